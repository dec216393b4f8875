"""SmolLM3 (``model_type`` smollm3: SmolLM3ForCausalLM): the LLaMA layout (llama.py's
embeddings, q/k/v/o projections, SwiGLU feed-forward, pre-norm RMSNorms, weight names) in
which some layers rotate nothing, NoPE layers (``position.nope_layers``):

- config.json's ``no_rope_layers`` holds one entry per layer, 1 where the layer applies
  RoPE and 0 where it does not; without it transformers makes every
  ``no_rope_layer_interval``-th layer (default 4: layers 3, 7, 11, ...) a NoPE layer.
  A NoPE layer's queries and keys go to the cache and the scores as projected.

Biases: ``attention_bias`` on q, k, v and o all or none (a missing one written as zeros),
``mlp_bias`` on gate, up and down. RoPE scaling as LLaMA's (llama.py's types); head_dim as
config.json sets it, else d / h. Tied head by default (SmolLM3Config's
tie_word_embeddings is true). Sliding windows (``use_sliding_window`` with a
``sliding_window``, or ``layer_types`` naming sliding_attention; by default the NoPE
layers) are refused on import: the published models have none. Export takes every decoder
with NoPE layers (no other layout holds them) and names what else SmolLM3 lacks.

Shapes: d d_model, h heads, h_kv key/value heads, d_h head dim.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attnlab.config import AttentionConfig, FFNConfig, ModelConfig, NormConfig, PositionConfig
from attnlab.interop import llama
from attnlab.interop.io import (
    Family,
    HFCheckpointError,
    Plan,
    Source,
    activation,
    common_config,
    get,
    hf_activation,
    rope_settings,
    rope_to_hf,
    unrepresentable,
)

ARCHITECTURES = {"smollm3": ("SmolLM3ForCausalLM", "SmolLM3Model")}
MODEL_TYPES = tuple(ARCHITECTURES)

# transformers' SmolLM3Config class defaults for the config.json keys read here
# (no_rope_layers, sliding_window and layer_types, None there, are left out: read as
# missing, the NoPE layers made from the interval as SmolLM3Config.__post_init__ makes them).
DEFAULTS: dict[str, dict[str, Any]] = {
    "smollm3": {
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 11008,
        "num_hidden_layers": 36,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "use_sliding_window": False,
        "no_rope_layer_interval": 4,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": True,
    }
}

# SmolLM3Config.default_theta: the RoPE base of a config.json without rope_theta
DEFAULT_THETA = 2_000_000.0

# --------------------------------------------------------------------------- configs


def nope_layers_from_hf(hf: dict[str, Any], n_layers: int) -> list[int]:
    """The NoPE layers of a config.json: the 0 entries of ``no_rope_layers`` (transformers
    reads the first n_layers entries), else every ``no_rope_layer_interval``-th layer."""
    flags = hf.get("no_rope_layers")
    if flags is None:
        interval = hf.get("no_rope_layer_interval", 4)
        if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
            raise HFCheckpointError(
                f"config.json no_rope_layer_interval must be a positive integer, got {interval!r}"
            )
        flags = [int((i + 1) % interval != 0) for i in range(n_layers)]
    if not isinstance(flags, list) or len(flags) < n_layers:
        raise HFCheckpointError(
            f"config.json no_rope_layers must list one 0 or 1 per layer ({n_layers}), got {flags!r}"
        )
    if any(f not in (0, 1) for f in flags[:n_layers]):  # (True and False compare as 1 and 0)
        raise HFCheckpointError(
            f"config.json no_rope_layers entries must be 0 (NoPE) or 1 (RoPE), got {flags!r}"
        )
    return [i for i in range(n_layers) if not flags[i]]


def _check_no_windows(hf: dict[str, Any], n_layers: int, nope: list[int]) -> None:
    """Refuse the sliding windows SmolLM3Config can describe (the published models have
    none): ``layer_types`` as transformers makes it (sliding on the NoPE layers with
    use_sliding_window and a sliding_window) or as config.json sets it."""
    window = hf.get("sliding_window")
    use = bool(hf.get("use_sliding_window", False))
    types = hf.get("layer_types") or [
        "sliding_attention" if use and window is not None and i in nope else "full_attention"
        for i in range(n_layers)
    ]
    if not isinstance(types, list) or set(types) - {"full_attention", "sliding_attention"}:
        raise HFCheckpointError(
            f"layer_types={types!r}: expected full_attention or sliding_attention per layer"
        )
    if "sliding_attention" in types[:n_layers]:
        raise HFCheckpointError(
            f"sliding windows (use_sliding_window={use}, sliding_window={window}, "
            f"layer_types with sliding_attention) are not supported for smollm3; "
            f"supported: full attention on every layer"
        )


def config_from_hf(hf: dict[str, Any], model_type: str) -> ModelConfig:
    d, n_heads = get(hf, "hidden_size"), get(hf, "num_attention_heads")
    n_layers = get(hf, "num_hidden_layers")
    n_kv_heads = hf.get("num_key_value_heads") or n_heads
    # transformers' SmolLM3Attention reads a head_dim config.json sets (getattr), else d / h
    head_dim = hf.get("head_dim") or d // n_heads
    nope = nope_layers_from_hf(hf, n_layers)
    _check_no_windows(hf, n_layers, nope)
    attention_bias = bool(hf.get("attention_bias", False))
    return ModelConfig(
        vocab_size=get(hf, "vocab_size"),
        max_seq_len=get(hf, "max_position_embeddings"),
        d_model=d,
        n_layers=n_layers,
        attention=AttentionConfig(
            n_heads=n_heads,
            n_kv_heads=None if n_kv_heads == n_heads else n_kv_heads,
            head_dim=None if head_dim * n_heads == d else head_dim,
            qkv_bias=attention_bias,
            out_bias=attention_bias,
            dropout=hf.get("attention_dropout", 0.0),
        ),
        position=PositionConfig(
            kind="rope",
            rope_layout="split",
            nope_layers=nope,
            **rope_settings({"rope_theta": DEFAULT_THETA, **hf}, llama.ROPE_TYPES),
        ),
        ffn=FFNConfig(
            kind="glu",
            activation=activation(hf.get("hidden_act"), "hidden_act"),
            hidden_dim=get(hf, "intermediate_size"),
            bias=bool(hf.get("mlp_bias", False)),
        ),
        norm=NormConfig(kind="rmsnorm", eps=get(hf, "rms_norm_eps")),
        tie_embeddings=hf.get("tie_word_embeddings", True),
        init_std=hf.get("initializer_range", 0.02),
    )


def smollm3_features(cfg: ModelConfig) -> list[str]:
    """The fields of ``cfg`` set to what only SmolLM3 has among the exported families."""
    return ["position.nope_layers"] if cfg.position.nope_layers else []


def exports(cfg: ModelConfig) -> bool:
    """Decoders with NoPE layers (the other families' layouts would rotate every layer)."""
    return cfg.arch == "decoder" and bool(smollm3_features(cfg))


def export_type(cfg: ModelConfig) -> str:
    """``smollm3``, or HFCheckpointError naming the field SmolLM3 has otherwise. Windows,
    sinks, QK-norm and other families' pieces are refused by ``convert`` for every family
    that lacks them."""
    att, ffn, pos, norm = cfg.attention, cfg.ffn, cfg.position, cfg.norm

    def refuse(reason: str) -> HFCheckpointError:
        return unrepresentable(f"{reason}; position.nope_layers exports as smollm3 only")

    for field, value, theirs in (
        ("attention.kind", att.kind, "mha"),
        ("position.kind", pos.kind, "rope"),
        ("norm.kind", norm.kind, "rmsnorm"),
        ("norm.placement", norm.placement, "pre"),
        ("ffn.kind", ffn.kind, "glu"),
    ):
        if value != theirs:
            raise refuse(f"{field}={value!r} (SmolLM3's is {theirs!r})")
    hf_activation(ffn.activation)  # (refused by name if transformers has no such name)
    return "smollm3"


def config_to_hf(cfg: ModelConfig, model_type: str, dtype: torch.dtype) -> dict[str, Any]:
    att, pos = cfg.attention, cfg.position
    rope = rope_to_hf(pos)
    return {
        **common_config(cfg, FAMILY, model_type, dtype),
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn.hidden_size(cfg.d_model),
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,  # (not a SmolLM3Config field: transformers reads it as set)
        "hidden_act": hf_activation(cfg.ffn.activation),
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm.eps,
        "attention_bias": att.qkv_bias or att.out_bias,
        "attention_dropout": att.dropout,
        "mlp_bias": cfg.ffn.bias,
        "no_rope_layers": [int(i not in pos.nope_layers) for i in range(cfg.n_layers)],
        "no_rope_layer_interval": 4,  # (read only without no_rope_layers)
        "use_sliding_window": False,
        "sliding_window": None,
        "layer_types": ["full_attention"] * cfg.n_layers,
        "rope_theta": pos.rope_theta,  # transformers 4.x
        "rope_scaling": None if pos.rope_scaling is None else rope,
        "rope_parameters": rope,  # transformers 5.x
    }


# --------------------------------------------------------------------------- weights


def weights_to_attnlab(src: Source, cfg: ModelConfig) -> Plan:
    """llama.py's plan: SmolLM3's weights have LLaMA's names and shapes."""
    return llama.weights_to_attnlab(src, cfg)


def weights_from_attnlab(
    sd: dict[str, Tensor], cfg: ModelConfig, model_type: str
) -> dict[str, Tensor]:
    """llama.py's tensors with LLaMA's biases (q, k, v and o all or none, zeros for a
    missing one; gate, up and down by ffn.bias); interleaved RoPE rows permuted to split
    halves (a NoPE layer's too: q and k permuted alike leave its scores as they were)."""
    return llama.weights_from_attnlab(sd, cfg, "llama")


FAMILY = Family(
    name="smollm3",
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
