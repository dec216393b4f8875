"""The training loop: AdamW, warm-up + decay schedule (cosine or WSD), gradient accumulation
and clipping, bf16 autocast, periodic validation, crash-safe checkpoints, exact resume, time
budgets and data-parallel training under torchrun. It knows nothing of the task: the data,
the loss and the metrics come from the run's task (``attnlab.tasks``, ``RunConfig.task``).

Batches. ``train.batch_size`` examples per process per micro-step, so one optimizer step
sees a global batch of ``batch_size * grad_accum * world_size`` examples. Every process
draws the same global example keys (``Task.sample``) from one shared generator, laid out
as ``(grad_accum, world_size, batch_size)``, and takes its own column. Each micro-batch's
mean loss weighs by its share of the step's loss terms (``Task.loss_terms``: masked tokens,
target lengths, tagged tokens; equal shares where every batch holds as many), and the
model's auxiliary loss (a mean per micro-batch; a mixture of experts leaves padding out
of it) by ``1 / grad_accum``. So the step's loss and gradient are those of the mean over
all its targets: a 2-process run with ``batch_size=b`` equals a 1-process run with
``batch_size=2b``, and ``grad_accum=k`` with ``b`` equals ``grad_accum=1`` with ``k*b``
(to float rounding), for every task.

Validation. Periodic evaluations cover a fixed sample of the validation set (for language
modelling a fixed random sample of blocks spread over the split), the same whatever the
number of processes; each process evaluates its slice and the task's totals are summed.
The sample starts at ``train.eval_batches * train.batch_size`` examples and grows (never
shrinks) to the size whose mean loss agrees with the whole set's within 1% (95%
confidence, judged from the spread the task measures), up to the whole set. The best
checkpoint (``best/``) is always chosen on that sample; the run's last evaluation also
covers the whole validation set (logged as ``val_full_*``). ``best/`` holds a checkpoint of
the training stage in progress: resuming into a new one (``AttentionConfig.STAGE_FIELDS``:
DSA's warm-up -> sparse) starts its tracking afresh (the new stage's first evaluation
replaces the old stage's best/), and while a module trains alone (the warm-up, whose
validation loss is the frozen model's) every evaluation replaces it.

Clipping. ``train.grad_clip`` bounds the norm of the gradient of the parameters that learn
from their module's own loss alone (``alone_parameters()``: DSA's indexers, detached
inputs) and, apart, that of the rest of the model, so each part's step is the one it would
take trained alone with its loss; the logged ``grad_norm`` is that of every gradient.

Steps. ``step`` counts completed optimizer steps; the step that is running is
``step + 1``; metrics, checkpoints and errors name that 1-based number.

Stopping. SIGINT/SIGTERM finish the running step, save a checkpoint and return normally
with ``TrainResult.interrupted`` set to "SIGINT" or "SIGTERM" (a second signal aborts
at once with KeyboardInterrupt); ``attnlab train`` then exits with 128 + the signal number
(130, 143). An evaluation due at that step is made when the run resumes. A non-finite
loss or gradient raises TrainingError naming the step, before the optimizer touches the
weights and without saving; so do a non-finite validation loss, and weights that a step
with a finite loss and gradient made non-finite (a huge lr), before they are saved.

Time budget (seconds of the training loop, evaluations and saves included, setup not):
after a few timed steps the schedule's length becomes the number of steps that fit (never
more than ``max_steps``), refitted every ``REFIT_EVERY`` steps and at each evaluation (a
run without evaluations follows the machine's speed too). A fitted schedule warms up for
at most ``WARMUP_FRACTION`` of its length; refits before the decay begins (during the
warm-up, and WSD's stable phase) may lengthen it (the first fit is made on a few steps,
often slower than the rest), later ones only shorten it; no refit lengthens the warm-up
(that would take steps back into it at a lower rate), so the learning rate rises through
the warm-up, and once it falls it never increases again. When the steps turn out faster
than the fit assumed (a machine that was busy at the start), the run goes on at
``min_lr`` after the schedule ends, for the steps that still fit. The run stops when the
time is used (resumed then, with its budget, it takes no further step). The fitted
lengths are saved, and the time the last evaluation took, so a resumed run keeps its
schedule and refits it as the uninterrupted run would. An explicit
``max_steps`` without a ``time_budget`` drops the config's budget: the run takes exactly
those steps.

Every run ends with one line saying why it stopped (``TrainResult.stop_message``, also the
``"stop"`` record of metrics.jsonl): max_steps reached, the fitted schedule completed,
the time budget reached, a signal, or a non-finite loss.

Shapes: b batch per process, t block size.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import shutil
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn
from tqdm.auto import tqdm

from attnlab.allocator import keep_freed_memory
from attnlab.config import LATENT_KINDS, AttentionConfig, ModelConfig, RunConfig
from attnlab.fileio import error_reason
from attnlab.models import build_model
from attnlab.nn.linear import set_layout
from attnlab.tasks import Task, eval_mode, get_task
from attnlab.training.checkpoint import (
    CHECKPOINT_FILES,
    Checkpoint,
    CheckpointError,
    copy_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from attnlab.training.evaluate import autocast_context
from attnlab.training.metrics import (
    METRICS_FILE,
    PLOT_FILE,
    MetricsLogger,
    read_metrics,
    tensorboard_missing,
)
from attnlab.training.optim import (
    build_optimizer,
    decaying,
    load_optimizer_state,
    lr_at,
    muon_parameters,
    set_lr,
)

try:
    import fcntl
except ImportError:  # Windows: runs on one folder are not kept apart
    fcntl = None

BEST_DIR = "best"
LOCK_FILE = ".train.lock"  # locked while a run writes into its folder (_sole_writer)
FIT_SKIP_STEPS = 1  # steps ignored when timing (allocation, warm-up of kernels)
FIT_STEPS = 20  # steps timed before the first fit (fewer: a few slow ones shortened it)
FIT_WINDOW = 50  # refits use the mean time of the last this many steps
REFIT_EVERY = 25  # steps between refits, evaluations or not (each evaluation refits too)
WARMUP_FRACTION = 0.1  # a schedule fitted to a time budget warms up for at most this share
EVAL_REL_TOL = 0.01  # periodic validation samples agree with the whole set within 1%

_clock = time.perf_counter  # every duration the loop measures (tests substitute a fake)


class TrainingError(RuntimeError):
    """Training cannot go on: a non-finite loss, or a run set up inconsistently."""


@dataclass
class TrainResult:
    step: int  # completed optimizer steps
    train_loss: float | None  # loss of the last step
    val_loss: float | None  # the last validation loss
    best_val_loss: float | None
    out_dir: Path
    throughput: float  # training throughput of this call (all processes), in ``unit``/s
    max_steps: int = 0  # the schedule's length (fitted to a time budget if one was given)
    elapsed: float = 0.0  # seconds, including earlier calls of a resumed run
    interrupted: str | None = None  # "SIGINT" / "SIGTERM" when a signal stopped the run
    stop_reason: str = "max_steps"  # "max_steps", "time_budget" or "signal"
    losses: list[float] = field(default_factory=list)  # per-step train loss, this call
    unit: str = "tokens"  # the task's unit of throughput
    val_metrics: dict[str, float] = field(default_factory=dict)  # the last validation's
    val_step: int | None = None  # the step of the last validation
    val_coverage: str = ""  # what the last validation covered, in words
    stop_message: str = ""  # why the run stopped, e.g. "stopped at step 5: max_steps=5 reached"

    @property
    def tokens_per_second(self) -> float:
        """Throughput of a token-based task (language modelling)."""
        if self.unit != "tokens":
            raise AttributeError(f"this task counts {self.unit}; use throughput")
        return self.throughput


# --------------------------------------------------------------------------- processes


@dataclass
class _Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_device(
    name: str, *, cuda_count: int, local_rank: int = 0, local_world_size: int = 1
) -> torch.device:
    """The device of process ``local_rank`` of the ``local_world_size`` on this machine,
    which has ``cuda_count`` GPUs. "auto" is cuda when there is one; "cuda" becomes
    cuda:<local_rank>. An explicit index ("cuda:1") is refused when several processes share
    the machine (they would all train on that one GPU), and so is a GPU the machine lacks."""
    if name == "auto":
        name = "cuda" if cuda_count else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise TrainingError(
            f"train.device={name!r} is not a device; use auto, cpu, cuda or cuda:N"
        ) from None
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise TrainingError(
            f"train.device={name!r} but MPS is not available on this machine; use cpu"
        )
    if device.type not in ("cpu", "cuda", "mps"):
        raise TrainingError(
            f"train.device={name!r}: the {device.type} device is not supported; use auto, "
            "cpu, cuda or cuda:N"
        )
    if device.type == "cuda":
        if not cuda_count:
            raise TrainingError(
                f"train.device={name!r} but CUDA is not available; use train.device=cpu"
            )
        if device.index is None:
            device = torch.device("cuda", local_rank)
        elif local_world_size > 1:
            raise TrainingError(
                f"train.device={name!r} would put all {local_world_size} processes of this "
                "machine on one GPU; use train.device=cuda (process i takes cuda:i) and "
                "choose the GPUs with CUDA_VISIBLE_DEVICES"
            )
        if device.index >= cuda_count:
            gpus = f"this machine has {cuda_count} GPU{'s' if cuda_count > 1 else ''}"
            if local_world_size > 1:
                raise TrainingError(
                    f"process {local_rank} of the {local_world_size} on this machine would "
                    f"train on {device}, but {gpus}; start at most {cuda_count} per machine "
                    f"(torchrun --nproc_per_node={cuda_count}) or set train.device=cpu"
                )
            raise TrainingError(
                f"train.device={name!r} but {gpus} (cuda:0 to cuda:{cuda_count - 1})"
            )
    return device


def _cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_backend(model_cfg: ModelConfig, device: torch.device) -> None:
    """A TrainingError, naming ``model.attention.backend``, when that backend cannot train
    on ``device`` or lacks the ``model.attention.dropout`` asked for (it would otherwise fail
    at the first step)."""
    from attnlab import kernels
    from attnlab.functional.attention import BACKENDS

    name = model_cfg.attention.backend
    reason = BACKENDS[name].unavailable()
    if reason is None and device.type == "cpu":
        if name == "flex":
            reason = "torch's FlexAttention has no backward on CPU"
        elif name == "triton" and not kernels.interpreting():
            reason = "its kernels need CUDA tensors (or TRITON_INTERPRET=1)"
    if reason is not None:
        raise TrainingError(
            f"model.attention.backend={name!r} cannot train on {device.type}: {reason}; "
            "use flash, sdpa or eager"
        )
    att = model_cfg.attention
    # attend() would refuse the dropout at the first step, after the data and an evaluation
    # (MLA's absorbed path drops its weights itself, without a backend)
    absorbed = att.kind in LATENT_KINDS and att.mla_path == "absorbed"
    if att.dropout > 0 and not BACKENDS[name].dropout and not absorbed:
        raise TrainingError(
            f"model.attention.backend={name!r} has no attention dropout, but "
            f"model.attention.dropout={att.dropout}; set it to 0 or use sdpa or eager"
        )


def _resolve_device(name: str, local_rank: int, local_world_size: int) -> torch.device:
    device = resolve_device(
        name,
        cuda_count=_cuda_count(),
        local_rank=local_rank,
        local_world_size=local_world_size,
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def _setup_distributed(device_name: str) -> tuple[_Dist, torch.device]:
    """Join the torchrun process group when WORLD_SIZE > 1 (gloo on CPU, nccl on CUDA)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return _Dist(), _resolve_device(device_name, 0, 1)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    device = _resolve_device(device_name, local_rank, local_world_size)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return _Dist(dist.get_rank(), dist.get_world_size(), local_rank), device


