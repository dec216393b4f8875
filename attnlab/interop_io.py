"""Reading and writing Hugging Face model folders (``config.json`` + safetensors) for the
encoder, encoder–decoder and vision mappings (``interop_bert``, ``interop_marian``,
``interop_vit``). Safetensors only: pickled weights can run code when loaded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from attnlab.fileio import atomic_path, atomic_write_text
from attnlab.interop import HFCheckpointError

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"


def read_folder(path: str | Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """(config dict, every tensor) of a Hugging Face model folder (single file or shards)."""
    path = Path(path)
    if not (path / CONFIG_NAME).is_file():
        raise HFCheckpointError(f"{path}: no {CONFIG_NAME}; pass a Hugging Face model directory")
    try:
        config = json.loads((path / CONFIG_NAME).read_text())
    except json.JSONDecodeError as e:
        raise HFCheckpointError(f"{path / CONFIG_NAME}: not valid JSON ({e})") from None
    if (path / WEIGHTS_NAME).is_file():
        files = [path / WEIGHTS_NAME]
    elif (path / WEIGHTS_INDEX_NAME).is_file():
        weight_map = json.loads((path / WEIGHTS_INDEX_NAME).read_text())["weight_map"]
        files = [path / name for name in dict.fromkeys(weight_map.values())]
    else:
        raise HFCheckpointError(f"{path}: no {WEIGHTS_NAME} or {WEIGHTS_INDEX_NAME} found")
    tensors: dict[str, Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return config, tensors


def write_folder(path: str | Path, config: dict[str, Any], tensors: dict[str, Tensor]) -> None:
    """Write ``config.json`` and ``model.safetensors`` atomically (each file whole)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    # safetensors refuses shared or strided storage: each tensor gets its own copy.
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    with atomic_path(path / WEIGHTS_NAME) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    atomic_write_text(path / CONFIG_NAME, json.dumps(config, indent=2) + "\n")


class Tensors:
    """Checkpoint tensors handed out by name; ``finish`` names missing or unexpected ones."""

    def __init__(self, tensors: dict[str, Tensor], ignore: tuple[str, ...] = ()):
        self.left = dict(tensors)
        self.missing: list[str] = []
        self.ignore = ignore

    def take(self, name: str) -> Tensor:
        t = self.left.pop(name, None)
        if t is None:
            self.missing.append(name)
            return torch.empty(0)
        return t

    def pop(self, name: str) -> Tensor | None:
        return self.left.pop(name, None)

    def finish(self) -> None:
        unexpected = sorted(n for n in self.left if not any(n.endswith(s) for s in self.ignore))
        for label, names in (("missing tensors", self.missing), ("unexpected tensors", unexpected)):
            if names:
                more = f" (+{len(names) - 8} more)" if len(names) > 8 else ""
                raise HFCheckpointError(
                    f"checkpoint does not match config.json: {label}: {', '.join(names[:8])}{more}"
                )


def load_state(model: torch.nn.Module, state: dict[str, Tensor], skip: set[str]) -> None:
    """Copy ``state`` into ``model`` strictly: every parameter except ``skip`` (tied ones)
    must be present with its shape."""
    params = model.state_dict()
    expected = set(params) - skip
    if set(state) != expected:  # a mapping bug, not a user error
        raise RuntimeError(f"interop mapping mismatch: {sorted(set(state) ^ expected)}")
    with torch.no_grad():
        for name, t in state.items():
            if tuple(t.shape) != tuple(params[name].shape):
                raise HFCheckpointError(
                    f"tensor for {name} has shape {tuple(t.shape)}, the config implies "
                    f"{tuple(params[name].shape)}"
                )
            params[name].copy_(t)
