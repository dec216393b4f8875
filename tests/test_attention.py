"""MultiHeadAttention (MHA / GQA / MQA, self and cross) against torch.nn.MultiheadAttention
with copied weights, GQA against MHA with repeated key/value heads, sliding windows against
the naive loop, QK-norm against its formula, and dropout in train vs eval mode.

Shapes: b batch, t query length, s key length, d d_model, h heads, h_kv key/value heads,
d_h head dim.
"""

from __future__ import annotations

import pytest
import torch
from oracle import head_norm, naive_attention, sliding_window_allowed
from torch import nn

from attnlab.config import AttentionConfig
from attnlab.functional.attention import available_backends
from attnlab.nn.attention import MultiHeadAttention

BACKENDS = ["eager", "sdpa"]
D, H = 32, 4
D_H = D // H


def _torch_mha(kdim: int | None = None) -> nn.MultiheadAttention:
    ref = nn.MultiheadAttention(D, H, bias=True, batch_first=True, kdim=kdim, vdim=kdim)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(std=0.3)  # random biases too (torch initialises them to zero)
    return ref.eval()


def _ours(backend: str, **kw) -> MultiHeadAttention:
    cfg = AttentionConfig(n_heads=H, qkv_bias=True, out_bias=True, backend=backend)
    return MultiHeadAttention(D, cfg, **kw).eval()


def _copy_self(ours: MultiHeadAttention, ref: nn.MultiheadAttention) -> None:
    with torch.no_grad():
        ours.qkv.weight.copy_(ref.in_proj_weight)  # rows [q; k; v], like in_proj_weight
        ours.qkv.bias.copy_(ref.in_proj_bias)
        ours.out.weight.copy_(ref.out_proj.weight)
        ours.out.bias.copy_(ref.out_proj.bias)


def _valid(b: int, s: int) -> torch.Tensor:
    valid = torch.ones(b, s, dtype=torch.bool)
    valid[1, :2] = False  # left padding on row 1
    valid[2, -3:] = False  # right padding on row 2
    return valid


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padding", [False, True])
def test_self_attention_matches_torch(backend, causal, padding):
    b, t = 3, 7
    ref, ours = _torch_mha(), _ours(backend, causal=causal)
    _copy_self(ours, ref)
    x = torch.randn(b, t, D)
    valid = _valid(b, t)
    attn_mask = torch.triu(torch.ones(t, t, dtype=torch.bool), 1) if causal else None  # True=block
    expected = ref(x, x, x, key_padding_mask=~valid if padding else None, attn_mask=attn_mask)[0]
    mask = valid[:, None, None, :] if padding else None
    out = ours(x, mask=mask)
    if padding and causal:
        # Row 1's first query sees only padding: torch gives NaN there, we give zeros.
        empty = ~(valid[:, None, :] & ~attn_mask).any(-1)  # (b, t)
        assert empty.any()  # the case this branch checks must really occur
        assert torch.isnan(expected[empty]).all()
        assert (out[empty] == ours.out.bias).all()
        expected, out = expected[~empty], out[~empty]
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("context_dim", [D, 24])
def test_cross_attention_matches_torch(backend, context_dim):
    b, t, s = 3, 5, 9
    kdim = None if context_dim == D else context_dim
    ref = _torch_mha(kdim=kdim)
    ours = _ours(backend, cross=True, context_dim=context_dim)
    with torch.no_grad():
        if kdim is None:  # one fused in_proj_weight of rows [q; k; v]
            ours.q.weight.copy_(ref.in_proj_weight[:D])
            ours.kv.weight.copy_(ref.in_proj_weight[D:])
        else:  # separate projections when key/value dims differ
            ours.q.weight.copy_(ref.q_proj_weight)
            ours.kv.weight.copy_(torch.cat((ref.k_proj_weight, ref.v_proj_weight)))
        ours.q.bias.copy_(ref.in_proj_bias[:D])
        ours.kv.bias.copy_(ref.in_proj_bias[D:])
        ours.out.weight.copy_(ref.out_proj.weight)
        ours.out.bias.copy_(ref.out_proj.bias)
    x, ctx = torch.randn(b, t, D), torch.randn(b, s, context_dim)
    valid = _valid(b, s)
    expected = ref(x, ctx, ctx, key_padding_mask=~valid)[0]
    out = ours(x, context=ctx, mask=valid[:, None, None, :])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # Cross-attention is never causal: with no mask it matches torch without a mask.
    torch.testing.assert_close(ours(x, context=ctx), ref(x, ctx, ctx)[0], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="needs a context"):
        ours(x)


