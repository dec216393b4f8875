"""``attnlab eval``: a checkpoint's task metrics on its validation set; for language
models the held-out loss, perplexity and bits per token / character, also of any text.
A model with a segment memory (Transformer-XL) reads the text as one stream, segment by
segment, its memory carried from each segment to the next; ``--set model.mem_len=...``
(and ``clamp_len``, ``same_length``) evaluates it with another memory than it trained with."""

from __future__ import annotations

import argparse
import json
import math
from typing import TYPE_CHECKING

import numpy as np

from attnlab.cli.common import (
    CLIError,
    add_checkpoint_argument,
    add_device_argument,
    add_dtype_argument,
    add_evaluation_settings_argument,
    add_tokenizer_argument,
    check_data_path,
    evaluation_settings,
    load_for_inference,
    path_arg,
    positive_int,
    refuse_tokenizer_option,
    require_tokenizer,
    resolve_device,
    tokenizer_option,
)

if TYPE_CHECKING:
    from torch import Tensor

    from attnlab.config import RunConfig
    from attnlab.tokenizers import Tokenizer


LM_ARCHS = ("decoder", "xl")  # the models the language-modelling loss applies to


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "eval",
        help="loss and task metrics of a checkpoint",
        description="The metrics of a checkpoint's task on its validation set; for a "
        "language model the mean next-token loss over consecutive non-overlapping blocks "
        "of its validation split, or of any text with --data.",
    )
    add_checkpoint_argument(p)
    p.add_argument(
        "--data",
        type=path_arg,
        metavar="PATH",
        help="a .txt or .md file, or a folder read recursively for them, to evaluate on (its "
        "whole blocks; --stride scores every token)",
    )
    p.add_argument(
        "--errors",
        choices=("strict", "replace"),
        help="--data bytes that are not UTF-8: refuse them (strict) or read them as U+FFFD "
        "(replace); default: the run's data.errors",
    )
    p.add_argument("--batch-size", type=positive_int, metavar="N", help="default: the run's")
    p.add_argument("--block-size", type=positive_int, metavar="T", help="default: the run's")
    p.add_argument("--max-batches", type=positive_int, metavar="N", help="stop after N batches")
    p.add_argument(
        "--stride",
        type=positive_int,
        metavar="S",
        help="overlapping windows of the block size moved by S tokens: each token scored "
        "once with at least block - S tokens of context (S <= block size)",
    )
    add_evaluation_settings_argument(p)
    add_device_argument(p)
    add_dtype_argument(p)
    add_tokenizer_argument(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=run)


LM_TASKS = ("lm", "lm-stream")  # evaluated as language models, of any text


def _tokens_of_file(
    path: str, tokenizer: Tokenizer, errors: str, special_tokens: bool = False
) -> tuple[np.ndarray, list]:
    """The tokens of a file or folder's documents joined as training joins them, and the
    documents' texts; ``special_tokens``: with those the tokenizer puts around a text (an
    imported LLaMA tokenizer's ``<s>`` first), as transformers' ``tokenizer(text)``."""
    from attnlab.data import DOCUMENT_SEPARATOR, read_corpus
    from attnlab.data.lm import DataError
    from attnlab.tokenizers import TokenizerError

    try:
        texts = [doc for _, doc in read_corpus(path, errors=errors)]
    except DataError as e:  # the options eval has for them
        message = str(e).replace("set data.errors=replace", "give --errors replace")
        raise CLIError(message.replace("data.path: ", "--data: ", 1)) from None
    try:
        return tokenizer.encode_array(DOCUMENT_SEPARATOR.join(texts), special_tokens), texts
    except TokenizerError as e:
        raise CLIError(f"--data {path}: {e}") from None


