"""Mistral and Qwen2 checkpoints with a sliding window shorter than the text, against
transformers (tiny random configs, eager attention): the logits of a full forward pass,
and greedy decoding with the rolling cache far past the window (and, every layer windowed,
past max_position_embeddings) give transformers' tokens. transformers 5.x windows are
``kv_idx > q_idx - sliding_window``: the query itself and the sliding_window - 1 before it,
as attnlab's. A Qwen2 with windows on some layers only loads as an attention.layer_pattern.

Shapes: b batch, t length, V vocabulary size.
"""

from __future__ import annotations

import pytest
import torch

from attnlab.cache import DenseKV, RollingKV
from attnlab.interop import load_hf, save_hf

transformers = pytest.importorskip("transformers")

VOCAB, WINDOW, MAX_POS = 61, 6, 32
TOL = 1e-4  # float32, two libraries' op orders; observed ~1e-6


def hf_config(kind: str):
    common = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_POS,
        rope_parameters={"rope_type": "default", "rope_theta": 100.0}, rms_norm_eps=1e-5,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, attn_implementation="eager",
        sliding_window=WINDOW,
    )  # fmt: skip
    if kind == "mistral":
        return transformers.MistralConfig(**common)
    first_window_layer = 0 if kind == "qwen2" else 1  # qwen2_mixed: layer 0 global
    return transformers.Qwen2Config(
        **common, use_sliding_window=True, max_window_layers=first_window_layer
    )


def hf_greedy(ref, prompt: torch.Tensor, n: int) -> torch.Tensor:
    """transformers' greedy generate; the explicit mask keeps token 0 (its pad id) real."""
    mask = torch.ones_like(prompt)
    return ref.generate(prompt, attention_mask=mask, do_sample=False, max_new_tokens=n,
                        pad_token_id=0)  # fmt: skip


@pytest.fixture(scope="module", params=["mistral", "qwen2", "qwen2_mixed"])
def pair(request, tmp_path_factory):
    """(kind, transformers model, attnlab model loaded from its saved folder)."""
    kind = request.param
    torch.manual_seed(0)
    cls = transformers.MistralForCausalLM if kind == "mistral" else transformers.Qwen2ForCausalLM
    ref = cls(hf_config(kind))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # far from the tiny init: a wrong window changes the logits a lot
        for name, p in ref.named_parameters():
            norm = p.dim() == 1 and "norm" in name
            p.copy_(
                0.5 + torch.rand(p.shape, generator=g)
                if norm
                else 0.2 * torch.randn(p.shape, generator=g)
            )
    ref.eval()
    path = tmp_path_factory.mktemp(kind)
    ref.save_pretrained(path)
    return kind, ref, load_hf(path).eval()


def test_config_keeps_the_window(pair):
    kind, ref, model = pair
    att = model.cfg.attention
    assert att.sliding_window == WINDOW == ref.config.sliding_window
    assert att.layer_pattern == ("GL" if kind == "qwen2_mixed" else None)
    cache = model.new_cache(1, MAX_POS)
    local = [isinstance(e, RollingKV) and e.k.shape[2] == WINDOW for e in cache.layers]
    assert local == ([False, True] if kind == "qwen2_mixed" else [True, True])
    assert all(isinstance(e, DenseKV) for e, lo in zip(cache.layers, local) if not lo)


@torch.no_grad()
def test_full_forward_logits_equal_transformers(pair):
    _, ref, model = pair
    idx = torch.randint(0, VOCAB, (2, 4 * WINDOW))
    theirs = ref(idx).logits
    assert theirs.abs().max() > 1.0
    assert (model(idx).logits - theirs).abs().max() <= TOL
    # The window is really applied: attending to everything gives other logits.
    dense = model.cfg.override({"attention.sliding_window": None, "attention.layer_pattern": None})
    from attnlab.models import build_model

    full = build_model(dense).eval()
    full.load_state_dict(model.state_dict())
    assert (full(idx).logits - theirs).abs().max() > 100 * TOL


@torch.no_grad()
def test_greedy_decoding_past_the_window_equals_transformers(pair):
    """A rolling ring of WINDOW entries per local layer; greedy tokens over 5x the window
    equal transformers' generate (its sliding-window cache)."""
    _, ref, model = pair
    prompt = torch.randint(0, VOCAB, (1, 5))
    n = MAX_POS - 5  # 4.5 windows, within max_seq_len (the context never slides)
    theirs = hf_greedy(ref, prompt, n)
    assert model.generate(prompt[0].tolist(), n) == theirs[0, 5:].tolist()


@torch.no_grad()
def test_rolling_past_max_position_embeddings(pair):
    """Every layer windowed: decoding goes on past max_position_embeddings in flat memory
    (overflow='roll'), still equal to transformers (RoPE is relative)."""
    kind, ref, model = pair
    if kind == "qwen2_mixed":
        pytest.skip("a global layer cannot roll and equal full attention past its capacity")
    prompt = torch.randint(0, VOCAB, (1, 4))
    n = 3 * MAX_POS
    theirs = hf_greedy(ref, prompt, n)
    got = model.generate(prompt[0].tolist(), n, overflow="roll")
    assert got == theirs[0, 4:].tolist()


@torch.no_grad()
def test_left_padded_batch_decodes_like_transformers(pair):
    _, ref, model = pair
    rows = [torch.randint(1, VOCAB, (3,)).tolist(), torch.randint(1, VOCAB, (9,)).tolist()]
    ids = torch.zeros(2, 9, dtype=torch.long)
    mask = torch.zeros(2, 9, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, 9 - len(r) :], mask[i, 9 - len(r) :] = torch.tensor(r), 1
    n = 3 * WINDOW
    theirs = ref.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n,
                          pad_token_id=0)  # fmt: skip
    assert model.generate(rows, n) == theirs[:, 9:].tolist()


def test_export_round_trip_keeps_the_layer_types(pair, tmp_path):
    kind, ref, model = pair
    save_hf(model, tmp_path)
    back = transformers.AutoConfig.from_pretrained(tmp_path)
    assert back.model_type == ref.config.model_type
    assert back.sliding_window == WINDOW
    if kind != "mistral":
        assert back.layer_types == ref.config.layer_types
    assert load_hf(tmp_path).cfg == model.cfg
