"""StableLM checkpoints: transformers models from tiny random configs (StableLM 2's
pre-norm blocks with q/k/v biases, GQA and a quarter of each head rotated; StableLM 2
12B's parallel blocks with a LayerNorm per query and key head, linear scaling, a tied
head and a large LayerNorm eps; pre-norm blocks with the per-head LayerNorms, MHA and
transformers 4.x's RoPE keys) with every weight set to random values, loaded with
``load_hf``, give the same logits (with and without left padding), the same greedy tokens
(one prompt and a ragged batch) and the same loss and gradients; attnlab models saved with
``save_hf`` load in transformers with the same logits and load back exactly; QK-norm's
LayerNorms are transformers' (StableLM's per head, Cohere's, Phi's); configs neither side
can hold are refused by name; export picks StableLM only for what no other layout holds.

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
from attnlab.models.decoder import DecoderLM
from attnlab.nn.norm import HeadNorm
from attnlab.presets import get_preset

V = 97
TOL = 1e-5  # float32 logits up to ~10 through 2 layers (weights of std 0.3)
CASES = {
    # StableLM 2 1.6B's block: pre-norm, q/k/v biases, GQA 4/2 heads of 16, a quarter of
    # each head rotated (StableLmConfig's default factor), an untied head
    "pre-gqa-qkv-bias": dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_qkv_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 100.0},
    ),
    # StableLM 2 12B's block: parallel residual on one norm, a LayerNorm per query and key
    # head (qk_layernorm), GQA 4/2, half of each head rotated with linear scaling x2, a tied
    # head, GELU gating, a LayerNorm eps large enough to matter
    "parallel-qk-layernorm": dict(
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_parallel_residual=True,
        qk_layernorm=True,
        layer_norm_eps=0.05,
        tie_word_embeddings=True,
        hidden_act="gelu",
        rope_parameters={
            "rope_type": "linear",
            "factor": 2.0,
            "rope_theta": 300.0,
            "partial_rotary_factor": 0.5,
        },
    ),
    # pre-norm blocks with the per-head LayerNorms, MHA with 2 heads of 32, transformers
    # 4.x's RoPE keys (whole heads rotated), q/k/v biases
    "pre-qk-layernorm-4x-keys": dict(
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,  # (StableLmConfig's default is 32, whatever the heads)
        max_position_embeddings=64,
        qk_layernorm=True,
        use_qkv_bias=True,
        partial_rotary_factor=1.0,
        rope_theta=50.0,
    ),
}


def _is_norm(name: str, p: torch.Tensor) -> bool:
    """LayerNorm weights (QK-norm's too) in [0.5, 1.5), every other parameter random."""
    return "norm" in name and name.endswith("weight")


HF = HFCases("StableLmConfig", "StableLmForCausalLM", CASES, V, norms=(0.5, 1.5), is_norm=_is_norm)
imported = HF.imported_fixture()


def test_import_config_and_weights(imported):
    """The config as transformers reads it; pre-norm or one shared norm per block; each
    head's QK LayerNorm one row of attnlab's (h, d_h) weight."""
    case, ref, model = imported
    cfg, hf = model.cfg, ref.config
    att, pos = cfg.attention, cfg.position
    assert model.num_parameters() == ref.num_parameters()
    assert config_from_hf(hf.to_dict()) == cfg  # the in-memory config, not only config.json
    assert hf_model_type(cfg) == "stablelm"
    params = hf.rope_parameters
    assert (pos.rope_layout, pos.rope_theta) == ("split", params["rope_theta"])
    assert pos.rope_fraction == params["partial_rotary_factor"]
    assert cfg.rope_dim == ref.model.layers[0].self_attn.rotary_ndims
    assert pos.rope_scaling == ("linear" if case == "parallel-qk-layernorm" else None)
    placement = "parallel_shared" if hf.use_parallel_residual else "pre"
    assert (cfg.norm.kind, cfg.norm.bias, cfg.norm.eps, cfg.norm.placement) == (
        "layernorm", True, hf.layer_norm_eps, placement)  # fmt: skip
    assert (cfg.ffn.kind, cfg.ffn.activation, cfg.ffn.bias) == ("glu", hf.hidden_act, False)
    assert (att.qkv_bias, att.out_bias) == (hf.use_qkv_bias, False)
    assert (cfg.n_heads, cfg.n_kv_heads) == (hf.num_attention_heads, hf.num_key_value_heads)
    assert cfg.tie_embeddings == hf.tie_word_embeddings
    assert att.qk_norm == hf.qk_layernorm
    block, layer = model.blocks[1], ref.model.layers[1]
    if hf.use_parallel_residual:
        assert block.attn_norm is None and torch.equal(block.norm.bias, layer.input_layernorm.bias)
    else:
        assert torch.equal(block.ffn_norm.bias, layer.post_attention_layernorm.bias)
    if att.qk_norm:
        assert (att.qk_norm_kind, att.qk_norm_bias, att.qk_norm_weight) == (
            "layernorm", False, "per_head")  # fmt: skip
        for ours, theirs in ((block.attn.q_norm, layer.self_attn.q_layernorm),
                             (block.attn.k_norm, layer.self_attn.k_layernorm)):  # fmt: skip
            assert ours.bias is None and ours.weight.shape == (theirs.num_heads, cfg.head_dim)
            assert torch.equal(ours.weight, torch.stack([n.weight for n in theirs.norms]))


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
    gradients of the stacked q/k/v projection and its biases, the norms, each head's QK
    LayerNorm weight, the MLP and the embedding are transformers'."""
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
            (block.ffn.down.weight.grad, layer.mlp.down_proj.weight.grad),
            (model.norm.weight.grad, ref.model.norm.weight.grad),
            (model.norm.bias.grad, ref.model.norm.bias.grad),
            (model.tok_emb.weight.grad, ref.model.embed_tokens.weight.grad),
        ]
        if cfg.attention.qkv_bias:
            grads = torch.cat([getattr(attn, n).bias.grad for n in qkv])
            pairs.append((block.attn.qkv.bias.grad, grads))
        if cfg.norm.placement == "parallel_shared":
            pairs.append((block.norm.weight.grad, layer.input_layernorm.weight.grad))
        else:
            pairs.append((block.ffn_norm.bias.grad, layer.post_attention_layernorm.bias.grad))
        if cfg.attention.qk_norm:
            for ours_norm, theirs_norm in ((block.attn.q_norm, attn.q_layernorm),
                                           (block.attn.k_norm, attn.k_layernorm)):  # fmt: skip
                grads = torch.stack([n.weight.grad for n in theirs_norm.norms])
                pairs.append((ours_norm.weight.grad, grads))
        for got, want in pairs:
            assert want.abs().max() > 0  # (a gradient that flows)
            # float32 sums over the batch in different orders: 1e-4
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    finally:
        ref.eval().zero_grad()
        model.eval().zero_grad()


