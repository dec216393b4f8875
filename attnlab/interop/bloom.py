"""BLOOM (``model_type`` bloom: BloomForCausalLM, BloomModel): ALiBi position biases, a
LayerNorm on the token embeddings, pre-norm blocks, LayerNorms and linear layers with
biases, the tanh-approximate GELU in a 4 d MLP, a head tied to the embedding:

- scores = q . k / sqrt(d_h) + alibi (transformers' ``alibi.baddbmm(q, k^T, beta=1,
  alpha=1/sqrt(d_h))``): the bias is not scaled with q . k (``position.kind='alibi'``,
  Falcon-RW's scaled one is ``alibi_scaled``); BLOOM's slopes are the paper's with
  largest bias 8 (``_get_alibi_slopes``: ``nn/position_bias.py``'s :func:`alibi_slopes`),
  each key's position counted over real tokens (``cumsum(mask) - 1``: attnlab's positions);
- ``word_embeddings_layernorm``: ``embedding_norm``;
- ``bloom_gelu``: 0.5 x (1 + tanh(0.79788456 x (1 + 0.044715 x^2))), ``gelu_tanh`` (the
  constant is sqrt(2 / pi) rounded to 8 digits: the two differ by ~1e-9 relative).

Refused by name: ``apply_residual_connection_post_layernorm`` true (the normed input as
each residual), ``pretraining_tp`` > 1 with ``slow_but_exact`` (Megatron's sliced sums of
the output projections; without ``slow_but_exact`` the slices are not read), and a
``hidden_dropout`` other than 0 (BLOOM drops each sublayer's output but not the
embeddings; attnlab's ``dropout`` drops both). ``attention_dropout`` (on the softmax
weights) is ``attention.dropout``. BLOOM has no context length in its config: attnlab's
``max_seq_len`` (the default cache size; ALiBi itself has no limit) is read from a
``seq_length`` key, which export writes, else 2048 (BLOOM's training sequences).

Weights (attnlab Linear weights are (out, in), like ``torch.nn.Linear``):

    word_embeddings                -> tok_emb,  word_embeddings_layernorm -> emb_norm
    h.i.input_layernorm            -> attn_norm, h.i.post_attention_layernorm -> ffn_norm
    h.i.self_attention.query_key_value -> attn.qkv  rows (h, 3, d_h) stored (GPT-NeoX's
                                          order), [q; k; v] in attnlab
    h.i.self_attention.dense       -> attn.out
    h.i.mlp.dense_h_to_4h          -> ffn.up,   h.i.mlp.dense_4h_to_h -> ffn.down
    ln_f                           -> norm,     lm_head (untied only) -> lm_head

Shapes: d d_model, h heads, d_h head dim, f feed-forward hidden size (4 d), V vocabulary
size.
"""

from __future__ import annotations

import re
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
    common_config,
    get,
    or_zeros,
    prefix,
    split_rows,
    unrepresentable,
)

ARCHITECTURES = {"bloom": ("BloomForCausalLM", "BloomModel")}

# transformers' BloomConfig class defaults for the config.json keys read here (its n_layer
# and n_head, 2 and 8, are read beside their aliases num_hidden_layers and
# num_attention_heads: see _first)
DEFAULTS: dict[str, dict[str, Any]] = {
    "bloom": {
        "vocab_size": 250880,
        "hidden_size": 64,
        "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02,
        "apply_residual_connection_post_layernorm": False,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "pretraining_tp": 1,
        "slow_but_exact": False,
        "tie_word_embeddings": True,
    }
}
CONTEXT = 2048  # max_seq_len where config.json names none (BLOOM's training sequences)
MAX_BIAS = 8.0  # BLOOM's slopes: 2^(-8 h / n)
# BLOOM checkpoints store no buffers (ALiBi's slopes are computed): nothing is ignored.
IGNORED = re.compile(r"(?!)")
HEAD = "lm_head.weight"


# --------------------------------------------------------------------------- configs


def _refuse(key: str, why: str) -> HFCheckpointError:
    return HFCheckpointError(f"config.json {key} is not supported: {why}")


def _first(hf: dict[str, Any], name: str, alias: str, default: int) -> Any:
    """BloomConfig's ``name`` (n_layer, n_head), or its alias (num_hidden_layers,
    num_attention_heads), or the class default."""
    for key in (name, alias):
        if hf.get(key) is not None:
            return hf[key]
    return default


