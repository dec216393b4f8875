"""Hugging Face folder <-> attnlab model: configs through the family registry, weights
through each family's name mapping."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from attnlab.config import ConfigError, ModelConfig
from attnlab.interop.io import (
    Family,
    HFCheckpointError,
    Source,
    read_config,
    unrepresentable,
    weight_files,
    write_folder,
)
from attnlab.interop.registry import FAMILIES, lookup
from attnlab.models.decoder import DecoderLM
from attnlab.weights import SafetensorsFile, WeightsFileError, materialize, parameters_on_meta


def config_from_hf(hf_config: dict[str, Any]) -> ModelConfig:
    """Map a Hugging Face ``config.json`` (as a dict) to an attnlab :class:`ModelConfig`."""
    family, model_type = lookup(hf_config)
    try:
        cfg = family.config_from_hf(hf_config, model_type)
        cfg.validate()
    except ConfigError as e:
        raise HFCheckpointError(f"config.json maps to an invalid attnlab config: {e}") from None
    return cfg


def _export_family(cfg: ModelConfig) -> tuple[Family, str]:
    att = cfg.attention
    if cfg.norm.placement != "pre":
        raise unrepresentable("post-norm blocks (all supported architectures are pre-norm)")
    if att.kind != "mha":
        raise unrepresentable(f"attention.kind={att.kind!r}")
    for family in FAMILIES:
        if family.exports(cfg):
            return family, family.export_type(cfg)
    raise unrepresentable(f"position.kind={cfg.position.kind!r} (use 'learned' or 'rope')")


def hf_model_type(cfg: ModelConfig) -> str:
    """The Hugging Face ``model_type`` that :func:`save_hf` writes ``cfg`` as.

    learned positions + LayerNorm + MLP -> ``gpt2``; RoPE + RMSNorm + gated FFN -> ``qwen2``
    when q/k/v have biases and nothing else does, ``mistral`` with a sliding window and no
    biases, else ``llama`` (missing biases are written as zeros)."""
    return _export_family(cfg)[1]


def config_to_hf(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The ``config.json`` dict :func:`save_hf` writes for ``cfg`` (see :func:`hf_model_type`)."""
    family, model_type = _export_family(cfg)
    return family.config_to_hf(cfg, model_type, dtype)


def load_hf(
    path: str | Path,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> DecoderLM:
    """Load a Hugging Face GPT-2 / LLaMA / Mistral / Qwen2 checkpoint directory.

    Returns a :class:`DecoderLM` in eval mode (as ``from_pretrained`` does). ``dtype``
    defaults to float32 whatever the checkpoint stores; ``device`` defaults to the CPU.
    The model is built on the meta device and each parameter is allocated once, in
    ``dtype`` on ``device``, and read from the files: loading needs about the memory of
    the loaded model, not twice it."""
    path = Path(path)
    hf_config = read_config(path)
    cfg = config_from_hf(hf_config)
    family, _ = lookup(hf_config)
    files: dict[str, SafetensorsFile] = {}  # tensor name -> its file
    for file in weight_files(path):
        try:
            opened = SafetensorsFile(file)
        except (WeightsFileError, OSError) as e:
            raise HFCheckpointError(str(e)) from None
        files |= dict.fromkeys(opened.keys(), opened)
    src = Source({name: f.shape(name) for name, f in files.items()}, family.ignored)
    plan = family.weights_to_attnlab(src, cfg)
    src.check()
    for a, b in src.must_equal:
        if not torch.equal(files[a].read(a), files[b].read(b)):
            raise HFCheckpointError(
                f"config.json says tie_word_embeddings=true but {a} differs from the token "
                "embedding; set tie_word_embeddings to false in config.json"
            )
    with parameters_on_meta():
        model = DecoderLM(cfg)
    # strict: every attnlab parameter must come from the checkpoint (the tied head is shared).
    expected = set(model.state_dict()) - ({"lm_head.weight"} if cfg.tie_embeddings else set())
    if set(plan) != expected:  # a mapping bug, not a user error
        raise RuntimeError(f"interop mapping mismatch: {sorted(set(plan) ^ expected)}")

    def fill(name: str, dest: torch.Tensor) -> None:
        row = 0
        for part in plan[name]:  # stacked along the first dimension
            shape = files[part.name].shape(part.name)
            rows = shape[-1] if part.transposed else shape[0]
            view = dest[row : row + rows] if len(plan[name]) > 1 else dest
            files[part.name].read_into(part.name, view.t() if part.transposed else view)
            row += rows

    # Floating parameters get dtype (float32 by default); the RoPE frequencies stay float32.
    materialize(model, fill, dtype=dtype or torch.float32, device=device)
    return model.eval()


def save_hf(model: DecoderLM, path: str | Path) -> None:
    """Write ``config.json`` and ``model.safetensors`` loadable by
    ``transformers.AutoModelForCausalLM.from_pretrained(path)`` with the same logits.

    A tied head is not stored (transformers re-ties it). Interleaved RoPE q/k rows are
    reordered to the split layout. Raises :class:`HFCheckpointError` for configs no
    supported architecture represents (see :func:`hf_model_type`)."""
    cfg = model.cfg
    family, model_type = _export_family(cfg)
    hf_config = family.config_to_hf(cfg, model_type, model.tok_emb.weight.dtype)
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    tensors = family.weights_from_attnlab(sd, cfg, model_type)
    if not cfg.tie_embeddings:
        tensors["lm_head.weight"] = sd["lm_head.weight"]
    write_folder(Path(path), tensors, hf_config)
