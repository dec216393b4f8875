"""Additive attention (Bahdanau, Cho and Bengio 2015, "Neural machine translation by jointly
learning to align and translate"):

    a(q, k_j) = w_v^T tanh(W_q q + W_k k_j)                       score, eq. (6) of the paper
    alpha_j   = softmax_j a(q, k_j) over the real (unpadded) keys
    c         = sum_j alpha_j v_j                                  context vector

A small MLP scores each (query, key) pair, so queries and keys may have different sizes.
W_k k does not depend on the query: a decoder that queries the same keys at every step
projects them once (``project_keys``) and passes them back in.

This is a cross-attention between two sequences of different kinds (an RNN state and
encoder states), not a transformer layer, so it takes (query, keys, values) rather than
the ``forward(x, *, positions, ...)`` of the self-attention modules.

Shapes: b batch, t queries, s keys (source length), d_q query size, d_k key size,
d_v value size, d_a attention (hidden) size.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnlab.functional.softmax import masked_softmax
from attnlab.nn.linear import Linear


class AdditiveAttention(nn.Module):
    def __init__(self, query_dim: int, key_dim: int, attention_dim: int) -> None:
        super().__init__()
        for name, value in (("query_dim", query_dim), ("key_dim", key_dim)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if attention_dim < 1:
            raise ValueError(f"attention_dim must be >= 1, got {attention_dim}")
        self.w_q = Linear(query_dim, attention_dim, bias=False)
        self.w_k = Linear(key_dim, attention_dim, bias=False)
        self.w_v = Linear(attention_dim, 1, bias=False)

    def project_keys(self, keys: Tensor) -> Tensor:
        """W_k k for every key: (b, s, d_k) -> (b, s, d_a)."""
        return self.w_k(keys)

    def forward(
        self,
        query: Tensor,
        keys: Tensor,
        values: Tensor,
        *,
        mask: Tensor | None = None,
        projected_keys: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """query (b, d_q) or (b, t, d_q); keys (b, s, d_k); values (b, s, d_v); mask: bool or
        0/1 integers, True (1) at real keys, or an additive float mask: (b, s), (1, s) or
        (s,), the same keys for every query (source padding), or (b or 1, t or 1, s) per
        query. A 2-D mask is always per key, never (t, s): give a per-query mask its batch
        dim.

        Returns (context, weights): (b, d_v) and (b, s) for a single query, else
        (b, t, d_v) and (b, t, s). A query with no real key gets zero weights and context.
        """
        single = query.dim() == 2
        if single:
            query = query[:, None]  # (b, 1, d_q)
        if projected_keys is None:
            projected_keys = self.project_keys(keys)  # (b, s, d_a)
        features = torch.tanh(self.w_q(query)[:, :, None] + projected_keys[:, None])  # (b,t,s,d_a)
        scores = self.w_v(features).squeeze(-1)  # (b, t, s)
        if mask is not None and not mask.is_floating_point():
            # 0/1 integers (a padding mask as the Transformer models take it) mean keep/drop:
            # masked_softmax would add them as an additive mask and attend to the padding
            mask = mask.bool()
        if mask is not None:
            b, t, s = scores.shape
            if mask.dim() == 1:
                mask = mask[None]  # (s,): one set of keys for every row
            fits = mask.dim() in (2, 3) and mask.shape[0] in (1, b) and mask.shape[-1] == s
            if not fits or (mask.dim() == 3 and mask.shape[1] not in (1, t)):
                raise ValueError(
                    f"mask of shape {tuple(mask.shape)} does not fit {b} rows of {s} keys: "
                    f"give (b, s) = ({b}, {s}) per key or (b, t, s) = ({b}, {t}, {s}) per "
                    "query (1 for b or t broadcasts)"
                )
            if mask.dim() == 2:
                mask = mask[:, None, :]  # (b, 1, s): the same source padding for every query
        weights = masked_softmax(scores, mask)  # (b, t, s)
        context = weights @ values  # (b, t, d_v)
        if single:
            return context[:, 0], weights[:, 0]
        return context, weights
