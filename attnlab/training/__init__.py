"""Training: the loop, optimiser and schedule, checkpoint io, evaluation and metrics."""

from attnlab.training.checkpoint import (
    Checkpoint,
    CheckpointError,
    load_checkpoint,
    save_checkpoint,
)
from attnlab.training.evaluate import evaluate
from attnlab.training.optim import build_optimizer, lr_at, parameter_groups
from attnlab.training.trainer import TrainingError, TrainResult, train

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "TrainResult",
    "TrainingError",
    "build_optimizer",
    "evaluate",
    "load_checkpoint",
    "lr_at",
    "parameter_groups",
    "save_checkpoint",
    "train",
]
