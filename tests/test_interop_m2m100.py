"""M2M100 / NLLB mapping: transformers' M2M100ForConditionalGeneration from tiny random
configs is the reference for logits with left- and right-padded sources (positions counted
past the padding id), the loss and its gradients, greedy and beam-search tokens under the
cache with a forced target language, and export; the presets' sizes are their models'.
Shapes: b batch, s source length, t target length, V vocabulary size."""

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
from attnlab.nn.embedding import tensor2tensor_table
from attnlab.presets import get_preset

V, PAD, BOS, EOS, LANG = 64, 1, 0, 2, 7
TOL = 1e-5  # float32 logits of a few units


def _config(**kw):
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
        attention_dropout=0.0,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
        decoder_start_token_id=EOS,
        attn_implementation="eager",
    )
    return transformers.M2M100Config(**{**settings, **kw})


def _is_norm_weight(name: str, p: torch.Tensor) -> bool:
    return "norm" in name and name.endswith("weight")  # (the norms' biases: normal, as others)


def _reference(seed: int = 0, std: float = 0.3, emb: float = 1.0, **kw):
    """A transformers model with every weight far from its init (the padding token's
    embedding too) and the token embedding ``emb`` times as wide."""
    torch.manual_seed(seed)
    ref = transformers.M2M100ForConditionalGeneration(_config(**kw)).eval()
    randomize_weights(ref, seed, std=std, norms=(0.5, 1.5), is_norm=_is_norm_weight)
    with torch.no_grad():
        ref.model.shared.weight.mul_(emb)
    return ref


@pytest.fixture(scope="module")
def m2m(tmp_path_factory):
    ref = _reference()
    path = tmp_path_factory.mktemp("m2m100")
    ref.save_pretrained(path)
    return ref, path


def _batch(s: int = 14, t: int = 11):
    """Row 0 right-padded, row 1 left-padded (M2M100's positions skip the padding)."""
    g = torch.Generator().manual_seed(1)
    src = torch.randint(3, V, (2, s), generator=g)
    mask = torch.ones(2, s, dtype=torch.long)
    src[0, s - 5 :], mask[0, s - 5 :] = PAD, 0
    src[1, :3], mask[1, :3] = PAD, 0
    tgt = torch.cat((torch.full((2, 1), EOS), torch.randint(3, V, (2, t - 1), generator=g)), 1)
    return src, mask, tgt


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def test_tensor2tensor_sinusoids_are_transformers_table():
    """attnlab's tensor2tensor sinusoids are M2M100's table (its padding row aside)."""
    emb = transformers.models.m2m_100.modeling_m2m_100.M2M100SinusoidalPositionalEmbedding
    table = emb.get_embedding(50, 32)  # (no padding row)
    assert _max_diff(tensor2tensor_table(torch.arange(50), 32), table) <= 1e-5
    with pytest.raises(ValueError, match="d_model >= 4"):
        tensor2tensor_table(torch.arange(3), 2)


