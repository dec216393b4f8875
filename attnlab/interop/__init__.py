"""Hugging Face checkpoint import and export: GPT-2, LLaMA, Mistral, Qwen2, Qwen3,
Qwen2-MoE, Qwen3-MoE, Mixtral, GPT-OSS, Gemma, Gemma 2, Gemma 3 (text), OLMo 2, SmolLM3,
Phi-3, GPT-NeoX (Pythia), Phi-1/1.5/2, GPT-J, Falcon (Falcon-RW), BLOOM, StarCoder2, Granite,
Cohere, StableLM, OPT, GPT-BigCode (SantaCoder, StarCoder), DeepSeek-V2/V3/V3.2, BERT, RoBERTa,
XLM-RoBERTa, ModernBERT, MarianMT, BART, mBART, T5, ViT.

A Hugging Face model directory holds ``config.json`` and safetensors weights (one
``model.safetensors`` or shards listed in ``model.safetensors.index.json``). This package
maps both onto attnlab configs and models (``DecoderLM``, ``EncoderModel``,
``Seq2SeqModel``, ``VisionTransformer``), and back: ``load_hf(path)``, ``save_hf(model,
path)``, the family picked by config.json's ``model_type`` or the model's config.

    io.py            the shared reader/writer: folders, safetensors, config.json, mapping helpers
    gpt2.py          GPT-2
    opt.py           OPT: learned positions past 2 offset rows, pre- or post-norm blocks, ReLU MLP
    gpt_bigcode.py   GPT-BigCode (SantaCoder, StarCoder): GPT-2 with multi-query attention
    llama.py         LLaMA and its layout variants Mistral, Qwen2 and Qwen3
    gpt_oss.py       GPT-OSS: sink logits, local/global layers, biased clamped-SwiGLU experts
    gemma.py         Gemma, Gemma 2, Gemma 3 (text): norms of weight 1 + w, scaled embeddings,
                     sandwich norms, logit soft-capping, 2 RoPE bases (Gemma 3)
    olmo2.py         OLMo 2: norms on the sublayers' outputs, QK-norm over whole projections
    smollm3.py       SmolLM3: LLaMA's layout with NoPE layers (no RoPE on some layers)
    phi3.py          Phi-3: LLaMA's layout with q/k/v and gate/up fused, LongRoPE, partial RoPE
    gpt_neox.py      GPT-NeoX, Pythia: parallel attention and MLP, per-head fused q/k/v,
                     partial RoPE, LayerNorm, GELU MLP
    phi.py           Phi-1, Phi-1.5, Phi-2: parallel attention and MLP on one shared LayerNorm,
                     partial RoPE, biases everywhere, a biased head
    gptj.py          GPT-J: Phi's block with interleaved partial RoPE, no attention biases
    falcon.py        Falcon: parallel blocks with one shared norm (7B) or two (40B, 180B),
                     MQA / grouped fused q/k/v, or sequential blocks; LayerNorm, GELU MLP;
                     Falcon-RW's ALiBi (scaled with q . k, rounded to bfloat16)
    bloom.py         BLOOM: ALiBi, a LayerNorm on the embeddings, per-head fused q/k/v,
                     pre-norm blocks, tanh-GELU MLP
    starcoder2.py    StarCoder2: LLaMA's attention with biased LayerNorms and a GELU MLP
    granite.py       Granite: LLaMA's layout with muP multipliers (embeddings, residual
                     branches, softmax scale, logits)
    cohere.py        Cohere (Command-R): LLaMA's names on parallel blocks of one bias-free
                     LayerNorm, interleaved RoPE, a logit scale
    qwen2_moe.py     Qwen2-MoE: Qwen2's attention with routed experts and a gated shared expert
    qwen3_moe.py     Qwen3-MoE: Qwen3's attention with mixture-of-experts feed-forwards
    mixtral.py       Mixtral: Mistral's attention with a mixture of experts in every layer
    deepseek.py      DeepSeek-V2 / V3 (multi-head latent attention, mixture of experts)
    deepseek_v32.py  DeepSeek-V3.2: V3 plus the lightning indexer (attention kind dsa)
    bert.py          BERT with its masked-LM, classification, token and QA heads
    modernbert.py    ModernBERT: BERT's heads on a pre-norm RoPE encoder with GeGLU, local
                     (bidirectional window) and global layers and 2 RoPE bases
    marian.py        MarianMT (encoder-decoder)
    bart.py          BART and mBART (encoder-decoders with learned positions, embedding norms)
    vit.py           ViT image classifiers
    registry.py      model_type / architecture -> family (a new family: a module + one entry)
    convert.py       load_hf, save_hf, config_from_hf, config_to_hf, hf_model_type
"""

from attnlab.interop.convert import config_from_hf, config_to_hf, hf_model_type, load_hf, save_hf
from attnlab.interop.io import HFCheckpointError
from attnlab.interop.registry import ARCHITECTURES, SUPPORTED_MODEL_TYPES

__all__ = [
    "ARCHITECTURES",
    "SUPPORTED_MODEL_TYPES",
    "HFCheckpointError",
    "config_from_hf",
    "config_to_hf",
    "hf_model_type",
    "load_hf",
    "save_hf",
]
