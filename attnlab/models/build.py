"""Build a model from its config: the architecture is chosen by ``cfg.arch``."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from attnlab.config import ModelConfig

MODELS: dict[str, type[nn.Module]] = {}


def register_model(arch: str) -> Callable[[type[nn.Module]], type[nn.Module]]:
    """Class decorator: ``@register_model("encoder")`` makes ``build_model`` build it for
    configs with that ``arch``."""

    def add(cls: type[nn.Module]) -> type[nn.Module]:
        MODELS[arch] = cls
        return cls

    return add


def build_model(cfg: ModelConfig) -> nn.Module:
    """The model that ``cfg.arch`` names (``decoder``: :class:`DecoderLM`, ...)."""
    cfg.validate()
    if cfg.arch not in MODELS:
        raise ValueError(f"unknown model arch {cfg.arch!r}; choose one of {', '.join(MODELS)}")
    return MODELS[cfg.arch](cfg)
