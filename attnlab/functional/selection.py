"""Selection maths of sparse attention: which keys each query reads. No parameters.

* DSA (DeepSeek-V3.2): the lightning indexer's score I[t, s] = sum_j w[t, j] ReLU(q[t, j] . k[s])
  and the top-k keys per query; a Hadamard rotation and simulated FP8 quantisation of the
  index queries/keys, as DeepSeek's inference code applies before scoring.
* NSA (Yuan et al. 2025, "Native Sparse Attention"): the blocks that compression summarises
  (length l, stride d) and Eq. 9, which turns attention over compressed blocks into
  importance of selection blocks (length l'). Which complete blocks a query may read is
  the module's (``NativeSparseAttention.compressed``: a block's last key must be allowed).

Shapes: b batch, t queries, s keys, H_I index heads, d_I index head dim, k selected keys,
n_c compressed blocks, n_s selection blocks.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attnlab.functional.softmax import compute_dtype

# --------------------------------------------------------------------------- DSA


def index_scores(q: Tensor, k: Tensor, weights: Tensor, scale: float) -> Tensor:
    """The lightning indexer (DeepSeek-V3.2, Eq. 1): q (b, t, H_I, d_I), k (b, s, d_I),
    weights (b, t, H_I) -> I (b, t, s) = sum_j weights[t, j] ReLU(scale q[t, j] . k[s]),
    in float32 (the reference scores in FP8 with float accumulation; float64 inputs in
    float64), under autocast too: its bf16 products would round the scores (more ties in the
    top-k) and the indexer's log-softmax, whose KL then came out negative."""
    dtype = compute_dtype(torch.promote_types(q.dtype, k.dtype))
    with torch.autocast(q.device.type, enabled=False):
        dots = torch.einsum("btjd,bsd->btjs", q.to(dtype), k.to(dtype)) * scale  # (b, t, H_I, s)
        return torch.einsum("btj,btjs->bts", weights.to(dtype), dots.relu())  # (b, t, s)


def _by_score_then_position(scores: Tensor, order: Tensor | None) -> Tensor:
    """(b, t, s) key indices by descending score, equal scores by ascending position:
    ``order`` (b, s) the keys' positions, None when the index is the position."""
    if order is None:
        return scores.sort(dim=-1, descending=True, stable=True).indices
    perm = order.argsort(dim=-1, stable=True)[:, None, :].expand_as(scores)  # by position
    ranked = scores.gather(-1, perm).sort(dim=-1, descending=True, stable=True).indices
    return perm.gather(-1, ranked)


