"""Imported Hugging Face BERT task heads through attnlab's commands: tiny random
``BertForSequenceClassification``, ``BertForTokenClassification`` and
``BertForQuestionAnswering`` folders with a WordPiece tokenizer.json, run by ``classify``,
``tag`` and ``answer`` (on the Hugging Face folder and on its ``import-hf`` checkpoint) with
the model's own tokenizer and special tokens, against transformers: its text- and
token-classification pipelines, and for question answering (no pipeline in transformers
5) its model's start/end logits searched by a brute-force loop here."""

from __future__ import annotations

import json

import pytest
import torch
from hf_cases import transformers

from attnlab.cli.main import main

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "alice", "bob", "lives", "live", "in",
         "paris", "lyon", "where", "does", "who", "was", "born", "19", "##12", "the", "cat",
         "sat", "on", "mat", ".", "?", "##s", "dog"]  # fmt: skip
SPECIALS = [("[CLS]", 2), ("[SEP]", 3)]
TAGS = {0: "O", 1: "B-PER", 2: "I-PER", 3: "B-LOC", 4: "I-LOC"}
LANGS = {0: "negative", 1: "neutral", 2: "positive"}
HEADS = {  # folder name -> (transformers class, its config's extra fields)
    "sequence": ("BertForSequenceClassification", {"id2label": LANGS}),
    "numbered": ("BertForSequenceClassification", {"num_labels": 3}),
    "token": ("BertForTokenClassification", {"id2label": TAGS}),
    "qa": ("BertForQuestionAnswering", {}),
    "multi": (  # one sigmoid per label (transformers' pipeline and loss)
        "BertForSequenceClassification",
        {"id2label": LANGS, "problem_type": "multi_label_classification"},
    ),
}


