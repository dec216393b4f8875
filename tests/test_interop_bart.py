"""BART and mBART mapping: transformers' BartForConditionalGeneration and
MBartForConditionalGeneration from tiny random configs are the reference for logits with
padded sources, the loss and its gradients, greedy and beam-search tokens under the cache,
and export; the presets' sizes are their models'. Shapes: b batch, s source length, t target
length, V vocabulary size."""

from __future__ import annotations

import json

import pytest
import torch
from hf_cases import transformers
from oracle import randomize_weights

from attnlab.analysis import count_parameters
from attnlab.config import ConfigError
from attnlab.interop import HFCheckpointError, config_from_hf, load_hf, save_hf
from attnlab.models import build_model
from attnlab.presets import get_preset

V, PAD, BOS, EOS = 64, 1, 0, 2
TOL = 1e-5  # float32 logits of a few units

KINDS = {  # model_type -> (config class, model class, settings)
    "bart": ("BartConfig", "BartForConditionalGeneration", dict(scale_embedding=False)),
    "mbart": ("MBartConfig", "MBartForConditionalGeneration", dict(scale_embedding=True)),
}


def _config(kind: str, **kw):
    config_class, _, own = KINDS[kind]
    settings = dict(
        vocab_size=V,
        d_model=32,
        encoder_layers=2,
        decoder_layers=3,  # depths may differ
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=48,
        decoder_ffn_dim=48,
        max_position_embeddings=40,
        dropout=0.0,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
        decoder_start_token_id=EOS,
        attn_implementation="eager",
    )
    return getattr(transformers, config_class)(**{**settings, **own, **kw})


def _is_norm_weight(name: str, p: torch.Tensor) -> bool:
    return "norm" in name and name.endswith("weight")  # (the norms' biases: normal, as others)


def _reference(kind: str, seed: int = 0, std: float = 0.3, emb: float = 1.0, **kw):
    """A transformers model with every weight far from its init (the position tables' two
    unread rows too), the token embedding ``emb`` times as wide, and a random final logits
    bias (a buffer there)."""
    torch.manual_seed(seed)
    ref = getattr(transformers, KINDS[kind][1])(_config(kind, **kw)).eval()
    randomize_weights(ref, seed, std=std, norms=(0.5, 1.5), is_norm=_is_norm_weight)
    with torch.no_grad():
        ref.final_logits_bias.copy_(torch.randn(ref.final_logits_bias.shape))
        ref.model.shared.weight.mul_(emb)
    return ref


@pytest.fixture(scope="module", params=list(KINDS))
def bart(request, tmp_path_factory):
    ref = _reference(request.param)
    path = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(path)
    return request.param, ref, path


