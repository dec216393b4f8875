"""Where the time goes: one decoded token and one training step, taken apart.

Decoding: the ~30M-parameter LLaMA-style model of vs_transformers.py (random weights, same
shapes), batch 1, float32, one token at a time after a 32-token prompt. The eager step is
profiled with torch.profiler: the self time of the matmul operators (every weight matrix),
of the attention operator, and the rest of the measured step (small operators and Python);
the compiled fixed-shape step (``generate(compile=True)``) likewise, beside it. In the
compiled step the weight products are inductor's own loops, fused with their neighbours,
so its "matmuls" are the same 33 one-vector products compiled and timed alone.

Training: one optimizer step of a run preset (default ``demo``) through attnlab's own
Trainer pieces, timed phase by phase: data (sample + batch), forward (loss), backward,
optimizer (clip + AdamW + zero_grad). CPU work is synchronous, so wall clocks split it.
The same step compiled (``train.compile``) is profiled by kind of work: the matrix
products, attention (forward and backward kernels), inductor's fused element-wise kernels
(timed one by one: ``cpp.enable_kernel_profile``), the AdamW step, and the rest (the
compiled graphs' Python wrappers, autograd, gradient clipping, the step's other Python).
A second table sets the model FLOPs of the products and of attention (mfu.py's count,
attnlab.analysis.flops_per_token) against their profiled times and the float32 matmul peak
measured before and after the profile: how fast each kind of work runs, and the MFU the step
would reach if everything else took no time.

    python benchmarks/where_time_goes.py [--steps 100] [--preset demo] [--threads 2]
        [--only decoding|training] [--kernels 0]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time

import torch
from mfu import matmul_flops
from torch.profiler import ProfilerActivity, profile

from _common import copy_bandwidth, machine, read_bandwidth, setup_threads, table
from attnlab import build_model
from attnlab.analysis import flops_per_token
from attnlab.generation import _compiled_step
from attnlab.presets import get_run_preset, llama_30m

MATMUL_OPS = {"aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::mv", "aten::addmv"}
MATMUL_OPS |= {"attnlab::onednn_mm", "mkldnn::_linear_pointwise"}  # attnlab's float32 products
ATTENTION_OPS = {
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
    "aten::_scaled_dot_product_attention_math",
    "aten::_softmax",
}


def decode_breakdown(steps: int) -> None:
    torch.manual_seed(0)
    model = build_model(llama_30m()).eval()
    prompt = torch.randint(0, model.cfg.vocab_size, (1, 32))
    nxt = torch.tensor([[1]])
    weights = sum(p.nbytes for p in model.parameters()) - model.tok_emb.weight.nbytes
    twin = copy.deepcopy(model)  # compiling re-stores its weights row-major; model stays
    compiled = _compiled_step(twin)
    with torch.inference_mode():
        eager_cache = model.new_cache(1, 32 + 3 * steps + 16)
        static_cache = twin.new_cache(1, 32 + 3 * steps + 16, static=True)
        model(prompt, cache=eager_cache, last_only=True)
        twin(prompt, cache=static_cache, last_only=True)
        t = time.perf_counter()
        compiled(twin, nxt, None, static_cache)  # compiles (or loads inductor's disk cache)
        compile_s = time.perf_counter() - t
        linears = [m for m in twin.modules() if isinstance(m, torch.nn.Linear)]
        vectors = [torch.randn(1, 1, m.in_features) for m in linears]
        products = torch.compile(
            lambda xs: [m(x) for m, x in zip(linears, xs)], fullgraph=True, dynamic=False
        )
        products(vectors)
        eager_ms, compiled_ms, products_ms = [], [], []
        for _ in range(steps):  # interleaved
            t = time.perf_counter()
            model(nxt, cache=eager_cache, last_only=True)
            eager_ms.append((time.perf_counter() - t) * 1e3)
            t = time.perf_counter()
            compiled(twin, nxt, None, static_cache, skip_guards=True)  # as generate() does
            compiled_ms.append((time.perf_counter() - t) * 1e3)
            t = time.perf_counter()
            products(vectors)
            products_ms.append((time.perf_counter() - t) * 1e3)

        def parts(step, cache, median_ms, matmul_ms=None):
            """(matmul, attention, other) ms of one step: profiled self times, scaled to
            the unprofiled median (the profiler's own overhead spread in proportion);
            ``matmul_ms`` replaces the profiled matmul time where given."""
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                t = time.perf_counter()
                for _ in range(steps):
                    step(cache)
                profiled_ms = (time.perf_counter() - t) * 1e3 / steps
            self_ms = {"matmul": 0.0, "attention": 0.0}
            for ev in prof.key_averages():
                if ev.key in MATMUL_OPS:
                    self_ms["matmul"] += ev.self_cpu_time_total / 1e3 / steps
                elif ev.key in ATTENTION_OPS:
                    self_ms["attention"] += ev.self_cpu_time_total / 1e3 / steps
            scale = median_ms / profiled_ms
            matmul, attention = self_ms["matmul"] * scale, self_ms["attention"] * scale
            if matmul_ms is not None:
                matmul = matmul_ms
            return matmul, attention, median_ms - matmul - attention

        eager, compiled_med = statistics.median(eager_ms), statistics.median(compiled_ms)
        e_parts = parts(lambda c: model(nxt, cache=c, last_only=True), eager_cache, eager)
        alone = statistics.median(products_ms)

        def compiled_step(c):  # as generate() calls it after its first, guarded step
            return compiled(twin, nxt, None, c, skip_guards=True)

        c_parts = parts(compiled_step, static_cache, compiled_med, alone)
    bandwidth, read = copy_bandwidth(), read_bandwidth()
    print(
        f"decoding: LLaMA-style 30M (d_model 512, 8 layers, GQA 8/2, vocab 8192), float32, "
        f"batch 1; weights read per token {weights / 1e6:.0f} MB; copy bandwidth "
        f"{bandwidth / 1e9:.1f} GB/s (bound {weights / bandwidth * 1e3:.2f} ms/token), "
        f"reading alone {read / 1e9:.1f} GB/s ({weights / read * 1e3:.2f} ms/token); "
        f"compile {compile_s:.0f} s"
    )

    def cells(value, total):
        return [f"{value:.2f}", f"{value / total:.0%}"]

    names = ["matmuls (weights)", "attention", "everything else (small ops, Python)"]
    rows = [[name, *cells(e, eager), *cells(c, compiled_med)]
            for name, e, c in zip(names, e_parts, c_parts)]  # fmt: skip
    rows.append(["step (median)", f"{eager:.2f}", f"{1e3 / eager:.0f} tok/s",
                 f"{compiled_med:.2f}", f"{1e3 / compiled_med:.0f} tok/s"])  # fmt: skip
    rows.append(["weights read by the matmuls", f"{weights / (e_parts[0] / 1e3) / 1e9:.1f} GB/s",
                 "", f"{weights / (c_parts[0] / 1e3) / 1e9:.1f} GB/s", ""])  # fmt: skip
    headers = ["per decoded token", "eager ms", "share", "compiled ms", "share"]
    print(table(headers, rows))


def training_breakdown(preset: str, steps: int) -> None:
    from attnlab.training.optim import set_lr
    from attnlab.training.trainer import Trainer

    cfg = get_run_preset(preset).override({"train.eval_every": 0, "train.time_budget": None})
    with tempfile.TemporaryDirectory() as tmp:
        tr = Trainer(cfg, tmp, progress=False)
    tc, model, opt = tr.tc, tr.model, tr.optimizer
    set_lr(opt, tc.lr)
    phases: dict[str, list[float]] = {k: [] for k in ("data", "forward", "backward", "optimizer")}
    for i in range(steps + 5):
        t0 = time.perf_counter()
        keys = tr.task.sample(tc.batch_size, tr.data_generator)
        batch = tr.task.batch(keys, tr.device)
        t1 = time.perf_counter()
        out = tr.task.step(tr.train_model, batch)
        t2 = time.perf_counter()
        out.objective.backward()
        t3 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        t4 = time.perf_counter()
        if i >= 5:  # warm-up steps skipped
            for name, a, b in (("data", t0, t1), ("forward", t1, t2), ("backward", t2, t3),
                               ("optimizer", t3, t4)):  # fmt: skip
                phases[name].append((b - a) * 1e3)
    m = cfg.model
    print(
        f"\ntraining: preset {preset} ({m.n_layers}x{m.d_model}, block "
        f"{tr.task.block_size}, batch "
        f"{tc.batch_size}, {tc.dtype}), median of {steps} steps"
    )
    med = {k: statistics.median(v) for k, v in phases.items()}
    print_shares("per training step", "step", med, tokens_per_step(tr, micro_steps=1))


def tokens_per_step(tr, micro_steps: int | None = None) -> int:
    """Tokens one timed step trains on: batch x the task's block x micro-steps (the run's
    gradient accumulation by default)."""
    micro_steps = tr.tc.grad_accum if micro_steps is None else micro_steps
    return tr.tc.batch_size * tr.task.block_size * micro_steps


def print_shares(what: str, step: str, ms: dict[str, float], tokens: int) -> None:
    """A table of ms per part, each part's share, and the whole step's ms and tokens/s."""
    total = sum(ms.values())
    rows = [[k, f"{v:.2f}", f"{v / total:.0%}"] for k, v in ms.items()]
    rows.append([step, f"{total:.2f}", f"{tokens / total * 1e3:,.0f} tok/s"])
    print(table([what, "ms", "share"], rows))


def compiled_training_breakdown(preset: str, steps: int, kernels: int = 0) -> None:
    from attnlab.training.trainer import Trainer, _StopRequest

    torch._inductor.config.cpp.enable_kernel_profile = True  # each fused kernel an event
    cfg = get_run_preset(preset).override(
        {"train.eval_every": 0, "train.time_budget": None, "train.compile": True,
         "train.max_steps": 2 * steps + 20}
    )  # fmt: skip
    stop, never = _StopRequest(), lambda: False
    with tempfile.TemporaryDirectory() as tmp:
        tr = Trainer(cfg, tmp, progress=False)
        for _ in range(15):  # compiles in the first steps
            tr._train_step(stop, never)
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            tr._train_step(stop, never)
            times.append(time.perf_counter() - t)
        profiled = min(steps, 20)
        peak = matmul_flops(torch.float32)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(profiled):
                tr._train_step(stop, never)
        peak = max(peak, matmul_flops(torch.float32))
    kinds = {k: 0.0 for k in ("matmuls", "attention", "fused element-wise", "AdamW", "rest")}
    fused: list[tuple[float, int, str]] = []  # ms per step, calls per step, kernel
    for e in prof.key_averages():
        if e.key in MATMUL_OPS:
            kind = "matmuls"
        elif e.key in ATTENTION_OPS:
            kind = "attention"
        elif e.key.startswith("graph_") and "cpp_fused" in e.key:
            kind = "fused element-wise"
            fused.append((e.self_cpu_time_total / 1e3 / profiled, e.count // profiled, e.key))
        elif e.key in ("aten::_fused_adamw_", "Optimizer.step#AdamW.step"):
            kind = "AdamW"
        else:
            kind = "rest"
        kinds[kind] += e.self_cpu_time_total / 1e3 / profiled
    print(
        f"\ntraining, compiled: preset {preset}, profile of {profiled} steps (self times); "
        f"median step {statistics.median(times) * 1e3:.1f} ms over {steps} steps"
    )
    tokens = tokens_per_step(tr)
    print_shares("per compiled training step", "step (profiled)", kinds, tokens)
    print_rates(tr, kinds, tokens, peak)
    if kernels:
        rows = [[f"{ms:.2f}", calls, name[:110]] for ms, calls, name in sorted(fused)[::-1]]
        print(table(["ms per step", "calls", "fused kernel"], rows[:kernels]))


def print_rates(tr, ms: dict[str, float], tokens: int, peak: float) -> None:
    """Model FLOPs per step of the products and of attention (training: 3x the forward's),
    each against its profiled ms and the float32 matmul peak ``peak`` (FLOP/s)."""
    if tr.cfg.model.arch != "decoder":
        return  # flops_per_token counts decoder LMs
    per_token = flops_per_token(tr.cfg.model, tr.task.block_size)
    gflop = {k: 3 * per_token[k] * tokens / 1e9 for k in ("dense", "attention")}
    total_ms = sum(ms.values())
    rows = []
    for name, flop, part_ms in (
        ("matmuls", gflop["dense"], ms["matmuls"]),
        ("attention", gflop["attention"], ms["attention"]),
        ("step (profiled)", sum(gflop.values()), total_ms),
        ("matmuls + attention alone", sum(gflop.values()), ms["matmuls"] + ms["attention"]),
    ):
        rate = flop / part_ms * 1e3  # GFLOP/s
        rows.append(
            [name, f"{flop:.2f}", f"{part_ms:.2f}", f"{rate:.1f}", f"{rate / peak * 1e9:.0%}"]
        )
    print(f"model FLOPs per step; float32 matmul peak {peak / 1e9:.1f} GFLOP/s around the profile")
    print(table(["work", "GFLOP", "ms", "GFLOP/s", "of peak"], rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--preset", default="demo")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--only", choices=["decoding", "training"], default=None)
    ap.add_argument("--kernels", type=int, default=0, help="list the N slowest fused kernels")
    args = ap.parse_args()
    setup_threads(args.threads)
    print(f"machine: {machine()}")
    if args.only != "training":
        decode_breakdown(args.steps)
    if args.only != "decoding":
        training_breakdown(args.preset, args.steps)
        compiled_training_breakdown(args.preset, args.steps, args.kernels)


if __name__ == "__main__":
    main()
