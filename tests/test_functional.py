"""Softmax, masks and the attention backends against torch built-ins and the naive loop.

Shapes: b batch, h heads, h_kv key/value heads, t query length, s key length, d_h head dim.
"""

from __future__ import annotations

import functools

import pytest
import torch
from oracle import causal_allowed, naive_attention, sliding_window_allowed

from attnlab.functional import (
    attend,
    causal_mask,
    combine_masks,
    masked_softmax,
    padding_mask,
    stable_softmax,
    to_additive,
)
from attnlab.functional.attention import eager_attention, sdpa_attention
from attnlab.functional.masks import prefix_lm_mask, sliding_window_mask
from attnlab.functional.softmax import attention_online, softmax_3pass, softmax_online

BACKENDS = ["eager", "sdpa"]
ATOL = 1e-5


# --------------------------------------------------------------------------- softmax


def test_stable_softmax_matches_torch():
    x = torch.randn(3, 5, 11) * 4
    for dim in (-1, 1, 0):
        torch.testing.assert_close(stable_softmax(x, dim=dim), torch.softmax(x, dim=dim))


def test_stable_softmax_huge_logits_do_not_overflow():
    x = torch.tensor([[1e4, 1e4 - 1.0, -1e4], [3e4, 0.0, 3e4]])
    assert torch.exp(x).isinf().any()  # the naive formula would overflow here
    y = stable_softmax(x)
    assert y.isfinite().all()
    # Shifting by a constant does not change softmax: the reference is computed near zero.
    torch.testing.assert_close(y, torch.softmax(x - x.amax(-1, keepdim=True), dim=-1))
    torch.testing.assert_close(y, torch.softmax(x, dim=-1))


def test_masked_softmax_all_masked_row_gives_zeros():
    x = torch.randn(3, 4)
    mask = torch.tensor(
        [[True, False, True, True], [False, False, False, False], [True] * 4], dtype=torch.bool
    )
    y = masked_softmax(x, mask)
    assert y.isfinite().all()
    assert torch.equal(y[1], torch.zeros(4))
    torch.testing.assert_close(y[0], torch.softmax(x[0].masked_fill(~mask[0], -1e9), -1))
    torch.testing.assert_close(y[2], torch.softmax(x[2], -1))
    # Additive form of the same mask, and a row that is -inf in the logits themselves.
    torch.testing.assert_close(masked_softmax(x, to_additive(mask)), y)
    z = stable_softmax(torch.full((2, 3), float("-inf")))
    assert torch.equal(z, torch.zeros(2, 3))


