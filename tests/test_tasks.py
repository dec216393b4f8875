"""The task protocol: the registry and the config's task field, the language-modelling
task, and a toy classification task registered here that the trainer trains, checkpoints
(without a tokenizer), evaluates and resumes exactly, which shows the trainer is generic.
Also: a model's auxiliary loss is optimised and its metrics are logged."""

from __future__ import annotations

import json
import math
import os
import signal
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import attnlab.training.trainer as trainer_module
from attnlab.cli.main import main
from attnlab.config import ConfigError, DataConfig, RunConfig, TrainConfig
from attnlab.data import prepare_data
from attnlab.models import build_model
from attnlab.presets import gpt2_style
from attnlab.tasks import (
    TASKS,
    LanguageModelling,
    StepOutput,
    Task,
    get_task,
    model_extras,
    shard,
)
from attnlab.training import evaluate, load_checkpoint, train
from attnlab.training.metrics import read_metrics

# --------------------------------------------------------------------------- a toy task

N_CLASSES = 8  # tokens are classes too
SEQ_LEN = 6


class ToyRecall(Task):
    """Sequences of random tokens; the label is the first token, predicted from the last
    position's logits (the model must attend back). Batches are dicts of tensors."""

    name = "toy-recall"
    unit = "examples"

    def __init__(self, cfg, *, tokenizer=None, data=None):
        super().__init__(cfg, tokenizer=None)
        g = torch.Generator().manual_seed(1234)  # the data does not depend on the run's seed
        self.train_x = torch.randint(0, N_CLASSES, (256, SEQ_LEN), generator=g)
        self.val_x = torch.randint(0, N_CLASSES, (40, SEQ_LEN), generator=g)

    def configure_model(self, model_cfg):
        model_cfg.vocab_size = N_CLASSES

    def sample(self, n, generator):
        return torch.randint(0, len(self.train_x), (n,), generator=generator)

    def batch(self, keys, device=None):
        x = self.train_x[keys]
        return {"x": x.to(device), "label": x[:, 0].to(device)}

    def step(self, model, batch):
        out = model(batch["x"])
        loss = F.cross_entropy(out.logits[:, -1], batch["label"])
        aux_loss, metrics = model_extras(out)
        return StepOutput(loss, len(batch["x"]), aux_loss, metrics)

    def eval_sums(self, model, *, batch_size, max_batches, rank=0, world_size=1, device=None):
        n = (
            len(self.val_x)
            if max_batches is None
            else min(len(self.val_x), batch_size * max_batches)
        )
        mine = shard(n, rank, world_size)
        loss_sum = correct = 0.0
        for x in self.val_x[mine.start : mine.stop].split(batch_size):
            logits = model(x.to(device)).logits[:, -1]
            label = x[:, 0].to(device)
            loss_sum += float(F.cross_entropy(logits, label, reduction="sum"))
            correct += float((logits.argmax(-1) == label).sum())
        return {"loss_sum": loss_sum, "correct": correct, "examples": float(len(mine))}

    def summarize(self, sums):
        n = sums["examples"]
        return {"loss": sums["loss_sum"] / n, "accuracy": sums["correct"] / n, "examples": n}


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(TASKS, ToyRecall.name, ToyRecall)
    return ToyRecall


def toy_run(**train_kw) -> RunConfig:
    model = gpt2_style(vocab_size=N_CLASSES, max_seq_len=SEQ_LEN, d_model=32, n_layers=2, n_heads=2)
    train_cfg = dict(
        batch_size=16,
        max_steps=12,
        warmup_steps=2,
        lr=3e-3,
        min_lr=3e-4,
        eval_every=0,
        eval_batches=2,
        log_every=1,
        seed=0,
    )
    train_cfg.update(train_kw)
    return RunConfig(model=model, train=TrainConfig(**train_cfg), task=ToyRecall.name)


