"""Encoder-only models (BERT layout): transformers' BERT models built from tiny random
configs are the reference (no downloads); the MLM masking rule is checked as a pure
function. Shapes: b batch, t length, V vocabulary size."""

from __future__ import annotations

import json

import pytest
import torch
from hf_cases import transformers
from oracle import randomize_weights

from attnlab.config import ConfigError, ModelConfig
from attnlab.interop import HFCheckpointError, load_hf, save_hf
from attnlab.models import build_model
from attnlab.models.encoder import EncoderConfig, EncoderModel, mask_tokens

VOCAB = 61
TOL = 1e-4  # float32; the two libraries order their operations differently


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """LayerNorm weights in [0.5, 1.5), the rest random."""
    randomize_weights(
        model, seed, std=0.2, norms=(0.5, 1.5), is_norm=lambda name, p: "LayerNorm.weight" in name
    )


def _bert_config(**kw):
    return transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        max_position_embeddings=40,
        type_vocab_size=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attn_implementation="eager",
        **kw,
    )


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, VOCAB, (3, 11), generator=g)
    types = torch.randint(0, 3, (3, 11), generator=g)
    mask = torch.ones(3, 11, dtype=torch.long)
    mask[1, 7:] = 0  # right padding
    mask[2, 4:] = 0
    return idx, types, mask


CLASSES = {
    "BertForMaskedLM": lambda o: o.logits,
    "BertForSequenceClassification": lambda o: o.logits,
    "BertForTokenClassification": lambda o: o.logits,
    "BertForQuestionAnswering": lambda o: torch.stack((o.start_logits, o.end_logits), -1),
}


@pytest.mark.parametrize("name", list(CLASSES))
def test_bert_loads_and_saves_with_equal_logits(name, tmp_path):
    torch.manual_seed(0)
    n_labels = 2 if name == "BertForQuestionAnswering" else 5  # QA: start and end
    ref = getattr(transformers, name)(_bert_config(num_labels=n_labels)).eval()
    _randomize(ref, 1)
    ref.save_pretrained(tmp_path / "hf")
    model = load_hf(tmp_path / "hf")
    idx, types, mask = _inputs()
    with torch.no_grad():
        expected = CLASSES[name](ref(input_ids=idx, token_type_ids=types, attention_mask=mask))
        out = model(idx, token_type_ids=types, attention_mask=mask).logits
    real = mask.bool() if out.dim() == 3 else torch.ones(3, dtype=torch.bool)
    torch.testing.assert_close(out[real], expected[real], atol=TOL, rtol=TOL)
    # and back: transformers loads what attnlab saves, with the same logits
    save_hf(model, tmp_path / "ours")
    back = getattr(transformers, name).from_pretrained(tmp_path / "ours").eval()
    with torch.no_grad():
        again = CLASSES[name](back(input_ids=idx, token_type_ids=types, attention_mask=mask))
    torch.testing.assert_close(again, expected, atol=TOL, rtol=TOL)


def test_untied_mlm_head_adds_its_decoder_bias(tmp_path):
    """With tie_word_embeddings=false transformers 5 ties nothing: the MLM head's output is
    its own weight plus cls.predictions.decoder.bias, and cls.predictions.bias (stored
    beside it) goes unused."""
    ref = transformers.BertForMaskedLM(_bert_config(tie_word_embeddings=False)).eval()
    _randomize(ref, 2)  # every tensor its own values: the two biases differ
    assert not torch.equal(ref.cls.predictions.bias, ref.cls.predictions.decoder.bias)
    ref.save_pretrained(tmp_path / "hf")
    model = load_hf(tmp_path / "hf")
    idx, types, mask = _inputs(1)
    with torch.no_grad():
        expected = ref(input_ids=idx, token_type_ids=types, attention_mask=mask).logits
        out = model(idx, token_type_ids=types, attention_mask=mask).logits
        real = mask.bool()
        torch.testing.assert_close(out[real], expected[real], atol=TOL, rtol=TOL)
        save_hf(model, tmp_path / "ours")
        back = transformers.BertForMaskedLM.from_pretrained(tmp_path / "ours").eval()
        again = back(input_ids=idx, token_type_ids=types, attention_mask=mask).logits
    torch.testing.assert_close(again[real], expected[real], atol=TOL, rtol=TOL)


