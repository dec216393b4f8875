"""Peak memory of loading a GPT-2-small-sized (124M parameters) checkpoint, relative to
the size of its weights file: attnlab.interop.load_hf (a Hugging Face folder) and
attnlab.training.load_checkpoint (an attnlab checkpoint), each in a fresh subprocess.

Peak = ru_maxrss of the loading process minus ru_maxrss of a process that imports the same
modules and loads nothing (interpreter + torch baseline, measured the same way). The
weights are random, written to a temporary folder by another subprocess: this script never
imports torch itself, since a child's ru_maxrss starts from its parent's memory (Linux keeps
the high-water mark across fork and exec). Target: at most 1.3x the file size.

    python benchmarks/load_memory.py [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WRITE = r"""
import sys, torch
from pathlib import Path
from attnlab.config import RunConfig
from attnlab.interop import save_hf
from attnlab.models import build_model
from attnlab.presets import get_preset
from attnlab.training import save_checkpoint
torch.manual_seed(0)
cfg = get_preset("gpt2")
model = build_model(cfg)
save_hf(model, Path(sys.argv[1]) / "hf")
save_checkpoint(Path(sys.argv[1]) / "ckpt", model, RunConfig(model=cfg), None)
"""

CHILD = r"""
import resource, sys, torch
from attnlab.interop import load_hf
from attnlab.training import load_checkpoint
how, path, dtype = sys.argv[1], sys.argv[2], getattr(torch, sys.argv[3])
if how == "load_hf":
    model = load_hf(path, dtype=dtype)
elif how == "load_checkpoint":
    model = load_checkpoint(path, dtype=dtype).model
if how != "baseline":
    assert sum(p.numel() for p in model.parameters()) == 124_439_808
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # KiB on Linux
"""


def _python(code: str, *args: str) -> str:
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": str(ROOT)},
    ).stdout


def _peak(how: str, path: Path, dtype: str) -> int:
    return int(_python(CHILD, how, str(path), dtype).split()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        _python(WRITE, tmp)
        hf, ckpt = Path(tmp) / "hf", Path(tmp) / "ckpt"
        baseline = min(_peak("baseline", hf, args.dtype) for _ in range(2))
        rows = []
        for how, folder in (("load_hf", hf), ("load_checkpoint", ckpt)):
            size = (folder / "model.safetensors").stat().st_size
            peak = _peak(how, folder, args.dtype) - baseline
            rows.append([how, f"{size / 2**20:.0f} MiB", f"{peak / 2**20:.0f} MiB",
                         f"{peak / size:.2f}x"])  # fmt: skip
    # Only now: _common imports torch, whose memory every later child would start from.
    from _common import machine, table

    print(f"GPT-2 small (124M), float32 file, loaded as {args.dtype}")
    print(f"machine: {machine()} (shared with other jobs while measured)")
    print(f"baseline (interpreter + torch + attnlab, nothing loaded): {baseline / 2**20:.0f} MiB")
    print(table(["loader", "file", "peak above baseline", "peak / file"], rows))


if __name__ == "__main__":
    main()
