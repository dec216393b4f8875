"""Greedy decoding with the eager step vs the compiled fixed-shape step (torch.compile of one
decode step over a static cache, as gpt-fast does), same weights, same tokens.

On CPU, inductor fuses the small per-layer operations (norms, RoPE, residuals, softmax) that
dominate the step of a small model; on a GPU the same path also removes kernel launches
(add ``--mode reduce-overhead`` for CUDA graphs).

    python benchmarks/compile_decode.py [--new-tokens 256] [--threads 2] [--device cpu]
"""

from __future__ import annotations

import argparse
import time

import torch

from _common import machine, setup_threads, table
from attnlab import build_model
from attnlab.presets import llama_style


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    setup_threads(args.threads)
    torch.manual_seed(0)
    cfg = llama_style(
        vocab_size=4096,
        max_seq_len=1024,
        d_model=256,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden=704,
    )
    model = build_model(cfg).eval().to(args.device)
    prompt = torch.randint(0, cfg.vocab_size, (args.prompt,)).tolist()
    n = args.new_tokens
    print(
        f"model: LLaMA-style d_model 256, 4 layers, {model.num_parameters() / 1e6:.1f}M "
        f"parameters, float32, batch 1, {args.prompt}-token prompt, {n} new tokens, greedy"
    )
    print(f"machine: {machine()}, device {args.device}")
    t = time.perf_counter()
    model.generate(prompt, 4, compile=True)  # compiles the decode step once
    compile_s = time.perf_counter() - t
    model.generate(prompt, 4)  # warm up
    best, outs = {}, {}
    for _ in range(args.repeats):  # interleaved, best of each
        for compiled in (False, True):
            t = time.perf_counter()
            outs[compiled] = model.generate(prompt, n, compile=compiled)
            rate = n / (time.perf_counter() - t)
            best[compiled] = max(best.get(compiled, 0.0), rate)
    same = outs[True] == outs[False]
    rows = [
        ["eager", f"{best[False]:.1f}", "1.00x", "-"],
        [
            "compiled (static cache)",
            f"{best[True]:.1f}",
            f"{best[True] / best[False]:.2f}x",
            f"{compile_s:.0f} s",
        ],
    ]
    print(table(["decode step", "tokens/s", "speed vs eager", "compile time"], rows))
    print(f"(best of {args.repeats} interleaved runs; tokens identical: {'yes' if same else 'NO'})")


if __name__ == "__main__":
    main()
