"""attnlab vs Hugging Face transformers: greedy decoding on the same LLaMA-style model.

Both run the identical ~30M-parameter model (d_model 512, 8 layers, 8 heads, 2 KV heads;
transformers' weights copied into attnlab through attnlab.interop), float32, CPU, batch 1,
a 32-token prompt, 256 new tokens, the same thread count. The tokens must be identical.
Also prints the fraction of the memory-bandwidth limit reached: bytes of weights and KV
cache read per token x tokens/s / bandwidth of a large tensor copy (read + write bytes), and
the same against the rate of only reading a large tensor (decoding only reads). A shared
machine's bandwidth drifts within minutes, so both are measured before and after every
round of repeats, and each run is set against the better of the two around it; the table
shows the median over the repeats and the lowest and highest.

Rows: attnlab's default eager decoding and its compiled fixed-shape step
(``generate(compile=True)``; compile time printed, not counted), transformers' default
and static caches.

    python benchmarks/vs_transformers.py [--new-tokens 256] [--repeats 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from _common import copy_bandwidth, machine, read_bandwidth, setup_threads, table  # noqa: E402
from attnlab.interop import load_hf  # noqa: E402


def bytes_per_token(model, prompt_len: int, new_tokens: int) -> float:
    """Weights read per decoding step (every matrix once; one row of the input embedding)
    plus the KV cache read, averaged over the steps."""
    cfg = model.cfg
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if not cfg.tie_embeddings:  # the input embedding is a lookup of one row
        weights -= model.tok_emb.weight.numel() * 4 - cfg.d_model * 4
    per_slot = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 4  # k and v, float32
    mean_len = prompt_len + (new_tokens - 1) / 2
    return weights + per_slot * mean_len


def build_pair():
    """transformers' LlamaForCausalLM (random weights, seeded) and the same weights loaded
    into attnlab, both in eval mode."""
    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    hf_cfg = LlamaConfig(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    hf = LlamaForCausalLM(hf_cfg).eval()
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        ours = load_hf(tmp).eval()
    return hf, ours


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled row")
    args = ap.parse_args()
    threads = setup_threads(args.threads)
    hf, ours = build_pair()
    hf_cfg = hf.config
    n_params = ours.num_parameters()
    prompt = torch.randint(0, hf_cfg.vocab_size, (1, args.prompt))
    n = args.new_tokens

    def run_hf(cache: str | None):
        kw = {"cache_implementation": cache} if cache else {}
        with torch.inference_mode():
            out = hf.generate(
                prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, **kw
            )
        return out[0, args.prompt :].tolist()

    runners = {
        "attnlab (eager, default)": lambda: ours.generate(prompt[0], n),
        "transformers": lambda: run_hf(None),
        "transformers (static cache)": lambda: run_hf("static"),
    }
    compile_s = None
    if not args.no_compile:  # the compiled fixed-shape step: compile once, then time
        # a copy: compiling re-stores its weights row-major, the eager row keeps its layout
        compiled = copy.deepcopy(ours)
        t = time.perf_counter()
        compiled.generate(prompt[0], 4, compile=True)
        compile_s = time.perf_counter() - t
        runners["attnlab (compiled step)"] = lambda: compiled.generate(prompt[0], n, compile=True)
    tokens, times = {}, {}
    for name, fn in runners.items():  # warm up, and check the tokens
        tokens[name] = fn()
    bandwidths = [copy_bandwidth(repeats=3)]
    reads = [read_bandwidth(repeats=3)]
    for _ in range(args.repeats):  # interleaved, the bandwidths between rounds
        for name, fn in runners.items():
            t = time.perf_counter()
            fn()
            times.setdefault(name, []).append(time.perf_counter() - t)
        bandwidths.append(copy_bandwidth(repeats=3))
        reads.append(read_bandwidth(repeats=3))
    best = {name: min(ts) for name, ts in times.items()}
    median = {name: statistics.median(ts) for name, ts in times.items()}
    per_token = bytes_per_token(ours, args.prompt, n)

    def shares(name: str, measured: list[float]) -> str:
        """Median (lowest-highest) share of the bound, each run against its round's."""
        around = [max(a, b) for a, b in zip(measured, measured[1:])]
        s = [per_token * n / t / bw for t, bw in zip(times[name], around)]
        return f"{statistics.median(s):.0%} ({min(s):.0%}-{max(s):.0%})"

    print(
        f"model: LLaMA-style, {n_params / 1e6:.1f}M parameters, float32, batch 1, "
        f"{args.prompt}-token prompt, {n} new tokens, greedy"
    )
    print(f"machine: {machine()}; threads: {threads}")
    print(
        f"memory bandwidth over the run: large tensor copy {min(bandwidths) / 1e9:.1f}-"
        f"{max(bandwidths) / 1e9:.1f} GB/s, reading alone {min(reads) / 1e9:.1f}-"
        f"{max(reads) / 1e9:.1f} GB/s; bytes read per token: {per_token / 1e6:.1f} MB"
    )
    if compile_s is not None:
        print(f"compile time of the decode step: {compile_s:.1f} s (once per model and batch)")
    rows = []
    for name in runners:
        tps = n / best[name]
        same = "yes" if tokens[name] == tokens["transformers"] else "NO"
        rows.append(
            [
                name,
                f"{tps:.1f}",
                f"{n / median[name]:.1f}",
                f"{best['transformers'] / best[name]:.2f}x",
                f"{median['transformers'] / median[name]:.2f}x",
                shares(name, bandwidths),
                shares(name, reads),
                same,
            ]
        )
    headers = ["implementation", "tok/s (best)", "tok/s (median)", "vs transformers (best)",
               "vs transformers (median)", "of copy bandwidth bound", "of read bound",
               "same tokens"]  # fmt: skip
    print(table(headers, rows))
    print(
        f"(best and median of {args.repeats} interleaved repeats; bounds: median and range "
        "over the repeats)"
    )


if __name__ == "__main__":
    main()
