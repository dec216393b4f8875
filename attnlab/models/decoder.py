"""Decoder-only language model (GPT-2, LLaMA, ... are presets of this one class).

    h_0 = E[idx] (+ P[positions])            token (+ absolute position) embedding
    h_l = Block_l(h_{l-1})                   causal self-attention + feed-forward
    logits = W_out norm(h_L)                 W_out tied to E or separate

Shapes: b batch, t new tokens, d d_model, V vocabulary size.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.cache import KVCache
from attnlab.config import ModelConfig
from attnlab.functional.masks import padding_mask
from attnlab.nn.block import TransformerBlock
from attnlab.nn.embedding import LearnedPositionalEmbedding, SinusoidalPositionalEmbedding
from attnlab.nn.linear import Linear
from attnlab.nn.norm import build_norm
from attnlab.nn.rope import RotaryEmbedding

if TYPE_CHECKING:
    from attnlab.generation import Prompts


class LMOutput(NamedTuple):
    logits: Tensor  # (b, t, V), or (b, 1, V) with last_only=True
    loss: Tensor | None


class DecoderLM(nn.Module):
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
        # One RoPE module shared by every layer (it holds no weights).
        rope = None
        if cfg.position.kind == "rope":
            rope = RotaryEmbedding.from_config(cfg.head_dim, cfg.position)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(TransformerBlock(cfg, rope=rope) for _ in range(cfg.n_layers))
        # Post-norm blocks already end in a norm; pre-norm stacks need a final one.
        self.norm = build_norm(cfg.norm, d) if cfg.norm.placement == "pre" else nn.Identity()
        self.lm_head = Linear(d, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        # GPT-2: scale residual output projections by 1/sqrt(2 * n_layers).
        for name, p in self.named_parameters():
            if name.endswith(("attn.out.weight", "ffn.down.weight")):
                nn.init.normal_(p, std=cfg.init_std / math.sqrt(2 * cfg.n_layers))

    def _init_weights(self, m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=self.cfg.init_std)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    def num_parameters(self, *, exclude_embeddings: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())  # tied weights are counted once
        if exclude_embeddings:
            n -= self.tok_emb.weight.numel()
            if isinstance(self.pos_emb, nn.Embedding):
                n -= self.pos_emb.weight.numel()
        return n

    def new_cache(
        self,
        batch: int,
        max_len: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> KVCache:
        """A preallocated KV cache for ``batch`` rows of up to ``max_len`` tokens."""
        p = self.tok_emb.weight
        return KVCache(
            self.cfg.n_layers,
            batch,
            self.cfg.n_kv_heads,
            max_len or self.cfg.max_seq_len,
            self.cfg.head_dim,
            dtype=dtype or p.dtype,
            device=device or p.device,
        )

    def forward(
        self,
        idx: Tensor,
        *,
        positions: Tensor | None = None,
        cache: KVCache | None = None,
        attention_mask: Tensor | None = None,
        targets: Tensor | None = None,
        last_only: bool = False,
    ) -> LMOutput:
        """idx (b, t) token ids. ``attention_mask`` (b, t): 1 for real tokens, 0 for (left)
        padding. ``positions`` (b, t) default to counting real tokens, continuing from the
        cache. ``targets`` (b, t): the next token at each position (-100 = ignore).
        ``last_only`` computes logits for the last position only (decoding)."""
        b, t = idx.shape
        if last_only and targets is not None:
            raise ValueError("last_only=True keeps one position's logits; the loss needs all")
        if cache is not None:
            cache.reserve(t)
            if positions is None:
                positions = cache.positions_for(t, attention_mask)
            mask = cache.key_mask(t, attention_mask)  # (b, 1, 1, s) or None
        else:
            if positions is None:
                if attention_mask is None:
                    positions = torch.arange(t, device=idx.device)[None, :]  # (1, t)
                else:
                    positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
            mask = None
            if attention_mask is not None and not bool(attention_mask.bool().all()):
                mask = padding_mask(attention_mask)  # (b, 1, 1, t)
        if isinstance(self.pos_emb, LearnedPositionalEmbedding):
            limit = (cache.length if cache is not None else 0) + t
            if limit > self.cfg.max_seq_len:
                raise ValueError(
                    f"sequence of {limit} tokens exceeds max_seq_len={self.cfg.max_seq_len} "
                    "of learned positions; crop the input"
                )
        x = self.tok_emb(idx)  # (b, t, d)
        if self.pos_emb is not None:
            x = x + self.pos_emb(positions).to(x.dtype)
        x = self.drop(x)
        for i, block in enumerate(self.blocks):
            x = block(x, positions=positions, cache=None if cache is None else cache[i], mask=mask)
        if cache is not None:
            cache.advance(t, positions.expand(b, t), attention_mask)
        if last_only:
            x = x[:, -1:]
        logits = self.lm_head(self.norm(x))  # (b, t, V)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(
                logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100
            )
        return LMOutput(logits, loss)

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
