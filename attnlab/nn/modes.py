"""Training modes: eval mode for a while, then every module's own mode back.

``model.train(was_training)`` after ``model.eval()`` sets every submodule to the model's
flag, switching on dropout in submodules a caller had put in eval mode on purpose (frozen
parts of a model being fine-tuned). These record each module's flag and restore it."""

from __future__ import annotations

from torch import nn

Modes = list[tuple[nn.Module, bool]]


def enter_eval(model: nn.Module) -> Modes:
    """``model.eval()``; returns every module's training flag before, for :func:`restore`."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    return modes


def restore(modes: Modes) -> None:
    """Give each module the training flag :func:`enter_eval` recorded."""
    for module, training in modes:
        module.training = training
