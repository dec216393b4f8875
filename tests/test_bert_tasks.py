"""The encoder (BERT) applications: the generated data of the three fine-tuning tasks
(splits disjoint, tags aligned with tokens, answers slicing back to their text), their
metrics on small cases derived by hand, each task learning, checkpointing, evaluating and
resuming exactly through the real trainer, and whole-word masking for the mlm task."""

from __future__ import annotations

import json
import os
import random
import signal

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from attnlab.cli.main import main
from attnlab.config import ConfigError
from attnlab.data.corpus import DataError
from attnlab.data.generated import (
    CITIES,
    EVERYONE,
    FIRST_NAMES,
    MONTHS,
    SURNAMES,
    WEEKDAYS,
    distinct_splits,
    number_languages,
    qa_examples,
    tagged_sentences,
)
from attnlab.data.numbers import number_to_words
from attnlab.models.encoder import mask_padding, mask_whole_words
from attnlab.presets import get_run_preset
from attnlab.tasks import TASKS
from attnlab.tasks.mlm import letter_edges, word_ids
from attnlab.tasks.question_answering import (
    answer_f1,
    answer_tokens,
    answer_words,
    best_span,
    best_spans,
    context_logits,
    encode_question,
    exact_match,
)
from attnlab.tasks.text import IGNORE, TextCodec
from attnlab.tasks.token_classification import (
    TAGS,
    bio_tags,
    entity_counts,
    entity_spans,
    f1_scores,
)
from attnlab.tokenizers import train_tokenizer
from attnlab.training import load_checkpoint, train
from attnlab.training.metrics import read_metrics

# --------------------------------------------------------------------------- generated data


def test_languages_are_split_by_number_and_ambiguous_texts_left_out():
    langs = ["en", "fr", "es", "pt"]
    data = number_languages(langs, max_number=120, n_train=80, n_val=20, n_test=20, seed=3)
    # Every number below 120 in every language, read back: text -> (number, language).
    written = {}
    for n in range(120):
        for label, lang in enumerate(langs):
            written.setdefault(number_to_words(n, lang), []).append((n, label))
    numbers = {}
    for split in ("train", "val", "test"):
        pairs = data.split(split)
        for text, label in pairs:
            assert written[text] == [(written[text][0][0], label)]  # unambiguous, right label
        numbers[split] = {written[text][0][0] for text, _ in pairs}
    assert not numbers["train"] & numbers["val"] and not numbers["train"] & numbers["test"]
    assert not numbers["val"] & numbers["test"]
    assert len(numbers["train"]) == 80  # every number keeps its unambiguous languages
    shared = {text for text, where in written.items() if len(where) > 1}
    assert "six" in shared and "cinco" in shared  # en/fr, es/pt
    kept = {text for split in ("train", "val", "test") for text, _ in data.split(split)}
    assert not kept & shared


def is_date(text: str) -> bool:
    """A weekday, or a real calendar day written as "March 3", "3 March 1990", "March 3,
    1990" or "Monday, March 3" (a day without a year is read in the leap year 2000)."""
    from datetime import datetime

    if text in WEEKDAYS:
        return True
    for form in ("%d %B %Y", "%B %d, %Y", "%B %d %Y", "%A, %B %d %Y"):
        for written in (text, f"{text} 2000"):
            try:
                datetime.strptime(written, form)
                return True
            except ValueError:
                pass
    return False


def test_tagged_sentences_entities_and_held_out_names():
    data = tagged_sentences(400, 60, 60, seed=1, held_out=0.25)
    in_words = {number_to_words(n) for n in range(2, 1000)}  # a NUM may be written out
    seen, unseen = EVERYONE.split(0.25, seed=1)
    texts = {split: {s.text for s in data.split(split)} for split in ("train", "val", "test")}
    assert len(texts["train"]) == 400 and not texts["train"] & (texts["val"] | texts["test"])
    assert not texts["val"] & texts["test"]
    for split in ("train", "val", "test"):
        names = seen if split == "train" else unseen
        for sentence in data.split(split):
            for label, text in sentence.spans():
                if label == "PER":
                    first, *last = text.split(" ")
                    assert first in names.first_names and all(w in names.surnames for w in last)
                elif label == "CITY":
                    assert text in names.cities
                elif label == "DATE":
                    assert any(w in text for w in MONTHS + WEEKDAYS)
                    assert is_date(text), text
                else:
                    # words may open the sentence, capitalised
                    assert text.lower() in in_words or 2 <= int(text.replace(",", "")) <= 20_000
    assert set(seen.cities) | set(unseen.cities) == set(CITIES)
    assert not set(seen.first_names) & set(unseen.first_names)
    assert len(unseen.surnames) == round(0.25 * len(SURNAMES))
    # a small fraction still holds out three of each (a QA context names up to three people)
    _, few = EVERYONE.split(0.01, seed=1)
    assert len(few.first_names) == len(few.surnames) == len(few.cities) == 3
    assert len(qa_examples(20, 5, 5, seed=1, held_out=0.01).test) == 5
    assert tagged_sentences(50, 5, 5, seed=1) == tagged_sentences(50, 5, 5, seed=1)
    assert tagged_sentences(50, 5, 5, seed=1) != tagged_sentences(50, 5, 5, seed=2)


