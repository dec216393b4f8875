"""Numerically stable and masked softmax.

softmax(x)_i = exp(x_i - max_j x_j) / sum_k exp(x_k - max_j x_j): subtracting the row
maximum leaves the result unchanged and keeps exp() from overflowing.
"""

from __future__ import annotations

import torch
from torch import Tensor


def stable_softmax(x: Tensor, dim: int = -1) -> Tensor:
    """Softmax that subtracts the maximum first. Rows of all -inf give zeros, not NaN."""
    m = x.amax(dim=dim, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # all -inf row: avoid inf - inf
    e = torch.exp(x - m)
    s = e.sum(dim=dim, keepdim=True)
    return e / torch.where(s > 0, s, torch.ones_like(s))


def masked_softmax(x: Tensor, mask: Tensor | None, dim: int = -1) -> Tensor:
    """Softmax over positions where ``mask`` is True (bool) or of ``x + mask`` (additive).

    A row with no allowed position returns all zeros, so it contributes nothing.
    """
    if mask is not None:
        x = x.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else x + mask
    return stable_softmax(x, dim=dim)
