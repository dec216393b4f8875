"""Atomic file writes: a reader (or a crash) never sees a half-written file.

Write to a temporary file beside the target, then ``os.replace`` it into place: the
rename is atomic on POSIX and Windows when both paths are on one file system, which a
sibling temporary file guarantees.
"""

from __future__ import annotations

import errno
import os
import stat
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_path(target: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield an unused temporary path beside ``target`` (parent folders are created); when
    the block ends without an error, the file written there replaces ``target``, else it is
    removed and ``target`` is left as it was (an OSError naming the temporary file, or no
    file, as a full disk fails a write, names ``target`` instead). A ``target`` that is a
    folder raises IsADirectoryError naming it, one whose folder is a file NotADirectoryError
    naming that file."""
    target = Path(target)
    if target.is_dir():  # before any work; the rename would name the temporary file instead
        raise IsADirectoryError(errno.EISDIR, "is a folder; give a file path", str(target))
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        # a file where one of the folders must be: named, not "File exists" or the path
        # below it "Not a directory"
        file = next((p for p in reversed(target.parents) if p.exists() and not p.is_dir()), None)
        if file is None:
            raise
        what = f"is {file_kind(file)}, not a folder"
        raise NotADirectoryError(errno.ENOTDIR, what, str(file)) from None
    # A unique name the caller creates: the file gets the usual permissions (mkstemp's
    # would be owner-only) and concurrent writers never share a temporary file.
    tmp = target.parent / f".{target.name}.{uuid.uuid4().hex}.tmp"
    try:
        yield tmp
        usual_permissions(tmp)
        with open(tmp, "rb") as written:  # on disk before the rename: after a power loss
            os.fsync(written.fileno())  # the target is the old file or the new, never empty
        os.replace(tmp, target)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and (e.filename is None or str(e.filename) == str(tmp)):
            e.filename = str(target)  # a full disk names the file asked for, not the temporary
        raise


def file_kind(path: str | os.PathLike[str]) -> str:
    """What ``path`` is, in words for an error message: "a folder", "a regular file", "a
    character device" (/dev/null), "a named pipe (FIFO)", "a socket", "a block device", or
    "missing" when nothing is there (links followed)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return "missing"
    kinds = ((stat.S_ISDIR, "a folder"), (stat.S_ISREG, "a regular file"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
             (stat.S_ISSOCK, "a socket"), (stat.S_ISBLK, "a block device"))  # fmt: skip
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def error_reason(e: BaseException) -> str:
    """What went wrong, in a few words: an OSError's strerror ("No space left on device"),
    else the first line of the message, else the exception's type."""
    return getattr(e, "strerror", None) or (str(e).splitlines() or [""])[0] or type(e).__name__


def usual_permissions(path: str | os.PathLike[str]) -> None:
    """Give a file the permissions a plain ``open(path, "w")`` would (0o666 less the
    umask): some writers (safetensors' ``save_file``) make theirs owner-only."""
    os.chmod(path, 0o666 & ~_umask())


def _umask() -> int:
    """The process's umask. Read from /proc where Linux shows it: ``os.umask`` can only
    read it by setting another, and a file another thread creates meanwhile would get
    that one (0: world-writable, whatever the user's umask)."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o077)  # if a thread creates a file meanwhile, it is private
    os.umask(mask)
    return mask


def atomic_write_text(target: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` (UTF-8) to ``target`` atomically."""
    with atomic_path(target) as tmp:
        tmp.write_text(text, encoding="utf-8")
