"""Gemma 3 (text) checkpoints: transformers models from tiny random configs (local and global
layers in a pattern of their own and in transformers' default 5 : 1, windows shorter than
the inputs, linear RoPE scaling on the global layers and another base on the local ones,
query_pre_attn_scalar != head_dim, GQA and MQA, attention biases on and off, tied and untied
heads) with every norm weight set to random values (transformers starts them at zero, the
identity), loaded with ``load_hf``, give the same logits (with and without left padding),
the same greedy tokens past the window (one prompt and a ragged batch) and the same loss
and gradients; attnlab models saved with ``save_hf`` load in transformers with the same
logits and load back into attnlab exactly; configs neither side can hold are refused by
name; Gemma 2's final logit soft-capping, which transformers' Gemma 3 applies when set,
is read too (its attention cap, which it never applies, is refused). (The command line:
tests/test_interop_cli.py.)

Shapes: b batch, t length, V vocabulary, d d_model.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hf_cases import HFCases, transformers
from oracle import (
    assert_greedy_tokens_match_hf,
    assert_left_padded_logits_match_hf,
    assert_logits_match_hf,
    hf_logits,
)
from safetensors.torch import load_file

from attnlab.interop import HFCheckpointError, config_from_hf, hf_model_type, load_hf, save_hf
from attnlab.models.decoder import DecoderLM
from attnlab.presets import get_preset

V = 97
TOL = 2e-5  # float32: observed up to 7e-6 on logits up to ~17 (op order)
CASES = {
    # a pattern of its own (local, local, global, local, global), a window of 5, GQA 4/2,
    # head_dim 12 != d / h and a softmax scale of 20**-0.5, linear RoPE x8 on the global
    # layers and base 50 (not 1000) on the local ones, tied head (Gemma's)
    "pattern-linear-gqa": dict(
        hidden_size=32,
        intermediate_size=48,
        head_dim=12,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
        query_pre_attn_scalar=20,
        sliding_window=5,
        layer_types=[
            "sliding_attention",
            "sliding_attention",
            "full_attention",
            "sliding_attention",
            "full_attention",
        ],  # fmt: skip
        max_position_embeddings=128,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
        },
    ),
    # transformers 4.x's keys (rope_theta, rope_local_base_freq, rope_scaling) and
    # transformers' default pattern: every 6th layer global (7 layers: 6th global, 7th
    # local); MQA, attention biases, an untied head, head_dim d / h, plain RoPE; Gemma 2's
    # final logit soft-capping, which Gemma3ForCausalLM applies when set (a cap low enough
    # to bend these logits)
    "default-pattern-mqa-biased": dict(
        hidden_size=32,
        intermediate_size=40,
        head_dim=8,
        num_hidden_layers=7,
        num_attention_heads=4,
        num_key_value_heads=1,
        query_pre_attn_scalar=8,
        sliding_window=4,
        max_position_embeddings=64,
        rope_theta=300.0,
        rope_local_base_freq=30.0,
        attention_bias=True,
        tie_word_embeddings=False,
        final_logit_softcapping=8.0,
    ),
}


# Norms' offsets in [-0.5, 0.5) (weights 1 + w), biases (zero at init) random.
HF = HFCases("Gemma3TextConfig", "Gemma3ForCausalLM", CASES, V, norms=(-0.5, 0.5))
imported = HF.imported_fixture()


def test_import_config(imported):
    case, ref, model = imported
    cfg, hf = model.cfg, ref.config
    att, pos = cfg.attention, cfg.position
    assert model.num_parameters() == ref.num_parameters()
    assert config_from_hf(hf.to_dict()) == cfg  # the in-memory config, not only config.json
    windows = [att.window_of(i) for i in range(cfg.n_layers)]
    assert windows == [hf.sliding_window if t == "sliding_attention" else None
                       for t in hf.layer_types]  # fmt: skip
    assert (cfg.norm.kind, cfg.norm.placement, cfg.scale_embeddings) == (
        "gemma_rmsnorm",
        "sandwich",
        True,
    )
    assert att.qk_norm and att.qkv_bias == att.out_bias == hf.attention_bias
    rope = hf.rope_parameters
    assert pos.rope_theta == rope["full_attention"]["rope_theta"]
    assert pos.local_rope_theta == rope["sliding_attention"]["rope_theta"]
    if case == "pattern-linear-gqa":
        assert att.layer_pattern == "LLGLG"
        assert att.scale == 20**-0.5 and (pos.rope_scaling, pos.rope_factor) == ("linear", 8.0)
    else:
        assert att.layer_pattern == "LLLLLG" and att.scale is None  # the scalar is head_dim
        assert (pos.rope_theta, pos.local_rope_theta, pos.rope_scaling) == (300.0, 30.0, None)
    assert cfg.tie_embeddings == hf.tie_word_embeddings
    assert att.softcap is None and att.backend == "sdpa"
    assert cfg.final_logit_softcap == hf.final_logit_softcapping
    # the norms' offsets are loaded as stored (not 1 + w): attnlab adds the one
    layer = ref.model.layers[1]
    assert torch.equal(model.blocks[1].attn_post_norm.weight, layer.post_attention_layernorm.weight)
    assert torch.equal(model.blocks[1].ffn_norm.weight, layer.pre_feedforward_layernorm.weight)
    assert torch.equal(model.blocks[1].attn.k_norm.weight, layer.self_attn.k_norm.weight)


def test_import_logits(imported):
    case, ref, model = imported
    assert_logits_match_hf(ref, model, V, TOL)


def test_import_logits_left_padding(imported):
    case, ref, model = imported
    assert_left_padded_logits_match_hf(ref, model, V, TOL)


def test_import_greedy_generation(imported):
    """Past the window: the local layers' rolling caches and both RoPE tables against
    transformers' cache."""
    case, ref, model = imported
    assert_greedy_tokens_match_hf(ref, model, V)


