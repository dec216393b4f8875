"""The encoder commands: ``fill-mask`` (mlm checkpoints with char and BPE tokenizers, and an
imported BertForMaskedLM with a WordPiece tokenizer, against transformers' fill-mask
pipeline), ``classify`` on texts, ``tag`` and ``answer``, each against the model run by
hand on inputs built here, and their one-line errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_bert_tasks import small_run

from attnlab.cli.main import main
from attnlab.models import build_model
from attnlab.presets import get_run_preset
from attnlab.tasks.question_answering import best_span
from attnlab.tasks.token_classification import TAGS
from attnlab.tokenizers import train_tokenizer
from attnlab.training import load_checkpoint, train
from attnlab.training.checkpoint import save_checkpoint

transformers = pytest.importorskip("transformers")

TEXT = "the cat sat on the mat. the dog sat on the log.\n" * 20


def run_json(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)


def run_error(capsys, *argv) -> str:
    assert main(list(argv)) == 1
    err = capsys.readouterr().err
    assert err.startswith("attnlab: error: ") and err.count("\n") == 1, err
    return err


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Tiny checkpoints of the three fine-tuning tasks (a few steps: wiring, not quality)."""
    out = {}
    for task in ("text-classification", "token-classification", "question-answering"):
        folder = tmp_path_factory.mktemp(task)
        train(small_run(task, max_steps=20, eval_every=0), folder, progress=False)
        out[task] = str(folder)
    return out


# --------------------------------------------------------------------------- fill-mask


def mlm_checkpoint(path, kind: str):
    """A random mlm-task encoder with a ``kind`` tokenizer, saved as a checkpoint."""
    tokenizer = train_tokenizer(kind, [TEXT], vocab_size=270)
    cfg = get_run_preset("bert-tiny-mlm").override(
        {
            "model.d_model": 32,
            "model.ffn.hidden_dim": 64,
            "model.max_seq_len": 24,
            "train.block_size": 24,
        }  # fmt: skip
    )
    cfg.model.vocab_size = tokenizer.vocab_size + 1  # + [MASK]
    torch.manual_seed(0)
    model = build_model(cfg.model).eval()
    save_checkpoint(path, model, cfg, tokenizer)
    return model, tokenizer


def top_k(model, ids: list[int], positions: list[int], k: int):
    with torch.no_grad():
        probs = model(torch.tensor([ids])).logits[0, positions].softmax(-1)
    return [probs[i].topk(k) for i in range(len(positions))]


