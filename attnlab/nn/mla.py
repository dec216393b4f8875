"""Multi-head latent attention (MLA, DeepSeek-V2 Sec. 2.1; DeepSeek-V3).

Keys and values are compressed into one latent per token, and a separate small key carries
the position (decoupled RoPE):

    c_q   = RMSNorm(W_DQ x)                 (optional query compression, q_lora_rank)
    q     = W_UQ c_q  (or W_Q x)            per head [q_nope (d_n) | q_rope (d_r)]
    [c_kv | k_r] = W_DKV x                  c_kv (d_c): the latent; k_r (d_r): one RoPE key
    c_kv  = RMSNorm(c_kv)                   shared by every head
    [k_nope | v] = W_UKV c_kv               per head: k_nope (d_n), v (d_v)
    score = (q_nope . k_nope + RoPE(q_rope) . RoPE(k_r)) * scale
    y     = W_O concat_h(softmax(score) v)

Only c_kv and RoPE(k_r) are cached: d_c + d_r values per token and layer.

Two paths over the same weights:
* naive:    rebuild per-head k_nope and v from every cached latent, then attend (training,
            long prefill: one up-projection per key, shared by all the queries).
* absorbed: q_nope . (W_UK c) = (W_UK^T q_nope) . c and sum_j p_j W_UV c_j = W_UV sum_j p_j c_j,
            so fold W_UK into the query and W_UV into the output and attend in latent space:
            multi-query attention with one key/value head [c_kv | k_r] / c_kv; per-head keys
            and values never exist (decoding: a few queries over a long cache). Its kernel is
            written out here (``_latent_attend``) rather than taken from the backends.

Shapes: b batch, t query length, s key length, d d_model, h heads, d_n qk_nope_head_dim,
d_r qk_rope_head_dim, d_v v_head_dim, d_c kv_lora_rank, d_q q_lora_rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.cache import Cache, LatentKV, LayerCache
from attnlab.config import AttentionConfig
from attnlab.functional.attention import attend, hand_over_weights
from attnlab.functional.masks import (
    causal_mask,
    combine_masks,
    document_mask,
    global_window_mask,
    sliding_window_mask,
)
from attnlab.functional.softmax import masked_softmax, score_operands, softmax_dtype
from attnlab.nn.linear import Linear
from attnlab.nn.norm import RMSNorm
from attnlab.nn.registry import register_attention
from attnlab.nn.rope import RopeTables, RotaryEmbedding

LATENT_NORM_EPS = 1e-6  # DeepSeek's q_a / kv_a RMSNorms use this, whatever the model's eps


@register_attention("mla")
class MultiHeadLatentAttention(nn.Module):
    """Causal self-attention with a latent key/value cache. Parameter names follow the
    DeepSeek checkpoints (``q_proj`` or ``q_a_proj``/``q_a_norm``/``q_b_proj``,
    ``kv_a_proj``, ``kv_a_norm``, ``kv_b_proj``) so that they map one to one. ``doc_ids``
    keeps packed documents apart on both paths (``supports_documents``)."""

    supports_documents = True  # forward takes doc_ids (packed documents)

    def __init__(
        self,
        d_model: int,
        cfg: AttentionConfig,
        *,
        causal: bool = True,
        cross: bool = False,
        context_dim: int | None = None,
        rope: RotaryEmbedding | None = None,
        resid_dropout: float = 0.0,
    ):
        super().__init__()
        if cross:
            raise ValueError("multi-head latent attention is self-attention only")
        dims = cfg.mla_dims(d_model)
        self.n_heads = h = cfg.n_heads
        self.q_lora_rank, self.kv_lora_rank = dims.q_lora_rank, dims.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = (
            dims.qk_nope_head_dim,
            dims.qk_rope_head_dim,
            dims.v_head_dim,
        )
        self.causal, self.window = causal, cfg.sliding_window
        self.backend, self.attn_dropout, self.path = cfg.backend, cfg.dropout, cfg.mla_path
        qk_dim = self.nope_dim + self.rope_dim
        if self.q_lora_rank is None:
            self.q_proj = Linear(d_model, h * qk_dim, bias=False)
        else:
            self.q_a_proj = Linear(d_model, self.q_lora_rank, bias=cfg.qkv_bias)
            self.q_a_norm = RMSNorm(self.q_lora_rank, eps=LATENT_NORM_EPS)
            self.q_b_proj = Linear(self.q_lora_rank, h * qk_dim, bias=False)
        self.kv_a_proj = Linear(d_model, self.kv_lora_rank + self.rope_dim, bias=cfg.qkv_bias)
        self.kv_a_norm = RMSNorm(self.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.kv_b_proj = Linear(self.kv_lora_rank, h * (self.nope_dim + self.v_dim), bias=False)
        self.out = Linear(h * self.v_dim, d_model, bias=cfg.out_bias)
        self.out.residual_projection = True
        self.rope = rope
        self.uses_rope = rope is not None
        # 1/sqrt(d_n + d_r), times YaRN's mscale(factor, mscale_all_dim)^2 when stretched.
        self.scale = qk_dim**-0.5 * (rope.softmax_factor if rope is not None else 1.0)
        self.resid_dropout = nn.Dropout(resid_dropout)

    def new_cache_entry(self, cache: Cache) -> LayerCache:
        """The compressed latent and the shared RoPE key per token (:class:`LatentKV`)."""
        return LatentKV(cache, self.kv_lora_rank, self.rope_dim)

    # ------------------------------------------------------------------ the two paths

    def _up_weights(self) -> tuple[Tensor, Tensor]:
        """W_UK (h, d_n, d_c) and W_UV (h, d_v, d_c): views of kv_b_proj's rows, which are
        [k_nope; v] per head."""
        w = self.kv_b_proj.weight.view(self.n_heads, self.nope_dim + self.v_dim, -1)
        return w[:, : self.nope_dim], w[:, self.nope_dim :]

    def choose_path(self, t: int, s: int, cached: bool) -> str:
        """``mla_path``, or for ``auto`` the path with fewer multiply-adds: naive expands s
        latents, s d_c h (d_n + d_v), and attends, t s h (d_n + d_r + d_v); absorbed maps t
        queries in and out, t h d_c (d_n + d_v), and attends in latent space, t s h
        (2 d_c + d_r). Without a cache (training, a whole prompt) naive is kept."""
        if self.path != "auto":
            return self.path
        if not cached:
            return "naive"
        h, d_c, d_n, d_r, d_v = self.n_heads, self.kv_lora_rank, *self._dims()
        naive = s * d_c * h * (d_n + d_v) + t * s * h * (d_n + d_r + d_v)
        absorbed = t * h * d_c * (d_n + d_v) + t * s * h * (2 * d_c + d_r)
        return "absorbed" if absorbed < naive else "naive"

    def _dims(self) -> tuple[int, int, int]:
        return self.nope_dim, self.rope_dim, self.v_dim

    def _naive(self, q_nope, q_rope, latent, mask, causal, doc_ids=None) -> Tensor:
        b, h, _, _ = q_nope.shape
        s = latent.shape[-2]
        c_kv, k_rope = latent.split((self.kv_lora_rank, self.rope_dim), dim=-1)  # (b, 1, s, .)
        kv = self.kv_b_proj(c_kv.squeeze(1))  # (b, s, h (d_n + d_v))
        kv = kv.view(b, s, h, self.nope_dim + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split((self.nope_dim, self.v_dim), dim=-1)  # (b, h, s, d_n), (b, h, s, d_v)
        k = torch.cat(
            (k_nope, k_rope.expand(b, h, s, self.rope_dim)), dim=-1
        )  # (b, h, s, d_n + d_r)
        q = torch.cat((q_nope, q_rope), dim=-1)  # (b, h, t, d_n + d_r)
        return self._attend(q, k, v, mask, causal, doc_ids)  # (b, h, t, d_v)

    def _absorbed(self, q_nope, q_rope, latent, mask, causal) -> Tensor:
        w_uk, w_uv = self._up_weights()
        q_latent = torch.einsum("bhtn,hnc->bhtc", q_nope, w_uk)  # (b, h, t, d_c)
        q = torch.cat((q_latent, q_rope), dim=-1)  # (b, h, t, d_c + d_r)
        o_latent = self._latent_attend(q, latent, mask, causal)  # (b, h, t, d_c)
        return torch.einsum("bhtc,hvc->bhtv", o_latent, w_uv)  # (b, h, t, d_v)

    def _latent_attend(self, q: Tensor, latent: Tensor, mask, causal: bool) -> Tensor:
        """Attention with one key head [c_kv | k_r] and one value head c_kv shared by all h
        query heads: the heads are stacked as rows of one matrix product, so the cache is
        read once per step and never copied per head (torch's fused kernels would repeat it
        h times for a value width that differs from the key width)."""
        b, h, t, width = q.shape
        keys = latent.squeeze(1)  # (b, s, d_c + d_r)
        s = keys.shape[1]
        qs, ks = score_operands(q, keys)  # float16 in float32: its products overflow
        scores = torch.matmul(qs.reshape(b, h * t, width), ks.transpose(1, 2))  # (b, h t, s)
        scores = scores.view(b, h, t, s) * self.scale
        if causal and t > 1:  # one query is the newest position: it may see every key
            mask = combine_masks(mask, causal_mask(t, s, device=q.device))
        weights = masked_softmax(softmax_dtype(scores), mask).to(q.dtype)  # (b, h, t, s)
        hand_over_weights(lambda: weights)  # to an attention map being recorded
        if self.training and self.attn_dropout > 0:
            weights = F.dropout(weights, p=self.attn_dropout)
        values = keys[..., : self.kv_lora_rank]  # (b, s, d_c)
        return torch.matmul(weights.view(b, h * t, s), values).view(b, h, t, self.kv_lora_rank)

    def _attend(self, q, k, v, mask, causal, doc_ids=None) -> Tensor:
        return attend(
            q,
            k,
            v,
            mask,
            causal=causal,
            scale=self.scale,
            backend=self.backend,
            dropout_p=self.attn_dropout if self.training else 0.0,
            doc_ids=doc_ids,
        )

    def _project(
        self, x: Tensor, positions: Tensor | None, rope: RopeTables | None
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
        """q_nope (b, h, t, d_n), rotated q_rope (b, h, t, d_r), c_kv (b, 1, t, d_c), rotated
        k_rope (b, 1, t, d_r), and the query latent c_q (b, t, d_q) (None without query
        compression)."""
        b, t, _ = x.shape
        c_q = None
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            c_q = self.q_a_norm(self.q_a_proj(x))  # (b, t, d_q)
            q = self.q_b_proj(c_q)
        q = q.view(b, t, self.n_heads, self.nope_dim + self.rope_dim).transpose(1, 2)
        q_nope, q_rope = q.split((self.nope_dim, self.rope_dim), dim=-1)
        c_kv, k_rope = self.kv_a_proj(x).split((self.kv_lora_rank, self.rope_dim), dim=-1)
        c_kv = self.kv_a_norm(c_kv).unsqueeze(1)  # (b, 1, t, d_c)
        k_rope = k_rope.unsqueeze(1)  # (b, 1, t, d_r): one key for every head
        if self.uses_rope:
            rope = self.rope_tables(positions, rope)
            q_rope, k_rope = rope.rotate(q_rope), rope.rotate(k_rope)
        return q_nope, q_rope, c_kv, k_rope, c_q

    def rope_tables(self, positions: Tensor | None, rope: RopeTables | None) -> RopeTables:
        """The cos/sin tables for this pass: ``rope`` when the model computed them, else
        from ``positions`` (a module used on its own)."""
        if rope is not None:
            return rope
        if positions is None:
            raise ValueError("RoPE attention needs positions")
        return self.rope.tables(positions)

    def window_mask(self, t: int, device: torch.device) -> Tensor:
        """(t, t) bool: the sliding window of a pass without a cache. Causal: the last
        ``window`` keys; bidirectional (an encoder's): within window - 1 on either side, as
        multi-head attention's (a causal window made an encoder causal once its input
        outgrew the window: a row's outputs then depended on the padding of its batch)."""
        if self.causal:
            return sliding_window_mask(t, t, self.window, device=device)
        return global_window_mask(t, t, self.window, 0, causal=False, device=device)

    # ------------------------------------------------------------------ forward

    def forward(
        self,
        x: Tensor,
        *,
        positions: Tensor | None = None,
        rope: RopeTables | None = None,
        cache: LayerCache | None = None,
        mask: Tensor | None = None,
        context: Tensor | None = None,
        doc_ids: Tensor | None = None,
    ) -> Tensor:
        """x (b, t, d); positions (b, t) (for RoPE, unless ``rope`` tables are given);
        cache: this layer's :class:`LatentKV`; mask: extra mask broadcastable to
        (b, h, t, s), e.g. key padding (under a cache the cache supplies it); doc_ids
        (b, t): packed documents, no attention across them (without a cache)."""
        if context is not None:
            raise ValueError("multi-head latent attention is self-attention only")
        if doc_ids is not None and cache is not None:
            raise ValueError("doc_ids (packed documents) apply without a cache")
        b, t, _ = x.shape
        h = self.n_heads
        q_nope, q_rope, c_kv, k_rope, _ = self._project(x, positions, rope)
        causal = self.causal
        if cache is not None:
            latent = cache.update(c_kv, k_rope)  # (b, 1, s, d_c + d_r): every token so far
            mask, causal = cache.mask(self.window)
        else:
            latent = torch.cat((c_kv, k_rope), dim=-1)  # (b, 1, t, d_c + d_r)
            if self.window is not None and t > self.window:
                mask, causal = combine_masks(mask, self.window_mask(t, x.device)), False
        path = self.choose_path(t, latent.shape[-2], cache is not None)
        if path == "absorbed" and doc_ids is not None:  # latent attention takes masks only
            mask, doc_ids = combine_masks(mask, document_mask(doc_ids)), None
        if path == "absorbed":
            y = self._absorbed(q_nope, q_rope, latent, mask, causal)  # (b, h, t, d_v)
        else:
            y = self._naive(q_nope, q_rope, latent, mask, causal, doc_ids)
        y = y.transpose(1, 2).reshape(b, t, h * self.v_dim)  # (b, t, h d_v)
        return self.resid_dropout(self.out(y))

    def extra_repr(self) -> str:
        return (
            f"heads={self.n_heads}, q_lora_rank={self.q_lora_rank}, "
            f"kv_lora_rank={self.kv_lora_rank}, qk_nope={self.nope_dim}, "
            f"qk_rope={self.rope_dim}, v={self.v_dim}, path={self.path!r}"
        )
