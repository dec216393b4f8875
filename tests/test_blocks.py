"""Feed-forward networks, norms, position embeddings and the transformer block, against
manual formulas, torch built-ins (nn.RMSNorm, nn.TransformerEncoderLayer /
TransformerDecoderLayer) and the oracle sinusoid loop.

Shapes: b batch, t length, d d_model.
"""

from __future__ import annotations

import math
import unittest.mock

import pytest
import torch
import torch.nn.functional as F
from oracle import sinusoid_table
from torch import nn

from attnlab import build_model
from attnlab.config import AttentionConfig, FFNConfig, ModelConfig, NormConfig, PositionConfig
from attnlab.nn import (
    MLP,
    GatedFFN,
    LearnedPositionalEmbedding,
    RMSNorm,
    SinusoidalPositionalEmbedding,
    TransformerBlock,
    build_ffn,
    build_norm,
)
from attnlab.nn.embedding import sinusoidal_table
from attnlab.presets import get_preset

D = 16


def _randomise(module: nn.Module, std: float = 0.3) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(std=std)


# Activations written from their definitions, not via torch.nn.functional.
MANUAL_ACT = {
    "relu": lambda x: torch.where(x > 0, x, torch.zeros_like(x)),
    "gelu": lambda x: 0.5 * x * (1 + torch.erf(x / math.sqrt(2))),
    "gelu_tanh": lambda x: (
        0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    ),
    "silu": lambda x: x / (1 + torch.exp(-x)),
    "sigmoid": lambda x: 1 / (1 + torch.exp(-x)),
}


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("bias", [True, False])
def test_mlp_matches_manual(activation, bias):
    m = MLP(D, 3 * D, activation, bias=bias)
    _randomise(m)
    x = torch.randn(2, 5, D)
    h = x @ m.up.weight.T + (m.up.bias if bias else 0)
    expected = MANUAL_ACT[activation](h) @ m.down.weight.T + (m.down.bias if bias else 0)
    torch.testing.assert_close(m(x), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("activation", ["sigmoid", "gelu", "silu"])  # GLU, GeGLU, SwiGLU
@pytest.mark.parametrize("bias", [True, False])
def test_gated_ffn_matches_manual(activation, bias):
    hidden = 24
    m = GatedFFN(D, hidden, activation, bias=bias)
    _randomise(m)
    x = torch.randn(2, 5, D)
    w_gate, w_up = m.gate_up.weight[:hidden], m.gate_up.weight[hidden:]  # rows [gate; up]
    b_gate, b_up = (m.gate_up.bias[:hidden], m.gate_up.bias[hidden:]) if bias else (0, 0)
    gated = MANUAL_ACT[activation](x @ w_gate.T + b_gate) * (x @ w_up.T + b_up)
    expected = gated @ m.down.weight.T + (m.down.bias if bias else 0)
    torch.testing.assert_close(m(x), expected, atol=1e-5, rtol=1e-5)


def _clamped_swiglu_by_hand(gate, up, alpha, limit):
    """GPT-OSS's activation written out: g = min(gate, limit), u = up clamped to
    [-limit, limit], g * sigmoid(alpha g) * (u + 1)."""
    g = torch.where(gate > limit, torch.full_like(gate, limit), gate)
    u = torch.where(up > limit, torch.full_like(up, limit), up)
    u = torch.where(u < -limit, torch.full_like(u, -limit), u)
    return g / (1 + torch.exp(-alpha * g)) * (u + 1)


@pytest.mark.parametrize("alpha, limit", [(1.702, 7.0), (0.9, 1.5)])
def test_clamped_swiglu_matches_its_formula_beyond_the_clamp(alpha, limit):
    """From -3 limit to 3 limit: the gate clamped above only (a large negative gate
    passes, its sigmoid near 0), the up projection both ways; against the formula and
    transformers' GPT-OSS experts' gate (its input interleaves gate and up)."""
    from attnlab.nn.feedforward import clamped_swiglu

    gate = torch.linspace(-3 * limit, 3 * limit, 121)
    up = torch.linspace(3 * limit, -3 * limit, 121)  # each beyond the clamp where the other is
    assert (gate > limit).any() and (up < -limit).any() and (up > limit).any()
    expected = _clamped_swiglu_by_hand(gate, up, alpha, limit)
    got = clamped_swiglu(gate, up, alpha, limit)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    beyond = (gate > limit) & (up < -limit)  # both clamped: min(g) sigmoid(.) (1 - limit)
    pinned = limit * torch.sigmoid(torch.tensor(alpha * limit)) * (1 - limit)
    torch.testing.assert_close(got[beyond], pinned.expand(int(beyond.sum())))
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    hf = GptOssExperts(transformers.GptOssConfig(hidden_size=8, intermediate_size=121,
                                                 num_local_experts=1, swiglu_alpha=alpha,
                                                 swiglu_limit=limit))  # fmt: skip
    interleaved = torch.stack((gate, up), dim=-1).flatten()  # gate0 up0 gate1 up1 ...
    torch.testing.assert_close(got, hf._apply_gate(interleaved), atol=1e-6, rtol=1e-6)
    # the clamp's gradient: 0 where clamped, the formula's elsewhere (float64 gradcheck
    # away from the kinks)
    inside = torch.tensor([-0.7, 0.3, 1.1]) * limit
    args = (inside.double().requires_grad_(), (-inside).double().requires_grad_())
    assert torch.autograd.gradcheck(lambda g, u: clamped_swiglu(g, u, alpha, limit), args)
    g, u = (gate.clone().requires_grad_(), up.clone().requires_grad_())
    clamped_swiglu(g, u, alpha, limit).sum().backward()
    assert not g.grad[gate > limit].any() and not u.grad[up.abs() > limit].any()


@pytest.mark.parametrize("bias", [True, False])
def test_gated_ffn_with_clamped_swiglu_matches_manual(bias):
    """ffn.activation 'clamped_swiglu' (gated kinds only): W_down glu(W_gate x, W_up x)
    with the config's alpha and limit, which the projections' values pass."""
    cfg = FFNConfig(kind="glu", activation="clamped_swiglu", hidden_dim=24, bias=bias,
                    swiglu_alpha=1.3, swiglu_limit=0.8)  # fmt: skip
    m = build_ffn(cfg, D)
    _randomise(m)
    x = torch.randn(2, 5, D)
    w_gate, w_up = m.gate_up.weight[:24], m.gate_up.weight[24:]  # rows [gate; up]
    b_gate, b_up = (m.gate_up.bias[:24], m.gate_up.bias[24:]) if bias else (0, 0)
    gate, up = x @ w_gate.T + b_gate, x @ w_up.T + b_up
    assert gate.max() > 0.8 and up.abs().max() > 0.8
    hidden = _clamped_swiglu_by_hand(gate, up, 1.3, 0.8)
    expected = hidden @ m.down.weight.T + (m.down.bias if bias else 0)
    torch.testing.assert_close(m(x), expected, atol=1e-5, rtol=1e-5)


def test_clamped_swiglu_needs_a_gated_feed_forward():
    from attnlab.config import ConfigError

    with pytest.raises(ConfigError, match=r"ffn.activation: 'clamped_swiglu' gates an up "
                       r"projection: use ffn.kind 'glu' or 'moe'"):  # fmt: skip
        FFNConfig.from_dict({"kind": "mlp", "activation": "clamped_swiglu"})
    with pytest.raises(ConfigError, match=r"ffn.swiglu_limit: must be > 0, got 0"):
        FFNConfig.from_dict({"kind": "glu", "activation": "clamped_swiglu", "swiglu_limit": 0})
    with pytest.raises(ConfigError, match=r"ffn.swiglu_alpha: must be finite"):
        FFNConfig.from_dict({"kind": "glu", "swiglu_alpha": float("inf")})
    # an encoder's masked-LM head applies the activation to one projection
    from attnlab.models.encoder import EncoderConfig

    with pytest.raises(ConfigError, match=r"ffn.activation: 'clamped_swiglu' gates two"):
        ffn = {"kind": "glu", "activation": "clamped_swiglu"}
        EncoderConfig.from_dict({"arch": "encoder", "head": "mlm", "ffn": ffn})


def test_build_ffn_picks_class_and_size():
    mlp = build_ffn(FFNConfig(kind="mlp", activation="relu"), D)
    assert isinstance(mlp, MLP) and mlp.up.out_features == 4 * D
    glu = build_ffn(FFNConfig(kind="glu", activation="silu", multiple_of=32, bias=False), 96)
    hidden = FFNConfig(kind="glu", multiple_of=32).hidden_size(96)
    assert isinstance(glu, GatedFFN) and glu.hidden == hidden and hidden % 32 == 0
    assert glu.gate_up.weight.shape == (2 * hidden, 96) and glu.gate_up.bias is None


def test_ffn_dropout_train_only():
    m = MLP(D, 4 * D, dropout=0.5)
    x = torch.randn(4, 8, D)
    m.train()
    assert ((m(x) == 0).float().mean() - 0.5).abs() < 0.15
    m.eval()
    assert (m(x) != 0).all()


# --------------------------------------------------------------------------- norms


@pytest.mark.parametrize("eps", [1e-6, 1e-2])
def test_rmsnorm_matches_formula_and_torch(eps):
    norm = RMSNorm(D, eps=eps)
    _randomise(norm)
    x = torch.randn(3, 4, D) * 3
    rms = torch.sqrt((x * x).sum(-1, keepdim=True) / D + eps)
    torch.testing.assert_close(norm(x), x / rms * norm.weight)
    if hasattr(nn, "RMSNorm"):
        ref = nn.RMSNorm(D, eps=eps)
        with torch.no_grad():
            ref.weight.copy_(norm.weight)
        torch.testing.assert_close(norm(x), ref(x))


def test_rmsnorm_bf16_keeps_dtype():
    norm = RMSNorm(D)
    x = torch.randn(2, D) * 100
    y = norm.bfloat16()(x.bfloat16())  # a model cast to bf16
    assert y.dtype == torch.bfloat16
    # Output rounding to bf16 only (~2^-8 relative).
    torch.testing.assert_close(y.float(), RMSNorm(D)(x), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rmsnorm_half_precision_matches_the_formula_in_float32(dtype):
    """A half-precision norm normalises in float32 and scales by its weight in its own
    dtype, as LLaMA's: w * (x / sqrt(mean(x^2) + eps)).to(dtype). A random weight and
    inputs of 1e-3, where mean(x^2) is about eps, so both show."""
    norm = RMSNorm(D, eps=1e-6)
    _randomise(norm)
    norm = norm.to(dtype)
    x = (torch.randn(3, 4, D) * 1e-3).to(dtype)
    xf = x.float()
    want = (xf / torch.sqrt((xf * xf).mean(-1, keepdim=True) + 1e-6)).to(dtype) * norm.weight
    y = norm(x)
    assert y.dtype == dtype
    # one rounding to dtype apart at most (F.rms_norm's float32 sums against the formula's)
    torch.testing.assert_close(y, want, atol=1e-3, rtol=2**-7)


def test_rmsnorm_float64_stays_float64():
    """A float64 model normalises in float64 (an upcast to float32, never a downcast): exact
    to float64 rounding, and gradcheck holds."""
    norm = RMSNorm(D).double()
    _randomise(norm)
    x = torch.randn(3, D, dtype=torch.float64) * 1e3 + 1.0
    want = x / torch.sqrt((x * x).mean(-1, keepdim=True) + norm.eps) * norm.weight
    y = norm(x)
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
    xg = torch.randn(2, D, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(norm, (xg,))
    # float64 input through float32 weights: still normalised in float64
    y32 = RMSNorm(D)(x)
    torch.testing.assert_close(y32, x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6))


def test_build_norm():
    ln = build_norm(NormConfig(kind="layernorm", eps=1e-3, bias=False), D)
    assert isinstance(ln, nn.LayerNorm) and ln.eps == 1e-3 and ln.bias is None
    rms = build_norm(NormConfig(kind="rmsnorm", eps=1e-4), D)
    assert isinstance(rms, RMSNorm) and rms.eps == 1e-4 and not rms.unit_offset
    gemma = build_norm(NormConfig(kind="gemma_rmsnorm", eps=1e-4), D)
    assert isinstance(gemma, RMSNorm) and gemma.eps == 1e-4 and gemma.unit_offset


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_gemma_rmsnorm_scales_by_one_plus_its_weight_in_float32(dtype):
    """Gemma's RMSNorm: x / sqrt(mean(x^2) + eps) * (1 + w), the product formed in float32
    (float64 kept) and then cast to x's dtype, as transformers' Gemma3RMSNorm (its weight
    starts at zero: the identity scale). Offsets of 1e-3, which 1 + w in bf16 cannot hold:
    a plain RMSNorm given 1 + w in the model's dtype is not the same norm."""
    norm = RMSNorm(D, eps=1e-6, unit_offset=True)
    assert torch.equal(norm.weight, torch.zeros(D))
    with torch.no_grad():
        norm.weight.copy_(1e-3 * torch.randn(D) + torch.linspace(-0.5, 2.0, D))
    norm = norm.to(dtype)
    x = (torch.randn(3, 4, D) * 3).to(dtype)
    up = torch.float64 if dtype == torch.float64 else torch.float32
    xf = x.to(up)
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
    want = (normed * (1.0 + norm.weight.to(up))).to(dtype)
    y = norm(x)
    assert y.dtype == dtype
    exact = dtype in (torch.bfloat16, torch.float16)  # float32 products, one final rounding
    tol = {} if exact else {"atol": 1e-6, "rtol": 1e-6}  # (fused kernel vs the formula)
    torch.testing.assert_close(y, want, **({"atol": 0, "rtol": 0} if exact else tol))
    if dtype == torch.bfloat16:
        plain = RMSNorm(D, eps=1e-6).to(dtype)
        with torch.no_grad():
            plain.weight.copy_(1.0 + norm.weight.float())  # rounds to bf16
        assert not torch.equal(plain(x), want)


# --------------------------------------------------------------------------- embeddings


def test_sinusoidal_table_matches_loop():
    for d in (8, 64):
        expected = sinusoid_table(50, d).float()
        torch.testing.assert_close(sinusoidal_table(torch.arange(50), d), expected)
    emb = SinusoidalPositionalEmbedding(8)
    pos = torch.tensor([[0, 3, 7], [10, 11, 12]])
    torch.testing.assert_close(emb(pos), sinusoid_table(13, 8).float()[pos])


def test_sinusoidal_table_at_far_positions_is_float32_rounding_of_the_float64_one():
    """Positions up to 32k: each float32 value within float32's rounding of the float64 table
    (6e-8, a half ulp of a value up to 1). Angles formed in float32 were off by up to
    p * 6e-8 (1e-3 here), and the sines with them."""
    g = torch.Generator().manual_seed(0)
    pos = torch.randint(0, 32768, (64,), generator=g)
    d = 16
    w = [10000 ** (-2 * j / d) for j in range(d // 2)]
    want = torch.tensor(
        [[f(p * x) for x in w for f in (math.sin, math.cos)] for p in pos.tolist()],
        dtype=torch.float64,
    )
    got = sinusoidal_table(pos, d)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=0, atol=6e-8)


def test_sinusoidal_positions_refuse_an_odd_width():
    """Sines and cosines come in pairs: an odd d_model gave d_model + 1 columns, not the
    (b, t, d) the embedding promises."""
    with pytest.raises(ValueError, match="d_model must be even, got 5"):
        SinusoidalPositionalEmbedding(5)
    with pytest.raises(ValueError, match="d_model must be even, got 7"):
        sinusoidal_table(torch.arange(4), 7)


def test_sinusoidal_positions_of_a_float64_model_are_float64():
    """A float64 model adds float64 sinusoids (they were float32 values, off by ~1e-7 from
    the float64 loop), in the decoder as in the table function."""
    expected = sinusoid_table(3000, 8)
    got = sinusoidal_table(torch.arange(3000), 8, torch.float64)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    model = build_model(
        ModelConfig(d_model=8, n_layers=1, attention=AttentionConfig(n_heads=2),
                    position=PositionConfig(kind="sinusoidal"))
    ).double()  # fmt: skip
    idx = torch.tensor([[1, 2, 3]])
    seen = {}
    model.blocks.register_forward_pre_hook(lambda mod, args: seen.setdefault("x", args[0]))
    model(idx)
    torch.testing.assert_close(
        seen["x"][0], model.tok_emb.weight[idx[0]] + expected[:3], rtol=1e-12, atol=1e-12
    )


def test_learned_positional_embedding_is_one_hot_times_table_and_trains_used_rows():
    emb = LearnedPositionalEmbedding(10, D)
    pos = torch.tensor([[0, 4, 9], [4, 4, 1]])
    one_hot = torch.nn.functional.one_hot(pos, 10).float()  # (b, t, 10)
    torch.testing.assert_close(emb(pos), one_hot @ emb.weight)
    emb(pos).sum().backward()
    used = torch.zeros(10, dtype=torch.bool)
    used[pos.flatten()] = True
    assert (emb.weight.grad[~used] == 0).all() and (emb.weight.grad[used] != 0).all()
    # row 4 appears three times: its gradient is three times that of a row used once
    torch.testing.assert_close(emb.weight.grad[4], 3 * emb.weight.grad[0])


# --------------------------------------------------------------------------- block


def _cfg(placement: str, **kw) -> ModelConfig:
    return ModelConfig(
        vocab_size=32,
        max_seq_len=16,
        d_model=D,
        n_layers=1,
        attention=AttentionConfig(n_heads=4, qkv_bias=True, out_bias=True),
        position=PositionConfig(kind="none"),
        ffn=FFNConfig(kind="mlp", activation="relu", bias=True, hidden_dim=3 * D),
        norm=NormConfig(kind="layernorm", placement=placement),
        **kw,
    )


@pytest.mark.parametrize("placement", ["pre", "post"])
def test_block_is_the_composition_of_its_submodules(placement):
    blk = TransformerBlock(_cfg(placement)).eval()
    _randomise(blk)
    x = torch.randn(2, 6, D)
    a, f = blk.attn, blk.ffn
    if placement == "pre":  # x + f(norm(x))
        h = x + a(blk.attn_norm(x))
        expected = h + f(blk.ffn_norm(h))
    else:  # norm(x + f(x))
        h = blk.attn_norm(x + a(x))
        expected = blk.ffn_norm(h + f(h))
    torch.testing.assert_close(blk(x), expected)
    assert blk.attn_post_norm is None and blk.ffn_post_norm is None
    other = TransformerBlock(_cfg("post" if placement == "pre" else "pre")).eval()
    other.load_state_dict(blk.state_dict())
    assert not torch.allclose(other(x), expected, atol=1e-3)


@pytest.mark.parametrize("kind", ["gemma_rmsnorm", "layernorm"])
def test_sandwich_block_norms_each_sublayer_before_and_after(kind):
    """Sandwich norms (Gemma 2 and 3): x + post_norm(f(pre_norm(x))) for attention and the
    feed-forward, four norms of their own; the same weights as pre-norm (post-norms left
    out) give other numbers."""
    cfg = _cfg("sandwich").override({"norm.kind": kind})
    blk = TransformerBlock(cfg).eval()
    _randomise(blk)
    names = [n for n, _ in blk.named_parameters() if "norm" in n]
    assert {n.split(".")[0] for n in names} == {
        "attn_norm", "attn_post_norm", "ffn_norm", "ffn_post_norm"
    }  # fmt: skip
    x = torch.randn(2, 6, D)
    h = x + blk.attn_post_norm(blk.attn(blk.attn_norm(x)))
    expected = h + blk.ffn_post_norm(blk.ffn(blk.ffn_norm(h)))
    torch.testing.assert_close(blk(x), expected)
    pre = TransformerBlock(_cfg("pre").override({"norm.kind": kind})).eval()
    pre.load_state_dict(blk.state_dict(), strict=False)
    assert not torch.allclose(pre(x), expected, atol=1e-3)


@pytest.mark.parametrize("kind", ["rmsnorm", "layernorm"])
def test_post_sublayer_block_norms_each_sublayers_output_only(kind):
    """Post-sublayer norms (OLMo 2): x + post_norm(f(x)) for attention and the feed-forward,
    no norm before either (two norms in all, attn_norm and ffn_norm None); the same
    weights in a sandwich block with its pre-norms taken out give the same numbers, and in
    a post-norm block (the norm after the residual add) others."""
    cfg = _cfg("post_sublayer").override({"norm.kind": kind})
    blk = TransformerBlock(cfg).eval()
    _randomise(blk)
    names = [n for n, _ in blk.named_parameters() if "norm" in n]
    assert {n.split(".")[0] for n in names} == {"attn_post_norm", "ffn_post_norm"}
    assert blk.attn_norm is None and blk.ffn_norm is None
    x = torch.randn(2, 6, D)
    h = x + blk.attn_post_norm(blk.attn(x))
    expected = h + blk.ffn_post_norm(blk.ffn(h))
    torch.testing.assert_close(blk(x), expected)
    sandwich = TransformerBlock(_cfg("sandwich").override({"norm.kind": kind})).eval()
    sandwich.load_state_dict(blk.state_dict(), strict=False)
    sandwich.attn_norm = sandwich.ffn_norm = nn.Identity()  # (a norm of weight 1 still scales)
    torch.testing.assert_close(sandwich(x), expected)
    post = TransformerBlock(_cfg("post").override({"norm.kind": kind})).eval()
    post.attn_norm.load_state_dict(blk.attn_post_norm.state_dict())
    post.ffn_norm.load_state_dict(blk.ffn_post_norm.state_dict())
    post.load_state_dict(blk.state_dict(), strict=False)
    assert not torch.allclose(post(x), expected, atol=1e-3)


@pytest.mark.parametrize("placement", ["sandwich", "post_sublayer"])
def test_sandwich_and_post_sublayer_placements_are_the_decoders_only(placement):
    """Other architectures build their own final norms and blocks: refused by name."""
    from attnlab.config import ConfigError
    from attnlab.models.encoder import EncoderConfig

    with pytest.raises(ConfigError, match=rf"norm.placement: '{placement}' is implemented by "
                       r"the decoder architecture only, not 'encoder'"):  # fmt: skip
        EncoderConfig(norm=NormConfig(placement=placement)).validate()


def _parallel_by_hand(blk: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x + attn(norm(x)) + ffn(norm'(x)) written out: LayerNorm, causal multi-head softmax
    attention (a per-query loop) and the GELU MLP from the block's weights."""
    from oracle import causal_allowed, naive_attention

    def layer_norm(ln: nn.Module) -> torch.Tensor:
        mu, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
        return (x - mu) / torch.sqrt(var + ln.eps) * ln.weight + ln.bias

    shared = blk.norm is not None
    h_attn = layer_norm(blk.norm if shared else blk.attn_norm)
    h_ffn = layer_norm(blk.norm if shared else blk.ffn_norm)
    b, t, _ = x.shape
    qkv = h_attn @ blk.attn.qkv.weight.T + blk.attn.qkv.bias  # (b, t, 3 d)
    q, k, v = (z.view(b, t, 4, D // 4).transpose(1, 2) for z in qkv.split(D, -1))
    heads = naive_attention(q, k, v, causal_allowed(t, t)).to(x.dtype)  # (b, h, t, d_h)
    attn = heads.transpose(1, 2).reshape(b, t, D) @ blk.attn.out.weight.T + blk.attn.out.bias
    hidden = F.gelu(h_ffn @ blk.ffn.up.weight.T + blk.ffn.up.bias)
    return x + attn + hidden @ blk.ffn.down.weight.T + blk.ffn.down.bias


@pytest.mark.parametrize("placement", ["parallel", "parallel_shared"])
def test_parallel_block_is_x_plus_attention_plus_ffn_of_its_input(placement):
    """GPT-NeoX's block (two norms) and Phi's (one shared norm): both sublayers read the
    block's input, x + attn(norm(x)) + ffn(norm'(x)), as written out by hand; a sequential
    pre-norm block with the same weights gives other numbers."""
    from attnlab.nn import ParallelTransformerBlock
    from attnlab.nn.block import TransformerStack

    cfg = _cfg(placement).override({"ffn.activation": "gelu"})
    blk = ParallelTransformerBlock(cfg).eval()
    _randomise(blk)
    with torch.no_grad():  # LayerNorm weights near 1, so that the norm matters
        for name, p in blk.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.add_(1.0)
    norms = {n.split(".")[0] for n, _ in blk.named_parameters() if "norm" in n}
    assert norms == ({"norm"} if placement == "parallel_shared" else {"attn_norm", "ffn_norm"})
    x = torch.randn(3, 7, D)
    with torch.no_grad():
        torch.testing.assert_close(blk(x), _parallel_by_hand(blk, x), atol=1e-5, rtol=1e-5)
        assert isinstance(TransformerStack(cfg)[0], ParallelTransformerBlock)
        # Granite's residual_multiplier scales both branches: x + m (attn + ffn)
        scaled = ParallelTransformerBlock(cfg.override({"residual_multiplier": 0.3})).eval()
        scaled.load_state_dict(blk.state_dict())
        expected = x + 0.3 * (_parallel_by_hand(blk, x) - x)
        torch.testing.assert_close(scaled(x), expected, atol=1e-5, rtol=1e-5)
        if placement == "parallel":
            pre = TransformerBlock(_cfg("pre").override({"ffn.activation": "gelu"})).eval()
            pre.load_state_dict(blk.state_dict())
            assert not torch.allclose(pre(x), blk(x), atol=1e-3)


def test_parallel_blocks_refuse_what_they_do_not_build():
    """No cross-attention (encoder-decoders), no other architecture, no other placement:
    refused by name."""
    from attnlab.config import ConfigError
    from attnlab.models.encoder import EncoderConfig
    from attnlab.nn import ParallelTransformerBlock

    with pytest.raises(ValueError, match="parallel blocks have no cross-attention"):
        ParallelTransformerBlock(_cfg("parallel"), cross_attention=True)
    with pytest.raises(ValueError, match="a parallel block needs norm.placement parallel or"):
        ParallelTransformerBlock(_cfg("pre"))
    with pytest.raises(ConfigError, match=r"norm.placement: 'parallel_shared' is implemented "
                       r"by the decoder architecture only, not 'encoder'"):  # fmt: skip
        EncoderConfig(norm=NormConfig(placement="parallel_shared")).validate()
    with pytest.raises(ConfigError, match=r"norm.placement: 'parallel' is implemented by the "
                       r"decoder architecture only, not 'seq2seq'"):  # fmt: skip
        ModelConfig.from_dict({"arch": "seq2seq", "norm": {"placement": "parallel"}})


@pytest.mark.parametrize("placement", ["parallel", "parallel_shared"])
@torch.no_grad()
def test_parallel_decoder_decodes_pads_and_packs_like_full_passes(placement):
    """A decoder of parallel blocks (pythia-tiny's, or with one shared norm): cached
    decoding equals the full pass and greedy generation re-running the whole sequence; a
    left-padded row equals the row alone; packed documents equal each document alone."""
    from oracle import greedy_no_cache

    torch.manual_seed(0)
    cfg = get_preset("pythia-tiny").override({"norm.placement": placement, "vocab_size": 64})
    model = build_model(cfg).eval()
    _randomise(model, std=0.1)
    idx = torch.randint(0, 64, (2, 14), generator=torch.Generator().manual_seed(1))
    full = model(idx).logits
    cache = model.new_cache(2, 20)
    steps = [model(idx[:, :6], cache=cache).logits]
    steps += [model(idx[:, i : i + 1], cache=cache).logits for i in range(6, 14)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
    prompt = idx[0, :5].tolist()
    assert model.generate(prompt, 10) == greedy_no_cache(model, prompt, 10)
    padded = torch.cat([torch.zeros(1, 4, dtype=torch.long), idx[1:, :10]], 1)
    mask = (torch.arange(14) >= 4).long()[None]
    alone = model(idx[1:, :10]).logits
    torch.testing.assert_close(model(padded, attention_mask=mask).logits[:, 4:], alone,
                               atol=1e-5, rtol=1e-5)  # fmt: skip
    docs = torch.tensor([[0] * 6 + [1] * 8])
    packed = model(idx[:1], doc_ids=docs).logits
    torch.testing.assert_close(packed[:, 6:], model(idx[:1, 6:]).logits, atol=1e-5, rtol=1e-5)


def test_parallel_decoder_passes_expert_statistics_through():
    """Experts in parallel blocks: the balance loss counts real tokens only, as in
    sequential blocks (the blocks hand real_tokens to the feed-forward)."""
    cfg = get_preset("pythia-tiny").override(
        {"ffn.kind": "moe", "ffn.router": "deepseek-v2", "ffn.n_shared_experts": 0,
         "ffn.switch_aux_loss_coef": 0.01, "ffn.moe_hidden_dim": 32, "vocab_size": 64}
    )  # fmt: skip
    torch.manual_seed(0)
    model = build_model(cfg)
    idx = torch.randint(1, 64, (2, 8), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(idx)
    mask[0, :3] = 0
    out = model(idx, attention_mask=mask, targets=idx)
    assert out.aux_loss is not None and out.aux_loss > 0
    changed = idx.clone()
    changed[0, :3] = 5  # other pads: the same statistics
    again = model(changed, attention_mask=mask, targets=idx)
    torch.testing.assert_close(again.aux_loss, out.aux_loss)


def _copy_encoder_layer(blk: TransformerBlock, ref: nn.Module) -> None:
    with torch.no_grad():
        blk.attn.qkv.weight.copy_(ref.self_attn.in_proj_weight)
        blk.attn.qkv.bias.copy_(ref.self_attn.in_proj_bias)
        blk.attn.out.load_state_dict(ref.self_attn.out_proj.state_dict())
        blk.ffn.up.load_state_dict(ref.linear1.state_dict())
        blk.ffn.down.load_state_dict(ref.linear2.state_dict())
        blk.attn_norm.load_state_dict(ref.norm1.state_dict())
        blk.ffn_norm.load_state_dict(ref.norm2.state_dict())


@pytest.mark.parametrize("placement", ["pre", "post"])
def test_block_matches_torch_encoder_layer(placement):
    ref = nn.TransformerEncoderLayer(
        D, 4, dim_feedforward=3 * D, dropout=0.0, batch_first=True, norm_first=placement == "pre"
    ).eval()
    _randomise(ref)
    blk = TransformerBlock(_cfg(placement)).eval()
    _copy_encoder_layer(blk, ref)
    x = torch.randn(2, 6, D)
    causal = nn.Transformer.generate_square_subsequent_mask(6)
    torch.testing.assert_close(blk(x), ref(x, src_mask=causal), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("placement", ["pre", "post"])
def test_cross_attention_block_matches_torch_decoder_layer(placement):
    ref = nn.TransformerDecoderLayer(
        D, 4, dim_feedforward=3 * D, dropout=0.0, batch_first=True, norm_first=placement == "pre"
    ).eval()
    _randomise(ref)
    blk = TransformerBlock(_cfg(placement), cross_attention=True).eval()
    _copy_encoder_layer(blk, ref)
    with torch.no_grad():
        w, b = ref.multihead_attn.in_proj_weight, ref.multihead_attn.in_proj_bias
        blk.cross_attn.q.weight.copy_(w[:D])
        blk.cross_attn.q.bias.copy_(b[:D])
        blk.cross_attn.kv.weight.copy_(w[D:])
        blk.cross_attn.kv.bias.copy_(b[D:])
        blk.cross_attn.out.load_state_dict(ref.multihead_attn.out_proj.state_dict())
        blk.cross_norm.load_state_dict(ref.norm2.state_dict())
        blk.ffn_norm.load_state_dict(ref.norm3.state_dict())
    x, memory = torch.randn(2, 6, D), torch.randn(2, 9, D)
    memory_valid = torch.ones(2, 9, dtype=torch.bool)
    memory_valid[1, 6:] = False
    causal = nn.Transformer.generate_square_subsequent_mask(6)
    expected = ref(x, memory, tgt_mask=causal, memory_key_padding_mask=~memory_valid)
    out = blk(x, context=memory, context_mask=memory_valid[:, None, None, :])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_block_dropout_train_vs_eval():
    blk = TransformerBlock(_cfg("pre", dropout=0.5))
    x = torch.randn(2, 6, D)
    blk.train()
    assert not torch.allclose(blk(x), blk(x))
    blk.eval()
    torch.testing.assert_close(blk(x), blk(x))


# --------------------------------------------------------------------------- Linear


@pytest.mark.parametrize("layout", ["input", "rows"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 1), (1,), (3, 5), (1, 1, 1)])
def test_linear_fast_path_equals_f_linear(bias, shape, layout, monkeypatch):
    """attnlab's Linear (input-major weight, or row-major after set_layout; split vector
    product for one vector) equals F.linear on the same weights, for one vector and for
    batches."""
    import attnlab.nn.linear as linear_module
    from attnlab.nn.linear import Linear, set_layout

    lin = Linear(64, 48, bias=bias)
    assert lin.weight.shape == (48, 64) and lin.weight.stride() == (1, 48)
    assert set_layout(lin, layout) == (layout == "rows")
    assert lin.weight.stride() == {"input": (1, 48), "rows": (64, 1)}[layout]
    x = torch.randn(*shape, 64, requires_grad=True)
    calls = []
    split = linear_module.split_vecmat
    monkeypatch.setattr(linear_module, "split_vecmat", lambda *a: calls.append(1) or split(*a))
    monkeypatch.setattr(linear_module, "SPLIT_MIN_NUMEL", 0)  # also take it for small weights
    y = lin(x)
    assert len(calls) == (1 if x.numel() == 64 else 0)  # the fast path ran for one vector
    ref = torch.nn.functional.linear(x, lin.weight.detach().contiguous(), lin.bias)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
    y.sum().backward()  # the fast path is differentiable too
    assert lin.weight.grad.shape == (48, 64)


def test_linear_state_dict_is_plain(tmp_path):
    """The state dict is a torch.nn.Linear one (names, shapes, contiguous row-major data as
    saved by safetensors): a plain nn.Linear loaded from it computes the same function, and
    attnlab's Linear loaded from a plain one keeps its input-major layout."""
    from safetensors.torch import load_file, save_file

    from attnlab.nn.linear import Linear, is_input_major

    torch.manual_seed(0)
    lin = Linear(64, 48)
    torch.nn.init.normal_(lin.bias)
    sd = lin.state_dict()
    assert {k: tuple(v.shape) for k, v in sd.items()} == {"weight": (48, 64), "bias": (48,)}
    save_file({k: v.contiguous() for k, v in sd.items()}, tmp_path / "lin.safetensors")
    stored = load_file(tmp_path / "lin.safetensors")
    plain = torch.nn.Linear(64, 48)
    plain.load_state_dict(stored)
    for x in (torch.randn(5, 64), torch.randn(64)):  # batch and one vector (split product)
        torch.testing.assert_close(plain(x), lin(x), rtol=1e-5, atol=1e-6)
    back = Linear(64, 48)
    back.load_state_dict(torch.nn.Linear(64, 48).state_dict() | stored)
    assert is_input_major(back.weight)
    x = torch.randn(3, 64)
    torch.testing.assert_close(back(x), plain(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_split_product_error_no_worse_than_f_linear(dtype, bias, monkeypatch):
    """Against a float64 reference, the one-vector split product is as exact as F.linear
    in low precision (each output rounded once)."""
    import attnlab.nn.linear as linear_module
    from attnlab.nn.linear import Linear

    calls = []
    split = linear_module.split_vecmat
    monkeypatch.setattr(linear_module, "split_vecmat", lambda *a: calls.append(1) or split(*a))
    torch.manual_seed(0)
    lin = Linear(1024, 768, bias=bias).to(dtype)
    if bias:
        torch.nn.init.normal_(lin.bias)
    errors = {"split": 0.0, "F.linear": 0.0}
    with torch.no_grad():
        for _ in range(8):
            x = torch.randn(1, 1024).to(dtype)
            ref = x.double() @ lin.weight.double().t() + (lin.bias.double() if bias else 0.0)
            ours = lin(x)
            theirs = torch.nn.functional.linear(x, lin.weight.contiguous(), lin.bias)
            errors["split"] += (ours.double() - ref).abs().mean().item()
            errors["F.linear"] += (theirs.double() - ref).abs().mean().item()
    assert len(calls) == 8  # the split product ran
    # 1%: the two kernels may differ in an output's last bit; summing the halves in bf16
    # (the old path) was about 1.5x worse. float32 sums two partial sums and the bias
    # separately: errors of ~1e-6 (F.linear's order is MKL's), within 1.5x here (AMD EPYC)
    # and 1.6-1.7x on an Intel Xeon.
    slack = 2.0 if dtype == torch.float32 else 1.01
    assert errors["split"] <= slack * errors["F.linear"], errors


def test_set_layout_restores_weights_in_place_and_leaves_ties_alone():
    """set_layout re-stores every Linear weight (same Parameter objects, same values, same
    state dict, still trainable) and leaves a weight tied to an embedding as it is."""
    from attnlab.nn.linear import is_input_major, set_layout

    torch.manual_seed(0)
    model = build_model(get_preset("gpt2-tiny"))  # tied head: the embedding's weight
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = list(model.parameters())
    with torch.inference_mode():  # as generate() calls it: the new tensors stay normal
        assert set_layout(model, "rows") > 0
    assert all(a is b for a, b in zip(params, model.parameters()))
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert all(m.weight.is_contiguous() for m in linears)
    assert set_layout(model, "rows") == 0  # already there
    idx = torch.randint(0, model.cfg.vocab_size, (2, 8))
    model(idx, targets=idx).loss.backward()  # trainable (not inference tensors)
    assert set_layout(model, "input") > 0
    assert model.lm_head.weight is model.tok_emb.weight and model.tok_emb.weight.is_contiguous()
    assert all(is_input_major(m.weight) for m in linears if m.weight is not model.tok_emb.weight)
    with pytest.raises(ValueError, match="unknown weight layout 'cols'"):
        set_layout(model, "cols")


@pytest.mark.parametrize("rows", [1, 3, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_compiled_row_product_equals_f_linear(dtype, rows):
    """The compiled product of a row-major weight with one vector or a few (inductor's own
    loops over (W[:, None] * x).sum(-1), accumulated in float32), or more (oneDNN's in
    float32, F.linear's in bfloat16), is as exact as F.linear against float64."""
    from attnlab.nn.linear import Linear, set_layout

    torch.manual_seed(0)
    lin = Linear(512, 384).to(dtype)
    torch.nn.init.normal_(lin.bias)
    set_layout(lin, "rows")
    torch._dynamo.reset()
    f = torch.compile(lin, fullgraph=True, dynamic=False)
    errors = {"compiled": 0.0, "F.linear": 0.0}
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(rows, 512).to(dtype)
            ref = x.double() @ lin.weight.double().t() + lin.bias.double()
            errors["compiled"] += (f(x).double() - ref).abs().mean().item()
            errors["F.linear"] += (
                (F.linear(x, lin.weight, lin.bias).double() - ref).abs().mean().item()
            )
    assert errors["compiled"] <= 1.5 * errors["F.linear"], errors


@pytest.mark.parametrize("rows", [1, 3])
def test_linear_compiled_row_product_keeps_float64(rows):
    """A float64 weight's compiled product of a few vectors (rows_matmul) runs in float64,
    as F.linear does: it was accumulated in float32 (errors of 1e-7, in a float64 model's
    compiled decode step). Backend aot_eager: the same traced product, no code generation."""
    from attnlab.nn.linear import Linear, set_layout

    torch.manual_seed(0)
    lin = Linear(64, 48).double()
    torch.nn.init.normal_(lin.bias)
    set_layout(lin, "rows")
    torch._dynamo.reset()
    f = torch.compile(lin, fullgraph=True, dynamic=False, backend="aot_eager")
    with torch.no_grad():
        x = torch.randn(rows, 64, dtype=torch.float64)
        got = f(x)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, F.linear(x, lin.weight, lin.bias), atol=1e-12, rtol=1e-12)


def test_linear_compiled_vector_product_is_one_operator():
    """Under torch.compile without gradients a one-vector product is the opaque
    attnlab::split_vecmat operator (its fake kernel gives the shape), equal to F.linear; with
    gradients, or for a batch, the graph holds plain products; a row-major weight's is a
    product and a sum (inductor's own loops)."""
    from attnlab.nn.linear import Linear, set_layout

    torch.manual_seed(0)
    lin = Linear(512, 256)  # 131,072 weights: at the split threshold
    torch.nn.init.normal_(lin.bias)
    graphs = []

    def backend(gm, example_inputs):  # records the traced operators, runs them as traced
        graphs.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return gm.forward

    from torch._dynamo.backends.common import aot_autograd

    torch._dynamo.reset()
    f = torch.compile(lin, fullgraph=True, dynamic=False, backend=aot_autograd(fw_compiler=backend))
    for shape, grad in (((1, 1, 512), False), ((3, 512), False), ((1, 512), True)):
        x = torch.randn(*shape)
        with torch.set_grad_enabled(grad):
            y = f(x)
        ref = torch.nn.functional.linear(x, lin.weight.detach().contiguous(), lin.bias.detach())
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
        uses_op = any("attnlab.split_vecmat" in t for t in graphs[-1])
        assert uses_op == (shape == (1, 1, 512) and not grad), (shape, grad, graphs[-1])
    # row-major (the compiled decode step's layout): a product and a sum, no matmul (compiled
    # afresh: torch 2.11 reran the graph above, whose product gives the same values)
    set_layout(lin, "rows")
    torch._dynamo.reset()
    f = torch.compile(lin, fullgraph=True, dynamic=False, backend=aot_autograd(fw_compiler=backend))
    with torch.no_grad():
        x = torch.randn(1, 1, 512)
        y = f(x)
    ref = torch.nn.functional.linear(x, lin.weight, lin.bias)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    ops = " ".join(graphs[-1])
    assert "aten.sum" in ops and "aten.mul" in ops, graphs[-1]
    assert not any(k in ops for k in ("mm", "split_vecmat", "linear")), graphs[-1]
    # a row-major weight below the split threshold too (the 5M model's 256 x 256 products):
    # inductor's loops, not an MKL call
    small = Linear(256, 256)
    set_layout(small, "rows")
    g = torch.compile(
        small, fullgraph=True, dynamic=False, backend=aot_autograd(fw_compiler=backend)
    )
    with torch.no_grad():
        x = torch.randn(1, 1, 256)
        torch.testing.assert_close(
            g(x), F.linear(x, small.weight, small.bias), rtol=1e-5, atol=1e-5
        )
    ops = " ".join(graphs[-1])
    assert "aten.sum" in ops and not any(k in ops for k in ("mm", "split_vecmat")), graphs[-1]


def test_linear_compiled_small_batch_product_is_a_sum_over_rows():
    """Under torch.compile without gradients a product of a few vectors (a small batch's
    decode step, up to ROWS_MATMUL_MAX) with a row-major weight is inductor's sum over W's
    rows, equal to F.linear; more vectors, or gradients, are oneDNN's product (F.linear's
    without oneDNN)."""
    from torch._dynamo.backends.common import aot_autograd

    import attnlab.nn.linear as linear_module
    from attnlab.nn.linear import ROWS_MATMUL_MAX, Linear, set_layout

    torch.manual_seed(0)
    lin = Linear(96, 80)
    torch.nn.init.normal_(lin.bias)
    set_layout(lin, "rows")
    graphs = []

    def backend(gm, example_inputs):  # records the traced operators, runs them as traced
        graphs.append(" ".join(str(n.target) for n in gm.graph.nodes if n.op == "call_function"))
        return gm.forward

    torch._dynamo.reset()
    f = torch.compile(lin, fullgraph=True, dynamic=False, backend=aot_autograd(fw_compiler=backend))
    cases = [((2, 1, 96), False), ((ROWS_MATMUL_MAX, 1, 96), False)]
    cases += [((ROWS_MATMUL_MAX + 1, 96), False), ((3, 96), True)]
    for shape, grad in cases:
        x = torch.randn(*shape)
        with torch.set_grad_enabled(grad):
            y = f(x)
        ref = F.linear(x, lin.weight.detach(), lin.bias.detach())
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
        summed = not grad and x.numel() // 96 <= ROWS_MATMUL_MAX
        product = "onednn_mm" if linear_module.ONEDNN else "mm"
        assert ("aten.sum" in graphs[-1]) == summed, (shape, grad, graphs[-1])
        assert (product in graphs[-1]) == (not summed), (shape, grad, graphs[-1])


@pytest.mark.parametrize("layout", ["rows", "input"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("compiled", [False, True])
def test_linear_products_of_several_vectors_are_onednn_and_equal_f_linear(layout, bias, compiled):
    """Products of several float32 vectors on CPU (a batch, a prompt, training) are oneDNN's,
    eager and compiled (inductor), with and without gradients: outputs and the gradients of
    input, weight and bias equal F.linear's; one vector keeps its own products, and with
    ONEDNN off every product is F.linear's."""
    import attnlab.nn.linear as linear_module
    from attnlab.nn.linear import Linear, set_layout

    if not linear_module.ONEDNN:
        pytest.skip("this torch build has no oneDNN")
    torch.manual_seed(0)
    lin = Linear(96, 80, bias=bias)
    if bias:
        torch.nn.init.normal_(lin.bias)
    set_layout(lin, layout)
    plain = torch.nn.Linear(96, 80, bias=bias)
    plain.load_state_dict({k: v.contiguous() for k, v in lin.state_dict().items()})
    calls = []
    real = linear_module.onednn_linear
    spy = lambda *a: calls.append(1) or real(*a)  # noqa: E731
    torch._dynamo.reset()
    f = torch.compile(lin, fullgraph=True, dynamic=False) if compiled else lin
    with unittest.mock.patch.object(linear_module, "onednn_linear", spy):
        for shape in ((2, 7, 96), (5, 96), (1, 96)):
            x = torch.randn(*shape, requires_grad=True)
            x_ref = x.detach().clone().requires_grad_()
            calls.clear()
            y = f(x)
            ref = plain(x_ref)
            torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
            (y * torch.arange(80.0)).sum().backward()
            (ref * torch.arange(80.0)).sum().backward()
            torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
            for p, q in zip(lin.parameters(), plain.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-4)
                p.grad = q.grad = None
            assert bool(calls) == (x.numel() > 96), shape
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast's products stay F.linear's
        x = torch.randn(5, 96)
        assert lin(x).dtype == plain(x).dtype == torch.bfloat16
        torch.testing.assert_close(lin(x), plain(x), rtol=0, atol=0)
    with torch.no_grad(), unittest.mock.patch.object(linear_module, "ONEDNN", False):
        x = torch.randn(5, 96)
        with unittest.mock.patch.object(linear_module, "onednn_linear", None):
            torch.testing.assert_close(lin(x), plain(x), rtol=1e-5, atol=1e-5)


def test_linear_weight_gradient_of_a_sliced_input_is_fast_and_exact():
    """A Linear fed a slice of a wider tensor (MLA's kv_b_proj reads c_KV, a slice of
    kv_a_proj's output) gets dW = dy^T x with x^T strided (1, wider): oneDNN's slow path,
    about 1000x slower, unless it is first copied to a plain transpose. The gradients equal
    F.linear's, and the product takes about the time of one from contiguous operands."""
    import time

    import attnlab.nn.linear as linear_module
    from attnlab.nn.linear import Linear, onednn_mm

    if not linear_module.ONEDNN:
        pytest.skip("this torch build has no oneDNN")
    torch.manual_seed(0)
    wide = torch.randn(8, 128, 144, requires_grad=True)
    lin = Linear(128, 256)
    plain = torch.nn.Linear(128, 256)
    plain.load_state_dict({k: v.contiguous() for k, v in lin.state_dict().items()})
    lin(wide[..., :128]).square().sum().backward()
    ref_wide = wide.detach().clone().requires_grad_()
    plain(ref_wide[..., :128]).square().sum().backward()
    torch.testing.assert_close(lin.weight.grad, plain.weight.grad, rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(wide.grad, ref_wide.grad, rtol=1e-5, atol=1e-5)

    dy, x = torch.randn(1024, 256), torch.randn(1024, 144)[:, :128]

    def best(a: torch.Tensor, b: torch.Tensor) -> float:
        onednn_mm(a, b)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            onednn_mm(a, b)
            times.append(time.perf_counter() - t0)
        return min(times)

    torch.testing.assert_close(onednn_mm(dy.t(), x.t()), dy.t() @ x, rtol=1e-4, atol=1e-3)
    assert best(dy.t(), x.t()) < 20 * best(dy.t(), x.contiguous().t()) + 2e-3


def test_onednn_linear_second_derivatives_equal_f_linears():
    """A gradient penalty (create_graph) through the oneDNN product: its backward's products
    had no derivative, so the penalty's dependence on the weight through dx = dy W was
    silently dropped (torch only warned); the second derivatives equal F.linear's."""
    from attnlab.nn.linear import onednn_linear

    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")
    torch.manual_seed(0)
    x0, w0, b0, c = torch.randn(4, 7), torch.randn(6, 7), torch.randn(6), torch.randn(4, 6)
    grads = []
    for linear in (onednn_linear, F.linear):
        x, w, b = (t.clone().requires_grad_() for t in (x0, w0, b0))
        for loss in (lambda y: (y * c).sum(), lambda y: y.square().sum()):
            (dx,) = torch.autograd.grad(loss(linear(x, w, b)), x, create_graph=True)
            grads.append(torch.autograd.grad(dx.square().sum(), (w, b), allow_unused=True))
    for got, want in zip(grads[:2], grads[2:]):
        for a, e in zip(got, want):
            if e is None:
                assert a is None
            else:
                torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("needs", ["x", "weight", "bias", "all"])
def test_onednn_linear_saves_only_what_its_gradients_need(needs):
    """Like F.linear, the oneDNN product keeps x for dW and W for dx only: a frozen weight's
    layer kept its input alive until the backward (and a bias alone kept both)."""
    from attnlab.nn.linear import onednn_linear

    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")

    def saved_numel(linear):
        x, w, b = torch.randn(6, 4, 32), torch.randn(16, 32), torch.randn(16)
        for name, t in (("x", x), ("weight", w), ("bias", b)):
            t.requires_grad_(needs in (name, "all"))
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t: sizes.append(t.numel()) or t, lambda t: t
        ):
            y = linear(x, w, b)
        y.sum().backward()
        return sum(sizes)

    assert saved_numel(onednn_linear) == saved_numel(F.linear)


def test_rows_matmul_keeps_float64_and_equals_f_linear():
    """The compiled decode step's one-vector product, run eagerly: float64 stays float64
    (it rounded to float32), float32 and bf16 as F.linear."""
    from attnlab.nn.linear import rows_matmul

    torch.manual_seed(0)
    w, b = torch.randn(6, 5, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    x = torch.randn(1, 3, 5, dtype=torch.float64)
    y = rows_matmul(x, w, b)
    assert y.dtype == torch.float64 and y.shape == (1, 3, 6)
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-13, atol=1e-13)
    for dtype in (torch.float32, torch.bfloat16):
        ref = F.linear(x.to(dtype), w.to(dtype), b.to(dtype))
        out = rows_matmul(x.to(dtype), w.to(dtype), b.to(dtype))
        assert out.dtype == dtype
        torch.testing.assert_close(out, ref, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                                   atol=1e-2 if dtype == torch.bfloat16 else 1e-5)  # fmt: skip
