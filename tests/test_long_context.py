"""Long context: sliding-window layers with per-layer rings, local/global layer patterns,
decoding past max_seq_len with a rolling cache.

Shapes: b batch, t length, V vocabulary size.
"""

from __future__ import annotations

import pytest
import torch
from oracle import naive_attention, streaming_llm_keys

from attnlab.analysis import kv_cache_bytes
from attnlab.cache import DenseKV, RollingKV
from attnlab.config import AttentionConfig, ConfigError, ModelConfig, PositionConfig
from attnlab.models import DecoderLM

TOL = {"atol": 1e-5, "rtol": 1e-5}


def tiny(window: int | None = 4, pattern: str | None = None, **kw) -> DecoderLM:
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=40,
        max_seq_len=kw.pop("max_seq_len", 32),
        d_model=32,
        n_layers=kw.pop("n_layers", 4),
        attention=AttentionConfig(
            n_heads=4, n_kv_heads=2, sliding_window=window, layer_pattern=pattern
        ),
        position=PositionConfig(kind=kw.pop("position", "rope")),
        init_std=0.1,
        **kw,
    )
    return DecoderLM(cfg).eval()


def _chunks(model, idx, mask, cache, sizes):
    """Feed idx (b, T) in chunks of the given sizes; the logits of every position."""
    out, i = [], 0
    for n in sizes:
        m = None if mask is None else mask[:, i : i + n]
        out.append(model(idx[:, i : i + n], cache=cache, attention_mask=m).logits)
        i += n
    return torch.cat(out, dim=1)


# --------------------------------------------------------------------------- per-layer rings


def test_layer_pattern_picks_local_and_global_layers():
    model = tiny(window=4, pattern="LLG", n_layers=6)
    assert [b.attn.window for b in model.blocks] == [4, 4, None, 4, 4, None]
    cache = model.new_cache(1, 16)
    kinds = [type(e) for e in cache.layers]
    assert kinds == [RollingKV, RollingKV, DenseKV] * 2
    assert cache.layers[0].k.shape[2] == 4 and cache.layers[2].k.shape[2] == 16


@torch.no_grad()
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("pattern", [None, "LG"])
def test_ring_cache_equals_full_attention_under_the_window(static, pattern):
    """A ring of w entries per local layer gives the full forward pass's logits (sliding
    window mask) with left padding and chunks longer than the window (w + t keys)."""
    model = tiny(window=4, pattern=pattern)
    idx = torch.randint(0, 40, (2, 20))
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, :5] = 0  # row 1 is left padded, longer than one window
    full = model(idx, attention_mask=mask).logits
    cache = model.new_cache(2, 24, static=static)
    sizes = [7, 1, 1, 6, 1, 1, 1, 1, 1] if not static else [7] + [1] * 13
    got = _chunks(model, idx, mask, cache, sizes)
    torch.testing.assert_close(got[0], full[0], **TOL)
    torch.testing.assert_close(got[1, 5:], full[1, 5:], **TOL)
    ring = [e for e in cache.layers if isinstance(e, RollingKV)]
    assert ring and all(e.k.shape[2] == 4 for e in ring)


@torch.no_grad()
def test_all_local_rolling_cache_takes_chunks_of_any_size_past_capacity():
    """Every layer windowed: a rolling cache holds w entries per layer and goes on far past
    its capacity in chunks of any size, equal to the full windowed forward pass."""
    model = tiny(window=4, max_seq_len=128)
    idx = torch.randint(0, 40, (2, 60))
    full = model(idx).logits
    cache = model.new_cache(2, 8, rolling=True)
    nbytes = cache.nbytes
    got = _chunks(model, idx, None, cache, [9, 1, 13, 1, 1, 20, 2, 13])
    torch.testing.assert_close(got, full, **TOL)
    assert cache.nbytes == nbytes == 4 * 2 * (2 * 2 * 4 * 8 * 4)  # layers, k+v, b h w d_h f32


