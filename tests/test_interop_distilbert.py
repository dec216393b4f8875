"""DistilBERT checkpoints: transformers models (masked LM, base model, sequence, token and QA
heads; learned or sinusoidal positions) from tiny random configs with every weight set to
random values, loaded with ``load_hf``, give the same outputs on left- and right-padded
batches, the same losses and gradients; attnlab models saved with ``save_hf`` load in
transformers with the same outputs and load back into attnlab exactly; configs neither side
can hold are refused by name, and BERT-shaped encoders (token types) still export as BERT.
``fill-mask`` runs an imported DistilBERT folder as transformers' pipeline does.

Shapes: b batch, t length, V vocabulary, d d_model.
"""

from __future__ import annotations

import re

import pytest
import torch
from hf_cases import transformers
from oracle import randomize_weights
from safetensors.torch import load_file

from attnlab.interop import HFCheckpointError, config_from_hf, hf_model_type, load_hf, save_hf
from attnlab.interop.registry import FAMILIES
from attnlab.models.encoder import EncoderModel
from attnlab.presets import get_preset

V = 53
TOL = 1e-5  # float32, the two libraries' operations in other orders
CASES = {
    "learned": dict(dim=32, n_layers=2, n_heads=4, hidden_dim=48, max_position_embeddings=20),
    # sinusoids (attnlab computes them), ReLU, an untied decoder, 3 layers
    "sinusoidal-relu-untied": dict(dim=24, n_layers=3, n_heads=2, hidden_dim=40,
                                   max_position_embeddings=20, sinusoidal_pos_embds=True,
                                   activation="relu", tie_word_embeddings=False),
}  # fmt: skip
HEADS = {
    "DistilBertForMaskedLM": lambda o: o.logits,
    "DistilBertModel": lambda o: o.last_hidden_state,
    "DistilBertForSequenceClassification": lambda o: o.logits,
    "DistilBertForTokenClassification": lambda o: o.logits,
    "DistilBertForQuestionAnswering": lambda o: torch.stack((o.start_logits, o.end_logits), -1),
}
PARAMS = [
    (c, h) for c in CASES for h in HEADS if c == "learned" or "Sequence" in h or "Masked" in h
]


def _is_norm(name: str, p: torch.Tensor) -> bool:
    """The LayerNorm weights (LayerNorm, *_layer_norm), drawn around 1."""
    return name.endswith("weight") and ("LayerNorm" in name or "layer_norm" in name)


