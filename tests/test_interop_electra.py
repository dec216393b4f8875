"""ELECTRA checkpoints: transformers models (the discriminator, the generator, the base model,
sequence, token and QA heads) from tiny random configs with every weight set to random
values, loaded with ``load_hf``, give the same outputs on left- and right-padded batches, the
same losses and gradients; attnlab models saved with ``save_hf`` load in transformers with the
same outputs and load back into attnlab exactly; configs neither side can hold are refused by
name, and encoders without ELECTRA's heads still export as BERT's or ALBERT's. ``fill-mask``
runs an imported generator folder as transformers' pipeline does; the published presets'
parameter counts are transformers' models of the same configs.

Shapes: b batch, t length, V vocabulary, E embedding_size, d d_model.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from hf_cases import transformers
from oracle import randomize_weights
from safetensors.torch import load_file

from attnlab.analysis import count_parameters
from attnlab.interop import HFCheckpointError, config_from_hf, hf_model_type, load_hf, save_hf
from attnlab.interop.registry import FAMILIES
from attnlab.models.encoder import EncoderModel
from attnlab.presets import get_preset

V = 53
TOL = 1e-5  # float32, the two libraries' operations in other orders
CASES = {
    # E 16 -> d 32 (embeddings_project), GELU
    "projected": dict(embedding_size=16, hidden_size=32, num_hidden_layers=2,
                      num_attention_heads=4, intermediate_size=48, max_position_embeddings=20),
    # E == d (no map, the base and large models'), ReLU layers (the generator head's GELU
    # stays), an untied decoder
    "unprojected-relu-untied": dict(embedding_size=24, hidden_size=24, num_hidden_layers=2,
                                    num_attention_heads=2, intermediate_size=40,
                                    max_position_embeddings=20, hidden_act="relu",
                                    tie_word_embeddings=False, layer_norm_eps=0.05),
}  # fmt: skip
HEADS = {
    "ElectraForPreTraining": lambda o: o.logits,
    "ElectraForMaskedLM": lambda o: o.logits,
    "ElectraModel": lambda o: o.last_hidden_state,
    "ElectraForSequenceClassification": lambda o: o.logits,
    "ElectraForTokenClassification": lambda o: o.logits,
    "ElectraForQuestionAnswering": lambda o: torch.stack((o.start_logits, o.end_logits), -1),
}
PRETRAINING = ("ElectraForPreTraining", "ElectraForMaskedLM")
PARAMS = [(c, h) for c in CASES for h in HEADS if c == "projected" or h in PRETRAINING]


def _is_norm(name: str, p: torch.Tensor) -> bool:
    return name.endswith("weight") and "LayerNorm" in name


def _hf_config(case: str, name: str = "ElectraForPreTraining", **changes):
    labels = 2 if name.endswith("QuestionAnswering") else 3
    cfg = transformers.ElectraConfig(
        num_labels=labels, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        **{"vocab_size": V, **CASES[case], **changes},
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    return cfg


def _hf_model(case: str, name: str, seed: int = 0, **changes):
    torch.manual_seed(seed)
    model = getattr(transformers, name)(_hf_config(case, name, **changes))
    randomize_weights(model, seed, std=0.3, norms=(0.5, 1.5), is_norm=_is_norm)
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
    """The real tokens' outputs of per-token heads ((b, t) and (b, t, ...)); others whole."""
    return out[mask.bool()] if out.dim() >= 2 and out.shape[:2] == mask.shape else out


@pytest.fixture(scope="module", params=PARAMS, ids=[f"{c}-{h}" for c, h in PARAMS])
def imported(request, tmp_path_factory):
    case, name = request.param
    ref = _hf_model(case, name, seed=len(case) + len(name))
    path = tmp_path_factory.mktemp("hf")
    ref.save_pretrained(path)
    return case, name, ref, load_hf(path)


def test_import_config_and_layout(imported):
    case, name, ref, model = imported
    cfg, hf = model.cfg, ref.config
    assert model.num_parameters() == ref.num_parameters()  # every weight read, none made up
    assert count_parameters(cfg)["total"] == model.num_parameters()
    assert config_from_hf(hf.to_dict()) == cfg
    assert hf_model_type(cfg) == "electra" and cfg.classifier_transform == "electra"
    projected = hf.embedding_size != hf.hidden_size
    assert (model.emb_proj is not None) == projected
    assert cfg.embedding_size == (hf.embedding_size if projected else None)
    assert model.tok_emb.weight.shape == (V, hf.embedding_size)
    if name == "ElectraForMaskedLM":  # the generator head's GELU whatever hidden_act
        assert (cfg.head_activation or cfg.ffn.activation) == "gelu"