def train_records(out_dir) -> list[dict]:
    return [r for r in read_metrics(out_dir / "metrics.jsonl") if r["kind"] == "train"]


# --------------------------------------------------------------------------- registry, config


def test_registry_and_config_field(tmp_path):
    assert get_task("lm") is LanguageModelling and TASKS["lm"].unit == "tokens"
    with pytest.raises(ValueError, match="unknown task 'nope'; choose one of lm"):
        get_task("nope")
    assert RunConfig().task == "lm"
    with pytest.raises(ConfigError, match="task: unknown value 'nope'; choose one of lm"):
        RunConfig(task="nope").validate()
    with pytest.raises(ConfigError, match="task"):
        RunConfig.from_dict({"task": 3})
    # config.json files written before tasks existed still load, as language modelling.
    old = RunConfig().to_dict()
    del old["task"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert RunConfig.load(tmp_path / "old.json").task == "lm"
    assert json.loads(RunConfig().to_json())["task"] == "lm"


def test_registered_task_is_accepted_by_config(toy):
    assert RunConfig(task=toy.name).override({"train.lr": 1e-3}).task == toy.name


@pytest.mark.parametrize("n", [0, 1, 5, 12, 13])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_shard_covers_each_index_once(n, world_size):
    parts = [shard(n, rank, world_size) for rank in range(world_size)]
    assert [i for part in parts for i in part] == list(range(n))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_model_extras_before_and_after_the_output_change():
    assert model_extras(SimpleNamespace(logits=None, loss=None)) == (None, {})
    aux = torch.tensor(0.5)
    out = SimpleNamespace(aux_loss=aux, metrics={"balance": 1.0})
    assert model_extras(out) == (aux, {"balance": 1.0})
    step = StepOutput(loss=torch.tensor(2.0), count=3, aux_loss=aux)
    assert float(step.objective) == 2.5
    assert float(StepOutput(loss=torch.tensor(2.0), count=3).objective) == 2.0


# --------------------------------------------------------------------------- language modelling


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return prepare_data(DataConfig(), cache_dir=tmp_path_factory.mktemp("cache"))


def test_lm_eval_is_a_slice_of_one_fixed_set(dataset):
    cfg = RunConfig(
        model=gpt2_style(vocab_size=256, max_seq_len=16, d_model=16, n_layers=1, n_heads=2)
    )
    task = LanguageModelling(cfg, data=dataset)
    task.configure_model(cfg.model)
    assert cfg.model.vocab_size == dataset.tokenizer.vocab_size
    model = build_model(cfg.model).eval()
    whole = task.evaluate(model, batch_size=3, max_batches=4)
    # A fixed random sample of 12 of the split's non-overlapping blocks, spread over it.
    blocks = task.eval_block_indices(3, 4)
    n_blocks = dataset.n_eval_blocks("val", 16)
    assert len(blocks) == 12 and blocks.unique().numel() == 12
    assert torch.equal(blocks, task.eval_block_indices(3, 4))  # the same every time
    assert blocks.max() > n_blocks // 2  # not just the start of the split
    assert set(blocks.tolist()) <= set(task.eval_block_indices(5, 4).tolist())  # nested
    assert "12 of" in task.eval_coverage(3, 4) and task.eval_coverage(3, None).startswith("all")
    # Evaluated directly, block by block.
    x, y = dataset.batch("val", blocks * 16, 16)
    direct = evaluate(model, [(x, y)])
    assert whole == pytest.approx(direct, rel=1e-6)
    assert whole["tokens"] == 12 * 16
    # Three processes, each its slice: the totals add up to the one-process ones.
    with torch.no_grad():
        parts = [
            task.eval_sums(model, batch_size=3, max_batches=4, rank=r, world_size=3)
            for r in range(3)
        ]
    summed = {k: sum(p[k] for p in parts) for k in parts[0]}
    assert task.summarize(summed) == pytest.approx(whole, rel=1e-6)
    # All blocks with max_batches=None: the dataset's own iterator over the split.
    everything = task.evaluate(model, batch_size=64, max_batches=None)
    assert everything == pytest.approx(evaluate(model, dataset.iter_eval("val", 64, 16)), rel=1e-6)


def test_lm_eval_sample_size_for_one_percent(dataset):
    """The sample size the task asks for from the spread of block losses: a sample that
    large agrees with the whole split within 1%."""
    cfg = RunConfig(
        model=gpt2_style(vocab_size=256, max_seq_len=16, d_model=16, n_layers=1, n_heads=2)
    )
    task = LanguageModelling(cfg, data=dataset)
    task.configure_model(cfg.model)
    torch.manual_seed(0)
    model = build_model(cfg.model).eval()
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.5) if hasattr(model, "lm_head") else None
        sums = task.eval_sums(model, batch_size=8, max_batches=2)
        needed = task.eval_batches_needed(sums, 8, 0.01)
        whole = task.evaluate(model, batch_size=64, max_batches=None)["loss"]
        sample = task.evaluate(model, batch_size=8, max_batches=needed)["loss"]
    assert needed is None or needed * 8 < dataset.n_eval_blocks("val", 16)
    assert sample == pytest.approx(whole, rel=0.01)


