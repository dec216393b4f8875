"""Helpers shared by the subcommands: argument types, config assembly, loading models.

The heavy modules (training, data, interop) are imported inside the functions that need
them, so ``attnlab presets`` or ``attnlab info`` stay quick to start.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from attnlab.config import SEED_MAX, SEED_MIN, ConfigError, ModelConfig, RunConfig
from attnlab.fileio import file_kind

if TYPE_CHECKING:  # heavy imports, kept out of the CLI's start-up
    from attnlab.models.decoder import DecoderLM
    from attnlab.tokenizers import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CLIError(Exception):
    """A bad command line: printed as one ``attnlab: error: ...`` line."""


# ------------------------------------------------------------------ argument types


def positive_int(text: str) -> int:
    value = _number(text, int)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return _int64(value, text)


def non_negative_int(text: str) -> int:
    value = _number(text, int)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return _int64(value, text)


def _int64(value: int, text: str) -> int:
    """``value`` if torch takes it as a size or count (past int64, "Overflow when unpacking
    long long" was the whole error, or a traceback)."""
    if value > SEED_MAX:
        raise argparse.ArgumentTypeError(f"must be at most 2**63 - 1, got {text!r}")
    return value


def positive_float(text: str) -> float:
    value = _number(text, float)
    if not 0 < value < float("inf"):  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def finite_float(text: str) -> float:
    value = _number(text, float)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    value = _number(text, float)
    if not 0 <= value < float("inf"):  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def path_arg(text: str) -> str:
    """A file or folder path, not empty: ``Path("")`` is the current folder, which a
    command would read (a corpus, a model) or write into instead of the one meant, and
    ``if args.out`` would take an empty one for none given."""
    if not text:
        raise argparse.ArgumentTypeError("expected a path, got ''")
    return text


def seed_int(text: str) -> int:
    """A random seed: an integer torch.manual_seed takes."""
    value = _number(text, int)
    if not SEED_MIN <= value <= SEED_MAX:
        raise argparse.ArgumentTypeError(
            f"must be an integer from -2**63 to 2**63 - 1, got {text!r}"
        )
    return value


def token_ids(text: str) -> list[int]:
    """``"1,2,3"`` (or spaces between) -> [1, 2, 3]."""
    parts = text.replace(",", " ").split()
    if not parts or not all(part.isdigit() for part in parts):
        raise argparse.ArgumentTypeError(
            f"expected token ids separated by commas (e.g. 1,2,3), got {text!r}"
        )
    return [int(part) for part in parts]


def _number(text: str, kind: type) -> Any:
    try:
        return kind(text)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None


# ------------------------------------------------------------------ configs


def parse_assignments(items: list[str] | None) -> dict[str, Any]:
    """``["train.lr=3e-4", "model.position.kind=rope"]`` -> dotted-key dict. Values are
    read as JSON when they parse (numbers, true/false, null, lists, quoted strings) and
    kept as plain strings otherwise."""
    out: dict[str, Any] = {}
    for item in items or ():
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise CLIError(f"--set expects key=value (e.g. train.lr=3e-4), got {item!r}")
        try:
            out[key] = json.loads(text)
        except json.JSONDecodeError:
            out[key] = text
    return out


def add_evaluation_settings_argument(p: argparse.ArgumentParser) -> None:
    """``--set model.NAME=VALUE`` of a command that runs a trained model (eval, generate):
    its evaluation settings, applied by :func:`evaluation_settings`."""
    p.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="an evaluation setting of the model, e.g. model.mem_len=1600 (Transformer-XL: "
        "mem_len, clamp_len, same_length; repeatable)",
    )


def evaluation_settings(
    items: list[str] | None, model: torch.nn.Module, cfg: RunConfig, command: str
) -> RunConfig:
    """``--set model.NAME=VALUE`` of ``command``: the model's evaluation settings (its
    config's ``EVAL_FIELDS``, which it reads at every forward pass) changed on the loaded
    model, its weights as trained; any other field is refused by name."""
    overrides = parse_assignments(items)
    if not overrides:
        return cfg
    allowed = [f"model.{name}" for name in type(cfg.model).EVAL_FIELDS]
    which = f"those of this model: {', '.join(allowed)}"
    if not allowed:
        which = f"a {cfg.model.arch!r} model has none"
    for key in overrides:
        if key not in allowed:
            raise CLIError(f"--set {key}: {command} changes only evaluation settings; {which}")
    try:
        model_cfg = cfg.model.override({k.removeprefix("model."): v for k, v in overrides.items()})
    except ConfigError as e:
        raise CLIError(f"--set model.{e}") from None
    model.cfg = model_cfg
    return dataclasses.replace(cfg, model=model_cfg)


