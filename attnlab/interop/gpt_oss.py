"""GPT-OSS (``model_type`` gpt_oss): the LLaMA layout's attention and names (llama.py) with
q/k/v/o biases (``attention_bias``), a learned sink logit per head, local (a sliding window)
and global layers as ``layer_types`` says, and a mixture of experts in every layer.

Its router is a Linear with bias over the experts: the top k of the logits, then a softmax
over those k, which is attnlab's ``deepseek-v2`` softmax router renormalised over the top k
(``norm_topk_prob``) with ``router_bias``. Its experts are SwiGLUs with biases
(``expert_bias``) and a clamp (``activation`` ``clamped_swiglu``: ``swiglu_alpha``,
``swiglu_limit``); no shared experts. ``hidden_act`` is not read (neither does transformers'
model). ``router_aux_loss_coef`` with ``output_router_logits`` (transformers' Switch
load-balancing loss over the routers' logits, bias included, when training) is
``ffn.switch_aux_loss_coef``, both ways.

Weights beyond llama.py's, HF (``model.layers.{i}.``) -> attnlab (``blocks.{i}.``):

    self_attn.sinks                     (h,)           -> attn.sink_logit
    mlp.router.weight, .bias            (E, d), (E,)   -> ffn.gate.weight, .bias
    mlp.experts.gate_up_proj            (E, d, 2f)     -> ffn.experts.gate_up (E, 2f, d)
    mlp.experts.gate_up_proj_bias       (E, 2f)        -> ffn.experts.gate_up_bias (E, 2f)
    mlp.experts.down_proj               (E, f, d)      -> ffn.experts.down (E, d, f)
    mlp.experts.down_proj_bias          (E, d)         -> ffn.experts.down_bias

transformers multiplies ``x @ gate_up_proj[e]`` (stored (in, out): transposed here) and
interleaves gate and up along the last dimension (gate ``[..., ::2]``, up ``[..., 1::2]``);
attnlab stacks them, rows [gate; up] (``Part.interleaved``).

Checkpoints with MXFP4-quantised experts (``quantization_config``: the published
openai/gpt-oss-20b and -120b folders) are refused by name: dequantise them first.

Shapes: d d_model, h heads, f expert hidden size, E experts.
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
    common_config,
    get,
    interleave,
    is_plain_decoder,
    local_layers,
    or_zeros,
    periodic_layer_types,
    prefix,
    rope_settings,
    rope_to_hf,
    switch_loss_from_hf,
    switch_loss_to_hf,
    unrepresentable,
    windows_of_layer_types,
)

ARCHITECTURES = {"gpt_oss": ("GptOssForCausalLM", "GptOssModel")}

# transformers' GptOssConfig class defaults for the config.json keys read here (they are
# openai/gpt-oss-120b's sizes). num_local_experts is read below (config.json may call it
# num_experts); RoPE and layer_types are filled as GptOssConfig.__post_init__ fills them.
DEFAULTS: dict[str, dict[str, Any]] = {
    "gpt_oss": {
        "vocab_size": 201088,
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "head_dim": 64,
        "num_hidden_layers": 36,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "sliding_window": 128,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "attention_dropout": 0.0,
        "attention_bias": True,
        "num_experts_per_tok": 4,
        "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
    }
}
N_EXPERTS_DEFAULT = 128  # GptOssConfig's num_local_experts
# GptOssConfig.__post_init__: YaRN x32 from a 4k context, its ramp bounds not rounded, and
# the class's default_theta, where config.json gives no RoPE parameters (or no theta)
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
DEFAULT_THETA = 150000.0
UNUSED_WINDOW = DEFAULTS["gpt_oss"]["sliding_window"]  # written when no layer slides
_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

# --------------------------------------------------------------------------- configs


def _layer_types(hf: dict[str, Any], n_layers: int) -> list[str]:
    """config.json's layer_types; without them GptOssConfig's default: sliding, full,
    sliding, ..."""
    types = hf.get("layer_types")
    return periodic_layer_types(n_layers, 2) if types is None else types


def _rope(hf: dict[str, Any]) -> dict[str, Any]:
    """PositionConfig fields, RoPE parameters and theta defaulting as GptOssConfig's."""
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or dict(DEFAULT_ROPE)
    if not isinstance(params, dict):
        raise HFCheckpointError(f"config.json rope_parameters must be a mapping, got {params!r}")
    theta = params.get("rope_theta", hf.get("rope_theta"))
    params = {**params, "rope_theta": DEFAULT_THETA if theta is None else theta}
    return rope_settings({**hf, "rope_scaling": None, "rope_parameters": params}, _ROPE_TYPES)


