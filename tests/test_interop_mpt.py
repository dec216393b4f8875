"""MPT checkpoints: transformers models from tiny random configs (6 heads: the interleaved
ALiBi slopes, tied head; 4 heads with an untied head, 3 layers, another epsilon, a softmax
scale of their own and alibi_bias_max 16; 2 heads with clip_qkv) with every weight set to
random values, loaded with ``load_hf``, give the same logits (with left padding), loss and
gradients, and the same greedy tokens with the KV cache; attnlab models saved with
``save_hf`` load in transformers with the same logits and load back exactly; what neither
side can hold is refused by name.

transformers' ``MptModel`` builds its slopes with 8 whatever ``alibi_bias_max`` says
(MosaicML's code, which trained the checkpoints, reads it): the case with 16 gives its
reference model transformers' own ``build_mpt_alibi_tensor`` called with 16.

Shapes: b batch, t length, V vocabulary, h heads, d_h head dim.
"""

from __future__ import annotations

import functools
import re

import pytest
import torch
from hf_cases import HFCases, imported_fixture, transformers
from oracle import (
    assert_greedy_tokens_match_hf,
    assert_left_padded_logits_match_hf,
    assert_logits_match_hf,
    hf_training_loss,
    left_padded_batch,
)
from safetensors.torch import load_file

from attnlab.config import PositionConfig
from attnlab.interop import HFCheckpointError, config_from_hf, hf_model_type, load_hf, save_hf
from attnlab.interop.mpt import ATTN_DEFAULTS
from attnlab.models.decoder import DecoderLM
from attnlab.nn.position_bias import AlibiBias
from attnlab.presets import get_preset

V = 97
TOL = 1e-5  # float32 logits up to ~5 (weights of std 0.3)
CTX = 64  # max_seq_len: transformers' bias covers it; every test sequence is shorter
CASES = {
    # 6 heads of 8: slopes 2^-2, 2^-4, 2^-6, 2^-8, then 2^-1, 2^-3 (the 8-head sequence's)
    "six-heads-tied": dict(d_model=48, n_layers=2, n_heads=6, max_seq_len=CTX),
    # 4 heads of 8, 3 layers, an untied head, another epsilon, softmax_scale 0.3 and the
    # slopes of alibi_bias_max 16 (2^-4, 2^-8, 2^-12, 2^-16)
    "untied-scaled-max16": dict(
        d_model=32,
        n_layers=3,
        n_heads=4,
        max_seq_len=CTX,
        tie_word_embeddings=False,
        layer_norm_epsilon=1e-3,
        attn_config=dict(softmax_scale=0.3, alibi_bias_max=16),
    ),
    # 2 heads of 16 with the fused projection clamped to [-0.5, 0.5] (most entries are
    # larger: the weights have std 0.3)
    "clip-qkv": dict(
        d_model=32, n_layers=2, n_heads=2, max_seq_len=CTX, attn_config=dict(clip_qkv=0.5)
    ),
}


def _is_norm(name: str, p: torch.Tensor) -> bool:
    """LayerNorm weights (norm_1, norm_2, norm_f) in [0.5, 1.5), every other weight random."""
    return p.dim() == 1 and "norm" in name


HF = HFCases("MptConfig", "MptForCausalLM", CASES, V, norms=(0.5, 1.5), is_norm=_is_norm)


def _hf_model(case: str, seed: int = 0) -> torch.nn.Module:
    """HF.model, its ALiBi built with the config's alibi_bias_max (transformers' MptModel
    passes none to its ``build_mpt_alibi_tensor``, whose default is 8)."""
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    model = HF.model(case, seed)
    bias_max = model.config.attn_config.alibi_bias_max
    if bias_max != 8:
        build = functools.partial(build_mpt_alibi_tensor, alibi_bias_max=bias_max)
        model.transformer.build_mpt_alibi_tensor = build
    return model


imported = imported_fixture(CASES, _hf_model)


