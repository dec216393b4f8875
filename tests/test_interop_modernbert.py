"""ModernBERT checkpoints: transformers models (masked LM, base model, sequence, token and QA
heads) from tiny random configs (local and global layers with two RoPE bases and sequences
longer than the local window; biases on and off, tied and untied decoders, cls and mean
pooling, 4.x's and 5.x's config keys) with every weight set to random values, loaded with
``load_hf``, give the same outputs on padded batches (transformers 5 masks the padding, 4.x
unpads: the same numbers at the real tokens), the same losses and gradients; attnlab models
saved with ``save_hf`` load in transformers with the same outputs and load back into attnlab
exactly; configs neither side can hold are refused by name, and BERT-shaped encoders still
export as bert. The local layers' window is checked against a hand-written mask.

Shapes: b batch, t length, V vocabulary, d d_model.
"""

from __future__ import annotations

import re

import pytest
import torch
from hf_cases import transformers
from oracle import randomize_weights
from safetensors.torch import load_file

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

V = 61
# float32, the two libraries' operations in other orders: observed up to 1.5e-5 absolute on
# outputs up to ~6 (assert_close allows ATOL + TOL |expected|)
TOL, ATOL = 1e-5, 3e-5
NO_SPECIAL = dict(
    pad_token_id=None, bos_token_id=None, eos_token_id=None, cls_token_id=None, sep_token_id=None
)
CASES = {
    # ModernBERT's own defaults in small: no biases, LayerNorms without bias, layer 0 and
    # every third global, keys within 4 either side on the others, two RoPE bases in 4.x's
    # keys, a tied decoder with a bias, [CLS] pooling
    "published": dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        max_position_embeddings=64,
        local_attention=8,
        global_attn_every_n_layers=3,
        global_rope_theta=1000.0,
        local_rope_theta=50.0,
    ),
    # every bias (decoder's none), an untied decoder, GELU-tanh in the layers and SiLU in the
    # heads, an odd local_attention (7: keys within 3), transformers 5.x's layer_types and
    # rope_parameters, mean pooling, an eps large enough to matter
    "biased-untied-mean": dict(
        hidden_size=24,
        intermediate_size=40,
        num_hidden_layers=3,
        num_attention_heads=2,
        max_position_embeddings=64,
        local_attention=7,
        layer_types=["full_attention", "sliding_attention", "full_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 300.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 20.0},
        },
        attention_bias=True,
        mlp_bias=True,
        norm_bias=True,
        classifier_bias=True,
        decoder_bias=False,
        tie_word_embeddings=False,
        hidden_activation="gelu_pytorch_tanh",
        classifier_activation="silu",
        classifier_pooling="mean",
        norm_eps=0.05,
    ),
}
HEADS = {
    "ModernBertForMaskedLM": lambda o: o.logits,
    "ModernBertModel": lambda o: o.last_hidden_state,
    "ModernBertForSequenceClassification": lambda o: o.logits,
    "ModernBertForTokenClassification": lambda o: o.logits,
    "ModernBertForQuestionAnswering": lambda o: torch.stack((o.start_logits, o.end_logits), -1),
}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """LayerNorm weights in [0.5, 1.5), biases and every other weight random."""
    randomize_weights(model, seed, std=0.3, norms=(0.5, 1.5))


def _hf_config(case: str, name: str = "ModernBertForMaskedLM", **changes):
    labels = 2 if name == "ModernBertForQuestionAnswering" else 3
    cfg = transformers.ModernBertConfig(
        vocab_size=V, num_labels=labels, **NO_SPECIAL, **{**CASES[case], **changes}
    )
    cfg._attn_implementation = "eager"
    return cfg


def _hf_model(case: str, name: str, seed: int = 0):
    torch.manual_seed(seed)
    model = getattr(transformers, name)(_hf_config(case, name))
    _randomize(model, seed)
    return model.eval()