def test_masked_softmax_is_torchs_fused_softmax():
    """masked_softmax runs torch's softmax kernel, no elementwise exp: on CPU torch.exp is
    3-12x slower for inputs below about -87 (masked -inf, scores far below the maximum).
    Gradients flow, and are zero, through a row with nothing allowed."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    x = (torch.randn(2, 3, 5, 7) * 50).requires_grad_()
    allowed = causal_allowed(5, 7).clone()
    allowed[1] = False  # a query that may attend to nothing
    with Ops() as ops:
        y = masked_softmax(x, allowed)
    assert "_softmax" in ops.seen and "exp" not in ops.seen
    torch.testing.assert_close(y, stable_softmax(x.masked_fill(~allowed, float("-inf"))))
    (grad,) = torch.autograd.grad(y, x, torch.randn_like(y))
    assert grad.isfinite().all() and torch.equal(grad[:, :, 1], torch.zeros(2, 3, 7))


# ------------------------------------------------ from softmax to flash attention, by passes

DERIVATIONS = {"3-pass": softmax_3pass, "online": softmax_online}


def _hard_rows() -> torch.Tensor:
    """Random rows, rows of all -inf, partly -inf rows (-inf first: the running maximum
    starts at -inf), and logits so large that exp() would overflow without the maximum."""
    x = torch.randn(6, 13) * 3
    x[1] = float("-inf")
    x[2, :7] = float("-inf")
    x[3] = torch.linspace(-3e4, 3e4, 13)
    x[4, 5:] = 1e4
    x[5, ::2] = float("-inf")
    return x


@pytest.mark.parametrize("name", list(DERIVATIONS))
@pytest.mark.parametrize("block", [1, 4, 13, 20])
def test_softmax_derivations_match_torch(name, block):
    x = _hard_rows()
    y = DERIVATIONS[name](x, block=block)
    assert y.isfinite().all()
    assert torch.equal(y[1], torch.zeros(13))  # all -inf: zeros (project convention)
    finite_rows = [0, 2, 3, 4, 5]
    torch.testing.assert_close(y[finite_rows], torch.softmax(x[finite_rows], dim=-1))
    torch.testing.assert_close(y, stable_softmax(x))


@pytest.mark.parametrize("block", [1, 3, 8])
def test_online_attention_matches_eager(block):
    b, h, t, s, d_h = 2, 3, 5, 11, 8
    q = torch.randn(b, h, t, d_h)
    k, v = torch.randn(b, h, s, d_h), torch.randn(b, h, s, d_h)
    allowed = causal_allowed(t, s).expand(b, 1, t, s).clone()
    allowed[1, 0, 2] = False  # a query that may attend to nothing
    out, lse = attention_online(q, k, v, allowed, block=block)
    ref = attend(q, k, v, allowed, backend="eager")
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=ATOL)
    assert (out[1, :, 2] == 0).all() and (lse[1, :, 2] == float("-inf")).all()
    scores = (q @ k.transpose(-2, -1)) * d_h**-0.5
    expected_lse = scores.masked_fill(~allowed, float("-inf")).logsumexp(-1)
    torch.testing.assert_close(lse, expected_lse)
    # Huge logits: the running maximum keeps every exp() finite.
    out, _ = attention_online(q * 1e3, k, v, block=block)
    assert out.isfinite().all()
    torch.testing.assert_close(out, attend(q * 1e3, k, v, backend="eager"), atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_online_attention_keeps_half_precision_statistics_in_float32(dtype):
    """float16 products past 65504 (q . k of 1e5 here) and running sums were inf (NaN rows):
    statistics and products run in float32, the output comes back in the input dtype."""
    torch.manual_seed(0)
    q = (torch.randn(1, 2, 4, 8) * 100).to(dtype)
    k = (torch.randn(1, 2, 6, 8) * 100).to(dtype)
    v = torch.randn(1, 2, 6, 8).to(dtype)
    out, lse = attention_online(q, k, v, scale=1e-3, block=2)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert out.isfinite().all() and lse.isfinite().all()
    # Oracle: eager in float32 on the same rounded inputs. Eager in bfloat16 keeps its
    # products in bfloat16 (score_operands): scores near 30 round by up to 0.06, and it
    # missed the old atol=rtol=2e-2 on one seed in five (seed 0 passed by luck). Left: the
    # output's one rounding to the input dtype, at most half an ulp (< eps relative).
    ref = attend(q.float(), k.float(), v.float(), scale=1e-3, backend="eager")
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(out.float(), ref, atol=1e-5, rtol=eps)


# --------------------------------------------------------------------------- masks


@pytest.mark.parametrize("t,s", [(4, 4), (3, 7), (1, 5)])
def test_causal_mask_bottom_right(t, s):
    assert torch.equal(causal_mask(t, s), causal_allowed(t, s))


def test_causal_mask_rejects_fewer_keys_than_queries():
    with pytest.raises(ValueError, match="shorter than query length"):
        causal_mask(5, 3)


@pytest.mark.parametrize("t,s,w", [(6, 6, 2), (3, 8, 3), (1, 9, 4), (5, 5, 10)])
def test_sliding_window_mask(t, s, w):
    assert torch.equal(sliding_window_mask(t, s, w), sliding_window_allowed(t, s, w))


@pytest.mark.parametrize("backend", ["eager", "sdpa", "flash", "flex"])
def test_windowed_attention_rejects_fewer_keys_than_queries(backend):
    """Causal attention with a window over fewer keys than queries: eager and sdpa gave the
    first t - s queries (before every key) zeros where flash and flex raised, as plain
    causal attention does on every backend."""
    q, k = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match="key length s=3 is shorter than query length t=5"):
        attend(q, k, k, causal=True, window=2, backend=backend)


@pytest.mark.parametrize("window", [True, "2"])
def test_a_window_that_is_not_a_number_is_refused_on_every_backend(window):
    """flash and flex read window=True as 1 where eager and sdpa failed inside."""
    q = torch.randn(1, 2, 4, 8)
    for backend in ("eager", "sdpa", "flash", "flex"):
        with pytest.raises(ValueError, match="window must be a number of keys"):
            attend(q, q, q, causal=True, window=window, backend=backend)


def test_prefix_lm_mask_is_made_on_the_device_of_its_prefix_lengths():
    """Prefix lengths on another device (meta here, a GPU in use) give the mask there: it
    was made on the CPU and failed beside them."""
    prefix = torch.tensor([2, 3])
    want = prefix_lm_mask(4, 6, prefix)
    assert want.shape == (2, 1, 4, 6)
    assert prefix_lm_mask(4, 6, prefix.to("meta")).is_meta


def test_combine_masks_bool_and_additive():
    a = torch.rand(3, 4) > 0.3
    c = torch.rand(3, 4) > 0.3
    assert torch.equal(combine_masks(a, None, c), a & c)
    assert combine_masks(None, None) is None
    bias = torch.randn(3, 4)
    mixed = combine_masks(bias, a)  # additive + bool -> additive
    assert mixed.dtype == torch.float32
    expected = torch.where(a, bias, torch.tensor(float("-inf")))
    assert torch.equal(mixed, expected)
    pad = padding_mask(torch.tensor([[1, 0, 1]]))
    assert pad.shape == (1, 1, 1, 3) and pad.dtype == torch.bool
    assert pad.flatten().tolist() == [True, False, True]


# --------------------------------------------------------------------------- attention


def _qkv(b=2, h=4, h_kv=4, t=5, s=5, d_h=8, dtype=torch.float32):
    q = torch.randn(b, h, t, d_h, dtype=dtype)
    k = torch.randn(b, h_kv, s, d_h, dtype=dtype)
    v = torch.randn(b, h_kv, s, d_h, dtype=dtype)
    return q, k, v


def _key_valid(b, s):
    """(b, s) bool: row 0 keeps every key, later rows lose their first keys (left padding)."""
    valid = torch.ones(b, s, dtype=torch.bool)
    for i in range(1, b):
        valid[i, : min(i + 1, s - 1)] = False
    return valid


CASES = {
    # name: (t, s, causal, padding, h_kv)
    "plain": (5, 5, False, False, 4),
    "causal": (5, 5, True, False, 4),
    "padding": (5, 6, False, True, 4),
    "causal+padding": (6, 6, True, True, 4),
    "causal t<s": (3, 7, True, False, 4),
    "causal+padding t<s": (3, 7, True, True, 4),
    "gqa causal+padding": (4, 6, True, True, 2),
    "mqa causal+padding": (4, 6, True, True, 1),
    "mqa plain": (5, 5, False, False, 1),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_attend_matches_naive_loop(backend, case):
    t, s, causal, padding, h_kv = CASES[case]
    b = 3
    q, k, v = _qkv(b=b, h_kv=h_kv, t=t, s=s)
    mask = padding_mask(_key_valid(b, s)) if padding else None
    allowed = torch.ones(b, 1, t, s, dtype=torch.bool)
    if causal:
        allowed = allowed & causal_allowed(t, s)
    if padding:
        allowed = allowed & _key_valid(b, s)[:, None, None, :]
    expected = naive_attention(q, k, v, allowed)
    out = attend(q, k, v, mask, causal=causal, backend=backend)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("backend", ["eager", "sdpa", "flash"])
def test_attend_documents_with_fewer_queries_than_keys_match_naive_loop(backend):
    """doc_ids (b, s) with t < s: the queries are the last t tokens of each packed row
    (bottom-right, as ``causal``), so query i, token s - t + i, sees the earlier keys of
    that token's document only. Eager and SDPA fold the documents into a mask
    (``document_mask(doc_ids, t)``), flash skips tiles; the loop checks all three."""
    b, t, s = 2, 4, 10
    doc = torch.tensor([[0] * 3 + [1] * 5 + [2] * 2, [0] * 7 + [1] * 3])
    q, k, v = _qkv(b=b, h=4, h_kv=2, t=t, s=s)
    allowed = torch.zeros(b, 1, t, s, dtype=torch.bool)
    for row in range(b):
        for i in range(t):
            p = s - t + i
            for j in range(s):
                allowed[row, 0, i, j] = j <= p and bool(doc[row, j] == doc[row, p])
    out = attend(q, k, v, causal=True, doc_ids=doc, backend=backend)
    torch.testing.assert_close(out, naive_attention(q, k, v, allowed), atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("backend", ["eager", "sdpa", "flash", "flex"])
def test_attend_refuses_document_ids_of_the_queries_only(backend):
    """doc_ids are one per key (b, s): the ids of a decoding step's one query (b, 1) were
    broadcast by eager and sdpa over every key, so it attended across documents (the
    result of no doc_ids at all); flex failed with an IndexError."""
    q, k, v = _qkv(b=2, h=4, h_kv=2, t=1, s=6)
    doc = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 1, 1]])
    with pytest.raises(ValueError, match=r"doc_ids must be \(b, s\) = \(2, 6\), got \(2, 1\)"):
        attend(q, k, v, causal=True, doc_ids=doc[:, -1:], backend=backend)
    with pytest.raises(ValueError, match=r"doc_ids must be \(b, s\) = \(1, 6\), got \(2, 6\)"):
        attend(q[:1], k[:1], v[:1], causal=True, doc_ids=doc, backend=backend)


@pytest.mark.parametrize("backend", ["eager", "sdpa", "flash", "flex"])
def test_attend_refuses_a_mask_wider_than_the_scores(backend):
    """A mask must broadcast to the scores (b, h, t, s): one with more rows than the queries
    widened eager's output to its batch (one row in, two out) and flex read its first row
    only; sdpa and flash failed deep inside."""
    q, k, v = _qkv(b=1, h=4, h_kv=2, t=3, s=5)
    wider = torch.ones(2, 1, 3, 5, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"mask of shape \(2, 1, 3, 5\) does not broadcast"):
        attend(q, k, v, wider, backend=backend)
    with pytest.raises(ValueError, match=r"mask of shape \(1, 1, 1, 3, 5\) does not broadcast"):
        attend(q, k, v, wider[None, :1], backend=backend)
    with pytest.raises(ValueError, match=r"to the scores \(b, h, t, s\) = \(1, 4, 3, 5\)"):
        attend(q, k, v, torch.ones(1, 2, 3, 5, dtype=torch.bool), backend=backend)  # h_kv heads


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("h_kv", [4, 2, 1])
def test_attend_boolean_and_additive_masks(backend, h_kv):
    b, t, s = 2, 4, 6
    q, k, v = _qkv(b=b, h_kv=h_kv, t=t, s=s)
    allowed = torch.rand(b, 1, t, s) > 0.4
    allowed[..., 0] = True  # every query keeps a key (fully masked rows are tested below)
    expected = naive_attention(q, k, v, allowed)
    torch.testing.assert_close(attend(q, k, v, allowed, backend=backend), expected)
    torch.testing.assert_close(attend(q, k, v, to_additive(allowed), backend=backend), expected)
    # A finite additive bias (as ALiBi or relative positions would add) on top of the mask.
    bias = torch.randn(b, 4, t, s)
    additive = bias + to_additive(allowed)
    expected = naive_attention(q, k, v, allowed, bias)
    torch.testing.assert_close(attend(q, k, v, additive, backend=backend), expected)
    # Custom scale.
    expected = naive_attention(q, k, v, allowed, scale=0.3)
    torch.testing.assert_close(attend(q, k, v, allowed, scale=0.3, backend=backend), expected)


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_every_backend_takes_a_one_dimensional_key_mask(kind):
    """A mask (s,) broadcasts to (b, h, t, s): ``sdpa`` raised an IndexError (torch's SDPA
    wants at least 2-D) where eager, flash and flex took it."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    keys = torch.tensor([True, False, True, True, False])
    m = to_additive(keys) if kind == "additive" else keys
    want = naive_attention(q, k, v, keys)
    for backend in ("eager", "sdpa", "flash", "flex"):
        torch.testing.assert_close(attend(q, k, v, m, backend=backend), want, atol=ATOL, rtol=0)
        torch.testing.assert_close(
            attend(q, k, v, m, causal=True, backend=backend),
            naive_attention(q, k, v, keys & causal_allowed(3, 5)),
            atol=ATOL,
            rtol=0,
        )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["bool", "additive", "additive+bias", "causal+padding"])
