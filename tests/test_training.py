"""The training loop: schedule, parameter groups, learning, accumulation, exact resume
(in process and after a real SIGTERM), NaN handling, time budgets, metrics, and 2-process
data parallelism."""

from __future__ import annotations

import dataclasses
import importlib.util
import io
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import attnlab.training.trainer as trainer_module
from attnlab.config import ConfigError, DataConfig, RunConfig, TrainConfig
from attnlab.data import prepare_data
from attnlab.models import LMOutput, build_model
from attnlab.nn.linear import Linear
from attnlab.presets import (
    get_preset,
    get_run_preset,
    gpt2_style,
    list_presets,
    list_run_presets,
)
from attnlab.training import (
    TrainingError,
    build_optimizer,
    evaluate,
    load_checkpoint,
    lr_at,
    parameter_groups,
    train,
)
from attnlab.training.metrics import read_metrics
from attnlab.training.optim import decaying

REPO = Path(__file__).resolve().parents[1]
HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data_cache")


@pytest.fixture(scope="module")
def dataset(cache_dir):
    return prepare_data(DataConfig(), cache_dir=cache_dir)  # the embedded corpus, char level


def tiny_run(*, dropout: float = 0.0, **train_kw) -> RunConfig:
    model = gpt2_style(
        vocab_size=256, max_seq_len=32, d_model=32, n_layers=2, n_heads=2, dropout=dropout
    )
    train_cfg = dict(
        batch_size=4,
        max_steps=12,
        warmup_steps=3,
        lr=3e-3,
        min_lr=3e-4,
        eval_every=0,
        eval_batches=2,
        log_every=1,
        seed=0,
    )
    train_cfg.update(train_kw)
    return RunConfig(model=model, train=TrainConfig(**train_cfg))


def final_weights(out_dir) -> dict[str, torch.Tensor]:
    return load_checkpoint(out_dir).model.state_dict()


def grad_norms(out_dir) -> list[float]:
    return [r["grad_norm"] for r in read_metrics(out_dir / "metrics.jsonl") if r["kind"] == "train"]


def assert_weights_close(a: dict, b: dict, *, tol: float) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=tol, atol=tol, msg=name)


class InterruptingDataset:
    """Wraps a dataset; sends ``sig`` to this process while the ``at``-th training
    micro-batch is being fetched, i.e. in the middle of an optimizer step."""

    def __init__(self, inner, at: int, sig=signal.SIGTERM):
        self.inner, self.at, self.sig, self.calls = inner, at, sig, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def batch(self, split, starts, block_size, device=None):
        if split == "train":
            self.calls += 1
            if self.calls == self.at:
                os.kill(os.getpid(), self.sig)
        return self.inner.batch(split, starts, block_size, device)


# --------------------------------------------------------------------------- optimiser


def test_schedule_matches_formula():
    cfg = TrainConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10, max_steps=110)
    for step in range(10):  # linear warm-up reaching lr * 10/11 at the last warm-up step
        assert lr_at(step, cfg) == pytest.approx(1e-3 * (step + 1) / 11, rel=1e-12)
    for step in range(10, 111):
        r = (step - 10) / 100
        # Independent form of the cosine: (1 + cos(pi r)) / 2 == cos(pi r / 2)^2.
        expected = 1e-4 + (1e-3 - 1e-4) * math.cos(math.pi * r / 2) ** 2
        assert lr_at(step, cfg) == pytest.approx(expected, rel=1e-12)
    assert lr_at(10, cfg) == pytest.approx(1e-3)
    assert lr_at(60, cfg) == pytest.approx(5.5e-4)  # half way: the mean of lr and min_lr
    assert lr_at(500, cfg) == 1e-4
    assert lr_at(60, cfg, total_steps=210) == pytest.approx(
        1e-4 + 9e-4 * math.cos(math.pi * 0.25 / 2) ** 2
    )


def test_wsd_schedule_matches_formula():
    """Warm-up, stable, decay: the peak rate held until the last decay_fraction of the
    post-warm-up steps, then a straight line down to min_lr."""
    cfg = TrainConfig(
        lr=1e-3, min_lr=1e-4, warmup_steps=10, max_steps=110, schedule="wsd", decay_fraction=0.3
    )
    for step in range(10):  # the same warm-up as the cosine's
        assert lr_at(step, cfg) == pytest.approx(1e-3 * (step + 1) / 11, rel=1e-12)
    for step in range(10, 81):  # stable: 70 of the 100 post-warm-up steps
        assert lr_at(step, cfg) == pytest.approx(1e-3, rel=1e-12)
        assert not decaying(step, cfg)
    for step in range(81, 111):  # the line through (80, lr) and (110, min_lr)
        expected = 1e-3 + (1e-4 - 1e-3) * (step - 80) / 30
        assert lr_at(step, cfg) == pytest.approx(expected, rel=1e-12)
        assert decaying(step, cfg)
    assert lr_at(95, cfg) == pytest.approx(5.5e-4)  # half way down: the mean
    assert lr_at(500, cfg) == 1e-4
    # A shorter schedule starts its decay sooner: never a higher rate at a given step.
    for total in (30, 60, 90, 109):
        assert all(lr_at(s, cfg, total) <= lr_at(s, cfg) + 1e-18 for s in range(10, 200))
    # The last stable step is the peak exactly: (1 - r) / f rounded to 0.9999999999999998
    edge = TrainConfig(lr=1e-3, min_lr=0.0, warmup_steps=10, max_steps=100, schedule="wsd",
                       decay_fraction=0.2)  # fmt: skip
    assert lr_at(82, edge) == 1e-3 and not decaying(82, edge) and decaying(83, edge)


@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
def test_decaying_marks_where_the_rate_falls(schedule):
    cfg = TrainConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10, max_steps=110, schedule=schedule)
    lrs = [lr_at(s, cfg) for s in range(130)]
    for s in range(130):
        assert decaying(s, cfg) == (s >= 10 and lrs[s] < 1e-3 * (1 - 1e-12)), s
    assert all(b <= a for a, b in zip(lrs[10:], lrs[11:]))  # after the warm-up: only down


def test_parameter_groups_follow_nanogpt():
    model = build_model(tiny_run().model)  # tied embeddings, biases, LayerNorms
    decay, no_decay = parameter_groups(model, 0.1)
    by_id = {id(p): name for name, p in model.named_parameters()}
    decay_names = {by_id[id(p)] for p in decay["params"]}
    no_decay_names = {by_id[id(p)] for p in no_decay["params"]}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert decay_names | no_decay_names == set(by_id.values()) and not decay_names & no_decay_names
    assert "tok_emb.weight" in decay_names  # tied with lm_head: listed once
    assert "blocks.0.attn.qkv.weight" in decay_names
    assert "blocks.0.attn.qkv.bias" in no_decay_names
    assert "blocks.0.attn_norm.weight" in no_decay_names
    for name, p in model.named_parameters():
        assert (name in decay_names) == (p.dim() >= 2)
    optimizer = build_optimizer(model, tiny_run().train, "cpu")
    assert optimizer.defaults["fused"] is True  # torch >= 2.4 has fused AdamW on CPU
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]


def test_optimizer_steps_survive_a_weight_layout_change_between_steps():
    """generate(compile=True) re-stores Linear weights row-major in place (set_layout), and
    a failed compile input-major again, whatever the optimizer holds: moments (and a
    gradient) of the old layout. Fused AdamW reads them all in the parameter's memory order,
    so the steps must equal those of a model whose layout never changed (they updated
    transposed elements: weights off by ~3e-3 after two steps)."""
    import copy

    from attnlab.nn.linear import set_layout

    torch.manual_seed(0)
    model = build_model(tiny_run().model)  # input-major Linear weights
    ref = copy.deepcopy(model)
    opts = [build_optimizer(m, tiny_run().train, "cpu") for m in (model, ref)]
    x = torch.randint(0, 256, (2, 17))

    def backward(m):
        m(x[:, :-1], targets=x[:, 1:]).loss.backward()

    for m, opt in zip((model, ref), opts):
        backward(m)
        opt.step()
        opt.zero_grad()
    assert set_layout(model, "rows") > 0  # moments of the old layout
    for m, opt in zip((model, ref), opts):
        backward(m)
        opt.step()
        opt.zero_grad()
        backward(m)
    set_layout(model, "input")  # a gradient of the old layout too
    for opt in opts:
        opt.step()
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)


def test_layout_matching_walks_the_parameters_only_after_a_layout_change():
    """The step pre-hook that matches moments to re-stored weights runs before every
    optimizer step: it walks the parameters on the first step, after set_layout and after
    a loaded state, not at every step of a training loop."""
    from attnlab.nn.linear import set_layout
    from attnlab.training.optim import match_layouts

    class Walked(list):
        def __iter__(self):
            raise AssertionError("walked the parameters")

    torch.manual_seed(0)
    model = build_model(tiny_run().model)
    opt = build_optimizer(model, tiny_run().train, "cpu")
    x = torch.randint(0, 256, (2, 9))
    model(x[:, :-1], targets=x[:, 1:]).loss.backward()
    opt.step()  # the first step looks
    groups = opt.param_groups
    opt.param_groups = Walked(groups)
    match_layouts(opt)  # nothing changed since: no walk
    assert set_layout(model, "rows") > 0
    with pytest.raises(AssertionError, match="walked"):
        match_layouts(opt)
    opt.param_groups = groups
    match_layouts(opt)
    opt.load_state_dict(opt.state_dict())
    opt.param_groups = Walked(opt.param_groups)
    with pytest.raises(AssertionError, match="walked"):
        match_layouts(opt)


