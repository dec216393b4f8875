"""Rotary position embedding (RoPE, Su et al. 2021).

Each pair of dimensions (x_a, x_b) of a query or key at position m is rotated by the
angle m * theta^(-2i/d): q_m . k_n then depends on m - n only. Two pair layouts exist:
``interleaved`` pairs (x_0, x_1), (x_2, x_3), ... as in RoFormer, and ``split`` halves
(x_i, x_{i + d/2}) as in LLaMA and Hugging Face checkpoints. A partial rotation rotates
the first d_r features only, its pairs laid out within them (:func:`apply_partial_rope`).

Shapes: b batch, h heads, t length, d_h head dim.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attnlab.functional.softmax import compute_dtype


def rope_inv_freq(
    head_dim: int,
    theta: float = 10000.0,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """(d_h/2,) frequencies theta^(-2i/d_h), float32 (or ``dtype``: float64 models)."""
    i = torch.arange(0, head_dim, 2, dtype=dtype, device=device)
    return 1.0 / (theta ** (i / head_dim))


def scale_inv_freq(
    inv_freq: Tensor,
    kind: str | None,
    factor: float = 1.0,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_max_seq_len: int = 8192,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    theta: float = 10000.0,
    truncate: bool = True,
) -> Tensor:
    """Stretch RoPE to longer contexts. ``linear``: every frequency / factor (position
    interpolation). ``llama3``: wavelengths longer than original_max_seq_len / low_freq_factor
    are divided by factor, shorter than original_max_seq_len / high_freq_factor are kept, and
    those between are interpolated linearly in original_max_seq_len / wavelength.
    ``yarn`` (Peng et al. 2023, "NTK-by-parts"): pair i makes r_i = original_max_seq_len /
    wavelength_i rotations over the original context; pairs with r_i < beta_slow are divided
    by factor, r_i > beta_fast kept, and a linear ramp in i between (``theta`` locates its
    bounds), rounded outward to whole pairs unless ``truncate`` is False (gpt-oss)."""
    if kind is None:
        return inv_freq
    if kind == "linear":
        return inv_freq / factor
    if kind == "yarn":
        n_pairs = inv_freq.shape[-1]
        keep = yarn_keep(
            n_pairs,
            theta,
            original_max_seq_len,
            beta_fast,
            beta_slow,
            truncate=truncate,
            dtype=inv_freq.dtype,
        )
        keep = keep.to(inv_freq.device)
        return keep * inv_freq + (1 - keep) * inv_freq / factor
    if kind != "llama3":
        raise ValueError(f"unknown RoPE scaling {kind!r}; use 'linear', 'llama3' or 'yarn'")
    ratio = original_max_seq_len * inv_freq / (2 * math.pi)  # context length / wavelength
    # 0 for long wavelengths (fully scaled), 1 for short ones (kept), linear in between.
    keep = ((ratio - low_freq_factor) / (high_freq_factor - low_freq_factor)).clamp(0.0, 1.0)
    return (1 - keep) * inv_freq / factor + keep * inv_freq


def yarn_keep(
    n_pairs: int,
    theta: float,
    original_max_seq_len: int,
    beta_fast: float,
    beta_slow: float,
    truncate: bool = True,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """(n_pairs,) float32 (float64 for a ``dtype`` of float64): 1 for pairs kept as they
    are, 0 for pairs interpolated by factor.

    Pair i of a d = 2 n_pairs head turns original_max_seq_len / (2 pi theta^(2i/d)) times over
    the original context, so r rotations happen at i(r) = d ln(L / (2 pi r)) / (2 ln theta).
    The ramp runs from i(beta_fast) to i(beta_slow), widened to whole pairs (floor, ceil)
    when ``truncate``, as the YaRN paper's code does; clamped to [0, d - 1] either way."""
    d = 2 * n_pairs

    def pair_at(rotations: float) -> float:
        return (
            d * math.log(original_max_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))
        )

    low, high = pair_at(beta_fast), pair_at(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # a step, not a division by zero
    pairs = torch.arange(n_pairs, dtype=compute_dtype(dtype))
    ramp = ((pairs - low) / (high - low)).clamp(0.0, 1.0)
    return 1 - ramp  # ramp 0 below `low` (many rotations: keep), 1 above `high` (scale)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature: 0.1 mscale ln(factor) + 1 (1 when not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factors(
    factor: float,
    mscale: float | None,
    mscale_all_dim: float | None,
    attention_factor: float | None = None,
) -> tuple[float, float]:
    """(rope factor, softmax factor). cos/sin are multiplied by the first: ``attention_factor``
    when given, else mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are
    given, else mscale(factor). DeepSeek's MLA multiplies its softmax scale by the second,
    mscale(factor, mscale_all_dim)^2 (1 without mscale_all_dim): with mscale ==
    mscale_all_dim, as in DeepSeek-V2/V3, the whole temperature moves to the softmax, the
    rope part included."""
    if attention_factor is not None:
        rope = attention_factor
    elif mscale and mscale_all_dim:
        rope = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    else:
        rope = yarn_mscale(factor)
    softmax = yarn_mscale(factor, mscale_all_dim) ** 2 if mscale_all_dim else 1.0
    return rope, softmax


