"""Hugging Face checkpoint import and export (GPT-2, LLaMA, Mistral, Qwen2).

A Hugging Face model directory holds ``config.json`` and safetensors weights (one
``model.safetensors`` or shards listed in ``model.safetensors.index.json``). This package
maps both onto attnlab's :class:`~attnlab.config.ModelConfig` and :class:`DecoderLM` names,
and back.

    io.py        the shared reader/writer: folders, safetensors, config.json, mapping helpers
    gpt2.py      GPT-2
    llama.py     LLaMA and its layout variants Mistral and Qwen2
    registry.py  model_type / architecture -> family (a new family: a module + one entry)
    convert.py   load_hf, save_hf, config_from_hf, config_to_hf, hf_model_type
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
