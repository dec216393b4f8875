"""StarCoder2 checkpoints: transformers models from tiny random configs (GQA 4/2 with a
window of 6 and MHA with head_dim 12 != d / h and no window, biases on and off, tied and
untied heads, plain and LLaMA 3 RoPE, tanh and exact GELU) with every weight set to random
values, loaded with ``load_hf``, give the same logits (with and without left padding), the
same greedy tokens (one prompt and a ragged batch, decoding past the window) and the same
loss and gradients; attnlab models saved with ``save_hf`` load in transformers with the
same logits and load back into attnlab exactly; configs neither side can hold are refused
by name, and the other families' exports are unchanged.

Shapes: b batch, t length, V vocabulary.
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
from attnlab.presets import get_preset

V = 97
TOL = 2e-5  # float32, logits up to ~10 through 2 layers (op order)
CASES = {
    # GQA 4/2, head_dim d / h, a window of 6 keys (greedy decoding runs past it), biases
    # (the class default), a tied head (the class default), plain RoPE of base 1000
    # (transformers 5.x's rope_parameters), an MLP of 48 (not 4d)
    "gqa-window-biased-tied": dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        sliding_window=6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
    ),
    # MHA with head_dim 12 != d / h, no window, no biases (the LayerNorms keep theirs), an
    # untied head, LLaMA 3 RoPE scaling in transformers 4.x's keys, exact GELU, an eps
    # large enough to matter
    "mha-unbiased-untied-llama3": dict(
        hidden_size=32,
        intermediate_size=40,
        head_dim=12,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        norm_epsilon=0.05,
        use_bias=False,
        tie_word_embeddings=False,
        hidden_act="gelu",
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


def _is_norm_weight(name: str, p: torch.Tensor) -> bool:
    return ("norm" in name or "layernorm" in name) and name.endswith("weight")


# LayerNorm weights in [0.5, 1.5) (transformers starts them at one), biases (zero at init, the
# LayerNorms' too) and every other weight random.
HF = HFCases(
    "Starcoder2Config", "Starcoder2ForCausalLM", CASES, V, norms=(0.5, 1.5), is_norm=_is_norm_weight
)
imported = HF.imported_fixture()


def test_import_config(imported):
    case, ref, model = imported
    cfg, hf = model.cfg, ref.config
    att, pos = cfg.attention, cfg.position
    assert model.num_parameters() == ref.num_parameters()
    assert config_from_hf(hf.to_dict()) == cfg  # the in-memory config, not only config.json
    assert hf_model_type(cfg) == "starcoder2"
    assert (cfg.norm.kind, cfg.norm.placement, cfg.norm.bias) == ("layernorm", "pre", True)
    assert cfg.norm.eps == hf.norm_epsilon
    assert (cfg.ffn.kind, cfg.ffn.hidden_dim) == ("mlp", hf.intermediate_size)
    assert cfg.ffn.activation == ("gelu_tanh" if case == "gqa-window-biased-tied" else "gelu")
    assert att.qkv_bias == att.out_bias == cfg.ffn.bias == hf.use_bias
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (
        hf.num_attention_heads,
        hf.num_key_value_heads,
        getattr(hf, "head_dim", 32 // hf.num_attention_heads),
    )
    assert att.sliding_window == hf.sliding_window and att.layer_pattern is None
    assert cfg.tie_embeddings == hf.tie_word_embeddings
    assert pos.rope_theta == hf.rope_parameters["rope_theta"]
    assert pos.rope_scaling == (None if case == "gqa-window-biased-tied" else "llama3")


def test_import_logits(imported):
    case, ref, model = imported
    assert_logits_match_hf(ref, model, V, TOL)


def test_import_logits_left_padding(imported):
    case, ref, model = imported
    assert_left_padded_logits_match_hf(ref, model, V, TOL)


def test_import_greedy_generation(imported):
    """Cached decoding (past the window of 6: a rolling cache) against transformers' cache,
    one prompt and a left-padded batch."""
    case, ref, model = imported
    assert_greedy_tokens_match_hf(ref, model, V)


def test_training_gradients_match_transformers(imported):
    """A loss backward in training mode (dropout 0): the loss over a left-padded batch and
    the gradients of every parameter (LayerNorm biases and the MLP's included) are
    transformers'."""
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
        sd = model.state_dict(keep_vars=True)
        cfg = model.cfg
        q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        layer = ref.model.layers[0]
        pairs = [
            (sd["norm.weight"], ref.model.norm.weight),
            (sd["norm.bias"], ref.model.norm.bias),
            (sd["tok_emb.weight"], ref.model.embed_tokens.weight),
            (sd["blocks.0.attn_norm.bias"], layer.input_layernorm.bias),
            (sd["blocks.0.ffn_norm.weight"], layer.post_attention_layernorm.weight),
            (sd["blocks.0.ffn.up.weight"], layer.mlp.c_fc.weight),
            (sd["blocks.0.ffn.down.weight"], layer.mlp.c_proj.weight),
            (sd["blocks.0.attn.out.weight"], layer.self_attn.o_proj.weight),
        ]
        got_k = sd["blocks.0.attn.qkv.weight"].grad[q_dim : q_dim + kv_dim]
        torch.testing.assert_close(got_k, layer.self_attn.k_proj.weight.grad, atol=1e-4, rtol=1e-4)
        if cfg.ffn.bias:
            pairs += [
                (sd["blocks.0.ffn.up.bias"], layer.mlp.c_fc.bias),
                (sd["blocks.0.attn.out.bias"], layer.self_attn.o_proj.bias),
            ]
        if not cfg.tie_embeddings:
            pairs.append((sd["lm_head.weight"], ref.lm_head.weight))
        for ours_p, theirs_p in pairs:
            assert theirs_p.grad.abs().max() > 0  # (a gradient that flows)
            torch.testing.assert_close(ours_p.grad, theirs_p.grad, atol=1e-4, rtol=1e-4)
    finally:
        ref.eval().zero_grad()
        model.eval().zero_grad()


# --------------------------------------------------------------------------- export


def _tiny(**changes):
    return get_preset("starcoder2-tiny").override({"vocab_size": V, **changes})


EXPORTS = {
    "starcoder2-tiny": _tiny(),
    # interleaved RoPE pairs (q/k rows permuted to split halves), q/k/v biases only (o's and
    # the MLP's written as zeros), LayerNorms without biases (written as zeros), an untied
    # head, MHA with head_dim 12, no window, YaRN, exact GELU
    "interleaved-partial-biases-untied": _tiny(
        **{
            "position.rope_layout": "interleaved",
            "position.rope_scaling": "yarn",
            "position.rope_factor": 4.0,
            "position.rope_original_max_seq_len": 32,
            "attention.out_bias": False,
            "attention.n_kv_heads": None,
            "attention.head_dim": 12,
            "attention.sliding_window": None,
            "ffn.bias": False,
            "ffn.activation": "gelu",
            "norm.bias": False,
            "tie_embeddings": False,
        }
    ),
    # MQA, no biases anywhere (use_bias false), windows of 5
    "mqa-unbiased": _tiny(
        **{
            "attention.n_kv_heads": 1,
            "attention.qkv_bias": False,
            "attention.out_bias": False,
            "ffn.bias": False,
            "attention.sliding_window": 5,
        }
    ),
}


def _as_imported(cfg):
    """What export then import gives for ``cfg``: split RoPE pairs, StarCoder2's biases
    (every projection's if any), LayerNorm biases."""
    att = cfg.attention
    bias = att.qkv_bias or att.out_bias or cfg.ffn.bias
    return cfg.override(
        {
            "position.rope_layout": "split",
            "attention.qkv_bias": bias,
            "attention.out_bias": bias,
            "ffn.bias": bias,
            "norm.bias": True,
        }
    )


@pytest.mark.parametrize("name", list(EXPORTS))
def test_export_round_trip(name, tmp_path):
    cfg = EXPORTS[name]
    torch.manual_seed(20)
    model = DecoderLM(cfg).eval()
    HF.randomize(model, seed=len(name))
    assert hf_model_type(cfg) == "starcoder2"
    save_hf(model, tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    assert ("lm_head.weight" in stored) == (not cfg.tie_embeddings)

    idx = torch.randint(0, V, (2, 40), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(idx)
    mask[1, :7] = 0
    with torch.no_grad():
        ours = model(idx, attention_mask=mask).logits
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert type(ref).__name__ == "Starcoder2ForCausalLM"
    assert ref.config.sliding_window == cfg.attention.sliding_window
    theirs = hf_logits(ref.eval(), idx, mask)
    real = mask.bool()
    assert ours.abs().max() > 1.0
    # interleaved pairs: q . k summed in another order (observed up to 1.4e-5)
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
    """config.json -> attnlab -> config.json keeps every key transformers' StarCoder2 reads,
    and attnlab -> config.json -> attnlab is the same config."""
    hf = HF.config(case).to_dict()
    cfg = config_from_hf(hf)
    written = config_to_hf(cfg)
    assert (written["model_type"], written["architectures"]) == (
        "starcoder2",
        ["Starcoder2ForCausalLM"],
    )
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "hidden_act",
        "max_position_embeddings",
        "norm_epsilon",
        "use_bias",
        "sliding_window",
        "attention_dropout",
        "residual_dropout",
        "embedding_dropout",
        "tie_word_embeddings",
        "initializer_range",
        "rope_parameters",
    ):
        assert written[key] == hf[key], key
    assert config_from_hf(written) == cfg
    for cfg in EXPORTS.values():
        assert config_from_hf(config_to_hf(cfg)) == _as_imported(cfg)


def test_dropouts_are_read_and_written():
    hf = {**HF.config("gqa-window-biased-tied").to_dict(), "attention_dropout": 0.2}
    cfg = config_from_hf({**hf, "residual_dropout": 0.1, "embedding_dropout": 0.1})
    assert (cfg.dropout, cfg.attention.dropout) == (0.1, 0.2)
    written = config_to_hf(cfg)
    assert (written["residual_dropout"], written["embedding_dropout"]) == (0.1, 0.1)
    assert written["attention_dropout"] == 0.2


def test_differing_dropouts_load_as_one_with_a_warning():
    hf = {**HF.config("gqa-window-biased-tied").to_dict(), "residual_dropout": 0.1}
    warning = "embedding_dropout=0.0 differs from residual_dropout=0.1: attnlab has one dropout"
    with pytest.warns(UserWarning, match=warning):
        cfg = config_from_hf({**hf, "embedding_dropout": 0.0})
    assert cfg.dropout == 0.1


# --------------------------------------------------------------------------- refusals


def _message(named: str) -> str:
    return named.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"hidden_act": "gelu_fast"}, "hidden_act='gelu_fast' is not supported"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
         "RoPE scaling 'dynamic' is not supported"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                              "partial_rotary_factor": 0.5}},
         "partial_rotary_factor=0.5 is not supported for this model type"),
        ({"num_key_value_heads": 3}, "n_heads=4 is not divisible by n_kv_heads=3"),
        ({"architectures": ["Starcoder2ForSequenceClassification"]},
         "architecture 'Starcoder2ForSequenceClassification' is not supported"),
    ],
    ids=["activation", "rope", "partial-rope", "kv-heads", "head"],
)  # fmt: skip
def test_config_it_cannot_hold_is_refused_by_name(changes, named):
    hf = {**HF.config("gqa-window-biased-tied").to_dict(), **changes}
    with pytest.raises(HFCheckpointError, match=_message(named)):
        config_from_hf(hf)


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"attention.layer_pattern": "LG"},
         "local and global layers (attention.layer_pattern): StarCoder2 windows every layer"),
        ({"attention.qk_norm": True}, "attention.qk_norm (starcoder2 has no QK-norm"),
        # GPT-NeoX's (LayerNorm and a partial rotation) and SmolLM3's families take their
        # pieces first and name what they lack
        ({"position.rope_fraction": 0.5},
         "attention.n_kv_heads=2 (GPT-NeoX has one key/value head per query head"),
        ({"position.nope_layers": [1]},
         "norm.kind='layernorm' (SmolLM3's is 'rmsnorm'); position.nope_layers exports as "
         "smollm3 only"),
        ({"attention.sink_logits": True}, "attention.sink_logits (starcoder2 has none"),
    ],
)  # fmt: skip
def test_export_refuses_what_starcoder2_cannot_hold(changes, named, tmp_path):
    cfg = _tiny(**changes)
    with pytest.raises(HFCheckpointError, match=_message(named)):
        save_hf(DecoderLM(cfg), tmp_path)
    assert not (tmp_path / "config.json").exists()


