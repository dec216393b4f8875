"""DeepSeek-V3.2 checkpoints (``DeepseekV32ForCausalLM``) to and from attnlab: DeepSeek-V3
(MLA with query compression, DeepSeekMoE) plus a lightning indexer per layer, so attention
kind ``dsa``. Everything but the indexer is the DeepSeek-V3 mapping, reused from
``attnlab.interop_deepseek``; the indexer's tensors map one to one:

    model.layers.{i}.self_attn.indexer.wq_b, wk, k_norm (weight, bias), weights_proj
        -> blocks.{i}.attn.indexer.wq_b, wk, k_norm, weights_proj

config.json: ``index_topk``, ``index_n_heads``, ``index_head_dim`` -> attention fields of the
same names; ``mlp_layer_types`` (dense first, then sparse) -> ffn.first_k_dense. The main
attention rotates interleaved RoPE pairs (V3.2 has no ``rope_interleave`` switch), the
indexer split halves, as attnlab's DSA does.

Shapes: d d_model, H_I index heads, d_I index head dim, d_q q_lora_rank.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor

# The DeepSeek-V2/V3 mapping as it stood when this was written (attnlab/interop_deepseek.py).
# When it moves to attnlab/interop/deepseek.py (a Family), this becomes a Family too: its
# config_from_hf/config_to_hf wrap the V3 ones as below, its weight plan is the V3 plan plus
# the indexer entries of _plan, and FAMILIES in attnlab/interop/registry.py lists it.
from attnlab import interop_deepseek as _v3
from attnlab.config import ConfigError, ModelConfig
from attnlab.fileio import atomic_path, atomic_write_text
from attnlab.models.decoder import DecoderLM

DeepSeekCheckpointError = _v3.DeepSeekCheckpointError
MODEL_TYPES = {"deepseek_v32": "DeepseekV32ForCausalLM"}
_INDEX_KEYS = ("index_topk", "index_n_heads", "index_head_dim")
_INDEXER = ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """attnlab config (attention kind ``dsa``) of a DeepSeek-V3.2 ``config.json``."""
    if hf.get("model_type") not in MODEL_TYPES:
        raise DeepSeekCheckpointError(
            f"config.json: model_type {hf.get('model_type')!r} is not deepseek_v32"
        )
    v3 = {k: v for k, v in hf.items() if k not in _INDEX_KEYS}
    v3 |= {"model_type": "deepseek_v3", "rope_interleave": True}
    types = hf.get("mlp_layer_types")
    if types is not None:
        dense = sum(1 for kind in types if kind == "dense")
        if types != ["dense"] * dense + ["sparse"] * (len(types) - dense):
            raise DeepSeekCheckpointError("config.json: mlp_layer_types must be dense, then sparse")
        v3["first_k_dense_replace"] = dense
    if hf.get("q_lora_rank") is None:
        raise DeepSeekCheckpointError("config.json: DeepSeek-V3.2 needs q_lora_rank")
    cfg = _v3.config_from_hf(v3)
    data = cfg.to_dict()
    data["attention"] |= {"kind": "dsa", "dsa_stage": "sparse"}
    data["attention"] |= {k: _v3._need(hf, k) for k in _INDEX_KEYS}
    try:
        return ModelConfig.from_dict(data)
    except ConfigError as e:
        raise DeepSeekCheckpointError(f"config.json: {e}") from None


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """A ``config.json`` dict that transformers reads as the same DeepSeek-V3.2 model."""
    att = cfg.attention
    if att.kind != "dsa" or att.index_hadamard or att.index_fp8:
        raise DeepSeekCheckpointError("DeepSeek-V3.2 needs attention kind 'dsa' (exact indexer)")
    if cfg.position.rope_layout != "interleaved":
        raise DeepSeekCheckpointError("DeepSeek-V3.2 rotates interleaved RoPE pairs")
    as_v3 = dataclasses.replace(cfg, attention=dataclasses.replace(att, kind="mla"))
    out = _v3.config_to_hf(as_v3, "deepseek_v3")
    out.pop("rope_interleave", None)
    n_dense = out["first_k_dense_replace"]
    out |= {
        "architectures": [MODEL_TYPES["deepseek_v32"]],
        "model_type": "deepseek_v32",
        "index_topk": att.index_topk,
        "index_n_heads": att.index_n_heads,
        "index_head_dim": att.index_dim(cfg.d_model),
        "mlp_layer_types": ["dense"] * n_dense + ["sparse"] * (cfg.n_layers - n_dense),
    }
    if cfg.ffn.kind != "moe":  # transformers' V3.2 defaults want MoE fields even when unused
        out |= {"n_routed_experts": 1, "num_experts_per_tok": 1, "n_group": 1, "topk_group": 1}
    return out


def _plan(cfg: ModelConfig, fused_experts: bool) -> dict[str, Any]:
    plan = _v3._plan(cfg, fused_experts)
    for i in range(cfg.n_layers):
        for name in _INDEXER:
            plan[f"blocks.{i}.attn.indexer.{name}"] = f"model.layers.{i}.self_attn.indexer.{name}"
    return plan


def state_dict_from_hf(tensors: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """attnlab state dict of DeepSeek-V3.2 tensors; one error naming every mismatch."""
    tensors = {k: v for k, v in tensors.items() if not _v3._SKIPPED.search(k)}
    tensors = {
        k: v
        for k, v in tensors.items()
        if not (k.startswith("model.layers.") and int(k.split(".")[2]) >= cfg.n_layers)
    }  # multi-token-prediction layers
    fused = any(k.endswith("mlp.experts.gate_up_proj") for k in tensors)
    plan, targets = _plan(cfg, fused), _v3._target_shapes(cfg)
    missing, wrong, used = [], [], set()
    for ours, spec in plan.items():
        for name, shape in _v3._leaves(spec, targets[ours]):
            used.add(name)
            if name not in tensors:
                missing.append(name)
            elif tuple(tensors[name].shape) != shape:
                wrong.append(f"{name} has shape {tuple(tensors[name].shape)}, expected {shape}")
    unexpected = sorted(set(tensors) - used)
    for label, names in (("wrong shapes", wrong), ("missing", missing), ("unexpected", unexpected)):
        if names:
            more = f" (+{len(names) - 6} more)" if len(names) > 6 else ""
            raise DeepSeekCheckpointError(
                f"checkpoint does not match config.json: {label}: {', '.join(names[:6])}{more}"
            )
    return {ours: _v3._assemble(spec, tensors) for ours, spec in plan.items()}


def state_dict_to_hf(sd: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """HF checkpoint tensors (experts one by one, as DeepSeek's files store them)."""
    out = _v3.state_dict_to_hf(sd, cfg)  # the V3 part (the plan it walks has no indexer)
    for i in range(cfg.n_layers):
        for name in _INDEXER:
            out[f"model.layers.{i}.self_attn.indexer.{name}"] = (
                sd[f"blocks.{i}.attn.indexer.{name}"].detach().contiguous()
            )
    return out


def load_deepseek_v32(path: str | Path, dtype: torch.dtype | None = None) -> DecoderLM:
    """A :class:`DecoderLM` from a DeepSeek-V3.2 directory (config.json + safetensors)."""
    path = Path(path)
    try:
        hf = json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise DeepSeekCheckpointError(f"{path}: config.json not found") from None
    cfg = config_from_hf(hf)
    model = DecoderLM(cfg)
    model.load_state_dict(state_dict_from_hf(_v3._read_tensors(path), cfg), strict=True)
    return model.to(dtype) if dtype is not None else model


def save_deepseek_v32(model: DecoderLM, path: str | Path) -> None:
    """Write ``config.json`` and ``model.safetensors`` that transformers loads as
    ``DeepseekV32ForCausalLM``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hf_config = config_to_hf(model.cfg)
    hf_config["dtype"] = str(model.tok_emb.weight.dtype).removeprefix("torch.")
    tensors = state_dict_to_hf(model.state_dict(), model.cfg)
    with atomic_path(path / "model.safetensors") as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    atomic_write_text(path / "config.json", json.dumps(hf_config, indent=2) + "\n")
