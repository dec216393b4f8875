"""DeepSeek-V3.2 (DSA) against transformers' ``DeepseekV32ForCausalLM`` built from a tiny random
config with index_topk smaller than the sequence: logits, greedy tokens, the round trip
through files, and a mismatched checkpoint's error.

Shapes: b batch, t length, V vocabulary.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers.models.deepseek_v32")

from transformers import DeepseekV32Config, DeepseekV32ForCausalLM  # noqa: E402

from attnlab.interop_deepseek_v32 import (  # noqa: E402
    DeepSeekCheckpointError,
    config_from_hf,
    load_deepseek_v32,
    save_deepseek_v32,
    state_dict_from_hf,
)
from attnlab.models.decoder import DecoderLM  # noqa: E402

V = 97


def _hf(moe: bool = True) -> DeepseekV32ForCausalLM:
    torch.manual_seed(0)
    cfg = DeepseekV32Config(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=24,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1 if moe else 2,
        index_topk=5,
        index_n_heads=8,
        index_head_dim=16,
        max_position_embeddings=128,
        attn_implementation="eager",
    )
    model = DeepseekV32ForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial norms, biases and router bias
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
        for m in model.modules():
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias.copy_(0.1 * torch.randn_like(m.e_score_correction_bias))
    return model


def _ours(hf) -> DecoderLM:
    cfg = config_from_hf(hf.config.to_dict())
    model = DecoderLM(cfg).eval()
    model.load_state_dict(state_dict_from_hf(hf.state_dict(), cfg), strict=True)
    return model


@pytest.mark.parametrize("moe", [True, False])
@torch.no_grad()
def test_logits_and_greedy_tokens_match_transformers(moe):
    hf = _hf(moe)
    ours = _ours(hf)
    assert ours.cfg.attention.kind == "dsa" and ours.cfg.attention.index_topk == 5
    idx = torch.randint(0, V, (2, 21))
    torch.testing.assert_close(ours(idx).logits, hf(idx).logits, rtol=1e-4, atol=1e-4)
    prompt = idx[:1, :9]
    want = hf.generate(prompt, max_new_tokens=12, do_sample=False, min_new_tokens=12)
    got = ours.generate(prompt[0].tolist(), max_new_tokens=12, temperature=0.0)
    assert got == want[0, 9:].tolist()


@torch.no_grad()
def test_round_trip_through_files(tmp_path):
    hf = _hf()
    ours = _ours(hf)
    save_deepseek_v32(ours, tmp_path)
    back = DeepseekV32ForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    idx = torch.randint(0, V, (1, 16))
    torch.testing.assert_close(back(idx).logits, hf(idx).logits, rtol=1e-5, atol=1e-5)
    again = load_deepseek_v32(tmp_path).eval()
    torch.testing.assert_close(again(idx).logits, ours(idx).logits, rtol=0, atol=0)


def test_missing_indexer_tensor_is_named():
    hf = _hf()
    sd = {k: v for k, v in hf.state_dict().items() if "layers.1.self_attn.indexer.wk" not in k}
    with pytest.raises(DeepSeekCheckpointError, match=r"missing: .*indexer\.wk\.weight"):
        state_dict_from_hf(sd, config_from_hf(hf.config.to_dict()))
