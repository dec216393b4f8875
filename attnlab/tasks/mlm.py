"""Masked language modelling (BERT, Devlin et al. 2019) on a tokenised corpus, for the
encoder (arch ``encoder``, head ``mlm``).

The vocabulary is the corpus tokenizer's plus one id, ``[MASK]`` = tokenizer.vocab_size
(the model's ``vocab_size`` is one larger), or only the tokenizer's where it has a
``[MASK]`` of its own (an imported BERT's WordPiece). Training examples are blocks at uniformly
drawn starts, masked by BERT's rule (15%: 80% [MASK], 10% random, 10% kept); each key
carries a seed for its own masking, so a batch depends on its keys only (exact resume,
any number of processes).

Whole-word masking (``data.options.whole_word=true``) chooses words, not tokens: a
chosen word's tokens are all predicted, each masked, replaced or kept on its own draw (as
in Google's BERT code). Words: a token
continues the word of the token before it when its text begins with a letter and the
previous token's text ends with one; any other token starts a new word. With the char
tokenizer a word is a run of letters (every other character is a word of its own); with
byte-level BPE a token beginning with a space ("Ġcat") or a non-letter starts a word, a
sub-word piece ("is" after "ĠPar") continues it; with an imported BERT's WordPiece a
"##" piece continues the word before it and every other token starts one (its pieces
carry no space). "Letter": ``str.isalpha`` or U+FFFD, what a token holding part of a
multi-byte character decodes to. A block may begin inside a
word: that part is a word of its own. The validation set is the first ``batch_size * max_batches``
consecutive blocks of the validation split, each masked with a seed fixed by its index.
Metrics: the cross-entropy over masked positions (``loss``) and masked-token accuracy.

Shapes: b batch, t block size.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor, nn

from attnlab.config import ConfigError, _Config, _fail
from attnlab.models.encoder import mask_tokens, mask_whole_words
from attnlab.tasks.base import StepOutput, Task, model_extras, shard
from attnlab.tasks.lm import IGNORE_INDEX
from attnlab.tasks.text import own_special_ids

if TYPE_CHECKING:
    from attnlab.config import ModelConfig, RunConfig
    from attnlab.data import TokenDataset
    from attnlab.tokenizers import Tokenizer

EVAL_SEED = 2**31 - 1  # validation block j is masked with seed EVAL_SEED + j


@dataclass
class MLMOptions(_Config):
    """``data.options`` of the mlm task."""

    mask_prob: float = 0.15
    whole_word: bool = False  # choose (and predict) a word's tokens together

    def validate(self, path: str = "data.options") -> None:
        if not 0.0 < self.mask_prob <= 1.0:
            _fail(f"{path}.mask_prob", f"must be in (0, 1], got {self.mask_prob}")


def letter_edges(tokenizer: Tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """(begins, ends) (V,) bool: whether the text of each token id begins / ends with a
    letter (``str.isalpha`` or U+FFFD, a piece of a multi-byte character).

    A WordPiece tokenizer (an imported BERT's) marks a word's continuation itself: its
    pieces carry no space, so "the" "dog" would read as one word and "dog" "##s" as two.
    There a token continues the previous word exactly when it begins with the model's
    continuing-subword prefix ("##"), as transformers' whole-word masking reads it:
    ``begins`` is that prefix, ``ends`` true for every token."""
    if tokenizer.kind == "wordpiece":
        model = json.loads(tokenizer.hf.to_str())["model"]
        prefix = model.get("continuing_subword_prefix") or "##"
        tokens = [tokenizer.hf.id_to_token(i) or "" for i in range(tokenizer.vocab_size)]
        begins = np.array([t.startswith(prefix) and len(t) > len(prefix) for t in tokens])
        return begins, np.ones(len(tokens), dtype=bool)
    texts = [tokenizer.decode([i]) for i in range(tokenizer.vocab_size)]

    def letter(char: str) -> bool:
        return char.isalpha() or char == "\ufffd"

    begins = np.array([bool(t) and letter(t[0]) for t in texts])
    ends = np.array([bool(t) and letter(t[-1]) for t in texts])
    return begins, ends


def word_ids(tokens: Tensor, begins: np.ndarray, ends: np.ndarray) -> Tensor:
    """(t,) word number of each token of a (t,) row: a token continues the previous
    token's word when it begins with a letter and that token ends with one."""
    ids = tokens.numpy()
    starts = np.ones(len(ids), dtype=bool)
    starts[1:] = ~(begins[ids[1:]] & ends[ids[:-1]])
    return torch.from_numpy(np.cumsum(starts) - 1)


class MaskedLanguageModelling(Task):
    """BERT-style masked language modelling (80/10/10 masking, [MASK] one id past the
    tokenizer's); metrics: loss and accuracy on the masked tokens."""

    name = "mlm"
    unit = "tokens"
    options = MLMOptions

    def __init__(
        self,
        cfg: RunConfig,
        *,
        tokenizer: Tokenizer | None = None,
        data: TokenDataset | None = None,
    ) -> None:
        super().__init__(cfg, tokenizer=tokenizer, data=data)
        self.opts = self.data_options(cfg)
        if data is None:
            from attnlab.data import prepare_data

            data = prepare_data(cfg.data, tokenizer=tokenizer)
        self.data = data
        self.tokenizer = data.tokenizer
        # one id past the tokenizer's, or its own (an imported BERT's WordPiece [MASK])
        self.own_mask = own_special_ids(self.tokenizer)[0]
        self.mask_id = self.tokenizer.vocab_size if self.own_mask is None else self.own_mask
        self.block_size = cfg.train.block_size or cfg.model.max_seq_len
        data.check_block(self.block_size)
        self.edges = letter_edges(self.tokenizer) if self.opts.whole_word else None

    def configure_model(self, model_cfg: ModelConfig) -> None:
        if model_cfg.arch != "encoder" or getattr(model_cfg, "head", None) != "mlm":
            raise ConfigError(
                "task mlm trains an encoder with the mlm head (arch 'encoder', head 'mlm'); "
                "use --preset bert-tiny-mlm"
            )
        model_cfg.vocab_size = self.tokenizer.vocab_size + (self.own_mask is None)  # + [MASK]
        if model_cfg.position.padding_idx is not None:
            # RoBERTa's positions count the tokens that are not padding: the padding id must
            # be no text token's. The tokenizer's own (an imported RoBERTa's <pad>), else a
            # [PAD] id past [MASK] (the blocks hold none: every position counts)
            own_pad = own_special_ids(self.tokenizer)[3]
            if own_pad is None:
                own_pad = model_cfg.vocab_size
                model_cfg.vocab_size += 1
            model_cfg.position.padding_idx = own_pad

    def mask(self, blocks: Tensor, seeds: Tensor) -> tuple[Tensor, Tensor]:
        """(inputs, targets) (b, t): each row masked by a generator seeded with its seed."""
        inputs, targets = [], []
        # Random replacements are the tokenizer's tokens (never attnlab's [MASK]).
        rule = dict(mask_id=self.mask_id, vocab_size=self.tokenizer.vocab_size,
                    mask_prob=self.opts.mask_prob)  # fmt: skip
        for row, seed in zip(blocks, seeds.tolist()):
            g = torch.Generator().manual_seed(int(seed))
            if self.edges is None:
                x, y = mask_tokens(row[None], generator=g, **rule)
            else:
                words = word_ids(row, *self.edges)[None]  # (1, t)
                x, y = mask_whole_words(row[None], words, generator=g, **rule)
            inputs.append(x)
            targets.append(y)
        return torch.cat(inputs), torch.cat(targets)

    # ------------------------------------------------------------ training

    def sample(self, n: int, generator: torch.Generator) -> Tensor:
        # any block of the split, the last one too (no next token to predict, as in lm)
        high = len(self.data.train) - self.block_size + 1
        starts = torch.randint(0, high, (n,), generator=generator)  # (n,)
        seeds = torch.randint(0, 2**62, (n,), generator=generator)
        return torch.stack((starts, seeds), dim=1)  # (n, 2)

    def batch(self, keys: Tensor, device: torch.device | str | None = None):
        blocks = self.data.windows("train", keys[:, 0], self.block_size)  # (b, t)
        inputs, targets = self.mask(blocks, keys[:, 1])
        return inputs.to(device), targets.to(device)

    def loss_terms(self, batch) -> Tensor:
        return (batch[1] != IGNORE_INDEX).sum()  # the masked positions: random in number

    def step(self, model: nn.Module, batch) -> StepOutput:
        inputs, targets = batch
        out = model(inputs, targets=targets)
        aux_loss, metrics = model_extras(out)
        return StepOutput(out.loss, inputs.numel(), aux_loss, metrics)

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
        n = len(self.data.val) // self.block_size  # whole blocks: no next token needed
        n = n if max_batches is None else min(n, batch_size * max_batches)
        mine = shard(n, rank, world_size)
        index = torch.arange(mine.start, mine.stop, dtype=torch.int64)
        loss_sum = correct = count = 0.0
        for chunk in index.split(batch_size):
            blocks = self.data.windows("val", chunk * self.block_size, self.block_size)
            inputs, targets = self.mask(blocks, EVAL_SEED + chunk)
            inputs, targets = inputs.to(device), targets.to(device)
            chosen = targets != -100
            n_masked = float(chosen.sum())
            if n_masked == 0:
                continue
            out = model(inputs, targets=targets)
            loss_sum += float(out.loss) * n_masked
            correct += float((out.logits.argmax(-1) == targets)[chosen].sum())
            count += n_masked
        return {"loss_sum": loss_sum, "correct": correct, "masked_tokens": count}

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        n = sums["masked_tokens"]
        if n == 0:
            raise ValueError("no masked tokens to evaluate; evaluate more blocks")
        accuracy = sums["correct"] / n
        return {"loss": sums["loss_sum"] / n, "accuracy": accuracy, "masked_tokens": int(n)}
