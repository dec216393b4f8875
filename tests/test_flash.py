"""Tiled flash attention (functional/flash.py) and the backend registry against the eager
reference and the naive loop; packed documents against running each document alone.

Shapes: b batch, h heads, h_kv key/value heads, t query length, s key length, d_h head dim.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from oracle import causal_allowed, naive_attention, sliding_window_allowed

from attnlab.config import AttentionConfig, ConfigError
from attnlab.functional.attention import (
    BACKENDS,
    attend,
    available_backends,
    backend_names,
    eager_attention,
)
from attnlab.functional.flash import flash_attention, plan_tiles
from attnlab.functional.masks import (
    document_ids,
    document_mask,
    document_positions,
    padding_mask,
    to_additive,
)
from attnlab.memory import PeakTensorMemory

TOL = dict(atol=1e-5, rtol=1e-5)


def _qkv(b=2, h=4, h_kv=4, t=5, s=5, d_h=8, dtype=torch.float32, grad=False):
    xs = (torch.randn(b, h, t, d_h), torch.randn(b, h_kv, s, d_h), torch.randn(b, h_kv, s, d_h))
    return tuple(x.to(dtype).requires_grad_(grad) for x in xs)


def _grads(out, inputs, seed=1):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype)
    return torch.autograd.grad(out, inputs, g)


def _left_padding(b, s):
    valid = torch.ones(b, s, dtype=torch.bool)
    for i in range(1, b):
        valid[i, : min(2 * i, s - 1)] = False
    return valid


# ------------------------------------------------------------- flash against eager, a grid

GRID = [
    # (t, s, h, h_kv, causal, window, padding, block_q, block_k)
    (1, 1, 2, 2, False, None, False, 4, 4),
    (7, 7, 4, 4, False, None, False, 4, 4),
    (33, 33, 4, 2, True, None, False, 8, 16),
    (33, 33, 4, 1, True, None, True, 16, 8),
    (5, 37, 4, 2, True, None, True, 4, 8),  # t < s: bottom-right causal (chunked prefill)
    (1, 29, 4, 1, True, None, True, 8, 8),  # one decode step
    (20, 45, 2, 2, False, None, True, 7, 9),  # uneven blocks and lengths
    (40, 40, 4, 2, True, 9, False, 8, 8),  # sliding window
    (17, 50, 2, 1, True, 5, True, 4, 16),
    (64, 64, 2, 2, True, None, False, 64, 64),  # one block
    (30, 30, 2, 2, True, None, True, 128, 128),  # block larger than the sequence
]


@pytest.mark.parametrize("t,s,h,h_kv,causal,window,padding,block_q,block_k", GRID)
def test_flash_matches_eager_outputs_and_grads(
    t, s, h, h_kv, causal, window, padding, block_q, block_k
):
    b = 3
    q, k, v = _qkv(b=b, h=h, h_kv=h_kv, t=t, s=s, d_h=16, grad=True)
    mask = padding_mask(_left_padding(b, s)) if padding else None
    kw = dict(causal=causal, window=window)
    out = flash_attention(q, k, v, mask, block_q=block_q, block_k=block_k, **kw)
    ref = attend(q, k, v, mask, backend="eager", **kw)
    torch.testing.assert_close(out, ref, **TOL)
    for a, e in zip(_grads(out, (q, k, v)), _grads(ref, (q, k, v))):
        torch.testing.assert_close(a, e, **TOL)


def test_flash_matches_naive_loop_with_window():
    q, k, v = _qkv(b=1, h=2, h_kv=1, t=6, s=11)
    allowed = sliding_window_allowed(6, 11, 4)
    out = flash_attention(q, k, v, causal=True, window=4, block_q=2, block_k=3)
    torch.testing.assert_close(out, naive_attention(q, k, v, allowed), **TOL)


@pytest.mark.parametrize("kind", ["bool", "additive", "additive+bias", "per-head"])
def test_flash_general_masks(kind):
    b, h, t, s = 2, 4, 9, 13
    q, k, v = _qkv(b=b, h=h, h_kv=2, t=t, s=s, grad=True)
    allowed = torch.rand(b, 1 if kind != "per-head" else h, t, s) > 0.4
    allowed[0, 0, 3] = False  # a row that may attend to nothing
    mask = allowed
    if kind == "additive":
        mask = to_additive(allowed)
    elif kind == "additive+bias":
        mask = torch.randn(b, h, t, s) + to_additive(allowed)
    out = flash_attention(q, k, v, mask, causal=True, block_q=4, block_k=4)
    ref = eager_attention(q, k, v, mask, causal=True)
    torch.testing.assert_close(out, ref, **TOL)
    assert (out[0, 0, 3] == 0).all()
    for a, e in zip(_grads(out, (q, k, v)), _grads(ref, (q, k, v))):
        assert a.isfinite().all()
        torch.testing.assert_close(a, e, **TOL)


def test_flash_value_head_dim_may_differ():
    """MLA attends with values narrower than its query/key heads (d_v != d_h)."""
    q, k, _ = _qkv(b=2, h=4, h_kv=2, t=40, s=40, d_h=24, grad=True)
    v = torch.randn(2, 2, 40, 16, requires_grad=True)
    doc = torch.tensor([[0] * 15 + [1] * 25, [0] * 30 + [1] * 10])
    out = flash_attention(q, k, v, causal=True, doc_ids=doc, block_q=8, block_k=16)
    ref = attend(q, k, v, causal=True, doc_ids=doc, backend="eager")
    assert out.shape == (2, 4, 40, 16)
    torch.testing.assert_close(out, ref, **TOL)
    for a, e in zip(_grads(out, (q, k, v)), _grads(ref, (q, k, v))):
        torch.testing.assert_close(a, e, **TOL)


def test_flash_fully_masked_rows_give_zeros_and_zero_query_grads():
    b, t = 2, 6
    q, k, v = _qkv(b=b, h=2, h_kv=2, t=t, s=t, grad=True)
    valid = torch.ones(b, t, dtype=torch.bool)
    valid[1, :3] = False  # left padding: queries 0-2 of row 1 see only padding
    out = flash_attention(q, k, v, padding_mask(valid), causal=True, block_q=2, block_k=2)
    assert (out[1, :, :3] == 0).all()
    dq, dk, dv = _grads(out, (q, k, v))
    assert (dq[1, :, :3] == 0).all() and dk.isfinite().all() and dv.isfinite().all()


def test_flash_bfloat16_close_to_float32():
    q, k, v = _qkv(b=2, h=4, h_kv=2, t=40, s=40, d_h=16, grad=True)
    ref = flash_attention(q, k, v, causal=True, block_q=16, block_k=16)
    qb, kb, vb = (x.detach().bfloat16().requires_grad_(True) for x in (q, k, v))
    out = flash_attention(qb, kb, vb, causal=True, block_q=16, block_k=16)
    assert out.dtype == torch.bfloat16
    # bf16 keeps 8 bits of mantissa: inputs, products and outputs round at ~4e-3 relative.
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)
    eager = eager_attention(qb, kb, vb, causal=True)
    torch.testing.assert_close(out.float(), eager.float(), atol=3e-2, rtol=3e-2)
    for a, e in zip(_grads(out, (qb, kb, vb)), _grads(ref, (q, k, v))):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), e, atol=6e-2, rtol=6e-2)


def test_flash_float64_keeps_float64_precision():
    """float64 in, float64 statistics (as eager's softmax_dtype): the gradients pass
    gradcheck. With float32 statistics the outputs were off by ~1e-6 and gradcheck failed."""
    q, k, v = _qkv(b=1, h=2, h_kv=1, t=5, s=7, d_h=4, dtype=torch.float64, grad=True)
    mask = torch.rand(1, 1, 5, 7) > 0.3
    out = flash_attention(q, k, v, mask, causal=True, block_q=2, block_k=3)
    ref = eager_attention(q, k, v, mask, causal=True)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    fn = lambda q, k, v: flash_attention(q, k, v, mask, causal=True, block_q=2, block_k=3)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_flash_float64_mask_below_float32_range_is_added_as_eager_adds_it():
    """A float64 additive mask widens eager's scores (scores + mask): a row wholly below
    float32's range gets the softmax of its values (-1e39 everywhere: uniform weights).
    Added to float32 tile scores, those values were -inf and the row came back as zeros."""
    q, k, v = _qkv(b=1, h=2, h_kv=1, t=4, s=6, grad=True)
    mask = torch.zeros(1, 1, 4, 6, dtype=torch.float64)
    mask[..., 0, :] = -1e39  # one value: uniform weights
    mask[..., 1, :] = -1e39 * torch.arange(1.0, 7.0, dtype=torch.float64)  # all on key 0
    mask[..., 2, 3:] = -1e300  # some keys only: those get no weight
    out = flash_attention(q, k, v, mask, block_q=2, block_k=4)
    ref = eager_attention(q, k, v, mask)
    torch.testing.assert_close(out, ref, **TOL)
    # Row 0's gradient left out: the backward recomputes P = exp(S - L) from L = m + log l,
    # which loses log l when |m| is this large (torch's SDPA alike): P = 1, not 1/s there.
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    g[:, :, 0] = 0.0
    got = torch.autograd.grad(out, (q, k, v), g)
    for a, e in zip(got, torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(a, e, **TOL)


def test_flash_double_backward_raises_instead_of_wrong_second_derivatives():
    """The backward recomputes P from the saved log-sum-exp, a constant to autograd: a
    gradient penalty through it silently gave second derivatives off by ~75% (against
    eager's). Now it raises, as torch's once-differentiable functions do."""
    q, k, v = _qkv(b=1, h=2, h_kv=1, t=3, s=4, d_h=3, dtype=torch.float64, grad=True)
    out = flash_attention(q, k, v, causal=True, block_q=2, block_k=2)
    (dq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        (out.square().sum() + dq.square().sum()).backward()
    # the first derivative itself is unchanged
    ref = eager_attention(q, k, v, causal=True)
    torch.testing.assert_close(dq, torch.autograd.grad(ref.square().sum(), q)[0])


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_flash_mask_changed_in_place_before_backward_raises(kind):
    """The backward recomputes the scores with the mask (and document ids): changed in
    place after the forward, it gave other gradients silently (as SDPA does, it raises)."""
    q, k, v = _qkv(b=1, h=2, h_kv=2, t=6, s=6, d_h=4, grad=True)
    mask = torch.rand(1, 1, 6, 6) > 0.3 if kind == "bool" else torch.randn(1, 1, 6, 6)
    out = flash_attention(q, k, v, mask, block_q=2, block_k=2)
    mask.fill_(True) if kind == "bool" else mask.zero_()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
    doc = torch.tensor([[0, 0, 1, 1, 1, 2]])
    out = flash_attention(q, k, v, causal=True, doc_ids=doc, block_q=2, block_k=2)
    doc.zero_()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_flash_takes_a_float_window_as_eager_does():
    """A float window (eager, SDPA and the Triton twin take it: keys k > p - w) failed in
    the tiles' slices with a TypeError."""
    q, k, v = _qkv(b=2, h=4, h_kv=2, t=9, s=9, d_h=6, grad=True)
    out = flash_attention(q, k, v, causal=True, window=3.5, block_q=4, block_k=4)
    ref = attend(q, k, v, causal=True, window=3.5, backend="eager")
    torch.testing.assert_close(out, ref, **TOL)
    for a, e in zip(_grads(out, (q, k, v)), _grads(ref, (q, k, v))):
        torch.testing.assert_close(a, e, **TOL)


def test_flash_huge_logits_stay_finite():
    q, k, v = _qkv(b=1, h=2, h_kv=2, t=12, s=12, grad=True)
    out = flash_attention(q, k, v, causal=True, scale=300.0, block_q=4, block_k=4)
    ref = eager_attention(q, k, v, causal=True, scale=300.0)
    assert out.isfinite().all()
    torch.testing.assert_close(out, ref, **TOL)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_flash_block_size_must_be_positive_int(bad):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="block_q must be a positive integer"):
        flash_attention(q, k, v, block_q=bad)
    with pytest.raises(ValueError, match="block_k must be a positive integer"):
        flash_attention(q, k, v, block_k=bad)


def test_flash_block_sizes_may_be_numpy_integers():
    """A numpy integer is an integer: it was refused as "must be a positive integer"."""
    q, k, v = _qkv(b=1, h=2, h_kv=2, t=12, s=12)
    want = flash_attention(q, k, v, causal=True, block_q=4, block_k=8)
    got = flash_attention(q, k, v, causal=True, block_q=np.int64(4), block_k=np.int32(8))
    torch.testing.assert_close(got, want)


def test_flash_argument_errors():
    q, k, v = _qkv(t=6, s=4)
    with pytest.raises(ValueError, match="shorter than query length"):
        flash_attention(q, k, v, causal=True)
    with pytest.raises(ValueError, match="needs causal=True"):
        flash_attention(q, k, v, window=3)
    # v's heads broadcast against k's (silently wrong); t > s with documents failed deep
    # inside with a shape error (the Triton kernel read before the ids)
    with pytest.raises(ValueError, match=r"which k and v share; got k 4, v 1"):
        flash_attention(q, k, v[:, :1])
    with pytest.raises(ValueError, match="doc_ids need query length t=6 <= key length s=4"):
        flash_attention(q, k, v, doc_ids=torch.zeros(2, 4, dtype=torch.long))


# ------------------------------------------------------------- skipping and memory


def _visited(tiles, t, s):
    seen = torch.zeros(t, s, dtype=torch.bool)
    for tile in tiles:
        seen[tile.q0 : tile.q1, tile.k0 : tile.k1] = True
    return seen


@pytest.mark.parametrize("t,s", [(64, 64), (24, 64)])
def test_causal_tiles_above_the_diagonal_are_skipped(t, s):
    tiles = plan_tiles(t, s, causal=True, block_q=8, block_k=8)
    seen = _visited(tiles, t, s)
    allowed = causal_allowed(t, s)
    assert seen[allowed].all()  # nothing needed is skipped
    # Every whole 8x8 tile above the diagonal is skipped: only tiles the diagonal cuts and
    # those under it are computed.
    tiles_seen = seen.reshape(t // 8, 8, s // 8, 8).any(3).any(1)
    tiles_needed = allowed.reshape(t // 8, 8, s // 8, 8).any(3).any(1)
    assert torch.equal(tiles_seen, tiles_needed)
    assert seen.float().mean() < 0.6 if t == s else True


def test_window_and_document_tiles_are_skipped():
    t = s = 64
    tiles = plan_tiles(t, s, causal=True, window=8, block_q=8, block_k=8)
    seen = _visited(tiles, t, s)
    assert seen[sliding_window_allowed(t, s, 8)].all()
    assert seen.float().mean() < 0.25  # a band, not the triangle
    docs = torch.tensor([[0] * 20 + [1] * 30 + [2] * 14])
    tiles = plan_tiles(t, s, causal=True, doc_ids=docs, block_q=8, block_k=8)
    seen = _visited(tiles, t, s)
    assert seen[document_mask(docs)[0, 0] & causal_allowed(t, s)].all()
    assert not seen[56:, :16].any()  # document 2 never looks at document 0's tiles


def _peak_bytes(fn) -> int:
    with PeakTensorMemory() as mem:
        fn()
    return mem.peak


def test_flash_peak_memory_grows_linearly():
    def run(backend, t):
        q, k, v = _qkv(b=1, h=2, h_kv=2, t=t, s=t, d_h=16, grad=True)

        def step():
            attend(q, k, v, causal=True, backend=backend).sum().backward()

        return _peak_bytes(step)

    flash = [run("flash", t) for t in (512, 1024, 2048)]
    eager = [run("eager", t) for t in (512, 1024, 2048)]
    # Doubling t doubles flash's memory (O(t) tiles of block_k keys) and quadruples eager's.
    assert flash[2] / flash[1] < 2.3 and flash[1] / flash[0] < 2.3
    assert eager[2] / eager[1] > 3.5
    assert eager[2] > 8 * flash[2]


def test_flash_saves_no_t_by_s_tensor():
    t = 256
    q, k, v = _qkv(b=1, h=2, h_kv=1, t=t, s=t, d_h=16, grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda x: saved.append(x.numel()) or x, lambda x: x
    ):
        flash_attention(q, k, v, causal=True, block_q=32, block_k=32)
    assert saved and max(saved) <= q.numel()  # q, k, v, out, log-sum-exp


# ------------------------------------------------------------- the registry


def test_registry_is_the_one_list_of_backends():
    assert backend_names() == ("eager", "sdpa", "flash", "triton", "flex")
    assert set(available_backends()) >= {"eager", "sdpa", "flash", "flex"}
    for name in backend_names():
        AttentionConfig(backend=name).validate()
    with pytest.raises(ConfigError, match="choose one of eager, sdpa, flash, triton, flex"):
        AttentionConfig(backend="flsh").validate()


def test_registry_errors_are_single_clear_lines():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="unknown attention backend 'nope'; choose one of eager"):
        attend(q, k, v, backend="nope")
    for name in ("sdpa", "flash", "flex", "triton"):
        with pytest.raises(
            ValueError, match=f"return_weights=True needs backend='eager' \\('{name}'"
        ):
            attend(q, k, v, backend=name, return_weights=True)
    with pytest.raises(ValueError, match="dropout needs backend 'eager' or 'sdpa'"):
        attend(q, k, v, backend="flash", dropout_p=0.1)
    with pytest.raises(ValueError, match="needs causal=True"):
        attend(q, k, v, backend="sdpa", window=2)


@pytest.fixture
def fresh_interpreter_check():
    """The interpreter check reads the installed versions once per process: read them anew
    (here, faked) and forget the fakes after."""
    import attnlab.kernels as kernels

    kernels._interpreter_problem.cache_clear()
    yield kernels
    kernels._interpreter_problem.cache_clear()


@pytest.mark.parametrize(
    "triton_version, numpy_version, problem",
    [
        (
            "3.2.0",
            "1.26.4",
            "Triton 3.2.0's interpreter cannot run these kernels on CPU; pip install 'triton>=3.4'",
        ),
        (
            "3.6.0",
            "2.4.0",
            "Triton 3.6.0's interpreter fails under numpy 2.4.0; "
            "pip install 'triton>=3.7' or 'numpy<2.4'",
        ),
        ("3.6.0", "2.3.5", None),
        ("3.7.0", "2.4.6", None),
        ("3.10.1+git1234", "2.10.0", None),
        (None, "2.4.0", None),  # installed some other way: let it try
        ("unknown", "2.4.0", None),
    ],
)
def test_an_interpreter_that_cannot_run_the_kernels_is_named(
    monkeypatch, fresh_interpreter_check, triton_version, numpy_version, problem
):
    """Under TRITON_INTERPRET=1 the triton backend is unavailable, with the reason, where
    the installed triton and numpy cannot run the kernels (measured: triton 3.2-3.3 look
    for a GPU driver; 3.4-3.6 fail under numpy >= 2.4)."""
    kernels = fresh_interpreter_check
    versions = {"triton": triton_version, "numpy": numpy_version}

    def version(name):
        if versions.get(name) is None:
            raise kernels.importlib.metadata.PackageNotFoundError(name)
        return versions[name]

    monkeypatch.setattr(kernels.importlib.metadata, "version", version)
    monkeypatch.setattr(kernels.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernels.triton_unavailable_reason() == problem
    if problem is not None:
        q, k, v = _qkv()
        with pytest.raises(RuntimeError, match="attention backend 'triton' cannot run: Triton"):
            kernels.triton_attention(q, k, v)


def test_a_nightly_triton_is_known_by_its_distribution_name(monkeypatch, fresh_interpreter_check):
    """PyTorch's nightlies install the ``triton`` module as the pytorch-triton distribution."""
    kernels = fresh_interpreter_check
    versions = {"pytorch-triton": "3.3.0+git96316ce5", "numpy": "1.26.4"}

    def version(name):
        if name not in versions:
            raise kernels.importlib.metadata.PackageNotFoundError(name)
        return versions[name]

    monkeypatch.setattr(kernels.importlib.metadata, "version", version)
    monkeypatch.setattr(kernels.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernels.triton_unavailable_reason() == (
        "Triton 3.3.0+git96316ce5's interpreter cannot run these kernels on CPU; "
        "pip install 'triton>=3.4'"
    )


REGISTRY_CASES = {
    # name: (t, s, h_kv, causal, padding, window)
    "plain": (9, 9, 4, False, False, None),
    "causal": (9, 9, 4, True, False, None),
    "causal t<s": (4, 11, 4, True, False, None),
    "gqa causal+padding": (6, 10, 2, True, True, None),
    "mqa padding": (7, 7, 1, False, True, None),
    "window": (12, 12, 2, True, False, 4),
    "decode": (1, 10, 2, True, True, None),
}


@pytest.mark.parametrize("backend", [n for n in backend_names() if n != "eager"])
@pytest.mark.parametrize("case", list(REGISTRY_CASES))
def test_every_backend_agrees_with_eager(backend, case):
    if backend not in available_backends():
        pytest.skip(f"{backend}: {BACKENDS[backend].unavailable()}")
    t, s, h_kv, causal, padding, window = REGISTRY_CASES[case]
    b = 2
    q, k, v = _qkv(b=b, h_kv=h_kv, t=t, s=s, d_h=16)
    mask = padding_mask(_left_padding(b, s)) if padding else None
    kw = dict(causal=causal, window=window)
    ref = attend(q, k, v, mask, backend="eager", **kw)
    out = attend(q, k, v, mask, backend=backend, **kw)
    torch.testing.assert_close(out, ref, **TOL)
    if backend == "flex" and q.device.type == "cpu":
        return  # no backward on CPU (tested in test_flash_flex.py)
    qkv = tuple(x.clone().requires_grad_(True) for x in (q, k, v))
    ref_qkv = tuple(x.clone().requires_grad_(True) for x in (q, k, v))
    got = _grads(attend(*qkv, mask, backend=backend, **kw), qkv)
    want = _grads(attend(*ref_qkv, mask, backend="eager", **kw), ref_qkv)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, **TOL)


# ------------------------------------------------------------- packed documents


def test_document_helpers():
    tokens = torch.tensor([[5, 6, 0, 7, 0, 8, 9, 9]])  # 0 ends a document
    ids = document_ids(tokens, eos_id=0)
    assert ids.tolist() == [[0, 0, 0, 1, 1, 2, 2, 2]]
    assert document_positions(ids).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    mask = document_mask(ids)
    assert mask.shape == (1, 1, 8, 8)
    assert mask[0, 0, 3].tolist() == [False, False, False, True, True, False, False, False]
    assert document_mask(ids, t=2).shape == (1, 1, 2, 8)


@pytest.mark.parametrize("backend", ["eager", "sdpa", "flash", "flex", "triton"])
def test_packed_sequence_equals_each_document_alone(backend):
    if backend not in available_backends():
        pytest.skip(f"{backend}: {BACKENDS[backend].unavailable()}")
    lengths = [[7, 12, 5], [3, 20, 1]]
    s = 24
    doc = torch.tensor([sum(([i] * n for i, n in enumerate(row)), []) for row in lengths])
    q, k, v = _qkv(b=2, h=4, h_kv=2, t=s, s=s, d_h=16)
    out = attend(q, k, v, causal=True, doc_ids=doc, backend=backend)
    # The same through a boolean mask (what any backend accepts).
    masked = attend(q, k, v, document_mask(doc), causal=True, backend=backend)
    torch.testing.assert_close(out, masked, **TOL)
    for bi, row in enumerate(lengths):
        start = 0
        for n in row:
            part = slice(start, start + n)
            alone = eager_attention(
                q[bi : bi + 1, :, part], k[bi : bi + 1, :, part], v[bi : bi + 1, :, part],
                causal=True,
            )  # fmt: skip
            torch.testing.assert_close(out[bi : bi + 1, :, part], alone, **TOL)
            start += n


# ------------------------------------------------------------- models, generation, the CLI


def _model(name: str, backend: str, **overrides):
    from attnlab.models import build_model
    from attnlab.presets import get_preset

    torch.manual_seed(1)
    cfg = get_preset(name).override({"init_std": 0.2, "attention.backend": backend, **overrides})
    return build_model(cfg)


@pytest.mark.parametrize("backend", ["sdpa", "flash"])
@pytest.mark.parametrize("window", [None, 5])
def test_model_loss_and_grads_match_eager(backend, window):
    idx = torch.randint(0, 256, (2, 24))
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[1, :5] = 0  # left padding
    losses, grads = [], []
    for name in (backend, "eager"):
        m = _model("llama-tiny", name, **{"attention.sliding_window": window})
        out = m(idx, attention_mask=mask, targets=idx)
        out.loss.backward()
        losses.append(out.loss)
        grads.append([p.grad for p in m.parameters()])
    torch.testing.assert_close(losses[0], losses[1], **TOL)
    for a, e in zip(*grads):
        torch.testing.assert_close(a, e, atol=1e-4, rtol=1e-4)  # summed over layers and tokens


@pytest.mark.parametrize("backend", backend_names())
@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_generation_with_every_backend(backend, name):
    if backend not in available_backends():
        pytest.skip(f"{backend}: {BACKENDS[backend].unavailable()}")
    n_new = 3 if backend == "triton" else 6  # the Triton interpreter is slow
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (5, 2, 7)]  # left-padded batch
    expected = _model(name, "eager").eval().generate(prompts, n_new)
    model = _model(name, backend).eval()
    assert model.generate(prompts, n_new) == expected  # prefill + t=1 decode with a mask
    assert model.generate(prompts[0], n_new, use_cache=False) == expected[0]


def test_cli_trains_with_the_flash_backend(tmp_path, capsys):
    from attnlab.cli.main import main

    (tmp_path / "corpus.txt").write_text("the cat sat on the mat. " * 200)
    argv = ["train", "--preset", "gpt2-tiny", "--data", str(tmp_path / "corpus.txt")]
    argv += ["--out", str(tmp_path / "run"), "--max-steps", "2", "--quiet"]
    argv += ["--set", "model.max_seq_len=32", "--set", "train.batch_size=2"]
    argv += ["--set", "train.block_size=16", "--set", "model.attention.backend=flash"]
    assert main(argv) == 0, capsys.readouterr().err
    import json

    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["model"]["attention"]["backend"] == "flash"
