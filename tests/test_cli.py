"""The ``attnlab`` command line: every subcommand end to end in a subprocess on a tiny
model, outputs checked against the library computed independently here, and every bad
input answered with one ``attnlab...: error:`` line and a non-zero exit.

Subprocesses cost ~2 s of torch start-up each, so the many bad-input cases run through
``main(argv)`` in this process (the same code path minus the interpreter start); a few
of them also run as real subprocesses.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from attnlab.cli.main import main
from attnlab.presets import list_presets
from attnlab.tokenizers import train_tokenizer
from attnlab.training.checkpoint import load_checkpoint
from attnlab.training.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
WORDS = "the cat sat on a mat and dog ran far away from home while birds sang in trees".split()
TINY = [  # a 2-layer GPT-2 with a 64-token context, trained for 5 steps
    "--preset", "gpt2-tiny",
    "--set", "model.max_seq_len=64",
    "--set", "train.batch_size=4",
    "--set", "train.block_size=32",
    "--set", "train.eval_every=5",
    "--set", "train.eval_batches=2",
    "--set", "train.log_every=5",
    "--max-steps", "5",
]  # fmt: skip


def _corpus() -> str:
    g = torch.Generator().manual_seed(0)
    picks = torch.randint(len(WORDS), (200, 10), generator=g).tolist()
    return "\n".join(" ".join(WORDS[i] for i in row).capitalize() + "." for row in picks) + "\n"


def run_cli(*args: str, cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ATTNLAB_CACHE": str(cwd / "cache")}
    proc = subprocess.run(
        [sys.executable, "-m", "attnlab", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def run_main(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse usage errors and --help
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code, err: str, needle: str) -> None:
    assert code not in (0, None), err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("attnlab") and ": error: " in lines[0], lines[0]
    assert needle in lines[0], lines[0]


@contextlib.contextmanager
def watchdog(seconds: int):
    """Fail (TimeoutError) instead of hanging when the block runs longer than ``seconds``."""

    def expired(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(autouse=True)
def _restore_warning_hook(monkeypatch):
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)  # main() replaces it


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A folder with corpus.txt and run/ (a checkpoint trained by `attnlab train`)."""
    work = tmp_path_factory.mktemp("cli")
    (work / "corpus.txt").write_text(_corpus())
    proc = run_cli("train", *TINY, "--data", "corpus.txt", "--out", "run", "--quiet", cwd=work)
    (work / "train_stdout.txt").write_text(proc.stdout)
    return work


# ------------------------------------------------------------------ the happy paths


def test_train_applies_overrides_and_reports_files(work):
    stdout = (work / "train_stdout.txt").read_text()
    ckpt = load_checkpoint(work / "run")
    assert ckpt.config.model.max_seq_len == 64
    assert (ckpt.config.train.batch_size, ckpt.config.train.block_size) == (4, 32)
    assert ckpt.config.data.path == "corpus.txt"
    assert "finished at step 5" in stdout
    for name in ("metrics.jsonl", "loss.png"):
        assert (work / "run" / name).is_file()
        assert str(Path("run") / name) in stdout


def test_suggested_sample_command_works_for_the_run(work, tmp_path, capsys):
    # the "sample with:" line after training: --prompt 'The ' only where the tokenizer
    # can encode it (a char tokenizer trained on "ab" cannot), else generate's default
    from attnlab.cli.train import sample_command
    from attnlab.models import build_model
    from attnlab.tokenizers import train_tokenizer
    from attnlab.training.checkpoint import save_checkpoint

    assert sample_command(work / "run")[-2:] == ["--prompt", "The "]
    ckpt = load_checkpoint(work / "run")
    train_tokenizer("char", ["abba"]).save(tmp_path)
    assert sample_command(tmp_path) == ["attnlab", "generate", "--ckpt", tmp_path]
    ckpt.model.cfg.vocab_size = 2
    save_checkpoint(tmp_path / "ab", build_model(ckpt.model.cfg), ckpt.config,
                    train_tokenizer("char", ["abba"]))  # fmt: skip
    words = [str(word) for word in sample_command(tmp_path / "ab")[1:]]
    code, out, err = run_main([*words, "--max-new-tokens", "3", "--seed", "0"], capsys)
    assert code == 0 and err == "" and set(out) == {"a", "b", "\n"} and len(out) == 5


def test_train_config_layering(tmp_path):
    # preset < --config (partial, merged per section) < --set < --data/--seed shortcuts
    from attnlab.cli import train as train_cmd
    from attnlab.cli.main import build_parser
    from attnlab.presets import get_run_preset

    (tmp_path / "partial.json").write_text(json.dumps({"train": {"lr": 0.005, "seed": 1}}))
    argv = ["train", "--preset", "llama-tiny", "--config", str(tmp_path / "partial.json")]
    argv += ["--set", "model.n_layers=1", "--set", "train.lr=0.002", "--set", "data.path=x"]
    argv += ["--seed", "7", "--data", "corpus.txt"]
    cfg, name = train_cmd.run_config(build_parser().parse_args(argv))
    expected = get_run_preset("llama-tiny").to_dict()
    expected["model"]["n_layers"] = 1
    expected["train"].update(lr=0.002, seed=7)
    expected["data"]["path"] = "corpus.txt"
    assert cfg.to_dict() == expected
    assert name == "llama-tiny"


def test_config_file_merges_into_a_run_presets_sections(tmp_path):
    # a partial --config replaces only the fields it names: the demo's batch, schedule and
    # budget stay (a section replaced whole would fall back to TrainConfig's defaults)
    from attnlab.cli import train as train_cmd
    from attnlab.cli.main import build_parser
    from attnlab.presets import get_run_preset

    (tmp_path / "partial.json").write_text(json.dumps({"train": {"lr": 0.005}}))
    argv = ["train", "--preset", "demo", "--config", str(tmp_path / "partial.json")]
    cfg, _ = train_cmd.run_config(build_parser().parse_args(argv))
    expected = get_run_preset("demo").to_dict()
    expected["train"]["lr"] = 0.005
    assert cfg.to_dict() == expected


def test_set_with_an_object_merges_into_the_section_as_a_config_file_does(tmp_path):
    """--set model.attention={"n_heads": 4} keeps the section's other keys (it replaced the
    whole section: the preset's GQA fell back to n_kv_heads null, and every other field to
    its default), as --config with the same partial section does."""
    from attnlab.cli import train as train_cmd
    from attnlab.cli.main import build_parser
    from attnlab.presets import get_preset

    base = ["train", "--preset", "llama-tiny"]
    by_set, _ = train_cmd.run_config(
        build_parser().parse_args([*base, "--set", 'model.attention={"n_heads": 8}'])
    )
    (tmp_path / "partial.json").write_text(json.dumps({"model": {"attention": {"n_heads": 8}}}))
    by_file, _ = train_cmd.run_config(
        build_parser().parse_args([*base, "--config", str(tmp_path / "partial.json")])
    )
    assert by_set.to_dict() == by_file.to_dict()
    attention = by_set.model.attention
    assert attention.n_heads == 8
    assert attention.n_kv_heads == get_preset("llama-tiny").attention.n_kv_heads is not None


def test_train_shortcuts_and_the_default_preset(capsys, tmp_path, monkeypatch):
    """Without --preset the run is the demo's; --save-every and --task set their own
    fields, and a --set value may itself hold '='."""
    from attnlab.presets import get_run_preset

    monkeypatch.chdir(tmp_path)
    code, out, err = run_main(["train", "--print-config"], capsys)
    assert code == 0, err
    assert json.loads(out) == get_run_preset("demo").to_dict()
    argv = ["train", "--preset", "gpt2-tiny", "--save-every", "3", "--task", "lm-stream"]
    code, out, err = run_main([*argv, "--set", "data.path=a=b.txt", "--print-config"], capsys)
    assert code == 0, err
    cfg = json.loads(out)
    assert (cfg["train"]["save_every"], cfg["task"]) == (3, "lm-stream")
    assert cfg["train"]["eval_every"] == get_run_preset("gpt2-tiny").train.eval_every
    assert cfg["data"]["path"] == "a=b.txt"


def test_train_resume_continues_the_run(work, tmp_path, capsys, monkeypatch):
    shutil.copytree(work / "run", tmp_path / "run")
    monkeypatch.chdir(work)  # data.path is relative to where the run started
    monkeypatch.setenv("ATTNLAB_CACHE", str(tmp_path / "cache"))
    argv = ["train", "--resume", str(tmp_path / "run"), "--max-steps", "7", "--quiet"]
    code, out, err = run_main(argv, capsys)
    assert code == 0, err
    assert "finished at step 7" in out
    assert load_checkpoint(tmp_path / "run", with_state=True).state["step"] == 7


def test_train_resume_of_a_finished_run_says_how_to_go_on(work, tmp_path, capsys, monkeypatch):
    shutil.copytree(work / "run", tmp_path / "run")
    monkeypatch.chdir(work)
    monkeypatch.setenv("ATTNLAB_CACHE", str(tmp_path / "cache"))
    step = load_checkpoint(tmp_path / "run", with_state=True).state["step"]
    code, out, err = run_main(["train", "--resume", str(tmp_path / "run"), "--quiet"], capsys)
    assert code == 0, err
    assert "no step left to take: resume with a larger --max-steps" in out
    assert f"finished at step {step}" in out
    assert load_checkpoint(tmp_path / "run", with_state=True).state["step"] == step


