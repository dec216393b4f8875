"""Named model configurations: plain functions returning a fresh config.

Tiny presets build in milliseconds for tests; published sizes (GPT-2, LLaMA, Mistral,
Qwen2, Mixtral, Gemma 3, Phi-3, Pythia, ...) are there for the calculators and for
checkpoint import.
"""

from __future__ import annotations

from collections.abc import Callable

from attnlab.config import (
    AttentionConfig,
    ConfigError,
    DataConfig,
    FFNConfig,
    ModelConfig,
    NormConfig,
    PositionConfig,
    RunConfig,
    TrainConfig,
)


def gpt2_style(
    *,
    vocab_size: int,
    max_seq_len: int,
    d_model: int,
    n_layers: int,
    n_heads: int,
    dropout: float = 0.0,
) -> ModelConfig:
    """GPT-2: learned positions, LayerNorm with bias, pre-norm, GELU (tanh) MLP of 4d, MHA
    with biases, tied embeddings."""
    return ModelConfig(
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
        d_model=d_model,
        n_layers=n_layers,
        attention=AttentionConfig(n_heads=n_heads, qkv_bias=True, out_bias=True),
        position=PositionConfig(kind="learned"),
        ffn=FFNConfig(kind="mlp", activation="gelu_tanh", bias=True),
        norm=NormConfig(kind="layernorm", eps=1e-5, bias=True, placement="pre"),
        tie_embeddings=True,
        dropout=dropout,
    )


def llama_style(
    *,
    vocab_size: int,
    max_seq_len: int,
    d_model: int,
    n_layers: int,
    n_heads: int,
    n_kv_heads: int | None = None,
    ffn_hidden: int | None = None,
    multiple_of: int = 256,
    rope_theta: float = 10000.0,
    norm_eps: float = 1e-5,
    tie_embeddings: bool = False,
    qkv_bias: bool = False,
) -> ModelConfig:
    """LLaMA: RoPE (split halves), RMSNorm, pre-norm, SwiGLU, GQA, no biases, untied head."""
    return ModelConfig(
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
        d_model=d_model,
        n_layers=n_layers,
        attention=AttentionConfig(n_heads=n_heads, n_kv_heads=n_kv_heads, qkv_bias=qkv_bias),
        position=PositionConfig(kind="rope", rope_theta=rope_theta, rope_layout="split"),
        ffn=FFNConfig(
            kind="glu",
            activation="silu",
            hidden_dim=ffn_hidden,
            multiple_of=multiple_of,
            bias=False,
        ),
        norm=NormConfig(kind="rmsnorm", eps=norm_eps, placement="pre"),
        tie_embeddings=tie_embeddings,
    )


def gpt2_tiny() -> ModelConfig:
    return gpt2_style(vocab_size=256, max_seq_len=128, d_model=64, n_layers=2, n_heads=4)


def llama_tiny() -> ModelConfig:
    return llama_style(
        vocab_size=256,
        max_seq_len=128,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        multiple_of=32,
    )


def vaswani_tiny() -> ModelConfig:
    """The original Transformer's choices in a decoder-only model: sinusoidal positions,
    post-norm, ReLU MLP."""
    return ModelConfig(
        vocab_size=256,
        max_seq_len=128,
        d_model=64,
        n_layers=2,
        attention=AttentionConfig(n_heads=4, qkv_bias=True, out_bias=True),
        position=PositionConfig(kind="sinusoidal"),
        ffn=FFNConfig(kind="mlp", activation="relu"),
        norm=NormConfig(kind="layernorm", placement="post"),
    )


def xl_tiny() -> ModelConfig:
    """Transformer-XL (Dai et al. 2019): relative positional attention, a memory of 64
    hidden states per layer; pre-norm GPT-2-style blocks otherwise."""
    from attnlab.models.xl import XLConfig

    return XLConfig(
        vocab_size=256,
        max_seq_len=128,
        d_model=64,
        n_layers=2,
        attention=AttentionConfig(n_heads=4),
        ffn=FFNConfig(kind="mlp", activation="gelu"),
        mem_len=64,
    )


def gpt2() -> ModelConfig:  # 124M
    return gpt2_style(vocab_size=50257, max_seq_len=1024, d_model=768, n_layers=12, n_heads=12)


def gpt2_medium() -> ModelConfig:  # 355M
    return gpt2_style(vocab_size=50257, max_seq_len=1024, d_model=1024, n_layers=24, n_heads=16)


def gpt2_large() -> ModelConfig:  # 774M
    return gpt2_style(vocab_size=50257, max_seq_len=1024, d_model=1280, n_layers=36, n_heads=20)


def gpt2_xl() -> ModelConfig:  # 1.5B
    return gpt2_style(vocab_size=50257, max_seq_len=1024, d_model=1600, n_layers=48, n_heads=25)


def llama_2_7b() -> ModelConfig:
    return llama_style(
        vocab_size=32000, max_seq_len=4096, d_model=4096, n_layers=32, n_heads=32, ffn_hidden=11008
    )


def llama_3_8b() -> ModelConfig:
    return llama_style(
        vocab_size=128256,
        max_seq_len=8192,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_hidden=14336,
        rope_theta=500000.0,
    )


def mistral_7b() -> ModelConfig:
    return llama_style(
        vocab_size=32000,
        max_seq_len=32768,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_hidden=14336,
        rope_theta=1e6,
    )


def qwen2_0_5b() -> ModelConfig:
    """Qwen/Qwen2-0.5B config.json: GQA 14/2, q/k/v biases, tied head; its
    max_position_embeddings is 131072 (the model card quotes a 32K context)."""
    return llama_style(
        vocab_size=151936,
        max_seq_len=131072,
        d_model=896,
        n_layers=24,
        n_heads=14,
        n_kv_heads=2,
        ffn_hidden=4864,
        rope_theta=1e6,
        norm_eps=1e-6,
        tie_embeddings=True,
        qkv_bias=True,
    )


def llama_2_70b() -> ModelConfig:
    """meta-llama/Llama-2-70b-hf config.json: GQA 64/8, 80 layers, 4k context."""
    return llama_style(
        vocab_size=32000,
        max_seq_len=4096,
        d_model=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_hidden=28672,
    )


def qwen2_7b() -> ModelConfig:
    """Qwen/Qwen2-7B config.json: GQA 28/4, q/k/v biases, untied head."""
    return llama_style(
        vocab_size=152064,
        max_seq_len=131072,
        d_model=3584,
        n_layers=28,
        n_heads=28,
        n_kv_heads=4,
        ffn_hidden=18944,
        rope_theta=1e6,
        norm_eps=1e-6,
        qkv_bias=True,
    )


def qwen3(
    *, d_model: int, n_layers: int, n_heads: int, ffn_hidden: int, tie_embeddings: bool
) -> ModelConfig:
    """Qwen3 (dense): the LLaMA layout with QK-norm, 128-wide heads whatever d_model, GQA
    with 8 key/value heads, a 152K vocabulary and a 40,960-token context."""
    return llama_style(
        vocab_size=151936,
        max_seq_len=40960,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=8,
        ffn_hidden=ffn_hidden,
        rope_theta=1e6,
        norm_eps=1e-6,
        tie_embeddings=tie_embeddings,
    ).override(  # head_dim stays None where d_model / n_heads gives 128 (as import-hf reads it)
        {"attention.head_dim": None if d_model == 128 * n_heads else 128, "attention.qk_norm": True}
    )


def qwen3_0_6b() -> ModelConfig:
    """Qwen/Qwen3-0.6B config.json: GQA 16/8, tied head."""
    return qwen3(d_model=1024, n_layers=28, n_heads=16, ffn_hidden=3072, tie_embeddings=True)


def qwen3_8b() -> ModelConfig:
    """Qwen/Qwen3-8B config.json: GQA 32/8, untied head."""
    return qwen3(d_model=4096, n_layers=36, n_heads=32, ffn_hidden=12288, tie_embeddings=False)


def mixtral(
    *,
    vocab_size: int,
    max_seq_len: int,
    d_model: int,
    n_layers: int,
    n_heads: int,
    ffn_hidden: int,
) -> ModelConfig:
    """Mixtral: Mistral's attention (GQA with 8 key/value heads, RoPE theta 1e6, no
    window) with a mixture of 8 SwiGLU experts as wide as ``ffn_hidden`` in every layer, of
    which 2 per token by a softmax router renormalised over them (attnlab's ``deepseek-v2``
    router, no shared experts)."""
    return llama_style(
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=8,
        ffn_hidden=ffn_hidden,
        rope_theta=1e6,
    ).override(
        {
            "ffn.kind": "moe",
            "ffn.router": "deepseek-v2",
            "ffn.n_routed_experts": 8,
            "ffn.n_shared_experts": 0,
            "ffn.n_activated_experts": 2,
            "ffn.moe_hidden_dim": ffn_hidden,
            "ffn.norm_topk_prob": True,
        }
    )


def mixtral_8x7b() -> ModelConfig:
    """mistralai/Mixtral-8x7B-v0.1 config.json: 46.7B total, 12.9B active; GQA 32/8, 32k
    context."""
    return mixtral(
        vocab_size=32000, max_seq_len=32768, d_model=4096, n_layers=32, n_heads=32, ffn_hidden=14336
    )


def mixtral_8x22b() -> ModelConfig:
    """mistralai/Mixtral-8x22B-Instruct-v0.1 config.json (the v3 tokenizer's 32768 tokens;
    mistral-community's conversion of the base model has 32000): 141B total, 39B active;
    GQA 48/8, 56 layers, 64k context."""
    return mixtral(
        vocab_size=32768, max_seq_len=65536, d_model=6144, n_layers=56, n_heads=48, ffn_hidden=16384
    )


def qwen2_moe(
    *,
    vocab_size: int,
    max_seq_len: int,
    d_model: int,
    n_layers: int,
    n_heads: int,
    n_kv_heads: int | None,
    ffn_hidden: int,
    n_experts: int,
    top_k: int,
    expert_hidden: int,
    n_shared: int,
    rope_theta: float = 1e6,
    first_k_dense: int = 0,
    dense_layers: tuple[int, ...] = (),
) -> ModelConfig:
    """Qwen2-MoE: Qwen2's attention (q/k/v biases, RMSNorm eps 1e-6) with a softmax router
    choosing ``top_k`` of ``n_experts`` SwiGLU experts, not renormalised (attnlab's
    ``deepseek-v2`` router), and a shared expert ``n_shared`` times as wide whose output a
    learned sigmoid gate scales per token; ``ffn_hidden``: the dense layers' width."""
    return llama_style(
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        ffn_hidden=ffn_hidden,
        rope_theta=rope_theta,
        norm_eps=1e-6,
        qkv_bias=True,
    ).override(
        {
            "ffn.kind": "moe",
            "ffn.router": "deepseek-v2",
            "ffn.n_routed_experts": n_experts,
            "ffn.n_shared_experts": n_shared,
            "ffn.shared_expert_gate": True,
            "ffn.n_activated_experts": top_k,
            "ffn.moe_hidden_dim": expert_hidden,
            "ffn.norm_topk_prob": False,
            "ffn.first_k_dense": first_k_dense,
            "ffn.dense_layers": list(dense_layers),
        }
    )


def qwen2_moe_tiny() -> ModelConfig:
    """Qwen2-MoE's architecture in 4 layers, d_model 64, GQA 4/2: 8 experts of 32 (top 2)
    and a gated shared expert of 64 on layers 1 and 3 (decoder_sparse_step 2), dense
    SwiGLU layers of 128 on 0 and 2, for tests."""
    return qwen2_moe(
        vocab_size=256,
        max_seq_len=128,
        d_model=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden=128,
        n_experts=8,
        top_k=2,
        expert_hidden=32,
        n_shared=2,
        rope_theta=10000.0,
        first_k_dense=1,
        dense_layers=(2,),
    )


def qwen1_5_moe_a2_7b() -> ModelConfig:
    """Qwen/Qwen1.5-MoE-A2.7B config.json: 14.3B total, 2.7B active; MHA 16 heads, 60
    experts of 1408 (top 4) and a shared expert of 5632 (4 x 1408) in every layer, 8k
    context."""
    return qwen2_moe(
        vocab_size=151936,
        max_seq_len=8192,
        d_model=2048,
        n_layers=24,
        n_heads=16,
        n_kv_heads=None,
        ffn_hidden=5632,
        n_experts=60,
        top_k=4,
        expert_hidden=1408,
        n_shared=4,
    )


def deepseek_style(
    *,
    vocab_size: int,
    max_seq_len: int,
    d_model: int,
    n_layers: int,
    n_heads: int,
    ffn_hidden: int,
    kv_lora_rank: int,
    qk_nope_head_dim: int,
    qk_rope_head_dim: int,
    v_head_dim: int,
    q_lora_rank: int | None = None,
    moe: dict | None = None,
    yarn: dict | None = None,
    rope_theta: float = 10000.0,
    norm_eps: float = 1e-6,
) -> ModelConfig:
    """DeepSeek-V2/V3: multi-head latent attention with decoupled RoPE (interleaved pairs),
    RMSNorm, pre-norm, SwiGLU, untied head; ``moe``: FFNConfig fields of the
    mixture-of-experts layers; ``yarn``: PositionConfig fields of YaRN context extension."""
    ffn = FFNConfig(kind="glu", activation="silu", hidden_dim=ffn_hidden, bias=False)
    if moe is not None:
        ffn = FFNConfig(kind="moe", activation="silu", hidden_dim=ffn_hidden, bias=False, **moe)
    position = PositionConfig(kind="rope", rope_theta=rope_theta, rope_layout="interleaved")
    if yarn is not None:
        position = PositionConfig(
            kind="rope", rope_theta=rope_theta, rope_layout="interleaved", **yarn
        )
    return ModelConfig(
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
        d_model=d_model,
        n_layers=n_layers,
        attention=AttentionConfig(
            kind="mla",
            n_heads=n_heads,
            q_lora_rank=q_lora_rank,
            kv_lora_rank=kv_lora_rank,
            qk_nope_head_dim=qk_nope_head_dim,
            qk_rope_head_dim=qk_rope_head_dim,
            v_head_dim=v_head_dim,
        ),
        position=position,
        ffn=ffn,
        norm=NormConfig(kind="rmsnorm", eps=norm_eps, placement="pre"),
        tie_embeddings=False,
    )


def deepseek_tiny() -> ModelConfig:
    """MLA with a dense SwiGLU, 2 layers, d_model 64: CPU-trainable, for tests."""
    return deepseek_style(
        vocab_size=256,
        max_seq_len=128,
        d_model=64,
        n_layers=2,
        n_heads=4,
        ffn_hidden=176,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
    )


def deepseek_moe_tiny() -> ModelConfig:
    """MLA with query compression and DeepSeek-V3 routing (8 experts in 2 groups, top 2
    from the best group, 1 shared expert), first layer dense; 2 layers, d_model 64."""
    return deepseek_style(
        vocab_size=256,
        max_seq_len=128,
        d_model=64,
        n_layers=2,
        n_heads=4,
        ffn_hidden=176,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        moe=dict(
            n_routed_experts=8,
            n_shared_experts=1,
            n_activated_experts=2,
            moe_hidden_dim=48,
            first_k_dense=1,
            router="deepseek-v3",
            n_groups=2,
            topk_groups=1,
            routed_scaling_factor=2.5,
        ),
    )


def deepseek_v2_lite() -> ModelConfig:
    """deepseek-ai/DeepSeek-V2-Lite config.json: 15.7B total, 2.4B active; MLA without query
    compression, 64 routed experts (6 per token, softmax greedy) + 2 shared, YaRN x40."""
    return deepseek_style(
        vocab_size=102400,
        max_seq_len=163840,
        d_model=2048,
        n_layers=27,
        n_heads=16,
        ffn_hidden=10944,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        moe=dict(
            n_routed_experts=64,
            n_shared_experts=2,
            n_activated_experts=6,
            moe_hidden_dim=1408,
            first_k_dense=1,
            router="deepseek-v2",
            norm_topk_prob=False,
            routed_scaling_factor=1.0,
        ),
        yarn=_deepseek_yarn(mscale=0.707),
    )


def deepseek_v3() -> ModelConfig:
    """deepseek-ai/DeepSeek-V3 config.json: 671B total (without the multi-token-prediction
    module), 37B active; 256 routed experts in 8 groups (8 per token from 4 groups, sigmoid
    with bias) + 1 shared, first 3 layers dense, YaRN x40."""
    return deepseek_style(
        vocab_size=129280,
        max_seq_len=163840,
        d_model=7168,
        n_layers=61,
        n_heads=128,
        ffn_hidden=18432,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        moe=dict(
            n_routed_experts=256,
            n_shared_experts=1,
            n_activated_experts=8,
            moe_hidden_dim=2048,
            first_k_dense=3,
            router="deepseek-v3",
            n_groups=8,
            topk_groups=4,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
        ),
        yarn=_deepseek_yarn(mscale=1.0),
    )


def _deepseek_yarn(mscale: float) -> dict:
    return dict(
        rope_scaling="yarn",
        rope_factor=40.0,
        rope_original_max_seq_len=4096,
        rope_beta_fast=32.0,
        rope_beta_slow=1.0,
        rope_mscale=mscale,
        rope_mscale_all_dim=mscale,
    )


def deepseek_v32_tiny() -> ModelConfig:
    """deepseek-moe-tiny with DeepSeek sparse attention: a lightning indexer of 4 heads x 32
    per layer picking 16 keys per query (tests, examples)."""
    return deepseek_moe_tiny().override(
        {"attention.kind": "dsa", "attention.index_topk": 16, "attention.index_n_heads": 4}
    )


def deepseek_v32() -> ModelConfig:
    """deepseek-ai/DeepSeek-V3.2-Exp config.json: DeepSeek-V3 plus a lightning indexer of
    64 heads x 128 per layer selecting 2048 keys per query."""
    return deepseek_v3().override(
        {
            "attention.kind": "dsa",
            "attention.index_topk": 2048,
            "attention.index_n_heads": 64,
            "attention.index_head_dim": 128,
        }
    )


