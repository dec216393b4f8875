"""Peak tensor memory of a piece of code, on any device (CPU included).

``torch.cuda.max_memory_allocated`` has no CPU twin, and process RSS mixes in the
allocator's caching and everything else Python holds. ``PeakTensorMemory`` counts what
the code itself allocates: every tensor an operator returns is looked up by its storage;
a new storage adds its size to the live total until the storage is freed (a weak-reference
finaliser subtracts it). Views and in-place results share a storage and count once.
Tensors that existed before the block (inputs, parameters) are not counted: the figure is
the peak *extra* memory, which is what differs between attention implementations.

The figure is that of the code *under the mode*, which is not always the code's own: while
any dispatch mode is active, autograd sums the gradients that several uses of one tensor
send back out of place instead of in place (measured with ``torch.profiler``: four
``w[i]`` of one ``w`` (4, N), forward and backward, peak 3 N floats more with the mode on;
a deepseek-moe-tiny training step 6% more, its experts' weights being used that way).
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class PeakTensorMemory(TorchDispatchMode):
    """``with PeakTensorMemory() as mem: ...`` then ``mem.peak`` (bytes). Adds some Python
    overhead to every operator: time code separately."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # an output on an input's storage (a view, an in-place result) is no allocation:
        # counted already if the block made that storage, never if it existed before
        inputs = {
            x.untyped_storage().data_ptr()
            for x in tree_flatten((args, kwargs))[0]
            if isinstance(x, torch.Tensor)
        }
        for x in tree_flatten(out)[0]:
            if isinstance(x, torch.Tensor):
                self._track(x, inputs)
        return out

    def _track(self, x: torch.Tensor, inputs: set[int]) -> None:
        storage = x.untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or key in self.live or key in inputs:
            return
        self.live[key] = size
        self.current += size
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)
