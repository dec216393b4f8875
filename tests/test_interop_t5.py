"""T5 mapping: transformers' T5ForConditionalGeneration from tiny random configs is the
reference for logits (ReLU + tied head, T5 v1.0; gated GELU + untied head, v1.1), the loss
and its gradients, greedy and beam-search tokens, and the relative position buckets.
Shapes: b batch, s source length, t target length, V vocabulary size."""

from __future__ import annotations

import json

import pytest
import torch
from hf_cases import transformers
from oracle import randomize_weights

from attnlab.analysis import count_parameters
from attnlab.config import ConfigError, ModelConfig
from attnlab.functional.buckets import relative_buckets
from attnlab.interop import HFCheckpointError, config_from_hf, load_hf, save_hf
from attnlab.models import build_model
from attnlab.presets import get_preset

V, PAD, EOS = 64, 0, 1
TOL = 1e-5  # float32 logits of a few units

KINDS = {  # name -> T5Config settings
    "v1.0": dict(feed_forward_proj="relu", tie_word_embeddings=True),
    "v1.1": dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False),
}


def _config(kind: str, **kw):
    settings = dict(
        vocab_size=V,
        d_model=32,
        d_kv=6,  # 4 heads of 6: inner width 24 != d_model
        d_ff=48,
        num_layers=2,
        num_decoder_layers=3,
        num_heads=4,
        relative_attention_num_buckets=8,  # exact below 2 (encoder) / 4 (decoder)
        relative_attention_max_distance=12,  # sequences here run past it
        dropout_rate=0.0,
        pad_token_id=PAD,
        eos_token_id=EOS,
        decoder_start_token_id=PAD,
        attn_implementation="eager",
    )
    return transformers.T5Config(**{**settings, **KINDS[kind], **kw})


def _reference(kind: str, seed: int = 0, std: float = 0.15, emb: float = 6.0, **kw):
    """A transformers T5 with every weight far from its init, normal with ``std``, the
    embedding ``emb`` times that (tied logits are read at d^-1/2: some range); an untied
    head of its own for v1.1 (transformers 5 ties a fresh model's head whatever the config
    says)."""
    torch.manual_seed(seed)
    ref = transformers.T5ForConditionalGeneration(_config(kind, **kw)).eval()
    if not KINDS[kind]["tie_word_embeddings"]:
        ref.lm_head.weight = torch.nn.Parameter(torch.empty(V, 32))
    randomize_weights(ref, seed, std=std, norms=(0.5, 1.5))
    with torch.no_grad():
        ref.shared.weight.mul_(emb)
    return ref


@pytest.fixture(scope="module", params=list(KINDS))
def t5(request, tmp_path_factory):
    ref = _reference(request.param)
    path = tmp_path_factory.mktemp(f"t5-{request.param}")
    ref.save_pretrained(path)
    return request.param, ref, path


