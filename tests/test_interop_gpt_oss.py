"""GPT-OSS checkpoints: transformers models from tiny random configs (local and global
layers in transformers' default alternation and in a pattern of their own, GQA and MHA,
YaRN with its ramp bounds not rounded and plain RoPE, attention biases on and off, tied and
untied heads, a clamp the experts' activations reach) with every bias and sink logit set
to random values (transformers starts them at zero), loaded with ``load_hf``, give the same
logits (with and without left padding), the same greedy tokens (one prompt and a ragged
batch) and the same gradients; attnlab models saved with ``save_hf`` load in transformers
with the same logits and load back into attnlab exactly; configs neither side can hold are
refused by name. (The command line: tests/test_interop_cli.py.)

Shapes: b batch, t length, V vocabulary, E experts, d d_model, f expert hidden size.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from hf_cases import HFCases, transformers
from oracle import (
    assert_greedy_tokens_match_hf,
    assert_left_padded_logits_match_hf,
    hf_logits,
)
from safetensors.torch import load_file
from test_interop import router_gradients_match

from attnlab.interop import HFCheckpointError, config_from_hf, hf_model_type, load_hf, save_hf
from attnlab.models.decoder import DecoderLM
from attnlab.presets import get_preset
from attnlab.training.optim import parameter_groups

V = 97
TOL = 1e-4  # float32: observed up to 3e-5 on logits up to ~8 (op order; relative ~4e-6)
YARN = dict(
    rope_type="yarn",
    rope_theta=150000.0,
    factor=8.0,
    beta_fast=32.0,
    beta_slow=1.0,
    truncate=False,  # gpt-oss's: the ramp bounds kept unrounded
    original_max_position_embeddings=32,
)
CASES = {
    # transformers' default layer_types (sliding, full, ...), a window shorter than the
    # inputs, GQA, head_dim != d / h, YaRN, biases, untied; a clamp of 1 (the projections'
    # values reach ~5): most gates and ups are clamped
    "alternating-yarn-gqa": dict(
        hidden_size=32,
        intermediate_size=24,
        head_dim=12,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=5,
        max_position_embeddings=256,  # factor x original: no mismatch warning
        rope_parameters=YARN,
        swiglu_limit=1.0,
    ),
    # a pattern of its own (global first), MHA, no attention biases, a tied head, plain
    # RoPE, one expert per token out of 3, another alpha and limit
    "pattern-mha-tied": dict(
        hidden_size=32,
        intermediate_size=16,
        head_dim=8,  # d / h
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_local_experts=3,
        num_experts_per_tok=1,
        sliding_window=4,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"],
        max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        attention_bias=False,
        tie_word_embeddings=True,
        swiglu_alpha=1.3,
        swiglu_limit=2.5,
    ),
}


class _GptOssCases(HFCases):
    def randomize(self, model: torch.nn.Module, seed: int) -> None:
        """Every parameter far from its init (biases and sinks start at zero in transformers)
        so that a wrong mapping changes the logits a lot: HFCases' rule, but sink logits
        of std 1."""
        low, high = self.norms
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.copy_(torch.rand(p.shape, generator=g) * (high - low) + low)
                elif name.endswith(("sinks", "sink_logit")):
                    p.copy_(torch.randn(p.shape, generator=g))  # a sink that takes real weight
                else:
                    p.copy_(0.3 * torch.randn(p.shape, generator=g))


HF = _GptOssCases("GptOssConfig", "GptOssForCausalLM", CASES, V, norms=(0.5, 1.5))
imported = HF.imported_fixture()


def test_import_config(imported):
    case, ref, model = imported
    cfg, hf = model.cfg, ref.config
    att, ffn = cfg.attention, cfg.ffn
    assert model.num_parameters() == ref.num_parameters()
    assert config_from_hf(hf.to_dict()) == cfg  # the in-memory config, not only config.json
    assert att.sink_logits and att.qkv_bias == att.out_bias == hf.attention_bias
    assert (cfg.head_dim, cfg.n_kv_heads) == (hf.head_dim, hf.num_key_value_heads)
    # the layer pattern repeats: each layer's window is the one layer_types gives it
    windows = [att.window_of(i) for i in range(cfg.n_layers)]
    assert windows == [hf.sliding_window if t == "sliding_attention" else None
                       for t in hf.layer_types]  # fmt: skip
    if case == "alternating-yarn-gqa":
        assert att.layer_pattern == "LG"  # the shortest period
        assert (cfg.position.rope_scaling, cfg.position.rope_truncate) == ("yarn", False)
    assert (ffn.kind, ffn.activation, ffn.router, ffn.norm_topk_prob) == (
        "moe",
        "clamped_swiglu",
        "deepseek-v2",
        True,
    )
    assert (ffn.swiglu_alpha, ffn.swiglu_limit) == (hf.swiglu_alpha, hf.swiglu_limit)
    assert ffn.router_bias and ffn.expert_bias and ffn.n_shared_experts == 0
    assert (ffn.n_routed_experts, ffn.n_activated_experts, ffn.moe_hidden_dim) == (
        hf.num_local_experts,
        hf.num_experts_per_tok,
        hf.intermediate_size,
    )
    assert cfg.tie_embeddings == hf.tie_word_embeddings
    # the biases and sinks are loaded, not left at zero
    assert torch.equal(model.blocks[1].ffn.gate.bias, ref.model.layers[1].mlp.router.bias)
    assert torch.equal(model.blocks[1].attn.sink_logit, ref.model.layers[1].self_attn.sinks)
    assert model.blocks[1].ffn.experts.down_bias.abs().max() > 0.1


def test_import_logits(imported, monkeypatch):
    case, ref, model = imported
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    reached = []  # the largest |gate|, |up| value transformers' experts clamp
    apply_gate = GptOssExperts._apply_gate

    def recording(self, gate_up):
        reached.append(gate_up.abs().max().item())
        return apply_gate(self, gate_up)

    monkeypatch.setattr(GptOssExperts, "_apply_gate", recording)
    idx = torch.randint(0, V, (3, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(idx).logits
    theirs = hf_logits(ref, idx)
    assert max(reached) > ref.config.swiglu_limit  # the clamp takes part
    assert theirs.abs().max() > 1.0  # the comparison is not between near-zero logits
    assert (ours - theirs).abs().max() <= TOL


def test_import_logits_left_padding(imported):
    case, ref, model = imported
    assert_left_padded_logits_match_hf(ref, model, V, TOL)


def test_import_greedy_generation(imported):
    """Past the window: the local layers' rolling caches against transformers' cache."""
    case, ref, model = imported
    assert_greedy_tokens_match_hf(ref, model, V)


def test_training_gradients_match_transformers(imported):
    """A loss backward through the imported model in training mode: the loss and the
    gradients of the router (weight and bias), the sink logits, the experts' projections
    and biases and the embedding are transformers' (the router bias trains by gradient, as
    its weight does, when tokens choose more than one expert), and all are finite."""
    case, ref, model = imported
    ref, model = ref.train(), model.train()
    idx = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(4))
    ours = model(idx[:, :-1], targets=idx[:, 1:]).loss
    theirs = F.cross_entropy(ref(idx[:, :-1]).logits.flatten(0, 1), idx[:, 1:].flatten())
    ours.backward()
    theirs.backward()
    try:
        assert abs(ours.item() - theirs.item()) <= 1e-5
        assert all(p.grad is not None and torch.isfinite(p.grad).all()
                   for p in model.parameters())  # fmt: skip
        i = 1
        block, layer = model.blocks[i], ref.model.layers[i]
        moe, experts = block.ffn, layer.mlp.experts

        def interleaved(t):  # attnlab's [gate; up] as transformers' gate0 up0 gate1 up1 ...
            gate, up = t.chunk(2, dim=-1)
            return torch.stack((gate, up), dim=-1).flatten(-2)

        pairs = [
            (moe.gate.weight.grad, layer.mlp.router.weight.grad),
            (moe.gate.bias.grad, layer.mlp.router.bias.grad),
            (block.attn.sink_logit.grad, layer.self_attn.sinks.grad),
            (moe.experts.down_bias.grad, experts.down_proj_bias.grad),
            (interleaved(moe.experts.gate_up_bias.grad), experts.gate_up_proj_bias.grad),
            (interleaved(moe.experts.gate_up.grad.transpose(1, 2)), experts.gate_up_proj.grad),
            (moe.experts.down.grad.transpose(1, 2), experts.down_proj.grad),
            (model.tok_emb.weight.grad, ref.model.embed_tokens.weight.grad),
        ]
        # the router (bias too) learns through the softmax over each token's k experts;
        # with k = 1 that weight is 1 whatever the logits: no gradient, in both
        learns = moe.gate.bias.grad.abs().max() > 1e-4
        assert learns == (ref.config.num_experts_per_tok > 1)
        for got, want in pairs:
            # float32 sums over the batch in different orders: 1e-4
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    finally:
        ref.eval().zero_grad()
        model.eval().zero_grad()


def test_switch_balance_loss_trains_as_in_transformers_and_round_trips(tmp_path):
    """output_router_logits with router_aux_loss_coef imports as ffn.switch_aux_loss_coef:
    transformers' loss takes the router logits with their bias, and so does attnlab's; the
    loss and the routers' gradients (weight and bias) agree, padded or not; export writes
    the keys back."""
    torch.manual_seed(0)
    hf = HF.config("alternating-yarn-gqa")
    hf.output_router_logits, hf.router_aux_loss_coef = True, 0.3
    ref = transformers.GptOssForCausalLM(hf)
    HF.randomize(ref, seed=8)
    ref.save_pretrained(tmp_path / "hf")
    model = load_hf(tmp_path / "hf")
    assert model.cfg.ffn.switch_aux_loss_coef == 0.3
    for padded in (False, True):
        router_gradients_match(ref, model, padded, seed=9)
    save_hf(model, tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (written["output_router_logits"], written["router_aux_loss_coef"]) == (True, 0.3)
    assert load_hf(tmp_path / "out").cfg == model.cfg
    off = _hf_dict() | {"router_aux_loss_coef": 0.3}  # output_router_logits false: no loss
    assert config_from_hf(off).ffn.switch_aux_loss_coef == 0


def test_expert_and_router_biases_take_no_weight_decay():
    """The experts' biases are (E, 2f) and (E, d) matrices, one row per expert: biases
    all the same, left out of weight decay like every other bias (and the router's)."""
    model = DecoderLM(get_preset("gpt-oss-tiny"))
    decay, no_decay = parameter_groups(model, 0.1)
    decayed = {id(p) for p in decay["params"]}
    names = {id(p): n for n, p in model.named_parameters()}
    biases = [n for n in names.values() if n.endswith(("_bias", "gate.bias", "sink_logit"))]
    assert len(biases) == 4 * model.cfg.n_layers
    assert not [names[i] for i in decayed if names[i] in biases]
    assert id(model.blocks[0].ffn.experts.gate_up) in decayed
    assert no_decay["weight_decay"] == 0.0


# --------------------------------------------------------------------------- export


def _tiny(**changes):
    return get_preset("gpt-oss-tiny").override({"vocab_size": V, **changes})


EXPORTS = {
    "gpt-oss-tiny": _tiny(),
    # no biases anywhere (written as zeros), interleaved RoPE pairs (q/k rows permuted to
    # the split halves), every layer local, tied, GQA 4/1, plain RoPE
    "no-biases-interleaved-local": _tiny(
        **{
            "attention.qkv_bias": False,
            "attention.out_bias": False,
            "ffn.router_bias": False,
            "ffn.expert_bias": False,
            "position.rope_layout": "interleaved",
            "attention.layer_pattern": None,
            "attention.sliding_window": 6,
            "tie_embeddings": True,
            "attention.n_kv_heads": 1,
            "position.rope_scaling": None,
        }
    ),
    # no window anywhere (transformers still needs one: written, used by no layer); q/k/v
    # biases only (o_proj's written as zeros), 3 layers, top 3 of 4
    "global-only": _tiny(
        **{
            "attention.layer_pattern": None,
            "attention.sliding_window": None,
            "attention.out_bias": False,
            "n_layers": 3,
            "ffn.n_activated_experts": 3,
            "ffn.swiglu_limit": 0.5,
        }
    ),
}


@pytest.mark.parametrize("name", list(EXPORTS))
def test_export_round_trip(name, tmp_path):
    cfg = EXPORTS[name]
    torch.manual_seed(20)
    model = DecoderLM(cfg).eval()
    HF.randomize(model, seed=len(name))
    assert hf_model_type(cfg) == "gpt_oss"
    save_hf(model, tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    assert ("lm_head.weight" in stored) == (not cfg.tie_embeddings)

    idx = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(idx)
    mask[1, :7] = 0
    with torch.no_grad():
        ours = model(idx, attention_mask=mask).logits
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert type(ref).__name__ == "GptOssForCausalLM"
    theirs = hf_logits(ref.eval(), idx, mask)
    real = mask.bool()
    assert ours.abs().max() > 1.0
    assert (ours[real] - theirs[real]).abs().max() <= TOL

    back = load_hf(tmp_path)  # import(export(x)): the same model, the same numbers
    assert back.cfg.position.rope_layout == "split"
    if cfg.position.rope_layout == "split":
        assert back.cfg == cfg.override({"ffn.router_bias": True, "ffn.expert_bias": True,
                                         "attention.qkv_bias": True, "attention.out_bias": True,
                                         "ffn.bias": False, "init_std": cfg.init_std})  # fmt: skip
        mine = model.state_dict()
        for key, value in back.state_dict().items():
            want = mine.get(key, torch.zeros_like(value))  # biases it had not: zeros
            assert torch.equal(value, want), key
    with torch.no_grad():
        again = back(idx, attention_mask=mask).logits
    # the same sums (zero biases added), or, interleaved pairs read as split halves, q . k
    # summed in another order
    tol = 1e-5 if cfg.position.rope_layout == "split" else TOL
    assert (again - ours)[real].abs().max() <= tol
    save_hf(back, tmp_path / "again")  # export(import(export(x))) writes the same tensors
    twice = load_file(tmp_path / "again" / "model.safetensors")
    assert twice.keys() == stored.keys()
    assert all(torch.equal(twice[k], stored[k]) for k in stored)


def test_transformers_state_dict_is_the_checkpoint_layout(tmp_path):
    """GPT-OSS's experts are stacked in transformers' own state dict and in its files: one
    layout, read the same way."""
    ref = HF.model("alternating-yarn-gqa", seed=7)
    ref.save_pretrained(tmp_path)
    assert set(load_file(tmp_path / "model.safetensors")) == set(ref.state_dict())


# --------------------------------------------------------------------------- refusals


def _hf_dict(case: str = "alternating-yarn-gqa") -> dict:
    return HF.config(case).to_dict()


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"quantization_config": {"quant_method": "mxfp4"}}, "quantization_config (mxfp4)"),
        ({"layer_types": ["sliding_attention"] * 3}, "layer_types"),
        ({"layer_types": ["chunked_attention"] * 4}, "layer_types"),
        ({"sliding_window": None}, "sliding_window is null"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "RoPE scaling 'dynamic'"),
        ({"num_experts_per_tok": 5}, "ffn.n_activated_experts"),
        ({"num_hidden_layers": "four"}, "num_hidden_layers must be a positive integer"),
    ],
    ids=["mxfp4", "layer-count", "layer-kind", "no-window", "rope", "top-k", "layers"],
)
def test_config_it_cannot_hold_is_refused_by_name(changes, named):
    with pytest.raises(HFCheckpointError, match=named.replace("(", r"\(").replace(")", r"\)")):
        config_from_hf({**_hf_dict(), **changes})


