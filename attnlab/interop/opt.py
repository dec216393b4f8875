"""OPT (``model_type`` opt: OPTForCausalLM, Zhang et al. 2022): learned positions, LayerNorm,
a ReLU MLP, separate q/k/v projections, a head tied to the embedding.

- Positions: transformers' OPTLearnedPositionalEmbedding has ``max_position_embeddings + 2``
  rows and looks a token up at ``cumsum(mask) * mask - 1 + 2``: a row's first real token at
  row 2 whatever padding precedes it, padding at row 1, row 0 never. attnlab's learned
  table holds ``max_seq_len`` rows and numbers a left-padded row's real tokens from 0 the
  same way, so import reads rows 2.. of the table and drops the two offset rows (row 1
  touches padding tokens only, whose outputs no real token reads); export writes them as
  zeros.
- ``do_layer_norm_before``: pre-norm blocks (true) with a final LayerNorm, or post-norm
  blocks (false, ``norm.placement='post'``: ``norm(x + f(x))``) without one.
- ``enable_bias``: biases on q, k, v, out_proj, fc1 and fc2 all or none (a missing one
  written as zeros on export); the LayerNorms are always biased, of eps 1e-5 (nn.LayerNorm's).
- The query is scaled by d_h^-1/2 before q k^T (transformers' OPTAttention), the same
  product as scaling the scores, to float32 rounding.
- Dropout: ``dropout`` drops each sublayer's output and never the embeddings, which
  attnlab's one ``dropout`` also drops (a warning where it is not 0: training only);
  ``attention_dropout`` is ``attention.dropout``; ``layerdrop`` (skipping whole layers
  while training) is read as 0 with a warning.
- Refused by name: ``word_embed_proj_dim`` other than ``hidden_size`` (OPT-350m's
  ``project_in`` / ``project_out`` around the stack), ``layer_norm_elementwise_affine``
  false (LayerNorms without weights), ``_remove_final_layer_norm`` in pre-norm blocks.
- transformers gives the token embedding ``padding_idx=pad_token_id``, which zeroes that
  row's gradient; attnlab trains it (the padding's outputs are masked from every loss).

Export takes the learned-position decoders in OPT's layout: post-norm blocks (GPT-2 has
pre-norm ones only) and pre-norm ones with a ReLU MLP (GPT-2's are GELU) and one key/value
head per query head (GPT-BigCode takes the multi-query ones).

Weights, HF (``model.decoder.``; ``decoder.`` in headless OPTModel files) -> attnlab:

    embed_tokens.weight                         (V, d)     -> tok_emb.weight
    embed_positions.weight                      (L + 2, d) -> pos_emb.weight (rows 2..)
    final_layer_norm.{weight,bias}              (d,)       -> norm (pre-norm only)
    layers.{i}.self_attn.{q,k,v}_proj           (d, d)     -> blocks.{i}.attn.qkv ([q; k; v])
    layers.{i}.self_attn.out_proj               (d, d)     -> blocks.{i}.attn.out
    layers.{i}.self_attn_layer_norm             (d,)       -> blocks.{i}.attn_norm
    layers.{i}.fc1, fc2                         (f, d), (d, f) -> blocks.{i}.ffn.up, ffn.down
    layers.{i}.final_layer_norm                 (d,)       -> blocks.{i}.ffn_norm
    lm_head.weight                              (V, d)     -> lm_head.weight (untied only)

Shapes: d d_model, f feed-forward hidden size, V vocabulary size, L max positions.
"""

from __future__ import annotations

import re
import warnings
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
    activation,
    cat,
    common_config,
    get,
    hf_activation,
    one_dropout,
    or_zeros,
    prefix,
    unrepresentable,
)

ARCHITECTURES = {"opt": ("OPTForCausalLM", "OPTModel")}

