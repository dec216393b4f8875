"""Linear layer tuned for single-token decoding on CPU, with oneDNN's float32 products for
several tokens.

Decoding multiplies one token's vector by every weight matrix: a memory-bound vector-matrix
product whose speed is the memory bandwidth it reaches. Two changes from ``nn.Linear``; the
weight keeps its logical shape (out, in), so state dict keys, shapes and values and
checkpoints are ``nn.Linear``'s, though a state dict's input-major entries are
non-contiguous views (``safetensors.torch.save_file`` refuses those: save
``{k: v.contiguous() ...}``, or with ``safetensors.torch.save_model``, as attnlab's
checkpoints are):

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

Under ``torch.compile`` without gradients (the compiled decode step) the split product of
an input-major weight is the operator ``torch.ops.attnlab.split_vecmat``, which inductor
calls as it is: traced through, its two half-products were fused into inductor's own loops,
slower than one ``F.linear``.

The layout survives ``load_state_dict`` (also with ``assign=True``) and the meta-device
loaders (they allocate each weight with the strides the module was built with).

The compiled decode step reads the other layout: there a one-vector product of a row-major
weight is written as a sum over each row, ``(W * x).sum(-1)`` (:func:`rows_matmul`), which
inductor turns into its own vectorised loops that stream the weight in order on every
thread: about 40 GB/s where MKL's vector products reach 20-30 on a 2-core CPU. So
``generate(compile=True)`` re-stores a model's weights row-major once (:func:`set_layout`,
in place, same values) before compiling; eager one-vector products of row-major weights
split the output rows between two threads instead. A compiled decode step of a small batch
(up to ``ROWS_MATMUL_MAX`` rows) multiplies its few vectors the same way.

Other products of several vectors (a batch, a prompt, training) in float32 on CPU are
oneDNN's (:func:`onednn_linear`), eager and compiled, forward and backward: see the note
below.

``python benchmarks/linear_layout.py`` and ``benchmarks/compile_decode.py`` measure them;
tests compare with ``F.linear``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.flop_counter import register_flop_formula

from attnlab.functional.softmax import compute_dtype

# Below about 130 thousand weights (512 KB in float32) a second thread's start-up costs more
# than it saves (measured with benchmarks/linear_layout.py on a 2-core CPU).
SPLIT_MIN_NUMEL = 1 << 17


def input_major(weight: Tensor) -> Tensor:
    """The same (out, in) values, stored in (in, out) order: strides (1, out)."""
    return weight.detach().t().contiguous().t()


def is_input_major(weight: Tensor) -> bool:
    return weight.dim() == 2 and weight.stride() == (1, weight.shape[0])


def split_vecmat(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x (..., in) holding one vector, weight (out, in) -> (..., out), as two half-products
    in one batched matmul (two threads). Needs an even ``in`` for an input-major float32
    weight, an even ``out`` otherwise (see :func:`can_split`)."""
    n_out, n_in = weight.shape
    if weight.dtype == torch.float32 and is_input_major(weight):  # halves of the input
        half = n_in // 2
        # (2, in/2, out): the two halves of W^T, whose memory is W's (one view op, not two)
        w_t = weight.as_strided((2, half, n_out), (half * n_out, n_out, 1))
        y = torch.bmm(x.reshape(2, 1, half), w_t).sum(dim=0)  # (1, out)
        if bias is not None:
            y = y + bias
        return y.view(*x.shape[:-1], n_out)
    half = n_out // 2  # halves of the output dimension: each output rounded once
    if is_input_major(weight):
        w_t = weight.t().view(n_in, 2, half).transpose(0, 1)  # (2, in, out/2): column halves
    else:  # row-major: the two halves of the rows, each read in order
        w_t = weight.view(2, half, n_in).transpose(1, 2)  # (2, in, out/2)
    x2 = x.reshape(1, 1, n_in).expand(2, 1, n_in)
    if bias is None:
        y = torch.bmm(x2, w_t)  # (2, 1, out/2)
    else:  # the bias inside the product, rounded once with it (as F.linear does)
        y = torch.baddbmm(bias.view(2, 1, half), x2, w_t)
    return y.reshape(*x.shape[:-1], n_out)  # [first half, second half]


