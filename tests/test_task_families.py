"""The other model families through the shared task protocol: masked LM (encoder),
numbers-to-words translation (Transformer and GRU encoder-decoders), digits
classification (ViT). Each learns, checkpoints with its vocabularies, resumes exactly
after SIGTERM and reports its metric through ``attnlab eval``; plus ``attnlab translate``
and ``attnlab classify``, and beam search through DecoderLM.generate and the CLI."""

from __future__ import annotations

import copy
import json
import os
import signal

import numpy as np
import pytest
import torch

from attnlab.cli.main import main
from attnlab.config import ConfigError
from attnlab.data.numbers import CharVocabPair
from attnlab.presets import get_run_preset
from attnlab.tasks import TASKS
from attnlab.training import load_checkpoint, train
from attnlab.training.metrics import read_metrics

SMALL_NUMBERS = {"data.options.max_number": 400, "data.options.n_train": 300,
                 "data.options.n_val": 40, "data.options.n_test": 20}  # fmt: skip

# Each task's preset, shrunk to run in seconds: (preset, overrides, metric).
CASES = {
    "mlm": (
        "bert-tiny-mlm",
        {"model.max_seq_len": 32, "train.block_size": 32, "model.d_model": 32,
         "model.ffn.hidden_dim": 64, "train.batch_size": 8},
        "accuracy",
    ),
    "transformer": (
        "transformer-numbers",
        {**SMALL_NUMBERS, "model.d_model": 32, "model.ffn.hidden_dim": 64,
         "train.batch_size": 16, "model.n_layers": 1, "model.n_decoder_layers": 1},
        "exact_match",
    ),
    "gru": (
        "gru-numbers",
        {**SMALL_NUMBERS, "model.hidden_dim": 32, "model.embed_dim": 16, "train.batch_size": 16},
        "exact_match",
    ),
    "vit": (
        "vit-digits",
        {"model.d_model": 32, "model.ffn.hidden_dim": 64, "model.n_layers": 2,
         "train.batch_size": 32, "model.init_std": 0.1, "train.weight_decay": 0.0},
        "accuracy",
    ),
}  # fmt: skip


def small_run(case: str, **train_kw):
    preset, overrides, _ = CASES[case]
    base = {"train.warmup_steps": 5, "train.eval_batches": 2, "train.log_every": 1,
            "train.seed": 0, "train.device": "cpu",
            "train.time_budget": None}  # fixed step counts, not a preset's time budget  # fmt: skip
    train_kw = {f"train.{k}": v for k, v in train_kw.items()}
    return get_run_preset(preset).override({**base, **overrides, **train_kw})


@pytest.mark.parametrize("case", list(CASES))
def test_task_learns_checkpoints_and_evaluates(case, tmp_path, capsys):
    steps = 200 if case == "vit" else 60  # a ViT's loss sits on a plateau for ~100 steps
    cfg = small_run(case, max_steps=steps, eval_every=steps, lr=3e-3)
    result = train(cfg, tmp_path, progress=False)
    val = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "val"]
    assert val[-1]["val_loss"] < val[0]["val_loss"] - 0.3, val  # it learns
    metric = CASES[case][2]
    assert f"val_{metric}" in val[-1]
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.config.task == cfg.task
    if cfg.task == "seq2seq":  # the two vocabularies come back with the checkpoint
        assert isinstance(ckpt.tokenizer, CharVocabPair)
        assert ckpt.tokenizer.source.chars == "0123456789"
        assert ckpt.tokenizer.vocab_size == ckpt.config.model.vocab_size
    elif cfg.task == "image-classification":
        assert ckpt.tokenizer is None
    else:  # [MASK] is one id past the tokenizer's
        assert ckpt.config.model.vocab_size == ckpt.tokenizer.vocab_size + 1
    code = main(["eval", "--ckpt", str(tmp_path), "--json"])  # the whole split, as the run ends
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["task"] == cfg.task
    assert report[metric] == pytest.approx(result.val_metrics[metric])
    # named as the task's data names it: the digits hold out a test split
    held_out = "held-out test split" if case == "vit" else "validation split"
    assert report["source"].startswith(held_out)
    # the run's last evaluation of the whole split (val_full_* when periodic ones sample)
    final_loss = val[-1].get("val_full_loss", val[-1]["val_loss"])
    assert report["loss"] == pytest.approx(final_loss, rel=1e-4)


def interrupted(cls, at: int):
    """``cls`` that sends SIGTERM to this process while fetching its ``at``-th batch."""

    class Interrupted(cls):
        calls = 0

        def batch(self, keys, device=None):
            type(self).calls += 1
            if type(self).calls == at:
                os.kill(os.getpid(), signal.SIGTERM)
            return super().batch(keys, device)

    return Interrupted


