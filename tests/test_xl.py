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
from attnlab.models.xl import same_length_mask, xl_loss_sums
from attnlab.nn.relative import (
    RelativeMultiHeadAttention,
    rel_shift,
    relative_encodings,
    relative_sinusoids,
)
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
@pytest.mark.parametrize("m, clamp_len", [(0, None), (5, None), (5, 3)])
def test_relative_attention_equals_the_four_terms(m, clamp_len):
    """clamp_len: R of min(distance, clamp_len), as the original's clamped pos_seq."""
    torch.manual_seed(0)
    d, h, t = 32, 4, 6
    attn = RelativeMultiHeadAttention(d, AttentionConfig(n_heads=h)).eval()
    attn.u.normal_()
    attn.v.normal_()
    x, memory = torch.randn(2, t, d), torch.randn(2, m, d)
    encodings = None if clamp_len is None else relative_encodings(m + t, d, clamp_len=clamp_len)
    got = attn(x, memory=memory if m else None, encodings=encodings)
    # direct O(T^2): A_ij = q^T k + q^T W_R R + u^T k + v^T W_R R, one (i, j) at a time
    d_h, s = d // h, m + t
    ctx = torch.cat((memory, x), 1)
    q = attn.q(x).view(2, t, h, d_h)
    k, v = (y.view(2, s, h, d_h) for y in attn.kv(ctx).chunk(2, -1))
    y = torch.zeros(2, t, h, d_h)
    for i in range(t):
        scores = torch.full((2, h, s), float("-inf"))
        for j in range(m + i + 1):
            distance = min(m + i - j, clamp_len or m + i - j)
            R = relative_sinusoids(torch.tensor([distance]), d)[0]  # (d,)
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


@torch.no_grad()
def test_padded_segment_after_a_memory_keeps_every_memory_key():
    """The padding mask of a segment read after a memory covers the segment's keys, after
    the memory's (all real): a right-padded last segment gives its real tokens the logits of
    the segment cut at its end, with the same memory."""
    model = tiny(mem_len=16)
    idx = torch.randint(0, 40, (2, 13))
    memory = model(idx[:, :6]).memory
    attention_mask = torch.ones(2, 7, dtype=torch.long)
    attention_mask[1, 4:] = 0
    out = model(idx[:, 6:], memory=memory, attention_mask=attention_mask)
    unpadded = model(idx[:, 6:], memory=memory).logits
    torch.testing.assert_close(out.logits[0], unpadded[0], **TOL)
    cut = model(idx[1:, 6:10], memory=[m[1:] for m in memory]).logits
    torch.testing.assert_close(out.logits[1, :4], cut[0], **TOL)


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
        ({"attention": {"qk_norm": True}}, "attention.qk_norm: does not apply"),
        ({"attention": {"n_kv_heads": 1}}, "attention.n_kv_heads: Transformer-XL's relative"),
        # its relative attention never calls a backend: flash was silently computed eagerly
        ({"attention": {"backend": "flash"}}, "attention.backend: 'flash' does not apply"),
        ({"d_model": 33, "attention": {"n_heads": 3}}, "d_model: the relative encodings pair"),
        ({"clamp_len": 0}, "clamp_len: must be a positive integer or null"),
        ({"clamp_len": -1}, "clamp_len: must be a positive integer or null"),
        ({"clamp_len": 2.5}, "clamp_len: expected int or null"),
        ({"same_length": 1}, "same_length: expected true/false"),
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
    # pad_id does not apply (rows decode alone) but is checked as DecoderLM checks it
    assert model.generate(prompt, 12, pad_id=39) == greedy
    for bad in (None, -1, 40, 2.5):
        with pytest.raises(ValueError, match=r"pad_id must be a token id in \[0, 40\)"):
            model.stream(prompt, 4, pad_id=bad)


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


