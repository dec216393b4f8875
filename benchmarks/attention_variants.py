"""Attention variants side by side: MHA, GQA, MQA, sliding window, MLA, DSA, NSA, linear models of
about equal size (LLaMA-style, 4 layers, d_model 128, 4 heads, character level), each
trained on the embedded corpus for the same wall time.

One table (validation loss, parameters, KV-cache bytes per token, decode tokens/s with 1K
and 8K cached tokens, training tokens/s) and a PNG: loss against cache bytes per token,
marker area proportional to decode speed at 8K.

    python benchmarks/attention_variants.py [--seconds 30] [--out attention_variants.png]

DSA trains its sparse stage from the start (no dense warm-up: the runs are short), its
indexer by its KL loss. Timings depend on the machine and its load (a shared 2-core CPU
gives noisy numbers: compare within one run).

Shapes: b batch, t block length.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from _common import machine, setup_threads, table
from attnlab.analysis import kv_cache_bytes, kv_cache_bytes_per_token
from attnlab.config import DataConfig
from attnlab.data import prepare_data
from attnlab.models import build_model
from attnlab.presets import llama_style

BLOCK, BATCH, LR = 128, 8, 3e-3


def variants() -> dict[str, dict]:
    mla = {"attention.kind": "mla"}
    return {
        "MHA": {},
        "GQA (2 kv)": {"attention.n_kv_heads": 2},
        "MQA": {"attention.n_kv_heads": 1},
        "sliding window 32": {"attention.sliding_window": 32},
        "MLA": mla,
        "DSA top-32": {
            **mla,
            "attention.kind": "dsa",
            "attention.q_lora_rank": 64,
            "attention.index_topk": 32,
        },
        "NSA": {"attention.kind": "nsa", "attention.n_kv_heads": 2},
        "linear": {"attention.kind": "linear"},
    }


def cache_bytes_per_token(cfg) -> int:
    """The table's "kv bytes/token": the cache bytes each token adds, and for linear attention,
    whose cache does not grow with the tokens (``kv_cache_bytes_per_token`` counts 0), its
    whole fixed-size recurrent state."""
    if cfg.attention.kind == "linear":
        return kv_cache_bytes(cfg, 1)
    return kv_cache_bytes_per_token(cfg)


def config(overrides: dict, vocab: int):
    base = llama_style(
        vocab_size=vocab,
        max_seq_len=BLOCK,
        d_model=128,
        n_layers=4,
        n_heads=4,
        multiple_of=32,
        tie_embeddings=True,
    )
    return base.override(overrides)


def train(model, data, seconds: float) -> tuple[int, float]:
    """AdamW for ``seconds`` of wall time; returns (steps, training tokens/s)."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)
    model.train()
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        x, y = data.batch("train", data.sample_starts("train", BATCH, BLOCK, gen), BLOCK)
        out = model(x, targets=y)
        loss = out.loss if out.aux_loss is None else out.loss + out.aux_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        lr = LR * 0.5 * (1 + math.cos(math.pi * min(1.0, (time.perf_counter() - start) / seconds)))
        for g in opt.param_groups:
            g["lr"] = max(lr, LR / 10)
        opt.step()
        steps += 1
    return steps, steps * BATCH * BLOCK / (time.perf_counter() - start)


@torch.inference_mode()
def val_loss(model, data, n_blocks: int = 64) -> float:
    model.eval()
    n = min(n_blocks, data.n_eval_blocks("val", BLOCK))
    starts = torch.arange(n) * BLOCK
    total = 0.0
    for chunk in starts.split(16):
        x, y = data.batch("val", chunk, BLOCK)
        total += float(model(x, targets=y).loss) * len(chunk)
    return total / n


@torch.inference_mode()
def decode_speed(model, cached: int, steps: int = 16, chunk: int = 512) -> float:
    """Tokens/s of one-token steps with ``cached`` tokens already in the cache."""
    model.eval()
    cache = model.new_cache(1, cached + steps + 1)
    gen = torch.Generator().manual_seed(1)
    vocab = model.cfg.vocab_size
    for start in range(0, cached, chunk):
        model(torch.randint(0, vocab, (1, min(chunk, cached - start)), generator=gen), cache=cache)
    tok = torch.randint(0, vocab, (1, 1), generator=gen)
    model(tok, cache=cache)  # warm up
    t = time.perf_counter()
    for _ in range(steps):
        tok = model(tok, cache=cache, last_only=True).logits.argmax(-1)
    return steps / (time.perf_counter() - t)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    top = max(r["decode 8K"] for r in rows)
    for r in rows:
        ax.scatter(r["kv bytes/token"], r["val loss"], s=40 + 600 * r["decode 8K"] / top, alpha=0.6)
        ax.annotate(r["name"], (r["kv bytes/token"], r["val loss"]), fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("KV cache bytes per token (float32, all layers)")
    ax.set_ylabel("validation loss (nats/char)")
    ax.set_title("Attention variants, equal training time (marker area: decode tok/s at 8K)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=30.0, help="training wall time per model")
    p.add_argument("--only", nargs="*", help="variant names to run (default all)")
    p.add_argument("--out", default="attention_variants.png")
    p.add_argument(
        "--threads", type=int, default=1, help="1: on a shared CPU more threads wait on each other"
    )
    args = p.parse_args()
    unknown = [name for name in args.only or () if name not in variants()]
    if unknown:  # else no rows: an IndexError after loading the corpus
        p.error(
            f"--only: no variant {', '.join(map(repr, unknown))}; the variants: "
            + ", ".join(map(repr, variants()))
        )
    setup_threads(args.threads)
    print(f"# {machine()}; {args.seconds:.0f} s of training per model")
    data = prepare_data(DataConfig())
    vocab = data.tokenizer.vocab_size
    rows = []
    for name, overrides in variants().items():
        if args.only and name not in args.only:
            continue
        torch.manual_seed(0)
        cfg = config(overrides, vocab)
        model = build_model(cfg)
        steps, train_tps = train(model, data, args.seconds)
        rows.append(
            {
                "name": name,
                "val loss": val_loss(model, data),
                "params": model.num_parameters(),
                "kv bytes/token": cache_bytes_per_token(cfg),
                "decode 1K": decode_speed(model, 1024),
                "decode 8K": decode_speed(model, 8192),
                "train tok/s": train_tps,
                "steps": steps,
            }
        )
        print(f"  {name}: {rows[-1]['val loss']:.3f} after {steps} steps", flush=True)
    headers = list(rows[0])
    fmt = {
        "val loss": "{:.3f}",
        "decode 1K": "{:.0f}",
        "decode 8K": "{:.0f}",
        "train tok/s": "{:.0f}",
    }
    print(table(headers, [[fmt.get(h, "{}").format(r[h]) for h in headers] for r in rows]))
    plot(rows, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
