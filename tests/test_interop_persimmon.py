"""Persimmon checkpoints: transformers models from tiny random configs (Persimmon-8B's
block: QK LayerNorm, half of each head rotated, squared ReLU; one without QK-norm, with
linear scaling and a tied head; one with a GELU and transformers 4.x's RoPE keys) with every
weight set to random values, loaded with ``load_hf``, give the same logits (with and without left
padding), the same greedy tokens (one prompt and a ragged batch) and the same loss and
gradients; attnlab models saved with ``save_hf`` load in transformers with the same logits
and load back exactly; what Persimmon cannot hold is refused by name; export picks
Persimmon only for what no other layout holds.

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

from attnlab.interop import (
    HFCheckpointError,
    config_from_hf,
    config_to_hf,
    hf_model_type,
    load_hf,
    save_hf,
)
from attnlab.interop.gpt_neox import heads_together
from attnlab.models.decoder import DecoderLM
from attnlab.nn.feedforward import relu2
from attnlab.presets import get_preset

V = 97
TOL = 1e-5  # float32 logits up to ~10 through 2 layers (weights of std 0.3)
CASES = {
    # Persimmon-8B's block: QK LayerNorm with biases, half of each head rotated
    # (PersimmonConfig's default factor), squared ReLU, 4 heads of 16, an untied head
    "qk-layernorm-relu2": dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 100.0},
    ),
    # no QK-norm, a quarter of each head rotated with linear scaling x2, a tied head, GELU,
    # a LayerNorm eps large enough to matter
    "no-qk-norm-linear-tied": dict(
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=64,
        qk_layernorm=False,
        layer_norm_eps=0.05,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "linear",
            "factor": 2.0,
            "rope_theta": 300.0,
            "partial_rotary_factor": 0.25,
        },
    ),
    # transformers 4.x's RoPE keys, whole heads rotated, QK LayerNorm with a GELU
    "4x-keys-whole-heads-gelu": dict(
        hidden_act="gelu",
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=3,
        max_position_embeddings=64,
        partial_rotary_factor=1.0,
        rope_theta=50.0,
    ),
}


def _is_norm(name: str, p: torch.Tensor) -> bool:
    """LayerNorm weights (QK-norm's too) in [0.5, 1.5), every other parameter random."""
    return "norm" in name and name.endswith("weight")


HF = HFCases(
    "PersimmonConfig", "PersimmonForCausalLM", CASES, V, norms=(0.5, 1.5), is_norm=_is_norm
)
imported = HF.imported_fixture()


def test_relu2_is_transformers_squared_relu():
    from transformers.activations import ACT2FN

    x = torch.randn(4, 33, generator=torch.Generator().manual_seed(0)) * 3
    torch.testing.assert_close(relu2(x), ACT2FN["relu2"](x), atol=0, rtol=0)


def test_import_config_and_weights(imported):
    """The config as transformers reads it; the fused projection's rows head by head become
    attnlab's [q; k; v]; the QK LayerNorms (weight and bias) every head shares."""
    case, ref, model = imported
    cfg, hf = model.cfg, ref.config
    att, pos = cfg.attention, cfg.position
    assert model.num_parameters() == ref.num_parameters()
    assert config_from_hf(hf.to_dict()) == cfg  # the in-memory config, not only config.json
    assert hf_model_type(cfg) == "persimmon"
    params = hf.rope_parameters
    assert (pos.rope_layout, pos.rope_theta) == ("split", params["rope_theta"])
    assert pos.rope_fraction == params["partial_rotary_factor"]
    assert cfg.rope_dim == ref.model.layers[0].self_attn.rotary_ndims
    assert pos.rope_scaling == ("linear" if case == "no-qk-norm-linear-tied" else None)
    assert (cfg.norm.kind, cfg.norm.bias, cfg.norm.eps, cfg.norm.placement) == (
        "layernorm", True, hf.layer_norm_eps, "pre")  # fmt: skip
    assert (cfg.ffn.kind, cfg.ffn.activation, cfg.ffn.bias) == (
        "mlp", {"relu2": "relu2", "gelu": "gelu"}[hf.hidden_act], True)  # fmt: skip
    assert (att.qkv_bias, att.out_bias, cfg.n_kv_heads) == (True, True, cfg.n_heads)
    assert cfg.tie_embeddings == hf.tie_word_embeddings
    assert att.qk_norm == hf.qk_layernorm
    block, layer = model.blocks[1], ref.model.layers[1]
    attn = layer.self_attn
    qkv = heads_together(block.attn.qkv.weight.detach(), cfg.n_heads)
    assert torch.equal(qkv, attn.query_key_value.weight)
    if att.qk_norm:
        assert (att.qk_norm_kind, att.qk_norm_bias, att.qk_norm_weight) == (
            "layernorm", True, "shared")  # fmt: skip
        for ours, theirs in ((block.attn.q_norm, attn.q_layernorm),
                             (block.attn.k_norm, attn.k_layernorm)):  # fmt: skip
            assert torch.equal(ours.weight, theirs.weight) and torch.equal(ours.bias, theirs.bias)


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
    gradients of the fused projection (rows head by head), the QK LayerNorms, the norms,
    the MLP and the embedding are transformers'."""
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
        h = cfg.n_heads
        pairs = [
            (heads_together(block.attn.qkv.weight.grad, h), attn.query_key_value.weight.grad),
            (heads_together(block.attn.qkv.bias.grad, h), attn.query_key_value.bias.grad),
            (block.attn.out.bias.grad, attn.dense.bias.grad),
            (block.ffn.up.weight.grad, layer.mlp.dense_h_to_4h.weight.grad),
            (block.ffn.down.bias.grad, layer.mlp.dense_4h_to_h.bias.grad),
            (block.attn_norm.weight.grad, layer.input_layernorm.weight.grad),
            (block.ffn_norm.bias.grad, layer.post_attention_layernorm.bias.grad),
            (model.norm.weight.grad, ref.model.final_layernorm.weight.grad),
            (model.tok_emb.weight.grad, ref.model.embed_tokens.weight.grad),
        ]
        if cfg.attention.qk_norm:
            for ours_norm, theirs_norm in ((block.attn.q_norm, attn.q_layernorm),
                                           (block.attn.k_norm, attn.k_layernorm)):  # fmt: skip
                pairs.append((ours_norm.weight.grad, theirs_norm.weight.grad))
                pairs.append((ours_norm.bias.grad, theirs_norm.bias.grad))
        for got, want in pairs:
            assert want.abs().max() > 0  # (a gradient that flows)
            # float32 sums over the batch in different orders: 1e-4
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    finally:
        ref.eval().zero_grad()
        model.eval().zero_grad()


# --------------------------------------------------------------------------- export


def _tiny(**changes):
    return get_preset("persimmon-tiny").override({"vocab_size": V, **changes})


EXPORTS = {
    "persimmon-tiny": _tiny(),
    # no QK-norm, interleaved pairs in the rotated quarter (q/k rows permuted to
    # rotate-half there only), linear scaling, a tied head, biases missing (written as zeros)
    "interleaved-linear-tied-no-biases": _tiny(
        **{
            "attention.qk_norm": False,
            "attention.qk_norm_kind": "rmsnorm",
            "attention.qk_norm_bias": False,
            "attention.qkv_bias": False,
            "norm.bias": False,
            "norm.eps": 0.05,
            "position.rope_layout": "interleaved",
            "position.rope_fraction": 0.25,
            "position.rope_scaling": "linear",
            "position.rope_factor": 2.0,
            "tie_embeddings": True,
        },
    ),
    # the QK-norm with interleaved pairs (its features permuted as the q/k rows are) and GELU
    "qk-norm-interleaved-gelu": _tiny(
        **{"position.rope_layout": "interleaved", "ffn.activation": "gelu"}
    ),
}


@pytest.mark.parametrize("name", list(EXPORTS))
def test_export_round_trip(name, tmp_path):
    cfg = EXPORTS[name]
    torch.manual_seed(20)
    model = DecoderLM(cfg).eval()
    HF.randomize(model, seed=len(name))
    assert hf_model_type(cfg) == "persimmon"
    save_hf(model, tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    assert ("lm_head.weight" in stored) == (not cfg.tie_embeddings)

    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert type(ref).__name__ == "PersimmonForCausalLM"
    assert ref.model.layers[0].self_attn.rotary_ndims == cfg.rope_dim
    assert ref.config.qk_layernorm == cfg.attention.qk_norm
    assert_logits_match_hf(ref.eval(), model, V, TOL)
    assert_left_padded_logits_match_hf(ref, model, V, TOL)

    back = load_hf(tmp_path)  # import(export(x)): the same model, the same numbers
    written = {"position.rope_layout": "split", "attention.qkv_bias": True, "norm.bias": True}
    if cfg.attention.qk_norm:
        written["attention.qk_norm_bias"] = True
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
    """config.json -> attnlab -> config.json keeps every key transformers' Persimmon reads,
    and attnlab -> config.json -> attnlab is the same config."""
    hf = HF.config(case).to_dict()
    cfg = config_from_hf(hf)
    written = config_to_hf(cfg)
    assert (written["model_type"], written["architectures"]) == (
        "persimmon", ["PersimmonForCausalLM"])  # fmt: skip
    for key in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "hidden_act", "max_position_embeddings", "layer_norm_eps",
        "qk_layernorm", "hidden_dropout", "attention_dropout", "tie_word_embeddings",
        "initializer_range",
    ):  # fmt: skip
        assert written[key] == hf[key], key
    rope = hf["rope_parameters"]
    assert {k: written["rope_parameters"][k] for k in rope} == rope
    assert config_from_hf(written) == cfg


def test_rope_fraction_defaults_as_transformers_reads_it():
    """Without partial_rotary_factor anywhere, PersimmonConfig's 0.5; the RoPE parameters'
    own factor wins over the top-level key."""
    base = {"model_type": "persimmon", "vocab_size": V, **CASES["qk-layernorm-relu2"]}
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


def test_hidden_dropout_is_read_with_a_warning():
    hf = {"model_type": "persimmon", "vocab_size": V, **CASES["qk-layernorm-relu2"]}
    with pytest.warns(UserWarning, match=re.escape("hidden_dropout=0.1 drops Persimmon's MLP")):
        cfg = config_from_hf({**hf, "hidden_dropout": 0.1})
    assert cfg.dropout == 0.1


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"head_dim": 8},
         "config.json head_dim=8: Persimmon's attention has heads of hidden_size / "
         "num_attention_heads = 16"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
         "RoPE scaling 'dynamic' is not supported"),
        ({"hidden_act": "gelu_fast"}, "hidden_act='gelu_fast' is not supported"),
        ({"layer_norm_eps": None}, "config.json layer_norm_eps must be a number"),
        ({"architectures": ["PersimmonForSequenceClassification"]},
         "architecture 'PersimmonForSequenceClassification' is not supported"),
    ],
    ids=["head-dim", "dynamic-rope", "activation", "null-eps", "head"],
)  # fmt: skip
def test_config_it_cannot_hold_is_refused_by_name(changes, named):
    hf = {**HF.config("qk-layernorm-relu2").to_dict(), **changes}
    with pytest.raises(HFCheckpointError, match=re.escape(named)):
        config_from_hf(hf)


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"attention.head_dim": 8},
         "attention.head_dim=8 (Persimmon's heads are d_model / n_heads = 16 wide); pre-norm "
         "RoPE decoders with LayerNorm and a squared-ReLU MLP export as persimmon"),
        ({"position.rope_scaling": "yarn"},
         "position.rope_scaling='yarn' (Persimmon's: none or linear)"),
        ({"attention.qk_norm_weight": "per_head", "attention.qk_norm_bias": False},
         "attention.qk_norm_weight='per_head' (persimmon's QK-norm has 'shared'; this "
         "QK-norm exports as cohere or stablelm)"),
        ({"attention.qk_norm_kind": "rmsnorm", "attention.qk_norm_bias": False},
         "attention.qk_norm_kind='rmsnorm' (persimmon's QK-norm has 'layernorm'; this "
         "QK-norm exports as qwen3 or qwen3_moe or gemma3_text)"),
        ({"attention.sliding_window": 8}, "attention.sliding_window (persimmon attends to"),
        ({"final_logits_bias": True}, "final_logits_bias (persimmon's head has no bias"),
    ],
    ids=["head-dim", "yarn", "per-head-qk-norm", "rms-qk-norm", "window", "head-bias"],
)  # fmt: skip
def test_export_refuses_what_persimmon_cannot_hold(changes, named, tmp_path):
    with pytest.raises(HFCheckpointError, match=re.escape(named)):
        save_hf(DecoderLM(_tiny(**changes)), tmp_path)
    assert not (tmp_path / "config.json").exists()


# --------------------------------------------------------------------------- presets


def test_published_preset_exports_as_persimmon():
    """Persimmon-8B is Persimmon's layout (tests/test_analysis.py checks its count against
    transformers' model of its config.json, built on the meta device)."""
    cfg = get_preset("persimmon-8b")
    assert hf_model_type(cfg) == "persimmon"
    hf = config_to_hf(cfg)
    assert (hf["qk_layernorm"], hf["hidden_act"], hf["partial_rotary_factor"]) == (
        True, "relu2", 0.5)  # fmt: skip
