"""Language-modelling data: a corpus tokenised once into a cached token stream, split into
train and validation, and sampled as (x, y) blocks where y is x shifted by one token. The
stream remembers where each document of the corpus starts (``doc_starts``), so a block can
tell its packed documents apart (``document_ids``).

Shapes: n sequences in a batch, t = block_size tokens per sequence.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from attnlab.config import DataConfig
from attnlab.data.corpus import (
    DOCUMENT_SEPARATOR,
    DataError,
    RawSource,
    decode_source,
    load_sources,
    sources_digest,
)
from attnlab.fileio import atomic_path, atomic_write_text
from attnlab.tokenizers import (
    Tokenizer,
    TokenizerError,
    load_tokenizer,
    split_for_encoding,
    train_tokenizer,
)

CACHE_ENV = "ATTNLAB_CACHE"
CACHE_DIRNAME = ".attnlab_cache"  # the old in-cwd location (make clean removes it)
_CACHE_VERSION = "1"  # bump when the cached stream's format or meaning changes
SPLITS = ("train", "val")


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned type that holds every id: uint16 below 65536 tokens."""
    return np.dtype(np.uint16 if vocab_size < 2**16 else np.uint32)


def default_cache_dir() -> Path:
    """Where tokenizers and token streams are cached: ``$ATTNLAB_CACHE`` if set, else the
    user cache folder ``$XDG_CACHE_HOME/attnlab`` (``~/.cache/attnlab`` by default), never
    the current directory."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "attnlab"


@dataclass
class TokenDataset:
    """A token stream split into ``train`` and ``val`` (1-D arrays, possibly memory maps)."""

    tokenizer: Tokenizer
    train: np.ndarray
    val: np.ndarray
    sources: list[str] = field(default_factory=list)  # document names, in stream order
    # Token index (in the whole stream, train then val) where each document starts, sorted;
    # None: the stream is one document.
    doc_starts: np.ndarray | None = None
    n_chars: int | None = None  # characters in the joined corpus
    from_cache: bool = False  # True when the token stream was read from the cache
    cache_file: Path | None = None

    def split(self, split: str) -> np.ndarray:
        if split == "train":
            return self.train
        if split == "val":
            return self.val
        raise DataError(f"unknown split {split!r}; choose train or val")

    @property
    def n_tokens(self) -> int:
        return len(self.train) + len(self.val)

    def check_block(self, block_size: int) -> None:
        """Fail clearly when a split cannot hold one (x, y) pair of ``block_size`` tokens."""
        if block_size < 1:
            raise DataError(f"block_size must be >= 1, got {block_size}")
        for name in SPLITS:
            length = len(self.split(name))
            if length < block_size + 1:
                fix = "raise data.val_fraction" if name == "val" else "lower data.val_fraction"
                raise DataError(
                    f"the {name} split has {length} tokens but block_size={block_size} needs "
                    f"at least {block_size + 1}; use a longer corpus, a smaller "
                    f"train.block_size, or {fix}"
                )

    def sample_starts(
        self, split: str, n: int, block_size: int, generator: torch.Generator | None
    ) -> Tensor:
        """(n,) int64 block starts drawn uniformly from [0, len(split) - block_size - 1]."""
        self.check_block(block_size)
        high = len(self.split(split)) - block_size  # exclusive: the last start still has a y
        return torch.randint(0, high, (n,), generator=generator, dtype=torch.int64)

    def windows(self, split: str, starts: Tensor, length: int) -> Tensor:
        """(n, length) int64: tokens[s : s + length] of ``split`` for each start s (a
        DataError when a window would run past the split)."""
        tokens = self.split(split)
        starts_np = starts.detach().cpu().numpy().astype(np.int64).reshape(-1)
        if starts_np.size and (starts_np.min() < 0 or starts_np.max() > len(tokens) - length):
            raise DataError(
                f"block starts must lie in [0, {len(tokens) - length}] for the {split} "
                f"split ({len(tokens)} tokens, windows of {length})"
            )
        offsets = np.arange(length, dtype=np.int64)
        windows = tokens[starts_np[:, None] + offsets]  # (n, length): one gather, no loop
        return torch.from_numpy(windows.astype(np.int64))

    def batch(
        self,
        split: str,
        starts: Tensor,
        block_size: int,
        device: torch.device | str | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Blocks at ``starts`` -> x, y (n, t) int64: x = tokens[s : s + t] and
        y = tokens[s + 1 : s + t + 1], the next token at every position."""
        windows = self.windows(split, starts, block_size + 1)  # (n, t + 1)
        x = windows[:, :-1].contiguous()  # (n, t)
        y = windows[:, 1:].contiguous()  # (n, t)
        if device is not None:
            x, y = x.to(device), y.to(device)
        return x, y

    def document_ids(self, split: str, starts: Tensor, length: int) -> Tensor:
        """(n, length) int64: the index of the document each of tokens[s : s + length] of
        ``split`` belongs to, counted from the document of the row's first token (rows are
        non-decreasing: 0, 0, 1, 1, 1, 2, ...)."""
        self.split(split)  # checks the name
        offset = 0 if split == "train" else len(self.train)
        index = starts.detach().cpu().to(torch.int64).reshape(-1, 1) + torch.arange(length)
        if self.doc_starts is None:
            return torch.zeros_like(index)
        bounds = torch.from_numpy(np.asarray(self.doc_starts, dtype=np.int64))
        ids = torch.searchsorted(bounds, index + offset, right=True)  # (n, length)
        return ids - ids[:, :1]

    def n_eval_blocks(self, split: str, block_size: int) -> int:
        """How many non-overlapping blocks ``iter_eval`` walks over."""
        return max(0, (len(self.split(split)) - 1) // block_size)

    def iter_eval(
        self,
        split: str,
        batch_size: int,
        block_size: int,
        max_batches: int | None = None,
        device: torch.device | str | None = None,
    ) -> Iterator[tuple[Tensor, Tensor]]:
        """Deterministic (x, y) batches of consecutive, non-overlapping blocks from the
        start of ``split``: block j covers x = tokens[j t : (j + 1) t]. The last batch
        may be smaller; ``max_batches`` stops early."""
        self.check_block(block_size)
        if batch_size < 1:
            raise DataError(f"batch_size must be >= 1, got {batch_size}")
        n_blocks = self.n_eval_blocks(split, block_size)
        all_starts = torch.arange(n_blocks, dtype=torch.int64) * block_size  # (n_blocks,)
        for i, starts in enumerate(all_starts.split(batch_size)):
            if max_batches is not None and i >= max_batches:
                return
            yield self.batch(split, starts, block_size, device)


def _digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode("utf-8")).hexdigest()[:20]