def test_original_bert_checkpoint_layout(tmp_path):
    """The original BERT files (bert-base-uncased's, config.json saying BertForMaskedLM):
    LayerNorm gamma/beta names, the next-sentence head and the pooler of pre-training, no
    decoder bias. transformers renames the first and leaves the others unused; so does
    attnlab."""
    import json

    from safetensors.torch import save_file

    torch.manual_seed(0)
    pre = transformers.BertForPreTraining(_bert_config()).eval()
    _randomize(pre, 3)
    legacy = {"LayerNorm.weight": "LayerNorm.gamma", "LayerNorm.bias": "LayerNorm.beta"}
    tensors = {}
    for k, v in pre.state_dict().items():
        for new, old in legacy.items():
            k = k.removesuffix(new) + old if k.endswith(new) else k
        if k != "cls.predictions.decoder.bias":
            tensors[k] = v.contiguous().clone()
    assert "cls.seq_relationship.weight" in tensors and "bert.pooler.dense.weight" in tensors
    assert "bert.embeddings.LayerNorm.gamma" in tensors
    (tmp_path / "hf").mkdir()
    save_file(tensors, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    config = pre.config.to_dict() | {"architectures": ["BertForMaskedLM"]}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    ref = transformers.BertForMaskedLM.from_pretrained(tmp_path / "hf").eval()
    idx, types, mask = _inputs(2)
    with torch.no_grad():
        expected = ref(input_ids=idx, token_type_ids=types, attention_mask=mask).logits
        out = load_hf(tmp_path / "hf")(idx, token_type_ids=types, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(out[real], expected[real], atol=TOL, rtol=TOL)
    # one tensor under both names is refused, not read from whichever came last
    tensors["bert.embeddings.LayerNorm.weight"] = tensors["bert.embeddings.LayerNorm.gamma"].clone()
    save_file(tensors, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(HFCheckpointError, match="stored twice"):
        load_hf(tmp_path / "hf")


def test_sigmoid_bert_is_exported(tmp_path):
    """hidden_act sigmoid (which the import reads) is written back, not refused."""
    ref = transformers.BertForMaskedLM(_bert_config(hidden_act="sigmoid")).eval()
    _randomize(ref, 3)
    ref.save_pretrained(tmp_path / "hf")
    save_hf(load_hf(tmp_path / "hf"), tmp_path / "ours")
    back = transformers.BertForMaskedLM.from_pretrained(tmp_path / "ours").eval()
    assert back.config.hidden_act == "sigmoid"
    idx, types, mask = _inputs(2)
    with torch.no_grad():
        expected = ref(input_ids=idx, token_type_ids=types, attention_mask=mask).logits
        again = back(input_ids=idx, token_type_ids=types, attention_mask=mask).logits
    torch.testing.assert_close(again, expected, atol=TOL, rtol=TOL)


def test_config_settings_are_read_and_written_back(tmp_path):
    """layer_norm_eps (large here, so that it moves the logits), the dropouts (the classifier's
    its own) and initializer_range are imported into the fields that use them and exported
    back: a fine-tuned import trains with the checkpoint's settings."""
    hf_cfg = _bert_config(num_labels=3, layer_norm_eps=0.05, classifier_dropout=0.25)
    hf_cfg.hidden_dropout_prob, hf_cfg.attention_probs_dropout_prob = 0.15, 0.05
    hf_cfg.initializer_range = 0.07
    ref = transformers.BertForSequenceClassification(hf_cfg).eval()
    _randomize(ref, 4)
    ref.save_pretrained(tmp_path / "hf")
    model = load_hf(tmp_path / "hf")
    cfg = model.cfg
    assert (cfg.norm.eps, cfg.dropout, cfg.attention.dropout) == (0.05, 0.15, 0.05)
    assert (cfg.classifier_dropout, cfg.init_std) == (0.25, 0.07)
    assert model.head.dropout.p == 0.25 and model.drop.p == 0.15
    idx, types, mask = _inputs(3)
    with torch.no_grad():
        expected = ref(input_ids=idx, token_type_ids=types, attention_mask=mask).logits
        torch.testing.assert_close(
            model(idx, token_type_ids=types, attention_mask=mask).logits, expected,
            atol=TOL, rtol=TOL,
        )  # fmt: skip
    save_hf(model, tmp_path / "ours")
    back = transformers.BertForSequenceClassification.from_pretrained(tmp_path / "ours").eval()
    c = back.config
    assert (c.layer_norm_eps, c.hidden_dropout_prob, c.attention_probs_dropout_prob) == (
        0.05, 0.15, 0.05,
    )  # fmt: skip
    assert (c.classifier_dropout, c.initializer_range) == (0.25, 0.07)
    with torch.no_grad():
        again = back(input_ids=idx, token_type_ids=types, attention_mask=mask).logits
    torch.testing.assert_close(again, expected, atol=TOL, rtol=TOL)


def test_pre_norm_encoder_ends_in_its_final_norm():
    """A pre-norm stack leaves its residual stream unnormalised: the encoder's hidden states
    are the final norm's output (LayerNorm with weight w and bias b: per token, mean b and
    standard deviation |w| across features when w and b are constants)."""
    torch.manual_seed(0)
    cfg = EncoderConfig(vocab_size=VOCAB, d_model=16, n_layers=2, head="none", init_std=0.5)
    model = EncoderModel(cfg.override({"norm.placement": "pre"})).eval()
    with torch.no_grad():
        model.norm.weight.fill_(3.0)
        model.norm.bias.fill_(-2.0)
        h = model(torch.randint(0, VOCAB, (2, 7))).logits  # (b, t, d)
    torch.testing.assert_close(h.mean(-1), torch.full((2, 7), -2.0), atol=1e-5, rtol=0)
    var = h.var(-1, unbiased=False)
    torch.testing.assert_close(var, torch.full((2, 7), 9.0), atol=1e-3, rtol=1e-3)


def test_single_label_problem_type_needs_two_labels(tmp_path):
    """A softmax over one class has loss 0 whatever the weights; transformers refuses
    problem_type single_label_classification with num_labels=1, and so does attnlab (a
    config.json of an older transformers too), rather than export a folder transformers
    cannot load."""
    kw = {"head": "sequence", "n_labels": 1, "problem_type": "single_label_classification"}
    with pytest.raises(ConfigError, match="single_label_classification needs n_labels >= 2"):
        EncoderConfig(vocab_size=VOCAB, d_model=16, n_layers=1, **kw).validate()
    transformers.BertForSequenceClassification(_bert_config(num_labels=1)).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["problem_type"] = "single_label_classification"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFCheckpointError, match="needs n_labels >= 2"):
        load_hf(tmp_path)


@pytest.mark.parametrize("cross", [False, True])
def test_causal_or_cross_attending_bert_is_refused(cross, tmp_path):
    """transformers runs such a BERT causally (and with cross-attention): refused, not
    imported as a bidirectional encoder."""
    cfg = _bert_config(is_decoder=True, add_cross_attention=cross)
    transformers.BertModel(cfg).save_pretrained(tmp_path)
    with pytest.raises(HFCheckpointError, match="is_decoder=true is not supported"):
        load_hf(tmp_path)


def test_bert_losses_match_transformers(tmp_path):
    torch.manual_seed(0)
    idx, types, mask = _inputs()
    for name, targets, kw in (
        ("BertForMaskedLM", torch.where(mask.bool(), idx, -100), "labels"),
        ("BertForSequenceClassification", torch.tensor([0, 4, 2]), "labels"),
        ("BertForTokenClassification", torch.randint(0, 5, (3, 11)), "labels"),
    ):
        ref = getattr(transformers, name)(_bert_config(num_labels=5)).eval()
        _randomize(ref, 2)
        ref.save_pretrained(tmp_path / name)
        model = load_hf(tmp_path / name)
        with torch.no_grad():
            expected = ref(
                input_ids=idx, token_type_ids=types, attention_mask=mask, **{kw: targets}
            )
            loss = model(idx, token_type_ids=types, attention_mask=mask, targets=targets).loss
        torch.testing.assert_close(loss, expected.loss, atol=TOL, rtol=TOL)
    ref = transformers.BertForQuestionAnswering(_bert_config()).eval()
    _randomize(ref, 3)
    ref.save_pretrained(tmp_path / "qa")
    model = load_hf(tmp_path / "qa")
    start, end = torch.tensor([1, 3, 40]), torch.tensor([2, 5, 0])  # 40: outside, ignored
    with torch.no_grad():
        expected = ref(input_ids=idx, start_positions=start, end_positions=end).loss
        loss = model(idx, targets=torch.stack((start, end), 1)).loss
    torch.testing.assert_close(loss, expected, atol=TOL, rtol=TOL)


def test_padding_does_not_change_real_tokens():
    torch.manual_seed(0)
    model = EncoderModel(EncoderConfig(vocab_size=VOCAB, d_model=32, n_layers=2)).eval()
    idx = torch.randint(0, VOCAB, (1, 6))
    padded = torch.cat((idx, torch.zeros(1, 3, dtype=torch.long)), dim=1)
    mask = torch.tensor([[1] * 6 + [0] * 3])
    with torch.no_grad():
        alone = model(idx).logits
        out = model(padded, attention_mask=mask).logits[:, :6]
    torch.testing.assert_close(out, alone, atol=1e-5, rtol=1e-5)


def test_encoder_config_parses_by_arch_and_rejects_unknown_keys():
    cfg = ModelConfig.from_dict({"arch": "encoder", "head": "qa", "d_model": 32})
    assert isinstance(cfg, EncoderConfig) and cfg.norm.placement == "post"
    assert isinstance(build_model(cfg), EncoderModel)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="head"):
        ModelConfig.from_dict({"arch": "encoder", "head": "mlmm"})
    with pytest.raises(ConfigError, match="n_label"):
        ModelConfig.from_dict({"arch": "encoder", "n_label": 3})


@pytest.mark.parametrize("arch", ["encoder", "vit"])
@pytest.mark.parametrize("kind", ["linear", "nsa"])
def test_bidirectional_models_refuse_causal_only_attention(arch, kind):
    # the config was accepted and building the model failed without naming the field
    with pytest.raises(ConfigError, match=rf"^attention\.kind: '{kind}' attention is causal"):
        ModelConfig.from_dict({"arch": arch, "attention": {"kind": kind}})


@pytest.mark.parametrize("head", ["mlm", "sequence", "token", "qa", "none"])
def test_heads_shapes_and_pre_norm(head):
    cfg = EncoderConfig(vocab_size=VOCAB, d_model=16, n_layers=1, head=head, n_labels=3)
    cfg = cfg.override({"norm.placement": "pre"})
    out = build_model(cfg)(torch.randint(0, VOCAB, (2, 5))).logits
    shapes = {"mlm": (2, 5, VOCAB), "sequence": (2, 3), "token": (2, 5, 3), "qa": (2, 5, 2)}
    assert tuple(out.shape) == shapes.get(head, (2, 5, 16))


def test_mask_tokens_80_10_10():
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(5, 1000, (64, 256), generator=g)
    special = torch.zeros_like(idx, dtype=torch.bool)
    special[:, 0] = True
    inputs, targets = mask_tokens(
        idx, mask_id=3, vocab_size=1000, mask_prob=0.15, special=special, generator=g
    )
    chosen = targets != -100
    assert torch.equal(targets[chosen], idx[chosen])  # targets are the original tokens
    assert not chosen[:, 0].any()  # special positions are never chosen
    assert torch.equal(inputs[~chosen], idx[~chosen])  # the rest is untouched
    n = chosen.sum().item()
    assert abs(n / (64 * 255) - 0.15) < 0.01
    masked = (inputs[chosen] == 3).float().mean().item()
    kept = (inputs[chosen] == idx[chosen]).float().mean().item()  # includes random == original
    assert abs(masked - 0.8) < 0.02
    assert abs(kept - 0.1) < 0.02
    assert abs(1 - masked - kept - 0.1) < 0.02  # replaced by a random token
    # pure: same generator state -> same output, input not modified
    again = mask_tokens(idx, mask_id=3, vocab_size=1000, generator=torch.Generator().manual_seed(1))
    same = mask_tokens(idx, mask_id=3, vocab_size=1000, generator=torch.Generator().manual_seed(1))
    assert torch.equal(again[0], same[0]) and torch.equal(again[1], same[1])
    # special token ids given as a list
    ids = torch.tensor([[0, 7, 7, 0]])
    inp, tgt = mask_tokens(ids, mask_id=3, vocab_size=10, mask_prob=1.0, special=torch.tensor([0]))
    assert tgt.tolist() == [[-100, 7, 7, -100]]


def test_mlm_learns():
    """A tiny encoder learns to fill in a masked token of a repeated pattern."""
    torch.manual_seed(0)
    cfg = EncoderConfig(vocab_size=12, max_seq_len=16, d_model=32, n_layers=2, head="mlm")
    model = EncoderModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(150):
        start = torch.randint(0, 5, (32, 1), generator=g)
        idx = 2 + (start + torch.arange(12)) % 10  # counting sequences: context decides
        inputs, targets = mask_tokens(idx, mask_id=1, vocab_size=12, mask_prob=0.2, generator=g)
        loss = model(inputs, targets=targets).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-10:]) / 10 < 0.3 * sum(losses[:10]) / 10