def gpt_oss_style(
    *,
    vocab_size: int,
    max_seq_len: int,
    d_model: int,
    n_layers: int,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    sliding_window: int,
    n_experts: int,
    n_activated_experts: int,
    expert_hidden: int,
    yarn: dict,
) -> ModelConfig:
    """GPT-OSS: GQA with q/k/v/o biases and a learned sink logit per head, alternating
    local (a sliding window, first) and global layers, YaRN RoPE (ramp bounds not rounded),
    RMSNorm, untied head, and experts in every layer: a softmax over the top-k logits of a
    router with bias, SwiGLU experts with biases and a clamp (alpha 1.702, limit 7)."""
    return ModelConfig(
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
        d_model=d_model,
        n_layers=n_layers,
        attention=AttentionConfig(
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            qkv_bias=True,
            out_bias=True,
            sliding_window=sliding_window,
            layer_pattern="LG",
            sink_logits=True,
        ),
        position=PositionConfig(
            kind="rope",
            rope_theta=150000.0,
            rope_layout="split",
            rope_scaling="yarn",
            rope_beta_fast=32.0,
            rope_beta_slow=1.0,
            rope_truncate=False,
            **yarn,
        ),
        ffn=FFNConfig(
            kind="moe",
            activation="clamped_swiglu",
            bias=False,
            n_routed_experts=n_experts,
            n_shared_experts=0,
            n_activated_experts=n_activated_experts,
            moe_hidden_dim=expert_hidden,
            router="deepseek-v2",
            norm_topk_prob=True,
            router_bias=True,
            expert_bias=True,
        ),
        norm=NormConfig(kind="rmsnorm", eps=1e-5, placement="pre"),
        tie_embeddings=False,
    )


def gpt_oss_tiny() -> ModelConfig:
    """GPT-OSS's architecture in 2 layers (local, global), d_model 64, 4 experts (top 2):
    CPU-trainable, for tests."""
    return gpt_oss_style(
        vocab_size=256,
        max_seq_len=128,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=24,  # (independent of d_model / n_heads, as gpt-oss's 64 is)
        sliding_window=16,
        n_experts=4,
        n_activated_experts=2,
        expert_hidden=64,
        yarn=dict(rope_factor=4.0, rope_original_max_seq_len=32),
    )


def gpt_oss(n_layers: int, n_experts: int) -> ModelConfig:
    """openai/gpt-oss-20b and -120b config.json: d_model 2880, 64 query heads of 64 and 8
    key/value heads, a window of 128 on every other layer, experts of 2880 (4 per token),
    a 201,088-token vocabulary, 131,072 positions by YaRN x32 from 4,096."""
    return gpt_oss_style(
        vocab_size=201088,
        max_seq_len=131072,
        d_model=2880,
        n_layers=n_layers,
        n_heads=64,
        n_kv_heads=8,
        head_dim=64,
        sliding_window=128,
        n_experts=n_experts,
        n_activated_experts=4,
        expert_hidden=2880,
        yarn=dict(rope_factor=32.0, rope_original_max_seq_len=4096),
    )


def gpt_oss_20b() -> ModelConfig:
    """openai/gpt-oss-20b: 24 layers, 32 experts; 20.9B parameters, 3.6B active."""
    return gpt_oss(n_layers=24, n_experts=32)


def gpt_oss_120b() -> ModelConfig:
    """openai/gpt-oss-120b: 36 layers, 128 experts; 116.8B parameters, 5.1B active."""
    return gpt_oss(n_layers=36, n_experts=128)


def gemma3_style(
    *,
    vocab_size: int,
    max_seq_len: int,
    d_model: int,
    n_layers: int,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    ffn_hidden: int,
    sliding_window: int,
    query_pre_attn_scalar: int,
    rope_factor: float | None = None,
    rope_theta: float = 1_000_000.0,
    local_rope_theta: float = 10_000.0,
) -> ModelConfig:
    """Gemma 3 (text): five local layers (a sliding window; RoPE of base local_rope_theta)
    to one global layer (RoPE of base rope_theta, linear x rope_factor in the 4B to 27B
    models), GQA with QK-norm and a softmax scale of query_pre_attn_scalar**-0.5, RMSNorms
    of weight 1 + w before and after each sublayer, GeGLU (tanh), no biases, embeddings
    scaled by sqrt(d_model) and tied to the head."""
    scale = None if query_pre_attn_scalar == head_dim else query_pre_attn_scalar**-0.5
    return ModelConfig(
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
        d_model=d_model,
        n_layers=n_layers,
        attention=AttentionConfig(
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=None if head_dim * n_heads == d_model else head_dim,
            sliding_window=sliding_window,
            layer_pattern="LLLLLG",
            qk_norm=True,
            scale=scale,
        ),
        position=PositionConfig(
            kind="rope",
            rope_theta=rope_theta,
            rope_layout="split",
            rope_scaling=None if rope_factor is None else "linear",
            rope_factor=1.0 if rope_factor is None else rope_factor,
            local_rope_theta=local_rope_theta,
        ),
        ffn=FFNConfig(kind="glu", activation="gelu_tanh", hidden_dim=ffn_hidden, bias=False),
        norm=NormConfig(kind="gemma_rmsnorm", eps=1e-6, placement="sandwich"),
        tie_embeddings=True,
        scale_embeddings=True,
    )


def gemma3_tiny() -> ModelConfig:
    """Gemma 3's architecture in 6 layers (5 local, 1 global), d_model 64: CPU-trainable,
    for tests; a softmax scale of its own (query_pre_attn_scalar 24, head_dim 16) and
    linear RoPE scaling on the global layer, as the larger models have."""
    return gemma3_style(
        vocab_size=256,
        max_seq_len=128,
        d_model=64,
        n_layers=6,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        ffn_hidden=128,
        sliding_window=16,
        query_pre_attn_scalar=24,
        rope_factor=8.0,
    )


def gemma3_1b() -> ModelConfig:
    """google/gemma-3-1b-pt config.json: 26 layers, MQA (4 heads of 256, 1 key/value head),
    a window of 512, 32k context, no RoPE scaling, a 262,144-token vocabulary."""
    return gemma3_style(
        vocab_size=262144,
        max_seq_len=32768,
        d_model=1152,
        n_layers=26,
        n_heads=4,
        n_kv_heads=1,
        head_dim=256,
        ffn_hidden=6912,
        sliding_window=512,
        query_pre_attn_scalar=256,
    )


def gemma3_large(
    d_model: int, n_layers: int, n_heads: int, ffn_hidden: int, head_dim: int, scalar: int
) -> ModelConfig:
    """The text models of google/gemma-3-4b/12b/27b (config.json text_config): GQA 2:1, a
    window of 1024, 128k context by linear RoPE x8, a 262,208-token vocabulary."""
    return gemma3_style(
        vocab_size=262208,
        max_seq_len=131072,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_heads // 2,
        head_dim=head_dim,
        ffn_hidden=ffn_hidden,
        sliding_window=1024,
        query_pre_attn_scalar=scalar,
        rope_factor=8.0,
    )


def gemma3_4b() -> ModelConfig:
    """google/gemma-3-4b-pt's language model: 34 layers, 8 heads of 256."""
    return gemma3_large(2560, 34, 8, 10240, head_dim=256, scalar=256)


def gemma3_12b() -> ModelConfig:
    """google/gemma-3-12b-pt's language model: 48 layers, 16 heads of 256."""
    return gemma3_large(3840, 48, 16, 15360, head_dim=256, scalar=256)


def gemma3_27b() -> ModelConfig:
    """google/gemma-3-27b-pt's language model: 62 layers, 32 heads of 128, a softmax scale
    of 168**-0.5 (query_pre_attn_scalar 168, not head_dim)."""
    return gemma3_large(5376, 62, 32, 21504, head_dim=128, scalar=168)


def gemma_style(
    *,
    d_model: int,
    n_layers: int,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    ffn_hidden: int,
    vocab_size: int = 256000,
    max_seq_len: int = 8192,
    rope_theta: float = 10_000.0,
) -> ModelConfig:
    """Gemma (1): pre-norm blocks with RMSNorms of weight 1 + w, every layer global, one
    RoPE, MHA or MQA with heads of 256, GeGLU (tanh), no biases, embeddings scaled by
    sqrt(d_model) and tied to the head."""
    return ModelConfig(
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
        d_model=d_model,
        n_layers=n_layers,
        attention=AttentionConfig(
            n_heads=n_heads,
            n_kv_heads=None if n_kv_heads == n_heads else n_kv_heads,
            head_dim=None if head_dim * n_heads == d_model else head_dim,
        ),
        position=PositionConfig(kind="rope", rope_theta=rope_theta, rope_layout="split"),
        ffn=FFNConfig(kind="glu", activation="gelu_tanh", hidden_dim=ffn_hidden, bias=False),
        norm=NormConfig(kind="gemma_rmsnorm", eps=1e-6, placement="pre"),
        tie_embeddings=True,
        scale_embeddings=True,
    )


def gemma_2b() -> ModelConfig:
    """google/gemma-2b config.json: 18 layers, MQA (8 heads of 256, 1 key/value head)."""
    return gemma_style(
        d_model=2048, n_layers=18, n_heads=8, n_kv_heads=1, head_dim=256, ffn_hidden=16384
    )


def gemma_7b() -> ModelConfig:
    """google/gemma-7b config.json (transformers' GemmaConfig defaults): 28 layers, MHA
    (16 heads of 256)."""
    return gemma_style(
        d_model=3072, n_layers=28, n_heads=16, n_kv_heads=16, head_dim=256, ffn_hidden=24576
    )


def gemma2_style(
    *,
    d_model: int,
    n_layers: int,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    ffn_hidden: int,
    query_pre_attn_scalar: int,
    sliding_window: int = 4096,
    vocab_size: int = 256000,
    max_seq_len: int = 8192,
    attn_softcap: float = 50.0,
    final_softcap: float = 30.0,
    backend: str = "flash",
) -> ModelConfig:
    """Gemma 2: local (a sliding window) and global layers alternating, one RoPE of base
    10,000, GQA and a softmax scale of query_pre_attn_scalar**-0.5, attention logits
    soft-capped at 50 and output logits at 30 (c tanh(x / c)), RMSNorms of weight 1 + w
    before and after each sublayer, GeGLU (tanh), no biases, embeddings scaled by
    sqrt(d_model) and tied to the head. Attention backend ``flash`` (sdpa cannot cap the
    scores)."""
    scale = None if query_pre_attn_scalar == head_dim else query_pre_attn_scalar**-0.5
    return ModelConfig(
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
        d_model=d_model,
        n_layers=n_layers,
        attention=AttentionConfig(
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=None if head_dim * n_heads == d_model else head_dim,
            sliding_window=sliding_window,
            layer_pattern="LG",
            scale=scale,
            softcap=attn_softcap,
            backend=backend,
        ),
        position=PositionConfig(kind="rope", rope_theta=10_000.0, rope_layout="split"),
        ffn=FFNConfig(kind="glu", activation="gelu_tanh", hidden_dim=ffn_hidden, bias=False),
        norm=NormConfig(kind="gemma_rmsnorm", eps=1e-6, placement="sandwich"),
        tie_embeddings=True,
        scale_embeddings=True,
        final_logit_softcap=final_softcap,
    )


def gemma2_tiny() -> ModelConfig:
    """Gemma 2's architecture in 4 layers (local, global, local, global), d_model 64:
    CPU-trainable, for tests; a window of 16, a softmax scale of its own
    (query_pre_attn_scalar 24, head_dim 16) and caps low enough to bend its logits (attention
    5, output 10)."""
    return gemma2_style(
        vocab_size=256,
        max_seq_len=128,
        d_model=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        ffn_hidden=128,
        query_pre_attn_scalar=24,
        sliding_window=16,
        attn_softcap=5.0,
        final_softcap=10.0,
    )


def gemma2_2b() -> ModelConfig:
    """google/gemma-2-2b config.json (transformers' Gemma2Config defaults): 26 layers, GQA
    (8 heads of 256, 4 key/value heads)."""
    return gemma2_style(
        d_model=2304,
        n_layers=26,
        n_heads=8,
        n_kv_heads=4,
        head_dim=256,
        ffn_hidden=9216,
        query_pre_attn_scalar=256,
    )


def gemma2_9b() -> ModelConfig:
    """google/gemma-2-9b config.json: 42 layers, GQA (16 heads of 256, 8 key/value heads)."""
    return gemma2_style(
        d_model=3584,
        n_layers=42,
        n_heads=16,
        n_kv_heads=8,
        head_dim=256,
        ffn_hidden=14336,
        query_pre_attn_scalar=256,
    )


def gemma2_27b() -> ModelConfig:
    """google/gemma-2-27b config.json: 46 layers, GQA (32 heads of 128, 16 key/value
    heads), a softmax scale of 144**-0.5 (query_pre_attn_scalar d_model / n_heads = 144,
    not head_dim)."""
    return gemma2_style(
        d_model=4608,
        n_layers=46,
        n_heads=32,
        n_kv_heads=16,
        head_dim=128,
        ffn_hidden=36864,
        query_pre_attn_scalar=144,
    )


def olmo2_style(
    *,
    d_model: int,
    n_layers: int,
    n_heads: int,
    ffn_hidden: int,
    n_kv_heads: int | None = None,
    vocab_size: int = 100352,
    max_seq_len: int = 4096,
    rope_theta: float = 500_000.0,
) -> ModelConfig:
    """OLMo 2: LLaMA's RoPE, SwiGLU and untied head, with an RMSNorm on each sublayer's
    output inside its residual branch instead of before it (x + norm(f(x)),
    ``norm.placement=post_sublayer``) and QK-norm over the whole query and key projections
    before the split into heads (``attention.qk_norm_scope=projection``); no biases."""
    return ModelConfig(
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
        d_model=d_model,
        n_layers=n_layers,
        attention=AttentionConfig(
            n_heads=n_heads,
            n_kv_heads=None if n_kv_heads == n_heads else n_kv_heads,
            qk_norm=True,
            qk_norm_scope="projection",
        ),
        position=PositionConfig(kind="rope", rope_theta=rope_theta, rope_layout="split"),
        ffn=FFNConfig(kind="glu", activation="silu", hidden_dim=ffn_hidden, bias=False),
        norm=NormConfig(kind="rmsnorm", eps=1e-6, placement="post_sublayer"),
        tie_embeddings=False,
    )


def olmo2_tiny() -> ModelConfig:
    """OLMo 2's architecture in 2 layers, d_model 64, GQA 4/2: CPU-trainable, for tests."""
    return olmo2_style(
        vocab_size=256,
        max_seq_len=128,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden=160,
        rope_theta=10_000.0,
    )


def olmo2_1b() -> ModelConfig:
    """allenai/OLMo-2-0425-1B config.json: 16 layers, MHA (16 heads of 128)."""
    return olmo2_style(d_model=2048, n_layers=16, n_heads=16, ffn_hidden=8192)


def olmo2_7b() -> ModelConfig:
    """allenai/OLMo-2-1124-7B config.json: 32 layers, MHA (32 heads of 128)."""
    return olmo2_style(d_model=4096, n_layers=32, n_heads=32, ffn_hidden=11008)


def olmo2_13b() -> ModelConfig:
    """allenai/OLMo-2-1124-13B config.json: 40 layers, MHA (40 heads of 128)."""
    return olmo2_style(d_model=5120, n_layers=40, n_heads=40, ffn_hidden=13824)


def smollm3_style(
    *,
    d_model: int,
    n_layers: int,
    n_heads: int,
    n_kv_heads: int,
    ffn_hidden: int,
    vocab_size: int = 128256,
    max_seq_len: int = 65536,
    rope_theta: float = 5_000_000.0,
    nope_interval: int = 4,
) -> ModelConfig:
    """SmolLM3: LLaMA's GQA, RoPE, SwiGLU and RMSNorm with a tied head, in which every
    ``nope_interval``-th layer (3, 7, 11, ...) applies no RoPE (NoPE,
    ``position.nope_layers``; transformers' no_rope_layers = 0); no biases."""
    return ModelConfig(
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
        d_model=d_model,
        n_layers=n_layers,
        attention=AttentionConfig(n_heads=n_heads, n_kv_heads=n_kv_heads),
        position=PositionConfig(
            kind="rope",
            rope_theta=rope_theta,
            rope_layout="split",
            nope_layers=list(range(nope_interval - 1, n_layers, nope_interval)),
        ),
        ffn=FFNConfig(kind="glu", activation="silu", hidden_dim=ffn_hidden, bias=False),
        norm=NormConfig(kind="rmsnorm", eps=1e-6),
        tie_embeddings=True,
    )


def smollm3_tiny() -> ModelConfig:
    """SmolLM3's architecture in 4 layers (layer 3 NoPE), d_model 64, GQA 4/2: for tests."""
    return smollm3_style(
        vocab_size=256,
        max_seq_len=128,
        d_model=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden=160,
        rope_theta=10_000.0,
    )


def smollm3_3b() -> ModelConfig:
    """HuggingFaceTB/SmolLM3-3B config.json: 36 layers (every 4th NoPE), GQA 16/4 heads of
    128, a tied head, 64k context at RoPE base 5e6."""
    return smollm3_style(d_model=2048, n_layers=36, n_heads=16, n_kv_heads=4, ffn_hidden=11008)


def starcoder2_style(
    *,
    d_model: int,
    n_layers: int,
    n_heads: int,
    n_kv_heads: int,
    rope_theta: float,
    tie_embeddings: bool,
    vocab_size: int = 49152,
    max_seq_len: int = 16384,
    window: int | None = 4096,
    init_std: float = 0.018042,
) -> ModelConfig:
    """StarCoder2: GQA with biases on q, k, v and o, RoPE (split halves), a sliding window
    on every layer, LayerNorm with biases before each sublayer, a GELU (tanh) MLP of 4d
    with biases (``c_fc``, ``c_proj``)."""
    return ModelConfig(
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
        d_model=d_model,
        n_layers=n_layers,
        attention=AttentionConfig(
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            qkv_bias=True,
            out_bias=True,
            sliding_window=window,
        ),
        position=PositionConfig(kind="rope", rope_theta=rope_theta, rope_layout="split"),
        ffn=FFNConfig(kind="mlp", activation="gelu_tanh", hidden_dim=4 * d_model, bias=True),
        norm=NormConfig(kind="layernorm", eps=1e-5, bias=True),
        tie_embeddings=tie_embeddings,
        init_std=init_std,
    )


