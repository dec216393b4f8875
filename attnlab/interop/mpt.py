"""MPT (MosaicML 2023; ``model_type`` mpt: MptForCausalLM, MptModel): ALiBi position
biases, pre-norm blocks, no biases anywhere (its LayerNorms included: ``no_bias``), a fused
``Wqkv`` projection, the exact GELU in an MLP of ``expansion_ratio`` d, a head tied to the
embedding, no norm on the embeddings:

- scores = q . k * softmax_scale + alibi (the bias not scaled: ``position.kind='alibi'``
  as BLOOM's); ``softmax_scale`` (None: 1 / sqrt(d_h)) is ``attention.scale``;
- the slopes (``build_mpt_alibi_tensor``) are the paper's with largest bias
  ``alibi_bias_max`` (``position.alibi_max_bias``; ``nn/position_bias.py``'s
  :func:`alibi_slopes` gives its order for any number of heads). MPT biases key j by
  m_h (j - (s - 1)) over the s keys held, the same for every query; attnlab's bias is
  -m_h (i - j), i and j positions counting real tokens. For a query i of a left-padded row
  with p pads, the two differ by m_h (i - p - (s - 1)) for every key of the row: a constant
  per query row, which softmax ignores (softmax(x + c) = softmax(x)), so the weights are
  the same (padded keys are masked on both sides);
- ``clip_qkv``: the fused projection clamped to [-clip_qkv, clip_qkv]
  (``attention.clip_qkv``; 0 or null: none).

transformers' port reads less of config.json than MosaicML's own code, which trained the
checkpoints: its ``MptModel`` builds the slopes with 8 whatever ``alibi_bias_max`` says and
its MLP is 4 d wide whatever ``expansion_ratio`` says. attnlab reads both as MosaicML's code
does (the MLP's width is checked against the stored weights), and export writes only
models transformers reads the same way (``alibi_max_bias`` 8, a 4 d MLP). Dropouts as
MosaicML's code applies them: ``attn_pdrop`` on the softmax weights
(``attention.dropout``), ``resid_pdrop`` on each sublayer's output and ``emb_pdrop`` on the
embeddings (attnlab's one ``dropout``: ``io.one_dropout``; transformers' port drops the
sublayer outputs with ``attn_pdrop`` instead and never the embeddings; training only).
``learned_pos_emb`` is not read: with ALiBi there is no position embedding (transformers
builds none; a stored ``wpe`` is refused as an unexpected tensor).

Refused by name (what neither transformers' MptForCausalLM nor attnlab computes as the
checkpoint's own code would): ``attn_config`` ``alibi`` false, ``prefix_lm``,
``attn_uses_sequence_id``, ``qk_ln`` (LayerNorms on the whole q and k projections, which
transformers does not apply), llm-foundry's ``rope`` and an ``attn_type`` other than
multihead_attention;
``no_bias`` false, a ``logit_scale``, an ``embedding_fraction`` other than 1 (a scaled
gradient of the embeddings) and a ``norm_type`` other than a LayerNorm.

Weights (attnlab Linear weights are (out, in), like ``torch.nn.Linear``):

    wte                       -> tok_emb
    blocks.i.norm_1           -> attn_norm,   blocks.i.norm_2 -> ffn_norm
    blocks.i.attn.Wqkv        -> attn.qkv     rows [q; k; v] by projection, as attnlab's
    blocks.i.attn.out_proj    -> attn.out
    blocks.i.ffn.up_proj      -> ffn.up,      blocks.i.ffn.down_proj -> ffn.down
    norm_f                    -> norm,        lm_head (untied only) -> lm_head

Shapes: d d_model, h heads, d_h head dim, f feed-forward hidden size, V vocabulary size.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import Tensor

from attnlab.config import AttentionConfig, FFNConfig, ModelConfig, NormConfig, PositionConfig
from attnlab.interop.io import (
    Family,
    HFCheckpointError,
    Part,
    Plan,
    Source,
    common_config,
    get,
    one_dropout,
    prefix,
    unrepresentable,
)

ARCHITECTURES = {"mpt": ("MptForCausalLM", "MptModel")}

# transformers' MptConfig class defaults for the top-level config.json keys read here (its
# d_model, n_heads and n_layers, 2048, 16 and 24, are read beside their aliases hidden_size,
# num_attention_heads and num_hidden_layers: see _first)
DEFAULTS: dict[str, dict[str, Any]] = {
    "mpt": {
        "vocab_size": 50368,
        "expansion_ratio": 4,
        "max_seq_len": 2048,
        "layer_norm_epsilon": 1e-5,
        "resid_pdrop": 0.0,
        "emb_pdrop": 0.0,
        "no_bias": True,
        "embedding_fraction": 1.0,
        "norm_type": "low_precision_layernorm",
        "initializer_range": 0.02,
        "tie_word_embeddings": True,
    }
}
# transformers' MptAttentionConfig defaults: the attn_config keys read here (tested against
# the installed transformers in tests/test_interop_mpt.py)
ATTN_DEFAULTS: dict[str, Any] = {
    "attn_type": "multihead_attention",
    "attn_pdrop": 0,
    "clip_qkv": None,
    "softmax_scale": None,
    "prefix_lm": False,
    "qk_ln": False,
    "attn_uses_sequence_id": False,
    "alibi": True,
    "alibi_bias_max": 8,
}
MAX_BIAS = 8.0  # the largest ALiBi bias transformers' MptModel builds its slopes with
EXPANSION = 4  # transformers' MptMLP: 4 d wide
LAYERNORMS = ("low_precision_layernorm", "layernorm")  # the same maths in float32
# MPT checkpoints store no buffers (ALiBi's slopes are computed): nothing is ignored.
IGNORED = re.compile(r"(?!)")
HEAD = "lm_head.weight"


# --------------------------------------------------------------------------- configs


def _refuse(key: str, why: str) -> HFCheckpointError:
    return HFCheckpointError(f"config.json {key} is not supported: {why}")


def _first(hf: dict[str, Any], name: str, alias: str, default: int) -> Any:
    """MptConfig's ``name`` (d_model, n_heads, n_layers), or its alias (hidden_size,
    num_attention_heads, num_hidden_layers), or the class default."""
    for key in (name, alias):
        if hf.get(key) is not None:
            return hf[key]
    return default


def attn_config(hf: dict[str, Any]) -> dict[str, Any]:
    """``attn_config`` with the keys it lacks set to MptAttentionConfig's defaults."""
    given = hf.get("attn_config") or {}
    if not isinstance(given, dict):
        raise HFCheckpointError(f"config.json attn_config must be a mapping, got {given!r}")
    return {**ATTN_DEFAULTS, **given}