def test_generate_refuses_overflow_modes_on_xl_whose_memory_has_no_context_limit(tmp_path, capsys):
    """``generate --overflow stop`` / ``roll`` on Transformer-XL were silently ignored (its
    memory carries on past max_seq_len): refused in one line naming --overflow; without it
    (or with the default, slide) the command prints the library's tokens, past the
    context."""
    from attnlab.config import RunConfig
    from attnlab.training.checkpoint import save_checkpoint

    model = tiny(mem_len=8, max_seq_len=8)
    save_checkpoint(tmp_path, model, RunConfig(model=model.cfg), None)
    argv = ["generate", "--ckpt", str(tmp_path), "--prompt-ids", "1,2,3"]
    argv += ["--max-new-tokens", "12", "--temperature", "0"]
    for mode in ("stop", "roll"):
        capsys.readouterr()
        assert main([*argv, "--overflow", mode]) == 1
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1, err
        said = f"--overflow {mode}: Transformer-XL's segment memory has no context limit"
        assert err.startswith(f"attnlab: error: {said}, so --overflow does not apply"), err
    want = ",".join(map(str, [1, 2, 3, *model.generate([1, 2, 3], 12)])) + "\n"
    for extra in ([], ["--overflow", "slide"]):
        capsys.readouterr()
        assert main([*argv, *extra]) == 0
        assert capsys.readouterr().out == want  # 15 tokens: past max_seq_len=8


def test_relative_sinusoids_at_far_distances_are_float32_rounding_of_the_float64_ones():
    """Distances up to 32k: float32 encodings within float32's rounding of the float64 ones
    (6e-8); angles formed in float32 were off by up to p * 6e-8 (1e-3 here)."""
    import math

    g = torch.Generator().manual_seed(0)
    distances = torch.randint(0, 32768, (64,), generator=g)
    d = 16
    w = [10000 ** (-2 * k / d) for k in range(d // 2)]
    want = [[math.sin(p * x) for x in w] + [math.cos(p * x) for x in w] for p in distances.tolist()]
    got = relative_sinusoids(distances, d)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), torch.tensor(want, dtype=torch.float64), rtol=0,
                               atol=6e-8)  # fmt: skip


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


# ---------------------------------------------------------------- clamp_len, same_length
# The reference below follows the original code (kimiyoung/transformer-xl,
# MemTransformerLM._forward and RelPartialLearnableMultiHeadAttn), written independently of
# attnlab's relative shift, encodings table and masks: pos_seq = klen - 1, ..., 0 clamped
# at clamp_len; dec_attn_mask = triu(ones, 1 + mlen) + tril(ones, -mask_shift_len) with
# same_length; the (b)+(d) term of each pair read from R[pos_seq] by index.


def original_mask(qlen: int, mlen: int, mem_len: int, same_length: bool) -> torch.Tensor:
    """(qlen, klen) bool, True = masked: the original's dec_attn_mask."""
    klen = mlen + qlen
    all_ones = torch.ones(qlen, klen)
    if not same_length:
        return torch.triu(all_ones, diagonal=1 + mlen).bool()
    mask_len = klen - mem_len
    mask_shift_len = qlen - mask_len if mask_len > 0 else qlen
    return (torch.triu(all_ones, 1 + mlen) + torch.tril(all_ones, -mask_shift_len)).bool()


def original_pos_emb(klen: int, d: int, clamp_len: int | None) -> torch.Tensor:
    """(klen, d): the original's PositionalEmbedding of pos_seq = klen - 1, ..., 0."""
    pos_seq = torch.arange(klen - 1, -1, -1.0)
    if clamp_len is not None and clamp_len > 0:
        pos_seq.clamp_(max=clamp_len)
    inv_freq = 1 / (10000 ** (torch.arange(0.0, d, 2.0) / d))
    sinusoid_inp = torch.outer(pos_seq, inv_freq)
    return torch.cat([sinusoid_inp.sin(), sinusoid_inp.cos()], dim=-1)


