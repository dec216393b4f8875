"""Image classification on scikit-learn's 8 x 8 handwritten digits (``attnlab.data.images``)
with a Vision Transformer (arch ``vit``).

Training keys are (image index, dy, dx) drawn from the trainer's generator: the shift
augmentation is part of the key, so a resumed run sees the same augmented images. The
validation set is the held-out split (the first ``batch_size * max_batches`` images);
the metric is accuracy, with the cross-entropy loss.

Shapes: b batch, C channels (1), H = W = 8.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.config import ConfigError, _Config, _fail, _positive, _seed
from attnlab.data.images import ImageSplit, digits, shift
from attnlab.functional.softmax import softmax_dtype
from attnlab.models.vit import normalize_pixels
from attnlab.tasks.base import StepOutput, Task, model_extras, shard

if TYPE_CHECKING:
    from attnlab.config import ModelConfig, RunConfig

N_CLASSES, CHANNELS, SIZE = 10, 1, 8


@dataclass
class DigitsOptions(_Config):
    """``data.options`` of image-classification."""

    test_fraction: float = 0.2
    seed: int = 0  # the split's shuffle (not the run's seed)
    shift: int = 1  # augmentation: random shifts of up to this many pixels (0: none)

    def validate(self, path: str = "data.options") -> None:
        if not 0.0 < self.test_fraction < 1.0:
            _fail(f"{path}.test_fraction", f"must be in (0, 1), got {self.test_fraction}")
        _positive(f"{path}.shift", self.shift, allow_zero=True)
        _seed(f"{path}.seed", self.seed)  # seeds a torch.Generator


class ImageClassification(Task):
    """Classify scikit-learn's 8x8 handwritten digits (random shifts as augmentation);
    metric: accuracy on the held-out images."""

    name = "image-classification"
    unit = "images"
    uses_tokenizer = False
    held_out = "held-out test split (data.options.test_fraction)"
    options = DigitsOptions

    def __init__(self, cfg: RunConfig, *, tokenizer=None, data: ImageSplit | None = None) -> None:
        super().__init__(cfg, tokenizer=None)
        self.opts = self.data_options(cfg)
        self.data = data if data is not None else digits(self.opts.test_fraction, self.opts.seed)

    def configure_model(self, model_cfg: ModelConfig) -> None:
        if model_cfg.arch != "vit":
            raise ConfigError(
                f"task image-classification trains a ViT (arch 'vit'), not {model_cfg.arch!r}; "
                "use --preset vit-digits"
            )
        shape = (model_cfg.channels, model_cfg.image_size, model_cfg.width)
        if shape != (CHANNELS, SIZE, SIZE):
            raise ConfigError(
                f"the digits are {CHANNELS} x {SIZE} x {SIZE} images; the model takes "
                f"{' x '.join(map(str, shape))} (set model.channels, model.image_size)"
            )
        model_cfg.n_classes = N_CLASSES
        model_cfg.class_names = None  # the digits (an imported model's id2label no more)

    # ------------------------------------------------------------ training

    def sample(self, n: int, generator: torch.Generator) -> Tensor:
        index = torch.randint(0, len(self.data.train_y), (n, 1), generator=generator)
        offsets = torch.randint(0, 2 * self.opts.shift + 1, (n, 2), generator=generator)
        return torch.cat((index, offsets), dim=1)  # (n, 3): image, dy, dx

    def batch(self, keys: Tensor, device: torch.device | str | None = None):
        images, labels = self.data.train_x[keys[:, 0]], self.data.train_y[keys[:, 0]]
        if self.opts.shift:
            images = shift(images, keys[:, 1], keys[:, 2], self.opts.shift)
        return normalize_pixels(images, self.cfg.model).to(device), labels.to(device)

    def step(self, model: nn.Module, batch) -> StepOutput:
        images, labels = batch
        out = model(images, targets=labels)
        aux_loss, metrics = model_extras(out)
        return StepOutput(out.loss, len(labels), aux_loss, metrics)

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
        x, y = self.data.test_x, self.data.test_y
        n = len(y) if max_batches is None else min(len(y), batch_size * max_batches)
        mine = shard(n, rank, world_size)
        loss_sum = correct = 0.0
        for start in range(mine.start, mine.stop, batch_size):
            stop = min(start + batch_size, mine.stop)
            images = normalize_pixels(x[start:stop], self.cfg.model).to(device)
            labels = y[start:stop].to(device)
            logits = softmax_dtype(model(images).logits)
            loss_sum += float(F.cross_entropy(logits, labels, reduction="sum"))
            correct += float((logits.argmax(-1) == labels).sum())
        return {"loss_sum": loss_sum, "correct": correct, "examples": float(len(mine))}

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        n = sums["examples"]
        if n == 0:
            raise ValueError("no images to evaluate")
        return {"loss": sums["loss_sum"] / n, "accuracy": sums["correct"] / n, "examples": int(n)}
