"""Shared helpers for the benchmark scripts: thread setup, timing, memory bandwidth."""

from __future__ import annotations

import argparse
import functools
import os
import platform
import time

import torch

from attnlab.mkl_any_cpu import mkl_code_path


def setup_threads(threads: int | None) -> int:
    if threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def check_device(parser: argparse.ArgumentParser, device: str) -> None:
    """Refuse ``--device`` (argparse's usage error) where this machine has no such device:
    a GPU run on a CPU-only machine would otherwise end in a traceback from deep inside."""
    try:
        kind = torch.device(device).type
    except RuntimeError:
        parser.error(f"--device {device}: not a device; use cpu or cuda")
    if kind == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {device}: CUDA is not available on this machine; use cpu")


def sync(device: torch.device | str = "cpu") -> None:
    """Wait for the device's queued work (a no-op on CPU): timings on a GPU need it."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(mbytes: int = 512, repeats: int = 5, device: str = "cpu") -> float:
    """Bytes/s of a large tensor copy (read + write), best of ``repeats``: the practical
    memory-bandwidth limit of this machine (or of the GPU ``device``)."""
    a = torch.ones(mbytes * 2**20 // 4, device=device)
    b = torch.empty_like(a)
    b.copy_(a)  # touch the pages
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        b.copy_(a)
        sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * a.nbytes / best


@functools.cache
def _big(mbytes: int, device: str = "cpu") -> torch.Tensor:
    return torch.ones(mbytes * 2**20 // 4, device=device)


def read_bandwidth(mbytes: int = 512, repeats: int = 5, device: str = "cpu") -> float:
    """Bytes/s of reading a large tensor (its maximum: nothing written), best of
    ``repeats``: the rate a workload that only reads, such as decoding reading the weights,
    can reach (the copy bandwidth counts the bytes written too)."""
    a = _big(mbytes, device)
    a.max()
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        a.max()
        sync(device)
        best = min(best, time.perf_counter() - t)
    return a.nbytes / best


def machine(device: str = "cpu") -> str:
    """The machine in one line; for a GPU ``device``, the GPU and its software too."""
    if torch.device(device).type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return (
            f"{p.name} ({p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs), "
            f"torch {torch.__version__}, CUDA {torch.version.cuda}, {os.cpu_count()} CPUs"
        )
    cpu = platform.processor() or platform.machine()
    threads = torch.get_num_threads()
    mkl = mkl_code_path()  # 0: MKL's generic path (its choice on non-Intel CPUs)
    path = "" if mkl is None else f", MKL code path {mkl}" + (" (generic)" if mkl == 0 else "")
    return f"{cpu}, {os.cpu_count()} CPUs, torch {torch.__version__}, {threads} threads{path}"


def table(headers: list[str], rows: list[list]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), sep] + [line(r) for r in cells[1:]])
