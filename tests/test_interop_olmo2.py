"""OLMo 2 checkpoints: transformers models from tiny random configs (GQA 4/2 and MHA, head_dim
d / h and not, attention biases on and off, tied and untied heads, plain and LLaMA 3 RoPE in
transformers 5.x's and 4.x's keys) with every weight, norms included, set to random values,
loaded with ``load_hf``, give the same logits (with and without left padding), the same
greedy tokens (one prompt and a ragged batch), the same loss and gradients, and a compiled
decode step gives the eager one's logits; attnlab models saved with ``save_hf`` load in
transformers with the same logits and load back into attnlab exactly; configs neither side
can hold are refused by name, and OLMo 2's pieces (norms on the sublayers' outputs, QK-norm
over whole projections) are refused by every other layout. (The command line:
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
TOL = 1e-5  # float32: observed up to 6e-6 on logits up to ~10 (op order)
CASES = {
    # GQA 4/2, head_dim d / h, an untied head, plain RoPE of base 1000 (transformers 5.x's
    # rope_parameters), the published models' eps
    "gqa": dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
    ),
    # MHA with head_dim 12 != d / h (read by transformers as set), biases on q, k, v and o,
    # a tied head, LLaMA 3 RoPE scaling in transformers 4.x's keys, an eps large enough to
    # matter
    "mha-biased-tied-llama3": dict(
        hidden_size=32,
        intermediate_size=40,
        head_dim=12,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        rms_norm_eps=0.05,
        attention_bias=True,
        tie_word_embeddings=True,
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
HF = HFCases("Olmo2Config", "Olmo2ForCausalLM", CASES, V, norms=(0.5, 1.5))
imported = HF.imported_fixture()


def test_import_config(imported):
    case, ref, model = imported
    cfg, hf = model.cfg, ref.config
    att, pos = cfg.attention, cfg.position
    assert model.num_parameters() == ref.num_parameters()
    assert config_from_hf(hf.to_dict()) == cfg  # the in-memory config, not only config.json
    assert hf_model_type(cfg) == "olmo2"
    assert (cfg.norm.kind, cfg.norm.placement, cfg.norm.eps) == (
        "rmsnorm",
        "post_sublayer",
        hf.rms_norm_eps,
    )
    assert att.qk_norm and att.qk_norm_scope == "projection"
    assert att.qkv_bias == att.out_bias == hf.attention_bias
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (
        hf.num_attention_heads,
        hf.num_key_value_heads,
        getattr(hf, "head_dim", 32 // hf.num_attention_heads),
    )
    assert cfg.tie_embeddings == hf.tie_word_embeddings
    rope = hf.rope_parameters
    assert pos.rope_theta == rope["rope_theta"]
    if case == "mha-biased-tied-llama3":
        assert (pos.rope_scaling, pos.rope_factor, pos.rope_original_max_seq_len) == (
            "llama3",
            4.0,
            16,
        )
    else:
        assert pos.rope_scaling is None
    # no norm before the sublayers; the output norms and whole-projection QK-norms as stored
    block, layer = model.blocks[1], ref.model.layers[1]
    assert block.attn_norm is None and block.ffn_norm is None
    assert torch.equal(block.attn_post_norm.weight, layer.post_attention_layernorm.weight)
    assert torch.equal(block.ffn_post_norm.weight, layer.post_feedforward_layernorm.weight)
    for name in ("q_norm", "k_norm"):
        ours, theirs = getattr(block.attn, name).weight, getattr(layer.self_attn, name).weight
        assert ours.shape == theirs.shape and torch.equal(ours, theirs)
    assert block.attn.k_norm.weight.shape == (cfg.n_kv_heads * cfg.head_dim,)


def test_import_logits(imported):
    case, ref, model = imported
    assert_logits_match_hf(ref, model, V, TOL)


def test_import_logits_left_padding(imported):
    case, ref, model = imported
    assert_left_padded_logits_match_hf(ref, model, V, TOL)


def test_import_greedy_generation(imported):
    """Cached decoding (keys normalised over the whole projection before the cache) against
    transformers' cache, one prompt and a left-padded batch."""
    case, ref, model = imported
    assert_greedy_tokens_match_hf(ref, model, V)


