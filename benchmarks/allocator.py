"""Page faults and step time of CPU training with glibc's default malloc settings and with
the ones the trainer sets (``train.keep_freed_memory``: attnlab/allocator.py).

A malloc setting is process-wide and cannot be undone, so every measurement is its own
process (this script run with ``--child``): it builds the preset's trainer, runs
``--warmup`` steps (compiling, for ``compile``), then times ``--steps`` steps with
attnlab's trainer step (``eval``: forward passes of 4 batches without gradients, as
evaluation runs them) and counts the minor page faults they took (``getrusage``). The two
settings take turns, ``--rounds`` times; medians are shown.

    python benchmarks/allocator.py [--presets demo llama-30m] [--steps 40] [--rounds 3]
        [--variants eager compile eval] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from _common import machine, setup_threads, table

# llama-30m as benchmarks/mfu.py trains it
EXTRA = {"llama-30m": {"train.batch_size": 4, "train.block_size": 256, "train.lr": 3e-4}}


def child(args: argparse.Namespace) -> None:
    """One measurement, printed as one JSON line."""
    from attnlab.presets import get_run_preset
    from attnlab.training.trainer import Trainer, _StopRequest

    setup_threads(args.threads)
    overrides = {
        **EXTRA.get(args.preset, {}),
        "train.eval_every": 0,
        "train.time_budget": None,
        "train.max_steps": args.warmup + args.steps + 1,
        "train.compile": args.variant == "compile",
        "train.keep_freed_memory": args.setting == "kept",
    }
    cfg = get_run_preset(args.preset).override(overrides)
    stop, never = _StopRequest(), lambda: False
    with tempfile.TemporaryDirectory() as tmp:
        tr = Trainer(cfg, tmp, progress=False)
        if args.variant == "eval":  # forward passes of 4 batches, as evaluation runs them
            tr.model.eval()
            batches = [tr.task.batch(tr.task.sample(tr.tc.batch_size, tr.data_generator), "cpu")
                       for _ in range(4)]  # fmt: skip
            step = torch.inference_mode()(lambda: [tr.task.step(tr.model, b) for b in batches])
        else:
            step = lambda: tr._train_step(stop, never)  # noqa: E731
        for _ in range(args.warmup):
            step()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        times = []
        for _ in range(args.steps):
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    ms = statistics.median(times) * 1e3
    print(json.dumps({"ms": ms, "faults": faults / args.steps}))


def measure(args: argparse.Namespace, preset: str, variant: str, setting: str) -> dict:
    cmd = [sys.executable, __file__, "--child", "--preset", preset, "--variant", variant]
    cmd += ["--setting", setting, "--steps", str(args.steps), "--warmup", str(args.warmup)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--presets", nargs="+", default=["demo", "llama-30m"])
    ap.add_argument("--variants", nargs="+", default=["eager", "compile"],
                    choices=["eager", "compile", "eval"])  # fmt: skip
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--preset", help=argparse.SUPPRESS)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    ap.add_argument("--setting", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    setup_threads(args.threads)
    print(f"machine: {machine()}")
    runs = [(p, v) for p in args.presets for v in args.variants]
    results: dict[tuple[str, str, str], list[dict]] = {}
    for _ in range(args.rounds):
        for preset, variant in runs:
            for setting in ("default", "kept"):
                key = (preset, variant, setting)
                results.setdefault(key, []).append(measure(args, preset, variant, setting))

    def med(key, field):
        return statistics.median(r[field] for r in results[key])

    rows = []
    for preset, variant in runs:
        d, k = (preset, variant, "default"), (preset, variant, "kept")
        rows.append([preset, variant, f"{med(d, 'ms'):.1f}", f"{med(d, 'faults'):,.0f}",
                     f"{med(k, 'ms'):.1f}", f"{med(k, 'faults'):,.0f}",
                     f"{med(d, 'ms') / med(k, 'ms'):.2f}x"])  # fmt: skip
    print(
        f"training step (eval: forward passes of 4 batches), median of {args.rounds} processes "
        f"per cell ({args.steps} steps each, after {args.warmup}); page faults per step"
    )
    headers = ["preset", "run", "default ms", "faults", "kept ms", "faults", "speed-up"]
    print(table(headers, rows))


if __name__ == "__main__":
    main()
