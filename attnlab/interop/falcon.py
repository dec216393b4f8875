"""Falcon (``model_type`` falcon: FalconForCausalLM, FalconModel): LayerNorms with bias, a
GELU MLP, RoPE on whole heads (rotate-half pairs), one ``bias`` switch for every linear
layer, a head tied to the embedding by default, and three block layouts, read as
transformers' FalconDecoderLayer runs them:

- ``new_decoder_architecture`` false, ``parallel_attn`` true (Falcon-7B): one
  ``input_layernorm`` read by attention and MLP side by side, x + attn(ln(x)) + mlp(ln(x)),
  ``norm.placement='parallel_shared'``; ``multi_query`` true: one key/value head, else one
  per query head (``num_kv_heads`` must then be the number of heads);
- ``new_decoder_architecture`` false, ``parallel_attn`` false: sequential pre-norm blocks,
  ``input_layernorm`` then ``post_attention_layernorm``, ``norm.placement='pre'``;
- ``new_decoder_architecture`` true (Falcon-40B, 180B): ``num_kv_heads`` key/value heads and
  two norms side by side, x + attn(ln_attn(x)) + mlp(ln_mlp(x)), ``norm.placement='parallel'``
  (``num_ln_in_parallel_attn`` 1: one shared ``input_layernorm``, ``parallel_shared``).

Layouts transformers' Falcon cannot run (the new architecture with ``parallel_attn`` false,
two parallel norms in the old one, ...) are refused by name. RoPE: ``rope_parameters``
(transformers 5) or ``rope_theta`` and ``rope_scaling`` (4.x); none, linear, llama3 or YaRN
scaling.

``alibi`` true (Falcon-RW): no rotation; ALiBi biases (``position.kind='alibi'``, BLOOM's
slopes, largest bias 8) added to q . k before the scale, softmax((q . k + alibi) / sqrt(d_h))
(``alibi_scaled``: BLOOM adds them after it), each slope and its product with a key's
position rounded to bfloat16 as transformers' ``build_alibi_tensor`` forms them
(``alibi_bfloat16``). transformers' SDPA path (its default) adds the bias once; its eager
path adds it twice (once in the mask it builds, once in the attention), which no checkpoint
was trained with: compare with SDPA.

Dropout: transformers' rotary Falcon attention drops no attention weights, so
``attention_dropout`` is read only where it drops something, the attention branch's output
in sequential blocks; that and ``hidden_dropout`` (each block's output) are refused unless
0, since attnlab's ``dropout`` also drops the embeddings, which Falcon does not. Export
writes both as 0 (dropout is a training setting: the logits are the same).

Weights (attnlab Linear weights are (out, in), like ``torch.nn.Linear``):

    self_attention.query_key_value -> attn.qkv  rows (h_kv, h / h_kv + 2, d_h) stored: each
                                                 key/value head's queries, key, value together
                                                 (MQA: [all q; k; v]; one key/value head per
                                                 query head: (h, 3, d_h), GPT-NeoX's order)
    self_attention.dense           -> attn.out
    mlp.dense_h_to_4h              -> ffn.up,   mlp.dense_4h_to_h -> ffn.down
    input_layernorm                -> norm (parallel_shared) or attn_norm (pre)
    post_attention_layernorm       -> ffn_norm (pre)
    ln_attn, ln_mlp                -> attn_norm, ffn_norm (parallel)
    ln_f                           -> norm,     word_embeddings -> tok_emb,  lm_head -> lm_head

Shapes: d d_model, h heads, h_kv key/value heads, d_h head dim, f feed-forward hidden
size, V vocabulary size.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import Tensor

from attnlab.config import AttentionConfig, FFNConfig, ModelConfig, NormConfig, PositionConfig
from attnlab.interop import llama
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
    or_zeros,
    prefix,
    rope_rows_to_split,
    rope_settings,
    rope_to_hf,
    split_rows,
    unrepresentable,
)

ARCHITECTURES = {"falcon": ("FalconForCausalLM", "FalconModel")}

# transformers' FalconConfig class defaults for the config.json keys read here (its
# num_kv_heads, num_ln_in_parallel_attn and ffn_hidden_size default to None: the number of
# heads, 2 in the new architecture, 4 hidden_size)
DEFAULTS: dict[str, dict[str, Any]] = {
    "falcon": {
        "vocab_size": 65024,
        "hidden_size": 4544,
        "num_hidden_layers": 32,
        "num_attention_heads": 71,
        "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "alibi": False,
        "new_decoder_architecture": False,
        "multi_query": True,
        "parallel_attn": True,
        "bias": False,
        "max_position_embeddings": 2048,
        "activation": "gelu",
        "tie_word_embeddings": True,
    }
}
# RoPE frequencies older checkpoints saved (the original RW code's persistent buffer).
IGNORED = re.compile(
    r"^(transformer\.)?(h\.\d+\.self_attention\.(maybe_rotary|rotary_emb)\.|rotary_emb\.)inv_freq$"
)
HEAD = "lm_head.weight"


# --------------------------------------------------------------------------- configs


def _refuse(key: str, why: str) -> HFCheckpointError:
    return HFCheckpointError(f"config.json {key} is not supported: {why}")


def layout(hf: dict[str, Any]) -> tuple[str, int]:
    """(norm.placement, key/value heads) of a Falcon config.json, as FalconDecoderLayer and
    FalconAttention build them; layouts they cannot run refused by name."""
    h = get(hf, "num_attention_heads")
    n_kv = h if hf.get("num_kv_heads") is None else hf["num_kv_heads"]
    n_ln = hf.get("num_ln_in_parallel_attn")
    parallel = bool(hf.get("parallel_attn", True))
    if hf.get("new_decoder_architecture"):
        if not parallel:
            raise _refuse(
                "new_decoder_architecture=true with parallel_attn=false",
                "transformers' Falcon builds no norms the new architecture reads; set "
                "parallel_attn to true (the new architecture's blocks are parallel)",
            )
        if n_ln not in (None, 1, 2):
            raise _refuse(
                f"num_ln_in_parallel_attn={n_ln!r}", "the new architecture has 1 or 2 norms"
            )
        return ("parallel_shared" if n_ln == 1 else "parallel"), n_kv
    if parallel and n_ln == 2:
        raise _refuse(
            "num_ln_in_parallel_attn=2 with new_decoder_architecture=false",
            "transformers' Falcon builds ln_attn and ln_mlp but its old blocks read "
            "input_layernorm; set it to 1 or null",
        )
    placement = "parallel_shared" if parallel else "pre"
    if hf.get("multi_query", True):
        return placement, 1
    if n_kv != h:
        raise _refuse(
            f"num_kv_heads={n_kv} with multi_query=false and new_decoder_architecture=false",
            f"the old architecture has one key/value head per query head ({h}) without "
            "multi-query attention; set num_kv_heads to null or new_decoder_architecture "
            "to true",
        )
    return placement, h


def _position(hf: dict[str, Any]) -> PositionConfig:
    """RoPE, or with ``alibi`` Falcon-RW's ALiBi: scaled with q . k, rounded to bfloat16."""
    if hf.get("alibi"):
        return PositionConfig(kind="alibi", alibi_scaled=True, alibi_bfloat16=True)
    return PositionConfig(kind="rope", rope_layout="split", **rope_settings(hf, llama.ROPE_TYPES))