def longrope_inv_freq(
    rotary_dim: int,
    theta: float,
    factors: list[float],
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """(d_r/2,) LongRoPE frequencies (Ding et al. 2024, Phi-3): 1 / (factor_i theta^(2i/d_r)),
    each pair's frequency divided by its own rescale factor (in transformers' order of
    operations: the same float32 values)."""
    i = torch.arange(0, rotary_dim, 2, dtype=dtype, device=device)
    return 1.0 / (torch.tensor(factors, dtype=dtype, device=device) * theta ** (i / rotary_dim))


def longrope_attention_factor(
    factor: float, original_max_seq_len: int, attention_factor: float | None = None
) -> float:
    """LongRoPE's scale of cos/sin: ``attention_factor`` when given, else
    sqrt(1 + ln(factor) / ln(original_max_seq_len)) for a context stretched ``factor``
    times (1 when not stretched), the same for the short and the long factors."""
    if attention_factor is not None:
        return attention_factor
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(original_max_seq_len))


def rope_angles(positions: Tensor, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
    """positions (..., t) -> cos, sin (..., t, d_h/2), float32 (bf16 positions above 256
    would round), float64 for float64 frequencies (a float64 model's: never a downcast)."""
    dtype = compute_dtype(inv_freq.dtype)
    angles = positions.to(dtype)[..., None] * inv_freq.to(dtype)
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
    pass and shared by every layer). The rotation runs in float32 (float64 inputs in
    float64) and casts back."""
    if cos.shape[-1] != x.shape[-1]:
        cos, sin = rope_tables(cos, sin, layout)
    # at least float32: half precision is raised, float64 kept (x.float() would round it)
    xf = x if x.dtype in (torch.float32, torch.float64) else x.float()
    if layout == "split":  # pairs (i, i + d/2): swap the halves
        half = x.shape[-1] // 2
        if torch.compiler.is_compiling():
            # Inductor vectorises the backward of a cat of slices; roll's wrapped index
            # gave a scalar loop, 4% of the demo's compiled training step
            # (benchmarks/where_time_goes.py --kernels).
            swapped = torch.cat((xf[..., half:], xf[..., :half]), dim=-1)
        else:  # one kernel, faster than the cat eagerly
            swapped = xf.roll(half, dims=-1)
    elif layout == "interleaved":  # pairs (2i, 2i + 1): swap neighbours
        swapped = xf.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    else:
        raise ValueError(f"unknown RoPE layout {layout!r}; use 'split' or 'interleaved'")
    y = xf * cos + swapped * sin
    return y if y.dtype == x.dtype else y.to(x.dtype)


def apply_partial_rope(x: Tensor, cos: Tensor, sin: Tensor, layout: str = "split") -> Tensor:
    """Rotate the first d_r features of x (..., t, d_h) with full-width tables (..., t, d_r)
    (:func:`rope_tables`) and pass the other d_h - d_r unchanged (transformers'
    ``partial_rotary_factor``; the pairs lie within the first d_r). d_r == d_h: apply_rope."""
    d_r = cos.shape[-1]
    if d_r == x.shape[-1]:
        return apply_rope(x, cos, sin, layout)
    return torch.cat((apply_rope(x[..., :d_r], cos, sin, layout), x[..., d_r:]), dim=-1)


def interleaved_to_split(d: int) -> Tensor:
    """Permutation p with x_split = x_interleaved[..., p]: pair i (2i, 2i+1) -> (i, i + d/2)."""
    return torch.cat((torch.arange(0, d, 2), torch.arange(1, d, 2)))
