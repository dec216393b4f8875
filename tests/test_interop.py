"""Hugging Face import/export: transformers models built from tiny random configs are the
independent reference (no downloads). Shapes: b batch, t length, V vocabulary size."""

from __future__ import annotations

import dataclasses
import json
import os
import re

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest  # noqa: E402
import torch  # noqa: E402
from oracle import assert_greedy_tokens_match_hf, hf_logits, hf_training_loss, randomize_weights  # noqa: E402
from safetensors.torch import load, load_file, save_file  # noqa: E402

from attnlab.config import ModelConfig, PositionConfig  # noqa: E402
from attnlab.interop import (  # noqa: E402
    SUPPORTED_MODEL_TYPES,
    HFCheckpointError,
    config_from_hf,
    hf_model_type,
    load_hf,
    qwen3_moe,
    save_hf,
)
from attnlab.interop.io import rope_to_hf  # noqa: E402
from attnlab.interop.registry import FAMILIES  # noqa: E402
from attnlab.models.decoder import DecoderLM  # noqa: E402
from attnlab.models.loadable import UntiedWeightsError  # noqa: E402
from attnlab.presets import get_preset, gpt2_style, llama_style, vaswani_tiny  # noqa: E402

transformers = pytest.importorskip("transformers")
transformers.utils.logging.disable_progress_bar()

VOCAB = 97
TOL = 1e-4  # float32; observed differences are ~1e-6 (different op order in each library)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Norm weights (1-D, "norm" or GPT-2's "ln_") in [0.5, 1.5), the rest random."""
    randomize_weights(model, seed, std=0.15, norms=(0.5, 1.5), is_norm=_is_norm)


def _is_norm(name: str, p: torch.Tensor) -> bool:
    return p.dim() == 1 and ("norm" in name or "ln_" in name) and name.endswith("weight")


def _hf_config(kind: str):
    small = dict(
        vocab_size=VOCAB,
        bos_token_id=None,
        eos_token_id=None,  # keep generation running for max_new_tokens
        pad_token_id=None,
        attn_implementation="eager",
    )
    llama_like = dict(
        hidden_size=32,
        intermediate_size=56,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        rms_norm_eps=1e-5,
    )
    if kind == "gpt2":
        return transformers.GPT2Config(
            n_positions=48, n_embd=32, n_layer=2, n_head=4, n_inner=48, **small
        )
    if kind == "gpt2_untied":
        return transformers.GPT2Config(
            n_positions=48, n_embd=32, n_layer=2, n_head=4, tie_word_embeddings=False, **small
        )
    if kind == "llama":  # GQA, untied
        return transformers.LlamaConfig(**llama_like, **small)
    if kind == "llama_bias":  # biases everywhere, head_dim != hidden / heads, tied
        return transformers.LlamaConfig(
            **{**llama_like, "num_key_value_heads": 4},
            head_dim=12,
            attention_bias=True,
            mlp_bias=True,
            hidden_act="gelu_pytorch_tanh",
            tie_word_embeddings=True,
            **small,
        )
    if kind == "qwen2":
        return transformers.Qwen2Config(**llama_like, tie_word_embeddings=False, **small)
    if kind == "qwen2_tied":
        return transformers.Qwen2Config(**llama_like, tie_word_embeddings=True, **small)
    if kind == "qwen3":  # QK-norm; GQA, head_dim != hidden / heads, untied
        return transformers.Qwen3Config(**llama_like, head_dim=12, **small)
    if kind == "qwen3_bias_tied":  # attention biases (q, k, v and o), tied, linear RoPE scaling
        rope = {"rope_type": "linear", "rope_theta": 500.0, "factor": 3.0}
        return transformers.Qwen3Config(
            **{**llama_like, "rope_parameters": rope},
            head_dim=12,
            attention_bias=True,
            tie_word_embeddings=True,
            **small,
        )
    if kind.startswith("qwen3moe"):  # 4 experts, top 2, softmax router
        moe = llama_like | dict(num_hidden_layers=3, num_experts=4, num_experts_per_tok=2)
        moe |= dict(moe_intermediate_size=16)
        if kind == "qwen3moe":  # a dense first layer, renormalised top-k, tied
            moe |= dict(mlp_only_layers=[0], norm_topk_prob=True, tie_word_embeddings=True)
        else:  # experts on every layer, weights not renormalised, head_dim 12, biases
            moe |= dict(head_dim=12, attention_bias=True)
        return transformers.Qwen3MoeConfig(**moe, **small)
    if kind.startswith("mixtral"):  # Mistral's attention, an MoE (top k renormalised) everywhere
        moe = llama_like | dict(num_hidden_layers=2, intermediate_size=16)
        if kind == "mixtral":  # no window; head_dim 12, 4 experts of which 2, tied
            moe |= dict(head_dim=12, num_local_experts=4, num_experts_per_tok=2)
            moe |= dict(tie_word_embeddings=True)
        else:  # a window shorter than the test sequences; 5 experts of which 3; untied
            moe |= dict(sliding_window=5, num_local_experts=5, num_experts_per_tok=3)
        return transformers.MixtralConfig(**moe, **small)
    if kind == "mistral":  # window shorter than the test sequences, so it matters
        return transformers.MistralConfig(**llama_like, sliding_window=5, **small)
    if kind == "llama_rope3":  # LLaMA 3.1 scaling; head_dim 8, theta 500: wavelengths 6,
        # 30, 140, 664 fall in the kept, ramp and scaled bands of original_max 64
        rope = {"rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0}
        rope |= {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
        rope |= {"original_max_position_embeddings": 64}
        return transformers.LlamaConfig(**{**llama_like, "rope_parameters": rope}, **small)
    if kind == "llama_yarn":  # YaRN with DeepSeek's mscale pair: cos/sin scaled by their ratio
        rope = {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0}
        rope |= {"original_max_position_embeddings": 16, "mscale": 1.0, "mscale_all_dim": 0.5}
        return transformers.LlamaConfig(**{**llama_like, "rope_parameters": rope}, **small)
    if kind == "llama_yarn_untruncated":  # gpt-oss's form: ramp bounds left unrounded (pair
        # 1 keeps 0.55 of its frequency, not 0.5) and an attention factor given outright
        rope = {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "beta_fast": 4.0}
        rope |= {"original_max_position_embeddings": 64, "truncate": False}
        rope |= {"attention_factor": 1.25}
        return transformers.LlamaConfig(**{**llama_like, "rope_parameters": rope}, **small)
    if kind == "qwen2_yarn":  # YaRN's defaults: attention factor 0.1 ln(factor) + 1
        rope = {"rope_type": "yarn", "rope_theta": 500.0, "factor": 2.0}
        return transformers.Qwen2Config(**{**llama_like, "rope_parameters": rope}, **small)
    if kind == "llama_linear":
        rope = {"rope_type": "linear", "rope_theta": 500.0, "factor": 3.0}
        return transformers.LlamaConfig(**{**llama_like, "rope_parameters": rope}, **small)
    raise ValueError(kind)


HF_CLASSES = {
    "gpt2": "GPT2LMHeadModel",
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
}
KINDS = ["gpt2", "gpt2_untied", "llama", "llama_bias", "qwen2", "qwen2_tied", "mistral"]
KINDS += ["llama_rope3", "llama_linear", "llama_yarn", "llama_yarn_untruncated", "qwen2_yarn"]
KINDS += ["qwen3", "qwen3_bias_tied", "qwen3moe", "qwen3moe_sparse"]
KINDS += ["mixtral", "mixtral_window"]


def _hf_model(kind: str, seed: int = 0, **changes):
    torch.manual_seed(seed)
    cls = getattr(transformers, HF_CLASSES[kind.split("_")[0]])
    hf = _hf_config(kind)
    for key, value in changes.items():
        setattr(hf, key, value)
    model = cls(hf)
    _randomize(model, seed)
    return model.eval()


@pytest.fixture(scope="module", params=KINDS)
def imported(request, tmp_path_factory):
    """(transformers model, attnlab model loaded from its save_pretrained directory)."""
    kind = request.param
    ref = _hf_model(kind, seed=KINDS.index(kind))
    path = tmp_path_factory.mktemp(kind)
    ref.save_pretrained(path)
    return kind, ref, load_hf(path)


def test_import_config(imported):
    kind, ref, model = imported
    cfg, hf = model.cfg, ref.config
    assert cfg.vocab_size == VOCAB and cfg.tie_embeddings == hf.tie_word_embeddings
    assert model.num_parameters() == ref.num_parameters()
    assert config_from_hf(hf.to_dict()) == cfg  # in-memory config, not only config.json
    if kind == "mistral":
        assert cfg.attention.sliding_window == 5
    if kind.startswith("qwen2"):
        assert cfg.attention.sliding_window is None  # use_sliding_window is false
        assert cfg.attention.qkv_bias and not cfg.attention.out_bias
    if kind == "llama_bias":
        assert cfg.head_dim == 12 and cfg.ffn.activation == "gelu_tanh"
    if kind in ("qwen3", "qwen3_bias_tied"):
        att = cfg.attention
        assert att.qk_norm and cfg.head_dim == 12 and cfg.n_kv_heads == 2
        assert att.qkv_bias == att.out_bias == hf.attention_bias and not cfg.ffn.bias
        # the QK-norm weights are loaded, not left at ones (_randomize set them)
        ours = model.blocks[1].attn.k_norm.weight
        assert torch.equal(ours, ref.model.layers[1].self_attn.k_norm.weight)
        assert (ours - 1).abs().max() > 0.1
    if kind.startswith("qwen3moe"):
        ffn = cfg.ffn
        assert (ffn.kind, ffn.router, ffn.n_shared_experts, ffn.routed_scaling_factor) == (
            "moe",
            "deepseek-v2",
            0,
            1.0,
        )
        assert (ffn.n_routed_experts, ffn.n_activated_experts, ffn.moe_hidden_dim) == (4, 2, 16)
        assert ffn.first_k_dense == len(hf.mlp_only_layers)
        assert ffn.norm_topk_prob == hf.norm_topk_prob and cfg.attention.qk_norm
    if kind.startswith("mixtral"):
        ffn, att = cfg.ffn, cfg.attention
        assert (ffn.kind, ffn.router, ffn.n_shared_experts, ffn.first_k_dense) == (
            "moe",
            "deepseek-v2",
            0,
            0,
        )
        assert ffn.norm_topk_prob and ffn.routed_scaling_factor == 1.0
        assert (ffn.n_routed_experts, ffn.n_activated_experts, ffn.moe_hidden_dim) == (
            hf.num_local_experts,
            hf.num_experts_per_tok,
            16,
        )
        assert att.sliding_window == hf.sliding_window and not att.qk_norm
        assert (cfg.n_kv_heads, cfg.head_dim) == (2, 12 if kind == "mixtral" else 8)
        assert cfg.position.rope_theta == 500.0
    if kind == "llama_rope3":
        pos = cfg.position
        assert (pos.rope_scaling, pos.rope_factor, pos.rope_original_max_seq_len) == (
            "llama3",
            8.0,
            64,
        )
    if "yarn" in kind:
        pos = cfg.position
        assert (pos.rope_scaling, pos.rope_factor) == ("yarn", hf.rope_parameters["factor"])
        assert pos.rope_truncate == (kind != "llama_yarn_untruncated")
        assert pos.rope_attention_factor == hf.rope_parameters.get("attention_factor")
    if kind == "llama_linear":
        assert (cfg.position.rope_scaling, cfg.position.rope_factor) == ("linear", 3.0)


def test_import_logits(imported):
    kind, ref, model = imported
    torch.manual_seed(1)
    idx = torch.randint(0, VOCAB, (3, 16))
    with torch.no_grad():
        ours = model(idx).logits
    theirs = hf_logits(ref, idx)
    assert theirs.abs().max() > 1.0  # the comparison is not between near-zero logits
    assert (ours - theirs).abs().max() <= TOL


def test_import_logits_left_padding(imported):
    kind, ref, model = imported
    torch.manual_seed(2)
    idx = torch.randint(0, VOCAB, (3, 16))
    mask = torch.ones_like(idx)
    mask[0, :5] = 0
    mask[2, :9] = 0
    idx = idx.masked_fill(mask == 0, 0)
    with torch.no_grad():
        ours = model(idx, attention_mask=mask).logits
    theirs = hf_logits(ref, idx, mask)
    real = mask.bool()
    assert (ours[real] - theirs[real]).abs().max() <= TOL


def test_import_greedy_generation(imported):
    kind, ref, model = imported
    assert_greedy_tokens_match_hf(ref, model, VOCAB)


def test_sharded_checkpoint(tmp_path):
    ref = _hf_model("llama", seed=11)
    ref.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    model = load_hf(tmp_path)
    idx = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (model(idx).logits - hf_logits(ref, idx)).abs().max() <= TOL


def test_export_replaces_a_sharded_checkpoint(tmp_path):
    """save_hf into a folder holding an earlier sharded save_pretrained removes the index and
    its shards: readers that follow the index (vLLM) would load the old weights."""
    old, new = _hf_model("llama", seed=11), _hf_model("llama", seed=12)
    out = tmp_path / "out"
    old.save_pretrained(out, max_shard_size="20KB")
    (out / "notes.txt").write_text("kept")
    new.save_pretrained(tmp_path / "new")
    save_hf(load_hf(tmp_path / "new"), out)
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",  # transformers', not a weight file: left alone
        "model.safetensors",
        "notes.txt",
    ]
    idx = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(0))
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert (back(idx).logits - hf_logits(new, idx)).abs().max() <= TOL


