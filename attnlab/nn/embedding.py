"""Position embeddings added to token embeddings. Shapes: b batch, t length, d d_model."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from attnlab.functional.softmax import compute_dtype


class LearnedPositionalEmbedding(nn.Embedding):
    """One trained vector per absolute position (GPT-2, BERT). With ``padding_idx`` (a
    padding token id: ``position.padding_idx``), RoBERTa's positions counted past it: the
    table has ``max_seq_len + padding_idx + 1`` rows and row ``padding_idx`` is padding's
    (no gradient, as transformers' ``nn.Embedding(padding_idx=...)``)."""

    def __init__(self, max_seq_len: int, d_model: int, padding_idx: int | None = None):
        rows = max_seq_len if padding_idx is None else max_seq_len + padding_idx + 1
        super().__init__(rows, d_model, padding_idx=padding_idx)

    def positions(self, idx: Tensor) -> Tensor:
        """The positions of token ids ``idx`` (b, t) when none are given: (1, t) 0, 1, ...;
        with ``padding_idx``, (b, t) padding_idx + the count of non-padding tokens up to and
        including each one, and padding_idx at padding (fairseq's make_positions, transformers'
        create_position_ids_from_input_ids): left or right padding, a row's first real token
        is at padding_idx + 1."""
        if self.padding_idx is None:
            return torch.arange(idx.shape[-1], device=idx.device)[None, :]  # (1, t)
        real = idx.ne(self.padding_idx).long()  # (b, t)
        return real.cumsum(dim=-1) * real + self.padding_idx

    def forward(self, positions: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """(b, t) -> (b, t, d) in the weight's dtype (``dtype``: as the sinusoids', unused)."""
        return super().forward(positions)


def _check_even(d_model: int) -> None:
    if d_model % 2:
        raise ValueError(
            f"sinusoidal positions pair sines with cosines: d_model must be even, got {d_model}"
        )


def angle_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype sinusoid angles p w are formed in before their sines: float64 (where the
    device has it: not MPS), then rounded to ``dtype``. A float32 angle is off by up to
    p 6e-8 (1e-4 at position 2048, 2e-3 at 32k) and every sine with it: tables far less
    accurate than float32 values, and errors that grew with the sequence length."""
    return dtype if torch.device(device).type == "mps" else torch.float64


def sinusoidal_table(positions: Tensor, d_model: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """p[i, 2j] = sin(i / 10000^(2j/d)), p[i, 2j+1] = cos(i / 10000^(2j/d)) (Vaswani et al.).

    positions (...,) -> (..., d) float32 (angles in float64: :func:`angle_dtype`); float64 for a
    ``dtype`` of float64 (a float64 model's: never float32 values). ``d_model`` must be
    even (sines and cosines come in pairs: an odd width gave d_model + 1 columns)."""
    _check_even(d_model)
    dtype = compute_dtype(dtype)
    wide = angle_dtype(dtype, positions.device)
    j2 = torch.arange(0, d_model, 2, dtype=wide, device=positions.device)  # 2j
    inv = torch.exp(-math.log(10000.0) * j2 / d_model)  # 10000^(-2j/d)
    angles = positions.to(wide)[..., None] * inv  # (..., d/2)
    table = torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)  # sin, cos interleaved
    return table.to(dtype)


def tensor2tensor_table(
    positions: Tensor, d_model: int, dtype: torch.dtype = torch.float32
) -> Tensor:
    """p[i, j] = sin(i w_j), p[i, d/2 + j] = cos(i w_j), w_j = 10000^(-j / (d/2 - 1)) for
    j < d/2: tensor2tensor's timing signal (fairseq's and transformers' M2M100/NLLB
    sinusoids), all sines then all cosines, the last frequency exactly 1/10000.

    positions (...,) -> (..., d) as :func:`sinusoidal_table` (angles in float64). ``d_model``
    must be even and at least 4 (d/2 - 1 frequencies span the range)."""
    _check_even(d_model)
    if d_model < 4:
        raise ValueError(f"tensor2tensor sinusoids need d_model >= 4, got {d_model}")
    dtype = compute_dtype(dtype)
    wide = angle_dtype(dtype, positions.device)
    half = d_model // 2
    j = torch.arange(half, dtype=wide, device=positions.device)
    inv = torch.exp(-math.log(10000.0) * j / (half - 1))  # 10000^(-j/(d/2-1))
    angles = positions.to(wide)[..., None] * inv  # (..., d/2)
    return torch.cat((angles.sin(), angles.cos()), dim=-1).to(dtype)


class SinusoidalPositionalEmbedding(nn.Module):
    """Fixed sinusoids, computed for the requested positions (no length limit, no weights)."""

    def __init__(self, d_model: int):
        super().__init__()
        _check_even(d_model)
        self.d_model = d_model

    def forward(self, positions: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        """(b, t) -> (b, t, d) float32 (float64 for a ``dtype`` of float64)."""
        return sinusoidal_table(positions, self.d_model, dtype)
