"""RotaryEmbedding: applies RoPE to queries and keys at given absolute positions.

Angles are computed in float32 from the positions at each call, so they are exact under a
KV cache, with left padding and for models running in bf16."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnlab.config import PositionConfig
from attnlab.functional.rope import rope_angles, rope_inv_freq, scale_inv_freq


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        theta: float = 10000.0,
        layout: str = "split",
        scaling: dict | None = None,
    ):
        """``scaling``: keyword arguments of :func:`scale_inv_freq` (kind, factor, ...)."""
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
        self.layout, self.head_dim, self.theta = layout, head_dim, theta
        self.scaling = dict(scaling or {})
        self._memo: tuple | None = None
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    @classmethod
    def from_config(cls, head_dim: int, cfg: PositionConfig) -> RotaryEmbedding:
        scaling = None
        if cfg.rope_scaling is not None:
            scaling = dict(
                kind=cfg.rope_scaling,
                factor=cfg.rope_factor,
                low_freq_factor=cfg.rope_low_freq_factor,
                high_freq_factor=cfg.rope_high_freq_factor,
                original_max_seq_len=cfg.rope_original_max_seq_len,
            )
        return cls(head_dim, cfg.rope_theta, cfg.rope_layout, scaling)

    def _inv_freq(self, device=None) -> Tensor:
        inv_freq = rope_inv_freq(self.head_dim, self.theta, device=device)
        return scale_inv_freq(inv_freq, **self.scaling) if self.scaling else inv_freq

    def forward(self, q: Tensor, k: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """q (b, h, t, d_h), k (b, h_kv, t, d_h), positions (b, t) or (t,)."""
        cos, sin = self._angles(positions)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """The rotation of :func:`apply_rope` (its readable twin; tests compare the two)
        in fewer operations: x * cos + swap(x) * sin, with cos/sin already spread over the
        full head dim and sin signed, where swap exchanges the two members of every pair."""
        xf = x.float()
        if self.layout == "split":  # pairs (i, i + d/2): swap the halves
            swapped = xf.roll(self.head_dim // 2, dims=-1)
        else:  # pairs (2i, 2i + 1): swap neighbours
            swapped = xf.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
        return (xf * cos + swapped * sin).to(x.dtype)

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
                inv_freq = self._inv_freq(device=inv_freq.device)
            cos, sin = rope_angles(positions, inv_freq)  # (b, t, d_h/2)
            if cos.dim() == 3:
                cos, sin = cos[:, None], sin[:, None]  # (b, 1, t, d_h/2)
            if self.layout == "split":  # (b, 1, t, d_h): [cos, cos], [-sin, sin]
                cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)
            else:  # (b, 1, t, d_h): [c0, c0, c1, c1, ...], [-s0, s0, -s1, s1, ...]
                cos = cos.repeat_interleave(2, dim=-1)
                sin = torch.stack((-sin, sin), dim=-1).flatten(-2)
            memo = self._memo = (positions.clone(), self.inv_freq, cos, sin)
        return memo[2], memo[3]

    def extra_repr(self) -> str:
        return f"head_dim={2 * self.inv_freq.numel()}, layout={self.layout!r}"
