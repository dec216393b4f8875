"""Numbers to words: a small translation task ("1234" -> "one thousand, two hundred and
thirty-four", or "mille deux cent trente-quatre"), generated with ``num2words``.

It needs reordering and long-range alignment (French "quatre-vingt-dix-sept" for 97, the
English "and" before the last two digits) while being generated in milliseconds, so an
encoder-decoder learns it on a CPU and its attention weights show the alignment. The data
and batches know nothing about the model: the GRU encoder-decoder and the Transformer one
read the same ``Seq2SeqBatch``.

Splits are by number: a number lies in exactly one of train, val and test, chosen by a
seeded permutation, so the same seed gives the same splits. Both vocabularies are
character level with ``<pad>`` = 0, ``<bos>`` = 1, ``<eos>`` = 2.

Shapes: b batch, s source length, t target length (both padded to the longest row).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from attnlab.data.corpus import DataError

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SPECIALS = (PAD, BOS, EOS)
IGNORE_INDEX = -100  # target positions with nothing to predict


class CharVocab:
    """Specials first (pad 0, bos 1, eos 2), then the characters in sorted order."""

    pad_id, bos_id, eos_id = 0, 1, 2

    def __init__(self, chars: Iterable[str]) -> None:
        chars = sorted(set(chars))
        bad = [c for c in chars if len(c) != 1]
        if bad:
            raise DataError(f"a character vocabulary holds single characters, got {bad[:3]}")
        self.itos: list[str] = [*SPECIALS, *chars]
        self.stoi: dict[str, int] = {c: i for i, c in enumerate(self.itos)}

    def __len__(self) -> int:
        return len(self.itos)

    def __repr__(self) -> str:
        return f"CharVocab({''.join(self.itos[len(SPECIALS) :])!r})"

    @property
    def chars(self) -> str:
        return "".join(self.itos[len(SPECIALS) :])

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        unknown = sorted({c for c in text if c not in self.stoi or c in SPECIALS})
        if unknown:
            raise DataError(f"characters not in the vocabulary: {unknown[:5]} (in {text!r})")
        ids = [self.stoi[c] for c in text]
        return [self.bos_id] * bos + ids + [self.eos_id] * eos

    def decode(self, ids: Iterable[int]) -> str:
        """Characters up to the first EOS; pad and bos are skipped."""
        out = []
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            if i >= len(SPECIALS):
                out.append(self.itos[i])
        return "".join(out)


class CharVocabPair:
    """The source and target vocabularies of a translation task, saved in a checkpoint as
    its ``tokenizer.json`` (``{"attnlab_vocabulary": "char-pair", ...}``, read back by
    :func:`attnlab.tokenizers.load_tokenizer`). ``vocab_size`` is the target's: the
    model's output vocabulary."""

    kind = "char-pair"

    def __init__(self, source: CharVocab, target: CharVocab) -> None:
        self.source, self.target = source, target

    @property
    def vocab_size(self) -> int:
        return len(self.target)

    def __repr__(self) -> str:
        return f"CharVocabPair(source={self.source!r}, target={self.target!r})"

    def to_json(self) -> str:
        import json

        data = {"attnlab_vocabulary": self.kind, "source": self.source.chars}
        return json.dumps({**data, "target": self.target.chars}, ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str) -> CharVocabPair:
        import json

        data = json.loads(text)
        return cls(CharVocab(data["source"]), CharVocab(data["target"]))

    def save(self, path) -> None:
        from pathlib import Path

        from attnlab.fileio import atomic_write_text

        path = Path(path)
        atomic_write_text(
            path if path.suffix == ".json" else path / "tokenizer.json", self.to_json()
        )


def number_to_words(n: int, lang: str = "en") -> str:
    from num2words import num2words

    return num2words(n, lang=lang)


def check_language(lang: str) -> None:
    from num2words import CONVERTER_CLASSES

    if lang not in CONVERTER_CLASSES:
        known = ", ".join(sorted(CONVERTER_CLASSES))
        raise DataError(f"num2words has no language {lang!r}; known: {known}")


