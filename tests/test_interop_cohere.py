"""Cohere checkpoints: transformers models from tiny random configs (GQA 4/2 with a tied
head and a logit scale that is no power of two, and MHA with head_dim 12 != d / h,
attention biases, an untied head, YaRN and a large LayerNorm eps) with every weight set to
random values, loaded with ``load_hf``, give the same logits (with and without left
padding), the same greedy tokens (one prompt and a ragged batch) and the same loss and
gradients; attnlab models saved with ``save_hf`` load in transformers with the same logits
and load back into attnlab exactly; Cohere's LayerNorm is attnlab's bias-free one and its
logit scale a product; configs neither side can hold are refused by name, and the logit
scale by every other layout.

Shapes: b batch, t length, V vocabulary.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from hf_cases import HFCases, transformers
from oracle import (
    assert_greedy_tokens_match_hf,
    assert_left_padded_logits_match_hf,
    assert_logits_match_hf,
    hf_logits,
    left_padded_batch,
)
from safetensors.torch import load_file

from attnlab.config import ConfigError, NormConfig
from attnlab.interop import (
    HFCheckpointError,
    config_from_hf,
    config_to_hf,
    hf_model_type,
    load_hf,
    save_hf,
)
from attnlab.models.decoder import DecoderLM
from attnlab.nn.norm import build_norm
from attnlab.presets import get_preset

V = 97
TOL = 2e-5  # float32, logits up to ~10 through 2 layers (op order)
CASES = {
    # GQA 4/2, head_dim d / h, a tied head (CohereConfig's default), a logit scale of
    # 5/6 (Command R+'s, no power of two: its product rounds unlike a division by 1.2),
    # plain RoPE of base 1000 (transformers 5.x's rope_parameters)
    "gqa-tied-scale": dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        logit_scale=0.8333333333333334,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
    ),
    # MHA with head_dim 12 != d / h, q/k/v/o biases, an untied head, YaRN in transformers
    # 4.x's keys, a LayerNorm eps large enough to matter, a logit scale of 1/2 (Command-R's
    # 1/16 would leave logits too small to compare)
    "mha-biased-untied-yarn": dict(
        hidden_size=32,
        intermediate_size=40,
        head_dim=12,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        layer_norm_eps=0.05,
        logit_scale=0.5,
        attention_bias=True,
        tie_word_embeddings=False,
        rope_theta=300.0,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    # Command R+'s QK-norm (use_qk_norm): a LayerNorm without bias per query and key head,
    # each head its own weight, GQA 4/2, an eps large enough to matter
    "qk-norm": dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        layer_norm_eps=0.05,
        logit_scale=0.5,
        use_qk_norm=True,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
    ),
}


HF = HFCases("CohereConfig", "CohereForCausalLM", CASES, V, norms=(0.5, 1.5))
imported = HF.imported_fixture()


def test_import_config(imported):
    case, ref, model = imported
    cfg, hf = model.cfg, ref.config
    att, pos = cfg.attention, cfg.position
    assert model.num_parameters() == ref.num_parameters()
    assert config_from_hf(hf.to_dict()) == cfg  # the in-memory config, not only config.json
    assert hf_model_type(cfg) == "cohere"
    assert cfg.logit_scale == hf.logit_scale and cfg.logit_divisor == 1.0
    assert (cfg.norm.kind, cfg.norm.bias, cfg.norm.placement, cfg.norm.eps) == (
        "layernorm",
        False,
        "parallel_shared",
        hf.layer_norm_eps,
    )
    assert (cfg.ffn.kind, cfg.ffn.activation, cfg.ffn.bias) == ("glu", "silu", False)
    assert att.qkv_bias == att.out_bias == hf.attention_bias
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (
        hf.num_attention_heads,
        hf.num_key_value_heads,
        getattr(hf, "head_dim", 32 // hf.num_attention_heads),
    )
    assert cfg.tie_embeddings == hf.tie_word_embeddings
    assert (pos.rope_layout, pos.rope_theta) == ("interleaved", hf.rope_parameters["rope_theta"])
    assert pos.rope_scaling == ("yarn" if case == "mha-biased-untied-yarn" else None)
    assert att.qk_norm == hf.use_qk_norm
    if att.qk_norm:  # a weight per head, (h, d_h) and (h_kv, d_h), as stored
        assert (att.qk_norm_kind, att.qk_norm_bias, att.qk_norm_weight) == (
            "layernorm", False, "per_head")  # fmt: skip
        attn, theirs = model.blocks[1].attn, ref.model.layers[1].self_attn
        assert torch.equal(attn.q_norm.weight, theirs.q_norm.weight)
        assert torch.equal(attn.k_norm.weight, theirs.k_norm.weight)
        assert attn.k_norm.weight.shape == (cfg.n_kv_heads, cfg.head_dim)


def test_import_logits(imported):
    case, ref, model = imported
    assert_logits_match_hf(ref, model, V, TOL)


def test_import_logits_left_padding(imported):
    case, ref, model = imported
    assert_left_padded_logits_match_hf(ref, model, V, TOL)


def test_import_greedy_generation(imported):
    """Cached decoding against transformers' cache, one prompt and a left-padded batch."""
    case, ref, model = imported
    assert_greedy_tokens_match_hf(ref, model, V)


