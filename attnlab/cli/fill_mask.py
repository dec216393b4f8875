"""``attnlab fill-mask``: the likeliest tokens at each ``[MASK]`` of a text, with a masked-LM
encoder: a checkpoint of the mlm task, or an imported ``BertForMaskedLM`` folder.

How the text becomes ids depends on where ``[MASK]`` lives:

* the tokenizer has a mask token of its own (a Hugging Face BERT tokenizer's ``[MASK]``,
  a RoBERTa tokenizer's ``<mask>``, which the text may hold in place of ``[MASK]``): the
  text is encoded whole, with the tokenizer's own special tokens ([CLS] ... [SEP], or
  <s> ... </s>), as transformers' fill-mask pipeline does;
* otherwise the model's id just past the tokenizer's is the mask (the mlm task's layout):
  the text is cut at each ``[MASK]``, the pieces are encoded and the mask id put between
  them; with byte-level BPE a space right before ``[MASK]`` belongs to the masked token
  (as "Ġcat" carries its space), so "the [MASK] sat" predicts " cat".

The filled-in text ("filled:") is the tokenizer's decode of the ids with each mask's best
token in place, special tokens left out, in the first case (the pipeline's ``sequence``:
WordPiece's "##s" joins its word, the text as normalised), and the text's pieces with the
tokens between them in the second.
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

import torch

from attnlab.cli.common import (
    CLIError,
    add_checkpoint_argument,
    add_device_argument,
    add_dtype_argument,
    add_tokenizer_argument,
    load_for_inference,
    positive_int,
    require_tokenizer,
    resolve_device,
    tokenizer_option,
)
from attnlab.functional.softmax import softmax_dtype

if TYPE_CHECKING:
    from attnlab.tokenizers import Tokenizer

MASK = "[MASK]"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "fill-mask",
        help="predict the tokens at [MASK] (an mlm checkpoint, a BERT, ModernBERT or RoBERTa "
        "masked LM)",
        description="Print the top-k tokens and their probabilities at every [MASK] of the "
        "text, with a masked-LM encoder: an mlm checkpoint (attnlab train --preset "
        "bert-tiny-mlm) or a BertForMaskedLM, ModernBertForMaskedLM or RobertaForMaskedLM "
        "folder (attnlab import-hf; RoBERTa's <mask> may be written for [MASK]).",
    )
    add_checkpoint_argument(p)
    p.add_argument("text", metavar="TEXT", help='text with [MASK] in it, e.g. "The c[MASK]t"')
    p.add_argument("--top-k", type=positive_int, default=5, metavar="K", help="default 5")
    add_tokenizer_argument(p)
    add_device_argument(p)
    add_dtype_argument(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=run)


def masked_ids(
    text: str, tokenizer: Tokenizer, vocab_size: int
) -> tuple[list[int], list[str], int]:
    """(ids, the text's pieces between masks as encoded, mask id) of ``text``; the pieces
    joined with the predicted tokens give the filled text (see the module docstring)."""
    pieces = text.split(MASK)
    own = own_mask_token(tokenizer)
    if own is not None:
        from attnlab.tokenizers import check_encodable

        text = check_encodable(text.replace(MASK, own))
        ids = tokenizer.hf.encode(text, add_special_tokens=True).ids
        return ids, pieces, tokenizer.hf.token_to_id(own)
    mask_id = tokenizer.vocab_size
    if vocab_size <= mask_id:
        raise CLIError(
            f"the tokenizer has no {MASK} token and the model no id past the tokenizer's "
            f"({tokenizer.vocab_size} tokens, vocab_size={vocab_size}); give the tokenizer "
            "the model was trained with (--tokenizer)"
        )
    if tokenizer.kind == "bpe":  # the space before a mask is part of the masked token
        last = len(pieces) - 1
        pieces = [p[:-1] if i < last and p.endswith(" ") else p for i, p in enumerate(pieces)]
    ids: list[int] = []
    for i, piece in enumerate(pieces):
        if i:
            ids.append(mask_id)
        ids += tokenizer.encode(piece)
    return ids, pieces, mask_id


def own_mask_token(tokenizer: Tokenizer) -> str | None:
    """The tokenizer's own mask token (BERT's ``[MASK]``, RoBERTa's ``<mask>``), or None."""
    from attnlab.tasks.text import own_special_ids, own_special_tokens

    if own_special_ids(tokenizer)[0] is None:
        return None
    return own_special_tokens(tokenizer)[0]


def token_text(tokenizer: Tokenizer, token: int, mask_id: int) -> str:
    """The text of one predicted id: [MASK] for the mlm task's extra id ``mask_id``, and
    nothing for another id past the tokenizer's (an embedding no token has: a padded
    vocabulary), as the fill-mask pipeline decodes it."""
    if token < tokenizer.vocab_size:
        return tokenizer.decode([token])
    return MASK if token == mask_id else ""


def fill_mask(
    model, tokenizer: Tokenizer, text: str, top_k: int, max_seq_len: int, device: str = "cpu"
) -> dict:
    """{"text", "filled", "masks": [{"position", "candidates": [{"token", "id", "prob"}]}]}
    for every [MASK] of ``text`` in order; "filled" puts each mask's top token in place
    (see the module docstring)."""
    given, own = text, own_mask_token(tokenizer)
    if own is not None and own != MASK:  # RoBERTa's <mask> written as it is: [MASK] here
        text = text.replace(own, MASK)
    if MASK not in text:
        raise CLIError(f"no {MASK} in the text; write {MASK} where a token is to be predicted")
    ids, pieces, mask_id = masked_ids(text, tokenizer, model.cfg.vocab_size)
    if len(ids) > max_seq_len:
        raise CLIError(
            f"the text is {len(ids)} tokens, more than the model's max_seq_len={max_seq_len}; "
            "shorten it"
        )
    positions = [i for i, token in enumerate(ids) if token == mask_id]
    with torch.no_grad():
        logits = softmax_dtype(model(torch.tensor([ids], device=device)).logits[0, positions])
    probs = logits.softmax(-1).cpu()  # (masks, V)
    masks, best = [], []
    for position, row in zip(positions, probs):
        top = row.topk(min(top_k, row.numel()))
        candidates = [
            {"token": token_text(tokenizer, int(i), mask_id), "id": int(i), "prob": float(p)}
            for p, i in zip(top.values, top.indices)
        ]
        masks.append({"position": position, "candidates": candidates})
        best.append(candidates[0]["token"])
    if mask_id < tokenizer.vocab_size:  # the tokenizer's own [MASK] (an HF BERT's)
        # its decode of the filled ids, special tokens left out, as the fill-mask
        # pipeline's "sequence": WordPiece joins "dog ##s" into "dogs"
        ids = list(ids)
        for position, mask in zip(positions, masks):
            ids[position] = mask["candidates"][0]["id"]
        filled = tokenizer.hf.decode(ids, skip_special_tokens=True)
    else:  # the text's own pieces, each mask's token between them
        filled = pieces[0] + "".join(token + piece for token, piece in zip(best, pieces[1:]))
    return {"text": given, "filled": filled, "masks": masks}


def run(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    model, cfg, tokenizer = load_for_inference(args.ckpt, device, args.dtype)
    head = getattr(cfg.model, "head", None)
    if cfg.model.arch != "encoder" or head != "mlm":
        what = f"arch {cfg.model.arch!r}" + (f", head {head!r}" if head else "")
        raise CLIError(
            f"{args.ckpt}: the model ({what}) has no masked-LM head; fill-mask needs an mlm "
            "checkpoint (attnlab train --preset bert-tiny-mlm) or an imported BertForMaskedLM"
        )
    tokenizer = tokenizer_option(args.tokenizer, tokenizer, cfg.model.vocab_size)
    tokenizer = require_tokenizer(tokenizer, args.ckpt)
    report = fill_mask(model, tokenizer, args.text, args.top_k, cfg.model.max_seq_len, device)
    if args.json:
        print(json.dumps(report, ensure_ascii=False))
        return 0
    for k, mask in enumerate(report["masks"], 1):
        print(f"{MASK} {k} (token {mask['position']}):")
        for c in mask["candidates"]:
            print(f"  {c['prob']:.4f}  {c['token']!r}")
    print(f"filled: {report['filled']}")
    return 0
