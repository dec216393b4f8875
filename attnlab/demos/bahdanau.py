"""Bahdanau attention learns an alignment: a GRU encoder-decoder with additive attention
(attnlab.models.rnn) trained for --seconds on numbers-to-words (attnlab.data.numbers), then
decoded greedily and with beam search on numbers it never saw.

A demonstration, not the trainer: the few lines of training loop live here so the demo
runs alone; training runs for real go through attnlab's shared trainer.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from attnlab.data.corpus import DataError
from attnlab.data.numbers import check_language, collate, iterate_batches, make_numbers_dataset
from attnlab.demos.common import format_table, new_figure, save_figure
from attnlab.models.rnn import GRUSeq2Seq, RNNSeq2SeqConfig

NAME = "bahdanau"
DESCRIPTION = "GRU encoder-decoder with additive attention on numbers-to-words: alignment heatmap"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from attnlab.cli.common import positive_float, positive_int

    p.add_argument("--lang", default="en", help="num2words language (en, fr, ...)")
    p.add_argument("--seconds", type=positive_float, default=30.0, help="training time")
    p.add_argument("--max-number", type=positive_int, default=1000, help="numbers below this")
    p.add_argument("--n-test", type=positive_int, default=100, help="held-out numbers")
    p.add_argument("--hidden", type=positive_int, default=64, help="GRU hidden size")
    p.add_argument("--batch-size", type=positive_int, default=32)
    p.add_argument("--beam", type=positive_int, default=4, help="beam width")


def run(args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)
    n_train = args.max_number - args.n_test
    if n_train < 1:
        raise ValueError(f"--n-test {args.n_test} leaves no training numbers below "
                         f"--max-number {args.max_number}")  # fmt: skip
    try:
        check_language(args.lang)
    except DataError as e:
        raise ValueError(f"--lang: {e}") from None
    data = make_numbers_dataset(args.lang, max_number=args.max_number, n_train=n_train, n_val=0,
                                n_test=args.n_test, seed=args.seed)  # fmt: skip
    src_vocab, tgt_vocab = data.src_vocab, data.tgt_vocab
    cfg = RNNSeq2SeqConfig(
        src_vocab_size=len(src_vocab), vocab_size=len(tgt_vocab),
        pad_id=tgt_vocab.pad_id, bos_id=tgt_vocab.bos_id, eos_id=tgt_vocab.eos_id,
        embed_dim=32, hidden_dim=args.hidden,
    )  # fmt: skip
    model = GRUSeq2Seq(cfg)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses, start, epoch = [], time.perf_counter(), 0
    while time.perf_counter() - start < args.seconds or not losses:  # at least one step
        for batch in iterate_batches(data.train, src_vocab, tgt_vocab, args.batch_size,
                                     shuffle=True, seed=args.seed + epoch):  # fmt: skip
            loss = model(batch.src, batch.src_mask, batch.tgt_in, batch.tgt_out).loss
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            losses.append(loss.item())
            if time.perf_counter() - start >= args.seconds:
                break
        epoch += 1
    model.eval()
    # passes over the training set: the last one may have stopped part-way
    epochs = len(losses) / math.ceil(len(data.train) / args.batch_size)
    print(f"{args.lang}: {len(data.train)} training numbers below {args.max_number}, "
          f"{len(data.test)} held out; {len(losses)} steps ({epochs:.1f} epochs) in "
          f"{args.seconds:g} s, "
          f"last train loss {sum(losses[-20:]) / len(losses[-20:]):.3f}")  # fmt: skip

    test = collate(data.test, src_vocab, tgt_vocab)
    max_len = max(len(w) for _, w in data.train) + 6  # room for EOS and a few extra
    greedy = [tgt_vocab.decode(h.tokens) for h in model.greedy(test.src, test.src_mask,
                                                                max_len=max_len)]  # fmt: skip
    beams = model.beam_search(test.src, test.src_mask, beam_width=args.beam, length_penalty=0.6,
                              max_len=max_len)  # fmt: skip
    beam = [tgt_vocab.decode(hyps[0].tokens) for hyps in beams]
    words = [w for _, w in data.test]
    rows = [
        ["greedy", exact(greedy, words), char_accuracy(greedy, words)],
        [f"beam {args.beam} (alpha 0.6)", exact(beam, words), char_accuracy(beam, words)],
    ]
    print(format_table(["decoding", "exact match", "char accuracy"], rows))
    for (digits, truth), b in list(zip(data.test, beam))[:5]:
        print(f"  {digits:>6} -> {b!r}" + ("" if b == truth else f"  (want {truth!r})"))
    plot(Path(args.out), model, data, losses, beam)
    return 0


def exact(predictions: list[str], truths: list[str]) -> float:
    return sum(p == t for p, t in zip(predictions, truths)) / len(truths)


def char_accuracy(predictions: list[str], truths: list[str]) -> float:
    """Position-wise character agreement over the longer of each pair."""
    hits = sum(sum(a == b for a, b in zip(p, t)) for p, t in zip(predictions, truths))
    return hits / sum(max(len(p), len(t)) for p, t in zip(predictions, truths))


def plot(out: Path, model: GRUSeq2Seq, data, losses: list[float], outputs: list[str]) -> Path:
    # The two longest held-out numbers, decoded by beam search: where did each output
    # character look in the source? (teacher forcing on the model's own output)
    picks = sorted(range(len(data.test)), key=lambda i: -len(data.test[i][0]))[:2]
    fig, axes = new_figure(3)
    axes[0].plot(losses)
    axes[0].set(xlabel="step", ylabel="cross-entropy (nats/char)", title="training loss",
                yscale="log")  # fmt: skip
    for ax, i in zip(axes[1:], picks):
        digits, output = data.test[i][0], outputs[i]
        batch = collate([(digits, output)], data.src_vocab, data.tgt_vocab)
        with torch.no_grad():
            weights = model(batch.src, batch.src_mask, batch.tgt_in).attention[0]  # (t, s)
        ax.imshow(weights, aspect="auto", cmap="Blues", vmin=0, vmax=1)
        ax.set_xticks(range(len(digits)), list(digits))
        ax.set_yticks(range(len(output) + 1), list(output) + ["<eos>"], fontsize=6)
        ax.set(xlabel="source digit", ylabel="output character",
               title=f"alignment: {digits} -> {output}")  # fmt: skip
    return save_figure(fig, out / "bahdanau.png")