def starcoder2_tiny() -> ModelConfig:
    """StarCoder2's architecture in 2 layers, d_model 64, GQA 4/2, windows of 16 keys: for
    tests and quick training."""
    return starcoder2_style(
        vocab_size=256,
        max_seq_len=128,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        rope_theta=10_000.0,
        tie_embeddings=True,
        window=16,
        init_std=0.02,
    )


# StarCoder2's published sizes: bigcode/starcoder2-{3b,7b,15b} config.json as recalled (no
# download here): 16k context, windows of 4096, vocabulary 49152, norm_epsilon 1e-5; the
# parameter counts are transformers' models of these configs (tests/test_analysis.py).


def starcoder2_3b() -> ModelConfig:
    """bigcode/starcoder2-3b: 30 layers, GQA 24/2 heads of 128, RoPE base 999999.44 (sic),
    a tied head; 3.03B parameters."""
    return starcoder2_style(
        d_model=3072,
        n_layers=30,
        n_heads=24,
        n_kv_heads=2,
        rope_theta=999999.4420358813,
        tie_embeddings=True,
    )


def starcoder2_7b() -> ModelConfig:
    """bigcode/starcoder2-7b: 32 layers, GQA 36/4 heads of 128, RoPE base 1e6, a tied head
    (recalled: its config.json sets no tie_word_embeddings, read as transformers' default,
    true, and its published size is 7.17B); 7.17B parameters."""
    return starcoder2_style(
        d_model=4608,
        n_layers=32,
        n_heads=36,
        n_kv_heads=4,
        rope_theta=1_000_000.0,
        tie_embeddings=True,
    )


def starcoder2_15b() -> ModelConfig:
    """bigcode/starcoder2-15b: 40 layers, GQA 48/4 heads of 128, RoPE base 1e5, an untied
    head (tie_word_embeddings false); 16.0B parameters."""
    return starcoder2_style(
        d_model=6144,
        n_layers=40,
        n_heads=48,
        n_kv_heads=4,
        rope_theta=100_000.0,
        tie_embeddings=False,
        init_std=0.01275,
    )


def granite_tiny() -> ModelConfig:
    """Granite's architecture (LLaMA's with muP multipliers) in 2 layers, d_model 64, GQA
    4/2, a tied head: embeddings x 12, sublayer outputs x 0.22, a softmax scale of 1 / d_h
    and logits / 8, the kind of values Granite 3's checkpoints use: for tests."""
    cfg = llama_style(
        vocab_size=256,
        max_seq_len=128,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden=128,
        norm_eps=1e-5,
        tie_embeddings=True,
    )
    return cfg.override(
        {
            "embedding_multiplier": 12.0,
            "residual_multiplier": 0.22,
            "attention.scale": 1 / 16,  # 1 / head_dim (muP), not 1 / sqrt(head_dim)
            "logit_divisor": 8.0,
        }
    )


def cohere_style(
    *,
    vocab_size: int,
    max_seq_len: int,
    d_model: int,
    n_layers: int,
    n_heads: int,
    ffn_hidden: int,
    rope_theta: float,
    n_kv_heads: int | None = None,
    logit_scale: float = 0.0625,
) -> ModelConfig:
    """Cohere (Command-R): attention and a SwiGLU MLP side by side on each block's input,
    after one LayerNorm without bias that both read (``norm.placement='parallel_shared'``),
    RoPE on interleaved pairs, no biases, a tied head, and the logits multiplied by
    ``logit_scale``."""
    return ModelConfig(
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
        d_model=d_model,
        n_layers=n_layers,
        attention=AttentionConfig(n_heads=n_heads, n_kv_heads=n_kv_heads),
        position=PositionConfig(kind="rope", rope_theta=rope_theta, rope_layout="interleaved"),
        ffn=FFNConfig(kind="glu", activation="silu", hidden_dim=ffn_hidden, bias=False),
        norm=NormConfig(kind="layernorm", eps=1e-5, bias=False, placement="parallel_shared"),
        tie_embeddings=True,
        logit_scale=logit_scale,
    )


def cohere_tiny() -> ModelConfig:
    """Cohere's architecture in 2 layers, d_model 64, GQA 4/2, logits x 1/16 (Command-R's
    scale): for tests and quick training."""
    return cohere_style(
        vocab_size=256,
        max_seq_len=128,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden=128,
        rope_theta=10_000.0,
    )


def command_r() -> ModelConfig:
    """CohereForAI/c4ai-command-r-v01, its config.json as recalled (not read here): 40
    layers, d_model 8192, MHA 64 heads of 128, SwiGLU of 22528, vocabulary 256000, a tied
    head, logit_scale 0.0625, RoPE base 8e6 and max_position_embeddings 8192 (the last two
    recalled with less certainty than the sizes); 35.0B parameters (transformers' count of
    that config, tests/test_analysis.py)."""
    return cohere_style(
        vocab_size=256_000,
        max_seq_len=8192,
        d_model=8192,
        n_layers=40,
        n_heads=64,
        ffn_hidden=22528,
        rope_theta=8_000_000.0,
    )


def command_r_plus() -> ModelConfig:
    """CohereForAI/c4ai-command-r-plus, its config.json as recalled (not read here): 64
    layers, d_model 12288, GQA 96/8 heads of 128, SwiGLU of 33792, vocabulary 256000, a
    tied head, logit_scale 0.8333333333333334, QK-norm (``use_qk_norm``: a LayerNorm per
    query and key head, each head its own weight), RoPE base 7.5e7 and
    max_position_embeddings 8192 (the last two recalled with less certainty than the
    sizes); 103.8B parameters (transformers' count of that config, tests/test_analysis.py)."""
    return cohere_style(
        vocab_size=256_000,
        max_seq_len=8192,
        d_model=12288,
        n_layers=64,
        n_heads=96,
        n_kv_heads=8,
        ffn_hidden=33792,
        rope_theta=75_000_000.0,
        logit_scale=0.8333333333333334,
    ).override(
        {
            "attention.qk_norm": True,
            "attention.qk_norm_kind": "layernorm",
            "attention.qk_norm_weight": "per_head",
        }
    )


def stablelm_style(
    *,
    vocab_size: int,
    max_seq_len: int,
    d_model: int,
    n_layers: int,
    n_heads: int,
    ffn_hidden: int,
    n_kv_heads: int | None = None,
    qkv_bias: bool = False,
    qk_norm: bool = False,
    parallel: bool = False,
    rope_fraction: float = 0.25,
) -> ModelConfig:
    """StableLM (StableLM-3B-4E1T, StableLM 2): LayerNorms with biases, pre-norm blocks (or,
    ``parallel``, attention and the MLP side by side on one norm: ``parallel_shared``), a
    SwiGLU MLP without biases, RoPE of base 10000 on the first ``rope_fraction`` of each
    head (rotate-half pairs), q/k/v biases where ``qkv_bias``, a LayerNorm per query and key
    head (``qk_norm``: ``qk_norm_kind=layernorm``, ``qk_norm_weight=per_head``), an untied
    head."""
    return ModelConfig(
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
        d_model=d_model,
        n_layers=n_layers,
        attention=AttentionConfig(
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            qkv_bias=qkv_bias,
            qk_norm=qk_norm,
            qk_norm_kind="layernorm" if qk_norm else "rmsnorm",
            qk_norm_weight="per_head" if qk_norm else "shared",
        ),
        position=PositionConfig(
            kind="rope", rope_theta=10000.0, rope_layout="split", rope_fraction=rope_fraction
        ),
        ffn=FFNConfig(kind="glu", activation="silu", hidden_dim=ffn_hidden, bias=False),
        norm=NormConfig(
            kind="layernorm",
            eps=1e-5,
            bias=True,
            placement="parallel_shared" if parallel else "pre",
        ),
        tie_embeddings=False,
    )


def stablelm_tiny() -> ModelConfig:
    """StableLM 2's architecture in 2 layers, d_model 64, GQA 4/2 heads of 16 (a quarter of
    each rotated), q/k/v biases: CPU-trainable, for tests."""
    return stablelm_style(
        vocab_size=256,
        max_seq_len=128,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden=128,
        qkv_bias=True,
    )


# stabilityai/stablelm-3b-4e1t, stablelm-2-1_6b and stablelm-2-12b config.json (recalled,
# not read here; tests/test_analysis.py checks each count against transformers'
# StableLmForCausalLM of the same config.json): d_model, layers, heads, key/value heads,
# SwiGLU width, vocabulary, q/k/v biases, QK-norm and parallel blocks. All rotate a quarter
# of each head at base 10000 with 4096 positions, LayerNorm eps 1e-5, an untied head.
STABLELM_SIZES = {
    "stablelm-3b-4e1t": (2560, 32, 32, 32, 6912, 50304, False, False),  # 2,795,443,200
    "stablelm-2-1_6b": (2048, 24, 32, 32, 5632, 100352, True, False),  # 1,644,515,328
    "stablelm-2-12b": (5120, 40, 32, 8, 13824, 100352, False, True),  # 12,143,185,920
}


def stablelm(name: str) -> ModelConfig:
    """stabilityai/``name`` (:data:`STABLELM_SIZES`); StableLM 2 12B with QK-norm and
    parallel blocks."""
    d, n_layers, n_heads, n_kv_heads, ffn, vocab, bias, twelve = STABLELM_SIZES[name]
    return stablelm_style(
        vocab_size=vocab,
        max_seq_len=4096,
        d_model=d,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=None if n_kv_heads == n_heads else n_kv_heads,
        ffn_hidden=ffn,
        qkv_bias=bias,
        qk_norm=twelve,
        parallel=twelve,
    )


def persimmon_style(
    *,
    vocab_size: int,
    max_seq_len: int,
    d_model: int,
    n_layers: int,
    n_heads: int,
    ffn_hidden: int,
    rope_theta: float,
    rope_fraction: float = 0.5,
) -> ModelConfig:
    """Persimmon (Adept): pre-norm blocks of LayerNorms with biases, one fused q/k/v
    projection and an output projection with biases, a LayerNorm with a bias over each
    query and key head that every head shares (``qk_norm``: ``qk_norm_kind=layernorm``,
    ``qk_norm_bias``), RoPE on the first ``rope_fraction`` of each head (rotate-half pairs),
    a squared-ReLU MLP with biases (``relu2``), an untied head."""
    return ModelConfig(
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
        d_model=d_model,
        n_layers=n_layers,
        attention=AttentionConfig(
            n_heads=n_heads,
            qkv_bias=True,
            out_bias=True,
            qk_norm=True,
            qk_norm_kind="layernorm",
            qk_norm_bias=True,
        ),
        position=PositionConfig(
            kind="rope", rope_theta=rope_theta, rope_layout="split", rope_fraction=rope_fraction
        ),
        ffn=FFNConfig(kind="mlp", activation="relu2", hidden_dim=ffn_hidden, bias=True),
        norm=NormConfig(kind="layernorm", eps=1e-5, bias=True, placement="pre"),
        tie_embeddings=False,
    )


def persimmon_tiny() -> ModelConfig:
    """Persimmon's architecture in 2 layers, d_model 64, 4 heads of 16 (half of each
    rotated), QK LayerNorm, squared ReLU: CPU-trainable, for tests."""
    return persimmon_style(
        vocab_size=256, max_seq_len=128, d_model=64, n_layers=2, n_heads=4, ffn_hidden=256,
        rope_theta=10000.0,
    )  # fmt: skip


def persimmon_8b() -> ModelConfig:
    """adept/persimmon-8b-base (recalled from its config.json, not read here:
    tests/test_analysis.py checks the count against transformers' PersimmonForCausalLM of
    the same config.json): d_model 4096, 36 layers, 64 heads of 64, MLP 16384, 262,144-token
    vocabulary, 16k context, half of each head rotated at base 25000; 9,397,175,296
    parameters (its name rounds down)."""
    return persimmon_style(
        vocab_size=262144, max_seq_len=16384, d_model=4096, n_layers=36, n_heads=64,
        ffn_hidden=16384, rope_theta=25000.0,
    )  # fmt: skip


def nemotron_style(
    *,
    vocab_size: int,
    max_seq_len: int,
    d_model: int,
    n_layers: int,
    n_heads: int,
    ffn_hidden: int,
    n_kv_heads: int | None = None,
    head_dim: int | None = None,
    rope_fraction: float = 0.5,
) -> ModelConfig:
    """Nemotron (NVIDIA's Nemotron-3, Minitron): pre-norm blocks of LayerNorms whose weight
    is stored as its offset from one (``norm.kind=layernorm1p``, with biases), q/k/v/o
    projections without biases (GQA where ``n_kv_heads``), RoPE of base 10000 on the first
    ``rope_fraction`` of each head (rotate-half pairs), a squared-ReLU MLP without biases
    (``relu2``, not gated), an untied head."""
    return ModelConfig(
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
        d_model=d_model,
        n_layers=n_layers,
        attention=AttentionConfig(n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim),
        position=PositionConfig(
            kind="rope", rope_theta=10000.0, rope_layout="split", rope_fraction=rope_fraction
        ),
        ffn=FFNConfig(kind="mlp", activation="relu2", hidden_dim=ffn_hidden, bias=False),
        norm=NormConfig(kind="layernorm1p", eps=1e-5, bias=True, placement="pre"),
        tie_embeddings=False,
    )


def nemotron_tiny() -> ModelConfig:
    """Nemotron's architecture in 2 layers, d_model 64, GQA 4/2 heads of 16 (half of each
    rotated), unit-offset LayerNorms, squared ReLU: CPU-trainable, for tests."""
    return nemotron_style(
        vocab_size=256, max_seq_len=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
        ffn_hidden=256,
    )  # fmt: skip


# nvidia/Minitron-4B-Base and Minitron-8B-Base config.json (recalled, not read here;
# tests/test_analysis.py checks each count against transformers' NemotronForCausalLM of the
# same config.json): d_model, layers, heads, key/value heads, head dim, MLP width. Both have
# a 256,000-token vocabulary, 4096 positions, half of each head rotated at base 10000.
MINITRON_SIZES = {
    "minitron-4b": (3072, 32, 24, 8, 128, 9216),  # 4,190,509,056
    "minitron-8b": (4096, 32, 48, 8, 128, 16384),  # 8,271,699,968
}


def minitron(name: str) -> ModelConfig:
    """nvidia/Minitron-4B-Base or Minitron-8B-Base (:data:`MINITRON_SIZES`): Nemotron-4
    15B pruned and distilled."""
    d, n_layers, n_heads, n_kv_heads, head_dim, ffn = MINITRON_SIZES[name]
    return nemotron_style(
        vocab_size=256000, max_seq_len=4096, d_model=d, n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=n_kv_heads, head_dim=None if head_dim * n_heads == d else head_dim,
        ffn_hidden=ffn,
    )  # fmt: skip


def phi3_tiny() -> ModelConfig:
    """Phi-3's architecture (the LLaMA layout with LongRoPE, as Phi-3-mini-128k's) in 2
    layers, d_model 64, GQA 4/2: a context of 128 stretched 4x from 32 by per-pair factors
    of its own (short ones near 1, long ones from 1 to 4), for tests."""
    cfg = llama_style(
        vocab_size=256,
        max_seq_len=128,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden=128,
    )
    return cfg.override(
        {
            "position.rope_scaling": "longrope",
            "position.rope_original_max_seq_len": 32,
            "position.rope_factor": 4.0,  # max_seq_len / rope_original_max_seq_len
            "position.rope_short_factor": [1.0, 1.0, 1.02, 1.05, 1.1, 1.2, 1.3, 1.5],
            "position.rope_long_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.6, 3.3, 4.0],
        }
    )


def phi_3_mini_4k() -> ModelConfig:
    """microsoft/Phi-3-mini-4k-instruct config.json: 32 layers, 32 heads of 96 (MHA), a
    window of 2047 on every layer, 4k context, no RoPE scaling; 3.82B parameters (its
    weights store q/k/v and gate/up fused: the same numbers)."""
    cfg = llama_style(
        vocab_size=32064,
        max_seq_len=4096,
        d_model=3072,
        n_layers=32,
        n_heads=32,
        ffn_hidden=8192,
    )
    return cfg.override({"attention.sliding_window": 2047})


def gpt_neox_style(
    *,
    d_model: int,
    n_layers: int,
    n_heads: int,
    vocab_size: int = 50304,
    max_seq_len: int = 2048,
    rope_fraction: float = 0.25,
    parallel: bool = True,
) -> ModelConfig:
    """GPT-NeoX (Black et al. 2022) and Pythia (Biderman et al. 2023): attention and a GELU
    MLP of 4d side by side on each block's input, each after its own LayerNorm
    (``norm.placement='parallel'``; ``parallel=False``: sequential pre-norm), biases
    everywhere, RoPE of base 10000 on the first quarter of each head (rotate-half pairs),
    MHA, an untied head."""
    return ModelConfig(
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
        d_model=d_model,
        n_layers=n_layers,
        attention=AttentionConfig(n_heads=n_heads, qkv_bias=True, out_bias=True),
        position=PositionConfig(
            kind="rope", rope_theta=10000.0, rope_layout="split", rope_fraction=rope_fraction
        ),
        ffn=FFNConfig(kind="mlp", activation="gelu", hidden_dim=4 * d_model, bias=True),
        norm=NormConfig(
            kind="layernorm", eps=1e-5, bias=True, placement="parallel" if parallel else "pre"
        ),
        tie_embeddings=False,
    )


def pythia_tiny() -> ModelConfig:
    """Pythia's architecture in 2 layers, d_model 64, 4 heads of 16 (4 features of each
    rotated): CPU-trainable, for tests."""
    return gpt_neox_style(vocab_size=256, max_seq_len=128, d_model=64, n_layers=2, n_heads=4)


# EleutherAI/pythia-* config.json (recalled, not read here; tests/test_analysis.py checks
# each against transformers' GPTNeoXForCausalLM of the same config.json, and the totals
# against those of the Pythia paper's Table 1): d_model, layers, heads, vocabulary.
PYTHIA_SIZES = {
    "70m": (512, 6, 8, 50304),  # 70,426,624 parameters
    "160m": (768, 12, 12, 50304),  # 162,322,944
    "410m": (1024, 24, 16, 50304),  # 405,334,016
    "1b": (2048, 16, 8, 50304),  # 1,011,781,632
    "1.4b": (2048, 24, 16, 50304),  # 1,414,647,808
    "2.8b": (2560, 32, 32, 50304),  # 2,775,208,960
    "6.9b": (4096, 32, 32, 50432),  # 6,857,302,016
    "12b": (5120, 36, 40, 50688),  # 11,846,072,320
}


