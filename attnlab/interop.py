"""Hugging Face checkpoint import and export (GPT-2, LLaMA, Mistral, Qwen2).

A Hugging Face model directory holds ``config.json`` and safetensors weights (one
``model.safetensors`` or shards listed in ``model.safetensors.index.json``). This module maps
both onto attnlab's :class:`~attnlab.config.ModelConfig` and :class:`DecoderLM` names, and
back. Weights are read with safetensors only: pickled ``pytorch_model.bin`` files can run
arbitrary code when loaded, so they are refused.

Weight layouts (attnlab Linear weights are (out, in), like ``torch.nn.Linear``):

    GPT-2   c_attn (Conv1D, stored (in, out)) -> attn.qkv (transposed; columns [q, k, v])
            c_proj, c_fc, mlp.c_proj           -> attn.out, ffn.up, ffn.down (transposed)
    LLaMA   [q_proj; k_proj; v_proj]           -> attn.qkv   (rows stacked)
            [gate_proj; up_proj]               -> ffn.gate_up (rows stacked)

Shapes: d d_model, h heads, h_kv key/value heads, d_h head dim, f feed-forward hidden size,
V vocabulary size, L max positions.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NoReturn

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from attnlab.config import (
    AttentionConfig,
    ConfigError,
    FFNConfig,
    ModelConfig,
    NormConfig,
    PositionConfig,
)
from attnlab.fileio import atomic_path, atomic_write_text
from attnlab.functional.rope import interleaved_to_split
from attnlab.models.decoder import DecoderLM

SUPPORTED_MODEL_TYPES = ("gpt2", "llama", "mistral", "qwen2")
# Causal-LM classes and their headless base models (whose head may be tied to the embedding).
ARCHITECTURES = {
    "gpt2": ("GPT2LMHeadModel", "GPT2Model"),
    "llama": ("LlamaForCausalLM", "LlamaModel"),
    "mistral": ("MistralForCausalLM", "MistralModel"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Model"),
}
# Hugging Face activation names (transformers' ACT2FN) -> attnlab names.
_HF_ACTIVATIONS = {
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu": "gelu",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
    "sigmoid": "sigmoid",
}
# attnlab -> Hugging Face, per family (GPT-2 checkpoints use "gelu_new" for the tanh GELU).
_GPT2_ACTIVATIONS = {
    "gelu_tanh": "gelu_new",
    "gelu": "gelu",
    "relu": "relu",
    "silu": "silu",
    "sigmoid": "sigmoid",
}
_LLAMA_ACTIVATIONS = {**_GPT2_ACTIVATIONS, "gelu_tanh": "gelu_pytorch_tanh"}
# Non-parameter buffers that older transformers versions saved: causal-mask tables (GPT-2)
# and RoPE frequencies (LLaMA family). They are recomputed, never loaded.
_IGNORED = re.compile(
    r"^(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)$"
    r"|^(model\.)?layers\.\d+\.self_attn\.rotary_emb\.inv_freq$"
)

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
_PICKLE_NAMES = ("pytorch_model.bin", "pytorch_model.bin.index.json")


class HFCheckpointError(ValueError):
    """A Hugging Face checkpoint is missing, malformed or uses something attnlab lacks."""


# --------------------------------------------------------------------------- configs


def _get(hf: dict[str, Any], key: str) -> Any:
    if hf.get(key) is None:
        raise HFCheckpointError(f"config.json has no {key!r}; it is required for this model")
    return hf[key]


def _activation(name: Any, key: str) -> str:
    if name not in _HF_ACTIVATIONS:
        raise HFCheckpointError(
            f"config.json {key}={name!r} is not supported; supported: {', '.join(_HF_ACTIVATIONS)}"
        )
    return _HF_ACTIVATIONS[name]


def _check_architecture(hf: dict[str, Any], model_type: str) -> None:
    archs = hf.get("architectures") or []
    for arch in archs:
        if arch not in ARCHITECTURES[model_type]:
            raise HFCheckpointError(
                f"architecture {arch!r} is not supported; for model_type {model_type!r} use "
                f"{' or '.join(ARCHITECTURES[model_type])}"
            )


def _rope_settings(hf: dict[str, Any]) -> dict[str, Any]:
    """PositionConfig fields from transformers 4.x (``rope_theta`` + ``rope_scaling``) or 5.x
    (``rope_parameters``) configs. Scaling "linear" and "llama3" are supported."""
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise HFCheckpointError(f"config.json rope_parameters must be a mapping, got {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in _ROPE_KEYS:
        raise HFCheckpointError(
            f"RoPE scaling {rope_type!r} is not supported; attnlab implements "
            f"{', '.join(repr(k) for k in _ROPE_KEYS)}"
        )
    extra = set(params) - {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
    extra -= set(_ROPE_KEYS[rope_type])
    if extra:
        raise HFCheckpointError(
            f"RoPE parameters {sorted(extra)} are not supported for rope_type {rope_type!r}"
        )
    factor = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if factor not in (None, 1, 1.0):
        raise HFCheckpointError(
            f"partial_rotary_factor={factor} is not supported; attnlab rotates whole heads"
        )
    theta = params.get("rope_theta", hf.get("rope_theta"))
    out: dict[str, Any] = {"rope_theta": float(theta if theta is not None else 10000.0)}
    if rope_type != "default":
        out["rope_scaling"] = rope_type
        for hf_key, ours in _ROPE_KEYS[rope_type].items():
            if hf_key in params:
                out[ours] = params[hf_key]
    return out


# rope_type -> {HF key: PositionConfig field}
_ROPE_KEYS: dict[str, dict[str, str]] = {
    "default": {},
    "linear": {"factor": "rope_factor"},
    "llama3": {
        "factor": "rope_factor",
        "low_freq_factor": "rope_low_freq_factor",
        "high_freq_factor": "rope_high_freq_factor",
        "original_max_position_embeddings": "rope_original_max_seq_len",
    },
}


def _rope_to_hf(pos: PositionConfig) -> dict[str, Any]:
    """The ``rope_parameters`` (5.x) / ``rope_scaling`` (4.x) dict for a PositionConfig."""
    kind = pos.rope_scaling or "default"
    params: dict[str, Any] = {"rope_type": kind, "rope_theta": pos.rope_theta}
    for hf_key, ours in _ROPE_KEYS[kind].items():
        params[hf_key] = getattr(pos, ours)
    return params


def _sliding_window(hf: dict[str, Any], model_type: str) -> int | None:
    if model_type == "mistral":
        return hf.get("sliding_window")
    if model_type != "qwen2" or not hf.get("use_sliding_window", False):
        return None  # LLaMA has no window; Qwen2 ignores sliding_window unless enabled
    window = hf.get("sliding_window")
    n_layers = _get(hf, "num_hidden_layers")
    first = hf.get("max_window_layers", 28)
    layer_types = hf.get("layer_types") or [
        "sliding_attention" if window is not None and i >= first else "full_attention"
        for i in range(n_layers)
    ]
    kinds = set(layer_types)
    if kinds <= {"full_attention"} or window is None:
        return None
    if kinds == {"sliding_attention"}:
        return window
    raise HFCheckpointError(
        f"Qwen2 with a sliding window on some layers only (layer_types={layer_types}) is not "
        "supported; attnlab uses one window for every layer"
    )


def config_from_hf(hf_config: dict[str, Any]) -> ModelConfig:
    """Map a Hugging Face ``config.json`` (as a dict) to an attnlab :class:`ModelConfig`."""
    model_type = hf_config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise HFCheckpointError(
            f"model_type {model_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    _check_architecture(hf_config, model_type)
    try:
        if model_type == "gpt2":
            cfg = _gpt2_config(hf_config)
        else:
            cfg = _llama_config(hf_config, model_type)
        cfg.validate()
    except ConfigError as e:
        raise HFCheckpointError(f"config.json maps to an invalid attnlab config: {e}") from None
    return cfg


def _gpt2_config(hf: dict[str, Any]) -> ModelConfig:
    refused = {
        "scale_attn_weights": False,  # unscaled attention scores
        "scale_attn_by_inverse_layer_idx": True,  # scores / (layer + 1)
        "add_cross_attention": True,
    }
    for key, bad in refused.items():
        if key in hf and hf[key] == bad:
            raise HFCheckpointError(f"GPT-2 with {key}={bad} is not supported by attnlab")
    # reorder_and_upcast_attn only changes the float precision of the scores (same maths).
    d = _get(hf, "n_embd")
    return ModelConfig(
        vocab_size=_get(hf, "vocab_size"),
        max_seq_len=_get(hf, "n_positions"),
        d_model=d,
        n_layers=_get(hf, "n_layer"),
        attention=AttentionConfig(
            n_heads=_get(hf, "n_head"),
            qkv_bias=True,
            out_bias=True,
            dropout=hf.get("attn_pdrop", 0.0),
        ),
        position=PositionConfig(kind="learned"),
        ffn=FFNConfig(
            kind="mlp",
            activation=_activation(
                hf.get("activation_function", "gelu_new"), "activation_function"
            ),
            hidden_dim=hf.get("n_inner") or 4 * d,
            bias=True,
        ),
        norm=NormConfig(kind="layernorm", eps=hf.get("layer_norm_epsilon", 1e-5), bias=True),
        tie_embeddings=hf.get("tie_word_embeddings", True),
        # attnlab has one dropout for embeddings and residuals; GPT-2 sets both to 0.1.
        dropout=hf.get("resid_pdrop", 0.0),
        init_std=hf.get("initializer_range", 0.02),
    )


def _llama_config(hf: dict[str, Any], model_type: str) -> ModelConfig:
    d, n_heads = _get(hf, "hidden_size"), _get(hf, "num_attention_heads")
    n_kv_heads = hf.get("num_key_value_heads") or n_heads
    head_dim = hf.get("head_dim") or d // n_heads
    if model_type == "llama":
        qkv_bias = out_bias = bool(hf.get("attention_bias", False))
        mlp_bias = bool(hf.get("mlp_bias", False))
    else:  # the bias layout is fixed by the architecture
        qkv_bias, out_bias, mlp_bias = model_type == "qwen2", False, False
    return ModelConfig(
        vocab_size=_get(hf, "vocab_size"),
        max_seq_len=_get(hf, "max_position_embeddings"),
        d_model=d,
        n_layers=_get(hf, "num_hidden_layers"),
        attention=AttentionConfig(
            n_heads=n_heads,
            n_kv_heads=None if n_kv_heads == n_heads else n_kv_heads,
            head_dim=None if head_dim * n_heads == d else head_dim,
            qkv_bias=qkv_bias,
            out_bias=out_bias,
            dropout=hf.get("attention_dropout", 0.0),
            sliding_window=_sliding_window(hf, model_type),
        ),
        position=PositionConfig(kind="rope", rope_layout="split", **_rope_settings(hf)),
        ffn=FFNConfig(
            kind="glu",
            activation=_activation(hf.get("hidden_act", "silu"), "hidden_act"),
            hidden_dim=_get(hf, "intermediate_size"),
            bias=mlp_bias,
        ),
        norm=NormConfig(kind="rmsnorm", eps=hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=hf.get("tie_word_embeddings", False),
        init_std=hf.get("initializer_range", 0.02),
    )


def _unrepresentable(reason: str) -> NoReturn:
    raise HFCheckpointError(f"no Hugging Face architecture can represent this model: {reason}")


def hf_model_type(cfg: ModelConfig) -> str:
    """The Hugging Face ``model_type`` that :func:`save_hf` writes ``cfg`` as.

    learned positions + LayerNorm + MLP -> ``gpt2``; RoPE + RMSNorm + gated FFN -> ``qwen2``
    when q/k/v have biases and nothing else does, ``mistral`` with a sliding window and no
    biases, else ``llama`` (missing biases are written as zeros)."""
    att = cfg.attention
    if cfg.norm.placement != "pre":
        _unrepresentable("post-norm blocks (all supported architectures are pre-norm)")
    if att.kind != "mha":
        _unrepresentable(f"attention.kind={att.kind!r}")
    if cfg.position.kind == "learned":
        if cfg.norm.kind != "layernorm" or cfg.ffn.kind != "mlp":
            _unrepresentable("learned positions need LayerNorm and an MLP feed-forward (GPT-2)")
        if cfg.n_kv_heads != cfg.n_heads or cfg.head_dim * cfg.n_heads != cfg.d_model:
            _unrepresentable("GPT-2 needs n_kv_heads == n_heads and head_dim * n_heads == d_model")
        if att.sliding_window is not None:
            _unrepresentable("GPT-2 has no sliding-window attention")
        return "gpt2"
    if cfg.position.kind == "rope":
        if cfg.norm.kind != "rmsnorm" or cfg.ffn.kind != "glu":
            _unrepresentable("RoPE models need RMSNorm and a gated feed-forward (LLaMA family)")
        qwen_biases = att.qkv_bias and not att.out_bias and not cfg.ffn.bias
        if att.sliding_window is None:
            return "qwen2" if qwen_biases else "llama"
        if qwen_biases:
            return "qwen2"
        if not (att.qkv_bias or att.out_bias or cfg.ffn.bias):
            return "mistral"
        _unrepresentable(
            "a sliding window with biases other than q/k/v only (Qwen2) or none (Mistral)"
        )
    _unrepresentable(f"position.kind={cfg.position.kind!r} (use 'learned' or 'rope')")


def config_to_hf(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The ``config.json`` dict :func:`save_hf` writes for ``cfg`` (see :func:`hf_model_type`)."""
    model_type = hf_model_type(cfg)
    att = cfg.attention
    common = {
        "architectures": [ARCHITECTURES[model_type][0]],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "use_cache": True,
        "bos_token_id": None,  # attnlab models carry no special tokens
        "eos_token_id": None,
        "pad_token_id": None,
        "dtype": str(dtype).removeprefix("torch."),  # transformers 5.x
        "torch_dtype": str(dtype).removeprefix("torch."),  # transformers 4.x
    }
    hidden = cfg.ffn.hidden_size(cfg.d_model)
    if model_type == "gpt2":
        return {
            **common,
            "n_embd": cfg.d_model,
            "n_layer": cfg.n_layers,
            "n_head": cfg.n_heads,
            "n_positions": cfg.max_seq_len,
            "n_inner": hidden,
            "activation_function": _GPT2_ACTIVATIONS[cfg.ffn.activation],
            "layer_norm_epsilon": cfg.norm.eps,
            "resid_pdrop": cfg.dropout,
            "embd_pdrop": cfg.dropout,
            "attn_pdrop": att.dropout,
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
            "add_cross_attention": False,
        }
    theta = cfg.position.rope_theta
    rope = _rope_to_hf(cfg.position)
    hf = {
        **common,
        "hidden_size": cfg.d_model,
        "intermediate_size": hidden,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": _LLAMA_ACTIVATIONS[cfg.ffn.activation],
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm.eps,
        "attention_dropout": att.dropout,
        "rope_theta": theta,  # transformers 4.x
        "rope_scaling": None if cfg.position.rope_scaling is None else rope,
        "rope_parameters": rope,  # transformers 5.x
    }
    if model_type == "llama":
        hf["attention_bias"] = att.qkv_bias or att.out_bias
        hf["mlp_bias"] = cfg.ffn.bias
        hf["pretraining_tp"] = 1
    elif model_type == "mistral":
        hf["sliding_window"] = att.sliding_window
    else:  # qwen2: one window for every layer, or none
        window = att.sliding_window
        hf["use_sliding_window"] = window is not None
        hf["sliding_window"] = window
        hf["max_window_layers"] = 0 if window is not None else cfg.n_layers
        kind = "sliding_attention" if window is not None else "full_attention"
        hf["layer_types"] = [kind] * cfg.n_layers
    return hf


