"""Normalisation layers. LayerNorm comes from torch; RMSNorm (Zhang & Sennrich 2019):
y = x / sqrt(mean(x^2) + eps) * g, with no centring and no bias; Gemma's RMSNorm stores
g - 1 (``unit_offset``: zeros are the identity) and scales in float32."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.config import NormConfig
from attnlab.functional.softmax import softmax_dtype

_FULL = (torch.float32, torch.float64)  # dtypes F.rms_norm runs in as they are


class RMSNorm(nn.Module):
    """Root-mean-square normalisation (Zhang and Sennrich 2019; LLaMA):
    ``x / sqrt(mean(x^2) + eps) * weight``, computed in float32 (float64 inputs in float64).

    ``unit_offset`` (Gemma): the weight is stored as its offset from one, ``x / rms(x) *
    (1 + weight)``, initialised to zeros, and the product is formed in float32 before the
    cast back to x's dtype, as transformers' Gemma3RMSNorm. (Mapping 1 + w into a plain
    RMSNorm at import gives the same float32 forward pass, but rounds a bf16 model's scale
    to bf16 and loses the low bits of small w, so checkpoints would not round-trip.)"""

    def __init__(self, dim: int, eps: float = 1e-6, *, unit_offset: bool = False):
        super().__init__()
        self.eps, self.unit_offset = eps, unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        if self.unit_offset:  # Gemma: (x / rms(x)) * (1 + w) in float32, then cast
            y = F.rms_norm(softmax_dtype(x), (x.shape[-1],), eps=self.eps)
            return (y * (1.0 + self.weight.to(y.dtype))).to(x.dtype)
        # F.rms_norm is torch's fused kernel of the formula above (tests compare the two).
        if x.dtype == self.weight.dtype and x.dtype in _FULL:  # one call: decoding runs 17 a token
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # Normalise in float32 (bf16 sums of squares lose precision), float64 kept (an upcast,
        # never a downcast), scale in x's dtype.
        y = F.rms_norm(softmax_dtype(x), (x.shape[-1],), eps=self.eps)
        return self.weight * y.to(x.dtype)


def build_norm(cfg: NormConfig, dim: int) -> nn.Module:
    """The normalisation layer of ``cfg`` over the last dimension of width ``dim``:
    :class:`RMSNorm` (``gemma_rmsnorm``: its unit offset) or ``torch.nn.LayerNorm``."""
    if cfg.kind in ("rmsnorm", "gemma_rmsnorm"):
        return RMSNorm(dim, eps=cfg.eps, unit_offset=cfg.kind == "gemma_rmsnorm")
    return nn.LayerNorm(dim, eps=cfg.eps, bias=cfg.bias)
