"""Typed configs: unknown keys, wrong types, inconsistent values, JSON round trips, dotted
overrides, and preset parameter counts (built on the meta device: no memory allocated)."""

from __future__ import annotations

import re

import pytest
import torch

from attnlab.config import ConfigError, FFNConfig, ModelConfig, RunConfig
from attnlab.models import DecoderLM
from attnlab.presets import PRESETS, get_preset


def test_unknown_key_names_key_and_suggests_close_match():
    with pytest.raises(
        ConfigError, match=r"attention\.n_head: unknown key; did you mean 'n_heads'"
    ):
        ModelConfig.from_dict({"attention": {"n_head": 4}})
    with pytest.raises(ConfigError, match=r"d_modle: unknown key; did you mean 'd_model'"):
        ModelConfig.from_dict({"d_modle": 64})
    with pytest.raises(ConfigError, match="zzz: unknown key; known keys"):
        ModelConfig.from_dict({"zzz": 1})


@pytest.mark.parametrize(
    "data,where",
    [
        ({"d_model": "64"}, "d_model"),
        ({"d_model": 64.5}, "d_model"),
        ({"n_layers": True}, "n_layers"),
        ({"tie_embeddings": 1}, "tie_embeddings"),
        ({"dropout": "0.1"}, "dropout"),
        ({"attention": {"n_kv_heads": "2"}}, "attention.n_kv_heads"),
        ({"attention": 4}, "attention"),
        ({"position": {"kind": 3}}, "position.kind"),
        ({"arch": ["decoder"]}, "arch"),  # was a TypeError: a list is no variant name
        ({"init_std": 10**400}, "init_std"),  # was an OverflowError: beyond the float range
    ],
)
def test_wrong_types_rejected(data, where):
    with pytest.raises(ConfigError, match=rf"^{where}: expected"):
        ModelConfig.from_dict(data)


def test_optional_list_fields_name_their_type():
    # an optional list field's error named its item type: "expected float or null, got 0.5"
    with pytest.raises(ConfigError, match=r"^image_mean: expected a list of float or null, got"):
        ModelConfig.from_dict({"arch": "vit", "image_mean": 0.5, "image_std": [1, 1, 1]})
    with pytest.raises(ConfigError, match=r"^label_names: expected a list of str or null, got"):
        ModelConfig.from_dict({"arch": "encoder", "head": "sequence", "label_names": "a"})


def test_top_level_must_be_a_mapping():
    with pytest.raises(ConfigError, match="expected a mapping for ModelConfig"):
        ModelConfig.from_dict([1, 2])
    with pytest.raises(ConfigError, match="expected a mapping for ModelConfig"):
        ModelConfig.from_json("[1, 2]")


def test_integral_float_accepted_as_int():
    cfg = ModelConfig.from_dict({"d_model": 64.0, "dropout": 0})
    assert cfg.d_model == 64 and isinstance(cfg.d_model, int)
    assert isinstance(cfg.dropout, float)