def test_qa_answers_are_spans_of_their_context():
    data = qa_examples(300, 40, 40, seed=0, held_out=0.25)
    _, unseen = EVERYONE.split(0.25, seed=0)
    contexts = {s: {e.context for e in data.split(s)} for s in ("train", "val", "test")}
    assert not contexts["train"] & contexts["val"] and not contexts["val"] & contexts["test"]
    assert not contexts["train"] & contexts["test"]  # no test example is seen in training
    # also without held-out names, where only the split itself keeps the contexts apart
    plain = qa_examples(300, 40, 40, seed=0)
    keys = {s: [e.context for e in plain.split(s)] for s in ("train", "val", "test")}
    assert sum(map(len, keys.values())) == len(set().union(*keys.values())) == 380
    for split in ("train", "val", "test"):
        for e in data.split(split):
            assert e.context[e.start : e.end] == e.answer
            # The fact holding the answer is about the person the question names.
            sentence = e.context[: e.start].rsplit(". ", 1)[-1]
            person = next(name for name in FIRST_NAMES if f" {name}" in f" {e.question[:-1]}")
            assert person in sentence
            if split != "train":
                assert person in unseen.first_names


# The facts and questions as the module documents them, written out here independently:
# relation -> (fact pattern, question pattern); a fact's groups are (person, value).
QA_FACTS = {
    "born": (r"(\w+) was born in (\d{4})", r"When was (\w+) born\?"),
    "lives": (r"(\w+) lives in ([A-Z][A-Za-z ]+)", r"Where does (\w+) live\?"),
    "job": (r"(\w+) works as a (\w+)", r"What is the job of (\w+)\?"),
    "colour": (r"The favourite colour of (\w+) is (\w+)", r"What colour does (\w+) like best\?"),
    "plays": (r"(\w+) plays the (\w+)", r"Which instrument does (\w+) play\?"),
    "cats": (r"(\w+) has (\d) cats", r"How many cats does (\w+) have\?"),
}


def test_qa_question_asks_the_one_fact_whose_value_is_the_answer():
    """Read every context back into (person, relation) -> value by the fact patterns: no
    person-relation pair is stated twice (two values would make the question ambiguous),
    and the question's person and relation name the fact whose value is the answer, at
    ``start``."""
    import re

    data = qa_examples(200, 20, 20, seed=3)
    for e in data.train + data.val + data.test:
        facts = {}
        sentences = e.context[:-1].split(". ")
        assert 3 <= len(sentences) <= 5, e.context
        offset = 0
        for sentence in sentences:
            [(relation, match)] = [
                (r, m) for r, (fact, _) in QA_FACTS.items() if (m := re.fullmatch(fact, sentence))
            ]
            key = (match.group(1), relation)
            assert key not in facts, e.context  # each pair stated once
            facts[key] = (match.group(2), offset + match.start(2))
            offset += len(sentence) + 2
        [(relation, match)] = [
            (r, m) for r, (_, q) in QA_FACTS.items() if (m := re.fullmatch(q, e.question))
        ]
        assert facts[(match.group(1), relation)] == (e.answer, e.start), (e.context, e.question)


def test_distinct_splits_keep_every_key_once_and_say_when_too_few_exist():
    data = distinct_splits(lambda rng: rng.randrange(10), str, 5, 2, 3, seed=0)
    drawn = data.train + data.val + data.test
    assert (len(data.train), len(data.val), len(data.test)) == (5, 2, 3)
    assert sorted(drawn) == list(range(10))  # ten distinct draws of ten values
    with pytest.raises(DataError, match="only 10 distinct examples"):
        distinct_splits(lambda rng: rng.randrange(10), str, 5, 3, 3, seed=0)


@pytest.mark.parametrize("make", [tagged_sentences, qa_examples])
def test_held_out_leaving_too_few_names_for_training_is_a_clear_error(make):
    """Holding out nearly every name leaves training too few to fill its slots (a QA
    context names up to three people): a DataError naming held_out, not an IndexError or
    a "sample larger than population" from inside the generator."""
    from attnlab.data.corpus import DataError

    def left(names, held_out):  # what training keeps of a list (see Fillers.split)
        return len(names) - max(3, round(held_out * len(names)))

    for held_out in (0.9, 0.93, 0.95, 0.99):
        enough = min(left(v, held_out) for v in (FIRST_NAMES, SURNAMES, CITIES)) >= 1
        if enough and (make is tagged_sentences or left(FIRST_NAMES, held_out) >= 3):
            assert len(make(30, 5, 5, seed=0, held_out=held_out).train) == 30
        else:
            with pytest.raises(DataError, match=f"held_out={held_out} leaves"):
                make(30, 5, 5, seed=0, held_out=held_out)


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_tags_are_aligned_with_tokens(kind):
    data = tagged_sentences(200, 10, 10, seed=0)
    texts = [s.text for s in data.train]
    codec = TextCodec(train_tokenizer(kind, texts, vocab_size=400))
    for sentence in data.train:
        ids, spans = codec.encode(sentence.text)
        tags = bio_tags(spans, sentence.entities)
        assert len(tags) == len(ids)
        # Reading the entities back from the tags gives each entity's text and label.
        found = [
            (label, sentence.text[spans[a][0] : spans[b - 1][1]])
            for label, a, b in entity_spans(tags)
        ]
        assert found == sentence.spans()


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_tag_text_words_take_their_first_token_reading_the_tokens_once(kind):
    """``attnlab tag``'s words each show the tag of their first token (the search over all
    tokens per word, below), found reading the token spans a few times over, not once per
    word (a long text's words times its tokens)."""
    import re
    from types import SimpleNamespace

    from attnlab.cli.tag import tag_text

    text = "  Alice met Bob in Paris, on Monday 3 May.\n\nThey  talked. " * 30
    codec = TextCodec(train_tokenizer(kind, [text], vocab_size=300))
    ids, spans = codec.encode(text)
    reads = 0

    class Spans(list):  # counts the spans read
        def __iter__(self):
            nonlocal reads
            for span in super().__iter__():
                reads += 1
                yield span

        def __getitem__(self, i):
            nonlocal reads
            reads += 1
            return super().__getitem__(i)

    counted = SimpleNamespace(
        encode=lambda t: (ids, Spans(spans)), single=codec.single, token_text=codec.token_text,
        unk_id=codec.unk_id,
    )  # fmt: skip
    logits = torch.randn(1, len(ids) + 2, len(TASKS["token-classification"].label_names()),
                         generator=torch.Generator().manual_seed(0))  # fmt: skip
    report = tag_text(lambda x: SimpleNamespace(logits=logits), counted, text, 10**6)
    tags = [report["tokens"][i]["tag"] for i in range(len(ids))]
    words = list(re.finditer(r"\S+", text))
    assert len(report["words"]) == len(words)
    for got, word in zip(report["words"], words):
        first = next(
            (i for i, (a, b) in enumerate(spans) if a < b and word.start() <= a < word.end()), None
        )
        assert got == {"word": word.group(), "tag": tags[first] if first is not None else "O"}
    assert reads <= 5 * len(spans)


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_answer_tokens_slice_back_to_the_answer(kind):
    data = qa_examples(100, 5, 5, seed=0)
    texts = [t for e in data.train for t in (e.question, e.context)]
    codec = TextCodec(train_tokenizer(kind, texts, vocab_size=400))
    for e in data.train:
        ids, types, offset, spans = encode_question(codec, e.question, e.context)
        first, last = answer_tokens(spans, e.start, e.end)
        assert e.context[spans[first][0] : spans[last][1]] == e.answer
        assert ids[offset - 1] == codec.sep_id and types[offset] == 1 and types[offset - 1] == 0
        assert len(ids) == offset + len(spans) + 1


