"""GPT-J (``model_type`` gptj: GPTJForCausalLM): Phi's parallel block (phi.py) in Wang and
Komatsuzaki's original layout:

- x + attn(ln_1(x)) + mlp(ln_1(x)), one LayerNorm with bias per layer read by both
  (``norm.placement='parallel_shared'``);
- ``attn.q_proj``, ``k_proj``, ``v_proj`` and ``out_proj`` without biases, MHA with heads of
  d_model / n_heads; an MLP ``fc_in`` -> ``activation_function`` (gelu_new) -> ``fc_out`` of
  ``n_inner`` (null: 4 d) with biases;
- RoPE of base 10000 on the first ``rotary_dim`` features of each head, adjacent pairs
  (2i, 2i + 1) rotated together (``position.rope_layout='interleaved'``,
  ``rope_fraction`` = rotary_dim / head_dim); no scaling;
- ``ln_f``, then ``lm_head`` with a bias (``final_logits_bias``), untied by default.

Dropout as Phi's: ``resid_pdrop`` is attnlab's ``dropout`` (an ``embd_pdrop`` that differs
loads with a warning), ``attn_pdrop`` ``attention.dropout``.

Weights, HF (``transformer.h.{i}.``) -> attnlab (``blocks.{i}.``):

    attn.q_proj / k_proj / v_proj  (d, d) x 3     -> attn.qkv [q; k; v] (pairs as stored)
    attn.out_proj                  (d, d)         -> attn.out
    mlp.fc_in (f, d), (f,); mlp.fc_out (d, f), (d,) -> ffn.up, ffn.down
    ln_1                           (d,), (d,)     -> norm
    transformer.wte (V, d) -> tok_emb,  transformer.ln_f -> norm,  lm_head (V, d), (V,)

Export writes a parallel_shared decoder as gptj where it is GPT-J's own: interleaved pairs,
no attention biases, whole-width MHA heads, base 10000, no RoPE scaling (missing MLP, norm
and head biases written as zeros); every other one as phi, which holds it all.

Shapes: d d_model, f feed-forward hidden size, V vocabulary size.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import Tensor

from attnlab.config import AttentionConfig, FFNConfig, ModelConfig, NormConfig, PositionConfig
from attnlab.interop.io import (
    TO_HF_ACTIVATIONS,
    Family,
    HFCheckpointError,
    Part,
    Plan,
    Source,
    activation,
    cat,
    common_config,
    get,
    hf_activation,
    one_dropout,
    or_zeros,
    prefix,
    split_rows,
)

ARCHITECTURES = {"gptj": ("GPTJForCausalLM", "GPTJModel")}

# transformers' GPTJConfig class defaults for the config.json keys read here (n_inner,
# None there, is left out: read as missing, 4 d)
DEFAULTS: dict[str, dict[str, Any]] = {
    "gptj": {
        "vocab_size": 50400,
        "n_positions": 2048,
        "n_embd": 4096,
        "n_layer": 28,
        "n_head": 16,
        "rotary_dim": 64,
        "activation_function": "gelu_new",
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
    }
}
ROPE_THETA = 10000.0  # GPT-J's create_sinusoidal_positions: fixed
# GPT-J's own spelling of the tanh GELU
ACTIVATIONS = {**TO_HF_ACTIVATIONS, "gelu_tanh": "gelu_new"}
# Causal-mask buffers older transformers versions saved
IGNORED = re.compile(r"^(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)$")

# --------------------------------------------------------------------------- configs


def _rope_fraction(hf: dict[str, Any], head_dim: int, n_heads: int) -> float:
    """``position.rope_fraction`` of ``rotary_dim``: the fraction of each head whose int(head_dim
    * fraction) is rotary_dim, which must be even and at most the head's width (null: the
    whole hidden size, which transformers runs with one head only)."""
    rotary = hf.get("rotary_dim")
    if rotary is None and n_heads == 1:
        rotary = head_dim
    if isinstance(rotary, bool) or not isinstance(rotary, int) or not 2 <= rotary <= head_dim:
        raise HFCheckpointError(
            f"config.json rotary_dim={rotary!r}: GPT-J rotates the first rotary_dim features of "
            f"each head; give an even number from 2 to the head width {head_dim}"
        )
    fraction = rotary / head_dim
    if int(head_dim * fraction) != rotary:  # (float rounding: not such a fraction)
        raise HFCheckpointError(
            f"config.json rotary_dim={rotary} is no fraction of the head width {head_dim} that "
            "attnlab's position.rope_fraction can hold"
        )
    return fraction


def config_from_hf(hf: dict[str, Any], model_type: str = "gptj") -> ModelConfig:
    d, n_heads = get(hf, "n_embd"), get(hf, "n_head")
    if d % n_heads:
        raise HFCheckpointError(
            f"config.json n_embd={d} is not divisible by n_head={n_heads} (GPT-J's heads are "
            "n_embd / n_head wide)"
        )
    return ModelConfig(
        vocab_size=get(hf, "vocab_size"),
        max_seq_len=get(hf, "n_positions"),
        d_model=d,
        n_layers=get(hf, "n_layer"),
        attention=AttentionConfig(
            n_heads=n_heads, qkv_bias=False, out_bias=False, dropout=hf.get("attn_pdrop") or 0.0
        ),
        position=PositionConfig(
            kind="rope",
            rope_theta=ROPE_THETA,
            rope_layout="interleaved",
            rope_fraction=_rope_fraction(hf, d // n_heads, n_heads),
        ),
        ffn=FFNConfig(
            kind="mlp",
            activation=activation(hf.get("activation_function"), "activation_function"),
            hidden_dim=hf.get("n_inner") or 4 * d,
            bias=True,
        ),
        norm=NormConfig(
            kind="layernorm",
            eps=hf.get("layer_norm_epsilon", 1e-5),
            bias=True,
            placement="parallel_shared",
        ),
        tie_embeddings=hf.get("tie_word_embeddings", False),
        final_logits_bias=True,
        dropout=one_dropout(hf),
        init_std=hf.get("initializer_range", 0.02),
    )


def exports(cfg: ModelConfig) -> bool:
    """Parallel blocks with one shared norm in GPT-J's own layout: interleaved RoPE pairs of
    base 10000 unscaled, no attention biases, whole-width MHA heads, LayerNorm, an MLP. The
    others (split pairs, attention biases, GQA, ...) are Phi's (phi.py), which holds them."""
    pos, att = cfg.position, cfg.attention
    return (
        cfg.arch == "decoder"
        and att.kind == "mha"
        and cfg.norm.placement == "parallel_shared"
        and cfg.norm.kind == "layernorm"
        and cfg.ffn.kind == "mlp"
        and pos.kind == "rope"
        and pos.rope_layout == "interleaved"
        and pos.rope_scaling is None
        and pos.rope_theta == ROPE_THETA
        and not (att.qkv_bias or att.out_bias)
        and cfg.n_kv_heads == cfg.n_heads
        and cfg.head_dim * cfg.n_heads == cfg.d_model
    )


