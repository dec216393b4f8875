"""Logit soft-capping (Gemma 2): attention scores c tanh(s / c) after the scale and before the
mask (``attention.softcap``, ``attend(softcap=)``) in every backend that takes it (eager,
flash's tiles and its backward, flex's score_mod, the attention-sinks cache) against a
per-query loop (tests/oracle.py), and the output logits (``final_logit_softcap``) in the
loss, evaluation and decoding; the backend that cannot cap (sdpa) and the attention kinds
that do not (MLA, DSA, NSA, linear) refuse it by name. The Triton kernels' cap is tested
against eager in test_flash_triton.py; here, that flash hands it to them on CUDA.

Shapes: b batch, h heads, h_kv key/value heads, t queries, s keys, d_h head dim, V vocabulary.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from oracle import causal_allowed, naive_attention, sliding_window_allowed

from attnlab.config import ConfigError, ModelConfig
from attnlab.functional import attention as attention_module
from attnlab.functional.attention import attend
from attnlab.functional.flash import flash_attention
from attnlab.models.decoder import DecoderLM
from attnlab.presets import get_preset

CAP = 1.5  # the scores below reach ~6: well into tanh's bend
TOL = dict(atol=1e-10, rtol=1e-10)  # float64


def _qkv(b, h, h_kv, t, s, d_h=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = 2 * torch.randn(b, h, t, d_h, generator=g, dtype=torch.float64)
    k = 2 * torch.randn(b, h_kv, s, d_h, generator=g, dtype=torch.float64)
    v = torch.randn(b, h_kv, s, d_h, generator=g, dtype=torch.float64)
    return q, k, v


# (t, s, h, h_kv, window, padding): a prefill, a chunk (t < s), a decode step (t = 1)
SHAPES = {
    "prefill-window-padding-gqa": (9, 9, 4, 2, 4, True),
    "chunk-gqa": (5, 12, 4, 2, None, True),
    "chunk-window-mqa": (5, 12, 4, 1, 3, False),
    "decode-window": (1, 11, 4, 2, 5, True),
    "decode": (1, 11, 2, 2, None, False),
}


def _padding(b: int, s: int, on: bool) -> torch.Tensor | None:
    """(b, 1, 1, s) bool: row 0 left-padded by 3 keys."""
    if not on:
        return None
    mask = torch.ones(b, 1, 1, s, dtype=torch.bool)
    mask[0, ..., :3] = False
    return mask


@pytest.mark.parametrize("backend", ["eager", "flash", "flex"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_softcap_matches_per_query_loop(backend, shape):
    t, s, h, h_kv, window, padding = SHAPES[shape]
    q, k, v = _qkv(2, h, h_kv, t, s)
    mask = _padding(2, s, padding)
    allowed = causal_allowed(t, s) if window is None else sliding_window_allowed(t, s, window)
    allowed = allowed if mask is None else allowed & mask
    want = naive_attention(q, k, v, allowed, scale=0.3, softcap=CAP)
    got = attend(q, k, v, mask, causal=True, window=window, scale=0.3, backend=backend,
                 softcap=CAP)  # fmt: skip
    torch.testing.assert_close(got, want, **TOL)
    uncapped = attend(q, k, v, mask, causal=True, window=window, scale=0.3, backend=backend)
    assert (uncapped - want).abs().max() > 1e-2  # the cap changes these outputs


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("blocks", [(2, 3), (128, 256)])
def test_flash_softcap_gradients_equal_eager(shape, blocks):
    """float64: the tiled backward's dS times 1 - tanh^2(S' / c) against autograd through
    eager, for q, k and v (small tiles: the cap's slope in tiles cut by the diagonal, the
    window and the padding)."""
    t, s, h, h_kv, window, padding = SHAPES[shape]
    q, k, v = _qkv(2, h, h_kv, t, s, seed=1)
    mask = _padding(2, s, padding)
    grad_out = torch.randn(2, h, t, 8, generator=torch.Generator().manual_seed(2),
                           dtype=torch.float64)  # fmt: skip

    def grads(fn):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        (fn(*leaves) * grad_out).sum().backward()
        return [x.grad for x in leaves]

    want = grads(lambda q, k, v: attend(q, k, v, mask, causal=True, window=window,
                                        backend="eager", softcap=CAP))  # fmt: skip
    got = grads(lambda q, k, v: flash_attention(q, k, v, mask, causal=True, window=window,
                                                softcap=CAP, block_q=blocks[0],
                                                block_k=blocks[1]))  # fmt: skip
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL)


def test_flash_softcap_passes_gradcheck_with_sinks():
    """Finite differences through the cap, with learned sink logits beside it."""
    q, k, v = _qkv(1, 2, 1, 4, 6, d_h=4, seed=3)
    sinks = torch.tensor([0.5, -1.0], dtype=torch.float64)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
    assert torch.autograd.gradcheck(
        lambda q, k, v, sk: flash_attention(q, k, v, causal=True, window=3, sinks=sk,
                                            softcap=CAP, block_q=2, block_k=2),
        leaves,
    )  # fmt: skip


def test_softcap_with_sinks_equals_eager_in_flash():
    q, k, v = _qkv(2, 4, 2, 6, 6, seed=4)
    sinks = torch.tensor([0.1, 2.0, -1.0, 0.0], dtype=torch.float64)
    want = attend(q, k, v, causal=True, backend="eager", sinks=sinks, softcap=CAP)
    got = attend(q, k, v, causal=True, backend="flash", sinks=sinks, softcap=CAP)
    torch.testing.assert_close(got, want, **TOL)


def test_softcap_then_additive_mask_in_every_backend():
    """An additive mask's finite values are added after the cap (transformers' order)."""
    q, k, v = _qkv(1, 2, 2, 5, 5, seed=5)
    bias = torch.randn(1, 2, 5, 5, generator=torch.Generator().manual_seed(6),
                       dtype=torch.float64)  # fmt: skip
    bias[..., 0, 1:] = float("-inf")
    allowed = torch.isfinite(bias)
    want = naive_attention(q, k, v, allowed, bias.masked_fill(~allowed, 0.0), softcap=CAP)
    for backend in ("eager", "flash", "flex"):
        got = attend(q, k, v, bias, backend=backend, softcap=CAP)
        torch.testing.assert_close(got, want, **TOL)


def test_recorded_weights_are_capped():
    from attnlab.functional.attention import recording_weights

    q, k, v = _qkv(1, 2, 2, 4, 4, seed=7)
    seen = []
    with recording_weights(seen.append):
        attend(q, k, v, causal=True, backend="flash", softcap=CAP)
    _, want = attend(q, k, v, causal=True, backend="eager", softcap=CAP, return_weights=True)
    torch.testing.assert_close(seen[0], want, **TOL)


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("backend", ["sdpa"])
def test_backends_that_cannot_cap_refuse_it_by_name(backend):
    q, k, v = _qkv(1, 2, 2, 3, 3)
    with pytest.raises(ValueError, match="attention.softcap") as e:
        attend(q, k, v, causal=True, backend=backend, softcap=CAP)
    assert "'eager', 'flash', 'triton' or 'flex'" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="attention.softcap"):  # a direct call as well
        attention_module.BACKENDS[backend].fn(
            q, k, v, None, causal=True, scale=None, dropout_p=0.0, window=None, doc_ids=None,
            sinks=None, softcap=CAP,
        )  # fmt: skip


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan"), True, "2"])
def test_softcap_must_be_a_positive_number(bad):
    q, k, v = _qkv(1, 2, 2, 3, 3)
    with pytest.raises(ValueError, match="softcap must be a positive number"):
        attend(q, k, v, causal=True, backend="eager", softcap=bad)


class _OnCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA (for ``_triton_takes``'s device test)."""

    @property
    def is_cuda(self) -> bool:
        return True