def test_training_gradients_match_transformers(imported):
    """A loss backward in training mode over a left-padded batch: the loss (of the scaled
    logits) and the gradients of the embedding (tied or not), the final norm, a layer's
    one norm (read by both sublayers), its projections, are transformers'."""
    case, ref, model = imported
    ref.train()
    model.train()
    idx, mask = left_padded_batch(V, seed=4)
    # (a padding position's logits are no model's business: no target there)
    targets = idx[:, 1:].masked_fill(mask[:, :-1] == 0, -100)
    ours = model(idx[:, :-1], attention_mask=mask[:, :-1], targets=targets).loss
    logits = ref(
        idx[:, :-1],
        attention_mask=mask[:, :-1],
        position_ids=(mask[:, :-1].cumsum(-1) - 1).clamp(min=0),
    ).logits
    theirs = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    ours.backward()
    theirs.backward()
    try:
        assert abs(ours.item() - theirs.item()) <= 1e-5
        cfg = model.cfg
        q_dim = cfg.n_heads * cfg.head_dim
        block, layer = model.blocks[0], ref.model.layers[0]
        pairs = [
            (model.norm.weight, ref.model.norm.weight),
            (model.tok_emb.weight, ref.model.embed_tokens.weight),
            (block.norm.weight, layer.input_layernorm.weight),
            (block.attn.out.weight, layer.self_attn.o_proj.weight),
            (block.ffn.down.weight, layer.mlp.down_proj.weight),
        ]
        # q rows as stored (interleaved pairs on both sides)
        got_q = block.attn.qkv.weight.grad[:q_dim]
        torch.testing.assert_close(got_q, layer.self_attn.q_proj.weight.grad, atol=1e-4, rtol=1e-4)
        if not cfg.tie_embeddings:
            pairs.append((model.lm_head.weight, ref.lm_head.weight))
        if cfg.attention.qkv_bias:
            pairs.append((block.attn.out.bias, layer.self_attn.o_proj.bias))
        if cfg.attention.qk_norm:  # each head's weight (interleaved pairs on both sides)
            pairs.append((block.attn.q_norm.weight, layer.self_attn.q_norm.weight))
            pairs.append((block.attn.k_norm.weight, layer.self_attn.k_norm.weight))
        for ours_p, theirs_p in pairs:
            assert theirs_p.grad.abs().max() > 0  # (a gradient that flows)
            torch.testing.assert_close(ours_p.grad, theirs_p.grad, atol=1e-4, rtol=1e-4)
    finally:
        ref.eval().zero_grad()
        model.eval().zero_grad()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("eps", [1e-5, 0.05])