def pythia(size: str) -> ModelConfig:
    """EleutherAI/pythia-``size``: 2048-token context, parallel blocks, a quarter of each
    head rotated, MLP of 4d (:data:`PYTHIA_SIZES`)."""
    d, n_layers, n_heads, vocab = PYTHIA_SIZES[size]
    return gpt_neox_style(d_model=d, n_layers=n_layers, n_heads=n_heads, vocab_size=vocab)


def phi_style(
    *,
    d_model: int,
    n_layers: int,
    n_heads: int,
    vocab_size: int = 51200,
    max_seq_len: int = 2048,
    rope_fraction: float = 0.5,
) -> ModelConfig:
    """Phi-1, Phi-1.5 and Phi-2 (Gunasekar et al. 2023; Li et al. 2023): attention and a
    tanh-GELU MLP of 4d side by side on one LayerNorm of each block's input
    (``norm.placement='parallel_shared'``), biases everywhere and on the head
    (``final_logits_bias``), RoPE of base 10000 on the first ``rope_fraction`` of each head
    (rotate-half pairs), MHA, an untied head."""
    return ModelConfig(
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
        d_model=d_model,
        n_layers=n_layers,
        attention=AttentionConfig(n_heads=n_heads, qkv_bias=True, out_bias=True),
        position=PositionConfig(
            kind="rope", rope_theta=10000.0, rope_layout="split", rope_fraction=rope_fraction
        ),
        ffn=FFNConfig(kind="mlp", activation="gelu_tanh", hidden_dim=4 * d_model, bias=True),
        norm=NormConfig(kind="layernorm", eps=1e-5, bias=True, placement="parallel_shared"),
        tie_embeddings=False,
        final_logits_bias=True,
    )


def phi_tiny() -> ModelConfig:
    """Phi's architecture in 2 layers, d_model 64, 4 heads of 16 (half of each rotated):
    CPU-trainable, for tests."""
    return phi_style(vocab_size=256, max_seq_len=128, d_model=64, n_layers=2, n_heads=4)


# microsoft/phi-1, phi-1_5 and phi-2 config.json (recalled, not read here;
# tests/test_analysis.py checks each against transformers' PhiForCausalLM of the same
# config.json): d_model, layers, heads, rotated fraction. Phi-1.5 has Phi-1's architecture
# (Li et al. 2023, Sec. 2.1); all three have a 51200-token vocabulary and 2048 positions.
PHI_SIZES = {
    "phi-1": (2048, 24, 32, 0.5),  # 1,418,270,720 parameters
    "phi-1.5": (2048, 24, 32, 0.5),  # 1,418,270,720
    "phi-2": (2560, 32, 32, 0.4),  # 2,779,683,840
}


def gptj_style(
    *,
    d_model: int,
    n_layers: int,
    n_heads: int,
    vocab_size: int = 50400,
    max_seq_len: int = 2048,
    rope_fraction: float = 0.25,
) -> ModelConfig:
    """GPT-J (Wang and Komatsuzaki 2021): Phi's parallel block on one shared LayerNorm with a
    tanh-GELU MLP of 4d (biases there, none in the attention), RoPE of base 10000 on the
    first ``rope_fraction`` of each head in adjacent pairs (``rope_layout='interleaved'``),
    MHA, an untied head with a bias (``final_logits_bias``)."""
    cfg = phi_style(
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
        rope_fraction=rope_fraction,
    )
    return cfg.override(
        {
            "attention.qkv_bias": False,
            "attention.out_bias": False,
            "position.rope_layout": "interleaved",
        }
    )


def gptj_tiny() -> ModelConfig:
    """GPT-J's architecture in 2 layers, d_model 64, 4 heads of 16 (the first 4 features of
    each rotated): CPU-trainable, for tests."""
    return gptj_style(vocab_size=256, max_seq_len=128, d_model=64, n_layers=2, n_heads=4)


def gpt_j_6b() -> ModelConfig:
    """EleutherAI/gpt-j-6b config.json (recalled, not read here; tests/test_analysis.py
    checks it against transformers' GPTJForCausalLM of the same config.json): d_model 4096,
    28 layers, 16 heads of 256 with rotary_dim 64, a 50400-token vocabulary (padded from
    GPT-2's 50257), 2048 positions. transformers counts 6,050,882,784 parameters; the
    original release's 6,053,381,344 counts 2,498,560 more."""
    return gptj_style(d_model=4096, n_layers=28, n_heads=16)


def phi(name: str) -> ModelConfig:
    """microsoft/``name`` (:data:`PHI_SIZES`): parallel blocks with one shared norm, 32
    rotated features of each head."""
    d, n_layers, n_heads, fraction = PHI_SIZES[name]
    return phi_style(d_model=d, n_layers=n_layers, n_heads=n_heads, rope_fraction=fraction)


def falcon_style(
    *,
    d_model: int,
    n_layers: int,
    n_heads: int,
    n_kv_heads: int = 1,
    vocab_size: int = 65024,
    max_seq_len: int = 2048,
    placement: str = "parallel_shared",
) -> ModelConfig:
    """Falcon (Almazrouei et al. 2023): attention and a GELU MLP of 4d side by side on each
    block's input, after one shared LayerNorm (Falcon-7B, ``parallel_shared``) or one each
    (Falcon-40B and 180B, ``parallel``), one key/value head (multi-query) or a few groups,
    RoPE of base 10000 on whole heads (rotate-half pairs), no linear biases, a head tied to
    the embedding."""
    return ModelConfig(
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
        d_model=d_model,
        n_layers=n_layers,
        attention=AttentionConfig(
            n_heads=n_heads,
            n_kv_heads=None if n_kv_heads == n_heads else n_kv_heads,
            qkv_bias=False,
            out_bias=False,
        ),
        position=PositionConfig(kind="rope", rope_theta=10000.0, rope_layout="split"),
        ffn=FFNConfig(kind="mlp", activation="gelu", hidden_dim=4 * d_model, bias=False),
        norm=NormConfig(kind="layernorm", eps=1e-5, bias=True, placement=placement),
        tie_embeddings=True,
    )


def falcon_tiny() -> ModelConfig:
    """Falcon-7B's architecture (one shared norm, multi-query attention) in 2 layers,
    d_model 64, 4 query heads of 16 and one key/value head: CPU-trainable, for tests."""
    return falcon_style(vocab_size=256, max_seq_len=128, d_model=64, n_layers=2, n_heads=4)


def falcon_7b() -> ModelConfig:
    """tiiuae/falcon-7b config.json (recalled, not read here; tests/test_analysis.py checks
    the count against transformers' FalconForCausalLM of that config.json): 32 layers,
    d_model 4544, 71 query heads of 64 and one key/value head, one shared norm, the
    65024-token vocabulary, a tied head; 6.92B parameters (7.22B with the head counted
    apart from the embedding, as a safetensors file that stores both reports it)."""
    return falcon_style(d_model=4544, n_layers=32, n_heads=71)


def falcon_40b() -> ModelConfig:
    """tiiuae/falcon-40b config.json (recalled, not read here; checked as falcon-7b is):
    the new decoder architecture, 60 layers, d_model 8192, 128 query heads of 64 in 8
    key/value groups, two norms per block, a tied head; 41.30B parameters (41.84B with the
    head counted apart)."""
    return falcon_style(d_model=8192, n_layers=60, n_heads=128, n_kv_heads=8, placement="parallel")


def opt_style(
    *,
    d_model: int,
    n_layers: int,
    n_heads: int,
    vocab_size: int = 50272,
    max_seq_len: int = 2048,
    dropout: float = 0.1,
) -> ModelConfig:
    """OPT (Zhang et al. 2022): GPT-2's pre-norm decoder with learned positions (transformers'
    table holds two offset rows more: see ``attnlab/interop/opt.py``), LayerNorms of eps
    1e-5, biases everywhere, MHA with separate q/k/v projections, a ReLU MLP of 4d and a
    head tied to the embedding; ``dropout`` on each sublayer's output (0.1 in the released
    configs; attnlab also drops the embeddings)."""
    return ModelConfig(
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
        d_model=d_model,
        n_layers=n_layers,
        attention=AttentionConfig(n_heads=n_heads, qkv_bias=True, out_bias=True),
        position=PositionConfig(kind="learned"),
        ffn=FFNConfig(kind="mlp", activation="relu", hidden_dim=4 * d_model, bias=True),
        norm=NormConfig(kind="layernorm", eps=1e-5, bias=True, placement="pre"),
        tie_embeddings=True,
        dropout=dropout,
    )


def opt_tiny() -> ModelConfig:
    """OPT's architecture in 2 layers, d_model 64, 4 heads of 16, 128 positions:
    CPU-trainable, for tests."""
    return opt_style(
        vocab_size=256, max_seq_len=128, d_model=64, n_layers=2, n_heads=4, dropout=0.0
    )


# facebook/opt-* config.json (recalled, not read here; the sizes are the OPT paper's,
# Zhang et al. 2022, Table 1; tests/test_interop_opt.py checks each count against
# transformers' OPTForCausalLM of the same config.json): d_model, layers, heads. All have
# a 50272-token vocabulary, 2048 positions, a ReLU MLP of 4 d, pre-norm blocks and a tied
# head. (opt-350m is left out: its 512-wide embeddings projected to d_model 1024 and its
# post-norm blocks without a final norm are beyond attnlab's embeddings.) attnlab's counts
# are transformers' less the position table's 2 offset rows (2 d).
OPT_SIZES = {
    "125m": (768, 12, 12),  # 125,239,296 parameters (transformers' count)
    "1.3b": (2048, 24, 32),  # 1,315,758,080
    "2.7b": (2560, 32, 32),  # 2,651,596,800
    "6.7b": (4096, 32, 32),  # 6,658,473,984
    "13b": (5120, 40, 40),  # 12,853,473,280
    "30b": (7168, 48, 56),  # 29,974,540,288
    "66b": (9216, 64, 72),  # 65,719,701,504
}


def opt(size: str) -> ModelConfig:
    """facebook/opt-``size`` (:data:`OPT_SIZES`)."""
    d, n_layers, n_heads = OPT_SIZES[size]
    return opt_style(d_model=d, n_layers=n_layers, n_heads=n_heads)


def falcon_rw_1b() -> ModelConfig:
    """tiiuae/falcon-rw-1b config.json (recalled, not read here; tests/test_analysis.py
    checks the count against transformers' FalconForCausalLM of that config.json): Falcon's
    sequential blocks (``parallel_attn`` false, the old architecture), 24 layers, d_model
    2048, 32 heads of 64 each with its own key/value head, ALiBi scaled with q . k and
    rounded to bfloat16 (``alibi`` true), biases on every linear layer, the 50304-token
    vocabulary, a tied head; 1.31B parameters."""
    return ModelConfig(
        vocab_size=50304,
        max_seq_len=2048,
        d_model=2048,
        n_layers=24,
        attention=AttentionConfig(n_heads=32, qkv_bias=True, out_bias=True),
        position=PositionConfig(kind="alibi", alibi_scaled=True, alibi_bfloat16=True),
        ffn=FFNConfig(kind="mlp", activation="gelu", hidden_dim=4 * 2048, bias=True),
        norm=NormConfig(kind="layernorm", eps=1e-5, bias=True, placement="pre"),
        tie_embeddings=True,
    )


def bloom_style(
    *,
    d_model: int,
    n_layers: int,
    n_heads: int,
    vocab_size: int = 250880,
    max_seq_len: int = 2048,
) -> ModelConfig:
    """BLOOM (BigScience 2022): ALiBi biases (largest 8) added after the softmax scale, a
    LayerNorm on the token embeddings, pre-norm blocks with biased LayerNorms, q/k/v and
    output projections, a 4d MLP with the tanh GELU, a head tied to the embedding. ALiBi has
    no context limit: ``max_seq_len`` (2048, BLOOM's training sequences) is the default
    cache size."""
    return ModelConfig(
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
        d_model=d_model,
        n_layers=n_layers,
        attention=AttentionConfig(n_heads=n_heads, qkv_bias=True, out_bias=True),
        position=PositionConfig(kind="alibi", alibi_max_bias=8.0),
        ffn=FFNConfig(kind="mlp", activation="gelu_tanh", hidden_dim=4 * d_model, bias=True),
        norm=NormConfig(kind="layernorm", eps=1e-5, bias=True, placement="pre"),
        embedding_norm=True,
        tie_embeddings=True,
    )


def bloom_tiny() -> ModelConfig:
    """BLOOM's architecture in 2 layers, d_model 64, 4 heads of 16 (slopes 1/4, 1/16, 1/64,
    1/256), a 256-token vocabulary: CPU-trainable, for tests."""
    return bloom_style(vocab_size=256, max_seq_len=128, d_model=64, n_layers=2, n_heads=4)


# bigscience/bloom-* config.json (recalled, not read here; tests/test_analysis.py checks
# each count against transformers' BloomForCausalLM of that config.json): size ->
# (hidden_size, n_layer, n_head), every one with the 250880-token vocabulary; the counts are
# the model cards' 559,214,592 ... 176,247,271,424.
BLOOM_SIZES: dict[str, tuple[int, int, int]] = {
    "560m": (1024, 24, 16),
    "1b1": (1536, 24, 16),
    "1b7": (2048, 24, 16),
    "3b": (2560, 30, 32),
    "7b1": (4096, 30, 32),
    "176b": (14336, 70, 112),
}


def bloom(size: str) -> ModelConfig:
    """bigscience/bloom-``size`` (:data:`BLOOM_SIZES`; the 176B model is bigscience/bloom)."""
    d, n_layers, n_heads = BLOOM_SIZES[size]
    return bloom_style(d_model=d, n_layers=n_layers, n_heads=n_heads)


def mpt_style(
    *,
    d_model: int,
    n_layers: int,
    n_heads: int,
    vocab_size: int = 50432,
    max_seq_len: int = 2048,
) -> ModelConfig:
    """MPT (MosaicML 2023): ALiBi biases (largest 8) added after the softmax scale, no norm
    on the embeddings, pre-norm blocks, no biases anywhere (LayerNorms included), a fused
    q/k/v projection, a 4d MLP with the exact GELU, a head tied to the embedding. ALiBi has
    no context limit: ``max_seq_len`` (the training sequences) is the default cache size."""
    return ModelConfig(
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
        d_model=d_model,
        n_layers=n_layers,
        attention=AttentionConfig(n_heads=n_heads),
        position=PositionConfig(kind="alibi", alibi_max_bias=8.0),
        ffn=FFNConfig(kind="mlp", activation="gelu", hidden_dim=4 * d_model, bias=False),
        norm=NormConfig(kind="layernorm", eps=1e-5, bias=False, placement="pre"),
        tie_embeddings=True,
    )


def mpt_tiny() -> ModelConfig:
    """MPT's architecture in 2 layers, d_model 64, 4 heads of 16 (slopes 1/4, 1/16, 1/64,
    1/256), a 256-token vocabulary: CPU-trainable, for tests."""
    return mpt_style(vocab_size=256, max_seq_len=128, d_model=64, n_layers=2, n_heads=4)


# mosaicml/mpt-* config.json (recalled, not read here; tests/test_analysis.py checks each
# count against transformers' MptForCausalLM of that config.json): size -> (d_model,
# n_layers, n_heads, max_seq_len), both with the 50432-token vocabulary, expansion_ratio 4
# and alibi_bias_max 8.
MPT_SIZES: dict[str, tuple[int, int, int, int]] = {
    "7b": (4096, 32, 32, 2048),  # 6,649,286,656
    "30b": (7168, 48, 64, 8192),  # 29,957,200,896
}


def mpt(size: str) -> ModelConfig:
    """mosaicml/mpt-``size`` (:data:`MPT_SIZES`)."""
    d, n_layers, n_heads, context = MPT_SIZES[size]
    return mpt_style(d_model=d, n_layers=n_layers, n_heads=n_heads, max_seq_len=context)


def bigcode_style(
    *,
    d_model: int,
    n_layers: int,
    n_heads: int,
    vocab_size: int = 49152,
    max_seq_len: int = 8192,
    dropout: float = 0.1,
) -> ModelConfig:
    """GPT-BigCode (SantaCoder, StarCoder): GPT-2's pre-norm decoder (learned positions,
    biased LayerNorms and projections, a tanh-GELU MLP of 4d, a tied head) with multi-query
    attention, one key/value head shared by every query head. ``dropout`` on the embeddings,
    each sublayer's output and the attention weights (0.1 in the released configs)."""
    return ModelConfig(
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
        d_model=d_model,
        n_layers=n_layers,
        attention=AttentionConfig(
            n_heads=n_heads, n_kv_heads=1, qkv_bias=True, out_bias=True, dropout=dropout
        ),
        position=PositionConfig(kind="learned"),
        ffn=FFNConfig(kind="mlp", activation="gelu_tanh", hidden_dim=4 * d_model, bias=True),
        norm=NormConfig(kind="layernorm", eps=1e-5, bias=True, placement="pre"),
        tie_embeddings=True,
        dropout=dropout,
    )


def bigcode_tiny() -> ModelConfig:
    """GPT-BigCode's architecture in 2 layers, d_model 64, 4 query heads of 16 sharing one
    key/value head, 128 positions, a 256-token vocabulary, no dropout: CPU-trainable, for
    tests."""
    return bigcode_style(
        vocab_size=256, max_seq_len=128, d_model=64, n_layers=2, n_heads=4, dropout=0.0
    )


# bigcode/* config.json (recalled, not read here; tests/test_interop_gpt_bigcode.py checks
# each count against transformers' GPTBigCodeForCausalLM of that config.json): name ->
# (n_embd, n_layer, n_head, vocab_size, n_positions), every one multi-query with an MLP of
# 4 n_embd, the tanh GELU, dropouts of 0.1 and no tie_word_embeddings key (a tied head).
# The counts are transformers' of these configs.
BIGCODE_SIZES: dict[str, tuple[int, int, int, int, int]] = {
    "gpt_bigcode-santacoder": (2048, 24, 16, 49280, 2048),  # 1,124,886,528 parameters
    "starcoderbase-1b": (2048, 24, 16, 49152, 8192),  # 1,137,207,296
    "starcoderbase-3b": (2816, 36, 22, 49152, 8192),  # 3,043,311,104
    "starcoderbase-7b": (4096, 42, 32, 49152, 8192),  # 7,327,263,232
    "starcoder": (6144, 40, 48, 49152, 8192),  # 15,517,456,384 (StarCoderBase's too)
}


