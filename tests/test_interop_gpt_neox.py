"""GPT-NeoX / Pythia checkpoints: transformers models from tiny random configs (parallel
blocks with a partial rotation and 3 heads; sequential blocks with transformers 4.x's RoPE
keys, linear scaling and a tied head; no attention biases and whole heads rotated) with
every weight set to random values, loaded with ``load_hf``, give the same logits (with
left padding), loss and gradients, and the same greedy tokens; attnlab models saved with
``save_hf`` load in transformers with the same logits and load back exactly; what neither
side can hold is refused by name.

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
TOL = 1e-5  # float32 logits up to ~15 (weights of std 0.3): observed up to 7e-6
CASES = {
    # Pythia's block: parallel, 3 heads of 16 (half of each rotated: 4 pairs), base 100
    "parallel-partial": dict(
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=3,
        max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 100.0, "partial_rotary_factor": 0.5},
    ),
    # sequential pre-norm blocks, transformers 4.x's keys (a quarter of heads of 16: 2
    # pairs), linear scaling x2, a tied head, the tanh GELU
    "sequential-linear-tied": dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        use_parallel_residual=False,
        rotary_pct=0.25,
        rotary_emb_base=50.0,
        rope_scaling={"type": "linear", "factor": 2.0},
        tie_word_embeddings=True,
        hidden_act="gelu_new",
    ),
    # no biases on query_key_value and dense, whole heads rotated, 2 heads of 16
    "no-attention-bias": dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        max_position_embeddings=64,
        attention_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": 300.0, "partial_rotary_factor": 1.0},
    ),
}


def _is_norm_weight(name: str, p: torch.Tensor) -> bool:
    return "norm" in name and name.endswith("weight")


# LayerNorm weights in [0.5, 1.5), every other parameter (their biases too) random.
HF = HFCases(
    "GPTNeoXConfig", "GPTNeoXForCausalLM", CASES, V, norms=(0.5, 1.5), is_norm=_is_norm_weight
)
imported = HF.imported_fixture()


def test_import_config_and_fused_qkv_layout(imported):
    """The config as transformers reads it; query_key_value's rows are (h, 3, d_h), each
    head's q, k and v together: attnlab's [q; k; v] holds head j's query at rows
    j d_h ... (j + 1) d_h of its first third."""
    case, ref, model = imported
    cfg, hf = model.cfg, ref.config
    assert model.num_parameters() == ref.num_parameters()
    assert config_from_hf(hf.to_dict()) == cfg  # the in-memory config, not only config.json
    params = hf.rope_parameters
    assert cfg.position.rope_theta == params["rope_theta"]
    assert cfg.position.rope_fraction == params["partial_rotary_factor"]
    assert cfg.position.rope_scaling == (None if case != "sequential-linear-tied" else "linear")
    assert cfg.norm.placement == ("parallel" if hf.use_parallel_residual else "pre")
    assert cfg.attention.qkv_bias == cfg.attention.out_bias == hf.attention_bias
    assert cfg.tie_embeddings == hf.tie_word_embeddings
    h, d_h, d = cfg.n_heads, cfg.head_dim, cfg.d_model
    theirs = ref.gpt_neox.layers[1].attention.query_key_value
    ours = model.blocks[1].attn.qkv
    for j in range(h):
        for part in range(3):  # q, k, v
            stored = theirs.weight[(3 * j + part) * d_h : (3 * j + part + 1) * d_h]
            assert torch.equal(ours.weight[part * d + j * d_h : part * d + (j + 1) * d_h], stored)
            if hf.attention_bias:
                stored = theirs.bias[(3 * j + part) * d_h : (3 * j + part + 1) * d_h]
                assert torch.equal(ours.bias[part * d + j * d_h : part * d + (j + 1) * d_h], stored)


def test_import_logits(imported):
    case, ref, model = imported
    assert_logits_match_hf(ref, model, V, TOL)
    assert_left_padded_logits_match_hf(ref, model, V, TOL)


def test_import_greedy_generation(imported):
    case, ref, model = imported
    assert_greedy_tokens_match_hf(ref, model, V, n=10)


def test_training_loss_and_gradients_match_transformers(imported):
    """A loss backward in training mode over a left-padded batch: the loss and the
    gradients of the fused q/k/v projection (rows in attnlab's order), the norms, the MLP
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
        block, layer = model.blocks[1], ref.gpt_neox.layers[1]
        h = model.cfg.n_heads
        qkv_grad = layer.attention.query_key_value.weight.grad  # (h, 3, d_h) rows
        in_our_order = qkv_grad.view(h, 3, -1, model.cfg.d_model).transpose(0, 1).flatten(0, 2)
        pairs = [
            (block.attn.qkv.weight.grad, in_our_order),
            (block.attn.out.weight.grad, layer.attention.dense.weight.grad),
            (block.attn_norm.weight.grad, layer.input_layernorm.weight.grad),
            (block.ffn_norm.bias.grad, layer.post_attention_layernorm.bias.grad),
            (block.ffn.up.weight.grad, layer.mlp.dense_h_to_4h.weight.grad),
            (block.ffn.down.bias.grad, layer.mlp.dense_4h_to_h.bias.grad),
            (model.norm.weight.grad, ref.gpt_neox.final_layer_norm.weight.grad),
            (model.tok_emb.weight.grad, ref.gpt_neox.embed_in.weight.grad),
        ]
        for got, want in pairs:
            # float32 sums over the batch in different orders: 1e-4
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    finally:
        ref.eval().zero_grad()
        model.eval().zero_grad()


# --------------------------------------------------------------------------- export


def _tiny(**changes):
    return get_preset("pythia-tiny").override({"vocab_size": V, **changes})


EXPORTS = {
    "pythia-tiny": _tiny(),
    # sequential blocks, interleaved RoPE pairs in the rotated half (q/k rows permuted to
    # rotate-half there only), linear scaling, a tied head, the tanh GELU
    "sequential-interleaved-tied": _tiny(
        **{
            "norm.placement": "pre",
            "position.rope_layout": "interleaved",
            "position.rope_fraction": 0.5,
            "position.rope_scaling": "linear",
            "position.rope_factor": 3.0,
            "tie_embeddings": True,
            "ffn.activation": "gelu_tanh",
        }
    ),
    # no attention biases, whole heads rotated
    "no-attention-bias-full-rotation": _tiny(
        **{
            "attention.qkv_bias": False,
            "attention.out_bias": False,
            "position.rope_fraction": 1.0,
        }
    ),
}


@pytest.mark.parametrize("name", list(EXPORTS))
def test_export_round_trip(name, tmp_path):
    cfg = EXPORTS[name]
    torch.manual_seed(20)
    model = DecoderLM(cfg).eval()
    HF.randomize(model, seed=len(name))
    assert hf_model_type(cfg) == "gpt_neox"
    save_hf(model, tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    assert ("embed_out.weight" in stored) == (not cfg.tie_embeddings)
    assert ("gpt_neox.layers.0.attention.dense.bias" in stored) == cfg.attention.out_bias

    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert type(ref).__name__ == "GPTNeoXForCausalLM"
    assert ref.config.use_parallel_residual == (cfg.norm.placement == "parallel")
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
    """GPT-NeoX's MLP and LayerNorms always have biases, its attention both or none: a
    model without some exports them as zeros (the same logits) and imports with them."""
    cfg = _tiny(**{"ffn.bias": False, "norm.bias": False, "attention.out_bias": False})
    torch.manual_seed(3)
    model = DecoderLM(cfg).eval()
    save_hf(model, tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    assert not stored["gpt_neox.layers.1.mlp.dense_4h_to_h.bias"].any()
    assert not stored["gpt_neox.layers.1.attention.dense.bias"].any()
    back = load_hf(tmp_path)
    assert back.cfg.ffn.bias and back.cfg.norm.bias and back.cfg.attention.out_bias
    idx = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(back(idx).logits, model(idx).logits, atol=0, rtol=0)


# --------------------------------------------------------------------------- presets


# --------------------------------------------------------------------------- refusals


def _hf_dict(case: str = "parallel-partial") -> dict:
    return {"model_type": "gpt_neox", "vocab_size": V, **CASES[case]}


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "RoPE scaling 'dynamic'"),
        ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.2}},
         "rotates int(16 * 0.2) = 3 features of each head; RoPE rotates pairs"),
        ({"hidden_act": "gelu_fast"}, "hidden_act='gelu_fast'"),
        ({"num_attention_heads": 5}, "d_model=48 is not divisible by attention.n_heads=5"),
    ],
    ids=["rope-type", "odd-rotation", "activation", "heads"],
)  # fmt: skip
def test_config_it_cannot_hold_is_refused_by_name(changes, named):
    hf = {**_hf_dict(), **changes}
    with pytest.raises(HFCheckpointError, match=re.escape(named)):
        config_from_hf(hf)


