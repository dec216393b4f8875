"""attnlab: attention and transformers, each verified against an independent reference."""

from attnlab.config import (
    AttentionConfig,
    ConfigError,
    FFNConfig,
    ModelConfig,
    NormConfig,
    PositionConfig,
)
from attnlab.models import DecoderLM, build_model
from attnlab.presets import get_preset, list_presets

__version__ = "0.1.0"

__all__ = [
    "AttentionConfig",
    "ConfigError",
    "DecoderLM",
    "FFNConfig",
    "ModelConfig",
    "NormConfig",
    "PositionConfig",
    "build_model",
    "get_preset",
    "list_presets",
]
