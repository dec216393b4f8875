"""RoBERTa and XLM-RoBERTa checkpoints: transformers models (masked LM, base model, sequence,
token and QA heads) from tiny random configs with every weight set to random values, loaded
with ``load_hf``, give the same outputs on left- and right-padded batches (positions counted
past the padding id, as transformers derives them from the ids), the same losses and
gradients; attnlab models saved with ``save_hf`` load in transformers with the same outputs
and load back into attnlab exactly; configs neither side can hold are refused by name, and
BERT- and ModernBERT-shaped encoders still export as theirs. ``fill-mask`` and ``classify``
run an imported RoBERTa folder (byte-level BPE with <s> </s> <pad> <mask>) as transformers'
pipelines do, and ``roberta-tiny`` trains on the mlm task.

Shapes: b batch, t length, V vocabulary, d d_model.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from hf_cases import transformers
from oracle import randomize_weights
from safetensors.torch import load_file

from attnlab.config import ConfigError, ModelConfig
from attnlab.interop import (
    HFCheckpointError,
    config_from_hf,
    config_to_hf,
    hf_model_type,
    load_hf,
    save_hf,
)
from attnlab.models.encoder import EncoderModel
from attnlab.presets import get_preset

V = 53
# float32, the two libraries' operations in other orders (observed under 2e-6)
TOL = 1e-5
CASES = {
    # the published models' settings in small: pad 1 (positions from 2), one token type,
    # eps 1e-5, GELU, a tied decoder
    "published": dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=22,  # 20 tokens past pad_token_id 1
        type_vocab_size=1,
        layer_norm_eps=1e-5,
    ),
    # another padding id (3: positions from 4), two token types, ReLU in the layers (the
    # masked-LM head's GELU is its own), an untied decoder, an eps large enough to matter
    "pad3-relu-untied": dict(
        hidden_size=24,
        intermediate_size=40,
        num_hidden_layers=3,
        num_attention_heads=2,
        max_position_embeddings=24,
        type_vocab_size=2,
        pad_token_id=3,
        hidden_act="relu",
        tie_word_embeddings=False,
        layer_norm_eps=0.05,
    ),
}
HEADS = {
    "RobertaForMaskedLM": lambda o: o.logits,
    "RobertaModel": lambda o: o.last_hidden_state,
    "RobertaForSequenceClassification": lambda o: o.logits,
    "RobertaForTokenClassification": lambda o: o.logits,
    "RobertaForQuestionAnswering": lambda o: torch.stack((o.start_logits, o.end_logits), -1),
    "XLMRobertaForMaskedLM": lambda o: o.logits,
    "XLMRobertaForSequenceClassification": lambda o: o.logits,
}
PARAMS = [(c, h) for c in CASES for h in HEADS if c == "published" or "XLM" not in h]


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """LayerNorm weights in [0.5, 1.5), biases and every other weight random."""
    randomize_weights(model, seed, std=0.3, norms=(0.5, 1.5),
                      is_norm=lambda name, p: "LayerNorm.weight" in name
                      or "layer_norm.weight" in name)  # fmt: skip


def _hf_config(case: str, name: str = "RobertaForMaskedLM", **changes):
    labels = 2 if name.endswith("QuestionAnswering") else 3
    config_class = transformers.XLMRobertaConfig if "XLM" in name else transformers.RobertaConfig
    cfg = config_class(
        vocab_size=V, num_labels=labels, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, **{**CASES[case], **changes},
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    return cfg


def _hf_model(case: str, name: str, seed: int = 0, **changes):
    torch.manual_seed(seed)
    model = getattr(transformers, name)(_hf_config(case, name, **changes))
    _randomize(model, seed)
    return model.eval()


def _batch(pad: int, side: str, seed: int = 0, t: int = 14):
    """(b, t) ids, their mask and token types: rows of t, 9 and 4 real tokens, padded with
    ``pad`` on ``side``; the real tokens are never ``pad``."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, V - 1, (3, t), generator=g)
    idx = idx + (idx >= pad).long()  # every id but pad
    mask = torch.ones_like(idx)
    for row, n in ((1, 9), (2, 4)):
        if side == "right":
            mask[row, n:] = 0
        else:
            mask[row, : t - n] = 0
    types = torch.randint(0, 2, idx.shape, generator=g) * mask
    return idx.masked_fill(mask == 0, pad), mask, types