def test_lm_eval_sample_size_is_cochrans_with_the_finite_population_correction(dataset):
    """eval_batches_needed from the block losses' sums against Cochran's sample size written
    out: n0 = (z s / (tol mean))^2 with s the sample standard deviation (n - 1), then
    n0 / (1 + (n0 - 1) / N) for a split of N blocks, in whole batches."""
    cfg = RunConfig(
        model=gpt2_style(vocab_size=256, max_seq_len=16, d_model=16, n_layers=1, n_heads=2)
    )
    task = LanguageModelling(cfg, data=dataset)
    N = dataset.n_eval_blocks("val", 16)
    losses = np.array([2.0, 2.6, 1.7, 2.3])  # four blocks: n - 1 differs from n
    sums = {"blocks": 4.0, "block_loss_sum": losses.sum(), "block_loss_sq": (losses**2).sum()}
    mean, s = losses.mean(), losses.std(ddof=1)
    for n0 in (2 * N, N / 2, 40.0, 1.5):  # the correction large to small; at least a batch
        tol = 1.96 * s / (mean * math.sqrt(n0))
        expected = math.ceil(n0 / (1 + (n0 - 1) / N) / 8)
        assert task.eval_batches_needed(sums, 8, tol) == expected


# --------------------------------------------------------------------------- a generic trainer


def test_toy_task_trains_checkpoints_and_evaluates(tmp_path, toy, capsys):
    cfg = toy_run(max_steps=120, eval_every=60, log_every=20)
    result = train(cfg, tmp_path, progress=False)
    val = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "val"]
    assert [r["step"] for r in val] == [0, 60, 120]
    assert set(val[0]) >= {"val_loss", "val_accuracy", "val_examples"}
    assert val[0]["val_examples"] == 32  # eval_batches * batch_size
    assert val[-1]["val_loss"] < val[0]["val_loss"] - 0.5  # it learns
    assert val[-1]["val_accuracy"] > 2 / N_CLASSES
    assert result.unit == "examples" and result.throughput > 0
    assert result.val_metrics["accuracy"] == val[-1]["val_accuracy"]
    with pytest.raises(AttributeError, match="examples"):
        _ = result.tokens_per_second
    records = train_records(tmp_path)
    assert all(r["examples_per_second"] > 0 and "tokens_per_second" not in r for r in records)
    # A checkpoint without a tokenizer, loadable and marked with its task.
    assert not (tmp_path / "tokenizer.json").exists()
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.tokenizer is None and ckpt.config.task == toy.name
    # attnlab eval reports the task's metrics: on the trainer's validation set (2 batches
    # of 16), the same as the trainer's last validation.
    code = main(["eval", "--ckpt", str(tmp_path), "--json", "--max-batches", "2"])
    out = capsys.readouterr().out
    assert code == 0
    report = json.loads(out)
    assert report["task"] == toy.name
    assert report["accuracy"] == pytest.approx(val[-1]["val_accuracy"])
    assert report["loss"] == pytest.approx(val[-1]["val_loss"], rel=1e-5)
    assert main(["eval", "--ckpt", str(tmp_path), "--max-batches", "1"]) == 0
    assert "accuracy" in capsys.readouterr().out


