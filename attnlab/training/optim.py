"""The optimizer (AdamW with decay / no-decay parameter groups, or Muon for the hidden weight
matrices with AdamW for the rest) and the warm-up + decay learning-rate schedule.

Schedule, with ``step`` the 0-based index of the optimizer step about to be taken and
``r = (step - warmup) / (total - warmup)`` the progress after the warm-up:

    lr(step) = lr * (step + 1) / (warmup + 1)                        step < warmup
             = min_lr + (lr - min_lr) * decay(r)                     warmup <= step < total
             = min_lr                                                step >= total

``decay`` falls from 1 to 0 (``train.schedule``, the registry :data:`SCHEDULES`):

    cosine  (1 + cos(pi r)) / 2                          nanoGPT's
    wsd     1 for r <= 1 - f, then (1 - r) / f           warm-up, stable, decay: the rate
                                                         held at its peak, then a linear
                                                         decay over the last f (train.
                                                         decay_fraction) of the steps
"""

from __future__ import annotations

import math

import torch
from torch import nn

from attnlab.config import TrainConfig
from attnlab.nn.linear import layout_version


def cosine_decay(r: float, cfg: TrainConfig) -> float:
    return 0.5 * (1.0 + math.cos(math.pi * r))


def wsd_decay(r: float, cfg: TrainConfig) -> float:
    if r <= 1.0 - cfg.decay_fraction:  # the stable phase: exactly 1 (the quotient rounds)
        return 1.0
    return (1.0 - r) / cfg.decay_fraction


# name -> decay(r, cfg): 1 at r = 0, 0 at r = 1, never increasing in r
SCHEDULES = {"cosine": cosine_decay, "wsd": wsd_decay}


def _progress(
    step: int, cfg: TrainConfig, total_steps: int | None, warmup_steps: int | None
) -> tuple[int, int, float]:
    """(total, warmup, r): the schedule's length and warm-up (the config's by default) and
    the progress r in [0, 1] of ``step`` after the warm-up (0 within it)."""
    total = cfg.max_steps if total_steps is None else total_steps
    warmup = cfg.warmup_steps if warmup_steps is None else warmup_steps
    r = min(1.0, max(0, step - warmup) / max(1, total - warmup))
    return total, warmup, r


def lr_at(
    step: int, cfg: TrainConfig, total_steps: int | None = None, warmup_steps: int | None = None
) -> float:
    """Learning rate for optimizer step ``step`` (0-based) of a run of ``total_steps``
    (default ``cfg.max_steps``) warming up for ``warmup_steps`` (default
    ``cfg.warmup_steps``). After the warm-up it never increases with ``step``, and for a
    fixed step past the warm-up it never increases when ``total_steps`` or
    ``warmup_steps`` shrink (inside the warm-up a shorter one is further along it)."""
    total, warmup, r = _progress(step, cfg, total_steps, warmup_steps)
    if step < warmup:
        return cfg.lr * (step + 1) / (warmup + 1)
    if step >= total:
        return cfg.min_lr
    return cfg.min_lr + SCHEDULES[cfg.schedule](r, cfg) * (cfg.lr - cfg.min_lr)


