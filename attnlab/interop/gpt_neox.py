"""GPT-NeoX and Pythia (``model_type`` gpt_neox: GPTNeoXForCausalLM): LayerNorms with bias,
a GELU MLP with biases, a partial rotation, an untied head, and attention and MLP side by
side in each layer:

- ``use_parallel_residual`` true (every published GPT-NeoX and Pythia model):
  x + attn(ln1(x)) + mlp(ln2(x)), ``norm.placement='parallel'``; false: the ordinary
  pre-norm block, ``norm.placement='pre'``;
- RoPE on the first int(head_dim * partial_rotary_factor) features of each head, pairs
  (i, i + d_r / 2) within them (rotate-half: ``position.rope_fraction``, split layout):
  transformers 5's ``rope_parameters`` (``partial_rotary_factor``, ``rope_theta``), else
  4.x's ``rotary_pct`` and ``rotary_emb_base`` (defaults 0.25 and 10000; top-level
  ``partial_rotary_factor`` and ``rope_theta`` keys are ignored, as transformers ignores
  them); linear scaling too;
- ``attention_bias`` (true by default): biases on query_key_value and dense, or neither.

Weights (attnlab Linear weights are (out, in), like ``torch.nn.Linear``):

    attention.query_key_value  -> attn.qkv   rows (h, 3, d_h) stored, [q; k; v] in attnlab:
                                              each head's q, k and v rows together
    attention.dense            -> attn.out
    mlp.dense_h_to_4h          -> ffn.up,   mlp.dense_4h_to_h -> ffn.down
    input_layernorm            -> attn_norm, post_attention_layernorm -> ffn_norm
    final_layer_norm           -> norm,     embed_in -> tok_emb,  embed_out -> lm_head

(transformers 5 names the head ``lm_head`` in memory and writes ``embed_out``, the Hub
checkpoints' name, to its files; either is read.) ``hidden_dropout`` (on the embeddings
and each sublayer's output) is attnlab's ``dropout``, ``attention_dropout``
``attention.dropout``.

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
    Part,
    Plan,
    Source,
    activation,
    common_config,
    get,
    hf_activation,
    or_zeros,
    prefix,
    rope_parameters,
    rope_rows_to_split,
    rope_settings,
    rope_to_hf,
    split_rows,
    unrepresentable,
)

ARCHITECTURES = {"gpt_neox": ("GPTNeoXForCausalLM", "GPTNeoXModel")}

# transformers' GPTNeoXConfig class defaults for the config.json keys read here
DEFAULTS: dict[str, dict[str, Any]] = {
    "gpt_neox": {
        "vocab_size": 50432,
        "hidden_size": 6144,
        "num_hidden_layers": 44,
        "num_attention_heads": 64,
        "intermediate_size": 24576,
        "hidden_act": "gelu",
        "attention_dropout": 0.0,
        "hidden_dropout": 0.0,
        "max_position_embeddings": 2048,
        "initializer_range": 0.02,
        "layer_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "use_parallel_residual": True,
        "attention_bias": True,
    }
}
# GPTNeoXConfig's defaults of its 4.x RoPE keys (rope_parameters' where it has none)
ROTARY_PCT, ROTARY_EMB_BASE = 0.25, 10000.0
ROPE_TYPES = ("default", "linear")
# Buffers older transformers versions saved (causal-mask tables, RoPE frequencies).
IGNORED = re.compile(
    r"^(gpt_neox\.)?layers\.\d+\.attention\.(bias|masked_bias|rotary_emb\.inv_freq)$"
)
HEAD = "embed_out.weight"  # the head's name in checkpoint files


def hub_name(name: str) -> str:
    """transformers 5's in-memory name of the head (``lm_head``) -> the files' ``embed_out``."""
    return HEAD if name == "lm_head.weight" else name


# --------------------------------------------------------------------------- configs


def _rope(hf: dict[str, Any]) -> dict[str, Any]:
    """PositionConfig fields: transformers 5 takes the RoPE parameters' own theta and
    fraction, else ``rotary_emb_base`` and ``rotary_pct`` (its 4.x keys), else 10000 and
    0.25 (GPTNeoXConfig.convert_rope_params_to_dict)."""
    params = rope_parameters(hf)
    fraction = params.get("partial_rotary_factor")
    theta = params.get("rope_theta")
    resolved = {
        "partial_rotary_factor": hf.get("rotary_pct", ROTARY_PCT) if fraction is None else fraction,
        "rope_theta": hf.get("rotary_emb_base", ROTARY_EMB_BASE) if theta is None else theta,
    }
    return rope_settings({**hf, **resolved}, ROPE_TYPES, partial=True)


def config_from_hf(hf: dict[str, Any], model_type: str = "gpt_neox") -> ModelConfig:
    bias = bool(hf.get("attention_bias", True))
    parallel = bool(hf.get("use_parallel_residual", True))
    return ModelConfig(
        vocab_size=get(hf, "vocab_size"),
        max_seq_len=get(hf, "max_position_embeddings"),
        d_model=get(hf, "hidden_size"),
        n_layers=get(hf, "num_hidden_layers"),
        attention=AttentionConfig(
            n_heads=get(hf, "num_attention_heads"),
            qkv_bias=bias,
            out_bias=bias,
            dropout=hf.get("attention_dropout", 0.0),
        ),
        position=PositionConfig(kind="rope", rope_layout="split", **_rope(hf)),
        ffn=FFNConfig(
            kind="mlp",
            activation=activation(hf.get("hidden_act", "gelu"), "hidden_act"),
            hidden_dim=get(hf, "intermediate_size"),
            bias=True,
        ),
        norm=NormConfig(
            kind="layernorm",
            eps=hf.get("layer_norm_eps", 1e-5),
            bias=True,
            placement="parallel" if parallel else "pre",
        ),
        tie_embeddings=hf.get("tie_word_embeddings", False),
        dropout=hf.get("hidden_dropout", 0.0),  # embeddings and both sublayers' outputs
        init_std=hf.get("initializer_range", 0.02),
    )


def exports(cfg: ModelConfig) -> bool:
    """RoPE decoders with LayerNorm and an MLP feed-forward in parallel blocks with two
    norms, or in pre-norm blocks with a partial rotation: GPT-NeoX's shape (LLaMA's layout
    needs RMSNorm and a gated FFN). Pre-norm ones that rotate every pair are StarCoder2's
    (starcoder2.py: GQA and windows too), which transformers runs alike."""
    return (
        cfg.arch == "decoder"
        and cfg.attention.kind == "mha"
        and cfg.position.kind == "rope"
        and cfg.norm.kind == "layernorm"
        and cfg.ffn.kind == "mlp"
        and (
            cfg.norm.placement == "parallel"
            or (cfg.norm.placement == "pre" and cfg.position.rope_fraction < 1)
        )
    )


def export_type(cfg: ModelConfig) -> str:
    """``gpt_neox``, or HFCheckpointError naming what GPT-NeoX has not (absent biases are
    written as zeros)."""
    if cfg.n_kv_heads != cfg.n_heads:
        raise unrepresentable(
            f"attention.n_kv_heads={cfg.n_kv_heads} (GPT-NeoX has one key/value head per "
            "query head; set it to null, or rotate whole heads, position.rope_fraction=1, to "
            "export as falcon)"
        )
    if cfg.head_dim * cfg.n_heads != cfg.d_model:
        raise unrepresentable(
            f"attention.head_dim={cfg.head_dim} (GPT-NeoX's heads are d_model / n_heads = "
            f"{cfg.d_model // cfg.n_heads} wide)"
        )
    if cfg.position.rope_scaling not in (None, "linear"):
        raise unrepresentable(
            f"position.rope_scaling={cfg.position.rope_scaling!r} (gpt_neox: none or linear)"
        )
    hf_activation(cfg.ffn.activation)  # (refused by name if transformers has no such name)
    return "gpt_neox"


def config_to_hf(cfg: ModelConfig, model_type: str, dtype: torch.dtype) -> dict[str, Any]:
    att, pos = cfg.attention, cfg.position
    # written even when 1.0: GPTNeoXConfig's default is 0.25
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
        "hidden_dropout": cfg.dropout,
        "attention_dropout": att.dropout,
        "use_parallel_residual": cfg.norm.placement == "parallel",
        "attention_bias": att.qkv_bias or att.out_bias,
        "rotary_pct": pos.rope_fraction,  # transformers 4.x
        "rotary_emb_base": pos.rope_theta,  # transformers 4.x
        # (4.x's form; transformers 5 reads it first, with the two keys above)
        "rope_scaling": (
            None if pos.rope_scaling is None else {"type": "linear", "factor": pos.rope_factor}
        ),
        "rope_parameters": rope,  # transformers 5.x
    }


# --------------------------------------------------------------------------- weights

NORMS = (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ffn_norm"))


def weights_to_attnlab(src: Source, cfg: ModelConfig) -> Plan:
    d, f, V, h = cfg.d_model, cfg.ffn.hidden_size(cfg.d_model), cfg.vocab_size, cfg.n_heads
    att = cfg.attention
    p = prefix(src, "gpt_neox.", "embed_in.weight")
    out: dict[str, tuple[Part, ...] | None] = {
        "tok_emb.weight": src.take(f"{p}embed_in.weight", (V, d)),
        "norm.weight": src.take(f"{p}final_layer_norm.weight", (d,)),
        "norm.bias": src.take(f"{p}final_layer_norm.bias", (d,)),
    }
    for i in range(cfg.n_layers):
        hf, a = f"{p}layers.{i}.", f"blocks.{i}."
        qkv = hf + "attention.query_key_value."
        out |= {
            # rows (h, 3, d_h) stored: each head's q, k, v together
            a + "attn.qkv.weight": src.take(qkv + "weight", (3 * d, d), per_head=(3, h)),
            a + "attn.out.weight": src.take(hf + "attention.dense.weight", (d, d)),
            a + "ffn.up.weight": src.take(hf + "mlp.dense_h_to_4h.weight", (f, d)),
            a + "ffn.up.bias": src.take(hf + "mlp.dense_h_to_4h.bias", (f,)),
            a + "ffn.down.weight": src.take(hf + "mlp.dense_4h_to_h.weight", (d, f)),
            a + "ffn.down.bias": src.take(hf + "mlp.dense_4h_to_h.bias", (d,)),
        }
        for hf_name, name in NORMS:
            out[f"{a}{name}.weight"] = src.take(f"{hf}{hf_name}.weight", (d,))
            out[f"{a}{name}.bias"] = src.take(f"{hf}{hf_name}.bias", (d,))
        if att.qkv_bias:
            out[a + "attn.qkv.bias"] = src.take(qkv + "bias", (3 * d,), per_head=(3, h))
        if att.out_bias:
            out[a + "attn.out.bias"] = src.take(hf + "attention.dense.bias", (d,))
    if cfg.tie_embeddings:
        src.tied(HEAD, out["tok_emb.weight"])
    else:
        out["lm_head.weight"] = src.take(HEAD, (V, d))
    return out  # type: ignore[return-value]  # None entries only with src.missing/wrong


def heads_together(t: Tensor, n_heads: int) -> Tensor:
    """[q; k; v] rows (3 h d_h, ...) -> GPT-NeoX's (h, 3, d_h, ...) order, flattened."""
    rows = t.reshape(3, n_heads, -1, *t.shape[1:])  # (3, h, d_h, ...)
    return rows.transpose(0, 1).reshape(t.shape)


