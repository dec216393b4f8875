"""Cohere (``model_type`` cohere: CohereForCausalLM, Command-R): LLaMA's weight names
(llama.py) on a parallel block with one norm, x + attn(ln(x)) + mlp(ln(x)):

- one ``input_layernorm`` per layer read by both the attention and the MLP
  (``norm.placement='parallel_shared'``), and one before the head; Cohere's LayerNorm has
  no bias and normalises in float32 (``norm.kind=layernorm``, ``norm.bias`` false,
  ``layer_norm_eps``);
- q/k/v/o projections with biases all or none (``attention_bias``; a missing one written
  as zeros), GQA, heads of ``head_dim`` where config.json sets one;
- a SwiGLU MLP, gate/up/down without biases (``ffn.kind=glu``);
- RoPE on whole heads in the interleaved layout: Cohere rotates adjacent pairs (2i, 2i + 1)
  (``position.rope_layout='interleaved'``, which import keeps as stored; LLaMA's RoPE
  scalings; CohereConfig's RoPE base without rope_theta is 500000, not 10000);
- ``logit_scale``: the logits multiplied by it (``logit_scale``, a product as transformers
  forms it, not a division by its inverse, which would round differently);
- a head tied to the embeddings by default (``tie_word_embeddings``).

``use_qk_norm`` (Command R+): a LayerNorm without bias over each query and key head's d_h
features, in float32, a weight of its own per head, (h, d_h) and (h_kv, d_h), eps
``layer_norm_eps``, after the projections and before RoPE and the cache
(``attention.qk_norm``, ``qk_norm_kind=layernorm``, ``qk_norm_weight=per_head``).
Export takes every decoder with a logit scale, and those with a parallel block of one
LayerNorm without bias read by a gated feed-forward that rotates whole heads (no other
exported layout holds either; a biased LayerNorm or a partial rotation there is
StableLM's, stablelm.py), and names what else Cohere lacks; split-halves q/k rows (and the
QK-norm weights with them) are permuted to Cohere's interleaved pairs.

Weights, HF (``model.layers.{i}.``) -> attnlab (``blocks.{i}.``), beyond llama.py's
attention and feed-forward:

    input_layernorm.weight (d,)  -> norm.weight   (the block's one norm)
    model.norm.weight      (d,)  -> norm.weight   (before the head)
    self_attn.q_norm.weight / k_norm.weight  (h, d_h), (h_kv, d_h)  -> attn.q_norm / k_norm

Shapes: d d_model, h heads, h_kv key/value heads, d_h head dim.
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
    number,
    rope_parameters,
    rope_rows_to_interleaved,
    rope_settings,
    rope_to_hf,
    unrepresentable,
)

ARCHITECTURES = {"cohere": ("CohereForCausalLM", "CohereModel")}
MODEL_TYPES = tuple(ARCHITECTURES)

# transformers' CohereConfig class defaults for the config.json keys read here (its
# num_key_value_heads, None, is num_attention_heads)
DEFAULTS: dict[str, dict[str, Any]] = {
    "cohere": {
        "vocab_size": 256000,
        "hidden_size": 8192,
        "intermediate_size": 22528,
        "logit_scale": 0.0625,
        "num_hidden_layers": 40,
        "num_attention_heads": 64,
        "hidden_act": "silu",
        "max_position_embeddings": 8192,
        "initializer_range": 0.02,
        "layer_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_qk_norm": False,
    }
}
DEFAULT_THETA = 500000.0  # CohereConfig.default_theta: the RoPE base without rope_theta
# Each layer's one norm, HF name -> attnlab name (the parallel block's shared norm)
NORMS = (("input_layernorm", "norm"),)

# --------------------------------------------------------------------------- configs


def config_from_hf(hf: dict[str, Any], model_type: str) -> ModelConfig:
    if hf.get("rope_theta") is None and rope_parameters(hf).get("rope_theta") is None:
        hf = {**hf, "rope_theta": DEFAULT_THETA}  # as CohereConfig fills it
    d, n_heads = get(hf, "hidden_size"), get(hf, "num_attention_heads")
    n_kv_heads = hf.get("num_key_value_heads") or n_heads
    # transformers' CohereAttention reads a head_dim config.json sets (getattr), else d / h
    head_dim = hf.get("head_dim") or d // n_heads
    bias = bool(hf.get("attention_bias", False))
    qk_norm = bool(hf.get("use_qk_norm", False))
    return ModelConfig(
        vocab_size=get(hf, "vocab_size"),
        max_seq_len=get(hf, "max_position_embeddings"),
        d_model=d,
        n_layers=get(hf, "num_hidden_layers"),
        attention=AttentionConfig(
            n_heads=n_heads,
            n_kv_heads=None if n_kv_heads == n_heads else n_kv_heads,
            head_dim=None if head_dim * n_heads == d else head_dim,
            qkv_bias=bias,
            out_bias=bias,
            dropout=hf.get("attention_dropout", 0.0),
            qk_norm=qk_norm,
            qk_norm_kind="layernorm" if qk_norm else "rmsnorm",
            qk_norm_weight="per_head" if qk_norm else "shared",
        ),
        position=PositionConfig(
            kind="rope", rope_layout="interleaved", **rope_settings(hf, llama.ROPE_TYPES)
        ),
        ffn=FFNConfig(
            kind="glu",
            activation=activation(hf.get("hidden_act", "silu"), "hidden_act"),
            hidden_dim=get(hf, "intermediate_size"),
            bias=False,
        ),
        norm=NormConfig(
            kind="layernorm",
            eps=number(hf, "layer_norm_eps"),
            bias=False,
            placement="parallel_shared",
        ),
        tie_embeddings=hf.get("tie_word_embeddings", True),
        logit_scale=number(hf, "logit_scale"),
        init_std=hf.get("initializer_range", 0.02),
    )


def cohere_features(cfg: ModelConfig) -> list[str]:
    """The fields of ``cfg`` set to what only Cohere has among the exported families."""
    return ["logit_scale"] if cfg.logit_scale != 1.0 else []


def exports(cfg: ModelConfig) -> bool:
    """Decoders with a logit scale, or a parallel block of one norm (``parallel_shared``)
    whose feed-forward is not a plain MLP (Phi's, GPT-J's and Falcon's are: phi.py, gptj.py,
    falcon.py): no other exported layout holds either. Without a logit scale, a LayerNorm
    with a bias or a partial rotation there are StableLM's (stablelm.py), not Cohere's."""
    shared = cfg.norm.placement == "parallel_shared" and cfg.ffn.kind != "mlp"
    stablelm = cfg.norm.kind == "layernorm" and (cfg.norm.bias or cfg.position.rope_fraction != 1.0)
    return cfg.arch == "decoder" and ((shared and not stablelm) or bool(cohere_features(cfg)))


def export_type(cfg: ModelConfig) -> str:
    """``cohere``, or HFCheckpointError naming the field Cohere has otherwise. QK-norm,
    windows, partial rotation, Granite's multipliers and other families' pieces are refused
    by ``convert`` for every family that lacks them."""
    att, ffn, pos, norm = cfg.attention, cfg.ffn, cfg.position, cfg.norm
    piece = (
        "norm.placement='parallel_shared'"
        if norm.placement == "parallel_shared"
        else cohere_features(cfg)[0]
    )

    def refuse(reason: str) -> HFCheckpointError:
        return unrepresentable(f"{reason}; {piece} exports as cohere only")

    for field, value, theirs in (
        ("attention.kind", att.kind, "mha"),
        ("position.kind", pos.kind, "rope"),
        ("norm.kind", norm.kind, "layernorm"),
        ("norm.placement", norm.placement, "parallel_shared"),
        ("ffn.kind", ffn.kind, "glu"),
    ):
        if value != theirs:
            raise refuse(f"{field}={value!r} (Cohere's is {theirs!r})")
    if norm.bias:
        raise refuse("norm.bias=true (Cohere's LayerNorms have no bias: set it to false)")
    if ffn.bias:
        raise refuse("ffn.bias=true (Cohere's MLP has no biases: set it to false)")
    if pos.rope_scaling not in (None, *llama.ROPE_TYPES):
        raise refuse(
            f"position.rope_scaling={pos.rope_scaling!r} (Cohere's: none, linear, llama3, yarn)"
        )
    hf_activation(ffn.activation)  # (refused by name if transformers has no such name)
    return "cohere"


def config_to_hf(cfg: ModelConfig, model_type: str, dtype: torch.dtype) -> dict[str, Any]:
    att, pos = cfg.attention, cfg.position
    rope = rope_to_hf(pos)
    return {
        **common_config(cfg, FAMILY, model_type, dtype),
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn.hidden_size(cfg.d_model),
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,  # (not a CohereConfig field: transformers reads it as set)
        "hidden_act": hf_activation(cfg.ffn.activation),
        "max_position_embeddings": cfg.max_seq_len,
        "layer_norm_eps": cfg.norm.eps,
        "logit_scale": cfg.logit_scale,
        "attention_bias": att.qkv_bias or att.out_bias,
        "attention_dropout": att.dropout,
        "use_qk_norm": att.qk_norm,
        "rope_theta": pos.rope_theta,  # transformers 4.x
        "rope_scaling": None if pos.rope_scaling is None else rope,
        "rope_parameters": rope,  # transformers 5.x
    }


# --------------------------------------------------------------------------- weights


def weights_to_attnlab(src: Source, cfg: ModelConfig) -> Plan:
    """llama.py's plan with one norm per layer (no biases: the config's LayerNorms have
    none); q/k rows as stored (interleaved pairs, as the imported config rotates them)."""
    return llama.weights_to_attnlab(src, cfg, NORMS)


def weights_from_attnlab(
    sd: dict[str, Tensor], cfg: ModelConfig, model_type: str
) -> dict[str, Tensor]:
    """llama.py's tensors (q, k, v and o biases all or none, zeros for a missing one; q/k
    rows in split halves), with the norms' biases (zeros: export_type refuses real ones)
    left out and the q/k rows, and the QK-norm weights per head, permuted to Cohere's
    interleaved pairs."""
    out = llama.weights_from_attnlab(sd, cfg, "llama", NORMS)
    for name in [n for n in out if n.endswith("norm.bias")]:  # (CohereLayerNorm has none)
        del out[name]
    for i in range(cfg.n_layers):
        h = f"model.layers.{i}.self_attn."
        for proj, heads in (("q_proj", cfg.n_heads), ("k_proj", cfg.n_kv_heads)):
            for kind in ("weight", "bias"):
                name = f"{h}{proj}.{kind}"
                if name in out:
                    out[name] = rope_rows_to_interleaved(out[name], heads, cfg.head_dim)
            norm = f"{h}{proj[0]}_norm.weight"  # (heads, d_h): each head's features
            if norm in out:
                w = out[norm]
                out[norm] = rope_rows_to_interleaved(w.reshape(-1), heads, w.shape[-1])
                out[norm] = out[norm].reshape(w.shape)
    return out


FAMILY = Family(
    name="cohere",
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