# transformers' OPTConfig class defaults for the config.json keys read here
# (word_embed_proj_dim, None there, is left out: read as missing, hidden_size).
DEFAULTS: dict[str, dict[str, Any]] = {
    "opt": {
        "vocab_size": 50272,
        "hidden_size": 768,
        "num_hidden_layers": 12,
        "ffn_dim": 3072,
        "max_position_embeddings": 2048,
        "do_layer_norm_before": True,
        "_remove_final_layer_norm": False,
        "dropout": 0.1,
        "attention_dropout": 0.0,
        "num_attention_heads": 12,
        "activation_function": "relu",
        "layerdrop": 0.0,
        "init_std": 0.02,
        "enable_bias": True,
        "layer_norm_elementwise_affine": True,
        "tie_word_embeddings": True,
    }
}

OFFSET = 2  # OPTLearnedPositionalEmbedding's rows before position 0
EPS = 1e-5  # nn.LayerNorm's default: OPT's LayerNorms have no eps setting
IGNORED = re.compile(r"$^")  # OPT saves no buffers

# --------------------------------------------------------------------------- configs


def config_from_hf(hf: dict[str, Any], model_type: str = "opt") -> ModelConfig:
    d, n_heads = get(hf, "hidden_size"), get(hf, "num_attention_heads")
    if d % n_heads:
        raise HFCheckpointError(
            f"config.json hidden_size={d} is not divisible by num_attention_heads={n_heads} "
            "(OPT's heads split hidden_size evenly)"
        )
    proj = hf.get("word_embed_proj_dim")
    if proj is not None and proj != d:
        raise HFCheckpointError(
            f"config.json word_embed_proj_dim={proj} differs from hidden_size={d} (OPT-350m's "
            "project_in/project_out around the stack): attnlab's embeddings are d_model wide; "
            "only OPT models with word_embed_proj_dim == hidden_size are supported"
        )
    if not hf.get("layer_norm_elementwise_affine", True):
        raise HFCheckpointError(
            "config.json layer_norm_elementwise_affine=false (LayerNorms without weights or "
            "biases) is not supported: attnlab's LayerNorms have a weight; set it to true"
        )
    pre = bool(hf.get("do_layer_norm_before", True))
    if pre and hf.get("_remove_final_layer_norm", False):
        raise HFCheckpointError(
            "config.json _remove_final_layer_norm=true with do_layer_norm_before=true (pre-norm "
            "blocks without a final LayerNorm) is not supported: attnlab's pre-norm decoders "
            "end in a norm"
        )
    if hf.get("layerdrop"):
        warnings.warn(
            f"config.json layerdrop={hf['layerdrop']}: attnlab has no LayerDrop (skipping "
            "whole layers while training) and trains every layer (evaluation and generation "
            "are unaffected)",
            stacklevel=3,
        )
    bias = bool(hf.get("enable_bias", True))
    return ModelConfig(
        vocab_size=get(hf, "vocab_size"),
        max_seq_len=get(hf, "max_position_embeddings"),
        d_model=d,
        n_layers=get(hf, "num_hidden_layers"),
        attention=AttentionConfig(
            n_heads=n_heads,
            qkv_bias=bias,
            out_bias=bias,
            dropout=hf.get("attention_dropout") or 0.0,
        ),
        position=PositionConfig(kind="learned"),
        ffn=FFNConfig(
            kind="mlp",
            activation=activation(hf.get("activation_function", "relu"), "activation_function"),
            hidden_dim=get(hf, "ffn_dim"),
            bias=bias,
        ),
        norm=NormConfig(kind="layernorm", eps=EPS, bias=True, placement="pre" if pre else "post"),
        tie_embeddings=hf.get("tie_word_embeddings", True),
        dropout=one_dropout(hf, "dropout", None),  # (OPT drops no embeddings)
        init_std=hf.get("init_std", 0.02),
    )