def read_json_file(path: str | Path, what: str = "config") -> dict[str, Any]:
    path = Path(path)
    if path.exists() and not path.is_file() and not path.is_dir():  # a FIFO's read would wait
        raise CLIError(f"{path}: is {file_kind(path)}, not a regular file; give a JSON {what} file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CLIError(f"{path}: {what} file not found") from None
    except IsADirectoryError:
        raise CLIError(f"{path}: is a folder; give a JSON {what} file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CLIError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CLIError(f"{path}: expected a JSON object at the top level")
    return data


def run_preset(name: str) -> RunConfig:
    """A run preset (model + training + data) by name; a model preset name gives that
    model with the default training and data settings."""
    from attnlab.presets import get_run_preset

    return get_run_preset(name)


def is_run_config(data: dict[str, Any]) -> bool:
    return bool(data) and set(data) <= {"model", "train", "data", "task"}


def model_config_from_file(path: str | Path) -> ModelConfig:
    """A JSON file holding a RunConfig (e.g. a checkpoint's config.json), a ModelConfig,
    or a Hugging Face config.json."""
    from attnlab.interop.io import is_hf_config

    data = read_json_file(path)
    try:
        if is_hf_config(data):
            from attnlab.interop import config_from_hf

            return config_from_hf(data)
        if is_run_config(data):
            return RunConfig.for_inference(data).model  # its training settings unused
        return ModelConfig.from_dict(data)
    except ConfigError as e:
        raise CLIError(f"{path}: {e}") from None


# ------------------------------------------------------------------ models


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise CLIError(f"--device {name}: not a device; use auto, cpu, cuda or cuda:N") from None
    kind = device.type
    if kind == "cuda" and not torch.cuda.is_available():
        raise CLIError(f"--device {name}: CUDA is not available on this machine; use cpu")
    if kind == "cuda" and (device.index or 0) >= (count := torch.cuda.device_count()):
        raise CLIError(
            f"--device {name}: this machine has {count} GPU(s), cuda:0 to cuda:{count - 1}"
        )
    if kind == "mps" and not torch.backends.mps.is_available():
        raise CLIError(f"--device {name}: MPS is not available on this machine; use cpu")
    if kind == "cpu" and device.index is not None:  # torch takes cpu:1, but there is one CPU
        raise CLIError(f"--device {name}: the CPU device has no index; use cpu")
    if kind not in ("cpu", "cuda", "mps"):
        raise CLIError(f"--device {name}: the {kind} device is not supported; use cpu or cuda")
    return name


def is_hf_dir(path: Path) -> bool:
    """A Hugging Face model folder (its config.json is Hugging Face's), not an attnlab one."""
    from attnlab.interop.io import is_hf_folder

    return is_hf_folder(path)


def check_dir(path: str | Path, what: str) -> Path:
    path = Path(path)
    if not path.exists():
        raise CLIError(f"{path}: {what} not found")
    if not path.is_dir():
        raise CLIError(f"{path}: is {file_kind(path)}, not a folder; give a {what}")
    return path


def check_data_path(path: str) -> Path:
    """``--data PATH`` (train, eval): a text file or a folder, checked before any work (a
    device or FIFO was searched as a folder, and reported as one without text files)."""
    data = Path(path)
    if not data.exists():
        raise CLIError(f"--data {path}: no such file or folder")
    if not data.is_file() and not data.is_dir():
        raise CLIError(
            f"--data {path}: is {file_kind(data)}, not a text file or a folder; give a .txt or "
            ".md file, or a folder of them"
        )
    return data


def add_checkpoint_argument(p: argparse.ArgumentParser) -> None:
    """``--ckpt DIR``: the model to run, an attnlab checkpoint or a Hugging Face folder."""
    p.add_argument(
        "--ckpt", type=path_arg, required=True, metavar="DIR", help="checkpoint (or HF) folder"
    )


def add_device_argument(p: argparse.ArgumentParser) -> None:
    """``--device`` of a command that runs a model (checked by :func:`resolve_device`)."""
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ... (default auto)")


def add_dtype_argument(p: argparse.ArgumentParser) -> None:
    """``--dtype`` of a command that loads a model (passed to :func:`load_for_inference`)."""
    p.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default="float32",
        help="weights are loaded straight into this dtype (default float32)",
    )


def load_for_inference(
    path: str | Path, device: str = "cpu", dtype: str | torch.dtype = "float32"
) -> tuple[DecoderLM, RunConfig, Tokenizer | None]:
    """(model in eval mode, RunConfig, tokenizer or None) from an attnlab checkpoint
    folder, or from a Hugging Face model folder (weights via attnlab.interop, tokenizer
    from its tokenizer.json when there is one). ``dtype``: a DTYPES name or torch dtype."""
    path = check_dir(path, "checkpoint folder")
    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    if is_hf_dir(path):
        from attnlab.interop import load_hf
        from attnlab.interop.io import read_config
        from attnlab.interop.registry import lookup

        family, _ = lookup(read_config(path))
        model = load_hf(path, device=device, dtype=dtype)
        tokenizer = None
        if (path / "tokenizer.json").is_file():
            from attnlab.tokenizers import load_tokenizer

            tokenizer = load_tokenizer(path / "tokenizer.json")
        return model.eval(), RunConfig(model=model.cfg, task=family.task(model.cfg)), tokenizer
    from attnlab.training.checkpoint import load_checkpoint

    ckpt = load_checkpoint(path, device=device, dtype=dtype)
    return ckpt.model.eval(), ckpt.config, ckpt.tokenizer


def stop_token_ids(path: str | Path) -> list[int]:
    """The end-of-sequence ids of a model folder: ``eos_token_id`` (an int or a list) of its
    generation_config.json, else of its config.json when that is a Hugging Face one (an
    imported checkpoint keeps the source's generation_config.json). Empty when none."""
    from attnlab.interop.io import eos_token_ids

    return eos_token_ids(Path(path))


def add_tokenizer_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tokenizer",
        type=path_arg,
        metavar="FILE",
        help="tokenizer.json to use instead of the checkpoint's (for checkpoints without one)",
    )


