"""Transformer-XL: relative attention against the direct four-term formula, the relative
shift against a gather, segment recurrence against a full forward pass, bad configs, and
training/evaluation from the command line.

Shapes: b batch, h heads, t segment, m memory, s = m + t keys, d d_model.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn.functional as F

from attnlab.cli.main import main
from attnlab.config import AttentionConfig, ConfigError, ModelConfig, NormConfig
from attnlab.models import TransformerXL, XLConfig, build_model
from attnlab.models.xl import xl_loss_sums
from attnlab.nn.relative import RelativeMultiHeadAttention, rel_shift, relative_sinusoids
from attnlab.presets import get_preset

TOL = {"atol": 1e-5, "rtol": 1e-5}


def test_rel_shift_aligns_each_row_to_its_distances():
    t, s = 4, 7
    x = torch.randn(2, t, s)  # column c: distance s - 1 - c
    got = rel_shift(x)
    for i in range(t):
        for j in range(s - t + i + 1):  # the causal part
            c = s - 1 - ((s - t + i) - j)
            assert got[:, i, j].tolist() == x[:, i, c].tolist()


@torch.no_grad()
@pytest.mark.parametrize("m", [0, 5])
def test_relative_attention_equals_the_four_terms(m):
    torch.manual_seed(0)
    d, h, t = 32, 4, 6
    attn = RelativeMultiHeadAttention(d, AttentionConfig(n_heads=h)).eval()
    attn.u.normal_()
    attn.v.normal_()
    x, memory = torch.randn(2, t, d), torch.randn(2, m, d)
    got = attn(x, memory=memory if m else None)
    # direct O(T^2): A_ij = q^T k + q^T W_R R + u^T k + v^T W_R R, one (i, j) at a time
    d_h, s = d // h, m + t
    ctx = torch.cat((memory, x), 1)
    q = attn.q(x).view(2, t, h, d_h)
    k, v = (y.view(2, s, h, d_h) for y in attn.kv(ctx).chunk(2, -1))
    y = torch.zeros(2, t, h, d_h)
    for i in range(t):
        scores = torch.full((2, h, s), float("-inf"))
        for j in range(m + i + 1):
            R = relative_sinusoids(torch.tensor([m + i - j]), d)[0]  # (d,)
            r = attn.r(R[None])[0].view(h, d_h)  # W_R R_{i-j}
            a = (q[:, i] * k[:, j]).sum(-1)
            b = (q[:, i] * r).sum(-1)
            c = (attn.u * k[:, j]).sum(-1)
            e = (attn.v * r).sum(-1)
            scores[:, :, j] = (a + b + c + e) / d_h**0.5
        w = scores.softmax(-1)  # (2, h, s)
        y[:, i] = torch.einsum("bhs,bshd->bhd", w, v)
    want = attn.out(y.reshape(2, t, d))
    torch.testing.assert_close(got, want, **TOL)


def tiny(mem_len: int = 64, **kw) -> TransformerXL:
    torch.manual_seed(0)
    cfg = XLConfig(
        vocab_size=40, d_model=32, n_layers=3, attention=AttentionConfig(n_heads=4),
        mem_len=mem_len, init_std=0.1, **kw,
    )  # fmt: skip
    model = build_model(cfg).eval()
    for block in model.blocks:
        torch.nn.init.normal_(block.attn.u)
        torch.nn.init.normal_(block.attn.v)
    return model


@torch.no_grad()
@pytest.mark.parametrize("placement", ["pre", "post"])
def test_segments_with_memory_equal_the_full_pass(placement):
    """Causal layers: layer l's states of earlier tokens never depend on later ones, so with
    a memory holding every earlier token, segment by segment equals one forward pass."""
    model = tiny(mem_len=64, norm=NormConfig(placement=placement))
    idx = torch.randint(0, 40, (2, 21))
    full = model(idx).logits
    out, mem, got = None, None, []
    for sl in (slice(0, 8), slice(8, 9), slice(9, 21)):
        out = model(idx[:, sl], memory=mem)
        mem = out.memory
        got.append(out.logits)
    torch.testing.assert_close(torch.cat(got, 1), full, **TOL)
    assert [m.shape for m in mem] == [(2, 21, 32)] * 3


@torch.no_grad()
def test_left_padded_rows_equal_their_tokens_alone():
    """Relative positions: a left-padded row's real tokens see the same distances as the
    row alone. The padded queries attend to nothing and must give zeros, not NaN, which
    the next layer's keys and values would spread to every token of the row."""
    model = tiny(mem_len=8)
    idx = torch.randint(0, 40, (2, 7))
    attention_mask = torch.ones(2, 7, dtype=torch.long)
    attention_mask[1, :3] = 0
    out = model(idx, attention_mask=attention_mask)
    torch.testing.assert_close(out.logits[0], model(idx[:1]).logits[0], **TOL)
    torch.testing.assert_close(out.logits[1, 3:], model(idx[1:, 3:]).logits[0], **TOL)