def reference_attention(attn, x, mem, pos_emb, masked):
    """One layer's relative attention, pair by pair over (i, j): row klen - 1 - (mlen + i
    - j) of pos_emb is the encoding of key j's distance from query i (the shift's result)."""
    b, qlen, _ = x.shape
    mlen = mem.shape[1]
    h, d_h = attn.n_heads, attn.head_dim
    cat = torch.cat((mem, x), 1)
    klen = cat.shape[1]
    q = attn.q(x).view(b, qlen, h, d_h)
    k, v = (y.view(b, klen, h, d_h) for y in attn.kv(cat).chunk(2, -1))
    r = attn.r(pos_emb).view(klen, h, d_h)
    rows = torch.arange(qlen)[:, None]
    cols = torch.arange(klen)[None, :]
    r_ij = r[klen - 1 - (mlen + rows - cols).clamp(min=0)]  # (qlen, klen, h, d_h)
    ac = torch.einsum("bihd,bjhd->bhij", q + attn.u, k)
    bd = torch.einsum("bihd,ijhd->bhij", q + attn.v, r_ij)
    scores = ((ac + bd) / d_h**0.5).masked_fill(masked, float("-inf"))
    y = torch.einsum("bhij,bjhd->bihd", scores.softmax(-1), v)
    return attn.out(y.reshape(b, qlen, h * d_h))


def reference_segments(model, idx, segments, *, mem_len, clamp_len, same_length):
    """The logits of idx read in ``segments``, a pre-norm Transformer-XL with its memory
    (the last mem_len inputs of each layer) carried, in the original's formulas."""
    cfg, logits = model.cfg, []
    mems = [torch.zeros(idx.shape[0], 0, cfg.d_model)] * len(model.blocks)
    for sl in segments:
        x = model.tok_emb(idx[:, sl])
        qlen, mlen = x.shape[1], mems[0].shape[1]
        pos_emb = original_pos_emb(mlen + qlen, cfg.d_model, clamp_len)
        masked = original_mask(qlen, mlen, mem_len, same_length)
        new = []
        for block, mem in zip(model.blocks, mems):
            new.append(torch.cat((mem, x), 1)[:, -mem_len:])
            a = reference_attention(
                block.attn, block.attn_norm(x), block.attn_norm(mem), pos_emb, masked
            )
            x = x + a
            x = x + block.ffn(block.ffn_norm(x))
        mems = new
        logits.append(model.lm_head(model.norm(x)))
    return torch.cat(logits, 1)


@pytest.mark.parametrize("t, m, mem_len", [(5, 0, 3), (5, 4, 6), (4, 6, 6), (3, 2, 9), (4, 4, 8)])
def test_same_length_mask_is_the_original_formula(t, m, mem_len):
    """m + t above, equal to and below mem_len (the original's mask_len > 0, = 0, < 0)."""
    got = same_length_mask(t, m, mem_len)
    assert torch.equal(~got, original_mask(t, m, mem_len, True))
    # every query sees min(mem_len, its causal keys): the same number once m + i >= mem_len - 1
    assert got.sum(-1).tolist() == [min(mem_len, m + i + 1) for i in range(t)]


def segment_logits(model, idx, segments):
    """The model's logits over ``idx``, read segment by segment with its memory."""
    got, mem = [], None
    for sl in segments:
        out = model(idx[:, sl], memory=mem)
        mem = out.memory
        got.append(out.logits)
    return torch.cat(got, 1)


