"""Streamed language modelling with a memory carried across steps: how Transformer-XL
trains and evaluates (Dai et al. 2019; its ``batchify`` and ``mems``).

Training. The train split is cut into B contiguous rows, B the global batch
(``batch_size * grad_accum * processes``): row r is tokens[r n : (r + 1) n] with
n = len // B. Step k reads segment k of every row, x = row[k t : (k + 1) t] and y the next
tokens, and feeds the model the memory (detached) that segment k - 1 of the same row left.
After the last whole segment (an epoch) every row starts again from its first segment with
an empty memory. A key is (row, start, segment); the trainer lays the B keys out as
(grad_accum, processes, batch_size), so each micro-batch and each process reads its own
rows and keeps their memory. The segment counter and every row's memory are the task's
state (:meth:`state_dict`), saved in each checkpoint, so a resumed run continues exactly;
a resumed run must keep the global batch (the rows) and train.block_size (the segments).

Validation. The validation split is cut into ``batch_size`` streams the same way (the
number of processes does not change them; each process scores its share of the streams),
each read segment by segment with its memory; ``max_batches`` scores the first that many
segments of every stream, None all of them. Metrics: token-weighted mean loss, perplexity,
bits per token, as language modelling's.

Shapes: b rows, t segment (block) length, m memory length, d d_model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.config import _fail
from attnlab.data.corpus import DataError
from attnlab.functional.softmax import softmax_dtype
from attnlab.tasks.base import StepOutput, Task, model_extras, shard
from attnlab.tasks.lm import lm_summary

if TYPE_CHECKING:
    from attnlab.config import ModelConfig, RunConfig
    from attnlab.data import TokenDataset
    from attnlab.tokenizers import Tokenizer


def stream_rows(n_tokens: int, rows: int, segment: int, what: str) -> tuple[int, int]:
    """(row length n, whole segments per row) of a split of ``n_tokens`` cut into ``rows``
    contiguous rows (Transformer-XL's batchify); DataError when a row cannot hold one
    segment and its next token."""
    n = n_tokens // rows
    if n < segment + 1:
        raise DataError(
            f"the {what} split ({n_tokens} tokens) cut into {rows} streams gives {n} tokens "
            f"each, fewer than a segment of block_size={segment} + 1; lower the batch size "
            "or train.block_size"
        )
    return n, (n - 1) // segment


@torch.no_grad()
def stream_loss_sums(
    model: nn.Module,
    streams: Tensor,
    segment: int,
    *,
    max_segments: int | None = None,
    device: torch.device | str | None = None,
) -> tuple[float, int]:
    """(sum of token losses, number of targets) of ``streams`` (b, n), each read in
    consecutive segments of ``segment`` tokens with the model's memory carried from one
    to the next (the first segment has none). Every target streams[:, 1:] is scored once
    (the last segment may be shorter); ``max_segments`` stops early. The caller chooses
    the mode (eval)."""
    if device is None:
        device = next(model.parameters()).device
    streams = streams.to(device)
    n = streams.shape[1] - 1
    total, count, memory = 0.0, 0, None
    for k, start in enumerate(range(0, n, segment)):
        if max_segments is not None and k >= max_segments:
            break
        end = min(start + segment, n)
        x, y = streams[:, start:end], streams[:, start + 1 : end + 1]  # (b, t)
        out = model(x, memory=memory)
        logits = softmax_dtype(out.logits).flatten(0, 1)  # (b t, V)
        total += float(F.cross_entropy(logits, y.flatten(), reduction="sum"))
        count += y.numel()
        memory = out.memory
    return total, count


class StreamingLanguageModelling(Task):
    """Next-token prediction over contiguous streams with the model's memory carried from
    each step to the next (the model takes ``(x, memory=..., targets=y)`` and returns
    ``.memory``: Transformer-XL)."""

    name = "lm-stream"
    unit = "tokens"

    def __init__(
        self,
        cfg: RunConfig,
        *,
        tokenizer: Tokenizer | None = None,
        data: TokenDataset | None = None,
    ) -> None:
        super().__init__(cfg, tokenizer=tokenizer, data=data)
        if data is None:
            from attnlab.data import prepare_data

            data = prepare_data(cfg.data, tokenizer=tokenizer)
        self.data = data
        self.tokenizer = data.tokenizer
        self.block_size = cfg.train.block_size or cfg.model.max_seq_len
        data.check_block(self.block_size)
        # the validation streams, checked now: not after training, at its first evaluation
        stream_rows(len(data.val), cfg.train.batch_size, self.block_size, "validation")
        self.rows: int | None = None  # training rows: the global batch, fixed at the 1st step
        self.segment = 0  # training steps taken: the next one reads segment segment % n_seg
        self.memory: dict[int, list[Tensor]] = {}  # row -> per layer (m, d), no gradient

    def configure_model(self, model_cfg: ModelConfig) -> None:
        from attnlab.models.build import MODELS

        model_cfg.vocab_size = self.tokenizer.vocab_size
        if not hasattr(MODELS.get(model_cfg.arch), "new_memory"):
            _fail(
                "model.arch",
                f"task lm-stream carries a memory between segments, which {model_cfg.arch!r} "
                "models do not keep; use arch xl (e.g. --preset xl-tiny) or task lm",
            )

    # ------------------------------------------------------------ training

    def sample(self, n: int, generator: torch.Generator) -> Tensor:
        """(n, 3) keys (row, start, segment) of the next segment of every row. The order
        is fixed (``generator`` is not used); each call advances to the next segment."""
        if self.rows is None:
            self.rows = n
        elif n != self.rows:
            _fail(
                "train.batch_size",
                f"task lm-stream reads {self.rows} rows (the global batch this run started "
                f"with), got {n}; keep batch_size * grad_accum * processes at {self.rows} "
                "to continue it",
            )
        row_len, n_seg = stream_rows(len(self.data.train), n, self.block_size, "train")
        k = self.segment % n_seg
        self.segment += 1
        rows = torch.arange(n, dtype=torch.int64)
        starts = rows * row_len + k * self.block_size
        return torch.stack((rows, starts, torch.full_like(rows, k)), dim=1)  # (n, 3)

    def batch(self, keys: Tensor, device: torch.device | str | None = None) -> Any:
        x, y = self.data.batch("train", keys[:, 1], self.block_size, device)  # (b, t)
        return {"rows": keys[:, 0].tolist(), "first": int(keys[0, 2]) == 0, "x": x, "y": y}

    def step(self, model: nn.Module, batch: Any) -> StepOutput:
        rows, x, y = batch["rows"], batch["x"], batch["y"]
        memory = None
        if not batch["first"]:  # the memory these rows' previous segment left
            per_row = [self.memory[r] for r in rows]
            memory = [torch.stack(layer).to(x.device) for layer in zip(*per_row)]  # (b, m, d)
        out = model(x, memory=memory, targets=y)
        for i, r in enumerate(rows):
            self.memory[r] = [m[i].detach() for m in out.memory]
        aux_loss, metrics = model_extras(out)
        return StepOutput(loss=out.loss, count=y.numel(), aux_loss=aux_loss, metrics=metrics)

    def state_dict(self) -> dict[str, Any]:
        """The segment counter, the rows, the segment length and this process's rows'
        memory (on the CPU)."""
        mine = sorted(self.memory)
        layers = zip(*(self.memory[r] for r in mine)) if mine else ()
        return {
            "segment": self.segment,
            "rows": self.rows,
            "block_size": self.block_size,
            "memory_rows": mine,
            "memory": [torch.stack(layer).cpu() for layer in layers],  # per layer (r, m, d)
        }

    def load_state_dict(self, parts: list[dict[str, Any]]) -> None:
        """Every process's part: the same counter, and together every row's memory. The
        segment length must be the saved run's: the counter and the memory place each row
        at a token of the stream that another length would not continue (the memory would
        hold the new segment's own tokens, its targets among them)."""
        self.memory = {}
        for part in parts:
            saved = part.get("block_size")  # absent from checkpoints that predate it
            if saved is not None and int(saved) != self.block_size:
                _fail(
                    "train.block_size",
                    f"task lm-stream continues each row's stream in segments of {saved} "
                    f"tokens (the run being resumed), got {self.block_size}; keep it at "
                    f"{saved} to continue it",
                )
            self.segment, self.rows = int(part["segment"]), part["rows"]
            for i, r in enumerate(part["memory_rows"]):
                self.memory[int(r)] = [layer[i] for layer in part["memory"]]

    # ------------------------------------------------------------ evaluation

    def _eval_segments(self, batch_size: int, max_batches: int | None) -> int:
        _, n_seg = stream_rows(len(self.data.val), batch_size, self.block_size, "validation")
        return n_seg if max_batches is None else min(n_seg, max_batches)

    def eval_examples(self, batch_size: int, max_batches: int | None) -> int:
        """Segments scored: ``batch_size`` streams x the segments read from each."""
        return batch_size * self._eval_segments(batch_size, max_batches)

    def eval_coverage(self, batch_size: int, max_batches: int | None) -> str:
        k = self._eval_segments(batch_size, max_batches)
        _, n_seg = stream_rows(len(self.data.val), batch_size, self.block_size, "validation")
        first = "all" if k == n_seg else f"the first {k} of"
        return (
            f"{first} {n_seg} consecutive segments of {self.block_size} tokens, with memory, "
            f"in each of {batch_size} validation streams"
        )

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
        row_len, _ = stream_rows(len(self.data.val), batch_size, self.block_size, "validation")
        k = self._eval_segments(batch_size, max_batches)
        mine = shard(batch_size, rank, world_size)
        if not mine:
            return {"loss_sum": 0.0, "tokens": 0.0}
        # This process's streams, each the k segments it scores and the next token.
        val = torch.as_tensor(self.data.val[: batch_size * row_len].astype("int64"))
        streams = val.view(batch_size, row_len)[mine.start : mine.stop, : k * self.block_size + 1]
        total, count = stream_loss_sums(model, streams, self.block_size, device=device)
        return {"loss_sum": total, "tokens": float(count)}

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        return lm_summary(sums["loss_sum"], int(sums["tokens"]))
