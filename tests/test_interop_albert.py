"""ALBERT checkpoints: transformers models (masked LM, base model, sequence, token and QA
heads) from tiny random configs with every weight set to random values, loaded with
``load_hf``, give the same outputs on left- and right-padded batches, the same losses and
gradients (a shared block's summed over the layers that run it); attnlab models saved with
``save_hf`` load in transformers with the same outputs and load back into attnlab exactly;
shared blocks are one module, counted once; configs neither side can hold are refused by
name, and encoders without ALBERT's pieces still export as BERT's.

Shapes: b batch, t length, V vocabulary, E embedding_size, d d_model.
"""

from __future__ import annotations

import re

import pytest
import torch
from hf_cases import transformers
from oracle import randomize_weights
from safetensors.torch import load_file

from attnlab.analysis import count_parameters
from attnlab.config import ConfigError
from attnlab.interop import HFCheckpointError, config_from_hf, hf_model_type, load_hf, save_hf
from attnlab.interop.registry import FAMILIES
from attnlab.models.encoder import EncoderModel
from attnlab.presets import get_preset

V = 53
TOL = 1e-5  # float32, the two libraries' operations in other orders
CASES = {
    # 3 layers over 2 groups (layers 0, 1 share group 0), E 16 -> d 32, gelu_new
    "groups": dict(embedding_size=16, hidden_size=32, num_hidden_layers=3, num_hidden_groups=2,
                   num_attention_heads=4, intermediate_size=48, max_position_embeddings=20),
    # one block for every layer (the published models'), ReLU, an untied decoder, E > d
    "one-group-untied": dict(embedding_size=40, hidden_size=24, num_hidden_layers=2,
                             num_hidden_groups=1, num_attention_heads=2, intermediate_size=40,
                             max_position_embeddings=20, hidden_act="relu",
                             tie_word_embeddings=False, layer_norm_eps=0.05),
}  # fmt: skip
HEADS = {
    "AlbertForMaskedLM": lambda o: o.logits,
    "AlbertModel": lambda o: o.last_hidden_state,
    "AlbertForSequenceClassification": lambda o: o.logits,
    "AlbertForTokenClassification": lambda o: o.logits,
    "AlbertForQuestionAnswering": lambda o: torch.stack((o.start_logits, o.end_logits), -1),
}
PARAMS = [(c, h) for c in CASES for h in HEADS if c == "groups" or h == "AlbertForMaskedLM"]


def _is_norm(name: str, p: torch.Tensor) -> bool:
    """The LayerNorm weights (LayerNorm, *_layer_norm), drawn around 1."""
    return name.endswith("weight") and ("LayerNorm" in name or "layer_norm" in name)