@torch.no_grad()
@pytest.mark.parametrize(
    "clamp_len, same_length", [(None, False), (3, False), (None, True), (3, True)]
)
def test_clamp_len_and_same_length_equal_the_original_formulas(clamp_len, same_length):
    """Segments with memory (m from 0 to past mem_len) against the reference in the
    original code's formulas; (None, False) checks the reference itself."""
    model = tiny(mem_len=6, clamp_len=clamp_len, same_length=same_length)
    idx = torch.randint(0, 40, (2, 17))
    segments = (slice(0, 4), slice(4, 9), slice(9, 10), slice(10, 17))
    got = segment_logits(model, idx, segments)
    want = reference_segments(
        model, idx, segments, mem_len=6, clamp_len=clamp_len, same_length=same_length
    )
    torch.testing.assert_close(got, want, **TOL)


@torch.no_grad()
def test_head_dim_apart_from_d_model_equals_the_original_formulas():
    """The original's d_head is its own setting (n_head * d_head need not be d_model): the
    encodings keep width d_model and W_R maps them to n_heads * head_dim."""
    torch.manual_seed(0)
    cfg = XLConfig(
        vocab_size=40, d_model=32, n_layers=2, attention=AttentionConfig(n_heads=4, head_dim=6),
        mem_len=6, clamp_len=3, same_length=True, init_std=0.1,
    )  # fmt: skip
    model = build_model(cfg).eval()
    for block in model.blocks:
        torch.nn.init.normal_(block.attn.u)
        torch.nn.init.normal_(block.attn.v)
    assert model.blocks[0].attn.r.weight.shape == (24, 32)
    idx = torch.randint(0, 40, (2, 17))
    segments = (slice(0, 4), slice(4, 9), slice(9, 10), slice(10, 17))
    got = segment_logits(model, idx, segments)
    want = reference_segments(model, idx, segments, mem_len=6, clamp_len=3, same_length=True)
    torch.testing.assert_close(got, want, **TOL)


@torch.no_grad()
def test_post_norm_layers_read_the_clamped_encodings_and_the_same_length_mask():
    """Post-norm blocks (attention over the raw memory and segment, then the norm) under
    clamp_len and same_length against the original formulas written out layer by layer:
    each layer reads the model's clamped encodings, not unclamped ones of its own."""
    model = tiny(mem_len=6, clamp_len=3, same_length=True, norm=NormConfig(placement="post"))
    idx = torch.randint(0, 40, (2, 17))
    segments = (slice(0, 4), slice(4, 9), slice(9, 10), slice(10, 17))
    got = segment_logits(model, idx, segments)
    want, mems = [], [torch.zeros(2, 0, model.cfg.d_model)] * len(model.blocks)
    for sl in segments:
        x = model.tok_emb(idx[:, sl])
        qlen, mlen = x.shape[1], mems[0].shape[1]
        pos_emb = original_pos_emb(mlen + qlen, model.cfg.d_model, 3)
        masked = original_mask(qlen, mlen, 6, True)
        new = []
        for block, m in zip(model.blocks, mems):
            new.append(torch.cat((m, x), 1)[:, -6:])
            x = block.attn_norm(x + reference_attention(block.attn, x, m, pos_emb, masked))
            x = block.ffn_norm(x + block.ffn(x))
        mems = new
        want.append(model.lm_head(model.norm(x)))
    torch.testing.assert_close(got, torch.cat(want, 1), **TOL)


@torch.no_grad()
def test_same_length_applies_to_a_padded_segment_too():
    """With a padding mask, same_length still limits each query to the mem_len most recent
    keys: a right-padded segment after a memory gives its real tokens the logits of the
    segment cut at its end (same memory), and an unpadded row those of the row alone."""
    model = tiny(mem_len=6, same_length=True)
    idx = torch.randint(0, 40, (2, 13))
    memory = model(idx[:, :6]).memory  # m + t = 13 > mem_len: the window bites
    attention_mask = torch.ones(2, 7, dtype=torch.long)
    attention_mask[1, 4:] = 0
    out = model(idx[:, 6:], memory=memory, attention_mask=attention_mask)
    alone = model(idx[:1, 6:], memory=[m[:1] for m in memory]).logits
    torch.testing.assert_close(out.logits[0], alone[0], **TOL)
    cut = model(idx[1:, 6:10], memory=[m[1:] for m in memory]).logits
    torch.testing.assert_close(out.logits[1, :4], cut[0], **TOL)


