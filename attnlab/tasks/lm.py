"""Language modelling: next-token prediction over a tokenised corpus (``TokenDataset``).

Training examples are blocks of ``block_size`` tokens at uniformly drawn starts; the
validation set is the first ``batch_size * max_batches`` consecutive, non-overlapping
blocks of the validation split; the metric is the token-weighted mean cross-entropy
(nats), with perplexity and bits per token.

Shapes: b batch, t block size.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from attnlab.tasks.base import StepOutput, Task, model_extras, shard

if TYPE_CHECKING:
    from attnlab.config import ModelConfig, RunConfig
    from attnlab.data import TokenDataset
    from attnlab.tokenizers import Tokenizer

IGNORE_INDEX = -100


def lm_loss_sums(
    model: nn.Module,
    batches: Iterable[tuple[Tensor, Tensor]],
    device: torch.device | str | None = None,
) -> tuple[float, int]:
    """(sum of token losses, number of target tokens) over ``batches`` of (x, y), each
    (b, t). Summing, not averaging, lets callers combine shards (processes, batches).
    The caller chooses the mode (eval) and disables gradients."""
    if device is None:
        device = next(model.parameters()).device
    total, count = 0.0, 0
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        n = int((y != IGNORE_INDEX).sum())
        if n == 0:
            continue  # the model's mean over zero targets is NaN
        loss = model(x, targets=y).loss  # mean over the non-ignored targets
        total += float(loss) * n
        count += n
    return total, count


def strided_windows(n_tokens: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """Overlapping windows over a stream of ``n_tokens`` tokens (the Hugging Face
    "perplexity of fixed-length models" method): (begin, end, scored) with inputs
    tokens[begin:end], targets tokens[begin + 1 : end + 1], of which the last ``scored``
    are counted. Window k starts at k * stride; every target tokens[1:] is scored exactly
    once, each after at least ``window - stride`` tokens of context (all before it in the
    first window). stride == window: non-overlapping blocks."""
    if not 1 <= stride <= window:
        raise ValueError(f"stride must be in [1, window={window}], got {stride}")
    if n_tokens < 2:
        raise ValueError(f"strided evaluation needs at least 2 tokens, got {n_tokens}")
    out, scored_until = [], 0  # targets tokens[1 : scored_until + 1] are done
    for begin in range(0, n_tokens - 1, stride):
        end = min(begin + window, n_tokens - 1)
        out.append((begin, end, end - scored_until))
        scored_until = end
        if end == n_tokens - 1:
            break
    return out


def strided_loss_sums(
    model: nn.Module,
    tokens: Tensor,
    *,
    window: int,
    stride: int,
    batch_size: int = 8,
    max_batches: int | None = None,
    device: torch.device | str | None = None,
) -> tuple[float, int]:
    """(sum of token losses, number of targets) of a 1-D token stream longer than the
    context, scored through :func:`strided_windows` (windows of equal length batched
    together). The caller chooses the mode (eval) and disables gradients."""
    if device is None:
        device = next(model.parameters()).device
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    windows = strided_windows(len(tokens), window, stride)
    groups: list[list[tuple[int, int, int]]] = []
    for w in windows:  # consecutive windows of one length share a batch
        same = groups and len(groups[-1]) < batch_size
        if same and groups[-1][0][1] - groups[-1][0][0] == w[1] - w[0]:
            groups[-1].append(w)
        else:
            groups.append([w])
    if max_batches is not None:
        groups = groups[:max_batches]

    def batches() -> Iterable[tuple[Tensor, Tensor]]:
        for group in groups:
            x = torch.stack([tokens[b:e] for b, e, _ in group])  # (n, t)
            y = torch.stack([tokens[b + 1 : e + 1] for b, e, _ in group])
            for row, (b, e, scored) in enumerate(group):
                y[row, : e - b - scored] = IGNORE_INDEX  # context only: scored before
            yield x, y

    return lm_loss_sums(model, batches(), device)


def lm_summary(total: float, count: int) -> dict[str, float]:
    """Mean loss, perplexity and bits per token from :func:`lm_loss_sums`' totals."""
    if count == 0:
        raise ValueError("no target tokens to evaluate; give at least one non-empty batch")
    loss = total / count
    return {
        "loss": loss,
        "perplexity": math.exp(min(loss, 700.0)),  # exp overflows a float beyond ~709
        "tokens": count,
        "bits_per_token": loss / math.log(2.0),
    }


class LanguageModelling(Task):
    """Decoder-only next-token prediction; the model takes ``(x, targets=y)``."""

    name = "lm"
    unit = "tokens"

    def __init__(
        self,
        cfg: RunConfig,
        *,
        tokenizer: Tokenizer | None = None,
        data: TokenDataset | None = None,
        block_size: int | None = None,
    ) -> None:
        super().__init__(cfg, tokenizer=tokenizer, data=data)
        if data is None:
            from attnlab.data import prepare_data

            data = prepare_data(cfg.data, tokenizer=tokenizer)
        self.data = data
        self.tokenizer = data.tokenizer
        self.block_size = block_size or cfg.train.block_size or cfg.model.max_seq_len
        data.check_block(self.block_size)

    def configure_model(self, model_cfg: ModelConfig) -> None:
        model_cfg.vocab_size = self.tokenizer.vocab_size

    # ------------------------------------------------------------ training

    def sample(self, n: int, generator: torch.Generator) -> Tensor:
        return self.data.sample_starts("train", n, self.block_size, generator)  # (n,)

    def batch(self, keys: Tensor, device: torch.device | str | None = None) -> Any:
        return self.data.batch("train", keys, self.block_size, device)  # x, y: (b, t)

    def step(self, model: nn.Module, batch: Any) -> StepOutput:
        x, y = batch
        out = model(x, targets=y)
        aux_loss, metrics = model_extras(out)
        return StepOutput(loss=out.loss, count=y.numel(), aux_loss=aux_loss, metrics=metrics)

    # ------------------------------------------------------------ evaluation

    def n_eval_blocks(self, batch_size: int, max_batches: int | None) -> int:
        """Blocks in the validation set: the first ``batch_size * max_batches`` of the
        split's consecutive blocks (all of them with None)."""
        n = self.data.n_eval_blocks("val", self.block_size)
        return n if max_batches is None else min(n, batch_size * max_batches)

    def eval_batches(
        self,
        batch_size: int,
        max_batches: int | None = None,
        rank: int = 0,
        world_size: int = 1,
        device: torch.device | str | None = None,
    ) -> Iterable[tuple[Tensor, Tensor]]:
        """This process's (x, y) batches: block j covers x = tokens[j t : (j + 1) t]."""
        mine = shard(self.n_eval_blocks(batch_size, max_batches), rank, world_size)
        starts = torch.arange(mine.start, mine.stop, dtype=torch.int64) * self.block_size
        for chunk in starts.split(batch_size):
            yield self.data.batch("val", chunk, self.block_size, device)

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
        batches = self.eval_batches(batch_size, max_batches, rank, world_size)
        total, count = lm_loss_sums(model, batches, device)
        return {"loss_sum": total, "tokens": float(count)}

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        return lm_summary(sums["loss_sum"], int(sums["tokens"]))