def test_flash_hands_capped_attention_to_triton_on_cuda(monkeypatch):
    """On CUDA with Triton, flash runs the kernels, which cap as its tiles do: with a cap as
    without one (it kept capped attention on the tiled path while they could not). Here the
    tensors say they are on CUDA and the kernels say they are there; they record the cap
    they are handed and answer with the tiled twin."""
    from attnlab import kernels

    q, k, v = (x.float() for x in _qkv(1, 2, 2, 3, 3))
    takes = attention_module._triton_takes
    assert takes(*(x.as_subclass(_OnCuda) for x in (q, k, v)))
    monkeypatch.setattr(
        attention_module,
        "_triton_takes",
        lambda q, k, v, mask=None: takes(*(x.as_subclass(_OnCuda) for x in (q, k, v)), mask),
    )
    monkeypatch.setattr(kernels, "triton_available", lambda: True)
    caps = []

    def kernels_called(*a, softcap=None, **kw):
        caps.append(softcap)
        return flash_attention(*a, softcap=softcap, **kw)

    monkeypatch.setattr(kernels, "triton_attention", kernels_called)
    attend(q, k, v, causal=True, backend="flash")
    got = attend(q, k, v, causal=True, backend="flash", softcap=CAP)
    assert caps == [None, CAP]
    torch.testing.assert_close(got, attend(q, k, v, causal=True, backend="eager", softcap=CAP))


