"""What every Hugging Face family shares: the model folder (``config.json``, safetensors
weights in one file or shards listed in ``model.safetensors.index.json``), writing a folder,
and the helpers the per-family name mappings are built from.

A family maps names in one of two ways: explicitly, tensor by tensor with its shape
(gpt2.py, llama.py: ``Source.take``), or declaratively, as a :data:`Specs` table read by
``Source.plan`` and written back by :func:`unplan` (bert, marian, vit, deepseek), the
shapes then following from the attnlab model being loaded.

Weights are read with safetensors only: pickled ``pytorch_model.bin`` files can run
arbitrary code when loaded, so they are refused.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor

from attnlab.config import ModelConfig, PositionConfig
from attnlab.fileio import atomic_path, atomic_write_text
from attnlab.functional.rope import interleaved_to_split

CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
PREPROCESSOR_CONFIG_NAME = "preprocessor_config.json"  # an image processor's settings
# What an image processor does to pixels before the model, read with config.json (ViT).
PREPROCESSOR_KEYS = (
    "do_rescale",
    "rescale_factor",
    "do_normalize",
    "image_mean",
    "image_std",
    "resample",
)
WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
_PICKLE_NAMES = ("pytorch_model.bin", "pytorch_model.bin.index.json")

# Hugging Face activation names (transformers' ACT2FN) -> attnlab names.
HF_ACTIVATIONS = {
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu": "gelu",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
    "sigmoid": "sigmoid",
    "relu2": "relu2",
}


class HFCheckpointError(ValueError):
    """A Hugging Face checkpoint is missing, malformed or uses something attnlab lacks."""


def unrepresentable(reason: str) -> HFCheckpointError:
    return HFCheckpointError(f"no Hugging Face architecture can represent this model: {reason}")


# --------------------------------------------------------------------------- config.json


def get(hf: dict[str, Any], key: str) -> Any:
    """A required config.json entry."""
    if hf.get(key) is None:
        raise HFCheckpointError(f"config.json has no {key!r}; it is required for this model")
    return hf[key]


def number(hf: dict[str, Any], key: str) -> float:
    """A config.json entry that must be a number (not a string, a boolean or null)."""
    value = hf.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise HFCheckpointError(f"config.json {key} must be a number, got {value!r}")
    return float(value)


def activation(name: Any, key: str) -> str:
    if name not in HF_ACTIVATIONS:
        raise HFCheckpointError(
            f"config.json {key}={name!r} is not supported; supported: {', '.join(HF_ACTIVATIONS)}"
        )
    return HF_ACTIVATIONS[name]


# attnlab -> Hugging Face activation names (a family overrides the spellings it prefers).
TO_HF_ACTIVATIONS = {
    "gelu_tanh": "gelu_pytorch_tanh",
    "gelu": "gelu",
    "relu": "relu",
    "silu": "silu",
    "sigmoid": "sigmoid",
    "relu2": "relu2",
}


def hf_activation(name: str, table: dict[str, str] = TO_HF_ACTIVATIONS) -> str:
    if name not in table:
        raise unrepresentable(f"activation {name!r} (supported: {', '.join(table)})")
    return table[name]


def dtype_entries(dtype: torch.dtype) -> dict[str, str]:
    name = str(dtype).removeprefix("torch.")
    return {"dtype": name, "torch_dtype": name}  # transformers 5.x, 4.x


def label_entries(n: int, names: list[str] | None = None) -> dict[str, dict]:
    """``id2label`` / ``label2id`` for ``n`` classes: ``names``, else transformers' default
    ``LABEL_<i>``."""
    labels = {str(i): names[i] if names else f"LABEL_{i}" for i in range(n)}
    return {"id2label": labels, "label2id": {v: int(k) for k, v in labels.items()}}


def label_names(hf: dict[str, Any], n: int) -> list[str] | None:
    """The class names of config.json's ``id2label`` (class i's name at index i); None
    when it has none or only transformers' defaults (``LABEL_<i>``)."""
    id2label = hf.get("id2label") or {}
    if not isinstance(id2label, dict) or not id2label:
        return None
    try:
        names = {int(k): str(v) for k, v in id2label.items()}
    except ValueError:
        raise HFCheckpointError("config.json id2label keys must be class ids 0, 1, ...") from None
    if sorted(names) != list(range(n)):
        raise HFCheckpointError(f"config.json id2label must name each class 0 to {n - 1} once")
    ordered = [names[i] for i in range(n)]
    return None if ordered == [f"LABEL_{i}" for i in range(n)] else ordered


# rope_type -> {HF key: PositionConfig field}
ROPE_KEYS: dict[str, dict[str, str]] = {
    "default": {},
    "linear": {"factor": "rope_factor"},
    "llama3": {
        "factor": "rope_factor",
        "low_freq_factor": "rope_low_freq_factor",
        "high_freq_factor": "rope_high_freq_factor",
        "original_max_position_embeddings": "rope_original_max_seq_len",
    },
    "yarn": {
        "factor": "rope_factor",
        "original_max_position_embeddings": "rope_original_max_seq_len",
        "beta_fast": "rope_beta_fast",
        "beta_slow": "rope_beta_slow",
        "mscale": "rope_mscale",
        "mscale_all_dim": "rope_mscale_all_dim",
        "attention_factor": "rope_attention_factor",
        "truncate": "rope_truncate",
    },
    "longrope": {
        "short_factor": "rope_short_factor",
        "long_factor": "rope_long_factor",
        "factor": "rope_factor",
        "original_max_position_embeddings": "rope_original_max_seq_len",
        "attention_factor": "rope_attention_factor",
    },
}