def config_from_hf(hf: dict[str, Any], model_type: str) -> ModelConfig:
    quantization = hf.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else None
        raise HFCheckpointError(
            f"config.json quantization_config ({method}): quantised experts are not supported; "
            "dequantise first (transformers: GptOssForCausalLM.from_pretrained(path, "
            "quantization_config=Mxfp4Config(dequantize=True)).save_pretrained(out))"
        )
    d, n_heads = get(hf, "hidden_size"), get(hf, "num_attention_heads")
    n_layers = get(hf, "num_hidden_layers")
    if isinstance(n_layers, float) and n_layers.is_integer():
        n_layers = int(n_layers)  # (16.0: as transformers reads it)
    if not isinstance(n_layers, int) or isinstance(n_layers, bool) or n_layers < 1:
        raise HFCheckpointError(
            f"config.json num_hidden_layers must be a positive integer, got {n_layers!r}"
        )
    n_kv_heads = hf.get("num_key_value_heads") or n_heads  # (GptOssConfig: null is n_heads)
    head_dim = hf.get("head_dim") or d // n_heads
    window, layer_pattern = windows_of_layer_types(hf, _layer_types(hf, n_layers), n_layers)
    # transformers 5.x writes num_experts as num_local_experts, which wins when both are given
    n_experts = hf.get("num_local_experts", hf.get("num_experts", N_EXPERTS_DEFAULT))
    attention_bias = bool(hf.get("attention_bias", True))
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
            sliding_window=window,
            layer_pattern=layer_pattern,
            sink_logits=True,
        ),
        position=PositionConfig(kind="rope", rope_layout="split", **_rope(hf)),
        ffn=FFNConfig(
            kind="moe",
            activation="clamped_swiglu",
            swiglu_alpha=get(hf, "swiglu_alpha"),
            swiglu_limit=get(hf, "swiglu_limit"),
            bias=False,  # (no dense layers)
            n_routed_experts=n_experts,
            n_shared_experts=0,
            n_activated_experts=get(hf, "num_experts_per_tok"),
            moe_hidden_dim=get(hf, "intermediate_size"),
            first_k_dense=0,
            router="deepseek-v2",  # softmax, greedy top-k ...
            norm_topk_prob=True,  # ... renormalised: a softmax over the top-k logits
            routed_scaling_factor=1.0,
            router_bias=True,
            expert_bias=True,
            switch_aux_loss_coef=switch_loss_from_hf(hf),
        ),
        norm=NormConfig(kind="rmsnorm", eps=hf.get("rms_norm_eps", 1e-5)),
        tie_embeddings=hf.get("tie_word_embeddings", False),
        init_std=hf.get("initializer_range", 0.02),
    )


def exports(cfg: ModelConfig) -> bool:
    """Decoders with GPT-OSS's own pieces: sink logits or the clamped SwiGLU, in experts."""
    if not (is_plain_decoder(cfg) and cfg.position.kind == "rope" and cfg.ffn.kind == "moe"):
        return False
    return cfg.attention.sink_logits or cfg.ffn.activation == "clamped_swiglu"


def export_type(cfg: ModelConfig) -> str:
    """``gpt_oss``, or HFCheckpointError naming what GPT-OSS lacks (missing attention,
    router and expert biases are written as zeros)."""
    ffn = cfg.ffn
    if cfg.norm.kind != "rmsnorm":
        raise unrepresentable(f"norm.kind={cfg.norm.kind!r} (GPT-OSS's is 'rmsnorm')")
    if not cfg.attention.sink_logits:
        raise unrepresentable(
            "attention.sink_logits=False (GPT-OSS has a learned sink logit per head in every "
            "layer): set attention.sink_logits"
        )
    for name, value, theirs in (
        ("activation", ffn.activation, "clamped_swiglu"),
        ("router", ffn.router, "deepseek-v2"),
        ("norm_topk_prob", ffn.norm_topk_prob, True),
        ("n_shared_experts", ffn.n_shared_experts, 0),
        ("n_groups", ffn.n_groups, 1),
        ("routed_scaling_factor", ffn.routed_scaling_factor, 1.0),
        ("first_k_dense", ffn.first_k_dense, 0),
        ("dense_layers", ffn.dense_layers, []),
    ):
        if value != theirs:
            raise unrepresentable(f"ffn.{name}={value!r} (GPT-OSS's is {theirs!r})")
    return "gpt_oss"