def test_layernorm_is_cohere_layernorm(dtype, eps):
    """attnlab's bias-free LayerNorm (norm.bias false, one weight) is transformers'
    CohereLayerNorm (float32 statistics, eps inside the square root): within float32
    rounding, and within bf16 rounding in bf16 (both normalise in float32)."""
    from transformers.models.cohere.modeling_cohere import CohereLayerNorm

    torch.manual_seed(0)
    ours = build_norm(NormConfig(kind="layernorm", eps=eps, bias=False), 48)
    theirs = CohereLayerNorm(48, eps=eps)
    assert [name for name, _ in ours.named_parameters()] == ["weight"]
    with torch.no_grad():
        ours.weight.copy_(torch.rand(48) + 0.5)
        theirs.weight.copy_(ours.weight)
    ours.to(dtype)
    theirs.to(dtype)
    x = (torch.randn(4, 16, 48) * 3 + 1).to(dtype)  # (a mean away from zero)
    with torch.no_grad():
        got, want = ours(x), theirs(x)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    else:  # (assert_close's bf16 tolerances: a unit in the last place)
        torch.testing.assert_close(got, want)


@torch.no_grad()
def test_logit_scale_multiplies_the_logits():
    """The logits are the model's without logit_scale times it, the same product in float32
    as transformers' (a division by 1 / logit_scale rounds some of them differently)."""
    scale = 0.8333333333333334
    cfg = get_preset("cohere-tiny").override({"vocab_size": V, "logit_scale": scale})
    torch.manual_seed(0)
    model = DecoderLM(cfg).eval()
    HF.randomize(model, seed=1)
    idx = torch.randint(0, V, (2, 10), generator=torch.Generator().manual_seed(2))
    logits = model(idx).logits
    plain = DecoderLM(cfg.override({"logit_scale": 1.0})).eval()
    plain.load_state_dict(model.state_dict())
    unscaled = plain(idx).logits
    assert torch.equal(logits, unscaled * scale)
    assert not torch.equal(logits, unscaled / (1 / scale))  # (why it is not logit_divisor)


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"logit_scale": 0.0}, "logit_scale: must be > 0"),
        ({"logit_scale": float("inf")}, "logit_scale: must be finite"),
        ({"arch": "encoder", "norm.placement": "pre"},
         "logit_scale: is implemented by the decoder architecture only, not 'encoder'"),
    ],
)  # fmt: skip
def test_logit_scale_is_validated(changes, named):
    with pytest.raises(ConfigError, match=named):
        get_preset("cohere-tiny").override(changes).validate()


# --------------------------------------------------------------------------- export


def _tiny(**changes):
    return get_preset("cohere-tiny").override({"vocab_size": V, **changes})


EXPORTS = {
    "cohere-tiny": _tiny(),
    # split-halves RoPE pairs (q/k rows permuted to Cohere's interleaved ones), q/k/v
    # biases only (o's written as zeros), an untied head, MHA with head_dim 12, linear RoPE
    # scaling, no logit scale (written as 1)
    "split-biased-untied-linear-unscaled": _tiny(
        **{
            "position.rope_layout": "split",
            "position.rope_scaling": "linear",
            "position.rope_factor": 2.0,
            "attention.qkv_bias": True,
            "attention.n_kv_heads": None,
            "attention.head_dim": 12,
            "logit_scale": 1.0,
            "tie_embeddings": False,
        }
    ),
    # Command R+'s QK-norm with split-halves pairs: each head's weight permuted with its
    # q/k rows to Cohere's interleaved pairs
    "qk-norm-split": _tiny(
        **{
            "position.rope_layout": "split",
            "attention.qk_norm": True,
            "attention.qk_norm_kind": "layernorm",
            "attention.qk_norm_weight": "per_head",
            "norm.eps": 0.05,
            "logit_scale": 0.5,
        }
    ),
}