# --------------------------------------------------------------------------- weights


class _Source:
    """Hugging Face tensors handed out by name: records missing and mis-shaped ones, and
    what is left over at the end (unexpected tensors)."""

    def __init__(self, tensors: dict[str, Tensor]):
        self.left = dict(tensors)
        self.missing: list[str] = []
        self.wrong: list[str] = []

    def take(self, name: str, shape: tuple[int, ...]) -> Tensor | None:
        t = self.left.pop(name, None)
        if t is None:
            self.missing.append(name)
        elif tuple(t.shape) != shape:
            self.wrong.append(f"{name} has shape {tuple(t.shape)}, config.json implies {shape}")
            t = None
        return t

    def check(self) -> None:
        unexpected = sorted(n for n in self.left if not _IGNORED.match(n))
        for label, names in (
            ("wrong shapes", self.wrong),
            ("missing tensors", self.missing),
            ("unexpected tensors", unexpected),
        ):
            if names:
                shown = ", ".join(names[:8]) + (
                    f" (+{len(names) - 8} more)" if len(names) > 8 else ""
                )
                raise HFCheckpointError(f"checkpoint does not match config.json: {label}: {shown}")


def _cat(parts: Iterable[Tensor | None]) -> Tensor | None:
    parts = list(parts)
    return None if any(p is None for p in parts) else torch.cat(parts, dim=0)


