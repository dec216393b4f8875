"""SmolLM3 checkpoints: transformers models from tiny random configs (the default NoPE
interval and an irregular no_rope_layers, GQA 4/2 and MHA, head_dim d / h and not, attention
and MLP biases on and off, tied and untied heads, plain and LLaMA 3 RoPE) with every weight
set to random values, loaded with ``load_hf``, give the same logits (with and without left
padding), the same greedy tokens (one prompt and a ragged batch), the same loss and
gradients, and a compiled decode step gives the eager one's logits; attnlab models saved
with ``save_hf`` load in transformers with the same logits and load back into attnlab
exactly; configs neither side can hold are refused by name, and NoPE layers
(``position.nope_layers``) are refused by every other layout. A NoPE layer's attention does
not depend on positions.

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
TOL = 3e-5  # float32: observed up to 1.3e-5 on logits up to ~10 over 8 layers (op order)
CASES = {
    # GQA 4/2, head_dim d / h, the default interval (layers 3 and 7 NoPE), a tied head (the
    # class default), plain RoPE of base 1000 (transformers 5.x's rope_parameters)
    "gqa-interval-tied": dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
    ),
    # MHA with head_dim 12 != d / h, an irregular no_rope_layers (layers 0 and 2 NoPE),
    # biases on q, k, v, o and the MLP, an untied head, LLaMA 3 RoPE scaling in
    # transformers 4.x's keys, an eps large enough to matter
    "mha-irregular-biased-untied-llama3": dict(
        hidden_size=32,
        intermediate_size=40,
        head_dim=12,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        rms_norm_eps=0.05,
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=False,
        no_rope_layers=[0, 1, 0],
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
NOPE = {"gqa-interval-tied": [3, 7], "mha-irregular-biased-untied-llama3": [0, 2]}


# Norm weights in [0.5, 1.5) (transformers starts them at one), biases (zero at init) and every
# other weight random.
HF = HFCases("SmolLM3Config", "SmolLM3ForCausalLM", CASES, V, norms=(0.5, 1.5))
imported = HF.imported_fixture()


def test_import_config(imported):
    case, ref, model = imported
    cfg, hf = model.cfg, ref.config
    att, pos = cfg.attention, cfg.position
    assert model.num_parameters() == ref.num_parameters()
    assert config_from_hf(hf.to_dict()) == cfg  # the in-memory config, not only config.json
    assert hf_model_type(cfg) == "smollm3"
    assert pos.nope_layers == NOPE[case]
    assert pos.nope_layers == [i for i, f in enumerate(hf.no_rope_layers) if not f]
    # the layers transformers rotates are the ones attnlab rotates
    assert [b.attn.uses_rope for b in model.blocks] == [
        bool(layer.self_attn.use_rope) for layer in ref.model.layers
    ]
    assert (cfg.norm.kind, cfg.norm.placement, cfg.norm.eps) == ("rmsnorm", "pre", hf.rms_norm_eps)
    assert att.qkv_bias == att.out_bias == hf.attention_bias
    assert cfg.ffn.bias == hf.mlp_bias
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (
        hf.num_attention_heads,
        hf.num_key_value_heads,
        getattr(hf, "head_dim", 32 // hf.num_attention_heads),
    )
    assert cfg.tie_embeddings == hf.tie_word_embeddings
    assert pos.rope_theta == hf.rope_parameters["rope_theta"]
    assert pos.rope_scaling == (None if case == "gqa-interval-tied" else "llama3")
    assert att.sliding_window is None


def test_import_logits(imported):
    case, ref, model = imported
    assert_logits_match_hf(ref, model, V, TOL)


def test_import_logits_left_padding(imported):
    case, ref, model = imported
    assert_left_padded_logits_match_hf(ref, model, V, TOL)


def test_import_greedy_generation(imported):
    """Cached decoding (NoPE layers' keys cached unrotated) against transformers' cache,
    one prompt and a left-padded batch."""
    case, ref, model = imported
    assert_greedy_tokens_match_hf(ref, model, V)


def test_training_gradients_match_transformers(imported):
    """A loss backward in training mode: the loss and the gradients of a NoPE layer's and a
    RoPE layer's projections, norms, the final norm and the embedding are transformers'."""
    case, ref, model = imported
    ref.train()
    model.train()
    idx = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(4))
    ours = model(idx[:, :-1], targets=idx[:, 1:]).loss
    theirs = F.cross_entropy(ref(idx[:, :-1]).logits.flatten(0, 1), idx[:, 1:].flatten())
    ours.backward()
    theirs.backward()
    try:
        assert abs(ours.item() - theirs.item()) <= 1e-5
        cfg = model.cfg
        q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        pairs = [
            (model.norm.weight.grad, ref.model.norm.weight.grad),
            (model.tok_emb.weight.grad, ref.model.embed_tokens.weight.grad),
        ]
        for i in (NOPE[case][0], 1):  # a NoPE layer and a RoPE one
            block, layer = model.blocks[i], ref.model.layers[i]
            k_grad = block.attn.qkv.weight.grad[q_dim : q_dim + kv_dim]
            pairs += [
                (block.attn_norm.weight.grad, layer.input_layernorm.weight.grad),
                (block.ffn_norm.weight.grad, layer.post_attention_layernorm.weight.grad),
                (block.attn.qkv.weight.grad[:q_dim], layer.self_attn.q_proj.weight.grad),
                (k_grad, layer.self_attn.k_proj.weight.grad),
                (block.attn.out.weight.grad, layer.self_attn.o_proj.weight.grad),
                (block.ffn.down.weight.grad, layer.mlp.down_proj.weight.grad),
            ]
            if cfg.attention.qkv_bias:
                pairs.append((block.attn.qkv.bias.grad[:q_dim], layer.self_attn.q_proj.bias.grad))
            if cfg.ffn.bias:
                pairs.append((block.ffn.down.bias.grad, layer.mlp.down_proj.bias.grad))
        for got, want in pairs:
            assert want.abs().max() > 0  # (a gradient that flows)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    finally:
        ref.eval().zero_grad()
        model.eval().zero_grad()


@torch.no_grad()
def test_compiled_decode_step_equals_eager(imported):
    """The static-cache decode step of an imported model traces as one graph (backend
    'eager') and gives the eager step's logits over a left-padded batch."""
    case, ref, model = imported
    prompt = torch.randint(1, V, (2, 6), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(prompt)
    mask[1, :2] = 0

    def step(model, ids, cache):
        return model(ids, cache=cache, last_only=True).logits[:, -1]

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, dynamic=False, backend="eager")
    eager_cache = model.new_cache(2, 16)
    static_cache = model.new_cache(2, 16, static=True)
    model(prompt, cache=eager_cache, attention_mask=mask)
    model(prompt, cache=static_cache, attention_mask=mask)
    tok = prompt[:, -1:]
    for _ in range(4):
        a = step(model, tok, eager_cache)
        b = compiled(model, tok, static_cache)
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
        tok = a.argmax(-1, keepdim=True)


@pytest.mark.slow
def test_generate_compile_equals_eager_generate(imported):
    """generate(compile=True) (inductor's code, the static cache) gives the eager tokens,
    for one prompt and a left-padded batch."""
    case, ref, model = imported
    torch._dynamo.reset()
    prompts = [torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (9, 4)]  # fmt: skip
    assert model.generate(prompts[0], 12, compile=True) == model.generate(prompts[0], 12)
    assert model.generate(prompts, 12, compile=True) == model.generate(prompts, 12)


# --------------------------------------------------------------------------- NoPE


@torch.no_grad()
def test_nope_layer_attention_is_position_independent():
    """A NoPE layer's attention without a causal mask is a set function of its keys: the
    same output for permuted keys (a RoPE layer's changes), and the same as that layer's
    attention with position.kind 'none'."""
    cfg = get_preset("smollm3-tiny").override({"vocab_size": V})
    torch.manual_seed(0)
    model = DecoderLM(cfg).eval()
    HF.randomize(model, seed=1)
    nope, rope = model.blocks[3].attn, model.blocks[0].attn
    assert not nope.uses_rope and rope.uses_rope
    x = torch.randn(2, 10, cfg.d_model, generator=torch.Generator().manual_seed(2))
    perm = torch.randperm(10, generator=torch.Generator().manual_seed(3))
    positions = torch.arange(10).expand(2, 10)
    tables = model.rope.tables(positions)
    for attn in (nope, rope):
        attn.causal = False
    try:
        a = nope(x, positions=positions, rope=tables)
        b = nope(x[:, perm], positions=positions, rope=tables)
        torch.testing.assert_close(b, a[:, perm], atol=1e-5, rtol=1e-5)
        c = rope(x[:, perm], positions=positions, rope=tables)
        assert (c - rope(x, positions=positions, rope=tables)[:, perm]).abs().max() > 1e-2
    finally:
        for attn in (nope, rope):
            attn.causal = True
    # the whole model equals one whose NoPE layer is built without positions
    plain = DecoderLM(cfg.override({"position.nope_layers": [], "position.kind": "none"}))
    plain.load_state_dict(model.state_dict())
    idx = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(4))
    h_ours = model.blocks[3](x, positions=positions, rope=tables)
    h_plain = plain.blocks[3](x, positions=positions)
    torch.testing.assert_close(h_ours, h_plain, atol=0, rtol=0)
    assert (model(idx).logits - plain(idx).logits).abs().max() > 1e-3  # (the others rotate)


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"position.nope_layers": [3, 1]}, "must be distinct layers >= 0 in increasing order"),
        ({"position.nope_layers": [1, 1]}, "must be distinct layers >= 0 in increasing order"),
        ({"position.nope_layers": [-1]}, "must be distinct layers >= 0 in increasing order"),
        ({"position.nope_layers": [4]}, "layer 4 is not below n_layers=4"),
        ({"position.kind": "learned"}, "position.nope_layers: needs position.kind 'rope'"),
        (
            {"attention.kind": "mla", "attention.n_kv_heads": None},
            "position.nope_layers: is implemented by attention.kind='mha' only, not 'mla'",
        ),
        (
            {"attention.kind": "linear", "attention.n_kv_heads": None},
            "position.nope_layers: is implemented by attention.kind='mha' only, not 'linear'",
        ),
        ({"arch": "encoder"}, "is implemented by the decoder architecture only"),
    ],
)
def test_nope_layers_config_is_validated(changes, named):
    with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace(")", r"\)")):
        get_preset("smollm3-tiny").override(changes).validate()


