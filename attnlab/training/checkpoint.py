"""Checkpoint directories: weights, config, tokenizer and trainer state, written crash-safely.

A checkpoint directory holds

    config.json         the full RunConfig (vocab_size set from the tokenizer)
    tokenizer.json      the tokenizer (Hugging Face format); absent for tasks without one
    model.safetensors   the weights (tied tensors stored once)
    trainer_state.pt    optimizer state, step, RNG states, schedule; tensors and plain data only

beside whatever else a run writes there (metrics.jsonl, loss.png, best/).

Crash safety (a kill at any moment leaves a loadable, self-consistent checkpoint): a save
writes every file into a fresh ``.tmp-*`` folder and fsyncs it, renames that folder to
``.pending`` (the commit point: one atomic rename), then moves the files into place one by
one and removes ``.pending``. A reader overlays ``.pending`` on the directory, so it sees
either the whole old checkpoint (killed before the commit) or the whole new one (killed
after); the next save first finishes an interrupted move. Weights and state carry the same
random ``checkpoint_id``, so mixed files from two saves are caught instead of loaded.

Loading never unpickles arbitrary objects: weights come from safetensors and the trainer
state from ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_model, save_model
from torch import nn

from attnlab.config import ConfigError, RunConfig
from attnlab.models import build_model

CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
WEIGHTS_FILE = "model.safetensors"
STATE_FILE = "trainer_state.pt"
# Moved into place in this order; the state, which says "resumable from step n", goes last.
CHECKPOINT_FILES = (CONFIG_FILE, TOKENIZER_FILE, WEIGHTS_FILE, STATE_FILE)
PENDING_DIR = ".pending"
TMP_PREFIX = ".tmp-"
FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint directory is missing, incomplete or corrupt."""


@dataclass
class Checkpoint:
    model: nn.Module  # in eval mode, on the requested device
    config: RunConfig
    tokenizer: Any  # attnlab.tokenizers.Tokenizer, or None (a task without one: images)
    state: dict | None  # trainer state (with_state=True and one was saved), else None


