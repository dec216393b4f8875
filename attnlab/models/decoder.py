"""Decoder-only language model (GPT-2, LLaMA, ... are presets of this one class).

    h_0 = E[idx] (* sqrt(d)) (* m_e) (+ P[positions])  token (+ absolute position) embedding
    h_0 = norm(h_0)                          (embedding_norm: BLOOM's LayerNorm)
    h_l = Block_l(h_{l-1})                   causal self-attention + feed-forward
    logits = (W_out norm(h_L) (+ b)) (/ s) (* c_l)  W_out tied to E or separate; b: Phi's, GPT-J's
    logits = c tanh(logits / c)              soft-capped (Gemma 2): c = final_logit_softcap

(Granite: m_e = embedding_multiplier, s = logit_divisor, and each block's sublayer outputs
times residual_multiplier; Cohere: c_l = logit_scale.) A position bias on the scores
(``position.kind`` alibi or relative_bias: ``nn/position_bias.py``) is formed once per pass
from the queries' and keys' absolute positions (under a cache: every key held) and handed
to every block's self-attention.

Shapes: b batch, t new tokens, d d_model, V vocabulary size.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.cache import Cache, CacheError
from attnlab.config import POSITION_BIAS_KINDS, ModelConfig
from attnlab.functional.masks import document_positions, padding_mask, positions_from_padding
from attnlab.functional.softmax import softmax_dtype
from attnlab.models.inputs import check_ids, check_padding_mask, check_targets
from attnlab.models.loadable import LoadableModel
from attnlab.models.outputs import (
    LMOutput,
    aux_modules,
    finish_loss,
    init_residual_projections,
)
from attnlab.nn.block import TransformerStack
from attnlab.nn.dropout import dropout
from attnlab.nn.embedding import LearnedPositionalEmbedding, SinusoidalPositionalEmbedding
from attnlab.nn.linear import Linear
from attnlab.nn.norm import build_norm
from attnlab.nn.position_bias import build_position_bias
from attnlab.nn.registry import ATTENTION, attention_kinds
from attnlab.nn.rope import RotaryEmbedding

if TYPE_CHECKING:
    from attnlab.generation import Prompts

__all__ = ["DecoderLM", "LMOutput"]

# the position kinds a rolling cache (and overflow='roll') takes, as messages name them
RELATIVE_KINDS = "rope, none, alibi or relative_bias"


class DecoderLM(LoadableModel):
    """A decoder-only language model built from a :class:`ModelConfig`.

    ``model(idx, targets=...)`` returns :class:`LMOutput` (``logits, loss = ...``);
    ``new_cache`` makes the cache that ``forward(cache=...)``, ``generate`` and ``stream``
    decode with; ``forward(doc_ids=...)`` trains on packed documents."""

    @classmethod
    def documents_unsupported(cls, cfg: ModelConfig) -> str | None:
        """Why a model of ``cfg`` cannot keep packed documents apart (``forward(doc_ids=)``),
        or None when it can: its attention kind must take document ids."""
        kind = cfg.attention.kind
        attention_kinds()  # registers the built-in kinds
        if getattr(ATTENTION.get(kind), "supports_documents", False):
            return None
        able = [name for name, c in ATTENTION.items() if getattr(c, "supports_documents", False)]
        return (
            f"attention kind {kind!r} cannot keep packed documents apart; "
            f"use model.attention.kind {' or '.join(repr(n) for n in able)}"
        )

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        d = cfg.d_model
        self.tok_emb = nn.Embedding(cfg.vocab_size, d)
        self.pos_emb: nn.Module | None = None
        if cfg.position.kind == "learned":
            self.pos_emb = LearnedPositionalEmbedding(cfg.max_seq_len, d)
        elif cfg.position.kind == "sinusoidal":
            self.pos_emb = SinusoidalPositionalEmbedding(d)
        # One RoPE table for every layer: the angles are computed once per forward pass, as
        # wide as the part of each head the attention kind rotates (cfg.rope_dim).
        self.rope = self.local_rope = None
        if cfg.position.kind == "rope":
            self.rope = RotaryEmbedding.from_config(cfg.rope_dim, cfg.position)
        if cfg.position.local_rope_theta is not None:  # Gemma 3: local layers' own, unscaled
            theta, layout = cfg.position.local_rope_theta, cfg.position.rope_layout
            self.local_rope = RotaryEmbedding(cfg.rope_dim, theta, layout)
        # a bias on the self-attention scores, past keys only (ALiBi, T5's relative bias)
        scale = cfg.attention.scale or cfg.head_dim**-0.5  # (ALiBi scaled with the scores)
        self.pos_bias = build_position_bias(
            cfg.position, cfg.n_heads, bidirectional=False, n_layers=cfg.n_layers,
            score_scale=scale,
        )  # fmt: skip
        # (BLOOM's word_embeddings_layernorm: a norm of norm.kind, as the seq2seq model's)
        self.emb_norm = build_norm(cfg.norm, d) if cfg.embedding_norm else None
        self.drop = dropout(cfg.dropout)
        self.blocks = TransformerStack(cfg, causal=True, rope=self.rope, local_rope=self.local_rope)
        # Post-norm blocks already end in a norm; pre-norm (sandwich, post-sublayer) stacks
        # need one.
        self.norm = build_norm(cfg.norm, d) if cfg.norm.placement != "post" else nn.Identity()
        # (final_logits_bias: the head's own bias, also when its weight is the embedding)
        self.lm_head = Linear(d, cfg.vocab_size, bias=cfg.final_logits_bias)
        self.tie_weights()
        self.apply(self._init_weights)
        init_residual_projections(self, cfg.init_std, cfg.n_layers)
        self._aux = aux_modules(self)
        # A module training alone (DSA's dense warm-up) freezes the rest: see outputs.py.
        self._no_documents = self.documents_unsupported(cfg)

    # What generate(compile=...) keeps on the model for this process: the compiled decode
    # step (a local function: pickling the model failed once it existed, and a deepcopy
    # shared it), the CUDA-graph caches and the compile-failure flag. Neither pickled nor
    # copied: a copy or an unpickled model compiles its own.
    _PROCESS_STATE = ("_compiled_decode_step", "_graph_caches", "_compile_failed")

    def __getstate__(self):
        state = super().__getstate__()
        for name in self._PROCESS_STATE:
            state.pop(name, None)
        return state

    def tied_parameters(self) -> dict[str, str]:
        """The head is the token embedding when ``tie_embeddings``."""
        return {"lm_head.weight": "tok_emb.weight"} if self.cfg.tie_embeddings else {}

    def _init_weights(self, m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=self.cfg.init_std)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
        elif hasattr(m, "init_weights"):  # modules with raw parameters (MoE experts, router)
            m.init_weights(self.cfg.init_std)

    def num_parameters(self, *, exclude_embeddings: bool = False) -> int:
        """Parameters (tied ones counted once); ``exclude_embeddings``: without the token
        embedding, the count scaling laws use."""
        n = sum(p.numel() for p in self.parameters())  # tied weights are counted once
        if exclude_embeddings:
            n -= self.tok_emb.weight.numel()
            if isinstance(self.pos_emb, nn.Embedding):
                n -= self.pos_emb.weight.numel()
        return n

    @property
    def relative_positions(self) -> bool:
        """True when attention depends on relative positions only (RoPE, none, or a bias by
        key - query distance: ALiBi, T5's), so a cache may roll past its capacity (the bias
        reads the positions of the keys the ring holds)."""
        return self.cfg.position.kind in ("rope", "none", *POSITION_BIAS_KINDS)

    def new_cache(
        self,
        batch: int,
        max_len: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        *,
        static: bool = False,
        rolling: bool = False,
    ) -> Cache:
        """A preallocated cache for ``batch`` rows of up to ``max_len`` tokens, one entry
        per layer of the kind its attention keeps. ``static``: fixed shapes for a compiled
        decode step; ``rolling``: continue past ``max_len``, in steps of any size, by
        overwriting the oldest entries, each query seeing the last ``max_len`` tokens
        (models with relative positions only)."""
        if rolling and not self.relative_positions:
            raise CacheError(
                f"a rolling cache needs relative positions ({RELATIVE_KINDS}); this model uses "
                f"{self.cfg.position.kind!r} positions, which cannot slide"
            )
        p = self.tok_emb.weight
        cache = Cache(
            batch,
            max_len or self.cfg.max_seq_len,
            dtype=dtype or p.dtype,
            device=device or p.device,
            static=static,
            rolling=rolling,
        )
        return self.blocks.add_cache_entries(cache)

    def _check_cache_dtype(self, cache: Cache, device: torch.device) -> None:
        """A cache holds keys in the model's dtype (under autocast: any). Another dtype failed
        deep inside attention (q float32, k bf16), or silently rounded a float64 model's
        linear-attention state to float32."""
        dtype = self.tok_emb.weight.dtype
        if cache.dtype != dtype and not torch.is_autocast_enabled(device.type):
            raise CacheError(
                f"the cache holds {cache.dtype} but the model computes in {dtype}; make it "
                "with model.new_cache(...), whose dtype defaults to the model's (or decode "
                "under torch.autocast)"
            )

    def _longrope_pass(
        self, cache: Cache, t: int, attention_mask: Tensor | None, positions: Tensor | None
    ) -> bool | None:
        """Whether this cached pass of t tokens rotates by LongRoPE's long factors (None:
        unchanged, or no LongRoPE). LongRoPE rotates a pass by its long factors once a
        position reaches ``switch_length`` (its original context), by the short ones before:
        a cached pass that switches while the cache holds keys rotated by the short ones
        would mix the two, where the full pass rotates every key by the long ones. Refused
        before the cache changes (transformers' and attnlab's generate re-encode the
        sequence there). Dynamic caches only: a static one is read by no host code
        (generate re-encodes it all the same)."""
        switch = self.rope.switch_length if self.rope is not None else None
        if switch is None or cache.static or cache.rotated_long:
            return None
        held = cache.length
        # positions stay below the slots written (pads do not advance them): no host read
        # until they could reach the switch (explicit positions and rings: always)
        if positions is None and not cache.rolling and held + t <= switch:
            return None
        if positions is None:
            positions = positions_from_padding(attention_mask, t, start=cache.next_position)
        long = bool(positions.max() >= switch)
        if long and held:
            raise CacheError(
                f"LongRoPE switches to its long factors once a position reaches {switch} "
                "(position.rope_original_max_seq_len), and this pass does, but the cache holds "
                "keys rotated by the short ones; encode the whole sequence again into an "
                "empty cache (generate does)"
            )
        return long

    def forward(
        self,
        idx: Tensor,
        *,
        positions: Tensor | None = None,
        cache: Cache | None = None,
        attention_mask: Tensor | None = None,
        targets: Tensor | None = None,
        last_only: bool = False,
        doc_ids: Tensor | None = None,
    ) -> LMOutput:
        """idx (b, t) token ids. ``attention_mask`` (b, t): 1 for real tokens, 0 for (left)
        padding. ``positions`` (b, t) default to counting real tokens, continuing from the
        cache. ``targets`` (b, t): the next token at each position (-100 = ignore).
        ``last_only`` computes logits for the last position only (decoding). ``doc_ids``
        (b, t) non-decreasing per row: packed documents; no token attends across a document
        boundary and positions restart at 0 in each document (no cache)."""
        b, t = check_ids("idx", idx)
        check_padding_mask("attention_mask", attention_mask, b, t)
        if last_only and targets is not None:
            raise ValueError("last_only=True keeps one position's logits; the loss needs all")
        if targets is not None:
            targets = check_targets("targets", targets, (b, t), "(b, t) like idx")
        if doc_ids is not None:
            if self._no_documents:
                raise ValueError(f"doc_ids: {self._no_documents}")
            if cache is not None or doc_ids.shape != (b, t):
                raise ValueError(
                    f"doc_ids must be ({b}, {t}) like idx, without a cache; got "
                    f"{tuple(doc_ids.shape)}{' and a cache' if cache is not None else ''}"
                )
            if positions is None:
                positions = document_positions(doc_ids)  # (b, t): 0 at each document start
        if isinstance(self.pos_emb, LearnedPositionalEmbedding) and not (
            cache is not None and cache.static  # fixed shapes: its caller checks lengths
        ):
            limit = (cache.length if cache is not None else 0) + t
            if limit > self.cfg.max_seq_len:
                raise ValueError(
                    f"sequence of {limit} tokens exceeds max_seq_len={self.cfg.max_seq_len} "
                    "of learned positions; crop the input"
                )
        mask = key_positions = None
        if cache is not None:
            self._check_cache_dtype(cache, idx.device)
            if cache.batch != b:  # before begin(): a wrong batch failed deep inside a layer,
                # after the cache had taken (broadcast) some of its keys
                raise CacheError(
                    f"the cache was made for batch {cache.batch}, idx has batch {b}; make one for "
                    f"this batch with model.new_cache({b}, max_len)"
                )
            long = self._longrope_pass(cache, t, attention_mask, positions)
            step = cache.begin(t, attention_mask, positions=positions)
            positions = step.positions
            if long is not None:
                cache.rotated_long = long
            if self.pos_bias is not None:  # (b, s) every key held, this step's included
                held = cache.key_positions()
                key_positions = held if held is not None else cache.slot_pos[:, : step.end]
        else:
            if positions is None:
                positions = positions_from_padding(attention_mask, t, device=idx.device)
            if attention_mask is not None:
                mask = padding_mask(attention_mask)  # (b, 1, 1, t)
        x = self.tok_emb(idx)  # (b, t, d)
        if self.cfg.scale_embeddings:  # sqrt(d) rounded to the embedding's dtype, as Gemma's
            # (a CPU scalar: multiplies a tensor on any device without a copy to it)
            x = x * torch.tensor(self.cfg.d_model**0.5, dtype=x.dtype)
        if self.cfg.embedding_multiplier != 1.0:  # (Granite's)
            x = x * self.cfg.embedding_multiplier
        if self.pos_emb is not None:
            x = x + self.pos_emb(positions, dtype=x.dtype).to(x.dtype)
        if self.emb_norm is not None:
            x = self.emb_norm(x)
        x = self.drop(x)
        rope = self.rope.tables(positions) if self.rope is not None else None
        local_rope = self.local_rope.tables(positions) if self.local_rope is not None else None
        bias = None
        if self.pos_bias is not None:  # each query's position against every key's
            keys = positions if key_positions is None else key_positions
            bias = self.pos_bias(positions, keys)  # (b or 1, h, t, s), or one per layer
        # (b, t): MoE and DSA statistics skip the padding
        real = attention_mask.bool().expand(b, t) if attention_mask is not None else None
        x = self.blocks(
            x,
            positions=positions,
            rope=rope,
            cache=cache,
            mask=mask,
            doc_ids=doc_ids,
            real_tokens=real,
            local_rope=local_rope,
            bias=bias,
        )
        if cache is not None:
            cache.commit()
        if last_only:
            x = x[:, -1:]
        logits = self.lm_head(self.norm(x))  # (b, t, V)
        if self.cfg.logit_divisor != 1.0:  # (Granite's logits_scaling)
            logits = logits / self.cfg.logit_divisor
        if self.cfg.logit_scale != 1.0:  # (Cohere's)
            logits = logits * self.cfg.logit_scale
        cap = self.cfg.final_logit_softcap
        if cap is not None:  # (transformers' order: / cap, tanh, * cap)
            logits = torch.tanh(logits / cap) * cap
        loss = None
        if targets is not None:
            loss = F.cross_entropy(
                softmax_dtype(logits.flatten(0, 1)), targets.flatten(), ignore_index=-100
            )
        return LMOutput(logits, *finish_loss(self._aux, loss, self.training))

    @torch.inference_mode()
    def generate(
        self, prompts: Prompts, max_new_tokens: int = 32, **kwargs
    ) -> list[int] | list[list[int]]:
        """Generate from one prompt (list of ids / 1-D tensor) or a batch (list of lists /
        2-D tensor). See :func:`attnlab.generation.generate` for the options."""
        from attnlab.generation import generate

        return generate(self, prompts, max_new_tokens, **kwargs)

    def stream(
        self, prompts: Prompts, max_new_tokens: int = 32, **kwargs
    ) -> Iterator[int] | Iterator[list[int | None]]:
        """Like :meth:`generate` but an iterator yielding tokens as they are produced."""
        from attnlab.generation import stream

        return stream(self, prompts, max_new_tokens, **kwargs)