# --------------------------------------------------------------------------- export


def _tiny(**changes):
    return get_preset("smollm3-tiny").override({"vocab_size": V, **changes})


EXPORTS = {
    "smollm3-tiny": _tiny(),
    # interleaved RoPE pairs (q/k rows permuted to split halves, NoPE layers' too), q/k/v
    # biases only (o's written as zeros), MLP biases, an untied head, MHA with head_dim 12,
    # LLaMA 3 scaling, an irregular set of NoPE layers, another activation
    "interleaved-biased-untied": _tiny(
        **{
            "position.rope_layout": "interleaved",
            "position.rope_scaling": "llama3",
            "position.rope_factor": 8.0,
            "position.rope_original_max_seq_len": 16,
            "position.nope_layers": [0, 1],
            "attention.qkv_bias": True,
            "attention.n_kv_heads": None,
            "attention.head_dim": 12,
            "ffn.bias": True,
            "tie_embeddings": False,
            "ffn.activation": "gelu_tanh",
        }
    ),
    # MQA, YaRN, every layer NoPE, an eps large enough to matter
    "mqa-yarn-all-nope": _tiny(
        **{
            "attention.n_kv_heads": 1,
            "position.rope_scaling": "yarn",
            "position.rope_factor": 4.0,
            "position.rope_original_max_seq_len": 32,
            "position.nope_layers": [0, 1, 2, 3],
            "norm.eps": 0.05,
        }
    ),
}


