"""Multi-head attention with n_kv_heads: MHA (n_kv_heads = n_heads), GQA (a divisor of
n_heads, Ainslie et al. 2023) and MQA (1, Shazeer 2019) are one class. QK-norm
(``qk_norm``, Qwen3): an RMSNorm over each query and key head's features before RoPE; with
``qk_norm_scope`` "projection" (OLMo 2), over the whole query and key projections before
they are split into heads; ``qk_norm_kind`` "layernorm" (Phi, Cohere, StableLM) centres
too, with a bias where ``qk_norm_bias`` says, and ``qk_norm_weight`` "per_head" gives each
head a weight of its own (Cohere's Command R+, StableLM 2 12B).

Shapes: b batch, t query length, s key length, d d_model, h heads, h_kv key/value heads,
d_h head dim.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnlab.cache import Cache, CrossKV, DenseKV, GlobalWindowKV, LayerCache, RollingKV, SinkKV
from attnlab.config import AttentionConfig
from attnlab.functional.attention import attend
from attnlab.functional.masks import (
    combine_masks,
    global_window_mask,
)
from attnlab.functional.rope import apply_partial_rope
from attnlab.nn.dropout import dropout
from attnlab.nn.linear import Linear
from attnlab.nn.norm import build_qk_norm
from attnlab.nn.registry import register_attention
from attnlab.nn.rope import RopeTables, RotaryEmbedding


def split_heads(x: Tensor, n: int, head_dim: int) -> Tensor:
    """(b, t, n * d_h) -> (b, n, t, d_h)."""
    b, t, _ = x.shape
    return x.view(b, t, n, head_dim).transpose(1, 2)


@register_attention("mha")
class MultiHeadAttention(nn.Module):
    """Self-attention (``context=None``) or cross-attention (keys/values from ``context``).

    Self-attention projects q, k, v with one fused matmul; cross-attention projects q from x
    and k, v from the context. ``causal`` applies to self-attention only. Positions enter
    through RoPE tables computed once per forward pass by the model (``rope``), or from
    ``positions`` with the module's own :class:`RotaryEmbedding`. ``doc_ids`` keeps packed
    documents apart (``supports_documents``). ``norm_eps``: QK-norm's epsilon;
    ``norm_offset``: its weights stored as offsets from one (Gemma's RMSNorm).
    ``cfg.scale``: the softmax scale (None: 1 / sqrt(d_h)); ``cfg.softcap``: the scores'
    soft cap (Gemma 2), in every path, cached ones too. ``bias``: a term the model adds to
    the scores (T5's relative position bias, ``nn/position_bias.py``), in every path too.
    ``cfg.clip_qkv``: the projections clamped before the split into heads (MPT).
    """

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
        norm_eps: float = 1e-6,
        norm_offset: bool = False,
    ):
        super().__init__()
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.kv_heads
        self.head_dim = cfg.head_dim or d_model // cfg.n_heads
        self.causal, self.cross = causal and not cross, cross
        self.window, self.sinks = cfg.sliding_window, cfg.sink_tokens
        self.global_tokens = list(cfg.global_tokens)  # Longformer positions, beside the window
        self.backend, self.attn_dropout = cfg.backend, cfg.dropout
        self.scale = cfg.scale  # None: attend's 1 / sqrt(d_h)
        self.softcap = cfg.softcap  # None: no cap on the scores
        self.clip_qkv = cfg.clip_qkv  # None: the projections unclamped (MPT clamps them)
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.q_dim, self.kv_dim = q_dim, kv_dim
        if cross:
            self.q = Linear(d_model, q_dim, bias=cfg.qkv_bias)
            self.kv = Linear(context_dim or d_model, 2 * kv_dim, bias=cfg.qkv_bias)
        else:
            self.qkv = Linear(d_model, q_dim + 2 * kv_dim, bias=cfg.qkv_bias)  # [q; k; v]
        self.out = Linear(q_dim, d_model, bias=cfg.out_bias)
        self.out.residual_projection = True  # GPT-2's scaled init finds it by this role
        # GPT-OSS: a learned logit per head that takes part in every softmax (sinks.py)
        self.sink_logit = nn.Parameter(torch.zeros(self.n_heads)) if cfg.sink_logits else None
        # QK-norm (Qwen3): x / rms(x) * g over each head's d_h features, one g for
        # all query heads and one for all key heads; scope "projection" (OLMo 2): over the
        # whole projection, h d_h queries (g of h d_h) and h_kv d_h keys (g of h_kv d_h);
        # a LayerNorm (Phi: with a bias), or a g per head, (h, d_h) and (h_kv, d_h) (Cohere)
        qk = {"eps": norm_eps, "unit_offset": norm_offset, "kind": cfg.qk_norm_kind}
        qk["bias"] = cfg.qk_norm_bias
        self.qk_norm_per_head = cfg.qk_norm_scope == "head"
        q_width, k_width = (self.head_dim,) * 2 if self.qk_norm_per_head else (q_dim, kv_dim)
        own = cfg.qk_norm_weight == "per_head"  # a weight per head: (n, d_h)
        q_heads, k_heads = (self.n_heads, self.n_kv_heads) if own else (None, None)
        self.q_norm = build_qk_norm(q_width, heads=q_heads, **qk) if cfg.qk_norm else None
        self.k_norm = build_qk_norm(k_width, heads=k_heads, **qk) if cfg.qk_norm else None
        self.rope = rope
        self.uses_rope = rope is not None
        self.resid_dropout = dropout(resid_dropout)

    def new_cache_entry(self, cache: Cache) -> LayerCache:
        """Dense keys and values for self-attention; a ring of ``window`` entries for a
        sliding-window layer; computed-once keys/values for cross-attention."""
        if self.cross:
            return CrossKV(cache)
        if self.sinks:
            return SinkKV(cache, self.n_kv_heads, self.head_dim, self.window, self.sinks)
        if self.global_tokens:
            return GlobalWindowKV(
                cache, self.n_kv_heads, self.head_dim, self.window, self.global_tokens
            )
        if self.window is not None:
            return RollingKV(cache, self.n_kv_heads, self.head_dim, self.window)
        return DenseKV(cache, self.n_kv_heads, self.head_dim)

    def _heads(self, x: Tensor, n: int) -> Tensor:
        return split_heads(x, n, self.head_dim)

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
        bias: Tensor | None = None,
    ) -> Tensor:
        """x (b, t, d); positions (b, t) absolute positions (for RoPE, unless ``rope``
        tables are given); cache: this layer's entry of a :class:`Cache`; mask: extra mask
        broadcastable to (b, h, t, s), e.g. key padding (under a cache the cache supplies
        it); context (b, s, d_c) for cross-attention; doc_ids (b, t): packed documents,
        no attention across them (self-attention without a cache); bias: added to the
        scores after the scale, broadcastable to (b, h, t, s) over the keys attended to
        (under a cache: every key held, this step's included)."""
        b, t, _ = x.shape
        if doc_ids is not None and (cache is not None or self.cross):
            raise ValueError("doc_ids (packed documents) apply to self-attention without a cache")
        if bias is not None and (isinstance(cache, SinkKV) or self.sinks or self.global_tokens):
            raise ValueError("a score bias is not supported with attention sinks or global tokens")
        causal, window = self.causal, None
        if self.cross:
            q = self._normed_heads(self.q_norm, self._clip(self.q(x)), self.n_heads)
            if cache is not None:
                k, v = cache.get(context, self._project_context)  # computed once per source
            elif context is None:
                raise ValueError("cross-attention needs a context tensor")
            else:
                k, v = self._project_context(context)
        else:
            qkv = self._clip(self.qkv(x))  # (b, t, (h + 2 h_kv) d_h): [q; k; v]
            if isinstance(cache, SinkKV):  # StreamingLLM: rotates by positions in the cache
                q, k, v = qkv.split((self.q_dim, self.kv_dim, self.kv_dim), dim=-1)
                q = self._normed_heads(self.q_norm, q, self.n_heads)  # (b, h, t, d_h)
                k = self._normed_heads(self.k_norm, k, self.n_kv_heads)  # (b, h_kv, t, d_h)
                v = self._heads(v, self.n_kv_heads)
                rotary = self.rope if self.uses_rope else None
                y = cache.attend(q, k, v, rotary, self.scale, softcap=self.softcap)
                return self.resid_dropout(self.out(y.transpose(1, 2).reshape(b, t, self.q_dim)))
            if self.uses_rope and rope is None:
                if positions is None:
                    raise ValueError("RoPE attention needs positions")
                rope = self.rope.tables(positions)
            q, k, v = self._project_self(qkv, rope if self.uses_rope else None)
            if cache is not None:
                k, v = cache.update(k, v)  # (b, h_kv, s, d_h): all keys so far
                mask, causal = cache.mask(self.window)
            elif self.sinks and k.shape[-2] > self.window - self.sinks:
                mask, causal = combine_masks(mask, self._sink_mask(positions, t, x.device)), False
            elif self.global_tokens and k.shape[-2] > self.window:
                mask, causal = combine_masks(mask, self._global_mask(positions, t, x.device)), False
            elif self.window is not None and k.shape[-2] > self.window:
                if self.causal:  # attend's window: flash skips the blocks outside
                    window = self.window
                else:  # bidirectional (an encoder's): within window - 1 on either side
                    s = k.shape[-2]
                    win = global_window_mask(t, s, self.window, 0, causal=False, device=x.device)
                    mask, causal = combine_masks(mask, win), False
        if bias is not None:  # additive: a boolean mask becomes 0 / -inf beside it
            mask = combine_masks(mask, bias)
        y = attend(
            q,
            k,
            v,
            mask,
            causal=causal,
            scale=self.scale,
            window=window,
            backend=self.backend,
            dropout_p=self.attn_dropout if self.training else 0.0,
            doc_ids=doc_ids,
            sinks=self.sink_logit,
            softcap=self.softcap,
        )  # (b, h, t, d_h)
        y = y.transpose(1, 2).reshape(b, t, self.q_dim)  # (b, t, h * d_h)
        return self.resid_dropout(self.out(y))

    def _sink_mask(self, positions: Tensor | None, t: int, device: torch.device) -> Tensor:
        """(b or 1, 1, t, t): StreamingLLM's pattern, the sinks picked by the tokens'
        absolute positions (a left-padded row's sinks are its first real tokens): the
        sinks are global tokens beside a local window of the other window - sinks."""
        if positions is None:
            positions = torch.arange(t, device=device)[None, :]  # (1, t)
        is_sink = positions < self.sinks  # (b or 1, t)
        # a bidirectional layer (an encoder's) keeps its window on both sides of the query
        return global_window_mask(
            t, t, self.window - self.sinks, is_sink, causal=self.causal, device=device
        )

    def _global_mask(self, positions: Tensor | None, t: int, device: torch.device) -> Tensor:
        """(b or 1, 1, t, t): the local window plus ``global_tokens``, picked by the tokens'
        absolute positions (left padding shifts them)."""
        if positions is None:
            positions = torch.arange(t, device=device)[None, :]  # (1, t)
        wanted = torch.tensor(self.global_tokens, device=positions.device)
        is_global = torch.isin(positions, wanted)  # (b or 1, t)
        return global_window_mask(t, t, self.window, is_global, causal=self.causal, device=device)

    def _project_self(self, qkv: Tensor, rope: RopeTables | None) -> tuple[Tensor, Tensor, Tensor]:
        """Split [q; k; v] (b, t, (h + 2 h_kv) d_h) into heads, q and k rotated by ``rope``.
        q and k are rotated together, as one (b, t, h + h_kv, d_h) tensor: one rotation per
        layer instead of two (the same elementwise maths; tests compare with rotating each)."""
        b, t, _ = qkv.shape
        n_qk = self.n_heads + self.n_kv_heads
        qk, v = qkv.split((self.q_dim + self.kv_dim, self.kv_dim), dim=-1)
        if self.q_norm is not None and not self.qk_norm_per_head:  # OLMo 2: whole widths
            q, k = qk.split((self.q_dim, self.kv_dim), dim=-1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=-1)  # (b, t, (h + h_kv) d_h)
        qk = qk.view(b, t, n_qk, self.head_dim)  # (b, t, h + h_kv, d_h)
        if self.q_norm is not None and self.qk_norm_per_head:  # QK-norm, per head
            q, k = qk.split((self.n_heads, self.n_kv_heads), dim=2)  # (b, t, n, d_h): a
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=2)  # weight per head fits
        if rope is not None:  # tables (b or 1, 1, t, d_r) -> (b or 1, t, 1, d_r); d_r <= d_h
            cos, sin = rope.cos.transpose(1, 2), rope.sin.transpose(1, 2)
            qk = apply_partial_rope(qk, cos, sin, rope.layout)
        q, k = qk.transpose(1, 2).split((self.n_heads, self.n_kv_heads), dim=1)  # (b, n, t, d_h)
        return q, k, self._heads(v, self.n_kv_heads)

    def _clip(self, x: Tensor) -> Tensor:
        """The projections clamped to [-clip_qkv, clip_qkv] (MPT's clip_qkv), else as they are."""
        return x if self.clip_qkv is None else x.clamp(-self.clip_qkv, self.clip_qkv)

    def _project_context(self, context: Tensor) -> tuple[Tensor, Tensor]:
        k, v = self._clip(self.kv(context)).split(self.kv_dim, dim=-1)
        k = self._normed_heads(self.k_norm, k, self.n_kv_heads)  # (b, h_kv, s, d_h)
        return k, self._heads(v, self.n_kv_heads)

    def _normed_heads(self, norm: nn.Module | None, x: Tensor, n: int) -> Tensor:
        """(b, t, n * d_h) -> (b, n, t, d_h), QK-normed where the module has it: over the
        whole width before the split (scope "projection"), else over each head's d_h (on
        (b, t, n, d_h), where a weight per head lines up with the heads)."""
        if norm is None:
            return self._heads(x, n)
        if not self.qk_norm_per_head:
            return self._heads(norm(x), n)  # normed over (b, t, n * d_h)
        b, t, _ = x.shape
        return norm(x.view(b, t, n, self.head_dim)).transpose(1, 2)  # (b, n, t, d_h)