def export_type(cfg: ModelConfig) -> str:
    hf_activation(cfg.ffn.activation, ACTIVATIONS)  # (refused by name if transformers has none)
    return "gptj"


def config_to_hf(cfg: ModelConfig, model_type: str, dtype: torch.dtype) -> dict[str, Any]:
    return {
        **common_config(cfg, FAMILY, model_type, dtype),
        "n_embd": cfg.d_model,
        "n_layer": cfg.n_layers,
        "n_head": cfg.n_heads,
        "n_positions": cfg.max_seq_len,
        "n_inner": cfg.ffn.hidden_size(cfg.d_model),
        "rotary_dim": cfg.rope_dim,
        "activation_function": hf_activation(cfg.ffn.activation, ACTIVATIONS),
        "layer_norm_epsilon": cfg.norm.eps,
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.attention.dropout,
    }


# --------------------------------------------------------------------------- weights

MLP = (("mlp.fc_in", "ffn.up"), ("mlp.fc_out", "ffn.down"))
QKV = ("q_proj", "k_proj", "v_proj")


def weights_to_attnlab(src: Source, cfg: ModelConfig) -> Plan:
    d, f, V = cfg.d_model, cfg.ffn.hidden_size(cfg.d_model), cfg.vocab_size
    p = prefix(src, "transformer.", "wte.weight")
    out: dict[str, tuple[Part, ...] | None] = {
        "tok_emb.weight": src.take(f"{p}wte.weight", (V, d)),
        "norm.weight": src.take(f"{p}ln_f.weight", (d,)),
        "norm.bias": src.take(f"{p}ln_f.bias", (d,)),
        "lm_head.bias": src.take("lm_head.bias", (V,)),
    }
    shapes = {"ffn.up": (f, d), "ffn.down": (d, f)}
    for i in range(cfg.n_layers):
        hf, a = f"{p}h.{i}.", f"blocks.{i}."
        out[a + "attn.qkv.weight"] = cat(src.take(f"{hf}attn.{n}.weight", (d, d)) for n in QKV)
        out[a + "attn.out.weight"] = src.take(hf + "attn.out_proj.weight", (d, d))
        for theirs, ours in MLP:
            out[f"{a}{ours}.weight"] = src.take(f"{hf}{theirs}.weight", shapes[ours])
            out[f"{a}{ours}.bias"] = src.take(f"{hf}{theirs}.bias", shapes[ours][:1])
        out[a + "norm.weight"] = src.take(hf + "ln_1.weight", (d,))
        out[a + "norm.bias"] = src.take(hf + "ln_1.bias", (d,))
    if cfg.tie_embeddings:
        src.tied("lm_head.weight", out["tok_emb.weight"])
    else:
        out["lm_head.weight"] = src.take("lm_head.weight", (V, d))
    return out  # type: ignore[return-value]  # None entries only with src.missing/wrong


