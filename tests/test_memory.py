"""attnlab.memory.PeakTensorMemory on cases whose answer is known by construction.

Shapes: n elements of float32 (4 bytes each)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attnlab.memory import PeakTensorMemory

N = 1 << 18  # 1 MiB of float32


def _peak(fn) -> int:
    with PeakTensorMemory() as mem:
        fn()
    return mem.peak


def test_tensors_from_before_the_block_are_not_counted_through_views_or_in_place_ops():
    x, w, inp = torch.randn(N), torch.randn(512, 512), torch.randn(8, 512)
    assert _peak(lambda: x.view(-1)) == 0
    assert _peak(lambda: x[:10]) == 0
    assert _peak(lambda: x.mul_(1.0)) == 0
    assert _peak(lambda: F.linear(inp, w)) == 8 * 512 * 4  # the output only, not w.t()


def test_new_storages_count_once_and_leave_when_freed():
    x = torch.randn(N)

    def views_of_a_new_tensor():
        y = x * 2  # 1 MiB
        y.view(-1).add_(1)[:5].mul_(2)  # the same storage: no more

    assert _peak(views_of_a_new_tensor) == 4 * N

    def two_in_turn():
        a = torch.empty(N)
        del a
        b = torch.empty(N)
        del b

    assert _peak(two_in_turn) == 4 * N
    assert _peak(lambda: [torch.empty(N), torch.empty(N)]) == 8 * N