def test_same_command_with_resume_appended(work, tmp_path, capsys, monkeypatch):
    """Re-running a train command with --resume appended continues the run (the folder's
    name has a space: every printed hint is an exact, quoted command)."""
    monkeypatch.chdir(work)
    monkeypatch.setenv("ATTNLAB_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "my runs" / "r"
    argv = ["train", *TINY, "--data", "corpus.txt", "--out", str(out), "--quiet"]
    code, stdout, err = run_main(argv, capsys)
    assert code == 0, err
    lines = stdout.splitlines()
    assert lines[0] == "stopped at step 5: max_steps=5 reached"
    assert f"attnlab generate --ckpt '{out}' --prompt 'The '" in stdout
    # The same command again says how to continue, as a command that runs.
    code, _, err = run_main(argv, capsys)
    assert f"attnlab train --resume '{out}'" in err
    code, stdout, err = run_main([*argv, "--resume", str(out), "--max-steps", "7"], capsys)
    assert code == 0, err
    assert "stopped at step 7: max_steps=7 reached" in stdout
    assert load_checkpoint(out, with_state=True).state["step"] == 7


def test_print_config_prints_the_resolved_config(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["train", "--preset", "demo", "--set", "train.lr=0.002", "--device", "cpu"]
    code, out, err = run_main([*argv, "--max-steps", "9", "--print-config"], capsys)
    assert code == 0, err
    cfg = json.loads(out)
    assert cfg["train"]["lr"] == 0.002 and cfg["train"]["device"] == "cpu"
    assert cfg["model"]["n_layers"] == 4 and not (tmp_path / "runs").exists()
    # An explicit --max-steps on a preset with a time budget runs those steps ...
    assert cfg["train"]["max_steps"] == 9 and cfg["train"]["time_budget"] is None
    # ... unless --time-budget is given too.
    code, out, _ = run_main(
        [*argv, "--max-steps", "9", "--time-budget", "5", "--print-config"], capsys
    )
    assert json.loads(out)["train"]["time_budget"] == 5


def test_train_sigint_saves_and_exits_130(work, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ATTNLAB_CACHE": str(work / "cache")}
    argv = [sys.executable, "-m", "attnlab", "train", *TINY, "--max-steps", "100000"]
    argv += ["--data", "corpus.txt", "--out", str(tmp_path / "run"), "--quiet"]
    proc = subprocess.Popen(argv, cwd=work, env=env, stdout=subprocess.PIPE, text=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    # The step-0 evaluation is logged once the loop, and its signal handler, has started.
    started = lambda: metrics.is_file() and metrics.read_text().strip()
    while not started() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    stdout, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, stdout
    assert "SIGINT received" in stdout and "latest" not in stdout
    lines = stdout.splitlines()
    assert lines[0].startswith("stopped at step ") and lines[0].endswith(": SIGINT received")
    assert lines[1] == f"continue with: attnlab train --resume {tmp_path / 'run'}"
    # The summary shows the latest validation loss and its step.
    assert any(" val loss " in line and "(step 0" in line for line in lines), stdout
    step = load_checkpoint(tmp_path / "run", with_state=True).state["step"]
    assert 1 <= step < 100000


@pytest.mark.parametrize("kind", ["bpe", "char", "metaspace"])
def test_streamed_text_is_the_whole_decode_from_short_windows(kind):
    """--stream prints the continuation as decoding it whole would, on random ids (byte
    tokens cut through emoji and CJK characters; SentencePiece-style spaces), while each
    step decodes only a few tokens, however long the output."""
    import random

    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    from attnlab.cli.generate import continuation, stream_text
    from attnlab.tokenizers import Tokenizer as AttnlabTokenizer

    text = (
        "The caf\u00e9 \u6771\u4eac \U0001f600 na\u00efve "
        "\u0645\u0631\u062d\u0628\u0627 x\u0301 ok. " * 20
    )
    if kind == "metaspace":  # LLaMA-style: spaces are part of the pieces
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.normalizer = normalizers.Replace(" ", "\u2581")
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        tok.decoder = decoders.Metaspace()  # drops the first piece's space, as "first" does
        tok.train_from_iterator(
            [text], trainers.BpeTrainer(vocab_size=80, special_tokens=["<unk>"])
        )
        tokenizer = AttnlabTokenizer(tok)
    else:
        tokenizer = train_tokenizer(kind, [text], vocab_size=300)
    windows = []
    decode = tokenizer.decode

    def counted(ids):
        windows.append(len(ids))
        return decode(ids)

    tokenizer.decode = counted
    rng = random.Random(0)
    ids = tokenizer.encode(text)
    for _ in range(30):
        cut, end = rng.randrange(1, 40), rng.randrange(60, len(ids))
        prompt, new = ids[max(0, cut - rng.randint(1, 6)) : cut], ids[cut:end]
        seen: list[int] = []
        windows.clear()
        streamed = "".join(stream_text(tokenizer, prompt, iter(new), seen))
        assert max(windows) <= 12  # the last few tokens, not the whole output
        whole = continuation(tokenizer, prompt, new)
        assert seen == new and streamed == whole, (prompt, new)
    # Random ids (an untrained model's): invalid UTF-8 everywhere; no piece ends in the
    # middle of a character.
    for _ in range(30):
        prompt = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 6))]
        new = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 60))]
        for piece in stream_text(tokenizer, prompt, iter(new), []):
            assert piece and not piece.endswith("\ufffd")


def test_generate_stream_matches_library_sampling(work):
    ckpt = load_checkpoint(work / "run")
    prompt = "The cat"
    expected_ids = ckpt.model.generate(
        ckpt.tokenizer.encode(prompt), 30, temperature=0.9, top_k=10, seed=3
    )
    proc = run_cli(
        "generate", "--ckpt", "run", "--prompt", prompt, "--max-new-tokens", "30",
        "--temperature", "0.9", "--top-k", "10", "--seed", "3", "--stream",
        cwd=work,
    )  # fmt: skip
    assert proc.stdout == prompt + ckpt.tokenizer.decode(expected_ids) + "\n"


def test_generate_greedy_without_cache_and_default_prompt(work, capsys):
    ckpt = load_checkpoint(work / "run")
    argv = ["generate", "--ckpt", str(work / "run"), "--temperature", "0", "--no-cache"]
    code, out, err = run_main([*argv, "--max-new-tokens", "12", "--no-compile"], capsys)
    assert code == 0, err
    start = ckpt.tokenizer.encode("\n")  # the default prompt: a newline
    greedy = ckpt.model.generate(start, 12, temperature=0.0)
    assert out == "\n" + ckpt.tokenizer.decode(greedy) + "\n"


def test_generate_with_beams_prints_the_best_beam(work, capsys):
    ckpt = load_checkpoint(work / "run")
    prompt = "The cat"
    ids = ckpt.tokenizer.encode(prompt)
    for extra in (["--max-new-tokens", "8"], []):  # without: the default length
        argv = ["generate", "--ckpt", str(work / "run"), "--prompt", prompt, "--num-beams", "3"]
        code, out, err = run_main([*argv, *extra], capsys)
        assert code == 0, err
        n = 8 if extra else min(256, ckpt.model.cfg.max_seq_len - len(ids))
        best = ckpt.model.generate(ids, n, num_beams=3)
        assert out == prompt + ckpt.tokenizer.decode(best) + "\n"


def test_generate_of_weights_that_give_nan_logits_is_one_line_and_prints_nothing(
    work, tmp_path, capsys
):
    """A checkpoint whose logits are NaN (corrupt weights, or weights overflowing float16):
    sampling and beam search each end in one error line, with nothing on stdout (the
    prompt was printed before the traceback)."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    bad = tmp_path / "nan"
    shutil.copytree(work / "run", bad)
    with safe_open(bad / "model.safetensors", "pt") as f:  # its metadata: the checkpoint id
        metadata = f.metadata()
        weights = {k: torch.full_like(f.get_tensor(k), float("nan")) for k in f.keys()}
    save_file(weights, bad / "model.safetensors", metadata=metadata)
    argv = ["generate", "--ckpt", str(bad), "--prompt", "The", "--max-new-tokens", "3"]
    for extra in ([], ["--temperature", "1.0"], ["--num-beams", "2"]):
        code, out, err = run_main([*argv, *extra], capsys)
        assert_one_line_error(code, err, "logits are not finite")
        assert out == ""


def test_generate_refuses_sampling_options_with_beams(work, capsys):
    """--num-beams searches: --top-k, --top-p or a --temperature above 0 given with it are
    refused by name (they were silently ignored); without beams the default temperature
    still applies."""
    argv = ["generate", "--ckpt", str(work / "run"), "--num-beams", "2", "--max-new-tokens", "2"]
    for extra, named in ((["--top-k", "5"], "--top-k"), (["--temperature", "0.5", "--top-p",
                         "0.9"], "--temperature, --top-p")):  # fmt: skip
        code, _, err = run_main([*argv, *extra], capsys)
        assert code == 1 and f"{named}: sampling, and --num-beams" in err
        assert len(err.strip().splitlines()) == 1
    argv = ["generate", "--ckpt", str(work / "run"), "--seed", "3", "--max-new-tokens", "40"]
    outs = [run_main([*argv, *extra], capsys) for extra in ([], ["--temperature", "0.8"])]
    assert outs[0][0] == 0 and outs[0] == outs[1]  # the default temperature is 0.8


def test_generate_gives_its_options_to_the_library(work, capsys, monkeypatch):
    """Each sampling option reaches the decode loop as given (the default temperature
    0.8, sliding, the cache), and the text is the library's for the same options."""
    from attnlab.models.decoder import DecoderLM

    seen = []
    stream = DecoderLM.stream

    def spy(self, *args, **kwargs):
        seen.append(kwargs)
        return stream(self, *args, **kwargs)

    monkeypatch.setattr(DecoderLM, "stream", spy)
    ckpt = load_checkpoint(work / "run")
    argv = ["generate", "--ckpt", str(work / "run"), "--prompt", "The", "--seed", "1"]
    code, out, err = run_main([*argv, "--max-new-tokens", "4", "--no-compile"], capsys)
    assert code == 0, err
    given = {k: seen[-1][k] for k in ("temperature", "top_k", "top_p", "seed", "use_cache")}
    assert given == dict(temperature=0.8, top_k=None, top_p=None, seed=1, use_cache=True)
    assert seen[-1]["overflow"] == "slide"
    options = ["--temperature", "0.5", "--top-k", "7", "--top-p", "0.5", "--no-cache"]
    code, out, err = run_main([*argv, *options, "--overflow", "stop", "--max-new-tokens",
                               "20"], capsys)  # fmt: skip
    assert code == 0, err
    given = {k: seen[-1][k] for k in ("temperature", "top_k", "top_p", "seed", "use_cache")}
    assert given == dict(temperature=0.5, top_k=7, top_p=0.5, seed=1, use_cache=False)
    assert seen[-1]["overflow"] == "stop"
    ids = ckpt.tokenizer.encode("The")
    new = ckpt.model.generate(ids, 20, temperature=0.5, top_k=7, top_p=0.5, seed=1)
    assert out == "The" + ckpt.tokenizer.decode(new) + "\n"


