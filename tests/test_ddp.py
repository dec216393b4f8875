"""Data-parallel training under torchrun (two CPU processes, gloo): what one process with
the same global batch gives, and what a resume into another number of processes keeps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from attnlab.config import RunConfig
from attnlab.presets import get_preset
from attnlab.training import train

REPO = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent(
    """
    import hashlib, json, os, sys, torch
    torch.set_num_threads(1)
    from attnlab.config import RunConfig
    from attnlab.training.trainer import Trainer

    cfg = RunConfig.from_json(open(sys.argv[1]).read())
    resume = sys.argv[3] if sys.argv[3] != "-" else None
    trainer = Trainer(cfg, sys.argv[2], resume=resume, progress=False)
    dropout_rng = hashlib.md5(torch.get_rng_state().numpy().tobytes()).hexdigest()
    result = trainer.run()
    trainer.release()
    with open(f"{sys.argv[4]}.{os.environ['RANK']}.json", "w") as f:
        json.dump({"losses": result.losses, "dropout_rng": dropout_rng}, f)
    """
)


def torchrun(tmp_path: Path, cfg: RunConfig, out: str, resume: str = "-") -> list[dict]:
    (tmp_path / "cfg.json").write_text(cfg.to_json())
    (tmp_path / "child.py").write_text(CHILD)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    args = [str(tmp_path / "child.py"), str(tmp_path / "cfg.json"), str(tmp_path / out),
            str(tmp_path / resume) if resume != "-" else "-", str(tmp_path / out)]  # fmt: skip
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc_per_node=2", *args], check=True, env=env, capture_output=True,
                   timeout=300)  # fmt: skip
    return [json.loads((tmp_path / f"{out}.{rank}.json").read_text()) for rank in (0, 1)]


def dsa_warmup_run(**train_kw) -> RunConfig:
    train_cfg = {
        "train.max_steps": 3, "train.batch_size": 2, "train.block_size": 16,
        "train.eval_every": 0, "train.warmup_steps": 1, "train.log_every": 1,
        **{f"train.{k}": v for k, v in train_kw.items()},
    }  # fmt: skip
    return RunConfig(model=get_preset("deepseek-moe-tiny")).override(
        {
            "model.attention.kind": "dsa",
            "model.attention.index_topk": 4,
            "model.attention.dsa_stage": "warmup",
            **train_cfg,
        }
    )


@pytest.mark.slow
def test_dsa_warmup_two_processes_equal_one_with_double_batch(tmp_path):
    """The warm-up trains the indexer alone: DDP must average its gradients and not wait
    for the frozen parameters' (it crashed at the second step, after a first step whose
    gradients were not averaged)."""
    ddp = torchrun(tmp_path, dsa_warmup_run(), "ddp")
    single = train(dsa_warmup_run(grad_accum=2), tmp_path / "single", progress=False)
    assert len(ddp[0]["losses"]) == 3
    np.testing.assert_allclose(ddp[0]["losses"], single.losses, rtol=1e-5)


@pytest.mark.slow
def test_resume_in_more_processes_gives_each_its_own_dropout_stream(tmp_path):
    """A one-process checkpoint resumed in two processes: the first continues its dropout
    stream, the second must not copy it (every process dropped the same units)."""
    cfg = RunConfig(model=get_preset("gpt2-tiny")).override(
        {
            "model.dropout": 0.1, "train.max_steps": 2, "train.batch_size": 2,
            "train.block_size": 16, "train.eval_every": 0, "train.grad_accum": 2,
        }
    )  # fmt: skip
    train(cfg, tmp_path / "one", progress=False)
    resumed = torchrun(tmp_path, cfg.override({"train.max_steps": 3,
                                               "train.grad_accum": 1}), "one", "one")  # fmt: skip
    assert resumed[0]["dropout_rng"] != resumed[1]["dropout_rng"]
