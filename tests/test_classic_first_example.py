"""The first worked example of causal self-attention: six tokens, each attending to itself
and the tokens before it. Token 0 sees only itself, so its softmax is exactly [1, 0, ...]
and its output is exactly v_0, whatever the scores; the last token sees all six."""

from __future__ import annotations

import pytest
import torch
from oracle import causal_allowed, naive_attention

from attnlab.functional.attention import attend


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_six_token_causal_attention(backend):
    q, k, v = (torch.randn(1, 1, 6, 8) for _ in range(3))  # (b, h, t, d_h)
    out = attend(q, k, v, causal=True, backend=backend)
    assert torch.equal(out[0, 0, 0], v[0, 0, 0])  # bit for bit: weight 1 on v_0, 0 elsewhere
    want = naive_attention(q, k, v, causal_allowed(6, 6))
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    # the last row attends to everything: the same as attention without a mask
    full = attend(q, k, v, causal=False, backend=backend)
    torch.testing.assert_close(out[0, 0, 5], full[0, 0, 5], rtol=1e-5, atol=1e-6)


def test_six_token_causal_weights_are_lower_triangular_rows_summing_to_one():
    q, k, v = (torch.randn(1, 1, 6, 8) for _ in range(3))
    _, weights = attend(q, k, v, causal=True, backend="eager", return_weights=True)
    w = weights[0, 0]  # (t, s)
    assert torch.equal(w[0], torch.tensor([1.0, 0, 0, 0, 0, 0]))
    assert torch.equal(w.triu(1), torch.zeros(6, 6))  # no query sees a later token
    torch.testing.assert_close(w.sum(-1), torch.ones(6))
