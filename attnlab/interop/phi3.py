"""Phi-3 (``model_type`` phi3: Phi3ForCausalLM): the LLaMA layout (llama.py) with q, k and v
in one projection and gate and up in another, LongRoPE, and a partial rotation:

- ``self_attn.qkv_proj`` holds q, k and v stacked on the output dimension, as attnlab's
  ``attn.qkv``; ``mlp.gate_up_proj`` gate then up, as ``ffn.gate_up`` (one tensor each,
  read and written as they are);
- LongRoPE (``rope_parameters`` of rope_type "longrope"; "su" and "yarn" are its older
  names, read as transformers reads them): pair i's frequency divided by
  ``short_factor[i]``, or by ``long_factor[i]`` for every position of a forward pass whose
  positions run past ``original_max_position_embeddings`` (a top-level key, which wins
  over the RoPE parameters' own); cos/sin times ``attention_factor``, else
  sqrt(1 + ln(s) / ln(original)) with s = ``factor``, else max_position_embeddings /
  original (``position.rope_scaling='longrope'``, ``rope_short_factor``,
  ``rope_long_factor``, ``rope_original_max_seq_len``, ``rope_factor``,
  ``rope_attention_factor``). transformers' generate re-encodes the sequence when it first
  runs past the original length (its cached keys were rotated by the short factors), and
  so does attnlab's;
- ``partial_rotary_factor`` (Phi-4-mini's 0.75): RoPE on the first int(head_dim * factor)
  features of each head (``position.rope_fraction``);
- ``sliding_window`` on every layer (Phi-3-mini-4k's 2047), as Mistral's.

No biases. ``resid_pdrop`` (dropout on each sublayer's output) is refused unless 0:
attnlab's ``dropout`` drops the embeddings too, which transformers' Phi-3 does not (it
never applies ``embd_pdrop``, which is ignored here too); ``attention_dropout`` is
``attention.dropout``.

Export: a LLaMA-shaped decoder stays ``llama`` (the wider-read layout); one with LongRoPE
or a partial rotation, which LLaMA's transformers model has not (its generate would not
re-encode at the switch), is written as ``phi3``.

Shapes: d d_model, h heads, h_kv key/value heads, d_h head dim, f feed-forward hidden size.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attnlab.config import AttentionConfig, FFNConfig, ModelConfig, NormConfig, PositionConfig
from attnlab.interop import llama
from attnlab.interop.io import (
    Family,
    HFCheckpointError,
    Plan,
    Source,
    activation,
    common_config,
    get,
    hf_activation,
    is_plain_decoder,
    local_layers,
    rope_parameters,
    rope_settings,
    rope_to_hf,
    unrepresentable,
)

ARCHITECTURES = {"phi3": ("Phi3ForCausalLM", "Phi3Model")}

# transformers' Phi3Config class defaults for the config.json keys read here
DEFAULTS: dict[str, dict[str, Any]] = {
    "phi3": {
        "vocab_size": 32064,
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "resid_pdrop": 0.0,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "original_max_position_embeddings": 4096,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    }
}
ROPE_TYPES = ("default", "longrope")
OLD_LONGROPE_NAMES = ("su", "yarn")  # Phi3Config reads these rope_types as longrope

# --------------------------------------------------------------------------- configs


def _rope(hf: dict[str, Any]) -> dict[str, Any]:
    """PositionConfig fields of a Phi-3 config.json. Phi3Config renames rope_type "su" and
    "yarn" to "longrope" after moving original_max_position_embeddings into the RoPE
    parameters (which it does for longrope only): for those the parameters' own wins."""
    params = rope_parameters(hf)
    kind = params.get("rope_type", params.get("type"))
    if kind in OLD_LONGROPE_NAMES:
        params = {k: v for k, v in params.items() if k != "type"} | {"rope_type": "longrope"}
        own = params.get("original_max_position_embeddings")
        hf = {**hf, "original_max_position_embeddings": own or hf.get(
            "original_max_position_embeddings")}  # fmt: skip
    return rope_settings(
        {**hf, "rope_scaling": None, "rope_parameters": params}, ROPE_TYPES, partial=True
    )


def config_from_hf(hf: dict[str, Any], model_type: str) -> ModelConfig:
    resid = hf.get("resid_pdrop", 0.0)
    if resid:
        raise HFCheckpointError(
            f"config.json resid_pdrop={resid!r} is not supported: attnlab's dropout also drops "
            "the embeddings, which transformers' Phi-3 does not; set it to 0.0"
        )
    d, n_heads = get(hf, "hidden_size"), get(hf, "num_attention_heads")
    n_kv_heads = hf.get("num_key_value_heads") or n_heads
    head_dim = hf.get("head_dim") or d // n_heads
    return ModelConfig(
        vocab_size=get(hf, "vocab_size"),
        max_seq_len=get(hf, "max_position_embeddings"),
        d_model=d,
        n_layers=get(hf, "num_hidden_layers"),
        attention=AttentionConfig(
            n_heads=n_heads,
            n_kv_heads=None if n_kv_heads == n_heads else n_kv_heads,
            head_dim=None if head_dim * n_heads == d else head_dim,
            qkv_bias=False,
            out_bias=False,
            dropout=hf.get("attention_dropout", 0.0),
            sliding_window=hf.get("sliding_window"),
        ),
        position=PositionConfig(kind="rope", rope_layout="split", **_rope(hf)),
        ffn=FFNConfig(
            kind="glu",
            activation=activation(hf.get("hidden_act", "silu"), "hidden_act"),
            hidden_dim=get(hf, "intermediate_size"),
            bias=False,
        ),
        norm=NormConfig(kind="rmsnorm", eps=hf.get("rms_norm_eps", 1e-5)),
        tie_embeddings=hf.get("tie_word_embeddings", False),
        init_std=hf.get("initializer_range", 0.02),
    )


