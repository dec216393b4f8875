"""Attention masks. Convention: boolean True = may attend (as in
``F.scaled_dot_product_attention``); additive masks hold 0 or -inf.

Shapes: t query length, s key length, b batch. Masks broadcast to (b, h, t, s).
"""

from __future__ import annotations

import torch
from torch import Tensor


def causal_mask(
    t: int, s: int | None = None, *, device: torch.device | str | None = None
) -> Tensor:
    """(t, s) bool. Query i sits at key position s - t + i (bottom-right aligned), so the
    last t of s keys are the queries themselves: right for a KV cache and chunked prefill.
    (``is_causal=True`` in torch aligns top-left when t != s, which is wrong there.)"""
    s = t if s is None else s
    if s < t:
        raise ValueError(f"causal_mask: key length s={s} is shorter than query length t={t}")
    q_pos = torch.arange(s - t, s, device=device)[:, None]  # (t, 1)
    k_pos = torch.arange(s, device=device)[None, :]  # (1, s)
    return k_pos <= q_pos


def sliding_window_mask(
    t: int, s: int, window: int, *, device: torch.device | str | None = None
) -> Tensor:
    """(t, s) bool: causal, and only the last ``window`` keys (the query's own included).
    Fewer keys than queries is refused, as :func:`causal_mask` does (the first queries would
    sit before every key: eager and sdpa gave them zeros where flash and flex raised)."""
    if s < t:
        raise ValueError(
            f"sliding_window_mask: key length s={s} is shorter than query length t={t}"
        )
    q_pos = torch.arange(s - t, s, device=device)[:, None]  # (t, 1)
    k_pos = torch.arange(s, device=device)[None, :]  # (1, s)
    return (k_pos <= q_pos) & (k_pos > q_pos - window)


def sink_window_mask(
    t: int, s: int, window: int, sinks: int, *, device: torch.device | str | None = None
) -> Tensor:
    """(t, s) bool: causal, and the key is one of the first ``sinks`` positions or of the
    last ``window - sinks`` (the query's own included): StreamingLLM's attention pattern,
    at most ``window`` keys per query, sinks and itself counted. In the paper's code's
    terms start_size = sinks, recent_size = window - sinks - 1 (its cache of start +
    recent keys excludes the query); transformers' SinkCache(window_length=window,
    num_sink_tokens=sinks)."""
    q_pos = torch.arange(s - t, s, device=device)[:, None]  # (t, 1)
    k_pos = torch.arange(s, device=device)[None, :]  # (1, s)
    return (k_pos <= q_pos) & ((k_pos > q_pos - (window - sinks)) | (k_pos < sinks))


def global_window_mask(
    t: int,
    s: int,
    window: int,
    global_tokens: int | Tensor,
    *,
    causal: bool = True,
    device: torch.device | str | None = None,
) -> Tensor:
    """(t, s) bool: Longformer / BigBird attention. Query i sits at position s - t + i
    (bottom-right, as :func:`causal_mask`). A key is visible when it is in the query's
    local window (causal: one of the last ``window`` positions, the query's own included;
    else within ``window - 1`` positions on either side), or when the key or the query is
    global: global tokens attend everywhere and are attended by every position. ``causal``
    then still hides keys after the query. ``global_tokens``: the number of leading global
    positions, or a bool tensor (s,) marking them (Longformer's task tokens, BigBird-ITC),
    or (b, s) marking them per row (left-padded rows), which gives a (b, 1, t, s) mask.
    In a causal decoder leading global tokens are StreamingLLM's attention sinks
    (:func:`sink_window_mask` with ``sinks`` more positions in its window). The mask is
    made on ``device``, by default the device of a ``global_tokens`` tensor (a CPU mask
    failed beside CUDA scores, and moving the flags to the CPU read them back)."""
    if device is None and isinstance(global_tokens, Tensor):
        device = global_tokens.device
    q_pos = torch.arange(s - t, s, device=device)[:, None]  # (t, 1)
    k_pos = torch.arange(s, device=device)[None, :]  # (1, s)
    if isinstance(global_tokens, Tensor):
        is_global = global_tokens.to(device=k_pos.device, dtype=torch.bool)  # (s,) or (b, s)
        if is_global.shape[-1:] != (s,) or is_global.dim() > 2:
            raise ValueError(
                f"global_tokens must have shape ({s},) or (b, {s}), got {tuple(is_global.shape)}"
            )
    else:
        is_global = torch.arange(s, device=device) < global_tokens  # (s,)
    dist = q_pos - k_pos  # (t, s)
    local = (dist >= 0) & (dist < window) if causal else dist.abs() < window
    key_global = is_global[..., None, :]  # (.., 1, s)
    query_global = is_global[..., s - t :, None]  # (.., t, 1)
    mask = local | key_global | query_global  # (t, s) or (b, t, s)
    if causal:
        mask = mask & (dist >= 0)
    return mask if is_global.dim() == 1 else mask[:, None]  # (b, 1, t, s)


