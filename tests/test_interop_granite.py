"""Granite checkpoints: transformers models from tiny random configs (GQA 4/2 with all
four multipliers and MHA with head_dim 12 != d / h, biases and LLaMA 3 RoPE, with
GraniteConfig's default softmax scale of 1) with every weight set to random values, loaded
with ``load_hf``, give the same logits (with and without left padding), the same greedy
tokens (one prompt and a ragged batch) and the same loss and gradients; attnlab models
saved with ``save_hf`` load in transformers with the same logits and load back into attnlab
exactly; each multiplier acts where transformers applies it; configs neither side can hold
are refused by name, and the multipliers by every other layout.

Shapes: b batch, t length, V vocabulary.
"""

from __future__ import annotations

import math

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

from attnlab.config import ConfigError
from attnlab.interop import (
    HFCheckpointError,
    config_from_hf,
    config_to_hf,
    hf_model_type,
    load_hf,
    save_hf,
)
from attnlab.models.decoder import DecoderLM
from attnlab.presets import get_preset

V = 97
TOL = 2e-5  # float32, logits up to ~10 through 2 layers (op order)
CASES = {
    # GQA 4/2, head_dim d / h, all four multipliers away from 1 (a muP-like scale of
    # 1 / d_h), a tied head, plain RoPE of base 1000 (transformers 5.x's rope_parameters)
    "gqa-multipliers-tied": dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        embedding_multiplier=3.0,
        residual_multiplier=0.6,
        attention_multiplier=0.125,
        logits_scaling=4.0,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
    ),
    # MHA with head_dim 12 != d / h, attention and MLP biases, an untied head, LLaMA 3 RoPE
    # in transformers 4.x's keys, GraniteConfig's other defaults: a softmax scale of 1 (not
    # 1 / sqrt(d_h)) and the three other multipliers at 1
    "mha-biased-untied-llama3-defaults": dict(
        hidden_size=32,
        intermediate_size=40,
        head_dim=12,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
        rms_norm_eps=0.05,
        attention_bias=True,
        mlp_bias=True,
        rope_theta=300.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
}


# Norm weights in [0.5, 1.5) (transformers starts them at one), biases (zero at init) and every
# other weight random.
HF = HFCases("GraniteConfig", "GraniteForCausalLM", CASES, V, norms=(0.5, 1.5))
imported = HF.imported_fixture()


def test_import_config(imported):
    case, ref, model = imported
    cfg, hf = model.cfg, ref.config
    att = cfg.attention
    assert model.num_parameters() == ref.num_parameters()
    assert config_from_hf(hf.to_dict()) == cfg  # the in-memory config, not only config.json
    assert hf_model_type(cfg) == "granite"
    assert att.scale == hf.attention_multiplier
    assert cfg.embedding_multiplier == hf.embedding_multiplier
    assert cfg.residual_multiplier == hf.residual_multiplier
    assert cfg.logit_divisor == hf.logits_scaling
    assert (cfg.norm.kind, cfg.norm.placement, cfg.norm.eps) == ("rmsnorm", "pre", hf.rms_norm_eps)
    assert (cfg.ffn.kind, cfg.ffn.bias) == ("glu", hf.mlp_bias)
    assert att.qkv_bias == att.out_bias == hf.attention_bias
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (
        hf.num_attention_heads,
        hf.num_key_value_heads,
        getattr(hf, "head_dim", 32 // hf.num_attention_heads),
    )
    assert cfg.tie_embeddings == hf.tie_word_embeddings
    assert cfg.position.rope_theta == hf.rope_parameters["rope_theta"]


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
    """A loss backward in training mode over a left-padded batch: the loss (of the divided
    logits) and the gradients of the embedding (scaled), the norms and projections of a
    layer (scaled residual branches) are transformers'."""
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
            (block.attn_norm.weight, layer.input_layernorm.weight),
            (block.ffn_norm.weight, layer.post_attention_layernorm.weight),
            (block.attn.out.weight, layer.self_attn.o_proj.weight),
            (block.ffn.down.weight, layer.mlp.down_proj.weight),
        ]
        got_q = block.attn.qkv.weight.grad[:q_dim]
        torch.testing.assert_close(got_q, layer.self_attn.q_proj.weight.grad, atol=1e-4, rtol=1e-4)
        if cfg.ffn.bias:
            pairs.append((block.ffn.down.bias, layer.mlp.down_proj.bias))
        for ours_p, theirs_p in pairs:
            assert theirs_p.grad.abs().max() > 0  # (a gradient that flows)
            torch.testing.assert_close(ours_p.grad, theirs_p.grad, atol=1e-4, rtol=1e-4)
    finally:
        ref.eval().zero_grad()
        model.eval().zero_grad()


