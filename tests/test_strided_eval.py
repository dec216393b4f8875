"""Strided evaluation of text longer than the context (``attnlab eval --stride``): every
token scored once, with up to window - stride tokens of context; checked against scoring
each window by hand.

Shapes: t window, V vocabulary size.
"""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
import torch.nn.functional as F

from attnlab.cli.main import main
from attnlab.config import AttentionConfig, ModelConfig, PositionConfig
from attnlab.models import DecoderLM
from attnlab.tasks.lm import strided_loss_sums, strided_windows
from attnlab.training.checkpoint import load_checkpoint, save_checkpoint


def tiny() -> DecoderLM:
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=30,
        max_seq_len=16,
        d_model=32,
        n_layers=2,
        attention=AttentionConfig(n_heads=4),
        position=PositionConfig(kind="learned"),
        init_std=0.1,
    )
    return DecoderLM(cfg).eval()


def by_hand(model, tokens: list[int], window: int, stride: int) -> tuple[float, int, list]:
    """The HF recipe, one window at a time: window k covers tokens[k s : k s + window] (cut
    at the end), and scores the targets not scored by an earlier window."""
    total, count, scored, done = 0.0, 0, [], 0  # targets tokens[1 : done + 1] scored
    for begin in range(0, len(tokens) - 1, stride):
        end = min(begin + window, len(tokens) - 1)
        x = torch.tensor(tokens[begin:end])[None]
        y = torch.tensor(tokens[begin + 1 : end + 1])
        logits = model(x).logits[0]  # (t, V)
        new = end - done  # the last `new` targets of this window
        total += float(F.cross_entropy(logits[-new:], y[-new:], reduction="sum"))
        count += new
        scored += list(range(done + 1, end + 1))
        done = end
        if end == len(tokens) - 1:
            break
    return total, count, scored


@torch.no_grad()
@pytest.mark.parametrize("n, window, stride", [(50, 16, 4), (50, 16, 16), (37, 16, 5), (9, 16, 3)])
def test_strided_loss_equals_scoring_each_window_by_hand(n, window, stride):
    model = tiny()
    tokens = torch.randint(0, 30, (n,)).tolist()
    total, count, scored = by_hand(model, tokens, window, stride)
    assert scored == list(range(1, n))  # every target once
    got_total, got_count = strided_loss_sums(
        model, torch.tensor(tokens), window=window, stride=stride, batch_size=3
    )
    assert got_count == count == n - 1
    assert got_total == pytest.approx(total, rel=1e-5)


def test_windows_give_each_target_enough_context():
    for begin, end, scored in strided_windows(100, 16, 4)[1:]:
        assert end - begin - scored >= 12  # every scored target sees >= 12 tokens before it
    assert sum(s for *_, s in strided_windows(100, 16, 4)) == 99
    with pytest.raises(ValueError, match="stride must be in \\[1, window=16\\], got 17"):
        strided_windows(100, 16, 17)


# ------------------------------------------------------------------ the command line


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    work = tmp_path_factory.mktemp("strided")
    text = " ".join(["the cat sat on a mat and the dog ran far away"] * 40)
    (work / "corpus.txt").write_text(text)
    argv = ["train", "--preset", "gpt2-tiny", "--set", "model.max_seq_len=32"]
    argv += ["--set", "model.n_layers=1", "--set", "train.batch_size=2"]
    argv += ["--set", "train.eval_batches=1", "--max-steps", "2", "--quiet"]
    argv += ["--data", str(work / "corpus.txt"), "--out", str(work / "run")]
    with warnings.catch_warnings():
        assert main(argv) == 0
    return work


def test_cli_stride_equals_the_function(ckpt, capsys, monkeypatch):
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)
    monkeypatch.setenv("ATTNLAB_CACHE", str(ckpt / "cache"))
    argv = ["eval", "--ckpt", str(ckpt / "run"), "--data", str(ckpt / "corpus.txt")]
    assert main([*argv, "--stride", "8", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    loaded = load_checkpoint(ckpt / "run")
    ids = loaded.tokenizer.encode((ckpt / "corpus.txt").read_text())
    with torch.no_grad():
        total, count = strided_loss_sums(
            loaded.model.eval(), torch.tensor(ids), window=32, stride=8
        )
    assert report["tokens"] == count == len(ids) - 1
    assert report["loss"] == pytest.approx(total / count, rel=1e-5)
    assert report["stride"] == 8
    assert main([*argv, "--stride", "8"]) == 0
    assert "stride 8" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([*argv, "--stride", "0"])
    code = main([*argv, "--stride", "33"])
    err = capsys.readouterr().err
    assert code != 0 and "--stride 33 exceeds the window of 32 tokens" in err


def test_cli_stride_on_a_text_shorter_than_the_window(ckpt, capsys, monkeypatch):
    # a stride valid for the model's window: the short text is one window, scored whole
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)
    monkeypatch.setenv("ATTNLAB_CACHE", str(ckpt / "cache"))
    (ckpt / "short.txt").write_text("the cat sat")  # 11 tokens < the window of 32
    argv = ["eval", "--ckpt", str(ckpt / "run"), "--data", str(ckpt / "short.txt"), "--json"]
    assert main([*argv, "--stride", "16"]) == 0
    strided = json.loads(capsys.readouterr().out)
    assert main(argv) == 0
    blocks = json.loads(capsys.readouterr().out)
    assert strided["tokens"] == blocks["tokens"] == 10
    assert strided["loss"] == pytest.approx(blocks["loss"], rel=1e-5)


def test_cli_stride_error_names_the_runs_block_size(ckpt, tmp_path, capsys, monkeypatch):
    # the window defaults to the run's train.block_size (16 here), not max_seq_len (32): the
    # message said "default max_seq_len", so a stride of 20 < 32 seemed refused for nothing
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)
    monkeypatch.setenv("ATTNLAB_CACHE", str(ckpt / "cache"))
    run = tmp_path / "run"
    shutil.copytree(ckpt / "run", run)
    # as saved by a run trained with block_size 16 (an edited config.json is refused)
    saved = load_checkpoint(run, with_state=True)
    config = saved.config.override({"train.block_size": 16})
    save_checkpoint(run, saved.model, config, saved.tokenizer, saved.state)
    argv = ["eval", "--ckpt", str(run), "--data", str(ckpt / "corpus.txt")]
    assert main([*argv, "--stride", "20"]) != 0
    err = capsys.readouterr().err
    assert "--stride 20 exceeds the window of 16 tokens" in err
    assert "default the run's train.block_size, else max_seq_len" in err
    assert main([*argv, "--stride", "16", "--max-batches", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["block_size"] == 16
