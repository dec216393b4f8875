"""``attnlab translate``: translate with an encoder-decoder checkpoint, greedily or with
beam search: numbers into words with a checkpoint of the seq2seq task (the Transformer or
the GRU encoder-decoder), or text with an imported Marian, BART or T5 model (a BART source
is ``<s>`` tokens ``</s>`` as its tokenizer writes it: give it as ids with ``--source-ids``).

An imported model encodes text with its tokenizer (the checkpoint's ``tokenizer.json`` or
``--tokenizer FILE``; Marian's own SentencePiece files are not read) and ends each source
with its end-of-sequence token; without a tokenizer it takes token ids (``--source-ids``)
and prints token ids. Its output is text when the tokenizer covers the target vocabulary
(source and target share one), else token ids.
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from attnlab.cli.common import (
    CLIError,
    add_checkpoint_argument,
    add_device_argument,
    add_dtype_argument,
    add_early_stopping_argument,
    add_tokenizer_argument,
    check_beams_fit_vocabulary,
    early_stopping_value,
    finite_float,
    load_for_inference,
    positive_int,
    refuse_beam_options,
    refuse_tokenizer_option,
    resolve_device,
    token_ids,
    tokenizer_option,
)

if TYPE_CHECKING:
    from attnlab.config import ModelConfig, RunConfig

SEQ2SEQ_ARCHS = ("seq2seq", "gru-seq2seq")
DEFAULT_LENGTH_PENALTY, DEFAULT_BEAM_STYLE = 0.6, "gnmt"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "translate",
        help="translate with an encoder-decoder (numbers -> words, imported Marian, BART, T5)",
        description="Translate with an encoder-decoder checkpoint: digit strings into words "
        "with a model trained for the seq2seq task (attnlab train --preset "
        "transformer-numbers / gru-numbers), or text with an imported Marian, BART or T5 model "
        "(attnlab import-hf); without a tokenizer, token ids with --source-ids.",
    )
    add_checkpoint_argument(p)
    p.add_argument(
        "sources", nargs="*", metavar="TEXT", help="texts to translate, e.g. digit strings 1234"
    )
    p.add_argument(
        "--source-ids",
        type=token_ids,
        action="append",
        metavar="IDS",
        help="a source as token ids, comma-separated (repeatable); the output is token ids "
        "unless the checkpoint has a tokenizer for the target",
    )
    add_tokenizer_argument(p)
    p.add_argument(
        "--num-beams",
        type=positive_int,
        default=1,
        metavar="K",
        help="beam search with K beams, at most the target vocabulary size (1: greedy)",
    )
    p.add_argument(
        "--length-penalty",
        type=finite_float,
        metavar="A",
        help=f"with --num-beams: beam scores are log p / lp(length) ** A (default "
        f"{DEFAULT_LENGTH_PENALTY}; gnmt takes A >= 0)",
    )
    p.add_argument(
        "--beam-style",
        choices=("gnmt", "transformers"),
        help="with --num-beams: gnmt (default): lp = (5 + n) / 6, stop when no beam can win; "
        "transformers: lp = n, stop when num_beams have finished (as "
        "generate(early_stopping=True))",
    )
    add_early_stopping_argument(p, " --beam-style transformers")
    p.add_argument(
        "--max-new-tokens", type=positive_int, metavar="N", help="default: max_seq_len - 1"
    )
    add_device_argument(p)
    add_dtype_argument(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=run)


class Seq2SeqText:
    """How a seq2seq checkpoint's text becomes token ids and back: the numbers task's
    character vocabularies (a ``CharVocabPair``), an imported model's tokenizer (for the
    source; for the target too where the vocabularies are shared), or none (ids only).
    ``id_options``: the command's options for source and target ids (named in errors)."""

    def __init__(
        self, cfg: RunConfig, vocab, ckpt: str, id_options=("--source-ids", "--target-ids")
    ) -> None:
        from attnlab.data.numbers import CharVocabPair

        self.model_cfg, self.vocab, self.ckpt = cfg.model, vocab, ckpt
        self.id_options = id_options
        self.numbers = isinstance(vocab, CharVocabPair)
        shared = getattr(cfg.model, "source_vocab_size", None) == cfg.model.vocab_size
        self.target_vocab = vocab.target if self.numbers else vocab if shared else None

    def _need(self, option: str, alternative: str) -> None:
        if self.vocab is None:
            raise CLIError(
                f"{self.ckpt}: has no tokenizer.json, so {option} cannot be encoded; give "
                f"--tokenizer FILE (the model's tokenizer.json) or token ids with {alternative}"
            )

    def encode_source(self, text: str, option: str = "TEXT") -> list[int]:
        """Source ids of ``text`` (an imported model's end with its EOS token)."""
        self._need(option, self.id_options[0])
        if self.numbers:
            return self._encode(self.vocab.source, text, option)
        return self._encode(self.vocab, text, option) + [self.model_cfg.eos_id]

    def encode_target(self, text: str, option: str) -> list[int]:
        """Target ids of ``text`` (without BOS and EOS)."""
        self._need(option, self.id_options[1])
        if self.target_vocab is None:
            raise CLIError(
                f"{option}: the tokenizer covers the source vocabulary only (this model has a "
                f"separate target vocabulary); give the target as token ids ({self.id_options[1]})"
            )
        return self._encode(self.target_vocab, text, option)

    @staticmethod
    def _encode(vocab, text: str, option: str) -> list[int]:
        from attnlab.data.corpus import DataError
        from attnlab.tokenizers import TokenizerError

        try:
            ids = vocab.encode(text)
        except (DataError, TokenizerError) as e:
            raise CLIError(f"{option} {text!r}: {e}") from None
        if not ids:
            raise CLIError(f"{option}: the text is empty")
        return ids

    def decode_target(self, ids: list[int]) -> str | None:
        """The target text of ``ids``, or None without a target vocabulary."""
        return None if self.target_vocab is None else self.target_vocab.decode(ids)

    def source_labels(self, ids: list[int]) -> list[str]:
        """One label per source token."""
        vocab = self.vocab.source if self.numbers else self.vocab
        return _labels(vocab, ids)

    def target_labels(self, ids: list[int]) -> list[str]:
        """One label per target token."""
        return _labels(self.target_vocab, ids)