@torch.no_grad()
def test_each_multiplier_acts_where_transformers_applies_it():
    """Each scalar where transformers' Granite applies it: the first block receives the
    embeddings times embedding_multiplier; the logits are the model's without
    logit_divisor, divided by it; with a vanishing residual_multiplier only the embeddings
    reach the final norm (every branch's output is scaled before its residual add)."""
    cfg = get_preset("granite-tiny").override({"vocab_size": V})
    torch.manual_seed(0)
    model = DecoderLM(cfg).eval()
    HF.randomize(model, seed=1)
    idx = torch.randint(0, V, (2, 10), generator=torch.Generator().manual_seed(2))
    seen = []
    hook = model.blocks[0].register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    try:
        logits = model(idx).logits
    finally:
        hook.remove()
    torch.testing.assert_close(seen[0], model.tok_emb(idx) * 12.0, atol=0, rtol=0)

    def variant(**changes):
        other = DecoderLM(cfg.override(changes)).eval()
        other.load_state_dict(model.state_dict())
        return other(idx).logits

    torch.testing.assert_close(logits, variant(logit_divisor=1.0) / 8.0, atol=0, rtol=0)
    only_embeddings = model.lm_head(model.norm(model.tok_emb(idx) * 12.0)) / 8.0
    frozen = variant(residual_multiplier=1e-30)  # (0 is no multiplier attnlab accepts)
    torch.testing.assert_close(frozen, only_embeddings, atol=1e-6, rtol=1e-6)
    assert (logits - only_embeddings).abs().max() > 1e-2  # (the branches do matter)


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"embedding_multiplier": 0.0}, "embedding_multiplier: must be > 0"),
        ({"residual_multiplier": float("inf")}, "residual_multiplier: must be finite"),
        ({"logit_divisor": -2.0}, "logit_divisor: must be > 0"),
        ({"arch": "encoder", "embedding_multiplier": 1.0, "residual_multiplier": 1.0},
         "logit_divisor: is implemented by the decoder architecture only, not 'encoder'"),
    ],
)  # fmt: skip
def test_multipliers_are_validated(changes, named):
    with pytest.raises(ConfigError, match=named):
        get_preset("granite-tiny").override(changes).validate()


# --------------------------------------------------------------------------- export


def _tiny(**changes):
    return get_preset("granite-tiny").override({"vocab_size": V, **changes})


EXPORTS = {
    "granite-tiny": _tiny(),
    # interleaved RoPE pairs (q/k rows permuted to split halves), q/k/v biases only (o's
    # written as zeros), MLP biases, an untied head, MHA with head_dim 12, YaRN, no softmax
    # scale (written as 1 / sqrt(d_h)), only a residual multiplier
    "interleaved-biased-untied-residual-only": _tiny(
        **{
            "position.rope_layout": "interleaved",
            "position.rope_scaling": "yarn",
            "position.rope_factor": 4.0,
            "position.rope_original_max_seq_len": 32,
            "attention.qkv_bias": True,
            "attention.n_kv_heads": None,
            "attention.head_dim": 12,
            "attention.scale": None,
            "embedding_multiplier": 1.0,
            "logit_divisor": 1.0,
            "ffn.bias": True,
            "tie_embeddings": False,
        }
    ),
    # LLaMA's layout with a softmax scale of its own and no multiplier (Granite holds it)
    "llama-with-a-scale": get_preset("llama-tiny").override(
        {"vocab_size": V, "attention.scale": 0.3, "ffn.hidden_dim": 96, "ffn.multiple_of": 256}
    ),
}


