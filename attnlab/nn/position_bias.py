"""Position biases: learned terms added to every layer's attention scores, built by the
model from ``position.kind`` (``POSITION_BIASES``) and handed to its self-attention layers
as ``bias`` (b or 1, h, t, s).

``relative_bias`` (T5): a (buckets, h) table looked up by the bucket of each key's position
relative to the query's (``functional/buckets.py``); one table per stack, shared by its
layers (transformers keeps it in the first layer's self-attention), or with
``position.relative_bias_per_layer`` one table per layer (UMT5), the model then handing the
stack a list of biases, one per layer. Positions are absolute token positions, so a cached
decoding step reads the bias of its query's true position against every cached key.

Shapes: b batch, t query length, s key length, h heads.
"""

from __future__ import annotations

from collections.abc import Callable

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


# position.kind -> the bias module of one stack; kinds not listed add no bias to the scores.
POSITION_BIASES: dict[str, Callable[..., nn.Module]] = {
    "relative_bias": RelativePositionBias,
}


def build_position_bias(
    cfg: PositionConfig, n_heads: int, *, bidirectional: bool, n_layers: int
) -> nn.Module | None:
    """The position bias of ``cfg.kind`` for one stack of ``n_layers`` layers of
    ``n_heads``-head attention, or None where that kind adds none (learned, sinusoidal, RoPE
    positions)."""
    make = POSITION_BIASES.get(cfg.kind)
    if make is None:
        return None
    return make(cfg, n_heads, bidirectional=bidirectional, n_layers=n_layers)