@pytest.mark.parametrize(
    "data,match",
    [
        ({"d_model": 100, "attention": {"n_heads": 3}}, r"d_model=100 is not divisible"),
        ({"attention": {"n_heads": 4, "n_kv_heads": 3}}, r"n_heads=4 is not divisible"),
        (
            {"d_model": 12, "attention": {"n_heads": 4}, "position": {"kind": "rope"}},
            r"head_dim must be even, got 3",
        ),
        ({"d_model": -64}, r"d_model: must be > 0, got -64"),
        ({"n_layers": 0}, r"n_layers: must be > 0"),
        ({"vocab_size": -1}, r"vocab_size: must be > 0"),
        ({"attention": {"n_heads": -4}}, r"attention.n_heads: must be > 0"),
        ({"attention": {"n_kv_heads": 0}}, r"attention.n_kv_heads: must be > 0"),
        ({"ffn": {"hidden_dim": -8}}, r"ffn.hidden_dim: must be > 0"),
        ({"attention": {"sliding_window": 0}}, r"attention.sliding_window: must be > 0"),
        ({"dropout": 1.0}, r"dropout: must be in \[0, 1\)"),
        ({"init_std": float("nan")}, r"init_std: must be > 0, got nan"),
        ({"norm": {"eps": float("nan")}}, r"norm.eps: must be > 0, got nan"),
        ({"init_std": float("inf")}, r"init_std: must be finite, got inf"),
        ({"norm": {"eps": float("inf")}}, r"norm.eps: must be finite, got inf"),
        ({"position": {"rope_theta": float("inf")}}, r"position.rope_theta: must be finite"),
        # YaRN's temperatures and LLaMA 3's factor: NaN or inf gave NaN logits
        ({"position": {"rope_mscale": float("nan")}}, r"position.rope_mscale: must be a finite"),
        (
            {"position": {"rope_mscale_all_dim": float("inf")}},
            r"position.rope_mscale_all_dim: must be a finite number or null, got inf",
        ),
        (
            {"position": {"rope_scaling": "llama3", "rope_high_freq_factor": float("nan")}},
            r"position.rope_high_freq_factor: must be > 0, got nan",
        ),
        ({"attention": {"backend": "flashy"}}, r"attention.backend: unknown value 'flashy'"),
        ({"norm": {"placement": "middle"}}, r"norm.placement: unknown value"),
        ({"position": {"rope_layout": "pairs"}}, r"position.rope_layout: unknown value"),
        # LongRoPE's factors: both lists, one factor per rotated pair, positive, and only
        # with longrope scaling; the partial rotation: a fraction giving an even width
        (
            {"position": {"kind": "rope", "rope_scaling": "longrope", "rope_long_factor": [1.0]}},
            r"position.rope_short_factor: rope_scaling 'longrope' needs one factor per rotated",
        ),
        (
            {
                "position": {
                    "kind": "rope",
                    "rope_scaling": "longrope",
                    "rope_short_factor": [1.0] * 16,
                    "rope_long_factor": [2.0] * 7,
                }
            },
            r"position.rope_long_factor: has 7 factors; LongRoPE needs one per rotated pair of "
            r"dimensions: rope_dim / 2 = 16",
        ),
        (
            {
                "position": {
                    "kind": "rope",
                    "rope_scaling": "longrope",
                    "rope_short_factor": [1.0] * 16,
                    "rope_long_factor": [2.0, 0.0] * 8,
                }
            },
            r"position.rope_long_factor\[1\]: must be > 0, got 0.0",
        ),
        (
            {"position": {"kind": "rope", "rope_scaling": "yarn", "rope_short_factor": [1.0]}},
            r"position.rope_short_factor: is read by rope_scaling 'longrope' only",
        ),
        (
            {
                "position": {
                    "kind": "rope",
                    "rope_scaling": "longrope",
                    "rope_short_factor": [1.0],
                    "rope_long_factor": [1.0],
                    "rope_original_max_seq_len": 1,
                }
            },
            r"position.rope_original_max_seq_len: must be >= 2 with longrope, got 1",
        ),
        (
            {"position": {"kind": "rope", "rope_fraction": 0.0}},
            r"position.rope_fraction: must be in \(0, 1\], got 0.0",
        ),
        ({"position": {"kind": "learned", "rope_fraction": 0.5}}, r"needs position.kind 'rope'"),
        (
            {"position": {"kind": "rope", "rope_fraction": 0.1}},
            r"position.rope_fraction: rotates int\(32 \* 0.1\) = 3 features of each head; RoPE",
        ),
        (
            {"attention": {"kind": "linear"}, "position": {"kind": "rope", "rope_fraction": 0.5}},
            r"position.rope_fraction: is implemented by attention.kind='mha' only, not 'linear'",
        ),
        (
            {
                "attention": {"sliding_window": 8, "sink_tokens": 2},
                "position": {
                    "kind": "rope",
                    "rope_scaling": "longrope",
                    "rope_short_factor": [1.0] * 16,
                    "rope_long_factor": [2.0] * 16,
                },
            },
            r"attention.sink_tokens: attention sinks rotate cached keys again",
        ),
    ],
)
def test_inconsistent_values_rejected(data, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_dict(data)


@pytest.mark.parametrize(
    "data, match",
    [
        (
            {"schedule": "linear"},
            r"train.schedule: unknown value 'linear'; choose one of cosine, wsd",
        ),
        ({"decay_fraction": 0.0}, r"train.decay_fraction: must be in \(0, 1\], got 0.0"),
        ({"decay_fraction": 1.5}, r"train.decay_fraction: must be in \(0, 1\], got 1.5"),
        # a floor above the peak would make the "decay" raise the rate
        ({"lr": 1e-4, "min_lr": 3e-4}, r"train.min_lr: must be <= train.lr \(0.0001\), got 0.0003"),
    ],
)
def test_schedule_settings_checked(data, match):
    with pytest.raises(ConfigError, match=match):
        RunConfig.from_dict({"train": data})


def test_head_dim_override_allows_indivisible_d_model():
    cfg = ModelConfig.from_dict({"d_model": 100, "attention": {"n_heads": 3, "head_dim": 32}})
    assert cfg.head_dim == 32


@pytest.mark.parametrize("name", list(PRESETS))
def test_json_round_trip_every_preset(name, tmp_path):
    cfg = get_preset(name)
    again = ModelConfig.from_json(cfg.to_json())
    assert again == cfg
    assert again.to_dict() == cfg.to_dict()
    path = tmp_path / "config.json"
    cfg.save(path)
    assert ModelConfig.load(path) == cfg
    run = RunConfig(model=cfg)
    assert RunConfig.from_json(run.to_json()) == run


def test_load_names_the_file_in_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"missing\.json: config file not found"):
        ModelConfig.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match=r"bad\.json: not valid JSON"):
        ModelConfig.load(bad)


