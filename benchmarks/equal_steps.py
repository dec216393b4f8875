"""Quality at equal steps: training variants of a run preset (``demo`` unless ``--preset``),
each run for a fixed number of steps (the variant's, or ``--steps``) with its schedule over
them, scored on the whole validation split half-way and at the end. Losses at a given step
do not depend on the machine's load, so this compares what each variant learns per step
(or, with the batch varied, per token); step times come from train_levers.py and
time_to_quality.py. ``--seed`` changes the initialisation and the data order: run a few to
see how far the seed alone moves the loss.

    python benchmarks/equal_steps.py [--variants adamw muon-1e-2 ...] [--threads 1]
        [--preset demo] [--steps N] [--seed S]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from _common import machine, setup_threads
from attnlab.presets import get_run_preset
from attnlab.training.optim import lr_at, set_lr
from attnlab.training.trainer import Trainer

# name -> (steps, overrides of the preset)
VARIANTS = {
    "adamw": (400, {}),
    "adamw-lr2e-3": (400, {"train.lr": 0.002}),
    "adamw-lr3e-3": (400, {"train.lr": 0.003}),
    "adamw-lr4e-3": (400, {"train.lr": 0.004}),
    "adamw-lr6e-3": (400, {"train.lr": 0.006}),
    "muon-3e-3": (400, {"train.optimizer": "muon"}),
    "muon-6e-3": (400, {"train.optimizer": "muon", "train.lr": 0.006}),
    "muon-1e-2": (400, {"train.optimizer": "muon", "train.lr": 0.01}),
    "batch16": (200, {"train.batch_size": 16}),
    "batch4-lr2e-3": (800, {"train.batch_size": 4, "train.lr": 0.002}),
    "no-weight-decay": (400, {"train.weight_decay": 0.0}),
    "no-weight-decay-lr4e-3": (400, {"train.weight_decay": 0.0, "train.lr": 0.004}),
    "to-zero-lr": (400, {"train.min_lr": 0.0}),
    "cosine": (400, {"train.schedule": "cosine"}),
    "wsd": (400, {"train.schedule": "wsd", "train.decay_fraction": 0.3}),
    "wsd-half": (400, {"train.schedule": "wsd", "train.decay_fraction": 0.5}),
    "wsd-0.7": (400, {"train.schedule": "wsd", "train.decay_fraction": 0.7}),
    "linear": (400, {"train.schedule": "wsd", "train.decay_fraction": 1.0}),
    "beta2-0.95": (400, {"train.beta2": 0.95}),
    "warmup-20": (400, {"train.warmup_steps": 20}),
    "warmup-100": (400, {"train.warmup_steps": 100}),
    "gpt2-init-beta1-0.9": (400, {"model.init_std": 0.02, "train.beta1": 0.9}),
    "weight-decay-0.3": (400, {"train.weight_decay": 0.3}),
    "d192-3-layers": (
        400,
        {"model.d_model": 192, "model.n_layers": 3, "model.attention.n_heads": 3},
    ),
}
# One-setting sweeps, 400 steps each: init-<std> (weights' initial std), beta1-<b>, heads<n>.
for _std in (0.01, 0.03, 0.04, 0.05, 0.06, 0.08, 0.1, 0.12):
    VARIANTS[f"init-{_std:g}"] = (400, {"model.init_std": _std})
for _beta1 in (0.7, 0.8, 0.85):
    VARIANTS[f"beta1-{_beta1:g}"] = (400, {"train.beta1": _beta1})
for _heads in (2, 4, 8):
    VARIANTS[f"heads{_heads}"] = (
        400,
        {"model.attention.n_heads": _heads, "model.attention.n_kv_heads": _heads},
    )


def run(name: str, preset: str, steps: int, overrides: dict, seed: int | None) -> dict:
    base = {"train.eval_every": 0, "train.time_budget": None, "train.max_steps": steps}
    if seed is not None:
        base["train.seed"] = seed
    cfg = get_run_preset(preset).override({**base, **overrides})
    with tempfile.TemporaryDirectory() as tmp:
        tr = Trainer(cfg, tmp, progress=False)
        tc, val = tr.tc, {}
        t0 = time.perf_counter()
        for step in range(steps):
            set_lr(tr.optimizer, lr_at(step, tc, steps))
            keys = tr.task.sample(tc.batch_size * tc.grad_accum, tr.data_generator)
            out = tr.task.step(tr.train_model, tr.task.batch(keys, tr.device))
            out.objective.backward()
            torch.nn.utils.clip_grad_norm_(tr.model.parameters(), tc.grad_clip)
            tr.optimizer.step()
            tr.optimizer.zero_grad(set_to_none=True)
            if step + 1 in (steps // 2, steps):
                metrics, _ = tr._evaluate(None)  # the whole validation split
                val[step + 1] = round(metrics["loss"], 4)
    return {"name": name, "steps": steps, "val": val, "s": round(time.perf_counter() - t0, 1)}


def variant(name: str) -> str:
    unknown = [part for part in name.split("+") if part not in VARIANTS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown variant {unknown[0]!r}; choose from {', '.join(VARIANTS)} (join with +)"
        )
    return name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument(
        "--variants",
        nargs="+",
        default=list(VARIANTS),
        type=variant,
        help="names from VARIANTS; join several with + to combine their overrides",
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--preset", default="demo")
    ap.add_argument("--steps", type=int, default=None, help="every variant's step count")
    ap.add_argument("--seed", type=int, default=None, help="train.seed (default: the preset's)")
    args = ap.parse_args()
    setup_threads(args.threads)
    print(f"machine: {machine()}; preset {args.preset}")
    for name in args.variants:  # one JSON line per variant: val loss by step
        parts = [VARIANTS[part] for part in name.split("+")]
        steps = max(part_steps for part_steps, _ in parts)
        overrides = {key: value for _, part in parts for key, value in part.items()}
        result = run(name, args.preset, args.steps or steps, overrides, args.seed)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
