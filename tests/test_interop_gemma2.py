"""Gemma and Gemma 2 checkpoints: transformers models from tiny random configs (Gemma: MQA
and MHA, "gelu" read as transformers reads it, attention biases, an untied head; Gemma 2:
local and global layers alternating (transformers' default) and in a pattern of their own,
windows shorter than the inputs, query_pre_attn_scalar != head_dim, GQA, attention and
final logit soft-capping low enough to bend the scores and logits) with every norm weight
set to random values (transformers starts them at zero, the identity), loaded with
``load_hf``, give the same logits (with and without left padding), the same greedy tokens
past the window (one prompt and a ragged batch) and the same loss and gradients; attnlab
models saved with ``save_hf`` load in transformers with the same logits and load back into
attnlab exactly; configs neither side can hold are refused by name. transformers' Gemma 2
reference runs its eager attention (its sdpa path ignores the soft cap).

Shapes: b batch, t length, V vocabulary, d d_model.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hf_cases import HFCases, imported_fixture, transformers
from oracle import (
    assert_greedy_tokens_match_hf,
    hf_logits,
    left_padded_batch,
)
from safetensors.torch import load_file

from attnlab.interop import HFCheckpointError, config_from_hf, hf_model_type, load_hf, save_hf
from attnlab.models.decoder import DecoderLM
from attnlab.presets import get_preset

V = 97
TOL = 2e-5  # float32: op order (as the Gemma 3 tests)
CASES = {
    # Gemma 2: transformers' default layer types (local, global, ...), a window of 5, GQA
    # 4/2, head_dim 12 != d / h and a softmax scale of 20**-0.5, caps of 2 (attention: the
    # scores of these weights reach ~10) and 5 (logits), RoPE base 300
    "gemma2-default-gqa": (
        "gemma2",
        dict(
            hidden_size=32,
            intermediate_size=48,
            head_dim=12,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            query_pre_attn_scalar=20,
            sliding_window=5,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=5.0,
            max_position_embeddings=128,
            rope_parameters={"rope_type": "default", "rope_theta": 300.0},
        ),
    ),
    # Gemma 2: a pattern of its own (global, local, local), MQA, attention biases, an
    # untied head, head_dim d / h (the default scale), transformers 4.x's rope_theta,
    # linear RoPE scaling, no final cap
    "gemma2-pattern-mqa-biased": (
        "gemma2",
        dict(
            hidden_size=32,
            intermediate_size=40,
            head_dim=8,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=1,
            query_pre_attn_scalar=8,
            sliding_window=4,
            layer_types=["full_attention", "sliding_attention", "sliding_attention"],
            attn_logit_softcapping=3.0,
            final_logit_softcapping=None,
            max_position_embeddings=64,
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0},
            attention_bias=True,
            tie_word_embeddings=False,
        ),
    ),
    # Gemma: MQA with heads of 12 (!= d / h), pre-norm, "gelu" (transformers computes the
    # tanh approximation), tied head
    "gemma-mqa": (
        "gemma",
        dict(
            hidden_size=32,
            intermediate_size=48,
            head_dim=12,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=1,
            hidden_act="gelu",
            max_position_embeddings=64,
            rope_parameters={"rope_type": "default", "rope_theta": 200.0},
        ),
    ),
    # Gemma: MHA, attention biases, untied head
    "gemma-mha-biased": (
        "gemma",
        dict(
            hidden_size=32,
            intermediate_size=40,
            head_dim=8,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=64,
            attention_bias=True,
            tie_word_embeddings=False,
        ),
    ),
}
CLASSES = {
    "gemma": ("GemmaConfig", "GemmaForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
}
# One per model type, over its cases. Norms' offsets in [-0.5, 0.5) (weights 1 + w), biases
# (zero at init) random; eager attention (transformers' sdpa ignores Gemma 2's soft cap).
HF = {
    model_type: HFCases(
        config_class,
        model_class,
        {case: kw for case, (of_type, kw) in CASES.items() if of_type == model_type},
        vocab_size=V,
        norms=(-0.5, 0.5),
    )
    for model_type, (config_class, model_class) in CLASSES.items()
}


def _hf_config(case: str):
    return HF[CASES[case][0]].config(case)


def _hf_model(case: str, seed: int = 0):
    return HF[CASES[case][0]].model(case, seed)


imported = imported_fixture(CASES, _hf_model)


def test_import_config(imported):
    case, ref, model = imported
    cfg, hf = model.cfg, ref.config
    att, pos = cfg.attention, cfg.position
    assert model.num_parameters() == ref.num_parameters()
    assert config_from_hf(hf.to_dict()) == cfg  # the in-memory config, not only config.json
    assert (cfg.norm.kind, cfg.scale_embeddings, att.qk_norm) == ("gemma_rmsnorm", True, False)
    assert cfg.ffn.activation == "gelu_tanh"  # "gelu" too: transformers' Gemma reads it so
    assert att.qkv_bias == att.out_bias == hf.attention_bias
    assert cfg.tie_embeddings == hf.tie_word_embeddings
    assert pos.local_rope_theta is None and pos.rope_theta == hf.rope_parameters["rope_theta"]
    if hf.model_type == "gemma":
        assert cfg.norm.placement == "pre" and att.sliding_window is None
        assert att.scale is att.softcap is cfg.final_logit_softcap is None
        assert att.backend == "sdpa"
        return
    windows = [att.window_of(i) for i in range(cfg.n_layers)]
    assert windows == [hf.sliding_window if t == "sliding_attention" else None
                       for t in hf.layer_types]  # fmt: skip
    assert cfg.norm.placement == "sandwich"
    assert att.softcap == hf.attn_logit_softcapping
    assert cfg.final_logit_softcap == hf.final_logit_softcapping
    assert att.backend == "flash"  # sdpa cannot cap the scores
    if case == "gemma2-default-gqa":
        assert att.layer_pattern == "LG" and att.scale == 20**-0.5
    else:
        assert att.layer_pattern == "GLL" and att.scale is None
        assert (pos.rope_scaling, pos.rope_factor) == ("linear", 2.0)
    layer = ref.model.layers[1]
    assert torch.equal(model.blocks[1].attn_post_norm.weight, layer.post_attention_layernorm.weight)
    assert torch.equal(model.blocks[1].ffn_norm.weight, layer.pre_feedforward_layernorm.weight)


def test_import_logits(imported):
    case, ref, model = imported
    idx = torch.randint(0, V, (3, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(idx).logits
    theirs = hf_logits(ref, idx)
    assert theirs.abs().max() > 1.0  # the comparison is not between near-zero logits
    assert (ours - theirs).abs().max() <= TOL
    if ref.config.model_type == "gemma2":  # the caps bend these logits
        uncapped = model.cfg.override(
            {"attention.softcap": None, "attention.backend": "eager", "final_logit_softcap": None}
        )
        plain = DecoderLM(uncapped).eval()
        plain.load_state_dict(model.state_dict())
        with torch.no_grad():
            assert (plain(idx).logits - theirs).abs().max() > 0.1


@pytest.mark.parametrize("backend", ["eager", "flash", "flex"])
def test_import_logits_left_padding(imported, backend):
    """Every backend that takes soft-capping, with left padding: transformers' logits."""
    case, ref, model = imported
    idx, mask = left_padded_batch(V)
    other = DecoderLM(model.cfg.override({"attention.backend": backend})).eval()
    other.load_state_dict(model.state_dict())
    with torch.no_grad():
        ours = other(idx, attention_mask=mask).logits
    theirs = hf_logits(ref, idx, mask)
    real = mask.bool()
    assert (ours[real] - theirs[real]).abs().max() <= TOL


