"""Image classification data: scikit-learn's handwritten digits (8 x 8, 16 grey levels,
1797 images, shipped inside the package, no download) and the pieces a task needs:
a split, augmented batches and the accuracy metric.

Shapes: b batch, C channels (1), H = W = 8."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.nn.modes import enter_eval, restore


class ImageSplit(NamedTuple):
    train_x: Tensor  # (n, 1, 8, 8) float32 in [0, 1]
    train_y: Tensor  # (n,) long
    test_x: Tensor
    test_y: Tensor


def digits(test_fraction: float = 0.2, seed: int = 0) -> ImageSplit:
    """The digits, shuffled with ``seed`` and split; pixels scaled from 0..16 to 0..1."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:  # pragma: no cover
        raise ImportError("the digits data set needs scikit-learn: pip install scikit-learn") from e
    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32)[:, None] / 16.0  # (n, 1, 8, 8)
    y = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    n_test = int(round(len(y) * test_fraction))
    return ImageSplit(x[n_test:], y[n_test:], x[:n_test], y[:n_test])


def random_shift(images: Tensor, pad: int = 1, generator: torch.Generator | None = None) -> Tensor:
    """Augmentation: shift each image by up to ``pad`` pixels (zero padding, random crop)."""
    b = images.shape[0]
    dy = torch.randint(0, 2 * pad + 1, (b,), generator=generator)
    dx = torch.randint(0, 2 * pad + 1, (b,), generator=generator)
    return shift(images, dy, dx, pad)


def shift(images: Tensor, dy: Tensor, dx: Tensor, pad: int = 1) -> Tensor:
    """Crop (b,) windows at offsets dy, dx in [0, 2 pad] of the zero-padded images: a shift
    by (pad - dy, pad - dx) pixels; offsets (pad, pad) leave an image as it is."""
    b, _, h, w = images.shape
    padded = F.pad(images, (pad, pad, pad, pad))
    dy, dx = dy.to(images.device), dx.to(images.device)
    dev = images.device
    rows = (dy[:, None] + torch.arange(h, device=dev))[:, None, :, None]  # (b, 1, h, 1)
    cols = (dx[:, None] + torch.arange(w, device=dev))[:, None, None, :]  # (b, 1, 1, w)
    idx_b = torch.arange(b, device=dev)[:, None, None, None]
    channels = torch.arange(images.shape[1], device=dev)[None, :, None, None]
    return padded[idx_b, channels, rows, cols]


def image_batches(x: Tensor, y: Tensor, batch_size: int, *, seed: int = 0, augment: bool = True):
    """Endless shuffled (images, labels) batches, epoch after epoch (each ``batch_size``
    images; an epoch's remainder is left out)."""
    if not 1 <= batch_size <= len(y):  # else no epoch holds a batch: an endless loop
        raise ValueError(f"batch_size={batch_size} needs 1 to {len(y)} (the images given)")
    g = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(y), generator=g)
        for i in range(0, len(y) - batch_size + 1, batch_size):
            sel = order[i : i + batch_size]
            images = random_shift(x[sel], generator=g) if augment else x[sel]
            yield images, y[sel]


@torch.no_grad()
def accuracy(model: nn.Module, x: Tensor, y: Tensor, batch_size: int = 512) -> float:
    """Fraction of images whose arg-max class is the label (eval mode, restored after)."""
    modes = enter_eval(model)
    correct = 0
    try:
        for i in range(0, len(y), batch_size):
            correct += int(
                (model(x[i : i + batch_size]).logits.argmax(-1) == y[i : i + batch_size]).sum()
            )
    finally:  # also when the model raises: the caller's modes come back
        restore(modes)
    return correct / len(y)
