"""``attnlab translate``: translate numbers into words with a checkpoint of the seq2seq
task (the Transformer or the GRU encoder-decoder), greedily or with beam search."""

from __future__ import annotations

import argparse
import json

from attnlab.cli.common import CLIError, load_for_inference, positive_int, resolve_device


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "translate",
        help="translate numbers into words (a seq2seq checkpoint)",
        description="Translate digit strings into words with a model trained for the "
        "seq2seq task (attnlab train --preset transformer-numbers / gru-numbers).",
    )
    p.add_argument("--ckpt", required=True, metavar="DIR", help="checkpoint folder")
    p.add_argument("numbers", nargs="+", metavar="NUMBER", help="digit strings, e.g. 1234")
    p.add_argument("--num-beams", type=positive_int, default=1, metavar="K", help="1: greedy")
    p.add_argument(
        "--length-penalty",
        type=float,
        default=0.6,
        metavar="A",
        help="beam scores are log p / lp(length) ** A (default 0.6)",
    )
    p.add_argument(
        "--beam-style",
        choices=("gnmt", "transformers"),
        default="gnmt",
        help="gnmt (default): lp = (5 + n) / 6, stop when no beam can win; transformers: "
        "lp = n, stop when num_beams have finished (as generate(early_stopping=True))",
    )
    p.add_argument(
        "--max-new-tokens", type=positive_int, metavar="N", help="default: max_seq_len - 1"
    )
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ... (default auto)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from attnlab.data.corpus import DataError
    from attnlab.data.numbers import CharVocabPair, collate

    device = resolve_device(args.device)
    model, cfg, vocab = load_for_inference(args.ckpt, device)
    if cfg.task != "seq2seq" or not isinstance(vocab, CharVocabPair):
        raise CLIError(
            f"{args.ckpt} was trained for task {cfg.task!r}; translate needs a seq2seq "
            "checkpoint (attnlab train --preset transformer-numbers)"
        )
    try:
        batch = collate([(n, "") for n in args.numbers], vocab.source, vocab.target)
    except DataError as e:
        raise CLIError(f"cannot translate {args.numbers}: {e}") from None
    limit = cfg.model.max_seq_len
    if batch.src.shape[1] > limit:
        raise CLIError(f"a number of {batch.src.shape[1]} digits exceeds max_seq_len={limit}")
    max_new = args.max_new_tokens or limit - 1
    options = {"num_beams": args.num_beams}
    if args.num_beams > 1:
        options.update(length_penalty=args.length_penalty, style=args.beam_style)
    try:
        out = model.generate(
            batch.src.to(device), max_new, src_mask=batch.src_mask.to(device), **options
        )
    except ValueError as e:
        raise CLIError(str(e)) from None
    words = [vocab.target.decode(tokens) for tokens in out]
    if args.json:
        print(json.dumps(dict(zip(args.numbers, words)), ensure_ascii=False))
    else:
        for number, text in zip(args.numbers, words):
            print(f"{number}\t{text}")
    return 0
