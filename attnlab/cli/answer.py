"""``attnlab answer``: answer a question with a span of a context, with a checkpoint of the
question-answering task or an imported ``BertForQuestionAnswering`` (its own tokenizer)."""

from __future__ import annotations

import argparse
import json

import torch

from attnlab.cli.common import (
    CLIError,
    add_checkpoint_argument,
    add_device_argument,
    add_dtype_argument,
    add_tokenizer_argument,
    load_text_task,
    positive_int,
    resolve_device,
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "answer",
        help="answer a question from a context (a question-answering checkpoint)",
        description="Find the answer to a question as a span of the context, with an encoder "
        "trained for the question-answering task (attnlab train --preset bert-tiny-qa) or an "
        "imported BertForQuestionAnswering. "
        "The score is p(start) * p(end), softmax over the context tokens.",
    )
    add_checkpoint_argument(p)
    p.add_argument("--context", required=True, metavar="TEXT", help="text holding the answer")
    p.add_argument("--question", required=True, metavar="TEXT", help="the question")
    p.add_argument(
        "--max-answer-tokens",
        type=positive_int,
        metavar="N",
        help="longest answer in tokens (default: the task's max_answer_tokens)",
    )
    add_tokenizer_argument(p)
    add_device_argument(p)
    add_dtype_argument(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from attnlab.tasks.question_answering import encode_question, predict_answer
    from attnlab.tasks.text import check_length

    device = resolve_device(args.device)
    model, cfg, codec, opts = load_text_task(
        args.ckpt, device, "question-answering", "answer", args.tokenizer, args.dtype
    )
    if not args.context.strip():
        raise CLIError("--context is empty; give the text that holds the answer")
    if not args.question.strip():
        raise CLIError("--question is empty; give the question to answer")
    if cfg.model.type_vocab_size == 1:  # the context is token type 1 (BERT's pair layout)
        raise CLIError(
            f"{args.ckpt}: the model has one token type (type_vocab_size=1); answer feeds "
            "the question as type 0 and the context as type 1, so it needs a model with "
            "two (or none: 0)"
        )
    ids, types, offset, spans = encode_question(codec, args.question, args.context)
    if not spans:  # BERT's normaliser drops control and zero-width characters
        raise CLIError(
            "--context has no tokens (the tokenizer drops every character of it); give the "
            "text that holds the answer"
        )
    check_length(len(ids), cfg.model.max_seq_len, "the question and context")
    with torch.no_grad():
        logits = model(
            torch.tensor([ids], device=device), token_type_ids=torch.tensor([types], device=device)
        ).logits[0]  # (t, 2)
    limit = args.max_answer_tokens or opts.max_answer_tokens
    text, start, end, score = predict_answer(
        logits.float().cpu(), offset, spans, args.context, limit
    )
    report = {"answer": text, "score": round(score, 4), "start": start, "end": end}
    if args.json:
        print(json.dumps(report, ensure_ascii=False))
    else:
        print(f"{text}\t{score:.3f}")
    return 0
