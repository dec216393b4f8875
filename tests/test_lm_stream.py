"""Transformer-XL training with its memory carried across steps (task lm-stream): the rows
and segments against Transformer-XL's batchify, the memory fed to the next step against a
forward pass by hand, exact resume after SIGTERM (memory saved in the checkpoint) with
gradient accumulation, the state split over processes, validation with memory, and
``attnlab eval`` of an XL checkpoint against scoring the stream by hand.

Shapes: B rows, t segment, m memory, d d_model.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from attnlab.cli.main import main
from attnlab.config import AttentionConfig, ConfigError, DataConfig, RunConfig, TrainConfig
from attnlab.data import TokenDataset, prepare_data
from attnlab.models.xl import XLConfig, xl_loss_sums
from attnlab.presets import get_run_preset, gpt2_style
from attnlab.tasks import TASKS, StreamingLanguageModelling
from attnlab.training import load_checkpoint, train
from attnlab.training.metrics import MetricsLogger

REPO = Path(__file__).resolve().parents[1]
T = 8  # segment length


@pytest.fixture(autouse=True)
def _no_plots(monkeypatch):
    """loss.png is tested elsewhere; drawing it would dominate these runs' time."""
    monkeypatch.setattr(MetricsLogger, "plot", lambda self: None)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> TokenDataset:
    """A short slice of the embedded corpus: whole-split evaluations stay quick."""
    full = prepare_data(DataConfig(), cache_dir=tmp_path_factory.mktemp("cache"))
    return TokenDataset(tokenizer=full.tokenizer, train=full.train[:3000], val=full.val[:700])


def xl_run(**train_kw) -> RunConfig:
    model = XLConfig(
        vocab_size=256, max_seq_len=T, d_model=32, n_layers=2, mem_len=12,
        attention=AttentionConfig(n_heads=2),
    )  # fmt: skip
    train_cfg = dict(
        batch_size=3, block_size=T, max_steps=8, warmup_steps=2, lr=3e-3, min_lr=3e-4,
        eval_every=0, eval_batches=2, log_every=1, seed=0,
    )  # fmt: skip
    train_cfg.update(train_kw)
    return RunConfig(model=model, train=TrainConfig(**train_cfg), task="lm-stream")


def new_task(dataset, **train_kw) -> tuple[StreamingLanguageModelling, torch.nn.Module]:
    from attnlab.models import build_model

    cfg = xl_run(**train_kw)
    task = StreamingLanguageModelling(cfg, data=dataset)
    task.configure_model(cfg.model)
    torch.manual_seed(0)
    return task, build_model(cfg.model)


def test_registered_and_refuses_models_without_memory(dataset):
    assert TASKS["lm-stream"] is StreamingLanguageModelling
    cfg = RunConfig(model=gpt2_style(vocab_size=256, max_seq_len=8, d_model=16, n_layers=1,
                                     n_heads=2), task="lm-stream")  # fmt: skip
    with pytest.raises(ConfigError, match="model.arch: task lm-stream carries a memory"):
        StreamingLanguageModelling(cfg, data=dataset).configure_model(cfg.model)


def test_rows_and_segments_follow_batchify(dataset):
    """Row i starts at i * (len // B); step k reads segment k of every row; after the last
    whole segment the rows start again (segment 0: no memory)."""
    task, _ = new_task(dataset)
    B = 4
    n = len(dataset.train) // B
    rows = torch.as_tensor(dataset.train[: B * n].astype(np.int64)).view(B, n)  # batchify
    n_seg = (n - 1) // T
    for step in range(n_seg + 2):
        keys = task.sample(B, torch.Generator())
        k = step % n_seg
        x, y = task.batch(keys)["x"], task.batch(keys)["y"]
        assert torch.equal(x, rows[:, k * T : (k + 1) * T])
        assert torch.equal(y, rows[:, k * T + 1 : (k + 1) * T + 1])
        assert task.batch(keys)["first"] == (k == 0)
    with pytest.raises(ConfigError, match="train.batch_size: task lm-stream reads 4 rows"):
        task.sample(6, torch.Generator())


