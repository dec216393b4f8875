"""OLMo 2 (``model_type`` olmo2: Olmo2ForCausalLM): the LLaMA layout's embeddings, q/k/v/o
projections, SwiGLU feed-forward and untied head (llama.py) with OLMo 2's two pieces:

- no norm before the sublayers: an RMSNorm on each sublayer's output, inside its residual
  branch, x + norm(attn(x)) and x + norm(mlp(x)) (``norm.placement=post_sublayer``); the
  final norm before the head stays;
- QK-norm over the whole projections: one RMSNorm over all heads' queries at once (width
  h d_h) and one over the keys (h_kv d_h), before the split into heads and RoPE
  (``attention.qk_norm=true``, ``attention.qk_norm_scope=projection``), eps rms_norm_eps.

Biases (``attention_bias``) are on q, k, v and o all or none: attnlab's q/k/v and output
biases, a missing one written as zeros. RoPE scaling as LLaMA's (llama.py's types). Export
takes every decoder with one of these pieces (no other layout holds them) and names what
else OLMo 2 lacks.

Weights beyond llama.py's, HF (``model.layers.{i}.``) -> attnlab (``blocks.{i}.``):

    post_attention_layernorm     (d,)         -> attn_post_norm
    post_feedforward_layernorm   (d,)         -> ffn_post_norm
    self_attn.q_norm             (h d_h,)     -> attn.q_norm
    self_attn.k_norm             (h_kv d_h,)  -> attn.k_norm

(no ``input_layernorm``). Shapes: d d_model, h heads, h_kv key/value heads, d_h head dim.
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
    rope_settings,
    rope_to_hf,
    unrepresentable,
)

ARCHITECTURES = {"olmo2": ("Olmo2ForCausalLM", "Olmo2Model")}
MODEL_TYPES = tuple(ARCHITECTURES)

# transformers' Olmo2Config class defaults for the config.json keys read here (its
# num_key_value_heads, None, is num_attention_heads).
DEFAULTS: dict[str, dict[str, Any]] = {
    "olmo2": {
        "vocab_size": 50304,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rms_norm_eps": 1e-5,
    }
}

# --------------------------------------------------------------------------- configs


def config_from_hf(hf: dict[str, Any], model_type: str) -> ModelConfig:
    d, n_heads = get(hf, "hidden_size"), get(hf, "num_attention_heads")
    n_kv_heads = hf.get("num_key_value_heads") or n_heads
    # transformers' Olmo2Attention reads a head_dim config.json sets (getattr), else d / h
    head_dim = hf.get("head_dim") or d // n_heads
    attention_bias = bool(hf.get("attention_bias", False))
    return ModelConfig(
        vocab_size=get(hf, "vocab_size"),
        max_seq_len=get(hf, "max_position_embeddings"),
        d_model=d,
        n_layers=get(hf, "num_hidden_layers"),
        attention=AttentionConfig(
            n_heads=n_heads,
            n_kv_heads=None if n_kv_heads == n_heads else n_kv_heads,
            head_dim=None if head_dim * n_heads == d else head_dim,
            qkv_bias=attention_bias,
            out_bias=attention_bias,
            dropout=hf.get("attention_dropout", 0.0),
            qk_norm=True,
            qk_norm_scope="projection",
        ),
        position=PositionConfig(
            kind="rope", rope_layout="split", **rope_settings(hf, llama.ROPE_TYPES)
        ),
        ffn=FFNConfig(
            kind="glu",
            activation=activation(hf.get("hidden_act"), "hidden_act"),
            hidden_dim=get(hf, "intermediate_size"),
            bias=False,
        ),
        norm=NormConfig(kind="rmsnorm", eps=get(hf, "rms_norm_eps"), placement="post_sublayer"),
        tie_embeddings=hf.get("tie_word_embeddings", False),
        init_std=hf.get("initializer_range", 0.02),
    )


def olmo2_features(cfg: ModelConfig) -> list[str]:
    """The fields of ``cfg`` set to what only OLMo 2 has among the exported families."""
    found = []
    if cfg.norm.placement == "post_sublayer":
        found.append("norm.placement='post_sublayer'")
    if cfg.attention.qk_norm and cfg.attention.qk_norm_scope == "projection":
        found.append("attention.qk_norm_scope='projection'")
    return found


def exports(cfg: ModelConfig) -> bool:
    """Decoders with any of OLMo 2's own pieces (the other families' layouts would drop
    them)."""
    return cfg.arch == "decoder" and bool(olmo2_features(cfg))


def export_type(cfg: ModelConfig) -> str:
    """``olmo2``, or HFCheckpointError naming the field OLMo 2 has otherwise (and the OLMo 2
    piece that rules out every other layout). Windows, sinks and Gemma's pieces (a
    softmax scale, soft caps, ...) are refused by ``convert`` for every family that lacks
    them."""
    att, ffn, pos, norm = cfg.attention, cfg.ffn, cfg.position, cfg.norm
    piece = olmo2_features(cfg)[0]

    def refuse(reason: str) -> HFCheckpointError:
        return unrepresentable(f"{reason}; {piece} exports as olmo2 only")

    for field, value, theirs in (
        ("attention.kind", att.kind, "mha"),
        ("position.kind", pos.kind, "rope"),
        ("norm.kind", norm.kind, "rmsnorm"),
        ("norm.placement", norm.placement, "post_sublayer"),
        ("attention.qk_norm", att.qk_norm, True),
        ("attention.qk_norm_scope", att.qk_norm_scope, "projection"),
        ("ffn.kind", ffn.kind, "glu"),
        ("ffn.bias", ffn.bias, False),
    ):
        if value != theirs:
            raise refuse(f"{field}={value!r} (OLMo 2's is {theirs!r})")
    hf_activation(ffn.activation)  # (refused by name if transformers has no such name)
    return "olmo2"


def config_to_hf(cfg: ModelConfig, model_type: str, dtype: torch.dtype) -> dict[str, Any]:
    att = cfg.attention
    rope = rope_to_hf(cfg.position)
    return {
        **common_config(cfg, FAMILY, model_type, dtype),
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn.hidden_size(cfg.d_model),
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,  # (not an Olmo2Config field: transformers reads it as set)
        "hidden_act": hf_activation(cfg.ffn.activation),
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm.eps,
        "attention_bias": att.qkv_bias or att.out_bias,
        "attention_dropout": att.dropout,
        "rope_theta": cfg.position.rope_theta,  # transformers 4.x
        "rope_scaling": None if cfg.position.rope_scaling is None else rope,
        "rope_parameters": rope,  # transformers 5.x
    }


# --------------------------------------------------------------------------- weights

# OLMo 2's two norms per layer, on the sublayers' outputs: HF name -> attnlab name (in
# llama.py's place for LLaMA's pre-norms)
NORMS = (
    ("post_attention_layernorm", "attn_post_norm"),
    ("post_feedforward_layernorm", "ffn_post_norm"),
)


def weights_to_attnlab(src: Source, cfg: ModelConfig) -> Plan:
    """llama.py's plan with OLMo 2's norms (its QK-norm widths follow
    ``attention.qk_norm_scope``)."""
    return llama.weights_to_attnlab(src, cfg, norms=NORMS)


def weights_from_attnlab(
    sd: dict[str, Tensor], cfg: ModelConfig, model_type: str
) -> dict[str, Tensor]:
    """llama.py's tensors with OLMo 2's norms, biases as Qwen3's (q, k, v and o all or none,
    zeros for a missing one); interleaved RoPE rows, and each head's part of the QK-norm
    weights, permuted to split halves."""
    return llama.weights_from_attnlab(sd, cfg, "qwen3", norms=NORMS)


FAMILY = Family(
    name="olmo2",
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