def test_fully_masked_rows_give_zeros_and_finite_grads(backend, kind):
    b, h, t, s = 2, 4, 4, 5
    q, k, v = _qkv(b=b, h=h, h_kv=2, t=t, s=s)
    q.requires_grad_(True)
    k.requires_grad_(True)
    v.requires_grad_(True)
    causal = False
    allowed = torch.rand(b, 1, t, s) > 0.3
    allowed[..., 0] = True
    allowed[0, 0, 1] = False  # query 1 of batch row 0 may attend to nothing
    allowed[1, 0, 3] = False
    bias = None
    if kind == "bool":
        mask = allowed
    elif kind == "additive":
        mask = to_additive(allowed)
    elif kind == "additive+bias":
        bias = torch.randn(b, h, t, s)
        mask = bias + to_additive(allowed)
    else:  # left padding of 3 keys: the first queries of row 1 see only padding
        causal = True
        valid = torch.ones(b, s, dtype=torch.bool)
        valid[1, :3] = False
        mask = padding_mask(valid)
        allowed = valid[:, None, None, :] & causal_allowed(t, s)
    empty = ~allowed.any(-1)  # (b, 1, t)
    assert empty.any()
    out = attend(q, k, v, mask, causal=causal, backend=backend)
    assert out.isfinite().all()
    assert (out.masked_select(empty[..., None].expand_as(out)) == 0).all()
    torch.testing.assert_close(
        out.detach(), naive_attention(q.detach(), k.detach(), v.detach(), allowed, bias)
    )
    out.square().sum().backward()
    for x in (q, k, v):
        assert x.grad.isfinite().all()
    # The zero rows have no dependence on the queries.
    assert (q.grad.masked_select(empty.expand(b, h, t)[..., None].expand_as(q)) == 0).all()


