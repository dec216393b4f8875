"""Mixture of experts: the grouped expert computation against a direct loop over tokens,
both routers against transformers' DeepSeek-V3/V2 routers, dense first layers, the
aux-loss-free bias update, the sequence-wise balance loss and the Switch balance loss.

Shapes: N tokens, d d_model, E experts, k experts per token.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from oracle import sequence_balance_loss, switch_balance_loss

from attnlab.config import ConfigError, FFNConfig
from attnlab.models import build_model
from attnlab.models.outputs import collect_aux
from attnlab.nn.feedforward import GatedFFN
from attnlab.nn.moe import MoE, update_router_biases
from attnlab.presets import get_preset

D = 16


def _moe(**kw) -> MoE:
    cfg = FFNConfig.from_dict({"kind": "moe", "activation": "silu", "moe_hidden_dim": 12, **kw})
    return MoE(D, cfg).eval()


def _loop_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: route, run each chosen expert, weigh, add the shared experts."""
    flat = x.reshape(-1, D)
    weights, experts, _ = moe.gate(flat)
    out = torch.zeros_like(flat)
    for n in range(flat.shape[0]):
        for j in range(experts.shape[1]):
            out[n] += weights[n, j] * moe.experts.expert(int(experts[n, j]), flat[n : n + 1])[0]
    y = out.view_as(x)
    return y + moe.shared(x) if moe.shared is not None else y


# GPT-OSS's experts: a router with bias, softmax over the top k, biased clamped SwiGLUs
GPT_OSS = dict(router="deepseek-v2", norm_topk_prob=True, n_shared_experts=0,
               router_bias=True, expert_bias=True, activation="clamped_swiglu")  # fmt: skip
FAST_PATH_CASES = [dict(router="deepseek-v3"), dict(router="deepseek-v2", n_shared_experts=0),
                   GPT_OSS, dict(GPT_OSS, swiglu_limit=0.3)]  # fmt: skip


def _randomize_biases(moe: MoE) -> None:
    """Biases start at zero: nonzero ones, so that a path leaving one out shows."""
    for p in (moe.gate.bias, moe.experts.gate_up_bias, moe.experts.down_bias):
        if p is not None:
            p.normal_(std=0.5)