def test_malformed_index_is_a_checkpoint_error(tmp_path):
    _hf_model("llama", seed=11).save_pretrained(tmp_path, max_shard_size="20KB")
    index = tmp_path / "model.safetensors.index.json"
    for weight_map in ([], None, {"model.norm.weight": 3}):
        index.write_text(json.dumps({"weight_map": weight_map}))
        with pytest.raises(HFCheckpointError, match="weight_map"):
            load_hf(tmp_path)


def test_legacy_gpt2_layout(tmp_path):
    """Older GPT-2 files: no ``transformer.`` prefix, causal-mask buffers, a stored copy of
    the tied head. All load; the buffers are ignored."""
    ref = _hf_model("gpt2", seed=13)
    ref.save_pretrained(tmp_path)
    # in memory, not mapped from the file (safetensors < 0.8): the file is rewritten below
    tensors = load((tmp_path / "model.safetensors").read_bytes())
    legacy = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    legacy["h.0.attn.bias"] = torch.ones(1, 1, 48, 48).tril()
    legacy["h.0.attn.masked_bias"] = torch.tensor(-1e4)
    legacy["lm_head.weight"] = legacy["wte.weight"].clone()
    save_file(legacy, tmp_path / "model.safetensors")
    idx = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (load_hf(tmp_path)(idx).logits - hf_logits(ref, idx)).abs().max() <= TOL
    legacy["lm_head.weight"] = legacy["lm_head.weight"] + 1.0
    save_file(legacy, tmp_path / "model.safetensors")
    with pytest.raises(HFCheckpointError, match="lm_head.weight differs"):
        load_hf(tmp_path)


def test_gpt2_settings_both_ways(tmp_path):
    """What the round trips of attnlab presets leave alone: an MLP width other than 4 d
    (n_inner), a layer_norm_epsilon large enough to move the logits and the dropouts are
    imported and written back, so transformers rebuilds the same model."""
    torch.manual_seed(0)
    cfg = _hf_config("gpt2")  # n_inner 48 = 1.5 d
    cfg.layer_norm_epsilon, cfg.attn_pdrop, cfg.resid_pdrop, cfg.embd_pdrop = 0.05, 0.05, 0.15, 0.15
    ref = transformers.GPT2LMHeadModel(cfg)
    _randomize(ref, 14)
    ref.eval().save_pretrained(tmp_path / "hf")
    model = load_hf(tmp_path / "hf")
    c = model.cfg
    assert (c.ffn.hidden_dim, c.norm.eps, c.attention.dropout, c.dropout) == (48, 0.05, 0.05, 0.15)
    idx = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))
    expected = hf_logits(ref, idx)
    with torch.no_grad():
        torch.testing.assert_close(model(idx).logits, expected, atol=TOL, rtol=TOL)
    save_hf(model, tmp_path / "ours")
    back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "ours").eval()
    b = back.config
    assert (b.n_inner, b.layer_norm_epsilon, b.attn_pdrop, b.resid_pdrop) == (48, 0.05, 0.05, 0.15)
    torch.testing.assert_close(hf_logits(back, idx), expected, atol=TOL, rtol=TOL)


