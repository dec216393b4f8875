"""Softmax temperature: p_i = exp(z_i / tau) / sum_j exp(z_j / tau).

tau -> 0 puts all the weight on the largest logit (argmax: entropy 0, top weight 1);
tau -> infinity flattens it to uniform (entropy log n, top weight 1/n). Shown on a fixed
random logit vector, then on a language model's next-token distribution after a prompt:
a checkpoint given with --ckpt, else a small character-level model trained here with the
shared trainer for --train-seconds on the embedded corpus (the Python Language Reference);
--train-seconds 0 skips the model part.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from attnlab.config import DataConfig, RunConfig, TrainConfig
from attnlab.demos.common import check_memory, format_table, new_figure, save_figure
from attnlab.presets import llama_style

NAME = "temperature"
DESCRIPTION = "softmax temperature from argmax to uniform, on random logits and a trained model"

TABLE_TEMPERATURES = (0.01, 0.1, 0.25, 0.5, 0.8, 1.0, 1.5, 2.0, 5.0, 100.0)


def entropy(p: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in nats over the last dimension (0 log 0 = 0)."""
    return -torch.special.xlogy(p, p).sum(-1)


def sweep(logits: torch.Tensor, temperatures) -> list[dict[str, float]]:
    rows = []
    for tau in temperatures:
        p = (logits.double() / tau).softmax(-1)
        h = entropy(p).item()
        rows.append({"tau": tau, "entropy": h, "effective": math.exp(h), "top": p.max().item()})
    return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    from attnlab.cli.common import non_negative_int, path_arg, positive_int

    p.add_argument("--n-logits", type=positive_int, default=50, help="size of the random logits")
    p.add_argument(
        "--ckpt",
        type=path_arg,
        metavar="DIR",
        help="an attnlab checkpoint to read a distribution from",
    )
    p.add_argument("--prompt", default="The ", help="text before the next token")
    p.add_argument(
        "--train-seconds",
        type=non_negative_int,
        default=20,
        help="without --ckpt: train a small model this long (0: random logits only)",
    )


def run(args: argparse.Namespace) -> int:
    if args.n_logits < 2:
        raise ValueError(f"--n-logits must be at least 2, got {args.n_logits}")
    check_memory(32 * args.n_logits, "--n-logits")  # float64 logits and a few softmaxes
    out = Path(args.out)
    g = torch.Generator().manual_seed(args.seed)
    logits = 2.0 * torch.randn(args.n_logits, generator=g, dtype=torch.float64)
    taus = torch.logspace(-2, 2, 81, dtype=torch.float64).tolist()
    curves = {"random logits": (sweep(logits, taus), args.n_logits)}
    print(f"random logits z ~ N(0, 2^2), n = {args.n_logits} (uniform entropy log n = "
          f"{math.log(args.n_logits):.4g} nats)")  # fmt: skip
    print(_table(sweep(logits, TABLE_TEMPERATURES)))

    found, source = _model_logits(args, out)
    print()
    if found is None:
        print(source)
    else:
        next_logits, tokenizer = found
        n = next_logits.numel()
        curves[f"next token after {args.prompt!r}"] = (sweep(next_logits, taus), n)
        print(f"{source}: next-token distribution after {args.prompt!r}")
        print(f"vocabulary {n} (uniform entropy log V = {math.log(n):.4g} nats)")
        print(_table(sweep(next_logits, TABLE_TEMPERATURES)))
        top5 = next_logits.topk(min(5, n)).indices.tolist()
        print("most likely next tokens: " + ", ".join(repr(tokenizer.decode([i])) for i in top5))
    plot(out, curves)
    return 0


def _table(rows: list[dict[str, float]]) -> str:
    return format_table(
        ["tau", "entropy (nats)", "exp(entropy)", "top weight"],
        [[r["tau"], r["entropy"], r["effective"], r["top"]] for r in rows],
    )