def test_import_config_and_fused_qkv_layout(imported):
    """The config as transformers reads it (ALiBi after the scale, no norm on the
    embeddings, no biases, the exact GELU, 4 d MLP); Wqkv's rows are attn.qkv's [q; k; v]."""
    case, ref, model = imported
    cfg, hf = model.cfg, ref.config
    att = hf.attn_config
    assert model.num_parameters() == ref.num_parameters()
    assert config_from_hf(hf.to_dict()) == cfg  # the in-memory config, not only config.json
    assert cfg.position.kind == "alibi" and not cfg.position.alibi_scaled
    assert cfg.position.alibi_max_bias == att.alibi_bias_max
    assert cfg.attention.scale == att.softmax_scale and cfg.attention.clip_qkv == att.clip_qkv
    assert not cfg.embedding_norm and cfg.norm.placement == "pre"
    assert cfg.ffn.activation == "gelu" and cfg.ffn.hidden_dim == 4 * hf.d_model
    assert (cfg.n_layers, cfg.n_heads, cfg.norm.eps) == (
        hf.n_layers,
        hf.n_heads,
        hf.layer_norm_epsilon,
    )
    assert cfg.tie_embeddings == hf.tie_word_embeddings
    assert not [k for k in model.state_dict() if k.endswith("bias")]  # no biases, no ALiBi weights
    theirs, ours = ref.transformer.blocks[1].attn, model.blocks[1].attn
    assert torch.equal(ours.qkv.weight, theirs.Wqkv.weight)
    assert torch.equal(ours.out.weight, theirs.out_proj.weight)


def test_import_logits(imported):
    case, ref, model = imported
    assert_logits_match_hf(ref, model, V, TOL)
    assert_left_padded_logits_match_hf(ref, model, V, TOL)


def test_import_greedy_generation(imported):
    """Greedy tokens with the KV cache, one prompt and a left-padded batch of two."""
    case, ref, model = imported
    assert_greedy_tokens_match_hf(ref, model, V, n=10)


def test_training_loss_and_gradients_match_transformers(imported):
    """A loss backward in training mode over a left-padded batch: the loss and the
    gradients of the fused projection, the norms, the MLP and the embedding are
    transformers'."""
    case, ref, model = imported
    ref, model = ref.train(), model.train()
    idx, mask = left_padded_batch(V)
    targets = torch.cat([idx[:, 1:], torch.full_like(idx[:, :1], -100)], 1)
    targets = targets.masked_fill(mask == 0, -100)
    ours = model(idx, attention_mask=mask, targets=targets).loss
    theirs = hf_training_loss(ref, idx, targets, mask)
    ours.backward()
    theirs.backward()
    try:
        assert abs(ours.item() - theirs.item()) <= 1e-5
        block, layer, tr = model.blocks[1], ref.transformer.blocks[1], ref.transformer
        pairs = [
            (block.attn.qkv.weight.grad, layer.attn.Wqkv.weight.grad),
            (block.attn.out.weight.grad, layer.attn.out_proj.weight.grad),
            (block.attn_norm.weight.grad, layer.norm_1.weight.grad),
            (block.ffn_norm.weight.grad, layer.norm_2.weight.grad),
            (block.ffn.up.weight.grad, layer.ffn.up_proj.weight.grad),
            (block.ffn.down.weight.grad, layer.ffn.down_proj.weight.grad),
            (model.norm.weight.grad, tr.norm_f.weight.grad),
            (model.tok_emb.weight.grad, tr.wte.weight.grad),
        ]
        for got, want in pairs:
            # float32 sums over the batch in different orders: 1e-4
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    finally:
        ref.eval().zero_grad()
        model.eval().zero_grad()


@pytest.mark.parametrize("n_heads, bias_max", [(6, 8), (4, 16)])
def test_mpt_bias_is_ours_plus_a_constant_per_query_row(n_heads, bias_max):
    """MPT biases key j by m_h (j - (s - 1)) for every query; attnlab by -m_h (i - j) over
    positions that count real tokens. Over the keys a query of a left-padded row sees (real,
    not after it) the two differ by one constant per (row, head, query), which softmax
    ignores."""
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    idx, mask = left_padded_batch(V)
    s = idx.shape[1]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (b, s)
    cfg = PositionConfig(kind="alibi", alibi_max_bias=float(bias_max))
    ours = AlibiBias(cfg, n_heads, bidirectional=False, n_layers=1)(positions, positions)
    theirs = build_mpt_alibi_tensor(n_heads, s, alibi_bias_max=bias_max)  # (h, 1, s)
    seen = mask.bool()[:, None, :] & torch.ones(s, s).tril().bool()  # (b, t, s)
    diff = (ours - theirs[None]).masked_fill(~seen[:, None], float("nan"))  # (b, h, t, s)
    real = mask.bool()[:, None, :, None].expand_as(diff)  # real queries
    row_min = diff.nan_to_num(float("inf")).amin(-1, keepdim=True)
    row_max = diff.nan_to_num(float("-inf")).amax(-1, keepdim=True)
    spread = (row_max - row_min).expand_as(diff)[real]
    assert spread.abs().max() <= 1e-5
    assert (row_max - row_min).expand_as(diff)[real].numel() > 0
    assert (row_min.expand_as(diff)[real].abs() > 0).any()  # the biases do differ


