"""Gemma (``model_type`` gemma: GemmaForCausalLM), Gemma 2 (gemma2: Gemma2ForCausalLM) and
Gemma 3, text only (gemma3_text: Gemma3ForCausalLM): the LLaMA layout's attention and names
(llama.py) with Gemma's own pieces:

- token embeddings times sqrt(d_model), rounded to the embedding's dtype
  (``scale_embeddings``; all three);
- RMSNorms whose weight is stored as its offset from one, x / rms(x) * (1 + w), in float32
  (norm kind ``gemma_rmsnorm``; all three): before each sublayer in Gemma (norm placement
  ``pre``), in a "sandwich" around it in Gemma 2 and 3: x + post_norm(f(pre_norm(x)))
  (``sandwich``);
- a GeGLU feed-forward, no biases, a tied head (all three). Gemma reads ``hidden_act``
  (transformers turns the original checkpoints' "gelu" into gelu_pytorch_tanh, and so
  does attnlab); Gemma 2 and 3 read ``hidden_activation``;
- Gemma 2 and 3: a softmax scale of query_pre_attn_scalar**-0.5 (``attention.scale``),
  local (a sliding window) and global layers as ``layer_types`` says (without it Gemma 2
  alternates local and global, and Gemma 3 makes every ``sliding_window_pattern``-th layer
  global), and logit soft-capping: ``attn_logit_softcapping`` (``attention.softcap``:
  the scaled scores become c tanh(scores / c) before the mask) and
  ``final_logit_softcapping`` (``final_logit_softcap``: the same on the output logits).
  Gemma 2 sets both (50 and 30); Gemma 3 leaves them null. transformers' Gemma 3 applies
  a final_logit_softcapping that is set, and so does attnlab; it keeps but never applies
  attn_logit_softcapping, which attnlab refuses there by name (and a Gemma 3 config with
  attention.softcap is not exported). A model with the attention cap is given
  attention backend ``flash`` (``eager`` with attention dropout): sdpa cannot cap scores;
  the tiled flash path keeps memory linear in the length and skips the tiles outside the
  window, and has its own backward (on CUDA, the Triton kernels: they cap too);
- Gemma 3 only: QK-norm (the same RMSNorm over each head's features) and, on the local
  layers, RoPE of base ``rope_local_base_freq`` and no scaling (``position.local_rope_theta``),
  ``rope_theta`` with ``rope_scaling`` (linear in the 4B to 27B models) on the global
  ones; transformers 5 holds both in ``rope_parameters`` keyed by layer type. Gemma and
  Gemma 2 have one RoPE for all layers.

Export picks the type by the pieces: QK-norm or a second RoPE base -> gemma3_text; else
sandwich norms -> gemma2; else gemma. Bidirectional attention
(``use_bidirectional_attention``) and the vision model of ``gemma3``
(Gemma3ForConditionalGeneration) are refused by name.

Weights beyond llama.py's, HF (``model.layers.{i}.``) -> attnlab (``blocks.{i}.``), Gemma 2
and 3 (Gemma's are llama.py's: input_layernorm and post_attention_layernorm before each
sublayer):

    input_layernorm              (d,)     -> attn_norm
    post_attention_layernorm     (d,)     -> attn_post_norm
    pre_feedforward_layernorm    (d,)     -> ffn_norm
    post_feedforward_layernorm   (d,)     -> ffn_post_norm
    self_attn.q_norm, .k_norm    (d_h,)   -> attn.q_norm, attn.k_norm  (Gemma 3)

Shapes: d d_model, d_h head dim.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attnlab.config import AttentionConfig, FFNConfig, ModelConfig, NormConfig, PositionConfig
from attnlab.interop import llama
from attnlab.interop.io import (
    LAYER_TYPES,
    Family,
    HFCheckpointError,
    Plan,
    Source,
    activation,
    common_config,
    get,
    hf_activation,
    local_layers,
    periodic_layer_types,
    prefix,
    rope_settings,
    rope_to_hf,
    unrepresentable,
    windows_of_layer_types,
)

ARCHITECTURES = {
    "gemma": ("GemmaForCausalLM", "GemmaModel"),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Model"),
    "gemma3_text": ("Gemma3ForCausalLM", "Gemma3TextModel"),
}
NAMES = {"gemma": "Gemma", "gemma2": "Gemma 2", "gemma3_text": "Gemma 3"}
MODEL_TYPES = tuple(ARCHITECTURES)
MODEL_TYPES_TEXT = "gemma, gemma2 or gemma3_text"  # (for messages)

# transformers' GemmaConfig, Gemma2Config and Gemma3TextConfig class defaults for the
# config.json keys read here.
_COMMON_DEFAULTS: dict[str, Any] = {
    "head_dim": 256,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "attention_dropout": 0.0,
}
DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma": {  # gemma-7b
        **_COMMON_DEFAULTS,
        "vocab_size": 256000,
        "hidden_size": 3072,
        "intermediate_size": 24576,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "hidden_act": "gelu_pytorch_tanh",
        "max_position_embeddings": 8192,
    },
    "gemma2": {  # gemma-2-2b
        **_COMMON_DEFAULTS,
        "vocab_size": 256000,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 8192,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0,
    },
    "gemma3_text": {
        **_COMMON_DEFAULTS,
        "vocab_size": 262208,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 131072,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "use_bidirectional_attention": False,
    },
}
# Gemma3TextConfig: without layer_types every sliding_window_pattern-th layer is global;
# default_theta: the global and local RoPE bases without rope_theta / rope_local_base_freq
SLIDING_WINDOW_PATTERN = 6
DEFAULT_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}
UNUSED_WINDOW = DEFAULTS["gemma3_text"]["sliding_window"]  # written when no layer slides
# Gemma 3's global layers: plain or linear (position interpolation) RoPE; Gemma and Gemma 2
# take transformers' RoPE types as LLaMA does (one RoPE for every layer)
_ROPE_TYPES = ("default", "linear")
_SOFTCAPS = (  # config.json key -> attnlab field (Gemma 2; Gemma 3 the final one, when set)
    ("attn_logit_softcapping", "attention.softcap"),
    ("final_logit_softcapping", "final_logit_softcap"),
)

# --------------------------------------------------------------------------- configs


def _layer_types(hf: dict[str, Any], n_layers: int, model_type: str) -> list[str]:
    """config.json's layer_types, or its config class's: Gemma2Config alternates local and
    global (the first local), Gemma3TextConfig makes every sliding_window_pattern-th layer
    global."""
    types = hf.get("layer_types")
    if types is not None:
        return types
    if model_type == "gemma2":
        return periodic_layer_types(n_layers, 2)
    period = hf.get("sliding_window_pattern", SLIDING_WINDOW_PATTERN)
    if not isinstance(period, int) or isinstance(period, bool) or period < 1:
        raise HFCheckpointError(
            f"config.json sliding_window_pattern must be a positive integer, got {period!r}"
        )
    return periodic_layer_types(n_layers, period)


def _rope_parameters(hf: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """RoPE parameters by layer type, as Gemma3TextConfig.convert_rope_params_to_dict fills
    them: transformers 5's ``rope_parameters``, or 4.x's rope_theta + rope_scaling (global
    layers) and rope_local_base_freq (local layers)."""
    given = hf.get("rope_parameters")
    if given is not None and (
        not isinstance(given, dict)
        or set(given) - set(LAYER_TYPES)
        or not all(isinstance(v, dict) for v in given.values())
    ):
        raise HFCheckpointError(
            f"config.json rope_parameters must map {' and '.join(LAYER_TYPES)} to their "
            f"RoPE parameters, got {given!r}"
        )
    params = {t: dict((given or {}).get(t) or {"rope_type": "default"}) for t in LAYER_TYPES}
    scaling = hf.get("rope_scaling")
    if scaling is not None:
        if not isinstance(scaling, dict):
            raise HFCheckpointError(f"config.json rope_scaling must be a mapping, got {scaling!r}")
        params["full_attention"].update(scaling)
    keys = {"full_attention": "rope_theta", "sliding_attention": "rope_local_base_freq"}
    for layer_type, key in keys.items():
        theta = hf.get(key)
        default = DEFAULT_THETA[layer_type] if theta is None else theta
        params[layer_type].setdefault("rope_theta", default)
    return params


def _positions(hf: dict[str, Any], local: bool) -> PositionConfig:
    """The global layers' RoPE (theta, scaling) and, where there are local layers, their
    unscaled base (``local_rope_theta``)."""
    params = _rope_parameters(hf)
    full = rope_settings(
        {**hf, "rope_scaling": None, "rope_parameters": params["full_attention"]}, _ROPE_TYPES
    )
    sliding = params["sliding_attention"]
    rope_type = sliding.get("rope_type", sliding.get("type", "default"))
    extra = {k for k, v in sliding.items() if v is not None} - {"rope_type", "type", "rope_theta"}
    if rope_type != "default" or extra:
        raise HFCheckpointError(
            f"config.json RoPE parameters of sliding_attention layers {sliding!r}: attnlab's "
            "local layers take plain RoPE (rope_type 'default' and rope_theta only)"
        )
    local_theta = float(sliding["rope_theta"]) if local else None
    return PositionConfig(kind="rope", rope_layout="split", local_rope_theta=local_theta, **full)


def _softcap(hf: dict[str, Any], key: str) -> float | None:
    """A soft cap of config.json (null: none); transformers divides by it, so 0 is refused."""
    cap = hf.get(key)
    if cap is None:
        return None
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not 0 < cap < float("inf"):
        raise HFCheckpointError(f"config.json {key} must be a positive number or null, got {cap!r}")
    return float(cap)


def _scale(hf: dict[str, Any], head_dim: int) -> float | None:
    """attention.scale from query_pre_attn_scalar (Gemma 2 and 3)."""
    scalar = get(hf, "query_pre_attn_scalar")
    if not isinstance(scalar, (int, float)) or isinstance(scalar, bool) or not scalar > 0:
        raise HFCheckpointError(
            f"config.json query_pre_attn_scalar must be a positive number, got {scalar!r}"
        )
    # the same Python expression as transformers' (None: head_dim's, 1 / sqrt(d_h))
    return None if scalar == head_dim else scalar**-0.5


def _hidden_act(hf: dict[str, Any]) -> str:
    """Gemma's hidden_act, as GemmaConfig reads it: the original checkpoints' "gelu" meant
    the tanh approximation, and transformers computes that."""
    name = hf.get("hidden_act")
    return activation("gelu_pytorch_tanh" if name == "gelu" else name, "hidden_act")


def config_from_hf(hf: dict[str, Any], model_type: str) -> ModelConfig:
    if hf.get("use_bidirectional_attention"):
        raise HFCheckpointError(
            f"config.json use_bidirectional_attention={hf['use_bidirectional_attention']!r} is "
            f"not supported (bidirectional attention is not implemented); {NAMES[model_type]}'s "
            "language models leave it null/false"
        )
    d, n_heads = get(hf, "hidden_size"), get(hf, "num_attention_heads")
    n_layers = get(hf, "num_hidden_layers")
    n_kv_heads = hf.get("num_key_value_heads") or n_heads
    head_dim = hf.get("head_dim") or d // n_heads
    attention_bias = bool(hf.get("attention_bias", False))
    dropout = hf.get("attention_dropout", 0.0)
    if model_type == "gemma":  # pre-norm, every layer global, one RoPE, 1 / sqrt(d_h)
        window = layer_pattern = scale = attn_cap = final_cap = None
        position = PositionConfig(
            kind="rope", rope_layout="split", **rope_settings(hf, llama.ROPE_TYPES)
        )
        act, placement = _hidden_act(hf), "pre"
    else:
        types = _layer_types(hf, n_layers, model_type)
        window, layer_pattern = windows_of_layer_types(hf, types, n_layers)
        scale = _scale(hf, head_dim)
        if model_type == "gemma3_text":
            position = _positions(hf, local=window is not None)
        else:
            position = PositionConfig(
                kind="rope", rope_layout="split", **rope_settings(hf, llama.ROPE_TYPES)
            )
        act = activation(hf.get("hidden_activation"), "hidden_activation")
        placement = "sandwich"
        attn_cap, final_cap = (_softcap(hf, key) for key, _ in _SOFTCAPS)
        if model_type == "gemma3_text" and attn_cap is not None:
            raise HFCheckpointError(
                f"config.json attn_logit_softcapping={hf['attn_logit_softcapping']!r} is not "
                "supported for gemma3_text: transformers' Gemma 3 keeps it but never caps its "
                "attention scores (Gemma 3 leaves it null)"
            )
    # sdpa cannot cap the scores: the tiled flash path can (and keeps memory linear in the
    # length), eager where attention dropout is asked for (flash has none)
    backend = "sdpa" if attn_cap is None else ("eager" if dropout else "flash")
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
            dropout=dropout,
            sliding_window=window,
            layer_pattern=layer_pattern,
            qk_norm=model_type == "gemma3_text",
            scale=scale,
            softcap=attn_cap,
            backend=backend,
        ),
        position=position,
        ffn=FFNConfig(
            kind="glu", activation=act, hidden_dim=get(hf, "intermediate_size"), bias=False
        ),
        norm=NormConfig(
            kind="gemma_rmsnorm", eps=hf.get("rms_norm_eps", 1e-6), placement=placement
        ),
        tie_embeddings=hf.get("tie_word_embeddings", True),
        scale_embeddings=True,
        final_logit_softcap=final_cap,
        init_std=hf.get("initializer_range", 0.02),
    )


def gemma_features(cfg: ModelConfig) -> list[str]:
    """The fields of ``cfg`` set to what only Gemma's models have among the exported
    families."""
    found = []
    if cfg.norm.placement == "sandwich":
        found.append("norm.placement='sandwich'")
    if cfg.norm.kind == "gemma_rmsnorm":
        found.append("norm.kind='gemma_rmsnorm'")
    if cfg.scale_embeddings:
        found.append("scale_embeddings")
    if cfg.attention.scale is not None:
        found.append("attention.scale")
    if cfg.attention.softcap is not None:
        found.append("attention.softcap")
    if cfg.final_logit_softcap is not None:
        found.append("final_logit_softcap")
    if cfg.position.local_rope_theta is not None:
        found.append("position.local_rope_theta")
    return found


def exports(cfg: ModelConfig) -> bool:
    """Decoders with any of Gemma's own pieces (the others' families would drop them)."""
    return cfg.arch == "decoder" and bool(gemma_features(cfg))


def query_pre_attn_scalar(cfg: ModelConfig) -> int:
    """The integer s with s**-0.5 == attention.scale exactly (head_dim without a scale)."""
    scale = cfg.attention.scale
    if scale is None:
        return cfg.head_dim
    scalar = round(scale**-2)
    if scalar < 1 or scalar**-0.5 != scale:
        raise unrepresentable(
            f"attention.scale={scale!r} (Gemma's is query_pre_attn_scalar**-0.5 for an integer "
            f"query_pre_attn_scalar; the nearest, {scalar}, gives {max(scalar, 1) ** -0.5!r})"
        )
    return scalar


def _model_type(cfg: ModelConfig) -> str:
    """Gemma 3's own pieces (QK-norm, a second RoPE base) -> gemma3_text; sandwich norms ->
    gemma2; else gemma."""
    if cfg.attention.qk_norm or cfg.position.local_rope_theta is not None:
        return "gemma3_text"
    return "gemma2" if cfg.norm.placement == "sandwich" else "gemma"


def export_type(cfg: ModelConfig) -> str:
    """``gemma``, ``gemma2`` or ``gemma3_text`` (:func:`_model_type`), or HFCheckpointError
    naming the field that model type has otherwise (and the Gemma piece that rules out
    every other layout)."""
    att, ffn, pos, norm = cfg.attention, cfg.ffn, cfg.position, cfg.norm
    piece = gemma_features(cfg)[0]
    model_type = _model_type(cfg)
    name = NAMES[model_type]

    def refuse(reason: str) -> HFCheckpointError:
        return unrepresentable(f"{reason}; {piece} exports as {MODEL_TYPES_TEXT} only")

    placement = "pre" if model_type == "gemma" else "sandwich"
    for field, value, theirs in (
        ("attention.kind", att.kind, "mha"),
        ("position.kind", pos.kind, "rope"),
        ("norm.kind", norm.kind, "gemma_rmsnorm"),
        ("norm.placement", norm.placement, placement),
        ("scale_embeddings", cfg.scale_embeddings, True),
        ("attention.qk_norm", att.qk_norm, model_type == "gemma3_text"),
        ("ffn.kind", ffn.kind, "glu"),
        ("ffn.bias", ffn.bias, False),
    ):
        if value != theirs:
            raise refuse(f"{field}={value!r} ({name}'s is {theirs!r})")
    if model_type == "gemma3_text":
        if att.softcap is not None:
            raise refuse(
                f"attention.softcap={att.softcap!r} (transformers' Gemma 3 never caps its "
                "attention scores; without QK-norm and position.local_rope_theta it exports "
                "as gemma2)"
            )
        if pos.rope_scaling not in (None, "linear"):
            raise refuse(
                f"position.rope_scaling={pos.rope_scaling!r} (Gemma 3's global layers: none or "
                "linear)"
            )
        if any(local_layers(cfg)) and pos.local_rope_theta is None and pos.rope_scaling is not None:
            raise refuse(
                "position.local_rope_theta=None with rope_scaling (Gemma 3's local layers take "
                "unscaled RoPE: set position.local_rope_theta)"
            )
    if model_type == "gemma" and ffn.activation == "gelu":
        raise refuse(
            "ffn.activation='gelu' (transformers' Gemma reads hidden_act 'gelu' as the tanh "
            "approximation, gelu_tanh: the exact GELU cannot be written)"
        )
    if model_type == "gemma":  # what Gemma 2 added
        for field, value in (
            ("attention.sliding_window", att.sliding_window),
            ("attention.scale", att.scale),
            ("attention.softcap", att.softcap),
            ("final_logit_softcap", cfg.final_logit_softcap),
        ):
            if value is not None:
                raise refuse(
                    f"{field}={value!r} (Gemma has none; with norm.placement='sandwich' it "
                    "exports as gemma2)"
                )
    hf_activation(ffn.activation)  # (refused by name if transformers has no such name)
    query_pre_attn_scalar(cfg)
    return model_type


def config_to_hf(cfg: ModelConfig, model_type: str, dtype: torch.dtype) -> dict[str, Any]:
    att, pos = cfg.attention, cfg.position
    hf: dict[str, Any] = {
        **common_config(cfg, FAMILY, model_type, dtype),
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn.hidden_size(cfg.d_model),
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm.eps,
        "attention_bias": att.qkv_bias or att.out_bias,
        "attention_dropout": att.dropout,
        "use_bidirectional_attention": False,
    }
    full = rope_to_hf(pos)
    if model_type == "gemma":
        return {
            **hf,
            "hidden_act": hf_activation(cfg.ffn.activation),
            "rope_theta": pos.rope_theta,  # transformers 4.x
            "rope_scaling": None if pos.rope_scaling is None else full,
            "rope_parameters": full,  # transformers 5.x
        }
    local = local_layers(cfg)
    hf |= {
        "hidden_activation": hf_activation(cfg.ffn.activation),
        "query_pre_attn_scalar": query_pre_attn_scalar(cfg),
        "layer_types": ["sliding_attention" if w else "full_attention" for w in local],
        # transformers builds the sliding mask whatever the layers: a window even unused
        "sliding_window": att.sliding_window if any(local) else UNUSED_WINDOW,
        "attn_logit_softcapping": att.softcap,
        "final_logit_softcapping": cfg.final_logit_softcap,
    }
    if model_type == "gemma2":
        return {
            **hf,
            "rope_theta": pos.rope_theta,  # transformers 4.x
            "rope_scaling": None if pos.rope_scaling is None else full,
            "rope_parameters": full,  # transformers 5.x
        }
    local_theta = pos.local_rope_theta if pos.local_rope_theta is not None else pos.rope_theta
    sliding = {"rope_type": "default", "rope_theta": local_theta}
    return {
        **hf,
        # transformers 4.x
        "rope_theta": pos.rope_theta,
        "rope_local_base_freq": local_theta,
        "rope_scaling": None if pos.rope_scaling is None else full,
        # transformers 5.x
        "rope_parameters": {"full_attention": full, "sliding_attention": sliding},
    }


# --------------------------------------------------------------------------- weights

_NORMS = (  # Gemma's four norms per layer: HF name -> attnlab name
    ("input_layernorm", "attn_norm"),
    ("post_attention_layernorm", "attn_post_norm"),
    ("pre_feedforward_layernorm", "ffn_norm"),
    ("post_feedforward_layernorm", "ffn_post_norm"),
)


def weights_to_attnlab(src: Source, cfg: ModelConfig) -> Plan:
    p = prefix(src, "model.", "embed_tokens.weight")  # (before llama.py takes it)
    # embeddings, attention (QK-norm too), MLP, input_layernorm; llama.py reads
    # post_attention_layernorm as the FFN's pre-norm: Gemma 2 and 3's is their own, read below
    plan = llama.weights_to_attnlab(src, cfg)
    if cfg.norm.placement == "pre":  # Gemma: llama.py's names and places
        return plan
    d = cfg.d_model
    for i in range(cfg.n_layers):
        theirs, ours = f"{p}layers.{i}.", f"blocks.{i}."
        plan[ours + "attn_post_norm.weight"] = plan.pop(ours + "ffn_norm.weight")
        for hf_name, name in _NORMS[2:]:  # the FFN's pre- and post-norm
            plan[f"{ours}{name}.weight"] = src.take(f"{theirs}{hf_name}.weight", (d,))  # type: ignore[assignment]
    return plan


def weights_from_attnlab(
    sd: dict[str, Tensor], cfg: ModelConfig, model_type: str
) -> dict[str, Tensor]:
    # Qwen3's attention: biases on q, k, v and o all or none (zeros for a missing one),
    # QK-norm permuted with the q/k rows of interleaved RoPE pairs
    out = llama.weights_from_attnlab(sd, cfg, "qwen3")
    if cfg.norm.placement == "pre":  # Gemma: llama.py's names and places
        return out
    for i in range(cfg.n_layers):
        theirs, ours = f"model.layers.{i}.", f"blocks.{i}."
        for hf_name, name in _NORMS:
            out[f"{theirs}{hf_name}.weight"] = sd[f"{ours}{name}.weight"]
    return out


FAMILY = Family(
    name="gemma",
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