def test_training_gradients_match_transformers(imported):
    """A loss backward in training mode: the loss and the gradients of every norm (the two
    per layer, the whole-projection QK-norms, the final one), the projections and the
    embedding are transformers'."""
    case, ref, model = imported
    ref, model = ref.train(), model.train()
    idx = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(4))
    ours = model(idx[:, :-1], targets=idx[:, 1:]).loss
    theirs = F.cross_entropy(ref(idx[:, :-1]).logits.flatten(0, 1), idx[:, 1:].flatten())
    ours.backward()
    theirs.backward()
    try:
        assert abs(ours.item() - theirs.item()) <= 1e-5
        block, layer = model.blocks[1], ref.model.layers[1]
        cfg = model.cfg
        q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        k_grad = block.attn.qkv.weight.grad[q_dim : q_dim + kv_dim]
        pairs = [
            (block.attn_post_norm.weight.grad, layer.post_attention_layernorm.weight.grad),
            (block.ffn_post_norm.weight.grad, layer.post_feedforward_layernorm.weight.grad),
            (block.attn.q_norm.weight.grad, layer.self_attn.q_norm.weight.grad),
            (block.attn.k_norm.weight.grad, layer.self_attn.k_norm.weight.grad),
            (block.attn.qkv.weight.grad[:q_dim], layer.self_attn.q_proj.weight.grad),
            (k_grad, layer.self_attn.k_proj.weight.grad),
            (block.attn.out.weight.grad, layer.self_attn.o_proj.weight.grad),
            (block.ffn.down.weight.grad, layer.mlp.down_proj.weight.grad),
            (model.norm.weight.grad, ref.model.norm.weight.grad),
            (model.tok_emb.weight.grad, ref.model.embed_tokens.weight.grad),
        ]
        if cfg.attention.qkv_bias:
            pairs.append((block.attn.qkv.bias.grad[:q_dim], layer.self_attn.q_proj.bias.grad))
        for got, want in pairs:
            assert want.abs().max() > 0  # (a gradient that flows)
            # float32 sums over the batch in different orders: 1e-4
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    finally:
        ref.eval().zero_grad()
        model.eval().zero_grad()


@torch.no_grad()
def test_compiled_decode_step_equals_eager(imported):
    """The static-cache decode step of an imported model traces as one graph (backend
    'eager': the tracing without code generation) and gives the eager step's logits over a
    left-padded batch."""
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


# --------------------------------------------------------------------------- export


def _tiny(**changes):
    return get_preset("olmo2-tiny").override({"vocab_size": V, **changes})


