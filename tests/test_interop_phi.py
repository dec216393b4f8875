"""Phi-1/1.5/2 checkpoints: transformers models from tiny random configs (Phi-2's rotated
fraction on 3 heads; GQA with heads of their own width, transformers 4.x's RoPE keys, linear
scaling, the exact GELU and a tied head) with every weight set to random values, loaded
with ``load_hf``, give the same logits (with left padding), loss and gradients, and the same
greedy tokens; attnlab models saved with ``save_hf`` load in transformers with the same
logits and load back exactly; what neither side can hold is refused by name; the head's
bias (``final_logits_bias``) is refused by every family without one.

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

from attnlab.config import ConfigError
from attnlab.interop import HFCheckpointError, config_from_hf, hf_model_type, load_hf, save_hf
from attnlab.models import build_model
from attnlab.models.decoder import DecoderLM
from attnlab.presets import get_preset

V = 97
TOL = 1e-5  # float32 logits up to ~15 (weights of std 0.3): observed up to 7e-6
CASES = {
    # Phi-2's block: 3 heads of 16, int(16 * 0.4) = 6 features rotated (3 pairs), base 100
    "phi2-like": dict(
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=3,
        max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 100.0, "partial_rotary_factor": 0.4},
    ),
    # GQA 4/2 with heads of 16 on d_model 48, transformers 4.x's keys (a quarter of each
    # head: 2 pairs), linear scaling x2, the exact GELU, a tied head (its bias its own)
    "gqa-linear-tied": dict(
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        partial_rotary_factor=0.25,
        rope_theta=50.0,
        rope_scaling={"type": "linear", "factor": 2.0},
        tie_word_embeddings=True,
        hidden_act="gelu",
    ),
    # qk_layernorm: a LayerNorm with bias every query head shares, one every key head
    # shares, before a partial rotation (half of each head, linear scaling); GQA 4/2 and a
    # LayerNorm eps large enough to matter
    "qk-layernorm": dict(
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        layer_norm_eps=0.05,
        qk_layernorm=True,
        rope_parameters={
            "rope_type": "linear",
            "factor": 2.0,
            "rope_theta": 100.0,
            "partial_rotary_factor": 0.5,
        },
    ),
}


def _is_norm(name: str, p: torch.Tensor) -> bool:
    """LayerNorm weights in [0.5, 1.5), every other parameter (biases too) random."""
    return ("norm" in name or "layernorm" in name) and name.endswith("weight")


HF = HFCases("PhiConfig", "PhiForCausalLM", CASES, V, norms=(0.5, 1.5), is_norm=_is_norm)
imported = HF.imported_fixture()


def test_import_config_and_weights(imported):
    """The config as transformers reads it; one shared norm per block; q, k and v stacked
    as attnlab's [q; k; v]; the head's bias its own, the weight tied or not."""
    case, ref, model = imported
    cfg, hf = model.cfg, ref.config
    assert model.num_parameters() == ref.num_parameters()
    assert config_from_hf(hf.to_dict()) == cfg  # the in-memory config, not only config.json
    params = hf.rope_parameters
    assert cfg.position.rope_theta == params["rope_theta"]
    assert cfg.position.rope_fraction == params["partial_rotary_factor"]
    assert cfg.rope_dim == ref.model.layers[0].self_attn.rotary_ndims
    assert cfg.position.rope_scaling == (None if case == "phi2-like" else "linear")
    assert ref.model.layers[0].self_attn.qk_layernorm == cfg.attention.qk_norm
    assert cfg.norm.placement == "parallel_shared" and cfg.final_logits_bias
    assert (cfg.n_kv_heads, cfg.head_dim) == (
        hf.num_key_value_heads,
        ref.model.layers[0].self_attn.head_dim,
    )
    assert cfg.tie_embeddings == hf.tie_word_embeddings
    att = cfg.attention
    assert att.qk_norm == hf.qk_layernorm
    if att.qk_norm:  # one LayerNorm with bias for all query heads, one for all key heads
        assert (att.qk_norm_kind, att.qk_norm_bias, att.qk_norm_weight) == (
            "layernorm", True, "shared")  # fmt: skip
    block, layer = model.blocks[1], ref.model.layers[1]
    assert block.attn_norm is None and block.ffn_norm is None
    assert torch.equal(block.norm.bias, layer.input_layernorm.bias)
    attn = layer.self_attn
    if att.qk_norm:
        for ours, theirs in ((block.attn.q_norm, attn.q_layernorm),
                             (block.attn.k_norm, attn.k_layernorm)):  # fmt: skip
            assert torch.equal(ours.weight, theirs.weight) and torch.equal(ours.bias, theirs.bias)
    for ours, theirs in ((block.attn.qkv.weight, "weight"), (block.attn.qkv.bias, "bias")):
        stacked = torch.cat(
            [getattr(getattr(attn, n), theirs) for n in ("q_proj", "k_proj", "v_proj")]
        )
        assert torch.equal(ours, stacked)
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
    gradients of the stacked q/k/v projection, the shared norm, the MLP, the head's bias
    and the embedding are transformers'."""
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
        block, layer = model.blocks[1], ref.model.layers[1]
        attn = layer.self_attn
        qkv_grad = torch.cat([getattr(attn, n).weight.grad for n in ("q_proj", "k_proj", "v_proj")])
        pairs = [
            (block.attn.qkv.weight.grad, qkv_grad),
            (block.attn.out.bias.grad, attn.dense.bias.grad),
            (block.norm.weight.grad, layer.input_layernorm.weight.grad),
            (block.norm.bias.grad, layer.input_layernorm.bias.grad),
            (block.ffn.up.weight.grad, layer.mlp.fc1.weight.grad),
            (block.ffn.down.bias.grad, layer.mlp.fc2.bias.grad),
            (model.norm.weight.grad, ref.model.final_layernorm.weight.grad),
            (model.lm_head.bias.grad, ref.lm_head.bias.grad),
            (model.tok_emb.weight.grad, ref.model.embed_tokens.weight.grad),
        ]
        if model.cfg.attention.qk_norm:  # (the QK LayerNorms' weights and biases)
            for ours, theirs in ((block.attn.q_norm, attn.q_layernorm),
                                 (block.attn.k_norm, attn.k_layernorm)):  # fmt: skip
                pairs += [
                    (ours.weight.grad, theirs.weight.grad),
                    (ours.bias.grad, theirs.bias.grad),
                ]
        for got, want in pairs:
            # float32 sums over the batch in different orders: 1e-4
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    finally:
        ref.eval().zero_grad()
        model.eval().zero_grad()


