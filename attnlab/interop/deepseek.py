"""DeepSeek-V2 / DeepSeek-V3 (``model_type`` deepseek_v2, deepseek_v3): multi-head latent
attention, dense and mixture-of-experts layers, RMSNorm, gated feed-forwards.

Weight names, HF (``model.layers.{i}.``) -> attnlab (``blocks.{i}.``); Linear weights are
(out, in) on both sides:

    self_attn.q_proj  or  q_a_proj, q_a_layernorm, q_b_proj -> attn.q_proj  or  q_a_proj, ...
    self_attn.kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj -> attn.kv_a_proj, kv_a_norm, ...
    self_attn.o_proj                                        -> attn.out
    mlp.[gate_proj; up_proj], mlp.down_proj (dense)         -> ffn.gate_up (rows), ffn.down
    mlp.gate.weight, .e_score_correction_bias (V3)          -> ffn.gate.weight, .e_score_...
    mlp.experts.{e}.[gate_proj; up_proj] (E of (f, d))      -> ffn.experts.gate_up (E, 2f, d)
    mlp.experts.{e}.down_proj            (E of (d, f))      -> ffn.experts.down (E, d, f)
    mlp.shared_experts.[gate_proj; up_proj], down_proj      -> ffn.shared.gate_up, .down

Checkpoint files store experts one by one (as above); a transformers model's own
``state_dict()`` holds them stacked (``mlp.experts.gate_up_proj`` (E, 2f, d),
``mlp.experts.down_proj`` (E, d, f)); both are read. The multi-token-prediction layers of
DeepSeek-V3 checkpoints (layer index >= num_hidden_layers) are not part of the language model
and are skipped. RoPE: DeepSeek-V2 rotates interleaved pairs (complex multiplication), V3 too
unless ``rope_interleave`` is false; attnlab rotates in the same layout, so no weight is
permuted.

Shapes: d d_model, f (expert) hidden size, E routed experts, V vocabulary size.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import torch
from torch import Tensor

from attnlab.config import AttentionConfig, FFNConfig, ModelConfig, NormConfig, PositionConfig
from attnlab.interop.io import (
    Family,
    HFCheckpointError,
    Plan,
    Source,
    Specs,
    activation,
    common_config,
    get,
    hf_activation,
    moe_specs,
    rope_settings,
    rope_to_hf,
    unplan,
    unrepresentable,
)

ARCHITECTURES = {
    "deepseek_v2": ("DeepseekV2ForCausalLM", "DeepseekV2Model"),
    "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Model"),
}

# transformers' class defaults (DeepseekV2Config, DeepseekV3Config) for the config.json keys
# read here (Family.defaults).
_COMMON = {
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
}
# DeepSeek-V2's num_experts_per_tok, n_group and topk_group default to None: a MoE model
# needs num_experts_per_tok in config.json (refused by name without it).
DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v2": {
        **_COMMON,
        "vocab_size": 102400,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "moe_intermediate_size": 1407,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "max_position_embeddings": 2048,
        "mlp_bias": False,
        "first_k_dense_replace": 0,
        "n_routed_experts": 64,
        "n_shared_experts": 2,
        "routed_scaling_factor": 1.0,
        "topk_method": "greedy",
        "norm_topk_prob": False,
    },
    "deepseek_v3": {
        **_COMMON,
        "vocab_size": 129280,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "max_position_embeddings": 4096,
        "first_k_dense_replace": 3,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "n_group": 8,
        "topk_group": 4,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "rope_interleave": True,
    },
}

# RoPE frequencies that some checkpoints saved.
IGNORED = re.compile(r"^(model\.)?layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")
_LAYER = re.compile(r"^(model\.)?layers\.(\d+)\.")


# --------------------------------------------------------------------------- config


def _position(hf: dict[str, Any], model_type: str) -> PositionConfig:
    """DeepSeek-V2 rotates interleaved pairs; V3 too unless ``rope_interleave`` is false."""
    interleaved = model_type == "deepseek_v2" or hf.get("rope_interleave", True)
    return PositionConfig(
        kind="rope",
        rope_layout="interleaved" if interleaved else "split",
        **rope_settings(hf, ("default", "linear", "yarn")),
    )


def _norm_topk_prob(hf: dict[str, Any], v3: bool) -> bool:
    """Whether the chosen experts' weights are renormalised: V3's flag; never for V2, whose
    router in transformers ignores the flag (the weights are the softmax scores times
    routed_scaling_factor), so an imported model gives transformers' outputs."""
    if v3:
        return bool(hf.get("norm_topk_prob", True))
    if hf.get("norm_topk_prob"):
        warnings.warn(
            "config.json: norm_topk_prob=true is ignored for deepseek_v2, as transformers "
            "ignores it (the top-k weights are not renormalised)",
            stacklevel=2,
        )
    return False