def unwrap_model(model: nn.Module) -> nn.Module:
    """The plain model inside DistributedDataParallel and/or torch.compile wrappers."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):  # torch.compile's OptimizedModule
            model = model._orig_mod
        else:
            return model


# --------------------------------------------------------------------------- writing


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # platforms that cannot open directories (Windows)
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _finish_pending(directory: Path) -> None:
    """Complete a save that was killed after its commit point; drop uncommitted ones."""
    pending = directory / PENDING_DIR
    if pending.is_dir():
        for name in CHECKPOINT_FILES:
            if (pending / name).exists():
                os.replace(pending / name, directory / name)
            elif name == TOKENIZER_FILE:  # a save without a tokenizer: drop an older one
                (directory / name).unlink(missing_ok=True)
        _fsync_dir(directory)
        shutil.rmtree(pending)
    for tmp in directory.glob(f"{TMP_PREFIX}*"):
        shutil.rmtree(tmp, ignore_errors=True)


def save_checkpoint(
    directory: str | os.PathLike[str],
    model: nn.Module,
    cfg: RunConfig,
    tokenizer: Any,
    trainer_state: dict | None = None,
) -> None:
    """Write a checkpoint into ``directory`` (created if needed), replacing any there.

    ``trainer_state`` must hold only tensors, numbers, strings, bools, None and
    lists/tuples/dicts of them (what ``torch.load(weights_only=True)`` accepts).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _finish_pending(directory)
    checkpoint_id = uuid.uuid4().hex
    tmp = directory / f"{TMP_PREFIX}{checkpoint_id}"
    tmp.mkdir()
    try:
        (tmp / CONFIG_FILE).write_text(cfg.to_json() + "\n")
        if tokenizer is not None:
            tokenizer.save(tmp / TOKENIZER_FILE)
        save_model(
            unwrap_model(model),
            str(tmp / WEIGHTS_FILE),
            metadata={"checkpoint_id": checkpoint_id, "format": "attnlab"},
        )
        state = {
            "format_version": FORMAT_VERSION,
            "checkpoint_id": checkpoint_id,
            "has_state": trainer_state is not None,
            "has_tokenizer": tokenizer is not None,
            "trainer": trainer_state or {},
        }
        torch.save(state, tmp / STATE_FILE)
        for name in CHECKPOINT_FILES:
            if (tmp / name).exists():
                _fsync_file(tmp / name)
        _fsync_dir(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    # Commit point: from here on readers see the new checkpoint.
    os.rename(tmp, directory / PENDING_DIR)
    _fsync_dir(directory)
    _finish_pending(directory)


# --------------------------------------------------------------------------- reading


def checkpoint_files(directory: str | os.PathLike[str]) -> dict[str, Path]:
    """Where each file of the checkpoint in ``directory`` is, overlaying an interrupted
    save's ``.pending`` folder. Raises CheckpointError if the directory or a file is
    missing."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(
            f"{directory}: checkpoint directory not found; pass the output folder of a "
            "training run (attnlab train --out DIR)"
        )
    pending = directory / PENDING_DIR
    files = {}
    for name in CHECKPOINT_FILES:
        path = pending / name if (pending / name).is_file() else directory / name
        if name == TOKENIZER_FILE and not path.is_file():
            continue  # optional: the trainer state says whether the save had one
        if not path.is_file():
            raise CheckpointError(
                f"{directory}: not a complete checkpoint, {name} is missing; it should hold "
                f"{', '.join(CHECKPOINT_FILES)}"
            )
        files[name] = path
    return files


def _read_state(path: Path, device: str | torch.device) -> dict:
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:  # UnpicklingError for disallowed objects, others for corruption
        first_line = (str(e).splitlines() or [type(e).__name__])[0]
        raise CheckpointError(
            f"{path}: cannot read trainer state safely ({first_line}); it must hold only "
            "tensors and plain data"
        ) from None
    if not isinstance(state, dict) or "checkpoint_id" not in state:
        raise CheckpointError(f"{path}: not an attnlab trainer state")
    if state.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: trainer state format {state.get('format_version')!r} is not the "
            f"supported {FORMAT_VERSION}"
        )
    return state


def load_checkpoint(
    directory: str | os.PathLike[str],
    *,
    device: str | torch.device = "cpu",
    with_state: bool = False,
) -> Checkpoint:
    """Load the checkpoint in ``directory``: the model (eval mode, on ``device``), its
    RunConfig and tokenizer, and with ``with_state=True`` the trainer state."""
    from attnlab.tokenizers import TokenizerError, load_tokenizer

    files = checkpoint_files(directory)
    try:
        config = RunConfig.from_json(files[CONFIG_FILE].read_text())
    except (ConfigError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{files[CONFIG_FILE]}: invalid run config ({e})") from None
    state = _read_state(files[STATE_FILE], device)
    tokenizer = None
    if state.get("has_tokenizer", True):
        if TOKENIZER_FILE not in files:
            raise CheckpointError(
                f"{directory}: not a complete checkpoint, {TOKENIZER_FILE} is missing"
            )
        try:
            tokenizer = load_tokenizer(files[TOKENIZER_FILE])
        except TokenizerError as e:
            raise CheckpointError(str(e)) from None
        if tokenizer.vocab_size != config.model.vocab_size:
            raise CheckpointError(
                f"{directory}: tokenizer has {tokenizer.vocab_size} tokens but the model "
                f"config says vocab_size={config.model.vocab_size}; the files come from "
                "different runs"
            )

    weights = files[WEIGHTS_FILE]
    model = build_model(config.model)
    try:
        with safe_open(str(weights), framework="pt") as f:
            weights_id = (f.metadata() or {}).get("checkpoint_id")
        missing, unexpected = load_model(model, str(weights), strict=False)
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        first_line = (str(e).splitlines() or [type(e).__name__])[0]
        raise CheckpointError(f"{weights}: cannot read weights ({first_line})") from None
    if missing or unexpected:
        raise CheckpointError(
            f"{weights}: weights do not match the config (missing {sorted(missing)[:3]}, "
            f"unexpected {sorted(unexpected)[:3]})"
        )
    if weights_id != state["checkpoint_id"]:
        raise CheckpointError(
            f"{directory}: {WEIGHTS_FILE} and {STATE_FILE} come from different saves; "
            "restore both files from the same checkpoint"
        )
    model.to(device).eval()
    trainer = state["trainer"] if with_state and state.get("has_state") else None
    return Checkpoint(model=model, config=config, tokenizer=tokenizer, state=trainer)
