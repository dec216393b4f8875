"""The shared design: registries, the cache protocol (dynamic, static, rolling), RoPE tables
once per forward, compile-readiness, aux outputs, and the sampling edge cases.

Shapes: b batch, t length, V vocabulary size.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch._dynamo

from attnlab.cache import CacheError
from attnlab.config import AttentionConfig, ConfigError, ModelConfig, PositionConfig
from attnlab.generation import sample_next
from attnlab.models import MODELS, DecoderLM, build_model
from attnlab.models.outputs import ModelOutput
from attnlab.nn.registry import ATTENTION, build_attention
from attnlab.presets import get_preset

TOL = {"atol": 1e-5, "rtol": 1e-5}


def tiny(position: str = "rope", window: int | None = None, **kw) -> DecoderLM:
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=40,
        max_seq_len=kw.pop("max_seq_len", 32),
        d_model=32,
        n_layers=2,
        attention=AttentionConfig(n_heads=4, n_kv_heads=2, sliding_window=window),
        position=PositionConfig(kind=position),
        init_std=0.1,
        **kw,
    )
    return DecoderLM(cfg).eval()


# --------------------------------------------------------------------------- registries


def test_registries_build_by_name_and_reject_unknown_names():
    assert "mha" in ATTENTION and MODELS["decoder"] is DecoderLM
    m = build_attention("mha", 32, AttentionConfig(n_heads=4))
    assert type(m).__name__ == "MultiHeadAttention"
    with pytest.raises(ValueError, match="unknown attention kind 'nope'"):
        build_attention("nope", 32, AttentionConfig(n_heads=4))
    with pytest.raises(ConfigError, match="attention.kind: unknown value 'nope'"):
        ModelConfig.from_dict({"attention": {"kind": "nope"}})
    with pytest.raises(ConfigError, match="arch: unknown value 'tree'"):
        ModelConfig.from_dict({"arch": "tree"})
    cfg = ModelConfig.from_dict({"arch": "decoder", "d_model": 32})
    assert isinstance(build_model(cfg), DecoderLM)
    old = ModelConfig().to_dict()
    del old["arch"]  # configs saved before `arch` existed load as decoders
    assert ModelConfig.from_dict(old).arch == "decoder"


def test_output_unpacks_as_logits_and_loss():
    model = tiny()
    idx = torch.randint(0, 40, (2, 5))
    out = model(idx, targets=idx)
    assert isinstance(out, ModelOutput) and out.aux_loss is None and out.metrics == {}
    logits, loss = out
    assert logits is out.logits and loss is out[1]


def test_aux_losses_and_metrics_reach_the_output():
    model = tiny()
    ffn = model.blocks[1].ffn
    ffn.has_aux = True
    hook = ffn.register_forward_hook(
        lambda m, a, o: (
            setattr(m, "aux_loss", o.pow(2).mean()) or setattr(m, "aux_metrics", {"load": 1.5})
        )
    )
    from attnlab.models.outputs import aux_modules

    model._aux = aux_modules(model)
    out = model(torch.randint(0, 40, (1, 6)))
    hook.remove()
    assert out.aux_loss is not None and out.aux_loss.requires_grad
    assert out.metrics == {"blocks.1.ffn/load": 1.5}


@pytest.mark.parametrize("arch", ["encoder", "seq2seq", "vit", "xl"])
def test_every_architecture_gathers_its_modules_aux_losses_and_metrics(arch):
    # docs/design.md: modules with has_aux report aux_loss / aux_metrics; the model sums
    # and gathers them (a mixture-of-experts FFN's balance loss in any architecture)
    torch.manual_seed(0)
    ffn = {"kind": "moe", "n_routed_experts": 4, "n_activated_experts": 2}
    cfg = ModelConfig.from_dict(
        {
            "arch": arch,
            "vocab_size": 40,
            "max_seq_len": 16,
            "d_model": 32,
            "n_layers": 1,
            "attention": {"n_heads": 4},
            "ffn": {**ffn, "seq_aux_loss_coef": 0.01},
        }
    )
    model = build_model(cfg).train()
    idx = torch.randint(0, 40, (2, 8))
    if arch == "seq2seq":
        out = model(idx, idx, targets=idx)
    elif arch == "vit":
        size = (cfg.channels, cfg.image_size, cfg.width)
        out = model(torch.randn(2, *size), targets=torch.tensor([0, 1]))
    else:
        out = model(idx, targets=idx)
    assert out.aux_loss is not None and out.aux_loss.requires_grad
    assert any(key.endswith("/max_vio") for key in out.metrics)


@pytest.mark.parametrize("std", [0.02, 0.04])
def test_init_std_scales_every_matrix_and_residual_projections_by_role(std):
    cfg = get_preset("llama-tiny").override({"init_std": std})
    model = build_model(cfg)
    marked = [n for n, m in model.named_modules() if getattr(m, "residual_projection", False)]
    assert len(marked) == 2 * cfg.n_layers  # attention output and FFN down, each layer
    for name, m in model.named_modules():
        if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
            expected = std / (2 * cfg.n_layers) ** 0.5 if name in marked else std
            assert abs(m.weight.std().item() / expected - 1) < 0.15, name


# --------------------------------------------------------------------------- the cache


@torch.no_grad()
@pytest.mark.parametrize("position", ["rope", "learned", "none"])
@pytest.mark.parametrize("window", [None, 5])
def test_static_cache_equals_dynamic_cache_and_full_forward(position, window):
    """Fixed shapes (writes at tensor slots, attention over the whole capacity with a mask)
    give the dynamic cache's logits, with left padding and chunked prefill."""
    model = tiny(position, window)
    idx = torch.randint(0, 40, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :3] = 0  # row 1 is left padded
    full = model(idx, attention_mask=mask).logits
    for static in (False, True):
        cache = model.new_cache(2, 16, static=static)
        parts = [model(idx[:, :7], cache=cache, attention_mask=mask[:, :7]).logits]
        for i in range(7, 12):
            parts.append(model(idx[:, i : i + 1], cache=cache).logits)
        got = torch.cat(parts, dim=1)
        torch.testing.assert_close(got[0], full[0], **TOL)
        torch.testing.assert_close(got[1, 3:], full[1, 3:], **TOL)  # real tokens of row 1
        assert cache.length == 12


