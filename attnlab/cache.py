"""Caches for decoding. Shapes: b batch, t new tokens, L capacity (slots), h_kv key/value
heads, d_h head dim.

A :class:`Cache` belongs to one model and one batch. It holds one entry per layer, whose
kind follows that layer's attention (dense keys/values here; latent, rolling-window or
recurrent entries for other attention kinds), plus the bookkeeping every layer shares:
which slots hold real tokens (left-padded batches), the absolute position of each slot, and
the next position of each row. A forward pass makes two calls:

    step = cache.begin(t, attention_mask)   # positions of the new tokens, slots to write
    ...  every layer: k, v = cache[i].update(k, v); mask, causal = cache.mask(window)
    cache.commit()                          # the new tokens become part of the past

Two modes. ``static=False`` (default): the filled length is a Python int, keys are the
slots ``[0, length + t)`` and causality is the usual bottom-right alignment, so attention
reads no more than it needs. ``static=True`` (the compiled decode path, as gpt-fast does):
every shape is fixed, new entries are written in place at the slots given by a device
tensor, attention runs over the whole capacity with an explicit mask, and nothing in the
per-token path reads a tensor's value on the host, so a decode step compiles with
``fullgraph=True``. ``rolling=True`` lets steps continue past the capacity by overwriting
the oldest slots (a ring): exact for models whose attention depends on relative positions
only (RoPE, no positions), where it equals attending to the last L tokens. A step of one
token writes first and attends over the ring (the slot it overwrites holds the one key it
no longer sees); a chunk of several, which may overwrite keys its own earlier queries
still need, attends over [ring before the step; new tokens] (L + t keys, a temporary, as
:class:`RollingKV` does) and then keeps its last min(t, L) tokens in the ring. A static
cache cannot tell on the host whether a chunk wraps, so it takes that path for every
chunk of a rolling cache; a dynamic one only for a chunk that wraps.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from attnlab.functional.masks import padding_mask, positions_from_padding, sliding_window_mask
from attnlab.functional.softmax import compute_dtype, score_operands, softmax_dtype


class CacheError(ValueError):
    """A cache is used beyond what it holds."""


def check_global_tokens(global_tokens: list[int], window: int) -> None:
    """Global positions a windowed cache can keep: those inside the first window."""
    late = [p for p in global_tokens if p >= window]
    if late:
        raise CacheError(
            f"attention.global_tokens: position {late[0]} >= sliding_window={window}: a "
            "global query attends to every earlier token, which a windowed cache does "
            "not keep; cached decoding needs global positions below the window"
        )


class CacheStep(NamedTuple):
    positions: Tensor  # (b, t) absolute positions of the new tokens
    slots: Tensor | None  # (t,) slots written (static or wrapped), None: [start, start + t)
    start: int  # first slot written (dynamic mode)
    end: int  # keys are slots [0, end)
    valid: Tensor | None = None  # (b, t) which new tokens are real (not left padding)
    # A rolling cache's chunk: keys are [every slot before the step; the new tokens], whose
    # (positions, valid) (b, L + t) these are; only the last len(slots) new tokens are kept.
    past: tuple[Tensor, Tensor] | None = None


class LayerCache:
    """Base of one layer's entry: knows its cache and takes part in byte accounting.
    ``shared_slots``: the entry stores tokens at the cache's shared slots (so the cache's
    capacity bounds it); entries with their own bounded state (a window ring, a recurrent
    state) set it False."""

    shared_slots = True

    def __init__(self, cache: Cache):
        self.cache = cache

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())

    def tensors(self) -> list[Tensor]:
        return []

    def state(self) -> list[Tensor]:
        """Every tensor decoding writes in place; all zeros in a fresh entry (see
        ``Cache.reset(in_place=True)``). The stored tokens, unless an entry says more."""
        return self.tensors()

    def mask(self, window: int | None = None) -> tuple[Tensor | None, bool]:
        """The shared (mask, causal) of this step: see :meth:`Cache.mask`."""
        return self.cache.mask(window)

    def reorder(self, index: Tensor, batch: int) -> None:
        """Row j becomes a copy of row ``index[j]`` (beam search). Every batch-first tensor
        attribute (first dimension ``batch``, the batch before) is gathered; entries that
        keep batch-first state elsewhere override this."""
        for name, value in list(vars(self).items()):
            if isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == batch:
                setattr(self, name, value.index_select(0, index))


class DenseKV(LayerCache):
    """Keys and values (b, h_kv, L, d_h) of every slot: MHA, GQA and MQA layers."""

    def __init__(self, cache: Cache, n_kv_heads: int, head_dim: int, v_head_dim: int | None = None):
        super().__init__(cache)
        b, L = cache.batch, cache.max_len
        kw = dict(dtype=cache.dtype, device=cache.device)
        self.k = torch.zeros(b, n_kv_heads, L, head_dim, **kw)
        self.v = torch.zeros(b, n_kv_heads, L, v_head_dim or head_dim, **kw)

    def tensors(self) -> list[Tensor]:
        return [self.k, self.v]

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write the new keys/values (b, h_kv, t, d_h); return those to attend to."""
        return self.cache.write(self.k, k), self.cache.write(self.v, v)


