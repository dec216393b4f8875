"""One token through every weight matrix of a decoder: the vector-matrix products that bound
decoding speed. Compares nn.Linear's row-major weight, attnlab's input-major weight, and
attnlab's split two-thread product (attnlab.nn.linear), all side by side in one run.

The matrices are those of the ~30M-parameter LLaMA-style model of vs_transformers.py (8
layers of qkv, out, gate_up, down, and the 8192 x 512 output head): 108 MB per pass, far
more than the CPU's caches, as in real decoding.

    python benchmarks/linear_layout.py [--repeats 20] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from _common import copy_bandwidth, machine, setup_threads, table
from attnlab.nn.linear import SPLIT_MIN_NUMEL, input_major, split_vecmat

SHAPES = [(768, 512), (512, 512), (2816, 512), (512, 1408)] * 8 + [(8192, 512)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    setup_threads(args.threads)
    torch.manual_seed(0)
    row_major = [torch.randn(s) for s in SHAPES]
    in_major = [input_major(w) for w in row_major]
    x = {n_in: torch.randn(1, n_in) for _, n_in in SHAPES}
    nbytes = sum(w.nbytes for w in row_major)

    def split(ws):
        return [
            split_vecmat(x[w.shape[1]], w)
            if w.numel() >= SPLIT_MIN_NUMEL
            else F.linear(x[w.shape[1]], w)
            for w in ws
        ]

    variants = {
        "nn.Linear (row-major weight)": lambda: [F.linear(x[w.shape[1]], w) for w in row_major],
        "input-major weight": lambda: [F.linear(x[w.shape[1]], w) for w in in_major],
        "input-major + split product (attnlab)": lambda: split(in_major),
    }
    for w_row, w_in in zip(row_major[:4], in_major[:4]):  # same values, whatever the path
        # N(0, 1) weights give outputs of ~20: float32 summation order differs by ~1e-5
        torch.testing.assert_close(
            split([w_in])[0], F.linear(x[w_row.shape[1]], w_row), rtol=1e-5, atol=1e-4
        )
    best = {}
    for _ in range(args.repeats):  # interleaved, best of repeats
        for name, fn in variants.items():
            t = time.perf_counter()
            fn()
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - t)
    bandwidth = copy_bandwidth()
    print(f"{len(SHAPES)} weight matrices, {nbytes / 1e6:.0f} MB float32, one token")
    print(f"machine: {machine()}; large-copy bandwidth {bandwidth / 1e9:.1f} GB/s")
    base = best["nn.Linear (row-major weight)"]
    rows = [
        [name, f"{t * 1e3:.2f}", f"{nbytes / t / 1e9:.1f}", f"{base / t:.2f}x"]
        for name, t in best.items()
    ]
    print(table(["weights", "ms per token", "GB/s read", "speed-up"], rows))


if __name__ == "__main__":
    main()
