"""``attnlab generate``: sample text from a checkpoint, optionally streaming it.

stdout holds only the prompt and its continuation: warnings (a prompt cropped to the
context, a context that will fill up) go to stderr, all before the first character is
printed. Without ``--max-new-tokens`` the continuation fits the model's context:
``min(256, max_seq_len - prompt tokens)``, or, when the prompt fills the whole context,
``min(256, max_seq_len // 2)`` tokens (at least 1) with the context sliding as it goes.

A Transformer-XL checkpoint may generate with another memory than it trained with:
``--set model.mem_len=...`` (and ``clamp_len``, ``same_length``), as ``attnlab eval``.

A checkpoint without a tokenizer (e.g. imported from a weight-only Hugging Face folder)
takes ``--tokenizer FILE``, or token ids with ``--prompt-ids 1,2,3``; with no tokenizer at
all, the output is token ids too (comma-separated: the prompt's, then the new ones).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch

from attnlab.cli.common import (
    CLIError,
    add_checkpoint_argument,
    add_device_argument,
    add_dtype_argument,
    add_early_stopping_argument,
    add_evaluation_settings_argument,
    add_tokenizer_argument,
    check_beams_fit_vocabulary,
    early_stopping_value,
    evaluation_settings,
    finite_float,
    load_for_inference,
    non_negative_int,
    positive_int,
    refuse_beam_options,
    require_tokenizer,
    resolve_device,
    seed_int,
    stop_token_ids,
    token_ids,
    tokenizer_option,
)

if TYPE_CHECKING:
    from attnlab.tokenizers import Tokenizer

DEFAULT_PROMPT = "\n"  # a fresh line: the most neutral start a char-level model knows
DEFAULT_TEMPERATURE = 0.8
SAMPLING = ("temperature", "top_k", "top_p")  # the options --num-beams refuses
DEFAULT_MAX_NEW_TOKENS = 256  # at most; without --max-new-tokens the context's room left
DEFAULT_LENGTH_PENALTY = 1.0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "generate",
        help="sample text from a checkpoint",
        description="Continue a prompt with a trained model. Prints the prompt followed by "
        "the generated text.",
    )
    add_checkpoint_argument(p)
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument(
        "--prompt",
        metavar="TEXT",
        help="text to continue (default: a newline, or the first token when the "
        "vocabulary has no newline)",
    )
    prompt.add_argument(
        "--prompt-ids",
        type=token_ids,
        metavar="IDS",
        help="token ids to continue, comma-separated (e.g. 1,2,3): needs no tokenizer; "
        "without one the output is token ids too",
    )
    add_tokenizer_argument(p)
    p.add_argument(
        "--max-new-tokens",
        type=non_negative_int,
        metavar="N",
        help=f"tokens to generate (default: what fits the model's context, at most "
        f"{DEFAULT_MAX_NEW_TOKENS}: min({DEFAULT_MAX_NEW_TOKENS}, max_seq_len - prompt tokens))",
    )
    p.add_argument("--temperature", type=float, help=f"0 = greedy (default {DEFAULT_TEMPERATURE})")
    p.add_argument("--top-k", type=int, metavar="K", help="sample among the K likeliest")
    p.add_argument("--top-p", type=float, metavar="P", help="nucleus sampling mass in (0, 1]")
    p.add_argument("--seed", type=seed_int, help="seed the sampler (reproducible output)")
    p.add_argument("--stream", action="store_true", help="print tokens as they are produced")
    p.add_argument("--no-cache", action="store_true", help="recompute the context every step")
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="decode with a torch.compile'd fixed-shape step; default: only for generations "
        "long enough to repay the compile time (batch x new tokens >= 8,192)",
    )
    p.add_argument(
        "--overflow",
        choices=("slide", "roll", "stop"),
        default="slide",
        help="past max_seq_len: slide the context by half (default), roll a bounded cache "
        "(relative positions), or stop; not for Transformer-XL, whose segment memory has no "
        "context limit",
    )
    p.add_argument(
        "--num-beams",
        type=positive_int,
        default=1,
        metavar="K",
        help="beam search with K beams (at most the vocabulary size): the most probable "
        "continuation, not a sample (refused with --top-k, --top-p or a --temperature above 0)",
    )
    p.add_argument(
        "--length-penalty",
        type=finite_float,
        metavar="A",
        help=f"with --num-beams: beam scores are log p / length**A (default "
        f"{DEFAULT_LENGTH_PENALTY}); the search ends as --early-stopping says",
    )
    add_early_stopping_argument(p)
    add_evaluation_settings_argument(p)
    add_device_argument(p)
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
    vocabulary has one, else from token 0 (generation needs at least one token). The ids
    are the text's as transformers' ``tokenizer(prompt)`` gives them: with the special
    tokens the tokenizer's post-processor adds (an imported LLaMA's ``<s>`` first; none for
    attnlab's own tokenizers, GPT-2's or Qwen2's)."""
    from attnlab.tokenizers import TokenizerError

    if prompt:
        try:
            return prompt, tokenizer.encode(prompt, add_special_tokens=True)
        except TokenizerError as e:
            raise CLIError(f"--prompt: {e}") from None
    try:
        ids = tokenizer.encode(DEFAULT_PROMPT, add_special_tokens=True)
    except TokenizerError:
        ids = []
    if ids:
        return DEFAULT_PROMPT, ids
    return tokenizer.decode([0]), [0]