@pytest.mark.parametrize(
    "preset, changes, model_type",
    [
        ("llama-tiny", {}, "llama"),
        ("llama-tiny", {"attention.sliding_window": 8}, "mistral"),
        ("llama-tiny", {"attention.qkv_bias": True}, "qwen2"),
        ("gpt2-tiny", {}, "gpt2"),
        ("smollm3-tiny", {}, "smollm3"),
        ("phi3-tiny", {}, "phi3"),
        ("starcoder2-tiny", {}, "starcoder2"),
        ("pythia-tiny", {}, "gpt_neox"),  # parallel blocks, a partial rotation
        ("pythia-tiny", {"norm.placement": "pre"}, "gpt_neox"),  # a partial rotation
        ("pythia-tiny", {"norm.placement": "pre", "position.rope_fraction": 1.0}, "starcoder2"),
        ("granite-tiny", {}, "granite"),
        ("cohere-tiny", {}, "cohere"),  # parallel blocks of one norm, a logit scale
        # parallel blocks with two norms and one key/value head per query head: GPT-NeoX's,
        # whole heads rotated or not; with one shared norm, or grouped key/value heads,
        # Falcon's; Falcon's multi-query attention in pre-norm blocks: StarCoder2's
        ("pythia-tiny", {"position.rope_fraction": 1.0}, "gpt_neox"),
        ("falcon-tiny", {"norm.placement": "parallel", "attention.n_kv_heads": None}, "gpt_neox"),
        ("falcon-tiny", {}, "falcon"),
        ("falcon-tiny", {"norm.placement": "parallel"}, "falcon"),
        (
            "pythia-tiny",
            {"norm.placement": "parallel_shared", "position.rope_fraction": 1.0},
            "falcon",
        ),
        ("falcon-tiny", {"norm.placement": "pre"}, "starcoder2"),
    ],
)
def test_export_picks_starcoder2_only_for_its_pieces(preset, changes, model_type):
    """LayerNorm with a non-gated MLP under RoPE is StarCoder2's, in parallel blocks or with
    a partial rotation GPT-NeoX's, in parallel blocks with one shared norm or grouped
    key/value heads Falcon's; LLaMA-shaped, GPT-2 and the other families' configs export
    as before."""
    assert hf_model_type(get_preset(preset).override(changes)) == model_type


