"""Peak memory and time of attention forward + backward against sequence length, for the
eager reference, torch SDPA and attnlab's tiled flash attention (plus FlexAttention's
forward: it has no backward on CPU).

Setting: batch 1, 4 heads, head dim 64, causal, float32, T = 1K .. 16K, one run per
cell (best of --repeats). Every ratio in the table comes from this one run.

Peak memory: ``attnlab.memory.PeakTensorMemory``, a TorchDispatchMode that adds the bytes
of every new tensor storage an operator returns and subtracts them when the storage is
freed, keeping the maximum. It works on CPU (where torch has no max_memory_allocated),
counts autograd's saved tensors and the backward's temporaries, and leaves out the
inputs (the same for everyone). Scratch memory that a fused kernel allocates internally
(SDPA's per-thread tiles) is not an operator output and is not counted; FlexAttention is a
higher-order operator the tracker cannot see into, so its memory is not reported.
Timing runs separately, outside the tracker.

Eager is skipped where its estimate (its 1K peak times (T / 1K)^2) exceeds --eager-limit-gb.

On a GPU (``--device cuda``) the Triton kernels (backend ``triton``, which the ``flash``
backend runs on CUDA) take flash's place in the table, and the timings wait for the GPU
(forward + backward, best of --repeats, after a warm-up run that also autotunes the
kernels and is not counted in the memory either).

    python benchmarks/flash_attention.py                 # docs/benchmarks.md's table, ~4 min
    python benchmarks/flash_attention.py --lengths 1024 2048 --threads 2
    python benchmarks/flash_attention.py --device cuda --dtype bfloat16 --batch 4 --heads 16 \
        --repeats 5 --no-flex
    python benchmarks/flash_attention.py --sinks         # with learned sink logits (GPT-OSS)
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings

import torch

from _common import check_device, machine, setup_threads, sync, table
from attnlab.functional.attention import attend
from attnlab.functional.flex import flex_attention
from attnlab.memory import PeakTensorMemory

SHAPE = {"batch": 1, "heads": 4, "head_dim": 64, "device": "cpu", "dtype": torch.float32}
SINKS: dict[str, torch.Tensor] = {}  # --sinks: learned sink logits (h,), with gradients


def inputs(t: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(t)
    shape = (SHAPE["batch"], SHAPE["heads"], t, SHAPE["head_dim"])
    return tuple(
        torch.randn(shape, generator=g).to(SHAPE["device"], SHAPE["dtype"]).requires_grad_(True)
        for _ in range(3)
    )


def fwd_bwd(backend: str, q, k, v) -> None:
    sinks = SINKS.get("sinks")
    attend(q, k, v, causal=True, backend=backend, sinks=sinks).sum().backward()
    for x in (q, k, v, sinks):
        if x is not None:
            x.grad = None


def peak_bytes(backend: str, t: int) -> int:
    q, k, v = inputs(t)
    with PeakTensorMemory() as mem:
        fwd_bwd(backend, q, k, v)
    return mem.peak


def seconds(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        sync(SHAPE["device"])
        start = time.perf_counter()
        fn()
        sync(SHAPE["device"])
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1)")
    parser.add_argument("--repeats", type=int, default=1, help="timing runs per cell (best)")
    parser.add_argument("--eager-limit-gb", type=float, default=8.0)
    parser.add_argument("--no-flex", action="store_true", help="skip FlexAttention")
    parser.add_argument(
        "--flex-compile",
        action="store_true",
        help="time torch.compile'd flex (fused, ~20 s compile per length)",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda (adds the Triton kernels)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument(
        "--sinks", action="store_true", help="learned sink logits (GPT-OSS) in every backend"
    )
    args = parser.parse_args()
    check_device(parser, args.device)
    setup_threads(args.threads)
    SHAPE.update(batch=args.batch, heads=args.heads, device=args.device,
                 dtype=getattr(torch, args.dtype))  # fmt: skip
    gpu = torch.device(args.device).type == "cuda"
    if args.sinks:
        SINKS["sinks"] = torch.zeros(args.heads, device=args.device, requires_grad=True)
    # On CUDA the flash backend runs the Triton kernels: they take its place in the table.
    tiled = "triton" if gpu else "flash"
    backends = ["eager", "sdpa", tiled]
    print(
        f"# {machine(args.device)}; batch {args.batch}, {args.heads} heads, head dim "
        f"{SHAPE['head_dim']}, causal, {args.dtype}{', sink logits' if args.sinks else ''}\n"
    )
    eager_1k = peak_bytes("eager", 1024)
    rows = []
    wall = time.perf_counter()
    for t in args.lengths:
        run_eager = eager_1k * (t / 1024) ** 2 <= args.eager_limit_gb * 2**30
        mem, sec = {}, {}
        for backend in backends:
            if backend == "eager" and not run_eager:
                continue
            if gpu:  # warm-up, untracked: Triton's autotuner allocates a 256 MiB buffer
                fwd_bwd(backend, *inputs(t))  # (to flush the L2 cache) at a new length
            mem[backend] = peak_bytes(backend, t)
            q, k, v = inputs(t)
            sec[backend] = seconds(lambda: fwd_bwd(backend, q, k, v), args.repeats)  # noqa: B023
        flex = "-"
        # Unfused (eager) flex forms the (t, s) scores like eager: same memory limit.
        if not args.no_flex and (run_eager or args.flex_compile):
            q, k, v = (x.detach() for x in inputs(t))
            sinks = SINKS["sinks"].detach() if "sinks" in SINKS else None
            flex_kw = dict(causal=True, compile=args.flex_compile, sinks=sinks)
            run = lambda: flex_attention(q, k, v, **flex_kw)  # noqa: B023, E731
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                run()  # untimed first call (compiling, or flex's one-time setup), as for the others
                flex = f"{seconds(run, args.repeats):.2f}"
        mb = lambda b, mem=mem: f"{mem[b] / 2**20:,.0f}" if b in mem else "skipped"  # noqa: E731
        n = 4 if gpu else 2
        s = lambda b, sec=sec, n=n: f"{sec[b]:.{n}f}" if b in sec else "skipped"  # noqa: E731
        rows.append(
            [t, *map(mb, backends),
             f"{mem['eager'] / mem[tiled]:.1f}x" if "eager" in mem else "-",
             *map(s, backends), f"{sec[tiled] / sec['sdpa']:.2f}x", flex]
        )  # fmt: skip
        print(f"T={t} done ({time.perf_counter() - wall:.0f} s)", file=sys.stderr)
    headers = [
        "T",
        *(f"{b} MiB" for b in backends),
        f"eager/{tiled} mem",
        *(f"{b} s" for b in backends),
        f"{tiled}/sdpa time",
        f"flex fwd s{' (compiled)' if args.flex_compile else ' (eager)'}",
    ]
    print(table(headers, rows))
    print(
        "\nPeak memory: extra tensor bytes during forward + backward (inputs excluded). "
        "Time: forward + backward, seconds; flex: forward only."
    )


if __name__ == "__main__":
    main()
