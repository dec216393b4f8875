"""The calculators in attnlab.analysis against models that are actually built, and against
torch's own FLOP counter."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from attnlab import analysis
from attnlab.analysis import (
    count_parameters,
    flops_per_token,
    kv_cache_bytes,
    kv_cache_bytes_per_token,
    weights_bytes,
)
from attnlab.models import build_model
from attnlab.nn.moe import Router
from attnlab.presets import get_preset, list_presets

# Tiny presets plus overrides that switch on every structural choice the formula handles:
# tied/untied head, biases on/off, MLP/GLU, each position kind, norms, GQA/MQA, head_dim.
VARIANTS = [
    ("gpt2-tiny", {}),
    ("llama-tiny", {}),
    ("vaswani-tiny", {}),
    ("gpt2-tiny", {"tie_embeddings": False, "position.kind": "rope"}),
    ("gpt2-tiny", {"attention.qkv_bias": False, "ffn.bias": False, "norm.bias": False}),
    ("gpt2-tiny", {"attention.out_bias": False, "position.kind": "none"}),
    ("llama-tiny", {"tie_embeddings": True, "attention.n_kv_heads": 1, "ffn.hidden_dim": 40}),
    ("llama-tiny", {"attention.qkv_bias": True, "ffn.kind": "mlp", "ffn.activation": "relu"}),
    ("llama-tiny", {"attention.head_dim": 8, "position.kind": "learned"}),
    ("llama-tiny", {"attention.qk_norm": True, "attention.head_dim": 12}),  # 2 d_h per layer
    ("vaswani-tiny", {"ffn.kind": "glu", "ffn.multiple_of": 24, "norm.kind": "rmsnorm"}),
    # (measured on the model: sink logits, router and expert biases)
    ("gpt-oss-tiny", {}),
    ("gpt-oss-tiny", {"ffn.router_bias": False, "attention.qkv_bias": False}),
    # a bias on the head (Phi's, GPT-J's): its own, with the weight tied or not
    ("gpt2-tiny", {"final_logits_bias": True}),
    ("pythia-tiny", {"final_logits_bias": True, "norm.placement": "parallel_shared"}),
]
IDS = [f"{name}{'+' + ','.join(o) if o else ''}" for name, o in VARIANTS]


def _cfg(name: str, overrides: dict):
    return get_preset(name).override(overrides)


@pytest.mark.parametrize("name,overrides", VARIANTS, ids=IDS)
def test_parameter_count_matches_built_model(name, overrides):
    cfg = _cfg(name, overrides)
    model = build_model(cfg)
    counts = count_parameters(cfg)
    assert counts["total"] == model.num_parameters()
    assert counts["non_embedding"] == model.num_parameters(exclude_embeddings=True)
    assert counts["embedding"] + counts["non_embedding"] == counts["total"]
    head = 0 if cfg.tie_embeddings else model.lm_head.weight.numel()
    bias = model.lm_head.bias
    assert counts["lm_head"] == head + (0 if bias is None else bias.numel())
    # routers stay float32 in a bf16 model (nn.moe.KeepsPrecision): 4 bytes, not 2
    routers = [m for m in model.modules() if isinstance(m, Router)]
    kept = sum(p.numel() for m in routers for p in m.parameters())
    assert weights_bytes(cfg, torch.bfloat16) == 2 * counts["total"] + 2 * kept


# Published totals (the model cards / original papers' released checkpoints).
PUBLISHED = {
    "gpt2": 124_439_808,
    "llama-2-7b": 6_738_415_616,
    "llama-3-8b": 8_030_261_248,
    "mistral-7b": 7_241_732_096,
    "qwen2-0.5b": 494_032_768,
    "qwen3-0.6b": 596_049_920,  # 0.44B without the embedding, as the model card says
    "qwen3-8b": 8_190_735_360,  # 6.95B without the embedding and head
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_parameter_count_of_published_sizes(name):
    # Built on the meta device: real shapes, no memory. Both the formula and the built
    # model must give the published total.
    cfg = get_preset(name)
    with torch.device("meta"):
        model = build_model(cfg)
    assert model.num_parameters() == PUBLISHED[name]
    assert count_parameters(cfg)["total"] == PUBLISHED[name]


@pytest.mark.parametrize("name,overrides", VARIANTS[:3] + VARIANTS[6:9], ids=IDS[:3] + IDS[6:9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_cache_bytes_match_allocated_cache(name, overrides, dtype):
    cfg = _cfg(name, overrides)
    model = build_model(cfg)
    for batch, seq_len in [(1, 1), (3, 17)]:
        cache = model.new_cache(batch, seq_len, dtype)
        assert kv_cache_bytes(cfg, seq_len, batch, dtype) == cache.nbytes
    per_token = model.new_cache(1, 1, dtype).nbytes
    assert kv_cache_bytes_per_token(cfg, dtype) == per_token


def _counted_flops(model, idx, *, backward: bool) -> int:
    with FlopCounterMode(display=False) as counter:
        out = model(idx, targets=idx if backward else None)
        if backward:
            out.loss.backward()
    return counter.get_total_flops()


@pytest.mark.parametrize(
    "name,overrides",
    VARIANTS[:3] + VARIANTS[6:8] + VARIANTS[-2:],
    ids=IDS[:3] + IDS[6:8] + IDS[-2:],
)
def test_flops_match_torch_flop_counter(name, overrides):
    # The eager backend forms Q K^T and weights V with explicit matmuls, which the counter
    # sees (torch's CPU sdpa kernel is not registered with it). The counter, like our
    # convention, counts matmuls only (2 per multiply-add), so the match is exact: every
    # Linear runs on all b*T tokens, attention scores are the full T x T, and backward is
    # two matmuls per forward matmul (input and weight gradients).
    cfg = _cfg(name, {**overrides, "attention.backend": "eager"})
    model = build_model(cfg)
    batch, seq_len = 2, 23
    idx = torch.randint(0, cfg.vocab_size, (batch, seq_len))
    expected = flops_per_token(cfg, seq_len)
    assert expected["forward"] == expected["dense"] + expected["attention"]
    with torch.no_grad():
        forward = _counted_flops(model.eval(), idx, backward=False)
    assert forward == batch * seq_len * expected["forward"]
    training = _counted_flops(model.train(), idx, backward=True)
    assert training == batch * seq_len * expected["training"]


def test_flops_attention_term_grows_with_context():
    cfg = get_preset("llama-tiny")
    short, long = flops_per_token(cfg, 16), flops_per_token(cfg, 32)
    assert long["dense"] == short["dense"]
    assert long["attention"] == 2 * short["attention"]
    assert flops_per_token(cfg)["attention"] == flops_per_token(cfg, cfg.max_seq_len)["attention"]
    with pytest.raises(ValueError, match="seq_len"):
        flops_per_token(cfg, 0)


@pytest.mark.parametrize(
    "name,overrides", [VARIANTS[1], VARIANTS[3], *VARIANTS[-2:]], ids=[IDS[1], IDS[3], *IDS[-2:]]
)
def test_measured_fallback_agrees_with_formulas(name, overrides, monkeypatch):
    # Attention kinds without a formula are measured on a meta-device model; both paths
    # must agree where both apply.
    cfg = _cfg(name, overrides)
    expected = (
        count_parameters(cfg),
        analysis.matmul_parameters(cfg),
        kv_cache_bytes(cfg, 9, 2, torch.float16),
        kv_cache_bytes_per_token(cfg),
    )
    monkeypatch.setattr(analysis, "_FORMULA_KINDS", ())
    monkeypatch.setattr(analysis, "_KV_FORMULA_KINDS", ())
    measured = (
        count_parameters(cfg),
        analysis.matmul_parameters(cfg),
        kv_cache_bytes(cfg, 9, 2, torch.float16),
        kv_cache_bytes_per_token(cfg),
    )
    assert measured == expected


# --------------------------------------------------------------------------- KV-cache tables

# Decoders with a decoding cache (Transformer-XL keeps segment memory instead).
TINY_PRESETS = [
    n
    for n in list_presets()
    if ("tiny" in n or n in ("demo", "nanogpt-cpu")) and get_preset(n).arch == "decoder"
]


@pytest.mark.parametrize("name", TINY_PRESETS)
def test_kv_formula_equals_allocated_cache_for_every_tiny_preset(name):
    cfg = get_preset(name)
    model = build_model(cfg)
    for dtype in (torch.float32, torch.bfloat16):
        assert kv_cache_bytes(cfg, 13, 2, dtype) == model.new_cache(2, 13, dtype).nbytes
        assert kv_cache_bytes_per_token(cfg, dtype) == model.new_cache(1, 1, dtype).nbytes


def test_kv_bytes_per_token_by_kind():
    mla = get_preset("deepseek-moe-tiny")  # 2 layers, d_c 32, d_r 8
    assert kv_cache_bytes_per_token(mla, torch.bfloat16) == 2 * (32 + 8) * 2
    gqa = get_preset("llama-tiny")  # 2 layers, 2 KV heads of 16
    assert kv_cache_bytes_per_token(gqa, torch.float8_e4m3fn) == 2 * 2 * 2 * 16
    # A sliding window bounds the cache: the rolling cache of `window` slots holds it.
    windowed = gqa.override({"attention.sliding_window": 8})
    rolling = build_model(windowed).new_cache(3, 8, rolling=True)
    assert kv_cache_bytes(windowed, 100, 3) == rolling.nbytes == kv_cache_bytes(gqa, 8, 3)
    assert kv_cache_bytes(windowed, 5, 3) == kv_cache_bytes(gqa, 5, 3)


def test_moe_matmul_parameters_count_only_active_experts():
    cfg = get_preset("deepseek-moe-tiny")
    model = build_model(cfg)
    moe = model.blocks[1].ffn
    all_experts = moe.experts.gate_up.numel() + moe.experts.down.numel()
    active = all_experts // moe.n_experts * moe.top_k
    every = {"ffn.n_activated_experts": 8, "ffn.topk_groups": 2}
    dense = analysis.matmul_parameters(cfg.override(every))
    assert analysis.matmul_parameters(cfg) == dense - all_experts + active


@pytest.mark.parametrize(
    "name, total",
    [
        # config.json of each checkpoint; the totals their model cards and safetensors
        # index report (DeepSeek-V3 without its 14B multi-token-prediction module).
        ("deepseek-v3", 671_026_404_352),
        ("deepseek-v2-lite", 15_706_484_224),
        ("llama-2-70b", 68_976_648_192),
        ("qwen2-7b", 7_615_616_512),
        # the model cards' 46.7B (93,405,585,408 bytes of bf16 in the safetensors index)
        # and 141B (here with the Instruct model's 32768-token vocabulary)
        ("mixtral-8x7b", 46_702_792_704),
        ("mixtral-8x22b", 140_630_071_296),
        # Qwen/Qwen1.5-MoE-A2.7B: the model card's 14.3B (transformers' count of its
        # config.json)
        ("qwen1.5-moe-a2.7b", 14_315_784_192),
        # google/gemma-3-1b-pt: 1B (tied head; transformers' count of its config.json)
        ("gemma-3-1b", 999_885_952),
        # google/gemma-2b, -7b, gemma-2-2b, -9b, -27b (transformers' counts of their
        # config.json files: the model cards' 2B, 7B (8.5B with the embedding), 2B, 9B, 27B)
        ("gemma-2b", 2_506_172_416),
        ("gemma-7b", 8_537_680_896),
        ("gemma-2-2b", 2_614_341_888),
        ("gemma-2-9b", 9_241_705_984),
        ("gemma-2-27b", 27_227_128_320),
        # EleutherAI/pythia-*: the Pythia paper's (Biderman et al. 2023, Table 1) totals
        ("pythia-70m", 70_426_624),
        ("pythia-160m", 162_322_944),
        ("pythia-410m", 405_334_016),
        ("pythia-1b", 1_011_781_632),
        ("pythia-1.4b", 1_414_647_808),
        ("pythia-2.8b", 2_775_208_960),
        ("pythia-6.9b", 6_857_302_016),
        ("pythia-12b", 11_846_072_320),
        # microsoft/phi-1, phi-1_5 (Phi-1's architecture) and phi-2: transformers' counts of
        # their config.json (the papers' 1.3B and the model card's 2.7B round other counts)
        ("phi-1", 1_418_270_720),
        ("phi-1.5", 1_418_270_720),
        ("phi-2", 2_779_683_840),
        # EleutherAI/gpt-j-6b: transformers' count of its config.json (the original release
        # reports 6,053,381,344, 2,498,560 more)
        ("gpt-j-6b", 6_050_882_784),
        # bigscience/bloom-*: the model cards' totals (recalled), the 176B model's
        # 176,247,271,424 included; tiiuae/falcon-rw-1b: transformers' count of its config.json
        ("bloom-560m", 559_214_592),
        ("bloom-1b1", 1_065_314_304),
        ("bloom-1b7", 1_722_408_960),
        ("bloom-3b", 3_002_557_440),
        ("bloom-7b1", 7_069_016_064),
        ("bloom", 176_247_271_424),
        ("falcon-rw-1b", 1_311_625_216),
        # mosaicml/mpt-7b and mpt-30b: transformers' counts of their config.json (recalled;
        # MosaicML's "6.7B" and "30B")
        ("mpt-7b", 6_649_286_656),
        ("mpt-30b", 29_957_200_896),
    ],
)
def test_published_parameter_totals(name, total):
    assert count_parameters(get_preset(name))["total"] == total


@pytest.mark.parametrize("name, active", [("mixtral-8x7b", 12.9), ("mixtral-8x22b", 39)])
def test_mixtral_active_parameters_are_the_model_cards(name, active):
    """The model cards' active parameters per token (12.9B, 39B): the products a token
    goes through (its 2 experts of 8) plus the embedding row and the norms."""
    cfg = get_preset(name)
    d = cfg.d_model
    active_count = analysis.matmul_parameters(cfg) + cfg.vocab_size * d + (2 * cfg.n_layers + 1) * d
    assert round(active_count / 1e9, 1 if active < 20 else 0) == active


@pytest.mark.parametrize(
    "name, billions, active",
    # the model cards: 21B parameters (3.6B active), 117B (5.1B active); active: the
    # parameters a token passes through but the embedding (its 4 experts, not the others)
    [("gpt-oss-20b", 21, 3.6), ("gpt-oss-120b", 117, 5.1)],
)
def test_gpt_oss_totals_are_the_model_cards(name, billions, active):
    cfg = get_preset(name)
    counts = count_parameters(cfg)
    assert round(counts["total"] / 1e9) == billions
    f, E, k = cfg.ffn.moe_hidden_dim, cfg.ffn.n_routed_experts, cfg.ffn.n_activated_experts
    expert = 3 * cfg.d_model * f + 2 * f + cfg.d_model  # gate, up, down and their biases
    idle = cfg.n_layers * (E - k) * expert
    assert round((counts["total"] - idle - counts["embedding"]) / 1e9, 1) == active


@pytest.mark.parametrize("name", list_presets())
def test_parameter_count_of_every_preset_equals_its_built_model(name):
    """Every architecture (encoders, encoder-decoders, ViT, Transformer-XL, the GRU model):
    the total is the built model's (tied weights once), the parts add up."""
    cfg = get_preset(name)
    with torch.device("meta"):
        model = build_model(cfg)
    counts = count_parameters(cfg)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    assert counts["embedding"] + counts["non_embedding"] == counts["total"]


