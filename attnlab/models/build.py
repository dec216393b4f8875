"""Build a model from its config."""

from __future__ import annotations

from attnlab.config import ModelConfig
from attnlab.models.decoder import DecoderLM


def build_model(cfg: ModelConfig) -> DecoderLM:
    cfg.validate()
    return DecoderLM(cfg)
