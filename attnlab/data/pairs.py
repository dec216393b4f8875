"""Sequence-to-sequence pairs -> padded batches for :class:`~attnlab.models.seq2seq.Seq2SeqModel`,
and masked-LM batches from a token stream for :class:`~attnlab.models.encoder.EncoderModel`.

Shapes: b batch, s source length, t target length (+1 for the start/end token)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from attnlab.models.encoder import mask_tokens


class PairBatch(NamedTuple):
    src: Tensor  # (b, s) right padded with pad_id
    src_mask: Tensor  # (b, s) 1 real, 0 padding
    tgt: Tensor  # (b, t + 1) decoder inputs: bos, y_1 .. y_n, pads
    targets: Tensor  # (b, t + 1) y_1 .. y_n, eos, -100 for padding


def pad_pairs(
    pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    pad_id: int,
    bos_id: int,
    eos_id: int,
) -> PairBatch:
    """Batch (source ids, target ids) pairs: teacher forcing inputs and shifted targets."""
    if not pairs:
        raise ValueError("no pairs to batch")
    b = len(pairs)
    s = max(len(x) for x, _ in pairs)
    t = max(len(y) for _, y in pairs) + 1
    src = torch.full((b, s), pad_id, dtype=torch.long)
    src_mask = torch.zeros((b, s), dtype=torch.long)
    tgt = torch.full((b, t), pad_id, dtype=torch.long)
    targets = torch.full((b, t), -100, dtype=torch.long)
    for i, (x, y) in enumerate(pairs):
        src[i, : len(x)] = torch.tensor(list(x), dtype=torch.long)
        src_mask[i, : len(x)] = 1
        tgt[i, : len(y) + 1] = torch.tensor([bos_id, *y], dtype=torch.long)
        targets[i, : len(y) + 1] = torch.tensor([*y, eos_id], dtype=torch.long)
    return PairBatch(src, src_mask, tgt, targets)


def pair_batches(
    pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
    batch_size: int,
    *,
    pad_id: int,
    bos_id: int,
    eos_id: int,
    seed: int = 0,
):
    """Endless shuffled :class:`PairBatch` es, epoch after epoch (each ``batch_size`` pairs;
    an epoch's remainder is left out)."""
    if not 1 <= batch_size <= len(pairs):  # else no epoch holds a batch: an endless loop
        raise ValueError(f"batch_size={batch_size} needs 1 to {len(pairs)} (the pairs given)")
    g = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(pairs), generator=g).tolist()
        for i in range(0, len(order) - batch_size + 1, batch_size):
            chunk = [pairs[j] for j in order[i : i + batch_size]]
            yield pad_pairs(chunk, pad_id=pad_id, bos_id=bos_id, eos_id=eos_id)


def seq2seq_step(model, batch: PairBatch):
    """batch -> the model's output (teacher forcing; ``loss`` to optimise)."""
    return model(batch.src, batch.tgt, src_mask=batch.src_mask, targets=batch.targets)


def mlm_batches(
    tokens: Tensor,
    block_size: int,
    batch_size: int,
    *,
    mask_id: int,
    vocab_size: int,
    mask_prob: float = 0.15,
    special: Tensor | None = None,
    seed: int = 0,
):
    """Endless (inputs, targets) masked-LM batches of random ``block_size`` windows of a
    1-D token stream (e.g. the embedded corpus tokenised), masked by :func:`mask_tokens`."""
    if tokens.numel() < block_size:
        raise ValueError(f"need at least block_size={block_size} tokens, got {tokens.numel()}")
    g = torch.Generator().manual_seed(seed)
    while True:  # any window, the last one too (masked LM predicts no next token)
        starts = torch.randint(0, tokens.numel() - block_size + 1, (batch_size,), generator=g)
        idx = torch.stack([tokens[i : i + block_size] for i in starts.tolist()]).long()
        yield mask_tokens(
            idx,
            mask_id=mask_id,
            vocab_size=vocab_size,
            mask_prob=mask_prob,
            special=special,
            generator=g,
        )
