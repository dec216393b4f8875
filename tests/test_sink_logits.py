"""Learned sink logits against transformers' GPT-OSS attention (GptOssAttention, eager):
a sliding-window layer and a global one, with GQA, biases and YaRN RoPE with truncate=False
and its attention factor, left padding, gradients, and cached decoding (a ring of
sliding_window entries, dense keys) against the reference's full forward pass.

Shapes: b batch, t length, d d_model, h heads, h_kv key/value heads, d_h head dim.
"""

from __future__ import annotations

import pytest
import torch

from attnlab.cache import Cache
from attnlab.config import AttentionConfig, PositionConfig
from attnlab.functional.masks import padding_mask, positions_from_padding
from attnlab.nn.attention import MultiHeadAttention
from attnlab.nn.rope import RotaryEmbedding

D, H, H_KV, D_H, WINDOW, T = 32, 4, 2, 16, 5, 12
# d_h = 16 and 256 original positions put YaRN's ramp bounds at 0.16 and 2.49: truncate=False
# (gpt-oss) keeps them, truncate=True would round them to 0 and 3
YARN = dict(factor=8.0, beta_fast=32.0, beta_slow=1.0, original_max_position_embeddings=256)


def _gpt_oss(layer_type: str):
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import (
        GptOssAttention,
        GptOssRotaryEmbedding,
    )

    cfg = transformers.GptOssConfig(
        hidden_size=D,
        num_attention_heads=H,
        num_key_value_heads=H_KV,
        head_dim=D_H,
        num_hidden_layers=1,
        sliding_window=WINDOW,
        layer_types=[layer_type],
        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, truncate=False, **YARN),
        attention_bias=True,
        max_position_embeddings=2048,  # factor * original: no mismatch warning
        vocab_size=16,
        intermediate_size=8,
        num_local_experts=2,
        num_experts_per_tok=1,
    )
    cfg._attn_implementation = "eager"
    ref = GptOssAttention(cfg, 0)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(std=0.3)
        ref.sinks.normal_(std=1.5)
    return cfg, ref, GptOssRotaryEmbedding(cfg)


def _ours(ref, backend: str, window: int | None) -> MultiHeadAttention:
    cfg = AttentionConfig(
        n_heads=H,
        n_kv_heads=H_KV,
        head_dim=D_H,
        qkv_bias=True,
        out_bias=True,
        sink_logits=True,
        sliding_window=window,
        backend=backend,
    )
    pos = PositionConfig(
        kind="rope",
        rope_theta=150000.0,
        rope_scaling="yarn",
        rope_factor=YARN["factor"],
        rope_beta_fast=YARN["beta_fast"],
        rope_beta_slow=YARN["beta_slow"],
        rope_original_max_seq_len=YARN["original_max_position_embeddings"],
        rope_truncate=False,
    )
    ours = MultiHeadAttention(D, cfg, rope=RotaryEmbedding.from_config(D_H, pos))
    with torch.no_grad():
        ours.qkv.weight.copy_(torch.cat((ref.q_proj.weight, ref.k_proj.weight, ref.v_proj.weight)))
        ours.qkv.bias.copy_(torch.cat((ref.q_proj.bias, ref.k_proj.bias, ref.v_proj.bias)))
        ours.out.weight.copy_(ref.o_proj.weight)
        ours.out.bias.copy_(ref.o_proj.bias)
        ours.sink_logit.copy_(ref.sinks)
    return ours


@pytest.mark.parametrize("backend", ["eager", "sdpa", "flash"])
@pytest.mark.parametrize("layer_type", ["sliding_attention", "full_attention"])
def test_sink_logits_match_gpt_oss_attention(layer_type, backend):
    """Forward and gradients (inputs, sink logits) of a left-padded batch longer than the
    window, and a prefill then one token at a time through the cache, against transformers'
    full forward pass. Its sliding mask keeps keys k > q - w, as attnlab's window does."""
    cfg, ref, rotary = _gpt_oss(layer_type)  # skips without transformers
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    sliding = layer_type == "sliding_attention"
    ours = _ours(ref, backend, WINDOW if sliding else None)
    attention_mask = torch.ones(2, T, dtype=torch.long)
    attention_mask[1, :3] = 0  # left padding
    real = attention_mask.bool()
    positions = positions_from_padding(attention_mask, T)  # (b, t): pads do not count
    x = torch.randn(2, T, D, requires_grad=True)
    make_mask = create_sliding_window_causal_mask if sliding else create_causal_mask
    # positional arguments: the cache argument was renamed (past_key_values -> cache)
    mask = make_mask(cfg, x, attention_mask, None, allow_is_causal_skip=False)
    want, _ = ref(x, rotary(x, positions), mask)
    x_ours = x.detach().clone().requires_grad_(True)
    got = ours(x_ours, positions=positions, mask=padding_mask(attention_mask))
    tol = dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[real], want[real], **tol)

    grad = torch.randn_like(want) * real[..., None]  # pad rows' outputs are not compared
    (want * grad).sum().backward()
    (got * grad).sum().backward()
    # float32 sums of |values| about 10 over different orders: 1e-4 absolute
    torch.testing.assert_close(x_ours.grad, x.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ours.sink_logit.grad, ref.sinks.grad, atol=1e-4, rtol=1e-4)

    cache = Cache(2, T)
    cache.layers, cache.cross = [ours.new_cache_entry(cache)], [None]
    steps, start = [], 0
    with torch.no_grad():
        for n in [7] + [1] * (T - 7):  # the prefill fills more than the window
            step = cache.begin(n, attention_mask[:, start : start + n])
            x_step = x.detach()[:, start : start + n]
            steps.append(ours(x_step, positions=step.positions, cache=cache.layers[0]))
            cache.commit()
            start += n
    torch.testing.assert_close(torch.cat(steps, 1)[real], want.detach()[real], **tol)