def test_stream_prints_what_the_whole_decode_prints(tmp_path, capsys):
    """--stream holds back a byte-level token that ends inside a character until it is
    whole; what is still held at the end is printed then: the output equals the
    non-streamed one (random weights: invalid UTF-8 everywhere)."""
    from attnlab.config import RunConfig
    from attnlab.models import build_model
    from attnlab.presets import get_preset
    from attnlab.training.checkpoint import save_checkpoint

    bpe = train_tokenizer("bpe", [_corpus()], vocab_size=300)
    cfg = get_preset("llama-tiny").override({"vocab_size": bpe.vocab_size, "max_seq_len": 32})
    torch.manual_seed(0)
    save_checkpoint(tmp_path, build_model(cfg), RunConfig(model=cfg), bpe)
    argv = ["generate", "--ckpt", str(tmp_path), "--prompt", "The", "--temperature", "1"]
    held = 0
    for seed in range(4):
        outs = []
        for stream in ([], ["--stream"]):
            code, out, err = run_main([*argv, "--seed", str(seed), "--max-new-tokens", "12",
                                       *stream], capsys)  # fmt: skip
            assert code == 0, err
            outs.append(out)
        assert outs[0] == outs[1]
        held += outs[0].endswith("\ufffd\n")  # the stream's last piece was held back
    assert held  # the case is met


def test_generate_plans_roll_and_stop_past_the_context():
    # roll: a bounded cache goes on past max_seq_len (no warning); stop: only the room left
    from attnlab.cli.generate import plan_length

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert plan_length([1] * 60, 10, 64, "roll") == ([1] * 60, 10)
    with pytest.warns(UserWarning, match="room for 4 new tokens"):
        assert plan_length([1] * 60, 10, 64, "stop") == ([1] * 60, 4)


def test_generate_refuses_ids_and_beams_that_do_not_fit(work, capsys):
    vocab_size = load_checkpoint(work / "run").config.model.vocab_size
    argv = ["generate", "--ckpt", str(work / "run"), "--prompt-ids", f"1,{vocab_size}"]
    code, _, err = run_main(argv, capsys)
    assert_one_line_error(code, err, f"token id {vocab_size} is outside")
    argv = ["generate", "--ckpt", str(work / "run"), "--prompt", "The", "--num-beams", "2"]
    code, _, err = run_main([*argv, "--max-new-tokens", "62"], capsys)  # 3 + 62 > 64
    assert_one_line_error(code, err, "exceed max_seq_len=64; lower --max-new-tokens")


def test_generate_and_translate_refuse_more_beams_than_vocabulary_tokens(work, tmp_path, capsys):
    """--num-beams above the model's vocabulary size (the target's for translate) is one
    error line naming the limit, before any decoding (a huge K ran out of memory after a
    long wait); K equal to the vocabulary size still searches, as the library does."""
    from attnlab.config import RunConfig
    from attnlab.models import build_model
    from attnlab.presets import get_preset
    from attnlab.training.checkpoint import save_checkpoint

    ckpt = load_checkpoint(work / "run")
    v = ckpt.model.cfg.vocab_size
    argv = ["generate", "--ckpt", str(work / "run"), "--prompt", "The", "--max-new-tokens", "1"]
    for k in (v + 1, 10**9):
        code, out, err = run_main([*argv, "--num-beams", str(k)], capsys)
        assert_one_line_error(code, err, f"--num-beams {k}: more beams than the model's")
        assert f"give --num-beams {v} or fewer" in err and out == ""
    code, out, err = run_main([*argv, "--num-beams", str(v)], capsys)
    assert code == 0, err
    best = ckpt.model.generate(ckpt.tokenizer.encode("The"), 1, num_beams=v)
    assert out == "The" + ckpt.tokenizer.decode(best) + "\n"

    cfg = get_preset("transformer-numbers")  # no tokenizer: token ids in and out
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    save_checkpoint(tmp_path, model, RunConfig(model=cfg), None)
    argv = ["translate", "--ckpt", str(tmp_path), "--source-ids", "5,6,7", "--max-new-tokens", "2"]
    code, out, err = run_main([*argv, "--num-beams", str(cfg.vocab_size + 1)], capsys)
    assert_one_line_error(code, err, f"--num-beams {cfg.vocab_size + 1}: more beams than")
    assert f"give --num-beams {cfg.vocab_size} or fewer" in err and out == ""
    code, out, err = run_main([*argv, "--num-beams", str(cfg.vocab_size)], capsys)
    assert code == 0, err
    (want,) = model.generate(torch.tensor([[5, 6, 7]]), 2, num_beams=cfg.vocab_size,
                             length_penalty=0.6, style="gnmt")  # translate's defaults  # fmt: skip
    assert out == "5,6,7\t" + ",".join(map(str, want)) + "\n"


def test_continuation_is_decoded_after_the_prompt():
    """A SentencePiece-style decoder strips the leading space of what it decodes: the
    continuation is the text the new tokens add to the prompt's, not their text alone."""
    from attnlab.cli.generate import continuation

    class Metaspace:  # "\u2581" marks a space; the decoded text's first one is dropped
        pieces = ["\u2581The", "\u2581cat", "\u2581sat", "s"]

        def decode(self, ids):
            return "".join(self.pieces[i] for i in ids).replace("\u2581", " ").removeprefix(" ")

    tok = Metaspace()
    assert tok.decode([2]) == "sat"  # alone: no space
    assert continuation(tok, [0, 1], [2, 3]) == " sats"
    assert continuation(tok, [0, 1], []) == ""


def test_a_lone_surrogate_is_a_tokenizer_error_not_a_crash():
    from attnlab.tokenizers import TokenizerError, train_tokenizer

    bpe = train_tokenizer("bpe", ["abc abd"], 300)
    with pytest.raises(TokenizerError, match="U\\+DCFF"):
        bpe.encode("a\udcff")


def _direct_loss(model, ids: list[int], block: int, n_blocks: int) -> float:
    """Mean cross-entropy over consecutive blocks, written out here."""
    total, count = 0.0, 0
    with torch.no_grad():
        for j in range(n_blocks):
            x = torch.tensor(ids[j * block : (j + 1) * block])[None]  # (1, t)
            y = torch.tensor(ids[j * block + 1 : (j + 1) * block + 1])
            logits = model(x).logits[0]  # (t, V)
            total += float(F.cross_entropy(logits, y, reduction="sum"))
            count += len(y)
    return total / count


def test_eval_json_matches_direct_loss(work):
    ckpt = load_checkpoint(work / "run")
    args = ["--batch-size", "4", "--block-size", "32", "--max-batches", "2"]
    proc = run_cli("eval", "--ckpt", "run", "--data", "corpus.txt", "--json", *args, cwd=work)
    (line,) = proc.stdout.strip().splitlines()  # exactly one JSON object
    report = json.loads(line)
    ids = ckpt.tokenizer.encode((work / "corpus.txt").read_text())
    loss = _direct_loss(ckpt.model, ids, 32, 8)  # 2 batches of 4 blocks
    assert report["tokens"] == 8 * 32
    assert report["loss"] == pytest.approx(loss, rel=1e-5)
    assert report["perplexity"] == pytest.approx(torch.tensor(loss).exp().item(), rel=1e-5)
    bits = loss / torch.tensor(2.0).log().item()
    assert report["bits_per_token"] == pytest.approx(bits, rel=1e-5)
    # A char tokenizer predicts one character per token.
    assert report["characters"] == report["tokens"]
    assert report["bits_per_char"] == pytest.approx(bits, rel=1e-5)


def test_eval_options_and_text_report_match_the_json(work, capsys):
    """--batch-size and --block-size set the blocks scored; the text report shows the JSON
    report's numbers."""
    ckpt = load_checkpoint(work / "run")
    corpus = str(work / "corpus.txt")
    argv = ["eval", "--ckpt", str(work / "run"), "--data", corpus, "--batch-size", "2"]
    argv += ["--block-size", "16", "--max-batches", "3"]  # the run's: batch 4, block 32
    code, out, err = run_main([*argv, "--json"], capsys)
    assert code == 0, err
    report = json.loads(out)
    ids = ckpt.tokenizer.encode((work / "corpus.txt").read_text())
    assert (report["tokens"], report["block_size"], report["source"]) == (6 * 16, 16, corpus)
    assert report["loss"] == pytest.approx(_direct_loss(ckpt.model, ids, 16, 6), rel=1e-5)
    code, out, err = run_main(argv, capsys)
    assert code == 0, err
    rows = {line[:16].strip(): line[16:] for line in out.splitlines()}
    assert rows["data"] == corpus
    assert rows["tokens"] == f"{report['tokens']} ({report['characters']} characters, block 16)"
    assert rows["loss"] == f"{report['loss']:.4f} nats/token"
    assert rows["perplexity"] == f"{report['perplexity']:.3f}"
    assert rows["bits/token"] == f"{report['bits_per_token']:.4f}"
    assert rows["bits/character"] == f"{report['bits_per_char']:.4f}"


def test_eval_validation_split_prints_summary(work, capsys, monkeypatch):
    monkeypatch.chdir(work)
    monkeypatch.setenv("ATTNLAB_CACHE", str(work / "cache"))
    code, out, err = run_main(["eval", "--ckpt", "run", "--max-batches", "1"], capsys)
    assert code == 0, err
    for label in ("loss", "perplexity", "bits/token", "bits/character"):
        assert any(line.startswith(label) for line in out.splitlines()), out