def config_from_hf(hf: dict[str, Any], model_type: str) -> ModelConfig:
    if hf.get("mlp_bias"):
        raise HFCheckpointError("config.json: mlp_bias=true is not supported")
    n_layers = get(hf, "num_hidden_layers")
    ffn: dict[str, Any] = {
        "kind": "glu",
        "activation": activation(hf.get("hidden_act", "silu"), "hidden_act"),
        "hidden_dim": get(hf, "intermediate_size"),
        "bias": False,
    }
    first_dense = hf.get("first_k_dense_replace") or 0
    if hf.get("n_routed_experts") and first_dense < n_layers:
        v3 = model_type == "deepseek_v3"
        grouped = v3 or hf.get("topk_method") == "group_limited_greedy"
        if not v3 and hf.get("topk_method", "greedy") not in ("greedy", "group_limited_greedy"):
            raise HFCheckpointError(
                f"config.json: topk_method {hf['topk_method']!r} is not supported"
            )
        ffn |= {
            "kind": "moe",
            "n_routed_experts": hf["n_routed_experts"],
            "n_shared_experts": hf.get("n_shared_experts") or 0,
            "n_activated_experts": get(hf, "num_experts_per_tok"),
            "moe_hidden_dim": get(hf, "moe_intermediate_size"),
            "first_k_dense": first_dense,
            "router": "deepseek-v3" if v3 else "deepseek-v2",
            "n_groups": (hf.get("n_group") or 1) if grouped else 1,
            "topk_groups": (hf.get("topk_group") or 1) if grouped else 1,
            "norm_topk_prob": _norm_topk_prob(hf, v3),
            "routed_scaling_factor": float(hf.get("routed_scaling_factor", 1.0)),
        }
    bias = bool(hf.get("attention_bias", False))
    return ModelConfig(
        vocab_size=get(hf, "vocab_size"),
        max_seq_len=hf.get("max_position_embeddings", 4096),
        d_model=get(hf, "hidden_size"),
        n_layers=n_layers,
        attention=AttentionConfig(
            kind="mla",
            n_heads=get(hf, "num_attention_heads"),
            qkv_bias=bias,
            out_bias=bias,
            q_lora_rank=hf.get("q_lora_rank"),
            kv_lora_rank=get(hf, "kv_lora_rank"),
            qk_nope_head_dim=get(hf, "qk_nope_head_dim"),
            qk_rope_head_dim=get(hf, "qk_rope_head_dim"),
            v_head_dim=get(hf, "v_head_dim"),
        ),
        position=_position(hf, model_type),
        ffn=FFNConfig(**ffn),
        norm=NormConfig(kind="rmsnorm", eps=hf.get("rms_norm_eps", 1e-6), placement="pre"),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_std=hf.get("initializer_range", 0.02),
    )


def exports(cfg: ModelConfig) -> bool:
    return cfg.arch == "decoder" and cfg.attention.kind == "mla"


