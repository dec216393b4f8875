"""Which model shape learns most in a short time budget? Variants of the `quick` preset (and
the `demo` preset), each trained for the same wall-clock budget on the embedded corpus with
its schedule fitted to the budget, then scored on the whole validation split.

A short budget favours a shallow model that takes many steps: the table shows the steps
each variant fitted in the budget and its final validation loss. One run per variant per
round, the rounds interleaved; with ``--repeats`` the medians are shown. The step counts
move with the machine's speed during a run (a shared CPU), the losses with them.

    python benchmarks/short_budget.py [--budget 20] [--repeats 1] [--variants ...]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from _common import machine, setup_threads, table
from attnlab.presets import get_run_preset
from attnlab.training import train

BLOCK = lambda b, t: {"train.batch_size": b, "train.block_size": t, "model.max_seq_len": t}  # noqa: E731

# name -> (run preset, overrides); every variant trains on 1,024 tokens a step unless named
VARIANTS = {
    "quick (2 layers, block 64, batch 16)": ("quick", {}),
    "demo (4 layers, block 128, batch 8)": ("demo", {}),
    "quick, 1 layer": ("quick", {"model.n_layers": 1}),
    "quick, 3 layers": ("quick", {"model.n_layers": 3}),
    "quick, block 128, batch 8": ("quick", BLOCK(8, 128)),
    "quick, block 32, batch 32": ("quick", BLOCK(32, 32)),
    "quick, batch 24, lr 4e-3": ("quick", {"train.batch_size": 24, "train.lr": 4e-3}),
    "quick, 2 heads of 64": ("quick", {"model.attention.n_heads": 2}),
    "quick, lr 2e-3": ("quick", {"train.lr": 2e-3}),
    "quick, lr 5e-3": ("quick", {"train.lr": 5e-3}),
    "quick, d_model 192": ("quick", {"model.d_model": 192}),
    "quick, Muon": ("quick", {"train.optimizer": "muon"}),
    "quick, no weight decay": ("quick", {"train.weight_decay": 0.0}),
    "quick, warm-up 20": ("quick", {"train.warmup_steps": 20}),
    "quick, untied embeddings": ("quick", {"model.tie_embeddings": False}),
    "quick, batch 8 (512 tokens)": ("quick", {"train.batch_size": 8}),
    "quick, compiled": ("quick", {"train.compile": True}),
    "quick, min_lr 0": ("quick", {"train.min_lr": 0.0}),
    "quick, beta2 0.95": ("quick", {"train.beta2": 0.95}),
    "quick, no weight decay, min_lr 0": ("quick", {"train.weight_decay": 0.0, "train.min_lr": 0.0}),
    "quick, no weight decay, lr 4e-3": ("quick", {"train.weight_decay": 0.0, "train.lr": 4e-3}),
    "quick, no grad clip": ("quick", {"train.grad_clip": 0.0}),
    "quick, 4 heads of 32": ("quick", {"model.attention.n_heads": 4}),
    "quick, std 0.02, beta1 0.9": ("quick", {"model.init_std": 0.02, "train.beta1": 0.9}),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--budget", type=float, default=20.0, help="seconds per run")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    setup_threads(args.threads)
    results: dict[str, list[tuple[int, float]]] = {name: [] for name in args.variants}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for i, name in enumerate(args.variants):
                preset, overrides = VARIANTS[name]
                cfg = get_run_preset(preset).override(
                    {**overrides, "train.eval_every": 0, "train.time_budget": args.budget}
                )
                res = train(cfg, Path(tmp) / f"{r}-{i}", progress=False, overwrite=True)
                full = res.val_metrics["loss"]  # the final evaluation: whole validation split
                results[name].append((res.step, full))
    print(f"machine: {machine()}")
    print(
        f"budget: {args.budget:g} s per run (schedule fitted to it, final evaluation included); "
        f"embedded corpus, character level; {args.repeats} round(s), medians"
    )
    rows = []
    for name, runs in results.items():
        steps, losses = zip(*runs)
        rows.append([name, int(statistics.median(steps)), f"{statistics.median(losses):.4f}"])
    print(table(["variant", "steps", "final val loss (whole split)"], rows))


if __name__ == "__main__":
    main()
