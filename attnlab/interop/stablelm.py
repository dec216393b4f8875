"""StableLM (``model_type`` stablelm: StableLmForCausalLM; StableLM-3B-4E1T, StableLM 2):
LLaMA's weight names (llama.py) on LayerNorms with biases and a partial rotation:

- pre-norm blocks, x + attn(ln1(x)) then x + mlp(ln2(x)), or with ``use_parallel_residual``
  (StableLM 2 12B) x + attn(ln(x)) + mlp(ln(x)) on one ``input_layernorm`` both read
  (``norm.placement='parallel_shared'``); every LayerNorm with a bias, eps ``layer_norm_eps``
  (``norm.kind=layernorm``);
- q/k/v projections with biases where ``use_qkv_bias`` says (``attention.qkv_bias``),
  ``o_proj`` without, GQA; heads of hidden_size / num_attention_heads (StableLmAttention
  takes no head_dim of its own);
- a SwiGLU MLP, gate/up/down without biases (``ffn.kind=glu``, ``hidden_act``);
- RoPE on the first int(head_dim * partial_rotary_factor) features of each head in
  rotate-half pairs (``position.rope_fraction``, split layout): the RoPE parameters' own
  factor, else the top-level key, else 0.25 (StableLmConfig's); linear scaling too;
- ``qk_layernorm`` (StableLM 2 12B): a LayerNorm without bias of each query and each key
  head's d_h features, a weight of its own per head (StableLmLayerNormPerHead: one
  nn.LayerNorm per head), eps ``layer_norm_eps``, after the projections and before RoPE and
  the cache (``attention.qk_norm``, ``qk_norm_kind=layernorm``, ``qk_norm_weight=per_head``);
- ``model.norm`` then ``lm_head`` without a bias, untied by default.

Dropout: ``hidden_dropout`` drops the MLP's output only, attnlab's one dropout each
sublayer's output and the embeddings: a nonzero one is read as attnlab's with a warning
(training only). Export takes the RoPE decoders with LayerNorm and a gated feed-forward in
pre-norm blocks (no other exported layout holds them) and, in parallel blocks of one norm,
those Cohere's layout cannot hold (a LayerNorm with a bias, a partial rotation); missing
LayerNorm biases are written as zeros, interleaved q/k rows (and the QK-norm weights with
them) permuted to rotate-half.

Weights, HF (``model.layers.{i}.``) -> attnlab (``blocks.{i}.``), beyond llama.py's
attention and feed-forward (every LayerNorm with its bias):

    input_layernorm, post_attention_layernorm (d,)  -> attn_norm, ffn_norm  (pre-norm)
    input_layernorm                            (d,)  -> norm                 (parallel)
    self_attn.q_layernorm.norms.{j}.weight   (d_h,)  -> attn.q_norm.weight[j]   (h of them)
    self_attn.k_layernorm.norms.{j}.weight   (d_h,)  -> attn.k_norm.weight[j]   (h_kv)
    model.norm (d,) -> norm

Shapes: d d_model, h heads, h_kv key/value heads, d_h head dim.
"""

from __future__ import annotations

import warnings
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
    cat,
    common_config,
    get,
    hf_activation,
    number,
    prefix,
    rope_rows_to_split,
    rope_settings,
    rope_to_hf,
    unrepresentable,
)

ARCHITECTURES = {"stablelm": ("StableLmForCausalLM", "StableLmModel")}
MODEL_TYPES = tuple(ARCHITECTURES)

# transformers' StableLmConfig class defaults for the config.json keys read here
# (StableLM-3B-4E1T's sizes)
DEFAULTS: dict[str, dict[str, Any]] = {
    "stablelm": {
        "vocab_size": 50304,
        "intermediate_size": 6912,
        "hidden_size": 2560,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "initializer_range": 0.02,
        "layer_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "use_qkv_bias": False,
        "qk_layernorm": False,
        "use_parallel_residual": False,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
    }
}
# StableLmConfig's fraction of each head rotated where neither config.json nor its RoPE
# parameters give one (set in its __post_init__, not a class default)
PARTIAL_ROTARY_FACTOR = 0.25
ROPE_TYPES = ("default", "linear")
# Each layer's norms, HF name -> attnlab name: two in pre-norm blocks, one in parallel ones
NORMS = llama.NORMS
PARALLEL_NORMS = (("input_layernorm", "norm"),)
# QK-norm, HF name (a ModuleList of one LayerNorm per head) -> attnlab name
QK_NORMS = (("q_layernorm", "q_norm"), ("k_layernorm", "k_norm"))

