"""Run records: metrics.jsonl (one JSON object per line), loss.png, optional TensorBoard.

Each record has ``step`` and ``kind``: "train" (train_loss, lr, grad_norm,
``<unit>_per_second`` in the task's unit — tokens_per_second for language modelling —,
elapsed, and the model's own metrics and aux_loss, means over the log interval) or "val"
(``val_<metric>`` for each of the task's metrics: val_loss, val_perplexity, ... for
language modelling; best_val_loss, train_time).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from attnlab.fileio import atomic_path, atomic_write_text

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"
TENSORBOARD_DIR = "tensorboard"


def read_metrics(path: str | os.PathLike[str]) -> list[dict]:
    """The records of a metrics.jsonl file ([] if there is none); a torn last line (a
    kill mid-write) is skipped."""
    path = Path(path)
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def tensorboard_missing() -> str | None:
    """What to do for ``train.tensorboard=true`` here, or None when TensorBoard is installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:
        return (
            "train.tensorboard=true needs the tensorboard package; "
            "pip install tensorboard (or set train.tensorboard=false)"
        )
    return None


class MetricsLogger:
    """Appends records to ``out_dir/metrics.jsonl``; draws ``loss.png``; mirrors scalars
    to TensorBoard when asked. ``history`` seeds it with the records of a resumed run."""

    def __init__(
        self, out_dir: str | os.PathLike[str], *, tensorboard: bool = False, history=()
    ) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / METRICS_FILE
        self.records: list[dict] = list(history)
        # Rewrite the file so it holds exactly the resumed history (drops steps logged
        # after the checkpoint we resume from).
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in self.records))
        self.writer = None
        if tensorboard:
            if (problem := tensorboard_missing()) is not None:
                raise RuntimeError(problem)
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.out_dir / TENSORBOARD_DIR))

    def log(self, kind: str, step: int, **values: Any) -> None:
        record = {"kind": kind, "step": step, **values}
        self.records.append(record)
        try:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as e:
            if e.filename is None:  # a full disk fails the write naming no file
                e.filename = str(self.path)
            raise
        if self.writer is not None:
            for name, value in values.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self.writer.add_scalar(f"{kind}/{name}", value, step)

    def plot(self) -> None:
        """Train and validation loss against step, written atomically to loss.png."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        train = [(r["step"], r["train_loss"]) for r in self.records if r["kind"] == "train"]
        val = [(r["step"], r["val_loss"]) for r in self.records if r["kind"] == "val"]
        fig = Figure(figsize=(6, 4), dpi=100)
        FigureCanvasAgg(fig)  # no pyplot: no global state, no display needed
        ax = fig.add_subplot()
        if train:
            ax.plot(*zip(*train), label="train", linewidth=1)
        if val:
            ax.plot(*zip(*val), "o-", label="validation", markersize=3)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
        if train or val:
            ax.legend()
        fig.tight_layout()
        with atomic_path(self.out_dir / PLOT_FILE) as tmp:
            fig.savefig(tmp, format="png")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
