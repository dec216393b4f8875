"""Checkpoint directories: weights, config, tokenizer and trainer state, written crash-safely.

A checkpoint directory holds

    config.json         the full RunConfig (vocab_size set from the tokenizer)
    tokenizer.json      the tokenizer (Hugging Face format); absent for models without one
    model.safetensors   the weights (tied tensors stored once; see attnlab.models.loadable)
    trainer_state.pt    optimizer state, step, RNG states, schedule; tensors and plain data only

beside whatever else a run writes there (metrics.jsonl, loss.png, best/). Inference needs
only the first three: a folder without ``trainer_state.pt`` (deleted to save space, or
written weight-only by another tool) loads for ``generate``, ``eval`` and ``export-hf``;
resuming training needs the trainer state.

Crash safety (a kill at any moment leaves a loadable, self-consistent checkpoint): a save
writes every file into a fresh ``.tmp-*`` folder and fsyncs it, renames that folder to
``.pending`` (the commit point: one atomic rename), then moves the files into place one by
one and removes ``.pending``. A reader overlays ``.pending`` on the directory, so it sees
either the whole old checkpoint (killed before the commit) or the whole new one (killed
after); the next save first finishes an interrupted move. Weights and state carry the same
random ``checkpoint_id``, so mixed files from two saves are caught instead of loaded
(where the state exists: without it, there is nothing to compare the weights with). A save
that cannot write its files (a full disk) raises OSError naming the folder, which it leaves
as it was.

The weights' metadata and the trainer state record the checkpoint format
(``FORMAT_VERSION``) and the attnlab version that wrote them: a checkpoint of another format
is refused in one line naming that version (a later format: upgrade attnlab to load it).

A save without a tokenizer removes an older save's ``tokenizer.json`` while it finishes its
move, and readers skip that file while its ``.pending`` folder is there (its weights record
the tokenizer's digest as ``none``), so it is never mistaken for this save's; a
``tokenizer.json`` added to the folder later (as ``import-hf`` suggests for a model imported
without one) is loaded. The trainer state records whether the save had a tokenizer, so a
deleted one is reported missing.

The weights' metadata records the SHA-256 of ``config.json`` and of ``tokenizer.json`` as
written (``config_sha256``, ``tokenizer_sha256``: ``none`` for a save without a tokenizer), so
a file copied in from another run, or edited, is refused by name even where its shapes fit
the weights (another dropout, RoPE theta, norm eps or training setting; a tokenizer of the
same size with other merges). The whole of ``config.json`` counts, training settings too:
resuming and ``eval`` read them, and no documented workflow edits the file (settings change
with ``--set``: ``train --resume``'s training settings, ``eval``/``generate``'s evaluation
settings). A tokenizer.json added to a folder saved without one (what ``import-hf`` suggests
for a model imported without a tokenizer) has no digest to differ from. Checkpoints from
before these keys load unchecked.

Loading never unpickles arbitrary objects: weights come from safetensors and the trainer
state from ``torch.load(weights_only=True)``. It builds the model on the meta device and
allocates each parameter once, in the requested dtype and device (attnlab.weights): about
the memory of the model, not twice it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shlex
import shutil
import uuid
import warnings
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import save_model
from torch import nn

from attnlab import __version__
from attnlab.config import ConfigError, RunConfig
from attnlab.fileio import error_reason, usual_permissions
from attnlab.models import build_model
from attnlab.models.loadable import check_tied
from attnlab.weights import SafetensorsFile, WeightsFileError, materialize, parameters_on_meta

CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
WEIGHTS_FILE = "model.safetensors"
STATE_FILE = "trainer_state.pt"
# Moved into place in this order; the state, which says "resumable from step n", goes last.
CHECKPOINT_FILES = (CONFIG_FILE, TOKENIZER_FILE, WEIGHTS_FILE, STATE_FILE)
# A save without a tokenizer writes none; the trainer state is needed only to resume.
OPTIONAL_FILES = (TOKENIZER_FILE, STATE_FILE)
REQUIRED_FILES = tuple(name for name in CHECKPOINT_FILES if name not in OPTIONAL_FILES)
PENDING_DIR = ".pending"
# Weights-metadata keys: the SHA-256 (hex) of config.json and tokenizer.json as saved (additive
# keys: FORMAT_VERSION unchanged, checkpoints without them load unchecked).
CONFIG_DIGEST_KEY = "config_sha256"
TOKENIZER_DIGEST_KEY = "tokenizer_sha256"
NO_TOKENIZER = "none"  # TOKENIZER_DIGEST_KEY of a save without a tokenizer
TMP_PREFIX = ".tmp-"
FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint directory is missing, incomplete or corrupt."""