def _check(hf: dict[str, Any], attn: dict[str, Any]) -> None:
    """Refuse, by name, what attnlab would compute otherwise than the checkpoint's code."""
    if not attn["alibi"]:
        raise _refuse(
            "attn_config.alibi=false",
            "transformers' MPT adds ALiBi whatever it says, MosaicML's code learned positions; "
            "set it to true for ALiBi",
        )
    if attn["attn_type"] != "multihead_attention":
        raise _refuse(
            f"attn_config.attn_type={attn['attn_type']!r}",
            "transformers' MPT and attnlab's import read multihead_attention only (a fused "
            "Wqkv of 3 d_model rows)",
        )
    for key, why in (
        ("prefix_lm", "its prefix attends bidirectionally and attnlab's decoder is causal"),
        ("attn_uses_sequence_id", "it keeps packed sequences apart by token_type_ids, "
         "which transformers' MPT ignores"),
        ("qk_ln", "MosaicML's LayerNorms over the whole q and k projections are not applied "
         "by transformers' MPT"),
        ("rope", "llm-foundry's rotary embeddings are not applied by transformers' MPT"),
    ):  # fmt: skip
        if attn.get(key):
            raise _refuse(f"attn_config.{key}=true", f"{why}; set it to false")
    if hf.get("no_bias") is False:
        raise _refuse(
            "no_bias=false",
            "transformers' MPT has no biases (linear layers and LayerNorms) and would drop "
            "the checkpoint's; set it to true",
        )
    if hf.get("logit_scale") is not None:
        raise _refuse(
            f"logit_scale={hf['logit_scale']!r}",
            "transformers' MPT does not scale its logits; set it to null",
        )
    fraction = hf.get("embedding_fraction", 1.0)
    if fraction != 1.0:
        raise _refuse(
            f"embedding_fraction={fraction!r}",
            "attnlab does not scale the embeddings' gradient (transformers' MPT ignores it); "
            "set it to 1.0",
        )
    norm = hf.get("norm_type") or "low_precision_layernorm"
    if norm not in LAYERNORMS:
        raise _refuse(
            f"norm_type={norm!r}",
            f"transformers' MPT normalises with a LayerNorm; use {' or '.join(LAYERNORMS)}",
        )