def test_import_greedy_generation(imported):
    """Past the window: the local layers' rolling caches, soft-capped decode steps, against
    transformers' cache."""
    case, ref, model = imported
    assert_greedy_tokens_match_hf(ref, model, V)


def test_training_gradients_match_transformers(imported):
    """A loss backward in training mode (the flash backend's own backward through the
    attention cap; the final cap in the loss): the loss and the gradients of the norms,
    the projections and the embedding are transformers'."""
    case, ref, model = imported
    ref, model = ref.train(), model.train()
    idx = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(4))
    ours = model(idx[:, :-1], targets=idx[:, 1:]).loss
    theirs = F.cross_entropy(ref(idx[:, :-1]).logits.flatten(0, 1), idx[:, 1:].flatten())
    ours.backward()
    theirs.backward()
    try:
        assert abs(ours.item() - theirs.item()) <= 1e-5
        block, layer = model.blocks[1], ref.model.layers[1]
        q_dim = ref.config.num_attention_heads * ref.config.head_dim
        pairs = [
            (block.attn_norm.weight.grad, layer.input_layernorm.weight.grad),
            (block.attn.qkv.weight.grad[:q_dim], layer.self_attn.q_proj.weight.grad),
            (block.ffn.down.weight.grad, layer.mlp.down_proj.weight.grad),
            (model.norm.weight.grad, ref.model.norm.weight.grad),
            (model.tok_emb.weight.grad, ref.model.embed_tokens.weight.grad),
        ]
        if ref.config.model_type == "gemma2":
            pairs += [
                (block.attn_post_norm.weight.grad, layer.post_attention_layernorm.weight.grad),
                (block.ffn_norm.weight.grad, layer.pre_feedforward_layernorm.weight.grad),
                (block.ffn_post_norm.weight.grad, layer.post_feedforward_layernorm.weight.grad),
            ]
        else:
            pairs.append((block.ffn_norm.weight.grad, layer.post_attention_layernorm.weight.grad))
        for got, want in pairs:
            # float32 sums over the batch in different orders: 1e-4
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    finally:
        ref.eval().zero_grad()
        model.eval().zero_grad()


