"""Linear (kernelised) attention, Katharopoulos et al. 2020: softmax(q.k) replaced by
phi(q).phi(k) with phi = elu + 1, so causal attention is a running sum (an RNN) and
decoding keeps a constant-size state instead of a growing KV cache. The maths is in
:mod:`attnlab.functional.linear_attention`.

Shapes: b batch, t length, d d_model, h heads, h_kv key/value heads, d_h head dim.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnlab.cache import Cache, LayerCache, LinearState
from attnlab.config import AttentionConfig
from attnlab.functional.linear_attention import causal_linear_attention, elu_feature_map
from attnlab.nn.attention import split_heads
from attnlab.nn.linear import Linear
from attnlab.nn.registry import register_attention
from attnlab.nn.rope import RopeTables, RotaryEmbedding


@register_attention("linear")
class LinearAttention(nn.Module):
    """Causal linear self-attention with n_kv_heads (the state is kept per key/value head).
    With RoPE the numerator's features are rotated (RoFormer section 3.3). Masks: key
    padding only (b, 1, 1, t); sliding windows and sinks do not apply (config rejects them)."""

    chunk_size = 64  # tokens per chunk of the training / prefill form

    def __init__(
        self,
        d_model: int,
        cfg: AttentionConfig,
        *,
        causal: bool = True,
        cross: bool = False,
        context_dim: int | None = None,
        rope: RotaryEmbedding | None = None,
        resid_dropout: float = 0.0,
    ):
        super().__init__()
        if cross or not causal:
            raise ValueError("linear attention is implemented for causal self-attention only")
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.kv_heads
        self.head_dim = cfg.head_dim or d_model // cfg.n_heads
        self.q_dim, self.kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.qkv = Linear(d_model, self.q_dim + 2 * self.kv_dim, bias=cfg.qkv_bias)  # [q; k; v]
        self.out = Linear(self.q_dim, d_model, bias=cfg.out_bias)
        self.out.residual_projection = True
        self.rope = rope
        self.uses_rope = rope is not None
        self.window = None  # full causal attention (for code that inspects layers)
        self.resid_dropout = nn.Dropout(resid_dropout)

    def new_cache_entry(self, cache: Cache) -> LayerCache:
        """A recurrent state per head (the running sum of key-value outer products): constant
        size, however long the sequence."""
        return LinearState(cache, self.n_kv_heads, self.head_dim)

    def _heads(self, x: Tensor, n: int) -> Tensor:
        return split_heads(x, n, self.head_dim)  # (b, n, t, d_h)

    def forward(
        self,
        x: Tensor,
        *,
        positions: Tensor | None = None,
        rope: RopeTables | None = None,
        cache: LayerCache | None = None,
        mask: Tensor | None = None,
        context: Tensor | None = None,
    ) -> Tensor:
        """x (b, t, d); mask: key padding (b, 1, 1, t) bool or None (a cache supplies it)."""
        if context is not None:
            raise ValueError("linear attention is self-attention: context must be None")
        b, t, _ = x.shape
        q, k, v = self.qkv(x).split((self.q_dim, self.kv_dim, self.kv_dim), dim=-1)
        q = elu_feature_map(self._heads(q, self.n_heads))  # (b, h, t, d_h)
        k = elu_feature_map(self._heads(k, self.n_kv_heads))  # (b, h_kv, t, d_h)
        v = self._heads(v, self.n_kv_heads)
        if cache is not None:
            valid = cache.valid()  # (b, t)
        elif mask is not None:
            if mask.dtype != torch.bool or mask.shape[1:3] != (1, 1) or mask.shape[-1] != t:
                raise ValueError("linear attention takes a key-padding mask (b, 1, 1, t) only")
            valid = mask[:, 0, 0, :].expand(b, t)
        else:
            valid = None
        if valid is not None:  # pads add nothing to the state
            keep = valid[:, None, :, None].to(k.dtype)  # (b, 1, t, 1)
            k, v = k * keep, v * keep
        q_num, k_num = q, k
        if self.uses_rope:
            if rope is None:
                if positions is None:
                    raise ValueError("RoPE attention needs positions")
                rope = self.rope.tables(positions)
            q_num, k_num = rope.rotate(q), rope.rotate(k)
        state = (cache.S, cache.z) if cache is not None else None
        y, new_state = causal_linear_attention(
            q_num, k_num, v, q, k, state, chunk_size=self.chunk_size
        )  # (b, h, t, d_h)
        if cache is not None:
            cache.update(*new_state)
        y = y.transpose(1, 2).reshape(b, t, self.q_dim)  # (b, t, h * d_h)
        return self.resid_dropout(self.out(y))