@dataclass(frozen=True)
class NumbersDataset:
    lang: str
    train: list[tuple[str, str]]  # (digits, words)
    val: list[tuple[str, str]]
    test: list[tuple[str, str]]
    src_vocab: CharVocab
    tgt_vocab: CharVocab

    def split(self, name: str) -> list[tuple[str, str]]:
        if name not in ("train", "val", "test"):
            raise DataError(f"unknown split {name!r}; choose train, val or test")
        return getattr(self, name)


def make_numbers_dataset(
    lang: str = "en",
    *,
    max_number: int = 10_000,
    n_train: int = 8_000,
    n_val: int = 1_000,
    n_test: int = 1_000,
    seed: int = 0,
) -> NumbersDataset:
    """Distinct numbers in [0, max_number), drawn by a permutation seeded with ``seed``,
    cut into train / val / test. The target vocabulary holds the characters of all the
    generated words (every split): it is the language's alphabet, nothing more."""
    check_language(lang)
    for name, value in (("n_train", n_train), ("n_val", n_val), ("n_test", n_test)):
        if value < 0:
            raise DataError(f"{name} must be >= 0, got {value}")
    if n_train < 1 or max_number < 1:
        raise DataError(f"need n_train >= 1 and max_number >= 1, got {n_train}, {max_number}")
    total = n_train + n_val + n_test
    if total > max_number:
        raise DataError(
            f"n_train + n_val + n_test = {total} distinct numbers do not fit below "
            f"max_number={max_number}"
        )
    order = torch.randperm(max_number, generator=torch.Generator().manual_seed(seed)).tolist()
    words = {n: number_to_words(n, lang) for n in order[:total]}
    pairs = [(str(n), words[n]) for n in order[:total]]
    alphabet = set("".join(words.values()))
    return NumbersDataset(
        lang=lang,
        train=pairs[:n_train],
        val=pairs[n_train : n_train + n_val],
        test=pairs[n_train + n_val :],
        src_vocab=CharVocab("0123456789"),
        tgt_vocab=CharVocab(alphabet),
    )


class Seq2SeqBatch(NamedTuple):
    src: Tensor  # (b, s) source ids, padded with pad_id
    src_mask: Tensor  # (b, s) True at real source tokens
    tgt_in: Tensor  # (b, t) BOS y_1 .. y_n, padded with pad_id (the decoder's input)
    tgt_out: Tensor  # (b, t) y_1 .. y_n EOS, padded with -100 (the targets)
    tgt_mask: Tensor  # (b, t) True at real target positions


def _pad(rows: Sequence[list[int]], value: int) -> Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [value] * (width - len(r)) for r in rows], dtype=torch.long)


def collate(
    pairs: Sequence[tuple[str, str]], src_vocab: CharVocab, tgt_vocab: CharVocab
) -> Seq2SeqBatch:
    if not pairs:
        raise DataError("cannot make a batch of no pairs")
    src = [src_vocab.encode(s) for s, _ in pairs]
    tgt = [tgt_vocab.encode(t) for _, t in pairs]
    if any(not s for s in src):
        raise DataError("a source string is empty")
    src_ids = _pad(src, src_vocab.pad_id)
    tgt_in = _pad([[tgt_vocab.bos_id, *t] for t in tgt], tgt_vocab.pad_id)
    tgt_out = _pad([[*t, tgt_vocab.eos_id] for t in tgt], IGNORE_INDEX)
    return Seq2SeqBatch(
        src=src_ids,
        src_mask=_pad([[1] * len(s) for s in src], 0).bool(),
        tgt_in=tgt_in,
        tgt_out=tgt_out,
        tgt_mask=tgt_out != IGNORE_INDEX,
    )


def iterate_batches(
    pairs: Sequence[tuple[str, str]],
    src_vocab: CharVocab,
    tgt_vocab: CharVocab,
    batch_size: int,
    *,
    shuffle: bool = False,
    seed: int = 0,
) -> Iterator[Seq2SeqBatch]:
    """One pass over ``pairs`` in batches (the last may be smaller); ``shuffle`` draws the
    order from ``seed``."""
    if batch_size < 1:
        raise DataError(f"batch_size must be >= 1, got {batch_size}")
    order = list(range(len(pairs)))
    if shuffle:
        order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(seed)).tolist()
    for start in range(0, len(order), batch_size):
        chunk = [pairs[i] for i in order[start : start + batch_size]]
        yield collate(chunk, src_vocab, tgt_vocab)
