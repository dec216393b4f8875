"""Long context: three tables.

1. Generating 10x max_seq_len tokens: ``overflow="roll"`` (rolling cache, nothing
   re-encoded) against ``"slide"`` (re-encode the last half when the context is full), for
   a dense model and a sliding-window one: cache bytes and tokens/s.
2. Decode speed of linear attention (constant-size state) against softmax attention (a KV
   cache read in full each step) after contexts of growing length.
3. Transformer-XL evaluation of a stream with memory (each segment once) against
   recomputing each segment's context (memory length + segment tokens) from scratch.

    python benchmarks/long_context.py [--threads 2] [--quick]

Timings on a shared machine are noisy: best of a few repeats where cheap.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

from _common import machine, setup_threads, table
from attnlab import build_model
from attnlab.models.xl import XLConfig, xl_loss_sums
from attnlab.presets import llama_style


def small(max_seq_len: int, **attention) -> torch.nn.Module:
    cfg = llama_style(
        vocab_size=256, max_seq_len=max_seq_len, d_model=128, n_layers=4, n_heads=4,
        n_kv_heads=2, ffn_hidden=352,
    )  # fmt: skip
    for key, value in attention.items():
        setattr(cfg.attention, key, value)
    torch.manual_seed(0)
    return build_model(cfg).eval()


def _recording(new_cache, made: list):
    """new_cache that also appends each cache it makes to ``made``."""

    def wrapped(*args, **kwargs):
        made.append(new_cache(*args, **kwargs))
        return made[-1]

    return wrapped


def generation(limit: int) -> list[list]:
    rows = []
    window = limit // 4
    for name, kw in (("dense", {}), (f"window {window}", {"sliding_window": window})):
        model = small(limit, **kw)
        for overflow in ("slide", "roll"):
            made = []
            new_cache = model.new_cache
            model.new_cache = _recording(new_cache, made)
            n = 10 * limit
            start = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "slide" warns that the context will slide
                out = model.generate(list(range(1, 17)), n, overflow=overflow)
            seconds = time.perf_counter() - start
            assert len(out) == n
            rows.append([name, overflow, n, made[0].nbytes, f"{n / seconds:,.0f}"])
            model.new_cache = new_cache
    return rows


@torch.inference_mode()
def decode_speed(lengths: list[int], steps: int = 32) -> list[list]:
    rows = []
    for kind in ("mha", "linear"):
        model = small(max(lengths) + steps, kind=kind)
        for length in lengths:
            cache = model.new_cache(1, length + steps)
            model(torch.randint(0, 256, (1, length)), cache=cache)  # prefill
            token = torch.randint(0, 256, (1, 1))
            start = time.perf_counter()
            for _ in range(steps):
                model(token, cache=cache, last_only=True)
            seconds = time.perf_counter() - start
            rows.append([kind, length, cache.nbytes, f"{steps / seconds:,.0f}"])
    return rows


@torch.inference_mode()
def xl_eval(n_tokens: int, segment: int, mem_len: int) -> list[list]:
    torch.manual_seed(0)
    cfg = XLConfig(vocab_size=256, d_model=128, n_layers=4, mem_len=mem_len)
    model = build_model(cfg).eval()
    tokens = torch.randint(0, 256, (n_tokens,))
    start = time.perf_counter()
    xl_loss_sums(model, tokens, segment)
    with_memory = time.perf_counter() - start
    # recompute: each segment scored after re-running its mem_len tokens of context
    start = time.perf_counter()
    for s in range(0, n_tokens - 1, segment):
        lo, hi = max(0, s - mem_len), min(s + segment, n_tokens - 1)
        model(tokens[None, lo:hi], targets=tokens[None, lo + 1 : hi + 1])
    recompute = time.perf_counter() - start
    return [
        ["memory", n_tokens, segment, mem_len, f"{n_tokens / with_memory:,.0f}", "1.00"],
        [
            "recompute",
            n_tokens,
            segment,
            mem_len,
            f"{n_tokens / recompute:,.0f}",
            f"{recompute / with_memory:.2f}",
        ],
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run)")
    args = ap.parse_args()
    setup_threads(args.threads)
    print(machine())
    limit = 32 if args.quick else 128
    print(f"\n1. generate 10 x max_seq_len={limit} tokens (greedy, batch 1)")
    headers = ["model", "overflow", "tokens", "cache bytes", "tokens/s"]
    print(table(headers, generation(limit)))
    lengths = [64, 256] if args.quick else [256, 1024, 4096]
    print("\n2. decode steps/s after a context of L tokens (batch 1)")
    print(table(["attention", "L", "cache bytes", "steps/s"], decode_speed(lengths)))
    n = 512 if args.quick else 4096
    print("\n3. Transformer-XL evaluation of a stream: memory vs recompute")
    headers = ["mode", "tokens", "segment", "mem_len", "tokens/s", "time ratio"]
    print(table(headers, xl_eval(n, 64, 64 if args.quick else 192)))


if __name__ == "__main__":
    main()
