"""Mixtral (``model_type`` mixtral): Mistral's attention and names (GQA, RoPE, an optional
sliding window on every layer, no biases; the LLaMA layout, llama.py) with a sparse
mixture of experts in every layer: a router without bias, softmax over all experts, the
top k renormalised to sum to 1, SwiGLU experts as wide as ``intermediate_size``, no shared
experts. That is attnlab's MoE with the ``deepseek-v2`` router (one group, no shared
experts, ``norm_topk_prob``, scaling 1) and no dense layers.

Weights beyond llama.py's, HF (``model.layers.{i}.block_sparse_moe.``) -> attnlab
(``blocks.{i}.ffn.``):

    gate.weight                            (E, d)      -> gate.weight
    experts.{e}.[w1; w3]           (E of (f, d))       -> experts.gate_up (E, 2f, d)
    experts.{e}.w2                 (E of (d, f))       -> experts.down (E, d, f)

(w1 the gate, w3 the up and w2 the down projection.) Released checkpoints store experts
one by one under ``block_sparse_moe``; a transformers 5 model's own ``state_dict()``
renames it ``mlp`` and stacks them (``mlp.experts.gate_up_proj`` (E, 2f, d),
``mlp.experts.down_proj`` (E, d, f)); both are read, layer by layer. Export writes the
released layout, which transformers' ``from_pretrained`` converts on loading.

Training-only settings. With ``output_router_logits``, transformers adds
``router_aux_loss_coef`` times the Switch Transformer load-balancing loss over all layers'
router logits to the loss: ``ffn.switch_aux_loss_coef`` (0 when ``output_router_logits`` is
false), which export writes back (``output_router_logits`` = coefficient > 0). It also
multiplies a training MoE layer's input by noise uniform in [1 - ``router_jitter_noise``,
1 + it], which attnlab's MoE lacks. That changes nothing in eval mode (logits, generation),
so import reads such a checkpoint and warns that fine-tuning it in attnlab trains without
the noise (refusing would keep the model from being run at all); the released checkpoints
set none. Export writes ``router_jitter_noise`` 0: how attnlab trained it.

Shapes: d d_model, f expert hidden size, E experts.
"""

from __future__ import annotations

import dataclasses
import warnings
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
    prefix,
    switch_loss_from_hf,
    switch_loss_to_hf,
    unplan,
    unrepresentable,
)

ARCHITECTURES = {"mixtral": ("MixtralForCausalLM", "MixtralModel")}

# transformers' MixtralConfig class defaults for the config.json keys read here (the
# Mixtral-8x7B sizes). Its head_dim and sliding_window default to None (left out: read as
# missing); its RoPE theta without rope_theta or rope_parameters is its default_theta,
# 1e6, not 10000 (see config_from_hf).
DEFAULTS: dict[str, dict[str, Any]] = {
    "mixtral": {
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "attention_dropout": 0.0,
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "num_experts_per_tok": 2,
        "num_local_experts": 8,
        "router_jitter_noise": 0.0,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
    }
}
DEFAULT_THETA = 1e6  # MixtralConfig.default_theta


def _warn_training_only(hf: dict[str, Any]) -> None:
    """Warn about the training-time router noise attnlab's MoE lacks (module docstring)."""
    jitter = hf.get("router_jitter_noise") or 0.0
    if jitter:
        warnings.warn(
            f"config.json router_jitter_noise={jitter} is not implemented: attnlab's mixture "
            "of experts adds no noise to the router's input when training (eval and "
            "generation are unaffected)",
            stacklevel=3,
        )


def config_from_hf(hf: dict[str, Any], model_type: str) -> ModelConfig:
    if "rope_theta" not in hf and "rope_theta" not in (hf.get("rope_parameters") or {}):
        hf = {**hf, "rope_theta": DEFAULT_THETA}  # as MixtralConfig fills it
    _warn_training_only(hf)
    # Mistral's attention: the window on every layer, no biases, head_dim
    cfg = llama.config_from_hf(hf, "mistral")
    # MixtralConfig's attribute_map: a num_experts given wins over num_local_experts
    n_experts = hf.get("num_experts")
    n_experts = get(hf, "num_local_experts") if n_experts is None else n_experts
    ffn = dataclasses.replace(
        cfg.ffn,
        kind="moe",
        router="deepseek-v2",  # softmax over all experts, greedy top-k
        n_routed_experts=n_experts,
        n_shared_experts=0,
        n_activated_experts=get(hf, "num_experts_per_tok"),
        moe_hidden_dim=get(hf, "intermediate_size"),
        first_k_dense=0,
        norm_topk_prob=True,  # MixtralTopKRouter divides the top k by their sum
        routed_scaling_factor=1.0,
        switch_aux_loss_coef=switch_loss_from_hf(hf),
    )
    return dataclasses.replace(cfg, ffn=ffn)