@dataclass
class Checkpoint:
    """What :func:`load_checkpoint` returns.

    Attributes:
        model: the model (``DecoderLM`` for language models, else the class of
            ``config.model.arch``), in eval mode, on the requested device and dtype.
        config: the run's :class:`~attnlab.config.RunConfig` (``config.model`` is the
            model's :class:`~attnlab.config.ModelConfig`).
        tokenizer: its :class:`~attnlab.tokenizers.Tokenizer` (``encode``/``decode``), or
            None for a folder without a tokenizer.json.
        state: the trainer state dict (step, optimizer, RNG states) when loaded with
            ``with_state=True`` from a checkpoint that has one, else None.
    """

    model: nn.Module
    config: RunConfig
    tokenizer: Any
    state: dict | None


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


def _sha256(path: Path) -> str:
    """The SHA-256 (hex) of the bytes of the file ``path``."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


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
        with_tokenizer = _pending_save_has_tokenizer(directory)
        for name in CHECKPOINT_FILES:
            if (pending / name).exists():
                os.replace(pending / name, directory / name)
        if not with_tokenizer:  # a save without one: an older save's (readers skip it till now)
            (directory / TOKENIZER_FILE).unlink(missing_ok=True)
        _fsync_dir(directory)
        shutil.rmtree(pending)
    for tmp in directory.glob(f"{TMP_PREFIX}*"):
        shutil.rmtree(tmp, ignore_errors=True)


def _pending_save_has_tokenizer(directory: Path) -> bool:
    """Whether the save in ``directory``'s ``.pending`` folder wrote a tokenizer.json. Its
    weights (in ``.pending``, or already moved) say so: the tokenizer's digest, ``none``
    without one. Not whether ``.pending`` still holds one: the move takes it out before the
    weights and the state, and an older save's tokenizer.json was then taken for stale."""
    pending = directory / PENDING_DIR
    if (pending / TOKENIZER_FILE).is_file():
        return True
    weights = pending / WEIGHTS_FILE
    try:
        recorded = SafetensorsFile(weights if weights.is_file() else directory / WEIGHTS_FILE)
    except (WeightsFileError, OSError):
        return False  # the reader reports the weights
    # weights from before the digests: a .pending folder without one had none
    return recorded.metadata.get(TOKENIZER_DIGEST_KEY, NO_TOKENIZER) != NO_TOKENIZER


