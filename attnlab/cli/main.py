"""``attnlab`` entry point: builds the parser from the subcommand modules and turns
every user error into one ``attnlab: error: ...`` line on stderr and a non-zero exit.

Each subcommand module has ``add_parser(subparsers)`` (registering ``run`` as the
handler) and ``run(args) -> int``. Library errors for bad input all derive from
ValueError (ConfigError, DataError, TokenizerError, CheckpointError), OSError or, for a
corrupt weights file, SafetensorError; a third-party package that is not installed (the
lazily imported matplotlib, num2words, scikit-learn) is one line naming what to install;
so is a size given too large (a tensor past the machine's memory, or past torch's int64);
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import warnings

from safetensors import SafetensorError

from attnlab.cli import (
    answer,
    attention_map,
    classify,
    demo,
    evaluate,
    fill_mask,
    generate,
    hf,
    info,
    kv,
    presets,
    tag,
    train,
    translate,
)
from attnlab.cli.common import CLIError

SUBCOMMANDS = (train, generate, translate, classify, fill_mask, tag, answer, attention_map,
               evaluate, info, kv, presets, hf, demo)  # fmt: skip

EXIT_ERROR = 1
EXIT_USAGE = 2  # argparse's code for a malformed command line
EXIT_INTERRUPTED = 130  # 128 + SIGINT, the shell convention
PIP_NAMES = {"sklearn": "scikit-learn"}  # import name -> what pip installs


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (with a pointer to --help), not two."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="attnlab",
        description="Train, sample from, evaluate and inspect attnlab models.",
    )
    from attnlab import __version__

    parser.add_argument("--version", action="version", version=f"attnlab {__version__}")
    parser.add_argument(
        "--threads",
        type=_thread_count,
        default=None,
        metavar="N",
        help="CPU threads for torch (default: torch's, one per core); use 1 when other "
        "jobs share a small machine: threads waiting on a busy core slow every step",
    )
    subparsers = parser.add_subparsers(
        dest="command", metavar="COMMAND", required=True, parser_class=Parser
    )
    for module in SUBCOMMANDS:
        module.add_parser(subparsers)
    return parser


def _thread_count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"--threads must be a positive integer, got {text!r}")
    cpus = os.cpu_count() or 1
    if n > cpus:  # torch took 2**31 - 1 and failed past it; threads past the CPUs only wait
        raise argparse.ArgumentTypeError(
            f"--threads must be at most this machine's {cpus} CPUs, got {text!r}"
        )
    return n


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"attnlab: warning: {message}", file=sys.stderr if file is None else file)


def _error_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    if isinstance(error, OSError) and error.filename is not None and error.strerror:
        text = f"{error.filename}: {error.strerror}"
    return " ".join(text.split())  # one line, whatever the message held


def _missing_package(error: ImportError) -> str | None:
    """The error line for a third-party package that is not installed (``error`` or its
    cause a ModuleNotFoundError), or None: an attnlab module that fails to import is a bug."""
    missing = error if isinstance(error, ModuleNotFoundError) else error.__cause__
    if not isinstance(missing, ModuleNotFoundError) or not missing.name:
        return None
    name = missing.name.split(".")[0]
    if name == "attnlab":
        return None
    if missing is not error:  # the caller's own message says what needs it
        return _error_line(error)
    return f"the {name!r} package is not installed (pip install {PIP_NAMES.get(name, name)})"


def _too_large(error: BaseException, command: str) -> str | None:
    """The error line for a size given too large: a tensor the machine cannot hold (torch's
    CPU allocator failing, or CUDA out of memory), or a size torch cannot even take (past
    int64: a product of sizes the options allow one by one). None for any other error."""
    torch = sys.modules.get("torch")
    text = str(error)
    from attnlab.config import is_int64_overflow

    if is_int64_overflow(error):
        return (
            f"a size past torch's int64 (2**63 - 1), made of the sizes given; give {command} "
            "smaller sizes (batch, lengths, counts)"
        )
    cuda = torch is not None and isinstance(error, torch.OutOfMemoryError)
    if not cuda and "can't allocate memory" not in text:
        return None
    found = re.search(r"allocate (\d+) bytes", text) or re.search(r"allocate ([\d.]+ \w+)", text)
    size = ""
    if found:
        from attnlab.cli.common import human_bytes

        amount = found.group(1)
        size = f" ({human_bytes(int(amount)) if amount.isdigit() else amount} at once)"
    where = "the GPU" if cuda else "this machine"
    return (
        f"out of memory: a tensor{size} does not fit in {where}'s memory; give {command} "
        "smaller sizes (batch, lengths, counts)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    warnings.showwarning = _one_line_warning
    if args.command != "train":  # the trainer applies it itself (train.keep_freed_memory)
        from attnlab.allocator import keep_freed_memory

        keep_freed_memory()  # model runs reuse freed memory (attnlab/allocator.py)
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    try:
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:
        print("attnlab: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # e.g. `attnlab generate ... | head` closed our stdout
        # Point stdout at devnull so the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_ERROR
    except (CLIError, ValueError, OSError, SafetensorError) as error:
        line = _too_large(error, _command(args)) or _error_line(error)
        print(f"attnlab: error: {line}", file=sys.stderr)
        return EXIT_ERROR
    except ImportError as error:
        if (line := _missing_package(error)) is None:
            raise
        print(f"attnlab: error: {line}", file=sys.stderr)
        return EXIT_ERROR
    except (RuntimeError, TypeError) as error:
        if (line := _too_large(error, _command(args))) is None:
            raise  # a bug
        print(f"attnlab: error: {line}", file=sys.stderr)
        return EXIT_ERROR


def _command(args: argparse.Namespace) -> str:
    """The subcommand as typed: ``train``, ``demo sqrt-dk``."""
    return " ".join(filter(None, (args.command, getattr(args, "demo", None))))
