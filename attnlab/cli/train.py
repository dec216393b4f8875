"""``attnlab train``: train a model from a preset, a config file and ``--set`` overrides.

The run config is assembled in this order, each step overriding the one before:
the preset (or, with ``--resume``, the checkpoint's own config.json), the ``--config``
JSON file (a full or partial RunConfig, merged section by section), the ``--set``
assignments, then the ``--task``, ``--data`` and ``--seed`` shortcuts.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

from attnlab.cli.common import (
    CLIError,
    check_dir,
    deep_merge,
    non_negative_int,
    parse_assignments,
    positive_float,
    positive_int,
    read_json_file,
    run_preset,
)
from attnlab.config import ConfigError, RunConfig

DEFAULT_PRESET = "demo"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train",
        help="train a model",
        description="Train a model for a task (language modelling by default). Config = "
        "preset (or the resumed checkpoint's), then --config, then --set, then "
        "--task/--data/--seed. Ctrl-C stops cleanly after saving.",
    )
    p.add_argument(
        "--preset", metavar="NAME", help=f"run or model preset (default {DEFAULT_PRESET})"
    )
    p.add_argument(
        "--config", metavar="FILE", help="JSON run config, full or partial, merged over it"
    )
    p.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="override a field, e.g. --set model.n_layers=2 --set train.lr=3e-4 (repeatable)",
    )
    p.add_argument("--data", metavar="PATH", help="a .txt file or folder (sets data.path)")
    p.add_argument("--task", metavar="NAME", help="what to train for (sets task; default lm)")
    p.add_argument("--out", metavar="DIR", help="output folder (default runs/<preset>)")
    p.add_argument("--resume", metavar="DIR", help="continue the run saved in DIR")
    p.add_argument("--max-steps", type=positive_int, metavar="N", help="sets train.max_steps")
    p.add_argument(
        "--time-budget", type=positive_float, metavar="SECONDS", help="stop after this long"
    )
    p.add_argument(
        "--save-every", type=non_negative_int, metavar="STEPS", help="checkpoint interval"
    )
    p.add_argument("--seed", type=int, help="sets train.seed")
    p.add_argument(
        "--overwrite", action="store_true", help="start afresh in an --out that holds a run"
    )
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(handler=run)


def run_config(args: argparse.Namespace) -> tuple[RunConfig, str]:
    """The resolved RunConfig and the name the default output folder takes."""
    if args.resume is not None:
        if args.preset is not None:
            raise CLIError(
                "--preset and --resume exclude each other: a resumed run keeps its "
                "config (change fields with --set)"
            )
        from attnlab.training.checkpoint import CONFIG_FILE, checkpoint_files

        resume = check_dir(args.resume, "run folder to resume")
        base = read_json_file(checkpoint_files(resume)[CONFIG_FILE], "checkpoint config")
        name = resume.name
    else:
        name = args.preset or DEFAULT_PRESET
        base = run_preset(name).to_dict()
    if args.config is not None:
        base = deep_merge(base, read_json_file(args.config))
    try:
        cfg = RunConfig.from_dict(base)
    except ConfigError as e:
        where = args.config or (args.resume and f"{args.resume}/config.json") or name
        raise CLIError(f"{where}: {e}") from None
    overrides = parse_assignments(args.set)
    if args.task is not None:
        from attnlab.tasks import TASKS

        if args.task not in TASKS:
            raise CLIError(f"--task {args.task}: unknown task; choose one of {', '.join(TASKS)}")
        overrides["task"] = args.task
    if args.data is not None:
        overrides["data.path"] = args.data
    if args.seed is not None:
        overrides["train.seed"] = args.seed
    if overrides:
        cfg = cfg.override(overrides)
    return cfg, name


def _fmt(loss: float | None) -> str:
    return "n/a" if loss is None else f"{loss:.4f}"


def run(args: argparse.Namespace) -> int:
    cfg, name = run_config(args)
    if args.data is not None and not Path(args.data).exists():  # fail before building anything
        raise CLIError(f"--data {args.data}: no such file or folder")
    out = Path(args.out or args.resume or Path("runs") / name)
    if args.resume is None and not args.overwrite and (out / "config.json").exists():
        raise CLIError(
            f"{out} already holds a run; continue it with --resume {out}, start afresh "
            "with --overwrite, or choose another --out"
        )
    from attnlab.training import train
    from attnlab.training.metrics import METRICS_FILE, PLOT_FILE
    from attnlab.training.trainer import TrainingError

    try:
        result = train(
            cfg,
            out,
            resume=args.resume,
            max_steps=args.max_steps,
            time_budget=args.time_budget,
            save_every=args.save_every,
            progress=not args.quiet,
            overwrite=args.overwrite,
        )
    except TrainingError as e:  # a run set up wrongly or diverging: the user's to fix
        raise CLIError(str(e)) from None
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun, rank 0 reports
        return 0
    out = Path(result.out_dir)
    if result.interrupted:
        print(
            f"stopped by {result.interrupted} after step {result.step}; continue with: "
            f"attnlab train --resume {out}"
        )
    train_loss, val_loss = _fmt(result.train_loss), _fmt(result.val_loss)
    print(f"finished at step {result.step}: train loss {train_loss}, val loss {val_loss}")
    print(f"checkpoint  {out}")
    print(f"metrics     {out / METRICS_FILE}")
    if (out / PLOT_FILE).is_file():
        print(f"loss plot   {out / PLOT_FILE}")
    if cfg.task == "lm":
        print(f"sample with: attnlab generate --ckpt {out} --prompt 'The '")
    if result.interrupted:  # the shell convention 128 + signal number
        return 128 + int(getattr(signal, result.interrupted))
    return 0
