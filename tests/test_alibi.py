"""ALiBi (``position.kind='alibi'``, Press et al. 2022): the head slopes against the paper's
code, transformers' BLOOM and MPT functions; the bias against the formula written out
(``oracle.alibi_bias``); a decoder's logits against its blocks run with naive attention
and that explicit bias (left padding too); cached decoding (dynamic and static caches,
greedy generation) against the full pass; the flash and SDPA backends against eager,
gradients too; packed documents against separate passes; the encoder's symmetric bias;
Falcon-RW's scaled, bfloat16-rounded variant; and what cannot work refused by name.

Shapes: b batch, t length, h heads, d_h head dim, V vocabulary.
"""

from __future__ import annotations

import math

import pytest
import torch
from oracle import (
    alibi_bias,
    alibi_slopes_paper,
    causal_allowed,
    greedy_no_cache,
    naive_attention,
    randomize_weights,
)

from attnlab.config import ConfigError, ModelConfig
from attnlab.models.decoder import DecoderLM
from attnlab.models.encoder import EncoderConfig, EncoderModel
from attnlab.nn.attention import split_heads
from attnlab.nn.position_bias import AlibiBias, alibi_slopes

V = 61
TOL = 1e-5


def _cfg(**changes) -> ModelConfig:
    """A 2-layer ALiBi decoder, 3 heads of 8 (not a power of two: the interleaved slopes),
    a LayerNorm on the embeddings (BLOOM's); ``changes`` as dotted overrides."""
    base = ModelConfig.from_dict(
        {
            "vocab_size": V, "max_seq_len": 32, "d_model": 24, "n_layers": 2,
            "attention": {"n_heads": 3, "qkv_bias": True, "out_bias": True},
            "position": {"kind": "alibi"},
            "ffn": {"kind": "mlp", "activation": "gelu_tanh", "hidden_dim": 40, "bias": True},
            "norm": {"kind": "layernorm", "placement": "pre"},
            "embedding_norm": True,
        }
    )  # fmt: skip
    return base.override(changes)


def _model(cfg: ModelConfig, seed: int = 0) -> DecoderLM:
    torch.manual_seed(seed)
    model = DecoderLM(cfg).eval()
    randomize_weights(model, seed, std=0.3, norms=(0.5, 1.5), is_norm=lambda n, p: p.dim() == 1
                      and "norm" in n and n.endswith("weight"))  # fmt: skip
    return model