def quick_run(seconds: float, seed: int) -> RunConfig:
    """A model small enough to learn something in ~20 s on one CPU thread (747 steps
    and a validation loss of 1.68 nats per character on a 2-core AMD EPYC), evaluated once
    at the end."""
    model = llama_style(vocab_size=256, max_seq_len=64, d_model=64, n_layers=2, n_heads=4,
                        multiple_of=32, tie_embeddings=True)  # fmt: skip
    train = TrainConfig(batch_size=16, block_size=64, lr=5e-3, min_lr=5e-4, warmup_steps=20,
                        eval_every=0, time_budget=float(seconds), seed=seed)  # fmt: skip
    return RunConfig(model=model, train=train, data=DataConfig(tokenizer="char"))


def _model_logits(args: argparse.Namespace, out: Path):
    """((logits (V,), tokenizer), description) or (None, why not)."""
    from attnlab.training import load_checkpoint

    if args.ckpt is not None:
        ckpt = load_checkpoint(args.ckpt)
        source = f"checkpoint {args.ckpt}"
    elif args.train_seconds > 0:
        from attnlab.training import train

        result = train(quick_run(args.train_seconds, args.seed), out / "model", progress=False,
                       overwrite=True)  # fmt: skip
        ckpt = load_checkpoint(out / "model")
        source = (
            f"a 2-layer char-level LLaMA-style model (d_model 64) trained {result.step} steps "
            f"({args.train_seconds} s) on the embedded corpus, validation loss "
            f"{result.val_loss:.3f}; saved in {out / 'model'}"
        )
    else:
        return None, "no model: --train-seconds 0 and no --ckpt (random logits only)"
    if not hasattr(ckpt.model, "stream"):  # encoders, encoder-decoders: no next token
        raise ValueError(f"--ckpt {args.ckpt}: holds arch {ckpt.model.cfg.arch!r}; the demo "
                         "needs a language model (arch 'decoder' or 'xl')")  # fmt: skip
    if ckpt.tokenizer is None:
        raise ValueError(f"--ckpt {args.ckpt}: has no tokenizer.json to encode --prompt with")
    from attnlab.tokenizers import TokenizerError

    try:
        # as generate encodes a prompt: with the special tokens the tokenizer's
        # post-processor adds (an imported LLaMA's <s>; attnlab's own tokenizers: none)
        ids = torch.tensor([ckpt.tokenizer.encode(args.prompt, add_special_tokens=True)])
    except TokenizerError as e:
        raise ValueError(f"--prompt: {e}") from None
    if ids.numel() == 0:
        raise ValueError("--prompt is empty; give some text to continue")
    with torch.no_grad():
        logits = ckpt.model(ids).logits[0, -1].double()  # (V,)
    return (logits, ckpt.tokenizer), source


def plot(out: Path, curves: dict[str, tuple[list[dict], int]]) -> Path:
    """curves: name -> (sweep rows, number of outcomes n)."""
    fig, (ax_h, ax_top) = new_figure(2)
    for name, (rows, n) in curves.items():
        taus = [r["tau"] for r in rows]
        (line,) = ax_h.plot(taus, [r["entropy"] for r in rows], label=name)
        ax_h.axhline(math.log(n), color=line.get_color(), ls=":", label=f"log {n} (uniform)")
        ax_top.plot(taus, [r["top"] for r in rows], label=name)
        ax_top.axhline(1 / n, color=line.get_color(), ls=":", label=f"1/{n} (uniform)")
    ax_h.set(xscale="log", xlabel="temperature tau", ylabel="entropy (nats)",
             title="entropy: 0 (argmax) to log n (uniform)")  # fmt: skip
    ax_top.set(xscale="log", xlabel="temperature tau", ylabel="largest probability",
               title="top weight: 1 (argmax) to 1/n (uniform)")  # fmt: skip
    for ax in (ax_h, ax_top):
        ax.legend(fontsize=8)
    return save_figure(fig, out / "temperature.png")