# --------------------------------------------------------------------------- QK-norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["stablelm", "cohere", "phi"])
def test_head_norm_is_transformers_qk_norm(kind, dtype):
    """attnlab's QK LayerNorm (HeadNorm) is transformers': StableLmLayerNormPerHead (one
    nn.LayerNorm without bias per head, on (b, h, t, d_h)), CohereLayerNorm((h, d_h)) (on
    (b, t, h, d_h), in float32) and Phi's nn.LayerNorm(d_h) with bias shared by the heads:
    within float32 rounding, and within bf16 rounding in bf16 (float32 statistics)."""
    from transformers.models.cohere.modeling_cohere import CohereLayerNorm
    from transformers.models.stablelm.modeling_stablelm import StableLmLayerNormPerHead

    torch.manual_seed(0)
    h, d_h, eps = 3, 16, 0.05
    per_head = kind != "phi"
    ours = HeadNorm(d_h, heads=h if per_head else None, bias=kind == "phi", eps=eps)
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5)
        if ours.bias is not None:
            ours.bias.normal_()
    if kind == "stablelm":
        theirs = StableLmLayerNormPerHead(d_h, h, eps=eps)
        with torch.no_grad():
            for j, norm in enumerate(theirs.norms):
                norm.weight.copy_(ours.weight[j])
    elif kind == "cohere":
        theirs = CohereLayerNorm((h, d_h), eps=eps)
        with torch.no_grad():
            theirs.weight.copy_(ours.weight)
    else:
        theirs = torch.nn.LayerNorm(d_h, eps=eps)
        with torch.no_grad():
            theirs.weight.copy_(ours.weight)
            theirs.bias.copy_(ours.bias)
    ours.to(dtype)
    theirs.to(dtype)
    x = (torch.randn(2, 5, h, d_h) * 3 + 1).to(dtype)  # (b, t, h, d_h), a mean away from 0
    with torch.no_grad():
        got = ours(x)
        # StableLM's takes (b, h, t, d_h); the others the heads' features last
        want = theirs(x.transpose(1, 2)).transpose(1, 2) if kind == "stablelm" else theirs(x)
    assert got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    else:  # (assert_close's bf16 tolerances: a unit in the last place)
        torch.testing.assert_close(got, want)


# --------------------------------------------------------------------------- export


def _tiny(**changes):
    return get_preset("stablelm-tiny").override({"vocab_size": V, **changes})


