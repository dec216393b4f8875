"""Let the MKL inside PyTorch run its AVX2 / AVX-512 kernels on CPUs that are not Intel's.

PyTorch's CPU build carries Intel's MKL, and on x86 its float32 matrix products (``torch.mm``,
``bmm``, ``F.linear`` and the ones inside the CPU attention kernels of
``F.scaled_dot_product_attention``) are MKL's ``sgemm``. MKL picks its code path from the
CPU's vendor as well as its instruction sets: on an AMD CPU it runs its generic path,
whatever the CPU supports (its internal ``mkl_serv_cpu_detect()`` returns 0 there). MKL asks
one exported function, ``mkl_serv_intel_cpu_true``, whether the CPU is Intel's; a shared
library loaded ahead of PyTorch that defines it to answer yes makes MKL choose its path from
the instruction sets alone (the CPU's own CPUID flags, so nothing runs that the CPU lacks).

Measured on a 2-core AMD EPYC with AVX-512 (``python benchmarks/mkl_any_cpu.py``, in the
docs/benchmarks.md, "Model FLOP utilisation of training"): a 2048 x 2048 float32 product 209 -> 489
GFLOP/s, the demo preset's attention forward and backward (batch 8, 4 heads, 128 x 32)
1.8x faster, training steps 1.08-1.10x (demo) and 1.11x (llama-30m), eager and
compiled. Results stay IEEE float32 products (the kernels differ, so the last bits of a
sum may).

This is opt-in: ``ATTNLAB_MKL_ANY_CPU=1`` in the environment, read when ``attnlab`` is
imported. It must take effect before PyTorch is loaded, so it works when ``attnlab`` is
imported first (the ``attnlab`` command line, scripts that import attnlab before torch);
otherwise it warns, and ``LD_PRELOAD=$(python -m attnlab.mkl_any_cpu) python script.py``
does the same for any process (the module run as a script prints the library's path). The
library is compiled once with the C compiler (``$CC``, else ``cc``) into
``$XDG_CACHE_HOME/attnlab`` (``~/.cache/attnlab``). It relies on an undocumented MKL
function: a PyTorch built on another BLAS, or a later MKL, ignores it (nothing breaks; the
products run as before). On Intel CPUs it changes nothing.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

ENV = "ATTNLAB_MKL_ANY_CPU"
SOURCE = "int mkl_serv_intel_cpu_true(void) { return 1; }\n"
LIBRARY = "libattnlab_mkl_any_cpu.so"


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "attnlab"


def library_path() -> Path:
    """The shared library, compiled on first use (atomically: a half-written file is never
    in place). OSError / CalledProcessError when it cannot be built."""
    path = cache_dir() / LIBRARY
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        src, out = Path(tmp) / "mkl_any_cpu.c", Path(tmp) / LIBRARY
        src.write_text(SOURCE)
        cc = os.environ.get("CC", "cc")
        subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(out), str(src)],
                       check=True, capture_output=True)  # fmt: skip
        os.replace(out, path)
    return path


def enable() -> bool:
    """Load the library ahead of PyTorch; True when it is in place for this process. Warns
    (and returns False) when torch is already imported or the library cannot be built."""
    if sys.platform != "linux":
        warnings.warn(f"{ENV}=1 works on Linux only; it has no effect here", stacklevel=2)
        return False
    if LIBRARY in os.environ.get("LD_PRELOAD", ""):
        return True  # loaded by the dynamic linker already
    try:
        path = library_path()
    except (OSError, subprocess.CalledProcessError) as err:
        detail = (getattr(err, "stderr", None) or str(err).encode()).decode(errors="replace")
        warnings.warn(
            f"{ENV}=1: could not build {LIBRARY} with the C compiler (set CC to one): "
            + (detail.strip().splitlines() or [""])[-1],
            stacklevel=2,
        )
        return False
    if "torch" in sys.modules:
        warnings.warn(
            f"{ENV}=1 has no effect: torch was imported before attnlab; import attnlab first, "
            f"or start the process with LD_PRELOAD={path}",
            stacklevel=2,
        )
        return False
    try:
        ctypes.CDLL(str(path), mode=os.RTLD_GLOBAL)  # ahead of libtorch_cpu in symbol lookup
    except OSError as err:  # e.g. a damaged file in the cache: delete it to rebuild
        warnings.warn(f"{ENV}=1: could not load {path} ({err}); delete it to rebuild it",
                      stacklevel=2)  # fmt: skip
        return False
    return True


def mkl_code_path() -> int | None:
    """MKL's CPU code path in this process (its ``mkl_serv_cpu_detect()``): 0 is the generic
    path, higher numbers the instruction-set-specific ones; None when this PyTorch carries
    no MKL that says."""
    import torch

    lib_path = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        lib = ctypes.CDLL(str(lib_path))
        return int(lib.mkl_serv_cpu_detect())
    except (OSError, AttributeError):
        return None


def requested() -> bool:
    """Whether the environment asks for it: ``ATTNLAB_MKL_ANY_CPU`` = 1/true/yes/on (0,
    false, no, off or unset: no; anything else warns and counts as no)."""
    value = os.environ.get(ENV, "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value not in ("", "0", "false", "no", "off"):
        warnings.warn(f"{ENV}={value!r} not understood: set it to 1 or 0", stacklevel=2)
    return False


if __name__ == "__main__":  # python -m attnlab.mkl_any_cpu: build it, print its path
    print(library_path())
