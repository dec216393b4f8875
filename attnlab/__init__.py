"""attnlab: attention and transformers, each verified against an independent reference.

The top-level API: configs (:class:`ModelConfig` and its sections, :class:`RunConfig`),
presets (:func:`get_preset`, :func:`get_run_preset`), :func:`build_model`, the decoder
language model :class:`DecoderLM` and its decoding :class:`Cache`. Checkpoints:
``attnlab.training.load_checkpoint`` / ``save_checkpoint``; Hugging Face folders:
``attnlab.interop.load_hf`` / ``save_hf``.
"""

import os as _os

if _os.environ.get("ATTNLAB_MKL_ANY_CPU"):  # before anything imports torch
    from attnlab import mkl_any_cpu as _mkl_any_cpu  # (not imported otherwise: python -m)

    if _mkl_any_cpu.requested():
        _mkl_any_cpu.enable()

from attnlab.cache import Cache
from attnlab.config import (
    AttentionConfig,
    ConfigError,
    DataConfig,
    FFNConfig,
    ModelConfig,
    NormConfig,
    PositionConfig,
    RunConfig,
    TrainConfig,
)
from attnlab.models import DecoderLM, build_model
from attnlab.presets import get_preset, get_run_preset, list_presets, list_run_presets

__version__ = "0.1.0"

__all__ = [
    "AttentionConfig",
    "Cache",
    "ConfigError",
    "DataConfig",
    "DecoderLM",
    "FFNConfig",
    "ModelConfig",
    "NormConfig",
    "PositionConfig",
    "RunConfig",
    "TrainConfig",
    "build_model",
    "get_preset",
    "get_run_preset",
    "list_presets",
    "list_run_presets",
]
