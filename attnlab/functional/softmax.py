"""Numerically stable and masked softmax.

softmax(x)_i = exp(x_i - max_j x_j) / sum_k exp(x_k - max_j x_j): subtracting the row
maximum leaves the result unchanged and keeps exp() from overflowing.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnlab.functional.masks import check_mask_dtype


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype that precision-sensitive maths (softmax, RoPE angles, position tables,
    running sums) runs in for tensors of ``dtype``: float32 for half precision and float32,
    float64 kept (an upcast, never a downcast); :func:`softmax_dtype` converts to it."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def softmax_dtype(x: Tensor) -> Tensor:
    """``x`` in the precision a softmax runs in: half precision up to float32, float64
    kept (an upcast, never a downcast)."""
    return x if x.dtype == torch.float64 else x.float()


def score_operands(*xs: Tensor) -> tuple[Tensor, ...]:
    """The operands of attention scores (queries, keys) for their product: float16 raised to
    float32, every other dtype as it is. A float16 product past 65504 is inf before the
    scale can shrink it (q . k of 1e5 at d_h 64 is a score of 12,500; inf - inf then gives
    NaN rows), and its scores round to 0.03 near 50; torch's SDPA and the Triton kernels
    accumulate and keep scores in float32. bfloat16 has float32's range and keeps its
    products, as float32 and float64 do."""
    return tuple(x.float() if x.dtype == torch.float16 else x for x in xs)


def stable_softmax(x: Tensor, dim: int = -1) -> Tensor:
    """Softmax that subtracts the maximum first. Rows of all -inf give zeros, not NaN."""
    if x.shape[dim] == 0:  # no positions: an empty softmax (amax refuses empty rows)
        return x.clone()
    m = x.amax(dim=dim, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # all -inf row: avoid inf - inf
    e = torch.exp(x - m)
    s = e.sum(dim=dim, keepdim=True)
    return e / torch.where(s > 0, s, torch.ones_like(s))


def masked_softmax(x: Tensor, mask: Tensor | None, dim: int = -1) -> Tensor:
    """Softmax over positions where ``mask`` is True (bool) or of ``x + mask`` (additive).

    A row with no allowed position returns all zeros, so it contributes nothing.
    """
    check_mask_dtype(mask)
    if mask is not None:
        x = x.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else x + mask
    # torch's fused softmax, not stable_softmax's exp(x - max): on CPU torch.exp takes a slow
    # path for inputs below about -87 (a result that is denormal or 0): 3x slower for the
    # -inf of a causal mask, 12x for finite scores that far below the row's maximum, where
    # the fused kernel's time at most doubles. Scores (8, 4, 128, 128) under a causal mask:
    # 0.82 ms against 0.37 (forward and backward 2.2 against 1.3); spread as N(0, 30^2): 1.8
    # against 0.54 (3.3 against 1.3). A row with nothing allowed gives zeros (its softmax
    # would be NaN, and its gradient too).
    if x.shape[dim] == 0:  # no positions (no keys): an empty softmax, as torch.softmax's
        return torch.softmax(x, dim=dim)
    empty = x.amax(dim=dim, keepdim=True) == float("-inf")
    return torch.softmax(x.masked_fill(empty, 0.0), dim=dim).masked_fill(empty, 0.0)


# ----------------------------------------------------------------------------------------
# From softmax to flash attention, one pass at a time (Milakov & Gimelshein 2018,
# "Online normaliser calculation for softmax"; Dao et al. 2022, FlashAttention).
# Written as loops over blocks of columns (block=1: one element at a time) so each line is
# one equation; vectorised over every other dimension. ``functional/flash.py`` is the same
# recurrence as the last function, with tiles and an autograd backward.


def _safe(m: Tensor) -> Tensor:
    """A running maximum that is still -inf (nothing seen yet) is used as 0 in exp(x - m),
    so that exp(-inf - 0) = 0 instead of exp(-inf + inf) = NaN."""
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def softmax_3pass(x: Tensor, block: int = 1) -> Tensor:
    """Safe softmax over the last dim in three passes over x:
    (1) m = max_j x_j; (2) d = sum_j exp(x_j - m); (3) y_j = exp(x_j - m) / d."""
    n = x.shape[-1]
    m = torch.full(x.shape[:-1] + (1,), float("-inf"), dtype=x.dtype, device=x.device)
    for j in range(0, n, block):  # pass 1: maximum
        m = torch.maximum(m, x[..., j : j + block].amax(-1, keepdim=True))
    m = _safe(m)
    d = torch.zeros_like(m)
    for j in range(0, n, block):  # pass 2: denominator
        d = d + torch.exp(x[..., j : j + block] - m).sum(-1, keepdim=True)
    d = torch.where(d > 0, d, torch.ones_like(d))  # an all -inf row gives zeros
    return torch.cat([torch.exp(x[..., j : j + block] - m) / d for j in range(0, n, block)], -1)


def softmax_online(x: Tensor, block: int = 1) -> Tensor:
    """Two passes: the maximum and the denominator together. When the running maximum grows
    from m to m', every term already summed was exp(x - m) and must become exp(x - m'), so
    d' = d * exp(m - m') + sum_j exp(x_j - m'). Pass 2 normalises as before."""
    n = x.shape[-1]
    m = torch.full(x.shape[:-1] + (1,), float("-inf"), dtype=x.dtype, device=x.device)
    d = torch.zeros_like(m)
    for j in range(0, n, block):
        xj = x[..., j : j + block]
        m_new = torch.maximum(m, xj.amax(-1, keepdim=True))
        d = d * torch.exp(m - _safe(m_new)) + torch.exp(xj - _safe(m_new)).sum(-1, keepdim=True)
        m = m_new
    m = _safe(m)
    d = torch.where(d > 0, d, torch.ones_like(d))
    return torch.cat([torch.exp(x[..., j : j + block] - m) / d for j in range(0, n, block)], -1)


def attention_online(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    *,
    scale: float | None = None,
    block: int = 1,
) -> tuple[Tensor, Tensor]:
    """One pass over the keys: softmax(q k^T * scale) v without ever holding a full row of
    weights. Besides m and d, keep the unnormalised output o = sum_j exp(s_j - m) v_j and
    rescale it with the same factor as d when m grows; divide by d once at the end.

    q (..., t, d_h), k and v (..., s, d_h) (same leading dims), mask bool broadcastable to
    (..., t, s). Returns the output (..., t, d_h) and the log-sum-exp m + log d (..., t),
    -inf for rows that may attend to nothing (their output is 0)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    t, n = q.shape[-2], k.shape[-2]
    out_dtype = q.dtype
    # statistics, products and the running output in float32 for half precision (a float16
    # q . k past 65504, or a running sum, would be inf), as score_operands / compute_dtype
    f = compute_dtype(q.dtype)
    q, k, v = q.to(f), k.to(f), v.to(f)
    m = torch.full(q.shape[:-1] + (1,), float("-inf"), dtype=f, device=q.device)
    d = torch.zeros_like(m)
    o = torch.zeros_like(q)
    for j in range(0, n, block):
        s = (q @ k[..., j : j + block, :].transpose(-2, -1)) * scale  # (..., t, block)
        if mask is not None:
            allowed = mask.expand(*mask.shape[:-2], t, n)[..., j : j + block]
            s = s.masked_fill(~allowed, float("-inf"))
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        alpha = torch.exp(m - _safe(m_new))  # rescales what was summed under the old maximum
        p = torch.exp(s - _safe(m_new))
        d = d * alpha + p.sum(-1, keepdim=True)
        o = o * alpha + p @ v[..., j : j + block, :]
        m = m_new
    lse = (m + torch.log(d)).squeeze(-1)  # -inf where d == 0
    return (o / torch.where(d > 0, d, torch.ones_like(d))).to(out_dtype), lse