# --------------------------------------------------------------------------- export


def _tiny(**changes):
    return get_preset("gemma2-tiny").override({"vocab_size": V, **changes})


EXPORTS = {
    "gemma2-tiny": ("gemma2", _tiny()),
    # every layer local, the eager backend, no final cap, interleaved RoPE pairs (q/k rows
    # permuted to the split halves), q/k/v biases only (o's written as zeros), untied
    "gemma2-local-eager": (
        "gemma2",
        _tiny(
            **{
                "attention.layer_pattern": None,
                "attention.backend": "eager",
                "final_logit_softcap": None,
                "position.rope_layout": "interleaved",
                "attention.qkv_bias": True,
                "tie_embeddings": False,
            }
        ),
    ),
    # global layers only, no caps (sandwich norms still make it Gemma 2)
    "gemma2-global-uncapped": (
        "gemma2",
        _tiny(
            **{
                "attention.layer_pattern": None,
                "attention.sliding_window": None,
                "attention.softcap": None,
                "attention.backend": "sdpa",
                "final_logit_softcap": None,
            }
        ),
    ),
    "gemma": (
        "gemma",
        get_preset("gemma-2b").override(
            {
                "vocab_size": V,
                "d_model": 64,
                "n_layers": 2,
                "attention.head_dim": 16,
                "ffn.hidden_dim": 96,
                "max_seq_len": 128,
            }  # fmt: skip
        ),
    ),
}


