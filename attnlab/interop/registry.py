"""Every supported Hugging Face family, looked up by ``model_type`` or architecture class.

Adding a family: write ``attnlab/interop/<name>.py`` defining a
:class:`~attnlab.interop.io.Family` (see gpt2.py for the explicit mapping, vit.py for the
declarative one) and add it to ``FAMILIES`` below. Export tries the families in this order
(each family's ``exports`` picks configs by ``arch``, attention kind and positions).
"""

from __future__ import annotations

from typing import Any

from attnlab.interop import (
    albert,
    bart,
    bert,
    bloom,
    cohere,
    deberta_v2,
    deepseek,
    deepseek_v32,
    distilbert,
    electra,
    falcon,
    gemma,
    gpt2,
    gpt_bigcode,
    gpt_neox,
    gpt_oss,
    gptj,
    granite,
    llama,
    m2m_100,
    marian,
    mixtral,
    modernbert,
    mpt,
    nemotron,
    olmo2,
    opt,
    pegasus,
    persimmon,
    phi,
    phi3,
    qwen2_moe,
    qwen3_moe,
    roberta,
    smollm3,
    stablelm,
    starcoder2,
    t5,
    vit,
)
from attnlab.interop.io import Family, HFCheckpointError

FAMILIES: tuple[Family, ...] = (
    # first: it takes every decoder with a logit scale, or a parallel block of one LayerNorm
    # without bias and a gated feed-forward rotating whole heads (Cohere's), which no other
    # layout holds, and names what else it lacks
    cohere.FAMILY,
    # next: the ALiBi decoders whose bias is added after the scale in pre-norm blocks with no
    # norm on the embeddings, their own softmax scale included (which Gemma's would take)
    mpt.FAMILY,
    # next: it takes every decoder with Granite's multipliers (embeddings, residual
    # branches, logits), which the other layouts would drop, and the LLaMA-shaped ones with
    # a softmax scale of their own that Gemma's layouts would otherwise take
    granite.FAMILY,
    # next: it takes every decoder with a unit-offset LayerNorm (Nemotron's LayerNorm1P),
    # which no other layout holds, and names what else it lacks
    nemotron.FAMILY,
    # next: it takes every decoder with Gemma's own pieces (sandwich norms, scaled
    # embeddings, ...), which the other families' layouts would drop
    gemma.FAMILY,
    # next: every decoder with OLMo 2's pieces (norms on the sublayers' outputs, QK-norm
    # over whole projections), which LLaMA's layout would drop
    olmo2.FAMILY,
    # next: every decoder with NoPE layers (SmolLM3's), which the other layouts would rotate
    smollm3.FAMILY,
    # before GPT-NeoX and StarCoder2: it takes the pre-norm RoPE decoders with LayerNorm and
    # an MLP whose activation is the squared ReLU, or with a LayerNorm QK-norm every head
    # shares, which their layouts lack
    persimmon.FAMILY,
    # the ALiBi decoders whose bias is added after the scale, in pre-norm blocks, with a
    # norm on the embeddings (MPT's take those without; Falcon's those whose bias is scaled
    # with q . k, Falcon-RW's)
    bloom.FAMILY,
    # before GPT-NeoX: it takes the RoPE decoders with LayerNorm and an MLP in parallel blocks
    # with one shared norm, or two with grouped key/value heads, which GPT-NeoX's layout lacks
    falcon.FAMILY,
    # before Phi-3 and LLaMA: it takes the RoPE decoders with LayerNorm and an MLP in parallel
    # blocks or with a partial rotation, which their layouts (RMSNorm, gated FFN) would refuse
    gpt_neox.FAMILY,
    # the RoPE decoders with LayerNorm and an MLP in parallel blocks with one shared norm:
    # GPT-J's own layout (interleaved pairs, no attention biases, ...) first, Phi the others
    gptj.FAMILY,
    phi.FAMILY,
    # before Phi-3 and LLaMA: it takes the RoPE decoders with LayerNorm and a gated
    # feed-forward in pre-norm blocks, which their layouts (RMSNorm) would refuse, and those
    # in parallel blocks of one norm that Cohere's layout cannot hold (biased LayerNorms, a
    # partial rotation)
    stablelm.FAMILY,
    phi3.FAMILY,  # before LLaMA: it takes the dense decoders with LongRoPE or partial RoPE
    # before LLaMA: it takes the RoPE decoders with LayerNorm and a non-gated MLP
    starcoder2.FAMILY,
    # before OPT and GPT-2: it takes the pre-norm learned-position decoders with fewer
    # key/value heads than query heads (multi-query), which their layouts lack
    gpt_bigcode.FAMILY,
    # before GPT-2: it takes the learned-position decoders in OPT's layout, post-norm blocks
    # or a ReLU MLP, which GPT-2's (pre-norm, GELU) would not be
    opt.FAMILY,
    gpt2.FAMILY,
    llama.FAMILY,
    gpt_oss.FAMILY,  # before Qwen3-MoE: it takes the mixtures of experts with its own pieces
    qwen2_moe.FAMILY,  # before Qwen3-MoE and Mixtral: the gated shared experts are its own
    qwen3_moe.FAMILY,
    mixtral.FAMILY,
    deepseek.FAMILY,
    deepseek_v32.FAMILY,
    # before the other encoders: it takes the encoders with ELECTRA's discriminator head or
    # classification head (GELU), which no other layout holds, and names what else they lack
    electra.FAMILY,
    # before the other encoders: it takes the encoders with disentangled attention or
    # DeBERTa's ContextPooler, which no other layout holds
    deberta_v2.FAMILY,
    # before RoBERTa, ModernBERT and BERT: it takes the encoders (and encoder–decoders) with
    # relative position bias, which their layouts (and Marian's) would refuse
    t5.FAMILY,
    # before RoBERTa, ModernBERT, DistilBERT and BERT: it takes every encoder with factorised
    # embeddings or shared layers (ALBERT's), which their layouts would drop
    albert.FAMILY,
    # before ModernBERT and BERT: it takes every encoder with RoBERTa's pieces (positions
    # past a padding id, its classification head), which their layouts would drop
    roberta.FAMILY,
    # before BERT: it takes every encoder with ModernBERT's pieces (RoPE, GeGLU, pre-norm,
    # its heads' transform, ...), which BERT's layout would drop
    modernbert.FAMILY,
    # before BERT: the encoders without token types (BERT's layout has them; ModernBERT's
    # have none and go to it first) or with DistilBERT's sequence head (ReLU, not tanh)
    distilbert.FAMILY,
    bert.FAMILY,
    # before Marian: it takes the encoder–decoders with learned positions, which Marian's
    # layout (sinusoids) would refuse
    bart.FAMILY,
    # before Pegasus and Marian: it takes the encoder–decoders with M2M100's sinusoids
    # (counted past the padding id, or tensor2tensor's frequencies), which theirs would refuse
    m2m_100.FAMILY,
    # before Marian: it takes the other pre-norm encoder–decoders with sinusoids, which
    # Marian's layout (post-norm) would refuse
    pegasus.FAMILY,
    marian.FAMILY,
    vit.FAMILY,
)

