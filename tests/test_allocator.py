"""The malloc settings of attnlab/allocator.py: with them, memory freed and allocated again
is not page-faulted back in; the trainer applies them on CPU when
``train.keep_freed_memory`` is on, the command line for its other commands. Each malloc
measurement runs in a fresh process (the settings are process-wide and cannot be undone)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

import attnlab.allocator as allocator_module
import attnlab.training.trainer as trainer_module
from attnlab.cli.main import main
from attnlab.presets import get_run_preset
from attnlab.training.trainer import Trainer

GLIBC = sys.platform.startswith("linux") and "glibc" in " ".join(__import__("platform").libc_ver())

SCRIPT = textwrap.dedent(
    """
    import json, resource, sys
    import torch
    from attnlab.allocator import keep_freed_memory
    applied = keep_freed_memory() if sys.argv[1] == "kept" else None
    torch.manual_seed(0)
    nn = torch.nn
    net = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
    opt = torch.optim.AdamW(net.parameters())
    x = torch.randn(512, 256)
    def step():  # activations of 2 MB, allocated and freed every step
        net(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    for _ in range(3):
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        step()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    print(json.dumps({"applied": applied, "faults": faults}))
    """
)


def _faults(setting: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, setting], capture_output=True, text=True, check=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.skipif(not GLIBC, reason="the settings are glibc's")
def test_kept_memory_is_not_page_faulted_back_in():
    default, kept = _faults("default"), _faults("kept")
    assert kept["applied"] is True
    step_pages = 2 * (512 * 1024 * 4) // 4096  # two of the step's 2 MB activations
    assert default["faults"] > 20 * step_pages  # by default freed memory comes back as new pages
    assert kept["faults"] < default["faults"] / 10


@pytest.mark.parametrize("enabled", [True, False])
def test_trainer_applies_the_settings_on_cpu_when_enabled(tmp_path, monkeypatch, enabled):
    calls = []
    monkeypatch.setattr(trainer_module, "keep_freed_memory", lambda: calls.append(1))
    cfg = get_run_preset("quick").override(
        {"train.device": "cpu", "train.keep_freed_memory": enabled}
    )
    Trainer(cfg, tmp_path, progress=False)
    assert calls == ([1] if enabled else [])


@pytest.mark.parametrize("command", ["info", "train"])
def test_the_command_line_applies_them_for_commands_other_than_train(
    monkeypatch, capsys, tmp_path, command
):
    calls = []
    monkeypatch.setattr(allocator_module, "keep_freed_memory", lambda: calls.append(1))
    if command == "info":
        argv = ["info", "--preset", "demo"]
    else:  # the trainer decides (train.keep_freed_memory), not the command line
        argv = ["train", "--preset", "quick", "--max-steps", "1", "--quiet"]
        argv += ["--set", "train.eval_every=0", "--out", str(tmp_path / "run")]
    assert main(argv) == 0
    capsys.readouterr()
    assert calls == ([1] if command == "info" else [])
