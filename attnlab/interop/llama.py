"""The LLaMA layout: LLaMA, and Mistral, Qwen2 and Qwen3, which differ from it only in
config.json (Mistral: a sliding window; Qwen2: q/k/v biases and an optional window; Qwen3:
QK-norm, optional attention biases and window) and so share its weight names. RoPE
(split-halves pairs), RMSNorm, gated feed-forward.

Weights (attnlab Linear weights are (out, in), like ``torch.nn.Linear``):

    [q_proj; k_proj; v_proj]   -> attn.qkv     (rows stacked)
    [gate_proj; up_proj]       -> ffn.gate_up  (rows stacked)
    q_norm, k_norm             -> attn.q_norm, attn.k_norm  (Qwen3; (d_h,) each)

The mappings serve other families' variants of the layout too (starcoder2.py: a non-gated
MLP, ``mlp.c_fc`` -> ffn.up and ``mlp.c_proj`` -> ffn.down, and LayerNorms whose biases
go with their weights).

Shapes: d d_model, h heads, h_kv key/value heads, d_h head dim, f feed-forward hidden size,
V vocabulary size.
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
    cat,
    common_config,
    get,
    is_plain_decoder,
    local_layers,
    or_zeros,
    prefix,
    rope_rows_to_split,
    rope_settings,
    rope_to_hf,
    split_rows,
    unrepresentable,
)

ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "LlamaModel"),
    "mistral": ("MistralForCausalLM", "MistralModel"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Model"),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Model"),
}

# transformers' class defaults (LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config) for
# the config.json keys read here (Family.defaults).
_COMMON = {
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_dropout": 0.0,
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
}
DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        **_COMMON,
        "vocab_size": 32000,
        "intermediate_size": 11008,
        "max_position_embeddings": 2048,
        "attention_bias": False,
        "mlp_bias": False,
    },
    "mistral": {
        **_COMMON,
        "vocab_size": 32000,
        "intermediate_size": 14336,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "sliding_window": 4096,
    },
    "qwen2": {
        **_COMMON,
        "vocab_size": 151936,
        "intermediate_size": 22016,
        "num_key_value_heads": 32,
        "max_position_embeddings": 32768,
        "use_sliding_window": False,
        "sliding_window": 4096,  # used only with use_sliding_window
        "max_window_layers": 28,
    },
    "qwen3": {
        **_COMMON,
        "vocab_size": 151936,
        "intermediate_size": 22016,
        "num_key_value_heads": 32,
        "head_dim": 128,  # not hidden_size / num_attention_heads
        "max_position_embeddings": 32768,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": 4096,  # used only with use_sliding_window
        "max_window_layers": 28,
    },
}
QWEN = ("qwen2", "qwen3")  # windows on the layers use_sliding_window and layer_types name

# attnlab -> Hugging Face activation names.
ACTIVATIONS = io.TO_HF_ACTIVATIONS
# RoPE frequencies that older transformers versions saved.
IGNORED = re.compile(r"^(model\.)?layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# A non-gated MLP's two projections under ``mlp.`` (StarCoder2's, ffn.kind mlp): up, down
MLP = ("c_fc", "c_proj")

# --------------------------------------------------------------------------- configs


def _sliding_window(hf: dict[str, Any], model_type: str) -> tuple[int | None, str | None]:
    """(sliding_window, layer_pattern): Mistral windows every layer; Qwen2 and Qwen3 only with
    use_sliding_window, on the layers ``layer_types`` (or max_window_layers) names, which
    become an attnlab layer pattern (L local, G global) when some layers are global."""
    if model_type == "mistral":
        return hf.get("sliding_window"), None
    if model_type not in QWEN or not hf.get("use_sliding_window", False):
        return None, None  # LLaMA has no window; Qwen ignores sliding_window unless enabled
    window = hf.get("sliding_window")
    n_layers = get(hf, "num_hidden_layers")
    first = hf.get("max_window_layers", 28)
    layer_types = hf.get("layer_types") or [
        "sliding_attention" if window is not None and i >= first else "full_attention"
        for i in range(n_layers)
    ]
    kinds = set(layer_types)
    if kinds - {"full_attention", "sliding_attention"} or len(layer_types) != n_layers:
        raise HFCheckpointError(
            f"layer_types={layer_types}: expected {n_layers} of full_attention or sliding_attention"
        )
    if kinds <= {"full_attention"} or window is None:
        return None, None
    if kinds == {"sliding_attention"}:
        return window, None
    return window, "".join("L" if k == "sliding_attention" else "G" for k in layer_types)


def _biases(model_type: str, qkv: bool, out: bool, mlp: bool) -> tuple[bool, bool, bool]:
    """(q/k/v, o_proj, MLP) biases the architecture has: LLaMA's are set in config.json,
    Qwen3's attention ones too (attention_bias: q, k, v and o), StarCoder2's all at once
    (use_bias), Mistral's and Qwen2's are fixed by the architecture."""
    if model_type == "llama":
        return qkv, out, mlp
    if model_type == "starcoder2":  # use_bias: every projection's, or none
        every = qkv or out or mlp
        return every, every, every
    if model_type == "qwen3":
        return qkv, out, False
    return model_type == "qwen2", False, False


def config_from_hf(hf: dict[str, Any], model_type: str) -> ModelConfig:
    d, n_heads = get(hf, "hidden_size"), get(hf, "num_attention_heads")
    n_kv_heads = hf.get("num_key_value_heads") or n_heads
    head_dim = hf.get("head_dim") or d // n_heads
    attention_bias = bool(hf.get("attention_bias", False))
    qkv_bias, out_bias, mlp_bias = _biases(
        model_type, attention_bias, attention_bias, bool(hf.get("mlp_bias", False))
    )
    window, layer_pattern = _sliding_window(hf, model_type)
    return ModelConfig(
        vocab_size=get(hf, "vocab_size"),
        max_seq_len=get(hf, "max_position_embeddings"),
        d_model=d,
        n_layers=get(hf, "num_hidden_layers"),
        attention=AttentionConfig(
            n_heads=n_heads,
            n_kv_heads=None if n_kv_heads == n_heads else n_kv_heads,
            head_dim=None if head_dim * n_heads == d else head_dim,
            qkv_bias=qkv_bias,
            out_bias=out_bias,
            dropout=hf.get("attention_dropout", 0.0),
            sliding_window=window,
            layer_pattern=layer_pattern,
            qk_norm=model_type == "qwen3",
        ),
        position=PositionConfig(kind="rope", rope_layout="split", **rope_settings(hf, ROPE_TYPES)),
        ffn=FFNConfig(
            kind="glu",
            activation=activation(hf.get("hidden_act", "silu"), "hidden_act"),
            hidden_dim=get(hf, "intermediate_size"),
            bias=mlp_bias,
        ),
        norm=NormConfig(kind="rmsnorm", eps=hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=hf.get("tie_word_embeddings", False),
        init_std=hf.get("initializer_range", 0.02),
    )


def exports(cfg: ModelConfig) -> bool:
    return is_plain_decoder(cfg) and cfg.position.kind == "rope" and cfg.ffn.kind != "moe"


def export_type(cfg: ModelConfig) -> str:
    """``qwen3`` with QK-norm, ``qwen2`` when q/k/v have biases and nothing else does,
    ``mistral`` with a sliding window and no biases, else ``llama`` (missing biases are
    written as zeros)."""
    att = cfg.attention
    if cfg.norm.kind != "rmsnorm" or cfg.ffn.kind != "glu":
        raise unrepresentable("RoPE models need RMSNorm and a gated feed-forward (LLaMA family)")
    if att.qk_norm:  # Qwen3: any window pattern, attention biases all or none
        if cfg.ffn.bias:
            raise unrepresentable("attention.qk_norm exports as Qwen3, which has no ffn.bias")
        return "qwen3"
    qwen_biases = att.qkv_bias and not att.out_bias and not cfg.ffn.bias
    # the layers that really have the window: a layer_pattern of only global layers (or
    # one whose local entries fall past n_layers) leaves some or all of them without it
    local = local_layers(cfg)
    if not any(local):
        return "qwen2" if qwen_biases else "llama"
    if qwen_biases:
        return "qwen2"
    if not all(local):
        raise unrepresentable(
            "local and global layers (attention.layer_pattern) export as Qwen2 only: "
            "q/k/v biases and no others"
        )
    if not (att.qkv_bias or att.out_bias or cfg.ffn.bias):
        return "mistral"
    raise unrepresentable(
        "a sliding window with biases other than q/k/v only (Qwen2) or none (Mistral)"
    )


def config_to_hf(cfg: ModelConfig, model_type: str, dtype: torch.dtype) -> dict[str, Any]:
    att = cfg.attention
    rope = rope_to_hf(cfg.position)
    hf = {
        **common_config(cfg, FAMILY, model_type, dtype),
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn.hidden_size(cfg.d_model),
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": ACTIVATIONS[cfg.ffn.activation],
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm.eps,
        "attention_dropout": att.dropout,
        "rope_theta": cfg.position.rope_theta,  # transformers 4.x
        "rope_scaling": None if cfg.position.rope_scaling is None else rope,
        "rope_parameters": rope,  # transformers 5.x
    }
    if model_type == "llama":
        hf["attention_bias"] = att.qkv_bias or att.out_bias
        hf["mlp_bias"] = cfg.ffn.bias
        hf["pretraining_tp"] = 1
    elif model_type == "mistral":
        hf["sliding_window"] = att.sliding_window
    else:  # qwen2, qwen3: the window on the local layers of attention.layer_pattern (or all)
        if model_type == "qwen3":
            hf["attention_bias"] = att.qkv_bias or att.out_bias
        local = local_layers(cfg)
        window = att.sliding_window if any(local) else None
        hf["use_sliding_window"] = window is not None
        hf["sliding_window"] = window
        hf["max_window_layers"] = local.index(True) if any(local) else cfg.n_layers
        hf["layer_types"] = ["sliding_attention" if w else "full_attention" for w in local]
    return hf


# --------------------------------------------------------------------------- weights

# Each layer's (d,) norms, HF name -> attnlab name: LLaMA's, before each sublayer (OLMo 2
# passes its own, after each)
NORMS = (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ffn_norm"))


def _qk_norm_shapes(cfg: ModelConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of the q_norm and k_norm weights: (d_h,) each (shared by the heads:
    Qwen3), (h, d_h) and (h_kv, d_h) (a weight per head: Cohere's, CohereLayerNorm's
    (num_heads, head_dim)), or the whole projections' (h d_h,) and (h_kv d_h,)
    (attention.qk_norm_scope='projection': OLMo 2)."""
    att, d_h = cfg.attention, cfg.head_dim
    if att.qk_norm_weight == "per_head":
        return (cfg.n_heads, d_h), (cfg.n_kv_heads, d_h)
    if att.qk_norm_scope == "head":
        return (d_h,), (d_h,)
    return (cfg.n_heads * d_h,), (cfg.n_kv_heads * d_h,)