# --------------------------------------------------------------------------- signals


class _StopRequest:
    """SIGINT/SIGTERM set a flag the loop checks after each step; a second one aborts."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        if self.signal_name is not None:
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(signum).name

    def __enter__(self) -> _StopRequest:
        if threading.current_thread() is threading.main_thread():  # signal() needs it
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


# --------------------------------------------------------------------------- console


class _Console:
    """A console stream for progress output that goes quiet once its reader is gone (a
    closed pipe: Ctrl-C on ``attnlab train | tee log`` ends tee too), so that a write
    cannot end the run before it saves. Equal to the stream it wraps, as tqdm compares
    streams to clear its bar before another line."""

    def __init__(self, stream) -> None:
        self.stream, self.gone = stream, False

    def write(self, text: str) -> int:
        self._call(self.stream.write, text)
        return len(text)

    def flush(self) -> None:
        self._call(self.stream.flush)

    def _call(self, method, *args) -> None:
        if not self.gone:
            try:
                method(*args)
            except BrokenPipeError:
                self.gone = True

    def __getattr__(self, name: str):  # fileno, isatty, encoding: tqdm's terminal probes
        return getattr(self.stream, name)

    def __eq__(self, other) -> bool:
        return self.stream == getattr(other, "stream", other)

    def __hash__(self) -> int:
        return hash(self.stream)


# --------------------------------------------------------------------------- one writer


def _launch_rank() -> int:
    """This process's rank before the trainer joins a group: the group's where the caller
    already made one (its ranks need not be in the environment), else torchrun's RANK."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


@contextlib.contextmanager
def _sole_writer(out_dir: Path):
    """Hold a lock on ``out_dir`` while the run writes into it (rank 0 under torchrun): a
    second run started on the same folder stops with an error instead of interleaving its
    checkpoints and metrics with the first's. The process ending, however it ends,
    releases the lock; the folders this made for a run that then wrote nothing (it
    failed before starting) are removed again. File systems that cannot lock run unlocked."""
    if fcntl is None or _launch_rank() != 0:
        yield
        return
    created = [d for d in (out_dir, *out_dir.parents) if not d.exists()]  # deepest first
    out_dir.mkdir(parents=True, exist_ok=True)
    lock = out_dir / LOCK_FILE
    with open(lock, "a+", encoding="utf-8") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            locked = True
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "?"
            raise TrainingError(
                f"{out_dir}: another training run (process {holder}) is writing into this "
                "folder; wait for it to end, or choose another output folder"
            ) from None
        except OSError:  # no locks here (some network file systems)
            locked = False
        if locked:
            f.truncate(0)
            f.write(f"{os.getpid()}\n")
            f.flush()
        try:
            yield
        finally:
            if created and os.listdir(out_dir) == [LOCK_FILE]:
                with contextlib.suppress(OSError):
                    lock.unlink()
                    for folder in created:
                        folder.rmdir()


# --------------------------------------------------------------------------- helpers


def _copy_config(cfg: RunConfig) -> RunConfig:
    return RunConfig.from_dict(cfg.to_dict())


def _differences(mine: dict, theirs: dict, prefix: str) -> list[str]:
    """Dotted names of the fields that differ, with both values."""
    out = []
    for key in sorted(set(mine) | set(theirs)):
        a, b = mine.get(key), theirs.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key} (checkpoint {b!r}, given {a!r})")
    return out


# Model fields a task fills in from its tokenizer and data (Task.configure_model): before
# the task is built, a config may hold them unset.
TASK_FILLED_FIELDS = (
    "vocab_size", "src_vocab_size", "pad_id", "bos_id", "eos_id", "n_labels",
    "position.padding_idx",  # RoBERTa's padding id: the task's [PAD]
)  # fmt: skip


def _check_resume_config(
    cfg: RunConfig, saved: RunConfig, resume: Path, *, configured: bool = False
) -> None:
    """The task, optimizer, model and data of a resumed run must be the checkpoint's.
    Before the task has configured the model, the fields it fills in are left out; once it
    has (``configured``), the whole model is compared again."""
    if cfg.task != saved.task:
        raise TrainingError(
            f"resume: the checkpoint in {resume} was trained on task {saved.task!r}, not "
            f"{cfg.task!r}; resume it with task={saved.task}"
        )
    if cfg.train.optimizer != saved.train.optimizer:  # its state holds another's moments
        raise TrainingError(
            f"resume: the checkpoint in {resume} was trained with train.optimizer="
            f"{saved.train.optimizer}, not {cfg.train.optimizer}; resume it with "
            f"train.optimizer={saved.train.optimizer} (or start a new run from its weights "
            f"with --init-from {resume})"
        )
    for section in ("model",) if configured else ("model", "data"):
        mine, theirs = getattr(cfg, section).to_dict(), getattr(saved, section).to_dict()
        if section == "model" and not configured:
            for name in TASK_FILLED_FIELDS:
                *sections, leaf = name.split(".")
                ours, saved_part = mine, theirs
                for part in sections:
                    ours, saved_part = ours.get(part) or {}, saved_part.get(part) or {}
                if leaf in ours and leaf in saved_part:
                    ours[leaf] = saved_part[leaf]
        if section == "model":
            for name in AttentionConfig.STAGE_FIELDS:  # training stages: same parameters
                if "attention" in theirs and name in theirs["attention"]:
                    theirs = {
                        **theirs,
                        "attention": {**theirs["attention"], name: mine["attention"][name]},
                    }
        if mine != theirs:
            changed = _differences(mine, theirs, f"{section}.")
            raise TrainingError(
                f"resume: the {section} config differs from the checkpoint's in "
                f"{'; '.join(changed)}; drop the flags that change it (or resume with "
                f"the saved config, {resume / 'config.json'})"
            )