@pytest.mark.parametrize("side", ["right", "left"])
def test_import_outputs_with_padding(imported, side):
    case, name, ref, model = imported
    idx, mask, types = _batch(side)
    with torch.no_grad():
        theirs = HEADS[name](ref(input_ids=idx, attention_mask=mask, token_type_ids=types))
        ours = model(idx, attention_mask=mask, token_type_ids=types).logits
    assert ours.shape == theirs.shape
    assert theirs.abs().max() > 1.0
    assert (_real(ours, mask) - _real(theirs, mask)).abs().max() <= TOL


def _targets(name: str, idx, mask, g):
    if name == "ElectraForPreTraining":  # 1: replaced (any value at padding: left out)
        return torch.randint(0, 2, idx.shape, generator=g)
    if name == "ElectraForMaskedLM":
        targets = torch.where(torch.rand(idx.shape, generator=g) < 0.4, idx, -100)
        return targets.masked_fill(mask == 0, -100)
    return torch.randint(0, 3, (3,), generator=g)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("name", [*PRETRAINING, "ElectraForSequenceClassification"])
def test_loss_and_gradients_match_transformers(name, side, tmp_path):
    """A loss backward in training mode on a padded batch: the loss, and the gradients of
    the embeddings, the E -> d map, every layer and the head's, are transformers'."""
    ref = _hf_model("projected", name, seed=3).train()
    ref.save_pretrained(tmp_path)
    model = load_hf(tmp_path).train()
    idx, mask, types = _batch(side, seed=2)
    targets = _targets(name, idx, mask, torch.Generator().manual_seed(7))
    ours = model(idx, attention_mask=mask, token_type_ids=types, targets=targets).loss
    theirs = ref(input_ids=idx, attention_mask=mask, token_type_ids=types, labels=targets).loss
    ours.backward()
    theirs.backward()
    assert abs(ours.item() - theirs.item()) <= TOL
    emb, layers = ref.electra.embeddings, ref.electra.encoder.layer
    pairs = [
        # (but the padding id's row, which transformers' embedding never trains)
        (model.tok_emb.weight.grad[1:], emb.word_embeddings.weight.grad[1:]),
        (model.type_emb.weight.grad, emb.token_type_embeddings.weight.grad),
        (model.emb_norm.weight.grad, emb.LayerNorm.weight.grad),
        (model.emb_proj.weight.grad, ref.electra.embeddings_project.weight.grad),
    ]
    for block, layer in zip(model.blocks, layers, strict=True):
        pairs += [(block.attn.qkv.weight.grad[32:64], layer.attention.self.key.weight.grad),
                  (block.ffn.up.weight.grad, layer.intermediate.dense.weight.grad),
                  (block.ffn_norm.weight.grad, layer.output.LayerNorm.weight.grad)]  # fmt: skip
    head = {  # (built for the head at hand: the others' modules are not there)
        "ElectraForPreTraining": lambda: [
            (model.head.dense.weight.grad, ref.discriminator_predictions.dense.weight.grad),
            (model.head.prediction.weight.grad,
             ref.discriminator_predictions.dense_prediction.weight.grad),
        ],
        "ElectraForMaskedLM": lambda: [
            (model.head.transform.weight.grad, ref.generator_predictions.dense.weight.grad),
            (model.head.bias.grad, ref.generator_lm_head.bias.grad),
        ],
        "ElectraForSequenceClassification": lambda: [
            (model.head.pooler.weight.grad, ref.classifier.dense.weight.grad),
            (model.head.classifier.weight.grad, ref.classifier.out_proj.weight.grad),
        ],
    }  # fmt: skip
    for got, want in pairs + head[name]():
        assert want.abs().max() > 0
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_replaced_token_loss_is_over_the_real_tokens():
    """Without a mask every token counts; with one, padding's logits and targets do not
    (a padded row's loss is its unpadded one); targets of any dtype, checked for shape."""
    model = EncoderModel(get_preset("electra-tiny")).eval()
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(1, 256, (2, 7), generator=g)
    targets = torch.randint(0, 2, idx.shape, generator=g)
    mask = torch.ones_like(idx)
    mask[1, 4:] = 0
    with torch.no_grad():
        logits = model(idx, attention_mask=mask).logits
        loss = model(idx, attention_mask=mask, targets=targets.bool()).loss
        every = model(idx, targets=targets.float()).loss
    keep = mask.bool()
    want = torch.nn.functional.binary_cross_entropy_with_logits(logits[keep], targets[keep].float())
    assert torch.allclose(loss, want)
    every_want = torch.nn.functional.binary_cross_entropy_with_logits(
        model(idx).logits.detach(), targets.float()
    )
    assert torch.allclose(every, every_want) and not torch.allclose(every, loss)
    with pytest.raises(ValueError, match=re.escape("targets must be (b, t) = (2, 7) like idx")):
        model(idx, targets=targets[:, :3])


# --------------------------------------------------------------------------- export


