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

    python benchmarks/flash_attention.py                 # the README table, ~4 minutes
    python benchmarks/flash_attention.py --lengths 1024 2048 --threads 2
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings

import torch

from _common import machine, setup_threads, table
from attnlab.functional.attention import attend
from attnlab.functional.flex import flex_attention
from attnlab.memory import PeakTensorMemory

B, H, D_H = 1, 4, 64


def inputs(t: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(t)
    return tuple(torch.randn(B, H, t, D_H, generator=g).requires_grad_(True) for _ in range(3))


def fwd_bwd(backend: str, q, k, v) -> None:
    attend(q, k, v, causal=True, backend=backend).sum().backward()
    for x in (q, k, v):
        x.grad = None


def peak_bytes(backend: str, t: int) -> int:
    q, k, v = inputs(t)
    with PeakTensorMemory() as mem:
        fwd_bwd(backend, q, k, v)
    return mem.peak


def seconds(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
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
    args = parser.parse_args()
    setup_threads(args.threads)
    print(f"# {machine()}; batch {B}, {H} heads, head dim {D_H}, causal, float32\n")
    eager_1k = peak_bytes("eager", 1024)
    rows = []
    wall = time.perf_counter()
    for t in args.lengths:
        run_eager = eager_1k * (t / 1024) ** 2 <= args.eager_limit_gb * 2**30
        mem, sec = {}, {}
        for backend in ("eager", "sdpa", "flash"):
            if backend == "eager" and not run_eager:
                continue
            mem[backend] = peak_bytes(backend, t)
            q, k, v = inputs(t)
            sec[backend] = seconds(lambda: fwd_bwd(backend, q, k, v), args.repeats)  # noqa: B023
        flex = "-"
        # Unfused (eager) flex forms the (t, s) scores like eager: same memory limit.
        if not args.no_flex and (run_eager or args.flex_compile):
            q, k, v = (x.detach() for x in inputs(t))
            run = lambda: flex_attention(q, k, v, causal=True, compile=args.flex_compile)  # noqa: B023, E731
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if args.flex_compile:
                    run()  # compile outside the timing
                flex = f"{seconds(run, args.repeats):.2f}"
        mb = lambda b, mem=mem: f"{mem[b] / 2**20:,.0f}" if b in mem else "skipped"  # noqa: E731
        s = lambda b, sec=sec: f"{sec[b]:.2f}" if b in sec else "skipped"  # noqa: E731
        rows.append(
            [
                t,
                mb("eager"),
                mb("sdpa"),
                mb("flash"),
                f"{mem['eager'] / mem['flash']:.1f}x" if "eager" in mem else "-",
                s("eager"),
                s("sdpa"),
                s("flash"),
                f"{sec['flash'] / sec['sdpa']:.2f}x",
                flex,
            ]
        )
        print(f"T={t} done ({time.perf_counter() - wall:.0f} s)", file=sys.stderr)
    headers = [
        "T",
        "eager MiB",
        "sdpa MiB",
        "flash MiB",
        "eager/flash mem",
        "eager s",
        "sdpa s",
        "flash s",
        "flash/sdpa time",
        f"flex fwd s{' (compiled)' if args.flex_compile else ' (eager)'}",
    ]
    print(table(headers, rows))
    print(
        "\nPeak memory: extra tensor bytes during forward + backward (inputs excluded). "
        "Time: forward + backward, seconds; flex: forward only."
    )


if __name__ == "__main__":
    main()
