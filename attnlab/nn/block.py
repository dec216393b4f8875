"""Transformer blocks and the stack of them that every architecture shares.

A block: self-attention, optional cross-attention, feed-forward, each with a residual
connection. Pre-norm (GPT-2, LLaMA): x + f(norm(x)). Post-norm (Vaswani et al.):
norm(x + f(x)). Sandwich (Gemma 2 and 3): x + post_norm(f(norm(x))). Post-sublayer (OLMo 2):
x + post_norm(f(x)). Each sublayer's output may be scaled before its residual add
(``residual_multiplier``, Granite's). The attention and FFN kinds come from their registries.
Parallel blocks (GPT-NeoX, Phi: x + attn(norm(x)) + ffn(norm'(x))) are their own module,
``nn/parallel_block.py``, which the stack builds by ``norm.placement`` (:data:`BLOCKS`).

Shapes: (b, t, d) in and out; context (b, s, d_c).
"""

from __future__ import annotations

from torch import Tensor, nn

from attnlab.cache import Cache, LayerCache
from attnlab.config import ModelConfig
from attnlab.nn.feedforward import build_ffn
from attnlab.nn.norm import build_norm
from attnlab.nn.registry import build_attention
from attnlab.nn.rope import RopeTables, RotaryEmbedding


def self_attention(
    cfg: ModelConfig, *, causal: bool, rope: RotaryEmbedding | None, layer: int
) -> nn.Module:
    """Block ``layer``'s self-attention: ``cfg.attention.kind`` for that layer (local or
    global, by attention.layer_pattern), with QK-norm's RMSNorms of the model's norm eps
    (Qwen3's rms_norm_eps) and kind (Gemma's unit offset). ``position.kind`` disentangled
    (DeBERTa) forms its position terms from q and k: its own module,
    ``nn/disentangled.py``, in place of multi-head attention."""
    if cfg.position.kind == "disentangled":
        from attnlab.nn.disentangled import DisentangledSelfAttention

        return DisentangledSelfAttention(
            cfg.d_model,
            cfg.attention.for_layer(layer),
            position=cfg.position,
            causal=causal,
            rope=rope,
            resid_dropout=cfg.dropout,
        )
    return build_attention(
        cfg.attention.kind,
        cfg.d_model,
        cfg.attention.for_layer(layer),
        causal=causal,
        rope=rope,
        resid_dropout=cfg.dropout,
        **_qk_norm(cfg),
    )


def _qk_norm(cfg: ModelConfig) -> dict:
    """QK-norm's settings for an attention module: the model's norm eps, and its kind (an
    RMSNorm QK-norm stores Gemma's offsets from one where the model's norms do; a LayerNorm
    QK-norm never)."""
    att = cfg.attention
    if not att.qk_norm:
        return {}
    offset = cfg.norm.kind == "gemma_rmsnorm" and att.qk_norm_kind == "rmsnorm"
    return {"norm_eps": cfg.norm.eps, "norm_offset": offset}


class TransformerBlock(nn.Module):
    """One transformer layer: self-attention (causal or not), optional cross-attention,
    and a feed-forward network, each in a residual branch with pre-, post-, sandwich or
    post-sublayer normalisation as ``cfg.norm.placement`` says: ``attn_norm`` /
    ``ffn_norm`` before a sublayer (None in post-sublayer blocks), ``attn_post_norm`` /
    ``ffn_post_norm`` on its output (sandwich and post-sublayer blocks; else None). Input and
    output (b, t, d_model). ``rope``: the RoPE of this layer (a local layer's own where the
    model has two)."""

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
        self.post_residual = placement == "post"  # norm(x + f(x)); else x + ...
        self.residual_multiplier = cfg.residual_multiplier  # (Granite's: x + m f(...))
        d = cfg.d_model

        def pre_norm() -> nn.Module | None:  # the norm before a sublayer (none in OLMo 2's)
            return None if placement == "post_sublayer" else build_norm(cfg.norm, d)

        def post_norm() -> nn.Module | None:  # the norm on a sublayer's output, in its branch
            return build_norm(cfg.norm, d) if placement in ("sandwich", "post_sublayer") else None

        self.attn_norm = pre_norm()
        self.attn_post_norm = post_norm()
        self.attn = self_attention(cfg, causal=causal, rope=rope, layer=layer)
        self.cross_norm = pre_norm() if cross_attention else None
        self.cross_post_norm = post_norm() if cross_attention else None
        self.cross_attn = (
            build_attention(
                "mha", d, cfg.attention, cross=True, resid_dropout=cfg.dropout, **_qk_norm(cfg)
            )
            if cross_attention
            else None
        )
        self.ffn_norm = pre_norm()
        self.ffn_post_norm = post_norm()
        self.ffn = build_ffn(cfg.ffn, d, dropout=cfg.dropout, layer=layer)

    def _residual(
        self, x: Tensor, norm: nn.Module | None, post: nn.Module | None, f, **kw
    ) -> Tensor:
        m = self.residual_multiplier
        if self.post_residual:  # post-norm: the pre-norm slot holds the norm after the add
            y = f(x, **kw)
            return norm(x + (y if m == 1.0 else y * m))
        y = f(x if norm is None else norm(x), **kw)
        y = y if post is None else post(y)
        return x + (y if m == 1.0 else y * m)

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
        """x (b, t, d) -> (b, t, d). ``doc_ids`` (b, t): packed documents, no attention
        across them; passed only when given, to attention kinds with ``supports_documents``.
        ``real_tokens`` (b, t) bool, False at padding: passed only when given, to the
        modules with auxiliary statistics (``has_aux``: MoE, DSA), which leave padding out.
        ``bias`` (b or 1, h, t, s): the model's position bias on the self-attention scores
        (T5's), or what its position module hands the attention (disentangled attention's
        relative embeddings and rows), passed only when given."""
        docs = {} if doc_ids is None else {"doc_ids": doc_ids}
        scores = {} if bias is None else {"bias": bias}
        real = {} if real_tokens is None else {"real_tokens": real_tokens}
        attn_real = real if getattr(self.attn, "has_aux", False) else {}
        ffn_real = real if getattr(self.ffn, "has_aux", False) else {}
        x = self._residual(
            x,
            self.attn_norm,
            self.attn_post_norm,
            self.attn,
            positions=positions,
            rope=rope,
            cache=cache,
            mask=mask,
            **docs,
            **scores,
            **attn_real,
        )
        if self.cross_attn is not None:
            x = self._residual(
                x,
                self.cross_norm,
                self.cross_post_norm,
                self.cross_attn,
                context=context,
                mask=context_mask,
                cache=cross_cache,
            )
        return self._residual(x, self.ffn_norm, self.ffn_post_norm, self.ffn, **ffn_real)