def _new_interval() -> dict:
    """A log interval's running sums: step losses, seconds, work, the model's metrics
    (name -> [sum, n], this process's)."""
    return {"losses": [], "time": 0.0, "work": 0.0, "metrics": {}}


TRAIN_BYTES_PER_PARAMETER = 16  # float32 weights 4 + gradients 4 + AdamW's two moments 8
MUON_SAVED_BYTES = 4  # Muon keeps one moment (momentum) for the matrices it trains, not two


def machine_memory(device: torch.device) -> int | None:
    """Bytes of memory of ``device``: the GPU's, or this machine's physical memory."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def check_memory(
    model_cfg, device: torch.device, available: int | None = None, optimizer: str = "adamw"
) -> None:
    """Refuse a run whose weights, gradients and optimizer state alone exceed the memory
    of ``device`` (estimated with attnlab.analysis, before anything is allocated; with
    ``optimizer="muon"`` the matrices Muon trains keep one moment, the rest AdamW's two)."""
    from attnlab.analysis import count_parameters, meta_model

    available = machine_memory(device) if available is None else available
    if available is None:
        return
    n = count_parameters(model_cfg)["total"]
    needed = n * TRAIN_BYTES_PER_PARAMETER
    state = f"AdamW state ({n:,} parameters x {TRAIN_BYTES_PER_PARAMETER} bytes)"
    if optimizer == "muon":
        matrices = sum(p.numel() for p in muon_parameters(meta_model(model_cfg)))
        needed -= matrices * MUON_SAVED_BYTES
        state = (
            f"Muon + AdamW state ({n:,} parameters x {TRAIN_BYTES_PER_PARAMETER} bytes, "
            f"{MUON_SAVED_BYTES} fewer for the {matrices:,} in Muon's matrices)"
        )
    if needed > available:
        raise TrainingError(
            f"training this model needs about {needed / 2**30:.1f} GiB for weights, "
            f"gradients and {state} but "
            f"{device.type} has {available / 2**30:.1f} GiB; choose a smaller "
            "model (e.g. --set model.n_layers=..., model.d_model=...)"
        )


def _same_path(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    return Path(a).resolve() == Path(b).resolve()


def _holds_checkpoint(directory: Path) -> bool:
    return any((directory / name).exists() for name in CHECKPOINT_FILES)


FINETUNE_LR_FACTOR = 0.1  # fine-tuning starts from trained weights: a tenth of the lr
FINETUNE_MAX_STEPS = 200
FINETUNE_WARMUP_STEPS = 10


def finetune_config(base: RunConfig) -> RunConfig:
    """Defaults for fine-tuning a trained model: ``base`` (the checkpoint's config) with
    a tenth of its learning rate, a short warm-up, a few hundred steps and no time budget."""
    cfg = _copy_config(base)
    tc = cfg.train
    tc.lr = tc.lr * FINETUNE_LR_FACTOR
    tc.min_lr = tc.lr * FINETUNE_LR_FACTOR
    tc.max_steps = FINETUNE_MAX_STEPS
    tc.warmup_steps = FINETUNE_WARMUP_STEPS
    tc.time_budget = None
    return cfg


def _load_init(path: str | os.PathLike[str]) -> Checkpoint:
    """The weights, config and tokenizer to fine-tune: an attnlab checkpoint folder or a
    Hugging Face model folder (its tokenizer.json, if any)."""
    path = Path(path)
    if not path.is_dir():
        raise TrainingError(f"init_from: {path} is not a checkpoint folder")
    from attnlab.interop.io import is_hf_folder

    if not is_hf_folder(path):
        ckpt = load_checkpoint(path, device="cpu", inference=False)
        ckpt.model.train()
        return ckpt
    from attnlab.interop import load_hf
    from attnlab.tokenizers import load_tokenizer

    model = load_hf(path)
    tokenizer = None
    if (path / "tokenizer.json").is_file():
        tokenizer = load_tokenizer(path / "tokenizer.json")
    return Checkpoint(
        model=model, config=RunConfig(model=model.cfg), tokenizer=tokenizer, state=None
    )


def _fitting_weights(model: nn.Module, weights: dict[str, Tensor], init_from) -> dict:
    """The checkpoint ``weights`` for ``model``, those of another shape (a classifier for
    another number of labels than the task's) replaced by the model's fresh ones, with a
    warning, as transformers' ``from_pretrained(..., ignore_mismatched_sizes=True)`` does."""
    own = model.state_dict()
    fresh = [k for k, w in weights.items() if k in own and own[k].shape != w.shape]
    if fresh:
        shapes = ", ".join(f"{k} {tuple(weights[k].shape)} -> {tuple(own[k].shape)}" for k in fresh)
        warnings.warn(
            f"init_from: the head of {init_from} has another number of labels than the "
            f"task's; newly initialised: {shapes}",
            stacklevel=3,
        )
    return {**weights, **{k: own[k] for k in fresh}}


def _starting_point(
    cfg: RunConfig | None, resume: Path | None, init_from: str | os.PathLike[str] | None
) -> tuple[RunConfig, Checkpoint | None]:
    """The run's config and the checkpoint it starts from: the one it resumes (``cfg``
    None: its saved config), the one it fine-tunes (``cfg`` None: :func:`finetune_config`;
    the model is the checkpoint's), or none."""
    ckpt = None
    if resume is not None:
        ckpt = load_checkpoint(resume, device="cpu", with_state=True, inference=False)
        if ckpt.state is None:
            raise TrainingError(
                f"resume: {resume} has no trainer state (trainer_state.pt: step, "
                "optimizer and RNG states), so the run cannot continue where it stopped; "
                "its weights serve inference, or start a new run from them (attnlab train "
                f"--init-from {resume})"
            )
        if cfg is None:
            cfg = ckpt.config
        _check_resume_config(cfg, ckpt.config, resume)
        if init_from is not None:
            raise TrainingError("resume and init_from exclude each other")
    elif cfg is None and init_from is None:
        raise TrainingError("train() needs a RunConfig unless it resumes a checkpoint")
    if init_from is not None:
        ckpt = _load_init(init_from)
        cfg = _copy_config(cfg if cfg is not None else finetune_config(ckpt.config))
        cfg.model = ckpt.config.model
    return cfg, ckpt


def _with_overrides(
    cfg: RunConfig, max_steps: int | None, time_budget: float | None, save_every: int | None
) -> RunConfig:
    """A validated copy of ``cfg`` with train()'s own arguments applied."""
    cfg = _copy_config(cfg)
    if max_steps is not None:
        cfg.train.max_steps = max_steps
        if time_budget is None:
            cfg.train.time_budget = None  # an explicit step count wins over the budget
    if time_budget is not None:
        cfg.train.time_budget = time_budget
    if save_every is not None:
        cfg.train.save_every = save_every
    cfg.validate()
    return cfg


def _starting_model(cfg: RunConfig, ckpt: Checkpoint | None, init_from) -> tuple[nn.Module, bool]:
    """The model to train, and whether its config differs from the checkpoint's (a new
    stage, STAGE_FIELDS, or fine-tuning for another number of labels): then it is built
    afresh and given the checkpoint's weights."""
    if ckpt is None:
        return build_model(cfg.model), False
    if cfg.model.to_dict() == ckpt.config.model.to_dict():
        return ckpt.model, False
    model = build_model(cfg.model)
    weights = ckpt.model.state_dict()
    if init_from is not None:
        weights = _fitting_weights(model, weights, init_from)
    model.load_state_dict(weights)
    return model, True


def _parameter_roles(model: nn.Module) -> tuple[bool, list[nn.Parameter], list[list]]:
    """Whether some module trains alone, the parameters that then freeze, and the two
    groups whose gradients are clipped apart.

    A module that trains alone (DSA's warm-up) freezes the rest of the model: its
    alone_parameters() alone keep gradients (eagerly the others get none, but a compiled
    backward gives them zeros, which AdamW's weight decay would apply), and the other
    modules' updates after a step (MoE routers' balancing bias) hold still.

    Parameters that learn from their module's own loss alone (DSA's indexers, in every
    stage: detached inputs) have their gradient clipped on its own, apart from the rest of
    the model's, so each part's update is the one it would get trained alone with its
    loss: one shared norm let the indexer's gradient shrink the main model's update and
    the other way round."""
    alone = [m for m in model.modules() if getattr(m, "trains_alone", False)]
    trained = {id(p) for m in alone for p in m.alone_parameters()}
    frozen = [p for p in model.parameters() if id(p) not in trained] if alone else []
    own = {
        id(p)
        for m in model.modules()
        if hasattr(m, "alone_parameters")
        for p in m.alone_parameters()
    }
    clip_groups = [
        [p for p in model.parameters() if id(p) not in own],
        [p for p in model.parameters() if id(p) in own],
    ]
    return bool(alone), frozen, clip_groups


def _tokenizer_json(tokenizer) -> str | None:
    return None if tokenizer is None else tokenizer.to_json()


def _rng_state(device: torch.device) -> dict[str, Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"].cpu())
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


# --------------------------------------------------------------------------- trainer


@dataclass
class _StepResult:
    loss: float  # mean main loss over the global batch
    grad_norm: float
    count: float  # units of work of the global batch (Task.unit)
    metrics: dict[str, tuple[float, int]]  # this process's model metrics: name -> (sum, n)
    signalled: bool  # some process got SIGINT/SIGTERM
    out_of_time: bool  # some process found the time budget used up


class Trainer:
    """One training run; see :func:`train`."""

    def __init__(
        self,
        cfg: RunConfig | None,
        out_dir: str | os.PathLike[str],
        *,
        resume: str | os.PathLike[str] | None = None,
        max_steps: int | None = None,
        time_budget: float | None = None,
        save_every: int | None = None,
        progress: bool = True,
        dataset=None,
        overwrite: bool = False,
        init_from: str | os.PathLike[str] | None = None,
    ) -> None:
        self.out_dir = Path(out_dir)
        self.progress = progress
        resume = Path(resume) if resume is not None else None
        cfg, ckpt = _starting_point(cfg, resume, init_from)
        same_folder = resume is not None and _same_path(resume, self.out_dir)
        if not overwrite and not same_folder and _holds_checkpoint(self.out_dir):
            hint = "resume from it, choose another output folder, or pass overwrite=True"
            if resume is not None:
                hint = f"the run resumed from {resume} would overwrite it; {hint}"
            raise TrainingError(f"{self.out_dir} already holds a checkpoint; {hint}")
        device = resolve_device(cfg.train.device, cuda_count=_cuda_count())
        check_backend(cfg.model, device)
        check_memory(cfg.model, device, optimizer=cfg.train.optimizer)  # before building
        if cfg.train.tensorboard and (problem := tensorboard_missing()) is not None:
            raise TrainingError(problem)  # before preparing data and building the model
        self.dist, self.device = _setup_distributed(cfg.train.device)
        if self.device.type == "cpu" and cfg.train.keep_freed_memory:
            keep_freed_memory()  # without it each step page-faults its memory back in

        cfg = _with_overrides(cfg, max_steps, time_budget, save_every)
        tc = cfg.train

        self.task = self._build_task(cfg, ckpt, init_from, dataset)
        self.tokenizer = self.task.tokenizer
        cfg.validate()
        if resume is not None:  # the model as the task configured it, as the run saved it
            _check_resume_config(cfg, ckpt.config, resume, configured=True)
        self.cfg, self.tc = cfg, tc

        # Model and optimizer. Same seed on every process; DDP also broadcasts rank 0's.
        torch.manual_seed(tc.seed)
        model, new_model_config = _starting_model(cfg, ckpt, init_from)
        self.model = model.to(self.device).train()
        # Weights are trained row-major (contiguous): fused AdamW copies every non-contiguous
        # parameter, gradient and moment to contiguous scratch and back at each step, and
        # the products run at the same speed in either layout (benchmarks/train_levers.py,
        # input-major variants). Eager decoding prefers input-major weights:
        # ``set_layout(model, "input")`` after training, as loading a checkpoint does.
        set_layout(self.model, "rows")
        self._after_step = [m for m in model.modules() if hasattr(m, "after_optimizer_step")]
        self._alone, self._frozen, self._clip_groups = _parameter_roles(model)
        # A new training stage (resumed with other STAGE_FIELDS) keeps its own best/.
        self._new_stage = new_model_config and resume is not None
        self.optimizer = build_optimizer(self.model, tc, self.device.type)
        # The frozen parameters stop requiring gradients once the optimizer holds them (its
        # groups and state stay those of the other stages, so a checkpoint resumes in
        # either). Under DDP this is needed: its reducer waits for a gradient of every
        # parameter that requires one, and the frozen ones never get one (a crash at the
        # second step, after a first whose gradients were not averaged).
        for p in self._frozen:
            p.requires_grad_(False)
        self.autocast_dtype = torch.bfloat16 if tc.dtype == "bfloat16" else None
        self.train_model: nn.Module = self.model
        if self.dist.enabled:
            self.train_model = nn.parallel.DistributedDataParallel(
                self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None
            )
        if tc.compile:
            self.train_model = torch.compile(self.train_model)

        # Randomness: the shared data stream, and each process's own dropout stream.
        self.data_generator = torch.Generator()
        self.data_generator.manual_seed(tc.seed)
        torch.manual_seed(tc.seed + self.dist.rank)

        # Progress counters (restored below on resume).
        self.step = 0
        self.schedule_steps = tc.max_steps  # the learning-rate schedule's length
        self.run_steps = tc.max_steps  # steps to take: >= schedule_steps (then at min_lr)
        self.budget_fitted = False
        self.fitted_warmup: int | None = None  # a fitted schedule's warm-up: never lengthened
        self.elapsed_before = 0.0
        self.train_time = 0.0  # seconds in optimizer steps (no evaluations, no saves)
        self.interval = _new_interval()  # the log interval in progress
        self.best_val_loss: float | None = None
        self.last_val_loss: float | None = None
        self.last_val_step: int | None = None
        self.eval_batches: int | None = tc.eval_batches  # grows to EVAL_REL_TOL's size
        # Seconds the next evaluation takes, from the last one timed (None: none yet), for
        # the time budget's refits; saved, so a resumed run does not fall back to a guess.
        self.eval_time: float | None = None
        self.val_coverage = ""
        self.stop_message = ""
        self.last_train_loss: float | None = None
        self.last_val_metrics: dict[str, float] = {}
        history: list[dict] = []
        if ckpt is not None and resume is not None:
            self._restore(ckpt.state)
            if self._new_stage:  # best/ counts the checkpoints of the stage it trains
                self.best_val_loss = None
            # The records up to the checkpoint's step: those logged after it was saved go,
            # with an evaluation of its step it does not hold (its save failed or was
            # killed), which this run makes again.
            history = [
                r
                for r in read_metrics(resume / METRICS_FILE)
                if r.get("step", 0) < self.step
                or (
                    r.get("step", 0) == self.step
                    and (r.get("kind") != "val" or self.last_val_step == self.step)
                )
            ]
            self._restore_last_validation(history)
        self.logger = (
            MetricsLogger(self.out_dir, tensorboard=tc.tensorboard, history=history)
            if self.dist.is_main
            else None
        )
        self.resumed = resume is not None
        self.checkpoint_saved = same_folder  # out_dir holds a checkpoint of this run
        stale = self.out_dir / BEST_DIR  # an overwritten run's best checkpoint
        sources = [p for p in (resume, init_from) if p is not None]
        if (
            overwrite
            and not same_folder
            and self.dist.is_main
            and _holds_checkpoint(stale)
            and not any(_same_path(p, stale) for p in sources)
        ):
            # else it would pass for this run's until an improvement; a link to a folder
            # elsewhere is dropped, not the checkpoint it points to
            if stale.is_symlink():
                stale.unlink()
            else:
                shutil.rmtree(stale)
        if resume is not None and not same_folder and self.dist.is_main:
            self._carry_best(resume)

    def _carry_best(self, resume: Path) -> None:
        """A run resumed into another folder takes its best checkpoint along, the one
        ``best_val_loss`` describes: ``best/`` of the resumed folder, or the resumed
        checkpoint itself where its own evaluation is the best (resumed from a ``best/``).
        Without it the new folder had no best/ until an evaluation beat a loss it did not
        hold, and none at all if none did. A new stage starts its own (best_val_loss None)."""
        target = self.out_dir / BEST_DIR
        if self.best_val_loss is None or target.exists():
            return
        if _holds_checkpoint(resume / BEST_DIR):
            try:
                copy_checkpoint(resume / BEST_DIR, target)
                return
            except CheckpointError as e:  # a damaged best/ does not stop the resume (in
                # place it would not either): the new folder starts without it
                warnings.warn(f"{e}; {target} is not copied from it", stacklevel=2)
        if self.last_val_step == self.step and self.last_val_loss == self.best_val_loss:
            copy_checkpoint(resume, target)

    def _build_task(self, cfg: RunConfig, ckpt: Checkpoint | None, init_from, dataset) -> Task:
        """The run's task and its data, built on rank 0 first (so a tokenizer or data cache
        it writes is reused, not raced), which then sizes ``cfg.model`` (its vocabulary)."""
        task_cls = get_task(cfg.task)
        tokenizer = ckpt.tokenizer if ckpt is not None else None
        if init_from is not None and tokenizer is None and task_cls.uses_tokenizer:
            raise TrainingError(
                f"init_from: {init_from} has no tokenizer.json; the data must be encoded "
                "with the tokenizer the model was trained with"
            )
        task: Task | None = None
        if self.dist.is_main:
            task = task_cls(cfg, tokenizer=tokenizer, data=dataset)
        self._barrier()
        if task is None:
            task = task_cls(cfg, tokenizer=tokenizer, data=dataset)
        if ckpt is not None and _tokenizer_json(task.tokenizer) != _tokenizer_json(ckpt.tokenizer):
            raise TrainingError(
                "resume: the dataset's tokenizer differs from the checkpoint's; build the "
                "dataset with the checkpoint's tokenizer"
            )
        if init_from is not None:
            vocab = cfg.model.vocab_size  # may exceed the tokenizer's (padded embeddings)
            task.configure_model(cfg.model)
            if cfg.model.vocab_size > vocab:
                raise TrainingError(
                    f"init_from: the tokenizer has {cfg.model.vocab_size} tokens but the "
                    f"model only {vocab} embeddings"
                )
            cfg.model.vocab_size = vocab
        else:
            task.configure_model(cfg.model)
        return task

    # ------------------------------------------------------------------ state

    def _restore(self, state: dict) -> None:
        self.step = int(state["step"])
        load_optimizer_state(self.optimizer, state["optimizer"])
        self.data_generator.set_state(state["data_rng"])
        rng, rank = state["rng"], self.dist.rank
        if len(rng) == self.dist.world_size or rank < len(rng):
            _set_rng_state(rng[rank], self.device)
        else:
            # Another number of processes: dropout streams cannot continue exactly. A process
            # the saved run did not have starts a stream of its own (seeded from the saved
            # state): a copy of another process's would drop the same units there.
            g = torch.Generator()
            g.set_state(rng[0]["cpu"].cpu())
            seeds = torch.randint(2**62, (self.dist.world_size,), generator=g)
            torch.manual_seed(int(seeds[rank]))
        self.elapsed_before = float(state["elapsed"])
        self.train_time = float(state.get("train_time", 0.0))
        if "interval" in state:  # the log interval a stop cut short: logged as if it was not
            interval = state["interval"]
            own = state["interval_metrics"]
            metrics = own[self.dist.rank] if len(own) == self.dist.world_size else {}
            self.interval = {**interval, "metrics": metrics}
        self.best_val_loss = state["best_val_loss"]
        self.last_val_loss = state["val_loss"]
        self.last_train_loss = state["train_loss"]
        self.last_val_step = state.get("val_step")
        self.eval_batches = state.get("eval_batches", self.tc.eval_batches)
        self.eval_time = state.get("eval_time")
        self.task.load_state_dict(state.get("task", []))
        # A schedule fitted to the time budget is kept while there is a budget (within a new
        # max_steps); without one (dropped by an explicit max_steps) it is train.max_steps.
        if state["budget_fitted"] and self.tc.time_budget is not None:
            self.schedule_steps = min(int(state["schedule_steps"]), self.tc.max_steps)
            self.run_steps = min(
                int(state.get("run_steps", self.schedule_steps)), self.tc.max_steps
            )
            self.budget_fitted = True
            fitted_warmup = state.get("fitted_warmup")  # None: a checkpoint older than it
            self.fitted_warmup = None if fitted_warmup is None else int(fitted_warmup)

    def _restore_last_validation(self, history: list[dict]) -> None:
        """The metrics and coverage of the resumed run's last evaluation, from its records:
        the whole validation set's where that evaluation made them (a finished run resumed
        reports what it reported when it finished)."""
        records = [r for r in history if r.get("kind") == "val" and r["step"] == self.last_val_step]
        if not records:
            return
        record = records[-1]
        full = {k[len("val_full_") :]: v for k, v in record.items() if k.startswith("val_full_")}
        if full:
            self.last_val_metrics = full
            self.val_coverage = self.task.eval_coverage(self.tc.batch_size, None)
            return
        skip = ("val_coverage",)
        self.last_val_metrics = {
            k[len("val_") :]: v for k, v in record.items() if k.startswith("val_") and k not in skip
        }
        self.val_coverage = record.get("val_coverage", "")

    def _trainer_state(self, elapsed: float) -> dict:
        metrics = {k: [float(total), n] for k, (total, n) in self.interval["metrics"].items()}
        mine = (_rng_state(self.device), self.task.state_dict(), metrics)
        if self.dist.enabled:
            gathered: list = [None] * self.dist.world_size
            dist.all_gather_object(gathered, mine)
        else:
            gathered = [mine]
        return {
            "step": self.step,
            "schedule_steps": self.schedule_steps,
            "run_steps": self.run_steps,
            "budget_fitted": self.budget_fitted,
            "fitted_warmup": self.fitted_warmup,
            "elapsed": elapsed,
            "train_time": self.train_time,
            "optimizer": self.optimizer.state_dict(),
            "data_rng": self.data_generator.get_state(),
            "rng": [rng for rng, _, _ in gathered],  # one {"cpu", "cuda"?} per process
            "task": [task for _, task, _ in gathered],  # Task.state_dict() of each process
            "interval": {k: self.interval[k] for k in ("losses", "time", "work")},
            "interval_metrics": [metrics for _, _, metrics in gathered],  # per process
            "world_size": self.dist.world_size,
            "best_val_loss": self.best_val_loss,
            "val_loss": self.last_val_loss,
            "train_loss": self.last_train_loss,
            "val_step": self.last_val_step,
            "eval_batches": self.eval_batches,
            "eval_time": self.eval_time,
        }

    def _save(self, directory: Path, elapsed: float) -> None:
        # A finite loss and gradient can still step to non-finite weights (a huge lr):
        # never save those over the last good checkpoint.
        named = list(self.model.named_parameters())
        finite = torch.stack([p.isfinite().all() for _, p in named]).tolist() if named else []
        bad = [name for (name, _), ok in zip(named, finite) if not ok]
        if bad:
            raise self._diverged(
                f"weights are not finite ({bad[0]})", self.step, "stopped without saving"
            )
        state = self._trainer_state(elapsed)  # collective under DDP: every process calls it
        if self.dist.is_main:
            save_checkpoint(directory, self.model, self.cfg, self.tokenizer, state)
        self._barrier()
        self.checkpoint_saved |= directory == self.out_dir

    # ------------------------------------------------------------------ collectives

    def _barrier(self) -> None:
        if self.dist.enabled:
            dist.barrier()

    def _all_reduce(self, values: list[float], op=None) -> list[float]:
        if not self.dist.enabled:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
        return t.tolist()

    # ------------------------------------------------------------------ pieces

    def _loss_shares(self, batches: list) -> list[float] | Tensor:
        """Each micro-batch's weight in the step's loss: its loss terms (``Task.loss_terms``)
        over those of the whole step, in every process, times the world size (DDP's mean of
        the processes' gradients divides it back out): the step then follows the mean over
        all its targets, as one batch of them all would. Tasks whose batches hold equal
        numbers of terms: 1 / grad_accum each."""
        terms = [self.task.loss_terms(batch) for batch in batches]
        if any(t is None for t in terms):
            return [1.0 / len(batches)] * len(batches)
        n = torch.stack([torch.as_tensor(t, device=self.device) for t in terms]).float()
        total = n.sum()
        if self.dist.enabled:  # no host read: the counts stay on the device
            dist.all_reduce(total)
        return n * self.dist.world_size / total.clamp(min=1)

    def _train_step(self, stop: _StopRequest, time_up) -> _StepResult:
        """One optimizer step, with whether any process was signalled and whether the
        time budget is used up (``time_up()`` tells the latter locally)."""
        tc, ws = self.tc, self.dist.world_size
        lr = lr_at(self.step, tc, self.schedule_steps, self.warmup_steps)
        set_lr(self.optimizer, lr)
        # Global keys (accum, world, b, ...) from the shared generator; this process's column.
        keys = self.task.sample(tc.grad_accum * ws * tc.batch_size, self.data_generator)
        keys = keys.view(tc.grad_accum, ws, tc.batch_size, *keys.shape[1:])[:, self.dist.rank]
        batches = [self.task.batch(keys[micro], self.device) for micro in range(tc.grad_accum)]
        shares = self._loss_shares(batches)
        loss_sum = torch.zeros((), device=self.device)  # this process's part of the mean
        count = 0
        metrics: dict[str, list] = {}  # name -> [sum, n] over micro-steps
        for micro, batch in enumerate(batches):
            last = micro == tc.grad_accum - 1
            # DDP averages gradients across processes only on the last micro-step.
            sync = (
                self.train_model.no_sync()
                if self.dist.enabled and not last and hasattr(self.train_model, "no_sync")
                else contextlib.nullcontext()
            )
            with sync:
                with autocast_context(self.device, self.autocast_dtype):
                    out = self.task.step(self.train_model, batch)
                objective = out.loss * shares[micro]
                if out.aux_loss is not None:  # a mean per micro-batch (MoE balance)
                    objective = objective + out.aux_loss / tc.grad_accum
                objective.backward()
            loss_sum += out.loss.detach() * shares[micro]
            count += int(out.count)
            extras = dict(out.metrics)
            if out.aux_loss is not None:
                extras["aux_loss"] = out.aux_loss
            for name, value in extras.items():
                value = value.detach().float() if isinstance(value, Tensor) else float(value)
                entry = metrics.setdefault(name, [0.0, 0])
                entry[0] = entry[0] + value
                entry[1] += 1
        for p in self._frozen:
            p.grad = None
        groups = [[p for p in group if p.grad is not None] for group in self._clip_groups]
        groups = [group for group in groups if group] or [[]]
        if tc.grad_clip > 0:  # each group to its own norm (self._clip_groups)
            norms = [torch.nn.utils.clip_grad_norm_(group, tc.grad_clip) for group in groups]
        else:
            norms = [torch.nn.utils.get_total_norm([p.grad for p in group]) for group in groups]
        # the logged norm: of every gradient, before clipping
        grad_norm = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))
        # One collective per step: the mean loss, the work done, whether any must stop.
        loss_total, count_total, signalled, out_of_time = self._all_reduce(
            [
                float(loss_sum),
                float(count),
                float(stop.signal_name is not None),
                float(time_up()),
            ]
        )
        step_loss = loss_total / ws
        grad_norm = float(grad_norm)  # DDP gradients are identical on every process
        if not (math.isfinite(step_loss) and math.isfinite(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)
            what = "loss" if not math.isfinite(step_loss) else "gradient norm"
            value = step_loss if what == "loss" else grad_norm
            raise self._diverged(
                f"{what} is {value}", self.step + 1, "stopped without updating the weights"
            )
        self.optimizer.step()
        for module in self._after_step:  # e.g. MoE routers' load-balancing bias
            module.after_optimizer_step(
                frozen=self._alone and not getattr(module, "trains_alone", False)
            )
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return _StepResult(
            loss=step_loss,
            grad_norm=grad_norm,
            count=count_total,
            metrics={name: (float(total), n) for name, (total, n) in metrics.items()},
            signalled=signalled > 0,
            out_of_time=out_of_time > 0,
        )

    @property
    def warmup_steps(self) -> int:
        """The warm-up length: the config's, bounded by WARMUP_FRACTION of a schedule
        fitted to a time budget. Refits never lengthen it (only the schedule): a longer
        warm-up would lower the learning rate of the steps it takes back into the warm-up,
        which then climbs again (WSD's stable phase, or mid-warm-up)."""
        if self.budget_fitted:
            bound = min(self.tc.warmup_steps, int(WARMUP_FRACTION * self.schedule_steps))
            return bound if self.fitted_warmup is None else min(bound, self.fitted_warmup)
        return self.tc.warmup_steps

    def _evaluate(self, max_batches: int | None) -> tuple[dict[str, float], dict[str, float]]:
        """(metrics, totals) of the task on ``max_batches * batch_size`` validation
        examples (all with None), the same whatever the number of processes; each
        process evaluates its slice and the totals are summed over processes."""
        tc, ws, rank = self.tc, self.dist.world_size, self.dist.rank
        with eval_mode(self.model), autocast_context(self.device, self.autocast_dtype):
            sums = self.task.eval_sums(
                self.model,
                batch_size=tc.batch_size,
                max_batches=max_batches,
                rank=rank,
                world_size=ws,
                device=self.device,
            )
        names = sorted(sums)
        totals = dict(zip(names, self._all_reduce([float(sums[name]) for name in names])))
        return self.task.summarize(totals), totals

    def _eval_share(self, max_batches: int | None) -> float:
        """The size of an evaluation with ``max_batches`` relative to the current sample."""
        tc = self.tc
        mine = self.task.eval_examples(tc.batch_size, max_batches)
        sample = self.task.eval_examples(tc.batch_size, self.eval_batches)
        if mine is None or not sample:
            return 1.0
        return mine / sample

    def _diverged(self, what: str, step: int, done: str) -> TrainingError:
        """Log the stop for a non-finite ``what`` ("loss is nan") at ``step`` and return the
        error to raise; ``done`` says what the run did instead (nothing was saved)."""
        self._log_stop("nan", f"stopped at step {step}: {what}")
        kept = (
            f"the last good checkpoint in {self.out_dir} is kept"
            if self.checkpoint_saved
            else "no checkpoint of this run was saved"  # what out_dir holds is older
        )
        tc = self.tc
        remedies = ["lower train.lr"]  # only what the run does not do already
        remedies += ["enable train.grad_clip"] if not tc.grad_clip > 0 else []
        remedies += ["use train.dtype=float32"] if tc.dtype != "float32" else []
        hint = ", or ".join([", ".join(remedies[:-1]), remedies[-1]] if remedies[1:] else remedies)
        return TrainingError(f"{what} at step {step}; {done}, {kept} ({hint})")

    def _log_stop(self, reason: str, message: str) -> None:
        self.stop_message = message
        if self.dist.is_main and getattr(self, "logger", None) is not None:
            records = self.logger.records
            # A finished run resumed without more steps to take stops where it stopped.
            if records and records[-1] == {
                "kind": "stop", "step": self.step, "reason": reason, "message": message
            }:  # fmt: skip
                return
            self.logger.log("stop", self.step, reason=reason, message=message)

    def _plot(self) -> None:
        """Redraw loss.png. A plot that fails (matplotlib, a file it cannot write) is one
        warning, not the end of the run: metrics.jsonl holds every number it shows."""
        try:
            self.logger.plot()
        except Exception as e:
            warnings.warn(
                f"{self.out_dir / PLOT_FILE}: cannot draw the loss plot ({error_reason(e)}); "
                f"training goes on (the numbers are in {METRICS_FILE})",
                stacklevel=2,
            )

    def _reduce_metrics(self, metrics: dict[str, list]) -> dict[str, float]:
        """Means of the model's metrics ({name: [sum, n]}) over this log interval and
        every process (the names may differ between processes)."""
        if self.dist.enabled:
            gathered: list = [None] * self.dist.world_size
            dist.all_gather_object(gathered, metrics)
        else:
            gathered = [metrics]
        merged: dict[str, list] = {}
        for part in gathered:
            for name, (total, n) in part.items():
                entry = merged.setdefault(name, [0.0, 0])
                entry[0] += total
                entry[1] += n
        return {name: total / n for name, (total, n) in sorted(merged.items()) if n}

    def _fit_budget(self, step_time: float, eval_time: float | None, now: float) -> None:
        """Fit the schedule to the steps that fit in the time left (never past max_steps).
        Called after the first timed steps, and again at each evaluation with the mean
        step time so far (a shared CPU's speed drifts)."""
        tc = self.tc
        if eval_time is None:  # no evaluation timed yet: forward only, ~1/3 of a step
            eval_batches = (self.eval_batches or tc.eval_batches) / self.dist.world_size
            eval_time = step_time * eval_batches / (3 * tc.grad_accum)
        per_step = step_time + (eval_time / tc.eval_every if tc.eval_every else 0.0)
        # Keep room for the final evaluations: the sample and the whole validation set.
        final = eval_time * (1.0 + self._eval_share(None))
        left = tc.time_budget - now - final
        fits = self.step + max(0, int(min(left / per_step, tc.max_steps)))  # 1e308 s: inf
        fits = min(tc.max_steps, max(self.step, fits))
        schedule = fits
        if self.budget_fitted and decaying(self.step, tc, self.schedule_steps, self.warmup_steps):
            # Once the decay has begun refits only shorten: lengthening would raise the
            # learning rate again. Before it (the warm-up; WSD's stable phase) a refit may
            # lengthen a fit made on slower steps.
            schedule = min(fits, self.schedule_steps)
        fits, schedule = self._all_reduce([float(fits), float(schedule)], dist.ReduceOp.MIN)
        warmup = self.warmup_steps if self.budget_fitted else None  # the fitted one so far
        self.schedule_steps = int(schedule)
        self.run_steps = int(fits)  # past the schedule's end: min_lr
        self.budget_fitted = True
        bound = min(tc.warmup_steps, int(WARMUP_FRACTION * self.schedule_steps))
        self.fitted_warmup = bound if warmup is None else min(warmup, bound)

    # ------------------------------------------------------------------ loop

    def _budget_fit_due(self, n_timed: int) -> bool:
        """Whether to fit the schedule to the time budget after this step (``n_timed``: the
        steps this call has timed after its first FIT_SKIP_STEPS): first once FIT_STEPS are
        timed (or the run's steps are all taken before that), then every REFIT_EVERY steps."""
        if self.tc.time_budget is None:
            return False
        if not self.budget_fitted:
            return n_timed >= FIT_STEPS or self.step >= self.run_steps
        return self.step % REFIT_EVERY == 0

    def _validate(
        self, sample: int | None, final: bool
    ) -> tuple[dict[str, float], dict[str, float]]:
        """The validation metrics on ``sample`` batches (timed, for the time budget's fits)
        and, for the run's ``final`` evaluation, those of the whole validation set (the
        sample's own when it is the whole set; {} before the end)."""
        tc = self.tc
        t0 = _clock()
        metrics, sums = self._evaluate(sample)
        if not math.isfinite(metrics["loss"]):  # the weights diverged in the last step
            what = f"validation loss is {metrics['loss']}"
            raise self._diverged(what, self.step, "stopped without saving")
        self.eval_time = _clock() - t0
        self.val_coverage = self.task.eval_coverage(tc.batch_size, sample)
        if self.step > 0 and sample is not None:  # grow the sample to agree within 1%
            self._grow_eval_sample(sample, sums)
        if not final:
            return metrics, {}
        n_sample = self.task.eval_examples(tc.batch_size, sample)
        whole = self.task.eval_examples(tc.batch_size, None)
        if sample is not None and (n_sample is None or n_sample != whole):
            full, _ = self._evaluate(None)  # the whole validation set, reported
            self.val_coverage = self.task.eval_coverage(tc.batch_size, None)
            return metrics, full
        return metrics, metrics  # the sample is the whole set

    def _grow_eval_sample(self, sample: int, sums: dict[str, float]) -> None:
        """Grow the evaluation sample (from ``sample`` batches, whose totals are ``sums``)
        to the size at which its loss agrees within EVAL_REL_TOL, and the expected time of
        the next evaluation with it."""
        tc = self.tc
        needed = self.task.eval_batches_needed(sums, tc.batch_size, EVAL_REL_TOL)
        grown = None if needed is None else max(needed, sample)
        n_old = self.task.eval_examples(tc.batch_size, sample)
        n_new = self.task.eval_examples(tc.batch_size, grown)
        if n_new != n_old:
            self.eval_batches = grown
            self.eval_time *= n_new / n_old if n_old else 1.0  # the next one's

    def _record_validation(
        self,
        metrics: dict[str, float],
        full: dict[str, float],
        sample: int | None,
        report: Callable[[str], None],
    ) -> bool:
        """Keep and log an evaluation's ``metrics`` on ``sample`` batches (and ``full``, the
        whole validation set's, or {}); whether it is a new best/ to save."""
        tc = self.tc
        self.last_val_metrics = full or metrics
        val = metrics["loss"]  # best/ is always chosen on the sample
        self.last_val_loss = val
        self.last_val_step = self.step
        # While a module trains alone (DSA's warm-up) the validation loss is the frozen
        # model's and says nothing of what trains: each evaluation is the best so far.
        improved = self.best_val_loss is None or val < self.best_val_loss or self._alone
        new_best = improved and self.step > 0
        if new_best:
            self.best_val_loss = val
        if self.dist.is_main:
            self.logger.log(
                "val",
                self.step,
                **{f"val_{name}": value for name, value in metrics.items()},
                **{f"val_full_{name}": value for name, value in full.items()},
                val_coverage=self.task.eval_coverage(tc.batch_size, sample),
                best_val_loss=self.best_val_loss,
                train_time=self.train_time,
            )
            self._plot()
            if self.progress:
                text = f"step {self.step}: val loss {val:.4f}"
                if full and full is not metrics:
                    text += f" (whole validation set: {full['loss']:.4f})"
                report(text)
        return new_best

    def _log_interval(
        self, interval: dict, grad_norm: float, elapsed: Callable[[], float], bar: tqdm
    ) -> None:
        """Log the log ``interval`` that ends at this step (mean loss, throughput, the
        model's metrics; a collective) and show it on the progress bar."""
        unit = self.task.unit
        rate = interval["work"] / max(interval["time"], 1e-9)
        lr = self.optimizer.param_groups[0]["lr"]
        mean_loss = sum(interval["losses"]) / len(interval["losses"])
        model_metrics = self._reduce_metrics(interval["metrics"])  # collective
        if self.dist.is_main:
            self.logger.log(
                "train",
                self.step,
                **model_metrics,
                train_loss=mean_loss,
                lr=lr,
                grad_norm=grad_norm,
                **{f"{unit}_per_second": rate},  # tokens_per_second for language modelling
                elapsed=elapsed(),
            )
        bar.set_postfix(
            {
                "loss": f"{mean_loss:.4f}",
                "lr": f"{lr:.2e}",
                f"{unit}/s": f"{rate:.0f}",
            }
        )

    def run(self) -> TrainResult:
        tc, main, unit = self.tc, self.dist.is_main, self.task.unit
        t_start = _clock()
        elapsed = lambda: self.elapsed_before + _clock() - t_start
        time_up = lambda: tc.time_budget is not None and elapsed() >= tc.time_budget
        bar = tqdm(
            total=self.run_steps,
            initial=self.step,
            disable=not (self.progress and main),
            dynamic_ncols=True,
            desc="train",
            file=_Console(sys.stderr),
        )
        console = _Console(sys.stdout)  # the evaluations' lines
        losses: list[float] = []
        step_times: list[float] = []  # this call's step durations, evaluation excluded
        work_done = 0.0  # units of work of this call's steps, all processes
        iv = self.interval  # this log interval so far (a resumed run's carries on)
        # out_dir already holds this step's checkpoint only when resumed in place: a run
        # resumed into another folder with no step to take still saves it there
        last_saved = self.step if self.checkpoint_saved else -1
        stop_reason = "max_steps"
        stop = _StopRequest()

        def fit_budget() -> None:
            if not step_times:  # a resumed run's first evaluation: no step timed yet
                return
            timed = (step_times[FIT_SKIP_STEPS:] or step_times)[-FIT_WINDOW:]  # recent speed
            self._fit_budget(sum(timed) / len(timed), self.eval_time, elapsed())
            bar.total = self.run_steps
            bar.refresh()

        def report(text: str) -> None:  # an evaluation's line, above the progress bar
            bar.write(text, file=console)

        def evaluate_and_save(save: bool, final: bool = False) -> None:
            nonlocal last_saved
            sample = self.eval_batches
            metrics, full = self._validate(sample, final)
            if self.budget_fitted and 0 < self.step < self.run_steps:
                fit_budget()  # refit with more timings (before saving: resume sees it)
            new_best = self._record_validation(metrics, full, sample, report)
            if save:
                if new_best:
                    self._save(self.out_dir / BEST_DIR, elapsed())
                self._save(self.out_dir, elapsed())
                last_saved = self.step

        try:
            # A resumed run whose budget is used up takes no step (it took one more at each
            # resume); the saved elapsed time is the same in every process.
            spent = tc.time_budget is not None and self.elapsed_before >= tc.time_budget
            if spent:
                stop_reason = "time_budget"
            with stop:
                if not self.resumed and tc.eval_every:
                    evaluate_and_save(save=False)  # the untrained baseline on the curve
                elif self.step > 0 and self.last_val_step != self.step:
                    # A signal stopped the run before this step's evaluation: make it now,
                    # as the uninterrupted run did (its records, sample and best/ follow).
                    final = self.step >= self.run_steps or spent
                    if final or (tc.eval_every and self.step % tc.eval_every == 0):
                        evaluate_and_save(save=True, final=final)
                while self.step < self.run_steps and not spent:
                    t0 = _clock()
                    result = self._train_step(stop, time_up)
                    dt = _clock() - t0
                    loss = result.loss
                    losses.append(loss)
                    step_times.append(dt)
                    work_done += result.count
                    self.train_time += dt
                    self.last_train_loss = loss
                    iv["losses"].append(loss)
                    iv["time"] += dt
                    iv["work"] += result.count
                    for name, (total, n) in result.metrics.items():
                        entry = iv["metrics"].setdefault(name, [0.0, 0])
                        entry[0] += total
                        entry[1] += n
                    bar.update(1)

                    if self._budget_fit_due(n_timed=len(step_times) - FIT_SKIP_STEPS):
                        fit_budget()

                    # The run's last steps are logged (a signal's stop carries them on
                    # in the checkpoint instead, logged as if uninterrupted on resume).
                    last = self.step >= self.run_steps
                    last |= result.out_of_time and not result.signalled
                    if self.step % tc.log_every == 0 or last:
                        self._log_interval(iv, result.grad_norm, elapsed, bar)
                        iv = self.interval = _new_interval()

                    if result.signalled:
                        stop_reason = "signal"
                        break
                    if result.out_of_time:
                        stop_reason = "time_budget"
                        evaluate_and_save(save=True, final=True)
                        break
                    if tc.eval_every and self.step % tc.eval_every == 0:
                        evaluate_and_save(save=True, final=self.step >= self.run_steps)
                    elif tc.save_every and self.step % tc.save_every == 0:
                        self._save(self.out_dir, elapsed())
                        last_saved = self.step

                # The last step's evaluation (whole validation set, best/), also where a
                # save_every save came at that step without one.
                if stop_reason == "max_steps" and self.last_val_step != self.step:
                    evaluate_and_save(save=True, final=True)
                elif last_saved != self.step:
                    self._save(self.out_dir, elapsed())
                    last_saved = self.step
            self._log_stop(stop_reason, self._stop_text(stop_reason, stop.signal_name))
        finally:
            bar.close()
            if main:
                if self.logger.records:
                    self._plot()
                self.logger.close()

        total_time = sum(step_times)
        interrupted = stop.signal_name if stop_reason == "signal" else None
        if stop_reason == "signal" and interrupted is None:
            interrupted = "SIGTERM"  # another process was signalled
        return TrainResult(
            step=self.step,
            train_loss=self.last_train_loss,
            val_loss=self.last_val_metrics.get("loss", self.last_val_loss),
            best_val_loss=self.best_val_loss,
            out_dir=self.out_dir,
            throughput=work_done / max(total_time, 1e-9),
            max_steps=self.schedule_steps,
            elapsed=elapsed(),
            interrupted=interrupted,
            stop_reason=stop_reason,
            losses=losses,
            unit=unit,
            val_metrics=dict(self.last_val_metrics),
            val_step=self.last_val_step,
            val_coverage=self.val_coverage,
            stop_message=self.stop_message,
        )

    def release(self) -> None:
        """Drop the DistributedDataParallel wrapper (and a compiled one) now: its reducer
        sits in a reference cycle, and one still alive when the process group is destroyed
        (or the process exits) aborted the process now and then ("terminate called without
        an active exception"), so that torchrun reported a finished run as failed."""
        if self.train_model is not self.model:
            self.train_model = self.model
            gc.collect()

    def _stop_text(self, reason: str, signal_name: str | None) -> str:
        tc, n = self.tc, self.step
        if reason == "signal":
            return f"stopped at step {n}: {signal_name or 'SIGTERM'} received"
        if reason == "time_budget":
            return f"stopped at step {n}: {tc.time_budget:g} s time budget reached"
        held = self.run_steps - self.schedule_steps
        then = f", then {held} steps at min_lr" if self.budget_fitted and held > 0 else ""
        if self.budget_fitted and self.run_steps < tc.max_steps:
            return (
                f"stopped at step {n}: the schedule fitted to the {tc.time_budget:g} s time "
                f"budget ({self.schedule_steps} steps) is complete{then}"
            )
        return f"stopped at step {n}: max_steps={self.run_steps} reached{then}"


def train(
    cfg: RunConfig | None,
    out_dir: str | os.PathLike[str],
    *,
    resume: str | os.PathLike[str] | None = None,
    max_steps: int | None = None,
    time_budget: float | None = None,
    save_every: int | None = None,
    progress: bool = True,
    dataset=None,
    overwrite: bool = False,
    init_from: str | os.PathLike[str] | None = None,
) -> TrainResult:
    """Train ``cfg`` and write checkpoints, metrics.jsonl and loss.png into ``out_dir``.

    ``resume``: a checkpoint directory to continue from (usually ``out_dir``); the steps
    that follow equal those of an uninterrupted run. ``cfg`` may then be None (use the
    saved config); if given, its model and data sections must match the checkpoint's and
    its train section applies. ``max_steps``, ``time_budget`` and ``save_every`` override
    the train config. ``dataset``: a prepared TokenDataset (else built from ``cfg.data``).
    ``overwrite``: allow writing into a folder that holds a checkpoint (a fresh run, or a
    resumed run whose ``out_dir`` is not the folder it resumes from).
    ``init_from``: an attnlab checkpoint or Hugging Face model folder to fine-tune: its
    weights, model config and tokenizer, with a fresh optimizer and schedule; ``cfg``
    (its train and data sections) may be None for :func:`finetune_config`'s defaults.
    An explicit ``max_steps`` without ``time_budget`` drops the config's time budget.
    Under torchrun (WORLD_SIZE > 1) every process calls this; rank 0 writes the files.
    A run on an ``out_dir`` that another run is writing into raises TrainingError.
    The run seeds torch's global generators (its dropout stream); the caller's CPU state,
    and that of the CUDA devices already in use, are restored when it returns or raises.
    """
    group_existed = dist.is_available() and dist.is_initialized()
    trainer = None
    # CUDA devices not yet initialised are left alone: reading their state would start
    # CUDA on every GPU, in every process of a torchrun job.
    cuda = range(torch.cuda.device_count()) if torch.cuda.is_initialized() else ()
    with _sole_writer(Path(out_dir)), torch.random.fork_rng(cuda, device_type="cuda"):
        try:
            trainer = Trainer(
                cfg,
                out_dir,
                resume=resume,
                max_steps=max_steps,
                time_budget=time_budget,
                save_every=save_every,
                progress=progress,
                dataset=dataset,
                overwrite=overwrite,
                init_from=init_from,
            )
            return trainer.run()
        finally:
            if trainer is not None:
                trainer.release()
            if not group_existed and dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()  # we joined torchrun's group: leave it
