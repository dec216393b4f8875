"""Batched decoding and prefill throughput, attnlab vs transformers, on the ~30M LLaMA-style
model of vs_transformers.py (same weights, float32, greedy, same threads).

Decoding: batch 1, 8 and 32 prompts of 32 tokens, 64 new tokens each: generated tokens/s
(all rows). Prefill: one forward pass over a 512- and a 2048-token prompt, keeping the last
position's logits (what generation needs): prompt tokens/s. attnlab decodes with its
default eager path and with its compiled step (``generate(compile=True)``, compiled once
per batch size before timing; ``--no-compile`` skips it); transformers with ``generate``
(dynamic cache) and a plain forward (``logits_to_keep=1``) for prefill. The tokens must
agree.

    python benchmarks/throughput.py [--repeats 3] [--threads 2] [--no-compile]
        [--batches 1 8 32] [--prefill 512 2048] [--rows-matmul-max N]
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from vs_transformers import build_pair

import attnlab.nn.linear as linear_module
from _common import machine, setup_threads, table


def best_time(fns: dict, repeats: int) -> dict[str, float]:
    best: dict[str, float] = {}
    for _ in range(repeats):  # interleaved, best of repeats
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prefill", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled decode step")
    ap.add_argument(
        "--rows-matmul-max",
        type=int,
        default=None,
        help="compiled step: products of up to this many vectors as sums over the weight rows, "
        "more by oneDNN (default: attnlab.nn.linear.ROWS_MATMUL_MAX)",
    )
    args = ap.parse_args()
    setup_threads(args.threads)
    if args.rows_matmul_max is not None:
        linear_module.ROWS_MATMUL_MAX = args.rows_matmul_max
    hf, ours = build_pair("30m", torch.float32, "cpu")
    ours_compiled = copy.deepcopy(ours)  # compiling re-stores its weights row-major; ours stays
    vocab, n = hf.config.vocab_size, args.new_tokens
    print(f"model: LLaMA-style 30.9M, float32, greedy; machine: {machine()}")
    rows = []
    for b in args.batches:
        prompt = torch.randint(0, vocab, (b, 32))

        def run_hf(prompt=prompt):
            with torch.inference_mode():
                out = hf.generate(  # (an explicit mask: see vs_transformers.run_hf)
                    prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n,
                    min_new_tokens=n, do_sample=False, pad_token_id=0
                )  # fmt: skip
            return out[:, prompt.shape[1] :].tolist()

        def run_ours(prompt=prompt):
            return ours.generate(prompt, n)

        fns = {"hf": run_hf, "ours": run_ours}
        if not args.no_compile:
            fns["compiled"] = lambda prompt=prompt: ours_compiled.generate(prompt, n, compile=True)
        tokens = {name: fn() for name, fn in fns.items()}  # also compiles, once per batch
        same = all(t == tokens["hf"] for t in tokens.values())
        best = best_time(fns, args.repeats)
        compiled = ["-", "-"]
        if "compiled" in best:
            compiled = [f"{b * n / best['compiled']:,.0f}", f"{best['hf'] / best['compiled']:.2f}x"]
        rows.append([f"decode, batch {b}", f"{b * n / best['ours']:,.0f}",
                     f"{b * n / best['hf']:,.0f}", f"{best['hf'] / best['ours']:.2f}x",
                     *compiled,
                     "yes" if same else "NO"])  # fmt: skip
    for t in args.prefill:
        prompt = torch.randint(0, vocab, (1, t))

        def pre_hf(prompt=prompt):
            with torch.inference_mode():
                return hf(prompt, logits_to_keep=1).logits[:, -1]

        def pre_ours(prompt=prompt):
            with torch.inference_mode():
                return ours(prompt, last_only=True).logits[:, -1]

        same = bool(pre_hf().argmax(-1).eq(pre_ours().argmax(-1)).all())
        best = best_time({"hf": pre_hf, "ours": pre_ours}, args.repeats)
        rows.append([f"prefill, {t} tokens", f"{t / best['ours']:,.0f}",
                     f"{t / best['hf']:,.0f}", f"{best['hf'] / best['ours']:.2f}x", "-", "-",
                     "yes" if same else "NO"])  # fmt: skip
    headers = ["workload", "attnlab tok/s", "transformers tok/s", "speed-up",
               "attnlab compiled tok/s", "compiled speed-up", "same tokens"]  # fmt: skip
    print(table(headers, rows))
    print(f"(best of {args.repeats} interleaved repeats; decode: 32-token prompts, {n} new)")


if __name__ == "__main__":
    main()
