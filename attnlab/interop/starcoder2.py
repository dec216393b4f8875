"""StarCoder2 (``model_type`` starcoder2: Starcoder2ForCausalLM): the LLaMA layout's
embeddings, q/k/v/o projections and weight names (llama.py) with GPT-2's other pieces:

- LayerNorms with biases (``norm_epsilon``) before each sublayer and before the head
  (``norm.kind=layernorm``, ``norm.bias``);
- a non-gated MLP ``c_fc`` -> activation (``hidden_act``, gelu_pytorch_tanh) -> ``c_proj``
  (``ffn.kind=mlp``);
- ``use_bias``: biases on q, k, v, o, c_fc and c_proj all or none (a missing one written as
  zeros on export);
- GQA, RoPE on whole heads (split halves; LLaMA's scalings), and a sliding window on every
  layer when ``sliding_window`` is set (null: full attention).

Dropout: attnlab has one dropout for the embeddings and the residual branches, read from
``residual_dropout``; an ``embedding_dropout`` that differs loads with a warning, as Phi's
and GPT-J's (``io.one_dropout``; training only, the published models set both alike).
Export takes the plain RoPE decoders with LayerNorm and an MLP (LLaMA's layout has RMSNorm
and a gated feed-forward) and names what else StarCoder2 lacks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attnlab.config import AttentionConfig, FFNConfig, ModelConfig, NormConfig, PositionConfig
from attnlab.interop import llama
from attnlab.interop.io import (
    Family,
    Plan,
    Source,
    activation,
    common_config,
    get,
    hf_activation,
    is_plain_decoder,
    local_layers,
    one_dropout,
    rope_settings,
    rope_to_hf,
    unrepresentable,
)

ARCHITECTURES = {"starcoder2": ("Starcoder2ForCausalLM", "Starcoder2Model")}
MODEL_TYPES = tuple(ARCHITECTURES)

# transformers' Starcoder2Config class defaults for the config.json keys read here
# (sliding_window, None there, is left out: read as missing, full attention).
DEFAULTS: dict[str, dict[str, Any]] = {
    "starcoder2": {
        "vocab_size": 49152,
        "hidden_size": 3072,
        "intermediate_size": 12288,
        "num_hidden_layers": 30,
        "num_attention_heads": 24,
        "num_key_value_heads": 2,
        "hidden_act": "gelu_pytorch_tanh",
        "max_position_embeddings": 4096,
        "initializer_range": 0.018042,
        "norm_epsilon": 1e-5,
        "attention_dropout": 0.0,
        "residual_dropout": 0.0,
        "embedding_dropout": 0.0,
        "use_bias": True,
        "tie_word_embeddings": True,
    }
}

# --------------------------------------------------------------------------- configs


def config_from_hf(hf: dict[str, Any], model_type: str) -> ModelConfig:
    d, n_heads = get(hf, "hidden_size"), get(hf, "num_attention_heads")
    n_kv_heads = hf.get("num_key_value_heads") or n_heads
    # transformers' Starcoder2Attention reads a head_dim config.json sets (getattr), else d / h
    head_dim = hf.get("head_dim") or d // n_heads
    residual = one_dropout(hf, "residual_dropout", "embedding_dropout")
    bias = bool(hf.get("use_bias", True))
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
            sliding_window=hf.get("sliding_window"),
        ),
        position=PositionConfig(
            kind="rope", rope_layout="split", **rope_settings(hf, llama.ROPE_TYPES)
        ),
        ffn=FFNConfig(
            kind="mlp",
            activation=activation(hf.get("hidden_act"), "hidden_act"),
            hidden_dim=get(hf, "intermediate_size"),
            bias=bias,
        ),
        # (nn.LayerNorm: biased whatever use_bias says)
        norm=NormConfig(kind="layernorm", eps=get(hf, "norm_epsilon"), bias=True),
        tie_embeddings=hf.get("tie_word_embeddings", True),
        dropout=residual,
        init_std=hf.get("initializer_range", 0.02),
    )


def exports(cfg: ModelConfig) -> bool:
    """Plain RoPE decoders with LayerNorm and a non-gated MLP (LLaMA's layout has RMSNorm
    and a gated feed-forward)."""
    return (
        is_plain_decoder(cfg)
        and cfg.position.kind == "rope"
        and cfg.norm.kind == "layernorm"
        and cfg.ffn.kind == "mlp"
    )


def export_type(cfg: ModelConfig) -> str:
    """``starcoder2``, or HFCheckpointError naming what StarCoder2 lacks: a window on some
    layers only. QK-norm, partial rotation, NoPE layers, sinks and other families' pieces
    are refused by ``convert`` for every family that lacks them."""
    local = local_layers(cfg)
    if any(local) and not all(local):
        raise unrepresentable(
            "local and global layers (attention.layer_pattern): StarCoder2 windows every "
            "layer or none"
        )
    hf_activation(cfg.ffn.activation)  # (refused by name if transformers has no such name)
    return "starcoder2"


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
        "head_dim": cfg.head_dim,  # (not a Starcoder2Config field: transformers reads it as set)
        "hidden_act": hf_activation(cfg.ffn.activation),
        "max_position_embeddings": cfg.max_seq_len,
        "norm_epsilon": cfg.norm.eps,
        "use_bias": att.qkv_bias or att.out_bias or cfg.ffn.bias,
        "attention_dropout": att.dropout,
        "residual_dropout": cfg.dropout,
        "embedding_dropout": cfg.dropout,
        "sliding_window": att.sliding_window if any(local_layers(cfg)) else None,
        "rope_theta": pos.rope_theta,  # transformers 4.x
        "rope_scaling": None if pos.rope_scaling is None else rope,
        "rope_parameters": rope,  # transformers 5.x
    }


# --------------------------------------------------------------------------- weights


def weights_to_attnlab(src: Source, cfg: ModelConfig) -> Plan:
    """llama.py's plan: its attention and embeddings, the MLP's c_fc and c_proj, the
    LayerNorms' weights and biases."""
    return llama.weights_to_attnlab(src, cfg)


def weights_from_attnlab(
    sd: dict[str, Tensor], cfg: ModelConfig, model_type: str
) -> dict[str, Tensor]:
    """llama.py's tensors with StarCoder2's biases (every projection's or none, zeros for a
    missing one; the LayerNorms' always); interleaved RoPE rows permuted to split halves."""
    return llama.weights_from_attnlab(sd, cfg, "starcoder2")


FAMILY = Family(
    name="starcoder2",
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