def test_train_config_rejects_nan():
    with pytest.raises(ConfigError, match=r"train.lr: must be > 0, got nan"):
        RunConfig.from_dict({"train": {"lr": float("nan")}})
    with pytest.raises(ConfigError, match=r"train.weight_decay: must be >= 0, got nan"):
        RunConfig.from_dict({"train": {"weight_decay": float("nan")}})


def test_train_config_rejects_infinity_and_seeds_torch_cannot_take():
    with pytest.raises(ConfigError, match=r"train.lr: must be finite, got inf"):
        RunConfig.from_dict({"train": {"lr": float("inf")}})
    with pytest.raises(ConfigError, match=r"train.weight_decay: must be finite, got inf"):
        RunConfig.from_dict({"train": {"weight_decay": float("inf")}})
    with pytest.raises(ConfigError, match=r"train.seed: must be from -2\*\*63 to 2\*\*63 - 1"):
        RunConfig.from_dict({"train": {"seed": 2**64}})
    assert RunConfig.from_dict({"train": {"seed": -5}}).train.seed == -5


def test_integers_past_int64_are_refused_by_name():
    """Torch's sizes and counts are int64: a d_model of 1e300 was taken (info printed its
    301 digits, kv failed converting it to a float), and a batch of 1e18 sequences
    accumulated 1e18 times overflowed torch.randint's size (a TypeError traceback)."""
    int64 = r"must be from -2\*\*63 to 2\*\*63 - 1 \(torch's int64\)"
    with pytest.raises(ConfigError, match=rf"^d_model: {int64}, got 1\.000e\+300$"):
        ModelConfig.from_dict({"d_model": 10**300})
    # a field of int or null: its own message, not "expected int or null"
    with pytest.raises(ConfigError, match=rf"^attention.sliding_window: {int64}, got 1\.000e\+30"):
        ModelConfig.from_dict({"attention": {"sliding_window": 1e30}})
    assert ModelConfig.from_dict({"n_layers": 2**63 - 1}).n_layers == 2**63 - 1
    with pytest.raises(ConfigError, match=r"^train.grad_accum: 2 x 4611686018427387904 accum"):
        RunConfig.from_dict({"train": {"batch_size": 2, "grad_accum": 2**62}})