def positions_from_padding(
    attention_mask: Tensor | None,
    t: int,
    *,
    start: Tensor | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """Absolute positions of t tokens: (1, t) counting from 0, or (b, t) when a padding
    mask (b, t) (1 real, 0 left padding: pads do not advance the count) or a per-row
    ``start`` (b,) is given."""
    if attention_mask is None:
        dev = start.device if start is not None else device
        pos = torch.arange(t, device=dev)[None, :]  # (1, t)
    else:
        pos = (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)  # (b, t)
    return pos if start is None else start[:, None] + pos


def check_mask_dtype(mask: Tensor | None, name: str = "mask") -> None:
    """Refuse a mask that is neither boolean (True = may attend) nor floating (additive):
    an integer 0/1 mask was added to the scores, +1 on the kept keys and 0 on the dropped
    ones, which were attended to (torch's SDPA refuses it)."""
    if mask is not None and mask.dtype != torch.bool and not mask.is_floating_point():
        raise ValueError(
            f"{name} must be bool (True = may attend) or floating point (additive: 0 or "
            f"-inf), got {mask.dtype}; for a 1 = keep / 0 = drop mask pass {name}.bool()"
        )


def check_mask_shape(mask: Tensor | None, scores: tuple[int, ...], name: str = "mask") -> None:
    """Refuse a mask that does not broadcast to the scores (b, h, t, s): one with more rows,
    heads or dimensions than the queries silently widened eager's output (a (2, 1, t, s)
    mask gave a batch of one query row two output rows) and flex read its first rows only."""
    if mask is None:
        return
    shape = tuple(mask.shape)
    if len(shape) > len(scores) or any(
        n != 1 and n != m for n, m in zip(reversed(shape), reversed(scores))
    ):
        raise ValueError(
            f"{name} of shape {shape} does not broadcast to the scores (b, h, t, s) = "
            f"{tuple(scores)}; give it 1 or the scores' size in each dimension"
        )


def padding_mask(key_valid: Tensor) -> Tensor:
    """(b, s) bool or 0/1 -> (b, 1, 1, s) bool: which keys are real tokens."""
    return key_valid.bool()[:, None, None, :]


def combine_masks(*masks: Tensor | None) -> Tensor | None:
    """AND of boolean masks / sum of additive masks; ``None`` entries are skipped."""
    out = None
    for m in masks:
        if m is None:
            continue
        if out is None:
            out = m
        elif out.dtype == torch.bool and m.dtype == torch.bool:
            out = out & m
        else:
            out = to_additive(out) + to_additive(m)
    return out


def to_additive(mask: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Boolean mask -> 0 / -inf additive mask (additive masks pass through)."""
    if mask.dtype != torch.bool:
        return mask
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    # fills, not torch.tensor(-inf, device=...): a copy from host memory waits for a GPU
    minus_inf = torch.full((), float("-inf"), dtype=dtype, device=mask.device)
    return torch.where(mask, zero, minus_inf)


def additive_in(mask: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
    """An additive mask for queries of ``dtype`` without the overflow of a plain cast:
    float32's finfo min or -1e9 cast to float16 is -inf, which empties a row that eager
    (adding the mask to float32 scores) keeps.

    Returns ``(mask, saturated)``: finite values beyond ``dtype``'s range become its finfo
    min / max, infinities stay; ``saturated`` (mask's shape with s = 1, or None) marks rows
    whose every value is finite and below ``dtype``'s range. What such a row gives depends
    on the float32 scores (an offset of -1e9 swamps them: uniform weights; -1e5 does not),
    so the caller computes those as eager does. A mask already in ``dtype``, or in one no
    wider, is only cast."""
    if mask.dtype == dtype:
        return mask, None
    if not (mask.is_floating_point() and torch.finfo(mask.dtype).max > torch.finfo(dtype).max):
        return mask.to(dtype), None
    info = torch.finfo(dtype)
    top = mask.amax(dim=-1, keepdim=True)
    saturated = (top < info.min) & (top > float("-inf"))
    clamped = torch.where(torch.isinf(mask), mask, mask.clamp(info.min, info.max))
    return clamped.to(dtype), saturated


def prefix_lm_mask(
    t: int, s: int, prefix: int | Tensor, *, device: torch.device | str | None = None
) -> Tensor:
    """Prefix LM (Raffel et al. 2020, T5; UniLM): the first ``prefix`` positions see each
    other in both directions, later ones are causal. ``prefix`` an int -> (t, s) bool, or a
    (b,) tensor (one prefix length per sequence) -> (b, 1, t, s), by default on its
    device."""
    if device is None and isinstance(prefix, Tensor):
        device = prefix.device
    q_pos = torch.arange(s - t, s, device=device)[:, None]  # (t, 1)
    k_pos = torch.arange(s, device=device)[None, :]  # (1, s)
    if isinstance(prefix, Tensor):
        prefix = prefix.to(device)[:, None, None, None]  # (b, 1, 1, 1)
    return (k_pos <= q_pos) | (k_pos < prefix)


def document_ids(tokens: Tensor, eos_id: int) -> Tensor:
    """(b, s) token ids of packed sequences -> (b, s) document index, starting at 0 and
    growing by one after each ``eos_id`` (the end-of-document token stays in its document)."""
    ends = (tokens == eos_id).long()
    return ends.cumsum(-1) - ends


def document_positions(doc_ids: Tensor) -> Tensor:
    """(b, s) document ids (sorted: documents are contiguous) -> (b, s) positions that
    restart at 0 at the start of each document, for RoPE or learned position tables."""
    s = doc_ids.shape[-1]
    idx = torch.arange(s, device=doc_ids.device).expand_as(doc_ids)
    start = torch.ones_like(doc_ids, dtype=torch.bool)
    start[..., 1:] = doc_ids[..., 1:] != doc_ids[..., :-1]
    # Index of the latest document start at or before each position.
    first = torch.where(start, idx, torch.zeros_like(idx)).cummax(-1).values
    return idx - first


def document_mask(doc_ids: Tensor, t: int | None = None) -> Tensor:
    """(b, s) document ids -> (b, 1, t, s) bool: a query sees keys of its own document only.
    The t queries are the last t of the s positions (bottom-right, like ``causal_mask``);
    combine with ``causal=True`` for packed causal language modelling."""
    t = doc_ids.shape[-1] if t is None else t
    q_doc = doc_ids[:, -t:, None]  # (b, t, 1)
    return (q_doc == doc_ids[:, None, :])[:, None]  # (b, 1, t, s)
