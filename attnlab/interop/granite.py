"""Granite (``model_type`` granite: GraniteForCausalLM): the LLaMA layout (llama.py's
config keys, embeddings, q/k/v/o projections, SwiGLU feed-forward, pre-norm RMSNorms and
weight names) with four scalars (muP), each where transformers' Granite applies it:

- ``embedding_multiplier``: the token embeddings times it, before the first layer
  (``embedding_multiplier``);
- ``residual_multiplier``: each sublayer's output times it before its residual add,
  x + m attn(norm(x)), then x + m mlp(norm(x)) (``residual_multiplier``);
- ``attention_multiplier``: the softmax scale of q . k in place of 1 / sqrt(d_h)
  (``attention.scale``; GraniteConfig's default is 1.0, not 1 / sqrt(d_h));
- ``logits_scaling``: the output logits divided by it (``logit_divisor``).

Biases: ``attention_bias`` on q, k, v and o all or none (a missing one written as zeros),
``mlp_bias`` on gate, up and down. RoPE scaling as LLaMA's (llama.py's types). Export takes
every decoder with one of the three multipliers other than 1 (no other layout holds them)
and the LLaMA-shaped ones with a softmax scale of their own and none of Gemma's other
pieces, and names what else Granite lacks.

Shapes: d d_model, h heads, d_h head dim.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from attnlab.config import SCALAR_MULTIPLIERS, ModelConfig
from attnlab.interop import llama
from attnlab.interop.gemma import gemma_features
from attnlab.interop.io import (
    Family,
    HFCheckpointError,
    Plan,
    Source,
    common_config,
    hf_activation,
    is_plain_decoder,
    number,
    rope_to_hf,
    unrepresentable,
)

ARCHITECTURES = {"granite": ("GraniteForCausalLM", "GraniteModel")}
MODEL_TYPES = tuple(ARCHITECTURES)

# transformers' GraniteConfig class defaults for the config.json keys read here (its
# num_key_value_heads, None, is num_attention_heads).
DEFAULTS: dict[str, dict[str, Any]] = {
    "granite": {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "embedding_multiplier": 1.0,
        "logits_scaling": 1.0,
        "residual_multiplier": 1.0,
        "attention_multiplier": 1.0,
    }
}

# config.json key -> attnlab field of the three scalars outside the attention
SCALARS = {
    "embedding_multiplier": "embedding_multiplier",
    "residual_multiplier": "residual_multiplier",
    "logits_scaling": "logit_divisor",
}

# --------------------------------------------------------------------------- configs


def config_from_hf(hf: dict[str, Any], model_type: str) -> ModelConfig:
    """LLaMA's config (llama.py: biases as attention_bias and mlp_bias say) with Granite's
    four scalars."""
    cfg = llama.config_from_hf(hf, "llama")
    return cfg.override(
        {
            "attention.scale": number(hf, "attention_multiplier"),
            **{ours: number(hf, key) for key, ours in SCALARS.items()},
        }
    )


def granite_features(cfg: ModelConfig) -> list[str]:
    """The fields of ``cfg`` set to what only Granite has among the exported families."""
    return [name for name in SCALAR_MULTIPLIERS if getattr(cfg, name) != 1.0]


def _llama_shaped(cfg: ModelConfig) -> bool:
    return (
        is_plain_decoder(cfg)
        and cfg.position.kind == "rope"
        and cfg.norm.kind == "rmsnorm"
        and cfg.ffn.kind == "glu"
    )


def exports(cfg: ModelConfig) -> bool:
    """Decoders with any of Granite's multipliers, and LLaMA-shaped ones whose only piece
    beyond LLaMA's is a softmax scale of their own (which Gemma's layouts hold only with
    their other pieces)."""
    if cfg.arch != "decoder":
        return False
    return bool(granite_features(cfg)) or (
        _llama_shaped(cfg) and gemma_features(cfg) == ["attention.scale"]
    )


def export_type(cfg: ModelConfig) -> str:
    """``granite``, or HFCheckpointError naming the field Granite has otherwise. Windows,
    QK-norm, sinks and other families' pieces are refused by ``convert`` for every family
    that lacks them."""
    att, ffn, pos, norm = cfg.attention, cfg.ffn, cfg.position, cfg.norm
    piece = (granite_features(cfg) or ["attention.scale"])[0]

    def refuse(reason: str) -> HFCheckpointError:
        return unrepresentable(f"{reason}; {piece} exports as granite only")

    for field, value, theirs in (
        ("attention.kind", att.kind, "mha"),
        ("position.kind", pos.kind, "rope"),
        ("norm.kind", norm.kind, "rmsnorm"),
        ("norm.placement", norm.placement, "pre"),
        ("ffn.kind", ffn.kind, "glu"),
    ):
        if value != theirs:
            raise refuse(f"{field}={value!r} (Granite's is {theirs!r})")
    hf_activation(ffn.activation)  # (refused by name if transformers has no such name)
    return "granite"


def attention_multiplier(cfg: ModelConfig) -> float:
    """Granite's softmax scale: attention.scale, else attnlab's 1 / sqrt(d_h), the same
    float."""
    scale = cfg.attention.scale
    return 1.0 / math.sqrt(cfg.head_dim) if scale is None else scale


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
        "head_dim": cfg.head_dim,  # (not a GraniteConfig field: transformers reads it as set)
        "hidden_act": hf_activation(cfg.ffn.activation),
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm.eps,
        "attention_bias": att.qkv_bias or att.out_bias,
        "attention_dropout": att.dropout,
        "mlp_bias": cfg.ffn.bias,
        "attention_multiplier": attention_multiplier(cfg),
        **{key: getattr(cfg, ours) for key, ours in SCALARS.items()},
        "rope_theta": pos.rope_theta,  # transformers 4.x
        "rope_scaling": None if pos.rope_scaling is None else rope,
        "rope_parameters": rope,  # transformers 5.x
    }


# --------------------------------------------------------------------------- weights


def weights_to_attnlab(src: Source, cfg: ModelConfig) -> Plan:
    """llama.py's plan: Granite's weights have LLaMA's names and shapes."""
    return llama.weights_to_attnlab(src, cfg)


def weights_from_attnlab(
    sd: dict[str, Tensor], cfg: ModelConfig, model_type: str
) -> dict[str, Tensor]:
    """llama.py's tensors with LLaMA's biases (q, k, v and o all or none, zeros for a
    missing one; gate, up and down by ffn.bias); interleaved RoPE rows permuted to split
    halves."""
    return llama.weights_from_attnlab(sd, cfg, "llama")


FAMILY = Family(
    name="granite",
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