def _gqa(n_kv_heads: int, backend: str, **kw) -> MultiHeadAttention:
    cfg = AttentionConfig(n_heads=H, n_kv_heads=n_kv_heads, qkv_bias=True, backend=backend)
    m = MultiHeadAttention(D, cfg, **kw).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(std=0.3)
    return m


def _repeated_as_mha(gqa: MultiHeadAttention, backend: str) -> MultiHeadAttention:
    """An MHA module whose key/value heads are the GQA heads repeated: query head j reads
    kv head j // (h / h_kv), i.e. repeat_interleave over heads."""
    h_kv = gqa.n_kv_heads
    group = H // h_kv
    mha = _gqa(H, backend, causal=gqa.causal)
    q_w, k_w, v_w = gqa.qkv.weight.split((D, h_kv * D_H, h_kv * D_H))
    q_b, k_b, v_b = gqa.qkv.bias.split((D, h_kv * D_H, h_kv * D_H))

    def rep(w: torch.Tensor) -> torch.Tensor:  # (h_kv * d_h, ...) -> (h * d_h, ...)
        return w.reshape(h_kv, D_H, *w.shape[1:]).repeat_interleave(group, 0).flatten(0, 1)

    with torch.no_grad():
        mha.qkv.weight.copy_(torch.cat((q_w, rep(k_w), rep(v_w))))
        mha.qkv.bias.copy_(torch.cat((q_b, rep(k_b), rep(v_b))))
        mha.out.load_state_dict(gqa.out.state_dict())
    return mha


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n_kv_heads", [2, 1])
def test_gqa_and_mqa_equal_mha_with_repeated_heads(backend, n_kv_heads):
    gqa = _gqa(n_kv_heads, backend, causal=True)
    assert gqa.qkv.weight.shape == (D + 2 * n_kv_heads * D_H, D)
    mha = _repeated_as_mha(gqa, backend)
    x = torch.randn(3, 6, D)
    valid = _valid(3, 6)
    for mask in (None, valid[:, None, None, :]):
        torch.testing.assert_close(gqa(x, mask=mask), mha(x, mask=mask), atol=1e-5, rtol=1e-5)
    # The pairing matters: tiling heads (repeat instead of repeat_interleave) differs.
    if n_kv_heads == 2:
        tiled = _gqa(H, backend, causal=True)
        k_w = gqa.qkv.weight[D : D + 2 * D_H]
        v_w = gqa.qkv.weight[D + 2 * D_H :]
        with torch.no_grad():
            tiled.load_state_dict(mha.state_dict())
            tiled.qkv.weight[D : 2 * D].copy_(k_w.repeat(2, 1))
            tiled.qkv.weight[2 * D :].copy_(v_w.repeat(2, 1))
        assert not torch.allclose(tiled(x), gqa(x), atol=1e-3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gqa_with_all_kv_heads_is_mha(backend):
    mha = _gqa(H, backend)
    explicit = MultiHeadAttention(
        D, AttentionConfig(n_heads=H, n_kv_heads=None, qkv_bias=True, backend=backend)
    ).eval()
    explicit.load_state_dict(mha.state_dict())
    x = torch.randn(2, 5, D)
    torch.testing.assert_close(mha(x), explicit(x))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", [1, 3, 20])
def test_sliding_window_matches_naive_loop(backend, window):
    cfg = AttentionConfig(n_heads=H, n_kv_heads=2, sliding_window=window, backend=backend)
    m = MultiHeadAttention(D, cfg).eval()
    x = torch.randn(2, 8, D)
    q, k, v = m.qkv(x).split((D, 2 * D_H, 2 * D_H), dim=-1)
    q = q.view(2, 8, H, D_H).transpose(1, 2)  # (b, h, t, d_h)
    k, v = (z.view(2, 8, 2, D_H).transpose(1, 2) for z in (k, v))  # (b, h_kv, t, d_h)
    y = naive_attention(q, k, v, sliding_window_allowed(8, 8, window))
    expected = m.out(y.transpose(1, 2).reshape(2, 8, D))
    torch.testing.assert_close(m(x), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_dropout_train_vs_eval(backend):
    cfg = AttentionConfig(n_heads=H, dropout=0.5, backend=backend)
    m = MultiHeadAttention(D, cfg)
    plain = MultiHeadAttention(D, AttentionConfig(n_heads=H, backend=backend))
    plain.load_state_dict(m.state_dict())
    x = torch.randn(2, 6, D)
    m.train()
    a, b = m(x), m(x)
    assert not torch.allclose(a, b)  # fresh dropout masks each call
    assert not torch.allclose(a, plain(x))
    m.eval()
    torch.testing.assert_close(m(x), plain.eval()(x))
    torch.testing.assert_close(m(x), m(x))


def test_residual_dropout_train_vs_eval():
    m = MultiHeadAttention(D, AttentionConfig(n_heads=H), resid_dropout=0.5)
    x = torch.randn(2, 6, D)
    m.train()
    y = m(x)
    zeros = (y == 0).float().mean()
    assert 0.3 < zeros < 0.7  # about half the outputs dropped
    m.eval()
    clean = m(x)
    kept = y != 0
    torch.testing.assert_close(y[kept], 2 * clean[kept])  # survivors scaled by 1 / (1 - p)


def test_rope_attention_needs_positions():
    from attnlab.nn.rope import RotaryEmbedding

    m = MultiHeadAttention(D, AttentionConfig(n_heads=H), rope=RotaryEmbedding(D_H))
    with pytest.raises(ValueError, match="needs positions"):
        m(torch.randn(1, 3, D))


@pytest.mark.parametrize("layout", ["split", "interleaved"])
def test_fused_qk_rotation_equals_rotating_each(layout):
    """The fast path rotates q and k as one tensor; the twin splits heads, then rotates."""
    from attnlab.nn.rope import RotaryEmbedding

    torch.manual_seed(0)
    rope = RotaryEmbedding(D_H, layout=layout)
    attn = MultiHeadAttention(D, AttentionConfig(n_heads=H, n_kv_heads=2), rope=rope)
    x = torch.randn(2, 5, D)
    tables = rope.tables(torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]]))  # per row
    qkv = attn.qkv(x)
    q, k, v = attn._project_self(qkv, tables)
    q_ref, k_ref, v_ref = qkv.split((attn.q_dim, attn.kv_dim, attn.kv_dim), dim=-1)
    q_ref = tables.rotate(attn._heads(q_ref, H))
    k_ref = tables.rotate(attn._heads(k_ref, 2))
    torch.testing.assert_close(q, q_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(k, k_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(v, attn._heads(v_ref, 2), rtol=0, atol=0)


def _rms_normed(x: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    """QK-norm written out over the last (d_h) dimension: x / sqrt(mean(x^2) + eps) * g."""
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["self-split", "self-interleaved", "cross"])
def test_qk_norm_equals_its_formula(case, backend):
    """Each query and key head is normalised over its d_h features by one weight per side
    (shared by the heads), then rotated (Qwen3: q_norm(q.view(..., d_h)) before RoPE): the
    module against that formula and the naive loop; eps large enough to matter."""
    from attnlab.nn.rope import RotaryEmbedding

    torch.manual_seed(0)
    eps, b, t, s, h_kv = 0.3, 2, 5, 7, 2
    cfg = AttentionConfig(n_heads=H, n_kv_heads=h_kv, qk_norm=True, backend=backend)
    cross, layout = case == "cross", case.partition("-")[2] or "split"
    rope = None if cross else RotaryEmbedding(D_H, layout=layout)
    attn = MultiHeadAttention(D, cfg, cross=cross, rope=rope, norm_eps=eps).eval()
    with torch.no_grad():
        for name in ("q_norm", "k_norm"):
            getattr(attn, name).weight.uniform_(0.5, 1.5)
    x = 2 * torch.randn(b, t, D)  # rms far from 1, so the norm and eps matter
    if cross:
        ctx = 2 * torch.randn(b, s, D)
        q, (k, v) = attn.q(x), attn.kv(ctx).split(h_kv * D_H, dim=-1)
    else:
        q, k, v = attn.qkv(x).split((D, h_kv * D_H, h_kv * D_H), dim=-1)
    q = _rms_normed(attn._heads(q, H), attn.q_norm.weight, eps)  # (b, h, t, d_h)
    k = _rms_normed(attn._heads(k, h_kv), attn.k_norm.weight, eps)  # (b, h_kv, s, d_h)
    v = attn._heads(v, h_kv)
    if cross:
        out = attn(x, context=ctx)
        allowed = None
    else:
        positions = torch.tensor([[0, 1, 2, 3, 4], [6, 7, 8, 9, 10]])
        tables = rope.tables(positions)
        q, k = tables.rotate(q), tables.rotate(k)
        out = attn(x, positions=positions)
        allowed = torch.ones(t, t, dtype=torch.bool).tril()
    y = naive_attention(q, k, v, allowed).to(x.dtype)  # (b, h, t, d_h)
    expected = attn.out(y.transpose(1, 2).reshape(b, t, D))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # the norms act: without them (weights 1, eps 0 would still normalise) the output differs
    plain = MultiHeadAttention(D, AttentionConfig(n_heads=H, n_kv_heads=h_kv), cross=cross,
                               rope=rope).eval()  # fmt: skip
    plain.load_state_dict(attn.state_dict(), strict=False)
    args = {"context": ctx} if cross else {"positions": positions}
    assert (plain(x, **args) - out).abs().max() > 1e-2


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["self-split", "self-interleaved", "cross"])
def test_qk_norm_over_whole_projections_equals_its_formula(case, backend):
    """QK-norm with scope "projection" (OLMo 2: q_norm(q_proj(x)) before the view into
    heads): all h d_h query features normalised at once by one weight of h d_h, all h_kv d_h
    key features by one of h_kv d_h, then split into heads and rotated; the module against
    that formula and the naive loop, GQA, eps large enough to matter. Per-head QK-norm
    (the weights' first head's part) gives other numbers."""
    from attnlab.nn.rope import RotaryEmbedding

    torch.manual_seed(0)
    eps, b, t, s, h_kv = 0.3, 2, 5, 7, 2
    cfg = AttentionConfig(n_heads=H, n_kv_heads=h_kv, qk_norm=True, qk_norm_scope="projection",
                          backend=backend)  # fmt: skip
    cross, layout = case == "cross", case.partition("-")[2] or "split"
    rope = None if cross else RotaryEmbedding(D_H, layout=layout)
    attn = MultiHeadAttention(D, cfg, cross=cross, rope=rope, norm_eps=eps).eval()
    assert attn.q_norm.weight.shape == (H * D_H,) and attn.k_norm.weight.shape == (h_kv * D_H,)
    with torch.no_grad():
        for name in ("q_norm", "k_norm"):
            getattr(attn, name).weight.uniform_(0.5, 1.5)
    # rms far from 1 and different per head, so the width the norm spans matters
    x = 2 * torch.randn(b, t, D)
    if cross:
        ctx = 2 * torch.randn(b, s, D)
        q, (k, v) = attn.q(x), attn.kv(ctx).split(h_kv * D_H, dim=-1)
    else:
        q, k, v = attn.qkv(x).split((D, h_kv * D_H, h_kv * D_H), dim=-1)
    q = attn._heads(_rms_normed(q, attn.q_norm.weight, eps), H)  # (b, h, t, d_h)
    k = attn._heads(_rms_normed(k, attn.k_norm.weight, eps), h_kv)  # (b, h_kv, s, d_h)
    v = attn._heads(v, h_kv)
    if cross:
        out = attn(x, context=ctx)
        allowed = None
    else:
        positions = torch.tensor([[0, 1, 2, 3, 4], [6, 7, 8, 9, 10]])
        tables = rope.tables(positions)
        q, k = tables.rotate(q), tables.rotate(k)
        out = attn(x, positions=positions)
        allowed = torch.ones(t, t, dtype=torch.bool).tril()
    y = naive_attention(q, k, v, allowed).to(x.dtype)  # (b, h, t, d_h)
    expected = attn.out(y.transpose(1, 2).reshape(b, t, D))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    per_head_cfg = AttentionConfig(n_heads=H, n_kv_heads=h_kv, qk_norm=True, backend=backend)
    per_head = MultiHeadAttention(D, per_head_cfg, cross=cross, rope=rope, norm_eps=eps).eval()
    state = attn.state_dict()
    for name in ("q_norm.weight", "k_norm.weight"):
        state[name] = state[name][:D_H]
    per_head.load_state_dict(state)
    args = {"context": ctx} if cross else {"positions": positions}
    assert (per_head(x, **args) - out).abs().max() > 1e-2


# QK-norm kinds beyond Qwen3's: (qk_norm_kind, qk_norm_bias, qk_norm_weight)
_QK_NORM_KINDS = {
    "phi-layernorm-bias": ("layernorm", True, "shared"),  # Phi's qk_layernorm
    "cohere-layernorm-per-head": ("layernorm", False, "per_head"),  # Command R+, StableLM
    "rmsnorm-per-head": ("rmsnorm", False, "per_head"),
}


@pytest.mark.parametrize("kind", list(_QK_NORM_KINDS))
@pytest.mark.parametrize("case", ["self-split", "self-interleaved-partial", "cross", "sinks"])
def test_qk_norm_kinds_equal_their_formula(case, kind):
    """A LayerNorm (with a bias) or a weight per head: each query and key head normalised
    over its d_h features by the oracle's loop (head_norm), then rotated (a partial rotation
    too), GQA, eps large enough to matter; self- and cross-attention, and the sinks' cached
    path. The module against that formula and the naive loop; cached decoding equals the
    full pass; a shared RMSNorm (Qwen3's) gives other numbers."""
    from attnlab.nn.rope import RotaryEmbedding

    torch.manual_seed(0)
    norm_kind, bias, weight = _QK_NORM_KINDS[kind]
    eps, b, t, s, h_kv = 0.3, 2, 5, 7, 2
    cfg = AttentionConfig(n_heads=H, n_kv_heads=h_kv, qk_norm=True, qk_norm_kind=norm_kind,
                          qk_norm_bias=bias, qk_norm_weight=weight, backend="eager")  # fmt: skip
    if case == "sinks":
        cfg = cfg.override({"sliding_window": 4, "sink_tokens": 1})
    cross = case == "cross"
    layout = "interleaved" if "interleaved" in case else "split"
    d_r = D_H // 2 if "partial" in case else D_H  # the features rotated
    rope = None if cross else RotaryEmbedding(d_r, layout=layout)
    attn = MultiHeadAttention(D, cfg, cross=cross, rope=rope, norm_eps=eps).eval()
    shapes = ((D_H,), (D_H,)) if weight == "shared" else ((H, D_H), (h_kv, D_H))
    assert (attn.q_norm.weight.shape, attn.k_norm.weight.shape) == shapes
    assert (attn.q_norm.bias is not None) == bias
    with torch.no_grad():
        for name in ("q_norm", "k_norm"):
            norm = getattr(attn, name)
            norm.weight.uniform_(0.5, 1.5)
            if bias:
                norm.bias.normal_()
    x = 2 * torch.randn(b, t, D) + 1  # mean and rms far from 0 and 1: centring and eps matter
    if cross:
        ctx = 2 * torch.randn(b, s, D) + 1
        q, (k, v) = attn.q(x), attn.kv(ctx).split(h_kv * D_H, dim=-1)
    else:
        q, k, v = attn.qkv(x).split((D, h_kv * D_H, h_kv * D_H), dim=-1)

    def normed(norm, y, n):
        return head_norm(attn._heads(y, n), norm.weight, norm.bias, eps, norm_kind)

    q, k = normed(attn.q_norm, q, H), normed(attn.k_norm, k, h_kv)  # (b, n, t or s, d_h)
    v = attn._heads(v, h_kv)
    positions = torch.arange(t)[None].expand(b, t)
    if cross:
        out = attn(x, context=ctx)
        allowed = None
    else:
        tables = rope.tables(positions)
        q, k = tables.rotate(q), tables.rotate(k)
        out = attn(x, positions=positions)
        allowed = torch.ones(t, t, dtype=torch.bool).tril()
        if case == "sinks":  # the first token and the last 3 positions
            allowed &= (torch.arange(t)[None] == 0) | (
                torch.arange(t)[None] > torch.arange(t)[:, None] - 3)  # fmt: skip
    y = naive_attention(q, k, v, allowed).to(x.dtype)  # (b, h, t, d_h)
    expected = attn.out(y.transpose(1, 2).reshape(b, t, D))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    if not cross:  # cached decoding: the norms before RoPE and the cache
        from attnlab.cache import Cache

        cache = Cache(b, t, dtype=x.dtype)
        cache.layers = [attn.new_cache_entry(cache)]
        steps = []
        for lo, hi in ((0, 2), *((j, j + 1) for j in range(2, t))):
            cache.begin(hi - lo)
            steps.append(attn(x[:, lo:hi], positions=positions[:, lo:hi], cache=cache.layers[0]))
            cache.commit()
        # (the sinks' cache rotates keys by their places in it: the full pass's past the window)
        n = cfg.sliding_window if case == "sinks" else t
        torch.testing.assert_close(torch.cat(steps, 1)[:, :n], out[:, :n], atol=1e-5, rtol=1e-5)
    qwen3 = MultiHeadAttention(D, AttentionConfig(n_heads=H, n_kv_heads=h_kv, qk_norm=True),
                               cross=cross, rope=rope, norm_eps=eps).eval()  # fmt: skip
    state = attn.state_dict()
    for name in ("q_norm", "k_norm"):
        state[f"{name}.weight"] = state[f"{name}.weight"].reshape(-1, D_H)[0]
        state.pop(f"{name}.bias", None)
    qwen3.load_state_dict(state)
    args = {"context": ctx} if cross else {"positions": positions}
    assert (qwen3(x, **args) - out).abs().max() > 1e-2


def test_eager_attention_keeps_float64():
    """The reference backend upcasts half precision for its softmax but never downcasts
    float64 (a float64 check then holds to 1e-12, not float32's 1e-7)."""
    from attnlab.functional.attention import attend

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 8, dtype=torch.float64, generator=g) for _ in range(3))
    scores = q @ k.transpose(-2, -1) / 8**0.5
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    expected = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
    out = attend(q, k, v, causal=True, backend="eager")
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


