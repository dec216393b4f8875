"""Weight layout of linear layers.

``nn.Linear`` keeps its weight (out, in) row-major, so y = x W^T reads W one output row at a
time. Decoding multiplies a single token's vector by every weight matrix, a memory-bound
vector-matrix product; on CPU, MKL streams the transposed layout (the weight's memory in
(in, out) order) markedly faster (``python benchmarks/linear_layout.py`` measures it). The
parameter keeps its logical shape (out, in): only its strides change, so state dicts,
checkpoints and every ``x @ W.T`` are unaffected.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor, nn


def input_major(weight: Tensor) -> Tensor:
    """The same (out, in) values, stored in (in, out) order: strides (1, out)."""
    return weight.detach().t().contiguous().t()


def store_input_major(module: nn.Module, skip: Iterable[Tensor] = ()) -> None:
    """Re-store the weight of every ``nn.Linear`` in ``module`` input-major, in place.
    Weights in ``skip`` (e.g. one tied to an embedding, whose rows are gathered) stay."""
    skip_ids = {id(t) for t in skip}
    for m in module.modules():
        if isinstance(m, nn.Linear) and id(m.weight) not in skip_ids:
            m.weight = nn.Parameter(input_major(m.weight), requires_grad=m.weight.requires_grad)
