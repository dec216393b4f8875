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


def sample_next(
    logits: Tensor,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """logits (b, V) -> next tokens (b,). temperature 0 is greedy (argmax)."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (b, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
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
) -> Iterator[int] | Iterator[list[int | None]]:
    """Yield tokens as they are produced: an int per step for a single prompt, a list with
    one int (or None once that row has stopped) per step for a batch. A row stops at a stop
    token (not yielded) or after ``max_new_tokens``.

    Prompts longer than ``max_seq_len`` are cropped to their last ``max_seq_len`` tokens;
    while generating, the model sees the last ``max_seq_len`` tokens (with the cache, it is
    rebuilt from them when full), so cached and uncached decoding agree."""
    check_sampling(temperature, top_k, top_p)
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
    if longest + max_new_tokens > limit:
        warnings.warn(
            f"prompt + max_new_tokens exceeds max_seq_len={limit}: the context will be cropped "
            f"to the last {limit} tokens",
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
    )


def _decode(model, rows, single, max_new_tokens, use_cache, pad_id, stops, sampling):
    device = model.tok_emb.weight.device
    b, limit = len(rows), model.cfg.max_seq_len
    longest = max(len(r) for r in rows)
    seq = torch.full((b, longest), pad_id, dtype=torch.long, device=device)  # (b, T)
    valid = torch.zeros((b, longest), dtype=torch.bool, device=device)
    for i, r in enumerate(rows):  # left padding: each row ends at the last column
        seq[i, longest - len(r) :] = torch.tensor(r, dtype=torch.long)
        valid[i, longest - len(r) :] = True
    padded = not bool(valid.all())
    stops = stops.to(device)
    done = torch.zeros(b, dtype=torch.bool, device=device)

    @torch.inference_mode()
    def forward(ids, mask, cache):
        was_training = model.training
        if was_training:
            model.eval()
        try:
            return model(ids, cache=cache, attention_mask=mask, last_only=True).logits[:, -1]
        finally:
            if was_training:
                model.train()

    def window():
        w_valid = valid[:, -limit:]
        return seq[:, -limit:], (w_valid if not bool(w_valid.all()) else None)

    cache = None
    if use_cache and max_new_tokens > 0:
        cache = model.new_cache(b, min(limit, longest + max_new_tokens))
    if max_new_tokens > 0:
        ids, mask = window()
        logits = forward(ids, mask if padded else None, cache)  # prefill
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
        seq = torch.cat((seq, nxt[:, None]), dim=1)
        valid = torch.cat((valid, torch.ones_like(valid[:, :1])), dim=1)
        if cache is None:
            ids, mask = window()
            logits = forward(ids, mask, None)
        elif cache.length < cache.max_len:
            logits = forward(nxt[:, None], None, cache)  # decode one token
        else:  # cache full: rebuild it from the last max_seq_len tokens
            cache.reset()
            ids, mask = window()
            logits = forward(ids, mask, cache)


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
