"""Multi-head latent attention: the absorbed path against the naive one on the same weights
(full forward, under a cache, chunked prefill, left padding), cache decoding against the full
forward pass, the latent cache's size, the auto path choice, config errors, YaRN against
transformers' rope init, and a tiny MLA model learning.

Shapes: b batch, t length, V vocabulary.
"""

from __future__ import annotations

import math

import pytest
import torch

from attnlab.cache import LatentKV
from attnlab.config import ConfigError, ModelConfig
from attnlab.functional.rope import rope_inv_freq, scale_inv_freq
from attnlab.models import build_model
from attnlab.nn.mla import MultiHeadLatentAttention
from attnlab.nn.rope import RotaryEmbedding
from attnlab.presets import get_preset, get_run_preset

TOL = dict(rtol=1e-5, atol=1e-5)
V = 256
PRESETS = ["deepseek-tiny", "deepseek-moe-tiny"]  # without and with query compression


def _model(preset: str, layout: str = "interleaved", **overrides) -> torch.nn.Module:
    cfg = get_preset(preset).override({"position.rope_layout": layout, **overrides})
    return build_model(cfg).eval()


def _set_path(model, path: str) -> None:
    for m in model.modules():
        if isinstance(m, MultiHeadLatentAttention):
            m.path = path


def _both(model, fn):
    """fn() under the naive path, then under the absorbed path."""
    out = {}
    for path in ("naive", "absorbed"):
        _set_path(model, path)
        out[path] = fn()
    _set_path(model, "auto")
    return out["naive"], out["absorbed"]


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("layout", ["split", "interleaved"])
@torch.no_grad()
def test_absorbed_equals_naive_full_forward(preset, layout):
    model = _model(preset, layout)
    idx = torch.randint(0, V, (2, 24))
    naive, absorbed = _both(model, lambda: model(idx).logits)
    torch.testing.assert_close(absorbed, naive, **TOL)


@pytest.mark.parametrize("preset", PRESETS)
@torch.no_grad()
def test_cache_decode_equals_full_forward_on_both_paths(preset):
    model = _model(preset)
    idx = torch.randint(0, V, (2, 20))
    full = model(idx).logits

    def chunked():  # prefill 9, a chunk of 5, then one token at a time
        cache = model.new_cache(2, 32)
        parts = [model(idx[:, :9], cache=cache).logits, model(idx[:, 9:14], cache=cache).logits]
        parts += [model(idx[:, i : i + 1], cache=cache).logits for i in range(14, 20)]
        return torch.cat(parts, dim=1)

    naive, absorbed = _both(model, chunked)
    torch.testing.assert_close(naive, full, **TOL)
    torch.testing.assert_close(absorbed, full, **TOL)
    torch.testing.assert_close(absorbed, naive, **TOL)
    torch.testing.assert_close(chunked(), full, **TOL)  # auto


@pytest.mark.parametrize("preset", PRESETS)
@torch.no_grad()
def test_left_padded_batch_on_both_paths(preset):
    model = _model(preset)
    short, long = torch.randint(0, V, (5,)), torch.randint(0, V, (8,))
    pad = 3
    idx = torch.stack((torch.cat((torch.zeros(pad, dtype=torch.long), short)), long))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, :pad] = 0
    new = torch.randint(0, V, (2, 3))

    def run():
        cache = model.new_cache(2, 11)
        prefill = model(idx, attention_mask=mask, cache=cache).logits
        steps = [model(new[:, i : i + 1], cache=cache).logits for i in range(3)]
        return prefill, torch.cat(steps, dim=1)

    (pre_n, steps_n), (pre_a, steps_a) = _both(model, run)
    torch.testing.assert_close(pre_a, pre_n, **TOL)
    torch.testing.assert_close(steps_a, steps_n, **TOL)
    _set_path(model, "naive")
    alone_short = model(torch.cat((short, new[0]))[None]).logits[0]
    alone_long = model(torch.cat((long, new[1]))[None]).logits[0]
    torch.testing.assert_close(pre_n[0, pad:], alone_short[:5], **TOL)
    torch.testing.assert_close(steps_a[0], alone_short[-3:], **TOL)
    torch.testing.assert_close(steps_a[1], alone_long[-3:], **TOL)


