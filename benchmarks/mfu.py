"""Model FLOP utilisation of training: achieved FLOP/s / the matmul FLOP/s of this machine,
both measured in this run.

Achieved FLOP/s = training FLOPs per token (6 x matmul parameters + 12 x layers x context x
heads x head dim: attnlab.analysis.flops_per_token) x tokens/s of attnlab's trainer (the
`train` records of metrics.jsonl, first interval skipped as warm-up). Peak = the best
float32 (and, where the run uses it, bfloat16) square matmul.

Each preset runs eager and, with ``--compile``, also under ``train.compile`` (inductor),
whose fused element-wise kernels cut the time outside the matmuls. A shared machine's speed
drifts between runs: ``--rounds N`` runs them all N times in turn, each round measuring its
own matmul peak, and shows the medians.

    python benchmarks/mfu.py [--steps 60] [--presets nanogpt-cpu demo llama-30m] [--compile]
        [--rounds 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from _common import machine, setup_threads, table
from attnlab.analysis import flops_per_token
from attnlab.presets import get_run_preset
from attnlab.training import train

# A larger model than the CPU presets, to show utilisation where matmuls dominate.
EXTRA = {"llama-30m": {"train.batch_size": 4, "train.block_size": 256, "train.lr": 3e-4}}


def matmul_flops(dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--presets", nargs="+", default=["nanogpt-cpu", "demo", "llama-30m"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--compile", action="store_true", help="also each preset compiled")
    ap.add_argument("--rounds", type=int, default=1, help="all runs again; medians shown")
    args = ap.parse_args()
    setup_threads(args.threads)
    runs = [(name, False) for name in args.presets]
    runs += [(name, True) for name in args.presets if args.compile]
    info = {}  # label -> (train FLOPs per token, block, batch, dtype)
    rates: dict[str, list[float]] = {}  # label -> tokens/s of each round
    mfus: dict[str, list[float]] = {}  # label -> achieved / that round's matmul peak
    peaks: dict[torch.dtype, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):  # the machine's speed drifts: rounds, medians
            peak = {torch.float32: matmul_flops(torch.float32)}
            for name, compiled in runs:
                cfg = get_run_preset(name).override(
                    {"train.eval_every": 0, "train.log_every": 10, "train.time_budget": None,
                     "train.max_steps": args.steps, "train.compile": compiled,
                     **EXTRA.get(name, {})}
                )  # fmt: skip
                out = Path(tmp) / f"{name}{'-compiled' if compiled else ''}-{r}"
                train(cfg, out, progress=False)
                records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
                # the first intervals hold the warm-up (and the compilation): skipped
                tok_s = statistics.median(
                    [x["tokens_per_second"] for x in records if x["kind"] == "train"][2:]
                )
                saved = json.loads((out / "config.json").read_text())  # vocab: the tokenizer's
                model_cfg = cfg.model.override({"vocab_size": saved["model"]["vocab_size"]})
                block = cfg.train.block_size or cfg.model.max_seq_len
                dtype = torch.bfloat16 if cfg.train.dtype == "bfloat16" else torch.float32
                peak.setdefault(dtype, matmul_flops(dtype))
                per_token = flops_per_token(model_cfg, block)["training"]
                label = f"{name} (compiled)" if compiled else name
                info[label] = (per_token, block, cfg.train.batch_size, dtype)
                rates.setdefault(label, []).append(tok_s)
            for dtype in peak:  # the best of before and after the round's runs
                peak[dtype] = max(peak[dtype], matmul_flops(dtype))
                peaks.setdefault(dtype, []).append(peak[dtype])
            for label, (per_token, _, _, dtype) in info.items():
                mfus.setdefault(label, []).append(per_token * rates[label][-1] / peak[dtype])
    rows = []
    for label, (per_token, block, batch, dtype) in info.items():
        tok_s = statistics.median(rates[label])
        rows.append([label, f"{per_token / 1e6:.2f}M", block, batch, str(dtype).split(".")[-1],
                     f"{tok_s:,.0f}", f"{per_token * tok_s / 1e9:.1f}",
                     f"{statistics.median(peaks[dtype]) / 1e9:.1f}",
                     f"{statistics.median(mfus[label]):.0%}"])  # fmt: skip
    print(f"machine: {machine()}")
    print(
        f"medians over {args.rounds} round(s) of every run in turn; MFU against each round's peak"
    )
    print(table(["preset", "train FLOPs/token", "block", "batch", "dtype", "tokens/s",
                 "achieved GFLOP/s", "matmul GFLOP/s", "MFU"], rows))  # fmt: skip


if __name__ == "__main__":
    main()
