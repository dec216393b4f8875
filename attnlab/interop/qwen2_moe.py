"""Qwen2-MoE (``model_type`` qwen2_moe: Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention
and names (q/k/v biases unless ``qkv_bias`` is false, no output bias, GQA, an optional
sliding window; the LLaMA layout, llama.py) with mixture-of-experts feed-forwards: a softmax
router over all experts, the top k, renormalised when ``norm_topk_prob``, SwiGLU experts
without biases, and one shared expert whose output a learned sigmoid gate scales per token:

    y = sum_{i in topk} g_i FFN_i(x) + sigmoid(x w_g) FFN_shared(x)

That is attnlab's MoE with the ``deepseek-v2`` router (one group, scaling 1) and a gated
shared expert (``ffn.shared_expert_gate``). The shared expert, ``shared_expert_intermediate_size``
wide, is ``ffn.n_shared_experts`` = that width / ``moe_intermediate_size`` experts of the
routed experts' width (one gated FFN as wide as their sum: the same sums); a width that
is no multiple is refused. The dense layers ``decoder_sparse_step`` and ``mlp_only_layers``
choose (``intermediate_size`` wide) are ``ffn.first_k_dense`` and ``ffn.dense_layers``.

Weights beyond llama.py's, HF (``model.layers.{i}.mlp.``) -> attnlab (``blocks.{i}.ffn.``):

    gate.weight                                (E, d)      -> gate.weight
    experts.{e}.[gate_proj; up_proj]  (E of (f, d))        -> experts.gate_up (E, 2f, d)
    experts.{e}.down_proj             (E of (d, f))        -> experts.down (E, d, f)
    shared_expert.[gate_proj; up_proj]         (2 of (s, d)) -> shared.gate_up.weight
    shared_expert.down_proj                    (d, s)      -> shared.down.weight
    shared_expert_gate.weight                  (1, d)      -> shared_gate.weight

Checkpoint files store experts one by one; a transformers 5 model's own ``state_dict()``
stacks them (``experts.gate_up_proj``, ``experts.down_proj``); both are read. Export
writes them one by one, which ``from_pretrained`` stacks on loading.

Windows: with ``use_sliding_window``, the layers ``layer_types`` names (transformers 5.x
writes it), else transformers' rule for Qwen2-MoE: the even layers below
``max_window_layers``. Export writes ``layer_types``.

``router_aux_loss_coef`` (with ``output_router_logits``: transformers' Switch balance loss
when training) is ``ffn.switch_aux_loss_coef``, both ways.

Shapes: d d_model, f expert hidden size, s shared expert hidden size, E experts.
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
    HFCheckpointError,
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

ARCHITECTURES = {"qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeModel")}

# transformers' Qwen2MoeConfig class defaults (the Qwen1.5-MoE-A2.7B sizes) for the
# config.json keys read here.
DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen2_moe": {
        **llama._COMMON,
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "max_position_embeddings": 32768,
        "use_sliding_window": False,
        "sliding_window": 4096,  # used only with use_sliding_window
        "max_window_layers": 28,
        "qkv_bias": True,
        "decoder_sparse_step": 1,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "num_experts_per_tok": 4,
        "num_experts": 60,
        "norm_topk_prob": False,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
    }
}


def _layer_types(hf: dict[str, Any]) -> list[str] | None:
    """config.json's ``layer_types``, else transformers' Qwen2MoeConfig rule: with
    use_sliding_window, a window on the even layers below max_window_layers."""
    if hf.get("layer_types") or not hf.get("use_sliding_window"):
        return hf.get("layer_types")
    first = get(hf, "max_window_layers")
    return [
        "sliding_attention" if i % 2 == 0 and i < first else "full_attention"
        for i in range(get(hf, "num_hidden_layers"))
    ]


def config_from_hf(hf: dict[str, Any], model_type: str) -> ModelConfig:
    n_experts = get(hf, "num_experts")
    layers = moe_layers_from_hf(hf, n_experts)
    # Qwen2's attention, its window on the layers _layer_types names
    cfg = llama.config_from_hf({**hf, "layer_types": _layer_types(hf)}, "qwen2")
    attention = dataclasses.replace(cfg.attention, qkv_bias=bool(hf.get("qkv_bias", True)))
    cfg = dataclasses.replace(cfg, attention=attention)
    if layers is None:  # no experts anywhere: a dense Qwen2
        return cfg
    f, shared = get(hf, "moe_intermediate_size"), get(hf, "shared_expert_intermediate_size")
    if not shared or shared % f:
        raise HFCheckpointError(
            f"config.json shared_expert_intermediate_size={shared} is not a positive multiple of "
            f"moe_intermediate_size={f}: attnlab's shared experts are as wide as the routed ones"
        )
    ffn = dataclasses.replace(
        cfg.ffn,
        kind="moe",
        router="deepseek-v2",  # softmax over all experts, greedy top-k
        n_routed_experts=n_experts,
        n_shared_experts=shared // f,
        shared_expert_gate=True,
        n_activated_experts=get(hf, "num_experts_per_tok"),
        moe_hidden_dim=f,
        first_k_dense=layers[0],
        dense_layers=layers[1],
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        routed_scaling_factor=1.0,
        switch_aux_loss_coef=switch_loss_from_hf(hf),
    )
    return dataclasses.replace(cfg, ffn=ffn)


def exports(cfg: ModelConfig) -> bool:
    """Mixtures of experts with a gated shared expert."""
    return (
        is_plain_decoder(cfg)
        and cfg.position.kind == "rope"
        and cfg.ffn.kind == "moe"
        and cfg.ffn.shared_expert_gate
    )


def export_type(cfg: ModelConfig) -> str:
    """``qwen2_moe``, or HFCheckpointError naming what Qwen2-MoE lacks."""
    att, ffn = cfg.attention, cfg.ffn
    if cfg.norm.kind != "rmsnorm":
        raise unrepresentable(f"norm.kind={cfg.norm.kind!r} (Qwen2-MoE's is 'rmsnorm')")
    if not ffn.shared_expert_gate:
        raise unrepresentable("ffn.shared_expert_gate=False (Qwen2-MoE gates its shared expert)")
    for name, value, theirs in (("qk_norm", att.qk_norm, False), ("out_bias", att.out_bias, False)):
        if value != theirs:
            raise unrepresentable(f"attention.{name}={value!r} (Qwen2-MoE's is {theirs!r})")
    for name, value, theirs in (
        ("router", ffn.router, "deepseek-v2"),
        ("n_groups", ffn.n_groups, 1),
        ("routed_scaling_factor", ffn.routed_scaling_factor, 1.0),
        ("router_bias", ffn.router_bias, False),
        ("expert_bias", ffn.expert_bias, False),
        ("bias", ffn.bias, False),
    ):
        if value != theirs:
            raise unrepresentable(f"ffn.{name}={value!r} (Qwen2-MoE's is {theirs!r})")
    return "qwen2_moe"


def config_to_hf(cfg: ModelConfig, model_type: str, dtype: torch.dtype) -> dict[str, Any]:
    ffn, att = cfg.ffn, cfg.attention
    hf = llama.config_to_hf(cfg, "qwen2", dtype)  # the window: layer_types
    local = local_layers(cfg)
    hf["architectures"], hf["model_type"] = [ARCHITECTURES[model_type][0]], model_type
    f = ffn.expert_hidden_size(cfg.d_model)
    return hf | {
        "qkv_bias": att.qkv_bias,
        # read only without layer_types (transformers' rule: the even layers below it)
        "max_window_layers": cfg.n_layers if any(local) else 0,
        "num_experts": ffn.n_routed_experts,
        "num_experts_per_tok": ffn.n_activated_experts,
        "moe_intermediate_size": f,
        "shared_expert_intermediate_size": f * ffn.n_shared_experts,
        "norm_topk_prob": ffn.norm_topk_prob,
        **moe_layers_to_hf(cfg),
        **switch_loss_to_hf(cfg),
    }


def _moe_specs(cfg: ModelConfig, p: str, fused: bool) -> Specs:
    """attnlab name -> HF name(s) of the routers, experts and gated shared experts; ``p``
    the backbone prefix."""
    specs: Specs = {}
    for i in filter(cfg.ffn.moe_layer, range(cfg.n_layers)):
        a, m = f"blocks.{i}.ffn.", f"{p}layers.{i}.mlp."
        specs |= moe_specs(a, m, cfg.ffn.n_routed_experts, fused)
        s = m + "shared_expert."
        specs[a + "shared.gate_up.weight"] = [s + "gate_proj.weight", s + "up_proj.weight"]
        specs[a + "shared.down.weight"] = s + "down_proj.weight"
        specs[a + "shared_gate.weight"] = m + "shared_expert_gate.weight"
    return specs


def weights_to_attnlab(src: Source, cfg: ModelConfig) -> Plan:
    p = prefix(src, "model.", "embed_tokens.weight")  # (before llama.py takes it)
    plan = llama.weights_to_attnlab(src, cfg)  # embeddings, attention, norms, dense layers
    if cfg.ffn.kind != "moe":
        return plan
    d, E, f = cfg.d_model, cfg.ffn.n_routed_experts, cfg.ffn.expert_hidden_size(cfg.d_model)
    s = f * cfg.ffn.n_shared_experts
    shapes = {
        "gate.weight": (E, d),
        "experts.gate_up": (E, 2 * f, d),
        "experts.down": (E, d, f),
        "shared.gate_up.weight": (2 * s, d),
        "shared.down.weight": (d, s),
        "shared_gate.weight": (1, d),
    }
    fused = any(name.endswith("mlp.experts.gate_up_proj") for name in src.left)
    for ours, spec in _moe_specs(cfg, p, fused).items():
        plan[ours] = src.spec(spec, shapes[ours.split(".ffn.")[1]])  # type: ignore[assignment]
    return plan


def weights_from_attnlab(
    sd: dict[str, Tensor], cfg: ModelConfig, model_type: str
) -> dict[str, Tensor]:
    # Qwen2's names; without q/k/v biases Mistral's (no biases at all)
    out = llama.weights_from_attnlab(sd, cfg, "qwen2" if cfg.attention.qkv_bias else "mistral")
    return out | unplan(_moe_specs(cfg, "model.", fused=False), sd)


FAMILY = Family(
    name="qwen2_moe",
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
