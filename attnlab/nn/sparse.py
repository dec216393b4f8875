"""Sparse attention: DeepSeek sparse attention (DSA) and native sparse attention (NSA).

DSA (DeepSeek-V3.2-Exp): multi-head latent attention in which each query attends only to
the ``index_topk`` keys a lightning indexer ranks highest:

    q_I[t, j] = RoPE(W_qI c_q[t])            j = 1..H_I index heads, from the query latent
    k_I[s]    = RoPE(LayerNorm(W_kI x[s]))   one index key per token
    w[t, j]   = (W_w x[t])_j / sqrt(H_I)
    I[t, s]   = sum_j w[t, j] ReLU(q_I[t, j] . k_I[s] / sqrt(d_I))
    S_t       = top-k_s I[t, s] among s <= t;   MLA restricted to the keys in S_t

RoPE rotates the first d_r dims of each index head in the split-halves layout (DeepSeek's
reference code), whatever layout the main attention uses. Parameter names follow the
checkpoints (``indexer.wq_b``, ``wk``, ``k_norm``, ``weights_proj``).

Training (DeepSeek-V3.2 Sec. 2.1): ``dsa_stage="warmup"`` keeps attention dense and trains
only the indexer, by KL(p_t || softmax(I[t, :])) where p_t is the main attention summed over
heads and L1-normalised; the rest of the model is frozen (``trains_alone``). ``"sparse"``
attends to S_t; the indexer learns KL(p_t,S_t || softmax(I[t, S_t])) from detached inputs,
where p_t,S_t is that sparse attention (each head's softmax over S_t, summed over heads,
L1-normalised), the rest of the model from the task loss.

NSA (Yuan et al. 2025): three branches over the same queries, mixed per head by learned
sigmoid gates: attention over compressed block summaries, over the top-n selection blocks
(ranked by the compressed attention, shared by the heads of a GQA group; the initial block
and 2 local blocks always among them), and over a sliding window.

Shapes: b batch, t queries, s keys, h heads, h_kv key/value heads, g = h / h_kv, d_h head
dim, H_I index heads, d_I index head dim, k selected keys, n_c compressed blocks, n_s
selection blocks, d_c kv_lora_rank, d_r qk_rope_head_dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.cache import Cache, CacheError, DenseKV, IndexedLatentKV, LayerCache
from attnlab.config import AttentionConfig
from attnlab.functional.attention import attend, hand_over_weights
from attnlab.functional.masks import causal_mask, combine_masks
from attnlab.functional.rope import rope_tables
from attnlab.functional.selection import (
    block_windows,
    fake_fp8,
    hadamard,
    index_scores,
    selection_importance,
    selection_mask,
    topk_select,
)
from attnlab.functional.softmax import (
    compute_dtype,
    masked_softmax,
    score_operands,
    softmax_dtype,
)
from attnlab.nn.linear import Linear
from attnlab.nn.mla import MultiHeadLatentAttention
from attnlab.nn.registry import register_attention
from attnlab.nn.rope import RopeTables, RotaryEmbedding


def split_layout(tables: RopeTables) -> RopeTables:
    """The same angles as split-halves tables (the indexer's layout)."""
    if tables.layout == "split":
        return tables
    cos, sin = tables.cos[..., 0::2], tables.sin[..., 1::2]  # [c0, c0, ..], [-s0, s0, ..]
    return RopeTables(*rope_tables(cos, sin, "split"), "split")


def allowed_keys(mask: Tensor | None, causal: bool, b: int, t: int, s: int, device) -> Tensor:
    """(b, t, s) bool: the keys each query may read (extra mask, bottom-right causality)."""
    allowed = torch.ones(b, 1, t, s, dtype=torch.bool, device=device)
    if mask is not None:
        allowed = allowed & (mask if mask.dtype == torch.bool else mask > float("-inf"))
    if causal:
        allowed = allowed & causal_mask(t, s, device=device)
    return allowed[:, 0]


def _kl_rows(target: Tensor, log_q: Tensor, rows: Tensor) -> Tensor:
    """Mean over the rows that have keys of KL(target || q): sum target (log target - log q)."""
    kl = (torch.xlogy(target, target) - target * log_q.masked_fill(target == 0, 0.0)).sum(-1)
    return (kl * rows).sum() / rows.sum().clamp(min=1)


class LightningIndexer(nn.Module):
    """DeepSeek-V3.2's lightning indexer: a few small ReLU heads whose weighted scores rank
    the keys (module docstring)."""

    def __init__(self, d_model: int, cfg: AttentionConfig):
        super().__init__()
        dims = cfg.mla_dims(d_model)
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_dim(d_model)
        self.rope_dim = dims.qk_rope_head_dim
        self.wq_b = Linear(dims.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = Linear(d_model, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = Linear(d_model, self.n_heads, bias=False)
        self.scale = self.head_dim**-0.5
        self.rotate, self.fp8 = cfg.index_hadamard, cfg.index_fp8

    def _rope(self, x: Tensor, tables: RopeTables) -> Tensor:
        """Rotate the first d_r dims of x (b, n, t, d_I), split halves."""
        d_r = self.rope_dim
        return torch.cat((split_layout(tables).rotate(x[..., :d_r]), x[..., d_r:]), dim=-1)

    def forward(
        self, x: Tensor, c_q: Tensor, rope: RopeTables | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """x (b, t, d), c_q (b, t, d_q) -> q (b, t, H_I, d_I), k (b, t, d_I), w (b, t, H_I)."""
        b, t, _ = x.shape
        q = (
            self.wq_b(c_q).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        )  # (b, H_I, t, d_I)
        k = self.k_norm(self.wk(x)).unsqueeze(1)  # (b, 1, t, d_I)
        if rope is not None:
            q, k = self._rope(q, rope), self._rope(k, rope)
        if self.rotate:
            q, k = hadamard(q), hadamard(k)
        if self.fp8:  # what the reference scores with; the cache keeps these values
            q, k = fake_fp8(q), fake_fp8(k)
        w = softmax_dtype(self.weights_proj(x)) * self.n_heads**-0.5  # (b, t, H_I)
        return q.transpose(1, 2), k[:, 0], w

    def scores(self, q: Tensor, keys: Tensor, w: Tensor) -> Tensor:
        """(b, t, s) index scores of the queries against keys (b, s, d_I)."""
        return index_scores(q, keys, w, self.scale)


@register_attention("dsa")
class DeepSeekSparseAttention(MultiHeadLatentAttention):
    """MLA attending to the top-k keys of a lightning indexer. Two paths, as MLA: ``naive``
    (and training) masks dense attention to the selection (the readable twin); ``absorbed``
    (decoding from a cache) gathers the k selected latents of each query and attends to
    those only, so core attention costs O(k) per token whatever the context."""

    has_aux = True
    supports_documents = False  # the indexer's top-k would select across packed documents

    def __init__(self, d_model: int, cfg: AttentionConfig, **kwargs):
        super().__init__(d_model, cfg, **kwargs)
        self.indexer = LightningIndexer(d_model, cfg)
        self.topk, self.stage = cfg.index_topk, cfg.dsa_stage
        self.trains_alone = self.stage == "warmup"  # the model freezes all but the indexer
        self.aux_loss: Tensor | None = None
        self.aux_metrics: dict[str, Tensor | float] = {}
        self.last_selection: tuple[Tensor, Tensor] | None = None  # (indices, valid), for tests

    def new_cache_entry(self, cache: Cache) -> LayerCache:
        return IndexedLatentKV(cache, self.kv_lora_rank, self.rope_dim, self.indexer.head_dim)

    def alone_parameters(self) -> list[nn.Parameter]:
        """The lightning indexer's parameters, which learn from the indexer's KL loss alone
        (detached inputs). What trains in the warm-up stage (``trains_alone``; the trainer
        drops every other gradient); in both stages the trainer clips their gradient apart
        from the rest of the model's, as if each part trained alone with its own loss."""
        return list(self.indexer.parameters())

    # ------------------------------------------------------------------ sparse core

    def _gathered(self, q_nope, q_rope, latent, indices, valid) -> Tensor:
        """Absorbed attention over each query's own k latents: q (b, h, t, .), latent
        (b, 1, s, d_c + d_r), indices/valid (b, t, k) -> (b, h, t, d_v)."""
        w_uk, w_uv = self._up_weights()
        q = torch.cat((torch.einsum("bhtn,hnc->bhtc", q_nope, w_uk), q_rope), dim=-1)
        keys = latent[:, 0]  # (b, s, d_c + d_r)
        rows = torch.arange(keys.shape[0], device=keys.device)[:, None, None]
        picked = keys[rows, indices]  # (b, t, k, d_c + d_r): only these are read
        qs, ks = score_operands(q, picked)  # float16 in float32: its products overflow
        scores = torch.einsum("bhtc,btkc->bhtk", qs, ks) * self.scale
        weights = masked_softmax(softmax_dtype(scores), valid[:, None]).to(q.dtype)  # (b, h, t, k)
        hand_over_weights(  # recorded as a (b, h, t, s) map over every key, 0 where not picked
            lambda: weights.new_zeros(*weights.shape[:3], keys.shape[1]).scatter_add(
                -1, indices[:, None].expand_as(weights), weights
            )
        )
        if self.training and self.attn_dropout > 0:
            weights = F.dropout(weights, p=self.attn_dropout)
        o_latent = torch.einsum("bhtk,btkc->bhtc", weights, picked[..., : self.kv_lora_rank])
        return torch.einsum("bhtc,hvc->bhtv", o_latent, w_uv)  # (b, h, t, d_v)

    def _head_probs(self, q_nope, q_rope, latent, supports: tuple[Tensor, ...]) -> list[Tensor]:
        """For each support (b, t, s) bool: the main attention over those keys, each head's
        softmax summed over the heads and L1-normalised (b, t, s), computed in latent space
        from the same scores without gradients."""
        with torch.no_grad():
            w_uk, _ = self._up_weights()
            q = torch.cat((torch.einsum("bhtn,hnc->bhtc", q_nope, w_uk), q_rope), dim=-1)
            qs, ks = score_operands(q, latent[:, 0])  # float16 in float32: products overflow
            scores = softmax_dtype(torch.einsum("bhtc,bsc->bhts", qs, ks)) * self.scale
            probs = []
            for support in supports:
                p = masked_softmax(scores, support[:, None]).sum(1)  # (b, t, s)
                probs.append(p / p.sum(-1, keepdim=True).clamp(min=1e-20))
            return probs

    def _indexer_loss(
        self, q_nope, q_rope, latent, scores, allowed, indices, valid, real_tokens=None
    ) -> None:
        """KL of the indexer to the main attention (DeepSeek-V3.2 Sec. 2.1), and the recall
        of the dense attention's mass by the top-k, averaged over the queries that have a key
        and are real tokens (``real_tokens`` (b, t), False at padding: a padded query of an
        encoder still reads the real keys). ``valid`` (b, t, k): the selected slots that hold
        a key. Dense stage: p_t is the dense attention over every allowed key. Sparse stage:
        KL(p_t,S_t || softmax(I[t, S_t])) where p_t,S_t is the main attention of this stage,
        each head's softmax over S_t (the dense scores restricted to S_t), summed over the
        heads and L1-normalised, as Megatron-Core's DSA loss computes it. The dense
        distribution cut to S_t and renormalised is another target: it weights each head by
        its dense mass inside S_t (its KL came out 16% high in a tiny model with peaked heads)."""
        rows = allowed.any(-1)  # (b, t): queries with at least one key
        if real_tokens is not None:
            rows = rows & real_tokens
        rows = rows.to(scores.dtype)
        selected = selection_mask(indices, valid, allowed.shape[-1])
        if self.stage == "warmup":
            support = allowed
            (p_dense,) = self._head_probs(q_nope, q_rope, latent, (allowed,))
            target = p_dense
        else:
            support = selected
            p_dense, target = self._head_probs(q_nope, q_rope, latent, (allowed, selected))
        log_q = torch.log_softmax(scores.masked_fill(~support, float("-inf")), dim=-1)
        self.aux_loss = _kl_rows(target, log_q, rows)
        recall = ((p_dense * selected).sum(-1) * rows).sum() / rows.sum().clamp(min=1)
        self.aux_metrics = {"indexer_kl": self.aux_loss.detach(), "topk_recall": recall}

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
        real_tokens: Tensor | None = None,
    ) -> Tensor:
        """As :meth:`MultiHeadLatentAttention.forward`; ``cache`` an :class:`IndexedLatentKV`.
        ``real_tokens`` (b, t) bool, False at padding: those queries stay out of the
        indexer's loss and metrics."""
        if context is not None:
            raise ValueError("DeepSeek sparse attention is self-attention only")
        b, t, _ = x.shape
        tables = self.rope_tables(positions, rope) if self.uses_rope else None
        q_nope, q_rope, c_kv, k_rope, c_q = self._project(x, positions, tables)
        # Detached inputs: the indexer learns from its KL loss only (DeepSeek-V3.2 Sec. 2.1).
        iq, ik, iw = self.indexer(x.detach(), c_q.detach(), tables)
        causal = self.causal
        if cache is not None:
            latent, index_keys = cache.update(c_kv, k_rope, ik.to(cache.index_keys.dtype))
            mask, causal = cache.mask(self.window)
        else:
            latent, index_keys = torch.cat((c_kv, k_rope), dim=-1), ik  # (b, 1, t, d_c + d_r)
            if self.window is not None and t > self.window:
                mask, causal = combine_masks(mask, self.window_mask(t, x.device)), False
        s = latent.shape[-2]
        allowed = allowed_keys(mask, causal, b, t, s, x.device)  # (b, t, s)
        scores = self.indexer.scores(iq, index_keys, iw)  # (b, t, s)
        order = cache.cache.key_positions() if cache is not None else None  # ring: wrapped
        indices, valid = topk_select(scores, allowed, self.topk, order)  # (b, t, k)
        self.last_selection = (indices, valid)
        if self.stage == "warmup":  # dense attention while the indexer learns to mimic it
            path = self.choose_path(t, s, cache is not None)
            run = self._absorbed if path == "absorbed" else self._naive
            y = run(q_nope, q_rope, latent, mask, causal)
        elif self.choose_path(t, s, cache is not None) == "absorbed":
            y = self._gathered(q_nope, q_rope, latent, indices, valid)
        else:
            keep = selection_mask(indices, valid, s)[:, None]  # (b, 1, t, s)
            y = self._naive(q_nope, q_rope, latent, keep, False)  # (b, h, t, d_v)
        self.aux_loss, self.aux_metrics = None, {}
        if self.training and cache is None:
            self._indexer_loss(q_nope, q_rope, latent, scores, allowed, indices, valid, real_tokens)
        y = y.transpose(1, 2).reshape(b, t, self.n_heads * self.v_dim)  # (b, t, h d_v)
        return self.resid_dropout(self.out(y))

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, index_topk={self.topk}, index_heads="
            f"{self.indexer.n_heads}x{self.indexer.head_dim}, stage={self.stage!r}"
        )


# --------------------------------------------------------------------------- NSA


class BlockCompressor(nn.Module):
    """NSA Eq. 7: phi(block) = MLP(flatten(k_block + intra-block position embedding)),
    a block of l keys (or values) of width d_h -> one d_h summary."""

    def __init__(self, block_len: int, head_dim: int):
        super().__init__()
        self.pos = nn.Parameter(torch.zeros(block_len, head_dim))
        self.up = Linear(block_len * head_dim, 2 * head_dim, bias=True)
        self.down = Linear(2 * head_dim, head_dim, bias=True)

    def forward(self, blocks: Tensor) -> Tensor:
        """blocks (..., n_c, l, d_h) -> (..., n_c, d_h)."""
        return self.down(F.gelu(self.up((blocks + self.pos).flatten(-2))))


@register_attention("nsa")
class NativeSparseAttention(nn.Module):
    """Native sparse attention (Yuan et al. 2025) over one set of GQA queries/keys/values:
    y = g_cmp o_cmp + g_slc o_slc + g_win o_win. (The paper gives each branch its own keys
    and values; here they share one projection, so the parameter count stays near MHA's.)

    Blocks are laid over key slots from slot 0 (a cache's slots, a sequence's tokens), so
    a row must start at slot 0: left-padded rows are refused (``generate`` decodes prompts
    of different lengths one at a time), as is a rolling cache, whose slots wrap.
    Decoding keeps dense keys/values (:class:`DenseKV`) and recomputes the block summaries
    from them at every step: O(s) compression work per token, exact, simple."""

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
        if cross or not causal:
            raise ValueError("native sparse attention is causal self-attention only")
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.kv_heads
        self.head_dim = d_h = cfg.head_dim or d_model // cfg.n_heads
        self.block_len, self.stride = cfg.nsa_block_len, cfg.nsa_stride
        self.select_len, self.n_select, self.window = (
            cfg.nsa_select_len,
            cfg.nsa_n_select,
            cfg.nsa_window,
        )
        self.backend = cfg.backend
        self.q_dim, self.kv_dim = self.n_heads * d_h, self.n_kv_heads * d_h
        self.qkv = Linear(d_model, self.q_dim + 2 * self.kv_dim, bias=cfg.qkv_bias)
        self.compress_k = BlockCompressor(self.block_len, d_h)
        self.compress_v = BlockCompressor(self.block_len, d_h)
        self.gate = Linear(d_model, 3 * self.n_heads, bias=True)  # per head: cmp, slc, win
        self.out = Linear(self.q_dim, d_model, bias=cfg.out_bias)
        self.out.residual_projection = True
        self.rope, self.uses_rope = rope, rope is not None
        self.scale = d_h**-0.5
        self.resid_dropout = nn.Dropout(resid_dropout)

    def new_cache_entry(self, cache: Cache) -> LayerCache:
        """Dense keys and values: the compressed and selected branches are computed from them.
        A rolling cache is refused: its slots wrap, and the blocks lie over slots from 0."""
        if cache.rolling:
            raise CacheError(
                "native sparse attention lays its blocks over key slots from slot 0, which a "
                "rolling cache wraps; make the cache with rolling=False"
            )
        return DenseKV(cache, self.n_kv_heads, self.head_dim)

    # ------------------------------------------------------------------ branches

    def compressed(self, q: Tensor, k: Tensor, v: Tensor, allowed: Tensor):
        """q (b, h, t, d_h), k/v (b, h_kv, s, d_h), allowed (b, t, s) -> o_cmp (b, h, t, d_h)
        and p_cmp (b, h_kv, g, t, n_c), the attention over block summaries, in
        ``compute_dtype`` (float32 for half precision): the selection ranks blocks by it."""
        b, h, t, d_h = q.shape
        s, h_kv = k.shape[2], k.shape[1]
        win = block_windows(s, self.block_len, self.stride, device=q.device)  # (n_c, l)
        if win.shape[0] == 0:
            p = q.new_zeros(b, h_kv, h // h_kv, t, 0, dtype=compute_dtype(q.dtype))
            return q.new_zeros(b, h, t, d_h), p
        k_c = self.compress_k(k[:, :, win])  # (b, h_kv, n_c, d_h)
        v_c = self.compress_v(v[:, :, win])
        ok = allowed[..., win[:, -1]]  # (b, t, n_c): a block is complete when its last key is
        qg = q.view(b, h_kv, h // h_kv, t, d_h)  # (b, h_kv, g, t, d_h)
        qs, ks = score_operands(qg, k_c)  # float16 in float32: its products overflow
        scores = softmax_dtype(torch.einsum("bkgtd,bknd->bkgtn", qs, ks)) * self.scale
        p = masked_softmax(scores, ok[:, None, None])  # zero rows: no block yet
        o = torch.einsum("bkgtn,bknd->bkgtd", p.to(q.dtype), v_c)
        # p unrounded for the selection: bf16's 2^-9 steps tie blocks of near-equal weight
        # (a bf16 model picked other blocks than float32 for 63% of the queries at init)
        return o.reshape(b, h, t, d_h), p

    def select_blocks(self, p_cmp: Tensor, allowed: Tensor) -> Tensor:
        """(b, h_kv, t, s) bool: the keys of the top-n selection blocks of each GQA group
        (importance Eq. 9 summed over the group's heads, Eq. 10), only allowed keys. As in
        the paper's runs (Sec. 4.1), n counts 1 initial and 2 local blocks that are always
        selected: block 0, the query's own block and the one before it."""
        b, t, s = allowed.shape
        n_sel = -(-s // self.select_len)
        with torch.autocast(p_cmp.device.type, enabled=False):  # as a router: float32
            imp = selection_importance(
                softmax_dtype(p_cmp).sum(2), n_sel, self.block_len, self.stride, self.select_len
            )  # (b, h_kv, t, n_s)
        block = torch.arange(n_sel, device=allowed.device)
        opened = allowed[..., block * self.select_len]  # (b, t, n_s): has a key to read
        key_idx = torch.arange(s, device=allowed.device)
        last = torch.where(allowed, key_idx, -1).amax(-1)  # (b, t): the query's own slot
        own = (last // self.select_len)[..., None]  # (b, t, 1)
        fixed = (block == 0) | (block == own) | (block == own - 1)  # (b, t, n_s)
        imp = imp.masked_fill(~opened[:, None], float("-inf"))
        imp = imp.masked_fill(fixed[:, None] & opened[:, None], float("inf"))
        top, valid = topk_select(imp, opened[:, None].expand_as(imp), self.n_select)
        blocks = selection_mask(top, valid, n_sel)  # (b, h_kv, t, n_s)
        keys = blocks.repeat_interleave(self.select_len, dim=-1)[..., :s]  # (b, h_kv, t, s)
        return keys & allowed[:, None]

    def window_keys(self, allowed: Tensor) -> Tensor:
        """(b, t, s) bool: allowed keys among the last ``window`` slots up to the query's."""
        s = allowed.shape[-1]
        key_idx = torch.arange(s, device=allowed.device)
        last = torch.where(allowed, key_idx, -1).amax(-1, keepdim=True)  # (b, t, 1)
        return allowed & (key_idx > last - self.window)

    def _attend(self, q, k, v, keep: Tensor) -> Tensor:
        """Masked attention, keep (b, h_kv or 1, t, s) -> (b, h, t, d_h); rows with no key
        give zeros."""
        g = self.n_heads // self.n_kv_heads
        if keep.shape[1] > 1 and g > 1:
            keep = keep.repeat_interleave(g, dim=1)  # (b, h, t, s)
        y = attend(q, k, v, keep, causal=False, scale=self.scale, backend=self.backend)
        return y.masked_fill(~keep.any(-1, keepdim=True), 0.0)

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
    ) -> Tensor:
        if context is not None:
            raise ValueError("native sparse attention is self-attention only")
        b, t, _ = x.shape
        q, k, v = self.qkv(x).split((self.q_dim, self.kv_dim, self.kv_dim), dim=-1)
        q = q.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)  # (b, h, t, d_h)
        k = k.view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (b, h_kv, t, d_h)
        v = v.view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.uses_rope:
            if rope is None:
                if positions is None:
                    raise ValueError("RoPE attention needs positions")
                rope = self.rope.tables(positions)
            q, k = rope.rotate(q), rope.rotate(k)
        causal = True
        if cache is not None:
            k, v = cache.update(k, v)  # (b, h_kv, s, d_h)
            mask, causal = cache.mask(None)
        if t == 0:  # no query (the block reductions below need one)
            return self.resid_dropout(self.out(x.new_zeros(b, 0, self.q_dim)))
        allowed = allowed_keys(mask, causal, b, t, k.shape[2], x.device)  # (b, t, s)
        if cache is not None:  # the cache knows (no device read per decoding step)
            late_start = cache.cache.has_padding
        elif mask is not None and not torch.compiler.is_compiling():  # (a host read)
            seen = allowed.any(dim=1)  # (b, s): keys some query reads
            late_start = bool((seen.any(dim=1) & ~seen[:, 0]).any())  # a row starts later
        else:
            late_start = False
        if late_start:
            raise ValueError(
                "native sparse attention lays its blocks over key slots from slot 0, so it "
                "cannot take left-padded rows; run prompts of different lengths one at a time"
            )
        o_cmp, p_cmp = self.compressed(q, k, v, allowed)
        o_slc = self._attend(q, k, v, self.select_blocks(p_cmp, allowed))
        o_win = self._attend(q, k, v, self.window_keys(allowed)[:, None])
        gates = torch.sigmoid(self.gate(x)).view(b, t, 3, self.n_heads).permute(2, 0, 3, 1)
        y = sum(g[..., None] * o for g, o in zip(gates, (o_cmp, o_slc, o_win), strict=True))
        y = y.transpose(1, 2).reshape(b, t, self.q_dim)  # (b, t, h d_h)
        return self.resid_dropout(self.out(y))

    def extra_repr(self) -> str:
        return (
            f"heads={self.n_heads}, kv_heads={self.n_kv_heads}, block={self.block_len}/"
            f"{self.stride}, select={self.n_select}x{self.select_len}, window={self.window}"
        )


__all__ = [
    "BlockCompressor",
    "DeepSeekSparseAttention",
    "LightningIndexer",
    "NativeSparseAttention",
    "allowed_keys",
    "split_layout",
]