def _encode_corpus(tokenizer: Tokenizer, text: str) -> np.ndarray:
    """Tokenise the whole corpus (the one expensive step the cache saves)."""
    return tokenizer.encode_array(text)


def document_starts(tokenizer: Tokenizer, ids: np.ndarray, texts: list[str]) -> np.ndarray:
    """Token index where each of ``texts`` starts in ``ids``, the tokens of the texts joined
    by ``DOCUMENT_SEPARATOR``: the first token that begins at or after the document's first
    character. (A token spanning a boundary, which byte-level BPE can make of the separator
    and a leading space, stays with the document it begins in.)"""
    if tokenizer.char_starts() is None:  # neither characters nor byte-level BPE
        return _offset_starts(tokenizer, ids, texts)
    lengths = tokenizer.token_lengths()[np.asarray(ids, dtype=np.int64)]  # (n,)
    ends = np.cumsum(lengths)
    sizes = np.array([tokenizer.text_length(text) for text in texts], dtype=np.int64)
    sep = tokenizer.text_length(DOCUMENT_SEPARATOR)
    first = np.concatenate(([0], np.cumsum(sizes[:-1] + sep)))  # (n_docs,) text offsets
    total = int(sizes.sum()) + sep * (len(texts) - 1)
    if (int(ends[-1]) if len(ends) else 0) != total:
        raise DataError(
            f"the token stream covers {int(ends[-1]) if len(ends) else 0} units of text but "
            f"the corpus has {total}; the tokenizer does not reproduce the text exactly"
        )
    return np.searchsorted(ends - lengths, first, side="left").astype(np.int64)


def _offset_starts(tokenizer: Tokenizer, ids: np.ndarray, texts: list[str]) -> np.ndarray:
    """:func:`document_starts` for a tokenizer whose tokens do not spell out the text
    (WordPiece drops spaces, SentencePiece's "▁" and byte fallback "<0xE9>" are not the
    text's characters): from the character offsets of the tokens, encoded as
    ``Tokenizer.encode_array`` encodes the corpus."""
    text = DOCUMENT_SEPARATOR.join(texts)
    pieces = split_for_encoding(text) if tokenizer._chunkable else [text]
    starts, again, base = [], [], 0
    for piece, encoding in zip(pieces, tokenizer.hf.encode_batch(pieces, add_special_tokens=False)):
        again += encoding.ids
        starts += [base + start for start, _ in encoding.offsets]
        base += len(piece)
    if again != np.asarray(ids).tolist():
        raise DataError("the token stream is not the corpus's encoding with this tokenizer")
    sizes = np.array([len(t) for t in texts], dtype=np.int64)
    first = np.concatenate(([0], np.cumsum(sizes[:-1] + len(DOCUMENT_SEPARATOR))))
    return np.searchsorted(np.asarray(starts, dtype=np.int64), first, side="left").astype(np.int64)


def _save_array_atomic(target: Path, array: np.ndarray) -> None:
    with atomic_path(target) as tmp, open(tmp, "wb") as file:  # np.save(path) adds ".npy"
        np.save(file, array)


def _load_cached_tokens(file: Path, dtype: np.dtype) -> np.ndarray | None:
    if not file.is_file():
        return None
    try:
        tokens = np.load(file, mmap_mode="r")
    except Exception:  # noqa: BLE001 - any unreadable entry (empty: EOFError; a garbled
        return None  # header: ValueError or tokenize.TokenError; truncated...): rebuild
    if tokens.ndim != 1 or tokens.dtype != dtype:
        return None
    return tokens


