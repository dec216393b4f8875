"""Packed-document training (``data.options.pack_documents``): document boundaries survive
tokenisation, a packed block equals each of its documents run alone through the model
(every backend and position kind), and packing trains, resumes and fails clearly through
the task, the trainer and the CLI.

Shapes: b batch, t block length, V vocabulary size.
"""

from __future__ import annotations

import json
import signal

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from attnlab.config import ConfigError, DataConfig, RunConfig, TrainConfig
from attnlab.data import DOCUMENT_SEPARATOR, EMBEDDED_NAME, prepare_data, read_corpus
from attnlab.functional.attention import BACKENDS, available_backends
from attnlab.functional.masks import document_positions
from attnlab.models import build_model
from attnlab.presets import get_preset, gpt2_style
from attnlab.tasks.lm import IGNORE_INDEX, LanguageModelling, strided_loss_sums
from attnlab.training import load_checkpoint, train
from attnlab.training.metrics import read_metrics

DOCS = {  # a folder corpus: three documents, one starting with spaces (BPE merges them)
    "a.txt": "The first document.\nIt has two lines.",
    "b.txt": "   indented start, then text; " * 3,
    "c/d.txt": "Zed: the last one, a little longer than the others. " * 4,
}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("docs")
    for name, text in DOCS.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


@pytest.fixture(scope="module")
def embedded(cache_dir):
    return prepare_data(DataConfig(), cache_dir=cache_dir)  # the embedded corpus, char level


# ---------------------------------------------------------------- document boundaries


@pytest.mark.parametrize("tokenizer", ["char", "bpe"])
def test_document_starts_survive_tokenisation(tokenizer, folder, cache_dir):
    cfg = DataConfig(path=str(folder), tokenizer=tokenizer, bpe_vocab_size=300, val_fraction=0.2)
    data = prepare_data(cfg, cache_dir=cache_dir)
    texts = [text for _, text in read_corpus(folder)]
    stream = np.concatenate([data.train, data.val])
    starts = data.doc_starts.tolist()
    assert len(starts) == len(texts) and starts[0] == 0
    # Each document's tokens decode to its own text (a BPE token that swallows the
    # separator and leading spaces stays with the document before it).
    for i, text in enumerate(texts):
        end = starts[i + 1] if i + 1 < len(starts) else len(stream)
        piece = data.tokenizer.decode(stream[starts[i] : end])
        assert text.strip() in piece and piece.strip() in (text + DOCUMENT_SEPARATOR).strip()
    # The same boundaries when the stream comes back from the cache.
    again = prepare_data(cfg, cache_dir=cache_dir)
    assert again.from_cache and again.doc_starts.tolist() == starts
    # document_ids: per row, counted from the row's first document.
    ids = data.document_ids("train", torch.tensor([0, starts[1] - 1]), 3)
    assert ids.tolist() == [[0, 0, 0], [0, 1, 1]]
    whole = data.document_ids("train", torch.tensor([0]), len(data.train))[0]
    assert torch.equal(torch.unique(whole), torch.arange(int(whole.max()) + 1))
    assert (np.flatnonzero(np.diff(whole.numpy())) + 1).tolist() == [
        s for s in starts[1:] if s < len(data.train)
    ]


def test_embedded_corpus_is_one_document_per_topic(embedded):
    from pydoc_data.topics import topics

    docs = read_corpus(None)
    assert [name for name, _ in docs] == [f"{EMBEDDED_NAME}/{t}" for t in sorted(topics)]
    assert len(embedded.doc_starts) == len(topics)
    stream = np.concatenate([embedded.train, embedded.val])
    for (_, text), start in zip(docs, embedded.doc_starts.tolist()):
        assert embedded.tokenizer.decode(stream[start : start + 30]) == text[:30]