def config_from_hf(hf: dict[str, Any], model_type: str = "mpt") -> ModelConfig:
    attn = attn_config(hf)
    _check(hf, attn)
    d = _first(hf, "d_model", "hidden_size", 2048)
    ratio = hf.get("expansion_ratio", EXPANSION)
    hidden = ratio * d
    if isinstance(ratio, bool) or hidden != int(hidden) or hidden <= 0:
        raise _refuse(
            f"expansion_ratio={ratio!r}",
            f"the MLP's width, expansion_ratio * d_model = {hidden}, must be a positive whole "
            "number",
        )
    return ModelConfig(
        vocab_size=get(hf, "vocab_size"),
        max_seq_len=get(hf, "max_seq_len"),
        d_model=d,
        n_layers=_first(hf, "n_layers", "num_hidden_layers", 24),
        attention=AttentionConfig(
            n_heads=_first(hf, "n_heads", "num_attention_heads", 16),
            dropout=attn["attn_pdrop"] or 0.0,
            scale=attn["softmax_scale"],
            clip_qkv=attn["clip_qkv"] or None,  # 0: no clamp (transformers' `if clip_qkv`)
        ),
        position=PositionConfig(kind="alibi", alibi_max_bias=float(attn["alibi_bias_max"])),
        ffn=FFNConfig(kind="mlp", activation="gelu", hidden_dim=int(hidden), bias=False),
        norm=NormConfig(
            kind="layernorm", eps=hf.get("layer_norm_epsilon", 1e-5), bias=False, placement="pre"
        ),
        dropout=one_dropout(hf, "resid_pdrop", "emb_pdrop"),
        tie_embeddings=hf.get("tie_word_embeddings", True),
        init_std=hf.get("initializer_range", 0.02),
    )


def exports(cfg: ModelConfig) -> bool:
    """ALiBi decoders whose bias is added after the scale (Falcon-RW scales it) with no norm
    on the embeddings (BLOOM has one), LayerNorm and an MLP in pre-norm blocks."""
    return (
        cfg.arch == "decoder"
        and cfg.attention.kind == "mha"
        and cfg.position.kind == "alibi"
        and not cfg.position.alibi_scaled
        and not cfg.embedding_norm
        and cfg.norm.kind == "layernorm"
        and cfg.norm.placement == "pre"
        and cfg.ffn.kind == "mlp"
    )


def export_type(cfg: ModelConfig) -> str:
    """``mpt``, or HFCheckpointError naming what transformers' MPT has not."""
    att, pos, d = cfg.attention, cfg.position, cfg.d_model
    biases = [
        name
        for name, on in (
            ("attention.qkv_bias", att.qkv_bias),
            ("attention.out_bias", att.out_bias),
            ("ffn.bias", cfg.ffn.bias),
            ("norm.bias", cfg.norm.bias),
        )
        if on
    ]
    problems = [
        (bool(biases), f"{biases[0] if biases else ''} (MPT has no biases, its LayerNorms' "
         "included)"),
        (pos.alibi_max_bias != MAX_BIAS,
         f"position.alibi_max_bias={pos.alibi_max_bias} (transformers' MPT builds its slopes "
         "with 8 whatever alibi_bias_max says)"),
        (pos.alibi_bfloat16, "position.alibi_bfloat16 (MPT's bias is not rounded)"),
        (cfg.n_kv_heads != cfg.n_heads,
         f"attention.n_kv_heads={cfg.n_kv_heads} (MPT has one key/value head per query head)"),
        (cfg.head_dim * cfg.n_heads != d,
         f"attention.head_dim={cfg.head_dim} (MPT's heads are d_model / n_heads wide)"),
        (cfg.ffn.hidden_size(d) != EXPANSION * d,
         f"ffn.hidden_dim={cfg.ffn.hidden_size(d)} (transformers' MPT MLP is 4 d_model = "
         f"{EXPANSION * d} wide whatever expansion_ratio says)"),
        (cfg.ffn.activation != "gelu",
         f"ffn.activation={cfg.ffn.activation!r} (MPT's is the exact GELU, 'gelu')"),
        (att.dropout != 0.0,
         f"attention.dropout={att.dropout} (transformers' MptAttentionConfig takes a whole "
         "number for attn_pdrop: 0)"),
    ]  # fmt: skip
    for found, what in problems:
        if found:
            raise unrepresentable(what)
    return "mpt"


