"""What only a CUDA GPU can check (skipped elsewhere): the compiled decode step replayed as
a CUDA graph, training in bfloat16 autocast, and every model kind, attention backend and
architecture on the GPU against the same model on the CPU. The Triton kernels' GPU checks live in
test_flash_triton.py.

Run on a GPU machine: ``python -m pytest tests/test_gpu.py tests/test_flash_triton.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_design import ENTRY_KINDS

from attnlab.models import build_model
from attnlab.presets import get_preset

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("preset", ["llama-tiny", "deepseek-tiny"])
def test_cuda_graph_decode_gives_the_eager_tokens(preset):
    """Float32, so eager and compiled agree token for token: several generations (one
    kept cache per shape, so no recompiling and no re-recording), a batch of left-padded
    prompts, the graph really replayed (no cudagraph skips), and recorded once per shape,
    not once per step."""
    import attnlab.generation as gen

    assert gen.CUDA_GRAPHS
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = build_model(get_preset(preset)).cuda().eval()
    vocab = model.cfg.vocab_size
    prompts = [torch.randint(0, vocab, (n,)).tolist() for n in (5, 9, 3)]
    for prompt in prompts:
        assert model.generate(prompt, 24, compile=True) == model.generate(prompt, 24)
    batch = prompts[:2]
    assert model.generate(batch, 12, compile=True) == model.generate(batch, 12)
    assert model._compiled_decode_step.cuda_graphs
    inductor = torch._dynamo.utils.counters["inductor"]
    assert not inductor["cudagraph_skips"]
    # each recording adds its inputs that are not static (the token ids): a few in all,
    # where a graph recorded per step would add one for each of the ~80 steps above
    assert 0 < inductor["cudagraph_recorded_non_static_inputs"] <= 8
    # one graph per batch size: the later generations of batch 1 did not recompile
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2
    # and one kept cache per shape, reused in place (the graph replays at its addresses)
    pool = model.__dict__["_graph_caches"]
    assert sorted(key[:2] for key in pool) == [(1, 64), (2, 64)]
    kept = next(c for key, c in pool.items() if key[0] == 1)
    addresses = [t.data_ptr() for t in kept.state()]
    model.generate(prompts[0], 8, compile=True)
    assert next(c for key, c in pool.items() if key[0] == 1) is kept
    assert [t.data_ptr() for t in kept.state()] == addresses
    # a generation running beside another gets a cache of its own: the same tokens
    first = model.stream(prompts[0], 10, compile=True)
    head = next(first)
    beside = list(model.stream(prompts[0], 10, compile=True))
    assert [head, *first] == beside == model.generate(prompts[0], 10)


def test_cuda_graphs_off_compiles_a_plain_step():
    import attnlab.generation as gen

    torch._dynamo.reset()
    model = build_model(get_preset("llama-tiny")).cuda().eval()
    prompt = torch.randint(0, model.cfg.vocab_size, (6,)).tolist()
    eager = model.generate(prompt, 16)
    try:
        gen.CUDA_GRAPHS = False
        assert model.generate(prompt, 16, compile=True) == eager
        assert not model._compiled_decode_step.cuda_graphs
    finally:
        gen.CUDA_GRAPHS = True
    assert model.generate(prompt, 16, compile=True) == eager  # recompiled with the graph
    assert model._compiled_decode_step.cuda_graphs


def test_bf16_training_on_cuda_learns(tmp_path):
    """A few compiled bfloat16-autocast steps on the GPU lower the loss of a fixed batch."""
    from attnlab.presets import get_run_preset
    from attnlab.training.trainer import Trainer, _StopRequest

    cfg = get_run_preset("quick").override(
        {"train.device": "cuda", "train.dtype": "bfloat16", "train.compile": True,
         "train.eval_every": 0, "train.time_budget": None, "train.max_steps": 40}
    )  # fmt: skip
    tr = Trainer(cfg, str(tmp_path / "run"), progress=False)
    assert next(tr.model.parameters()).device.type == "cuda"
    stop, never = _StopRequest(), lambda: False
    losses = [float(tr._train_step(stop, never).loss) for _ in range(40)]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 1.0  # (CPU, same steps: -1.9)


# ------------------------------------------------------------------ the same model on CUDA
# Every model kind, run on the GPU with the CPU model's weights, gives the CPU's outputs,
# gradients and tokens: what the meta-device test in test_design.py checks by construction
# (no tensor made on the CPU, no host read), checked here on the device itself. Float32:
# matmuls without TF32, so CUDA and CPU differ by rounding alone.

CLOSE = {"atol": 1e-4, "rtol": 1e-4}
NSA = {
    "attention.kind": "nsa", "attention.n_kv_heads": 2, "attention.nsa_block_len": 4,
    "attention.nsa_stride": 2, "attention.nsa_select_len": 4, "attention.nsa_n_select": 4,
    "attention.nsa_window": 5,
}  # fmt: skip
DECODER_KINDS = {
    **ENTRY_KINDS,
    "nsa": ("llama-tiny", NSA),
    "moe": ("deepseek-moe-tiny", {}),
    "gpt2": ("gpt2-tiny", {}),
    "sinusoidal post-norm": ("vaswani-tiny", {}),
    "gpt-oss": ("gpt-oss-tiny", {}),  # sink logits, router and expert biases, clamped SwiGLU
}


def _on_cuda(model):
    return copy.deepcopy(model).cuda()


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.cpu() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", list(DECODER_KINDS))
def test_every_decoder_kind_trains_and_decodes_on_cuda_as_on_cpu(kind):
    """Loss, logits of a left-padded batch (sdpa's fix-up of rows with no key runs on the
    GPU without looking) and gradients as on the CPU; greedy decoding gives the CPU's tokens,
    eager and compiled (the compiled step a CUDA graph)."""
    name, override = DECODER_KINDS[kind]
    torch._dynamo.reset()
    cpu = build_model(get_preset(name).override(override)).train()
    gpu = _on_cuda(cpu)
    vocab = cpu.cfg.vocab_size
    idx = torch.randint(0, vocab, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :3] = 0
    want = cpu(idx, targets=idx)
    got = gpu(idx.cuda(), targets=idx.cuda())
    torch.testing.assert_close(got.loss.cpu(), want.loss, **CLOSE)
    torch.testing.assert_close(got.logits.cpu(), want.logits, **CLOSE)
    want.loss.backward()
    got.loss.backward()
    want_grads, got_grads = _grads(cpu), _grads(gpu)
    assert want_grads.keys() == got_grads.keys() and want_grads
    for n in want_grads:
        torch.testing.assert_close(got_grads[n], want_grads[n], **CLOSE, msg=n)
    cpu.eval(), gpu.eval()
    if kind not in ("linear", "nsa"):  # attention masks: multi-head and latent attention
        with torch.no_grad():
            padded = cpu(idx, attention_mask=mask).logits
            on_gpu = gpu(idx.cuda(), attention_mask=mask.cuda()).logits.cpu()
        torch.testing.assert_close(on_gpu[0], padded[0], **CLOSE)
        torch.testing.assert_close(on_gpu[1, 3:], padded[1, 3:], **CLOSE)
    prompts = [idx[0, :5].tolist(), idx[1, :8].tolist()]
    tokens = cpu.generate(prompts, 10)
    assert gpu.generate(prompts, 10) == tokens
    assert gpu.generate(prompts, 10, compile=True) == tokens
    assert gpu.generate(prompts[0], 10, compile=True) == cpu.generate(prompts[0], 10)


@pytest.mark.parametrize("backend", ["eager", "sdpa", "flash", "triton", "flex"])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("sinks", [False, True], ids=["", "sink logits"])
def test_every_attention_backend_on_cuda_gives_the_cpus_model(backend, window, sinks):
    """Each backend on the GPU (``flash`` runs the Triton kernels there, whose forward starts
    each row from the sink logit) against the CPU's eager attention: logits, gradients (the
    sink logits' too), and packed documents' logits."""
    override = {"attention.sliding_window": window, "attention.sink_logits": sinks}
    cpu = build_model(get_preset("llama-tiny").override(override)).train()
    with torch.no_grad():
        for name, p in cpu.named_parameters():
            if name.endswith("sink_logit"):
                p.normal_(std=1.5)
    gpu = build_model(get_preset("llama-tiny").override({**override, "attention.backend": backend}))
    gpu.load_state_dict(cpu.state_dict())
    gpu = gpu.cuda().train()
    idx = torch.randint(0, cpu.cfg.vocab_size, (2, 40))
    want = cpu(idx, targets=idx)
    got = gpu(idx.cuda(), targets=idx.cuda())
    torch.testing.assert_close(got.logits.cpu(), want.logits, **CLOSE)
    want.loss.backward()
    got.loss.backward()
    want_grads, got_grads = _grads(cpu), _grads(gpu)
    for n in want_grads:
        torch.testing.assert_close(got_grads[n], want_grads[n], **CLOSE, msg=n)
    docs = torch.tensor([[0] * 15 + [1] * 25, [0] * 30 + [1] * 10])
    with torch.no_grad():
        want = cpu(idx, doc_ids=docs).logits
        got = gpu(idx.cuda(), doc_ids=docs.cuda()).logits.cpu()
    torch.testing.assert_close(got, want, **CLOSE)


def _arch_cfg(arch: str):
    from attnlab.config import ModelConfig

    return ModelConfig.from_dict(
        {"arch": arch, "vocab_size": 40, "max_seq_len": 32, "d_model": 32, "n_layers": 2,
         "attention": {"n_heads": 4}, "ffn": {"kind": "moe", "n_routed_experts": 4,
         "n_activated_experts": 2, "seq_aux_loss_coef": 0.01}}
    )  # fmt: skip


@pytest.mark.parametrize("arch", ["encoder", "seq2seq", "vit", "xl"])
def test_every_architecture_on_cuda_gives_the_cpus_outputs(arch):
    """The encoder (with padding), encoder-decoder (and its greedy and beam decoding),
    ViT and Transformer-XL (and its decoding with segment memory) on the GPU, each with a
    mixture-of-experts FFN, against the same model on the CPU."""
    cpu = build_model(_arch_cfg(arch)).train()
    gpu = _on_cuda(cpu)
    idx = torch.randint(3, 40, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 7:] = 0

    def run(model, device):
        x, m = idx.to(device), mask.to(device)
        if arch == "seq2seq":
            return model(x, x, src_mask=m.bool(), targets=x)
        if arch == "vit":
            g = torch.Generator().manual_seed(1)
            images = torch.randn(2, model.cfg.channels, model.cfg.image_size, model.cfg.width,
                                 generator=g)  # fmt: skip
            return model(images.to(device), targets=torch.tensor([0, 1], device=device))
        if arch == "encoder":
            return model(x, attention_mask=m, targets=x)
        return model(x, targets=x)

    want, got = run(cpu, "cpu"), run(gpu, "cuda")
    torch.testing.assert_close(got.loss.cpu(), want.loss, **CLOSE)
    (want.loss + want.aux_loss).backward()
    (got.loss + got.aux_loss).backward()
    want_grads, got_grads = _grads(cpu), _grads(gpu)
    assert want_grads.keys() == got_grads.keys() and want_grads
    for n in want_grads:
        torch.testing.assert_close(got_grads[n], want_grads[n], **CLOSE, msg=n)
    cpu.eval(), gpu.eval()
    if arch == "seq2seq":
        for beams in (1, 3):
            want = cpu.generate(idx, 8, src_mask=mask.bool(), num_beams=beams)
            got = gpu.generate(idx.cuda(), 8, src_mask=mask.bool().cuda(), num_beams=beams)
            assert got == want
    if arch == "xl":
        prompt = idx[0].tolist()
        assert gpu.generate(prompt, 40) == cpu.generate(prompt, 40)  # past the memory


def test_gru_encoder_decoder_on_cuda_decodes_as_on_cpu():
    from attnlab.models.rnn import GRUSeq2Seq, RNNSeq2SeqConfig

    cfg = RNNSeq2SeqConfig(src_vocab_size=9, vocab_size=8, embed_dim=8, hidden_dim=12)
    cpu = GRUSeq2Seq(cfg).eval()
    gpu = _on_cuda(cpu)
    src = torch.randint(3, 9, (3, 6))
    mask = torch.arange(6)[None, :] < torch.tensor([6, 3, 1])[:, None]
    for beams in (1, 3):
        want = cpu.generate(src, 8, src_mask=mask, num_beams=beams)
        assert gpu.generate(src.cuda(), 8, src_mask=mask.cuda(), num_beams=beams) == want


@pytest.mark.parametrize(
    "dtype, kernel",
    [(torch.float32, "efficient"), (torch.bfloat16, "flash"), (torch.bfloat16, "efficient")],
    ids=str,
)
@pytest.mark.parametrize(
    "case", ["causal", "decode rows", "window", "padding", "grouped", "keys only"]
)
def test_sdpa_with_sink_logits_on_cuda_uses_the_kernels_log_sum_exp(
    case, dtype, kernel, monkeypatch
):
    """``sdpa`` with sink logits on a GPU calls a CUDA kernel for its log-sum-exp
    (FlashAttention-2 for bfloat16 without a mask, else the memory-efficient one; never
    ``sink_rescale``, which forms the (t, s) scores): output and the gradients of q, k, v
    and the sinks against eager attention in float64."""
    import attnlab.functional.attention as attention_module
    from attnlab.functional.attention import attend

    def refuse(*args, **kwargs):
        raise AssertionError("sink_rescale formed the (t, s) scores")

    monkeypatch.setattr(attention_module, "sink_rescale", refuse)
    if kernel == "efficient":
        monkeypatch.setattr(attention_module, "flash_kernel_fits", lambda device: False)
    g = torch.Generator().manual_seed(3)
    h, h_kv = 4, (2 if case == "grouped" else 4)
    t, s = {"decode rows": (5, 50), "keys only": (1, 37)}.get(case, (37, 37))
    q = torch.randn(2, h, t, 64, generator=g)
    k, v = torch.randn(2, 2, h_kv, s, 64, generator=g)
    sinks = torch.randn(h, generator=g) * 1.5
    kw: dict = {"causal": case != "padding"}
    if case == "window":
        kw["window"] = 9
    if case == "padding":  # key padding (b, 1, 1, s), and one batch row with a single key
        mask = torch.arange(s)[None, :] < torch.tensor([s, 1])[:, None]
        kw["mask"] = mask[:, None, None, :]
    tensors = [x.cuda().requires_grad_() for x in (q, k, v, sinks)]
    wide = [x.detach().double().requires_grad_() for x in tensors]

    def run(xs, backend, dt):
        q, k, v, sinks = xs
        mask = kw.get("mask")
        rest = {**kw, "mask": None if mask is None else mask.cuda()}
        out = attend(q.to(dt), k.to(dt), v.to(dt), backend=backend, sinks=sinks, **rest)
        (out.float() * torch.linspace(-1, 1, out.shape[-1], device="cuda")).sum().backward()
        return out

    got = run(tensors, "sdpa", dtype)
    want = run(wide, "eager", torch.float64)
    tol = {"atol": 2e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
    torch.testing.assert_close(got.double(), want, **tol)
    for name, a, b in zip("q k v sinks".split(), tensors, wide, strict=True):
        torch.testing.assert_close(a.grad.double(), b.grad, **tol, msg=name)


def test_sdpa_with_sink_logits_on_cuda_keeps_linear_memory_and_compiles():
    """At 8,192 tokens the (t, s) scores of 4 heads would be 1 GiB of float32: forward and
    backward stay far below, and ``torch.compile`` (fullgraph) gives eager's output."""
    from attnlab.functional.attention import attend

    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (
            torch.randn(1, 4, 8192, 64, device="cuda", dtype=dtype, requires_grad=True)
            for _ in range(3)
        )
        sinks = torch.zeros(4, device="cuda", requires_grad=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        attend(q, k, v, causal=True, backend="sdpa", sinks=sinks).sum().backward()
        torch.cuda.synchronize()
        assert torch.cuda.max_memory_allocated() - base < 256 * 2**20, dtype
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        x = [torch.randn(2, 4, 40, 32, device="cuda", dtype=dtype) for _ in range(3)]
        sinks = torch.randn(4, device="cuda")
        fn = torch.compile(
            lambda q, k, v, s: attend(q, k, v, causal=True, backend="sdpa", sinks=s),
            fullgraph=True,
        )
        eager = attend(*x, causal=True, backend="sdpa", sinks=sinks)
        torch.testing.assert_close(fn(*x, sinks), eager, atol=tol, rtol=tol)