class CrossKV(LayerCache):
    """Cross-attention keys/values: projected from the source once, reused every step."""

    def __init__(self, cache: Cache):
        super().__init__(cache)
        self.k: Tensor | None = None
        self.v: Tensor | None = None

    def tensors(self) -> list[Tensor]:
        return [t for t in (self.k, self.v) if t is not None]

    def state(self) -> list[Tensor]:  # projected from the context, none written in place
        return []

    def get(self, context: Tensor | None, project) -> tuple[Tensor, Tensor]:
        if self.k is None:
            if context is None:
                raise CacheError("the first step with a cross-attention cache needs the context")
            self.k, self.v = project(context)
        return self.k, self.v

    def reset(self) -> None:
        self.k = self.v = None


class RollingKV(LayerCache):
    """Keys and values of a sliding-window layer (window w): a ring of w slots, so memory
    stays bounded however long decoding runs. Shapes: (b, h_kv, w, d_h).

    A step of t new tokens attends to [ring; new] (w + t keys, a temporary) with a mask
    built from the stored positions: valid & k_pos <= q_pos & k_pos > q_pos - w. Then the
    last min(t, w) new tokens are written into the ring. Slots are taken in arrival order
    (token n of the stream, pads included, goes to slot n % w), not position % w: left
    padding repeats positions, which would make two tokens of a row share a slot."""

    shared_slots = False

    def __init__(
        self,
        cache: Cache,
        n_kv_heads: int,
        head_dim: int,
        window: int,
        v_head_dim: int | None = None,
    ):
        super().__init__(cache)
        self.window = window
        # A bounded cache never holds more than max_len tokens; a rolling one needs w. Only
        # w - 1 are read (a query's own key comes with its step): the spare slot, 1/w of the
        # ring, keeps it non-empty at w = 1 and "a layer holds its window" exact (analysis).
        self.size = window if cache.rolling else min(window, cache.max_len)
        self._shapes = (n_kv_heads, head_dim, v_head_dim or head_dim)
        self._keys: tuple[Tensor, Tensor] | None = None  # (pos, valid) of this step's keys
        self.reset()

    def reset(self) -> None:
        b, (h_kv, d_h, d_v), w = self.cache.batch, self._shapes, self.size
        kw = dict(dtype=self.cache.dtype, device=self.cache.device)
        dev = self.cache.device
        self.k = torch.zeros(b, h_kv, w, d_h, **kw)
        self.v = torch.zeros(b, h_kv, w, d_v, **kw)
        self.pos = torch.zeros(b, w, dtype=torch.long, device=dev)  # position of each slot
        self.valid = torch.zeros(b, w, dtype=torch.bool, device=dev)  # slot holds a token
        self.written = torch.zeros((), dtype=torch.long, device=dev)  # tokens ever written

    def tensors(self) -> list[Tensor]:
        return [self.k, self.v]

    def state(self) -> list[Tensor]:
        return [self.k, self.v, self.pos, self.valid, self.written]

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Take the new keys/values (b, h_kv, t, d_h); return the w + t to attend to."""
        step = self.cache._step
        if step is None:
            raise CacheError("cache.begin(t) must come before a layer writes to the cache")
        t = k.shape[2]
        pos, valid = step.positions, step.valid  # (b, t)
        if valid is None:
            valid = torch.ones_like(pos, dtype=torch.bool)
        keys_k = torch.cat((self.k, k.to(self.k.dtype)), dim=2)  # (b, h_kv, w + t, d_h)
        keys_v = torch.cat((self.v, v.to(self.v.dtype)), dim=2)
        self._keys = (torch.cat((self.pos, pos), 1), torch.cat((self.valid, valid), 1))
        n = min(t, self.size)  # older new tokens would be overwritten within this step
        slots = (self.written + (t - n) + torch.arange(n, device=k.device)) % self.size
        self.k.index_copy_(2, slots, k[:, :, t - n :].to(self.k.dtype))
        self.v.index_copy_(2, slots, v[:, :, t - n :].to(self.v.dtype))
        self.pos.index_copy_(1, slots, pos[:, t - n :])
        self.valid.index_copy_(1, slots, valid[:, t - n :])
        self.written.add_(t)
        return keys_k, keys_v

    def mask(self, window: int | None = None) -> tuple[Tensor | None, bool]:
        if self._keys is None:
            raise CacheError("a rolling layer's update() must come before its mask()")
        k_pos, k_valid = self._keys  # (b, w + t)
        q_pos = self.cache._step.positions[:, None, :, None]  # (b, 1, t, 1)
        k_pos = k_pos[:, None, None, :]  # (b, 1, 1, w + t)
        w = self.window if window is None else min(window, self.window)
        mask = k_valid[:, None, None, :] & (k_pos <= q_pos) & (k_pos > q_pos - w)
        return mask, False


class GlobalWindowKV(LayerCache):
    """A sliding-window layer with global tokens (``attention.global_tokens``, Longformer):
    the ring of the last ``window`` tokens (a :class:`RollingKV`) and, kept for good, the
    keys and values of the global positions, stored rotated at their own positions (not
    re-placed like :class:`SinkKV`'s), so decoding equals the full forward pass's
    :func:`~attnlab.functional.masks.global_window_mask` attention however long it runs.
    A global query sees every earlier token: the ring still holds them all when every
    global position lies inside the first window, which the constructor requires.
    Shapes: global keys (b, h_kv, g, d_h), ring (b, h_kv, w, d_h)."""

    shared_slots = False

    def __init__(
        self, cache: Cache, n_kv_heads: int, head_dim: int, window: int, global_tokens: list[int]
    ):
        super().__init__(cache)
        check_global_tokens(global_tokens, window)
        self.window = window
        self.ring = RollingKV(cache, n_kv_heads, head_dim, window)
        self.global_pos = torch.tensor(global_tokens, dtype=torch.long, device=cache.device)
        self._shapes = (n_kv_heads, head_dim)
        self.reset()

    def reset(self) -> None:
        b, (h_kv, d_h), g = self.cache.batch, self._shapes, len(self.global_pos)
        kw = dict(dtype=self.cache.dtype, device=self.cache.device)
        self.global_k = torch.zeros(b, h_kv, g, d_h, **kw)
        self.global_v = torch.zeros(b, h_kv, g, d_h, **kw)
        self.global_valid = torch.zeros(b, g, dtype=torch.bool, device=self.cache.device)
        self.ring.reset()

    def tensors(self) -> list[Tensor]:
        return [self.global_k, self.global_v, *self.ring.tensors()]

    def state(self) -> list[Tensor]:  # (global_pos is configuration, not state)
        return [self.global_k, self.global_v, self.global_valid, *self.ring.state()]

    def reorder(self, index: Tensor, batch: int) -> None:
        # Explicit: global_pos (g,) is not batch-first, even when g equals the batch.
        for name in ("global_k", "global_v", "global_valid"):
            setattr(self, name, getattr(self, name).index_select(0, index))
        self.ring.reorder(index, batch)

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Keep the new global tokens' keys/values (b, h_kv, t, d_h), write the ring; return
        [global; ring; new] (b, h_kv, g + w + t, d_h) to attend to."""
        step = self.cache._step
        if step is None:
            raise CacheError("cache.begin(t) must come before a layer writes to the cache")
        p = step.positions  # (b, t)
        valid = step.valid if step.valid is not None else torch.ones_like(p, dtype=torch.bool)
        onehot = valid[:, :, None] & (p[:, :, None] == self.global_pos)  # (b, t, g)
        hit = onehot.any(1)[:, None, :, None]  # (b, 1, g, 1)
        w = onehot.to(self.global_k.dtype)
        new_k = torch.einsum("btg,bhtd->bhgd", w, k.to(w.dtype))
        new_v = torch.einsum("btg,bhtd->bhgd", w, v.to(w.dtype))
        self.global_k.copy_(torch.where(hit, new_k, self.global_k))
        self.global_v.copy_(torch.where(hit, new_v, self.global_v))
        self.global_valid |= onehot.any(1)
        ring_k, ring_v = self.ring.update(k, v)  # (b, h_kv, w + t, d_h)
        return torch.cat((self.global_k, ring_k), 2), torch.cat((self.global_v, ring_v), 2)

    def mask(self, window: int | None = None) -> tuple[Tensor | None, bool]:
        """(b, 1, t, g + w + t): the global keys up to the query, and the window over the
        ring and the new tokens without the global ones (held once, above)."""
        ring_mask, _ = self.ring.mask(window)  # (b, 1, t, w + t)
        k_pos = self.ring._keys[0]  # (b, w + t)
        ring_mask = ring_mask & ~torch.isin(k_pos, self.global_pos)[:, None, None, :]
        q_pos = self.cache._step.positions[:, None, :, None]  # (b, 1, t, 1)
        g_mask = self.global_valid[:, None, None, :] & (self.global_pos <= q_pos)  # (b, 1, t, g)
        return torch.cat((g_mask, ring_mask), -1), False


class SinkKV(LayerCache):
    """StreamingLLM (Xiao et al. 2023): the first ``sinks`` tokens of each row, kept for
    good, plus a ring of the last ``window - sinks``: a query attends to the sinks and the
    last ``window - sinks`` positions, its own included, ``window`` keys in all (the
    paper's code's start_size = sinks, recent_size = window - sinks - 1: its cache holds
    start + recent keys before the query adds its own). Keys are stored un-rotated and given
    their positions within the cache when read, as the paper does: a recent key sits at its
    own distance from the query; a sink j at distance (query's place in the cache) - j,
    where the query's place is min(p, window - 1). So decoding runs forever in bounded
    memory with RoPE angles never beyond the window. While the window is not full this is
    exactly :func:`~attnlab.functional.masks.sink_window_mask` attention.

    The entry computes its attention itself (``attend``): sinks and recent keys need
    different query rotations (two score blocks under one softmax). Reference-speed eager
    maths. Shapes: sinks (b, h_kv, n_s, d_h), ring (b, h_kv, r, d_h), r = window - n_s."""

    shared_slots = False

    def __init__(self, cache: Cache, n_kv_heads: int, head_dim: int, window: int, sinks: int):
        super().__init__(cache)
        # a ring of r = window - sinks, one slot more than is read: see RollingKV's size
        self.window, self.sinks, self.recent = window, sinks, window - sinks
        self._shapes = (n_kv_heads, head_dim)
        self.reset()

    def reset(self) -> None:
        b, (h_kv, d_h), dev = self.cache.batch, self._shapes, self.cache.device
        kw = dict(dtype=self.cache.dtype, device=dev)
        self.sink_k = torch.zeros(b, h_kv, self.sinks, d_h, **kw)
        self.sink_v = torch.zeros(b, h_kv, self.sinks, d_h, **kw)
        self.sink_valid = torch.zeros(b, self.sinks, dtype=torch.bool, device=dev)
        self.k = torch.zeros(b, h_kv, self.recent, d_h, **kw)
        self.v = torch.zeros(b, h_kv, self.recent, d_h, **kw)
        self.pos = torch.zeros(b, self.recent, dtype=torch.long, device=dev)
        self.valid = torch.zeros(b, self.recent, dtype=torch.bool, device=dev)
        self.written = torch.zeros((), dtype=torch.long, device=dev)

    def tensors(self) -> list[Tensor]:
        return [self.sink_k, self.sink_v, self.k, self.v]

    def state(self) -> list[Tensor]:
        return [*self.tensors(), self.sink_valid, self.pos, self.valid, self.written]

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        rope,
        scale: float | None = None,
        *,
        softcap: float | None = None,
    ) -> Tensor:
        """q (b, h, t, d_h), k, v (b, h_kv, t, d_h), all un-rotated; ``rope`` a
        RotaryEmbedding or None (no positions); ``softcap``: scores -> softcap *
        tanh(scores / softcap) before the mask. Returns (b, h, t, d_h)."""
        step = self.cache._step
        if step is None:
            raise CacheError("cache.begin(t) must come before a layer writes to the cache")
        b, h, t, d_h = q.shape
        n_s, r = self.sinks, self.recent
        p = step.positions  # (b, t)
        valid = step.valid if step.valid is not None else torch.ones_like(p, dtype=torch.bool)
        k, v = k.to(self.k.dtype), v.to(self.v.dtype)
        # 1. Real tokens at positions < n_s become sinks (a row's positions are distinct).
        onehot = valid[:, :, None] & (p[:, :, None] == torch.arange(n_s, device=p.device))
        hit = onehot.any(1)  # (b, n_s)
        w = onehot.to(k.dtype)  # (b, t, n_s)
        new_sk = torch.einsum("btn,bhtd->bhnd", w, k)
        new_sv = torch.einsum("btn,bhtd->bhnd", w, v)
        self.sink_k.copy_(torch.where(hit[:, None, :, None], new_sk, self.sink_k))
        self.sink_v.copy_(torch.where(hit[:, None, :, None], new_sv, self.sink_v))
        self.sink_valid |= hit
        # 2. Recent keys: the ring and the new tokens, sinks excluded (held above).
        rk, rv = torch.cat((self.k, k), 2), torch.cat((self.v, v), 2)  # (b, h_kv, r + t, d_h)
        r_pos = torch.cat((self.pos, p), 1)  # (b, r + t)
        r_valid = torch.cat((self.valid, valid), 1) & (r_pos >= n_s)
        q_pos = p[:, None, :, None]  # (b, 1, t, 1)
        rec_mask = r_valid[:, None, None, :] & (r_pos[:, None, None, :] <= q_pos)
        rec_mask = rec_mask & (r_pos[:, None, None, :] > q_pos - r)
        sink_pos = torch.arange(n_s, device=p.device)
        sink_mask = self.sink_valid[:, None, None, :] & (sink_pos <= q_pos)
        # 3. Positions within the cache: the query sits at min(p, window - 1) for the sinks.
        sk = self.sink_k
        q_rec = q_sink = q
        if rope is not None:
            q_rec = rope.tables(p).rotate(q)
            q_sink = rope.tables(p.clamp(max=self.window - 1)).rotate(q)
            rk = rope.tables(r_pos).rotate(rk)
            sk = rope.tables(sink_pos[None, :].expand(b, n_s)).rotate(sk)
        n_rep = h // rk.shape[1]
        rep = (lambda x: x.repeat_interleave(n_rep, dim=1)) if n_rep > 1 else (lambda x: x)
        scale = d_h**-0.5 if scale is None else scale
        q_sink, q_rec, sk, rk_s = score_operands(q_sink, q_rec, sk, rk)  # float16 overflows
        scores = (
            torch.cat((q_sink @ rep(sk).transpose(-1, -2), q_rec @ rep(rk_s).transpose(-1, -2)), -1)
            * scale
        )  # (b, h, t, n_s + r + t)
        if softcap is not None:  # as attend's: after the scale, before the mask
            scores = torch.tanh(scores / softcap) * softcap
        mask = torch.cat((sink_mask.expand(b, 1, t, n_s), rec_mask), -1)
        probs = softmax_dtype(scores).masked_fill(~mask, float("-inf")).softmax(-1)
        probs = probs.nan_to_num(0.0).to(q.dtype)  # rows with no key: zeros
        y = probs @ torch.cat((rep(self.sink_v), rep(rv)), 2)  # (b, h, t, d_h)
        # 4. Keep the last min(t, r) new tokens in the ring (arrival order, as RollingKV).
        n = min(t, r)
        slots = (self.written + (t - n) + torch.arange(n, device=k.device)) % r
        self.k.index_copy_(2, slots, k[:, :, t - n :])
        self.v.index_copy_(2, slots, v[:, :, t - n :])
        self.pos.index_copy_(1, slots, p[:, t - n :])
        self.valid.index_copy_(1, slots, valid[:, t - n :])
        self.written.add_(t)
        return y


