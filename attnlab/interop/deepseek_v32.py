"""DeepSeek-V3.2 (``model_type`` deepseek_v32, ``DeepseekV32ForCausalLM``): DeepSeek-V3 (MLA
with query compression, DeepSeekMoE) plus a lightning indexer per layer, so attention kind
``dsa``. Everything but the indexer is the DeepSeek-V3 mapping of :mod:`deepseek`, reused
here; the indexer's tensors map one to one:

    model.layers.{i}.self_attn.indexer.wq_b, wk, k_norm (weight, bias), weights_proj
        -> blocks.{i}.attn.indexer.wq_b, wk, k_norm, weights_proj

config.json: ``index_topk``, ``index_n_heads``, ``index_head_dim`` -> attention fields of the
same names; ``mlp_layer_types`` (dense first, then sparse) -> ffn.first_k_dense. The main
attention rotates interleaved RoPE pairs (V3.2 has no ``rope_interleave`` switch), the
indexer split halves, as attnlab's DSA does. V3.2 has no dense warm-up stage: a model is
imported with ``dsa_stage`` sparse, and exported as the sparse model whatever its stage.

Shapes: d d_model, H_I index heads, d_I index head dim, d_q q_lora_rank.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

from attnlab.config import ModelConfig
from attnlab.interop import deepseek as v3
from attnlab.interop.io import (
    Family,
    HFCheckpointError,
    Plan,
    Source,
    Specs,
    get,
    unplan,
    unrepresentable,
)

ARCHITECTURES = {"deepseek_v32": ("DeepseekV32ForCausalLM", "DeepseekV32Model")}
_INDEX_KEYS = ("index_topk", "index_n_heads", "index_head_dim")
# transformers' class defaults (DeepseekV32Config) for the config.json keys read here
# (Family.defaults): V3's, but for the longer context, the indexer and no rope_interleave
# (V3.2 always interleaves).
DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v32": {
        **{k: v for k, v in v3.DEFAULTS["deepseek_v3"].items() if k != "rope_interleave"},
        "max_position_embeddings": 163840,
        "mlp_bias": False,
        "index_topk": 2048,
        "index_n_heads": 64,
        "index_head_dim": 128,
    },
}
_INDEXER = ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")


# --------------------------------------------------------------------------- config


def config_from_hf(hf: dict[str, Any], model_type: str) -> ModelConfig:
    """The V3 config of ``hf`` (interleaved RoPE, first_k_dense from ``mlp_layer_types``)
    with attention kind ``dsa`` and the indexer's fields."""
    if hf.get("q_lora_rank") is None:
        raise HFCheckpointError("config.json: DeepSeek-V3.2 needs q_lora_rank")
    as_v3 = {k: v for k, v in hf.items() if k not in _INDEX_KEYS}
    as_v3 |= {"model_type": "deepseek_v3", "rope_interleave": True}
    types = hf.get("mlp_layer_types")
    if types is not None:
        dense = sum(1 for kind in types if kind == "dense")
        if types != ["dense"] * dense + ["sparse"] * (len(types) - dense):
            raise HFCheckpointError(
                f"config.json: mlp_layer_types must be dense layers, then sparse, got {types}"
            )
        as_v3["first_k_dense_replace"] = dense
    cfg = v3.config_from_hf(as_v3, "deepseek_v3")
    index = {k: get(hf, k) for k in _INDEX_KEYS}
    attention = dataclasses.replace(cfg.attention, kind="dsa", dsa_stage="sparse", **index)
    return dataclasses.replace(cfg, attention=attention)  # validated by the caller


def _as_v3(cfg: ModelConfig) -> ModelConfig:
    return dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, kind="mla"))


def exports(cfg: ModelConfig) -> bool:
    return cfg.arch == "decoder" and cfg.attention.kind == "dsa"


def export_type(cfg: ModelConfig) -> str:
    """``deepseek_v32``, or the reason V3.2 cannot hold ``cfg``."""
    att = cfg.attention
    if att.index_hadamard or att.index_fp8:
        raise unrepresentable("DeepSeek-V3.2 has an exact indexer (no Hadamard rotation, FP8)")
    if cfg.position.kind == "rope" and cfg.position.rope_layout != "interleaved":
        raise unrepresentable("DeepSeek-V3.2 rotates interleaved RoPE pairs only")
    if v3.export_type(_as_v3(cfg)) != "deepseek_v3":
        raise unrepresentable("DeepSeek-V3.2 routes experts as DeepSeek-V3 does")
    return "deepseek_v32"


def config_to_hf(cfg: ModelConfig, model_type: str, dtype: torch.dtype) -> dict[str, Any]:
    att = cfg.attention
    out = v3.config_to_hf(_as_v3(cfg), "deepseek_v3", dtype)
    out.pop("rope_interleave", None)
    n_dense = out["first_k_dense_replace"]
    out |= {
        "architectures": [ARCHITECTURES[model_type][0]],
        "model_type": model_type,
        "index_topk": att.index_topk,
        "index_n_heads": att.index_n_heads,
        "index_head_dim": att.index_dim(cfg.d_model),
        "mlp_layer_types": ["dense"] * n_dense + ["sparse"] * (cfg.n_layers - n_dense),
    }
    if cfg.ffn.kind != "moe":  # transformers' V3.2 config wants MoE fields even when unused
        out |= {"n_routed_experts": 1, "num_experts_per_tok": 1, "n_group": 1, "topk_group": 1}
    return out


# --------------------------------------------------------------------------- weights


def _indexer_specs(cfg: ModelConfig, p: str) -> Specs:
    return {
        f"blocks.{i}.attn.indexer.{name}": f"{p}layers.{i}.self_attn.indexer.{name}"
        for i in range(cfg.n_layers)
        for name in _INDEXER
    }


def weights_to_attnlab(src: Source, cfg: ModelConfig) -> Plan:
    p = "model." if src.has("model.embed_tokens.weight") else ""
    plan = v3.weights_to_attnlab(src, cfg)
    return plan | src.plan(_indexer_specs(cfg, p))  # type: ignore[return-value]  # as in v3


def weights_from_attnlab(
    sd: dict[str, Tensor], cfg: ModelConfig, model_type: str
) -> dict[str, Tensor]:
    return v3.weights_from_attnlab(sd, cfg, "deepseek_v3") | unplan(
        _indexer_specs(cfg, "model."), sd
    )


FAMILY = Family(
    name="deepseek_v32",
    arch="decoder",
    architectures=ARCHITECTURES,
    config_from_hf=config_from_hf,
    defaults=DEFAULTS,
    config_to_hf=config_to_hf,
    weights_to_attnlab=weights_to_attnlab,
    weights_from_attnlab=weights_from_attnlab,
    exports=exports,
    export_type=export_type,
    ignored=v3.IGNORED,
)
