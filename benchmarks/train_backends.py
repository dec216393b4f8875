"""Training-step time of the ``demo`` model with each attention backend, and with packed
documents on and off.

Each variant is its own copy of the model (same initial weights) with the trainer's AdamW
(``build_optimizer``); one step is what the trainer does: the LM task's batch and loss
step, backward, gradient clipping, optimizer step. The variants take turns, one step
each, on the same blocks of the embedded corpus (so load on a shared machine hits them
alike); reported: the median ms per step, tokens per second, the time relative to
``sdpa``, the median forward time without gradients, and the peak extra tensor memory of
one step (``attnlab.memory.PeakTensorMemory`` on CPU, ``max_memory_allocated`` on CUDA).

Packed variants: ``corpus`` keeps the corpus's own documents apart (the LM task with
``data.options.pack_documents=true``; the embedded corpus's 79 topics average about
5,900 tokens, so most blocks hold one document); ``N-token docs`` gives every block
documents of N tokens (synthetic ids on the same tokens), where flash skips the tiles
between documents. ``flex`` has no backward on CPU: only its forward is timed there.
``triton`` needs a GPU (or the slow interpreter): skipped without CUDA.

    python benchmarks/train_backends.py [--block 1024] [--batch 2] [--repeats 10]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field

import torch

from _common import check_device, machine, setup_threads, table
from attnlab.data import prepare_data
from attnlab.memory import PeakTensorMemory
from attnlab.models import build_model
from attnlab.presets import get_run_preset
from attnlab.tasks.lm import IGNORE_INDEX, LanguageModelling
from attnlab.training.optim import build_optimizer

# name, backend, packing: None, "corpus" or a synthetic document length in tokens
VARIANTS = [
    ("eager", "eager", None),
    ("sdpa", "sdpa", None),
    ("flash", "flash", None),
    ("flex", "flex", None),
    ("triton", "triton", None),
    ("sdpa, packed (corpus)", "sdpa", "corpus"),
    ("flash, packed (corpus)", "flash", "corpus"),
    ("sdpa, packed (256-token docs)", "sdpa", 256),
    ("flash, packed (256-token docs)", "flash", 256),
]


@dataclass
class Run:
    name: str
    backend: str
    packing: str | int | None
    task: LanguageModelling
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None  # None: forward only (flex on CPU)
    step_s: list[float] = field(default_factory=list)
    forward_s: list[float] = field(default_factory=list)
    peak: int | None = None


def make_batch(run: Run, keys: torch.Tensor, device: torch.device) -> tuple:
    batch = run.task.batch(keys, device)
    if not isinstance(run.packing, int):
        return batch
    x, y = batch[:2]
    t = x.shape[1]
    docs = (torch.arange(t, device=device) // run.packing).expand_as(x)  # (b, t)
    first = torch.zeros_like(y, dtype=torch.bool)
    first[:, run.packing - 1 :: run.packing] = True  # targets that start a new document
    return x, y.masked_fill(first, IGNORE_INDEX), docs


def train_step(run: Run, batch: tuple, grad_clip: float) -> None:
    out = run.task.step(run.model, batch)
    out.objective.backward()
    torch.nn.utils.clip_grad_norm_(run.model.parameters(), grad_clip)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn, *args) -> float:
    sync(device)
    t = time.perf_counter()
    fn(*args)
    sync(device)
    return time.perf_counter() - t


def peak_bytes(device: torch.device, fn, *args) -> int:
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn(*args)
        sync(device)
        return torch.cuda.max_memory_allocated(device) - base
    with PeakTensorMemory() as mem:
        fn(*args)
    return mem.peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--block", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    names = [v[0] for v in VARIANTS]
    ap.add_argument("--variants", nargs="+", default=names, choices=names)
    args = ap.parse_args()
    check_device(ap, args.device)
    setup_threads(args.threads)
    device = torch.device(args.device)
    if device.type != "cuda" and set(args.variants) <= {"triton"}:  # else no runs: IndexError
        ap.error("--variants: triton needs a GPU; name a variant that runs on this device")
    base = get_run_preset("demo").override(
        {"model.max_seq_len": args.block, "train.block_size": args.block,
         "train.batch_size": args.batch}
    )  # fmt: skip
    data = prepare_data(base.data)

    runs: list[Run] = []
    skipped: dict[str, str] = {}
    for name, backend, packing in VARIANTS:
        if name not in args.variants:
            continue
        if backend == "triton" and device.type != "cuda":
            skipped[name] = "skipped: no GPU"
            continue
        cfg = base.override(
            {"model.attention.backend": backend,
             "data.options": {"pack_documents": packing == "corpus"}}
        )  # fmt: skip
        task = LanguageModelling(cfg, data=data)
        task.configure_model(cfg.model)
        torch.manual_seed(cfg.train.seed)  # the same initial weights for every variant
        model = build_model(cfg.model).to(device).train()
        backward = not (backend == "flex" and device.type == "cpu")
        optimizer = build_optimizer(model, cfg.train, device.type) if backward else None
        runs.append(Run(name, backend, packing, task, model, optimizer))

    generator = torch.Generator().manual_seed(0)
    clip = base.train.grad_clip
    for repeat in range(args.repeats + 1):  # the first round warms up, untimed
        keys = runs[0].task.sample(args.batch, generator)
        for run in runs:
            batch = make_batch(run, keys, device)
            if run.optimizer is not None:
                s = timed(device, train_step, run, batch, clip)
            with torch.no_grad():
                f = timed(device, run.task.step, run.model, batch)
            if repeat:
                if run.optimizer is not None:
                    run.step_s.append(s)
                run.forward_s.append(f)
    for run in runs:  # memory separately: the tracker slows every operator
        if run.optimizer is not None:
            keys = run.task.sample(args.batch, generator)
            batch = make_batch(run, keys, device)
            run.peak = peak_bytes(device, train_step, run, batch, clip)

    tokens = args.batch * args.block
    ref = next((r for r in runs if r.name == "sdpa"), None)
    ref_step = statistics.median(ref.step_s) if ref is not None else None
    rows = {name: [name, why, "-", "-", "-", "-"] for name, why in skipped.items()}
    for run in runs:
        fwd = statistics.median(run.forward_s) * 1e3
        if run.optimizer is None:
            rows[run.name] = [run.name, "n/a: no CPU backward", "-", "-", f"{fwd:.0f}", "-"]
            continue
        step = statistics.median(run.step_s)
        ratio = f"{step / ref_step:.2f}x" if ref_step else "-"
        rows[run.name] = [run.name, f"{step * 1e3:.0f}", f"{tokens / step:,.0f}", ratio,
                          f"{fwd:.0f}", f"{run.peak / 2**20:,.0f}"]  # fmt: skip
    n_params = sum(p.numel() for p in runs[0].model.parameters())
    print(f"# {machine()}; device {device}")
    print(f"# demo model ({n_params / 1e6:.2f}M parameters), block {args.block}, batch "
          f"{args.batch}, float32, AdamW; {args.repeats} interleaved repeats, medians")  # fmt: skip
    order = [name for name, _, _ in VARIANTS if name in rows]
    print(table(["variant", "ms/step", "tokens/s", "step vs sdpa", "forward ms (no grad)",
                 "peak MiB (step)"], [rows[name] for name in order]))  # fmt: skip
    print("step: forward + backward + clip + AdamW. Peak: extra tensor memory of one step.")


if __name__ == "__main__":
    main()