def _as_imported(cfg):
    """What export then import gives: interleaved RoPE pairs, q, k, v and o biases all or
    none."""
    bias = cfg.attention.qkv_bias or cfg.attention.out_bias
    return cfg.override(
        {
            "position.rope_layout": "interleaved",
            "attention.qkv_bias": bias,
            "attention.out_bias": bias,
        }
    )


@pytest.mark.parametrize("name", list(EXPORTS))
def test_export_round_trip(name, tmp_path):
    cfg = EXPORTS[name]
    torch.manual_seed(20)
    model = DecoderLM(cfg).eval()
    HF.randomize(model, seed=len(name))
    assert hf_model_type(cfg) == "cohere"
    save_hf(model, tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    assert ("lm_head.weight" in stored) == (not cfg.tie_embeddings)
    assert not [k for k in stored if k.endswith("norm.bias")]  # (Cohere's norms have none)

    idx = torch.randint(0, V, (2, 40), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(idx)
    mask[1, :7] = 0
    with torch.no_grad():
        ours = model(idx, attention_mask=mask).logits
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert type(ref).__name__ == "CohereForCausalLM"
    theirs = hf_logits(ref.eval(), idx, mask)
    real = mask.bool()
    assert ours.abs().max() > cfg.logit_scale  # (logits before the scale not near zero)
    assert (ours[real] - theirs[real]).abs().max() <= TOL

    back = load_hf(tmp_path)  # import(export(x)): the same model, the same numbers
    assert back.cfg == _as_imported(cfg)
    interleaved = cfg.position.rope_layout == "interleaved"
    if interleaved:
        mine = model.state_dict()
        for key, value in back.state_dict().items():
            want = mine.get(key, torch.zeros_like(value))  # biases it had not: zeros
            assert torch.equal(value, want), key
    with torch.no_grad():
        again = back(idx, attention_mask=mask).logits
    assert (again - ours)[real].abs().max() <= (0.0 if interleaved else TOL)
    save_hf(back, tmp_path / "again")  # export(import(export(x))) writes the same tensors
    twice = load_file(tmp_path / "again" / "model.safetensors")
    assert twice.keys() == stored.keys()
    assert all(torch.equal(twice[k], stored[k]) for k in stored)


@pytest.mark.parametrize("case", list(CASES))
def test_config_round_trips(case):
    """config.json -> attnlab -> config.json keeps every key transformers' Cohere reads,
    and attnlab -> config.json -> attnlab is the same config (the logit scale exactly)."""
    hf = HF.config(case).to_dict()
    cfg = config_from_hf(hf)
    written = config_to_hf(cfg)
    assert (written["model_type"], written["architectures"]) == ("cohere", ["CohereForCausalLM"])
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "hidden_act",
        "max_position_embeddings",
        "layer_norm_eps",
        "logit_scale",
        "attention_bias",
        "attention_dropout",
        "use_qk_norm",
        "tie_word_embeddings",
        "initializer_range",
    ):
        assert written[key] == hf[key], key
    # (YaRN's parameters written out in full: transformers' defaults where it left them out)
    rope = hf["rope_parameters"]
    assert {k: written["rope_parameters"][k] for k in rope} == rope
    assert config_from_hf(written) == cfg
    for cfg in EXPORTS.values():
        assert config_from_hf(config_to_hf(cfg)) == _as_imported(cfg)


def test_missing_rope_theta_is_cohere_configs_default():
    """Without rope_theta or RoPE parameters, CohereConfig's base (default_theta), not
    10000, as transformers fills it."""
    hf = {k: v for k, v in HF.config("gqa-tied-scale").to_dict().items() if k != "rope_parameters"}
    filled = transformers.CohereConfig(**{k: v for k, v in hf.items() if k != "model_type"})
    assert config_from_hf(hf).position.rope_theta == filled.rope_parameters["rope_theta"]


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"logit_scale": None}, "config.json logit_scale must be a number, got None"),
        ({"logit_scale": "0.5"}, "config.json logit_scale must be a number"),
        ({"logit_scale": -1.0}, "logit_scale: must be > 0, got -1.0"),
        ({"layer_norm_eps": None}, "config.json layer_norm_eps must be a number"),
        ({"hidden_act": "gelu_fast"}, "hidden_act='gelu_fast' is not supported"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
         "RoPE scaling 'dynamic' is not supported"),
        ({"architectures": ["CohereForSequenceClassification"]},
         "architecture 'CohereForSequenceClassification' is not supported"),
    ],
    ids=["null-scale", "string-scale", "negative-scale", "null-eps", "activation",
         "dynamic-rope", "head"],
)  # fmt: skip
def test_config_it_cannot_hold_is_refused_by_name(changes, named):
    hf = {**HF.config("gqa-tied-scale").to_dict(), **changes}
    with pytest.raises(HFCheckpointError, match=re.escape(named)):
        config_from_hf(hf)


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"norm.bias": True},
         "norm.bias=true (Cohere's LayerNorms have no bias: set it to false); "
         "norm.placement='parallel_shared' exports as cohere only"),
        ({"ffn.bias": True}, "ffn.bias=true (Cohere's MLP has no biases"),
        ({"norm.kind": "rmsnorm"}, "norm.kind='rmsnorm' (Cohere's is 'layernorm')"),
        ({"ffn.kind": "mlp", "ffn.activation": "gelu"}, "ffn.kind='mlp' (Cohere's is 'glu')"),
        ({"position.kind": "learned"}, "position.kind='learned' (Cohere's is 'rope')"),
        ({"norm.placement": "pre"},
         "norm.placement='pre' (Cohere's is 'parallel_shared'); logit_scale exports as "
         "cohere only"),
        ({"attention.qk_norm": True},
         "attention.qk_norm_kind='rmsnorm' (cohere's QK-norm has 'layernorm'; this QK-norm "
         "exports as qwen3 or qwen3_moe or gemma3_text)"),
        ({"attention.qk_norm": True, "attention.qk_norm_kind": "layernorm"},
         "attention.qk_norm_weight='shared' (cohere's QK-norm has 'per_head'; this QK-norm "
         "exports as phi or persimmon)"),
        ({"attention.sliding_window": 8}, "attention.sliding_window (cohere attends to every"),
        ({"position.rope_fraction": 0.5}, "position.rope_fraction=0.5 (cohere rotates whole"),
        ({"embedding_multiplier": 2.0},
         "embedding_multiplier (cohere has none; Granite's multipliers export as granite"),
        ({"logit_divisor": 2.0}, "logit_divisor (cohere has none"),
    ],
)  # fmt: skip
def test_export_refuses_what_cohere_cannot_hold(changes, named, tmp_path):
    cfg = _tiny(**changes)
    with pytest.raises(HFCheckpointError, match=re.escape(named)):
        save_hf(DecoderLM(cfg), tmp_path)
    assert not (tmp_path / "config.json").exists()


def test_families_other_than_cohere_refuse_its_logit_scale(monkeypatch):
    """convert's own check, should another family take such a config (Cohere's family
    left out of the registry here): each layout names the scale it has not."""
    from attnlab.interop import convert

    others = tuple(f for f in convert.FAMILIES if f.name != "cohere")
    monkeypatch.setattr(convert, "FAMILIES", others)
    for base, name in (("llama-tiny", "llama"), ("gpt2-tiny", "gpt2"),
                       ("granite-tiny", "granite"), ("pythia-tiny", "gpt_neox")):  # fmt: skip
        cfg = get_preset(base).override({"logit_scale": 0.5})
        with pytest.raises(HFCheckpointError, match=re.escape(
            f"logit_scale ({name} has none; Cohere's logit scale exports as cohere"
        )):  # fmt: skip
            hf_model_type(cfg)