def test_task_blocks_carry_document_ids_and_skip_first_tokens(embedded):
    cfg = RunConfig(
        model=get_preset("llama-tiny"), data=DataConfig(options={"pack_documents": True})
    )
    cfg.train.block_size = 64
    task = LanguageModelling(cfg, data=embedded)
    plain = LanguageModelling(cfg.override({"data.options": {}}), data=embedded)
    boundary = int(embedded.doc_starts[1])
    starts = torch.tensor([boundary - 10, 0])
    x, y, docs = task.batch(starts)
    x0, y0 = plain.batch(starts)
    assert torch.equal(x, x0)
    first = torch.zeros_like(y0, dtype=torch.bool)
    first[0, 9] = True  # target 9 of row 0 is the second document's first token
    assert torch.equal(y, y0.masked_fill(first, IGNORE_INDEX))
    assert docs[0].tolist() == [0] * 10 + [1] * 54 and docs[1].tolist() == [0] * 64
    assert document_positions(docs)[0, 10:13].tolist() == [0, 1, 2]  # positions restart
    # Validation blocks too (evaluation): val token j is token len(train) + j of the stream.
    n_train = len(embedded.train)
    boundary = int(next(s for s in embedded.doc_starts if s >= n_train + 10)) - n_train
    assert boundary + 54 < len(embedded.val)
    x, y, docs = task.blocks("val", torch.tensor([boundary - 10]))
    x0, y0 = plain.blocks("val", torch.tensor([boundary - 10]))
    assert torch.equal(x, x0) and torch.equal(y, y0.masked_fill(first[:1], IGNORE_INDEX))
    assert docs[0].tolist() == [0] * 10 + [1] * 54


# ---------------------------------------------------------------- the model


def _model(preset: str, backend: str, **overrides):
    torch.manual_seed(1)
    over = {"init_std": 0.2, "attention.backend": backend, "max_seq_len": 512, **overrides}
    return build_model(get_preset(preset).override(over))


LENGTHS = [[100, 150, 50], [260, 40]]  # two rows of t = 300: several flash tiles each


def _packed_block(lengths=LENGTHS, vocab=256):
    t = sum(lengths[0])
    g = torch.Generator().manual_seed(2)
    x = torch.randint(0, vocab, (len(lengths), t), generator=g)
    docs = torch.stack(
        [torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in lengths]
    )
    y = torch.randint(0, vocab, x.shape, generator=g)
    y = y.masked_fill(
        torch.cat(
            (docs[:, 1:] != docs[:, :-1], torch.zeros_like(docs[:, :1], dtype=torch.bool)), 1
        ),
        IGNORE_INDEX,
    )
    return x, y, docs


def _alone_losses(model, x, y, lengths):
    """Per-token losses (b, t) with each document run through ``model`` (the eager twin of
    the model under test) on its own."""
    out = torch.zeros(x.shape)
    for row, parts in enumerate(lengths):
        start = 0
        for n in parts:
            part = slice(start, start + n)
            logits = model(x[row : row + 1, part]).logits[0]  # (n, V)
            out[row, part] = F.cross_entropy(logits, y[row, part], reduction="none")
            start += n
    return out


def _packed_losses(model, x, y, docs):
    logits = model(x, doc_ids=docs).logits  # (b, t, V)
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view(y.shape)


CASES = [  # (preset, overrides): learned, rope (GQA, and a sliding window), sinusoidal
    ("gpt2-tiny", {}),
    ("llama-tiny", {}),
    ("llama-tiny", {"attention.sliding_window": 64}),
    ("vaswani-tiny", {}),
]


def _assert_packed_equals_alone(preset, backend, overrides=None, lengths=LENGTHS):
    """The packed block through ``backend`` against each document alone through the eager
    twin (same weights); returns the model, the block and its eager per-token losses."""
    model = _model(preset, backend, **(overrides or {})).eval()
    twin = _model(preset, "eager", **(overrides or {})).eval()
    x, y, docs = _packed_block(lengths)
    with torch.no_grad():
        alone = _alone_losses(twin, x, y, lengths)
        torch.testing.assert_close(_packed_losses(model, x, y, docs), alone, atol=1e-5, rtol=1e-5)
    return model, (x, y, docs), alone


@pytest.mark.parametrize("backend", ["eager", "sdpa", "flash", "flex"])
@pytest.mark.parametrize("preset,overrides", CASES)
def test_packed_block_equals_each_document_alone(backend, preset, overrides):
    model, (x, y, docs), alone = _assert_packed_equals_alone(preset, backend, overrides)
    with torch.no_grad():
        # The mean loss over the targets left: no first token of a document is predicted.
        loss = model(x, targets=y, doc_ids=docs).loss
        torch.testing.assert_close(loss, alone.sum() / (y != IGNORE_INDEX).sum())
        # Positions restart per document: counting on through the block gives other logits.
        if model.cfg.position.kind != "rope":  # RoPE is relative: the same logits
            shifted = model(x, doc_ids=docs, positions=torch.arange(x.shape[1])[None]).logits
            assert not torch.allclose(shifted, model(x, doc_ids=docs).logits, atol=1e-3)


@pytest.mark.parametrize("path", ["naive", "absorbed"])
def test_packed_mla_equals_each_document_alone(path):
    _assert_packed_equals_alone("deepseek-tiny", "flash", {"attention.mla_path": path})


