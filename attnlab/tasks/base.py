"""The task protocol: what the trainer asks of every task (language modelling, masked LM,
translation, image classification, ...). The trainer owns the loop, optimisation,
checkpoints, processes and time; a task owns its data, its loss and its metrics.

A task is a class registered by name (``attnlab.tasks.TASKS``); the trainer builds it from
the run config and then only calls the methods below. Batches may be anything the task's
``step`` understands (a tuple or a dict of tensors).

Training batches. ``sample(n, generator)`` draws the keys of ``n`` training examples
(e.g. block starts, example indices) from the trainer's shared generator; the trainer
lays the ``n = grad_accum * world_size * batch_size`` keys out as
``(grad_accum, world_size, batch_size, ...)`` and each process takes its column, so a
run's data depends on the global batch only (exact resume, DDP equal to one process).
``batch(keys, device)`` turns one micro-batch of keys into tensors. A task that carries
state from step to step (a streamed memory) saves it through ``state_dict`` and
``load_state_dict``, which the trainer keeps in every checkpoint.

Evaluation. ``eval_sums`` returns additive totals over this process's slice of one fixed
validation set (its size must not depend on the number of processes); the trainer adds
them over processes and ``summarize`` turns the totals into metrics, always with
``"loss"`` (used for the best checkpoint, lower is better).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor, nn

from attnlab.nn.modes import enter_eval, restore

if TYPE_CHECKING:
    from attnlab.config import ModelConfig, RunConfig
    from attnlab.tokenizers import Tokenizer

Metric = float | Tensor  # a Python number or a 0-d tensor


@dataclass
class StepOutput:
    """What one micro-batch gives the trainer."""

    loss: Tensor  # 0-d: the task's main loss, the mean over this micro-batch; reported
    count: int  # units of work in the micro-batch (Task.unit): for throughput
    aux_loss: Tensor | None = None  # 0-d, added to ``loss`` for the gradient (MoE balance)
    metrics: dict[str, Metric] = field(default_factory=dict)  # logged, averaged per interval

    @property
    def objective(self) -> Tensor:
        """What is optimised: the loss plus any auxiliary loss."""
        return self.loss if self.aux_loss is None else self.loss + self.aux_loss


def shard(n: int, rank: int, world_size: int) -> range:
    """The contiguous part of ``range(n)`` that process ``rank`` of ``world_size`` takes;
    the parts cover ``range(n)`` exactly once, their sizes differ by at most one."""
    return range(n * rank // world_size, n * (rank + 1) // world_size)


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """``model.eval()`` and no gradients inside; the training mode it had restored after."""
    modes = enter_eval(model)
    try:
        with torch.no_grad():
            yield
    finally:
        restore(modes)


def model_extras(out: Any) -> tuple[Tensor | None, dict[str, Metric]]:
    """(aux_loss, metrics) of a model output; outputs without them give (None, {})."""
    aux_loss = getattr(out, "aux_loss", None)
    metrics = getattr(out, "metrics", None) or {}
    return aux_loss, dict(metrics)


class Task:
    """Base class of every task; subclasses set ``name`` and ``unit`` and implement the
    methods that raise NotImplementedError."""

    name: ClassVar[str] = ""
    unit: ClassVar[str] = "examples"  # throughput unit: logged as ``<unit>_per_second``
    uses_tokenizer: ClassVar[bool] = True  # False: its inputs are no text (images)
    held_out: ClassVar[str] = "validation split"  # what evaluate() measures, as eval says it
    # A dataclass (a ``_Config``) of the task's own data settings, read from
    # ``cfg.data.options``; None: the task takes none.
    options: ClassVar[type | None] = None

    @classmethod
    def data_options(cls, cfg: RunConfig) -> Any:
        """``cfg.data.options`` parsed by :attr:`options` (ConfigError on unknown keys or
        wrong types, naming ``data.options.<key>``); None for tasks without options."""
        given = cfg.data.options
        if cls.options is None:
            if given:
                from attnlab.config import _fail

                _fail("data.options", f"task {cls.name!r} takes no options, got {sorted(given)}")
            return None
        from attnlab.config import _from_dict

        parsed = _from_dict(cls.options, given, "data.options")
        parsed.validate("data.options")
        return parsed

    def __init__(
        self, cfg: RunConfig, *, tokenizer: Tokenizer | None = None, data: Any = None
    ) -> None:
        """Build (or load) the train and validation data from ``cfg``; ``tokenizer`` is a
        resumed checkpoint's (reuse it), ``data`` a dataset prepared by the caller."""
        self.cfg = cfg
        self.tokenizer = tokenizer

    # ------------------------------------------------------------ set-up

    def configure_model(self, model_cfg: ModelConfig) -> None:
        """Fill in the model fields the data decides (vocabulary size, classes)."""

    # ------------------------------------------------------------ training

    def sample(self, n: int, generator: torch.Generator) -> Tensor:
        """(n, ...) keys of ``n`` training examples drawn with ``generator`` only."""
        raise NotImplementedError

    def batch(self, keys: Tensor, device: torch.device | str | None = None) -> Any:
        """The training batch of ``keys`` (b, ...) on ``device``."""
        raise NotImplementedError

    def step(self, model: nn.Module, batch: Any) -> StepOutput:
        """Forward ``batch`` through ``model`` (train mode, gradients on)."""
        raise NotImplementedError

    def loss_terms(self, batch: Any) -> Tensor | None:
        """0-d: how many terms the loss of ``batch`` is the mean of (its targets that are
        not ignored), for tasks where that differs from batch to batch. The trainer weighs
        each micro-batch by it, so a step's loss is the mean over all its targets, with
        gradient accumulation and in every process, as one large batch's would be. None
        (the default): every batch holds as many, and the micro-batches weigh the same."""
        return None

    def state_dict(self) -> dict[str, Any]:
        """This process's part of the task's training state (what it carries from one step
        to the next, e.g. a model's memory), saved in every checkpoint: tensors, numbers,
        strings, None and lists/dicts of them. Stateless tasks (the default): {}."""
        return {}

    def load_state_dict(self, parts: list[dict[str, Any]]) -> None:
        """Restore a checkpoint's state: ``parts`` holds every process's :meth:`state_dict`
        of the saved run, one per process (their number may differ from this run's)."""

    # ------------------------------------------------------------ evaluation

    def eval_sums(
        self,
        model: nn.Module,
        *,
        batch_size: int,
        max_batches: int | None,
        rank: int = 0,
        world_size: int = 1,
        device: torch.device | str | None = None,
    ) -> dict[str, float]:
        """Additive totals over this process's ``shard`` of the validation set: the
        first ``batch_size * max_batches`` examples (all with None), whatever the number
        of processes. Called in eval mode without gradients."""
        raise NotImplementedError

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        """Metrics from the totals of every process; must include ``"loss"``."""
        raise NotImplementedError

    def eval_examples(self, batch_size: int, max_batches: int | None) -> int | None:
        """How many examples an evaluation with these limits covers (None: unknown)."""
        return None

    def eval_coverage(self, batch_size: int, max_batches: int | None) -> str:
        """What an evaluation with these limits covers, in words (shown to users)."""
        if max_batches is None:
            return "the whole validation set"
        return f"the first {batch_size * max_batches} validation examples at most"

    def eval_batches_needed(
        self, sums: dict[str, float], batch_size: int, rel_tol: float
    ) -> int | None:
        """How many batches an evaluation needs to agree with the whole validation set
        within ``rel_tol`` (relative, 95% confidence), judged from ``sums``; None when
        the whole set is needed or the task cannot tell. The trainer grows its periodic
        evaluations to that size."""
        return None

    def evaluate(
        self,
        model: nn.Module,
        *,
        batch_size: int,
        max_batches: int | None = None,
        device: torch.device | str | None = None,
    ) -> dict[str, float]:
        """The task's metrics on the validation set, in one process."""
        with eval_mode(model):
            sums = self.eval_sums(
                model, batch_size=batch_size, max_batches=max_batches, device=device
            )
        return self.summarize(sums)