@pytest.mark.parametrize("name", list(EXPORTS))
def test_export_round_trip(name, tmp_path):
    cfg = EXPORTS[name]
    torch.manual_seed(20)
    model = DecoderLM(cfg).eval()
    HF.randomize(model, seed=len(name))
    assert hf_model_type(cfg) == "smollm3"
    save_hf(model, tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    assert ("lm_head.weight" in stored) == (not cfg.tie_embeddings)

    idx = torch.randint(0, V, (2, 40), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(idx)
    mask[1, :7] = 0
    with torch.no_grad():
        ours = model(idx, attention_mask=mask).logits
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert type(ref).__name__ == "SmolLM3ForCausalLM"
    assert [i for i, f in enumerate(ref.config.no_rope_layers) if not f] == cfg.position.nope_layers
    theirs = hf_logits(ref.eval(), idx, mask)
    real = mask.bool()
    assert ours.abs().max() > 1.0
    # interleaved pairs: q . k summed in another order, through 4 layers: observed 4.1e-5
    # (3.0e-5 against transformers' sdpa, which gives the split layouts' logits bit for bit)
    split = cfg.position.rope_layout == "split"
    assert (ours[real] - theirs[real]).abs().max() <= (TOL if split else 6e-5)

    back = load_hf(tmp_path)  # import(export(x)): the same model, the same numbers
    assert back.cfg.position.rope_layout == "split"
    if split:
        biases = cfg.attention.qkv_bias or cfg.attention.out_bias
        assert back.cfg == cfg.override({"attention.out_bias": biases})
        mine = model.state_dict()
        for key, value in back.state_dict().items():
            want = mine.get(key, torch.zeros_like(value))  # biases it had not: zeros
            assert torch.equal(value, want), key
    with torch.no_grad():
        again = back(idx, attention_mask=mask).logits
    tol = 0.0 if split else 6e-5  # (q . k in another order, as above)
    assert (again - ours)[real].abs().max() <= tol
    save_hf(back, tmp_path / "again")  # export(import(export(x))) writes the same tensors
    twice = load_file(tmp_path / "again" / "model.safetensors")
    assert twice.keys() == stored.keys()
    assert all(torch.equal(twice[k], stored[k]) for k in stored)


@pytest.mark.parametrize("case", list(CASES))
def test_config_round_trips(case):
    """config.json -> attnlab -> config.json keeps every key transformers' SmolLM3 reads,
    and attnlab -> config.json -> attnlab is the same config."""
    hf = HF.config(case).to_dict()
    cfg = config_from_hf(hf)
    written = config_to_hf(cfg)
    assert written["model_type"] == "smollm3"
    assert written["architectures"] == ["SmolLM3ForCausalLM"]
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
        "no_rope_layers",
        "use_sliding_window",
        "layer_types",
    ):
        assert written[key] == hf[key], key
    assert config_from_hf(written) == cfg
    for name in EXPORTS:
        assert config_from_hf(config_to_hf(EXPORTS[name])) == EXPORTS[name].override(
            {
                "position.rope_layout": "split",  # (rows permuted on export)
                "attention.out_bias": EXPORTS[name].attention.qkv_bias,
            }
        )


# --------------------------------------------------------------------------- refusals


def _message(named: str) -> str:
    return named.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"hidden_act": "gelu_fast"}, "hidden_act='gelu_fast' is not supported"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
         "RoPE scaling 'dynamic' is not supported"),
        ({"no_rope_layers": [1, 1, 1]}, "no_rope_layers must list one 0 or 1 per layer (8)"),
        ({"no_rope_layers": [1, 2, 1, 0, 1, 1, 1, 0]}, "entries must be 0 (NoPE) or 1 (RoPE)"),
        ({"use_sliding_window": True, "sliding_window": 8, "layer_types": None},
         "sliding windows (use_sliding_window=True, sliding_window=8"),
        ({"layer_types": ["full_attention"] * 7 + ["sliding_attention"], "sliding_window": 8},
         "sliding windows (use_sliding_window=False"),
        ({"layer_types": ["chunked_attention"] * 8}, "expected full_attention or sliding"),
        ({"num_key_value_heads": 3}, "n_heads=4 is not divisible by n_kv_heads=3"),
        ({"architectures": ["SmolLM3ForSequenceClassification"]},
         "architecture 'SmolLM3ForSequenceClassification' is not supported"),
    ],
    ids=["activation", "rope", "short-flags", "flag-2", "window", "layer-types", "chunked",
         "kv-heads", "head"],
)  # fmt: skip
def test_config_it_cannot_hold_is_refused_by_name(changes, named):
    hf = {**HF.config("gqa-interval-tied").to_dict(), **changes}
    with pytest.raises(HFCheckpointError, match=_message(named)):
        config_from_hf(hf)


