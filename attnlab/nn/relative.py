"""Transformer-XL relative positional attention (Dai et al. 2019, section 3.3).

For query i (at position m + i after m memory tokens) and key j, with R the sinusoidal
encoding of the distance m + i - j:

    A_ij = q_i^T k_j  +  q_i^T W_R R_{m+i-j}  +  u^T k_j  +  v^T W_R R_{m+i-j}
           (a) content   (b) content-position    (c) global   (d) global position
         = (q_i + u)^T k_j  +  (q_i + v)^T W_R R_{m+i-j}

Terms (b)+(d) are computed for every query against the s distances s-1, ..., 0 (one
(t, s) product instead of a (t, s, d) gather), then aligned by the relative shift. With
``clamp_len`` (the original code's), distances past it use R_clamp_len: a model evaluated
with a longer memory than it was trained with meets no encoding it never saw.

Shapes: b batch, t queries (the segment), m memory length, s = m + t keys, d d_model,
h heads, d_h head dim.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from attnlab.config import AttentionConfig
from attnlab.functional.softmax import compute_dtype, masked_softmax, score_operands, softmax_dtype
from attnlab.nn.embedding import angle_dtype
from attnlab.nn.linear import Linear


def relative_sinusoids(
    distances: Tensor, d_model: int, dtype: torch.dtype = torch.float32
) -> Tensor:
    """(n,) distances -> (n, d_model) encodings [sin(p w) ; cos(p w)], w_k = 10000^(-2k/d)
    (Transformer-XL's layout: all sines, then all cosines); float32, float64 for a ``dtype``
    of float64."""
    dtype = compute_dtype(dtype)
    wide = angle_dtype(dtype, distances.device)  # float64 angles: float32's grow off with p
    inv_freq = torch.exp(
        torch.arange(0, d_model, 2, dtype=wide, device=distances.device)
        * (-math.log(10000.0) / d_model)
    )  # (d/2,)
    angles = distances.to(wide)[:, None] * inv_freq[None, :]  # (n, d/2)
    return torch.cat((angles.sin(), angles.cos()), dim=-1).to(dtype)


def relative_encodings(
    s: int,
    d_model: int,
    *,
    clamp_len: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> Tensor:
    """(s, d_model) the encodings R of the distances s - 1, ..., 0 (the column order
    :func:`rel_shift` expects), each distance above ``clamp_len`` (None: none) replaced by
    ``clamp_len``, as the original's ``pos_seq.clamp_(max=clamp_len)``."""
    distances = torch.arange(s - 1, -1, -1, device=device)  # (s,) s - 1, ..., 0
    if clamp_len is not None:
        distances = distances.clamp(max=clamp_len)
    return relative_sinusoids(distances, d_model, dtype)


def rel_shift(x: Tensor) -> Tensor:
    """(..., t, s) scores whose column c belongs to distance s - 1 - c -> (..., t, s) whose
    entry [i, j] belongs to distance (s - t + i) - j, for j <= s - t + i (the rest is
    garbage, masked by causality). The trick: pad a zero column on the left, read the
    buffer as (s + 1, t), drop the first row, read it back as (t, s)."""
    *lead, t, s = x.shape
    padded = torch.cat((x.new_zeros(*lead, t, 1), x), dim=-1)  # (..., t, s + 1)
    return padded.view(*lead, s + 1, t)[..., 1:, :].reshape(*lead, t, s)


class RelativeMultiHeadAttention(nn.Module):
    """Causal self-attention over [memory; segment] with relative positions (no absolute
    position anywhere, so memory from the previous segment stays valid)."""

    no_weight_decay = ("u", "v")  # biases, one per head: no weight decay (the optimizer)

    def __init__(self, d_model: int, cfg: AttentionConfig, *, resid_dropout: float = 0.0):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.head_dim or d_model // cfg.n_heads
        self.d_model = d_model
        inner = self.n_heads * self.head_dim
        self.q = Linear(d_model, inner, bias=cfg.qkv_bias)
        self.kv = Linear(d_model, 2 * inner, bias=cfg.qkv_bias)  # [k; v]
        self.r = Linear(d_model, inner, bias=False)  # W_R: position encodings -> keys
        self.u = nn.Parameter(torch.zeros(self.n_heads, self.head_dim))  # content bias
        self.v = nn.Parameter(torch.zeros(self.n_heads, self.head_dim))  # position bias
        self.out = Linear(inner, d_model, bias=cfg.out_bias)
        self.out.residual_projection = True
        self.attn_dropout = nn.Dropout(cfg.dropout)
        self.resid_dropout = nn.Dropout(resid_dropout)

    def _heads(self, x: Tensor) -> Tensor:
        b, n, _ = x.shape
        return x.view(b, n, self.n_heads, self.head_dim).transpose(1, 2)  # (b, h, n, d_h)

    def forward(
        self,
        x: Tensor,
        *,
        memory: Tensor | None = None,
        mask: Tensor | None = None,
        encodings: Tensor | None = None,
    ) -> Tensor:
        """x (b, t, d) the segment; memory (b, m, d) the previous segment's states (no
        gradient); mask: extra boolean mask broadcastable to (b, h, t, s); encodings (s, d):
        :func:`relative_encodings` of the s keys, which the model computes once per forward
        pass for all its layers (clamped as its config says); None: unclamped, computed
        here."""
        b, t, _ = x.shape
        context = x if memory is None else torch.cat((memory, x), dim=1)  # (b, s, d)
        s = context.shape[1]
        q = self._heads(self.q(x))  # (b, h, t, d_h)
        k, v = (self._heads(y) for y in self.kv(context).chunk(2, dim=-1))  # (b, h, s, d_h)
        if encodings is None:
            encodings = relative_encodings(s, self.d_model, dtype=x.dtype, device=x.device)
        r = self.r(encodings.to(x.dtype))  # (s, h d_h)
        r = r.view(s, self.n_heads, self.head_dim).transpose(0, 1)  # (h, s, d_h)
        # float16 in float32: its products overflow
        q_u, q_v, k_s, r_s = score_operands(q + self.u[:, None, :], q + self.v[:, None, :], k, r)
        content = q_u @ k_s.transpose(-1, -2)  # (a) + (c): (b, h, t, s)
        position = rel_shift(q_v @ r_s.transpose(-1, -2))  # (b) + (d)
        scores = (content + position) * self.head_dim**-0.5
        q_pos = torch.arange(s - t, s, device=x.device)[:, None]  # (t, 1)
        allowed = torch.arange(s, device=x.device)[None, :] <= q_pos  # (t, s) causal
        if mask is not None:
            allowed = allowed & mask
        # a query with no allowed key (a left-padded position) gets zeros, not NaN, which
        # would reach every later token through the next layer's keys and values
        weights = masked_softmax(softmax_dtype(scores), allowed)
        weights = self.attn_dropout(weights.to(q.dtype))
        y = (weights @ v).transpose(1, 2).reshape(b, t, v.shape[1] * v.shape[-1])  # (b, t, h d_h)
        return self.resid_dropout(self.out(y))
