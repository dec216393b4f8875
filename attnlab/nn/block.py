"""Transformer block: self-attention, optional cross-attention, feed-forward, each with a
residual connection. Pre-norm (GPT-2, LLaMA): x + f(norm(x)). Post-norm (Vaswani et al.):
norm(x + f(x)). Shapes: (b, t, d) in and out."""

from __future__ import annotations

from torch import Tensor, nn

from attnlab.cache import LayerKV
from attnlab.config import ModelConfig
from attnlab.nn.attention import MultiHeadAttention
from attnlab.nn.feedforward import build_ffn
from attnlab.nn.norm import build_norm
from attnlab.nn.rope import RotaryEmbedding


class TransformerBlock(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        *,
        causal: bool = True,
        cross_attention: bool = False,
        rope: RotaryEmbedding | None = None,
    ):
        super().__init__()
        self.pre_norm = cfg.norm.placement == "pre"
        d = cfg.d_model
        self.attn_norm = build_norm(cfg.norm, d)
        self.attn = MultiHeadAttention(
            d, cfg.attention, causal=causal, rope=rope, resid_dropout=cfg.dropout
        )
        self.cross_norm = build_norm(cfg.norm, d) if cross_attention else None
        self.cross_attn = (
            MultiHeadAttention(d, cfg.attention, cross=True, resid_dropout=cfg.dropout)
            if cross_attention
            else None
        )
        self.ffn_norm = build_norm(cfg.norm, d)
        self.ffn = build_ffn(cfg.ffn, d, dropout=cfg.dropout)

    def _residual(self, x: Tensor, norm: nn.Module, f, **kw) -> Tensor:
        if self.pre_norm:
            return x + f(norm(x), **kw)
        return norm(x + f(x, **kw))

    def forward(
        self,
        x: Tensor,
        *,
        positions: Tensor | None = None,
        cache: LayerKV | None = None,
        mask: Tensor | None = None,
        context: Tensor | None = None,
        context_mask: Tensor | None = None,
    ) -> Tensor:
        x = self._residual(
            x, self.attn_norm, self.attn, positions=positions, cache=cache, mask=mask
        )
        if self.cross_attn is not None:
            x = self._residual(
                x, self.cross_norm, self.cross_attn, context=context, mask=context_mask
            )
        return self._residual(x, self.ffn_norm, self.ffn)