# --------------------------------------------------------------------------- export


def _tiny(**changes):
    return get_preset("phi-tiny").override({"vocab_size": V, **changes})


EXPORTS = {
    "phi-tiny": _tiny(),
    # interleaved RoPE pairs in the rotated half (q/k rows and biases permuted to
    # rotate-half there only), linear scaling, GQA, a tied head with its bias, the exact GELU
    "interleaved-gqa-tied": _tiny(
        **{
            "position.rope_layout": "interleaved",
            "position.rope_scaling": "linear",
            "position.rope_factor": 3.0,
            "attention.n_kv_heads": 2,
            "tie_embeddings": True,
            "ffn.activation": "gelu",
        }
    ),
    # QK-norm (Phi's qk_layernorm) with interleaved pairs in the rotated half: the
    # LayerNorms' weights and biases permuted with the q/k rows
    "qk-layernorm-interleaved": _tiny(
        **{
            "attention.qk_norm": True,
            "attention.qk_norm_kind": "layernorm",
            "attention.qk_norm_bias": True,
            "position.rope_layout": "interleaved",
            "norm.eps": 0.05,
        }
    ),
    # whole heads rotated, heads of their own width
    "full-rotation-head-dim": _tiny(
        **{"position.rope_fraction": 1.0, "attention.head_dim": 8, "attention.n_heads": 6}
    ),
}