def weights_to_attnlab(
    src: Source,
    cfg: ModelConfig,
    norms: tuple[tuple[str, str], ...] = NORMS,
    *,
    fused: bool = False,
) -> Plan:
    """``norms``: each layer's norms, HF name -> attnlab name. ``fused``: q, k and v stored
    as one ``qkv_proj`` and gate and up as one ``gate_up_proj``, each with its parts' rows
    stacked (Phi-3), as attnlab holds them."""
    d, f, V = cfg.d_model, cfg.ffn.hidden_size(cfg.d_model), cfg.vocab_size
    q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    att = cfg.attention
    p = prefix(src, "model.", "embed_tokens.weight")
    out: dict[str, tuple[Part, ...] | None] = {
        "tok_emb.weight": src.take(f"{p}embed_tokens.weight", (V, d)),
        "norm.weight": src.take(f"{p}norm.weight", (d,)),
    }
    layernorm = cfg.norm.kind == "layernorm" and cfg.norm.bias  # (StarCoder2's, biased)
    if layernorm:
        out["norm.bias"] = src.take(f"{p}norm.bias", (d,))
    for i in range(cfg.n_layers):
        h, a = f"{p}layers.{i}.", f"blocks.{i}."
        qkv = (("q_proj", q_dim), ("k_proj", kv_dim), ("v_proj", kv_dim))
        out |= {
            a + "attn.qkv.weight": (
                src.take(h + "self_attn.qkv_proj.weight", (q_dim + 2 * kv_dim, d))
                if fused
                else cat(src.take(f"{h}self_attn.{n}.weight", (rows, d)) for n, rows in qkv)
            ),
            a + "attn.out.weight": src.take(h + "self_attn.o_proj.weight", (d, q_dim)),
        }
        for hf_name, name in norms:
            out[f"{a}{name}.weight"] = src.take(f"{h}{hf_name}.weight", (d,))
            if layernorm:
                out[f"{a}{name}.bias"] = src.take(f"{h}{hf_name}.bias", (d,))
        if cfg.ffn.kind == "mlp":  # StarCoder2's: up, activation, down
            up, down = (f"{h}mlp.{n}." for n in MLP)
            out[a + "ffn.up.weight"] = src.take(up + "weight", (f, d))
            out[a + "ffn.down.weight"] = src.take(down + "weight", (d, f))
            if cfg.ffn.bias:
                out[a + "ffn.up.bias"] = src.take(up + "bias", (f,))
                out[a + "ffn.down.bias"] = src.take(down + "bias", (d,))
        elif not cfg.ffn.moe_layer(i):  # (qwen2_moe.py, qwen3_moe.py map the experts)
            out[a + "ffn.gate_up.weight"] = (
                src.take(h + "mlp.gate_up_proj.weight", (2 * f, d))
                if fused
                else cat(src.take(f"{h}mlp.{n}.weight", (f, d)) for n in ("gate_proj", "up_proj"))
            )
            out[a + "ffn.down.weight"] = src.take(h + "mlp.down_proj.weight", (d, f))
        if att.qkv_bias:
            out[a + "attn.qkv.bias"] = cat(
                src.take(f"{h}self_attn.{n}.bias", (rows,)) for n, rows in qkv
            )
        if att.out_bias:
            out[a + "attn.out.bias"] = src.take(h + "self_attn.o_proj.bias", (d,))
        if att.qk_norm:
            for n, shape in zip(("q_norm", "k_norm"), _qk_norm_shapes(cfg), strict=True):
                out[f"{a}attn.{n}.weight"] = src.take(f"{h}self_attn.{n}.weight", shape)
        if cfg.ffn.bias and cfg.ffn.kind != "mlp" and not cfg.ffn.moe_layer(i):  # (experts: none)
            out[a + "ffn.gate_up.bias"] = cat(
                src.take(f"{h}mlp.{n}.bias", (f,)) for n in ("gate_proj", "up_proj")
            )
            out[a + "ffn.down.bias"] = src.take(h + "mlp.down_proj.bias", (d,))
    if cfg.tie_embeddings:
        src.tied("lm_head.weight", out["tok_emb.weight"])
    else:
        out["lm_head.weight"] = src.take("lm_head.weight", (V, d))
    return out  # type: ignore[return-value]  # None entries only with src.missing/wrong