def test_load_dtype(tmp_path):
    _hf_model("qwen2", seed=12).save_pretrained(tmp_path)
    model = load_hf(tmp_path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.blocks[0].attn.rope.inv_freq.dtype == torch.float32  # not rounded
    assert not model.training


# --------------------------------------------------------------------------- export


def _llama(**kw) -> ModelConfig:
    args = dict(vocab_size=VOCAB, max_seq_len=64, d_model=32, n_layers=2, n_heads=4)
    args.update(n_kv_heads=2, ffn_hidden=40, rope_theta=300.0)
    return llama_style(**{**args, **kw})


def _with(cfg: ModelConfig, **changes) -> ModelConfig:
    return cfg.override(changes)


# Qwen3-MoE: QK-norm, 4 experts of which 2 per token by softmax, no shared experts
_QWEN3_MOE = {"attention.qk_norm": True, "ffn.kind": "moe", "ffn.router": "deepseek-v2"}
_QWEN3_MOE |= {"ffn.n_routed_experts": 4, "ffn.n_activated_experts": 2, "ffn.n_shared_experts": 0}
_QWEN3_MOE |= {"ffn.moe_hidden_dim": 16, "ffn.norm_topk_prob": True}
# Mixtral: the same without QK-norm, experts on every layer
_MIXTRAL = {k: v for k, v in _QWEN3_MOE.items() if k != "attention.qk_norm"}

EXPORTS = {
    "gpt2": (
        "gpt2",
        gpt2_style(vocab_size=VOCAB, max_seq_len=32, d_model=32, n_layers=2, n_heads=4),
    ),
    "gpt2_nobias_untied": (
        "gpt2",
        _with(
            gpt2_style(vocab_size=VOCAB, max_seq_len=32, d_model=32, n_layers=2, n_heads=4),
            **{"attention.qkv_bias": False, "attention.out_bias": False, "ffn.bias": False},
            **{"norm.bias": False, "tie_embeddings": False, "ffn.activation": "gelu"},
        ),
    ),
    # the same with a ReLU MLP: OPT's layout (GPT-2's MLP is GELU), no projection biases
    "opt_nobias_untied": (
        "opt",
        _with(
            gpt2_style(vocab_size=VOCAB, max_seq_len=32, d_model=32, n_layers=2, n_heads=4),
            **{"attention.qkv_bias": False, "attention.out_bias": False, "ffn.bias": False},
            **{"norm.bias": False, "tie_embeddings": False, "ffn.activation": "relu"},
        ),
    ),
    # post-norm blocks with learned positions: OPT's (OPT-350m's blocks), GELU kept
    "opt_post_norm": (
        "opt",
        _with(
            gpt2_style(vocab_size=VOCAB, max_seq_len=32, d_model=32, n_layers=2, n_heads=4),
            **{"norm.placement": "post"},
        ),
    ),
    "llama": ("llama", _llama()),
    "llama_interleaved": ("llama", _with(_llama(), **{"position.rope_layout": "interleaved"})),
    "llama_out_bias": ("llama", _with(_llama(), **{"attention.out_bias": True, "ffn.bias": True})),
    # heads wider than d_model / n_heads: config.json must say head_dim
    "llama_head_dim": ("llama", _with(_llama(), **{"attention.head_dim": 16})),
    "qwen2_interleaved_tied": (
        "qwen2",
        _with(
            _llama(qkv_bias=True, tie_embeddings=True), **{"position.rope_layout": "interleaved"}
        ),
    ),
    "mistral": ("mistral", _with(_llama(), **{"attention.sliding_window": 6})),
    "qwen3": ("qwen3", _with(_llama(), **{"attention.qk_norm": True, "attention.head_dim": 12})),
    # interleaved RoPE: the QK-norm weights are permuted with the q/k rows; a q/k/v bias
    # alone is written with a zero o_proj bias (Qwen3's attention_bias covers all four)
    "qwen3_interleaved_bias_tied": (
        "qwen3",
        _with(
            _llama(qkv_bias=True, tie_embeddings=True),
            **{"attention.qk_norm": True, "position.rope_layout": "interleaved"},
        ),
    ),
    "qwen3_window_pattern": (
        "qwen3",
        _with(
            _llama(),
            **{"attention.qk_norm": True, "attention.sliding_window": 6},
            **{"attention.layer_pattern": "GL"},
        ),
    ),
    "qwen3_moe": ("qwen3_moe", _with(_llama(), **_QWEN3_MOE, **{"ffn.first_k_dense": 1})),
    # interleaved RoPE, experts' weights not renormalised, a window on every layer
    "qwen3_moe_interleaved_window": (
        "qwen3_moe",
        _with(
            _llama(),
            **_QWEN3_MOE | {"ffn.norm_topk_prob": False},
            **{"position.rope_layout": "interleaved", "attention.sliding_window": 6},
        ),
    ),
    "mixtral": ("mixtral", _with(_llama(), **_MIXTRAL)),
    # interleaved RoPE, a window on every layer, tied, head_dim 12, 3 experts per token
    "mixtral_interleaved_window_tied": (
        "mixtral",
        _with(
            _llama(tie_embeddings=True),
            **_MIXTRAL | {"ffn.n_activated_experts": 3, "attention.head_dim": 12},
            **{"position.rope_layout": "interleaved", "attention.sliding_window": 6},
        ),
    ),
    "llama_rope3": (
        "llama",
        _with(
            _llama(),
            **{"position.rope_scaling": "llama3", "position.rope_factor": 4.0},
            **{"position.rope_original_max_seq_len": 16},
        ),
    ),
    "llama_yarn_untruncated": (
        "llama",
        _with(
            _llama(),
            **{"position.rope_scaling": "yarn", "position.rope_factor": 4.0},
            **{"position.rope_original_max_seq_len": 64, "position.rope_beta_fast": 4.0},
            **{"position.rope_truncate": False, "position.rope_attention_factor": 1.25},
        ),
    ),
    "qwen2_window": ("qwen2", _with(_llama(qkv_bias=True), **{"attention.sliding_window": 6})),
    # a layer_pattern of global layers only: no layer has the window (not a Mistral)
    "llama_global_pattern": (
        "llama",
        _with(_llama(), **{"attention.sliding_window": 6, "attention.layer_pattern": "G"}),
    ),
    # the pattern's global entry falls past the 2 layers: every layer has the window
    "mistral_pattern_past_layers": (
        "mistral",
        _with(_llama(), **{"attention.sliding_window": 6, "attention.layer_pattern": "LLG"}),
    ),
}


@pytest.mark.parametrize("name", list(EXPORTS))
def test_export_round_trip(name, tmp_path):
    model_type, cfg = EXPORTS[name]
    torch.manual_seed(20)
    model = DecoderLM(cfg).eval()
    _randomize(model, seed=len(name))
    assert hf_model_type(cfg) == model_type
    save_hf(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == model_type
    stored = load_file(tmp_path / "model.safetensors")
    assert ("lm_head.weight" in stored) == (not cfg.tie_embeddings)

    idx = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(idx)
    mask[1, :7] = 0
    with torch.no_grad():
        ours = model(idx, attention_mask=mask).logits
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    theirs = hf_logits(ref.eval(), idx, mask)
    real = mask.bool()
    assert ours.abs().max() > 1.0
    assert (ours[real] - theirs[real]).abs().max() <= TOL

    back = load_hf(tmp_path)
    assert back.cfg.position.rope_layout in ("split", cfg.position.rope_layout)
    with torch.no_grad():
        again = back(idx, attention_mask=mask).logits
    assert (ours[real] - again[real]).abs().max() <= TOL


@pytest.mark.parametrize(
    "changes, model_type",
    [
        ({}, "gpt2"),  # pre-norm, tanh GELU: GPT-2's
        ({"ffn.activation": "gelu"}, "gpt2"),
        ({"ffn.activation": "relu"}, "opt"),  # a ReLU MLP: OPT's
        ({"norm.placement": "post"}, "opt"),  # post-norm: GPT-2 has none
        ({"norm.placement": "post", "ffn.activation": "relu"}, "opt"),
        # one key/value head (multi-query): GPT-BigCode's, with any activation
        ({"attention.n_kv_heads": 1}, "gpt_bigcode"),
        ({"attention.n_kv_heads": 1, "ffn.activation": "relu"}, "gpt_bigcode"),
        ({"attention.n_kv_heads": 1, "ffn.activation": "gelu"}, "gpt_bigcode"),
        # (a single head is its own key/value head: multi-head, GPT-2's)
        ({"attention.n_heads": 1, "attention.n_kv_heads": 1}, "gpt2"),
    ],
)
def test_export_picks_one_family_for_learned_positions(changes, model_type):
    """Each learned-position LayerNorm decoder exports as exactly one of GPT-BigCode, OPT and
    GPT-2: GPT-BigCode takes the multi-query ones in pre-norm blocks, OPT post-norm blocks
    and ReLU MLPs with one key/value head per query head, GPT-2 the other pre-norm ones."""
    cfg = _with(EXPORTS["gpt2"][1], **changes)
    assert hf_model_type(cfg) == model_type
    assert [f.name for f in FAMILIES if f.exports(cfg)] == [model_type]  # no other claims it


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"position.kind": "sinusoidal", "norm.placement": "post"}, "post-norm"),  # no table
        # grouped key/value heads: GPT-BigCode has one or one per query head
        ({"attention.n_kv_heads": 2},
         "attention.n_kv_heads=2 (GPT-BigCode has one key/value head, multi_query, or one"),
        ({"attention.n_kv_heads": 2, "ffn.activation": "relu"}, "attention.n_kv_heads=2"),
        # multi-query in post-norm blocks: OPT's blocks, whose heads are all multi-head
        ({"attention.n_kv_heads": 1, "norm.placement": "post"},
         "OPT needs n_kv_heads == n_heads"),
    ],
)  # fmt: skip
def test_export_refuses_learned_positions_no_family_holds(changes, named):
    with pytest.raises(HFCheckpointError, match=re.escape(named)):
        hf_model_type(_with(EXPORTS["gpt2"][1], **changes))


@pytest.mark.parametrize(
    "preset, changes, model_type",
    [
        ("bert-tiny-qa", {}, "bert"),  # token types, BERT's pooler: BERT's
        ("bert-tiny-qa", {"embedding_size": 32}, "albert"),  # factorised embeddings
        ("bert-tiny-qa", {"embedding_size": 32, "layer_sets": 1}, "albert"),  # + shared
        (
            "bert-tiny-qa",
            {"type_vocab_size": 0, "classifier_transform": "distilbert"},
            "distilbert",
        ),  # no token types, DistilBERT's QA head
        ("distilbert-tiny", {}, "distilbert"),
        ("albert-tiny", {"layer_sets": None}, "albert"),
        ("roberta-tiny", {}, "roberta"),
        ("modernbert-tiny", {}, "modernbert"),  # no token types either: ModernBERT's first
        ("electra-tiny", {}, "electra"),  # the discriminator head
        ("bert-tiny-qa", {"head": "replaced_token"}, "electra"),  # a BERT-shaped discriminator
        ("electra-tiny", {"head": "mlm"}, "electra"),  # ELECTRA's classification head marks it
        ("electra-tiny", {"head": "mlm", "classifier_transform": "bert"}, "albert"),
        ("electra-tiny", {"head": "qa", "embedding_size": None, "classifier_transform": "bert"},
         "bert"),
    ],
)  # fmt: skip
def test_export_picks_one_family_per_encoder_layout(preset, changes, model_type):
    """ALBERT takes the encoders with factorised embeddings or shared layers, DistilBERT
    those without token types that ModernBERT does not take first, ELECTRA those with its
    discriminator or classification head, and none of them a config BERT exports."""
    cfg = get_preset(preset).override(changes)
    assert hf_model_type(cfg) == model_type
    claims = [f.name for f in FAMILIES if f.exports(cfg)]
    assert claims[0] == model_type
    if model_type == "bert":
        assert claims == ["bert"]