def config_to_hf(cfg: ModelConfig, model_type: str, dtype: torch.dtype) -> dict[str, Any]:
    att, ffn, pos = cfg.attention, cfg.ffn, cfg.position
    local = local_layers(cfg)
    rope = rope_to_hf(pos)
    return {
        **common_config(cfg, FAMILY, model_type, dtype),
        "hidden_size": cfg.d_model,
        "intermediate_size": ffn.expert_hidden_size(cfg.d_model),
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm.eps,
        "attention_dropout": att.dropout,
        "attention_bias": att.qkv_bias or att.out_bias,
        "layer_types": ["sliding_attention" if w else "full_attention" for w in local],
        # transformers builds the sliding mask whatever the layers: a window even unused
        "sliding_window": att.sliding_window if any(local) else UNUSED_WINDOW,
        "num_local_experts": ffn.n_routed_experts,
        "num_experts_per_tok": ffn.n_activated_experts,
        "swiglu_alpha": ffn.swiglu_alpha,
        "swiglu_limit": ffn.swiglu_limit,
        "hidden_act": "silu",
        **switch_loss_to_hf(cfg),
        "rope_theta": pos.rope_theta,  # transformers 4.x
        "rope_scaling": None if pos.rope_scaling is None else rope,
        "rope_parameters": rope,  # transformers 5.x
    }


# --------------------------------------------------------------------------- weights


def weights_to_attnlab(src: Source, cfg: ModelConfig) -> Plan:
    p = prefix(src, "model.", "embed_tokens.weight")  # (before llama.py takes it)
    plan = llama.weights_to_attnlab(src, cfg)  # embeddings, attention, norms
    d, h = cfg.d_model, cfg.n_heads
    E, f = cfg.ffn.n_routed_experts, cfg.ffn.expert_hidden_size(cfg.d_model)
    for i in range(cfg.n_layers):
        theirs, ours = f"{p}layers.{i}.", f"blocks.{i}."
        m, e = theirs + "mlp.", theirs + "mlp.experts."
        plan |= {
            ours + "attn.sink_logit": src.take(theirs + "self_attn.sinks", (h,)),
            ours + "ffn.gate.weight": src.take(m + "router.weight", (E, d)),
            ours + "ffn.gate.bias": src.take(m + "router.bias", (E,)),
            ours + "ffn.experts.gate_up": src.take(
                e + "gate_up_proj", (E, d, 2 * f), transposed=True, interleaved=True
            ),
            ours + "ffn.experts.gate_up_bias": src.take(
                e + "gate_up_proj_bias", (E, 2 * f), interleaved=True
            ),
            ours + "ffn.experts.down": src.take(e + "down_proj", (E, f, d), transposed=True),
            ours + "ffn.experts.down_bias": src.take(e + "down_proj_bias", (E, d)),
        }  # type: ignore[arg-type]  # None entries only with src.missing/wrong
    return plan


def weights_from_attnlab(
    sd: dict[str, Tensor], cfg: ModelConfig, model_type: str
) -> dict[str, Tensor]:
    # Qwen3's attention biases: q, k, v and o all or none (zeros for a missing one)
    out = llama.weights_from_attnlab(sd, cfg, "qwen3")
    d, E, f = cfg.d_model, cfg.ffn.n_routed_experts, cfg.ffn.expert_hidden_size(cfg.d_model)
    for i in range(cfg.n_layers):
        theirs, ours = f"model.layers.{i}.", f"blocks.{i}."
        m, e, x = theirs + "mlp.", theirs + "mlp.experts.", ours + "ffn.experts."
        out |= {
            theirs + "self_attn.sinks": sd[ours + "attn.sink_logit"],
            m + "router.weight": sd[ours + "ffn.gate.weight"],
            m + "router.bias": or_zeros(sd, ours + "ffn.gate.bias", E),
            # (E, 2f, d) rows [gate; up] -> (E, d, 2f), gate and up interleaved
            e + "gate_up_proj": interleave(sd[x + "gate_up"].transpose(-2, -1)),
            e + "gate_up_proj_bias": interleave(or_zeros(sd, x + "gate_up_bias", (E, 2 * f))),
            e + "down_proj": sd[x + "down"].transpose(-2, -1),  # (E, f, d)
            e + "down_proj_bias": or_zeros(sd, x + "down_bias", (E, d)),
        }
    return out


FAMILY = Family(
    name="gpt_oss",
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
