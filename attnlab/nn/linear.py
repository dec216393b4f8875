"""Linear layer tuned for single-token decoding on CPU.

Decoding multiplies one token's vector by every weight matrix: a memory-bound vector-matrix
product whose speed is the memory bandwidth it reaches. Two changes from ``nn.Linear``, both
invisible to state dicts and checkpoints (the weight keeps its logical shape (out, in)):

1. The weight is stored input-major (the memory of W^T, strides (1, out)): MKL streams it
   faster than the row-major layout for one vector.
2. A single vector is multiplied as two half-products over the halves of the input
   dimension, y = x[:in/2] W^T[:in/2] + x[in/2:] W^T[in/2:], one batched matmul (both halves
   of W^T are contiguous views): torch runs the two on two threads, where MKL runs a lone
   vector-matrix product on one.

``python benchmarks/linear_layout.py`` measures both; tests compare with ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# Below about 130 thousand weights (512 KB in float32) a second thread's start-up costs more
# than it saves (measured with benchmarks/linear_layout.py on a 2-core CPU).
SPLIT_MIN_NUMEL = 1 << 17


def input_major(weight: Tensor) -> Tensor:
    """The same (out, in) values, stored in (in, out) order: strides (1, out)."""
    return weight.detach().t().contiguous().t()


def split_vecmat(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x (..., in) holding one vector, weight (out, in) input-major -> (..., out)."""
    n_out, n_in = weight.shape
    half = n_in // 2
    w_t = weight.t().view(2, half, n_out)  # (2, in/2, out): the two halves of W^T
    y = torch.bmm(x.reshape(2, 1, half), w_t).sum(dim=0)  # (1, out)
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], n_out)


class Linear(nn.Linear):
    """``nn.Linear`` with an input-major weight and a two-thread product for one vector."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, **kw):
        super().__init__(in_features, out_features, bias=bias, **kw)
        self.weight = nn.Parameter(input_major(self.weight))

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight
        if (
            x.numel() == self.in_features  # one vector: decoding a single token
            and w.numel() >= SPLIT_MIN_NUMEL
            and x.device.type == "cpu"
            and self.in_features % 2 == 0
            and w.stride() == (1, self.out_features)  # input-major (not e.g. a tied embedding)
        ):
            return split_vecmat(x, w, self.bias)
        return F.linear(x, w, self.bias)
