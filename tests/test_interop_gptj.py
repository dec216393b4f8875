"""GPT-J checkpoints: transformers models from tiny random configs (GPT-J's block with half
of each head rotated in adjacent pairs; a tied head, whole heads rotated, the exact GELU and
the default MLP width) with every weight set to random values, loaded with ``load_hf``,
give the same logits (with left padding), loss and gradients, and the same greedy tokens;
attnlab models in GPT-J's layout saved with ``save_hf`` load in transformers with the same
logits and load back exactly, the others of its block export as phi; what neither side can
hold is refused by name.

Shapes: b batch, t length, V vocabulary, h heads, d_h head dim.
"""

from __future__ import annotations

import re

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

from attnlab.interop import HFCheckpointError, config_from_hf, hf_model_type, load_hf, save_hf
from attnlab.models.decoder import DecoderLM
from attnlab.presets import get_preset

V = 97
TOL = 1e-5  # float32 logits up to ~15 (weights of std 0.3)
CASES = {
    # GPT-J's block: 3 heads of 16, the first 8 features of each rotated in adjacent pairs
    "gptj-like": dict(n_embd=48, n_inner=80, n_layer=2, n_head=3, n_positions=64, rotary_dim=8),
    # a tied head (its bias its own), whole heads rotated, the exact GELU, n_inner null (4 d)
    "tied-full-rotation": dict(
        n_embd=32,
        n_layer=2,
        n_head=2,
        n_positions=64,
        rotary_dim=16,
        tie_word_embeddings=True,
        activation_function="gelu",
    ),
}


def _is_norm_weight(name: str, p: torch.Tensor) -> bool:
    return ("norm" in name or ".ln_" in name) and name.endswith("weight")


# LayerNorm weights in [0.5, 1.5), every other parameter (biases too) random.
HF = HFCases("GPTJConfig", "GPTJForCausalLM", CASES, V, norms=(0.5, 1.5), is_norm=_is_norm_weight)
imported = HF.imported_fixture()


def test_import_config_and_weights(imported):
    """The config as transformers reads it: interleaved pairs on rotary_dim features, no
    attention biases, one shared norm per block, the head's bias its own."""
    case, ref, model = imported
    cfg, hf = model.cfg, ref.config
    assert model.num_parameters() == ref.num_parameters()
    assert config_from_hf(hf.to_dict()) == cfg  # the in-memory config, not only config.json
    assert (cfg.rope_dim, cfg.position.rope_layout) == (hf.rotary_dim, "interleaved")
    assert cfg.position.rope_theta == 10000.0 and cfg.position.rope_scaling is None
    assert not (cfg.attention.qkv_bias or cfg.attention.out_bias)
    assert cfg.norm.placement == "parallel_shared" and cfg.final_logits_bias
    assert cfg.ffn.hidden_size(cfg.d_model) == ref.transformer.h[0].mlp.fc_in.out_features
    assert cfg.tie_embeddings == hf.tie_word_embeddings
    block, layer = model.blocks[1], ref.transformer.h[1]
    attn = layer.attn
    stacked = torch.cat([getattr(attn, n).weight for n in ("q_proj", "k_proj", "v_proj")])
    assert torch.equal(block.attn.qkv.weight, stacked)
    assert torch.equal(block.norm.bias, layer.ln_1.bias)
    assert torch.equal(model.lm_head.bias, ref.lm_head.bias)
    assert (model.lm_head.weight is model.tok_emb.weight) == cfg.tie_embeddings


def test_import_logits(imported):
    case, ref, model = imported
    assert_logits_match_hf(ref, model, V, TOL)
    assert_left_padded_logits_match_hf(ref, model, V, TOL)


def test_import_greedy_generation(imported):
    case, ref, model = imported
    assert_greedy_tokens_match_hf(ref, model, V, n=10)


def test_training_loss_and_gradients_match_transformers(imported):
    """A loss backward in training mode over a left-padded batch: the loss and the
    gradients of q/k/v, the shared norm, the MLP, the head's bias and the embedding."""
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
        block, layer = model.blocks[1], ref.transformer.h[1]
        attn = layer.attn
        qkv_grad = torch.cat([getattr(attn, n).weight.grad for n in ("q_proj", "k_proj", "v_proj")])
        pairs = [
            (block.attn.qkv.weight.grad, qkv_grad),
            (block.attn.out.weight.grad, attn.out_proj.weight.grad),
            (block.norm.weight.grad, layer.ln_1.weight.grad),
            (block.ffn.up.bias.grad, layer.mlp.fc_in.bias.grad),
            (block.ffn.down.weight.grad, layer.mlp.fc_out.weight.grad),
            (model.norm.bias.grad, ref.transformer.ln_f.bias.grad),
            (model.lm_head.bias.grad, ref.lm_head.bias.grad),
            (model.tok_emb.weight.grad, ref.transformer.wte.weight.grad),
        ]
        for got, want in pairs:
            # float32 sums over the batch in different orders: 1e-4
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    finally:
        ref.eval().zero_grad()
        model.eval().zero_grad()