class InterruptedToy(ToyRecall):
    """Sends SIGTERM to this process while fetching the ``at``-th training micro-batch."""

    at = 9
    calls = 0

    def batch(self, keys, device=None):
        type(self).calls += 1
        if type(self).calls == self.at:
            os.kill(os.getpid(), signal.SIGTERM)
        return super().batch(keys, device)


def test_toy_task_resumes_exactly_after_sigterm(tmp_path, toy, monkeypatch):
    cfg = toy_run(grad_accum=2, eval_every=4, max_steps=10)
    cfg.model.dropout = 0.1  # every random stream matters
    straight = train(cfg, tmp_path / "straight", progress=False)
    monkeypatch.setitem(TASKS, toy.name, InterruptedToy)
    first = train(cfg, tmp_path / "run", progress=False)
    assert first.interrupted == "SIGTERM" and first.step == 5
    monkeypatch.setitem(TASKS, toy.name, ToyRecall)
    second = train(None, tmp_path / "run", resume=tmp_path / "run", progress=False)
    assert second.step == 10
    assert first.losses + second.losses == straight.losses
    a, b = load_checkpoint(tmp_path / "run").model, load_checkpoint(tmp_path / "straight").model
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), name
    assert second.best_val_loss == straight.best_val_loss
    # Another task cannot resume this run.
    other = toy_run(max_steps=12)
    other.task = "lm"
    with pytest.raises(trainer_module.TrainingError, match="task 'toy-recall', not 'lm'"):
        train(other, tmp_path / "run", resume=tmp_path / "run", progress=False)


# --------------------------------------------------------------------------- aux loss, metrics


def with_aux_outputs(weight: float):
    """build_model whose model adds ``aux_loss = weight * sum of squared weights`` and a
    metric ``calls`` (1, 2, 3, ... per training forward) to its outputs."""

    def build(model_cfg):
        model = build_model(model_cfg)
        forward, calls = model.forward, {"n": 0}

        def forward_with_extras(*args, **kwargs):
            out = forward(*args, **kwargs)
            if not model.training:
                return out
            calls["n"] += 1
            aux = weight * sum((p**2).sum() for p in model.parameters())
            return SimpleNamespace(
                logits=out.logits,
                loss=out.loss,
                aux_loss=aux,
                metrics={"calls": torch.tensor(float(calls["n"])), "const": 2.0},
            )

        model.forward = forward_with_extras
        return model

    return build


def test_aux_loss_is_optimised_and_metrics_are_logged(tmp_path, dataset, monkeypatch):
    lm = RunConfig(
        model=gpt2_style(vocab_size=256, max_seq_len=16, d_model=16, n_layers=1, n_heads=2),
        train=TrainConfig(
            batch_size=4, max_steps=4, warmup_steps=1, eval_every=0, eval_batches=1, log_every=2
        ),
    )
    plain = train(lm, tmp_path / "plain", dataset=dataset, progress=False)
    monkeypatch.setattr(trainer_module, "build_model", with_aux_outputs(0.0))
    zero = train(lm, tmp_path / "zero", dataset=dataset, progress=False)
    assert zero.losses == plain.losses  # a zero aux loss changes nothing
    monkeypatch.setattr(trainer_module, "build_model", with_aux_outputs(1.0))
    aux = train(lm, tmp_path / "aux", dataset=dataset, progress=False)
    assert aux.losses[0] == plain.losses[0]  # the main loss is reported, not loss + aux
    assert aux.losses[1:] != plain.losses[1:]  # ... and the aux loss was optimised
    records = train_records(tmp_path / "aux")
    assert [r["step"] for r in records] == [2, 4]
    assert [r["calls"] for r in records] == [1.5, 3.5]  # the mean over each interval
    assert all(r["const"] == 2.0 and r["aux_loss"] > 0 for r in records)
    assert all(r["tokens_per_second"] > 0 for r in records)
    assert "calls" not in train_records(tmp_path / "plain")[0]
    assert math.isfinite(aux.val_loss)
    np.testing.assert_allclose(
        [r["train_loss"] for r in records], np.array(aux.losses).reshape(2, 2).mean(1)
    )