def test_backends_agree_on_gradients():
    q, k, v = _qkv(h_kv=2, t=4, s=6)
    mask = padding_mask(_key_valid(2, 6))
    grads = []
    for backend in BACKENDS:
        qs = [x.clone().requires_grad_(True) for x in (q, k, v)]
        attend(*qs, mask, causal=True, backend=backend).sin().sum().backward()
        grads.append([x.grad for x in qs])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=ATOL)


def test_eager_weights_rows_sum_to_one_or_zero():
    b, t, s = 2, 4, 6
    q, k, v = _qkv(b=b, h_kv=2, t=t, s=s)
    valid = torch.ones(b, s, dtype=torch.bool)
    valid[1, :4] = False  # row 1: first two queries see only padding under causality
    out, weights = attend(
        q, k, v, padding_mask(valid), causal=True, backend="eager", return_weights=True
    )
    assert weights.shape == (b, 4, t, s)
    allowed = valid[:, None, None, :] & causal_allowed(t, s)
    expected_sums = allowed.any(-1).float().expand(b, 4, t)
    torch.testing.assert_close(weights.sum(-1), expected_sums)
    assert (weights.masked_select(~allowed.expand_as(weights)) == 0).all()
    # out = weights @ v with query head j reading kv head j // 2.
    torch.testing.assert_close(out, weights @ v.repeat_interleave(2, dim=1))


