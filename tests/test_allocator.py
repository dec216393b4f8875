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
    import ctypes, json, resource, sys
    import torch
    from attnlab.allocator import M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, keep_freed_memory
    if sys.argv[1] == "kept":
        applied = keep_freed_memory()
    else:  # glibc's starting thresholds (128 KiB), held fixed: its dynamic ones depend on
        # what the process freed before (importing torch), which made the test flaky
        mallopt = ctypes.CDLL(None).mallopt
        applied = bool(mallopt(M_MMAP_THRESHOLD, 128 << 10))
        applied = applied and bool(mallopt(M_TRIM_THRESHOLD, 128 << 10))
    def step():  # like a training step: several blocks written, then all freed
        blocks = [torch.ones(1 << 20) for _ in range(4)]  # 4 x 4 MB
        return sum(float(b[-1]) for b in blocks)
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
    assert default["applied"] is True and kept["applied"] is True
    pages = 20 * 4 * (4 << 20) // 4096  # every block of every step, in 4 KB pages
    assert default["faults"] > 0.9 * pages  # given back to the kernel, faulted in again
    assert kept["faults"] < 0.01 * pages  # reused in place


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