# The most vectors a compiled product without gradients multiplies with rows_matmul (more go
# to oneDNN). `benchmarks/throughput.py --batches 2 4 8 16 --rows-matmul-max 4` and `... 1`
# (oneDNN from two vectors on), compiled decoding of the 30M model: 569 against 400 tok/s at
# batch 2, 947 against 643 at batch 4; at batch 8 rows_matmul only equalled oneDNN, at 16 it
# lost.
ROWS_MATMUL_MAX = 4


def rows_matmul(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x (..., in) holding n vectors (one, or a few: a small batch's decode step), weight
    (out, in) -> (..., out): each row of W times every vector, summed,
    ``(W[:, None, :] * x).sum(-1)``, in ``compute_dtype``: float32 (one rounding per output in
    lower precision, as F.linear), float64 kept. Written for inductor: the rows of W are the
    outer loop, split between the threads, so a row-major weight is streamed in order once
    and each row is reused from cache for the n vectors. Run eagerly it would materialise
    ``W * x``."""
    n_out, n_in = weight.shape
    # float64 kept: a float64 model's compiled decode step was rounded to float32 here
    dtype = compute_dtype(torch.promote_types(x.dtype, weight.dtype))
    xs = x.reshape(1, -1, n_in).to(dtype)  # (1, n, in)
    if xs.shape[1] > 1 and torch.compiler.is_compiling():
        # Inductor would compute x's producer (a norm, SwiGLU's SiLU) inside the product's
        # loop, again for every weight: free for one vector, which waits on memory, but it
        # made 8 vectors 10x slower. The opaque copy makes x a buffer computed once.
        xs = torch.ops.attnlab.realize(xs)
    y = (weight.to(dtype)[:, None, :] * xs).sum(-1)  # (out, n)
    if bias is not None:
        y = y + bias.to(dtype)[:, None]
    # (n, out) stored row by row: attention's q, k, v views need a unit last stride for
    # SDPA's fused kernel (the transposed view traced SDPA's slower unfused maths)
    return y.t().contiguous().to(x.dtype).reshape(*x.shape[:-1], n_out)


# split_vecmat as one opaque operator for torch.compile: inductor calls it as it is. Traced
# through, inductor fused the two half-products into its own loops; with plain F.linear
# products the compiled step of a 30M model ran at 1.01x the eager one, with the operator
# at 1.20x (benchmarks/compile_decode.py --model 30m). An operator for the batched product
# alone (the views and the sum left to inductor) measured slower: 0.93x the eager step.
# (Row-major weights with rows_matmul, the compiled step's default since, gave 1.58-1.72x.)
# Registered with torch.library.Library rather than @custom_op: its per-call overhead is
# about a quarter (~9 us against ~35 us), which counts ~30 times a token.
def _split_vecmat_fake(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


if not hasattr(torch.ops.attnlab, "split_vecmat"):  # once per process (also on a reload)
    _LIB = torch.library.Library("attnlab", "FRAGMENT")
    _LIB.define("split_vecmat(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor")
    _LIB.impl("split_vecmat", split_vecmat, "CPU")
    torch.library.register_fake("attnlab::split_vecmat", _split_vecmat_fake, lib=_LIB)
    # a contiguous copy that inductor cannot see into (see rows_matmul)
    _LIB.define("realize(Tensor x) -> Tensor")
    _LIB.impl("realize", lambda x: x.clone(memory_format=torch.contiguous_format), "CPU")
    torch.library.register_fake("attnlab::realize", lambda x: x.new_empty(x.shape), lib=_LIB)


# ----------------------------------------------------------------------------- oneDNN
#
# Products of several vectors (training, prefill, batched decoding; compiled, from
# ROWS_MATMUL_MAX + 1 rows) in float32 on CPU go to oneDNN, the library torch ships for its
# CPU kernels, instead of F.linear's MKL sgemm: on an AMD CPU with AVX-512 MKL runs a slower
# code path, and oneDNN's float32 products (IEEE float32, no reduced-precision maths) ran
# 1.6x faster there for 8 vectors and 2.2-2.3x for 512 (benchmarks/linear_layout.py
# --rows N); the demo's training step 1.2x eagerly and 1.46x compiled (train_levers.py).
# ``ONEDNN = False`` turns it off (F.linear everywhere).
ONEDNN = torch.backends.mkldnn.is_available()


def onednn_mm(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x (..., in) @ weight (out, in)^T + bias, by oneDNN (any strides: non-contiguous
    operands are copied first)."""
    return torch.ops.mkldnn._linear_pointwise(_readable(x), _readable(weight), bias, "none", [], "")


def _readable(t: Tensor) -> Tensor:
    """``t``, or a copy where oneDNN would read it slowly. A column-major matrix whose
    columns lie further apart than its height (the transpose of a slice of a wider
    matrix: MLA's weight gradient dW = dy^T x, where x is c_KV, a slice of kv_a_proj's
    output) takes oneDNN's slow path: 360 ms for a 256 x 1024 x 128 product that takes
    0.3 ms from the plain transpose this copies it to (row-major rows, then transposed)."""
    if t.dim() == 2 and t.stride(0) == 1 and t.stride(1) > t.shape[0] and t.shape[1] > 1:
        return t.t().contiguous().t()
    return t


def _onednn_mm_fake(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


# torch's own registration of the oneDNN product serves inductor's frozen (constant) weights
# only; as attnlab's operator inductor calls it as it is, weights and all.
if not hasattr(torch.ops.attnlab, "onednn_mm"):
    _ONEDNN_LIB = torch.library.Library("attnlab", "FRAGMENT")
    _ONEDNN_LIB.define("onednn_mm(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor")
    _ONEDNN_LIB.impl("onednn_mm", onednn_mm, "CPU")
    torch.library.register_fake("attnlab::onednn_mm", _onednn_mm_fake, lib=_ONEDNN_LIB)

    @register_flop_formula(torch.ops.attnlab.onednn_mm)
    def _onednn_mm_flops(x_shape, w_shape, *args, out_shape=None, **kwargs) -> int:
        """torch.utils.flop_counter counts it as the matrix product it is."""
        return 2 * math.prod(x_shape[:-1]) * x_shape[-1] * w_shape[0]


class _OneDNNLinear(torch.autograd.Function):
    """y = x W^T + b with oneDNN products forward and backward: dx = dy W, dW = dy^T x
    (transposed views), db = the sum of dy over its rows."""

    @staticmethod
    def forward(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        return torch.ops.attnlab.onednn_mm(x, weight, bias)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        x, weight, bias = inputs
        # Only what the requested gradients need (as F.linear): dW reads x, dx reads W (a
        # frozen weight's layer kept its input alive until the backward).
        needs_x, needs_w = ctx.needs_input_grad[:2]
        ctx.save_for_backward(x if needs_w else None, weight if needs_x else None)
        ctx.has_bias = bias is not None

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, weight = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])  # (rows, out)
        dx = dw = db = None
        mm = torch.ops.attnlab.onednn_mm
        if torch.is_grad_enabled():
            # create_graph (a gradient penalty, a Hessian-vector product): oneDNN's product
            # has no derivative, so the second derivative silently lost its terms; F.linear's
            mm = F.linear
        if ctx.needs_input_grad[0]:
            dx = mm(dy, weight.t())  # (..., in)
        if ctx.needs_input_grad[1]:
            dy_t, x_t = dy2.t(), x.reshape(-1, x.shape[-1]).t()  # (out, rows), (in, rows)
            if torch.compiler.is_compiling():
                # oneDNN copies transposed operands to contiguous ones first; compiled, the
                # copies are inductor's tiled loops instead, fused with what computes dy,
                # which made the compiled demo step 6-12% faster. Eagerly oneDNN's own
                # copy is the faster one (torch's made the eager step about 20% slower).
                dy_t, x_t = dy_t.contiguous(), x_t.contiguous()
            dw = mm(dy_t, x_t)  # (out, in)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0)
        return dx, dw, db


def onednn_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear by oneDNN (float32 CPU tensors), differentiable."""
    needs_grad = (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    if torch.is_grad_enabled() and needs_grad:
        return _OneDNNLinear.apply(x, weight, bias)
    return torch.ops.attnlab.onednn_mm(x, weight, bias)


def can_split(weight: Tensor) -> bool:
    n_out, n_in = weight.shape
    if weight.dtype == torch.float32 and is_input_major(weight):
        return n_in % 2 == 0
    return n_out % 2 == 0 and (is_input_major(weight) or weight.is_contiguous())


_layout_version = 0  # counts the calls of set_layout that re-stored a weight


def layout_version() -> int:
    """How many times :func:`set_layout` has re-stored weights in this process: the
    optimizers of ``attnlab.training.optim.build_optimizer`` match gradients and moments
    to their parameters' layouts only when it has changed since their last step."""
    return _layout_version


def set_layout(model: nn.Module, layout: str) -> int:
    """Store the weight of every attnlab :class:`Linear` in ``model`` ``"rows"`` (row-major,
    the compiled decode step's layout) or ``"input"`` (input-major, the eager one). In
    place: the same Parameter objects and values (state dicts and ties are unaffected).
    Gradients and optimizer moments keep their old layout: fused AdamW, which reads them
    in the parameter's memory order, needs them re-stored too (the optimizers of
    ``attnlab.training.optim.build_optimizer`` do so before their next step, ``match_layouts``).
    Returns how many weights were re-stored."""
    if layout not in ("rows", "input"):
        raise ValueError(f"unknown weight layout {layout!r}; choose 'rows' or 'input'")
    # a weight tied to another kind of module (an embedding) keeps that module's layout
    tied = {
        id(p) for m in model.modules() if not isinstance(m, Linear) for p in m.parameters(False)
    }
    changed = 0
    with torch.inference_mode(False), torch.no_grad():  # normal tensors, trainable later
        for m in model.modules():
            w = m.weight if isinstance(m, Linear) else None
            if w is None or id(w) in tied or w.device.type == "meta" or min(w.shape) < 2:
                continue
            if layout == "rows" and not w.is_contiguous():
                w.data = w.data.contiguous()
            elif layout == "input" and not is_input_major(w):
                w.data = input_major(w.data)
            else:
                continue
            changed += 1
    if changed:
        global _layout_version
        _layout_version += 1
    return changed


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
        if x.device.type == "cpu" and x.shape[-1] == self.in_features:
            rows = x.numel() // self.in_features  # vectors to multiply
            # the two-thread product pays from SPLIT_MIN_NUMEL weights; can_split rules out
            # layouts it cannot halve (e.g. a weight tied to a transposed tensor)
            split = rows == 1 and w.numel() >= SPLIT_MIN_NUMEL and can_split(w)
            if not torch.compiler.is_compiling():
                if split:  # one token's vector
                    return split_vecmat(x, w, self.bias)
            elif not torch.is_grad_enabled():  # the compiled decode step
                if is_input_major(w) and split:  # one opaque call
                    return torch.ops.attnlab.split_vecmat(x, w, self.bias)
                # Inductor's own loops over the rows, whatever the size (a small weight as
                # an MKL call, F.linear, slowed a 5M model's step down by about a tenth)
                if w.is_contiguous() and rows <= ROWS_MATMUL_MAX:
                    return rows_matmul(x, w, self.bias)
            if ONEDNN and rows > 1 and x.dtype == w.dtype == torch.float32:
                if not torch.is_autocast_enabled("cpu"):  # (autocast: F.linear's bf16)
                    return onednn_linear(x, w, self.bias)
        return F.linear(x, w, self.bias)
