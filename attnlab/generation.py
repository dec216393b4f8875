"""Autoregressive generation: greedy, temperature, top-k, top-p sampling; stop tokens;
streaming; batched prompts of different lengths (left padded) with a KV cache.

Shapes: b batch, T tokens so far, V vocabulary size.
"""

from __future__ import annotations

import contextlib
import functools
import math
import numbers
import types
import warnings
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch
from torch import Tensor

from attnlab.functional.softmax import softmax_dtype
from attnlab.nn.linear import set_layout
from attnlab.nn.modes import enter_eval, restore

if TYPE_CHECKING:
    from attnlab.models.decoder import DecoderLM

# One prompt (token ids) or a batch of them (rows may differ in length).
Prompts = Tensor | np.ndarray | Sequence[int] | Sequence[Sequence[int] | Tensor]


def _is_int(value) -> bool:
    """A Python or numpy integer (not a bool)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    if not 0 <= temperature < math.inf:  # also rejects NaN
        raise ValueError(f"temperature must be finite and >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and not _is_int(top_k):
        # (a float reached torch.topk at the first token: a TypeError, after stream() had
        # returned, naming topk's argument 'k')
        raise ValueError(f"top_k must be an integer >= 1, got {top_k!r}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


class NonFiniteLogitsError(ValueError):
    """The model's next-token logits hold NaN or inf, so nothing can be sampled from them."""

    def __init__(self) -> None:
        super().__init__(
            "the model's next-token logits are not finite (NaN or inf): its weights are "
            "corrupt or overflow the dtype they were loaded in (try float32)"
        )


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
    ``GREEDY_BELOW_TEMPERATURE``) is greedy (argmax). Applied in transformers' order:
    temperature, then top-k, then top-p, on float32 (float64 kept) logits. ``top_k`` keeps
    exactly k tokens (ties at the k-th logit go to the lowest index, as argmax's: top_k=1 is
    greedy; transformers' TopKLogitsWarper keeps every tie). ``top_p`` keeps as many tokens
    as transformers' TopPLogitsWarper; of tokens tied at its boundary, the lowest indices
    (transformers' choice among them follows its sort's order of ties)."""
    if temperature < GREEDY_BELOW_TEMPERATURE:
        return logits.argmax(dim=-1)
    logits = softmax_dtype(logits) / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        # exactly k per row: those above the k-th logit, then the lowest-index ties with it
        # (topk's own order among ties is unspecified)
        kth = logits.topk(top_k, dim=-1).values[:, -1:]  # (b, 1)
        above, tied = logits > kth, logits == kth
        room = top_k - above.sum(dim=-1, keepdim=True)
        keep = above | (tied & (tied.cumsum(dim=-1) <= room))
        logits = logits.masked_fill(~keep, float("-inf"))
    if top_p is not None and top_p < 1.0:
        # Keep the smallest set of most likely tokens whose probability reaches top_p; ties
        # in the order of their index (stable: an unstable sort orders a large row's ties
        # arbitrarily), so tied tokens at the boundary go to the lowest index, as top-k's.
        sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # probability mass ranked above each token
        drop_sorted = before >= top_p  # never drops the first token
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)
    try:
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    except RuntimeError as e:  # "probability tensor contains either inf, nan or element < 0"
        if "probability tensor" in str(e):
            raise NonFiniteLogitsError() from None
        raise


def _ids(row) -> list[int]:
    """One prompt as a list of Python ints (numpy integers, as a numpy array's or a
    tokenizer's ``encode_array``'s, become ints)."""
    if isinstance(row, (Tensor, np.ndarray)):
        row = row.tolist()
    return [int(tok) if isinstance(tok, numbers.Integral) else tok for tok in row]


def _as_batch(prompts: Prompts) -> tuple[list[list[int]], bool]:
    if isinstance(prompts, (Tensor, np.ndarray)):  # a numpy array as the tensor it holds
        if prompts.ndim == 1:
            return [_ids(prompts)], True
        if prompts.ndim == 2:
            return [_ids(row) for row in prompts], False
        raise ValueError(f"prompt tensor must be 1-D or 2-D, got shape {tuple(prompts.shape)}")
    # numbers.Integral, not int: a list of numpy integers is a list of token ids too (it
    # was refused as "must be a list of token ids")
    if (
        isinstance(prompts, Sequence)
        and len(prompts) > 0
        and isinstance(prompts[0], numbers.Integral)
    ):
        return [_ids(prompts)], True
    if isinstance(prompts, Sequence) and all(
        isinstance(p, (Sequence, Tensor, np.ndarray)) for p in prompts
    ):
        return [_ids(p) for p in prompts], False
    raise ValueError("prompts must be a list of token ids, a list of such lists, or a tensor")


def _prompt_rows(prompts: Prompts) -> tuple[list[list[int]], bool]:
    """:func:`_as_batch`, refusing no prompt and empty prompts."""
    rows, single = _as_batch(prompts)
    if not rows:
        raise ValueError("no prompt: give at least one token id (or a list of prompts)")
    if any(len(r) == 0 for r in rows):
        raise ValueError("every prompt needs at least one token")
    # torch.tensor(row, dtype=long) would truncate 2.7 to token 2 (and a float tensor's ids)
    bad = next((tok for r in rows for tok in r if not isinstance(tok, numbers.Integral)), None)
    if bad is not None:
        raise ValueError(f"prompt token ids must be integers, got {bad!r}")
    return rows, single


def check_max_new_tokens(max_new_tokens) -> None:
    """Every model's ``generate``/``stream``: an integer >= 0 (0: no new tokens)."""
    if not _is_int(max_new_tokens) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")


def stop_ids(tokens, name: str = "stop_tokens") -> list[int]:
    """The end token(s) as a sorted list of ints: None (none), one id, or any iterable, numpy
    array or tensor of ids (transformers' ``eos_token_id`` is an int or a list)."""
    if tokens is None:
        return []
    if isinstance(tokens, (Tensor, np.ndarray)):
        tokens = tokens.tolist()
    if _is_int(tokens):
        tokens = [tokens]
    # any iterable of ids, as set(stop_tokens) took them (dict.values(), a generator)
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Iterable):
        raise ValueError(f"{name} must be a token id or a list of them, got {tokens!r}")
    tokens = list(tokens)
    bad = next((tok for tok in tokens if not _is_int(tok) or tok < 0), None)
    if bad is not None:
        raise ValueError(f"{name} must be token ids (integers >= 0), got {bad!r}")
    return sorted({int(tok) for tok in tokens})


def check_pad_id(pad_id, vocab_size: int) -> None:
    """The id that left-pads a batch (masked out, so any token of the vocabulary will do):
    an out-of-range id failed inside the embedding as an IndexError, None (a tokenizer's
    ``pad_token_id`` when it has none) as a TypeError of torch.full."""
    if not _is_int(pad_id) or not 0 <= pad_id < vocab_size:
        raise ValueError(
            f"pad_id must be a token id in [0, {vocab_size}) (padding is masked out: any "
            f"will do), got {pad_id!r}"
        )