def _padded(seed: int = 1, t: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.randint(0, V, (2, t), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(idx)
    mask[1, :4] = 0  # row 1 left-padded by 4
    return idx, mask


# --------------------------------------------------------------------------- slopes, bias


@pytest.mark.parametrize("n", range(1, 17))
def test_slopes_are_the_papers_blooms_and_mpts(n):
    """n = 1 .. 16 heads: the paper's code, transformers' BLOOM slopes (its alibi tensor's
    entry at key position 1) and MPT's (its tensor's entry one position back, negated)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    ours = torch.tensor(alibi_slopes(n), dtype=torch.float64)
    torch.testing.assert_close(ours, torch.tensor(alibi_slopes_paper(n), dtype=torch.float64))
    bloom = build_alibi_tensor(torch.ones(1, 2), n, torch.float32)[:, 0, 1]  # (h,)
    torch.testing.assert_close(ours.float(), bloom, atol=0, rtol=1e-6)
    mpt = -build_mpt_alibi_tensor(n, 2, alibi_bias_max=8)[:, 0, 0]  # (h, 1, s) -> (h,)
    torch.testing.assert_close(ours.float(), mpt.float(), atol=0, rtol=1e-6)
    assert transformers  # (imported for its models)


@pytest.mark.parametrize("n, max_bias", [(4, 4.0), (8, 16.0), (6, 6.0), (12, 5.5)])
def test_slopes_with_another_largest_bias(n, max_bias):
    """position.alibi_max_bias (MPT's alibi_bias_max): powers of two end at 2^-max_bias."""
    ours = alibi_slopes(n, max_bias)
    assert ours == pytest.approx(alibi_slopes_paper(n, max_bias), rel=1e-12)
    if math.log2(n).is_integer():
        assert ours[-1] == pytest.approx(2.0**-max_bias, rel=1e-12)


@pytest.mark.parametrize("bidirectional", [False, True])
def test_bias_is_the_formula(bidirectional):
    """-m_h (i - j) (-m_h |i - j| both ways) for positions of a left-padded row and a
    cached step (queries at 7 and 8 against keys 0 .. 8)."""
    cfg = _cfg(**{"position.alibi_max_bias": 6.0}).position
    module = AlibiBias(cfg, 5, bidirectional=bidirectional, n_layers=2)
    q_pos = torch.tensor([[0, 0, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5]])
    slopes = alibi_slopes_paper(5, 6.0)
    for q, k in ((q_pos, q_pos), (torch.tensor([[7, 8]]), torch.arange(9)[None])):
        want = alibi_bias(slopes, q, k, bidirectional=bidirectional)
        torch.testing.assert_close(module(q, k).double(), want, atol=1e-6, rtol=0)
    assert not dict(module.state_dict())  # no weights: nothing in a checkpoint


def test_falcon_scaled_bfloat16_bias():
    """Falcon-RW's: bf16(bf16(m_h) j) * scale of the key's position alone, the slopes of 12
    heads (the last four not powers of two, so bfloat16 rounds them) at positions up to 300
    (past 256, where bfloat16 rounds the product)."""
    cfg = _cfg(**{"position.alibi_scaled": True, "position.alibi_bfloat16": True}).position
    module = AlibiBias(cfg, 12, bidirectional=False, n_layers=1, score_scale=0.125)
    k = torch.tensor([[0, 1, 5, 255, 257, 300]])
    got = module(k[:, -2:], k)  # (1, h, 2, s)
    for h, m in enumerate(alibi_slopes_paper(12)):
        m16 = torch.tensor(m).bfloat16()
        for j, pos in enumerate(k[0].tolist()):
            want = float((m16 * torch.tensor(pos, dtype=torch.bfloat16)).float()) * 0.125
            assert got[0, h, 0, j] == got[0, h, 1, j] == pytest.approx(want, rel=1e-7)
    assert float(module.slopes[8]) != alibi_slopes_paper(12)[8]  # rounded: 2^-0.5 is no bf16


# --------------------------------------------------------------------------- decoder


def _naive_logits(
    model: DecoderLM, idx: torch.Tensor, mask: torch.Tensor, window: int | None = None
) -> torch.Tensor:
    """The decoder's pre-norm blocks with naive attention (oracle) and the ALiBi bias of
    the formula over positions that count real tokens; the scale folded into the bias with
    ``alibi_scaled``; ``window``: each query sees its last ``window`` positions only."""
    cfg = model.cfg
    b, t = idx.shape
    h, d_h = cfg.n_heads, cfg.head_dim
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (b, t)
    slopes = alibi_slopes_paper(h, cfg.position.alibi_max_bias)
    if cfg.position.alibi_scaled:
        slopes = [m / math.sqrt(d_h) for m in slopes]
    bias = alibi_bias(slopes, positions, positions).float()  # (b, h, t, t)
    allowed = causal_allowed(t, t)[None, None] & mask.bool()[:, None, None, :]
    if window is not None:
        allowed = allowed & (torch.arange(t)[:, None] - torch.arange(t)[None, :] < window)
    with torch.no_grad():
        x = model.tok_emb(idx)
        x = model.emb_norm(x) if model.emb_norm is not None else x
        for block in model.blocks:
            qkv = block.attn.qkv(block.attn_norm(x))
            q, k, v = (split_heads(part, h, d_h) for part in qkv.split(h * d_h, dim=-1))
            y = naive_attention(q, k, v, allowed, bias)  # (b, h, t, d_h)
            x = x + block.attn.out(y.transpose(1, 2).reshape(b, t, h * d_h))
            x = x + block.ffn(block.ffn_norm(x))
        return model.lm_head(model.norm(x))


@pytest.mark.parametrize("scaled", [False, True], ids=["bloom", "scaled"])
def test_decoder_logits_are_naive_attention_with_the_bias(scaled):
    model = _model(_cfg(**{"position.alibi_scaled": scaled}))
    idx, mask = _padded()
    with torch.no_grad():
        ours = model(idx, attention_mask=mask).logits
    want = _naive_logits(model, idx, mask)
    real = mask.bool()
    assert want.abs().max() > 1.0
    assert (ours - want)[real].abs().max() <= TOL


# T5's relative bias (a learned table, the decoder's one-sided buckets) takes the same path
KINDS = {"alibi": {}, "relative_bias": {"position.kind": "relative_bias"}}


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_cached_decoding_is_the_full_pass(static, kind):
    """A left-padded prompt of 7 then one token at a time: each step's logits are the full
    pass's at that position (the bias of its true position against every cached key)."""
    model = _model(_cfg(**KINDS[kind]))
    idx, mask = _padded(t=11)
    with torch.no_grad():
        full = model(idx, attention_mask=mask).logits
        cache = model.new_cache(2, 16, static=static)
        steps = [model(idx[:, :7], cache=cache, attention_mask=mask[:, :7]).logits]
        steps += [model(idx[:, i : i + 1], cache=cache).logits for i in range(7, 11)]
    real = mask.bool()
    assert (torch.cat(steps, 1) - full)[real].abs().max() <= TOL


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_a_rolling_cache_is_attention_over_its_last_tokens(static):
    """A rolling cache of 5 slots taking 13 tokens (row 1 left-padded by 2) in steps of 3,
    1, 1, 3, 2, 3 (chunks that overwrite keys their earlier queries need, too): each query
    attends to the last 5 slots' real tokens, with the ALiBi bias of their true positions
    (which run past the cache, and past max_seq_len: ALiBi has no table)."""
    model = _model(_cfg(**{"max_seq_len": 8}))
    idx = torch.randint(0, V, (2, 13), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(idx)
    mask[1, :2] = 0
    cache, steps, start = model.new_cache(2, 5, rolling=True, static=static), [], 0
    with torch.no_grad():
        for n in (3, 1, 1, 3, 2, 3):
            part = slice(start, start + n)
            steps.append(model(idx[:, part], cache=cache, attention_mask=mask[:, part]).logits)
            start += n
    want = _naive_logits(model, idx, mask, window=5)  # (the last 5 slots, pads included)
    assert (torch.cat(steps, 1) - want)[mask.bool()].abs().max() <= TOL


@pytest.mark.parametrize("kind", list(KINDS))
def test_greedy_generation_with_the_cache_is_without(kind):
    model = _model(_cfg(**KINDS[kind]), seed=3)
    prompt = torch.randint(0, V, (6,), generator=torch.Generator().manual_seed(4)).tolist()
    assert model.generate(prompt, 8) == greedy_no_cache(model, prompt, 8)


@pytest.mark.parametrize("backend", ["flash", "sdpa"])
def test_backends_take_the_bias_as_eager_does(backend):
    """Logits over a left-padded batch and the gradients of a loss: flash (the tiled CPU
    twin of the Triton kernels) and SDPA against eager."""
    eager = _model(_cfg())
    other = _model(_cfg(**{"attention.backend": backend}))
    idx, mask = _padded()
    targets = torch.cat([idx[:, 1:], torch.full_like(idx[:, :1], -100)], 1)
    targets = targets.masked_fill(mask == 0, -100)
    outs = [m(idx, attention_mask=mask, targets=targets) for m in (eager, other)]
    real = mask.bool()
    assert (outs[0].logits - outs[1].logits)[real].abs().max() <= TOL
    for out in outs:
        out.loss.backward()
    for (name, a), b in zip(eager.named_parameters(), other.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_packed_documents_are_separate_passes():
    """doc_ids: positions restart in each document, so each document's logits are those
    of a pass over it alone."""
    model = _model(_cfg())
    idx = torch.randint(0, V, (1, 10), generator=torch.Generator().manual_seed(5))
    doc_ids = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        packed = model(idx, doc_ids=doc_ids).logits
        alone = torch.cat([model(idx[:, :4]).logits, model(idx[:, 4:]).logits], 1)
    assert (packed - alone).abs().max() <= TOL


# --------------------------------------------------------------------------- encoder


def test_encoder_bias_is_symmetric_and_relative():
    """An encoder's ALiBi is -m_h |i - j|: its bias is the formula's, and shifting every
    position leaves its outputs unchanged (the bias reads distances only)."""
    cfg = EncoderConfig.from_dict(
        {"vocab_size": V, "max_seq_len": 32, "d_model": 24, "n_layers": 2, "head": "none",
         "attention": {"n_heads": 4}, "position": {"kind": "alibi"}}
    )  # fmt: skip
    torch.manual_seed(0)
    model = EncoderModel(cfg).eval()
    positions = torch.arange(9)[None]
    want = alibi_bias(alibi_slopes_paper(4), positions, positions, bidirectional=True)
    torch.testing.assert_close(model.pos_bias(positions, positions).double(), want)
    idx = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        a = model.encode(idx, positions=positions)
        b = model.encode(idx, positions=positions + 5)
    assert (a - b).abs().max() <= TOL


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"attention.sliding_window": 4}, "attention.sliding_window: cannot be combined with "
         "position.kind 'alibi'"),
        ({"attention.sink_tokens": 2, "attention.sliding_window": 4}, "attention.sliding_window"),
        ({"attention.kind": "linear"}, "'alibi' decoders need attention.kind 'mha'"),
        ({"position.kind": "rope", "position.alibi_scaled": True},
         "position.alibi_scaled: needs position.kind 'alibi'"),
        ({"position.alibi_max_bias": 0.0}, "position.alibi_max_bias: must be a positive number"),
        ({"position.kind": "rope", "position.alibi_max_bias": 4.0},
         "position.alibi_max_bias: needs position.kind 'alibi', got 'rope'"),
    ],
    ids=["window", "sinks", "kind", "scaled-without-alibi", "max-bias", "max-bias-without"],
)  # fmt: skip
def test_what_cannot_work_is_refused_by_name(changes, named):
    with pytest.raises(ConfigError, match=named):
        _cfg(**changes).validate()


def test_architectures_without_it_refuse_by_name():
    seq2seq = {"arch": "seq2seq", "position": {"kind": "alibi"}}
    with pytest.raises(ConfigError, match="position.kind"):
        ModelConfig.from_dict(seq2seq).validate()
    with pytest.raises(ConfigError, match="embedding_norm: is implemented by the decoder, "
                       "encoder and seq2seq architectures only, not 'vit'"):  # fmt: skip
        ModelConfig.from_dict({"arch": "vit", "embedding_norm": True}).validate()
    encoder = {"arch": "encoder", "position": {"kind": "alibi", "alibi_bfloat16": True}}
    with pytest.raises(ConfigError, match="position.alibi_bfloat16: rounds the bias"):
        ModelConfig.from_dict(encoder).validate()
