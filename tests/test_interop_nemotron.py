"""Nemotron checkpoints: transformers models from tiny random configs (Minitron's block:
GQA, heads of their own width, half of each head rotated, squared ReLU; one with attention
and MLP biases, linear scaling, a tied head, a GELU and transformers 4.x's RoPE keys) with
every weight set to random values, loaded with ``load_hf``, give the same logits (with and
without left padding), the same greedy tokens (one prompt and a ragged batch) and the same
loss and gradients; attnlab models saved with ``save_hf`` load in transformers with the same
logits and load back exactly; the unit-offset LayerNorm is transformers' in float32 and
bfloat16; what Nemotron cannot hold is refused by name.

Shapes: b batch, t length, V vocabulary, d model width.
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

from attnlab.interop import (
    HFCheckpointError,
    config_from_hf,
    config_to_hf,
    hf_model_type,
    load_hf,
    save_hf,
)
from attnlab.models.decoder import DecoderLM
from attnlab.nn.norm import LayerNorm1P
from attnlab.presets import get_preset

V = 97
# float32 logits up to ~11 through 2 layers (weights of std 0.3); the biased, tied case rounds
# to 1.3e-5 (a relative 1.2e-6: summation order), the others within 1e-5
TOL = 2e-5
CASES = {
    # Minitron's block: GQA 4/2 heads of 24 (not hidden_size / heads), half of each head
    # rotated (NemotronConfig's default factor), squared ReLU, no biases, an untied head
    "gqa-head-dim-relu2": dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 100.0},
    ),
    # attention and MLP biases, MHA 2 heads of 32, a quarter rotated with linear scaling x2,
    # a tied head, GELU, transformers 4.x's RoPE keys, a norm eps large enough to matter
    "biases-linear-tied-4x-keys": dict(
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,  # (NemotronConfig leaves it null, which its attention cannot run)
        max_position_embeddings=64,
        attention_bias=True,
        mlp_bias=True,
        norm_eps=0.05,
        tie_word_embeddings=True,
        hidden_act="gelu",
        partial_rotary_factor=0.25,
        rope_theta=300.0,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    ),
}


def _is_norm(name: str, p: torch.Tensor) -> bool:
    """The LayerNorms' stored offsets in [-0.5, 0.5) (weights 1 + w in [0.5, 1.5)), every
    other parameter (their biases too) random."""
    return "norm" in name and name.endswith("weight")


HF = HFCases("NemotronConfig", "NemotronForCausalLM", CASES, V, norms=(-0.5, 0.5), is_norm=_is_norm)
imported = HF.imported_fixture()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layernorm1p_is_transformers(dtype):
    """(x - mean) / std * (1 + w) + b as NemotronLayerNorm1P computes it: exactly, in x's
    dtype, float32 and bfloat16 alike."""
    from transformers.models.nemotron.modeling_nemotron import NemotronLayerNorm1P

    g = torch.Generator().manual_seed(0)
    ours, theirs = LayerNorm1P(24, eps=0.01), NemotronLayerNorm1P(24, eps=0.01)
    with torch.no_grad():
        ours.weight.copy_(torch.rand(24, generator=g) - 0.5)
        ours.bias.copy_(torch.randn(24, generator=g))
        theirs.load_state_dict(ours.state_dict())
    ours.to(dtype)
    theirs.to(dtype)
    x = (torch.randn(2, 5, 24, generator=g) * 3 + 1).to(dtype)  # a mean away from 0
    with torch.no_grad():
        got, want = ours(x), theirs(x)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_import_config_and_weights(imported):
    """The config as transformers reads it; the norms' stored offsets read as they are."""
    case, ref, model = imported
    cfg, hf = model.cfg, ref.config
    att, pos = cfg.attention, cfg.position
    assert model.num_parameters() == ref.num_parameters()
    assert config_from_hf(hf.to_dict()) == cfg  # the in-memory config, not only config.json
    assert hf_model_type(cfg) == "nemotron"
    params = hf.rope_parameters
    assert (pos.rope_layout, pos.rope_theta) == ("split", params["rope_theta"])
    assert pos.rope_fraction == params["partial_rotary_factor"]
    assert pos.rope_scaling == ("linear" if case == "biases-linear-tied-4x-keys" else None)
    assert (cfg.norm.kind, cfg.norm.bias, cfg.norm.eps, cfg.norm.placement) == (
        "layernorm1p", True, hf.norm_eps, "pre")  # fmt: skip
    assert (cfg.ffn.kind, cfg.ffn.bias) == ("mlp", hf.mlp_bias)
    assert cfg.ffn.activation == {"relu2": "relu2", "gelu": "gelu"}[hf.hidden_act]
    assert (att.qkv_bias, att.out_bias) == (hf.attention_bias, hf.attention_bias)
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (
        hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim)  # fmt: skip
    assert cfg.tie_embeddings == hf.tie_word_embeddings
    block, layer = model.blocks[1], ref.model.layers[1]
    assert isinstance(block.ffn_norm, LayerNorm1P)
    assert torch.equal(block.ffn_norm.weight, layer.post_attention_layernorm.weight)
    assert torch.equal(model.norm.bias, ref.model.norm.bias)