def test_info_json_matches_built_model(work):
    ckpt = load_checkpoint(work / "run")
    proc = run_cli(
        "info", "--ckpt", "run", "--seq-len", "50", "--batch", "3", "--dtype", "bfloat16",
        "--json",
        cwd=work,
    )  # fmt: skip
    report = json.loads(proc.stdout)
    model = ckpt.model
    assert report["parameters"]["total"] == model.num_parameters()
    assert report["parameters"]["non_embedding"] == model.num_parameters(exclude_embeddings=True)
    assert report["kv_cache_bytes"] == model.new_cache(3, 50, torch.bfloat16).nbytes
    assert report["weights_bytes"] == 2 * model.num_parameters()
    assert report["flops_per_token"]["training"] == 3 * report["flops_per_token"]["forward"]


def test_info_json_numbers_are_the_calculators(capsys):
    """Every number of info's JSON is attnlab.analysis's for the model, length, batch and
    dtype given; without --seq-len the length is max_seq_len; --set takes model fields only."""
    from attnlab import analysis
    from attnlab.presets import get_preset

    cfg = get_preset("llama-tiny")
    argv = ["info", "--preset", "llama-tiny", "--seq-len", "50", "--batch", "3"]
    code, out, err = run_main([*argv, "--dtype", "bfloat16", "--json"], capsys)
    assert code == 0, err
    report = json.loads(out)
    assert (report["seq_len"], report["batch"], report["dtype"]) == (50, 3, "bfloat16")
    assert report["flops_per_token"] == analysis.flops_per_token(cfg, 50)
    assert report["flops_per_token"] != analysis.flops_per_token(cfg, cfg.max_seq_len)
    per_token = analysis.kv_cache_bytes_per_token(cfg, torch.bfloat16)
    assert report["kv_cache_bytes_per_token"] == per_token
    assert report["kv_cache_bytes"] == analysis.kv_cache_bytes(cfg, 50, 3, torch.bfloat16)
    assert report["weights_bytes"] == analysis.weights_bytes(cfg, torch.bfloat16)
    code, out, err = run_main(["info", "--preset", "llama-tiny", "--json"], capsys)
    assert code == 0, err
    report = json.loads(out)
    assert report["seq_len"] == cfg.max_seq_len and report["dtype"] == "float32"
    assert report["flops_per_token"] == analysis.flops_per_token(cfg, cfg.max_seq_len)
    code, _, err = run_main(["info", "--preset", "llama-tiny", "--set", "train.lr=1"], capsys)
    assert_one_line_error(code, err, "--set train.lr: info only uses model.* fields")


def test_info_text_shows_the_calculators_numbers(capsys):
    """The text report: counts with thousands separators and K/M/B (10^3 steps), bytes in
    KiB/MiB/GiB (2^10 steps), each the calculator's number."""
    from attnlab import analysis
    from attnlab.presets import get_preset

    cfg = get_preset("llama-2-7b")
    argv = ["info", "--preset", "llama-2-7b", "--seq-len", "100", "--batch", "2"]
    code, out, err = run_main([*argv, "--dtype", "float16"], capsys)
    assert code == 0, err
    rows = {line[:14].strip(): line[14:] for line in out.splitlines()}
    params = analysis.count_parameters(cfg)
    assert rows["parameters"] == (
        f"{params['total']:,} total ({params['total'] / 1e9:.2f}B), "
        f"{params['non_embedding']:,} non-embedding, {params['embedding']:,} embedding"
    )
    weights = analysis.weights_bytes(cfg, torch.float16)
    assert rows["weights"] == f"{weights / 2**30:.2f} GiB in float16"
    flops = analysis.flops_per_token(cfg, 100)
    assert rows["FLOPs/token"].startswith(f"forward {flops['forward'] / 1e9:.2f}B (dense ")
    assert f"training {flops['training'] / 1e9:.2f}B (3x forward)" in rows["FLOPs/token"]
    per_token = analysis.kv_cache_bytes_per_token(cfg, torch.float16)  # 512 KiB
    total = analysis.kv_cache_bytes(cfg, 100, 2, torch.float16)  # 100 MiB
    assert rows["KV cache"] == (
        f"{per_token / 2**10:.2f} KiB per token; {total / 2**20:.2f} MiB for batch 2 x 100 "
        "tokens in float16"
    )
    code, out, err = run_main(["info", "--preset", "gpt2"], capsys)  # 124M: millions
    assert code == 0, err
    total = analysis.count_parameters(get_preset("gpt2"))["total"]
    assert f"{total:,} total ({total / 1e6:.2f}M)" in out


def test_info_of_huge_and_tiny_models_prints_scaled_numbers(capsys):
    """Past 9999.99B (counts) and 10,000 GiB (bytes) numbers are powers of ten: 1e18 layers
    printed "200960000000000.00B" and "748634338378906.25 GiB"; a sliding-window model of
    1e18 layers never finished (a loop over the layers). A tiny model prints plain numbers."""
    from decimal import Decimal

    from attnlab import analysis
    from attnlab.cli.common import parse_assignments
    from attnlab.config import RunConfig
    from attnlab.presets import get_preset

    def info(preset: str, sets: list[str]):
        with watchdog(20):
            code, out, err = run_main(
                ["info", "--preset", preset, *[a for s in sets for a in ("--set", s)]], capsys
            )
        assert code == 0, err
        cfg = RunConfig(model=get_preset(preset)).override(parse_assignments(sets)).model
        return {line[:14].strip(): line[14:] for line in out.splitlines()}, cfg

    window = ["model.attention.sliding_window=16", "model.attention.layer_pattern=LLG"]
    for preset, sets in [("demo", []), ("gpt2-tiny", window)]:
        rows, cfg = info(preset, [*sets, "model.n_layers=1e18"])
        total = analysis.count_parameters(cfg)["total"]
        assert f"{total:,} total ({Decimal(total):.2e})" in rows["parameters"]
        assert rows["weights"] == f"{Decimal(4 * total):.2e} B in float32"
        forward = analysis.flops_per_token(cfg, cfg.max_seq_len)["forward"]
        assert rows["FLOPs/token"].startswith(f"forward {Decimal(forward):.2e} (dense ")
        kv = analysis.kv_cache_bytes(cfg, cfg.max_seq_len)
        assert rows["KV cache"].endswith(
            f"; {Decimal(kv):.2e} B for batch 1 x {cfg.max_seq_len} tokens in float32"
        )
        assert "0B" not in " ".join(rows.values())  # no "200960000000000.00B"
    tiny = ["model.n_layers=1", "model.d_model=2", "model.attention.n_heads=1",
            "model.vocab_size=1", "model.max_seq_len=1", "model.ffn.hidden_dim=1"]  # fmt: skip
    rows, cfg = info("demo", tiny)
    total = analysis.count_parameters(cfg)["total"]
    assert rows["parameters"].startswith(f"{total} total ({total}), ")
    assert rows["weights"] == f"{4 * total} B in float32"