# HF keys written only away from these values (transformers' defaults when left out)
_ROPE_OMITTED = {("attention_factor", None), ("truncate", True)}


# rope_type -> the keys transformers requires ("factor" may be null for YaRN)
ROPE_REQUIRED: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "yarn": ("factor",),
    "longrope": ("short_factor", "long_factor"),
}


def rope_settings(
    hf: dict[str, Any], supported: tuple[str, ...], *, partial: bool = False
) -> dict[str, Any]:
    """PositionConfig fields (theta, scaling) from transformers 4.x (``rope_theta`` +
    ``rope_scaling``) or 5.x (``rope_parameters``) configs; ``supported``: the rope_types
    the family has (keys of :data:`ROPE_KEYS`); ``partial``: whether the family rotates
    part of each head (``partial_rotary_factor``, read as ``rope_fraction``; else refused)."""
    params = rope_parameters(hf)
    rope_type = params.get("rope_type", params.get("type", "default"))
    fraction = _check_rope_parameters(hf, params, rope_type, supported, partial)
    theta = params.get("rope_theta", hf.get("rope_theta"))
    out: dict[str, Any] = {"rope_theta": float(theta if theta is not None else 10000.0)}
    if fraction != 1.0:
        out["rope_fraction"] = fraction
    if rope_type != "default":
        out["rope_scaling"] = rope_type
        for hf_key, ours in ROPE_KEYS[rope_type].items():
            if params.get(hf_key) is not None:
                out[ours] = params[hf_key]
    if rope_type == "yarn" and "truncate" in params:
        # transformers rounds the ramp's bounds when truncate is truthy: null reads as false
        if params["truncate"] not in (True, False, None):
            raise HFCheckpointError(
                f"config.json YaRN truncate must be true, false or null, got {params['truncate']!r}"
            )
        out["rope_truncate"] = bool(params["truncate"])
    if rope_type in ("llama3", "yarn", "longrope"):
        # as transformers reads it: a top-level original_max_position_embeddings (Phi-3's
        # place for it) wins over the RoPE parameters' own; without either, the pre-training
        # context is the model's own (not attnlab's default)
        original = (
            hf.get("original_max_position_embeddings")
            or params.get("original_max_position_embeddings")
            or hf.get("max_position_embeddings")
        )
        if original is not None:
            out["rope_original_max_seq_len"] = original
        if rope_type == "longrope" and params.get("factor") is None:
            # transformers: how far the context was stretched sets the attention factor
            if original is None or hf.get("max_position_embeddings") is None:
                raise HFCheckpointError(
                    "LongRoPE without a factor needs max_position_embeddings and its original"
                )
            out["rope_factor"] = hf["max_position_embeddings"] / original
        if rope_type == "yarn" and params["factor"] is None:
            # transformers (DeepSeek-V3's configs): the stretch is the ratio of the contexts
            if original is None or hf.get("max_position_embeddings") is None:
                raise HFCheckpointError(
                    "YaRN factor null needs max_position_embeddings and its original to derive it"
                )
            out["rope_factor"] = hf["max_position_embeddings"] / original
    return out


def rope_parameters(hf: dict[str, Any]) -> dict[str, Any]:
    """The RoPE parameters of a config.json: 4.x's ``rope_scaling``, else 5.x's
    ``rope_parameters`` (a mapping; {} when neither is set)."""
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise HFCheckpointError(f"config.json rope_parameters must be a mapping, got {params!r}")
    return params