def test_memory_is_capped_and_detached():
    model = tiny(mem_len=5).train()
    out = model(torch.randint(0, 40, (2, 8)))
    out2 = model(torch.randint(0, 40, (2, 3)), memory=out.memory)
    assert all(m.shape == (2, 5, 32) and not m.requires_grad for m in out2.memory)
    out2.logits.sum().backward()  # the graph stops at the memory
    assert model.tok_emb.weight.grad is not None


@torch.no_grad()
def test_memory_evaluation_scores_every_token_once():
    model = tiny(mem_len=64)
    tokens = torch.randint(0, 40, (30,))
    full = F.cross_entropy(model(tokens[None, :-1]).logits[0], tokens[1:], reduction="sum")
    total, count = xl_loss_sums(model, tokens, 7)
    assert count == 29 and total == pytest.approx(float(full), rel=1e-5)
    alone = xl_loss_sums(model, tokens, 7, memory=False)
    assert alone[1] == 29 and alone[0] != pytest.approx(total, rel=1e-3)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"mem_len": 0}, "mem_len: must be > 0, got 0"),
        ({"position": {"kind": "rope"}}, "position.kind: Transformer-XL encodes relative"),
        ({"attention": {"kind": "linear"}}, "attention.kind: Transformer-XL uses its own"),
        ({"attention": {"sliding_window": 4}}, "attention.sliding_window: does not apply"),
        ({"attention": {"n_kv_heads": 1}}, "attention.n_kv_heads: Transformer-XL's relative"),
        ({"d_model": 33, "attention": {"n_heads": 3}}, "d_model: the relative encodings pair"),
    ],
)
def test_bad_xl_configs_name_the_field(change, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict({"arch": "xl", **change})


@torch.no_grad()
@pytest.mark.parametrize("placement", ["pre", "post"])
def test_greedy_generation_with_memory_equals_full_passes(placement):
    """While the memory holds every earlier token, each new token (one-token segments)
    is the argmax of one forward pass over the whole sequence."""
    model = tiny(mem_len=64, norm=NormConfig(placement=placement)).eval()
    prompt = torch.randint(0, 40, (9,)).tolist()
    got = model.generate(prompt, 30)
    ids = list(prompt)
    for _ in range(30):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert got == ids[len(prompt) :]
    assert model.generate([prompt, prompt[:4]], 30)[0] == got  # rows keep their own memory
    assert model.generate([prompt, prompt[:4]], 0) == [[], []]
    # a prompt longer than max_seq_len is read in segments of it, the memory carried
    model = tiny(mem_len=64, norm=NormConfig(placement=placement), max_seq_len=16).eval()
    long_prompt = torch.randint(0, 40, (60,)).tolist()
    first = model(torch.tensor([long_prompt])).logits[0, -1].argmax()
    assert model.generate(long_prompt, 1) == [int(first)]


def test_generation_options_and_errors():
    model = tiny(mem_len=8).train()  # dropout 0: the same tokens in either mode
    prompt = [1, 2, 3]
    a = model.generate(prompt, 12, temperature=1.0, top_k=5, seed=3)
    assert a == model.generate(prompt, 12, temperature=1.0, top_k=5, seed=3) and len(a) == 12
    greedy = model.generate(prompt, 12)
    stop = greedy[4]
    assert model.generate(prompt, 12, stop_tokens=[stop]) == greedy[: greedy.index(stop)]
    assert model.training  # the mode it was in
    with pytest.raises(ValueError, match="overflow one of slide, roll, stop"):
        model.stream(prompt, 4, overflow="wrap")
    with pytest.raises(ValueError, match="use_cache=True"):
        model.stream(prompt, 4, use_cache=False)
    with pytest.raises(ValueError, match=r"prompt token ids must be in \[0, 40\)"):
        model.stream([99], 4)


def test_preset_round_trips_and_trains_from_the_cli(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)
    monkeypatch.setenv("ATTNLAB_CACHE", str(tmp_path / "cache"))
    cfg = get_preset("xl-tiny")
    assert isinstance(ModelConfig.from_dict(cfg.to_dict()), XLConfig)
    argv = ["train", "--preset", "xl-tiny", "--set", "model.mem_len=16"]
    argv += ["--set", "train.batch_size=4", "--set", "train.block_size=32"]
    argv += ["--set", "train.eval_batches=1", "--max-steps", "3", "--quiet"]
    argv += ["--out", str(tmp_path / "run")]
    assert main(argv) == 0
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["model"]["arch"] == "xl" and saved["model"]["mem_len"] == 16
    capsys.readouterr()
    assert main(["eval", "--ckpt", str(tmp_path / "run"), "--max-batches", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] > 0
    gen = ["generate", "--ckpt", str(tmp_path / "run"), "--prompt", "def f"]
    assert main([*gen, "--max-new-tokens", "40"]) == 0  # past max_seq_len (32): the memory
    assert capsys.readouterr().out.startswith("def f")


def test_float64_xl_computes_in_float64():
    """model.double(): float64 relative sinusoids (they were float32 values) and a float64
    loss (it was rounded to float32, and its gradient with it)."""
    import math

    got = relative_sinusoids(torch.tensor([0, 1, 2000]), 8, torch.float64)
    assert got.dtype == torch.float64
    w = [10000 ** (-2 * k / 8) for k in range(4)]
    want = [[math.sin(p * x) for x in w] + [math.cos(p * x) for x in w] for p in (0, 1, 2000)]
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-12)
    torch.manual_seed(0)
    model = build_model(get_preset("xl-tiny")).double()
    idx = torch.randint(0, 256, (2, 8))
    out = model(idx, targets=idx)
    assert out.loss.dtype == torch.float64
    want = F.cross_entropy(out.logits.flatten(0, 1), idx.flatten())
    torch.testing.assert_close(out.loss, want, rtol=1e-14, atol=0)


@torch.no_grad()
def test_float16_relative_scores_past_65504_stay_finite():
    """(q + u) . k and (q + v) . W_R R above float16's 65504 (below it once scaled by
    1/sqrt(d_h)): formed in float32, as attend's scores; in float16 they were inf before the
    scale, and inf - inf gave NaN rows."""
    torch.manual_seed(0)
    attn = RelativeMultiHeadAttention(32, AttentionConfig(n_heads=4)).eval().half()
    x = (torch.randn(2, 4, 32) * 300).half()
    got = attn(x)
    want = attn.float()(x.float())
    assert got.isfinite().all()
    torch.testing.assert_close(got.float(), want, atol=0.5, rtol=2e-2)


def test_streamed_resume_with_another_block_size_is_refused(tmp_path, monkeypatch):
    """Task lm-stream saves each row's memory and its segment counter: a resumed run with
    another train.block_size would read segment k at k * t_new while the memory ends at
    (k_old + 1) * t_old, so the memory would hold the new segment's own targets. Refused,
    naming the field; the saved length resumes."""
    from attnlab.config import DataConfig, RunConfig, TrainConfig
    from attnlab.data import TokenDataset, prepare_data
    from attnlab.training import train
    from attnlab.training.metrics import MetricsLogger

    monkeypatch.setattr(MetricsLogger, "plot", lambda self: None)
    full = prepare_data(DataConfig(), cache_dir=tmp_path / "cache")
    data = TokenDataset(tokenizer=full.tokenizer, train=full.train[:2000], val=full.val[:300])

    def run(block_size: int, max_steps: int) -> RunConfig:
        model = XLConfig(vocab_size=256, max_seq_len=8, d_model=16, n_layers=1, mem_len=8,
                         attention=AttentionConfig(n_heads=2))  # fmt: skip
        return RunConfig(model=model, task="lm-stream", train=TrainConfig(
            batch_size=2, block_size=block_size, max_steps=max_steps, warmup_steps=1,
            eval_every=0, eval_batches=1, seed=0))  # fmt: skip

    train(run(8, 3), tmp_path / "run", dataset=data, progress=False)
    with pytest.raises(ConfigError, match="train.block_size: task lm-stream continues each"):
        train(run(6, 5), tmp_path / "run", resume=tmp_path / "run", dataset=data,
              progress=False)  # fmt: skip
    assert train(run(8, 5), tmp_path / "run", resume=tmp_path / "run", dataset=data,
                 progress=False).step == 5  # fmt: skip


def test_streamed_validation_too_short_fails_before_training(tmp_path):
    """Task lm-stream cuts the validation split into batch_size streams of at least a
    segment and its next token; a split too short failed at the first evaluation, after
    the training steps before it (with eval_every=0 the run's end: nothing saved)."""
    from attnlab.config import DataConfig, RunConfig, TrainConfig
    from attnlab.data import DataError, TokenDataset, prepare_data
    from attnlab.tasks import StreamingLanguageModelling

    full = prepare_data(DataConfig(), cache_dir=tmp_path / "cache")
    block, batch = 8, 3
    val = full.val[: batch * (block + 1) - 1]  # one token short of 3 streams of 8 + 1
    data = TokenDataset(tokenizer=full.tokenizer, train=full.train[:2000], val=val)
    model = XLConfig(vocab_size=256, max_seq_len=block, d_model=16, n_layers=1,
                     attention=AttentionConfig(n_heads=2))  # fmt: skip
    cfg = RunConfig(model=model, task="lm-stream",
                    train=TrainConfig(batch_size=batch, block_size=block))  # fmt: skip
    with pytest.raises(DataError, match="the validation split .* cut into 3 streams"):
        StreamingLanguageModelling(cfg, data=data)
    cfg.train.batch_size = batch - 1  # two streams fit
    assert StreamingLanguageModelling(cfg, data=data).eval_examples(batch - 1, None) == 2
