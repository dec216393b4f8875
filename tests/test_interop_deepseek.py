"""DeepSeek-V2/V3 checkpoints: transformers models from tiny random configs (dense and MoE
layers, with and without query compression, both RoPE layouts, YaRN, attention biases, all
head widths different) loaded into attnlab give the same logits (1e-4) and the same greedy
tokens through both MLA paths, through ``attnlab.interop.load_hf`` (checkpoint folders with
experts one by one, and a transformers state dict with them stacked); saved back with
``save_hf`` they load in transformers; a missing or mis-shaped tensor is one error naming it.

Shapes: b batch, t length, V vocabulary.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from attnlab.interop import HFCheckpointError, config_from_hf, hf_model_type, load_hf, save_hf
from attnlab.models.decoder import DecoderLM
from attnlab.nn.mla import MultiHeadLatentAttention

pytest.importorskip("transformers")

V = 96
COMMON = dict(
    vocab_size=V,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,  # V3's default is 128
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=8,
    max_position_embeddings=256,
    initializer_range=0.1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    bos_token_id=None,  # no end-of-sequence token: greedy decoding runs its full length
    eos_token_id=None,
)
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
}
CASES = {
    "v3-moe-qlora": (
        "v3",
        dict(q_lora_rank=24, n_group=4, topk_group=2, routed_scaling_factor=2.5),
    ),
    "v3-dense-split-yarn": (
        "v3",
        dict(
            q_lora_rank=None,
            first_k_dense_replace=3,
            rope_interleave=False,
            rope_parameters=YARN,
            rms_norm_eps=0.05,  # large enough to move the logits
        ),
    ),
    "v2-moe-greedy": ("v2", dict(q_lora_rank=None, n_shared_experts=2, routed_scaling_factor=1.5)),
    # no shared experts: transformers still stores them, with zero rows
    # and the top-k weights not renormalised
    "v3-moe-no-shared": (
        "v3",
        dict(q_lora_rank=None, n_shared_experts=0, n_group=2, topk_group=1, norm_topk_prob=False),
    ),
    "v2-moe-group-qlora-yarn": (
        "v2",
        dict(
            q_lora_rank=24,
            topk_method="group_limited_greedy",
            n_group=4,
            # fewer groups than experts per token: with topk_group >= num_experts_per_tok the
            # top experts always lie in the groups of the highest scores (greedy's choice)
            topk_group=1,
            rope_parameters=YARN,
        ),
    ),
    # every head width different (d_n != d_v: the softmax scale is 1/sqrt(d_n + d_r)) and
    # the attention biases (q_a_proj, kv_a_proj_with_mqa, o_proj), given random values
    "v3-biases-head-dims": (
        "v3",
        dict(
            q_lora_rank=24,
            attention_bias=True,
            qk_nope_head_dim=6,
            v_head_dim=10,
            n_group=2,
            topk_group=1,
        ),
    ),
}


def _hf_model(case: str):
    import transformers

    family, extra = CASES[case]
    cls = {"v2": "DeepseekV2", "v3": "DeepseekV3"}[family]
    cfg = getattr(transformers, f"{cls}Config")(**{**COMMON, **extra})
    cfg._attn_implementation = "eager"
    model = getattr(transformers, f"{cls}ForCausalLM")(cfg).eval()
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(std=0.05)  # nonzero, so that the bias mapping is exercised
        for name, param in model.named_parameters():
            if name.endswith("proj.bias"):  # initialised to zeros
                param.normal_(std=0.1)
    return model


def _state_dict_folder(hf, path, tensors=None):
    """A folder holding the transformers model's own state dict (experts stacked)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf.config.to_dict()))
    tensors = {k: v.contiguous() for k, v in (tensors or hf.state_dict()).items()}
    save_file(tensors, path / "model.safetensors")
    return path


def _set_path(model: DecoderLM, path: str) -> None:
    for m in model.modules():
        if isinstance(m, MultiHeadLatentAttention):
            m.path = path


@pytest.mark.parametrize("case", list(CASES))
@torch.no_grad()
def test_logits_and_greedy_tokens_match_transformers(case, tmp_path):
    hf = _hf_model(case)
    ours = load_hf(_state_dict_folder(hf, tmp_path / "sd"))  # stacked experts
    assert isinstance(ours, DecoderLM) and not ours.training
    idx = torch.randint(0, V, (2, 20))
    ref = hf(idx).logits
    for path in ("naive", "absorbed"):
        _set_path(ours, path)
        torch.testing.assert_close(ours(idx).logits, ref, rtol=1e-4, atol=1e-4)

    prompt = idx[:1, :6]
    # an explicit mask: transformers would otherwise mask prompt tokens equal to pad_token_id
    ref_tokens = hf.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=10,
        do_sample=False,
        pad_token_id=0,
    )[0, 6:].tolist()
    for path in ("naive", "absorbed", "auto"):
        _set_path(ours, path)
        assert ours.generate(prompt[0].tolist(), max_new_tokens=10) == ref_tokens, path

    # A checkpoint directory (experts one by one, as save_pretrained writes them).
    hf.save_pretrained(tmp_path / "hf")
    loaded = load_hf(tmp_path / "hf")
    torch.testing.assert_close(loaded(idx).logits, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "case",
    [
        "v3-moe-qlora",
        "v2-moe-greedy",
        "v3-dense-split-yarn",
        "v2-moe-group-qlora-yarn",
        "v3-biases-head-dims",
    ],
)
@torch.no_grad()
def test_saved_checkpoint_loads_in_transformers(case, tmp_path):
    import transformers

    hf = _hf_model(case)
    ours = load_hf(_state_dict_folder(hf, tmp_path / "sd"))
    family = CASES[case][0]
    assert hf_model_type(ours.cfg) == f"deepseek_{family}"
    save_hf(ours, tmp_path / "out")
    cls = getattr(transformers, f"Deepseek{family.upper()}ForCausalLM")
    back = cls.from_pretrained(tmp_path / "out").eval()
    idx = torch.randint(0, V, (2, 12))
    torch.testing.assert_close(back(idx).logits, hf(idx).logits, rtol=1e-5, atol=1e-5)
    assert config_from_hf(back.config.to_dict()) == ours.cfg


