"""What only a CUDA GPU can check (skipped elsewhere): the compiled decode step replayed as
a CUDA graph, and training in bfloat16 autocast. The Triton kernels' GPU checks live in
test_flash_triton.py.

Run on a GPU machine: ``python -m pytest tests/test_gpu.py tests/test_flash_triton.py``.
"""

from __future__ import annotations

import pytest
import torch

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