def _batch(s: int = 14, t: int = 11):
    """Row 0 right-padded, row 1 left-padded (BART's positions ignore the padding)."""
    g = torch.Generator().manual_seed(1)
    src = torch.randint(3, V, (2, s), generator=g)
    mask = torch.ones(2, s, dtype=torch.long)
    src[0, s - 5 :], mask[0, s - 5 :] = PAD, 0
    src[1, :3], mask[1, :3] = PAD, 0
    tgt = torch.cat((torch.full((2, 1), EOS), torch.randint(3, V, (2, t - 1), generator=g)), 1)
    return src, mask, tgt


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def test_logits_match_transformers_with_padded_sources(bart):
    kind, ref, path = bart
    model = load_hf(path)
    cfg = model.cfg
    assert (cfg.norm.placement, cfg.final_norm) == (("post", False), ("pre", True))[kind == "mbart"]
    assert cfg.embedding_norm and cfg.position_offset == 2 and cfg.final_logits_bias
    assert cfg.scale_embeddings == (kind == "mbart")
    assert (cfg.n_layers, cfg.decoder_layers, cfg.bos_id) == (2, 3, EOS)
    src, mask, tgt = _batch()
    with torch.no_grad():
        theirs = ref(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
        ours = model(src, tgt, src_mask=mask).logits
    assert theirs.abs().max() > 1.0
    assert _max_diff(ours, theirs) <= TOL


def _cat(attention, parts: str, which: str) -> torch.Tensor:
    """The gradients of transformers' q/k/v projections ``parts``, stacked as attnlab's."""
    return torch.cat([getattr(getattr(attention, f"{p}_proj"), which).grad for p in parts])


def test_loss_and_gradients_match_transformers(bart):
    """The loss of labels (-100 ignored) and the gradients of the weights. Not compared:
    the pad token's embedding row (transformers' embedding has it as padding_idx: no
    gradient from lookups; attnlab's trains it, which changes no real token's output)."""
    kind, ref, path = bart
    model = load_hf(path)
    src, mask, _ = _batch()
    labels = torch.randint(3, V, (2, 9), generator=torch.Generator().manual_seed(5))
    labels[0, 6:] = -100  # a shorter target: ignored positions
    # decoder inputs: the start token, then the labels shifted right (-100 read as padding),
    # given to both (mBART's own shift starts from each row's last label, its language id)
    shifted = labels[:, :-1].masked_fill(labels[:, :-1] == -100, PAD)
    tgt = torch.cat((torch.full((2, 1), EOS), shifted), 1)
    ref.zero_grad()
    theirs = ref(input_ids=src, attention_mask=mask, decoder_input_ids=tgt, labels=labels).loss
    theirs.backward()
    ours = model(src, tgt, src_mask=mask, targets=labels).loss
    ours.backward()
    assert abs(ours.item() - theirs.item()) <= TOL
    m = ref.model
    real_rows = torch.arange(V) != PAD
    grads = {
        "src_emb.weight": (m.shared.weight.grad, real_rows),
        "src_pos.weight": (m.encoder.embed_positions.weight.grad, None),
        "tgt_pos.weight": (m.decoder.embed_positions.weight.grad, None),
        "src_emb_norm.weight": (m.encoder.layernorm_embedding.weight.grad, None),
        "tgt_emb_norm.bias": (m.decoder.layernorm_embedding.bias.grad, None),
        "decoder.2.attn.qkv.weight": (_cat(m.decoder.layers[2].self_attn, "qkv", "weight"), None),
        "decoder.1.cross_attn.kv.bias": (
            _cat(m.decoder.layers[1].encoder_attn, "kv", "bias"),
            None,
        ),
        "encoder.1.ffn.down.weight": (m.encoder.layers[1].fc2.weight.grad, None),
    }
    if kind == "mbart":
        grads["enc_norm.weight"] = (m.encoder.layer_norm.weight.grad, None)
        grads["dec_norm.bias"] = (m.decoder.layer_norm.bias.grad, None)
    params = dict(model.named_parameters())
    for name, (expected, rows) in grads.items():
        got = params[name].grad
        if rows is not None:
            got, expected = got[rows], expected[rows]
        assert _max_diff(got, expected) <= 1e-4 * expected.abs().max(), name


def test_export_loads_in_transformers_and_imports_back_identically(bart, tmp_path):
    kind, ref, path = bart
    model = load_hf(path)
    save_hf(model, tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["model_type"] == kind and hf["architectures"] == [KINDS[kind][1]]
    back = getattr(transformers, KINDS[kind][1]).from_pretrained(tmp_path).eval()
    src, mask, tgt = _batch()
    with torch.no_grad():
        expected = ref(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
        again = back(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
    assert _max_diff(again, expected) <= TOL  # (its default attention: sdpa, not eager)
    theirs = back.state_dict()
    assert all(torch.equal(theirs[k], v) for k, v in ref.state_dict().items())
    # the position tables' first two rows, exported as stored, are never read there
    with torch.no_grad():
        for stack in (back.model.encoder, back.model.decoder):
            stack.embed_positions.weight[:2] = 1e4
        assert torch.equal(
            back(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits, again
        )
    imported = load_hf(tmp_path)
    assert imported.cfg == model.cfg
    ours, theirs = model.state_dict(), imported.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


# weights whose greedy outputs are not one token repeated
GENERATION_WEIGHTS = {"bart": dict(seed=2, std=0.2, emb=2.5), "mbart": dict(seed=8, std=0.5)}


@pytest.mark.parametrize("kind", list(KINDS))
def test_greedy_and_beam_tokens_equal_transformers_generate(kind, tmp_path):
    """Cached greedy decoding and beam search give transformers' tokens, its forced first
    (bos) and last (eos) tokens included; the uncached loop the greedy ones. (BART's
    forced_bos_token_id comes from generation_config.json, which save_pretrained writes.)"""
    ref = _reference(kind, **GENERATION_WEIGHTS[kind])
    if kind == "bart":  # (transformers 5 keeps it in the generation config alone)
        ref.generation_config.forced_bos_token_id = BOS
    ref.save_pretrained(tmp_path)
    model = load_hf(tmp_path)
    assert model.cfg.forced_bos_id == (BOS if kind == "bart" else None)
    assert model.cfg.forced_eos_ids == [EOS]
    src, mask, _ = _batch()
    n = 12
    for k in (1, 3):
        out = ref.generate(input_ids=src, attention_mask=mask, max_new_tokens=n,
                           do_sample=False, num_beams=k, early_stopping=k > 1)  # fmt: skip
        ours = model.generate(src, n, src_mask=mask, num_beams=k)
        theirs = [seq[1:] for seq in out.tolist()]  # without the decoder start token
        theirs = [seq[: seq.index(EOS)] if EOS in seq else seq for seq in theirs]
        assert ours == theirs
        assert len({token for row in ours for token in row}) > 3  # not one token repeated
        if kind == "bart":
            assert all(row[0] == BOS for row in ours)
    assert model.generate(src, n, src_mask=mask, use_cache=False) == model.generate(
        src, n, src_mask=mask
    )


def test_untied_tables_match_transformers(tmp_path):
    """tie_word_embeddings=false: the encoder, the decoder and the head have tables of their
    own (model.shared stored but unused), both ways."""
    ref = _reference("bart", seed=2, tie_word_embeddings=False)
    ref.save_pretrained(tmp_path / "hf")
    model = load_hf(tmp_path / "hf")
    assert not (model.cfg.tie_embeddings or model.cfg.share_embeddings)
    save_hf(model, tmp_path / "out")
    back = transformers.BartForConditionalGeneration.from_pretrained(tmp_path / "out").eval()
    src, mask, tgt = _batch()
    with torch.no_grad():
        theirs = ref(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
        ours = model(src, tgt, src_mask=mask).logits
        again = back(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
    assert _max_diff(ours, theirs) <= TOL and _max_diff(again, theirs) <= TOL


def test_mbart_without_a_start_token_starts_from_bos():
    """MBartConfig has no decoder_start_token_id: generate starts from bos_token_id."""
    hf = _config("mbart", decoder_start_token_id=None, bos_token_id=5).to_dict()
    assert config_from_hf(hf).bos_id == 5


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"decoder_attention_heads": 2}, "encoder_attention_heads=4 != decoder_attention_heads=2"),
        ({"decoder_ffn_dim": 32}, "encoder_ffn_dim=48 != decoder_ffn_dim=32"),
        ({"eos_token_id": [2, 3]}, r"eos_token_id=\[2, 3\]"),
        ({"activation_function": "foo"}, "activation_function"),
    ],
)
def test_configs_attnlab_cannot_hold_are_refused_by_name(changes, named):
    hf = {**_config("bart").to_dict(), **changes}
    with pytest.raises(HFCheckpointError, match=named):
        config_from_hf(hf)


@pytest.mark.parametrize("arch", ["BartModel", "BartForSequenceClassification", "BartForCausalLM"])
def test_other_bart_classes_are_refused_by_name(arch):
    with pytest.raises(HFCheckpointError, match=f"{arch}.*BartForConditionalGeneration"):
        config_from_hf({"model_type": "bart", "architectures": [arch]})


@pytest.mark.parametrize(
    "changes, needs",
    [
        ({"embedding_norm": False}, "embedding_norm true"),
        ({"position_offset": 0}, "position_offset=2"),
        ({"norm.kind": "rmsnorm"}, "LayerNorm with bias"),
        ({"final_norm": True}, "post-norm blocks without final norms"),
        ({"final_logits_bias": False}, "a final logits bias"),
        ({"attention.n_kv_heads": 2}, "multi-head attention"),
        ({"attention.scale": 0.5}, "the default softmax scale"),
        ({"tie_embeddings": False}, "share_embeddings = tie_embeddings"),
        ({"scale_decoder_output": True}, "no rescale of the decoder's output"),
    ],
)
def test_export_refuses_what_bart_cannot_hold(changes, needs, tmp_path):
    cfg = get_preset("bart-tiny").override(changes)
    with pytest.raises(HFCheckpointError, match=needs):
        save_hf(build_model(cfg), tmp_path)
    assert not (tmp_path / "config.json").exists()


def test_new_config_fields_are_validated():
    with pytest.raises(ConfigError, match="position_offset.*set position_offset to 0"):
        get_preset("bart-tiny").override({"position.kind": "sinusoidal"}).validate()
    with pytest.raises(ConfigError, match="forced_bos_id"):
        get_preset("bart-tiny").override({"forced_bos_id": 128}).validate()


def _hf_config(cfg) -> dict:
    """The config.json of a preset, written out by hand (not by export)."""
    return dict(model_type="mbart" if cfg.final_norm else "bart", vocab_size=cfg.vocab_size,
                d_model=cfg.d_model, encoder_layers=cfg.n_layers,
                decoder_layers=cfg.decoder_layers, encoder_attention_heads=cfg.n_heads,
                decoder_attention_heads=cfg.n_heads, encoder_ffn_dim=cfg.ffn.hidden_dim,
                decoder_ffn_dim=cfg.ffn.hidden_dim, max_position_embeddings=cfg.max_seq_len,
                scale_embedding=cfg.scale_embeddings, dropout=cfg.dropout,
                attention_dropout=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                forced_eos_token_id=2,
                decoder_start_token_id=None if cfg.final_norm else 2)  # fmt: skip


@pytest.mark.parametrize(
    "name", ["bart-tiny", "bart-base", "bart-large", "mbart-large-cc25", "mbart-large-50"]
)
def test_presets_count_transformers_parameters(name):
    """Each preset is what import reads from its config.json, and has the parameters of
    transformers' model of that config (built on the meta device), the final logits bias
    counted (a buffer there, a parameter here)."""
    preset = get_preset(name)
    hf = _hf_config(preset)
    assert config_from_hf(hf) == preset
    config_class, model_class, _ = KINDS[hf["model_type"]]
    with torch.device("meta"):
        reference = getattr(transformers, model_class)(getattr(transformers, config_class)(**hf))
    n = reference.num_parameters() + reference.final_logits_bias.numel()
    assert count_parameters(preset)["total"] == n
    published = {"bart-base": 139, "bart-large": 406, "mbart-large-cc25": 611}  # millions
    if name in published:
        assert round(n / 1e6) == published[name]


def test_bart_tiny_fits_a_batch_in_a_few_steps():
    """bart-tiny trains: a few AdamW steps on one batch (copy the source) lower its loss."""
    torch.manual_seed(0)
    model = build_model(get_preset("bart-tiny"))
    src = torch.randint(3, 128, (8, 10))
    tgt = torch.cat((torch.full((8, 1), EOS), src[:, :-1]), 1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(10):
        loss = model(src, tgt, targets=src).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0]


def test_translate_cli_on_an_imported_bart_is_transformers_greedy(tmp_path, capsys):
    """``attnlab import-hf`` then ``attnlab translate --source-ids`` (greedy) prints the
    tokens transformers' ``generate`` gives, its forced first token included."""
    from attnlab.cli.main import main

    ref = _reference("bart", **GENERATION_WEIGHTS["bart"])
    ref.generation_config.forced_bos_token_id = BOS
    ref.save_pretrained(tmp_path / "hf")
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "run")]) == 0
    batch, mask, _ = _batch()
    src = batch[1][mask[1].bool()].tolist()  # the left-padded row without its padding
    n = 10
    capsys.readouterr()
    argv = ["translate", "--ckpt", str(tmp_path / "run"), "--source-ids", ",".join(map(str, src))]
    assert main([*argv, "--num-beams", "1", "--max-new-tokens", str(n)]) == 0
    out = capsys.readouterr().out
    (row,) = ref.generate(input_ids=torch.tensor([src]), max_new_tokens=n, do_sample=False,
                          num_beams=1).tolist()  # fmt: skip
    theirs = row[1:]  # without the decoder start token
    theirs = theirs[: theirs.index(EOS)] if EOS in theirs else theirs
    assert theirs[0] == BOS and len(set(theirs)) > 2
    assert out == ",".join(map(str, src)) + "\t" + ",".join(map(str, theirs)) + "\n"