class LinearState(LayerCache):
    """A linear-attention layer's recurrent state (Katharopoulos et al. 2020): S = sum
    phi(k) v^T (b, h_kv, d_h, d_v) and z = sum phi(k) (b, h_kv, d_h) over every token so far.
    Its size does not depend on the length: decoding runs on in constant memory."""

    shared_slots = False

    def __init__(self, cache: Cache, n_kv_heads: int, head_dim: int, v_head_dim: int | None = None):
        super().__init__(cache)
        self._shapes = (n_kv_heads, head_dim, v_head_dim or head_dim)
        self.reset()

    def reset(self) -> None:
        b, (h_kv, d_h, d_v) = self.cache.batch, self._shapes
        # Sums over every token so far: float32 in a half-precision cache (bf16's z stops
        # growing after a few thousand tokens), float64 kept
        kw = dict(dtype=compute_dtype(self.cache.dtype), device=self.cache.device)
        self.S = torch.zeros(b, h_kv, d_h, d_v, **kw)
        self.z = torch.zeros(b, h_kv, d_h, **kw)

    def tensors(self) -> list[Tensor]:
        return [self.S, self.z]

    def valid(self) -> Tensor:
        """(b, t) which of this step's tokens are real (pads add nothing to the state)."""
        step = self.cache._step
        if step is None:
            raise CacheError("cache.begin(t) must come before a layer reads its state")
        return step.valid if step.valid is not None else torch.ones_like(step.positions).bool()

    def update(self, S: Tensor, z: Tensor) -> None:
        """Store the state after this step's tokens (in place: static caches keep shapes)."""
        self.S.copy_(S)
        self.z.copy_(z)