def test_logits_match_transformers_with_padded_sources(m2m):
    ref, path = m2m
    model = load_hf(path)
    cfg = model.cfg
    assert (cfg.norm.placement, cfg.final_norm) == ("pre", True)
    assert cfg.sinusoid_layout == "tensor2tensor"
    assert cfg.position.kind == "sinusoidal" and cfg.position.padding_idx == PAD == cfg.pad_id
    assert cfg.scale_embeddings and not cfg.final_logits_bias and not cfg.embedding_norm
    assert (cfg.n_layers, cfg.decoder_layers, cfg.bos_id, cfg.eos_id) == (2, 3, EOS, EOS)
    src, mask, tgt = _batch()
    with torch.no_grad():
        theirs = ref(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
        ours = model(src, tgt, src_mask=mask).logits
        # left padding shifts no position: the row alone gives the same logits
        alone = model(src[1:, 3:], tgt[1:]).logits
    assert theirs.abs().max() > 1.0
    assert _max_diff(ours, theirs) <= TOL
    assert _max_diff(alone, ours[1:]) <= TOL


def _cat(attention, parts: str, which: str) -> torch.Tensor:
    """The gradients of transformers' q/k/v projections ``parts``, stacked as attnlab's."""
    return torch.cat([getattr(getattr(attention, f"{p}_proj"), which).grad for p in parts])


def test_loss_and_gradients_match_transformers(m2m):
    """The loss of labels (-100 ignored, read as padding in the decoder's inputs, whose
    positions then skip it) and the gradients of the weights, every row of the token
    embedding included: the padding token's gets the tied head's gradient alone in both (its
    lookups train nothing: ``padding_idx``)."""
    ref, path = m2m
    model = load_hf(path)
    src, mask, _ = _batch()
    labels = torch.randint(3, V, (2, 9), generator=torch.Generator().manual_seed(5))
    labels[0, 6:] = -100  # a shorter target: ignored positions
    shifted = labels[:, :-1].masked_fill(labels[:, :-1] == -100, PAD)
    tgt = torch.cat((torch.full((2, 1), EOS), shifted), 1)
    ref.zero_grad()
    theirs = ref(input_ids=src, attention_mask=mask, decoder_input_ids=tgt, labels=labels).loss
    theirs.backward()
    ours = model(src, tgt, src_mask=mask, targets=labels).loss
    ours.backward()
    assert abs(ours.item() - theirs.item()) <= TOL
    m = ref.model
    grads = {
        "src_emb.weight": m.shared.weight.grad,
        "enc_norm.weight": m.encoder.layer_norm.weight.grad,
        "dec_norm.bias": m.decoder.layer_norm.bias.grad,
        "decoder.2.attn.qkv.weight": _cat(m.decoder.layers[2].self_attn, "qkv", "weight"),
        "decoder.1.cross_attn.kv.bias": _cat(m.decoder.layers[1].encoder_attn, "kv", "bias"),
        "encoder.1.ffn.down.weight": m.encoder.layers[1].fc2.weight.grad,
    }
    params = dict(model.named_parameters())
    for name, expected in grads.items():
        assert _max_diff(params[name].grad, expected) <= 1e-4 * expected.abs().max(), name


def test_export_loads_in_transformers_and_imports_back_identically(m2m, tmp_path):
    ref, path = m2m
    model = load_hf(path)
    save_hf(model, tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["model_type"] == "m2m_100"
    assert hf["architectures"] == ["M2M100ForConditionalGeneration"]
    back = transformers.M2M100ForConditionalGeneration.from_pretrained(tmp_path).eval()
    src, mask, tgt = _batch()
    with torch.no_grad():
        expected = ref(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
        again = back(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
    assert _max_diff(again, expected) <= TOL  # (its default attention: sdpa, not eager)
    theirs = back.state_dict()
    assert all(torch.equal(theirs[k], v) for k, v in ref.state_dict().items())
    imported = load_hf(tmp_path)
    assert imported.cfg == model.cfg
    ours, theirs = model.state_dict(), imported.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


# weights whose greedy outputs are not one token repeated
GENERATION_WEIGHTS = dict(seed=0, std=0.3, emb=0.3)


def test_greedy_and_beam_tokens_equal_transformers_generate(tmp_path):
    """Cached greedy decoding and beam search give transformers' tokens, the target
    language forced first (forced_bos_token_id, from generation_config.json); the uncached
    loop the greedy ones."""
    ref = _reference(**GENERATION_WEIGHTS)
    ref.generation_config.forced_bos_token_id = LANG
    ref.save_pretrained(tmp_path)
    model = load_hf(tmp_path)
    assert model.cfg.forced_bos_id == LANG and model.cfg.forced_eos_ids == []
    src, mask, _ = _batch()
    n = 12
    for k in (1, 3):
        out = ref.generate(input_ids=src, attention_mask=mask, max_new_tokens=n,
                           do_sample=False, num_beams=k, early_stopping=k > 1)  # fmt: skip
        ours = model.generate(src, n, src_mask=mask, num_beams=k)
        theirs = [seq[1:] for seq in out.tolist()]  # without the decoder start token
        theirs = [seq[: seq.index(EOS)] if EOS in seq else seq for seq in theirs]
        assert ours == theirs
        assert all(row[0] == LANG for row in ours)
        if k == 1:  # not one token repeated
            assert len({token for row in ours for token in row}) > 3
    assert model.generate(src, n, src_mask=mask, use_cache=False) == model.generate(
        src, n, src_mask=mask
    )


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"decoder_attention_heads": 2}, "encoder_attention_heads=4 != decoder_attention_heads=2"),
        ({"decoder_ffn_dim": 32}, "encoder_ffn_dim=48 != decoder_ffn_dim=32"),
        ({"eos_token_id": [2, 3]}, r"eos_token_id=\[2, 3\]"),
        ({"d_model": 33}, "d_model=33: M2M100's sinusoids need an even d_model"),
        ({"activation_function": "foo"}, "activation_function"),
    ],
)
def test_configs_attnlab_cannot_hold_are_refused_by_name(changes, named):
    hf = {**_config().to_dict(), **changes}
    with pytest.raises(HFCheckpointError, match=named):
        config_from_hf(hf)


