"""Learned sink logits against transformers' GPT-OSS attention (GptOssAttention, eager):
a sliding-window layer and a global one, with GQA, biases and YaRN RoPE with truncate=False
and its attention factor, left padding, gradients, and cached decoding (a ring of
sliding_window entries, dense keys) against the reference's full forward pass.

Shapes: b batch, t length, d d_model, h heads, h_kv key/value heads, d_h head dim.
"""

from __future__ import annotations

import pytest
import torch

from attnlab.cache import Cache
from attnlab.config import AttentionConfig, PositionConfig
from attnlab.functional.masks import padding_mask, positions_from_padding
from attnlab.nn.attention import MultiHeadAttention
from attnlab.nn.rope import RotaryEmbedding

D, H, H_KV, D_H, WINDOW, T = 32, 4, 2, 16, 5, 12
# d_h = 16 and 256 original positions put YaRN's ramp bounds at 0.16 and 2.49: truncate=False
# (gpt-oss) keeps them, truncate=True would round them to 0 and 3
YARN = dict(factor=8.0, beta_fast=32.0, beta_slow=1.0, original_max_position_embeddings=256)


def _gpt_oss(layer_type: str):
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import (
        GptOssAttention,
        GptOssRotaryEmbedding,
    )

    cfg = transformers.GptOssConfig(
        hidden_size=D,
        num_attention_heads=H,
        num_key_value_heads=H_KV,
        head_dim=D_H,
        num_hidden_layers=1,
        sliding_window=WINDOW,
        layer_types=[layer_type],
        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, truncate=False, **YARN),
        attention_bias=True,
        max_position_embeddings=2048,  # factor * original: no mismatch warning
        vocab_size=16,
        intermediate_size=8,
        num_local_experts=2,
        num_experts_per_tok=1,
    )
    cfg._attn_implementation = "eager"
    ref = GptOssAttention(cfg, 0)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(std=0.3)
        ref.sinks.normal_(std=1.5)
    return cfg, ref, GptOssRotaryEmbedding(cfg)


def _ours(ref, backend: str, window: int | None) -> MultiHeadAttention:
    cfg = AttentionConfig(
        n_heads=H,
        n_kv_heads=H_KV,
        head_dim=D_H,
        qkv_bias=True,
        out_bias=True,
        sink_logits=True,
        sliding_window=window,
        backend=backend,
    )
    pos = PositionConfig(
        kind="rope",
        rope_theta=150000.0,
        rope_scaling="yarn",
        rope_factor=YARN["factor"],
        rope_beta_fast=YARN["beta_fast"],
        rope_beta_slow=YARN["beta_slow"],
        rope_original_max_seq_len=YARN["original_max_position_embeddings"],
        rope_truncate=False,
    )
    ours = MultiHeadAttention(D, cfg, rope=RotaryEmbedding.from_config(D_H, pos))
    with torch.no_grad():
        ours.qkv.weight.copy_(torch.cat((ref.q_proj.weight, ref.k_proj.weight, ref.v_proj.weight)))
        ours.qkv.bias.copy_(torch.cat((ref.q_proj.bias, ref.k_proj.bias, ref.v_proj.bias)))
        ours.out.weight.copy_(ref.o_proj.weight)
        ours.out.bias.copy_(ref.o_proj.bias)
        ours.sink_logit.copy_(ref.sinks)
    return ours


@pytest.mark.parametrize("backend", ["eager", "sdpa", "flash"])
@pytest.mark.parametrize("layer_type", ["sliding_attention", "full_attention"])
def test_sink_logits_match_gpt_oss_attention(layer_type, backend):
    """Forward and gradients (inputs, sink logits) of a left-padded batch longer than the
    window, and a prefill then one token at a time through the cache, against transformers'
    full forward pass. Its sliding mask keeps keys k > q - w, as attnlab's window does."""
    cfg, ref, rotary = _gpt_oss(layer_type)  # skips without transformers
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    sliding = layer_type == "sliding_attention"
    ours = _ours(ref, backend, WINDOW if sliding else None)
    attention_mask = torch.ones(2, T, dtype=torch.long)
    attention_mask[1, :3] = 0  # left padding
    real = attention_mask.bool()
    positions = positions_from_padding(attention_mask, T)  # (b, t): pads do not count
    x = torch.randn(2, T, D, requires_grad=True)
    make_mask = create_sliding_window_causal_mask if sliding else create_causal_mask
    # positional arguments: the cache argument was renamed (past_key_values -> cache)
    mask = make_mask(cfg, x, attention_mask, None, allow_is_causal_skip=False)
    want, _ = ref(x, rotary(x, positions), mask)
    x_ours = x.detach().clone().requires_grad_(True)
    got = ours(x_ours, positions=positions, mask=padding_mask(attention_mask))
    tol = dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[real], want[real], **tol)

    grad = torch.randn_like(want) * real[..., None]  # pad rows' outputs are not compared
    (want * grad).sum().backward()
    (got * grad).sum().backward()
    # float32 sums of |values| about 10 over different orders: 1e-4 absolute
    torch.testing.assert_close(x_ours.grad, x.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ours.sink_logit.grad, ref.sinks.grad, atol=1e-4, rtol=1e-4)

    cache = Cache(2, T)
    cache.layers, cache.cross = [ours.new_cache_entry(cache)], [None]
    steps, start = [], 0
    with torch.no_grad():
        for n in [7] + [1] * (T - 7):  # the prefill fills more than the window
            step = cache.begin(n, attention_mask[:, start : start + n])
            x_step = x.detach()[:, start : start + n]
            steps.append(ours(x_step, positions=step.positions, cache=cache.layers[0]))
            cache.commit()
            start += n
    torch.testing.assert_close(torch.cat(steps, 1)[real], want.detach()[real], **tol)