def config_to_hf(cfg: ModelConfig, model_type: str, dtype: torch.dtype) -> dict[str, Any]:
    att = cfg.attention
    return {
        **common_config(cfg, FAMILY, model_type, dtype),
        "d_model": cfg.d_model,
        "n_layers": cfg.n_layers,
        "n_heads": cfg.n_heads,
        "expansion_ratio": EXPANSION,
        "max_seq_len": cfg.max_seq_len,
        "layer_norm_epsilon": cfg.norm.eps,
        "no_bias": True,
        "learned_pos_emb": False,  # ALiBi: no position embedding
        "norm_type": "low_precision_layernorm",
        "embedding_fraction": 1.0,
        "logit_scale": None,
        "resid_pdrop": cfg.dropout,
        "emb_pdrop": cfg.dropout,
        "attn_config": {
            **ATTN_DEFAULTS,
            "attn_pdrop": 0,  # (an integer: transformers refuses 0.0)
            "clip_qkv": None if att.clip_qkv is None else float(att.clip_qkv),
            "softmax_scale": None if att.scale is None else float(att.scale),
            "alibi_bias_max": int(MAX_BIAS),
        },
    }


# --------------------------------------------------------------------------- weights

NORMS = (("norm_1", "attn_norm"), ("norm_2", "ffn_norm"))
LINEARS = (  # (MPT's, attnlab's): the same rows, Wqkv's [q; k; v] as attn.qkv's
    ("attn.Wqkv", "attn.qkv"),
    ("attn.out_proj", "attn.out"),
    ("ffn.up_proj", "ffn.up"),
    ("ffn.down_proj", "ffn.down"),
)


def _shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    d, f = cfg.d_model, cfg.ffn.hidden_size(cfg.d_model)
    return {"attn.qkv": (3 * d, d), "attn.out": (d, d), "ffn.up": (f, d), "ffn.down": (d, f)}


def weights_to_attnlab(src: Source, cfg: ModelConfig) -> Plan:
    d, V, shapes = cfg.d_model, cfg.vocab_size, _shapes(cfg)
    p = prefix(src, "transformer.", "wte.weight")
    out: dict[str, tuple[Part, ...] | None] = {
        "tok_emb.weight": src.take(f"{p}wte.weight", (V, d)),
        "norm.weight": src.take(f"{p}norm_f.weight", (d,)),
    }
    for i in range(cfg.n_layers):
        hf, a = f"{p}blocks.{i}.", f"blocks.{i}."
        for theirs, ours in LINEARS:
            out[f"{a}{ours}.weight"] = src.take(f"{hf}{theirs}.weight", shapes[ours])
        for theirs, ours in NORMS:
            out[f"{a}{ours}.weight"] = src.take(f"{hf}{theirs}.weight", (d,))
    if cfg.tie_embeddings:
        src.tied(HEAD, out["tok_emb.weight"])
    else:
        out["lm_head.weight"] = src.take(HEAD, (V, d))
    return out  # type: ignore[return-value]  # None entries only with src.missing/wrong


def weights_from_attnlab(
    sd: dict[str, Tensor], cfg: ModelConfig, model_type: str
) -> dict[str, Tensor]:
    out = {
        "transformer.wte.weight": sd["tok_emb.weight"],
        "transformer.norm_f.weight": sd["norm.weight"],
    }
    for i in range(cfg.n_layers):
        hf, a = f"transformer.blocks.{i}.", f"blocks.{i}."
        for theirs, ours in LINEARS:
            out[f"{hf}{theirs}.weight"] = sd[f"{a}{ours}.weight"]
        for theirs, ours in NORMS:
            out[f"{hf}{theirs}.weight"] = sd[f"{a}{ours}.weight"]
    if not cfg.tie_embeddings:  # a tied head is not stored: transformers re-ties it
        out[HEAD] = sd["lm_head.weight"]
    return out


FAMILY = Family(
    name="mpt",
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