@torch.no_grad()
def test_eager_backend_is_accepted_and_computes_the_same():
    """The refusal of the backends XL's attention never calls leaves eager (and the default
    sdpa): the relative attention forms its scores itself, so the logits are the same."""
    model = tiny(mem_len=8)
    eager = build_model(model.cfg.override({"attention.backend": "eager"})).eval()
    assert eager.cfg.attention.backend == "eager"
    eager.load_state_dict(model.state_dict())
    idx = torch.randint(0, 40, (2, 9))
    torch.testing.assert_close(eager(idx).logits, model(idx).logits, rtol=0, atol=0)


@torch.no_grad()
def test_defaults_are_bitwise_the_former_forward():
    """The xl-tiny preset: clamp_len None and same_length False compute exactly what each
    layer computed alone before (its own unclamped encodings, causality only); a clamp at
    or above every distance and a same-length window holding every key change nothing."""
    torch.manual_seed(0)
    cfg = get_preset("xl-tiny")
    model = build_model(cfg).eval()
    idx = torch.randint(0, 256, (2, 12))
    first = model(idx[:, :7])
    got = model(idx[:, 7:], memory=first.memory).logits
    x = model.tok_emb(idx[:, 7:])
    for block, mem in zip(model.blocks, first.memory):
        x = block(x, mem)  # encodings=None: the layer computes them, unclamped
    assert torch.equal(got, model.lm_head(model.norm(x)))
    for change in ({"clamp_len": 11}, {"same_length": True, "mem_len": 12}):
        other = build_model(ModelConfig.from_dict({**cfg.to_dict(), **change})).eval()
        other.load_state_dict(model.state_dict())
        out = other(idx[:, 7:], memory=[mm[:, -7:] for mm in first.memory])
        assert torch.equal(out.logits, model(idx[:, 7:], memory=first.memory).logits)


def test_longer_memory_at_evaluation_with_clamp_len():
    """Trained with mem_len 4 (distances up to 4 + t - 1 = 7), evaluated with mem_len 24:
    with clamp_len 7 no distance has an encoding training never met (every key past 7
    reads R_7), and the stream's loss equals the reference's. Gradients stay finite."""
    model = tiny(mem_len=4)
    tokens = torch.randint(0, 40, (41,))
    model.cfg = model.cfg.override({"mem_len": 24, "clamp_len": 7, "same_length": True})
    total, count = xl_loss_sums(model, tokens, 4)
    segments = [slice(k, k + 4) for k in range(0, 40, 4)]
    with torch.no_grad():
        want = reference_segments(model, tokens[None], segments, mem_len=24, clamp_len=7,
                                  same_length=True)  # fmt: skip
    loss = F.cross_entropy(want[0], tokens[1:], reduction="sum")
    assert count == 40 and total == pytest.approx(float(loss), rel=1e-5)
    table = relative_encodings(28, 32, clamp_len=7)  # distances 27, ..., 0
    assert torch.equal(table[:21], table[20].expand(21, -1))  # 27 ... 7 all read R_7
    model.train()
    out = model(tokens[None, :4], targets=tokens[None, 1:5])
    out = model(tokens[None, 4:8], memory=out.memory, targets=tokens[None, 5:9])
    out.loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and g.isfinite().all() for g in grads)
    assert all(bool(block.attn.r.weight.grad.abs().sum()) for block in model.blocks)


