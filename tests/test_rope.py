"""Rotary position embedding: relative-position property, norms, both pair layouts, the
complex-number oracle, position offsets and bf16; LongRoPE's tables and their switch, and
the partial rotation, against transformers' own functions (Phi-3's).

Shapes: b batch, h heads, t length, d_h head dim.
"""

from __future__ import annotations

import math

import pytest
import torch
from oracle import rope_complex_interleaved

from attnlab.functional.rope import (
    apply_partial_rope,
    apply_rope,
    interleaved_to_split,
    rope_angles,
    rope_inv_freq,
    rope_tables,
)
from attnlab.nn.rope import RotaryEmbedding

D_H = 16


def _rope(x: torch.Tensor, positions: torch.Tensor, layout: str, theta: float = 10000.0):
    cos, sin = rope_angles(positions, rope_inv_freq(x.shape[-1], theta))
    return apply_rope(x, cos, sin, layout)


@pytest.mark.parametrize("theta", [10000.0, 500000.0])
def test_inv_freq(theta):
    expected = torch.tensor([theta ** (-2 * i / D_H) for i in range(D_H // 2)], dtype=torch.float64)
    torch.testing.assert_close(rope_inv_freq(D_H, theta).double(), expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("theta", [10000.0, 100.0])
def test_interleaved_matches_complex_oracle(theta):
    x = torch.randn(2, 3, 7, D_H)
    positions = torch.tensor([0, 1, 2, 5, 17, 100, 1000])
    out = _rope(x, positions, "interleaved", theta)
    expected = rope_complex_interleaved(x, positions, theta).float()
    # Angles up to 1000 rad in float32 carry ~1e-4 absolute error (ulp of 1000 is 6e-5).
    torch.testing.assert_close(out, expected, atol=3e-4, rtol=1e-5)
    small = positions < 20  # small angles: float32 is exact to ~1e-6
    torch.testing.assert_close(out[..., small, :], expected[..., small, :], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", ["split", "interleaved"])
def test_dot_product_depends_only_on_offset(layout):
    q = torch.randn(1, 1, 1, D_H)
    k = torch.randn(1, 1, 1, D_H)

    def dot(m: int, n: int) -> torch.Tensor:
        qm = _rope(q, torch.tensor([m]), layout)
        kn = _rope(k, torch.tensor([n]), layout)
        return (qm * kn).sum()

    for m, n in [(3, 1), (7, 7), (2, 9), (0, 4)]:
        for shift in (1, 5, 40):
            torch.testing.assert_close(dot(m + shift, n + shift), dot(m, n), atol=1e-5, rtol=1e-5)
    # ... and really changes with the offset (the test could fail).
    assert not torch.allclose(dot(3, 1), dot(3, 2), atol=1e-3)


@pytest.mark.parametrize("layout", ["split", "interleaved"])
def test_rotation_preserves_norms(layout):
    x = torch.randn(2, 2, 9, D_H)
    out = _rope(x, torch.arange(9) * 13, layout)
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(_rope(x, torch.zeros(9, dtype=torch.long), layout), x)


def test_split_and_interleaved_agree_under_permutation():
    perm = interleaved_to_split(D_H)
    assert sorted(perm.tolist()) == list(range(D_H))
    q, k = torch.randn(2, 2, 6, D_H), torch.randn(2, 2, 6, D_H)
    pos = torch.tensor([0, 3, 4, 10, 11, 50])
    q_i, k_i = _rope(q, pos, "interleaved"), _rope(k, pos, "interleaved")
    q_s, k_s = _rope(q[..., perm], pos, "split"), _rope(k[..., perm], pos, "split")
    torch.testing.assert_close(q_s, q_i[..., perm])
    torch.testing.assert_close(k_s, k_i[..., perm])
    torch.testing.assert_close(q_s @ k_s.transpose(-1, -2), q_i @ k_i.transpose(-1, -2))
    # Without the permutation the layouts differ.
    assert not torch.allclose(_rope(q, pos, "split"), q_i, atol=1e-3)


def test_split_layout_matches_complex_oracle_after_permutation():
    perm = interleaved_to_split(D_H)
    x = torch.randn(1, 2, 5, D_H)  # split layout
    pos = torch.arange(5) * 7
    inverse = torch.argsort(perm)  # split -> interleaved
    expected = rope_complex_interleaved(x[..., inverse], pos).float()[..., perm]
    torch.testing.assert_close(_rope(x, pos, "split"), expected)


def test_unknown_layout_raises():
    with pytest.raises(ValueError, match="unknown RoPE layout"):
        _rope(torch.randn(1, 1, 2, D_H), torch.arange(2), "halves")
    with pytest.raises(ValueError, match="even head_dim"):
        RotaryEmbedding(7)


@pytest.mark.parametrize("layout", ["split", "interleaved"])
def test_module_positions_offset_and_per_row(layout):
    rope = RotaryEmbedding(D_H, layout=layout)
    q, k = torch.randn(2, 4, 9, D_H), torch.randn(2, 2, 9, D_H)
    full_q, full_k = rope(q, k, torch.arange(9))
    # The last 4 tokens alone, at positions 5..8 (as in a KV cache), rotate the same way.
    part_q, part_k = rope(q[:, :, 5:], k[:, :, 5:], torch.arange(5, 9))
    torch.testing.assert_close(part_q, full_q[:, :, 5:])
    torch.testing.assert_close(part_k, full_k[:, :, 5:])
    # Per-row positions (b, t): row 1 shifted by 3 equals the single-row result at those slots.
    pos = torch.stack((torch.arange(6), torch.arange(6) + 3))
    rows_q, rows_k = rope(q[:, :, :6], k[:, :, :6], pos)
    torch.testing.assert_close(rows_q[1], _rope(q[1:, :, :6], torch.arange(3, 9), layout)[0])
    torch.testing.assert_close(rows_k[1], _rope(k[1:, :, :6], torch.arange(3, 9), layout)[0])
    torch.testing.assert_close(rows_q[0], full_q[0, :, :6])


def test_module_tables_of_1d_positions_are_4d_and_serve_attention():
    """positions (t,) give tables (1, 1, t, d_h) as (1, t) do: attention modules transpose
    the heads axis (1) with the length axis (2), which a 3-D table does not have."""
    from attnlab.config import AttentionConfig
    from attnlab.nn.attention import MultiHeadAttention

    rope = RotaryEmbedding(D_H)
    one, row = rope.tables(torch.arange(5)), rope.tables(torch.arange(5)[None])
    assert one.cos.shape == row.cos.shape == (1, 1, 5, D_H)
    attn = MultiHeadAttention(2 * D_H, AttentionConfig(n_heads=2), rope=rope).eval()
    x = torch.randn(3, 5, 2 * D_H)
    with torch.no_grad():
        torch.testing.assert_close(
            attn(x, positions=torch.arange(5)), attn(x, positions=torch.arange(5)[None])
        )


def test_module_reused_between_inference_and_training():
    rope = RotaryEmbedding(D_H)
    q, k = torch.randn(1, 2, 4, D_H), torch.randn(1, 2, 4, D_H)
    pos = torch.arange(4)
    with torch.inference_mode():
        rope(q, k, pos)
    q.requires_grad_(True)
    rq, rk = rope(q, k, pos)  # same positions after an inference-mode call
    rq.sum().backward()
    assert q.grad is not None and q.grad.isfinite().all()


@pytest.mark.parametrize("layout", ["split", "interleaved"])
def test_bf16_input_uses_float32_angles(layout):
    x = torch.randn(1, 2, 4, D_H)
    pos = torch.tensor([300, 1001, 4097, 8191])  # not representable in bf16
    assert not torch.equal(pos.bfloat16().long(), pos)
    ref = _rope(x, pos, layout)  # float32 throughout
    out = _rope(x.bfloat16(), pos, layout)
    assert out.dtype == torch.bfloat16
    # Only the input and output round to bf16 (~2^-8 relative), so the error stays at that level.
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    # The same rotation with angles computed in bf16 is off by whole radians at these positions.
    angles = pos.bfloat16()[:, None] * rope_inv_freq(D_H).bfloat16()
    bad = apply_rope(x, angles.float().cos(), angles.float().sin(), layout)
    assert (bad - ref).abs().max() > 0.1
    # rope_angles always returns float32, even from a bf16 frequency table.
    assert rope_angles(pos, rope_inv_freq(D_H).bfloat16())[0].dtype == torch.float32


@pytest.mark.parametrize("layout", ["split", "interleaved"])
def test_float64_input_is_rotated_in_float64(layout):
    """The rotation raises half precision to float32 but keeps float64 (it rounded float64
    queries and keys to float32, so a float64 attention failed gradcheck)."""
    x = torch.randn(2, 3, 5, D_H, dtype=torch.float64)
    cos, sin = rope_angles(torch.arange(5), rope_inv_freq(D_H))  # float32 tables
    out = apply_rope(x, cos, sin, layout)
    assert out.dtype == torch.float64
    c, s = (t.double() for t in rope_tables(cos, sin, layout))
    if layout == "split":
        swapped = x.roll(D_H // 2, dims=-1)
    else:
        swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    torch.testing.assert_close(out, x * c + swapped * s, rtol=1e-14, atol=1e-14)
    x.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: apply_rope(x, cos, sin, layout), (x,))


@pytest.mark.parametrize("layout", ["split", "interleaved"])
def test_module_cast_to_bf16_keeps_float32_frequencies(layout):
    rope = RotaryEmbedding(D_H, layout=layout).to(torch.bfloat16)  # as model.to(bf16) does
    q, k = torch.randn(1, 2, 4, D_H), torch.randn(1, 2, 4, D_H)
    pos = torch.tensor([300, 1001, 4097, 8191])
    out_q, out_k = rope(q.bfloat16(), k.bfloat16(), pos)
    # Only input/output rounding to bf16 (~2^-8 relative) is allowed.
    torch.testing.assert_close(out_q.float(), _rope(q, pos, layout), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out_k.float(), _rope(k, pos, layout), atol=2e-2, rtol=2e-2)


LONGROPE = {"kind": "longrope", "short_factor": [1.0, 1.0, 1.1, 1.2, 1.5, 1.7, 2.0, 2.5],
            "long_factor": [1.0, 1.5, 2.0, 3.0, 5.0, 8.0, 13.0, 21.0],
            "original_max_seq_len": 512, "factor": 16.0}  # fmt: skip


@pytest.mark.parametrize("scaling", [None, {"kind": "yarn", "factor": 4.0}, LONGROPE])
def test_module_cast_to_bf16_and_back_has_exact_frequencies(scaling):
    """model.to(bf16) then .float() (or .half().double()): the frequency table is the exact
    one again, not the bf16-rounded table in float32 (0.4% off: angles at position 8191
    off by up to 1.5 radians here; llama-tiny's logits over 128 positions by 0.19)."""
    for there, back in ((torch.bfloat16, torch.float32), (torch.float16, torch.float64)):
        exact = RotaryEmbedding(D_H, scaling=scaling).to(back)  # computed in `back` itself
        expected = RotaryEmbedding(D_H, scaling=scaling)._inv_freq(dtype=back)
        torch.testing.assert_close(exact.inv_freq, expected, rtol=0, atol=0)
        rope = RotaryEmbedding(D_H, scaling=scaling).to(there).to(back)
        assert rope.inv_freq.dtype == back
        torch.testing.assert_close(rope.inv_freq, exact.inv_freq, rtol=0, atol=0)
        pos = torch.tensor([300, 1001, 4097, 8191])  # (LongRoPE: past 512, its long table)
        torch.testing.assert_close(rope.tables(pos).cos, exact.tables(pos).cos, rtol=0, atol=0)


@pytest.mark.parametrize("layout", ["split", "interleaved"])
def test_module_fast_rotation_equals_apply_rope(layout):
    """RotaryEmbedding's fused rotation (x cos + swap(x) sin) equals the readable apply_rope."""
    rope = RotaryEmbedding(D_H, theta=500.0, layout=layout)
    q, k = torch.randn(3, 4, 7, D_H), torch.randn(3, 2, 7, D_H)
    pos = torch.randint(0, 1000, (3, 7))
    fast_q, fast_k = rope(q, k, pos)
    cos, sin = rope_angles(pos, rope_inv_freq(D_H, 500.0))
    cos, sin = cos[:, None], sin[:, None]
    torch.testing.assert_close(fast_q, apply_rope(q, cos, sin, layout), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fast_k, apply_rope(k, cos, sin, layout), rtol=1e-5, atol=1e-6)


def _rotation_matrices(positions: torch.Tensor, d: int, layout: str) -> torch.Tensor:
    """(t, d, d): each pair (a, b) of the layout turned by its angle, one 2x2 block each."""
    cos, sin = rope_angles(positions, rope_inv_freq(d))  # (t, d/2)
    first = torch.arange(d // 2) if layout == "split" else torch.arange(0, d, 2)
    second = first + d // 2 if layout == "split" else first + 1
    r = torch.zeros(positions.shape[0], d, d)
    r[:, first, first], r[:, first, second] = cos, -sin
    r[:, second, first], r[:, second, second] = sin, cos
    return r


@pytest.mark.parametrize("layout", ["split", "interleaved"])
def test_rotation_and_its_gradient_equal_the_rotation_matrices(layout):
    """apply_rope, eager and compiled (inductor), equals multiplying by explicit 2x2
    rotation blocks, and so does its gradient."""
    pos = torch.arange(11) * 7
    x = torch.randn(2, 3, 11, D_H, requires_grad=True)
    grad = torch.randn(2, 3, 11, D_H)
    r = _rotation_matrices(pos, D_H, layout)
    want = torch.einsum("tij,bhtj->bhti", r, x)
    (want_grad,) = torch.autograd.grad(want, x, grad)
    cos, sin = rope_angles(pos, rope_inv_freq(D_H))
    for rotate in (apply_rope, torch.compile(apply_rope, fullgraph=True)):
        got = rotate(x, cos, sin, layout)
        (got_grad,) = torch.autograd.grad(got, x, grad)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("theta", [1.0, 0.5])
def test_yarn_with_theta_at_most_one_is_a_config_error(theta):
    """YaRN locates its ramp by ln(theta) (a division by zero at theta 1): one ConfigError
    naming the field, not a ZeroDivisionError when the model is built."""
    from attnlab.config import ConfigError, PositionConfig

    pos = PositionConfig(kind="rope", rope_theta=theta, rope_scaling="yarn", rope_factor=4.0)
    with pytest.raises(ConfigError, match=r"position\.rope_theta: must be > 1 with yarn"):
        pos.validate()


def test_float64_rope_stays_float64():
    """A float64 model rotates in float64: the angles of ``model.double()``'s RoPE are
    exact to float64 rounding (they were float32 tables, and apply_rope rounded q and k to
    float32: gradcheck of a float64 model failed), and the rotation's gradient checks."""
    rope = RotaryEmbedding(D_H, theta=500.0, scaling=dict(kind="yarn", factor=4.0)).double()
    positions = torch.tensor([[0, 1, 1000, 123457]])
    tables = rope.tables(positions)
    assert tables.cos.dtype == torch.float64
    assert rope_inv_freq(D_H, 500.0, dtype=torch.float64).dtype == torch.float64
    angles = positions[0, :, None].double() * rope._inv_freq(dtype=torch.float64)  # (t, d/2)
    half = D_H // 2
    want = angles.cos() * rope.attention_factor
    torch.testing.assert_close(tables.cos[0, 0, :, :half], want, rtol=1e-12, atol=1e-12)
    x = torch.randn(1, 2, 4, D_H, dtype=torch.float64) * 1e3 + 1.0
    y = tables.rotate(x)
    assert y.dtype == torch.float64
    c, s = tables.cos, tables.sin
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    torch.testing.assert_close(y, x * c + swapped * s, rtol=1e-12, atol=1e-9)
    xg = torch.randn(1, 2, 4, D_H, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(tables.rotate, (xg,))
    # float32 models keep float32 tables
    assert RotaryEmbedding(D_H).tables(positions).cos.dtype == torch.float32


# --------------------------------------------------------------------------- LongRoPE


def _phi3_config(partial: float = 1.0, attention_factor: float | None = None):
    """transformers' Phi3Config: heads of 16 (a partial rotation: fewer), a context of 256
    stretched 8x from 32, LongRoPE factors of its own per rotated pair."""
    transformers = pytest.importorskip("transformers")
    pairs = int(16 * partial) // 2
    params = {"rope_type": "longrope", "rope_theta": 500.0,
              "short_factor": [1.0 + 0.1 * i for i in range(pairs)],
              "long_factor": [1.0 + 2.5 * i for i in range(pairs)]}  # fmt: skip
    if attention_factor is not None:
        params["attention_factor"] = attention_factor
    return transformers.Phi3Config(
        hidden_size=64, num_attention_heads=4, max_position_embeddings=256,
        original_max_position_embeddings=32, partial_rotary_factor=partial,
        rope_parameters=params,
    )  # fmt: skip


def _ours(config) -> RotaryEmbedding:
    """attnlab's RotaryEmbedding of the same settings, from its own config fields."""
    from attnlab.config import ModelConfig, PositionConfig

    params = config.rope_parameters
    pos = PositionConfig(
        kind="rope", rope_theta=params["rope_theta"], rope_scaling="longrope",
        rope_short_factor=params["short_factor"], rope_long_factor=params["long_factor"],
        rope_original_max_seq_len=32, rope_factor=256 / 32,
        rope_attention_factor=params.get("attention_factor"),
        rope_fraction=params["partial_rotary_factor"],
    )  # fmt: skip
    cfg = ModelConfig(d_model=64, position=pos)
    cfg.validate()
    return RotaryEmbedding.from_config(cfg.rope_dim, pos)


@pytest.mark.parametrize("attention_factor", [None, 0.8])
@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_longrope_tables_are_transformers(partial, attention_factor):
    """Both frequency tables and the cos/sin factor equal transformers'
    ROPE_INIT_FUNCTIONS["longrope"]: the short one (no sequence length), the long one (one
    past the original context), the factor sqrt(1 + ln 8 / ln 32) or the one given; over
    the rotated part of a head when it rotates half."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = _phi3_config(partial, attention_factor)
    short, factor = ROPE_INIT_FUNCTIONS["longrope"](config, None)
    long, long_factor = ROPE_INIT_FUNCTIONS["longrope"](config, None, seq_len=33)
    ours = _ours(config)
    assert ours.inv_freq.shape == (int(16 * partial) // 2,)
    assert torch.equal(ours.inv_freq, short) and torch.equal(ours.long_inv_freq, long)
    assert not torch.equal(short, long)
    assert ours.attention_factor == pytest.approx(factor, rel=1e-12) == long_factor
    if attention_factor is None:
        assert factor == pytest.approx((1 + math.log(8) / math.log(32)) ** 0.5, rel=1e-12)


@pytest.mark.parametrize(
    "positions",
    [[list(range(20))], [list(range(32))], [list(range(33))], [list(range(70))],
     [list(range(10)), list(range(22, 32))], [list(range(10)), list(range(23, 33))],
     [[40]], [[31]]],
    ids=["20", "32", "33", "70", "batch-within", "batch-one-row-past", "decode-past",
         "decode-last-short"],
)  # fmt: skip
def test_longrope_switch_follows_transformers_rotary_embedding(positions):
    """cos/sin for a forward pass's positions are transformers' Phi3RotaryEmbedding's (its
    dynamic update): the short factors while every position stays below the original 32,
    the long ones for the whole pass (every row) once one reaches it."""
    pytest.importorskip("transformers")
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    config = _phi3_config()
    theirs = Phi3RotaryEmbedding(config)
    position_ids = torch.tensor(positions)
    cos, sin = theirs(torch.zeros(1, dtype=torch.float32), position_ids)  # (b, t, d_h)
    tables = _ours(config).tables(position_ids)  # (b, 1, t, d_h): cos [c, c], sin [-s, s]
    torch.testing.assert_close(tables.cos[:, 0], cos, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(tables.sin[:, 0, :, 8:], sin[..., 8:], rtol=1e-6, atol=1e-6)
    plain = _ours(config)
    plain.long_inv_freq = plain.inv_freq  # no switch: would the pass differ?
    differs = not torch.allclose(plain.tables(position_ids).cos, tables.cos)
    assert differs == (max(max(row) for row in positions) >= 32)


@pytest.mark.parametrize("layout", ["split", "interleaved"])
def test_partial_rotation_rotates_the_leading_features_only(layout):
    """Tables narrower than the head rotate its first d_r features, pairs laid out within
    them, and pass the rest unchanged; as wide as the head they are apply_rope."""
    x = torch.randn(2, 3, 5, D_H)
    cos, sin = rope_angles(torch.arange(5), rope_inv_freq(6, 100.0))  # d_r = 6 of 16
    c, s = rope_tables(cos, sin, layout)
    y = apply_partial_rope(x, c, s, layout)
    torch.testing.assert_close(y[..., :6], apply_rope(x[..., :6], cos, sin, layout))
    assert torch.equal(y[..., 6:], x[..., 6:])
    c, s = rope_tables(*rope_angles(torch.arange(5), rope_inv_freq(D_H)), layout)
    assert torch.equal(apply_partial_rope(x, c, s, layout), apply_rope(x, c, s, layout))


def test_partial_rotation_is_transformers():
    """Phi-3's apply_rotary_pos_emb with partial_rotary_factor 0.5 (cos/sin of 8 features
    for heads of 16) gives the q and k attnlab's tables rotate, and the model's rope_dim is
    int(head_dim * rope_fraction)."""
    pytest.importorskip("transformers")
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

    config = _phi3_config(partial=0.5)
    position_ids = torch.tensor([[0, 5, 17, 40, 41]])
    cos, sin = Phi3RotaryEmbedding(config)(torch.zeros(1), position_ids)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 5, D_H, generator=g), torch.randn(1, 2, 5, D_H, generator=g)
    q_theirs, k_theirs = apply_rotary_pos_emb(q, k, cos, sin)
    ours = _ours(config)
    assert ours.head_dim == 8
    q_ours, k_ours = ours(q, k, position_ids)
    torch.testing.assert_close(q_ours, q_theirs, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k_ours, k_theirs, rtol=1e-6, atol=1e-6)
    assert torch.equal(q_ours[..., 8:], q[..., 8:])
