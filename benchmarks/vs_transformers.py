"""attnlab vs Hugging Face transformers: greedy decoding on the same LLaMA-style model.

Both run the identical model (transformers' weights copied into attnlab through
attnlab.interop), batch 1, a 32-token prompt, 256 new tokens, greedy. ``--size 30m``
(default): ~30M parameters (d_model 512, 8 layers, 8 heads, 2 KV heads), float32, on the
CPU with the same thread count; the tokens must be identical. ``--size 1b``: TinyLlama's
1.1B shape (d_model 2048, 22 layers, 32 heads, 4 KV heads), meant for a GPU in bfloat16
(``--device cuda --dtype bfloat16``); there two correct bf16 implementations round
differently, so "same tokens" counts how many of the first tokens agree.

Also prints the fraction of the memory-bandwidth limit reached: bytes of weights and KV
cache read per token x tokens/s / bandwidth of a large tensor copy (read + write bytes), and
the same against the rate of only reading a large tensor (decoding only reads). A shared
machine's bandwidth drifts within minutes, so both are measured before and after every
round of repeats, and each run is set against the better of the two around it; the table
shows the median over the repeats and the lowest and highest.

Rows: attnlab's default eager decoding and its compiled fixed-shape step
(``generate(compile=True)``, on CUDA replayed as a CUDA graph, and on CUDA also without the
graph), transformers' default and static caches (on CUDA transformers compiles the
static-cache forward itself, with CUDA graphs). The compiled rows' first calls, which
compile, are printed, not timed.

    python benchmarks/vs_transformers.py [--new-tokens 256] [--repeats 5] [--threads 2]
    python benchmarks/vs_transformers.py --device cuda --dtype bfloat16 --size 1b
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

import attnlab.generation  # noqa: E402
from _common import (  # noqa: E402
    check_device,
    copy_bandwidth,
    machine,
    read_bandwidth,
    setup_threads,
    sync,
    table,
)
from attnlab.interop import load_hf  # noqa: E402

SIZES = {  # LlamaConfig fields
    "30m": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                num_attention_heads=8, num_key_value_heads=2, vocab_size=8192),
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
               num_attention_heads=32, num_key_value_heads=4, vocab_size=32000),
}  # fmt: skip


def bytes_per_token(model, prompt_len: int, new_tokens: int) -> float:
    """Weights read per decoding step (every matrix once; one row of the input embedding)
    plus the KV cache read, averaged over the steps."""
    cfg = model.cfg
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    size = model.tok_emb.weight.element_size()
    if not cfg.tie_embeddings:  # the input embedding is a lookup of one row
        weights -= model.tok_emb.weight.numel() * size - cfg.d_model * size
    per_slot = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * size  # k and v
    mean_len = prompt_len + (new_tokens - 1) / 2
    return weights + per_slot * mean_len


def build_pair(size: str, dtype: torch.dtype, device: str):
    """transformers' LlamaForCausalLM (random weights, seeded) and the same weights loaded
    into attnlab, both in eval mode, in ``dtype`` on ``device``."""
    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    hf_cfg = LlamaConfig(
        **SIZES[size],
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    with torch.device(device):  # a 1B model initialises much faster on a GPU
        hf = LlamaForCausalLM(hf_cfg)
    hf = hf.to(dtype).eval()
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        ours = load_hf(tmp, dtype=dtype, device=device).eval()
    return hf, ours


def agreement(tokens: list[int], reference: list[int]) -> str:
    """'yes' when identical, else how many of the first tokens agree."""
    if tokens == reference:
        return "yes"
    same = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), len(tokens))
    return f"first {same} of {len(reference)}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--size", choices=list(SIZES), default="30m")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled rows")
    args = ap.parse_args()
    check_device(ap, args.device)
    threads = setup_threads(args.threads)
    device, dtype = args.device, getattr(torch, args.dtype)
    cuda = torch.device(device).type == "cuda"
    t = time.perf_counter()
    hf, ours = build_pair(args.size, dtype, device)
    print(f"built both models: {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
    hf_cfg = hf.config
    n_params = ours.num_parameters()
    prompt = torch.randint(0, hf_cfg.vocab_size, (1, args.prompt), device=device)
    n = args.new_tokens

    def run_hf(cache: str | None):
        kw = {"cache_implementation": cache} if cache else {}
        with torch.inference_mode():
            # an explicit mask: from pad_token_id=0 alone, transformers would mask every
            # prompt token that happens to be id 0 (attnlab attends to all of them)
            out = hf.generate(
                prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n,
                min_new_tokens=n, do_sample=False, pad_token_id=0, **kw
            )  # fmt: skip
        return out[0, args.prompt :].tolist()

    def run_ours(model, compile: bool, cuda_graphs: bool = True):
        attnlab.generation.CUDA_GRAPHS = cuda_graphs
        return model.generate(prompt[0], n, compile=compile)

    runners = {
        "attnlab (eager, default)": lambda: run_ours(ours, False),
        "transformers": lambda: run_hf(None),
        "transformers (static cache)": lambda: run_hf("static"),
    }
    compile_s = {}
    if not args.no_compile:  # the compiled fixed-shape step: compile once, then time
        variants = {"attnlab (compiled step)": True}
        if cuda:
            variants = {"attnlab (compiled step, CUDA graph)": True,
                        "attnlab (compiled step, no CUDA graph)": False}  # fmt: skip
        # a copy per variant, made before anything compiles (each keeps its compiled step);
        # on CPU compiling re-stores the weights row-major, the eager row keeps its layout
        models = {name: copy.deepcopy(ours) for name in variants}
        for name, graphs in variants.items():
            model = models[name]
            t = time.perf_counter()
            run_ours(model, True, graphs)
            sync(device)
            compile_s[name] = time.perf_counter() - t
            print(f"first call {name}: {compile_s[name]:.1f} s", file=sys.stderr, flush=True)
            runners[name] = lambda m=model, g=graphs: run_ours(m, True, g)
    tokens, times = {}, {}
    for name, fn in runners.items():  # warm up (transformers compiles on CUDA), check tokens
        t = time.perf_counter()
        tokens[name] = fn()
        if name.startswith("transformers (static") and cuda:
            compile_s[name] = time.perf_counter() - t
        print(f"warm-up {name}: {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
    mb = 2048 if cuda else 512  # far beyond the GPU's L2 cache
    bandwidths = [copy_bandwidth(mb, repeats=3, device=device)]
    reads = [read_bandwidth(mb, repeats=3, device=device)]
    for _ in range(args.repeats):  # interleaved, the bandwidths between rounds
        for name, fn in runners.items():
            sync(device)
            t = time.perf_counter()
            fn()
            sync(device)
            times.setdefault(name, []).append(time.perf_counter() - t)
        bandwidths.append(copy_bandwidth(mb, repeats=3, device=device))
        reads.append(read_bandwidth(mb, repeats=3, device=device))
    best = {name: min(ts) for name, ts in times.items()}
    median = {name: statistics.median(ts) for name, ts in times.items()}
    per_token = bytes_per_token(ours, args.prompt, n)

    def shares(name: str, measured: list[float]) -> str:
        """Median (lowest-highest) share of the bound, each run against its round's."""
        around = [max(a, b) for a, b in zip(measured, measured[1:])]
        s = [per_token * n / t / bw for t, bw in zip(times[name], around)]
        return f"{statistics.median(s):.0%} ({min(s):.0%}-{max(s):.0%})"

    print(
        f"model: LLaMA-style, {n_params / 1e6:.1f}M parameters, {args.dtype}, batch 1, "
        f"{args.prompt}-token prompt, {n} new tokens, greedy"
    )
    print(f"machine: {machine(device)}" + ("" if cuda else f"; threads: {threads}"))
    print(
        f"memory bandwidth over the run: large tensor copy {min(bandwidths) / 1e9:.1f}-"
        f"{max(bandwidths) / 1e9:.1f} GB/s, reading alone {min(reads) / 1e9:.1f}-"
        f"{max(reads) / 1e9:.1f} GB/s; bytes read per token: {per_token / 1e6:.1f} MB"
    )
    for name, seconds in compile_s.items():
        print(f"first call (compiling, then {n} tokens), {name}: {seconds:.1f} s")
    rows = []
    for name in runners:
        tps = n / best[name]
        rows.append(
            [
                name,
                f"{tps:.1f}",
                f"{n / median[name]:.1f}",
                f"{best['transformers'] / best[name]:.2f}x",
                f"{median['transformers'] / median[name]:.2f}x",
                shares(name, bandwidths),
                shares(name, reads),
                agreement(tokens[name], tokens["transformers"]),
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
