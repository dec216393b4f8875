"""Token classification (named-entity tagging) with an encoder (arch ``encoder``, head
``token``: a linear classifier on every token).

Examples are generated sentences ("On May 3, Alice Martin met Bob in New York.") whose
entities are people (PER), cities (CITY), dates (DATE) and numbers in digits or words
(NUM) (``attnlab.data.generated.tagged_sentences``); sentences are distinct and each lies
in one split. With ``held_out`` > 0, val and test sentences name only people and cities
that no training sentence has (the tagger must read the context, not recall a list).
Every token of ``[CLS] sentence [SEP]`` gets a BIO tag (the specials are ignored): a
token whose text (without its leading whitespace) starts where an entity starts is
``B-X``, one that starts inside it ``I-X`` (a whitespace token inside an entity, e.g. the
space of "New York" at character level, too), every other token ``O``.
Metrics: token accuracy, and entity-level precision, recall and F1 where a predicted
entity counts only if its type and its exact token span equal a gold entity's (entities
are read from tags as in CoNLL's conlleval: ``B-X``, or an ``I-X`` that does not continue
an entity of type X, starts one; ``I-X`` continues it).

Shapes: b batch, t length, n tags.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab.config import _Config, _fail, _positive
from attnlab.data.generated import ENTITY_TYPES, Entity, Splits, TaggedSentence, tagged_sentences
from attnlab.tasks.text import IGNORE, EncoderTextTask, Features, pad

TAGS = ("O", *(f"{prefix}-{label}" for label in ENTITY_TYPES for prefix in "BI"))


@dataclass
class TaggingOptions(_Config):
    """``data.options`` of token-classification: how many sentences, and the split."""

    n_train: int = 8_000
    n_val: int = 500
    n_test: int = 500
    seed: int = 0  # the generator's seed (not the run's)
    held_out: float = 0.0  # of the names and cities: only in val and test examples

    def validate(self, path: str = "data.options") -> None:
        _positive(f"{path}.n_train", self.n_train)
        _positive(f"{path}.n_val", self.n_val)
        _positive(f"{path}.n_test", self.n_test, allow_zero=True)
        # random.Random seeds by absolute value: seed -S would give the data of seed S
        _positive(f"{path}.seed", self.seed, allow_zero=True)
        if not 0.0 <= self.held_out < 1.0:
            _fail(f"{path}.held_out", f"must be in [0, 1), got {self.held_out}")


def bio_tags(spans: Sequence[tuple[int, int]], entities: Sequence[Entity]) -> list[str]:
    """The BIO tag of each token from its character span (leading whitespace excluded,
    see :meth:`~attnlab.tasks.text.TextCodec.encode`) and the entities' spans."""
    tags = []
    for start, end in spans:
        tag = "O"
        for e in entities:
            if start == e.start and end > start:
                tag = f"B-{e.label}"
            elif e.start < start < e.end:
                tag = f"I-{e.label}"
        tags.append(tag)
    return tags


def entity_spans(tags: Sequence[str]) -> list[tuple[str, int, int]]:
    """(label, first, last + 1) token spans of the entities in a BIO tag sequence, read as
    conlleval does: ``B-X`` starts an entity, so does ``I-X`` after anything but a tag of
    type X; ``I-X`` after ``B-X``/``I-X`` continues it."""
    spans: list[tuple[str, int, int]] = []
    current: str | None = None
    for i, tag in enumerate(tags):
        prefix, _, label = tag.partition("-")
        if prefix == "I" and current == label:
            spans[-1] = (label, spans[-1][1], i + 1)
        elif prefix in ("B", "I"):
            spans.append((label, i, i + 1))
            current = label
        else:
            current = None
    return spans


def entity_counts(gold: Sequence[str], predicted: Sequence[str]) -> tuple[int, int, int]:
    """(exact matches, predicted entities, gold entities) of two tag sequences."""
    g, p = set(entity_spans(gold)), set(entity_spans(predicted))
    return len(g & p), len(p), len(g)


def f1_scores(matched: float, n_predicted: float, n_gold: float) -> dict[str, float]:
    """Precision, recall and F1 from counts (0 where a denominator is 0)."""
    precision = matched / n_predicted if n_predicted else 0.0
    recall = matched / n_gold if n_gold else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": precision, "recall": recall, "f1": f1}


class TokenClassification(EncoderTextTask):
    """Tag people, cities, dates and numbers (BIO) in generated sentences; metrics: token
    accuracy and entity-level F1 (exact spans)."""

    name = "token-classification"
    head = "token"
    preset = "bert-tiny-ner"
    options = TaggingOptions
    sum_keys = ("loss_sum", "tokens", "correct", "matched", "predicted", "gold")

    @staticmethod
    def label_names(opts: TaggingOptions | None = None) -> list[str]:
        """The tags, in label order: O, then B-/I- of PER, CITY, DATE, NUM."""
        return list(TAGS)

    def make_data(self, opts: TaggingOptions) -> Splits[TaggedSentence]:
        return tagged_sentences(opts.n_train, opts.n_val, opts.n_test, opts.seed, opts.held_out)

    def texts(self, examples: list[TaggedSentence]) -> list[str]:
        return [s.text for s in examples]

    def featurize(self, examples: list[TaggedSentence]) -> list[Features]:
        index = {tag: i for i, tag in enumerate(TAGS)}
        out = []
        for sentence in examples:
            ids, spans = self.codec.encode(sentence.text)
            labels = [index[t] for t in bio_tags(spans, sentence.entities)]
            out.append(Features(self.codec.single(ids), None, [IGNORE, *labels, IGNORE]))
        return out

    def n_labels(self) -> int:
        return len(TAGS)

    def targets(self, features: list[Features]) -> Tensor:
        return pad([f.target for f in features], IGNORE)

    def loss_terms(self, batch: dict[str, Tensor]) -> Tensor:
        return (batch["targets"] != IGNORE).sum()  # labelled tokens: words differ in pieces

    def batch_sums(self, logits: Tensor, batch: dict[str, Tensor], features: list[Features]):
        labels = batch["targets"]  # (b, t)
        predicted = logits.argmax(-1)  # (b, t)
        tokens = correct = matched = n_pred = n_gold = 0
        # every row's gold and predicted tags, read in one go (one host read per batch)
        for gold_row, pred_row in zip(*torch.stack((labels, predicted)).tolist()):
            pairs = [(g, p) for g, p in zip(gold_row, pred_row) if g != IGNORE]  # labelled
            tokens += len(pairs)
            correct += sum(g == p for g, p in pairs)
            m, p, g = entity_counts([TAGS[g] for g, _ in pairs], [TAGS[p] for _, p in pairs])
            matched, n_pred, n_gold = matched + m, n_pred + p, n_gold + g
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE,
                               reduction="sum")  # fmt: skip
        return {
            "loss_sum": loss,
            "tokens": tokens,
            "correct": correct,
            "matched": matched,
            "predicted": n_pred,
            "gold": n_gold,
        }

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        n = sums["tokens"]
        if n == 0:
            raise ValueError("no tokens to evaluate")
        scores = f1_scores(sums["matched"], sums["predicted"], sums["gold"])
        return {
            "loss": sums["loss_sum"] / n,
            "token_accuracy": sums["correct"] / n,
            "entity_f1": scores["f1"],
            "entity_precision": scores["precision"],
            "entity_recall": scores["recall"],
            "examples": int(sums["examples"]),
        }