def _labels(vocab, ids: list[int]) -> list[str]:
    from attnlab.attention_maps import token_label

    if vocab is None:
        return [str(i) for i in ids]
    if hasattr(vocab, "itos"):  # a CharVocab: specials by name
        return [token_label(vocab.itos[i]) for i in ids]
    return [token_label(vocab.decode([i])) for i in ids]


def load_seq2seq(args: argparse.Namespace, device: str):
    """(model, RunConfig, Seq2SeqText) of ``args.ckpt``; CLIError unless it is an
    encoder-decoder."""
    model, cfg, vocab = load_for_inference(args.ckpt, device, args.dtype)
    if cfg.model.arch not in SEQ2SEQ_ARCHS:
        raise CLIError(
            f"{args.ckpt} holds a {cfg.model.arch!r} model; this command needs a seq2seq "
            "checkpoint (attnlab train --preset transformer-numbers, or an imported Marian, BART "
            "or T5)"
        )
    return model, cfg, seq2seq_text(args, cfg, vocab)


def seq2seq_text(
    args: argparse.Namespace, cfg: RunConfig, vocab, id_options=("--source-ids", "--target-ids")
) -> Seq2SeqText:
    """The :class:`Seq2SeqText` of a loaded checkpoint: its numbers vocabularies, else
    ``--tokenizer FILE`` or its own tokenizer (maybe none)."""
    from attnlab.data.numbers import CharVocabPair

    if isinstance(vocab, CharVocabPair):
        what = f"{args.ckpt} is a numbers checkpoint with its own character vocabularies"
        refuse_tokenizer_option(args.tokenizer, what)
    else:
        src_vocab = getattr(cfg.model, "source_vocab_size", cfg.model.vocab_size)
        vocab = tokenizer_option(args.tokenizer, vocab, src_vocab)
    return Seq2SeqText(cfg, vocab, args.ckpt, id_options)