class Cache:
    """The decoding cache of one model and one batch (see the module docstring): one entry
    per layer (``cache[i]``) and the slots, positions and padding they share.

    Made by ``model.new_cache(batch, max_len, static=False, rolling=False)`` and passed as
    ``model(idx, cache=cache)``: each call appends its tokens, so a prompt then one token at a
    time equals one full forward pass. ``length`` tokens are held of ``max_len``; ``nbytes``
    counts the memory of every entry; ``reset()`` empties it."""

    def __init__(
        self,
        batch: int,
        max_len: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        static: bool = False,
        rolling: bool = False,
    ):
        if batch < 1 or max_len < 1:
            raise CacheError(f"a cache needs batch >= 1 and max_len >= 1, got {batch}, {max_len}")
        self.batch, self.max_len = batch, max_len
        self.dtype, self.device = dtype, torch.device(device or "cpu")
        self.static, self.rolling = static, rolling
        self.layers: list[LayerCache] = []  # one per layer (self-attention)
        self.cross: list[LayerCache | None] = []  # cross-attention entries, if any
        self._step: CacheStep | None = None
        self.reset()

    # ------------------------------------------------------------------ bookkeeping

    def reset(self, in_place: bool = False) -> None:
        """Forget every token. Fresh tensors by default, not in-place fills: these may have
        been made under inference_mode (by a forward pass) and this may run outside it.
        ``in_place``: zero the same tensors instead (under inference_mode), so that a CUDA
        graph that writes them finds them at the same addresses."""
        if in_place:
            with torch.inference_mode():
                for t in self.state():
                    t.zero_()
            for entry in self.cross:  # projections of the context: made again
                if entry is not None:
                    entry.reset()
            self._length, self.has_padding, self._step = 0, False, None
            self.rotated_long = False
            return
        L, dev = self.max_len, self.device
        self._length = 0  # dynamic mode: slots written so far (ever, when rolling)
        self._slot = torch.zeros((), dtype=torch.long, device=dev)  # static mode's twin
        self.key_valid = torch.zeros(self.batch, L, dtype=torch.bool, device=dev)
        self.slot_pos = torch.zeros(self.batch, L, dtype=torch.long, device=dev)
        self.next_position = torch.zeros(self.batch, dtype=torch.long, device=dev)
        self.has_padding = False
        self._step = None
        # LongRoPE: whether the keys held were rotated by the long factors (kept by the
        # model for a dynamic cache: nn.rope.RotaryEmbedding.switch_length)
        self.rotated_long = False
        for layer in [*getattr(self, "layers", ()), *getattr(self, "cross", ())]:
            if hasattr(layer, "reset"):
                layer.reset()

    def __getitem__(self, layer: int) -> LayerCache:
        return self.layers[layer]

    def __len__(self) -> int:
        return self.length

    @property
    def length(self) -> int:
        """Tokens held (at most max_len). Reads the device in static mode."""
        written = int(self._slot) if self.static else self._length
        return min(written, self.max_len)

    @property
    def wrapped(self) -> bool:
        """Whether a rolling cache has overwritten its oldest slots (more tokens seen than
        ``max_len``)."""
        return (int(self._slot) if self.static else self._length) > self.max_len

    def state(self) -> list[Tensor]:
        """Every tensor decoding writes in place: the shared bookkeeping and each entry's
        state; all zeros in a fresh cache."""
        shared = [self._slot, self.key_valid, self.slot_pos, self.next_position]
        entries = [*self.layers, *(c for c in self.cross if c is not None)]
        return shared + [t for entry in entries for t in entry.state()]

    @property
    def nbytes(self) -> int:
        """Bytes allocated by every layer's entry (full capacity)."""
        return sum(layer.nbytes for layer in [*self.layers, *self.cross] if layer is not None)

    @property
    def shared_slots(self) -> bool:
        """Whether some layer stores tokens at the shared slots (else the per-layer entries
        are bounded on their own, and a rolling cache takes chunks of any size)."""
        return any(layer.shared_slots for layer in self.layers) or not self.layers

    def check(self, t: int) -> None:
        """Raise before any state changes if t more tokens cannot be taken."""
        if self.static:
            return  # no host reads in the static path: its caller checks lengths
        if self.rolling:
            return  # a ring takes chunks of any size (module docstring)
        if self._length + t > self.max_len:
            raise CacheError(
                f"KV cache is full: {self.length} + {t} tokens > capacity {self.max_len}; "
                "create a larger cache with model.new_cache(batch, max_len)"
            )

    def begin(
        self, t: int, attention_mask: Tensor | None = None, positions: Tensor | None = None
    ) -> CacheStep:
        """Positions (b, t) of the next t tokens (pads do not advance them) and the slots
        they take. ``attention_mask`` (b, t): 1 for real tokens, 0 for left padding;
        ``positions``: explicit absolute positions instead of the running count."""
        self.check(t)
        L = self.max_len
        if positions is None:
            positions = positions_from_padding(attention_mask, t, start=self.next_position)
        positions = positions.expand(self.batch, t)  # (b, t)
        if attention_mask is not None and not self.static:
            self.has_padding = self.has_padding or not bool(attention_mask.bool().all())
        valid = (
            torch.ones(self.batch, t, dtype=torch.bool, device=self.device)
            if attention_mask is None
            else attention_mask.bool()
        )
        if self.rolling and not self.shared_slots and not self.static:
            # Only per-layer rings: no shared slots to write (the stream may be any length).
            self._step = CacheStep(positions, None, 0, 0, valid)
            return self._step
        if self.rolling and t > 1 and (self.static or self._length + t > L):
            # A chunk that may wrap: its earlier queries need keys it overwrites, so it
            # attends over [ring; new] and keeps its last n tokens (arrival order).
            n = min(t, L)
            first = self._slot if self.static else self._length
            slots = (first + (t - n) + torch.arange(n, device=self.device)) % L  # (n,)
            past = (torch.cat((self.slot_pos, positions), 1), torch.cat((self.key_valid, valid), 1))
            step = CacheStep(positions, slots, 0, L + t, past=past)
        elif self.static:
            slots = (self._slot + torch.arange(t, device=self.device)) % L  # (t,)
            step = CacheStep(positions, slots, 0, L)
        elif self._length + t > L:  # rolling past the capacity, one token
            slot = self._length % L
            # a fill, not torch.tensor([slot]): a copy from host memory, which on a GPU
            # waits for the device at every rolled token
            slots = torch.full((1,), slot, dtype=torch.long, device=self.device)
            step = CacheStep(positions, slots, slot, L)
        else:
            step = CacheStep(positions, None, self._length, self._length + t)
        step = step._replace(valid=valid)
        self.write(self.key_valid[:, None, :, None], valid[:, None, :, None], step)
        self.write(self.slot_pos[:, None, :, None], positions[:, None, :, None], step)
        self._step = step
        return step

    def write(self, store: Tensor, new: Tensor, step: CacheStep | None = None) -> Tensor:
        """Write ``new`` (b, n, t, ...) into ``store`` (b, n, L, ...) at this step's slots;
        return the keys to attend to: the part of ``store`` (all of it where slots are
        given), or for a rolling cache's chunk [store before the write; new] (b, n, L + t)."""
        step = step or self._step
        if step is None:
            raise CacheError("cache.begin(t) must come before a layer writes to the cache")
        if step.slots is None:
            store[:, :, step.start : step.start + new.shape[2]] = new
            return store[:, :, : step.end]
        new = new.to(store.dtype)
        # a rolling chunk's keys: cat copies the ring before the write below overwrites it
        keys = torch.cat((store, new), 2) if step.past is not None else store
        store.index_copy_(2, step.slots, new[:, :, new.shape[2] - step.slots.shape[0] :])
        return keys

    def key_positions(self) -> Tensor | None:
        """(b, L) the positions of the keys :meth:`write` returned where their slot order
        is not position order (a rolling cache, whose ring wraps); None where it is."""
        step = self._step
        if step is None or step.slots is None or not self.rolling:
            return None
        return self.slot_pos if step.past is None else step.past[0]

    def mask(self, window: int | None = None) -> tuple[Tensor | None, bool]:
        """(mask, causal) for this step's queries over the keys :meth:`write` returned:
        a boolean mask broadcastable to (b, h, t, s) or None, and whether attention must
        still apply bottom-right causality. ``window``: see only the last ``window``
        positions (a sliding-window layer)."""
        step = self._step
        if step is None:
            raise CacheError("cache.begin(t) must come before cache.mask()")
        t, s = step.positions.shape[-1], step.end
        if step.slots is None:  # contiguous slots: causality is bottom-right alignment
            mask = padding_mask(self.key_valid[:, :s]) if self.has_padding else None
            if window is not None and s > window:
                win = sliding_window_mask(t, s, window, device=self.device)
                return (win if mask is None else mask & win), False
            return mask, True
        # Fixed shapes or a ring: everything from the slots' positions.
        k_pos, k_valid = (self.slot_pos, self.key_valid) if step.past is None else step.past
        q_pos = step.positions[:, None, :, None]  # (b, 1, t, 1)
        k_pos = k_pos[:, None, None, :]  # (b, 1, 1, L) or, a rolling chunk's, (b, 1, 1, L + t)
        mask = k_valid[:, None, None, :] & (k_pos <= q_pos)
        if step.past is not None:  # what the ring would hold: the last L tokens
            window = self.max_len if window is None else min(window, self.max_len)
        if window is not None:
            mask = mask & (k_pos > q_pos - window)
        return mask, False

    def reorder(self, index: Tensor, *, cross: bool = True) -> None:
        """Make row j a copy of row ``index[j]`` (n,), for beam search: the batch becomes n
        (it may grow, b -> b * num_beams). Every layer entry (self and cross) and the shared
        bookkeeping follow. ``cross=False`` leaves the cross-attention entries as they are:
        for a caller that knows row j's cross keys/values already equal row ``index[j]``'s
        (beams of one source, reordered among themselves; the batch size must not change)."""
        if self._step is not None:
            raise CacheError("cannot reorder a cache in the middle of a step")
        if not cross and index.shape[0] != self.batch:
            raise CacheError(
                f"cross=False keeps the cross keys/values of {self.batch} rows; {index.shape[0]} "
                "rows need them reordered"
            )
        crossed = [c for c in self.cross if c is not None] if cross else []
        for entry in [*self.layers, *crossed]:
            entry.reorder(index, self.batch)
        for name in ("key_valid", "slot_pos", "next_position"):
            setattr(self, name, getattr(self, name).index_select(0, index))
        self.batch = index.shape[0]

    def commit(self) -> None:
        """The tokens of the step begun become part of the past."""
        step, self._step = self._step, None
        if step is None:
            return
        t = step.positions.shape[-1]
        if self.static:
            self._slot.add_(t)
        else:
            self._length += t
        # A row whose new tokens were all (left) padding keeps its position.
        real = step.valid[:, -1]  # (b,)
        self.next_position.copy_(torch.where(real, step.positions[:, -1] + 1, self.next_position))

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(layers={len(self.layers)}, batch={self.batch}, "
            f"length={self._length}/{self.max_len}, nbytes={self.nbytes}, "
            f"static={self.static}, rolling={self.rolling})"
        )


