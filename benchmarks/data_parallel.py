"""Data parallel on one CPU: one training process with every core's thread against one
process per core (``torchrun``, DistributedDataParallel over gloo) of one thread each, at the
same global batch (``train.batch_size`` is per process: each process trains on the preset's
batch divided by their number), and with the preset's batch in every process (twice the
work a step).

Each run is ``attnlab train --preset P --max-steps S`` in its own process(es); the runs take
turns, ``--rounds`` times. Throughput is the trainer's own: the ``tokens_per_second`` it
logs every 10 steps (all processes together, evaluations excluded), the median over the
logs after the first ``--skip`` steps (compilation, warm-up). The final training loss shows
that both runs train the same way.

    python benchmarks/data_parallel.py [--preset demo] [--steps 300] [--rounds 2] [--compile]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from _common import machine, table
from attnlab.presets import get_run_preset


def run(processes: int, threads: int, batch: int, args: argparse.Namespace) -> dict:
    """One training run: its median tokens/s and last logged training loss."""
    with tempfile.TemporaryDirectory() as out:
        train = ["train", "--preset", args.preset, "--out", out, "--max-steps", str(args.steps),
                 "--set", f"train.compile={str(args.compile).lower()}",
                 "--set", f"train.batch_size={batch}", "--quiet"]  # fmt: skip
        cmd = [sys.executable, "-m", "attnlab", "--threads", str(threads), *train]
        env = dict(os.environ)
        if processes > 1:
            env["OMP_NUM_THREADS"] = str(threads)
            cmd[1:3] = ["-m", "torch.distributed.run", "--standalone",
                        f"--nproc_per_node={processes}", "-m", "attnlab"]  # fmt: skip
        subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
        lines = Path(out, "metrics.jsonl").read_text(encoding="utf-8").splitlines()
        logs = [json.loads(line) for line in lines]
    train_logs = [r for r in logs if r["kind"] == "train"]
    timed = [r["tokens_per_second"] for r in train_logs if r["step"] > args.skip]
    return {"tok_s": statistics.median(timed), "loss": train_logs[-1]["train_loss"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="demo")
    ap.add_argument("--steps", type=int, default=300, help="training steps per run")
    ap.add_argument("--skip", type=int, default=50, help="first steps left out of the rate")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each variant, in turn")
    ap.add_argument("--compile", action="store_true", help="train.compile=true in every run")
    ap.add_argument("--cores", type=int, default=os.cpu_count(), help="threads / processes")
    args = ap.parse_args()
    if args.steps <= args.skip + 10:
        ap.error(f"--steps must exceed --skip + 10 ({args.skip + 10}) to leave a timed log")
    n = args.cores
    torch.set_num_threads(n)
    batch = get_run_preset(args.preset).train.batch_size
    if batch % n:
        ap.error(f"preset {args.preset}'s batch of {batch} does not split into {n} processes")
    # (name, processes, threads each, batch each)
    variants = [
        (f"1 process x {n} threads", 1, n, batch),
        (f"{n} processes x 1 thread", n, 1, batch // n),
        (f"{n} processes x 1 thread, batch {batch} each", n, 1, batch),
    ]
    results: dict[str, list[dict]] = {v[0]: [] for v in variants}
    for r in range(args.rounds):
        for name, processes, threads, each in variants:
            results[name].append(run(processes, threads, each, args))
            print(f"round {r + 1}: {name}: {results[name][-1]}", file=sys.stderr)
    base = statistics.median(x["tok_s"] for x in results[variants[0][0]])
    rows = []
    for name, processes, _, each in variants:
        runs = results[name]
        tok_s = statistics.median(x["tok_s"] for x in runs)
        lo, hi = min(x["tok_s"] for x in runs), max(x["tok_s"] for x in runs)
        loss = statistics.median(x["loss"] for x in runs)
        rows.append([name, processes * each, f"{tok_s:,.0f}", f"{lo:,.0f}-{hi:,.0f}",
                     f"{tok_s / base:.2f}x", f"{loss:.4f}"])  # fmt: skip
    print(f"machine: {machine()}")
    print(f"preset {args.preset}{', compiled' if args.compile else ''}: {args.steps} steps a run;"
          f" {args.rounds} round(s) in turn; tokens/s after step {args.skip}, medians;"
          " DDP over gloo")  # fmt: skip
    print(table(["run", "global batch", "tokens/s", "range", "speed", "final train loss"], rows))


if __name__ == "__main__":
    main()
