"""Pegasus mapping: transformers' PegasusForConditionalGeneration from tiny random configs is
the reference for logits with left- and right-padded sources, the loss and its gradients,
greedy and beam-search tokens under the cache, and export; the presets' sizes are their
models'. Shapes: b batch, s source length, t target length, V vocabulary size."""

from __future__ import annotations

import json

import pytest
import torch
from hf_cases import transformers
from oracle import randomize_weights

from attnlab.analysis import count_parameters
from attnlab.interop import HFCheckpointError, config_from_hf, load_hf, save_hf
from attnlab.models import build_model
from attnlab.presets import get_preset

V, PAD, EOS = 64, 0, 1  # Pegasus's: decoding starts from the pad token
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
        scale_embedding=True,
        activation_function="relu",
        pad_token_id=PAD,
        eos_token_id=EOS,
        decoder_start_token_id=PAD,
        forced_eos_token_id=EOS,
        attn_implementation="eager",
    )
    return transformers.PegasusConfig(**{**settings, **kw})


def _is_norm_weight(name: str, p: torch.Tensor) -> bool:
    return "norm" in name and name.endswith("weight")  # (the norms' biases: normal, as others)


def _reference(seed: int = 0, std: float = 0.3, emb: float = 1.0, bias: float = 1.0, **kw):
    """A transformers model with every weight far from its init but the sinusoid tables
    (stored parameters there, fixed), the token embedding ``emb`` times as wide, and a
    random final logits bias (a buffer there) of standard deviation ``bias``."""
    torch.manual_seed(seed)
    ref = transformers.PegasusForConditionalGeneration(_config(**kw)).eval()
    tables = {k: v.clone() for k, v in ref.state_dict().items() if "embed_positions" in k}
    randomize_weights(ref, seed, std=std, norms=(0.5, 1.5), is_norm=_is_norm_weight)
    ref.load_state_dict(tables, strict=False)
    with torch.no_grad():
        ref.final_logits_bias.copy_(bias * torch.randn(ref.final_logits_bias.shape))
        ref.model.shared.weight.mul_(emb)
    return ref


@pytest.fixture(scope="module")
def pegasus(tmp_path_factory):
    ref = _reference()
    path = tmp_path_factory.mktemp("pegasus")
    ref.save_pretrained(path)
    return ref, path