_PER_HEAD_QK = {
    "attention.qk_norm": True,
    "attention.qk_norm_kind": "layernorm",
    "attention.qk_norm_weight": "per_head",
}
EXPORTS = {
    "stablelm-tiny": _tiny(),
    # StableLM 2 12B's layout: parallel blocks on one norm, a LayerNorm per query and key
    # head, no q/k/v biases, a tied head; interleaved pairs in the rotated half (q/k rows
    # and the QK-norm weights permuted to rotate-half there only), linear scaling
    "parallel-qk-norm-interleaved-tied": _tiny(
        **_PER_HEAD_QK,
        **{
            "norm.placement": "parallel_shared",
            "norm.eps": 0.05,
            "attention.qkv_bias": False,
            "position.rope_layout": "interleaved",
            "position.rope_fraction": 0.5,
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
    assert hf_model_type(cfg) == "stablelm"
    save_hf(model, tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    assert ("lm_head.weight" in stored) == (not cfg.tie_embeddings)
    assert not [k for k in stored if k.endswith("o_proj.bias")]  # (StableLM's has none)

    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert type(ref).__name__ == "StableLmForCausalLM"
    assert ref.model.layers[0].self_attn.rotary_ndims == cfg.rope_dim
    assert ref.config.qk_layernorm == cfg.attention.qk_norm
    assert_logits_match_hf(ref.eval(), model, V, TOL)
    assert_left_padded_logits_match_hf(ref, model, V, TOL)

    back = load_hf(tmp_path)  # import(export(x)): the same model, the same numbers
    assert back.cfg == cfg.override({"position.rope_layout": "split"})
    idx, mask = left_padded_batch(V)
    with torch.no_grad():
        again = back(idx, attention_mask=mask).logits
        ours = model(idx, attention_mask=mask).logits
    if cfg.position.rope_layout == "split":
        mine = model.state_dict()
        assert back.state_dict().keys() == mine.keys()
        assert all(torch.equal(v, mine[k]) for k, v in back.state_dict().items())
        assert torch.equal(again, ours)
    else:  # the rotated pairs permuted: q . k in another order
        assert (again - ours)[mask.bool()].abs().max() <= TOL
    save_hf(back, tmp_path / "again")  # export(import(export(x))) writes the same tensors
    twice = load_file(tmp_path / "again" / "model.safetensors")
    assert twice.keys() == stored.keys()
    assert all(torch.equal(twice[k], stored[k]) for k in stored)


def test_missing_layernorm_biases_are_written_as_zeros(tmp_path):
    """StableLM's LayerNorms always have biases: a model without them exports them as
    zeros (the same logits) and imports with them."""
    model = DecoderLM(_tiny(**{"norm.bias": False})).eval()
    HF.randomize(model, seed=1)
    assert hf_model_type(model.cfg) == "stablelm"
    save_hf(model, tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    assert not stored["model.layers.1.post_attention_layernorm.bias"].any()
    back = load_hf(tmp_path)
    assert back.cfg.norm.bias
    idx = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(back(idx).logits, model(idx).logits, atol=0, rtol=0)


@pytest.mark.parametrize("case", list(CASES))
def test_config_round_trips(case):
    """config.json -> attnlab -> config.json keeps every key transformers' StableLM reads,
    and attnlab -> config.json -> attnlab is the same config."""
    hf = HF.config(case).to_dict()
    cfg = config_from_hf(hf)
    written = config_to_hf(cfg)
    assert (written["model_type"], written["architectures"]) == (
        "stablelm", ["StableLmForCausalLM"])  # fmt: skip
    for key in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "hidden_act", "max_position_embeddings",
        "layer_norm_eps", "use_qkv_bias", "qk_layernorm", "use_parallel_residual",
        "hidden_dropout", "attention_dropout", "tie_word_embeddings", "initializer_range",
    ):  # fmt: skip
        assert written[key] == hf[key], key
    rope = hf["rope_parameters"]
    assert {k: written["rope_parameters"][k] for k in rope} == rope
    assert config_from_hf(written) == cfg
    for cfg in EXPORTS.values():
        assert config_from_hf(config_to_hf(cfg)) == cfg.override({"position.rope_layout": "split"})


def test_rope_fraction_defaults_as_transformers_reads_it():
    """Without partial_rotary_factor anywhere, StableLmConfig's 0.25; the RoPE parameters'
    own factor wins over the top-level key."""
    base = {"model_type": "stablelm", "vocab_size": V, **CASES["pre-gqa-qkv-bias"]}
    del base["rope_parameters"]
    for extra in ({}, {"partial_rotary_factor": 0.5},
                  {"rope_parameters": {"rope_type": "default", "rope_theta": 10.0,
                                       "partial_rotary_factor": 1.0},
                   "partial_rotary_factor": 0.5}):  # fmt: skip
        hf = {**base, **extra}
        theirs = transformers.AutoConfig.for_model(**hf).rope_parameters
        ours = config_from_hf(hf).position
        assert (ours.rope_theta, ours.rope_fraction) == (
            theirs["rope_theta"], theirs["partial_rotary_factor"]), extra  # fmt: skip


def test_hidden_dropout_is_read_with_a_warning():
    """hidden_dropout drops the MLP's output only: read as attnlab's one dropout, with a
    warning (training only)."""
    hf = {"model_type": "stablelm", "vocab_size": V, **CASES["pre-gqa-qkv-bias"]}
    assert config_from_hf(hf).dropout == 0.0
    with pytest.warns(UserWarning, match=re.escape("hidden_dropout=0.1 drops StableLM's MLP")):
        cfg = config_from_hf({**hf, "hidden_dropout": 0.1})
    assert cfg.dropout == 0.1


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"head_dim": 8},
         "config.json head_dim=8: StableLM's attention has heads of hidden_size / "
         "num_attention_heads = 16"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
         "RoPE scaling 'dynamic' is not supported"),
        ({"hidden_act": "gelu_fast"}, "hidden_act='gelu_fast' is not supported"),
        ({"layer_norm_eps": None}, "config.json layer_norm_eps must be a number"),
        ({"architectures": ["StableLmForSequenceClassification"]},
         "architecture 'StableLmForSequenceClassification' is not supported"),
    ],
    ids=["head-dim", "dynamic-rope", "activation", "null-eps", "head"],
)  # fmt: skip
def test_config_it_cannot_hold_is_refused_by_name(changes, named):
    hf = {**HF.config("pre-gqa-qkv-bias").to_dict(), **changes}
    with pytest.raises(HFCheckpointError, match=re.escape(named)):
        config_from_hf(hf)


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"attention.out_bias": True},
         "attention.out_bias=true (StableLM's o_proj has no bias: set it to false); RoPE "
         "decoders with LayerNorm and a gated feed-forward export as stablelm"),
        ({"ffn.bias": True}, "ffn.bias=true (StableLM's MLP has no biases"),
        ({"attention.head_dim": 8}, "attention.head_dim=8 (StableLM's heads are d_model / "
         "n_heads = 16 wide)"),
        ({"position.rope_scaling": "yarn"},
         "position.rope_scaling='yarn' (StableLM's: none or linear)"),
        ({"attention.qk_norm": True},
         "attention.qk_norm_kind='rmsnorm' (stablelm's QK-norm has 'layernorm'; this "
         "QK-norm exports as qwen3 or qwen3_moe or gemma3_text)"),
        ({"attention.qk_norm": True, "attention.qk_norm_kind": "layernorm"},
         "attention.qk_norm_weight='shared' (stablelm's QK-norm has 'per_head'; this QK-norm "
         "exports as phi or persimmon)"),
        ({**_PER_HEAD_QK, "attention.qk_norm_bias": True},
         "attention.qk_norm_bias=true (stablelm's QK-norm has false; no exported family has "
         "this QK-norm)"),
        ({"attention.sliding_window": 8}, "attention.sliding_window (stablelm attends to every"),
        ({"final_logits_bias": True}, "final_logits_bias (stablelm's head has no bias"),
        # (Granite's family takes every decoder with its multipliers, and names what it lacks)
        ({"embedding_multiplier": 2.0},
         "norm.kind='layernorm' (Granite's is 'rmsnorm'); embedding_multiplier exports as "
         "granite only"),
    ],
    ids=["out-bias", "ffn-bias", "head-dim", "yarn", "rms-qk-norm", "shared-qk-norm",
         "biased-qk-norm", "window", "head-bias", "granite"],
)  # fmt: skip
def test_export_refuses_what_stablelm_cannot_hold(changes, named, tmp_path):
    cfg = _tiny(**changes)
    with pytest.raises(HFCheckpointError, match=re.escape(named)):
        save_hf(DecoderLM(cfg), tmp_path)
    assert not (tmp_path / "config.json").exists()


# --------------------------------------------------------------------------- presets


@pytest.mark.parametrize("name", ["stablelm-3b-4e1t", "stablelm-2-1_6b", "stablelm-2-12b"])
def test_published_presets_export_as_stablelm(name):
    """Each published size is StableLM's layout, the 12B's parallel blocks and per-head
    QK-norm included (tests/test_analysis.py checks each count against transformers' model
    of its config.json, built on the meta device)."""
    cfg = get_preset(name)
    assert hf_model_type(cfg) == "stablelm"
    hf = config_to_hf(cfg)
    twelve = name == "stablelm-2-12b"
    assert (hf["qk_layernorm"], hf["use_parallel_residual"]) == (twelve, twelve)
    assert hf["partial_rotary_factor"] == 0.25 and hf["use_qkv_bias"] == (name == "stablelm-2-1_6b")
