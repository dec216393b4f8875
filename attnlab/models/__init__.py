"""Architectures, one file each."""

from attnlab.models.build import build_model
from attnlab.models.decoder import DecoderLM, LMOutput

__all__ = ["DecoderLM", "LMOutput", "build_model"]