# --------------------------------------------------------------------------- export


def _tiny(**changes):
    return get_preset("mpt-tiny").override({"vocab_size": V, **changes})


EXPORTS = {
    "mpt-tiny": _tiny(),
    # 3 heads of 16 (slopes 2^-4, 2^-8, 2^-2), an untied head, 3 layers, a softmax scale of
    # its own, the projections clamped, another epsilon
    "three-heads-untied-scaled-clipped": _tiny(
        **{
            "attention.n_heads": 3,
            "d_model": 48,
            "ffn.hidden_dim": 192,
            "n_layers": 3,
            "tie_embeddings": False,
            "max_seq_len": 96,
            "norm.eps": 1e-4,
            "attention.scale": 0.2,
            "attention.clip_qkv": 0.8,
        }
    ),
}


@pytest.mark.parametrize("name", list(EXPORTS))
def test_export_round_trip(name, tmp_path):
    cfg = EXPORTS[name]
    torch.manual_seed(20)
    model = DecoderLM(cfg).eval()
    HF.randomize(model, seed=len(name))
    assert hf_model_type(cfg) == "mpt"
    save_hf(model, tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    assert ("lm_head.weight" in stored) == (not cfg.tie_embeddings)
    assert not [k for k in stored if k.endswith("bias")]

    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert type(ref).__name__ == "MptForCausalLM"
    assert ref.config.attn_config.clip_qkv == cfg.attention.clip_qkv
    assert_logits_match_hf(ref.eval(), model, V, TOL)
    assert_left_padded_logits_match_hf(ref, model, V, TOL)

    back = load_hf(tmp_path)  # import(export(x)): the same model, the same numbers
    assert back.cfg == cfg
    mine = model.state_dict()
    assert back.state_dict().keys() == mine.keys()
    assert all(torch.equal(v, mine[k]) for k, v in back.state_dict().items())
    idx, mask = left_padded_batch(V)
    with torch.no_grad():
        again = back(idx, attention_mask=mask).logits
        assert torch.equal(again, model(idx, attention_mask=mask).logits)
    save_hf(back, tmp_path / "again")  # export(import(export(x))) writes the same tensors
    twice = load_file(tmp_path / "again" / "model.safetensors")
    assert twice.keys() == stored.keys()
    assert all(torch.equal(twice[k], stored[k]) for k in stored)


# --------------------------------------------------------------------------- refusals


def _hf_dict(**attn) -> dict:
    case = {k: v for k, v in CASES["six-heads-tied"].items()}
    return {"model_type": "mpt", "vocab_size": V, **case, "attn_config": attn}


@pytest.mark.parametrize(
    "attn, top, named",
    [
        ({"alibi": False}, {}, "attn_config.alibi=false is not supported"),
        ({"attn_type": "multiquery_attention"}, {},
         "attn_config.attn_type='multiquery_attention' is not supported"),
        ({"prefix_lm": True}, {}, "attn_config.prefix_lm=true is not supported"),
        ({"attn_uses_sequence_id": True}, {},
         "attn_config.attn_uses_sequence_id=true is not supported"),
        ({"qk_ln": True}, {}, "attn_config.qk_ln=true is not supported"),
        ({"rope": True}, {}, "attn_config.rope=true is not supported"),
        ({}, {"no_bias": False}, "no_bias=false is not supported"),
        ({}, {"logit_scale": 0.5}, "logit_scale=0.5 is not supported"),
        ({}, {"embedding_fraction": 0.1}, "embedding_fraction=0.1 is not supported"),
        ({}, {"norm_type": "rmsnorm"}, "norm_type='rmsnorm' is not supported"),
        ({}, {"expansion_ratio": 1.01}, "expansion_ratio=1.01 is not supported"),
        ({}, {"n_heads": 5}, "d_model=48 is not divisible by attention.n_heads=5"),
    ],
    ids=["no-alibi", "multiquery", "prefix-lm", "sequence-id", "qk-ln", "rope", "biases",
         "logit-scale", "embedding-fraction", "rmsnorm", "expansion", "heads"],
)  # fmt: skip
def test_config_it_cannot_hold_is_refused_by_name(attn, top, named):
    with pytest.raises(HFCheckpointError, match=re.escape(named)):
        config_from_hf({**_hf_dict(**attn), **top})


def test_what_is_read_beside_the_refusals():
    """attn_config's defaults are transformers' MptAttentionConfig's; the MLP is
    expansion_ratio d wide (MosaicML's; transformers' port builds 4 d); clip_qkv 0 clamps
    nothing (transformers' ``if clip_qkv``); resid_pdrop and emb_pdrop are attnlab's one
    dropout, attn_pdrop the attention's; learned_pos_emb adds nothing beside ALiBi;
    hidden_size and the other aliases read as d_model, n_heads and n_layers."""
    defaults = transformers.MptConfig().attn_config
    assert all(getattr(defaults, k) == v for k, v in ATTN_DEFAULTS.items())
    cfg = config_from_hf(_hf_dict())
    assert cfg.position.alibi_max_bias == 8.0 and cfg.attention.clip_qkv is None
    assert cfg.max_seq_len == CTX and cfg.ffn.hidden_dim == 4 * 48
    assert config_from_hf({**_hf_dict(), "expansion_ratio": 2}).ffn.hidden_dim == 96
    assert config_from_hf(_hf_dict(clip_qkv=0)).attention.clip_qkv is None
    drops = config_from_hf(
        {**_hf_dict(attn_pdrop=0.2), "resid_pdrop": 0.1, "emb_pdrop": 0.1}
    )  # fmt: skip
    assert (drops.dropout, drops.attention.dropout) == (0.1, 0.2)
    assert config_from_hf({**_hf_dict(), "learned_pos_emb": True}) == cfg
    aliases = {"model_type": "mpt", "vocab_size": V, "max_seq_len": CTX, "hidden_size": 48,
               "num_attention_heads": 6, "num_hidden_layers": 2}  # fmt: skip
    assert config_from_hf(aliases) == cfg


def test_export_refuses_what_transformers_mpt_reads_otherwise():
    """Slopes of another largest bias and another MLP width: transformers' MPT would build
    8 and 4 d whatever config.json says; biases and other activations it has none of."""
    for changes, named in [
        ({"position.alibi_max_bias": 16.0}, "alibi_max_bias=16.0 (transformers' MPT builds"),
        ({"ffn.hidden_dim": 128}, "ffn.hidden_dim=128 (transformers' MPT MLP is 4 d_model"),
        ({"norm.bias": True}, "norm.bias (MPT has no biases"),
        ({"attention.qkv_bias": True}, "attention.qkv_bias (MPT has no biases"),
        ({"ffn.activation": "gelu_tanh"}, "ffn.activation='gelu_tanh' (MPT's is the exact"),
        ({"attention.n_kv_heads": 2}, "n_kv_heads=2 (MPT has one key/value head"),
        ({"attention.dropout": 0.1}, "attention.dropout=0.1 (transformers' MptAttentionConfig"),
    ]:
        with pytest.raises(HFCheckpointError, match=re.escape(named)):
            hf_model_type(_tiny(**changes))


def test_clip_qkv_is_a_positive_bound_of_multi_head_attention():
    from attnlab.config import AttentionConfig, ConfigError

    with pytest.raises(ConfigError, match=re.escape("attention.clip_qkv: must be > 0")):
        AttentionConfig(clip_qkv=-1.0).validate("attention")
    with pytest.raises(
        ConfigError, match=re.escape("clip_qkv: is implemented by attention.kind='mha'")
    ):
        AttentionConfig(kind="mla", clip_qkv=1.0).validate("attention")