def _check_rope_parameters(
    hf: dict[str, Any],
    params: dict[str, Any],
    rope_type: str,
    supported: tuple[str, ...],
    partial: bool = False,
) -> float:
    """Refuse RoPE parameters attnlab does not implement: an unsupported ``rope_type``,
    keys it does not read, a partial rotation where the family has none (``partial``), or
    required keys left out. Returns the fraction of each head rotated."""
    if rope_type not in supported:
        # (LongRoPE is Phi-3's: its generate encodes the sequence again past the original
        # context, which the other families' transformers models do not)
        hint = " for this model type (it is read for phi3)" if rope_type == "longrope" else ""
        raise HFCheckpointError(
            f"RoPE scaling {rope_type!r} is not supported{hint}; attnlab implements "
            f"{', '.join(repr(k) for k in supported)}"
        )
    extra = {k for k, v in params.items() if v is not None}  # None: transformers' default
    extra -= {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
    extra -= set(ROPE_KEYS[rope_type])
    if extra:
        raise HFCheckpointError(
            f"RoPE parameters {sorted(extra)} are not supported for rope_type {rope_type!r}"
        )
    factor = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if factor is None:  # null: transformers' default
        factor = 1.0
    if factor != 1.0 and not partial:
        raise HFCheckpointError(
            f"partial_rotary_factor={factor} is not supported for this model type: its "
            "transformers model rotates whole heads (attnlab reads it for phi3 and gpt_neox)"
        )
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise HFCheckpointError(
            f"config.json partial_rotary_factor must be a number in (0, 1], got {factor!r}"
        )
    # transformers refuses these too; attnlab's defaults would silently not scale
    nullable = {"factor"} if rope_type == "yarn" else set()
    missing = [
        k
        for k in ROPE_REQUIRED.get(rope_type, ())
        if k not in params or (params[k] is None and k not in nullable)
    ]
    if missing:
        raise HFCheckpointError(f"RoPE parameters for rope_type {rope_type!r} need {missing}")
    return float(factor)


def rope_to_hf(pos: PositionConfig) -> dict[str, Any]:
    """The ``rope_parameters`` (5.x) / ``rope_scaling`` (4.x) dict for a PositionConfig."""
    kind = pos.rope_scaling or "default"
    if kind not in ROPE_KEYS:
        raise unrepresentable(f"RoPE scaling {kind!r}")
    params: dict[str, Any] = {"rope_type": kind, "rope_theta": pos.rope_theta}
    for hf_key, ours in ROPE_KEYS[kind].items():
        value = getattr(pos, ours)
        if isinstance(value, list):  # (LongRoPE's factors: a copy, never the config's own)
            params[hf_key] = list(value)
        elif (hf_key, value) not in _ROPE_OMITTED:
            params[hf_key] = value
    if pos.rope_fraction != 1.0:  # (only families that rotate part of a head export it)
        params["partial_rotary_factor"] = pos.rope_fraction
    return params


def rope_rows_to_split(
    w: Tensor, n_heads: int, head_dim: int, rope_dim: int | None = None
) -> Tensor:
    """Reorder q or k projection rows (weight (h * d_h, d) or bias (h * d_h,)) from the
    interleaved RoPE pair layout to the split-halves layout Hugging Face uses, within the
    first ``rope_dim`` features of each head (all by default; the rest, unrotated, stay in
    place). q . k is unchanged because q and k get the same permutation within each head."""
    d_r = head_dim if rope_dim is None else rope_dim
    perm = torch.cat((interleaved_to_split(d_r), torch.arange(d_r, head_dim))).to(w.device)
    rows = w.reshape(n_heads, head_dim, *w.shape[1:])  # (h, d_h, ...)
    return rows[:, perm].reshape(w.shape)


def rope_rows_to_interleaved(w: Tensor, n_heads: int, head_dim: int) -> Tensor:
    """The inverse of :func:`rope_rows_to_split` over whole heads: q or k projection rows
    (weight (h * d_h, d) or bias (h * d_h,)) from the split-halves layout to interleaved
    pairs (Cohere's), (i, i + d_h/2) -> (2i, 2i + 1) within each head."""
    perm = torch.argsort(interleaved_to_split(head_dim)).to(w.device)
    rows = w.reshape(n_heads, head_dim, *w.shape[1:])  # (h, d_h, ...)
    return rows[:, perm].reshape(w.shape)


def local_layers(cfg: ModelConfig) -> list[bool]:
    """Whether each layer attends within attention.sliding_window (its layer_pattern
    resolved over the model's layers)."""
    return [cfg.attention.window_of(i) is not None for i in range(cfg.n_layers)]


# config.json ``layer_types`` (GPT-OSS, Gemma 2 and 3) -> attention.layer_pattern letters
LAYER_TYPES = {"sliding_attention": "L", "full_attention": "G"}


def windows_of_layer_types(
    hf: dict[str, Any], types: Any, n_layers: int
) -> tuple[int | None, str | None]:
    """(sliding_window, layer_pattern) of ``types``, config.json's layer_types (one per
    layer): the window of the sliding_attention layers, and, when some layers are global,
    their pattern of L (local) and G (global) cut to its shortest period (layer i takes
    entry i % period)."""
    if not isinstance(types, list) or len(types) != n_layers or set(types) - set(LAYER_TYPES):
        raise HFCheckpointError(
            f"config.json layer_types={types!r}: expected {n_layers} of {' or '.join(LAYER_TYPES)}"
        )
    pattern = "".join(LAYER_TYPES[t] for t in types)
    period = next(p for p in range(1, n_layers + 1) if pattern == _cycle(pattern[:p], n_layers))
    pattern = pattern[:period]
    if "L" not in pattern:
        return None, None
    window = hf.get("sliding_window")
    if window is None:
        raise HFCheckpointError(
            "config.json sliding_window is null but layer_types has sliding_attention layers"
        )
    return window, (pattern if "G" in pattern else None)


def periodic_layer_types(n_layers: int, period: int, *, first_global: bool = False) -> list[str]:
    """layer_types with every ``period``-th layer global (full_attention), the others
    sliding: GptOssConfig's and Gemma2Config's default (period 2), Gemma3TextConfig's from
    its sliding_window_pattern (layer i global when (i + 1) % period == 0).
    ``first_global``: from layer 0 on (i % period == 0), ModernBertConfig's from its
    global_attn_every_n_layers."""
    offset = 0 if first_global else 1
    return [
        "sliding_attention" if (i + offset) % period else "full_attention" for i in range(n_layers)
    ]


def _cycle(pattern: str, n: int) -> str:
    return (pattern * (n // len(pattern) + 1))[:n]


def is_plain_decoder(cfg: ModelConfig) -> bool:
    """A pre-norm multi-head-attention decoder: what GPT-2 and the LLaMA layouts hold."""
    return cfg.arch == "decoder" and cfg.norm.placement == "pre" and cfg.attention.kind == "mha"


# transformers' MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig and GptOssConfig default
# router_aux_loss_coef
ROUTER_AUX_LOSS_COEF = 0.001


def switch_loss_from_hf(hf: dict[str, Any]) -> float:
    """``ffn.switch_aux_loss_coef`` of a Mixtral, Qwen2-MoE, Qwen3-MoE or GPT-OSS config.json: its
    ``router_aux_loss_coef`` where ``output_router_logits`` turns the loss on, else 0."""
    if not hf.get("output_router_logits"):
        return 0.0
    coef = get(hf, "router_aux_loss_coef")
    if isinstance(coef, bool) or not isinstance(coef, int | float):
        raise HFCheckpointError(f"config.json router_aux_loss_coef must be a number, got {coef!r}")
    return float(coef)


def switch_loss_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json entries of ``ffn.switch_aux_loss_coef`` (transformers' default
    coefficient, unused, when the loss is off)."""
    coef = cfg.ffn.switch_aux_loss_coef
    return {
        "output_router_logits": coef > 0,
        "router_aux_loss_coef": coef if coef > 0 else ROUTER_AUX_LOSS_COEF,
    }


def moe_layers_from_hf(hf: dict[str, Any], n_experts: int) -> tuple[int, list[int]] | None:
    """(``ffn.first_k_dense``, ``ffn.dense_layers``) of a Qwen2-MoE or Qwen3-MoE config.json,
    whose decoder layers have experts unless listed in ``mlp_only_layers``, on every
    ``decoder_sparse_step``-th layer, when there are any (``num_experts`` > 0); None where no
    layer has experts. The leading dense layers are ``first_k_dense``, the others listed."""
    n_layers, step = get(hf, "num_hidden_layers"), get(hf, "decoder_sparse_step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise HFCheckpointError(f"config.json decoder_sparse_step must be >= 1, got {step!r}")
    only = hf.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
        raise HFCheckpointError(f"config.json mlp_only_layers must be layer numbers, got {only!r}")
    # transformers' Qwen2MoeDecoderLayer and Qwen3MoeDecoderLayer
    moe = [i for i in range(n_layers) if i not in only and (i + 1) % step == 0] if n_experts else []
    if not moe:
        return None
    return moe[0], [i for i in range(moe[0], n_layers) if i not in moe]


def moe_layers_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json entries that put experts on ``cfg``'s MoE layers (every layer but
    those listed in ``mlp_only_layers``)."""
    dense = [i for i in range(cfg.n_layers) if not cfg.ffn.moe_layer(i)]
    return {"decoder_sparse_step": 1, "mlp_only_layers": dense}


def one_dropout(
    hf: dict[str, Any], residual: str = "resid_pdrop", embedding: str | None = "embd_pdrop"
) -> float:
    """attnlab's one dropout (embeddings and each sublayer's output) of a config.json with
    a ``residual`` and an ``embedding`` dropout (Phi's and GPT-J's ``resid_pdrop`` and
    ``embd_pdrop``, StarCoder2's ``residual_dropout`` and ``embedding_dropout``; ``embedding``
    None: the family never drops its embeddings, OPT's): the residual one, with a warning
    where the embedding one differs (training only: evaluation and generation do not drop)."""
    resid = hf.get(residual) or 0.0
    embd = (hf.get(embedding) or 0.0) if embedding else 0.0
    if embd != resid:
        said = (
            f"{embedding}={embd} differs from {residual}={resid}"
            if embedding
            else f"{residual}={resid} drops each sublayer's output but not the embeddings"
        )
        warnings.warn(
            f"config.json {said}: attnlab has one dropout, {resid}, for the embeddings and "
            "each sublayer's output (training only; evaluation and generation are unaffected)",
            stacklevel=4,
        )
    return resid


def n_labels(hf: dict[str, Any]) -> int:
    return hf.get("num_labels") or len(hf.get("id2label") or {}) or 2


# The attnlab task (``attnlab.tasks.TASKS``) of each encoder head (BERT's, ModernBERT's); "lm"
# for none and for ELECTRA's replaced-token detector (no task runs them).
TASK_OF_HEAD = {
    "mlm": "mlm",
    "sequence": "text-classification",
    "token": "token-classification",
    "qa": "question-answering",
    "none": "lm",
    "replaced_token": "lm",
}
NAMED_HEADS = ("sequence", "token")  # encoder heads whose labels have names (id2label)


def numbered(n: int) -> list[str]:
    """The label names of a classifier whose labels have none: its label ids as text."""
    return [str(i) for i in range(n)]


def exported_label_names(names: list[str] | None, n: int) -> list[str] | None:
    """The id2label names export writes for a classifier's ``names``: transformers'
    defaults (None) where they are only numbered."""
    return None if names is None or names == numbered(n) else names


def common_config(cfg: ModelConfig, family: Family, model_type: str, dtype: torch.dtype) -> dict:
    """The config.json entries every decoder family writes."""
    return {
        "architectures": [family.architectures[model_type][0]],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "use_cache": True,
        "bos_token_id": None,  # attnlab models carry no special tokens
        "eos_token_id": None,
        "pad_token_id": None,
        **dtype_entries(dtype),
    }


HF_CONFIG_KEYS = ("model_type", "architectures")  # what tells an HF config.json apart


def is_hf_config(data: Any) -> bool:
    """A parsed config.json that is Hugging Face's (an attnlab checkpoint's holds a RunConfig)."""
    return isinstance(data, dict) and any(key in data for key in HF_CONFIG_KEYS)


def is_hf_folder(path: Path) -> bool:
    """A folder whose config.json is a Hugging Face config (not an attnlab checkpoint's)."""
    config = Path(path) / CONFIG_NAME
    if not config.is_file():
        return False
    try:
        return is_hf_config(json.loads(config.read_text(encoding="utf-8")))
    except (ValueError, OSError):
        return False


def read_config(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        raise HFCheckpointError(f"{path}: not a directory; pass a Hugging Face model directory")
    config_file = path / CONFIG_NAME
    if not config_file.is_file():
        raise HFCheckpointError(
            f"{path}: no {CONFIG_NAME}; a Hugging Face model directory needs config.json beside "
            "its weights"
        )
    return _json_object(config_file)


def _json_object(file: Path) -> dict[str, Any]:
    """The JSON object in ``file``; HFCheckpointError naming the file otherwise."""
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HFCheckpointError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise HFCheckpointError(f"{file}: expected a JSON object")
    return data


# Generation settings a family maps (Marian's blocked pad token and forced end token, BART's
# forced first token), read as transformers reads them: from generation_config.json where the
# folder has one, else from config.json.
GENERATION_KEYS = (
    "bad_words_ids",
    "renormalize_logits",
    "forced_eos_token_id",
    "forced_bos_token_id",
)
# GenerationConfig's defaults of those keys: what a generation_config.json without one
# gives (not the model config class's default, e.g. Marian's forced_eos_token_id 0).
GENERATION_DEFAULTS = {
    "bad_words_ids": None,
    "renormalize_logits": False,
    "forced_eos_token_id": None,
    "forced_bos_token_id": None,
}
# The special tokens generate also takes from generation_config.json alone (Marian's
# decoder start and end tokens): that file's where it has them, else config.json's.
GENERATION_TOKEN_KEYS = ("decoder_start_token_id", "eos_token_id")


def with_generation_config(path: Path, hf: dict[str, Any]) -> dict[str, Any]:
    """``hf`` (folder ``path``'s config.json) with the :data:`GENERATION_KEYS` of its
    generation_config.json in place of its own where the folder has that file
    (transformers then ignores config.json's; a key that file lacks is set to
    GenerationConfig's default), and the :data:`GENERATION_TOKEN_KEYS` that file has,
    else ``hf`` unchanged."""
    file = path / GENERATION_CONFIG_NAME
    if not file.is_file():
        return hf
    generation = _json_object(file)
    out = {k: v for k, v in hf.items() if k not in GENERATION_KEYS}
    tokens = {k: generation[k] for k in GENERATION_TOKEN_KEYS if generation.get(k) is not None}
    return out | {k: generation.get(k, GENERATION_DEFAULTS[k]) for k in GENERATION_KEYS} | tokens


def with_preprocessor_config(path: Path, hf: dict[str, Any]) -> dict[str, Any]:
    """``hf`` with the :data:`PREPROCESSOR_KEYS` of folder ``path``'s
    preprocessor_config.json (an image processor's rescaling and normalisation), where the
    folder has that file."""
    file = path / PREPROCESSOR_CONFIG_NAME
    if not file.is_file():
        return hf
    processor = _json_object(file)
    return hf | {k: processor[k] for k in PREPROCESSOR_KEYS if k in processor}


def _eos_of(data: Any) -> list[int] | None:
    eos = data.get("eos_token_id") if isinstance(data, dict) else None
    if eos is None:
        return None
    ids = [eos] if isinstance(eos, int) else eos
    if not isinstance(ids, list) or not all(isinstance(i, int) and i >= 0 for i in ids):
        raise HFCheckpointError(f"eos_token_id must be an int or a list of ints, got {eos!r}")
    return ids


def eos_token_ids(path: Path) -> list[int]:
    """``eos_token_id`` (int or list) of ``generation_config.json``, else of a Hugging Face
    ``config.json`` (one with a model_type), in folder ``path``; [] when neither has one."""
    for name in (GENERATION_CONFIG_NAME, CONFIG_NAME):
        file = path / name
        if not file.is_file():
            continue
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise HFCheckpointError(f"{file}: not valid JSON ({e})") from None
        if name == CONFIG_NAME and not (isinstance(data, dict) and "model_type" in data):
            continue  # an attnlab RunConfig: no special tokens
        ids = _eos_of(data)
        if ids is not None:
            return ids
    return []


# --------------------------------------------------------------------------- weight files


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the single file, or every shard of the index."""
    if (path / WEIGHTS_NAME).is_file():
        return [path / WEIGHTS_NAME]
    index_file = path / WEIGHTS_INDEX_NAME
    if index_file.is_file():
        weight_map = _weight_map(index_file)
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


def _weight_map(index_file: Path) -> dict[str, str]:
    """The ``weight_map`` (tensor name -> shard file name) of a safetensors index."""
    try:
        weight_map = json.loads(index_file.read_text(encoding="utf-8"))["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
        weight_map = None
    if not isinstance(weight_map, dict) or not all(
        isinstance(v, str) and v for v in weight_map.values()
    ):
        raise HFCheckpointError(
            f"{index_file}: expected JSON with a 'weight_map' of tensor names to shard file names"
        )
    return weight_map


# The shard files transformers' save_pretrained writes beside model.safetensors.index.json.
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def _remove_stale_shards(path: Path) -> None:
    """Remove a sharded checkpoint's index and shards from ``path`` (an earlier
    ``save_pretrained(max_shard_size=...)`` into the folder), once the single
    model.safetensors that replaces them is in place: tools that read the index (vLLM, or a
    reader of the shards alone) would otherwise load the old weights, and the old shards
    would be uploaded and stored with the new file."""
    index_file = path / WEIGHTS_INDEX_NAME
    names: set[str] = set()
    if index_file.is_file():
        try:
            names = {
                n
                for n in _weight_map(index_file).values()
                if Path(n).name == n and n.endswith(".safetensors")  # this folder's shards only
            }
        except HFCheckpointError:
            pass  # unreadable: its shards are still found by name below
        index_file.unlink()  # first: a crash then leaves no index naming missing shards
    for file in path.iterdir():
        if file.name != WEIGHTS_NAME and (file.name in names or _SHARD.fullmatch(file.name)):
            if file.is_file():
                file.unlink()


def write_folder(
    path: Path,
    tensors: dict[str, Tensor],
    hf_config: dict[str, Any],
    extra: dict[str, dict[str, Any]] | None = None,
) -> None:
    """Write ``model.safetensors``, ``config.json`` and the ``extra`` JSON files (name ->
    content), each replacing its old version whole: a crash never leaves a truncated
    file. A sharded checkpoint already in ``path`` (its index and shards) is removed."""
    # safetensors refuses shared or strided storage: give each tensor its own contiguous copy.
    tensors = {k: v.to("cpu").contiguous().clone() for k, v in tensors.items()}
    path.mkdir(parents=True, exist_ok=True)
    with atomic_path(path / WEIGHTS_NAME) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    _remove_stale_shards(path)
    atomic_write_text(path / CONFIG_NAME, json.dumps(hf_config, indent=2) + "\n")
    for name, content in (extra or {}).items():
        atomic_write_text(path / name, json.dumps(content, indent=2) + "\n")


# --------------------------------------------------------------------------- name mapping


@dataclass(frozen=True)
class Part:
    """One Hugging Face tensor that fills (rows of) an attnlab parameter; ``transposed``:
    its last two dimensions stored swapped, (in, out) (GPT-2's Conv1D, GPT-OSS's experts).
    ``interleaved``: its last dimension (after any transposition) holds the parameter's
    two halves interleaved, a0 b0 a1 b1 ... for [a; b] (GPT-OSS's fused gate/up, whose
    gate is ``[..., ::2]`` and up ``[..., 1::2]``). ``per_head`` = (parts, heads): the
    parameter's rows are ``parts`` equal blocks of ``heads`` heads each ([q; k; v], each
    (heads * d_h) rows), stored head by head, every head's parts together: rows (heads,
    parts, d_h) for the parameter's (parts, heads, d_h) (GPT-NeoX's ``query_key_value``). A
    stored shape that only adds unit dimensions is read as the parameter's (Marian's (1, V)
    logits bias). ``grouped`` = (groups, queries): the parameter's rows are [q; k; v] of
    ``groups * queries`` query heads and ``groups`` key/value heads, stored group by group,
    each group's ``queries`` query heads, then its key head, then its value head: rows
    (groups, queries + 2, d_h), query head g * queries + j reading key/value head g
    (Falcon's ``query_key_value``: (1, h + 2, d_h) for one key/value head, (h, 3, d_h) for
    one per query head)."""

    name: str
    transposed: bool = False
    interleaved: bool = False
    per_head: tuple[int, int] | None = None
    grouped: tuple[int, int] | None = None
    # (start, stop): only these leading rows of the stored tensor fill the parameter (OPT's
    # position table past its two offset rows)
    rows: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if (self.per_head is not None or self.grouped is not None or self.rows is not None) and (
            self.transposed or self.interleaved
        ):
            raise ValueError(
                f"{self.name}: per-head, grouped or sliced rows are read as stored (not transposed)"
            )
        if self.rows is not None and (self.per_head is not None or self.grouped is not None):
            raise ValueError(f"{self.name}: rows reads a slice of plain rows; give one layout")
        if self.per_head is not None and self.grouped is not None:
            raise ValueError(f"{self.name}: per_head and grouped are two layouts; give one")


# attnlab parameter name -> the Hugging Face tensors stacked along its first dimension
# (parts of lower rank than the parameter fill its leading dimensions flattened: experts).
Plan = dict[str, tuple[Part, ...]]

# The declarative form: attnlab name -> a Hugging Face name, a list of names whose rows are
# stacked (equal parts: [q; k; v], [gate; up]), or a list of such lists stacked along a new
# first axis (one per expert).
Spec = str | list[str] | list[list[str]]
Specs = dict[str, Spec]


class Source:
    """The Hugging Face tensor names and shapes of a checkpoint (no data), handed out by
    name to build a :data:`Plan`: records missing and mis-shaped tensors, and what is left
    over at the end (unexpected tensors). ``targets``: the attnlab parameter shapes, for
    :meth:`plan`."""

    def __init__(
        self,
        shapes: dict[str, tuple[int, ...]],
        ignored: re.Pattern[str],
        targets: dict[str, tuple[int, ...]] | None = None,
    ):
        self.left = dict(shapes)
        self.ignored = ignored
        self.targets = targets or {}
        self.missing: list[str] = []
        self.wrong: list[str] = []
        self.must_equal: list[tuple[str, str]] = []  # pairs whose data must be identical

    def has(self, name: str) -> bool:
        return name in self.left

    def skip(self, name: str) -> None:
        """Drop ``name`` if present: stored, but not part of the attnlab model."""
        self.left.pop(name, None)

    def take(
        self,
        name: str,
        shape: tuple[int, ...],
        *,
        transposed: bool = False,
        interleaved: bool = False,
        per_head: tuple[int, int] | None = None,
        grouped: tuple[int, int] | None = None,
        rows: tuple[int, int] | None = None,
    ) -> tuple[Part, ...] | None:
        """The tensor ``name``, which must have ``shape`` as stored (``transposed``,
        ``interleaved``, ``per_head``, ``grouped``, ``rows``: see :class:`Part`)."""
        stored = self.left.pop(name, None)
        if stored is None:
            self.missing.append(name)
            return None
        if tuple(stored) != shape:
            self.wrong.append(f"{name} has shape {tuple(stored)}, config.json implies {shape}")
            return None
        return (Part(name, transposed, interleaved, per_head, grouped, rows),)

    def tied(self, name: str, source: tuple[Part, ...] | None) -> None:
        """A stored copy of a tied tensor (a head tied to the embedding) is not loaded; it is
        accepted only if it equals ``source`` (checked on the data by the loader)."""
        if self.left.pop(name, None) is not None and source is not None:
            self.must_equal.append((name, source[0].name))

    def spec(self, spec: Spec, shape: tuple[int, ...]) -> tuple[Part, ...] | None:
        """The parts of one :data:`Spec` entry filling an attnlab tensor of ``shape``."""
        if isinstance(spec, str):
            return self.take(spec, shape)
        if spec and isinstance(spec[0], list):  # stacked along a new first axis
            return cat(self.spec(sub, shape[1:]) for sub in spec)
        rows = shape[0] // len(spec)
        return cat(self.take(name, (rows, *shape[1:])) for name in spec)

    def plan(self, specs: Specs) -> dict[str, tuple[Part, ...] | None]:
        return {ours: self.spec(spec, self.targets[ours]) for ours, spec in specs.items()}

    def check(self) -> None:
        unexpected = sorted(n for n in self.left if not self.ignored.match(n))
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


def moe_specs(ours: str, theirs: str, n_experts: int, fused: bool) -> Specs:
    """One mixture-of-experts layer's router and routed experts, attnlab ``ours``
    (``blocks.{i}.ffn.``) -> Hugging Face ``theirs`` (``...layers.{i}.mlp.``): the gate, and
    the experts one by one (checkpoint files) or stacked (``fused``: the ``gate_up_proj`` /
    ``down_proj`` of a transformers model's own state dict)."""
    specs: Specs = {ours + "gate.weight": theirs + "gate.weight"}
    e = theirs + "experts."
    if fused:
        specs[ours + "experts.gate_up"] = e + "gate_up_proj"
        specs[ours + "experts.down"] = e + "down_proj"
    else:
        experts = range(n_experts)
        specs[ours + "experts.gate_up"] = [
            [f"{e}{j}.gate_proj.weight", f"{e}{j}.up_proj.weight"] for j in experts
        ]
        specs[ours + "experts.down"] = [[f"{e}{j}.down_proj.weight"] for j in experts]
    return specs


def read_mlm_decoder(src: Source, plan: Plan, cfg: Any, decoder: str) -> None:
    """An encoder's masked-LM head, the stored copies beside ``plan``: ``decoder`` names the
    output projection (BERT's ``cls.predictions.decoder``). Its bias is the head's own
    (``head.bias``) where untied and stored (transformers 5 ties neither), else a copy of
    it; with a tied head its weight is a copy of the token embedding."""
    bias = f"{decoder}.bias"
    if not cfg.tie_embeddings and src.has(bias):
        plan["head.bias"] = src.take(bias, (cfg.vocab_size,))
    src.tied(bias, plan["head.bias"])
    if cfg.tie_embeddings:
        src.tied(f"{decoder}.weight", plan["tok_emb.weight"])


def write_mlm_decoder(out: dict[str, Tensor], sd: dict[str, Tensor], cfg: Any, decoder: str):
    """:func:`read_mlm_decoder`'s other way: the copies transformers stores (the decoder's
    bias, and its weight where tied)."""
    out[f"{decoder}.bias"] = sd["head.bias"]
    if cfg.tie_embeddings:
        out[f"{decoder}.weight"] = sd["tok_emb.weight"]


def unplan(specs: Specs, sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """The Hugging Face tensors of an attnlab state dict, by the same :data:`Specs` that
    load it (stacked experts are written one by one, as checkpoint files store them)."""
    out: dict[str, Tensor] = {}
    for ours, spec in specs.items():
        t = sd[ours]
        if isinstance(spec, str):
            out[spec] = t
        elif spec and isinstance(spec[0], list):
            for j, sub in enumerate(spec):
                out |= unplan({ours: sub}, {ours: t[j]})
        else:
            out |= dict(zip(spec, t.chunk(len(spec), dim=0), strict=True))
    return out


def interleave(t: Tensor) -> Tensor:
    """[a; b] along the last dimension -> a0 b0 a1 b1 ... (see :attr:`Part.interleaved`)."""
    a, b = t.chunk(2, dim=-1)
    return torch.stack((a, b), dim=-1).flatten(-2)


def cat(parts: Iterable[tuple[Part, ...] | None]) -> tuple[Part, ...] | None:
    """Parts stacked along the first dimension (None if any is missing)."""
    parts = list(parts)
    return None if any(p is None for p in parts) else sum(parts, ())


def prefix(src: Source, prefix: str, probe: str) -> str:
    """``prefix`` if the checkpoint nests the backbone under it (``transformer.``, ``model.``),
    else "" (headless base-model checkpoints)."""
    return prefix if src.has(prefix + probe) else ""


def split_rows(w: Tensor, *sizes: int) -> tuple[Tensor, ...]:
    return tuple(t.contiguous() for t in w.split(sizes, dim=0))


def or_zeros(sd: dict[str, Tensor], name: str, size: int | tuple[int, ...]) -> Tensor:
    """``sd[name]``, or zeros of ``size`` where attnlab has no such bias but the Hugging Face
    architecture always does (zeros add nothing)."""
    if name in sd:
        return sd[name]
    ref = sd["tok_emb.weight"]
    return torch.zeros(size, dtype=ref.dtype, device=ref.device)


def _as_configured(cfg: ModelConfig, names: Collection[str]) -> ModelConfig:
    """A family's config whatever tensors its checkpoint stores (the default)."""
    return cfg


@dataclass(frozen=True)
class Family:
    """One Hugging Face model family: its ``model_type``s and the four mappings.

    ``architectures`` maps each model_type to its accepted ``architectures`` entries (the
    causal-LM class first: it is what export writes; families with several heads write
    their own). ``exports`` says whether a config belongs to this family on export;
    ``export_type`` then names its model_type or raises :class:`HFCheckpointError` saying
    why none fits."""

    name: str
    arch: str  # the attnlab architecture (ModelConfig.arch) it maps to
    architectures: dict[str, tuple[str, ...]]
    config_from_hf: Callable[[dict[str, Any], str], ModelConfig]
    # model_type -> transformers' class defaults of the config.json keys config_from_hf
    # reads, filled in where config.json lacks a key (as from_pretrained fills it); keys
    # whose class default is None are left out (read as missing). The families' tables
    # are checked against the installed transformers (tests/test_interop_defaults.py).
    defaults: dict[str, dict[str, Any]]
    config_to_hf: Callable[[ModelConfig, str, torch.dtype], dict[str, Any]]
    weights_to_attnlab: Callable[[Source, ModelConfig], Plan]
    weights_from_attnlab: Callable[[dict[str, Tensor], ModelConfig, str], dict[str, Tensor]]
    exports: Callable[[ModelConfig], bool]
    export_type: Callable[[ModelConfig], str]
    # Non-parameter buffers older transformers versions saved; recomputed, never loaded.
    ignored: re.Pattern[str]
    # Checkpoint name -> the name the mapping uses (one layout for renamed generations).
    rename: Callable[[str], str] | None = None
    # The attnlab task (``attnlab.tasks.TASKS``) an imported model of this config runs:
    # recorded in the imported checkpoint's config.json, it picks what ``eval`` measures.
    task: Callable[[ModelConfig], str] = lambda cfg: "lm"
    # Files beside config.json that export writes for a config (name -> JSON content).
    extra_files: Callable[[ModelConfig], dict[str, dict[str, Any]]] = lambda cfg: {}
    # The config of a checkpoint given the tensor names it stores, where config.json leaves
    # a piece to them (T5 under transformers 5: a head of its own where one is stored).
    config_for_weights: Callable[[ModelConfig, Collection[str]], ModelConfig] = _as_configured