# One per kind of cache entry: dense, ring (window), sinks + ring, global tokens + ring,
# linear-attention state, MLA latent, MLA latent + indexer keys (DSA).
ENTRY_KINDS = {
    "dense": ("llama-tiny", {}),
    "window": ("llama-tiny", {"attention.sliding_window": 6}),
    "sinks": ("llama-tiny", {"attention.sliding_window": 6, "attention.sink_tokens": 2}),
    "global": ("llama-tiny", {"attention.sliding_window": 6, "attention.global_tokens": [0, 2]}),
    "linear": ("llama-tiny", {"attention.kind": "linear"}),
    "latent": ("deepseek-tiny", {}),
    "indexed latent": ("deepseek-v32-tiny", {}),
}


@torch.no_grad()
@pytest.mark.parametrize("kind", list(ENTRY_KINDS))
def test_in_place_reset_leaves_a_fresh_static_cache_at_the_same_addresses(kind):
    """reset(in_place=True) (the CUDA-graph decode reuses its cache so) zeroes the same
    tensors, and decoding then gives what a fresh cache gives, for every kind of entry."""
    name, override = ENTRY_KINDS[kind]
    model = build_model(get_preset(name).override(override)).eval()
    idx = torch.randint(0, model.cfg.vocab_size, (2, 11))
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, :2] = 0  # row 1 left padded

    def decode(cache, ids):
        out = [model(ids[:, :4], cache=cache, attention_mask=mask[:, :4]).logits]
        out += [model(ids[:, i : i + 1], cache=cache).logits for i in range(4, 11)]
        return torch.cat(out, dim=1)

    want = decode(model.new_cache(2, 16, static=True), idx)
    cache = model.new_cache(2, 16, static=True)
    decode(cache, idx.flip(1))  # other tokens first: the reset must forget them
    addresses = [t.data_ptr() for t in cache.state()]
    assert any(t.any() for t in cache.state())
    cache.reset(in_place=True)
    assert [t.data_ptr() for t in cache.state()] == addresses
    assert not any(t.any() for t in cache.state())
    torch.testing.assert_close(decode(cache, idx), want, **TOL)


@pytest.mark.parametrize("kind", [k for k in ENTRY_KINDS if k != "indexed latent"])
def test_forward_and_decoding_make_their_tensors_on_the_models_device(kind):
    """On the meta device, any tensor the code makes without device= is a CPU tensor that
    fails at its first use beside the model's: what a GPU would refuse (the sink and
    global-token masks were made on the CPU). A host read fails there too: off the CPU,
    sdpa fixes up empty rows without looking (a GPU waited at every masked layer). (DSA's
    experts and top-k ties read the host by design, so "indexed latent" is left out.)"""
    name, override = ENTRY_KINDS[kind]
    for backend in ("sdpa", "eager"):
        _forward_and_decode_on_meta(
            get_preset(name).override({**override, "attention.backend": backend})
        )


def _forward_and_decode_on_meta(cfg) -> None:
    model = build_model(cfg).to("meta")
    idx = torch.randint(0, cfg.vocab_size, (2, 11), device="meta")
    out = model(idx, targets=idx)
    out.loss.backward()
    assert out.logits.is_meta
    with torch.no_grad():
        for static in (False, True):
            cache = model.new_cache(2, 16, static=static)
            model(idx[:, :4], cache=cache)
            assert model(idx[:, 4:5], cache=cache).logits.is_meta


@torch.no_grad()
@pytest.mark.parametrize("static", [False, True])
def test_rolling_cache_equals_sliding_window_attention_over_the_stream(static):
    """A rolling cache of capacity L continues past L one token at a time; with relative
    positions that is exactly attention to the last L tokens at every layer, i.e. a
    sliding-window model of window L run over the whole stream."""
    L, T = 8, 20
    model = tiny("rope", max_seq_len=64)
    windowed = tiny("rope", window=L, max_seq_len=64)
    windowed.load_state_dict(model.state_dict())
    idx = torch.randint(0, 40, (2, T))
    reference = windowed(idx).logits  # (2, T, V)
    cache = model.new_cache(2, L, static=static, rolling=True)
    got = [model(idx[:, :6], cache=cache).logits]
    got += [model(idx[:, i : i + 1], cache=cache).logits for i in range(6, T)]
    torch.testing.assert_close(torch.cat(got, dim=1), reference, **TOL)
    assert cache.length == L and cache.wrapped


@torch.no_grad()
@pytest.mark.parametrize("static", [False, True])
def test_rolling_cache_takes_chunks_that_wrap_the_ring(static):
    """A chunk that wraps the ring overwrites keys its own earlier queries still need, and
    one longer than the ring writes some slots twice: each query still sees exactly the
    last L tokens (sliding-window attention of window L over the stream), left padding
    included. (Static: its earlier queries lost those keys; dynamic: it was refused.)"""
    L, T = 8, 40
    model = tiny("rope", max_seq_len=64)
    windowed = tiny("rope", window=L, max_seq_len=64)
    windowed.load_state_dict(model.state_dict())
    idx = torch.randint(0, 40, (2, T))
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, :3] = 0  # row 1 left padded
    reference = windowed(idx, attention_mask=mask).logits  # (2, T, V)
    cache = model.new_cache(2, L, static=static, rolling=True)
    got, i = [], 0
    for n in [5, 6, 1, 1, 12, 1, 3, 11]:  # 5 + 6 wraps; 12 and 11 are longer than the ring
        got.append(model(idx[:, i : i + n], cache=cache, attention_mask=mask[:, i : i + n]))
        i += n
    got = torch.cat([o.logits for o in got], dim=1)
    torch.testing.assert_close(got[0], reference[0], **TOL)
    torch.testing.assert_close(got[1, 3:], reference[1, 3:], **TOL)
    assert cache.length == L and cache.wrapped


def test_rolling_cache_needs_relative_positions():
    with pytest.raises(CacheError, match="needs relative positions"):
        tiny("learned").new_cache(1, 8, rolling=True)