def wordpiece():
    """BERT's tokenizer pipeline over ``WORDS`` (lower-casing, [CLS] a [SEP] b [SEP])."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    hf = Tokenizer(models.WordPiece({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    hf.normalizer = normalizers.BertNormalizer(lowercase=True)
    hf.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    hf.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=SPECIALS
    )
    hf.decoder = decoders.WordPiece()
    hf.add_special_tokens(WORDS[:5])
    return hf


def save_small_bert(folder, cls: str, **config) -> None:
    """A one-layer transformers ``cls`` (random weights) and the WordPiece tokenizer in
    ``folder``: a model folder for one error case."""
    config = transformers.BertConfig(
        vocab_size=len(WORDS), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=16, max_position_embeddings=32, **config,
    )  # fmt: skip
    getattr(transformers, cls)(config).save_pretrained(folder)
    wordpiece().save(str(folder / "tokenizer.json"))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """name -> (transformers model, HF folder, imported checkpoint), and the transformers
    tokenizer of the same tokenizer.json."""
    root = tmp_path_factory.mktemp("heads")
    hf = wordpiece()
    out = {}
    for i, (name, (cls, extra)) in enumerate(HEADS.items()):
        config = transformers.BertConfig(
            vocab_size=len(WORDS), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=48, max_position_embeddings=32, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, **extra,
        )  # fmt: skip
        torch.manual_seed(i)
        model = getattr(transformers, cls)(config).eval()
        with torch.no_grad():  # larger than the init: outputs differ clearly between tokens
            for weight, p in model.named_parameters():
                if p.dim() > 1:
                    head = weight.startswith(("classifier", "qa_outputs"))
                    p.normal_(0.0, 1.0 if head else p.shape[-1] ** -0.5)
        model.save_pretrained(root / name)
        hf.save(str(root / name / "tokenizer.json"))
        assert main(["import-hf", str(root / name), str(root / f"{name}-imported")]) == 0
        out[name] = (model, root / name, root / f"{name}-imported")
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=hf, cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]",
        mask_token="[MASK]", unk_token="[UNK]",
    )  # fmt: skip
    return out, fast


def run_json(capsys, *argv):
    capsys.readouterr()
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)


def run_error(capsys, *argv) -> str:
    capsys.readouterr()
    assert main([str(a) for a in argv]) == 1
    err = capsys.readouterr().err
    assert err.startswith("attnlab: error: ") and err.count("\n") == 1, err
    return err


def test_import_records_the_task_and_label_names(folders):
    models, _ = folders
    want = {"sequence": ("text-classification", list(LANGS.values())),
            "numbered": ("text-classification", ["0", "1", "2"]),
            "multi": ("text-classification", list(LANGS.values())),
            "token": ("token-classification", list(TAGS.values())),
            "qa": ("question-answering", None)}  # fmt: skip
    for name, (task, names) in want.items():
        saved = json.loads((models[name][2] / "config.json").read_text())
        assert saved["task"] == task
        assert saved["model"]["label_names"] == names


def test_classify_equals_the_text_classification_pipeline(folders, capsys):
    models, fast = folders
    texts = ["Alice lives in Paris.", "the dog sat on the mat", "Where does Bob live?"]
    for name in ("sequence", "numbered", "multi"):  # multi: a sigmoid per class
        model, hf_dir, ckpt = models[name]
        pipe = transformers.pipeline("text-classification", model=model, tokenizer=fast)
        for folder in (hf_dir, ckpt):
            report = run_json(capsys, "classify", "--ckpt", folder, "--top", "3", "--json", *texts)
            for text in texts:
                ranked = pipe(text, top_k=None)  # every class, best first
                if name == "numbered":  # no names in id2label: the label ids
                    ranked = [{**r, "label": r["label"].removeprefix("LABEL_")} for r in ranked]
                assert report[text]["class"] == ranked[0]["label"]
                assert [c for c, _ in report[text]["top"]] == [r["label"] for r in ranked]
                got = [p for _, p in report[text]["top"]]
                assert got == pytest.approx([r["score"] for r in ranked], abs=1e-4)
            if name == "multi":  # the inputs matter: (independent) scores differ
                assert len({str(report[text]["top"]) for text in texts}) == len(texts)
            else:  # the inputs matter: the class too
                assert len({report[text]["class"] for text in texts}) > 1


def test_tag_equals_the_token_classification_pipeline(folders, capsys):
    models, fast = folders
    model, hf_dir, ckpt = models["token"]
    pipe = transformers.pipeline("token-classification", model=model, tokenizer=fast)
    texts = ["Alice lives in Lyon.", "Bob was born in 1912 in Paris"]
    for folder in (hf_dir, ckpt):
        reports = run_json(capsys, "tag", "--ckpt", folder, "--json", *texts)
        for text, report in zip(texts, reports):
            want = pipe(text, aggregation_strategy="none", ignore_labels=[])  # every token
            got = [
                {"entity": t["tag"], "index": i + 1, "word": t["token"], "start": t["start"],
                 "end": t["end"]}
                for i, t in enumerate(report["tokens"])
            ]  # fmt: skip
            assert got == [{k: w[k] for k in got[0]} for w in want]
            assert 1 < len({t["tag"] for t in report["tokens"]})  # the tokens matter
    assert "1912" in texts[1] and any(t["token"] == "##12" for t in report["tokens"])


def test_tag_shows_the_text_of_unknown_tokens_as_the_pipeline(folders, capsys):
    """A word the WordPiece vocabulary cannot spell is one "[UNK]" token: tag shows the
    text it stands for (its span of the input), as the pipeline does; the words, the
    printed lines and the entities are the text's too."""
    models, fast = folders
    model, hf_dir, ckpt = models["token"]
    pipe = transformers.pipeline("token-classification", model=model, tokenizer=fast)
    text = "Zoë lives in Tokyo, Bob in Lyon!"
    unk = fast.convert_tokens_to_ids("[UNK]")
    enc = fast(text, return_offsets_mapping=True)
    unknown = [text[a:b] for i, (a, b) in zip(enc["input_ids"], enc["offset_mapping"]) if i == unk]
    assert unknown == ["Zoë", "Tokyo", ",", "!"]  # the case is met (and , ! are not in WORDS)
    want = pipe(text, aggregation_strategy="none", ignore_labels=[])
    for folder in (hf_dir, ckpt):
        (report,) = run_json(capsys, "tag", "--ckpt", folder, "--json", text)
        got = [(t["token"], t["tag"], t["start"], t["end"]) for t in report["tokens"]]
        assert got == [(w["word"], w["entity"], w["start"], w["end"]) for w in want]
        assert [t["token"] for t in report["tokens"]] == [
            "Zoë", "lives", "in", "Tokyo", ",", "bob", "in", "lyon", "!"
        ]  # fmt: skip
        assert all("[UNK]" not in e["text"] for e in report["entities"])