def test_sink_logits_are_counted():
    cfg = _cfg("llama-tiny", {"attention.sink_logits": True})
    built = sum(p.numel() for p in build_model(cfg).parameters())
    assert count_parameters(cfg)["total"] == built
    assert built == count_parameters(get_preset("llama-tiny"))["total"] + 2 * 4  # L x h


def test_vit_position_table_counts_as_embedding():
    """ViT keeps its learned positions as a plain parameter, not an nn.Embedding: `info`
    counted 0 embedding parameters."""
    cfg = get_preset("vit-digits")
    counts = count_parameters(cfg)
    assert counts["embedding"] == (cfg.n_patches + 1) * cfg.d_model


def test_flops_and_kv_are_refused_for_models_that_are_not_decoders():
    for name in ("bert-tiny-mlm", "transformer-numbers", "vit-digits", "xl-tiny"):
        cfg = get_preset(name)
        for fn in (flops_per_token, kv_cache_bytes_per_token):
            with pytest.raises(ValueError, match=f"decoder-only.*{cfg.arch}"):
                fn(cfg)


@torch.no_grad()
def test_dsa_flops_count_the_lightning_indexer():
    """DeepSeek sparse attention (eager backend: every product visible to the counter):
    the MLA formula plus the indexer's n_I dot products and their weighting per key."""
    cfg = _cfg("deepseek-v32-tiny", {"attention.backend": "eager"})
    model = build_model(cfg).eval()
    batch, seq_len = 2, 23
    idx = torch.randint(0, cfg.vocab_size, (batch, seq_len))
    counted = _counted_flops(model, idx, backward=False)
    assert counted == batch * seq_len * flops_per_token(cfg, seq_len)["forward"]


