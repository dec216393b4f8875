"""benchmarks/load_memory.py measures each loader's peak as ru_maxrss of a child process,
which on Linux starts from the parent's resident memory: the parent must not have imported
torch (benchmarks/_common.py does) before its children have run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_importing_the_script_does_not_import_torch():
    code = "import sys, load_memory; print('torch' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "benchmarks"), str(ROOT)])}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    ).stdout
    assert out.strip() == "False"
