"""Normalisation layers. LayerNorm comes from torch; RMSNorm (Zhang & Sennrich 2019):
y = x / sqrt(mean(x^2) + eps) * g, with no centring and no bias; Gemma's RMSNorm stores
g - 1 (``unit_offset``: zeros are the identity) and scales in float32; Nemotron's
:class:`LayerNorm1P` stores a LayerNorm's g - 1 the same way. QK-norm's
:class:`HeadNorm`: either kind over each head's d_h features with one weight per head.

Shapes: n heads, d_h head dim."""

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


class LayerNorm1P(nn.Module):
    """LayerNorm whose weight is stored as its offset from one (Nemotron's, Megatron's
    ``layernorm1p``): ``(x - mean(x)) / sqrt(var(x) + eps) * (1 + weight) + bias``, weight
    initialised to zeros. Computed as transformers' NemotronLayerNorm1P: 1 + w formed in the
    weight's dtype, then one ``F.layer_norm`` in x's dtype (no upcast)."""

    def __init__(self, dim: int, eps: float = 1e-5, *, bias: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        w = (self.weight + 1.0).to(x.dtype)
        b = None if self.bias is None else self.bias.to(x.dtype)
        return F.layer_norm(x, (x.shape[-1],), w, b, self.eps)


class HeadNorm(nn.Module):
    """QK-norm's LayerNorm, and its per-head RMSNorm: each vector of ``dim`` features
    normalised on its own, ``kind`` "layernorm" ``(x - mean(x)) / sqrt(var(x) + eps)``
    (biased variance) or "rmsnorm" ``x / sqrt(mean(x^2) + eps)``, then scaled by ``weight``
    and shifted by ``bias`` (``bias``: LayerNorm's, Phi's). ``heads`` None: one weight of
    ``dim`` for every vector (Phi's ``qk_layernorm``); else a weight (and bias) per head,
    ``(heads, dim)``, and the input's last two axes are (n, d_h) (Cohere's and StableLM's
    per-head LayerNorms). Statistics and affine in float32 (float64 kept), cast back to
    x's dtype, as transformers' CohereLayerNorm; ``unit_offset``: Gemma's 1 + w."""

    no_weight_decay = ("weight", "bias")  # gains and shifts, (n, d_h) per head: no decay

    def __init__(
        self,
        dim: int,
        *,
        heads: int | None = None,
        kind: str = "layernorm",
        bias: bool = False,
        eps: float = 1e-5,
        unit_offset: bool = False,
    ):
        super().__init__()
        if kind not in ("layernorm", "rmsnorm") or (bias and kind != "layernorm"):
            raise ValueError(f"HeadNorm: kind {kind!r} with bias={bias}")
        self.dim, self.kind, self.eps, self.unit_offset = dim, kind, eps, unit_offset
        shape = (dim,) if heads is None else (heads, dim)
        self.weight = nn.Parameter(torch.zeros(shape) if unit_offset else torch.ones(shape))
        self.bias = nn.Parameter(torch.zeros(shape)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        """x (..., d_h), or (..., n, d_h) with a weight per head; the same shape out."""
        y = softmax_dtype(x)
        if self.kind == "layernorm":
            y = F.layer_norm(y, (self.dim,), eps=self.eps)
        else:
            y = F.rms_norm(y, (self.dim,), eps=self.eps)
        w = self.weight.to(y.dtype)
        y = y * (1.0 + w if self.unit_offset else w)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(x.dtype)


def build_qk_norm(
    width: int,
    *,
    heads: int | None,
    kind: str,
    bias: bool,
    eps: float,
    unit_offset: bool,
) -> nn.Module:
    """QK-norm over vectors of ``width``: :class:`RMSNorm` for one shared RMSNorm weight
    (Qwen3, Gemma 3, OLMo 2), else :class:`HeadNorm` (a LayerNorm, or weights per head:
    ``heads``)."""
    if kind == "rmsnorm" and heads is None:
        return RMSNorm(width, eps=eps, unit_offset=unit_offset)
    return HeadNorm(width, heads=heads, kind=kind, bias=bias, eps=eps, unit_offset=unit_offset)


def build_norm(cfg: NormConfig, dim: int) -> nn.Module:
    """The normalisation layer of ``cfg`` over the last dimension of width ``dim``:
    :class:`RMSNorm` (``gemma_rmsnorm``: its unit offset), :class:`LayerNorm1P`
    (``layernorm1p``) or ``torch.nn.LayerNorm``."""
    if cfg.kind in ("rmsnorm", "gemma_rmsnorm"):
        return RMSNorm(dim, eps=cfg.eps, unit_offset=cfg.kind == "gemma_rmsnorm")
    if cfg.kind == "layernorm1p":
        return LayerNorm1P(dim, eps=cfg.eps, bias=cfg.bias)
    return nn.LayerNorm(dim, eps=cfg.eps, bias=cfg.bias)