def exports(cfg: ModelConfig) -> bool:
    """Learned-position multi-head decoders in OPT's layout: post-norm blocks (GPT-2's are
    pre-norm), or pre-norm ones with a ReLU feed-forward (GPT-2's is GELU) and one key/value
    head per query head (fewer: GPT-BigCode's, gpt_bigcode.py)."""
    placement, relu = cfg.norm.placement, cfg.ffn.activation == "relu"
    return (
        cfg.arch == "decoder"
        and cfg.attention.kind == "mha"
        and cfg.position.kind == "learned"
        and (placement == "post" or (placement == "pre" and relu and cfg.n_kv_heads == cfg.n_heads))
    )


def export_type(cfg: ModelConfig) -> str:
    """``opt``, or HFCheckpointError naming what OPT lacks. Windows, QK-norm, a head bias
    and other families' pieces are refused by ``convert`` for every family that lacks them."""
    if cfg.norm.kind != "layernorm" or cfg.ffn.kind != "mlp":
        raise unrepresentable(
            f"learned positions need LayerNorm and an MLP feed-forward (OPT, GPT-2), got "
            f"norm.kind={cfg.norm.kind!r} and ffn.kind={cfg.ffn.kind!r}"
        )
    if cfg.n_kv_heads != cfg.n_heads or cfg.head_dim * cfg.n_heads != cfg.d_model:
        raise unrepresentable("OPT needs n_kv_heads == n_heads and head_dim * n_heads == d_model")
    if cfg.norm.eps != EPS:
        raise unrepresentable(
            f"norm.eps={cfg.norm.eps} (OPT's LayerNorms have torch's default eps {EPS}, which "
            "config.json cannot change)"
        )
    hf_activation(cfg.ffn.activation)  # (refused by name if transformers has no such name)
    return "opt"


def config_to_hf(cfg: ModelConfig, model_type: str, dtype: torch.dtype) -> dict[str, Any]:
    att = cfg.attention
    return {
        **common_config(cfg, FAMILY, model_type, dtype),
        "hidden_size": cfg.d_model,
        "word_embed_proj_dim": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "ffn_dim": cfg.ffn.hidden_size(cfg.d_model),
        "max_position_embeddings": cfg.max_seq_len,
        "activation_function": hf_activation(cfg.ffn.activation),
        "do_layer_norm_before": cfg.norm.placement == "pre",
        "_remove_final_layer_norm": False,
        "enable_bias": att.qkv_bias or att.out_bias or cfg.ffn.bias,
        "layer_norm_elementwise_affine": True,
        "dropout": cfg.dropout,
        "attention_dropout": att.dropout,
        "layerdrop": 0.0,
        "init_std": cfg.init_std,
    }


# --------------------------------------------------------------------------- weights

_LINEARS = (("self_attn.out_proj", "attn.out"), ("fc1", "ffn.up"), ("fc2", "ffn.down"))
_NORMS = (("self_attn_layer_norm", "attn_norm"), ("final_layer_norm", "ffn_norm"))