def test_fill_mask_char_checkpoint(tmp_path, capsys):
    model, tok = mlm_checkpoint(tmp_path, "char")
    report = run_json(capsys, "fill-mask", "--ckpt", str(tmp_path), "the c[MASK]t [MASK]at",
                      "--top-k", "3", "--json")  # fmt: skip
    mask = tok.vocab_size  # the id past the tokenizer's
    ids = tok.encode("the c") + [mask] + tok.encode("t ") + [mask] + tok.encode("at")
    want = top_k(model, ids, [5, 8], 3)
    assert [m["position"] for m in report["masks"]] == [5, 8]
    for got, top in zip(report["masks"], want):
        assert [c["id"] for c in got["candidates"]] == top.indices.tolist()
        assert [c["prob"] for c in got["candidates"]] == pytest.approx(top.values.tolist())
        names = [tok.decode([i]) if i < mask else "[MASK]" for i in top.indices.tolist()]
        assert [c["token"] for c in got["candidates"]] == names
    best = [m["candidates"][0]["token"] for m in report["masks"]]
    assert report["filled"] == f"the c{best[0]}t {best[1]}at"
    assert main(["fill-mask", "--ckpt", str(tmp_path), "the c[MASK]t"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("[MASK] 1 (token 5):") and "filled: the c" in out
    one = run_json(capsys, "fill-mask", "--ckpt", str(tmp_path), "the c[MASK]t", "--json")
    (mask,) = one["masks"]  # the text report shows the JSON's 5 (default) candidates
    lines = ["[MASK] 1 (token 5):"]
    lines += [f"  {c['prob']:.4f}  {c['token']!r}" for c in mask["candidates"]]
    assert out == "\n".join([*lines, f"filled: {one['filled']}"]) + "\n"
    assert len(mask["candidates"]) == 5


def test_fill_mask_bpe_puts_the_space_in_the_masked_token(tmp_path, capsys):
    model, tok = mlm_checkpoint(tmp_path, "bpe")
    report = run_json(capsys, "fill-mask", "--ckpt", str(tmp_path), "the [MASK] sat", "--json")
    ids = tok.encode("the") + [tok.vocab_size] + tok.encode(" sat")
    (want,) = top_k(model, ids, [len(tok.encode("the"))], 5)
    assert [c["id"] for c in report["masks"][0]["candidates"]] == want.indices.tolist()
    assert report["filled"] == "the" + report["masks"][0]["candidates"][0]["token"] + " sat"


def wordpiece_bert_folder(path):
    """A tiny random BertForMaskedLM saved with a WordPiece tokenizer.json, and transformers'
    fill-mask pipeline on the same model and tokenizer."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat", "on", "mat",
             ".", "##s", "dog"]  # fmt: skip
    hf = Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    hf.normalizer = normalizers.BertNormalizer(lowercase=True)
    hf.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    hf.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    hf.decoder = decoders.WordPiece()
    hf.add_special_tokens(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    config = transformers.BertConfig(
        vocab_size=len(words), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=48, max_position_embeddings=32, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    ref = transformers.BertForMaskedLM(config).eval()
    ref.save_pretrained(path)
    hf.save(str(path / "tokenizer.json"))
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=hf, mask_token="[MASK]", cls_token="[CLS]", sep_token="[SEP]",
        pad_token="[PAD]", unk_token="[UNK]",
    )  # fmt: skip
    return transformers.pipeline("fill-mask", model=ref, tokenizer=fast, top_k=4)


def test_fill_mask_imported_bert_equals_the_transformers_pipeline(tmp_path, capsys):
    pipeline = wordpiece_bert_folder(tmp_path / "hf")
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "imported")]) == 0
    capsys.readouterr()
    text = "The [MASK] sat on the [MASK]."
    want = pipeline(text)  # one list of candidates per mask
    for folder in ("hf", "imported"):
        report = run_json(capsys, "fill-mask", "--ckpt", str(tmp_path / folder), text,
                          "--top-k", "4", "--json")  # fmt: skip
        assert len(report["masks"]) == 2
        for got, ref in zip(report["masks"], want):
            assert [c["id"] for c in got["candidates"]] == [r["token"] for r in ref]
            assert [c["token"] for c in got["candidates"]] == [r["token_str"] for r in ref]
            probs = [c["prob"] for c in got["candidates"]]
            assert probs == pytest.approx([r["score"] for r in ref], rel=1e-4)


def test_fill_mask_filled_text_is_the_pipelines_sequence(tmp_path, capsys):
    # The filled-in text is the tokenizer's decode, as the pipeline's "sequence": WordPiece
    # joins "dog" "##s" into "dogs" (it printed "The dog##s sat."), lower-cased as normalised.
    wordpiece_bert_folder(tmp_path)
    model = transformers.BertForMaskedLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        model.cls.predictions.bias[11] += 20.0  # "##s" wins at every mask
    model.save_pretrained(tmp_path)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(tmp_path / "tokenizer.json"), mask_token="[MASK]",
        cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]", unk_token="[UNK]",
    )  # fmt: skip
    pipeline = transformers.pipeline("fill-mask", model=model, tokenizer=fast, top_k=1)
    text = "The dog[MASK] sat."
    (want,) = pipeline(text)
    report = run_json(capsys, "fill-mask", "--ckpt", str(tmp_path), text, "--json")
    assert report["masks"][0]["candidates"][0]["token"] == want["token_str"] == "##s"
    assert report["filled"] == want["sequence"] == "the dogs sat."
    assert main(["fill-mask", "--ckpt", str(tmp_path), text]) == 0
    assert capsys.readouterr().out.endswith("filled: the dogs sat.\n")
    # several masks: each filled in (the pipeline's sequences fill one each), as decoded
    report = run_json(capsys, "fill-mask", "--ckpt", str(tmp_path), "cat[MASK] [MASK]", "--json")
    ids = [11 if i == fast.mask_token_id else i for i in fast("cat[MASK] [MASK]")["input_ids"]]
    assert report["filled"] == fast.decode(ids, skip_special_tokens=True) == "catss"


def test_fill_mask_ids_past_the_tokenizer_decode_to_nothing(tmp_path, capsys):
    # A model with more embeddings than its tokenizer has tokens (a padded vocabulary): a
    # candidate id that no token has decodes to nothing, as in the pipeline (it was
    # named "[MASK]", the token the tokenizer has at id 4).
    wordpiece_bert_folder(tmp_path)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(tmp_path / "tokenizer.json"), mask_token="[MASK]",
        cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]", unk_token="[UNK]",
    )  # fmt: skip
    config = transformers.BertConfig.from_pretrained(tmp_path)
    config.vocab_size = len(fast) + 3
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(config).eval()
    with torch.no_grad():
        model.cls.predictions.bias[len(fast) :] += 20.0  # the padded ids win
    model.save_pretrained(tmp_path)
    want = transformers.pipeline("fill-mask", model=model, tokenizer=fast, top_k=4)("the [MASK]")
    report = run_json(capsys, "fill-mask", "--ckpt", str(tmp_path), "the [MASK]", "--top-k",
                      "4", "--json")  # fmt: skip
    (got,) = report["masks"]
    assert [c["id"] for c in got["candidates"]] == [r["token"] for r in want]
    assert [c["token"] for c in got["candidates"]] == [r["token_str"] for r in want]
    assert [c["token"] for c in got["candidates"]][:3] == ["", "", ""]
    assert report["filled"] == want[0]["sequence"] == "the"


def test_fine_tuning_an_imported_bert_on_mlm(tmp_path, monkeypatch):
    """``attnlab train --init-from BERT_FOLDER --task mlm``: the WordPiece stream (whose
    tokens do not spell out the text) is split into its documents, tokens are masked with
    the tokenizer's own [MASK] (no id past its vocabulary, which the model has no
    embedding for), and the loss at the start is transformers' for the same labels."""
    from attnlab.cli.train import _finetune_base
    from attnlab.config import RunConfig
    from attnlab.tasks.base import eval_mode
    from attnlab.training.trainer import Trainer

    monkeypatch.setenv("ATTNLAB_CACHE", str(tmp_path / "cache"))
    wordpiece_bert_folder(tmp_path / "hf")
    ref = transformers.BertForMaskedLM.from_pretrained(tmp_path / "hf").eval()
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text(TEXT)
    (tmp_path / "docs" / "b.txt").write_text("Dogs sat. " * 40)
    cfg = RunConfig.from_dict(_finetune_base(str(tmp_path / "hf")))
    cfg.task, cfg.data.path, cfg.train.block_size = "mlm", str(tmp_path / "docs"), 16
    trainer = Trainer(cfg, tmp_path / "ft", init_from=tmp_path / "hf", progress=False)
    task = trainer.task
    assert task.mask_id == 4 and trainer.cfg.model.vocab_size == 13
    stream = np.concatenate((task.data.train, task.data.val))
    second = int(task.data.doc_starts[1])  # where b.txt begins: "dog", "##s"
    assert stream[second - 1 : second + 2].tolist() == [10, 12, 11]  # ".", "dog", "##s"
    inputs, targets = task.batch(torch.tensor([[0, 1], [30, 2], [60, 3]]))
    assert (inputs == 4).any() and inputs.max() < 13
    with eval_mode(trainer.model), torch.no_grad():
        mine = trainer.model(inputs, targets=targets).loss
        theirs = ref(input_ids=inputs, labels=targets).loss
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)