def _prefix(tensors: dict[str, Tensor], prefix: str, probe: str) -> str:
    """``prefix`` if the checkpoint nests the backbone under it (``transformer.``, ``model.``),
    else "" (headless base-model checkpoints)."""
    return prefix if prefix + probe in tensors else ""


def _tied_head(src: _Source, emb: Tensor | None) -> None:
    """Tied models need no lm_head; a stored copy is accepted only if it equals the embedding."""
    head = src.left.pop("lm_head.weight", None)
    if head is not None and (emb is None or not torch.equal(head, emb)):
        raise HFCheckpointError(
            "config.json says tie_word_embeddings=true but lm_head.weight differs from the "
            "token embedding; set tie_word_embeddings to false in config.json"
        )


def _gpt2_to_attnlab(tensors: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor | None]:
    d, f, V, L = cfg.d_model, cfg.ffn.hidden_size(cfg.d_model), cfg.vocab_size, cfg.max_seq_len
    src, p = _Source(tensors), _prefix(tensors, "transformer.", "wte.weight")

    def conv(name: str, d_in: int, d_out: int) -> Tensor | None:
        w = src.take(name, (d_in, d_out))  # Conv1D stores (in, out)
        return None if w is None else w.t()  # (out, in)

    out: dict[str, Tensor | None] = {
        "tok_emb.weight": src.take(f"{p}wte.weight", (V, d)),
        "pos_emb.weight": src.take(f"{p}wpe.weight", (L, d)),
        "norm.weight": src.take(f"{p}ln_f.weight", (d,)),
        "norm.bias": src.take(f"{p}ln_f.bias", (d,)),
    }
    for i in range(cfg.n_layers):
        h, a = f"{p}h.{i}.", f"blocks.{i}."
        out |= {
            a + "attn_norm.weight": src.take(h + "ln_1.weight", (d,)),
            a + "attn_norm.bias": src.take(h + "ln_1.bias", (d,)),
            a + "attn.qkv.weight": conv(h + "attn.c_attn.weight", d, 3 * d),  # rows [q; k; v]
            a + "attn.qkv.bias": src.take(h + "attn.c_attn.bias", (3 * d,)),
            a + "attn.out.weight": conv(h + "attn.c_proj.weight", d, d),
            a + "attn.out.bias": src.take(h + "attn.c_proj.bias", (d,)),
            a + "ffn_norm.weight": src.take(h + "ln_2.weight", (d,)),
            a + "ffn_norm.bias": src.take(h + "ln_2.bias", (d,)),
            a + "ffn.up.weight": conv(h + "mlp.c_fc.weight", d, f),
            a + "ffn.up.bias": src.take(h + "mlp.c_fc.bias", (f,)),
            a + "ffn.down.weight": conv(h + "mlp.c_proj.weight", f, d),
            a + "ffn.down.bias": src.take(h + "mlp.c_proj.bias", (d,)),
        }
    if cfg.tie_embeddings:
        _tied_head(src, out["tok_emb.weight"])
    else:
        out["lm_head.weight"] = src.take("lm_head.weight", (V, d))
    src.check()
    return out


