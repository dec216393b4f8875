"""RotaryEmbedding: the RoPE frequency table of a model and the angles of a forward pass.

A model computes the angles once per forward pass (:meth:`RotaryEmbedding.tables`) and hands
them to every layer, which rotates its queries and keys with
:func:`attnlab.functional.rope.apply_rope`. Angles are computed in float32 (float64 in a float64
model) from the absolute positions, so they are exact under a KV cache, with left padding
and in bf16 models.

Shapes: b batch, h heads, t length, d_h head dim.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from attnlab.config import PositionConfig
from attnlab.functional.rope import (
    apply_partial_rope,
    longrope_attention_factor,
    longrope_inv_freq,
    rope_angles,
    rope_inv_freq,
    rope_tables,
    scale_inv_freq,
    yarn_attention_factors,
)
from attnlab.functional.softmax import compute_dtype


class RopeTables(NamedTuple):
    """Full-width cos and signed sin (b or 1, 1, t, d_r) for one forward pass: d_r the
    features RoPE rotates (d_h, or fewer: a partial rotation)."""

    cos: Tensor
    sin: Tensor
    layout: str

    def rotate(self, x: Tensor) -> Tensor:
        """x (..., t, d_h): its first d_r features rotated, the rest as they are."""
        return apply_partial_rope(x, self.cos, self.sin, self.layout)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoPE, Su et al. 2021): rotates pairs of query/key
    features by position-dependent angles. :meth:`tables` gives the cos/sin tables for given
    positions, computed once per forward pass and shared by the layers."""

    def __init__(
        self,
        head_dim: int,
        theta: float = 10000.0,
        layout: str = "split",
        scaling: dict | None = None,
    ):
        """``scaling``: keyword arguments of :func:`scale_inv_freq` (kind, factor, ...); for
        ``yarn`` also ``mscale``, ``mscale_all_dim`` and ``attention_factor`` (see
        :func:`yarn_attention_factors`); for ``longrope``: ``short_factor``,
        ``long_factor``, ``original_max_seq_len``, ``factor`` and ``attention_factor``.
        ``head_dim``: the features rotated (d_r: the frequencies are theta^(-2i/d_r))."""
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
        if layout not in ("split", "interleaved"):
            raise ValueError(f"unknown RoPE layout {layout!r}; use 'split' or 'interleaved'")
        self.layout, self.head_dim, self.theta = layout, head_dim, theta
        self.scaling = dict(scaling or {})
        temperature = tuple(
            self.scaling.pop(k, None) for k in ("mscale", "mscale_all_dim", "attention_factor")
        )
        # YaRN's temperature: cos/sin are multiplied by attention_factor; softmax_factor is
        # for attention kinds that fold it into their softmax scale (DeepSeek's MLA).
        self.attention_factor, self.softmax_factor = 1.0, 1.0
        # LongRoPE: a forward pass whose positions all lie below switch_length rotates by
        # the short factors' table (inv_freq), else every position by the long one's
        self.switch_length: int | None = None
        if self.scaling.get("kind") == "longrope":
            self.switch_length = self.scaling["original_max_seq_len"]
            self.attention_factor = longrope_attention_factor(
                self.scaling.get("factor", 1.0), self.switch_length, temperature[2]
            )
        elif self.scaling.get("kind") == "yarn":
            self.scaling["theta"] = theta
            factor = self.scaling.get("factor", 1.0)
            self.attention_factor, self.softmax_factor = yarn_attention_factors(
                factor, *temperature
            )
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)
        if self.switch_length is not None:
            self.register_buffer("long_inv_freq", self._inv_freq(long=True), persistent=False)

    @classmethod
    def from_config(cls, head_dim: int, cfg: PositionConfig) -> RotaryEmbedding:
        """The RoPE of a :class:`PositionConfig` (theta, layout and scaling) for heads of
        width ``head_dim``."""
        scaling = None
        if cfg.rope_scaling in ("linear", "llama3"):
            scaling = dict(
                kind=cfg.rope_scaling,
                factor=cfg.rope_factor,
                low_freq_factor=cfg.rope_low_freq_factor,
                high_freq_factor=cfg.rope_high_freq_factor,
                original_max_seq_len=cfg.rope_original_max_seq_len,
            )
        elif cfg.rope_scaling == "yarn":
            scaling = dict(
                kind="yarn",
                factor=cfg.rope_factor,
                original_max_seq_len=cfg.rope_original_max_seq_len,
                beta_fast=cfg.rope_beta_fast,
                beta_slow=cfg.rope_beta_slow,
                truncate=cfg.rope_truncate,
                mscale=cfg.rope_mscale,
                mscale_all_dim=cfg.rope_mscale_all_dim,
                attention_factor=cfg.rope_attention_factor,
            )
        elif cfg.rope_scaling == "longrope":
            scaling = dict(
                kind="longrope",
                short_factor=list(cfg.rope_short_factor or ()),
                long_factor=list(cfg.rope_long_factor or ()),
                original_max_seq_len=cfg.rope_original_max_seq_len,
                factor=cfg.rope_factor,
                attention_factor=cfg.rope_attention_factor,
            )
        return cls(head_dim, cfg.rope_theta, cfg.rope_layout, scaling)

    def _inv_freq(self, device=None, dtype: torch.dtype = torch.float32, long=False) -> Tensor:
        """The frequency table (LongRoPE: the short factors', or the long ones')."""
        if self.switch_length is not None:
            factors = self.scaling["long_factor" if long else "short_factor"]
            return longrope_inv_freq(self.head_dim, self.theta, factors, device, dtype)
        inv_freq = rope_inv_freq(self.head_dim, self.theta, device=device, dtype=dtype)
        return scale_inv_freq(inv_freq, **self.scaling) if self.scaling else inv_freq

    def reset_buffers(self) -> None:
        """Recompute the frequency table (after building on the meta device)."""
        self._recompute()

    def _recompute(self) -> None:
        """The buffer as the constructor computes it (on the CPU, in float32 or float64),
        then cast to the buffer's dtype and device."""
        for name in self._tables():
            buf = getattr(self, name)
            exact = self._inv_freq(dtype=compute_dtype(buf.dtype), long=name == "long_inv_freq")
            setattr(self, name, exact.to(device=buf.device, dtype=buf.dtype))

    def _tables(self) -> tuple[str, ...]:
        return ("inv_freq",) if self.switch_length is None else ("inv_freq", "long_inv_freq")

    def _apply(self, fn, recurse: bool = True):
        # model.to(dtype), .half(), .double(), .to(device): the frequencies are a function of
        # the config, recomputed exactly and then cast. Converting the buffer itself kept
        # its rounding: after model.to(bfloat16).float() a float32 table rounded to bf16
        # (0.4% off: RoPE angles off by up to 0.004 x the position) that tables() could
        # not tell from an exact one. Computed on the CPU, as at construction, and moved:
        # another device's pow may round differently in the last bit.
        super()._apply(fn, recurse)
        if self.inv_freq.device.type != "meta" and self.inv_freq.is_floating_point():
            self._recompute()
        return self

    def tables(self, positions: Tensor) -> RopeTables:
        """positions (b, t) or (t,) -> cos/sin tables (b or 1, 1, t, d_h), float32; float64
        in a float64 model (``model.double()``: the buffer ``inv_freq`` is float64)."""
        if positions.dim() == 1:  # (t,): one row shared by the batch, (1, 1, t, d_h) tables
            positions = positions[None]
        inv_freq = self._exact(self.inv_freq)
        if self.switch_length is not None:
            # LongRoPE, as transformers: the long factors for every position of a pass whose
            # longest row runs past switch_length (its largest position + 1 > it). A 0-d
            # device tensor picks the table: no host read, one graph for a compiled step.
            long = positions.max() >= self.switch_length
            inv_freq = torch.where(long, self._exact(self.long_inv_freq, long=True), inv_freq)
        cos, sin = rope_angles(positions, inv_freq)  # (b, t, d_h/2) or (t, d_h/2)
        cos, sin = cos.unsqueeze(-3), sin.unsqueeze(-3)  # a heads axis: (b, 1, t, d_h/2)
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return RopeTables(*rope_tables(cos, sin, self.layout), self.layout)

    def _exact(self, buf: Tensor, long: bool = False) -> Tensor:
        """``buf``, or where it is half precision (model.to(bf16): rounded values) the exact
        float32 table on its device (float64 buffers are exact: see _apply)."""
        if buf.dtype in (torch.float32, torch.float64):
            return buf
        return self._inv_freq(device=buf.device, long=long)

    def forward(
        self, q: Tensor, k: Tensor, positions: Tensor | RopeTables
    ) -> tuple[Tensor, Tensor]:
        """Rotate q (b, h, t, d_h) and k (b, h_kv, t, d_h) at ``positions`` (b, t) or (t,),
        or with tables already computed for them."""
        tables = positions if isinstance(positions, RopeTables) else self.tables(positions)
        return tables.rotate(q), tables.rotate(k)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, layout={self.layout!r}"
