"""Rotary position embedding (RoPE, Su et al. 2021).

Each pair of dimensions (x_a, x_b) of a query or key at position m is rotated by the
angle m * theta^(-2i/d): q_m . k_n then depends on m - n only. Two pair layouts exist:
``interleaved`` pairs (x_0, x_1), (x_2, x_3), ... as in RoFormer, and ``split`` halves
(x_i, x_{i + d/2}) as in LLaMA and Hugging Face checkpoints.

Shapes: b batch, h heads, t length, d_h head dim.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def rope_inv_freq(
    head_dim: int, theta: float = 10000.0, device: torch.device | str | None = None
) -> Tensor:
    """(d_h/2,) float32 frequencies theta^(-2i/d_h)."""
    i = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device)
    return 1.0 / (theta ** (i / head_dim))


def scale_inv_freq(
    inv_freq: Tensor,
    kind: str | None,
    factor: float = 1.0,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_max_seq_len: int = 8192,
) -> Tensor:
    """Stretch RoPE to longer contexts. ``linear``: every frequency / factor (position
    interpolation). ``llama3``: wavelengths longer than original_max_seq_len / low_freq_factor
    are divided by factor, shorter than original_max_seq_len / high_freq_factor are kept, and
    those between are interpolated linearly in original_max_seq_len / wavelength."""
    if kind is None:
        return inv_freq
    if kind == "linear":
        return inv_freq / factor
    if kind != "llama3":
        raise ValueError(f"unknown RoPE scaling {kind!r}; use 'linear' or 'llama3'")
    ratio = original_max_seq_len * inv_freq / (2 * math.pi)  # context length / wavelength
    # 0 for long wavelengths (fully scaled), 1 for short ones (kept), linear in between.
    keep = ((ratio - low_freq_factor) / (high_freq_factor - low_freq_factor)).clamp(0.0, 1.0)
    return (1 - keep) * inv_freq / factor + keep * inv_freq


def rope_angles(positions: Tensor, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
    """positions (..., t) -> cos, sin (..., t, d_h/2), always float32 (bf16 positions
    above 256 would round)."""
    angles = positions.to(torch.float32)[..., None] * inv_freq.to(torch.float32)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, layout: str = "split") -> Tensor:
    """Rotate x (b, h, t, d_h) by cos/sin broadcastable to (b, h, t, d_h/2).

    The rotation is done in float32 and cast back to x's dtype."""
    dtype = x.dtype
    x = x.float()
    if layout == "split":
        x1, x2 = x.chunk(2, dim=-1)  # (b, h, t, d_h/2) each
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    elif layout == "interleaved":
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    else:
        raise ValueError(f"unknown RoPE layout {layout!r}; use 'split' or 'interleaved'")
    return out.to(dtype)


def interleaved_to_split(d: int) -> Tensor:
    """Permutation p with x_split = x_interleaved[..., p]: pair i (2i, 2i+1) -> (i, i + d/2)."""
    return torch.cat((torch.arange(0, d, 2), torch.arange(1, d, 2)))