def config_from_hf(hf: dict[str, Any], model_type: str = "falcon") -> ModelConfig:
    placement, n_kv = layout(hf)
    dropout = hf.get("hidden_dropout") or 0.0
    if dropout:
        raise _refuse(
            f"hidden_dropout={dropout!r}",
            "Falcon drops each block's output but not the embeddings, and attnlab's "
            "dropout drops both; set it to 0.0",
        )
    attn_dropout = hf.get("attention_dropout") or 0.0
    if hf.get("alibi") and attn_dropout:
        raise _refuse(
            f"attention_dropout={attn_dropout!r} with alibi=true",
            "Falcon's ALiBi attention drops its softmax weights and, in sequential blocks, the "
            "attention branch's output too, which attnlab's blocks do not; set it to 0.0",
        )
    if placement == "pre" and attn_dropout:  # (unread elsewhere: rotary attention drops none)
        raise _refuse(
            f"attention_dropout={attn_dropout!r} with parallel_attn=false",
            "sequential Falcon blocks drop the attention branch's output at that rate, "
            "which attnlab's blocks do not do apart from the embeddings; set it to 0.0",
        )
    d = hf.get("n_embed") or get(hf, "hidden_size")  # (n_embed: FalconConfig's old name)
    n_heads = get(hf, "num_attention_heads")
    bias = bool(hf.get("bias", False))
    return ModelConfig(
        vocab_size=get(hf, "vocab_size"),
        max_seq_len=get(hf, "max_position_embeddings"),
        d_model=d,
        n_layers=get(hf, "num_hidden_layers"),
        attention=AttentionConfig(
            n_heads=n_heads,
            n_kv_heads=None if n_kv == n_heads else n_kv,
            qkv_bias=bias,
            out_bias=bias,
        ),
        position=_position(hf),
        ffn=FFNConfig(
            kind="mlp",
            activation=activation(hf.get("activation", "gelu"), "activation"),
            hidden_dim=hf.get("ffn_hidden_size") or 4 * d,
            bias=bias,
        ),
        # (torch.nn.LayerNorm: biased whatever ``bias`` says)
        norm=NormConfig(
            kind="layernorm", eps=hf.get("layer_norm_epsilon", 1e-5), bias=True, placement=placement
        ),
        tie_embeddings=hf.get("tie_word_embeddings", True),
        init_std=hf.get("initializer_range", 0.02),
    )