def _real(out: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The outputs at real tokens (per-token heads) or every row (sequence heads)."""
    return out[mask.bool()] if out.dim() == 3 else out


@pytest.fixture(scope="module", params=PARAMS, ids=[f"{c}-{h}" for c, h in PARAMS])
def imported(request, tmp_path_factory):
    """(case, head class, transformers model, attnlab model loaded from its folder)."""
    case, name = request.param
    ref = _hf_model(case, name, seed=len(case) + len(name))
    path = tmp_path_factory.mktemp("hf")
    ref.save_pretrained(path)
    return case, name, ref, load_hf(path)


def test_import_config(imported):
    case, name, ref, model = imported
    cfg, hf = model.cfg, ref.config
    # RobertaModel's pooler (no head uses it; not read), an untied decoder's lm_head.bias
    # (transformers 5 ties neither: its forward adds lm_head.decoder.bias)
    unused = ("pooler.", "lm_head.bias") if not hf.tie_word_embeddings else ("pooler.",)
    extra = sum(p.numel() for n, p in ref.named_parameters() if n.startswith(unused))
    assert model.num_parameters() == ref.num_parameters() - extra
    assert config_from_hf(hf.to_dict()) == cfg  # the in-memory config, not only config.json
    assert hf_model_type(cfg) == "roberta"
    assert cfg.position.padding_idx == hf.pad_token_id
    assert cfg.max_seq_len == hf.max_position_embeddings - hf.pad_token_id - 1
    assert model.pos_emb.weight.shape[0] == hf.max_position_embeddings
    assert cfg.classifier_transform == "roberta" and cfg.type_vocab_size == hf.type_vocab_size
    assert (cfg.head_activation or cfg.ffn.activation) == "gelu"  # the LM head's, always


@pytest.mark.parametrize("side", ["right", "left"])
def test_import_outputs_with_padding(imported, side):
    """Hidden states and every head's logits at the real tokens of a batch padded on
    ``side`` with the padding id (token types where the model has two), and the positions
    transformers derives from the ids."""
    case, name, ref, model = imported
    pad = ref.config.pad_token_id
    idx, mask, types = _batch(pad, side)
    kw = {"token_type_ids": types} if ref.config.type_vocab_size > 1 else {}
    with torch.no_grad():
        theirs = HEADS[name](ref(input_ids=idx, attention_mask=mask, **kw))
        ours = model(idx, attention_mask=mask, **kw).logits
    assert theirs.abs().max() > 1.0  # the comparison is not between near-zero outputs
    assert (_real(ours, mask) - _real(theirs, mask)).abs().max() <= TOL
    want = ref.base_model.embeddings.create_position_ids_from_input_ids(idx, pad)
    assert torch.equal(model.pos_emb.positions(idx), want)
    # a row's real tokens are at pad + 1, pad + 2, ... whatever padding precedes them
    row = idx[2][mask[2].bool()]
    assert model.pos_emb.positions(row[None]).tolist() == [list(range(pad + 1, pad + 5))]


@torch.no_grad()
def test_padded_row_equals_the_row_alone(imported):
    case, name, ref, model = imported
    idx, mask, _ = _batch(ref.config.pad_token_id, "left", seed=1)
    ours = model(idx, attention_mask=mask).logits
    alone = model(idx[2:3, -4:]).logits
    if ours.dim() == 3:
        assert (ours[2:3, -4:] - alone).abs().max() <= TOL
    elif name.endswith("SequenceClassification"):  # (the first token: padding on the left)
        right, rmask, _ = _batch(ref.config.pad_token_id, "right", seed=1)
        assert (model(right, attention_mask=rmask).logits[2:3] - model(right[2:3, :4]).logits
                ).abs().max() <= TOL  # fmt: skip


def _targets(name: str, idx: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    if name.endswith("MaskedLM"):
        return torch.where(torch.rand(idx.shape, generator=g) < 0.4, idx, -100).masked_fill(
            mask == 0, -100
        )
    if name.endswith("SequenceClassification"):
        return torch.randint(0, 3, (idx.shape[0],), generator=g)
    return torch.randint(0, 3, idx.shape, generator=g).masked_fill(mask == 0, -100)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("name", ["RobertaForMaskedLM", "RobertaForSequenceClassification",
                                  "RobertaForTokenClassification"])  # fmt: skip
def test_loss_and_gradients_match_transformers(name, side, tmp_path):
    """A loss backward in training mode on a padded batch: the loss and the gradients of the
    token and position embeddings (padding's rows untrained in both), a block's weights, the
    heads' are transformers'."""
    ref = _hf_model("pad3-relu-untied", name, seed=3).train()
    ref.save_pretrained(tmp_path)
    model = load_hf(tmp_path).train()
    idx, mask, types = _batch(3, side, seed=2)
    targets = _targets(name, idx, mask)
    ours = model(idx, attention_mask=mask, token_type_ids=types, targets=targets).loss
    theirs = ref(input_ids=idx, attention_mask=mask, token_type_ids=types, labels=targets).loss
    ours.backward()
    theirs.backward()
    assert abs(ours.item() - theirs.item()) <= TOL
    emb, layer, block = ref.roberta.embeddings, ref.roberta.encoder.layer[1], model.blocks[1]
    pairs = [
        (model.tok_emb.weight.grad, emb.word_embeddings.weight.grad),
        (model.pos_emb.weight.grad, emb.position_embeddings.weight.grad),
        (model.type_emb.weight.grad, emb.token_type_embeddings.weight.grad),
        (model.emb_norm.weight.grad, emb.LayerNorm.weight.grad),
        (block.attn.qkv.weight.grad[:24], layer.attention.self.query.weight.grad),
        (block.attn.out.weight.grad, layer.attention.output.dense.weight.grad),
        (block.ffn.up.weight.grad, layer.intermediate.dense.weight.grad),
    ]
    if name == "RobertaForMaskedLM":
        pairs += [(model.head.transform.weight.grad, ref.lm_head.dense.weight.grad),
                  (model.head.decoder.weight.grad, ref.lm_head.decoder.weight.grad)]  # fmt: skip
    elif name == "RobertaForSequenceClassification":
        head = ref.classifier
        pairs += [(model.head.pooler.weight.grad, head.dense.weight.grad),
                  (model.head.classifier.weight.grad, head.out_proj.weight.grad)]  # fmt: skip
    else:
        pairs.append((model.head.classifier.weight.grad, ref.classifier.weight.grad))
    for got, want in pairs:
        assert want.abs().max() > 0  # (a gradient that flows)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert not model.pos_emb.weight.grad[3].any() and not model.tok_emb.weight.grad[3].any()


def test_classification_head_drops_out_before_and_after_its_dense_layer(tmp_path):
    """RoBERTa's head: dropout -> dense -> tanh -> dropout -> out_proj. With only the
    classifier's dropout on and the same random stream, training-mode logits are
    transformers' (BERT's pooler, with dropout after it only, gives other numbers)."""
    ref = _hf_model("published", "RobertaForSequenceClassification", seed=4,
                    classifier_dropout=0.5).train()  # fmt: skip
    ref.save_pretrained(tmp_path)
    model = load_hf(tmp_path).train()
    assert model.cfg.classifier_dropout == 0.5
    idx, mask, _ = _batch(1, "right", seed=3)
    torch.manual_seed(11)
    theirs = ref(input_ids=idx, attention_mask=mask).logits
    torch.manual_seed(11)
    ours = model(idx, attention_mask=mask).logits
    assert (ours - theirs).abs().max() <= TOL
    bert_head = EncoderModel(model.cfg.override({"classifier_transform": "bert"})).train()
    bert_head.load_state_dict(model.state_dict())
    torch.manual_seed(11)
    assert (bert_head(idx, attention_mask=mask).logits - theirs).abs().max() > 1e-3


# --------------------------------------------------------------------------- export


def _tiny(**changes):
    return get_preset("roberta-tiny").override({"vocab_size": V, "max_seq_len": 20, **changes})


EXPORTS = {
    "roberta-tiny": _tiny(),
    "sequence": _tiny(head="sequence", n_labels=3, label_names=["neg", "neu", "pos"]),
    "token": _tiny(head="token", n_labels=4),
    "qa": _tiny(head="qa"),
    "base-model": _tiny(head="none"),
    # padding id 0, two token types, an untied decoder, ReLU layers with the head's GELU
    "pad0-untied-relu": _tiny(
        **{
            "position.padding_idx": 0,
            "type_vocab_size": 2,
            "tie_embeddings": False,
            "ffn.activation": "relu",
            "head_activation": "gelu",
        }
    ),  # fmt: skip
}
AUTO = {
    "mlm": "RobertaForMaskedLM",
    "sequence": "RobertaForSequenceClassification",
    "token": "RobertaForTokenClassification",
    "qa": "RobertaForQuestionAnswering",
    "none": "RobertaModel",
}


def _reimported(cfg):
    """``cfg`` as import reads its export: the labels of a classifier without names
    numbered (as any imported classifier's)."""
    names = cfg.label_names
    if names is None and cfg.head in ("sequence", "token"):
        names = [str(i) for i in range(cfg.n_labels)]
    return cfg.override({"label_names": names})


@pytest.mark.parametrize("name", list(EXPORTS))
def test_export_round_trip(name, tmp_path):
    cfg = EXPORTS[name]
    torch.manual_seed(20)
    model = EncoderModel(cfg).eval()
    randomize_weights(model, len(name), std=0.3, norms=(0.5, 1.5))
    assert hf_model_type(cfg) == "roberta"
    save_hf(model, tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    pad = cfg.position.padding_idx
    for side in ("right", "left"):
        idx, mask, types = _batch(pad, side, seed=5)
        kw = {"token_type_ids": types} if cfg.type_vocab_size > 1 else {}
        with torch.no_grad():
            ours = model(idx, attention_mask=mask, **kw).logits
        ref = getattr(transformers, AUTO[cfg.head]).from_pretrained(
            tmp_path, attn_implementation="eager"
        )
        with torch.no_grad():
            theirs = HEADS[AUTO[cfg.head]](ref.eval()(input_ids=idx, attention_mask=mask, **kw))
        assert ours.abs().max() > 1.0
        assert (_real(ours, mask) - _real(theirs, mask)).abs().max() <= TOL
    assert ref.config.max_position_embeddings == cfg.max_seq_len + pad + 1
    if cfg.label_names:
        assert list(ref.config.id2label.values()) == cfg.label_names

    back = load_hf(tmp_path)  # import(export(x)): the same model, the same numbers
    assert back.cfg == _reimported(cfg)
    mine = model.state_dict()
    assert back.state_dict().keys() == mine.keys()
    assert all(torch.equal(v, mine[k]) for k, v in back.state_dict().items())
    save_hf(back, tmp_path / "again")  # export(import(export(x))) writes the same tensors
    twice = load_file(tmp_path / "again" / "model.safetensors")
    assert twice.keys() == stored.keys()
    assert all(torch.equal(twice[k], stored[k]) for k in stored)


@pytest.mark.parametrize("case", list(CASES))
def test_config_round_trips(case):
    """config.json -> attnlab -> config.json keeps every key transformers' RoBERTa reads, and
    attnlab -> config.json -> attnlab is the same config; XLM-RoBERTa reads as RoBERTa."""
    hf = _hf_config(case, "RobertaForSequenceClassification").to_dict()
    hf["architectures"] = ["RobertaForSequenceClassification"]
    cfg = config_from_hf(hf)
    written = config_to_hf(cfg)
    assert written["model_type"] == "roberta"
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "hidden_act", "max_position_embeddings",
                "type_vocab_size", "layer_norm_eps", "pad_token_id", "tie_word_embeddings",
                "initializer_range", "hidden_dropout_prob", "attention_probs_dropout_prob",
                "classifier_dropout", "architectures"):  # fmt: skip
        assert written[key] == hf[key], key
    assert config_from_hf(written) == cfg
    xlm = {**hf, "model_type": "xlm-roberta",
           "architectures": ["XLMRobertaForSequenceClassification"]}  # fmt: skip
    assert config_from_hf(xlm) == cfg
    for name in EXPORTS:
        assert config_from_hf(config_to_hf(EXPORTS[name])) == _reimported(EXPORTS[name])


def test_minimal_config_is_read_as_transformers_fills_it():
    """Without the keys: RobertaConfig's defaults (pad_token_id 1: 512 - 2 = 510 tokens of
    its default 512 positions, two token types, eps 1e-12)."""
    given = {"model_type": "roberta", "hidden_size": 32, "num_attention_heads": 4,
             "num_hidden_layers": 2, "vocab_size": V, "intermediate_size": 16}  # fmt: skip
    hf = transformers.AutoConfig.for_model(**given).to_dict()
    cfg = config_from_hf(given)
    assert cfg == config_from_hf(hf)
    assert (cfg.position.padding_idx, cfg.max_seq_len, cfg.type_vocab_size) == (1, 510, 2)
    assert cfg.head == "none" and cfg.norm.eps == 1e-12


def test_bert_and_modernbert_shaped_encoders_still_export_as_theirs():
    assert hf_model_type(get_preset("bert-tiny-qa")) == "bert"
    assert hf_model_type(get_preset("modernbert-tiny")) == "modernbert"
    assert hf_model_type(get_preset("roberta-tiny")) == "roberta"


@pytest.mark.parametrize("head", ["mlm", "token", "qa", "none"])
def test_classifier_transform_matters_to_the_sequence_head_only(head):
    """Positions past a padding id with BERT's classifier_transform: the heads other than
    the sequence head build no classification transform, so they are RoBERTa's alike; the
    sequence head with BERT's pooler is refused by name."""
    cfg = get_preset("roberta-tiny").override(
        {"head": head, "classifier_transform": "bert", "n_labels": 3}
    )
    assert hf_model_type(cfg) == "roberta"
    with pytest.raises(HFCheckpointError, match="classifier_transform='bert' \\(RoBERTa's is"):
        hf_model_type(cfg.override({"head": "sequence"}))


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"pad_token_id": None}, "config.json pad_token_id=None: RoBERTa counts its positions"),
        ({"max_position_embeddings": 2}, "max_position_embeddings=2 leaves no position past "
         "pad_token_id=1"),
        ({"pad_token_id": V, "max_position_embeddings": 99},
         f"pad_token_id={V} is not below vocab_size={V}"),
        ({"is_decoder": True}, "RoBERTa: is_decoder=true is not supported"),
        ({"position_embedding_type": "relative_key"},
         "RoBERTa: only absolute position embeddings are supported"),
        ({"architectures": ["RobertaForMultipleChoice"]},
         "architecture 'RobertaForMultipleChoice' is not supported"),
        ({"architectures": ["RobertaForQuestionAnswering"], "num_labels": 3, "id2label": None},
         "a QA model has 2 outputs (start, end), got num_labels=3"),
    ],
    ids=["no-pad", "no-positions", "pad-past-vocab", "decoder", "relative", "multiple-choice",
         "qa-labels"],
)  # fmt: skip
def test_config_it_cannot_hold_is_refused_by_name(changes, named):
    hf = {**_hf_config("published").to_dict(), **changes}
    with pytest.raises(HFCheckpointError, match=re.escape(named)):
        config_from_hf(hf)


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"classifier_transform": "bert", "head": "sequence", "n_labels": 3},
         "classifier_transform='bert' (RoBERTa's is 'roberta')"),
        ({"pooling": "mean"}, "pooling='mean' (RoBERTa's is 'cls')"),
        ({"head_activation": "relu"},
         "head_activation (or ffn.activation)='relu' (RoBERTa's is 'gelu')"),
        ({"norm.placement": "pre"}, "RoBERTa uses post-norm LayerNorm with bias"),
        ({"position.padding_idx": None},
         "position.padding_idx=None (RoBERTa counts positions past the padding token's id"),
    ],
)  # fmt: skip
def test_export_refuses_what_roberta_cannot_hold(changes, named, tmp_path):
    cfg = _tiny(**changes)
    with pytest.raises(HFCheckpointError, match=re.escape(named)):
        save_hf(EncoderModel(cfg), tmp_path)
    assert not (tmp_path / "config.json").exists()