# --------------------------------------------------------------------------- configs


def config_from_hf(hf: dict[str, Any], model_type: str = "stablelm") -> ModelConfig:
    d, n_heads = get(hf, "hidden_size"), get(hf, "num_attention_heads")
    n_kv_heads = hf.get("num_key_value_heads") or n_heads
    if hf.get("head_dim") not in (None, d // n_heads):
        raise HFCheckpointError(
            f"config.json head_dim={hf['head_dim']}: StableLM's attention has heads of "
            f"hidden_size / num_attention_heads = {d // n_heads} (its RoPE would read the "
            "other); drop head_dim"
        )
    fraction = hf.get("partial_rotary_factor", PARTIAL_ROTARY_FACTOR)
    rope = rope_settings({**hf, "partial_rotary_factor": fraction}, ROPE_TYPES, partial=True)
    dropout = hf.get("hidden_dropout") or 0.0
    if dropout:
        warnings.warn(
            f"config.json hidden_dropout={dropout} drops StableLM's MLP output only: attnlab "
            "drops each sublayer's output and the embeddings at it (training only; evaluation "
            "and generation are unaffected)",
            stacklevel=3,
        )
    qk_norm = bool(hf.get("qk_layernorm"))
    parallel = bool(hf.get("use_parallel_residual"))
    return ModelConfig(
        vocab_size=get(hf, "vocab_size"),
        max_seq_len=get(hf, "max_position_embeddings"),
        d_model=d,
        n_layers=get(hf, "num_hidden_layers"),
        attention=AttentionConfig(
            n_heads=n_heads,
            n_kv_heads=None if n_kv_heads == n_heads else n_kv_heads,
            qkv_bias=bool(hf.get("use_qkv_bias")),
            out_bias=False,
            dropout=hf.get("attention_dropout") or 0.0,
            qk_norm=qk_norm,
            qk_norm_kind="layernorm" if qk_norm else "rmsnorm",
            qk_norm_weight="per_head" if qk_norm else "shared",
        ),
        position=PositionConfig(kind="rope", rope_layout="split", **rope),
        ffn=FFNConfig(
            kind="glu",
            activation=activation(hf.get("hidden_act"), "hidden_act"),
            hidden_dim=get(hf, "intermediate_size"),
            bias=False,
        ),
        norm=NormConfig(
            kind="layernorm",
            eps=number(hf, "layer_norm_eps"),
            bias=True,
            placement="parallel_shared" if parallel else "pre",
        ),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        dropout=dropout,
        init_std=hf.get("initializer_range", 0.02),
    )


def exports(cfg: ModelConfig) -> bool:
    """RoPE decoders with LayerNorm and a gated feed-forward in pre-norm blocks (LLaMA's and
    Phi-3's layouts need RMSNorm), or in parallel blocks of one norm that Cohere's layout
    cannot hold (cohere.py, earlier in the registry, takes the others: a LayerNorm without
    bias, whole heads rotated)."""
    return (
        cfg.arch == "decoder"
        and cfg.attention.kind == "mha"
        and cfg.position.kind == "rope"
        and cfg.norm.kind == "layernorm"
        and cfg.ffn.kind == "glu"
        and cfg.norm.placement in ("pre", "parallel_shared")
    )


def export_type(cfg: ModelConfig) -> str:
    """``stablelm``, or HFCheckpointError naming what StableLM has not (missing LayerNorm
    biases are written as zeros; QK-norms other than its own, windows, a head bias and
    other families' pieces are refused by ``convert``)."""
    att, ffn, pos = cfg.attention, cfg.ffn, cfg.position

    def refuse(reason: str) -> HFCheckpointError:
        return unrepresentable(
            f"{reason}; RoPE decoders with LayerNorm and a gated feed-forward export as stablelm"
        )

    if att.out_bias:
        raise refuse("attention.out_bias=true (StableLM's o_proj has no bias: set it to false)")
    if ffn.bias:
        raise refuse("ffn.bias=true (StableLM's MLP has no biases: set it to false)")
    if cfg.head_dim * cfg.n_heads != cfg.d_model:
        raise refuse(
            f"attention.head_dim={cfg.head_dim} (StableLM's heads are d_model / n_heads = "
            f"{cfg.d_model // cfg.n_heads} wide)"
        )
    if pos.rope_scaling not in (None, "linear"):
        raise refuse(f"position.rope_scaling={pos.rope_scaling!r} (StableLM's: none or linear)")
    hf_activation(ffn.activation)  # (refused by name if transformers has no such name)
    return "stablelm"


def config_to_hf(cfg: ModelConfig, model_type: str, dtype: torch.dtype) -> dict[str, Any]:
    att, pos = cfg.attention, cfg.position
    # written even when 1.0: StableLmConfig's default is 0.25
    rope = {**rope_to_hf(pos), "partial_rotary_factor": pos.rope_fraction}
    return {
        **common_config(cfg, FAMILY, model_type, dtype),
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn.hidden_size(cfg.d_model),
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "hidden_act": hf_activation(cfg.ffn.activation),
        "max_position_embeddings": cfg.max_seq_len,
        "layer_norm_eps": cfg.norm.eps,
        "use_qkv_bias": att.qkv_bias,
        "qk_layernorm": att.qk_norm,
        "use_parallel_residual": cfg.norm.placement == "parallel_shared",
        "hidden_dropout": cfg.dropout,
        "attention_dropout": att.dropout,
        "partial_rotary_factor": pos.rope_fraction,  # transformers 4.x
        "rope_theta": pos.rope_theta,  # transformers 4.x
        "rope_scaling": (
            None if pos.rope_scaling is None else {"type": "linear", "factor": pos.rope_factor}
        ),
        "rope_parameters": rope,  # transformers 5.x
    }


# --------------------------------------------------------------------------- weights


def _norms(cfg: ModelConfig) -> tuple[tuple[str, str], ...]:
    return PARALLEL_NORMS if cfg.norm.placement == "parallel_shared" else NORMS


def _without_qk_norm(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` for llama.py's mapping, which knows QK-norm by Qwen3's names only: the
    per-head LayerNorms are mapped here."""
    return cfg.override(
        {
            "attention.qk_norm": False,
            "attention.qk_norm_kind": "rmsnorm",
            "attention.qk_norm_weight": "shared",
        }
    )


def weights_to_attnlab(src: Source, cfg: ModelConfig) -> Plan:
    """llama.py's plan (LayerNorm biases, q/k/v biases where the config has them), with
    each head's QK LayerNorm weight one row of attnlab's (h, d_h) weight."""
    p = prefix(src, "model.", "embed_tokens.weight")  # (before llama.py takes that tensor)
    out = llama.weights_to_attnlab(src, _without_qk_norm(cfg), _norms(cfg))
    if cfg.attention.qk_norm:
        for i in range(cfg.n_layers):
            h = f"{p}layers.{i}.self_attn."
            for (theirs, ours), heads in zip(QK_NORMS, (cfg.n_heads, cfg.n_kv_heads), strict=True):
                out[f"blocks.{i}.attn.{ours}.weight"] = cat(
                    src.take(f"{h}{theirs}.norms.{j}.weight", (cfg.head_dim,)) for j in range(heads)
                )
    return out


def weights_from_attnlab(
    sd: dict[str, Tensor], cfg: ModelConfig, model_type: str
) -> dict[str, Tensor]:
    """llama.py's tensors (LayerNorm biases, zeros where attnlab has none; q/k rows in
    split halves) without an o_proj bias (export_type refuses one), and each head's QK
    LayerNorm weight, permuted as the q/k rows are."""
    out = llama.weights_from_attnlab(sd, _without_qk_norm(cfg), "llama", _norms(cfg))
    interleaved = cfg.position.rope_layout == "interleaved"
    for i in range(cfg.n_layers):
        h, a = f"model.layers.{i}.self_attn.", f"blocks.{i}.attn."
        out.pop(h + "o_proj.bias", None)  # (llama.py writes q, k, v and o biases together)
        if not cfg.attention.qk_norm:
            continue
        for (theirs, ours), heads in zip(QK_NORMS, (cfg.n_heads, cfg.n_kv_heads), strict=True):
            w = sd[f"{a}{ours}.weight"]  # (heads, d_h)
            if interleaved:  # per feature within a head: permuted as the q/k rows are
                flat = rope_rows_to_split(w.reshape(-1), heads, cfg.head_dim, cfg.rope_dim)
                w = flat.reshape(w.shape)
            for j in range(heads):
                out[f"{h}{theirs}.norms.{j}.weight"] = w[j].contiguous()
    return out


FAMILY = Family(
    name="stablelm",
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