@torch.no_grad()
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("kind", ["LG", "mla", "dsa"])
def test_rolling_chunks_that_wrap_the_shared_slots_equal_the_windowed_stream(kind, static):
    """Chunks that wrap a rolling cache's shared slots (global layers beside windowed ones,
    latent attention, DSA whose top-k reads the wrapped slots' positions) equal the full
    forward pass with every layer seeing its window, or the last L tokens without one."""
    import copy

    from attnlab.models import build_model
    from attnlab.presets import get_preset

    L, T = 8, 34
    if kind == "LG":
        model = tiny(window=4, pattern="LG", n_layers=2, max_seq_len=64)
    else:
        preset, changes = {
            "mla": ("deepseek-tiny", {}),
            "dsa": ("deepseek-v32-tiny", {"attention.index_topk": 4}),  # fewer than L keys
        }[kind]
        torch.manual_seed(0)
        model = build_model(get_preset(preset).override({"max_seq_len": 64, **changes})).eval()
    reference = copy.deepcopy(model)
    for block in reference.blocks:
        block.attn.window = min(block.attn.window or L, L)
    idx = torch.randint(0, model.cfg.vocab_size, (2, T))
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, :3] = 0  # row 1 left padded
    want = reference(idx, attention_mask=mask).logits
    cache = model.new_cache(2, L, static=static, rolling=True)
    got = _chunks(model, idx, mask, cache, [5, 1, 9, 1, 1, 12, 3, 2])
    torch.testing.assert_close(got[0], want[0], **TOL)
    torch.testing.assert_close(got[1, 3:], want[1, 3:], **TOL)


@torch.no_grad()
@pytest.mark.parametrize("window, sinks", [(1, 0), (3, 0), (5, 0), (3, 2), (6, 1)])
def test_the_oldest_ring_slot_is_never_read(window, sinks):
    """A ring keeps one slot more than attention reads (the query's own key comes with its
    step; see RollingKV's size): garbage in the slot the next token overwrites leaves the
    logits bitwise the same, over decode steps and chunks, with left padding; garbage in
    the second-oldest changes them (it is read)."""
    cfg = tiny(window=window, n_layers=2, max_seq_len=64).cfg
    cfg.attention.sink_tokens = sinks
    model = DecoderLM(cfg).eval()
    idx = torch.randint(0, 40, (2, 30))
    mask = torch.ones(2, 30, dtype=torch.long)
    mask[1, :7] = 0  # left padding longer than the window

    def logits(slot: int | None) -> torch.Tensor:
        cache, out, i = model.new_cache(2, 32), [], 0
        for n in [4, 1, 1, 7, 1, 2, 1, 1, 9, 1, 1, 1]:  # 30 tokens
            out.append(model(idx[:, i : i + n], cache=cache, attention_mask=mask[:, i : i + n]))
            i += n
            for ring in cache.layers:
                size = ring.k.shape[2]
                if slot is not None and slot < size:
                    ring.k[:, :, (int(ring.written) + slot) % size] = 1e4
                    ring.v[:, :, (int(ring.written) + slot) % size] = -1e4
        return torch.cat([o.logits for o in out], 1)

    clean = logits(None)
    assert torch.equal(logits(0), clean)
    if window - sinks > 1:
        assert not torch.equal(logits(1), clean)


# --------------------------------------------------------------------------- analysis


@pytest.mark.parametrize("pattern", [None, "LLLG", "LLLLLG"])
@pytest.mark.parametrize("seq_len", [3, 16])
def test_kv_cache_bytes_are_window_bounded_on_local_layers(pattern, seq_len):
    model = tiny(window=5, pattern=pattern, n_layers=6)
    want = model.new_cache(2, seq_len).nbytes
    assert kv_cache_bytes(model.cfg, seq_len, batch=2) == want
    local = 6 if pattern is None else sum(pattern[i % len(pattern)] == "L" for i in range(6))
    entries = local * min(5, seq_len) + (6 - local) * seq_len
    assert want == 2 * entries * 2 * 2 * 8 * 4  # batch, k+v, h_kv, d_h, float32


def test_kv_cache_bytes_of_1e18_layers_come_from_one_period_of_the_pattern():
    """The entries were summed layer by layer: 1e18 layers (attnlab info --set
    model.n_layers=1e18) never finished."""
    from test_cli import watchdog

    cfg = tiny(window=5, pattern="LLLG", n_layers=6).cfg.override({"n_layers": 10**18 + 2})
    periods = 10**18 // 4  # LLLG, then the rest: LL
    local, global_ = 3 * periods + 2, periods
    with watchdog(20):
        got = kv_cache_bytes(cfg, 16, batch=2)
    assert got == 2 * (local * 5 + global_ * 16) * 2 * 2 * 8 * 4  # batch, k+v, h_kv, d_h, fp32


