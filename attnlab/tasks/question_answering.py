"""Extractive question answering with an encoder (arch ``encoder``, head ``qa``: start and
end logits per token), as BERT on SQuAD.

Examples are generated (``attnlab.data.generated.qa_examples``): a context of three to
five facts about two or three people ("Alice was born in 1912. Bob lives in Lyon. Alice
plays the harp.") and a question about one fact ("Where does Bob live?"); the answer is a
span of the context ("Lyon"). Contexts are distinct and each lies in one split; with
``held_out`` > 0, val and test contexts name only people and cities that no training
context has. Input: ``[CLS] question [SEP] context [SEP]``, token types 0 then 1; the
targets are the first
and last context tokens of the answer. The predicted span is the pair (start <= end <
start + ``max_answer_tokens``) of context tokens with the highest start + end logit.
Metrics: exact match and F1 of the predicted text against the answer, over words as in
SQuAD's evaluation (lower-cased, punctuation removed, the articles a/an/the removed,
split on whitespace), with the loss
(the mean of the start and end cross-entropies).

Shapes: b batch, t length, c context tokens.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab.config import ConfigError, ModelConfig, _Config, _fail, _positive
from attnlab.data.generated import QAExample, Splits, qa_examples
from attnlab.models.encoder import mask_padding
from attnlab.tasks.text import EncoderTextTask, Features, TextCodec

_PUNCTUATION = str.maketrans("", "", string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")  # SQuAD's remove_articles, after lower-casing


@dataclass
class QAOptions(_Config):
    """``data.options`` of question-answering: how many contexts, the split, and the
    longest answer (in tokens) a prediction may have."""

    n_train: int = 8_000
    n_val: int = 500
    n_test: int = 500
    seed: int = 0  # the generator's seed (not the run's)
    held_out: float = 0.0  # of the names and cities: only in val and test examples
    max_answer_tokens: int = 30

    def validate(self, path: str = "data.options") -> None:
        _positive(f"{path}.n_train", self.n_train)
        _positive(f"{path}.n_val", self.n_val)
        _positive(f"{path}.n_test", self.n_test, allow_zero=True)
        # random.Random seeds by absolute value: seed -S would give the data of seed S
        _positive(f"{path}.seed", self.seed, allow_zero=True)
        if not 0.0 <= self.held_out < 1.0:
            _fail(f"{path}.held_out", f"must be in [0, 1), got {self.held_out}")
        _positive(f"{path}.max_answer_tokens", self.max_answer_tokens)


def answer_words(text: str) -> list[str]:
    """SQuAD's normalisation (its evaluation script's ``normalize_answer``): lower case,
    punctuation removed, the articles "a", "an" and "the" removed, split on whitespace."""
    return _ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split()


def exact_match(predicted: str, answer: str) -> float:
    """1.0 when the normalised words are equal, else 0.0."""
    return float(answer_words(predicted) == answer_words(answer))


def answer_f1(predicted: str, answer: str) -> float:
    """F1 of the words the two texts share (as multisets), after normalisation; 1.0 when
    both normalise to nothing (SQuAD v2.0's rule; v1.1's script gives 0)."""
    pred, gold = answer_words(predicted), answer_words(answer)
    common = sum((Counter(pred) & Counter(gold)).values())
    if not pred or not gold:
        return float(pred == gold)
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(gold)
    return 2 * precision * recall / (precision + recall)


def best_spans(
    start_logits: Tensor, end_logits: Tensor, lengths: Sequence[int], max_tokens: int
) -> Tensor:
    """(b, 2): per row the span [i, j], i <= j < i + ``max_tokens``, maximising
    start_i + end_j over the row's first ``lengths[row]`` tokens of the (b, c) logits (the
    rest is padding); among ties the first in (i, j) order."""
    c = start_logits.shape[1]
    # only the spans allowed, (c, w) [i, j - i], not all (c, c) pairs: O(c w) for long
    # contexts; row-major in (i, j) as well, so argmax picks the same span among ties
    w = min(max_tokens, c)
    dev = start_logits.device  # (not CPU tensors copied over)
    j = torch.arange(c, device=dev)[:, None] + torch.arange(w, device=dev)[None, :]  # (c, w)
    scores = start_logits[:, :, None] + end_logits[:, j.clamp(max=c - 1)]  # (b, c, w)
    ends_at = torch.tensor(lengths, device=dev).clamp(max=c)[:, None, None]  # (b, 1, 1)
    outside = j >= ends_at  # (b, c, w): spans ending past the row's tokens
    flat = scores.masked_fill(outside, float("-inf")).flatten(1).argmax(1)  # (b,)
    return torch.stack((flat // w, flat // w + flat % w), dim=1)


def best_span(start_logits: Tensor, end_logits: Tensor, max_tokens: int) -> tuple[int, int, float]:
    """(i, j, score): the span i <= j < i + ``max_tokens`` maximising start_i + end_j over
    (c,) logits (:func:`best_spans` of one row); score is p_start(i) * p_end(j) with softmax
    over the c tokens."""
    c = start_logits.shape[0]
    a, b = best_spans(start_logits[None], end_logits[None], [c], max_tokens)[0].tolist()
    p = start_logits.softmax(-1)[a] * end_logits.softmax(-1)[b]
    return a, b, float(p)


def context_logits(logits: Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> Tensor:
    """(b, c, n) of ``logits`` (b, t, n): each row's context tokens, ``lengths[row]`` of
    them from ``offsets[row]``, moved to the front (c the longest context; after a row's
    own the values are padding)."""
    dev, t, c = logits.device, logits.shape[1], max(lengths)
    starts = torch.tensor(offsets, device=dev)[:, None]  # (b, 1)
    index = (starts + torch.arange(c, device=dev)).clamp(max=t - 1)  # (b, c)
    return logits.gather(1, index[..., None].expand(-1, -1, logits.shape[2]))


def encode_question(
    codec: TextCodec, question: str, context: str
) -> tuple[list[int], list[int], int, list[tuple[int, int]]]:
    """(ids, type ids, index of the first context token, context token spans) of
    ``[CLS] question [SEP] context [SEP]``."""
    q_ids, _ = codec.encode(question)
    c_ids, spans = codec.encode(context)
    ids, types = codec.pair(q_ids, c_ids)
    return ids, types, len(q_ids) + 2, spans


def answer_tokens(spans: list[tuple[int, int]], start: int, end: int) -> tuple[int, int]:
    """(first, last) token of the characters ``[start, end)``: the tokens whose text
    overlaps them (whitespace-only tokens never count)."""
    inside = [i for i, (a, b) in enumerate(spans) if a < b and a < end and b > start]
    if not inside:
        raise ValueError(f"no token covers the characters [{start}, {end})")
    return inside[0], inside[-1]


def predict_answer(
    logits: Tensor, offset: int, spans: list[tuple[int, int]], context: str, max_tokens: int
) -> tuple[str, int, int, float]:
    """(text, start, end, score) of the best answer in ``context`` from one example's
    (t, 2) logits, whose context tokens (with character ``spans``) start at ``offset``."""
    window = logits[offset : offset + len(spans)]  # (c, 2)
    i, j, score = best_span(window[:, 0], window[:, 1], max_tokens)
    start, end = spans[i][0], spans[j][1]
    return context[start:end], start, end, score


class QuestionAnswering(EncoderTextTask):
    """Answer questions about generated facts with a span of the context (start/end
    logits); metrics: exact match and word F1 of the predicted span."""

    name = "question-answering"
    head = "qa"
    preset = "bert-tiny-qa"
    options = QAOptions
    sum_keys = ("loss_sum", "exact", "f1_sum")

    def make_data(self, opts: QAOptions) -> Splits[QAExample]:
        return qa_examples(opts.n_train, opts.n_val, opts.n_test, opts.seed, opts.held_out)

    def texts(self, examples: list[QAExample]) -> list[str]:
        return [text for e in examples for text in (e.question, e.context)]

    def featurize(self, examples: list[QAExample]) -> list[Features]:
        out = []
        for e in examples:
            ids, types, offset, spans = encode_question(self.codec, e.question, e.context)
            first, last = answer_tokens(spans, e.start, e.end)
            out.append(Features(ids, types, (offset + first, offset + last), (offset, spans, e)))
        return out

    def configure_model(self, model_cfg: ModelConfig) -> None:
        super().configure_model(model_cfg)
        if model_cfg.type_vocab_size == 1:  # an embedding for type 0 only
            raise ConfigError(
                "model.type_vocab_size=1: question-answering feeds the question as token "
                "type 0 and the context as type 1; set it to 2 (or 0: no token types)"
            )

    def n_labels(self) -> int:
        return 2  # start, end

    def targets(self, features: list[Features]) -> Tensor:
        return torch.tensor([f.target for f in features], dtype=torch.long)  # (b, 2)

    def batch_sums(self, logits: Tensor, batch: dict[str, Tensor], features: list[Features]):
        targets = batch["targets"]  # (b, 2)
        logits = mask_padding(logits, batch.get("attention_mask"))  # as the model's loss
        loss = (
            F.cross_entropy(logits[..., 0], targets[:, 0], reduction="sum")
            + F.cross_entropy(logits[..., 1], targets[:, 1], reduction="sum")
        ) / 2
        # every row's best span at once, read in one go (one host read per batch)
        offsets = [f.extra[0] for f in features]
        lengths = [len(f.extra[1]) for f in features]  # context tokens
        window = context_logits(logits, offsets, lengths)  # (b, c, 2)
        limit = self.opts.max_answer_tokens
        chosen = best_spans(window[..., 0], window[..., 1], lengths, limit).tolist()
        exact = f1 = 0.0
        for (i, j), f in zip(chosen, features):
            _, spans, example = f.extra
            text = example.context[spans[i][0] : spans[j][1]]
            exact += exact_match(text, example.answer)
            f1 += answer_f1(text, example.answer)
        return {"loss_sum": loss, "exact": exact, "f1_sum": f1}

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        n = sums["examples"]
        if n == 0:
            raise ValueError("no examples to evaluate")
        return {
            "loss": sums["loss_sum"] / n,
            "exact_match": sums["exact"] / n,
            "f1": sums["f1_sum"] / n,
            "examples": int(n),
        }
