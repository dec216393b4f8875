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


def rope_tables(cos: Tensor, sin: Tensor, layout: str = "split") -> tuple[Tensor, Tensor]:
    """Spread half-width cos/sin (..., d_h/2) over the full head dim, sin signed, so that the
    rotation is ``x * cos + swap(x) * sin`` where swap exchanges the members of each pair.

    split:        cos [c, c],              sin [-s, s]
    interleaved:  cos [c0, c0, c1, c1..],  sin [-s0, s0, -s1, s1, ..]"""
    if layout == "split":
        return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)
    if layout == "interleaved":
        return cos.repeat_interleave(2, dim=-1), torch.stack((-sin, sin), dim=-1).flatten(-2)
    raise ValueError(f"unknown RoPE layout {layout!r}; use 'split' or 'interleaved'")


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, layout: str = "split") -> Tensor:
    """Rotate every pair of x (..., t, d_h) by its angle: (a, b) -> (a cos - b sin, b cos + a sin).

    ``cos``/``sin`` broadcast to x: half width (..., t, d_h/2) as :func:`rope_angles` returns
    them, or full width (..., t, d_h) from :func:`rope_tables` (computed once per forward
    pass and shared by every layer). The rotation runs in float32 and casts back."""
    if cos.shape[-1] != x.shape[-1]:
        cos, sin = rope_tables(cos, sin, layout)
    xf = x.float()
    if layout == "split":  # pairs (i, i + d/2): swap the halves
        swapped = xf.roll(x.shape[-1] // 2, dims=-1)
    elif layout == "interleaved":  # pairs (2i, 2i + 1): swap neighbours
        swapped = xf.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    else:
        raise ValueError(f"unknown RoPE layout {layout!r}; use 'split' or 'interleaved'")
    return (xf * cos + swapped * sin).to(x.dtype)


def interleaved_to_split(d: int) -> Tensor:
    """Permutation p with x_split = x_interleaved[..., p]: pair i (2i, 2i+1) -> (i, i + d/2)."""
    return torch.cat((torch.arange(0, d, 2), torch.arange(1, d, 2)))
