"""Options the inference commands share mean the same in each: ``--device`` and ``--dtype``
(one helper each in cli/common.py), and ``--tokenizer`` / ``--max-new-tokens`` refused by
name where the checkpoint has no use for them (never silently ignored)."""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest  # noqa: E402
import torch  # noqa: E402

from attnlab.cli import classify, common  # noqa: E402
from attnlab.cli.main import build_parser, main  # noqa: E402

# every command that loads a checkpoint and runs it, with arguments that parse
MODEL_COMMANDS = {
    "generate": [],
    "eval": [],
    "translate": ["123"],
    "classify": ["x.png"],
    "tag": ["a text"],
    "answer": ["--context", "c", "--question", "q"],
    "fill-mask": ["a [MASK]"],
    "attention-map": ["--out", "m.png"],
}


def _options(command: str) -> dict[str, argparse.Action]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {o: a for a in sub.choices[command]._actions for o in a.option_strings}


@pytest.mark.parametrize("command", MODEL_COMMANDS)
def test_every_model_command_takes_device_and_dtype(command):
    options = _options(command)
    assert options["--device"].default == "auto"
    dtype = options["--dtype"]
    assert dtype.choices == list(common.DTYPES) and dtype.default == "float32"
    args = build_parser().parse_args(
        [command, "--ckpt", "x", *MODEL_COMMANDS[command], "--dtype", "bfloat16"]
    )
    assert (args.device, args.dtype) == ("auto", "bfloat16")


@pytest.mark.parametrize("command", MODEL_COMMANDS)
def test_a_bad_dtype_is_one_usage_line(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--ckpt", "x", *MODEL_COMMANDS[command], "--dtype", "float64"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1
    assert "argument --dtype: invalid choice: 'float64'" in err


@pytest.fixture(scope="module")
def bert_heads(tmp_path_factory):
    """Tiny random BertForSequenceClassification and BertForTokenClassification folders
    with a WordPiece tokenizer.json (test_imported_bert_heads' vocabulary)."""
    transformers = pytest.importorskip("transformers")
    from test_imported_bert_heads import LANGS, TAGS, WORDS, wordpiece

    root = tmp_path_factory.mktemp("heads")
    heads = {"seq": ("BertForSequenceClassification", LANGS),
             "tok": ("BertForTokenClassification", TAGS)}  # fmt: skip
    for name, (cls, labels) in heads.items():
        config = transformers.BertConfig(
            vocab_size=len(WORDS), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=48, max_position_embeddings=32, id2label=labels,
        )  # fmt: skip
        torch.manual_seed(0)
        model = getattr(transformers, cls)(config).eval()
        with torch.no_grad():  # clear margins between the classes
            for weight, p in model.named_parameters():
                if p.dim() > 1:
                    p.normal_(0.0, 1.0 if weight.startswith("classifier") else 0.2)
        model.save_pretrained(root / name)
        wordpiece().save(str(root / name / "tokenizer.json"))
    return root


def _json(capsys, *argv):
    capsys.readouterr()
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)


def test_classify_and_tag_in_bfloat16_load_bf16_and_agree_with_float32(
    bert_heads, capsys, monkeypatch
):
    loaded = []

    def spy(*args, **kwargs):
        model, cfg, tokenizer = load(*args, **kwargs)
        loaded.append(next(model.parameters()).dtype)
        return model, cfg, tokenizer

    load = common.load_for_inference
    monkeypatch.setattr(common, "load_for_inference", spy)  # tag, answer (load_text_task)
    monkeypatch.setattr(classify, "load_for_inference", spy)
    texts = ["alice lives in paris.", "the dog sat on the mat", "where does bob live?"]
    runs = {}
    for dtype in ("float32", "bfloat16"):
        report = _json(capsys, "classify", "--ckpt", bert_heads / "seq", "--dtype", dtype,
                       "--json", *texts)  # fmt: skip
        tags = _json(capsys, "tag", "--ckpt", bert_heads / "tok", "--dtype", dtype, "--json",
                     *texts)  # fmt: skip
        runs[dtype] = ({t: r["class"] for t, r in report.items()},
                       [[w["tag"] for w in r["words"]] for r in tags])  # fmt: skip
    assert loaded == [torch.float32] * 2 + [torch.bfloat16] * 2
    assert runs["bfloat16"] == runs["float32"]
    classes, tags = runs["float32"]
    assert len(set(classes.values())) > 1 and len({t for row in tags for t in row}) > 1


def test_options_that_do_not_apply_are_refused_not_ignored(tmp_path, capsys):
    from PIL import Image

    from attnlab.config import RunConfig
    from attnlab.data.numbers import CharVocab, CharVocabPair
    from attnlab.models import build_model
    from attnlab.models.seq2seq import Seq2SeqConfig
    from attnlab.presets import get_run_preset
    from attnlab.training.checkpoint import save_checkpoint

    vocab = CharVocabPair(CharVocab("0123456789"), CharVocab("abcdefghij -"))
    cfg = Seq2SeqConfig(vocab_size=len(vocab.target), src_vocab_size=len(vocab.source),
                        share_embeddings=False, max_seq_len=16, d_model=16, n_layers=1)  # fmt: skip
    save_checkpoint(tmp_path / "numbers", build_model(cfg), RunConfig(model=cfg, task="seq2seq"),
                    vocab)  # fmt: skip
    vit = get_run_preset("vit-digits")
    save_checkpoint(tmp_path / "vit", build_model(vit.model), vit, None)
    Image.new("L", (8, 8)).save(tmp_path / "d.png")
    (tmp_path / "tok.json").write_text("{}")  # refused before it is read
    numbers, image = str(tmp_path / "numbers"), str(tmp_path / "vit")
    tok, out, png = str(tmp_path / "tok.json"), str(tmp_path / "m.png"), str(tmp_path / "d.png")
    cases = [
        (["translate", "--ckpt", numbers, "12", "--tokenizer", tok], "--tokenizer applies"),
        (["attention-map", "--ckpt", numbers, "--text", "12", "--out", out, "--tokenizer", tok],
         "--tokenizer applies"),
        (["eval", "--ckpt", numbers, "--tokenizer", tok], "--tokenizer applies"),
        (["eval", "--ckpt", image, "--tokenizer", tok], "--tokenizer applies"),
        (["classify", "--ckpt", image, png, "--tokenizer", tok], "--tokenizer applies"),
        (["attention-map", "--ckpt", image, "--image", png, "--out", out, "--tokenizer", tok],
         "--tokenizer applies"),
        (["attention-map", "--ckpt", image, "--image", png, "--out", out,
          "--max-new-tokens", "3"], "--max-new-tokens is for seq2seq checkpoints"),
    ]  # fmt: skip
    for argv, message in cases:
        capsys.readouterr()
        assert main(argv) == 1, argv
        err = capsys.readouterr().err
        assert err.startswith("attnlab: error: ") and err.count("\n") == 1, err
        assert message in err, (argv, err)
    assert not (tmp_path / "m.png").exists()
