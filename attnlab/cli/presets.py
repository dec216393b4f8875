"""``attnlab presets``: the named configurations, one per line."""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "presets",
        help="list the named presets",
        description="List the run presets (for `train`) and the model presets (for `train`, "
        "`info`, `kv`), one per line: name and description.",
    )
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from attnlab.presets import list_presets  # run presets are listed here too

    rows = list_presets()
    width = max(map(len, rows))
    for name, description in rows.items():
        print(f"{name:<{width}}  {description}")
    return 0