def test_training_gradients_match_transformers(imported):
    """A loss backward in training mode: the loss and the gradients of every norm (the
    four per layer, QK-norm, the final one), the projections and the embedding are
    transformers'."""
    case, ref, model = imported
    ref, model = ref.train(), model.train()
    idx = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(4))
    ours = model(idx[:, :-1], targets=idx[:, 1:]).loss
    theirs = F.cross_entropy(ref(idx[:, :-1]).logits.flatten(0, 1), idx[:, 1:].flatten())
    ours.backward()
    theirs.backward()
    try:
        assert abs(ours.item() - theirs.item()) <= 1e-5
        block, layer = model.blocks[2], ref.model.layers[2]
        q_dim = ref.config.num_attention_heads * ref.config.head_dim
        pairs = [
            (block.attn_norm.weight.grad, layer.input_layernorm.weight.grad),
            (block.attn_post_norm.weight.grad, layer.post_attention_layernorm.weight.grad),
            (block.ffn_norm.weight.grad, layer.pre_feedforward_layernorm.weight.grad),
            (block.ffn_post_norm.weight.grad, layer.post_feedforward_layernorm.weight.grad),
            (block.attn.q_norm.weight.grad, layer.self_attn.q_norm.weight.grad),
            (block.attn.k_norm.weight.grad, layer.self_attn.k_norm.weight.grad),
            (block.attn.qkv.weight.grad[:q_dim], layer.self_attn.q_proj.weight.grad),
            (block.ffn.down.weight.grad, layer.mlp.down_proj.weight.grad),
            (model.norm.weight.grad, ref.model.norm.weight.grad),
            (model.tok_emb.weight.grad, ref.model.embed_tokens.weight.grad),
        ]
        for got, want in pairs:
            # float32 sums over the batch in different orders: 1e-4
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    finally:
        ref.eval().zero_grad()
        model.eval().zero_grad()


# --------------------------------------------------------------------------- export


def _tiny(**changes):
    return get_preset("gemma3-tiny").override({"vocab_size": V, **changes})