def _cfg(**attention) -> dict:
    return dict(vocab_size=11, max_seq_len=16, d_model=16, n_layers=1,
                attention=dict(n_heads=2, **attention))  # fmt: skip


@pytest.mark.parametrize(
    "data, named",
    [
        (_cfg(softcap=5.0), "attention.backend: attention.softcap (logit soft-capping) needs "
         "backend 'eager', 'flash', 'triton' or 'flex'; 'sdpa' cannot cap the scores"),
        (_cfg(softcap=0.0, backend="eager"), "attention.softcap: must be > 0"),
        (_cfg(softcap=5.0, backend="eager", kind="mla"),
         "attention.softcap: is implemented by attention.kind='mha' only, not 'mla'"),
        (_cfg(softcap=5.0, backend="eager", kind="linear"),
         "attention.softcap: is implemented by attention.kind='mha' only, not 'linear'"),
        ({**_cfg(), "final_logit_softcap": -1.0}, "final_logit_softcap: must be > 0"),
        ({**_cfg(), "arch": "encoder", "final_logit_softcap": 5.0},
         "final_logit_softcap: is implemented by the decoder architecture only"),
        ({**_cfg(softcap=5.0, backend="eager"), "arch": "xl", "position": {"kind": "none"}},
         "attention.softcap: does not apply to Transformer-XL"),
    ],
)  # fmt: skip
def test_config_refuses_soft_capping_where_it_is_not_implemented(data, named):
    with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace(")", r"\)")):
        ModelConfig.from_dict(data).validate()


@pytest.mark.parametrize("backend", ["eager", "flash", "triton", "flex"])
def test_config_takes_soft_capping_with_the_backends_that_cap(backend):
    cfg = ModelConfig.from_dict(_cfg(softcap=5.0, backend=backend))
    cfg.validate()
    assert cfg.attention.softcap == 5.0 and cfg.attention.backend == backend


# --------------------------------------------------------------------------- models

V = 61


def _gemma2(seed: int = 0, **changes) -> DecoderLM:
    """gemma2-tiny (local, global, local, global; window 16; caps 5 and 10) with weights
    large enough that both caps bend."""
    cfg = get_preset("gemma2-tiny").override({"vocab_size": V, "init_std": 0.2, **changes})
    torch.manual_seed(seed)
    return DecoderLM(cfg).eval()


