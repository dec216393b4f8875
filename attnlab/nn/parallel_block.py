"""Parallel transformer blocks: attention and the feed-forward network side by side, both
reading the block's input, their outputs added to it in one residual step.

    parallel (GPT-NeoX, Pythia):                  y = x + attn(norm_a(x)) + ffn(norm_f(x))
    parallel_shared (Phi-1/1.5/2, GPT-J, Cohere):  y = x + attn(norm(x)) + ffn(norm(x))

(both branches scaled by ``residual_multiplier`` where it is not 1, as in sequential blocks)

(Wang and Komatsuzaki's GPT-J; Black et al. 2022, GPT-NeoX-20B, Sec. 2.1.) Sequential
pre-norm is x' = x + attn(norm_a(x)), y = x' + ffn(norm_f(x')): the feed-forward there
reads the attention's output, here it does not. Decoder blocks only: no cross-attention.

Shapes: (b, t, d) in and out.
"""

from __future__ import annotations

from torch import Tensor, nn

from attnlab.cache import LayerCache
from attnlab.config import PARALLEL_NORM_PLACEMENTS, ModelConfig
from attnlab.nn.block import BLOCKS, self_attention
from attnlab.nn.feedforward import build_ffn
from attnlab.nn.norm import build_norm
from attnlab.nn.rope import RopeTables, RotaryEmbedding


class ParallelTransformerBlock(nn.Module):
    """One parallel block (``norm.placement`` ``parallel`` or ``parallel_shared``):
    ``attn`` and ``ffn`` on the same input, each after its own norm (``attn_norm``,
    ``ffn_norm``; ``norm`` None) or after one shared ``norm`` (``attn_norm`` and ``ffn_norm``
    None). Takes and returns what :class:`~attnlab.nn.block.TransformerBlock` does; there is
    no cross-attention (``cross_attn`` None), so ``cross_attention=True`` is refused."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        causal: bool = True,
        cross_attention: bool = False,
        rope: RotaryEmbedding | None = None,
        layer: int = 0,
    ):
        super().__init__()
        placement = cfg.norm.placement
        if placement not in PARALLEL_NORM_PLACEMENTS:
            raise ValueError(
                f"a parallel block needs norm.placement {' or '.join(PARALLEL_NORM_PLACEMENTS)}, "
                f"got {placement!r} (TransformerBlock builds the others)"
            )
        if cross_attention:
            raise ValueError(
                f"norm.placement={placement!r}: parallel blocks have no cross-attention; use "
                "'pre' or 'post' in encoder-decoder models"
            )
        d = cfg.d_model
        shared = placement == "parallel_shared"
        self.norm = build_norm(cfg.norm, d) if shared else None
        self.attn_norm = None if shared else build_norm(cfg.norm, d)
        self.ffn_norm = None if shared else build_norm(cfg.norm, d)
        self.attn = self_attention(cfg, causal=causal, rope=rope, layer=layer)
        self.ffn = build_ffn(cfg.ffn, d, dropout=cfg.dropout, layer=layer)
        self.cross_attn = None  # (the stack asks every block for its cross-attention entry)
        self.residual_multiplier = cfg.residual_multiplier  # (Granite's: x + m (a + f))

    def forward(
        self,
        x: Tensor,
        *,
        positions: Tensor | None = None,
        rope: RopeTables | None = None,
        cache: LayerCache | None = None,
        mask: Tensor | None = None,
        context: Tensor | None = None,
        context_mask: Tensor | None = None,
        cross_cache: LayerCache | None = None,
        doc_ids: Tensor | None = None,
        real_tokens: Tensor | None = None,
        bias: Tensor | None = None,
    ) -> Tensor:
        """x (b, t, d) -> x + attn(norm(x)) + ffn(norm'(x)) (b, t, d); arguments as
        :meth:`TransformerBlock.forward`. ``context`` must be None (no cross-attention)."""
        if context is not None:
            raise ValueError("a parallel block has no cross-attention: context must be None")
        docs = {} if doc_ids is None else {"doc_ids": doc_ids}
        scores = {} if bias is None else {"bias": bias}  # a position bias (T5's), if any
        real = {} if real_tokens is None else {"real_tokens": real_tokens}
        attn_real = real if getattr(self.attn, "has_aux", False) else {}
        ffn_real = real if getattr(self.ffn, "has_aux", False) else {}
        if self.norm is not None:  # one norm read by both sublayers
            h_attn = h_ffn = self.norm(x)
        else:
            h_attn, h_ffn = self.attn_norm(x), self.ffn_norm(x)
        a = self.attn(
            h_attn,
            positions=positions,
            rope=rope,
            cache=cache,
            mask=mask,
            **docs,
            **scores,
            **attn_real,
        )
        y = a + self.ffn(h_ffn, **ffn_real)
        m = self.residual_multiplier
        return x + (y if m == 1.0 else y * m)


for _placement in PARALLEL_NORM_PLACEMENTS:
    BLOCKS[_placement] = ParallelTransformerBlock
