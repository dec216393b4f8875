"""Multi-head latent attention and mixture of experts on this machine.

1. Decode-step time of the naive and absorbed MLA paths on the same weights, with 1K, 4K
   and 8K tokens cached (the naive path re-expands every cached latent to per-head keys and
   values at each step; the absorbed one attends in latent space).
2. KV-cache bytes per token of that MLA model against a GQA model of equal parameter count.
3. Training tokens/s of a small DeepSeek-style MoE against a dense model with the same
   active parameters per token.

    python benchmarks/mla.py [--lengths 1024 4096 8192] [--threads 2] [--repeats 10]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from _common import machine, setup_threads, table
from attnlab import build_model
from attnlab.analysis import count_parameters, kv_cache_bytes_per_token, matmul_parameters
from attnlab.nn.mla import MultiHeadLatentAttention
from attnlab.presets import deepseek_style, llama_style

MLA = dict(  # DeepSeek-V2's ratios (d_c = 4 d_h, d_r = d_h / 2) at d_model 512
    vocab_size=1024,
    max_seq_len=8192 + 64,
    d_model=512,
    n_layers=4,
    n_heads=8,
    ffn_hidden=1408,
    kv_lora_rank=256,
    qk_nope_head_dim=64,
    qk_rope_head_dim=32,
    v_head_dim=64,
)


def _set_path(model, path: str) -> None:
    for m in model.modules():
        if isinstance(m, MultiHeadLatentAttention):
            m.path = path


@torch.inference_mode()
def decode_times(lengths: list[int], repeats: int) -> list[list]:
    model = build_model(deepseek_style(**MLA)).eval()
    rows = []
    for n in lengths:
        cache = model.new_cache(1, n + 2 * repeats + 2)
        _set_path(model, "auto")  # prefill in chunks, each on its cheaper path
        for start in range(0, n, 512):
            model(torch.randint(0, 1024, (1, min(512, n - start))), cache=cache, last_only=True)
        times = {}
        for path in ("naive", "absorbed"):
            _set_path(model, path)
            model(torch.randint(0, 1024, (1, 1)), cache=cache, last_only=True)  # warm-up
            samples = []
            for _ in range(repeats):
                tok = torch.randint(0, 1024, (1, 1))
                t = time.perf_counter()
                model(tok, cache=cache, last_only=True)
                samples.append(time.perf_counter() - t)
            times[path] = statistics.median(samples)
        rows.append(
            [
                n,
                f"{times['naive'] * 1e3:.2f}",
                f"{times['absorbed'] * 1e3:.2f}",
                f"{times['naive'] / times['absorbed']:.1f}x",
            ]
        )
    return rows


def kv_versus_gqa() -> list[list]:
    mla = deepseek_style(**MLA)
    target = count_parameters(mla)["total"]

    def gqa(hidden: int):
        return llama_style(
            vocab_size=MLA["vocab_size"],
            max_seq_len=MLA["max_seq_len"],
            d_model=MLA["d_model"],
            n_layers=MLA["n_layers"],
            n_heads=MLA["n_heads"],
            n_kv_heads=2,
            ffn_hidden=hidden,
        )

    # Parameters grow linearly with the FFN width: solve for the width that matches.
    a, b = count_parameters(gqa(1000))["total"], count_parameters(gqa(2000))["total"]
    hidden = round(1000 + (target - a) * 1000 / (b - a))
    rows = []
    for name, cfg in (("MLA (d_c 256, d_r 32)", mla), ("GQA 8/2 heads of 64", gqa(hidden))):
        rows.append(
            [
                name,
                f"{count_parameters(cfg)['total'] / 1e6:.2f}M",
                kv_cache_bytes_per_token(cfg, torch.bfloat16),
            ]
        )
    return rows


def moe_versus_dense(steps: int) -> list[list]:
    common = dict(
        vocab_size=1024,
        max_seq_len=128,
        d_model=256,
        n_layers=4,
        n_heads=4,
        kv_lora_rank=128,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
    )
    moe = dict(
        n_routed_experts=16,
        n_shared_experts=1,
        n_activated_experts=2,
        moe_hidden_dim=256,
        first_k_dense=0,
        n_groups=4,
        topk_groups=2,
    )
    cfgs = {
        "MoE 16 experts, top 2 + 1 shared": deepseek_style(ffn_hidden=768, moe=moe, **common),
        "dense SwiGLU 768 (same active)": deepseek_style(ffn_hidden=768, **common),
    }
    rows = []
    idx = torch.randint(0, 1024, (8, 129))
    for name, cfg in cfgs.items():
        model = build_model(cfg).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        samples = []
        for i in range(steps + 2):
            t = time.perf_counter()
            out = model(idx[:, :-1], targets=idx[:, 1:])
            loss = out.loss if out.aux_loss is None else out.loss + out.aux_loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            if i >= 2:  # warm-up
                samples.append(time.perf_counter() - t)
        tokens = idx[:, :-1].numel()
        rows.append(
            [
                name,
                f"{count_parameters(cfg)['total'] / 1e6:.2f}M",
                f"{matmul_parameters(cfg) / 1e6:.2f}M",
                f"{tokens / statistics.median(samples):,.0f}",
            ]
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    setup_threads(args.threads)
    torch.manual_seed(0)
    print(machine())
    print("\nMLA decode step (1 token, batch 1, 4 layers, d_model 512, 8 heads), median ms:")
    print(
        table(["cached", "naive", "absorbed", "speed-up"], decode_times(args.lengths, args.repeats))
    )
    print("\nKV cache per token (bf16), equal parameter counts:")
    print(table(["model", "params", "bytes/token"], kv_versus_gqa()))
    print("\nTraining step, batch 8 x 128 tokens, median tokens/s:")
    print(table(["model", "params", "active matmul", "tokens/s"], moe_versus_dense(args.steps)))


if __name__ == "__main__":
    main()
