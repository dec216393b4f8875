"""Attention kinds by name. A kind is a module class registered here, built from its
config section, and owning the kind of cache entry its layers keep when decoding
(``new_cache_entry(cache)``). New kinds are a new module plus one ``@register_attention``."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

ATTENTION: dict[str, type[nn.Module]] = {}


def register_attention(kind: str) -> Callable[[type[nn.Module]], type[nn.Module]]:
    def add(cls: type[nn.Module]) -> type[nn.Module]:
        if kind in ATTENTION and ATTENTION[kind] is not cls:
            raise ValueError(f"attention kind {kind!r} is registered twice")
        ATTENTION[kind] = cls
        return cls

    return add


def attention_kinds() -> tuple[str, ...]:
    import attnlab.nn  # noqa: F401  (registers every built-in kind)

    return tuple(ATTENTION)


def build_attention(kind: str, d_model: int, cfg, **kwargs) -> nn.Module:
    """The attention module of ``kind`` for a residual stream of width ``d_model``."""
    if kind not in attention_kinds():
        raise ValueError(
            f"unknown attention kind {kind!r}; choose one of {', '.join(sorted(ATTENTION))}"
        )
    return ATTENTION[kind](d_model, cfg, **kwargs)