EXPORTS = {
    "gemma3-tiny": _tiny(),
    # interleaved RoPE pairs (q/k rows and QK-norm weights permuted to the split halves),
    # attention biases on q/k/v only (o's written as zeros), untied, the default scale,
    # every layer local with the local base, final logits soft-capped
    "interleaved-biased-local": _tiny(
        **{
            "final_logit_softcap": 10.0,
            "position.rope_layout": "interleaved",
            "attention.qkv_bias": True,
            "tie_embeddings": False,
            "attention.scale": None,
            "attention.layer_pattern": None,
            "position.rope_scaling": None,
        }
    ),
    # global layers only (transformers still needs a window: written, used by no layer),
    # one RoPE, another activation, MHA
    "global-only": _tiny(
        **{
            "attention.layer_pattern": None,
            "attention.sliding_window": None,
            "position.local_rope_theta": None,
            "ffn.activation": "silu",
            "attention.n_kv_heads": None,
            "n_layers": 3,
        }
    ),
}


@pytest.mark.parametrize("name", list(EXPORTS))
def test_export_round_trip(name, tmp_path):
    cfg = EXPORTS[name]
    torch.manual_seed(20)
    model = DecoderLM(cfg).eval()
    HF.randomize(model, seed=len(name))
    assert hf_model_type(cfg) == "gemma3_text"
    save_hf(model, tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    assert ("lm_head.weight" in stored) == (not cfg.tie_embeddings)

    idx = torch.randint(0, V, (2, 40), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(idx)
    mask[1, :7] = 0
    with torch.no_grad():
        ours = model(idx, attention_mask=mask).logits
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert type(ref).__name__ == "Gemma3ForCausalLM"
    theirs = hf_logits(ref.eval(), idx, mask)
    real = mask.bool()
    assert ours.abs().max() > 1.0
    assert (ours[real] - theirs[real]).abs().max() <= TOL

    back = load_hf(tmp_path)  # import(export(x)): the same model, the same numbers
    assert back.cfg.position.rope_layout == "split"
    if cfg.position.rope_layout == "split":
        biases = cfg.attention.qkv_bias or cfg.attention.out_bias
        want_cfg = cfg.override({"attention.out_bias": biases})
        if cfg.attention.sliding_window is None:  # (written for transformers, read back)
            want_cfg = want_cfg.override({"attention.sliding_window": None})
        assert back.cfg == want_cfg
        mine = model.state_dict()
        for key, value in back.state_dict().items():
            want = mine.get(key, torch.zeros_like(value))  # biases it had not: zeros
            assert torch.equal(value, want), key
    with torch.no_grad():
        again = back(idx, attention_mask=mask).logits
    tol = 0.0 if cfg.position.rope_layout == "split" else TOL  # (q . k in another order)
    assert (again - ours)[real].abs().max() <= tol
    save_hf(back, tmp_path / "again")  # export(import(export(x))) writes the same tensors
    twice = load_file(tmp_path / "again" / "model.safetensors")
    assert twice.keys() == stored.keys()
    assert all(torch.equal(twice[k], stored[k]) for k in stored)


def test_bfloat16_norms_are_transformers_bit_for_bit(tmp_path):
    """A bf16 model: the norms scale by 1 + w formed in float32 (a weight mapped to 1 + w
    and stored in bf16 would round it, and lose small w's low bits), as transformers'
    Gemma3RMSNorm, and the embedding scale sqrt(d) is rounded to bf16 as there; the
    weights round-trip exactly."""
    ref = HF.model("pattern-linear-gqa", seed=9).to(torch.bfloat16)
    with torch.no_grad():  # offsets whose 1 + w bf16 cannot hold
        ref.model.layers[0].input_layernorm.weight.copy_(torch.full((32,), 3e-3))
    ref.save_pretrained(tmp_path)
    model = load_hf(tmp_path, dtype=torch.bfloat16)
    norm, theirs_norm = model.blocks[0].attn_norm, ref.model.layers[0].input_layernorm
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(norm(x), theirs_norm(x))
        ids = torch.randint(0, V, (1, 6), generator=torch.Generator().manual_seed(7))
        ours = model.tok_emb(ids) * torch.tensor(32**0.5, dtype=torch.bfloat16)
        assert torch.equal(ours, ref.model.embed_tokens(ids))
    assert torch.equal(norm.weight, theirs_norm.weight)


# --------------------------------------------------------------------------- refusals


def _hf_dict(case: str = "pattern-linear-gqa") -> dict:
    return HF.config(case).to_dict()


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"final_logit_softcapping": 0.0},
         "final_logit_softcapping must be a positive number or null, got 0.0"),
        ({"attn_logit_softcapping": 50.0},  # transformers' Gemma 3 keeps it, never applies it
         "attn_logit_softcapping=50.0 is not supported for gemma3_text"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
        ({"layer_types": ["chunked_attention"] * 5}, "layer_types"),
        ({"rope_parameters": {"full_attention": {"rope_type": "dynamic", "factor": 2.0},
                              "sliding_attention": {"rope_type": "default"}}},
         "RoPE scaling 'dynamic'"),
        ({"rope_parameters": {"full_attention": {"rope_type": "default"},
                              "sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
         "sliding_attention layers"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
         "rope_parameters must map"),
        ({"hidden_activation": "gelu_fast"}, "hidden_activation='gelu_fast'"),
        ({"model_type": "gemma3"}, "model_type 'gemma3' is not supported"),
    ],
    ids=["final-softcap", "attn-softcap", "bidirectional", "layer-kind", "rope", "local-rope",
         "flat-rope", "activation", "vision"],
)  # fmt: skip
def test_config_it_cannot_hold_is_refused_by_name(changes, named):
    with pytest.raises(HFCheckpointError, match=named.replace("(", r"\(").replace(")", r"\)")):
        config_from_hf({**_hf_dict(), **changes})


def test_minimal_config_is_read_as_transformers_fills_it():
    """Without layer_types every sliding_window_pattern-th layer is global (6 by default);
    without RoPE parameters the bases are 1e6 (global) and 1e4 (local)."""
    given = {"model_type": "gemma3_text", "hidden_size": 32, "num_attention_heads": 4,
             "num_hidden_layers": 4, "vocab_size": V, "intermediate_size": 16,
             "head_dim": 8}  # fmt: skip
    bases = {"rope_theta": 1e4, "rope_local_base_freq": 5.0}
    for extra in ({}, {"sliding_window_pattern": 2}, bases):
        hf = transformers.AutoConfig.for_model(**given, **extra).to_dict()
        assert config_from_hf({**given, **extra}) == config_from_hf(hf)
    cfg = config_from_hf(given)
    assert cfg.attention.layer_pattern is None and cfg.attention.sliding_window == 4096
    assert (cfg.position.rope_theta, cfg.position.local_rope_theta) == (1e6, 1e4)
    assert config_from_hf({**given, "sliding_window_pattern": 2}).attention.layer_pattern == "LG"


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"norm.placement": "pre"}, "norm.placement='pre' (Gemma 3's is 'sandwich')"),
        ({"norm.kind": "rmsnorm"}, "norm.kind='rmsnorm' (Gemma 3's is 'gemma_rmsnorm')"),
        ({"scale_embeddings": False}, "scale_embeddings=False"),
        ({"attention.qk_norm": False}, "attention.qk_norm=False"),
        ({"ffn.bias": True}, "ffn.bias=True"),
        ({"ffn.kind": "mlp"}, "ffn.kind='mlp'"),
        ({"attention.scale": 0.3}, "attention.scale=0.3"),
        ({"position.rope_scaling": "yarn"}, "position.rope_scaling='yarn'"),
        ({"position.local_rope_theta": None}, "position.local_rope_theta=None with rope_scaling"),
        ({"attention.sink_logits": True}, "attention.sink_logits (gemma3_text has none"),
        ({"attention.softcap": 20.0, "attention.backend": "flash"},
         "attention.softcap=20.0 (transformers' Gemma 3 never caps"),
    ],
)  # fmt: skip
def test_export_refuses_what_gemma3_cannot_hold(changes, named, tmp_path):
    cfg = _tiny(**changes)
    with pytest.raises(HFCheckpointError, match=named.replace("(", r"\(").replace(")", r"\)")):
        save_hf(DecoderLM(cfg), tmp_path)
    assert not (tmp_path / "config.json").exists()


