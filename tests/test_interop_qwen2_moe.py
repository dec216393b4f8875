"""Qwen2-MoE checkpoints: transformers models from tiny random configs (dense and MoE layers
mixed by decoder_sparse_step and by mlp_only_layers, GQA 4/2 and MHA, top-k weights
renormalised and not, tied and untied heads, a window on some layers, the Switch balance
loss on and off) with every weight set to random values, loaded with ``load_hf``, give the
same logits (with and without left padding), the same greedy tokens, the same loss and
gradients (routers, shared-expert gates, shared and routed experts), and a compiled decode
step gives the eager one's logits; attnlab models saved with ``save_hf`` load in
transformers with the same logits and load back into attnlab exactly; configs neither side
can hold are refused by name. The gated shared expert itself is checked against its
formula.

Shapes: b batch, t length, V vocabulary, d d_model, N tokens, E experts.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from hf_cases import HFCases, transformers
from oracle import (
    assert_greedy_tokens_match_hf,
    assert_left_padded_logits_match_hf,
    assert_logits_match_hf,
    hf_logits,
    hf_training_loss,
    randomize_weights,
)
from safetensors.torch import load_file, save_file
from test_interop import router_gradients_match

from attnlab.config import ConfigError
from attnlab.interop import (
    HFCheckpointError,
    config_from_hf,
    config_to_hf,
    hf_model_type,
    load_hf,
    qwen2_moe,
    save_hf,
)
from attnlab.models.decoder import DecoderLM
from attnlab.nn.moe import MoE
from attnlab.presets import get_preset

V = 97
TOL = 1e-5  # float32: observed up to ~3e-6 on logits up to ~10 (op order)
_COMMON = dict(
    hidden_size=32,
    intermediate_size=40,
    num_attention_heads=4,
    max_position_embeddings=64,
    moe_intermediate_size=8,
    rope_parameters={"rope_type": "default", "rope_theta": 500.0},
)
CASES = {
    # experts on every 2nd layer (1 and 3; 0 and 2 dense), GQA 4/2, 4 experts of which 2,
    # weights not renormalised (Qwen2-MoE's default), a shared expert of 2 x 8, untied
    "step2-gqa": dict(
        _COMMON,
        num_hidden_layers=4,
        num_key_value_heads=2,
        decoder_sparse_step=2,
        num_experts=4,
        num_experts_per_tok=2,
        shared_expert_intermediate_size=16,
    ),
    # a dense middle layer (mlp_only_layers [1]), MHA, 5 experts of which 3 renormalised,
    # a shared expert as wide as one expert, tied; a window of 5 on layer 0 (the even
    # layers below max_window_layers 2); the Switch balance loss on
    "mlp-only-window-norm-tied": dict(
        _COMMON,
        num_hidden_layers=3,
        num_key_value_heads=4,
        mlp_only_layers=[1],
        num_experts=5,
        num_experts_per_tok=3,
        norm_topk_prob=True,
        shared_expert_intermediate_size=8,
        tie_word_embeddings=True,
        use_sliding_window=True,
        sliding_window=5,
        max_window_layers=2,
        output_router_logits=True,
        router_aux_loss_coef=0.3,
    ),
}


# Norm weights in [0.5, 1.5) (transformers starts them at one), biases, routers and shared-expert
# gates (zero at init) and every other weight random.
HF = HFCases("Qwen2MoeConfig", "Qwen2MoeForCausalLM", CASES, V, norms=(0.5, 1.5))
imported = HF.imported_fixture()


def _moe_layers(ref) -> list[int]:
    return [i for i, layer in enumerate(ref.model.layers) if hasattr(layer.mlp, "experts")]


def test_import_config(imported):
    case, ref, model = imported
    cfg, hf = model.cfg, ref.config
    ffn, att = cfg.ffn, cfg.attention
    assert model.num_parameters() == ref.num_parameters()
    assert config_from_hf(hf.to_dict()) == cfg  # the in-memory config, not only config.json
    assert hf_model_type(cfg) == "qwen2_moe"
    assert (ffn.kind, ffn.router, ffn.routed_scaling_factor, ffn.shared_expert_gate) == (
        "moe",
        "deepseek-v2",
        1.0,
        True,
    )
    assert (ffn.n_routed_experts, ffn.n_activated_experts, ffn.moe_hidden_dim) == (
        hf.num_experts,
        hf.num_experts_per_tok,
        8,
    )
    assert ffn.n_shared_experts * 8 == hf.shared_expert_intermediate_size
    assert ffn.norm_topk_prob == hf.norm_topk_prob
    assert [i for i in range(cfg.n_layers) if ffn.moe_layer(i)] == _moe_layers(ref)
    assert att.qkv_bias and not att.out_bias and not att.qk_norm
    assert cfg.n_kv_heads == hf.num_key_value_heads and cfg.tie_embeddings == hf.tie_word_embeddings
    if case == "step2-gqa":
        assert (ffn.first_k_dense, ffn.dense_layers) == (1, [2])
        assert att.sliding_window is None and ffn.switch_aux_loss_coef == 0
    else:
        assert (ffn.first_k_dense, ffn.dense_layers) == (0, [1])
        assert hf.layer_types == ["sliding_attention", "full_attention", "full_attention"]
        assert (att.sliding_window, att.layer_pattern) == (5, "LGG")
        assert ffn.switch_aux_loss_coef == 0.3
    i = _moe_layers(ref)[0]
    ours = model.blocks[i].ffn.shared_gate.weight
    assert torch.equal(ours, ref.model.layers[i].mlp.shared_expert_gate.weight)
    assert ours.abs().max() > 0.1


def test_import_logits(imported):
    case, ref, model = imported
    assert_logits_match_hf(ref, model, V, TOL)


def test_import_logits_left_padding(imported):
    case, ref, model = imported
    assert_left_padded_logits_match_hf(ref, model, V, TOL)


def test_import_greedy_generation(imported):
    """Cached decoding against transformers' cache, one prompt and a left-padded batch.
    (With output_router_logits, transformers' generate computes its balance loss at each
    step from the whole attention mask and one token's router logits, and fails on the
    shapes; the loss takes no part in generation, so it is off here.)"""
    case, ref, model = imported
    router_logits = ref.config.output_router_logits
    ref.config.output_router_logits = False
    try:
        assert_greedy_tokens_match_hf(ref, model, V)
    finally:
        ref.config.output_router_logits = router_logits


def test_training_loss_and_gradients_match_transformers(imported):
    """A loss backward in training mode: the loss (with the Switch balance loss where the
    config turns it on) and the gradients of the routers, the shared-expert gates, the
    shared and routed experts, a dense layer, the q/k/v biases and the embedding are
    transformers'."""
    case, ref, model = imported
    ref, model = ref.train(), model.train()
    idx = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(4))
    targets = torch.cat([idx[:, 1:], torch.full_like(idx[:, :1], -100)], dim=1)
    out = model(idx, targets=targets)
    ours = out.loss + (out.aux_loss if out.aux_loss is not None else 0.0)
    theirs = hf_training_loss(ref, idx, targets)
    ours.backward()
    theirs.backward()
    try:
        assert (out.aux_loss is not None) == ref.config.output_router_logits
        assert abs(ours.item() - theirs.item()) <= 1e-5
        cfg = model.cfg
        i = _moe_layers(ref)[0]
        j = next(j for j in range(cfg.n_layers) if j not in _moe_layers(ref))  # a dense layer
        block, layer = model.blocks[i].ffn, ref.model.layers[i].mlp
        attn, ref_attn = model.blocks[i].attn, ref.model.layers[i].self_attn
        f, s = cfg.ffn.moe_hidden_dim, layer.shared_expert.gate_proj.weight.shape[0]
        q_dim = cfg.n_heads * cfg.head_dim
        pairs = [
            (block.gate.weight.grad, layer.gate.weight.grad),
            (block.shared_gate.weight.grad, layer.shared_expert_gate.weight.grad),
            (block.shared.gate_up.weight.grad[:s], layer.shared_expert.gate_proj.weight.grad),
            (block.shared.gate_up.weight.grad[s:], layer.shared_expert.up_proj.weight.grad),
            (block.shared.down.weight.grad, layer.shared_expert.down_proj.weight.grad),
            (block.experts.gate_up.grad, layer.experts.gate_up_proj.grad),
            (block.experts.down.grad, layer.experts.down_proj.grad),
            (model.blocks[j].ffn.down.weight.grad, ref.model.layers[j].mlp.down_proj.weight.grad),
            (attn.qkv.bias.grad[:q_dim], ref_attn.q_proj.bias.grad),
            (model.tok_emb.weight.grad, ref.model.embed_tokens.weight.grad),
        ]
        assert f * 2 == block.experts.gate_up.shape[1]
        for got, want in pairs:
            assert want.abs().max() > 0  # (a gradient that flows)
            # float32 sums over the batch in different orders: 1e-4
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    finally:
        ref.eval().zero_grad()
        model.eval().zero_grad()


