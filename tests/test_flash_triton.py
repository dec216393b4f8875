"""The Triton kernels (attnlab/kernels) against the eager reference.

Without a GPU they run under Triton's interpreter (numpy, one program at a time), so the
sizes are small and float32 only. TRITON_INTERPRET must be set before anything imports
triton (``triton.jit`` picks the interpreter at decoration time, triton's own helpers
included): conftest.py sets it when no GPU is present, before any test module loads.

Shapes: b batch, h heads, h_kv key/value heads, t query length, s key length, d_h head dim.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from attnlab.functional.attention import attend, eager_attention  # noqa: E402
from attnlab.functional.masks import padding_mask, to_additive  # noqa: E402
from attnlab.kernels import interpreting, triton_attention, triton_unavailable_reason  # noqa: E402

if triton_unavailable_reason() is not None:  # e.g. an interpreter too old for these kernels
    pytest.skip(triton_unavailable_reason(), allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"
TOL = dict(atol=1e-5, rtol=1e-5)


def _qkv(b, h, h_kv, t, s, d_h, dtype=torch.float32):
    xs = (torch.randn(b, h, t, d_h), torch.randn(b, h_kv, s, d_h), torch.randn(b, h_kv, s, d_h))
    return tuple(x.to(DEVICE, dtype).requires_grad_(True) for x in xs)


def _check(q, k, v, mask=None, tol=None, **kw):
    tol = tol or TOL
    out = triton_attention(q, k, v, mask, **kw)
    ref = attend(q, k, v, mask, backend="eager", **kw)
    torch.testing.assert_close(out.float(), ref.float(), **tol)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    want = torch.autograd.grad(ref, (q, k, v), g)
    for a, e in zip(got, want):
        assert a.dtype == e.dtype
        torch.testing.assert_close(a.float(), e.float(), **tol)
    return out


CASES = {
    # name: (t, s, h, h_kv, d_h, causal, window, padding)
    "plain": (20, 20, 2, 2, 16, False, None, False),
    "causal": (37, 37, 2, 2, 16, True, None, False),
    "causal gqa": (33, 33, 4, 2, 16, True, None, False),
    "causal mqa padding": (18, 18, 4, 1, 8, True, None, True),
    "t<s padding": (5, 40, 2, 1, 16, True, None, True),
    "decode": (1, 35, 4, 2, 16, True, None, True),
    "window": (40, 40, 2, 1, 16, True, 9, False),
    "head dim 12": (17, 23, 2, 2, 12, False, None, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_triton_matches_eager(case):
    t, s, h, h_kv, d_h, causal, window, padding = CASES[case]
    b = 2
    q, k, v = _qkv(b, h, h_kv, t, s, d_h)
    mask = None
    if padding:
        valid = torch.ones(b, s, dtype=torch.bool, device=DEVICE)
        valid[1, : s - t + 2] = False  # row 1: its first two queries see only padding
        mask = padding_mask(valid)
    out = _check(q, k, v, mask, causal=causal, window=window)
    if padding and causal:
        assert (out[1, :, :2] == 0).all()


def test_triton_general_masks_and_documents():
    b, h, t, s = 2, 4, 19, 19
    q, k, v = _qkv(b, h, 2, t, s, 16)
    allowed = torch.rand(b, h, t, s, device=DEVICE) > 0.4
    allowed[0, 1, 4] = False
    _check(q, k, v, torch.randn(b, h, t, s, device=DEVICE) + to_additive(allowed), causal=True)
    doc = torch.tensor([[0] * 7 + [1] * 12, [0] * 15 + [1] * 4], device=DEVICE)
    _check(q, k, v, causal=True, doc_ids=doc)


@pytest.mark.parametrize("t, s", [(21, 21), (3, 26)], ids=["prefill", "cached step"])
def test_triton_alibi_bias_matches_eager(t, s):
    """ALiBi's bias (nn/position_bias.py, 3 heads: the interleaved slopes) of queries at
    positions s - t .. s - 1 against keys 0 .. s - 1, beside a key-padding mask, as an
    additive mask: the kernels add it to the tiles as eager adds it to the scores."""
    from attnlab.config import PositionConfig
    from attnlab.nn.position_bias import AlibiBias

    b, h = 2, 3
    q, k, v = _qkv(b, h, h, t, s, 16)
    alibi = AlibiBias(PositionConfig(kind="alibi"), h, bidirectional=False, n_layers=1)
    k_pos = torch.arange(s, device=DEVICE)[None]  # (1, s)
    bias = alibi.to(DEVICE)(k_pos[:, s - t :], k_pos)  # (1, h, t, s)
    valid = torch.ones(b, s, dtype=torch.bool, device=DEVICE)
    valid[1, :4] = False
    _check(q, k, v, bias + to_additive(padding_mask(valid)), causal=True)


@pytest.mark.parametrize(
    "t, s, window, padding",
    [(37, 37, None, False), (1, 35, None, True), (40, 40, 9, False), (5, 40, 6, True)],
    ids=["causal", "decode", "window", "t<s window padding"],
)
def test_triton_sink_logits_match_eager(t, s, window, padding):
    """Sink logits start each row's online softmax (m = sink, l = 1); the backward kernels
    see them through L, and the sinks' gradient is computed beside them: all equal eager's
    written-out sink column, a row with only padding included (all weight on the sink)."""
    q, k, v = _qkv(2, 4, 2, t, s, 16)
    sinks = (torch.randn(4, device=DEVICE) * 2).requires_grad_(True)
    mask = None
    if padding:
        valid = torch.ones(2, s, dtype=torch.bool, device=DEVICE)
        valid[1, : s - t + 1] = False
        mask = padding_mask(valid)
    kw = dict(causal=True, window=window, sinks=sinks)
    out, ref = triton_attention(q, k, v, mask, **kw), attend(q, k, v, mask, backend="eager", **kw)
    torch.testing.assert_close(out, ref, **TOL)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, sinks), g)
    want = torch.autograd.grad(ref, (q, k, v, sinks), g)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, **TOL)
    if padding:
        assert (out[1, :, 0] == 0).all()


def test_triton_is_a_backend():
    q, k, v = (x.detach() for x in _qkv(2, 4, 2, 9, 9, 16))
    torch.testing.assert_close(
        attend(q, k, v, causal=True, backend="triton"), eager_attention(q, k, v, causal=True)
    )


@pytest.mark.skipif(not ON_GPU, reason="numpy (the interpreter) has no bfloat16 maths; GPU only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_half_precision(dtype):
    q, k, v = _qkv(2, 8, 2, 300, 300, 64, dtype)
    # Half inputs round at ~4e-3 (bf16) relative; products and P are half as in eager.
    _check(q, k, v, causal=True, tol=dict(atol=3e-2, rtol=3e-2))


@pytest.mark.skipif(
    not ON_GPU, reason="autotuning times kernels on a GPU; interpreter uses fixed blocks"
)
def test_triton_autotuned_long_sequence():
    assert not interpreting()
    q, k, v = _qkv(1, 4, 4, 1000, 1000, 64)
    _check(q, k, v, causal=True, tol=dict(atol=1e-4, rtol=1e-4))


@pytest.mark.skipif(not ON_GPU, reason="the flash backend picks the Triton kernel on CUDA only")
def test_flash_backend_uses_triton_on_cuda(monkeypatch):
    import attnlab.kernels as kernels

    calls = []
    real = kernels.triton_attention
    monkeypatch.setattr(
        kernels, "triton_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw)
    )
    q, k, v = (x.detach() for x in _qkv(1, 2, 2, 64, 64, 32))
    attend(q, k, v, causal=True, backend="flash")
    assert calls


def test_triton_refuses_a_value_head_dim_of_its_own():
    """The kernels take one head dim: MLA's narrower values (d_v != d_h) were read with the
    query/key width (past each value row) and came back (b, h, t, d_h)."""
    q, k, _ = _qkv(1, 2, 2, 5, 7, 24)
    v = torch.randn(1, 2, 7, 16, device=DEVICE)
    with pytest.raises(ValueError, match="one head dim for q, k and v, got 24, 24 and 16"):
        triton_attention(q, k, v, causal=True)


@pytest.mark.skipif(not ON_GPU, reason="the flash backend picks the Triton kernel on CUDA only")
def test_flash_backend_keeps_narrow_values_on_cuda():
    q, k, _ = (x.detach() for x in _qkv(1, 2, 2, 64, 64, 32))
    v = torch.randn(1, 2, 64, 16, device=DEVICE)
    out = attend(q, k, v, causal=True, backend="flash")
    assert out.shape == (1, 2, 64, 16)
    torch.testing.assert_close(out, eager_attention(q, k, v, causal=True), **TOL)


@pytest.mark.parametrize("window", [2**31 - 1, 2.5])
def test_triton_window_edge_values_match_eager(window):
    """window=2**31-1 (an "unlimited" sentinel) wrapped the backward's int32 bound on the
    queries that see a key block negative: dK and dV came back 0. A float window failed to
    compile while the other backends take it (keys k > p - w)."""
    q, k, v = _qkv(1, 2, 1, 5, 9, 16)
    _check(q, k, v, causal=True, window=window)


def test_triton_double_backward_raises():
    """The kernels write the gradients, which autograd cannot differentiate: a gradient
    penalty through them silently dropped the penalty's part (dQ did not require grad)."""
    q, k, v = _qkv(1, 2, 1, 4, 4, 16)
    out = triton_attention(q, k, v, causal=True)
    (dq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        (out.square().sum() + dq.square().sum()).backward()


def test_triton_document_ids_beyond_int32():
    """The ids went to the kernel as int32: 0 and 2**32 became one document."""
    q, k, v = _qkv(1, 2, 2, 9, 9, 16)
    _check(q, k, v, causal=True, doc_ids=torch.tensor([[0] * 4 + [2**32] * 5], device=DEVICE))


def test_triton_refuses_what_flash_refuses():
    """Arguments the tiled twin refuses by name were taken by the kernel: doc_ids of another
    shape, or with t > s, were read out of bounds; a mask that requires grad got none."""
    q, k, v = _qkv(2, 2, 2, 5, 9, 16)
    with pytest.raises(ValueError, match=r"doc_ids must be \(b, s\) = \(2, 9\), got \(2, 5\)"):
        triton_attention(q, k, v, causal=True, doc_ids=torch.zeros(2, 5, dtype=torch.long))
    q2, k2, v2 = _qkv(2, 2, 2, 9, 5, 16)
    with pytest.raises(ValueError, match="doc_ids need query length t=9 <= key length s=5"):
        triton_attention(q2, k2, v2, doc_ids=torch.zeros(2, 5, dtype=torch.long, device=DEVICE))
    mask = torch.zeros(2, 1, 5, 9, device=DEVICE, requires_grad=True)
    with pytest.raises(ValueError, match="does not differentiate the mask"):
        triton_attention(q, k, v, mask)
    with pytest.raises(ValueError, match="needs one dtype"):
        triton_attention(q, k, v.detach().half())


def test_triton_refuses_a_float64_mask_row_below_float32s_range():
    """The kernels add the mask as a float32 bias: a float64 row wholly below float32's
    range became -inf (zeros) where eager gives the softmax of scores + mask (uniform)."""
    q, k, v = _qkv(1, 2, 2, 4, 6, 16)
    mask = torch.zeros(1, 1, 4, 6, dtype=torch.float64, device=DEVICE)
    _check(q, k, v, mask)  # a float64 mask within range is only cast
    mask[..., 0, :] = -1e39
    with pytest.raises(ValueError, match="wholly below float32's range"):
        triton_attention(q, k, v, mask)


class _OnCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA: how the flash backend picks the kernels."""

    @property
    def is_cuda(self):
        return True


def test_flash_backend_keeps_float64_off_the_kernels(monkeypatch):
    """On CUDA, float64 went to the Triton kernels, which refuse it: attend(backend='flash')
    raised instead of running the tiled twin."""
    import attnlab.kernels as kernels

    calls = []
    monkeypatch.setattr(kernels, "triton_available", lambda: True)
    monkeypatch.setattr(kernels, "triton_attention", lambda q, *a, **kw: calls.append(q.dtype))
    q, k, v = (torch.randn(1, 2, 5, 8, dtype=torch.float64).as_subclass(_OnCuda) for _ in "qkv")
    out = attend(q, k, v, causal=True, backend="flash")
    assert not calls
    ref = eager_attention(*(x.as_subclass(torch.Tensor) for x in (q, k, v)), causal=True)
    torch.testing.assert_close(out.as_subclass(torch.Tensor), ref)
    attend(q.float(), k.float(), v.float(), causal=True, backend="flash")
    assert calls == [torch.float32]
    # a float64 mask stays with the tiled twin, which widens the scores as eager does
    mask = torch.full((1, 1, 5, 5), -1e39, dtype=torch.float64)
    out = attend(q.float(), k.float(), v.float(), mask, backend="flash")
    assert calls == [torch.float32]
    ref = eager_attention(*(x.as_subclass(torch.Tensor).float() for x in (q, k, v)), mask)
    torch.testing.assert_close(out.as_subclass(torch.Tensor), ref)


# --------------------------------------------------------------------------- soft-capping

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from attnlab.kernels.flash_attention import _tanh  # noqa: E402


@triton.jit
def _tanh_kernel(X, Y, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < N, other=0.0)
    tl.store(Y + offs, _tanh(x), mask=offs < N)


def test_kernel_tanh_matches_torch():
    """The kernels' tanh (exp and a Taylor series: Triton has none that both the interpreter
    and CUDA run) against torch.tanh in float64: within a float32 ulp or so on both sides of
    its switch at |x| = 1, exactly 0 at 0, and +-1 (no inf, no NaN) out to |x| = 1e4 and
    beyond."""
    g = torch.Generator().manual_seed(0)
    tiny_to_huge = torch.logspace(-30, 4, 3000, dtype=torch.float64)
    x = torch.cat(
        [
            torch.linspace(-12, 12, 24001, dtype=torch.float64),
            torch.linspace(0.99, 1.01, 2001, dtype=torch.float64),  # the switch
            torch.randn(4000, generator=g, dtype=torch.float64) * 3,
            tiny_to_huge,
            -tiny_to_huge,
            torch.tensor([0.0, 1.0, -1.0, 1e4, -1e4, 3e38, -3e38, float("inf"), -float("inf")]),
        ]
    ).float()
    got = torch.empty_like(x).to(DEVICE)
    block = 1024
    _tanh_kernel[(triton.cdiv(x.numel(), block),)](x.to(DEVICE), got, x.numel(), BLOCK=block)
    got = got.cpu()
    want = torch.tanh(x.double())
    assert torch.isfinite(got).all()
    nonzero = want != 0
    relative = (got.double() - want).abs()[nonzero] / want.abs()[nonzero]
    # within a float32 ulp of tanh (2**-23 relative at most) under the interpreter, whose
    # exp is numpy's; a CUDA tl.exp is ex2.approx (2 ulps) of a rounded product: 3 ulps
    ulps = 1 if interpreting() else 3
    assert relative.max() < ulps * 2**-23, relative.max()
    torch.testing.assert_close(got, torch.tanh(x), atol=0, rtol=(ulps + 1) * 2**-23)
    assert got[x == 0].eq(0).all() and got[x.abs() >= 10].abs().eq(1).all()
    assert (got.sign() == x.sign()).all()
    nan = torch.full((4,), float("nan"), device=DEVICE)
    _tanh_kernel[(1,)](nan, nan, 4, BLOCK=4)
    assert nan.isnan().all()


def _qkv_scaled(b, h, h_kv, t, s, d_h, spread=2.0, dtype=torch.float32):
    """q, k with entries ~ N(0, spread^2): scaled scores of several units, past small caps."""
    q, k, v = (x.detach() for x in _qkv(b, h, h_kv, t, s, d_h, dtype))
    return tuple(x.requires_grad_(True) for x in (q * spread, k * spread, v))


def _capped_lse(q, k, allowed, scale, cap, sinks=None):
    """float64 log-sum-exp of each row's capped scores (and its sink): (b, h, t), -inf for
    a row with nothing to see."""
    q, k = q.double(), k.double().repeat_interleave(q.shape[1] // k.shape[1], 1)
    scores = cap * torch.tanh(q @ k.transpose(-2, -1) * scale / cap)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        column = sinks.double()[:, None, None].expand(*scores.shape[:3], 1)
        scores = torch.cat((scores, column), -1)
    return torch.logsumexp(scores, -1)


SOFTCAP_CASES = {
    # name: (t, s, h, h_kv, d_h, window, padding, sinks, cap)
    "causal gqa": (33, 33, 4, 2, 16, None, False, False, 3.0),
    "window mqa": (40, 40, 2, 1, 16, 9, False, False, 2.0),
    "t<s padding": (5, 40, 2, 1, 16, None, True, False, 4.0),
    "decode window padding sinks": (1, 35, 4, 2, 16, 6, True, True, 2.5),
    "window gqa padding sinks": (24, 24, 4, 2, 12, 7, True, True, 3.0),
}


@pytest.mark.parametrize("case", list(SOFTCAP_CASES))
def test_triton_softcap_matches_eager(case):
    """The capped kernels: output, log-sum-exp, and the gradients of q, k, v (and of the
    sinks) against eager's autograd through c tanh(S' / c), at caps the scores pass (so
    the forward's cap and the backward's slope 1 - tanh^2 both matter)."""
    t, s, h, h_kv, d_h, window, padding, with_sinks, cap = SOFTCAP_CASES[case]
    b = 2
    q, k, v = _qkv_scaled(b, h, h_kv, t, s, d_h)
    sinks = (torch.randn(h, device=DEVICE) * 2).requires_grad_(True) if with_sinks else None
    valid = torch.ones(b, s, dtype=torch.bool, device=DEVICE)
    if padding:
        valid[1, : s - t + 1] = False  # row 1: its first query sees only padding
    mask = padding_mask(valid) if padding else None
    kw = dict(causal=True, window=window, sinks=sinks, softcap=cap)
    out = triton_attention(q, k, v, mask, **kw)
    ref = attend(q, k, v, mask, backend="eager", **kw)
    torch.testing.assert_close(out, ref, **TOL)
    # a float64 reference of the output too, and the stored L (the saved tensors' fifth)
    ref64 = attend(*(x.double() for x in (q, k, v)), mask, backend="eager",
                   **{**kw, "sinks": None if sinks is None else sinks.double()})  # fmt: skip
    torch.testing.assert_close(out.double(), ref64, **TOL)
    scale = d_h**-0.5
    positions = torch.arange(s, device=DEVICE)
    q_pos = positions[s - t :, None]
    allowed = positions[None] <= q_pos
    if window is not None:
        allowed = allowed & (positions[None] > q_pos - window)
    allowed = allowed & valid[:, None, None, :]  # (b, 1, t, s)
    want_lse = _capped_lse(q, k, allowed, scale, cap, sinks)
    lse = out.grad_fn.saved_tensors[4].view(b, h, t).double()
    seen = torch.isfinite(want_lse)
    assert (lse[~seen] == float("inf")).all()  # nothing seen: L = +inf (P = 0)
    torch.testing.assert_close(lse[seen], want_lse[seen], **TOL)
    # the cap bends these scores: the uncapped kernels give another output
    uncapped = triton_attention(q, k, v, mask, **{**kw, "softcap": None})
    assert (uncapped - out).abs().max() > 0.05
    g = torch.randn_like(out)
    leaves = (q, k, v) if sinks is None else (q, k, v, sinks)
    got = torch.autograd.grad(out, leaves, g)
    want = torch.autograd.grad(ref, leaves, g)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, **TOL)
    if padding:  # all weight on the sink, or nothing to see: zeros either way
        assert (out[1, :, 0] == 0).all()


def test_triton_softcap_slope_is_in_the_gradients():
    """Without the backward's factor 1 - tanh^2(S' / c), dQ and dK would be those of a
    straight-through cap (forward capped, slope 1): far from eager's, so the comparison
    with eager above would catch it. Here both are set against the kernels."""
    cap, scale = 2.0, 16**-0.5
    q, k, v = _qkv_scaled(1, 2, 1, 20, 20, 16)
    out = triton_attention(q, k, v, causal=True, softcap=cap)

    def straight_through(q, k, v):
        k, v = k.expand(-1, 2, -1, -1), v.expand(-1, 2, -1, -1)
        raw = q @ k.transpose(-2, -1) * scale
        capped = raw + (cap * torch.tanh(raw / cap) - raw).detach()  # slope 1
        allowed = torch.ones(20, 20, dtype=torch.bool, device=DEVICE).tril()
        return torch.softmax(capped.masked_fill(~allowed, float("-inf")), -1) @ v

    no_slope = straight_through(q, k, v)
    torch.testing.assert_close(no_slope, out, **TOL)  # the same forward
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k), g)
    wrong = torch.autograd.grad(no_slope, (q, k), g)
    want = torch.autograd.grad(attend(q, k, v, causal=True, softcap=cap, backend="eager"),
                               (q, k), g)  # fmt: skip
    for a, w, e in zip(got, wrong, want):
        torch.testing.assert_close(a, e, **TOL)
        assert (w - e).abs().max() > 100 * TOL["atol"] + TOL["rtol"] * e.abs().max()


def test_triton_softcap_with_masks_documents_and_the_backend():
    """An additive mask is added after the cap (transformers' order); document ids and a
    bool mask beside it; and attend(backend='triton') takes the cap."""
    b, h, t, s = 2, 4, 19, 19
    q, k, v = _qkv_scaled(b, h, 2, t, s, 16)
    allowed = torch.rand(b, h, t, s, device=DEVICE) > 0.4
    allowed[0, 1, 4] = False
    bias = torch.randn(b, h, t, s, device=DEVICE) + to_additive(allowed)
    _check(q, k, v, bias, causal=True, softcap=2.0)
    doc = torch.tensor([[0] * 7 + [1] * 12, [0] * 15 + [1] * 4], device=DEVICE)
    _check(q, k, v, allowed, causal=True, doc_ids=doc, softcap=3.0)
    _check(q, k, v, softcap=2.5, scale=0.4)  # not causal, a scale of its own
    qd, kd, vd = (x.detach() for x in (q, k, v))
    torch.testing.assert_close(
        attend(qd, kd, vd, causal=True, backend="triton", softcap=2.0),
        eager_attention(qd, kd, vd, causal=True, softcap=2.0),
        **TOL,
    )


@pytest.mark.skipif(not ON_GPU, reason="numpy (the interpreter) has no bfloat16 maths; GPU only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_softcap_half_precision(dtype):
    q, k, v = _qkv(2, 8, 2, 300, 300, 64, dtype)
    # as test_triton_half_precision; a cap of 2 bends the larger of these unit scores
    _check(q, k, v, causal=True, softcap=2.0, tol=dict(atol=3e-2, rtol=3e-2))
    _check(q, k, v, causal=True, window=70, softcap=2.0, tol=dict(atol=3e-2, rtol=3e-2))


@pytest.mark.skipif(
    not ON_GPU, reason="autotuning times kernels on a GPU; interpreter uses fixed blocks"
)
def test_triton_softcap_autotuned_long_sequence():
    assert not interpreting()
    q, k, v = _qkv_scaled(1, 4, 2, 1000, 1000, 64, spread=1.5)
    sinks = torch.randn(4, device=DEVICE).requires_grad_(True)
    _check(q, k, v, causal=True, softcap=5.0, tol=dict(atol=1e-4, rtol=1e-4))
    _check(q, k, v, causal=True, window=300, sinks=sinks, softcap=3.0,
           tol=dict(atol=1e-4, rtol=1e-4))  # fmt: skip


@pytest.mark.skipif(not ON_GPU, reason="the flash backend picks the Triton kernel on CUDA only")
def test_flash_backend_uses_triton_on_cuda_with_a_softcap(monkeypatch):
    import attnlab.kernels as kernels

    calls = []
    real = kernels.triton_attention
    monkeypatch.setattr(
        kernels, "triton_attention", lambda *a, **kw: calls.append(kw["softcap"]) or real(*a, **kw)
    )
    q, k, v = (x.detach() for x in _qkv_scaled(1, 2, 2, 64, 64, 32))
    out = attend(q, k, v, causal=True, backend="flash", softcap=2.0)
    assert calls == [2.0]
    torch.testing.assert_close(out, eager_attention(q, k, v, causal=True, softcap=2.0), **TOL)
