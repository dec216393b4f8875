"""Falcon-RW checkpoints (Falcon with ``alibi`` true): transformers models from tiny random
configs (Falcon-RW's sequential blocks with biases, 12 heads of 4: slopes that bfloat16
rounds; Falcon-7B's parallel block with one key/value head and an untied head) with every
weight set to random values, loaded with ``load_hf``, give the same logits (with left
padding), loss and gradients, and the same greedy tokens with the KV cache; attnlab models
saved with ``save_hf`` load in transformers with the same logits and load back exactly.

transformers' Falcon adds its ALiBi bias in the mask it builds, softmax(q . k / sqrt(d_h) +
alibi / sqrt(d_h)), in its SDPA path (its default); its eager path adds the bias a second
time inside the attention, which no checkpoint was trained with, so the references here
run SDPA.

Shapes: b batch, t length, V vocabulary, h heads, d_h head dim.
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
from attnlab.models.decoder import DecoderLM
from attnlab.presets import get_preset

V = 97
TOL = 1e-5  # float32 logits up to ~5 (weights of std 0.3): observed up to 2e-6
RW = dict(alibi=True, new_decoder_architecture=False)
CASES = {
    # Falcon-RW's block: sequential, one key/value head per query head (12 of 4: the last
    # four slopes, 2^-0.5 ..., rounded to bfloat16), every linear layer biased, tied head
    "rw-sequential": dict(
        RW, hidden_size=48, num_attention_heads=12, num_hidden_layers=2,
        parallel_attn=False, multi_query=False, bias=True,
    ),
    # Falcon-7B's block with ALiBi: one shared norm, multi-query (4 query heads of 8), no
    # biases, an untied head
    "parallel-mqa-untied": dict(
        RW, hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
        parallel_attn=True, multi_query=True, bias=False, tie_word_embeddings=False,
    ),
}  # fmt: skip


def _is_norm(name: str, p: torch.Tensor) -> bool:
    """LayerNorm weights in [0.5, 1.5), every other parameter (their biases too) random."""
    return p.dim() == 1 and ("norm" in name or "ln_" in name) and name.endswith("weight")


# transformers' SDPA path, not its eager one (see the module docstring)
HF = HFCases(
    "FalconConfig",
    "FalconForCausalLM",
    CASES,
    V,
    norms=(0.5, 1.5),
    is_norm=_is_norm,
    attn_implementation="sdpa",
)
imported = HF.imported_fixture()


def test_import_config(imported):
    case, ref, model = imported
    cfg, hf = model.cfg, ref.config
    assert model.num_parameters() == ref.num_parameters()
    assert config_from_hf(hf.to_dict()) == cfg
    pos = cfg.position
    assert (pos.kind, pos.alibi_scaled, pos.alibi_bfloat16) == ("alibi", True, True)
    assert cfg.norm.placement == ("parallel_shared" if hf.parallel_attn else "pre")
    assert cfg.n_kv_heads == (1 if hf.multi_query else cfg.n_heads)
    assert not cfg.embedding_norm


def test_import_logits(imported):
    case, ref, model = imported
    assert_logits_match_hf(ref, model, V, TOL)
    assert_left_padded_logits_match_hf(ref, model, V, TOL)


def test_import_greedy_generation(imported):
    case, ref, model = imported
    assert_greedy_tokens_match_hf(ref, model, V, n=10)


def test_training_loss_and_gradients_match_transformers(imported):
    """A loss backward in training mode over a left-padded batch: the loss and the
    gradients of the attention's output projection, the norms, the MLP and the embedding."""
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
        first = block.norm if model.cfg.norm.placement == "parallel_shared" else block.attn_norm
        pairs = [
            (block.attn.out.weight.grad, layer.self_attention.dense.weight.grad),
            (first.weight.grad, layer.input_layernorm.weight.grad),
            (block.ffn.up.weight.grad, layer.mlp.dense_h_to_4h.weight.grad),
            (block.ffn.down.weight.grad, layer.mlp.dense_4h_to_h.weight.grad),
            (model.norm.weight.grad, ref.transformer.ln_f.weight.grad),
            (model.tok_emb.weight.grad, ref.transformer.word_embeddings.weight.grad),
        ]
        for got, want in pairs:
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    finally:
        ref.eval().zero_grad()
        model.eval().zero_grad()


# --------------------------------------------------------------------------- export


def _tiny(**changes):
    """falcon-rw-1b's layout in 2 layers, d_model 48, 12 heads of 4."""
    small = {"vocab_size": V, "d_model": 48, "n_layers": 2, "attention.n_heads": 12,
             "ffn.hidden_dim": 192, "max_seq_len": 64}  # fmt: skip
    return get_preset("falcon-rw-1b").override({**small, **changes})


EXPORTS = {
    "rw": _tiny(),
    # one key/value head in sequential blocks, an untied head, no biases
    "rw-mqa-untied": _tiny(
        **{
            "attention.n_kv_heads": 1,
            "tie_embeddings": False,
            "attention.qkv_bias": False,
            "attention.out_bias": False,
            "ffn.bias": False,
        }
    ),  # fmt: skip
    # the new architecture's two parallel norms, 4 key/value groups
    "parallel-gqa": _tiny(**{"norm.placement": "parallel", "attention.n_kv_heads": 4}),
}


@pytest.mark.parametrize("name", list(EXPORTS))
def test_export_round_trip(name, tmp_path):
    cfg = EXPORTS[name]
    torch.manual_seed(20)
    model = DecoderLM(cfg).eval()
    HF.randomize(model, seed=len(name))
    assert hf_model_type(cfg) == "falcon"
    save_hf(model, tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa")
    assert ref.config.alibi
    assert_logits_match_hf(ref.eval(), model, V, TOL)
    assert_left_padded_logits_match_hf(ref, model, V, TOL)

    back = load_hf(tmp_path)  # import(export(x)): the same numbers
    biased = cfg.attention.qkv_bias or cfg.attention.out_bias or cfg.ffn.bias
    # (Falcon's one bias switch: all three, or none)
    assert back.cfg == cfg.override({"attention.qkv_bias": biased, "attention.out_bias": biased,
                                     "ffn.bias": biased})  # fmt: skip
    mine = model.state_dict()
    assert all(torch.equal(v, mine[k]) for k, v in back.state_dict().items())
    idx, mask = left_padded_batch(V)
    with torch.no_grad():
        again = back(idx, attention_mask=mask).logits
        assert torch.equal(again, model(idx, attention_mask=mask).logits)
    save_hf(back, tmp_path / "again")  # export(import(export(x))) writes the same tensors
    twice = load_file(tmp_path / "again" / "model.safetensors")
    assert twice.keys() == stored.keys()
    assert all(torch.equal(twice[k], stored[k]) for k in stored)


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"position.alibi_bfloat16": False}, "position.alibi_bfloat16=false"),
        ({"position.alibi_max_bias": 4.0}, "position.alibi_max_bias=4.0 (Falcon's ALiBi"),
        ({"attention.n_kv_heads": 3}, "attention.n_kv_heads=3 in sequential blocks"),
        ({"embedding_norm": True}, "embedding_norm (falcon has no norm on its embeddings"),
    ],
    ids=["unrounded", "max-bias", "sequential-gqa", "embedding-norm"],
)
def test_export_refuses_what_falcon_rw_cannot_hold(changes, named, tmp_path):
    with pytest.raises(HFCheckpointError, match=re.escape(named)):
        save_hf(DecoderLM(_tiny(**changes)), tmp_path)
    assert not (tmp_path / "config.json").exists()