def test_switch_balance_loss_trains_as_in_transformers_and_round_trips(tmp_path):
    """output_router_logits with router_aux_loss_coef imports as ffn.switch_aux_loss_coef:
    the training loss and the routers' gradients are transformers' (the dense layer has no
    router), padded or not; export writes both keys back, and transformers' defaults with
    the loss off."""
    case = "mlp-only-window-norm-tied"
    ref = HF.model(case, seed=42)
    ref.save_pretrained(tmp_path / "hf")
    model = load_hf(tmp_path / "hf")
    assert model.cfg.ffn.switch_aux_loss_coef == 0.3
    for padded in (False, True):
        router_gradients_match(ref, model, padded, seed=7)
    save_hf(model, tmp_path / "out")
    hf = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (hf["output_router_logits"], hf["router_aux_loss_coef"]) == (True, 0.3)
    assert load_hf(tmp_path / "out").cfg == model.cfg
    off = ref.config.to_dict() | {"output_router_logits": False}
    assert config_from_hf(off).ffn.switch_aux_loss_coef == 0
    written = config_to_hf(config_from_hf(off))
    assert (written["output_router_logits"], written["router_aux_loss_coef"]) == (False, 0.001)


@torch.no_grad()
def test_compiled_decode_step_equals_eager(imported):
    """The static-cache decode step of an imported model traces as one graph (backend
    'eager': the tracing without code generation; each token's chosen experts gathered)
    and gives the eager step's logits over a left-padded batch."""
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