def test_triton_packed_block_equals_documents_alone():
    if "triton" not in available_backends():
        pytest.skip(f"triton: {BACKENDS['triton'].unavailable()}")
    lengths = [[20, 12], [5, 27]]  # short: the Triton interpreter is slow
    _assert_packed_equals_alone("llama-tiny", "triton", lengths=lengths)


def test_packed_gradients_flash_match_eager():
    x, y, docs = _packed_block()
    grads = []
    for backend in ("eager", "flash"):
        model = _model("llama-tiny", backend)
        model(x, targets=y, doc_ids=docs).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        torch.testing.assert_close(
            grads[1][name], g, atol=1e-4, rtol=1e-4, msg=name
        )  # summed over tokens


def test_doc_ids_argument_errors():
    model = _model("llama-tiny", "sdpa")
    x = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(ValueError, match=r"doc_ids must be \(2, 8\)"):
        model(x, doc_ids=torch.zeros(2, 7, dtype=torch.long))
    with pytest.raises(ValueError, match="without a cache"):
        model(x, doc_ids=torch.zeros(2, 8, dtype=torch.long), cache=model.new_cache(2, 16))
    linear = _model("llama-tiny", "sdpa", **{"attention.kind": "linear"})
    with pytest.raises(ValueError, match="attention kind 'linear' cannot keep packed documents"):
        linear(x, doc_ids=torch.zeros(2, 8, dtype=torch.long))


# ---------------------------------------------------------------- task, trainer, CLI


def tiny_packed_run(**train_kw) -> RunConfig:
    model = gpt2_style(
        vocab_size=256, max_seq_len=64, d_model=32, n_layers=2, n_heads=2, dropout=0.1
    )
    train_cfg = dict(batch_size=4, block_size=64, max_steps=6, warmup_steps=2, eval_every=3,
                     eval_batches=2, log_every=1, seed=0)  # fmt: skip
    train_cfg.update(train_kw)
    data = DataConfig(options={"pack_documents": True})
    return RunConfig(model=model, train=TrainConfig(**train_cfg), data=data)


class Interrupt:
    """The dataset, sending SIGTERM to this process while the ``at``-th training batch is
    fetched (mid-step)."""

    def __init__(self, inner, at: int):
        self.inner, self.at, self.calls = inner, at, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def batch(self, split, starts, block_size, device=None):
        if split == "train":
            self.calls += 1
            if self.calls == self.at:
                signal.raise_signal(signal.SIGTERM)
        return self.inner.batch(split, starts, block_size, device)


def test_packed_gradient_accumulation_equals_one_big_batch(tmp_path, cache_dir):
    """Packed blocks lose a target at each document start, so micro-batches hold different
    numbers of targets: weighed by them (Task.loss_terms), two micro-batches of 4 are one
    batch of 8 (each micro-batch's mean weighing the same, they were not)."""
    root = tmp_path / "docs"
    root.mkdir()
    rng = np.random.default_rng(0)
    for i in range(60):  # many short documents: blocks cross different numbers of starts
        (root / f"{i:02d}.txt").write_text("word " * int(rng.integers(2, 12)))
    data = prepare_data(DataConfig(path=str(root), val_fraction=0.2), cache_dir=cache_dir)
    kw = dict(max_steps=3, eval_every=0, block_size=16)
    runs = {
        "big": tiny_packed_run(batch_size=8, **kw),
        "acc": tiny_packed_run(batch_size=4, grad_accum=2, **kw),
    }
    results = {}
    for name, cfg in runs.items():
        cfg = cfg.override({"model.dropout": 0.0})
        results[name] = train(cfg, tmp_path / name, dataset=data, progress=False)
    np.testing.assert_allclose(results["acc"].losses, results["big"].losses, rtol=1e-5)

    def grad_norms(name):
        rows = read_metrics(tmp_path / name / "metrics.jsonl")
        return [r["grad_norm"] for r in rows if r["kind"] == "train"]

    # Adam hides a gradient scale error from the losses; the norms show it.
    np.testing.assert_allclose(grad_norms("acc"), grad_norms("big"), rtol=1e-5)