@torch.no_grad()
def test_learned_position_overflow_leaves_the_cache_untouched():
    model = tiny("learned", max_seq_len=8)
    cache = model.new_cache(2, 16)
    model(torch.ones(2, 6, dtype=torch.long), cache=cache)
    state = (cache.length, cache.key_valid.clone(), cache.next_position.clone())
    pad = torch.tensor([[0, 1, 1], [1, 1, 1]])
    with pytest.raises(ValueError, match="exceeds max_seq_len=8"):
        model(torch.ones(2, 3, dtype=torch.long), cache=cache, attention_mask=pad)
    assert cache.length == state[0] and not cache.has_padding
    assert torch.equal(cache.key_valid, state[1]) and torch.equal(cache.next_position, state[2])


# --------------------------------------------------------------------------- compile


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny", "vaswani-tiny", "olmo2-tiny"])
def test_training_forward_has_no_graph_breaks(name):
    model = build_model(get_preset(name))
    idx = torch.randint(0, model.cfg.vocab_size, (2, 16))
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(model)(idx, targets=idx)
    assert explanation.graph_break_count == 0, explanation.break_reasons


# StableLM 2 12B's block: parallel on one biased LayerNorm, a LayerNorm QK-norm per head
_STABLELM_12B_BLOCK = {
    "norm.placement": "parallel_shared",
    "attention.qk_norm": True,
    "attention.qk_norm_kind": "layernorm",
    "attention.qk_norm_weight": "per_head",
}


@pytest.mark.parametrize(
    "name, override, batch",
    [
        ("llama-tiny", {}, 2),
        ("deepseek-moe-tiny", {}, 2),  # experts: each token's chosen experts gathered
        # more choices (8 x top 2) than experts (8): every expert on every token, by gates
        ("deepseek-moe-tiny", {"init_std": 0.2}, 8),
        ("deepseek-v32-tiny", {}, 2),  # DSA: top-k ties settled without a host read
        ("llama-tiny", {"attention.kind": "nsa"}, 2),
        ("deepseek-tiny", {}, 2),  # MLA
        ("llama-tiny", {"attention.kind": "linear"}, 2),
        ("llama-tiny", {"attention.n_kv_heads": 1, "attention.sliding_window": 4}, 2),
        ("llama-tiny", {"attention.sliding_window": 4, "attention.global_tokens": [0, 1]}, 2),
        ("llama-tiny", {"attention.sliding_window": 4, "attention.sink_tokens": 2}, 2),
        ("llama-tiny", {"attention.sliding_window": 4, "attention.sink_logits": True}, 2),
        ("llama-tiny", {"attention.qk_norm": True}, 2),
        ("olmo2-tiny", {}, 2),  # QK-norm over whole projections, norms on sublayer outputs
        # a LayerNorm QK-norm with a weight per head, parallel blocks on biased LayerNorms
        ("stablelm-tiny", _STABLELM_12B_BLOCK, 2),
        ("pythia-tiny", {}, 2),  # parallel blocks, a partial rotation
        ("pythia-tiny", {"norm.placement": "parallel_shared"}, 2),  # one norm per block
        ("phi-tiny", {"tie_embeddings": True}, 2),  # a bias on the (tied) head
        ("gptj-tiny", {}, 2),  # interleaved pairs on a quarter of each head
    ],
)
@torch.no_grad()
def test_decode_step_compiles_with_fullgraph_and_matches_eager(name, override, batch):
    """The static-cache decode step traces as one graph (backend 'eager' checks the
    tracing without paying for code generation; no host read of data-dependent values)
    and gives the eager step's logits, for dense, expert and sparse-attention models."""
    model = build_model(get_preset(name).override(override)).eval()
    prompt = torch.randint(0, model.cfg.vocab_size, (batch, 5))

    def step(model, ids, cache):
        return model(ids, cache=cache, last_only=True).logits[:, -1]

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, dynamic=False, backend="eager")
    eager_cache = model.new_cache(batch, 16)
    static_cache = model.new_cache(batch, 16, static=True)
    model(prompt, cache=eager_cache)
    model(prompt, cache=static_cache)
    tok = prompt[:, -1:]
    for _ in range(4):
        a = step(model, tok, eager_cache)
        b = compiled(model, tok, static_cache)
        torch.testing.assert_close(b, a, **TOL)
        tok = a.argmax(-1, keepdim=True)


def test_compiled_step_compiles_once_per_batch_size(monkeypatch):
    """generate, stream and generation.generate share one compiled step per batch size,
    for prompts of other lengths in the same capacity bucket too: each call hands the step
    inference tensors (dynamo guards on dispatch keys; stream() outside inference mode
    compiled a second version for the same shapes). The 'eager' backend counts the graphs
    without paying for code generation."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    import attnlab.generation as generation

    counter, real = CompileCounterWithBackend("eager"), torch.compile

    def compile_eagerly(fn, options=None, **kw):  # (options: inductor's, which it drops)
        return real(fn, backend=counter, **kw)

    monkeypatch.setattr(generation.torch, "compile", compile_eagerly)
    torch._dynamo.reset()
    counters.clear()
    model = tiny(max_seq_len=128)
    short, long = [3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8, 1, 8, 2]
    want = model.generate(long, 6)
    assert model.generate(long, 6, compile=True) == want
    assert list(model.stream(long, 6, compile=True)) == want
    generation.generate(model, short, 10, compile=True)
    model.generate(short, 3, compile=True)
    assert counter.frame_count == 1
    model.generate([short, long], 4, compile=True)
    list(model.stream([long, short], 4, compile=True))
    assert counter.frame_count == 2  # one more for batch size 2
    assert not counters["graph_break"]


@pytest.mark.slow
def test_generate_compile_equals_eager_generate(monkeypatch):
    import attnlab.nn.linear as linear_module

    # every product of one vector takes the split path (the compiled graph's opaque operator)
    monkeypatch.setattr(linear_module, "SPLIT_MIN_NUMEL", 0)
    torch._dynamo.reset()
    model = build_model(get_preset("llama-tiny").override({"init_std": 0.2})).eval()
    prompt = torch.randint(0, model.cfg.vocab_size, (9,)).tolist()
    assert model.generate(prompt, 12, compile=True) == model.generate(prompt, 12)


@pytest.mark.slow
def test_generate_compile_equals_eager_generate_for_a_padded_batch():
    """A batch of three left-padded prompts (the compiled step's products of three vectors
    are sums over the weight rows, attnlab.nn.linear.rows_matmul): the same tokens as eager
    decoding."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_model(get_preset("llama-tiny").override({"init_std": 0.2})).eval()
    prompts = [torch.randint(0, model.cfg.vocab_size, (n,)).tolist() for n in (9, 4, 6)]
    assert model.generate(prompts, 12, compile=True) == model.generate(prompts, 12)


