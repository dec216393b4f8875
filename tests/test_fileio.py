"""Atomic writes: the target is replaced whole on success and left untouched on failure,
with no temporary file left behind either way."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from attnlab.fileio import atomic_path, atomic_write_text, file_kind, usual_permissions


def test_atomic_write_text_replaces_target(tmp_path):
    target = tmp_path / "sub" / "file.txt"  # parent folders are created
    atomic_write_text(target, "first")
    atomic_write_text(target, "second é")
    assert target.read_text(encoding="utf-8") == "second é"
    assert sorted(p.name for p in target.parent.iterdir()) == ["file.txt"]


def test_the_new_file_is_on_disk_before_it_replaces_the_target(tmp_path, monkeypatch):
    """fsync before the rename: without it, a power loss after the rename could leave an
    empty target where the old file was (the rename reached the disk, the data not)."""
    events = []
    fsync, replace = os.fsync, os.replace

    def recording_fsync(fd):
        events.append(("fsync", os.fstat(fd).st_ino))
        fsync(fd)

    def recording_replace(src, dst):
        events.append(("replace", os.stat(src).st_ino))
        replace(src, dst)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "replace", recording_replace)
    atomic_write_text(tmp_path / "file.txt", "text")
    assert [kind for kind, _ in events] == ["fsync", "replace"]
    assert events[0][1] == events[1][1]  # the temporary file, synced, then renamed
    assert (tmp_path / "file.txt").read_text() == "text"


def test_failed_write_keeps_old_file_and_cleans_up(tmp_path):
    target = tmp_path / "file.bin"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_path(target) as tmp:
            assert tmp.parent == tmp_path and tmp != target
            tmp.write_bytes(b"half")
            raise RuntimeError("boom")
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.bin"]


def test_writer_that_creates_nothing_leaves_target_absent(tmp_path):
    target = tmp_path / "never.txt"
    with pytest.raises(OSError):
        with atomic_path(target):
            raise OSError("disk full")
    assert list(tmp_path.iterdir()) == []


def test_folder_target_is_refused_by_its_own_name(tmp_path):
    # The rename would fail naming the temporary file; the error names the folder instead.
    target = tmp_path / "plots"
    target.mkdir()
    with pytest.raises(IsADirectoryError) as error:
        atomic_write_text(target, "text")
    assert error.value.filename == str(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plots"]
    assert list(target.iterdir()) == []


def test_a_file_where_the_targets_folder_must_be_is_named_as_not_a_folder(tmp_path):
    # mkdir's FileExistsError said "corpus.txt: File exists" (attention-map --out
    # corpus.txt/map.png): true, but not what was wrong
    (tmp_path / "corpus.txt").write_text("mine")
    for target in ("corpus.txt/map.png", "corpus.txt/sub/map.png"):
        with pytest.raises(NotADirectoryError) as error:
            atomic_write_text(tmp_path / target, "text")
        assert error.value.filename == str(tmp_path / "corpus.txt")
        assert error.value.strerror == "is a regular file, not a folder"
    assert (tmp_path / "corpus.txt").read_text() == "mine"


def test_file_kind_names_what_is_there(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "file").write_text("x")
    assert file_kind(tmp_path) == "a folder"
    assert file_kind(tmp_path / "file") == "a regular file"
    assert file_kind(tmp_path / "fifo") == "a named pipe (FIFO)"
    assert file_kind(os.devnull) == "a character device"
    assert file_kind(tmp_path / "missing") == "missing"


def test_a_failed_write_names_the_target_not_the_temporary_file(tmp_path):
    # A full disk or a read-only folder fails on the temporary file, which is gone by the
    # time anyone reads the message: the error names the file the caller asked for.
    target = tmp_path / "metrics.jsonl"
    with pytest.raises(OSError) as error:
        with atomic_path(target) as tmp:
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp))
    assert error.value.filename == str(target)
    assert error.value.errno == errno.ENOSPC


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="/dev/full: Linux's full disk")
def test_a_full_disk_names_the_target(tmp_path):
    # A full disk fails the write naming no file: "[Errno 28] No space left on device" was
    # the command's whole error line, whatever the folder.
    target = tmp_path / "metrics.jsonl"
    with pytest.raises(OSError) as error:
        with atomic_path(target), open("/dev/full", "w", encoding="utf-8") as full:
            full.write("{}")  # fails when flushed, as a write to the temporary file would
    assert error.value.filename == str(target)
    assert error.value.errno == errno.ENOSPC
    assert not target.exists()


def test_weights_files_get_the_usual_permissions(tmp_path):
    # safetensors writes its files owner-only (0o600): a checkpoint or an export others on
    # the machine could not read, unlike every other file written (0o666 less the umask).
    import torch

    from attnlab.config import RunConfig
    from attnlab.interop.io import write_folder
    from attnlab.models import build_model
    from attnlab.presets import get_preset
    from attnlab.training.checkpoint import save_checkpoint

    model = build_model(get_preset("gpt2-tiny"))
    save_checkpoint(tmp_path / "ckpt", model, RunConfig(model=get_preset("gpt2-tiny")), None)
    write_folder(tmp_path / "hf", {"w": torch.zeros(2)}, {"model_type": "gpt2"})
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    want = plain.stat().st_mode & 0o777
    for path in (tmp_path / "ckpt" / "model.safetensors", tmp_path / "hf" / "model.safetensors"):
        assert path.stat().st_mode & 0o777 == want, path


@pytest.mark.skipif(
    not os.path.exists("/proc/self/status"), reason="the umask is read from Linux's /proc"
)
def test_usual_permissions_never_unsets_the_umask(tmp_path, monkeypatch):
    # os.umask reads the umask only by setting another: a file another thread created in
    # between got that one (os.umask(0): world-writable under the user's umask 077).
    old = os.umask(0o027)
    try:
        real_umask, set_to = os.umask, []
        monkeypatch.setattr(os, "umask", lambda mask: set_to.append(mask) or real_umask(mask))
        path = tmp_path / "model.safetensors"
        path.write_bytes(b"")
        os.chmod(path, 0o600)
        usual_permissions(path)
        assert path.stat().st_mode & 0o777 == 0o640
        assert set_to == []
    finally:
        os.umask(old)