def test_stacked_experts_of_a_transformers_state_dict_load(tmp_path):
    """A transformers model's own state dict (experts stacked: experts.gate_up_proj (E,
    2f, d), experts.down_proj (E, d, f)) loads as its checkpoint files (one by one) do."""
    ref = HF.model("step2-gqa", seed=40)
    tensors = {k: v.contiguous() for k, v in ref.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in tensors
    (tmp_path / "sd").mkdir()
    (tmp_path / "sd" / "config.json").write_text(json.dumps(ref.config.to_dict()))
    save_file(tensors, tmp_path / "sd" / "model.safetensors")
    ref.save_pretrained(tmp_path / "files")
    assert "model.layers.3.mlp.experts.3.up_proj.weight" in load_file(
        tmp_path / "files" / "model.safetensors"
    )
    idx = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        stacked = load_hf(tmp_path / "sd")(idx).logits
        files = load_hf(tmp_path / "files")(idx).logits
    assert (stacked - hf_logits(ref, idx)).abs().max() <= TOL
    assert torch.equal(stacked, files)


# --------------------------------------------------------------------------- export


def _tiny(**changes):
    return get_preset("qwen2-moe-tiny").override({"vocab_size": V, **changes})


EXPORTS = {
    # dense layers 0 and 2, experts on 1 and 3 (decoder_sparse_step 2), GQA 4/2, untied
    "qwen2-moe-tiny": _tiny(),
    # no q/k/v biases (qkv_bias false), top-k renormalised, the Switch loss, tied, experts
    # on every layer but the last, a window on layers 1 and 3 only
    "no-bias-norm-window-tied": _tiny(
        **{
            "attention.qkv_bias": False,
            "attention.sliding_window": 6,
            "attention.layer_pattern": "GLGL",
            "ffn.norm_topk_prob": True,
            "ffn.switch_aux_loss_coef": 0.01,
            "ffn.first_k_dense": 0,
            "ffn.dense_layers": [3],
            "tie_embeddings": True,
        }
    ),
}


@pytest.mark.parametrize("name", list(EXPORTS))
def test_export_round_trip(name, tmp_path):
    cfg = EXPORTS[name]
    torch.manual_seed(20)
    model = DecoderLM(cfg).eval()
    # (std 0.12: with 0.2 three MoE layers of d 64 reach logits of ~7, where float32's
    # op order alone gives 2e-5)
    randomize_weights(model, len(name), std=0.12, norms=(0.5, 1.5))
    assert hf_model_type(cfg) == "qwen2_moe"
    save_hf(model, tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    assert ("lm_head.weight" in stored) == (not cfg.tie_embeddings)
    assert ("model.layers.0.self_attn.q_proj.bias" in stored) == cfg.attention.qkv_bias
    assert stored["model.layers.1.mlp.shared_expert_gate.weight"].shape == (1, cfg.d_model)
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in stored  # one by one

    idx = torch.randint(0, V, (2, 40), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(idx)
    mask[1, :7] = 0
    with torch.no_grad():
        ours = model(idx, attention_mask=mask).logits
    # transformers' loop over experts (its default, grouped_mm, rounds differently: ~2e-5)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", experts_implementation="eager"
    )
    assert type(ref).__name__ == "Qwen2MoeForCausalLM"
    assert _moe_layers(ref) == [i for i in range(cfg.n_layers) if cfg.ffn.moe_layer(i)]
    theirs = hf_logits(ref.eval(), idx, mask)
    real = mask.bool()
    assert ours.abs().max() > 1.0
    assert (ours[real] - theirs[real]).abs().max() <= TOL

    back = load_hf(tmp_path)  # import(export(x)): the same model, the same numbers
    assert back.cfg == cfg
    mine = model.state_dict()
    assert back.state_dict().keys() == mine.keys()
    assert all(torch.equal(v, mine[k]) for k, v in back.state_dict().items())
    with torch.no_grad():
        assert torch.equal(back(idx, attention_mask=mask).logits, ours)


@pytest.mark.parametrize("case", list(CASES))
def test_config_round_trips(case):
    """config.json -> attnlab -> config.json -> attnlab is the same config, and the written
    keys build transformers' model with the same layers and sizes."""
    hf = HF.config(case).to_dict()
    cfg = config_from_hf(hf)
    written = config_to_hf(cfg)
    assert written["model_type"] == "qwen2_moe"
    assert written["architectures"] == ["Qwen2MoeForCausalLM"]
    assert config_from_hf(written) == cfg
    rebuilt = transformers.Qwen2MoeConfig(**{k: v for k, v in written.items() if k != "model_type"})
    for key in ("layer_types", "num_experts", "shared_expert_intermediate_size", "qkv_bias"):
        assert getattr(rebuilt, key) == hf[key], key
    for name, exported in EXPORTS.items():
        assert config_from_hf(config_to_hf(exported)) == exported, name


def test_window_without_layer_types_follows_transformers_rule():
    """use_sliding_window without layer_types (older config.json files): transformers'
    Qwen2MoeConfig puts the window on the even layers below max_window_layers."""
    hf = HF.config("mlp-only-window-norm-tied").to_dict()
    del hf["layer_types"]
    for first, pattern in ((2, "LGG"), (3, "LGL"), (0, None)):
        layers = transformers.Qwen2MoeConfig(**{**hf, "max_window_layers": first}).layer_types
        att = config_from_hf({**hf, "max_window_layers": first}).attention
        assert att.layer_pattern == pattern
        assert [k == "sliding_attention" for k in layers] == [
            att.window_of(i) is not None for i in range(3)
        ]


# --------------------------------------------------------------------------- refusals


def test_configs_it_cannot_hold_are_refused_by_name():
    hf = HF.config("step2-gqa").to_dict()
    with pytest.raises(HFCheckpointError, match="shared_expert_intermediate_size=12 is not a"):
        config_from_hf({**hf, "shared_expert_intermediate_size": 12})
    with pytest.raises(HFCheckpointError, match="decoder_sparse_step must be >= 1, got 0"):
        config_from_hf({**hf, "decoder_sparse_step": 0})
    assert config_from_hf({**hf, "num_experts": 0}).ffn.kind == "glu"  # a dense Qwen2
    assert hf_model_type(config_from_hf({**hf, "mlp_only_layers": [1, 3]})) == "qwen2"

    cfg = get_preset("qwen2-moe-tiny")
    for changes, named in (
        ({"attention.qk_norm": True}, "attention.qk_norm=True (Qwen2-MoE's is False)"),
        ({"attention.out_bias": True}, "attention.out_bias=True"),
        ({"ffn.router": "deepseek-v3"}, "ffn.router='deepseek-v3'"),
        ({"ffn.routed_scaling_factor": 2.0}, "ffn.routed_scaling_factor=2.0"),
        ({"ffn.n_groups": 2, "ffn.topk_groups": 2}, "ffn.n_groups=2"),
        ({"ffn.expert_bias": True}, "ffn.expert_bias=True"),
        ({"norm.kind": "layernorm"}, "norm.kind='layernorm'"),
    ):
        with pytest.raises(HFCheckpointError, match=named.replace("(", r"\(").replace(")", r"\)")):
            hf_model_type(cfg.override(changes))
    with pytest.raises(HFCheckpointError, match=r"shared_expert_gate=False \(Qwen2-MoE gates"):
        qwen2_moe.export_type(cfg.override({"ffn.shared_expert_gate": False}))
    # without the gate, shared experts are DeepSeek's (MLA) or refused by Qwen3-MoE / Mixtral
    ungated = {"ffn.shared_expert_gate": False, "ffn.first_k_dense": 0, "ffn.dense_layers": []}
    with pytest.raises(HFCheckpointError, match="ffn.n_shared_experts=2"):
        hf_model_type(cfg.override(ungated))
    # the families without a gate or with dense layers first only say so
    mla = get_preset("deepseek-moe-tiny")
    with pytest.raises(HFCheckpointError, match="ffn.shared_expert_gate"):
        hf_model_type(mla.override({"ffn.shared_expert_gate": True}))
    with pytest.raises(HFCheckpointError, match=r"ffn.dense_layers=\[1\]"):
        hf_model_type(mla.override({"ffn.first_k_dense": 0, "ffn.dense_layers": [1]}))
    mixtral = get_preset("mixtral-8x7b").override({"n_layers": 2, "ffn.dense_layers": [1]})
    with pytest.raises(HFCheckpointError, match=r"ffn.dense_layers=\[1\] \(Mixtral"):
        hf_model_type(mixtral)


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"ffn.n_shared_experts": 0}, "ffn.shared_expert_gate: gates a mixture of experts'"),
        ({"ffn.kind": "glu"}, "ffn.shared_expert_gate: gates a mixture of experts'"),
        ({"ffn.dense_layers": [2, 2]}, "ffn.dense_layers: must be distinct layers"),
        ({"ffn.dense_layers": [-1]}, "ffn.dense_layers: must be distinct layers"),
        ({"ffn.dense_layers": [2, 4]}, "ffn.dense_layers: layer 4 is not below n_layers=4"),
    ],
)
def test_config_validation_names_the_field(changes, named):
    with pytest.raises(ConfigError, match=named):
        get_preset("qwen2-moe-tiny").override(changes)