def run(args: argparse.Namespace) -> int:
    if args.errors is not None and args.data is None:  # it reads --data only
        raise CLIError("--errors applies to the text of --data; give --data PATH or drop it")
    device = resolve_device(args.device)
    model, cfg, tokenizer = load_for_inference(args.ckpt, device, args.dtype)
    cfg = evaluation_settings(args.set, model, cfg, "eval")
    from attnlab.data.numbers import CharVocabPair

    if cfg.model.arch == "vit":
        refuse_tokenizer_option(args.tokenizer, f"{args.ckpt} is an image classifier")
    elif isinstance(tokenizer, CharVocabPair):
        what = f"{args.ckpt} is a numbers checkpoint with its own character vocabularies"
        refuse_tokenizer_option(args.tokenizer, what)
    else:
        tokenizer = tokenizer_option(args.tokenizer, tokenizer, cfg.model.vocab_size)
    if cfg.task in LM_TASKS:
        report = _language_modelling(args, model, cfg, tokenizer, device)
    else:
        report = _task_metrics(args, model, cfg, tokenizer, device)
    if args.json:
        print(json.dumps(report))
        return 0
    if cfg.task not in LM_TASKS:
        for name, value in report.items():
            shown = f"{value:.4f}" if isinstance(value, float) else str(value)
            print(f"{name:<15} {shown}")
        return 0
    characters, bits_per_char = report["characters"], report["bits_per_char"]
    clamp = getattr(cfg.model, "clamp_len", None)
    print(f"data            {report['source']}")
    print(
        f"tokens          {report['tokens']:,} ({characters:,} characters, "
        f"block {report['block_size']}"
        + (f", stride {report['stride']}" if report.get("stride") else "")
        + (f", memory {report['memory']} carried" if report.get("memory") else "")
        + (f", distances clamped at {clamp}" if clamp else "")
        + (", same length" if getattr(cfg.model, "same_length", False) else "")
        + ")"
    )
    print(f"loss            {report['loss']:.4f} nats/token")
    print(f"perplexity      {report['perplexity']:.3f}")
    print(f"bits/token      {report['bits_per_token']:.4f}")
    if bits_per_char is not None:
        print(f"bits/character  {bits_per_char:.4f}")
    return 0


def _task_metrics(args, model, cfg: RunConfig, tokenizer, device: str) -> dict:
    """Any task: its metrics on its validation set, as the trainer measures them."""
    from attnlab.tasks import get_task

    flags = (("--data", args.data), ("--block-size", args.block_size), ("--stride", args.stride))
    for flag, value in flags:
        if value is not None:
            raise CLIError(
                f"{flag} applies to language modelling; {args.ckpt} was trained for task "
                f"{cfg.task!r}"
            )
    task = get_task(cfg.task)(cfg, tokenizer=tokenizer)
    _check_fits(args.ckpt, task, cfg)
    batch_size = args.batch_size or cfg.train.batch_size
    metrics = task.evaluate(
        model, batch_size=batch_size, max_batches=args.max_batches, device=device
    )
    return {"task": cfg.task, **metrics, "source": task.held_out}


def _check_fits(ckpt: str, task, cfg: RunConfig) -> None:
    """The task's data must fit the model (vocabulary, classes, image shape) as it did when
    the checkpoint was trained; an imported model met none of attnlab's data."""
    import copy
    import dataclasses

    from attnlab.config import ConfigError

    wanted = copy.deepcopy(cfg.model)
    try:
        task.configure_model(wanted)
    except ConfigError as e:
        raise CLIError(
            f"{ckpt}: the validation data of task {cfg.task!r} does not fit this model ({e}); "
            "eval measures a checkpoint on the data it was trained for (an imported model "
            "has none)"
        ) from None
    for f in dataclasses.fields(wanted):
        have, want = getattr(cfg.model, f.name), getattr(wanted, f.name)
        if have != want:
            raise CLIError(
                f"{ckpt}: the model has {f.name}={have} but the validation data of task "
                f"{cfg.task!r} needs {want}; eval measures a checkpoint on the data it was "
                "trained for (an imported model has none)"
            )