def test_biases_held_as_matrices_do_not_decay():
    """Transformer-XL's u and v are biases (one vector per head), not weights: no decay,
    though they are 2-D; every other matrix of the model decays."""
    model = build_model(get_preset("xl-tiny"))
    decay, no_decay = parameter_groups(model, 0.1)
    by_id = {id(p): name for name, p in model.named_parameters()}
    no_decay_names = {by_id[id(p)] for p in no_decay["params"]}
    assert {n for n in by_id.values() if n.endswith((".attn.u", ".attn.v"))} <= no_decay_names
    assert any(n.endswith(".attn.u") for n in no_decay_names)
    for p in decay["params"]:
        assert p.dim() >= 2 and not by_id[id(p)].endswith((".attn.u", ".attn.v"))


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_vit_class_token_and_position_embeddings_do_not_decay(optimizer):
    """timm's ViT names pos_embed and cls_token in no_weight_decay() (big_vision decays only
    kernels): they are matrices, but no weight decay pulls them to 0. The patch projection,
    the head and the blocks' matrices still decay; every parameter is in one group."""
    cfg = get_preset("vit-digits")
    cfg.n_classes = 10
    model = build_model(cfg)
    name_of = {id(p): name for name, p in model.named_parameters()}
    train_cfg = dataclasses.replace(tiny_run().train, optimizer=optimizer)
    groups = build_optimizer(model, train_cfg, "cpu").param_groups
    decay = {name_of[id(p)] for g in groups if g["weight_decay"] > 0 for p in g["params"]}
    kept = {name_of[id(p)] for g in groups if g["weight_decay"] == 0 for p in g["params"]}
    assert {"cls", "pos", "patch.bias", "norm.weight"} <= kept
    assert {"patch.weight", "head.weight", "blocks.0.attn.qkv.weight"} <= decay
    assert decay | kept == set(name_of.values()) and not decay & kept


def test_weights_train_row_major_and_match_input_major_training(dataset, tmp_path, monkeypatch):
    """The trainer stores Linear weights row-major, so fused AdamW finds contiguous
    parameters, gradients and moments; the steps equal those of input-major weights."""
    from attnlab.training.trainer import Trainer

    cfg = tiny_run(max_steps=6)
    trainer = Trainer(cfg, tmp_path / "rows", progress=False, dataset=dataset)
    linear = [m.weight for m in trainer.model.modules() if isinstance(m, Linear)]
    assert linear and all(w.is_contiguous() for w in linear)
    trainer.run()
    for state in trainer.optimizer.state.values():
        assert state["exp_avg"].is_contiguous() and state["exp_avg_sq"].is_contiguous()
    monkeypatch.setattr("attnlab.training.trainer.set_layout", lambda model, layout: 0)
    twin = Trainer(cfg, tmp_path / "input", progress=False, dataset=dataset)
    assert not twin.model.blocks[0].attn.qkv.weight.is_contiguous()  # input-major
    twin.run()
    assert_weights_close(
        final_weights(tmp_path / "rows"), final_weights(tmp_path / "input"), tol=1e-5
    )