def decaying(
    step: int, cfg: TrainConfig, total_steps: int | None = None, warmup_steps: int | None = None
) -> bool:
    """Whether step ``step`` falls in the decay (the warm-up over, the rate below its peak):
    from there a longer schedule would raise the rate again. Cosine decays from the first
    step after the warm-up; WSD only over its last ``decay_fraction``."""
    total, warmup, r = _progress(step, cfg, total_steps, warmup_steps)
    if step < warmup:
        return False
    return step >= total or SCHEDULES[cfg.schedule](r, cfg) < 1.0


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Matrices (linear weights, embeddings) decay; vectors (biases, norm gains) do not,
    nor do the matrices a module names in its ``no_weight_decay`` attribute: biases held
    as matrices (Transformer-XL's per-head u and v), a ViT's class token and position
    embeddings (timm's ``no_weight_decay``).

    Tied weights appear once: ``named_parameters`` skips duplicates.
    """
    biases = {
        id(getattr(module, name))
        for module in model.modules()
        for name in getattr(module, "no_weight_decay", ())
    }
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 and id(p) not in biases else no_decay).append(p)
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
    optimizer = None
    if _fused_supported(device_type):
        try:
            optimizer = torch.optim.AdamW(groups, fused=True, **kwargs)
        except (RuntimeError, TypeError, ValueError):
            pass  # an older torch without fused kernels for this device
    if optimizer is None:
        optimizer = torch.optim.AdamW(groups, foreach=True, **kwargs)
    optimizer.register_step_pre_hook(match_layouts)
    optimizer.register_load_state_dict_post_hook(_forget_layouts)  # loaded moments: look again
    return optimizer


def _forget_layouts(optimizer: torch.optim.Optimizer) -> None:
    optimizer._attnlab_layouts = None  # type: ignore[attr-defined]


def match_layouts(optimizer: torch.optim.Optimizer, args=(), kwargs=None) -> None:
    """Give every gradient and optimizer moment its parameter's strides (a step pre-hook).
    :func:`attnlab.nn.linear.set_layout` re-stores Linear weights in place (row-major for
    ``generate(compile=True)``, input-major after a failed compile), which leaves the
    gradients and AdamW's moments in the old layout; fused AdamW reads a parameter, its
    gradient and its moments as flat memory in one order, so a transposed moment or
    gradient silently updated the wrong elements. Only the first step and those after a
    set_layout call (:func:`attnlab.nn.linear.layout_version`) or a loaded state look: no
    walk over every parameter at every step."""
    version = layout_version()
    if getattr(optimizer, "_attnlab_layouts", None) == version:
        return
    optimizer._attnlab_layouts = version  # type: ignore[attr-defined]
    for group in optimizer.param_groups:
        for p in group["params"]:
            stride = p.stride()
            g = p.grad
            if g is not None and g.layout == torch.strided and g.stride() != stride:
                p.grad = torch.empty_like(p, dtype=g.dtype).copy_(g)
            state = optimizer.state.get(p)
            for name, value in (state or {}).items():
                if (
                    isinstance(value, torch.Tensor)
                    and value.shape == p.shape
                    and value.stride() != stride
                ):
                    state[name] = torch.empty_like(p, dtype=value.dtype).copy_(value)


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


# top-level output layers: AdamW (``out``: the GRU seq2seq's vocabulary projection)
_HEADS = ("lm_head", "head", "classifier", "out", "output")


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
            _check_groups(opt, sub)
            opt.load_state_dict(sub)


def _check_groups(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Refuse a saved state whose parameter groups differ in size from ``optimizer``'s:
    torch's own error does not say why (a version that grouped the parameters otherwise:
    Transformer-XL's u and v were decayed before they joined the no-decay group)."""
    saved = [len(g["params"]) for g in state.get("param_groups", ())]
    built = [len(g["params"]) for g in optimizer.param_groups]
    if "param_groups" in state and saved != built:
        raise ValueError(
            f"the checkpoint's optimizer state has parameter groups of {saved} tensors, this "
            f"version's optimizer {built}: it was saved by an attnlab version that grouped "
            "the parameters differently; resume it with that version, or start a new run "
            "from its weights with --init-from"
        )


def load_optimizer_state(optimizer: torch.optim.Optimizer | Optimizers, state: dict) -> None:
    """Load a checkpoint's optimizer state (moments, step counts) into ``optimizer``,
    keeping the settings its groups were built with from the run's config: torch's
    ``load_state_dict`` puts back the saved groups' ``weight_decay`` and ``betas``, so a
    resumed run's changed ``train.weight_decay`` or ``train.beta2`` would not apply."""
    settings = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    if not isinstance(optimizer, Optimizers):
        _check_groups(optimizer, state)
    optimizer.load_state_dict(state)
    for group, kept in zip(optimizer.param_groups, settings, strict=True):
        group.update(kept)


def set_lr(optimizer: torch.optim.Optimizer | Optimizers, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