def config_from_hf(hf: dict[str, Any], model_type: str = "bloom") -> ModelConfig:
    if hf.get("apply_residual_connection_post_layernorm"):
        raise _refuse(
            "apply_residual_connection_post_layernorm=true",
            "its blocks add each sublayer's output to the normed input, not to the block's "
            "input as attnlab's pre-norm blocks do; set it to false",
        )
    tp = hf.get("pretraining_tp") or 1
    if tp > 1 and hf.get("slow_but_exact"):
        raise _refuse(
            f"pretraining_tp={tp} with slow_but_exact=true",
            "the output projections summed in Megatron's slices round differently from one "
            "matmul; set slow_but_exact to false (the same weights, one matmul each)",
        )
    dropout = hf.get("hidden_dropout") or 0.0
    if dropout:
        raise _refuse(
            f"hidden_dropout={dropout!r}",
            "BLOOM drops each sublayer's output but not the embeddings, and attnlab's "
            "dropout drops both; set it to 0.0",
        )
    d = hf.get("n_embed") or get(hf, "hidden_size")  # (n_embed: BloomConfig's old name)
    return ModelConfig(
        vocab_size=get(hf, "vocab_size"),
        max_seq_len=hf.get("seq_length") or CONTEXT,
        d_model=d,
        n_layers=_first(hf, "n_layer", "num_hidden_layers", 2),
        attention=AttentionConfig(
            n_heads=_first(hf, "n_head", "num_attention_heads", 8),
            qkv_bias=True,
            out_bias=True,
            dropout=hf.get("attention_dropout") or 0.0,
        ),
        position=PositionConfig(kind="alibi", alibi_max_bias=MAX_BIAS),
        ffn=FFNConfig(kind="mlp", activation="gelu_tanh", hidden_dim=4 * d, bias=True),
        norm=NormConfig(
            kind="layernorm", eps=hf.get("layer_norm_epsilon", 1e-5), bias=True, placement="pre"
        ),
        embedding_norm=True,
        tie_embeddings=hf.get("tie_word_embeddings", True),
        init_std=hf.get("initializer_range", 0.02),
    )


def exports(cfg: ModelConfig) -> bool:
    """ALiBi decoders whose bias is added after the scale (BLOOM's; Falcon-RW scales it,
    ``position.alibi_scaled``) with a norm on the embeddings (MPT has none), LayerNorm and an
    MLP in pre-norm blocks."""
    return (
        cfg.arch == "decoder"
        and cfg.attention.kind == "mha"
        and cfg.position.kind == "alibi"
        and not cfg.position.alibi_scaled
        and cfg.embedding_norm
        and cfg.norm.kind == "layernorm"
        and cfg.norm.placement == "pre"
        and cfg.ffn.kind == "mlp"
    )


def export_type(cfg: ModelConfig) -> str:
    """``bloom``, or HFCheckpointError naming what BLOOM has not (absent biases are written
    as zeros)."""
    pos, d = cfg.position, cfg.d_model
    problems = [
        (pos.alibi_max_bias != MAX_BIAS,
         f"position.alibi_max_bias={pos.alibi_max_bias} (BLOOM's slopes have 8)"),
        (pos.alibi_bfloat16, "position.alibi_bfloat16 (BLOOM's bias is not rounded)"),
        (cfg.n_kv_heads != cfg.n_heads,
         f"attention.n_kv_heads={cfg.n_kv_heads} (BLOOM has one key/value head per query head)"),
        (cfg.head_dim * cfg.n_heads != d,
         f"attention.head_dim={cfg.head_dim} (BLOOM's heads are d_model / n_heads wide)"),
        (cfg.ffn.hidden_size(d) != 4 * d,
         f"ffn.hidden_dim={cfg.ffn.hidden_size(d)} (BLOOM's MLP is 4 d_model = {4 * d} wide)"),
        (cfg.ffn.activation != "gelu_tanh",
         f"ffn.activation={cfg.ffn.activation!r} (BLOOM's is the tanh GELU, 'gelu_tanh')"),
        (cfg.dropout != 0.0, f"dropout={cfg.dropout} (BLOOM does not drop its embeddings)"),
        (cfg.attention.scale is not None,
         f"attention.scale={cfg.attention.scale} (BLOOM's is 1 / sqrt(d_h))"),
    ]  # fmt: skip
    for found, what in problems:
        if found:
            raise unrepresentable(what)
    return "bloom"


def config_to_hf(cfg: ModelConfig, model_type: str, dtype: torch.dtype) -> dict[str, Any]:
    return {
        **common_config(cfg, FAMILY, model_type, dtype),
        "hidden_size": cfg.d_model,
        "n_layer": cfg.n_layers,
        "n_head": cfg.n_heads,
        "layer_norm_epsilon": cfg.norm.eps,
        "apply_residual_connection_post_layernorm": False,
        "hidden_dropout": 0.0,
        "attention_dropout": cfg.attention.dropout,
        "pretraining_tp": 1,
        "slow_but_exact": False,
        "seq_length": cfg.max_seq_len,  # (attnlab's; transformers keeps it, unread)
    }


# --------------------------------------------------------------------------- weights

