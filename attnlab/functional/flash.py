"""Flash attention in plain PyTorch: tiled, online-softmax attention that never holds a
(t, s) matrix (Dao et al. 2022, FlashAttention; Dao 2023, FlashAttention-2).

Forward: one pass over blocks of ``block_k`` keys. For each block, the scores of every
query row that can see it are formed at once (vectorised over query blocks: the only
Python loop is over key blocks), and the running maximum m, denominator l and unnormalised
output o of each row are rescaled and updated (``softmax.attention_online`` with tiles).
Only the output and the log-sum-exp L = m + log l of each row are saved. Learned sink
logits (one per head, a softmax column with no value) are where each row starts:
m = sink, l = exp(sink - m) = 1, o = 0; the backward is unchanged (L includes the sink),
and the sink's own gradient is -sum over rows of exp(sink - L) * D.

Backward (FlashAttention-2): the weights are recomputed block by block from L,
P = exp(S - L), and with D = rowsum(dO * O):
    dV += P^T dO,   dP = dO V^T,   dS = P * (dP - D),   dQ += dS K * scale,   dK += dS^T Q * scale.

Soft-capping (Gemma 2, ``softcap`` c): each tile's scaled scores become S = c tanh(S' / c)
before the mask; the backward recomputes them so, and multiplies dS by the cap's derivative
dS/dS' = 1 - tanh^2(S' / c) before the products with K and Q.

Skipping: the query rows that may see a key block form one contiguous range (causal,
sliding window, sorted document ids); it is widened to whole ``block_q`` tiles, so every
tile of the (t, s) grid that is fully masked (above the causal diagonal, outside the window,
in another document) is never computed. Tiles cut by a boundary get an elementwise mask.

Statistics (m, l, L, D) and accumulators are float32 (float64 for float64 inputs or a
float64 additive mask, as in the eager softmax); matrix products run in the input dtype
(bf16 P is cast before P V, as the CUDA kernels do; bf16 scores are rounded to bf16, as the
eager backend's are, where the CUDA kernels keep them in float32), except float16 scores,
products in float32 as the kernels' are (a float16 q . k past 65504 would be inf before the
scale).

Shapes: b batch, h query heads, h_kv key/value heads, g = h / h_kv queries per kv head,
t query length, s key length, d_h head dim, r rows (queries) and c columns (keys) of a tile.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from attnlab.functional.masks import check_mask_dtype, check_mask_shape

DEFAULT_BLOCK_Q = 128
DEFAULT_BLOCK_K = 256


@dataclass(frozen=True)
class _Tile:
    """One key block [k0, k1) and the query rows [q0, q1) that may see it."""

    k0: int
    k1: int
    q0: int
    q1: int
    positional_mask: bool  # the tile is cut by the causal diagonal or the window edge


def _check_block(name: str, value: int) -> int:
    # numbers.Integral: a numpy integer is an integer too (it was refused as not one)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"flash attention: {name} must be a positive integer, got {value!r}")
    return int(value)


def plan_tiles(
    t: int,
    s: int,
    *,
    causal: bool = False,
    window: int | None = None,
    doc_ids: Tensor | None = None,
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
) -> list[_Tile]:
    """The key blocks to visit and, for each, the whole query tiles that may see it.

    Query i sits at position s - t + i (bottom-right alignment). Causal: query at p sees
    keys <= p. Window w: and keys > p - w. ``doc_ids`` (b, s) non-decreasing: queries see
    keys of their own document only (the range is the union over the batch)."""
    block_q, block_k = _check_block("block_q", block_q), _check_block("block_k", block_k)
    off = s - t
    tiles = []
    k_starts = list(range(0, s, block_k))
    doc_lo = doc_hi = None
    if doc_ids is not None and doc_ids.shape[-1] > 1:
        sorted_ids = bool((doc_ids[:, 1:] >= doc_ids[:, :-1]).all())
        if sorted_ids:  # otherwise no skipping: the elementwise document mask still applies
            q_doc = doc_ids[:, off:].contiguous()  # (b, t)
            starts = torch.tensor(k_starts, device=doc_ids.device)
            ends = (starts + block_k).clamp(max=s) - 1
            first = doc_ids[:, starts].contiguous()  # (b, n_blocks): smallest doc of a block
            last = doc_ids[:, ends].contiguous()
            doc_lo = torch.searchsorted(q_doc, first, side="left").amin(0).tolist()
            doc_hi = torch.searchsorted(q_doc, last, side="right").amax(0).tolist()
    for n, k0 in enumerate(k_starts):
        k1 = min(k0 + block_k, s)
        q0, q1 = 0, t
        if causal:
            q0 = max(q0, k0 - off)  # first query whose position reaches key k0
        if window is not None:
            q1 = min(q1, k1 - 1 + window - off)  # last key k1 - 1 leaves the window after it
        if doc_lo is not None:
            q0, q1 = max(q0, doc_lo[n]), min(q1, doc_hi[n])
        if q0 >= q1:
            continue
        q0 = (q0 // block_q) * block_q
        q1 = min(t, -(-q1 // block_q) * block_q)
        cut = (causal and q0 + off < k1 - 1) or (window is not None and k0 <= q1 - 1 + off - window)
        tiles.append(_Tile(k0, k1, q0, q1, cut))
    return tiles


def _mask5(mask: Tensor, h_kv: int, g: int) -> Tensor:
    """Mask broadcastable to (b, h, t, s) -> broadcastable to (b, h_kv, g, t, s), a view."""
    while mask.dim() < 4:
        mask = mask[None]
    b, h, t, s = mask.shape
    if h == 1:
        return mask[:, :, None]  # (b, 1, 1, t, s)
    return mask.reshape(b, h_kv, g, t, s)


class _Problem:
    """Everything the forward and the backward share: the tiling and the tile scores."""

    def __init__(
        self, q5, k5, mask5, causal, window, doc_ids, scale, block_q, block_k, softcap=None
    ):
        self.t, self.s = q5.shape[-2], k5.shape[-2]
        self.off = self.s - self.t
        self.scale, self.window, self.mask5, self.causal = scale, window, mask5, causal
        self.softcap = softcap
        self.doc_ids = doc_ids
        # statistics: float32, float64 for float64 inputs (as softmax_dtype: never a downcast)
        self.dtype = torch.float64 if q5.dtype == torch.float64 else torch.float32
        if mask5 is not None and mask5.is_floating_point():
            # as eager's scores + mask: a float64 mask widens them. Added to float32 scores,
            # its values below float32's range became -inf, and a row of them gave zeros
            # where eager (and sdpa) give the softmax of scores + mask
            self.dtype = torch.promote_types(self.dtype, mask5.dtype)
        self.tiles = plan_tiles(
            self.t,
            self.s,
            causal=causal,
            window=window,
            doc_ids=doc_ids,
            block_q=block_q,
            block_k=block_k,
        )

    def scores(self, qs: Tensor, kb: Tensor, tile: _Tile) -> Tensor:
        """float32 (float64) scores of one tile, -inf where masked: (b, h_kv, g, r, c). Every
        step after the product is in place: on a CPU these passes over r x c, not the products,
        are what costs."""
        return self.scores_and_slope(qs, kb, tile)[0]

    def scores_and_slope(
        self, qs: Tensor, kb: Tensor, tile: _Tile, slope: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """The tile's scores and, with ``slope`` and a soft cap, the cap's derivative
        1 - tanh^2(S' / c) at each of them (b, h_kv, g, r, c), formed before the mask."""
        q0, q1, k0, k1 = tile.q0, tile.q1, tile.k0, tile.k1
        if qs.dtype == torch.float16:  # products in float32, as the kernels' (score_operands)
            qs, kb = qs.float(), kb.float()
        sc = qs @ kb.transpose(-2, -1)
        sc = sc.mul_(self.scale) if sc.dtype == self.dtype else sc.to(self.dtype).mul_(self.scale)
        dcap = None
        if self.softcap is not None:  # c tanh(S' / c), in transformers' order
            sc = sc.div_(self.softcap).tanh_()
            if slope:
                dcap = 1.0 - sc * sc
            sc = sc.mul_(self.softcap)
        if self.mask5 is not None:
            m = self.mask5
            m = m[..., q0:q1, :] if m.shape[-2] > 1 else m
            m = m[..., k0:k1] if m.shape[-1] > 1 else m
            if m.dtype == torch.bool:
                sc.masked_fill_(~m, float("-inf"))
            else:
                sc.add_(m)
        if tile.positional_mask:
            # Only the rows the diagonal (or the window's edge) cuts need the mask: causal
            # cuts the first rows of the range (position < k1 - 1), the window the last
            # ones (position - window >= k0).
            spans = [(q0, min(q1, k1 - 1 - self.off))]
            if self.window is not None:
                spans.append((max(q0, k0 + self.window - self.off), q1))
                if spans[1][0] <= spans[0][1]:  # overlapping: one span
                    spans = [(q0, q1)]
            k_pos = torch.arange(k0, k1, device=sc.device)[None, :]
            for lo, hi in spans:
                if lo >= hi:
                    continue
                q_pos = torch.arange(lo + self.off, hi + self.off, device=sc.device)[:, None]
                allowed = k_pos <= q_pos  # (hi - lo, c)
                if self.window is not None:
                    allowed = allowed & (k_pos > q_pos - self.window)
                sc[..., lo - q0 : hi - q0, :].masked_fill_(~allowed, float("-inf"))
        if self.doc_ids is not None:
            q_doc = self.doc_ids[:, self.off + q0 : self.off + q1, None]  # (b, r, 1)
            same = q_doc == self.doc_ids[:, None, k0:k1]  # (b, r, c)
            sc.masked_fill_(~same[:, None, None], float("-inf"))
        return sc, dcap


def _safe(m: Tensor) -> Tensor:
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


class FlashAttention(torch.autograd.Function):
    """q (b, h_kv, g, t, d_h), k (b, h_kv, 1, s, d_h), v (b, h_kv, 1, s, d_v) -> out
    (b, h_kv, g, t, d_v) (the 5-D views let query head j read kv head j // g without
    copying K or V)."""

    @staticmethod
    def forward(
        ctx, q, k, v, sinks5, mask5, causal, window, doc_ids, scale, block_q, block_k, softcap
    ):
        prob = _Problem(q, k, mask5, causal, window, doc_ids, scale, block_q, block_k, softcap)
        stats = q.shape[:-1] + (1,)
        f = prob.dtype
        if sinks5 is None:  # nothing seen yet
            m = torch.full(stats, float("-inf"), dtype=f, device=q.device)
            l = torch.zeros(stats, dtype=f, device=q.device)
        else:  # the sink column seen first: its exp(sink - m) = 1, its value 0
            m = sinks5.detach().to(f).expand(stats).clone()
            l = torch.ones(stats, dtype=f, device=q.device)
        acc = torch.zeros(stats[:-1] + v.shape[-1:], dtype=f, device=q.device)
        for tile in prob.tiles:
            rows = slice(tile.q0, tile.q1)
            kb, vb = k[..., tile.k0 : tile.k1, :], v[..., tile.k0 : tile.k1, :]
            sc = prob.scores(q[..., rows, :], kb, tile)  # (b, h_kv, g, r, c)
            m_old = m[..., rows, :]
            m_new = torch.maximum(m_old, sc.amax(-1, keepdim=True))
            alpha = torch.exp(m_old - _safe(m_new))  # rescale what was summed so far
            p = sc.sub_(_safe(m_new)).exp_()  # (b, h_kv, g, r, c), in place of the scores
            l[..., rows, :] = l[..., rows, :] * alpha + p.sum(-1, keepdim=True)
            acc[..., rows, :] = acc[..., rows, :] * alpha + (p.to(v.dtype) @ vb).to(f)
            m[..., rows, :] = m_new
        out = (acc / torch.where(l > 0, l, torch.ones_like(l))).to(q.dtype)
        # Rows with nothing seen (no allowed key, no sink): L = +inf makes the recomputed
        # P = exp(S - L) exactly 0.
        lse = torch.where(m > float("-inf"), m + torch.log(l), torch.full_like(l, float("inf")))
        # The mask and document ids too: the backward recomputes P from them, so changing
        # them in place before it must raise (as q, k, v do), not give other gradients.
        ctx.save_for_backward(q, k, v, out, lse, mask5, doc_ids, sinks5)
        ctx.prob = prob
        return out

    @staticmethod
    @once_differentiable  # the recomputed P treats L as a constant: no second derivative
    def backward(ctx, grad_out):
        q, k, v, out, lse, _, _, sinks5 = ctx.saved_tensors
        prob = ctx.prob
        grad_out = grad_out.contiguous()
        f = prob.dtype
        delta = (grad_out.to(f) * out.to(f)).sum(-1, keepdim=True)  # D = rowsum(dO * O)
        dsinks = None
        if sinks5 is not None and ctx.needs_input_grad[3]:
            # the sink column's dS = P_sink * (dP_sink - D), with dP_sink = 0 (no value)
            p_sink = torch.exp(sinks5.to(f) - lse)  # (b, h_kv, g, t, 1)
            dsinks = (-p_sink * delta).sum((0, 3)).reshape(sinks5.shape).to(sinks5.dtype)
        dq = torch.zeros(q.shape, dtype=f, device=q.device)
        dk = torch.zeros(k.shape, dtype=f, device=q.device)
        dv = torch.zeros(v.shape, dtype=f, device=q.device)
        for tile in prob.tiles:
            rows, cols = slice(tile.q0, tile.q1), slice(tile.k0, tile.k1)
            qs, kb, vb = q[..., rows, :], k[..., cols, :], v[..., cols, :]
            do = grad_out[..., rows, :]  # (b, h_kv, g, r, d_h)
            sc, dcap = prob.scores_and_slope(qs, kb, tile, slope=True)
            p = sc.sub_(lse[..., rows, :]).exp_()  # (b, h_kv, g, r, c)
            # Sum over the g query heads that share a kv head: (b, h_kv, 1, c, d_h).
            dv[..., cols, :] += (p.to(do.dtype).transpose(-2, -1) @ do).to(f).sum(2, True)
            dp = (do @ vb.transpose(-2, -1)).to(f)
            ds = dp.sub_(delta[..., rows, :]).mul_(p)  # dS = P * (dP - D)
            if dcap is not None:  # through the cap: dS' = dS * (1 - tanh^2(S' / c))
                ds = ds.mul_(dcap)
            ds = ds.to(q.dtype)
            dq[..., rows, :] += (ds @ kb).to(f) * prob.scale
            dk[..., cols, :] += (ds.transpose(-2, -1) @ qs).to(f).sum(2, True) * prob.scale
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks, *([None] * 8)


def heads_error(h: int, h_k: int, h_v: int) -> str:
    """The error for query, key and value heads (h, h_k, h_v) that do not fit together
    (``h % h_k or h_v != h_k``: v's heads would broadcast silently against k's)."""
    return (
        f"query heads ({h}) must be a multiple of key/value heads, which k and v share; "
        f"got k {h_k}, v {h_v}"
    )


def check_keys(q: Tensor, k: Tensor, v: Tensor) -> None:
    """k and v hold the same keys, q and k one head dim (v's may differ: MLA). torch's SDPA
    on the CPU returned a result for values shorter than the keys."""
    if k.shape[-2] != v.shape[-2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            "k and v must hold the same number of keys and q and k the same head dim; got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )


def check_doc_ids(doc_ids: Tensor | None, b: int, t: int, s: int) -> None:
    """Document ids are one per key, (b, s), and the queries are the last t of those keys:
    eager and sdpa took (b, t) ids of a decoding step (t < s) and broadcast its one column
    over every key, so the step attended across documents."""
    if doc_ids is not None and tuple(doc_ids.shape) != (b, s):
        raise ValueError(f"doc_ids must be (b, s) = {(b, s)}, got {tuple(doc_ids.shape)}")
    if doc_ids is not None and t > s:  # query i's document is doc_ids[:, s - t + i]
        raise ValueError(f"doc_ids need query length t={t} <= key length s={s}")


def check_sinks(sinks: Tensor | None, h: int) -> None:
    """Sink logits are one float per query head, (h,)."""
    if sinks is not None and (tuple(sinks.shape) != (h,) or not sinks.is_floating_point()):
        raise ValueError(
            f"sinks must be one float logit per query head, shape ({h},); got "
            f"{tuple(sinks.shape)} {sinks.dtype}"
        )


def check_softcap(softcap: float | None) -> None:
    """A soft cap is a positive finite number of logits (or None: no cap)."""
    if softcap is not None and (
        isinstance(softcap, bool)
        or not isinstance(softcap, numbers.Real)
        or not 0 < softcap < float("inf")
    ):
        raise ValueError(f"softcap must be a positive number, got {softcap!r}")


def check_arguments(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    *,
    causal: bool,
    window: float | None,
    doc_ids: Tensor | None,
    sinks: Tensor | None = None,
    softcap: float | None = None,
) -> None:
    """Refuse, by name, what flash attention (the tiled path here and the Triton kernels
    alike) cannot compute."""
    b, h, t = q.shape[:3]
    h_kv, s = k.shape[1], k.shape[2]
    if causal and s < t:
        raise ValueError(f"causal attention: key length s={s} is shorter than query length t={t}")
    if window is not None and (not causal or window <= 0):
        raise ValueError(f"window={window} needs causal=True and a positive size")
    if h % h_kv or v.shape[1] != h_kv:
        raise ValueError(heads_error(h, h_kv, v.shape[1]))
    check_keys(q, k, v)
    check_mask_dtype(mask)
    check_mask_shape(mask, (b, h, t, s))
    check_doc_ids(doc_ids, b, t, s)
    check_sinks(sinks, h)
    check_softcap(softcap)
    if mask is not None and mask.requires_grad:
        raise ValueError("flash attention does not differentiate the mask; detach it")


def flash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: int | None = None,
    doc_ids: Tensor | None = None,
    sinks: Tensor | None = None,
    softcap: float | None = None,
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
) -> Tensor:
    """Tiled attention, equal to ``eager_attention`` (1e-5 in float32) with memory linear in
    t and s. q (b, h, t, d_h); k, v (b, h_kv, s, d_h). ``mask`` bool (True = may attend) or
    additive, broadcastable to (b, h, t, s), not differentiated. ``causal`` aligns
    bottom-right; ``window`` (needs causal) keeps the last ``window`` keys of each query;
    ``doc_ids`` (b, s) int: no attention across documents (sorted ids also skip tiles).
    ``sinks`` (h,) learned sink logits: a softmax column per head with no value.
    ``softcap``: scores -> softcap * tanh(scores / softcap) before the mask (Gemma 2).
    Rows that may attend to nothing give zeros."""
    block_q, block_k = _check_block("block_q", block_q), _check_block("block_k", block_k)
    check_arguments(
        q, k, v, mask, causal=causal, window=window, doc_ids=doc_ids, sinks=sinks, softcap=softcap
    )
    b, h, t, d_h = q.shape
    h_kv = k.shape[1]
    g = h // h_kv
    scale = 1.0 / math.sqrt(d_h) if scale is None else scale
    if window is not None:  # keys k > p - w are keys k > p - ceil(w): a float window as an
        window = math.ceil(window)  # int, as the Triton twin takes it (the tiles' slices failed)
    q5 = q.reshape(b, h_kv, g, t, d_h)  # query head j -> (kv head j // g, j % g)
    k5, v5 = k[:, :, None], v[:, :, None]  # (b, h_kv, 1, s, d_h)
    mask5 = None if mask is None else _mask5(mask, h_kv, g)
    sinks5 = None if sinks is None else sinks.reshape(h_kv, g, 1, 1)  # (h_kv, g, t, 1)
    out = FlashAttention.apply(
        q5, k5, v5, sinks5, mask5, causal, window, doc_ids, scale, block_q, block_k, softcap
    )
    return out.reshape(b, h, t, v.shape[-1])  # the value width may differ (MLA)