def _as_imported(cfg):
    """What export then import gives: split RoPE pairs, q, k, v and o biases all or none,
    the softmax scale written out."""
    att = cfg.attention
    scale = 1.0 / math.sqrt(cfg.head_dim) if att.scale is None else att.scale
    return cfg.override(
        {
            "position.rope_layout": "split",
            "attention.out_bias": att.qkv_bias or att.out_bias,
            "attention.qkv_bias": att.qkv_bias or att.out_bias,
            "attention.scale": scale,
        }
    )


@pytest.mark.parametrize("name", list(EXPORTS))
def test_export_round_trip(name, tmp_path):
    cfg = EXPORTS[name]
    torch.manual_seed(20)
    model = DecoderLM(cfg).eval()
    HF.randomize(model, seed=len(name))
    assert hf_model_type(cfg) == "granite"
    save_hf(model, tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    assert ("lm_head.weight" in stored) == (not cfg.tie_embeddings)

    idx = torch.randint(0, V, (2, 40), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(idx)
    mask[1, :7] = 0
    with torch.no_grad():
        ours = model(idx, attention_mask=mask).logits
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert type(ref).__name__ == "GraniteForCausalLM"
    theirs = hf_logits(ref.eval(), idx, mask)
    real = mask.bool()
    assert ours.abs().max() > 1.0
    assert (ours[real] - theirs[real]).abs().max() <= TOL

    back = load_hf(tmp_path)  # import(export(x)): the same model, the same numbers
    assert back.cfg == _as_imported(cfg)
    split = cfg.position.rope_layout == "split"
    if split:
        mine = model.state_dict()
        for key, value in back.state_dict().items():
            want = mine.get(key, torch.zeros_like(value))  # biases it had not: zeros
            assert torch.equal(value, want), key
    with torch.no_grad():
        again = back(idx, attention_mask=mask).logits
    assert (again - ours)[real].abs().max() <= (0.0 if split else TOL)
    save_hf(back, tmp_path / "again")  # export(import(export(x))) writes the same tensors
    twice = load_file(tmp_path / "again" / "model.safetensors")
    assert twice.keys() == stored.keys()
    assert all(torch.equal(twice[k], stored[k]) for k in stored)


@pytest.mark.parametrize("case", list(CASES))
def test_config_round_trips(case):
    """config.json -> attnlab -> config.json keeps every key transformers' Granite reads,
    and attnlab -> config.json -> attnlab is the same config."""
    hf = HF.config(case).to_dict()
    cfg = config_from_hf(hf)
    written = config_to_hf(cfg)
    assert (written["model_type"], written["architectures"]) == ("granite", ["GraniteForCausalLM"])
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "hidden_act",
        "max_position_embeddings",
        "rms_norm_eps",
        "attention_bias",
        "attention_dropout",
        "mlp_bias",
        "tie_word_embeddings",
        "initializer_range",
        "rope_parameters",
        "embedding_multiplier",
        "residual_multiplier",
        "attention_multiplier",
        "logits_scaling",
    ):
        assert written[key] == hf[key], key
    assert config_from_hf(written) == cfg
    for cfg in EXPORTS.values():
        assert config_from_hf(config_to_hf(cfg)) == _as_imported(cfg)


# --------------------------------------------------------------------------- refusals


def _message(named: str) -> str:
    return named.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"logits_scaling": 0.0}, "logit_divisor: must be > 0, got 0.0"),
        ({"residual_multiplier": "0.2"}, "config.json residual_multiplier must be a number"),
        ({"attention_multiplier": None}, "config.json attention_multiplier must be a number"),
        ({"hidden_act": "gelu_fast"}, "hidden_act='gelu_fast' is not supported"),
        ({"architectures": ["GraniteForSequenceClassification"]},
         "architecture 'GraniteForSequenceClassification' is not supported"),
    ],
    ids=["logits-scaling", "string", "null", "activation", "head"],
)  # fmt: skip
def test_config_it_cannot_hold_is_refused_by_name(changes, named):
    hf = {**HF.config("gqa-multipliers-tied").to_dict(), **changes}
    with pytest.raises(HFCheckpointError, match=_message(named)):
        config_from_hf(hf)


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"norm.kind": "layernorm"},
         "norm.kind='layernorm' (Granite's is 'rmsnorm'); embedding_multiplier exports as "
         "granite only"),
        ({"ffn.kind": "mlp"}, "ffn.kind='mlp' (Granite's is 'glu')"),
        ({"norm.placement": "post"}, "norm.placement='post' (Granite's is 'pre')"),
        ({"attention.sliding_window": 8}, "attention.sliding_window (granite attends to every"),
        ({"attention.qk_norm": True}, "attention.qk_norm (granite has no QK-norm"),
        ({"scale_embeddings": True}, "scale_embeddings (granite has none; Gemma's pieces"),
        ({"final_logit_softcap": 20.0}, "final_logit_softcap (granite has none"),
        ({"position.nope_layers": [1]}, "position.nope_layers (granite rotates every layer"),
    ],
)  # fmt: skip
def test_export_refuses_what_granite_cannot_hold(changes, named, tmp_path):
    cfg = _tiny(**changes)
    with pytest.raises(HFCheckpointError, match=_message(named)):
        save_hf(DecoderLM(cfg), tmp_path)
    assert not (tmp_path / "config.json").exists()


