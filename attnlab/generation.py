"""Autoregressive generation: greedy, temperature, top-k, top-p sampling; stop tokens;
streaming; batched prompts of different lengths (left padded) with a KV cache.

Shapes: b batch, T tokens so far, V vocabulary size.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from attnlab.models.decoder import DecoderLM

# One prompt (token ids) or a batch of them (rows may differ in length).
Prompts = Tensor | Sequence[int] | Sequence[Sequence[int] | Tensor]


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    if not temperature >= 0:  # also rejects NaN
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


# Below this temperature, sampling is greedy: dividing logits by a smaller number overflows
# float32 (inf - inf = NaN probabilities), and the distribution is already one-hot.
GREEDY_BELOW_TEMPERATURE = 1e-5


def sample_next(
    logits: Tensor,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """logits (b, V) -> next tokens (b,). A temperature of 0 (or below
    ``GREEDY_BELOW_TEMPERATURE``) is greedy (argmax). ``top_k`` keeps exactly k tokens
    (ties at the k-th logit broken by index, as ``torch.topk`` does)."""
    if temperature < GREEDY_BELOW_TEMPERATURE:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        keep = torch.zeros_like(logits, dtype=torch.bool)
        keep.scatter_(-1, torch.topk(logits, top_k, dim=-1).indices, True)  # k per row
        logits = logits.masked_fill(~keep, float("-inf"))
    if top_p is not None and top_p < 1.0:
        # Keep the smallest set of most likely tokens whose probability reaches top_p.
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # probability mass ranked above each token
        drop_sorted = before >= top_p  # never drops the first token
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _as_batch(prompts: Prompts) -> tuple[list[list[int]], bool]:
    if isinstance(prompts, Tensor):
        if prompts.dim() == 1:
            return [prompts.tolist()], True
        if prompts.dim() == 2:
            return prompts.tolist(), False
        raise ValueError(f"prompt tensor must be 1-D or 2-D, got shape {tuple(prompts.shape)}")
    if isinstance(prompts, Sequence) and len(prompts) > 0 and isinstance(prompts[0], int):
        return [list(prompts)], True
    if isinstance(prompts, Sequence) and all(isinstance(p, (Sequence, Tensor)) for p in prompts):
        return [list(p.tolist() if isinstance(p, Tensor) else p) for p in prompts], False
    raise ValueError("prompts must be a list of token ids, a list of such lists, or a tensor")


def stream(
    model: DecoderLM,
    prompts: Prompts,
    max_new_tokens: int = 32,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    generator: torch.Generator | None = None,
    stop_tokens: Sequence[int] | None = None,
    use_cache: bool = True,
    pad_id: int = 0,
    compile: bool = False,
    overflow: str = "slide",
) -> Iterator[int] | Iterator[list[int | None]]:
    """Yield tokens as they are produced: an int per step for a single prompt, a list with
    one int (or None once that row has stopped) per step for a batch. A row stops at a stop
    token (not yielded) or after ``max_new_tokens``.

    Prompts longer than ``max_seq_len`` are cropped to their last ``max_seq_len`` tokens.
    When the context fills up while generating, it slides by half: the model goes on from
    the last ``max_seq_len - max_seq_len // 2`` tokens (re-encoded once into the cache), so
    it always sees between half and all of ``max_seq_len`` recent tokens and each new token
    costs O(1) forward tokens on average (re-encoding every step would cost max_seq_len).
    Cached and uncached decoding follow the same windows and agree.

    ``overflow`` says what happens when the context fills up: ``"slide"`` (above, the
    default), ``"roll"`` (decode on with a rolling cache: each layer keeps its last
    max_seq_len entries, or its window's, overwriting the oldest, so memory stays flat
    however long generation runs and nothing is re-encoded; exact sliding-window attention
    over the whole stream; needs relative positions, rope or none, and the cache) or
    ``"stop"`` (every row ends when prompt + new tokens reach max_seq_len).

    ``compile=True`` decodes with a fixed-shape cache and a ``torch.compile``d step
    (compiled once per model and batch shape; worth it for long generations)."""
    check_sampling(temperature, top_k, top_p)
    if overflow not in OVERFLOW_MODES:
        raise ValueError(f"overflow must be one of {', '.join(OVERFLOW_MODES)}, got {overflow!r}")
    if overflow == "roll" and not (use_cache and model.relative_positions):
        raise ValueError(
            "overflow='roll' decodes with a rolling cache: it needs use_cache=True and relative "
            f"positions (rope or none); this model uses {model.cfg.position.kind!r} positions"
        )
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    rows, single = _as_batch(prompts)
    if any(len(r) == 0 for r in rows):
        raise ValueError("every prompt needs at least one token")
    vocab = model.cfg.vocab_size
    if any(not 0 <= tok < vocab for r in rows for tok in r):
        raise ValueError(f"prompt token ids must be in [0, {vocab})")
    limit = model.cfg.max_seq_len
    if any(len(r) > limit for r in rows):
        warnings.warn(
            f"prompt longer than max_seq_len={limit}: keeping its last {limit} tokens",
            stacklevel=2,
        )
        rows = [r[-limit:] for r in rows]
    longest = max(len(r) for r in rows)
    if overflow == "stop":
        max_new_tokens = min(max_new_tokens, limit - longest)
    elif overflow == "slide" and longest + max_new_tokens > limit:
        warnings.warn(
            f"prompt + max_new_tokens exceeds max_seq_len={limit}: when the context is full it "
            f"slides to its last {limit - limit // 2} tokens",
            stacklevel=2,
        )
    if generator is None and seed is not None:
        generator = torch.Generator(device=model.tok_emb.weight.device).manual_seed(seed)
    stops = torch.tensor(sorted(set(stop_tokens or ())), dtype=torch.long)
    return _decode(
        model,
        rows,
        single,
        max_new_tokens,
        use_cache,
        pad_id,
        stops,
        dict(temperature=temperature, top_k=top_k, top_p=top_p, generator=generator),
        compile,
        overflow == "roll",
    )


OVERFLOW_MODES = ("slide", "roll", "stop")


def _decode(
    model, rows, single, max_new_tokens, use_cache, pad_id, stops, sampling, compile, roll=False
):
    device = model.tok_emb.weight.device
    b, limit = len(rows), model.cfg.max_seq_len
    longest = max(len(r) for r in rows)
    seq = torch.full((b, longest), pad_id, dtype=torch.long, device=device)  # (b, T)
    valid = torch.zeros((b, longest), dtype=torch.bool, device=device)
    for i, r in enumerate(rows):  # left padding: each row ends at the last column
        seq[i, longest - len(r) :] = torch.tensor(r, dtype=torch.long)
        valid[i, longest - len(r) :] = True
    stops = stops.to(device)
    done = torch.zeros(b, dtype=torch.bool, device=device)

    keep = limit - limit // 2  # tokens kept when a row's context slides
    # Each row's context is seq[row, starts[row]:]: at most `limit` real tokens, sliding
    # per row (a row's windows do not depend on the other prompts of the batch).
    first_real = [longest - len(r) for r in rows]
    starts = torch.tensor(
        [max(f, f + len(r) - limit) for f, r in zip(first_real, rows)], device=device
    )

    def window():
        lo = int(starts.min())
        cols = torch.arange(lo, seq.shape[1], device=device)
        w_valid = valid[:, lo:] & (cols[None, :] >= starts[:, None])
        return seq[:, lo:], (w_valid if not bool(w_valid.all()) else None)

    cache = None
    step_fn = _forward_last
    if use_cache and max_new_tokens > 0:
        capacity = limit if roll else min(limit, longest + max_new_tokens)
        cache = model.new_cache(b, capacity, static=compile, rolling=roll)
        if compile:
            step_fn = _compiled_step(model)
    if max_new_tokens > 0:
        ids, mask = window()
        logits = _forward_last(model, ids, mask, cache)  # prefill
    for step in range(max_new_tokens):
        nxt = sample_next(logits, **sampling)  # (b,)
        if stops.numel():
            done = done | torch.isin(nxt, stops)
        out = [None if d else int(t) for t, d in zip(nxt.tolist(), done.tolist())]
        if all(o is None for o in out):
            return
        yield out[0] if single else out
        if step == max_new_tokens - 1:
            return
        nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
        if roll:  # the cache holds the context: nothing grows, nothing is re-encoded
            logits = step_fn(model, nxt[:, None], None, cache)
            continue
        seq = torch.cat((seq, nxt[:, None]), dim=1)
        valid = torch.cat((valid, torch.ones_like(valid[:, :1])), dim=1)
        full = seq.shape[1] - starts > limit  # (b,) rows whose context overflows
        slide = bool(full.any())
        if slide:
            starts = torch.where(full, seq.shape[1] - keep, starts)
        if cache is None:
            ids, mask = window()
            logits = _forward_last(model, ids, mask, None)
        elif not slide:
            logits = step_fn(model, nxt[:, None], None, cache)  # decode one token
        else:  # re-encode the kept tokens: positions restart, so the cache does too
            cache.reset()
            ids, mask = window()
            logits = _forward_last(model, ids, mask, cache)


@torch.inference_mode()
def _forward_last(model, ids: Tensor, mask: Tensor | None, cache) -> Tensor:
    """The logits (b, V) of the last position, in eval mode."""
    was_training = model.training
    if was_training:
        model.eval()
    try:
        return model(ids, cache=cache, attention_mask=mask, last_only=True).logits[:, -1]
    finally:
        if was_training:
            model.train()


def _compiled_step(model):
    """One decode step compiled with fullgraph=True (kept on the model: compiled once)."""
    step = getattr(model, "_compiled_decode_step", None)
    if step is None:

        def decode_one(model, ids, mask, cache):
            return model(ids, cache=cache, last_only=True).logits[:, -1]

        compiled = torch.compile(decode_one, fullgraph=True, dynamic=False)

        @torch.inference_mode()
        def step(model, ids, mask, cache):
            return compiled(model, ids, None, cache)

        object.__setattr__(model, "_compiled_decode_step", step)  # not a submodule
    return step


def generate(
    model: DecoderLM, prompts: Prompts, max_new_tokens: int = 32, **kwargs
) -> list[int] | list[list[int]]:
    """The new tokens: a list for one prompt, a list of lists for a batch (each row stops at
    its first stop token, which is not included). Options as in :func:`stream`."""
    it = stream(model, prompts, max_new_tokens, **kwargs)
    batch, single = _as_batch(prompts)
    if single:
        return list(it)
    rows: list[list[int]] = [[] for _ in batch]
    for step in it:
        for r, tok in zip(rows, step):
            if tok is not None:
                r.append(tok)
    return rows