def export_type(cfg: ModelConfig) -> str:
    """``deepseek_v2`` for MoE layers with the DeepSeek-V2 router, else ``deepseek_v3``."""
    att, pos, ffn = cfg.attention, cfg.position, cfg.ffn
    if pos.kind != "rope" or cfg.norm.kind != "rmsnorm" or cfg.norm.placement != "pre":
        raise unrepresentable("DeepSeek needs RoPE and pre-norm RMSNorm")
    if att.qkv_bias != att.out_bias or ffn.kind == "mlp" or ffn.bias:
        raise unrepresentable("DeepSeek has one attention_bias and bias-free gated FFNs")
    if pos.rope_scaling not in (None, "linear", "yarn"):
        raise unrepresentable(f"RoPE scaling {pos.rope_scaling!r} (DeepSeek: linear, yarn)")
    if ffn.kind == "moe" and ffn.dense_layers:
        raise unrepresentable(
            f"ffn.dense_layers={ffn.dense_layers} (DeepSeek's dense layers come first: "
            "ffn.first_k_dense)"
        )
    if ffn.kind == "moe" and ffn.shared_expert_gate:
        raise unrepresentable("ffn.shared_expert_gate (DeepSeek's shared experts are ungated)")
    if ffn.kind == "moe" and ffn.router not in ("deepseek-v2", "deepseek-v3"):
        raise unrepresentable(f"router {ffn.router!r} (DeepSeek: deepseek-v2, deepseek-v3)")
    v2 = ffn.kind == "moe" and ffn.router == "deepseek-v2"
    if v2 and pos.rope_layout != "interleaved":
        raise unrepresentable("DeepSeek-V2 rotates interleaved RoPE pairs only")
    if v2 and ffn.norm_topk_prob:
        raise unrepresentable(
            "the DeepSeek-V2 router with ffn.norm_topk_prob=true (transformers' DeepSeek-V2 "
            "never renormalises the top-k weights); set ffn.norm_topk_prob=false"
        )
    return "deepseek_v2" if v2 else "deepseek_v3"


def config_to_hf(cfg: ModelConfig, model_type: str, dtype: torch.dtype) -> dict[str, Any]:
    att, pos, ffn = cfg.attention, cfg.position, cfg.ffn
    dims = att.mla_dims(cfg.d_model)
    out: dict[str, Any] = {
        **common_config(cfg, FAMILY, model_type, dtype),
        "hidden_size": cfg.d_model,
        "intermediate_size": ffn.hidden_size(cfg.d_model),
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": att.n_heads,
        "num_key_value_heads": att.n_heads,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm.eps,
        "attention_bias": att.qkv_bias,
        "hidden_act": hf_activation(ffn.activation),
        "q_lora_rank": dims.q_lora_rank,
        "kv_lora_rank": dims.kv_lora_rank,
        "qk_nope_head_dim": dims.qk_nope_head_dim,
        "qk_rope_head_dim": dims.qk_rope_head_dim,
        "v_head_dim": dims.v_head_dim,
        "rope_parameters": rope_to_hf(pos),
        "first_k_dense_replace": cfg.n_layers,  # all dense unless MoE below
        "num_nextn_predict_layers": 0,
    }
    if model_type == "deepseek_v3":
        out["rope_interleave"] = pos.rope_layout == "interleaved"
    if ffn.kind == "moe":
        out |= {
            "first_k_dense_replace": ffn.first_k_dense,
            "n_routed_experts": ffn.n_routed_experts,
            "n_shared_experts": ffn.n_shared_experts,
            "num_experts_per_tok": ffn.n_activated_experts,
            "moe_intermediate_size": ffn.expert_hidden_size(cfg.d_model),
            "n_group": ffn.n_groups,
            "topk_group": ffn.topk_groups,
            "norm_topk_prob": ffn.norm_topk_prob,
            "routed_scaling_factor": ffn.routed_scaling_factor,
        }
        if model_type == "deepseek_v2":
            out["topk_method"] = "group_limited_greedy" if ffn.n_groups > 1 else "greedy"
    return out