@pytest.mark.parametrize(
    "router_kw",
    [
        dict(router="deepseek-v3", n_groups=4, topk_groups=2, routed_scaling_factor=2.5),
        dict(router="deepseek-v3", n_shared_experts=0),
        dict(router="deepseek-v2", norm_topk_prob=False),
        dict(router="deepseek-v2", n_groups=2, topk_groups=1, n_shared_experts=2),
        GPT_OSS,
        # the GPT-OSS pieces with shared experts (biased too) and the sigmoid router
        dict(GPT_OSS, router="deepseek-v3", n_shared_experts=1, swiglu_limit=0.5),
    ],
)
@torch.no_grad()
def test_grouped_experts_equal_a_loop_over_tokens(router_kw):
    moe = _moe(n_routed_experts=8, n_activated_experts=3, **router_kw)
    _randomize_biases(moe)
    if moe.gate.e_score_correction_bias is not None:
        moe.gate.e_score_correction_bias.normal_(std=0.1)
    x = torch.randn(3, 7, D)
    torch.testing.assert_close(moe(x), _loop_reference(moe, x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kw", FAST_PATH_CASES, ids=["v3", "v2", "gpt-oss", "gpt-oss-clamped"])
@torch.no_grad()
def test_gathered_experts_equal_the_grouped_ones(kw):
    """The compiled decode path (each token's chosen experts' weights gathered) computes
    what the grouped loop does, on fresh random inputs."""
    moe = _moe(n_routed_experts=8, n_activated_experts=3, **kw)
    _randomize_biases(moe)
    for n in (1, 2, 5):
        x = torch.randn(n, D)
        weights, experts, _ = moe.gate(x)
        torch.testing.assert_close(
            moe.experts.gathered(x, experts, weights),
            moe.experts(x, experts, weights),
            rtol=1e-5,
            atol=1e-6,
        )


@pytest.mark.parametrize("kw", FAST_PATH_CASES, ids=["v3", "v2", "gpt-oss", "gpt-oss-clamped"])
@torch.no_grad()
def test_dense_experts_equal_the_grouped_ones(kw):
    """The compiled decode path of larger batches (every expert on every token, weighted
    by each token's gates, 0 for the others) computes what the grouped loop does; the
    experts' biases reach unchosen experts' outputs, which their zero gates drop."""
    moe = _moe(n_routed_experts=8, n_activated_experts=3, **kw)
    _randomize_biases(moe)
    for n in (3, 17):
        x = torch.randn(n, D)
        weights, experts, _ = moe.gate(x)
        torch.testing.assert_close(
            moe.experts.dense(x, experts, weights),
            moe.experts(x, experts, weights),
            rtol=1e-5,
            atol=1e-5,
        )


@torch.no_grad()
def test_gpt_oss_router_and_experts_match_transformers():
    """transformers' GptOssTopKRouter (top k of the logits x W^T + b, softmax over them)
    is the deepseek-v2 router renormalised over the top k with a bias; its GptOssExperts
    (x @ gate_up_proj[e] + bias, gate and up interleaved, clamped SwiGLU, @ down_proj[e] +
    bias) are attnlab's experts with the weights transposed and de-interleaved."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts, GptOssTopKRouter

    f = 12
    hf_cfg = transformers.GptOssConfig(hidden_size=D, intermediate_size=f, num_local_experts=8,
                                       num_experts_per_tok=3, swiglu_limit=1.5)  # fmt: skip
    router, experts = GptOssTopKRouter(hf_cfg), GptOssExperts(hf_cfg)
    for p in (*router.parameters(), *experts.parameters()):
        p.normal_(std=0.5)
    moe = _moe(n_routed_experts=8, n_activated_experts=3, moe_hidden_dim=f, swiglu_limit=1.5,
               **GPT_OSS)  # fmt: skip
    moe.gate.weight.copy_(router.weight)
    moe.gate.bias.copy_(router.bias)

    def split(t):  # transformers' gate0 up0 gate1 up1 ... -> [gate; up]
        return torch.cat((t[..., ::2], t[..., 1::2]), dim=-1)

    moe.experts.gate_up.copy_(split(experts.gate_up_proj).transpose(1, 2))
    moe.experts.gate_up_bias.copy_(split(experts.gate_up_proj_bias))
    moe.experts.down.copy_(experts.down_proj.transpose(1, 2))
    moe.experts.down_bias.copy_(experts.down_proj_bias)
    x = torch.randn(50, D)
    _, ref_w, ref_i = router(x)
    w, i, _ = moe.gate(x)
    ref = torch.zeros(50, 8).scatter_(1, ref_i, ref_w)  # order of the k choices is free
    torch.testing.assert_close(torch.zeros(50, 8).scatter_(1, i, w), ref)
    torch.testing.assert_close(moe(x[None])[0], experts(x, ref_i, ref_w), rtol=1e-5, atol=1e-5)


def test_defaults_keep_existing_moe_models_unchanged():
    """Configs written before GPT-OSS (no router_bias, expert_bias, swiglu_* keys) load
    with them off: the same model, with no new parameters."""
    cfg = get_preset("deepseek-moe-tiny")
    old = cfg.to_dict()
    for key in ("router_bias", "expert_bias", "swiglu_alpha", "swiglu_limit"):
        del old["ffn"][key]
    assert type(cfg).from_dict(old) == cfg
    names = set(build_model(cfg).state_dict())
    assert not [n for n in names if n.endswith(("gate.bias", "gate_up_bias", "down_bias"))]


def _hf_router_config(**kw):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        hidden_size=D, num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=3, **kw
    )


@torch.no_grad()
def test_v3_router_matches_transformers():
    pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    hf = DeepseekV3TopkRouter(_hf_router_config(n_group=4, topk_group=2, routed_scaling_factor=2.5))
    hf.weight.normal_()
    hf.e_score_correction_bias.normal_(std=0.3)  # large enough to change choices
    moe = _moe(
        n_routed_experts=8,
        n_activated_experts=3,
        n_groups=4,
        topk_groups=2,
        routed_scaling_factor=2.5,
    )
    moe.gate.weight.copy_(hf.weight)
    moe.gate.e_score_correction_bias.copy_(hf.e_score_correction_bias)
    x = torch.randn(50, D)
    _, ref_w, ref_i = hf(x)
    w, i, _ = moe.gate(x)
    ref = torch.zeros(50, 8).scatter_(1, ref_i, ref_w)  # order of the k choices is free
    ours = torch.zeros(50, 8).scatter_(1, i, w)
    torch.testing.assert_close(ours, ref)


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
@torch.no_grad()
def test_v2_router_matches_transformers(method):
    pytest.importorskip("transformers")
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    groups = 4 if method == "group_limited_greedy" else None
    hf_cfg = DeepseekV2Config(
        hidden_size=D,
        num_attention_heads=4,
        n_routed_experts=8,
        num_experts_per_tok=3,
        topk_method=method,
        n_group=groups,
        topk_group=2 if groups else None,
        routed_scaling_factor=1.5,
    )
    hf = DeepseekV2TopkRouter(hf_cfg)
    hf.weight.normal_()
    moe = _moe(
        router="deepseek-v2",
        n_routed_experts=8,
        n_activated_experts=3,
        n_groups=groups or 1,
        topk_groups=2 if groups else 1,
        norm_topk_prob=False,
        routed_scaling_factor=1.5,
    )
    moe.gate.weight.copy_(hf.weight)
    x = torch.randn(50, D)
    _, ref_w, ref_i = hf(x)
    w, i, _ = moe.gate(x)
    ref = torch.zeros(50, 8).scatter_(1, ref_i, ref_w)
    torch.testing.assert_close(torch.zeros(50, 8).scatter_(1, i, w), ref)


def test_first_k_dense_layers_are_dense():
    model = build_model(get_preset("deepseek-moe-tiny"))
    assert isinstance(model.blocks[0].ffn, GatedFFN)
    assert isinstance(model.blocks[1].ffn, MoE)


MOE = {"ffn.kind": "moe", "ffn.activation": "silu", "ffn.n_routed_experts": 4,
       "ffn.n_activated_experts": 1, "ffn.moe_hidden_dim": 8}  # fmt: skip


def test_first_k_dense_layers_are_dense_in_transformer_xl():
    """Transformer-XL built every block as layer 0, so first_k_dense=1 made all its FFNs
    dense: no MoE layer at all."""
    model = build_model(get_preset("xl-tiny").override({**MOE, "ffn.first_k_dense": 1}))
    assert len(model.blocks) > 1 and isinstance(model.blocks[0].ffn, GatedFFN)
    assert all(isinstance(block.ffn, MoE) for block in model.blocks[1:])


@pytest.mark.parametrize(
    "preset", ["deepseek-moe-tiny", "xl-tiny", "bert-tiny-mlm", "transformer-numbers", "vit-digits"]
)
def test_routed_experts_start_at_init_std_in_every_architecture(preset):
    """design.md: routed experts' stacked weights keep ``init_std``; only the decoder gave
    them it, the other architectures left the experts and routers at 0.02."""
    torch.manual_seed(0)
    cfg = get_preset(preset).override({**MOE, "init_std": 0.2})
    layers = [m for m in build_model(cfg).modules() if isinstance(m, MoE)]
    assert layers
    for moe in layers:
        for weight in (moe.experts.gate_up, moe.experts.down, moe.gate.weight):
            assert weight.std().item() == pytest.approx(cfg.init_std, rel=0.25)


def test_bias_moves_toward_under_loaded_experts():
    moe = _moe(n_routed_experts=4, n_activated_experts=1, n_shared_experts=0, bias_update_speed=0.1)
    moe.train()
    with torch.no_grad():
        moe.gate.weight.zero_()
        moe.gate.weight[0, 0] = 10.0  # expert 0 wins for x[..., 0] > 0
    x = torch.randn(1, 64, D).abs()
    moe(x)
    assert moe.load[0] == 64 and moe.aux_metrics["max_vio"] == pytest.approx(3.0)
    assert update_router_biases(torch.nn.Sequential(moe)) == 1
    torch.testing.assert_close(
        moe.gate.e_score_correction_bias, torch.tensor([-0.1, 0.1, 0.1, 0.1])
    )
    assert moe.load.sum() == 0
    # Eval passes report the load but do not count it toward the next update.
    moe.eval()
    moe(x)
    assert moe.load.sum() == 0


def test_sequence_balance_loss_trains_the_router():
    moe = _moe(n_routed_experts=4, n_activated_experts=2, seq_aux_loss_coef=0.01).train()
    x = torch.randn(2, 5, D)
    moe(x).sum().backward()
    assert moe.aux_loss is not None and moe.aux_loss.item() > 0
    assert moe.gate.weight.grad is not None
    # Equal scores: P_i = 1/E, and sum_i f_i = E whatever the choice, so the loss is alpha.
    with torch.no_grad():
        moe.gate.weight.zero_()
    moe(x)
    assert moe.aux_loss.item() == pytest.approx(0.01, rel=1e-5)


def test_sequence_balance_loss_matches_the_paper_and_transformers():
    """DeepSeek-V3's f_i counts each token's top k experts by affinity alone (eq. 18): the
    balancing bias and the group limit choose the experts that run, not the ones the loss
    counts (counting those made the loss 4.5% off here). The softmax (v2) router's loss
    is transformers' Mixtral balance loss of each sequence, over k."""
    mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    torch.manual_seed(0)
    x = torch.randn(3, 7, D)
    sizes = dict(n_routed_experts=8, n_activated_experts=2, seq_aux_loss_coef=0.1)
    moe = _moe(router="deepseek-v3", n_groups=4, topk_groups=2, **sizes).train()
    with torch.no_grad():
        moe.gate.weight.normal_()
        moe.gate.e_score_correction_bias.copy_(torch.linspace(-0.5, 0.5, 8))
        affinity = torch.sigmoid(x @ moe.gate.weight.T)  # (b, T, E)
        routed = moe.gate(x.reshape(-1, D))[1].sort(-1).values
    assert not torch.equal(routed, affinity.reshape(-1, 8).topk(2).indices.sort(-1).values)
    moe(x)
    torch.testing.assert_close(moe.aux_loss, sequence_balance_loss(affinity, 2, 0.1))

    moe = _moe(router="deepseek-v2", **sizes).train()
    with torch.no_grad():
        moe.gate.weight.normal_()
        logits = x @ moe.gate.weight.T  # (b, T, E)
    moe(x)
    expected = [mixtral.load_balancing_loss_func((row,), 8, 2) for row in logits]
    torch.testing.assert_close(moe.aux_loss, 0.1 / 2 * torch.stack(expected).mean())


def _switch_layers(n_layers: int, router_bias: bool, dtype=torch.float64) -> list[MoE]:
    """MoE layers with the Switch balance loss, sharp random routers (and biases)."""
    kw = dict(router="deepseek-v2", router_bias=router_bias, switch_aux_loss_coef=0.3)
    kw |= dict(n_routed_experts=6, n_activated_experts=2, n_shared_experts=0)
    layers = []
    for _ in range(n_layers):
        moe = _moe(**kw).to(dtype).train()
        with torch.no_grad():
            moe.gate.weight.normal_()
            if router_bias:
                moe.gate.bias.normal_()
        layers.append(moe)
    return layers


@pytest.mark.parametrize("router_bias", [False, True], ids=["mixtral", "gpt-oss"])
@pytest.mark.parametrize("padded", [False, True])
def test_switch_balance_loss_is_transformers_over_all_layers(router_bias, padded):
    """Three MoE layers' Switch loss, pooled by the model's collect_aux, is transformers'
    load_balancing_loss_func of their router logits (bias included: GPT-OSS's) concatenated,
    with the attention mask of a left-padded batch: not a sum of per-layer losses. float64
    against the readable oracle; transformers sums in float32."""
    mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    torch.manual_seed(0)
    b, t = 3, 7
    layers = _switch_layers(3, router_bias)
    mask = torch.ones(b, t, dtype=torch.long)
    if padded:
        mask[0, :3], mask[2, :6] = 0, 0
    xs = [torch.randn(b, t, D, dtype=torch.float64) for _ in layers]
    for moe, x in zip(layers, xs, strict=True):
        moe(x, real_tokens=mask.bool() if padded else None)
    loss, _ = collect_aux([(str(i), m) for i, m in enumerate(layers)])
    logits = [F.linear(x.reshape(-1, D), m.gate.weight, m.gate.bias) for m, x in zip(layers, xs)]
    real = mask.flatten().bool() if padded else None
    torch.testing.assert_close(loss, switch_balance_loss(logits, 2, 0.3, real), rtol=1e-12, atol=0)
    theirs = mixtral.load_balancing_loss_func(
        tuple(logits), 6, 2, attention_mask=mask if padded else None
    )
    torch.testing.assert_close(loss, 0.3 * theirs.double(), rtol=1e-6, atol=0)
    per_layer = sum(switch_balance_loss([lg], 2, 0.3, real) for lg in logits) / 3
    assert (loss - per_layer).abs() > 1e-3  # pooled, not the layers' mean


def test_switch_balance_loss_trains_only_when_asked():
    """Only training passes with switch_aux_loss_coef > 0 report the statistics; a batch of
    padding only gives a loss of 0 (not 0 / 0); the loss reaches the router's weights."""
    torch.manual_seed(0)
    (moe,) = _switch_layers(1, router_bias=True, dtype=torch.float32)
    x = torch.randn(2, 5, D)
    moe(x)
    loss, _ = collect_aux([("moe", moe)])
    loss.backward()
    assert moe.aux_loss is None and moe.gate.weight.grad.abs().max() > 0
    assert moe.gate.bias.grad.abs().max() > 0
    moe(x, real_tokens=torch.zeros(2, 5, dtype=torch.bool))
    assert collect_aux([("moe", moe)])[0] == 0
    moe.eval()(x)
    assert moe.aux_stats is None and collect_aux([("moe", moe)])[0] is None
    off = _moe(router="deepseek-v2").train()
    off(x)
    assert off.aux_pool is None and off.aux_stats is None


def test_switch_balance_loss_compiles_without_graph_breaks():
    """A training pass of few tokens (the gathered experts: static shapes) and the pooled
    loss compile in one graph (no host reads) and give eager's loss and gradients."""
    torch.manual_seed(0)
    layers = _switch_layers(2, router_bias=True, dtype=torch.float32)
    modules = [(str(i), m) for i, m in enumerate(layers)]
    x, real = torch.randn(1, 3, D), torch.tensor([[False, True, True]])

    def step(x):
        for m in layers:
            x = x + m(x, real_tokens=real)
        return collect_aux(modules)[0]

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    grads = []
    for run in (step, compiled):
        for m in layers:
            m.zero_grad()
        loss = run(x)
        loss.backward()
        grads.append((loss.detach(), [m.gate.weight.grad.clone() for m in layers]))
    torch.testing.assert_close(grads[1], grads[0])


def test_model_output_carries_aux_loss_and_per_layer_load():
    cfg = get_preset("deepseek-moe-tiny").override({"ffn.seq_aux_loss_coef": 0.001})
    model = build_model(cfg).train()
    idx = torch.randint(0, 256, (2, 12))
    out = model(idx, targets=idx)
    assert out.aux_loss is not None and "blocks.1.ffn/max_vio" in out.metrics
    (out.loss + out.aux_loss).backward()


def test_moe_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="ffn.n_groups"):
        FFNConfig.from_dict({"kind": "moe", "n_routed_experts": 6, "n_groups": 4})
    with pytest.raises(ConfigError, match="ffn.topk_groups"):
        FFNConfig.from_dict({"kind": "moe", "n_groups": 2, "topk_groups": 3})
    with pytest.raises(ConfigError, match="ffn.n_activated_experts"):
        FFNConfig.from_dict(
            {"kind": "moe", "n_groups": 4, "topk_groups": 1, "n_activated_experts": 3}
        )
    with pytest.raises(ConfigError, match="ffn.router"):
        FFNConfig.from_dict({"kind": "moe", "router": "switch"})
    with pytest.raises(ConfigError, match="router_bias: expected true/false"):
        FFNConfig.from_dict({"kind": "moe", "router_bias": "yes"})
    with pytest.raises(ConfigError, match="ffn.swiglu_limit: must be > 0, got -1"):
        FFNConfig.from_dict({"kind": "moe", "swiglu_limit": -1})
    switch = {"kind": "moe", "router": "deepseek-v2", "switch_aux_loss_coef": -0.1}
    with pytest.raises(ConfigError, match="ffn.switch_aux_loss_coef: must be >= 0, got -0.1"):
        FFNConfig.from_dict(switch)
    with pytest.raises(ConfigError, match="ffn.switch_aux_loss_coef: .* softmax router"):
        FFNConfig.from_dict({**switch, "router": "deepseek-v3", "switch_aux_loss_coef": 0.1})


def test_trainer_moves_router_biases_after_each_step(tmp_path):
    """Auxiliary-loss-free balancing runs inside `attnlab train`: the correction biases of
    the DeepSeek-V3 routers move away from zero during training."""
    from attnlab.config import RunConfig
    from attnlab.presets import get_preset
    from attnlab.training import train

    cfg = RunConfig(model=get_preset("deepseek-moe-tiny"))
    cfg = cfg.override(
        {
            "train.max_steps": 3,
            "train.batch_size": 2,
            "train.block_size": 16,
            "train.eval_every": 0,
            "train.log_every": 1,
        }
    )
    result = train(cfg, tmp_path / "run", progress=False)
    from attnlab.training import load_checkpoint

    model = load_checkpoint(result.out_dir).model
    biases = [m.gate.e_score_correction_bias for m in model.modules() if hasattr(m, "gate")]
    assert biases and any(b is not None and b.abs().sum() > 0 for b in biases)


def test_router_biases_stay_while_the_indexer_trains_alone(tmp_path):
    """DSA's warm-up stage freezes everything but the indexer, the routers' balancing
    biases too; the sparse stage moves them again."""
    from attnlab.config import RunConfig
    from attnlab.presets import get_preset
    from attnlab.training import load_checkpoint, train

    def biases(stage: str) -> list[torch.Tensor]:
        cfg = RunConfig(model=get_preset("deepseek-moe-tiny")).override(
            {
                "model.attention.kind": "dsa",
                "model.attention.index_topk": 4,
                "model.attention.dsa_stage": stage,
                "train.max_steps": 3,
                "train.batch_size": 2,
                "train.block_size": 16,
                "train.eval_every": 0,
            }
        )
        result = train(cfg, tmp_path / stage, progress=False)
        model = load_checkpoint(result.out_dir).model
        return [m.gate.e_score_correction_bias for m in model.modules() if hasattr(m, "gate")]

    warm = biases("warmup")
    assert warm and all(b is not None and not b.any() for b in warm)
    assert any(b.abs().sum() > 0 for b in biases("sparse"))


def test_router_runs_in_float32_under_autocast():
    """The trainer's bf16 autocast must not round the router's logits: near ties (sigmoid
    scores about 0.5 at initialisation) would pick other experts than float32 routing."""
    moe = _moe(n_routed_experts=64, n_activated_experts=6, n_groups=8, topk_groups=4)
    x = torch.randn(256, D)
    with torch.no_grad():
        ref = moe.gate(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = moe.gate(x)
    for a, b in zip(got, ref):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("router", ["deepseek-v3", "deepseek-v2"])
def test_float64_router_weights_are_not_rounded_to_float32(router):
    """Routing runs in float32 at least: a float64 model keeps float64 weights (they were
    rounded to float32, so a float64 MoE failed gradcheck)."""
    torch.manual_seed(0)
    moe = _moe(router=router, n_routed_experts=4, n_activated_experts=2).double()
    x = torch.randn(5, D, dtype=torch.float64)
    weights, _, scores = moe.gate(x)
    assert weights.dtype == scores.dtype == torch.float64
    logits = x @ moe.gate.weight.T
    expected = logits.sigmoid() if router == "deepseek-v3" else logits.softmax(-1)
    torch.testing.assert_close(scores, expected, rtol=1e-13, atol=1e-13)
    x.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: moe(x[None])[0], (x,), eps=1e-6, atol=1e-7)


def test_moe_runs_under_bf16_autocast():
    """The trainer's train.dtype=bfloat16: the experts' bf16 products were added into a
    float32 buffer (index_add_ refused: every MoE model failed to train in bf16)."""
    model = build_model(get_preset("deepseek-moe-tiny"))
    idx = torch.randint(0, 256, (2, 16))
    ref = model(idx, targets=idx)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(idx, targets=idx)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    torch.testing.assert_close(out.loss, ref.loss, rtol=0, atol=0.02)


def test_routing_state_keeps_full_precision_in_a_bf16_model():
    """model.to(bf16) leaves the router's weight and balancing bias and the token counts in
    float32 (values unrounded, the same Parameter), as transformers keeps them, so bias
    steps of 1e-3 still move it; .double() gives float64."""
    torch.manual_seed(0)
    moe = _moe(router="deepseek-v3")
    bias = torch.randn(moe.n_experts) * 0.3 + 0.5
    moe.gate.e_score_correction_bias.copy_(bias)
    weight, parameter = moe.gate.weight.detach().clone(), moe.gate.weight
    moe = moe.to(torch.bfloat16)
    assert moe.shared.down.weight.dtype == torch.bfloat16 and moe.gate.weight is parameter
    assert moe.gate.weight.dtype == torch.float32 == moe.load.dtype
    assert moe.gate.e_score_correction_bias.dtype == torch.float32
    torch.testing.assert_close(moe.gate.e_score_correction_bias, bias, rtol=0, atol=0)
    torch.testing.assert_close(moe.gate.weight.detach(), weight, rtol=0, atol=0)
    moe.train()
    moe(torch.randn(2, 300, moe.gate.weight.shape[1], dtype=torch.bfloat16))
    assert moe.load.sum() == 600 * moe.top_k  # bf16 counts would round above 256
    before = moe.gate.e_score_correction_bias.clone()
    moe.update_bias()
    step = (moe.gate.e_score_correction_bias - before).abs()  # 0 for an expert at the mean
    moved = step > 0
    assert moved.any()
    torch.testing.assert_close(step[moved], torch.full_like(step[moved], moe.bias_update_speed))
    assert moe.double().gate.e_score_correction_bias.dtype == torch.float64


# --------------------------------------------------------------------------- padded batches
# A padded batch's MoE statistics count its real tokens only: the load that moves the
# balancing bias, MaxVio and the sequence-wise balance loss equal those of the sequences
# run one by one, unpadded, computed here from the router's own choices by the formulas.

PADDED_MOE = {**MOE, "ffn.n_activated_experts": 2, "ffn.seq_aux_loss_coef": 0.01,
              "dropout": 0.0, "attention.dropout": 0.0}  # fmt: skip


def _record_routing(model):
    """Each MoE layer's router outputs, one (experts (N, k), scores (N, E)) per forward."""
    seen: dict[str, list] = {}

    def hook(name):
        def record(module, inputs, outputs):
            seen.setdefault(name, []).append((outputs[1], outputs[2]))

        return record

    layers = {n: m for n, m in model.named_modules() if isinstance(m, MoE)}
    handles = [m.gate.register_forward_hook(hook(n)) for n, m in layers.items()]
    return layers, seen, handles


def _paper_stats(routed, n_experts: int, top_k: int, coef: float):
    """Load, MaxVio and balance loss of sequences routed one by one: ``routed`` holds each
    sequence's (experts (T, k), scores (T, E)). DeepSeek-V3 eq. 17-20: per sequence
    f_i = E / (k T) * (tokens with i among their top k scores), P_i = mean over its tokens
    of s_i / sum_j s_j, loss alpha sum_i f_i P_i; averaged over the sequences."""
    load, losses = torch.zeros(n_experts), []
    for experts, scores in routed:
        load += torch.bincount(experts.flatten(), minlength=n_experts).float()
        top = scores.topk(top_k, dim=-1).indices  # (T, k)
        counts = torch.bincount(top.flatten(), minlength=n_experts).float()
        f = n_experts / (top_k * experts.shape[0]) * counts
        p = (scores / scores.sum(-1, keepdim=True)).mean(0)
        losses.append((f * p).sum())
    return load, load.max() / load.mean() - 1, coef * torch.stack(losses).mean()


def _check_padded_equals_alone(model, run_padded, runs_alone):
    """Each MoE layer's load, MaxVio and balance loss after ``run_padded()`` equal the
    formulas' over the sequences of ``runs_alone`` (one unpadded run each)."""
    model.train()
    layers, seen, handles = _record_routing(model)
    try:
        for run in runs_alone:
            run()
        alone = {name: list(calls) for name, calls in seen.items()}
        for m in layers.values():
            m.load.zero_()
        run_padded()
    finally:
        for h in handles:
            h.remove()
    assert layers
    for name, m in layers.items():
        load, max_vio, loss = _paper_stats(alone[name], m.n_experts, m.top_k, m.aux_coef)
        torch.testing.assert_close(m.load, load, rtol=0, atol=0)
        torch.testing.assert_close(m.aux_metrics["max_vio"], max_vio)
        torch.testing.assert_close(m.aux_loss, loss, rtol=1e-5, atol=1e-8)


def _right_padded(rows: list[torch.Tensor], width: int, pad_id: int = 0):
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = r, 1
    return ids, mask


@pytest.mark.parametrize("extra", [0, 5])
def test_moe_encoder_statistics_skip_padding(extra):
    """An MoE BERT's padded batch (the last row all padding) reports the load, MaxVio and
    balance loss of its sequences alone; padding was counted as tokens."""
    torch.manual_seed(0)
    model = build_model(get_preset("bert-tiny-mlm").override(PADDED_MOE))
    rows = [torch.randint(5, 200, (n,)) for n in (9, 5, 2)]
    idx, mask = _right_padded([*rows, rows[0][:0]], 9 + extra)
    _check_padded_equals_alone(
        model,
        lambda: model(idx, attention_mask=mask),
        [lambda r=r: model(r[None]) for r in rows],
    )


def test_moe_seq2seq_statistics_skip_padding():
    """The encoder-decoder: padded sources (src_mask) and padded targets (tgt_mask) count
    as the pairs one by one, in the encoder's MoE layers and the decoder's."""
    torch.manual_seed(0)
    model = build_model(get_preset("transformer-numbers").override(PADDED_MOE))
    src_rows = [torch.randint(3, 13, (n,)) for n in (6, 3, 1)]
    tgt_rows = [torch.randint(3, 32, (n,)) for n in (2, 7, 4)]
    src, src_mask = _right_padded(src_rows, 8)
    tgt, tgt_mask = _right_padded(tgt_rows, 9)
    layers = [n for n, m in model.named_modules() if isinstance(m, MoE)]
    assert any(n.startswith("encoder") for n in layers)
    assert any(n.startswith("decoder") for n in layers)
    _check_padded_equals_alone(
        model,
        lambda: model(src, tgt, src_mask=src_mask, tgt_mask=tgt_mask),
        [lambda s=s, t=t: model(s[None], t[None]) for s, t in zip(src_rows, tgt_rows)],
    )


def test_moe_translation_batches_count_their_pairs_alone():
    """The translation task's teacher-forcing step gives the model both masks of its padded
    batch: the MoE statistics count each (source, target) pair as if it ran alone."""
    from attnlab.data.numbers import CharVocab, collate
    from attnlab.tasks.translation import seq2seq_loss

    torch.manual_seed(0)
    model = build_model(get_preset("transformer-numbers").override(PADDED_MOE))
    src_vocab, tgt_vocab = CharVocab("0123456789"), CharVocab("abcdefghijklmnopqrstuvwxyz -")
    pairs = [("1234", "one thousand"), ("7", "seven"), ("45", "forty-five")]
    _check_padded_equals_alone(
        model,
        lambda: seq2seq_loss(model, collate(pairs, src_vocab, tgt_vocab)),
        [lambda p=p: seq2seq_loss(model, collate([p], src_vocab, tgt_vocab)) for p in pairs],
    )


def test_moe_decoder_statistics_skip_left_padding():
    """A left-padded decoder batch with its attention mask counts as its prompts alone."""
    torch.manual_seed(0)
    model = build_model(get_preset("deepseek-moe-tiny").override({"ffn.seq_aux_loss_coef": 0.01}))
    rows = [torch.randint(0, 256, (n,)) for n in (8, 3, 5)]
    idx = torch.zeros(3, 10, dtype=torch.long)
    mask = torch.zeros(3, 10, dtype=torch.long)
    for i, r in enumerate(rows):
        idx[i, 10 - len(r) :], mask[i, 10 - len(r) :] = r, 1
    _check_padded_equals_alone(
        model,
        lambda: model(idx, attention_mask=mask),
        [lambda r=r: model(r[None]) for r in rows],
    )


def test_bias_update_does_not_depend_on_the_padding():
    """The auxiliary-loss-free bias moves by the real tokens' load: a batch padded to any
    width moves it as its sequences run one by one do."""
    torch.manual_seed(0)
    cfg = get_preset("bert-tiny-mlm").override({**PADDED_MOE, "ffn.bias_update_speed": 0.1})
    model = build_model(cfg).train()
    rows = [torch.randint(5, 200, (n,)) for n in (9, 5, 2)]
    start = {k: v.clone() for k, v in model.state_dict().items()}
    biases = []
    for width in (None, 9, 30):  # None: one sequence at a time
        model.load_state_dict(start)
        if width is None:
            for r in rows:
                model(r[None])
        else:
            idx, mask = _right_padded(rows, width)
            model(idx, attention_mask=mask)
        update_router_biases(model)
        biases.append([m.gate.e_score_correction_bias.clone() for m in model.modules()
                       if isinstance(m, MoE)])  # fmt: skip
    assert any(b.abs().sum() > 0 for b in biases[0])
    for moved in biases[1:]:
        for a, b in zip(moved, biases[0], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_moe_without_padding_is_unchanged_by_an_all_ones_mask():
    """No padding: an all-ones mask gives the statistics of no mask (the packed path)."""
    torch.manual_seed(0)
    model = build_model(get_preset("bert-tiny-mlm").override(PADDED_MOE)).train()
    idx = torch.randint(5, 200, (3, 7))
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    model(idx)
    plain = [(m.load.clone(), m.aux_metrics["max_vio"], m.aux_loss) for m in layers]
    for m in layers:
        m.load.zero_()
    model(idx, attention_mask=torch.ones_like(idx))
    for m, (load, max_vio, loss) in zip(layers, plain, strict=True):
        torch.testing.assert_close(m.load, load, rtol=0, atol=0)
        torch.testing.assert_close(m.aux_metrics["max_vio"], max_vio)
        torch.testing.assert_close(m.aux_loss, loss)


@pytest.mark.parametrize("preset", ["bert-tiny-mlm", "transformer-numbers"])
def test_switch_balance_loss_of_a_padded_batch_pools_the_real_tokens_of_all_layers(preset):
    """Encoder and encoder-decoder, right-padded: the model's auxiliary loss is the
    oracle's Switch loss over the real tokens of all its MoE layers (the encoder's and the
    decoder's in one pool), from the routers' own scores."""
    torch.manual_seed(0)
    switch = {"ffn.router": "deepseek-v2", "ffn.seq_aux_loss_coef": 0.0,
              "ffn.switch_aux_loss_coef": 0.1}  # fmt: skip
    model = build_model(get_preset(preset).override({**PADDED_MOE, **switch})).train()
    layers, seen, handles = _record_routing(model)
    idx, mask = _right_padded([torch.randint(5, 12, (n,)) for n in (6, 3, 1)], 8)
    try:
        if preset == "bert-tiny-mlm":
            out = model(idx, attention_mask=mask)
        else:  # sources and targets padded alike
            out = model(idx, idx, src_mask=mask, tgt_mask=mask)
    finally:
        for h in handles:
            h.remove()
    assert len(layers) >= 2
    # the oracle takes logits: log s gives the router's softmax s back
    logits = [seen[name][0][1].log() for name in layers]
    expected = switch_balance_loss(logits, 2, 0.1, mask.flatten().bool())
    torch.testing.assert_close(out.aux_loss, expected)


def test_moe_batch_of_padding_only_counts_nothing():
    """A batch of padding only: no load, MaxVio 0 and a balance loss of 0 (not 0 / 0 = nan,
    which would reach the logged metrics and, through the loss, the weights)."""
    torch.manual_seed(0)
    model = build_model(get_preset("bert-tiny-mlm").override(PADDED_MOE)).train()
    idx = torch.randint(5, 200, (2, 6))
    out = model(idx, attention_mask=torch.zeros_like(idx))
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    assert layers
    for m in layers:
        assert not m.load.any()
        assert m.aux_metrics["max_vio"] == 0 and m.aux_loss == 0
    assert out.aux_loss == 0 and all(v == 0 for v in out.metrics.values())
