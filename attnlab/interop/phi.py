"""Phi-1, Phi-1.5 and Phi-2 (``model_type`` phi: PhiForCausalLM): attention and an MLP side
by side on one LayerNorm of each block's input, a partial rotation and a biased head:

- x + attn(ln(x)) + mlp(ln(x)) with one ``input_layernorm`` (LayerNorm with bias) per
  layer read by both (``norm.placement='parallel_shared'``);
- ``q_proj``, ``k_proj``, ``v_proj`` and ``dense`` with biases (``attention.qkv_bias``,
  ``out_bias``), GQA where ``num_key_value_heads`` is set (heads of ``head_dim`` where
  config.json sets one, as transformers reads it), an MLP ``fc1`` -> ``hidden_act``
  (gelu_new) -> ``fc2`` with biases;
- RoPE on the first int(head_dim * partial_rotary_factor) features of each head, pairs
  (i, i + d_r / 2) within them (rotate-half: ``position.rope_fraction``, split layout): the
  RoPE parameters' own factor, else the top-level key, else 0.5 (PhiConfig's default);
  linear scaling too;
- ``final_layernorm``, then ``lm_head`` with a bias (``final_logits_bias``), untied by
  default (``tie_word_embeddings`` ties its weight, never its bias).

``qk_layernorm``: one LayerNorm with bias of head_dim (eps ``layer_norm_eps``) that every
query head shares, one every key head shares, after the projections and before RoPE and
the cache (``attention.qk_norm``, ``qk_norm_kind=layernorm``, ``qk_norm_bias``); transformers
sizes them hidden_size / num_attention_heads, so a head_dim of its own is refused with
them. Dropout: attnlab has one dropout for the embeddings and
each sublayer's output, read from ``resid_pdrop``; an ``embd_pdrop`` that differs (Phi-2's
0.0 against 0.1) changes training only, so it is loaded with a warning (attnlab then drops
the embeddings at ``resid_pdrop`` too). ``attention_dropout`` is ``attention.dropout``.

Weights, HF (``model.layers.{i}.``) -> attnlab (``blocks.{i}.``):

    self_attn.q_proj / k_proj / v_proj  (h d_h, d), (h_kv d_h, d) x 2  -> attn.qkv [q; k; v]
    self_attn.dense                     (d, h d_h)                     -> attn.out
    mlp.fc1 (f, d), mlp.fc2 (d, f)                                     -> ffn.up, ffn.down
    input_layernorm                     (d,)                           -> norm
    self_attn.q_layernorm / k_layernorm (d_h,)                         -> attn.q_norm / k_norm
    model.embed_tokens (V, d) -> tok_emb,  model.final_layernorm -> norm,  lm_head -> lm_head

(every Linear with its bias). Export takes the RoPE decoders of parallel blocks with one
shared norm, LayerNorm and an MLP; biases attnlab lacks are written as zeros.

Shapes: d d_model, h heads, h_kv key/value heads, d_h head dim, f feed-forward hidden size,
V vocabulary size.
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
    rope_rows_to_split,
    rope_settings,
    rope_to_hf,
    split_rows,
    unrepresentable,
)

ARCHITECTURES = {"phi": ("PhiForCausalLM", "PhiModel")}

# transformers' PhiConfig class defaults for the config.json keys read here
DEFAULTS: dict[str, dict[str, Any]] = {
    "phi": {
        "vocab_size": 51200,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 24,
        "num_attention_heads": 32,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attention_dropout": 0.0,
        "hidden_act": "gelu_new",
        "max_position_embeddings": 2048,
        "initializer_range": 0.02,
        "layer_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "qk_layernorm": False,
    }
}
# PhiConfig's fraction of each head rotated where neither config.json nor its RoPE
# parameters give one (set in its __post_init__, not a class default)
PARTIAL_ROTARY_FACTOR = 0.5
ROPE_TYPES = ("default", "linear")
# Phi's own spelling of the tanh GELU
ACTIVATIONS = {**TO_HF_ACTIVATIONS, "gelu_tanh": "gelu_new"}
# RoPE frequencies older transformers versions saved
IGNORED = re.compile(r"^(model\.)?layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")

# --------------------------------------------------------------------------- configs


def _rope(hf: dict[str, Any]) -> dict[str, Any]:
    """PositionConfig fields: the RoPE parameters' own theta and fraction, else the
    top-level ``rope_theta`` and ``partial_rotary_factor``, else 10000 and 0.5."""
    fraction = hf.get("partial_rotary_factor", PARTIAL_ROTARY_FACTOR)
    return rope_settings({**hf, "partial_rotary_factor": fraction}, ROPE_TYPES, partial=True)


def config_from_hf(hf: dict[str, Any], model_type: str = "phi") -> ModelConfig:
    d, n_heads = get(hf, "hidden_size"), get(hf, "num_attention_heads")
    n_kv_heads = hf.get("num_key_value_heads") or n_heads
    # transformers' PhiAttention and its RoPE read a head_dim config.json sets, else d / h
    head_dim = hf.get("head_dim") or d // n_heads
    qk_norm = bool(hf.get("qk_layernorm"))
    if qk_norm and head_dim != d // n_heads:
        raise HFCheckpointError(
            f"config.json qk_layernorm=true with head_dim={head_dim}: transformers' Phi sizes "
            f"its query and key LayerNorms hidden_size / num_attention_heads = {d // n_heads} "
            "wide, which such heads cannot run; drop head_dim or qk_layernorm"
        )
    return ModelConfig(
        vocab_size=get(hf, "vocab_size"),
        max_seq_len=get(hf, "max_position_embeddings"),
        d_model=d,
        n_layers=get(hf, "num_hidden_layers"),
        attention=AttentionConfig(
            n_heads=n_heads,
            n_kv_heads=None if n_kv_heads == n_heads else n_kv_heads,
            head_dim=None if head_dim * n_heads == d else head_dim,
            qkv_bias=True,
            out_bias=True,
            dropout=hf.get("attention_dropout") or 0.0,
            qk_norm=qk_norm,
            qk_norm_kind="layernorm" if qk_norm else "rmsnorm",
            qk_norm_bias=qk_norm,
        ),
        position=PositionConfig(kind="rope", rope_layout="split", **_rope(hf)),
        ffn=FFNConfig(
            kind="mlp",
            activation=activation(hf.get("hidden_act"), "hidden_act"),
            hidden_dim=get(hf, "intermediate_size"),
            bias=True,
        ),
        norm=NormConfig(
            kind="layernorm",
            eps=hf.get("layer_norm_eps", 1e-5),
            bias=True,
            placement="parallel_shared",
        ),
        tie_embeddings=hf.get("tie_word_embeddings", False),
        final_logits_bias=True,
        dropout=one_dropout(hf),
        init_std=hf.get("initializer_range", 0.02),
    )


def exports(cfg: ModelConfig) -> bool:
    """RoPE decoders of parallel blocks with one shared norm, LayerNorm and an MLP
    feed-forward: Phi's shape (GPT-NeoX's parallel blocks have two norms)."""
    return (
        cfg.arch == "decoder"
        and cfg.attention.kind == "mha"
        and cfg.position.kind == "rope"
        and cfg.norm.kind == "layernorm"
        and cfg.ffn.kind == "mlp"
        and cfg.norm.placement == "parallel_shared"
    )


def export_type(cfg: ModelConfig) -> str:
    """``phi``, or HFCheckpointError naming what Phi has not (absent biases, the head's
    too, are written as zeros; QK-norms other than its own are refused by ``convert``)."""
    if cfg.attention.qk_norm and cfg.head_dim * cfg.n_heads != cfg.d_model:
        raise unrepresentable(
            f"attention.head_dim={cfg.head_dim} with attention.qk_norm (transformers' Phi sizes "
            f"its QK LayerNorms d_model / n_heads = {cfg.d_model // cfg.n_heads} wide)"
        )
    if cfg.position.rope_scaling not in (None, "linear"):
        raise unrepresentable(
            f"position.rope_scaling={cfg.position.rope_scaling!r} (phi: none or linear)"
        )
    hf_activation(cfg.ffn.activation, ACTIVATIONS)  # (refused by name if transformers has none)
    return "phi"


def config_to_hf(cfg: ModelConfig, model_type: str, dtype: torch.dtype) -> dict[str, Any]:
    att, pos = cfg.attention, cfg.position
    # written even when 1.0: PhiConfig's default is 0.5
    rope = {**rope_to_hf(pos), "partial_rotary_factor": pos.rope_fraction}
    return {
        **common_config(cfg, FAMILY, model_type, dtype),
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn.hidden_size(cfg.d_model),
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,  # (not a PhiConfig field: transformers reads it as set)
        "hidden_act": hf_activation(cfg.ffn.activation, ACTIVATIONS),
        "max_position_embeddings": cfg.max_seq_len,
        "layer_norm_eps": cfg.norm.eps,
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attention_dropout": att.dropout,
        "qk_layernorm": att.qk_norm,
        "partial_rotary_factor": pos.rope_fraction,  # transformers 4.x
        "rope_theta": pos.rope_theta,  # transformers 4.x
        # (4.x's form; transformers 5 reads it first, with the two keys above)
        "rope_scaling": (
            None if pos.rope_scaling is None else {"type": "linear", "factor": pos.rope_factor}
        ),
        "rope_parameters": rope,  # transformers 5.x
    }


# --------------------------------------------------------------------------- weights

LINEARS = (("self_attn.dense", "attn.out"), ("mlp.fc1", "ffn.up"), ("mlp.fc2", "ffn.down"))
QKV = ("q_proj", "k_proj", "v_proj")
QK_NORMS = (("q_layernorm", "attn.q_norm"), ("k_layernorm", "attn.k_norm"))


def weights_to_attnlab(src: Source, cfg: ModelConfig) -> Plan:
    d, f, V = cfg.d_model, cfg.ffn.hidden_size(cfg.d_model), cfg.vocab_size
    q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    p = prefix(src, "model.", "embed_tokens.weight")
    out: dict[str, tuple[Part, ...] | None] = {
        "tok_emb.weight": src.take(f"{p}embed_tokens.weight", (V, d)),
        "norm.weight": src.take(f"{p}final_layernorm.weight", (d,)),
        "norm.bias": src.take(f"{p}final_layernorm.bias", (d,)),
        "lm_head.bias": src.take("lm_head.bias", (V,)),
    }
    shapes = {"attn.out": (d, q_dim), "ffn.up": (f, d), "ffn.down": (d, f)}
    for i in range(cfg.n_layers):
        hf, a = f"{p}layers.{i}.", f"blocks.{i}."
        rows = (q_dim, kv_dim, kv_dim)
        attn = f"{hf}self_attn."
        out[a + "attn.qkv.weight"] = cat(
            src.take(f"{attn}{n}.weight", (r, d)) for n, r in zip(QKV, rows, strict=True)
        )
        out[a + "attn.qkv.bias"] = cat(
            src.take(f"{attn}{n}.bias", (r,)) for n, r in zip(QKV, rows, strict=True)
        )
        for theirs, ours in LINEARS:
            shape = shapes[ours]
            out[f"{a}{ours}.weight"] = src.take(f"{hf}{theirs}.weight", shape)
            out[f"{a}{ours}.bias"] = src.take(f"{hf}{theirs}.bias", shape[:1])
        out[a + "norm.weight"] = src.take(hf + "input_layernorm.weight", (d,))
        out[a + "norm.bias"] = src.take(hf + "input_layernorm.bias", (d,))
        if cfg.attention.qk_norm:
            for theirs, ours in QK_NORMS:
                for kind in ("weight", "bias"):
                    shape = (cfg.head_dim,)
                    out[f"{a}{ours}.{kind}"] = src.take(f"{attn}{theirs}.{kind}", shape)
    if cfg.tie_embeddings:
        src.tied("lm_head.weight", out["tok_emb.weight"])
    else:
        out["lm_head.weight"] = src.take("lm_head.weight", (V, d))
    return out  # type: ignore[return-value]  # None entries only with src.missing/wrong


def weights_from_attnlab(
    sd: dict[str, Tensor], cfg: ModelConfig, model_type: str
) -> dict[str, Tensor]:
    """Phi's tensors: its biases (zeros where attnlab has none); interleaved RoPE rows of q
    and k permuted to rotate-half within the rotated features."""
    d, f, V = cfg.d_model, cfg.ffn.hidden_size(cfg.d_model), cfg.vocab_size
    q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    interleaved = cfg.position.rope_layout == "interleaved"

    def to_split(t: Tensor, heads: int) -> Tensor:
        return rope_rows_to_split(t, heads, cfg.head_dim, cfg.rope_dim) if interleaved else t

    def qkv(t: Tensor) -> tuple[Tensor, ...]:
        q, k, v = split_rows(t, q_dim, kv_dim, kv_dim)
        return to_split(q, cfg.n_heads), to_split(k, cfg.n_kv_heads), v

    out = {
        "model.embed_tokens.weight": sd["tok_emb.weight"],
        "model.final_layernorm.weight": sd["norm.weight"],
        "model.final_layernorm.bias": or_zeros(sd, "norm.bias", d),
        "lm_head.bias": or_zeros(sd, "lm_head.bias", V),
    }
    widths = {"attn.out": d, "ffn.up": f, "ffn.down": d}
    for i in range(cfg.n_layers):
        hf, a = f"model.layers.{i}.", f"blocks.{i}."
        weights = qkv(sd[a + "attn.qkv.weight"])
        biases = qkv(or_zeros(sd, a + "attn.qkv.bias", q_dim + 2 * kv_dim))
        for n, w, b in zip(QKV, weights, biases, strict=True):
            out[f"{hf}self_attn.{n}.weight"], out[f"{hf}self_attn.{n}.bias"] = w, b
        for theirs, ours in LINEARS:
            out[f"{hf}{theirs}.weight"] = sd[f"{a}{ours}.weight"]
            out[f"{hf}{theirs}.bias"] = or_zeros(sd, f"{a}{ours}.bias", widths[ours])
        out[hf + "input_layernorm.weight"] = sd[a + "norm.weight"]
        out[hf + "input_layernorm.bias"] = or_zeros(sd, a + "norm.bias", d)
        if cfg.attention.qk_norm:  # per feature within a head: permuted as the q/k rows are
            for theirs, ours in QK_NORMS:
                for kind in ("weight", "bias"):
                    t = or_zeros(sd, f"{a}{ours}.{kind}", cfg.head_dim)
                    out[f"{hf}self_attn.{theirs}.{kind}"] = to_split(t, 1)
    if not cfg.tie_embeddings:  # a tied weight is not stored: transformers re-ties it
        out["lm_head.weight"] = sd["lm_head.weight"]
    return out


FAMILY = Family(
    name="phi",
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
