"""Training-speed levers for the ``demo`` preset, measured side by side: each variant trains
its own copy of the model on the same data stream, one step of each in turn (so load on a
shared machine hits them alike), with the preset's schedule over ``--steps``. Reported: the
median step time, the speed relative to the preset (to the first variant where the preset
is not run), and the mean training loss of the last tenth of the steps (quality at equal
steps; a faster step is only worth it at equal loss).

Variants: the preset (eager, float32, fused AdamW); torch.compile (inductor) of the model;
bf16 autocast; ``train.optimizer=muon`` (torch.optim.Muon for the hidden weight matrices,
AdamW for embeddings, norms and biases: the split Muon's authors use); ``input-major`` and
``compile-input-major``: the weights stored input-major (the eager decoding layout) instead
of the row-major layout the trainer gives them; ``mkl`` and ``compile-mkl``: the linear
layers' products by F.linear (MKL's sgemm) instead of oneDNN's (``attnlab.nn.linear.ONEDNN``);
``compile-max-autotune`` and ``compile-cpp-wrapper``: the compiled step under two of
inductor's settings (``INDUCTOR``, given as ``torch.compile``'s options): ``max_autotune``
(``mode="max-autotune-no-cudagraphs"``: on CPU it tries its C++ GEMM templates, which take
only constant, frozen weights as the second operand) and ``cpp_wrapper`` (the compiled
graph's calls made from C++ instead of Python); ``compile-eager-attention`` and
``compile-eager-attention-max-autotune``: attention as its explicit products and softmax
(``model.attention.backend=eager``), which max_autotune may give to its C++ batched-GEMM
template; ``compile-compiled-autograd``: the compiled step with its backward traced whole by
compiled autograd (``torch._dynamo.compiled_autograd``) and compiled, instead of autograd
running the compiled graphs' backward pieces (entered around this variant's forward and
backward only, so the variants still take turns in one process).

    python benchmarks/train_levers.py [--steps 300] [--preset demo] [--threads 2]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time

import torch

import attnlab.nn.linear as linear_module
from _common import machine, setup_threads, table
from attnlab.nn.linear import set_layout
from attnlab.presets import get_run_preset
from attnlab.training.evaluate import autocast_context
from attnlab.training.optim import lr_at, set_lr

OVERRIDES = {  # variant -> overrides of the preset
    "preset": {},
    "compile": {"train.compile": True},
    "bf16": {"train.dtype": "bfloat16"},
    "muon": {"train.optimizer": "muon", "train.lr": 0.01},  # its best of 3e-3, 6e-3, 1e-2
    "input-major": {},
    "compile-input-major": {"train.compile": True},
    "mkl": {},
    "compile-mkl": {"train.compile": True},
    "compile-max-autotune": {"train.compile": True},
    "compile-cpp-wrapper": {"train.compile": True},
    "compile-eager-attention": {"train.compile": True, "model.attention.backend": "eager"},
    "compile-eager-attention-max-autotune": {
        "train.compile": True,
        "model.attention.backend": "eager",
    },
    "compile-compiled-autograd": {"train.compile": True},
}
INDUCTOR = {  # variant -> torch.compile(options=...): inductor's settings for its graphs
    "compile-max-autotune": {"max_autotune": True},
    "compile-cpp-wrapper": {"cpp_wrapper": True},
    "compile-eager-attention-max-autotune": {"max_autotune": True},
}


def backward_context(variant: str) -> contextlib.AbstractContextManager:
    """Compiled autograd for ``compile-compiled-autograd`` (its forward and backward under
    it, as torch asks), nothing for the other variants."""
    if variant != "compile-compiled-autograd":
        return contextlib.nullcontext()
    from torch._dynamo import compiled_autograd

    return compiled_autograd._enable(torch.compile)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--preset", default="demo")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--variants", nargs="+", default=["preset", "compile", "bf16", "muon"],
                    choices=list(OVERRIDES))  # fmt: skip
    args = ap.parse_args()
    setup_threads(args.threads)
    from attnlab.training.trainer import Trainer

    onednn = linear_module.ONEDNN
    runs = {}
    base = {"train.eval_every": 0, "train.time_budget": None, "train.max_steps": args.steps}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.variants:
            cfg = get_run_preset(args.preset).override({**base, **OVERRIDES[name]})
            tr = Trainer(cfg, f"{tmp}/{name}", progress=False)
            if name.endswith("input-major"):
                set_layout(tr.model, "input")
            if name in INDUCTOR:  # its own options: a plain compile's graphs would serve it
                tr.train_model = torch.compile(tr.model, options=INDUCTOR[name])
            runs[name] = (tr, [tr.optimizer], [], [])
    tc = next(iter(runs.values()))[0].tc
    for step in range(args.steps):
        for name, (tr, opts, times, losses) in runs.items():
            linear_module.ONEDNN = onednn and not name.endswith("mkl")
            t = time.perf_counter()
            lr = lr_at(step, tr.tc, args.steps)
            for opt in opts:
                set_lr(opt, lr)
            keys = tr.task.sample(tc.batch_size, tr.data_generator)
            batch = tr.task.batch(keys, tr.device)
            with backward_context(name):
                with autocast_context(tr.device, tr.autocast_dtype):
                    out = tr.task.step(tr.train_model, batch)
                out.objective.backward()
            torch.nn.utils.clip_grad_norm_(tr.model.parameters(), tc.grad_clip)
            for opt in opts:
                opt.step()
                opt.zero_grad(set_to_none=True)
            losses.append(float(out.loss.detach()))
            times.append(time.perf_counter() - t)
    tail = max(1, args.steps // 10)
    warm = min(10, args.steps // 2)  # compile happens in the first steps
    med = {name: statistics.median(r[2][warm:]) for name, r in runs.items()}
    first = "preset" if "preset" in runs else next(iter(runs))  # what "speed" is relative to
    print(f"machine: {machine()}")
    print(f"preset {args.preset}: batch {tc.batch_size}, block {tc.block_size}, "
          f"{args.steps} steps each, interleaved")  # fmt: skip
    rows = [[name, f"{med[name] * 1e3:.1f}", f"{med[first] / med[name]:.2f}x",
             f"{sum(r[3][-tail:]) / tail:.4f}", f"{r[2][0]:.1f} s"]
            for name, r in runs.items()]  # fmt: skip
    print(table(["variant", "ms/step (median)", "speed", "train loss (last 10%)",
                 "first step"], rows))  # fmt: skip


if __name__ == "__main__":
    main()