def _inputs(seed: int = 0, t: int = 20):
    """(b, t) ids and a right-padded mask: rows of t, 13 and 5 real tokens (t > the window)."""
    idx = torch.randint(0, V, (3, t), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(idx)
    mask[1, 13:] = 0
    mask[2, 5:] = 0
    return idx, mask


def _real(out: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The outputs at real tokens (per-token heads) or every row (sequence heads)."""
    return out[mask.bool()] if out.dim() == 3 else out


@pytest.fixture(scope="module", params=[(c, h) for c in CASES for h in HEADS],
                ids=[f"{c}-{h[len('ModernBert'):]}" for c in CASES for h in HEADS])  # fmt: skip
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
    assert model.num_parameters() == ref.num_parameters()
    assert config_from_hf(hf.to_dict()) == cfg  # the in-memory config, not only config.json
    assert hf_model_type(cfg) == "modernbert"
    att, pos = cfg.attention, cfg.position
    # layer i local exactly where transformers' layer_types says so
    assert [att.window_of(i) is not None for i in range(cfg.n_layers)] == [
        t == "sliding_attention" for t in hf.layer_types
    ]
    assert att.sliding_window == hf.local_attention // 2 + 1  # |q - k| < window
    assert pos.rope_theta == hf.rope_parameters["full_attention"]["rope_theta"]
    assert pos.local_rope_theta == hf.rope_parameters["sliding_attention"]["rope_theta"]
    assert (cfg.norm.placement, cfg.norm.bias, cfg.norm.eps) == ("pre", hf.norm_bias, hf.norm_eps)
    assert (cfg.ffn.kind, cfg.ffn.bias, att.qkv_bias) == ("glu", hf.mlp_bias, hf.attention_bias)
    assert (cfg.pooling, cfg.head_bias) == (hf.classifier_pooling, hf.classifier_bias)
    assert isinstance(model.blocks[0].attn_norm, torch.nn.Identity)  # as layer 0's


def test_import_outputs_with_padding(imported):
    """Hidden states and every head's logits at the real tokens, on a right-padded batch
    longer than the local window."""
    case, name, ref, model = imported
    idx, mask = _inputs()
    with torch.no_grad():
        theirs = HEADS[name](ref(input_ids=idx, attention_mask=mask))
        ours = model(idx, attention_mask=mask).logits
    assert theirs.abs().max() > 1.0  # the comparison is not between near-zero outputs
    torch.testing.assert_close(_real(ours, mask), _real(theirs, mask), atol=ATOL, rtol=TOL)
    # without a mask too (mean pooling over every token)
    with torch.no_grad():
        theirs = HEADS[name](ref(input_ids=idx))
        ours = model(idx).logits
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=TOL)


@torch.no_grad()
def test_local_layers_see_their_window_only(imported):
    """The local layers' window changes the outputs (the inputs outgrow it): every layer
    global gives other numbers, and a padded row equals the row alone."""
    case, name, ref, model = imported
    idx, mask = _inputs(1)
    ours = model(idx, attention_mask=mask).logits
    wide = EncoderModel(model.cfg.override({"attention.sliding_window": 64})).eval()
    wide.load_state_dict(model.state_dict())
    assert (_real(wide(idx, attention_mask=mask).logits - ours, mask)).abs().max() > 1e-3
    alone = model(idx[1:2, :13]).logits
    expected = ours[1:2, :13] if ours.dim() == 3 else ours[1:2]
    torch.testing.assert_close(alone, expected, atol=ATOL, rtol=TOL)


def _loss_case(name: str, idx: torch.Tensor, mask: torch.Tensor):
    """(attnlab targets, transformers labels) of a head."""
    g = torch.Generator().manual_seed(7)
    if name == "ModernBertForMaskedLM":
        labels = torch.where(torch.rand(idx.shape, generator=g) < 0.3, idx, -100)
        labels = labels.masked_fill(mask == 0, -100)
        return labels, labels
    if name == "ModernBertForSequenceClassification":
        labels = torch.randint(0, 3, (idx.shape[0],), generator=g)
        return labels, labels
    labels = torch.randint(0, 3, idx.shape, generator=g).masked_fill(mask == 0, -100)
    return labels, labels


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", [
    "ModernBertForMaskedLM", "ModernBertForSequenceClassification",
    "ModernBertForTokenClassification",
])  # fmt: skip
def test_loss_and_gradients_match_transformers(case, name, tmp_path):
    """A loss backward in training mode: the loss and the gradients of the embedding, the
    norms (layer 1's, the final one, the head's), the fused projections and the classifier
    are transformers'."""
    ref = _hf_model(case, name, seed=3).train()
    ref.save_pretrained(tmp_path)
    model = load_hf(tmp_path).train()
    idx, mask = _inputs(2)
    targets, labels = _loss_case(name, idx, mask)
    ours = model(idx, attention_mask=mask, targets=targets).loss
    theirs = ref(input_ids=idx, attention_mask=mask, labels=labels).loss
    ours.backward()
    theirs.backward()
    assert abs(ours.item() - theirs.item()) <= 1e-5
    block, layer = model.blocks[1], ref.model.layers[1]
    pairs = [
        (model.tok_emb.weight.grad, ref.model.embeddings.tok_embeddings.weight.grad),
        (model.emb_norm.weight.grad, ref.model.embeddings.norm.weight.grad),
        (block.attn_norm.weight.grad, layer.attn_norm.weight.grad),
        (block.attn.qkv.weight.grad, layer.attn.Wqkv.weight.grad),
        (block.attn.out.weight.grad, layer.attn.Wo.weight.grad),
        (block.ffn_norm.weight.grad, layer.mlp_norm.weight.grad),
        (block.ffn.gate_up.weight.grad, layer.mlp.Wi.weight.grad),
        (block.ffn.down.weight.grad, layer.mlp.Wo.weight.grad),
        (model.norm.weight.grad, ref.model.final_norm.weight.grad),
        (model.head.transform.weight.grad, ref.head.dense.weight.grad),
        (model.head.norm.weight.grad, ref.head.norm.weight.grad),
    ]
    if name != "ModernBertForMaskedLM":
        pairs.append((model.head.classifier.weight.grad, ref.classifier.weight.grad))
    for got, want in pairs:
        assert want.abs().max() > 0  # (a gradient that flows)
        # float32 sums over the batch in different orders: 1e-4
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_bidirectional_window_is_transformers_mask():
    """A local layer's window against a mask written out by hand as transformers' masking
    defines it (|q - k| <= local_attention // 2, and real keys only), for even and odd
    local_attention, through multi-head attention with a padding mask."""
    from attnlab.config import AttentionConfig
    from attnlab.functional.attention import eager_attention
    from attnlab.nn.attention import MultiHeadAttention, split_heads

    torch.manual_seed(0)
    t, d = 13, 8
    x = torch.randn(2, t, d)
    keep = torch.ones(2, t, dtype=torch.bool)
    keep[1, 9:] = False
    for local_attention in (4, 7, 8):
        half = local_attention // 2
        attn = MultiHeadAttention(
            d, AttentionConfig(n_heads=2, sliding_window=half + 1), causal=False
        ).eval()
        mask = torch.zeros(2, 1, t, t, dtype=torch.bool)
        for b in range(2):
            for q in range(t):
                for k in range(t):
                    mask[b, 0, q, k] = abs(q - k) <= half and bool(keep[b, k])
        q, k, v = attn.qkv(x).split(d, dim=-1)
        heads = [split_heads(z, 2, d // 2) for z in (q, k, v)]  # (b, h, t, d_h) each
        y = eager_attention(*heads, mask)
        want = attn.out(y.transpose(1, 2).reshape(2, t, d))
        got = attn(x, mask=keep[:, None, None, :])
        torch.testing.assert_close(got[keep], want[keep])


# --------------------------------------------------------------------------- export


def _tiny(**changes):
    return get_preset("modernbert-tiny").override({"vocab_size": V, **changes})


EXPORTS = {
    "modernbert-tiny": _tiny(),
    "sequence-mean": _tiny(head="sequence", n_labels=3, pooling="mean"),
    "sequence-cls-biased": _tiny(
        **{
            "head": "sequence",
            "n_labels": 4,
            "pooling": "cls",
            "head_bias": True,
            "head_activation": "silu",
            "attention.qkv_bias": True,
            "attention.out_bias": True,
            "ffn.bias": True,
            "norm.bias": True,
            "label_names": ["a", "b", "c", "d"],
        }
    ),
    "token": _tiny(head="token", n_labels=5),
    "qa": _tiny(head="qa"),
    "base-model": _tiny(head="none"),
    # an untied decoder without a bias, one RoPE base, 4 layers (GL GL), gelu_tanh
    "untied-one-base": _tiny(
        **{
            "tie_embeddings": False,
            "decoder_bias": False,
            "position.local_rope_theta": None,
            "attention.layer_pattern": "GL",
            "n_layers": 4,
            "ffn.activation": "gelu_tanh",
        }
    ),
}


def _reimported(cfg):
    """``cfg`` as import reads its export: the classifier dropout as written (0), the labels
    of a classifier without names numbered (as any imported classifier's)."""
    names = cfg.label_names
    if names is None and cfg.head in ("sequence", "token"):
        names = [str(i) for i in range(cfg.n_labels)]
    return cfg.override({"classifier_dropout": 0.0, "label_names": names})


AUTO = {
    "mlm": "ModernBertForMaskedLM",
    "sequence": "ModernBertForSequenceClassification",
    "token": "ModernBertForTokenClassification",
    "qa": "ModernBertForQuestionAnswering",
    "none": "ModernBertModel",
}


@pytest.mark.parametrize("name", list(EXPORTS))
def test_export_round_trip(name, tmp_path):
    cfg = EXPORTS[name]
    torch.manual_seed(20)
    model = EncoderModel(cfg).eval()
    _randomize(model, seed=len(name))
    assert hf_model_type(cfg) == "modernbert"
    save_hf(model, tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    assert not any(k.endswith("layers.0.attn_norm.weight") for k in stored)
    idx, mask = _inputs(5, t=30)
    with torch.no_grad():
        ours = model(idx, attention_mask=mask).logits
    ref = getattr(transformers, AUTO[cfg.head]).from_pretrained(
        tmp_path, attn_implementation="eager"
    )
    with torch.no_grad():
        theirs = HEADS[AUTO[cfg.head]](ref.eval()(input_ids=idx, attention_mask=mask))
    assert ours.abs().max() > 1.0
    torch.testing.assert_close(_real(ours, mask), _real(theirs, mask), atol=ATOL, rtol=TOL)
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
    """config.json -> attnlab -> config.json keeps every key transformers' ModernBERT reads
    (an odd local_attention as the even one below it: the same mask), and attnlab ->
    config.json -> attnlab is the same config."""
    hf = _hf_config(case, "ModernBertForSequenceClassification").to_dict()
    hf["architectures"] = ["ModernBertForSequenceClassification"]
    cfg = config_from_hf(hf)
    written = config_to_hf(cfg)
    assert written["model_type"] == "modernbert"
    assert written["architectures"] == ["ModernBertForSequenceClassification"]
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "hidden_activation",
        "max_position_embeddings",
        "norm_eps",
        "norm_bias",
        "attention_bias",
        "mlp_bias",
        "tie_word_embeddings",
        "initializer_range",
        "layer_types",
        "rope_parameters",
        "decoder_bias",
        "classifier_pooling",
        "classifier_bias",
        "classifier_activation",
        "classifier_dropout",
    ):
        assert written[key] == hf[key], key
    assert written["local_attention"] == hf["local_attention"] // 2 * 2
    assert config_from_hf(written) == cfg
    reread = transformers.ModernBertConfig(**{**written, "model_type": None} | NO_SPECIAL)
    assert config_from_hf(reread.to_dict()) == cfg  # transformers reads what it was given
    for name in EXPORTS:
        assert config_from_hf(config_to_hf(EXPORTS[name])) == _reimported(EXPORTS[name])


def test_bert_shaped_encoders_still_export_as_bert():
    assert hf_model_type(get_preset("bert-tiny-qa")) == "bert"  # (token types: BERT's)
    assert hf_model_type(get_preset("modernbert-tiny")) == "modernbert"


# --------------------------------------------------------------------------- refusals


def _message(named: str) -> str:
    return re.escape(named)


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"mlp_dropout": 0.1}, "config.json mlp_dropout=0.1 is not supported"),
        ({"embedding_dropout": 0.1}, "config.json embedding_dropout=0.1 is not supported"),
        ({"attention_dropout": 0.1}, "config.json attention_dropout=0.1 is not supported"),
        ({"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                 "rope_theta": 1e4},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
         "RoPE scaling 'linear' is not supported"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
         "config.json rope_scaling={'rope_type': 'linear', 'factor': 2.0} is not supported"),
        ({"classifier_pooling": "max"}, "config.json classifier_pooling='max' is not supported"),
        ({"hidden_activation": "gelu_fast"}, "hidden_activation='gelu_fast' is not supported"),
        ({"classifier_activation": "tanh"}, "classifier_activation='tanh' is not supported"),
        ({"architectures": ["ModernBertForMultipleChoice"]},
         "architecture 'ModernBertForMultipleChoice' is not supported"),
        ({"architectures": ["ModernBertForQuestionAnswering"], "num_labels": 3,
          "id2label": None}, "a QA model has 2 outputs (start, end), got num_labels=3"),
        ({"layer_types": ["full_attention", "sliding"]}, "config.json layer_types="),
    ],
    ids=["mlp-dropout", "embedding-dropout", "attention-dropout", "rope-linear",
         "rope-scaling-4x", "pooling", "activation", "head-activation", "multiple-choice",
         "qa-labels", "layer-types"],
)  # fmt: skip
def test_config_it_cannot_hold_is_refused_by_name(changes, named):
    hf = {**_hf_config("published").to_dict(), **changes}
    with pytest.raises(HFCheckpointError, match=_message(named)):
        config_from_hf(hf)


def test_runtime_settings_are_read_and_ignored():
    """Settings that change no result (kernels, compilation, sparse MLM logits) are taken."""
    hf = _hf_config("published").to_dict()
    knobs = dict(deterministic_flash_attn=True, reference_compile=True, sparse_prediction=True,
                 repad_logits_with_grad=True, initializer_cutoff_factor=3.0)  # fmt: skip
    assert config_from_hf({**hf, **knobs}) == config_from_hf(hf)


def test_minimal_config_is_read_as_transformers_fills_it():
    """Without the keys: ModernBertConfig's defaults (every third layer global from layer 0,
    local_attention 128, RoPE bases 160000 and 10000, no biases, a [CLS] pooler)."""
    given = {"model_type": "modernbert", "hidden_size": 32, "num_attention_heads": 4,
             "num_hidden_layers": 4, "vocab_size": V, "intermediate_size": 16}  # fmt: skip
    hf = transformers.AutoConfig.for_model(**given, **NO_SPECIAL).to_dict()
    cfg = config_from_hf(given)
    assert cfg == config_from_hf(hf)
    assert (cfg.attention.layer_pattern, cfg.attention.sliding_window) == ("GLL", 65)
    assert (cfg.position.rope_theta, cfg.position.local_rope_theta) == (160_000.0, 10_000.0)
    assert (cfg.norm.bias, cfg.attention.qkv_bias, cfg.pooling) == (False, False, "cls")


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"norm.kind": "rmsnorm"}, "norm.kind='rmsnorm' (ModernBERT's is 'layernorm')"),
        ({"first_attn_norm": True}, "first_attn_norm=True (ModernBERT's is False)"),
        ({"type_vocab_size": 2}, "type_vocab_size=2 (ModernBERT's is 0)"),
        ({"ffn.kind": "mlp"}, "ffn.kind='mlp' (ModernBERT's is 'glu')"),
        ({"attention.n_kv_heads": 2}, "attention.n_kv_heads=2 (ModernBERT's is 4)"),
        ({"attention.qkv_bias": True}, "attention.out_bias=False (ModernBERT's is True)"),
        ({"position.rope_layout": "interleaved"},
         "position.rope_layout='interleaved' (ModernBERT's is 'split')"),
        ({"dropout": 0.1}, "dropout=0.1 (ModernBERT's is 0.0)"),
        ({"attention.layer_pattern": "LG"},
         "attention.layer_pattern='LG' (ModernBERT's layer i is global when"),
        ({"head": "token", "classifier_transform": "bert"},
         "classifier_transform='bert' (ModernBERT's is 'dense_act_norm')"),
    ],
)  # fmt: skip
def test_export_refuses_what_modernbert_cannot_hold(changes, named, tmp_path):
    cfg = _tiny(**changes)
    with pytest.raises(HFCheckpointError, match=_message(named)):
        save_hf(EncoderModel(cfg), tmp_path)
    assert not (tmp_path / "config.json").exists()


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"pooling": "mean"}, "position.kind='learned' (ModernBERT's is 'rope'); "
         "pooling='mean' exports as modernbert only"),
        ({"decoder_bias": False}, "decoder_bias=False exports as modernbert only"),
        ({"position.kind": "rope"}, "norm.placement='post' (ModernBERT's is 'pre'); "
         "position.kind='rope' exports as modernbert only"),
    ],
)  # fmt: skip
def test_modernbert_pieces_in_bert_are_refused(changes, named):
    """A BERT-shaped encoder with one of ModernBERT's pieces: BERT's layout would drop it, so
    ModernBERT's family takes it and names what it lacks."""
    cfg = get_preset("bert-tiny-qa").override(changes)
    with pytest.raises(HFCheckpointError, match=_message(named)):
        hf_model_type(cfg)


def test_mean_pooling_leaves_padding_out():
    """The sequence head's mean is over the real tokens: padding changes nothing."""
    torch.manual_seed(0)
    model = EncoderModel(_tiny(head="sequence", n_labels=3, pooling="mean")).eval()
    idx, mask = _inputs(6)
    with torch.no_grad():
        padded = model(idx, attention_mask=mask).logits
        alone = model(idx[2:3, :5]).logits
        noise = model(idx.masked_fill(mask == 0, 7), attention_mask=mask).logits
    torch.testing.assert_close(padded[2:3], alone, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(noise, padded, atol=1e-6, rtol=1e-5)