def exports(cfg: ModelConfig) -> bool:
    """RoPE decoders with LayerNorm and an MLP feed-forward in parallel blocks that only
    Falcon holds: one norm both sublayers read (``parallel_shared``) with whole heads
    rotated and no bias on the head (a partial rotation or a head bias are Phi's and
    GPT-J's), or two norms with fewer key/value heads than query heads and whole heads
    rotated (two norms with one key/value head per query head, or a partial rotation, are
    GPT-NeoX's); and the ALiBi decoders with LayerNorm and an MLP whose bias is scaled with
    q . k (Falcon-RW's; BLOOM adds it after the scale)."""
    if cfg.position.kind == "alibi":
        return (
            cfg.arch == "decoder"
            and cfg.attention.kind == "mha"
            and cfg.position.alibi_scaled
            and cfg.norm.kind == "layernorm"
            and cfg.ffn.kind == "mlp"
        )
    return (
        cfg.arch == "decoder"
        and cfg.attention.kind == "mha"
        and cfg.position.kind == "rope"
        and cfg.norm.kind == "layernorm"
        and cfg.ffn.kind == "mlp"
        and (
            (
                cfg.norm.placement == "parallel_shared"
                and cfg.position.rope_fraction == 1.0
                and not cfg.final_logits_bias
            )
            or (
                cfg.norm.placement == "parallel"
                and cfg.n_kv_heads != cfg.n_heads
                and cfg.position.rope_fraction == 1.0
            )
        )
    )


def export_type(cfg: ModelConfig) -> str:
    """``falcon``, or HFCheckpointError naming what Falcon has not (absent biases are
    written as zeros; a partial rotation is refused by ``convert``)."""
    if cfg.head_dim * cfg.n_heads != cfg.d_model:
        raise unrepresentable(
            f"attention.head_dim={cfg.head_dim} (Falcon's heads are d_model / n_heads = "
            f"{cfg.d_model // cfg.n_heads} wide)"
        )
    if cfg.position.kind == "alibi":
        _alibi_export_checks(cfg)
    if cfg.attention.dropout:
        raise unrepresentable(
            f"attention.dropout={cfg.attention.dropout} (Falcon's rotary attention drops no "
            "attention weights; set it to 0)"
        )
    if cfg.position.rope_scaling not in (None, *llama.ROPE_TYPES):
        raise unrepresentable(
            f"position.rope_scaling={cfg.position.rope_scaling!r} (falcon: none, "
            f"{', '.join(t for t in llama.ROPE_TYPES if t != 'default')})"
        )
    hf_activation(cfg.ffn.activation)  # (refused by name if transformers has no such name)
    return "falcon"


def _alibi_export_checks(cfg: ModelConfig) -> None:
    """What Falcon's ALiBi (Falcon-RW's) fixes: BLOOM's slopes (largest bias 8) rounded to
    bfloat16, the 1 / sqrt(d_h) scale, and a block layout of the old architecture or the
    new one's parallel norms (its sequential blocks need one key/value head per query head,
    or one in all)."""
    pos, n_kv = cfg.position, cfg.n_kv_heads
    if pos.alibi_max_bias != 8.0:
        raise unrepresentable(
            f"position.alibi_max_bias={pos.alibi_max_bias} (Falcon's ALiBi slopes have 8)"
        )
    if not pos.alibi_bfloat16:
        raise unrepresentable(
            "position.alibi_bfloat16=false (transformers' Falcon rounds its ALiBi bias to "
            "bfloat16; set it to true)"
        )
    if cfg.attention.scale is not None:
        raise unrepresentable(f"attention.scale={cfg.attention.scale} (Falcon's is 1 / sqrt(d_h))")
    if cfg.norm.placement == "pre" and n_kv not in (1, cfg.n_heads):
        raise unrepresentable(
            f"attention.n_kv_heads={n_kv} in sequential blocks (Falcon's have one key/value "
            "head, or one per query head)"
        )
    if cfg.norm.placement not in ("pre", "parallel", "parallel_shared"):
        raise unrepresentable(
            f"norm.placement={cfg.norm.placement!r} (Falcon's blocks are pre-norm or parallel)"
        )