def _language_modelling(args, model, cfg: RunConfig, tokenizer, device: str) -> dict:
    """Loss, perplexity and bits per token and per character, on the validation split or
    on any text (``--data``)."""
    from attnlab.tasks.lm import LanguageModelling

    if cfg.model.arch not in LM_ARCHS:
        raise CLIError(
            f"{args.ckpt} holds a {cfg.model.arch!r} model; eval's language-modelling loss "
            f"needs a language model ({', '.join(LM_ARCHS)})"
        )
    tokenizer = require_tokenizer(tokenizer, args.ckpt)
    block_size = args.block_size or cfg.train.block_size or cfg.model.max_seq_len
    if block_size > cfg.model.max_seq_len:
        raise CLIError(f"--block-size {block_size} exceeds max_seq_len={cfg.model.max_seq_len}")
    batch_size = args.batch_size or cfg.train.batch_size
    packed = cfg.task == "lm" and LanguageModelling.data_options(cfg).pack_documents
    if args.data is not None:
        data = _file_data(args, cfg, tokenizer, packed)
        source = args.data
        if args.stride is None:  # short texts: one shorter block (windows need no cut)
            block_size = min(block_size, len(data.val) - 1)
    else:
        from attnlab.data import prepare_data

        data = prepare_data(cfg.data, tokenizer=tokenizer)
        source = f"validation split of {cfg.data.path or 'the embedded corpus'}"
    task = None
    memory = getattr(model.cfg, "mem_len", None) if hasattr(model, "new_memory") else None
    if memory is not None:
        result = _with_memory(args, model, data.val, block_size, device)
    elif args.stride is not None:
        documents = None
        if packed:  # each document's windows on their own, as in training
            starts = _starts_document(data, len(data.val))
            cuts = [0, *(starts.nonzero()[:, 0] + 1).tolist(), len(data.val)]
            documents = list(zip(cuts[:-1], cuts[1:]))
        result = _strided(args, model, data.val, block_size, batch_size, device, documents)
        if documents is not None:  # the characters of the targets scored
            from attnlab.tasks.lm import strided_groups

            groups = strided_groups(
                documents, block_size, args.stride, batch_size, args.max_batches
            )
            result["characters"] = sum(
                characters_of(tokenizer, data.val[e + 1 - n : e + 1])
                for group in groups
                for _, e, n in group
            )
    else:
        task = LanguageModelling(
            cfg, tokenizer=tokenizer, data=data, block_size=block_size, eval_sample=False
        )
        result = task.evaluate(
            model, batch_size=batch_size, max_batches=args.max_batches, device=device
        )
    # Block j's targets are tokens[j t + 1 : (j + 1) t + 1], so the targets evaluated are
    # exactly tokens[1 : 1 + n]; their text gives the characters predicted. Packed
    # documents: n blocks' targets less each document's first token (not scored).
    if task is not None and task.pack_documents:
        walked = task.n_eval_blocks(batch_size, args.max_batches) * block_size
        targets = data.val[1 : 1 + walked]
        firsts = targets[_starts_document(data, walked + 1).numpy()]
        characters = characters_of(tokenizer, targets) - sum(
            characters_of(tokenizer, [i]) for i in firsts
        )
    elif "characters" in result:
        characters = result["characters"]
    else:
        characters = characters_of(tokenizer, data.val[1 : 1 + result["tokens"]])
    total_bits = result["loss"] * result["tokens"] / math.log(2.0)
    return {
        "task": "lm",
        "loss": result["loss"],
        "perplexity": result["perplexity"],
        "tokens": result["tokens"],
        "bits_per_token": result["bits_per_token"],
        "characters": characters,
        "bits_per_char": total_bits / characters if characters else None,
        "block_size": block_size,
        "stride": args.stride,
        "memory": memory,
        "source": source,
    }