_FLOAT64_KINDS = {
    "gqa-rope": dict(n_heads=4, n_kv_heads=2, head_dim=4),
    "sink-logits": dict(n_heads=2, head_dim=4, sink_logits=True),
    "qk-norm": dict(n_heads=4, n_kv_heads=2, head_dim=4, qk_norm=True),
    "linear": dict(kind="linear", n_heads=2, head_dim=4),
    "mla-naive": dict(kind="mla", n_heads=2, kv_lora_rank=6, qk_nope_head_dim=3,
                      qk_rope_head_dim=4, v_head_dim=5, mla_path="naive"),
    "mla-absorbed": dict(kind="mla", n_heads=2, q_lora_rank=8, kv_lora_rank=6,
                         qk_nope_head_dim=3, qk_rope_head_dim=4, v_head_dim=5,
                         mla_path="absorbed"),
    "dsa": dict(kind="dsa", n_heads=2, q_lora_rank=8, kv_lora_rank=6, qk_nope_head_dim=3,
                qk_rope_head_dim=4, v_head_dim=5, index_topk=2, index_n_heads=2,
                index_head_dim=4),
    "nsa": dict(kind="nsa", n_heads=4, n_kv_heads=2, head_dim=4, nsa_block_len=2, nsa_stride=2,
                nsa_select_len=2, nsa_n_select=3, nsa_window=2),
}  # fmt: skip


