"""Disentangled attention (He et al. 2021, "DeBERTa: Decoding-enhanced BERT with
Disentangled Attention"; DeBERTa-v2/v3 as transformers' ``DebertaV2Model``).

Each token is a content vector and a relative position. One table of 2k relative-position
embeddings P (``RelativePositionTable``, shared by the layers, LayerNormed) is projected by
every layer into position keys K^r = P W_k^r and position queries Q^r = P W_q^r (with
``position.disentangled_share_key``, v3's, by the layer's own content projections W_k,
W_q). With d(i, j) = clamp(bucket(i - j) + k, 0, 2k - 1) the row of query i's distance to
key j (``functional/buckets.py``: log-bucketed past buckets / 2), the scores are

    A[i, j] = ( q_i . k_j                      content -> content
              + q_i . K^r[d(i, j)]             content -> position   (c2p)
              + k_j . Q^r[d(i, j)] )           position -> content   (p2c)
              / sqrt(d_h (1 + number of terms))

with the terms ``position.disentangled_terms`` lists. The position terms are formed here
from q and k, scaled, and handed to ``attend`` as an additive term beside the padding mask
(so every backend runs it); the other attention kinds never see this module.

Shapes: b batch, t query length, s key length, d d_model, h heads, d_h head dim,
k half the relative-embedding rows (2k rows).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.config import AttentionConfig, PositionConfig
from attnlab.functional.attention import attend
from attnlab.functional.buckets import log_bucket_positions
from attnlab.functional.masks import combine_masks
from attnlab.nn.attention import split_heads
from attnlab.nn.dropout import dropout
from attnlab.nn.linear import Linear


def relative_rows(q_pos: Tensor, k_pos: Tensor, cfg: PositionConfig) -> Tensor:
    """q_pos (b or 1, t), k_pos (b or 1, s) absolute positions -> the table row d(i, j) of
    each query-key pair, (b or 1, t, s) long: clamp(bucket(q_i - k_j) + k, 0, 2k - 1)."""
    relative = q_pos[:, :, None] - k_pos[:, None, :]  # (b, t, s): query - key
    if cfg.disentangled_buckets:
        relative = log_bucket_positions(
            relative,
            buckets=cfg.disentangled_buckets,
            max_distance=cfg.disentangled_max_distance,
        )
    span = cfg.disentangled_span()
    return (relative + span).clamp(0, 2 * span - 1)


@dataclass(frozen=True)
class RelativePositions:
    """What the model hands every disentangled layer: the (normed) relative embeddings
    (2k, d) and each query-key pair's row in them (b or 1, t, s)."""

    embeddings: Tensor
    rows: Tensor


class RelativePositionTable(nn.Module):
    """The shared relative-position embeddings (2k, d) of a stack, LayerNormed
    (``position.disentangled_norm``) and dropped out once per pass; the forward pairs them
    with the rows of each query-key distance."""

    def __init__(self, cfg: PositionConfig, d_model: int, *, eps: float, dropout: float = 0.0):
        super().__init__()
        self.cfg = cfg
        self.embeddings = nn.Embedding(2 * cfg.disentangled_span(), d_model)  # (2k, d)
        self.norm = nn.LayerNorm(d_model, eps=eps) if cfg.disentangled_norm else nn.Identity()
        self.drop = nn.Dropout(dropout)

    def forward(self, q_pos: Tensor, k_pos: Tensor) -> RelativePositions:
        table = self.drop(self.norm(self.embeddings.weight))  # (2k, d)
        return RelativePositions(table, relative_rows(q_pos, k_pos, self.cfg))


