"""PyTorch's float32 products with MKL's generic code path (its choice on CPUs that are not
Intel's) and with its instruction-set path (``ATTNLAB_MKL_ANY_CPU=1``:
attnlab/mkl_any_cpu.py).

The setting acts when the process loads PyTorch, so every measurement is its own process
(this script run with ``--child``; the other setting's processes get the library by
``LD_PRELOAD``), and the settings take turns, ``--rounds`` times; medians are shown. Rows:
a square float32 product by ``torch.mm`` (MKL's sgemm) and by oneDNN (attnlab's products
of several vectors, which do not depend on the setting); the attention forward and
backward of the demo preset's shape (``F.scaled_dot_product_attention``, causal, batch 8,
4 heads, 128 positions of 32 dimensions); the training steps of the demo and llama-30m
presets (as benchmarks/mfu.py trains them), eager and compiled, with their MFU against the
faster of the two products measured in the same process.

    python benchmarks/mkl_any_cpu.py [--rounds 3] [--steps 30] [--presets demo llama-30m]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from mfu import EXTRA, matmul_flops

from _common import machine, setup_threads, table
from attnlab.mkl_any_cpu import ENV, library_path, mkl_code_path

N = 2048


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def child(args: argparse.Namespace) -> None:
    """Every row's measurement in this process's setting, printed as one JSON line."""
    from attnlab.analysis import flops_per_token
    from attnlab.nn.linear import onednn_mm
    from attnlab.presets import get_run_preset
    from attnlab.training.trainer import Trainer, _StopRequest

    setup_threads(args.threads)
    torch._dynamo.config.automatic_dynamic_shapes = False
    a, b = torch.randn(N, N), torch.randn(N, N)
    out = {"path": mkl_code_path()}
    out["mkl GFLOP/s"] = 2 * N**3 / median_ms(lambda: a @ b, 5) * 1e-6
    out["onednn GFLOP/s"] = 2 * N**3 / median_ms(lambda: onednn_mm(a, b), 5) * 1e-6
    q, k, v = (torch.randn(8, 4, 128, 32, requires_grad=True) for _ in range(3))
    grad = torch.randn(8, 4, 128, 32)
    attn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)  # noqa: E731
    out["attention ms"] = median_ms(attn, 200)
    peak = matmul_flops(torch.float32)  # the faster of MKL's and oneDNN's, as mfu.py takes it
    stop, never = _StopRequest(), lambda: False
    for preset in args.presets:
        for compiled in (False, True):
            cfg = get_run_preset(preset).override({
                **EXTRA.get(preset, {}), "train.eval_every": 0, "train.time_budget": None,
                "train.max_steps": args.warmup + args.steps + 1, "train.compile": compiled,
            })  # fmt: skip
            with tempfile.TemporaryDirectory() as tmp:
                tr = Trainer(cfg, tmp, progress=False)
                for _ in range(args.warmup):
                    tr._train_step(stop, never)
                ms = median_ms(functools.partial(tr._train_step, stop, never), args.steps)
                block = tr.task.block_size
                per_token = flops_per_token(tr.cfg.model, block)["training"]
                per_step = per_token * block * tr.tc.batch_size * tr.tc.grad_accum
            label = f"{preset} step{' (compiled)' if compiled else ''}"
            out[f"{label} ms"] = ms
            out[f"{label} MFU"] = per_step / (ms * 1e-3) / peak
    print(json.dumps(out))


def measure(args: argparse.Namespace, any_cpu: bool) -> dict:
    cmd = [sys.executable, __file__, "--child", "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--presets", *args.presets]  # fmt: skip
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", ENV)}
    if any_cpu:
        env["LD_PRELOAD"] = str(library_path())
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--presets", nargs="+", default=["demo", "llama-30m"])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    setup_threads(args.threads)
    runs = {False: [], True: []}
    for _ in range(args.rounds):
        for any_cpu in (False, True):
            runs[any_cpu].append(measure(args, any_cpu))
    generic, any_cpu = runs[False], runs[True]
    med = lambda rs, key: statistics.median(r[key] for r in rs)  # noqa: E731
    print(f"machine: {machine()}")
    print(
        f"MKL code path: {generic[0]['path']} by default, {any_cpu[0]['path']} with "
        f"{ENV}=1 (0: generic); medians of {args.rounds} processes per setting, "
        f"in turn; steps: median of {args.steps} after {args.warmup}"
    )
    rows = []
    for key in generic[0]:
        if key == "path" or key.endswith("MFU"):
            continue
        g, a = med(generic, key), med(any_cpu, key)
        higher_is_better = key.endswith("GFLOP/s")
        speed = a / g if higher_is_better else g / a
        mfu = key.removesuffix(" ms") + " MFU"
        cells = ["", ""]
        if mfu in generic[0]:
            cells = [f"{med(generic, mfu):.0%}", f"{med(any_cpu, mfu):.0%}"]
        rows.append([key, f"{g:,.1f}", f"{a:,.1f}", f"{speed:.2f}x", *cells])
    print(table(["measure", "MKL generic", "MKL any CPU", "speed-up", "MFU generic",
                 "MFU any CPU"], rows))  # fmt: skip


if __name__ == "__main__":
    main()
