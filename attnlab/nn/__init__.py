"""Parameterised building blocks (torch.nn-style modules)."""

from attnlab.nn.attention import MultiHeadAttention
from attnlab.nn.block import TransformerBlock
from attnlab.nn.embedding import LearnedPositionalEmbedding, SinusoidalPositionalEmbedding
from attnlab.nn.feedforward import MLP, GatedFFN, build_ffn
from attnlab.nn.linear_attention import LinearAttention
from attnlab.nn.mla import MultiHeadLatentAttention
from attnlab.nn.norm import HeadNorm, RMSNorm, build_norm
from attnlab.nn.parallel_block import ParallelTransformerBlock
from attnlab.nn.rope import RotaryEmbedding
from attnlab.nn.sparse import DeepSeekSparseAttention, LightningIndexer, NativeSparseAttention

__all__ = [
    "MLP",
    "DeepSeekSparseAttention",
    "GatedFFN",
    "HeadNorm",
    "LearnedPositionalEmbedding",
    "LightningIndexer",
    "LinearAttention",
    "MultiHeadAttention",
    "MultiHeadLatentAttention",
    "NativeSparseAttention",
    "ParallelTransformerBlock",
    "RMSNorm",
    "RotaryEmbedding",
    "SinusoidalPositionalEmbedding",
    "TransformerBlock",
    "build_ffn",
    "build_norm",
]