@pytest.mark.parametrize("ffn", ["mlp", "moe"])
def test_compiled_training_compiles_once(dataset, tmp_path, monkeypatch, ffn):
    """train.compile=true: the model compiles once, as one graph, and later steps (also
    after an evaluation, eager and in eval mode) run it without recompiling. A mixture of
    experts breaks the graph at its per-expert token counts (a host read); its split sizes
    turn dynamic at the second step, after which nothing recompiles either. The 'eager'
    backend counts the graphs without paying for code generation."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    from attnlab.config import FFNConfig
    from attnlab.training.trainer import Trainer, _StopRequest

    counter, real = CompileCounterWithBackend("eager"), torch.compile
    monkeypatch.setattr(torch, "compile", lambda model: real(model, backend=counter))
    torch._dynamo.reset()
    counters.clear()
    cfg = tiny_run(compile=True)
    if ffn == "moe":
        cfg.model.ffn = FFNConfig(
            kind="moe", hidden_dim=64, n_routed_experts=4, n_activated_experts=2
        )
    trainer = Trainer(cfg, tmp_path / "run", progress=False, dataset=dataset)
    stop, never = _StopRequest(), lambda: False
    for _ in range(2):
        trainer._train_step(stop, never)
    graphs = counter.frame_count
    trainer._evaluate(1)
    for _ in range(2):
        trainer._train_step(stop, never)
    assert counter.frame_count == graphs
    if ffn == "mlp":
        assert graphs == 1 and not counters["graph_break"]


def test_training_with_onednn_products_matches_f_linear(dataset, tmp_path, monkeypatch):
    """Six steps whose products are oneDNN's (float32 on CPU, the default where torch has
    oneDNN) end at the weights of six steps with F.linear's (MKL's) products."""
    import attnlab.nn.linear as linear_module
    from attnlab.training.trainer import Trainer

    if not linear_module.ONEDNN:
        pytest.skip("this torch build has no oneDNN")
    cfg = tiny_run(max_steps=6)
    calls = []
    real = linear_module.onednn_linear
    monkeypatch.setattr(linear_module, "onednn_linear", lambda *a: calls.append(1) or real(*a))
    Trainer(cfg, tmp_path / "onednn", progress=False, dataset=dataset).run()
    assert calls  # the products were oneDNN's
    monkeypatch.setattr(linear_module, "ONEDNN", False)
    calls.clear()
    Trainer(cfg, tmp_path / "mkl", progress=False, dataset=dataset).run()
    assert not calls
    assert_weights_close(
        final_weights(tmp_path / "onednn"), final_weights(tmp_path / "mkl"), tol=1e-5
    )


def test_evaluate_is_token_weighted(dataset):
    torch.manual_seed(0)
    model = build_model(tiny_run().model.override({"vocab_size": dataset.tokenizer.vocab_size}))
    batches = list(dataset.iter_eval("val", 3, 16, max_batches=3))
    batches.append(dataset.batch("val", torch.tensor([5]), 16))  # a smaller batch
    result = evaluate(model, batches)
    with torch.no_grad():
        total = sum(
            F.cross_entropy(model(x).logits.flatten(0, 1), y.flatten(), reduction="sum")
            for x, y in batches
        )
    count = sum(y.numel() for _, y in batches)
    assert result["tokens"] == count
    assert result["loss"] == pytest.approx(float(total) / count, rel=1e-6)
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]), rel=1e-9)
    assert result["bits_per_token"] == pytest.approx(result["loss"] / math.log(2), rel=1e-9)
    assert model.training  # evaluate restores the mode it found


# --------------------------------------------------------------------------- learning


def test_loss_drops_and_records_are_written(tmp_path, dataset):
    cfg = tiny_run(max_steps=150, batch_size=8, warmup_steps=10, eval_every=75, log_every=10)
    cfg.train.tensorboard = HAS_TENSORBOARD  # a dev extra; the rest runs without it
    result = train(cfg, tmp_path, dataset=dataset, progress=False)
    counts = np.bincount(dataset.train, minlength=dataset.tokenizer.vocab_size)
    p = counts[counts > 0] / counts.sum()
    unigram_entropy = float(-(p * np.log(p)).sum())  # best loss without using context
    records = read_metrics(tmp_path / "metrics.jsonl")
    val = [r for r in records if r["kind"] == "val"]
    assert [r["step"] for r in val] == [0, 75, 150]
    # Periodic evaluations cover a fixed sample; the last one also the whole split.
    assert result.val_loss == val[-1]["val_full_loss"] < val[0]["val_loss"] - 1.0
    assert val[-1]["val_loss"] == pytest.approx(result.val_loss, rel=0.01)
    assert result.val_coverage.startswith("all ") and "sample" in val[1]["val_coverage"]
    assert result.stop_message == "stopped at step 150: max_steps=150 reached"
    assert records[-1] == {
        "kind": "stop",
        "step": 150,
        "reason": "max_steps",
        "message": result.stop_message,
    }
    assert result.val_loss < unigram_entropy - 0.1
    assert result.best_val_loss == min(r["val_loss"] for r in val[1:])
    assert np.mean(result.losses[-20:]) < np.mean(result.losses[:5]) - 1.0
    trains = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in trains] == list(range(10, 151, 10))
    for r in trains:  # the lr logged at step s is the one step s used
        assert r["lr"] == pytest.approx(lr_at(r["step"] - 1, cfg.train), rel=1e-12)
        assert r["tokens_per_second"] > 0
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if HAS_TENSORBOARD:
        assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    best = load_checkpoint(tmp_path / "best", with_state=True)
    assert best.state["val_loss"] == result.best_val_loss
    assert load_checkpoint(tmp_path).config.model.vocab_size == dataset.tokenizer.vocab_size
    with pytest.raises(TrainingError, match="already holds a checkpoint"):
        train(cfg, tmp_path, dataset=dataset, progress=False)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="/dev/full: Linux's full disk")
def test_a_full_disk_while_logging_names_the_metrics_file(tmp_path, monkeypatch):
    """A full disk fails an append naming no file: the error names metrics.jsonl (the
    command's line was "[Errno 28] No space left on device", whatever the folder)."""
    import attnlab.training.metrics as metrics_module

    logger = metrics_module.MetricsLogger(tmp_path)
    full = lambda *args, **kwargs: open("/dev/full", "w", encoding="utf-8")  # noqa: E731
    monkeypatch.setattr(metrics_module, "open", full, raising=False)
    with pytest.raises(OSError, match="No space left") as error:
        logger.log("train", 1, train_loss=1.0)
    assert error.value.filename == str(tmp_path / "metrics.jsonl")


def test_tensorboard_without_the_package_is_refused_before_anything_runs(
    tmp_path, dataset, monkeypatch
):
    # A TrainingError (the command line's one error line), before the data, the model or
    # any file: not a RuntimeError traceback once all that is done.
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # not installed
    monkeypatch.setattr(trainer_module, "build_model", None)  # must not be reached
    with pytest.raises(TrainingError, match="pip install tensorboard"):
        train(tiny_run(tensorboard=True), tmp_path / "run", dataset=dataset, progress=False)
    assert not (tmp_path / "run").exists()


def test_a_loss_plot_that_fails_is_a_warning_not_a_lost_run(tmp_path, dataset, monkeypatch):
    def broken(self):
        raise RuntimeError("matplotlib cannot draw\nmore detail")

    monkeypatch.setattr(trainer_module.MetricsLogger, "plot", broken)
    with pytest.warns(UserWarning, match=r"loss.png: cannot draw the loss plot \(matplotlib"):
        result = train(
            tiny_run(max_steps=4, eval_every=2), tmp_path, dataset=dataset, progress=False
        )
    assert result.step == 4 and result.val_step == 4
    assert load_checkpoint(tmp_path, with_state=True).state["step"] == 4


class ConsolePipe(io.TextIOBase):
    """A console pipe whose reader goes away (``gone``) mid-run: Ctrl-C on
    `attnlab train 2>&1 | tee log` ends tee as well."""

    gone = False

    def write(self, text):
        if self.gone:
            raise BrokenPipeError(32, "Broken pipe")
        return len(text)

    def flush(self):
        if self.gone:
            raise BrokenPipeError(32, "Broken pipe")


class ReaderGoesAway(InterruptingDataset):
    """SIGTERM at the ``at``-th micro-batch, once ``pipes`` have lost their reader."""

    def __init__(self, inner, at: int, pipes):
        super().__init__(inner, at)
        self.pipes = pipes

    def batch(self, split, starts, block_size, device=None):
        if split == "train" and self.calls + 1 == self.at:
            for pipe in self.pipes:
                pipe.gone = True
        return super().batch(split, starts, block_size, device)


def test_progress_output_to_a_closed_pipe_does_not_stop_the_run(tmp_path, dataset, monkeypatch):
    pipes = ConsolePipe(), ConsolePipe()
    monkeypatch.setattr(sys, "stderr", pipes[0])  # the progress bar
    monkeypatch.setattr(sys, "stdout", pipes[1])  # the evaluations' lines
    stopping = ReaderGoesAway(dataset, 3, pipes)
    result = train(tiny_run(max_steps=8, eval_every=2), tmp_path, dataset=stopping)
    assert result.interrupted == "SIGTERM" and result.step == 3  # saved, then stopped
    assert load_checkpoint(tmp_path, with_state=True).state["step"] == 3


@pytest.mark.skipif(trainer_module.fcntl is None, reason="no file locks on this platform")
def test_a_second_run_on_a_folder_that_a_run_writes_into_is_refused(tmp_path, dataset):
    # Two runs on one folder would interleave their checkpoints and metrics (or one would
    # delete the other's half-written save): the second stops before it writes anything.
    out = tmp_path / "run"
    with trainer_module._sole_writer(out):  # a run in progress there
        with pytest.raises(TrainingError, match=rf"process {os.getpid()}\) is writing into"):
            train(tiny_run(max_steps=2), out, dataset=dataset, progress=False)
        assert [p.name for p in out.iterdir()] == [trainer_module.LOCK_FILE]
    assert train(tiny_run(max_steps=2), out, dataset=dataset, progress=False).step == 2


@pytest.mark.skipif(trainer_module.fcntl is None, reason="no file locks on this platform")
def test_the_lock_follows_the_rank_of_a_group_the_caller_made(tmp_path, monkeypatch):
    # A caller that made the process group itself (init_process_group(rank=...), mp.spawn)
    # need not set RANK: only its rank 0 writes, so only it locks (every process taking
    # the lock refused all but one of them).
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(trainer_module.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(trainer_module.dist, "get_rank", lambda group=None: 1)
    out = tmp_path / "run"
    with trainer_module._sole_writer(out):  # rank 0's, say
        with trainer_module._sole_writer(out):  # rank 1's: no lock, no error
            pass
    monkeypatch.setattr(trainer_module.dist, "get_rank", lambda group=None: 0)
    with trainer_module._sole_writer(out):
        with pytest.raises(TrainingError, match="is writing into"):
            with trainer_module._sole_writer(out):
                pass


def test_grad_accumulation_equals_big_batch(tmp_path, dataset):
    big = train(
        tiny_run(max_steps=3, batch_size=8), tmp_path / "big", dataset=dataset, progress=False
    )
    acc = train(
        tiny_run(max_steps=3, batch_size=4, grad_accum=2),
        tmp_path / "acc",
        dataset=dataset,
        progress=False,
    )
    # Same tokens, summed in another order: equal to float32 rounding.
    np.testing.assert_allclose(acc.losses, big.losses, rtol=1e-5)
    # Adam hides a gradient scale error from losses and weights; the norms show it.
    np.testing.assert_allclose(
        grad_norms(tmp_path / "acc"), grad_norms(tmp_path / "big"), rtol=1e-5
    )
    assert_weights_close(final_weights(tmp_path / "acc"), final_weights(tmp_path / "big"), tol=1e-5)


@pytest.mark.parametrize("clip", [0.05, 0.0])
def test_the_optimizer_gets_clipped_gradients_and_the_scheduled_rate_in_every_group(
    tmp_path, dataset, clip
):
    """What reaches the optimizer at each step: gradients of total norm min(norm,
    grad_clip) (untouched with grad_clip=0), every parameter group (decay and no decay) at
    lr_at(step); the logged grad_norm is the norm before clipping. AdamW all but ignores the
    scale of its gradients, so neither losses nor weights show a clip that went wrong."""
    from attnlab.training.trainer import Trainer

    cfg = tiny_run(max_steps=4, grad_clip=clip)
    trainer = Trainer(cfg, tmp_path, progress=False, dataset=dataset)
    seen = []

    def record(optimizer, args, kwargs):
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([g.double().norm() for g in grads]))
        seen.append((float(norm), [g["lr"] for g in optimizer.param_groups]))

    trainer.optimizer.register_step_pre_hook(record)
    trainer.run()
    logged = grad_norms(tmp_path)
    assert len(seen) == len(logged) == 4
    assert len(seen[0][1]) == 2  # the decay and no-decay groups
    for step, ((norm, lrs), before) in enumerate(zip(seen, logged)):
        assert lrs == [pytest.approx(lr_at(step, cfg.train), rel=1e-12)] * 2
        assert norm == pytest.approx(min(before, clip) if clip else before, rel=1e-5)
    if clip:
        assert min(logged) > 2 * clip  # every step was clipped


def test_bfloat16_autocast_trains(tmp_path, dataset):
    fp32 = train(tiny_run(max_steps=3), tmp_path / "fp32", dataset=dataset, progress=False)
    bf16 = train(
        tiny_run(max_steps=3, dtype="bfloat16"),
        tmp_path / "bf16",
        dataset=dataset,
        progress=False,
    )
    assert all(math.isfinite(v) for v in bf16.losses)
    assert bf16.losses != fp32.losses  # autocast really ran the matmuls in bf16 ...
    np.testing.assert_allclose(bf16.losses, fp32.losses, atol=0.05)  # ... to bf16 accuracy


# --------------------------------------------------------------------------- resume


def test_resume_equals_uninterrupted(tmp_path, dataset):
    """Stop by SIGTERM in the middle of step 5 (with dropout and accumulation, so every
    RNG matters), resume, and match the uninterrupted run bit for bit."""
    cfg = tiny_run(dropout=0.1, grad_accum=2, eval_every=4, max_steps=10)
    straight = train(cfg, tmp_path / "straight", dataset=dataset, progress=False)

    stopping = InterruptingDataset(dataset, at=9)  # first micro-batch of step 5
    first = train(cfg, tmp_path / "run", dataset=stopping, progress=False)
    assert first.interrupted == "SIGTERM" and first.stop_reason == "signal"
    assert first.step == 5
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handler restored
    second = train(cfg, tmp_path / "run", resume=tmp_path / "run", dataset=dataset, progress=False)
    assert second.step == 10 and second.interrupted is None
    assert first.losses + second.losses == straight.losses
    assert_weights_close(
        final_weights(tmp_path / "run"), final_weights(tmp_path / "straight"), tol=0
    )
    assert second.best_val_loss == straight.best_val_loss
    # metrics.jsonl continues without duplicates across the interruption.
    steps = [
        r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "train"
    ]
    assert steps == list(range(1, 11))


@pytest.mark.parametrize("eval_every", [0, 4])
def test_resuming_a_finished_run_changes_nothing_and_reports_its_end(tmp_path, dataset, eval_every):
    """A run resumed after its last step takes no step, logs no second stop record and
    reports the validation of its end (the whole validation set), not the last sample's."""
    cfg = tiny_run(eval_every=eval_every, max_steps=8)
    first = train(cfg, tmp_path / "run", dataset=dataset, progress=False)
    records = (tmp_path / "run" / "metrics.jsonl").read_text()
    again = train(cfg, tmp_path / "run", resume=tmp_path / "run", dataset=dataset, progress=False)
    assert again.step == first.step == 8 and again.losses == []
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == records
    assert again.stop_message == first.stop_message
    assert again.val_loss == first.val_loss and again.val_step == first.val_step == 8
    assert again.val_metrics == first.val_metrics
    assert again.val_coverage == first.val_coverage
    assert "all " in first.val_coverage  # the final evaluation covers the whole set


@pytest.mark.parametrize("stop_in", [4, 10])
def test_a_stop_in_an_evaluation_step_evaluates_on_resume(tmp_path, dataset, stop_in):
    """SIGTERM during step 4 (eval_every=4) or the last step: the stopped run saves without
    that step's evaluation, so the resumed run makes it first. The validation records, the
    sample's growth and the best checkpoint then match the uninterrupted run's."""
    cfg = tiny_run(grad_accum=2, eval_every=4, max_steps=10)
    straight = train(cfg, tmp_path / "straight", dataset=dataset, progress=False)
    stopping = InterruptingDataset(dataset, at=2 * stop_in - 1)
    assert train(cfg, tmp_path / "run", dataset=stopping, progress=False).step == stop_in
    second = train(cfg, tmp_path / "run", resume=tmp_path / "run", dataset=dataset, progress=False)

    def val_records(run):
        rows = read_metrics(tmp_path / run / "metrics.jsonl")
        drop = ("train_time",)  # seconds: differ between runs
        return [{k: v for k, v in r.items() if k not in drop} for r in rows if r["kind"] == "val"]

    assert val_records("run") == val_records("straight")
    assert second.best_val_loss == straight.best_val_loss
    assert second.val_metrics == straight.val_metrics
    assert_weights_close(
        final_weights(tmp_path / "run" / "best"),
        final_weights(tmp_path / "straight" / "best"),
        tol=0,
    )


def test_a_log_interval_cut_by_a_stop_is_logged_as_if_uninterrupted(tmp_path, dataset):
    """log_every=5, SIGTERM during step 4: the resumed run's step-5 record is the mean over
    steps 1-5, as the uninterrupted run's (the interval's sums travel in the checkpoint)."""
    cfg = tiny_run(max_steps=10, log_every=5)
    train(cfg, tmp_path / "straight", dataset=dataset, progress=False)
    stopping = InterruptingDataset(dataset, at=4)
    train(cfg, tmp_path / "run", dataset=stopping, progress=False)
    train(cfg, tmp_path / "run", resume=tmp_path / "run", dataset=dataset, progress=False)

    def records(run):
        rows = read_metrics(tmp_path / run / "metrics.jsonl")
        return [(r["step"], r["train_loss"]) for r in rows if r["kind"] == "train"]

    assert records("run") == records("straight") and len(records("run")) == 2


def test_a_periodic_save_at_the_last_step_keeps_the_final_evaluation(tmp_path, dataset):
    """save_every dividing max_steps: the save at the last step does not stand in for the
    run's final evaluation (the whole validation set, best/)."""
    result = train(tiny_run(max_steps=4, save_every=2), tmp_path, dataset=dataset, progress=False)
    assert result.val_step == 4 and result.val_coverage.startswith("all ")
    val = [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "val"]
    assert val == [4]
    assert load_checkpoint(tmp_path / "best", with_state=True).state["step"] == 4


def test_a_final_evaluation_whose_save_failed_is_logged_once_after_resume(
    tmp_path, dataset, monkeypatch
):
    """save_every dividing max_steps, the final evaluation's save killed (or its disk full):
    the folder holds step 4 without that evaluation, which the resumed run makes again. Its
    record is logged once (the stopped run's was kept beside the new one), as uninterrupted."""
    cfg = tiny_run(max_steps=4, save_every=2)
    real_save, saves = trainer_module.save_checkpoint, []

    def dies_at_the_last_save(directory, *args, **kwargs):
        saves.append(directory)
        if len(saves) == 4:  # steps 2 and 4, best/ after the final evaluation, then the folder
            raise KeyboardInterrupt("killed")
        real_save(directory, *args, **kwargs)

    monkeypatch.setattr(trainer_module, "save_checkpoint", dies_at_the_last_save)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, tmp_path / "run", dataset=dataset, progress=False)
    monkeypatch.undo()
    assert load_checkpoint(tmp_path / "run", with_state=True).state["val_step"] is None
    train(cfg, tmp_path / "run", resume=tmp_path / "run", dataset=dataset, progress=False)
    train(cfg, tmp_path / "straight", dataset=dataset, progress=False)

    def records(run):
        rows = read_metrics(tmp_path / run / "metrics.jsonl")
        return [(r["kind"], r["step"], r.get("val_loss", r.get("train_loss"))) for r in rows]

    assert records("run") == records("straight")