def refuse_tokenizer_option(path: str | None, what: str) -> None:
    """``--tokenizer FILE`` given for a model that reads no text tokenizer (``what`` says
    which: an image classifier, the numbers task's character vocabularies): one CLIError,
    never a silently unused option."""
    if path is not None:
        raise CLIError(f"--tokenizer applies to models that read text with a tokenizer; {what}")


def tokenizer_option(path: str | None, tokenizer: Tokenizer | None, vocab_size: int):
    """The tokenizer of ``--tokenizer FILE`` when given (checked to fit a model of
    ``vocab_size`` embeddings), else the checkpoint's ``tokenizer`` (maybe None)."""
    if path is None:
        return tokenizer
    from attnlab.tokenizers import TokenizerError, load_tokenizer

    try:
        tokenizer = load_tokenizer(path)
    except TokenizerError as e:
        raise CLIError(f"--tokenizer: {e}") from None
    if tokenizer.vocab_size > vocab_size:  # fewer is fine: padded embeddings
        raise CLIError(
            f"--tokenizer {path}: {tokenizer.vocab_size} tokens but the model has only "
            f"vocab_size={vocab_size} embeddings; give the model's own tokenizer"
        )
    return tokenizer


def require_tokenizer(
    tokenizer: Tokenizer | None, path: str | Path, alternatives: str = ""
) -> Tokenizer:
    """``tokenizer``, or one CLIError saying how to give one (``alternatives``: the
    command's other ways, e.g. token ids)."""
    if tokenizer is None:
        raise CLIError(
            f"{path}: has no tokenizer.json, so text cannot be encoded; give --tokenizer FILE "
            f"(the model's tokenizer.json){alternatives}, or copy that file into the folder"
        )
    return tokenizer


# ------------------------------------------------------------------ formatting


HUMAN_COUNT_MAX = 10**13  # from here "12345.67B" would be unreadable: powers of ten
HUMAN_BYTES_MAX = 10**4 << 30  # 10,000 GiB (a 671B model's float32 weights are 2,500)


def _in_units(n: float, units: tuple[tuple[str, int | float], ...]) -> tuple[float, str] | None:
    """(n to 2 decimals, unit) in the largest of ``units`` (largest first) that n reaches, or
    None below the smallest. A figure that rounds up to the unit above (999,999 is 1000.00K,
    1,048,575 bytes 1024.00 KiB) is given in that unit: 1.00M, 1.00 MiB."""
    for i, (unit, size) in enumerate(units):
        if abs(n) >= size:
            figure = round(n / size, 2)
            if i > 0 and abs(figure) * size >= units[i - 1][1]:
                unit, size = units[i - 1]
                figure = round(n / size, 2)
            return figure, unit
    return None


def human_count(n: float) -> str:
    """``836.74K``, ``8.03B`` (up to ``9999.99B``); past that ``2.01e+23`` (an int of any
    size: no float conversion to overflow)."""
    if abs(n) < HUMAN_COUNT_MAX:
        scaled = _in_units(n, (("B", 10**9), ("M", 10**6), ("K", 10**3)))
        if scaled is None:
            return f"{n:g}"
        figure, unit = scaled
        if unit != "B" or abs(figure) * 10**9 < HUMAN_COUNT_MAX:  # not 10000.00B
            return f"{figure:.2f}{unit}"
    return f"{Decimal(n):.2e}"


