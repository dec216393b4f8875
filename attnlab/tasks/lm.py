"""Language modelling: next-token prediction over a tokenised corpus (``TokenDataset``).

Training examples are blocks of ``block_size`` tokens at uniformly drawn starts. The
validation split is cut into consecutive, non-overlapping blocks; an evaluation limited to
``batch_size * max_batches`` of them takes a fixed random sample (the same blocks every
time, spread over the whole split, each smaller sample a subset of every larger one),
and ``max_batches=None`` takes them all. The metric is the token-weighted mean
cross-entropy (nats), with perplexity and bits per token.

Packed documents (``data.options.pack_documents=true``): blocks still start anywhere in
the stream, but the corpus's documents (each file of a folder, each topic of the embedded
corpus; a single file is one document) are kept apart inside a block: the model gets
document ids, so no token attends across a boundary and positions restart at 0 in each
document, and the first token of a document is not a target (predicting it from the
previous document's context means nothing), in training and evaluation alike.

Shapes: b batch, t block size.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.config import ConfigError, _Config
from attnlab.functional.softmax import softmax_dtype
from attnlab.tasks.base import StepOutput, Task, model_extras, shard

if TYPE_CHECKING:
    from attnlab.config import ModelConfig, RunConfig
    from attnlab.data import TokenDataset
    from attnlab.tokenizers import Tokenizer

IGNORE_INDEX = -100
EVAL_SAMPLE_SEED = 0  # fixes which validation blocks a limited evaluation takes
Z_95 = 1.96  # two-sided 95% normal quantile


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
    """Overlapping windows over a stream of ``n_tokens`` tokens (the sliding window of
    Hugging Face's "perplexity of fixed-length models", with each window also predicting
    the token after its last input): (begin, end, scored) with inputs tokens[begin:end],
    targets tokens[begin + 1 : end + 1], of which the last ``scored`` are counted. Window k
    starts at k * stride; every target tokens[1:] is scored exactly once, each after at
    least ``window - stride`` tokens of context (all before it in the first window).
    stride == window: non-overlapping blocks, every token scored. (Hugging Face's recipe
    takes its targets inside each window: one token less of context for each, and with
    stride == window the first token of every window goes unscored.)"""
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


def strided_groups(
    spans: list[tuple[int, int]],
    window: int,
    stride: int,
    batch_size: int = 8,
    max_batches: int | None = None,
) -> list[list[tuple[int, int, int]]]:
    """The batches of :func:`strided_loss_sums`: the :func:`strided_windows` of each span
    (begin, end) of the stream (a document: no window crosses into the next, and a span's
    first token is never a target), consecutive windows of one length batched together, at
    most ``max_batches`` batches. Spans of fewer than 2 tokens have no targets."""
    windows = [
        (b0 + b, b0 + e, scored)
        for b0, e0 in spans
        if e0 - b0 >= 2
        for b, e, scored in strided_windows(e0 - b0, window, stride)
    ]
    groups: list[list[tuple[int, int, int]]] = []
    for w in windows:  # consecutive windows of one length share a batch
        same = groups and len(groups[-1]) < batch_size
        if same and groups[-1][0][1] - groups[-1][0][0] == w[1] - w[0]:
            groups[-1].append(w)
        else:
            groups.append([w])
    return groups if max_batches is None else groups[:max_batches]


def strided_loss_sums(
    model: nn.Module,
    tokens: Tensor,
    *,
    window: int,
    stride: int,
    batch_size: int = 8,
    max_batches: int | None = None,
    device: torch.device | str | None = None,
    documents: list[tuple[int, int]] | None = None,
) -> tuple[float, int]:
    """(sum of token losses, number of targets) of a 1-D token stream longer than the
    context, scored through :func:`strided_windows` (windows of equal length batched
    together); with ``documents`` ((begin, end) spans: packed documents), each document's
    windows on their own, as the model saw documents in training. The caller chooses the
    mode (eval) and disables gradients."""
    if device is None:
        device = next(model.parameters()).device
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    if len(tokens) < 2:
        raise ValueError(f"strided evaluation needs at least 2 tokens, got {len(tokens)}")
    spans = documents if documents is not None else [(0, len(tokens))]
    groups = strided_groups(spans, window, stride, batch_size, max_batches)

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


@dataclass
class LMOptions(_Config):
    """``data.options`` of the lm task: ``pack_documents`` keeps the corpus's documents
    apart inside each block (document mask, positions restarting per document)."""

    pack_documents: bool = False

    def validate(self, path: str = "data.options") -> None:
        """Nothing to check beyond the type (a bool)."""


class LanguageModelling(Task):
    """Decoder-only next-token prediction; the model takes ``(x, targets=y)``, and
    ``doc_ids`` too with ``data.options.pack_documents``."""

    name = "lm"
    unit = "tokens"
    options = LMOptions

    def __init__(
        self,
        cfg: RunConfig,
        *,
        tokenizer: Tokenizer | None = None,
        data: TokenDataset | None = None,
        block_size: int | None = None,
        eval_sample: bool = True,
    ) -> None:
        super().__init__(cfg, tokenizer=tokenizer, data=data)
        self.pack_documents = self.data_options(cfg).pack_documents
        if data is None:
            from attnlab.data import prepare_data

            data = prepare_data(cfg.data, tokenizer=tokenizer)
        self.data = data
        self.tokenizer = data.tokenizer
        self.block_size = block_size or cfg.train.block_size or cfg.model.max_seq_len
        self.eval_sample = eval_sample  # False: a limited evaluation takes the first blocks
        data.check_block(self.block_size)

    def configure_model(self, model_cfg: ModelConfig) -> None:
        """Set the vocabulary size; with packed documents, check the model can take
        document ids (ConfigError naming ``data.options.pack_documents`` otherwise)."""
        model_cfg.vocab_size = self.tokenizer.vocab_size
        if self.pack_documents:
            from attnlab.models.build import MODELS

            check = getattr(MODELS.get(model_cfg.arch), "documents_unsupported", None)
            reason = (
                f"model arch {model_cfg.arch!r} takes no document ids"
                if check is None
                else check(model_cfg)
            )
            if reason:
                raise ConfigError(
                    f"data.options.pack_documents: {reason}, or set "
                    "data.options.pack_documents=false"
                )

    def blocks(
        self, split: str, starts: Tensor, device: torch.device | str | None = None
    ) -> tuple[Tensor, ...]:
        """The blocks at ``starts``: (x, y) (b, t), or with packed documents (x, y, doc_ids),
        y ignoring (-100) the first token of each document."""
        x, y = self.data.batch(split, starts, self.block_size)
        if not self.pack_documents:
            return x.to(device), y.to(device)
        docs = self.data.document_ids(split, starts, self.block_size + 1)  # (b, t + 1)
        y = y.masked_fill(docs[:, 1:] != docs[:, :-1], IGNORE_INDEX)  # a new document starts
        return x.to(device), y.to(device), docs[:, :-1].to(device)

    # ------------------------------------------------------------ training

    def sample(self, n: int, generator: torch.Generator) -> Tensor:
        return self.data.sample_starts("train", n, self.block_size, generator)  # (n,)

    def batch(self, keys: Tensor, device: torch.device | str | None = None) -> Any:
        return self.blocks("train", keys, device)  # x, y (, doc_ids): (b, t)

    def loss_terms(self, batch: Any) -> Tensor | None:
        if not self.pack_documents:
            return None  # every block predicts all its tokens
        return (batch[1] != IGNORE_INDEX).sum()  # less each document's first token

    def step(self, model: nn.Module, batch: Any) -> StepOutput:
        x, y, *docs = batch
        out = model(x, targets=y, **({"doc_ids": docs[0]} if docs else {}))
        aux_loss, metrics = model_extras(out)
        return StepOutput(loss=out.loss, count=y.numel(), aux_loss=aux_loss, metrics=metrics)

    # ------------------------------------------------------------ evaluation

    def n_eval_blocks(self, batch_size: int, max_batches: int | None) -> int:
        """Blocks in the validation set: ``batch_size * max_batches`` of the split's
        consecutive blocks (all of them with None, or when the split has fewer)."""
        n = self.data.n_eval_blocks("val", self.block_size)
        return n if max_batches is None else min(n, batch_size * max_batches)

    def eval_examples(self, batch_size: int, max_batches: int | None) -> int:
        return self.n_eval_blocks(batch_size, max_batches)

    def eval_block_indices(self, batch_size: int, max_batches: int | None) -> Tensor:
        """(n,) sorted indices of the validation blocks evaluated: a fixed random sample
        of the split's blocks (the first n of one seeded permutation), or all of them."""
        total = self.data.n_eval_blocks("val", self.block_size)
        n = self.n_eval_blocks(batch_size, max_batches)
        if n >= total or not self.eval_sample:
            return torch.arange(n, dtype=torch.int64)
        generator = torch.Generator().manual_seed(EVAL_SAMPLE_SEED)
        return torch.randperm(total, generator=generator)[:n].sort().values

    def eval_coverage(self, batch_size: int, max_batches: int | None) -> str:
        total = self.data.n_eval_blocks("val", self.block_size)
        n = self.n_eval_blocks(batch_size, max_batches)
        if n >= total:
            return f"all {total} validation blocks of {self.block_size} tokens"
        if not self.eval_sample:
            return f"the first {n} of {total} validation blocks of {self.block_size} tokens"
        return (
            f"a fixed random sample of {n} of {total} validation blocks of "
            f"{self.block_size} tokens ({100 * n / total:.0f}%)"
        )

    def eval_batches_needed(
        self, sums: dict[str, float], batch_size: int, rel_tol: float
    ) -> int | None:
        """Batches a sample needs for its mean loss to lie within ``rel_tol`` (relative)
        of the whole split's with 95% confidence, from the spread of the block losses in
        ``sums`` (finite-population corrected); None when the whole split is needed."""
        total = self.data.n_eval_blocks("val", self.block_size)
        n = sums.get("blocks", 0.0)
        if n < 2:
            return None
        mean = sums["block_loss_sum"] / n
        var = max(0.0, sums["block_loss_sq"] / n - mean * mean) * n / (n - 1)
        if mean <= 0:
            return None
        n0 = (Z_95 * math.sqrt(var) / (rel_tol * mean)) ** 2
        needed = n0 / (1 + (n0 - 1) / total) if total > 1 else total
        if needed >= total:
            return None
        return max(1, math.ceil(needed / batch_size))

    def eval_batches(
        self,
        batch_size: int,
        max_batches: int | None = None,
        rank: int = 0,
        world_size: int = 1,
        device: torch.device | str | None = None,
    ) -> Iterable[tuple[Tensor, ...]]:
        """This process's (x, y) batches (x, y, doc_ids with packed documents): block j
        covers x = tokens[j t : (j + 1) t]."""
        blocks = self.eval_block_indices(batch_size, max_batches)
        mine = shard(len(blocks), rank, world_size)
        starts = blocks[mine.start : mine.stop] * self.block_size
        for chunk in starts.split(batch_size):
            yield self.blocks("val", chunk, device)

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
        if device is None:
            device = next(model.parameters()).device
        total, count, blocks, block_sum, block_sq = 0.0, 0, 0, 0.0, 0.0
        for x, y, *docs in self.eval_batches(batch_size, max_batches, rank, world_size, device):
            logits = model(x, **({"doc_ids": docs[0]} if docs else {})).logits  # (b, t, V)
            losses = F.cross_entropy(
                softmax_dtype(logits).flatten(0, 1), y.flatten(), reduction="none"
            ).view(y.shape)  # (b, t); ignored targets give 0
            scored = (y != IGNORE_INDEX).sum(dim=1)  # (b,)
            per_block = losses.sum(dim=1) / scored.clamp(min=1)  # (b,)
            total += float(losses.sum())
            count += int(scored.sum())
            blocks += len(per_block)
            block_sum += float(per_block.sum())
            block_sq += float((per_block * per_block).sum())
        return {
            "loss_sum": total,
            "tokens": float(count),
            "blocks": float(blocks),
            "block_loss_sum": block_sum,
            "block_loss_sq": block_sq,
        }

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        return lm_summary(sums["loss_sum"], int(sums["tokens"]))
