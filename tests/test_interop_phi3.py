"""Phi-3 checkpoints: transformers models from tiny random configs (LongRoPE with an
original context of 16, so that inputs run on both sides of it; plain RoPE with a window
and a tied head; a partial rotation with LongRoPE, an attention factor of its own and
transformers 4.x's keys; GQA, MQA and MHA) with every weight set to random values, loaded
with ``load_hf``, give the same logits (shorter and longer than the original context, with
left padding), the same loss and gradients, and the same greedy and beam-search tokens
while decoding runs past the original context (where transformers' generate, and
attnlab's, encode the sequence again with the long factors); attnlab models saved with
``save_hf`` load in transformers with the same logits and load back exactly; what neither
side can hold is refused by name. (LongRoPE's tables and the partial rotation against
transformers' own functions: tests/test_rope.py.)

Shapes: b batch, t length, V vocabulary.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from hf_cases import HFCases, transformers
from oracle import assert_greedy_tokens_match_hf, hf_logits
from safetensors.torch import load_file

from attnlab.cache import CacheError
from attnlab.interop import HFCheckpointError, config_from_hf, hf_model_type, load_hf, save_hf
from attnlab.models.decoder import DecoderLM
from attnlab.presets import get_preset

V = 97
ORIGINAL = 16  # the tiny configs' original_max_position_embeddings
TOL = 3e-5  # float32: observed up to 2e-5 on logits up to ~11 (sdpa against eager, op order)
CASES = {
    # LongRoPE x4 (64 from 16): factors of its own per pair (head_dim 8: 4 pairs), base 100
    # (turns enough within 16 positions), GQA 4/2, the default attention factor
    "longrope-gqa": dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        original_max_position_embeddings=ORIGINAL,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 100.0,
            "short_factor": [1.0, 1.1, 1.25, 1.5],
            "long_factor": [1.0, 1.9, 3.2, 4.0],
        },
    ),
    # plain RoPE, MHA, a window of 5 on every layer (Phi-3-mini-4k's kind), a tied head
    "plain-window-tied": dict(
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        sliding_window=5,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 300.0},
    ),
    # transformers 4.x's keys (rope_scaling with "type", rope_theta and partial_rotary_factor
    # at the top level): half of each head of 12 rotated (3 pairs), MQA, an attention
    # factor of its own, untied head
    "partial-longrope-mqa": dict(
        hidden_size=48,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=48,
        original_max_position_embeddings=ORIGINAL,
        partial_rotary_factor=0.5,
        rope_theta=50.0,
        rope_scaling={
            "type": "longrope",
            "short_factor": [1.0, 1.2, 1.6],
            "long_factor": [1.5, 2.5, 3.0],
            "attention_factor": 1.3,
        },
    ),
}


# Norm weights in [0.5, 1.5), every other parameter random.
HF = HFCases("Phi3Config", "Phi3ForCausalLM", CASES, V, norms=(0.5, 1.5))
imported = HF.imported_fixture()


def test_import_config(imported):
    case, ref, model = imported
    cfg, hf = model.cfg, ref.config
    pos, att = cfg.position, cfg.attention
    assert model.num_parameters() == ref.num_parameters()
    assert config_from_hf(hf.to_dict()) == cfg  # the in-memory config, not only config.json
    assert (cfg.max_seq_len, cfg.tie_embeddings) == (hf.max_position_embeddings,
                                                     hf.tie_word_embeddings)  # fmt: skip
    assert att.n_kv_heads in (None, hf.num_key_value_heads)
    assert att.sliding_window == hf.sliding_window
    assert not (att.qkv_bias or att.out_bias or cfg.ffn.bias)
    params = hf.rope_parameters
    assert pos.rope_theta == params["rope_theta"]
    assert pos.rope_fraction == params["partial_rotary_factor"]
    assert cfg.rope_dim == int(cfg.head_dim * params["partial_rotary_factor"])
    if case == "plain-window-tied":
        assert pos.rope_scaling is None
    else:
        assert pos.rope_scaling == "longrope"
        assert pos.rope_short_factor == params["short_factor"]
        assert pos.rope_long_factor == params["long_factor"]
        assert pos.rope_original_max_seq_len == ORIGINAL
        assert pos.rope_factor == hf.max_position_embeddings / ORIGINAL  # (no factor given)
        assert pos.rope_attention_factor == params.get("attention_factor")
    # q, k and v are one tensor in both: stored rows are attnlab's rows
    layer = ref.model.layers[1]
    assert torch.equal(model.blocks[1].attn.qkv.weight, layer.self_attn.qkv_proj.weight)
    assert torch.equal(model.blocks[1].ffn.gate_up.weight, layer.mlp.gate_up_proj.weight)


@pytest.mark.parametrize("t", [12, ORIGINAL, ORIGINAL + 1, 40])
def test_import_logits(imported, t):
    """Within the original context (short factors), at its end, one past it and far past
    it (long factors for every position)."""
    case, ref, model = imported
    idx = torch.randint(0, V, (3, t), generator=torch.Generator().manual_seed(t))
    with torch.no_grad():
        ours = model(idx).logits
    theirs = hf_logits(ref, idx)
    assert theirs.abs().max() > 1.0  # the comparison is not between near-zero logits
    assert (ours - theirs).abs().max() <= TOL


@pytest.mark.parametrize("pads", [(5, 0, 9), (6, 8, 5)], ids=["longest-unpadded", "all-padded"])
def test_import_logits_left_padding(imported, pads):
    """24 columns: with a row unpadded the longest row runs past the original context (long
    factors for the batch); with every row padded by 5 or more no position reaches it
    (short factors), as transformers picks them, by positions and not columns."""
    case, ref, model = imported
    g = torch.Generator().manual_seed(2)
    idx = torch.randint(0, V, (3, 24), generator=g)
    mask = torch.ones_like(idx)
    for row, n in enumerate(pads):
        mask[row, :n] = 0
    idx = idx.masked_fill(mask == 0, 0)
    with torch.no_grad():
        ours = model(idx, attention_mask=mask).logits
    theirs = hf_logits(ref, idx, mask)
    real = mask.bool()
    assert (ours[real] - theirs[real]).abs().max() <= TOL


def test_import_greedy_generation(imported):
    """Prompts of 7 (and 4 and 9, left padded) and 14 new tokens: decoding runs past the
    original context of 16, where both re-encode the sequence with the long factors."""
    case, ref, model = imported
    assert_greedy_tokens_match_hf(ref, model, V, n=14)


@pytest.mark.parametrize("imported", ["longrope-gqa", "partial-longrope-mqa"], indirect=True)
def test_the_long_factors_decide_the_tokens_past_the_switch(imported):
    """The greedy test above has teeth: with the long factors replaced by the short ones
    (no switch) the tokens past the original context are not transformers'."""
    case, ref, model = imported
    prompt = torch.randint(0, V, (1, 7), generator=torch.Generator().manual_seed(3))
    theirs = ref.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                          max_new_tokens=20, pad_token_id=0)[0, 7:].tolist()  # fmt: skip
    short = model.cfg.position.rope_short_factor
    no_switch = DecoderLM(model.cfg.override({"position.rope_long_factor": short})).eval()
    no_switch.load_state_dict(model.state_dict())
    assert model.generate(prompt[0].tolist(), 20) == theirs
    assert no_switch.generate(prompt[0].tolist(), 20) != theirs