def _llama_to_attnlab(tensors: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor | None]:
    d, f, V = cfg.d_model, cfg.ffn.hidden_size(cfg.d_model), cfg.vocab_size
    q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    att = cfg.attention
    src, p = _Source(tensors), _prefix(tensors, "model.", "embed_tokens.weight")
    out: dict[str, Tensor | None] = {
        "tok_emb.weight": src.take(f"{p}embed_tokens.weight", (V, d)),
        "norm.weight": src.take(f"{p}norm.weight", (d,)),
    }
    for i in range(cfg.n_layers):
        h, a = f"{p}layers.{i}.", f"blocks.{i}."
        qkv = (("q_proj", q_dim), ("k_proj", kv_dim), ("v_proj", kv_dim))
        out |= {
            a + "attn_norm.weight": src.take(h + "input_layernorm.weight", (d,)),
            a + "attn.qkv.weight": _cat(
                src.take(f"{h}self_attn.{n}.weight", (rows, d)) for n, rows in qkv
            ),
            a + "attn.out.weight": src.take(h + "self_attn.o_proj.weight", (d, q_dim)),
            a + "ffn_norm.weight": src.take(h + "post_attention_layernorm.weight", (d,)),
            a + "ffn.gate_up.weight": _cat(
                src.take(f"{h}mlp.{n}.weight", (f, d)) for n in ("gate_proj", "up_proj")
            ),
            a + "ffn.down.weight": src.take(h + "mlp.down_proj.weight", (d, f)),
        }
        if att.qkv_bias:
            out[a + "attn.qkv.bias"] = _cat(
                src.take(f"{h}self_attn.{n}.bias", (rows,)) for n, rows in qkv
            )
        if att.out_bias:
            out[a + "attn.out.bias"] = src.take(h + "self_attn.o_proj.bias", (d,))
        if cfg.ffn.bias:
            out[a + "ffn.gate_up.bias"] = _cat(
                src.take(f"{h}mlp.{n}.bias", (f,)) for n in ("gate_proj", "up_proj")
            )
            out[a + "ffn.down.bias"] = src.take(h + "mlp.down_proj.bias", (d,))
    if cfg.tie_embeddings:
        _tied_head(src, out["tok_emb.weight"])
    else:
        out["lm_head.weight"] = src.take("lm_head.weight", (V, d))
    src.check()
    return out