def human_bytes(n: float) -> str:
    """``512 B``, ``3.19 MiB``, ``2499.77 GiB`` (up to 9999.99 GiB); past that ``8.04e+23 B``."""
    if abs(n) < HUMAN_BYTES_MAX:
        scaled = _in_units(n, (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)))
        if scaled is None:
            return f"{int(n)} B"
        figure, unit = scaled
        if unit != "GiB" or abs(figure) * (1 << 30) < HUMAN_BYTES_MAX:  # not 10000.00 GiB
            return f"{figure:.2f} {unit}"
    return f"{Decimal(n):.2e} B"


# ------------------------------------------------------------------ encoder text tasks


def load_text_task(
    path: str | Path,
    device: str,
    task: str,
    command: str,
    tokenizer_file=None,
    dtype: str | torch.dtype = "float32",
):
    """(model, RunConfig, TextCodec, the task's parsed data options) of a checkpoint of the
    encoder text ``task`` (trained, or an imported Hugging Face BERT with that head), its
    weights in ``dtype`` and its tokenizer replaced by ``tokenizer_file`` when given; one
    CLIError naming the preset otherwise."""
    from attnlab.tasks import TASKS

    model, cfg, tokenizer = load_for_inference(path, device, dtype)
    if cfg.task != task:
        preset = TASKS[task].preset
        raise CLIError(
            f"{path} was trained for task {cfg.task!r}; {command} needs a {task} checkpoint "
            f"(attnlab train --preset {preset}) or an imported Hugging Face BERT of that task"
        )
    tokenizer = tokenizer_option(tokenizer_file, tokenizer, cfg.model.vocab_size)
    codec = text_codec(require_tokenizer(tokenizer, path), cfg.model.vocab_size)
    return model, cfg, codec, TASKS[task].data_options(cfg)


def text_codec(tokenizer: Tokenizer, vocab_size: int):
    """The :class:`~attnlab.tasks.text.TextCodec` of ``tokenizer`` for a model of
    ``vocab_size`` embeddings (see :func:`attnlab.tasks.text.text_codec`); a CLIError when
    its special ids do not fit the model."""
    from attnlab.tasks import text

    codec = text.text_codec(tokenizer)
    if codec.vocab_size > vocab_size:
        raise CLIError(
            f"the tokenizer ({tokenizer.vocab_size} tokens) has no [CLS], [SEP] and [PAD] of "
            f"its own and the model no ids past it (vocab_size={vocab_size}); give the "
            "model's own tokenizer.json with --tokenizer FILE"
        )
    return codec


def label_names(cfg: RunConfig) -> list[str]:
    """The names of an encoder head's labels, in label order: the model's ``label_names``
    (an imported model's id2label), else those of the task it was trained for."""
    from attnlab.tasks import TASKS

    names = getattr(cfg.model, "label_names", None)
    if names is not None:
        return list(names)
    task = TASKS[cfg.task]
    return list(task.label_names(task.data_options(cfg)))


def refuse_beam_options(given: dict[str, object]) -> None:
    """Without ``--num-beams`` K > 1: the beam-only options in ``given`` (option -> value,
    None when not given) are refused by name, where they were silently ignored."""
    for option, value in given.items():
        if value is not None:
            raise CLIError(f"{option} applies to beam search; give --num-beams K (K > 1)")


def add_early_stopping_argument(p: argparse.ArgumentParser, note: str = "") -> None:
    """``--early-stopping true|false|never``: when beam search ends, read by
    :func:`early_stopping_value` (None when not given)."""
    p.add_argument(
        "--early-stopping",
        choices=("true", "false", "never"),
        help="with --num-beams" + note + ": when the search ends, as transformers' "
        "generate(early_stopping=...): true (default) once K beams have finished; false "
        "(transformers' default) once no live beam can beat them at its current length; "
        "never: at the length limit when A > 0",
    )


def early_stopping_value(given: str | None) -> bool | str:
    """The library's ``early_stopping`` for ``--early-stopping`` (True when not given)."""
    return {"false": False, "never": "never"}.get(given, True)


def check_beams_fit_vocabulary(num_beams: int, vocab_size: int) -> None:
    """``--num-beams`` at most the model's vocabulary: beam search keeps distinct
    continuations, and after the first token there are only ``vocab_size`` of them (a huge
    K ran out of memory after a long wait). The library goes wider, up to its exhaustive
    search (``generation.check_beams_can_fill``); generate and translate bound it here."""
    if num_beams > vocab_size:
        raise CLIError(
            f"--num-beams {num_beams}: more beams than the model's vocabulary has tokens "
            f"({vocab_size}): beam search keeps distinct continuations, and its first step has "
            f"only {vocab_size}; give --num-beams {vocab_size} or fewer"
        )
