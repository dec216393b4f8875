"""Model FLOP utilisation of training: achieved FLOP/s / the matmul FLOP/s of this machine,
both measured in this run.

Achieved FLOP/s = training FLOPs per token (6 x matmul parameters + 12 x layers x context x
heads x head dim: attnlab.analysis.flops_per_token) x tokens/s of attnlab's trainer step
(``Trainer._train_step``: data, forward, backward, clip, optimizer, and the step's loss and
gradient norm read back). Peak = the best float32 (and, where the run uses it, bfloat16)
square matmul, by MKL or oneDNN, whichever is faster (on an AMD CPU with AVX-512, oneDNN's
float32 product is over twice MKL's).

Each preset runs eager and, with ``--compile``, also under ``train.compile`` (inductor),
whose fused element-wise kernels cut the time outside the matmuls. A shared machine's speed
drifts within minutes, so every run gets its own trainer and they take turns: ``--chunks``
rounds of ``--steps`` steps each, the matmul peak measured just before and after every
chunk, each chunk's MFU taken against the better of those two. Medians are shown, and the
lowest and highest chunk's MFU. The first ``--warmup`` steps of each trainer (and its
compilation) are not timed.

    python benchmarks/mfu.py [--steps 20] [--chunks 5] [--warmup 10] [--compile]
        [--presets nanogpt-cpu demo llama-30m]

On a GPU (``--device cuda``) every run trains in bfloat16 autocast (``train.dtype``) with
batches sized for the GPU (``GPU_EXTRA``), and the peak is the best of ten 8192^3 products
in bfloat16 on that GPU (with ``--dtype float32``: float32 runs against the float32 peak,
both with torch's default of no TF32):

    python benchmarks/mfu.py --device cuda --compile --no-eager --presets demo llama-30m gpt2
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time

import torch

from _common import check_device, machine, setup_threads, sync, table
from attnlab.analysis import flops_per_token
from attnlab.nn.linear import ONEDNN, onednn_mm
from attnlab.presets import get_run_preset
from attnlab.training.trainer import Trainer, _StopRequest

# A larger model than the CPU presets, to show utilisation where matmuls dominate.
EXTRA = {"llama-30m": {"train.batch_size": 4, "train.block_size": 256, "train.lr": 3e-4}}
# On a GPU: batches of 16K-32K tokens (the CPU presets' few thousand leave a GPU idle).
GPU_EXTRA = {
    "demo": {"train.batch_size": 256},
    "llama-30m": {"train.batch_size": 64, "train.block_size": 256, "train.lr": 3e-4},
    "gpt2": {"train.batch_size": 16, "train.block_size": 1024, "train.lr": 3e-4},
}


@functools.cache
def operands(dtype: torch.dtype, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    n = 8192 if torch.device(device).type == "cuda" else 2048
    return tuple(torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))


def matmul_flops(dtype: torch.dtype, repeats: int = 3, device: str = "cpu") -> float:
    """Best FLOP/s of a square matmul, by torch's default kernel (MKL's sgemm in float32;
    cuBLAS on a GPU) and, in float32 on CPU, by oneDNN (attnlab's products of several
    vectors on CPU): the faster is the peak. The operands are made once (fresh 16 MB
    allocations between chunks would disturb the allocator the training steps use)."""
    a, b = operands(dtype, device)
    n = a.shape[0]
    products = [lambda: a @ b]
    if dtype == torch.float32 and ONEDNN and a.device.type == "cpu":
        products.append(lambda: onednn_mm(a, b))  # a @ b^T: the same FLOPs
    if a.device.type == "cuda":
        repeats = max(repeats, 10)
    best = float("inf")
    for product in products:
        product()
        for _ in range(repeats):
            sync(device)
            t = time.perf_counter()
            product()
            sync(device)
            best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per chunk")
    ap.add_argument("--chunks", type=int, default=5, help="timed chunks per run, in turn")
    ap.add_argument("--warmup", type=int, default=10, help="untimed first steps per run")
    ap.add_argument("--presets", nargs="+", default=["nanogpt-cpu", "demo", "llama-30m"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--compile", action="store_true", help="also each preset compiled")
    ap.add_argument("--no-eager", action="store_true", help="only the compiled runs")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                    help="train.dtype (default: the preset's; bfloat16 on a GPU)")  # fmt: skip
    args = ap.parse_args()
    check_device(ap, args.device)
    if args.no_eager and not args.compile:
        ap.error("--no-eager leaves no run without --compile")
    setup_threads(args.threads)
    device = args.device
    gpu = torch.device(device).type == "cuda"
    train_dtype = args.dtype or ("bfloat16" if gpu else None)
    extra = GPU_EXTRA if gpu else EXTRA
    # Several models compile in this one process: without this, the second shape seen would
    # turn dynamo's graphs dynamic (slower) for every preset after the first.
    torch._dynamo.config.automatic_dynamic_shapes = False
    runs = [] if args.no_eager else [(name, False) for name in args.presets]
    runs += [(name, True) for name in args.presets if args.compile]
    total = args.warmup + args.steps * args.chunks
    trainers: dict[str, tuple[Trainer, int, torch.dtype]] = {}  # label -> trainer, FLOPs, dtype
    stop, never = _StopRequest(), lambda: False
    with tempfile.TemporaryDirectory() as tmp:  # the trainers' (unused) run directories
        for name, compiled in runs:
            cfg = get_run_preset(name).override(
                {"train.eval_every": 0, "train.time_budget": None, "train.max_steps": total,
                 "train.compile": compiled, "train.device": device,
                 **({"train.dtype": train_dtype} if train_dtype else {}), **extra.get(name, {})}
            )  # fmt: skip
            label = f"{name} (compiled)" if compiled else name
            tr = Trainer(cfg, f"{tmp}/{len(trainers)}", progress=False)
            block = tr.task.block_size
            per_token = flops_per_token(tr.cfg.model, block)["training"]  # tokenizer's vocab
            dtype = torch.bfloat16 if tr.tc.dtype == "bfloat16" else torch.float32
            trainers[label] = (tr, per_token, dtype)
            t = time.perf_counter()
            for _ in range(args.warmup):
                tr._train_step(stop, never)
            sync(device)
            print(f"{label}: {args.warmup} warm-up steps (compile included) "
                  f"{time.perf_counter() - t:.1f} s", flush=True)  # fmt: skip
        rates: dict[str, list[float]] = {label: [] for label in trainers}  # tokens/s per chunk
        mfus: dict[str, list[float]] = {label: [] for label in trainers}
        peaks: dict[torch.dtype, list[float]] = {}
        for _ in range(args.chunks):
            for label, (tr, per_token, dtype) in trainers.items():
                before = matmul_flops(dtype, device=device)
                t, tokens = time.perf_counter(), 0.0
                for _ in range(args.steps):
                    tokens += tr._train_step(stop, never).count
                sync(device)
                rate = tokens / (time.perf_counter() - t)
                peak = max(before, matmul_flops(dtype, device=device))
                rates[label].append(rate)
                mfus[label].append(per_token * rate / peak)
                peaks.setdefault(dtype, []).append(peak)
    rows = []
    for label, (tr, per_token, dtype) in trainers.items():
        tok_s = statistics.median(rates[label])
        rows.append([label, f"{per_token / 1e6:.2f}M", tr.task.block_size, tr.tc.batch_size,
                     str(dtype).split(".")[-1], f"{tok_s:,.0f}", f"{per_token * tok_s / 1e9:.1f}",
                     f"{statistics.median(peaks[dtype]) / 1e9:.1f}",
                     f"{statistics.median(mfus[label]):.0%}",
                     f"{min(mfus[label]):.0%}-{max(mfus[label]):.0%}"])  # fmt: skip
    print(f"machine: {machine(device)}")
    print(
        f"{args.chunks} chunks of {args.steps} steps per run, the runs in turn; medians; each "
        "chunk's MFU against the matmul peak measured around it; chunks: lowest-highest MFU"
    )
    print(table(["preset", "train FLOPs/token", "block", "batch", "dtype", "tokens/s",
                 "achieved GFLOP/s", "matmul GFLOP/s", "MFU", "chunks"], rows))  # fmt: skip


if __name__ == "__main__":
    main()