def best_answer(model, fast, question: str, context: str, max_tokens: int):
    """(answer, start, end, score) from transformers' QA model: the span i <= j < i +
    ``max_tokens`` of context tokens with the highest start_i + end_j logit, its score
    p_start(i) * p_end(j) with softmax over the context tokens (a loop over all pairs)."""
    enc = fast(question, context, return_offsets_mapping=True, return_token_type_ids=True)
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor([enc["input_ids"]]),
            token_type_ids=torch.tensor([enc["token_type_ids"]]),
        )
    context_tokens = [i for i, s in enumerate(enc.sequence_ids()) if s == 1]
    start, end = out.start_logits[0, context_tokens], out.end_logits[0, context_tokens]
    best = None
    for a in range(len(context_tokens)):
        for b in range(a, min(a + max_tokens, len(context_tokens))):
            if best is None or start[a] + end[b] > start[best[0]] + end[best[1]]:
                best = (a, b)
    a, b = best
    score = float(start.softmax(-1)[a] * end.softmax(-1)[b])
    first, last = enc["offset_mapping"][context_tokens[a]], enc["offset_mapping"][context_tokens[b]]
    return context[first[0] : last[1]], first[0], last[1], score


def test_answer_equals_the_transformers_model(folders, capsys):
    models, fast = folders
    model, hf_dir, ckpt = models["qa"]
    context = "Alice lives in Lyon. Bob was born in 1912 in Paris."
    for question, limit in (("Where does Bob live?", 30), ("Who was born in 1912?", 2)):
        answer, start, end, score = best_answer(model, fast, question, context, limit)
        for folder in (hf_dir, ckpt):
            args = ["--context", context, "--question", question, "--max-answer-tokens", limit]
            report = run_json(capsys, "answer", "--ckpt", folder, *args, "--json")
            assert (report["answer"], report["start"], report["end"]) == (answer, start, end)
            assert report["score"] == pytest.approx(score, abs=1e-4)


def test_answer_refuses_a_context_without_tokens_and_an_empty_question(folders, capsys):
    # BERT's normaliser drops zero-width and control characters: a context of only those
    # has no token to answer with (it was an IndexError from the span search).
    models, fast = folders
    _, hf_dir, ckpt = models["qa"]
    assert fast("\u200b\u0007", add_special_tokens=False)["input_ids"] == []
    for folder in (hf_dir, ckpt):
        err = run_error(capsys, "answer", "--ckpt", folder, "--context", "\u200b\u0007",
                        "--question", "Where does Bob live?")  # fmt: skip
        assert "--context has no tokens" in err
        # no question: transformers' question-answering pipeline refused it too (4.x)
        err = run_error(capsys, "answer", "--ckpt", folder, "--context", "Bob lives in Lyon.",
                        "--question", " ")  # fmt: skip
        assert "--question is empty" in err


def test_answer_refuses_a_model_with_one_token_type(tmp_path, capsys):
    # The context is token type 1, which a one-type model has no embedding for (it was a
    # traceback from inside torch).
    save_small_bert(tmp_path, "BertForQuestionAnswering", type_vocab_size=1)
    err = run_error(capsys, "answer", "--ckpt", tmp_path, "--context", "Bob lives in Lyon.",
                    "--question", "Where does Bob live?")  # fmt: skip
    assert "type_vocab_size=1" in err


