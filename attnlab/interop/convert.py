"""Hugging Face folder <-> attnlab model: configs through the family registry, weights
through each family's name mapping."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from attnlab.config import ConfigError, ModelConfig
from attnlab.interop.cohere import MODEL_TYPES as COHERE_TYPES
from attnlab.interop.cohere import cohere_features
from attnlab.interop.gemma import MODEL_TYPES as GEMMA_TYPES
from attnlab.interop.gemma import MODEL_TYPES_TEXT as GEMMA_TYPES_TEXT
from attnlab.interop.gemma import gemma_features
from attnlab.interop.granite import MODEL_TYPES as GRANITE_TYPES
from attnlab.interop.granite import granite_features
from attnlab.interop.io import (
    Family,
    HFCheckpointError,
    Part,
    Source,
    local_layers,
    read_config,
    unrepresentable,
    weight_files,
    with_generation_config,
    with_preprocessor_config,
    write_folder,
)
from attnlab.interop.olmo2 import MODEL_TYPES as OLMO2_TYPES
from attnlab.interop.olmo2 import olmo2_features
from attnlab.interop.registry import FAMILIES, lookup
from attnlab.interop.smollm3 import MODEL_TYPES as SMOLLM3_TYPES
from attnlab.interop.t5 import CLASS_PREFIX as T5_TYPES
from attnlab.models import build_model
from attnlab.models.loadable import check_tied
from attnlab.weights import SafetensorsFile, WeightsFileError, materialize, parameters_on_meta


def with_defaults(hf: dict[str, Any], family: Family, model_type: str) -> dict[str, Any]:
    """``hf`` with the keys it lacks set to transformers' class defaults for
    ``model_type`` (a key present, even as null, is kept)."""
    return {**family.defaults.get(model_type, {}), **hf}


def config_from_hf(hf_config: dict[str, Any]) -> ModelConfig:
    """Map a Hugging Face ``config.json`` (as a dict) to an attnlab :class:`ModelConfig`.

    A key the file lacks is read as transformers' config class for its ``model_type``
    fills it (the family's ``defaults``), so a minimal config.json gives the model
    ``from_pretrained`` builds; keys with no usable default are refused by name."""
    family, model_type = lookup(hf_config)
    try:
        cfg = family.config_from_hf(with_defaults(hf_config, family, model_type), model_type)
        # through from_dict: its type checks (a "two" or a 16.0 in config.json, written
        # into the config as is, failed later in a comparison or in torch.empty)
        cfg = type(cfg).from_dict(cfg.to_dict())
        cfg.validate()
    except ConfigError as e:
        raise HFCheckpointError(f"config.json maps to an invalid attnlab config: {e}") from None
    return cfg


# model types whose attention has a sliding window (the only windowed ones attnlab writes)
WINDOWED_TYPES = (
    "mistral",
    "qwen2",
    "qwen3",
    "qwen2_moe",
    "qwen3_moe",
    "mixtral",
    "gpt_oss",
    "gemma2",
    "gemma3_text",
    "phi3",
    "starcoder2",
    "modernbert",  # (bidirectional: keys within the window on either side)
)
# The QK-norms (attention.qk_norm_kind, qk_norm_bias, qk_norm_weight, qk_norm_scope) each
# model type with QK-norm holds: an RMSNorm of one weight every head shares (Qwen3, Gemma 3)
# or over whole projections (OLMo 2); Phi's LayerNorm with a bias every head shares (a
# missing bias written as zeros); Cohere's and StableLM's LayerNorm, a weight per head and
# no bias
_RMS_HEAD = ("rmsnorm", False, "shared", "head")
_LN_SHARED = ("layernorm", True, "shared", "head")
_LN_PER_HEAD = ("layernorm", False, "per_head", "head")
QK_NORMS: dict[str, tuple[tuple[str, bool, str, str], ...]] = {
    "qwen3": (_RMS_HEAD,),
    "qwen3_moe": (_RMS_HEAD,),
    "gemma3_text": (_RMS_HEAD,),
    "olmo2": (("rmsnorm", False, "shared", "projection"),),
    "phi": (_LN_SHARED, ("layernorm", False, "shared", "head")),
    "cohere": (_LN_PER_HEAD,),
    "stablelm": (_LN_PER_HEAD,),
    "persimmon": (_LN_SHARED, ("layernorm", False, "shared", "head")),
}
QK_NORM_TYPES = tuple(QK_NORMS)
QK_NORM_FIELDS = ("qk_norm_kind", "qk_norm_bias", "qk_norm_weight", "qk_norm_scope")
# model types with LongRoPE (whose generate re-encodes past the original context), and with
# a partial rotation (position.rope_fraction)
LONGROPE_TYPES = ("phi3",)
PARTIAL_ROTARY_TYPES = ("phi3", "gpt_neox", "phi", "gptj", "stablelm", "persimmon", "nemotron")
# model types whose LayerNorms store their weight as an offset from one (norm.kind=layernorm1p)
LAYERNORM1P_TYPES = ("nemotron",)
# decoder model types whose head has a bias (final_logits_bias: lm_head.bias)
HEAD_BIAS_TYPES = ("phi", "gptj")
# the model_types that hold ALiBi position biases (BLOOM's unscaled, Falcon-RW's scaled)
ALIBI_TYPES = ("bloom", "mpt", "falcon")
# model types whose q/k/v projections may be clamped (attention.clip_qkv)
CLIP_QKV_TYPES = ("mpt",)
# GPT-OSS's own pieces, which no other exported architecture has: a learned sink logit per
# head, the clamped SwiGLU, biases on the router's logits and on the experts
GPT_OSS_TYPES = ("gpt_oss",)


def _gpt_oss_features(cfg: ModelConfig) -> list[str]:
    """The fields of ``cfg`` set to what only GPT-OSS has (experts' settings only where the
    model has experts)."""
    ffn, found = cfg.ffn, []
    if cfg.attention.sink_logits:
        found.append("attention.sink_logits")
    if ffn.kind in ("glu", "moe") and ffn.activation == "clamped_swiglu":
        found.append("ffn.activation='clamped_swiglu'")
    if any(ffn.moe_layer(i) for i in range(cfg.n_layers)):
        found += [f"ffn.{name}" for name in ("router_bias", "expert_bias") if getattr(ffn, name)]
    return found


def _check_attention(cfg: ModelConfig) -> None:
    """Refuse attention features that no exported architecture has, rather than write a
    folder that transformers loads without them (and so with other logits)."""
    att = cfg.attention
    if att.sink_tokens:
        raise unrepresentable("attention.sink_tokens (StreamingLLM's attention sinks)")
    if att.global_tokens:
        raise unrepresentable("attention.global_tokens (Longformer's global attention)")


def _check_qk_norm(cfg: ModelConfig, model_type: str) -> None:
    """Refuse QK-norm where ``model_type`` has none."""
    if cfg.attention.qk_norm and model_type not in QK_NORMS:
        hint = (  # decoders only: no encoder, seq2seq or ViT family has QK-norm
            f"; decoders with it export as {' or '.join(QK_NORM_TYPES)}, each its own kind"
            if cfg.arch == "decoder"
            else ""
        )
        raise unrepresentable(f"attention.qk_norm ({model_type} has no QK-norm{hint})")


def _check_qk_norm_kind(cfg: ModelConfig, model_type: str) -> None:
    """Refuse a QK-norm of another kind than ``model_type``'s (after OLMo 2's check, which
    names its scope with the rest of its pieces), naming the first field that differs."""
    att = cfg.attention
    if not att.qk_norm:
        return
    ours = tuple(getattr(att, name) for name in QK_NORM_FIELDS)
    if ours in QK_NORMS[model_type]:
        return

    def differences(kind: tuple) -> list[int]:
        return [i for i, (a, b) in enumerate(zip(ours, kind, strict=True)) if a != b]

    def show(value: object) -> str:
        return str(value).lower() if isinstance(value, bool) else repr(value)

    theirs = min(QK_NORMS[model_type], key=lambda kind: len(differences(kind)))  # the nearest
    i = differences(theirs)[0]
    holders = [t for t, kinds in QK_NORMS.items() if ours in kinds]
    where = f"this QK-norm exports as {' or '.join(holders)}" if holders else (
        "no exported family has this QK-norm")  # fmt: skip
    raise unrepresentable(
        f"attention.{QK_NORM_FIELDS[i]}={show(ours[i])} ({model_type}'s QK-norm has "
        f"{show(theirs[i])}; {where})"
    )


def _export_family(cfg: ModelConfig) -> tuple[Family, str]:
    _check_attention(cfg)
    if cfg.norm.kind == "layernorm1p" and cfg.arch != "decoder":  # (nemotron.py takes decoders)
        raise unrepresentable(
            f"norm.kind='layernorm1p' (no {cfg.arch} family has a unit-offset LayerNorm; it "
            f"exports as {' or '.join(LAYERNORM1P_TYPES)}: RoPE decoders, an MLP)"
        )
    for family in FAMILIES:
        if family.exports(cfg):
            model_type = family.export_type(cfg)
            _check_qk_norm(cfg, model_type)
            found = _gpt_oss_features(cfg)
            if found and model_type not in GPT_OSS_TYPES:
                raise unrepresentable(
                    f"{found[0]} ({model_type} has none; GPT-OSS's pieces export as gpt_oss: "
                    "RoPE, RMSNorm, sink logits, experts in every layer with clamped SwiGLU)"
                )
            # (an encoder-decoder's scaled embeddings are Marian's own, an encoder's second
            # RoPE base ModernBERT's, T5's unscaled scores its own: its export_type checks
            # attention.scale is 1)
            others = {"seq2seq": "scale_embeddings", "encoder": "position.local_rope_theta"}
            gemma = [f for f in gemma_features(cfg) if f != others.get(cfg.arch)]
            # (T5's unscaled scores, Granite's attention_multiplier, MPT's softmax_scale: a
            # softmax scale of their own)
            if model_type in (*T5_TYPES, *GRANITE_TYPES, "mpt"):
                gemma = [f for f in gemma if f != "attention.scale"]
            if gemma and model_type not in GEMMA_TYPES:
                raise unrepresentable(
                    f"{gemma[0]} ({model_type} has none; Gemma's pieces export as "
                    f"{GEMMA_TYPES_TEXT})"
                )
            found = cohere_features(cfg)
            if found and model_type not in COHERE_TYPES:
                raise unrepresentable(
                    f"{found[0]} ({model_type} has none; Cohere's logit scale exports as "
                    "cohere: parallel blocks of one LayerNorm, RoPE, gated feed-forward)"
                )
            found = granite_features(cfg)
            if found and model_type not in GRANITE_TYPES:
                raise unrepresentable(
                    f"{found[0]} ({model_type} has none; Granite's multipliers export as "
                    "granite: RoPE, RMSNorm, gated feed-forward)"
                )
            olmo = olmo2_features(cfg)
            if olmo and model_type not in OLMO2_TYPES:
                raise unrepresentable(
                    f"{olmo[0]} ({model_type} has none; OLMo 2's pieces export as olmo2: "
                    "RoPE, RMSNorm on each sublayer's output, QK-norm over whole projections)"
                )
            _check_qk_norm_kind(cfg, model_type)
            pos = cfg.position
            if pos.nope_layers and model_type not in SMOLLM3_TYPES:
                raise unrepresentable(
                    f"position.nope_layers ({model_type} rotates every layer; NoPE layers "
                    f"export as {' or '.join(SMOLLM3_TYPES)}: RoPE, RMSNorm, gated feed-forward)"
                )
            if pos.rope_scaling == "longrope" and model_type not in LONGROPE_TYPES:
                raise unrepresentable(
                    f"position.rope_scaling='longrope' ({model_type} has no LongRoPE; it "
                    f"exports as {' or '.join(LONGROPE_TYPES)}: dense feed-forwards, no biases)"
                )
            if pos.rope_fraction != 1.0 and model_type not in PARTIAL_ROTARY_TYPES:
                raise unrepresentable(
                    f"position.rope_fraction={pos.rope_fraction} ({model_type} rotates whole "
                    f"heads; a partial rotation exports as {' or '.join(PARTIAL_ROTARY_TYPES)})"
                )
            if (
                cfg.arch == "decoder"
                and cfg.final_logits_bias
                and model_type not in HEAD_BIAS_TYPES
            ):
                raise unrepresentable(
                    f"final_logits_bias ({model_type}'s head has no bias; a biased head exports "
                    f"as {' or '.join(HEAD_BIAS_TYPES)}: RoPE, LayerNorm, parallel blocks with one "
                    "norm, an MLP)"
                )
            if cfg.arch == "decoder" and cfg.embedding_norm and model_type not in ("bloom",):
                raise unrepresentable(
                    f"embedding_norm ({model_type} has no norm on its embeddings; a decoder "
                    "with one exports as bloom: ALiBi, LayerNorm, an MLP, pre-norm blocks)"
                )
            if pos.kind == "alibi" and model_type not in ALIBI_TYPES:
                raise unrepresentable(
                    f"position.kind='alibi' ({model_type} has no ALiBi; ALiBi decoders export "
                    f"as {' or '.join(ALIBI_TYPES)}: LayerNorm, an MLP)"
                )
            if cfg.attention.clip_qkv is not None and model_type not in CLIP_QKV_TYPES:
                raise unrepresentable(
                    f"attention.clip_qkv ({model_type} does not clamp its projections; clamped "
                    f"ones export as {' or '.join(CLIP_QKV_TYPES)}: ALiBi, LayerNorm, an MLP)"
                )
            if any(local_layers(cfg)) and model_type not in WINDOWED_TYPES:
                raise unrepresentable(
                    f"attention.sliding_window ({model_type} attends to every position; "
                    f"windows export as {' or '.join(WINDOWED_TYPES)})"
                )
            return family, model_type
    if cfg.arch != "decoder":
        raise unrepresentable(f"arch={cfg.arch!r}")
    if cfg.norm.placement == "post":
        raise unrepresentable(
            "post-norm blocks (supported decoders are pre-norm, sandwich or post_sublayer; "
            "post-norm ones export as opt with learned positions)"
        )
    if cfg.norm.placement == "sandwich":
        raise unrepresentable(
            "norm.placement='sandwich' (Gemma's: exports as gemma2 or gemma3_text only)"
        )
    if cfg.norm.placement == "post_sublayer":
        raise unrepresentable("norm.placement='post_sublayer' (OLMo 2's: exports as olmo2 only)")
    if cfg.norm.placement == "parallel":
        raise unrepresentable(
            "norm.placement='parallel' (GPT-NeoX's: exports as gpt_neox only, or with grouped "
            "key/value heads as falcon: RoPE, LayerNorm, an MLP feed-forward)"
        )
    if cfg.norm.placement == "parallel_shared":
        raise unrepresentable(
            "norm.placement='parallel_shared' (Phi's, GPT-J's, Falcon's and Cohere's: exports as "
            "phi, gptj, falcon or cohere only: RoPE, LayerNorm, an MLP (phi, gptj, falcon) or a "
            "gated feed-forward (cohere)"
        )
    if cfg.attention.kind not in ("mha", "mla", "dsa"):
        raise unrepresentable(f"attention.kind={cfg.attention.kind!r}")
    raise unrepresentable(
        f"position.kind={cfg.position.kind!r} (use 'learned' or 'rope', or 'alibi' with "
        "LayerNorm and an MLP)"
    )


def hf_model_type(cfg: ModelConfig) -> str:
    """The Hugging Face ``model_type`` that :func:`save_hf` writes ``cfg`` as.

    The families are tried in ``registry.FAMILIES``' order, each taking the configs only it
    holds. By arch: encoder -> ``t5`` (T5's relative position bias: T5EncoderModel), else
    ``roberta`` (positions past a padding id or RoBERTa's classification head), else
    ``modernbert`` (its pieces: RoPE, gated FFN, pre-norm, ...), else ``bert``; seq2seq ->
    ``t5`` or ``umt5`` (a relative position bias, a table in every layer for umt5),
    ``bart`` or ``mbart`` (learned positions: post-norm or pre-norm blocks), else
    ``marian``; vit -> ``vit``. Decoders: MLA -> ``deepseek_v2`` (DeepSeek-V2 router) or
    ``deepseek_v3``; DSA -> ``deepseek_v32``;
    learned positions + LayerNorm + MLP -> ``gpt_bigcode`` with one key/value head
    (multi-query, pre-norm blocks), else ``opt`` in post-norm blocks or with ReLU, else
    ``gpt2``; RoPE + RMSNorm + gated FFN -> ``qwen3``
    with QK-norm, ``qwen2`` when q/k/v have biases and nothing else does, ``mistral`` with a
    sliding window and no biases, else ``llama`` (missing biases are written as zeros),
    and with LongRoPE or a partial rotation ``phi3`` (no biases); RoPE + LayerNorm + MLP ->
    ``gpt_neox`` in parallel blocks with two norms or with a partial rotation, ``falcon``
    in parallel blocks with one shared norm (whole heads rotated, no head bias) or with two
    and grouped key/value heads, ``gptj`` in one-norm blocks of GPT-J's own layout
    (interleaved pairs, no attention biases), ``phi`` in the other one-norm blocks (a partial
    rotation or a head bias, ``final_logits_bias``), ``persimmon`` in pre-norm blocks with one
    key/value head per query head and the squared ReLU or a LayerNorm QK-norm the heads share,
    else ``starcoder2``; a unit-offset LayerNorm (``norm.kind=layernorm1p``) -> ``nemotron``;
    ALiBi + LayerNorm + MLP -> ``bloom`` with the bias added after the scale (pre-norm blocks,
    a norm on the embeddings), ``mpt`` without the embeddings' norm (no biases, an exact
    GELU), ``falcon`` with the bias scaled with q . k (Falcon-RW's);
    with a mixture of experts and a gated shared expert -> ``qwen2_moe``;
    with a mixture of experts (softmax router, no shared experts) -> ``gpt_oss`` with sink
    logits and clamped SwiGLU experts (their router and expert biases written as zeros where
    the model has none), else ``qwen3_moe`` with QK-norm, else ``mixtral`` (experts on every
    layer, top-k weights renormalised); with Gemma's pieces (norms of weight 1 + w, scaled
    embeddings, a softmax scale of its own, logit soft-capping, a second RoPE base for
    local layers) -> ``gemma3_text`` with QK-norm or the second base, else ``gemma2`` with
    sandwich norms, else ``gemma``; with OLMo 2's pieces (an RMSNorm on each sublayer's
    output and none before it, QK-norm over the whole query and key projections) ->
    ``olmo2``; with NoPE layers (``position.nope_layers``) -> ``smollm3``; with Granite's
    multipliers (``embedding_multiplier``, ``residual_multiplier``, ``logit_divisor``), or
    LLaMA-shaped with a softmax scale (``attention.scale``) and none of Gemma's other
    pieces -> ``granite``; with a logit scale (``logit_scale``), or in parallel blocks of one
    norm with a gated feed-forward -> ``cohere``."""
    return _export_family(cfg)[1]


def config_to_hf(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The ``config.json`` dict :func:`save_hf` writes for ``cfg`` (see :func:`hf_model_type`)."""
    family, model_type = _export_family(cfg)
    return _hf_config(cfg, family, model_type, dtype)