def test_eval_sets_a_longer_memory_clamp_len_and_same_length(tmp_path, capsys):
    """attnlab eval --set model.mem_len/clamp_len/same_length: the stream's loss is the
    model's under those settings, its weights as trained; other fields are refused."""
    from attnlab.config import RunConfig
    from attnlab.tokenizers import train_tokenizer
    from attnlab.training.checkpoint import save_checkpoint

    text = "the memory of a transformer carries the segments along " * 3
    tokenizer = train_tokenizer("char", [text])
    model = tiny(mem_len=4, max_seq_len=8)
    save_checkpoint(tmp_path / "ckpt", model, RunConfig(model=model.cfg, task="lm-stream"),
                    tokenizer)  # fmt: skip
    (tmp_path / "text.txt").write_text(text)
    ev = ["eval", "--ckpt", str(tmp_path / "ckpt"), "--data", str(tmp_path / "text.txt")]
    ev += ["--block-size", "4", "--json"]
    settings = {"mem_len": 40, "clamp_len": 7, "same_length": True}
    sets = [f"--set=model.{k}={json.dumps(v)}" for k, v in settings.items()]
    assert main([*ev, *sets]) == 0
    report = json.loads(capsys.readouterr().out)
    model.cfg = model.cfg.override(settings)
    tokens = torch.as_tensor(tokenizer.encode_array(text).astype("int64"))
    total, count = xl_loss_sums(model, tokens, 4)
    assert report["memory"] == 40 and report["tokens"] == count
    assert report["loss"] == pytest.approx(total / count, rel=1e-6)
    assert main(ev) == 0
    assert json.loads(capsys.readouterr().out)["loss"] != pytest.approx(report["loss"])
    assert main([*ev[:-1], *sets]) == 0  # the text line names the settings
    assert "memory 40 carried, distances clamped at 7, same length)" in capsys.readouterr().out
    for bad, message in (
        ("model.n_layers=1", "--set model.n_layers: eval changes only evaluation settings; "
         "those of this model: model.mem_len, model.clamp_len, model.same_length"),
        ("model.clamp_len=0", "--set model.clamp_len: must be a positive integer or null"),
    ):  # fmt: skip
        assert main([*ev, "--set", bad]) == 1
        assert message in capsys.readouterr().err


def test_generate_sets_a_longer_memory(tmp_path, capsys):
    """attnlab generate --set model.mem_len (clamp_len, same_length): the greedy tokens of
    the Python API's generation by a model built with those settings, the same weights;
    other fields are refused by name, as eval refuses them."""
    from attnlab.config import RunConfig
    from attnlab.training.checkpoint import save_checkpoint

    model = tiny(mem_len=4, max_seq_len=8)
    save_checkpoint(tmp_path / "ckpt", model, RunConfig(model=model.cfg, task="lm-stream"), None)
    prompt = torch.randint(0, 40, (19,)).tolist()  # read in segments of max_seq_len
    gen = ["generate", "--ckpt", str(tmp_path / "ckpt"), "--temperature", "0"]
    gen += ["--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", "30"]
    outputs = {}
    for settings in ({}, {"mem_len": 24}, {"mem_len": 24, "clamp_len": 5, "same_length": True}):
        sets = [f"--set=model.{k}={json.dumps(v)}" for k, v in settings.items()]
        assert main([*gen, *sets]) == 0
        got = [int(i) for i in capsys.readouterr().out.split(",")][len(prompt) :]
        other = build_model(model.cfg.override(settings)).eval()  # built with them
        other.load_state_dict(model.state_dict())
        assert got == other.generate(prompt, 30)
        outputs[json.dumps(settings)] = got
    assert len(set(map(tuple, outputs.values()))) == 3  # each setting changed the tokens
    for bad, message in (
        ("model.n_layers=1", "--set model.n_layers: generate changes only evaluation settings; "
         "those of this model: model.mem_len, model.clamp_len, model.same_length"),
        ("train.lr=1", "--set train.lr: generate changes only evaluation settings"),
        ("model.mem_len=0", "--set model.mem_len: must be > 0, got 0"),
    ):  # fmt: skip
        assert main([*gen, "--set", bad]) == 1
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1