@pytest.mark.parametrize(
    "changes, piece",
    [
        ({"scale_embeddings": True}, "scale_embeddings"),
        ({"norm.placement": "sandwich"}, "norm.placement='sandwich'"),
        ({"norm.kind": "gemma_rmsnorm"}, "norm.kind='gemma_rmsnorm'"),
        ({"attention.scale": 0.25}, "attention.scale"),
        ({"position.local_rope_theta": 100.0, "attention.sliding_window": 8},
         "position.local_rope_theta"),
    ],
)  # fmt: skip
def test_gemma_pieces_in_other_layouts_are_refused(changes, piece):
    """A LLaMA or GPT-2 config with one of Gemma's pieces: no layout but Gemma's holds
    it (none drops it silently), and the refusal names it and what else the Gemma model
    type it would be (gemma3_text with a second RoPE base, else gemma) lacks."""
    for base in ("llama-tiny", "gpt2-tiny"):
        if base == "gpt2-tiny" and piece == "position.local_rope_theta":
            continue  # (RoPE only: refused by the config itself)
        cfg = get_preset(base).override(changes)
        if base == "llama-tiny" and piece == "attention.scale":
            # Granite's attention_multiplier is a softmax scale of its own
            assert hf_model_type(cfg) == "granite"
            continue
        with pytest.raises(HFCheckpointError, match="Gemma( 2| 3)?'s is") as e:
            hf_model_type(cfg)
        assert f"{piece} exports as gemma, gemma2 or gemma3_text only" in str(e.value)


