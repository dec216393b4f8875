"""Train the three encoder fine-tuning presets with ``attnlab train --preset NAME`` (run in
this process) and score the final checkpoint on each task's test split, which no training
or validation example is drawn from: language identification of numbers in words
(``bert-tiny-langid``, text-classification), entity tagging (``bert-tiny-ner``,
token-classification) and extractive QA (``bert-tiny-qa``, question-answering).

    python benchmarks/bert_tasks.py [--threads 1] [--presets bert-tiny-ner ...] [--out runs]

Prints one table row per preset: parameters, steps, wall seconds of the whole command
(data generation, tokenizer training, evaluations and saves included), and the test
metrics; for QA also how many test misses answer with the value that the asked relation
has for another person of the context. Wall times depend on the machine and its load: the
script prints the load average next to them. ``--no-train`` scores the runs already in
``--out``.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import time
from pathlib import Path

import torch

from _common import table
from attnlab.cli.main import main as attnlab
from attnlab.data.generated import RELATIONS
from attnlab.tasks import TASKS
from attnlab.tasks.base import eval_mode
from attnlab.tasks.question_answering import predict_answer
from attnlab.training import load_checkpoint

PRESETS = ("bert-tiny-langid", "bert-tiny-ner", "bert-tiny-qa")
METRICS = {  # what each task's test row shows
    "text-classification": ("accuracy",),
    "token-classification": ("token_accuracy", "entity_f1"),
    "question-answering": ("exact_match", "f1"),
}


def _pattern(template: str, value: str) -> str:
    """A fact or question template as a regex: any person, ``value`` for {V}."""
    return re.escape(template).replace(r"\{P\}", r"\w+").replace(r"\{V\}", value)


def qa_misses(task, model) -> tuple[int, int]:
    """(test misses, misses whose text is the asked relation's value for another person)."""
    misses = other_person = 0
    features = task.features["test"]
    with eval_mode(model):
        for i in range(0, len(features), 100):
            chunk = features[i : i + 100]
            logits = task.forward(model, task.collate(chunk), with_targets=False).logits
            for row, f in zip(logits, chunk):
                offset, spans, e = f.extra
                text = predict_answer(row, offset, spans, e.context, task.opts.max_answer_tokens)[0]
                if text == e.answer:
                    continue
                misses += 1
                fact = next(
                    f for f, q, _ in RELATIONS.values() if re.fullmatch(_pattern(q, ""), e.question)
                )
                other_person += text in re.findall(_pattern(fact, "(.+?)"), e.context)
    return misses, other_person


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--presets", nargs="+", default=list(PRESETS), choices=PRESETS)
    ap.add_argument("--out", default="runs", help="each run goes to OUT/<preset>-bench")
    ap.add_argument("--no-train", action="store_true", help="score the runs already in --out")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for preset in args.presets:
        out = Path(args.out) / f"{preset}-bench"
        argv = ["train", "--preset", preset, "--out", str(out), "--device", "cpu"]
        argv += ["--overwrite", "--quiet"]
        start = time.perf_counter()
        if not args.no_train and attnlab(argv):
            raise SystemExit(f"attnlab {' '.join(argv)} failed")
        seconds = "-" if args.no_train else f"{time.perf_counter() - start:.0f}"
        load = os.getloadavg()[0]
        ckpt = load_checkpoint(out, with_state=True)
        task = TASKS[ckpt.config.task](ckpt.config, tokenizer=ckpt.tokenizer)
        test = task.evaluate_split(ckpt.model, "test")
        shown = ", ".join(f"{m} {test[m]:.4f}" for m in METRICS[ckpt.config.task])
        if ckpt.config.task == "question-answering":
            misses, other = qa_misses(task, ckpt.model)
            shown += f"; {other} of {misses} misses: another person's value"
        params = sum(p.numel() for p in ckpt.model.parameters())
        rows.append([preset, ckpt.config.task, f"{params:,}", ckpt.state["step"], seconds,
                     f"{load:.1f}", int(test["examples"]), shown])  # fmt: skip
        print(f"{preset}: {seconds} s, test {shown}", flush=True)
    print(
        f"\nmachine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} thread(s); command per row: "
        f"OMP_NUM_THREADS={args.threads} attnlab train --preset NAME"
    )
    headers = ["preset", "task", "params", "steps", "wall s", "load", "test examples",
               "test metrics (final checkpoint)"]  # fmt: skip
    print(table(headers, rows))


if __name__ == "__main__":
    main()
