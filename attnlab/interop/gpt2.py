"""GPT-2 (``model_type`` gpt2): learned positions, LayerNorm, MLP, biases everywhere.

Weights: GPT-2 uses Conv1D layers, which store (in, out); attnlab Linear weights are
(out, in), like ``torch.nn.Linear``:

    c_attn   -> attn.qkv  (transposed; rows [q; k; v])
    c_proj   -> attn.out, mlp.c_fc -> ffn.up, mlp.c_proj -> ffn.down   (transposed)

Shapes: d d_model, f feed-forward hidden size, V vocabulary size, L max positions.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import Tensor

from attnlab.config import AttentionConfig, FFNConfig, ModelConfig, NormConfig, PositionConfig
from attnlab.interop import io
from attnlab.interop.io import (
    Family,
    HFCheckpointError,
    Part,
    Plan,
    Source,
    activation,
    common_config,
    get,
    is_plain_decoder,
    or_zeros,
    prefix,
    unrepresentable,
)

ARCHITECTURES = {"gpt2": ("GPT2LMHeadModel", "GPT2Model")}

# transformers' class defaults (GPT2Config) for the config.json keys read here (Family.defaults).
DEFAULTS: dict[str, dict[str, Any]] = {
    "gpt2": {
        "vocab_size": 50257,
        "n_positions": 1024,
        "n_embd": 768,
        "n_layer": 12,
        "n_head": 12,
        "activation_function": "gelu_new",
        "resid_pdrop": 0.1,
        "attn_pdrop": 0.1,
        "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02,
        "tie_word_embeddings": True,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "add_cross_attention": False,
    },
}

# attnlab -> Hugging Face activation names (GPT-2 checkpoints use "gelu_new" for tanh GELU).
ACTIVATIONS = {**io.TO_HF_ACTIVATIONS, "gelu_tanh": "gelu_new"}
# Causal-mask tables that older transformers versions saved.
IGNORED = re.compile(r"^(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)$")


def config_from_hf(hf: dict[str, Any], model_type: str = "gpt2") -> ModelConfig:
    refused = {
        "scale_attn_weights": False,  # unscaled attention scores
        "scale_attn_by_inverse_layer_idx": True,  # scores / (layer + 1)
        "add_cross_attention": True,
    }
    for key, bad in refused.items():
        if key in hf and hf[key] == bad:
            raise HFCheckpointError(f"GPT-2 with {key}={bad} is not supported by attnlab")
    # reorder_and_upcast_attn only changes the float precision of the scores (same maths).
    d = get(hf, "n_embd")
    return ModelConfig(
        vocab_size=get(hf, "vocab_size"),
        max_seq_len=get(hf, "n_positions"),
        d_model=d,
        n_layers=get(hf, "n_layer"),
        attention=AttentionConfig(
            n_heads=get(hf, "n_head"),
            qkv_bias=True,
            out_bias=True,
            dropout=hf.get("attn_pdrop", 0.0),
        ),
        position=PositionConfig(kind="learned"),
        ffn=FFNConfig(
            kind="mlp",
            activation=activation(hf.get("activation_function", "gelu_new"), "activation_function"),
            hidden_dim=hf.get("n_inner") or 4 * d,
            bias=True,
        ),
        norm=NormConfig(kind="layernorm", eps=hf.get("layer_norm_epsilon", 1e-5), bias=True),
        tie_embeddings=hf.get("tie_word_embeddings", True),
        # attnlab has one dropout for embeddings and residuals; GPT-2 sets both to 0.1.
        dropout=hf.get("resid_pdrop", 0.0),
        init_std=hf.get("initializer_range", 0.02),
    )


def exports(cfg: ModelConfig) -> bool:
    """Pre-norm learned-position decoders with one key/value head per query head but those
    with a ReLU MLP (OPT's layout, opt.py; so is every post-norm one); the others, fewer
    key/value heads, are GPT-BigCode's (gpt_bigcode.py)."""
    return (
        is_plain_decoder(cfg)
        and cfg.position.kind == "learned"
        and cfg.n_kv_heads == cfg.n_heads
        and cfg.ffn.activation != "relu"
    )


def export_type(cfg: ModelConfig) -> str:
    if cfg.norm.kind != "layernorm" or cfg.ffn.kind != "mlp":
        raise unrepresentable("learned positions need LayerNorm and an MLP feed-forward (GPT-2)")
    if cfg.n_kv_heads != cfg.n_heads or cfg.head_dim * cfg.n_heads != cfg.d_model:
        raise unrepresentable("GPT-2 needs n_kv_heads == n_heads and head_dim * n_heads == d_model")
    if cfg.attention.sliding_window is not None:
        raise unrepresentable("GPT-2 has no sliding-window attention")
    return "gpt2"


def config_to_hf(cfg: ModelConfig, model_type: str, dtype: torch.dtype) -> dict[str, Any]:
    att = cfg.attention
    return {
        **common_config(cfg, FAMILY, model_type, dtype),
        "n_embd": cfg.d_model,
        "n_layer": cfg.n_layers,
        "n_head": cfg.n_heads,
        "n_positions": cfg.max_seq_len,
        "n_inner": cfg.ffn.hidden_size(cfg.d_model),
        "activation_function": ACTIVATIONS[cfg.ffn.activation],
        "layer_norm_epsilon": cfg.norm.eps,
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": att.dropout,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "add_cross_attention": False,
    }


def weights_to_attnlab(src: Source, cfg: ModelConfig) -> Plan:
    d, f, V, L = cfg.d_model, cfg.ffn.hidden_size(cfg.d_model), cfg.vocab_size, cfg.max_seq_len
    p = prefix(src, "transformer.", "wte.weight")

    def conv(name: str, d_in: int, d_out: int) -> tuple[Part, ...] | None:
        return src.take(name, (d_in, d_out), transposed=True)  # Conv1D stores (in, out)

    out: dict[str, tuple[Part, ...] | None] = {
        "tok_emb.weight": src.take(f"{p}wte.weight", (V, d)),
        "pos_emb.weight": src.take(f"{p}wpe.weight", (L, d)),
        "norm.weight": src.take(f"{p}ln_f.weight", (d,)),
        "norm.bias": src.take(f"{p}ln_f.bias", (d,)),
    }
    for i in range(cfg.n_layers):
        h, a = f"{p}h.{i}.", f"blocks.{i}."
        out |= {
            a + "attn_norm.weight": src.take(h + "ln_1.weight", (d,)),
            a + "attn_norm.bias": src.take(h + "ln_1.bias", (d,)),
            a + "attn.qkv.weight": conv(h + "attn.c_attn.weight", d, 3 * d),  # rows [q; k; v]
            a + "attn.qkv.bias": src.take(h + "attn.c_attn.bias", (3 * d,)),
            a + "attn.out.weight": conv(h + "attn.c_proj.weight", d, d),
            a + "attn.out.bias": src.take(h + "attn.c_proj.bias", (d,)),
            a + "ffn_norm.weight": src.take(h + "ln_2.weight", (d,)),
            a + "ffn_norm.bias": src.take(h + "ln_2.bias", (d,)),
            a + "ffn.up.weight": conv(h + "mlp.c_fc.weight", d, f),
            a + "ffn.up.bias": src.take(h + "mlp.c_fc.bias", (f,)),
            a + "ffn.down.weight": conv(h + "mlp.c_proj.weight", f, d),
            a + "ffn.down.bias": src.take(h + "mlp.c_proj.bias", (d,)),
        }
    if cfg.tie_embeddings:
        src.tied("lm_head.weight", out["tok_emb.weight"])
    else:
        out["lm_head.weight"] = src.take("lm_head.weight", (V, d))
    return out  # type: ignore[return-value]  # None entries only with src.missing/wrong


def weights_from_attnlab(
    sd: dict[str, Tensor], cfg: ModelConfig, model_type: str
) -> dict[str, Tensor]:
    d, f = cfg.d_model, cfg.ffn.hidden_size(cfg.d_model)

    def bias(name: str, size: int) -> Tensor:  # GPT-2 always has biases; absent ones are 0
        return or_zeros(sd, name, size)

    out = {
        "transformer.wte.weight": sd["tok_emb.weight"],
        "transformer.wpe.weight": sd["pos_emb.weight"],
        "transformer.ln_f.weight": sd["norm.weight"],
        "transformer.ln_f.bias": bias("norm.bias", d),
    }
    for i in range(cfg.n_layers):
        h, a = f"transformer.h.{i}.", f"blocks.{i}."
        out |= {
            h + "ln_1.weight": sd[a + "attn_norm.weight"],
            h + "ln_1.bias": bias(a + "attn_norm.bias", d),
            h + "attn.c_attn.weight": sd[a + "attn.qkv.weight"].t(),  # Conv1D: (in, out)
            h + "attn.c_attn.bias": bias(a + "attn.qkv.bias", 3 * d),
            h + "attn.c_proj.weight": sd[a + "attn.out.weight"].t(),
            h + "attn.c_proj.bias": bias(a + "attn.out.bias", d),
            h + "ln_2.weight": sd[a + "ffn_norm.weight"],
            h + "ln_2.bias": bias(a + "ffn_norm.bias", d),
            h + "mlp.c_fc.weight": sd[a + "ffn.up.weight"].t(),
            h + "mlp.c_fc.bias": bias(a + "ffn.up.bias", f),
            h + "mlp.c_proj.weight": sd[a + "ffn.down.weight"].t(),
            h + "mlp.c_proj.bias": bias(a + "ffn.down.bias", d),
        }
    if not cfg.tie_embeddings:  # a tied head is not stored: transformers re-ties it
        out["lm_head.weight"] = sd["lm_head.weight"]
    return out


FAMILY = Family(
    name="gpt2",
    arch="decoder",
    architectures=ARCHITECTURES,
    config_from_hf=config_from_hf,
    defaults=DEFAULTS,
    config_to_hf=config_to_hf,
    weights_to_attnlab=weights_to_attnlab,
    weights_from_attnlab=weights_from_attnlab,
    exports=exports,
    export_type=export_type,
    ignored=IGNORED,
)