# --------------------------------------------------------------------------- metrics


def test_entity_spans_read_as_conlleval():
    tags = ["B-PER", "I-PER", "O", "I-CITY", "I-CITY", "B-DATE", "B-DATE", "I-NUM", "I-DATE"]
    # B starts; I continues an entity of its type; an I of another type starts a new one.
    assert entity_spans(tags) == [
        ("PER", 0, 2), ("CITY", 3, 5), ("DATE", 5, 6), ("DATE", 6, 7), ("NUM", 7, 8),
        ("DATE", 8, 9),
    ]  # fmt: skip


def test_entity_f1_on_hand_checked_cases():
    gold = ["B-PER", "I-PER", "O", "B-CITY", "O"]
    # The PER span is cut short: only CITY matches. 1 of 2 predicted, 1 of 2 gold.
    assert entity_counts(gold, ["B-PER", "O", "O", "B-CITY", "O"]) == (1, 2, 2)
    assert f1_scores(1, 2, 2) == {"precision": 0.5, "recall": 0.5, "f1": 0.5}
    # Both found, plus two spurious entities: precision 2/4, recall 2/2, F1 = 2PR/(P+R).
    assert entity_counts(gold, ["B-PER", "I-PER", "B-NUM", "B-CITY", "B-DATE"]) == (2, 4, 2)
    assert f1_scores(2, 4, 2)["f1"] == pytest.approx(2 * 0.5 * 1.0 / 1.5)
    # The right span with the wrong type does not count.
    assert entity_counts(gold, ["B-NUM", "I-NUM", "O", "B-CITY", "O"]) == (1, 2, 2)
    assert f1_scores(0, 0, 3) == {"precision": 0.0, "recall": 0.0, "f1": 0.0}


def test_answer_metrics_on_hand_checked_cases():
    assert exact_match("Lyon.", "lyon") == 1.0 and exact_match("in Lyon", "Lyon") == 0.0
    # "the old red car" vs "red car": "the" goes (an article), 2 shared words of
    # ["old", "red", "car"]: precision 2/3, recall 1.
    assert answer_f1("the old red car", "red car") == pytest.approx(2 * (2 / 3) / (2 / 3 + 1))
    assert answer_f1("blue", "red car") == 0.0 and answer_f1("", "") == 1.0


def test_answer_metrics_drop_articles_as_squad():
    # SQuAD v1.1's evaluate-v1.1.py (normalize_answer: lower, remove punctuation, remove
    # articles a/an/the, collapse whitespace) gives exact match 1.0 and F1 1.0 for each of
    # these; the generated facts read "plays the {V}" and "works as a {V}", so a span
    # taking the article is right by SQuAD's scoring (without article removal: EM 0, F1 2/3).
    for predicted, answer in (("the harp", "harp"), ("a teacher", "Teacher"),
                              ("An apple.", "apple"), ("the red car", "red car")):  # fmt: skip
        assert exact_match(predicted, answer) == 1.0, predicted
        assert answer_f1(predicted, answer) == 1.0, predicted
    # Only whole words are articles: "theatre" and "an" inside "piano" stay.
    assert answer_words("The theatre, a piano") == ["theatre", "piano"]
    # "in the harp" vs "harp": ["in", "harp"] vs ["harp"]: precision 1/2, recall 1, F1 2/3.
    assert exact_match("in the harp", "harp") == 0.0
    assert answer_f1("in the harp", "harp") == pytest.approx(2 / 3)


