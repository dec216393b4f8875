"""What the encoder fine-tuning tasks share: BERT's special tokens on top of an attnlab
tokenizer, text -> ids with the character span of every token, padded batches, and a
:class:`Task` base class whose subclasses only say how an example becomes features and how
a batch of logits is scored.

Special tokens take the ids just past the tokenizer's: ``[MASK]`` = V (as in the mlm
task), ``[CLS]`` = V + 1, ``[SEP]`` = V + 2, ``[PAD]`` = V + 3; the model's vocabulary is
V + 4. A single text is fed as ``[CLS] text [SEP]``, a pair as ``[CLS] a [SEP] b [SEP]``
with token types 0 for the first part and 1 for the second (BERT's layout). A tokenizer
with these tokens of its own (an imported Hugging Face BERT's WordPiece ``tokenizer.json``)
keeps its ids for them, in the same layout: :func:`text_codec` picks the codec.

The tokenizer of a fresh run is trained on the task's generated texts with
``data.tokenizer``: ``char`` on the characters of every split (the alphabet: a test text
never holds an unknown character), ``bpe`` (byte-level: no text is ever unknown) on the
training texts only, with at most ``data.bpe_vocab_size`` tokens.

Shapes: b batch, t padded length, n labels.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor, nn

from attnlab.config import ConfigError
from attnlab.functional.softmax import softmax_dtype
from attnlab.tasks.base import StepOutput, Task, eval_mode, model_extras, shard

if TYPE_CHECKING:
    from attnlab.config import DataConfig, ModelConfig, RunConfig
    from attnlab.tokenizers import Tokenizer

SPECIAL_TOKENS = ("[MASK]", "[CLS]", "[SEP]", "[PAD]")  # ids V, V + 1, V + 2, V + 3
# The special tokens a Hugging Face tokenizer may have of its own, in SPECIAL_TOKENS' order:
# BERT's (ModernBERT's too), and RoBERTa's (<s> text </s>, as BERT's [CLS] text [SEP])
OWN_SPECIAL_TOKENS = (SPECIAL_TOKENS, ("<mask>", "<s>", "</s>", "<pad>"))
IGNORE = -100  # a target position with nothing to predict


class TextCodec:
    """An attnlab tokenizer plus BERT's special tokens (ids past the tokenizer's)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        v = tokenizer.vocab_size
        self.mask_id, self.cls_id, self.sep_id, self.pad_id = v, v + 1, v + 2, v + 3

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary: the tokenizer's and the four special tokens."""
        return self.tokenizer.vocab_size + len(SPECIAL_TOKENS)

    def encode(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """(ids, spans): ``spans[i]`` is the (start, end) of token i in ``text`` without the
        whitespace it begins with (byte-level BPE's "Ġ"): "ĠLyon" -> the span of "Lyon"; a
        token of whitespace only has an empty span at its end."""
        if self.tokenizer.kind == "char":  # one token per code point
            ids = self.tokenizer.encode(text)
            offsets = [(i, i + 1) for i in range(len(text))]
        else:
            from attnlab.tokenizers import check_encodable

            encoding = self.tokenizer.hf.encode(check_encodable(text), add_special_tokens=False)
            ids, offsets = list(encoding.ids), list(encoding.offsets)
        spans = []
        for start, end in offsets:
            piece = text[start:end]
            spans.append((start + len(piece) - len(piece.lstrip()), end))
        return ids, spans

    @property
    def unk_id(self) -> int | None:
        """The tokenizer's unknown token ("[UNK]"), or None where it has none."""
        return self.tokenizer.unk_id

    def token_text(self, token: int) -> str:
        """The text of one id (a special token's name for the ids past the tokenizer's)."""
        v = self.tokenizer.vocab_size
        return SPECIAL_TOKENS[token - v] if token >= v else self.tokenizer.decode([token])

    def single(self, ids: Sequence[int]) -> list[int]:
        """``[CLS] ids [SEP]``."""
        return [self.cls_id, *ids, self.sep_id]

    def pair(self, first: Sequence[int], second: Sequence[int]) -> tuple[list[int], list[int]]:
        """(``[CLS] first [SEP] second [SEP]``, token types: 0 up to the first [SEP], then 1)."""
        ids = [self.cls_id, *first, self.sep_id, *second, self.sep_id]
        return ids, [0] * (len(first) + 2) + [1] * (len(second) + 1)


class OwnSpecialsCodec(TextCodec):
    """A tokenizer that has BERT's special tokens itself (the WordPiece tokenizer.json of an
    imported Hugging Face BERT): ``[CLS]``, ``[SEP]``, ``[PAD]`` (and ``[MASK]`` where it
    has one) are its own ids, as transformers' BERT tokenizer lays them out (a RoBERTa
    tokenizer's ``<s>``, ``</s>``, ``<pad>``, ``<mask>`` in their places: ``<s> text </s>``);
    the model's vocabulary is the tokenizer's."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.mask_id, self.cls_id, self.sep_id, self.pad_id = own_special_ids(tokenizer)

    @property
    def vocab_size(self) -> int:
        """The tokenizer's vocabulary (its special tokens included)."""
        return self.tokenizer.vocab_size

    def token_text(self, token: int) -> str:
        """The vocabulary entry of one id (WordPiece's "##" marks a word's continuation)."""
        return self.tokenizer.hf.id_to_token(token)


def own_special_tokens(tokenizer: Tokenizer) -> tuple[str, ...]:
    """The entry of :data:`OWN_SPECIAL_TOKENS` ``tokenizer`` has most of (BERT's on a tie:
    the names attnlab's own special ids are shown by)."""
    if tokenizer.kind == "char":  # "[CLS]" would be five characters
        return SPECIAL_TOKENS
    return max(
        OWN_SPECIAL_TOKENS,
        key=lambda names: sum(tokenizer.hf.token_to_id(t) is not None for t in names),
    )


def own_special_ids(tokenizer: Tokenizer) -> list[int | None]:
    """The ids of [MASK], [CLS], [SEP], [PAD] in ``tokenizer``'s own vocabulary, under BERT's
    names or RoBERTa's (:func:`own_special_tokens`); None where it has none (a character
    tokenizer has none)."""
    if tokenizer.kind == "char":
        return [None] * len(SPECIAL_TOKENS)
    return [tokenizer.hf.token_to_id(token) for token in own_special_tokens(tokenizer)]


def text_codec(tokenizer: Tokenizer) -> TextCodec:
    """The codec of ``tokenizer``: its own [CLS], [SEP] and [PAD] where it has all three (a
    Hugging Face BERT tokenizer), else attnlab's special ids past the tokenizer's."""
    if all(i is not None for i in own_special_ids(tokenizer)[1:]):
        return OwnSpecialsCodec(tokenizer)
    return TextCodec(tokenizer)


def pad(rows: Sequence[Sequence[int]], value: int) -> Tensor:
    """(b, t) int64: ``rows`` padded on the right with ``value`` to the longest."""
    width = max(len(r) for r in rows)
    return torch.tensor([list(r) + [value] * (width - len(r)) for r in rows], dtype=torch.long)


def train_text_tokenizer(
    data: DataConfig, train_texts: Sequence[str], all_texts: Sequence[str]
) -> Tokenizer:
    """The tokenizer of a fresh run (see the module docstring): ``char`` over the
    characters of ``all_texts``, ``bpe`` trained on ``train_texts``."""
    from attnlab.tokenizers import train_tokenizer

    if data.tokenizer == "char":
        return train_tokenizer("char", all_texts)
    return train_tokenizer("bpe", train_texts, data.bpe_vocab_size)


def check_length(n_tokens: int, max_seq_len: int, what: str) -> None:
    """ValueError when ``n_tokens`` (special tokens included) exceed the model's context."""
    if n_tokens > max_seq_len:
        raise ValueError(
            f"{what} is {n_tokens} tokens with [CLS]/[SEP], more than the model's "
            f"max_seq_len={max_seq_len}; shorten it"
        )


@dataclass
class Features:
    """One example as the model sees it: ``ids`` with special tokens, ``type_ids`` (None:
    all 0), the ``target`` (a class id, a label per token, or a (start, end) pair) and
    whatever the metric needs (``extra``)."""

    ids: list[int]
    type_ids: list[int] | None
    target: Any
    extra: Any = None


class EncoderTextTask(Task):
    """Base class of the encoder fine-tuning tasks on generated text. A subclass sets
    ``name``, ``head``, ``preset`` and ``options`` (with n_train, n_val, n_test, seed) and
    implements ``make_data``, ``texts``, ``featurize``, ``n_labels``, ``targets`` and
    ``batch_sums``/``summarize``. Training keys are indices into the training examples;
    the validation set is the val split (``evaluate_split`` scores any split)."""

    head: ClassVar[str] = ""
    preset: ClassVar[str] = ""  # named in errors: the run preset that trains this task
    sum_keys: ClassVar[tuple[str, ...]] = ("loss_sum",)  # what ``batch_sums`` returns
    unit = "examples"

    def __init__(self, cfg: RunConfig, *, tokenizer: Tokenizer | None = None, data=None) -> None:
        super().__init__(cfg, tokenizer=tokenizer, data=data)
        from attnlab.tokenizers import Tokenizer

        self.opts = self.data_options(cfg)
        self.data = data if data is not None else self.make_data(self.opts)
        if tokenizer is None:
            train_texts = self.texts(self.data.train)
            every = train_texts + self.texts(self.data.val) + self.texts(self.data.test)
            tokenizer = train_text_tokenizer(cfg.data, train_texts, every)
        elif not isinstance(tokenizer, Tokenizer):
            raise ConfigError(f"task {self.name} needs a char or bpe tokenizer, got {tokenizer!r}")
        self.tokenizer = tokenizer
        self.codec = text_codec(tokenizer)  # an imported BERT's own [CLS]/[SEP]/[PAD]
        if not self.data.val:
            raise ConfigError(f"data.options.n_val: task {self.name} needs validation examples")
        self.features = {
            split: self.featurize(self.data.split(split)) for split in ("train", "val", "test")
        }
        self.longest = max(len(f.ids) for fs in self.features.values() for f in fs)

    # ------------------------------------------------------------ what subclasses define

    def make_data(self, opts: Any):
        """The generated train / val / test examples (:class:`~attnlab.data.generated.Splits`)."""
        raise NotImplementedError

    def texts(self, examples: list) -> list[str]:
        """The texts of ``examples`` that the tokenizer reads."""
        raise NotImplementedError

    def featurize(self, examples: list) -> list[Features]:
        """``examples`` as model inputs and targets."""
        raise NotImplementedError

    def n_labels(self) -> int:
        """The head's number of outputs."""
        raise NotImplementedError

    def targets(self, features: list[Features]) -> Tensor:
        """The head's targets of a batch (padded with -100 where they are per token)."""
        raise NotImplementedError

    def batch_sums(self, logits: Tensor, batch: dict[str, Tensor], features: list[Features]):
        """Additive metric totals of one evaluation batch (``loss_sum`` among them)."""
        raise NotImplementedError

    # ------------------------------------------------------------ shared

    def configure_model(self, model_cfg: ModelConfig) -> None:
        if model_cfg.arch != "encoder" or getattr(model_cfg, "head", None) != self.head:
            raise ConfigError(
                f"task {self.name} trains an encoder with the {self.head!r} head (arch "
                f"'encoder', head '{self.head}'); use --preset {self.preset}"
            )
        model_cfg.vocab_size = self.codec.vocab_size
        if model_cfg.position.padding_idx is not None:  # RoBERTa's positions: past the [PAD]
            model_cfg.position.padding_idx = self.codec.pad_id
        model_cfg.n_labels = self.n_labels()
        model_cfg.label_names = None  # the task's labels (an imported model's id2label no more)
        # the task trains one label per example (softmax cross-entropy): a multi-label
        # model fine-tuned by it (--init-from) is scored by a softmax from then on
        model_cfg.problem_type = None
        if model_cfg.max_seq_len < self.longest:
            raise ConfigError(
                f"model.max_seq_len={model_cfg.max_seq_len} is shorter than the longest "
                f"example of task {self.name} ({self.longest} tokens); raise it"
            )

    def collate(self, features: list[Features], device=None) -> dict[str, Tensor]:
        """A padded batch: ``idx`` (b, t), ``attention_mask`` (b, t), ``token_type_ids``
        (b, t) when the examples have types, ``targets``."""
        batch = {
            "idx": pad([f.ids for f in features], self.codec.pad_id),
            "attention_mask": pad([[1] * len(f.ids) for f in features], 0),
            "targets": self.targets(features),
        }
        if features[0].type_ids is not None:
            batch["token_type_ids"] = pad([f.type_ids for f in features], 0)
        return {k: v.to(device) for k, v in batch.items()}

    @staticmethod
    def forward(model: nn.Module, batch: dict[str, Tensor], with_targets: bool = True):
        """The model's output on ``batch`` (its loss too when ``with_targets``)."""
        return model(
            batch["idx"],
            attention_mask=batch["attention_mask"],
            token_type_ids=batch.get("token_type_ids"),
            targets=batch["targets"] if with_targets else None,
        )

    def sample(self, n: int, generator: torch.Generator) -> Tensor:
        return torch.randint(0, len(self.features["train"]), (n,), generator=generator)

    def batch(self, keys: Tensor, device: torch.device | str | None = None):
        train = self.features["train"]
        return self.collate([train[i] for i in keys.tolist()], device)

    def step(self, model: nn.Module, batch) -> StepOutput:
        out = self.forward(model, batch)
        aux_loss, metrics = model_extras(out)
        return StepOutput(out.loss, len(batch["idx"]), aux_loss, metrics)

    def split_sums(
        self, model: nn.Module, features: list[Features], batch_size: int, device=None
    ) -> dict[str, float]:
        """The totals of ``batch_sums`` over ``features`` and their number (``examples``)."""
        sums = {"examples": float(len(features)), **dict.fromkeys(self.sum_keys, 0.0)}
        for i in range(0, len(features), batch_size):
            chunk = features[i : i + batch_size]
            batch = self.collate(chunk, device)
            logits = softmax_dtype(self.forward(model, batch, with_targets=False).logits)
            for key, value in self.batch_sums(logits, batch, chunk).items():
                sums[key] += float(value)
        return sums

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
        val = self.features["val"]
        n = len(val) if max_batches is None else min(len(val), batch_size * max_batches)
        mine = shard(n, rank, world_size)
        return self.split_sums(model, val[mine.start : mine.stop], batch_size, device)

    def eval_examples(self, batch_size: int, max_batches: int | None) -> int | None:
        n = len(self.features["val"])
        return n if max_batches is None else min(n, batch_size * max_batches)

    def evaluate_split(
        self, model: nn.Module, split: str, *, batch_size: int = 64, device=None
    ) -> dict[str, float]:
        """The task's metrics on all of ``split`` (train, val or test), in one process."""
        if split not in self.features:
            raise ValueError(f"unknown split {split!r}; choose train, val or test")
        if not self.features[split]:
            raise ValueError(f"the {split} split of task {self.name} is empty")
        with eval_mode(model):
            sums = self.split_sums(model, self.features[split], batch_size, device)
        return self.summarize(sums)