def test_export_unrepresentable(tmp_path):
    with pytest.raises(HFCheckpointError, match="post-norm"):
        save_hf(DecoderLM(vaswani_tiny()), tmp_path)
    gqa_gpt2 = _with(EXPORTS["gpt2"][1], **{"attention.n_kv_heads": 2})
    with pytest.raises(HFCheckpointError, match="n_kv_heads"):
        save_hf(DecoderLM(gqa_gpt2), tmp_path)
    with pytest.raises(HFCheckpointError, match="sliding window"):
        hf_model_type(_with(_llama(), **{"attention.sliding_window": 4, "ffn.bias": True}))
    # QK-norm exports as Qwen3 only: not as GPT-2, nor with feed-forward biases
    with pytest.raises(HFCheckpointError, match=r"attention\.qk_norm \(gpt2 has no QK-norm"):
        save_hf(DecoderLM(_with(EXPORTS["gpt2"][1], **{"attention.qk_norm": True})), tmp_path)
    with pytest.raises(HFCheckpointError, match="qk_norm exports as Qwen3, which has no ffn.bias"):
        hf_model_type(_with(_llama(), **{"attention.qk_norm": True, "ffn.bias": True}))
    # a ViT with it: no family of its architecture has QK-norm (no decoder hint)
    vit = get_preset("vit-digits").override({"attention.qk_norm": True})
    with pytest.raises(HFCheckpointError, match=r"attention\.qk_norm \(vit has no QK-norm\)$"):
        hf_model_type(vit)
    assert not (tmp_path / "config.json").exists()


# QK-norms beyond Qwen3's: Phi's LayerNorm (its bias), Cohere's and StableLM's per head
_LN_QK = {"attention.qk_norm": True, "attention.qk_norm_kind": "layernorm"}
_PER_HEAD_QK = {**_LN_QK, "attention.qk_norm_weight": "per_head"}
# Cohere's block on StableLM's preset: one LayerNorm without bias, whole heads rotated
_COHERE_BLOCK = {"norm.placement": "parallel_shared", "norm.bias": False,
                 "position.rope_fraction": 1.0}  # fmt: skip

# Persimmon's preset without its QK LayerNorm
_NO_QK = {"attention.qk_norm": False, "attention.qk_norm_kind": "rmsnorm",
          "attention.qk_norm_bias": False}  # fmt: skip

_BART_AS_MARIAN = {"position.kind": "sinusoidal", "sinusoid_layout": "split"}
_BART_AS_MARIAN |= {"position_offset": 0, "embedding_norm": False}


@pytest.mark.parametrize(
    "preset, changes, model_type",
    [
        ("stablelm-tiny", {}, "stablelm"),
        ("stablelm-tiny", _PER_HEAD_QK, "stablelm"),
        ("stablelm-2-12b", {}, "stablelm"),
        # parallel blocks of one norm and a gated feed-forward: StableLM's only where Cohere's
        # layout cannot hold them (a LayerNorm with a bias, a partial rotation)
        ("stablelm-tiny", {"norm.placement": "parallel_shared"}, "stablelm"),
        ("stablelm-tiny", {"norm.placement": "parallel_shared", "norm.bias": False}, "stablelm"),
        ("stablelm-tiny", _COHERE_BLOCK, "cohere"),
        ("stablelm-tiny", {**_COHERE_BLOCK, **_PER_HEAD_QK}, "cohere"),
        ("cohere-tiny", {}, "cohere"),
        ("cohere-tiny", _PER_HEAD_QK, "cohere"),
        ("cohere-tiny", {"logit_scale": 1.0}, "cohere"),
        ("cohere-tiny", {"logit_scale": 1.0, "norm.bias": True}, "stablelm"),
        ("command-r-plus", {}, "cohere"),
        # pre-norm blocks of LayerNorm and a gated feed-forward: StableLM's only
        ("llama-tiny", {"norm.kind": "layernorm"}, "stablelm"),
        ("llama-tiny", {"attention.qk_norm": True}, "qwen3"),
        ("phi-tiny", {}, "phi"),
        ("phi-tiny", {**_LN_QK, "attention.qk_norm_bias": True}, "phi"),
        ("phi-tiny", _LN_QK, "phi"),  # (its bias written as zeros)
        ("gptj-tiny", {}, "gptj"),
        ("falcon-tiny", {}, "falcon"),
        ("pythia-tiny", {}, "gpt_neox"),
        ("starcoder2-tiny", {}, "starcoder2"),
        ("phi3-tiny", {}, "phi3"),
        ("olmo2-tiny", {}, "olmo2"),
        ("gemma3-tiny", {}, "gemma3_text"),
        ("llama-tiny", {}, "llama"),
        # the squared ReLU or Phi's shared QK LayerNorm in pre-norm blocks of LayerNorm and an
        # MLP, one key/value head per query head: Persimmon's; without either, GPT-NeoX's
        # (a partial rotation) or StarCoder2's as before; grouped heads: StarCoder2's
        ("persimmon-tiny", {}, "persimmon"),
        ("persimmon-8b", {}, "persimmon"),
        ("persimmon-tiny", _NO_QK, "persimmon"),
        ("persimmon-tiny", {"ffn.activation": "gelu"}, "persimmon"),
        ("persimmon-tiny", {**_NO_QK, "ffn.activation": "gelu"}, "gpt_neox"),
        (
            "persimmon-tiny",
            {**_NO_QK, "ffn.activation": "gelu", "position.rope_fraction": 1.0},
            "starcoder2",
        ),  # fmt: skip
        ("starcoder2-tiny", {"ffn.activation": "relu2"}, "starcoder2"),
        ("pythia-tiny", {"ffn.activation": "relu2"}, "gpt_neox"),
        ("pythia-tiny", {"norm.placement": "pre", "ffn.activation": "relu2"}, "persimmon"),
        ("phi-tiny", {"ffn.activation": "relu2"}, "phi"),
        # the unit-offset LayerNorm: Nemotron's, whatever else the decoder has
        ("nemotron-tiny", {}, "nemotron"),
        ("minitron-8b", {}, "nemotron"),
        ("nemotron-tiny", {"ffn.activation": "silu", "attention.n_kv_heads": None}, "nemotron"),
        (
            "starcoder2-tiny",
            {"norm.kind": "layernorm1p", "attention.sliding_window": None},
            "nemotron",
        ),  # fmt: skip
        (
            "nemotron-tiny",
            {"norm.kind": "layernorm", "position.rope_fraction": 1.0},
            "starcoder2",
        ),  # fmt: skip
    ],
)
def test_export_picks_one_family_per_layout_and_qk_norm(preset, changes, model_type):
    """StableLM, Persimmon and Nemotron take the layouts only they hold and no config
    another family exports; each QK-norm kind goes with the layouts that have it."""
    assert hf_model_type(get_preset(preset).override(changes)) == model_type


@pytest.mark.parametrize(
    "preset, changes, named",
    [
        ("llama-tiny", _LN_QK,
         "attention.qk_norm_kind='layernorm' (qwen3's QK-norm has 'rmsnorm'; this QK-norm "
         "exports as phi or persimmon)"),
        ("llama-tiny", _PER_HEAD_QK,
         "attention.qk_norm_kind='layernorm' (qwen3's QK-norm has 'rmsnorm'; this QK-norm "
         "exports as cohere or stablelm)"),
        ("llama-tiny", {"attention.qk_norm": True, "attention.qk_norm_weight": "per_head"},
         "attention.qk_norm_weight='per_head' (qwen3's QK-norm has 'shared'; no exported "
         "family has this QK-norm)"),
        ("olmo2-tiny", {"attention.qk_norm_kind": "layernorm"},
         "attention.qk_norm_kind='layernorm' (olmo2's QK-norm has 'rmsnorm'; no exported "
         "family has this QK-norm)"),
        ("gpt2-tiny", _LN_QK,
         "attention.qk_norm (gpt2 has no QK-norm; decoders with it export as qwen3 or "
         "qwen3_moe or gemma3_text or olmo2 or phi or cohere or stablelm or persimmon, each "
         "its own kind)"),
        # Nemotron's unit-offset LayerNorm with LLaMA's gated feed-forward
        ("llama-tiny", {"norm.kind": "layernorm1p"},
         "ffn.kind='glu' (Nemotron's is 'mlp'); norm.kind='layernorm1p' exports as nemotron "
         "only"),
    ],
    ids=["layernorm-qwen3", "per-head-qwen3", "rms-per-head", "olmo2-layernorm", "gpt2",
         "layernorm1p-glu"],
)  # fmt: skip
def test_export_refuses_a_qk_norm_of_another_kind_by_name(preset, changes, named):
    with pytest.raises(HFCheckpointError, match=re.escape(named)):
        hf_model_type(get_preset(preset).override(changes))