def _architecture(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json keys of ``cfg``'s block layout (parallel blocks: see :func:`exports`):
    the old architecture where it holds it (one shared norm with one key/value head,
    Falcon-7B's, or with one per query head), else the new one with ``num_kv_heads``
    groups and one or two norms."""
    placement, h, n_kv = cfg.norm.placement, cfg.n_heads, cfg.n_kv_heads
    if placement == "pre":  # (Falcon-RW's: one key/value head per query head, or one)
        return {
            "new_decoder_architecture": False,
            "parallel_attn": False,
            "multi_query": n_kv == 1 and h > 1,
            "num_kv_heads": n_kv,
            "num_ln_in_parallel_attn": None,
        }
    if placement == "parallel_shared" and n_kv in (1, h):
        return {
            "new_decoder_architecture": False,
            "parallel_attn": True,
            "multi_query": n_kv == 1 and h > 1,
            "num_kv_heads": n_kv,
            "num_ln_in_parallel_attn": None,
        }
    return {
        "new_decoder_architecture": True,
        "parallel_attn": True,
        "multi_query": n_kv == 1,  # (ignored by the new architecture)
        "num_kv_heads": n_kv,
        "num_ln_in_parallel_attn": 1 if placement == "parallel_shared" else 2,
    }


def config_to_hf(cfg: ModelConfig, model_type: str, dtype: torch.dtype) -> dict[str, Any]:
    att, pos = cfg.attention, cfg.position
    rope = rope_to_hf(pos)
    return {
        **common_config(cfg, FAMILY, model_type, dtype),
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        **_architecture(cfg),
        "alibi": pos.kind == "alibi",
        "bias": att.qkv_bias or att.out_bias or cfg.ffn.bias,
        "ffn_hidden_size": cfg.ffn.hidden_size(cfg.d_model),
        "activation": hf_activation(cfg.ffn.activation),
        "max_position_embeddings": cfg.max_seq_len,
        "layer_norm_epsilon": cfg.norm.eps,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "rope_theta": pos.rope_theta,  # transformers 4.x
        "rope_scaling": None if pos.rope_scaling is None else rope,  # transformers 4.x
        "rope_parameters": rope,  # transformers 5.x
    }


# --------------------------------------------------------------------------- weights


def norms(cfg: ModelConfig) -> tuple[tuple[str, str], ...]:
    """(Falcon name, attnlab name) of each block's norms."""
    if cfg.norm.placement == "parallel_shared":
        return (("input_layernorm", "norm"),)
    if cfg.norm.placement == "parallel":
        return (("ln_attn", "attn_norm"), ("ln_mlp", "ffn_norm"))
    return (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ffn_norm"))


def weights_to_attnlab(src: Source, cfg: ModelConfig) -> Plan:
    d, f, V = cfg.d_model, cfg.ffn.hidden_size(cfg.d_model), cfg.vocab_size
    h, n_kv, d_h = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    att, rows = cfg.attention, (h + 2 * n_kv) * d_h
    groups = (n_kv, h // n_kv)  # rows (h_kv, h / h_kv + 2, d_h) stored
    p = prefix(src, "transformer.", "word_embeddings.weight")
    out: dict[str, tuple[Part, ...] | None] = {
        "tok_emb.weight": src.take(f"{p}word_embeddings.weight", (V, d)),
        "norm.weight": src.take(f"{p}ln_f.weight", (d,)),
        "norm.bias": src.take(f"{p}ln_f.bias", (d,)),
    }
    for i in range(cfg.n_layers):
        hf, a = f"{p}h.{i}.", f"blocks.{i}."
        qkv = hf + "self_attention.query_key_value."
        out |= {
            a + "attn.qkv.weight": src.take(qkv + "weight", (rows, d), grouped=groups),
            a + "attn.out.weight": src.take(hf + "self_attention.dense.weight", (d, d)),
            a + "ffn.up.weight": src.take(hf + "mlp.dense_h_to_4h.weight", (f, d)),
            a + "ffn.down.weight": src.take(hf + "mlp.dense_4h_to_h.weight", (d, f)),
        }
        for hf_name, name in norms(cfg):
            out[f"{a}{name}.weight"] = src.take(f"{hf}{hf_name}.weight", (d,))
            out[f"{a}{name}.bias"] = src.take(f"{hf}{hf_name}.bias", (d,))
        # (``bias`` true: every linear layer's; read as all three switches)
        if att.qkv_bias:
            out[a + "attn.qkv.bias"] = src.take(qkv + "bias", (rows,), grouped=groups)
        if att.out_bias:
            out[a + "attn.out.bias"] = src.take(hf + "self_attention.dense.bias", (d,))
        if cfg.ffn.bias:
            out[a + "ffn.up.bias"] = src.take(hf + "mlp.dense_h_to_4h.bias", (f,))
            out[a + "ffn.down.bias"] = src.take(hf + "mlp.dense_4h_to_h.bias", (d,))
    if cfg.tie_embeddings:
        src.tied(HEAD, out["tok_emb.weight"])
    else:
        out["lm_head.weight"] = src.take(HEAD, (V, d))
    return out  # type: ignore[return-value]  # None entries only with src.missing/wrong


def grouped_rows(t: Tensor, n_heads: int, n_kv_heads: int) -> Tensor:
    """attnlab's [q; k; v] rows ((h + 2 h_kv) d_h, ...) -> Falcon's (h_kv, h / h_kv + 2, d_h)
    order, flattened: each key/value head's query heads, then its key, then its value."""
    d_h = t.shape[0] // (n_heads + 2 * n_kv_heads)
    q, k, v = t.split((n_heads * d_h, n_kv_heads * d_h, n_kv_heads * d_h))
    q = q.reshape(n_kv_heads, n_heads // n_kv_heads, d_h, *t.shape[1:])  # (h_kv, h/h_kv, d_h, ...)
    k, v = (x.reshape(n_kv_heads, 1, d_h, *t.shape[1:]) for x in (k, v))  # (h_kv, 1, d_h, ...)
    return torch.cat((q, k, v), dim=1).reshape(t.shape)


def weights_from_attnlab(
    sd: dict[str, Tensor], cfg: ModelConfig, model_type: str
) -> dict[str, Tensor]:
    d, f = cfg.d_model, cfg.ffn.hidden_size(cfg.d_model)
    h, n_kv, d_h = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    att, rows = cfg.attention, (h + 2 * n_kv) * d_h
    # (the layout of rotated pairs: none without RoPE, Falcon-RW's ALiBi)
    interleaved = cfg.position.kind == "rope" and cfg.position.rope_layout == "interleaved"
    bias = att.qkv_bias or att.out_bias or cfg.ffn.bias  # Falcon's one switch

    def zeros_or(name: str, size: int) -> Tensor:
        return or_zeros(sd, name, size)

    def qkv(t: Tensor) -> Tensor:  # q and k rows to the split layout, then group by group
        q, k, v = split_rows(t, h * d_h, n_kv * d_h, n_kv * d_h)
        if interleaved:
            q, k = rope_rows_to_split(q, h, d_h), rope_rows_to_split(k, n_kv, d_h)
        return grouped_rows(torch.cat((q, k, v)), h, n_kv)

    out = {
        "transformer.word_embeddings.weight": sd["tok_emb.weight"],
        "transformer.ln_f.weight": sd["norm.weight"],
        "transformer.ln_f.bias": zeros_or("norm.bias", d),
    }
    for i in range(cfg.n_layers):
        hf, a = f"transformer.h.{i}.", f"blocks.{i}."
        attn = hf + "self_attention."
        out |= {
            attn + "query_key_value.weight": qkv(sd[a + "attn.qkv.weight"]),
            attn + "dense.weight": sd[a + "attn.out.weight"],
            hf + "mlp.dense_h_to_4h.weight": sd[a + "ffn.up.weight"],
            hf + "mlp.dense_4h_to_h.weight": sd[a + "ffn.down.weight"],
        }
        for hf_name, name in norms(cfg):  # (LayerNorms: always biased)
            out[f"{hf}{hf_name}.weight"] = sd[f"{a}{name}.weight"]
            out[f"{hf}{hf_name}.bias"] = zeros_or(f"{a}{name}.bias", d)
        if bias:  # every linear layer's (zeros for one attnlab has not)
            out[attn + "query_key_value.bias"] = qkv(zeros_or(a + "attn.qkv.bias", rows))
            out[attn + "dense.bias"] = zeros_or(a + "attn.out.bias", d)
            out[hf + "mlp.dense_h_to_4h.bias"] = zeros_or(a + "ffn.up.bias", f)
            out[hf + "mlp.dense_4h_to_h.bias"] = zeros_or(a + "ffn.down.bias", d)
    if not cfg.tie_embeddings:  # a tied head is not stored: transformers re-ties it
        out[HEAD] = sd["lm_head.weight"]
    return out


FAMILY = Family(
    name="falcon",
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