def test_families_other_than_granite_refuse_its_multipliers(monkeypatch):
    """convert's own check, should another family take such a config (Granite's family
    left out of the registry here): each layout names the multiplier it has not."""
    from attnlab.interop import convert

    others = tuple(f for f in convert.FAMILIES if f.name != "granite")
    monkeypatch.setattr(convert, "FAMILIES", others)
    layouts = (("llama-tiny", "llama"), ("gpt2-tiny", "gpt2"),
               ("starcoder2-tiny", "starcoder2"), ("gemma3-tiny", "gemma3_text"))  # fmt: skip
    for base, name in layouts:
        for field in ("embedding_multiplier", "residual_multiplier", "logit_divisor"):
            cfg = get_preset(base).override({field: 2.0})
            with pytest.raises(HFCheckpointError, match=_message(
                f"{field} ({name} has none; Granite's multipliers export as granite"
            )):  # fmt: skip
                hf_model_type(cfg)


@pytest.mark.parametrize(
    "preset, changes, model_type",
    [
        ("llama-tiny", {}, "llama"),
        ("llama-tiny", {"attention.scale": 0.25}, "granite"),
        ("gemma3-tiny", {}, "gemma3_text"),
        ("gemma2-tiny", {}, "gemma2"),
        ("olmo2-tiny", {}, "olmo2"),
        ("gpt2-tiny", {}, "gpt2"),
        ("granite-tiny", {}, "granite"),
        ("pythia-tiny", {}, "gpt_neox"),
        ("cohere-tiny", {}, "cohere"),  # parallel blocks of one norm, a logit scale
    ],
)
def test_export_picks_granite_only_for_its_pieces(preset, changes, model_type):
    """Gemma's configs (whose softmax scale comes with their other pieces) and the other
    families' export as before; a LLaMA-shaped one with a scale of its own is Granite's."""
    assert hf_model_type(get_preset(preset).override(changes)) == model_type
