"""``attnlab eval``: held-out loss, perplexity and bits per token / character."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from attnlab.cli.common import (
    CLIError,
    add_dtype_argument,
    load_for_inference,
    positive_int,
    require_tokenizer,
    resolve_device,
)

if TYPE_CHECKING:
    from attnlab.tokenizers import Tokenizer


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "eval",
        help="loss and perplexity of a checkpoint",
        description="Mean next-token loss of a checkpoint over consecutive non-overlapping "
        "blocks of its validation split, or of any text with --data.",
    )
    p.add_argument("--ckpt", required=True, metavar="DIR", help="checkpoint (or HF) folder")
    p.add_argument(
        "--data", metavar="PATH", help="a .txt file or folder to evaluate on (all of it)"
    )
    p.add_argument("--batch-size", type=positive_int, metavar="N", help="default: the run's")
    p.add_argument("--block-size", type=positive_int, metavar="T", help="default: the run's")
    p.add_argument("--max-batches", type=positive_int, metavar="N", help="stop after N batches")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ... (default auto)")
    add_dtype_argument(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=run)


def _tokens_of_file(path: str, tokenizer: Tokenizer, errors: str) -> np.ndarray:
    from attnlab.data import DOCUMENT_SEPARATOR, read_corpus
    from attnlab.tokenizers import TokenizerError

    text = DOCUMENT_SEPARATOR.join(doc for _, doc in read_corpus(path, errors=errors))
    try:
        return tokenizer.encode_array(text)
    except TokenizerError as e:
        raise CLIError(f"--data {path}: {e}") from None


def run(args: argparse.Namespace) -> int:
    from attnlab.data import TokenDataset, prepare_data
    from attnlab.training.evaluate import evaluate

    device = resolve_device(args.device)
    model, cfg, tokenizer = load_for_inference(args.ckpt, device, args.dtype)
    tokenizer = require_tokenizer(tokenizer, args.ckpt)
    block_size = args.block_size or cfg.train.block_size or cfg.model.max_seq_len
    if block_size > cfg.model.max_seq_len:
        raise CLIError(f"--block-size {block_size} exceeds max_seq_len={cfg.model.max_seq_len}")
    batch_size = args.batch_size or cfg.train.batch_size
    if args.data is not None:
        if not Path(args.data).exists():
            raise CLIError(f"--data {args.data}: no such file or folder")
        tokens = _tokens_of_file(args.data, tokenizer, cfg.data.errors)
        if len(tokens) < 2:
            raise CLIError(f"--data {args.data}: needs at least 2 tokens, got {len(tokens)}")
        block_size = min(block_size, len(tokens) - 1)  # short texts: one shorter block
        data = TokenDataset(tokenizer=tokenizer, train=tokens, val=tokens)
        source = args.data
    else:
        data = prepare_data(cfg.data, tokenizer=tokenizer)
        source = f"validation split of {cfg.data.path or 'the embedded corpus'}"
    batches = data.iter_eval("val", batch_size, block_size, args.max_batches)
    result = evaluate(model, batches, device=device)
    # Block j's targets are tokens[j t + 1 : (j + 1) t + 1], so the targets evaluated are
    # exactly tokens[1 : 1 + n]; their text gives the characters predicted.
    characters = len(tokenizer.decode(data.val[1 : 1 + result["tokens"]]))
    total_bits = result["loss"] * result["tokens"] / math.log(2.0)
    bits_per_char = total_bits / characters if characters else None
    report = {
        "loss": result["loss"],
        "perplexity": result["perplexity"],
        "tokens": result["tokens"],
        "bits_per_token": result["bits_per_token"],
        "characters": characters,
        "bits_per_char": bits_per_char,
        "block_size": block_size,
        "source": source,
    }
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"data            {source}")
    print(f"tokens          {report['tokens']:,} ({characters:,} characters, block {block_size})")
    print(f"loss            {report['loss']:.4f} nats/token")
    print(f"perplexity      {report['perplexity']:.3f}")
    print(f"bits/token      {report['bits_per_token']:.4f}")
    if bits_per_char is not None:
        print(f"bits/character  {bits_per_char:.4f}")
    return 0