def test_best_span_equals_brute_force():
    g = torch.Generator().manual_seed(0)
    for c, limit in ((1, 3), (7, 3), (12, 30), (9, 1)):
        start, end = torch.randn(c, generator=g), torch.randn(c, generator=g)
        i, j, score = best_span(start, end, limit)
        pairs = [(a, b) for a in range(c) for b in range(a, min(c, a + limit))]
        want = max(pairs, key=lambda p: float(start[p[0]] + end[p[1]]))
        assert (i, j) == want
        p = start.softmax(-1)[i] * end.softmax(-1)[j]
        assert score == pytest.approx(float(p))


def test_best_span_work_is_bounded_by_the_answer_length():
    """Over a long context the search scores the (c, max_tokens) spans allowed, not all
    (c, c) pairs: its largest tensor, seen by a dispatch mode, has c * max_tokens values at
    most. Ties go to the first span in (start, end) order, as over all pairs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    self.numel = max(self.numel, t.numel())
            return out

    g = torch.Generator().manual_seed(0)
    c, limit = 2000, 8
    start, end = torch.randn(c, generator=g), torch.randn(c, generator=g)
    with Largest() as largest:
        best_span(start, end, limit)
    assert largest.numel <= c * limit
    for c, limit in ((6, 3), (9, 20), (30, 4)):  # integer logits: many ties
        start = torch.randint(0, 3, (c,), generator=g).float()
        end = torch.randint(0, 3, (c,), generator=g).float()
        pairs = [(a, b) for a in range(c) for b in range(a, min(c, a + limit))]
        want = max(pairs, key=lambda p: float(start[p[0]] + end[p[1]]))  # the first best
        assert best_span(start, end, limit)[:2] == want


def _best_span_before(start_logits, end_logits, max_tokens):
    """best_span as it was before the batched search: one context, two host reads."""
    c = start_logits.shape[0]
    w = min(max_tokens, c)
    dev = start_logits.device
    j = torch.arange(c, device=dev)[:, None] + torch.arange(w, device=dev)[None, :]  # (c, w)
    scores = start_logits[:, None] + end_logits[j.clamp(max=c - 1)]  # (c, w)
    flat = int(scores.masked_fill(j >= c, float("-inf")).argmax())
    a, b = flat // w, flat // w + flat % w
    p = start_logits.softmax(-1)[a] * end_logits.softmax(-1)[b]
    return a, b, float(p)


def test_best_spans_of_a_batch_equal_the_search_of_each_row():
    """The batched search picks each row's span of the one-row search before it: random
    contexts (offsets, lengths, answer limits), integer logits (many ties), padding at
    -inf, and contexts whose logits are all -inf (every span ties at -inf)."""
    g = torch.Generator().manual_seed(0)
    rng = random.Random(0)
    for trial in range(300):
        b, t = rng.randint(1, 6), rng.randint(2, 40)
        logits = torch.randn(b, t, 2, generator=g) * 3
        if trial % 2:
            logits = logits.round()  # ties
        lengths = [rng.randint(1, t - 1) for _ in range(b)]
        offsets = [rng.randint(1, t - c) for c in lengths]
        for r, (o, c) in enumerate(zip(offsets, lengths)):
            logits[r, o + c :] = float("-inf")  # padding, as mask_padding leaves it
            if rng.random() < 0.1:
                logits[r, o : o + c, rng.randint(0, 1)] = float("-inf")
        limit = rng.randint(1, 45)
        window = context_logits(logits, offsets, lengths)  # (b, c, 2)
        got = best_spans(window[..., 0], window[..., 1], lengths, limit).tolist()
        for r, (o, c) in enumerate(zip(offsets, lengths)):
            row = logits[r, o : o + c]
            want = _best_span_before(row[:, 0], row[:, 1], limit)
            assert got[r] == list(want[:2])
            i, j, score = best_span(row[:, 0], row[:, 1], limit)  # the one-row wrapper
            assert (i, j) == want[:2]
            assert score == want[2] or np.isnan(score) and np.isnan(want[2])  # nan: all -inf


def _qa_sums_before(task, logits, batch, features):
    """QuestionAnswering.batch_sums before the batched search: a search per row."""
    targets = batch["targets"]
    logits = mask_padding(logits, batch.get("attention_mask"))
    loss = (
        F.cross_entropy(logits[..., 0], targets[:, 0], reduction="sum")
        + F.cross_entropy(logits[..., 1], targets[:, 1], reduction="sum")
    ) / 2
    exact = f1 = 0.0
    for row, f in zip(logits, features):
        offset, spans, example = f.extra
        window = row[offset : offset + len(spans)]
        i, j, _ = _best_span_before(window[:, 0], window[:, 1], task.opts.max_answer_tokens)
        text = example.context[spans[i][0] : spans[j][1]]
        exact += exact_match(text, example.answer)
        f1 += answer_f1(text, example.answer)
    return {"loss_sum": loss, "exact": exact, "f1_sum": f1}


def _tagging_sums_before(task, logits, batch, features):
    """TokenClassification.batch_sums before one read per batch: two reads per row."""
    labels = batch["targets"]
    real = labels != IGNORE
    predicted = logits.argmax(-1)
    matched = n_pred = n_gold = 0
    for gold_row, pred_row, keep in zip(labels, predicted, real):
        gold = [TAGS[i] for i in gold_row[keep].tolist()]
        pred = [TAGS[i] for i in pred_row[keep].tolist()]
        m, p, g = entity_counts(gold, pred)
        matched, n_pred, n_gold = matched + m, n_pred + p, n_gold + g
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE,
                           reduction="sum")  # fmt: skip
    return {
        "loss_sum": loss,
        "tokens": real.sum(),
        "correct": (predicted == labels)[real].sum(),
        "matched": matched,
        "predicted": n_pred,
        "gold": n_gold,
    }


@pytest.mark.parametrize(
    "name, before",
    [("question-answering", _qa_sums_before), ("token-classification", _tagging_sums_before)],
)
def test_evaluation_reads_each_batch_once_and_scores_as_per_row(name, before, host_reads):
    """An evaluation batch's spans / tags reach the host in one read (the per-row twins read
    once or twice per row), and only the loss is left for the evaluation loop to read; the
    sums equal the twins' on random logits (integer ones too: ties), exactly."""
    task = TASKS[name](small_run(name))
    g = torch.Generator().manual_seed(0)
    features = task.features["val"] + task.features["test"]
    for trial, start in enumerate(range(0, len(features), 7)):
        chunk = features[start : start + 7]
        batch = task.collate(chunk)
        logits = torch.randn(*batch["idx"].shape, task.n_labels(), generator=g) * 4
        if trial % 2:
            logits = logits.round()  # ties
        host_reads.clear()
        got = task.batch_sums(logits, batch, chunk)
        assert len(host_reads) == 1, host_reads
        assert [k for k, v in got.items() if isinstance(v, torch.Tensor)] == ["loss_sum"]
        host_reads.clear()
        want = before(task, logits, batch, chunk)
        assert len(host_reads) >= len(chunk)  # the twin: a read (or two) per row
        assert {k: float(v) for k, v in got.items()} == {k: float(v) for k, v in want.items()}