def _hf_config(cfg: ModelConfig, family: Family, model_type: str, dtype: torch.dtype) -> dict:
    """The family's config.json; a warning where it leaves out the Switch balance loss
    (a training setting: the weights and logits export all the same)."""
    hf = family.config_to_hf(cfg, model_type, dtype)
    coef = cfg.ffn.switch_aux_loss_coef
    moe = any(cfg.ffn.moe_layer(i) for i in range(cfg.n_layers))
    if moe and coef > 0 and "router_aux_loss_coef" not in hf:
        warnings.warn(
            f"ffn.switch_aux_loss_coef={coef} is not written: {model_type} has no Switch "
            "balance loss (Mixtral, Qwen2-MoE, Qwen3-MoE and GPT-OSS have); training it with "
            "transformers leaves it out",
            stacklevel=3,
        )
    return hf


def _aliases(model: nn.Module) -> set[str]:
    """Names of parameters that are another parameter (tied heads): loaded once, under the
    first name."""
    every = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return every - {name for name, _ in model.named_parameters()}


def load_hf(
    path: str | Path,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> nn.Module:
    """Load a Hugging Face checkpoint directory of any supported family (see
    :data:`SUPPORTED_MODEL_TYPES`), picked by config.json's ``model_type``.

    Returns the attnlab model of its config's ``arch`` (:class:`DecoderLM` for GPT-2,
    LLaMA, Mistral, Qwen2(-MoE), Qwen3(-MoE), Mixtral, GPT-OSS, Gemma 1/2/3, OLMo 2, Phi-3,
    GPT-NeoX, Phi, GPT-J, Falcon, StarCoder2, Granite, Cohere, OPT, DeepSeek-V2/V3/V3.2;
    ``EncoderModel`` for BERT, RoBERTa, ModernBERT and T5's encoder (T5EncoderModel);
    ``Seq2SeqModel`` for Marian, BART, mBART, T5 and mT5, ``VisionTransformer`` for ViT) in
    eval mode, as ``from_pretrained`` does (with the generation settings a family maps, e.g.
    Marian's blocked pad token, from generation_config.json or else config.json, as
    transformers reads them). ``dtype`` defaults to float32 whatever the checkpoint stores;
    ``device`` defaults to the CPU. The model is built on the meta device and each
    parameter is allocated once, in ``dtype`` on ``device``, and read from the files:
    loading needs about the memory of the loaded model, not twice it."""
    path = Path(path)
    hf_config = with_generation_config(path, read_config(path))
    hf_config = with_preprocessor_config(path, hf_config)
    cfg = config_from_hf(hf_config)
    family, _ = lookup(hf_config)
    rename = family.rename or (lambda name: name)
    files: dict[str, tuple[SafetensorsFile, str]] = {}  # mapped name -> (file, stored name)
    for file in weight_files(path):
        try:
            opened = SafetensorsFile(file)
        except (WeightsFileError, OSError) as e:
            raise HFCheckpointError(str(e)) from None
        for name in opened.keys():
            mapped = rename(name)
            if mapped in files:  # two names for one tensor (old and new), or shards overlap
                other, stored = files[mapped]
                raise HFCheckpointError(
                    f"{path}: tensor {mapped!r} is stored twice: {stored!r} in {other.path.name} "
                    f"and {name!r} in {file.name}"
                )
            files[mapped] = (opened, name)
    cfg = family.config_for_weights(cfg, files.keys())

    def shape(name: str) -> tuple[int, ...]:
        file, stored = files[name]
        return file.shape(stored)

    def read_into(part: Part, dest: torch.Tensor) -> None:
        file, stored = files[part.name]
        want = file.shape(stored)
        if part.transposed:
            dest = dest.transpose(-2, -1)
        if part.interleaved:  # stored a0 b0 a1 b1 ...: dest's halves as (..., n, 2) pairs
            dest = dest.unflatten(-1, (2, dest.shape[-1] // 2)).transpose(-2, -1)
            file.read_into(stored, dest, reshaped=True)
            return
        if part.per_head is not None:  # stored (heads, parts, d_h, ...): dest's (parts, heads, ...)
            parts, heads = part.per_head
            dest = dest.unflatten(0, (parts, heads, -1)).transpose(0, 1)
            file.read_into(stored, dest, reshaped=True)
            return
        if part.grouped is not None:  # stored (groups, queries + 2, d_h, ...): see Part
            groups, queries = part.grouped
            d_h = dest.shape[0] // (groups * (queries + 2))
            q, k, v = dest.split((groups * queries * d_h, groups * d_h, groups * d_h))
            row = 0  # each group's query heads, key head, value head: contiguous rows each
            for g in range(groups):
                for into in (q[g * queries * d_h :][: queries * d_h], k[g * d_h :][:d_h],
                             v[g * d_h :][:d_h]):  # fmt: skip
                    file.read_into(stored, into, rows=(row, row + into.shape[0]))
                    row += into.shape[0]
            return
        if part.rows is not None:  # a slice of the stored rows (OPT's positions past 2)
            file.read_into(stored, dest, rows=part.rows)
            return
        # a stored shape with extra unit dimensions (checked by the plan) is read as dest's
        file.read_into(stored, dest if tuple(dest.shape) == want else dest.view(want))

    with parameters_on_meta():
        model = build_model(cfg)
    # strict: every attnlab parameter must come from the checkpoint (tied ones are shared).
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    for alias in _aliases(model):
        del expected[alias]
    src = Source({name: shape(name) for name in files}, family.ignored, expected)
    plan = family.weights_to_attnlab(src, cfg)
    src.check()
    for a, b in src.must_equal:
        (fa, na), (fb, nb) = files[a], files[b]
        if not torch.equal(fa.read(na), fb.read(nb)):
            raise HFCheckpointError(
                f"config.json says tie_word_embeddings=true but {a} differs from {b}; set "
                "tie_word_embeddings to false in config.json"
            )
    if set(plan) != set(expected):  # a mapping bug, not a user error
        raise RuntimeError(f"interop mapping mismatch: {sorted(set(plan) ^ set(expected))}")

    def fill(name: str, dest: torch.Tensor) -> None:
        parts = plan[name]
        if len(parts) == 1:
            read_into(parts[0], dest)
            return
        # Stacked along the first dimension; parts of lower rank (one per expert) along the
        # leading dimensions flattened (a view: such parameters are contiguous).
        first = shape(parts[0].name)
        rows_of = dest.flatten(0, dest.dim() - len(first))
        row = 0
        for part in parts:
            if part.rows is not None:  # (a slice of its rows)
                rows = part.rows[1] - part.rows[0]
            else:
                rows = shape(part.name)[-1 if part.transposed else 0]
            read_into(part, rows_of[row : row + rows])
            row += rows

    # Floating parameters get dtype (float32 by default); the RoPE frequencies stay float32.
    materialize(model, fill, dtype=dtype or torch.float32, device=device)
    return model.eval()


def save_hf(model: nn.Module, path: str | Path) -> None:
    """Write ``config.json`` and ``model.safetensors`` that transformers'
    ``from_pretrained`` loads (``AutoModelForCausalLM`` for decoders, the family's class
    otherwise) with the same logits; the family follows the model's config. The index and
    shards of a sharded checkpoint already in ``path`` are removed.

    A tied head is not stored (transformers re-ties it). Interleaved RoPE q/k rows are
    reordered to the split layout where the family rotates split halves. Raises
    :class:`HFCheckpointError` for configs no supported architecture represents (see
    :func:`hf_model_type`), :class:`~attnlab.models.loadable.UntiedWeightsError` for a model
    whose config ties parameters that are not one tensor (before writing anything)."""
    check_tied(model)
    cfg = model.cfg
    family, model_type = _export_family(cfg)
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    hf_config = _hf_config(cfg, family, model_type, dtype)
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    tensors = family.weights_from_attnlab(sd, cfg, model_type)
    write_folder(Path(path), tensors, hf_config, family.extra_files(cfg))
