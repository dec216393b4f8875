"""``attnlab train``: train a model from a preset, a config file and ``--set`` overrides.

The run config is assembled in this order, each step overriding the one before:
the preset (or, with ``--resume`` and no ``--preset``, the checkpoint's own config.json;
with ``--init-from``, the checkpoint's config with fine-tuning defaults), the ``--config``
JSON file (a full or partial RunConfig, merged section by section), the ``--set``
assignments, then the ``--task``, ``--data``, ``--seed`` and ``--device`` shortcuts.

Re-running a command with ``--resume DIR`` appended works: its model and data settings
must equal the checkpoint's (the differing field is named otherwise), its training
settings apply. ``--max-steps N`` without ``--time-budget`` runs exactly N steps, also on
a preset (or a resumed run) that has a time budget.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
from pathlib import Path
from typing import Any

from attnlab.cli.common import (
    CLIError,
    check_data_path,
    check_dir,
    non_negative_int,
    parse_assignments,
    path_arg,
    positive_float,
    positive_int,
    read_json_file,
    run_preset,
    seed_int,
)
from attnlab.config import ConfigError, RunConfig, deep_merge

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
        "--config",
        type=path_arg,
        metavar="FILE",
        help="JSON run config, full or partial, merged over it",
    )
    p.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="override a field, e.g. --set model.n_layers=2 --set train.lr=3e-4 (repeatable)",
    )
    p.add_argument(
        "--data",
        type=path_arg,
        metavar="PATH",
        help="a .txt or .md file, or a folder read recursively for .txt and .md files "
        "(sets data.path)",
    )
    p.add_argument(
        "--task",
        metavar="NAME",
        help="what to train for (sets task; default: the preset's or checkpoint's, else lm)",
    )
    p.add_argument(
        "--out",
        type=path_arg,
        metavar="DIR",
        help="output folder (default runs/<preset>; with --resume, the resumed folder; with "
        "--init-from, runs/<its name>-finetuned)",
    )
    p.add_argument("--resume", type=path_arg, metavar="DIR", help="continue the run saved in DIR")
    p.add_argument(
        "--init-from",
        type=path_arg,
        metavar="DIR",
        help="fine-tune: start from the weights and tokenizer of an attnlab checkpoint or "
        "Hugging Face model folder, with a fresh optimizer and schedule (default lr a "
        "tenth of the checkpoint's, 10 warm-up steps, 200 steps)",
    )
    p.add_argument("--device", metavar="DEV", help="auto, cpu, cuda, cuda:1 (sets train.device)")
    p.add_argument(
        "--print-config", action="store_true", help="print the resolved config as JSON and exit"
    )
    p.add_argument(
        "--max-steps",
        type=positive_int,
        metavar="N",
        help="sets train.max_steps: exactly N steps (a preset's time budget then applies only "
        "with --time-budget)",
    )
    p.add_argument(
        "--time-budget",
        type=positive_float,
        metavar="SECONDS",
        help="sets train.time_budget: the schedule is fitted to the steps that fit in it",
    )
    p.add_argument(
        "--save-every", type=non_negative_int, metavar="STEPS", help="checkpoint interval"
    )
    p.add_argument("--seed", type=seed_int, help="sets train.seed")
    p.add_argument(
        "--overwrite", action="store_true", help="start afresh in an --out that holds a run"
    )
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(handler=run)


def run_config(args: argparse.Namespace) -> tuple[RunConfig, str]:
    """The resolved RunConfig and the name the default output folder takes."""
    if args.resume is not None and args.init_from is not None:
        raise CLIError("--resume and --init-from exclude each other")
    # fine-tuning keeps the checkpoint's model (a --preset starts from the preset instead)
    finetuning = args.init_from is not None and args.preset is None
    if args.resume is not None and args.preset is None:
        from attnlab.training.checkpoint import checked_config_file

        resume = check_dir(args.resume, "run folder to resume")
        # the config saved with the weights (one copied from another run is refused)
        base = read_json_file(checked_config_file(resume), "checkpoint config")
        name = resume.name
    elif finetuning:
        base = _finetune_base(args.init_from)
        name = Path(args.init_from).name + "-finetuned"
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
    overrides = {**parse_assignments(args.set), **_option_overrides(args)}
    lr = overrides.get("train.lr")
    if (
        finetuning
        and "train.min_lr" not in overrides
        and isinstance(lr, (int, float))
        and not isinstance(lr, bool)
    ):
        # fine-tuning's min_lr was a tenth of its default lr: it stays a tenth of the given
        # one (else a lower --set train.lr failed on a min_lr the user never set)
        from attnlab.training.trainer import FINETUNE_LR_FACTOR

        overrides["train.min_lr"] = lr * FINETUNE_LR_FACTOR
    if overrides:
        cfg = cfg.override(overrides)
    if finetuning:
        _check_model_kept(cfg, base["model"], args.init_from)
    return cfg, name


def _option_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The dotted config fields that train's own options set (they win over --set)."""
    overrides: dict[str, Any] = {}
    if args.task is not None:
        from attnlab.tasks import TASKS

        if args.task not in TASKS:
            raise CLIError(f"--task {args.task}: unknown task; choose one of {', '.join(TASKS)}")
        overrides["task"] = args.task
    if args.data is not None:
        overrides["data.path"] = args.data
    if args.seed is not None:
        overrides["train.seed"] = args.seed
    if args.device is not None:
        overrides["train.device"] = args.device
    if args.max_steps is not None:
        overrides["train.max_steps"] = args.max_steps
        if args.time_budget is None:
            overrides["train.time_budget"] = None  # explicit steps win over a preset's budget
    if args.time_budget is not None:
        overrides["train.time_budget"] = args.time_budget
    if args.save_every is not None:
        overrides["train.save_every"] = args.save_every
    return overrides


