"""OPT checkpoints: transformers models from tiny random configs (pre-norm with a tied head;
post-norm blocks without a final norm and an untied head; 3 heads without biases) with
every weight set to random values, loaded with ``load_hf``, give the same logits (with
left padding, by transformers' own positions from the mask), loss and gradients, and the
same greedy tokens; attnlab models in OPT's layout saved with ``save_hf`` load in
transformers with the same logits and load back exactly, the two offset rows of the
position table written as zeros that transformers never reads for a real token; the
learned-position decoders GPT-2 holds stay GPT-2's; what OPT cannot hold is refused by
name.

Shapes: b batch, t length, V vocabulary, d d_model.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from hf_cases import HFCases, transformers
from oracle import (
    assert_greedy_tokens_match_hf,
    assert_left_padded_logits_match_hf,
    assert_logits_match_hf,
    hf_training_loss,
    left_padded_batch,
)
from safetensors.torch import load_file

from attnlab.analysis import count_parameters
from attnlab.interop import HFCheckpointError, config_from_hf, hf_model_type, load_hf, save_hf
from attnlab.models.decoder import DecoderLM
from attnlab.presets import OPT_SIZES, get_preset

V = 97
TOL = 1e-5  # float32 logits up to ~10 (weights of std 0.3)
_BASE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64)
_BASE |= dict(max_position_embeddings=64, dropout=0.0)
CASES = {
    # OPT-125m's block: pre-norm, biases, ReLU, a final LayerNorm, a tied head
    "pre-norm": dict(_BASE),
    # OPT-350m's blocks (without its projections): post-norm, no final LayerNorm; untied
    "post-norm-untied": dict(_BASE, do_layer_norm_before=False, tie_word_embeddings=False),
    # 3 heads of 16, no biases on the projections (the LayerNorms keep theirs), 3 layers
    "3-heads-no-bias": dict(
        _BASE,
        hidden_size=48,
        num_attention_heads=3,
        ffn_dim=80,
        num_hidden_layers=3,
        enable_bias=False,
    ),  # fmt: skip
}


def _is_norm(name: str, p: torch.Tensor) -> bool:
    """LayerNorm weights (in [0.5, 1.5)); every other parameter (biases, positions) random."""
    return ("norm" in name or "layer_norm" in name) and name.endswith("weight")


HF = HFCases("OPTConfig", "OPTForCausalLM", CASES, V, norms=(0.5, 1.5), is_norm=_is_norm)
imported = HF.imported_fixture()


def test_import_config_and_weights(imported):
    """The config as transformers reads it; the position table without its two offset rows
    (attnlab counts 2 d parameters fewer); separate q, k, v stacked."""
    case, ref, model = imported
    cfg, hf = model.cfg, ref.config
    assert model.num_parameters() + 2 * cfg.d_model == ref.num_parameters()
    assert config_from_hf(hf.to_dict()) == cfg  # the in-memory config, not only config.json
    assert cfg.norm.placement == ("pre" if hf.do_layer_norm_before else "post")
    assert cfg.position.kind == "learned" and cfg.max_seq_len == hf.max_position_embeddings
    assert cfg.ffn.activation == "relu" and cfg.ffn.hidden_dim == hf.ffn_dim
    assert cfg.attention.qkv_bias == cfg.attention.out_bias == cfg.ffn.bias == hf.enable_bias
    assert cfg.tie_embeddings == hf.tie_word_embeddings
    decoder = ref.model.decoder
    assert torch.equal(model.pos_emb.weight, decoder.embed_positions.weight[2:])
    block, layer = model.blocks[1], decoder.layers[1]
    attn = layer.self_attn
    stacked = torch.cat([getattr(attn, f"{n}_proj").weight for n in "qkv"])
    assert torch.equal(block.attn.qkv.weight, stacked)
    assert torch.equal(block.attn_norm.bias, layer.self_attn_layer_norm.bias)
    assert torch.equal(block.ffn_norm.weight, layer.final_layer_norm.weight)
    assert (decoder.final_layer_norm is None) == (cfg.norm.placement == "post")
    assert (model.lm_head.weight is model.tok_emb.weight) == cfg.tie_embeddings


def test_import_logits(imported):
    case, ref, model = imported
    assert_logits_match_hf(ref, model, V, TOL)
    assert_left_padded_logits_match_hf(ref, model, V, TOL)


def test_left_padding_by_transformers_own_positions(imported):
    """transformers' OPT numbers positions from the mask itself (cumsum(mask) * mask - 1,
    past 2 offset rows): a left-padded row's first real token is at position 0, as in
    attnlab; no position_ids are passed here."""
    case, ref, model = imported
    idx, mask = left_padded_batch(V)
    with torch.no_grad():
        ours = model(idx, attention_mask=mask).logits
        theirs = ref(idx, attention_mask=mask).logits
        whole = model(idx[2:, 9:]).logits  # row 2's real tokens alone
    real = mask.bool()
    assert (ours[real] - theirs[real]).abs().max() <= TOL
    assert (ours[2, 9:] - whole[0]).abs().max() <= TOL


def test_import_greedy_generation(imported):
    case, ref, model = imported
    assert_greedy_tokens_match_hf(ref, model, V, n=10)


def test_training_loss_and_gradients_match_transformers(imported):
    """A loss backward in training mode (dropout 0) over a left-padded batch: the loss and
    the gradients of q/k/v, the norms, the MLP, the positions and the embedding."""
    case, ref, model = imported
    ref, model = ref.train(), model.train()
    idx, mask = left_padded_batch(V)
    targets = torch.cat([idx[:, 1:], torch.full_like(idx[:, :1], -100)], 1)
    targets = targets.masked_fill(mask == 0, -100)
    ours = model(idx, attention_mask=mask, targets=targets).loss
    theirs = hf_training_loss(ref, idx, targets, mask)
    ours.backward()
    theirs.backward()
    try:
        assert abs(ours.item() - theirs.item()) <= 1e-5
        decoder = ref.model.decoder
        block, layer = model.blocks[1], decoder.layers[1]
        attn = layer.self_attn
        qkv_grad = torch.cat([getattr(attn, f"{n}_proj").weight.grad for n in "qkv"])
        pairs = [
            (block.attn.qkv.weight.grad, qkv_grad),
            (block.attn.out.weight.grad, attn.out_proj.weight.grad),
            (block.attn_norm.weight.grad, layer.self_attn_layer_norm.weight.grad),
            (block.ffn_norm.bias.grad, layer.final_layer_norm.bias.grad),
            (block.ffn.up.weight.grad, layer.fc1.weight.grad),
            (block.ffn.down.weight.grad, layer.fc2.weight.grad),
            (model.pos_emb.weight.grad, decoder.embed_positions.weight.grad[2:]),
            (model.tok_emb.weight.grad, decoder.embed_tokens.weight.grad),
        ]
        if model.cfg.ffn.bias:
            pairs.append((block.ffn.down.bias.grad, layer.fc2.bias.grad))
        if not model.cfg.tie_embeddings:
            pairs.append((model.lm_head.weight.grad, ref.lm_head.weight.grad))
        for got, want in pairs:
            # float32 sums over the batch in different orders: 1e-4
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    finally:
        ref.eval().zero_grad()
        model.eval().zero_grad()


def test_headless_opt_model_checkpoint(tmp_path):
    """An OPTModel folder (``decoder.`` names, no ``model.`` prefix, no head) of a tied
    model loads with the causal LM's logits."""
    ref = HF.model("pre-norm", seed=7)
    ref.model.save_pretrained(tmp_path)
    assert not any(k.startswith("model.") for k in load_file(tmp_path / "model.safetensors"))
    assert_logits_match_hf(ref, load_hf(tmp_path), V, TOL)