def test_minimal_config_is_read_as_transformers_fills_it():
    """Without the keys: SmolLM3Config's defaults (every 4th layer NoPE, RoPE base 2e6,
    GQA with 4 key/value heads, a tied head, eps 1e-6), not attnlab's."""
    given = {"model_type": "smollm3", "hidden_size": 32, "num_attention_heads": 4,
             "num_hidden_layers": 8, "vocab_size": V, "intermediate_size": 16}  # fmt: skip
    hf = transformers.AutoConfig.for_model(**given).to_dict()
    cfg = config_from_hf(given)
    assert cfg == config_from_hf(hf)
    assert cfg.position.nope_layers == [3, 7]
    assert (cfg.norm.eps, cfg.position.rope_theta, cfg.attention.n_kv_heads) == (1e-6, 2e6, None)
    assert (cfg.tie_embeddings, cfg.max_seq_len) == (True, 32768)
    interval = config_from_hf({**given, "no_rope_layer_interval": 3})
    assert interval.position.nope_layers == [2, 5]


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"norm.placement": "post"},
         "norm.placement='post' (SmolLM3's is 'pre'); position.nope_layers exports "
         "as smollm3 only"),
        ({"norm.kind": "layernorm"}, "norm.kind='layernorm' (SmolLM3's is 'rmsnorm')"),
        ({"ffn.kind": "mlp"}, "ffn.kind='mlp' (SmolLM3's is 'glu')"),
        ({"ffn.kind": "moe", "ffn.n_shared_experts": 0}, "ffn.kind='moe' (SmolLM3's is 'glu')"),
        ({"attention.qk_norm": True}, "attention.qk_norm (smollm3 has no QK-norm"),
        ({"attention.sliding_window": 8}, "attention.sliding_window (smollm3 attends to every"),
        ({"attention.sink_logits": True}, "attention.sink_logits (smollm3 has none"),
        ({"position.rope_fraction": 0.5}, "position.rope_fraction=0.5 (smollm3 rotates whole"),
    ],
)  # fmt: skip
def test_export_refuses_what_smollm3_cannot_hold(changes, named, tmp_path):
    cfg = _tiny(**changes)
    with pytest.raises(HFCheckpointError, match=_message(named)):
        save_hf(DecoderLM(cfg), tmp_path)
    assert not (tmp_path / "config.json").exists()


