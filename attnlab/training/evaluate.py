"""Held-out loss of a language model, and the autocast context the trainer uses.

The language-modelling evaluation itself lives with its task (``attnlab.tasks.lm``); this
module keeps the public ``evaluate`` / ``loss_sums`` / ``summarize`` entry points.

Shapes: b batch, t block size.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

from attnlab.tasks.base import eval_mode
from attnlab.tasks.lm import IGNORE_INDEX, lm_loss_sums, lm_summary

__all__ = ["IGNORE_INDEX", "autocast_context", "evaluate", "loss_sums", "summarize"]


def autocast_context(device: torch.device, dtype: torch.dtype | None) -> torch.autocast:
    """bf16 autocast on CPU or CUDA when ``dtype`` is given, else autocast turned off (also
    a caller's autocast around it: None or float32 runs in the model's own dtype)."""
    if dtype is None or dtype == torch.float32:
        return torch.autocast(device.type, enabled=False)
    return torch.autocast(device.type, dtype=dtype)


def loss_sums(
    model: nn.Module,
    batches: Iterable[tuple[Tensor, Tensor]],
    *,
    device: torch.device | str | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> tuple[float, int]:
    """(sum of token losses, number of target tokens) over ``batches`` of (x, y), each
    (b, t), in eval mode (the model's mode is restored after)."""
    if device is None:
        device = next(model.parameters()).device
    device = torch.device(device)
    with eval_mode(model), autocast_context(device, autocast_dtype):
        return lm_loss_sums(model, batches, device)


def summarize(total: float, count: int) -> dict:
    """Mean loss, perplexity and bits per token from :func:`loss_sums`' totals."""
    return lm_summary(total, count)


def evaluate(
    model: nn.Module,
    batches: Iterable[tuple[Tensor, Tensor]],
    *,
    device: torch.device | str | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> dict:
    """{"loss", "perplexity", "tokens", "bits_per_token"} of ``model`` on ``batches``:
    the token-weighted mean cross-entropy (nats), so unequal batches count fairly."""
    total, count = loss_sums(model, batches, device=device, autocast_dtype=autocast_dtype)
    return summarize(total, count)
