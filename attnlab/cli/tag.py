"""``attnlab tag``: tag the words of texts with a checkpoint of the token-classification
task (people, cities, dates and numbers in BIO tags), or an imported
``BertForTokenClassification`` (its id2label's tags, its own tokenizer), and list the
entities found (read from BIO tags; labels of another scheme give none)."""

from __future__ import annotations

import argparse
import bisect
import json
import re
from collections.abc import Sequence

import torch

from attnlab.cli.common import (
    add_checkpoint_argument,
    add_device_argument,
    add_dtype_argument,
    add_tokenizer_argument,
    label_names,
    load_text_task,
    resolve_device,
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "tag",
        help="tag entities in text (a token-classification checkpoint)",
        description="Tag each word of a text (BIO tags of PER, CITY, DATE, NUM) with an "
        "encoder trained for the token-classification task (attnlab train --preset "
        "bert-tiny-ner) or an imported BertForTokenClassification, and list the entities: "
        "a word shows the tag of its first token.",
    )
    add_checkpoint_argument(p)
    p.add_argument("texts", nargs="+", metavar="TEXT", help="texts to tag")
    add_tokenizer_argument(p)
    add_device_argument(p)
    add_dtype_argument(p)
    p.add_argument("--json", action="store_true", help="print one JSON list, one object a text")
    p.set_defaults(handler=run)


def tag_text(
    model,
    codec,
    text: str,
    max_seq_len: int,
    device: str = "cpu",
    labels: Sequence[str] | None = None,
) -> dict:
    """{"text", "tokens", "words", "entities"} of one text: each token (its vocabulary
    entry, or for the unknown token the text it stands for, as transformers' pipeline
    shows it; and its character span) and each whitespace-separated word with its tag, and
    the entities' labels, texts and spans. ``labels``: the names of the model's labels
    (default: the task's BIO tags)."""
    from attnlab.tasks.text import check_length
    from attnlab.tasks.token_classification import TAGS, entity_spans

    labels = TAGS if labels is None else labels

    ids, spans = codec.encode(text)
    inputs = codec.single(ids)
    check_length(len(inputs), max_seq_len, "the text")
    with torch.no_grad():
        logits = model(torch.tensor([inputs], device=device)).logits[0, 1:-1]  # (n, tags)
    tags = [labels[i] for i in logits.argmax(-1).tolist()]
    # each word's first token (one pass over the tokens, not one per word: a long text's
    # words times its tokens); a token's start lies in the last word starting at or before it
    found = list(re.finditer(r"\S+", text))
    word_starts = [word.start() for word in found]
    first_token: list[int | None] = [None] * len(found)
    for i, (a, b) in enumerate(spans):
        k = bisect.bisect_right(word_starts, a) - 1
        if a < b and k >= 0 and a < found[k].end() and first_token[k] is None:
            first_token[k] = i
    words = [
        {"word": word.group(), "tag": tags[first] if first is not None else "O"}
        for word, first in zip(found, first_token)
    ]
    entities = []
    for label, first, last in entity_spans(tags):
        start, end = spans[first][0], spans[last - 1][1]
        entities.append({"label": label, "text": text[start:end], "start": start, "end": end})
    # a token is its vocabulary entry ("##12"), but the unknown token ("[UNK]") shows the
    # text it stands for, as transformers' token-classification pipeline shows it
    unk = codec.unk_id
    return {
        "text": text,
        "tokens": [
            {
                "token": text[a:b] if i == unk else codec.token_text(i),
                "tag": t,
                "start": a,
                "end": b,
            }
            for i, t, (a, b) in zip(ids, tags, spans)
        ],
        "words": words,
        "entities": entities,
    }


def run(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    model, cfg, codec, _ = load_text_task(
        args.ckpt, device, "token-classification", "tag", args.tokenizer, args.dtype
    )
    labels = label_names(cfg)
    reports = [
        tag_text(model, codec, text, cfg.model.max_seq_len, device, labels) for text in args.texts
    ]
    if args.json:
        print(json.dumps(reports, ensure_ascii=False))
        return 0
    for i, report in enumerate(reports):
        if i:
            print()
        width = max(len(w["word"]) for w in report["words"]) if report["words"] else 0
        for w in report["words"]:
            print(f"{w['word']:<{width}}  {w['tag']}")
        found = ", ".join(f"{e['label']} {e['text']!r}" for e in report["entities"])
        print(f"entities: {found or 'none'}")
    return 0