@torch.no_grad()
def test_each_step_gets_the_memory_its_rows_left(dataset):
    """Two micro-batches (rows 0-1 and 2-3) over three steps: each step's loss equals the
    model run by hand on the row's segments with the memory of its previous segment."""
    task, model = new_task(dataset)
    model.eval()  # no dropout: the same numbers twice
    losses = []
    for _ in range(3):
        keys = task.sample(4, torch.Generator()).view(2, 2, 3)
        losses.append([float(task.step(model, task.batch(keys[i])).loss) for i in range(2)])
    n = len(dataset.train) // 4
    rows = torch.as_tensor(dataset.train[: 4 * n].astype(np.int64)).view(4, n)
    for i, pick in enumerate(([0, 1], [2, 3])):
        memory = None
        for k in range(3):
            x, y = rows[pick, k * T : (k + 1) * T], rows[pick, k * T + 1 : (k + 1) * T + 1]
            out = model(x, memory=memory, targets=y)
            assert float(out.loss) == pytest.approx(losses[k][i], rel=1e-6)
            if memory is not None:  # the memory changes the loss: it is really used
                alone = float(model(x, targets=y).loss)
                assert alone != pytest.approx(losses[k][i], rel=1e-5)
            memory = out.memory
    assert [m.shape for m in task.memory[3]] == [(12, 32)] * 2  # capped at mem_len


def test_state_of_several_processes_recombines(dataset):
    """Each process saves its rows' memory; a run resumed with any number of processes
    finds every row's memory."""
    task, model = new_task(dataset)
    for _ in range(2):
        keys = task.sample(4, torch.Generator())
        task.step(model, task.batch(keys))
    state = task.state_dict()
    parts = []
    for mine in ([0, 1], [2, 3]):  # as two processes would have saved it
        part = dict(state, memory_rows=mine)
        part["memory"] = [layer[mine] for layer in state["memory"]]
        parts.append(part)
    fresh, _ = new_task(dataset)
    fresh.load_state_dict(parts)
    assert fresh.segment == 2 and fresh.rows == 4 and sorted(fresh.memory) == [0, 1, 2, 3]
    for r in range(4):
        for a, b in zip(fresh.memory[r], task.memory[r]):
            assert torch.equal(a, b)


class InterruptingDataset:
    """Sends SIGTERM while the ``at``-th training micro-batch is fetched."""

    def __init__(self, inner, at: int):
        self.inner, self.at, self.calls = inner, at, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def batch(self, split, starts, block_size, device=None):
        if split == "train":
            self.calls += 1
            if self.calls == self.at:
                os.kill(os.getpid(), signal.SIGTERM)
        return self.inner.batch(split, starts, block_size, device)


def test_resume_after_sigterm_equals_uninterrupted(tmp_path, dataset):
    """Dropout and accumulation on, memory carried: stopped in the middle of step 5 and
    resumed, the run's losses and weights equal an uninterrupted run's bit for bit (the
    memory and the segment counter come back from the checkpoint)."""
    cfg = xl_run(grad_accum=2, eval_every=3, max_steps=8)
    cfg.model.dropout = 0.1
    straight = train(cfg, tmp_path / "straight", dataset=dataset, progress=False)
    first = train(cfg, tmp_path / "run", dataset=InterruptingDataset(dataset, 9), progress=False)
    assert first.interrupted == "SIGTERM" and first.step == 5
    second = train(None, tmp_path / "run", resume=tmp_path / "run", dataset=dataset,
                   progress=False)  # fmt: skip
    assert first.losses + second.losses == straight.losses
    a, b = (load_checkpoint(tmp_path / d).model.state_dict() for d in ("run", "straight"))
    assert all(torch.equal(a[name], b[name]) for name in a)
    assert second.val_loss == straight.val_loss
    state = torch.load(tmp_path / "run" / "trainer_state.pt", weights_only=True)
    assert state["trainer"]["task"][0]["segment"] == 8


def test_resume_with_another_global_batch_is_refused(tmp_path, dataset):
    train(xl_run(max_steps=2), tmp_path, dataset=dataset, progress=False)
    cfg = xl_run(max_steps=4, batch_size=2)
    with pytest.raises(ConfigError, match="reads 3 rows"):
        train(cfg, tmp_path, resume=tmp_path, dataset=dataset, progress=False)


@torch.no_grad()
def test_validation_reads_streams_with_memory(dataset):
    """batch_size streams of the validation split, each scored with its memory carried:
    one stream equals xl_loss_sums; processes share the streams, the totals do not change."""
    task, model = new_task(dataset)
    model.eval()
    one = task.eval_sums(model, batch_size=1, max_batches=None)
    n_seg = (len(dataset.val) - 1) // T
    val = torch.as_tensor(dataset.val.astype(np.int64))
    total, count = xl_loss_sums(model, val[: n_seg * T + 1], T)
    assert one["tokens"] == count == n_seg * T
    assert one["loss_sum"] == pytest.approx(total, rel=1e-5)
    whole = task.eval_sums(model, batch_size=3, max_batches=2)
    parts = [task.eval_sums(model, batch_size=3, max_batches=2, rank=r, world_size=2)
             for r in range(2)]  # fmt: skip
    assert whole["tokens"] == 3 * 2 * T == sum(p["tokens"] for p in parts)
    assert whole["loss_sum"] == pytest.approx(sum(p["loss_sum"] for p in parts), rel=1e-6)
    assert task.eval_examples(3, 2) == 6 and "the first 2 of" in task.eval_coverage(3, 2)


