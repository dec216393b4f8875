"""Linear layer tuned for single-token decoding on CPU.

Decoding multiplies one token's vector by every weight matrix: a memory-bound vector-matrix
product whose speed is the memory bandwidth it reaches. Two changes from ``nn.Linear``, both
invisible to state dicts and checkpoints (the weight keeps its logical shape (out, in)):

1. The weight is stored input-major (the memory of W^T, strides (1, out)): MKL streams it
   faster than the row-major layout for one vector.
2. A single vector is multiplied as two half-products in one batched matmul: torch runs
   the two on two threads, where MKL runs a lone vector-matrix product on one. In float32
   the halves split the input dimension, y = x[:in/2] W^T[:in/2] + x[in/2:] W^T[in/2:]
   (contiguous halves of W^T: the fastest; the float32 sum of two partial sums loses
   nothing measurable). In bfloat16/float16 that sum would round each partial sum before
   adding them, twice the error of ``F.linear``; there the halves split the output
   dimension instead, y = [x W^T[:, :out/2], x W^T[:, out/2:]], so every output is one
   product rounded once, bit-identical to ``F.linear``.

Under ``torch.compile`` without gradients (the compiled decode step) the split product is
the operator ``torch.ops.attnlab.split_vecmat``, which inductor calls as it is: traced
through, its two half-products were fused into inductor's own loops, slower than one
``F.linear``.

The layout survives ``load_state_dict`` (also with ``assign=True``) and the meta-device
loaders (they allocate each weight with the strides the module was built with).

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


def is_input_major(weight: Tensor) -> bool:
    return weight.dim() == 2 and weight.stride() == (1, weight.shape[0])


def split_vecmat(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x (..., in) holding one vector, weight (out, in) input-major -> (..., out). Needs an
    even ``in`` for float32, an even ``out`` otherwise (see :func:`can_split`)."""
    n_out, n_in = weight.shape
    if weight.dtype == torch.float32:  # halves of the input dimension, partial sums added
        half = n_in // 2
        # (2, in/2, out): the two halves of W^T, whose memory is W's (one view op, not two)
        w_t = weight.as_strided((2, half, n_out), (half * n_out, n_out, 1))
        y = torch.bmm(x.reshape(2, 1, half), w_t).sum(dim=0)  # (1, out)
        if bias is not None:
            y = y + bias
        return y.view(*x.shape[:-1], n_out)
    half = n_out // 2  # halves of the output dimension: each output rounded once
    w_t = weight.t().view(n_in, 2, half).transpose(0, 1)  # (2, in, out/2): column halves
    x2 = x.reshape(1, 1, n_in).expand(2, 1, n_in)
    if bias is None:
        y = torch.bmm(x2, w_t)  # (2, 1, out/2)
    else:  # the bias inside the product, rounded once with it (as F.linear does)
        y = torch.baddbmm(bias.view(2, 1, half), x2, w_t)
    return y.reshape(*x.shape[:-1], n_out)  # [first half, second half]


# split_vecmat as one opaque operator for torch.compile: inductor calls it as it is. Traced
# through, inductor fused the two half-products into its own loops; with plain F.linear
# products the compiled step of a 30M model ran at 1.01x the eager one, with the operator
# at 1.20x (benchmarks/compile_decode.py --model 30m). An operator for the batched product
# alone (the views and the sum left to inductor) measured slower: 0.93x the eager step.
# Registered with torch.library.Library rather than @custom_op: its per-call overhead is
# about a quarter (~9 us against ~35 us), which counts ~30 times a token.
def _split_vecmat_fake(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


if not hasattr(torch.ops.attnlab, "split_vecmat"):  # once per process (also on a reload)
    _LIB = torch.library.Library("attnlab", "FRAGMENT")
    _LIB.define("split_vecmat(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor")
    _LIB.impl("split_vecmat", split_vecmat, "CPU")
    torch.library.register_fake("attnlab::split_vecmat", _split_vecmat_fake, lib=_LIB)


def can_split(weight: Tensor) -> bool:
    n_out, n_in = weight.shape
    return (n_in if weight.dtype == torch.float32 else n_out) % 2 == 0


class Linear(nn.Linear):
    """``nn.Linear`` with an input-major weight and a two-thread product for one vector."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, **kw):
        super().__init__(in_features, out_features, bias=bias, **kw)
        self.weight = nn.Parameter(input_major(self.weight))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        # load_state_dict(assign=True) replaces the weight with the given (row-major) tensor;
        # restore the layout the weight had (a weight tied to an embedding is left alone).
        was_input_major = is_input_major(self.weight)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        w = self.weight
        if was_input_major and not is_input_major(w) and w.device.type != "meta":
            self.weight = nn.Parameter(input_major(w), requires_grad=w.requires_grad)

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight
        if (
            x.numel() == self.in_features  # one vector: decoding a single token
            and w.numel() >= SPLIT_MIN_NUMEL
            and x.device.type == "cpu"
            and is_input_major(w)  # (not e.g. a tied embedding)
            and can_split(w)
        ):
            if not torch.compiler.is_compiling():
                return split_vecmat(x, w, self.bias)
            if not torch.is_grad_enabled():  # compiled decoding: one opaque call
                return torch.ops.attnlab.split_vecmat(x, w, self.bias)
        return F.linear(x, w, self.bias)