def test_attend_argument_errors():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="unknown attention backend"):
        attend(q, k, v, backend="nope")
    with pytest.raises(ValueError, match="needs backend='eager'"):
        attend(q, k, v, backend="sdpa", return_weights=True)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        attend(q, k[:, :3], v[:, :3])
    with pytest.raises(ValueError, match=r"\(b, h, t, d_h\)"):
        attend(q[0], k[0], v[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_attend_bf16_close_to_float32(backend):
    q, k, v = _qkv(h_kv=2, t=4, s=6)
    mask = padding_mask(_key_valid(2, 6))
    ref = attend(q, k, v, mask, causal=True, backend=backend)
    out = attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, causal=True, backend=backend)
    assert out.dtype == torch.bfloat16
    # bf16 keeps 8 bits of mantissa: inputs and outputs round at ~4e-3 relative.
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("backend", ["eager", "sdpa", "flash"])
def test_attend_float16_products_past_65504_stay_finite(backend):
    """float16 q . k above 65504 (a score below it once scaled by 1/sqrt(d_h)): the scores
    are products in float32, as torch's SDPA and the Triton kernels form them. eager and
    flash formed them in float16, inf before the scale, and inf - inf gave NaN rows."""
    torch.manual_seed(0)
    q, k, v = (x.half() for x in _qkv(h_kv=2, t=6, s=6))
    q, k = q * 100, k * 100
    dots = q.float() @ k.float().repeat_interleave(2, 1).mT
    assert dots.abs().max() > 65504 > dots.abs().max() * 8**-0.5
    q, k, v = (x.requires_grad_(True) for x in (q, k, v))
    out = attend(q, k, v, causal=True, backend=backend)
    ref = attend(q.detach().float(), k.detach().float(), v.detach().float(), causal=True)
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)
    out.float().square().sum().backward()
    assert all(x.grad.isfinite().all() for x in (q, k, v))


@pytest.mark.parametrize("p", [-0.1, 1.5, float("nan")])
@pytest.mark.parametrize(
    "fn",
    [
        eager_attention,
        sdpa_attention,
        *(functools.partial(attend, backend=b) for b in ("eager", "sdpa", "flash", "flex")),
    ],
)
def test_dropout_p_outside_zero_one_is_refused(fn, p):
    """A negative p dropped nothing where it was checked as ``p > 0`` (eager), with no
    word; every entry point now names it."""
    q = k = v = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match=r"dropout_p must be a probability in \[0, 1\]"):
        fn(q, k, v, dropout_p=p)