def test_export_writes_the_label_names_back(folders, tmp_path, capsys):
    models, _ = folders
    for name in ("sequence", "numbered", "token", "multi"):
        model, hf_dir, ckpt = models[name]
        assert main(["export-hf", str(ckpt), str(tmp_path / name)]) == 0
        back = transformers.AutoConfig.from_pretrained(tmp_path / name)
        assert back.id2label == model.config.id2label  # numbered: LABEL_<i> again
        assert back.problem_type == model.config.problem_type
    # The WordPiece tokenizer names BERT's special tokens: transformers pads a batch (and
    # a fill-mask pipeline finds [MASK]) as with the original tokenizer.
    _, fast = folders
    back = transformers.AutoTokenizer.from_pretrained(tmp_path / "sequence")
    texts = ["Alice lives in Paris.", "the dog"]
    assert back(texts, padding=True)["input_ids"] == fast(texts, padding=True)["input_ids"]
    for name in ("unk", "sep", "pad", "cls", "mask"):
        assert getattr(back, f"{name}_token") == getattr(fast, f"{name}_token")


def test_errors_without_a_tokenizer_and_with_a_foreign_one(folders, tmp_path, capsys):
    import shutil

    heads, _ = folders
    _, hf_dir, ckpt = heads["sequence"]

    bare = tmp_path / "bare"
    shutil.copytree(hf_dir, bare)
    (bare / "tokenizer.json").rename(tmp_path / "wordpiece.json")
    err = run_error(capsys, "classify", "--ckpt", bare, "the cat")
    assert "no tokenizer.json" in err and "--tokenizer FILE" in err
    with_file = run_json(capsys, "classify", "--ckpt", bare, "the cat", "--json",
                         "--tokenizer", tmp_path / "wordpiece.json")  # fmt: skip
    assert with_file == run_json(capsys, "classify", "--ckpt", ckpt, "the cat", "--json")
    for command, args in (("tag", ["the cat"]), ("answer", ["--context", "a", "--question", "b"])):
        bare_head = tmp_path / command
        shutil.copytree(heads["token" if command == "tag" else "qa"][1], bare_head)
        (bare_head / "tokenizer.json").unlink()
        err = run_error(capsys, command, "--ckpt", bare_head, *args)
        assert "no tokenizer.json" in err and "--tokenizer FILE" in err
    # A tokenizer without BERT's special tokens, for a model with no ids past it.
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = WORDS[5:] + ["a", "b", "c", "d", "e"]  # as many as the model's, none past them
    plain = Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="."))
    plain.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    plain.save(str(tmp_path / "plain.json"))
    err = run_error(capsys, "classify", "--ckpt", ckpt, "the cat",
                    "--tokenizer", tmp_path / "plain.json")  # fmt: skip
    assert "no [CLS], [SEP] and [PAD]" in err and "--tokenizer FILE" in err


def test_saved_padding_and_truncation_change_nothing(folders, tmp_path, capsys):
    """transformers' save_pretrained writes the padding and truncation of the tokenizer's
    last call (tokenizer(..., padding="max_length", truncation=True)) into tokenizer.json;
    its pipelines ignore them, and so does attnlab: the same outputs as without them."""
    import shutil

    from tokenizers import Tokenizer

    heads, _ = folders
    text, context, question = "Alice lives in Paris.", "Bob lives in Lyon.", "Where does Bob live?"
    commands = {"sequence": ["classify", "--top", "3", text],
                "token": ["tag", text],
                "qa": ["answer", "--context", context, "--question", question]}  # fmt: skip
    for name, args in commands.items():
        hf_dir = heads[name][1]
        padded = tmp_path / name
        shutil.copytree(hf_dir, padded)
        hf = Tokenizer.from_file(str(padded / "tokenizer.json"))
        hf.enable_truncation(max_length=6)
        hf.enable_padding(pad_id=0, pad_token="[PAD]", length=12)
        hf.save(str(padded / "tokenizer.json"))
        assert main(["import-hf", str(padded), str(tmp_path / f"{name}-imported")]) == 0
        want = run_json(capsys, args[0], "--ckpt", hf_dir, *args[1:], "--json")
        for folder in (padded, tmp_path / f"{name}-imported"):
            assert run_json(capsys, args[0], "--ckpt", folder, *args[1:], "--json") == want