def test_fill_mask_ignores_saved_padding_and_truncation(tmp_path, capsys):
    # save_pretrained after tokenizer(..., padding="max_length", truncation=True) keeps both
    # in tokenizer.json; the pipeline encodes the text whole and unpadded, so does attnlab.
    from tokenizers import Tokenizer

    pipeline = wordpiece_bert_folder(tmp_path)
    hf = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    hf.enable_truncation(max_length=5)
    hf.enable_padding(pad_id=0, pad_token="[PAD]", length=16)
    hf.save(str(tmp_path / "tokenizer.json"))
    text = "The cat sat on the [MASK]."  # the mask is past the 5 tokens kept by truncation
    (want,) = [pipeline(text)]
    report = run_json(capsys, "fill-mask", "--ckpt", str(tmp_path), text, "--top-k", "4",
                      "--json")  # fmt: skip
    (got,) = report["masks"]
    assert [c["id"] for c in got["candidates"]] == [r["token"] for r in want]
    probs = [c["prob"] for c in got["candidates"]]
    assert probs == pytest.approx([r["score"] for r in want], rel=1e-4)


def test_fill_mask_errors(tmp_path, capsys, trained):
    mlm_checkpoint(tmp_path / "mlm", "char")
    ckpt = str(tmp_path / "mlm")
    assert "no [MASK] in the text" in run_error(capsys, "fill-mask", "--ckpt", ckpt, "the cat")
    err = run_error(capsys, "fill-mask", "--ckpt", ckpt, "the [MASK] " * 5)
    assert "max_seq_len=24" in err
    err = run_error(capsys, "fill-mask", "--ckpt", ckpt, "the [MASK] \u00e9")
    assert "not in the vocabulary" in err
    # A BertForMaskedLM without a tokenizer: one line saying how to give one.
    wordpiece_bert_folder(tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.json").rename(tmp_path / "wordpiece.json")
    capsys.readouterr()  # transformers' progress bars
    err = run_error(capsys, "fill-mask", "--ckpt", str(tmp_path / "hf"), "the [MASK]")
    assert "no tokenizer.json" in err and "--tokenizer" in err
    report = run_json(capsys, "fill-mask", "--ckpt", str(tmp_path / "hf"), "the [MASK]",
                      "--tokenizer", str(tmp_path / "wordpiece.json"), "--json")  # fmt: skip
    assert len(report["masks"]) == 1
    # A model without an MLM head.
    err = run_error(capsys, "fill-mask", "--ckpt", trained["text-classification"], "a [MASK]")
    assert "no masked-LM head" in err


# --------------------------------------------------------------------------- classify, tag, answer


def encoder_logits(ckpt: str, ids: list[int], types: list[int] | None = None) -> torch.Tensor:
    model = load_checkpoint(ckpt).model
    with torch.no_grad():
        t = None if types is None else torch.tensor([types])
        return model(torch.tensor([ids]), token_type_ids=t).logits[0]


def test_classify_texts(trained, capsys):
    ckpt = trained["text-classification"]
    texts = ["einundzwanzig", "ventuno", "twenty-one"]
    report = run_json(capsys, "classify", "--ckpt", ckpt, "--json", *texts)
    loaded = load_checkpoint(ckpt)
    tok, langs = loaded.tokenizer, loaded.config.data.options["langs"]
    v = tok.vocab_size
    for text in texts:
        probs = encoder_logits(ckpt, [v + 1, *tok.encode(text), v + 2]).softmax(-1)
        assert report[text]["class"] == langs[int(probs.argmax())]
        assert [p for _, p in report[text]["top"]] == pytest.approx(
            sorted(probs.tolist(), reverse=True), abs=1e-4
        )
    assert main(["classify", "--ckpt", ckpt, "ventuno"]) == 0
    assert capsys.readouterr().out.startswith("ventuno\t")
    for k in (1, 2):  # --top K: the K likeliest, as the full ranking has them
        top = run_json(capsys, "classify", "--ckpt", ckpt, "--top", str(k), "--json", "ventuno")
        assert top["ventuno"]["top"] == report["ventuno"]["top"][:k]
    assert main(["classify", "--ckpt", ckpt, "--top", "2", "ventuno"]) == 0
    shown = ", ".join(f"{c}: {p:.3f}" for c, p in report["ventuno"]["top"][:2])
    assert capsys.readouterr().out == f"ventuno\t{report['ventuno']['class']}\t({shown})\n"
    assert main(["classify", "--ckpt", ckpt, "ventuno", "dos", "ventuno"]) == 0
    lines = capsys.readouterr().out.splitlines()  # one line per input, repeats included
    assert [line.split("\t")[0] for line in lines] == ["ventuno", "dos", "ventuno"]
    err = run_error(capsys, "classify", "--ckpt", ckpt, "tre" * 40)  # named by its start
    assert "max_seq_len" in err and f"the text {('tre' * 40)[:50]!r}... (120 characters)" in err
    err = run_error(capsys, "classify", "--ckpt", ckpt, "ventuno", "douze!")
    assert "the text 'douze!': " in err and "not in the vocabulary" in err  # which input
    assert "--invert applies to images" in run_error(
        capsys, "classify", "--ckpt", ckpt, "--invert", "ventuno"
    )
    err = run_error(capsys, "classify", "--ckpt", trained["question-answering"], "x")
    assert "text-classification one (attnlab train --preset bert-tiny-langid)" in err


def test_generate_names_the_commands_for_an_encoder_checkpoint(trained, capsys):
    err = run_error(capsys, "generate", "--ckpt", trained["text-classification"], "--prompt", "a")
    assert "arch 'encoder'; generate needs a language model" in err and "classify" in err


def test_tag_command(trained, capsys):
    ckpt = trained["token-classification"]
    text = "Alice Martin moved to New York on May 3."
    (report,) = run_json(capsys, "tag", "--ckpt", ckpt, "--json", text)
    tok = load_checkpoint(ckpt).tokenizer
    encoding = tok.hf.encode(text, add_special_tokens=False)
    v = tok.vocab_size
    logits = encoder_logits(ckpt, [v + 1, *encoding.ids, v + 2])[1:-1]
    tags = [TAGS[i] for i in logits.argmax(-1).tolist()]
    assert [t["tag"] for t in report["tokens"]] == tags
    assert "".join(t["token"] for t in report["tokens"]) == text
    assert [w["word"] for w in report["words"]] == text.split()
    for e in report["entities"]:
        assert text[e["start"] : e["end"]] == e["text"] and e["label"] in (
            "PER",
            "CITY",
            "DATE",
            "NUM",
        )
    for word in report["words"]:  # a word's tag is its first token's
        start = text.index(word["word"])
        first = next(t for t in report["tokens"] if start <= t["start"] < start + len(word["word"]))
        assert word["tag"] == first["tag"]
    assert main(["tag", "--ckpt", ckpt, text, "Bob called."]) == 0
    out = capsys.readouterr().out
    assert out.count("entities:") == 2 and out.startswith("Alice ")
    first_text = out.split("\n\n")[0].splitlines()  # the text report shows the JSON's
    width = max(len(w["word"]) for w in report["words"])
    assert first_text[:-1] == [f"{w['word']:<{width}}  {w['tag']}" for w in report["words"]]
    found = ", ".join(f"{e['label']} {e['text']!r}" for e in report["entities"])
    assert first_text[-1] == f"entities: {found or 'none'}"
    assert "max_seq_len" in run_error(capsys, "tag", "--ckpt", ckpt, "Paris " * 200)
    err = run_error(capsys, "tag", "--ckpt", trained["text-classification"], "Bob")
    assert "token-classification checkpoint (attnlab train --preset bert-tiny-ner)" in err


def test_answer_command(trained, capsys):
    ckpt = trained["question-answering"]
    context, question = "Bob lives in Lyon. Alice was born in 1912.", "Where does Bob live?"
    report = run_json(capsys, "answer", "--ckpt", ckpt, "--context", context,
                      "--question", question, "--json")  # fmt: skip
    tok = load_checkpoint(ckpt).tokenizer
    v = tok.vocab_size
    q = tok.hf.encode(question, add_special_tokens=False)
    c = tok.hf.encode(context, add_special_tokens=False)
    ids = [v + 1, *q.ids, v + 2, *c.ids, v + 2]
    types = [0] * (len(q.ids) + 2) + [1] * (len(c.ids) + 1)
    window = encoder_logits(ckpt, ids, types)[len(q.ids) + 2 : len(q.ids) + 2 + len(c.ids)]
    i, j, score = best_span(window[:, 0], window[:, 1], 30)
    start = c.offsets[i][0] + (context[c.offsets[i][0]] == " ")  # "ĠLyon" -> "Lyon"
    assert (report["start"], report["end"]) == (start, c.offsets[j][1])
    assert report["answer"] == context[start : c.offsets[j][1]]
    assert report["score"] == pytest.approx(score, abs=1e-4)
    assert main(["answer", "--ckpt", ckpt, "--context", context, "--question", question]) == 0
    answer, shown = capsys.readouterr().out.removesuffix("\n").split("\t")
    assert answer == report["answer"] and shown == f"{float(shown):.3f}"  # 3 decimals
    assert float(shown) == pytest.approx(score, abs=6e-4)
    # --max-answer-tokens: the best span of at most that many tokens
    short = run_json(capsys, "answer", "--ckpt", ckpt, "--context", context, "--question",
                     question, "--max-answer-tokens", "1", "--json")  # fmt: skip
    i, j, score = best_span(window[:, 0], window[:, 1], 1)
    assert i == j and short["end"] == c.offsets[j][1]
    assert short["score"] == pytest.approx(score, abs=1e-4)
    err = run_error(
        capsys, "answer", "--ckpt", ckpt, "--context", context * 40, "--question", question
    )
    assert "max_seq_len" in err
    assert "--context is empty" in run_error(
        capsys, "answer", "--ckpt", ckpt, "--context", " ", "--question", question
    )
    err = run_error(capsys, "answer", "--ckpt", trained["token-classification"], "--context", "a",
                    "--question", "b")  # fmt: skip
    assert "question-answering checkpoint (attnlab train --preset bert-tiny-qa)" in err
