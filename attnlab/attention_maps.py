"""Attention maps: the softmax weights every attention layer of a model forms in one
forward pass, recorded without touching the model, and drawn as a grid of heatmaps
(rows: layers, columns: heads).

    with record_attention(model) as maps:    # every attention runs the eager backend
        model(idx)
    maps["blocks.0.attn"]                    # (b, h, t, s): each row sums to 1
                                             # (less with sink logits: the rest is the sink's)

Forward hooks on the model's attention modules (the kinds of ``attnlab.nn.registry``) say
which module is running; :func:`~attnlab.functional.attention.recording_weights` hands
over the weights each ``attend`` call forms. A module must form exactly one softmax per
call: kinds that never form one (linear attention) or mix several (NSA's branches) raise
:class:`AttentionMapError`. MLA's absorbed path hands its weights over itself
(``hand_over_weights``): they are the naive path's.

Shapes: b batch, L layers, h heads, t query length, s key length.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from attnlab.functional.attention import recording_weights

if TYPE_CHECKING:
    from matplotlib.figure import Figure

MAX_PANELS = 256  # a larger grid is unreadable: pick layers and heads
CELL_INCHES = 2.0  # one heatmap
MARGIN_INCHES = 0.8  # the figure title
DPI = 100
MAX_TICK_LABELS = 40  # longer sequences are drawn without token labels
# Text drawn as written: a token or path holding "$...$" is not mathtext (which would
# misdraw "$x$" and fail to parse " $$").
_PLAIN = {"parse_math": False}
# what an undecodable byte of a path given on the command line becomes (surrogateescape);
# matplotlib cannot draw it
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


class AttentionMapError(ValueError):
    """The model's attention cannot be recorded (or drawn) as asked."""


def attention_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The model's attention modules (instances of a registered attention kind), by name."""
    from attnlab.nn.registry import ATTENTION, attention_kinds

    attention_kinds()  # registers the built-in kinds
    kinds = tuple(ATTENTION.values())
    return {name: m for name, m in model.named_modules() if isinstance(m, kinds)}


def _kind_of(module: nn.Module) -> str:
    from attnlab.nn.registry import ATTENTION

    return next((k for k, cls in ATTENTION.items() if type(module) is cls), type(module).__name__)


@contextlib.contextmanager
def record_attention(model: nn.Module) -> Iterator[dict[str, Tensor]]:
    """Record the softmax weights (b, h, t, s) of each attention module of ``model`` while
    the block runs, into the dict it yields (module name -> weights, detached). Every
    attention runs the ``eager`` backend inside. Run one forward pass: a module that runs
    twice raises, as does one that forms no softmax (or several)."""
    modules = attention_modules(model)
    if not modules:
        raise AttentionMapError(f"{type(model).__name__} has no attention modules to record")
    maps: dict[str, Tensor] = {}
    running: list[str] = []  # the attention module now in its forward pass
    formed: list[Tensor] = []  # the weights its attend() calls formed

    def sink(weights: Tensor) -> None:
        if running:  # attend() called outside an attention module is not the model's
            formed.append(weights.detach())

    def before(name: str):
        def hook(*_):
            if name in maps:
                raise AttentionMapError(
                    f"{name} ran twice while recording; record a single forward pass"
                )
            running.append(name)
            formed.clear()

        return hook

    def after(name: str, module: nn.Module):
        def hook(*_):
            running.pop()
            if len(formed) != 1:
                what = "no softmax weights" if not formed else f"{len(formed)} softmaxes"
                raise AttentionMapError(
                    f"{name}: attention kind {_kind_of(module)!r} forms {what} here, so it has "
                    "no attention map (linear attention never forms the weights; NSA mixes "
                    "several branches)"
                )
            maps[name] = formed.pop()

        return hook

    handles = []
    for name, m in modules.items():
        handles.append(m.register_forward_pre_hook(before(name)))
        handles.append(m.register_forward_hook(after(name, m)))
    try:
        with recording_weights(sink):
            yield maps
    finally:
        for handle in handles:
            handle.remove()


def stack_layers(maps: dict[str, Tensor]) -> dict[str, Tensor]:
    """Group recorded maps by module name with the layer index taken out
    (``decoder.1.cross_attn`` -> ``decoder.cross_attn``), each stacked by layer:
    name -> (L, b, h, t, s), layers in order."""
    groups: dict[str, dict[int, Tensor]] = {}
    for name, weights in maps.items():
        match = re.search(r"(^|\.)(\d+)(\.|$)", name)
        layer = int(match.group(2)) if match else 0
        key = name if match is None else name[: match.start(2)] + name[match.end(2) + 1 :]
        groups.setdefault(key.strip("."), {})[layer] = weights
    return {k: torch.stack([g[i] for i in sorted(g)]) for k, g in groups.items()}


# --------------------------------------------------------------------------- drawing


