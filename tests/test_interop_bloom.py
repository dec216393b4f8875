"""BLOOM checkpoints: transformers models from tiny random configs (6 heads: the
interleaved ALiBi slopes, tied head; 4 heads with an untied head, 3 layers and another
epsilon) with every weight set to random values, loaded with ``load_hf``, give the same
logits (with left padding), loss and gradients, and the same greedy tokens with the KV
cache; attnlab models saved with ``save_hf`` load in transformers with the same logits and
load back exactly; what neither side can hold is refused by name.

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
CASES = {
    # 6 heads of 8: slopes 2^-2, 2^-4, 2^-6, 2^-8, then 2^-1, 2^-3 (the 8-head sequence's)
    "six-heads-tied": dict(hidden_size=48, n_layer=2, n_head=6),
    # 4 heads of 8, 3 layers, an untied head, another epsilon; the aliases of n_layer/n_head
    "untied": dict(
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        tie_word_embeddings=False,
        layer_norm_epsilon=1e-3,
    ),
}


def _is_norm(name: str, p: torch.Tensor) -> bool:
    """LayerNorm weights in [0.5, 1.5), every other parameter (their biases too) random."""
    return p.dim() == 1 and ("norm" in name or "ln_f" in name) and name.endswith("weight")


HF = HFCases("BloomConfig", "BloomForCausalLM", CASES, V, norms=(0.5, 1.5), is_norm=_is_norm)
imported = HF.imported_fixture()


def test_import_config_and_fused_qkv_layout(imported):
    """The config as transformers reads it (ALiBi, the embedding LayerNorm, the tanh GELU,
    4 d MLP); query_key_value's rows are (h, 3, d_h), each head's q, k and v together."""
    case, ref, model = imported
    cfg, hf = model.cfg, ref.config
    assert model.num_parameters() == ref.num_parameters()
    assert config_from_hf(hf.to_dict()) == cfg  # the in-memory config, not only config.json
    assert cfg.position.kind == "alibi" and not cfg.position.alibi_scaled
    assert cfg.embedding_norm and cfg.norm.placement == "pre"
    assert cfg.ffn.activation == "gelu_tanh" and cfg.ffn.hidden_dim == 4 * hf.hidden_size
    assert (cfg.n_layers, cfg.n_heads) == (hf.n_layer, hf.n_head)
    assert cfg.norm.eps == hf.layer_norm_epsilon
    assert cfg.tie_embeddings == hf.tie_word_embeddings
    assert not [k for k in model.state_dict() if "pos_bias" in k]  # ALiBi: no weights
    h, d_h, d = cfg.n_heads, cfg.head_dim, cfg.d_model
    theirs = ref.transformer.h[1].self_attention.query_key_value
    ours = model.blocks[1].attn.qkv
    for j in range(h):
        for part in range(3):  # q, k, v
            rows = slice((3 * j + part) * d_h, (3 * j + part + 1) * d_h)
            mine = slice(part * d + j * d_h, part * d + (j + 1) * d_h)
            assert torch.equal(ours.weight[mine], theirs.weight[rows])
            assert torch.equal(ours.bias[mine], theirs.bias[rows])
    assert torch.equal(model.emb_norm.weight, ref.transformer.word_embeddings_layernorm.weight)


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
    gradients of the fused q/k/v projection (rows in attnlab's order), the norms (the
    embedding's too), the MLP and the embedding are transformers'."""
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
        block, layer, tr = model.blocks[1], ref.transformer.h[1], ref.transformer
        h = model.cfg.n_heads
        qkv_grad = layer.self_attention.query_key_value.weight.grad  # (h, 3, d_h) rows
        in_our_order = qkv_grad.view(h, 3, -1, model.cfg.d_model).transpose(0, 1).flatten(0, 2)
        pairs = [
            (block.attn.qkv.weight.grad, in_our_order),
            (block.attn.out.weight.grad, layer.self_attention.dense.weight.grad),
            (block.attn_norm.weight.grad, layer.input_layernorm.weight.grad),
            (block.ffn_norm.bias.grad, layer.post_attention_layernorm.bias.grad),
            (block.ffn.up.weight.grad, layer.mlp.dense_h_to_4h.weight.grad),
            (block.ffn.down.bias.grad, layer.mlp.dense_4h_to_h.bias.grad),
            (model.emb_norm.weight.grad, tr.word_embeddings_layernorm.weight.grad),
            (model.norm.weight.grad, tr.ln_f.weight.grad),
            (model.tok_emb.weight.grad, tr.word_embeddings.weight.grad),
        ]
        for got, want in pairs:
            # float32 sums over the batch in different orders: 1e-4
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    finally:
        ref.eval().zero_grad()
        model.eval().zero_grad()


# --------------------------------------------------------------------------- export


def _tiny(**changes):
    return get_preset("bloom-tiny").override({"vocab_size": V, **changes})


EXPORTS = {
    "bloom-tiny": _tiny(),
    # 3 heads of 16 (slopes 2^-4, 2^-8, 2^-2), an untied head, 3 layers, a longer context
    "three-heads-untied": _tiny(
        **{
            "attention.n_heads": 3,
            "d_model": 48,
            "ffn.hidden_dim": 192,
            "n_layers": 3,
            "tie_embeddings": False,
            "max_seq_len": 512,
            "norm.eps": 1e-4,
        }
    ),
}


@pytest.mark.parametrize("name", list(EXPORTS))
def test_export_round_trip(name, tmp_path):
    cfg = EXPORTS[name]
    torch.manual_seed(20)
    model = DecoderLM(cfg).eval()
    HF.randomize(model, seed=len(name))
    assert hf_model_type(cfg) == "bloom"
    save_hf(model, tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    assert ("lm_head.weight" in stored) == (not cfg.tie_embeddings)
    assert "transformer.word_embeddings_layernorm.bias" in stored

    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert type(ref).__name__ == "BloomForCausalLM"
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


def _hf_dict(case: str = "six-heads-tied") -> dict:
    return {"model_type": "bloom", "vocab_size": V, **CASES[case]}


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"apply_residual_connection_post_layernorm": True},
         "apply_residual_connection_post_layernorm=true is not supported"),
        ({"pretraining_tp": 2, "slow_but_exact": True},
         "pretraining_tp=2 with slow_but_exact=true is not supported"),
        ({"hidden_dropout": 0.1}, "hidden_dropout=0.1 is not supported"),
        ({"n_head": 5}, "d_model=48 is not divisible by attention.n_heads=5"),
    ],
    ids=["post-layernorm-residual", "slow-but-exact", "hidden-dropout", "heads"],
)  # fmt: skip
def test_config_it_cannot_hold_is_refused_by_name(changes, named):
    with pytest.raises(HFCheckpointError, match=re.escape(named)):
        config_from_hf({**_hf_dict(), **changes})


def test_what_is_read_beside_the_refusals():
    """pretraining_tp > 1 without slow_but_exact reads the same weights with one matmul
    each (transformers' own path); seq_length sets max_seq_len (2048 without it); the
    attention dropout is attention.dropout; n_embed is hidden_size's old name."""
    cfg = config_from_hf({**_hf_dict(), "pretraining_tp": 4, "attention_dropout": 0.1})
    assert cfg.max_seq_len == 2048 and cfg.attention.dropout == 0.1
    assert config_from_hf({**_hf_dict(), "seq_length": 300}).max_seq_len == 300
    old = {k: v for k, v in _hf_dict().items() if k != "hidden_size"}
    assert config_from_hf({**old, "n_embed": 48}).d_model == 48