# --------------------------------------------------------------------------- export


def _tiny(**changes):
    return get_preset("opt-tiny").override({"vocab_size": V, **changes})


EXPORTS = {
    "opt-tiny": _tiny(),
    # post-norm blocks (no final norm) with the exact GELU, an untied head, 3 layers
    "post-norm-gelu-untied": _tiny(
        **{"norm.placement": "post", "ffn.activation": "gelu", "tie_embeddings": False},
        n_layers=3,
    ),
    # no projection biases, 2 heads of 32, an MLP of 3 d
    "no-bias": _tiny(
        **{"attention.qkv_bias": False, "attention.out_bias": False, "ffn.bias": False},
        **{"attention.n_heads": 2, "ffn.hidden_dim": 192},
    ),
}


@pytest.mark.parametrize("name", list(EXPORTS))
def test_export_round_trip(name, tmp_path):
    cfg = EXPORTS[name]
    torch.manual_seed(20)
    model = DecoderLM(cfg).eval()
    HF.randomize(model, seed=len(name))
    assert hf_model_type(cfg) == "opt"
    save_hf(model, tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    assert ("lm_head.weight" in stored) == (not cfg.tie_embeddings)
    assert ("model.decoder.layers.0.fc1.bias" in stored) == cfg.ffn.bias
    assert ("model.decoder.final_layer_norm.weight" in stored) == (cfg.norm.placement == "pre")
    table = stored["model.decoder.embed_positions.weight"]  # (L + 2, d): 2 zero rows first
    assert table.shape == (cfg.max_seq_len + 2, cfg.d_model) and not table[:2].any()

    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert type(ref).__name__ == "OPTForCausalLM"
    assert ref.config.do_layer_norm_before == (cfg.norm.placement == "pre")
    assert_logits_match_hf(ref.eval(), model, V, TOL)
    assert_left_padded_logits_match_hf(ref, model, V, TOL)

    back = load_hf(tmp_path)  # import(export(x)): the same model, the same numbers
    assert back.cfg == cfg
    mine = model.state_dict()
    assert all(torch.equal(v, mine[k]) for k, v in back.state_dict().items())
    idx, mask = left_padded_batch(V)
    with torch.no_grad():
        assert torch.equal(
            back(idx, attention_mask=mask).logits, model(idx, attention_mask=mask).logits
        )
    save_hf(back, tmp_path / "again")  # export(import(export(x))) writes the same tensors
    twice = load_file(tmp_path / "again" / "model.safetensors")
    assert twice.keys() == stored.keys()
    assert all(torch.equal(twice[k], stored[k]) for k in stored)


def test_offset_rows_are_never_read_for_real_tokens(tmp_path):
    """The two rows before position 0 (written as zeros) set to random values: transformers'
    logits of every real token are unchanged, left padding included (its own positions)."""
    torch.manual_seed(4)
    model = DecoderLM(_tiny()).eval()
    HF.randomize(model, seed=4)
    save_hf(model, tmp_path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    idx, mask = left_padded_batch(V)
    real = mask.bool()
    table = ref.model.decoder.embed_positions.weight
    with torch.no_grad():
        before = ref(idx, attention_mask=mask).logits
        table[:2] = torch.randn(2, table.shape[1], generator=torch.Generator().manual_seed(1))
        after = ref(idx, attention_mask=mask).logits
        ours = model(idx, attention_mask=mask).logits
    assert torch.equal(before[real], after[real])
    assert (ours[real] - after[real]).abs().max() <= TOL


def test_missing_biases_are_written_as_zeros_and_read_back_as_such(tmp_path):
    """OPT's biases are on every projection or none, and its LayerNorms always have one: a
    model with some only (and bias-free norms) exports zeros for the rest (the same logits)
    and imports with them all."""
    cfg = _tiny(**{"ffn.bias": False, "norm.bias": False, "attention.out_bias": False})
    torch.manual_seed(3)
    model = DecoderLM(cfg).eval()
    assert hf_model_type(cfg) == "opt"
    save_hf(model, tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    zeros = ("layers.1.fc2.bias", "layers.0.self_attn.out_proj.bias", "final_layer_norm.bias")
    for name in zeros:
        assert not stored[f"model.decoder.{name}"].any()
    back = load_hf(tmp_path)
    assert back.cfg.ffn.bias and back.cfg.attention.out_bias and back.cfg.norm.bias
    idx = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(back(idx).logits, model(idx).logits, atol=0, rtol=0)


@pytest.mark.parametrize(
    "preset, changes, model_type",
    [
        ("opt-tiny", {}, "opt"),
        ("opt-tiny", {"norm.placement": "post"}, "opt"),
        ("opt-tiny", {"ffn.activation": "gelu_tanh"}, "gpt2"),  # GELU, pre-norm: GPT-2's
        ("opt-tiny", {"ffn.activation": "gelu", "norm.placement": "post"}, "opt"),
        ("gpt2-tiny", {}, "gpt2"),
        ("gpt2-tiny", {"ffn.activation": "relu"}, "opt"),  # a ReLU MLP: OPT's
        ("gpt2-tiny", {"norm.placement": "post"}, "opt"),  # post-norm: GPT-2 has none
        ("llama-tiny", {"ffn.activation": "relu"}, "llama"),  # RoPE: not a learned table
    ],
)
def test_export_picks_opt_only_for_its_layout(preset, changes, model_type):
    """Learned-position decoders: post-norm or ReLU ones are OPT's, the other pre-norm ones
    GPT-2's, as before."""
    assert hf_model_type(get_preset(preset).override(changes)) == model_type


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"norm.eps": 1e-6}, "norm.eps=1e-06 (OPT's LayerNorms have torch's default eps"),
        ({"norm.kind": "rmsnorm"}, "learned positions need LayerNorm and an MLP"),
        ({"attention.n_kv_heads": 2, "norm.placement": "post"},
         "OPT needs n_kv_heads == n_heads"),
        # (in pre-norm blocks fewer key/value heads than query heads are GPT-BigCode's to
        # refuse: one, or one per query head)
        ({"attention.n_kv_heads": 2},
         "attention.n_kv_heads=2 (GPT-BigCode has one key/value head, multi_query, or one"),
        ({"attention.sliding_window": 8}, "attention.sliding_window (opt attends"),
        ({"final_logits_bias": True}, "final_logits_bias (opt's head has no bias"),
    ],
    ids=["eps", "rmsnorm", "gqa-post-norm", "gqa", "window", "head-bias"],
)  # fmt: skip
def test_export_refuses_what_opt_cannot_hold(changes, named, tmp_path):
    with pytest.raises(HFCheckpointError, match=re.escape(named)):
        save_hf(DecoderLM(_tiny(**changes)), tmp_path)
    assert not (tmp_path / "config.json").exists()


