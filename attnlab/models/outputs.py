"""What every model returns, and how auxiliary losses reach the trainer.

Modules that add a training signal of their own (a mixture-of-experts balance loss, a
sparse-attention indexer loss) set ``has_aux = True`` and, at each forward pass, the
attributes ``aux_loss`` (a 0-d tensor or None) and ``aux_metrics`` (name -> value). A loss
over several modules at once (the Switch balance loss over all MoE layers) is pooled: each
module reports its sums in ``aux_stats`` and the model adds those of one ``aux_pool`` and
calls it once. The model sums the losses and gathers the metrics into its output (the
graph goes with the output: the modules keep their losses' values, detached); the trainer
optimises ``loss + aux_loss`` and logs the metrics. Their forward also takes
``real_tokens`` (b, t) bool, False at padding, which the blocks pass when the model has a
padding mask: the statistics and losses count the real tokens only. A module that sets
``trains_alone = True`` (DeepSeek sparse attention's dense warm-up stage) freezes the rest
of the model: when training, the model reports its task loss detached and leaves out the
other modules' auxiliary losses (pooled ones too), so only the losses of the modules
training alone (and the parameters they reach) receive gradients; the optimiser skips
parameters without one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import add

import torch
from torch import Tensor, nn


@dataclass
class ModelOutput:
    """``logits`` (b, t, V) or (b, 1, V) with ``last_only``; ``loss`` the task loss (or
    None without targets); ``aux_loss`` to be added to it when training; ``metrics``.
    Unpacks as ``logits, loss = model(...)``."""

    logits: Tensor
    loss: Tensor | None = None
    aux_loss: Tensor | None = None
    metrics: dict[str, Tensor | float] = field(default_factory=dict)

    def __iter__(self):
        yield self.logits
        yield self.loss

    def __getitem__(self, i: int):
        return (self.logits, self.loss)[i]


# A pytree node, as torch's tuples and dicts are: torch.export.export(model, (idx,)) refused
# an output of an unknown type. (Each subclass is registered beside it.)
torch.export.register_dataclass(ModelOutput, serialized_type_name="attnlab.ModelOutput")

LMOutput = ModelOutput  # the name the decoder's output has always had


def aux_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The submodules that report auxiliary losses (found once, at construction)."""
    return [(n, m) for n, m in model.named_modules() if getattr(m, "has_aux", False)]


def collect_aux(
    modules: list[tuple[str, nn.Module]], *, alone: bool = False
) -> tuple[Tensor | None, dict[str, Tensor | float]]:
    """Sum of the modules' ``aux_loss`` and their ``aux_metrics`` as ``"<module>/<name>"``,
    plus the pooled losses: the ``aux_stats`` (a tuple of tensors) of the modules with equal
    ``aux_pool`` are added and ``aux_pool(*stats)`` is one loss (the Switch balance loss
    over all MoE layers, ``nn.moe.SwitchBalance``). ``alone``: the losses of the modules that
    train alone only (the rest of the model is frozen, so a mixture-of-experts balance loss
    must not reach it); all metrics still."""
    total, metrics = None, {}
    pools: dict[object, tuple[Tensor, ...]] = {}
    for name, m in modules:
        loss = getattr(m, "aux_loss", None)
        stats = getattr(m, "aux_stats", None)
        # the output carries the graph; the module keeps the values (a tensor with a graph
        # held on a module made copy.deepcopy(model) fail after a training pass)
        if loss is not None:
            m.aux_loss = loss.detach()
        if stats is not None:
            m.aux_stats = tuple(s.detach() for s in stats)
        if alone and not getattr(m, "trains_alone", False):
            loss = stats = None
        if loss is not None:
            total = loss if total is None else total + loss
        if stats is not None:
            pool = m.aux_pool
            pools[pool] = stats if pool not in pools else tuple(map(add, pools[pool], stats))
        for key, value in (getattr(m, "aux_metrics", None) or {}).items():
            metrics[f"{name}/{key}"] = value
    for pool, stats in pools.items():
        loss = pool(*stats)
        total = loss if total is None else total + loss
    return total, metrics


def finish_loss(
    modules: list[tuple[str, nn.Module]], loss: Tensor | None, training: bool
) -> tuple[Tensor | None, Tensor | None, dict[str, Tensor | float]]:
    """(loss, aux_loss, metrics) of a forward pass: the modules' auxiliary losses and
    metrics (:func:`collect_aux`); while a module trains alone (training only), the task loss
    detached and only that module's auxiliary loss."""
    if not modules:
        return loss, None, {}
    alone = training and any(getattr(m, "trains_alone", False) for _, m in modules)
    aux_loss, metrics = collect_aux(modules, alone=alone)
    if loss is not None and alone:
        loss = loss.detach()  # reported, not optimised: only the aux losses train
    return loss, aux_loss, metrics


def init_residual_projections(model: nn.Module, std: float, n_layers: int) -> None:
    """GPT-2: the projections that write into the residual stream (marked with
    ``residual_projection = True``) start with std / sqrt(2 * n_layers)."""
    for m in model.modules():
        if getattr(m, "residual_projection", False):
            nn.init.normal_(m.weight, std=std / (2 * n_layers) ** 0.5)