@pytest.mark.parametrize("name", ["text-classification", "token-classification"])
def test_evaluation_loss_of_a_bf16_model_is_summed_in_float32(name):
    """A bf16 model (``attnlab eval --dtype bfloat16``): the evaluation's loss sum is the
    float64 cross-entropy of the model's own bf16 logits to float32's rounding (1e-5
    relative); summed in bf16 it would be about 0.5% off."""
    from attnlab.models import build_model

    task = TASKS[name](small_run(name))
    cfg = task.cfg.model
    task.configure_model(cfg)
    torch.manual_seed(0)
    model = build_model(cfg).eval().bfloat16()
    chunk = task.features["val"][:16]
    with torch.no_grad():  # as evaluate_split and the trainer call it (eval_mode)
        got = task.split_sums(model, chunk, batch_size=16)["loss_sum"]
    batch = task.collate(chunk)
    with torch.no_grad():
        logits = task.forward(model, batch, with_targets=False).logits
    assert logits.dtype == torch.bfloat16
    labels = batch["targets"]
    want = F.cross_entropy(
        logits.double().flatten(0, -2), labels.flatten(), ignore_index=IGNORE, reduction="sum"
    )
    assert got == pytest.approx(float(want), rel=1e-5)


# --------------------------------------------------------------------------- tasks and trainer

SMALL_MODEL = {"model.d_model": 32, "model.ffn.hidden_dim": 64, "train.batch_size": 8,
               "train.warmup_steps": 5, "train.eval_batches": 2, "train.log_every": 1,
               "train.seed": 0, "train.device": "cpu", "train.time_budget": None}  # fmt: skip
LANGID_DATA = {"data.options.max_number": 400, "data.options.langs": ["en", "de", "it"],
               "data.options.n_train": 120, "data.options.n_val": 16,
               "data.options.n_test": 8}  # fmt: skip
SMALL_DATA = {"data.options.n_train": 200, "data.options.n_val": 24, "data.options.n_test": 24,
              "data.bpe_vocab_size": 300, "model.max_seq_len": 160}  # fmt: skip
CASES = {  # task: (preset, metric, overrides)
    "text-classification": ("bert-tiny-langid", "accuracy", LANGID_DATA),
    "token-classification": ("bert-tiny-ner", "entity_f1", SMALL_DATA),
    "question-answering": ("bert-tiny-qa", "exact_match", SMALL_DATA),
}


def small_run(task: str, **train_kw):
    preset, _, data = CASES[task]
    train_kw = {f"train.{k}": v for k, v in train_kw.items()}
    return get_run_preset(preset).override({**SMALL_MODEL, **data, **train_kw})