def test_rope_keys_are_read_as_transformers_reads_them():
    """The RoPE parameters' own theta and fraction win; else rotary_emb_base and rotary_pct
    (transformers 4.x); else 10000 and 0.25; top-level rope_theta and
    partial_rotary_factor are ignored, as transformers ignores them."""
    base = {k: v for k, v in _hf_dict().items() if k != "rope_parameters"}
    for extra in (
        {},
        {"rotary_pct": 0.5, "rotary_emb_base": 40.0},
        {"rope_theta": 70.0, "partial_rotary_factor": 0.5},
        {"rope_parameters": {"rope_type": "default", "rope_theta": 30.0}, "rotary_pct": 1.0},
    ):
        hf = {**base, **extra}
        theirs = transformers.AutoConfig.for_model(**hf).rope_parameters
        ours = config_from_hf(hf).position
        assert (ours.rope_theta, ours.rope_fraction) == (
            theirs["rope_theta"], theirs["partial_rotary_factor"]
        ), extra  # fmt: skip
    # int(16 * 0.3) = 4 features rotated, as transformers' rotary_ndims
    odd = {**base, "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.3}}
    assert config_from_hf(odd).rope_dim == 4


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"attention.n_kv_heads": 2}, "attention.n_kv_heads=2 (GPT-NeoX has one key/value"),
        ({"attention.head_dim": 8}, "attention.head_dim=8 (GPT-NeoX's heads are"),
        ({"position.rope_scaling": "yarn"}, "position.rope_scaling='yarn' (gpt_neox: none or"),
        ({"attention.sliding_window": 8}, "attention.sliding_window (gpt_neox attends to"),
        ({"attention.qk_norm": True}, "attention.qk_norm (gpt_neox has no QK-norm"),
        ({"norm.kind": "rmsnorm"}, "norm.placement='parallel' (GPT-NeoX's: exports as gpt_neox"),
        ({"ffn.kind": "glu"}, "norm.placement='parallel' (GPT-NeoX's: exports as gpt_neox"),
    ],
    ids=["gqa", "head-dim", "yarn", "window", "qk-norm", "rmsnorm", "glu"],
)
def test_export_refuses_what_gpt_neox_cannot_hold(changes, named, tmp_path):
    cfg = _tiny(**changes)
    with pytest.raises(HFCheckpointError, match=re.escape(named)):
        save_hf(DecoderLM(cfg), tmp_path)
    assert not (tmp_path / "config.json").exists()


def test_other_layouts_keep_their_model_types():
    """GPT-NeoX takes only RoPE decoders with LayerNorm and an MLP: LLaMA- and GPT-2-shaped
    configs keep theirs, and a LayerNorm + MLP RoPE decoder in pre-norm blocks is gpt_neox."""
    assert hf_model_type(get_preset("llama-tiny")) == "llama"
    assert hf_model_type(get_preset("gpt2-tiny")) == "gpt2"
    assert hf_model_type(get_preset("phi3-tiny")) == "phi3"
    assert hf_model_type(_tiny(**{"norm.placement": "pre"})) == "gpt_neox"
