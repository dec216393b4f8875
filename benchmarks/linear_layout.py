"""One token through every weight matrix of a decoder: the vector-matrix products that bound
decoding speed. Compares nn.Linear's row-major weight, attnlab's input-major weight,
attnlab's split two-thread product (attnlab.nn.linear) of input-major and of row-major
weights, and the compiled decode step's products (row-major weights, each product a sum
over the rows that inductor compiles into its own loops), all side by side in one run. A
last row reads the same row-major weights without multiplying (the maximum of every row,
compiled alike): how fast this machine reads them with nothing else to do.

The matrices are those of the ~30M-parameter LLaMA-style model of vs_transformers.py (8
layers of qkv, out, gate_up, down, and the 8192 x 512 output head): 108 MB per pass, far
more than the CPU's caches, as in real decoding.

``--rows N`` multiplies N vectors at once, as a decode step of a batch of N does: there
attnlab's products are oneDNN's (float32 on CPU; the split product is for one vector),
compiled too beyond ``ROWS_MATMUL_MAX`` vectors (up to it, the compiled sums over the rows).

    python benchmarks/linear_layout.py [--rows 1] [--repeats 20] [--threads 2]
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.nn.functional as F

from _common import copy_bandwidth, machine, setup_threads, table
from attnlab.nn.linear import ROWS_MATMUL_MAX, Linear, set_layout

SHAPES = [(768, 512), (512, 512), (2816, 512), (512, 1408)] * 8 + [(8192, 512)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rows", type=int, default=1, help="vectors per product (batch size)")
    args = ap.parse_args()
    setup_threads(args.threads)
    torch.manual_seed(0)
    row_major = [torch.nn.Linear(n_in, n_out, bias=False) for n_out, n_in in SHAPES]
    ours = [Linear(n_in, n_out, bias=False) for n_out, n_in in SHAPES]
    with torch.no_grad():
        for lin, theirs in zip(ours, row_major):
            lin.weight.copy_(theirs.weight)  # same values, input-major storage
    in_major = [lin.weight.detach() for lin in ours]
    x = {n_in: torch.randn(args.rows, n_in) for _, n_in in SHAPES}
    nbytes = sum(lin.weight.nbytes for lin in row_major)
    ours_rows = torch.nn.ModuleList(copy.deepcopy(ours))
    set_layout(ours_rows, "rows")  # as the compiled decode step stores them
    compiled = torch.compile(
        lambda: [m(x[m.in_features]) for m in ours_rows], fullgraph=True, dynamic=False
    )
    variants = {
        "nn.Linear (row-major weight)": lambda: [m(x[m.in_features]) for m in row_major],
        "input-major weight": lambda: [F.linear(x[w.shape[1]], w) for w in in_major],
        "input-major + split product (attnlab)": lambda: [m(x[m.in_features]) for m in ours],
        "row-major + split product (attnlab)": lambda: [m(x[m.in_features]) for m in ours_rows],
        "row-major, compiled sums (attnlab)": compiled,
    }
    if args.rows > 1:  # the split products are for one vector: attnlab's Linear is oneDNN's
        del variants["input-major + split product (attnlab)"]
        del variants["row-major + split product (attnlab)"]
        variants["input-major, oneDNN (attnlab)"] = lambda: [m(x[m.in_features]) for m in ours]
        if args.rows > ROWS_MATMUL_MAX:  # compiled, more vectors are oneDNN's too
            variants["row-major, compiled oneDNN (attnlab)"] = variants.pop(
                "row-major, compiled sums (attnlab)"
            )
        variants["row-major, compiled F.linear (MKL)"] = torch.compile(
            lambda: [F.linear(x[m.in_features], m.weight) for m in ours_rows],
            fullgraph=True,
            dynamic=False,
        )
    with torch.no_grad():
        for fn in variants.values():  # (compiles the last one)
            for a, b in zip(fn(), variants["nn.Linear (row-major weight)"]()):
                # N(0, 1/in) init; float32 summation order differs between the kernels
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        weights = [m.weight.detach() for m in ours_rows]
        reads = torch.compile(lambda: [w.amax(-1) for w in weights], fullgraph=True)
        reads()
    variants["row-major, read alone (no product)"] = reads
    best = {}
    for _ in range(args.repeats):  # interleaved, best of repeats
        for name, fn in variants.items():
            t = time.perf_counter()
            with torch.no_grad():
                fn()
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - t)
    bandwidth = copy_bandwidth()
    vectors = "one token" if args.rows == 1 else f"{args.rows} tokens (one per batch row)"
    print(f"{len(SHAPES)} weight matrices, {nbytes / 1e6:.0f} MB float32, {vectors}")
    print(f"machine: {machine()}; large-copy bandwidth {bandwidth / 1e9:.1f} GB/s")
    base = best["nn.Linear (row-major weight)"]
    flops = 2 * args.rows * nbytes / 4  # a multiply and an add per weight and vector
    rows = [
        [
            name,
            f"{t * 1e3:.2f}",
            f"{nbytes / t / 1e9:.1f}",
            "-" if "read alone" in name else f"{flops / t / 1e9:.1f}",
            f"{base / t:.2f}x",
        ]
        for name, t in best.items()
    ]
    print(table(["weights", "ms per pass", "GB/s read", "GFLOP/s", "speed-up"], rows))


if __name__ == "__main__":
    main()