def test_families_other_than_gemma_refuse_its_pieces(monkeypatch):
    """convert's own check, should another family take such a config: each names the
    piece it has not (the Gemma family left out of the registry here)."""
    from attnlab.interop import convert

    others = tuple(f for f in convert.FAMILIES if f.name != "gemma")
    monkeypatch.setattr(convert, "FAMILIES", others)
    for base, changes, piece in (
        ("llama-tiny", {"scale_embeddings": True}, "scale_embeddings"),
        # (a LLaMA-shaped one with a softmax scale is Granite's: GPT-2's layout has none)
        ("gpt2-tiny", {"attention.scale": 0.25}, "attention.scale"),
        ("llama-tiny", {"norm.placement": "sandwich"}, "norm.placement='sandwich'"),
        ("llama-tiny", {"attention.softcap": 20.0, "attention.backend": "flash"},
         "attention.softcap"),
        ("llama-tiny", {"final_logit_softcap": 20.0}, "final_logit_softcap"),
    ):  # fmt: skip
        cfg = get_preset(base).override(changes)
        with pytest.raises(HFCheckpointError, match=rf"{piece} \(((llama|gpt2) has none|Gemma's)"):
            hf_model_type(cfg)


@pytest.mark.parametrize("model_type", ["bert", "marian", "vit"])
def test_other_architectures_refuse_the_softmax_scale(model_type):
    """attention.scale on an encoder, encoder-decoder or ViT (multi-head attention all):
    their layouts have no such setting, so export names it rather than drop it; Marian's
    scaled embeddings stay its own."""
    from test_interop_defaults import MINIMAL

    cfg = config_from_hf({"model_type": model_type, **MINIMAL[model_type][0]})
    assert hf_model_type(cfg) == model_type
    with pytest.raises(HFCheckpointError, match=rf"attention.scale \({model_type} has none"):
        hf_model_type(cfg.override({"attention.scale": 0.3}))