@pytest.mark.parametrize("task", list(CASES))
def test_task_learns_checkpoints_and_evaluates(task, tmp_path, capsys):
    cfg = small_run(task, max_steps=40, eval_every=40, lr=3e-3)
    assert cfg.task == task
    result = train(cfg, tmp_path, progress=False)
    val = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "val"]
    assert val[-1]["val_loss"] < val[0]["val_loss"] - 0.2, val  # it learns
    metric = CASES[task][1]
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.config.task == task
    assert ckpt.config.model.vocab_size == ckpt.tokenizer.vocab_size + 4  # + the 4 specials
    code = main(["eval", "--ckpt", str(tmp_path), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["task"] == task and metric in report
    assert report[metric] == pytest.approx(result.val_metrics[metric])
    assert report["loss"] == pytest.approx(
        val[-1].get("val_full_loss", val[-1]["val_loss"]), rel=1e-4
    )
    # The test split is scored the same way (never seen in training).
    task_obj = TASKS[task](ckpt.config, tokenizer=ckpt.tokenizer)
    test = task_obj.evaluate_split(ckpt.model, "test")
    assert test["examples"] == len(task_obj.data.test) and 0.0 <= test[metric] <= 1.0


def interrupted(cls, at: int):
    """``cls`` that sends SIGTERM to this process while fetching its ``at``-th batch."""

    class Interrupted(cls):
        calls = 0

        def batch(self, keys, device=None):
            type(self).calls += 1
            if type(self).calls == at:
                os.kill(os.getpid(), signal.SIGTERM)
            return super().batch(keys, device)

    return Interrupted


def resumes_exactly(cfg, tmp_path, monkeypatch):
    straight = train(cfg, tmp_path / "straight", progress=False)
    task_cls = TASKS[cfg.task]
    monkeypatch.setitem(TASKS, cfg.task, interrupted(task_cls, at=7))
    first = train(cfg, tmp_path / "run", progress=False)
    assert first.interrupted == "SIGTERM" and first.step == 4
    monkeypatch.setitem(TASKS, cfg.task, task_cls)
    second = train(None, tmp_path / "run", resume=tmp_path / "run", progress=False)
    assert second.step == 8
    assert first.losses + second.losses == straight.losses
    a, b = load_checkpoint(tmp_path / "run").model, load_checkpoint(tmp_path / "straight").model
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("task", list(CASES))
def test_task_resumes_exactly_after_sigterm(task, tmp_path, monkeypatch):
    cfg = small_run(task, max_steps=8, eval_every=4, grad_accum=2)
    cfg.model.dropout = 0.1  # every random stream matters
    resumes_exactly(cfg, tmp_path, monkeypatch)


def test_task_configs_are_checked():
    cfg = get_run_preset("bert-tiny-ner")
    with pytest.raises(ConfigError, match="data.options.held_out"):
        cfg.override({"data.options.held_out": 1.0}).validate()
    with pytest.raises(ConfigError, match="data.options.langs"):
        get_run_preset("bert-tiny-langid").override({"data.options.langs": ["en"]}).validate()
    with pytest.raises(ConfigError, match="data.options.langs"):
        get_run_preset("bert-tiny-langid").override({"data.options.langs": ["en", "xx"]}).validate()
    with pytest.raises(ConfigError, match="data.options.max_answer_tokens"):
        get_run_preset("bert-tiny-qa").override({"data.options.max_answer_tokens": 0}).validate()
    wrong_head = small_run("question-answering").override({"model.head": "token"})
    with pytest.raises(ConfigError, match="'qa' head.*bert-tiny-qa"):
        train(wrong_head, "unused", progress=False, max_steps=1)
    short = small_run("question-answering").override({"model.max_seq_len": 16})
    with pytest.raises(ConfigError, match="model.max_seq_len=16 is shorter"):
        train(short, "unused", progress=False, max_steps=1)


def test_question_answering_refuses_a_model_with_one_token_type(tmp_path):
    # The context is token type 1: with one type embedding the first step failed inside
    # torch ("IndexError: index out of range in self"). None (0) or two train.
    one_type = small_run("question-answering").override({"model.type_vocab_size": 1})
    with pytest.raises(ConfigError, match=r"model.type_vocab_size=1: .*set it to 2"):
        train(one_type, tmp_path / "one", progress=False, max_steps=1)
    no_types = small_run("question-answering", max_steps=1, eval_every=0)
    train(no_types.override({"model.type_vocab_size": 0}), tmp_path / "none", progress=False)


# --------------------------------------------------------------------------- whole-word masking


def test_word_ids_char_and_bpe():
    char = train_tokenizer("char", ["ab, cd\n"])
    begins, ends = letter_edges(char)
    row = torch.tensor(char.encode("ab, cd"))
    # a b | , | ' ' | c d: runs of letters, every other character a word of its own.
    assert word_ids(row, begins, ends).tolist() == [0, 0, 1, 2, 3, 3]
    text = " ".join(random.Random(0).choices(["cat", "catalogue", "dog", "dogma", "zebra"], k=300))
    bpe = train_tokenizer("bpe", [text], vocab_size=270)  # few merges: words split in pieces
    ids = bpe.encode(text)
    words = word_ids(torch.tensor(ids), *letter_edges(bpe)).tolist()
    assert len(ids) > len(text.split())  # some words are several tokens
    pieces = {}
    for token, word in zip(ids, words):
        pieces[word] = pieces.get(word, "") + bpe.decode([token])
    assert [pieces[w].strip() for w in sorted(pieces)] == text.split()


def test_whole_word_masking_covers_words_at_the_masking_rate():
    mlm = get_run_preset("bert-tiny-mlm").override({"data.options.whole_word": True})
    task = TASKS["mlm"](mlm)
    blocks, _ = task.data.batch("train", torch.arange(0, 400 * 64, 64), 64)  # (400, 64)
    seeds = torch.arange(400) * 7919
    inputs, targets = task.mask(blocks, seeds)
    chosen = targets != -100
    masked = inputs == task.mask_id
    words_chosen = n_words = several = mixed = 0
    for row, pick, hidden in zip(blocks, chosen, masked):
        words = word_ids(row, *task.edges)
        for w in range(int(words.max()) + 1):
            at = words == w
            assert pick[at].all() or not pick[at].any()  # the whole word or none of it
            assert pick[at].all() or not hidden[at].any()  # only chosen words' tokens hidden
            n_words += 1
            words_chosen += int(pick[at].all())
            several += int(pick[at].all() and int(at.sum()) > 1)
            mixed += int(pick[at].all() and hidden[at].any() and not hidden[at].all())
    assert chosen.float().mean() == pytest.approx(0.15, abs=0.02)  # per token, as mask_prob
    assert words_chosen / n_words == pytest.approx(0.15, abs=0.02)
    # 80/10/10 per token (Google's create_pretraining_data.py): a chosen word of several
    # tokens is sometimes part [MASK], part not
    assert masked[chosen].float().mean() == pytest.approx(0.8, abs=0.05)
    assert several > 20 and mixed > 0
    assert (
        torch.equal(targets[chosen], blocks[chosen]) and (inputs[~chosen] == blocks[~chosen]).all()
    )
    # Deterministic per key seed: the same seeds give the same masks, others do not.
    again = task.mask(blocks[:50], seeds[:50])
    assert all(torch.equal(x, y) for x, y in zip(again, (inputs[:50], targets[:50])))
    other = task.mask(blocks[:50], seeds[:50] + 1)
    assert not torch.equal(other[1], targets[:50])


def test_mlm_draws_the_last_block_of_each_split():
    """Masked LM predicts no next token, so a block may end at a split's last token: every
    train token is drawn (the lm sampler, which keeps one for the target, never drew the
    last), and validation walks every whole block (len // t, not (len - 1) // t)."""
    from attnlab.data import TokenDataset
    from attnlab.models.outputs import ModelOutput

    block = 8
    tokenizer = train_tokenizer("char", ["abcdefghijklmnopqrstuvwxyz"])
    stream = np.arange(3 * block + 5 + 3 * block) % 26  # train 29 tokens, val 3 whole blocks
    data = TokenDataset(tokenizer, train=stream[:29], val=stream[29:])
    every = {"train.block_size": block, "data.options.mask_prob": 1.0}  # targets: all tokens
    task = TASKS["mlm"](get_run_preset("bert-tiny-mlm").override(every), data=data)
    keys = task.sample(2000, torch.Generator().manual_seed(0))
    assert set(keys[:, 0].tolist()) == set(range(29 - block + 1))
    targets = task.batch(keys[:50])[1]
    for (start, _), row in zip(keys[:50].tolist(), targets):
        assert row.tolist() == stream[start : start + block].tolist()

    class Seen(torch.nn.Module):  # records what it is asked to predict
        def __init__(self):
            super().__init__()
            self.w, self.inputs = torch.nn.Parameter(torch.zeros(())), []

        def forward(self, idx, targets=None):
            self.inputs.append(idx)
            logits = torch.zeros(*idx.shape, task.mask_id + 1) + self.w
            return ModelOutput(logits, self.w.new_ones(()))

    model = Seen()
    assert task.eval_sums(model, batch_size=2, max_batches=None)["masked_tokens"] == 3 * block
    assert torch.cat(model.inputs).numel() == 3 * block


def test_mlm_random_replacements_are_tokenizer_tokens_never_mask():
    """BERT's 10% random tokens come from the tokenizer's vocabulary: never attnlab's own
    [MASK] (one id past it). With a two-token vocabulary and every token chosen: 80%
    [MASK], 10% + 10% / 2 the original token, 10% / 2 the other one (a [MASK] drawn as a
    random token would make it 83% / 13% / 3%)."""
    from attnlab.data import TokenDataset

    tokenizer = train_tokenizer("char", ["ab"])
    stream = np.random.default_rng(0).integers(0, 2, 6000)
    data = TokenDataset(tokenizer, train=stream[:5000], val=stream[5000:])
    every = {"train.block_size": 50, "data.options.mask_prob": 1.0}
    task = TASKS["mlm"](get_run_preset("bert-tiny-mlm").override(every), data=data)
    assert task.mask_id == 2
    blocks, _ = data.batch("train", torch.arange(0, 4000, 5), 50)  # (800, 50)
    inputs, targets = task.mask(blocks, torch.arange(800))
    assert torch.equal(targets, blocks)
    assert (inputs == 2).float().mean() == pytest.approx(0.8, abs=0.01)
    assert (inputs == blocks).float().mean() == pytest.approx(0.15, abs=0.01)
    assert ((inputs != blocks) & (inputs != 2)).float().mean() == pytest.approx(0.05, abs=0.01)


def test_mlm_evaluation_is_the_mean_over_every_masked_token():
    """The validation loss is the cross-entropy averaged over all masked tokens of the
    validation blocks (each block j masked with seed EVAL_SEED + j), computed here per
    token, not a mean of the batches' means."""
    import torch.nn.functional as F

    from attnlab.models import build_model
    from attnlab.tasks.mlm import EVAL_SEED

    task = TASKS["mlm"](get_run_preset("bert-tiny-mlm").override({"train.block_size": 32}))
    cfg = task.cfg.model
    task.configure_model(cfg)
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    got = task.evaluate(model, batch_size=3, max_batches=3)
    blocks = task.data.windows("val", torch.arange(9) * 32, 32)  # (9, 32)
    inputs, targets = task.mask(blocks, EVAL_SEED + torch.arange(9))
    with torch.no_grad():
        logits = model(inputs).logits
    chosen = targets != -100
    assert chosen.sum(1).unique().numel() > 1  # the blocks hold different numbers
    want = F.cross_entropy(logits[chosen], targets[chosen])
    assert got["masked_tokens"] == int(chosen.sum())
    assert got["loss"] == pytest.approx(float(want), rel=1e-5)
    correct = (logits.argmax(-1) == targets)[chosen].float().mean()
    assert got["accuracy"] == pytest.approx(float(correct), rel=1e-6)


def test_mask_whole_words_matches_a_per_word_reading():
    """mask_whole_words against its definition: words chosen per word and spread to their
    tokens, 80/10/10 drawn per token."""
    idx = torch.randint(0, 50, (3, 20))
    words = torch.tensor([[0, 0, 1, 2, 2, 2, 3, 4, 5, 5, 6, 7, 8, 9, 9, 10, 11, 12, 13, 14]] * 3)
    x, y = mask_whole_words(idx, words, mask_id=99, vocab_size=50, mask_prob=0.5,
                            generator=torch.Generator().manual_seed(5))  # fmt: skip
    g = torch.Generator().manual_seed(5)
    pick = torch.rand((3, 15), generator=g) < 0.5
    u = torch.rand((3, 20), generator=g)
    random_ids = torch.randint(50, (3, 20), generator=g)
    for b in range(3):
        for t in range(20):
            w = int(words[b, t])
            want_y = int(idx[b, t]) if pick[b, w] else -100
            if not pick[b, w] or u[b, t] >= 0.9:
                want_x = int(idx[b, t])
            elif u[b, t] < 0.8:
                want_x = 99
            else:
                want_x = int(random_ids[b, t])
            assert (int(x[b, t]), int(y[b, t])) == (want_x, want_y)


def test_whole_word_mlm_resumes_exactly(tmp_path, monkeypatch):
    cfg = get_run_preset("bert-tiny-mlm").override(
        {
            "model.max_seq_len": 32,
            "train.block_size": 32,
            "model.d_model": 32,
            "model.ffn.hidden_dim": 64,
            "train.batch_size": 8,
            "train.max_steps": 8,
            "train.eval_every": 4,
            "train.eval_batches": 2,
            "train.grad_accum": 2,
            "train.warmup_steps": 2,
            "train.seed": 0,
            "train.device": "cpu",
            "data.options.whole_word": True,
        }  # fmt: skip
    )
    resumes_exactly(cfg, tmp_path, monkeypatch)


DDP_TASK_CHILD = """
import json, os, sys, torch
torch.set_num_threads(1)
from attnlab.config import RunConfig
from attnlab.training import train
result = train(RunConfig.from_json(open(sys.argv[1]).read()), sys.argv[2], progress=False)
if os.environ["RANK"] == "0":
    with open(sys.argv[3], "w") as f:
        json.dump({"losses": result.losses, "val_loss": result.val_loss}, f)
"""


@pytest.mark.slow
@pytest.mark.parametrize("task", ["text-classification", "token-classification"])
def test_two_processes_train_as_one_with_double_batch(task, tmp_path):
    """The README: N processes equal one with N times the batch, for every task: one class
    per example, or a number of labelled tokens that differs between the processes'
    slices (each slice weighs by it)."""
    import subprocess
    import sys
    from pathlib import Path

    import numpy as np

    def run(batch_size):
        return small_run(task, max_steps=3, eval_every=3, batch_size=batch_size,
                         grad_accum=2).override({"model.dropout": 0.0})  # fmt: skip

    (tmp_path / "cfg.json").write_text(run(4).to_json())
    (tmp_path / "child.py").write_text(DDP_TASK_CHILD)
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    args = [str(tmp_path / n) for n in ("child.py", "cfg.json", "ddp", "ddp.json")]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node=2", *args], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    ddp = json.loads((tmp_path / "ddp.json").read_text())
    single = train(run(8), tmp_path / "single", progress=False)
    np.testing.assert_allclose(ddp["losses"], single.losses, rtol=1e-5)
    assert ddp["val_loss"] == pytest.approx(single.val_loss, rel=1e-5)
    a, b = (load_checkpoint(tmp_path / d).model.state_dict() for d in ("ddp", "single"))
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-5, msg=name)


def test_accumulated_tagging_micro_batches_train_as_one_batch(tmp_path):
    """Sentences have different numbers of labelled tokens: two micro-batches of b give
    the loss and weights of one batch of 2b (the mean over all labelled tokens)."""
    one, two = (
        train(
            small_run(
                "token-classification", max_steps=3, eval_every=0, grad_accum=a, batch_size=16 // a
            ).override({"model.dropout": 0.0}),
            tmp_path / str(a),
            progress=False,
        )  # fmt: skip
        for a in (1, 2)
    )
    torch.testing.assert_close(
        torch.tensor(two.losses), torch.tensor(one.losses), rtol=1e-5, atol=0
    )
    a, b = (load_checkpoint(tmp_path / str(n)).model.state_dict() for n in (1, 2))
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-5, msg=name)


def test_word_ids_wordpiece_groups_continuation_pieces():
    """An imported BERT's WordPiece: "##" pieces continue the word before them and every
    other token starts a word (its tokens carry no space: "the" "dog" are two words, "dog"
    "##s" one), as transformers' whole-word masking groups them."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers, pre_tokenizers

    from attnlab.tokenizers import Tokenizer

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "dog", "##s", "run",
             "##ning", "fast", "un", "##believ", "##able", "."]  # fmt: skip
    hf = HFTokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    hf.normalizer = normalizers.BertNormalizer(lowercase=True)
    hf.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    hf.decoder = decoders.WordPiece()
    tok = Tokenizer(hf)
    ids = tok.encode("the dogs running unbelievable fast.")
    assert [hf.id_to_token(i) for i in ids] == [
        "the", "dog", "##s", "run", "##ning", "un", "##believ", "##able", "fast", "."
    ]  # fmt: skip
    words = word_ids(torch.tensor(ids), *letter_edges(tok)).tolist()
    assert words == [0, 1, 1, 2, 2, 3, 3, 3, 4, 5]