@pytest.mark.parametrize("name", list(_FLOAT64_KINDS))
def test_float64_attention_passes_gradcheck(name):
    """A float64 module computes in float64 throughout: RoPE's rotation, the latent's
    RMSNorm and the sink rescaling rounded to float32 before, so
    finite differences (and any float64 reference) disagreed by 1e-3 relative."""
    from attnlab.config import ModelConfig
    from attnlab.models import build_model

    torch.manual_seed(0)
    cfg = ModelConfig.from_dict(
        dict(vocab_size=11, max_seq_len=8, d_model=10, n_layers=1,
             attention=_FLOAT64_KINDS[name], position=dict(kind="rope"))
    )  # fmt: skip
    model = build_model(cfg).double()
    attn = model.blocks[0].attn
    positions = torch.arange(4)[None].expand(2, 4)
    tables = model.rope.tables(positions)
    x = torch.randn(2, 4, cfg.d_model, dtype=torch.float64, requires_grad=True)
    assert attn(x, positions=positions, rope=tables).dtype == torch.float64
    assert torch.autograd.gradcheck(
        lambda x: attn(x, positions=positions, rope=tables), (x,), eps=1e-6, atol=1e-7
    )


def test_no_keys_give_zeros_in_every_backend():
    """s = 0 (nothing to attend to): zeros of the query's shape, as sdpa gives them (eager
    raised in amax)."""
    from attnlab.functional.attention import attend, available_backends

    q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 0, 4), torch.randn(1, 2, 0, 4)
    for backend in available_backends():
        if backend == "flex":
            continue  # flex builds block masks of at least one key block
        out = attend(q, k, v, backend=backend)
        assert torch.equal(out, torch.zeros(1, 2, 3, 4)), backend


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("low", [torch.finfo(torch.float32).min, -1e9])
def test_huge_finite_additive_mask_equals_eager_in_every_backend(dtype, low):
    """A float32 additive mask of finfo(float32).min or -1e9 (as Hugging Face builds them)
    with float16 queries: a cast to float16 made it -inf, so sdpa and flex gave zeros for a
    fully masked row (computing ``keep`` before the cast) where eager gives uniform weights."""
    from attnlab.functional.attention import attend, available_backends

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, n, 8).to(dtype) for n in (3, 5, 5))
    mask = torch.zeros(2, 1, 3, 5)
    mask[:, :, 0, :] = low  # every key masked (finite): eager's weights are uniform
    mask[:, :, 1, 2:] = low
    mask[1, :, 2, :] = float("-inf")  # -inf stays empty: zeros
    ref = attend(q, k, v, mask, backend="eager")
    assert torch.allclose(ref[:, :, 0].float(), v.float().mean(-2), atol=2e-3)
    for backend in available_backends():
        if backend == "flex" and dtype == torch.float16:  # refused by name, not guessed
            with pytest.raises(ValueError, match="flex attention: a mask row lies wholly"):
                attend(q, k, v, mask, backend=backend)
            continue
        out = attend(q, k, v, mask, backend=backend)
        assert out.dtype == dtype, backend
        # Each backend rounds its output to dtype once: they may differ by one ulp, eps
        # relative (float16's is 1.95e-3 from 2 to 4: seed 0's flash row sat at 0.97 atol)
        rtol = torch.finfo(dtype).eps
        assert torch.allclose(out.float(), ref.float(), rtol=rtol, atol=2e-3), backend


