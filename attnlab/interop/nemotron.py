"""Nemotron (``model_type`` nemotron: NemotronForCausalLM; NVIDIA's Nemotron-3 8B and the
Minitron 4B/8B): LLaMA's weight names on LayerNorms whose weight is stored as its offset
from one, a squared-ReLU MLP and a partial rotation:

- pre-norm blocks, x + attn(ln1(x)) then x + mlp(ln2(x)); every norm a NemotronLayerNorm1P,
  (x - mean) / std * (1 + w) + b with a bias, eps ``norm_eps``, computed in x's dtype
  (``norm.kind=layernorm1p``: the stored w is read as is, zeros the identity);
- q/k/v/o projections, biases on all four where ``attention_bias`` says
  (``attention.qkv_bias``, ``out_bias``), GQA, heads of ``head_dim`` (hidden_size /
  num_attention_heads unless config.json sets one);
- an MLP ``up_proj`` -> ``hidden_act`` (relu2, the squared ReLU, by default) -> ``down_proj``,
  not gated, biases where ``mlp_bias`` says (``ffn.kind=mlp``, ``ffn.bias``);
- RoPE on the first int(head_dim * partial_rotary_factor) features of each head in
  rotate-half pairs (``position.rope_fraction``, split layout): the RoPE parameters' own
  factor, else the top-level key, else 0.5 (NemotronConfig's); linear scaling too;
- ``model.norm`` then ``lm_head`` without a bias, untied by default.

Export takes every decoder with a unit-offset LayerNorm (no other exported layout holds one)
and names what else Nemotron lacks; absent LayerNorm biases, and the attention bias attnlab
lacks where it has the other, are written as zeros; interleaved q/k rows are permuted to
rotate-half.

Weights, HF (``model.layers.{i}.``) -> attnlab (``blocks.{i}.``):

    self_attn.q_proj / k_proj / v_proj  (h d_h, d), (h_kv d_h, d) x 2  -> attn.qkv [q; k; v]
    self_attn.o_proj                    (d, h d_h)                     -> attn.out
    mlp.up_proj (f, d), mlp.down_proj (d, f)                           -> ffn.up, ffn.down
    input_layernorm, post_attention_layernorm (d,)  -> attn_norm, ffn_norm (weight and bias)
    model.embed_tokens (V, d) -> tok_emb,  model.norm -> norm,  lm_head -> lm_head

Shapes: d d_model, h heads, h_kv key/value heads, d_h head dim, f feed-forward hidden size,
V vocabulary size.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attnlab.config import AttentionConfig, FFNConfig, ModelConfig, NormConfig, PositionConfig
from attnlab.interop import llama
from attnlab.interop.io import (
    Family,
    Part,
    Plan,
    Source,
    activation,
    cat,
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

ARCHITECTURES = {"nemotron": ("NemotronForCausalLM", "NemotronModel")}

# transformers' NemotronConfig class defaults for the config.json keys read here
DEFAULTS: dict[str, dict[str, Any]] = {
    "nemotron": {
        "vocab_size": 256000,
        "hidden_size": 6144,
        "intermediate_size": 24576,
        "num_hidden_layers": 32,
        "num_attention_heads": 48,
        "hidden_act": "relu2",
        "max_position_embeddings": 4096,
        "initializer_range": 0.0134,
        "norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
    }
}
# NemotronConfig's fraction of each head rotated where neither config.json nor its RoPE
# parameters give one (set in its __post_init__, not a class default)
PARTIAL_ROTARY_FACTOR = 0.5
ROPE_TYPES = ("default", "linear")
NORMS = llama.NORMS
MLP = (("mlp.up_proj", "ffn.up"), ("mlp.down_proj", "ffn.down"))
QKV = ("q_proj", "k_proj", "v_proj")

# --------------------------------------------------------------------------- configs


def config_from_hf(hf: dict[str, Any], model_type: str = "nemotron") -> ModelConfig:
    d, n_heads = get(hf, "hidden_size"), get(hf, "num_attention_heads")
    n_kv_heads = hf.get("num_key_value_heads") or n_heads
    head_dim = hf.get("head_dim") or d // n_heads  # (NemotronConfig's, as it sets it)
    fraction = hf.get("partial_rotary_factor", PARTIAL_ROTARY_FACTOR)
    rope = rope_settings({**hf, "partial_rotary_factor": fraction}, ROPE_TYPES, partial=True)
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
            dropout=hf.get("attention_dropout") or 0.0,
        ),
        position=PositionConfig(kind="rope", rope_layout="split", **rope),
        ffn=FFNConfig(
            kind="mlp",
            activation=activation(hf.get("hidden_act"), "hidden_act"),
            hidden_dim=get(hf, "intermediate_size"),
            bias=bool(hf.get("mlp_bias", False)),
        ),
        norm=NormConfig(kind="layernorm1p", eps=number(hf, "norm_eps"), bias=True),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_std=hf.get("initializer_range", 0.0134),
    )


def exports(cfg: ModelConfig) -> bool:
    """Every decoder with a unit-offset LayerNorm (``norm.kind=layernorm1p``), which no
    other exported layout holds; export_type names what else Nemotron lacks."""
    return cfg.arch == "decoder" and cfg.norm.kind == "layernorm1p"


def export_type(cfg: ModelConfig) -> str:
    """``nemotron``, or HFCheckpointError naming what Nemotron has not (absent biases are
    written as zeros; QK-norm, windows and other families' pieces are refused by
    ``convert``)."""
    att, ffn, pos, norm = cfg.attention, cfg.ffn, cfg.position, cfg.norm
    for field, ours, theirs in (
        ("attention.kind", att.kind, "mha"),
        ("position.kind", pos.kind, "rope"),
        ("ffn.kind", ffn.kind, "mlp"),
        ("norm.placement", norm.placement, "pre"),
    ):
        if ours != theirs:
            raise unrepresentable(
                f"{field}={ours!r} (Nemotron's is {theirs!r}); norm.kind='layernorm1p' exports "
                "as nemotron only"
            )
    if pos.rope_scaling not in (None, "linear"):
        raise unrepresentable(
            f"position.rope_scaling={pos.rope_scaling!r} (Nemotron's: none or linear)"
        )
    hf_activation(ffn.activation)  # (refused by name if transformers has no such name)
    return "nemotron"


def config_to_hf(cfg: ModelConfig, model_type: str, dtype: torch.dtype) -> dict[str, Any]:
    att, pos = cfg.attention, cfg.position
    # written even when 1.0: NemotronConfig's default is 0.5
    rope = {**rope_to_hf(pos), "partial_rotary_factor": pos.rope_fraction}
    return {
        **common_config(cfg, FAMILY, model_type, dtype),
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn.hidden_size(cfg.d_model),
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": hf_activation(cfg.ffn.activation),
        "max_position_embeddings": cfg.max_seq_len,
        "norm_eps": cfg.norm.eps,
        "attention_bias": att.qkv_bias or att.out_bias,
        "mlp_bias": cfg.ffn.bias,
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
    d, f, V = cfg.d_model, cfg.ffn.hidden_size(cfg.d_model), cfg.vocab_size
    q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    att = cfg.attention
    p = prefix(src, "model.", "embed_tokens.weight")
    out: dict[str, tuple[Part, ...] | None] = {
        "tok_emb.weight": src.take(f"{p}embed_tokens.weight", (V, d)),
        "norm.weight": src.take(f"{p}norm.weight", (d,)),
        "norm.bias": src.take(f"{p}norm.bias", (d,)),
    }
    shapes = {"ffn.up": (f, d), "ffn.down": (d, f)}
    rows = (q_dim, kv_dim, kv_dim)
    for i in range(cfg.n_layers):
        hf, a = f"{p}layers.{i}.", f"blocks.{i}."
        attn = hf + "self_attn."
        out[a + "attn.qkv.weight"] = cat(
            src.take(f"{attn}{n}.weight", (r, d)) for n, r in zip(QKV, rows, strict=True)
        )
        out[a + "attn.out.weight"] = src.take(attn + "o_proj.weight", (d, q_dim))
        if att.qkv_bias:
            out[a + "attn.qkv.bias"] = cat(
                src.take(f"{attn}{n}.bias", (r,)) for n, r in zip(QKV, rows, strict=True)
            )
        if att.out_bias:
            out[a + "attn.out.bias"] = src.take(attn + "o_proj.bias", (d,))
        for theirs, ours in MLP:
            shape = shapes[ours]
            out[f"{a}{ours}.weight"] = src.take(f"{hf}{theirs}.weight", shape)
            if cfg.ffn.bias:
                out[f"{a}{ours}.bias"] = src.take(f"{hf}{theirs}.bias", shape[:1])
        for theirs, ours in NORMS:
            for kind in ("weight", "bias"):
                out[f"{a}{ours}.{kind}"] = src.take(f"{hf}{theirs}.{kind}", (d,))
    if cfg.tie_embeddings:
        src.tied("lm_head.weight", out["tok_emb.weight"])
    else:
        out["lm_head.weight"] = src.take("lm_head.weight", (V, d))
    return out  # type: ignore[return-value]  # None entries only with src.missing/wrong


def weights_from_attnlab(
    sd: dict[str, Tensor], cfg: ModelConfig, model_type: str
) -> dict[str, Tensor]:
    """Nemotron's tensors: the LayerNorms' offsets and biases (zeros where attnlab has
    none), the attention's four biases or none (zeros for a missing one), interleaved RoPE
    rows of q and k permuted to rotate-half within the rotated features."""
    d = cfg.d_model
    q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    att = cfg.attention
    interleaved = cfg.position.rope_layout == "interleaved"

    def to_split(t: Tensor, heads: int) -> Tensor:
        return rope_rows_to_split(t, heads, cfg.head_dim, cfg.rope_dim) if interleaved else t

    def qkv(t: Tensor) -> tuple[Tensor, ...]:
        q, k, v = split_rows(t, q_dim, kv_dim, kv_dim)
        return to_split(q, cfg.n_heads), to_split(k, cfg.n_kv_heads), v

    out = {
        "model.embed_tokens.weight": sd["tok_emb.weight"],
        "model.norm.weight": sd["norm.weight"],
        "model.norm.bias": or_zeros(sd, "norm.bias", d),
    }
    for i in range(cfg.n_layers):
        hf, a = f"model.layers.{i}.", f"blocks.{i}."
        attn = hf + "self_attn."
        for n, w in zip(QKV, qkv(sd[a + "attn.qkv.weight"]), strict=True):
            out[f"{attn}{n}.weight"] = w
        out[attn + "o_proj.weight"] = sd[a + "attn.out.weight"]
        if att.qkv_bias or att.out_bias:  # attention_bias: all four or none
            biases = qkv(or_zeros(sd, a + "attn.qkv.bias", q_dim + 2 * kv_dim))
            for n, b in zip(QKV, biases, strict=True):
                out[f"{attn}{n}.bias"] = b
            out[attn + "o_proj.bias"] = or_zeros(sd, a + "attn.out.bias", d)
        for theirs, ours in MLP:
            out[f"{hf}{theirs}.weight"] = sd[f"{a}{ours}.weight"]
            if cfg.ffn.bias:
                out[f"{hf}{theirs}.bias"] = sd[f"{a}{ours}.bias"]
        for theirs, ours in NORMS:
            out[f"{hf}{theirs}.weight"] = sd[f"{a}{ours}.weight"]
            out[f"{hf}{theirs}.bias"] = or_zeros(sd, f"{a}{ours}.bias", d)
    if not cfg.tie_embeddings:  # a tied weight is not stored: transformers re-ties it
        out["lm_head.weight"] = sd["lm_head.weight"]
    return out


FAMILY = Family(
    name="nemotron",
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