def _tiny(**changes):
    return get_preset("electra-tiny").override({"vocab_size": V, "max_seq_len": 20, **changes})


EXPORTS = {
    "electra-tiny": _tiny(),
    "generator": _tiny(head="mlm"),
    # ReLU layers, the generator head's GELU; an untied decoder; E == d (no map)
    "generator-relu-untied": _tiny(head="mlm", head_activation="gelu", tie_embeddings=False,
                                   embedding_size=None, **{"ffn.activation": "relu"}),
    "discriminator-unprojected": _tiny(embedding_size=None, **{"ffn.activation": "gelu_tanh"}),
    "sequence": _tiny(head="sequence", n_labels=3, label_names=["a", "b", "c"],
                      classifier_dropout=0.3),
    "token": _tiny(head="token", n_labels=4, label_names=["0", "1", "2", "3"]),
    "qa": _tiny(head="qa"),
    "base-model": _tiny(head="none"),
}  # fmt: skip
AUTO = {
    "replaced_token": "ElectraForPreTraining",
    "mlm": "ElectraForMaskedLM",
    "sequence": "ElectraForSequenceClassification",
    "token": "ElectraForTokenClassification",
    "qa": "ElectraForQuestionAnswering",
    "none": "ElectraModel",
}


@pytest.mark.parametrize("name", list(EXPORTS))
def test_export_round_trip(name, tmp_path):
    cfg = EXPORTS[name]
    torch.manual_seed(20)
    model = EncoderModel(cfg).eval()
    randomize_weights(model, len(name), std=0.3, norms=(0.5, 1.5))
    assert hf_model_type(cfg) == "electra"
    save_hf(model, tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    ref = getattr(transformers, AUTO[cfg.head]).from_pretrained(
        tmp_path, attn_implementation="eager"
    ).eval()  # fmt: skip
    assert ref.num_parameters() == model.num_parameters()
    for side in ("right", "left"):
        idx, mask, types = _batch(side, seed=5)
        with torch.no_grad():
            ours = model(idx, attention_mask=mask, token_type_ids=types).logits
            theirs = HEADS[AUTO[cfg.head]](
                ref(input_ids=idx, attention_mask=mask, token_type_ids=types)
            )
        assert ours.abs().max() > 1.0
        assert (_real(ours, mask) - _real(theirs, mask)).abs().max() <= TOL
    assert ref.config.embedding_size == (cfg.embedding_size or cfg.d_model)
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
        ({}, "electra"),  # the discriminator head
        ({"head": "mlm"}, "electra"),  # ELECTRA's classification head (GELU) names it
        ({"head": "qa", "embedding_size": None}, "electra"),
        ({"classifier_transform": "bert"}, "electra"),  # a discriminator is ELECTRA's
        ({"head": "mlm", "classifier_transform": "bert"}, "albert"),  # factorised BERT
        ({"head": "qa", "classifier_transform": "bert", "embedding_size": None}, "bert"),
    ],
)
def test_export_picks_electra_for_its_heads_only(changes, model_type):
    cfg = _tiny(**changes)
    assert hf_model_type(cfg) == model_type
    claims = [f.name for f in FAMILIES if f.exports(cfg)]
    assert ("electra" in claims) == (model_type == "electra")


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"embedding_size": 64}, "embedding_size=64 equals d_model (ELECTRA maps its"),
        ({"layer_sets": 1}, "layer_sets=1 (ELECTRA's is None)"),
        ({"ffn.bias": False},
         "ELECTRA uses an MLP with biases and"),
        ({"head": "mlm", "head_activation": "relu"},
         "head_activation='relu' with ffn.activation='gelu' (ELECTRA's generator head"),
        ({"head": "mlm", "ffn.activation": "relu"},  # the generator head would be ReLU
         "head_activation=None with ffn.activation='relu' (ELECTRA's generator head"),
        ({"head_activation": "relu"}, "head_activation='relu' (ELECTRA's discriminator head"),
        ({"head": "qa", "head_activation": "relu"}, "head_activation='relu' (ELECTRA's qa head"),
        ({"type_vocab_size": 0}, "ELECTRA has an embedding LayerNorm and token types"),
        ({"position.padding_idx": 1}, "position.padding_idx=1 (ELECTRA's is None)"),
        ({"decoder_bias": False, "head": "mlm"}, "decoder_bias=False (ELECTRA's is True)"),
    ],
)  # fmt: skip
def test_export_refuses_what_electra_cannot_hold(changes, named, tmp_path):
    with pytest.raises(HFCheckpointError, match=re.escape(named)):
        save_hf(EncoderModel(_tiny(**changes)), tmp_path)
    assert not (tmp_path / "config.json").exists()


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"architectures": ["ElectraForMultipleChoice"]},
         "architecture 'ElectraForMultipleChoice' is not supported"),
        ({"architectures": ["ElectraForCausalLM"], "is_decoder": True},
         "architecture 'ElectraForCausalLM' is not supported"),
        ({"is_decoder": True}, "ELECTRA: is_decoder=true is not supported"),
        ({"position_embedding_type": "relative_key"},
         "ELECTRA: only absolute position embeddings are supported"),
        ({"architectures": ["ElectraForQuestionAnswering"], "num_labels": 3},
         "a QA model has 2 outputs (start, end), got num_labels=3"),
    ],
)  # fmt: skip
def test_config_it_cannot_hold_is_refused_by_name(changes, named):
    hf = {**_hf_config("projected").to_dict(), **changes}
    with pytest.raises(HFCheckpointError, match=re.escape(named)):
        config_from_hf(hf)