@torch.no_grad()
def test_qa_loss_of_an_example_does_not_depend_on_its_padding():
    """Padding is no candidate start or end: the same example alone and padded in a batch
    has the same loss (transformers' BERT lets the padded positions into its softmax)."""
    from attnlab.presets import get_preset

    torch.manual_seed(0)
    model = build_model(get_preset("bert-tiny-qa").override({"dropout": 0.0})).eval()
    V = model.cfg.vocab_size
    idx = torch.randint(5, V, (1, 6))
    targets = torch.tensor([[2, 4]])
    alone = model(idx, targets=targets).loss
    padded = torch.cat((idx, torch.randint(5, V, (1, 5))), dim=1)  # right padding
    mask = torch.ones_like(padded)
    mask[:, 6:] = 0
    loss = model(padded, attention_mask=mask, targets=targets).loss
    torch.testing.assert_close(loss, alone)
    assert model(padded, targets=targets).loss > alone  # unmasked, the pads take mass


@pytest.mark.parametrize(
    "window_kw",
    [
        dict(sliding_window=4),
        dict(sliding_window=4, sink_logits=True),
        dict(sliding_window=5, sink_tokens=1),
    ],
)
@torch.no_grad()
def test_bidirectional_window_sees_both_sides(window_kw):
    """An encoder's windowed layer attends within window - 1 positions on either side (as
    global_window_mask(causal=False) defines, and as its global tokens do). With sinks or a
    sink logit it silently became causal once the sequence outgrew the window; a plain
    window raised."""
    from attnlab.config import AttentionConfig
    from attnlab.functional.masks import global_window_mask
    from attnlab.nn.attention import MultiHeadAttention

    torch.manual_seed(0)
    cfg = AttentionConfig(n_heads=2, head_dim=4, **window_kw)
    attn = MultiHeadAttention(10, cfg, causal=False).eval()
    ref_cfg = AttentionConfig(n_heads=2, head_dim=4, sink_logits=cfg.sink_logits)
    ref = MultiHeadAttention(10, ref_cfg, causal=False).eval()
    ref.load_state_dict(attn.state_dict())
    if cfg.sink_logits:
        attn.sink_logit.normal_()
        ref.sink_logit.copy_(attn.sink_logit)
    t, sinks = 11, cfg.sink_tokens
    x = torch.randn(2, t, 10)
    mask = global_window_mask(t, t, cfg.sliding_window - sinks, sinks, causal=False)
    torch.testing.assert_close(attn(x), ref(x, mask=mask))
    # the key right after a query (inside its window) reaches it
    y = x.clone()
    y[:, 1] += 1.0
    assert (attn(y)[:, 0] - attn(x)[:, 0]).abs().max() > 1e-4