def test_import_logits(imported):
    case, ref, model = imported
    assert_logits_match_hf(ref, model, V, TOL)
    assert_left_padded_logits_match_hf(ref, model, V, TOL)


def test_import_greedy_generation(imported):
    """Cached decoding against transformers' cache, one prompt and a left-padded batch."""
    case, ref, model = imported
    assert_greedy_tokens_match_hf(ref, model, V, n=10)


def test_training_loss_and_gradients_match_transformers(imported):
    """A loss backward in training mode over a left-padded batch: the loss and the
    gradients of the stacked q/k/v projection, the norms' offsets and biases, the MLP and
    the embedding are transformers'."""
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
        cfg = model.cfg
        block, layer = model.blocks[1], ref.model.layers[1]
        attn = layer.self_attn
        qkv = ("q_proj", "k_proj", "v_proj")
        pairs = [
            (block.attn.qkv.weight.grad, torch.cat([getattr(attn, n).weight.grad for n in qkv])),
            (block.attn.out.weight.grad, attn.o_proj.weight.grad),
            (block.ffn.up.weight.grad, layer.mlp.up_proj.weight.grad),
            (block.ffn.down.weight.grad, layer.mlp.down_proj.weight.grad),
            (block.attn_norm.weight.grad, layer.input_layernorm.weight.grad),
            (block.ffn_norm.bias.grad, layer.post_attention_layernorm.bias.grad),
            (model.norm.weight.grad, ref.model.norm.weight.grad),
            (model.tok_emb.weight.grad, ref.model.embed_tokens.weight.grad),
        ]
        if cfg.attention.qkv_bias:
            grads = torch.cat([getattr(attn, n).bias.grad for n in qkv])
            pairs.append((block.attn.qkv.bias.grad, grads))
            pairs.append((block.ffn.up.bias.grad, layer.mlp.up_proj.bias.grad))
        for got, want in pairs:
            assert want.abs().max() > 0  # (a gradient that flows)
            # float32 sums over the batch in different orders: 1e-4
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    finally:
        ref.eval().zero_grad()
        model.eval().zero_grad()


# --------------------------------------------------------------------------- export


def _tiny(**changes):
    return get_preset("nemotron-tiny").override({"vocab_size": V, **changes})


EXPORTS = {
    "nemotron-tiny": _tiny(),
    # q/k/v biases only (the o_proj bias written as zeros), norms without biases (zeros),
    # interleaved pairs in the rotated quarter (q/k rows permuted to rotate-half there
    # only), linear scaling, a tied head, MLP biases, heads of their own width
    "interleaved-linear-tied-biases": _tiny(
        **{
            "attention.qkv_bias": True,
            "attention.head_dim": 8,
            "ffn.bias": True,
            "norm.bias": False,
            "norm.eps": 0.05,
            "position.rope_layout": "interleaved",
            "position.rope_fraction": 0.25,
            "position.rope_scaling": "linear",
            "position.rope_factor": 2.0,
            "tie_embeddings": True,
        },
    ),
}


@pytest.mark.parametrize("name", list(EXPORTS))
def test_export_round_trip(name, tmp_path):
    cfg = EXPORTS[name]
    torch.manual_seed(20)
    model = DecoderLM(cfg).eval()
    HF.randomize(model, seed=len(name))
    assert hf_model_type(cfg) == "nemotron"
    save_hf(model, tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    assert ("lm_head.weight" in stored) == (not cfg.tie_embeddings)

    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert type(ref).__name__ == "NemotronForCausalLM"
    assert ref.config.head_dim == cfg.head_dim
    assert_logits_match_hf(ref.eval(), model, V, TOL)
    assert_left_padded_logits_match_hf(ref, model, V, TOL)

    back = load_hf(tmp_path)  # import(export(x)): the same model, the same numbers
    written = {"position.rope_layout": "split", "norm.bias": True}
    if cfg.attention.qkv_bias:
        written["attention.out_bias"] = True
    assert back.cfg == cfg.override(written)
    idx, mask = left_padded_batch(V)
    with torch.no_grad():
        again = back(idx, attention_mask=mask).logits
        ours = model(idx, attention_mask=mask).logits
    if back.cfg == cfg:
        mine = model.state_dict()
        assert back.state_dict().keys() == mine.keys()
        assert all(torch.equal(v, mine[k]) for k, v in back.state_dict().items())
        assert torch.equal(again, ours)
    else:  # the rotated pairs permuted (q . k in another order), zero biases added
        assert (again - ours)[mask.bool()].abs().max() <= TOL
    save_hf(back, tmp_path / "again")  # export(import(export(x))) writes the same tensors
    twice = load_file(tmp_path / "again" / "model.safetensors")
    assert twice.keys() == stored.keys()
    assert all(torch.equal(twice[k], stored[k]) for k in stored)


@pytest.mark.parametrize("case", list(CASES))
def test_config_round_trips(case):
    """config.json -> attnlab -> config.json keeps every key transformers' Nemotron reads,
    and attnlab -> config.json -> attnlab is the same config."""
    hf = HF.config(case).to_dict()
    cfg = config_from_hf(hf)
    written = config_to_hf(cfg)
    assert (written["model_type"], written["architectures"]) == (
        "nemotron", ["NemotronForCausalLM"])  # fmt: skip
    for key in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
        "max_position_embeddings", "norm_eps", "attention_bias", "mlp_bias",
        "attention_dropout", "tie_word_embeddings", "initializer_range",
    ):  # fmt: skip
        assert written[key] == hf[key], key
    rope = hf["rope_parameters"]
    assert {k: written["rope_parameters"][k] for k in rope} == rope
    assert config_from_hf(written) == cfg