@torch.no_grad()
def test_static_cache_and_sliding_window_on_both_paths():
    model = _model("deepseek-tiny", **{"attention.sliding_window": 6})
    idx = torch.randint(0, V, (2, 14))
    full = model(idx).logits

    def decode(static: bool):
        cache = model.new_cache(2, 16, static=static)
        parts = [model(idx[:, :8], cache=cache).logits]
        parts += [model(idx[:, i : i + 1], cache=cache).logits for i in range(8, 14)]
        return torch.cat(parts, dim=1)

    for static in (False, True):
        naive, absorbed = _both(model, lambda static=static: decode(static))
        torch.testing.assert_close(naive, full, **TOL)
        torch.testing.assert_close(absorbed, full, **TOL)


def test_latent_cache_holds_only_the_latent_and_the_rope_key():
    cfg = get_preset("deepseek-moe-tiny")
    model = build_model(cfg)
    cache = model.new_cache(3, 40, dtype=torch.bfloat16)
    assert all(isinstance(entry, LatentKV) for entry in cache.layers)
    att = cfg.attention
    per_token = cfg.n_layers * (att.kv_lora_rank + att.qk_rope_head_dim) * 2  # bf16
    assert cache.nbytes == 3 * 40 * per_token


def test_auto_path_absorbs_only_when_decoding_from_a_cache():
    att = _model("deepseek-tiny").blocks[0].attn
    assert att.choose_path(64, 64, cached=False) == "naive"  # training
    assert att.choose_path(1, 100, cached=True) == "absorbed"  # decoding
    assert att.choose_path(64, 64, cached=True) == "naive"  # a long prefill
    att.path = "absorbed"
    assert att.choose_path(64, 64, cached=False) == "absorbed"


def test_mla_trains_from_the_demo_preset_with_one_override():
    run = get_run_preset("demo")
    cfg = run.model.override({"attention.kind": "mla", "n_layers": 2, "max_seq_len": 32})
    model = build_model(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    idx = torch.randint(0, 16, (8, 33))
    losses = []
    for _ in range(40):
        loss = model(idx[:, :-1], targets=idx[:, 1:]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize(
    "override, field",
    [
        ({"attention.qk_rope_head_dim": 7}, "model.attention.qk_rope_head_dim"),
        ({"attention.kv_lora_rank": 4096}, "model.attention.kv_lora_rank"),
        ({"attention.q_lora_rank": 4096}, "model.attention.q_lora_rank"),
        ({"attention.n_kv_heads": 2}, "model.attention.n_kv_heads"),
        ({"attention.kv_lora_rank": 0}, "model.attention.kv_lora_rank"),
        ({"attention.mla_path": "fast"}, "model.attention.mla_path"),
        ({"attention.kind": "mha"}, "model.attention.q_lora_rank"),  # MLA fields on MHA
    ],
)
def test_inconsistent_mla_config_names_the_field(override, field):
    run = get_run_preset("demo")
    run = run.override({"model.attention.kind": "mla", "model.attention.q_lora_rank": 64})
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        run.override({f"model.{k}": v for k, v in override.items()})


def test_absorbed_path_trains_with_attention_dropout_whatever_the_backend():
    """MLA's absorbed path drops its attention weights itself, without a backend: the
    trainer's check lets attention dropout train there with a backend that has none
    (flash), and the weights are dropped (two seeds, two losses); the naive and auto paths
    call the backend, so there it is refused before training, naming it."""
    from attnlab.training import TrainingError
    from attnlab.training.trainer import check_backend

    sets = {"attention.backend": "flash", "attention.dropout": 0.5, "dropout": 0.0}
    idx = torch.randint(0, V, (2, 9))
    for path in ("naive", "auto"):
        cfg = get_preset("deepseek-tiny").override({**sets, "attention.mla_path": path})
        with pytest.raises(TrainingError, match="backend='flash' has no attention dropout"):
            check_backend(cfg, torch.device("cpu"))
    cfg = get_preset("deepseek-tiny").override({**sets, "attention.mla_path": "absorbed"})
    check_backend(cfg, torch.device("cpu"))
    model = build_model(cfg).train()
    losses = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        loss = model(idx[:, :-1], targets=idx[:, 1:]).loss
        loss.backward()
        losses.append(loss.item())
    assert losses[0] != losses[1]
    assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters())


def test_mla_defaults_follow_the_paper():
    cfg = ModelConfig.from_dict({"d_model": 128, "attention": {"kind": "mla", "n_heads": 4}})
    dims = cfg.attention.mla_dims(cfg.d_model)
    assert (dims.kv_lora_rank, dims.qk_rope_head_dim) == (4 * 32, 16)  # d_c = 4 d_h, d_h / 2
    assert (dims.qk_nope_head_dim, dims.v_head_dim, dims.q_lora_rank) == (32, 32, None)
    assert cfg.rope_dim == 16


# --------------------------------------------------------------------------- YaRN


def _hf_deepseek_config(**rope):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        hidden_size=64,
        num_attention_heads=4,
        qk_nope_head_dim=16,
        qk_rope_head_dim=32,
        v_head_dim=16,
        max_position_embeddings=4096 * 8,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, **rope},
    )


