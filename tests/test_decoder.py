"""DecoderLM: presets build, loss, tied embeddings, gradients; the KV cache against the full
forward pass for every attention kind, position scheme and norm placement; sliding windows;
left-padded batches.

Shapes: b batch, t length, V vocabulary size.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnlab.config import AttentionConfig, FFNConfig, ModelConfig, NormConfig, PositionConfig
from attnlab.models import DecoderLM, build_model
from attnlab.presets import get_preset

TOL = {"atol": 1e-5, "rtol": 1e-5}
V = 50
KV_HEADS = {"mha": None, "gqa": 2, "mqa": 1}
POSITIONS = ["learned", "sinusoidal", "rope-split", "rope-interleaved", "none"]


def tiny(
    kv: str = "gqa",
    position: str = "rope-split",
    placement: str = "pre",
    *,
    window: int | None = None,
    backend: str = "sdpa",
    n_layers: int = 2,
    max_seq_len: int = 24,
) -> DecoderLM:
    kind, _, layout = position.partition("-")
    cfg = ModelConfig(
        vocab_size=V,
        max_seq_len=max_seq_len,
        d_model=32,
        n_layers=n_layers,
        attention=AttentionConfig(
            n_heads=4, n_kv_heads=KV_HEADS[kv], sliding_window=window, backend=backend
        ),
        position=PositionConfig(kind=kind, rope_layout=layout or "split"),
        ffn=FFNConfig(kind="glu" if placement == "pre" else "mlp", multiple_of=16),
        norm=NormConfig(kind="rmsnorm" if placement == "pre" else "layernorm", placement=placement),
        init_std=0.1,  # larger than usual so that layers visibly change the logits
    )
    return DecoderLM(cfg).eval()


# --------------------------------------------------------------------------- presets


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny", "vaswani-tiny"])
def test_preset_loss_matches_cross_entropy_with_ignore_index(name):
    model = build_model(get_preset(name))
    idx = torch.randint(0, model.cfg.vocab_size, (2, 10))
    targets = torch.randint(0, model.cfg.vocab_size, (2, 10))
    targets[0, :4] = -100
    targets[1, 7] = -100
    out = model(idx, targets=targets)
    assert out.logits.shape == (2, 10, model.cfg.vocab_size)
    logits = out.logits.reshape(-1, model.cfg.vocab_size)
    expected = F.cross_entropy(logits, targets.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(out.loss, expected)
    # Written out: mean over kept positions of -log p(target).
    keep = targets.reshape(-1) != -100
    logp = logits.log_softmax(-1)[keep, targets.reshape(-1)[keep]]
    torch.testing.assert_close(out.loss, -logp.mean())
    unmasked = F.cross_entropy(logits, targets.reshape(-1).clamp(min=0))
    assert not torch.allclose(out.loss, unmasked)  # ignoring really changed something


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny", "vaswani-tiny"])
def test_gradient_reaches_every_parameter(name):
    model = build_model(get_preset(name)).train()
    idx = torch.randint(0, model.cfg.vocab_size, (2, 12))
    model(idx, targets=torch.roll(idx, -1, dims=1)).loss.backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None, pname
        assert p.grad.isfinite().all(), pname
        assert p.grad.abs().sum() > 0, pname


def test_tied_embeddings_share_storage():
    tied = build_model(get_preset("gpt2-tiny"))
    assert tied.cfg.tie_embeddings
    assert tied.lm_head.weight is tied.tok_emb.weight
    assert tied.lm_head.weight.data_ptr() == tied.tok_emb.weight.data_ptr()
    with torch.no_grad():
        tied.tok_emb.weight[3].fill_(1.5)
    assert (tied.lm_head.weight[3] == 1.5).all()
    n_unique = sum(p.numel() for p in {id(p): p for p in tied.parameters()}.values())
    assert tied.num_parameters() == n_unique

    untied = build_model(get_preset("llama-tiny"))
    assert not untied.cfg.tie_embeddings
    assert untied.lm_head.weight.data_ptr() != untied.tok_emb.weight.data_ptr()
    before = untied.lm_head.weight.clone()
    with torch.no_grad():
        untied.tok_emb.weight.add_(1.0)
    assert torch.equal(untied.lm_head.weight, before)
    tied_cfg = get_preset("llama-tiny").override({"tie_embeddings": True})
    d, vocab = tied_cfg.d_model, tied_cfg.vocab_size
    assert untied.num_parameters() - build_model(tied_cfg).num_parameters() == d * vocab


def test_learned_positions_beyond_max_seq_len_raise():
    model = tiny(position="learned", max_seq_len=8)
    with pytest.raises(ValueError, match="exceeds max_seq_len=8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_last_only_equals_last_row_of_full_logits():
    model = tiny()
    idx = torch.randint(0, V, (2, 7))
    full = model(idx).logits  # (b, t, V)
    last = model(idx, last_only=True).logits  # (b, 1, V)
    assert last.shape == (2, 1, V)
    torch.testing.assert_close(last, full[:, -1:], **TOL)
    with pytest.raises(ValueError, match="last_only=True"):
        model(idx, targets=idx, last_only=True)


# --------------------------------------------------------------------------- KV cache


def _decode_one_by_one(model: DecoderLM, idx: torch.Tensor) -> torch.Tensor:
    cache = model.new_cache(idx.shape[0], idx.shape[1])
    steps = [model(idx[:, i : i + 1], cache=cache).logits for i in range(idx.shape[1])]
    assert len(cache) == idx.shape[1]
    return torch.cat(steps, dim=1)


def _prefill_in_chunks(model: DecoderLM, idx: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    cache = model.new_cache(idx.shape[0], idx.shape[1] + 4)
    out, start = [], 0
    for size in sizes:
        out.append(model(idx[:, start : start + size], cache=cache).logits)
        start += size
    assert start == idx.shape[1]
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("placement", ["pre", "post"])
@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("kv", list(KV_HEADS))
@torch.no_grad()
def test_cache_equals_full_forward(kv, position, placement):
    model = tiny(kv, position, placement)
    idx = torch.randint(0, V, (2, 11))
    full = model(idx).logits
    torch.testing.assert_close(_decode_one_by_one(model, idx), full, **TOL)
    torch.testing.assert_close(_prefill_in_chunks(model, idx, [4, 1, 5, 1]), full, **TOL)
    torch.testing.assert_close(_prefill_in_chunks(model, idx, [11]), full, **TOL)


@pytest.mark.parametrize(
    "position, attention",
    [
        ("rope-split", {}),
        ("rope-interleaved", {"n_kv_heads": 1}),
        ("learned", {}),
        ("rope-split", {"sliding_window": 4}),  # a ring of the window
        ("rope-split", {"sliding_window": 12, "sink_tokens": 2}),  # StreamingLLM's entry
        # OLMo 2's QK-norm over whole projections, and its norms on the sublayers' outputs
        ("rope-split", {"qk_norm_scope": "projection"}),
        ("rope-interleaved", {"qk_norm_scope": "projection", "sliding_window": 4}),
        ("rope-split", {"qk_norm_scope": "projection", "sliding_window": 12, "sink_tokens": 2}),
    ],
    ids=["gqa", "mqa-interleaved", "learned", "window", "sinks", "projection-gqa",
         "projection-window", "projection-sinks"],
)  # fmt: skip
@torch.no_grad()
def test_cache_equals_full_forward_with_qk_norm(position, attention):
    """QK-norm normalises keys before they enter the cache: every kind of dense entry gives
    the full pass's logits (norm weights away from 1, eps large enough to matter), per
    head and over whole projections (with OLMo 2's post-sublayer norms)."""
    cfg = tiny("gqa", position).cfg.override(
        {"attention.qk_norm": True, "norm.eps": 0.1}
        | {f"attention.{k}": v for k, v in attention.items()}
    )
    if cfg.attention.qk_norm_scope == "projection":
        cfg = cfg.override({"norm.placement": "post_sublayer"})
    torch.manual_seed(0)
    model = DecoderLM(cfg).eval()
    for name, p in model.named_parameters():
        if "q_norm" in name or "k_norm" in name:
            p.uniform_(0.5, 1.5)
    idx = torch.randint(0, V, (2, 11))
    full = model(idx).logits
    torch.testing.assert_close(_decode_one_by_one(model, idx), full, **TOL)
    torch.testing.assert_close(_prefill_in_chunks(model, idx, [4, 1, 5, 1]), full, **TOL)


@pytest.mark.parametrize("position", ["rope-split", "learned"])
@torch.no_grad()
def test_cache_equals_full_forward_eager_backend(position):
    model = tiny("gqa", position, backend="eager")
    idx = torch.randint(0, V, (2, 9))
    full = model(idx).logits
    torch.testing.assert_close(_decode_one_by_one(model, idx), full, **TOL)
    torch.testing.assert_close(_prefill_in_chunks(model, idx, [2, 5, 2]), full, **TOL)
    sdpa = tiny("gqa", position)
    sdpa.load_state_dict(model.state_dict())
    torch.testing.assert_close(sdpa(idx).logits, full, **TOL)


@pytest.mark.parametrize("kv", list(KV_HEADS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_nbytes(kv, dtype):
    """The bytes the cache reports are the storage it really holds, and equal the
    calculator's formula (analysis.kv_cache_bytes, written independently)."""
    from attnlab.analysis import kv_cache_bytes

    model = tiny(kv)
    b, max_len = 3, 17
    cache = model.new_cache(b, max_len, dtype=dtype)
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for entry in cache.layers
        for t in vars(entry).values()
        if isinstance(t, torch.Tensor)
    }
    assert cache.nbytes == sum(storages.values())
    assert cache.nbytes == kv_cache_bytes(model.cfg, max_len, b, dtype)
    assert model.new_cache(1).max_len == model.cfg.max_seq_len
    assert model.new_cache(1).layers[0].k.dtype == model.tok_emb.weight.dtype
    with torch.no_grad():
        model(torch.zeros(b, 5, dtype=torch.long), cache=model.new_cache(b, max_len))


@torch.no_grad()
def test_cache_overflow_raises_clear_error():
    model = tiny()
    cache = model.new_cache(1, 6)
    model(torch.zeros(1, 4, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match=r"KV cache is full: 4 \+ 3 tokens > capacity 6"):
        model(torch.zeros(1, 3, dtype=torch.long), cache=cache)
    assert len(cache) == 4  # the failed call wrote nothing
    model(torch.zeros(1, 2, dtype=torch.long), cache=cache)
    assert len(cache) == 6


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("batch", [1, 3])
@torch.no_grad()
def test_cache_of_another_batch_is_refused_before_it_changes(window, batch):
    """A cache made for 2 rows fed 1 or 3 failed deep inside a layer (a reshape, a cat or a
    broadcast: no word of the cache), after a dense cache had taken the one row's keys into
    both of its rows; it is refused by name and stays as it was."""
    from attnlab.cache import CacheError

    model = tiny("mqa", window=window)
    idx = torch.randint(0, V, (2, 7))
    cache = model.new_cache(2, 12)
    model(idx[:, :5], cache=cache)
    before = [t.clone() for t in cache.state()]
    with pytest.raises(CacheError, match=f"made for batch 2, idx has batch {batch}"):
        model(torch.randint(0, V, (batch, 2)), cache=cache)
    assert len(cache) == 5 and all(torch.equal(a, b) for a, b in zip(before, cache.state()))
    steps = [model(idx[:, i : i + 1], cache=cache).logits for i in (5, 6)]
    torch.testing.assert_close(torch.cat(steps, 1), model(idx).logits[:, 5:], **TOL)


# --------------------------------------------------------------------------- sliding window


@pytest.mark.parametrize("position", ["rope-split", "rope-interleaved", "none"])
@torch.no_grad()
def test_sliding_window_sees_only_the_last_window_tokens(position):
    """One layer with a window of w: the output at position i depends on tokens i-w+1..i
    only, and RoPE / no positions are shift invariant, so it equals running that slice
    alone."""
    w = 3
    model = tiny(position=position, window=w, n_layers=1)
    idx = torch.randint(0, V, (2, 10))
    full = model(idx).logits
    for i in range(10):
        alone = model(idx[:, max(0, i - w + 1) : i + 1]).logits[:, -1]
        torch.testing.assert_close(full[:, i], alone, **TOL)
    unwindowed = tiny(position=position, n_layers=1)
    unwindowed.load_state_dict(model.state_dict())
    reference = unwindowed(idx).logits
    torch.testing.assert_close(full[:, :w], reference[:, :w], **TOL)
    assert not torch.allclose(full[:, w:], reference[:, w:], atol=1e-4)


@pytest.mark.parametrize("kv", ["mha", "mqa"])
@pytest.mark.parametrize("position", ["rope-split", "learned"])
@torch.no_grad()
def test_sliding_window_with_cache(kv, position):
    model = tiny(kv, position, window=4)
    idx = torch.randint(0, V, (2, 13))
    full = model(idx).logits
    torch.testing.assert_close(_decode_one_by_one(model, idx), full, **TOL)
    torch.testing.assert_close(_prefill_in_chunks(model, idx, [3, 6, 1, 3]), full, **TOL)


# --------------------------------------------------------------------------- left padding


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@torch.no_grad()
def test_left_padding_matches_unpadded_rows(position, backend):
    model = tiny("gqa", position, backend=backend)
    short, long = torch.randint(0, V, (5,)), torch.randint(0, V, (8,))
    pad = 3
    idx = torch.stack((torch.cat((torch.zeros(pad, dtype=torch.long), short)), long))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, :pad] = 0
    batch = model(idx, attention_mask=mask).logits
    torch.testing.assert_close(batch[0, pad:], model(short[None]).logits[0], **TOL)
    torch.testing.assert_close(batch[1], model(long[None]).logits[0], **TOL)

    # The same with a KV cache: prefill the padded batch, then decode three more tokens.
    cache = model.new_cache(2, 11)
    prefill = model(idx, attention_mask=mask, cache=cache).logits
    torch.testing.assert_close(prefill, batch, **TOL)
    new = torch.randint(0, V, (2, 3))
    steps = torch.cat([model(new[:, i : i + 1], cache=cache).logits for i in range(3)], dim=1)
    alone_short = model(torch.cat((short, new[0]))[None]).logits[0, -3:]
    alone_long = model(torch.cat((long, new[1]))[None]).logits[0, -3:]
    torch.testing.assert_close(steps[0], alone_short, **TOL)
    torch.testing.assert_close(steps[1], alone_long, **TOL)


@pytest.mark.parametrize("name", ["llama-tiny", "deepseek-tiny"])
def test_cache_of_another_dtype_is_refused_by_name(name):
    """A cache in another dtype than the model's failed deep inside attention ("Expected
    query, key, and value to have the same dtype"), and a float64 linear-attention model
    rounded its state to a float32 cache's; under autocast any dtype decodes."""
    from attnlab.cache import CacheError

    model = build_model(get_preset(name)).eval()
    idx = torch.randint(0, 256, (2, 6))
    with torch.no_grad():
        for dtype in (torch.bfloat16, torch.float64):
            with pytest.raises(CacheError, match="model computes in torch.float32"):
                model(idx, cache=model.new_cache(2, 16, dtype=dtype))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(idx, cache=model.new_cache(2, 16, dtype=torch.bfloat16))
        assert torch.isfinite(out.logits).all()
        linear = build_model(
            get_preset("llama-tiny").override({"attention.kind": "linear"})
        ).double()
        with pytest.raises(CacheError, match="holds torch.float32"):
            linear(idx, cache=linear.new_cache(2, 16, dtype=torch.float32))


@pytest.mark.parametrize(
    "preset,overrides",
    [
        ("llama-tiny", {}),
        ("llama-tiny", {"attention.kind": "nsa"}),
        ("llama-tiny", {"attention.kind": "linear"}),
        ("llama-tiny", {"attention.backend": "flex"}),
        ("deepseek-tiny", {}),
        ("deepseek-v32-tiny", {}),
        ("deepseek-moe-tiny", {}),
        ("xl-tiny", {}),
    ],
)
@torch.no_grad()
def test_an_empty_input_gives_empty_logits_for_every_kind(preset, overrides):
    # As torch's own layers do (and a dense decoder did): (b, 0) ids -> (b, 0, V) logits.
    # MLA, the MoE router, XL, NSA and flex failed with reshape / reduction errors.
    model = build_model(get_preset(preset).override(overrides)).eval()
    ids = torch.zeros(2, 0, dtype=torch.long)
    assert model(ids).logits.shape == (2, 0, model.cfg.vocab_size)


# --------------------------------------------------------------------------- Gemma 3's pieces


def _gemma3(seed: int = 0, **changes) -> DecoderLM:
    """gemma3-tiny (5 local layers : 1 global, window 16, linear RoPE x8 on the global
    layer, base 1e4 on the local ones) with every norm offset random."""
    torch.manual_seed(seed)
    cfg = get_preset("gemma3-tiny").override({"vocab_size": V, "init_std": 0.1, **changes})
    model = DecoderLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5)
    return model


@torch.no_grad()
def test_gemma3_decoder_is_its_blocks_with_a_rope_table_per_layer_kind():
    """The decoder of Gemma 3's pieces, composed by hand: embeddings times sqrt(d_model),
    each local layer rotated by its own unscaled RoPE of base local_rope_theta, each global
    one by rope_theta with its linear scaling, the final norm, the tied head. A model that
    gave every layer one table, or left the embedding unscaled, differs."""
    from attnlab.nn.rope import RotaryEmbedding

    model = _gemma3()
    cfg, pos = model.cfg, model.cfg.position
    assert pos.local_rope_theta == 1e4 and (pos.rope_theta, pos.rope_scaling) == (1e6, "linear")
    idx = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(20)
    local = RotaryEmbedding(cfg.head_dim, pos.local_rope_theta).tables(positions)
    scaled = {"kind": "linear", "factor": pos.rope_factor}
    global_ = RotaryEmbedding(cfg.head_dim, pos.rope_theta, scaling=scaled).tables(positions)
    x = model.tok_emb(idx) * cfg.d_model**0.5
    for i, block in enumerate(model.blocks):
        is_local = cfg.attention.window_of(i) is not None
        assert is_local == (i % 6 != 5)
        x = block(x, positions=positions, rope=local if is_local else global_)
    want = model.lm_head(model.norm(x))
    torch.testing.assert_close(model(idx).logits, want, **TOL)
    one_table = _gemma3(**{"position.local_rope_theta": None, "attention.sliding_window": 16})
    one_table.load_state_dict(model.state_dict())
    assert not torch.allclose(one_table(idx).logits, want, atol=1e-3)
    unscaled = _gemma3(scale_embeddings=False)
    unscaled.load_state_dict(model.state_dict())
    assert not torch.allclose(unscaled(idx).logits, want, atol=1e-3)


@pytest.mark.parametrize("cache", ["dynamic", "static", "rolling"])
@torch.no_grad()
def test_cache_equals_full_forward_with_gemma3_pieces(cache):
    """Past the window of the local layers, with both RoPE tables: one token at a time, in
    chunks, in a static cache (the compiled decode's) and in a rolling one."""
    model = _gemma3(seed=2)
    idx = torch.randint(0, V, (2, 30), generator=torch.Generator().manual_seed(3))
    full = model(idx).logits
    kw = {"static": cache == "static", "rolling": cache == "rolling"}
    for sizes in ([1] * 30, [7, 1, 17, 5]):
        c = model.new_cache(2, 40 if cache != "rolling" else 64, **kw)
        out, start = [], 0
        for size in sizes:
            out.append(model(idx[:, start : start + size], cache=c).logits)
            start += size
        torch.testing.assert_close(torch.cat(out, 1), full, **TOL)


@pytest.mark.slow
def test_generate_compile_equals_eager_generate_with_gemma3_pieces():
    """The compiled decode step (static cache, both RoPE tables) past the window: the
    eager tokens, for one prompt and a left-padded batch."""
    torch._dynamo.reset()
    model = _gemma3(seed=4)
    prompts = [torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (9, 4)]  # fmt: skip
    assert model.generate(prompts[0], 20, compile=True) == model.generate(prompts[0], 20)
    assert model.generate(prompts, 20, compile=True) == model.generate(prompts, 20)
