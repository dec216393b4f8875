"""Text corpora: the embedded default (CPython's Language Reference topics), a text file,
or a folder whose .txt and .md files are read recursively in sorted order (hidden ones
skipped).

A corpus is a list of documents: each topic of the embedded corpus, each file of a folder,
or the one file given. They are joined by ``DOCUMENT_SEPARATOR`` into one token stream
whose document boundaries are kept (``TokenDataset.doc_starts``)."""

from __future__ import annotations

import codecs
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from attnlab.fileio import file_kind

EMBEDDED_NAME = "<embedded: pydoc_data.topics>"
DOCUMENT_SEPARATOR = "\n\n"  # between documents when a corpus becomes one token stream
TEXT_SUFFIXES = (".txt", ".md")  # what a folder corpus reads


class DataError(ValueError):
    """The data cannot be used: missing or empty, undecodable, or too short."""


def default_documents() -> list[tuple[str, str]]:
    """(topic name, text) of each Python Language Reference topic that ships with CPython
    (``pydoc_data``), in sorted topic order: deterministic for a given Python version."""
    from pydoc_data.topics import topics

    return [(name, topics[name].strip("\n")) for name in sorted(topics)]


def default_corpus() -> str:
    """The embedded corpus as one text: the topics of :func:`default_documents`, about
    0.5 MB of English prose and code, joined by ``DOCUMENT_SEPARATOR``."""
    return DOCUMENT_SEPARATOR.join(text for _, text in default_documents())


@dataclass(frozen=True)
class RawSource:
    """One document before decoding: a display name, a stable key and its bytes."""

    name: str  # shown to users (the file path)
    key: str  # what identifies it in the cache: the path relative to the corpus root
    data: bytes


def load_sources(path: str | os.PathLike[str] | None) -> list[RawSource]:
    """Read the raw bytes of every document of a corpus (see ``read_corpus``)."""
    if path is None:  # one document per topic
        return [
            RawSource(f"{EMBEDDED_NAME}/{name}", f"{EMBEDDED_NAME}/{name}", text.encode("utf-8"))
            for name, text in default_documents()
        ]
    root = Path(path).expanduser()
    if not root.exists():
        raise DataError(
            f"data.path: {root} does not exist; give a text file or a folder of .txt / .md files "
            "(or leave data.path unset for the embedded corpus)"
        )
    if root.is_file():
        data = root.read_bytes()
        if _is_blank(data):
            raise DataError(f"data.path: {root} is empty; give a file with text in it")
        return [RawSource(str(root), root.name, data)]
    if not root.is_dir():  # /dev/null, a FIFO: searched as a folder, reported as one
        raise DataError(
            f"data.path: {root} is {file_kind(root)}, not a text file or a folder; give a "
            ".txt / .md file or a folder of them"
        )
    files = sorted(_text_files(root), key=lambda f: f.relative_to(root).as_posix())
    if not files:
        raise DataError(f"data.path: no .txt or .md files under the folder {root}")
    sources = [RawSource(str(f), f.relative_to(root).as_posix(), f.read_bytes()) for f in files]
    # Empty files add nothing to the stream; keep the others.
    sources = [source for source in sources if not _is_blank(source.data)]
    if not sources:
        raise DataError(f"data.path: all {len(files)} .txt / .md files under {root} are empty")
    return sources


def _is_blank(data: bytes) -> bool:
    """Whether a file holds no text: only whitespace, after a byte order mark if any."""
    return not data.removeprefix(codecs.BOM_UTF8).strip()


def decode_source(source: RawSource, errors: str = "strict") -> str:
    """UTF-8 bytes -> text. ``errors="replace"`` substitutes U+FFFD for bad bytes."""
    if errors not in ("strict", "replace"):
        raise DataError(f"data.errors: unknown value {errors!r}; choose strict or replace")
    try:
        text = source.data.decode("utf-8", errors=errors)
    except UnicodeDecodeError as e:
        raise DataError(
            f"{source.name}: byte offset {e.start} is not valid UTF-8 ({e.reason}: "
            f"{source.data[e.start : e.start + 4]!r}); fix the file or set "
            "data.errors=replace to substitute U+FFFD"
        ) from None
    return text.removeprefix("\ufeff")  # a UTF-8 byte order mark is not text


def _text_files(root: Path) -> list[Path]:
    """The .txt / .md files under ``root``, in symlinked folders too (``rglob`` skips
    those), each real folder once (a link back up the tree is no endless loop) and each
    real file once (a link to a file of the corpus would put its text in both splits).
    Hidden files and folders (a name starting with ".": .git, .ipynb_checkpoints' copies
    of the notebooks' texts) are skipped, as Hugging Face ``datasets`` skips them."""
    files, seen = [], set()
    for folder, subfolders, names in os.walk(root, followlinks=True):
        real = os.path.realpath(folder)
        if real in seen:
            subfolders[:] = []
            continue
        seen.add(real)
        subfolders[:] = [name for name in subfolders if not name.startswith(".")]
        names = [name for name in names if not name.startswith(".")]
        # a fixed order (listdir's is the file system's), real folders before links: a
        # folder reached both ways is read under the same names on every machine
        subfolders.sort(key=lambda name: (os.path.islink(os.path.join(folder, name)), name))
        for name in names:
            f = Path(folder) / name
            if f.suffix.lower() in TEXT_SUFFIXES and f.is_file():
                files.append(f)
    # a file reached both directly and through a link keeps its own name; one file is one
    # inode (a hard link is another name of it, with a path of its own)
    real: dict[tuple[int, int], Path] = {}
    for f in sorted(files, key=lambda f: (f.is_symlink(), f.as_posix())):
        status = f.stat()
        real.setdefault((status.st_dev, status.st_ino), f)
    return list(real.values())


def sources_digest(sources: list[RawSource]) -> str:
    """A hash of the corpus content and the order of its documents (the cache key)."""
    digest = hashlib.sha256()
    for source in sources:
        # surrogateescape: a file name that is not UTF-8 holds its bytes as lone surrogates
        for part in (source.key.encode("utf-8", "surrogateescape"), source.data):
            digest.update(len(part).to_bytes(8, "little"))
            digest.update(part)
    return digest.hexdigest()


def read_corpus(
    path: str | os.PathLike[str] | None, *, errors: str = "strict"
) -> list[tuple[str, str]]:
    """(source name, text) per document. ``path``: a text file, or a folder searched
    recursively for ``*.txt`` and ``*.md`` (sorted by relative path, hidden ones skipped);
    ``None``: the embedded corpus."""
    return [(source.name, decode_source(source, errors)) for source in load_sources(path)]