def test_packed_training_learns_and_resumes_exactly(tmp_path, embedded):
    cfg = tiny_packed_run()
    straight = train(cfg, tmp_path / "straight", dataset=embedded, progress=False)
    first = train(cfg, tmp_path / "run", dataset=Interrupt(embedded, at=4), progress=False)
    assert first.interrupted == "SIGTERM" and first.step == 4  # the step under way ends
    second = train(cfg, tmp_path / "run", resume=tmp_path / "run", dataset=embedded, progress=False)
    assert second.step == 6 and first.losses + second.losses == straight.losses
    a, b = (load_checkpoint(tmp_path / d).model.state_dict() for d in ("run", "straight"))
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert load_checkpoint(tmp_path / "run").config.data.options == {"pack_documents": True}
    # Packing changes what is computed: the same run without it has other losses. The whole
    # run, not its first steps: only a block that crosses a document boundary differs, and
    # which blocks are drawn depends on the corpus (Python 3.10's crossed none in two steps).
    plain = train(cfg.override({"data.options": {}}), tmp_path / "plain", dataset=embedded,
                  progress=False)  # fmt: skip
    assert plain.losses != straight.losses


def test_packed_eval_block_losses_are_means_over_each_blocks_targets():
    """The per-block losses behind the evaluation's sample size (eval_batches_needed) are
    each block's mean over the targets it scores: a packed block leaves out each
    document's first token, so its divisor is not the block length."""
    from attnlab.data import TokenDataset
    from attnlab.tokenizers import train_tokenizer

    tokenizer = train_tokenizer("char", ["abcdefghijklmnopqrstuvwxyz"])
    stream = np.random.default_rng(0).integers(0, 26, 800)
    starts = np.cumsum(np.random.default_rng(1).integers(3, 12, 120))
    doc_starts = np.concatenate(([0], starts[starts < 800]))
    data = TokenDataset(tokenizer, train=stream[:600], val=stream[600:], doc_starts=doc_starts)
    packed = DataConfig(options={"pack_documents": True})
    cfg = RunConfig(model=get_preset("llama-tiny"), data=packed)
    cfg.train.block_size = 16
    task = LanguageModelling(cfg, data=data)
    task.configure_model(cfg.model)
    torch.manual_seed(0)
    model = build_model(cfg.model).eval()
    with torch.no_grad():
        sums = task.eval_sums(model, batch_size=4, max_batches=None)
        x, y, docs = task.blocks("val", torch.arange(data.n_eval_blocks("val", 16)) * 16)
        losses = _packed_losses(model, x, y, docs)  # (b, t); ignored targets: 0
    scored = (y != IGNORE_INDEX).sum(1)
    assert (scored < 16).all() and scored.unique().numel() > 1
    per_block = losses.sum(1) / scored
    assert sums["blocks"] == len(per_block) and sums["tokens"] == scored.sum()
    assert sums["block_loss_sum"] == pytest.approx(float(per_block.sum()), rel=1e-5)
    assert sums["block_loss_sq"] == pytest.approx(float((per_block**2).sum()), rel=1e-5)


@pytest.mark.parametrize(
    "preset,overrides,kind",
    [
        ("llama-tiny", {"attention.kind": "linear"}, "'linear'"),
        ("llama-tiny", {"attention.kind": "nsa"}, "'nsa'"),
        ("deepseek-v32-tiny", {}, "'dsa'"),
        ("xl-tiny", {}, "arch 'xl'"),
    ],
)
def test_models_without_document_ids_fail_early(preset, overrides, kind, embedded):
    cfg = RunConfig(model=get_preset(preset).override(overrides),
                    data=DataConfig(options={"pack_documents": True}))  # fmt: skip
    task = LanguageModelling(cfg, data=embedded)
    with pytest.raises(ConfigError, match=f"^data.options.pack_documents: .*{kind}") as e:
        task.configure_model(cfg.model)
    assert "\n" not in str(e.value)


def test_options_are_typed():
    cfg = RunConfig().override({"data.options.pack_documents": True})
    assert LanguageModelling.data_options(cfg).pack_documents is True
    with pytest.raises(ConfigError, match="data.options.pack_docs: unknown key; did you mean"):
        RunConfig().override({"data.options.pack_docs": True})
    with pytest.raises(ConfigError, match="data.options.pack_documents: expected true/false"):
        RunConfig().override({"data.options.pack_documents": "yes"})