def check_request(
    model, prompts: Prompts, max_new_tokens: int, seed: int | None, generator
) -> tuple[list[list[int]], bool, torch.Generator | None]:
    """The checks every language model's ``stream`` makes of its request: (prompt rows,
    whether one prompt was given, the generator ``seed`` makes when none is given)."""
    check_max_new_tokens(max_new_tokens)
    rows, single = _prompt_rows(prompts)
    vocab = model.cfg.vocab_size
    if any(not 0 <= tok < vocab for r in rows for tok in r):
        raise ValueError(f"prompt token ids must be in [0, {vocab})")
    if seed is not None and not _is_int(seed):  # a numpy integer is one too
        raise ValueError(f"seed must be an integer, got {seed!r}")
    if generator is not None and seed is not None:  # the seed was silently ignored
        raise ValueError("give seed or generator, not both: the generator would ignore the seed")
    if generator is None and seed is not None:
        generator = torch.Generator(device=model.tok_emb.weight.device).manual_seed(int(seed))
    return rows, single, generator


# The options of the language models' generate/stream (DecoderLM, Transformer-XL): an
# encoder-decoder's generate refuses them by name (a ValueError, not an unexpected keyword).
LM_OPTIONS = ("temperature", "top_k", "top_p", "seed", "generator", "stop_tokens", "pad_id",
              "compile", "overflow", "use_cache")  # fmt: skip


def refuse_options(
    what: str,
    options: dict,
    why: str = "it decodes greedily or with beam search (num_beams), ending at cfg.eos_id",
) -> None:
    """``options`` given to ``what`` (e.g. ``"Seq2SeqModel.generate"``) that it does not
    take: a ValueError naming those of :data:`LM_OPTIONS` (``why``: what it does instead;
    by default an encoder-decoder's), a TypeError (as Python's) for any other name."""
    unknown = [name for name in options if name not in LM_OPTIONS]
    if unknown:
        raise TypeError(f"{what}() got an unexpected keyword argument {unknown[0]!r}")
    if options:
        raise ValueError(f"{what} does not take {', '.join(options)}: {why}")


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
    compile: bool | str = "auto",
    overflow: str = "slide",
    _closed_loop: bool = False,
) -> Iterator[int] | Iterator[list[int | None]]:
    """Yield tokens as they are produced: an int per step for a single prompt, a list with
    one int (or None once that row has stopped) per step for a batch. A row stops at a stop
    token (not yielded) or after ``max_new_tokens``.

    Prompts longer than ``max_seq_len`` are cropped to their last ``max_seq_len`` tokens.
    When the context fills up while generating, it slides by half: the model goes on from
    the last ``max_seq_len - max_seq_len // 2`` tokens (re-encoded once into the cache), so
    it always sees between half and all of ``max_seq_len`` recent tokens and each new token
    costs O(1) forward tokens on average (re-encoding every step would cost max_seq_len).
    Cached and uncached decoding follow the same windows and agree (but for attention sinks
    with RoPE past the window, where the cache re-positions its keys, as StreamingLLM does).

    ``overflow`` says what happens when the context fills up: ``"slide"`` (above, the
    default), ``"roll"`` (decode on with a rolling cache: each layer keeps its last
    max_seq_len entries, or its window's, overwriting the oldest, so memory stays flat
    however long generation runs and nothing is re-encoded; exact sliding-window attention
    over the whole stream; needs relative positions, rope, none, alibi or relative_bias,
    and the cache) or
    ``"stop"`` (every row ends when prompt + new tokens reach max_seq_len).

    ``compile=True`` decodes with a fixed-shape cache and a ``torch.compile``d step
    (compiled once per model, batch size and capacity bucket; worth it for long
    generations). ``compile="auto"`` (the default) compiles only where the compile time
    pays off: when this model already has a compiled step, or for at least
    ``AUTO_COMPILE_MIN_TOKENS`` new tokens (batch x max_new_tokens); if compiling fails
    there (e.g. no C++ compiler for inductor), it warns once and decodes eagerly."""
    if compile not in (True, False, "auto"):
        raise ValueError(f"compile must be True, False or 'auto', got {compile!r}")
    check_sampling(temperature, top_k, top_p)
    _check_overflow(model, overflow, use_cache)
    check_pad_id(pad_id, model.cfg.vocab_size)
    rows, single, generator = check_request(model, prompts, max_new_tokens, seed, generator)
    rows, max_new_tokens, budgets = _fit_to_context(
        rows, max_new_tokens, model.cfg.max_seq_len, overflow
    )
    stops = torch.tensor(stop_ids(stop_tokens), dtype=torch.long)
    fallback = compile == "auto"
    if compile == "auto":
        compile = _compile_pays_off(model, len(rows) * max_new_tokens, use_cache)
    steps = _decode(
        model,
        rows,
        single,
        max_new_tokens,
        use_cache=use_cache,
        pad_id=pad_id,
        stops=stops,
        sampling=dict(temperature=temperature, top_k=top_k, top_p=top_p, generator=generator),
        compile=compile,
        roll=overflow == "roll",
        fallback=fallback,
        closed_loop=_closed_loop,
        budgets=budgets,
    )
    return _in_inference_mode(steps)


def roll_blocker(model: DecoderLM, use_cache: bool) -> str | None:
    """What keeps ``overflow="roll"`` from this model and ``use_cache``, the one place its
    rules live: ``"cache"`` (it decodes with a rolling cache), ``"nsa"`` (native sparse
    attention's blocks lie over cache slots from slot 0, which a rolling cache wraps),
    ``"positions"`` (a rolling cache keeps no absolute positions: it needs rope, none,
    alibi or relative_bias),
    ``"longrope"`` (past its original context LongRoPE rotates every key by other
    factors: the whole sequence is encoded again, which a rolling cache cannot), or None
    where rolling is possible."""
    if not use_cache:
        return "cache"
    if model.cfg.attention.kind == "nsa":
        return "nsa"
    if longrope_switch(model) is not None:
        return "longrope"
    if not model.relative_positions:
        return "positions"
    return None


def longrope_switch(model) -> int | None:
    """The context length past which a LongRoPE model rotates by its long factors
    (``RotaryEmbedding.switch_length``); None without LongRoPE. A cached decode encodes the
    sequence again into an empty cache when its context first runs past it, as
    transformers' Phi-3 does: the cached keys were rotated by the short factors."""
    return getattr(getattr(model, "rope", None), "switch_length", None)


