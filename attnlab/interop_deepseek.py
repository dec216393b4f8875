"""DeepSeek-V2 / DeepSeek-V3 checkpoints (``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``)
to and from attnlab (multi-head latent attention, dense and mixture-of-experts layers).

Self-contained; to become ``attnlab/interop/deepseek.py`` when interop is a package.

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

import json
import re
from pathlib import Path
from typing import Any

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
from attnlab.models.decoder import DecoderLM

MODEL_TYPES = {"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "relu": "relu"}
_ROPE_KEYS = {  # HF rope parameter -> PositionConfig field
    "factor": "rope_factor",
    "original_max_position_embeddings": "rope_original_max_seq_len",
    "beta_fast": "rope_beta_fast",
    "beta_slow": "rope_beta_slow",
    "mscale": "rope_mscale",
    "mscale_all_dim": "rope_mscale_all_dim",
}


class DeepSeekCheckpointError(ValueError):
    """A DeepSeek config or checkpoint that attnlab cannot represent or that does not match."""


# --------------------------------------------------------------------------- config


def _need(hf: dict[str, Any], key: str) -> Any:
    if hf.get(key) is None:
        raise DeepSeekCheckpointError(f"config.json: missing {key!r}")
    return hf[key]


def _position(hf: dict[str, Any], model_type: str) -> PositionConfig:
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    interleaved = model_type == "deepseek_v2" or hf.get("rope_interleave", True)
    fields: dict[str, Any] = {
        "kind": "rope",
        "rope_theta": float(theta),
        "rope_layout": "interleaved" if interleaved else "split",
    }
    if rope_type == "yarn":
        fields["rope_scaling"] = "yarn"
        for key, ours in _ROPE_KEYS.items():
            if params.get(key) is not None:
                fields[ours] = params[key]
        if params.get("attention_factor") is not None or params.get("truncate") is False:
            raise DeepSeekCheckpointError(
                "config.json: YaRN attention_factor / truncate=false are not supported"
            )
    elif rope_type == "linear":
        fields |= {"rope_scaling": "linear", "rope_factor": params["factor"]}
    elif rope_type != "default":
        raise DeepSeekCheckpointError(
            f"config.json: RoPE scaling {rope_type!r} is not supported; use default, linear, yarn"
        )
    return PositionConfig(**fields)


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """attnlab config of a DeepSeek-V2/V3 ``config.json`` (as a dict)."""
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise DeepSeekCheckpointError(
            f"config.json: model_type {model_type!r} is not one of {', '.join(MODEL_TYPES)}"
        )
    if hf.get("mlp_bias"):
        raise DeepSeekCheckpointError("config.json: mlp_bias=true is not supported")
    act = hf.get("hidden_act", "silu")
    if act not in _ACTIVATIONS:
        raise DeepSeekCheckpointError(f"config.json: hidden_act {act!r} is not supported")
    n_layers = _need(hf, "num_hidden_layers")
    ffn: dict[str, Any] = {
        "kind": "glu",
        "activation": _ACTIVATIONS[act],
        "hidden_dim": _need(hf, "intermediate_size"),
        "bias": False,
    }
    first_dense = hf.get("first_k_dense_replace") or 0
    if hf.get("n_routed_experts") and first_dense < n_layers:
        v3 = model_type == "deepseek_v3"
        grouped = v3 or hf.get("topk_method") == "group_limited_greedy"
        if not v3 and hf.get("topk_method", "greedy") not in ("greedy", "group_limited_greedy"):
            raise DeepSeekCheckpointError(
                f"config.json: topk_method {hf['topk_method']!r} is not supported"
            )
        ffn |= {
            "kind": "moe",
            "n_routed_experts": hf["n_routed_experts"],
            "n_shared_experts": hf.get("n_shared_experts") or 0,
            "n_activated_experts": _need(hf, "num_experts_per_tok"),
            "moe_hidden_dim": _need(hf, "moe_intermediate_size"),
            "first_k_dense": first_dense,
            "router": "deepseek-v3" if v3 else "deepseek-v2",
            "n_groups": (hf.get("n_group") or 1) if grouped else 1,
            "topk_groups": (hf.get("topk_group") or 1) if grouped else 1,
            "norm_topk_prob": bool(hf.get("norm_topk_prob", v3)),
            "routed_scaling_factor": float(hf.get("routed_scaling_factor", 1.0)),
        }
    bias = bool(hf.get("attention_bias", False))
    data = ModelConfig(
        vocab_size=_need(hf, "vocab_size"),
        max_seq_len=hf.get("max_position_embeddings", 4096),
        d_model=_need(hf, "hidden_size"),
        n_layers=n_layers,
        attention=AttentionConfig(
            kind="mla",
            n_heads=_need(hf, "num_attention_heads"),
            qkv_bias=bias,
            out_bias=bias,
            q_lora_rank=hf.get("q_lora_rank"),
            kv_lora_rank=_need(hf, "kv_lora_rank"),
            qk_nope_head_dim=_need(hf, "qk_nope_head_dim"),
            qk_rope_head_dim=_need(hf, "qk_rope_head_dim"),
            v_head_dim=_need(hf, "v_head_dim"),
        ),
        position=_position(hf, model_type),
        ffn=FFNConfig(),
        norm=NormConfig(kind="rmsnorm", eps=hf.get("rms_norm_eps", 1e-6), placement="pre"),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    ).to_dict()
    data["ffn"] = ffn
    try:
        return ModelConfig.from_dict(data)
    except ConfigError as e:
        raise DeepSeekCheckpointError(f"config.json: {e}") from None


def config_to_hf(cfg: ModelConfig, model_type: str = "deepseek_v3") -> dict[str, Any]:
    """A ``config.json`` dict that transformers reads as the same model."""
    if model_type not in MODEL_TYPES:
        raise DeepSeekCheckpointError(f"model_type must be one of {', '.join(MODEL_TYPES)}")
    att, pos, ffn = cfg.attention, cfg.position, cfg.ffn
    dims = att.mla_dims(cfg.d_model)
    if att.kind != "mla" or pos.kind != "rope" or cfg.norm.kind != "rmsnorm":
        raise DeepSeekCheckpointError("a DeepSeek checkpoint needs MLA, RoPE and RMSNorm")
    if att.qkv_bias != att.out_bias or ffn.kind == "mlp" or ffn.bias:
        raise DeepSeekCheckpointError("DeepSeek has one attention_bias and bias-free SwiGLUs")
    if model_type == "deepseek_v2" and pos.rope_layout != "interleaved":
        raise DeepSeekCheckpointError("DeepSeek-V2 rotates interleaved RoPE pairs only")
    rope: dict[str, Any] = {
        "rope_type": pos.rope_scaling or "default",
        "rope_theta": pos.rope_theta,
    }
    if pos.rope_scaling == "yarn":
        rope |= {key: getattr(pos, ours) for key, ours in _ROPE_KEYS.items()}
    elif pos.rope_scaling == "linear":
        rope["factor"] = pos.rope_factor
    elif pos.rope_scaling is not None:
        raise DeepSeekCheckpointError(f"RoPE scaling {pos.rope_scaling!r} has no DeepSeek form")
    out: dict[str, Any] = {
        "architectures": [MODEL_TYPES[model_type]],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": ffn.hidden_size(cfg.d_model),
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": att.n_heads,
        "num_key_value_heads": att.n_heads,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm.eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": att.qkv_bias,
        "hidden_act": ffn.activation,
        "q_lora_rank": dims.q_lora_rank,
        "kv_lora_rank": dims.kv_lora_rank,
        "qk_nope_head_dim": dims.qk_nope_head_dim,
        "qk_rope_head_dim": dims.qk_rope_head_dim,
        "v_head_dim": dims.v_head_dim,
        "rope_parameters": rope,
        "first_k_dense_replace": cfg.n_layers,  # all dense unless MoE below
        "num_nextn_predict_layers": 0,
    }
    if model_type == "deepseek_v3":
        out["rope_interleave"] = pos.rope_layout == "interleaved"
    if ffn.kind == "moe":
        if (ffn.router == "deepseek-v3") != (model_type == "deepseek_v3"):
            raise DeepSeekCheckpointError(f"router {ffn.router!r} does not match {model_type}")
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


def _plan(cfg: ModelConfig, fused_experts: bool) -> dict[str, Any]:
    """attnlab name -> HF source: a name, a list of names concatenated along rows, or a
    list of such lists stacked (one per expert)."""
    plan: dict[str, Any] = {
        "tok_emb.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
    }
    if not cfg.tie_embeddings:
        plan["lm_head.weight"] = "lm_head.weight"
    att, ffn = cfg.attention, cfg.ffn
    for i in range(cfg.n_layers):
        a, h = f"blocks.{i}.", f"model.layers.{i}."
        sa = h + "self_attn."
        plan[a + "attn_norm.weight"] = h + "input_layernorm.weight"
        plan[a + "ffn_norm.weight"] = h + "post_attention_layernorm.weight"
        names = {"kv_a_proj": "kv_a_proj_with_mqa", "kv_b_proj": "kv_b_proj", "out": "o_proj"}
        if att.q_lora_rank is None:
            names["q_proj"] = "q_proj"
        else:
            names |= {"q_a_proj": "q_a_proj", "q_b_proj": "q_b_proj"}
            plan[a + "attn.q_a_norm.weight"] = sa + "q_a_layernorm.weight"
            if att.qkv_bias:
                plan[a + "attn.q_a_proj.bias"] = sa + "q_a_proj.bias"
        for ours, theirs in names.items():
            plan[f"{a}attn.{ours}.weight"] = f"{sa}{theirs}.weight"
        plan[a + "attn.kv_a_norm.weight"] = sa + "kv_a_layernorm.weight"
        if att.qkv_bias:
            plan[a + "attn.kv_a_proj.bias"] = sa + "kv_a_proj_with_mqa.bias"
        if att.out_bias:
            plan[a + "attn.out.bias"] = sa + "o_proj.bias"
        m = h + "mlp."
        if ffn.kind != "moe" or i < ffn.first_k_dense:
            plan[a + "ffn.gate_up.weight"] = [m + "gate_proj.weight", m + "up_proj.weight"]
            plan[a + "ffn.down.weight"] = m + "down_proj.weight"
            continue
        plan[a + "ffn.gate.weight"] = m + "gate.weight"
        if ffn.router == "deepseek-v3":
            plan[a + "ffn.gate.e_score_correction_bias"] = m + "gate.e_score_correction_bias"
        e = m + "experts."
        if fused_experts:
            plan[a + "ffn.experts.gate_up"] = e + "gate_up_proj"
            plan[a + "ffn.experts.down"] = e + "down_proj"
        else:
            E = range(ffn.n_routed_experts)
            plan[a + "ffn.experts.gate_up"] = [
                [f"{e}{j}.gate_proj.weight", f"{e}{j}.up_proj.weight"] for j in E
            ]
            plan[a + "ffn.experts.down"] = [[f"{e}{j}.down_proj.weight"] for j in E]
        if ffn.n_shared_experts:
            s = m + "shared_experts."
            plan[a + "ffn.shared.gate_up.weight"] = [s + "gate_proj.weight", s + "up_proj.weight"]
            plan[a + "ffn.shared.down.weight"] = s + "down_proj.weight"
    return plan


def _leaves(spec: Any, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """The HF names of a plan entry with the shape each must have, given the attnlab shape."""
    if isinstance(spec, str):
        return [(spec, shape)]
    if isinstance(spec[0], list):  # stacked along a new first axis
        return [leaf for sub in spec for leaf in _leaves(sub, shape[1:])]
    rows = shape[0] // len(spec)
    return [(name, (rows, *shape[1:])) for name in spec]


def _assemble(spec: Any, tensors: dict[str, Tensor]) -> Tensor:
    if isinstance(spec, str):
        return tensors[spec]
    if isinstance(spec[0], list):
        return torch.stack([_assemble(sub, tensors) for sub in spec])
    return torch.cat([tensors[name] for name in spec], dim=0)


_SKIPPED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def _target_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        model = DecoderLM(cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def state_dict_from_hf(tensors: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """attnlab state dict of HF DeepSeek tensors (checkpoint or ``model.state_dict()``).
    Raises one :class:`DeepSeekCheckpointError` listing every missing, mis-shaped or
    unexpected tensor."""
    mtp = re.compile(r"^model\.layers\.(\d+)\.")
    tensors = {
        k: v
        for k, v in tensors.items()
        if not _SKIPPED.search(k)
        and not ((m := mtp.match(k)) and int(m.group(1)) >= cfg.n_layers)  # MTP layers
    }
    fused = any(k.endswith("mlp.experts.gate_up_proj") for k in tensors)
    plan, targets = _plan(cfg, fused), _target_shapes(cfg)
    missing, wrong, used = [], [], set()
    for ours, spec in plan.items():
        for name, shape in _leaves(spec, targets[ours]):
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
    return {ours: _assemble(spec, tensors) for ours, spec in plan.items()}


def state_dict_to_hf(sd: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """HF checkpoint tensors (experts one by one, as DeepSeek's files store them)."""
    out: dict[str, Tensor] = {}
    for ours, spec in _plan(cfg, fused_experts=False).items():
        t = sd[ours]
        if isinstance(spec, str):
            out[spec] = t
        elif isinstance(spec[0], list):  # one entry per expert
            for j, sub in enumerate(spec):
                out |= dict(zip(sub, t[j].chunk(len(sub), dim=0), strict=True))
        else:
            out |= dict(zip(spec, t.chunk(len(spec), dim=0), strict=True))
    return {k: v.detach().contiguous() for k, v in out.items()}


# --------------------------------------------------------------------------- files


def _read_tensors(path: Path) -> dict[str, Tensor]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = [path / "model.safetensors"]
    if not files[0].is_file():
        raise DeepSeekCheckpointError(f"{path}: no model.safetensors (or index) found")
    tensors: dict[str, Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118  (safe_open has keys(), not iteration)
                tensors[key] = f.get_tensor(key)
    return tensors


def load_deepseek(path: str | Path, dtype: torch.dtype | None = None) -> DecoderLM:
    """A :class:`DecoderLM` from a DeepSeek-V2/V3 model directory (config.json +
    safetensors)."""
    path = Path(path)
    try:
        hf = json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise DeepSeekCheckpointError(f"{path}: config.json not found") from None
    cfg = config_from_hf(hf)
    sd = state_dict_from_hf(_read_tensors(path), cfg)
    model = DecoderLM(cfg)
    model.load_state_dict(sd, strict=True)
    return model.to(dtype) if dtype is not None else model


def save_deepseek(model: DecoderLM, path: str | Path, model_type: str = "deepseek_v3") -> None:
    """Write ``config.json`` and ``model.safetensors`` that transformers loads as
    ``DeepseekV2ForCausalLM`` / ``DeepseekV3ForCausalLM``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hf_config = config_to_hf(model.cfg, model_type)
    hf_config["dtype"] = str(model.tok_emb.weight.dtype).removeprefix("torch.")
    tensors = state_dict_to_hf(model.state_dict(), model.cfg)
    with atomic_path(path / "model.safetensors") as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    atomic_write_text(path / "config.json", json.dumps(hf_config, indent=2) + "\n")
