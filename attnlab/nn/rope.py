"""RotaryEmbedding: applies RoPE to queries and keys at given absolute positions.

Angles are computed in float32 from the positions at each call, so they are exact under a
KV cache, with left padding and for models running in bf16."""

from __future__ import annotations

from torch import Tensor, nn

from attnlab.functional.rope import apply_rope, rope_angles, rope_inv_freq


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float = 10000.0, layout: str = "split"):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
        self.layout = layout
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta), persistent=False)

    def forward(self, q: Tensor, k: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """q (b, h, t, d_h), k (b, h_kv, t, d_h), positions (b, t) or (t,)."""
        cos, sin = rope_angles(positions, self.inv_freq)  # (b, t, d_h/2)
        if cos.dim() == 3:
            cos, sin = cos[:, None], sin[:, None]  # (b, 1, t, d_h/2)
        return apply_rope(q, cos, sin, self.layout), apply_rope(k, cos, sin, self.layout)

    def extra_repr(self) -> str:
        return f"head_dim={2 * self.inv_freq.numel()}, layout={self.layout!r}"