def test_config_read_as_transformers_fills_it():
    """num_experts is num_local_experts' other name; without layer_types the layers
    alternate, sliding first; without RoPE parameters YaRN x32 of theta 150000, as
    GptOssConfig fills them; global layers only have no window."""
    given = {"model_type": "gpt_oss", "hidden_size": 32, "num_attention_heads": 8,
             "num_hidden_layers": 3, "vocab_size": V, "intermediate_size": 16}  # fmt: skip
    for extra in ({"num_experts": 4}, {"num_local_experts": 4}, {"rope_theta": 1e4}):
        hf = transformers.AutoConfig.for_model(**given, **extra).to_dict()
        assert config_from_hf({**given, **extra}) == config_from_hf(hf)
    cfg = config_from_hf({**given, "num_experts": 4})
    assert cfg.ffn.n_routed_experts == 4 and cfg.attention.layer_pattern == "LG"
    pos = cfg.position
    assert (pos.rope_scaling, pos.rope_factor, pos.rope_theta) == ("yarn", 32.0, 150000.0)
    full = config_from_hf({**given, "layer_types": ["full_attention"] * 3})
    assert full.attention.sliding_window is None and full.attention.layer_pattern is None


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"attention.sink_logits": False}, "set attention.sink_logits"),
        ({"norm.kind": "layernorm"}, "norm.kind='layernorm'"),
        ({"ffn.norm_topk_prob": False}, "ffn.norm_topk_prob=False"),
        ({"ffn.n_shared_experts": 1}, "ffn.n_shared_experts=1"),
        ({"ffn.router": "deepseek-v3"}, "ffn.router='deepseek-v3'"),
        ({"ffn.routed_scaling_factor": 2.0}, "ffn.routed_scaling_factor=2.0"),
        ({"ffn.first_k_dense": 1}, "ffn.first_k_dense=1"),
        ({"ffn.n_groups": 2, "ffn.router": "deepseek-v2"}, "ffn.n_groups=2"),
        ({"ffn.activation": "silu"}, "ffn.activation='silu'"),
        ({"attention.qk_norm": True}, "attention.qk_norm (gpt_oss has no QK-norm"),
    ],
)
def test_export_refuses_what_gpt_oss_cannot_hold(changes, named, tmp_path):
    cfg = _tiny(**changes)
    with pytest.raises(HFCheckpointError, match=named.replace("(", r"\(")):
        save_hf(DecoderLM(cfg), tmp_path)
    assert not (tmp_path / "config.json").exists()