def _starts_document(data, n: int) -> Tensor:
    """(n - 1,) bool: whether each of the validation split's tokens 1 .. n - 1 begins a
    packed document (token 0 begins one)."""
    import torch

    ids = data.document_ids("val", torch.zeros(1, dtype=torch.int64), n)[0]  # (n,)
    return ids[1:] != ids[:-1]


def _file_data(args, cfg: RunConfig, tokenizer, packed: bool):
    """The text of ``--data`` as a TokenDataset whose validation split is all of it (and
    so is its training split), its documents apart when training packed them."""
    from attnlab.data import TokenDataset
    from attnlab.data.lm import DataError, document_starts

    check_data_path(args.data)
    # read as the model's tokenizer reads a text: an imported LLaMA's opens with <s>
    # (packed documents are cut at their texts' boundaries, which holds none)
    errors = args.errors or cfg.data.errors
    tokens, texts = _tokens_of_file(args.data, tokenizer, errors, not packed)
    if len(tokens) < 2:
        raise CLIError(f"--data {args.data}: needs at least 2 tokens, got {len(tokens)}")
    doc_starts = None
    if packed:  # the documents apart, as in training
        try:
            starts = document_starts(tokenizer, tokens, texts)
        except DataError as e:
            raise CLIError(f"--data {args.data}: {e}") from None
        doc_starts = np.concatenate((starts, starts + len(tokens)))  # (train, then val)
    return TokenDataset(tokenizer=tokenizer, train=tokens, val=tokens, doc_starts=doc_starts)


def characters_of(tokenizer: Tokenizer, ids) -> int:
    """The characters of the text that the tokens ``ids`` (a run of the stream) predict:
    those beginning in them, so a character cut across tokens (byte-level BPE) counts
    once whichever runs its bytes fall in (decoding a run that starts or ends inside a
    character would count a U+FFFD per stray byte); by decoding for tokenizers that do
    not say where characters begin."""
    starts = tokenizer.char_starts()
    ids = np.asarray(ids, dtype=np.int64)
    if starts is None:
        return len(tokenizer.decode(ids))
    return int(starts[ids].sum())


def _with_memory(args, model, tokens, block_size: int, device: str) -> dict:
    """The whole text as one stream in consecutive segments of ``block_size``, the model's
    memory carried from each to the next (Transformer-XL); ``--max-batches`` segments."""
    import torch

    from attnlab.tasks.base import eval_mode
    from attnlab.tasks.lm import lm_summary
    from attnlab.tasks.lm_stream import stream_loss_sums

    if args.stride is not None:
        raise CLIError(
            "--stride: this model reads the text in segments with its memory carried, not "
            "in overlapping windows; drop --stride"
        )
    stream = torch.from_numpy(np.asarray(tokens, dtype=np.int64))[None]  # (1, n)
    with eval_mode(model):
        total, count = stream_loss_sums(
            model, stream, block_size, max_segments=args.max_batches, device=device
        )
    return lm_summary(total, count)


def _strided(
    args, model, tokens, block_size: int, batch_size: int, device: str, documents=None
) -> dict:
    """The whole stream through overlapping windows of ``block_size`` (``--stride``);
    ``documents``: (begin, end) spans scored each on its own (packed documents)."""
    import torch

    from attnlab.tasks.base import eval_mode
    from attnlab.tasks.lm import lm_summary, strided_loss_sums

    if args.stride > block_size:
        raise CLIError(
            f"--stride {args.stride} exceeds the window of {block_size} tokens (--block-size, "
            "default the run's train.block_size, else max_seq_len); use a stride from 1 to "
            "the window"
        )
    with eval_mode(model):
        total, count = strided_loss_sums(
            model,
            torch.from_numpy(np.asarray(tokens, dtype=np.int64)),
            window=block_size,
            stride=args.stride,
            batch_size=batch_size,
            max_batches=args.max_batches,
            device=device,
            documents=documents,
        )
    return lm_summary(total, count)
