"""DeepSeek-V3.2 (DSA) through ``attnlab.interop.load_hf`` / ``save_hf``, against transformers'
``DeepseekV32ForCausalLM`` built from a tiny random config with index_topk smaller than the
sequence: logits (1e-4) and greedy tokens, from a folder of the transformers state dict
(experts stacked) and from ``save_pretrained`` (experts one by one); saved back with
``save_hf`` it loads in transformers with the same logits and config; a missing or
mis-shaped indexer tensor is one error naming it.

Shapes: b batch, t length, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import save_file

pytest.importorskip("transformers.models.deepseek_v32")

from transformers import DeepseekV32Config, DeepseekV32ForCausalLM  # noqa: E402

from attnlab.interop import (  # noqa: E402
    HFCheckpointError,
    config_from_hf,
    hf_model_type,
    load_hf,
    save_hf,
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
        bos_token_id=None,  # no end-of-sequence token: greedy decoding runs its full length
        eos_token_id=None,
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


def _state_dict_folder(hf, path, tensors=None):
    """A folder holding the transformers model's own state dict (experts stacked)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf.config.to_dict()))
    tensors = {k: v.contiguous() for k, v in (tensors or hf.state_dict()).items()}
    save_file(tensors, path / "model.safetensors")
    return path


@pytest.mark.parametrize("moe", [True, False])
@torch.no_grad()
def test_logits_and_greedy_tokens_match_transformers(moe, tmp_path):
    hf = _hf(moe)
    ours = load_hf(_state_dict_folder(hf, tmp_path / "sd"))
    assert isinstance(ours, DecoderLM) and not ours.training
    att = ours.cfg.attention
    assert (att.kind, att.index_topk, att.index_n_heads, att.index_head_dim) == ("dsa", 5, 8, 16)
    assert ours.cfg.position.rope_layout == "interleaved"
    assert ours.cfg.ffn.kind == ("moe" if moe else "glu")
    idx = torch.randint(0, V, (2, 21))
    ref = hf(idx).logits
    torch.testing.assert_close(ours(idx).logits, ref, rtol=1e-4, atol=1e-4)
    prompt = idx[:1, :9]
    want = hf.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=12,
        min_new_tokens=12,
        do_sample=False,
        pad_token_id=0,
    )
    got = ours.generate(prompt[0].tolist(), max_new_tokens=12, temperature=0.0)
    assert got == want[0, 9:].tolist()

    # A checkpoint directory (experts one by one, as save_pretrained writes them).
    hf.save_pretrained(tmp_path / "hf")
    torch.testing.assert_close(load_hf(tmp_path / "hf")(idx).logits, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("moe", [True, False])
@torch.no_grad()
def test_round_trip_through_save_hf(moe, tmp_path):
    hf = _hf(moe)
    ours = load_hf(_state_dict_folder(hf, tmp_path / "sd"))
    assert hf_model_type(ours.cfg) == "deepseek_v32"
    save_hf(ours, tmp_path / "out")
    back = DeepseekV32ForCausalLM.from_pretrained(tmp_path / "out").eval()
    idx = torch.randint(0, V, (1, 16))
    torch.testing.assert_close(back(idx).logits, hf(idx).logits, rtol=1e-5, atol=1e-5)
    assert config_from_hf(back.config.to_dict()) == ours.cfg
    again = load_hf(tmp_path / "out")
    torch.testing.assert_close(again(idx).logits, ours(idx).logits, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["wk.weight", "k_norm.bias", "weights_proj.weight"])
def test_missing_or_misshaped_indexer_tensor_is_named(name, tmp_path):
    hf = _hf()
    sd = dict(hf.state_dict())
    name = f"model.layers.1.self_attn.indexer.{name}"
    missing = {k: v for k, v in sd.items() if k != name}
    with pytest.raises(HFCheckpointError, match=rf"missing tensors: {name}"):
        load_hf(_state_dict_folder(hf, tmp_path / "a", missing))
    wrong = {**sd, name: sd[name][:-1]}
    with pytest.raises(HFCheckpointError, match=rf"wrong shapes: {name} has shape"):
        load_hf(_state_dict_folder(hf, tmp_path / "b", wrong))


def test_unsupported_configs_are_refused():
    """Import needs q_lora_rank and dense-then-sparse layers; export an exact indexer and
    interleaved RoPE."""
    hf = _hf().config.to_dict()
    with pytest.raises(HFCheckpointError, match="q_lora_rank"):
        config_from_hf({**hf, "q_lora_rank": None})
    with pytest.raises(HFCheckpointError, match="mlp_layer_types"):
        config_from_hf({**hf, "mlp_layer_types": ["sparse", "dense"]})
    cfg = config_from_hf(hf)
    for change in ({"index_hadamard": True}, {"index_fp8": True}):
        att = dataclasses.replace(cfg.attention, **change)
        with pytest.raises(HFCheckpointError, match="exact indexer"):
            hf_model_type(dataclasses.replace(cfg, attention=att))
    split = dataclasses.replace(cfg.position, rope_layout="split")
    with pytest.raises(HFCheckpointError, match="interleaved"):
        hf_model_type(dataclasses.replace(cfg, position=split))