def weights_from_attnlab(
    sd: dict[str, Tensor],
    cfg: ModelConfig,
    model_type: str,
    norms: tuple[tuple[str, str], ...] = NORMS,
    *,
    fused: bool = False,
) -> dict[str, Tensor]:
    """``norms`` as :func:`weights_to_attnlab`'s. ``fused``: write ``qkv_proj`` and
    ``gate_up_proj`` (Phi-3), each its parts' rows stacked, instead of q/k/v_proj and
    gate/up_proj."""
    att, f, d = cfg.attention, cfg.ffn.hidden_size(cfg.d_model), cfg.d_model
    q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    interleaved = cfg.position.rope_layout == "interleaved"
    # Which biases the chosen architecture has (absent attnlab biases are written as zeros).
    any_attention_bias = att.qkv_bias or att.out_bias
    qkv_bias, out_bias, mlp_bias = _biases(
        model_type, any_attention_bias, any_attention_bias, cfg.ffn.bias
    )

    def to_split(t: Tensor, n: int) -> Tensor:
        return rope_rows_to_split(t, n, cfg.head_dim, cfg.rope_dim) if interleaved else t

    out = {
        "model.embed_tokens.weight": sd["tok_emb.weight"],
        "model.norm.weight": sd["norm.weight"],
    }
    layernorm = cfg.norm.kind == "layernorm"  # (StarCoder2's, always biased: zeros if need be)
    if layernorm:
        out["model.norm.bias"] = or_zeros(sd, "norm.bias", d)
    for i in range(cfg.n_layers):
        h, a = f"model.layers.{i}.", f"blocks.{i}."
        q, k, v = split_rows(sd[a + "attn.qkv.weight"], q_dim, kv_dim, kv_dim)
        q, k = to_split(q, cfg.n_heads), to_split(k, cfg.n_kv_heads)
        if fused:
            out[h + "self_attn.qkv_proj.weight"] = torch.cat((q, k, v))
        else:
            out[h + "self_attn.q_proj.weight"], out[h + "self_attn.k_proj.weight"] = q, k
            out[h + "self_attn.v_proj.weight"] = v
        if cfg.ffn.kind == "mlp":  # StarCoder2's: up, activation, down
            up, down = (f"{h}mlp.{n}." for n in MLP)
            out[up + "weight"] = sd[a + "ffn.up.weight"]
            out[down + "weight"] = sd[a + "ffn.down.weight"]
            if mlp_bias:
                out[up + "bias"] = or_zeros(sd, a + "ffn.up.bias", f)
                out[down + "bias"] = or_zeros(sd, a + "ffn.down.bias", d)
        elif not cfg.ffn.moe_layer(i):
            if fused:
                out[h + "mlp.gate_up_proj.weight"] = sd[a + "ffn.gate_up.weight"]
            else:
                gate, up = split_rows(sd[a + "ffn.gate_up.weight"], f, f)
                out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = gate, up
            out[h + "mlp.down_proj.weight"] = sd[a + "ffn.down.weight"]
        out |= {
            h + "self_attn.o_proj.weight": sd[a + "attn.out.weight"],
        }
        for hf_name, name in norms:
            out[f"{h}{hf_name}.weight"] = sd[f"{a}{name}.weight"]
            if layernorm:
                out[f"{h}{hf_name}.bias"] = or_zeros(sd, f"{a}{name}.bias", d)
        if qkv_bias:
            qb, kb, vb = split_rows(
                or_zeros(sd, a + "attn.qkv.bias", q_dim + 2 * kv_dim), q_dim, kv_dim, kv_dim
            )
            out[h + "self_attn.q_proj.bias"] = to_split(qb, cfg.n_heads)
            out[h + "self_attn.k_proj.bias"] = to_split(kb, cfg.n_kv_heads)
            out[h + "self_attn.v_proj.bias"] = vb
        if out_bias:
            out[h + "self_attn.o_proj.bias"] = or_zeros(sd, a + "attn.out.bias", d)
        if att.qk_norm:  # per feature within a head: permuted as the q/k rows are
            # (one head's weight, each head's own, or each head's part of a whole projection's)
            shared = att.qk_norm_scope == "head" and att.qk_norm_weight == "shared"
            for n, heads in (("q_norm", cfg.n_heads), ("k_norm", cfg.n_kv_heads)):
                w = sd[f"{a}attn.{n}.weight"]
                split = to_split(w.reshape(-1), 1 if shared else heads)
                out[f"{h}self_attn.{n}.weight"] = split.reshape(w.shape)
        if mlp_bias and cfg.ffn.kind != "mlp" and not cfg.ffn.moe_layer(i):  # (experts: none)
            gb, ub = split_rows(sd[a + "ffn.gate_up.bias"], f, f)
            out[h + "mlp.gate_proj.bias"], out[h + "mlp.up_proj.bias"] = gb, ub
            out[h + "mlp.down_proj.bias"] = sd[a + "ffn.down.bias"]
    if not cfg.tie_embeddings:  # a tied head is not stored: transformers re-ties it
        out["lm_head.weight"] = sd["lm_head.weight"]
    return out


FAMILY = Family(
    name="llama",
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
