"""Attention sinks (StreamingLLM, Xiao et al. 2023): a model trained on 128-token blocks
reads a text 10x longer; the per-token loss by position for four ways of reading it.

    window      a rolling cache of the last 128 tokens (the oldest evicted, no sinks)
    sinks       StreamingLLM: the first 4 tokens kept + the last 124, positions within the
                cache (attention.sink_tokens=4, sliding_window=128)
    recompute   the last 128 tokens re-encoded from scratch for every token (the slow exact
                baseline: every window starts afresh at position 0)
    dense       plain attention over everything before (RoPE past the trained length)

The model: the ``demo`` run preset (LLaMA-style, RoPE, 4 layers, d_model 128, block 128,
character level on the embedded corpus) trained for ``--seconds``; the texts: ``--texts``
disjoint stretches of 10 x 128 tokens of the validation split.

    python benchmarks/attention_sinks.py [--seconds 60] [--texts 8] [--ckpt DIR]

Prints the mean loss per 128-token span of positions and saves the smoothed curves to
docs/img/attention_sinks.png. ``--ckpt`` reuses a trained checkpoint.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from _common import machine, setup_threads, table
from attnlab import build_model
from attnlab.functional.attention import attend
from attnlab.presets import get_run_preset
from attnlab.training import load_checkpoint, train

ROOT = Path(__file__).resolve().parents[1]
SINKS = 4
SPAN = 128  # positions per row of the table
SMOOTH = 64  # moving average of the plotted curves, in tokens


def train_model(out: Path, seconds: float) -> None:
    cfg = get_run_preset("demo")
    cfg.train.time_budget = seconds
    t0 = time.perf_counter()
    result = train(cfg, out, progress=False, overwrite=True)
    print(
        f"trained {result.step} steps in {time.perf_counter() - t0:.0f} s: "
        f"val loss {result.val_loss:.3f} ({result.val_coverage})"
    )


def with_attention(model: torch.nn.Module, **attention) -> torch.nn.Module:
    """The same weights in a model whose attention config is changed (no new parameters)."""
    cfg = model.cfg.override({f"attention.{k}": v for k, v in attention.items()})
    other = build_model(cfg).eval()
    other.load_state_dict(model.state_dict())
    return other


def token_losses(logits: torch.Tensor, targets: torch.Tensor) -> np.ndarray:
    return F.cross_entropy(logits.float(), targets, reduction="none").numpy()


@torch.inference_mode()
def cached(model: torch.nn.Module, tokens: torch.Tensor, chunk: int) -> np.ndarray:
    """Losses of tokens[1:] read through the model's bounded cache, ``chunk`` tokens a
    call (the same numbers as one token a call: tests/test_long_context.py)."""
    cache = model.new_cache(1, model.cfg.attention.sliding_window, rolling=True)
    x = tokens[:-1]
    logits = [model(x[None, i : i + chunk], cache=cache).logits[0] for i in range(0, len(x), chunk)]
    return token_losses(torch.cat(logits), tokens[1:])


@torch.inference_mode()
def recompute(model: torch.nn.Module, tokens: torch.Tensor, window: int) -> np.ndarray:
    """Each token predicted from the last ``window`` tokens encoded afresh (positions
    0..window-1); the first window in one pass (its prefixes are its causal rows)."""
    x = tokens[:-1]
    first = model(x[None, :window]).logits[0]  # (w, V)
    windows = x.unfold(0, window, 1)[1:]  # (n - w, w): the window ending at each later token
    last = [model(batch).logits[:, -1] for batch in windows.split(64)]
    return token_losses(torch.cat([first, *last]), tokens[1:])


@torch.inference_mode()
def dense(model: torch.nn.Module, tokens: torch.Tensor) -> np.ndarray:
    return token_losses(model(tokens[None, :-1]).logits[0], tokens[1:])


@torch.inference_mode()
def first_token_attention(
    model: torch.nn.Module, windows: torch.Tensor
) -> list[tuple[float, float]]:
    """Per layer: (the attention weight on position 0, averaged over the queries at
    positions w/2..w-1 of ``windows`` (n, w), for the head that gives it most; the same
    average of 1 / (p + 1), what uniform attention would give). An attention sink is a
    head whose weight on the first token is far above uniform."""
    w = model.cfg.max_seq_len
    inputs: list = []
    hooks = [
        block.attn.register_forward_pre_hook(
            lambda mod, args, kwargs: inputs.append((mod, args[0], kwargs["rope"])),
            with_kwargs=True,
        )
        for block in model.blocks
    ]
    try:
        model(windows)
    finally:
        for hook in hooks:
            hook.remove()
    out = []
    later = torch.arange(w // 2, w)
    uniform = float((1.0 / (later + 1)).mean())
    for attn, x, rope in inputs:
        q, k, v = attn._project_self(attn.qkv(x), rope)  # (1, h, w, d_h), RoPE applied
        _, weights = attend(q, k, v, causal=True, backend="eager", return_weights=True)
        on_first = weights[:, :, w // 2 :, 0].mean((0, 2))  # (h,)
        out.append((float(on_first.max()), uniform))
    return out


def plot(curves: dict[str, np.ndarray], window: int, path: Path) -> None:
    """Top: the smoothed loss of each reader by position; bottom: each bounded reader minus
    recompute (the top curves of the three can lie on top of each other)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(8, 6), sharex=True, gridspec_kw={"height_ratios": [2, 1]}
    )
    kernel = np.ones(SMOOTH) / SMOOTH
    smooth = {name: np.convolve(c, kernel, mode="valid") for name, c in curves.items()}
    x = np.arange(len(next(iter(smooth.values())))) + SMOOTH
    styles = {"window": "-", "sinks": "--", "recompute": ":", "dense": "-"}
    for name, y in smooth.items():
        top.plot(x, y, styles.get(name, "-"), label=name, lw=1.6)
    for name in ("window", "sinks"):
        bottom.plot(x, smooth[name] - smooth["recompute"], styles[name], label=name, lw=1.4)
    for ax in (top, bottom):
        ax.axvline(window, color="grey", ls=":", lw=1)
    top.set_ylabel(f"loss (nats), {SMOOTH}-token mean")
    top.set_title(f"Reading 10x the trained length of {window} tokens")
    top.legend(loc="upper left", ncol=4, fontsize=8)
    bottom.axhline(0, color="black", lw=0.6)
    bottom.set_ylabel("minus recompute")
    bottom.set_xlabel(f"position of the predicted token (dotted: {window}, the cache is full)")
    bottom.legend(loc="upper left", ncol=2, fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"saved {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=60.0, help="training time budget")
    p.add_argument("--texts", type=int, default=8, help="validation texts averaged")
    p.add_argument("--ckpt", type=Path, help="a trained checkpoint (skips training)")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "attention_sinks")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--plot", type=Path, default=ROOT / "docs" / "img" / "attention_sinks.png")
    args = p.parse_args()
    setup_threads(args.threads)
    print(f"# {machine()}")
    if args.ckpt is None:
        train_model(args.out, args.seconds)
        args.ckpt = args.out
    ckpt = load_checkpoint(args.ckpt)
    model = ckpt.model.eval()
    window = model.cfg.max_seq_len
    length = 10 * window
    val = load_validation(ckpt)
    if len(val) < args.texts * (length + 1):
        raise SystemExit(f"the validation split holds {len(val)} tokens: use fewer --texts")
    readers = {
        "window": lambda x: cached(with_attention(model, sliding_window=window), x, window),
        "sinks": lambda x: cached(
            with_attention(model, sliding_window=window, sink_tokens=SINKS), x, window
        ),
        "recompute": lambda x: recompute(model, x, window),
        "dense": lambda x: dense(model, x),
    }
    curves = {name: np.zeros(length) for name in readers}
    seconds = dict.fromkeys(readers, 0.0)
    for i in range(args.texts):
        tokens = torch.as_tensor(val[i * (length + 1) : (i + 1) * (length + 1)].astype(np.int64))
        for name, read in readers.items():
            t0 = time.perf_counter()
            curves[name] += read(tokens) / args.texts
            seconds[name] += time.perf_counter() - t0
    print(
        f"\nmean loss (nats/char) of {args.texts} validation texts of {length} tokens, by the "
        f"position of the predicted token; trained length {window}, cache {window} tokens"
        f" ({SINKS} sinks + {window - SINKS} recent for sinks)\n"
    )
    rows = []
    for start in range(0, length, SPAN):
        rows.append(
            [f"{start + 1}-{start + SPAN}"]
            + [f"{curves[name][start : start + SPAN].mean():.3f}" for name in readers]
        )
    rows.append(["all"] + [f"{curves[name].mean():.3f}" for name in readers])
    rows.append(["seconds"] + [f"{seconds[name]:.1f}" for name in readers])
    print(table(["positions", *readers], rows))
    print("\n(seconds: measured while other jobs shared the CPU)")
    starts = [i * (length + 1) for i in range(args.texts)]  # the texts' first windows
    windows = torch.stack([torch.as_tensor(val[s : s + window].astype(np.int64)) for s in starts])
    first = first_token_attention(model, windows)
    print(
        f"\nattention weight on the first token of the texts' first windows, queries at "
        f"positions {window // 2}-"
        f"{window - 1}, the most attentive head of each layer (an attention sink would be far "
        "above uniform)\n"
    )
    print(
        table(
            ["layer", "weight on token 0", "uniform"],
            [[i, f"{a:.4f}", f"{u:.4f}"] for i, (a, u) in enumerate(first)],
        )
    )
    plot(curves, window, args.plot)


def load_validation(ckpt) -> np.ndarray:
    from attnlab.data import prepare_data

    return prepare_data(ckpt.config.data, tokenizer=ckpt.tokenizer).val


if __name__ == "__main__":
    main()