# --------------------------------------------------------------------------- the gate


def test_gated_shared_expert_is_its_formula():
    """y = sum_{topk} g_i FFN_i(x) + sigmoid(x w_g) FFN_shared(x), written out with a loop
    over tokens and their experts (softmax router, top-k weights not renormalised)."""
    cfg = get_preset("qwen2-moe-tiny").ffn
    d = 16
    torch.manual_seed(0)
    moe = MoE(d, cfg).eval()
    randomize_weights(moe, 3, std=0.4, norms=(1.0, 1.0))
    x = torch.randn(2, 5, d)
    with torch.no_grad():
        got = moe(x)
        want = torch.empty_like(x)
        f, s = cfg.moe_hidden_dim, cfg.moe_hidden_dim * cfg.n_shared_experts
        for n, v in enumerate(x.reshape(-1, d)):
            probs = (moe.gate.weight @ v).softmax(-1)  # (E,)
            top = probs.topk(cfg.n_activated_experts)
            y = torch.zeros(d)
            for p, e in zip(top.values, top.indices, strict=True):
                gate, up = (moe.experts.gate_up[e] @ v).split(f)
                y += p * (moe.experts.down[e] @ (F.silu(gate) * up))
            gate, up = (moe.shared.gate_up.weight @ v).split(s)
            shared = moe.shared.down.weight @ (F.silu(gate) * up)
            y += torch.sigmoid(moe.shared_gate.weight @ v) * shared
            want.view(-1, d)[n] = y
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert moe.shared_gate.weight.shape == (1, d)
    assert MoE(d, dataclasses.replace(cfg, shared_expert_gate=False)).shared_gate is None