@pytest.mark.parametrize("name", list(EXPORTS))
def test_export_round_trip(name, tmp_path):
    cfg = EXPORTS[name]
    torch.manual_seed(20)
    model = DecoderLM(cfg).eval()
    HF.randomize(model, seed=len(name))
    assert hf_model_type(cfg) == "phi"
    save_hf(model, tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    assert ("lm_head.weight" in stored) == (not cfg.tie_embeddings)
    assert torch.equal(stored["lm_head.bias"], model.lm_head.bias)

    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert type(ref).__name__ == "PhiForCausalLM"
    assert ref.model.layers[0].self_attn.rotary_ndims == cfg.rope_dim
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
        assert all(torch.equal(v, mine[k]) for k, v in back.state_dict().items())
        assert torch.equal(again, ours)
    else:  # the rotated pairs permuted: q . k in another order
        assert (again - ours)[mask.bool()].abs().max() <= TOL
    save_hf(back, tmp_path / "again")  # export(import(export(x))) writes the same tensors
    twice = load_file(tmp_path / "again" / "model.safetensors")
    assert twice.keys() == stored.keys()
    assert all(torch.equal(twice[k], stored[k]) for k in stored)


def test_missing_biases_are_written_as_zeros_and_read_back_as_such(tmp_path):
    """Phi's projections, LayerNorms and head always have biases: a model without some
    exports them as zeros (the same logits) and imports with them."""
    cfg = _tiny(
        **{
            "ffn.bias": False,
            "norm.bias": False,
            "attention.qkv_bias": False,
            "final_logits_bias": False,
        }
    )
    torch.manual_seed(3)
    model = DecoderLM(cfg).eval()
    assert hf_model_type(cfg) == "phi"
    save_hf(model, tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    for name in (
        "lm_head.bias",
        "model.layers.1.mlp.fc2.bias",
        "model.layers.1.self_attn.k_proj.bias",
    ):
        assert not stored[name].any()
    back = load_hf(tmp_path)
    assert back.cfg.final_logits_bias and back.cfg.ffn.bias and back.cfg.attention.qkv_bias
    idx = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(back(idx).logits, model(idx).logits, atol=0, rtol=0)


# --------------------------------------------------------------------------- the head's bias


@pytest.mark.parametrize("tied", [False, True])
def test_head_bias_in_training_and_cached_decoding(tied):
    """final_logits_bias adds the head's own bias to every logit (tied weight or not): the
    logits are those of the model without it plus the bias, the bias learns, and cached
    decoding (dynamic and static cache) equals the full pass."""
    cfg = _tiny(tie_embeddings=tied)
    torch.manual_seed(0)
    model = DecoderLM(cfg).eval()
    assert model.lm_head.bias is not None and model.lm_head.bias.shape == (V,)
    assert ("lm_head.bias" in model.tied_parameters()) is False
    with torch.no_grad():
        model.lm_head.bias.normal_()
    plain = DecoderLM(cfg.override({"final_logits_bias": False})).eval()
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if k != "lm_head.bias"})
    idx = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(idx).logits
        torch.testing.assert_close(full, plain(idx).logits + model.lm_head.bias, atol=1e-6, rtol=0)
        for static in (False, True):
            cache = model.new_cache(2, 16, static=static)
            steps = [model(idx[:, :5], cache=cache).logits]
            steps += [model(idx[:, j : j + 1], cache=cache).logits for j in range(5, 9)]
            torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
    model.train()
    loss = model(idx, targets=idx.roll(-1, 1)).loss
    loss.backward()
    assert model.lm_head.bias.grad.abs().sum() > 0


def test_head_bias_is_refused_where_it_is_not_implemented():
    from attnlab.models.encoder import EncoderConfig

    only = "final_logits_bias: is implemented by the decoder and seq2seq architectures only"
    with pytest.raises(ConfigError, match=re.escape(only)):
        EncoderConfig(final_logits_bias=True).validate()
    with pytest.raises(ConfigError, match="masked-LM head has decoder_bias"):
        EncoderConfig(final_logits_bias=True).validate()
    with pytest.raises(ConfigError, match="final_logits_bias"):
        build_model(get_preset("xl-tiny").override({"final_logits_bias": True}))


@pytest.mark.parametrize(
    "preset, model_type",
    [("llama-tiny", "llama"), ("gpt2-tiny", "gpt2"), ("pythia-tiny", "gpt_neox"),
     ("starcoder2-tiny", "starcoder2"), ("phi3-tiny", "phi3")],
)  # fmt: skip
def test_other_families_refuse_a_head_bias_by_name(preset, model_type, tmp_path):
    cfg = get_preset(preset).override({"final_logits_bias": True})
    with pytest.raises(HFCheckpointError, match=re.escape(
        f"final_logits_bias ({model_type}'s head has no bias; a biased head exports as phi"
    )):  # fmt: skip
        save_hf(build_model(cfg), tmp_path)
    assert not (tmp_path / "config.json").exists()


# --------------------------------------------------------------------------- presets


# --------------------------------------------------------------------------- refusals


def _hf_dict(case: str = "phi2-like") -> dict:
    return {"model_type": "phi", "vocab_size": V, **CASES[case]}


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"qk_layernorm": True, "head_dim": 8},
         "qk_layernorm=true with head_dim=8: transformers' Phi sizes its query and key "
         "LayerNorms hidden_size / num_attention_heads = 16 wide"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "RoPE scaling 'dynamic'"),
        ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.2}},
         "rotates int(16 * 0.2) = 3 features of each head; RoPE rotates pairs"),
        ({"hidden_act": "gelu_fast"}, "hidden_act='gelu_fast'"),
    ],
    ids=["qk-layernorm", "rope-type", "odd-rotation", "activation"],
)  # fmt: skip
def test_config_it_cannot_hold_is_refused_by_name(changes, named):
    hf = {**_hf_dict(), **changes}
    with pytest.raises(HFCheckpointError, match=re.escape(named)):
        config_from_hf(hf)