def test_round_trip_detects_change():
    cfg = get_preset("gpt2-tiny")
    other = ModelConfig.from_json(cfg.to_json().replace('"n_layers": 2', '"n_layers": 3'))
    assert other != cfg and other.n_layers == 3


def test_override_dotted_keys():
    cfg = get_preset("llama-tiny")
    new = cfg.override({"attention.n_kv_heads": 1, "d_model": 128, "position.rope_theta": 1e6})
    assert new.n_kv_heads == 1 and new.d_model == 128 and new.position.rope_theta == 1e6
    assert cfg.n_kv_heads == 2 and cfg.d_model == 64  # the original is untouched
    with pytest.raises(ConfigError, match=r"attention.n_kv_head: unknown key; did you mean"):
        cfg.override({"attention.n_kv_head": 1})
    with pytest.raises(ConfigError, match=r"atention: unknown section; did you mean 'attention'"):
        cfg.override({"atention.n_heads": 2})
    with pytest.raises(ConfigError, match=r"sections of the top level: attention, ffn, norm"):
        cfg.override({"foo.bar": 2})
    with pytest.raises(ConfigError, match=r"n_heads=4 is not divisible"):
        cfg.override({"attention.n_kv_heads": 3})
    with pytest.raises(ConfigError, match=r"d_model: expected an integer"):
        cfg.override({"d_model": "wide"})


