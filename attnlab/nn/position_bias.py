"""Position biases: learned terms added to every layer's attention scores, built by the
model from ``position.kind`` (``POSITION_BIASES``) and handed to its self-attention layers
as ``bias`` (b or 1, h, t, s).

``relative_bias`` (T5): a (buckets, h) table looked up by the bucket of each key's position
relative to the query's (``functional/buckets.py``); one table per stack, shared by its
layers (transformers keeps it in the first layer's self-attention), or with
``position.relative_bias_per_layer`` one table per layer (UMT5), the model then handing the
stack a list of biases, one per layer. Positions are absolute token positions, so a cached
decoding step reads the bias of its query's true position against every cached key.

``alibi`` (Press et al. 2022, "Train Short, Test Long"): no weights, a fixed bias
``-m_h (i - j)`` for query position i and key position j in a causal stack (keys j <= i),
``-m_h |i - j|`` in a bidirectional one, one slope m_h per head (:func:`alibi_slopes`).
Falcon-RW's variants: the bias times the softmax scale (``position.alibi_scaled``), and its
slopes and products rounded to bfloat16 (``position.alibi_bfloat16``).

Shapes: b batch, t query length, s key length, h heads.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from attnlab.config import PositionConfig
from attnlab.functional.buckets import relative_buckets


class RelativePositionBias(nn.Module):
    """T5's bucketed relative position bias: ``bias[b, h, i, j] = table[bucket(k_j - q_i), h]``.
    ``bidirectional``: the encoder's buckets (both signs), else the decoder's (past only).
    With ``cfg.relative_bias_per_layer`` (UMT5) each of the stack's ``n_layers`` layers has
    a table of its own (``tables``) and the forward returns a list of biases, one per layer;
    else one ``table`` serves them all and the forward returns its bias."""

    def __init__(self, cfg: PositionConfig, n_heads: int, *, bidirectional: bool, n_layers: int):
        super().__init__()
        self.bidirectional = bidirectional
        self.num_buckets, self.max_distance = cfg.relative_buckets, cfg.relative_max_distance
        self.table: nn.Embedding | None = None
        self.tables: nn.ModuleList | None = None
        if cfg.relative_bias_per_layer:
            self.tables = nn.ModuleList(
                nn.Embedding(self.num_buckets, n_heads) for _ in range(n_layers)
            )  # (buckets, h) each
        else:
            self.table = nn.Embedding(self.num_buckets, n_heads)  # (buckets, h)

    def forward(self, q_pos: Tensor, k_pos: Tensor) -> Tensor | list[Tensor]:
        """q_pos (b or 1, t), k_pos (b or 1, s) absolute positions -> bias (b or 1, h, t, s),
        or a list of them, one per layer (``tables``)."""
        relative = k_pos[:, None, :] - q_pos[:, :, None]  # (b, t, s)
        buckets = relative_buckets(
            relative,
            bidirectional=self.bidirectional,
            num_buckets=self.num_buckets,
            max_distance=self.max_distance,
        )
        if self.tables is not None:  # the buckets once, each layer's table on them
            return [table(buckets).permute(0, 3, 1, 2) for table in self.tables]
        assert self.table is not None
        return self.table(buckets).permute(0, 3, 1, 2)  # (b, t, s, h) -> (b, h, t, s)

    def extra_repr(self) -> str:
        return (
            f"buckets={self.num_buckets}, max_distance={self.max_distance}, "
            f"bidirectional={self.bidirectional}"
        )


def alibi_slopes(n_heads: int, max_bias: float = 8.0) -> list[float]:
    """ALiBi's slope of each head, largest first.

    n a power of two: the geometric sequence m_h = 2^(-max_bias h / n), h = 1 .. n (the
    paper's 1/2, 1/4, ..., 1/256 for 8 heads and max_bias 8).

    Other n (the paper's footnote, BLOOM's ``_get_alibi_slopes``): with p = 2^floor(log2 n)
    the p slopes of p heads, 2^(-max_bias h / p), then the first n - p slopes of odd index in
    the sequence of 2p heads, 2^(-max_bias (2k - 1) / (2p)), k = 1 .. n - p: the ones that
    fall between the first ones. MPT's ``build_mpt_alibi_tensor`` reaches the same order
    from the 2p sequence directly: its even-index entries (h = 2, 4, ..., 2p: the p-head
    sequence again) and then its odd-index ones, cut to n.

    Returned as Python floats (each 2.0 ** -x, rounded once)."""
    if n_heads < 1:
        raise ValueError(f"ALiBi needs at least one head, got {n_heads}")
    p = 2 ** math.floor(math.log2(n_heads))
    slopes = [2.0 ** (-max_bias * h / p) for h in range(1, p + 1)]
    slopes += [2.0 ** (-max_bias * (2 * k - 1) / (2 * p)) for k in range(1, n_heads - p + 1)]
    return slopes


class AlibiBias(nn.Module):
    """ALiBi: ``bias[b, h, i, j] = -m_h (q_i - k_j)``, or ``-m_h |q_i - k_j|`` when
    ``bidirectional``, from the tokens' absolute positions (a cached step: the query's true
    position against every cached key's; left padding: positions that count real tokens).
    No weights: the slopes are a non-persistent buffer, so checkpoints hold none.
    ``score_scale``: multiplies the slopes (the softmax scale, with
    ``position.alibi_scaled``: Falcon-RW's (q . k + bias) * scale). With
    ``position.alibi_bfloat16`` (causal only) the bias is Falcon's: bf16(bf16(m_h) k_j) *
    score_scale, of the key's position alone (softmax ignores a constant per query row)."""

    def __init__(
        self,
        cfg: PositionConfig,
        n_heads: int,
        *,
        bidirectional: bool,
        n_layers: int,
        score_scale: float = 1.0,
    ):
        super().__init__()
        if cfg.alibi_bfloat16 and bidirectional:
            raise ValueError("position.alibi_bfloat16 rounds the bias of a causal stack only")
        self.bidirectional, self.bfloat16 = bidirectional, cfg.alibi_bfloat16
        self.max_bias, self.score_scale = cfg.alibi_max_bias, score_scale
        slopes = torch.tensor(alibi_slopes(n_heads, cfg.alibi_max_bias), dtype=torch.float32)
        if self.bfloat16:  # rounded as transformers' Falcon rounds them
            slopes = slopes.bfloat16()
        elif score_scale != 1.0:
            slopes = slopes * score_scale
        self.register_buffer("slopes", slopes, persistent=False)  # (h,)

    def forward(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """q_pos (b or 1, t), k_pos (b or 1, s) absolute positions -> bias (b or 1, h, t, s)."""
        if self.bfloat16:  # Falcon's: bf16(m) * k in bfloat16 (whatever the model's dtype)
            keyed = self.slopes.bfloat16()[None, :, None] * k_pos[:, None, :]  # (b, h, s)
            bias = keyed.float()[:, :, None, :] * self.score_scale  # (b, h, 1, s)
            return bias.expand(-1, -1, q_pos.shape[-1], -1)
        distance = (q_pos[:, :, None] - k_pos[:, None, :]).float()  # (b, t, s): i - j
        if self.bidirectional:
            distance = distance.abs()
        return -self.slopes[None, :, None, None] * distance[:, None]  # (b, h, t, s)

    def extra_repr(self) -> str:
        return (
            f"heads={self.slopes.numel()}, max_bias={self.max_bias}, "
            f"bidirectional={self.bidirectional}, score_scale={self.score_scale}, "
            f"bfloat16={self.bfloat16}"
        )


# position.kind -> the bias module of one stack; kinds not listed add no bias to the scores.
POSITION_BIASES: dict[str, Callable[..., nn.Module]] = {
    "relative_bias": RelativePositionBias,
    "alibi": AlibiBias,
}


def build_position_bias(
    cfg: PositionConfig,
    n_heads: int,
    *,
    bidirectional: bool,
    n_layers: int,
    score_scale: float = 1.0,
) -> nn.Module | None:
    """The position bias of ``cfg.kind`` for one stack of ``n_layers`` layers of
    ``n_heads``-head attention, or None where that kind adds none (learned, sinusoidal, RoPE
    positions). ``score_scale``: the attention's softmax scale, which ALiBi multiplies into
    its slopes with ``cfg.alibi_scaled``."""
    make = POSITION_BIASES.get(cfg.kind)
    if make is None:
        return None
    kw = {"score_scale": score_scale} if cfg.kind == "alibi" and cfg.alibi_scaled else {}
    return make(cfg, n_heads, bidirectional=bidirectional, n_layers=n_layers, **kw)