@pytest.mark.slow
def test_generate_compile_equals_eager_generate_with_experts():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_model(get_preset("deepseek-moe-tiny").override({"init_std": 0.2})).eval()
    prompt = torch.randint(0, model.cfg.vocab_size, (9,)).tolist()
    assert model.generate(prompt, 12, compile=True) == model.generate(prompt, 12)


@pytest.mark.slow
def test_generate_compile_equals_eager_generate_with_sink_logits():
    """gpt-oss-tiny (sink logits on the sdpa backend, a 16-token window on alternate layers,
    experts with biases): two left-padded prompts decoded past the window, compiled and
    eagerly, give the same tokens."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_model(get_preset("gpt-oss-tiny").override({"init_std": 0.2})).eval()
    prompts = [torch.randint(0, model.cfg.vocab_size, (n,)).tolist() for n in (9, 4)]
    assert model.generate(prompts, 14, compile=True) == model.generate(prompts, 14)


# --------------------------------------------------------------------------- sampling


def test_tiny_temperature_is_greedy_not_nan():
    logits = torch.randn(3, 50) * 30
    for t in (1e-6, 1e-12, 1e-30):
        assert torch.equal(sample_next(logits, temperature=t), logits.argmax(-1))


def test_top_k_keeps_exactly_k_tokens_with_ties():
    logits = torch.zeros(1, 10)  # every logit tied
    seen = set()
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        seen.add(int(sample_next(logits, temperature=1.0, top_k=3, generator=g)))
    assert len(seen) == 3


@pytest.mark.slow
def test_train_with_compile_matches_eager_losses(tmp_path):
    """train.compile=true (inductor) trains the same model: losses agree with eager."""
    from attnlab.config import RunConfig
    from attnlab.training import train

    cfg = RunConfig(model=get_preset("llama-tiny")).override(
        {
            "train.max_steps": 4,
            "train.batch_size": 2,
            "train.block_size": 32,
            "train.eval_every": 0,
            "train.log_every": 1,
        }
    )
    eager = train(cfg, tmp_path / "eager", progress=False).losses
    compiled = train(cfg.override({"train.compile": True}), tmp_path / "c", progress=False)
    assert compiled.losses == pytest.approx(eager, rel=1e-4)


def test_compiled_step_restores_the_weights_row_major_once(monkeypatch):
    """Making the compiled decode step (compilation itself waits for the first call)
    re-stores every Linear weight row-major in place: the same parameters, the same
    logits from the eager path, which now takes the row-major split product."""
    import attnlab.generation as gen
    import attnlab.nn.linear as linear_module
    from attnlab.nn.linear import is_input_major

    monkeypatch.setattr(linear_module, "SPLIT_MIN_NUMEL", 0)  # one token: the split product

    model = build_model(get_preset("llama-tiny").override({"init_std": 0.2})).eval()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert any(is_input_major(m.weight) for m in linears)
    params = list(model.parameters())
    idx = torch.randint(0, model.cfg.vocab_size, (1, 7))
    with torch.no_grad():
        before = [model(idx[:, :1]).logits, model(idx).logits]
        gen._compiled_step(model)
        after = [model(idx[:, :1]).logits, model(idx).logits]
    assert all(m.weight.is_contiguous() for m in linears)
    assert all(a is b for a, b in zip(params, model.parameters()))
    for a, b in zip(before, after):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_model_with_a_compiled_step_pickles_and_copies_without_it():
    """generate(compile=True) keeps its compiled step on the model (a local function):
    torch.save(model) / pickle then failed ("Can't pickle local object"), and deepcopy
    shared the step. Both leave it behind; the copy decodes as the original."""
    import copy
    import io

    import attnlab.generation as gen

    model = build_model(get_preset("llama-tiny").override({"init_std": 0.2})).eval()
    gen._compiled_step(model)  # what generate(compile=True) keeps (compiles at its first call)
    assert model._compiled_decode_step is not None
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    copies = [torch.load(buf, weights_only=False), copy.deepcopy(model)]
    prompt = torch.randint(0, model.cfg.vocab_size, (5,)).tolist()
    for other in copies:
        assert getattr(other, "_compiled_decode_step", None) is None
        assert other.generate(prompt, 6) == model.generate(prompt, 6)
    assert model._compiled_decode_step is not None  # the original keeps its own


@pytest.mark.parametrize(
    "name, override",
    [
        ("gpt2-tiny", {}),  # its GELU (tanh) was a lambda kept on each MLP: unpicklable
        ("deepseek-v32-tiny", {}),  # DSA keeps its indexer loss on the module
        ("deepseek-moe-tiny", {"ffn.seq_aux_loss_coef": 0.01}),  # MoE its balance loss
        ("gpt-oss-tiny", {"ffn.switch_aux_loss_coef": 0.01}),  # MoE its Switch statistics
    ],
)
def test_a_model_after_a_training_step_copies_and_pickles_into_an_equal_model(name, override):
    """copy.deepcopy and torch.save(model) after a training pass: the modules' aux losses
    held the step's graph (deepcopy refused a tensor that is not a leaf), GPT-2's GELU was
    a lambda (pickle refused it). The copies share no memory and compute what the
    original does, loss and gradients."""
    import copy
    import io

    model = build_model(get_preset(name).override(override)).train()

    def step(m, idx):
        m.zero_grad()
        out = m(idx, targets=idx)
        (out.loss + (0 if out.aux_loss is None else out.aux_loss)).backward()
        return [out.loss, out.aux_loss, *(p.grad for p in m.parameters())]

    step(model, torch.randint(0, model.cfg.vocab_size, (2, 12)))
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    idx = torch.randint(0, model.cfg.vocab_size, (2, 12))
    for other in (copy.deepcopy(model), torch.load(buf, weights_only=False)):
        ours = {p.untyped_storage().data_ptr() for p in model.parameters()}
        assert not ours & {p.untyped_storage().data_ptr() for p in other.parameters()}
        for got, want in zip(step(other, idx), step(model, idx), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["llama-tiny", "xl-tiny"])
def test_forward_exports_with_torch_export(name):
    """torch.export.export refused the model's output (a dataclass it did not know as a
    pytree); the exported program computes the model's logits."""
    model = build_model(get_preset(name)).eval()
    idx = torch.randint(0, model.cfg.vocab_size, (2, 9))
    program = torch.export.export(model, (idx,))
    idx = torch.randint(0, model.cfg.vocab_size, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(program.module()(idx).logits, model(idx).logits, **TOL)


def test_every_model_output_is_a_pytree_node():
    """Each ModelOutput subclass is registered beside it, as ModelOutput is (torch.export
    refused outputs of an unregistered type): flattening gives its tensors, and unflattening
    gives back the same class with the same fields."""
    import dataclasses

    from torch.utils import _pytree as pytree

    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)

    classes = [ModelOutput, *subclasses(ModelOutput)]
    assert {c.__name__ for c in classes} >= {"ModelOutput", "XLOutput", "Seq2SeqOutput"}
    for cls in classes:
        extra = {f.name: torch.ones(2) for f in dataclasses.fields(cls)
                 if f.name not in ("logits", "loss", "aux_loss", "metrics")}  # fmt: skip
        out = cls(logits=torch.randn(2, 3), loss=torch.tensor(1.5), **extra)
        leaves, spec = pytree.tree_flatten(out)
        assert len(leaves) == 2 + len(extra) and all(isinstance(x, torch.Tensor) for x in leaves)
        back = pytree.tree_unflatten(leaves, spec)
        assert type(back) is cls and torch.equal(back.logits, out.logits), cls.__name__