# --------------------------------------------------------------------------- presets

# the published checkpoints' config.json entries (recalled, as the presets' docstrings say)
_ELECTRA = dict(model_type="electra", vocab_size=30522, max_position_embeddings=512,
                type_vocab_size=2, hidden_act="gelu", layer_norm_eps=1e-12)  # fmt: skip
PUBLISHED = {
    "electra-small-discriminator": dict(embedding_size=128, hidden_size=256,
                                        num_hidden_layers=12, num_attention_heads=4,
                                        intermediate_size=1024),
    "electra-base-discriminator": dict(embedding_size=768, hidden_size=768,
                                       num_hidden_layers=12, num_attention_heads=12,
                                       intermediate_size=3072),
    "electra-large-discriminator": dict(embedding_size=1024, hidden_size=1024,
                                        num_hidden_layers=24, num_attention_heads=16,
                                        intermediate_size=4096),
    "electra-base-generator": dict(embedding_size=768, hidden_size=256, num_hidden_layers=12,
                                   num_attention_heads=4, intermediate_size=1024),
    "electra-large-generator": dict(embedding_size=1024, hidden_size=256,
                                    num_hidden_layers=24, num_attention_heads=4,
                                    intermediate_size=1024),
}  # fmt: skip


@pytest.mark.parametrize("name", ["electra-tiny", *PUBLISHED])
def test_preset_parameter_count_is_transformers(name):
    """Each preset is its config.json as import reads it, and counts as many parameters as
    transformers' model of that config (built on the meta device)."""
    preset = get_preset(name)
    arch = AUTO[preset.head]
    if name == "electra-tiny":
        hf = config_to_hf_dict(preset)
    else:
        hf = {**_ELECTRA, **PUBLISHED[name], "architectures": [arch]}
        assert config_from_hf(hf) == preset
    with torch.device("meta"):
        reference = getattr(transformers, arch)(transformers.ElectraConfig(**hf))
    assert count_parameters(preset)["total"] == reference.num_parameters()


def config_to_hf_dict(cfg):
    from attnlab.interop import config_to_hf

    hf = config_to_hf(cfg)
    return {k: v for k, v in hf.items() if k not in ("model_type", "architectures")}


# --------------------------------------------------------------------------- fill-mask


def test_fill_mask_imported_generator_equals_the_transformers_pipeline(tmp_path, capsys):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    from attnlab.cli.main import main

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat", "on", "mat",
             ".", "##s", "dog"]  # fmt: skip
    hf = Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    hf.normalizer = normalizers.BertNormalizer(lowercase=True)
    hf.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    hf.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    hf.decoder = decoders.WordPiece()
    hf.add_special_tokens(words[:5])
    ref = _hf_model("projected", "ElectraForMaskedLM", seed=4, vocab_size=len(words))
    ref.save_pretrained(tmp_path / "hf")
    hf.save(str(tmp_path / "hf" / "tokenizer.json"))
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=hf, mask_token="[MASK]", cls_token="[CLS]", sep_token="[SEP]",
        pad_token="[PAD]", unk_token="[UNK]",
    )  # fmt: skip
    text = "The [MASK] sat on the [MASK]."
    want = transformers.pipeline("fill-mask", model=ref, tokenizer=fast, top_k=4)(text)
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "imported")]) == 0
    for folder in ("hf", "imported"):
        capsys.readouterr()
        assert main(["fill-mask", "--ckpt", str(tmp_path / folder), text, "--top-k", "4",
                     "--json"]) == 0  # fmt: skip
        report = json.loads(capsys.readouterr().out)
        assert len(report["masks"]) == 2
        for got, theirs in zip(report["masks"], want, strict=True):
            assert [c["id"] for c in got["candidates"]] == [r["token"] for r in theirs]
            assert [c["token"] for c in got["candidates"]] == [r["token_str"] for r in theirs]
            probs = [c["prob"] for c in got["candidates"]]
            assert probs == pytest.approx([r["score"] for r in theirs], rel=1e-4)
