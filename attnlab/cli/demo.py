"""``attnlab demo [NAME]``: run one of the classic attention demos (see attnlab.demos), or
with no name list them. Each prints a table and writes its figures into --out."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from attnlab.cli.common import CLIError, non_negative_int, path_arg
from attnlab.config import SEED_MAX
from attnlab.demos import DEMOS
from attnlab.fileio import file_kind


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo",
        help="run a classic attention demo (tables and figures); no name lists them",
        description="Run a demo of a classic attention result: it prints a table and writes "
        "PNG figures into --out (default runs/demo-NAME). With no NAME, list the demos.",
    )
    p.set_defaults(handler=run, demo=None)
    names = p.add_subparsers(dest="demo", metavar="NAME")  # same parser class: one-line errors
    for name, module in DEMOS.items():
        q = names.add_parser(name, help=module.DESCRIPTION, description=module.__doc__)
        q.add_argument(
            "--out", type=path_arg, metavar="DIR", default=f"runs/demo-{name}", help="figure folder"
        )
        q.add_argument("--seed", type=_seed, default=0, help="random seed")
        module.add_arguments(q)


def _seed(text: str) -> int:
    value = non_negative_int(text)  # the demos' data generators take no negative seeds
    if value > SEED_MAX:  # nor does torch.manual_seed a seed past 64 bits
        raise argparse.ArgumentTypeError(f"must be an integer from 0 to 2**63 - 1, got {text!r}")
    return value


def run(args: argparse.Namespace) -> int:
    if args.demo is None:
        width = max(len(name) for name in DEMOS)
        for name, module in DEMOS.items():
            print(f"{name:<{width}}  {module.DESCRIPTION}")
        return 0
    # The demos run small tensors: one thread is as fast, and two threads fighting other
    # processes for two cores made a training step ten times slower.
    torch.set_num_threads(1)
    out = Path(args.out)
    if out.exists() and not out.is_dir():  # found only when the first figure was written
        raise CLIError(f"--out {out}: is {file_kind(out)}, not a folder; give a figure folder")
    return int(DEMOS[args.demo].run(args) or 0)