def test_export_picks_the_alibi_families():
    """ALiBi decoders with LayerNorm and an MLP: bloom where the bias is added after the
    scale with a norm on the embeddings (BLOOM's), mpt without one (MPT's, its softmax scale
    and clamped projections included), falcon where it is scaled with q . k (Falcon-RW's),
    in any of Falcon's block layouts; what none holds, and ALiBi, an embedding norm or
    clamped projections reaching another family, refused by name."""
    bloom = get_preset("bloom-tiny").override({"vocab_size": VOCAB})
    mpt = get_preset("mpt-tiny").override({"vocab_size": VOCAB})
    rw = get_preset("falcon-rw-1b").override(
        {"vocab_size": VOCAB, "d_model": 32, "n_layers": 2, "attention.n_heads": 4,
         "ffn.hidden_dim": 128, "max_seq_len": 64}
    )  # fmt: skip
    assert hf_model_type(bloom) == "bloom"
    assert hf_model_type(rw) == "falcon"
    for layout in ("parallel_shared", "parallel"):
        assert hf_model_type(_with(rw, **{"norm.placement": layout})) == "falcon"
    assert hf_model_type(_with(rw, **{"attention.n_kv_heads": 1})) == "falcon"
    assert hf_model_type(mpt) == "mpt"
    assert hf_model_type(_with(mpt, **{"attention.scale": 0.3, "attention.clip_qkv": 1.0})) == "mpt"
    # an embedding norm is BLOOM's: MPT's layout with one and BLOOM's GELU exports as bloom
    as_bloom = _with(mpt, **{"embedding_norm": True, "ffn.activation": "gelu_tanh"})
    assert hf_model_type(as_bloom) == "bloom"
    refused = [
        (bloom, {"embedding_norm": False}, "attention.qkv_bias (MPT has no biases"),
        (mpt, {"embedding_norm": True}, "ffn.activation='gelu' (BLOOM's is the tanh GELU"),
        (mpt, {"position.alibi_max_bias": 4.0}, "alibi_max_bias=4.0 (transformers' MPT builds"),
        (mpt, {"ffn.hidden_dim": 96}, "ffn.hidden_dim=96 (transformers' MPT MLP is 4 d_model"),
        (mpt, {"norm.bias": True}, "norm.bias (MPT has no biases"),
        (mpt, {"position.alibi_scaled": True}, "alibi_bfloat16=false (transformers' Falcon"),
        (as_bloom, {"attention.clip_qkv": 1.0}, "attention.clip_qkv (bloom does not clamp"),
        (bloom, {"position.alibi_max_bias": 4.0}, "alibi_max_bias=4.0 (BLOOM's slopes have 8)"),
        (bloom, {"ffn.activation": "gelu"}, "ffn.activation='gelu' (BLOOM's is the tanh GELU"),
        (bloom, {"attention.n_kv_heads": 2}, "n_kv_heads=2 (BLOOM has one key/value head"),
        (bloom, {"norm.placement": "parallel"}, "norm.placement='parallel'"),
        (rw, {"position.alibi_bfloat16": False}, "alibi_bfloat16=false (transformers' Falcon"),
        (rw, {"attention.n_kv_heads": 2}, "n_kv_heads=2 in sequential blocks"),
        (rw, {"embedding_norm": True}, "embedding_norm (falcon has no norm on its embeddings"),
        (bloom, {"norm.kind": "rmsnorm"}, "position.kind='alibi' (use 'learned' or 'rope', or"),
        (bloom, {"attention.scale": 0.5}, "position.kind='alibi' (Gemma's is 'rope')"),
    ]
    for cfg, changes, named in refused:
        with pytest.raises(HFCheckpointError, match=re.escape(named)):
            hf_model_type(_with(cfg, **changes))


def test_export_picks_deberta_for_exactly_the_disentangled_encoders():
    """Disentangled attention (v3's shared projections, v2's own ones and absolute
    positions) exports as deberta-v2 and nothing else does: the same encoder with learned
    positions and BERT's pooler is BERT's or RoBERTa's, with DeBERTa's ContextPooler refused
    by name; what DeBERTa lacks is refused by name, not handed on."""
    deberta = get_preset("deberta-v3-tiny")
    v2 = {"position.disentangled_share_key": False, "position.disentangled_absolute": True}
    assert hf_model_type(deberta) == "deberta-v2"
    assert hf_model_type(_with(deberta, **v2, type_vocab_size=2)) == "deberta-v2"
    # (a new position section: the disentangled fields would be refused under learned ones)
    learned = dataclasses.replace(deberta, position=PositionConfig(kind="learned"))
    learned = _with(learned, type_vocab_size=2)
    with pytest.raises(HFCheckpointError, match=re.escape("position.kind='learned' (DeBERTa")):
        hf_model_type(learned)  # its ContextPooler is DeBERTa's alone
    learned = _with(learned, classifier_transform="bert")
    assert hf_model_type(learned) == "bert"
    assert hf_model_type(_with(learned, **{"position.padding_idx": 1})) == "roberta"
    assert hf_model_type(get_preset("roberta-tiny")) == "roberta"
    assert hf_model_type(get_preset("modernbert-tiny")) == "modernbert"
    with pytest.raises(HFCheckpointError, match=re.escape("DeBERTa uses post-norm")):
        hf_model_type(_with(deberta, **{"norm.placement": "pre"}))


@pytest.mark.parametrize(
    "preset, changes, model_type",
    [
        ("bart-tiny", {}, "bart"),
        ("mbart-large-cc25", {}, "mbart"),
        ("bart-tiny", {"norm.placement": "pre", "final_norm": True}, "mbart"),
        ("bart-tiny", _BART_AS_MARIAN, "marian"),  # sinusoids: Marian's
        ("t5-tiny", {}, "t5"),
        ("m2m100-tiny", {}, "m2m_100"),
        ("nllb-200-distilled-600m", {}, "m2m_100"),
        ("pegasus-tiny", {}, "pegasus"),
        # M2M100's sinusoids in Pegasus's blocks: M2M100's, as counted past the padding id
        (
            "pegasus-tiny",
            {
                "sinusoid_layout": "tensor2tensor",
                "final_logits_bias": False,
                "position.padding_idx": 0,
            },
            "m2m_100",
        ),  # fmt: skip
        ("pegasus-tiny", {"norm.placement": "post", "final_norm": False}, "marian"),
    ],
)
def test_export_picks_the_seq2seq_family_by_its_positions(preset, changes, model_type):
    """Learned positions are BART's (post-norm) or mBART's (pre-norm, final norms), split
    sinusoids Marian's (post-norm) or Pegasus's (pre-norm, final norms), sinusoids counted
    past the padding id (tensor2tensor's) M2M100's, a relative position bias T5's; each
    family takes only its own."""
    assert hf_model_type(get_preset(preset).override(changes)) == model_type


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"embedding_norm": False}, "BART needs a norm on the embeddings"),
        ({"norm.placement": "pre", "final_norm": False}, "BART needs post-norm blocks"),
        ({"position_offset": 0}, "BART needs position_offset=2"),
    ],
)
def test_export_names_what_keeps_learned_positions_out_of_bart(changes, named):
    """Learned positions go to BART, which names what it lacks (Marian's sinusoids would
    not take them either)."""
    with pytest.raises(HFCheckpointError, match=named):
        hf_model_type(get_preset("bart-tiny").override(changes))


@pytest.mark.parametrize(
    "preset, changes, named",
    [
        ("m2m100-tiny", {"position.padding_idx": None}, "M2M100 needs positions counted past"),
        ("pegasus-tiny", {"position.padding_idx": 0}, "M2M100 needs tensor2tensor sinusoids"),
        ("pegasus-tiny", {"sinusoid_layout": "interleaved"}, "Pegasus needs split sinusoids"),
    ],
)
def test_sinusoidal_seq2seq_families_name_what_they_lack(preset, changes, named):
    """Sinusoids counted past the padding id or tensor2tensor's go to M2M100, other
    pre-norm sinusoids to Pegasus: each names what keeps a config out."""
    with pytest.raises(HFCheckpointError, match=named):
        hf_model_type(get_preset(preset).override(changes))


@pytest.mark.parametrize(
    "preset, changes, named",
    [
        ("bart-tiny", {**_BART_AS_MARIAN, "embedding_norm": True}, "embedding_norm .BART's"),
        ("bart-tiny", {**_BART_AS_MARIAN, "forced_bos_id": 0}, "forced_bos_id .BART's"),
        ("t5-tiny", {"embedding_norm": True}, "no norm on the embeddings"),
        ("t5-tiny", {"forced_bos_id": 0}, "no blocked or forced tokens"),
    ],
)
def test_marian_and_t5_refuse_barts_pieces(preset, changes, named):
    """A norm on the embeddings or a forced first token has no place in Marian's or T5's
    config.json: named, not dropped."""
    with pytest.raises(HFCheckpointError, match=named):
        hf_model_type(get_preset(preset).override(changes))


