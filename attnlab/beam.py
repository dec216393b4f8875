"""Beam search over any autoregressive step function (encoder-decoder or decoder-only).

Keep the ``beam_width`` most probable prefixes; extend each by every token; keep the best
``beam_width`` extensions that do not end in EOS, setting aside those that do (when they
rank above the last kept prefix) as finished hypotheses. Finished hypotheses are ranked by

    score = log p(y | x) / lp(|y|),   lp(n) = ((5 + n) / 6) ** alpha

the length penalty of Wu et al. 2016 (GNMT, eq. 14): alpha = 0 ranks by log-probability,
which favours short outputs; alpha ~ 0.6-1 compensates. |y| counts the EOS token.

Stopping: a prefix's log-probability only falls as it grows and lp(n) <= lp(max_len), so no
live prefix can end above (its log p) / lp(max_len). The search stops when the ``n_best``-th
finished score reaches that bound for every live prefix, or after ``max_len`` tokens.
Stopping as soon as ``beam_width`` hypotheses have finished (a common shortcut) returned
worse outputs than greedy decoding on a peaked model: near-copies one token shorter than
the best prefix finish first and end the search before it does.

The model is seen only through two callables, so the same search serves every model:
``step(tokens (n,), state) -> (log_probs (n, V), state)`` advances n prefixes by one token,
``reorder(state, index (n',)) -> state`` keeps (and repeats) the prefixes listed in index.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass
class Hypothesis:
    tokens: list[int]  # generated tokens (no BOS), ending with EOS when finished
    log_prob: float  # sum over tokens of the model's log-probability
    score: float  # log_prob / length_penalty(len(tokens), alpha)
    finished: bool  # whether it ended with EOS (else it reached max_len)


def length_penalty(length: int, alpha: float) -> float:
    return ((5.0 + length) / 6.0) ** alpha


def check_search(beam_width: int, max_len: int, n_best: int, alpha: float) -> None:
    if beam_width < 1:
        raise ValueError(f"beam_width must be >= 1, got {beam_width}")
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    if not 1 <= n_best <= beam_width:
        raise ValueError(f"n_best must be between 1 and beam_width ({beam_width}), got {n_best}")
    if not alpha >= 0:  # also rejects nan
        raise ValueError(f"length_penalty must be >= 0, got {alpha}")


@torch.no_grad()
def beam_search(
    step: Callable[[Tensor, Any], tuple[Tensor, Any]],
    state: Any,
    reorder: Callable[[Any, Tensor], Any],
    *,
    bos_id: int,
    eos_id: int,
    beam_width: int = 4,
    max_len: int = 50,
    length_penalty_alpha: float = 0.0,
    n_best: int = 1,
) -> list[Hypothesis]:
    """The ``n_best`` best hypotheses for one input, best first. ``state`` holds that one
    input (batch 1). If fewer than ``n_best`` finish within ``max_len`` tokens, the best
    unfinished ones fill the list (``finished=False``)."""
    check_search(beam_width, max_len, n_best, length_penalty_alpha)
    prefixes: list[list[int]] = [[]]
    prefix_log_probs = torch.zeros(1, dtype=torch.float64)  # (n,) log p of each prefix
    last = torch.tensor([bos_id])
    finished: list[Hypothesis] = []

    def hypothesis(tokens: list[int], log_prob: float, done: bool) -> Hypothesis:
        score = log_prob / length_penalty(len(tokens), length_penalty_alpha)
        return Hypothesis(tokens, log_prob, score, done)

    for _ in range(max_len):
        log_probs, state = step(last, state)  # (n, V)
        vocab = log_probs.shape[-1]
        totals = prefix_log_probs[:, None] + log_probs.double()  # (n, V)
        # 2k candidates: even if k of them end in EOS, k others can carry on.
        top = totals.flatten().topk(min(2 * beam_width, totals.numel()))
        keep_rows, keep_tokens, keep_log_probs = [], [], []
        for total, flat in zip(top.values.tolist(), top.indices.tolist()):
            row, token = divmod(flat, vocab)
            if token == eos_id:
                finished.append(hypothesis(prefixes[row] + [token], total, True))
            else:
                keep_rows.append(row)
                keep_tokens.append(token)
                keep_log_probs.append(total)
                if len(keep_rows) == beam_width:
                    break
        if not keep_rows:
            prefixes = []
            break
        if len(finished) >= n_best:
            nth_best = sorted((h.score for h in finished), reverse=True)[n_best - 1]
            bound = max(keep_log_probs) / length_penalty(max_len, length_penalty_alpha)
            if nth_best >= bound:
                prefixes = []
                break
        prefixes = [prefixes[r] + [t] for r, t in zip(keep_rows, keep_tokens)]
        prefix_log_probs = torch.tensor(keep_log_probs, dtype=torch.float64)
        last = torch.tensor(keep_tokens)
        state = reorder(state, torch.tensor(keep_rows))

    ranked = sorted(finished, key=lambda h: h.score, reverse=True)
    if len(ranked) < n_best:  # max_len reached first: complete with unfinished prefixes
        unfinished = [
            hypothesis(tokens, lp, False) for tokens, lp in zip(prefixes, prefix_log_probs.tolist())
        ]
        ranked += sorted(unfinished, key=lambda h: h.score, reverse=True)
    return ranked[:n_best]
