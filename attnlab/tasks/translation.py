"""Translation of numbers into words (``attnlab.data.numbers``): "1234" -> "one thousand,
two hundred and thirty-four", for the Transformer encoder-decoder (arch ``seq2seq``) and
the GRU one with additive attention (``gru-seq2seq``), through the same batches.

Training examples are pairs drawn uniformly from the train split; the loss is the
token-weighted cross-entropy of teacher forcing. The validation set is the first
``batch_size * max_batches`` pairs of the val split (numbers never trained on); the
metric is the exact match of greedy decoding, with the loss. The two character
vocabularies are the run's "tokenizer" (:class:`~attnlab.data.numbers.CharVocabPair`),
saved in every checkpoint.

Shapes: b batch, s source length, t target length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from attnlab.config import ConfigError, _Config, _fail, _positive, _seed
from attnlab.data.numbers import (
    IGNORE_INDEX,
    CharVocabPair,
    NumbersDataset,
    Seq2SeqBatch,
    check_language,
    collate,
    make_numbers_dataset,
)
from attnlab.tasks.base import StepOutput, Task, model_extras, shard

if TYPE_CHECKING:
    from attnlab.config import ModelConfig, RunConfig

SEQ2SEQ_ARCHS = ("seq2seq", "gru-seq2seq")


@dataclass
class NumbersOptions(_Config):
    """``data.options`` of the seq2seq task: the num2words language and the split."""

    lang: str = "en"
    max_number: int = 10_000
    n_train: int = 8_000
    n_val: int = 1_000
    n_test: int = 1_000
    seed: int = 0  # the split's permutation (not the run's seed: runs share the split)

    def validate(self, path: str = "data.options") -> None:
        for name in ("max_number", "n_train"):
            _positive(f"{path}.{name}", getattr(self, name))
        for name in ("n_val", "n_test"):
            _positive(f"{path}.{name}", getattr(self, name), allow_zero=True)
        _seed(f"{path}.seed", self.seed)  # seeds a torch.Generator
        try:
            check_language(self.lang)
        except ValueError as e:
            _fail(f"{path}.lang", str(e))
        if self.n_train + self.n_val + self.n_test > self.max_number:
            _fail(f"{path}.max_number", "must be at least n_train + n_val + n_test")


def batch_to(batch: Seq2SeqBatch, device: torch.device | str | None) -> Seq2SeqBatch:
    return Seq2SeqBatch(*(t.to(device) for t in batch)) if device is not None else batch


def seq2seq_loss(model: nn.Module, batch: Seq2SeqBatch) -> Any:
    """Teacher forcing: both encoder-decoders take these keywords."""
    return model(
        batch.src,
        tgt=batch.tgt_in,
        src_mask=batch.src_mask,
        tgt_mask=batch.tgt_mask,
        targets=batch.tgt_out,
    )


class NumbersTranslation(Task):
    """Numbers written in digits -> words (num2words), split by number so test numbers are
    never seen in training; for the Transformer and the GRU encoder-decoders; metric: exact
    match of greedy decoding."""

    name = "seq2seq"
    unit = "examples"
    options = NumbersOptions

    def __init__(
        self,
        cfg: RunConfig,
        *,
        tokenizer: CharVocabPair | None = None,
        data: NumbersDataset | None = None,
    ) -> None:
        super().__init__(cfg, tokenizer=tokenizer, data=data)
        opts = self.data_options(cfg)
        if data is None:
            data = make_numbers_dataset(
                opts.lang,
                max_number=opts.max_number,
                n_train=opts.n_train,
                n_val=opts.n_val,
                n_test=opts.n_test,
                seed=opts.seed,
            )
        self.data = data
        if tokenizer is None:
            tokenizer = CharVocabPair(data.src_vocab, data.tgt_vocab)
        elif not isinstance(tokenizer, CharVocabPair):
            raise ConfigError(f"task seq2seq needs a CharVocabPair vocabulary, got {tokenizer!r}")
        self.tokenizer = tokenizer
        if not data.val:
            raise ConfigError("data.options.n_val: the seq2seq task needs validation numbers")
        pairs = data.train + data.val + data.test
        self.max_source = max(len(s) for s, _ in pairs)
        self.max_new_tokens = max(len(t) for _, t in pairs) + 1  # the words and EOS

    def configure_model(self, model_cfg: ModelConfig) -> None:
        src, tgt = self.tokenizer.source, self.tokenizer.target
        if model_cfg.arch not in SEQ2SEQ_ARCHS:
            raise ConfigError(
                f"task seq2seq trains an encoder-decoder (arch {' or '.join(SEQ2SEQ_ARCHS)}), "
                f"not arch {model_cfg.arch!r}; use --preset transformer-numbers or gru-numbers"
            )
        model_cfg.vocab_size = len(tgt)
        model_cfg.src_vocab_size = len(src)
        model_cfg.pad_id, model_cfg.bos_id, model_cfg.eos_id = tgt.pad_id, tgt.bos_id, tgt.eos_id
        if model_cfg.position.padding_idx is not None:  # M2M100's positions: past the pad
            model_cfg.position.padding_idx = tgt.pad_id
        if getattr(model_cfg, "share_embeddings", False):
            raise ConfigError(
                "model.share_embeddings: digits and words have their own vocabularies; set "
                "model.share_embeddings=false"
            )
        longest = max(self.max_source, self.max_new_tokens)
        if model_cfg.arch == "seq2seq" and model_cfg.max_seq_len < longest:
            raise ConfigError(
                f"model.max_seq_len={model_cfg.max_seq_len} is shorter than the longest "
                f"sequence of the task ({longest}); raise it"
            )

    # ------------------------------------------------------------ training

    def sample(self, n: int, generator: torch.Generator) -> Tensor:
        return torch.randint(0, len(self.data.train), (n,), generator=generator)

    def batch(self, keys: Tensor, device: torch.device | str | None = None) -> Seq2SeqBatch:
        pairs = [self.data.train[i] for i in keys.tolist()]
        return batch_to(collate(pairs, self.tokenizer.source, self.tokenizer.target), device)

    def loss_terms(self, batch: Seq2SeqBatch) -> Tensor:
        return (batch.tgt_out != IGNORE_INDEX).sum()  # target tokens: lengths differ

    def step(self, model: nn.Module, batch: Seq2SeqBatch) -> StepOutput:
        out = seq2seq_loss(model, batch)
        aux_loss, metrics = model_extras(out)
        return StepOutput(out.loss, len(batch.src), aux_loss, metrics)

    # ------------------------------------------------------------ evaluation

    def translate(
        self,
        model: nn.Module,
        numbers: list[str],
        *,
        num_beams: int = 1,
        length_penalty: float = 0.6,
        style: str = "gnmt",
        device: torch.device | str | None = None,
    ) -> list[str]:
        """Digit strings -> words (greedy, or the best of ``num_beams`` beams). GNMT
        scoring by default: transformers' early stopping (stop at k finished) loses words
        that a shorter near-copy outlives ("thirty" -> "three": 83% exact against 96%
        greedy on a half-trained model)."""
        src_vocab, tgt_vocab = self.tokenizer.source, self.tokenizer.target
        batch = batch_to(collate([(n, "") for n in numbers], src_vocab, tgt_vocab), device)
        beams = {} if num_beams == 1 else {"length_penalty": length_penalty, "style": style}
        out = model.generate(
            batch.src, self.max_new_tokens, src_mask=batch.src_mask, num_beams=num_beams, **beams
        )
        return [tgt_vocab.decode(tokens) for tokens in out]

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
        n = len(self.data.val) if max_batches is None else batch_size * max_batches
        mine = shard(min(n, len(self.data.val)), rank, world_size)
        pairs = self.data.val[mine.start : mine.stop]
        loss_sum = tokens = exact = 0.0
        for i in range(0, len(pairs), batch_size):
            chunk = pairs[i : i + batch_size]
            batch = batch_to(collate(chunk, self.tokenizer.source, self.tokenizer.target), device)
            n_tokens = float(batch.tgt_mask.sum())
            loss_sum += float(seq2seq_loss(model, batch).loss) * n_tokens
            tokens += n_tokens
            words = self.translate(model, [s for s, _ in chunk], device=device)
            exact += sum(w == t for w, (_, t) in zip(words, chunk))
        return {"loss_sum": loss_sum, "tokens": tokens, "exact": exact, "examples": len(pairs)}

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        n = sums["examples"]
        if n == 0:
            raise ValueError("no validation pairs to evaluate")
        return {
            "loss": sums["loss_sum"] / sums["tokens"],
            "exact_match": sums["exact"] / n,
            "examples": int(n),
        }