def exports(cfg: ModelConfig) -> bool:
    """Dense RoPE decoders with LongRoPE or a partial rotation (LLaMA's layout has
    neither); other LLaMA-shaped configs export as llama."""
    pos = cfg.position
    return (
        is_plain_decoder(cfg)
        and pos.kind == "rope"
        and cfg.ffn.kind != "moe"
        and (pos.rope_scaling == "longrope" or pos.rope_fraction != 1.0)
    )


def export_type(cfg: ModelConfig) -> str:
    """``phi3``, or HFCheckpointError naming the field Phi-3 has otherwise."""
    att, pos = cfg.attention, cfg.position
    piece = "position.rope_scaling='longrope'" if pos.rope_scaling == "longrope" else (
        "position.rope_fraction")  # fmt: skip

    def refuse(reason: str) -> HFCheckpointError:
        return unrepresentable(f"{reason}; {piece} exports as phi3 only")

    for field, value, theirs in (
        ("norm.kind", cfg.norm.kind, "rmsnorm"),
        ("ffn.kind", cfg.ffn.kind, "glu"),
        ("attention.qkv_bias", att.qkv_bias, False),
        ("attention.out_bias", att.out_bias, False),
        ("ffn.bias", cfg.ffn.bias, False),
    ):
        if value != theirs:
            raise refuse(f"{field}={value!r} (Phi-3's is {theirs!r})")
    if pos.rope_scaling not in (None, "longrope"):
        raise refuse(f"position.rope_scaling={pos.rope_scaling!r} (Phi-3's: none or longrope)")
    if pos.rope_scaling == "longrope" and cfg.head_dim * cfg.n_heads != cfg.d_model:
        raise refuse(
            f"attention.head_dim={cfg.head_dim} with LongRoPE (transformers' Phi3Config checks "
            "the factors against heads of hidden_size / num_attention_heads)"
        )
    local = local_layers(cfg)
    if any(local) and not all(local):
        raise refuse("local and global layers (attention.layer_pattern; Phi-3 windows all)")
    hf_activation(cfg.ffn.activation)  # (refused by name if transformers has no such name)
    return "phi3"


def _transformers_4_rope(cfg: ModelConfig) -> dict[str, Any] | None:
    """transformers 4.x's rope_scaling, which holds only type, short_factor and long_factor
    (its Phi3Config refuses other keys) and derives the attention factor from the
    contexts; None when the model's LongRoPE needs more (transformers 5 then reads the
    full RoPE parameters)."""
    pos = cfg.position
    ratio = cfg.max_seq_len / pos.rope_original_max_seq_len
    if pos.rope_attention_factor is not None or pos.rope_factor != ratio:
        return None
    return {"type": "longrope", "short_factor": pos.rope_short_factor,
            "long_factor": pos.rope_long_factor}  # fmt: skip


def config_to_hf(cfg: ModelConfig, model_type: str, dtype: torch.dtype) -> dict[str, Any]:
    att, pos = cfg.attention, cfg.position
    rope = rope_to_hf(pos)
    longrope = pos.rope_scaling == "longrope"
    # transformers 5 reads rope_scaling first: the 4.x form where it means the same
    scaling = (_transformers_4_rope(cfg) or rope) if longrope else None
    return {
        **common_config(cfg, FAMILY, model_type, dtype),
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn.hidden_size(cfg.d_model),
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,  # (transformers 5; 4.x takes hidden_size / heads)
        "hidden_act": hf_activation(cfg.ffn.activation),
        "max_position_embeddings": cfg.max_seq_len,
        "original_max_position_embeddings": (
            pos.rope_original_max_seq_len if longrope else cfg.max_seq_len
        ),
        "rms_norm_eps": cfg.norm.eps,
        "attention_dropout": att.dropout,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "sliding_window": att.sliding_window if any(local_layers(cfg)) else None,
        "partial_rotary_factor": pos.rope_fraction,  # transformers 4.x
        "rope_theta": pos.rope_theta,  # transformers 4.x
        "rope_scaling": scaling,
        "rope_parameters": rope,  # transformers 5.x
    }


# --------------------------------------------------------------------------- weights


def weights_to_attnlab(src: Source, cfg: ModelConfig) -> Plan:
    return llama.weights_to_attnlab(src, cfg, fused=True)


def weights_from_attnlab(
    sd: dict[str, Tensor], cfg: ModelConfig, model_type: str
) -> dict[str, Tensor]:
    return llama.weights_from_attnlab(sd, cfg, model_type, fused=True)


FAMILY = Family(
    name="phi3",
    arch="decoder",
    architectures=ARCHITECTURES,
    config_from_hf=config_from_hf,
    defaults=DEFAULTS,
    config_to_hf=config_to_hf,
    weights_to_attnlab=weights_to_attnlab,
    weights_from_attnlab=weights_from_attnlab,
    exports=exports,
    export_type=export_type,
    ignored=llama.IGNORED,
)