def test_sdpa_float16_row_offset_below_float16_range_matches_eager():
    """A row whose every finite value is below float16's range but does not swamp the
    float32 scores (-1e5): eager gives the softmax of the scores, not uniform weights."""
    from attnlab.functional.attention import attend

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 1, 3, 8).half() for _ in range(3))
    for offset in (-1e9, -1e5):
        m = torch.zeros(1, 1, 3, 3)
        m[..., 1, :] = offset
        m[..., 1, 2] = float("-inf")
        eager = attend(q, k, v, m, backend="eager").float()
        sdpa = attend(q, k, v, m, backend="sdpa").float()
        torch.testing.assert_close(sdpa, eager, atol=2e-3, rtol=2e-3)


# --------------------------------------------------------------------------- softmax scale


def _scaled(backend: str, scale: float | None, **kw) -> MultiHeadAttention:
    cfg = AttentionConfig(n_heads=H, n_kv_heads=2, backend=backend, scale=scale, **kw)
    torch.manual_seed(0)
    return MultiHeadAttention(D, cfg, causal=True).eval()


@pytest.mark.parametrize("backend", available_backends())
@pytest.mark.parametrize("window", [None, 3])
def test_attention_scale_is_every_backends_softmax_scale(backend, window):
    """``attention.scale`` (Gemma 3's query_pre_attn_scalar**-0.5) replaces 1 / sqrt(d_h) in
    every backend, with and without a window, and in a decoding cache (a ring for the
    window): the naive loop with that scale."""
    from attnlab.cache import Cache

    scale = 0.61  # about 1.7 / sqrt(d_h): far from the default
    m = _scaled(backend, scale, sliding_window=window)
    x = torch.randn(2, 7, D, generator=torch.Generator().manual_seed(1))
    q, k, v = m.qkv(x).split((D, D_H * 2, D_H * 2), dim=-1)
    q = q.view(2, 7, H, D_H).transpose(1, 2)  # (b, h, t, d_h)
    k, v = (t.view(2, 7, 2, D_H).transpose(1, 2) for t in (k, v))  # (b, h_kv, t, d_h)
    allowed = sliding_window_allowed(7, 7, window or 7)
    y = naive_attention(q, k, v, allowed, scale=scale)  # (b, h, t, d_h)
    want = m.out(y.transpose(1, 2).reshape(2, 7, D))
    with torch.no_grad():
        torch.testing.assert_close(m(x), want, atol=1e-5, rtol=1e-5)
        default = _scaled(backend, None, sliding_window=window)
        assert not torch.allclose(default(x), want, atol=1e-3)
        cache = Cache(2, 7, dtype=x.dtype)
        cache.layers = [m.new_cache_entry(cache)]
        steps = []
        for i in range(7):
            cache.begin(1)
            steps.append(m(x[:, i : i + 1], cache=cache.layers[0]))
            cache.commit()
        torch.testing.assert_close(torch.cat(steps, 1), want, atol=1e-5, rtol=1e-5)


def test_attention_scale_is_multi_head_attentions_only():
    from attnlab.config import ConfigError

    for kind in ("mla", "linear"):
        with pytest.raises(ConfigError, match=f"attention.scale: is implemented by "
                           f"attention.kind='mha' only, not '{kind}'"):  # fmt: skip
            AttentionConfig(kind=kind, scale=0.5).validate()
    with pytest.raises(ConfigError, match="attention.scale: must be > 0"):
        AttentionConfig(scale=0.0).validate()


def test_attention_scale_reaches_the_attention_sinks_cache():
    """StreamingLLM's sinks decode through their own cache (SinkKV.attend): the scale too,
    so decoding equals the full pass."""
    from attnlab.cache import Cache

    m = _scaled("eager", 0.61, sliding_window=4, sink_tokens=1)
    x = torch.randn(2, 9, D, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = m(x, positions=torch.arange(9))
        cache = Cache(2, 9, dtype=x.dtype)
        cache.layers = [m.new_cache_entry(cache)]
        steps = []
        for i in range(9):
            cache.begin(1)
            steps.append(m(x[:, i : i + 1], cache=cache.layers[0]))
            cache.commit()
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