# The name earlier versions used for the dense cache.
KVCache = Cache


class LatentKV(LayerCache):
    """Multi-head latent attention (DeepSeek-V2): per token only the normalised latent c_kv
    (d_c values) and the one RoPE key shared by every head (d_r values), side by side in one
    tensor (b, 1, L, d_c + d_r) as the absorbed path reads them: (d_c + d_r) values per token
    and layer, against 2 h d_h for dense keys and values."""

    def __init__(self, cache: Cache, kv_lora_rank: int, rope_dim: int):
        super().__init__(cache)
        self.kv_lora_rank, self.rope_dim = kv_lora_rank, rope_dim
        b, L = cache.batch, cache.max_len
        kw = dict(dtype=cache.dtype, device=cache.device)
        self.latent = torch.zeros(b, 1, L, kv_lora_rank + rope_dim, **kw)

    def tensors(self) -> list[Tensor]:
        return [self.latent]

    def update(self, c_kv: Tensor, k_rope: Tensor) -> Tensor:
        """Write the new c_kv (b, 1, t, d_c) and rotated k_rope (b, 1, t, d_r); return
        [c_kv | k_rope] (b, 1, s, d_c + d_r) of every token to attend to."""
        return self.cache.write(self.latent, torch.cat((c_kv, k_rope), dim=-1))


class IndexedLatentKV(LatentKV):
    """DeepSeek sparse attention (DeepSeek-V3.2): the MLA latent entry plus the lightning
    indexer's key of every token, (b, 1, L, d_I): (d_c + d_r + d_I) values per token and
    layer. The indexer reads every key each step (cheap: d_I wide, one head); the core
    attention reads only the index_topk latents it selects."""

    def __init__(self, cache: Cache, kv_lora_rank: int, rope_dim: int, index_dim: int):
        super().__init__(cache, kv_lora_rank, rope_dim)
        b, L = cache.batch, cache.max_len
        self.index_keys = torch.zeros(b, 1, L, index_dim, dtype=cache.dtype, device=cache.device)

    def tensors(self) -> list[Tensor]:
        return [self.latent, self.index_keys]

    def update(self, c_kv: Tensor, k_rope: Tensor, index_k: Tensor) -> tuple[Tensor, Tensor]:
        """Also write the new index keys (b, t, d_I); return the latents (b, 1, s, d_c + d_r)
        and the index keys (b, s, d_I) of every token to attend to."""
        latent = super().update(c_kv, k_rope)
        return latent, self.cache.write(self.index_keys, index_k.unsqueeze(1))[:, 0]
