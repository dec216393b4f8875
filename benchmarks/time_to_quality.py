"""Time to quality on a character corpus: the `demo` preset against nanoGPT's documented CPU
configuration (`nanogpt-cpu`), trained one after the other on the same machine, corpus
(the embedded Python Language Reference), tokenizer and validation split.

The baseline runs its full schedule (2000 steps). The demo then gets the same wall-time
budget (its cosine schedule fitted to it). Both evaluate on the whole validation split (each
model at its own block size) about 20 times. Reported: the training time (optimizer steps
only, evaluations excluded, for both) each needs to reach the baseline's final validation
loss, and the demo's own final loss within the baseline's time.

    python benchmarks/time_to_quality.py
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from _common import machine, setup_threads, table
from attnlab.presets import get_run_preset
from attnlab.training import load_checkpoint, train


def curve(out_dir: Path) -> list[tuple[float, float, int]]:
    """(training seconds, val loss, step) of every evaluation after step 0."""
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [
        (r["train_time"], r["val_loss"], r["step"])
        for r in rows
        if r["kind"] == "val" and r["step"] > 0
    ]


def time_to_reach(points: list[tuple[float, float, int]], target: float) -> float | None:
    """Training time at which the validation curve first reaches ``target`` (linear
    interpolation between evaluations), or None."""
    prev_t, prev_v = 0.0, float("inf")
    for t, v, _ in points:
        if v <= target:
            if prev_v == float("inf"):
                return t
            return prev_t + (t - prev_t) * (prev_v - target) / (prev_v - v)
        prev_t, prev_v = t, v
    return None


def run(name: str, out: Path, eval_every: int, budget: float | None):
    # eval_batches beyond the split's size: the whole validation split at every evaluation
    overrides = {"train.eval_every": eval_every, "train.eval_batches": 10**6}
    cfg = get_run_preset(name).override({**overrides, "train.time_budget": budget})
    result = train(cfg, out / name, progress=False, overwrite=True)
    n_params = load_checkpoint(out / name).model.num_parameters()
    return cfg, result, curve(out / name), n_params


def describe(cfg, n_params: int) -> str:
    m, t = cfg.model, cfg.train
    arch = "LLaMA-style" if m.position.kind == "rope" else "GPT-2-style"
    return (
        f"{arch}, {m.n_layers}x{m.d_model}, {n_params / 1e6:.2f}M params, block "
        f"{t.block_size}, batch {t.batch_size}, lr {t.lr:g}, {t.dtype}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--baseline-eval-every", type=int, default=100)
    ap.add_argument("--demo-eval-every", type=int, default=40)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None, help="keep the runs here")
    args = ap.parse_args()
    setup_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        base_cfg, base, base_curve, base_n = run("nanogpt-cpu", out, args.baseline_eval_every, None)
        demo_cfg, demo, demo_curve, demo_n = run("demo", out, args.demo_eval_every, base.elapsed)
    target = base_curve[-1][1]
    base_time = base_curve[-1][0]
    demo_time = time_to_reach(demo_curve, target)
    print(f"machine: {machine()}")
    print(
        f"target: the baseline's final validation loss {target:.4f} (whole validation split, "
        "each model at its own block size); times are optimizer steps, evaluations excluded"
    )
    reach = "never" if demo_time is None else f"{demo_time:.1f}"
    ratio = "-" if demo_time is None else f"{demo_time / base_time:.2f}x"
    rows = [
        ["nanogpt-cpu (baseline)", describe(base_cfg, base_n), base.step, f"{base_time:.1f}",
         f"{base_time:.1f}", "1.00x", f"{target:.4f}"],
        ["demo", describe(demo_cfg, demo_n), demo.step, f"{demo_curve[-1][0]:.1f}", reach,
         ratio, f"{demo_curve[-1][1]:.4f}"],
    ]  # fmt: skip
    print(table(["preset", "model and training", "steps", "train s", "s to target",
                 "time vs baseline", "final val loss"], rows))  # fmt: skip
    print("validation loss by training time:")
    for name, pts in (("nanogpt-cpu", base_curve), ("demo", demo_curve)):
        marks = [pts[i] for i in sorted({len(pts) * k // 8 for k in range(8)} | {len(pts) - 1})]
        print(f"  {name:12s} " + "  ".join(f"{t:.0f}s:{v:.3f}" for t, v, _ in marks))


if __name__ == "__main__":
    main()
