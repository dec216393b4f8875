"""RotaryEmbedding: applies RoPE to queries and keys at given absolute positions.

Angles are computed in float32 from the positions at each call, so they are exact under a
KV cache, with left padding and for models running in bf16."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnlab.functional.rope import apply_rope, rope_angles, rope_inv_freq


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float = 10000.0, layout: str = "split"):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
        self.layout, self.head_dim, self.theta = layout, head_dim, theta
        self._memo: tuple | None = None
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta), persistent=False)

    def forward(self, q: Tensor, k: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """q (b, h, t, d_h), k (b, h_kv, t, d_h), positions (b, t) or (t,)."""
        cos, sin = self._angles(positions)
        return apply_rope(q, cos, sin, self.layout), apply_rope(k, cos, sin, self.layout)

    def _angles(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        # Every layer of a forward pass gets the same positions: compute the angles once.
        memo = self._memo
        if (
            memo is None
            or memo[1] is not self.inv_freq  # module moved to another device
            or memo[0].shape != positions.shape
            or not torch.equal(memo[0], positions)
            # angles made under inference_mode cannot be saved for a later backward pass
            or (memo[2].is_inference() and not torch.is_inference_mode_enabled())
        ):
            inv_freq = self.inv_freq
            if inv_freq.dtype != torch.float32:  # model.to(bf16) rounded it: rebuild exactly
                inv_freq = rope_inv_freq(self.head_dim, self.theta, device=inv_freq.device)
            cos, sin = rope_angles(positions, inv_freq)  # (b, t, d_h/2)
            if cos.dim() == 3:
                cos, sin = cos[:, None], sin[:, None]  # (b, 1, t, d_h/2)
            memo = self._memo = (positions.clone(), self.inv_freq, cos, sin)
        return memo[2], memo[3]

    def extra_repr(self) -> str:
        return f"head_dim={2 * self.inv_freq.numel()}, layout={self.layout!r}"
