"""``attention.global_tokens`` (Longformer): the config's checks, multi-head attention
through every backend against a one-query-at-a-time oracle (causal and bidirectional, with
left padding), cached decoding (prefill, chunks, one token at a time, left padding, and a
rolling cache 3x past max_seq_len) against the full forward pass, and the cache's size in
``attnlab.analysis`` and ``attnlab kv``.

Shapes: b batch, h heads, t length, d d_model, V vocabulary size.
"""

from __future__ import annotations

import json

import pytest
import torch
from oracle import global_window_allowed, naive_attention

from attnlab.analysis import kv_cache_bytes
from attnlab.cache import CacheError, GlobalWindowKV, RollingKV
from attnlab.cli.main import main
from attnlab.config import AttentionConfig, ConfigError, ModelConfig, PositionConfig
from attnlab.functional.attention import BACKENDS, available_backends, backend_names
from attnlab.functional.masks import positions_from_padding
from attnlab.models import DecoderLM
from attnlab.nn.attention import MultiHeadAttention
from attnlab.nn.rope import RotaryEmbedding

TOL = {"atol": 1e-5, "rtol": 1e-5}
WINDOW, GLOBAL = 3, [0, 2]


def decoder(window=WINDOW, global_tokens=GLOBAL, **kw) -> DecoderLM:
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=40,
        max_seq_len=kw.pop("max_seq_len", 32),
        d_model=32,
        n_layers=kw.pop("n_layers", 2),
        attention=AttentionConfig(
            n_heads=4, n_kv_heads=2, sliding_window=window, global_tokens=global_tokens,
            layer_pattern=kw.pop("layer_pattern", None),
        ),
        position=PositionConfig(kind="rope"),
        init_std=0.2,
        **kw,
    )  # fmt: skip
    return DecoderLM(cfg).eval()


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "attention, message",
    [
        ({"sliding_window": 4, "global_tokens": [2, 1]}, "distinct positions >= 0 in increasing"),
        ({"sliding_window": 4, "global_tokens": [1, 1]}, "distinct positions"),
        ({"sliding_window": 4, "global_tokens": [-1]}, "distinct positions >= 0"),
        ({"global_tokens": [0]}, "only change a windowed layer; set attention.sliding_window"),
        ({"sliding_window": 4, "global_tokens": [0], "sink_tokens": 1}, "with sink_tokens"),
        ({"sliding_window": 4, "global_tokens": [0], "kind": "mla"}, "kind='mha' only"),
        ({"sliding_window": 4, "global_tokens": [40]}, "40 is not below max_seq_len=32"),
        ({"sliding_window": 4, "global_tokens": ["a"]}, r"\[0\]: expected an integer"),
    ],
)
def test_bad_global_tokens_name_the_field(attention, message):
    with pytest.raises(ConfigError, match=r"attention.global_tokens.*" + message):
        ModelConfig.from_dict({"max_seq_len": 32, "attention": attention})


def test_only_local_layers_of_a_pattern_get_global_tokens():
    model = decoder(layer_pattern="LG", n_layers=4)
    assert [b.attn.global_tokens for b in model.blocks] == [GLOBAL, [], GLOBAL, []]
    kinds = [type(e) for e in model.new_cache(1, 16).layers]
    assert kinds[0] is GlobalWindowKV and kinds[1] is not GlobalWindowKV


# --------------------------------------------------------------------------- attention


@torch.no_grad()
@pytest.mark.parametrize("backend", backend_names())  # every backend, as the README says
@pytest.mark.parametrize("causal", [True, False])
def test_attention_equals_the_oracle(backend, causal):
    """The module's output against softmax over the allowed keys one query at a time,
    with one left-padded row (its positions, hence its global tokens, shifted)."""
    if backend not in available_backends():
        pytest.skip(f"{backend}: {BACKENDS[backend].unavailable()}")
    d, t = 32, 11
    cfg = AttentionConfig(n_heads=4, n_kv_heads=2, sliding_window=WINDOW, global_tokens=[0, 5],
                          backend=backend)  # fmt: skip
    rope = RotaryEmbedding(8)
    attn = MultiHeadAttention(d, cfg, causal=causal, rope=rope).eval()
    x = torch.randn(2, t, d)
    valid = torch.ones(2, t, dtype=torch.bool)
    valid[1, :3] = False  # row 1: three pads on the left
    positions = positions_from_padding(valid.long(), t)  # (2, t)
    pad_mask = valid[:, None, None, :]
    got = attn(x, positions=positions, mask=pad_mask)
    q, k, v = attn._project_self(attn.qkv(x), rope.tables(positions))
    allowed = global_window_allowed(positions, WINDOW, [0, 5], causal=causal, valid=valid)
    y = naive_attention(q, k, v, allowed)  # (b, h, t, d_h)
    want = attn.out(y.transpose(1, 2).reshape(2, t, d))
    torch.testing.assert_close(got[valid], want[valid], **TOL)
    # The global tokens matter: the plain window gives other outputs.
    plain = global_window_allowed(positions, WINDOW, [], causal=causal, valid=valid)
    other = attn.out(naive_attention(q, k, v, plain).transpose(1, 2).reshape(2, t, d))
    assert (other[valid] - want[valid]).abs().max() > 1e-3