def test_other_m2m100_classes_are_refused_by_name():
    with pytest.raises(HFCheckpointError, match="M2M100Model.*M2M100ForConditionalGeneration"):
        config_from_hf({"model_type": "m2m_100", "architectures": ["M2M100Model"]})


@pytest.mark.parametrize(
    "changes, needs",
    [
        ({"sinusoid_layout": "split"}, "M2M100 needs tensor2tensor sinusoids"),
        ({"position.padding_idx": None}, r"positions counted past the padding token"),
        ({"final_logits_bias": True}, "no final logits bias"),
        ({"norm.placement": "post", "final_norm": False}, "pre-norm blocks with final norms"),
        ({"embedding_norm": True}, "no norm on the embeddings"),
        ({"attention.n_kv_heads": 2}, "multi-head attention"),
        ({"tie_embeddings": False}, "share_embeddings = tie_embeddings"),
    ],
)
def test_export_refuses_what_m2m100_cannot_hold(changes, needs, tmp_path):
    cfg = get_preset("m2m100-tiny").override(changes)
    with pytest.raises(HFCheckpointError, match=needs):
        save_hf(build_model(cfg), tmp_path)
    assert not (tmp_path / "config.json").exists()


@pytest.mark.parametrize(
    "preset, changes, named",
    [
        ("m2m100-tiny", {"pad_id": 0}, "position.padding_idx: 1 must be the padding token"),
        ("m2m100-tiny", {"position.kind": "learned"}, "counts sinusoidal positions in an enc"),
        (
            "roberta-tiny",
            {"position.kind": "sinusoidal"},
            "counts an encoder's learned positions",
        ),  # fmt: skip
    ],
)
def test_positions_past_the_padding_id_are_validated(preset, changes, named):
    with pytest.raises(ConfigError, match=named):
        get_preset(preset).override(changes).validate()


def _hf_config(cfg) -> dict:
    """The config.json of a preset, written out by hand (not by export)."""
    return dict(model_type="m2m_100", vocab_size=cfg.vocab_size, d_model=cfg.d_model,
                encoder_layers=cfg.n_layers, decoder_layers=cfg.decoder_layers,
                encoder_attention_heads=cfg.n_heads, decoder_attention_heads=cfg.n_heads,
                encoder_ffn_dim=cfg.ffn.hidden_dim, decoder_ffn_dim=cfg.ffn.hidden_dim,
                max_position_embeddings=cfg.max_seq_len, scale_embedding=True,
                activation_function="relu", dropout=cfg.dropout,
                attention_dropout=cfg.attention.dropout, pad_token_id=1, bos_token_id=0,
                eos_token_id=2, decoder_start_token_id=2)  # fmt: skip


@pytest.mark.parametrize("name", ["m2m100-tiny", "m2m100-418m", "nllb-200-distilled-600m"])
def test_presets_count_transformers_parameters(name):
    """Each preset is what import reads from its config.json, and has the parameters of
    transformers' model of that config (built on the meta device)."""
    preset = get_preset(name)
    hf = _hf_config(preset)
    assert config_from_hf(hf) == preset
    with torch.device("meta"):
        reference = transformers.M2M100ForConditionalGeneration(transformers.M2M100Config(**hf))
    assert count_parameters(preset)["total"] == reference.num_parameters()


def test_m2m100_tiny_fits_a_batch_in_a_few_steps():
    """m2m100-tiny trains: a few AdamW steps on one batch (copy the source) lower its loss."""
    torch.manual_seed(0)
    model = build_model(get_preset("m2m100-tiny"))
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