@torch.no_grad()
def test_beam_search_across_the_switch_equals_transformers(imported):
    """Beam search (3 beams, left-padded prompts of 5 and 9) from within the original
    context to past it: every row's 3 best continuations are transformers'."""
    from attnlab.generation import beam_search

    case, ref, model = imported
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(1, V, (n,), generator=g).tolist() for n in (5, 9)]
    ids = torch.zeros(2, 9, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, 9 - len(p) :] = torch.tensor(p)
    out = ref.generate(
        ids, attention_mask=(ids != 0).long(), max_new_tokens=12, num_beams=3,
        num_return_sequences=3, early_stopping=True, do_sample=False, pad_token_id=0,
        output_scores=True, return_dict_in_generate=True,
    )  # fmt: skip
    hyps = beam_search(model, prompts, 12, num_beams=3, n_best=3)
    assert [h.tokens for row in hyps for h in row] == out.sequences[:, 9:].tolist()
    scores = [h.score for row in hyps for h in row]
    assert scores == pytest.approx(out.sequences_scores.tolist(), rel=1e-5, abs=1e-5)


def test_training_gradients_match_transformers(imported):
    """A loss backward in training mode over 24 tokens (past the original context): the
    loss and the gradients of the fused projections, norms and embedding are
    transformers'."""
    case, ref, model = imported
    ref, model = ref.train(), model.train()
    idx = torch.randint(0, V, (2, 25), generator=torch.Generator().manual_seed(4))
    ours = model(idx[:, :-1], targets=idx[:, 1:]).loss
    theirs = F.cross_entropy(ref(idx[:, :-1]).logits.flatten(0, 1), idx[:, 1:].flatten())
    ours.backward()
    theirs.backward()
    try:
        assert abs(ours.item() - theirs.item()) <= 1e-5
        block, layer = model.blocks[1], ref.model.layers[1]
        pairs = [
            (block.attn_norm.weight.grad, layer.input_layernorm.weight.grad),
            (block.ffn_norm.weight.grad, layer.post_attention_layernorm.weight.grad),
            (block.attn.qkv.weight.grad, layer.self_attn.qkv_proj.weight.grad),
            (block.attn.out.weight.grad, layer.self_attn.o_proj.weight.grad),
            (block.ffn.gate_up.weight.grad, layer.mlp.gate_up_proj.weight.grad),
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


# --------------------------------------------------------------------------- decoding


def _phi3_tiny(seed: int = 0, **changes) -> DecoderLM:
    torch.manual_seed(seed)
    model = DecoderLM(get_preset("phi3-tiny").override({"vocab_size": V, **changes})).eval()
    HF.randomize(model, seed)
    return model


@torch.no_grad()
def test_a_cached_pass_that_switches_factors_is_refused_and_a_fresh_one_is_exact():
    """A cache filled within the original context (32) holds keys rotated by the short
    factors: the step that reaches past it is refused (the full pass would rotate every
    key by the long ones), before the cache changes. A cache filled past it from the start
    decodes on exactly as full passes do."""
    model = _phi3_tiny()
    idx = torch.randint(0, V, (2, 40), generator=torch.Generator().manual_seed(6))
    cache = model.new_cache(2, 40)
    model(idx[:, :32], cache=cache)
    with pytest.raises(CacheError, match="LongRoPE switches to its long factors once a posit"):
        model(idx[:, 32:33], cache=cache)
    assert cache.length == 32
    full = model(idx).logits
    cache = model.new_cache(2, 40)
    steps = [model(idx[:, :34], cache=cache).logits]
    steps += [model(idx[:, i : i + 1], cache=cache).logits for i in range(34, 40)]
    # logits up to ~11 from weights of std 0.3: float32 rounding in another order gives
    # 3e-5 here (1e-5 with plain RoPE on the same weights)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=5e-5)


def test_decoding_across_the_switch_cached_uncached_and_compiled_agree():
    """Greedy decoding from a prompt of 20 to 50 tokens (the switch at 32): the cached
    eager loop (which encodes the 33 tokens again), the compiled step on a static cache
    (the same) and full passes without a cache give the same tokens, and those depend on
    the long factors."""
    model = _phi3_tiny(seed=3)
    prompt = torch.randint(0, V, (20,), generator=torch.Generator().manual_seed(7)).tolist()
    eager = model.generate(prompt, 30, compile=False)
    assert model.generate(prompt, 30, use_cache=False) == eager
    assert model.generate(prompt, 30, compile=True) == eager
    short = model.cfg.position.rope_short_factor
    no_switch = _phi3_tiny(seed=3, **{"position.rope_long_factor": short})
    assert no_switch.generate(prompt, 30, compile=False)[12:] != eager[12:]


def test_rolling_past_the_context_is_refused_with_longrope(tmp_path, capsys):
    """A rolling cache cannot encode the sequence again at the switch: generate and the
    command line refuse overflow='roll' by name (and decode with the default slide)."""
    from attnlab.cli.main import main

    model = _phi3_tiny()
    with pytest.raises(ValueError, match="overflow='roll' is not available with LongRoPE"):
        model.generate([1, 2, 3], 4, overflow="roll")
    save_hf(model, tmp_path / "hf")
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    run = ["generate", "--ckpt", str(tmp_path / "ckpt"), "--prompt-ids", "1,2,3"]
    assert main([*run, "--max-new-tokens", "4", "--overflow", "roll"]) != 0
    assert "--overflow roll: past its original context LongRoPE" in capsys.readouterr().err
    assert main([*run, "--max-new-tokens", "40"]) == 0  # past the switch at 32


# --------------------------------------------------------------------------- export


def _tiny(**changes):
    return get_preset("phi3-tiny").override({"vocab_size": V, **changes})


EXPORTS = {
    "phi3-tiny": _tiny(),
    # interleaved RoPE pairs within the rotated half of each head (q/k rows permuted to the
    # split halves there only), a window on every layer, a tied head, MHA, an attention
    # factor of its own (written only to transformers 5's RoPE parameters)
    "interleaved-partial-window": _tiny(
        **{
            "position.rope_layout": "interleaved",
            "position.rope_fraction": 0.5,
            "position.rope_short_factor": [1.0, 1.1, 1.2, 1.4],
            "position.rope_long_factor": [1.2, 2.0, 3.0, 4.0],
            "position.rope_attention_factor": 1.2,
            "attention.sliding_window": 12,
            "attention.n_kv_heads": None,
            "tie_embeddings": True,
        }
    ),
    # LLaMA's shape with a partial rotation (12 of 16 features) and plain RoPE: phi3 too
    "llama-partial": get_preset("llama-tiny").override(
        {
            "vocab_size": V,
            "position.rope_fraction": 0.75,
            "ffn.hidden_dim": 96,
            "ffn.multiple_of": 256,
        }  # (the hidden size as set, which import gives back)
    ),
}


@pytest.mark.parametrize("name", list(EXPORTS))
def test_export_round_trip(name, tmp_path):
    cfg = EXPORTS[name]
    torch.manual_seed(20)
    model = DecoderLM(cfg).eval()
    HF.randomize(model, seed=len(name))
    assert hf_model_type(cfg) == "phi3"
    save_hf(model, tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    assert ("lm_head.weight" in stored) == (not cfg.tie_embeddings)
    assert "model.layers.0.self_attn.qkv_proj.weight" in stored

    idx = torch.randint(0, V, (2, 48), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(idx)
    mask[1, :7] = 0
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert type(ref).__name__ == "Phi3ForCausalLM"
    real = mask.bool()
    for t in (24, 48):  # within the original context of 32, and past it
        with torch.no_grad():
            ours = model(idx[:, :t], attention_mask=mask[:, :t]).logits
        theirs = hf_logits(ref.eval(), idx[:, :t], mask[:, :t])
        assert ours.abs().max() > 1.0
        assert (ours[real[:, :t]] - theirs[real[:, :t]]).abs().max() <= TOL

    back = load_hf(tmp_path)  # import(export(x)): the same model, the same numbers
    assert back.cfg == cfg.override({"position.rope_layout": "split"})
    if cfg.position.rope_layout == "split":
        mine = model.state_dict()
        for key, value in back.state_dict().items():
            assert torch.equal(value, mine[key]), key
    with torch.no_grad():
        again = back(idx, attention_mask=mask).logits
        ours = model(idx, attention_mask=mask).logits
    tol = 0.0 if cfg.position.rope_layout == "split" else TOL  # (q . k in another order)
    assert (again - ours)[real].abs().max() <= tol
    save_hf(back, tmp_path / "again")  # export(import(export(x))) writes the same tensors
    twice = load_file(tmp_path / "again" / "model.safetensors")
    assert twice.keys() == stored.keys()
    assert all(torch.equal(twice[k], stored[k]) for k in stored)


def test_llama_shaped_configs_keep_their_model_types():
    """Phi-3 takes only what LLaMA's layout lacks: a LLaMA-shaped config stays llama (or
    mistral with a window, as Phi-3-mini-4k's preset), with LongRoPE it becomes phi3."""
    assert hf_model_type(get_preset("llama-tiny")) == "llama"
    assert hf_model_type(get_preset("phi-3-mini-4k")) == "mistral"
    longrope = {
        "position.rope_scaling": "longrope",
        "position.rope_original_max_seq_len": 32,
        "position.rope_short_factor": [1.0] * 8,
        "position.rope_long_factor": [2.0] * 8,
    }
    assert hf_model_type(get_preset("llama-tiny").override(longrope)) == "phi3"


# --------------------------------------------------------------------------- refusals


def _hf_dict(case: str = "longrope-gqa") -> dict:
    return HF.config(case).to_dict()


def _longrope(**changes) -> dict:
    return {**CASES["longrope-gqa"]["rope_parameters"], **changes}


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"resid_pdrop": 0.1}, "resid_pdrop=0.1 is not supported"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "RoPE scaling 'dynamic'"),
        ({"rope_parameters": _longrope(short_factor=[1.0, 1.0, 1.0])},
         "position.rope_short_factor: has 3 factors; LongRoPE needs one per rotated pair of "
         "dimensions: rope_dim / 2 = 4"),
        ({"rope_parameters": _longrope(long_factor=None)},
         "RoPE parameters for rope_type 'longrope' need ['long_factor']"),
        ({"rope_parameters": _longrope(long_factor=[1.0, 2.0, -1.0, 4.0])},
         "position.rope_long_factor[2]: must be > 0, got -1.0"),
        ({"rope_parameters": _longrope(beta_fast=32.0)}, "RoPE parameters ['beta_fast']"),
        ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.375}},
         "rotates int(8 * 0.375) = 3 features of each head; RoPE rotates pairs"),
        ({"hidden_act": "gelu_fast"}, "hidden_act='gelu_fast'"),
    ],
    ids=["resid-dropout", "rope-type", "short-length", "no-long", "negative", "yarn-key",
         "odd-rotation", "activation"],
)  # fmt: skip
def test_config_it_cannot_hold_is_refused_by_name(changes, named):
    hf = {**_hf_dict(), **changes}
    if "rope_parameters" in changes:
        hf["rope_scaling"] = None
    with pytest.raises(HFCheckpointError, match=re.escape(named)):
        config_from_hf(hf)