# --------------------------------------------------------------------------- weights


def _specs(cfg: ModelConfig, p: str, fused_experts: bool) -> Specs:
    """attnlab name -> HF name(s); ``p`` the backbone prefix (``model.`` or none)."""
    specs: Specs = {"tok_emb.weight": f"{p}embed_tokens.weight", "norm.weight": f"{p}norm.weight"}
    if not cfg.tie_embeddings:
        specs["lm_head.weight"] = "lm_head.weight"
    att, ffn = cfg.attention, cfg.ffn
    for i in range(cfg.n_layers):
        a, h = f"blocks.{i}.", f"{p}layers.{i}."
        sa = h + "self_attn."
        specs[a + "attn_norm.weight"] = h + "input_layernorm.weight"
        specs[a + "ffn_norm.weight"] = h + "post_attention_layernorm.weight"
        names = {"kv_a_proj": "kv_a_proj_with_mqa", "kv_b_proj": "kv_b_proj", "out": "o_proj"}
        if att.q_lora_rank is None:
            names["q_proj"] = "q_proj"
        else:
            names |= {"q_a_proj": "q_a_proj", "q_b_proj": "q_b_proj"}
            specs[a + "attn.q_a_norm.weight"] = sa + "q_a_layernorm.weight"
            if att.qkv_bias:
                specs[a + "attn.q_a_proj.bias"] = sa + "q_a_proj.bias"
        for ours, theirs in names.items():
            specs[f"{a}attn.{ours}.weight"] = f"{sa}{theirs}.weight"
        specs[a + "attn.kv_a_norm.weight"] = sa + "kv_a_layernorm.weight"
        if att.qkv_bias:
            specs[a + "attn.kv_a_proj.bias"] = sa + "kv_a_proj_with_mqa.bias"
        if att.out_bias:
            specs[a + "attn.out.bias"] = sa + "o_proj.bias"
        m = h + "mlp."
        if not ffn.moe_layer(i):
            specs[a + "ffn.gate_up.weight"] = [m + "gate_proj.weight", m + "up_proj.weight"]
            specs[a + "ffn.down.weight"] = m + "down_proj.weight"
            continue
        specs |= moe_specs(a + "ffn.", m, ffn.n_routed_experts, fused_experts)
        if ffn.router == "deepseek-v3":
            specs[a + "ffn.gate.e_score_correction_bias"] = m + "gate.e_score_correction_bias"
        if ffn.n_shared_experts:
            s = m + "shared_experts."
            specs[a + "ffn.shared.gate_up.weight"] = [s + "gate_proj.weight", s + "up_proj.weight"]
            specs[a + "ffn.shared.down.weight"] = s + "down_proj.weight"
    return specs


def weights_to_attnlab(src: Source, cfg: ModelConfig) -> Plan:
    for name in list(src.left):  # multi-token-prediction layers: not the language model
        if (m := _LAYER.match(name)) and int(m.group(2)) >= cfg.n_layers:
            src.skip(name)
    for name, shape in list(src.left.items()):  # n_shared_experts=0: transformers keeps
        if ".mlp.shared_experts." in name and 0 in shape:  # empty shared experts
            src.skip(name)
    p = "model." if src.has("model.embed_tokens.weight") else ""
    # A transformers model's own state dict stacks the experts; checkpoint files do not.
    fused = any(name.endswith("mlp.experts.gate_up_proj") for name in src.left)
    plan = src.plan(_specs(cfg, p, fused))
    if cfg.tie_embeddings:
        src.tied("lm_head.weight", plan["tok_emb.weight"])
    return plan  # type: ignore[return-value]  # None entries only with src.missing/wrong


def weights_from_attnlab(
    sd: dict[str, Tensor], cfg: ModelConfig, model_type: str
) -> dict[str, Tensor]:
    return unplan(_specs(cfg, "model.", fused_experts=False), sd)


FAMILY = Family(
    name="deepseek",
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