def _val_losses(monkeypatch, losses):
    """Stub the trainer's sample evaluations to report ``losses(step)`` (the real metrics
    and totals otherwise), and record ``(step, max_batches)`` of every evaluation."""
    real, calls = trainer_module.Trainer._evaluate, []

    def evaluate(self, max_batches):
        calls.append((self.step, max_batches))
        metrics, sums = real(self, max_batches)
        return {**metrics, "loss": losses(self.step)}, sums

    monkeypatch.setattr(trainer_module.Trainer, "_evaluate", evaluate)
    return calls


def test_the_untrained_baseline_is_never_the_best(tmp_path, dataset, monkeypatch):
    """The step-0 evaluation (the untrained model's) goes on the curve only: it sets no
    best_val_loss, so a first trained evaluation worse than it is still saved as best/."""
    _val_losses(monkeypatch, lambda step: 1.0 if step == 0 else 2.0)
    result = train(tiny_run(max_steps=2, eval_every=2), tmp_path, dataset=dataset, progress=False)
    val = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "val"]
    assert [(r["step"], r["best_val_loss"]) for r in val] == [(0, None), (2, 2.0)]
    assert result.best_val_loss == 2.0
    assert load_checkpoint(tmp_path / "best", with_state=True).state["step"] == 2


def test_an_equal_validation_loss_keeps_the_earlier_best(tmp_path, dataset, monkeypatch):
    """best/ is rewritten only by a strictly lower loss: later evaluations that tie keep
    the first step that reached it."""
    _val_losses(monkeypatch, lambda step: 5.0 if step == 0 else 3.0)
    cfg = tiny_run(max_steps=6, eval_every=2)
    result = train(cfg, tmp_path, dataset=dataset, progress=False)
    assert result.best_val_loss == 3.0
    assert load_checkpoint(tmp_path / "best", with_state=True).state["step"] == 2


def test_a_run_resumed_into_another_folder_takes_its_best_checkpoint(
    tmp_path, dataset, monkeypatch
):
    """``--resume A --out B``: B gets A's best/ (the checkpoint best_val_loss describes);
    resumed from A/best, B's best/ is that checkpoint. B had no best/ while its evaluations
    were worse than A's best, and none at all when every one was."""
    _val_losses(monkeypatch, lambda step: 1.0 if step == 2 else 2.0 + step)
    kw = dict(dataset=dataset, progress=False)
    train(tiny_run(max_steps=4, eval_every=2), tmp_path / "a", **kw)
    best = tmp_path / "a" / "best"
    assert load_checkpoint(best, with_state=True).state["step"] == 2
    for source, out in ((tmp_path / "a", "b"), (best, "c")):
        result = train(tiny_run(max_steps=6, eval_every=2), tmp_path / out, resume=source, **kw)
        assert result.best_val_loss == 1.0
        copied = load_checkpoint(tmp_path / out / "best", with_state=True)
        assert copied.state["step"] == 2 and copied.state["best_val_loss"] == 1.0
        for name in ("model.safetensors", "config.json", "trainer_state.pt"):
            assert (tmp_path / out / "best" / name).read_bytes() == (best / name).read_bytes()
    # a resumed run that beats it replaces it with its own, as in the run it continues
    _val_losses(monkeypatch, lambda step: 0.5)
    train(tiny_run(max_steps=8, eval_every=2), tmp_path / "d", resume=tmp_path / "b", **kw)
    assert load_checkpoint(tmp_path / "d" / "best", with_state=True).state["step"] == 8


def test_a_failed_copy_of_the_best_checkpoint_leaves_no_folder(tmp_path, dataset, monkeypatch):
    """The copy is all or nothing: a full disk midway leaves no best/ (which would read as
    a broken checkpoint) and no temporary folder, and says which folder it could not fill."""
    import shutil

    kw = dict(dataset=dataset, progress=False)
    train(tiny_run(max_steps=2, eval_every=2), tmp_path / "a", **kw)
    real, copies = shutil.copy2, []

    def full_disk(src, dst, **kwargs):
        copies.append(dst)
        if len(copies) == 2:
            raise OSError(28, "No space left on device")
        return real(src, dst, **kwargs)

    monkeypatch.setattr(shutil, "copy2", full_disk)
    with pytest.raises(OSError, match=r"best: cannot copy the checkpoint .*No space left"):
        train(tiny_run(max_steps=4, eval_every=2), tmp_path / "b", resume=tmp_path / "a", **kw)
    assert not [p.name for p in (tmp_path / "b").iterdir() if p.name.startswith(".tmp")]
    assert not (tmp_path / "b" / "best").exists()


def test_the_evaluation_sample_never_shrinks(tmp_path, dataset, monkeypatch):
    """A later evaluation's spread asking for fewer batches than the sample holds leaves
    the sample as it is (it only grows)."""
    from attnlab.tasks.lm import LanguageModelling

    needs = iter([6, 3, 1, 1])  # at steps 2, 4, 6, 8
    monkeypatch.setattr(
        LanguageModelling, "eval_batches_needed", lambda self, sums, b, tol: next(needs)
    )
    calls = _val_losses(monkeypatch, lambda step: 3.0)
    train(tiny_run(max_steps=8, eval_every=2), tmp_path, dataset=dataset, progress=False)
    samples = [n for step, n in calls if n is not None]  # the final whole-set one aside
    assert samples == [2, 2, 6, 6, 6]
    assert load_checkpoint(tmp_path, with_state=True).state["eval_batches"] == 6


def test_the_untrained_baseline_does_not_size_the_evaluation_sample(tmp_path, dataset, monkeypatch):
    """The sample grows from trained evaluations only: the step-0 one's spread (the
    untrained model's) leaves it at train.eval_batches for the next evaluation."""
    from attnlab.tasks.lm import LanguageModelling

    monkeypatch.setattr(LanguageModelling, "eval_batches_needed", lambda self, *a: 5)
    calls = _val_losses(monkeypatch, lambda step: 3.0)
    train(tiny_run(max_steps=4, eval_every=2), tmp_path, dataset=dataset, progress=False)
    assert [(step, n) for step, n in calls if n is not None] == [(0, 2), (2, 2), (4, 5)]


def test_an_evaluation_of_the_whole_set_reports_its_coverage(tmp_path, dataset):
    """A sample as large as the validation set: the final evaluation is that sample's, and
    the run reports it as covering the whole set."""
    cfg = tiny_run(max_steps=2, eval_batches=100_000)
    result = train(cfg, tmp_path, dataset=dataset, progress=False)
    assert result.val_coverage.startswith("all ")


def test_muon_trains_and_resumes_exactly(tmp_path, dataset):
    """train.optimizer=muon: Muon takes exactly the hidden linear weights (not the
    embeddings or the tied head), the loss falls, and a run stopped at step 5 and resumed
    matches the uninterrupted one bit for bit (both optimizers' states are saved)."""
    from attnlab import build_model
    from attnlab.training.optim import build_optimizer, muon_parameters

    cfg = tiny_run(optimizer="muon", max_steps=10, eval_every=5)
    model = build_model(cfg.model)
    hidden = {id(p) for p in muon_parameters(model)}
    expected = {
        id(m.weight) for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and name.startswith("blocks.")
    }  # fmt: skip
    assert hidden == expected and id(model.tok_emb.weight) not in hidden
    opt = build_optimizer(model, cfg.train, "cpu")
    kinds = [type(o).__name__ for o in opt.optimizers]
    assert kinds == ["AdamW", "Muon"]
    everything = [p for g in opt.param_groups for p in g["params"]]
    assert sorted(map(id, everything)) == sorted(id(p) for p in model.parameters())

    straight = train(cfg, tmp_path / "straight", dataset=dataset, progress=False)
    assert sum(straight.losses[-3:]) < sum(straight.losses[:3])
    stopping = InterruptingDataset(dataset, at=5)
    first = train(cfg, tmp_path / "run", dataset=stopping, progress=False)
    assert first.step == 5
    second = train(cfg, tmp_path / "run", resume=tmp_path / "run", dataset=dataset, progress=False)
    assert first.losses + second.losses == straight.losses
    assert_weights_close(
        final_weights(tmp_path / "run"), final_weights(tmp_path / "straight"), tol=0
    )