def test_missing_or_misshaped_tensor_is_one_error_naming_it(tmp_path):
    hf = _hf_model("v3-moe-qlora")
    sd = dict(hf.state_dict())
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    missing = {k: v for k, v in sd.items() if k != name}
    with pytest.raises(HFCheckpointError, match=f"missing tensors: {name}"):
        load_hf(_state_dict_folder(hf, tmp_path / "a", missing))
    wrong = {**sd, name: sd[name][:-1]}
    with pytest.raises(HFCheckpointError, match=rf"wrong shapes: {name} has shape"):
        load_hf(_state_dict_folder(hf, tmp_path / "b", wrong))
    with pytest.raises(HFCheckpointError, match="unexpected tensors: model.extra"):
        load_hf(_state_dict_folder(hf, tmp_path / "c", {**sd, "model.extra": torch.zeros(1)}))
    # Multi-token-prediction layers beyond num_hidden_layers are skipped.
    mtp = {**sd, "model.layers.3.eh_proj.weight": torch.zeros(1)}
    load_hf(_state_dict_folder(hf, tmp_path / "d", mtp))


def test_unsupported_config_is_refused():
    base = {**COMMON, "model_type": "deepseek_v3"}
    with pytest.raises(HFCheckpointError, match="RoPE scaling 'dynamic'"):
        config_from_hf({**base, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}})
    with pytest.raises(HFCheckpointError, match="kv_lora_rank"):
        config_from_hf({**base, "kv_lora_rank": None})


@torch.no_grad()
def test_v2_router_never_renormalises_as_transformers(tmp_path):
    """transformers' DeepSeek-V2 router ignores norm_topk_prob (its top-k weights are the
    softmax scores times routed_scaling_factor): the import follows it, with a warning, and
    the export refuses a V2 router that renormalises rather than write a flag transformers
    would ignore."""
    import transformers

    extra = dict(q_lora_rank=None, n_shared_experts=1, norm_topk_prob=True, initializer_range=0.3)
    cfg = transformers.DeepseekV2Config(**{**COMMON, **extra})
    cfg._attn_implementation = "eager"
    hf = transformers.DeepseekV2ForCausalLM(cfg).eval()
    with pytest.warns(UserWarning, match="norm_topk_prob=true is ignored"):
        ours = load_hf(_state_dict_folder(hf, tmp_path / "sd"))
    assert ours.cfg.ffn.norm_topk_prob is False
    idx = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(3))
    ref = hf(idx).logits
    torch.testing.assert_close(ours(idx).logits, ref, rtol=1e-4, atol=1e-4)

    renormalising = DecoderLM(ours.cfg.override({"ffn.norm_topk_prob": True})).eval()
    renormalising.load_state_dict(ours.state_dict())
    assert (renormalising(idx).logits - ref).abs().max() > 1e-2  # the flag matters here
    with pytest.raises(HFCheckpointError, match="norm_topk_prob"):
        save_hf(renormalising, tmp_path / "out")
    assert not (tmp_path / "out" / "config.json").exists()
    save_hf(ours, tmp_path / "out")  # without it, the same weights export
    back = transformers.DeepseekV2ForCausalLM.from_pretrained(tmp_path / "out").eval()
    torch.testing.assert_close(back(idx).logits, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["v3-moe-qlora", "v2-moe-greedy"])
@torch.no_grad()
def test_bf16_load_keeps_the_router_in_float32_as_transformers(case, tmp_path):
    """load_hf(dtype=bf16) keeps the routers' weights (and V3's balancing bias) float32, as
    transformers' from_pretrained(dtype=bf16) does: routing the same tokens the same way."""
    import transformers

    hf = _hf_model(case)
    hf.save_pretrained(tmp_path / "hf")
    family = CASES[case][0]
    cls = getattr(transformers, f"Deepseek{family.upper()}ForCausalLM")
    ref = cls.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16).eval()
    ours = load_hf(tmp_path / "hf", dtype=torch.bfloat16)
    theirs = {n: t for n, t in [*ref.named_parameters(), *ref.named_buffers()] if ".gate." in n}
    mine = [m for m in ours.modules() if type(m).__name__ == "Router"]
    assert mine and len(mine) * (2 if family == "v3" else 1) == len(theirs)
    if any(t.dtype != torch.float32 for t in theirs.values()):  # (5.17 did, 5.24 does not)
        pytest.skip(f"transformers {transformers.__version__} loads the routers in bf16")
    for name, tensor in theirs.items():
        layer = int(name.split(".layers.")[1].split(".")[0])
        router = ours.blocks[layer].ffn.gate
        attr = "weight" if name.endswith("gate.weight") else "e_score_correction_bias"
        value = getattr(router, attr)
        assert value.dtype == tensor.dtype == torch.float32, name
        torch.testing.assert_close(value, tensor, rtol=0, atol=0)
    assert ours.tok_emb.weight.dtype == torch.bfloat16
