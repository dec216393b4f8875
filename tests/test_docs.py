"""The documentation promises: every public class and function of the top-level API has a
docstring (``help()`` says what it is), and the README's Python examples run as written."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import itertools
import re
import shlex
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# The user-facing documents; benchmarks.md holds the benchmark tables the README summarises.
DOCS = ("README.md", "docs/design.md", "docs/benchmarks.md")
API_MODULES = ("attnlab", "attnlab.models", "attnlab.nn", "attnlab.tasks")


def _own_docstring(obj) -> str | None:
    """A class's own docstring (not the signature dataclasses write), a function's doc."""
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__
    if inspect.isclass(obj) and dataclasses.is_dataclass(obj) and doc:
        if doc.startswith(f"{obj.__name__}("):
            return None
    return doc.strip() if doc else None


def _public_api():
    for module_name in API_MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isclass(obj) or inspect.isfunction(obj):
                yield f"{module_name}.{name}", obj


def test_every_exported_class_and_function_has_a_docstring():
    missing = [name for name, obj in _public_api() if not _own_docstring(obj)]
    assert not missing, f"no docstring: {missing}"


def test_public_methods_of_exported_classes_have_docstrings():
    """Methods and properties a class defines (inherited docstrings count: an override of
    a documented method says the same)."""
    missing = []
    for name, cls in _public_api():
        if not inspect.isclass(cls):
            continue
        for attr, value in vars(cls).items():
            if attr.startswith("_"):
                continue
            if isinstance(value, property):
                doc = value.__doc__
            elif inspect.isfunction(value) or isinstance(value, (classmethod, staticmethod)):
                doc = inspect.getdoc(getattr(cls, attr))
            else:
                continue
            if not doc:
                missing.append(f"{name}.{attr}")
    assert not missing, f"no docstring: {missing}"


# ------------------------------------------------------------------ README examples

# Placeholder paths in the README's examples, replaced by real folders made here.
PLACEHOLDERS = {"path/to/hf-folder": "hf", "runs/x": "run", "exported/": "exported"}


def readme_python_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_readme_has_python_examples():
    assert len(readme_python_blocks()) >= 2


@pytest.mark.parametrize("index", range(len(readme_python_blocks())))
def test_readme_python_example_runs(index, tmp_path, monkeypatch):
    """Each ```python block of the README runs as written, its placeholder paths pointing
    at a tiny exported model (an HF folder) and a tiny trained run made here."""
    from attnlab import build_model, get_preset
    from attnlab.interop import save_hf

    code = readme_python_blocks()[index]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ATTNLAB_CACHE", str(tmp_path / "cache"))
    if "path/to/hf-folder" in code:
        torch.manual_seed(0)
        save_hf(build_model(get_preset("llama-tiny")), tmp_path / "hf")
    for placeholder, real in PLACEHOLDERS.items():
        code = code.replace(placeholder, str(tmp_path / real) + ("/" if real == "exported" else ""))
    # Keep training examples tiny: the run presets' step counts would take minutes here.
    code = code.replace('get_run_preset("demo")', 'get_run_preset("demo").override(_TINY)')
    tiny = {"train.max_steps": 2, "train.time_budget": None, "train.eval_every": 0}
    tiny |= {"model.n_layers": 1, "model.d_model": 32, "model.max_seq_len": 32}
    tiny |= {"train.batch_size": 2, "train.block_size": 16}
    namespace = {"_TINY": tiny, "__name__": "readme_example"}
    exec(compile(code, f"README.md python block {index + 1}", "exec"), namespace)


# ------------------------------------------------------------------ README command lines


def readme_command_lines() -> list[str]:
    """Every ``attnlab`` command line the README shows: the lines of its ```bash blocks (a
    trailing backslash joins the next line; ``&&`` separates commands) and its indented
    ``$ attnlab ...`` examples. Comments are dropped; words before ``attnlab`` (an
    environment variable, ``torchrun ... -m``) too."""
    text = (ROOT / "README.md").read_text()
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        lines += block.replace("\\\n", " ").splitlines()
    lines += [line.strip()[2:] for line in text.splitlines() if line.strip().startswith("$ ")]
    commands = []
    for line in lines:
        for part in line.split("&&"):
            words = shlex.split(part, comments=True)
            if "attnlab" in words:
                commands.append(shlex.join(words[words.index("attnlab") + 1 :]))
    return commands


def test_readme_shows_command_lines():
    assert len(readme_command_lines()) >= 40


@pytest.mark.parametrize("command", readme_command_lines())
def test_readme_command_line_is_accepted(command):
    """Each README command parses (its options exist, their values are valid choices); a
    ``train`` command also resolves its config (preset names, ``--set`` keys and values,
    ``--task``), as ``--print-config`` would, unless it reads a run folder the README's
    earlier commands make (``--resume``, ``--init-from``)."""
    from attnlab.cli.main import build_parser
    from attnlab.cli.train import run_config

    argv = shlex.split(command)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"attnlab {command}: rejected by the parser (exit {e.code})")
    if args.command == "train" and args.resume is None and args.init_from is None:
        run_config(args)


def test_readme_kv_table_is_what_the_command_prints(capsys):
    """The README's ``$ attnlab kv ...`` example shows that command's output (computed,
    not measured: it changes only when the accounting does)."""
    from attnlab.cli.main import main

    text = (ROOT / "README.md").read_text()
    match = re.search(r"\n    \$ attnlab (kv [^\n]*)\n((?:    [^\n]*\n|\n)+)", text)
    assert match, "no `$ attnlab kv` example in the README"
    shown = [line[4:].rstrip() for line in match.group(2).rstrip("\n").splitlines()]
    assert main(shlex.split(match.group(1))) == 0
    printed = [line.rstrip() for line in capsys.readouterr().out.rstrip("\n").splitlines()]
    assert printed == shown


def _referenced_paths(text: str) -> set[str]:
    pattern = r"docs/img/[\w.-]+\.png|benchmarks/\w+\.(?:py|sh)|tests/\w+\.py|attnlab/[\w/]+\.py"
    return set(re.findall(pattern, text))


@pytest.mark.parametrize("doc", DOCS)
def test_files_the_docs_name_exist(doc):
    text = (ROOT / doc).read_text()
    missing = sorted(p for p in _referenced_paths(text) if not (ROOT / p).exists())
    assert not missing, f"{doc} names files that do not exist: {missing}"


def test_readme_module_table_names_existing_files():
    """The 'What is inside' table's ``where`` column: each file or folder, relative to
    ``attnlab/`` (a bare file name after a path: the same folder, or any)."""
    text = (ROOT / "README.md").read_text()
    table = text.split("## What is inside", 1)[1].strip().split("\n\n", 1)[0]
    files = {p.relative_to(ROOT / "attnlab").as_posix() for p in (ROOT / "attnlab").rglob("*")}
    assert table.startswith("| piece | where |"), table[:100]
    missing = []
    for row in table.splitlines()[2:]:
        where = row.split("|")[2]
        for name in re.findall(r"`([^`]+)`", where):
            name = name.rstrip("/")
            if not any(f == name or f.endswith("/" + name) for f in files):
                missing.append(name)
    assert not missing, f"the README's module table names missing files: {missing}"


def _docs_text() -> str:
    """Every document's text, each line break (and the spaces around it) one space."""
    text = "\n".join((ROOT / doc).read_text() for doc in DOCS)
    return re.sub(r"\s*\n\s*", " ", text)