def exports(cfg: ModelConfig) -> bool:
    """Mixtures of experts without QK-norm (with it: Qwen3-MoE, qwen3_moe.py)."""
    return (
        is_plain_decoder(cfg)
        and cfg.position.kind == "rope"
        and cfg.ffn.kind == "moe"
        and not cfg.attention.qk_norm
    )


def export_type(cfg: ModelConfig) -> str:
    """``mixtral``, or HFCheckpointError naming the field Mixtral cannot hold."""
    att, ffn = cfg.attention, cfg.ffn
    if cfg.norm.kind != "rmsnorm":
        raise unrepresentable(f"norm.kind={cfg.norm.kind!r} (Mixtral's is 'rmsnorm')")
    for name in ("first_k_dense", "dense_layers"):
        if getattr(ffn, name):
            raise unrepresentable(
                f"ffn.{name}={getattr(ffn, name)!r} (Mixtral has experts on every layer; "
                "dense layers export as Qwen3-MoE, which has QK-norm: attention.qk_norm)"
            )
    for name, value, theirs in (
        ("router", ffn.router, "deepseek-v2"),
        ("n_shared_experts", ffn.n_shared_experts, 0),
        ("n_groups", ffn.n_groups, 1),
        ("norm_topk_prob", ffn.norm_topk_prob, True),
        ("routed_scaling_factor", ffn.routed_scaling_factor, 1.0),
    ):
        if value != theirs:
            raise unrepresentable(f"ffn.{name}={value!r} (Mixtral's is {theirs!r})")
    for name in ("qkv_bias", "out_bias"):
        if getattr(att, name):
            raise unrepresentable(f"attention.{name}=True (Mixtral's attention has no biases)")
    local = local_layers(cfg)
    if any(local) and not all(local):
        raise unrepresentable("attention.layer_pattern (Mixtral windows all layers or none)")
    return "mixtral"


def config_to_hf(cfg: ModelConfig, model_type: str, dtype: torch.dtype) -> dict[str, Any]:
    ffn = cfg.ffn
    hf = llama.config_to_hf(cfg, "mistral", dtype)
    hf["architectures"], hf["model_type"] = [ARCHITECTURES[model_type][0]], model_type
    return hf | {
        # a layer_pattern of global layers only leaves every layer without the window
        "sliding_window": cfg.attention.sliding_window if any(local_layers(cfg)) else None,
        "intermediate_size": ffn.expert_hidden_size(cfg.d_model),
        "num_local_experts": ffn.n_routed_experts,
        "num_experts_per_tok": ffn.n_activated_experts,
        "router_jitter_noise": 0.0,
        **switch_loss_to_hf(cfg),
    }


def _expert_specs(cfg: ModelConfig, src: Source | None, p: str) -> Specs:
    """attnlab name -> HF name(s) of the routers and experts; ``p`` the backbone prefix.
    Each layer is read as ``src`` stores it (stacked under ``mlp`` where it has that
    layer's ``mlp.experts.gate_up_proj``), and written one expert at a time."""
    specs: Specs = {}
    for i in range(cfg.n_layers):
        ours, h = f"blocks.{i}.ffn.", f"{p}layers.{i}."
        if src is not None and src.has(f"{h}mlp.experts.gate_up_proj"):
            specs[ours + "gate.weight"] = f"{h}mlp.gate.weight"
            specs[ours + "experts.gate_up"] = f"{h}mlp.experts.gate_up_proj"
            specs[ours + "experts.down"] = f"{h}mlp.experts.down_proj"
            continue
        e = f"{h}block_sparse_moe.experts."
        experts = range(cfg.ffn.n_routed_experts)
        specs[ours + "gate.weight"] = f"{h}block_sparse_moe.gate.weight"
        specs[ours + "experts.gate_up"] = [
            [f"{e}{j}.w1.weight", f"{e}{j}.w3.weight"] for j in experts
        ]
        specs[ours + "experts.down"] = [[f"{e}{j}.w2.weight"] for j in experts]
    return specs


def weights_to_attnlab(src: Source, cfg: ModelConfig) -> Plan:
    p = prefix(src, "model.", "embed_tokens.weight")  # (before llama.py takes it)
    plan = llama.weights_to_attnlab(src, cfg)  # embeddings, attention, norms
    d, E, f = cfg.d_model, cfg.ffn.n_routed_experts, cfg.ffn.expert_hidden_size(cfg.d_model)
    shapes = {"gate.weight": (E, d), "experts.gate_up": (E, 2 * f, d), "experts.down": (E, d, f)}
    for ours, spec in _expert_specs(cfg, src, p).items():
        plan[ours] = src.spec(spec, shapes[ours.split(".ffn.")[1]])  # type: ignore[assignment]
    return plan


def weights_from_attnlab(
    sd: dict[str, Tensor], cfg: ModelConfig, model_type: str
) -> dict[str, Tensor]:
    out = llama.weights_from_attnlab(sd, cfg, "mistral")
    return out | unplan(_expert_specs(cfg, None, "model."), sd)


FAMILY = Family(
    name="mixtral",
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