EXPORTS = {
    "olmo2-tiny": _tiny(),
    # interleaved RoPE pairs (q/k rows and each head's part of the QK-norm weights permuted
    # to the split halves), q/k/v biases only (o's written as zeros), a tied head, MHA with
    # head_dim 12 != d / h, LLaMA 3 scaling, another activation
    "interleaved-biased-tied": _tiny(
        **{
            "position.rope_layout": "interleaved",
            "position.rope_scaling": "llama3",
            "position.rope_factor": 8.0,
            "position.rope_original_max_seq_len": 16,
            "attention.qkv_bias": True,
            "attention.n_kv_heads": None,
            "attention.head_dim": 12,
            "tie_embeddings": True,
            "ffn.activation": "gelu_tanh",
        }
    ),
    # MQA, YaRN, 3 layers, an eps large enough to matter
    "mqa-yarn": _tiny(
        **{
            "attention.n_kv_heads": 1,
            "position.rope_scaling": "yarn",
            "position.rope_factor": 4.0,
            "position.rope_original_max_seq_len": 32,
            "n_layers": 3,
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
    assert hf_model_type(cfg) == "olmo2"
    save_hf(model, tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    assert ("lm_head.weight" in stored) == (not cfg.tie_embeddings)
    assert not any("input_layernorm" in k for k in stored)
    assert stored["model.layers.0.self_attn.q_norm.weight"].shape == (cfg.n_heads * cfg.head_dim,)

    idx = torch.randint(0, V, (2, 40), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(idx)
    mask[1, :7] = 0
    with torch.no_grad():
        ours = model(idx, attention_mask=mask).logits
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert type(ref).__name__ == "Olmo2ForCausalLM"
    theirs = hf_logits(ref.eval(), idx, mask)
    real = mask.bool()
    assert ours.abs().max() > 1.0
    assert (ours[real] - theirs[real]).abs().max() <= TOL

    back = load_hf(tmp_path)  # import(export(x)): the same model, the same numbers
    assert back.cfg.position.rope_layout == "split"
    if cfg.position.rope_layout == "split":
        biases = cfg.attention.qkv_bias or cfg.attention.out_bias
        assert back.cfg == cfg.override({"attention.out_bias": biases})
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


@pytest.mark.parametrize("case", list(CASES))
def test_config_round_trips(case):
    """config.json -> attnlab -> config.json keeps every key transformers' OLMo 2 reads
    (its RoPE parameters in 5.x's form), and attnlab -> config.json -> attnlab is the same
    config."""
    hf = HF.config(case).to_dict()
    cfg = config_from_hf(hf)
    written = config_to_hf(cfg)
    assert written["model_type"] == "olmo2"
    assert written["architectures"] == ["Olmo2ForCausalLM"]
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
        "tie_word_embeddings",
        "initializer_range",
        "rope_parameters",
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


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"hidden_act": "gelu_fast"}, "hidden_act='gelu_fast' is not supported"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
         "RoPE scaling 'dynamic' is not supported"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                              "partial_rotary_factor": 0.5}},
         "partial_rotary_factor=0.5 is not supported"),
        ({"rms_norm_eps": None}, "config.json has no 'rms_norm_eps'"),
        ({"num_key_value_heads": 3}, "n_heads=4 is not divisible by n_kv_heads=3"),
        ({"architectures": ["Olmo2ForSequenceClassification"]},
         "architecture 'Olmo2ForSequenceClassification' is not supported"),
        ({"model_type": "olmo"}, "model_type 'olmo' is not supported"),
    ],
    ids=["activation", "rope", "partial-rotary", "eps", "kv-heads", "head", "olmo-1"],
)  # fmt: skip
def test_config_it_cannot_hold_is_refused_by_name(changes, named):
    hf = {**HF.config("gqa").to_dict(), **changes}
    with pytest.raises(HFCheckpointError, match=named.replace("(", r"\(").replace(")", r"\)")):
        config_from_hf(hf)


def test_minimal_config_is_read_as_transformers_fills_it():
    """Without the keys: Olmo2Config's defaults (eps 1e-5, RoPE base 1e4, MHA, an untied
    head), not attnlab's or the published models' (eps 1e-6, base 5e5)."""
    given = {"model_type": "olmo2", "hidden_size": 32, "num_attention_heads": 4,
             "num_hidden_layers": 2, "vocab_size": V, "intermediate_size": 16}  # fmt: skip
    hf = transformers.AutoConfig.for_model(**given).to_dict()
    cfg = config_from_hf(given)
    assert cfg == config_from_hf(hf)
    assert (cfg.norm.eps, cfg.position.rope_theta, cfg.attention.n_kv_heads) == (1e-5, 1e4, None)
    assert (cfg.tie_embeddings, cfg.max_seq_len) == (False, 2048)


def _message(named: str) -> str:
    return named.replace("(", r"\(").replace(")", r"\)")


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"norm.placement": "pre"},
         "norm.placement='pre' (OLMo 2's is 'post_sublayer'); "
         "attention.qk_norm_scope='projection' exports as olmo2 only"),
        ({"attention.qk_norm_scope": "head"},
         "attention.qk_norm_scope='head' (OLMo 2's is 'projection'); "
         "norm.placement='post_sublayer' exports as olmo2 only"),
        ({"attention.qk_norm": False, "attention.qk_norm_scope": "head"},
         "attention.qk_norm=False (OLMo 2's is True)"),
        ({"norm.kind": "layernorm"}, "norm.kind='layernorm' (OLMo 2's is 'rmsnorm')"),
        ({"ffn.kind": "mlp"}, "ffn.kind='mlp' (OLMo 2's is 'glu')"),
        ({"ffn.bias": True}, "ffn.bias=True (OLMo 2's is False)"),
        ({"position.kind": "learned"}, "position.kind='learned' (OLMo 2's is 'rope')"),
        ({"ffn.kind": "moe", "ffn.n_shared_experts": 0}, "ffn.kind='moe' (OLMo 2's is 'glu')"),
        ({"attention.sliding_window": 8}, "attention.sliding_window (olmo2 attends to every"),
        ({"attention.sink_logits": True}, "attention.sink_logits (olmo2 has none"),
        ({"attention.sliding_window": 8, "attention.sink_tokens": 2},
         "attention.sink_tokens (StreamingLLM's attention sinks)"),
    ],
)  # fmt: skip
def test_export_refuses_what_olmo2_cannot_hold(changes, named, tmp_path):
    cfg = _tiny(**changes)
    with pytest.raises(HFCheckpointError, match=_message(named)):
        save_hf(DecoderLM(cfg), tmp_path)
    assert not (tmp_path / "config.json").exists()


