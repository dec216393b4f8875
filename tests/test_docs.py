"""The documentation promises: every public class and function of the top-level API has a
docstring (``help()`` says what it is), and the README's Python examples run as written."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
API_MODULES = ("attnlab", "attnlab.models", "attnlab.nn", "attnlab.tasks")


def _own_docstring(obj) -> str | None:
    """A class's own docstring (not the signature dataclasses write), a function's doc."""
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__
    if inspect.isclass(obj) and dataclasses.is_dataclass(obj) and doc:
        if doc.startswith(f"{obj.__name__}("):
            return None
    return doc.strip() if doc else None


def _public_api():
    for module_name in API_MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isclass(obj) or inspect.isfunction(obj):
                yield f"{module_name}.{name}", obj


def test_every_exported_class_and_function_has_a_docstring():
    missing = [name for name, obj in _public_api() if not _own_docstring(obj)]
    assert not missing, f"no docstring: {missing}"


def test_public_methods_of_exported_classes_have_docstrings():
    """Methods and properties a class defines (inherited docstrings count: an override of
    a documented method says the same)."""
    missing = []
    for name, cls in _public_api():
        if not inspect.isclass(cls):
            continue
        for attr, value in vars(cls).items():
            if attr.startswith("_"):
                continue
            if isinstance(value, property):
                doc = value.__doc__
            elif inspect.isfunction(value) or isinstance(value, (classmethod, staticmethod)):
                doc = inspect.getdoc(getattr(cls, attr))
            else:
                continue
            if not doc:
                missing.append(f"{name}.{attr}")
    assert not missing, f"no docstring: {missing}"


# ------------------------------------------------------------------ README examples

# Placeholder paths in the README's examples, replaced by real folders made here.
PLACEHOLDERS = {"path/to/hf-folder": "hf", "runs/x": "run", "exported/": "exported"}


def readme_python_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_readme_has_python_examples():
    assert len(readme_python_blocks()) >= 2


@pytest.mark.parametrize("index", range(len(readme_python_blocks())))
def test_readme_python_example_runs(index, tmp_path, monkeypatch):
    """Each ```python block of the README runs as written, its placeholder paths pointing
    at a tiny exported model (an HF folder) and a tiny trained run made here."""
    from attnlab import build_model, get_preset
    from attnlab.interop import save_hf

    code = readme_python_blocks()[index]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ATTNLAB_CACHE", str(tmp_path / "cache"))
    if "path/to/hf-folder" in code:
        torch.manual_seed(0)
        save_hf(build_model(get_preset("llama-tiny")), tmp_path / "hf")
    for placeholder, real in PLACEHOLDERS.items():
        code = code.replace(placeholder, str(tmp_path / real) + ("/" if real == "exported" else ""))
    # Keep training examples tiny: the run presets' step counts would take minutes here.
    code = code.replace('get_run_preset("demo")', 'get_run_preset("demo").override(_TINY)')
    tiny = {"train.max_steps": 2, "train.time_budget": None, "train.eval_every": 0}
    tiny |= {"model.n_layers": 1, "model.d_model": 32, "model.max_seq_len": 32}
    tiny |= {"train.batch_size": 2, "train.block_size": 16}
    namespace = {"_TINY": tiny, "__name__": "readme_example"}
    exec(compile(code, f"README.md python block {index + 1}", "exec"), namespace)