def bigcode(name: str) -> ModelConfig:
    """bigcode/``name`` (:data:`BIGCODE_SIZES`)."""
    d, n_layers, n_heads, vocab_size, max_seq_len = BIGCODE_SIZES[name]
    return bigcode_style(
        d_model=d,
        n_layers=n_layers,
        n_heads=n_heads,
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
    )


def t5_style(
    *,
    d_model: int,
    n_layers: int,
    n_heads: int,
    ffn_hidden: int,
    gated: bool = False,
    head_dim: int = 64,
    vocab_size: int = 32128,
    max_seq_len: int = 512,
    relative_buckets: int = 32,
    relative_max_distance: int = 128,
    dropout: float = 0.1,
) -> ModelConfig:
    """T5 (Raffel et al. 2020): a pre-norm encoder–decoder with RMSNorm, no biases, unscaled
    scores, heads of ``head_dim`` whatever d_model, a learned relative position bias per
    stack, one shared vocabulary. v1.0 (``gated`` false): a ReLU MLP and the tied head, which
    reads d^-1/2 times the decoder's output; v1.1 / Flan-T5 (``gated``): a GeGLU with the
    tanh GELU and a head of its own. ``max_seq_len``: the decoding cache's default capacity
    (T5 has no limit on positions)."""
    from attnlab.models.seq2seq import Seq2SeqConfig

    return Seq2SeqConfig(
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
        d_model=d_model,
        n_layers=n_layers,
        attention=AttentionConfig(n_heads=n_heads, head_dim=head_dim, scale=1.0, dropout=dropout),
        position=PositionConfig(
            kind="relative_bias",
            relative_buckets=relative_buckets,
            relative_max_distance=relative_max_distance,
        ),
        ffn=FFNConfig(
            kind="glu" if gated else "mlp",
            activation="gelu_tanh" if gated else "relu",
            hidden_dim=ffn_hidden,
            bias=False,
        ),
        norm=NormConfig(kind="rmsnorm", eps=1e-6, placement="pre"),
        tie_embeddings=not gated,
        scale_decoder_output=not gated,
        dropout=dropout,
        scale_embeddings=False,
        final_norm=True,
        pad_id=0,
        bos_id=0,  # the decoder starts from the pad token
        eos_id=1,
    )


def t5_tiny() -> ModelConfig:
    """T5 v1.0's architecture in 2 + 2 layers, d_model 64, 4 heads of 16, 16 buckets up to
    distance 32, a 128-token vocabulary: CPU-trainable, for tests."""
    return t5_style(d_model=64, n_layers=2, n_heads=4, ffn_hidden=128, head_dim=16,
                    vocab_size=128, max_seq_len=128, relative_buckets=16,
                    relative_max_distance=32, dropout=0.0)  # fmt: skip


# The published sizes below are recalled from the google-t5/* and google/flan-t5-* config.json
# files (no download here); tests check their parameter counts against transformers' models of
# the same configs, and t5-small's against its published 60.5M.
def t5_small() -> ModelConfig:
    """google-t5/t5-small: 6 + 6 layers, d_model 512, 8 heads of 64, ReLU MLP of 2048."""
    return t5_style(d_model=512, n_layers=6, n_heads=8, ffn_hidden=2048)


def t5_base() -> ModelConfig:
    """google-t5/t5-base: 12 + 12 layers, d_model 768, 12 heads of 64, ReLU MLP of 3072."""
    return t5_style(d_model=768, n_layers=12, n_heads=12, ffn_hidden=3072)


def t5_large() -> ModelConfig:
    """google-t5/t5-large: 24 + 24 layers, d_model 1024, 16 heads of 64, ReLU MLP of 4096."""
    return t5_style(d_model=1024, n_layers=24, n_heads=16, ffn_hidden=4096)


def flan_t5_small() -> ModelConfig:
    """google/flan-t5-small (T5 v1.1 small's architecture): 8 + 8 layers, d_model 512,
    6 heads of 64 (inner width 384), GeGLU of 1024, untied head."""
    return t5_style(d_model=512, n_layers=8, n_heads=6, ffn_hidden=1024, gated=True)


def flan_t5_base() -> ModelConfig:
    """google/flan-t5-base (T5 v1.1 base's architecture): 12 + 12 layers, d_model 768,
    12 heads of 64, GeGLU of 2048, untied head."""
    return t5_style(d_model=768, n_layers=12, n_heads=12, ffn_hidden=2048, gated=True)


# mT5's sizes, recalled from the google/mt5-* config.json files as the Flan-T5 ones (no
# download here): T5 v1.1's architecture with a 250112-token vocabulary (most of the
# parameters: the embedding and the head of its own). Tests check the counts against
# transformers' MT5ForConditionalGeneration of the same configs, and against the paper's
# 300M and 580M (Xue et al. 2021, Table 1; recalled, rounded there).
MT5_VOCAB = 250112


def mt5_small() -> ModelConfig:
    """google/mt5-small: 8 + 8 layers, d_model 512, 6 heads of 64, GeGLU of 1024, untied
    head, a 250112-token vocabulary."""
    return t5_style(
        d_model=512, n_layers=8, n_heads=6, ffn_hidden=1024, gated=True, vocab_size=MT5_VOCAB
    )


def mt5_base() -> ModelConfig:
    """google/mt5-base: 12 + 12 layers, d_model 768, 12 heads of 64, GeGLU of 2048, untied
    head, a 250112-token vocabulary."""
    return t5_style(
        d_model=768, n_layers=12, n_heads=12, ffn_hidden=2048, gated=True, vocab_size=MT5_VOCAB
    )


def bart_style(
    *,
    d_model: int,
    n_layers: int,
    n_heads: int,
    ffn_hidden: int,
    vocab_size: int = 50265,
    max_seq_len: int = 1024,
    multilingual: bool = False,
    dropout: float = 0.1,
) -> ModelConfig:
    """BART (Lewis et al. 2020): an encoder–decoder with learned positions (transformers'
    tables start 2 rows in: ``position_offset``), a LayerNorm on the embeddings, post-norm
    blocks with exact-GELU MLPs, one tied vocabulary and a final logits bias. ``multilingual``:
    mBART (Liu et al. 2020): pre-norm blocks with a final norm per stack and embeddings scaled
    by sqrt(d). Special tokens: BartConfig's defaults (pad 1, end 2, decoding starts from 2
    and length-limited outputs end with it); for mBART, whose class gives no start token,
    generate's fallback, bos 0. Published checkpoints' config.json may add more (bart-large's
    ``forced_bos_token_id``), which import reads."""
    from attnlab.models.seq2seq import Seq2SeqConfig

    return Seq2SeqConfig(
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
        d_model=d_model,
        n_layers=n_layers,
        attention=AttentionConfig(n_heads=n_heads, qkv_bias=True, out_bias=True),
        position=PositionConfig(kind="learned"),
        position_offset=2,
        ffn=FFNConfig(kind="mlp", activation="gelu", hidden_dim=ffn_hidden),
        norm=NormConfig(kind="layernorm", eps=1e-5, placement="pre" if multilingual else "post"),
        final_norm=multilingual,
        embedding_norm=True,
        tie_embeddings=True,
        scale_embeddings=multilingual,
        final_logits_bias=True,
        dropout=dropout,
        pad_id=1,
        bos_id=0 if multilingual else 2,
        eos_id=2,
        forced_eos_ids=[2],
    )


def bart_tiny() -> ModelConfig:
    """BART's architecture in 2 + 2 layers, d_model 64, 4 heads of 16, an MLP of 128, a
    128-token vocabulary: CPU-trainable, for tests."""
    return bart_style(d_model=64, n_layers=2, n_heads=4, ffn_hidden=128, vocab_size=128,
                      max_seq_len=128, dropout=0.0)  # fmt: skip


# The published sizes below are recalled from the facebook/bart-* and facebook/mbart-*
# config.json files (no download here; dropout rates and generation settings not claimed);
# tests check their parameter counts against transformers' models of the same configs.
def bart_base() -> ModelConfig:
    """facebook/bart-base: 6 + 6 layers, d_model 768, 12 heads of 64, GELU MLP of 3072,
    50265-token vocabulary, 1024 positions."""
    return bart_style(d_model=768, n_layers=6, n_heads=12, ffn_hidden=3072)


def bart_large() -> ModelConfig:
    """facebook/bart-large: 12 + 12 layers, d_model 1024, 16 heads of 64, GELU MLP of 4096,
    50265-token vocabulary, 1024 positions."""
    return bart_style(d_model=1024, n_layers=12, n_heads=16, ffn_hidden=4096)


def mbart_large_cc25() -> ModelConfig:
    """facebook/mbart-large-cc25: bart-large's sizes, pre-norm, scaled embeddings, a
    250027-token vocabulary (25 languages)."""
    return bart_style(d_model=1024, n_layers=12, n_heads=16, ffn_hidden=4096,
                      vocab_size=250027, multilingual=True)  # fmt: skip


def mbart_large_50() -> ModelConfig:
    """facebook/mbart-large-50: mbart-large-cc25 with a 250054-token vocabulary (50
    languages)."""
    return bart_style(d_model=1024, n_layers=12, n_heads=16, ffn_hidden=4096,
                      vocab_size=250054, multilingual=True)  # fmt: skip


def m2m100_style(
    *,
    d_model: int,
    n_layers: int,
    n_heads: int,
    ffn_hidden: int,
    vocab_size: int = 128112,
    max_seq_len: int = 1024,
    dropout: float = 0.1,
) -> ModelConfig:
    """M2M100 (Fan et al. 2020) and NLLB-200: an encoder–decoder with fixed sinusoids counted
    past the padding id (``position.padding_idx``: padding never shifts a row's positions) in
    tensor2tensor's layout, pre-norm blocks with a final norm per stack, ReLU MLPs, embeddings
    scaled by sqrt(d), one tied vocabulary, no logits bias. Special tokens: M2M100Config's
    defaults (pad 1, end 2, decoding starts from 2); the target language, forced as the first
    token, is ``forced_bos_id`` (given per translation in transformers, unset here)."""
    from attnlab.models.seq2seq import Seq2SeqConfig

    return Seq2SeqConfig(
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
        d_model=d_model,
        n_layers=n_layers,
        attention=AttentionConfig(n_heads=n_heads, qkv_bias=True, out_bias=True, dropout=dropout),
        position=PositionConfig(kind="sinusoidal", padding_idx=1),
        sinusoid_layout="tensor2tensor",
        ffn=FFNConfig(kind="mlp", activation="relu", hidden_dim=ffn_hidden),
        norm=NormConfig(kind="layernorm", eps=1e-5, placement="pre"),
        final_norm=True,
        tie_embeddings=True,
        scale_embeddings=True,
        dropout=dropout,
        pad_id=1,
        bos_id=2,
        eos_id=2,
    )


def m2m100_tiny() -> ModelConfig:
    """M2M100's architecture in 2 + 2 layers, d_model 64, 4 heads of 16, a ReLU MLP of 128, a
    128-token vocabulary: CPU-trainable, for tests."""
    return m2m100_style(d_model=64, n_layers=2, n_heads=4, ffn_hidden=128, vocab_size=128,
                        max_seq_len=128, dropout=0.0)  # fmt: skip


# The published sizes below are recalled from the facebook/m2m100_418M,
# facebook/nllb-200-distilled-600M and google/pegasus-large config.json files (no download
# here; dropout rates and generation settings not claimed); tests check their parameter
# counts against transformers' models of the same configs.
def m2m100_418m() -> ModelConfig:
    """facebook/m2m100_418M: 12 + 12 layers, d_model 1024, 16 heads of 64, ReLU MLP of 4096,
    a 128112-token vocabulary, 1024 positions."""
    return m2m100_style(d_model=1024, n_layers=12, n_heads=16, ffn_hidden=4096)


def nllb_200_distilled_600m() -> ModelConfig:
    """facebook/nllb-200-distilled-600M (M2M100's class): m2m100_418M's sizes with a
    256206-token vocabulary (200 languages)."""
    return m2m100_style(d_model=1024, n_layers=12, n_heads=16, ffn_hidden=4096,
                        vocab_size=256206)  # fmt: skip


def pegasus_style(
    *,
    d_model: int,
    n_layers: int,
    n_heads: int,
    ffn_hidden: int,
    vocab_size: int = 96103,
    max_seq_len: int = 1024,
    dropout: float = 0.1,
) -> ModelConfig:
    """Pegasus (Zhang et al. 2020): an encoder–decoder with Marian's split sinusoids, pre-norm
    blocks with a final norm per stack, ReLU MLPs, embeddings scaled by sqrt(d), one tied
    vocabulary and a final logits bias. Special tokens: the checkpoints' (pad 0, end 1,
    decoding starts from the pad token and length-limited outputs end with the end token)."""
    from attnlab.models.seq2seq import Seq2SeqConfig

    return Seq2SeqConfig(
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
        d_model=d_model,
        n_layers=n_layers,
        attention=AttentionConfig(n_heads=n_heads, qkv_bias=True, out_bias=True, dropout=dropout),
        position=PositionConfig(kind="sinusoidal"),
        sinusoid_layout="split",
        ffn=FFNConfig(kind="mlp", activation="relu", hidden_dim=ffn_hidden),
        norm=NormConfig(kind="layernorm", eps=1e-5, placement="pre"),
        final_norm=True,
        tie_embeddings=True,
        scale_embeddings=True,
        final_logits_bias=True,
        dropout=dropout,
        pad_id=0,
        bos_id=0,
        eos_id=1,
        forced_eos_ids=[1],
    )


def pegasus_tiny() -> ModelConfig:
    """Pegasus's architecture in 2 + 2 layers, d_model 64, 4 heads of 16, a ReLU MLP of 128, a
    128-token vocabulary: CPU-trainable, for tests."""
    return pegasus_style(d_model=64, n_layers=2, n_heads=4, ffn_hidden=128, vocab_size=128,
                         max_seq_len=128, dropout=0.0)  # fmt: skip


def pegasus_large() -> ModelConfig:
    """google/pegasus-large (recalled): 16 + 16 layers, d_model 1024, 16 heads of 64, ReLU MLP
    of 4096, a 96103-token vocabulary, 1024 positions."""
    return pegasus_style(d_model=1024, n_layers=16, n_heads=16, ffn_hidden=4096)


def modernbert_style(
    *,
    d_model: int,
    n_layers: int,
    n_heads: int,
    ffn_hidden: int,
    vocab_size: int = 50368,
    max_seq_len: int = 8192,
    window: int = 65,
    global_every: int = 3,
    rope_theta: float = 160_000.0,
    local_rope_theta: float = 10_000.0,
    pooling: str = "mean",
) -> ModelConfig:
    """ModernBERT (Warner et al. 2024), masked-LM head: a pre-norm encoder with RoPE, GeGLU,
    LayerNorms without bias and no biases anywhere but the decoder's, every
    ``global_every``-th layer global from layer 0 and the others local, attending within
    ``window - 1`` positions on either side (local_attention 2 (window - 1)) with RoPE of
    base ``local_rope_theta``; no norm before the first layer's attention (its input is the
    normed embeddings); heads of dense -> GELU -> LayerNorm; a tied decoder with a bias."""
    from attnlab.models.encoder import EncoderConfig

    return EncoderConfig(
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
        d_model=d_model,
        n_layers=n_layers,
        attention=AttentionConfig(
            n_heads=n_heads,
            sliding_window=window,
            layer_pattern="G" + "L" * (global_every - 1),
        ),
        position=PositionConfig(
            kind="rope", rope_theta=rope_theta, local_rope_theta=local_rope_theta
        ),
        ffn=FFNConfig(kind="glu", activation="gelu", hidden_dim=ffn_hidden, bias=False),
        norm=NormConfig(kind="layernorm", eps=1e-5, bias=False, placement="pre"),
        type_vocab_size=0,
        head="mlm",
        first_attn_norm=False,
        pooling=pooling,
        classifier_transform="dense_act_norm",
        head_bias=False,
        classifier_dropout=0.0,
    )


def modernbert_tiny() -> ModelConfig:
    """ModernBERT's architecture in 3 layers (global, local, local), d_model 64, a window of
    8 either side: CPU-trainable (``--set task=mlm``), for tests."""
    return modernbert_style(
        vocab_size=256,
        max_seq_len=128,
        d_model=64,
        n_layers=3,
        n_heads=4,
        ffn_hidden=96,
        window=9,
        rope_theta=10_000.0,
        local_rope_theta=1_000.0,
    )


def modernbert_base() -> ModelConfig:
    """answerdotai/ModernBERT-base config.json: 22 layers, 12 heads of 64, GeGLU 1152."""
    return modernbert_style(d_model=768, n_layers=22, n_heads=12, ffn_hidden=1152)


def modernbert_large() -> ModelConfig:
    """answerdotai/ModernBERT-large config.json: 28 layers, 16 heads of 64, GeGLU 2624."""
    return modernbert_style(d_model=1024, n_layers=28, n_heads=16, ffn_hidden=2624)


def roberta_style(
    *,
    d_model: int,
    n_layers: int,
    n_heads: int,
    ffn_hidden: int,
    vocab_size: int,
    max_seq_len: int = 512,
    padding_idx: int = 1,
    dropout: float = 0.1,
) -> ModelConfig:
    """RoBERTa (Liu et al. 2019), masked-LM head: BERT's post-norm encoder (GELU MLP, biases
    everywhere, LayerNorm eps 1e-5, one token type) with learned positions counted past the
    padding token ``padding_idx`` (max_position_embeddings = max_seq_len + padding_idx + 1),
    RoBERTa's classification head (dropout -> dense -> tanh -> dropout -> out_proj on <s>)
    and a tied decoder with a bias."""
    from attnlab.models.encoder import EncoderConfig

    return EncoderConfig(
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
        d_model=d_model,
        n_layers=n_layers,
        attention=AttentionConfig(n_heads=n_heads, qkv_bias=True, out_bias=True, dropout=dropout),
        position=PositionConfig(kind="learned", padding_idx=padding_idx),
        ffn=FFNConfig(kind="mlp", activation="gelu", hidden_dim=ffn_hidden),
        norm=NormConfig(kind="layernorm", eps=1e-5, placement="post"),
        type_vocab_size=1,
        dropout=dropout,
        head="mlm",
        classifier_transform="roberta",
    )


