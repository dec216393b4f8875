"""Scaled dot-product attention: softmax(Q K^T / sqrt(d_h) + mask) V (Vaswani et al. 2017).

One signature, several backends: ``eager`` is the readable reference (and can return the
attention weights); ``sdpa`` calls ``torch.nn.functional.scaled_dot_product_attention``.

Shapes: b batch, h query heads, h_kv key/value heads (h_kv divides h), t query length,
s key length, d_h head dim. Masks broadcast to (b, h, t, s); boolean True = may attend,
or additive (0 / -inf). ``causal=True`` aligns query i with key s - t + i (bottom-right),
which is what a KV cache and chunked prefill need.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab.functional.masks import causal_mask, combine_masks
from attnlab.functional.softmax import masked_softmax


def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """(b, h_kv, s, d_h) -> (b, h_kv * n_rep, s, d_h): query head j reads kv head j // n_rep."""
    if n_rep == 1:
        return x
    b, h_kv, s, d = x.shape
    return x[:, :, None].expand(b, h_kv, n_rep, s, d).reshape(b, h_kv * n_rep, s, d)


def _check(q: Tensor, k: Tensor, v: Tensor) -> int:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"attention expects (b, h, t, d_h) tensors, got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    h, h_kv = q.shape[1], k.shape[1]
    if h % h_kv or v.shape[1] != h_kv:
        raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({h_kv})")
    return h // h_kv


def eager_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    *,
    causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    return_weights: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """The reference: every step written out. Fully masked rows give zero output."""
    n_rep = _check(q, k, v)
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)  # (b, h, s, d_h)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if causal:
        mask = combine_masks(mask, causal_mask(q.shape[-2], k.shape[-2], device=q.device))
    scores = (q @ k.transpose(-2, -1)) * scale  # (b, h, t, s)
    weights = masked_softmax(scores.float(), mask).to(q.dtype)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    out = weights @ v  # (b, h, t, d_h)
    return (out, weights) if return_weights else out


def sdpa_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    *,
    causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> Tensor:
    """torch's fused kernel, with two fixes: bottom-right causal alignment when t != s,
    and zeros (not NaN) for query rows that may attend to nothing."""
    n_rep = _check(q, k, v)
    t, s = q.shape[-2], k.shape[-2]
    causal = causal and t > 1  # one query is the newest position: it may see every key
    is_causal = causal and mask is None and t == s
    if causal and not is_causal:
        mask = combine_masks(mask, causal_mask(t, s, device=q.device))
    keep = None
    if mask is not None:
        allowed = mask if mask.dtype == torch.bool else mask > float("-inf")
        keep = allowed.any(dim=-1, keepdim=True)  # (.., t, 1): rows with some key
        # Eager: look (one host read) and skip the fix-up when every row has a key.
        # Compiled: always fix up, so the graph has no data-dependent branch.
        if torch.compiler.is_compiling() or not bool(keep.all()):
            # Let empty rows attend everywhere (finite), then zero their output. An additive
            # mask keeps its finite values (e.g. a bias) on the other rows.
            if mask.dtype == torch.bool:
                mask = allowed | ~keep
            else:
                mask = torch.where(keep, mask, mask.new_zeros(()))
        else:
            keep = None
        if mask.dtype != torch.bool:
            mask = mask.to(q.dtype)
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=n_rep > 1,
    )
    if keep is not None:
        out = out * keep.to(out.dtype)
    return out


BACKENDS = {"eager": eager_attention, "sdpa": sdpa_attention}


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    *,
    causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    backend: str = "sdpa",
    return_weights: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention with the chosen backend. ``return_weights`` needs ``backend='eager'``."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {list(BACKENDS)}")
    if return_weights:
        if backend != "eager":
            raise ValueError("return_weights=True needs backend='eager' (sdpa never forms them)")
        return eager_attention(
            q, k, v, mask, causal=causal, scale=scale, dropout_p=dropout_p, return_weights=True
        )
    return BACKENDS[backend](q, k, v, mask, causal=causal, scale=scale, dropout_p=dropout_p)