def test_final_softcap_is_in_logits_loss_and_last_only():
    model = _gemma2(final_logit_softcap=3.0)
    plain = DecoderLM(model.cfg.override({"final_logit_softcap": None})).eval()
    plain.load_state_dict(model.state_dict())
    idx = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        raw = plain(idx).logits
        assert raw.abs().max() > 6  # the cap of 3 bends these
        want = 3.0 * torch.tanh(raw / 3.0)
        out = model(idx, targets=targets)
        torch.testing.assert_close(out.logits, want)
        loss = F.cross_entropy(want.flatten(0, 1), targets.flatten())
        torch.testing.assert_close(out.loss, loss)
        torch.testing.assert_close(model(idx, last_only=True).logits, want[:, -1:])


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("backend", ["eager", "flash"])
@torch.no_grad()
def test_cached_decoding_equals_full_forward_with_soft_caps(cache, backend):
    """Past the window, one token at a time and in chunks (both caps in every step), in the
    dynamic cache and the static one (the compiled decode's)."""
    model = _gemma2(seed=2, **{"attention.backend": backend})
    idx = torch.randint(0, V, (2, 30), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(idx)
    mask[0, :4] = 0
    full = model(idx, attention_mask=mask).logits
    real = mask.bool()
    for sizes in ([1] * 30, [7, 1, 17, 5]):
        c = model.new_cache(2, 40, static=cache == "static")
        out, start = [], 0
        for size in sizes:
            part = slice(start, start + size)
            out.append(model(idx[:, part], cache=c, attention_mask=mask[:, part]).logits)
            start += size
        torch.testing.assert_close(torch.cat(out, 1)[real], full[real], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_attention_sinks_cache_caps_the_scores():
    """StreamingLLM's cache (sink_tokens) computes its own attention: capped there too.
    Within the window its keys sit at their own positions, so a step equals the full
    forward pass (past it the cache re-places them, as the paper does)."""
    model = _gemma2(seed=5, **{"attention.sink_tokens": 2, "attention.sliding_window": 8,
                               "attention.backend": "eager"})  # fmt: skip
    idx = torch.randint(0, V, (1, 8), generator=torch.Generator().manual_seed(6))
    full = model(idx).logits
    c = model.new_cache(1, 20)
    steps = torch.cat([model(idx[:, i : i + 1], cache=c).logits for i in range(8)], 1)
    torch.testing.assert_close(steps, full, atol=1e-5, rtol=1e-5)
    uncapped = DecoderLM(model.cfg.override({"attention.softcap": None})).eval()
    uncapped.load_state_dict(model.state_dict())
    c = uncapped.new_cache(1, 20)
    other = torch.cat([uncapped(idx[:, i : i + 1], cache=c).logits for i in range(8)], 1)
    assert (other - steps).abs().max() > 1e-3


def test_training_step_through_both_caps_matches_eager():
    """flash's backward through the attention cap and the final cap in the loss: the
    gradients eager's autograd gives (float64)."""
    grads = {}
    for backend in ("eager", "flash"):
        model = _gemma2(seed=7, **{"attention.backend": backend}).double().train()
        idx = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(8))
        model(idx[:, :-1], targets=idx[:, 1:]).loss.backward()
        grads[backend] = {n: p.grad for n, p in model.named_parameters()}
    for name, want in grads["eager"].items():
        torch.testing.assert_close(grads["flash"][name], want, atol=1e-10, rtol=1e-8)


def test_greedy_generation_past_the_window_equals_the_loop_without_cache():
    from oracle import greedy_no_cache

    model = _gemma2(seed=9)
    prompt = torch.randint(0, V, (5,), generator=torch.Generator().manual_seed(10)).tolist()
    assert model.generate(prompt, 20) == greedy_no_cache(model, prompt, 20)


@pytest.mark.slow
def test_generate_compile_equals_eager_generate_with_soft_caps():
    """The compiled decode step (static cache, both caps, the flash backend) past the
    window: the eager tokens, greedy and sampled, for one prompt and a left-padded batch."""
    torch._dynamo.reset()
    model = _gemma2(seed=11)
    prompts = [torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (9, 4)]  # fmt: skip
    assert model.generate(prompts[0], 20, compile=True) == model.generate(prompts[0], 20)
    assert model.generate(prompts, 20, compile=True) == model.generate(prompts, 20)
