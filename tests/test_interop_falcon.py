"""Falcon checkpoints: transformers models from tiny random configs (Falcon-7B's block: one
shared norm, multi-query attention; sequential blocks with one key/value head per query
head, biases, transformers 4.x's RoPE keys with linear scaling and an untied head;
Falcon-40B's: two parallel norms and 3 key/value groups of 2 query heads, YaRN; the new
architecture with one shared norm, 4 groups and biases) with every weight set to random
values, loaded with ``load_hf``, give the same logits (with left padding), loss and
gradients, and the same greedy tokens; attnlab models saved with ``save_hf`` load in
transformers with the same logits and load back exactly; what neither side can hold is
refused by name.

Shapes: b batch, t length, V vocabulary, h heads, h_kv key/value heads, d_h head dim.
"""

from __future__ import annotations

import re

import pytest
import torch
from hf_cases import HFCases, transformers
from oracle import (
    assert_greedy_tokens_match_hf,
    assert_left_padded_logits_match_hf,
    assert_logits_match_hf,
    hf_training_loss,
    left_padded_batch,
)
from safetensors.torch import load_file

from attnlab.interop import HFCheckpointError, config_from_hf, hf_model_type, load_hf, save_hf
from attnlab.interop.falcon import grouped_rows
from attnlab.models.decoder import DecoderLM
from attnlab.presets import get_preset

V = 97
TOL = 1e-5  # float32 logits up to ~10 (weights of std 0.3): observed up to 8e-6
CASES = {
    # Falcon-7B's block: old architecture, one input_layernorm read by attention and MLP,
    # multi-query (3 query heads of 16, one key/value head), no biases, a tied head
    "7b-shared-mqa": dict(
        hidden_size=48,
        num_attention_heads=3,
        num_hidden_layers=2,
        max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 100.0},
    ),
    # sequential blocks (parallel_attn false), one key/value head per query head (4 of 8),
    # every linear layer biased, transformers 4.x's RoPE keys with linear scaling x2, an
    # untied head, the tanh GELU
    "sequential-mha-bias": dict(
        hidden_size=32,
        num_attention_heads=4,
        num_hidden_layers=2,
        max_position_embeddings=64,
        parallel_attn=False,
        multi_query=False,
        bias=True,
        rope_theta=50.0,
        rope_scaling={"type": "linear", "factor": 2.0},
        tie_word_embeddings=False,
        activation="gelu_new",
    ),
    # Falcon-40B's block: new architecture, ln_attn and ln_mlp side by side, 3 key/value
    # groups of 2 query heads of 8, an FFN width of its own, YaRN x2, an untied head
    "40b-grouped": dict(
        hidden_size=48,
        num_attention_heads=6,
        num_kv_heads=3,
        num_hidden_layers=2,
        new_decoder_architecture=True,
        ffn_hidden_size=80,
        max_position_embeddings=64,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 300.0,
            "factor": 2.0,
            "original_max_position_embeddings": 32,
        },
        tie_word_embeddings=False,
    ),  # fmt: skip
    # new architecture with one shared norm (num_ln_in_parallel_attn 1), 4 groups of 2
    # query heads of 8, biases, 3 layers
    "new-shared-bias": dict(
        hidden_size=64,
        num_attention_heads=8,
        num_kv_heads=4,
        num_hidden_layers=3,
        new_decoder_architecture=True,
        num_ln_in_parallel_attn=1,
        bias=True,
        max_position_embeddings=64,
    ),
}
PLACEMENTS = {
    "7b-shared-mqa": "parallel_shared",
    "sequential-mha-bias": "pre",
    "40b-grouped": "parallel",
    "new-shared-bias": "parallel_shared",
}
SCALINGS = {"sequential-mha-bias": "linear", "40b-grouped": "yarn"}  # (the others: none)


def _is_norm_weight(name: str, p: torch.Tensor) -> bool:
    """LayerNorm weights in [0.5, 1.5), every other parameter (their biases too) random."""
    return ("norm" in name or ".ln_" in name or "layernorm" in name) and name.endswith("weight")


HF = HFCases(
    "FalconConfig", "FalconForCausalLM", CASES, V, norms=(0.5, 1.5), is_norm=_is_norm_weight
)
imported = HF.imported_fixture()