def test_cli_trains_packed_and_evaluates(tmp_path, folder, capsys, monkeypatch):
    from attnlab.cli.main import main

    monkeypatch.setenv("ATTNLAB_CACHE", str(tmp_path / "cache"))
    argv = ["train", "--preset", "gpt2-tiny", "--data", str(folder), "--out", str(tmp_path / "run")]
    argv += ["--max-steps", "2", "--quiet", "--set", "data.options.pack_documents=true"]
    argv += ["--set", "train.batch_size=2", "--set", "train.block_size=24"]
    argv += ["--set", "data.val_fraction=0.5", "--set", "model.attention.backend=flash"]
    assert main(argv) == 0, capsys.readouterr().err
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["data"]["options"] == {"pack_documents": True}
    capsys.readouterr()
    assert main(["eval", "--ckpt", str(tmp_path / "run"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    data = prepare_data(load_checkpoint(tmp_path / "run").config.data)
    walked = (len(data.val) - 1) // 24 * 24
    ids = data.document_ids("val", torch.tensor([0]), walked + 1)[0]
    assert result["tokens"] == walked - int((ids[1:] != ids[:-1]).sum())
    assert result["characters"] == result["tokens"]  # char tokens: one character each
    # --data FOLDER: its documents apart too (each first token not a target)
    assert main(["eval", "--ckpt", str(tmp_path / "run"), "--data", str(folder), "--json"]) == 0
    on_folder = json.loads(capsys.readouterr().out)
    from attnlab.data import DOCUMENT_SEPARATOR, read_corpus

    texts = [text for _, text in read_corpus(str(folder))]
    starts = np.cumsum([len(t) + len(DOCUMENT_SEPARATOR) for t in texts[:-1]])  # char level
    walked = (len(DOCUMENT_SEPARATOR.join(texts)) - 1) // 24 * 24  # targets 1..walked
    assert on_folder["tokens"] == walked - int(((starts >= 1) & (starts <= walked)).sum())
    # --stride: each document's windows on their own, equal to scoring each document alone
    run = ["eval", "--ckpt", str(tmp_path / "run"), "--data", str(folder), "--json"]
    assert main([*run, "--stride", "8"]) == 0
    strided = json.loads(capsys.readouterr().out)
    loaded = load_checkpoint(tmp_path / "run")
    total = count = 0
    with torch.no_grad():
        # a document's tokens run to the next one's first (the separator stays behind)
        spans = [t + DOCUMENT_SEPARATOR for t in texts[:-1]] + texts[-1:]
        for span in spans:
            ids = torch.tensor(loaded.tokenizer.encode(span))
            t, n = strided_loss_sums(loaded.model.eval(), ids, window=24, stride=8)
            total, count = total + t, count + n
    assert strided["tokens"] == count == sum(len(span) - 1 for span in spans)
    assert strided["loss"] == pytest.approx(total / count, rel=1e-5)
    assert strided["characters"] == count  # char tokens: one character each

    bad = argv[:6] + [str(tmp_path / "bad"), *argv[7:-2], "--set", "model.attention.kind=linear"]
    assert main(bad) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("attnlab")
    assert "error: data.options.pack_documents: attention kind 'linear'" in err[0]


def test_cli_counts_characters_cut_across_byte_level_tokens_once(tmp_path, capsys, monkeypatch):
    # Byte tokens (bpe_vocab_size 257: one merge): each CJK character is three or two
    # tokens. bits/char must count the characters of each document's text, whatever the
    # stride: decoding each window's scored tokens alone counted a U+FFFD per stray byte
    # (--stride 1: a "character" per token).
    from attnlab.cli.main import main
    from attnlab.tokenizers import train_tokenizer
    from attnlab.training.checkpoint import save_checkpoint

    monkeypatch.setenv("ATTNLAB_CACHE", str(tmp_path / "cache"))
    texts = ["日本語の文字" * 6, "中文字漢 日本" * 5]
    folder = tmp_path / "docs"
    folder.mkdir()
    for i, text in enumerate(texts):
        (folder / f"{i}.txt").write_text(text, encoding="utf-8")
    tokenizer = train_tokenizer("bpe", [DOCUMENT_SEPARATOR.join(texts)], 257)
    cfg = RunConfig(model=gpt2_style(vocab_size=tokenizer.vocab_size, max_seq_len=32,
                                     d_model=32, n_layers=1, n_heads=2),
                    data=DataConfig(path=str(folder), tokenizer="bpe", bpe_vocab_size=257,
                                    options={"pack_documents": True}))  # fmt: skip
    cfg.train.block_size = 16
    torch.manual_seed(0)
    save_checkpoint(tmp_path / "run", build_model(cfg.model), cfg, tokenizer)
    # every character of each document (and separator) but the first: its first token,
    # a lead byte, is not a target
    spans = [texts[0] + DOCUMENT_SEPARATOR, texts[1]]
    expected = sum(len(span) - 1 for span in spans)
    argv = ["eval", "--ckpt", str(tmp_path / "run"), "--data", str(folder), "--json"]
    for stride in ("1", "5", "16"):
        assert main([*argv, "--stride", stride]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["characters"] == expected, stride
        bits = report["loss"] * report["tokens"] / np.log(2)
        assert report["bits_per_char"] == pytest.approx(bits / expected, rel=1e-6)
