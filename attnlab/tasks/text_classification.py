"""Text classification with an encoder (arch ``encoder``, head ``sequence``: BERT's pooled
[CLS] token -> a linear classifier): which language a number is written in.

Each example is a number below ``max_number`` written in words by ``num2words`` in one of
``langs`` ("vingt et un" -> fr, "einundzwanzig" -> de); the label is the language's index
in ``langs``. Numbers are split into train / val / test, so no test number is ever seen
in training, in any language; texts that two languages share ("six": en and fr) are left
out (``attnlab.data.generated.number_languages``). Input: ``[CLS] words [SEP]``.
Metric: accuracy, with the cross-entropy loss.

Shapes: b batch, t length, n languages.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab.config import _Config, _fail, _positive
from attnlab.data.generated import Splits, number_languages
from attnlab.tasks.text import EncoderTextTask, Features

DEFAULT_LANGS = ("en", "fr", "de", "es", "it", "pt")


@dataclass
class LanguageOptions(_Config):
    """``data.options`` of text-classification: the languages and the split by number."""

    langs: list[str] = field(default_factory=lambda: list(DEFAULT_LANGS))
    max_number: int = 10_000
    n_train: int = 2_000  # numbers; each gives one example per language
    n_val: int = 250
    n_test: int = 250
    seed: int = 0  # the split's permutation (not the run's seed)

    def validate(self, path: str = "data.options") -> None:
        from attnlab.data.numbers import check_language

        if len(self.langs) < 2 or len(set(self.langs)) != len(self.langs):
            _fail(f"{path}.langs", f"needs at least two distinct languages, got {self.langs}")
        for lang in self.langs:
            try:
                check_language(lang)
            except ValueError as e:
                _fail(f"{path}.langs", str(e))
        _positive(f"{path}.max_number", self.max_number)
        _positive(f"{path}.n_train", self.n_train)
        _positive(f"{path}.n_val", self.n_val)
        _positive(f"{path}.n_test", self.n_test, allow_zero=True)
        # random.Random seeds by absolute value: seed -S would give the data of seed S
        _positive(f"{path}.seed", self.seed, allow_zero=True)
        if self.n_train + self.n_val + self.n_test > self.max_number:
            _fail(f"{path}.max_number", "must be at least n_train + n_val + n_test")


class TextClassification(EncoderTextTask):
    """Which language a number is written in (num2words, en/fr/de/es/it/pt by default),
    split by number; sequence classification from the pooled [CLS]; metric: accuracy."""

    name = "text-classification"
    head = "sequence"
    preset = "bert-tiny-langid"
    options = LanguageOptions
    sum_keys = ("loss_sum", "correct")

    @staticmethod
    def label_names(opts: LanguageOptions) -> list[str]:
        """The class names, in label order: the language codes."""
        return list(opts.langs)

    def make_data(self, opts: LanguageOptions) -> Splits[tuple[str, int]]:
        return number_languages(
            opts.langs,
            max_number=opts.max_number,
            n_train=opts.n_train,
            n_val=opts.n_val,
            n_test=opts.n_test,
            seed=opts.seed,
        )

    def texts(self, examples: list[tuple[str, int]]) -> list[str]:
        return [text for text, _ in examples]

    def featurize(self, examples: list[tuple[str, int]]) -> list[Features]:
        return [Features(self.codec.single(self.codec.encode(t)[0]), None, y) for t, y in examples]

    def n_labels(self) -> int:
        return len(self.opts.langs)

    def targets(self, features: list[Features]) -> Tensor:
        return torch.tensor([f.target for f in features], dtype=torch.long)

    def batch_sums(self, logits: Tensor, batch: dict[str, Tensor], features: list[Features]):
        labels = batch["targets"]
        return {
            "loss_sum": F.cross_entropy(logits, labels, reduction="sum"),
            "correct": (logits.argmax(-1) == labels).sum(),
        }

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        n = sums["examples"]
        if n == 0:
            raise ValueError("no examples to evaluate")
        return {"loss": sums["loss_sum"] / n, "accuracy": sums["correct"] / n, "examples": int(n)}