# ------------------------------------------------ sink logits inside every attention backend

SINK_CASES = {  # name: (t, s, causal, window, key mask with an empty row, packed documents)
    "causal": (19, 19, True, None, False, False),
    "decode step": (1, 19, True, None, False, False),
    "window": (19, 19, True, 5, False, False),
    "chunk of a longer sequence, window": (7, 19, True, 4, False, False),
    "bidirectional, mask": (19, 19, False, None, True, False),
    "documents": (19, 19, True, None, False, True),
    "window, mask, documents": (19, 19, True, 3, True, True),
}


def _sink_inputs(t, s, causal, window, masked, docs, dtype=torch.float64):
    q = torch.randn(2, 4, t, 8, dtype=dtype, requires_grad=True)  # h = 4 query heads
    k, v = (torch.randn(2, 2, s, 8, dtype=dtype, requires_grad=True) for _ in range(2))
    sinks = (torch.randn(4, dtype=dtype) * 2).requires_grad_(True)
    mask = None
    if masked:
        mask = torch.rand(2, 1, t, s) > 0.3
        mask[0, 0, 0] = False  # a row with no key: all its weight goes to the sink
    doc_ids = torch.tensor([[0] * 6 + [1] * (s - 6), [0] * (s - 4) + [1] * 4]) if docs else None
    kw = dict(causal=causal, window=window, doc_ids=doc_ids, sinks=sinks)
    return (q, k, v, sinks), mask, kw