@pytest.mark.parametrize("case", list(CASES))
def test_task_resumes_exactly_after_sigterm(case, tmp_path, monkeypatch):
    cfg = small_run(case, max_steps=8, eval_every=4, grad_accum=2)
    if case != "gru":
        cfg.model.dropout = 0.1  # every random stream matters
    straight = train(cfg, tmp_path / "straight", progress=False)
    task_cls = TASKS[cfg.task]
    monkeypatch.setitem(TASKS, cfg.task, interrupted(task_cls, at=7))
    first = train(cfg, tmp_path / "run", progress=False)
    assert first.interrupted == "SIGTERM" and first.step == 4
    monkeypatch.setitem(TASKS, cfg.task, task_cls)
    second = train(None, tmp_path / "run", resume=tmp_path / "run", progress=False)
    assert second.step == 8
    assert first.losses + second.losses == straight.losses
    a, b = load_checkpoint(tmp_path / "run").model, load_checkpoint(tmp_path / "straight").model
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), name


def test_task_options_are_typed():
    cfg = get_run_preset("transformer-numbers")
    with pytest.raises(ConfigError, match="data.options.langg"):
        cfg.override({"data.options": {"langg": "fr"}}).validate()
    with pytest.raises(ConfigError, match="data.options.lang"):
        cfg.override({"data.options.lang": "xx-nope"}).validate()
    with pytest.raises(ConfigError, match=r"data.options.\w+: unknown key"):  # lm's are others
        cfg.override({"task": "lm"}).validate()
    with pytest.raises(ConfigError, match="data.options.shift"):
        get_run_preset("vit-digits").override({"data.options.shift": -1}).validate()
    # the split seeds a torch.Generator: out of its range was an unnamed "Overflow" at training
    for preset in ("vit-digits", "transformer-numbers"):
        with pytest.raises(ConfigError, match=r"data\.options\.seed: must be from -2\*\*63"):
            get_run_preset(preset).override({"data.options.seed": 2**64})
    # the generated texts seed random.Random, which takes a seed's absolute value: -3 made
    # the data of 3 (a seed sweep over -S..S trained on each data set twice)
    for preset in ("bert-tiny-langid", "bert-tiny-ner", "bert-tiny-qa"):
        get_run_preset(preset).override({"data.options.seed": 0}).validate()
        with pytest.raises(ConfigError, match=r"data\.options\.seed: must be >= 0, got -3"):
            get_run_preset(preset).override({"data.options.seed": -3})


def test_wrong_model_for_a_task_is_a_clear_error(tmp_path):
    cfg = get_run_preset("vit-digits").override({"task": "seq2seq", "data.options": {}})
    with pytest.raises(ConfigError, match="encoder-decoder"):
        train(cfg, tmp_path, progress=False, max_steps=1)