class DisentangledSelfAttention(nn.Module):
    """Bidirectional self-attention with DeBERTa's content and position terms. q, k, v
    come from one fused projection ``qkv`` (as :class:`MultiHeadAttention`'s); without
    ``share_key`` the position keys and queries have their own ``pos_key`` / ``pos_query``
    projections (for the terms that read them). ``bias`` is the model's
    :class:`RelativePositions`. No cache, no cross-attention: an encoder's layer."""

    supports_documents = False

    def __init__(
        self,
        d_model: int,
        cfg: AttentionConfig,
        *,
        position: PositionConfig,
        causal: bool = False,
        rope: object | None = None,
        resid_dropout: float = 0.0,
        **_: object,
    ):
        super().__init__()
        if causal or rope is not None:
            raise ValueError("disentangled attention is bidirectional and takes no RoPE")
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.head_dim or d_model // cfg.n_heads
        self.q_dim = self.n_heads * self.head_dim
        self.terms = tuple(position.disentangled_terms)
        self.share_key = position.disentangled_share_key
        self.backend, self.attn_dropout = cfg.backend, cfg.dropout
        # 1 / sqrt(d_h (1 + terms)): each term adds as much variance as q . k
        self.root = math.sqrt(self.head_dim * (1 + len(self.terms)))
        self.scale = 1.0 / self.root
        self.qkv = Linear(d_model, 3 * self.q_dim, bias=cfg.qkv_bias)  # [q; k; v]
        self.out = Linear(self.q_dim, d_model, bias=cfg.out_bias)
        self.out.residual_projection = True
        if not self.share_key:
            if "c2p" in self.terms:
                self.pos_key = Linear(d_model, self.q_dim, bias=True)
            if "p2c" in self.terms:
                self.pos_query = Linear(d_model, self.q_dim, bias=True)
        self.resid_dropout = dropout(resid_dropout)

    def new_cache_entry(self, cache: object) -> None:
        raise ValueError("disentangled attention is an encoder's: it keeps no cache")

    def _position_heads(self, table: Tensor, which: str) -> Tensor:
        """(2k, d) -> the position keys (``which`` "key") or queries (h, 2k, d_h): the
        layer's own key / query projection (share_key) or its pos_key / pos_query."""
        if self.share_key:
            rows = slice(self.q_dim, 2 * self.q_dim) if which == "key" else slice(0, self.q_dim)
            bias = None if self.qkv.bias is None else self.qkv.bias[rows]
            projected = F.linear(table, self.qkv.weight[rows], bias)  # (2k, h d_h)
        else:
            projected = (self.pos_key if which == "key" else self.pos_query)(table)
        return projected.view(-1, self.n_heads, self.head_dim).transpose(0, 1)  # (h, 2k, d_h)

    def position_scores(self, q: Tensor, k: Tensor, rel: RelativePositions) -> Tensor:
        """c2p + p2c, unscaled, (b, h, t, s), for q (b, h, t, d_h) and k (b, h, s, d_h)."""
        b, h, t, _ = q.shape
        s = k.shape[-2]
        rows = rel.rows[:, None]  # (b or 1, 1, t, s)
        scores = q.new_zeros(b, h, t, s)
        if "c2p" in self.terms:  # q_i . K^r[d(i, j)]
            every = q @ self._position_heads(rel.embeddings, "key").transpose(-1, -2)
            scores = scores + every.gather(-1, rows.expand(b, h, t, s))  # (b, h, t, 2k) -> s
        if "p2c" in self.terms:  # k_j . Q^r[d(i, j)]
            every = k @ self._position_heads(rel.embeddings, "query").transpose(-1, -2)
            by_key = every.gather(-1, rows.transpose(-1, -2).expand(b, h, s, t))  # (b, h, s, t)
            scores = scores + by_key.transpose(-1, -2)
        return scores

    def forward(
        self,
        x: Tensor,
        *,
        positions: Tensor | None = None,
        rope: object | None = None,
        cache: object | None = None,
        mask: Tensor | None = None,
        context: Tensor | None = None,
        bias: RelativePositions | None = None,
    ) -> Tensor:
        """x (b, t, d) -> (b, t, d); mask: key padding, broadcastable to (b, h, t, s);
        bias: the model's :class:`RelativePositions`."""
        if cache is not None or context is not None:
            raise ValueError("disentangled attention is self-attention without a cache")
        if not isinstance(bias, RelativePositions):
            raise ValueError("disentangled attention needs the model's relative positions")
        b, t, _ = x.shape
        qkv = self.qkv(x).split(self.q_dim, dim=-1)  # [q; k; v], (b, t, h d_h) each
        q, k, v = (split_heads(y, self.n_heads, self.head_dim) for y in qkv)  # (b, h, t, d_h)
        terms = self.position_scores(q, k, bias) / self.root  # (b, h, t, s)
        y = attend(
            q,
            k,
            v,
            combine_masks(mask, terms),
            scale=self.scale,
            backend=self.backend,
            dropout_p=self.attn_dropout if self.training else 0.0,
        )  # (b, h, t, d_h)
        y = y.transpose(1, 2).reshape(b, t, self.q_dim)  # (b, t, h d_h)
        return self.resid_dropout(self.out(y))