def test_linear_attention_flops_and_cache_do_not_grow_with_the_context():
    cfg = _cfg("llama-tiny", {"attention.kind": "linear"})
    short, long = flops_per_token(cfg, 16), flops_per_token(cfg, 4096)
    assert short == long and short["attention"] == 2 * 2 * (2 + 4) * 16 * 16  # 2 L (h_kv + h) d_h^2
    assert kv_cache_bytes_per_token(cfg) == 0  # a fixed-size state
    assert kv_cache_bytes(cfg, 16) == kv_cache_bytes(cfg, 4096) > 0


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_linear_attention_flops_count_one_state_per_key_value_head(n_kv_heads):
    """GQA/MQA linear attention keeps one d_h x d_h state per key/value head: each token
    updates h_kv states and h query heads read them. Against a hand-written recurrent step
    (Katharopoulos et al. eq. 5-9, the normaliser's vectors aside) under torch's counter."""
    cfg = _cfg("llama-tiny", {"attention.kind": "linear", "attention.n_kv_heads": n_kv_heads})
    h, d_h = cfg.n_heads, cfg.head_dim
    S = torch.zeros(n_kv_heads, d_h, d_h)
    k, v = torch.randn(n_kv_heads, d_h, 1), torch.randn(n_kv_heads, 1, d_h)
    q = torch.randn(h, 1, d_h)
    with FlopCounterMode(display=False) as counter:
        S = S + k @ v  # S += phi(k)^T v, per key/value head
        q @ S.repeat_interleave(h // n_kv_heads, dim=0)  # y = phi(q) S, per query head
    assert flops_per_token(cfg, 16)["attention"] == cfg.n_layers * counter.get_total_flops()


def test_kv_bytes_refuse_global_tokens_no_cache_can_hold():
    cfg = _cfg("llama-tiny", {"attention.sliding_window": 16, "attention.global_tokens": [20]})
    with pytest.raises(ValueError, match="global_tokens: position 20 >= sliding_window=16"):
        kv_cache_bytes(cfg, 128)


@pytest.mark.parametrize("name", ["llama-tiny", "gpt2-tiny", "deepseek-moe-tiny", "bert-tiny-mlm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_weights_bytes_equal_the_built_model_cast_to_the_dtype(name, dtype):
    """A half-precision model keeps its MoE routers in float32: they count 4 bytes each."""
    cfg = get_preset(name)
    model = build_model(cfg).to(dtype)
    params = {id(p): p for p in model.parameters()}  # tied weights once
    assert weights_bytes(cfg, dtype) == sum(p.numel() * p.element_size() for p in params.values())


# config.json of each published checkpoint on the Hugging Face hub (the architecture keys):
# the reference the published presets are checked against.
_LLAMA = dict(rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
_DEEPSEEK_YARN = dict(type="yarn", factor=40, original_max_position_embeddings=4096,
                      beta_fast=32, beta_slow=1)  # fmt: skip
_DEEPSEEK_V3 = dict(
    model_type="deepseek_v3", hidden_size=7168, intermediate_size=18432,
    moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
    num_key_value_heads=128, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
    n_group=8, topk_group=4, first_k_dense_replace=3, moe_layer_freq=1, kv_lora_rank=512,
    q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    vocab_size=129280, max_position_embeddings=163840, rms_norm_eps=1e-6, rope_theta=10000.0,
    rope_scaling=dict(_DEEPSEEK_YARN, mscale=1.0, mscale_all_dim=1.0),
    routed_scaling_factor=2.5, norm_topk_prob=True, tie_word_embeddings=False,
)  # fmt: skip
_MIXTRAL = dict(num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                rms_norm_eps=1e-5, rope_theta=1e6, sliding_window=None,
                tie_word_embeddings=False, output_router_logits=False)  # fmt: skip
# openai/gpt-oss-20b's config.json (transformers 4.55's keys, OpenAI's own extras
# experts_per_token and initial_context_length included), without its quantization_config:
# the MXFP4 experts of the published folder, which import-hf refuses (dequantise first)
_GPT_OSS_LAYERS = ["sliding_attention", "full_attention"]
_GPT_OSS = dict(
    model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, head_dim=64,
    num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, num_local_experts=32,
    num_experts_per_tok=4, experts_per_token=4, vocab_size=201088,
    max_position_embeddings=131072, initial_context_length=4096, rms_norm_eps=1e-5,
    rope_theta=150000, rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0,
                                         beta_slow=1.0, truncate=False,
                                         original_max_position_embeddings=4096),
    sliding_window=128, layer_types=_GPT_OSS_LAYERS * 12, swiglu_limit=7.0,
    attention_bias=True, attention_dropout=0.0, tie_word_embeddings=False,
    router_aux_loss_coef=0.9, output_router_logits=False, hidden_act="silu",
    initializer_range=0.02, eos_token_id=200002, pad_token_id=199999,
)  # fmt: skip
# google/gemma-3-1b-pt's config.json, and the text_config of google/gemma-3-4b-pt, -12b-pt
# and -27b-pt (Gemma3ForConditionalGeneration: the language model without the vision tower)
_GEMMA3_1B = dict(
    model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], attention_bias=False,
    attention_dropout=0.0, attn_logit_softcapping=None, final_logit_softcapping=None,
    head_dim=256, hidden_activation="gelu_pytorch_tanh", hidden_size=1152,
    initializer_range=0.02, intermediate_size=6912, max_position_embeddings=32768,
    num_attention_heads=4, num_hidden_layers=26, num_key_value_heads=1,
    query_pre_attn_scalar=256, rms_norm_eps=1e-6, rope_local_base_freq=10000,
    rope_scaling=None, rope_theta=1000000, sliding_window=512, sliding_window_pattern=6,
    vocab_size=262144, bos_token_id=2, eos_token_id=1, pad_token_id=0,
)  # fmt: skip
_GEMMA3_LINEAR = {"factor": 8.0, "rope_type": "linear"}
# google/gemma-2b and -7b's config.json ("gelu": transformers reads it as the tanh
# approximation), and google/gemma-2-2b, -9b and -27b's
_GEMMA = dict(
    model_type="gemma", architectures=["GemmaForCausalLM"], attention_bias=False,
    attention_dropout=0.0, head_dim=256, hidden_act="gelu", initializer_range=0.02,
    max_position_embeddings=8192, rms_norm_eps=1e-6, rope_scaling=None, rope_theta=10000.0,
    vocab_size=256000, bos_token_id=2, eos_token_id=1, pad_token_id=0,
)  # fmt: skip
_GEMMA2 = dict(
    model_type="gemma2", architectures=["Gemma2ForCausalLM"], attention_bias=False,
    attention_dropout=0.0, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
    head_dim=256, hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh",
    initializer_range=0.02, max_position_embeddings=8192, query_pre_attn_scalar=256,
    rms_norm_eps=1e-6, rope_theta=10000.0, sliding_window=4096, vocab_size=256000,
    bos_token_id=2, eos_token_id=1, pad_token_id=0,
)  # fmt: skip
# allenai/OLMo-2-0425-1B, OLMo-2-1124-7B and OLMo-2-1124-13B's config.json (their special
# tokens and sizes below)
_OLMO2 = dict(
    model_type="olmo2", architectures=["Olmo2ForCausalLM"], attention_bias=False,
    attention_dropout=0.0, hidden_act="silu", initializer_range=0.02,
    max_position_embeddings=4096, rms_norm_eps=1e-6, rope_scaling=None, rope_theta=500000,
    tie_word_embeddings=False, vocab_size=100352, eos_token_id=100257, pad_token_id=100277,
)  # fmt: skip
_STARCODER2 = dict(
    model_type="starcoder2", architectures=["Starcoder2ForCausalLM"], vocab_size=49152,
    max_position_embeddings=16384, sliding_window=4096, norm_epsilon=1e-5, use_bias=True,
    hidden_act="gelu_pytorch_tanh", bos_token_id=0, eos_token_id=0,
)  # fmt: skip
# answerdotai/ModernBERT-base and -large's config.json (transformers 4.x keys)
# FacebookAI/roberta-{base,large} and xlm-roberta-{base,large} config.json (recalled)
_ROBERTA = dict(
    model_type="roberta",
    architectures=["RobertaForMaskedLM"],
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=12,
    vocab_size=50265,
    max_position_embeddings=514,
    type_vocab_size=1,
    layer_norm_eps=1e-5,
    pad_token_id=1,
    bos_token_id=0,
    eos_token_id=2,
    hidden_act="gelu",
    hidden_dropout_prob=0.1,
    attention_probs_dropout_prob=0.1,
    initializer_range=0.02,
)
_LARGE = dict(
    hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16
)
_XLMR = dict(model_type="xlm-roberta", architectures=["XLMRobertaForMaskedLM"], vocab_size=250002)
# albert/albert-*-v2 (recalled: embedding_size 128, one group, no dropout, gelu_new)
_ALBERT = dict(model_type="albert", architectures=["AlbertForMaskedLM"], vocab_size=30000,
               embedding_size=128, num_hidden_groups=1, inner_group_num=1, hidden_act="gelu_new",
               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
               max_position_embeddings=512, type_vocab_size=2, layer_norm_eps=1e-12,
               pad_token_id=0)  # fmt: skip
# distilbert/distilbert-base-uncased (recalled)
_DISTILBERT = dict(model_type="distilbert", architectures=["DistilBertForMaskedLM"],
                   vocab_size=30522, dim=768, n_layers=6, n_heads=12, hidden_dim=3072,
                   max_position_embeddings=512, sinusoidal_pos_embds=False, activation="gelu",
                   dropout=0.1, attention_dropout=0.1, qa_dropout=0.1, seq_classif_dropout=0.2,
                   pad_token_id=0)  # fmt: skip
_MODERNBERT = dict(
    model_type="modernbert", architectures=["ModernBertForMaskedLM"], attention_bias=False,
    attention_dropout=0.0, bos_token_id=50281, classifier_activation="gelu",
    classifier_bias=False, classifier_dropout=0.0, classifier_pooling="mean",
    cls_token_id=50281, decoder_bias=True, deterministic_flash_attn=False,
    embedding_dropout=0.0, eos_token_id=50282, global_attn_every_n_layers=3,
    global_rope_theta=160000.0, hidden_activation="gelu", initializer_cutoff_factor=2.0,
    initializer_range=0.02, local_attention=128, local_rope_theta=10000.0,
    max_position_embeddings=8192, mlp_bias=False, mlp_dropout=0.0, norm_bias=False,
    norm_eps=1e-5, pad_token_id=50283, sep_token_id=50282, tie_word_embeddings=True,
    vocab_size=50368,
)  # fmt: skip
# EleutherAI/pythia-70m ... -12b config.json (transformers 4.x keys; recalled, and their
# transformers parameter counts are the Pythia paper's totals, 70,426,624 to 11,846,072,320)
_PYTHIA = dict(
    model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"], hidden_act="gelu",
    max_position_embeddings=2048, rotary_pct=0.25, rotary_emb_base=10000,
    use_parallel_residual=True, layer_norm_eps=1e-5, initializer_range=0.02,
    tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
)  # fmt: skip
# microsoft/phi-1, phi-1_5 and phi-2 config.json (transformers 4.x keys; recalled; their
# dropouts, training settings, left out)
_PHI = dict(
    model_type="phi", architectures=["PhiForCausalLM"], hidden_act="gelu_new",
    max_position_embeddings=2048, layer_norm_eps=1e-5, initializer_range=0.02,
    rope_theta=10000.0, rope_scaling=None, qk_layernorm=False, tie_word_embeddings=False,
    vocab_size=51200, hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
    num_attention_heads=32, num_key_value_heads=None, partial_rotary_factor=0.5,
)  # fmt: skip
# tiiuae/falcon-7b and falcon-40b config.json (recalled: transformers' FalconConfig keys;
# no tie_word_embeddings entry, so the head is tied, as transformers reads them)
_FALCON = dict(
    model_type="falcon", architectures=["FalconForCausalLM"], vocab_size=65024, alibi=False,
    bias=False, parallel_attn=True, hidden_dropout=0.0, attention_dropout=0.0,
    layer_norm_epsilon=1e-5, initializer_range=0.02, bos_token_id=11, eos_token_id=11,
)  # fmt: skip
# stabilityai/stablelm-3b-4e1t, stablelm-2-1_6b and stablelm-2-12b config.json (recalled;
# transformers 4.x keys; their dropouts, special tokens, training settings left out)
_STABLELM = dict(
    model_type="stablelm", architectures=["StableLmForCausalLM"], hidden_act="silu",
    max_position_embeddings=4096, layer_norm_eps=1e-5, initializer_range=0.02,
    rope_theta=10000.0, rope_scaling=None, partial_rotary_factor=0.25,
    tie_word_embeddings=False, use_qkv_bias=False, qk_layernorm=False,
    use_parallel_residual=False, hidden_size=2560, intermediate_size=6912,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, vocab_size=50304,
)  # fmt: skip
# adept/persimmon-8b-base config.json (recalled; transformers 4.x keys)
_PERSIMMON_8B = dict(
    model_type="persimmon", architectures=["PersimmonForCausalLM"], hidden_act="relu2",
    hidden_size=4096, intermediate_size=16384, num_hidden_layers=36, num_attention_heads=64,
    vocab_size=262144, max_position_embeddings=16384, layer_norm_eps=1e-5, qk_layernorm=True,
    rope_theta=25000.0, partial_rotary_factor=0.5, tie_word_embeddings=False,
    initializer_range=0.02,
)  # fmt: skip
# nvidia/Minitron-4B-Base and Minitron-8B-Base config.json (recalled; transformers 4.x keys)
_MINITRON = dict(
    model_type="nemotron", architectures=["NemotronForCausalLM"], hidden_act="relu2",
    hidden_size=3072, intermediate_size=9216, num_hidden_layers=32, num_attention_heads=24,
    num_key_value_heads=8, head_dim=128, vocab_size=256000, max_position_embeddings=4096,
    norm_eps=1e-5, rope_theta=10000.0, partial_rotary_factor=0.5, tie_word_embeddings=False,
    attention_bias=False, mlp_bias=False, initializer_range=0.0134,
)  # fmt: skip
# tiiuae/falcon-rw-1b config.json (recalled: sequential blocks, ALiBi, biases everywhere)
_FALCON_RW_1B = dict(
    _FALCON, vocab_size=50304, hidden_size=2048, num_hidden_layers=24, num_attention_heads=32,
    alibi=True, bias=True, multi_query=False, parallel_attn=False,
    new_decoder_architecture=False, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
# mosaicml/mpt-7b and mpt-30b config.json (recalled; MosaicML's training keys that neither
# library reads (attn_impl, init_config, ...) left out)
_MPT = dict(
    model_type="mpt", architectures=["MptForCausalLM"], vocab_size=50432, d_model=4096,
    n_heads=32, n_layers=32, expansion_ratio=4, max_seq_len=2048, no_bias=True,
    learned_pos_emb=True, resid_pdrop=0, emb_pdrop=0, embedding_fraction=1.0, logit_scale=None,
    norm_type="low_precision_layernorm", init_device="cpu", use_cache=False,
    attn_config=dict(alibi=True, alibi_bias_max=8, attn_impl="torch", attn_pdrop=0,
                     attn_type="multihead_attention", attn_uses_sequence_id=False,
                     clip_qkv=None, prefix_lm=False, qk_ln=False, softmax_scale=None),
)  # fmt: skip
# bigscience/bloom-560m ... bloom config.json (recalled; their Megatron training keys, read
# by neither library, left out)
_BLOOM = dict(
    model_type="bloom", architectures=["BloomForCausalLM"], vocab_size=250880,
    layer_norm_epsilon=1e-5, initializer_range=0.02, apply_residual_connection_post_layernorm=False,
    hidden_dropout=0.0, attention_dropout=0.0, pretraining_tp=1, slow_but_exact=False,
    bos_token_id=1, eos_token_id=2, pad_token_id=3,
)  # fmt: skip
_PYTHIA_SIZES = [("70m", 512, 6, 8, 50304), ("160m", 768, 12, 12, 50304),
                 ("410m", 1024, 24, 16, 50304), ("1b", 2048, 16, 8, 50304),
                 ("1.4b", 2048, 24, 16, 50304), ("2.8b", 2560, 32, 32, 50304),
                 ("6.9b", 4096, 32, 32, 50432), ("12b", 5120, 36, 40, 50688)]  # fmt: skip
CONFIG_JSON = {
    "gemma-2b": dict(_GEMMA, hidden_size=2048, intermediate_size=16384, num_hidden_layers=18,
                     num_attention_heads=8, num_key_value_heads=1),
    "gemma-7b": dict(_GEMMA, hidden_size=3072, intermediate_size=24576, num_hidden_layers=28,
                     num_attention_heads=16, num_key_value_heads=16),
    "gemma-2-2b": dict(_GEMMA2, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                       num_attention_heads=8, num_key_value_heads=4),
    "gemma-2-9b": dict(_GEMMA2, hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
                       num_attention_heads=16, num_key_value_heads=8),
    "gemma-2-27b": dict(_GEMMA2, head_dim=128, hidden_size=4608, intermediate_size=36864,
                        num_hidden_layers=46, num_attention_heads=32, num_key_value_heads=16,
                        query_pre_attn_scalar=144),
    "gemma-3-1b": _GEMMA3_1B,
    "gemma-3-4b": dict(model_type="gemma3_text", hidden_size=2560, intermediate_size=10240,
                       num_hidden_layers=34, rope_scaling=_GEMMA3_LINEAR, sliding_window=1024),
    "gemma-3-12b": dict(model_type="gemma3_text", hidden_size=3840, intermediate_size=15360,
                        num_attention_heads=16, num_hidden_layers=48, num_key_value_heads=8,
                        rope_scaling=_GEMMA3_LINEAR, sliding_window=1024),
    "gemma-3-27b": dict(model_type="gemma3_text", head_dim=128, hidden_size=5376,
                        intermediate_size=21504, num_attention_heads=32, num_hidden_layers=62,
                        num_key_value_heads=16, query_pre_attn_scalar=168,
                        rope_scaling=_GEMMA3_LINEAR, sliding_window=1024),
    "gpt2": dict(model_type="gpt2", n_embd=768, n_layer=12, n_head=12, n_positions=1024,
                 vocab_size=50257, layer_norm_epsilon=1e-5, activation_function="gelu_new"),
    "gpt2-medium": dict(model_type="gpt2", n_embd=1024, n_layer=24, n_head=16, n_positions=1024,
                        vocab_size=50257, layer_norm_epsilon=1e-5, activation_function="gelu_new"),
    "gpt2-large": dict(model_type="gpt2", n_embd=1280, n_layer=36, n_head=20, n_positions=1024,
                       vocab_size=50257, layer_norm_epsilon=1e-5, activation_function="gelu_new"),
    "gpt2-xl": dict(model_type="gpt2", n_embd=1600, n_layer=48, n_head=25, n_positions=1024,
                    vocab_size=50257, layer_norm_epsilon=1e-5, activation_function="gelu_new"),
    "llama-2-7b": dict(_LLAMA, model_type="llama", hidden_size=4096, intermediate_size=11008,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                       vocab_size=32000, max_position_embeddings=4096),
    "llama-2-70b": dict(_LLAMA, model_type="llama", hidden_size=8192, intermediate_size=28672,
                        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                        vocab_size=32000, max_position_embeddings=4096),
    "llama-3-8b": dict(_LLAMA, model_type="llama", hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0),
    "mistral-7b": dict(_LLAMA, model_type="mistral", hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       vocab_size=32000, max_position_embeddings=32768, rope_theta=1e6,
                       sliding_window=None),  # v0.2
    "qwen2-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864,
                       num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                       vocab_size=151936, max_position_embeddings=131072, rms_norm_eps=1e-6,
                       rope_theta=1e6, tie_word_embeddings=True, use_sliding_window=False,
                       sliding_window=131072, max_window_layers=24),
    "qwen2-7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944,
                     num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                     vocab_size=152064, max_position_embeddings=131072, rms_norm_eps=1e-6,
                     rope_theta=1e6, tie_word_embeddings=False, use_sliding_window=False,
                     sliding_window=131072, max_window_layers=28),
    "qwen3-0.6b": dict(model_type="qwen3", hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                       rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True,
                       use_sliding_window=False, sliding_window=None, max_window_layers=28,
                       attention_bias=False),
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                     rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False,
                     use_sliding_window=False, sliding_window=None, max_window_layers=36,
                     attention_bias=False),
    "deepseek-v2-lite": dict(
        model_type="deepseek_v2", hidden_size=2048, intermediate_size=10944,
        moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
        num_key_value_heads=16, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
        first_k_dense_replace=1, moe_layer_freq=1, kv_lora_rank=512, q_lora_rank=None,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, vocab_size=102400,
        max_position_embeddings=163840, rms_norm_eps=1e-6, rope_theta=10000.0,
        rope_scaling=dict(_DEEPSEEK_YARN, mscale=0.707, mscale_all_dim=0.707),
        routed_scaling_factor=1.0, topk_method="greedy", norm_topk_prob=False, n_group=1,
        topk_group=1, tie_word_embeddings=False,
    ),
    "mixtral-8x7b": dict(_MIXTRAL, model_type="mixtral", hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, vocab_size=32000,
                         max_position_embeddings=32768, router_aux_loss_coef=0.02),
    "mixtral-8x22b": dict(_MIXTRAL, model_type="mixtral", hidden_size=6144,
                          intermediate_size=16384, num_hidden_layers=56, num_attention_heads=48,
                          vocab_size=32768, max_position_embeddings=65536,
                          router_aux_loss_coef=0.001, router_jitter_noise=0.0),  # Instruct
    # Qwen/Qwen1.5-MoE-A2.7B
    "qwen1.5-moe-a2.7b": dict(model_type="qwen2_moe", hidden_size=2048, intermediate_size=5632,
                              num_hidden_layers=24, num_attention_heads=16,
                              num_key_value_heads=16, vocab_size=151936,
                              max_position_embeddings=8192, max_window_layers=21,
                              moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
                              num_experts=60, num_experts_per_tok=4, norm_topk_prob=False,
                              decoder_sparse_step=1, output_router_logits=False,
                              router_aux_loss_coef=0.001, rms_norm_eps=1e-6, rope_theta=1e6,
                              sliding_window=32768, use_sliding_window=False,
                              tie_word_embeddings=False, hidden_act="silu"),
    "olmo-2-1b": dict(_OLMO2, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                      num_attention_heads=16, num_key_value_heads=16),
    "olmo-2-7b": dict(_OLMO2, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=32),
    "olmo-2-13b": dict(_OLMO2, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                       num_attention_heads=40, num_key_value_heads=40),
    # HuggingFaceTB/SmolLM3-3B (no_rope_layers: every 4th layer 0, as the interval makes it)
    "smollm3-3b": dict(model_type="smollm3", hidden_size=2048, intermediate_size=11008,
                       num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=4,
                       vocab_size=128256, max_position_embeddings=65536, rms_norm_eps=1e-6,
                       rope_theta=5e6, tie_word_embeddings=True, use_sliding_window=False,
                       sliding_window=None, attention_bias=False, mlp_bias=False,
                       no_rope_layers=[int((i + 1) % 4 != 0) for i in range(36)]),
    # bigcode/starcoder2-{3b,7b,15b} (recalled; 7b's tied head as its unset
    # tie_word_embeddings reads, 15b's untied as its config.json says)
    "starcoder2-3b": dict(_STARCODER2, hidden_size=3072, intermediate_size=12288,
                          num_hidden_layers=30, num_attention_heads=24, num_key_value_heads=2,
                          rope_theta=999999.4420358813, initializer_range=0.018042),
    "starcoder2-7b": dict(_STARCODER2, hidden_size=4608, intermediate_size=18432,
                          num_hidden_layers=32, num_attention_heads=36, num_key_value_heads=4,
                          rope_theta=1000000, initializer_range=0.018042),
    "starcoder2-15b": dict(_STARCODER2, hidden_size=6144, intermediate_size=24576,
                           num_hidden_layers=40, num_attention_heads=48, num_key_value_heads=4,
                           rope_theta=100000, initializer_range=0.01275,
                           tie_word_embeddings=False),
    "modernbert-base": dict(_MODERNBERT, hidden_size=768, intermediate_size=1152,
                            num_hidden_layers=22, num_attention_heads=12),
    "modernbert-large": dict(_MODERNBERT, hidden_size=1024, intermediate_size=2624,
                             num_hidden_layers=28, num_attention_heads=16),
    "albert-base-v2": dict(_ALBERT, hidden_size=768, num_hidden_layers=12,
                           num_attention_heads=12, intermediate_size=3072),
    "albert-large-v2": dict(_ALBERT, hidden_size=1024, num_hidden_layers=24,
                            num_attention_heads=16, intermediate_size=4096),
    "albert-xlarge-v2": dict(_ALBERT, hidden_size=2048, num_hidden_layers=24,
                             num_attention_heads=16, intermediate_size=8192),
    "albert-xxlarge-v2": dict(_ALBERT, hidden_size=4096, num_hidden_layers=12,
                              num_attention_heads=64, intermediate_size=16384),
    "distilbert-base-uncased": _DISTILBERT,
    "roberta-base": _ROBERTA,
    "roberta-large": dict(_ROBERTA, **_LARGE),
    "xlm-roberta-base": dict(_ROBERTA, **_XLMR),
    "xlm-roberta-large": dict(_ROBERTA, **_LARGE, **_XLMR),
    "deepseek-v3": _DEEPSEEK_V3,
    "deepseek-v3.2": dict(_DEEPSEEK_V3, model_type="deepseek_v32", index_topk=2048,
                          index_n_heads=64, index_head_dim=128),  # V3.2-Exp
    # microsoft/Phi-3-mini-4k-instruct (its q/k/v and gate/up are stored fused)
    "phi-3-mini-4k": dict(model_type="phi3", hidden_size=3072, intermediate_size=8192,
                          num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                          vocab_size=32064, max_position_embeddings=4096,
                          original_max_position_embeddings=4096, rms_norm_eps=1e-5,
                          rope_scaling=None, rope_theta=10000.0, sliding_window=2047,
                          tie_word_embeddings=False, hidden_act="silu", attention_dropout=0.0,
                          resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=1, eos_token_id=32000,
                          pad_token_id=32000),
    **{f"pythia-{size}": dict(_PYTHIA, hidden_size=d, intermediate_size=4 * d,
                              num_hidden_layers=n, num_attention_heads=h, vocab_size=vocab)
       for size, d, n, h, vocab in _PYTHIA_SIZES},
    "phi-1": _PHI,
    "phi-1.5": _PHI,
    "phi-2": dict(_PHI, hidden_size=2560, intermediate_size=10240, num_hidden_layers=32,
                  partial_rotary_factor=0.4, bos_token_id=50256, eos_token_id=50256),
    # EleutherAI/gpt-j-6b (recalled; its dropouts, training settings, left out)
    "gpt-j-6b": dict(model_type="gptj", architectures=["GPTJForCausalLM"], vocab_size=50400,
                     n_positions=2048, n_embd=4096, n_layer=28, n_head=16, rotary_dim=64,
                     n_inner=None, activation_function="gelu_new", layer_norm_epsilon=1e-5,
                     initializer_range=0.02, tie_word_embeddings=False, bos_token_id=50256,
                     eos_token_id=50256),
    # CohereForAI/c4ai-command-r-v01 (recalled: its sizes surely, its RoPE base and context
    # less so; 34,980,831,232 parameters, the model card's 35B)
    "command-r": dict(model_type="cohere", architectures=["CohereForCausalLM"],
                      hidden_size=8192, intermediate_size=22528, num_hidden_layers=40,
                      num_attention_heads=64, num_key_value_heads=64, vocab_size=256000,
                      max_position_embeddings=8192, rope_theta=8000000.0, layer_norm_eps=1e-5,
                      logit_scale=0.0625, tie_word_embeddings=True, attention_bias=False,
                      use_qk_norm=False, hidden_act="silu", bos_token_id=5,
                      eos_token_id=255001, pad_token_id=0),
    # CohereForAI/c4ai-command-r-plus (recalled: its sizes surely, its RoPE base and context
    # less so; 103,810,674,688 parameters, the model card's 104B)
    "command-r-plus": dict(model_type="cohere", architectures=["CohereForCausalLM"],
                           hidden_size=12288, intermediate_size=33792, num_hidden_layers=64,
                           num_attention_heads=96, num_key_value_heads=8, vocab_size=256000,
                           max_position_embeddings=8192, rope_theta=75000000.0,
                           layer_norm_eps=1e-5, logit_scale=0.8333333333333334,
                           tie_word_embeddings=True, attention_bias=False, use_qk_norm=True,
                           hidden_act="silu", bos_token_id=5, eos_token_id=255001,
                           pad_token_id=0),
    "stablelm-3b-4e1t": _STABLELM,
    "stablelm-2-1_6b": dict(_STABLELM, hidden_size=2048, intermediate_size=5632,
                            num_hidden_layers=24, vocab_size=100352, use_qkv_bias=True),
    "stablelm-2-12b": dict(_STABLELM, hidden_size=5120, intermediate_size=13824,
                           num_hidden_layers=40, num_key_value_heads=8, vocab_size=100352,
                           qk_layernorm=True, use_parallel_residual=True),
    "persimmon-8b": _PERSIMMON_8B,
    "minitron-4b": _MINITRON,
    "minitron-8b": dict(_MINITRON, hidden_size=4096, intermediate_size=16384,
                        num_attention_heads=48),
    "falcon-7b": dict(_FALCON, hidden_size=4544, num_hidden_layers=32, num_attention_heads=71,
                      multi_query=True, new_decoder_architecture=False),
    "falcon-40b": dict(_FALCON, hidden_size=8192, num_hidden_layers=60,
                       num_attention_heads=128, num_kv_heads=8, new_decoder_architecture=True),
    "falcon-rw-1b": _FALCON_RW_1B,
    "mpt-7b": _MPT,
    "mpt-30b": dict(_MPT, d_model=7168, n_heads=64, n_layers=48, max_seq_len=8192),
    "bloom-560m": dict(_BLOOM, hidden_size=1024, n_layer=24, n_head=16),
    "bloom-1b1": dict(_BLOOM, hidden_size=1536, n_layer=24, n_head=16),
    "bloom-1b7": dict(_BLOOM, hidden_size=2048, n_layer=24, n_head=16),
    "bloom-3b": dict(_BLOOM, hidden_size=2560, n_layer=30, n_head=32),
    "bloom-7b1": dict(_BLOOM, hidden_size=4096, n_layer=30, n_head=32),
    "bloom": dict(_BLOOM, hidden_size=14336, n_layer=70, n_head=112),
    "gpt-oss-20b": _GPT_OSS,
    "gpt-oss-120b": dict(_GPT_OSS, num_hidden_layers=36, num_local_experts=128,
                         layer_types=_GPT_OSS_LAYERS * 18),
}  # fmt: skip


@pytest.mark.parametrize("name", list(CONFIG_JSON))
def test_published_presets_are_their_config_json(name):
    """Each published preset is the model its checkpoint's config.json describes (as
    import-hf reads it: every architecture field, context and RoPE settings included), and
    its parameter count is the transformers model's built from that config.json."""
    transformers = pytest.importorskip("transformers")
    from attnlab.interop import config_from_hf

    hf = CONFIG_JSON[name]
    preset, imported = get_preset(name), config_from_hf(hf)

    def architecture(cfg):  # training settings aside: dropout, init std; widths resolved
        return cfg.override({"dropout": 0.0, "attention.dropout": 0.0, "init_std": 0.02,
                             "ffn.hidden_dim": cfg.ffn.hidden_size(cfg.d_model)})  # fmt: skip

    assert architecture(preset) == architecture(imported)
    config = transformers.AutoConfig.for_model(**hf)
    # encoders (ModernBERT) by their masked-LM head, decoders by their language-model head
    auto = (transformers.AutoModelForMaskedLM if preset.arch == "encoder"
            else transformers.AutoModelForCausalLM)  # fmt: skip
    with torch.device("meta"):
        reference = auto.from_config(config)
    assert count_parameters(preset)["total"] == reference.num_parameters()
