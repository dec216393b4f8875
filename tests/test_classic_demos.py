"""``attnlab demo``: each demo end to end at small sizes (through ``main``, in process), the
numbers they print checked against independent computations, and bad input answered with
one error line and a non-zero exit."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnlab.cli.main import main
from attnlab.demos import DEMOS
from attnlab.demos.sqrt_dk import measure, softmax_jacobian
from attnlab.demos.temperature import entropy, quick_run, sweep

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def table_rows(text: str, first_cell: str) -> list[list[str]]:
    """The rows of a printed table whose first cell is ``first_cell`` (split on 2+ spaces)."""
    import re

    rows = [re.split(r"\s{2,}", line.strip()) for line in text.splitlines()]
    return [r for r in rows if r and r[0] == first_cell]


def assert_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_MAGIC, path


def test_demo_without_name_lists_every_demo(capsys):
    assert main(["demo"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == list(DEMOS)
    assert all(len(line.split(None, 1)[1]) > 10 for line in lines)  # a description each


def test_unknown_demo_is_one_line_on_stderr_and_nonzero_exit(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "attnlab", "demo", "no-such-demo"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "error" in lines[0] and "no-such-demo" in lines[0]


def test_kernel_regression_demo(tmp_path, capsys):
    code = main([
        "demo", "kernel-regression", "--out", str(tmp_path), "--n-train", "40",
        "--n-test", "30", "--steps", "60",
    ])  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    assert_png(tmp_path / "kernel_regression.png")
    mse = {r[0]: float(r[-1]) for r in table_rows(out, "mean of y (baseline)")}
    for name in ("fixed gaussian", "fixed boxcar", "fixed epanechnikov", "learned gaussian (LOO)"):
        [row] = table_rows(out, name)
        mse[name] = float(row[-1])
    assert all(
        v < mse["mean of y (baseline)"] for k, v in mse.items() if k != "mean of y (baseline)"
    )  # noqa: E501


def test_kernel_regression_demo_errors_are_against_the_d2l_function(tmp_path, capsys):
    """The printed test MSEs, recomputed here: the data of d2l.ai 11.2 (x ~ U(0, 5) drawn
    from the seed, y = 2 sin(x) + x^0.8 + noise), the mean of y and a Nadaraya-Watson
    estimate with Gaussian weights exp(-((x - x_i) / h)^2 / 2) over an even grid of [0, 5]."""
    n, n_test, h, noise = 40, 30, 0.5, 0.5
    code = main([
        "demo", "kernel-regression", "--out", str(tmp_path), "--n-train", str(n), "--n-test",
        str(n_test), "--steps", "1", "--seed", "5", "--bandwidth", str(h), "--noise", str(noise),
    ])  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    g = torch.Generator().manual_seed(5)
    x = torch.sort(torch.rand(n, generator=g) * 5).values.double()
    y = 2 * torch.sin(x) + x**0.8 + noise * torch.randn(n, generator=g).double()
    grid = torch.linspace(0, 5, n_test, dtype=torch.float64)
    truth = 2 * torch.sin(grid) + grid**0.8
    weights = torch.exp(-(((grid[:, None] - x[None, :]) / h) ** 2) / 2)  # (n_test, n)
    estimate = (weights / weights.sum(1, keepdim=True)) @ y
    for name, pred in (("mean of y (baseline)", y.mean()), ("fixed gaussian", estimate)):
        [row] = table_rows(out, name)
        assert float(row[-1]) == pytest.approx(((pred - truth) ** 2).mean().item(), rel=1e-3)


def test_kernel_regression_demo_prints_the_leave_one_out_error_of_the_learned_bandwidth(
    tmp_path, capsys
):
    """The printed leave-one-out MSEs, recomputed here at the bandwidths printed beside them
    (1.0 before training, the learned h after): after one Adam step the demo printed the
    error before that step (the same figure twice, 0.7787 -> 0.7787, with h 1.0 -> 0.9512),
    not the error of the bandwidth it reported (0.7466)."""
    import re

    n, noise = 50, 0.5
    argv = ["demo", "kernel-regression", "--out", str(tmp_path), "--steps", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    match = re.search(r"learned bandwidth: 1\.0 -> (\S+) in 1 Adam steps, leave-one-out MSE "
                      r"(\S+) -> (\S+)", out)  # fmt: skip
    assert match, out
    h, before, after = (float(v) for v in match.groups())
    g = torch.Generator().manual_seed(0)
    x = torch.sort(torch.rand(n, generator=g) * 5).values.double()
    y = 2 * torch.sin(x) + x**0.8 + noise * torch.randn(n, generator=g).double()

    def loo(bandwidth: float) -> float:  # each point from all the others, Gaussian weights
        w = torch.exp(-(((x[:, None] - x[None, :]) / bandwidth) ** 2) / 2).fill_diagonal_(0)
        return (((w / w.sum(1, keepdim=True)) @ y - y) ** 2).mean().item()

    assert before == pytest.approx(loo(1.0), rel=1e-3)
    assert after == pytest.approx(loo(h), rel=1e-3)
    assert abs(loo(h) - loo(1.0)) > 0.01 * loo(1.0)  # the two figures differ at 4 digits


def test_bahdanau_demo_counts_the_epochs_it_trained(tmp_path, capsys, monkeypatch):
    """55 training numbers in batches of 32 are 2 steps an epoch: 3 steps are 1.5 epochs
    (a pass stopped part-way was counted whole: "2 epochs"). A clock that ticks once per
    reading makes the time budget a number of steps."""
    import itertools
    import types

    from attnlab.demos import bahdanau

    ticks = itertools.count()
    monkeypatch.setattr(bahdanau, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))
    argv = ["demo", "bahdanau", "--out", str(tmp_path), "--seconds", "5", "--max-number", "60",
            "--n-test", "5", "--hidden", "8", "--beam", "2"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "55 training numbers below 60, 5 held out; 3 steps (1.5 epochs)" in out


def test_temperature_demo_encodes_the_prompt_as_generate_does(tmp_path, capsys):
    """A LLaMA-style tokenizer puts <s> before a text, as ``generate --prompt`` and
    transformers' ``tokenizer(text)`` encode it: the distribution shown is the one
    generation samples from (before, the prompt lacked <s>: another distribution)."""
    from oracle import llama_style_tokenizer

    from attnlab.config import RunConfig
    from attnlab.models import build_model
    from attnlab.tokenizers import Tokenizer
    from attnlab.training.checkpoint import save_checkpoint

    tokenizer = Tokenizer(llama_style_tokenizer("the cat sat on the mat. " * 20, vocab_size=40))
    cfg = quick_run(1, seed=0).model
    cfg.vocab_size = tokenizer.vocab_size
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    with torch.no_grad():  # weights far from the init: a peaked next-token distribution
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    save_checkpoint(tmp_path / "ckpt", model, RunConfig(model=cfg), tokenizer)
    prompt = "the cat"
    argv = ["demo", "temperature", "--out", str(tmp_path / "fig"), "--ckpt",
            str(tmp_path / "ckpt"), "--prompt", prompt]  # fmt: skip
    assert main(argv) == 0
    printed = float(table_rows(capsys.readouterr().out, "1")[1][1])  # tau = 1, the model's

    def entropy_after(ids: list[int]) -> float:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].double()
        return torch.distributions.Categorical(logits=logits).entropy().item()

    bos = tokenizer.hf.token_to_id("<s>")
    with_bos = entropy_after(tokenizer.hf.encode(prompt).ids)  # transformers' tokenizer(text)
    assert tokenizer.hf.encode(prompt).ids[0] == bos
    assert printed == pytest.approx(with_bos, rel=1e-3)
    assert entropy_after(tokenizer.encode(prompt)) != pytest.approx(with_bos, rel=1e-2)
    # a prompt the tokenizer cannot encode is one error line naming --prompt
    capsys.readouterr()
    assert main([*argv[:-1], "\ud800"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--prompt" in err[0], err


def test_bahdanau_demo_scores():
    from attnlab.demos.bahdanau import char_accuracy, exact

    assert exact(["one", "two", "si"], ["one", "twO", "six"]) == pytest.approx(1 / 3)
    # position by position over the longer of each pair: 2 of 3, then 2 of 4
    assert char_accuracy(["abc", "ab"], ["abd", "abcd"]) == pytest.approx(4 / 7)
    assert char_accuracy(["xbcde"], ["abc"]) == pytest.approx(2 / 5)


def test_sqrt_dk_demo_prints_variances_near_d_and_one(tmp_path, capsys):
    argv = ["demo", "sqrt-dk", "--out", str(tmp_path), "--d-max", "64", "--n-rows", "200"]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # the demos run their small tensors on one thread
        code = main(argv)
        assert code == 0 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    out = capsys.readouterr().out
    assert main([*argv, "--seed", "0"]) == 0  # the default seed
    assert capsys.readouterr().out == out
    assert_png(tmp_path / "sqrt_dk.png")
    for d in (1, 8, 64):
        [row] = table_rows(out, str(d))
        var_raw, var_scaled = float(row[1]), float(row[2])
        # 200 x 64 samples of a product of normals: the sample variance is within ~5%
        assert abs(var_raw / d - 1) < 0.15 and abs(var_scaled - 1) < 0.15


def test_sqrt_dk_demo_measures_d_max_itself_when_it_is_not_a_power_of_two(tmp_path, capsys):
    """--d-max 24: the powers of 2 below it, then 24 (it stopped at 16: a user who asks for
    1000 expects 1000 shown), its variances near 24 and 1; a power of 2 is not repeated."""
    argv = ["demo", "sqrt-dk", "--out", str(tmp_path), "--n-rows", "200", "--d-max"]
    for d_max, want in ((24, [1, 2, 4, 8, 16, 24]), (16, [1, 2, 4, 8, 16])):
        assert main([*argv, str(d_max)]) == 0
        out = capsys.readouterr().out
        cells = [line.split() for line in out.splitlines()]
        assert [int(c[0]) for c in cells if c and c[0].isdigit()] == want  # the d_k column
        [row] = table_rows(out, str(d_max))
        # 200 x 64 samples of a product of normals: the sample variance is within ~5%
        assert abs(float(row[1]) / d_max - 1) < 0.15 and abs(float(row[2]) - 1) < 0.15


def test_sqrt_dk_measurements_show_saturation_only_without_scaling():
    g = torch.Generator().manual_seed(0)
    small, large = (measure(d, n_keys=64, n_rows=200, generator=g) for d in (4, 1024))
    assert large["p_max_raw"] > 0.99 and large["p_max_scaled"] < 0.3
    assert large["jacobian_raw"] < 0.01 * large["jacobian_scaled"]
    assert abs(small["jacobian_scaled"] - large["jacobian_scaled"]) < 0.05  # scaled: flat in d
    assert large["p_sigma_raw"] < 1e-6 < large["p_sigma_scaled"]


def test_softmax_jacobian_equals_autograd():
    scores = torch.randn(3, 5, dtype=torch.float64)
    got = softmax_jacobian(scores.softmax(-1))
    for row in range(3):
        want = torch.autograd.functional.jacobian(lambda s: s.softmax(-1), scores[row])
        torch.testing.assert_close(got[row], want)


def test_temperature_sweep_goes_from_argmax_to_uniform():
    logits = torch.randn(20, dtype=torch.float64)
    cold, one, hot = sweep(logits, [1e-3, 1.0, 1e4])
    assert cold["top"] == pytest.approx(1.0) and cold["entropy"] == pytest.approx(0, abs=1e-9)
    assert hot["top"] == pytest.approx(1 / 20, rel=1e-3)
    assert hot["entropy"] == pytest.approx(math.log(20), rel=1e-6)
    want = torch.distributions.Categorical(logits=logits).entropy().item()
    assert one["entropy"] == pytest.approx(want, rel=1e-9)
    assert entropy(torch.tensor([1.0, 0.0])).item() == 0.0  # 0 log 0 = 0, not nan
    # exp(entropy): the number of equally likely outcomes with that entropy (1 to n)
    assert one["effective"] == pytest.approx(math.exp(want), rel=1e-9)
    assert cold["effective"] == pytest.approx(1.0) and hot["effective"] == pytest.approx(20)
    rows = torch.stack([logits.softmax(-1), (logits / 3).softmax(-1)])  # (2, n): one per row
    want_rows = torch.distributions.Categorical(probs=rows).entropy()
    torch.testing.assert_close(entropy(rows), want_rows)


def test_temperature_demo_without_model(tmp_path, capsys):
    code = main(["demo", "temperature", "--out", str(tmp_path), "--train-seconds", "0"])
    assert code == 0
    out = capsys.readouterr().out
    assert_png(tmp_path / "temperature.png")
    assert "random logits only" in out
    [row] = table_rows(out, "0.01")
    assert float(row[-1]) == pytest.approx(1.0)


def test_temperature_demo_with_checkpoint(tmp_path, capsys):
    from attnlab.training import load_checkpoint, train

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat and the dog ran to the cat.\n" * 40)
    cfg = quick_run(60, seed=0)
    cfg.data.path = str(corpus)
    cfg.train.time_budget = None
    train(cfg, tmp_path / "ckpt", max_steps=3, progress=False)
    capsys.readouterr()
    code = main([
        "demo", "temperature", "--out", str(tmp_path / "fig"), "--ckpt", str(tmp_path / "ckpt"),
        "--prompt", "the ca",
    ])  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    assert_png(tmp_path / "fig" / "temperature.png")
    # The printed entropy at tau = 1 is the entropy of the checkpoint's own next-token
    # distribution, computed here independently.
    ckpt = load_checkpoint(tmp_path / "ckpt")
    with torch.no_grad():
        logits = ckpt.model(torch.tensor([ckpt.tokenizer.encode("the ca")])).logits[0, -1]
    want = torch.distributions.Categorical(logits=logits.double()).entropy().item()
    rows = table_rows(out, "1")
    assert len(rows) == 2  # random logits, then the checkpoint
    assert float(rows[1][1]) == pytest.approx(want, rel=1e-3)


@pytest.mark.parametrize(
    "argv, code, needle",
    [
        (["demo", "kernel-regression", "--bandwidth", "0"], 2, "--bandwidth"),
        (["demo", "kernel-regression", "--noise", "-1"], 2, "argument --noise"),
        # the error named the library's bandwidth: "bandwidth must be ..., got nan"
        (["demo", "kernel-regression", "--noise", "inf"], 2, "argument --noise: must be a"),
        (["demo", "kernel-regression", "--noise", "1e30"], 1, "--noise 1e+30: the squared"),
        (["demo", "kernel-regression", "--bandwidth", "1e39"], 1, "--bandwidth 1e+39: outside"),
        (["demo", "kernel-regression", "--bandwidth", "1e-300"], 1, "--bandwidth 1e-300: out"),
        # sizes past the machine's memory: an allocation traceback, or hours of crawling
        (
            ["demo", "kernel-regression", "--n-train", "100000000000"],
            1,
            "--n-train / --n-test: the",
        ),
        (["demo", "sqrt-dk", "--n-keys", "1000000000000"], 1, "--d-max / --n-keys / --n-rows: the"),
        (
            ["demo", "temperature", "--n-logits", "1000000000000", "--train-seconds", "0"],
            1,
            "--n-logits: the demo's tensors would take",
        ),
        (["demo", "kernel-regression", "--n-train", "1"], 1, "--n-train"),
        (["demo", "bahdanau", "--lang", "xx"], 1, "--lang"),
        (["demo", "sqrt-dk", "--n-keys", "1"], 1, "--n-keys"),
        (["demo", "temperature", "--ckpt", "/nonexistent/ckpt"], 1, "/nonexistent/ckpt"),
        (["demo", "temperature", "--n-logits", "x"], 2, "--n-logits"),
    ],
)
def test_bad_demo_input_is_one_error_line(argv, code, needle, tmp_path, capsys):
    try:
        got = main([*argv, "--out", str(tmp_path)])
    except SystemExit as e:  # argparse usage errors exit from inside parse_args
        got = e.code
    assert got == code
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error" in err[0] and needle in err[0]


def test_temperature_demo_needs_a_language_model_with_a_tokenizer(tmp_path, capsys):
    """A seq2seq checkpoint (no next-token distribution) or one without tokenizer.json was
    an AttributeError traceback; now one error line naming --ckpt."""
    from attnlab.config import RunConfig
    from attnlab.data.numbers import CharVocab, CharVocabPair
    from attnlab.models import build_model
    from attnlab.models.rnn import RNNSeq2SeqConfig
    from attnlab.training.checkpoint import save_checkpoint

    gru = RNNSeq2SeqConfig(vocab_size=8, src_vocab_size=13, embed_dim=4, hidden_dim=4)
    vocab = CharVocabPair(CharVocab("0123456789"), CharVocab("abcde"))
    save_checkpoint(tmp_path / "gru", build_model(gru), RunConfig(model=gru), vocab)
    lm = quick_run(1, seed=0).model
    save_checkpoint(tmp_path / "lm", build_model(lm), RunConfig(model=lm), None)
    for name, needle in (("gru", "language model"), ("lm", "tokenizer.json")):
        capsys.readouterr()
        argv = ["demo", "temperature", "--out", str(tmp_path / "fig"), "--ckpt"]
        assert main([*argv, str(tmp_path / name)]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--ckpt" in err[0] and needle in err[0], err


def test_bahdanau_demo(tmp_path, capsys):
    code = main([
        "demo", "bahdanau", "--out", str(tmp_path), "--seconds", "1", "--max-number", "60",
        "--n-test", "5", "--hidden", "16", "--beam", "2",
    ])  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    assert_png(tmp_path / "bahdanau.png")
    for name in ("greedy", "beam 2 (alpha 0.6)"):
        [row] = table_rows(out, name)
        assert 0.0 <= float(row[1]) <= 1.0 and 0.0 <= float(row[2]) <= 1.0
    assert "55 training numbers below 60, 5 held out" in out


def test_bahdanau_demo_trains_at_least_one_step(tmp_path, capsys):
    """A --seconds shorter than one step took none, and the report divided by zero."""
    argv = ["demo", "bahdanau", "--out", str(tmp_path), "--seconds", "1e-9", "--max-number",
            "20", "--n-test", "2", "--hidden", "8", "--beam", "2"]  # fmt: skip
    assert main(argv) == 0
    assert "1 steps (1.0 epochs) in 1e-09 s, last train loss" in capsys.readouterr().out


def test_demo_out_that_is_a_file_is_refused_before_the_demo_runs(tmp_path, capsys):
    """It failed with "File exists" when the first figure was written, after the work."""
    out = tmp_path / "figures"
    out.write_text("mine")
    assert main(["demo", "sqrt-dk", "--out", str(out), "--d-max", "2"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == (
        f"attnlab: error: --out {out}: is a regular file, not a folder; give a figure folder\n"
    )
    assert out.read_text() == "mine"


def test_bahdanau_demo_rejects_a_test_set_that_leaves_no_training_data(tmp_path, capsys):
    argv = ["demo", "bahdanau", "--out", str(tmp_path), "--max-number", "5", "--n-test", "5"]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--n-test" in err[0]
