"""Shared pytest setup: every test starts from the same random state.

Tests run tiny models: one intra-op thread is as fast, and avoids spinning threads fighting
over the 2 shared cores (which made small forward passes 50x slower under load)."""

import os

import pytest
import torch

torch.set_num_threads(1)
# ... and so do the processes tests start (the CLI, torchrun): with the suite on every core
# (make test runs one pytest process per core), a process of two threads waits on the other
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Without a GPU the Triton kernels run under Triton's interpreter. It must be switched on
# before anything imports triton (torch does, lazily): triton.jit picks at decoration time.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# The test files that run on a GPU where there is one; every other test runs on the CPU.
GPU_TEST_FILES = ("test_gpu.py", "test_flash_triton.py")


@pytest.fixture(autouse=True)
def _cpu_unless_a_gpu_test(request, monkeypatch):
    """The suite is written for a machine without a GPU, as CI's: its tests compare with
    CPU references, and "auto" devices would pick a GPU where there is one. There, every
    test outside GPU_TEST_FILES sees none: torch.cuda.is_available() is False, and the
    processes it starts (torchrun, the CLI) have no visible GPU."""
    if torch.cuda.is_available() and request.node.path.name not in GPU_TEST_FILES:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    yield


@pytest.fixture(autouse=True, scope="session")
def _private_data_cache(tmp_path_factory):
    """Tokenizers and token streams that tests prepare without a cache_dir go to a folder of
    this run, not the user's ~/.cache/attnlab (which `make test` filled with files): no
    leftovers, and no stale entry from an earlier run decides what a test reads."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ATTNLAB_CACHE", str(tmp_path_factory.mktemp("attnlab_cache")))
        yield


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def host_reads(monkeypatch) -> list[tuple[str, int]]:
    """Every read of tensor values on the host while the test runs, as (how, numel): each
    ``tolist()``, ``item()``, ``int()``, ``float()``, ``bool()`` or ``__index__`` of a tensor
    (on a GPU each is one synchronisation with the device; a test clears the list to count
    from where it starts)."""
    reads: list[tuple[str, int]] = []
    for name in ("tolist", "item", "__int__", "__float__", "__bool__", "__index__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name):
            reads.append((_name, self.numel()))
            return _original(self, *args)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return reads