def _check_model_kept(cfg: RunConfig, model: dict, init_from: str) -> None:
    """A fine-tuned model is the checkpoint's: a --set or --config that changes it (which
    the trainer would not apply) is refused by name."""
    from attnlab.training.trainer import _differences

    changed = _differences(cfg.model.to_dict(), model, "model.")
    if changed:
        raise CLIError(
            f"--init-from {init_from}: the model is the checkpoint's; it differs in "
            f"{'; '.join(changed)}: drop the --set/--config that changes it"
        )


def _finetune_base(path: str) -> dict:
    """The config to fine-tune the model in ``path`` (attnlab or Hugging Face folder)."""
    from attnlab.cli.common import is_hf_dir
    from attnlab.training.checkpoint import CONFIG_FILE, checked_config_file
    from attnlab.training.trainer import finetune_config

    folder = check_dir(path, "checkpoint folder to fine-tune")
    if is_hf_dir(folder):
        from attnlab.interop import config_from_hf

        base = RunConfig(model=config_from_hf(read_json_file(folder / CONFIG_FILE)))
    else:
        data = read_json_file(checked_config_file(folder), "checkpoint config")
        try:
            base = RunConfig.from_dict(data)
        except ConfigError as e:
            raise CLIError(f"{folder}/config.json: {e}") from None
    cfg = finetune_config(base)
    cfg.data.path = None
    return cfg.to_dict()


def command(*words: str | os.PathLike[str]) -> str:
    """An exact shell command: every word quoted as the shell needs (spaces, quotes)."""
    return " ".join(shlex.quote(str(word)) for word in words)


SAMPLE_PROMPT = "The "  # the prompt suggested after training, where the tokenizer has it


def sample_command(out: str | os.PathLike[str]) -> list[str | os.PathLike[str]]:
    """The generate command suggested after training a language model in ``out``: with
    ``--prompt 'The '`` where the run's tokenizer encodes it (a char tokenizer knows only
    its corpus's characters), else with generate's default prompt."""
    from attnlab.tokenizers import TokenizerError, load_tokenizer

    words: list[str | os.PathLike[str]] = ["attnlab", "generate", "--ckpt", out]
    try:
        load_tokenizer(out).encode(SAMPLE_PROMPT)
    except (TokenizerError, OSError):
        return words
    return [*words, "--prompt", SAMPLE_PROMPT]


