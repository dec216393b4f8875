"""Learned attention-sink logits (GPT-OSS): each head h has a logit s_h that joins every
query's softmax as one more column with no value,

    y = sum_j softmax([s_h, z_1, ..., z_S])_j v_j  =  attention(q, k, v) * sigmoid(lse(z) - s_h)

so a head can put weight "nowhere". ``attend(..., sinks=)`` takes them on every backend:
``eager`` writes the column out, ``flash`` and ``triton`` start each row's online softmax
from it, ``flex`` rescales with its own log-sum-exp, and ``sdpa``, which returns none,
rescales here, forming the (t, s) scores for their log-sum-exp.

Shapes: b batch, h heads, h_kv key/value heads, t queries, s keys, d_h head dim.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnlab.functional.masks import causal_mask
from attnlab.functional.softmax import score_operands, softmax_dtype


def sink_rescale(
    y: Tensor,
    q: Tensor,
    k: Tensor,
    sink: Tensor,
    mask: Tensor | None = None,
    *,
    causal: bool = False,
    scale: float | None = None,
) -> Tensor:
    """y (b, h, t, d_h) the attention output over keys k (b, h_kv, s, d_h) for queries q
    under ``mask`` (bool or additive, broadcastable to (b, h, t, s)) and bottom-right
    ``causal``; sink (h,) logits. Returns y scaled by each row's share left after the sink."""
    h, t, d_h = q.shape[1], q.shape[2], q.shape[3]
    s = k.shape[2]
    k = k.repeat_interleave(h // k.shape[1], dim=1) if k.shape[1] != h else k
    qs, ks = score_operands(q, k)  # float16 in float32: its products overflow
    scores = softmax_dtype(qs @ ks.transpose(-1, -2)) * (d_h**-0.5 if scale is None else scale)
    if mask is not None:
        scores = (
            scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        )
    if causal and t > 1:
        scores = scores.masked_fill(~causal_mask(t, s, device=q.device), float("-inf"))
    lse = scores.logsumexp(-1, keepdim=True)  # (b, h, t, 1); -inf for rows with no key
    share = torch.sigmoid(lse - sink.to(lse.dtype)[:, None, None])  # (b, h, t, 1)
    return y * share.to(y.dtype)