@pytest.mark.parametrize("seq_len", [3, 16])
@pytest.mark.parametrize(
    "preset, changes",
    [
        ("llama-tiny", {"attention.sink_tokens": 2}),  # sinks and ring preallocated
        ("deepseek-tiny", {}),  # latent attention keeps every token: its window only masks
        ("deepseek-v32-tiny", {}),
    ],
    ids=["sinks", "mla", "dsa"],
)
def test_kv_cache_bytes_equal_what_a_windowed_cache_allocates(preset, changes, seq_len):
    from attnlab.presets import get_preset

    cfg = get_preset(preset).override({"attention.sliding_window": 8, **changes})
    model = DecoderLM(cfg)
    assert kv_cache_bytes(cfg, seq_len, batch=2) == model.new_cache(2, seq_len).nbytes


# --------------------------------------------------------------------------- generation


@torch.no_grad()
def _greedy_windowed_stream(model: DecoderLM, prompt: list[int], n_new: int) -> list[int]:
    """Argmax re-run from scratch each step over the whole stream, every layer seeing only
    its window (or max_seq_len on global layers): what rolling decode promises."""
    limit = model.cfg.max_seq_len
    ref = tiny(
        window=limit,
        n_layers=model.cfg.n_layers,
        max_seq_len=10_000,
        position=model.cfg.position.kind,
    )
    ref.load_state_dict(model.state_dict())
    for block, own in zip(ref.blocks, model.blocks):
        block.attn.window = min(own.attn.window or limit, limit)
    ids, out = list(prompt), []
    for _ in range(n_new):
        nxt = int(ref(torch.tensor([ids])).logits[0, -1].argmax())
        out.append(nxt)
        ids.append(nxt)
    return out


@pytest.mark.parametrize("pattern", [None, "LG"])
def test_generate_roll_runs_10x_past_max_seq_len_with_flat_memory(pattern):
    model = tiny(window=4, pattern=pattern, max_seq_len=8, n_layers=2)
    sizes = []
    model.new_cache = _spy(model.new_cache, sizes)
    prompt = torch.randint(0, 40, (5,)).tolist()
    got = model.generate(prompt, 80, overflow="roll")  # 10x max_seq_len
    assert len(got) == 80
    (cache,) = sizes
    before = cache.nbytes
    assert before == sum(t.nbytes for e in cache.layers for t in e.tensors())
    assert got[:30] == _greedy_windowed_stream(model, prompt, 30)
    assert cache.nbytes == before and cache.max_len == 8


def _spy(new_cache, made):
    def wrapped(*a, **kw):
        cache = new_cache(*a, **kw)
        made.append(cache)
        return cache

    return wrapped


def test_generate_overflow_modes():
    model = tiny(window=None, max_seq_len=8, n_layers=2)
    assert len(model.generate([1, 2, 3], 20, overflow="stop")) == 5
    with pytest.raises(ValueError, match="overflow must be one of"):
        model.generate([1, 2], 3, overflow="wrap")
    learned = tiny(window=None, max_seq_len=8, n_layers=2, position="learned")
    with pytest.raises(ValueError, match="needs relative positions"):
        learned.generate([1, 2], 3, overflow="roll")
    with pytest.raises(ValueError, match="rolling cache: it needs use_cache=True"):
        model.generate([1, 2], 3, overflow="roll", use_cache=False)
    # roll on a dense model: each layer sees its last max_seq_len tokens
    prompt = [3, 1, 4, 1, 5]
    assert model.generate(prompt, 20, overflow="roll") == _greedy_windowed_stream(model, prompt, 20)