# --------------------------------------------------------------------------- commands


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Small checkpoints of the translation (GRU, Transformer) and digits tasks."""
    out = {}
    for case in ("gru", "transformer", "vit"):
        d = tmp_path_factory.mktemp(case)
        train(small_run(case, max_steps=30, eval_every=0), d, progress=False)
        out[case] = d
    return out


@pytest.mark.parametrize("case", ["gru", "transformer"])
def test_translate_command(case, trained, capsys):
    ckpt = str(trained[case])
    loaded = load_checkpoint(ckpt)
    task = TASKS["seq2seq"](loaded.config, tokenizer=loaded.tokenizer)
    n = str(task.max_new_tokens)
    assert main(["translate", "--ckpt", ckpt, "--json", "--max-new-tokens", n, "12", "305"]) == 0
    greedy = json.loads(capsys.readouterr().out)
    assert set(greedy) == {"12", "305"}
    # The same words as the model's own greedy decoding through the task.
    assert [greedy["12"], greedy["305"]] == task.translate(loaded.model, ["12", "305"])
    assert main(["translate", "--ckpt", ckpt, "--num-beams", "3", "7"]) == 0
    assert capsys.readouterr().out.startswith("7\t")
    assert main(["translate", "--ckpt", ckpt, "12a"]) == 1
    assert "not in the vocabulary" in capsys.readouterr().err
    assert main(["translate", "--ckpt", str(trained["vit"]), "12"]) == 1
    assert "seq2seq checkpoint" in capsys.readouterr().err


def test_classify_command(trained, tmp_path, capsys):
    from PIL import Image

    from attnlab.data.images import digits

    data = digits()
    ckpt = load_checkpoint(trained["vit"])
    image = data.test_x[0, 0].numpy()  # (8, 8) in [0, 1]
    small = tmp_path / "digit.png"
    Image.fromarray(np.round(image * 255).astype(np.uint8)).save(small)
    big = tmp_path / "big.png"  # 32 x 32: resized to the model's 8 x 8
    Image.fromarray(np.round(np.kron(image, np.ones((4, 4))) * 255).astype(np.uint8)).save(big)
    assert main(["classify", "--ckpt", str(trained["vit"]), "--json", str(small), str(big)]) == 0
    report = json.loads(capsys.readouterr().out)
    with torch.no_grad():
        x = torch.from_numpy(np.round(image * 255).astype(np.float32) / 255)[None, None]
        want = int(ckpt.model(x).logits.argmax())
    assert report[str(small)]["class"] == want
    assert 0 <= report[str(big)]["class"] < 10 and len(report[str(big)]["top"]) == 3
    rgb = tmp_path / "rgb.png"
    Image.new("RGB", (8, 8)).save(rgb)
    assert main(["classify", "--ckpt", str(trained["vit"]), str(rgb)]) == 1
    assert "3 channels" in capsys.readouterr().err
    assert main(["classify", "--ckpt", str(trained["gru"]), str(small)]) == 1
    assert "image-classification checkpoint" in capsys.readouterr().err


# --------------------------------------------------------------------------- beam search


def test_gru_generate_matches_greedy_and_beam(trained):
    model = load_checkpoint(trained["gru"]).model
    src = torch.tensor([[4, 5, 6], [7, 3, 0]])
    mask = src != 0
    greedy = model.greedy(src, mask, max_len=20)
    assert model.generate(src, 20, src_mask=mask) == [
        h.tokens[:-1] if h.finished else h.tokens for h in greedy
    ]
    beams = model.beam_search(src, mask, beam_width=3, max_len=20)
    got = model.generate(src, 20, src_mask=mask, num_beams=3)
    assert got == [r[0].tokens[:-1] if r[0].finished else r[0].tokens for r in beams]


def test_decoder_generate_with_beams_and_cache_reorder(tmp_path, capsys):
    from attnlab.generation import beam_search
    from attnlab.models import build_model
    from attnlab.presets import get_preset

    torch.manual_seed(0)
    model = build_model(get_preset("llama-tiny")).eval()
    prompts = [[5, 6, 7], [8, 9]]
    best = [row[0].tokens for row in beam_search(model, prompts, 6, num_beams=3, eos_id=4)]
    assert model.generate(prompts, 6, num_beams=3, stop_tokens=[4]) == best
    assert model.generate(prompts[0], 6, num_beams=3, stop_tokens=[4]) == best[0]
    with pytest.raises(ValueError, match="temperature"):
        model.generate(prompts, 6, num_beams=3, temperature=0.8)
    # Cache.reorder: row j becomes row index[j], in every layer and the bookkeeping.
    cache = model.new_cache(2, 8)
    model(torch.tensor([[1, 2, 3], [4, 5, 6]]), cache=cache)
    k0 = cache[0].k.clone()
    cache.reorder(torch.tensor([1, 1, 0]))
    assert cache.batch == 3 and torch.equal(cache[0].k, k0[[1, 1, 0]])
    assert cache.next_position.tolist() == [3, 3, 3]


@pytest.mark.parametrize("case", ["transformer", "mlm"])
def test_the_same_config_resumes(case, tmp_path):
    """``--resume DIR`` appended to the same command: the model fields the task fills in
    (vocabularies, special tokens) are compared as the task fills them, not as unset."""
    cfg = small_run(case, max_steps=2)
    train(cfg, tmp_path, progress=False)
    assert train(cfg, tmp_path, resume=tmp_path, max_steps=3, progress=False).step == 3


@torch.no_grad()
def test_mlm_batch_without_a_masked_token_has_zero_loss_not_nan():
    from attnlab.models.encoder import MaskedLMHead

    logits = torch.randn(2, 5, 11, requires_grad=True)
    none = torch.full((2, 5), -100)
    assert MaskedLMHead.loss(logits, none).item() == 0.0
    some = none.clone()
    some[1, 2] = 4
    expected = torch.nn.functional.cross_entropy(logits[1, 2][None], torch.tensor([4]))
    torch.testing.assert_close(MaskedLMHead.loss(logits, some), expected)


MOE_BALANCE = {"model.ffn.kind": "moe", "model.ffn.n_routed_experts": 4,
               "model.ffn.n_activated_experts": 2, "model.ffn.seq_aux_loss_coef": 0.1}  # fmt: skip


@pytest.mark.parametrize("case", ["mlm", "transformer", "gru", "transformer-moe"])
def test_accumulated_gradient_is_the_one_batch_gradient(case, tmp_path):
    """The gradient a step accumulates over micro-batches (the trainer's own step) equals
    the gradient of the loss plus auxiliary loss of the whole batch in one forward pass.
    With a mixture of experts, padding counted in the balance loss made it differ (by
    0.3% of the gradient: a micro-batch's padding depends on its longest example)."""
    from attnlab.training.trainer import Trainer, _StopRequest

    name, _, moe = case.partition("-")
    cfg = small_run(name, max_steps=3, grad_accum=2, batch_size=8, grad_clip=0.0).override(
        {"model.dropout": 0.0, **(MOE_BALANCE if moe else {})}
    )
    tr = Trainer(cfg, tmp_path, progress=False)
    keys = tr.task.sample(16, torch.Generator().set_state(tr.data_generator.get_state()))
    reference = copy.deepcopy(tr.model)  # the weights the step starts from
    out = tr.task.step(reference, tr.task.batch(keys))
    (out.loss if out.aux_loss is None else out.loss + out.aux_loss).backward()
    assert (out.aux_loss is not None) == bool(moe)
    accumulated = {}
    tr.optimizer.step = lambda: accumulated.update(
        {n: p.grad.clone() for n, p in tr.model.named_parameters() if p.grad is not None}
    )
    try:
        step = tr._train_step(_StopRequest(), lambda: False)
    finally:
        tr.release()
    assert step.loss == pytest.approx(out.loss.item(), rel=1e-6)
    expected = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    assert accumulated.keys() == expected.keys()
    for n in expected:
        torch.testing.assert_close(accumulated[n], expected[n], rtol=1e-5, atol=1e-7, msg=n)


@pytest.mark.parametrize("case", ["mlm", "transformer", "gru"])
def test_accumulated_micro_batches_train_as_one_batch(case, tmp_path):
    """Their targets differ in number from batch to batch (masked tokens, target lengths):
    two micro-batches of b must give the loss and weights of one batch of 2b (the mean over
    all its targets), not the mean of the two micro-batches' means."""
    runs = {
        accum: small_run(
            case, max_steps=3, eval_every=0, grad_accum=accum, batch_size=16 // accum
        ).override({"model.dropout": 0.0})  # fmt: skip
        for accum in (1, 2)
    }
    one, two = (train(runs[a], tmp_path / str(a), progress=False) for a in (1, 2))
    np.testing.assert_allclose(two.losses, one.losses, rtol=1e-5)
    a, b = (load_checkpoint(tmp_path / str(n)).model.state_dict() for n in (1, 2))
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-5, msg=name)


LANGID = ("bert-tiny-langid", {"model.d_model": 32, "model.ffn.hidden_dim": 64,
          "train.batch_size": 8, "data.options.max_number": 400,
          "data.options.langs": ["en", "de"], "data.options.n_train": 40,
          "data.options.n_val": 12, "data.options.n_test": 4})  # fmt: skip


@pytest.mark.parametrize("case", ["mlm", "transformer", "vit", "langid"])
def test_eval_counts_are_whole_numbers_in_json_and_text(case, tmp_path, capsys):
    # The tasks' totals are summed over processes as floats; a count reported from them
    # was 32.0 in the JSON and "32.0000" in the text report (seq2seq's was 32).
    if case == "langid":
        preset, overrides = LANGID
        cfg = get_run_preset(preset).override(
            {
                **overrides,
                "train.max_steps": 1,
                "train.warmup_steps": 0,
                "train.time_budget": None,
                "train.device": "cpu",
            }  # fmt: skip
        )
    else:
        cfg = small_run(case, max_steps=1, warmup_steps=0, eval_every=1)
    train(cfg, tmp_path, progress=False)
    argv = ["eval", "--ckpt", str(tmp_path), "--max-batches", "1"]
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert main(argv) == 0
    lines = dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines())
    count = "masked_tokens" if cfg.task == "mlm" else "examples"
    expected = {"mlm": None, "seq2seq": 16, "image-classification": 32, "text-classification": 8}
    assert isinstance(report[count], int), report
    if expected[cfg.task] is not None:  # one batch of batch_size examples
        assert report[count] == expected[cfg.task] == cfg.train.batch_size
    assert lines[count] == str(report[count])
    for name, value in report.items():  # the text report shows the JSON's values
        shown = f"{value:.4f}" if isinstance(value, float) else str(value)
        assert lines[name] == shown, name