def test_glu_default_hidden_size():
    def llama_rule(d: int, multiple_of: int) -> int:
        hidden = int(2 * (4 * d) / 3)  # 2/3 of a 4d MLP keeps the parameter count
        return multiple_of * ((hidden + multiple_of - 1) // multiple_of)

    assert FFNConfig(kind="glu", multiple_of=256).hidden_size(4096) == llama_rule(4096, 256)
    assert llama_rule(4096, 256) == 11008  # LLaMA 7B's published FFN size
    for d, m in [(64, 32), (96, 1), (100, 64), (768, 256)]:
        assert FFNConfig(kind="glu", multiple_of=m).hidden_size(d) == llama_rule(d, m)
    assert FFNConfig(kind="mlp").hidden_size(96) == 4 * 96
    assert FFNConfig(kind="glu", hidden_dim=40).hidden_size(96) == 40


def expected_parameters(cfg: ModelConfig) -> int:
    """Parameter count written from the architecture, independent of the module code."""
    d, h, h_kv, d_h = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    a, f, nrm = cfg.attention, cfg.ffn, cfg.norm
    norm = d * (2 if nrm.kind in ("layernorm", "layernorm1p") and nrm.bias else 1)
    attn = d * (h + 2 * h_kv) * d_h + (h + 2 * h_kv) * d_h * a.qkv_bias
    attn += h * d_h * d + d * a.out_bias
    # QK-norm: one weight (and bias) for queries, one for keys: shared by the heads (d_h
    # each), each head its own, or over the whole projections (h d_h and h_kv d_h)
    shared = a.qk_norm_scope == "head" and a.qk_norm_weight == "shared"
    attn += (2 * d_h if shared else (h + h_kv) * d_h) * (1 + a.qk_norm_bias) * a.qk_norm
    attn += h * a.sink_logits  # GPT-OSS: a learned sink logit per head
    if a.kind in ("mla", "dsa"):  # DeepSeek-V2 eq. 9-19: down/up projections, latent norms
        q_r, kv_r = a.q_lora_rank, a.kv_lora_rank
        qk, rope, v = a.qk_nope_head_dim + a.qk_rope_head_dim, a.qk_rope_head_dim, a.v_head_dim
        q = d * h * qk if q_r is None else d * q_r + q_r * a.qkv_bias + q_r + q_r * h * qk
        kv = (
            d * (kv_r + rope)
            + (kv_r + rope) * a.qkv_bias
            + kv_r
            + kv_r * h * (a.qk_nope_head_dim + v)
        )
        attn = q + kv + h * v * d + d * a.out_bias
    if a.kind == "dsa":  # DeepSeek-V3.2 indexer: wq_b, wk, k_norm (LayerNorm), weights_proj
        d_i = a.index_head_dim or max(32, a.qk_rope_head_dim)
        attn += a.q_lora_rank * a.index_n_heads * d_i + d * d_i + 2 * d_i + d * a.index_n_heads
    hidden = f.hidden_size(d)
    if f.kind == "mlp":
        ffn = 2 * d * hidden + (hidden + d) * f.bias
    else:
        ffn = 3 * d * hidden + (2 * hidden + d) * f.bias
    ffns = cfg.n_layers * ffn
    if f.kind == "moe":  # router E d (its balance bias is a buffer), routed + shared experts
        # (GPT-OSS: a router bias of E, each expert's biases 2 f + d; Qwen2-MoE: a gate
        # (1, d) on the shared experts' output)
        per_expert = 3 * d * f.moe_hidden_dim + (2 * f.moe_hidden_dim + d) * f.expert_bias
        moe = f.n_routed_experts * (d + f.router_bias) + d * f.shared_expert_gate
        moe += per_expert * (f.n_routed_experts + f.n_shared_experts)
        n_dense = f.first_k_dense + len(f.dense_layers)  # (dense_layers: past the first ones)
        ffns = n_dense * ffn + (cfg.n_layers - n_dense) * moe
    total = cfg.vocab_size * d  # token embedding
    total += cfg.max_seq_len * d if cfg.position.kind == "learned" else 0
    # a LayerNorm on the embeddings (BLOOM's; an encoder config's embedding_norm, True by
    # default, builds one too), biased as the blocks' norms
    total += (2 * d if nrm.bias else d) * cfg.embedding_norm
    pos = cfg.position
    if pos.kind == "relative_bias":  # T5's (buckets, h) table, one per layer in UMT5's
        total += pos.relative_buckets * h * (cfg.n_layers if pos.relative_bias_per_layer else 1)
    # (sandwich: a norm after each too; post_sublayer: one after each, none before;
    # parallel_shared: one norm both sublayers read)
    n_norms = {"sandwich": 4, "parallel_shared": 1}.get(nrm.placement, 2)
    total += cfg.n_layers * (attn + n_norms * norm) + ffns
    total += norm if nrm.placement != "post" else 0  # final norm
    total += 0 if cfg.tie_embeddings else cfg.vocab_size * d
    total += cfg.vocab_size * cfg.final_logits_bias  # the head's own bias (Phi, GPT-J)
    return total


# (the DeBERTa presets' disentangled attention is an encoder's only, not a decoder's: their
# counts are checked against transformers' in tests/test_interop_deberta_v2.py)
@pytest.mark.parametrize("name", [n for n in PRESETS if not n.startswith("deberta-")])
def test_preset_parameter_counts_on_meta_device(name):
    cfg = get_preset(name)
    with torch.device("meta"):
        model = DecoderLM(cfg)
    assert model.tok_emb.weight.is_meta
    assert model.num_parameters() == expected_parameters(cfg)


def test_gpt2_is_124m():
    cfg = get_preset("gpt2")
    with torch.device("meta"):
        n = DecoderLM(cfg).num_parameters()
    d, n_layers = 768, 12
    # 50257 x 768 tokens + 1024 x 768 positions + 12 layers x (12 d^2 + 13 d) + final LayerNorm.
    assert n == 50257 * d + 1024 * d + n_layers * (12 * d * d + 13 * d) + 2 * d
    assert round(n / 1e6) == 124


@pytest.mark.parametrize("kind", ["mla", "dsa"])
@pytest.mark.parametrize(
    "sinks",
    [{"sink_logits": True}, {"sliding_window": 8, "sink_tokens": 2}],
    ids=["logits", "tokens"],
)
def test_latent_attention_refuses_sinks_it_does_not_implement(kind, sinks):
    """Sinks are multi-head attention's: on latent attention they would be silently ignored
    (no sink parameter, no kept sink keys), so the config says so."""
    attention = {"kind": kind, "q_lora_rank": 24, **sinks}
    name = next(iter(k for k in sinks if k.startswith("sink")))
    with pytest.raises(ConfigError, match=rf"attention\.{name}: is implemented by .*'mha' only"):
        ModelConfig.from_dict({"d_model": 64, "attention": attention}).validate()
    attention = {k: v for k, v in attention.items() if not k.startswith("sink")}
    ModelConfig.from_dict({"d_model": 64, "attention": attention}).validate()


@pytest.mark.parametrize("kind", ["mla", "dsa", "nsa", "linear"])
def test_qk_norm_is_refused_where_it_is_not_implemented(kind):
    """QK-norm is multi-head attention's: another kind would build without it."""
    attention = {"kind": kind, "qk_norm": True} | ({"q_lora_rank": 24} if kind == "dsa" else {})
    with pytest.raises(
        ConfigError, match=rf"^attention\.qk_norm: is implemented by .*'mha' only, not '{kind}'"
    ):
        ModelConfig.from_dict({"d_model": 64, "attention": attention})
    ModelConfig.from_dict({"d_model": 64, "attention": {**attention, "qk_norm": False}})
    ModelConfig.from_dict({"d_model": 64, "attention": {"qk_norm": True}})  # mha


@pytest.mark.parametrize(
    "data, named",
    [
        ({"position": {"kind": "rope", "local_rope_theta": 100.0}},
         "position.local_rope_theta: applies to local layers, and none has a window"),
        ({"position": {"kind": "learned", "local_rope_theta": 100.0}},
         "position.local_rope_theta: needs position.kind 'rope', got 'learned'"),
        ({"position": {"kind": "rope", "local_rope_theta": 0.0}},
         "position.local_rope_theta: must be > 0"),
        ({"position": {"kind": "rope", "local_rope_theta": 100.0},
          "attention": {"kind": "mla", "sliding_window": 4}},
         "position.local_rope_theta: is implemented by attention.kind='mha' only, not 'mla'"),
        ({"arch": "seq2seq", "position": {"kind": "rope", "local_rope_theta": 100.0},
          "attention": {"sliding_window": 4}},
         "position.local_rope_theta: is implemented by the decoder and encoder architectures "
         "only, not 'seq2seq'"),
        ({"arch": "encoder", "scale_embeddings": True},
         "scale_embeddings: is implemented by the decoder and seq2seq architectures only"),
        ({"arch": "vit", "norm": {"placement": "sandwich"}},
         "norm.placement: 'sandwich' is implemented by the decoder architecture only"),
        ({"arch": "xl", "position": {"kind": "none"}, "attention": {"scale": 0.5}},
         "attention.scale: does not apply to Transformer-XL"),
    ],
)  # fmt: skip
def test_gemma_pieces_are_refused_where_they_are_not_implemented(data, named):
    """Gemma 3's pieces (a second RoPE base for local layers, scaled embeddings, sandwich
    norms, a softmax scale) where the model would build without them: refused by name."""
    with pytest.raises(ConfigError, match=re.escape(named)):
        ModelConfig.from_dict({"d_model": 64, **data})


@pytest.mark.parametrize(
    "data, named",
    [
        ({"arch": "encoder", "norm": {"placement": "post_sublayer"}},
         "norm.placement: 'post_sublayer' is implemented by the decoder architecture only, "
         "not 'encoder'"),
        ({"arch": "xl", "position": {"kind": "none"}, "norm": {"placement": "post_sublayer"}},
         "norm.placement: 'post_sublayer' is implemented by the decoder architecture only, "
         "not 'xl'"),
        ({"attention": {"qk_norm_scope": "projection"}},
         "attention.qk_norm_scope: 'projection' says what QK-norm normalises, and "
         "attention.qk_norm is false"),
        ({"attention": {"qk_norm": True, "qk_norm_scope": "heads"}},
         "attention.qk_norm_scope: unknown value 'heads'; choose one of head, projection"),
        ({"attention": {"kind": "mla", "qk_norm": True, "qk_norm_scope": "projection"}},
         "attention.qk_norm: is implemented by attention.kind='mha' only, not 'mla'"),
        ({"arch": "xl", "position": {"kind": "none"},
          "attention": {"qk_norm": True, "qk_norm_scope": "projection"}},
         "attention.qk_norm: does not apply to Transformer-XL"),
    ],
)  # fmt: skip
def test_olmo2_pieces_are_refused_where_they_are_not_implemented(data, named):
    """OLMo 2's pieces (norms on the sublayers' outputs only, QK-norm over whole
    projections) where the model would build without them, or a scope without QK-norm:
    refused by name."""
    with pytest.raises(ConfigError, match=re.escape(named)):
        ModelConfig.from_dict({"d_model": 64, **data})


@pytest.mark.parametrize(
    "attention, named",
    [
        ({"qk_norm_kind": "layernorm"},
         "attention.qk_norm_kind: 'layernorm' says what QK-norm is, and attention.qk_norm is "
         "false: set it to true, or qk_norm_kind to 'rmsnorm'"),
        ({"qk_norm_bias": True},
         "attention.qk_norm_bias: true says what QK-norm is, and attention.qk_norm is false: "
         "set it to true, or qk_norm_bias to false"),
        ({"qk_norm_weight": "per_head"},
         "attention.qk_norm_weight: 'per_head' says what QK-norm is, and attention.qk_norm is "
         "false"),
        ({"qk_norm": True, "qk_norm_kind": "layer"},
         "attention.qk_norm_kind: unknown value 'layer'; choose one of rmsnorm, layernorm"),
        ({"qk_norm": True, "qk_norm_weight": "heads"},
         "attention.qk_norm_weight: unknown value 'heads'; choose one of shared, per_head"),
        ({"qk_norm": True, "qk_norm_bias": True},
         "attention.qk_norm_bias: an RMSNorm has no bias: set attention.qk_norm_kind to "
         "'layernorm', or qk_norm_bias to false"),
        ({"qk_norm": True, "qk_norm_weight": "per_head", "qk_norm_scope": "projection"},
         "attention.qk_norm_weight: 'per_head' needs attention.qk_norm_scope='head'"),
    ],
)  # fmt: skip
def test_qk_norm_kinds_are_validated(attention, named):
    """QK-norm's kind, bias and weights: unknown values, settings without QK-norm, a bias
    on an RMSNorm, a weight per head over whole projections: refused by name."""
    with pytest.raises(ConfigError, match=re.escape(named)):
        ModelConfig.from_dict({"d_model": 64, "attention": attention})


@pytest.mark.parametrize(
    "attention",
    [
        {"qk_norm_kind": "layernorm", "qk_norm_bias": True},
        {"qk_norm_kind": "layernorm", "qk_norm_weight": "per_head"},
        {"qk_norm_weight": "per_head"},
        {"qk_norm_kind": "layernorm", "qk_norm_scope": "projection", "qk_norm_bias": True},
    ],
    ids=["phi", "cohere", "rms-per-head", "layernorm-projection"],
)
def test_qk_norm_kinds_count_their_parameters(attention):
    """The calculator, the formula written here and the built model agree for every kind."""
    from attnlab.analysis import count_parameters

    cfg = ModelConfig.from_dict(
        {"d_model": 32, "n_layers": 2, "vocab_size": 50,
         "attention": {"n_heads": 4, "n_kv_heads": 2, "qk_norm": True, **attention}}
    )  # fmt: skip
    model = DecoderLM(cfg)
    assert model.num_parameters() == expected_parameters(cfg) == count_parameters(cfg)["total"]


def test_scale_embeddings_is_one_field_for_decoders_and_seq2seq():
    """The decoder's field is the encoder-decoder's: off by default for decoders, on for
    seq2seq models (Vaswani et al.), as before."""
    from attnlab.models.seq2seq import Seq2SeqConfig

    assert ModelConfig().scale_embeddings is False
    assert Seq2SeqConfig().scale_embeddings is True
    assert ModelConfig.from_dict({"scale_embeddings": True}).scale_embeddings
