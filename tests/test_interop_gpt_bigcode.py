"""GPT-BigCode checkpoints: transformers models from tiny random configs (multi-query with 4
heads and a tied head; one key/value head per query head, ``multi_query`` false, with 3
heads, 3 layers, an untied head and another epsilon; multi-query with a ReLU MLP) with every
weight set to random values, loaded with ``load_hf``, give the same logits (with left
padding), loss and gradients, and the same greedy tokens with the KV cache; attnlab models
saved with ``save_hf`` (multi-query: ``model_type`` gpt_bigcode) or with the family's own
mapping (one key/value head per query head, which export writes as gpt2) load in
transformers with the same logits and load back exactly; what neither side can hold is
refused by name; the published presets count transformers' parameters.

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

from attnlab.analysis import count_parameters
from attnlab.interop import HFCheckpointError, config_from_hf, hf_model_type, load_hf, save_hf
from attnlab.interop import gpt_bigcode as bigcode
from attnlab.interop.io import write_folder
from attnlab.models.decoder import DecoderLM
from attnlab.presets import BIGCODE_SIZES, get_preset

V = 97
TOL = 1e-5  # float32 logits up to ~8 (weights of std 0.3): observed up to 5e-6
NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
CASES = {
    # 4 query heads of 8 sharing one key/value head, an MLP of 48, a tied head
    "mqa-tied": dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, n_inner=48, **NO_DROPOUT),
    # one key/value head per query head: c_attn head by head; 3 heads of 16, 3 layers, an
    # untied head, another epsilon, the exact GELU
    "mha-three-heads": dict(
        n_embd=48,
        n_layer=3,
        n_head=3,
        n_positions=64,
        multi_query=False,
        tie_word_embeddings=False,
        layer_norm_epsilon=1e-3,
        activation_function="gelu",
        **NO_DROPOUT,
    ),
    # 2 query heads of 16, a ReLU MLP of 4 d (n_inner left out), an untied head
    "mqa-relu-untied": dict(
        n_embd=32,
        n_layer=2,
        n_head=2,
        n_positions=64,
        activation_function="relu",
        tie_word_embeddings=False,
        **NO_DROPOUT,
    ),
}


def _is_norm(name: str, p: torch.Tensor) -> bool:
    """LayerNorm weights (ln_1, ln_2, ln_f; attnlab's *norm) in [0.5, 1.5), every other
    parameter (their biases too) random."""
    return p.dim() == 1 and ("norm" in name or ".ln_" in name) and name.endswith("weight")


HF = HFCases(
    "GPTBigCodeConfig", "GPTBigCodeForCausalLM", CASES, V, norms=(0.5, 1.5), is_norm=_is_norm
)
imported = HF.imported_fixture()


def test_import_config_and_fused_qkv_layout(imported):
    """The config as transformers reads it (learned positions, pre-norm LayerNorms, one
    key/value head with multi_query); c_attn's rows are [q (d); k (d_h); v (d_h)] with
    multi_query, else (h, 3, d_h): each head's q, k and v together."""
    case, ref, model = imported
    cfg, hf = model.cfg, ref.config
    assert model.num_parameters() == ref.num_parameters()
    assert config_from_hf(hf.to_dict()) == cfg  # the in-memory config, not only config.json
    assert cfg.position.kind == "learned" and cfg.norm.placement == "pre"
    assert (cfg.n_layers, cfg.n_heads, cfg.d_model) == (hf.n_layer, hf.n_head, hf.n_embd)
    assert cfg.n_kv_heads == (1 if hf.multi_query else hf.n_head)
    assert cfg.ffn.hidden_dim == (hf.n_inner or 4 * hf.n_embd)
    assert cfg.norm.eps == hf.layer_norm_epsilon
    assert cfg.tie_embeddings == hf.tie_word_embeddings
    h, d_h, d = cfg.n_heads, cfg.head_dim, cfg.d_model
    theirs = ref.transformer.h[1].attn.c_attn
    ours = model.blocks[1].attn.qkv
    if hf.multi_query:
        assert torch.equal(ours.weight, theirs.weight) and torch.equal(ours.bias, theirs.bias)
        assert theirs.weight.shape[0] == d + 2 * d_h
        return
    for j in range(h):
        for part in range(3):  # q, k, v
            rows = slice((3 * j + part) * d_h, (3 * j + part + 1) * d_h)
            mine = slice(part * d + j * d_h, part * d + (j + 1) * d_h)
            assert torch.equal(ours.weight[mine], theirs.weight[rows])
            assert torch.equal(ours.bias[mine], theirs.bias[rows])


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
    gradients of the fused q/k/v projection (rows in attnlab's order), the output
    projection, the norms, the MLP and both embeddings are transformers'."""
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
        h, d = model.cfg.n_heads, model.cfg.d_model
        qkv_grad = layer.attn.c_attn.weight.grad
        if not ref.config.multi_query:  # (h, 3, d_h) rows -> [q; k; v]
            qkv_grad = qkv_grad.view(h, 3, -1, d).transpose(0, 1).flatten(0, 2)
        pairs = [
            (block.attn.qkv.weight.grad, qkv_grad),
            (block.attn.out.weight.grad, layer.attn.c_proj.weight.grad),
            (block.attn_norm.weight.grad, layer.ln_1.weight.grad),
            (block.ffn_norm.bias.grad, layer.ln_2.bias.grad),
            (block.ffn.up.weight.grad, layer.mlp.c_fc.weight.grad),
            (block.ffn.down.bias.grad, layer.mlp.c_proj.bias.grad),
            (model.norm.weight.grad, tr.ln_f.weight.grad),
            (model.pos_emb.weight.grad, tr.wpe.weight.grad),
            (model.tok_emb.weight.grad, tr.wte.weight.grad),
        ]
        for got, want in pairs:
            # float32 sums over the batch in different orders: 1e-4
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    finally:
        ref.eval().zero_grad()
        model.eval().zero_grad()


# --------------------------------------------------------------------------- export


def _tiny(**changes):
    return get_preset("bigcode-tiny").override({"vocab_size": V, **changes})


EXPORTS = {
    "bigcode-tiny": _tiny(),
    # 3 query heads of 16 sharing one key/value head, an untied head, 3 layers, a ReLU MLP
    # (multi-query: not OPT's), attention dropout (training only), another epsilon
    "three-heads-untied-relu": _tiny(
        **{
            "attention.n_heads": 3,
            "d_model": 48,
            "ffn.hidden_dim": 80,
            "ffn.activation": "relu",
            "n_layers": 3,
            "tie_embeddings": False,
            "attention.dropout": 0.1,
            "norm.eps": 1e-4,
        }
    ),
}


def _assert_same_model_back(model, path):
    """import(export(x)): the same config and tensors, the same logits bit for bit."""
    back = load_hf(path)
    assert back.cfg == model.cfg
    mine = model.state_dict()
    assert back.state_dict().keys() == mine.keys()
    assert all(torch.equal(v, mine[k]) for k, v in back.state_dict().items())
    idx, mask = left_padded_batch(V)
    with torch.no_grad():
        again = back.eval()(idx, attention_mask=mask).logits
        assert torch.equal(again, model(idx, attention_mask=mask).logits)
    return back


@pytest.mark.parametrize("name", list(EXPORTS))
def test_export_round_trip(name, tmp_path):
    cfg = EXPORTS[name]
    torch.manual_seed(20)
    model = DecoderLM(cfg).eval()
    HF.randomize(model, seed=len(name))
    assert hf_model_type(cfg) == "gpt_bigcode"
    save_hf(model, tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    assert ("lm_head.weight" in stored) == (not cfg.tie_embeddings)
    d, d_h = cfg.d_model, cfg.head_dim
    assert stored["transformer.h.0.attn.c_attn.weight"].shape == (d + 2 * d_h, d)

    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert type(ref).__name__ == "GPTBigCodeForCausalLM" and ref.config.multi_query
    assert ref.config.attn_pdrop == cfg.attention.dropout
    assert_logits_match_hf(ref.eval(), model, V, TOL)
    assert_left_padded_logits_match_hf(ref, model, V, TOL)

    back = _assert_same_model_back(model, tmp_path)
    save_hf(back, tmp_path / "again")  # export(import(export(x))) writes the same tensors
    twice = load_file(tmp_path / "again" / "model.safetensors")
    assert twice.keys() == stored.keys()
    assert all(torch.equal(twice[k], stored[k]) for k in stored)


def test_multi_head_layout_writes_and_reads_back(tmp_path):
    """One key/value head per query head exports as gpt2 (its layout holds it); the GPT-BigCode
    mapping still writes it (multi_query false, c_attn head by head) for transformers'
    GPTBigCodeForCausalLM, and reads it back exactly."""
    heads = {"attention.n_kv_heads": None, "attention.n_heads": 3}
    cfg = _tiny(**heads, **{"d_model": 48, "ffn.hidden_dim": 192})
    assert hf_model_type(cfg) == "gpt2"
    torch.manual_seed(21)
    model = DecoderLM(cfg).eval()
    HF.randomize(model, seed=3)
    family = bigcode.FAMILY
    assert not family.exports(cfg)
    hf = family.config_to_hf(cfg, "gpt_bigcode", torch.float32)
    write_folder(tmp_path, family.weights_from_attnlab(model.state_dict(), cfg, "gpt_bigcode"), hf)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert type(ref).__name__ == "GPTBigCodeForCausalLM" and not ref.config.multi_query
    assert_logits_match_hf(ref.eval(), model, V, TOL)
    assert_left_padded_logits_match_hf(ref, model, V, TOL)
    _assert_same_model_back(model, tmp_path)


def _published(name: str) -> dict:
    """bigcode/``name``'s config.json as recalled: GPTBigCodeConfig's keys."""
    d, n_layers, n_heads, vocab_size, n_positions = BIGCODE_SIZES[name]
    return dict(
        model_type="gpt_bigcode", architectures=["GPTBigCodeForCausalLM"], n_embd=d,
        n_layer=n_layers, n_head=n_heads, n_inner=4 * d, vocab_size=vocab_size,
        n_positions=n_positions, multi_query=True, activation_function="gelu_pytorch_tanh",
        resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, layer_norm_epsilon=1e-5,
        scale_attn_weights=True, attention_softmax_in_fp32=True,
        scale_attention_softmax_in_fp32=True, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip


@pytest.mark.parametrize("name", list(BIGCODE_SIZES))
def test_published_presets_are_their_config_json(name):
    """bigcode/``name``'s config.json (recalled) reads as the preset, and transformers'
    model of it (on the meta device) counts the preset's parameters."""
    hf = _published(name)
    preset = get_preset(name)
    assert config_from_hf(hf) == preset
    assert hf_model_type(preset) == "gpt_bigcode"
    config = transformers.AutoConfig.for_model(**hf)
    with torch.device("meta"):
        reference = transformers.AutoModelForCausalLM.from_config(config)
    assert count_parameters(preset)["total"] == reference.num_parameters()


# --------------------------------------------------------------------------- refusals


def _hf_dict(case: str = "mqa-tied") -> dict:
    return {"model_type": "gpt_bigcode", "vocab_size": V, **CASES[case]}


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"scale_attn_weights": False}, "scale_attn_weights=false (unscaled attention scores)"),
        ({"add_cross_attention": True}, "add_cross_attention=true (cross-attention to an"),
        ({"n_head": 5}, "d_model=32 is not divisible by attention.n_heads=5"),
        ({"activation_function": "gelu_fast"}, "activation_function='gelu_fast' is not"),
    ],
    ids=["unscaled", "cross-attention", "heads", "activation"],
)
def test_config_it_cannot_hold_is_refused_by_name(changes, named):
    with pytest.raises(HFCheckpointError, match=re.escape(named)):
        config_from_hf({**_hf_dict(), **changes})