def test_rope_fraction_defaults_as_transformers_reads_it():
    """Without partial_rotary_factor anywhere, NemotronConfig's 0.5; the RoPE parameters'
    own factor wins over the top-level key."""
    base = {"model_type": "nemotron", "vocab_size": V, **CASES["gqa-head-dim-relu2"]}
    del base["rope_parameters"]
    for extra in ({}, {"partial_rotary_factor": 0.25},
                  {"rope_parameters": {"rope_type": "default", "rope_theta": 10.0,
                                       "partial_rotary_factor": 1.0},
                   "partial_rotary_factor": 0.25}):  # fmt: skip
        hf = {**base, **extra}
        theirs = transformers.AutoConfig.for_model(**hf).rope_parameters
        ours = config_from_hf(hf).position
        assert (ours.rope_theta, ours.rope_fraction) == (
            theirs["rope_theta"], theirs["partial_rotary_factor"]), extra  # fmt: skip


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
         "RoPE scaling 'dynamic' is not supported"),
        ({"hidden_act": "gelu_fast"}, "hidden_act='gelu_fast' is not supported"),
        ({"norm_eps": None}, "config.json norm_eps must be a number"),
        ({"architectures": ["NemotronForQuestionAnswering"]},
         "architecture 'NemotronForQuestionAnswering' is not supported"),
    ],
    ids=["dynamic-rope", "activation", "null-eps", "head"],
)  # fmt: skip
def test_config_it_cannot_hold_is_refused_by_name(changes, named):
    hf = {**HF.config("gqa-head-dim-relu2").to_dict(), **changes}
    with pytest.raises(HFCheckpointError, match=re.escape(named)):
        config_from_hf(hf)


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"ffn.kind": "glu"},
         "ffn.kind='glu' (Nemotron's is 'mlp'); norm.kind='layernorm1p' exports as nemotron "
         "only"),
        ({"norm.placement": "parallel_shared"},
         "norm.placement='parallel_shared' (Nemotron's is 'pre')"),
        ({"position.kind": "learned", "position.rope_fraction": 1.0},
         "position.kind='learned' (Nemotron's is 'rope')"),
        ({"position.rope_scaling": "yarn"},
         "position.rope_scaling='yarn' (Nemotron's: none or linear)"),
        ({"attention.qk_norm": True}, "attention.qk_norm (nemotron has no QK-norm"),
        ({"attention.sliding_window": 8}, "attention.sliding_window (nemotron attends to"),
        ({"final_logits_bias": True}, "final_logits_bias (nemotron's head has no bias"),
    ],
    ids=["glu", "parallel", "learned", "yarn", "qk-norm", "window", "head-bias"],
)  # fmt: skip
def test_export_refuses_what_nemotron_cannot_hold(changes, named, tmp_path):
    with pytest.raises(HFCheckpointError, match=re.escape(named)):
        save_hf(DecoderLM(_tiny(**changes)), tmp_path)
    assert not (tmp_path / "config.json").exists()


def test_unit_offset_layernorm_exports_as_nemotron_only():
    """An encoder with the unit-offset LayerNorm has no family to hold it: refused by name,
    not written as a plain LayerNorm."""
    cfg = get_preset("bert-tiny-mlm").override({"norm.kind": "layernorm1p"})
    with pytest.raises(
        HFCheckpointError,
        match=re.escape(
            "norm.kind='layernorm1p' (no encoder family has a unit-offset LayerNorm; it exports "
            "as nemotron"
        ),
    ):
        hf_model_type(cfg)


# --------------------------------------------------------------------------- presets


@pytest.mark.parametrize("name", ["minitron-4b", "minitron-8b"])
def test_published_presets_export_as_nemotron(name):
    """Each published size is Nemotron's layout (tests/test_analysis.py checks each count
    against transformers' model of its config.json, built on the meta device)."""
    cfg = get_preset(name)
    assert hf_model_type(cfg) == "nemotron"
    hf = config_to_hf(cfg)
    assert (hf["hidden_act"], hf["partial_rotary_factor"], hf["head_dim"]) == ("relu2", 0.5, 128)