def test_classify_refuses_a_regression_head(tmp_path, capsys):
    save_small_bert(tmp_path, "BertForSequenceClassification", num_labels=1)
    err = run_error(capsys, "classify", "--ckpt", tmp_path, "the cat")
    assert "n_labels=1" in err


def finetune_config(folder, task: str, options: dict):
    """``attnlab train --init-from FOLDER --task TASK``'s config, with small data."""
    from attnlab.cli.train import _finetune_base
    from attnlab.config import RunConfig

    cfg = RunConfig.from_dict(_finetune_base(str(folder)))
    cfg.task, cfg.data.options = task, options
    return cfg


def test_fine_tuning_keeps_the_imported_special_tokens_and_weights(tmp_path):
    """A BertForSequenceClassification fine-tuned on text-classification (--init-from):
    its batches are transformers' tokenizer's ids ([CLS]/[SEP]/[PAD] the WordPiece
    tokenizer's own, not ids past its vocabulary, which the model has no embedding for)
    and the model starts as transformers' ([CLS]-pooled logits); its labels are then the
    task's languages, no longer config.json's id2label."""
    from attnlab.tasks.base import eval_mode
    from attnlab.training.trainer import Trainer

    names = ["a", "b", "c", "d", "e", "f"]  # the task's six languages: the head fits
    config = transformers.BertConfig(
        vocab_size=len(WORDS), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=48, max_position_embeddings=128,
        id2label=dict(enumerate(names)),
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config).eval()
    model.save_pretrained(tmp_path / "hf")
    hf = wordpiece()
    hf.save(str(tmp_path / "hf" / "tokenizer.json"))
    options = {"n_train": 8, "n_val": 4, "n_test": 0, "max_number": 100}
    cfg = finetune_config(tmp_path / "hf", "text-classification", options)
    trainer = Trainer(cfg, tmp_path / "ft", init_from=tmp_path / "hf", progress=False)
    assert trainer.cfg.model.vocab_size == len(WORDS)
    assert trainer.cfg.model.label_names is None  # the task's: en, fr, ...
    texts = [text for text, _ in trainer.task.data.val]
    batch = trainer.task.collate(trainer.task.features["val"])
    fast = transformers.BertTokenizerFast(tokenizer_object=hf)
    theirs = fast(texts, padding=True, return_tensors="pt")
    assert torch.equal(batch["idx"], theirs["input_ids"])
    assert torch.equal(batch["attention_mask"], theirs["attention_mask"])
    with eval_mode(trainer.model), torch.no_grad():
        mine = trainer.task.forward(trainer.model, batch, with_targets=False).logits
        want = model(**theirs).logits
    torch.testing.assert_close(mine, want, rtol=1e-5, atol=1e-5)


def test_fine_tuning_for_another_number_of_labels_starts_a_new_head(folders, tmp_path):
    """The 5-tag BertForTokenClassification fine-tuned on token-classification's 9 tags:
    as transformers' ``from_pretrained(..., ignore_mismatched_sizes=True)``, the classifier
    is new (with a warning naming it) and every other weight the checkpoint's."""
    from attnlab.interop import load_hf
    from attnlab.training.trainer import Trainer

    models, _ = folders
    folder = models["token"][1]
    cfg = finetune_config(folder, "token-classification", {"n_train": 8, "n_val": 4})
    with pytest.warns(UserWarning, match=r"newly initialised: head.classifier.weight \(5, 32\)"):
        trainer = Trainer(cfg, tmp_path / "ft", init_from=folder, progress=False)
    mine, imported = trainer.model.state_dict(), load_hf(folder).state_dict()
    assert mine.keys() == imported.keys()
    for name, weight in imported.items():
        if name.startswith("head.classifier"):
            assert mine[name].shape[0] == 9
        else:
            assert torch.equal(mine[name], weight), name
    assert trainer.cfg.model.label_names is None  # the task's tags, not id2label's