def weights_to_attnlab(src: Source, cfg: ModelConfig) -> Plan:
    d, f, V, L = cfg.d_model, cfg.ffn.hidden_size(cfg.d_model), cfg.vocab_size, cfg.max_seq_len
    att, bias = cfg.attention, cfg.ffn.bias
    p = prefix(src, "model.", "decoder.embed_tokens.weight") + "decoder."
    # (rows 0 and 1 precede position 0: dropped)
    pos = src.take(f"{p}embed_positions.weight", (L + OFFSET, d), rows=(OFFSET, L + OFFSET))
    out: dict[str, tuple[Part, ...] | None] = {
        "tok_emb.weight": src.take(f"{p}embed_tokens.weight", (V, d)),
        "pos_emb.weight": pos,
    }
    if cfg.norm.placement == "pre":  # (post-norm blocks end in their own norm)
        out["norm.weight"] = src.take(f"{p}final_layer_norm.weight", (d,))
        out["norm.bias"] = src.take(f"{p}final_layer_norm.bias", (d,))
    shapes = {"attn.out": (d, d), "ffn.up": (f, d), "ffn.down": (d, f)}
    for i in range(cfg.n_layers):
        h, a = f"{p}layers.{i}.", f"blocks.{i}."
        qkv = [f"{h}self_attn.{n}_proj." for n in "qkv"]
        out[a + "attn.qkv.weight"] = cat(src.take(n + "weight", (d, d)) for n in qkv)
        if att.qkv_bias:
            out[a + "attn.qkv.bias"] = cat(src.take(n + "bias", (d,)) for n in qkv)
        for hf_name, ours in _LINEARS:
            out[f"{a}{ours}.weight"] = src.take(f"{h}{hf_name}.weight", shapes[ours])
            if att.out_bias if ours == "attn.out" else bias:
                out[f"{a}{ours}.bias"] = src.take(f"{h}{hf_name}.bias", shapes[ours][:1])
        for hf_name, ours in _NORMS:
            out[f"{a}{ours}.weight"] = src.take(f"{h}{hf_name}.weight", (d,))
            out[f"{a}{ours}.bias"] = src.take(f"{h}{hf_name}.bias", (d,))
    if cfg.tie_embeddings:
        src.tied("lm_head.weight", out["tok_emb.weight"])
    else:
        out["lm_head.weight"] = src.take("lm_head.weight", (V, d))
    return out  # type: ignore[return-value]  # None entries only with src.missing/wrong


def weights_from_attnlab(
    sd: dict[str, Tensor], cfg: ModelConfig, model_type: str
) -> dict[str, Tensor]:
    """OPT's tensors: the position table with two zero rows before position 0 (transformers
    reads row 1 for padding tokens only and row 0 never), biases on every projection or
    none (zeros for a missing one), the LayerNorms' always."""
    d, f = cfg.d_model, cfg.ffn.hidden_size(cfg.d_model)
    att = cfg.attention
    bias = att.qkv_bias or att.out_bias or cfg.ffn.bias
    table = sd["pos_emb.weight"]
    p = "model.decoder."
    out = {
        f"{p}embed_tokens.weight": sd["tok_emb.weight"],
        f"{p}embed_positions.weight": torch.cat((table.new_zeros(OFFSET, d), table)),
    }
    if cfg.norm.placement == "pre":
        out[f"{p}final_layer_norm.weight"] = sd["norm.weight"]
        out[f"{p}final_layer_norm.bias"] = or_zeros(sd, "norm.bias", d)
    sizes = {"attn.out": d, "ffn.up": f, "ffn.down": d}
    for i in range(cfg.n_layers):
        h, a = f"{p}layers.{i}.", f"blocks.{i}."
        names = [f"{h}self_attn.{n}_proj." for n in "qkv"]
        for name, w in zip(names, sd[a + "attn.qkv.weight"].chunk(3), strict=True):
            out[name + "weight"] = w
        if bias:
            qkv_bias = or_zeros(sd, a + "attn.qkv.bias", 3 * d)
            for name, b in zip(names, qkv_bias.chunk(3), strict=True):
                out[name + "bias"] = b
        for hf_name, ours in _LINEARS:
            out[f"{h}{hf_name}.weight"] = sd[f"{a}{ours}.weight"]
            if bias:
                out[f"{h}{hf_name}.bias"] = or_zeros(sd, f"{a}{ours}.bias", sizes[ours])
        for hf_name, ours in _NORMS:
            out[f"{h}{hf_name}.weight"] = sd[f"{a}{ours}.weight"]
            out[f"{h}{hf_name}.bias"] = or_zeros(sd, f"{a}{ours}.bias", d)
    if not cfg.tie_embeddings:  # a tied head is not stored: transformers re-ties it
        out["lm_head.weight"] = sd["lm_head.weight"]
    return out


FAMILY = Family(
    name="opt",
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