@pytest.mark.parametrize("use_cache", [True, False])
def test_overflow_stop_ends_each_row_at_its_own_length(use_cache):
    """overflow="stop" ends each row of a batch when its own prompt + new tokens reach
    max_seq_len, as that prompt alone does (the longest prompt does not end the others)."""
    model = tiny(window=None, max_seq_len=8, n_layers=2, position="learned")
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [7]]
    kw = dict(overflow="stop", use_cache=use_cache)
    alone = [model.generate(p, 20, **kw) for p in prompts]
    assert [len(a) for a in alone] == [5, 2, 7]
    assert model.generate(prompts, 20, **kw) == alone
    steps = list(model.stream(prompts, 20, **kw))
    assert len(steps) == 7 and steps[2] == [alone[0][2], None, alone[2][2]]
    assert steps[6] == [None, None, alone[2][6]]


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "change, message",
    [
        ({"attention": {"sliding_window": 4, "layer_pattern": "LXG"}}, "attention.layer_pattern"),
        ({"attention": {"layer_pattern": "LG"}}, "attention.layer_pattern: local layers need"),
        (
            {"attention": {"sliding_window": 64}, "max_seq_len": 32},
            "attention.sliding_window: 64 >= max_seq_len=32",
        ),
    ],
)
def test_bad_long_context_configs_name_the_field(change, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(change)


# --------------------------------------------------------------------------- attention sinks


def _streaming_allowed(n_tokens: int, window: int, sinks: int) -> torch.Tensor:
    """(T, T) bool: the keys of each query in StreamingLLM's reference loop, run with
    start_size = sinks and recent_size = window - sinks - 1 (attnlab's parameters in the
    reference's: the window counts the sinks and the query itself)."""
    allowed = torch.zeros(n_tokens, n_tokens, dtype=torch.bool)
    for p, keys in enumerate(streaming_llm_keys(n_tokens, sinks, window - sinks - 1)):
        allowed[p, keys] = True
    return allowed


@pytest.mark.parametrize("window, sinks", [(6, 2), (2, 1), (5, 4), (10, 3)])
def test_sink_window_mask_is_streaming_llms_reference_loop(window, sinks):
    """sliding_window = w, sink_tokens = n: a query attends to at most w keys, the n sinks
    and itself included, as transformers' SinkCache(window_length=w, num_sink_tokens=n)
    did; StreamingLLM's start_size = n, recent_size = w - n - 1 (its cache holds start +
    recent keys before the query adds its own). Also in chunks (bottom-right queries)."""
    from attnlab.functional.masks import sink_window_mask

    T = 16
    want = _streaming_allowed(T, window, sinks)
    assert int(want.sum(1).max()) == window
    assert torch.equal(sink_window_mask(T, T, window, sinks), want)
    assert torch.equal(sink_window_mask(5, T, window, sinks), want[-5:])


def _streaming_oracle(attn, x: torch.Tensor, window: int, sinks: int) -> torch.Tensor:
    """StreamingLLM by hand, one query at a time: its reference loop's keys (start_size =
    sinks, recent_size = window - sinks - 1), placed at positions 0..m-1 in cache order
    (its position shift), the query at m - 1; un-rotated projections rotated by those
    places."""
    b, T, _ = x.shape
    h, h_kv, d_h = attn.n_heads, attn.n_kv_heads, attn.head_dim
    q, k, v = attn.qkv(x).split((attn.q_dim, attn.kv_dim, attn.kv_dim), dim=-1)
    q = q.view(b, T, h, d_h).transpose(1, 2)
    k = k.view(b, T, h_kv, d_h).transpose(1, 2).repeat_interleave(h // h_kv, 1)
    v = v.view(b, T, h_kv, d_h).transpose(1, 2).repeat_interleave(h // h_kv, 1)
    outs = []
    for p, keep in enumerate(streaming_llm_keys(T, sinks, window - sinks - 1)):
        places = torch.arange(len(keep))[None, :]  # (1, m)
        kr = attn.rope.tables(places).rotate(k[:, :, keep])
        qr = attn.rope.tables(places[:, -1:]).rotate(q[:, :, p : p + 1])
        w = (qr @ kr.transpose(-1, -2) * d_h**-0.5).softmax(-1)
        outs.append(w @ v[:, :, keep])  # (b, h, 1, d_h)
    y = torch.cat(outs, 2).transpose(1, 2).reshape(b, T, h * d_h)
    return attn.out(y)


@torch.no_grad()
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("sizes", [[1] * 20, [7, 1, 1, 9, 2]])
def test_sink_cache_equals_streaming_llm_by_hand(sizes, static):
    window, sinks = 6, 2
    model = tiny(window=window, n_layers=1, max_seq_len=64)
    model.cfg.attention.sink_tokens = sinks
    from attnlab.nn.attention import MultiHeadAttention

    cfg = AttentionConfig(n_heads=4, n_kv_heads=2, sliding_window=window, sink_tokens=sinks)
    attn = MultiHeadAttention(32, cfg, rope=model.rope).eval()
    x = torch.randn(2, sum(sizes), 32)
    cache = model.new_cache(2, 8, static=static, rolling=True)
    cache.layers = [attn.new_cache_entry(cache)]
    got, i = [], 0
    for n in sizes:
        step = cache.begin(n)
        got.append(attn(x[:, i : i + n], positions=step.positions, cache=cache.layers[0]))
        cache.commit()
        i += n
    want = _streaming_oracle(attn, x, window, sinks)
    torch.testing.assert_close(torch.cat(got, 1), want, **TOL)


@torch.no_grad()
def test_sink_model_equals_full_forward_until_the_window_fills():
    model = tiny(window=10, max_seq_len=64)
    model.cfg.attention.sink_tokens = 3
    sink = DecoderLM(model.cfg).eval()
    sink.load_state_dict(model.state_dict())
    assert [b.attn.sinks for b in sink.blocks] == [3] * 4
    idx = torch.randint(0, 40, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, :2] = 0
    full = sink(idx, attention_mask=mask).logits
    cache = sink.new_cache(2, 10)
    got = _chunks(sink, idx, mask, cache, [4, 1, 3, 1, 1])
    torch.testing.assert_close(got[1], full[1], **TOL)
    torch.testing.assert_close(got[0, 2:], full[0, 2:], **TOL)


@pytest.mark.parametrize("position", ["learned", "rope"])
def test_sinks_of_a_left_padded_row_are_its_first_real_tokens(position):
    """Without a cache, past the window: a left-padded row gives the logits of its prompt
    alone (its sinks are its first real tokens, not the pad columns)."""
    cfg = tiny(window=6, max_seq_len=64, position=position).cfg.override(
        {"attention.sink_tokens": 2}
    )
    torch.manual_seed(1)
    model = DecoderLM(cfg).eval()
    idx = torch.randint(0, 40, (2, 14))
    mask = torch.ones(2, 14, dtype=torch.long)
    mask[1, :4] = 0  # row 1: 10 real tokens, more than the window
    with torch.no_grad():
        batch = model(idx, attention_mask=mask).logits
        alone = model(idx[1:, 4:]).logits
    torch.testing.assert_close(batch[1, 4:], alone[0], **TOL)


@torch.no_grad()
@pytest.mark.parametrize("n_kv_heads", [4, 2])
def test_sink_layer_without_a_cache_equals_the_sink_pattern_by_hand(n_kv_heads):
    """Past the window, a layer with sinks and no cache (training, a whole prompt) attends
    at the tokens' own positions to the keys of StreamingLLM's reference loop: query p sees
    key j <= p when j < sinks or p - j < window - sinks. Written out with the naive loop."""
    from attnlab.nn.attention import MultiHeadAttention

    window, sinks, b, T = 6, 2, 2, 14
    cfg = AttentionConfig(
        n_heads=4, n_kv_heads=n_kv_heads, sliding_window=window, sink_tokens=sinks
    )
    attn = MultiHeadAttention(32, cfg).eval()  # no RoPE: q, k, v are the projections
    x = torch.randn(b, T, 32)
    allowed = _streaming_allowed(T, window, sinks)
    q, k, v = attn.qkv(x).split((attn.q_dim, attn.kv_dim, attn.kv_dim), dim=-1)

    def heads(z, n):  # (b, T, n d_h) -> (b, n, T, d_h)
        return z.view(b, T, n, attn.head_dim).transpose(1, 2)

    y = naive_attention(heads(q, 4), heads(k, n_kv_heads), heads(v, n_kv_heads), allowed)
    want = attn.out(y.transpose(1, 2).reshape(b, T, attn.q_dim))
    torch.testing.assert_close(attn(x, positions=torch.arange(T)[None]), want, **TOL)


def test_sink_generation_runs_10x_past_max_seq_len_with_flat_memory():
    torch.manual_seed(0)
    cfg = tiny(window=6, max_seq_len=8, n_layers=2).cfg
    cfg.attention.sink_tokens = 2
    model = DecoderLM(cfg).eval()
    made = []
    model.new_cache = _spy(model.new_cache, made)
    got = model.generate([[1, 2, 3], [4, 5, 6, 7, 8]], 80, overflow="roll")
    assert [len(r) for r in got] == [80, 80]
    (cache,) = made
    assert cache.nbytes == 2 * 2 * (2 * 2 * 2 + 2 * 2 * 4) * 8 * 4  # layers, k+v, sinks+ring
    assert all(int(e.written) == 5 + 79 for e in cache.layers)


def test_sinks_need_a_larger_window():
    for window in (None, 2, 1):
        with pytest.raises(ConfigError, match="attention.sink_tokens: 2 sinks need a sliding"):
            AttentionConfig(sliding_window=window, sink_tokens=2).validate()


# --------------------------------------------------------------------------- learned sink logits


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_learned_sink_logits_equal_an_extra_softmax_column(backend):
    from attnlab.nn.attention import MultiHeadAttention

    torch.manual_seed(0)
    cfg = AttentionConfig(n_heads=4, n_kv_heads=2, sink_logits=True, backend=backend)
    attn = MultiHeadAttention(32, cfg).eval()
    with torch.no_grad():
        attn.sink_logit.copy_(torch.randn(4))
    x = torch.randn(2, 7, 32)
    key_valid = torch.ones(2, 7, dtype=torch.bool)
    key_valid[1, :2] = False
    got = attn(x, mask=key_valid[:, None, None, :])
    # the formula: softmax([s_h, z_1..z_s]) with the sink column dropped, times V
    q, k, v = attn.qkv(x).split((32, 16, 16), dim=-1)
    q = q.view(2, 7, 4, 8).transpose(1, 2)
    k = k.view(2, 7, 2, 8).transpose(1, 2).repeat_interleave(2, 1)
    v = v.view(2, 7, 2, 8).transpose(1, 2).repeat_interleave(2, 1)
    z = q @ k.transpose(-1, -2) / 8**0.5  # (2, 4, 7, 7)
    allowed = torch.ones(7, 7).tril().bool() & key_valid[:, None, None, :]
    z = z.masked_fill(~allowed, float("-inf"))
    sink = attn.sink_logit[None, :, None, None].expand(2, 4, 7, 1)
    w = torch.cat((sink, z), -1).softmax(-1)[..., 1:]
    want = attn.out((w @ v).transpose(1, 2).reshape(2, 7, 32))
    torch.testing.assert_close(got[0], want[0], **TOL)
    torch.testing.assert_close(got[1, 2:], want[1, 2:], **TOL)
    got.sum().backward()
    assert attn.sink_logit.grad is not None and attn.sink_logit.grad.abs().sum() > 0


@torch.no_grad()
def test_learned_sink_logits_under_a_cache_equal_the_full_pass():
    cfg = tiny(window=None, max_seq_len=32).cfg.override({"attention.sink_logits": True})
    torch.manual_seed(0)
    model = DecoderLM(cfg).eval()
    for block in model.blocks:
        block.attn.sink_logit.normal_()
    idx = torch.randint(0, 40, (2, 9))
    full = model(idx).logits
    cache = model.new_cache(2, 16)
    torch.testing.assert_close(_chunks(model, idx, None, cache, [5, 1, 1, 1, 1]), full, **TOL)


@torch.no_grad()
def test_float16_sink_scores_past_65504_stay_finite():
    """float16 q . k above 65504 (below it once scaled): the sink cache's scores and the
    learned sink logits' rescaling are formed in float32; in float16 the products were inf
    before the scale, the sink cache turned the NaN rows into zeros and the rescaling under
    an additive mask gave NaN."""
    from attnlab.functional.masks import to_additive
    from attnlab.functional.sinks import sink_rescale
    from attnlab.nn.attention import MultiHeadAttention

    torch.manual_seed(0)
    q, k = (torch.randn(2, 4, 5, 8) * 60).half(), (torch.randn(2, 2, 5, 8) * 60).half()
    y, sink = torch.randn(2, 4, 5, 8).half(), torch.randn(4)
    mask = to_additive(torch.rand(2, 1, 5, 5) > 0.3)
    got = sink_rescale(y, q, k, sink, mask, causal=True)
    want = sink_rescale(y.float(), q.float(), k.float(), sink, mask, causal=True)
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2)
    cfg = AttentionConfig(n_heads=4, n_kv_heads=2, sliding_window=4, sink_tokens=2)
    outs = []
    for dtype in (torch.float16, torch.float32):
        torch.manual_seed(0)
        attn = MultiHeadAttention(32, cfg).eval().half().to(dtype)
        model = tiny(window=4, n_layers=1)
        cache = model.new_cache(1, 8, dtype=dtype, rolling=True)
        cache.layers = [attn.new_cache_entry(cache)]
        x = (torch.randn(1, 7, 32) * 300).half().to(dtype)
        got = []
        for i in range(7):
            step = cache.begin(1)
            got.append(attn(x[:, i : i + 1], positions=step.positions, cache=cache.layers[0]))
            cache.commit()
        outs.append(torch.cat(got, 1))
    assert outs[0].isfinite().all()
    torch.testing.assert_close(outs[0].float(), outs[1], atol=0.5, rtol=2e-2)