def test_softmax_precision_flags_read_as_the_same_model():
    """attention_softmax_in_fp32 and scale_attention_softmax_in_fp32 change half-precision
    rounding only (float32 scores: no upcast, a layer factor of 1): every combination reads
    as the same config, and transformers' float32 logits are the same with each."""
    base = config_from_hf(_hf_dict())
    flags = ("attention_softmax_in_fp32", "scale_attention_softmax_in_fp32")
    logits = []
    for upcast in (True, False):
        for scaled in (True, False):
            hf = {**_hf_dict(), flags[0]: upcast, flags[1]: scaled}
            assert config_from_hf(hf) == base
            config = HF.config("mqa-tied")
            setattr(config, flags[0], upcast)
            setattr(config, flags[1], scaled)
            torch.manual_seed(0)
            ref = transformers.GPTBigCodeForCausalLM(config)
            HF.randomize(ref, seed=0)
            idx = torch.arange(12).view(1, 12) % V
            with torch.no_grad():
                logits.append(ref.eval()(idx).logits)
    assert all(torch.equal(x, logits[0]) for x in logits)


def test_what_is_read_beside_the_refusals():
    """The dropouts: resid_pdrop is attnlab's one dropout (an embd_pdrop that differs loads
    with a warning: training only), attn_pdrop the attention weights'; n_inner absent is
    4 d; a one-head multi-query model is a multi-head one."""
    cfg = config_from_hf({**_hf_dict(), "resid_pdrop": 0.2, "embd_pdrop": 0.2, "attn_pdrop": 0.3})
    assert (cfg.dropout, cfg.attention.dropout) == (0.2, 0.3)
    with pytest.warns(UserWarning, match=re.escape("embd_pdrop=0.1 differs from resid_pdrop=0.0")):
        assert config_from_hf({**_hf_dict(), "embd_pdrop": 0.1}).dropout == 0.0
    assert config_from_hf(_hf_dict("mqa-relu-untied")).ffn.hidden_dim == 128
    one = config_from_hf({**_hf_dict(), "n_head": 1})
    assert one.n_kv_heads == one.n_heads == 1


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"attention.n_heads": 4, "attention.n_kv_heads": 2},
         "attention.n_kv_heads=2 (GPT-BigCode has one key/value head, multi_query, or one per"),
        ({"norm.kind": "rmsnorm"}, "norm.kind='rmsnorm' (GPT-BigCode's is 'layernorm')"),
        ({"ffn.kind": "glu"}, "ffn.kind='glu' (GPT-BigCode's is 'mlp')"),
        ({"attention.head_dim": 8}, "attention.head_dim=8 (GPT-BigCode's heads are d_model"),
        ({"attention.sliding_window": 8}, "attention.sliding_window (gpt_bigcode attends to"),
    ],
    ids=["grouped", "rmsnorm", "glu", "head-dim", "window"],
)  # fmt: skip
def test_export_refuses_what_gpt_bigcode_cannot_hold(changes, named, tmp_path):
    cfg = _tiny(**changes)
    with pytest.raises(HFCheckpointError, match=re.escape(named)):
        save_hf(DecoderLM(cfg), tmp_path)
    assert not (tmp_path / "config.json").exists()