def roberta_tiny() -> ModelConfig:
    """RoBERTa's architecture in 2 layers, d_model 64, no dropout: CPU-trainable
    (``--set task=mlm``: the task gives the padding token an id of its own), for tests."""
    return roberta_style(
        vocab_size=256,
        max_seq_len=128,
        d_model=64,
        n_layers=2,
        n_heads=4,
        ffn_hidden=128,
        dropout=0.0,
    )


def deberta_v3_style(
    *,
    d_model: int,
    n_layers: int,
    n_heads: int,
    ffn_hidden: int,
    vocab_size: int = 128100,
    max_seq_len: int = 512,
    buckets: int = 256,
    dropout: float = 0.1,
) -> ModelConfig:
    """DeBERTa-v3 (He et al. 2021/2023), masked-LM head: BERT's post-norm encoder (GELU MLP,
    biases everywhere, LayerNorm eps 1e-7, no token types) with disentangled attention
    (``position.kind`` disentangled: c2p and p2c, relative positions log-bucketed into
    ``buckets`` per side up to max_seq_len, position keys and queries from the layers' own
    projections, a LayerNorm on the shared relative embeddings, no absolute positions), a
    tied decoder with a bias, and DeBERTa's ContextPooler for a sequence head (dense -> GELU,
    no tanh)."""
    from attnlab.models.encoder import EncoderConfig

    return EncoderConfig(
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
        d_model=d_model,
        n_layers=n_layers,
        attention=AttentionConfig(n_heads=n_heads, qkv_bias=True, out_bias=True, dropout=dropout),
        position=PositionConfig(
            kind="disentangled",
            disentangled_terms=["p2c", "c2p"],
            disentangled_buckets=buckets,
            disentangled_max_distance=max_seq_len,
            disentangled_share_key=True,
            disentangled_norm=True,
        ),
        ffn=FFNConfig(kind="mlp", activation="gelu", hidden_dim=ffn_hidden),
        norm=NormConfig(kind="layernorm", eps=1e-7, placement="post"),
        type_vocab_size=0,
        dropout=dropout,
        head="mlm",
        classifier_transform="context_pooler",
    )


def deberta_v3_tiny() -> ModelConfig:
    """DeBERTa-v3's architecture in 2 layers, d_model 64, 16 buckets per side over 128
    positions, no dropout: CPU-trainable (``--set task=mlm``), for tests."""
    return deberta_v3_style(
        vocab_size=256,
        max_seq_len=128,
        d_model=64,
        n_layers=2,
        n_heads=4,
        ffn_hidden=128,
        buckets=16,
        dropout=0.0,
    )


# The four published sizes below are recalled from the checkpoints' config.json files
# (microsoft/deberta-v3-xsmall, -small, -base, -large: vocab_size 128100,
# max_position_embeddings 512, position_buckets 256, relative_attention, share_att_key,
# pos_att_type "p2c|c2p", norm_rel_ebd "layer_norm", position_biased_input false,
# type_vocab_size 0, layer_norm_eps 1e-7), not read from them here (no download);
# tests/test_interop_deberta_v2.py checks each parameter count against transformers' model
# of the same config.


def deberta_v3_xsmall() -> ModelConfig:
    """deberta-v3-xsmall: 12 layers, 6 heads of 64 (d_model 384), MLP 1536."""
    return deberta_v3_style(d_model=384, n_layers=12, n_heads=6, ffn_hidden=1536)


def deberta_v3_small() -> ModelConfig:
    """deberta-v3-small: 6 layers, 12 heads of 64, MLP 3072."""
    return deberta_v3_style(d_model=768, n_layers=6, n_heads=12, ffn_hidden=3072)


def deberta_v3_base() -> ModelConfig:
    """deberta-v3-base: 12 layers, 12 heads of 64, MLP 3072."""
    return deberta_v3_style(d_model=768, n_layers=12, n_heads=12, ffn_hidden=3072)


def deberta_v3_large() -> ModelConfig:
    """deberta-v3-large: 24 layers, 16 heads of 64, MLP 4096."""
    return deberta_v3_style(d_model=1024, n_layers=24, n_heads=16, ffn_hidden=4096)


# The four published sizes below are recalled from the checkpoints' config.json files
# (FacebookAI/roberta-base, roberta-large, xlm-roberta-base, xlm-roberta-large:
# max_position_embeddings 514, pad_token_id 1, type_vocab_size 1, layer_norm_eps 1e-5),
# not read from them here (no download); tests/test_analysis.py checks each parameter count
# against transformers' model of the same config.


def roberta_base() -> ModelConfig:
    """roberta-base: 12 layers, 12 heads of 64, MLP 3072, byte-level BPE of 50265."""
    return roberta_style(d_model=768, n_layers=12, n_heads=12, ffn_hidden=3072, vocab_size=50265)


def roberta_large() -> ModelConfig:
    """roberta-large: 24 layers, 16 heads of 64, MLP 4096, byte-level BPE of 50265."""
    return roberta_style(d_model=1024, n_layers=24, n_heads=16, ffn_hidden=4096, vocab_size=50265)


def xlm_roberta_base() -> ModelConfig:
    """xlm-roberta-base: roberta-base's layers over a SentencePiece vocabulary of 250002."""
    return roberta_style(d_model=768, n_layers=12, n_heads=12, ffn_hidden=3072, vocab_size=250002)


def albert_style(
    *,
    d_model: int,
    n_layers: int,
    n_heads: int,
    ffn_hidden: int,
    embedding_size: int = 128,
    vocab_size: int = 30000,
    layer_sets: int | None = 1,
    max_seq_len: int = 512,
) -> ModelConfig:
    """ALBERT (Lan et al. 2020), masked-LM head: BERT's post-norm encoder (GELU-tanh MLP,
    biases everywhere, LayerNorm eps 1e-12, two token types, no dropout: the v2 models')
    with factorised embeddings (``embedding_size`` wide, mapped to d_model) and one block
    shared by every layer (``layer_sets`` 1), the masked-LM head decoding from the
    embedding width with the tied token table."""
    from attnlab.models.encoder import EncoderConfig

    return EncoderConfig(
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
        d_model=d_model,
        n_layers=n_layers,
        attention=AttentionConfig(n_heads=n_heads, qkv_bias=True, out_bias=True),
        position=PositionConfig(kind="learned"),
        ffn=FFNConfig(kind="mlp", activation="gelu_tanh", hidden_dim=ffn_hidden),
        norm=NormConfig(kind="layernorm", eps=1e-12, placement="post"),
        type_vocab_size=2,
        head="mlm",
        embedding_size=embedding_size,
        layer_sets=layer_sets,
    )


def albert_tiny() -> ModelConfig:
    """ALBERT's architecture in small: 3 layers sharing one block, d_model 64, embeddings 32
    wide; CPU-trainable (``--set task=mlm``), for tests."""
    return albert_style(
        d_model=64,
        n_layers=3,
        n_heads=4,
        ffn_hidden=128,
        embedding_size=32,
        vocab_size=256,
        max_seq_len=128,
    )


# The four ALBERT v2 sizes below are recalled from the checkpoints' config.json files
# (albert/albert-{base,large,xlarge,xxlarge}-v2: embedding_size 128, one hidden group,
# vocab 30000, gelu_new, no dropout), not read from them here (no download);
# tests/test_analysis.py checks each parameter count against transformers' model of the
# same config.


def albert_base_v2() -> ModelConfig:
    """albert-base-v2: 12 layers sharing one block, d 768, 12 heads, MLP 3072."""
    return albert_style(d_model=768, n_layers=12, n_heads=12, ffn_hidden=3072)


def albert_large_v2() -> ModelConfig:
    """albert-large-v2: 24 layers sharing one block, d 1024, 16 heads, MLP 4096."""
    return albert_style(d_model=1024, n_layers=24, n_heads=16, ffn_hidden=4096)


def albert_xlarge_v2() -> ModelConfig:
    """albert-xlarge-v2: 24 layers sharing one block, d 2048, 16 heads (recalled; the count
    does not depend on it), MLP 8192."""
    return albert_style(d_model=2048, n_layers=24, n_heads=16, ffn_hidden=8192)


def albert_xxlarge_v2() -> ModelConfig:
    """albert-xxlarge-v2: 12 layers sharing one block, d 4096, 64 heads, MLP 16384."""
    return albert_style(d_model=4096, n_layers=12, n_heads=64, ffn_hidden=16384)


def electra_style(
    *,
    d_model: int,
    n_layers: int,
    n_heads: int,
    ffn_hidden: int,
    embedding_size: int,
    head: str = "replaced_token",
    vocab_size: int = 30522,
    max_seq_len: int = 512,
    dropout: float = 0.1,
) -> ModelConfig:
    """ELECTRA (Clark et al. 2020): BERT's post-norm encoder (GELU MLP, biases everywhere,
    LayerNorm eps 1e-12, two token types) with embeddings ``embedding_size`` wide, mapped to
    d_model where they differ; ``head`` ``replaced_token`` (the discriminator: a logit per
    token, "replaced") or ``mlm`` (the generator: dense d -> E, GELU, LayerNorm, the tied
    E-wide table and a bias); its classification head (GELU) for sequence labels."""
    from attnlab.models.encoder import EncoderConfig

    return EncoderConfig(
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
        d_model=d_model,
        n_layers=n_layers,
        attention=AttentionConfig(n_heads=n_heads, qkv_bias=True, out_bias=True, dropout=dropout),
        position=PositionConfig(kind="learned"),
        ffn=FFNConfig(kind="mlp", activation="gelu", hidden_dim=ffn_hidden),
        norm=NormConfig(kind="layernorm", eps=1e-12, placement="post"),
        dropout=dropout,
        type_vocab_size=2,
        head=head,
        classifier_transform="electra",
        embedding_size=None if embedding_size == d_model else embedding_size,
    )


def electra_tiny() -> ModelConfig:
    """ELECTRA's discriminator in small: 2 layers, d_model 64 from embeddings 32 wide; for
    tests and ``import``/``export`` round trips (no task trains the replaced-token head)."""
    return electra_style(
        d_model=64,
        n_layers=2,
        n_heads=4,
        ffn_hidden=128,
        embedding_size=32,
        vocab_size=256,
        max_seq_len=128,
        dropout=0.0,
    )


# The ELECTRA sizes below are recalled from the checkpoints' config.json files
# (google/electra-{small,base,large}-{discriminator,generator}: vocab 30522, 512 positions,
# gelu, dropout 0.1), not read from them here (no download); tests/test_interop_electra.py
# checks each parameter count against transformers' model of the same config. The small
# generator is left out: its published width is not recalled with certainty.


def electra_small_discriminator() -> ModelConfig:
    """google/electra-small-discriminator: 12 layers, d 256, 4 heads, MLP 1024, embeddings
    128 wide (mapped to 256)."""
    return electra_style(d_model=256, n_layers=12, n_heads=4, ffn_hidden=1024, embedding_size=128)


def electra_base_discriminator() -> ModelConfig:
    """google/electra-base-discriminator: BERT-base's layers (12, d 768, 12 heads, MLP 3072),
    embeddings 768 wide (no map)."""
    return electra_style(d_model=768, n_layers=12, n_heads=12, ffn_hidden=3072, embedding_size=768)


def electra_large_discriminator() -> ModelConfig:
    """google/electra-large-discriminator: BERT-large's layers (24, d 1024, 16 heads, MLP
    4096), embeddings 1024 wide (no map)."""
    return electra_style(
        d_model=1024, n_layers=24, n_heads=16, ffn_hidden=4096, embedding_size=1024
    )


def electra_base_generator() -> ModelConfig:
    """google/electra-base-generator: 12 layers, d 256, 4 heads, MLP 1024, the
    discriminator's embeddings (768 wide, mapped to 256)."""
    return electra_style(
        d_model=256, n_layers=12, n_heads=4, ffn_hidden=1024, embedding_size=768, head="mlm"
    )


def electra_large_generator() -> ModelConfig:
    """google/electra-large-generator: 24 layers, d 256, 4 heads, MLP 1024, the
    discriminator's embeddings (1024 wide, mapped to 256)."""
    return electra_style(
        d_model=256, n_layers=24, n_heads=4, ffn_hidden=1024, embedding_size=1024, head="mlm"
    )


def distilbert_style(
    *,
    d_model: int,
    n_layers: int,
    n_heads: int,
    ffn_hidden: int,
    vocab_size: int = 30522,
    max_seq_len: int = 512,
    dropout: float = 0.1,
) -> ModelConfig:
    """DistilBERT (Sanh et al. 2019), masked-LM head: BERT's post-norm encoder (GELU MLP,
    biases everywhere, LayerNorm eps 1e-12) without token types or pooler, learned
    positions, its sequence head (dense -> ReLU -> dropout 0.2 -> classifier) and a tied
    decoder with a bias."""
    from attnlab.models.encoder import EncoderConfig

    return EncoderConfig(
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
        d_model=d_model,
        n_layers=n_layers,
        attention=AttentionConfig(n_heads=n_heads, qkv_bias=True, out_bias=True, dropout=dropout),
        position=PositionConfig(kind="learned"),
        ffn=FFNConfig(kind="mlp", activation="gelu", hidden_dim=ffn_hidden),
        norm=NormConfig(kind="layernorm", eps=1e-12, placement="post"),
        type_vocab_size=0,
        dropout=dropout,
        head="mlm",
        classifier_transform="distilbert",
    )


def distilbert_tiny() -> ModelConfig:
    """DistilBERT's architecture in 2 layers, d_model 64, no dropout: CPU-trainable
    (``--set task=mlm``), for tests."""
    return distilbert_style(
        d_model=64, n_layers=2, n_heads=4, ffn_hidden=128, vocab_size=256, max_seq_len=128,
        dropout=0.0,
    )  # fmt: skip


def distilbert_base_uncased() -> ModelConfig:
    """distilbert-base-uncased: 6 layers, 12 heads of 64, MLP 3072, WordPiece of 30522
    (recalled from its config.json, not read here; tests/test_analysis.py checks the
    parameter count against transformers' model of that config)."""
    return distilbert_style(d_model=768, n_layers=6, n_heads=12, ffn_hidden=3072)


def xlm_roberta_large() -> ModelConfig:
    """xlm-roberta-large: roberta-large's layers over a SentencePiece vocabulary of 250002."""
    return roberta_style(d_model=1024, n_layers=24, n_heads=16, ffn_hidden=4096, vocab_size=250002)


def llama_30m() -> ModelConfig:
    """The ~30M-parameter LLaMA-style model of the decoding benchmark."""
    return llama_style(
        vocab_size=8192,
        max_seq_len=2048,
        d_model=512,
        n_layers=8,
        n_heads=8,
        n_kv_heads=2,
        ffn_hidden=1408,
    )


