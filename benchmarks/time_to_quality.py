"""Time to quality on a character corpus: the `demo` preset against nanoGPT's documented CPU
configuration (`nanogpt-cpu`), trained one after the other on the same machine, corpus
(the embedded Python Language Reference), tokenizer and validation split.

The baseline runs its full schedule (2000 steps), its linear layers' products by F.linear
(MKL's sgemm), as nanoGPT's nn.Linear does; attnlab's runs use its own (oneDNN's in
float32 on CPU: attnlab.nn.linear). Every run, the baseline included, trains with the
malloc settings attnlab's trainer applies on CPU (attnlab/allocator.py: they are
process-wide, and they make the baseline faster too). Each variant then gets a budget (its
schedule fitted to it): `demo` the baseline's wall time, evaluating on the whole
validation split (each model at its own block size) about 20 times on the way; the "1/4
budget" (1/5 to 1/8, 0.3, 0.35) rows that share of the baseline's training time, evaluations
excluded (the schedule a user picks to finish fast), and evaluate once, at the end (the
trainer keeps room in the budget for that evaluation, so they train a few percent less
than the share). `quick` is the 2-layer preset shaped for such budgets. Reported: the
training time (optimizer steps only, evaluations excluded) each needs to reach the
baseline's final validation loss, and its own final loss; with ``--repeats``
the rounds run one after the other and the medians are shown.

``--corpus stdlib`` repeats the comparison on another plain-text corpus of about the same
size: the source of CPython's own standard library (the first public ASCII modules of its
top folder in sorted order, about 0.5 MB, one document per module).

    python benchmarks/time_to_quality.py [--repeats 3] [--variants ...] [--corpus stdlib]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import attnlab.nn.linear as linear_module
from _common import machine, setup_threads, table
from attnlab.presets import get_run_preset
from attnlab.training import load_checkpoint, train


def curve(out_dir: Path) -> list[tuple[float, float, int]]:
    """(training seconds, val loss, step) of every evaluation after step 0."""
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [
        (r["train_time"], r.get("val_full_loss", r["val_loss"]), r["step"])
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


def stdlib_corpus(folder: Path, size: int) -> Path:
    """Write the first public ASCII modules of CPython's standard library (sorted by name;
    private ones such as the generated _sysconfigdata left out) to
    ``folder`` as .txt files, until they hold at least ``size`` characters."""
    import sysconfig

    folder.mkdir(parents=True, exist_ok=True)
    total = 0
    for src in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = src.read_text(encoding="utf-8", errors="replace")
        if src.name.startswith("_") or not text.isascii() or len(text) < 2000:
            continue
        (folder / f"{src.stem}.txt").write_text(text)
        total += len(text)
        if total >= size:
            break
    return folder


def run(preset: str, overrides: dict, out: Path, label: str, eval_every: int, budget):
    # eval_batches beyond the split's size: the whole validation split at every evaluation
    # (without evaluations on the way, the trainer's final one covers the whole split)
    overrides = {**overrides, "train.eval_every": eval_every}
    if eval_every:
        overrides["train.eval_batches"] = 10**6
    if DATA_PATH is not None:
        overrides["data.path"] = DATA_PATH
    cfg = get_run_preset(preset).override({**overrides, "train.time_budget": budget})
    onednn = linear_module.ONEDNN
    linear_module.ONEDNN = onednn and preset != "nanogpt-cpu"  # the baseline: nn.Linear's
    try:
        result = train(cfg, out / label, progress=False, overwrite=True)
    finally:
        linear_module.ONEDNN = onednn
    n_params = load_checkpoint(out / label).model.num_parameters()
    return cfg, result, curve(out / label), n_params


def describe(cfg, n_params: int) -> str:
    m, t = cfg.model, cfg.train
    arch = "LLaMA-style" if m.position.kind == "rope" else "GPT-2-style"
    return (
        f"{arch}, {m.n_layers}x{m.d_model}, {n_params / 1e6:.2f}M params, block "
        f"{t.block_size}, batch {t.batch_size}, lr {t.lr:g}, {t.dtype}"
        + (", compiled" if t.compile else "")
    )


DATA_PATH: str | None = None  # None: the embedded corpus

# name -> (run preset, overrides, time budget as a fraction of the baseline's training time)
VARIANTS = {
    "demo": ("demo", {}, 1.0),
    "demo, 1/4 budget": ("demo", {}, 0.25),
    "demo + muon, 1/4 budget": ("demo", {"train.optimizer": "muon", "train.lr": 0.01}, 0.25),
    "demo + compile": ("demo", {"train.compile": True}, 1.0),
    "demo, batch 4": ("demo", {"train.batch_size": 4, "train.lr": 0.002}, 1.0),
    "demo, batch 4, 1/4 budget": ("demo", {"train.batch_size": 4, "train.lr": 0.002}, 0.25),
    "quick, 1/4 budget": ("quick", {}, 0.25),
    "quick, 1/5 budget": ("quick", {}, 0.2),
    "quick, 1/6 budget": ("quick", {}, 1 / 6),
    "quick, 1/7 budget": ("quick", {}, 1 / 7),
    "quick, 1/8 budget": ("quick", {}, 1 / 8),
    "quick, 0.3 budget": ("quick", {}, 0.3),
    "quick, 0.35 budget": ("quick", {}, 0.35),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--baseline-eval-every", type=int, default=100)
    ap.add_argument("--demo-eval-every", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=1, help="interleaved rounds; medians shown")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None, help="keep the runs here")
    ap.add_argument("--corpus", choices=["embedded", "stdlib"], default="embedded")
    args = ap.parse_args()
    setup_threads(args.threads)
    global DATA_PATH
    rounds = []  # per round: {name: (cfg, result, curve, n_params)}
    with tempfile.TemporaryDirectory() as tmp:
        if args.corpus == "stdlib":
            from attnlab.data.corpus import default_corpus

            DATA_PATH = str(stdlib_corpus(Path(tmp) / "stdlib", len(default_corpus())))
        for r in range(args.repeats):
            out = (args.out or Path(tmp)) / f"round{r}"
            base = run("nanogpt-cpu", {}, out, "baseline", args.baseline_eval_every, None)
            runs = {"nanogpt-cpu (baseline)": base}
            base_time = base[2][-1][0]
            for name in args.variants:
                preset, overrides, share = VARIANTS[name]
                label = name.replace(", ", "-").replace(" + ", "-").replace("/", "_")
                if share < 1:  # a share of the baseline's training time; evaluated at the end
                    budget, eval_every = share * base_time, 0
                else:
                    budget, eval_every = base[1].elapsed, args.demo_eval_every
                runs[name] = run(preset, overrides, out, label, eval_every, budget)
            rounds.append((base_time, runs))
    print(f"machine: {machine()}")
    print(f"corpus: {'embedded (pydoc_data.topics)' if DATA_PATH is None else 'stdlib sources'}")
    targets = [runs["nanogpt-cpu (baseline)"][2][-1][1] for _, runs in rounds]
    print(
        f"target: the baseline's final validation loss ({', '.join(f'{t:.4f}' for t in targets)}"
        f" in {len(rounds)} interleaved round(s); whole validation split, each model at its own "
        "block size); times are optimizer steps, evaluations excluded; medians over rounds"
    )
    rows = []
    for name in ["nanogpt-cpu (baseline)", *args.variants]:
        reach, ratios, finals, train_s, steps = [], [], [], [], []
        for (base_time, runs), target in zip(rounds, targets):
            cfg, result, pts, n_params = runs[name]
            t = time_to_reach(pts, target) if name != "nanogpt-cpu (baseline)" else base_time
            reach.append(t)
            ratios.append(None if t is None else t / base_time)
            finals.append(pts[-1][1])
            train_s.append(pts[-1][0])
            steps.append(result.step)
        reached = [t for t in reach if t is not None]
        ok = [x for x in ratios if x is not None]
        missed = len(reach) - len(reached)
        rows.append([
            name, describe(cfg, n_params), int(statistics.median(steps)),
            f"{statistics.median(train_s):.1f}",
            f"{statistics.median(reached):.1f}" if reached else "never",
            (f"{statistics.median(ok):.2f}x" if ok else "-")
            + (f" ({missed} missed)" if missed else ""),
            f"{statistics.median(finals):.4f}",
        ])  # fmt: skip
    print(table(["run", "model and training", "steps", "train s", "s to target",
                 "time vs baseline", "final val loss"], rows))  # fmt: skip
    print("validation loss by training time (last round):")
    for name, (_, _, pts, _) in rounds[-1][1].items():
        marks = [pts[i] for i in sorted({len(pts) * k // 8 for k in range(8)} | {len(pts) - 1})]
        print(f"  {name:24s} " + "  ".join(f"{t:.0f}s:{v:.3f}" for t, v, _ in marks))


if __name__ == "__main__":
    main()