def _batch(s: int = 14, t: int = 11):
    """Row 0 right-padded, row 1 left-padded (Pegasus's positions count the padding)."""
    g = torch.Generator().manual_seed(1)
    src = torch.randint(2, V, (2, s), generator=g)
    mask = torch.ones(2, s, dtype=torch.long)
    src[0, s - 5 :], mask[0, s - 5 :] = PAD, 0
    src[1, :3], mask[1, :3] = PAD, 0
    tgt = torch.cat((torch.full((2, 1), PAD), torch.randint(2, V, (2, t - 1), generator=g)), 1)
    return src, mask, tgt


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def test_logits_match_transformers_with_padded_sources(pegasus):
    ref, path = pegasus
    model = load_hf(path)
    cfg = model.cfg
    assert (cfg.norm.placement, cfg.final_norm, cfg.sinusoid_layout) == ("pre", True, "split")
    assert cfg.position.kind == "sinusoidal" and cfg.position.padding_idx is None
    assert cfg.scale_embeddings and cfg.final_logits_bias and not cfg.embedding_norm
    assert cfg.ffn.activation == "relu"
    assert (cfg.n_layers, cfg.decoder_layers, cfg.bos_id, cfg.eos_id) == (2, 3, PAD, EOS)
    src, mask, tgt = _batch()
    with torch.no_grad():
        theirs = ref(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
        ours = model(src, tgt, src_mask=mask).logits
    assert theirs.abs().max() > 1.0
    assert _max_diff(ours, theirs) <= TOL


def test_gelu_config_matches_transformers(tmp_path):
    """PegasusConfig's default activation (GELU) and unscaled embeddings."""
    ref = _reference(seed=1, activation_function="gelu", scale_embedding=False)
    ref.save_pretrained(tmp_path)
    model = load_hf(tmp_path)
    assert model.cfg.ffn.activation == "gelu" and not model.cfg.scale_embeddings
    src, mask, tgt = _batch()
    with torch.no_grad():
        theirs = ref(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
        ours = model(src, tgt, src_mask=mask).logits
    assert _max_diff(ours, theirs) <= TOL


def _cat(attention, parts: str, which: str) -> torch.Tensor:
    """The gradients of transformers' q/k/v projections ``parts``, stacked as attnlab's."""
    return torch.cat([getattr(getattr(attention, f"{p}_proj"), which).grad for p in parts])


def test_loss_and_gradients_match_transformers(pegasus):
    """The loss of labels (-100 ignored) and the gradients of the weights. Not compared:
    the pad token's embedding row (transformers' embedding has it as padding_idx: no
    gradient from lookups; attnlab's trains it, which changes no real token's output)."""
    ref, path = pegasus
    model = load_hf(path)
    src, mask, _ = _batch()
    labels = torch.randint(2, V, (2, 9), generator=torch.Generator().manual_seed(5))
    labels[0, 6:] = -100  # a shorter target: ignored positions
    shifted = labels[:, :-1].masked_fill(labels[:, :-1] == -100, PAD)
    tgt = torch.cat((torch.full((2, 1), PAD), shifted), 1)
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
        "enc_norm.weight": (m.encoder.layer_norm.weight.grad, None),
        "dec_norm.bias": (m.decoder.layer_norm.bias.grad, None),
        "decoder.2.attn.qkv.weight": (_cat(m.decoder.layers[2].self_attn, "qkv", "weight"), None),
        "decoder.1.cross_attn.kv.bias": (
            _cat(m.decoder.layers[1].encoder_attn, "kv", "bias"),
            None,
        ),
        "encoder.1.ffn.down.weight": (m.encoder.layers[1].fc2.weight.grad, None),
    }
    params = dict(model.named_parameters())
    for name, (expected, rows) in grads.items():
        got = params[name].grad
        if rows is not None:
            got, expected = got[rows], expected[rows]
        assert _max_diff(got, expected) <= 1e-4 * expected.abs().max(), name


def test_export_loads_in_transformers_and_imports_back_identically(pegasus, tmp_path):
    ref, path = pegasus
    model = load_hf(path)
    save_hf(model, tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["model_type"] == "pegasus"
    assert hf["architectures"] == ["PegasusForConditionalGeneration"]
    back = transformers.PegasusForConditionalGeneration.from_pretrained(tmp_path).eval()
    src, mask, tgt = _batch()
    with torch.no_grad():
        expected = ref(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
        again = back(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
    assert _max_diff(again, expected) <= TOL  # (its default attention: sdpa, not eager)
    theirs = back.state_dict()  # the sinusoid tables written as transformers computes them
    assert all(_max_diff(theirs[k], v) <= 1e-6 for k, v in ref.state_dict().items())
    imported = load_hf(tmp_path)
    assert imported.cfg == model.cfg
    ours, theirs = model.state_dict(), imported.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


# weights whose greedy outputs are not one token repeated
GENERATION_WEIGHTS = dict(seed=0, std=0.3, bias=0.1)


def test_greedy_and_beam_tokens_equal_transformers_generate(tmp_path):
    """Cached greedy decoding and beam search give transformers' tokens, its forced last
    (eos) token included; the uncached loop the greedy ones."""
    ref = _reference(**GENERATION_WEIGHTS)
    ref.save_pretrained(tmp_path)
    model = load_hf(tmp_path)
    assert model.cfg.forced_eos_ids == [EOS] and model.cfg.forced_bos_id is None
    src, mask, _ = _batch()
    n = 12
    for k in (1, 3):
        out = ref.generate(input_ids=src, attention_mask=mask, max_new_tokens=n,
                           do_sample=False, num_beams=k, early_stopping=k > 1)  # fmt: skip
        ours = model.generate(src, n, src_mask=mask, num_beams=k)
        theirs = [seq[1:] for seq in out.tolist()]  # without the decoder start token
        theirs = [seq[: seq.index(EOS)] if EOS in seq else seq for seq in theirs]
        assert ours == theirs
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
        ({"eos_token_id": [1, 3]}, r"eos_token_id=\[1, 3\]"),
        ({"d_model": 33}, "d_model=33: Pegasus's sinusoids need an even d_model"),
    ],
)
def test_configs_attnlab_cannot_hold_are_refused_by_name(changes, named):
    hf = {**_config().to_dict(), **changes}
    with pytest.raises(HFCheckpointError, match=named):
        config_from_hf(hf)


@pytest.mark.parametrize("arch", ["PegasusModel", "PegasusForCausalLM"])
def test_other_pegasus_classes_are_refused_by_name(arch):
    with pytest.raises(HFCheckpointError, match=f"{arch}.*PegasusForConditionalGeneration"):
        config_from_hf({"model_type": "pegasus", "architectures": [arch]})


@pytest.mark.parametrize(
    "changes, needs",
    [
        ({"sinusoid_layout": "interleaved"}, "Pegasus needs split sinusoids"),
        ({"final_logits_bias": False}, "a final logits bias"),
        ({"final_norm": False}, "pre-norm blocks with final norms"),
        ({"norm.kind": "rmsnorm"}, "LayerNorm with bias"),
        ({"attention.scale": 0.5}, "the default softmax scale"),
        ({"scale_decoder_output": True}, "no rescale of the decoder's output"),
    ],
)
def test_export_refuses_what_pegasus_cannot_hold(changes, needs, tmp_path):
    cfg = get_preset("pegasus-tiny").override(changes)
    with pytest.raises(HFCheckpointError, match=needs):
        save_hf(build_model(cfg), tmp_path)
    assert not (tmp_path / "config.json").exists()


def _hf_config(cfg) -> dict:
    """The config.json of a preset, written out by hand (not by export)."""
    return dict(model_type="pegasus", vocab_size=cfg.vocab_size, d_model=cfg.d_model,
                encoder_layers=cfg.n_layers, decoder_layers=cfg.decoder_layers,
                encoder_attention_heads=cfg.n_heads, decoder_attention_heads=cfg.n_heads,
                encoder_ffn_dim=cfg.ffn.hidden_dim, decoder_ffn_dim=cfg.ffn.hidden_dim,
                max_position_embeddings=cfg.max_seq_len, scale_embedding=True,
                activation_function="relu", dropout=cfg.dropout,
                attention_dropout=cfg.attention.dropout, pad_token_id=0, eos_token_id=1,
                decoder_start_token_id=0, forced_eos_token_id=1)  # fmt: skip


@pytest.mark.parametrize("name", ["pegasus-tiny", "pegasus-large"])
def test_presets_count_transformers_parameters(name):
    """Each preset is what import reads from its config.json, and has the parameters of
    transformers' model of that config (built on the meta device) but its sinusoid tables
    (frozen parameters there, computed here), the final logits bias counted (a buffer
    there, a parameter here)."""
    preset = get_preset(name)
    hf = _hf_config(preset)
    assert config_from_hf(hf) == preset
    with torch.device("meta"):
        reference = transformers.PegasusForConditionalGeneration(transformers.PegasusConfig(**hf))
    tables = 2 * preset.max_seq_len * preset.d_model
    n = reference.num_parameters() - tables + reference.final_logits_bias.numel()
    assert count_parameters(preset)["total"] == n
    if name == "pegasus-large":
        assert round(n / 1e6) == 569  # google/pegasus-large: "568M" published (recalled)


def test_pegasus_tiny_fits_a_batch_in_a_few_steps():
    """pegasus-tiny trains: a few AdamW steps on one batch (copy the source) lower its loss."""
    torch.manual_seed(0)
    model = build_model(get_preset("pegasus-tiny"))
    src = torch.randint(2, 128, (8, 10))
    tgt = torch.cat((torch.full((8, 1), PAD), src[:, :-1]), 1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(10):
        loss = model(src, tgt, targets=src).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0]