PRESETS: dict[str, tuple[Callable[[], ModelConfig], str]] = {
    "gpt2-tiny": (gpt2_tiny, "GPT-2 architecture, 2 layers, d_model 64 (tests)"),
    "llama-tiny": (llama_tiny, "LLaMA architecture with GQA, 2 layers, d_model 64 (tests)"),
    "vaswani-tiny": (vaswani_tiny, "sinusoidal positions, post-norm, ReLU; 2 layers (tests)"),
    "xl-tiny": (xl_tiny, "Transformer-XL: relative attention, memory of 64 per layer; 2 layers"),
    "llama-30m": (llama_30m, "LLaMA-style, d_model 512, 8 layers, 8 heads, 2 KV heads"),
    "gpt2": (gpt2, "GPT-2 small, 124M parameters"),
    "gpt2-medium": (gpt2_medium, "GPT-2 medium, 355M parameters"),
    "gpt2-large": (gpt2_large, "GPT-2 large, 774M parameters"),
    "gpt2-xl": (gpt2_xl, "GPT-2 XL, 1.5B parameters"),
    "llama-2-7b": (llama_2_7b, "LLaMA 2 7B (MHA, 4k context)"),
    "llama-3-8b": (llama_3_8b, "LLaMA 3 8B (GQA 32/8, 128k vocabulary, 8k context)"),
    "mistral-7b": (mistral_7b, "Mistral 7B v0.2 (GQA 32/8, 32k context)"),
    "qwen2-0.5b": (qwen2_0_5b, "Qwen2 0.5B (GQA 14/2, q/k/v biases, tied embeddings)"),
    "qwen2-7b": (qwen2_7b, "Qwen2 7B (GQA 28/4, q/k/v biases)"),
    "qwen3-0.6b": (qwen3_0_6b, "Qwen3 0.6B (GQA 16/8, QK-norm, tied embeddings)"),
    "qwen3-8b": (qwen3_8b, "Qwen3 8B (GQA 32/8, QK-norm)"),
    "llama-2-70b": (llama_2_70b, "LLaMA 2 70B (GQA 64/8, 4k context)"),
    "mixtral-8x7b": (
        mixtral_8x7b,
        "Mixtral 8x7B, 46.7B total, 12.9B active (MoE 8 experts, top 2)",
    ),
    "mixtral-8x22b": (
        mixtral_8x22b,
        "Mixtral 8x22B, 141B total, 39B active (MoE 8 experts, top 2)",
    ),
    "qwen2-moe-tiny": (
        qwen2_moe_tiny,
        "Qwen2-MoE architecture: 8 experts (top 2) + a gated shared expert, 4 layers (tests)",
    ),
    "qwen1.5-moe-a2.7b": (
        qwen1_5_moe_a2_7b,
        "Qwen1.5-MoE-A2.7B, 14.3B total, 2.7B active (MoE 60 experts, top 4, gated shared)",
    ),
    "deepseek-tiny": (deepseek_tiny, "MLA + dense SwiGLU, 2 layers, d_model 64 (tests)"),
    "deepseek-moe-tiny": (
        deepseek_moe_tiny,
        "MLA with q compression + DeepSeek-V3 MoE (8 experts, top 2, 1 shared); 2 layers",
    ),
    "deepseek-v2-lite": (deepseek_v2_lite, "DeepSeek-V2-Lite, 15.7B total, 2.4B active (MLA, MoE)"),
    "deepseek-v3": (deepseek_v3, "DeepSeek-V3, 671B total, 37B active (MLA, MoE 256 experts)"),
    "deepseek-v32-tiny": (deepseek_v32_tiny, "deepseek-moe-tiny with DSA (indexer 4x32, top 16)"),
    "deepseek-v3.2": (deepseek_v32, "DeepSeek-V3.2-Exp: V3 + DSA (indexer 64x128, top 2048)"),
    "gpt-oss-tiny": (
        gpt_oss_tiny,
        "GPT-OSS architecture: sink logits, local/global layers, 4 experts (top 2); 2 layers",
    ),
    "gpt-oss-20b": (gpt_oss_20b, "gpt-oss-20b, 20.9B total, 3.6B active (MoE 32 experts, top 4)"),
    "gpt-oss-120b": (
        gpt_oss_120b,
        "gpt-oss-120b, 116.8B total, 5.1B active (MoE 128 experts, top 4)",
    ),
    "gemma-2b": (gemma_2b, "Gemma 2B, 2.5B (MQA 8/1, heads of 256, 8k context)"),
    "gemma-7b": (gemma_7b, "Gemma 7B, 8.5B (MHA 16 heads of 256, 8k context)"),
    "gemma2-tiny": (
        gemma2_tiny,
        "Gemma 2 architecture: sandwich norms, local/global layers, logit soft-capping; 4 layers",
    ),
    "gemma-2-2b": (gemma2_2b, "Gemma 2 2B, 2.6B (GQA 8/4, local/global, soft-capping)"),
    "gemma-2-9b": (gemma2_9b, "Gemma 2 9B, 9.2B (GQA 16/8, local/global, soft-capping)"),
    "gemma-2-27b": (gemma2_27b, "Gemma 2 27B, 27.2B (GQA 32/16, local/global, soft-capping)"),
    "gemma3-tiny": (
        gemma3_tiny,
        "Gemma 3 architecture: sandwich norms, 5 local : 1 global layers, 2 RoPE bases; 6 layers",
    ),
    "gemma-3-1b": (gemma3_1b, "Gemma 3 1B, 1.0B (MQA, 5 local : 1 global, 32k context)"),
    "gemma-3-4b": (gemma3_4b, "Gemma 3 4B's language model, 3.9B (GQA 8/4, 128k context)"),
    "gemma-3-12b": (gemma3_12b, "Gemma 3 12B's language model, 11.8B (GQA 16/8, 128k context)"),
    "gemma-3-27b": (gemma3_27b, "Gemma 3 27B's language model, 27.0B (GQA 32/16, 128k context)"),
    "olmo2-tiny": (
        olmo2_tiny,
        "OLMo 2 architecture: norms on sublayer outputs, QK-norm over whole projections; 2 layers",
    ),
    "olmo-2-1b": (olmo2_1b, "OLMo 2 1B, 1.5B (MHA 16 heads, 4k context)"),
    "olmo-2-7b": (olmo2_7b, "OLMo 2 7B, 7.3B (MHA 32 heads, 4k context)"),
    "olmo-2-13b": (olmo2_13b, "OLMo 2 13B, 13.7B (MHA 40 heads, 4k context)"),
    "smollm3-tiny": (
        smollm3_tiny,
        "SmolLM3 architecture: NoPE layers (every 4th without RoPE), GQA 4/2; 4 layers",
    ),
    "smollm3-3b": (smollm3_3b, "SmolLM3 3B, 3.1B (GQA 16/4, every 4th layer NoPE, 64k context)"),
    "starcoder2-tiny": (
        starcoder2_tiny,
        "StarCoder2 architecture: LayerNorm, GELU MLP, biases, GQA 4/2, windows of 16; 2 layers",
    ),
    "starcoder2-3b": (starcoder2_3b, "StarCoder2 3B, 3.0B (GQA 24/2, window 4096, 16k context)"),
    "starcoder2-7b": (starcoder2_7b, "StarCoder2 7B, 7.2B (GQA 36/4, window 4096, 16k context)"),
    "starcoder2-15b": (starcoder2_15b, "StarCoder2 15B, 16.0B (GQA 48/4, window 4096, 16k)"),
    "granite-tiny": (
        granite_tiny,
        "Granite architecture: LLaMA's with muP multipliers (embeddings, residuals, logits)",
    ),
    "cohere-tiny": (
        cohere_tiny,
        "Cohere architecture: parallel attention and SwiGLU after one LayerNorm, logit scale",
    ),
    "command-r": (command_r, "Command-R v01, 35.0B (MHA 64 heads, 256k vocabulary, tied head)"),
    "command-r-plus": (
        command_r_plus,
        "Command R+, 103.8B (GQA 96/8, QK-norm: a LayerNorm per head, 256k vocabulary)",
    ),
    "stablelm-tiny": (
        stablelm_tiny,
        "StableLM 2 architecture: LayerNorm, SwiGLU, a quarter of heads rotated, q/k/v "
        "biases, GQA 4/2; 2 layers",
    ),
    "stablelm-3b-4e1t": (
        lambda: stablelm("stablelm-3b-4e1t"),
        "StableLM-3B-4E1T, 2.8B (MHA 32 heads, d_model 2560, 4k context)",
    ),
    "stablelm-2-1_6b": (
        lambda: stablelm("stablelm-2-1_6b"),
        "StableLM 2 1.6B (MHA 32 heads, q/k/v biases, 100k vocabulary)",
    ),
    "stablelm-2-12b": (
        lambda: stablelm("stablelm-2-12b"),
        "StableLM 2 12B, 12.1B (GQA 32/8, parallel blocks, a LayerNorm per query/key head)",
    ),
    "persimmon-tiny": (
        persimmon_tiny,
        "Persimmon architecture: LayerNorm, QK LayerNorm, squared-ReLU MLP, half of heads "
        "rotated; 2 layers",
    ),
    "persimmon-8b": (
        persimmon_8b,
        "Persimmon-8B, 9.4B (MHA 64 heads, QK LayerNorm, squared ReLU, 262k vocabulary, 16k)",
    ),
    "nemotron-tiny": (
        nemotron_tiny,
        "Nemotron architecture: unit-offset LayerNorm, squared-ReLU MLP, half of heads "
        "rotated, GQA 4/2; 2 layers",
    ),
    "minitron-4b": (
        lambda: minitron("minitron-4b"),
        "Minitron-4B, 4.19B (GQA 24/8, heads of 128, squared ReLU, 256k vocabulary)",
    ),
    "minitron-8b": (
        lambda: minitron("minitron-8b"),
        "Minitron-8B, 8.27B (GQA 48/8, heads of 128, squared ReLU, 256k vocabulary)",
    ),
    "phi3-tiny": (phi3_tiny, "Phi-3 architecture with LongRoPE (32 -> 128 tokens), 2 layers"),
    "phi-3-mini-4k": (phi_3_mini_4k, "Phi-3-mini-4k, 3.8B (MHA 32 heads, window 2047, 4k)"),
    "pythia-tiny": (
        pythia_tiny,
        "GPT-NeoX/Pythia architecture: parallel attention and MLP, 1/4 of heads rotated; 2 layers",
    ),
    **{
        f"pythia-{size}": (
            lambda size=size: pythia(size),
            f"Pythia {size.upper()} (GPT-NeoX: parallel blocks, d_model {d}, {n} layers, "
            f"{h} heads)",
        )
        for size, (d, n, h, _) in PYTHIA_SIZES.items()
    },
    "phi-tiny": (
        phi_tiny,
        "Phi-1/1.5/2 architecture: parallel attention and MLP on one norm, half of heads "
        "rotated, a biased head; 2 layers",
    ),
    "phi-1": (lambda: phi("phi-1"), "Phi-1, 1.3B (1.42B counted; 24 layers, d_model 2048)"),
    "phi-1.5": (lambda: phi("phi-1.5"), "Phi-1.5, 1.3B (1.42B counted; Phi-1's architecture)"),
    "phi-2": (lambda: phi("phi-2"), "Phi-2, 2.7B (2.78B counted; 32 layers, d_model 2560)"),
    "gptj-tiny": (
        gptj_tiny,
        "GPT-J architecture: parallel attention and MLP on one norm, interleaved RoPE on 1/4 "
        "of heads; 2 layers",
    ),
    "gpt-j-6b": (gpt_j_6b, "GPT-J 6B, 6.05B (28 layers, d_model 4096, 16 heads, rotary_dim 64)"),
    "falcon-tiny": (
        falcon_tiny,
        "Falcon architecture: parallel attention and MLP after one norm, multi-query; 2 layers",
    ),
    "falcon-7b": (falcon_7b, "Falcon-7B, 6.9B (multi-query 71 heads, one norm per block, tied)"),
    "falcon-40b": (
        falcon_40b,
        "Falcon-40B, 41.3B (GQA 128/8, two parallel norms per block, tied)",
    ),
    "opt-tiny": (
        opt_tiny,
        "OPT architecture: learned positions, pre-norm, ReLU MLP, separate q/k/v; 2 layers",
    ),
    **{
        f"opt-{size}": (
            lambda size=size: opt(size),
            f"OPT {size.upper()} (d_model {d}, {n} layers, {h} heads, ReLU, tied, 2k context)",
        )
        for size, (d, n, h) in OPT_SIZES.items()
    },
    "falcon-rw-1b": (
        falcon_rw_1b,
        "Falcon-RW-1B, 1.31B (sequential blocks, ALiBi scaled with the scores, 32 heads, tied)",
    ),
    "bloom-tiny": (
        bloom_tiny,
        "BLOOM architecture: ALiBi, a LayerNorm on the embeddings, pre-norm, tanh GELU; 2 layers",
    ),
    **{
        ("bloom" if size == "176b" else f"bloom-{size}"): (
            lambda size=size: bloom(size),
            f"BLOOM{'' if size == '176b' else '-' + size}, {total} (d_model {d}, {n} layers, "
            f"{h} heads, ALiBi, tied)",
        )
        for (size, (d, n, h)), total in zip(
            BLOOM_SIZES.items(), ("559M", "1.07B", "1.72B", "3.00B", "7.07B", "176.2B"), strict=True
        )
    },
    "mpt-tiny": (
        mpt_tiny,
        "MPT architecture: ALiBi, no biases, pre-norm, exact GELU, fused q/k/v; 2 layers",
    ),
    **{
        f"mpt-{size}": (
            lambda size=size: mpt(size),
            f"MPT-{size.upper()}, {total} (d_model {d}, {n} layers, {h} heads, ALiBi, no "
            f"biases, tied, {ctx // 1024}k context)",
        )
        for (size, (d, n, h, ctx)), total in zip(
            MPT_SIZES.items(), ("6.65B", "29.96B"), strict=True
        )
    },
    "bigcode-tiny": (
        bigcode_tiny,
        "GPT-BigCode architecture: GPT-2 with multi-query attention (4 heads, 1 KV); 2 layers",
    ),
    **{
        name: (
            lambda name=name: bigcode(name),
            f"{title}, {total} (d_model {d}, {n} layers, multi-query {h}/1, {ctx // 1024}k "
            "context, tied)",
        )
        for (name, (d, n, h, _, ctx)), (title, total) in zip(
            BIGCODE_SIZES.items(),
            (
                ("SantaCoder", "1.12B"),
                ("StarCoderBase-1B", "1.14B"),
                ("StarCoderBase-3B", "3.04B"),
                ("StarCoderBase-7B", "7.33B"),
                ("StarCoder (and StarCoderBase) 15.5B", "15.5B"),
            ),
            strict=True,
        )
    },
    "t5-tiny": (
        t5_tiny,
        "T5 v1.0 architecture: relative position bias, RMSNorm, ReLU, tied; 2+2 layers, d 64",
    ),
    "t5-small": (t5_small, "T5-small encoder-decoder, 60.5M (6+6 layers, d 512, tied, ReLU)"),
    "t5-base": (t5_base, "T5-base encoder-decoder, 223M (12+12 layers, d 768, tied, ReLU)"),
    "t5-large": (t5_large, "T5-large encoder-decoder, 738M (24+24 layers, d 1024, tied, ReLU)"),
    "flan-t5-small": (
        flan_t5_small,
        "Flan-T5-small (T5 v1.1), 77M (8+8 layers, d 512, 6 heads, GeGLU, untied head)",
    ),
    "flan-t5-base": (
        flan_t5_base,
        "Flan-T5-base (T5 v1.1), 248M (12+12 layers, d 768, GeGLU, untied head)",
    ),
    "mt5-small": (mt5_small, "mT5-small (T5 v1.1, 250k vocabulary), 300M (8+8 layers, d 512)"),
    "mt5-base": (mt5_base, "mT5-base (T5 v1.1, 250k vocabulary), 582M (12+12 layers, d 768)"),
    "bart-tiny": (
        bart_tiny,
        "BART architecture: learned positions, embedding norm, post-norm, GELU; 2+2 layers, d 64",
    ),
    "bart-base": (bart_base, "BART-base encoder-decoder, 139M (6+6 layers, d 768, tied, GELU)"),
    "bart-large": (bart_large, "BART-large encoder-decoder, 406M (12+12 layers, d 1024, tied)"),
    "mbart-large-cc25": (
        mbart_large_cc25,
        "mBART-large-cc25 (pre-norm BART, 250k vocabulary), 611M (12+12 layers, d 1024)",
    ),
    "mbart-large-50": (
        mbart_large_50,
        "mBART-large-50 (pre-norm BART, 250k vocabulary), 611M (12+12 layers, d 1024)",
    ),
    "m2m100-tiny": (
        m2m100_tiny,
        "M2M100/NLLB architecture: sinusoids past the padding id, pre-norm, ReLU; 2+2 layers, d 64",
    ),
    "m2m100-418m": (m2m100_418m, "M2M100-418M translation, 484M (12+12 layers, d 1024, tied)"),
    "nllb-200-distilled-600m": (
        nllb_200_distilled_600m,
        "NLLB-200-distilled-600M (M2M100, 256k vocabulary), 615M (12+12 layers, d 1024)",
    ),
    "pegasus-tiny": (
        pegasus_tiny,
        "Pegasus architecture: split sinusoids, pre-norm, ReLU, logits bias; 2+2 layers, d 64",
    ),
    "pegasus-large": (pegasus_large, "Pegasus-large summarizer, 568M (16+16 layers, d 1024)"),
    "modernbert-tiny": (
        modernbert_tiny,
        "ModernBERT architecture: RoPE, GeGLU, 1 global : 2 local (bidirectional) layers; 3 layers",
    ),
    "modernbert-base": (modernbert_base, "ModernBERT-base encoder, 149M (masked LM, 8k context)"),
    "deberta-v3-tiny": (
        deberta_v3_tiny,
        "DeBERTa-v3 architecture: disentangled attention (c2p, p2c, log buckets); 2 layers",
    ),
    "deberta-v3-xsmall": (
        deberta_v3_xsmall,
        "DeBERTa-v3-xsmall encoder, 71.0M (masked LM, 128k vocabulary)",
    ),
    "deberta-v3-small": (
        deberta_v3_small,
        "DeBERTa-v3-small encoder, 142.0M (masked LM, 128k vocabulary)",
    ),
    "deberta-v3-base": (
        deberta_v3_base,
        "DeBERTa-v3-base encoder, 184.6M (masked LM, 128k vocabulary)",
    ),
    "deberta-v3-large": (
        deberta_v3_large,
        "DeBERTa-v3-large encoder, 435.2M (masked LM, 128k vocabulary)",
    ),
    "roberta-tiny": (
        roberta_tiny,
        "RoBERTa architecture: BERT's layout, positions past the padding id; 2 layers (tests)",
    ),
    "roberta-base": (roberta_base, "RoBERTa-base encoder, 124.7M (masked LM, 512 tokens)"),
    "roberta-large": (roberta_large, "RoBERTa-large encoder, 355.4M (masked LM, 512 tokens)"),
    "xlm-roberta-base": (
        xlm_roberta_base,
        "XLM-RoBERTa-base encoder, 278.3M (masked LM, 250k vocabulary, 512 tokens)",
    ),
    "xlm-roberta-large": (
        xlm_roberta_large,
        "XLM-RoBERTa-large encoder, 560.1M (masked LM, 250k vocabulary, 512 tokens)",
    ),
    "albert-tiny": (
        albert_tiny,
        "ALBERT architecture: factorised embeddings (32 -> 64), 3 layers sharing one block",
    ),
    "albert-base-v2": (albert_base_v2, "ALBERT-base v2 encoder, 11.2M (12 shared layers, d 768)"),
    "albert-large-v2": (albert_large_v2, "ALBERT-large v2 encoder, 16.8M (24 shared layers)"),
    "albert-xlarge-v2": (albert_xlarge_v2, "ALBERT-xlarge v2 encoder, 54.8M (24 shared layers)"),
    "albert-xxlarge-v2": (
        albert_xxlarge_v2,
        "ALBERT-xxlarge v2 encoder, 206.4M (12 shared layers, d 4096)",
    ),
    "electra-tiny": (
        electra_tiny,
        "ELECTRA discriminator architecture: embeddings 32 -> 64, replaced-token head (tests)",
    ),
    "electra-small-discriminator": (
        electra_small_discriminator,
        "ELECTRA-small discriminator, 13.5M (12 layers, d 256, embeddings 128)",
    ),
    "electra-base-discriminator": (
        electra_base_discriminator,
        "ELECTRA-base discriminator, 109.5M (12 layers, d 768)",
    ),
    "electra-large-discriminator": (
        electra_large_discriminator,
        "ELECTRA-large discriminator, 335.1M (24 layers, d 1024)",
    ),
    "electra-base-generator": (
        electra_base_generator,
        "ELECTRA-base generator, 33.7M (12 layers, d 256, embeddings 768)",
    ),
    "electra-large-generator": (
        electra_large_generator,
        "ELECTRA-large generator, 51.3M (24 layers, d 256, embeddings 1024)",
    ),
    "distilbert-tiny": (
        distilbert_tiny,
        "DistilBERT architecture: BERT without token types or pooler; 2 layers (tests)",
    ),
    "distilbert-base-uncased": (
        distilbert_base_uncased,
        "DistilBERT-base (uncased) encoder, 67.0M (6 layers, d 768)",
    ),
    "modernbert-large": (
        modernbert_large,
        "ModernBERT-large encoder, 395M (masked LM, 8k context)",
    ),
}


