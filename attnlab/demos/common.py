"""What the demos share: tables on stdout and figures written atomically."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from attnlab.fileio import atomic_path

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def check_memory(nbytes: int, options: str) -> None:
    """Refuse sizes whose tensors alone would outgrow this machine's memory: the demo would
    fail at an allocation, or crawl toward one for hours. ``options`` names the options
    that set them."""
    from attnlab.cli.common import human_bytes

    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no way to tell: let it try
        return
    if nbytes > total:
        raise ValueError(
            f"{options}: the demo's tensors would take {human_bytes(nbytes)}, more than this "
            f"machine's {human_bytes(total)} of memory; give smaller values"
        )


def new_figure(n_panels: int, *, width: float = 5.0, height: float = 4.0) -> tuple:
    """A matplotlib Figure with ``n_panels`` axes side by side (no pyplot, no display)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * n_panels, height), layout="constrained")
    axes = fig.subplots(1, n_panels, squeeze=False)[0]
    return fig, list(axes)


def save_figure(fig: Figure, path: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    print(f"wrote {path}")
    return path


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Right-aligned columns; floats with 4 significant digits."""

    def cell(x: object) -> str:
        return f"{x:.4g}" if isinstance(x, float) else str(x)

    cells = [list(headers)] + [[cell(x) for x in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