@pytest.mark.parametrize("name", list(EXPORTS))
def test_export_round_trip(name, tmp_path):
    model_type, cfg = EXPORTS[name]
    torch.manual_seed(20)
    model = DecoderLM(cfg).eval()
    HF[model_type].randomize(model, seed=len(name))
    assert hf_model_type(cfg) == model_type
    save_hf(model, tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    assert ("lm_head.weight" in stored) == (not cfg.tie_embeddings)

    idx = torch.randint(0, V, (2, 40), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(idx)
    mask[1, :7] = 0
    with torch.no_grad():
        ours = model(idx, attention_mask=mask).logits
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert type(ref).__name__ == CLASSES[model_type][1]
    theirs = hf_logits(ref.eval(), idx, mask)
    real = mask.bool()
    assert ours.abs().max() > 1.0
    assert (ours[real] - theirs[real]).abs().max() <= TOL

    back = load_hf(tmp_path)  # import(export(x)): the same model, the same numbers
    if cfg.position.rope_layout == "split":
        biases = cfg.attention.qkv_bias or cfg.attention.out_bias
        want_cfg = cfg.override({"attention.out_bias": biases})
        # the backend is no checkpoint's: the importer's choice (flash with a cap)
        want_cfg = want_cfg.override({"attention.backend": back.cfg.attention.backend})
        assert back.cfg.attention.backend == ("sdpa" if cfg.attention.softcap is None else "flash")
        assert back.cfg == want_cfg
        mine = model.state_dict()
        for key, value in back.state_dict().items():
            want = mine.get(key, torch.zeros_like(value))  # biases it had not: zeros
            assert torch.equal(value, want), key
    with torch.no_grad():
        again = back(idx, attention_mask=mask).logits
    # (q . k in another order for interleaved pairs; the flash backend's tiled sums)
    tol = 0.0 if cfg == back.cfg else TOL
    assert (again - ours)[real].abs().max() <= tol
    save_hf(back, tmp_path / "again")  # export(import(export(x))) writes the same tensors
    twice = load_file(tmp_path / "again" / "model.safetensors")
    assert twice.keys() == stored.keys()
    assert all(torch.equal(twice[k], stored[k]) for k in stored)


# --------------------------------------------------------------------------- refusals


def _hf_dict(case: str = "gemma2-default-gqa") -> dict:
    return _hf_config(case).to_dict()


@pytest.mark.parametrize(
    "case, changes, named",
    [
        ("gemma2-default-gqa", {"attn_logit_softcapping": 0.0},
         "attn_logit_softcapping must be a positive number or null, got 0.0"),
        ("gemma2-default-gqa", {"final_logit_softcapping": "30"},
         "final_logit_softcapping must be a positive number or null, got '30'"),
        ("gemma2-default-gqa", {"use_bidirectional_attention": True},
         "use_bidirectional_attention=True"),
        ("gemma-mqa", {"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
        ("gemma2-default-gqa", {"layer_types": ["chunked_attention"] * 4}, "layer_types"),
        ("gemma2-default-gqa", {"hidden_activation": "gelu_fast"},
         "hidden_activation='gelu_fast'"),
        ("gemma-mqa", {"hidden_act": "gelu_fast"}, "hidden_act='gelu_fast'"),
        ("gemma2-default-gqa", {"query_pre_attn_scalar": 0}, "query_pre_attn_scalar"),
    ],
    ids=["attn-cap-zero", "final-cap-string", "bidirectional-2", "bidirectional-1",
         "layer-kind", "activation-2", "activation-1", "scalar"],
)  # fmt: skip
def test_config_it_cannot_hold_is_refused_by_name(case, changes, named):
    with pytest.raises(HFCheckpointError, match=named.replace("(", r"\(").replace(")", r"\)")):
        config_from_hf({**_hf_dict(case), **changes})


def test_attention_dropout_takes_the_eager_backend():
    """flash has no dropout: a Gemma 2 config with attention dropout gets eager."""
    cfg = config_from_hf({**_hf_dict(), "attention_dropout": 0.1})
    assert (cfg.attention.backend, cfg.attention.dropout) == ("eager", 0.1)


@pytest.mark.parametrize("model_type", ["gemma", "gemma2"])
def test_minimal_config_is_read_as_transformers_fills_it(model_type):
    """Without layer_types Gemma 2 alternates local and global layers (the first local);
    RoPE base 10,000; Gemma 2's caps 50 and 30."""
    given = {"model_type": model_type, "hidden_size": 32, "num_attention_heads": 4,
             "num_key_value_heads": 2, "num_hidden_layers": 3, "vocab_size": V,
             "intermediate_size": 16, "head_dim": 8}  # fmt: skip
    hf = transformers.AutoConfig.for_model(**given).to_dict()
    cfg = config_from_hf(given)
    assert cfg == config_from_hf(hf)
    assert cfg.position.rope_theta == 10_000.0
    if model_type == "gemma2":
        assert cfg.attention.layer_pattern == "LG" and cfg.attention.sliding_window == 4096
        assert (cfg.attention.softcap, cfg.final_logit_softcap) == (50.0, 30.0)


@pytest.mark.parametrize(
    "base, changes, named",
    [
        # Gemma 2 (sandwich, no QK-norm, one RoPE)
        ("gemma2-tiny", {"norm.kind": "rmsnorm"}, "norm.kind='rmsnorm' (Gemma 2's is"),
        ("gemma2-tiny", {"scale_embeddings": False}, "scale_embeddings=False (Gemma 2's is True)"),
        ("gemma2-tiny", {"ffn.kind": "mlp"}, "ffn.kind='mlp' (Gemma 2's is 'glu')"),
        ("gemma2-tiny", {"attention.scale": 0.3}, "attention.scale=0.3"),
        ("gemma2-tiny", {"attention.sink_logits": True}, "attention.sink_logits (gemma2 has none"),
        # Gemma (pre-norm): what Gemma 2 added
        ("gemma-2b", {"attention.sliding_window": 8},
         "attention.sliding_window=8 (Gemma has none; with norm.placement='sandwich'"),
        ("gemma-2b", {"attention.softcap": 20.0, "attention.backend": "flash"},
         "attention.softcap=20.0 (Gemma has none"),
        ("gemma-2b", {"final_logit_softcap": 20.0}, "final_logit_softcap=20.0 (Gemma has none"),
        ("gemma-2b", {"attention.scale": 0.25}, "attention.scale=0.25 (Gemma has none"),
        ("gemma-2b", {"norm.kind": "rmsnorm"}, "norm.kind='rmsnorm' (Gemma's is"),
        ("gemma-2b", {"ffn.activation": "gelu"},
         "ffn.activation='gelu' (transformers' Gemma reads hidden_act 'gelu' as the tanh"),
    ],
)  # fmt: skip
def test_export_refuses_what_gemma_cannot_hold(base, changes, named, tmp_path):
    cfg = get_preset(base).override({"vocab_size": V, "d_model": 64, "n_layers": 2,
                                     "attention.head_dim": 16, "ffn.hidden_dim": 64,
                                     "max_seq_len": 64, **changes})  # fmt: skip
    with pytest.raises(HFCheckpointError, match=named.replace("(", r"\(").replace(")", r"\)")):
        save_hf(DecoderLM(cfg), tmp_path)
    assert not (tmp_path / "config.json").exists()


def test_soft_capping_in_other_layouts_is_refused_by_name():
    """A LLaMA config with a soft cap (and nothing else of Gemma's): the Gemma layout would
    need its other pieces too, so export names the cap and what Gemma has otherwise;
    an encoder's attention cap is not BERT's."""
    from test_interop_defaults import MINIMAL

    for changes, piece in (
        ({"attention.softcap": 20.0, "attention.backend": "eager"}, "attention.softcap"),
        ({"final_logit_softcap": 20.0}, "final_logit_softcap"),
    ):
        cfg = get_preset("llama-tiny").override(changes)
        with pytest.raises(HFCheckpointError, match="Gemma's is") as e:
            hf_model_type(cfg)
        assert f"{piece} exports as gemma, gemma2 or gemma3_text only" in str(e.value)
    bert = config_from_hf({"model_type": "bert", **MINIMAL["bert"][0]})
    capped = bert.override({"attention.softcap": 20.0, "attention.backend": "eager"})
    with pytest.raises(HFCheckpointError, match=r"attention.softcap \(bert has none"):
        hf_model_type(capped)