def test_info_figures_that_round_up_print_in_the_next_unit(capsys):
    """A figure that rounds up to the next unit is printed in it: 999,998 parameters are
    1.00M, not "1000.00K"; 1,048,572 bytes 1.00 MiB, not "1024.00 KiB"; 10^13 - 1 parameters
    a power of ten, not "10000.00B"."""
    from decimal import Decimal

    from attnlab import analysis
    from attnlab.cli.common import human_count, parse_assignments
    from attnlab.config import RunConfig
    from attnlab.presets import get_preset

    tiny = ["model.n_layers=1", "model.d_model=2", "model.attention.n_heads=1",
            "model.max_seq_len=1", "model.ffn.hidden_dim=1"]  # fmt: skip

    def total(vocab: int) -> int:
        sets = [*tiny, f"model.vocab_size={vocab}"]
        cfg = RunConfig(model=get_preset("demo")).override(parse_assignments(sets)).model
        return analysis.count_parameters(cfg)["total"]

    def info(vocab: int, dtype: str) -> dict[str, str]:
        sets = [*tiny, f"model.vocab_size={vocab}"]
        argv = ["info", "--preset", "demo", "--dtype", dtype]
        code, out, err = run_main([*argv, *[a for s in sets for a in ("--set", s)]], capsys)
        assert code == 0, err
        return {line[:14].strip(): line[14:] for line in out.splitlines()}

    base, step = total(1), total(2) - total(1)  # parameters grow by d_model per token
    vocab = 1 + (10**6 - 1 - base) // step  # the most parameters below 10^6
    n = total(vocab)
    assert f"{n / 1e3:.2f}" == "1000.00"
    assert f"{n:,} total ({n / 1e6:.2f}M)" in info(vocab, "float32")["parameters"]
    vocab = 1 + ((1 << 20) // 2 - 1 - base) // step  # float16 weights just below 1 MiB
    weights = 2 * total(vocab)
    assert f"{weights / 2**10:.2f}" == "1024.00"
    assert info(vocab, "float16")["weights"] == f"{weights / 2**20:.2f} MiB in float16"
    assert human_count(10**13 - 1) == f"{Decimal(10**13 - 1):.2e}"


def test_info_from_preset_and_config_file(work, capsys):
    code, out, err = run_main(["info", "--config", str(work / "run" / "config.json")], capsys)
    assert code == 0, err
    total = load_checkpoint(work / "run").model.num_parameters()
    assert f"{total:,} total" in out
    argv = ["info", "--preset", "llama-tiny", "--set", "model.n_layers=3", "--json"]
    code, out, err = run_main(argv, capsys)
    assert code == 0, err
    report = json.loads(out)
    assert report["config"]["n_layers"] == 3


def test_presets_one_line_each(tmp_path):
    proc = run_cli("presets", cwd=tmp_path)
    names = [line.split()[0] for line in proc.stdout.splitlines()]
    assert len(names) == len(set(names))
    assert set(list_presets()) <= set(names)
    assert all(len(line.split(maxsplit=1)) == 2 for line in proc.stdout.splitlines())


def test_export_and_import_hf_round_trip(work, tmp_path, capsys):
    run_cli("export-hf", str(work / "run"), str(tmp_path / "hf"), cwd=work)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (tmp_path / "hf" / name).is_file()
    run_cli("import-hf", str(tmp_path / "hf"), str(tmp_path / "back"), cwd=work)
    original, back = load_checkpoint(work / "run"), load_checkpoint(tmp_path / "back")
    idx = torch.randint(0, original.config.model.vocab_size, (2, 20))
    torch.testing.assert_close(back.model(idx).logits, original.model(idx).logits)
    assert back.tokenizer.to_json() == original.tokenizer.to_json()
    # An HF folder works directly as --ckpt too.
    argv = ["generate", "--ckpt", str(tmp_path / "hf"), "--prompt", "The", "--temperature", "0"]
    code, out, err = run_main([*argv, "--max-new-tokens", "5"], capsys)
    assert code == 0, err
    expected = original.model.generate(original.tokenizer.encode("The"), 5, temperature=0.0)
    assert out == "The" + original.tokenizer.decode(expected) + "\n"


def test_inference_needs_no_trainer_state(work, tmp_path, capsys):
    """generate, eval and export-hf work on a folder without trainer_state.pt."""
    shutil.copytree(work / "run", tmp_path / "run")
    (tmp_path / "run" / "trainer_state.pt").unlink()
    original = load_checkpoint(work / "run")
    argv = ["generate", "--ckpt", str(tmp_path / "run"), "--prompt", "The", "--temperature", "0"]
    code, out, err = run_main([*argv, "--max-new-tokens", "8"], capsys)
    assert code == 0, err
    expected = original.model.generate(original.tokenizer.encode("The"), 8, temperature=0.0)
    assert out == "The" + original.tokenizer.decode(expected) + "\n"
    argv = ["eval", "--ckpt", str(tmp_path / "run"), "--data", str(work / "corpus.txt")]
    code, out, err = run_main([*argv, "--json", "--max-batches", "1"], capsys)
    assert code == 0, err
    assert json.loads(out)["tokens"] > 0
    code, _, err = run_main(["export-hf", str(tmp_path / "run"), str(tmp_path / "hf")], capsys)
    assert code == 0, err
    assert (tmp_path / "hf" / "tokenizer.json").is_file()


def test_weight_only_hf_import_and_generate(work, tmp_path, capsys):
    """A decoder folder without tokenizer.json imports without a tokenizer; generate then
    takes --tokenizer FILE or --prompt-ids (printing ids), and says so otherwise."""
    original = load_checkpoint(work / "run")
    code, _, err = run_main(["export-hf", str(work / "run"), str(tmp_path / "hf")], capsys)
    assert code == 0, err
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "hf" / name).unlink()
    imported = tmp_path / "imported"
    code, out, err = run_main(["import-hf", str(tmp_path / "hf"), str(imported)], capsys)
    assert code == 0, err
    assert "--tokenizer" in out and "--prompt-ids" in out
    assert not (imported / "tokenizer.json").exists()
    assert load_checkpoint(imported).tokenizer is None
    base = ["generate", "--ckpt", str(imported), "--temperature", "0", "--max-new-tokens", "6"]
    code, out, err = run_main([*base, "--prompt", "The"], capsys)
    assert_one_line_error(code, err, "has no tokenizer.json")
    assert "--tokenizer FILE" in err and "--prompt-ids" in err
    code, out, err = run_main(base, capsys)  # the default prompt is text too
    assert_one_line_error(code, err, "--prompt-ids")
    ids = original.tokenizer.encode("The")
    expected = original.model.generate(ids, 6, temperature=0.0)
    tokenizer_file = str(work / "run" / "tokenizer.json")
    code, out, err = run_main([*base, "--prompt", "The", "--tokenizer", tokenizer_file], capsys)
    assert code == 0, err
    assert out == "The" + original.tokenizer.decode(expected) + "\n"
    prompt_ids = ",".join(map(str, ids))
    for stream in ([], ["--stream"]):
        code, out, err = run_main([*base, "--prompt-ids", prompt_ids, *stream], capsys)
        assert code == 0, err
        assert out == ",".join(map(str, ids + expected)) + "\n"
    # Token ids with a tokenizer: text out.
    argv = ["generate", "--ckpt", str(work / "run"), "--temperature", "0"]
    code, out, err = run_main([*argv, "--max-new-tokens", "6", "--prompt-ids", prompt_ids], capsys)
    assert code == 0, err
    assert out == "The" + original.tokenizer.decode(expected) + "\n"


def test_generate_default_length_fits_the_context(work):
    """Without --max-new-tokens the continuation fills the 64-token context, and nothing
    is written to stderr."""
    ckpt = load_checkpoint(work / "run")
    prompt = "The cat"
    proc = run_cli("generate", "--ckpt", "run", "--prompt", prompt, "--temperature", "0", cwd=work)
    assert proc.stderr == ""
    ids = ckpt.tokenizer.encode(prompt)
    expected = ckpt.model.generate(ids, 64 - len(ids), temperature=0.0)
    assert len(expected) == 64 - len(ids)
    assert proc.stdout == prompt + ckpt.tokenizer.decode(expected) + "\n"


def test_generate_default_length_is_at_most_256_tokens():
    # min(256, max_seq_len - prompt tokens): a long context is not filled by default
    from attnlab.cli.generate import plan_length

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # room enough: no warning
        assert plan_length([1, 2, 3], None, 1024, "slide") == ([1, 2, 3], 256)
        assert plan_length([1] * 800, None, 1024, "slide") == ([1] * 800, 224)
        assert plan_length([1, 2, 3], 300, 1024, "slide") == ([1, 2, 3], 300)  # explicit
    with pytest.warns(UserWarning, match="generating 256 tokens"):  # half would be 512
        assert plan_length([1] * 1024, None, 1024, "slide") == ([1] * 1024, 256)


def test_generate_default_length_when_the_prompt_fills_the_context():
    # half the context, sliding; a context of one token still generates (it gave none)
    from attnlab.cli.generate import plan_length

    with pytest.warns(UserWarning, match="generating 32 tokens"):
        assert plan_length([1] * 64, None, 64, "slide") == ([1] * 64, 32)
    with pytest.warns(UserWarning, match="generating 1 tokens"):
        assert plan_length([7], None, 1, "slide") == ([7], 1)