@pytest.mark.parametrize(
    "changes, named",
    [
        # Qwen3-MoE's router and experts have no biases
        ({"ffn.router_bias": True}, "ffn.router_bias (qwen3_moe has none"),
        ({"ffn.expert_bias": True}, "ffn.expert_bias (qwen3_moe has none"),
        # a dense LLaMA-style model with GPT-OSS's activation or sinks
        ({"ffn.kind": "glu", "ffn.activation": "clamped_swiglu", "attention.qk_norm": False},
         "ffn.activation='clamped_swiglu' (llama has none"),
        ({"ffn.kind": "glu", "attention.sink_logits": True, "attention.qk_norm": False},
         "attention.sink_logits (llama has none"),
    ],
)  # fmt: skip
def test_gpt_oss_pieces_other_families_lack_are_refused(changes, named):
    qwen3_moe = {"attention.qk_norm": True, "ffn.kind": "moe", "ffn.router": "deepseek-v2",
                 "ffn.n_routed_experts": 4, "ffn.n_activated_experts": 2,
                 "ffn.n_shared_experts": 0, "ffn.moe_hidden_dim": 16}  # fmt: skip
    base = get_preset("llama-tiny").override(qwen3_moe)
    assert hf_model_type(base) == "qwen3_moe"
    with pytest.raises(HFCheckpointError, match=named.replace("(", r"\(")):
        hf_model_type(base.override(changes))