def test_old_longrope_names_and_minimal_configs_read_as_transformers_reads_them():
    """rope_type "su" (Phi-3's first name for LongRoPE) is longrope, its own original
    context winning (transformers 5 moves the top-level one in for "longrope" only); a
    config.json without RoPE keys or original length has Phi3Config's defaults."""
    given = {"model_type": "phi3", "hidden_size": 32, "num_attention_heads": 4,
             "num_hidden_layers": 2, "vocab_size": V, "intermediate_size": 16}  # fmt: skip
    su = {"type": "su", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
          "original_max_position_embeddings": 8}  # fmt: skip
    ours = config_from_hf({**given, "max_position_embeddings": 64, "rope_scaling": su})
    theirs = transformers.Phi3Config(**{k: v for k, v in given.items() if k != "model_type"},
                                     max_position_embeddings=64, rope_scaling=dict(su))  # fmt: skip
    assert theirs.rope_parameters["rope_type"] == ours.position.rope_scaling == "longrope"
    assert ours.position.rope_original_max_seq_len == 8
    assert theirs.rope_parameters["original_max_position_embeddings"] == 8
    plain = config_from_hf(given)
    assert (plain.max_seq_len, plain.norm.eps, plain.position.rope_scaling) == (4096, 1e-5, None)


def test_llama_refuses_phi3s_rope_pieces():
    """LLaMA's transformers model rotates whole heads, and its generate does not encode
    again past LongRoPE's switch: both are refused there by name."""
    hf = {"model_type": "llama", "hidden_size": 32, "num_attention_heads": 4, "vocab_size": V,
          "num_hidden_layers": 1, "intermediate_size": 16}  # fmt: skip
    with pytest.raises(HFCheckpointError, match="partial_rotary_factor=0.5 is not supported"):
        config_from_hf({**hf, "partial_rotary_factor": 0.5})
    with pytest.raises(HFCheckpointError, match="RoPE scaling 'longrope' is not supported"):
        config_from_hf({**hf, "rope_parameters": _longrope()})


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"attention.qkv_bias": True}, "attention.qkv_bias=True (Phi-3's is False)"),
        ({"ffn.bias": True}, "ffn.bias=True (Phi-3's is False)"),
        # (LayerNorm with a gated feed-forward is StableLM's layout, which has no LongRoPE)
        ({"norm.kind": "layernorm"}, "position.rope_scaling='longrope' (StableLM's: none or"),
        ({"attention.sliding_window": 8, "attention.layer_pattern": "LG"},
         "local and global layers"),
        ({"position.rope_scaling": "yarn", "position.rope_short_factor": None,
          "position.rope_long_factor": None, "position.rope_fraction": 0.5},
         "position.rope_scaling='yarn' (Phi-3's: none or longrope); position.rope_fraction"),
        ({"attention.head_dim": 8, "position.rope_short_factor": [1.0] * 4,
          "position.rope_long_factor": [2.0] * 4}, "attention.head_dim=8 with LongRoPE"),
        ({"attention.qk_norm": True}, "attention.qk_norm (phi3 has no QK-norm"),
        ({"ffn.kind": "moe", "ffn.router": "deepseek-v2", "ffn.n_shared_experts": 0},
         "position.rope_scaling='longrope' (mixtral has no LongRoPE"),
    ],
    ids=["qkv-bias", "ffn-bias", "layernorm", "pattern", "yarn", "head-dim", "qk-norm",
         "experts"],
)  # fmt: skip
def test_export_refuses_what_phi3_cannot_hold(changes, named, tmp_path):
    cfg = _tiny(**changes)
    with pytest.raises(HFCheckpointError, match=re.escape(named)):
        save_hf(DecoderLM(cfg), tmp_path)
    assert not (tmp_path / "config.json").exists()
