"""Checks of what a model's ``forward`` receives, so that a malformed argument is one
``ValueError`` naming it instead of an error from deep inside torch (a 4-D padding mask
failed as "split_with_sizes expects split_sizes to sum exactly to 2", or in the GRU model as
"every source sequence needs at least one real token"). Shapes and dtypes only: nothing
here reads a tensor's values (no host read per decoding step).

Shapes: b batch, t length.
"""

from __future__ import annotations

import torch
from torch import Tensor


def check_ids(name: str, ids: Tensor) -> tuple[int, int]:
    """``ids`` (b, t) integer token ids (int64 or int32, as ``nn.Embedding`` takes); returns
    (b, t)."""
    if ids.dim() != 2:
        raise ValueError(
            f"{name} must be (b, t) token ids, got shape {tuple(ids.shape)}"
            + (f"; one sequence is {name}[None]" if ids.dim() == 1 else "")
        )
    if ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name} must hold integer token ids (int64 or int32), got {ids.dtype}")
    return ids.shape[0], ids.shape[1]


def check_padding_mask(
    name: str, mask: Tensor | None, b: int, t: int, *, one_row: bool = True
) -> None:
    """``mask`` (b, t) (or (1, t) for every row, where ``one_row``): 1 / True for real
    tokens, 0 / False for padding; any dtype (it is read as ``mask.bool()``)."""
    rows = (1, b) if one_row else (b,)
    if mask is not None and (mask.dim() != 2 or mask.shape[1] != t or mask.shape[0] not in rows):
        raise ValueError(
            f"{name} must be ({b}, {t}) like the token ids, 1 for real tokens and 0 for "
            f"padding, got shape {tuple(mask.shape)}"
        )


def check_targets(name: str, targets: Tensor, shape: tuple[int, ...], what: str) -> Tensor:
    """``targets`` of ``shape`` holding class ids, as int64 (cross-entropy refuses int32)."""
    if tuple(targets.shape) != tuple(shape):
        raise ValueError(
            f"{name} must be {what} = {tuple(shape)}, got shape {tuple(targets.shape)}"
        )
    if targets.is_floating_point() or targets.dtype == torch.bool:
        raise ValueError(f"{name} must hold integer class ids, got {targets.dtype}")
    return targets.long()