@dataclass
class AttentionGrid:
    """One kind of attention of one example, ready to draw: ``weights`` (L, h, t, s);
    ``queries`` / ``keys`` label the rows and columns of each heatmap. ``patches`` (rows,
    cols): draw query 0's weights over keys 1.. as an image of patches (ViT's [CLS] over
    the image) instead of a t x s heatmap."""

    title: str
    weights: Tensor
    queries: list[str]
    keys: list[str]
    patches: tuple[int, int] | None = None

    @property
    def n_layers(self) -> int:
        """Layers recorded (L)."""
        return self.weights.shape[0]

    @property
    def n_heads(self) -> int:
        """Heads per layer (h)."""
        return self.weights.shape[1]


def figure_inches(rows: int, cols: int) -> tuple[float, float]:
    """The (width, height) in inches of a figure of rows x cols heatmaps."""
    return cols * CELL_INCHES, rows * CELL_INCHES + MARGIN_INCHES


def panel_rows(
    grids: Sequence[AttentionGrid], layers: Sequence[int] | None, heads: Sequence[int] | None
) -> tuple[list[tuple[AttentionGrid, int]], list[int]]:
    """The rows to draw, (grid, layer) for each grid's layers among ``layers`` (all when
    None), and the heads (all when None). AttentionMapError names the option (``--layers``
    / ``--heads``) when an index exists in no grid, or when the figure would be too big."""
    n_layers = max(g.n_layers for g in grids)
    n_heads = min(g.n_heads for g in grids)
    for option, chosen, n, what in (("--layers", layers, n_layers, "layers"),
                                    ("--heads", heads, n_heads, "heads per layer")):  # fmt: skip
        bad = [i for i in chosen or () if not 0 <= i < n]
        if bad:
            raise AttentionMapError(
                f"{option} {bad[0]}: the model has {n} {what}; choose from 0 to {n - 1}"
            )
    rows = [(g, i) for g in grids for i in range(g.n_layers) if layers is None or i in layers]
    heads = list(heads) if heads else list(range(n_heads))
    panels = len(rows) * len(heads)
    if panels > MAX_PANELS:
        raise AttentionMapError(
            f"{panels} heatmaps ({len(rows)} rows of layers x {len(heads)} heads) exceed "
            f"{MAX_PANELS}; pick some with --layers and --heads"
        )
    return rows, heads


def draw_attention(
    grids: Sequence[AttentionGrid],
    layers: Sequence[int] | None = None,
    heads: Sequence[int] | None = None,
    title: str = "",
) -> Figure:
    """A matplotlib Figure: for each grid, one row per layer, one column per head; each
    panel's colour scale runs from 0 to its largest weight."""
    from matplotlib.figure import Figure

    rows, heads = panel_rows(grids, layers, heads)
    fig = Figure(figsize=figure_inches(len(rows), len(heads)), layout="constrained")
    axes = fig.subplots(len(rows), len(heads), squeeze=False)
    for r, (grid, layer) in enumerate(rows):
        last = r + 1 == len(rows) or rows[r + 1][0] is not grid  # the grid's bottom row
        for c, head in enumerate(heads):
            ax = axes[r][c]
            _panel(ax, grid, grid.weights[layer, head].float(), keys=last, queries=c == 0)
            ax.set_title(f"{grid.title}: layer {layer}, head {head}", **_PLAIN, fontsize=7)
    note = "attention weights; each panel's colours run from 0 to its largest weight"
    title = _LONE_SURROGATE.sub("\ufffd", title)  # a file name's undecodable byte: no glyph
    fig.suptitle(f"{title}\n{note}" if title else note, **_PLAIN, fontsize=9)
    return fig


def _panel(ax, grid: AttentionGrid, w: Tensor, *, keys: bool, queries: bool) -> None:
    """One heatmap of w (t, s); token labels on the keys' axis when ``keys`` (the grid's
    bottom row), on the queries' when ``queries`` (the first column), where they fit."""
    if grid.patches is not None:
        image = w[0, 1:].reshape(grid.patches)  # query 0 ([CLS]) over the patches
        ax.imshow(image.numpy(), cmap="Blues", vmin=0, vmax=float(image.max()))
        ax.set_xticks([])
        ax.set_yticks([])
        return
    ax.imshow(w.numpy(), aspect="auto", cmap="Blues", vmin=0, vmax=float(w.max()))
    for labels, shown, set_ticks in ((grid.keys, keys, ax.set_xticks),
                                     (grid.queries, queries, ax.set_yticks)):  # fmt: skip
        if shown and len(labels) <= MAX_TICK_LABELS:
            size = max(3.0, min(7.0, 110.0 / max(len(labels), 1)))
            set_ticks(range(len(labels)), labels, **_PLAIN, fontsize=size)
        else:
            set_ticks([])
    ax.tick_params(axis="x", labelrotation=90)


def save_png(fig: Figure, path: str | Path) -> Path:
    """Write ``fig`` as a PNG at :data:`DPI` (atomically: never a half-written file)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from attnlab.fileio import atomic_path

    FigureCanvasAgg(fig)
    path = Path(path)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=DPI)
    return path


def token_label(text: str) -> str:
    """A token's text as a tick label: spaces and line breaks made visible."""
    return text.replace(" ", "\u2423").replace("\n", "\u21b5") or "\u2205"