def test_aux_loss_of_a_model_module_reaches_the_trainer(tmp_path, dataset, monkeypatch):
    """The models' own mechanism (a submodule with ``has_aux``, see models/outputs.py):
    its aux loss is optimised and its metrics are logged under the module's name."""
    from attnlab.models.outputs import aux_modules

    def build(model_cfg):
        model = build_model(model_cfg)
        ffn = model.blocks[0].ffn
        ffn.has_aux = True
        ffn.register_forward_hook(
            lambda m, a, o: (
                setattr(m, "aux_loss", o.pow(2).mean()) or setattr(m, "aux_metrics", {"load": 1.5})
            )
        )
        model._aux = aux_modules(model)
        return model

    lm = RunConfig(
        model=gpt2_style(vocab_size=256, max_seq_len=16, d_model=16, n_layers=1, n_heads=2),
        train=TrainConfig(
            batch_size=4, max_steps=3, warmup_steps=1, eval_every=0, eval_batches=1, log_every=1
        ),
    )
    plain = train(lm, tmp_path / "plain", dataset=dataset, progress=False)
    monkeypatch.setattr(trainer_module, "build_model", build)
    aux = train(lm, tmp_path / "aux", dataset=dataset, progress=False)
    assert aux.losses[0] == plain.losses[0] and aux.losses[1:] != plain.losses[1:]
    records = train_records(tmp_path / "aux")
    assert all(r["blocks.0.ffn/load"] == 1.5 and r["aux_loss"] > 0 for r in records)


def test_an_aux_loss_accumulated_over_micro_batches_trains_as_one_batch(
    tmp_path, dataset, monkeypatch
):
    """An aux loss is a mean per micro-batch (as the main loss): two micro-batches of b
    must give the losses and gradients of one batch of 2b, the aux loss counted once, not
    once per micro-batch. (This aux loss does not depend on the batch: any scale error
    shows in the gradient norms, which Adam hides from losses and weights.)"""

    def lm(**kw) -> RunConfig:
        model = gpt2_style(vocab_size=256, max_seq_len=16, d_model=16, n_layers=1, n_heads=2)
        train_kw = dict(batch_size=8, max_steps=3, warmup_steps=1, eval_every=0, eval_batches=1)
        return RunConfig(model=model, train=TrainConfig(**{**train_kw, **kw}))

    monkeypatch.setattr(trainer_module, "build_model", with_aux_outputs(0.05))
    one = train(lm(), tmp_path / "one", dataset=dataset, progress=False)
    two = train(lm(batch_size=4, grad_accum=2), tmp_path / "two", dataset=dataset, progress=False)
    np.testing.assert_allclose(two.losses, one.losses, rtol=1e-5)
    norms = [[r["grad_norm"] for r in train_records(tmp_path / n)] for n in ("one", "two")]
    np.testing.assert_allclose(norms[1], norms[0], rtol=1e-5)
    aux = [[r["aux_loss"] for r in train_records(tmp_path / n)] for n in ("one", "two")]
    np.testing.assert_allclose(aux[1], aux[0], rtol=1e-5)