def test_qwen3_moe_stacked_experts_and_what_it_cannot_hold(tmp_path):
    """A transformers model's own state dict (experts stacked: experts.gate_up_proj) loads
    as its checkpoint files do; dense layers other than the first ones (mlp_only_layers,
    decoder_sparse_step) are ffn.dense_layers and written back; a mixture of experts
    Qwen3-MoE cannot hold is refused on export by name."""
    ref = _hf_model("qwen3moe", seed=40)
    (tmp_path / "sd").mkdir()
    (tmp_path / "sd" / "config.json").write_text(json.dumps(ref.config.to_dict()))
    tensors = {k: v.contiguous() for k, v in ref.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in tensors
    del tensors["lm_head.weight"]  # tied
    save_file(tensors, tmp_path / "sd" / "model.safetensors")
    idx = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = load_hf(tmp_path / "sd")(idx).logits
    assert (ours - hf_logits(ref, idx)).abs().max() <= TOL
    hf = ref.config.to_dict()
    for dense, step, layers in (([1], 1, (0, [1])), ([], 2, (1, [2])), ([2], 1, (0, [2]))):
        cfg = config_from_hf({**hf, "mlp_only_layers": dense, "decoder_sparse_step": step})
        assert (cfg.ffn.first_k_dense, cfg.ffn.dense_layers) == layers
        written = qwen3_moe.config_to_hf(cfg, "qwen3_moe", torch.float32)
        assert written["decoder_sparse_step"] == 1 and config_from_hf(written) == cfg
        moe = [i for i in range(3) if i not in dense and (i + 1) % step == 0]
        assert [i for i in range(3) if i not in written["mlp_only_layers"]] == moe
    assert config_from_hf({**hf, "num_local_experts": 0}).ffn.kind == "glu"  # a dense Qwen3
    with pytest.raises(HFCheckpointError, match="decoder_sparse_step must be >= 1, got 0"):
        config_from_hf({**hf, "decoder_sparse_step": 0})
    cfg = _with(_llama(), **_QWEN3_MOE)
    for changes, named in (
        ({"ffn.n_shared_experts": 1}, "ffn.n_shared_experts=1"),
        ({"ffn.router": "deepseek-v3"}, "ffn.router='deepseek-v3'"),
        ({"ffn.routed_scaling_factor": 2.0}, "ffn.routed_scaling_factor=2.0"),
        ({"attention.sliding_window": 6, "attention.layer_pattern": "LG"}, "layer_pattern"),
    ):
        with pytest.raises(HFCheckpointError, match=re.escape(named)):
            hf_model_type(_with(cfg, **changes))
    # without QK-norm it is a Mixtral; Qwen3-MoE itself says so
    assert hf_model_type(_with(cfg, **{"attention.qk_norm": False})) == "mixtral"
    with pytest.raises(HFCheckpointError, match=r"qk_norm=False .* export as Mixtral\)$"):
        qwen3_moe.export_type(_with(cfg, **{"attention.qk_norm": False}))


def test_mixtral_stacked_experts_and_training_only_router_settings(tmp_path):
    """A transformers model's own state dict (``mlp.gate``, experts stacked in
    ``mlp.experts.gate_up_proj``) loads as the released per-expert ``block_sparse_moe``
    files do, with a window shorter than the sequence; the training-time router noise
    attnlab lacks (jitter) is read with a warning naming it."""
    ref = _hf_model("mixtral_window", seed=41)
    hf = ref.config.to_dict()
    (tmp_path / "sd").mkdir()
    (tmp_path / "sd" / "config.json").write_text(json.dumps(hf))
    tensors = {k: v.contiguous() for k, v in ref.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in tensors
    assert not any("block_sparse_moe" in k for k in tensors)
    save_file(tensors, tmp_path / "sd" / "model.safetensors")
    ref.save_pretrained(tmp_path / "files")
    stored = load_file(tmp_path / "files" / "model.safetensors")
    assert "model.layers.1.block_sparse_moe.experts.4.w3.weight" in stored
    idx = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    theirs = hf_logits(ref, idx)
    with torch.no_grad():
        fused, files = load_hf(tmp_path / "sd")(idx).logits, load_hf(tmp_path / "files")(idx).logits
    assert (fused - theirs).abs().max() <= TOL
    assert torch.equal(fused, files)

    with pytest.warns(UserWarning, match=r"router_jitter_noise=0\.1 is not implemented"):
        assert config_from_hf({**hf, "router_jitter_noise": 0.1}) == config_from_hf(hf)
    # num_experts (MixtralConfig's alias) wins over num_local_experts, as in transformers
    alias = {**hf, "num_experts": 4}
    assert config_from_hf(alias).ffn.n_routed_experts == 4
    assert transformers.MixtralConfig(**alias).num_local_experts == 4


def router_gradients_match(ref, model, padded: bool, seed: int) -> None:
    """transformers' training loss (task loss + router_aux_loss_coef x its Switch balance
    loss over all layers) is attnlab's loss + aux_loss, and the routers' gradients agree,
    in training mode (no dropout), on a batch left-padded or not (padding takes no target
    and no part in the balance loss on either side)."""
    ref.train().zero_grad()
    model.train().zero_grad()
    try:
        g = torch.Generator().manual_seed(seed)
        idx = torch.randint(0, model.cfg.vocab_size, (3, 12), generator=g)
        mask = torch.ones_like(idx)
        if padded:
            mask[0, :4], mask[2, :7] = 0, 0
        targets = torch.cat([idx[:, 1:], torch.full_like(idx[:, :1], -100)], dim=1)
        targets = targets.masked_fill(mask == 0, -100)  # a pad predicts no first token
        theirs = hf_training_loss(ref, idx, targets, mask if padded else None)
        out = model(idx, attention_mask=mask if padded else None, targets=targets)
        ours = out.loss + out.aux_loss
        theirs.backward()
        ours.backward()
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
        assert out.aux_loss > 0.1 * model.cfg.ffn.switch_aux_loss_coef  # E sum F P >= k
        moe = [(i, m) for i, m in enumerate(model.blocks) if model.cfg.ffn.moe_layer(i)]
        assert moe
        for i, block in moe:
            layer = ref.model.layers[i].mlp
            router = getattr(layer, "gate", None) or layer.router
            pairs = [(block.ffn.gate.weight.grad, router.weight.grad)]
            if getattr(router, "bias", None) is not None:
                pairs.append((block.ffn.gate.bias.grad, router.bias.grad))
            for got, want in pairs:
                assert want.abs().max() > 1e-3
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    finally:
        ref.eval().zero_grad()
        model.eval().zero_grad()


@pytest.mark.parametrize("kind", ["mixtral_window", "qwen3moe"])
def test_switch_balance_loss_trains_as_in_transformers_and_round_trips(kind, tmp_path):
    """output_router_logits with router_aux_loss_coef imports as ffn.switch_aux_loss_coef:
    the training loss and the routers' gradients are transformers' (Qwen3-MoE's dense first
    layer has no router), padded or not; export writes both keys back, and the coefficient
    0 as transformers' defaults with the loss off."""
    ref = _hf_model(kind, seed=42, output_router_logits=True, router_aux_loss_coef=0.3)
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
    save_hf(DecoderLM(config_from_hf(off)), tmp_path / "off")
    hf = json.loads((tmp_path / "off" / "config.json").read_text())
    assert (hf["output_router_logits"], hf["router_aux_loss_coef"]) == (False, 0.001)


def test_switch_balance_loss_is_not_written_where_a_family_has_none(tmp_path):
    """DeepSeek's config.json has no Switch balance loss: export warns that the setting is
    left out (the weights and logits are the same without it) and writes the folder."""
    cfg = get_preset("deepseek-moe-tiny").override(
        {"ffn.router": "deepseek-v2", "ffn.n_groups": 1, "ffn.topk_groups": 1,
         "ffn.norm_topk_prob": False, "position.rope_layout": "interleaved",
         "ffn.switch_aux_loss_coef": 0.01}
    )  # fmt: skip
    assert hf_model_type(cfg) == "deepseek_v2"
    with pytest.warns(UserWarning, match="switch_aux_loss_coef=0.01 is not written: deepseek_v2"):
        save_hf(DecoderLM(cfg), tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert "router_aux_loss_coef" not in hf and "output_router_logits" not in hf


def test_mixtral_export_is_the_released_layout_and_round_trips_exactly(tmp_path):
    """Export writes the per-expert block_sparse_moe layout of the released checkpoints,
    which transformers loads with nothing missing or left over; import(export(x)) gives the
    same tensors bit for bit and exports to the same files again."""
    _, cfg = EXPORTS["mixtral"]
    cfg = _with(cfg, **{"attention.sliding_window": 6, "ffn.hidden_dim": 16})
    torch.manual_seed(21)
    model = DecoderLM(cfg).eval()
    _randomize(model, seed=21)
    save_hf(model, tmp_path / "out")
    hf = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (hf["model_type"], hf["architectures"]) == ("mixtral", ["MixtralForCausalLM"])
    assert (hf["num_local_experts"], hf["num_experts_per_tok"], hf["intermediate_size"]) == (
        4,
        2,
        16,
    )
    assert (hf["sliding_window"], hf["router_jitter_noise"]) == (6, 0.0)
    stored = load_file(tmp_path / "out" / "model.safetensors")
    names = {re.sub(r"\.\d+\.", ".N.", k) for k in stored}
    assert {n for n in names if ".mlp." in n or "block_sparse_moe" in n} == {
        f"model.layers.N.block_sparse_moe.{n}"
        for n in (
            "gate.weight",
            "experts.N.w1.weight",
            "experts.N.w2.weight",
            "experts.N.w3.weight",
        )
    }
    e = model.blocks[1].ffn.experts
    assert torch.equal(
        stored["model.layers.1.block_sparse_moe.experts.3.w1.weight"], e.gate_up[3, :16]
    )
    assert torch.equal(
        stored["model.layers.1.block_sparse_moe.experts.3.w3.weight"], e.gate_up[3, 16:]
    )
    assert torch.equal(stored["model.layers.1.block_sparse_moe.experts.3.w2.weight"], e.down[3])
    ref, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", output_loading_info=True
    )
    assert type(ref).__name__ == "MixtralForCausalLM"
    assert not any(info.values()), info

    back = load_hf(tmp_path / "out")
    assert back.cfg == cfg
    ours, again = model.state_dict(), back.state_dict()
    assert ours.keys() == again.keys() and all(torch.equal(ours[k], again[k]) for k in ours)
    save_hf(back, tmp_path / "again")
    assert (tmp_path / "again" / "config.json").read_text() == json.dumps(hf, indent=2) + "\n"
    twice = load_file(tmp_path / "again" / "model.safetensors")
    assert twice.keys() == stored.keys() and all(torch.equal(twice[k], stored[k]) for k in stored)


# field Mixtral cannot hold -> (its change to a Mixtral config, the refusal's words)
_MIXTRAL_REFUSALS = [
    ({"norm.kind": "layernorm"}, "norm.kind='layernorm' (Mixtral's is 'rmsnorm')"),
    ({"ffn.first_k_dense": 1}, "ffn.first_k_dense=1 (Mixtral has experts on every layer"),
    ({"ffn.router": "deepseek-v3"}, "ffn.router='deepseek-v3' (Mixtral's is 'deepseek-v2')"),
    ({"ffn.n_shared_experts": 1}, "ffn.n_shared_experts=1 (Mixtral's is 0)"),
    ({"ffn.n_groups": 2, "ffn.topk_groups": 2}, "ffn.n_groups=2 (Mixtral's is 1)"),
    ({"ffn.norm_topk_prob": False}, "ffn.norm_topk_prob=False (Mixtral's is True)"),
    ({"ffn.routed_scaling_factor": 2.0}, "ffn.routed_scaling_factor=2.0 (Mixtral's is 1.0)"),
    ({"attention.qkv_bias": True}, "attention.qkv_bias=True (Mixtral's attention has no"),
    ({"attention.out_bias": True}, "attention.out_bias=True (Mixtral's attention has no"),
    (
        {"attention.sliding_window": 6, "attention.layer_pattern": "LG"},
        "attention.layer_pattern (Mixtral windows all layers or none)",
    ),
]


@pytest.mark.parametrize(
    "changes, named",
    _MIXTRAL_REFUSALS,
    ids=[named.split()[0].split("=")[0] for _, named in _MIXTRAL_REFUSALS],
)
def test_mixtral_export_refuses_what_it_cannot_hold(changes, named, tmp_path):
    """A mixture of experts without QK-norm exports as Mixtral or not at all: each field
    Mixtral cannot hold is one error naming it and Mixtral's value; nothing is written."""
    cfg = _with(EXPORTS["mixtral"][1], **changes)
    with pytest.raises(HFCheckpointError, match=re.escape(named)) as error:
        save_hf(DecoderLM(cfg), tmp_path)
    assert "\n" not in str(error.value)
    assert not (tmp_path / "config.json").exists()


def test_export_of_a_meta_loaded_tied_model_after_a_step_and_refusal_of_an_untied_one(tmp_path):
    """A tied GPT-2 given its weights by ``load_state_dict(assign=True)`` on the meta device
    keeps one head/embedding Parameter: after an optimizer step its export (which stores the
    tied tensor once) reloads with its logits. A model whose head came apart is refused."""
    cfg = EXPORTS["gpt2"][1]
    torch.manual_seed(0)
    twin = DecoderLM(cfg)
    with torch.device("meta"):
        model = DecoderLM(cfg)
    model.load_state_dict({k: v.clone() for k, v in twin.state_dict().items()}, assign=True)
    assert model.lm_head.weight is model.tok_emb.weight
    idx = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(5))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    model(idx, targets=idx).loss.backward()
    opt.step()
    save_hf(model.eval(), tmp_path / "tied")
    with torch.no_grad():
        assert torch.equal(load_hf(tmp_path / "tied")(idx).logits, model(idx).logits)

    model.lm_head.weight = torch.nn.Parameter(model.tok_emb.weight.detach().clone())
    with pytest.raises(UntiedWeightsError, match=r"lm_head\.weight .* tok_emb\.weight"):
        save_hf(model, tmp_path / "untied")
    assert not (tmp_path / "untied").exists()


_MLA = {
    "attention.kind": "mla",
    "attention.n_kv_heads": None,
    "position.rope_layout": "interleaved",
}


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"attention.sink_logits": True}, "sink_logits"),
        ({"attention.sliding_window": 6, "attention.sink_tokens": 2}, "sink_tokens"),
        ({"attention.sliding_window": 6, "attention.global_tokens": [0, 3]}, "global_tokens"),
        ({**_MLA, "attention.sliding_window": 5}, "sliding_window"),
    ],
    ids=["sink_logits", "sink_tokens", "global_tokens", "mla_window"],
)
def test_export_refuses_attention_it_would_drop(changes, named, tmp_path):
    """Features no exported architecture has are refused by name, never written without
    them (transformers would load such a folder and give other logits)."""
    bases = [_llama()] + ([] if "attention.kind" in changes else [EXPORTS["gpt2"][1]])
    for base in bases:
        cfg = _with(base, **changes)
        with pytest.raises(HFCheckpointError, match=named):
            save_hf(DecoderLM(cfg), tmp_path)
        assert not (tmp_path / "config.json").exists()
    # without the feature the same model exports
    plain = {k: v for k, v in changes.items() if k in _MLA}
    assert hf_model_type(_with(_llama(), **plain)) in ("llama", "deepseek_v3")