def test_rope_keys_are_read_as_transformers_reads_them():
    """The RoPE parameters' own theta and fraction win; else the top-level rope_theta and
    partial_rotary_factor (transformers 4.x); else 10000 and 0.5 (PhiConfig's)."""
    base = {k: v for k, v in _hf_dict().items() if k != "rope_parameters"}
    for extra in (
        {},
        {"partial_rotary_factor": 0.75, "rope_theta": 40.0},
        {
            "rope_parameters": {"rope_type": "default", "rope_theta": 30.0},
            "partial_rotary_factor": 1.0,
        },
        {
            "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.25},
            "rope_theta": 70.0,
        },
    ):
        hf = {**base, **extra}
        theirs = transformers.AutoConfig.for_model(**hf).rope_parameters
        ours = config_from_hf(hf).position
        assert (ours.rope_theta, ours.rope_fraction) == (
            theirs["rope_theta"], theirs["partial_rotary_factor"]
        ), extra  # fmt: skip


def test_dropouts_read_as_one_with_a_warning_where_they_differ():
    """resid_pdrop is attnlab's dropout; an embd_pdrop that differs (Phi-2's 0.0 against
    0.1) changes training only: a warning, not a refusal."""
    assert config_from_hf({**_hf_dict(), "resid_pdrop": 0.1, "embd_pdrop": 0.1}).dropout == 0.1
    with pytest.warns(UserWarning, match=re.escape("embd_pdrop=0.0 differs from resid_pdrop=0.1")):
        cfg = config_from_hf({**_hf_dict(), "resid_pdrop": 0.1, "embd_pdrop": 0.0})
    assert cfg.dropout == 0.1


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"position.rope_scaling": "yarn"}, "position.rope_scaling='yarn' (phi: none or linear)"),
        ({"attention.sliding_window": 8}, "attention.sliding_window (phi attends to"),
        (
            {"attention.qk_norm": True},
            "attention.qk_norm_kind='rmsnorm' (phi's QK-norm has 'layernorm'; this QK-norm "
            "exports as qwen3 or qwen3_moe or gemma3_text)",
        ),
        (
            {
                "attention.qk_norm": True,
                "attention.qk_norm_kind": "layernorm",
                "attention.qk_norm_weight": "per_head",
            },
            "attention.qk_norm_weight='per_head' (phi's QK-norm has 'shared'; this QK-norm "
            "exports as cohere or stablelm)",
        ),
        (
            {
                "attention.qk_norm": True,
                "attention.qk_norm_kind": "layernorm",
                "attention.head_dim": 8,
                "attention.n_heads": 6,
            },
            "attention.head_dim=8 with attention.qk_norm (transformers' Phi sizes its QK "
            "LayerNorms d_model / n_heads = 10 wide)",
        ),
        ({"norm.kind": "rmsnorm"}, "norm.placement='parallel_shared' (Phi's, GPT-J's, Falcon's"),
        # a gated feed-forward on biased LayerNorms is StableLM's, whose o_proj has no bias
        ({"ffn.kind": "glu"}, "attention.out_bias=true (StableLM's o_proj has no bias"),
    ],
    ids=["yarn", "window", "qk-norm", "qk-norm-per-head", "qk-norm-head-dim", "rmsnorm", "glu"],
)
def test_export_refuses_what_phi_cannot_hold(changes, named, tmp_path):
    cfg = _tiny(**changes)
    with pytest.raises(HFCheckpointError, match=re.escape(named)):
        save_hf(DecoderLM(cfg), tmp_path)
    assert not (tmp_path / "config.json").exists()


@pytest.mark.parametrize(
    "preset, changes, model_type",
    [
        ("phi-tiny", {}, "phi"),
        ("phi-tiny", {"final_logits_bias": False}, "phi"),  # a partial rotation
        # whole heads rotated, no head bias: Falcon-7B's block
        ("phi-tiny", {"final_logits_bias": False, "position.rope_fraction": 1.0}, "falcon"),
        ("pythia-tiny", {"norm.placement": "parallel_shared"}, "phi"),
        ("falcon-tiny", {"position.rope_fraction": 0.5}, "phi"),
        ("falcon-tiny", {"final_logits_bias": True}, "phi"),
        ("pythia-tiny", {}, "gpt_neox"),
        ("starcoder2-tiny", {}, "starcoder2"),
        ("llama-tiny", {}, "llama"),
        ("gpt2-tiny", {}, "gpt2"),
    ],
)
def test_export_picks_phi_only_for_its_blocks(preset, changes, model_type):
    """Parallel blocks with one shared norm are Phi's, whatever else; the other layouts keep
    their model types."""
    assert hf_model_type(get_preset(preset).override(changes)) == model_type
