"""Architectures, one file each, registered by their config's ``arch``."""

from attnlab.models.build import MODELS, build_model, register_model
from attnlab.models.decoder import DecoderLM
from attnlab.models.outputs import LMOutput, ModelOutput
from attnlab.models.xl import TransformerXL, XLConfig

register_model("decoder")(DecoderLM)

__all__ = [
    "MODELS",
    "DecoderLM",
    "LMOutput",
    "ModelOutput",
    "TransformerXL",
    "XLConfig",
    "build_model",
    "register_model",
]