def test_static_capacity_buckets():
    from attnlab.generation import static_capacity

    assert [static_capacity(n, 2048) for n in (1, 64, 65, 200, 256, 257)] == [
        64, 64, 128, 256, 256, 512,
    ]  # fmt: skip
    assert static_capacity(1500, 1024) == 1024  # never beyond max_seq_len
    assert static_capacity(40, 48) == 48


@pytest.mark.slow
def test_generate_compile_reuses_the_step_within_a_capacity_bucket():
    model = build_model(get_preset("llama-tiny")).eval()
    prompt = torch.randint(0, model.cfg.vocab_size, (9,)).tolist()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    a = model.generate(prompt, 20, compile=True)  # capacity 29 -> bucket 64
    b = model.generate(prompt[:5], 40, compile=True)  # capacity 45 -> bucket 64
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert a == model.generate(prompt, 20) and b == model.generate(prompt[:5], 40)


def test_generate_compile_is_not_stopped_by_dynamos_recompile_limit():
    """Each batch size compiles its own version of the decode step: dynamo's limit on
    versions per function (8 by default; 1 here, as if other shapes and models had used it
    up) must not turn a new shape into an error."""
    torch._dynamo.reset()
    model = build_model(get_preset("llama-tiny").override({"init_std": 0.2})).eval()
    other = build_model(get_preset("llama-tiny")).eval()  # its own step, its own versions
    prompt = torch.randint(0, model.cfg.vocab_size, (5,)).tolist()
    with torch._dynamo.config.patch(recompile_limit=1):
        other.generate(prompt, 3, compile=True)
        for batch in (1, 2):
            prompts = [prompt] * batch
            assert model.generate(prompts, 3, compile=True) == model.generate(prompts, 3)
    assert other._compiled_decode_step is not model._compiled_decode_step


def test_generate_compile_auto_stays_eager_for_short_generations():
    model = build_model(get_preset("llama-tiny")).eval()
    prompt = torch.randint(0, model.cfg.vocab_size, (5,)).tolist()
    assert model.generate(prompt, 6, compile="auto") == model.generate(prompt, 6)
    assert getattr(model, "_compiled_decode_step", None) is None  # nothing was compiled
    with pytest.raises(ValueError, match="compile must be"):
        model.generate(prompt, 2, compile="yes")