def test_post_norm_with_sinusoids_is_still_refused():
    with pytest.raises(HFCheckpointError, match="post-norm"):
        hf_model_type(get_preset("vaswani-tiny"))


# --------------------------------------------------------------------------- refusals


def _hf(**changes) -> dict:
    return {"model_type": "opt", "vocab_size": V, **CASES["pre-norm"], **changes}


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"word_embed_proj_dim": 16}, "word_embed_proj_dim=16 differs from hidden_size=32"),
        ({"layer_norm_elementwise_affine": False}, "layer_norm_elementwise_affine=false"),
        ({"_remove_final_layer_norm": True}, "_remove_final_layer_norm=true"),
        ({"num_attention_heads": 5}, "hidden_size=32 is not divisible by num_attention_heads=5"),
        ({"activation_function": "gelu_fast"}, "activation_function='gelu_fast'"),
    ],
    ids=["projections", "no-affine", "no-final-norm", "heads", "activation"],
)
def test_config_it_cannot_hold_is_refused_by_name(changes, named):
    with pytest.raises(HFCheckpointError, match=re.escape(named)):
        config_from_hf(_hf(**changes))


def test_post_norm_without_a_final_norm_flag_reads_as_post_norm():
    """_remove_final_layer_norm changes nothing in post-norm blocks (they have no final
    norm either way); word_embed_proj_dim equal to hidden_size is read."""
    cfg = _hf(do_layer_norm_before=False, _remove_final_layer_norm=True, word_embed_proj_dim=32)
    assert config_from_hf(cfg).norm.placement == "post"