def check_ids(ids: list[int], vocab_size: int, option: str) -> list[int]:
    """``ids`` unless one is outside [0, vocab_size): then a CLIError naming ``option``."""
    bad = [i for i in ids if i >= vocab_size]
    if bad:
        raise CLIError(
            f"{option}: token id {bad[0]} is outside the model's vocabulary [0, {vocab_size})"
        )
    return ids


def _source_rows(
    args: argparse.Namespace, text: Seq2SeqText, model_cfg: ModelConfig
) -> list[list[int]]:
    """The ids of the sources to translate: the texts (encoded), then ``--source-ids``."""
    if not args.sources and not args.source_ids:
        raise CLIError("give the texts to translate (or token ids with --source-ids)")
    if args.source_ids and text.numbers:
        raise CLIError("--source-ids is for imported models; give the numbers as digits")
    rows = [text.encode_source(s) for s in args.sources]
    source_vocab = getattr(model_cfg, "source_vocab_size", model_cfg.vocab_size)
    rows += [check_ids(ids, source_vocab, "--source-ids") for ids in args.source_ids or ()]
    longest = max(len(r) for r in rows)
    limit = model_cfg.max_seq_len
    if longest > limit:
        raise CLIError(f"a source of {longest} tokens exceeds max_seq_len={limit}")
    return rows


def check_beam_options(args: argparse.Namespace) -> dict:
    """The beam search options of ``args`` for ``model.generate``: refused by name without
    ``--num-beams`` K > 1 (they were silently ignored) and where they rank nothing (the
    library's error named its length_penalty)."""
    if args.num_beams == 1:
        refuse_beam_options(
            {
                "--length-penalty": args.length_penalty,
                "--beam-style": args.beam_style,
                "--early-stopping": args.early_stopping,
            }
        )
        return {"num_beams": 1}
    alpha = DEFAULT_LENGTH_PENALTY if args.length_penalty is None else args.length_penalty
    style = args.beam_style or DEFAULT_BEAM_STYLE
    if style == "gnmt" and args.early_stopping is not None:  # GNMT has its own stopping rule
        raise CLIError(
            "--early-stopping applies to --beam-style transformers (gnmt, the default, stops "
            "when no live beam can beat the finished ones)"
        )
    if style == "gnmt" and alpha < 0:  # its stopping rule needs lp to grow with the length
        raise CLIError(
            f"--length-penalty {alpha:g}: gnmt beam scoring (--beam-style gnmt, the default) "
            "takes A >= 0; give --beam-style transformers for a negative A"
        )
    options = {"num_beams": args.num_beams, "length_penalty": alpha, "style": style}
    return options | {"early_stopping": early_stopping_value(args.early_stopping)}


def run(args: argparse.Namespace) -> int:
    import torch

    options = check_beam_options(args)  # before the (slow) model load
    device = resolve_device(args.device)
    model, cfg, text = load_seq2seq(args, device)
    m = cfg.model
    check_beams_fit_vocabulary(args.num_beams, m.vocab_size)  # the target's
    rows = _source_rows(args, text, m)
    shown = list(args.sources) + [",".join(map(str, ids)) for ids in args.source_ids or ()]
    # Padded on the right, as the encoder's training batches are (data.numbers.collate);
    # a decoder's prompts are padded on the left instead (generation._left_padded).
    longest, pad = max(len(r) for r in rows), m.pad_id
    src = torch.tensor([r + [pad] * (longest - len(r)) for r in rows], device=device)
    src_mask = torch.tensor([[1] * len(r) + [0] * (longest - len(r)) for r in rows]).bool()
    try:
        out = model.generate(
            src, args.max_new_tokens or m.max_seq_len - 1, src_mask=src_mask.to(device), **options
        )
    except ValueError as e:
        raise CLIError(str(e)) from None
    outputs = [text.decode_target(tokens) for tokens in out]
    outputs = [",".join(map(str, t)) if o is None else o for o, t in zip(outputs, out)]
    if args.json:  # one entry per distinct input (a repeated one has the same output)
        print(json.dumps(dict(zip(shown, outputs)), ensure_ascii=False))
    else:
        for source, output in zip(shown, outputs):
            print(f"{source}\t{output}")
    return 0