def _print(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def continuation(
    tokenizer, prompt_ids: list[int], new_ids: list[int], base: str | None = None
) -> str:
    """The text ``new_ids`` add after ``prompt_ids``: decoded together, less the prompt's
    text ``base`` (decoded alone, a SentencePiece-style decoder strips the continuation's
    leading space, and byte-level pieces may join across the boundary)."""
    if base is None:
        base = tokenizer.decode(prompt_ids)
    full = tokenizer.decode(list(prompt_ids) + list(new_ids))
    return full[len(base) :] if full.startswith(base) else tokenizer.decode(new_ids)


def plan_length(
    ids: list[int], max_new_tokens: int | None, max_seq_len: int, overflow: str
) -> tuple[list[int], int]:
    """(prompt ids cropped to the context, new tokens to generate), warning (stderr, before
    anything is printed) about a cropped prompt and a context that will fill up."""
    if len(ids) > max_seq_len:
        warnings.warn(
            f"the prompt has {len(ids)} tokens, more than the model's context "
            f"(max_seq_len={max_seq_len}): keeping its last {max_seq_len}",
            stacklevel=2,
        )
        ids = ids[-max_seq_len:]
    room = max_seq_len - len(ids)
    explicit = max_new_tokens is not None
    if not explicit:
        # a full context: half of it (at least one token: max_seq_len=1 slides by one)
        max_new_tokens = min(DEFAULT_MAX_NEW_TOKENS, room or max(1, max_seq_len // 2))
    if max_new_tokens <= room or overflow == "roll":
        return ids, max_new_tokens
    if overflow == "stop":
        warnings.warn(
            f"the prompt ({len(ids)} tokens) leaves room for {room} new tokens in the model's "
            f"context (max_seq_len={max_seq_len}); --overflow stop ends there",
            stacklevel=2,
        )
        return ids, room
    slides = f"slides to its last {max_seq_len - max_seq_len // 2} tokens"
    if explicit:
        message = (
            f"the prompt ({len(ids)} tokens) + --max-new-tokens {max_new_tokens} exceed the "
            f"model's context (max_seq_len={max_seq_len}): when it is full it {slides}"
        )
    else:
        message = (
            f"the prompt ({len(ids)} tokens) fills the model's context (max_seq_len="
            f"{max_seq_len}): generating {max_new_tokens} tokens as the context {slides}"
        )
    warnings.warn(message, stacklevel=2)
    return ids, max_new_tokens


def run(args: argparse.Namespace) -> int:
    from attnlab.generation import check_sampling

    if args.num_beams > 1:  # a search, not a sample: options of sampling would be ignored
        given = [  # --temperature 0 (greedy) does not sample
            f"--{n.replace('_', '-')}" for n in SAMPLING if getattr(args, n) not in (None, 0)
        ]
        if given:
            raise CLIError(
                f"{', '.join(given)}: sampling, and --num-beams searches instead of sampling; "
                "drop one of them"
            )
        # beam search always caches and never compiles: these were silently ignored
        for option, given in (("--no-cache", args.no_cache), ("--compile", args.compile)):
            if given:
                raise CLIError(
                    f"{option}: beam search (--num-beams) always caches and never compiles; "
                    "drop one of them"
                )
    else:
        refuse_beam_options(
            {"--length-penalty": args.length_penalty, "--early-stopping": args.early_stopping}
        )
    if args.length_penalty is None:
        args.length_penalty = DEFAULT_LENGTH_PENALTY
    if args.temperature is None:
        args.temperature = DEFAULT_TEMPERATURE
    try:
        check_sampling(args.temperature, args.top_k, args.top_p)
    except ValueError as e:  # before the (slow) model load
        raise CLIError(f"--{str(e).replace('_', '-')}") from None
    device = resolve_device(args.device)
    model, run_cfg, tokenizer = load_for_inference(args.ckpt, device, args.dtype)
    cfg = model.cfg
    if not hasattr(model, "stream"):  # encoders, encoder-decoders, image classifiers
        raise CLIError(
            f"{args.ckpt} holds a model of arch {cfg.arch!r}; generate needs a language model "
            "(arch 'decoder' or 'xl'): use translate for seq2seq checkpoints, fill-mask, "
            "classify, tag or answer for encoders"
        )
    cfg = evaluation_settings(args.set, model, run_cfg, "generate").model
    tokenizer = tokenizer_option(args.tokenizer, tokenizer, cfg.vocab_size)
    if getattr(model, "unbounded_context", False) and args.overflow != "slide":
        # the library accepts and ignores it: here it would promise a limit there is not
        raise CLIError(
            f"--overflow {args.overflow}: Transformer-XL's segment memory has no context "
            "limit, so --overflow does not apply; drop it"
        )
    _check_roll(args, model)
    from attnlab.interop import HFCheckpointError
    from attnlab.tokenizers import TokenizerError

    try:
        stops = [] if args.ignore_eos else stop_token_ids(args.ckpt)
    except HFCheckpointError as e:
        raise CLIError(str(e)) from None
    shown, ids = _prompt(args, tokenizer, cfg.vocab_size)
    if getattr(model, "unbounded_context", False):  # Transformer-XL: its memory carries on
        max_new_tokens = args.max_new_tokens
        if max_new_tokens is None:
            max_new_tokens = DEFAULT_MAX_NEW_TOKENS
        if args.num_beams > 1:
            raise CLIError(f"--num-beams: beam search needs a decoder checkpoint ({cfg.arch})")
    else:
        check_beams_fit_vocabulary(args.num_beams, cfg.vocab_size)
        with warnings.catch_warnings(record=True) as planned:
            warnings.simplefilter("always")
            ids, max_new_tokens = plan_length(
                ids, args.max_new_tokens, cfg.max_seq_len, args.overflow
            )
        if args.num_beams > 1 and len(ids) + max_new_tokens > cfg.max_seq_len:
            # beams cannot slide: one error line, without the plan's notes on sliding
            raise CLIError(
                f"--num-beams: prompt ({len(ids)} tokens) + {max_new_tokens} new tokens "
                f"exceed max_seq_len={cfg.max_seq_len}; lower --max-new-tokens"
            )
        for note in planned:
            warnings.warn_explicit(note.message, note.category, note.filename, note.lineno)
    options = dict(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        use_cache=not args.no_cache,
        overflow=args.overflow,
        compile="auto" if args.compile is None else args.compile,
        stop_tokens=stops,
    )
    beams = args.num_beams > 1
    if beams and args.stream:
        raise CLIError("--stream and --num-beams exclude each other: beams end together")
    if args.seed is not None:
        torch.manual_seed(args.seed)
    try:
        return _write(args, model, tokenizer, ids, shown, max_new_tokens, beams, stops, options)
    except TokenizerError as e:  # a --tokenizer smaller than the model's vocabulary
        if tokenizer is None:
            raise
        raise CLIError(
            f"the model generated a token its tokenizer cannot decode ({e}): the tokenizer "
            f"has {tokenizer.vocab_size} tokens, the model {cfg.vocab_size}; give the model's "
            "own tokenizer.json with --tokenizer FILE"
        ) from None


def _check_roll(args: argparse.Namespace, model) -> None:
    """``--overflow roll`` where the model and options allow it (``generation.roll_blocker``),
    refused by its options' names (the library names its arguments)."""
    from attnlab.generation import roll_blocker

    if args.overflow != "roll" or getattr(model, "unbounded_context", False) or args.num_beams > 1:
        return
    blocker = roll_blocker(model, use_cache=not args.no_cache)
    if blocker == "cache":
        raise CLIError("--overflow roll decodes with a rolling cache; drop --no-cache")
    if blocker == "nsa":
        raise CLIError(
            "--overflow roll: native sparse attention's blocks lie over cache slots from slot 0, "
            "which a rolling cache wraps; use --overflow slide"
        )
    if blocker == "longrope":
        raise CLIError(
            "--overflow roll: past its original context LongRoPE rotates every key by its long "
            "factors, so the sequence is encoded again, which a rolling cache cannot; use "
            "--overflow slide or stop"
        )
    if blocker == "positions":
        raise CLIError(
            "--overflow roll needs relative positions (rope, none, alibi or relative_bias): a "
            "rolling cache keeps "
            f"no absolute ones; this model uses {model.cfg.position.kind!r} positions: use "
            "--overflow slide or stop"
        )


def _prompt(args: argparse.Namespace, tokenizer, vocab_size: int) -> tuple[str | None, list[int]]:
    """The prompt as it is printed (None: ``--prompt-ids`` without a tokenizer, printed as
    ids) and its token ids: ``--prompt-ids`` as given, else ``--prompt`` encoded."""
    from attnlab.tokenizers import TokenizerError

    if args.prompt_ids is None:
        alternatives = " or token ids with --prompt-ids 1,2,3"
        return encode_prompt(require_tokenizer(tokenizer, args.ckpt, alternatives), args.prompt)
    ids = args.prompt_ids
    bad = [i for i in ids if i >= vocab_size]
    if bad:
        raise CLIError(
            f"--prompt-ids: token id {bad[0]} is outside the model's vocabulary [0, {vocab_size})"
        )
    try:
        shown = None if tokenizer is None else tokenizer.decode(ids)
    except TokenizerError as e:
        raise CLIError(f"--prompt-ids: {e}") from None
    return shown, ids


def _write(args, model, tokenizer, ids, shown, max_new_tokens, beams, stops, options) -> int:
    """Generate and print the prompt and its continuation (see :func:`run`)."""
    with warnings.catch_warnings():
        # plan_length said it already: the library's own notes would come mid-output
        warnings.filterwarnings("ignore", message="prompt ", category=UserWarning)
        if beams:  # the best beam, once all have ended
            tokens = model.generate(
                ids,
                max_new_tokens,
                num_beams=args.num_beams,
                length_penalty=args.length_penalty,
                early_stopping=early_stopping_value(args.early_stopping),
                stop_tokens=stops,
            )
        else:
            tokens = model.stream(ids, max_new_tokens, **options)  # checks, before any output
        if not args.stream:  # all of it before any output (an error prints nothing)
            tokens = list(tokens)
        if shown is None:
            _print(",".join(map(str, args.prompt_ids)))
            for token in tokens:
                _print(f",{token}")
            _print("\n")
            return 0
        _print(shown)
        if not args.stream:
            _print(continuation(tokenizer, ids, tokens) + "\n")
            return 0
        new_ids: list[int] = []
        printed = ""
        for piece in stream_text(tokenizer, ids, tokens, new_ids):
            _print(piece)
            printed += piece
        full = continuation(tokenizer, ids, new_ids)  # what the stream held back, if any
        _print((full[len(printed) :] if full.startswith(printed) else "") + "\n")
    return 0


STREAM_CONTEXT = 4  # tokens decoded before the new ones (a SentencePiece word's space)


def stream_text(
    tokenizer, prompt_ids: list[int], tokens: Iterable[int], new_ids: list[int]
) -> Iterator[str]:
    """The text of ``tokens`` (appended to ``new_ids``) piece by piece, as they come: each
    step decodes a short window, the tokens not yet printed and a few before them, and
    yields what they add to the window's printed part, once it is whole (a token may be
    part of a multi-byte character: byte-level BPE). A window, not the whole text: the
    cost per token stays the same however long the output."""
    ids = list(prompt_ids)
    start, done = max(0, len(ids) - STREAM_CONTEXT), len(ids)  # window; printed up to done
    shown = tokenizer.decode(ids[start:done])
    for token in tokens:
        ids.append(token)
        new_ids.append(token)
        text = tokenizer.decode(ids[start:])
        if not text.startswith(shown):  # the new bytes joined what the window began with
            start, shown = done, ""
            text = tokenizer.decode(ids[start:])
        if text.endswith("\ufffd") or len(text) == len(shown):
            continue  # an incomplete character, or nothing to show yet
        yield text[len(shown) :]
        start, done = max(start, len(ids) - STREAM_CONTEXT), len(ids)
        shown = tokenizer.decode(ids[start:done])