def _hf_config(case: str, name: str = "DistilBertForMaskedLM", **changes):
    labels = 2 if name.endswith("QuestionAnswering") else 3
    cfg = transformers.DistilBertConfig(
        vocab_size=V, num_labels=labels,
        **{"dropout": 0.0, "attention_dropout": 0.0, "qa_dropout": 0.0,
           "seq_classif_dropout": 0.0, **CASES[case], **changes},
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    return cfg


def _hf_model(case: str, name: str, seed: int = 0, **changes):
    torch.manual_seed(seed)
    model = getattr(transformers, name)(_hf_config(case, name, **changes))
    sinusoids = model.base_model.embeddings.position_embeddings.weight.detach().clone()
    randomize_weights(model, seed, std=0.3, norms=(0.5, 1.5),
                      is_norm=_is_norm)  # fmt: skip
    if model.config.sinusoidal_pos_embds:  # the fixed table stays the sinusoids
        with torch.no_grad():
            model.base_model.embeddings.position_embeddings.weight.copy_(sinusoids)
    return model.eval()


def _batch(side: str, seed: int = 0, t: int = 12):
    """(b, t) ids (never the padding id 0) and their mask: rows of t, 8 and 3 real tokens."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(1, V, (3, t), generator=g)
    mask = torch.ones_like(idx)
    for row, n in ((1, 8), (2, 3)):
        if side == "right":
            mask[row, n:] = 0
        else:
            mask[row, : t - n] = 0
    return idx.masked_fill(mask == 0, 0), mask


def _real(out: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return out[mask.bool()] if out.dim() == 3 else out


@pytest.fixture(scope="module", params=PARAMS, ids=[f"{c}-{h}" for c, h in PARAMS])
def imported(request, tmp_path_factory):
    case, name = request.param
    ref = _hf_model(case, name, seed=len(case) + len(name))
    path = tmp_path_factory.mktemp("hf")
    ref.save_pretrained(path)
    return case, name, ref, load_hf(path)


def test_import_config(imported):
    case, name, ref, model = imported
    cfg, hf = model.cfg, ref.config
    table = ref.base_model.embeddings.position_embeddings.weight  # (sinusoids: not read)
    extra = table.numel() if hf.sinusoidal_pos_embds else 0
    assert model.num_parameters() == ref.num_parameters() - extra
    assert config_from_hf(hf.to_dict()) == cfg
    assert hf_model_type(cfg) == "distilbert"
    assert cfg.type_vocab_size == 0 and cfg.classifier_transform == "distilbert"
    assert cfg.position.kind == ("sinusoidal" if hf.sinusoidal_pos_embds else "learned")
    if name.endswith("SequenceClassification"):
        assert cfg.classifier_dropout == hf.seq_classif_dropout
    if hf.sinusoidal_pos_embds:  # attnlab's sinusoids are transformers' table
        ours = model.pos_emb(torch.arange(hf.max_position_embeddings))
        assert (ours - table).abs().max() <= 1e-6


@pytest.mark.parametrize("side", ["right", "left"])
def test_import_outputs_with_padding(imported, side):
    case, name, ref, model = imported
    idx, mask = _batch(side)
    with torch.no_grad():
        theirs = HEADS[name](ref(input_ids=idx, attention_mask=mask))
        ours = model(idx, attention_mask=mask).logits
    assert theirs.abs().max() > 1.0
    assert (_real(ours, mask) - _real(theirs, mask)).abs().max() <= TOL


@pytest.mark.parametrize("name", ["DistilBertForMaskedLM", "DistilBertForSequenceClassification",
                                  "DistilBertForQuestionAnswering"])  # fmt: skip
def test_loss_and_gradients_match_transformers(name, tmp_path):
    """A loss backward in training mode (dropout off) on a right-padded batch: the loss and
    the gradients of the embeddings, a block's and the head's weights are transformers'."""
    ref = _hf_model("learned", name, seed=3).train()
    ref.save_pretrained(tmp_path)
    model = load_hf(tmp_path).train()
    idx, mask = _batch("right", seed=2)
    g = torch.Generator().manual_seed(7)
    kw = {}
    if name.endswith("MaskedLM"):
        targets = torch.where(torch.rand(idx.shape, generator=g) < 0.4, idx, -100)
        kw["labels"] = targets = targets.masked_fill(mask == 0, -100)
    elif name.endswith("SequenceClassification"):
        kw["labels"] = targets = torch.randint(0, 3, (3,), generator=g)
    else:  # spans inside every row's real tokens; no padding (attnlab's QA loss leaves it
        # out of the candidate positions, transformers' counts it)
        targets = torch.tensor([[1, 4], [0, 6], [2, 2]])
        idx, mask = idx.clamp(min=1), torch.ones_like(mask)
        kw = {"start_positions": targets[:, 0], "end_positions": targets[:, 1]}
    ours = model(idx, attention_mask=mask, targets=targets).loss
    theirs = ref(input_ids=idx, attention_mask=mask, **kw).loss
    ours.backward()
    theirs.backward()
    assert abs(ours.item() - theirs.item()) <= TOL
    emb, layer, block = (
        ref.distilbert.embeddings,
        ref.distilbert.transformer.layer[1],
        model.blocks[1],
    )
    pairs = [
        (model.tok_emb.weight.grad[1:], emb.word_embeddings.weight.grad[1:]),  # (padding's row)
        (model.pos_emb.weight.grad, emb.position_embeddings.weight.grad),
        (block.attn.qkv.weight.grad[:32], layer.attention.q_lin.weight.grad),
        (block.ffn.up.weight.grad, layer.ffn.lin1.weight.grad),
        (block.attn_norm.weight.grad, layer.sa_layer_norm.weight.grad),
    ]
    if name.endswith("MaskedLM"):
        pairs.append((model.head.transform.weight.grad, ref.vocab_transform.weight.grad))
    elif name.endswith("SequenceClassification"):
        pairs.append((model.head.pooler.weight.grad, ref.pre_classifier.weight.grad))
    else:
        pairs.append((model.head.span.weight.grad, ref.qa_outputs.weight.grad))
    for got, want in pairs:
        assert want.abs().max() > 0
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_sequence_head_drops_out_after_relu(tmp_path):
    """pre_classifier -> ReLU -> dropout (seq_classif_dropout) -> classifier: training-mode
    logits with the same random stream are transformers'."""
    ref = _hf_model("learned", "DistilBertForSequenceClassification", seed=4,
                    seq_classif_dropout=0.5).train()  # fmt: skip
    ref.save_pretrained(tmp_path)
    model = load_hf(tmp_path).train()
    assert model.cfg.classifier_dropout == 0.5
    idx, mask = _batch("right", seed=3)
    torch.manual_seed(11)
    theirs = ref(input_ids=idx, attention_mask=mask).logits
    torch.manual_seed(11)
    assert (model(idx, attention_mask=mask).logits - theirs).abs().max() <= TOL


# --------------------------------------------------------------------------- export


def _tiny(**changes):
    return get_preset("distilbert-tiny").override({"vocab_size": V, "max_seq_len": 20, **changes})


EXPORTS = {
    "distilbert-tiny": _tiny(),
    "sinusoidal-untied": _tiny(tie_embeddings=False, **{"position.kind": "sinusoidal"}),
    "sequence": _tiny(head="sequence", n_labels=3, label_names=["a", "b", "c"],
                      classifier_dropout=0.3),
    "token": _tiny(head="token", n_labels=4, label_names=["0", "1", "2", "3"]),
    "qa": _tiny(head="qa", classifier_dropout=0.25),
    "base-model": _tiny(head="none"),
}  # fmt: skip
AUTO = {
    "mlm": "DistilBertForMaskedLM",
    "sequence": "DistilBertForSequenceClassification",
    "token": "DistilBertForTokenClassification",
    "qa": "DistilBertForQuestionAnswering",
    "none": "DistilBertModel",
}


@pytest.mark.parametrize("name", list(EXPORTS))
def test_export_round_trip(name, tmp_path):
    cfg = EXPORTS[name]
    torch.manual_seed(20)
    model = EncoderModel(cfg).eval()
    randomize_weights(model, len(name), std=0.3, norms=(0.5, 1.5))
    assert hf_model_type(cfg) == "distilbert"
    save_hf(model, tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    ref = getattr(transformers, AUTO[cfg.head]).from_pretrained(
        tmp_path, attn_implementation="eager"
    ).eval()  # fmt: skip
    for side in ("right", "left"):
        idx, mask = _batch(side, seed=5)
        with torch.no_grad():
            ours = model(idx, attention_mask=mask).logits
            theirs = HEADS[AUTO[cfg.head]](ref(input_ids=idx, attention_mask=mask))
        assert ours.abs().max() > 1.0
        assert (_real(ours, mask) - _real(theirs, mask)).abs().max() <= TOL
    back = load_hf(tmp_path)
    assert back.cfg == cfg
    mine = model.state_dict()
    assert back.state_dict().keys() == mine.keys()
    assert all(torch.equal(v, mine[k]) for k, v in back.state_dict().items())
    save_hf(back, tmp_path / "again")
    twice = load_file(tmp_path / "again" / "model.safetensors")
    assert twice.keys() == stored.keys()
    assert all(torch.equal(twice[k], stored[k]) for k in stored)


@pytest.mark.parametrize(
    "preset, changes, model_type",
    [
        ("distilbert-tiny", {}, "distilbert"),
        ("distilbert-tiny", {"type_vocab_size": 2, "classifier_transform": "bert"}, "bert"),
        ("bert-tiny-qa", {}, "bert"),
        ("modernbert-tiny", {}, "modernbert"),
        ("roberta-tiny", {}, "roberta"),
        ("albert-tiny", {}, "albert"),
    ],
)
def test_export_picks_one_encoder_family(preset, changes, model_type):
    """DistilBERT takes the encoders without token types that no earlier family claims, and
    no config BERT exports."""
    cfg = get_preset(preset).override(changes)
    assert hf_model_type(cfg) == model_type
    claims = [f.name for f in FAMILIES if f.exports(cfg)]
    assert claims[0] == model_type
    if model_type == "bert":
        assert claims == ["bert"]


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"type_vocab_size": 2}, "type_vocab_size=2 (DistilBERT's is 0)"),
        ({"norm.eps": 1e-5}, "norm.eps=1e-05 (DistilBERT's is 1e-12)"),
        ({"head": "sequence", "classifier_transform": "bert", "type_vocab_size": 0,
          "n_labels": 2}, "classifier_transform='bert' (DistilBERT's is 'distilbert')"),
        ({"head": "token", "classifier_dropout": 0.3},
         "classifier_dropout (the token head's is dropout)=0.3"),
        ({"attention.n_kv_heads": 2}, "DistilBERT uses multi-head attention with head_dim"),
    ],
)  # fmt: skip
def test_export_refuses_what_distilbert_cannot_hold(changes, named, tmp_path):
    with pytest.raises(HFCheckpointError, match=re.escape(named)):
        save_hf(EncoderModel(_tiny(**changes)), tmp_path)
    assert not (tmp_path / "config.json").exists()


