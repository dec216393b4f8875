"""config.json keys missing from a Hugging Face config are read as transformers fills them:
from the config class of the model_type (the families' ``defaults`` tables), so a minimal
config.json gives attnlab the model ``from_pretrained`` builds."""

from __future__ import annotations

import inspect
import json

import pytest

from attnlab.interop import SUPPORTED_MODEL_TYPES, HFCheckpointError, config_from_hf
from attnlab.interop.registry import BY_MODEL_TYPE

_MLA = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 5,
    "num_attention_heads": 4,
    "vocab_size": 100,
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "v_head_dim": 8,
}
_RMS = {"vocab_size": 100, "intermediate_size": 128, "num_hidden_layers": 2}

# model_type -> minimal config.json entries: small sizes, plus the keys attnlab needs that
# transformers leaves None (DeepSeek-V2's num_experts_per_tok). Everything else (dropout,
# windows, router settings, special tokens, ...) is left to the defaults.
_BART = {
    "d_model": 32,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64,
    "max_position_embeddings": 64,
}
MINIMAL: dict[str, list[dict]] = {
    "gpt2": [{"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64, "vocab_size": 100}],
    "llama": [{**_RMS, "hidden_size": 64, "num_attention_heads": 4}],
    # 16 heads of 4: num_key_value_heads defaults to 8
    "mistral": [{**_RMS, "hidden_size": 64, "num_attention_heads": 16}],
    # 32 heads: num_key_value_heads defaults to 32
    "qwen2": [
        {**_RMS, "hidden_size": 128, "num_attention_heads": 32},
        # window 4096 (the default) from layer 1 on
        {
            **_RMS,
            "hidden_size": 128,
            "num_attention_heads": 32,
            "num_hidden_layers": 3,
            "use_sliding_window": True,
            "max_window_layers": 1,
        },
    ],
    # 32 heads: num_key_value_heads defaults to 32; head_dim to 128 (not 128 / 32)
    "qwen3": [
        {**_RMS, "hidden_size": 128, "num_attention_heads": 32},
        # window 4096 (the default) from layer 1 on; attention biases
        {
            **_RMS,
            "hidden_size": 128,
            "num_attention_heads": 32,
            "num_hidden_layers": 3,
            "use_sliding_window": True,
            "max_window_layers": 1,
            "attention_bias": True,
        },
    ],
    # 16 heads of 4 (num_key_value_heads defaults to 16), 60 experts of 1408, 4 per token,
    # not renormalised, a gated shared expert of 5632 (4 x 1408), q/k/v biases, by default;
    # experts on every 2nd layer and windows (4096) on the even layers below
    # max_window_layers
    "qwen2_moe": [
        {**_RMS, "hidden_size": 64, "num_attention_heads": 16},
        {
            **_RMS,
            "hidden_size": 64,
            "num_attention_heads": 16,
            "num_hidden_layers": 4,
            "decoder_sparse_step": 2,
            "use_sliding_window": True,
            "max_window_layers": 3,
        },
    ],
    # 128 experts of 768, 8 per token, by default; a dense first layer
    "qwen3_moe": [
        {**_RMS, "hidden_size": 64, "num_attention_heads": 4},
        {**_RMS, "hidden_size": 64, "num_attention_heads": 8, "mlp_only_layers": [0]},
    ],
    # 16 heads of 4: num_key_value_heads defaults to 8; RoPE theta to 1e6 (default_theta);
    # 8 experts of intermediate_size, 2 per token
    "mixtral": [
        {**_RMS, "hidden_size": 64, "num_attention_heads": 16},
        {
            **_RMS,
            "hidden_size": 64,
            "num_attention_heads": 16,
            "sliding_window": 8,
            "num_experts": 4,  # MixtralConfig's alias of num_local_experts
            "num_experts_per_tok": 3,
        },
    ],
    # 128 experts (4 per token) of intermediate_size, head_dim 64 and 8 key/value heads,
    # layers alternating sliding (window 128) and full, YaRN x32, by default
    "gpt_oss": [
        {
            "vocab_size": 100,
            "hidden_size": 64,
            "intermediate_size": 32,
            "num_hidden_layers": 3,
            "num_attention_heads": 8,
            "num_local_experts": 4,
        },
        # experts by their other name, plain RoPE of another theta, layers of its own
        {
            "vocab_size": 100,
            "hidden_size": 64,
            "intermediate_size": 32,
            "num_hidden_layers": 3,
            "num_attention_heads": 16,
            "num_experts": 8,
            "sliding_window": 6,
            "layer_types": ["full_attention", "sliding_attention", "sliding_attention"],
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0},
        },
    ],
    # 16 heads of 256 (16 key/value heads), "gelu" read as the tanh approximation
    "gemma": [{**_RMS, "hidden_size": 64}, {**_RMS, "hidden_size": 64, "hidden_act": "gelu"}],
    # 8 heads of 256 (4 key/value heads), local and global layers alternating, windows of
    # 4096, soft caps of 50 (attention) and 30 (logits)
    "gemma2": [{**_RMS, "hidden_size": 64, "num_hidden_layers": 3}],
    # 8 heads of 256 (4 key/value heads), every 6th layer global, windows of 4096, bases 1e6
    # (global) and 1e4 (local), query_pre_attn_scalar 256, a tied head, by default
    "gemma3_text": [
        {**_RMS, "hidden_size": 64, "num_hidden_layers": 7},
        # transformers 4.x's keys: a window pattern, the two bases, linear RoPE scaling
        {
            **_RMS,
            "hidden_size": 64,
            "num_hidden_layers": 4,
            "head_dim": 16,
            "num_attention_heads": 4,
            "sliding_window_pattern": 2,
            "rope_theta": 1000.0,
            "rope_local_base_freq": 20.0,
            "rope_scaling": {"rope_type": "linear", "factor": 4.0},
            "query_pre_attn_scalar": 24,
        },
    ],
    # 32 heads of 4 (num_key_value_heads: num_attention_heads), rms_norm_eps 1e-5, RoPE
    # theta 1e4, an untied head, by default
    "smollm3": [
        # 8 layers: the default interval makes layers 3 and 7 NoPE; RoPE base 2e6, GQA 4 kv
        {**_RMS, "hidden_size": 64, "num_attention_heads": 8, "num_hidden_layers": 8},
        # an irregular no_rope_layers, untied, biases, another interval (ignored with the list)
        {
            **_RMS,
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "no_rope_layers": [0, 1],
            "no_rope_layer_interval": 2,
            "attention_bias": True,
            "mlp_bias": True,
            "tie_word_embeddings": False,
        },
        # the interval alone
        {**_RMS, "hidden_size": 64, "num_attention_heads": 4, "no_rope_layer_interval": 1},
    ],
    "olmo2": [
        {**_RMS, "hidden_size": 128, "num_attention_heads": 32},
        # GQA, attention biases (q, k, v and o), transformers 4.x's RoPE keys, LLaMA 3 scaling
        {
            **_RMS,
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "attention_bias": True,
            "rope_theta": 5e5,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 512,
            },
        },
    ],
    # 32 heads (num_key_value_heads: num_attention_heads), a softmax scale of 1 and the
    # other multipliers 1, an untied head, by default
    "granite": [
        {**_RMS, "hidden_size": 64, "num_attention_heads": 4},
        {
            **_RMS,
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "embedding_multiplier": 12.0,
            "residual_multiplier": 0.22,
            "attention_multiplier": 0.0625,
            "logits_scaling": 8.0,
        },
    ],
    # 24 heads of 4 (2 key/value heads), biases, a tied head, gelu_pytorch_tanh, no window,
    # by default
    "starcoder2": [
        {**_RMS, "hidden_size": 96},
        # a window, no biases, heads of their own
        {
            **_RMS,
            "hidden_size": 64,
            "num_attention_heads": 4,
            "sliding_window": 8,
            "use_bias": False,
        },
    ],
    # 32 heads by default (MHA), rms_norm_eps 1e-5, an original context of 4096 (read by
    # LongRoPE only), no window
    "phi3": [
        {**_RMS, "hidden_size": 64, "num_attention_heads": 4},
        # LongRoPE by transformers 4.x's keys, no factor: the context ratio, 64 / 16
        {
            **_RMS,
            "hidden_size": 64,
            "num_attention_heads": 4,
            "max_position_embeddings": 64,
            "original_max_position_embeddings": 16,
            "rope_scaling": {
                "type": "longrope",
                "short_factor": [1.0] * 8,
                "long_factor": [float(i + 1) for i in range(8)],
            },
        },
    ],
    # 64 heads (MHA; of 8 here), a tied head, logit_scale 1/16, LayerNorm eps 1e-5 and a RoPE
    # base of 500000 (CohereConfig's default_theta), no biases, by default
    "cohere": [
        {**_RMS, "hidden_size": 512},
        # GQA, attention biases, an untied head, transformers 4.x's RoPE keys
        {
            **_RMS,
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "attention_bias": True,
            "tie_word_embeddings": False,
            "logit_scale": 0.5,
            "rope_theta": 8e6,
        },
    ],
    # 64 heads (MHA; of 8 here), parallel blocks, a quarter of each head rotated at base 10000,
    # attention biases, LayerNorm eps 1e-5, an untied head, by default
    "gpt_neox": [
        {"vocab_size": 100, "hidden_size": 512, "intermediate_size": 64, "num_hidden_layers": 2},
        # transformers 4.x's keys: sequential blocks, half of each head at base 500, no
        # attention biases
        {
            "vocab_size": 100,
            "hidden_size": 64,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "use_parallel_residual": False,
            "rotary_pct": 0.5,
            "rotary_emb_base": 500.0,
            "attention_bias": False,
        },
    ],
    # 32 heads and 32 key/value heads (of 4 here: the default 32 is no divisor of fewer
    # heads), pre-norm blocks, a quarter of each head rotated at base 10000, no q/k/v biases,
    # LayerNorm eps 1e-5, an untied head, by default
    "stablelm": [
        {"vocab_size": 100, "hidden_size": 512, "intermediate_size": 64, "num_hidden_layers": 2},
        # transformers 4.x's keys: parallel blocks, per-head QK LayerNorms, half of each head
        # at base 500, GQA, q/k/v biases, a tied head
        {
            "vocab_size": 100,
            "hidden_size": 64,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "use_parallel_residual": True,
            "qk_layernorm": True,
            "use_qkv_bias": True,
            "partial_rotary_factor": 0.5,
            "rope_theta": 500.0,
            "tie_word_embeddings": True,
        },
    ],
    # 32 heads (MHA; of 4 here), half of each head rotated at base 10000, an untied head
    "phi": [
        {"vocab_size": 100, "hidden_size": 128, "intermediate_size": 64, "num_hidden_layers": 2},
        # transformers 4.x's keys: a quarter of each head at base 500, GQA, a tied head
        {
            "vocab_size": 100,
            "hidden_size": 64,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "partial_rotary_factor": 0.25,
            "rope_theta": 500.0,
            "tie_word_embeddings": True,
        },
    ],
    # ffn_dim 3072 (not 4 hidden_size), a ReLU MLP, pre-norm, biases, a tied head, 2048
    # positions, dropout 0.1 (with a warning: OPT drops no embeddings), by default
    "opt": [
        {"vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4},
        # post-norm blocks, no biases
        {
            "vocab_size": 100,
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "do_layer_norm_before": False,
            "enable_bias": False,
        },
    ],
    # 16 heads of 256 (of 4 here: rotary_dim 64 at most), n_inner 4 d, an untied head
    "gptj": [
        {"vocab_size": 100, "n_embd": 64, "n_layer": 2, "n_head": 1},
        {"vocab_size": 100, "n_embd": 64, "n_layer": 2, "n_head": 4, "rotary_dim": 8},
    ],
    # multi-query, the tanh GELU, n_inner 4 n_embd, dropouts of 0.1, a tied head, by default
    "gpt_bigcode": [
        {"vocab_size": 100, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64},
        # one key/value head per query head, an MLP of its own width, an untied head
        {
            "vocab_size": 100,
            "n_embd": 48,
            "n_layer": 2,
            "n_head": 3,
            "n_positions": 64,
            "multi_query": False,
            "n_inner": 80,
            "tie_word_embeddings": False,
        },
    ],
    # 71 heads (of 2 here), the old architecture: one shared norm, multi-query attention,
    # no biases, an FFN of 4 hidden_size, RoPE base 10000, a tied head, by default
    # BloomConfig's n_layer and n_head (2 and 8) left to their defaults; its alias keys
    "bloom": [
        {"vocab_size": 100, "hidden_size": 64},
        {"vocab_size": 100, "hidden_size": 48, "num_hidden_layers": 3, "num_attention_heads": 6},
    ],
    # MptConfig's d_model, n_heads and n_layers (2048, 16, 24: of 4 here), attn_config left
    # to MptAttentionConfig; the aliases hidden_size, num_attention_heads, num_hidden_layers
    "mpt": [
        {"vocab_size": 100, "d_model": 64, "n_heads": 4, "n_layers": 2},
        {"vocab_size": 100, "hidden_size": 48, "num_attention_heads": 6, "num_hidden_layers": 3},
    ],
    # Falcon-RW: ALiBi instead of RoPE
    "falcon": [
        {"vocab_size": 100, "hidden_size": 142, "num_hidden_layers": 2},
        {"vocab_size": 100, "hidden_size": 142, "num_hidden_layers": 2, "alibi": True},
        # the new architecture: num_kv_heads defaults to the heads, two norms
        {
            "vocab_size": 100,
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 8,
            "new_decoder_architecture": True,
        },
        # sequential blocks, one key/value head per query head, transformers 4.x's rope_theta
        {
            "vocab_size": 100,
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "parallel_attn": False,
            "multi_query": False,
            "rope_theta": 500.0,
        },
    ],
    "deepseek_v2": [
        {**_MLA, "num_experts_per_tok": 2},
        {**_MLA, "num_experts_per_tok": 2, "q_lora_rank": None},
        # q_lora_rank defaults to 1536 (a compression of 128 heads' 2048-wide queries)
        {
            **{k: v for k, v in _MLA.items() if k != "q_lora_rank"},
            "hidden_size": 256,
            "num_attention_heads": 128,
            "num_experts_per_tok": 2,
        },
    ],
    "deepseek_v3": [_MLA, {**_MLA, "rope_interleave": False}],
    "deepseek_v32": [
        {**_MLA, "index_n_heads": 2, "index_head_dim": 16, "index_topk": 4},
        _MLA,  # the indexer's sizes too from the defaults
    ],
    # ALBERT: one group by default (every layer shares one block)
    "albert": [
        {
            "hidden_size": 32,
            "num_attention_heads": 4,
            "num_hidden_layers": 2,
            "vocab_size": 100,
            "intermediate_size": 48,
            "embedding_size": 16,
        },
    ],
    # Persimmon: a QK LayerNorm, squared ReLU and half of each head rotated by default
    "persimmon": [
        {
            "vocab_size": 100,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
        },
    ],
    # Nemotron: unit-offset LayerNorms, squared ReLU, half of each head rotated; GQA 4/2
    # (transformers leaves num_key_value_heads null, which its attention cannot run)
    "nemotron": [
        {
            "vocab_size": 100,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        },
    ],
    # ELECTRA: electra-small's sizes by default (embeddings 128 wide, mapped to 256); the
    # discriminator head without architectures (ElectraModel's), the generator's with them
    "electra": [
        {"vocab_size": 100, "num_hidden_layers": 2},
        {
            "vocab_size": 100,
            "hidden_size": 32,
            "embedding_size": 32,
            "num_hidden_layers": 2,
            "intermediate_size": 48,
            "hidden_act": "relu",
            "architectures": ["ElectraForMaskedLM"],
        },
    ],
    "distilbert": [
        {"dim": 32, "n_heads": 4, "n_layers": 2, "vocab_size": 100, "hidden_dim": 48},
        {
            "dim": 32,
            "n_heads": 4,
            "n_layers": 2,
            "vocab_size": 100,
            "hidden_dim": 48,
            "sinusoidal_pos_embds": True,
        },
    ],
    "bert": [
        {
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "intermediate_size": 128,
            "vocab_size": 100,
            "max_position_embeddings": 64,
        }
    ],
    # relative_attention and pos_att_type are needed: transformers' defaults (false, none)
    # are a DeBERTa without disentangled attention, which attnlab refuses by name
    "deberta-v2": [
        {
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "intermediate_size": 128,
            "vocab_size": 100,
            "relative_attention": True,
            "pos_att_type": ["p2c", "c2p"],
        }
    ],
    "roberta": [
        {
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "intermediate_size": 128,
            "vocab_size": 100,
            "max_position_embeddings": 66,
        }
    ],
    "xlm-roberta": [
        {
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "intermediate_size": 128,
            "vocab_size": 100,
        }
    ],
    # the default vocabulary: the default pad/decoder start token 58100 must be in it
    "modernbert": [
        {
            "hidden_size": 32,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "intermediate_size": 48,
            "vocab_size": 100,
            # ModernBertConfig's special tokens lie beyond a small vocabulary
            "pad_token_id": None,
        },
        # transformers 4.x's keys: the period of the global layers and the two RoPE bases
        {
            "hidden_size": 32,
            "num_hidden_layers": 5,
            "num_attention_heads": 2,
            "intermediate_size": 48,
            "vocab_size": 100,
            "pad_token_id": None,
            "global_attn_every_n_layers": 2,
            "global_rope_theta": 500.0,
            "local_rope_theta": 30.0,
            "local_attention": 16,
        },
    ],
    "marian": [
        {
            "d_model": 32,
            "encoder_layers": 2,
            "decoder_layers": 2,
            "encoder_attention_heads": 4,
            "decoder_attention_heads": 4,
            "encoder_ffn_dim": 64,
            "decoder_ffn_dim": 64,
            "max_position_embeddings": 64,
        }
    ],
    "bart": [_BART],
    "m2m_100": [_BART],
    "pegasus": [_BART, {**_BART, "decoder_layers": 3, "scale_embedding": True}],
    # no decoder start token in MBartConfig: generate's fallback, bos_token_id
    "mbart": [_BART, {**_BART, "decoder_layers": 3, "scale_embedding": True}],
    "t5": [
        {"d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_heads": 4},
        # v1.1: gated GELU, untied head (transformers 5 stores it as scale_decoder_outputs)
        {
            "d_model": 32,
            "d_kv": 8,
            "d_ff": 64,
            "num_layers": 2,
            "num_decoder_layers": 3,
            "num_heads": 4,
            "feed_forward_proj": "gated-gelu",
            "scale_decoder_outputs": False,
        },
    ],
    # T5 v1.1's defaults, a 250112-token vocabulary (kept), its own start token
    "mt5": [{"d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_heads": 4}],
    "umt5": [{"d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_heads": 4}],
    "vit": [
        {
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "intermediate_size": 64,
            "image_size": 32,
            "patch_size": 8,
        }
    ],
}


def _transformers():
    return pytest.importorskip("transformers")


def _class_defaults(model_type: str) -> dict:
    """The keyword defaults of transformers' config class for ``model_type``."""
    cls = _transformers().CONFIG_MAPPING[model_type]
    params = inspect.signature(cls.__init__).parameters
    return {k: p.default for k, p in params.items() if p.default is not inspect.Parameter.empty}


def test_every_model_type_has_a_defaults_table_and_a_minimal_config() -> None:
    assert set(MINIMAL) == set(SUPPORTED_MODEL_TYPES)
    for model_type, family in BY_MODEL_TYPE.items():
        assert family.defaults.get(model_type), model_type


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
def test_defaults_table_matches_the_installed_transformers(model_type: str) -> None:
    """Every entry of the table is transformers' class default (never None: such keys are
    left out, read as missing)."""
    table = BY_MODEL_TYPE[model_type].defaults[model_type]
    defaults = _class_defaults(model_type)
    unknown = sorted(set(table) - set(defaults))
    assert not unknown, f"{model_type}: not arguments of the config class: {unknown}"
    wrong = {k: (v, defaults[k]) for k, v in table.items() if defaults[k] != v}
    assert not wrong, f"{model_type}: table vs transformers {wrong}"
    assert all(v is not None for v in table.values())


@pytest.mark.parametrize(
    "model_type, minimal",
    [(t, m) for t, ms in MINIMAL.items() for m in ms],
    ids=[f"{t}-{i}" for t, ms in MINIMAL.items() for i in range(len(ms))],
)
def test_minimal_config_reads_as_transformers_fills_it(model_type: str, minimal: dict) -> None:
    transformers = _transformers()
    filled = transformers.AutoConfig.for_model(model_type, **minimal).to_dict()
    ours = config_from_hf({"model_type": model_type, **minimal})
    assert ours == config_from_hf(filled)


def test_defaults_are_the_class_defaults_not_attnlabs() -> None:
    """Keys where attnlab's own fallback differed from transformers' (no transformers
    needed): the values a minimal config.json now reads as."""
    v3 = config_from_hf({"model_type": "deepseek_v3", **_MLA})
    assert v3.ffn.routed_scaling_factor == 2.5
    assert v3.ffn.first_k_dense == 3
    assert (v3.ffn.n_groups, v3.ffn.topk_groups) == (8, 4)
    assert (v3.ffn.n_routed_experts, v3.ffn.n_shared_experts, v3.ffn.n_activated_experts) == (
        256,
        1,
        8,
    )
    mixtral = config_from_hf({"model_type": "mixtral", **MINIMAL["mixtral"][0]})
    assert mixtral.position.rope_theta == 1e6  # MixtralConfig's default_theta, not 10000
    assert (mixtral.norm.eps, mixtral.max_seq_len, mixtral.attention.sliding_window) == (
        1e-5,
        131072,
        None,
    )
    assert (mixtral.ffn.n_routed_experts, mixtral.ffn.n_activated_experts) == (8, 2)
    mistral = config_from_hf({"model_type": "mistral", **MINIMAL["mistral"][0]})
    assert mistral.attention.sliding_window == 4096
    assert mistral.attention.n_kv_heads == 8
    gpt2 = config_from_hf({"model_type": "gpt2", **MINIMAL["gpt2"][0]})
    assert (gpt2.dropout, gpt2.attention.dropout) == (0.1, 0.1)


def test_keys_without_a_default_stay_refused() -> None:
    """DeepSeek-V2's num_experts_per_tok defaults to None in transformers: a MoE config
    without it is refused by name; so is an explicit null of a required key."""
    with pytest.raises(HFCheckpointError, match="num_experts_per_tok"):
        config_from_hf({"model_type": "deepseek_v2", **_MLA})
    with pytest.raises(HFCheckpointError, match="hidden_size"):
        config_from_hf({"model_type": "llama", **_RMS, "hidden_size": None})
    with pytest.raises(HFCheckpointError, match="q_lora_rank"):
        config_from_hf({"model_type": "deepseek_v32", **_MLA, "q_lora_rank": None})


def test_generation_config_without_a_key_gives_generation_defaults(tmp_path) -> None:
    """Marian's forced_eos_token_id defaults to 0 in config.json, but a
    generation_config.json without it (which transformers then reads alone) forces none."""
    from attnlab.interop.io import with_generation_config

    hf = {"model_type": "marian", **MINIMAL["marian"][0]}
    assert config_from_hf(hf).forced_eos_ids == [0]
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_length": 8}))
    read = with_generation_config(tmp_path, hf)
    assert config_from_hf(read).forced_eos_ids == []
    assert config_from_hf(read).renormalize_logits is False


def test_marian_end_token_listed_once_is_read_and_several_are_refused() -> None:
    """generation_config.json may list Marian's end token ([0]): one is that token; several
    (one eos_id holds one) are refused by name, not a TypeError from the comparisons."""
    hf = {"model_type": "marian", **MINIMAL["marian"][0]}
    assert config_from_hf({**hf, "eos_token_id": [3]}).eos_id == 3
    with pytest.raises(HFCheckpointError, match="only one end-of-sequence token"):
        config_from_hf({**hf, "eos_token_id": [3, 4]})