def _check_overflow(model: DecoderLM, overflow: str, use_cache: bool) -> None:
    """``stream``'s ``overflow`` is one of OVERFLOW_MODES, and "roll" one this model and
    ``use_cache`` allow (``roll_blocker``)."""
    if overflow not in OVERFLOW_MODES:
        raise ValueError(f"overflow must be one of {', '.join(OVERFLOW_MODES)}, got {overflow!r}")
    blocker = roll_blocker(model, use_cache) if overflow == "roll" else None
    if blocker == "cache":
        raise ValueError("overflow='roll' decodes with a rolling cache: it needs use_cache=True")
    if blocker == "nsa":
        raise ValueError(
            "overflow='roll' is not available for native sparse attention: its blocks lie "
            "over cache slots from slot 0, which a rolling cache wraps; use overflow='slide'"
        )
    if blocker == "longrope":
        raise ValueError(
            "overflow='roll' is not available with LongRoPE (position.rope_scaling='longrope'): "
            "once the context passes its original length every key is rotated by the long "
            "factors, so the sequence is encoded again, which a rolling cache cannot; use "
            "overflow='slide' or 'stop'"
        )
    if blocker == "positions":
        raise ValueError(
            "overflow='roll' needs relative positions (rope, none, alibi or relative_bias): a "
            "rolling cache keeps no "
            f"absolute ones; this model uses {model.cfg.position.kind!r} positions: use "
            "overflow='slide' or 'stop'"
        )


def _fit_to_context(
    rows: list[list[int]], max_new_tokens: int, limit: int, overflow: str
) -> tuple[list[list[int]], int, list[int] | None]:
    """The prompt ``rows`` cropped to the context of ``limit`` tokens, the new tokens to
    decode, and (overflow="stop", rows that differ) each row's own number of them; warns
    (for ``stream``'s caller) of a cropped prompt and of a context that will slide."""
    if any(len(r) > limit for r in rows):
        warnings.warn(
            f"prompt longer than max_seq_len={limit}: keeping its last {limit} tokens",
            stacklevel=3,
        )
        rows = [r[-limit:] for r in rows]
    longest = max(len(r) for r in rows)
    budgets = None  # per row: the new tokens it may have (overflow="stop", rows that differ)
    if overflow == "stop":
        # each row ends when its own prompt + new tokens reach max_seq_len
        room = [min(max_new_tokens, limit - len(r)) for r in rows]
        max_new_tokens = max(room)
        budgets = room if min(room) < max_new_tokens else None
    elif overflow == "slide" and longest + max_new_tokens > limit:
        warnings.warn(
            f"prompt + max_new_tokens exceeds max_seq_len={limit}: when the context is full it "
            f"slides to its last {limit - limit // 2} tokens",
            stacklevel=3,
        )
    return rows, max_new_tokens, budgets


def _compile_pays_off(model: DecoderLM, new_tokens: int, use_cache: bool) -> bool:
    """compile="auto": compile the decode step of ``new_tokens`` (batch x max_new_tokens)
    when this model already has one, or when there are enough new tokens to pay for
    compiling it, unless compiling has failed for this model before."""
    return (
        use_cache
        and not getattr(model, "_compile_failed", False)
        and (
            getattr(model, "_compiled_decode_step", None) is not None
            or new_tokens >= AUTO_COMPILE_MIN_TOKENS
        )
    )


def _in_inference_mode(steps: Iterator) -> Iterator:
    """``steps``, each computed in inference mode whatever the caller's mode (the caller's
    own code between them runs in its own). Every call then hands the compiled step
    inference tensors (tokens, static cache): dynamo guards on a tensor's dispatch keys,
    and ``model.generate`` (inference mode) after ``stream`` or ``generation.generate``
    (not) would otherwise compile a second version of the step for the same shapes."""
    with contextlib.closing(steps):
        while True:
            with torch.inference_mode():
                try:
                    step = next(steps)
                except StopIteration:
                    return
            yield step


OVERFLOW_MODES = ("slide", "roll", "stop")

# compile="auto": the new tokens from which compiling the decode step pays for itself.
# Break-even = compile time / time saved per token. Measured on a 2-core CPU
# (benchmarks/compile_decode.py, row-major compiled products): 10-15 s to compile (cold),
# saving 2-3.5 ms per token for a 30M model (3K-7K tokens) and about 1 ms for a 5M one
# (10K-19K). From 8K on the 30M model comes out ahead; the 5M one is slower there (by up to
# half) until 10K-19K.
AUTO_COMPILE_MIN_TOKENS = 8192


def _left_padded(rows: list[list[int]], pad_id: int, device) -> tuple[Tensor, Tensor]:
    """The prompt ``rows`` as one (b, T) batch, each row ending at the last column, and
    which of its entries are real tokens (b, T) bool."""
    b, longest = len(rows), max(len(r) for r in rows)
    seq = torch.full((b, longest), pad_id, dtype=torch.long, device=device)  # (b, T)
    valid = torch.zeros((b, longest), dtype=torch.bool, device=device)
    for i, r in enumerate(rows):
        seq[i, longest - len(r) :] = torch.tensor(r, dtype=torch.long)
        valid[i, longest - len(r) :] = True
    return seq, valid


