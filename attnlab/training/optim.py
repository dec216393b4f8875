"""AdamW with decay / no-decay parameter groups, and the warm-up + cosine learning-rate schedule.

Schedule (nanoGPT's, with ``step`` the 0-based index of the optimizer step about to be taken):

    lr(step) = lr * (step + 1) / (warmup + 1)                        step < warmup
             = min_lr + (lr - min_lr) * (1 + cos(pi * r)) / 2        r = (step - warmup) /
                                                                         (total - warmup)
             = min_lr                                                step >= total
"""

from __future__ import annotations

import math

import torch
from torch import nn

from attnlab.config import TrainConfig


def lr_at(
    step: int, cfg: TrainConfig, total_steps: int | None = None, warmup_steps: int | None = None
) -> float:
    """Learning rate for optimizer step ``step`` (0-based) of a run of ``total_steps``
    (default ``cfg.max_steps``) warming up for ``warmup_steps`` (default
    ``cfg.warmup_steps``). After the warm-up it never increases with ``step``, and for a
    fixed step it never increases when ``total_steps`` or ``warmup_steps`` shrink."""
    total = cfg.max_steps if total_steps is None else total_steps
    warmup = cfg.warmup_steps if warmup_steps is None else warmup_steps
    if step < warmup:
        return cfg.lr * (step + 1) / (warmup + 1)
    if step >= total:
        return cfg.min_lr
    decay_ratio = (step - warmup) / max(1, total - warmup)
    coeff = 0.5 * (1.0 + math.cos(math.pi * min(1.0, decay_ratio)))  # 1 -> 0
    return cfg.min_lr + coeff * (cfg.lr - cfg.min_lr)


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Matrices (linear weights, embeddings) decay; vectors (biases, norm gains) do not.

    Tied weights appear once: ``named_parameters`` skips duplicates.
    """
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def _fused_supported(device_type: str) -> bool:
    # Fused AdamW runs on CUDA and (torch >= 2.4) on CPU; other devices use foreach.
    return device_type in ("cuda", "cpu")


def build_optimizer(model: nn.Module, cfg: TrainConfig, device_type: str) -> torch.optim.AdamW:
    """AdamW over :func:`parameter_groups`, fused where the device supports it."""
    groups = parameter_groups(model, cfg.weight_decay)
    kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8)
    if _fused_supported(device_type):
        try:
            return torch.optim.AdamW(groups, fused=True, **kwargs)
        except (RuntimeError, TypeError, ValueError):
            pass  # an older torch without fused kernels for this device
    return torch.optim.AdamW(groups, foreach=True, **kwargs)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