class _Corpus:
    """Corpus bytes, decoded and joined only when something needs the text."""

    def __init__(self, sources: list[RawSource], errors: str) -> None:
        self.sources = sources
        self.errors = errors
        self.digest = sources_digest(sources)
        self._texts: list[str] | None = None
        self._text: str | None = None

    @property
    def texts(self) -> list[str]:
        if self._texts is None:
            self._texts = [decode_source(source, self.errors) for source in self.sources]
        return self._texts

    @property
    def text(self) -> str:
        if self._text is None:
            self._text = DOCUMENT_SEPARATOR.join(self.texts)
        return self._text


def _warn_no_cache(file: Path, error: OSError) -> None:
    message = f"could not write the data cache {file} ({error}); continuing without it"
    warnings.warn(message, stacklevel=3)


def _cached_tokenizer(cfg: DataConfig, corpus: _Corpus, cache: Path) -> Tokenizer:
    """Train the tokenizer on the corpus, or reuse the one trained on the same corpus."""
    size = str(cfg.bpe_vocab_size) if cfg.tokenizer == "bpe" else "-"
    key = _digest(_CACHE_VERSION, corpus.digest, cfg.errors, cfg.tokenizer, size)
    file = cache / f"tokenizer-{cfg.tokenizer}-{key}.json"
    if file.is_file():
        try:
            cached = load_tokenizer(file)
            if getattr(cached, "kind", None) == cfg.tokenizer:
                return cached
        except (TokenizerError, OSError):
            pass  # a corrupt, unreadable or foreign cache entry: retrain and overwrite
    tokenizer = train_tokenizer(cfg.tokenizer, [corpus.text], cfg.bpe_vocab_size)
    try:
        atomic_write_text(file, tokenizer.to_json())
    except OSError as e:
        _warn_no_cache(file, e)
    return tokenizer


def prepare_data(
    cfg: DataConfig,
    *,
    tokenizer: Tokenizer | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> TokenDataset:
    """Read the corpus, train a tokenizer unless one is given, tokenise once (cached by
    corpus content and tokenizer JSON), and split: the last ``cfg.val_fraction`` of the
    token stream is validation."""
    corpus = _Corpus(load_sources(cfg.path), cfg.errors)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if tokenizer is None:
        tokenizer = _cached_tokenizer(cfg, corpus, cache)

    tokenizer_digest = hashlib.sha256(tokenizer.to_json().encode("utf-8")).hexdigest()
    key = _digest(_CACHE_VERSION, corpus.digest, cfg.errors, tokenizer_digest)
    tokens_file = cache / f"tokens-{tokenizer.kind}-{key}.npy"
    meta_file = tokens_file.with_suffix(".json")
    dtype = token_dtype(tokenizer.vocab_size)

    tokens = _load_cached_tokens(tokens_file, dtype)
    n_chars: int | None = None
    doc_starts: np.ndarray | None = None
    if tokens is not None:
        try:
            meta = json.loads(meta_file.read_text(encoding="utf-8"))
            n_chars = meta["n_chars"]
            doc_starts = np.asarray(meta["doc_starts"], dtype=np.int64)
            # a stream whose length is not the one written (a garbled .npy header reads
            # as a shorter array) or whose document starts lie outside it is not used
            if (
                meta["n_tokens"] != len(tokens)
                or doc_starts.ndim != 1
                or (doc_starts.size and (doc_starts.min() < 0 or doc_starts.max() > len(tokens)))
                or np.any(np.diff(doc_starts) < 0)
            ):
                raise ValueError("the cached stream does not match its meta file")
        except (OSError, ValueError, KeyError, TypeError):
            tokens = None  # a stream cached without its document starts: encode again
    from_cache = tokens is not None
    if tokens is None:
        try:
            ids = _encode_corpus(tokenizer, corpus.text)
        except TokenizerError as e:
            raise DataError(f"the corpus cannot be encoded with this tokenizer: {e}") from None
        tokens = ids.astype(dtype)
        n_chars = len(corpus.text)
        doc_starts = document_starts(tokenizer, ids, corpus.texts)
        try:
            # The meta file first: a token file present means its meta file was written.
            meta = {
                "sources": [s.name for s in corpus.sources],
                "n_chars": n_chars,
                "n_tokens": len(tokens),
                "doc_starts": doc_starts.tolist(),
            }
            atomic_write_text(meta_file, json.dumps(meta, indent=1) + "\n")
            _save_array_atomic(tokens_file, tokens)
        except OSError as e:
            _warn_no_cache(tokens_file, e)

    # Deterministic split: the validation set is the tail of the stream.
    n_val = int(round(len(tokens) * cfg.val_fraction))
    n_train = len(tokens) - n_val
    return TokenDataset(
        tokenizer=tokenizer,
        train=tokens[:n_train],
        val=tokens[n_train:],
        sources=[source.name for source in corpus.sources],
        doc_starts=doc_starts,
        n_chars=n_chars,
        from_cache=from_cache,
        cache_file=tokens_file,
    )