def _per_query_head(x: torch.Tensor, h: int) -> torch.Tensor:
    """(n, d_h, d) keys or values of n heads -> (h, d_h, d), the one each query head reads."""
    return x.expand(h, *x.shape[1:]) if x.shape[0] == 1 else x.repeat_interleave(h // len(x), 0)


def test_import_config_and_fused_qkv_layout(imported):
    """The config as transformers reads it, and query_key_value's rows as transformers'
    own ``_split_heads`` takes them apart: attnlab's [q; k; v] gives each query head the
    query rows, and the key and value rows of the key/value head, that transformers does."""
    case, ref, model = imported
    cfg, hf = model.cfg, ref.config
    assert model.num_parameters() == ref.num_parameters()
    assert config_from_hf(hf.to_dict()) == cfg  # the in-memory config, not only config.json
    assert cfg.norm.placement == PLACEMENTS[case]
    assert cfg.position.rope_theta == hf.rope_parameters["rope_theta"]
    assert cfg.position.rope_scaling == SCALINGS.get(case)
    assert cfg.attention.qkv_bias == cfg.attention.out_bias == cfg.ffn.bias == hf.bias
    assert cfg.tie_embeddings == hf.tie_word_embeddings
    assert cfg.ffn.hidden_size(cfg.d_model) == hf.ffn_hidden_size
    h, h_kv, d_h = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    attn = ref.transformer.h[1].self_attention
    names = [("weight", attn.query_key_value.weight.T[None])]  # (1, d, rows): d "positions"
    if hf.bias:
        names.append(("bias", attn.query_key_value.bias[None, None]))  # (1, 1, rows)
    ours = model.blocks[1].attn.qkv
    for name, fused in names:
        with torch.no_grad():
            q, k, v = (x[0].permute(1, 2, 0) for x in attn._split_heads(fused))  # (n, d_h, .)
        mine = getattr(ours, name).reshape(h + 2 * h_kv, d_h, -1)  # (heads, d_h, d or 1)
        assert torch.equal(mine[:h], q)
        assert torch.equal(_per_query_head(mine[h : h + h_kv], h), _per_query_head(k, h))
        assert torch.equal(_per_query_head(mine[h + h_kv :], h), _per_query_head(v, h))


def test_import_logits(imported):
    case, ref, model = imported
    assert_logits_match_hf(ref, model, V, TOL)
    assert_left_padded_logits_match_hf(ref, model, V, TOL)


def test_import_greedy_generation(imported):
    case, ref, model = imported
    assert_greedy_tokens_match_hf(ref, model, V, n=10)


def test_training_loss_and_gradients_match_transformers(imported):
    """A loss backward in training mode over a left-padded batch: the loss and the
    gradients of the fused q/k/v projection (in Falcon's row order), the norms, the MLP
    and the embedding are transformers'."""
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
        block, layer = model.blocks[1], ref.transformer.h[1]
        cfg = model.cfg
        qkv = grouped_rows(block.attn.qkv.weight.grad, cfg.n_heads, cfg.n_kv_heads)
        pairs = [
            (qkv, layer.self_attention.query_key_value.weight.grad),
            (block.attn.out.weight.grad, layer.self_attention.dense.weight.grad),
            (block.ffn.up.weight.grad, layer.mlp.dense_h_to_4h.weight.grad),
            (block.ffn.down.weight.grad, layer.mlp.dense_4h_to_h.weight.grad),
            (model.norm.weight.grad, ref.transformer.ln_f.weight.grad),
            (model.tok_emb.weight.grad, ref.transformer.word_embeddings.weight.grad),
        ]
        if cfg.norm.placement == "parallel_shared":
            pairs.append((block.norm.bias.grad, layer.input_layernorm.bias.grad))
        elif cfg.norm.placement == "parallel":
            pairs.append((block.attn_norm.weight.grad, layer.ln_attn.weight.grad))
            pairs.append((block.ffn_norm.bias.grad, layer.ln_mlp.bias.grad))
        else:
            pairs.append((block.attn_norm.weight.grad, layer.input_layernorm.weight.grad))
            pairs.append((block.ffn_norm.bias.grad, layer.post_attention_layernorm.bias.grad))
        if cfg.ffn.bias:
            pairs.append((block.ffn.up.bias.grad, layer.mlp.dense_h_to_4h.bias.grad))
        for got, want in pairs:
            # float32 sums over the batch in different orders: 1e-4
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    finally:
        ref.eval().zero_grad()
        model.eval().zero_grad()


def test_headless_falcon_model_loads_with_the_tied_head(tmp_path):
    """A FalconModel folder (no ``transformer.`` prefix, no head) loads; its tied head gives
    the logits of its last hidden states times the embedding."""
    ref = HF.model("7b-shared-mqa", seed=5)
    ref.transformer.save_pretrained(tmp_path)
    model = load_hf(tmp_path)
    idx = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        hidden = ref.transformer(idx).last_hidden_state
        theirs = hidden @ ref.transformer.word_embeddings.weight.T
        assert (model(idx).logits - theirs).abs().max() <= TOL


# --------------------------------------------------------------------------- export


def _tiny(**changes):
    return get_preset("falcon-tiny").override({"vocab_size": V, **changes})


EXPORTS = {
    # Falcon-7B's block: old architecture, multi-query, tied
    "falcon-tiny": ("parallel_shared", False, _tiny()),
    # one shared norm with one key/value head per query head (the old architecture's
    # (h, 3, d_h) rows), every linear layer biased, interleaved RoPE pairs (q/k rows
    # permuted to rotate-half), an untied head
    "shared-mha-bias-interleaved": (
        "parallel_shared",
        False,
        _tiny(
            **{
                "attention.n_kv_heads": None,
                "attention.qkv_bias": True,
                "attention.out_bias": True,
                "ffn.bias": True,
                "position.rope_layout": "interleaved",
                "tie_embeddings": False,
            }
        ),
    ),
    # one shared norm with 2 groups: the new architecture, num_ln_in_parallel_attn 1;
    # linear scaling, the tanh GELU
    "shared-grouped-linear": (
        "parallel_shared",
        True,
        _tiny(
            **{
                "attention.n_kv_heads": 2,
                "position.rope_scaling": "linear",
                "position.rope_factor": 3.0,
                "ffn.activation": "gelu_tanh",
            }
        ),
    ),
    # Falcon-40B's block: two norms, 2 groups of 2 query heads, llama3 scaling, untied
    "parallel-grouped-llama3": (
        "parallel",
        True,
        _tiny(
            **{
                "norm.placement": "parallel",
                "attention.n_kv_heads": 2,
                "position.rope_scaling": "llama3",
                "position.rope_factor": 4.0,
                "position.rope_original_max_seq_len": 32,
                "tie_embeddings": False,
            }
        ),
    ),
}


@pytest.mark.parametrize("name", list(EXPORTS))
def test_export_round_trip(name, tmp_path):
    placement, new_architecture, cfg = EXPORTS[name]
    assert cfg.norm.placement == placement
    torch.manual_seed(20)
    model = DecoderLM(cfg).eval()
    HF.randomize(model, seed=len(name))
    assert hf_model_type(cfg) == "falcon"
    save_hf(model, tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    assert ("lm_head.weight" in stored) == (not cfg.tie_embeddings)
    assert ("transformer.h.0.self_attention.dense.bias" in stored) == cfg.attention.out_bias

    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert type(ref).__name__ == "FalconForCausalLM"
    hf = ref.config
    assert hf.new_decoder_architecture == new_architecture
    assert (hf.num_ln_in_parallel_attn == 2) == (placement == "parallel")
    assert ref.num_parameters() == model.num_parameters()
    assert_logits_match_hf(ref.eval(), model, V, TOL)
    assert_left_padded_logits_match_hf(ref, model, V, TOL)

    back = load_hf(tmp_path)  # import(export(x)): the same model, the same numbers
    assert back.cfg == cfg.override({"position.rope_layout": "split"})
    idx, mask = left_padded_batch(V)
    with torch.no_grad():
        again = back(idx, attention_mask=mask).logits
        ours = model(idx, attention_mask=mask).logits
    if cfg.position.rope_layout == "split":
        mine = model.state_dict()
        assert all(torch.equal(v, mine[k]) for k, v in back.state_dict().items())
        assert torch.equal(again, ours)
    else:  # the rotated pairs permuted: q . k in another order
        assert (again - ours)[mask.bool()].abs().max() <= TOL
    save_hf(back, tmp_path / "again")  # export(import(export(x))) writes the same tensors
    twice = load_file(tmp_path / "again" / "model.safetensors")
    assert twice.keys() == stored.keys()
    assert all(torch.equal(twice[k], stored[k]) for k in stored)


def test_missing_biases_are_written_as_zeros_and_read_back_as_such(tmp_path):
    """Falcon's ``bias`` is every linear layer's, and its LayerNorms always have one: a
    model with the MLP's biases only exports the others as zeros (the same logits) and
    imports with all of them."""
    cfg = _tiny(**{"ffn.bias": True, "norm.bias": False})
    torch.manual_seed(3)
    model = DecoderLM(cfg).eval()
    HF.randomize(model, seed=3)
    save_hf(model, tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    assert not stored["transformer.h.1.self_attention.query_key_value.bias"].any()
    assert not stored["transformer.h.1.self_attention.dense.bias"].any()
    assert not stored["transformer.h.1.input_layernorm.bias"].any()
    assert stored["transformer.h.1.mlp.dense_h_to_4h.bias"].any()
    back = load_hf(tmp_path)
    assert back.cfg.attention.qkv_bias and back.cfg.attention.out_bias and back.cfg.norm.bias
    idx = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(back(idx).logits, model(idx).logits, atol=0, rtol=0)


# --------------------------------------------------------------------------- presets


# --------------------------------------------------------------------------- refusals


def _hf_dict(case: str = "7b-shared-mqa") -> dict:
    return {"model_type": "falcon", "vocab_size": V, **CASES[case]}


def test_config_keys_are_read_as_transformers_reads_them():
    """``n_embed`` (FalconConfig's old name of hidden_size) and 4.x's ``rope_theta``;
    ``num_kv_heads`` is unread with multi-query attention in the old architecture (one
    key/value head), as FalconAttention ignores it; ``attention_dropout`` in parallel blocks,
    which the rotary attention never applies."""
    base = {k: v for k, v in _hf_dict().items() if k not in ("hidden_size", "rope_parameters")}
    hf = {**base, "n_embed": 48, "rope_theta": 70.0, "num_kv_heads": 3, "attention_dropout": 0.1}
    theirs = transformers.AutoConfig.for_model(**hf)
    ours = config_from_hf(hf)
    assert ours.d_model == theirs.hidden_size == 48
    assert ours.position.rope_theta == theirs.rope_parameters["rope_theta"] == 70.0
    assert ours.n_kv_heads == 1 and ours.attention.dropout == 0.0


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"alibi": True, "attention_dropout": 0.1},
         "attention_dropout=0.1 with alibi=true is not supported"),
        ({"new_decoder_architecture": True, "parallel_attn": False},
         "new_decoder_architecture=true with parallel_attn=false is not supported"),
        ({"new_decoder_architecture": True, "num_ln_in_parallel_attn": 3},
         "num_ln_in_parallel_attn=3 is not supported"),
        ({"num_ln_in_parallel_attn": 2},
         "num_ln_in_parallel_attn=2 with new_decoder_architecture=false is not supported"),
        ({"multi_query": False, "num_kv_heads": 1},
         "num_kv_heads=1 with multi_query=false and new_decoder_architecture=false"),
        ({"hidden_dropout": 0.1}, "hidden_dropout=0.1 is not supported"),
        ({"parallel_attn": False, "attention_dropout": 0.1},
         "attention_dropout=0.1 with parallel_attn=false is not supported"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "RoPE scaling 'dynamic'"),
        ({"activation": "gelu_fast"}, "activation='gelu_fast'"),
        ({"new_decoder_architecture": True, "num_kv_heads": 2},
         "n_heads=3 is not divisible by n_kv_heads=2"),
    ],
    ids=["alibi-attention-dropout", "new-sequential", "new-3-norms", "old-2-norms",
         "old-mha-kv", "dropout", "sequential-attention-dropout", "rope-type", "activation",
         "groups"],
)  # fmt: skip
def test_config_it_cannot_hold_is_refused_by_name(changes, named):
    hf = {**_hf_dict(), **changes}
    with pytest.raises(HFCheckpointError, match=re.escape(named)):
        config_from_hf(hf)


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"attention.head_dim": 8}, "attention.head_dim=8 (Falcon's heads are"),
        ({"attention.dropout": 0.1}, "attention.dropout=0.1 (Falcon's rotary attention"),
        ({"attention.sliding_window": 8}, "attention.sliding_window (falcon attends to"),
        ({"attention.qk_norm": True}, "attention.qk_norm (falcon has no QK-norm"),
        ({"norm.kind": "rmsnorm"}, "norm.placement='parallel_shared' (Phi's, GPT-J's, Falcon's"),
    ],
    # (a partial rotation in one-norm blocks is Phi's: test_interop_phi.py's export picks)
    ids=["head-dim", "attention-dropout", "window", "qk-norm", "rmsnorm"],
)
def test_export_refuses_what_falcon_cannot_hold(changes, named, tmp_path):
    cfg = _tiny(**changes)
    with pytest.raises(HFCheckpointError, match=re.escape(named)):
        save_hf(DecoderLM(cfg), tmp_path)
    assert not (tmp_path / "config.json").exists()