@pytest.mark.parametrize(
    "base, changes, named",
    [
        # Gemma's and OLMo 2's families take their pieces first; convert names the NoPE
        # layers their layouts lack
        ("gemma3-tiny", {"position.nope_layers": [1]},
         "position.nope_layers (gemma3_text rotates every layer; NoPE layers export as "
         "smollm3"),
        ("olmo2-tiny", {"position.nope_layers": [1]},
         "position.nope_layers (olmo2 rotates every layer"),
    ],
)  # fmt: skip
def test_nope_layers_in_other_layouts_are_refused(base, changes, named):
    cfg = get_preset(base).override(changes)
    with pytest.raises(HFCheckpointError, match=_message(named)):
        hf_model_type(cfg)


def test_families_other_than_smollm3_refuse_nope_layers(monkeypatch):
    """convert's own check, should another family take such a config (the SmolLM3 family
    left out of the registry here): LLaMA's layout names the NoPE layers it has not."""
    from attnlab.interop import convert

    others = tuple(f for f in convert.FAMILIES if f.name != "smollm3")
    monkeypatch.setattr(convert, "FAMILIES", others)
    with pytest.raises(HFCheckpointError, match=_message(
        "position.nope_layers (llama rotates every layer; NoPE layers export as smollm3"
    )):  # fmt: skip
        hf_model_type(get_preset("smollm3-tiny"))