def _hf_config(case: str, name: str = "AlbertForMaskedLM", **changes):
    labels = 2 if name.endswith("QuestionAnswering") else 3
    cfg = transformers.AlbertConfig(
        vocab_size=V, num_labels=labels, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0,
        **{**CASES[case], **changes},
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    return cfg


def _hf_model(case: str, name: str, seed: int = 0, **changes):
    torch.manual_seed(seed)
    model = getattr(transformers, name)(_hf_config(case, name, **changes))
    randomize_weights(model, seed, std=0.3, norms=(0.5, 1.5),
                      is_norm=_is_norm)  # fmt: skip
    return model.eval()


def _batch(side: str, seed: int = 0, t: int = 12):
    """(b, t) ids (never the padding id 0), their mask and token types: rows of t, 8 and 3
    real tokens, padded on ``side``."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(1, V, (3, t), generator=g)
    mask = torch.ones_like(idx)
    for row, n in ((1, 8), (2, 3)):
        if side == "right":
            mask[row, n:] = 0
        else:
            mask[row, : t - n] = 0
    types = torch.randint(0, 2, idx.shape, generator=g) * mask
    return idx.masked_fill(mask == 0, 0), mask, types


def _real(out: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return out[mask.bool()] if out.dim() == 3 else out


@pytest.fixture(scope="module", params=PARAMS, ids=[f"{c}-{h}" for c, h in PARAMS])
def imported(request, tmp_path_factory):
    case, name = request.param
    ref = _hf_model(case, name, seed=len(case) + len(name))
    path = tmp_path_factory.mktemp("hf")
    ref.save_pretrained(path)
    return case, name, ref, load_hf(path)


def test_import_config_and_sharing(imported):
    case, name, ref, model = imported
    cfg, hf = model.cfg, ref.config
    # AlbertModel's pooler (no head but the sequence one reads it), an untied decoder's
    # predictions.bias (transformers 5 ties neither: its forward adds decoder.bias)
    unused = ("albert.pooler.", "pooler.") if name != "AlbertForSequenceClassification" else ()
    if not hf.tie_word_embeddings:
        unused += ("predictions.bias",)
    extra = sum(p.numel() for n, p in ref.named_parameters() if n.startswith(unused))
    assert model.num_parameters() == ref.num_parameters() - extra
    assert count_parameters(cfg)["total"] == model.num_parameters()  # shared blocks once
    assert config_from_hf(hf.to_dict()) == cfg
    assert hf_model_type(cfg) == "albert"
    assert cfg.embedding_size == hf.embedding_size
    groups = [int(i / (hf.num_hidden_layers / hf.num_hidden_groups))
              for i in range(hf.num_hidden_layers)]  # fmt: skip
    assert model.blocks.order == groups and len(model.blocks) == hf.num_hidden_groups


@pytest.mark.parametrize("side", ["right", "left"])
def test_import_outputs_with_padding(imported, side):
    case, name, ref, model = imported
    idx, mask, types = _batch(side)
    with torch.no_grad():
        theirs = HEADS[name](ref(input_ids=idx, attention_mask=mask, token_type_ids=types))
        ours = model(idx, attention_mask=mask, token_type_ids=types).logits
    assert theirs.abs().max() > 1.0
    assert (_real(ours, mask) - _real(theirs, mask)).abs().max() <= TOL


def test_shared_blocks_are_one_module_counted_once():
    """layer_sets 2 over 5 layers: layers 0-2 run block 0, layers 3-4 block 1 (the same
    objects), the state dict and the parameter count hold each block once."""
    cfg = get_preset("albert-tiny").override({"n_layers": 5, "layer_sets": 2})
    model = EncoderModel(cfg)
    assert model.blocks.order == [0, 0, 0, 1, 1] and len(model.blocks) == 2
    layers = [model.blocks[j] for j in model.blocks.order]
    assert layers[0] is layers[2] and layers[3] is layers[4] and layers[0] is not layers[3]
    assert layers[0].attn.qkv.weight is layers[1].attn.qkv.weight
    assert not any(k.startswith("blocks.2.") for k in model.state_dict())
    unshared = EncoderModel(cfg.override({"layer_sets": None}))
    block = sum(p.numel() for p in model.blocks[0].parameters())
    assert unshared.num_parameters() - model.num_parameters() == 3 * block
    assert count_parameters(cfg)["total"] == model.num_parameters()
    # factorised: E-wide tables and head, one E -> d map
    assert model.tok_emb.weight.shape == (cfg.vocab_size, cfg.embedding_size)
    assert model.emb_proj.weight.shape == (cfg.d_model, cfg.embedding_size)
    assert model.head.decoder.weight is model.tok_emb.weight


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("name", ["AlbertForMaskedLM", "AlbertForSequenceClassification"])
def test_loss_and_gradients_match_transformers(name, side, tmp_path):
    """A loss backward in training mode on a padded batch: the loss, and the gradients of
    the embeddings, the E -> d map, each shared block (summed over its layers) and the
    head's, are transformers'."""
    ref = _hf_model("groups", name, seed=3).train()
    ref.save_pretrained(tmp_path)
    model = load_hf(tmp_path).train()
    idx, mask, types = _batch(side, seed=2)
    g = torch.Generator().manual_seed(7)
    if name == "AlbertForMaskedLM":
        targets = torch.where(torch.rand(idx.shape, generator=g) < 0.4, idx, -100)
        targets = targets.masked_fill(mask == 0, -100)
    else:
        targets = torch.randint(0, 3, (3,), generator=g)
    ours = model(idx, attention_mask=mask, token_type_ids=types, targets=targets).loss
    theirs = ref(input_ids=idx, attention_mask=mask, token_type_ids=types, labels=targets).loss
    ours.backward()
    theirs.backward()
    assert abs(ours.item() - theirs.item()) <= TOL
    emb, enc = ref.albert.embeddings, ref.albert.encoder
    pairs = [
        # (but the padding id's row, which transformers' embedding never trains: a
        # left-padded row's first token is padding, which the sequence head pools)
        (model.tok_emb.weight.grad[1:], emb.word_embeddings.weight.grad[1:]),
        (model.type_emb.weight.grad, emb.token_type_embeddings.weight.grad),
        (model.emb_proj.weight.grad, enc.embedding_hidden_mapping_in.weight.grad),
    ]
    for g_, block in enumerate(model.blocks):
        layer = enc.albert_layer_groups[g_].albert_layers[0]
        pairs += [(block.attn.qkv.weight.grad[:32], layer.attention.query.weight.grad),
                  (block.ffn.up.weight.grad, layer.ffn.weight.grad),
                  (block.ffn_norm.weight.grad,
                   layer.full_layer_layer_norm.weight.grad)]  # fmt: skip
    if name == "AlbertForMaskedLM":
        pairs.append((model.head.transform.weight.grad, ref.predictions.dense.weight.grad))
    else:
        pairs += [(model.head.pooler.weight.grad, ref.albert.pooler.weight.grad),
                  (model.head.classifier.weight.grad, ref.classifier.weight.grad)]  # fmt: skip
    for got, want in pairs:
        assert want.abs().max() > 0
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------- export


def _tiny(**changes):
    return get_preset("albert-tiny").override({"vocab_size": V, "max_seq_len": 20, **changes})


EXPORTS = {
    "albert-tiny": _tiny(),
    "two-sets-of-4": _tiny(n_layers=4, layer_sets=2),
    "unshared-untied": _tiny(layer_sets=None, tie_embeddings=False, **{"ffn.activation": "relu"}),
    "sequence": _tiny(head="sequence", n_labels=3, label_names=["a", "b", "c"],
                      classifier_dropout=0.3),
    "token": _tiny(head="token", n_labels=4, label_names=["0", "1", "2", "3"]),
    "qa": _tiny(head="qa"),
    "base-model": _tiny(head="none"),
}  # fmt: skip
AUTO = {
    "mlm": "AlbertForMaskedLM",
    "sequence": "AlbertForSequenceClassification",
    "token": "AlbertForTokenClassification",
    "qa": "AlbertForQuestionAnswering",
    "none": "AlbertModel",
}


@pytest.mark.parametrize("name", list(EXPORTS))
def test_export_round_trip(name, tmp_path):
    cfg = EXPORTS[name]
    torch.manual_seed(20)
    model = EncoderModel(cfg).eval()
    randomize_weights(model, len(name), std=0.3, norms=(0.5, 1.5))
    assert hf_model_type(cfg) == "albert"
    save_hf(model, tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    ref = getattr(transformers, AUTO[cfg.head]).from_pretrained(
        tmp_path, attn_implementation="eager"
    ).eval()  # fmt: skip
    if cfg.head == "none":  # (AlbertModel builds a pooler attnlab's base model lacks)
        with torch.no_grad():
            ref.pooler.weight.zero_()
    for side in ("right", "left"):
        idx, mask, types = _batch(side, seed=5)
        with torch.no_grad():
            ours = model(idx, attention_mask=mask, token_type_ids=types).logits
            theirs = HEADS[AUTO[cfg.head]](
                ref(input_ids=idx, attention_mask=mask, token_type_ids=types)
            )
        assert ours.abs().max() > 1.0
        assert (_real(ours, mask) - _real(theirs, mask)).abs().max() <= TOL
    assert ref.config.num_hidden_groups == (cfg.layer_sets or cfg.n_layers)
    back = load_hf(tmp_path)  # import(export(x)): the same model, the same numbers
    assert back.cfg == cfg
    mine = model.state_dict()
    assert back.state_dict().keys() == mine.keys()
    assert all(torch.equal(v, mine[k]) for k, v in back.state_dict().items())
    save_hf(back, tmp_path / "again")
    twice = load_file(tmp_path / "again" / "model.safetensors")
    assert twice.keys() == stored.keys()
    assert all(torch.equal(twice[k], stored[k]) for k in stored)


@pytest.mark.parametrize(
    "changes, model_type",
    [
        ({}, "albert"),
        ({"layer_sets": None}, "albert"),  # factorised only
        ({"embedding_size": None, "layer_sets": None}, "bert"),
    ],
)
def test_export_picks_albert_for_shared_or_factorised_encoders(changes, model_type):
    cfg = _tiny(**changes)
    assert hf_model_type(cfg) == model_type
    assert [f.name for f in FAMILIES if f.exports(cfg) and f.name != "bert"] == (
        ["albert"] if model_type == "albert" else []
    )


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"embedding_size": None}, "embedding_size=None (ALBERT always maps its embeddings"),
        ({"n_layers": 18, "layer_sets": 14}, "layer_sets=14 with n_layers=18: transformers"),
        ({"type_vocab_size": 0}, "ALBERT has an embedding LayerNorm and token types"),
        ({"position.padding_idx": 1}, "position.padding_idx=1 (ALBERT's is None)"),
        ({"head": "sequence", "classifier_transform": "distilbert"},
         "classifier_transform='distilbert' (ALBERT's is 'bert')"),
    ],
)  # fmt: skip
def test_export_refuses_what_albert_cannot_hold(changes, named, tmp_path):
    with pytest.raises(HFCheckpointError, match=re.escape(named)):
        save_hf(EncoderModel(_tiny(**changes)), tmp_path)
    assert not (tmp_path / "config.json").exists()


def test_other_encoder_layouts_refuse_shared_layers_by_name():
    """BERT's, RoBERTa's, ModernBERT's and T5's layouts have no shared layers: a config of
    theirs with layer_sets exports as ALBERT, which names what it lacks."""
    shared = {"layer_sets": 1}
    with pytest.raises(HFCheckpointError, match="ALBERT always maps its embeddings"):
        hf_model_type(get_preset("bert-tiny-qa").override(shared))
    with pytest.raises(HFCheckpointError, match="position.padding_idx=1 \\(ALBERT's is None"):
        hf_model_type(get_preset("roberta-tiny").override(shared))
    from attnlab.interop import bert

    assert bert.shared_problems(_tiny(), "BERT")[0].startswith("embedding_size=32 (BERT has no")


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"inner_group_num": 2}, "config.json inner_group_num=2 is not supported"),
        ({"num_hidden_groups": 4}, "num_hidden_groups=4 must be in [1, num_hidden_layers=3]"),
        ({"num_hidden_layers": 18, "num_hidden_groups": 14},
         "num_hidden_groups=14 with num_hidden_layers=18: transformers' float arithmetic"),
        ({"architectures": ["AlbertForPreTraining"]},
         "architecture 'AlbertForPreTraining' is not supported"),
    ],
)  # fmt: skip
def test_config_it_cannot_hold_is_refused_by_name(changes, named):
    hf = {**_hf_config("groups").to_dict(), **changes}
    with pytest.raises(HFCheckpointError, match=re.escape(named)):
        config_from_hf(hf)


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"layer_sets": 0}, "layer_sets: must be in [1, n_layers=3], got 0"),
        ({"layer_sets": 4}, "layer_sets: must be in [1, n_layers=3], got 4"),
        ({"attention.sliding_window": 4}, "layer_sets: shared blocks are alike in every layer"),
        ({"embedding_size": 0}, "embedding_size: must be"),
    ],
)
def test_config_validation_names_the_field(changes, named):
    with pytest.raises(ConfigError, match=re.escape(named)):
        get_preset("albert-tiny").override(changes).validate()
