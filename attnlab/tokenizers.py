"""Tokenizers: a character tokenizer and byte-level BPE, both stored as a standard
Hugging Face ``tokenizer.json``.

Both kinds wrap a ``tokenizers.Tokenizer`` so that one file format saves and reloads
them (and other tools can read it). The hot paths avoid per-token Python work:

* ``char``: a WordLevel model over single characters (one id per code point, ids in
  sorted character order). Encoding maps code points to ids with numpy
  (``searchsorted``); the HF pipeline (split every character, ``Fuse`` decoder) gives the
  same ids and is the oracle in the tests.
* ``bpe``: byte-level BPE (GPT-2 style: ByteLevel pre-tokenizer and decoder), so any
  unicode text round-trips exactly. Long texts are cut at safe line breaks and encoded
  with ``encode_batch``, which runs the pieces in parallel and yields the same ids as
  encoding the whole text at once.

A ``tokenizer.json`` of another model type that ships with BERT checkpoints, WordPiece,
loads too (kind ``wordpiece``: encoded and decoded by its own pipeline, never trained
here), so imported BERT folders keep their tokenizer.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
from tokenizers import Encoding, Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from attnlab.fileio import atomic_write_text

TOKENIZER_KINDS = ("char", "bpe")
TOKENIZER_FILE = "tokenizer.json"

# Target size of the pieces a long text is cut into for ``encode_batch``.
_CHUNK_CHARS = 1 << 16
# A cut here cannot change byte-level pre-tokenization: a "\n" between two visible
# ASCII characters is always a pre-token of its own (the GPT-2 pattern has no
# look-behind, and its only look-ahead, ``\s+(?!\S)``, sees the same next character),
# so the text after it is split exactly as it would be in the whole string. (ASCII only,
# so that Python's and the Rust regex engine's idea of whitespace cannot differ.)
_SAFE_CUT = re.compile(r"(?<=[!-~]\n)(?=[!-~])")
_MAX_LISTED = 10  # unknown characters named in an error message


class TokenizerError(ValueError):
    """Text a tokenizer cannot encode, ids it cannot decode, or a bad tokenizer file."""


def _describe_char(char: str) -> str:
    return f"{char!r} (U+{ord(char):04X})"


def check_encodable(text: str) -> str:
    """``text`` if a Rust tokenizer can take it: no lone surrogates (which an undecodable
    byte in a file or on the command line becomes); else a TokenizerError naming it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise TokenizerError(
            f"the text holds {_describe_char(text[e.start])} at position {e.start}, a lone "
            "surrogate (a byte that is not UTF-8); pass UTF-8 text"
        ) from None
    return text


def _code_points(text: str) -> np.ndarray:
    """Text -> (n,) uint32 code points, without a Python loop over characters."""
    # surrogatepass keeps lone surrogates (which str may hold) as their own code points.
    return np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")


def _from_code_points(points: np.ndarray) -> str:
    return points.astype("<u4").tobytes().decode("utf-32-le", "surrogatepass")


def split_for_encoding(text: str, chunk_chars: int | None = None) -> list[str]:
    """Cut ``text`` into pieces of about ``chunk_chars`` at cuts that leave byte-level
    pre-tokenization unchanged, so encoding the pieces equals encoding the whole."""
    chunk_chars = chunk_chars or _CHUNK_CHARS
    if len(text) <= chunk_chars:
        return [text]
    pieces = []
    start = 0
    while len(text) - start > chunk_chars:
        cut = _SAFE_CUT.search(text, start + chunk_chars)
        if cut is None:
            break
        pieces.append(text[start : cut.start()])
        start = cut.start()
    pieces.append(text[start:])
    return pieces