def test_resume_applies_the_new_weight_decay_and_betas(tmp_path, dataset):
    """train.weight_decay and train.beta2 changed on resume apply (torch's load_state_dict
    would put back the saved groups' values, while config.json records the new ones).
    AdamW's decoupled decay (Loshchilov & Hutter): two resumed steps that differ only in
    weight_decay differ by lr * (wd_a - wd_b) * w in every matrix, not at all in vectors."""
    train(tiny_run(max_steps=2, weight_decay=0.1), tmp_path / "run", dataset=dataset,
          progress=False)  # fmt: skip
    before = final_weights(tmp_path / "run")
    after = {}
    for wd in (0.0, 0.5):
        out = tmp_path / f"wd{wd}"
        cfg = tiny_run(max_steps=3, weight_decay=wd, beta2=0.95)
        train(cfg, out, resume=tmp_path / "run", dataset=dataset, progress=False)
        after[wd] = final_weights(out)
        groups = torch.load(out / "trainer_state.pt", weights_only=True)["trainer"]["optimizer"]
        assert [g["betas"] for g in groups["param_groups"]] == [(0.9, 0.95)] * 2
    lr = lr_at(2, tiny_run(max_steps=3).train)
    for name, w in before.items():
        expected = lr * 0.5 * w if w.dim() >= 2 else torch.zeros_like(w)
        torch.testing.assert_close(after[0.0][name] - after[0.5][name], expected, msg=name)


def test_resume_with_another_optimizer_is_refused(tmp_path, dataset):
    train(tiny_run(max_steps=1, optimizer="muon"), tmp_path, dataset=dataset, progress=False)
    with pytest.raises(TrainingError, match="train.optimizer=muon, not adamw"):
        train(tiny_run(max_steps=2), tmp_path, resume=tmp_path, dataset=dataset, progress=False)


def test_resume_of_an_optimizer_state_grouped_otherwise_is_refused_by_name(tmp_path, dataset):
    """Versions before Transformer-XL's u and v joined the no-decay group saved them in the
    decay group: such a state (made here by moving a tensor between the saved groups) is
    refused naming the grouping, not with torch's bare group-size error."""
    train(tiny_run(max_steps=1), tmp_path, dataset=dataset, progress=False)
    path = tmp_path / "trainer_state.pt"
    state = torch.load(path, weights_only=True)
    decay, no_decay = state["trainer"]["optimizer"]["param_groups"]
    decay["params"].append(no_decay["params"].pop())
    torch.save(state, path)
    with pytest.raises(ValueError, match="grouped the parameters differently.*--init-from"):
        train(tiny_run(max_steps=2), tmp_path, resume=tmp_path, dataset=dataset, progress=False)


@pytest.mark.parametrize(
    "preset, head", [("gru-numbers", "out"), ("vit-digits", "head"), ("bert-tiny-qa", "head.span")]
)
def test_muon_leaves_every_output_head_to_adamw(preset, head):
    """The layer that writes the logits stays with AdamW in every architecture (the GRU
    seq2seq names its ``out``), while the hidden matrices of the same model go to Muon."""
    from attnlab import build_model
    from attnlab.training.optim import muon_parameters

    cfg = get_preset(preset)
    for name in ("vocab_size", "src_vocab_size", "n_labels"):
        if getattr(cfg, name, 1) is None:
            setattr(cfg, name, 11)
    model = build_model(cfg)
    hidden = {id(p) for p in muon_parameters(model)}
    assert hidden and id(model.get_submodule(head).weight) not in hidden


CHILD = textwrap.dedent(
    """
    import sys, time, torch
    torch.set_num_threads(1)
    from attnlab.config import RunConfig
    from attnlab.data import prepare_data
    from attnlab.training import train

    cfg = RunConfig.from_json(open(sys.argv[1]).read())
    data = prepare_data(cfg.data, cache_dir=sys.argv[2])

    class Slow:  # slow enough for the parent to signal mid-run
        def __getattr__(self, name):
            return getattr(data, name)

        def batch(self, *args, **kwargs):
            time.sleep(0.05)
            return data.batch(*args, **kwargs)

    result = train(cfg, sys.argv[3], dataset=Slow(), progress=False)
    print("RESULT", result.step, result.interrupted, flush=True)
    """
)