def _split_rows(w: Tensor, *sizes: int) -> tuple[Tensor, ...]:
    return tuple(t.contiguous() for t in w.split(sizes, dim=0))


def _rope_rows_to_split(w: Tensor, n_heads: int, head_dim: int) -> Tensor:
    """Reorder q or k projection rows (weight (h * d_h, d) or bias (h * d_h,)) from the
    interleaved RoPE pair layout to the split-halves layout Hugging Face uses. q . k is
    unchanged because q and k get the same permutation within each head."""
    perm = interleaved_to_split(head_dim).to(w.device)
    rows = w.reshape(n_heads, head_dim, *w.shape[1:])  # (h, d_h, ...)
    return rows[:, perm].reshape(w.shape)


def _gpt2_from_attnlab(sd: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    def bias(name: str, size: int) -> Tensor:  # GPT-2 always has biases; absent ones are 0
        ref = sd["tok_emb.weight"]
        return sd[name] if name in sd else torch.zeros(size, dtype=ref.dtype, device=ref.device)

    d, f = cfg.d_model, cfg.ffn.hidden_size(cfg.d_model)
    out = {
        "transformer.wte.weight": sd["tok_emb.weight"],
        "transformer.wpe.weight": sd["pos_emb.weight"],
        "transformer.ln_f.weight": sd["norm.weight"],
        "transformer.ln_f.bias": bias("norm.bias", d),
    }
    for i in range(cfg.n_layers):
        h, a = f"transformer.h.{i}.", f"blocks.{i}."
        out |= {
            h + "ln_1.weight": sd[a + "attn_norm.weight"],
            h + "ln_1.bias": bias(a + "attn_norm.bias", d),
            h + "attn.c_attn.weight": sd[a + "attn.qkv.weight"].t(),  # Conv1D: (in, out)
            h + "attn.c_attn.bias": bias(a + "attn.qkv.bias", 3 * d),
            h + "attn.c_proj.weight": sd[a + "attn.out.weight"].t(),
            h + "attn.c_proj.bias": bias(a + "attn.out.bias", d),
            h + "ln_2.weight": sd[a + "ffn_norm.weight"],
            h + "ln_2.bias": bias(a + "ffn_norm.bias", d),
            h + "mlp.c_fc.weight": sd[a + "ffn.up.weight"].t(),
            h + "mlp.c_fc.bias": bias(a + "ffn.up.bias", f),
            h + "mlp.c_proj.weight": sd[a + "ffn.down.weight"].t(),
            h + "mlp.c_proj.bias": bias(a + "ffn.down.bias", d),
        }
    return out


def _llama_from_attnlab(
    sd: dict[str, Tensor], cfg: ModelConfig, model_type: str
) -> dict[str, Tensor]:
    att, f, d = cfg.attention, cfg.ffn.hidden_size(cfg.d_model), cfg.d_model
    q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    interleaved = cfg.position.rope_layout == "interleaved"
    # Which biases the chosen architecture has (absent attnlab biases are written as zeros).
    if model_type == "llama":
        qkv_bias = out_bias = att.qkv_bias or att.out_bias
        mlp_bias = cfg.ffn.bias
    else:
        qkv_bias, out_bias, mlp_bias = model_type == "qwen2", False, False
    ref = sd["tok_emb.weight"]

    def get(name: str, size: int) -> Tensor:
        return sd[name] if name in sd else torch.zeros(size, dtype=ref.dtype, device=ref.device)

    def to_split(t: Tensor, n: int) -> Tensor:
        return _rope_rows_to_split(t, n, cfg.head_dim) if interleaved else t

    out = {
        "model.embed_tokens.weight": sd["tok_emb.weight"],
        "model.norm.weight": sd["norm.weight"],
    }
    for i in range(cfg.n_layers):
        h, a = f"model.layers.{i}.", f"blocks.{i}."
        q, k, v = _split_rows(sd[a + "attn.qkv.weight"], q_dim, kv_dim, kv_dim)
        gate, up = _split_rows(sd[a + "ffn.gate_up.weight"], f, f)
        out |= {
            h + "input_layernorm.weight": sd[a + "attn_norm.weight"],
            h + "self_attn.q_proj.weight": to_split(q, cfg.n_heads),
            h + "self_attn.k_proj.weight": to_split(k, cfg.n_kv_heads),
            h + "self_attn.v_proj.weight": v,
            h + "self_attn.o_proj.weight": sd[a + "attn.out.weight"],
            h + "post_attention_layernorm.weight": sd[a + "ffn_norm.weight"],
            h + "mlp.gate_proj.weight": gate,
            h + "mlp.up_proj.weight": up,
            h + "mlp.down_proj.weight": sd[a + "ffn.down.weight"],
        }
        if qkv_bias:
            qb, kb, vb = _split_rows(
                get(a + "attn.qkv.bias", q_dim + 2 * kv_dim), q_dim, kv_dim, kv_dim
            )
            out[h + "self_attn.q_proj.bias"] = to_split(qb, cfg.n_heads)
            out[h + "self_attn.k_proj.bias"] = to_split(kb, cfg.n_kv_heads)
            out[h + "self_attn.v_proj.bias"] = vb
        if out_bias:
            out[h + "self_attn.o_proj.bias"] = get(a + "attn.out.bias", d)
        if mlp_bias:
            gb, ub = _split_rows(sd[a + "ffn.gate_up.bias"], f, f)
            out[h + "mlp.gate_proj.bias"], out[h + "mlp.up_proj.bias"] = gb, ub
            out[h + "mlp.down_proj.bias"] = sd[a + "ffn.down.bias"]
    return out


# --------------------------------------------------------------------------- files


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        raise HFCheckpointError(f"{path}: not a directory; pass a Hugging Face model directory")
    config_file = path / CONFIG_NAME
    if not config_file.is_file():
        raise HFCheckpointError(
            f"{path}: no {CONFIG_NAME}; a Hugging Face model directory needs config.json beside "
            "its weights"
        )
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise HFCheckpointError(f"{config_file}: not valid JSON ({e})") from None


def _weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the single file, or every shard of the index."""
    if (path / WEIGHTS_NAME).is_file():
        return [path / WEIGHTS_NAME]
    index_file = path / WEIGHTS_INDEX_NAME
    if index_file.is_file():
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise HFCheckpointError(f"{index_file}: expected JSON with a 'weight_map'") from None
        files = [path / name for name in dict.fromkeys(weight_map.values())]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise HFCheckpointError(
                f"{path}: shards listed in {WEIGHTS_INDEX_NAME} are missing: {', '.join(absent)}"
            )
        return files
    if any((path / name).is_file() for name in _PICKLE_NAMES):
        raise HFCheckpointError(
            f"{path}: only pickled weights (pytorch_model.bin) found; attnlab loads safetensors "
            "only, since unpickling can run arbitrary code. Convert with transformers: "
            "AutoModelForCausalLM.from_pretrained(path).save_pretrained(path)"
        )
    raise HFCheckpointError(f"{path}: no {WEIGHTS_NAME} or {WEIGHTS_INDEX_NAME} found")


def _read_tensors(files: list[Path]) -> dict[str, Tensor]:
    tensors: dict[str, Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return tensors


def load_hf(
    path: str | Path,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> DecoderLM:
    """Load a Hugging Face GPT-2 / LLaMA / Mistral / Qwen2 checkpoint directory.

    Returns a :class:`DecoderLM` in eval mode (as ``from_pretrained`` does). ``dtype``
    defaults to float32 whatever the checkpoint stores; ``device`` defaults to the CPU."""
    path = Path(path)
    cfg = config_from_hf(_read_config(path))
    tensors = _read_tensors(_weight_files(path))
    if cfg.position.kind == "learned":
        state = _gpt2_to_attnlab(tensors, cfg)
    else:
        state = _llama_to_attnlab(tensors, cfg)
    model = DecoderLM(cfg)
    # strict: every attnlab parameter must come from the checkpoint (the tied head is shared).
    expected = set(model.state_dict()) - ({"lm_head.weight"} if cfg.tie_embeddings else set())
    if set(state) != expected:  # a mapping bug, not a user error
        raise RuntimeError(f"interop mapping mismatch: {sorted(set(state) ^ expected)}")
    with torch.no_grad():
        params = model.state_dict()
        for name, t in state.items():
            params[name].copy_(t)
    # Cast parameters only: module.to(dtype) would also round the float32 RoPE frequencies.
    model.to(device=device)
    if dtype is not None:
        for p in model.parameters():
            p.data = p.data.to(dtype)
    return model.eval()


def save_hf(model: DecoderLM, path: str | Path) -> None:
    """Write ``config.json`` and ``model.safetensors`` loadable by
    ``transformers.AutoModelForCausalLM.from_pretrained(path)`` with the same logits.

    A tied head is not stored (transformers re-ties it). Interleaved RoPE q/k rows are
    reordered to the split layout. Raises :class:`HFCheckpointError` for configs no
    supported architecture represents (see :func:`hf_model_type`)."""
    cfg = model.cfg
    dtype = model.tok_emb.weight.dtype
    hf_config = config_to_hf(cfg, dtype)
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    if hf_config["model_type"] == "gpt2":
        tensors = _gpt2_from_attnlab(sd, cfg)
    else:
        tensors = _llama_from_attnlab(sd, cfg, hf_config["model_type"])
    if not cfg.tie_embeddings:
        tensors["lm_head.weight"] = sd["lm_head.weight"]
    # safetensors refuses shared or strided storage: give each tensor its own contiguous copy.
    tensors = {k: v.to("cpu").contiguous().clone() for k, v in tensors.items()}
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    # Each file replaces its old version whole: a crash never leaves a truncated one.
    with atomic_path(path / WEIGHTS_NAME) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    atomic_write_text(path / CONFIG_NAME, json.dumps(hf_config, indent=2) + "\n")
