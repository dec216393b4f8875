"""Keep the memory one training step (or forward pass) frees for the next (glibc's malloc,
Linux).

A training step on CPU allocates its activations and gradients and frees them again: tens of
MB, every step. With its default settings glibc's malloc hands memory freed at the top of
its heap back to the kernel (the trim threshold, 128 KB to start with) and serves blocks
from 128 KB up with fresh ``mmap`` regions that ``free`` unmaps, so the next step touches new
pages, and each first touch of a 4 KB page is a page fault: the kernel zeroes and maps it.
The demo preset's step took 5,500-6,700 of them (16,000-29,000 for llama-30m's), counted
with ``getrusage``. Two ``mallopt`` settings keep that memory in the process instead:

- ``M_MMAP_THRESHOLD`` = 32 MiB (glibc's ceiling): smaller blocks come from the heap, where
  freed memory is reused;
- ``M_TRIM_THRESHOLD`` = 1 GiB: freed memory at the heap's top stays mapped (up to 1 GiB).

With them the demo's step took 0-16 page faults and ran 1.26-1.28x faster eagerly and
1.31-1.36x compiled, llama-30m's compiled step 1.07-1.12x, and forward passes without
gradients (evaluation) 1.88x for the demo's model and 1.40x for llama-30m's (``python
benchmarks/allocator.py --variants eager compile eval``, which runs each setting in its own
process). The price: memory a run frees stays with the process for its next step rather
than going back to the system, as PyTorch's CUDA caching allocator keeps GPU memory.

The trainer applies them on CPU unless ``train.keep_freed_memory`` is false, and the
``attnlab`` command line for its other commands; they hold for the rest of the process (and
turn off glibc's dynamic adjustment of both thresholds).
Elsewhere (macOS, musl, Windows) nothing changes.
"""

from __future__ import annotations

import ctypes
import functools
import sys

# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # the largest value glibc accepts on 64-bit machines
TRIM_THRESHOLD = 1 << 30


@functools.cache
def keep_freed_memory() -> bool:
    """Apply the two settings once per process; True where glibc accepted them."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)  # the C library this process already uses
        if not hasattr(libc, "gnu_get_libc_version"):  # glibc only (musl's mallopt is a no-op)
            return False
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