def _fmt(loss: float | None) -> str:
    return "n/a" if loss is None else f"{loss:.4f}"


def _output_folder(args: argparse.Namespace, name: str) -> Path:
    """The run's folder (``--out``, else the resumed run's, else runs/NAME), checked: a
    folder that holds no other run's checkpoint, unless ``--overwrite``."""
    from attnlab.training.checkpoint import CHECKPOINT_FILES, STATE_FILE

    if args.resume is not None and args.out is None:
        from attnlab.training.trainer import BEST_DIR

        resume = Path(args.resume)
        if resume.name == BEST_DIR and (resume.parent / STATE_FILE).is_file():
            # training in place would replace the run's best checkpoint with later steps
            raise CLIError(
                f"--resume {resume}: is the best checkpoint of the run in {resume.parent}; "
                f"training there would overwrite it: give --out for the resumed run"
            )
    out = Path(args.out or args.resume or Path("runs") / name)
    if out.exists() and not out.is_dir():
        raise CLIError(f"--out {out}: exists and is not a folder; give a folder for the run")
    same = args.resume is not None and out.resolve() == Path(args.resume).resolve()
    if not args.overwrite and not same and any((out / f).exists() for f in CHECKPOINT_FILES):
        if args.resume is None:
            raise CLIError(
                f"{out} already holds a run; continue it with: "
                f"{command('attnlab', 'train', '--resume', out)} (or start afresh with "
                "--overwrite, or choose another --out)"
            )
        raise CLIError(
            f"{out} already holds a checkpoint; the run resumed from {args.resume} would "
            "overwrite it: choose another --out (or pass --overwrite)"
        )
    from attnlab.training.metrics import METRICS_FILE, PLOT_FILE
    from attnlab.training.trainer import BEST_DIR

    # without a checkpoint: files of the user's own (or of a run killed before its first
    # save) under the names a run writes, which it would replace
    others = [f for f in (METRICS_FILE, PLOT_FILE, BEST_DIR) if (out / f).exists()]
    if not args.overwrite and not same and others:
        raise CLIError(
            f"{out} holds {', '.join(others)}, which the run would replace: choose another "
            "--out (or pass --overwrite)"
        )
    return out


def run(args: argparse.Namespace) -> int:
    cfg, name = run_config(args)
    if args.print_config:
        print(json.dumps(cfg.to_dict(), indent=2))
        return 0
    if args.data is not None:  # fail before building anything
        check_data_path(args.data)
    out = _output_folder(args, name)
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
            init_from=args.init_from,
        )
    except TrainingError as e:  # a run set up wrongly or diverging: the user's to fix
        raise CLIError(str(e)) from None
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun, rank 0 reports
        return 0
    out = Path(result.out_dir)
    print(result.stop_message)
    if args.resume is not None and not result.losses and not result.interrupted:
        print("the resumed run had no step left to take: resume with a larger --max-steps or "
              "--time-budget to train on")  # fmt: skip
    if result.interrupted:
        print(f"continue with: {command('attnlab', 'train', '--resume', out)}")
    train_loss, val_loss = _fmt(result.train_loss), _fmt(result.val_loss)
    if result.val_step is not None and result.val_loss is not None:
        val_loss += f" (step {result.val_step}"
        val_loss += f", {result.val_coverage})" if result.val_coverage else ")"
    print(f"finished at step {result.step}: train loss {train_loss}, val loss {val_loss}")
    print(f"checkpoint  {out}")
    print(f"metrics     {out / METRICS_FILE}")
    if (out / PLOT_FILE).is_file():
        print(f"loss plot   {out / PLOT_FILE}")
    if cfg.task == "lm":
        print(f"sample with: {command(*sample_command(out))}")
    if result.interrupted:  # the shell convention 128 + signal number
        return 128 + int(getattr(signal, result.interrupted))
    return 0
