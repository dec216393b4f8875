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

    python benchmarks/attention_sinks.py [--seconds 60] [--texts 8] [--ckpt DIR] [--bos]

Prints the mean loss per 128-token span of positions and saves the smoothed curves to
docs/img/attention_sinks.png. ``--ckpt`` reuses a trained checkpoint.

``--bos`` is the paper's setting: every training and validation block starts with the
same token, a BOS id one past the tokenizer's (the model's vocabulary is one larger), as
LLMs see <s> at the start of every sequence. Each text is then read as [BOS] + text:
``window`` evicts BOS once the cache is full, ``sinks`` keeps it (4 sinks: BOS + the
text's first 3 tokens; ``sinks1``: BOS alone + the last 127), ``recompute`` re-encodes
[BOS] + the last 127 tokens for every token (the blocks the model was trained on). The
plot goes to docs/img/attention_sinks_bos.png, the run to runs/attention_sinks_bos.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from _common import machine, setup_threads, table
from attnlab import build_model
from attnlab.data import TokenDataset, prepare_data
from attnlab.functional.attention import attend
from attnlab.presets import get_run_preset
from attnlab.tokenizers import Tokenizer
from attnlab.training import load_checkpoint, train

ROOT = Path(__file__).resolve().parents[1]
SINKS = 4
SPAN = 128  # positions per row of the table
SMOOTH = 64  # moving average of the plotted curves, in tokens


class BOSTokenizer(Tokenizer):
    """The corpus tokenizer plus one id past its own, ``bos``: ``vocab_size`` (which the lm
    task gives the model) counts it; the saved tokenizer.json is the corpus tokenizer's (a
    checkpoint's model may have more ids than its tokenizer)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        super().__init__(tokenizer.hf)
        self.bos = self.vocab_size
        self.vocab_size += 1


@dataclasses.dataclass
class BOSDataset(TokenDataset):
    """A TokenDataset whose blocks all start with BOS: x = [BOS, tokens[s : s + t - 1]],
    y = tokens[s : s + t] (the first text token is predicted from BOS alone)."""

    @classmethod
    def wrap(cls, data: TokenDataset) -> BOSDataset:
        """``data``'s token streams, with a :class:`BOSTokenizer`."""
        fields = {f.name: getattr(data, f.name) for f in dataclasses.fields(data)}
        return cls(**{**fields, "tokenizer": BOSTokenizer(data.tokenizer)})

    def batch(
        self,
        split: str,
        starts: torch.Tensor,
        block_size: int,
        device: torch.device | str | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks at ``starts`` -> x, y (n, t) int64, x opening with BOS."""
        x, y = super().batch(split, starts, block_size, device)  # (n, t)
        bos = torch.full_like(x[:, :1], self.tokenizer.bos)  # (n, 1)
        return torch.cat([bos, x[:, :-1]], dim=1), x


def train_model(out: Path, seconds: float, bos: bool) -> None:
    cfg = get_run_preset("demo")
    cfg.train.time_budget = seconds
    dataset = BOSDataset.wrap(prepare_data(cfg.data)) if bos else None
    t0 = time.perf_counter()
    result = train(cfg, out, progress=False, overwrite=True, dataset=dataset)
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
def recompute(
    model: torch.nn.Module, tokens: torch.Tensor, window: int, keep_first: bool = False
) -> np.ndarray:
    """Each token predicted from the last ``window`` tokens encoded afresh (positions
    0..window-1); the first window in one pass (its prefixes are its causal rows).
    ``keep_first``: the window is tokens[0] (BOS) + the last ``window - 1`` tokens."""
    x = tokens[:-1]
    first = model(x[None, :window]).logits[0]  # (w, V)
    if keep_first:
        recent = x[1:].unfold(0, window - 1, 1)[1:]  # (n - w, w - 1): ending at each later token
        head = x[:1].expand(len(recent), 1)  # (n - w, 1)
        windows = torch.cat([head, recent], dim=1)  # (n - w, w)
    else:
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


def plot(curves: dict[str, np.ndarray], window: int, path: Path, title: str = "") -> None:
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
    styles = {"window": "-", "sinks": "--", "sinks1": "-.", "recompute": ":", "dense": "-"}
    for name, y in smooth.items():
        top.plot(x, y, styles.get(name, "-"), label=name, lw=1.6)
    for name in [n for n in ("window", "sinks", "sinks1") if n in smooth]:
        bottom.plot(x, smooth[name] - smooth["recompute"], styles[name], label=name, lw=1.4)
    for ax in (top, bottom):
        ax.axvline(window, color="grey", ls=":", lw=1)
    top.set_ylabel(f"loss (nats), {SMOOTH}-token mean")
    top.set_title(f"Reading 10x the trained length of {window} tokens{title}")
    top.legend(loc="upper left", ncol=len(curves), fontsize=8)
    bottom.axhline(0, color="black", lw=0.6)
    bottom.set_ylabel("minus recompute")
    bottom.set_xlabel(f"position of the predicted token (dotted: {window}, the cache is full)")
    bottom.legend(loc="upper left", ncol=3, fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"saved {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=60.0, help="training time budget")
    p.add_argument("--texts", type=int, default=8, help="validation texts averaged")
    p.add_argument("--ckpt", type=Path, help="a trained checkpoint (skips training)")
    p.add_argument("--bos", action="store_true", help="train and read with a BOS token")
    p.add_argument("--out", type=Path, help="the run folder (default runs/attention_sinks[_bos])")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--plot", type=Path, help="default docs/img/attention_sinks[_bos].png")
    args = p.parse_args()
    suffix = "_bos" if args.bos else ""
    args.out = args.out or ROOT / "runs" / f"attention_sinks{suffix}"
    args.plot = args.plot or ROOT / "docs" / "img" / f"attention_sinks{suffix}.png"
    setup_threads(args.threads)
    print(f"# {machine()}")
    if args.ckpt is None:
        train_model(args.out, args.seconds, args.bos)
        args.ckpt = args.out
    ckpt = load_checkpoint(args.ckpt)
    model = ckpt.model.eval()
    bos = ckpt.tokenizer.vocab_size  # BOSTokenizer's extra id
    if (model.cfg.vocab_size == bos + 1) != args.bos:
        trained = "with" if model.cfg.vocab_size == bos + 1 else "without"
        raise SystemExit(
            f"--ckpt {args.ckpt} was trained {trained} a BOS token: "
            f"{'pass' if trained == 'with' else 'drop'} --bos"
        )
    window = model.cfg.max_seq_len
    length = 10 * window
    val = prepare_data(ckpt.config.data, tokenizer=ckpt.tokenizer).val
    if len(val) < args.texts * (length + 1):
        raise SystemExit(f"the validation split holds {len(val)} tokens: use fewer --texts")

    def sinks(n: int):
        other = with_attention(model, sliding_window=window, sink_tokens=n)
        return lambda x: cached(other, x, window)

    windowed = with_attention(model, sliding_window=window)
    readers = {"window": lambda x: cached(windowed, x, window), "sinks": sinks(SINKS)}
    if args.bos:
        readers["sinks1"] = sinks(1)
    readers["recompute"] = lambda x: recompute(model, x, window, keep_first=args.bos)
    readers["dense"] = lambda x: dense(model, x)
    curves = {name: np.zeros(length) for name in readers}
    seconds = dict.fromkeys(readers, 0.0)
    for i in range(args.texts):
        text = torch.as_tensor(val[i * (length + 1) : (i + 1) * (length + 1)].astype(np.int64))
        # With BOS: [BOS] + the text's first ``length`` tokens, the same ``length`` targets
        # counted from the text's first token.
        tokens = torch.cat([torch.tensor([bos]), text[:-1]]) if args.bos else text
        for name, read in readers.items():
            t0 = time.perf_counter()
            curves[name] += read(tokens) / args.texts
            seconds[name] += time.perf_counter() - t0
    opening = "[BOS] + " if args.bos else ""
    print(
        f"\nmean loss (nats/char) of {args.texts} validation texts of {length} tokens read as "
        f"{opening}text, by the position of the predicted token; trained length {window}, "
        f"cache {window} tokens ({SINKS} sinks + {window - SINKS} recent for sinks"
        + (f", 1 + {window - 1} for sinks1)\n" if args.bos else ")\n")
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
    first_window = [torch.as_tensor(val[s : s + window].astype(np.int64)) for s in starts]
    if args.bos:
        first_window = [torch.cat([torch.tensor([bos]), w[:-1]]) for w in first_window]
    first = first_token_attention(model, torch.stack(first_window))
    print(
        f"\nattention weight on {'BOS' if args.bos else 'the first token'} of the texts' "
        f"first windows, queries at positions {window // 2}-{window - 1}, the most attentive "
        "head of each layer (an attention sink would be far above uniform)\n"
    )
    print(
        table(
            ["layer", "weight on token 0", "uniform"],
            [[i, f"{a:.4f}", f"{u:.4f}"] for i, (a, u) in enumerate(first)],
        )
    )
    plot(curves, window, args.plot, ", BOS-trained" if args.bos else "")


if __name__ == "__main__":
    main()