@pytest.mark.parametrize("kind", ["mla", "dsa"])
@torch.no_grad()
def test_latent_attention_window_of_an_encoder_sees_both_sides(kind):
    """MLA's and DSA's windowed layers in an encoder attend within window - 1 positions on
    either side, as multi-head attention's. They applied the causal window once the input
    outgrew it: the encoder turned causal, and a row padded in a batch longer than the
    window gave other outputs than the row alone."""
    from attnlab.config import AttentionConfig
    from attnlab.functional.masks import global_window_mask
    from attnlab.nn.registry import build_attention

    torch.manual_seed(0)
    latent = dict(kind=kind, n_heads=2, q_lora_rank=8, kv_lora_rank=8, index_topk=64)
    cfg = AttentionConfig(sliding_window=3, **latent)
    attn = build_attention(kind, 16, cfg, causal=False).eval()
    ref = build_attention(kind, 16, AttentionConfig(**latent), causal=False).eval()
    ref.load_state_dict(attn.state_dict())
    t = 9
    x = torch.randn(2, t, 16)
    mask = global_window_mask(t, t, 3, 0, causal=False)
    torch.testing.assert_close(attn(x), ref(x, mask=mask))
    # through the encoder: a short row padded in a batch equals the row alone
    model = EncoderModel(
        EncoderConfig(vocab_size=VOCAB, d_model=16, n_layers=2, head="token", attention=cfg)
    ).eval()
    idx = torch.randint(0, VOCAB, (2, t))
    pad = torch.ones(2, t, dtype=torch.long)
    pad[1, 3:] = 0
    out = model(idx, attention_mask=pad).logits
    torch.testing.assert_close(out[1, :3], model(idx[1:, :3]).logits[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[0], model(idx[:1]).logits[0], atol=1e-5, rtol=1e-5)