def save_checkpoint(
    directory: str | os.PathLike[str],
    model: nn.Module,
    cfg: RunConfig,
    tokenizer: Any,
    trainer_state: dict | None = None,
) -> None:
    """Write a checkpoint into ``directory`` (created if needed), replacing any there.
    ``tokenizer`` may be None (models that read no text): no tokenizer.json is written.

    ``trainer_state`` must hold only tensors, numbers, strings, bools, None and
    lists/tuples/dicts of them (what ``torch.load(weights_only=True)`` accepts).

    Raises :class:`~attnlab.models.loadable.UntiedWeightsError` (before writing anything) for a
    model whose config ties parameters that are not one tensor: the file stores them once.
    """
    check_tied(unwrap_model(model))
    directory = Path(directory)
    created = not directory.exists()
    directory.mkdir(parents=True, exist_ok=True)
    _finish_pending(directory)
    checkpoint_id = uuid.uuid4().hex
    tmp = directory / f"{TMP_PREFIX}{checkpoint_id}"
    tmp.mkdir()
    try:
        (tmp / CONFIG_FILE).write_text(cfg.to_json() + "\n", encoding="utf-8")
        if tokenizer is not None:
            tokenizer.save(tmp / TOKENIZER_FILE)
        # the bytes as written, read back: what a reader will hash
        tokenizer_digest = _sha256(tmp / TOKENIZER_FILE) if tokenizer is not None else NO_TOKENIZER
        save_model(
            unwrap_model(model),
            str(tmp / WEIGHTS_FILE),
            metadata={
                "checkpoint_id": checkpoint_id,
                "format": "attnlab",
                "format_version": str(FORMAT_VERSION),
                "attnlab_version": __version__,
                CONFIG_DIGEST_KEY: _sha256(tmp / CONFIG_FILE),
                TOKENIZER_DIGEST_KEY: tokenizer_digest,
            },
        )
        usual_permissions(tmp / WEIGHTS_FILE)  # safetensors writes it owner-only
        state = {
            "format_version": FORMAT_VERSION,
            "attnlab_version": __version__,
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
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if created:  # a folder of no checkpoint (a first best/) would read as a broken one
            with contextlib.suppress(OSError):
                directory.rmdir()
        # A full disk or a lost write permission: torch.save says so as a RuntimeError,
        # safetensors as a SafetensorError, and an OSError names the deleted temporary file.
        writing = isinstance(e, (OSError, SafetensorError)) or (
            isinstance(e, RuntimeError) and "inline_container" in str(e)  # torch.save's writer
        )
        if writing:
            raise OSError(
                f"{directory}: cannot write the checkpoint ({error_reason(e)}); "
                "its checkpoint files are as they were: free disk space or make the folder "
                "writable"
            ) from e
        raise
    # Commit point: from here on readers see the new checkpoint.
    os.rename(tmp, directory / PENDING_DIR)
    _fsync_dir(directory)
    _finish_pending(directory)


def copy_checkpoint(source: str | os.PathLike[str], target: str | os.PathLike[str]) -> None:
    """Copy the checkpoint in ``source`` (an interrupted save's ``.pending`` files
    included) to the new folder ``target``, all or nothing: into a temporary sibling
    folder, synced, then renamed into place. A copy killed midway leaves that temporary
    folder, which the next save into ``target``'s parent removes."""
    files = checkpoint_files(source)
    target = Path(target)
    if target.exists():
        raise FileExistsError(f"{target}: exists; copy_checkpoint makes a new folder")
    tmp = target.parent / f"{TMP_PREFIX}{uuid.uuid4().hex}"
    tmp.mkdir(parents=True)
    try:
        for name, path in files.items():
            shutil.copy2(path, tmp / name)
            _fsync_file(tmp / name)
        _fsync_dir(tmp)
        os.rename(tmp, target)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise OSError(
                f"{target}: cannot copy the checkpoint in {source} ({error_reason(e)}); "
                "nothing was written: free disk space or make the folder writable"
            ) from e
        raise
    _fsync_dir(target.parent)


# --------------------------------------------------------------------------- reading


def checkpoint_files(directory: str | os.PathLike[str]) -> dict[str, Path]:
    """Where each file of the checkpoint in ``directory`` is, overlaying an interrupted
    save's ``.pending`` folder. Raises CheckpointError if the directory or a required file
    is missing; an optional file (tokenizer.json, trainer_state.pt) that is absent is left
    out."""
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
        if name == TOKENIZER_FILE and pending.is_dir():
            if not _pending_save_has_tokenizer(directory):
                continue  # a committed save without a tokenizer: the folder's is an older save's
        if not path.is_file() and name in OPTIONAL_FILES:
            continue
        if not path.is_file():
            raise CheckpointError(
                f"{directory}: not a complete checkpoint, {name} is missing; it should hold "
                f"{', '.join(REQUIRED_FILES)}"
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
    _check_format(path, state.get("format_version"), state.get("attnlab_version"))
    return state


def _check_format(path: Path, version, written_by) -> None:
    """Refuse a file of another checkpoint format than this attnlab's, saying which attnlab
    wrote it and what to do."""
    if version == FORMAT_VERSION:
        return
    by = f" by attnlab {written_by}" if written_by else ""
    if isinstance(version, int) and version > FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: written{by} in checkpoint format {version}, newer than the format "
            f"{FORMAT_VERSION} that attnlab {__version__} reads; upgrade attnlab to load it"
        )
    raise CheckpointError(
        f"{path}: checkpoint format {version!r}{by} is not the format {FORMAT_VERSION} that "
        f"attnlab {__version__} reads"
    )


def load_checkpoint(
    directory: str | os.PathLike[str],
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    with_state: bool = False,
    inference: bool = True,
) -> Checkpoint:
    """Load the checkpoint in ``directory`` as a :class:`Checkpoint`: ``.model`` (eval
    mode, on ``device``, floating parameters in ``dtype``, default float32), ``.config``
    (its RunConfig), ``.tokenizer`` (None when the folder has no tokenizer.json) and, with
    ``with_state=True``, ``.state``: the trainer state (None when the folder has no
    trainer_state.pt, which only resuming needs). With ``inference`` (the default), an
    attention backend that cannot run on ``device`` (``triton`` without a GPU) becomes
    ``flash`` (the same maths, the kernels' tiled twin) with a warning; the trainer passes
    ``inference=False`` and refuses such a backend itself (``trainer.check_backend``)."""
    from attnlab.tokenizers import TokenizerError, load_tokenizer

    files = checkpoint_files(directory)
    try:
        config_bytes = files[CONFIG_FILE].read_bytes()  # read once: parsed and hashed
        config = RunConfig.for_inference(json.loads(config_bytes.decode("utf-8")))
        try:
            config.validate()  # what the model's own checks passed: the training settings
        except ConfigError as e:
            if not inference:
                raise
            # a run saved by an earlier version, whose training settings it accepted: its
            # model still runs (generate, eval, export), only resuming needs them valid
            warnings.warn(
                f"{files[CONFIG_FILE]}: {e} (ignored to run the model; resuming the run "
                "needs it fixed with --set)",
                stacklevel=2,
            )
    except (ConfigError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{files[CONFIG_FILE]}: invalid run config ({e})") from None
    if inference:
        _runnable_backends(config, device, directory)
    state = _read_state(files[STATE_FILE], device) if STATE_FILE in files else None
    tokenizer = None
    # name -> (path, SHA-256) of each file whose content is used, checked against the weights'
    digests = {CONFIG_FILE: (files[CONFIG_FILE], hashlib.sha256(config_bytes).hexdigest())}
    # The tokenizer is whatever tokenizer.json the folder holds (an older save's is never
    # there: a save without one removes it before its commit is complete, and readers skip
    # it till then), also one added to a save without a tokenizer, as import-hf suggests;
    # the state says whether this save had one (checkpoints older than that flag: True).
    if state is not None and state.get("has_tokenizer", True) and TOKENIZER_FILE not in files:
        raise CheckpointError(
            f"{directory}: not a complete checkpoint, {TOKENIZER_FILE} is missing; the "
            f"trainer state says this save had one"
        )
    if TOKENIZER_FILE in files:
        try:
            tokenizer = load_tokenizer(files[TOKENIZER_FILE])
        except TokenizerError as e:
            raise CheckpointError(str(e)) from None
        digests[TOKENIZER_FILE] = (files[TOKENIZER_FILE], _sha256(files[TOKENIZER_FILE]))
        # The model may have more ids than the tokenizer (Qwen2 / Llama 3 pad their
        # vocabulary; a masked LM adds [MASK]), never fewer; a seq2seq model's tokenizer
        # may serve the source vocabulary only (Marian with separate vocabularies).
        vocab_size = max(config.model.vocab_size, getattr(config.model, "source_vocab_size", 0))
        if tokenizer.vocab_size > vocab_size:
            raise CheckpointError(
                f"{directory}: tokenizer has {tokenizer.vocab_size} tokens but the model config "
                f"says vocab_size={vocab_size}; the files come from different runs"
            )
    model = _load_weights(files[WEIGHTS_FILE], config, state, directory, device, dtype, digests)
    trainer = state["trainer"] if with_state and state and state.get("has_state") else None
    return Checkpoint(model=model.eval(), config=config, tokenizer=tokenizer, state=trainer)


def _backend_problem(name: str, device: str | torch.device) -> str | None:
    """Why attention backend ``name`` cannot run inference on ``device``, or None."""
    from attnlab import kernels
    from attnlab.functional.attention import BACKENDS

    reason = BACKENDS[name].unavailable()
    if reason is None and name == "triton" and torch.device(device).type != "cuda":
        if not kernels.interpreting():
            reason = "its kernels need CUDA tensors (or TRITON_INTERPRET=1)"
    return reason


def _runnable_backends(config: RunConfig, device: str | torch.device, directory) -> None:
    """Every attention config of ``config`` whose backend cannot run on ``device`` falls
    back to ``flash`` (in place), with one warning line."""
    from attnlab.config import AttentionConfig

    problems: dict[str, str] = {}  # backend -> why it cannot run

    def walk(cfg) -> None:
        if isinstance(cfg, AttentionConfig):
            reason = _backend_problem(cfg.backend, device)
            if reason is not None:
                problems.setdefault(cfg.backend, reason)
                cfg.backend = "flash"
            return
        if is_dataclass(cfg):
            for f in fields(cfg):
                walk(getattr(cfg, f.name))

    walk(config)
    # One line per backend, however many attention configs fall back, under the caller's
    # warning filters (a "once" filter of our own here overrode their "error" or "ignore").
    for backend, reason in problems.items():
        warnings.warn(
            f"{directory}: attention backend {backend!r} cannot run on "
            f"{torch.device(device).type} ({reason}); using 'flash' instead",
            stacklevel=3,  # load_checkpoint's caller
        )


def _listed(label: str, names: list[str], describe, limit: int = 4) -> str:
    """``label (n): a, b, c, d (+m more)`` for a non-empty ``names``, else ""."""
    if not names:
        return ""
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return f"{label} ({len(names)}): " + ", ".join(describe(n) for n in names[:limit]) + more


def _load_weights(
    weights: Path,
    config: RunConfig,
    state: dict | None,
    directory: str | os.PathLike[str],
    device: str | torch.device,
    dtype: torch.dtype | None,
    digests: dict[str, tuple[Path, str]],
) -> nn.Module:
    """The model of ``config`` built on the meta device, each parameter then allocated once
    and read from ``weights``. ``digests``: file name -> (path, SHA-256) of the files read
    beside the weights, refused where the weights record another digest."""
    file = _open_weights(weights)
    stored_format = file.metadata.get("format_version")  # absent before it was recorded
    if stored_format is not None:
        _check_format(
            weights,
            int(stored_format) if stored_format.isdigit() else stored_format,
            file.metadata.get("attnlab_version"),
        )
    if state is not None and file.metadata.get("checkpoint_id") != state["checkpoint_id"]:
        raise CheckpointError(
            f"{directory}: {WEIGHTS_FILE} and {STATE_FILE} come from different saves; "
            "restore both files from the same checkpoint"
        )
    with parameters_on_meta():
        model = build_model(config.model)
    # Tied parameters are stored once, under one of their names: any of them will do.
    names: dict[int, list[str]] = {}
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors |= dict(model.named_buffers())
    for name, t in tensors.items():
        names.setdefault(id(t), []).append(name)
    wanted = list(model.state_dict())  # in the model's order, as the messages list them
    stored = set(file.keys())
    missing = [n for n in wanted if not stored & set(names[id(tensors[n])])]
    unexpected = sorted(n for n in stored if n not in tensors)
    wrong = [n for n in wanted if n in stored and file.shape(n) != tensors[n].shape]
    # Tensors the config ties but the file holds apart (an untied model's weights): only one
    # of them would be loaded, the other dropped without a word.
    apart = []
    for group in names.values():
        present = [n for n in group if n in stored and n not in wrong]
        if len(present) > 1:
            first = file.read(present[0])
            apart += [(n, present[0]) for n in present[1:] if not torch.equal(file.read(n), first)]
    if missing or unexpected or wrong or apart:

        def stored_shape(name: str) -> tuple[int, ...]:
            return tuple(file.shape(name))

        def config_shape(name: str) -> tuple[int, ...]:
            return tuple(tensors[name].shape)

        problems = [
            _listed(
                "wrong shape",
                wrong,
                lambda n: f"{n} has shape {stored_shape(n)}, the config implies {config_shape(n)}",
            ),
            _listed("missing", missing, lambda n: f"{n} {config_shape(n)}"),
            _listed("unexpected", unexpected, lambda n: f"{n} {stored_shape(n)}"),
            _listed(
                "tied by the config but stored with different values",
                apart,
                lambda pair: f"{pair[0]} and {pair[1]}",
            ),
        ]
        raise CheckpointError(
            f"{weights}: the weights do not match {CONFIG_FILE} (tensors: "
            + "; ".join(p for p in problems if p)
            + "); the two files come from different models: restore the config.json saved "
            "with these weights"
        )

    # After the shapes (whose message names the tensors), before reading any tensor: a file
    # from another run whose shapes fit the weights.
    for name, (path, digest) in digests.items():
        _check_digest(file.metadata, name, path, digest, directory, type(config.model).EVAL_FIELDS)

    def fill(name: str, dest: torch.Tensor) -> None:
        source = next(n for n in names[id(tensors[name])] if n in stored)
        file.read_into(source, dest)

    try:
        materialize(model, fill, dtype=dtype, device=device)
    except (WeightsFileError, OSError) as e:
        raise CheckpointError(f"{weights}: cannot read weights ({e})") from None
    return model


def _open_weights(weights: Path) -> SafetensorsFile:
    """The weights file's header (names, shapes, metadata), as one CheckpointError if torn."""
    try:
        return SafetensorsFile(weights)
    except (WeightsFileError, OSError) as e:
        first_line = (str(e).splitlines() or [type(e).__name__])[0]
        raise CheckpointError(f"{weights}: cannot read weights ({first_line})") from None


def _check_digest(
    metadata: dict[str, str],
    name: str,
    path: Path,
    digest: str,
    directory: str | os.PathLike[str],
    eval_fields: tuple[str, ...] = (),
) -> None:
    """Refuse ``path`` (checkpoint file ``name``, SHA-256 ``digest``) where the weights'
    ``metadata`` records another digest for it: a file of another run, or one edited since
    the save. Nothing is recorded before the digests were (older checkpoints), nor for a
    tokenizer.json added to a save without one (as import-hf suggests)."""
    if name == CONFIG_FILE:
        recorded = metadata.get(CONFIG_DIGEST_KEY)
        if recorded not in (None, digest):
            raise _config_differs(path, digest, recorded, directory, eval_fields)
        return
    recorded = metadata.get(TOKENIZER_DIGEST_KEY)
    if recorded not in (None, NO_TOKENIZER, digest):
        raise CheckpointError(
            f"{_not_saved(path, name, digest, recorded)}: it would turn text into other token "
            f"ids and ids into other text; restore the {name} saved with these weights"
        )


def _not_saved(path: Path, name: str, digest: str, recorded: str) -> str:
    return (
        f"{path}: not the {name} saved with these weights (its SHA-256 is {digest[:12]}..., "
        f"{WEIGHTS_FILE} records {recorded[:12]}...)"
    )


def _config_differs(
    path: Path,
    digest: str,
    recorded: str,
    directory: str | os.PathLike[str],
    eval_fields: tuple[str, ...],
) -> CheckpointError:
    """The one-line error for a config.json that is not the one saved with the weights: what
    to restore, and the ``--set`` options that change settings without editing it."""
    folder = shlex.quote(str(directory))  # the commands as a shell takes them
    settings = f"`attnlab train --resume {folder} --set train.NAME=VALUE` for training settings"
    if eval_fields:
        fields = ", ".join(f"model.{field}" for field in eval_fields)
        settings += (
            f", `attnlab eval` or `generate --ckpt {folder} --set model.NAME=VALUE` for its "
            f"evaluation settings ({fields})"
        )
    return CheckpointError(
        f"{_not_saved(path, CONFIG_FILE, digest, recorded)}: a copy from another run or an "
        f"edit makes the model compute something else; restore the {CONFIG_FILE} saved with "
        f"these weights, and change settings with --set instead of editing it: {settings}"
    )


def checked_config_file(directory: str | os.PathLike[str]) -> Path:
    """The config.json of the checkpoint in ``directory``, refused (CheckpointError) where
    its SHA-256 is not the one the weights record. Reads only the weights' header: for
    commands that need the config alone (info, train --resume / --init-from)."""
    files = checkpoint_files(directory)
    path = files[CONFIG_FILE]
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    recorded = _open_weights(files[WEIGHTS_FILE]).metadata.get(CONFIG_DIGEST_KEY)
    if recorded in (None, digest):
        return path
    try:  # its evaluation settings, for the message (an unreadable config has none)
        model = RunConfig.for_inference(json.loads(data.decode("utf-8"))).model
        eval_fields = type(model).EVAL_FIELDS
    except ValueError:  # ConfigError, JSONDecodeError, UnicodeDecodeError
        eval_fields = ()
    raise _config_differs(path, digest, recorded, directory, eval_fields)
