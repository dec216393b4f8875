"""Qwen3-MoE (``model_type`` qwen3_moe): Qwen3's attention and names (QK-norm; the LLaMA
layout, llama.py) with mixture-of-experts feed-forwards: a softmax router over all experts,
the top k, renormalised when ``norm_topk_prob``, no shared experts, SwiGLU experts without
biases. That is attnlab's MoE with the ``deepseek-v2`` router (one group, no shared
experts, scaling 1); the dense layers that ``decoder_sparse_step`` and ``mlp_only_layers``
choose are ``ffn.first_k_dense`` (the leading ones) and ``ffn.dense_layers`` (the others).

Weights beyond llama.py's, HF (``model.layers.{i}.mlp.``) -> attnlab (``blocks.{i}.ffn.``):

    gate.weight                                (E, d)      -> gate.weight
    experts.{e}.[gate_proj; up_proj]  (E of (f, d))        -> experts.gate_up (E, 2f, d)
    experts.{e}.down_proj             (E of (d, f))        -> experts.down (E, d, f)

Checkpoint files store experts one by one; a transformers model's own ``state_dict()``
stacks them (``experts.gate_up_proj``, ``experts.down_proj``); both are read.

``router_aux_loss_coef`` (with ``output_router_logits``: transformers' Switch balance loss
when training) is ``ffn.switch_aux_loss_coef``, both ways.

Shapes: d d_model, f expert hidden size, E experts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

from attnlab.config import ModelConfig
from attnlab.interop import llama
from attnlab.interop.io import (
    Family,
    Plan,
    Source,
    Specs,
    get,
    is_plain_decoder,
    local_layers,
    moe_layers_from_hf,
    moe_layers_to_hf,
    moe_specs,
    prefix,
    switch_loss_from_hf,
    switch_loss_to_hf,
    unplan,
    unrepresentable,
)

ARCHITECTURES = {"qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeModel")}

# transformers' Qwen3MoeConfig class defaults for the config.json keys read here (it has no
# head_dim: hidden_size / num_attention_heads unless config.json gives one).
DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_moe": {
        **llama._COMMON,
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 24,
        "num_key_value_heads": 4,
        "max_position_embeddings": 32768,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": 4096,  # used only with use_sliding_window
        "decoder_sparse_step": 1,
        "moe_intermediate_size": 768,
        "num_experts_per_tok": 8,
        "num_experts": 128,
        "norm_topk_prob": False,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
    }
}


def config_from_hf(hf: dict[str, Any], model_type: str) -> ModelConfig:
    # transformers 5.x writes num_experts as num_local_experts, which wins when both are given
    n_experts = hf.get("num_local_experts")
    n_experts = get(hf, "num_experts") if n_experts is None else n_experts
    layers = moe_layers_from_hf(hf, n_experts)
    # the attention of Qwen3, whose window (every layer here: no max_window_layers or
    # layer_types) is set below
    cfg = llama.config_from_hf({**hf, "use_sliding_window": False}, "qwen3")
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    attention = dataclasses.replace(cfg.attention, sliding_window=window)
    if layers is None:  # no experts anywhere: a dense Qwen3
        return dataclasses.replace(cfg, attention=attention)
    ffn = dataclasses.replace(
        cfg.ffn,
        kind="moe",
        router="deepseek-v2",  # softmax over all experts, greedy top-k
        n_routed_experts=n_experts,
        n_shared_experts=0,
        n_activated_experts=get(hf, "num_experts_per_tok"),
        moe_hidden_dim=get(hf, "moe_intermediate_size"),
        first_k_dense=layers[0],
        dense_layers=layers[1],
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        routed_scaling_factor=1.0,
        switch_aux_loss_coef=switch_loss_from_hf(hf),
    )
    return dataclasses.replace(cfg, attention=attention, ffn=ffn)


def exports(cfg: ModelConfig) -> bool:
    # without QK-norm: Mixtral (mixtral.py)
    return (
        is_plain_decoder(cfg)
        and cfg.position.kind == "rope"
        and cfg.ffn.kind == "moe"
        and cfg.attention.qk_norm
    )


def export_type(cfg: ModelConfig) -> str:
    """``qwen3_moe``, or HFCheckpointError naming what Qwen3-MoE lacks."""
    att, ffn = cfg.attention, cfg.ffn
    if cfg.norm.kind != "rmsnorm":
        raise unrepresentable(f"norm.kind={cfg.norm.kind!r} (Qwen3-MoE's is 'rmsnorm')")
    if not att.qk_norm:
        raise unrepresentable(
            "attention.qk_norm=False (Qwen3-MoE has QK-norm; mixtures of experts without it "
            "export as Mixtral)"
        )
    for name, value, theirs in (
        ("router", ffn.router, "deepseek-v2"),
        ("n_shared_experts", ffn.n_shared_experts, 0),
        ("n_groups", ffn.n_groups, 1),
        ("routed_scaling_factor", ffn.routed_scaling_factor, 1.0),
        ("bias", ffn.bias, False),
        ("shared_expert_gate", ffn.shared_expert_gate, False),
    ):
        if value != theirs:
            raise unrepresentable(f"ffn.{name}={value!r} (Qwen3-MoE's is {theirs!r})")
    if any(local_layers(cfg)) and not all(local_layers(cfg)):
        raise unrepresentable("attention.layer_pattern (Qwen3-MoE windows all layers or none)")
    return "qwen3_moe"


def config_to_hf(cfg: ModelConfig, model_type: str, dtype: torch.dtype) -> dict[str, Any]:
    ffn = cfg.ffn
    hf = llama.config_to_hf(cfg, "qwen3", dtype)
    for key in ("max_window_layers", "layer_types"):  # Qwen3's, not Qwen3-MoE's
        del hf[key]
    hf["architectures"], hf["model_type"] = [ARCHITECTURES[model_type][0]], model_type
    return hf | {
        "num_experts": ffn.n_routed_experts,
        "num_experts_per_tok": ffn.n_activated_experts,
        "moe_intermediate_size": ffn.expert_hidden_size(cfg.d_model),
        "norm_topk_prob": ffn.norm_topk_prob,
        **moe_layers_to_hf(cfg),
        **switch_loss_to_hf(cfg),
    }


def _expert_specs(cfg: ModelConfig, p: str, fused: bool) -> Specs:
    """attnlab name -> HF name(s) of the routers and experts; ``p`` the backbone prefix."""
    specs: Specs = {}
    for i in filter(cfg.ffn.moe_layer, range(cfg.n_layers)):
        specs |= moe_specs(
            f"blocks.{i}.ffn.", f"{p}layers.{i}.mlp.", cfg.ffn.n_routed_experts, fused
        )
    return specs


def weights_to_attnlab(src: Source, cfg: ModelConfig) -> Plan:
    p = prefix(src, "model.", "embed_tokens.weight")  # (before llama.py takes it)
    plan = llama.weights_to_attnlab(src, cfg)  # embeddings, attention, norms, dense layers
    if cfg.ffn.kind != "moe":
        return plan
    d, E, f = cfg.d_model, cfg.ffn.n_routed_experts, cfg.ffn.expert_hidden_size(cfg.d_model)
    shapes = {"gate.weight": (E, d), "experts.gate_up": (E, 2 * f, d), "experts.down": (E, d, f)}
    fused = any(name.endswith("mlp.experts.gate_up_proj") for name in src.left)
    for ours, spec in _expert_specs(cfg, p, fused).items():
        plan[ours] = src.spec(spec, shapes[ours.split(".ffn.")[1]])  # type: ignore[assignment]
    return plan


def weights_from_attnlab(
    sd: dict[str, Tensor], cfg: ModelConfig, model_type: str
) -> dict[str, Tensor]:
    out = llama.weights_from_attnlab(sd, cfg, "qwen3")
    return out | unplan(_expert_specs(cfg, "model.", fused=False), sd)


FAMILY = Family(
    name="qwen3_moe",
    arch="decoder",
    architectures=ARCHITECTURES,
    config_from_hf=config_from_hf,
    defaults=DEFAULTS,
    config_to_hf=config_to_hf,
    weights_to_attnlab=weights_to_attnlab,
    weights_from_attnlab=weights_from_attnlab,
    exports=exports,
    export_type=export_type,
    ignored=llama.IGNORED,
)
