"""The ``flex`` backend (torch FlexAttention) against the eager reference and the naive loop.

torch 2.13 runs FlexAttention forward on CPU eagerly (an unfused version) and compiled;
it has no backward on CPU at all, so training there must fail at once with one line.

Shapes: b batch, h heads, h_kv key/value heads, t query length, s key length, d_h head dim.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from oracle import causal_allowed, naive_attention, sliding_window_allowed

from attnlab.functional.attention import attend, eager_attention
from attnlab.functional.flex import NO_CPU_BACKWARD, flex_attention, prefix_lm_mod
from attnlab.functional.masks import prefix_lm_mask, to_additive

TOL = dict(atol=1e-5, rtol=1e-5)


def _qkv(b=2, h=4, h_kv=2, t=9, s=9, d_h=16):
    return torch.randn(b, h, t, d_h), torch.randn(b, h_kv, s, d_h), torch.randn(b, h_kv, s, d_h)


def test_flex_sliding_window_matches_naive():
    q, k, v = _qkv(t=6, s=14)
    out = flex_attention(q, k, v, causal=True, window=5)
    allowed = sliding_window_allowed(6, 14, 5)
    torch.testing.assert_close(out, naive_attention(q, k, v, allowed), **TOL)


def test_flex_prefix_lm_matches_mask():
    t = 12
    q, k, v = _qkv(t=t, s=t)
    for prefix in (4, torch.tensor([3, 7])):
        out = flex_attention(q, k, v, mask_mod=prefix_lm_mod(t, t, prefix))
        mask = prefix_lm_mask(t, t, prefix)
        torch.testing.assert_close(out, eager_attention(q, k, v, mask), **TOL)
    # Prefix 0 is plain causal; prefix t is full bidirectional attention.
    torch.testing.assert_close(prefix_lm_mask(t, t, 0), causal_allowed(t, t))
    assert prefix_lm_mask(t, t, t).all()


def test_flex_additive_and_per_head_masks():
    b, h, t, s = 2, 4, 7, 11
    q, k, v = _qkv(b=b, h=h, t=t, s=s)
    allowed = torch.rand(b, h, t, s) > 0.4
    allowed[1, 2, 3] = False  # empty row -> zeros, as in eager
    bias = torch.randn(b, h, t, s)
    for mask in (allowed, to_additive(allowed), bias + to_additive(allowed)):
        torch.testing.assert_close(
            flex_attention(q, k, v, mask), eager_attention(q, k, v, mask), **TOL
        )


def test_flex_training_on_cpu_fails_early_with_one_line():
    q, k, v = _qkv()
    q.requires_grad_(True)
    with pytest.raises(NotImplementedError, match="no backward on CPU") as err:
        attend(q, k, v, causal=True, backend="flex")
    assert "\n" not in str(err.value) and "'flash'" in NO_CPU_BACKWARD
    with torch.no_grad():  # inference is fine
        attend(q, k, v, causal=True, backend="flex")


@pytest.mark.slow
def test_flex_compiled_on_cpu():
    """torch.compile(flex_attention) builds a fused CPU kernel (tens of seconds)."""
    q, k, v = _qkv(t=64, s=64)
    out = flex_attention(q, k, v, causal=True, compile=True)
    torch.testing.assert_close(out, eager_attention(q, k, v, causal=True), **TOL)


@pytest.mark.slow
def test_flex_compiled_per_row_prefix_lm():
    """The fused kernel skips tiles (and unmasks full ones) by the block mask: built for the
    first row only, a (b,) prefix would hide keys 128..199 from row 1's first 128 queries."""
    t = 256  # two 128-blocks
    q, k, v = _qkv(h=2, h_kv=2, t=t, s=t, d_h=8)
    for prefix in (torch.tensor([0, 200]), torch.tensor([200, 0])):
        out = flex_attention(q, k, v, mask_mod=prefix_lm_mod(t, t, prefix), compile=True)
        want = eager_attention(q, k, v, prefix_lm_mask(t, t, prefix))
        torch.testing.assert_close(out, want, **TOL)


def test_block_mask_is_built_per_row_and_head_only_where_the_mask_reads_them(monkeypatch):
    """A (b, h) block mask costs b h times one; a mask_mod gets the dimensions it says it
    reads (prefix_lm_mod: b with a per-row prefix, none with an int), an undeclared one
    both (it may read either), and each still matches the dense mask."""
    import torch.nn.attention.flex_attention as torch_flex

    built = []
    real = torch_flex.create_block_mask

    def spy(mod, B, H, *args, **kwargs):
        built.append((B, H))
        return real(mod, B, H, *args, **kwargs)

    monkeypatch.setattr(torch_flex, "create_block_mask", spy)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 20, 8) for _ in range(3))
    prefix = torch.tensor([4, 11])
    per_row = prefix_lm_mod(20, 20, prefix)
    undeclared = lambda b, h, q_idx, kv_idx: per_row(b, h, q_idx, kv_idx)  # noqa: E731
    cases = [(prefix_lm_mod(20, 20, 6), 6, (None, None)), (per_row, prefix, (2, None))]
    cases.append((undeclared, prefix, (2, 3)))
    for mod, p, shape in cases:
        built.clear()
        out = flex_attention(q, k, v, mask_mod=mod)
        assert built == [shape]
        ref = eager_attention(q, k, v, prefix_lm_mask(20, 20, p))
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_flex_leaves_a_callers_warning_registry_alone():
    """A warning with the "default" action shows once per place; hiding torch's one
    unfused-flex warning with catch_warnings at every call reset that registry, so a
    caller's warning came again after each flex call (every decoding step)."""
    q, k, v = _qkv()

    def caller():
        warnings.warn("the caller's warning", UserWarning, stacklevel=1)

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        with torch.no_grad():
            flex_attention(q, k, v, causal=True)  # torch's own once-only warning, hidden
            for _ in range(3):
                caller()
                flex_attention(q, k, v, causal=True)
    assert [str(w.message) for w in seen] == ["the caller's warning"]
