"""KV caches. Shapes: b batch, h_kv key/value heads, L capacity, d_h head dim.

A dense cache preallocates keys and values for every layer, (b, h_kv, L, d_h) each, and
writes new entries in place: decoding never copies the past. It also keeps which slots
hold real tokens (for left-padded batches) and the next absolute position of each row.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnlab.functional.masks import padding_mask


class LayerKV:
    """One layer's view of a :class:`KVCache`."""

    def __init__(self, cache: KVCache, k: Tensor, v: Tensor):
        self.cache, self.k, self.v = cache, k, v

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write new keys/values (b, h_kv, t, d_h) after the cached ones; return all of them."""
        start = self.cache.length
        end = start + k.shape[-2]
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]


class KVCache:
    def __init__(
        self,
        n_layers: int,
        batch: int,
        n_kv_heads: int,
        max_len: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        shape = (batch, n_kv_heads, max_len, head_dim)
        self.layers = [
            LayerKV(
                self,
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device),
            )
            for _ in range(n_layers)
        ]
        self.batch, self.max_len = batch, max_len
        self.length = 0  # slots filled, same for every row
        self.key_valid = torch.ones(batch, max_len, dtype=torch.bool, device=device)
        self.has_padding = False
        self.next_position = torch.zeros(batch, dtype=torch.long, device=device)

    def __getitem__(self, layer: int) -> LayerKV:
        return self.layers[layer]

    def __len__(self) -> int:
        return self.length

    def reserve(self, t: int) -> None:
        if self.length + t > self.max_len:
            raise ValueError(
                f"KV cache is full: {self.length} + {t} tokens > capacity {self.max_len}; "
                "create a larger cache with model.new_cache(batch, max_len)"
            )

    def positions_for(self, t: int, attention_mask: Tensor | None) -> Tensor:
        """Absolute positions (b, t) of the next t tokens: pads do not advance the count."""
        if attention_mask is None:
            steps = torch.arange(t, device=self.next_position.device)[None, :]
            return self.next_position[:, None] + steps
        counts = attention_mask.long().cumsum(dim=-1) - 1
        return self.next_position[:, None] + counts.clamp(min=0)

    def key_mask(self, t: int, attention_mask: Tensor | None) -> Tensor | None:
        """Record which of the next t slots are real; return the key padding mask
        (b, 1, 1, s) over all slots so far, or None when every slot is real."""
        if attention_mask is not None:
            valid = attention_mask.bool()
            self.key_valid[:, self.length : self.length + t] = valid
            self.has_padding = self.has_padding or not bool(valid.all())
        if not self.has_padding:
            return None
        return padding_mask(self.key_valid[:, : self.length + t])  # (b, 1, 1, s)

    def advance(self, t: int, positions: Tensor, attention_mask: Tensor | None) -> None:
        self.length += t
        last = positions[:, -1] + 1
        if attention_mask is not None:  # a row with no real token keeps its position
            last = torch.where(attention_mask.bool().any(dim=-1), last, self.next_position)
        self.next_position = last

    def reset(self) -> None:
        # Fresh tensors, not in-place fills: these may have been made under inference_mode
        # (by a forward pass) and this may run outside it (a stream being iterated).
        self.length = 0
        self.key_valid = torch.ones_like(self.key_valid)
        self.has_padding = False
        self.next_position = torch.zeros_like(self.next_position)

    @property
    def nbytes(self) -> int:
        """Bytes allocated for keys and values (all layers, full capacity)."""
        return sum(e.k.nbytes + e.v.nbytes for e in self.layers)

    @property
    def bytes_used(self) -> int:
        """Bytes of keys and values filled so far."""
        return self.nbytes * self.length // self.max_len

    def __repr__(self) -> str:
        return (
            f"KVCache(layers={len(self.layers)}, batch={self.batch}, length={self.length}/"
            f"{self.max_len}, nbytes={self.nbytes})"
        )
