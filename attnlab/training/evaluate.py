"""Held-out loss: the mean next-token cross-entropy over every target token of the batches.

Shapes: b batch, t block size.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor, nn

IGNORE_INDEX = -100


def autocast_context(device: torch.device, dtype: torch.dtype | None) -> torch.autocast:
    """bf16 autocast on CPU or CUDA when ``dtype`` is given, else a no-op context."""
    if dtype is None or dtype == torch.float32:
        return torch.autocast(device.type, enabled=False)
    return torch.autocast(device.type, dtype=dtype)


@torch.no_grad()
def loss_sums(
    model: nn.Module,
    batches: Iterable[tuple[Tensor, Tensor]],
    *,
    device: torch.device | str | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> tuple[float, int]:
    """(sum of token losses, number of target tokens) over ``batches`` of (x, y), each
    (b, t). Summing, not averaging, lets callers combine shards (processes, batches)."""
    if device is None:
        device = next(model.parameters()).device
    device = torch.device(device)
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for x, y in batches:
            x, y = x.to(device), y.to(device)
            n = int((y != IGNORE_INDEX).sum())
            if n == 0:
                continue  # the model's mean over zero targets is NaN
            with autocast_context(device, autocast_dtype):
                loss = model(x, targets=y).loss  # mean over the non-ignored targets
            total += float(loss) * n
            count += n
    finally:
        model.train(was_training)
    return total, count


def summarize(total: float, count: int) -> dict:
    """Mean loss, perplexity and bits per token from :func:`loss_sums`' totals."""
    if count == 0:
        raise ValueError("no target tokens to evaluate; give at least one non-empty batch")
    loss = total / count
    return {
        "loss": loss,
        "perplexity": math.exp(min(loss, 700.0)),  # exp overflows a float beyond ~709
        "tokens": count,
        "bits_per_token": loss / math.log(2.0),
    }


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
