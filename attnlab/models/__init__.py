"""Architectures, one file each, registered by their config's ``arch``."""

from attnlab.models.build import MODELS, build_model, register_model
from attnlab.models.decoder import DecoderLM
from attnlab.models.encoder import EncoderConfig, EncoderModel
from attnlab.models.outputs import LMOutput, ModelOutput
from attnlab.models.rnn import GRUSeq2Seq, RNNSeq2SeqConfig
from attnlab.models.seq2seq import Seq2SeqConfig, Seq2SeqModel
from attnlab.models.vit import VisionTransformer, ViTConfig
from attnlab.models.xl import TransformerXL, XLConfig

register_model("decoder")(DecoderLM)

__all__ = [
    "MODELS",
    "DecoderLM",
    "EncoderConfig",
    "EncoderModel",
    "GRUSeq2Seq",
    "LMOutput",
    "ModelOutput",
    "RNNSeq2SeqConfig",
    "Seq2SeqConfig",
    "Seq2SeqModel",
    "ViTConfig",
    "VisionTransformer",
    "TransformerXL",
    "XLConfig",
    "build_model",
    "register_model",
]
