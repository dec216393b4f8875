"""Global tokens (Longformer, BigBird): a local window plus positions that attend everywhere
and are attended by every position; the mask against a loop, and attention through it
(eager and sdpa) against a softmax over the allowed keys one query at a time.

Shapes: b batch, h heads, t queries, s keys, d_h head dim.
"""

from __future__ import annotations

import pytest
import torch

from attnlab.functional.attention import attend
from attnlab.functional.masks import global_window_mask, sink_window_mask


def loop_mask(t, s, window, is_global, causal):
    want = torch.zeros(t, s, dtype=torch.bool)
    for i in range(t):
        p = s - t + i
        for j in range(s):
            local = 0 <= p - j < window if causal else abs(p - j) < window
            ok = local or is_global[j] or is_global[p]
            want[i, j] = ok and (j <= p or not causal)
    return want


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("t, s", [(12, 12), (4, 12), (1, 9)])
def test_global_window_mask_matches_a_loop(causal, t, s):
    for spec in (2, torch.tensor([j in (0, 5, s - 1) for j in range(s)])):
        got = global_window_mask(t, s, 3, spec, causal=causal)
        is_global = [j < spec for j in range(s)] if isinstance(spec, int) else spec.tolist()
        assert torch.equal(got, loop_mask(t, s, 3, is_global, causal))


def test_leading_global_tokens_in_a_causal_model_are_attention_sinks():
    for t, s in ((10, 10), (3, 10)):
        got = global_window_mask(t, s, 4, 2, causal=True)
        assert torch.equal(got, sink_window_mask(t, s, 4 + 2, 2))


def test_global_mask_is_made_on_the_device_of_its_flags():
    """Flags on another device (meta here, a GPU in use) give the mask there: it was made on
    the CPU, with the flags copied back, and failed beside the GPU's scores."""
    for flags in (torch.zeros(6, dtype=torch.bool), torch.zeros(2, 6, dtype=torch.bool)):
        assert global_window_mask(6, 6, 2, flags.to("meta")).is_meta
    assert global_window_mask(6, 6, 2, 1, device="meta").is_meta


def test_global_mask_shape_is_checked():
    with pytest.raises(ValueError, match="global_tokens must have shape \\(6,\\)"):
        global_window_mask(6, 6, 2, torch.ones(5, dtype=torch.bool))


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("causal", [True, False])
def test_attention_through_the_mask_equals_a_loop(backend, causal):
    b, h, s, d = 2, 3, 11, 8
    q, k, v = (torch.randn(b, h, s, d) for _ in range(3))
    is_global = torch.zeros(s, dtype=torch.bool)
    is_global[[0, 6]] = True
    mask = global_window_mask(s, s, 3, is_global, causal=causal)
    got = attend(q, k, v, mask, causal=False, backend=backend)
    allowed = loop_mask(s, s, 3, is_global.tolist(), causal)
    for i in range(s):
        keys = allowed[i].nonzero().squeeze(-1)
        w = (q[:, :, i : i + 1] @ k[:, :, keys].transpose(-1, -2) / d**0.5).softmax(-1)
        torch.testing.assert_close(got[:, :, i : i + 1], w @ v[:, :, keys], atol=1e-5, rtol=1e-5)