def test_eval_cli_scores_an_xl_checkpoint_with_memory(tmp_path, dataset, capsys):
    """``attnlab eval --ckpt XL`` reads the text as one stream, segment by segment with the
    memory carried: the loss equals scoring the stream by hand."""
    train(xl_run(max_steps=2), tmp_path / "run", dataset=dataset, progress=False)
    text = "".join(dataset.tokenizer.decode(dataset.val[:200].tolist()))
    (tmp_path / "text.txt").write_text(text)
    argv = ["eval", "--ckpt", str(tmp_path / "run"), "--data", str(tmp_path / "text.txt")]
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    ckpt = load_checkpoint(tmp_path / "run")
    tokens = torch.as_tensor(ckpt.tokenizer.encode_array(text).astype(np.int64))
    model = ckpt.model.eval()
    total, memory = 0.0, None
    with torch.no_grad():  # by hand: consecutive segments of T, memory carried
        for s in range(0, len(tokens) - 1, T):
            x, y = tokens[None, s : min(s + T, len(tokens) - 1)], tokens[None, s + 1 : s + T + 1]
            out = model(x, memory=memory)
            total += float(F.cross_entropy(out.logits[0], y[0], reduction="sum"))
            memory = out.memory
    assert report["tokens"] == len(tokens) - 1 and report["memory"] == 12
    assert report["loss"] == pytest.approx(total / (len(tokens) - 1), rel=1e-5)
    assert report["loss"] == pytest.approx(xl_loss_sums(model, tokens, T)[0] / (len(tokens) - 1),
                                           rel=1e-5)  # fmt: skip
    assert main(argv) == 0
    assert "memory 12 carried" in capsys.readouterr().out
    assert main([*argv, "--stride", "4"]) == 1
    assert "--stride: this model reads the text in segments" in capsys.readouterr().err


def test_xl_tiny_run_preset_streams(tmp_path, dataset):
    cfg = get_run_preset("xl-tiny")
    assert cfg.task == "lm-stream" and cfg.model.arch == "xl"
    cfg.train.batch_size, cfg.train.eval_batches = 2, 1
    result = train(cfg, tmp_path, max_steps=2, dataset=dataset, progress=False)
    assert result.step == 2 and "with memory" in result.val_coverage


DDP_CHILD = textwrap.dedent(
    """
    import json, os, sys, torch
    torch.set_num_threads(1)
    from attnlab.config import RunConfig
    from attnlab.data import TokenDataset, prepare_data
    from attnlab.training import train

    cfg = RunConfig.from_json(open(sys.argv[1]).read())
    full = prepare_data(cfg.data, cache_dir=sys.argv[2])
    data = TokenDataset(tokenizer=full.tokenizer, train=full.train[:3000], val=full.val[:700])
    result = train(cfg, sys.argv[3], dataset=data, progress=False)
    if os.environ["RANK"] == "0":
        with open(sys.argv[4], "w") as f:
            json.dump({"losses": result.losses, "val_loss": result.val_loss}, f)
    """
)


@pytest.mark.slow
def test_two_processes_equal_one_with_double_batch(tmp_path, dataset):
    """Each process reads its own rows and keeps their memory: 2 processes x 3 rows equal
    one process with 6 rows (the validation streams: batch_size, whatever the processes)."""
    cfg = xl_run(max_steps=4, grad_accum=2, eval_every=4)
    (tmp_path / "cfg.json").write_text(cfg.to_json())
    (tmp_path / "child.py").write_text(DDP_CHILD)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    args = [str(tmp_path / n) for n in ("child.py", "cfg.json", "cache", "ddp", "ddp.json")]
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc_per_node=2", *args], check=True, env=env, capture_output=True,
                   timeout=300)  # fmt: skip
    ddp = json.loads((tmp_path / "ddp.json").read_text())
    single = train(xl_run(max_steps=4, grad_accum=2, eval_every=4, batch_size=6),
                   tmp_path / "single", dataset=dataset, progress=False)  # fmt: skip
    np.testing.assert_allclose(ddp["losses"], single.losses, rtol=1e-5)
    resumed_state = torch.load(tmp_path / "ddp" / "trainer_state.pt", weights_only=True)
    assert [p["memory_rows"] for p in resumed_state["trainer"]["task"]] == [
        [0, 1, 2, 6, 7, 8],
        [3, 4, 5, 9, 10, 11],
    ]