BY_MODEL_TYPE: dict[str, Family] = {t: f for f in FAMILIES for t in f.architectures}
BY_ARCHITECTURE: dict[str, str] = {
    arch: t for f in FAMILIES for t, archs in f.architectures.items() for arch in archs
}
SUPPORTED_MODEL_TYPES = tuple(BY_MODEL_TYPE)
ARCHITECTURES = {t: f.architectures[t] for t, f in BY_MODEL_TYPE.items()}


def lookup(hf: dict[str, Any]) -> tuple[Family, str]:
    """(family, model_type) of a config.json: by ``model_type``, or, where that is absent,
    by its ``architectures`` entry. Every listed architecture must belong to the type."""
    archs = hf.get("architectures") or []
    model_type = hf.get("model_type")
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise HFCheckpointError(f"config.json architectures must be a list of names, got {archs!r}")
    if model_type is not None and not isinstance(model_type, str):
        raise HFCheckpointError(f"config.json model_type must be a string, got {model_type!r}")
    if model_type is None and archs and archs[0] in BY_ARCHITECTURE:
        model_type = BY_ARCHITECTURE[archs[0]]
    if model_type not in BY_MODEL_TYPE:
        raise HFCheckpointError(
            f"model_type {model_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    for arch in archs:
        if arch not in ARCHITECTURES[model_type]:
            raise HFCheckpointError(
                f"architecture {arch!r} is not supported; for model_type {model_type!r} use "
                f"{' or '.join(ARCHITECTURES[model_type])}"
            )
    return BY_MODEL_TYPE[model_type], model_type