def weights_from_attnlab(
    sd: dict[str, Tensor], cfg: ModelConfig, model_type: str
) -> dict[str, Tensor]:
    d, f, h = cfg.d_model, cfg.ffn.hidden_size(cfg.d_model), cfg.n_heads
    att = cfg.attention
    interleaved = cfg.position.rope_layout == "interleaved"

    def bias(name: str, size: int) -> Tensor:  # GPT-NeoX's LayerNorms and MLP have biases
        return or_zeros(sd, name, size)

    def qkv(t: Tensor) -> Tensor:  # q and k rows to the split layout, then head by head
        q, k, v = split_rows(t, d, d, d)
        if interleaved:
            q, k = (rope_rows_to_split(x, h, cfg.head_dim, cfg.rope_dim) for x in (q, k))
        return heads_together(torch.cat((q, k, v)), h)

    out = {
        "gpt_neox.embed_in.weight": sd["tok_emb.weight"],
        "gpt_neox.final_layer_norm.weight": sd["norm.weight"],
        "gpt_neox.final_layer_norm.bias": bias("norm.bias", d),
    }
    for i in range(cfg.n_layers):
        hf, a = f"gpt_neox.layers.{i}.", f"blocks.{i}."
        out |= {
            hf + "attention.query_key_value.weight": qkv(sd[a + "attn.qkv.weight"]),
            hf + "attention.dense.weight": sd[a + "attn.out.weight"],
            hf + "mlp.dense_h_to_4h.weight": sd[a + "ffn.up.weight"],
            hf + "mlp.dense_h_to_4h.bias": bias(a + "ffn.up.bias", f),
            hf + "mlp.dense_4h_to_h.weight": sd[a + "ffn.down.weight"],
            hf + "mlp.dense_4h_to_h.bias": bias(a + "ffn.down.bias", d),
        }
        for hf_name, name in NORMS:
            out[f"{hf}{hf_name}.weight"] = sd[f"{a}{name}.weight"]
            out[f"{hf}{hf_name}.bias"] = bias(f"{a}{name}.bias", d)
        if att.qkv_bias or att.out_bias:  # attention_bias: both or neither (zeros for one)
            out[hf + "attention.query_key_value.bias"] = qkv(bias(a + "attn.qkv.bias", 3 * d))
            out[hf + "attention.dense.bias"] = bias(a + "attn.out.bias", d)
    if not cfg.tie_embeddings:  # a tied head is not stored: transformers re-ties it
        out[HEAD] = sd["lm_head.weight"]
    return out


FAMILY = Family(
    name="gpt_neox",
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
    rename=hub_name,
)
