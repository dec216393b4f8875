"""Greedy decoding with the eager step vs the compiled fixed-shape step (torch.compile of one
decode step over a static cache, as gpt-fast does), same weights, same tokens.

On CPU, inductor fuses the small per-layer operations (norms, RoPE, residuals, softmax) that
dominate the step of a small model; on a GPU the same path also removes kernel launches.
The compiled step re-stores the weights row-major and writes each one-vector product as a
sum over the rows, which inductor turns into its own loops; within one ``generate`` call only
its first step goes through dynamo and its guards, the rest call the code that ran directly
(the row "guards every step" goes through dynamo at every step, as ``stream()`` does, with
the same compiled graph). Two more rows compile the other ways of doing the products, on
copies of the model: attnlab's two-thread product of the input-major weights as one opaque
operator (``torch.ops.attnlab.split_vecmat``), and plain ``F.linear`` calls (MKL).

A second table times single steps, one step of each row in turn, a few thousand times: the
machine's memory bandwidth drifts by tens of percent within seconds, and steps taken side by
side meet the same bandwidth, so the median of their paired ratios separates differences of
a few percent that whole runs cannot. (Two identical copies of one model differed by up to
2% there: where each copy's weights lie in memory matters at that level.)

    python benchmarks/compile_decode.py [--model 5m|30m] [--new-tokens 256] [--threads 2]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from unittest import mock

import torch
import torch.nn.functional as F

from _common import check_device, machine, setup_threads, table
from attnlab import build_model, generation
from attnlab.nn.linear import Linear
from attnlab.presets import llama_30m, llama_style


class PlainLinear(Linear):
    """attnlab's Linear without its one-vector products: every product is F.linear."""

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


def compiled_keeping_layout(model):
    """The compiled step of ``model`` with its weights left input-major (so the products
    are the opaque split operator)."""
    with mock.patch.object(generation, "set_layout", lambda model, layout: 0):
        return generation._compiled_step(model)


def model_config(name: str):
    if name == "30m":  # d_model 512, 8 layers, GQA 8/2, vocab 8192 (vs_transformers.py's shape)
        return llama_30m()
    return llama_style(vocab_size=4096, max_seq_len=1024, d_model=256, n_layers=4, n_heads=4,
                       n_kv_heads=2, ffn_hidden=704)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", choices=["5m", "30m"], default="5m")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--paired-steps", type=int, default=2000, help="0: skip the step table")
    args = ap.parse_args()
    check_device(ap, args.device)
    setup_threads(args.threads)
    torch.manual_seed(0)
    cfg = model_config(args.model)
    model = build_model(cfg).eval().to(args.device)
    operator = copy.deepcopy(model)
    compiled_keeping_layout(operator)  # made (not yet compiled) with the layout kept
    plain = copy.deepcopy(model)
    for m in plain.modules():
        if type(m) is Linear:
            m.__class__ = PlainLinear
    eager = copy.deepcopy(model)  # the model itself is re-stored by its compiled step
    prompt = torch.randint(0, cfg.vocab_size, (args.prompt,)).tolist()
    n = args.new_tokens
    print(
        f"model: LLaMA-style d_model {cfg.d_model}, {cfg.n_layers} layers, "
        f"{model.num_parameters() / 1e6:.1f}M parameters, float32, batch 1, "
        f"{args.prompt}-token prompt, {n} new tokens, greedy"
    )
    print(f"machine: {machine()}, device {args.device}")
    runs = {
        "eager": lambda: eager.generate(prompt, n),
        "compiled (static cache)": lambda: model.generate(prompt, n, compile=True),
        # the same compiled step, its guards checked at every step (as stream() does)
        "compiled, guards every step": lambda: list(
            generation.stream(model, prompt, n, compile=True)
        ),
        "compiled, input-major operator": lambda: operator.generate(prompt, n, compile=True),
        "compiled, F.linear products": lambda: plain.generate(prompt, n, compile=True),
    }
    compile_s, outs = {}, {}
    for name, fn in runs.items():  # compiles each step once (and warms up)
        t = time.perf_counter()
        outs[name] = fn()
        compile_s[name] = time.perf_counter() - t
    best = {}
    for _ in range(args.repeats):  # interleaved, best of each
        for name, fn in runs.items():
            t = time.perf_counter()
            assert fn() == outs[name]
            best[name] = max(best.get(name, 0.0), n / (time.perf_counter() - t))
    same = all(o == outs["eager"] for o in outs.values())
    rows = [[name, f"{best[name]:.1f}", f"{best[name] / best['eager']:.2f}x",
             "-" if name == "eager" else f"{compile_s[name]:.0f} s"] for name in runs]  # fmt: skip
    print(table(["decode step", "tokens/s", "speed vs eager", "first run (compiles)"], rows))
    print(f"(best of {args.repeats} interleaved runs; tokens identical: {'yes' if same else 'NO'})")
    if args.paired_steps:
        # (without "guards every step": interleaved, dynamo's guards for this model would
        # first rule out the other rows' compiled variants of the same function each step)
        models = {"eager": eager, "compiled (static cache)": model,
                  "compiled, input-major operator": operator,
                  "compiled, F.linear products": plain}  # fmt: skip
        cap = generation.static_capacity(args.prompt + n, cfg.max_seq_len)
        ms = step_by_step(models, torch.tensor([prompt]), cap, args.paired_steps)
        ref = ms["compiled (static cache)"]
        rows = [[name, f"{statistics.median(t) * 1e3:.3f}",
                 f"{statistics.median([b / a for a, b in zip(ref, t)]):.3f}"]
                for name, t in ms.items()]  # fmt: skip
        print(table(["decode step", "ms per step (median)", "time vs compiled (paired)"], rows))
        print(f"({args.paired_steps} steps of each, one of each in turn; static capacity {cap})")


@torch.inference_mode()
def step_by_step(models: dict, prompt: torch.Tensor, capacity: int, steps: int) -> dict:
    """Seconds of each of ``steps`` single decode steps per row, one step of every row in
    turn. Each row decodes greedily on its own cache, prefilled with ``prompt`` and
    prefilled again when full."""

    def start(name):
        m = models[name]
        eager = name == "eager"
        cache = m.new_cache(1, capacity, static=not eager)
        nxt = m(prompt, cache=cache, last_only=True).logits[:, -1].argmax(-1, keepdim=True)
        return {"cache": cache, "ids": nxt, "left": capacity - prompt.shape[1], "first": True}

    def one_step(name, state):
        m, c, ids = models[name], state["cache"], state["ids"]
        if name == "eager":
            return m(ids, cache=c, last_only=True).logits[:, -1]
        first, state["first"] = state["first"], False
        return generation._compiled_step(m)(m, ids, None, c, skip_guards=not first)

    states = {name: start(name) for name in models}
    times = {name: [] for name in models}
    names = list(models)
    for i in range(steps):
        turn = i % len(names)  # a rotation: no row always goes first, none runs twice in a row
        for name in names[turn:] + names[:turn]:
            state = states[name]
            if state["left"] == 0:
                state = states[name] = start(name)
            t = time.perf_counter()
            logits = one_step(name, state)
            times[name].append(time.perf_counter() - t)
            state["ids"], state["left"] = logits.argmax(-1, keepdim=True), state["left"] - 1
    return times


if __name__ == "__main__":
    main()