def test_generate_compiles_by_default_only_when_long_and_falls_back_to_eager(monkeypatch):
    """The default compile="auto" leaves short generations eager; where it compiles and the
    compilation fails, it warns once and decodes eagerly on the same static cache (same
    tokens) with the eager weight layout back, and stops trying for that model.
    compile=True raises instead."""
    import attnlab.generation as gen
    from attnlab.nn.linear import is_input_major, set_layout

    model = build_model(get_preset("llama-tiny")).eval()
    prompt = torch.randint(0, model.cfg.vocab_size, (5,)).tolist()
    expected = model.generate(prompt, 6, compile=False)
    assert model.generate(prompt, 6) == expected
    assert getattr(model, "_compiled_decode_step", None) is None  # nothing was compiled

    def failing_step(model):
        set_layout(model, "rows")  # as the real one does before compiling

        def step(*args, **kw):
            calls.append(1)
            raise RuntimeError("no C++ compiler found\nmore detail")

        return step

    calls = []
    monkeypatch.setattr(gen, "AUTO_COMPILE_MIN_TOKENS", 1)  # every generation "long"
    monkeypatch.setattr(gen, "_compiled_step", failing_step)
    with pytest.warns(UserWarning, match="compiling the decode step failed .*no C\\+\\+ compiler"):
        assert model.generate(prompt, 6) == expected
    assert len(calls) == 1  # tried once, then eager for the rest of the generation
    assert all(is_input_major(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second attempt, no second warning
        assert model.generate(prompt, 6) == expected
    assert len(calls) == 1
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        model.generate(prompt, 6, compile=True)


def test_compiled_decode_step_runs_in_eval_mode_like_the_eager_step(monkeypatch):
    """A model left in training mode (dropout on) decodes the same with the compiled step as
    with the eager one: both run in eval mode, and the model is back in training mode after.
    (torch.compile replaced by the identity: this checks the step's wrapper, not inductor.)"""
    import attnlab.generation as gen

    model = build_model(get_preset("llama-tiny").override({"dropout": 0.5}))
    assert model.training
    prompt = torch.randint(0, model.cfg.vocab_size, (5,)).tolist()
    eager = model.generate(prompt, 8, compile=False)
    monkeypatch.setattr(gen.torch, "compile", lambda fn, **kw: fn)
    assert model.generate(prompt, 8, compile=True) == eager
    assert model.training and all(m.training for m in model.modules())


def test_compiled_decoding_leaves_the_threads_context_as_it_found_it(monkeypatch):
    """Every guarded compiled step raises dynamo's recompile limit for its call; a fresh
    torch._dynamo.config.patch per step left a context variable of its own in the thread's
    context for good: one more per token of a compiled stream, per generate call. (torch.compile
    replaced by the identity: every step is a guarded one.)"""
    import contextvars

    import attnlab.generation as gen

    monkeypatch.setattr(gen.torch, "compile", lambda fn, **kw: fn)
    model = build_model(get_preset("llama-tiny").override({"n_layers": 1})).eval()
    prompt = torch.randint(0, model.cfg.vocab_size, (5,)).tolist()
    list(model.stream(prompt, 3, compile=True))
    before = len(contextvars.copy_context())
    for _ in range(3):
        list(model.stream(prompt, 8, compile=True))
        model.generate([prompt, prompt], 8, compile=True)
    assert len(contextvars.copy_context()) == before


def test_a_freed_model_takes_its_compiled_decode_step_with_it(monkeypatch):
    """torch keeps a compiled function's code object, and with it every graph compiled from
    it and the ``__compiled_fn`` global each installs in attnlab.generation: a model compiled
    and freed left them behind, for good, one set per model. (dynamo with its eager backend.)"""
    import gc
    import weakref

    import attnlab.generation as gen

    real_compile = torch.compile
    monkeypatch.setattr(
        gen.torch, "compile", lambda fn, **kw: real_compile(fn, backend="eager", **kw)
    )

    def compiled_fns() -> int:
        return sum(name.startswith("__compiled_fn") for name in vars(gen))

    gc.collect()
    before = compiled_fns()
    model = build_model(get_preset("llama-tiny").override({"n_layers": 1})).eval()
    prompt = torch.randint(0, model.cfg.vocab_size, (5,)).tolist()
    model.generate(prompt, 2, compile=True)
    assert compiled_fns() > before
    freed = weakref.ref(model)
    del model
    gc.collect()
    assert freed() is None
    assert compiled_fns() == before


def test_compile_fallback_catches_only_the_compiling_call(monkeypatch):
    """An error after the compiled step has run once is the model's error: it propagates."""
    import attnlab.generation as gen

    model = build_model(get_preset("llama-tiny")).eval()
    prompt = torch.randint(0, model.cfg.vocab_size, (5,)).tolist()

    def flaky_step(model):
        calls = []

        def step(model, ids, mask, cache, skip_guards=False):
            calls.append(1)
            if len(calls) > 1:
                raise RuntimeError("a later failure")
            return gen._forward_last(model, ids, mask, cache)

        return step

    monkeypatch.setattr(gen, "AUTO_COMPILE_MIN_TOKENS", 1)
    monkeypatch.setattr(gen, "_compiled_step", flaky_step)
    with pytest.raises(RuntimeError, match="a later failure"):
        model.generate(prompt, 6)
    assert not getattr(model, "_compile_failed", False)


def test_generate_skips_guards_after_the_first_step_and_keeps_each_models_graph(monkeypatch):
    """Inside generate() only the first compiled step of a call (and the first after the
    cache is re-encoded) goes through dynamo and its guards; the rest call the code that
    ran then directly. Two models of the same shapes but different constants (RMSNorm
    eps), batch sizes 1 and 2 and two capacity buckets, in turns: every call decodes what
    the eager step decodes, so a direct call never runs another variant's graph, and each
    direct call counts itself in dynamo's invocation count as a call through dynamo does
    (cudagraph trees tell steps apart by it). stream() goes through dynamo at every step.
    (dynamo with its eager backend: this checks guard handling, not inductor.)"""
    import attnlab.generation as gen

    real_compile, calls = torch.compile, {"guarded": 0, "direct": 0}
    monkeypatch.setattr(
        gen.torch, "compile", lambda fn, **kw: real_compile(fn, backend="eager", **kw)
    )
    real_code_that_ran = gen._code_that_ran

    def counting(fn, *args):
        calls["guarded"] += 1
        code = real_code_that_ran(fn, *args)
        assert code is not None  # torch 2.13 keeps its entries where this finds them

        def direct(*a):
            calls["direct"] += 1
            return code(*a)

        return direct

    monkeypatch.setattr(gen, "_code_that_ran", counting)
    torch._dynamo.reset()
    torch.manual_seed(0)
    models = [
        build_model(get_preset("llama-tiny").override({"init_std": 0.3, "norm.eps": eps})).eval()
        for eps in (1e-6, 0.5)
    ]
    one = torch.randint(0, models[0].cfg.vocab_size, (7,)).tolist()
    two = [one, one[::-1]]
    runs = [(m, p, n) for p, n in ((one, 10), (two, 6), (one, 70)) for m in models]
    expected = [m.generate(p, n, compile=False) for m, p, n in runs]
    tracker = torch._dynamo.mutation_guard.GenerationTracker
    for i, ((m, p, n), want) in enumerate(zip(runs * 2, expected * 2)):
        calls.update(guarded=0, direct=0)
        before = tracker.generation
        assert m.generate(p, n, compile=True) == want
        assert calls == {"guarded": 1, "direct": n - 2}  # n - 1 decode steps
        if i >= len(runs):  # (compiled by now) each step counts as one call into dynamo,
            assert tracker.generation - before == n - 1  # direct ones too: CUDA graphs
    assert expected[0] != expected[1]  # the eps makes the two models decode differently
    calls.update(guarded=0, direct=0)
    assert [t for t in gen.stream(models[0], one, 10, compile=True)] == expected[0]
    assert calls == {"guarded": 9, "direct": 0}


@pytest.mark.filterwarnings("ignore:prompt \\+ max_new_tokens exceeds max_seq_len")
def test_cuda_graph_decode_cache_logic_on_cpu(monkeypatch):
    """The CUDA-graph decode's kept caches, with the eager step standing in for the graph:
    the same tokens as eager decoding when the context slides or rolls past max_seq_len
    (a window wider than max_seq_len keeps its full ring when rolling), for a batch, with
    stop tokens; one cache per shape, reused in place by the next generation."""
    import attnlab.generation as gen

    def graph_step(model):
        def step(model, ids, mask, cache, skip_guards=False):
            return gen._forward_last(model, ids, mask, cache)

        step.cuda_graphs = True
        return step

    cfg = get_preset("llama-tiny").override({"max_seq_len": 16, "attention.sliding_window": 24})
    model = build_model(cfg).eval()
    vocab = model.cfg.vocab_size
    one, two = torch.randint(0, vocab, (5,)).tolist(), torch.randint(0, vocab, (9,)).tolist()
    cases = [
        (one, 40, {}),  # slides twice
        (one, 40, {"overflow": "roll"}),
        ([one, two], 30, {}),
        ([one, two], 30, {"overflow": "roll"}),
        (two, 12, {"stop_tokens": [one[0], two[0]]}),
    ]
    expected = [model.generate(p, n, compile=False, **kw) for p, n, kw in cases]
    monkeypatch.setattr(gen, "_compiled_step", graph_step)
    for _ in range(2):
        for (p, n, kw), want in zip(cases, expected):
            assert model.generate(p, n, compile=True, **kw) == want
    pool = model.__dict__["_graph_caches"]
    assert sorted(k[:3] for k in pool) == [
        (1, 16, False),
        (1, 16, True),
        (2, 16, False),
        (2, 16, True),
    ]
    kept = pool[(1, 16, True, torch.float32, torch.device("cpu"))]
    assert kept.layers[0].size == 24  # the rolling ring keeps the whole window
    model.generate(one, 40, compile=True, overflow="roll")
    assert pool[(1, 16, True, torch.float32, torch.device("cpu"))] is kept


def test_compiled_step_goes_through_dynamo_where_its_entries_are_not_found(monkeypatch):
    """Without torch's cache-entry internals (another torch version) the direct calls are
    off: every step goes through dynamo, with the same tokens."""
    import attnlab.generation as gen

    real_compile = torch.compile
    monkeypatch.setattr(
        gen.torch, "compile", lambda fn, **kw: real_compile(fn, backend="eager", **kw)
    )
    monkeypatch.delattr(torch._dynamo.eval_frame, "_debug_get_cache_entry_list")
    torch._dynamo.reset()
    model = build_model(get_preset("llama-tiny").override({"init_std": 0.3})).eval()
    prompt = torch.randint(0, model.cfg.vocab_size, (7,)).tolist()
    assert gen._code_that_ran(lambda x: x, 1) is None
    assert model.generate(prompt, 9, compile=True) == model.generate(prompt, 9, compile=False)


def test_compiled_step_keeps_the_code_that_ran_per_cache(monkeypatch):
    """Two decodes in turns (as two threads could interleave them) with caches of batch 1
    and 2: each cache's direct calls run the code compiled for its own shapes, and the
    logits equal the eager step's."""
    import attnlab.generation as gen

    real_compile = torch.compile
    monkeypatch.setattr(
        gen.torch, "compile", lambda fn, **kw: real_compile(fn, backend="eager", **kw)
    )
    torch._dynamo.reset()
    model = build_model(get_preset("llama-tiny")).eval()
    step = gen._compiled_step(model)
    runs = []
    for b in (1, 2):
        prompt = torch.randint(0, model.cfg.vocab_size, (b, 5))
        static, eager = model.new_cache(b, 16, static=True), model.new_cache(b, 16)
        with torch.no_grad():
            model(prompt, cache=static)
            model(prompt, cache=eager)
        runs.append([static, eager, prompt[:, -1:], True])
    for _ in range(4):
        for run in runs:
            static, eager, ids, first = run
            got = step(model, ids, None, static, skip_guards=not first)
            with torch.no_grad():
                want = model(ids, cache=eager, last_only=True).logits[:, -1]
            torch.testing.assert_close(got, want, **TOL)
            run[2:] = [want.argmax(-1, keepdim=True), False]


@pytest.mark.filterwarnings("ignore:prompt \\+ max_new_tokens exceeds max_seq_len")
def test_compiled_generate_slides_its_context_like_eager(monkeypatch):
    """Past max_seq_len the context slides and the cache is re-encoded: the next compiled
    step goes through dynamo again, then calls directly; tokens equal eager decoding's,
    for one slide and for several."""
    import attnlab.generation as gen

    real_compile = torch.compile
    monkeypatch.setattr(
        gen.torch, "compile", lambda fn, **kw: real_compile(fn, backend="eager", **kw)
    )
    torch._dynamo.reset()
    cfg = get_preset("llama-tiny").override({"init_std": 0.3, "max_seq_len": 24})
    model = build_model(cfg).eval()
    prompt = torch.randint(0, model.cfg.vocab_size, (7,)).tolist()
    for n in (30, 50):  # 7 + n tokens overflow 24 once and more than once
        assert model.generate(prompt, n, compile=True) == model.generate(prompt, n)


@pytest.mark.parametrize(
    "name, override",
    [
        ("deepseek-moe-tiny", {}),
        ("deepseek-v32-tiny", {}),
        ("llama-tiny", {"attention.kind": "nsa"}),
        ("deepseek-tiny", {}),
        ("llama-tiny", {"attention.kind": "linear"}),
        ("llama-tiny", {"attention.n_kv_heads": 1, "attention.sliding_window": 4}),
        ("llama-tiny", {"attention.sliding_window": 4, "attention.global_tokens": [0, 1]}),
        ("phi-tiny", {}),  # parallel blocks on one norm, a bias on the head
    ],
)
def test_compiled_generate_equals_eager_for_every_attention_kind(monkeypatch, name, override):
    """generate(compile=True), its steps after the first called directly (dynamo with its
    eager backend: the direct calls, not inductor), decodes what eager decoding does for
    expert, MLA, sparse, linear and windowed models, a batch of two prompts."""
    import attnlab.generation as gen

    real_compile = torch.compile
    monkeypatch.setattr(
        gen.torch, "compile", lambda fn, **kw: real_compile(fn, backend="eager", **kw)
    )
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_model(get_preset(name).override({**override, "init_std": 0.2})).eval()
    prompts = [torch.randint(0, model.cfg.vocab_size, (n,)).tolist() for n in (6, 3)]
    assert model.generate(prompts, 9, compile=True) == model.generate(prompts, 9)


@pytest.mark.parametrize("batch", [1, 3])
def test_compiled_decode_step_of_a_float64_model_stays_float64(monkeypatch, batch):
    """The compiled decode step of a float64 model computes in float64 (nothing rounds it
    to float32): its logits equal the eager step's to float64 precision. Its products of a
    few vectors (rows_matmul) were accumulated in float32: errors of about 1e-7."""
    import attnlab.generation as gen

    real_compile = torch.compile
    monkeypatch.setattr(
        gen.torch, "compile", lambda fn, **kw: real_compile(fn, backend="aot_eager", **kw)
    )
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_model(get_preset("llama-tiny").override({"init_std": 0.2})).double().eval()
    prompt = torch.randint(0, model.cfg.vocab_size, (batch, 5))
    eager, static = model.new_cache(batch, 16), model.new_cache(batch, 16, static=True)
    step = gen._compiled_step(model)
    want = gen._forward_last(model, prompt, None, eager)
    gen._forward_last(model, prompt, None, static)
    for _ in range(3):
        tok = want.argmax(-1, keepdim=True)
        want = gen._forward_last(model, tok, None, eager)
        got = step(model, tok, None, static)
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize(
    "preset", ["llama-tiny", "xl-tiny", "deepseek-v32-tiny", "transformer-numbers", "vit-digits"]
)
def test_float64_model_loss_stays_float64(preset):
    """A float64 model's loss (and DSA's indexer target) is computed in float64: an upcast
    for half precision, never a rounding of float64 to float32."""
    from attnlab.presets import get_run_preset

    torch.manual_seed(0)
    run = preset in ("transformer-numbers", "vit-digits")
    cfg = get_run_preset(preset).model if run else get_preset(preset)
    model = build_model(cfg).double()
    if preset == "vit-digits":
        targets = torch.tensor([3, 7])
        out = model(torch.rand(2, 1, 8, 8, dtype=torch.float64), targets=targets)
    else:
        targets = torch.randint(0, cfg.vocab_size, (2, 9))
        args = (targets, targets) if preset == "transformer-numbers" else (targets,)
        out = model(*args, targets=targets)
    assert out.loss.dtype == torch.float64
    ref = torch.nn.functional.cross_entropy(out.logits.flatten(0, -2), targets.flatten())
    smoothing = getattr(cfg, "label_smoothing", 0.0)
    if not smoothing:
        assert abs(out.loss.item() - ref.item()) < 1e-12


@pytest.mark.parametrize("head", ["mlm", "classification", "regression", "token", "qa"])
def test_float64_encoder_head_losses_stay_float64(head):
    from attnlab.models import encoder

    logits = torch.randn(2, 5, 3, dtype=torch.float64)
    if head == "mlm":
        loss = encoder.MaskedLMHead.loss(logits, torch.randint(0, 3, (2, 5)))
    elif head == "classification":
        loss = encoder.SequenceClassificationHead.loss(logits[:, 0], torch.tensor([0, 2]))
    elif head == "regression":
        loss = encoder.SequenceClassificationHead.loss(logits[:, 0, :1], torch.rand(2))
    elif head == "token":
        loss = encoder.TokenClassificationHead.loss(logits, torch.randint(0, 3, (2, 5)))
    else:
        loss = encoder.QuestionAnsweringHead.loss(logits[..., :2], torch.tensor([[1, 2], [0, 4]]))
    assert loss.dtype == torch.float64


def test_decoding_and_evaluation_restore_every_modules_own_mode():
    """generate, beam search, the task's eval_mode, XL, seq2seq and GRU decoding run in
    eval mode and then give each module its own mode back: a submodule the caller put in
    eval mode (a frozen part) stays there, the rest trains again (model.train(True) would
    have switched the frozen part's dropout back on)."""
    from attnlab.generation import beam_search, generate
    from attnlab.models.rnn import GRUSeq2Seq
    from attnlab.presets import get_run_preset
    from attnlab.tasks.base import eval_mode

    def check(model, run):
        model.train()
        frozen = next(m for m in model.modules() if m is not model and list(m.children()))
        frozen.eval()
        before = {name: m.training for name, m in model.named_modules()}
        seen = []  # the mode of every module that runs
        hook = torch.nn.modules.module.register_module_forward_pre_hook(
            lambda m, args: seen.append(m.training)
        )
        try:
            run(model)
        finally:
            hook.remove()
        assert seen and not any(seen)  # eval mode inside
        assert {name: m.training for name, m in model.named_modules()} == before

    lm = tiny()
    check(lm, lambda m: generate(m, [1, 2, 3], 3))
    check(lm, lambda m: beam_search(m, [[1, 2], [3]], 3, num_beams=2))

    def evaluate(m):
        with eval_mode(m):
            m(torch.tensor([[1, 2]]))

    check(lm, evaluate)
    xl = build_model(get_preset("xl-tiny"))
    check(xl, lambda m: m.generate([1, 2, 3], 3))
    seq2seq = build_model(get_run_preset("transformer-numbers").model)
    check(seq2seq, lambda m: m.generate(torch.tensor([[5, 6, 7]]), 3, num_beams=2))
    gru = build_model(get_run_preset("gru-numbers").model)
    assert isinstance(gru, GRUSeq2Seq)
    check(gru, lambda m: m.generate(torch.tensor([[5, 6, 7]]), 3))