@pytest.mark.parametrize(
    "rope",
    [
        dict(factor=8.0, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1),
        dict(
            factor=40.0,
            original_max_position_embeddings=4096,
            beta_fast=32,
            beta_slow=1,
            mscale=0.707,
            mscale_all_dim=0.707,
        ),
        dict(factor=4.0, original_max_position_embeddings=512, mscale=1.0, mscale_all_dim=0.5),
        # bounds left unrounded and a rope factor given: the softmax keeps mscale_all_dim's
        dict(
            factor=4.0,
            original_max_position_embeddings=512,
            mscale=1.0,
            mscale_all_dim=0.5,
            truncate=False,
            attention_factor=0.9,
        ),
    ],
)
def test_yarn_matches_transformers(rope):
    pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    hf = _hf_deepseek_config(**rope)
    ref_inv_freq, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    scaling = dict(
        kind="yarn",
        factor=rope["factor"],
        original_max_seq_len=rope["original_max_position_embeddings"],
        beta_fast=rope.get("beta_fast", 32),
        beta_slow=rope.get("beta_slow", 1),
        truncate=rope.get("truncate", True),
    )
    inv_freq = scale_inv_freq(rope_inv_freq(32), theta=10000.0, **scaling)
    torch.testing.assert_close(inv_freq, ref_inv_freq, rtol=1e-6, atol=0)
    emb = RotaryEmbedding(
        32,
        scaling={
            **scaling,
            "mscale": rope.get("mscale"),
            "mscale_all_dim": rope.get("mscale_all_dim"),
            "attention_factor": rope.get("attention_factor"),
        },
    )
    assert math.isclose(emb.attention_factor, ref_factor, rel_tol=1e-12)
    # The softmax scale of DeepSeek's attention: 1/sqrt(d_n + d_r) * mscale(all_dim)^2.
    hf_scale = DeepseekV3Attention(hf, layer_idx=0).scaling
    assert math.isclose((16 + 32) ** -0.5 * emb.softmax_factor, hf_scale, rel_tol=1e-12)
    # And the tables: cos/sin scaled by the attention factor.
    positions = torch.arange(7)
    tables = emb.tables(positions)
    angles = positions[:, None].float() * ref_inv_freq
    torch.testing.assert_close(tables.cos[0, 0, :, :16], angles.cos() * ref_factor)


def test_yarn_config_reaches_the_model():
    cfg = get_preset("deepseek-tiny").override(
        {
            "position.rope_scaling": "yarn",
            "position.rope_factor": 4.0,
            "position.rope_original_max_seq_len": 32,
            "position.rope_mscale": 1.0,
            "position.rope_mscale_all_dim": 1.0,
        }
    )
    model = build_model(cfg)
    mscale = 0.1 * math.log(4.0) + 1
    assert math.isclose(model.blocks[0].attn.scale, (16 + 8) ** -0.5 * mscale**2)
    with pytest.raises(ConfigError, match="rope_beta_fast"):
        cfg.override({"position.rope_beta_fast": 0.5})