# --------------------------------------------------------------------------- decoding


def _chunks(model, idx, cache, sizes, mask=None):
    out, i = [], 0
    for n in sizes:
        m = None if mask is None else mask[:, i : i + n]
        out.append(model(idx[:, i : i + n], cache=cache, attention_mask=m).logits)
        i += n
    return torch.cat(out, dim=1)


@torch.no_grad()
@pytest.mark.parametrize("static", [False, True])
def test_cached_decoding_equals_the_full_pass(static):
    """Prefill, chunks and single tokens, a left-padded row: the cache keeps the global
    tokens' keys for good and a ring of the window, and gives the full pass's logits."""
    model = decoder()
    idx = torch.randint(0, 40, (2, 20))
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, :4] = 0
    full = model(idx, attention_mask=mask).logits
    cache = model.new_cache(2, 24, static=static)
    sizes = [5, 1, 1, 7, 1, 1, 1, 1, 1, 1] if not static else [5] + [1] * 15
    got = _chunks(model, idx, cache, sizes, mask)
    torch.testing.assert_close(got[0], full[0], **TOL)
    torch.testing.assert_close(got[1, 4:], full[1, 4:], **TOL)
    entry = cache.layers[0]
    assert isinstance(entry, GlobalWindowKV) and entry.ring.k.shape[2] == WINDOW
    assert entry.global_k.shape[2] == len(GLOBAL)


@torch.no_grad()
def test_rolling_cache_runs_past_max_seq_len_with_flat_memory():
    model = decoder(max_seq_len=16)
    idx = torch.randint(0, 40, (1, 48))
    full = model(idx).logits  # RoPE: the full pass takes 3 x max_seq_len
    cache = model.new_cache(1, 16, rolling=True)
    before = cache.nbytes
    got = _chunks(model, idx, cache, [6] + [1] * 20 + [9, 13])
    torch.testing.assert_close(got, full, **TOL)
    assert cache.nbytes == before
    tokens = model.generate(idx[0, :6].tolist(), 40, overflow="roll")
    seq = idx[:, :6]
    for _ in range(40):  # greedy by hand with full passes
        seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert tokens == seq[0, 6:].tolist()


def test_global_position_outside_the_window_cannot_be_cached():
    model = decoder(global_tokens=[0, 7])
    with pytest.raises(CacheError, match="position 7 >= sliding_window=3"):
        model.new_cache(1, 16)


def test_kv_bytes_count_the_global_entries(capsys):
    cfg = decoder().cfg
    for seq_len in (2, 16):
        assert kv_cache_bytes(cfg, seq_len) == DecoderLM(cfg).new_cache(1, seq_len).nbytes
    plain = cfg.override({"attention.global_tokens": []})
    per_layer_token = 2 * 2 * 8 * 4  # k and v, 2 kv heads of 8, float32
    assert kv_cache_bytes(cfg, 16) - kv_cache_bytes(plain, 16) == 2 * 2 * per_layer_token
    assert isinstance(DecoderLM(plain).new_cache(1, 16).layers[0], RollingKV)
    argv = ["kv", "--preset", "mistral-7b", "--seq-len", "8192", "--json"]
    argv += ["--set", "model.attention.sliding_window=4096"]
    assert main(argv) == 0
    (before,) = json.loads(capsys.readouterr().out)
    assert main([*argv, "--set", "model.attention.global_tokens=[0,1,2,3]"]) == 0
    (after,) = json.loads(capsys.readouterr().out)
    assert after["bytes"]["8192"] - before["bytes"]["8192"] == 4 * before["bytes_per_token"]
    assert main([*argv, "--set", "train.lr=1"]) == 1
    assert "kv only uses model.* fields" in capsys.readouterr().err


@torch.no_grad()
def test_reordered_cache_equals_one_built_for_the_new_rows():
    """Beam search reorders rows: the global keys and the ring follow them."""
    model = decoder()
    idx = torch.randint(0, 40, (2, 9))
    cache = model.new_cache(2, 16)
    model(idx, cache=cache)
    cache.reorder(torch.tensor([1, 0, 1]))
    fresh = model.new_cache(3, 16)
    model(idx[[1, 0, 1]], cache=fresh)
    nxt = torch.randint(0, 40, (3, 1))
    torch.testing.assert_close(model(nxt, cache=cache).logits, model(nxt, cache=fresh).logits)
