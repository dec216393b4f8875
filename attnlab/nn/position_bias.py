"""Position biases: learned terms added to every layer's attention scores, built by the
model from ``position.kind`` (``POSITION_BIASES``) and handed to its self-attention layers
as ``bias`` (b or 1, h, t, s).

``relative_bias`` (T5): a (buckets, h) table looked up by the bucket of each key's position
relative to the query's (``functional/buckets.py``); one table per stack, shared by its
layers (transformers keeps it in the first layer's self-attention). Positions are absolute
token positions, so a cached decoding step reads the bias of its query's true position
against every cached key.

Shapes: b batch, t query length, s key length, h heads.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from attnlab.config import PositionConfig
from attnlab.functional.buckets import relative_buckets


class RelativePositionBias(nn.Module):
    """T5's bucketed relative position bias: ``bias[b, h, i, j] = table[bucket(k_j - q_i), h]``.
    ``bidirectional``: the encoder's buckets (both signs), else the decoder's (past only)."""

    def __init__(self, cfg: PositionConfig, n_heads: int, *, bidirectional: bool):
        super().__init__()
        self.bidirectional = bidirectional
        self.num_buckets, self.max_distance = cfg.relative_buckets, cfg.relative_max_distance
        self.table = nn.Embedding(self.num_buckets, n_heads)  # (buckets, h)

    def forward(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """q_pos (b or 1, t), k_pos (b or 1, s) absolute positions -> bias (b or 1, h, t, s)."""
        relative = k_pos[:, None, :] - q_pos[:, :, None]  # (b, t, s)
        buckets = relative_buckets(
            relative,
            bidirectional=self.bidirectional,
            num_buckets=self.num_buckets,
            max_distance=self.max_distance,
        )
        return self.table(buckets).permute(0, 3, 1, 2)  # (b, t, s, h) -> (b, h, t, s)

    def extra_repr(self) -> str:
        return (
            f"buckets={self.num_buckets}, max_distance={self.max_distance}, "
            f"bidirectional={self.bidirectional}"
        )


# position.kind -> the bias module of one stack; kinds not listed add no bias to the scores.
POSITION_BIASES: dict[str, Callable[..., nn.Module]] = {
    "relative_bias": RelativePositionBias,
}


def build_position_bias(
    cfg: PositionConfig, n_heads: int, *, bidirectional: bool
) -> nn.Module | None:
    """The position bias of ``cfg.kind`` for one stack of ``n_heads``-head attention, or None
    where that kind adds none (learned, sinusoidal, RoPE positions)."""
    make = POSITION_BIASES.get(cfg.kind)
    return None if make is None else make(cfg, n_heads, bidirectional=bidirectional)