# --------------------------------------------------------------------------- export


def _tiny(**changes):
    return get_preset("gptj-tiny").override({"vocab_size": V, **changes})


EXPORTS = {
    "gptj-tiny": _tiny(),
    # a tied head with its bias, whole heads rotated, the exact GELU, an MLP of 3 d
    "tied-full-rotation": _tiny(
        **{
            "tie_embeddings": True,
            "position.rope_fraction": 1.0,
            "ffn.activation": "gelu",
            "ffn.hidden_dim": 192,
        }
    ),
}


@pytest.mark.parametrize("name", list(EXPORTS))
def test_export_round_trip(name, tmp_path):
    cfg = EXPORTS[name]
    torch.manual_seed(20)
    model = DecoderLM(cfg).eval()
    HF.randomize(model, seed=len(name))
    assert hf_model_type(cfg) == "gptj"
    save_hf(model, tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    assert ("lm_head.weight" in stored) == (not cfg.tie_embeddings)
    assert "transformer.h.0.attn.q_proj.bias" not in stored

    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert type(ref).__name__ == "GPTJForCausalLM"
    assert ref.config.rotary_dim == cfg.rope_dim
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


def test_missing_biases_are_written_as_zeros_and_read_back_as_such(tmp_path):
    """GPT-J's MLP, LayerNorms and head always have biases: a model without them exports
    zeros (the same logits) and imports with them."""
    cfg = _tiny(**{"ffn.bias": False, "norm.bias": False, "final_logits_bias": False})
    torch.manual_seed(3)
    model = DecoderLM(cfg).eval()
    assert hf_model_type(cfg) == "gptj"
    save_hf(model, tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    for name in ("lm_head.bias", "transformer.h.1.mlp.fc_out.bias", "transformer.ln_f.bias"):
        assert not stored[name].any()
    back = load_hf(tmp_path)
    assert back.cfg.final_logits_bias and back.cfg.ffn.bias and back.cfg.norm.bias
    idx = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(back(idx).logits, model(idx).logits, atol=0, rtol=0)


@pytest.mark.parametrize(
    "changes, model_type",
    [
        ({}, "gptj"),
        ({"position.rope_layout": "split"}, "phi"),  # rotate-half pairs: Phi's
        ({"attention.qkv_bias": True}, "phi"),  # attention biases: Phi's
        ({"attention.n_kv_heads": 2}, "phi"),  # GQA: Phi's
        ({"position.rope_theta": 500.0}, "phi"),  # another base: Phi's
        ({"position.rope_scaling": "linear", "position.rope_factor": 2.0}, "phi"),
        ({"norm.placement": "parallel", "final_logits_bias": False}, "gpt_neox"),
    ],
)
def test_export_picks_gptj_only_for_its_own_layout(changes, model_type):
    """A parallel_shared decoder in GPT-J's own layout is gptj (imported back as it was);
    one it cannot hold is Phi's, which holds it all."""
    assert hf_model_type(_tiny(**changes)) == model_type


# --------------------------------------------------------------------------- presets


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"rotary_dim": 24}, "rotary_dim=24: GPT-J rotates the first rotary_dim features"),
        ({"rotary_dim": None}, "rotary_dim=None: GPT-J rotates"),
        ({"rotary_dim": 5}, "RoPE rotates pairs: must be even"),
        ({"n_head": 5}, "n_embd=48 is not divisible by n_head=5"),
        ({"activation_function": "gelu_fast"}, "activation_function='gelu_fast'"),
    ],
    ids=["too-wide", "null", "odd", "heads", "activation"],
)
def test_config_it_cannot_hold_is_refused_by_name(changes, named):
    hf = {"model_type": "gptj", "vocab_size": V, **CASES["gptj-like"], **changes}
    with pytest.raises(HFCheckpointError, match=re.escape(named)):
        config_from_hf(hf)


def test_dropouts_read_as_one_with_a_warning_where_they_differ():
    hf = {"model_type": "gptj", "vocab_size": V, **CASES["gptj-like"]}
    assert config_from_hf({**hf, "resid_pdrop": 0.1, "embd_pdrop": 0.1}).dropout == 0.1
    with pytest.warns(UserWarning, match=re.escape("embd_pdrop=0.2 differs from resid_pdrop=0.1")):
        assert config_from_hf({**hf, "resid_pdrop": 0.1, "embd_pdrop": 0.2}).dropout == 0.1