@pytest.mark.parametrize(
    "cfg, named",
    [
        ({"arch": "decoder", "position": {"padding_idx": 1}},
         "position.padding_idx: is implemented by the encoder and seq2seq architectures only"),
        ({"arch": "encoder", "vocab_size": 8, "position": {"padding_idx": 8}},
         "position.padding_idx: 8 is the padding token's id: it must be below vocab_size=8"),
        ({"arch": "encoder", "position": {"kind": "sinusoidal", "padding_idx": 1}},
         "position.padding_idx: counts an encoder's learned positions"),
        ({"arch": "encoder", "position": {"padding_idx": -1}}, "position.padding_idx: must be"),
    ],
)  # fmt: skip
def test_padding_idx_outside_learned_encoder_positions_is_refused(cfg, named):
    with pytest.raises(ConfigError, match=re.escape(named)):
        ModelConfig.from_dict(cfg)


# --------------------------------------------------------------------------- commands

WORDS = "the cat sat on the mat . the dog sat on the log . Alice lives in Paris ."


def roberta_tokenizer():
    """A byte-level BPE with RoBERTa's special tokens (<s> 0, <pad> 1, </s> 2, <unk> 3,
    <mask> 4) and its template (<s> text </s>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    trainer = trainers.BpeTrainer(vocab_size=90, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    hf.train_from_iterator([WORDS] * 10, trainer)
    hf.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    return hf


def _fast(hf):
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=hf, bos_token="<s>", eos_token="</s>", cls_token="<s>",
        sep_token="</s>", pad_token="<pad>", unk_token="<unk>", mask_token="<mask>",
    )  # fmt: skip


def _folder(path, cls: str, hf, **config):
    config = transformers.RobertaConfig(
        vocab_size=hf.get_vocab_size(), hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=48, max_position_embeddings=66,
        type_vocab_size=1, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        **config,
    )  # fmt: skip
    torch.manual_seed(0)
    model = getattr(transformers, cls)(config).eval()
    with torch.no_grad():  # larger than the init: outputs differ clearly between tokens
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    model.save_pretrained(path)
    hf.save(str(path / "tokenizer.json"))
    return model


def _run_json(capsys, *argv):
    from attnlab.cli.main import main

    capsys.readouterr()
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)


def test_fill_mask_imported_roberta_equals_the_transformers_pipeline(tmp_path, capsys):
    from attnlab.cli.main import main

    hf = roberta_tokenizer()
    model = _folder(tmp_path / "hf", "RobertaForMaskedLM", hf)
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "imported")]) == 0
    pipeline = transformers.pipeline("fill-mask", model=model, tokenizer=_fast(hf), top_k=4)
    text = "the <mask> sat on the<mask> ."
    want = pipeline(text)  # one list of candidates per mask
    for folder in ("hf", "imported"):
        for written in (text, text.replace("<mask>", "[MASK]")):  # either spelling
            report = _run_json(capsys, "fill-mask", "--ckpt", tmp_path / folder, written,
                               "--top-k", "4", "--json")  # fmt: skip
            assert report["text"] == written and len(report["masks"]) == 2
            for got, ref in zip(report["masks"], want):
                assert [c["id"] for c in got["candidates"]] == [r["token"] for r in ref]
                assert [c["token"] for c in got["candidates"]] == [r["token_str"] for r in ref]
                probs = [c["prob"] for c in got["candidates"]]
                assert probs == pytest.approx([r["score"] for r in ref], rel=1e-4)


def test_classify_imported_roberta_equals_the_text_classification_pipeline(tmp_path, capsys):
    """Texts of different lengths: classify pads them in one batch with <pad>, which the
    positions skip."""
    hf = roberta_tokenizer()
    labels = {0: "neg", 1: "neu", 2: "pos"}
    model = _folder(tmp_path, "RobertaForSequenceClassification", hf, id2label=labels)
    pipe = transformers.pipeline("text-classification", model=model, tokenizer=_fast(hf))
    texts = ["the cat sat on the mat .", "Alice lives", "the dog sat on the log . the cat"]
    report = _run_json(capsys, "classify", "--ckpt", tmp_path, "--top", "3", "--json", *texts)
    for text in texts:
        ranked = pipe(text, top_k=None)
        assert [c for c, _ in report[text]["top"]] == [r["label"] for r in ranked]
        got = [p for _, p in report[text]["top"]]
        assert got == pytest.approx([r["score"] for r in ranked], abs=1e-4)  # (printed to 4)
    assert len({str(report[text]["top"]) for text in texts}) == len(texts)


def test_roberta_tiny_trains_on_mlm(tmp_path, monkeypatch):
    """``--preset roberta-tiny --set task=mlm``: the task gives padding an id of its own
    past [MASK] (no character is taken for padding), and a few steps train."""
    import math

    from attnlab.presets import get_run_preset
    from attnlab.training import load_checkpoint, train

    monkeypatch.setenv("ATTNLAB_CACHE", str(tmp_path / "cache"))
    (tmp_path / "text.txt").write_text(WORDS * 40)
    cfg = get_run_preset("roberta-tiny").override({
        "task": "mlm", "train.max_steps": 2, "train.batch_size": 2, "train.block_size": 16,
        "train.eval_every": 0, "data.tokenizer": "char", "data.path": str(tmp_path / "text.txt"),
    })  # fmt: skip
    result = train(cfg, tmp_path / "run", progress=False)
    ckpt = load_checkpoint(tmp_path / "run")
    model_cfg, v = ckpt.config.model, ckpt.tokenizer.vocab_size
    assert model_cfg.vocab_size == v + 2  # + [MASK], [PAD]
    assert model_cfg.position.padding_idx == v + 1
    assert math.isfinite(result.train_loss)
    block = torch.arange(v)[None]  # every character: none is padding
    assert ckpt.model.pos_emb.positions(block).tolist() == [list(range(v + 2, 2 * v + 2))]
