"""ATTNLAB_MKL_ANY_CPU: MKL's instruction-set code path on any vendor's CPU
(attnlab/mkl_any_cpu.py). The setting acts when a process loads PyTorch, so the checks that
need it run in fresh Python processes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from attnlab import mkl_any_cpu

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or mkl_any_cpu.mkl_code_path() is None,
    reason="Linux PyTorch with MKL only",
)

# In the child: MKL's code path, and float32 products and attention against float64 maths.
CHILD = r"""
import json, sys
import attnlab, torch
import torch.nn.functional as F
from attnlab.mkl_any_cpu import mkl_code_path
torch.manual_seed(0)
errs = {}
for m, k, n in [(2048, 2048, 2048), (1, 512, 2048), (77, 33, 130), (1024, 32, 128)]:
    a, b = torch.randn(m, k), torch.randn(k, n)
    ref = a.double() @ b.double()
    errs[f"mm {m}x{k}x{n}"] = ((a @ b).double() - ref).abs().max().item() / ref.abs().max().item()
q, k, v = (torch.randn(8, 4, 128, 32, dtype=torch.float64, requires_grad=True) for _ in range(3))
g = torch.randn(8, 4, 128, 32, dtype=torch.float64)
qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
out = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True)
ref.backward(g)
out.backward(g.float())
errs["attention"] = (out.double() - ref).abs().max().item()
errs["attention dq"] = (qf.grad.double() - q.grad).abs().max().item() / q.grad.abs().max().item()
print(json.dumps({"path": mkl_code_path(), "errs": errs}))
"""


def _child(tmp_path, env_extra: dict, code: str = CHILD) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", mkl_any_cpu.ENV)}
    env.update({"XDG_CACHE_HOME": str(tmp_path / "cache"), **env_extra})
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    return {"result": json.loads(out.stdout.strip().splitlines()[-1]), "stderr": out.stderr}


needs_cc = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no cc")


@needs_cc
def test_env_var_selects_the_instruction_set_path_and_products_stay_float32_exact(tmp_path):
    default = _child(tmp_path, {})["result"]
    forced = _child(tmp_path, {mkl_any_cpu.ENV: "1"})
    assert mkl_any_cpu.ENV not in forced["stderr"]  # built and loaded without a warning
    assert (tmp_path / "cache" / "attnlab" / mkl_any_cpu.LIBRARY).exists()
    if default["path"] == 0:  # a CPU MKL does not treat as Intel's: the generic path before
        assert forced["result"]["path"] > 0
    else:  # an Intel CPU: nothing changes
        assert forced["result"]["path"] == default["path"]
    for run in (default, forced["result"]):
        for name, err in run["errs"].items():
            assert err < 2e-6, (name, err)  # float32 rounding, either code path


@needs_cc
def test_ld_preload_does_the_same_for_a_process_that_imports_torch_first(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    lib = mkl_any_cpu.library_path()
    code = "import torch; from attnlab.mkl_any_cpu import mkl_code_path; print(mkl_code_path())"
    default = _child(tmp_path, {}, code)["result"]
    preloaded = _child(tmp_path, {"LD_PRELOAD": str(lib), mkl_any_cpu.ENV: "1"}, code)
    assert mkl_any_cpu.ENV not in preloaded["stderr"]  # no "torch was imported first" warning
    assert preloaded["result"] > 0 if default == 0 else preloaded["result"] == default


@needs_cc
def test_enable_after_torch_is_loaded_warns_with_the_ld_preload_path(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    lib = tmp_path / "cache" / "attnlab" / mkl_any_cpu.LIBRARY
    with pytest.warns(UserWarning, match=f"imported before attnlab.*LD_PRELOAD={lib}"):
        assert mkl_any_cpu.enable() is False
    assert lib.exists()  # built, so the advice can be followed as written


def test_a_missing_compiler_warns_and_changes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    with pytest.warns(UserWarning, match="could not build .*set CC"):
        assert mkl_any_cpu.enable() is False
    assert not (tmp_path / "cache" / "attnlab" / mkl_any_cpu.LIBRARY).exists()
    assert list((tmp_path / "cache" / "attnlab").iterdir()) == []  # no half-built file left


def test_a_damaged_library_in_the_cache_warns_instead_of_failing_the_import(tmp_path):
    lib = tmp_path / "cache" / "attnlab" / mkl_any_cpu.LIBRARY
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"not an ELF file")
    code = "import attnlab, torch; print(1)"
    run = _child(tmp_path, {mkl_any_cpu.ENV: "1"}, code)
    assert run["result"] == 1
    assert f"could not load {lib}" in run["stderr"] and "delete it to rebuild" in run["stderr"]


def test_other_systems_warn(monkeypatch):
    monkeypatch.setattr(mkl_any_cpu.sys, "platform", "darwin")
    with pytest.warns(UserWarning, match="Linux only"):
        assert mkl_any_cpu.enable() is False


@needs_cc
def test_the_library_is_built_once(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    first = mkl_any_cpu.library_path()
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))  # a rebuild would fail
    assert mkl_any_cpu.library_path() == first


@pytest.mark.parametrize(
    "value, expected",
    [("1", True), ("true", True), ("ON", True), ("yes", True), ("", False), ("0", False),
     ("off", False), ("no", False)],
)  # fmt: skip
def test_requested_reads_the_environment(monkeypatch, value, expected):
    monkeypatch.setenv(mkl_any_cpu.ENV, value)
    assert mkl_any_cpu.requested() is expected


def test_an_unclear_value_warns_and_counts_as_off(monkeypatch):
    monkeypatch.setenv(mkl_any_cpu.ENV, "maybe")
    with pytest.warns(UserWarning, match="ATTNLAB_MKL_ANY_CPU='maybe' not understood"):
        assert mkl_any_cpu.requested() is False


@needs_cc
def test_module_as_a_script_prints_the_library_path_for_ld_preload(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != mkl_any_cpu.ENV}
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    out = subprocess.run([sys.executable, "-m", "attnlab.mkl_any_cpu"], capture_output=True,
                         text=True, env=env, check=True)  # fmt: skip
    assert "Warning" not in out.stderr  # (runpy warns if the package imported the module)
    assert out.stdout.strip() == str(tmp_path / "cache" / "attnlab" / mkl_any_cpu.LIBRARY)
    assert os.path.exists(out.stdout.strip())
