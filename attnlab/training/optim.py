"""The optimizer (AdamW with decay / no-decay parameter groups, or Muon for the hidden weight
matrices with AdamW for the rest) and the warm-up + cosine learning-rate schedule.

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


def build_optimizer(
    model: nn.Module, cfg: TrainConfig, device_type: str
) -> torch.optim.Optimizer | Optimizers:
    """``cfg.optimizer``: "adamw" is AdamW over :func:`parameter_groups`, fused where the
    device supports it; "muon" is :func:`muon_parameters` under ``torch.optim.Muon`` (its
    learning rate scaled to AdamW's update size, so one ``lr`` and schedule serve both)
    and AdamW for every other parameter."""
    if cfg.optimizer == "muon":
        hidden = muon_parameters(model)
        ids = {id(p) for p in hidden}
        muon = torch.optim.Muon(
            hidden, lr=cfg.lr, weight_decay=cfg.weight_decay, adjust_lr_fn="match_rms_adamw"
        )
        return Optimizers([_adamw(model, cfg, device_type, exclude=ids), muon])
    return _adamw(model, cfg, device_type)


def _adamw(
    model: nn.Module, cfg: TrainConfig, device_type: str, exclude: set[int] = frozenset()
) -> torch.optim.AdamW:
    groups = parameter_groups(model, cfg.weight_decay)
    for group in groups:
        group["params"] = [p for p in group["params"] if id(p) not in exclude]
    groups = [g for g in groups if g["params"]]
    kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8)
    if _fused_supported(device_type):
        try:
            return torch.optim.AdamW(groups, fused=True, **kwargs)
        except (RuntimeError, TypeError, ValueError):
            pass  # an older torch without fused kernels for this device
    return torch.optim.AdamW(groups, foreach=True, **kwargs)


def muon_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The hidden weight matrices Muon orthogonalises: the 2-D weights of linear layers,
    except any shared with an embedding (a tied output head). Embeddings, the output head,
    norms and biases stay with AdamW, as Muon's authors train them."""
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    heads = {id(p) for name, p in model.named_parameters() if name.split(".")[0] in _HEADS}
    found, seen = [], set()
    for module in model.modules():
        if isinstance(module, nn.Linear):
            w = module.weight
            if w.requires_grad and w.dim() == 2 and id(w) not in embedded | heads | seen:
                seen.add(id(w))
                found.append(w)
    return found


_HEADS = ("lm_head", "head", "classifier", "output")  # top-level output layers: AdamW


class Optimizers:
    """Several optimizers stepped as one (Muon + AdamW): the optimizer interface the
    trainer uses (``param_groups``, ``step``, ``zero_grad``, ``state_dict``)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state: dict) -> None:
        if len(state.get("optimizers", ())) != len(self.optimizers):
            raise ValueError(
                "the checkpoint's optimizer state does not match train.optimizer; resume "
                "with the optimizer it was trained with (or start a new run with --init-from)"
            )
        for opt, sub in zip(self.optimizers, state["optimizers"]):
            opt.load_state_dict(sub)


def set_lr(optimizer: torch.optim.Optimizer | Optimizers, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
