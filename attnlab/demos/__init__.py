"""Runnable demos of the classic attention results: ``attnlab demo NAME --out DIR``.

Each demo module has ``NAME``, ``DESCRIPTION`` (one line), ``add_arguments(parser)`` and
``run(args) -> int``; it prints a table and writes its figures into ``args.out``. Each
finishes in under a minute on two CPU cores. They are demonstrations, not benchmarks:
what they train, they train with a few lines inside the demo.
"""

from __future__ import annotations

from types import ModuleType

from attnlab.demos import bahdanau, kernel_regression, sqrt_dk, temperature

DEMOS: dict[str, ModuleType] = {
    module.NAME: module for module in (kernel_regression, sqrt_dk, temperature, bahdanau)
}