def test_generate_warnings_come_before_the_text(work):
    """Cropping and context-full warnings go to stderr before any text: with stderr merged
    into stdout they all precede the prompt; stdout alone holds only the text."""
    ckpt = load_checkpoint(work / "run")
    prompt = "The cat sat on a mat. " * 5  # 110 characters, 64 kept
    argv = ["generate", "--ckpt", "run", "--prompt", prompt, "--temperature", "0"]
    argv += ["--max-new-tokens", "10"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ATTNLAB_CACHE": str(work / "cache")}
    merged = subprocess.run(
        [sys.executable, "-m", "attnlab", *argv],
        cwd=work,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    assert merged.returncode == 0, merged.stdout
    with pytest.warns(UserWarning, match="max_seq_len"):  # the library says it too
        expected = ckpt.model.generate(ckpt.tokenizer.encode(prompt), 10, temperature=0.0)
    text = prompt + ckpt.tokenizer.decode(expected) + "\n"
    warning_lines = merged.stdout[: -len(text)].splitlines()
    assert merged.stdout.endswith(text), merged.stdout
    assert len(warning_lines) == 2, merged.stdout
    assert all(line.startswith("attnlab: warning: ") for line in warning_lines)
    assert "keeping its last 64" in warning_lines[0] and "slides" in warning_lines[1]
    separate = run_cli(*argv, cwd=work)
    assert separate.stdout == text
    assert separate.stderr.splitlines() == warning_lines


def test_exported_tokenizers_work_in_transformers(work, tmp_path, capsys):
    """AutoTokenizer.from_pretrained on an export encodes and decodes as attnlab does: a
    GPT-2-style char-level checkpoint (which GPT2Tokenizer would strip of spaces and
    newlines) and a LLaMA-style byte-level BPE one."""
    transformers = pytest.importorskip("transformers")
    from attnlab.config import RunConfig
    from attnlab.models import build_model
    from attnlab.presets import get_preset
    from attnlab.tokenizers import train_tokenizer
    from attnlab.training.checkpoint import save_checkpoint

    bpe_text = 'Hello, world!  It\'s (really) "fine"; ok?\n\tNew line: 3.5 + 2 = 5.5\n'
    bpe = train_tokenizer("bpe", [_corpus(), bpe_text], vocab_size=300)
    cfg = get_preset("llama-tiny").override({"vocab_size": bpe.vocab_size, "max_seq_len": 32})
    save_checkpoint(tmp_path / "bpe", build_model(cfg), RunConfig(model=cfg), bpe)
    char_text = "The cat sat on a mat.\nThe  dog ran far away.\n\nthe end. "
    cases = [(work / "run", char_text, "gpt2"), (tmp_path / "bpe", bpe_text, "llama")]
    for ckpt_dir, text, model_type in cases:
        out = tmp_path / f"hf-{ckpt_dir.name}"
        code, stdout, err = run_main(["export-hf", str(ckpt_dir), str(out)], capsys)
        assert code == 0, err
        assert "tokenizer_config.json" in stdout
        assert json.loads((out / "config.json").read_text())["model_type"] == model_type
        ours = load_checkpoint(ckpt_dir).tokenizer
        theirs = transformers.AutoTokenizer.from_pretrained(out)
        ids = ours.encode(text)
        assert theirs.encode(text) == ids
        assert theirs(text)["input_ids"] == ids
        assert theirs.decode(ids) == ours.decode(ids) == text
        assert len(theirs) == ours.vocab_size  # no token added


# ------------------------------------------------------------------ bad input

BAD_INPUTS = [
    # (argv with {work}/{tmp} placeholders, text the error line must contain)
    (["generate", "--ckpt", "{tmp}/missing"], "not found"),
    (["eval", "--ckpt", "{tmp}/corrupt"], "model.safetensors"),
    (["info", "--ckpt", "{tmp}/empty"], "is missing"),
    (["export-hf", "{tmp}/missing", "{tmp}/out"], "not found"),
    (["train", "--preset", "no-such-preset"], "no-such-preset"),
    (["info", "--preset", "no-such-preset"], "no-such-preset"),
    (["train", "--preset", "gpt2-tiny", "--set", "train.lrr=0.1"], "did you mean 'lr'"),
    (["train", "--preset", "gpt2-tiny", "--set", "train.lr=fast"], "train.lr"),
    (["train", "--preset", "gpt2-tiny", "--set", "model.n_layers"], "key=value"),
    (["train", "--preset", "gpt2-tiny", "--set", "model.n_layers=0"], "n_layers"),
    (["train", "--preset", "gpt2-tiny", "--data", "{tmp}/missing.txt"], "missing.txt"),
    (["train", "--preset", "gpt2-tiny", "--config", "{tmp}/missing.json"], "not found"),
    (["train", "--preset", "gpt2-tiny", "--config", "{tmp}/bad.json"], "not valid JSON"),
    (["train", "--preset", "gpt2-tiny", "--config", "{tmp}/typo.json"], "did you mean"),
    (["train", "--resume", "{tmp}/missing"], "not found"),
    (["train", "--preset", "gpt2-tiny", "--out", "{work}/run"], "--overwrite"),
    (
        ["train", "--resume", "{work}/run", "--preset", "gpt2-tiny"],
        "model.max_seq_len (checkpoint 64, given 128)",
    ),
    (
        ["train", "--resume", "{work}/run", "--set", "model.n_layers=3"],
        "model.n_layers (checkpoint 2, given 3)",
    ),
    (["train", "--resume", "{work}/run", "--out", "{tmp}/other"], "would overwrite it"),
    (["train", "--resume", "{work}/run", "--init-from", "{work}/run"], "exclude each other"),
    (["train", "--init-from", "{tmp}/missing"], "not found"),
    (  # the trainer keeps the checkpoint's model: a change would be silently dropped
        ["train", "--init-from", "{work}/run", "--set", "model.dropout=0.3"],
        "model.dropout (checkpoint 0.0, given 0.3)",
    ),
    (["train", "--preset", "gpt2-tiny", "--device", "tpu9"], "not a device"),
    (["train", "--preset", "gpt2-tiny", "--device", "mps"], "MPS is not available"),
    (["generate", "--ckpt", "{work}/run", "--device", "tpu9"], "--device tpu9: not a device"),
    (["eval", "--ckpt", "{work}/run", "--device", "meta"], "--device meta: the meta device"),
    (
        [
            "train",
            "--preset",
            "gpt2-tiny",
            "--device",
            "cpu",
            "--set",
            "model.attention.backend=flex",
        ],
        "model.attention.backend='flex' cannot train on cpu",
    ),
    (  # refused before the data and the first evaluation, not at the first step
        ["train", "--preset", "gpt2-tiny", "--set", "model.attention.backend=flash"]
        + ["--set", "model.attention.dropout=0.1"],
        "model.attention.backend='flash' has no attention dropout",
    ),
    (
        ["generate", "--ckpt", "{work}/run", "--tokenizer", "{tmp}/small.json", "--prompt", "a"],
        "the tokenizer has 2 tokens, the model",
    ),
    (["train", "--preset", "llama-3-8b"], "GiB for weights, gradients and AdamW state"),
    (
        ["train", "--preset", "gpt2-tiny", "--set", "train.nope=1"],
        "valid keys of train: batch_size, beta1",
    ),
    (
        ["train", "--preset", "gpt2-tiny", "--set", "model.attention.nope=1"],
        "valid keys of model.attention:",
    ),
    (["train", "--preset", "gpt2-tiny", "--max-steps", "0"], "--max-steps"),
    (["train", "--preset", "gpt2-tiny", "--task", "nope"], "unknown task; choose one of lm"),
    (["train", "--preset", "gpt2-tiny", "--set", "task=nope"], "task: unknown value 'nope'"),
    (["generate", "--ckpt", "{work}/run", "--prompt", "caf\u00e9"], "U+00E9"),
    (["generate", "--ckpt", "{work}/run", "--temperature", "-1"], "--temperature"),
    (["generate", "--ckpt", "{work}/run", "--top-p", "0"], "--top-p"),
    (["generate", "--ckpt", "{work}/run", "--top-k", "0"], "--top-k"),
    (["generate", "--ckpt", "{work}/run", "--max-new-tokens", "-3"], "--max-new-tokens"),
    (  # a decoder reads no evaluation settings (Transformer-XL's: tests/test_xl.py)
        ["generate", "--ckpt", "{work}/run", "--set", "model.mem_len=8"],
        "--set model.mem_len: generate changes only evaluation settings; a 'decoder' model "
        "has none",
    ),
    (
        ["eval", "--ckpt", "{work}/run", "--set", "model.dropout=0"],
        "--set model.dropout: eval changes only evaluation settings; a 'decoder' model has none",
    ),
    (["eval", "--ckpt", "{work}/run", "--data", "{tmp}/missing.txt"], "missing.txt"),
    (["eval", "--ckpt", "{work}/run", "--data", "{tmp}/euro.txt"], "U+20AC"),
    (
        ["import-hf", "{tmp}/hf_no_tokenizer", "{tmp}/out", "--tokenizer", "{tmp}/no.json"],
        "tokenizer not found",
    ),
    (["train", "--resume", "{tmp}/no_state"], "no trainer state (trainer_state.pt"),
    (["train", "--resume", "{tmp}/other/best"], "is the best checkpoint of the run in"),
    (["generate", "--ckpt", "{work}/run", "--prompt-ids", "1,x"], "expected token ids"),
    (["generate", "--ckpt", "{work}/run", "--prompt-ids", "1,99999"], "token id 99999"),
    (["generate", "--ckpt", "{work}/run", "--prompt", "a", "--prompt-ids", "1"], "not allowed"),
    (["generate", "--ckpt", "{work}/run", "--tokenizer", "{tmp}/no.json"], "not found"),
    (["eval", "--ckpt", "{work}/run", "--tokenizer", "{tmp}/bad.json"], "--tokenizer"),
    (["info", "--config", "{tmp}/bad.json"], "not valid JSON"),
    (["no-such-command"], "no-such-command"),
    (["train", "--preset", "gpt2-tiny", "--out", "{tmp}/bad.json"], "is not a folder"),
    (["train", "--preset", "gpt2-tiny", "--out", "{tmp}/weights_only"], "--overwrite"),
    (["train", "--preset", "gpt2-tiny", "--seed", "18446744073709551616"], "--seed"),
    (["train", "--preset", "gpt2-tiny", "--set", "train.lr=Infinity"], "train.lr: must be finite"),
    (["generate", "--ckpt", "{work}/run", "--seed", "18446744073709551616"], "--seed"),
    (  # the option, not the library's length_penalty
        ["generate", "--ckpt", "{work}/run", "--num-beams", "2", "--length-penalty", "nan"],
        "argument --length-penalty: must be a finite number, got 'nan'",
    ),
    # options of a decoding the command does not do were silently ignored
    (
        ["generate", "--ckpt", "{work}/run", "--length-penalty", "2"],
        "--length-penalty applies to beam search; give --num-beams K",
    ),
    (
        ["generate", "--ckpt", "{work}/run", "--early-stopping", "false"],
        "--early-stopping applies to beam search; give --num-beams K",
    ),
    (["generate", "--ckpt", "{work}/run", "--num-beams", "2", "--no-cache"], "--no-cache: beam"),
    (["generate", "--ckpt", "{work}/run", "--num-beams", "2", "--compile"], "--compile: beam"),
    (  # was overflow='roll' ... use_cache=True, the library's names
        ["generate", "--ckpt", "{work}/run", "--overflow", "roll"],
        "--overflow roll needs relative positions (rope, none, alibi or relative_bias): a "
        "rolling cache keeps no "
        "absolute ones; this model uses 'learned' positions: use --overflow slide or stop",
    ),
    (
        ["generate", "--ckpt", "{work}/run", "--overflow", "roll", "--no-cache"],
        "--overflow roll decodes with a rolling cache; drop --no-cache",
    ),
    (["translate", "--ckpt", "{tmp}/missing", "1", "--length-penalty", "1"], "--length-penalty"),
    (["translate", "--ckpt", "{tmp}/missing", "1", "--beam-style", "gnmt"], "--beam-style applies"),
    (
        ["translate", "--ckpt", "{tmp}/missing", "1", "--early-stopping", "never"],
        "--early-stopping applies to beam search; give --num-beams K (K > 1)",
    ),
    (
        ["translate", "--ckpt", "{tmp}/missing", "1", "--num-beams", "2"]
        + ["--early-stopping", "false"],
        "--early-stopping applies to --beam-style transformers (gnmt, the default, stops when no "
        "live beam can beat the finished ones)",
    ),
    (
        ["translate", "--ckpt", "{tmp}/missing", "1", "--num-beams", "2", "--length-penalty", "-1"],
        "--length-penalty -1: gnmt beam scoring (--beam-style gnmt, the default) takes A >= 0",
    ),
    (  # was "run/trainer_state.pt: cannot read trainer state safely (... cpu:1 ...)"
        ["generate", "--ckpt", "{work}/run", "--device", "cpu:1"],
        "--device cpu:1: the CPU device has no index; use cpu",
    ),
    # a path that is neither a regular file nor a folder (was "no .txt or .md files under the
    # folder /dev/null"; a FIFO given as a JSON file was read and waited for a writer)
    (
        ["train", "--preset", "gpt2-tiny", "--data", "/dev/null"],
        "--data /dev/null: is a character device, not a text file or a folder",
    ),
    (["train", "--preset", "gpt2-tiny", "--data", "{tmp}/fifo"], "is a named pipe (FIFO), not a"),
    (["eval", "--ckpt", "{work}/run", "--data", "/dev/null"], "--data /dev/null: is a character"),
    (["eval", "--ckpt", "{work}/run", "--data", "{tmp}/empty"], "--data: no .txt or .md files"),
    (
        ["train", "--preset", "gpt2-tiny", "--config", "{tmp}/fifo"],
        "fifo: is a named pipe (FIFO), not a regular file; give a JSON config file",
    ),
    (["info", "--config", "/dev/null"], "/dev/null: is a character device, not a regular file"),
    (["info", "--ckpt", "/dev/null"], "is a character device, not a folder; give a checkpoint"),
    (
        ["import-hf", "{tmp}/hf_no_tokenizer", "{tmp}/out", "--tokenizer", "/dev/null"],
        "--tokenizer /dev/null: is a character device, not a file",
    ),
    # an empty path was the current folder: read as the corpus, written into by export-hf
    (["train", "--preset", "gpt2-tiny", "--data", ""], "argument --data: expected a path"),
    (["train", "--preset", "gpt2-tiny", "--set", "data.path="], "data.path: is empty"),
    (["train", "--preset", "gpt2-tiny", "--out", ""], "argument --out: expected a path"),
    (["export-hf", "{work}/run", ""], "argument OUT: expected a path, got ''"),
    (["generate", "--ckpt", ""], "argument --ckpt: expected a path"),
    # sizes past what torch counts, and models too deep to build (info, kv and train's
    # memory check build them on the meta device: 1e18 layers never ended)
    (["info", "--preset", "demo", "--set", "model.d_model=1e300"], "must be from -2**63 to"),
    (["info", "--preset", "xl-tiny", "--set", "model.d_model=1e12"], "more elements than torch"),
    (["info", "--preset", "xl-tiny", "--set", "model.n_layers=1e18"], "at most 10,000 layers"),
    (["kv", "--preset", "deepseek-v3", "--set", "model.n_layers=1e18"], "at most 10,000 layers"),
    (  # a cache measured on the meta device (linear attention's state): a torch traceback
        ["info", "--preset", "gpt2-tiny", "--set", "model.attention.kind=linear"]
        + ["--seq-len", "100000000000000000", "--batch", "1000000000"],
        "a KV cache of batch 1000000000 x 100000000000000000 tokens would have more elements",
    ),
    (
        ["train", "--preset", "gpt2-tiny", "--set", "train.grad_accum=1e18"],
        "train.grad_accum: 12 x 1000000000000000000 accumulated sequences per step exceed",
    ),
    (["--threads", "100000000000000000000", "presets"], "--threads must be at most"),
    (  # was the line "Overflow when unpacking long long", naming nothing
        ["eval", "--ckpt", "{work}/run", "--batch-size", "100000000000000000000"],
        "argument --batch-size: must be at most 2**63 - 1",
    ),
    (["import-hf", "{tmp}/hf_no_tokenizer", "{tmp}/other"], "holds a training run"),
    (["import-hf", "{tmp}/hf_no_tokenizer", "{tmp}/bad.json"], "is not a folder"),
    (["export-hf", "{work}/run", "{tmp}/other"], "holds an attnlab checkpoint"),
]


@pytest.fixture
def bad_files(work, tmp_path) -> Path:
    shutil.copytree(work / "run", tmp_path / "corrupt")
    shutil.copytree(work / "run", tmp_path / "other")  # another run's folder
    weights = tmp_path / "corrupt" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "typo.json").write_text(json.dumps({"train": {"batch_sise": 4}}))
    (tmp_path / "euro.txt").write_text("The cat costs 5 \u20ac.\n")
    shutil.copytree(work / "run", tmp_path / "no_state")
    (tmp_path / "no_state" / "trainer_state.pt").unlink()
    (tmp_path / "weights_only").mkdir()  # checkpoint files but no config.json
    shutil.copy(work / "run" / "model.safetensors", tmp_path / "weights_only")
    (tmp_path / "hf_no_tokenizer").mkdir()
    (tmp_path / "hf_no_tokenizer" / "config.json").write_text('{"model_type": "gpt2"}')
    train_tokenizer("char", ["a "]).save(tmp_path / "small.json")  # fewer tokens than the model
    os.mkfifo(tmp_path / "fifo")  # whose reader waits for a writer: never one here
    return tmp_path


@pytest.mark.parametrize("argv,needle", BAD_INPUTS, ids=[" ".join(a[:3]) for a, _ in BAD_INPUTS])
def test_bad_input_is_one_error_line(argv, needle, work, bad_files, capsys, monkeypatch):
    monkeypatch.chdir(bad_files)
    argv = [a.format(work=work, tmp=bad_files) for a in argv]
    with watchdog(60):  # some of them hung (a FIFO read, 1e18 layers built)
        code, out, err = run_main(argv, capsys)
    assert_one_line_error(code, err, needle)
    assert not (bad_files / "runs").exists()  # nothing started


def test_import_and_export_replace_only_their_own_output(work, tmp_path, capsys):
    # Each writes into a new folder or over its own earlier output, never over a training
    # run, a model folder of the other kind, or a config.json of neither.
    run = tmp_path / "run"
    shutil.copytree(work / "run", run)
    hf, ckpt, user = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "mine"
    for _ in range(2):  # the second time over its own output
        assert run_main(["export-hf", str(run), str(hf)], capsys)[0] == 0
        assert run_main(["import-hf", str(hf), str(ckpt)], capsys)[0] == 0
    user.mkdir()
    (user / "config.json").write_text('{"my": "settings"}')
    hf2 = tmp_path / "hf2"
    shutil.copytree(hf, hf2)
    foreign = tmp_path / "foreign"  # a model folder saved by another tool: no marker
    shutil.copytree(hf, foreign, ignore=shutil.ignore_patterns(".attnlab-export"))
    loose = tmp_path / "loose"  # weights of the user's own, no config
    loose.mkdir()
    shutil.copy(hf / "model.safetensors", loose / "model.safetensors")

    def files() -> dict[Path, bytes]:
        return {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}

    before = files()
    for argv, needle in [
        (["import-hf", str(hf), str(run)], "holds a training run"),
        (["import-hf", str(hf), str(hf2)], "holds a Hugging Face model folder"),
        (["import-hf", str(hf), str(user)], "config.json that is not an attnlab"),
        (["export-hf", str(run), str(ckpt)], "holds an attnlab checkpoint"),
        (["export-hf", str(run), str(user)], "config.json that is not a Hugging Face"),
        # it replaced that model's config and weights and deleted its tokenizer files
        (["export-hf", str(run), str(foreign)], "Hugging Face model that export-hf did not"),
        (["export-hf", str(run), str(loose)], "files an export writes (model.safetensors)"),
    ]:
        code, _, err = run_main(argv, capsys)
        assert_one_line_error(code, err, needle)
    assert files() == before


def test_inputs_of_the_wrong_kind_are_named_as_such(work, tmp_path, capsys):
    """An HF folder given to export-hf, a folder given as a --tokenizer file: the error
    said "invalid run config (activation_function: unknown key ...)" and "tokenizer file
    not found" (it exists)."""
    hf = tmp_path / "hf"
    assert run_main(["export-hf", str(work / "run"), str(hf)], capsys)[0] == 0
    code, _, err = run_main(["export-hf", str(hf), str(tmp_path / "again")], capsys)
    assert_one_line_error(code, err, "is a Hugging Face model folder already")
    assert "import-hf" in err and not (tmp_path / "again").exists()
    argv = ["generate", "--ckpt", str(work / "run"), "--prompt", "a", "--tokenizer"]
    code, _, err = run_main([*argv, "/dev/null"], capsys)
    assert_one_line_error(code, err, "not a regular file")


def test_train_refuses_a_folder_with_files_it_would_replace(tmp_path, capsys):
    """A folder without a checkpoint but with a metrics.jsonl or loss.png of the user's
    own: training there replaced them (rc 0); --overwrite still may."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"mine": 1}\n')
    (out / "notes.txt").write_text("kept")
    argv = ["train", "--preset", "gpt2-tiny", "--max-steps", "1", "--quiet", "--out", str(out)]
    code, _, err = run_main(argv, capsys)
    assert_one_line_error(code, err, "holds metrics.jsonl, which the run would replace")
    assert (out / "metrics.jsonl").read_text() == '{"mine": 1}\n'


def test_bad_input_in_a_real_process(work, tmp_path):
    # The same promise from the installed entry point: no traceback, one line, exit != 0.
    for args, needle in [
        (["generate", "--ckpt", "run", "--prompt", "\u20ac"], "U+20AC"),
        (["train", "--preset", "gpt2-tiny", "--set", "model.d_model=abc"], "model.d_model"),
    ]:
        proc = run_cli(*args, cwd=work, check=False)
        assert_one_line_error(proc.returncode, proc.stderr, needle)


# ------------------------------------------------------------------ fine-tuning


def test_init_from_with_a_lower_lr_keeps_min_lr_a_tenth_of_it(work, capsys):
    # Fine-tuning's min_lr is a tenth of its lr; a --set train.lr below the default min_lr
    # failed on "train.min_lr: must be <= train.lr", a setting the user never gave.
    argv = ["train", "--init-from", str(work / "run"), "--print-config"]
    code, out, err = run_main([*argv, "--set", "train.lr=1e-6"], capsys)
    assert code == 0, err
    train_cfg = json.loads(out)["train"]
    assert (train_cfg["lr"], train_cfg["min_lr"]) == (1e-6, pytest.approx(1e-7))
    code, out, err = run_main([*argv, "--set", "train.lr=1e-6", "--set", "train.min_lr=0"], capsys)
    assert code == 0, err
    assert json.loads(out)["train"]["min_lr"] == 0


def test_init_from_defaults_are_the_fine_tuning_config(work, capsys):
    """--init-from DIR alone: the checkpoint's config with a tenth of its lr (min_lr a tenth
    of that), 10 warm-up steps, 200 steps, no time budget and no data path; the default
    output folder is runs/<its name>-finetuned."""
    from attnlab.cli import train as train_cmd
    from attnlab.cli.main import build_parser
    from attnlab.training.trainer import FINETUNE_MAX_STEPS, FINETUNE_WARMUP_STEPS

    trained = load_checkpoint(work / "run").config
    code, out, err = run_main(["train", "--init-from", str(work / "run"), "--print-config"], capsys)
    assert code == 0, err
    cfg = json.loads(out)
    assert cfg["train"]["lr"] == pytest.approx(trained.train.lr / 10)
    assert cfg["train"]["min_lr"] == pytest.approx(trained.train.lr / 100)
    assert (cfg["train"]["warmup_steps"], cfg["train"]["max_steps"]) == (10, 200)
    assert (FINETUNE_WARMUP_STEPS, FINETUNE_MAX_STEPS) == (10, 200)  # as --help says
    assert cfg["train"]["time_budget"] is None and cfg["data"]["path"] is None
    assert cfg["model"] == trained.model.to_dict()
    args = build_parser().parse_args(["train", "--init-from", str(work / "run")])
    assert train_cmd.run_config(args)[1] == "run-finetuned"


def test_init_from_fine_tunes_an_imported_hf_model(tmp_path, capsys, monkeypatch):
    """`attnlab train --init-from HF_FOLDER --data FILE`: a tiny random LLaMA saved by
    transformers (vocabulary padded past its tokenizer's, as Qwen2 / Llama 3 do) is
    fine-tuned on a small text; the loss falls and the export loads in transformers."""
    transformers = pytest.importorskip("transformers")
    from attnlab.tokenizers import train_tokenizer

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ATTNLAB_CACHE", str(tmp_path / "cache"))
    (tmp_path / "small.txt").write_text(_corpus())
    tokenizer = train_tokenizer("char", [_corpus()])
    config = transformers.LlamaConfig(
        vocab_size=tokenizer.vocab_size + 5,  # padded embedding
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    tokenizer.save(tmp_path / "hf" / "tokenizer.json")
    argv = ["train", "--init-from", "hf", "--data", "small.txt", "--out", "ft", "--quiet"]
    argv += ["--max-steps", "60", "--set", "train.lr=3e-3", "--set", "train.eval_every=30"]
    argv += ["--set", "train.batch_size=8", "--set", "train.block_size=32"]
    code, out, err = run_main(argv, capsys)
    assert code == 0, err
    val = [r for r in read_metrics(tmp_path / "ft" / "metrics.jsonl") if r["kind"] == "val"]
    assert val[0]["step"] == 0 and val[-1]["step"] == 60
    assert val[-1]["val_loss"] < val[0]["val_loss"] - 0.5
    ckpt = load_checkpoint(tmp_path / "ft", with_state=True)
    assert ckpt.config.model.vocab_size == tokenizer.vocab_size + 5
    assert ckpt.tokenizer.to_json() == tokenizer.to_json()
    assert ckpt.state["step"] == 60  # a fresh schedule, counted from 0
    code, out, err = run_main(["export-hf", "ft", "exported"], capsys)
    assert code == 0, err
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported").eval()
    ids = torch.tensor([tokenizer.encode("The cat sat")])
    with torch.no_grad():
        theirs = model(ids).logits
        mine = ckpt.model(ids).logits
    torch.testing.assert_close(theirs, mine, rtol=1e-4, atol=1e-4)


def test_finetune_defaults_and_python_api(tmp_path):
    from attnlab.presets import get_run_preset
    from attnlab.training import train
    from attnlab.training.trainer import finetune_config

    base = get_run_preset("demo")
    ft = finetune_config(base)
    assert ft.train.lr == pytest.approx(base.train.lr / 10) and ft.train.time_budget is None
    assert ft.train.warmup_steps <= 10 and ft.model == base.model
    (tmp_path / "t.txt").write_text(_corpus())
    cfg = get_run_preset("gpt2-tiny").override(
        {"model.max_seq_len": 32, "data.path": str(tmp_path / "t.txt"), "train.eval_every": 0}
    )
    first = train(cfg, tmp_path / "a", max_steps=3, progress=False)
    again = train(cfg, tmp_path / "b", max_steps=2, progress=False, init_from=first.out_dir)
    assert again.step == 2
    weights = load_checkpoint(tmp_path / "b").model.state_dict()
    assert weights.keys() == load_checkpoint(tmp_path / "a").model.state_dict().keys()


def test_threads_option_sets_torch_threads(capsys, monkeypatch):
    """``attnlab --threads N`` sets torch's thread count before the subcommand runs; a
    count below 1 is one usage error."""
    import torch

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # conftest runs tests on one thread: 1 would prove nothing
        code, out, _ = run_main(["--threads", "1", "presets"], capsys)
        assert code == 0 and out and torch.get_num_threads() == 1
        code, _, err = run_main(["--threads", "0", "presets"], capsys)
        assert_one_line_error(code, err, "--threads must be a positive integer")
    finally:
        torch.set_num_threads(before)


def test_interrupt_and_os_errors_are_one_line_each(capsys, monkeypatch, tmp_path):
    """Ctrl-C in a command exits 130 (128 + SIGINT) with one line; an OSError names its
    file."""
    from attnlab.cli import presets as presets_cmd
    from attnlab.cli.main import _error_line

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(presets_cmd, "run", interrupted)  # the handler main's parser takes
    code, out, err = run_main(["presets"], capsys)
    assert (code, out, err) == (130, "", "attnlab: interrupted\n")
    missing = tmp_path / "gone.txt"
    try:
        missing.read_text()
    except OSError as e:
        assert _error_line(e) == f"{missing}: No such file or directory"


def test_sizes_too_large_are_one_error_line_and_other_runtime_errors_keep_their_traceback(
    capsys, monkeypatch
):
    """A size too large for the machine (torch's CPU allocator failing: batch_size=1e18 in
    training, a demo's counts) or for torch's int64 (translate --max-new-tokens 2**63 - 1
    sized a cache of one more) was a traceback, or the line "Overflow when unpacking long
    long"; it is one line naming the command. Other RuntimeErrors are bugs and still raise."""
    from attnlab.cli import presets as presets_cmd

    def failing(message: str, kind: type = RuntimeError):
        def run(args):
            raise kind(message)

        return run

    for kind in (TypeError, ValueError):  # torch's argument parsing raises either
        overflow = "zeros(): argument 'size' failed to unpack ... Overflow when unpacking long"
        monkeypatch.setattr(presets_cmd, "run", failing(overflow, kind))
        code, out, err = run_main(["presets"], capsys)
        assert_one_line_error(code, err, "a size past torch's int64 (2**63 - 1), made of the")

    oom = ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
           "memory: you tried to allocate 400000000000 bytes. Error code 12 (Cannot allocate "
           "memory)")  # fmt: skip
    monkeypatch.setattr(presets_cmd, "run", failing(oom))
    code, out, err = run_main(["presets"], capsys)
    assert_one_line_error(code, err, "out of memory: a tensor (372.53 GiB at once) does not fit")
    assert "give presets smaller sizes" in err
    monkeypatch.setattr(presets_cmd, "run", failing("a bug"))
    with pytest.raises(RuntimeError, match="a bug"):
        main(["presets"])


def test_argument_types_and_device_resolution(monkeypatch):
    """Seeds take torch's whole range (negative ones too); --device auto picks CUDA where
    there is one, and an explicit cuda is refused where there is none or the index is
    beyond the machine's GPUs."""
    import argparse

    from attnlab.cli.common import CLIError, resolve_device, seed_int

    assert seed_int("-5") == -5 and seed_int(str(-(2**63))) == -(2**63)
    with pytest.raises(argparse.ArgumentTypeError):
        seed_int(str(-(2**63) - 1))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto") == "cuda" and resolve_device("cuda:1") == "cuda:1"
    with pytest.raises(CLIError, match=r"--device cuda:2: this machine has 2 GPU\(s\), cuda:0 to"):
        resolve_device("cuda:2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu"
    with pytest.raises(CLIError, match="--device cuda: CUDA is not available"):
        resolve_device("cuda")


def test_eval_reads_invalid_utf8_as_its_errors_option_says(work, tmp_path, capsys):
    """eval has no --set: its error names its own --errors option, which then reads the bad
    byte as U+FFFD (here a character the char tokenizer never saw: refused by name)."""
    bad = tmp_path / "bad.txt"
    bad.write_bytes(_corpus()[:200].encode() + b"\xff" + _corpus()[:200].encode())
    argv = ["eval", "--ckpt", str(work / "run"), "--data", str(bad)]
    code, _, err = run_main(argv, capsys)
    assert code == 1 and "not valid UTF-8" in err and "give --errors replace" in err
    code, _, err = run_main([*argv, "--errors", "replace"], capsys)
    assert code == 1 and "U+FFFD" in err and "not in the vocabulary" in err
    # without --data it would change nothing: refused by name, not ignored
    code, _, err = run_main(["eval", "--ckpt", str(work / "run"), "--errors", "replace"], capsys)
    assert_one_line_error(code, err, "--errors applies to the text of --data")


@pytest.mark.parametrize(
    "argv, blocked, needle",
    [
        (["train", "--preset", "gru-numbers"], "num2words", "pip install num2words"),
        (["train", "--preset", "vit-digits"], "sklearn.datasets", "pip install scikit-learn"),
    ],
)
def test_a_missing_package_is_one_error_line(argv, blocked, needle, tmp_path, capsys, monkeypatch):
    """A lazily imported dependency that is not installed is one line naming what to
    install, not a traceback; an attnlab module that fails to import stays a bug."""
    from attnlab.cli.main import _missing_package

    monkeypatch.setitem(sys.modules, blocked, None)  # import raises ModuleNotFoundError
    argv = [*argv, "--max-steps", "1", "--out", str(tmp_path / "run")]
    code, _, err = run_main(argv, capsys)
    assert_one_line_error(code, err, needle)
    assert _missing_package(ModuleNotFoundError("no", name="attnlab.nn.nope")) is None