def _batch(s: int = 20, t: int = 18):
    """Row 0 right-padded, row 1 left-padded (T5's positions are the same either way)."""
    g = torch.Generator().manual_seed(1)
    src = torch.randint(2, V, (2, s), generator=g)
    mask = torch.ones(2, s, dtype=torch.long)
    src[0, s - 6 :], mask[0, s - 6 :] = PAD, 0
    src[1, :4], mask[1, :4] = PAD, 0
    tgt = torch.cat((torch.full((2, 1), PAD), torch.randint(2, V, (2, t - 1), generator=g)), 1)
    return src, mask, tgt


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def test_logits_match_transformers_with_padded_sources(t5):
    kind, ref, path = t5
    model = load_hf(path)
    assert model.cfg.tie_embeddings == (kind == "v1.0")  # v1.1: the stored head is its own
    assert model.cfg.scale_decoder_output == (kind == "v1.0")
    src, mask, tgt = _batch()
    with torch.no_grad():
        theirs = ref(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
        ours = model(src, tgt, src_mask=mask).logits
    assert theirs.abs().max() > 1.0
    assert _max_diff(ours, theirs) <= TOL


def test_loss_and_gradients_match_transformers(t5):
    kind, ref, path = t5
    model = load_hf(path)
    src, mask, _ = _batch()
    labels = torch.randint(2, V, (2, 9), generator=torch.Generator().manual_seed(5))
    labels[0, 6:] = -100  # a shorter target: ignored positions
    # decoder inputs: the start token, then the labels shifted right (-100 read as padding)
    shifted = labels[:, :-1].masked_fill(labels[:, :-1] == -100, PAD)
    tgt = torch.cat((torch.full((2, 1), PAD), shifted), 1)
    ref.zero_grad()
    theirs = ref(input_ids=src, attention_mask=mask, labels=labels).loss
    theirs.backward()
    ours = model(src, tgt, src_mask=mask, targets=labels).loss
    ours.backward()
    assert abs(ours.item() - theirs.item()) <= TOL
    grads = {
        "src_emb.weight": ref.shared.weight.grad,
        "src_pos_bias.table.weight": ref.encoder.block[0]
        .layer[0]
        .SelfAttention.relative_attention_bias.weight.grad,
        "tgt_pos_bias.table.weight": ref.decoder.block[0]
        .layer[0]
        .SelfAttention.relative_attention_bias.weight.grad,
        "decoder.2.attn.qkv.weight": torch.cat(
            [getattr(ref.decoder.block[2].layer[0].SelfAttention, p).weight.grad for p in "qkv"]
        ),
        "encoder.1.ffn.down.weight": ref.encoder.block[1].layer[1].DenseReluDense.wo.weight.grad,
    }
    if kind == "v1.1":
        grads["lm_head.weight"] = ref.lm_head.weight.grad
    params = dict(model.named_parameters())
    for name, expected in grads.items():
        assert _max_diff(params[name].grad, expected) <= 1e-4 * expected.abs().max(), name


def test_export_loads_in_transformers_and_imports_back_identically(t5, tmp_path):
    kind, ref, path = t5
    model = load_hf(path)
    save_hf(model, tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["feed_forward_proj"] == KINDS[kind]["feed_forward_proj"]
    back = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path).eval()
    src, mask, tgt = _batch()
    with torch.no_grad():
        expected = ref(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
        again = back(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
    assert _max_diff(again, expected) <= TOL  # (its default attention: sdpa, not eager)
    theirs = back.state_dict()
    assert all(torch.equal(theirs[k], v) for k, v in ref.state_dict().items())
    imported = load_hf(tmp_path)
    assert imported.cfg == model.cfg
    ours, theirs = model.state_dict(), imported.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.parametrize("kind", list(KINDS))
def test_greedy_and_beam_tokens_equal_transformers_generate(kind, tmp_path):
    """Cached greedy decoding (the bias of each new query against every cached key) gives
    transformers' tokens, and the uncached loop the same; beam search too. (Equal encoder
    and decoder depths: transformers 5's T5 cache is sized by the encoder's.)"""
    # weights whose greedy outputs are not one token repeated (a tied T5's often are)
    weights = {"v1.0": dict(seed=5, std=0.5, emb=2.0), "v1.1": dict(seed=3)}[kind]
    ref = _reference(kind, num_decoder_layers=2, **weights)
    ref.save_pretrained(tmp_path)
    model = load_hf(tmp_path)
    src, mask, _ = _batch()
    n = 16  # past the largest bucket's distance (12)
    for k in (1, 3):
        out = ref.generate(input_ids=src, attention_mask=mask, max_new_tokens=n,
                           do_sample=False, num_beams=k, early_stopping=k > 1)  # fmt: skip
        ours = model.generate(src, n, src_mask=mask, num_beams=k)
        theirs = [seq[1:] for seq in out.tolist()]  # without the decoder start token
        theirs = [seq[: seq.index(EOS)] if EOS in seq else seq for seq in theirs]
        assert ours == theirs
        assert len({token for row in ours for token in row}) > 3  # not one token repeated
    assert model.generate(src, n, src_mask=mask, use_cache=False) == model.generate(
        src, n, src_mask=mask
    )


def test_cached_decoding_equals_the_full_decoder_past_the_largest_bucket(t5):
    """One token at a time under the cache, the decoder's logits are the full pass's at
    every position, for targets longer than relative_max_distance."""
    _, _, path = t5
    model = load_hf(path)
    src, mask, tgt = _batch(t=18)
    with torch.no_grad():
        memory = model.encode(src, mask)
        full = model.logits(model.decode(tgt, memory, mask))
        cache = model.new_cache(2, tgt.shape[1])
        steps = [model.logits(model.decode(tgt[:, :3], memory, mask, cache=cache))]
        for i in range(3, tgt.shape[1]):
            steps.append(model.logits(model.decode(tgt[:, i : i + 1], None, mask, cache=cache)))
    assert _max_diff(torch.cat(steps, 1), full) <= 1e-5


@pytest.mark.parametrize("buckets,distance", [(32, 128), (8, 12), (10, 20), (6, 4)])
@pytest.mark.parametrize("bidirectional", [True, False])
def test_relative_buckets_are_transformers(buckets, distance, bidirectional):
    relative = torch.arange(-300, 301)[None, :] - torch.arange(0, 3)[:, None]
    theirs = transformers.models.t5.modeling_t5.T5Attention._relative_position_bucket(
        relative, bidirectional=bidirectional, num_buckets=buckets, max_distance=distance
    )
    ours = relative_buckets(
        relative, bidirectional=bidirectional, num_buckets=buckets, max_distance=distance
    )
    assert torch.equal(ours, theirs)
    assert ours.min() >= 0 and ours.max() == buckets - 1


def test_transformers_5_fresh_untied_config_is_tied_without_rescale(tmp_path):
    """A T5 built by transformers 5 from tie_word_embeddings=false ties its head anyway and
    saves no head (config.json: tie_word_embeddings true, scale_decoder_outputs false)."""
    torch.manual_seed(3)
    ref = transformers.T5ForConditionalGeneration(_config("v1.1", num_decoder_layers=2)).eval()
    randomize_weights(ref, 3, std=0.15, norms=(0.5, 1.5))
    ref.save_pretrained(tmp_path)
    model = load_hf(tmp_path)
    assert model.cfg.tie_embeddings and not model.cfg.scale_decoder_output
    src, mask, tgt = _batch()
    with torch.no_grad():
        theirs = ref(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
        ours = model(src, tgt, src_mask=mask).logits
    assert _max_diff(ours, theirs) <= TOL


def test_earlier_transformers_configs_read_tie_as_the_rescale():
    """Before transformers 5, config.json's tie_word_embeddings alone says both."""
    hf = {"model_type": "t5", "d_model": 32, "d_kv": 8, "num_heads": 4, "vocab_size": V}
    assert config_from_hf(hf).scale_decoder_output is True
    untied = config_from_hf({**hf, "tie_word_embeddings": False})
    assert not untied.tie_embeddings and not untied.scale_decoder_output
    assert config_from_hf({**hf, "feed_forward_proj": "gelu"}).ffn.activation == "gelu"
    glu = config_from_hf({**hf, "feed_forward_proj": "gated-gelu"}).ffn
    assert (glu.kind, glu.activation) == ("glu", "gelu_tanh")  # transformers' gelu_new
    assert config_from_hf({**hf, "decoder_start_token_id": 5}).bos_id == 5
    assert config_from_hf({**hf, "n_positions": 64}).max_seq_len == 64


@pytest.mark.parametrize("proj", ["gelu-relu", "gated-gelu-x", "swiglu", "gated-foo"])
def test_unknown_feed_forward_proj_is_refused_by_name(proj):
    hf = {"model_type": "t5", "d_model": 32, "num_heads": 4, "feed_forward_proj": proj}
    with pytest.raises(HFCheckpointError, match="feed_forward_proj"):
        config_from_hf(hf)


@pytest.mark.parametrize("model_type, arch", [("t5", "T5Model"), ("mt5", "MT5Model")])
def test_headless_encoder_decoders_are_refused_by_name(model_type, arch):
    """No head: attnlab's encoder–decoder ends in one (the encoder alone, T5EncoderModel,
    loads: tests/test_interop_t5_family.py)."""
    with pytest.raises(HFCheckpointError, match=f"{arch}.*T5ForConditionalGeneration"):
        config_from_hf({"model_type": model_type, "architectures": [arch]})


@pytest.mark.parametrize(
    "changes, needs",
    [
        ({"attention.scale": None}, "unscaled scores"),
        ({"norm.kind": "layernorm"}, "pre-norm RMSNorm"),
        ({"ffn.bias": True}, "an FFN without biases"),
        ({"attention.n_kv_heads": 2}, "multi-head attention"),
        ({"attention.dropout": 0.1}, "one dropout rate"),
    ],
)
def test_export_refuses_what_t5_cannot_hold(changes, needs, tmp_path):
    cfg = get_preset("t5-tiny").override(changes)
    with pytest.raises(HFCheckpointError, match=needs):
        save_hf(build_model(cfg), tmp_path)


def test_relative_bias_is_refused_where_nothing_builds_it():
    with pytest.raises(ConfigError, match="seq2seq and encoder and decoder architectures only"):
        ModelConfig.from_dict({"arch": "xl", "position": {"kind": "relative_bias"}}).validate()
    with pytest.raises(ConfigError, match="relative_buckets"):
        get_preset("t5-tiny").override({"position.relative_buckets": 2}).validate()
    with pytest.raises(ConfigError, match="relative_buckets: needs position.kind"):
        get_preset("llama-tiny").override({"position.relative_buckets": 16}).validate()
    with pytest.raises(ConfigError, match="relative_max_distance"):
        get_preset("t5-tiny").override({"position.relative_max_distance": 8}).validate()


def _hf_config(cfg) -> dict:
    """The config.json of a preset, written out by hand (not by export)."""
    gated = cfg.ffn.kind == "glu"
    return dict(model_type="t5", vocab_size=cfg.vocab_size, d_model=cfg.d_model,
                d_kv=cfg.head_dim, d_ff=cfg.ffn.hidden_dim, num_layers=cfg.n_layers,
                num_decoder_layers=cfg.decoder_layers, num_heads=cfg.n_heads,
                relative_attention_num_buckets=cfg.position.relative_buckets,
                relative_attention_max_distance=cfg.position.relative_max_distance,
                feed_forward_proj="gated-gelu" if gated else "relu",
                tie_word_embeddings=not gated, n_positions=cfg.max_seq_len,
                dropout_rate=cfg.dropout, decoder_start_token_id=0)  # fmt: skip


@pytest.mark.parametrize(
    "name", ["t5-tiny", "t5-small", "t5-base", "t5-large", "flan-t5-small", "flan-t5-base"]
)
def test_presets_count_transformers_parameters(name):
    """Each preset is what import reads from its config.json, and has the parameters of
    transformers' model of that config (built on the meta device)."""
    preset = get_preset(name)
    hf = _hf_config(preset)
    assert config_from_hf(hf) == preset
    with torch.device("meta"):
        reference = transformers.T5ForConditionalGeneration(transformers.T5Config(**hf))
    n = reference.num_parameters()
    if not preset.tie_embeddings:  # transformers 5 ties a fresh model's head regardless
        n += preset.vocab_size * preset.d_model
    assert count_parameters(preset)["total"] == n
    if name == "t5-small":
        assert round(n / 1e6, 1) == 60.5  # the published size


def test_t5_tiny_fits_a_batch_in_a_few_steps():
    """t5-tiny trains: a few AdamW steps on one batch (copy the source) lower its loss."""
    torch.manual_seed(0)
    model = build_model(get_preset("t5-tiny"))
    src = torch.randint(2, 128, (8, 10))
    tgt = torch.cat((torch.zeros(8, 1, dtype=torch.long), src[:, :-1]), 1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    losses = []
    for _ in range(10):
        loss = model(src, tgt, targets=src).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0]