@pytest.mark.parametrize(
    "base, changes, named",
    [
        # LLaMA with OLMo 2's norm placement: exporting it as llama would drop the norms'
        # places; OLMo 2 has QK-norm, which this model lacks
        ("llama-tiny", {"norm.placement": "post_sublayer"},
         "attention.qk_norm=False (OLMo 2's is True); "
         "norm.placement='post_sublayer' exports as olmo2 only"),
        # Qwen3 (QK-norm, pre-norm) with QK-norm over whole projections
        ("llama-tiny", {"attention.qk_norm": True, "attention.qk_norm_scope": "projection"},
         "norm.placement='pre' (OLMo 2's is 'post_sublayer'); "
         "attention.qk_norm_scope='projection' exports as olmo2 only"),
        ("gpt2-tiny", {"norm.placement": "post_sublayer"},
         "position.kind='learned' (OLMo 2's is 'rope'); "
         "norm.placement='post_sublayer' exports as olmo2 only"),
        # Gemma 3's per-head QK-norm over whole projections: Gemma's family takes it (its
        # pieces first) and convert's check names the scope gemma3_text lacks
        ("gemma3-tiny", {"attention.qk_norm_scope": "projection"},
         "attention.qk_norm_scope='projection' (gemma3_text has none; OLMo 2's pieces "
         "export as olmo2"),
        # OLMo 2 with one of Gemma's pieces: Gemma's family takes it first and names what
        # it lacks
        ("olmo2-tiny", {"attention.scale": 0.25},
         "norm.kind='rmsnorm' (Gemma 3's is 'gemma_rmsnorm'); attention.scale exports as gemma"),
    ],
)  # fmt: skip
def test_olmo2_pieces_in_other_layouts_are_refused(base, changes, named):
    """A config with one of OLMo 2's pieces in another family's layout: no layout but
    OLMo 2's holds it (none drops it silently), and the refusal names the field."""
    cfg = get_preset(base).override(changes)
    with pytest.raises(HFCheckpointError, match=_message(named)):
        hf_model_type(cfg)


def test_families_other_than_olmo2_refuse_its_pieces(monkeypatch):
    """convert's own check, should another family take such a config (the OLMo 2 family
    left out of the registry here): the LLaMA layout names the scope it has not, and no
    family takes the placement."""
    from attnlab.interop import convert

    others = tuple(f for f in convert.FAMILIES if f.name != "olmo2")
    monkeypatch.setattr(convert, "FAMILIES", others)
    cfg = get_preset("llama-tiny").override(
        {"attention.qk_norm": True, "attention.qk_norm_scope": "projection"}
    )
    with pytest.raises(HFCheckpointError, match=_message(
        "attention.qk_norm_scope='projection' (qwen3 has none; OLMo 2's pieces export as "
        "olmo2: RoPE, RMSNorm on each sublayer's output, QK-norm over whole projections)"
    )):  # fmt: skip
        hf_model_type(cfg)
    moe = get_preset("llama-tiny").override(
        {"attention.qk_norm": True, "attention.qk_norm_scope": "projection", "ffn.kind": "moe",
         "ffn.router": "deepseek-v2", "ffn.n_shared_experts": 0}
    )  # fmt: skip
    with pytest.raises(HFCheckpointError, match=r"qk_norm_scope='projection' \(qwen3_moe has"):
        hf_model_type(moe)
    with pytest.raises(HFCheckpointError, match=_message(
        "norm.placement='post_sublayer' (OLMo 2's: exports as olmo2 only)"
    )):  # fmt: skip
        hf_model_type(get_preset("olmo2-tiny"))