def topk_select(
    scores: Tensor, mask: Tensor | None, topk: int, order: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The min(topk, s) best keys of each query among those ``mask`` allows.

    scores (b, t, s); mask bool broadcastable to (b, t, s). Returns indices (b, t, k) long
    and valid (b, t, k) bool: False where a query has fewer than k allowed keys and the
    pick is a masked one (those must stay masked). A tie at the k-th place (ReLU scores
    are often exactly 0) goes to the earliest key, so the choice does not depend on how
    many keys follow (a cache's length): decoding equals the full forward pass. ``order``
    (b, s): the keys' positions where index order is not position order (a rolling cache's
    wrapped slots)."""
    if mask is not None:
        mask = mask.expand_as(scores)
        scores = scores.masked_fill(~mask, float("-inf"))
    s = scores.shape[-1]
    k = min(topk, s)
    values, indices = scores.topk(min(k + 1, s), dim=-1)  # (b, t, k + 1)
    if k < s:
        kth, next_ = values[..., k - 1], values[..., k]
        tie = (kth == next_) & kth.isfinite()  # (b, t): the k-th place is shared
        if torch.compiler.is_compiling():  # no host read: the settled picks where tied
            by_position = _by_score_then_position(scores, order)[..., :k]
            indices = torch.where(tie[..., None], by_position, indices[..., :k])
        elif bool(tie.any()):  # settle ties by position, in the tied queries only
            # Rare per query (1-4% in deepseek-v32-tiny's training) but in 99% of its
            # batches: sorting every query made this 3x slower (3.0 ms against 1.0 for
            # 1,536 queries of 128 keys).
            where = tie.nonzero(as_tuple=True)  # the tied queries' (b, t) coordinates
            rows = scores[where][:, None]  # (n, 1, s)
            mine = None if order is None else order[where[0]]  # (n, s)
            indices = indices[..., :k].clone()
            indices[where] = _by_score_then_position(rows, mine)[:, 0, :k]
        indices = indices[..., :k]
    if mask is None:
        return indices, torch.ones_like(indices, dtype=torch.bool)
    return indices, mask.gather(-1, indices)


def selection_mask(indices: Tensor, valid: Tensor, s: int) -> Tensor:
    """(b, t, k) picks -> (b, t, s) bool, True at the selected allowed keys."""
    out = torch.zeros(*indices.shape[:-1], s, dtype=torch.bool, device=indices.device)
    return out.scatter(-1, indices, valid)


def hadamard(x: Tensor) -> Tensor:
    """x H / sqrt(d) along the last axis (d a power of 2): the fast Walsh-Hadamard transform.
    H / sqrt(d) is orthogonal and symmetric, so (q H)(k H)^T = q k^T: rotating index queries
    and keys changes no score, only spreads outliers before FP8 quantisation. Half
    precision is rotated in float32 and rounded once, as DeepSeek's bf16 kernel
    (fast_hadamard_transform) does: bf16 butterflies rounded at each of the log2(d) stages
    (3x the error of one rounding at d = 128)."""
    d = x.shape[-1]
    if d & (d - 1):
        raise ValueError(f"a Hadamard transform needs a power-of-2 width, got {d}")
    shape = x.shape
    y = x.reshape(-1, d).to(compute_dtype(x.dtype))
    h = 1
    while h < d:  # butterflies: pairs (i, i + h) within blocks of 2h -> (a + b, a - b)
        y = y.view(-1, d // (2 * h), 2, h)
        y = torch.stack((y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]), dim=2)
        h *= 2
    return (y.reshape(shape) / math.sqrt(d)).to(x.dtype)


FP8_E4M3_MAX = 448.0


def fake_fp8(x: Tensor, block: int = 128, pow2_scale: bool = True) -> Tensor:
    """Quantise x to FP8 e4m3 per block of ``block`` values along the last axis and back
    (DeepSeek's ``act_quant``): scale = amax / 448 (rounded up to a power of 2 with
    ``pow2_scale``, the UE8M0 scale format), x / scale rounded to e4m3, times scale.
    Straight through in training: the gradient passes the rounding unchanged (autograd's
    own went back through the float8 cast, rounding the gradient times the scale to e4m3:
    the indexer's query and key projections got zero gradients)."""
    d = x.shape[-1]
    block = min(block, d)
    if d % block:
        raise ValueError(f"width {d} is not a multiple of the quantisation block {block}")
    xb = x.detach().float().unflatten(-1, (d // block, block))  # (..., d / block, block)
    scale = xb.abs().amax(-1, keepdim=True).clamp(min=1e-4) / FP8_E4M3_MAX
    if pow2_scale:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (xb / scale).to(torch.float8_e4m3fn).float()
    y = (q * scale).flatten(-2).to(x.dtype)
    return y + (x - x.detach()) if x.requires_grad else y  # values y, gradient identity


# --------------------------------------------------------------------------- NSA


def n_compressed_blocks(s: int, block_len: int, stride: int) -> int:
    """Blocks [i d, i d + l) that fit in s keys."""
    return 0 if s < block_len else (s - block_len) // stride + 1


def block_windows(s: int, block_len: int, stride: int, device=None) -> Tensor:
    """(n_c, l) key indices of each compression block (NSA Eq. 7: blocks of length l,
    stride d)."""
    n = n_compressed_blocks(s, block_len, stride)
    start = torch.arange(n, device=device)[:, None] * stride
    return start + torch.arange(block_len, device=device)  # (n_c, l)


def selection_importance(p_cmp: Tensor, n_sel: int, block_len: int, stride: int, sel_len: int):
    """NSA Eq. 9: importance of selection block j (keys [j l', (j + 1) l')) from the
    compressed attention of the compression blocks overlapping it. p_cmp (..., n_c) ->
    (..., n_sel). Eq. 9's double sum over m < l'/d and n < l/d counts compression block i
    once per stride-long piece it shares with block j, so each block is weighted by its
    overlap in strides: block i covers [i d, i d + l), and l, l' are multiples of d (with
    l = l' = 2d the weights of blocks 2j-1, 2j, 2j+1 are 1, 2, 1). That is the index
    (l'/d) j + m - n; the paper prints (l'/d) j - m - n, the same weights l'/d - 1 blocks
    earlier (2j-2, 2j-1, 2j above: block 2j-2 lies wholly in selection block j-1), so the
    overlap is taken in token terms, as XunhaoLai/native-sparse-attention-triton's
    ``transform_score`` does."""
    if block_len % stride or sel_len % stride:
        raise ValueError(f"block_len={block_len} and sel_len={sel_len} must be multiples of "
                         f"stride={stride}")  # fmt: skip
    # Counted in strides, so no tensor is floor-divided (inductor failed to compile that:
    # "vr must not be None", which crashed train.compile with NSA)
    n_c, block, sel = p_cmp.shape[-1], block_len // stride, sel_len // stride  # in strides
    start = torch.arange(n_c, device=p_cmp.device)  # (n_c,)
    j0 = torch.arange(n_sel, device=p_cmp.device)[:, None] * sel  # (n_sel, 1)
    shared = torch.minimum(start + block, j0 + sel) - torch.maximum(start, j0)
    weight = shared.clamp(min=0)  # (n_sel, n_c): stride-long pieces in common
    return p_cmp @ weight.to(p_cmp.dtype).T  # (..., n_sel)
