"""Decoding speed with and without the KV cache.

Without a cache every new token re-runs the whole context (O(T^2) work for T tokens); with
the preallocated cache each step processes one token. The gap must grow with length.

    python benchmarks/decode.py [--lengths 256 1024] [--threads 2]
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
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    setup_threads(args.threads)
    torch.manual_seed(0)
    # A small LLaMA-style model: the uncached run at 1024 tokens stays within minutes.
    cfg = llama_style(
        vocab_size=4096,
        max_seq_len=2048,
        d_model=256,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden=704,
    )
    model = build_model(cfg).eval()
    prompt = torch.randint(0, cfg.vocab_size, (args.prompt,))
    print(
        f"model: LLaMA-style d_model 256, 4 layers, {model.num_parameters() / 1e6:.1f}M "
        f"parameters, float32, batch 1, {args.prompt}-token prompt, greedy"
    )
    print(f"machine: {machine()}")
    model.generate(prompt, 8)  # warm up
    rows = []
    for n in args.lengths:
        speed, outs = {}, {}
        for use_cache in (True, False):
            t = time.perf_counter()
            outs[use_cache] = model.generate(prompt, n, use_cache=use_cache)
            speed[use_cache] = n / (time.perf_counter() - t)
        assert outs[True] == outs[False], "cached and uncached decoding disagree"
        rows.append(
            [n, f"{speed[True]:.1f}", f"{speed[False]:.1f}", f"{speed[True] / speed[False]:.1f}x"]
        )
    print(table(["new tokens", "with cache tok/s", "without cache tok/s", "cache speed-up"], rows))
    print("(tokens identical with and without the cache)")


if __name__ == "__main__":
    main()
