"""Benchmark scripts refuse options they cannot honour with a usage error (exit status 2)
before any work, instead of running something else under the option's name, printing an
empty table, or ending in a traceback from deep inside."""

from __future__ import annotations

import importlib
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module


def refused(monkeypatch, capsys, module, *argv: str) -> str:
    """Run ``module.main()`` with ``argv``; assert argparse's usage error; its message."""
    monkeypatch.setattr("sys.argv", [f"{module.__name__}.py", *argv])
    with pytest.raises(SystemExit) as exit_info:
        module.main()
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_allocator_refuses_an_unknown_variant(bench, monkeypatch, capsys):
    """``--variants foo`` used to run the eager training step and label its row "foo"."""
    allocator = bench("allocator")

    def no_measure(*args, **kwargs):
        raise AssertionError("measured before --variants was checked")

    monkeypatch.setattr(allocator, "measure", no_measure)
    err = refused(monkeypatch, capsys, allocator, "--variants", "eager", "foo")
    assert "invalid choice: 'foo'" in err


def test_mfu_refuses_no_eager_without_compile(bench, monkeypatch, capsys):
    """``--no-eager`` alone used to build nothing and print an empty table."""
    mfu = bench("mfu")
    monkeypatch.setattr(mfu, "Trainer", None)  # building a trainer would fail loudly
    err = refused(monkeypatch, capsys, mfu, "--no-eager", "--presets", "demo")
    assert "--no-eager" in err and "--compile" in err


def test_train_backends_refuses_unknown_and_gpu_only_variants(bench, monkeypatch, capsys):
    """``--variants foo``, or only ``triton`` on a CPU, used to load the corpus, build no
    run and end in an IndexError."""
    backends = bench("train_backends")

    def no_data(*args, **kwargs):
        raise AssertionError("the corpus was loaded before --variants was checked")

    monkeypatch.setattr(backends, "prepare_data", no_data)
    err = refused(monkeypatch, capsys, backends, "--device", "cpu", "--variants", "foo")
    assert "invalid choice: 'foo'" in err
    err = refused(monkeypatch, capsys, backends, "--device", "cpu", "--variants", "triton")
    assert "triton needs a GPU" in err


@pytest.mark.parametrize(
    "script", ["flash_attention", "compile_decode", "mfu", "vs_transformers", "train_backends"]
)
def test_device_cuda_without_cuda_is_a_usage_error(bench, monkeypatch, capsys, script):
    """``--device cuda`` on a machine without CUDA used to end in torch's AssertionError
    traceback (after loading the corpus, for train_backends)."""
    if script == "vs_transformers":
        pytest.importorskip("transformers")
    module = bench(script)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = refused(monkeypatch, capsys, module, "--device", "cuda")
    assert "--device cuda: CUDA is not available on this machine" in err


def test_train_levers_refuses_an_unknown_variant(bench, monkeypatch, capsys):
    levers = bench("train_levers")
    err = refused(monkeypatch, capsys, levers, "--variants", "preset", "foo")
    assert "invalid choice: 'foo'" in err


class _FakeTrainer:
    """Just what train_levers.py uses of a Trainer; each step of the variant named by the
    run folder takes ``DELAY[name]`` seconds."""

    DELAY = {"mkl": 0.03, "preset": 0.01}

    def __init__(self, cfg, out_dir, progress=False):
        delay = self.DELAY[Path(out_dir).name]
        self.tc, self.device, self.autocast_dtype, self.data_generator = (
            cfg.train, torch.device("cpu"), None, None
        )  # fmt: skip
        self.model = self.train_model = torch.nn.Linear(2, 1)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)

        def step(model, batch):
            time.sleep(delay)
            loss = model(torch.ones(1, 2)).sum()
            return SimpleNamespace(objective=loss, loss=loss)

        self.task = SimpleNamespace(sample=lambda n, g: None, batch=lambda k, d: None, step=step)


def test_train_levers_speed_is_relative_to_the_preset(bench, monkeypatch, capsys):
    """The docstring's "speed relative to the preset" was relative to the first variant
    named: ``--variants mkl preset`` showed mkl at 1.00x and the preset 3x faster."""
    levers = bench("train_levers")
    monkeypatch.setattr("attnlab.training.trainer.Trainer", _FakeTrainer)
    monkeypatch.setattr(
        "sys.argv", ["train_levers.py", "--steps", "5", "--variants", "mkl", "preset"]
    )
    levers.main()
    speed = {}
    for line in capsys.readouterr().out.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] in ("mkl", "preset"):
            speed[cells[0]] = float(cells[2].rstrip("x"))
    assert speed["preset"] == 1.0
    assert speed["mkl"] < 0.8