# norm.placement -> the block class that builds it, where not TransformerBlock (the parallel
# placements: nn/parallel_block.py registers itself, imported by attnlab.nn)
BLOCKS: dict[str, type[nn.Module]] = {}


def block_class(cfg: ModelConfig) -> type[nn.Module]:
    """The block class of ``cfg.norm.placement``."""
    import attnlab.nn  # noqa: F401  (registers the parallel blocks)

    return BLOCKS.get(cfg.norm.placement, TransformerBlock)


class TransformerStack(nn.ModuleList):
    """The blocks of an encoder or decoder, run in order (a ModuleList, so parameter names
    stay ``blocks.<i>.…``), each a :class:`TransformerBlock` or the block class that
    ``norm.placement`` names in :data:`BLOCKS` (parallel blocks). Decoder-only, encoder-only
    and encoder–decoder models all use it; cross-attention keys/values are computed once per
    source under a cache.
    ``local_rope`` (Gemma 3's rope_local_base_freq): the RoPE of the local (windowed)
    layers, whose tables ``forward`` then takes as ``local_rope``; else every layer has
    ``rope``. The layers of ``position.nope_layers`` (SmolLM3's NoPE layers) take none.
    ``layer_sets`` (ALBERT's cross-layer sharing): build that many blocks and run layer i with
    block ``i * layer_sets // n`` (consecutive layers reuse one block: the same module, so
    one set of parameters whose gradients sum over its uses); ``order`` lists each layer's
    block. None: a block per layer."""

    def __init__(
        self,
        cfg: ModelConfig,
        n_layers: int | None = None,
        *,
        causal: bool = True,
        cross_attention: bool = False,
        rope: RotaryEmbedding | None = None,
        local_rope: RotaryEmbedding | None = None,
        layer_sets: int | None = None,
    ):
        n = cfg.n_layers if n_layers is None else n_layers
        order = list(range(n)) if layer_sets is None else [i * layer_sets // n for i in range(n)]
        n = n if layer_sets is None else layer_sets  # the blocks built: one per set
        # which blocks take the local RoPE: the windowed ones, where there is one
        local = [local_rope is not None and cfg.attention.window_of(i) is not None
                 for i in range(n)]  # fmt: skip
        nope = [i in cfg.position.nope_layers for i in range(n)]  # no rotation at all
        block = block_class(cfg)
        super().__init__(
            block(
                cfg,
                causal=causal,
                cross_attention=cross_attention,
                rope=None if nope[i] else local_rope if local[i] else rope,
                layer=i,
            )
            for i in range(n)
        )
        self.local, self.nope, self.order = local, nope, order

    def add_cache_entries(self, cache: Cache) -> Cache:
        """One entry per block, of the kind its attention keeps; cross-attention entries
        in ``cache.cross``."""
        cache.layers = [block.attn.new_cache_entry(cache) for block in self]
        cache.cross = [
            block.cross_attn.new_cache_entry(cache) if block.cross_attn is not None else None
            for block in self
        ]
        return cache

    def forward(
        self,
        x: Tensor,
        *,
        positions: Tensor | None = None,
        rope: RopeTables | None = None,
        cache: Cache | None = None,
        mask: Tensor | None = None,
        context: Tensor | None = None,
        context_mask: Tensor | None = None,
        doc_ids: Tensor | None = None,
        real_tokens: Tensor | None = None,
        local_rope: RopeTables | None = None,
        bias: Tensor | list[Tensor] | None = None,
    ) -> Tensor:
        """Run every block in order; arguments as :meth:`TransformerBlock.forward`;
        ``local_rope``: the local layers' tables (a stack built with ``local_rope``);
        ``bias``: one position bias for every layer's self-attention (T5's), or a list of
        one per layer (UMT5's)."""
        if isinstance(bias, list) and len(bias) != len(self.order):
            raise ValueError(f"{len(bias)} position biases for {len(self.order)} layers")
        if any(self.local) and rope is not None and local_rope is None:
            raise ValueError("this stack's local layers have their own RoPE: pass local_rope")
        for i, j in enumerate(self.order):  # layer i runs block j (i, or its shared set)
            x = self[j](
                x,
                positions=positions,
                rope=None if self.nope[j] else local_rope if self.local[j] else rope,
                cache=None if cache is None else cache.layers[i],
                mask=mask,
                context=context,
                context_mask=context_mask,
                cross_cache=None if cache is None else cache.cross[i],
                doc_ids=doc_ids,
                real_tokens=real_tokens,
                bias=bias[i] if isinstance(bias, list) else bias,
            )
        return x