def weights_from_attnlab(
    sd: dict[str, Tensor], cfg: ModelConfig, model_type: str
) -> dict[str, Tensor]:
    """GPT-J's tensors (q/k rows in the interleaved layout the config has; the MLP's,
    norms' and head's biases zeros where attnlab has none)."""
    d, f, V = cfg.d_model, cfg.ffn.hidden_size(cfg.d_model), cfg.vocab_size
    out = {
        "transformer.wte.weight": sd["tok_emb.weight"],
        "transformer.ln_f.weight": sd["norm.weight"],
        "transformer.ln_f.bias": or_zeros(sd, "norm.bias", d),
        "lm_head.bias": or_zeros(sd, "lm_head.bias", V),
    }
    widths = {"ffn.up": f, "ffn.down": d}
    for i in range(cfg.n_layers):
        hf, a = f"transformer.h.{i}.", f"blocks.{i}."
        for n, w in zip(QKV, split_rows(sd[a + "attn.qkv.weight"], d, d, d), strict=True):
            out[f"{hf}attn.{n}.weight"] = w
        out[hf + "attn.out_proj.weight"] = sd[a + "attn.out.weight"]
        for theirs, ours in MLP:
            out[f"{hf}{theirs}.weight"] = sd[f"{a}{ours}.weight"]
            out[f"{hf}{theirs}.bias"] = or_zeros(sd, f"{a}{ours}.bias", widths[ours])
        out[hf + "ln_1.weight"] = sd[a + "norm.weight"]
        out[hf + "ln_1.bias"] = or_zeros(sd, a + "norm.bias", d)
    if not cfg.tie_embeddings:  # a tied weight is not stored: transformers re-ties it
        out["lm_head.weight"] = sd["lm_head.weight"]
    return out


FAMILY = Family(
    name="gptj",
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
