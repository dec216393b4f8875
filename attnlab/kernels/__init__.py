"""GPU kernels (Triton), each with a CPU-tested twin in ``attnlab.functional``.

Triton is optional: nothing here imports it until a kernel is asked for. On a machine
without a GPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set
before the first kernel call), which is how the tests check them on CPU.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import re

import torch
from torch import Tensor


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_unavailable_reason() -> str | None:
    """Why the Triton kernels cannot run here, or None when they can."""
    if importlib.util.find_spec("triton") is None:
        return "the 'triton' package is not installed (pip install triton)"
    if not (torch.cuda.is_available() or interpreting()):
        return "no CUDA GPU (set TRITON_INTERPRET=1 to run the kernels on CPU, slowly)"
    if interpreting():
        return _interpreter_problem()
    return None


@functools.cache  # the installed versions stay for the process; reading them takes ~2 ms
def _interpreter_problem() -> str | None:
    """Why Triton's interpreter cannot run the kernels with the installed triton and numpy
    (it runs them in numpy), or None. Measured: triton 3.0-3.3 cannot (3.0 rejects the
    kernels, 3.2-3.3 look for a GPU driver), and 3.4-3.6 fail under numpy 2.4 and later."""
    triton_version = _installed_version("triton", "pytorch-triton")  # the latter: nightlies
    numpy_version = _installed_version("numpy")
    if triton_version is None or numpy_version is None:  # versions unknown: let it try
        return None
    if triton_version[1] < (3, 4):
        return (
            f"Triton {triton_version[0]}'s interpreter cannot run these kernels on CPU; "
            "pip install 'triton>=3.4'"
        )
    if triton_version[1] < (3, 7) and numpy_version[1] >= (2, 4):
        return (
            f"Triton {triton_version[0]}'s interpreter fails under numpy {numpy_version[0]}; "
            "pip install 'triton>=3.7' or 'numpy<2.4'"
        )
    return None


def _installed_version(*distributions: str) -> tuple[str, tuple[int, int]] | None:
    """The first of these distributions installed: its version, and as (major, minor)."""
    for name in distributions:
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        found = re.match(r"(\d+)\.(\d+)", version)
        return (version, (int(found[1]), int(found[2]))) if found else None
    return None


def triton_available() -> bool:
    return triton_unavailable_reason() is None


def triton_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: int | None = None,
    doc_ids: Tensor | None = None,
    sinks: Tensor | None = None,
    softcap: float | None = None,
) -> Tensor:
    """Flash attention as Triton kernels (forward and FlashAttention-2 backward); the same
    contract as ``attnlab.functional.flash.flash_attention``, soft-capping included."""
    reason = triton_unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"attention backend 'triton' cannot run: {reason}; use 'flash'")
    if q.device.type == "cpu" and not interpreting():
        raise RuntimeError(
            "attention backend 'triton' needs CUDA tensors (or TRITON_INTERPRET=1); use 'flash'"
        )
    if interpreting():
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(tl.zeros, InterpretedFunction):  # triton's own jit helpers
            raise RuntimeError(
                "TRITON_INTERPRET=1 was set after triton was imported; set it before "
                "anything imports triton (e.g. in the environment)"
            )
    from attnlab.kernels.flash_attention import triton_flash_attention

    return triton_flash_attention(
        q,
        k,
        v,
        mask,
        causal=causal,
        scale=scale,
        window=window,
        doc_ids=doc_ids,
        sinks=sinks,
        softcap=softcap,
    )