def test_config_it_cannot_hold_is_refused_by_name():
    hf = _hf_config("learned").to_dict()
    with pytest.raises(HFCheckpointError, match="sinusoidal_pos_embds=true with dim=33"):
        config_from_hf({**hf, "dim": 33, "n_heads": 1, "sinusoidal_pos_embds": True})
    with pytest.raises(HFCheckpointError, match="'DistilBertForMultipleChoice' is not supp"):
        config_from_hf({**hf, "architectures": ["DistilBertForMultipleChoice"]})


# --------------------------------------------------------------------------- commands


def test_fill_mask_imported_distilbert_equals_the_transformers_pipeline(tmp_path, capsys):
    import json

    from test_interop_roberta import _fast, roberta_tokenizer

    from attnlab.cli.main import main

    hf = roberta_tokenizer()
    config = transformers.DistilBertConfig(
        vocab_size=hf.get_vocab_size(), dim=32, n_layers=2, n_heads=4, hidden_dim=48,
        max_position_embeddings=64, dropout=0.0, attention_dropout=0.0, pad_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.DistilBertForMaskedLM(config).eval()
    randomize_weights(model, 0, std=0.3, norms=(0.5, 1.5))
    model.save_pretrained(tmp_path)
    hf.save(str(tmp_path / "tokenizer.json"))
    want = transformers.pipeline("fill-mask", model=model, tokenizer=_fast(hf), top_k=3)(
        "the <mask> sat on the mat ."
    )
    capsys.readouterr()
    assert main(["fill-mask", "--ckpt", str(tmp_path), "the <mask> sat on the mat .",
                 "--top-k", "3", "--json"]) == 0  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    got = report["masks"][0]["candidates"]
    assert [c["id"] for c in got] == [r["token"] for r in want]
    assert [c["prob"] for c in got] == pytest.approx([r["score"] for r in want], rel=1e-4)