def test_sigterm_in_subprocess_then_resume(tmp_path, dataset, cache_dir):
    cfg = tiny_run(dropout=0.1, max_steps=20, eval_every=7)
    (tmp_path / "cfg.json").write_text(cfg.to_json())
    (tmp_path / "child.py").write_text(CHILD)
    out = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen(
        [
            sys.executable,
            str(tmp_path / "child.py"),
            str(tmp_path / "cfg.json"),
            str(cache_dir),
            str(out),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and child.poll() is None:
        steps = [r["step"] for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"]
        if steps and steps[-1] >= 3:
            break
        time.sleep(0.02)
    child.send_signal(signal.SIGTERM)
    stdout, stderr = child.communicate(timeout=120)
    assert child.returncode == 0, stderr
    _, stopped, how = stdout.split()
    assert how == "SIGTERM" and 3 <= int(stopped) < 20

    straight = train(cfg, tmp_path / "straight", dataset=dataset, progress=False)
    child_losses = [
        r["train_loss"] for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"
    ]
    resumed = train(cfg, out, resume=out, dataset=dataset, progress=False)
    assert resumed.step == 20
    np.testing.assert_allclose(
        child_losses[: int(stopped)] + resumed.losses, straight.losses, rtol=1e-6, atol=0
    )
    assert_weights_close(final_weights(out), final_weights(tmp_path / "straight"), tol=1e-6)


# --------------------------------------------------------------------------- failures, budgets


def _poison_step(monkeypatch, step: int) -> None:
    """The models the trainer builds return a NaN loss at training step ``step``."""

    def poisoned_build(model_cfg):
        model = build_model(model_cfg)
        forward, calls = model.forward, {"n": 0}

        def nan_at_step(*args, **kwargs):
            out = forward(*args, **kwargs)
            if model.training:
                calls["n"] += 1
                if calls["n"] == step:
                    return LMOutput(out.logits, out.loss * float("nan"))
            return out

        model.forward = nan_at_step
        return model

    monkeypatch.setattr(trainer_module, "build_model", poisoned_build)


def test_nan_loss_names_step_and_keeps_last_checkpoint(tmp_path, dataset, monkeypatch):
    _poison_step(monkeypatch, 5)
    with pytest.raises(TrainingError, match="loss is nan at step 5.*last good checkpoint in"):
        train(tiny_run(save_every=2), tmp_path, dataset=dataset, progress=False)
    saved = load_checkpoint(tmp_path, with_state=True)
    assert saved.state["step"] == 4
    assert all(torch.isfinite(p).all() for p in saved.model.parameters())


@pytest.mark.parametrize(
    "settings, hint",
    [
        ({"grad_clip": 1.0}, "(lower train.lr)"),  # clipped, float32: the one left to try
        ({"grad_clip": 0.0}, "(lower train.lr, or enable train.grad_clip)"),
        (
            {"grad_clip": 0.0, "dtype": "bfloat16"},
            "(lower train.lr, enable train.grad_clip, or use train.dtype=float32)",
        ),
    ],
)
def test_a_diverged_run_suggests_only_what_it_does_not_do(
    tmp_path, dataset, monkeypatch, settings, hint
):
    # it suggested clipping and float32 to a clipped float32 run
    _poison_step(monkeypatch, 1)
    with pytest.raises(TrainingError) as error:
        train(tiny_run(max_steps=2, **settings), tmp_path, dataset=dataset, progress=False)
    assert str(error.value).endswith(hint)


def test_train_leaves_the_callers_random_state_as_it_was(tmp_path, dataset, monkeypatch):
    """The run seeds torch's global generator for its dropout; the caller's state comes
    back, after a finished run and after one that raises, so a caller drawing between runs
    (a hyperparameter search) does not draw the run's numbers every time."""
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    train(tiny_run(dropout=0.1, max_steps=2), tmp_path / "a", dataset=dataset, progress=False)
    assert torch.equal(torch.get_rng_state(), before)
    _poison_step(monkeypatch, 1)
    with pytest.raises(TrainingError):
        train(tiny_run(max_steps=2), tmp_path / "b", dataset=dataset, progress=False)
    assert torch.equal(torch.get_rng_state(), before)


def test_nan_loss_before_the_first_save_does_not_vouch_for_an_older_run(
    tmp_path, dataset, monkeypatch
):
    # A fresh run (overwrite=True) over an older one: what the folder holds is not this
    # run's, so the error must not call it "the last good checkpoint".
    train(tiny_run(max_steps=2), tmp_path, dataset=dataset, progress=False)
    _poison_step(monkeypatch, 1)
    with pytest.raises(TrainingError, match="at step 1.*no checkpoint of this run was saved"):
        train(tiny_run(), tmp_path, dataset=dataset, progress=False, overwrite=True)


def test_weights_a_step_made_non_finite_are_never_saved(tmp_path, dataset):
    """lr=1e39: the step's loss and gradient are finite, its update makes the weights inf.
    The save that follows stops the run instead of writing them over the last good
    checkpoint (it wrote them, and the next step's NaN loss called them "kept")."""
    train(tiny_run(max_steps=2, save_every=1), tmp_path, dataset=dataset, progress=False)
    huge = tiny_run(max_steps=4, save_every=1, lr=1e39, warmup_steps=0)
    with pytest.raises(TrainingError, match=r"weights are not finite .* at step 3;.*is kept"):
        train(huge, tmp_path, resume=tmp_path, dataset=dataset, progress=False)
    saved = load_checkpoint(tmp_path, with_state=True)
    assert saved.state["step"] == 2
    assert all(torch.isfinite(p).all() for p in saved.model.parameters())


def test_a_non_finite_validation_loss_stops_the_run_without_saving(tmp_path, dataset):
    """The evaluation after a step that made the weights inf stops the run naming the step
    (it crashed sizing the validation sample: "cannot convert float NaN to integer")."""
    cfg = tiny_run(max_steps=3, eval_every=1, lr=1e39, warmup_steps=0)
    with pytest.raises(TrainingError, match="validation loss is nan at step 1; stopped"):
        train(cfg, tmp_path, dataset=dataset, progress=False)
    assert not (tmp_path / "best").exists() and not (tmp_path / "model.safetensors").exists()
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert all(math.isfinite(r["val_loss"]) for r in records if r["kind"] == "val")
    assert records[-1]["reason"] == "nan"


def test_overwrite_drops_the_older_runs_best_checkpoint_but_never_its_own_source(
    tmp_path, dataset, monkeypatch
):
    # best/ of the run a fresh one overwrites would pass for the new run's until that one
    # evaluates (here it stops before); resuming from that best/ into its run keeps it.
    train(tiny_run(max_steps=4, eval_every=2), tmp_path, dataset=dataset, progress=False)
    best = tmp_path / "best"
    assert load_checkpoint(best, with_state=True).state["step"] == 4
    kw = dict(dataset=dataset, progress=False, overwrite=True)
    train(tiny_run(max_steps=5, eval_every=0), tmp_path, resume=best, **kw)
    assert load_checkpoint(tmp_path, with_state=True).state["step"] == 5
    assert (best / "model.safetensors").is_file()  # the source of the resumed run
    _poison_step(monkeypatch, 1)
    with pytest.raises(TrainingError, match="at step 1"):
        train(tiny_run(max_steps=2), tmp_path, **kw)
    assert not best.exists()


def test_overwrite_drops_a_best_link_not_the_checkpoint_it_points_to(tmp_path, dataset):
    """best/ of the overwritten run is a link to a checkpoint elsewhere (kept apart by
    hand): the fresh run drops the link and keeps its own best/ in its folder; it crashed
    with "Cannot call rmtree on a symbolic link"."""
    kept = tmp_path / "kept"
    train(tiny_run(max_steps=2, eval_every=2), kept, dataset=dataset, progress=False)
    files = {f.name: f.read_bytes() for f in (kept / "best").iterdir()}
    out = tmp_path / "out"
    out.mkdir()
    (out / "best").symlink_to(kept / "best", target_is_directory=True)
    cfg = tiny_run(max_steps=2, eval_every=2, seed=5)
    train(cfg, out, dataset=dataset, progress=False, overwrite=True)
    assert {f.name: f.read_bytes() for f in (kept / "best").iterdir()} == files
    assert not (out / "best").is_symlink()
    assert load_checkpoint(out / "best").config.train.seed == 5


class FakeClock:
    """Stands in for the trainer's clock: time moves only when the dataset says so."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class TimedDataset:
    """Wraps a dataset; each batch advances ``clock`` by ``cost(split, call number)``."""

    def __init__(self, inner, clock: FakeClock, cost):
        self.inner, self.clock, self.cost, self.calls = inner, clock, cost, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def batch(self, split, starts, block_size, device=None):
        if split == "train":
            self.calls += 1
        self.clock.now += self.cost(split, self.calls)
        return self.inner.batch(split, starts, block_size, device)


def test_time_budget_fits_the_schedule(tmp_path, dataset, monkeypatch):
    """With a fake clock (steps of 0.1 s, evaluation batches of 1 ms every 10 steps, the
    whole validation split of 364 batches at the end), a 3 s budget fits about 26 steps
    (3 s = 0.1 n + the evaluations); the run must use the budget nearly whole and never
    pass it."""
    clock = FakeClock()
    monkeypatch.setattr(trainer_module, "_clock", clock)
    data = TimedDataset(dataset, clock, lambda split, n: 0.1 if split == "train" else 0.001)
    cfg = tiny_run(max_steps=1000, time_budget=3.0, eval_every=10, eval_batches=2)
    result = train(cfg, tmp_path, dataset=data, progress=False)
    assert result.stop_reason == "max_steps"  # the fitted schedule ran to its end ...
    assert 24 <= result.max_steps == result.step <= 26  # ... of about as many steps as fit
    assert 0.95 * 3.0 <= result.elapsed <= 3.0  # the budget used, not exceeded
    assert result.elapsed == pytest.approx(clock.now)
    state = load_checkpoint(tmp_path, with_state=True).state
    assert state["budget_fitted"] and state["schedule_steps"] == result.max_steps
    resumed = train(None, tmp_path, resume=tmp_path, dataset=data, progress=False)
    assert resumed.max_steps == result.max_steps  # the fitted length is kept on resume


def slowdown_run(
    tmp_path, dataset, monkeypatch, later: float, refit_every=None, slow_until=6, **train_kw
):
    """A run under a fake clock whose first fit (FIT_STEPS pinned to 5: steps 2-6) sees
    0.1 s steps, every step after ``slow_until`` taking ``later`` s (evaluation batches
    1 ms): the config, the result and the learning rate of every step."""
    clock = FakeClock()
    monkeypatch.setattr(trainer_module, "_clock", clock)
    monkeypatch.setattr(trainer_module, "FIT_STEPS", 5)
    if refit_every is not None:
        monkeypatch.setattr(trainer_module, "REFIT_EVERY", refit_every)
    cost = lambda split, n: (0.1 if n <= slow_until else later) if split == "train" else 0.001  # noqa: E731
    cfg = tiny_run(max_steps=1000, **train_kw)
    result = train(cfg, tmp_path, dataset=TimedDataset(dataset, clock, cost), progress=False)
    lrs = [r["lr"] for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "train"]
    return cfg, result, lrs


def test_time_budget_stops_when_steps_slow_down(tmp_path, dataset, monkeypatch):
    """Steps take 0.1 s while the schedule is fitted, then 0.3 s: the refits shorten the
    schedule, and the run stops with a final evaluation once the 3 s are used."""
    _, result, _ = slowdown_run(
        tmp_path, dataset, monkeypatch, 0.3, time_budget=3.0, eval_every=10, eval_batches=2
    )
    assert result.stop_reason == "time_budget" and result.step <= result.max_steps < 28
    # Stopped after the step that used up the budget, plus the final evaluations.
    assert 3.0 <= result.elapsed <= 3.0 + 0.3 + 0.4 + 1e-9
    val = [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "val"]
    assert val[-1] == result.step == load_checkpoint(tmp_path, with_state=True).state["step"]


def test_time_budget_schedule_never_rewinds(tmp_path, dataset, monkeypatch):
    """Steps take 0.1 s while the schedule is first fitted, then 0.02 s: the refits at the
    evaluations must not lengthen the schedule (that restarted the cosine, raising the
    learning rate mid-run), and the warm-up (50 steps configured) is bounded by a
    tenth of the fitted length."""
    cfg, result, lrs = slowdown_run(
        tmp_path, dataset, monkeypatch, 0.02, time_budget=3.0, eval_every=5, warmup_steps=50
    )
    peak = lrs.index(max(lrs))
    # The warm-up ends once the schedule is fitted (after the first timed steps).
    assert peak <= max(0.1 * result.max_steps, 5 + trainer_module.FIT_SKIP_STEPS)
    assert all(b <= a for a, b in zip(lrs[peak:], lrs[peak + 1 :])), lrs  # then only down
    assert result.max_steps <= 30  # fitted on the slow steps, never lengthened
    assert lrs[-1] == pytest.approx(cfg.train.min_lr, rel=0.05)  # the cosine completed
    # The faster steps left time: the run went on at min_lr instead of stopping early.
    assert result.step > result.max_steps + 20
    assert all(lr == pytest.approx(cfg.train.min_lr) for lr in lrs[result.max_steps :])
    assert result.elapsed >= 0.9 * 3.0
    held = result.step - result.max_steps
    assert result.stop_message in (
        f"stopped at step {result.step}: 3 s time budget reached",
        f"stopped at step {result.step}: the schedule fitted to the 3 s time budget "
        f"({result.max_steps} steps) is complete, then {held} steps at min_lr",
    ), result.stop_message


@pytest.mark.parametrize("later", [0.02, 0.3])
def test_time_budget_refits_without_evaluations(tmp_path, dataset, monkeypatch, later):
    """No evaluations on the way (eval_every=0): periodic refits still follow the steps'
    speed. Steps faster than at the first fit: the run goes on at min_lr past the fitted
    schedule instead of stopping at its end. Slower: the schedule is shortened, and the
    budget is not passed. (The first fit reserves time for the final evaluation of the
    whole validation split, estimated from the step time: about 12 s of the 30.)"""
    cfg, result, lrs = slowdown_run(
        tmp_path, dataset, monkeypatch, later, refit_every=5, time_budget=30.0, eval_every=0
    )
    assert result.elapsed <= 30.0 + later + 0.4 + 1e-9
    if later < 0.1:  # fitted to ~180 steps of 0.1 s; ran far more at min_lr
        assert result.max_steps < 200 and result.step > result.max_steps + 300
        assert all(lr == pytest.approx(cfg.train.min_lr) for lr in lrs[result.max_steps :])
    else:  # without the refits the schedule would have stayed ~180 steps long
        assert result.max_steps < 60


def test_time_budget_refits_may_lengthen_the_schedule_during_the_warm_up(
    tmp_path, dataset, monkeypatch
):
    """The first fit is made on 5 slow steps (0.1 s), the rest take 0.05 s: refits while the
    learning rate still warms up (20 steps) lengthen the schedule to the faster pace; after
    the warm-up they only shorten it, and the learning rate never rises again."""
    _, result, lrs = slowdown_run(
        tmp_path, dataset, monkeypatch, 0.05, refit_every=5, time_budget=30.0, warmup_steps=20
    )
    # fitted on the slow steps alone: (30 s - ~12 s kept for the final evaluation) / 0.1 s
    assert result.max_steps > 200
    peak = lrs.index(max(lrs))
    assert peak <= 20 and all(b <= a for a, b in zip(lrs[peak:], lrs[peak + 1 :]))
    assert result.elapsed <= 30.0 + 0.05 + 0.4 + 1e-9


@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
def test_time_budget_wsd_refits_lengthen_until_the_decay(tmp_path, dataset, monkeypatch, schedule):
    """Steps take 0.1 s for the first 40 (past the 5-step warm-up), then 0.05 s. The cosine
    decays from the end of the warm-up: its refits may only shorten, so the faster steps
    run on at min_lr after the schedule fitted on slow steps. WSD holds the peak rate until
    its last decay_fraction: refits in that stable phase lengthen the schedule to the
    faster pace, and the decay, once begun, is never undone."""
    cfg, result, lrs = slowdown_run(
        tmp_path, dataset, monkeypatch, 0.05, refit_every=5, slow_until=40,
        time_budget=30.0, eval_every=0, warmup_steps=5, schedule=schedule,
    )  # fmt: skip
    peak = lrs.index(max(lrs))
    assert peak <= 5 and all(b <= a for a, b in zip(lrs[peak:], lrs[peak + 1 :]))
    assert result.elapsed <= 30.0 + 0.05 + 0.4 + 1e-9
    # fitted on 0.1 s steps: about (30 s - ~12 s kept for the final evaluation) / 0.1 s
    if schedule == "cosine":
        assert result.max_steps < 200 and result.step > result.max_steps + 50
    else:  # the stable phase followed the 0.05 s steps: the schedule filled the budget
        assert result.max_steps > 250 and result.step <= result.max_steps + 5
        assert lrs[result.max_steps - 1] < 1.1 * cfg.train.min_lr  # the decay completed
        decay_start = 5 + int(0.7 * (result.max_steps - 5))
        assert all(lr == pytest.approx(cfg.train.lr) for lr in lrs[5 : decay_start - 10])


def test_time_budget_refits_never_lengthen_the_warm_up(tmp_path, dataset, monkeypatch):
    """A long configured warm-up (1000 steps) is bounded by a tenth of the fitted schedule.
    The first fit is made on 0.1 s steps, later ones on 0.05 s and then 0.002 s steps:
    WSD's stable phase lets the refits lengthen the schedule tenfold, but not the warm-up,
    which would take steps already at the peak rate back into it (the rate fell to a
    fifth of the peak at step 110 and climbed again) and made the warm-up saw-toothed."""
    clock = FakeClock()
    monkeypatch.setattr(trainer_module, "_clock", clock)
    monkeypatch.setattr(trainer_module, "FIT_STEPS", 5)
    monkeypatch.setattr(trainer_module, "REFIT_EVERY", 5)

    def cost(split, n):  # the budget runs out at step 151
        return (0.1 if n <= 6 else 0.05 if n <= 60 else 0.002 if n <= 150 else 100.0) * (
            split == "train"
        )

    cfg = tiny_run(max_steps=5000, time_budget=30.0, eval_every=0, warmup_steps=1000,
                   schedule="wsd")  # fmt: skip
    result = train(cfg, tmp_path, dataset=TimedDataset(dataset, clock, cost), progress=False)
    assert result.stop_reason == "time_budget" and result.step == 151
    lrs = [r["lr"] for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "train"]
    peak = lrs.index(cfg.train.lr)
    assert all(a <= b for a, b in zip(lrs[:peak], lrs[1 : peak + 1])), lrs[:peak]
    assert all(lr == cfg.train.lr for lr in lrs[peak:]), lrs[peak:]  # WSD: held
    assert load_checkpoint(tmp_path, with_state=True).state["fitted_warmup"] <= peak


def test_time_budget_resume_keeps_the_measured_evaluation_time(tmp_path, dataset, monkeypatch):
    """Evaluations (every 20 steps) cost a tenth of a step per batch, much less than the
    guess made before any is timed. A run stopped by SIGTERM in step 41 resumes there and
    refits at step 50, before its next evaluation: with the measured time carried in the
    checkpoint it follows the uninterrupted run (it guessed, and stopped at step 50)."""
    clock = FakeClock()
    monkeypatch.setattr(trainer_module, "_clock", clock)
    monkeypatch.setattr(trainer_module, "FIT_STEPS", 5)
    cost = lambda split, n: 0.1 if split == "train" else 0.01  # noqa: E731
    cfg = tiny_run(max_steps=1000, time_budget=20.0, eval_every=20, warmup_steps=5)

    def lrs(run):
        return [
            r["lr"] for r in read_metrics(tmp_path / run / "metrics.jsonl") if r["kind"] == "train"
        ]

    straight = train(
        cfg, tmp_path / "straight", dataset=TimedDataset(dataset, clock, cost), progress=False
    )
    clock.now = 0.0
    stopping = InterruptingDataset(dataset, at=41)
    first = train(
        cfg, tmp_path / "run", dataset=TimedDataset(stopping, clock, cost), progress=False
    )
    assert first.step == 41
    clock.now = 0.0  # a new process: its clock starts anywhere
    second = train(
        cfg, tmp_path / "run", resume=tmp_path / "run", dataset=TimedDataset(dataset, clock, cost),
        progress=False,
    )  # fmt: skip
    assert second.step == straight.step and second.max_steps == straight.max_steps
    assert lrs("run") == lrs("straight")


def test_time_budget_resume_with_explicit_max_steps_keeps_the_fitted_schedule(
    tmp_path, dataset, monkeypatch
):
    """`attnlab train --max-steps 1000 --time-budget 2.5` with --resume appended: the budget
    still applies, so the schedule fitted before the stop is kept (it went back to 1000
    steps, the rate jumping back up to its peak, until the next refit). Resumed without a
    budget, the run takes train.max_steps (it crashed formatting the missing budget)."""
    clock = FakeClock()
    monkeypatch.setattr(trainer_module, "_clock", clock)
    monkeypatch.setattr(trainer_module, "FIT_STEPS", 5)
    cost = lambda split, n: 0.1 if split == "train" else 0.001  # noqa: E731
    cfg = tiny_run(max_steps=1000, time_budget=2.5, warmup_steps=2, eval_every=5)
    flags = dict(max_steps=1000, time_budget=2.5, progress=False)

    def lrs(run):
        rows = read_metrics(tmp_path / run / "metrics.jsonl")
        return [r["lr"] for r in rows if r["kind"] == "train"]

    straight = train(
        cfg, tmp_path / "straight", dataset=TimedDataset(dataset, clock, cost), **flags
    )
    clock.now = 0.0
    stopping = TimedDataset(InterruptingDataset(dataset, at=10), clock, cost)
    assert train(cfg, tmp_path / "run", dataset=stopping, **flags).step == 10
    clock.now = 0.0
    data = TimedDataset(dataset, clock, cost)
    second = train(cfg, tmp_path / "run", resume=tmp_path / "run", dataset=data, **flags)
    assert second.step == straight.step and second.max_steps == straight.max_steps < 1000
    assert lrs("run") == lrs("straight")
    unbudgeted = tiny_run(max_steps=straight.step + 2, warmup_steps=2)
    third = train(unbudgeted, tmp_path / "run", resume=tmp_path / "run", dataset=data,
                  progress=False)  # fmt: skip
    assert third.step == straight.step + 2 and "max_steps" in third.stop_message


def test_explicit_max_steps_drops_the_time_budget(tmp_path, dataset, monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(trainer_module, "_clock", clock)
    data = TimedDataset(dataset, clock, lambda split, n: 1.0 if split == "train" else 0.0)
    cfg = tiny_run(max_steps=1000, time_budget=2.5)
    first = train(cfg, tmp_path, dataset=data, progress=False)
    assert first.stop_reason == "time_budget" and first.step == 3
    assert first.stop_message == "stopped at step 3: 2.5 s time budget reached"
    # The budget is spent: resumed with it, the run takes no step (it took one each time).
    for _ in range(2):
        spent = train(None, tmp_path, resume=tmp_path, dataset=data, progress=False)
        assert spent.step == 3 and spent.stop_message == first.stop_message
    # An explicit step count continues to it.
    again = train(None, tmp_path, resume=tmp_path, max_steps=6, dataset=data, progress=False)
    assert again.step == 6 and again.stop_message == "stopped at step 6: max_steps=6 reached"
    stops = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "stop"]
    # The resumes that took no step logged no second stop record.
    assert [r["reason"] for r in stops] == ["time_budget", "max_steps"]
    # A fresh run of a config with a budget: max_steps wins unless time_budget is given.
    fresh = train(cfg, tmp_path / "b", max_steps=4, dataset=data, progress=False)
    assert fresh.step == 4 and fresh.stop_reason == "max_steps"
    both = train(cfg, tmp_path / "c", max_steps=4, time_budget=1.5, dataset=data, progress=False)
    assert both.step == 2 and both.stop_reason == "time_budget"


def test_a_time_budget_stop_logs_the_last_log_interval(tmp_path, dataset, monkeypatch):
    """log_every=5 and a budget used up at step 3: the steps since the last record are
    logged at the stop, as at max_steps (metrics.jsonl and loss.png lacked them)."""
    clock = FakeClock()
    monkeypatch.setattr(trainer_module, "_clock", clock)
    data = TimedDataset(dataset, clock, lambda split, n: 1.0 if split == "train" else 0.0)
    cfg = tiny_run(max_steps=1000, time_budget=2.5, log_every=5)
    result = train(cfg, tmp_path, dataset=data, progress=False)
    assert result.stop_reason == "time_budget" and result.step == 3
    rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [3]
    assert rows[0]["train_loss"] == pytest.approx(sum(result.losses) / 3)


def test_a_time_budget_too_long_to_count_in_steps_runs_max_steps(tmp_path, dataset):
    """--time-budget 1e308 (finite, accepted): the steps that fit overflow a float; the
    run takes max_steps (it crashed: "cannot convert float infinity to integer")."""
    cfg = tiny_run(max_steps=2, time_budget=1e308)
    result = train(cfg, tmp_path, dataset=dataset, progress=False)
    assert result.step == 2 and result.stop_reason == "max_steps"


# --------------------------------------------------------------------------- data parallel


DDP_CHILD = textwrap.dedent(
    """
    import json, os, sys, torch
    torch.set_num_threads(1)
    from attnlab.config import RunConfig
    from attnlab.data import prepare_data
    from attnlab.training import train

    cfg = RunConfig.from_json(open(sys.argv[1]).read())
    data = prepare_data(cfg.data, cache_dir=sys.argv[2])
    result = train(cfg, sys.argv[3], dataset=data, progress=False)
    if os.environ["RANK"] == "0":
        with open(sys.argv[4], "w") as f:
            json.dump({"losses": result.losses, "val_loss": result.val_loss}, f)
    """
)


def test_two_processes_equal_one_with_double_batch(tmp_path, dataset, cache_dir):
    # The validation set is eval_batches * batch_size blocks whatever the number of
    # processes: 4 * 3 here, 2 * 6 in the single process below.
    per_process = tiny_run(max_steps=4, batch_size=3, grad_accum=2, eval_every=4, eval_batches=4)
    (tmp_path / "cfg.json").write_text(per_process.to_json())
    (tmp_path / "child.py").write_text(DDP_CHILD)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(tmp_path / "child.py"),
            str(tmp_path / "cfg.json"),
            str(cache_dir),
            str(tmp_path / "ddp"),
            str(tmp_path / "ddp.json"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]  # the processes' own errors, if any
    ddp = json.loads((tmp_path / "ddp.json").read_text())
    single = train(
        tiny_run(max_steps=4, batch_size=6, grad_accum=2, eval_every=4, eval_batches=2),
        tmp_path / "single",
        dataset=dataset,
        progress=False,
    )
    np.testing.assert_allclose(ddp["losses"], single.losses, rtol=1e-5)
    np.testing.assert_allclose(
        grad_norms(tmp_path / "ddp"), grad_norms(tmp_path / "single"), rtol=1e-5
    )
    assert ddp["val_loss"] == pytest.approx(single.val_loss, rel=1e-5)
    assert_weights_close(
        final_weights(tmp_path / "ddp"), final_weights(tmp_path / "single"), tol=1e-5
    )
    # The same config in one process validates on the same blocks: at step 0 (the same
    # initial weights) its val loss equals the 2-process run's.
    train(per_process, tmp_path / "one", max_steps=1, dataset=dataset, progress=False)

    def val_at_0(run: str) -> list[float]:
        records = read_metrics(tmp_path / run / "metrics.jsonl")
        return [r["val_loss"] for r in records if r["kind"] == "val" and r["step"] == 0]

    assert val_at_0("one") == pytest.approx(val_at_0("ddp"), rel=1e-6)
    assert val_at_0("single") == pytest.approx(val_at_0("ddp"), rel=1e-6)


def test_device_resolution():
    resolve = trainer_module.resolve_device
    assert resolve("auto", cuda_count=0) == torch.device("cpu")
    assert resolve("auto", cuda_count=1) == torch.device("cuda", 0)
    assert resolve("cpu", cuda_count=2, local_rank=1, local_world_size=2).type == "cpu"
    # Under torchrun, "cuda" gives each process of the machine its own GPU ...
    for rank in (0, 1):
        for name in ("cuda", "auto"):
            device = resolve(name, cuda_count=2, local_rank=rank, local_world_size=2)
            assert device == torch.device("cuda", rank)
    # ... and refuses more processes than GPUs (CUDA would say "invalid device ordinal") ...
    for name in ("cuda", "auto"):
        with pytest.raises(TrainingError, match=r"process 1 of the 2 .* has 1 GPU; .*=1\)"):
            resolve(name, cuda_count=1, local_rank=1, local_world_size=2)
    # ... an explicit index is taken as named by a single process, where the machine has it ...
    assert resolve("cuda:1", cuda_count=2) == torch.device("cuda", 1)
    with pytest.raises(TrainingError, match=r"'cuda:2' but this machine has 2 GPUs \(cuda:0 to"):
        resolve("cuda:2", cuda_count=2)
    # ... and refused when several processes would share it.
    with pytest.raises(TrainingError, match="all 2 processes of this machine on one GPU"):
        resolve("cuda:1", cuda_count=2, local_rank=1, local_world_size=2)
    with pytest.raises(TrainingError, match="CUDA is not available"):
        resolve("cuda", cuda_count=0)
    with pytest.raises(TrainingError, match="not a device"):
        resolve("gpu", cuda_count=0)


def test_explicit_gpu_under_torchrun_is_refused(monkeypatch):
    """The environment torchrun sets reaches the device resolution: refused before any
    process group or GPU is touched."""
    for name, value in {"WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(TrainingError, match="cuda:1"):
        trainer_module._setup_distributed("cuda:1")


# --------------------------------------------------------------------------- presets


@pytest.mark.parametrize("name", ["demo", "quick", "nanogpt-cpu"])
def test_run_presets_train(tmp_path, dataset, name):
    cfg = get_run_preset(name)
    cfg.train.eval_batches = 1  # keep the test quick
    assert name in list_presets() and name in list_run_presets()
    assert get_preset(name) == cfg.model  # the model preset of the same name
    result = train(cfg, tmp_path, max_steps=2, dataset=dataset, progress=False)
    assert result.step == 2 and math.isfinite(result.val_loss)
    saved = load_checkpoint(tmp_path).config
    assert saved.train.max_steps == 2 and saved.model.vocab_size == dataset.tokenizer.vocab_size


def test_quick_preset_is_the_demo_made_shallow_with_the_same_tokens_per_step_and_wsd():
    demo, quick = get_run_preset("demo"), get_run_preset("quick")
    assert (quick.model.n_layers, quick.train.block_size, quick.model.max_seq_len) == (2, 64, 64)
    tokens = lambda c: c.train.batch_size * c.train.block_size * c.train.grad_accum
    assert tokens(quick) == tokens(demo) == 1024
    shallow = {"n_layers": 2, "max_seq_len": 64, "init_std": 0.04, "attention.n_heads": 8}
    assert quick.model == demo.model.override(shallow)
    assert quick.train == dataclasses.replace(
        demo.train,
        block_size=64,
        batch_size=16,
        lr=3e-3,
        time_budget=30.0,
        schedule="wsd",
        decay_fraction=0.5,
        beta2=0.95,
    )


def test_run_presets_have_the_settings_their_docstrings_give():
    """Each run preset's recipe as its docstring (and the README) states it."""
    demo = get_run_preset("demo")
    m, t = demo.model, demo.train
    assert (m.n_layers, m.d_model, m.attention.n_heads, m.position.kind, m.norm.kind,
            m.ffn.kind, m.init_std) == (4, 128, 4, "rope", "rmsnorm", "glu", 0.06)  # fmt: skip
    assert (t.batch_size, t.block_size, t.lr, t.beta1, t.schedule) == (8, 128, 2e-3, 0.8, "cosine")
    assert (t.time_budget, t.max_steps, demo.data.tokenizer) == (150.0, 2500, "char")
    nano = get_run_preset("nanogpt-cpu")
    m, t = nano.model, nano.train
    assert (m.n_layers, m.attention.n_heads, m.d_model, m.max_seq_len) == (4, 4, 128, 64)
    assert (m.position.kind, m.norm.kind, m.norm.bias, m.ffn.kind, m.ffn.activation) == (
        "learned", "layernorm", True, "mlp", "gelu"
    )  # fmt: skip
    assert m.ffn.hidden_dim in (None, 4 * 128) and m.tie_embeddings and m.dropout == 0.0
    assert (t.batch_size, t.block_size, t.grad_accum, t.lr, t.min_lr) == (12, 64, 1, 1e-3, 1e-4)
    assert (t.beta2, t.weight_decay, t.warmup_steps, t.max_steps, t.schedule) == (
        0.99, 0.1, 100, 2000, "cosine"
    )  # fmt: skip
    assert (t.grad_clip, t.dtype, t.time_budget, nano.data.tokenizer) == (
        1.0, "float32", None, "char"
    )  # fmt: skip
    xl = get_run_preset("xl-tiny")
    assert (xl.task, xl.train.batch_size, xl.train.block_size, xl.model.mem_len) == (
        "lm-stream", 16, 64, 64
    )  # fmt: skip
    assert (xl.train.time_budget, xl.data.tokenizer) == (120.0, "char")
    vit = get_run_preset("vit-digits")
    assert (vit.model.patch_size, vit.model.d_model, vit.model.n_layers) == (2, 64, 3)
    assert (vit.train.time_budget, vit.train.max_steps, vit.data.options["shift"]) == (
        150.0, 3000, 1
    )  # fmt: skip
    numbers = get_run_preset("transformer-numbers")
    m = numbers.model
    assert (m.n_layers, m.n_decoder_layers, m.d_model, m.attention.n_heads) == (2, 2, 64, 4)
    assert (m.norm.placement, m.position.kind, numbers.train.max_steps) == (
        "pre", "sinusoidal", 900
    )  # fmt: skip


def test_get_run_preset_wraps_model_presets():
    cfg = get_run_preset("gpt2-tiny")
    assert cfg.model == get_preset("gpt2-tiny") and cfg.train == TrainConfig()
    with pytest.raises(ConfigError, match="unknown preset 'nope'.*demo"):
        get_run_preset("nope")


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_memory_check_estimates_what_one_step_allocates(optimizer):
    """Weights, gradients and optimizer state after a step (Muon: one moment for the
    matrices it trains, AdamW's two for the rest): the check lets through a machine that
    holds them and refuses one 1% smaller."""
    cfg = get_preset("llama-tiny")
    model = build_model(cfg)
    opt = build_optimizer(model, TrainConfig(optimizer=optimizer), "cpu")
    idx = torch.randint(0, cfg.vocab_size, (2, 16))
    model(idx, targets=idx).loss.backward()
    opt.step()
    params = {id(p): p for p in model.parameters()}.values()
    opts = getattr(opt, "optimizers", [opt])
    states = [v for o in opts for s in o.state.values() for v in s.values()]
    held = sum(p.nbytes + p.grad.nbytes for p in params)
    held += sum(v.nbytes for v in states if isinstance(v, torch.Tensor))
    device = torch.device("cpu")
    trainer_module.check_memory(cfg, device, available=held, optimizer=optimizer)
    with pytest.raises(TrainingError, match="GiB for weights, gradients and"):
        trainer_module.check_memory(cfg, device, available=held * 99 // 100, optimizer=optimizer)


@pytest.mark.parametrize("spent", ["max_steps", "time_budget"])
def test_a_run_resumed_into_another_folder_with_no_step_to_take_saves_its_checkpoint(
    tmp_path, dataset, spent
):
    """``--resume A --out B`` after A's last step (or with its time budget spent) takes no
    step; B still gets the checkpoint, beside the best/ it copied, so it resumes and loads
    (it held best/ alone, and ``--resume B`` said config.json is missing)."""
    kw = dict(dataset=dataset, progress=False)
    train(tiny_run(max_steps=4, eval_every=2), tmp_path / "a", **kw)
    extra = {"time_budget": 1e-9} if spent == "time_budget" else {}
    result = train(tiny_run(max_steps=4, eval_every=2), tmp_path / "b", resume=tmp_path / "a",
                   **extra, **kw)  # fmt: skip
    assert result.step == 4 and result.losses == []
    state = load_checkpoint(tmp_path / "b", with_state=True).state
    assert state["step"] == 4 and state["best_val_loss"] == result.best_val_loss
    again = train(tiny_run(max_steps=6, eval_every=2), tmp_path / "b", resume=tmp_path / "b", **kw)
    assert again.step == 6


def test_a_damaged_best_checkpoint_does_not_stop_a_resume_into_another_folder(tmp_path, dataset):
    """``--resume A --out B`` with A/best missing its weights resumes as it did before
    best/ was copied (and as a resume in place does), with a warning."""
    kw = dict(dataset=dataset, progress=False)
    train(tiny_run(max_steps=4, eval_every=2), tmp_path / "a", **kw)
    (tmp_path / "a" / "best" / "model.safetensors").unlink()
    with pytest.warns(UserWarning, match=r"model.safetensors is missing; .*b.best is not copied"):
        result = train(tiny_run(max_steps=6, eval_every=2), tmp_path / "b",
                       resume=tmp_path / "a", **kw)  # fmt: skip
    assert result.step == 6
    load_checkpoint(tmp_path / "b")