def test_dropouts_read_as_one_with_a_warning_where_they_differ():
    """OPT drops each sublayer's output by ``dropout`` and never the embeddings, which
    attnlab's one dropout also drops: a warning where it is not 0; layerdrop is dropped
    with one."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert config_from_hf(_hf(dropout=0.0, attention_dropout=0.2)).attention.dropout == 0.2
    said = "dropout=0.1 drops each sublayer's output but not the embeddings"
    with pytest.warns(UserWarning, match=re.escape(said)):
        assert config_from_hf(_hf(dropout=0.1)).dropout == 0.1
    with pytest.warns(UserWarning, match=re.escape("layerdrop=0.2: attnlab has no LayerDrop")):
        assert config_from_hf(_hf(layerdrop=0.2)).n_layers == 2


# --------------------------------------------------------------------------- presets


@pytest.mark.parametrize("size", list(OPT_SIZES))
def test_published_presets_are_their_config_json(size):
    """facebook/opt-``size``'s config.json (recalled: the OPT paper's sizes, transformers'
    OPTConfig keys) reads as the preset, and transformers' model of it (on the meta
    device) counts the preset's parameters plus the position table's 2 offset rows."""
    d, n_layers, n_heads = OPT_SIZES[size]
    hf = dict(
        model_type="opt", architectures=["OPTForCausalLM"], vocab_size=50272, hidden_size=d,
        num_hidden_layers=n_layers, num_attention_heads=n_heads, ffn_dim=4 * d,
        word_embed_proj_dim=d, max_position_embeddings=2048, do_layer_norm_before=True,
        activation_function="relu", dropout=0.1, attention_dropout=0.0, enable_bias=True,
        layer_norm_elementwise_affine=True, tie_word_embeddings=True, pad_token_id=1,
        bos_token_id=2, eos_token_id=2,
    )  # fmt: skip
    preset = get_preset(f"opt-{size}")
    with pytest.warns(UserWarning, match="not the embeddings"):
        assert config_from_hf(hf) == preset
    config = transformers.AutoConfig.for_model(**hf)
    with torch.device("meta"):
        reference = transformers.AutoModelForCausalLM.from_config(config)
    assert count_parameters(preset)["total"] + 2 * d == reference.num_parameters()
