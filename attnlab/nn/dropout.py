"""Dropout that costs nothing when it does nothing.

``nn.Dropout(0.0)`` is still a module call per use: a few microseconds each, dozens per
decoded token. Models built with p = 0 (every inference preset) get ``nn.Identity``; the
two are the same function, and state dicts do not change (dropout has no parameters).
"""

from __future__ import annotations

from torch import nn


def dropout(p: float) -> nn.Module:
    return nn.Dropout(p) if p > 0 else nn.Identity()
