"""Flash attention as Triton kernels: the maths of ``functional/flash.py`` on one GPU tile
per program (Dao et al. 2022; Dao 2023, FlashAttention-2).

forward   grid (query blocks, h, b): running max m, denominator l, output acc over the
          key blocks the query block can see (causal: up to the diagonal; window: from
          its lower edge); stores O and the log-sum-exp L (+inf for empty rows). Sink
          logits (one per head) start each row: m = sink, l = 1.
backward  D = rowsum(dO * O) in torch, then two kernels without atomics:
          dK/dV grid (key blocks, h_kv, b): each program loops over the g query heads of
          its kv head (GQA) and the query blocks that can see it; dQ grid (query blocks,
          h, b), like the forward. P = exp(S - L) is recomputed, never stored. L includes
          the sink, so the kernels need nothing else; its gradient, -sum exp(sink - L) D
          over the rows, is one torch expression.
soft cap  (Gemma 2, HAS_SOFTCAP, runtime ``softcap`` c): the scaled scores S' of each tile
          become c tanh(S' / c) before the mask (``_tanh``: Triton has none that the
          interpreter and CUDA both run), so m, l and L are those of the capped scores; the
          backward recomputes them so and multiplies dS by 1 - tanh^2(S' / c) before dQ, dK.

Masks: causal (bottom-right: query i at position s - t + i), sliding window, document
ids (b, s), and any bool/additive mask broadcastable to (b, h, t, s), read through its
broadcast strides (a (b, 1, 1, s) padding mask costs b * s floats, not b * h * t * s).
Statistics and accumulators are float32; float32 inputs use IEEE products (no TF32) so
the kernel matches the reference to float32 rounding.

Shapes: b batch, h heads, h_kv kv heads, g = h / h_kv, t queries, s keys, d_h head dim.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.autograd.function import once_differentiable

from attnlab.functional.flash import check_arguments
from attnlab.functional.masks import additive_in
from attnlab.kernels import interpreting


@triton.jit
def _tanh(x):
    """tanh of a float32 tile from ``tl.exp`` and a Taylor series: Triton has no tanh that
    both the interpreter and the CUDA compiler run (libdevice's is CUDA only). Within a
    float32 ulp (~1e-7 relative) of tanh (tested), exactly 0 at 0, +-1 from |x| = 10 with
    no inf or NaN on the way, NaN for NaN.
    |x| >= 1: 1 - 2e / (1 + e), e = exp(-2|x|) in (0, 0.14]: exp never overflows, and the
    difference never cancels. |x| < 1, where it would: x + x^3 P(x^2), the series (its
    coefficients 2^2n (2^2n - 1) B_2n / (2n)!, B Bernoulli's numbers; radius pi / 2) to
    x^37, whose remainder is below float32's rounding there."""
    a = tl.abs(x)
    e = tl.exp(-2.0 * tl.minimum(a, 20.0))  # tanh(20) is 1 in float32 (from 9.01)
    big = 1.0 - 2.0 * e / (1.0 + e)
    z = tl.minimum(a, 1.0)  # the series' |x| < 1 (the clamp: no overflow in lanes unused)
    y = z * z
    p = 7.054636946400968e-08  # x^37
    p = p * y - 1.7406618963571648e-07  # x^35
    p = p * y + 4.294911078273806e-07  # x^33
    p = p * y - 1.0597268320104654e-06  # x^31
    p = p * y + 2.6147711512907546e-06  # x^29
    p = p * y - 6.451689215655431e-06  # x^27
    p = p * y + 1.5918905069328964e-05  # x^25
    p = p * y - 3.927832388331683e-05  # x^23
    p = p * y + 9.691537956929451e-05  # x^21
    p = p * y - 0.00023912911424355248  # x^19
    p = p * y + 0.000590027440945586  # x^17
    p = p * y - 0.0014558343870513183  # x^15
    p = p * y + 0.003592128036572481  # x^13
    p = p * y - 0.008863235529902197  # x^11
    p = p * y + 0.021869488536155203  # x^9
    p = p * y - 0.05396825396825397  # x^7
    p = p * y + 0.13333333333333333  # x^5
    p = p * y - 0.3333333333333333  # x^3
    small = z + z * (y * p)
    t = tl.where(a < 1.0, small, big)
    t = tl.where(x < 0, -t, t)
    return tl.where(x == x, t, x)  # NaN stays NaN (minimum may drop it)


@triton.jit
def _tile_scores(
    q,
    k,
    rows,
    cols,
    b,
    h,
    BIAS,
    DOC,
    s_bias_b,
    s_bias_h,
    s_bias_t,
    s_bias_s,
    s_doc_b,
    T,
    S,
    OFF,
    WINDOW,
    scale,
    softcap,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_DOC: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Scores of one (rows x cols) tile, float32, -inf where masked; and, with a soft cap,
    tanh(S' / c) of the scaled scores S' before the mask (the backward's slope 1 - tanh^2;
    without a cap the second value is unused)."""
    sc = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    th = sc
    if HAS_SOFTCAP:  # c tanh(S' / c) in transformers' order, in natural units (tl.exp)
        th = _tanh(sc / softcap)
        sc = th * softcap
    q_pos = rows + OFF
    ok = (rows < T)[:, None] & (cols < S)[None, :]
    if CAUSAL:
        ok = ok & (cols[None, :] <= q_pos[:, None])
    if HAS_WINDOW:
        ok = ok & (cols[None, :] > q_pos[:, None] - WINDOW)
    if HAS_DOC:
        q_doc = tl.load(DOC + b * s_doc_b + q_pos, mask=rows < T, other=-1)
        k_doc = tl.load(DOC + b * s_doc_b + cols, mask=cols < S, other=-2)
        ok = ok & (q_doc[:, None] == k_doc[None, :])
    if HAS_BIAS:
        # int64 rows: a full (t, s) bias passes 2**31 elements from t = s = 46341
        rows64 = rows[:, None].to(tl.int64)
        bias_ptr = BIAS + b * s_bias_b + h * s_bias_h + rows64 * s_bias_t
        sc += tl.load(bias_ptr + cols[None, :] * s_bias_s, mask=ok, other=0.0)
    return tl.where(ok, sc, float("-inf")), th


@triton.jit
def _fwd_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    SINK,
    BIAS,
    DOC,
    s_qb,
    s_qh,
    s_qt,
    s_kb,
    s_kh,
    s_ks,
    s_vb,
    s_vh,
    s_vs,
    s_bias_b,
    s_bias_h,
    s_bias_t,
    s_bias_s,
    s_doc_b,
    H,
    G,
    T,
    S,
    D,
    OFF,
    WINDOW,
    scale,
    softcap,
    HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_DOC: tl.constexpr,
    HAS_SINK: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    # Grid (query blocks, h, b): CUDA caps grid axes 1 and 2 at 65535, which b * h on one
    # axis passed (b=1024, h=64). int64: b * (h * t * d_h) and (b * h + h) * t * d_h pass
    # 2**31 elements on big batches; int32 offsets wrapped and read/wrote other memory.
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    pid_bh = b * H + h
    hk = h // G  # GQA: query head h reads kv head h // g
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    q_ok = (rows < T)[:, None] & (dims < D)[None, :]
    q_ptr = Q + b * s_qb + h * s_qh + rows[:, None] * s_qt + dims[None, :]
    q = tl.load(q_ptr, mask=q_ok, other=0.0)
    if HAS_SINK:  # the sink column first: exp(sink - m) = 1, value 0
        m_i = tl.full([BLOCK_M], 0.0, tl.float32) + tl.load(SINK + h)
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    lo = 0
    hi = S
    if CAUSAL:  # keys after the block's last query position are never seen
        hi = tl.minimum(S, (pid_m + 1) * BLOCK_M + OFF)
    if HAS_WINDOW:  # keys before the first query's window neither
        lo = tl.maximum(0, pid_m * BLOCK_M + OFF - WINDOW + 1)
        lo = (lo // BLOCK_N) * BLOCK_N
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        kv_ok = (cols < S)[:, None] & (dims < D)[None, :]
        # masked lanes are undefined without other=: a NaN there times 0 (the padded head
        # dims, the masked keys' p = 0) would reach the whole row
        k = tl.load(
            K + b * s_kb + hk * s_kh + cols[:, None] * s_ks + dims[None, :], mask=kv_ok, other=0.0
        )
        v = tl.load(
            V + b * s_vb + hk * s_vh + cols[:, None] * s_vs + dims[None, :], mask=kv_ok, other=0.0
        )
        sc, _ = _tile_scores(
            q, k, rows, cols, b, h, BIAS, DOC, s_bias_b, s_bias_h, s_bias_t, s_bias_s,
            s_doc_b, T, S, OFF, WINDOW, scale, softcap,
            CAUSAL, HAS_WINDOW, HAS_BIAS, HAS_DOC, HAS_SOFTCAP, PRECISION,
        )  # fmt: skip
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(sc - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]  # rows with no allowed key: acc = 0
    o_ptr = O + pid_bh * T * D + rows[:, None] * D + dims[None, :]
    tl.store(o_ptr, out.to(O.dtype.element_ty), mask=q_ok)
    # nothing seen (no key, no sink): L = +inf, so P = 0 in the backward
    lse = tl.where(m_i > float("-inf"), m_i + tl.log(l_safe), float("inf"))
    tl.store(LSE + pid_bh * T + rows, lse, mask=rows < T)


@triton.jit
def _bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    BIAS,
    DOC,
    s_qb,
    s_qh,
    s_qt,
    s_kb,
    s_kh,
    s_ks,
    s_vb,
    s_vh,
    s_vs,
    s_bias_b,
    s_bias_h,
    s_bias_t,
    s_bias_s,
    s_doc_b,
    H,
    G,
    T,
    S,
    D,
    OFF,
    WINDOW,
    scale,
    softcap,
    HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_DOC: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_n = tl.program_id(0)
    H_KV = H // G
    hk = tl.program_id(1).to(tl.int64)  # grid (key blocks, h_kv, b), int64 as the forward
    b = tl.program_id(2).to(tl.int64)
    pid_bk = b * H_KV + hk
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    kv_ok = (cols < S)[:, None] & (dims < D)[None, :]
    k = tl.load(
        K + b * s_kb + hk * s_kh + cols[:, None] * s_ks + dims[None, :], mask=kv_ok, other=0.0
    )
    v = tl.load(
        V + b * s_vb + hk * s_vh + cols[:, None] * s_vs + dims[None, :], mask=kv_ok, other=0.0
    )
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    lo = 0
    hi = T
    if CAUSAL:  # queries before the block's first key never see it
        lo = tl.maximum(0, pid_n * BLOCK_N - OFF)
        lo = (lo // BLOCK_M) * BLOCK_M
    if HAS_WINDOW:  # nor queries whose window has passed its last key
        hi = tl.minimum(T, (pid_n + 1) * BLOCK_N - 1 + WINDOW - OFF)
    for gi in range(0, G):  # every query head that reads this kv head
        h = hk * G + gi
        for start in range(lo, hi, BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            q_ok = (rows < T)[:, None] & (dims < D)[None, :]
            offs = b * s_qb + h * s_qh + rows[:, None] * s_qt + dims[None, :]
            q = tl.load(Q + offs, mask=q_ok, other=0.0)
            do = tl.load(
                DO + (b * H + h) * T * D + rows[:, None] * D + dims[None, :], mask=q_ok, other=0.0
            )
            lse = tl.load(LSE + (b * H + h) * T + rows, mask=rows < T, other=float("inf"))
            delta = tl.load(DELTA + (b * H + h) * T + rows, mask=rows < T, other=0.0)
            sc, th = _tile_scores(
                q, k, rows, cols, b, h, BIAS, DOC, s_bias_b, s_bias_h, s_bias_t, s_bias_s,
                s_doc_b, T, S, OFF, WINDOW, scale, softcap,
                CAUSAL, HAS_WINDOW, HAS_BIAS, HAS_DOC, HAS_SOFTCAP, PRECISION,
            )  # fmt: skip
            p = tl.exp(sc - lse[:, None])  # (rows, cols)
            dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
            ds = p * (dp - delta[:, None])
            if HAS_SOFTCAP:  # through the cap: dS' = dS (1 - tanh^2(S' / c))
                ds = ds * (1.0 - th * th)
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
    out = pid_bk * S * D + cols[:, None] * D + dims[None, :]
    tl.store(DK + out, (dk * scale).to(DK.dtype.element_ty), mask=kv_ok)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=kv_ok)


@triton.jit
def _bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DQ,
    BIAS,
    DOC,
    s_qb,
    s_qh,
    s_qt,
    s_kb,
    s_kh,
    s_ks,
    s_vb,
    s_vh,
    s_vs,
    s_bias_b,
    s_bias_h,
    s_bias_t,
    s_bias_s,
    s_doc_b,
    H,
    G,
    T,
    S,
    D,
    OFF,
    WINDOW,
    scale,
    softcap,
    HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_DOC: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    # Grid (query blocks, h, b): CUDA caps grid axes 1 and 2 at 65535, which b * h on one
    # axis passed (b=1024, h=64). int64: b * (h * t * d_h) and (b * h + h) * t * d_h pass
    # 2**31 elements on big batches; int32 offsets wrapped and read/wrote other memory.
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    pid_bh = b * H + h
    hk = h // G
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    q_ok = (rows < T)[:, None] & (dims < D)[None, :]
    q = tl.load(
        Q + b * s_qb + h * s_qh + rows[:, None] * s_qt + dims[None, :], mask=q_ok, other=0.0
    )
    do = tl.load(DO + pid_bh * T * D + rows[:, None] * D + dims[None, :], mask=q_ok, other=0.0)
    lse = tl.load(LSE + pid_bh * T + rows, mask=rows < T, other=float("inf"))
    delta = tl.load(DELTA + pid_bh * T + rows, mask=rows < T, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    lo = 0
    hi = S
    if CAUSAL:
        hi = tl.minimum(S, (pid_m + 1) * BLOCK_M + OFF)
    if HAS_WINDOW:
        lo = tl.maximum(0, pid_m * BLOCK_M + OFF - WINDOW + 1)
        lo = (lo // BLOCK_N) * BLOCK_N
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        kv_ok = (cols < S)[:, None] & (dims < D)[None, :]
        k = tl.load(
            K + b * s_kb + hk * s_kh + cols[:, None] * s_ks + dims[None, :], mask=kv_ok, other=0.0
        )
        v = tl.load(
            V + b * s_vb + hk * s_vh + cols[:, None] * s_vs + dims[None, :], mask=kv_ok, other=0.0
        )
        sc, th = _tile_scores(
            q, k, rows, cols, b, h, BIAS, DOC, s_bias_b, s_bias_h, s_bias_t, s_bias_s,
            s_doc_b, T, S, OFF, WINDOW, scale, softcap,
            CAUSAL, HAS_WINDOW, HAS_BIAS, HAS_DOC, HAS_SOFTCAP, PRECISION,
        )  # fmt: skip
        p = tl.exp(sc - lse[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        if HAS_SOFTCAP:  # through the cap: dS' = dS (1 - tanh^2(S' / c))
            ds = ds * (1.0 - th * th)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    tl.store(
        DQ + pid_bh * T * D + rows[:, None] * D + dims[None, :],
        (dq * scale).to(DQ.dtype.element_ty),
        mask=q_ok,
    )


SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Block sizes: the interpreter runs numpy, so small tiles keep the tests quick and still
# give several blocks per sequence; on a GPU the forward is autotuned over a few shapes.
INTERPRET_BLOCKS = {"BLOCK_M": 16, "BLOCK_N": 16}
GPU_CONFIGS = [
    triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st)
    for bm, bn, w, st in [(64, 64, 4, 2), (128, 64, 4, 3), (128, 128, 8, 2), (64, 32, 4, 2)]
]
TUNE_KEY = ["T", "S", "HEAD_DIM", "CAUSAL", "HAS_WINDOW", "HAS_BIAS", "HAS_DOC", "PRECISION"]
# a capped tile does more work per score (its tanh): tuned apart
_fwd_tuned = triton.autotune(GPU_CONFIGS, key=[*TUNE_KEY, "HAS_SINK", "HAS_SOFTCAP"])(_fwd_kernel)
_dkdv_tuned = triton.autotune(GPU_CONFIGS, key=[*TUNE_KEY, "HAS_SOFTCAP"])(_bwd_dkdv_kernel)
_dq_tuned = triton.autotune(GPU_CONFIGS, key=[*TUNE_KEY, "HAS_SOFTCAP"])(_bwd_dq_kernel)


def _launch(kernel, tuned, grid_rows: int, heads: int, b: int, *args, **meta) -> None:
    if interpreting():
        grid = (triton.cdiv(grid_rows, INTERPRET_BLOCKS[meta.pop("_axis")]), heads, b)
        kernel[grid](*args, **meta, **INTERPRET_BLOCKS)
    else:
        axis = meta.pop("_axis")
        tuned[lambda m: (triton.cdiv(grid_rows, m[axis]), heads, b)](*args, **meta)


def _bias_and_strides(mask: Tensor | None, b: int, h: int, t: int, s: int, device):
    """Mask -> float32 additive bias read through broadcast strides (0 on size-1 dims)."""
    if mask is None:
        return torch.empty(1, device=device, dtype=torch.float32), (0, 0, 0, 0)
    if mask.dtype == torch.bool:
        zero = torch.zeros((), device=mask.device)
        mask = torch.where(mask, zero, torch.full((), float("-inf"), device=mask.device))
    bias = mask.float()
    while bias.dim() < 4:
        bias = bias[None]
    bias = bias.expand(b, h, t, s)
    return bias, tuple(bias.stride())


class _TritonFlash(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, q, k, v, sinks, bias, has_bias, bias_strides, doc, causal, window, scale, softcap
    ):
        b, h, t, d = q.shape
        h_kv, s = k.shape[1], k.shape[2]
        q, k, v = (x.contiguous() for x in (q, k, v))
        out = torch.empty_like(q)
        lse = torch.empty(b * h, t, device=q.device, dtype=torch.float32)
        meta = _meta(d, causal, window, has_bias, doc, softcap, q.dtype)
        has_sink = sinks is not None
        sink = sinks.detach().float().contiguous() if has_sink else lse  # lse: never read
        common = (bias, doc, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *bias_strides)
        # softcap 1.0 without a cap: never read (HAS_SOFTCAP is False)
        cap = 1.0 if softcap is None else float(softcap)
        tail = (_doc_stride(doc), h, h // h_kv, t, s, d, s - t, window or 0, scale, cap)
        args = (q, k, v, out, lse, sink, *common, *tail)
        _launch(_fwd_kernel, _fwd_tuned, t, h, b, *args, _axis="BLOCK_M", HAS_SINK=has_sink, **meta)
        ctx.save_for_backward(q, k, v, out, lse, bias, doc, sinks)
        ctx.has_bias, ctx.bias_strides = has_bias, bias_strides
        ctx.causal, ctx.window, ctx.scale, ctx.softcap = causal, window, scale, softcap
        return out

    @staticmethod
    @once_differentiable  # kernels write the gradients: no second derivative
    def backward(ctx, grad_out):
        q, k, v, out, lse, bias, doc, sinks = ctx.saved_tensors
        b, h, t, d = q.shape
        h_kv, s = k.shape[1], k.shape[2]
        grad_out = grad_out.contiguous()
        delta = (grad_out.float() * out.float()).sum(-1)  # D = rowsum(dO * O): (b, h, t)
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[3]:  # the sink column's P (-D): no value
            p_sink = torch.exp(sinks.float()[:, None] - lse.view(b, h, t))
            dsinks = (-p_sink * delta).sum((0, 2)).to(sinks.dtype)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        meta = _meta(d, ctx.causal, ctx.window, ctx.has_bias, doc, ctx.softcap, q.dtype)
        strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *ctx.bias_strides)
        cap = 1.0 if ctx.softcap is None else float(ctx.softcap)
        window = ctx.window or 0
        tail = (_doc_stride(doc), h, h // h_kv, t, s, d, s - t, window, ctx.scale, cap)
        dkdv_args = (q, k, v, grad_out, lse, delta, dk, dv, bias, doc, *strides, *tail)
        _launch(_bwd_dkdv_kernel, _dkdv_tuned, s, h_kv, b, *dkdv_args, _axis="BLOCK_N", **meta)
        dq_args = (q, k, v, grad_out, lse, delta, dq, bias, doc, *strides, *tail)
        _launch(_bwd_dq_kernel, _dq_tuned, t, h, b, *dq_args, _axis="BLOCK_M", **meta)
        return dq, dk, dv, dsinks, *([None] * 8)


def _doc_stride(doc: Tensor) -> int:
    return doc.stride(0) if doc.dim() == 2 else 0


def _meta(
    d: int,
    causal: bool,
    window: int | None,
    has_bias: bool,
    doc: Tensor,
    softcap: float | None,
    dtype,
) -> dict:
    return {
        "HEAD_DIM": max(16, triton.next_power_of_2(d)),
        "CAUSAL": bool(causal),
        "HAS_WINDOW": window is not None,
        "HAS_BIAS": has_bias,
        "HAS_DOC": doc.dim() == 2,
        "HAS_SOFTCAP": softcap is not None,
        "PRECISION": "ieee" if dtype == torch.float32 else "tf32",
    }


def triton_flash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: int | None = None,
    doc_ids: Tensor | None = None,
    sinks: Tensor | None = None,
    softcap: float | None = None,
) -> Tensor:
    """q (b, h, t, d_h); k, v (b, h_kv, s, d_h); see ``flash_attention`` for the contract."""
    check_arguments(
        q, k, v, mask, causal=causal, window=window, doc_ids=doc_ids, sinks=sinks, softcap=softcap
    )
    b, h, t, d = q.shape
    s = k.shape[2]
    if v.shape[-1] != d or k.shape[-1] != d:
        raise ValueError(
            f"triton attention needs one head dim for q, k and v, got {d}, {k.shape[-1]} and "
            f"{v.shape[-1]} (MLA's narrower values); use backend 'flash' or 'sdpa'"
        )
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"triton attention supports float32, float16, bfloat16, not {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"triton attention needs one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if mask is not None and mask.dtype == torch.float64:  # the one dtype wider than the bias
        _, saturated = additive_in(mask, torch.float32)
        if saturated is not None and bool(saturated.any()):  # they were -inf: zeros, not eager's
            raise ValueError(
                "triton attention: a float64 mask row lies wholly below float32's range, whose "
                "result depends on float64 scores; use backend 'flash', 'eager' or 'sdpa'"
            )
    if window is not None:
        # Keys k > p - w are keys k > p - ceil(w): a float window (which the other backends
        # take) as the int the kernel needs (a float failed to compile). A window of s keys
        # or more is plain causal; clamping keeps the backward's bound (last key + window -
        # offset) inside int32: window=2**31-1 wrapped it negative and dK, dV came back 0.
        window = min(math.ceil(window), max(s, 1))
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    bias, bias_strides = _bias_and_strides(mask, b, h, t, s, q.device)
    doc = (
        torch.empty(0, device=q.device, dtype=torch.int32)
        if doc_ids is None
        # int64: int32 wrapped ids 2**32 apart (hashes, global offsets) into one document
        else doc_ids.to(device=q.device, dtype=torch.int64).contiguous()
    )
    return _TritonFlash.apply(
        q, k, v, sinks, bias, mask is not None, bias_strides, doc, causal, window, scale, softcap
    )