def _written_out(q, k, v, sinks, mask, *, causal, window, doc_ids):
    """softmax([z_1 .. z_s, sink_h]) with the sink's column dropped, times V: the definition,
    with the allowed keys spelled out position by position."""
    b, h, t, d_h = q.shape
    s = k.shape[2]
    k, v = k.repeat_interleave(h // k.shape[1], 1), v.repeat_interleave(h // v.shape[1], 1)
    q_pos, k_pos = torch.arange(s - t, s)[:, None], torch.arange(s)[None, :]
    allowed = torch.ones(b, h, t, s, dtype=torch.bool)
    if causal:
        allowed &= k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    if mask is not None:
        allowed &= mask
    if doc_ids is not None:
        allowed &= doc_ids[:, None, s - t :, None] == doc_ids[:, None, None, :]
    z = (q @ k.transpose(-1, -2) / d_h**0.5).masked_fill(~allowed, float("-inf"))
    column = sinks[None, :, None, None].expand(b, h, t, 1)
    return torch.cat((z, column), -1).softmax(-1)[..., :-1] @ v


@pytest.mark.parametrize("case", list(SINK_CASES))
@pytest.mark.parametrize("backend", ["eager", "sdpa", "flash", "flex"])
def test_every_backend_takes_sink_logits(backend, case):
    """attend(..., sinks=): the forward and the gradients of q, k, v and the sink logits
    equal the written-out extra column, float64. Flash runs with tiles small enough that
    rows cross several key blocks (the sink starts each row's online softmax); flex (no
    backward on CPU) rescales its output from its log-sum-exp."""
    from attnlab.functional.attention import attend
    from attnlab.functional.flash import flash_attention

    torch.manual_seed(0)
    inputs, mask, kw = _sink_inputs(*SINK_CASES[case])
    want = _written_out(*inputs, mask, **{n: kw[n] for n in ("causal", "window", "doc_ids")})
    tol = dict(atol=1e-12, rtol=1e-10)
    if backend == "flex":
        with torch.no_grad():
            got = attend(*inputs[:3], mask, backend="flex", **kw)
        torch.testing.assert_close(got, want, **tol)
        return
    if backend == "flash":
        got = flash_attention(*inputs[:3], mask, block_q=4, block_k=8, **kw)
    else:
        got = attend(*inputs[:3], mask, backend=backend, **kw)
    torch.testing.assert_close(got, want, **tol)
    grad = torch.randn_like(want)
    for g_got, g_want in zip(
        torch.autograd.grad(got, inputs, grad), torch.autograd.grad(want, inputs, grad)
    ):
        torch.testing.assert_close(g_got, g_want, **tol)


def test_sink_logits_returned_weights_are_the_keys_share():
    """Eager's weights with sinks: each row sums to 1 - sigmoid(sink - logsumexp(z)), the
    output is weights @ V, and a row with no key gives all its weight to the sink."""
    from attnlab.functional.attention import attend

    torch.manual_seed(0)
    (q, k, v, sinks), mask, kw = _sink_inputs(*SINK_CASES["bidirectional, mask"])
    out, w = attend(q, k, v, mask, backend="eager", return_weights=True, **kw)
    z = (q @ k.repeat_interleave(2, 1).transpose(-1, -2) / 8**0.5).masked_fill(~mask, -torch.inf)
    share = torch.sigmoid(z.logsumexp(-1) - sinks[:, None])  # (b, h, t)
    torch.testing.assert_close(w.sum(-1), share)
    torch.testing.assert_close(out, w @ v.repeat_interleave(2, 1))
    assert bool((w[0, :, 0] == 0).all()) and bool((out[0, :, 0] == 0).all())


@pytest.mark.parametrize(
    "sinks, match", [(torch.zeros(3), r"\(4,\)"), (torch.zeros(4, dtype=torch.long), "float")]
)
def test_sink_logits_of_the_wrong_shape_or_dtype_are_refused(sinks, match):
    from attnlab.functional.attention import attend

    q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    for backend in ("eager", "sdpa", "flash", "flex"):
        with pytest.raises(ValueError, match=match):
            attend(q, k, v, causal=True, backend=backend, sinks=sinks)


@pytest.mark.parametrize("backend", ["flash", "sdpa"])
@pytest.mark.parametrize("window", [None, 64])
def test_sink_logits_hold_no_t_by_s_matrix(backend, window):
    """flash: the sink column lives in the online softmax's starting state, and a window
    stays a window (its blocks skipped). sdpa on the CPU: the fused kernel's own
    log-sum-exp rescales its output, and its backward is handed the one with the sink. An
    attention layer with sink logits peaks about where it does without them (sdpa at
    t = 2048: 2.4 MiB against 2.1; 26 against 22 with a window, whose (t, s) mask both
    form). Rescaling the output
    by the scores' log-sum-exp afterwards (``sink_rescale``) formed the (t, s) scores: 133
    MiB against 13.9 at t = 2048 on flash (137 against 4.8 with a 64-key window)."""
    from attnlab.memory import PeakTensorMemory

    def peak(sink_logits):
        torch.manual_seed(0)
        cfg = AttentionConfig(
            n_heads=2, head_dim=16, sink_logits=sink_logits, sliding_window=window, backend=backend
        )
        attn = MultiHeadAttention(32, cfg)
        x = torch.randn(1, 2048, 32, requires_grad=True)
        with PeakTensorMemory() as mem:
            attn(x, positions=torch.arange(2048)[None]).sum().backward()
        return mem.peak

    with_sinks, without = peak(True), peak(False)
    # sdpa keeps the rescaled output beside the kernel's: one more (b, h, t, d_h) tensor
    assert with_sinks <= (1.05 if backend == "flash" else 1.2) * without
    assert with_sinks < 2 * 2048 * 2048 * 4  # the (t, s) scores of one head: 16 MiB


def test_sdpa_sink_logits_on_the_cpu_use_the_kernels_log_sum_exp(monkeypatch):
    """On the CPU the sdpa backend never calls the rescaling that forms the scores."""
    import attnlab.functional.attention as attention_module
    from attnlab.functional.attention import attend

    def refuse(*args, **kwargs):
        raise AssertionError("sink_rescale formed the (t, s) scores")

    monkeypatch.setattr(attention_module, "sink_rescale", refuse)
    (q, k, v, sinks), _, _ = _sink_inputs(13, 29, True, None, False, False)
    for p in (q, k, v, sinks):
        p.requires_grad_(True)
    y = attend(q, k, v, causal=True, backend="sdpa", sinks=sinks, window=7)
    y.square().sum().backward()
    assert all(p.grad is not None for p in (q, k, v, sinks))


@pytest.mark.parametrize("masked", [False, True])
def test_sink_rescaling_without_gradients_goes_by_blocks_of_rows(monkeypatch, masked):
    """Under no_grad (a prefill on a GPU, where the sdpa backend rescales its output with
    ``sink_rescale``) the scores are formed a few query rows at a time: the same result as
    all at once (float64, causal chunk of a longer sequence, a per-query mask), and a peak
    far below the (t, s) scores."""
    import attnlab.functional.sinks as sinks_module
    from attnlab.functional.attention import attend, sdpa_attention
    from attnlab.functional.sinks import sink_rescale
    from attnlab.memory import PeakTensorMemory

    torch.manual_seed(0)
    (q, k, v, sinks), _, _ = _sink_inputs(13, 29, True, None, False, False)
    mask = (torch.rand(2, 1, 13, 29) > 0.3) if masked else None
    with torch.no_grad():
        y = sdpa_attention(q, k, v, mask, causal=True)
        whole = sink_rescale(y, q, k, sinks, mask, causal=True)
        monkeypatch.setattr(sinks_module, "CHUNK_SCORES", 2 * 4 * 29 * 3)  # 3 rows a block
        blocks = sink_rescale(y, q, k, sinks, mask, causal=True)
    torch.testing.assert_close(blocks, whole, atol=1e-14, rtol=1e-12)
    eager = attend(q, k, v, mask, causal=True, backend="eager", sinks=sinks)
    torch.testing.assert_close(blocks, eager)

    monkeypatch.setattr(sinks_module, "CHUNK_SCORES", 2**16)
    q, k, v = (torch.randn(1, 4, 2048, 16) for _ in range(3))
    with torch.no_grad():
        y = sdpa_attention(q, k, v, causal=True)
        with PeakTensorMemory() as mem:
            sink_rescale(y, q, k, torch.zeros(4), causal=True)
    assert mem.peak < 2 * 2**20  # the (t, s) scores would be 64 MiB


def test_sdpa_sink_logits_compile_as_eager():
    """torch.compile (fullgraph) of the sdpa backend with sink logits on the CPU, whose
    autograd Function calls torch's CPU kernel and its backward: outputs and gradients equal
    the written-out column's (float32), causal with a window, grouped heads."""
    from attnlab.functional.attention import attend

    torch.manual_seed(0)
    (q, k, v, sinks), _, _ = _sink_inputs(11, 11, True, None, False, False, torch.float32)
    dy = torch.randn(2, 4, 11, 8)

    def sdpa(q, k, v, sinks):
        return attend(q, k, v, causal=True, window=4, backend="sdpa", sinks=sinks)

    compiled = torch.compile(sdpa, fullgraph=True, dynamic=False)

    def run(f):
        xs = [x.detach().clone().requires_grad_(True) for x in (q, k, v, sinks)]
        y = f(*xs)
        y.backward(dy)
        return [y, *(x.grad for x in xs)]

    def eager(q, k, v, sinks):
        return attend(q, k, v, causal=True, window=4, backend="eager", sinks=sinks)

    for got, want in zip(run(compiled), run(eager), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_sdpa_sink_logits_differentiate_a_learned_additive_mask():
    """torch's CPU kernel gives its mask no gradient, so an additive mask that requires one
    (a learned bias) takes the rescaling route: every gradient, the bias's too, is eager's
    (float64)."""
    from attnlab.functional.attention import attend

    torch.manual_seed(0)
    (q, k, v, sinks), _, _ = _sink_inputs(6, 6, True, None, False, False)
    bias = torch.randn(1, 4, 6, 6, dtype=torch.float64, requires_grad=True)
    grads = []
    for backend in ("sdpa", "eager"):
        xs = [x.detach().clone().requires_grad_(True) for x in (q, k, v, sinks, bias)]
        attend(*xs[:3], xs[4], causal=True, backend=backend, sinks=xs[3]).square().sum().backward()
        grads.append([x.grad for x in xs])
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize(
    "shape, copied",
    [((7, 40), True), ((7, 48), False), ((2, 1, 1, 40), True), ((2, 1, 1, 48), False),
     ((1, 3, 7, 48), False), ((7, 1), True), ((2, 3, 7, 40), True)],
    ids=str,
)  # fmt: skip
def test_aligned_bias_is_the_mask_as_the_cuda_kernel_reads_it(shape, copied):
    """The CUDA kernel's bias: the same values, broadcast to (b, h, t, s), last dimension
    contiguous, every other stride a multiple of 16 (0 for broadcast dimensions); copied
    only where the mask's own strides are not so."""
    from attnlab.functional.sinks import BIAS_ALIGN, aligned_bias

    mask = torch.randn(shape)
    full = (2, 3, 7, 48 if shape[-1] == 48 else 40)
    got = aligned_bias(mask, full)
    assert got.shape == full and torch.equal(got, mask.expand(full))
    assert got.stride(-1) == 1 and all(st % BIAS_ALIGN == 0 for st in got.stride()[:-1])
    assert (got.untyped_storage().data_ptr() != mask.untyped_storage().data_ptr()) == copied
