"""Persimmon (``model_type`` persimmon: PersimmonForCausalLM; Adept's Persimmon-8B):
GPT-NeoX's fused attention in pre-norm blocks, with a LayerNorm on the queries and keys
and a squared-ReLU MLP:

- pre-norm blocks, x + attn(ln1(x)) then x + mlp(ln2(x)), every LayerNorm with a bias,
  eps ``layer_norm_eps`` (``norm.kind=layernorm``, ``norm.placement=pre``);
- one ``query_key_value`` projection with a bias, its rows laid out head by head (each
  head's q, k and v rows together, GPT-NeoX's order), ``dense`` with a bias; heads of
  hidden_size / num_attention_heads, one key/value head per query head;
- ``qk_layernorm`` (true by default): one LayerNorm with a bias over d_h that every query
  head shares, one every key head shares, after the projection and before RoPE and the
  cache (``attention.qk_norm``, ``qk_norm_kind=layernorm``, ``qk_norm_bias``; Phi's kind);
- RoPE on the first int(head_dim * partial_rotary_factor) features of each head in
  rotate-half pairs (``position.rope_fraction``, split layout): the RoPE parameters' own
  factor, else the top-level key, else 0.5 (PersimmonConfig's); linear scaling too;
- an MLP ``dense_h_to_4h`` -> ``hidden_act`` (relu2, the squared ReLU, by default) ->
  ``dense_4h_to_h``, both with biases;
- ``final_layernorm`` then ``lm_head`` without a bias, untied by default.

Dropout: ``hidden_dropout`` drops the MLP's output only, attnlab's one dropout each
sublayer's output and the embeddings: a nonzero one is read as attnlab's with a warning
(training only). Export takes the pre-norm RoPE decoders with LayerNorm and an MLP whose
activation is the squared ReLU, or with Phi's QK-norm (a LayerNorm every head shares),
which no other exported layout holds; absent biases are written as zeros, interleaved q/k
rows (and the QK-norm's features with them) permuted to rotate-half.

Weights, HF (``model.layers.{i}.``) -> attnlab (``blocks.{i}.``), every one with its bias:

    self_attn.query_key_value (3 h d_h, d)  -> attn.qkv   rows (h, 3, d_h) stored, [q; k; v]
    self_attn.dense           (d, h d_h)    -> attn.out
    self_attn.q_layernorm / k_layernorm (d_h,)  -> attn.q_norm / attn.k_norm
    mlp.dense_h_to_4h (f, d), mlp.dense_4h_to_h (d, f)  -> ffn.up, ffn.down
    input_layernorm, post_attention_layernorm (d,)     -> attn_norm, ffn_norm
    model.embed_tokens (V, d) -> tok_emb,  model.final_layernorm -> norm,  lm_head -> lm_head

Shapes: d d_model, h heads, d_h head dim, f feed-forward hidden size, V vocabulary size.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor

from attnlab.config import AttentionConfig, FFNConfig, ModelConfig, NormConfig, PositionConfig
from attnlab.interop.gpt_neox import heads_together
from attnlab.interop.io import (
    Family,
    HFCheckpointError,
    Part,
    Plan,
    Source,
    activation,
    common_config,
    get,
    hf_activation,
    number,
    or_zeros,
    prefix,
    rope_rows_to_split,
    rope_settings,
    rope_to_hf,
    split_rows,
    unrepresentable,
)
from attnlab.interop.phi import IGNORED

ARCHITECTURES = {"persimmon": ("PersimmonForCausalLM", "PersimmonModel")}

# transformers' PersimmonConfig class defaults for the config.json keys read here
# (Persimmon-8B's sizes)
DEFAULTS: dict[str, dict[str, Any]] = {
    "persimmon": {
        "vocab_size": 262144,
        "hidden_size": 4096,
        "intermediate_size": 16384,
        "num_hidden_layers": 36,
        "num_attention_heads": 64,
        "hidden_act": "relu2",
        "max_position_embeddings": 16384,
        "initializer_range": 0.02,
        "layer_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "qk_layernorm": True,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
    }
}
# PersimmonConfig's fraction of each head rotated where neither config.json nor its RoPE
# parameters give one (set in its __post_init__, not a class default)
PARTIAL_ROTARY_FACTOR = 0.5
ROPE_TYPES = ("default", "linear")
NORMS = (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ffn_norm"))
MLP = (("mlp.dense_h_to_4h", "ffn.up"), ("mlp.dense_4h_to_h", "ffn.down"))
QK_NORMS = (("q_layernorm", "q_norm"), ("k_layernorm", "k_norm"))

# --------------------------------------------------------------------------- configs


def config_from_hf(hf: dict[str, Any], model_type: str = "persimmon") -> ModelConfig:
    d, n_heads = get(hf, "hidden_size"), get(hf, "num_attention_heads")
    if hf.get("head_dim") not in (None, d // n_heads):
        raise HFCheckpointError(
            f"config.json head_dim={hf['head_dim']}: Persimmon's attention has heads of "
            f"hidden_size / num_attention_heads = {d // n_heads} (its RoPE would read the "
            "other); drop head_dim"
        )
    fraction = hf.get("partial_rotary_factor", PARTIAL_ROTARY_FACTOR)
    rope = rope_settings({**hf, "partial_rotary_factor": fraction}, ROPE_TYPES, partial=True)
    dropout = hf.get("hidden_dropout") or 0.0
    if dropout:
        warnings.warn(
            f"config.json hidden_dropout={dropout} drops Persimmon's MLP output only: attnlab "
            "drops each sublayer's output and the embeddings at it (training only; evaluation "
            "and generation are unaffected)",
            stacklevel=3,
        )
    qk_norm = bool(hf.get("qk_layernorm", True))
    eps = number(hf, "layer_norm_eps")
    return ModelConfig(
        vocab_size=get(hf, "vocab_size"),
        max_seq_len=get(hf, "max_position_embeddings"),
        d_model=d,
        n_layers=get(hf, "num_hidden_layers"),
        attention=AttentionConfig(
            n_heads=n_heads,
            qkv_bias=True,
            out_bias=True,
            dropout=hf.get("attention_dropout") or 0.0,
            qk_norm=qk_norm,
            qk_norm_kind="layernorm" if qk_norm else "rmsnorm",
            qk_norm_bias=qk_norm,
        ),
        position=PositionConfig(kind="rope", rope_layout="split", **rope),
        ffn=FFNConfig(
            kind="mlp",
            activation=activation(hf.get("hidden_act"), "hidden_act"),
            hidden_dim=get(hf, "intermediate_size"),
            bias=True,
        ),
        norm=NormConfig(kind="layernorm", eps=eps, bias=True, placement="pre"),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        dropout=dropout,
        init_std=hf.get("initializer_range", 0.02),
    )


def exports(cfg: ModelConfig) -> bool:
    """Pre-norm RoPE decoders with LayerNorm, an MLP and one key/value head per query head
    whose activation is the squared ReLU or with a LayerNorm QK-norm every head shares
    (Phi's): Persimmon's pieces, which GPT-NeoX's and StarCoder2's layouts (later in the
    registry) lack (StarCoder2's takes those with grouped key/value heads)."""
    att = cfg.attention
    shared_ln_qk_norm = (
        att.qk_norm
        and att.qk_norm_kind == "layernorm"
        and att.qk_norm_weight == "shared"
        and att.qk_norm_scope == "head"
    )
    return (
        cfg.arch == "decoder"
        and att.kind == "mha"
        and cfg.n_kv_heads == cfg.n_heads
        and cfg.position.kind == "rope"
        and cfg.norm.kind == "layernorm"
        and cfg.ffn.kind == "mlp"
        and cfg.norm.placement == "pre"
        and (cfg.ffn.activation == "relu2" or shared_ln_qk_norm)
    )


def export_type(cfg: ModelConfig) -> str:
    """``persimmon``, or HFCheckpointError naming what Persimmon has not (absent biases are
    written as zeros; windows, other QK-norms and other families' pieces are refused by
    ``convert``)."""

    def refuse(reason: str) -> HFCheckpointError:
        return unrepresentable(
            f"{reason}; pre-norm RoPE decoders with LayerNorm and a squared-ReLU MLP export "
            "as persimmon"
        )

    if cfg.head_dim * cfg.n_heads != cfg.d_model:
        raise refuse(
            f"attention.head_dim={cfg.head_dim} (Persimmon's heads are d_model / n_heads = "
            f"{cfg.d_model // cfg.n_heads} wide)"
        )
    if cfg.position.rope_scaling not in (None, "linear"):
        raise refuse(
            f"position.rope_scaling={cfg.position.rope_scaling!r} (Persimmon's: none or linear)"
        )
    hf_activation(cfg.ffn.activation)  # (refused by name if transformers has no such name)
    return "persimmon"


def config_to_hf(cfg: ModelConfig, model_type: str, dtype: torch.dtype) -> dict[str, Any]:
    att, pos = cfg.attention, cfg.position
    # written even when 1.0: PersimmonConfig's default is 0.5
    rope = {**rope_to_hf(pos), "partial_rotary_factor": pos.rope_fraction}
    return {
        **common_config(cfg, FAMILY, model_type, dtype),
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn.hidden_size(cfg.d_model),
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "hidden_act": hf_activation(cfg.ffn.activation),
        "max_position_embeddings": cfg.max_seq_len,
        "layer_norm_eps": cfg.norm.eps,
        "qk_layernorm": att.qk_norm,
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


def weights_to_attnlab(src: Source, cfg: ModelConfig) -> Plan:
    d, f, V, h = cfg.d_model, cfg.ffn.hidden_size(cfg.d_model), cfg.vocab_size, cfg.n_heads
    p = prefix(src, "model.", "embed_tokens.weight")
    out: dict[str, tuple[Part, ...] | None] = {
        "tok_emb.weight": src.take(f"{p}embed_tokens.weight", (V, d)),
        "norm.weight": src.take(f"{p}final_layernorm.weight", (d,)),
        "norm.bias": src.take(f"{p}final_layernorm.bias", (d,)),
    }
    shapes = {"ffn.up": (f, d), "ffn.down": (d, f)}
    for i in range(cfg.n_layers):
        hf, a = f"{p}layers.{i}.", f"blocks.{i}."
        attn = hf + "self_attn."
        qkv = attn + "query_key_value."
        out |= {
            # rows (h, 3, d_h) stored: each head's q, k, v together
            a + "attn.qkv.weight": src.take(qkv + "weight", (3 * d, d), per_head=(3, h)),
            a + "attn.qkv.bias": src.take(qkv + "bias", (3 * d,), per_head=(3, h)),
            a + "attn.out.weight": src.take(attn + "dense.weight", (d, d)),
            a + "attn.out.bias": src.take(attn + "dense.bias", (d,)),
        }
        for theirs, ours in MLP:
            shape = shapes[ours]
            out[f"{a}{ours}.weight"] = src.take(f"{hf}{theirs}.weight", shape)
            out[f"{a}{ours}.bias"] = src.take(f"{hf}{theirs}.bias", shape[:1])
        for theirs, ours in NORMS:
            for kind in ("weight", "bias"):
                out[f"{a}{ours}.{kind}"] = src.take(f"{hf}{theirs}.{kind}", (d,))
        if cfg.attention.qk_norm:
            for theirs, ours in QK_NORMS:
                for kind in ("weight", "bias"):
                    out[f"{a}attn.{ours}.{kind}"] = src.take(
                        f"{attn}{theirs}.{kind}", (cfg.head_dim,)
                    )
    if cfg.tie_embeddings:
        src.tied("lm_head.weight", out["tok_emb.weight"])
    else:
        out["lm_head.weight"] = src.take("lm_head.weight", (V, d))
    return out  # type: ignore[return-value]  # None entries only with src.missing/wrong


def weights_from_attnlab(
    sd: dict[str, Tensor], cfg: ModelConfig, model_type: str
) -> dict[str, Tensor]:
    """Persimmon's tensors: its biases (zeros where attnlab has none), q/k/v rows head by
    head, interleaved RoPE rows of q and k (and the QK-norm's features) permuted to
    rotate-half within the rotated features."""
    d, f, h = cfg.d_model, cfg.ffn.hidden_size(cfg.d_model), cfg.n_heads
    interleaved = cfg.position.rope_layout == "interleaved"

    def to_split(t: Tensor, heads: int) -> Tensor:
        return rope_rows_to_split(t, heads, cfg.head_dim, cfg.rope_dim) if interleaved else t

    def qkv(t: Tensor) -> Tensor:  # q and k rows to the split layout, then head by head
        q, k, v = split_rows(t, d, d, d)
        return heads_together(torch.cat((to_split(q, h), to_split(k, h), v)), h)

    out = {
        "model.embed_tokens.weight": sd["tok_emb.weight"],
        "model.final_layernorm.weight": sd["norm.weight"],
        "model.final_layernorm.bias": or_zeros(sd, "norm.bias", d),
    }
    widths = {"ffn.up": f, "ffn.down": d}
    for i in range(cfg.n_layers):
        hf, a = f"model.layers.{i}.", f"blocks.{i}."
        attn = hf + "self_attn."
        out |= {
            attn + "query_key_value.weight": qkv(sd[a + "attn.qkv.weight"]),
            attn + "query_key_value.bias": qkv(or_zeros(sd, a + "attn.qkv.bias", 3 * d)),
            attn + "dense.weight": sd[a + "attn.out.weight"],
            attn + "dense.bias": or_zeros(sd, a + "attn.out.bias", d),
        }
        for theirs, ours in MLP:
            out[f"{hf}{theirs}.weight"] = sd[f"{a}{ours}.weight"]
            out[f"{hf}{theirs}.bias"] = or_zeros(sd, f"{a}{ours}.bias", widths[ours])
        for theirs, ours in NORMS:
            out[f"{hf}{theirs}.weight"] = sd[f"{a}{ours}.weight"]
            out[f"{hf}{theirs}.bias"] = or_zeros(sd, f"{a}{ours}.bias", d)
        if cfg.attention.qk_norm:  # per feature within a head: permuted as the q/k rows are
            for theirs, ours in QK_NORMS:
                for kind in ("weight", "bias"):
                    t = or_zeros(sd, f"{a}attn.{ours}.{kind}", cfg.head_dim)
                    out[f"{attn}{theirs}.{kind}"] = to_split(t, 1)
    if not cfg.tie_embeddings:  # a tied weight is not stored: transformers re-ties it
        out["lm_head.weight"] = sd["lm_head.weight"]
    return out


FAMILY = Family(
    name="persimmon",
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
