"""``attnlab generate``: sample text from a checkpoint, optionally streaming it."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

import torch

from attnlab.cli.common import (
    CLIError,
    add_dtype_argument,
    load_for_inference,
    non_negative_int,
    positive_int,
    require_tokenizer,
    resolve_device,
    stop_token_ids,
)

if TYPE_CHECKING:
    from attnlab.tokenizers import Tokenizer

DEFAULT_PROMPT = "\n"  # a fresh line: the most neutral start a char-level model knows


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "generate",
        help="sample text from a checkpoint",
        description="Continue a prompt with a trained model. Prints the prompt followed by "
        "the generated text.",
    )
    p.add_argument("--ckpt", required=True, metavar="DIR", help="checkpoint (or HF) folder")
    p.add_argument(
        "--prompt",
        metavar="TEXT",
        help="text to continue (default: a newline, or the first token when the "
        "vocabulary has no newline)",
    )
    p.add_argument("--max-new-tokens", type=non_negative_int, default=256, metavar="N")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, metavar="K", help="sample among the K likeliest")
    p.add_argument("--top-p", type=float, metavar="P", help="nucleus sampling mass in (0, 1]")
    p.add_argument("--seed", type=int, help="seed the sampler (reproducible output)")
    p.add_argument("--stream", action="store_true", help="print tokens as they are produced")
    p.add_argument("--no-cache", action="store_true", help="recompute the context every step")
    p.add_argument(
        "--compile",
        action="store_true",
        help="decode with a torch.compile'd fixed-shape step (pays off for long generations)",
    )
    p.add_argument(
        "--overflow",
        choices=("slide", "roll", "stop"),
        default="slide",
        help="past max_seq_len: slide the context by half (default), roll a bounded cache "
        "(relative positions), or stop",
    )
    p.add_argument(
        "--num-beams",
        type=positive_int,
        default=1,
        metavar="K",
        help="beam search with K beams: the most probable continuation, not a sample "
        "(sampling options do not apply)",
    )
    p.add_argument(
        "--length-penalty",
        type=float,
        default=1.0,
        metavar="A",
        help="beam scores are log p / length**A (default 1.0)",
    )
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ... (default auto)")
    add_dtype_argument(p)
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="keep going past the end-of-sequence token(s) of generation_config.json / "
        "config.json (by default generation stops there)",
    )
    p.set_defaults(handler=run)


def encode_prompt(tokenizer: Tokenizer, prompt: str | None) -> tuple[str, list[int]]:
    """(shown prompt, ids). An empty or missing prompt starts from a newline if the
    vocabulary has one, else from token 0 (generation needs at least one token)."""
    from attnlab.tokenizers import TokenizerError

    if prompt:
        try:
            return prompt, tokenizer.encode(prompt)
        except TokenizerError as e:
            raise CLIError(f"--prompt: {e}") from None
    try:
        ids = tokenizer.encode(DEFAULT_PROMPT)
    except TokenizerError:
        ids = []
    if ids:
        return DEFAULT_PROMPT, ids
    return tokenizer.decode([0]), [0]


def _print(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def run(args: argparse.Namespace) -> int:
    from attnlab.generation import check_sampling

    try:
        check_sampling(args.temperature, args.top_k, args.top_p)
    except ValueError as e:  # before the (slow) model load
        raise CLIError(f"--{str(e).replace('_', '-')}") from None
    device = resolve_device(args.device)
    model, _, tokenizer = load_for_inference(args.ckpt, device, args.dtype)
    tokenizer = require_tokenizer(tokenizer, args.ckpt)
    from attnlab.interop import HFCheckpointError

    try:
        stops = [] if args.ignore_eos else stop_token_ids(args.ckpt)
    except HFCheckpointError as e:
        raise CLIError(str(e)) from None
    shown, ids = encode_prompt(tokenizer, args.prompt)
    options = dict(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        use_cache=not args.no_cache,
        overflow=args.overflow,
        compile=args.compile,
        stop_tokens=stops,
    )
    if args.num_beams > 1:
        if args.stream:
            raise CLIError("--stream and --num-beams exclude each other: beams end together")
        options = dict(
            num_beams=args.num_beams, length_penalty=args.length_penalty, stop_tokens=stops
        )
        if len(ids) + args.max_new_tokens > model.cfg.max_seq_len:
            raise CLIError(
                f"--num-beams: prompt ({len(ids)} tokens) + --max-new-tokens "
                f"{args.max_new_tokens} exceed max_seq_len={model.cfg.max_seq_len}"
            )
    if args.seed is not None:
        torch.manual_seed(args.seed)
    _print(shown)
    if not args.stream:
        new = model.generate(ids, args.max_new_tokens, **options)
        _print(tokenizer.decode(new) + "\n")
        return 0
    # Decode the whole continuation each step and print what is new: one token may be
    # part of a multi-byte character (byte-level BPE), shown once it is complete.
    new_ids: list[int] = []
    printed = ""
    for token in model.stream(ids, args.max_new_tokens, **options):
        new_ids.append(token)
        text = tokenizer.decode(new_ids)
        if text.endswith("\ufffd") or not text.startswith(printed):
            continue
        _print(text[len(printed) :])
        printed = text
    _print(tokenizer.decode(new_ids)[len(printed) :] + "\n")
    return 0