NORMS = (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ffn_norm"))


def weights_to_attnlab(src: Source, cfg: ModelConfig) -> Plan:
    d, f, V, h = cfg.d_model, cfg.ffn.hidden_size(cfg.d_model), cfg.vocab_size, cfg.n_heads
    p = prefix(src, "transformer.", "word_embeddings.weight")
    out: dict[str, tuple[Part, ...] | None] = {
        "tok_emb.weight": src.take(f"{p}word_embeddings.weight", (V, d)),
        "emb_norm.weight": src.take(f"{p}word_embeddings_layernorm.weight", (d,)),
        "emb_norm.bias": src.take(f"{p}word_embeddings_layernorm.bias", (d,)),
        "norm.weight": src.take(f"{p}ln_f.weight", (d,)),
        "norm.bias": src.take(f"{p}ln_f.bias", (d,)),
    }
    for i in range(cfg.n_layers):
        hf, a = f"{p}h.{i}.", f"blocks.{i}."
        qkv = hf + "self_attention.query_key_value."
        out |= {
            # rows (h, 3, d_h) stored: each head's q, k, v together
            a + "attn.qkv.weight": src.take(qkv + "weight", (3 * d, d), per_head=(3, h)),
            a + "attn.qkv.bias": src.take(qkv + "bias", (3 * d,), per_head=(3, h)),
            a + "attn.out.weight": src.take(hf + "self_attention.dense.weight", (d, d)),
            a + "attn.out.bias": src.take(hf + "self_attention.dense.bias", (d,)),
            a + "ffn.up.weight": src.take(hf + "mlp.dense_h_to_4h.weight", (f, d)),
            a + "ffn.up.bias": src.take(hf + "mlp.dense_h_to_4h.bias", (f,)),
            a + "ffn.down.weight": src.take(hf + "mlp.dense_4h_to_h.weight", (d, f)),
            a + "ffn.down.bias": src.take(hf + "mlp.dense_4h_to_h.bias", (d,)),
        }
        for hf_name, name in NORMS:
            out[f"{a}{name}.weight"] = src.take(f"{hf}{hf_name}.weight", (d,))
            out[f"{a}{name}.bias"] = src.take(f"{hf}{hf_name}.bias", (d,))
    if cfg.tie_embeddings:
        src.tied(HEAD, out["tok_emb.weight"])
    else:
        out["lm_head.weight"] = src.take(HEAD, (V, d))
    return out  # type: ignore[return-value]  # None entries only with src.missing/wrong


def weights_from_attnlab(
    sd: dict[str, Tensor], cfg: ModelConfig, model_type: str
) -> dict[str, Tensor]:
    d, f, h = cfg.d_model, cfg.ffn.hidden_size(cfg.d_model), cfg.n_heads

    def bias(name: str, size: int) -> Tensor:  # BLOOM's linear layers and norms have biases
        return or_zeros(sd, name, size)

    def qkv(t: Tensor) -> Tensor:  # [q; k; v] -> head by head
        return heads_together(torch.cat(split_rows(t, d, d, d)), h)

    out = {
        "transformer.word_embeddings.weight": sd["tok_emb.weight"],
        "transformer.word_embeddings_layernorm.weight": sd["emb_norm.weight"],
        "transformer.word_embeddings_layernorm.bias": bias("emb_norm.bias", d),
        "transformer.ln_f.weight": sd["norm.weight"],
        "transformer.ln_f.bias": bias("norm.bias", d),
    }
    for i in range(cfg.n_layers):
        hf, a = f"transformer.h.{i}.", f"blocks.{i}."
        attn = hf + "self_attention."
        out |= {
            attn + "query_key_value.weight": qkv(sd[a + "attn.qkv.weight"]),
            attn + "query_key_value.bias": qkv(bias(a + "attn.qkv.bias", 3 * d)),
            attn + "dense.weight": sd[a + "attn.out.weight"],
            attn + "dense.bias": bias(a + "attn.out.bias", d),
            hf + "mlp.dense_h_to_4h.weight": sd[a + "ffn.up.weight"],
            hf + "mlp.dense_h_to_4h.bias": bias(a + "ffn.up.bias", f),
            hf + "mlp.dense_4h_to_h.weight": sd[a + "ffn.down.weight"],
            hf + "mlp.dense_4h_to_h.bias": bias(a + "ffn.down.bias", d),
        }
        for hf_name, name in NORMS:
            out[f"{hf}{hf_name}.weight"] = sd[f"{a}{name}.weight"]
            out[f"{hf}{hf_name}.bias"] = bias(f"{a}{name}.bias", d)
    if not cfg.tie_embeddings:  # a tied head is not stored: transformers re-ties it
        out[HEAD] = sd["lm_head.weight"]
    return out


FAMILY = Family(
    name="bloom",
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