class Tokenizer:
    """A trained tokenizer: ``kind`` is "char", "bpe" or "wordpiece" (loaded only); ids are
    in ``[0, vocab_size)``."""

    def __init__(self, hf: HFTokenizer) -> None:
        # A tokenizer.json keeps the padding and truncation its last caller set (transformers'
        # save_pretrained after tokenizer(..., padding="max_length", truncation=True) writes
        # them); attnlab encodes every text whole and unpadded, as transformers' pipelines
        # do, and says so when a text is too long: drop them (from a copy: the caller's
        # tokenizer keeps its settings).
        if hf.padding is not None or hf.truncation is not None:
            hf = HFTokenizer.from_str(hf.to_str())
            hf.no_padding()
            hf.no_truncation()
        self.hf = hf
        spec = json.loads(hf.to_str())  # its tokenizer.json, read once
        model_type = spec["model"]["type"]
        if model_type == "WordLevel":
            self.kind = "char"
            self._init_char_tables()
        elif model_type == "BPE":
            self.kind = "bpe"
        elif model_type == "WordPiece":  # BERT's, loaded from an imported folder
            self.kind = "wordpiece"
        else:
            raise TokenizerError(
                f"unsupported tokenizer model {model_type!r}; attnlab uses WordLevel "
                "(char), BPE (bpe) or WordPiece (BERT) tokenizers"
            )
        self.vocab_size = hf.get_vocab_size(with_added_tokens=True)
        self._chunkable = _cuts_are_safe(spec)
        self._byte_level = _is_byte_level(spec)
        self._char_starts: np.ndarray | None = None

    def _init_char_tables(self) -> None:
        vocab = self.hf.get_vocab(with_added_tokens=True)  # token -> id
        bad = [token for token in vocab if len(token) != 1]
        if bad:
            raise TokenizerError(
                f"a char tokenizer's vocabulary must hold single characters, found {bad[:3]}"
            )
        points = np.array([ord(token) for token in vocab], dtype=np.uint32)
        ids = np.array(list(vocab.values()), dtype=np.int64)
        order = np.argsort(points)
        self._sorted_points = points[order]  # (V,) ascending code points
        self._sorted_ids = ids[order]  # (V,) the id of each of them
        self._id_to_point = np.zeros(int(ids.max()) + 1, dtype=np.uint32)
        self._id_to_point[ids] = points

    def __repr__(self) -> str:
        return f"Tokenizer(kind={self.kind!r}, vocab_size={self.vocab_size})"

    # ------------------------------------------------------------------ encoding

    def encode_array(self, text: str, add_special_tokens: bool = False) -> np.ndarray:
        """Text -> (n,) int64 ids, fast on long texts (the path the data pipeline uses).
        ``add_special_tokens``: with the special tokens the tokenizer's post-processor puts
        around a text (a LLaMA tokenizer's ``<s>`` first), as transformers'
        ``tokenizer(text)`` encodes it; attnlab's own tokenizers have none."""
        specials = add_special_tokens and self.hf.post_processor is not None
        if self.kind == "char" and not specials:
            return self._encode_char(text)
        text = check_encodable(text)
        # a text cut into pieces encodes as the whole only where no step of the pipeline
        # depends on where a piece starts (not so for SentencePiece's prepended "▁")
        pieces = split_for_encoding(text) if self._chunkable else [text]
        encodings = self.hf.encode_batch(pieces, add_special_tokens=False)
        if specials:
            merged = Encoding.merge(encodings, growing_offsets=True)
            return np.asarray(self.hf.post_process(merged).ids, dtype=np.int64)
        arrays = [np.asarray(encoding.ids, dtype=np.int64) for encoding in encodings]
        return np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)

    def _encode_char(self, text: str) -> np.ndarray:
        points = _code_points(text)
        where = np.searchsorted(self._sorted_points, points)
        where = np.minimum(where, len(self._sorted_points) - 1)
        known = self._sorted_points[where] == points
        if not known.all():
            unknown, counts = np.unique(points[~known], return_counts=True)
            listed = ", ".join(_describe_char(chr(p)) for p in unknown[:_MAX_LISTED].tolist())
            more = f" and {len(unknown) - _MAX_LISTED} more" if len(unknown) > _MAX_LISTED else ""
            raise TokenizerError(
                f"{int(counts.sum())} characters not in the vocabulary: {listed}{more}; the "
                "char tokenizer knows only the characters of the corpus it was trained on "
                "(train it on text that has them, or use the bpe tokenizer)"
            )
        return self._sorted_ids[where]

    def token_lengths(self) -> np.ndarray:
        """(vocab_size,) int64: how much text each id stands for, in characters (``char``)
        or UTF-8 bytes (``bpe``: a byte-level token's string has one symbol per byte). The
        running sum over a token stream gives each token's offset in the text."""
        lengths = np.zeros(self.vocab_size, dtype=np.int64)
        for token, i in self.hf.get_vocab(with_added_tokens=True).items():
            lengths[i] = len(token)
        return lengths

    def char_starts(self) -> np.ndarray | None:
        """(vocab_size,) int64: how many characters of the text begin in each id's text, so
        that the characters a run of ids covers is ``char_starts()[ids].sum()`` even where
        a character is cut across tokens (byte-level BPE: it counts once, in the token
        holding its first byte; decoding a run that starts or ends inside a character
        gives a U+FFFD per stray byte). ``char``: 1 per id; byte-level BPE: the token's
        bytes that are not UTF-8 continuation bytes (0x80-0xBF); None for other
        tokenizers (count characters by decoding)."""
        if self._char_starts is None and self.kind == "char":
            self._char_starts = np.ones(self.vocab_size, dtype=np.int64)
        elif self._char_starts is None and self._byte_level:
            to_byte = _byte_level_decoder()
            starts = np.zeros(self.vocab_size, dtype=np.int64)
            for token, i in self.hf.get_vocab(with_added_tokens=True).items():
                if all(symbol in to_byte for symbol in token):
                    starts[i] = sum(1 for symbol in token if not 0x80 <= to_byte[symbol] < 0xC0)
                else:  # an added token ("<|endoftext|>") decodes to its own text
                    starts[i] = len(self.decode([i]))
            self._char_starts = starts
        return self._char_starts

    def text_length(self, text: str) -> int:
        """The length of ``text`` in the units of :meth:`token_lengths`."""
        return len(text) if self.kind == "char" else len(text.encode("utf-8", "surrogatepass"))

    @property
    def unk_id(self) -> int | None:
        """The id of the unknown token, which stands for text the vocabulary cannot spell
        (WordPiece's "[UNK]"); None where the tokenizer has none (byte-level BPE spells
        everything; a char tokenizer refuses unknown characters)."""
        unk = getattr(self.hf.model, "unk_token", None)
        return None if unk is None else self.hf.token_to_id(unk)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.encode_array(text, add_special_tokens).tolist()

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            bad = ids[(ids < 0) | (ids >= self.vocab_size)][0]
            raise TokenizerError(f"token id {int(bad)} is outside [0, {self.vocab_size})")
        if self.kind == "char":
            return _from_code_points(self._id_to_point[ids])
        return self.hf.decode(ids.tolist(), skip_special_tokens=False)

    # ------------------------------------------------------------------ files

    def to_json(self) -> str:
        """The ``tokenizer.json`` text (deterministic: also used as a cache key)."""
        return self.hf.to_str()

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write ``tokenizer.json``; ``path`` is a ``.json`` file or a directory. Atomic."""
        path = Path(path)
        target = path if path.suffix == ".json" else path / TOKENIZER_FILE
        atomic_write_text(target, self.to_json())
        return target


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the symbol standing for each byte -> the byte
    (printable bytes stand for themselves, the others for code points from 256 up)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    symbols, extra = {}, 0
    for byte in range(256):
        if byte in kept:
            symbols[chr(byte)] = byte
        else:
            symbols[chr(256 + extra)] = byte
            extra += 1
    return symbols


def _is_byte_level(spec: dict) -> bool:
    """Whether the tokenizer of ``spec`` (its ``tokenizer.json``) decodes byte-level
    tokens (GPT-2's alphabet: attnlab's bpe, GPT-2, Qwen2, LLaMA 3)."""
    decoder = spec.get("decoder") or {}
    kinds = [d.get("type") for d in decoder.get("decoders", [decoder])]
    return spec["model"]["type"] == "BPE" and "ByteLevel" in kinds


def _cuts_are_safe(spec: dict) -> bool:
    """Whether a text cut by :func:`split_for_encoding` encodes as the whole text with the
    tokenizer of ``spec`` (its ``tokenizer.json``): not when its normalizer or
    pre-tokenizer adds something at the start of every text (SentencePiece-style
    tokenizers' ``Prepend("▁")`` or ``Metaspace``, a byte-level ``add_prefix_space``),
    which would be added at every cut too, nor when nothing splits the text at its
    newlines (no pre-tokenizer, or ``Metaspace``, which splits at spaces only): then a
    token holding a newline and what follows it ("\\nb") would be cut in two."""

    def nodes(node):
        if isinstance(node, dict):
            yield node
            for value in node.values():
                yield from nodes(value)
        elif isinstance(node, list):
            for value in node:
                yield from nodes(value)

    if spec.get("pre_tokenizer") is None:  # the model sees the whole text as one piece
        return False
    for node in (*nodes(spec.get("normalizer")), *nodes(spec.get("pre_tokenizer"))):
        kind = node.get("type")
        if kind in ("Prepend", "Metaspace"):
            return False
        if kind == "ByteLevel" and node.get("add_prefix_space"):
            return False
    return True


def _char_tokenizer(chars: Iterable[str]) -> Tokenizer:
    vocab = {char: i for i, char in enumerate(sorted(set(chars)))}
    if not vocab:
        raise TokenizerError("cannot train a char tokenizer on empty text")
    hf = HFTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    # Every code point is its own pre-token; Fuse joins tokens back without spaces.
    hf.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    hf.decoder = decoders.Fuse()
    return Tokenizer(hf)


def _bpe_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet):
        raise TokenizerError(
            f"bpe vocab_size must be at least {len(alphabet)} (the byte alphabet), got {vocab_size}"
        )
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=alphabet,  # all 256 bytes, so no text is ever unknown
        special_tokens=[],
        show_progress=False,
    )
    hf.train_from_iterator(
        (piece for text in texts for piece in split_for_encoding(text)), trainer=trainer
    )
    return Tokenizer(hf)


def train_tokenizer(kind: str, texts: Iterable[str], vocab_size: int = 4096) -> Tokenizer:
    """Train a tokenizer on ``texts``. ``char``: the vocabulary is the sorted set of
    characters (``vocab_size`` is ignored). ``bpe``: byte-level BPE with at most
    ``vocab_size`` tokens (fewer when the text has too few distinct merges). A single
    string is one text (iterated, it was one text per character: bpe learnt no merge)."""
    if isinstance(texts, str):
        texts = [texts]
    texts = (check_encodable(text) for text in texts)  # a lone surrogate: named, not a crash
    if kind == "char":
        chars: set[str] = set()
        for text in texts:
            chars.update(text)
        return _char_tokenizer(chars)
    if kind == "bpe":
        return _bpe_tokenizer(texts, vocab_size)
    raise TokenizerError(f"unknown tokenizer kind {kind!r}; choose one of {TOKENIZER_KINDS}")


# Vocabularies of tasks that are not one Hugging Face tokenizer (the numbers task's two
# character vocabularies) save JSON with this key naming their kind; the kind's class
# (imported on demand) rebuilds them with ``from_json``.
VOCABULARY_KEY = "attnlab_vocabulary"
VOCABULARY_KINDS = {"char-pair": "attnlab.data.numbers:CharVocabPair"}


def _task_vocabulary(file: Path):
    """The task vocabulary saved in ``file``, or None when it is a Hugging Face one."""
    import importlib

    try:
        # UTF-8, as every writer writes it (a char-pair vocabulary holds "é" unescaped),
        # never the locale's encoding (cp1252 read it back as "Ã©": other characters)
        text = file.read_text(encoding="utf-8")
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None  # HFTokenizer.from_file reports it
    if not isinstance(data, dict) or VOCABULARY_KEY not in data:
        return None
    kind = data[VOCABULARY_KEY]
    if kind not in VOCABULARY_KINDS:
        raise TokenizerError(
            f"{file}: unknown vocabulary kind {kind!r}; known: {', '.join(VOCABULARY_KINDS)}"
        )
    module, name = VOCABULARY_KINDS[kind].split(":")
    try:
        return getattr(importlib.import_module(module), name).from_json(text)
    except (ValueError, KeyError, TypeError) as e:
        raise TokenizerError(f"{file}: invalid {kind} vocabulary ({e})") from None


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """Load a ``tokenizer.json`` file, or the one inside the directory ``path`` (a task
    vocabulary saved by attnlab, e.g. the numbers task's, comes back as its own class)."""
    path = Path(path)
    file = path / TOKENIZER_FILE if path.is_dir() else path
    if file.exists() and not file.is_file():
        raise TokenizerError(f"{file}: not a regular file; give a tokenizer.json file")
    if not file.is_file():
        raise TokenizerError(f"{file}: tokenizer file not found; save one with Tokenizer.save")
    vocabulary = _task_vocabulary(file)
    if vocabulary is not None:
        return vocabulary
    try:
        # read here, not by from_file: the Rust side takes only UTF-8 paths, and a folder's
        # name may hold any bytes (a lone surrogate in str)
        hf = HFTokenizer.from_str(file.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise TokenizerError(
            f"{file}: not a valid tokenizer.json (byte offset {e.start} is not UTF-8)"
        ) from None
    except Exception as e:  # tokenizers raises plain Exception for bad JSON
        first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise TokenizerError(f"{file}: not a valid tokenizer.json ({first_line})") from None
    try:
        return Tokenizer(hf)
    except TokenizerError as e:
        raise TokenizerError(f"{file}: {e}") from None