def _anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped (hyphens and
    underscores kept), spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(text: str) -> set[str]:
    """The anchors of a document's headings (outside code blocks; a repeated heading gets
    ``-1``, ``-2``... as on GitHub)."""
    seen: dict[str, int] = {}
    anchors = set()
    prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    for heading in re.findall(r"^#{1,6} (.+)$", prose, flags=re.M):
        base = _anchor(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        anchors.add(base if n == 0 else f"{base}-{n}")
    return anchors


@pytest.mark.parametrize("doc", DOCS)
def test_links_between_the_docs_resolve(doc):
    """Each relative Markdown link ``[text](path#anchor)`` names a file that exists and, with
    an anchor, a heading of that file."""
    path = ROOT / doc
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
        if re.match(r"[a-z]+:", target):  # http(s):, mailto:
            continue
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        if not linked.exists():
            broken.append(target)
        elif anchor and (linked.suffix != ".md" or anchor not in _anchors(linked.read_text())):
            broken.append(target)
    assert not broken, f"{doc} links to missing files or headings: {broken}"


def test_benchmark_options_the_docs_use_exist():
    """``python benchmarks/NAME.py --option ...`` in the docs: the script (or the shared
    ``_common.py``) defines each option."""
    text = _docs_text()
    missing = []
    command = r"benchmarks/(\w+)\.py((?: --?[\w-]+(?: (?!-)[^\s`]+)*)*)"  # options, values
    for script, options in re.findall(command, text):
        source = (ROOT / "benchmarks" / f"{script}.py").read_text()
        source += (ROOT / "benchmarks" / "_common.py").read_text()
        for option in re.findall(r"(?<!\S)--[\w-]+", options):
            if f'"{option}"' not in source:
                missing.append(f"{script}.py {option}")
    assert not missing, f"options the docs give that the benchmarks lack: {sorted(set(missing))}"


def test_benchmark_variants_the_docs_use_exist():
    """``python benchmarks/NAME.py ... --variants A "B, C" ...`` in the docs: each variant
    (each ``+``-joined part) is one the script defines, literally or by a generated name
    (``heads4`` from ``f"heads{n}"``)."""
    text = _docs_text()
    missing = []
    for span in re.findall(r"`([^`]*benchmarks/\w+\.py[^`]*--variants[^`]*)`", text):
        words = shlex.split(span)
        script = next(w for w in words if re.fullmatch(r"benchmarks/\w+\.py", w))
        source = (ROOT / script).read_text()
        start = words.index("--variants") + 1
        for name in itertools.takewhile(lambda w: not w.startswith("--"), words[start:]):
            for part in name.split("+") if name != "..." else []:
                generated = re.sub(r"[\d.]+$", "", part)
                if f'"{part}"' not in source and f'f"{generated}{{' not in source:
                    missing.append(f"{script} {part}")
    assert not missing, f"variants the docs give that the benchmarks lack: {missing}"


def test_benchmark_help_descriptions_are_whole_sentences():
    """A script's ``--help`` description cut from its docstring (first line, first
    paragraph) ends where a sentence does, not mid-phrase."""
    cut = []
    for script in sorted((ROOT / "benchmarks").glob("*.py")):
        tree = ast.parse(script.read_text())
        doc = ast.get_docstring(tree, clean=False) or ""
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "ArgumentParser":
                for kw in node.keywords:
                    if kw.arg == "description" and not isinstance(kw.value, ast.Name):
                        shown = eval(compile(ast.Expression(kw.value), script.name, "eval"),
                                     {"__doc__": doc})  # fmt: skip
                        if not shown.rstrip().endswith((".", ":", ")")):
                            cut.append(f"{script.name}: ...{shown.rstrip()[-40:]!r}")
    assert not cut, f"--help descriptions cut mid-sentence: {cut}"


def _config_fields():
    """Dotted config keys: ``train.*``, ``data.*`` (``data.options.*``: any task's options)
    and ``model.*`` over every architecture's config, nested sections included."""
    import attnlab.models  # noqa: F401  (registers the architectures' configs)
    from attnlab.config import ModelConfig, RunConfig
    from attnlab.tasks import TASKS

    keys: set[str] = set()

    def walk(prefix: str, cfg) -> None:
        for f in dataclasses.fields(cfg):
            keys.add(f"{prefix}.{f.name}")
            value = getattr(cfg, f.name)
            if dataclasses.is_dataclass(value):
                walk(f"{prefix}.{f.name}", value)

    run = RunConfig()
    walk("train", run.train)
    walk("data", run.data)
    for cls in ModelConfig._variants.values():
        walk("model", cls())
    for task in TASKS.values():
        options = getattr(task, "options", None)
        if options is not None:
            keys |= {f"data.options.{f.name}" for f in dataclasses.fields(options)}
    return keys


# ``model.`` followed by a method or file of a model object, not a config key.
NOT_CONFIG = ("model.safetensors", "model.generate", "model.stream", "model.new_cache", "model.to")


@pytest.mark.parametrize("doc", DOCS)
def test_config_keys_the_docs_name_exist(doc):
    """Every ``train.x`` / ``data.x`` / ``model.x.y`` the docs name, and the short
    ``attention.x`` / ``ffn.x`` / ``position.x`` / ``norm.x`` of a model config, is a field
    of the typed configs (a renamed field leaves no stale key behind)."""
    text = (ROOT / doc).read_text()
    keys = _config_fields()
    full = r"(?<![\w./-])((?:train|data|model)(?:\.[a-z_][a-z_0-9]*)+)"
    short = r"`((?:attention|ffn|position|norm)(?:\.[a-z_][a-z_0-9]*)+)"
    named = {m for m in re.findall(full, text) if not m.startswith(NOT_CONFIG)}
    named |= {f"model.{m}" for m in re.findall(short, text)}
    missing = sorted(k for k in named if k not in keys)
    assert not missing, f"{doc} names config keys that do not exist: {missing}"


def test_readme_names_every_preset():
    """The README's preset summary names every preset ``attnlab presets`` lists."""
    from attnlab.presets import list_presets

    text = (ROOT / "README.md").read_text()
    summary = text.split("Presets (`attnlab presets` lists them all", 1)[1].split("\n\n", 1)[0]
    named = set(re.findall(r"`([\w.-]+)`", summary))
    missing = sorted(set(list_presets()) - named)
    assert not missing, f"presets the README's summary leaves out: {missing}"


def test_design_layout_names_every_package_and_module():
    """docs/design.md's layout table covers the tree: each subpackage of ``attnlab/`` and
    each top-level module (the ``attnlab/*.py`` row lists those without a row of their
    own)."""
    text = (ROOT / "docs" / "design.md").read_text()
    layout = text.split("## Layout", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`([^`]+)`", layout))
    package = ROOT / "attnlab"
    missing = [
        f"attnlab/{p.name}/"
        for p in sorted(package.iterdir())
        if (p / "__init__.py").exists() and f"attnlab/{p.name}/" not in named
    ]
    missing += [
        f"attnlab/{p.name}"
        for p in sorted(package.glob("*.py"))
        if p.name not in ("__init__.py", "__main__.py")
        and f"attnlab/{p.name}" not in named
        and p.name not in named
    ]
    assert not missing, f"docs/design.md's layout leaves out: {missing}"