def _decode(
    model,
    rows,
    single,
    max_new_tokens,
    *,
    use_cache,
    pad_id,
    stops,
    sampling,
    compile,
    roll=False,
    fallback=False,
    closed_loop=False,
    budgets=None,
):
    device = model.tok_emb.weight.device
    b, limit = len(rows), model.cfg.max_seq_len
    longest = max(len(r) for r in rows)
    seq, valid = _left_padded(rows, pad_id, device)  # (b, T)
    stops = stops.to(device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    if budgets is not None:  # a row is done once it has its budget of new tokens
        budgets = torch.tensor(budgets, device=device)

    keep = limit - limit // 2  # tokens kept when a row's context slides
    # Each row's context is seq[row, starts[row]:]: at most `limit` real tokens, sliding
    # per row (a row's windows do not depend on the other prompts of the batch).
    first_real = [longest - len(r) for r in rows]
    starts = torch.tensor(
        [max(f, f + len(r) - limit) for f, r in zip(first_real, rows)], device=device
    )

    min_start = int(starts.min())
    length = longest  # columns of seq, with the tokens not yet appended to it
    switch = longrope_switch(model)
    pending: list[Tensor] = []  # new tokens (b,) not yet in seq: appended when needed

    def window():
        nonlocal seq, valid
        if pending:  # one append for the tokens decoded since the last window
            seq = torch.cat((seq, torch.stack(pending, dim=1)), dim=1)
            valid = torch.cat((valid, valid.new_ones((b, len(pending)))), dim=1)
            pending.clear()
        cols = torch.arange(min_start, seq.shape[1], device=device)
        w_valid = valid[:, min_start:] & (cols[None, :] >= starts[:, None])
        return seq[:, min_start:], (w_valid if not bool(w_valid.all()) else None)

    cache = None
    step_fn = _forward_last
    graphs = False  # the compiled step replays a CUDA graph
    if use_cache and max_new_tokens > 0:
        capacity = limit if roll else min(limit, longest + max_new_tokens)
        if compile and not roll:
            capacity = static_capacity(capacity, limit)
        if compile:
            step_fn = _compiled_step(model)
            graphs = getattr(step_fn, "cuda_graphs", False)
            if fallback:
                step_fn = _eager_if_compile_fails(step_fn)
        if graphs:
            cache, give_back = _graph_cache(model, b, capacity, roll)
        else:
            cache = model.new_cache(b, capacity, static=compile, rolling=roll)
    # Inside generate()'s own loop nothing the compiled graph depends on changes between
    # steps (same model, cache and shapes; only tensor values move), so once its guards have
    # passed, the following steps call the code that ran directly, without dynamo
    # (benchmarks/compile_decode.py compares with checking the guards at every step).
    # stream()'s caller runs code between tokens: there every step goes through dynamo.
    guards_passed = False

    def decode_one(nxt: Tensor) -> Tensor:
        nonlocal guards_passed
        if not compile:
            return step_fn(model, nxt[:, None], None, cache)
        logits = step_fn(model, nxt[:, None], None, cache, skip_guards=guards_passed)
        guards_passed = closed_loop
        return logits

    # generate()'s own loop without stop tokens never needs a token on the host before the
    # end: it yields the device tensors and reads them all at once (collect), so a GPU runs
    # step after step without waiting for the host to read each token.
    on_device = closed_loop and not stops.numel() and budgets is None
    # Sampling refuses NaN or inf logits itself; greedy decoding checks the largest logit
    # of each row (NaN wins max): at each step where the tokens are read anyway, else once
    # at the end, before generate returns anything.
    greedy = sampling["temperature"] < GREEDY_BELOW_TEMPERATURE
    maxima: list[Tensor] = []

    def check_finite() -> None:
        if maxima and not bool(torch.isfinite(torch.stack(maxima)).all()):
            raise NonFiniteLogitsError()

    try:
        if max_new_tokens > 0:
            ids, mask = window()
            logits = _forward_last(model, ids, mask, cache)  # prefill
        for step in range(max_new_tokens):
            if greedy:
                top, nxt = logits.max(dim=-1)  # (b,): argmax, and its logit
                if on_device:
                    maxima.append(top)
                elif not all(map(math.isfinite, top.tolist())):
                    raise NonFiniteLogitsError()
            else:
                nxt = sample_next(logits, **sampling)  # (b,)
            if stops.numel() or budgets is not None:  # (else no row is ever done)
                if stops.numel():
                    done = done | torch.isin(nxt, stops)
                if budgets is not None:
                    done = done | (budgets <= step)
                out = [None if d else int(t) for t, d in zip(nxt.tolist(), done.tolist())]
                if all(o is None for o in out):
                    return
                nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
            else:
                out = nxt if on_device else nxt.tolist()
            if on_device and step == max_new_tokens - 1:
                check_finite()
            yield out[0] if single else out
            if step == max_new_tokens - 1:
                return
            if roll:  # the cache holds the context: nothing grows, nothing is re-encoded
                logits = decode_one(nxt)
                continue
            pending.append(nxt)
            length += 1
            slide = length - min_start > limit  # some row's context overflows
            if slide:
                full = length - starts > limit  # (b,) those rows
                starts = torch.where(full, length - keep, starts)
                min_start = int(starts.min())
            # LongRoPE: the longest context first runs past the original length, and every
            # key turns to the long factors: the cache's were rotated by the short ones
            switched = switch is not None and length - min_start == switch + 1
            if cache is None:
                ids, mask = window()
                logits = _forward_last(model, ids, mask, None)
            elif not (slide or switched):
                logits = decode_one(nxt)
            else:  # re-encode the kept tokens (a slide: positions restart, so the cache does too)
                cache.reset(in_place=graphs)
                guards_passed = False  # a reset cache: the next step checks its guards
                ids, mask = window()
                logits = _forward_last(model, ids, mask, cache)
    finally:
        if graphs:
            give_back()  # for the next generation of this shape


@torch.inference_mode()
def _forward_last(model, ids: Tensor, mask: Tensor | None, cache) -> Tensor:
    """The logits (b, V) of the last position, in eval mode."""
    modes = enter_eval(model) if model.training else None
    try:
        return model(ids, cache=cache, attention_mask=mask, last_only=True).logits[:, -1]
    finally:
        if modes is not None:
            restore(modes)


STATIC_CAPACITY_MIN = 64


def static_capacity(needed: int, limit: int) -> int:
    """The capacity of a compiled decode's static cache: the next power of two >= ``needed``
    (at least ``STATIC_CAPACITY_MIN``), capped at ``limit`` (max_seq_len). The compiled
    step's shapes follow the capacity, so calls of different lengths share a few buckets
    instead of recompiling for each; the spare slots are masked out (their keys are a few
    MB at most against the weights read every step)."""
    bucket = max(STATIC_CAPACITY_MIN, 1 << max(needed - 1, 0).bit_length())
    return min(bucket, limit)


def _eager_if_compile_fails(step_fn):
    """``step_fn``, or the eager step (on the same static cache) if its first call, which
    compiles, fails; the model remembers the failure, so "auto" stops trying, and gets its
    eager weight layout back. Errors of later calls are not caught (on CUDA that includes
    the recording of the CUDA graph, which cudagraph trees do at a later call)."""
    state = {"first": True, "eager": False}

    def step(model, ids, mask, cache, skip_guards=False):
        if state["eager"]:
            return _forward_last(model, ids, mask, cache)
        if not state["first"]:
            return step_fn(model, ids, mask, cache, skip_guards)
        state["first"] = False
        try:
            return step_fn(model, ids, mask, cache)
        except Exception as e:  # inductor's compiler errors have no common base class
            state["eager"] = True
            object.__setattr__(model, "_compile_failed", True)
            if next(model.parameters()).device.type == "cpu":
                set_layout(model, "input")  # the eager layout back
            first_line = str(e).splitlines()[0] if str(e) else ""
            warnings.warn(
                f"compiling the decode step failed ({type(e).__name__}: {first_line}); "
                "decoding eagerly (pass compile=False to skip the attempt)",
                stacklevel=2,
            )
            return _forward_last(model, ids, mask, cache)

    return step


# On CUDA the compiled decode step replays a CUDA graph (inductor's cudagraph trees, as
# torch.compile's mode="reduce-overhead"): one launch per token instead of one per kernel.
# False: compiled kernels launched one by one (for comparison, benchmarks/vs_transformers.py).
CUDA_GRAPHS = True


def _graph_cache(model, batch: int, capacity: int, rolling: bool):
    """The static cache of a CUDA-graph decode, and a function that gives it back: one per
    shape, kept on the model and zeroed in place for its next generation, so the graph
    replays at the same addresses (as transformers' StaticCache). With a fresh cache each
    time torch would record the graph again for every generation and keep every recording
    (some torch versions stop using the graph after 128 re-records). A generation
    holds the cache until it ends; one running beside it gets a fresh one."""
    pool = model.__dict__.setdefault("_graph_caches", {})
    p = model.tok_emb.weight
    key = (batch, capacity, rolling, p.dtype, p.device)
    cache = pool.pop(key, None)
    if cache is None:
        cache = model.new_cache(batch, capacity, static=True, rolling=rolling)
        for t in cache.state():  # written in place at every step, at fixed addresses
            torch._dynamo.mark_static_address(t, guard=False)
    else:
        cache.reset(in_place=True)
    return cache, lambda: pool.setdefault(key, cache)


# Compiled versions of one model's decode step (batch sizes x capacity buckets) before
# dynamo refuses to compile another (its default, 8, is a handful of batch sizes).
RECOMPILE_LIMIT = 64


@functools.lru_cache(maxsize=8)
def _recompile_limit_patch(limit: int):
    """One reusable ``torch._dynamo.config.patch(recompile_limit=limit)`` per limit: each
    patch object sets a ContextVar of its own that stays in the thread's context after
    the ``with`` (torch 2.13), so a new one per guarded step (every token of a compiled
    ``stream``) grew the context by one variable per token, for good."""
    return torch._dynamo.config.patch(recompile_limit=limit)


def _forget_compiled(code) -> None:
    """Drop what dynamo compiled from ``code`` (a model's own decode-step code object),
    once the model is gone: torch keeps the code object, so its compiled graphs (and the
    ``__compiled_fn`` global each installs in this module) outlived every model that was
    compiled and freed."""
    try:
        torch._dynamo.eval_frame.reset_code(code)
    except (AttributeError, TypeError, RuntimeError):  # another torch's internals
        pass


def _compiled_step(model):
    """One decode step compiled with fullgraph=True (kept on the model: compiled once), in
    eval mode like the eager step (a model in training mode is switched for the call).
    On CPU the model's Linear weights are first re-stored row-major, in place (the layout
    the compiled one-vector products read fastest, see ``attnlab.nn.linear``); on CUDA the
    step is a CUDA graph (``CUDA_GRAPHS``)."""
    step = getattr(model, "_compiled_decode_step", None)
    device = next(model.parameters()).device.type
    cuda_graphs = CUDA_GRAPHS and device == "cuda"
    if step is not None and getattr(step, "cuda_graphs", cuda_graphs) != cuda_graphs:
        step = None  # CUDA_GRAPHS changed since this model's step was compiled
    if step is None:
        if device == "cpu":
            set_layout(model, "rows")

        def decode_one(model, ids, mask, cache):
            return model(ids, cache=cache, last_only=True).logits[:, -1]

        # A code object of its own per model: dynamo keeps, and limits, the versions it
        # compiles (one per batch size and capacity bucket) per code object.
        decode_one = types.FunctionType(
            decode_one.__code__.replace(), decode_one.__globals__, "decode_one"
        )

        # Inductor's per-call asserts of every input's size and stride repeat what dynamo's
        # guards check before a guarded call, and a direct call (below) reuses only code
        # whose guards passed for that cache: off, 1.6% of a 30M model's step.
        options = {"size_asserts": False, "triton.cudagraphs": cuda_graphs}
        compiled = torch.compile(decode_one, fullgraph=True, dynamic=False, options=options)
        # per cache object: the code dynamo ran at its last guarded call with it, as a
        # plain function
        last_ran: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

        @torch.inference_mode()
        def step(model, ids, mask, cache, skip_guards=False):
            """``skip_guards``: the caller vouches that nothing but tensor values changed
            since this step last ran (and passed its guards) with this model and cache;
            the step then calls the code dynamo ran then directly, without its guards."""
            modes = enter_eval(model) if model.training else None
            try:
                code = last_ran.get(cache) if skip_guards else None
                if code is not None:
                    return code(model, ids, None, cache)
                limit = max(RECOMPILE_LIMIT, torch._dynamo.config.recompile_limit)
                with _recompile_limit_patch(limit):
                    out = compiled(model, ids, None, cache)
                code = _code_that_ran(decode_one, model, ids, None, cache)
                if code is not None:
                    last_ran[cache] = code
                return out
            finally:
                if modes is not None:
                    restore(modes)

        step.cuda_graphs = cuda_graphs
        object.__setattr__(model, "_compiled_decode_step", step)  # not a submodule
        weakref.finalize(model, _forget_compiled, decode_one.__code__).atexit = False
    return step


def _code_that_ran(fn, *args):
    """The compiled code dynamo keeps for ``fn`` whose guards pass for ``args``, as a
    function to call without dynamo: no cache lookup, no guards, no frame hooks, so
    1-2 tenths of a millisecond less per step of a 30M model on CPU (benchmarks/
    compile_decode.py). It is the bytecode dynamo itself runs (inputs gathered, the
    compiled graph called, Python side effects replayed), and each call counts itself as
    dynamo's entry does: CUDA graphs (cudagraph trees) tell one call from the next by that
    count, and without it would record each step as a new graph chained to the last.
    None where torch offers no such entry (the caller then keeps calling through dynamo)."""
    try:
        tracker = torch._dynamo.mutation_guard.GenerationTracker
        if not isinstance(tracker.generation, int):
            return None
        entries = torch._dynamo.eval_frame._debug_get_cache_entry_list(fn.__code__)
        names = fn.__code__.co_varnames[: fn.__code__.co_argcount]
        f_locals = dict(zip(names, args))
        for entry in entries:  # dynamo's own order: the first whose guards pass runs
            if entry.guard_manager.check(f_locals):
                code = types.FunctionType(
                    entry.code, fn.__globals__, fn.__name__, None, fn.__closure__
                )
                return _counted(code, tracker)
    except (AttributeError, TypeError, RuntimeError):  # another torch's internals
        pass
    return None


def _counted(code, tracker):
    """``code`` that first counts a new invocation, as dynamo's entry does."""

    def call(*args):
        tracker.generation += 1
        return code(*args)

    return call


def generate(
    model: DecoderLM,
    prompts: Prompts,
    max_new_tokens: int = 32,
    *,
    num_beams: int = 1,
    length_penalty: float = 1.0,
    early_stopping: bool | str = True,
    **kwargs,
) -> list[int] | list[list[int]]:
    """The new tokens: a list for one prompt, a list of lists for a batch (each row stops at
    its first stop token, which is not included). Options as in :func:`stream`; with
    ``num_beams`` > 1 the best beam of :func:`beam_search` (``stop_tokens`` end beams;
    deterministic, so no sampling options; prompt + new tokens must fit max_seq_len;
    ``early_stopping`` as transformers', True by default)."""
    check_num_beams(num_beams)  # (0 or -1 decoded greedily, 2.5 failed inside topk)
    check_max_new_tokens(max_new_tokens)
    batch, single = _as_batch(prompts)
    if model.cfg.attention.kind == "nsa" and len({len(r) for r in batch}) > 1:
        # native sparse attention takes no left padding (its blocks start at slot 0)
        kw = dict(num_beams=num_beams, length_penalty=length_penalty, **kwargs)
        kw["early_stopping"] = early_stopping
        if num_beams == 1 and kw.get("seed") is not None:
            # the rows draw from one generator, as a padded batch's do: the seed given to
            # each row alone gave every row the same draws (different prompts, one text)
            _, _, kw["generator"] = check_request(
                model, batch, max_new_tokens, kw.pop("seed"), kw.get("generator")
            )
        return [generate(model, row, max_new_tokens, **kw) for row in batch]
    if num_beams > 1:
        sampling = _unused_by_beams(kwargs)
        if sampling or kwargs.get("use_cache") is False:
            raise ValueError(
                f"beam search (num_beams={num_beams}) is deterministic and cached; drop "
                f"{', '.join(sampling) or 'use_cache=False'}"
            )
        if max_new_tokens == 0:
            return [] if single else [[] for _ in batch]
        hyps = beam_search(
            model,
            batch,
            max_new_tokens,
            num_beams=num_beams,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            eos_id=stop_ids(kwargs.get("stop_tokens")),
            pad_id=kwargs.get("pad_id", 0),
        )
        if not all(hyps):  # every beam's score was NaN: none was ever kept
            raise NonFiniteLogitsError()
        rows = [row[0].tokens for row in hyps]
        return rows[0] if single else rows
    steps = stream(model, prompts, max_new_tokens, _closed_loop=True, **kwargs)
    return collect(steps, single, len(batch))


def _unused_by_beams(kwargs: dict) -> list[str]:
    """The options of :func:`stream` in ``kwargs`` that beam search would ignore: all but its
    stop tokens, pad id and cache, unless at their defaults (compile=False too: the search
    never compiles). seed=0 and top_k=0 used to pass (equal to 0.0), overflow="slide", the
    default, to be refused. A name stream does not take is Python's TypeError, as without
    beams."""
    import inspect

    params = inspect.signature(stream).parameters
    unused = []
    for name, value in kwargs.items():
        param = params.get(name)
        if param is None or param.kind is not inspect.Parameter.KEYWORD_ONLY:
            raise TypeError(f"generate() got an unexpected keyword argument {name!r}")
        if name in ("stop_tokens", "pad_id", "use_cache") or (name == "compile" and value is False):
            continue
        default = param.default
        if default is None or value is None:
            at_default = value is default
        else:
            at_default = isinstance(value, (str, numbers.Real)) and type(value) is not bool
            at_default = at_default and value == default
        if not at_default:
            unused.append(name)
    return unused


def collect(steps: Iterator, single: bool, n_rows: int) -> list[int] | list[list[int]]:
    """What a ``stream`` yielded, as ``generate`` returns it: the tokens of one prompt, or a
    list per row of a batch (the None after a row's stop token left out). Steps may also be
    tensors (generate's loop without stop tokens, read from the device once, here)."""
    steps = list(steps)
    if steps and isinstance(steps[0], Tensor):  # (b,) per step, or 0-d for one prompt
        return torch.stack(steps, dim=-1).tolist()
    if single:
        return steps
    rows: list[list[int]] = [[] for _ in range(n_rows)]
    for step in steps:
        for r, tok in zip(rows, step):
            if tok is not None:
                r.append(tok)
    return rows


# --------------------------------------------------------------------------- beam search
#
# One beam search serves every model (decoder-only, the Transformer encoder-decoder, the
# GRU encoder-decoder): the model is seen only through the first next-token logits and
# ``advance(source, tokens)``. Two scoring styles, picked by ``style``:
#
# "transformers" (default): transformers' generate(num_beams=k, length_penalty=a,
#     early_stopping=e). score = log p / n ** a; with e True (attnlab's default) a row
#     stops once k hypotheses have finished; with False (transformers' default) once k
#     have finished and the best live beam's log p / m ** a, m its length, is no better
#     than the k-th; with "never", m is max_new_tokens when a > 0 (its length when a <= 0).
#     At the last allowed step the best k continuations finish whether or not they end
#     in EOS.
# "gnmt": Wu et al. 2016 (GNMT, eq. 14), lp(n) = ((5 + n) / 6) ** a with a >= 0. A row
#     stops only when no live beam can still beat its n_best-th finished hypothesis: a
#     prefix's log p only falls as it grows and lp(n) <= lp(max_new_tokens), so none ends
#     above (its log p) / lp(max_new_tokens). Stopping at k finished (the shortcut above)
#     returned worse outputs than greedy on a peaked model: near-copies one token shorter
#     than the best prefix finish first and end the search before it does. At the length
#     limit, unfinished beams fill the list only when fewer than n_best have finished.
#
# Shared rules: n counts the EOS token; each step keeps the 2k best continuations of all
# beams by summed log-probability; those of the best k that end in EOS finish; the k best
# that do not go on; each row keeps its k best finished hypotheses.

BEAM_STYLES = ("transformers", "gnmt")


class Hypothesis(NamedTuple):
    """A beam: its new tokens (the end-of-sequence token not included), its score (the
    summed log-probability over the style's length penalty, the length counting the
    end-of-sequence token), its summed log-probability, and whether it ended with EOS
    (else it stopped at the length limit)."""

    tokens: list[int]
    score: float
    log_prob: float = 0.0
    finished: bool = True


def length_penalty(length: int, alpha: float, style: str = "transformers") -> float:
    """The divisor of a hypothesis' log-probability: length ** alpha (transformers) or
    ((5 + length) / 6) ** alpha (GNMT)."""
    if style == "gnmt":
        return ((5.0 + length) / 6.0) ** alpha
    return float(length) ** alpha


def block_tokens(scores: Tensor, ids: Sequence[int]) -> Tensor:
    """``scores`` (..., V) with -inf at the token ``ids``, which are then never chosen
    (transformers' ``bad_words_ids`` of single tokens: Marian's pad token)."""
    if not ids:
        return scores
    index = torch.tensor(list(ids), dtype=torch.long, device=scores.device)
    return scores.index_fill(-1, index, float("-inf"))


def force_tokens(scores: Tensor, ids: Sequence[int]) -> Tensor:
    """``scores`` (..., V) with 0 at the token ``ids`` and -inf elsewhere (transformers'
    ``ForcedEOSTokenLogitsProcessor`` at the last step); unchanged when ``ids`` is empty."""
    if not ids:
        return scores
    index = torch.tensor(list(ids), dtype=torch.long, device=scores.device)
    return torch.full_like(scores, float("-inf")).index_fill(-1, index, 0.0)


def check_num_beams(num_beams, n_best: int = 1) -> None:
    """num_beams an integer >= 1, and n_best (the hypotheses kept) from 1 to num_beams."""
    if not _is_int(num_beams) or num_beams < 1:
        raise ValueError(f"num_beams (beam_width) must be an integer >= 1, got {num_beams!r}")
    if not _is_int(n_best) or not 1 <= n_best <= num_beams:
        raise ValueError(f"n_best must be between 1 and num_beams ({num_beams}), got {n_best!r}")


def check_beams_can_fill(num_beams: int, vocab_size: int, max_new_tokens: int) -> None:
    """ValueError unless ``num_beams`` beams can all be filled: beam search keeps distinct
    continuations, and ``max_new_tokens`` tokens over a vocabulary of ``vocab_size`` have
    vocab_size ** max_new_tokens of them (vocab_size after the first token; the beams grow
    to num_beams as the prefixes do). A wider beam prunes nothing more: that many beams is
    an exhaustive search already, and a huge num_beams only ran out of memory, late."""
    limit = 1  # vocab_size ** max_new_tokens, counted only up to num_beams (no huge power)
    for _ in range(max_new_tokens):
        limit *= vocab_size
        if limit >= num_beams:
            return
    if num_beams > limit:
        raise ValueError(
            f"num_beams={num_beams} exceeds the {limit} distinct continuations of "
            f"max_new_tokens={max_new_tokens} tokens over a vocabulary of {vocab_size}: beam "
            f"search keeps distinct continuations, so beams past them stay empty; give "
            f"num_beams <= {limit}"
        )


def check_decoding(max_new_tokens, num_beams, n_best: int = 1) -> None:
    """An encoder-decoder's ``generate``: max_new_tokens, num_beams and n_best as every
    model's generate takes them (n_best at most num_beams)."""
    check_max_new_tokens(max_new_tokens)
    check_num_beams(num_beams, n_best)


def check_beam_search(
    num_beams: int,
    max_new_tokens: int,
    n_best: int,
    alpha: float,
    style: str,
    early_stopping: bool | str = True,
):
    if style not in BEAM_STYLES:
        raise ValueError(f"style must be one of {', '.join(BEAM_STYLES)}, got {style!r}")
    if not (early_stopping is True or early_stopping is False or early_stopping == "never"):
        raise ValueError(f"early_stopping must be True, False or 'never', got {early_stopping!r}")
    if style == "gnmt" and early_stopping is not True:
        raise ValueError("early_stopping applies to style='transformers' (GNMT has its own rule)")
    check_num_beams(num_beams, n_best)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens (max_len) must be >= 1, got {max_new_tokens}")
    if style == "gnmt" and not alpha >= 0:  # the stopping bound needs lp to grow; rejects nan
        raise ValueError(f"length_penalty must be >= 0 for GNMT scoring, got {alpha}")
    if not math.isfinite(alpha):  # every score would be nan (or 0): no ranking at all
        raise ValueError(f"length_penalty must be a finite number, got {alpha}")


def read_together(*tensors: Tensor) -> list[list[list]]:
    """(b, n_i) tensors read to the host in one transfer (one synchronisation with the
    device, not one per tensor): each as its rows of Python floats, ints or bools, as its
    own ``tolist()`` gives them. They travel as one float64 tensor, exact for float32 and
    float64 values and for integers below 2**53; MPS has no float64, so there each tensor
    is read on its own."""
    if tensors[0].device.type == "mps":
        return [t.tolist() for t in tensors]
    rows = torch.cat([t.to(torch.float64) for t in tensors], dim=1).tolist()  # (b, sum n_i)
    out, start = [], 0
    for t in tensors:
        end = start + t.shape[1]
        kind = float if t.is_floating_point() else bool if t.dtype == torch.bool else int
        out.append([list(map(kind, row[start:end])) for row in rows])
        start = end
    return out


def path_tokens(node) -> list[int]:
    """The tokens of a beam kept as linked (previous, token) nodes, first to last."""
    tokens = []
    while node is not None:
        node, token = node
        tokens.append(token)
    return tokens[::-1]


def beam_search_core(
    logits: Tensor,
    advance,
    *,
    num_beams: int,
    max_new_tokens: int,
    eos_id: int | Sequence[int] | None,
    length_penalty: float = 1.0,
    n_best: int = 1,
    style: str = "transformers",
    blocked_ids: Sequence[int] = (),
    renormalize: bool = False,
    forced_last_ids: Sequence[int] = (),
    early_stopping: bool | str = True,
    forced_first_ids: Sequence[int] = (),
) -> list[list[Hypothesis]]:
    """Beam search over any model, given the next-token ``logits`` (b, V) of each row's
    input and ``advance(source, tokens)``: make decoding row j continue row ``source[j]``
    (reorder caches / states), feed ``tokens`` (b * beams,) and return the next logits
    (b * beams, V). Rows are grouped by input: row j continues one of the beams of input
    row j // beams, so what all beams of an input share (an encoder's output) needs
    reordering only when the number of beams changes. ``eos_id``: the end token(s). The
    number of beams per row is ``num_beams`` (fewer at first when the vocabulary is small).
    Returns, per row, its ``n_best`` best hypotheses, best first (scoring and stopping: the
    comment above, ``style``). ``blocked_ids`` are never chosen: as in transformers, their
    log-probabilities become -inf after the log-softmax, and with ``renormalize`` the rest
    are log-softmaxed again (``renormalize_logits``), else they keep the mass the blocked
    tokens had. At the last step only ``forced_last_ids`` may be chosen, each with
    log-probability 0 (before the renormalization): transformers' ``forced_eos_token_id``;
    at the first step only ``forced_first_ids`` (``forced_bos_token_id``), the last step's
    forcing taking precedence when they coincide (as transformers' processors apply them).
    ``early_stopping`` (True, False or "never"): when a row stops, as transformers'
    (the comment above; "transformers" style only)."""
    k, alpha = num_beams, length_penalty
    check_beam_search(k, max_new_tokens, n_best, alpha, style, early_stopping)
    gnmt = style == "gnmt"
    b, V = logits.shape
    check_beams_can_fill(k, V, max_new_tokens)
    device = logits.device
    stops = stop_ids(eos_id, "eos_id")
    eos = torch.tensor(stops, dtype=torch.long, device=device)
    bound_lp = _length_penalty(max_new_tokens, alpha, style)  # the largest a prefix can get
    scores = torch.zeros(b, 1, device=device)  # (b, beams): summed log-probs, -inf: dead
    # each row's live beams' tokens, kept on the host as linked (previous, token) nodes
    # (None: no tokens yet): a step adds one node per beam, whatever the length so far
    paths: list[list] = [[None] for _ in range(b)]  # (b, beams)
    finished: list[list[Hypothesis]] = [[] for _ in range(b)]
    done = [False] * b
    for step in range(max_new_tokens):
        beams = scores.shape[1]
        last = step == max_new_tokens - 1
        logp = block_tokens(torch.log_softmax(softmax_dtype(logits), dim=-1), blocked_ids)
        first = list(forced_first_ids) if step == 0 else []
        forced = list(forced_last_ids) if last else []
        logp = force_tokens(force_tokens(logp, first), forced)
        if renormalize and (blocked_ids or forced or first):
            logp = torch.log_softmax(logp, dim=-1)
        logp = logp.view(b, beams, V) + scores[..., None]  # (b, beams, V)
        # enough candidates that k beams live on even if every stop token is among them
        # (transformers keeps max(2, 1 + n_eos) * k)
        n_cand = min(max(2, 1 + len(stops)) * k, beams * V)
        top, flat = logp.view(b, beams * V).topk(n_cand, dim=-1)  # (b, C)
        beam, tok = flat // V, flat % V
        is_eos = torch.isin(tok, eos)
        ends = torch.ones_like(is_eos) if last and not gnmt else is_eos
        alive = torch.isfinite(top)
        n_keep = min(k, n_cand)
        going_on = top.masked_fill(ends | ~alive, float("-inf"))
        keep = going_on.topk(n_keep, dim=-1).indices  # (b, n_keep)
        kept = going_on.gather(1, keep)  # (b, n_keep), -inf where fewer beams go on
        penalty = _length_penalty(step + 1, alpha, style)
        # all the host needs of this step, read in one go (one synchronisation per step)
        top_l, beam_l, tok_l, eos_l, keep_l, kept_l = read_together(
            top, beam, tok, is_eos, keep, kept
        )
        every_one_ends = last and not gnmt  # (``ends`` on the host; ``alive``: isfinite)
        # (b, C): each candidate's tokens, its new token's node after its beam's
        cand = [[(paths[r][i], t) for i, t in zip(beam_l[r], tok_l[r])] for r in range(b)]
        for r in range(b):
            if done[r]:
                continue
            for j in range(n_keep):  # only the best k candidates may finish
                if (every_one_ends or eos_l[r][j]) and math.isfinite(top_l[r][j]):
                    total, tokens = top_l[r][j], path_tokens(cand[r][j])
                    tokens = tokens[:-1] if eos_l[r][j] else tokens
                    finished[r].append(Hypothesis(tokens, total / penalty, total, eos_l[r][j]))
            finished[r] = sorted(finished[r], key=lambda h: -h.score)[:k]
            best_live = max(kept_l[r])
            if not gnmt:
                done[r] = len(finished[r]) >= k
                if done[r] and early_stopping is not True:  # can the best live beam win?
                    m = max_new_tokens if early_stopping == "never" and alpha > 0 else step + 1
                    done[r] = best_live / float(m) ** alpha <= finished[r][k - 1].score
            elif best_live == float("-inf"):
                done[r] = True  # nothing goes on
            elif len(finished[r]) >= n_best:
                done[r] = finished[r][n_best - 1].score >= best_live / bound_lp
            if last and gnmt and not done[r] and len(finished[r]) < n_best:
                # the length limit: unfinished beams fill short lists
                live = [
                    Hypothesis(path_tokens(cand[r][j]), top_l[r][j] / penalty, top_l[r][j], False)
                    for j in keep_l[r]
                    if math.isfinite(top_l[r][j]) and not eos_l[r][j]
                ]
                finished[r] += sorted(live, key=lambda h: -h.score)
        if last or all(done):
            break
        scores = kept
        paths = [[cand[r][j] for j in keep_l[r]] for r in range(b)]
        source = (torch.arange(b, device=device)[:, None] * beams + beam.gather(1, keep)).flatten()
        logits = advance(source, tok.gather(1, keep).flatten())  # (b * n_keep, V)
    return [f[:n_best] for f in finished]


_length_penalty = length_penalty  # beam_search_core's argument of that name shadows it


@torch.inference_mode()
def beam_search(
    model: DecoderLM,
    prompts: Prompts,
    max_new_tokens: int = 32,
    *,
    num_beams: int = 4,
    length_penalty: float = 1.0,
    eos_id: int | Sequence[int] | None = None,
    n_best: int = 1,
    pad_id: int = 0,
    style: str = "transformers",
    early_stopping: bool | str = True,
) -> list[list[Hypothesis]]:
    """Beam search for a decoder-only model: for each prompt (a batch is left padded), the
    ``n_best`` best continuations, best first (``early_stopping``: :func:`beam_search_core`).
    The prompt is run once per row; the cache
    is then copied to the beams and reordered as they are chosen."""
    rows, _ = _prompt_rows(prompts)
    check_pad_id(pad_id, model.cfg.vocab_size)
    device = model.tok_emb.weight.device
    b, longest = len(rows), max(len(r) for r in rows)
    if longest + max_new_tokens > model.cfg.max_seq_len:
        raise ValueError(
            f"prompt ({longest}) + max_new_tokens ({max_new_tokens}) exceeds "
            f"max_seq_len={model.cfg.max_seq_len}"
        )
    seq, valid = _left_padded(rows, pad_id, device)  # (b, longest)
    modes = enter_eval(model)
    try:
        cache = model.new_cache(b, longest + max_new_tokens)
        mask = None if bool(valid.all()) else valid
        first = model(seq, cache=cache, attention_mask=mask, last_only=True).logits[:, -1]
        # LongRoPE: each row's tokens, to encode again once the context first runs past the
        # original length (longrope_switch)
        switch = longrope_switch(model)
        track = switch is not None and longest <= switch

        def advance(source: Tensor, tokens: Tensor) -> Tensor:
            nonlocal cache, seq, valid
            if track:
                seq = torch.cat((seq[source], tokens[:, None]), dim=1)  # (n, longest + steps)
                valid = torch.cat((valid[source], valid.new_ones(len(source), 1)), dim=1)
                if seq.shape[1] == switch + 1:
                    cache = model.new_cache(len(source), longest + max_new_tokens)
                    mask = None if bool(valid.all()) else valid
                    out = model(seq, cache=cache, attention_mask=mask, last_only=True)
                    return out.logits[:, -1]
            cache.reorder(source)
            return model(tokens[:, None], cache=cache, last_only=True).logits[:, -1]

        return beam_search_core(
            first,
            advance,
            num_beams=num_beams,
            max_new_tokens=max_new_tokens,
            eos_id=eos_id,
            length_penalty=length_penalty,
            n_best=n_best,
            style=style,
            early_stopping=early_stopping,
        )
    finally:
        restore(modes)