def register_preset(name: str, fn: Callable[[], ModelConfig], description: str) -> None:
    PRESETS[name] = (fn, description)


def get_preset(name: str) -> ModelConfig:
    """The :class:`ModelConfig` of preset ``name`` (``list_presets()`` names them all);
    :class:`ConfigError` listing the known presets otherwise."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
    return PRESETS[name][0]()


def list_presets() -> dict[str, str]:
    """Every model preset: name -> one-line description."""
    return {name: desc for name, (_, desc) in PRESETS.items()}


# --------------------------------------------------------------------------- run presets
# A run preset is a whole RunConfig (model + training + data). vocab_size is a placeholder:
# training sets it from the tokenizer.


def demo_run() -> RunConfig:
    """Character-level LLaMA-style model (RoPE, RMSNorm, SwiGLU; 4 layers, d_model 128,
    block 128) on the embedded corpus: a 150-second training budget on a 2-core CPU, the
    cosine schedule fitted to the steps that fit in it (at most 2500).

    LLaMA-style because at equal steps it reached a far lower loss than the GPT-2 layout
    here (val 1.54 vs 2.09 after 400 steps), for ~12% more time per step. Batch 8 with lr
    3e-3 reached nanogpt-cpu's final loss sooner than batch 16 or 12 with lr 4e-3 to 6e-3
    (benchmarks/time_to_quality.py: about 53 s against 60-77 s). float32: bf16 autocast
    was ~10x slower on the AVX2-only CPU it was tuned on (no AVX-512 BF16/AMX), and only
    1.03-1.04x faster on an AVX-512 BF16 one (benchmarks/train_levers.py); --set
    train.dtype=bfloat16 where that pays.

    Weights start at std 0.06, not GPT-2's 0.02 (made for d_model 768; 1/sqrt(d_model) is
    0.088 here), and Adam's beta1 is 0.8: after 400 steps 1.394 against 1.514 with 0.02 and
    0.9, both at lr 3e-3 (benchmarks/equal_steps.py --variants adamw-lr3e-3+gpt2-init-beta1-0.9
    adamw-lr3e-3, seeds 1 and 2); std 0.04 1.421, 0.08 1.399, 0.1 1.429. With them lr 2e-3
    beat 3e-3 (--steps 1200 --variants adamw-lr3e-3 adamw: 1.207 against 1.220 at the end,
    1.340 against 1.367 at step 600, both seeds lower); 4e-3 was worse (1.422 at 400)."""
    model = llama_style(
        vocab_size=256,
        max_seq_len=128,
        d_model=128,
        n_layers=4,
        n_heads=4,
        multiple_of=32,
        tie_embeddings=True,
    )
    model.init_std = 0.06
    return RunConfig(
        model=model,
        train=TrainConfig(
            batch_size=8,
            block_size=128,
            max_steps=2500,
            lr=2e-3,
            min_lr=3e-4,
            warmup_steps=50,
            weight_decay=0.1,
            beta1=0.8,
            beta2=0.99,
            grad_clip=1.0,
            eval_every=100,
            eval_batches=10,
            log_every=10,
            time_budget=150.0,
        ),
        data=DataConfig(tokenizer="char"),
    )


def quick_run() -> RunConfig:
    """The ``demo`` recipe shaped for budgets of a few tens of seconds: 2 layers instead of
    4, 8 heads of 16 dimensions instead of 4 of 32, block 64 and batch 16 (the same 1,024
    tokens a step); a 30-second budget.

    Short budgets favour shallow models that take many steps. Trained for 20 s each on a
    2-core CPU (benchmarks/short_budget.py, medians of 2 rounds, 4 heads): 2 layers reached
    a validation loss of 1.353, the 4-layer demo 1.498; 1 layer 1.399, 3 layers 1.384,
    block 128 x batch 8 1.359, d_model 192 1.474. Eight heads ended lower than four in
    each of three such comparisons (by 0.007-0.027, for up to 8% fewer steps) and at 650
    equal steps for each of four seeds (by 0.006 on average; --variants heads4 adamw).

    The schedule is WSD (``train.schedule``): the peak rate held, then a linear decay over
    the second half of the steps. At 650 steps it ended lower than the cosine for each of
    four seeds (benchmarks/equal_steps.py --preset quick --steps 650, with the earlier
    init and beta1: 1.385 against 1.397 on average), and under a time budget its stable
    phase lets the refits follow the machine's speed until the decay begins. Adam's beta2
    is 0.95 (the demo's 0.99 averages squared gradients over ~100 steps, 0.95 over ~20):
    lower for each of eight seeds (0.008 on average).

    Like the demo, Adam's beta1 is 0.8 and the weights start larger than GPT-2's 0.02, here
    at std 0.04: with the demo's earlier 0.02 and beta1 0.9 the loss at 650 steps was 0.055
    higher, for each of four seeds (--variants gpt2-init-beta1-0.9+heads4 heads4: 1.379 vs
    1.324 on average); std 0.03-0.06 and beta1 0.7-0.85 within 0.01 of 0.04 and 0.8.
    benchmarks/time_to_quality.py compares it with nanoGPT's CPU run: it reaches that
    run's final loss in a quarter of its time."""
    cfg = demo_run()
    cfg.model.n_layers = 2
    cfg.model.max_seq_len = 64
    cfg.model.init_std = 0.04  # the demo's 0.06 is best at 4 layers, 0.04 at 2
    cfg.model.attention.n_heads = 8
    cfg.train.lr = 3e-3  # the demo's 2e-3 was no better for quick (1.339 vs 1.340, seed 2)
    cfg.train.block_size = 64
    cfg.train.batch_size = 16
    cfg.train.time_budget = 30.0
    cfg.train.schedule = "wsd"
    cfg.train.decay_fraction = 0.5
    cfg.train.beta2 = 0.95
    return cfg


def nanogpt_cpu_run() -> RunConfig:
    """nanoGPT's documented CPU run (README, shakespeare_char on a MacBook): GPT-2
    architecture (learned positions, LayerNorm with bias, exact-GELU MLP of 4d, MHA, tied
    embeddings), 4 layers, 4 heads, d_model 128, block 64, batch 12, AdamW lr 1e-3 with
    beta2 0.99 and weight decay 0.1, 100 warm-up steps, cosine to 1e-4 over 2000 steps,
    grad clip 1.0, no dropout, float32; on the embedded corpus, character level."""
    model = gpt2_style(vocab_size=256, max_seq_len=64, d_model=128, n_layers=4, n_heads=4)
    model.ffn.activation = "gelu"  # nanoGPT's nn.GELU() is the exact (erf) GELU
    return RunConfig(
        model=model,
        train=TrainConfig(
            batch_size=12,
            block_size=64,
            grad_accum=1,
            max_steps=2000,
            lr=1e-3,
            min_lr=1e-4,
            warmup_steps=100,
            weight_decay=0.1,
            beta1=0.9,
            beta2=0.99,
            grad_clip=1.0,
            dtype="float32",
            eval_every=250,
            eval_batches=20,
            log_every=10,
        ),
        data=DataConfig(tokenizer="char"),
    )


def xl_tiny_run() -> RunConfig:
    """Transformer-XL as its paper trains it (task lm-stream): each of the 16 batch rows
    reads its own contiguous part of the embedded corpus (character level) in consecutive
    segments of 64 tokens, the memory of 64 hidden states per layer carried from one step
    to the next; validation reads the validation split the same way."""
    return RunConfig(
        model=xl_tiny(),
        train=TrainConfig(
            batch_size=16,
            block_size=64,
            max_steps=1500,
            lr=2e-3,
            min_lr=2e-4,
            warmup_steps=50,
            weight_decay=0.1,
            eval_every=100,
            eval_batches=8,
            log_every=10,
            time_budget=120.0,
        ),
        data=DataConfig(tokenizer="char"),
        task="lm-stream",
    )


def bert_tiny_mlm_run() -> RunConfig:
    """A BERT-style encoder (post-norm, learned positions, GELU MLP, tied MLM decoder), 2
    layers, d_model 64, masked LM on the embedded corpus at character level, block 64."""
    from attnlab.models.encoder import EncoderConfig

    model = EncoderConfig(
        vocab_size=256,
        max_seq_len=64,
        d_model=64,
        n_layers=2,
        attention=AttentionConfig(n_heads=4, qkv_bias=True, out_bias=True),
        position=PositionConfig(kind="learned"),
        ffn=FFNConfig(kind="mlp", activation="gelu", hidden_dim=256),
        type_vocab_size=0,
        head="mlm",
    )
    return RunConfig(
        model=model,
        train=TrainConfig(
            batch_size=32,
            block_size=64,
            max_steps=1000,
            lr=2e-3,
            min_lr=2e-4,
            warmup_steps=50,
            weight_decay=0.01,
            eval_every=250,
            eval_batches=8,
        ),
        data=DataConfig(tokenizer="char", options={"mask_prob": 0.15, "whole_word": False}),
        task="mlm",
    )


def _bert_tiny(head: str, max_seq_len: int, *, type_vocab_size: int = 0, n_layers: int = 2):
    """The fine-tuning presets' encoder: BERT's layout (post-norm, learned positions, GELU
    MLP), d_model 64, 4 heads, FFN 256; vocab_size and n_labels are set by the task."""
    from attnlab.models.encoder import EncoderConfig

    return EncoderConfig(
        vocab_size=256,
        max_seq_len=max_seq_len,
        d_model=64,
        n_layers=n_layers,
        attention=AttentionConfig(n_heads=4, qkv_bias=True, out_bias=True),
        position=PositionConfig(kind="learned"),
        ffn=FFNConfig(kind="mlp", activation="gelu", hidden_dim=256),
        type_vocab_size=type_vocab_size,
        head=head,
    )


def _bert_tiny_train(max_steps: int, lr: float = 2e-3) -> TrainConfig:
    return TrainConfig(
        batch_size=32,
        max_steps=max_steps,
        lr=lr,
        min_lr=lr / 10,
        warmup_steps=50,
        weight_decay=0.01,
        eval_every=200,
        eval_batches=8,
        log_every=20,
    )


def bert_tiny_langid_run() -> RunConfig:
    """Language identification of numbers written in words (task text-classification:
    en, fr, de, es, it, pt; numbers below 10,000 split so test numbers are never trained
    on): a 2-layer BERT-style encoder, d_model 64, character level, pooled [CLS]."""
    options = {"langs": ["en", "fr", "de", "es", "it", "pt"], "max_number": 10_000,
               "n_train": 2_000, "n_val": 250, "n_test": 250, "seed": 0}  # fmt: skip
    return RunConfig(
        model=_bert_tiny("sequence", max_seq_len=64),
        train=_bert_tiny_train(max_steps=600),
        data=DataConfig(tokenizer="char", options=options),
        task="text-classification",
    )


def bert_tiny_ner_run() -> RunConfig:
    """Named-entity tagging (task token-classification: PER, CITY, DATE, NUM in BIO tags)
    of generated sentences: a 2-layer BERT-style encoder, d_model 64, byte-level BPE of
    at most 1024 tokens trained on the training sentences."""
    options = {"n_train": 8_000, "n_val": 500, "n_test": 500, "seed": 0, "held_out": 0.0}
    return RunConfig(
        model=_bert_tiny("token", max_seq_len=64),
        train=_bert_tiny_train(max_steps=800),
        data=DataConfig(tokenizer="bpe", bpe_vocab_size=1024, options=options),
        task="token-classification",
    )


def bert_tiny_qa_run() -> RunConfig:
    """Extractive question answering (task question-answering) on generated facts about
    people: a 2-layer BERT-style encoder, d_model 64, token types for question and
    context, byte-level BPE of at most 1024 tokens trained on the training texts."""
    options = {"n_train": 8_000, "n_val": 500, "n_test": 500, "seed": 0, "held_out": 0.0,
               "max_answer_tokens": 30}  # fmt: skip
    return RunConfig(
        model=_bert_tiny("qa", max_seq_len=64, type_vocab_size=2),
        train=_bert_tiny_train(max_steps=1500),
        data=DataConfig(tokenizer="bpe", bpe_vocab_size=1024, options=options),
        task="question-answering",
    )


def _numbers_options() -> dict:
    return {"lang": "en", "max_number": 10_000, "n_train": 8_000, "n_val": 1_000, "n_test": 1_000,
            "seed": 0}  # fmt: skip


def transformer_numbers_run() -> RunConfig:
    """The Transformer encoder-decoder (pre-norm, sinusoidal positions) translating numbers
    below 10,000 into English words (task seq2seq): 2 + 2 layers, d_model 64, 4 heads.
    ``benchmarks/numbers_translation.py`` measures it against gru-numbers."""
    from attnlab.models.seq2seq import Seq2SeqConfig

    model = Seq2SeqConfig(
        vocab_size=32,
        max_seq_len=64,
        d_model=64,
        n_layers=2,
        n_decoder_layers=2,
        attention=AttentionConfig(n_heads=4, qkv_bias=True, out_bias=True),
        ffn=FFNConfig(kind="mlp", activation="relu", hidden_dim=256),
        norm=NormConfig(placement="pre"),
        share_embeddings=False,
        dropout=0.0,
    )
    train = _numbers_train()
    train.max_steps = 900  # 99.5% greedy exact match on the 1,000 test numbers (benchmark)
    return RunConfig(model=model, train=train, task="seq2seq",
                     data=DataConfig(options=_numbers_options()))  # fmt: skip


def gru_numbers_run() -> RunConfig:
    """The GRU encoder-decoder with additive attention (Bahdanau et al. 2015) on the same
    numbers task as transformer-numbers, at a similar parameter count."""
    from attnlab.models.rnn import RNNSeq2SeqConfig

    model = RNNSeq2SeqConfig(
        vocab_size=32, src_vocab_size=13, max_seq_len=64, embed_dim=32, hidden_dim=96
    )
    return RunConfig(model=model, train=_numbers_train(), task="seq2seq",
                     data=DataConfig(options=_numbers_options()))  # fmt: skip


def _numbers_train() -> TrainConfig:
    return TrainConfig(
        batch_size=64,
        max_steps=1500,
        lr=3e-3,
        min_lr=1e-4,
        warmup_steps=100,
        weight_decay=0.01,
        eval_every=500,
        eval_batches=4,
        log_every=50,
    )


def vit_digits_run() -> RunConfig:
    """A small ViT on scikit-learn's 8 x 8 digits (task image-classification): 2 x 2
    patches, d_model 64, 3 layers; shifts of one pixel as augmentation. A 150 s time
    budget (the schedule is fitted to the steps that fit; ~900 steps on one busy CPU
    thread) with max_steps 3000 as the ceiling on a fast machine."""
    from attnlab.models.vit import vit_digits

    return RunConfig(
        model=vit_digits(),
        train=TrainConfig(
            batch_size=64,
            max_steps=3000,
            lr=3e-3,
            min_lr=1e-4,
            warmup_steps=50,
            weight_decay=0.05,
            time_budget=150.0,
            eval_every=250,
            eval_batches=6,
            log_every=50,
        ),
        data=DataConfig(options={"test_fraction": 0.2, "seed": 0, "shift": 1}),
        task="image-classification",
    )


RUN_PRESETS: dict[str, tuple[Callable[[], RunConfig], str]] = {
    "xl-tiny": (
        xl_tiny_run,
        "Transformer-XL, 2 layers, d 64, memory 64: streamed chars, memory carried; 120 s CPU",
    ),
    "bert-tiny-mlm": (bert_tiny_mlm_run, "BERT-style encoder, 2 layers, d 64: masked LM, chars"),
    "bert-tiny-langid": (
        bert_tiny_langid_run,
        "BERT-style encoder, 2 layers, d 64: language of numbers in words (classification)",
    ),
    "bert-tiny-ner": (
        bert_tiny_ner_run,
        "BERT-style encoder, 2 layers, d 64: entity tagging of generated sentences, BPE",
    ),
    "bert-tiny-qa": (
        bert_tiny_qa_run,
        "BERT-style encoder, 2 layers, d 64: extractive QA on generated facts, BPE",
    ),
    "transformer-numbers": (
        transformer_numbers_run,
        "Transformer encoder-decoder, 2+2 layers, d 64: numbers -> English words",
    ),
    "gru-numbers": (gru_numbers_run, "GRU encoder-decoder + Bahdanau attention: numbers -> words"),
    "vit-digits": (
        vit_digits_run,
        "ViT, 2x2 patches, d 64, 3 layers: 8x8 digits classification; 150 s CPU",
    ),
    "demo": (
        demo_run,
        "char-level LLaMA-style, 4 layers, d_model 128, block 128, embedded corpus; 150 s CPU",
    ),
    "quick": (
        quick_run,
        "char-level LLaMA-style, 2 layers, 8 heads, d_model 128, block 64: a 30 s CPU budget",
    ),
    "nanogpt-cpu": (
        nanogpt_cpu_run,
        "nanoGPT's CPU config: GPT-2 4 layers, 4 heads, d_model 128, block 64, 2000 steps",
    ),
}

for _name, (_fn, _description) in RUN_PRESETS.items():
    # Also a model preset (its model), so list_presets() and get_preset() know the name.
    register_preset(_name, lambda fn=_fn: fn().model, f"{_description} (run preset)")


def get_run_preset(name: str) -> RunConfig:
    """A run preset's RunConfig; a model preset gives its model with default training and
    data settings."""
    if name in RUN_PRESETS:
        return RUN_PRESETS[name][0]()
    if name in PRESETS:
        return RunConfig(model=get_preset(name))
    known = ", ".join([*RUN_PRESETS, *(n for n in PRESETS if n not in RUN_PRESETS)])
    raise ConfigError(f"unknown preset {name!r}; known presets: {known}")


def list_run_presets() -> dict[str, str]:
    """Every run preset (model + training + data): name -> one-line description."""
    return {name: desc for name, (_, desc) in RUN_PRESETS.items()}