# --------------------------------------------------------------------------- config


def test_config_rope_forms():
    """transformers 4.x writes rope_theta/rope_scaling, 5.x writes rope_parameters."""
    base = {
        "model_type": "llama",
        "vocab_size": 10,
        "hidden_size": 16,
        "intermediate_size": 24,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "max_position_embeddings": 32,
    }
    v4 = config_from_hf({**base, "rope_theta": 5e5, "rope_scaling": None})
    v5 = config_from_hf({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}})
    assert v4 == v5 and v4.position.rope_theta == 5e5
    assert config_from_hf(base).position.rope_theta == 10000.0
    v4_linear = config_from_hf({**base, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert (v4_linear.position.rope_scaling, v4_linear.position.rope_factor) == ("linear", 2.0)
    for scaling in (
        {"rope_scaling": {"type": "dynamic", "factor": 2.0}},
        {"rope_parameters": {"rope_type": "longrope", "rope_theta": 5e5, "factor": 8.0}},
    ):
        with pytest.raises(HFCheckpointError, match="RoPE scaling"):
            config_from_hf({**base, **scaling})
    qwen = {**base, "model_type": "qwen2", "use_sliding_window": False, "sliding_window": 4}
    qwen["num_key_value_heads"] = 2  # Qwen2Config's default is 32
    assert config_from_hf(qwen).attention.sliding_window is None
    mixed = {**qwen, "use_sliding_window": True, "max_window_layers": 1, "num_hidden_layers": 2}
    assert config_from_hf(mixed).attention.layer_pattern == "GL"  # layer 0 global
    with pytest.raises(HFCheckpointError, match="layer_types=.*full_attention or sliding"):
        config_from_hf({**mixed, "layer_types": ["sliding_attention", "chunked_attention"]})


@pytest.mark.parametrize("given", [None, 12])
@pytest.mark.parametrize("rope_type", ["llama3", "yarn"])
def test_config_rope_original_context_as_transformers_reads_it(rope_type, given):
    """Scaled RoPE's pre-training context: the RoPE parameters' original_max_position_
    embeddings, else max_position_embeddings (transformers' reading of the same dict is the
    reference; LLaMA for llama3, DeepSeek-V3 for YaRN)."""
    params = {"rope_type": rope_type, "rope_theta": 500.0, "factor": 4.0}
    hf = {"vocab_size": 10, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 1,
          "num_attention_heads": 2, "max_position_embeddings": 48}  # fmt: skip
    if rope_type == "llama3":
        params |= {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
        model_type, cls = "llama", transformers.LlamaConfig
    else:
        hf |= {"num_key_value_heads": 2, "kv_lora_rank": 8, "q_lora_rank": None,
               "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8}  # fmt: skip
        model_type, cls = "deepseek_v3", transformers.DeepseekV3Config
    if given is not None:
        params["original_max_position_embeddings"] = given
    hf["rope_parameters"] = params
    ours = config_from_hf({**hf, "model_type": model_type}).position.rope_original_max_seq_len
    theirs = cls(**hf).rope_parameters["original_max_position_embeddings"]  # (fills in hf's)
    assert ours == theirs == (given or 48)


def test_config_yarn_null_factor_is_the_context_ratio_as_transformers_reads_it():
    """DeepSeek-V3-style YaRN with ``factor: null``: transformers stretches by
    max_position_embeddings / original_max_position_embeddings (here 4), not by 1."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from attnlab.nn.rope import RotaryEmbedding

    hf = {"vocab_size": 10, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 1,
          "num_attention_heads": 2, "num_key_value_heads": 2, "kv_lora_rank": 8,
          "q_lora_rank": None, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8,
          "max_position_embeddings": 512}  # fmt: skip
    hf["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": None,
                             "original_max_position_embeddings": 128}  # fmt: skip
    cfg = config_from_hf({**hf, "model_type": "deepseek_v3"})
    ours = RotaryEmbedding.from_config(cfg.rope_dim, cfg.position)
    ref_inv_freq, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](transformers.DeepseekV3Config(**hf))
    torch.testing.assert_close(ours.inv_freq, ref_inv_freq, rtol=1e-6, atol=0)
    assert ours.attention_factor == pytest.approx(ref_factor, rel=1e-12)
    assert cfg.position.rope_factor == 4.0


@pytest.mark.parametrize("in_params", [None, 24])
@pytest.mark.parametrize("rope_type", ["llama3", "yarn"])
def test_config_top_level_original_context_wins_as_transformers_reads_it(rope_type, in_params):
    """A config.json with original_max_position_embeddings at the top level (Phi-3's place
    for it): transformers scales RoPE by that one, over the RoPE parameters' own and over
    max_position_embeddings; so do attnlab's frequencies (they used 24 or 48: other logits)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from attnlab.nn.rope import RotaryEmbedding

    params = {"rope_type": rope_type, "rope_theta": 500.0, "factor": 4.0}
    if rope_type == "llama3":
        params |= {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
    if in_params is not None:
        params["original_max_position_embeddings"] = in_params
    hf = {"vocab_size": 10, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 1,
          "num_attention_heads": 2, "max_position_embeddings": 48,
          "original_max_position_embeddings": 12}  # fmt: skip
    cfg = config_from_hf({**hf, "model_type": "llama", "rope_parameters": dict(params)})
    ours = RotaryEmbedding.from_config(cfg.head_dim, cfg.position)
    ref = transformers.LlamaConfig(**hf, rope_parameters=dict(params))
    ref_inv_freq, ref_factor = ROPE_INIT_FUNCTIONS[rope_type](ref)
    assert cfg.position.rope_original_max_seq_len == 12
    torch.testing.assert_close(ours.inv_freq, ref_inv_freq, rtol=1e-6, atol=0)
    assert ours.attention_factor == pytest.approx(ref_factor, rel=1e-12)


@pytest.mark.parametrize("truncate", ["absent", True, None, False])
@pytest.mark.parametrize("attention_factor", ["absent", None, 0.75])
def test_config_yarn_truncate_and_attention_factor_as_transformers_reads_them(
    truncate, attention_factor
):
    """YaRN's ramp bounds are rounded outward when ``truncate`` is absent or true, left
    as they are when it is false, or null (transformers tests its truth); an
    ``attention_factor`` replaces the one derived from factor and the mscales."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from attnlab.nn.rope import RotaryEmbedding

    params = {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "mscale": 1.0,
              "mscale_all_dim": 0.5, "original_max_position_embeddings": 16}  # fmt: skip
    for key, value in (("truncate", truncate), ("attention_factor", attention_factor)):
        if value != "absent":
            params[key] = value
    hf = {"vocab_size": 10, "hidden_size": 64, "intermediate_size": 24, "num_hidden_layers": 1,
          "num_attention_heads": 2, "max_position_embeddings": 64}  # fmt: skip
    ref_inv_freq, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](
        transformers.LlamaConfig(**hf, rope_parameters=dict(params))
    )
    plain = {k: v for k, v in params.items() if k != "attention_factor"} | {"truncate": True}
    rounded, derived = ROPE_INIT_FUNCTIONS["yarn"](
        transformers.LlamaConfig(**hf, rope_parameters=plain)
    )
    # the cases differ: bounds unrounded give other frequencies, a factor given another one
    assert ((ref_inv_freq - rounded).abs().max() > 1e-3) == (truncate in (None, False))
    assert (ref_factor != derived) == (attention_factor == 0.75)
    cfg = config_from_hf({**hf, "model_type": "llama", "rope_parameters": dict(params)})
    ours = RotaryEmbedding.from_config(cfg.head_dim, cfg.position)
    torch.testing.assert_close(ours.inv_freq, ref_inv_freq, rtol=1e-6, atol=0)
    assert ours.attention_factor == pytest.approx(ref_factor, rel=1e-12)
    # and back: what export writes, transformers reads as the same frequencies
    written = rope_to_hf(cfg.position)
    again, again_factor = ROPE_INIT_FUNCTIONS["yarn"](
        transformers.LlamaConfig(**hf, rope_parameters=written)
    )
    torch.testing.assert_close(again, ref_inv_freq, rtol=0, atol=0)
    assert again_factor == pytest.approx(ref_factor, rel=1e-12)
    assert ("truncate" in written) == (truncate in (None, False))  # written when not default


def test_config_yarn_truncate_that_is_not_a_boolean_is_refused():
    hf = {"model_type": "llama", "vocab_size": 10, "hidden_size": 64, "intermediate_size": 24,
          "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 64,
          "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "truncate": "false"}}  # fmt: skip
    with pytest.raises(HFCheckpointError, match="YaRN truncate must be true, false or null"):
        config_from_hf(hf)
    hf["rope_parameters"] |= {"truncate": False, "attention_factor": -1.0}
    with pytest.raises(HFCheckpointError, match="rope_attention_factor: must be > 0"):
        config_from_hf(hf)


@pytest.mark.parametrize(
    "params",
    [
        {"rope_type": "linear"},
        {"type": "linear", "factor": None},
        {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0},
        {"rope_type": "yarn", "original_max_position_embeddings": 16},
    ],
)
def test_config_rope_without_a_required_key_is_refused(params):
    """transformers raises on these; attnlab's defaults (factor 1) would not stretch at all."""
    hf = {"model_type": "deepseek_v3" if "yarn" in params.values() else "llama",
          "vocab_size": 10, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 1,
          "num_attention_heads": 2, "max_position_embeddings": 32, "kv_lora_rank": 8,
          "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8,
          "rope_parameters": params}  # fmt: skip
    with pytest.raises(HFCheckpointError, match="RoPE parameters for rope_type .* need"):
        config_from_hf(hf)


def test_config_errors():
    with pytest.raises(HFCheckpointError, match="model_type 'codegen' is not supported") as err:
        config_from_hf({"model_type": "codegen"})
    listed = str(err.value).split("supported: ")[1].split(", ")
    assert sorted(listed) == sorted(SUPPORTED_MODEL_TYPES)
    assert {"gpt2", "llama", "qwen3_moe", "deepseek_v32", "bert", "marian", "vit"} <= set(listed)
    with pytest.raises(HFCheckpointError, match="LlamaForSequenceClassification"):
        config_from_hf({"model_type": "llama", "architectures": ["LlamaForSequenceClassification"]})
    gpt2 = {"model_type": "gpt2", "vocab_size": 10, "n_positions": 8, "n_embd": 8}
    gpt2 |= {"n_layer": 1, "n_head": 2}
    assert config_from_hf(gpt2).ffn.activation == "gelu_tanh"  # gelu_new
    with pytest.raises(HFCheckpointError, match="scale_attn_by_inverse_layer_idx"):
        config_from_hf({**gpt2, "scale_attn_by_inverse_layer_idx": True})
    # a missing n_embd is GPT2Config's default (768); a null one is refused by name
    assert config_from_hf({k: v for k, v in gpt2.items() if k != "n_embd"}).d_model == 768
    with pytest.raises(HFCheckpointError, match="n_embd"):
        config_from_hf({**gpt2, "n_embd": None})


# --------------------------------------------------------------------------- file errors


@pytest.fixture
def saved_llama(tmp_path):
    _hf_model("llama", seed=30).save_pretrained(tmp_path)
    return tmp_path


def test_missing_tensor(saved_llama):
    tensors = load_file(saved_llama / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, saved_llama / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(HFCheckpointError, match=r"missing tensors: model\.layers\.1\.self_attn"):
        load_hf(saved_llama)


def test_unexpected_and_misshaped_tensor(saved_llama):
    # in memory, not mapped from the file (safetensors < 0.8): the file is rewritten below
    tensors = load((saved_llama / "model.safetensors").read_bytes())
    save_file({**tensors, "model.extra.weight": torch.zeros(3)}, saved_llama / "model.safetensors")
    with pytest.raises(HFCheckpointError, match=r"unexpected tensors: model\.extra\.weight"):
        load_hf(saved_llama)
    tensors["model.norm.weight"] = torch.ones(31)
    save_file(tensors, saved_llama / "model.safetensors")
    with pytest.raises(HFCheckpointError, match=r"model\.norm\.weight has shape \(31,\)"):
        load_hf(saved_llama)


def test_missing_files(saved_llama, tmp_path_factory):
    empty = tmp_path_factory.mktemp("empty")
    with pytest.raises(HFCheckpointError, match="no config.json"):
        load_hf(empty)
    with pytest.raises(HFCheckpointError, match="not a directory"):
        load_hf(empty / "nowhere")
    (saved_llama / "model.safetensors").rename(saved_llama / "pytorch_model.bin")
    with pytest.raises(HFCheckpointError, match="safetensors only"):
        load_hf(saved_llama)
    (saved_llama / "pytorch_model.bin").unlink()
    with pytest.raises(HFCheckpointError, match="no model.safetensors"):
        load_hf(saved_llama)


def test_unsupported_model_type_dir(saved_llama):
    config = json.loads((saved_llama / "config.json").read_text())
    config["model_type"] = "codegen"
    (saved_llama / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFCheckpointError, match="model_type 'codegen' is not supported"):
        load_hf(saved_llama)


def test_llama_weight_maps_give_dense_ffn_biases_to_dense_layers_only():
    """A mixture of experts after a dense first layer, with ffn.bias: the LLaMA-layout
    weight maps (which the MoE families build on) write and read mlp biases for the dense
    layer only; the experts have none (they asked the MoE layers for dense biases)."""
    from attnlab.interop import llama
    from attnlab.interop.io import Source

    cfg = get_preset("llama-tiny").override(
        {"ffn.kind": "moe", "ffn.bias": True, "ffn.first_k_dense": 1, "ffn.n_shared_experts": 0}
    )
    sd = DecoderLM(cfg).state_dict()
    out = llama.weights_from_attnlab(sd, cfg, "llama")
    assert "model.layers.0.mlp.gate_proj.bias" in out
    assert not any(k.startswith("model.layers.1.mlp.") for k in out)
    src = Source({k: tuple(v.shape) for k, v in out.items()}, llama.IGNORED)
    plan = llama.weights_to_attnlab(src, cfg)
    assert "blocks.0.ffn.gate_up.bias" in plan and "blocks.1.ffn.gate_up.bias" not in plan
    assert not src.missing and not src.wrong