@pytest.mark.parametrize(
    "changes, named",
    [
        # RoPE with LayerNorm and a gated FFN is StableLM's layout (its o_proj has no bias);
        # RMSNorm with an MLP: neither layout
        ({"ffn.kind": "glu"}, "StableLM's o_proj has no bias"),
        ({"norm.kind": "rmsnorm"}, "RoPE models need RMSNorm and a gated feed-forward"),
    ],
)
def test_half_starcoder2_configs_stay_refused(changes, named):
    with pytest.raises(HFCheckpointError, match=named):
        hf_model_type(_tiny(**changes))


def test_families_other_than_starcoder2_refuse_its_pieces(monkeypatch):
    """convert's own checks, should StarCoder2's family take a config with another
    family's pieces (GPT-NeoX's, Phi-3's and SmolLM3's families left out of the registry
    here)."""
    from attnlab.interop import convert

    others = tuple(f for f in convert.FAMILIES if f.name not in ("gpt_neox", "phi3", "smollm3"))
    monkeypatch.setattr(convert, "FAMILIES", others)
    with pytest.raises(HFCheckpointError, match=_message(
        "position.rope_fraction=0.5 (starcoder2 rotates whole heads"
    )):  # fmt: skip
        hf_model_type(_tiny(**{"position.rope_fraction": 0.5}))
    with pytest.raises(HFCheckpointError, match=_message(
        "position.nope_layers (starcoder2 rotates every layer"
    )):  # fmt: skip
        hf_model_type(_tiny(**{"position.nope_layers": [1]}))
