"""MarianMT with separate source and target vocabularies
(``share_encoder_decoder_embeddings=False``, ``decoder_vocab_size``): transformers'
MarianMTModel from a tiny random config is the reference for logits (load and save) and
beam-search outputs, with the output layer tied to the target embedding or not.
Shapes: b, s, t; V_src source and V_tgt target vocabulary sizes."""

from __future__ import annotations

import pytest
import torch
from hf_cases import transformers

from attnlab.interop import HFCheckpointError, config_from_hf, load_hf, save_hf
from attnlab.models import build_model

V_SRC, V_TGT, PAD, EOS = 43, 29, 1, 2


def marian_config(tie: bool) -> transformers.MarianConfig:
    return transformers.MarianConfig(
        vocab_size=V_SRC,
        decoder_vocab_size=V_TGT,
        share_encoder_decoder_embeddings=False,
        tie_word_embeddings=tie,
        d_model=32,
        encoder_layers=2,
        decoder_layers=1,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=48,
        decoder_ffn_dim=48,
        max_position_embeddings=64,
        pad_token_id=PAD,
        decoder_start_token_id=PAD,
        eos_token_id=EOS,
        forced_eos_token_id=None,
        scale_embedding=True,
        dropout=0.0,
    )


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def marian(request, tmp_path_factory):
    torch.manual_seed(0)
    ref = transformers.MarianMTModel(marian_config(request.param)).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "embed_positions" in name:  # fixed sinusoids, recomputed on load
                continue
            if "layer_norm" in name and name.endswith("weight"):
                p.copy_(0.5 + torch.rand_like(p))
            else:
                p.copy_(0.3 * torch.randn_like(p))
        ref.final_logits_bias.copy_(torch.randn_like(ref.final_logits_bias))
        ref.model.decoder.embed_tokens.weight[EOS] *= 1.5  # some beams end early
    # the two vocabularies really are apart: different sizes, different tensors
    assert ref.model.encoder.embed_tokens.weight.shape == (V_SRC, 32)
    assert ref.lm_head.weight.shape == (V_TGT, 32)
    path = tmp_path_factory.mktemp("marian-vocab")
    ref.save_pretrained(path)
    return ref, path


def _batch():
    g = torch.Generator().manual_seed(1)
    src = torch.randint(3, V_SRC, (2, 7), generator=g)  # ids past the target vocabulary too
    mask = torch.ones(2, 7, dtype=torch.long)
    src[1, 5:], mask[1, 5:] = PAD, 0
    tgt = torch.cat((torch.full((2, 1), PAD), torch.randint(3, V_TGT, (2, 5), generator=g)), 1)
    return src, mask, tgt


def test_separate_vocabularies_config(marian):
    _, path = marian
    model = load_hf(path)
    cfg = model.cfg
    assert (cfg.vocab_size, cfg.src_vocab_size, cfg.share_embeddings) == (V_TGT, V_SRC, False)
    assert model.src_emb.weight.shape == (V_SRC, 32) and model.tgt_emb.weight.shape == (V_TGT, 32)
    assert (model.lm_head.weight is model.tgt_emb.weight) == cfg.tie_embeddings


def test_logits_equal_transformers_both_ways(marian, tmp_path):
    ref, path = marian
    model = load_hf(path)
    src, mask, tgt = _batch()
    with torch.no_grad():
        expected = ref(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
        out = model(src, tgt, src_mask=mask).logits
    assert out.shape == (2, 6, V_TGT)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    save_hf(model, tmp_path)
    back = transformers.MarianMTModel.from_pretrained(tmp_path).eval()
    assert not back.config.share_encoder_decoder_embeddings
    assert (back.config.vocab_size, back.config.decoder_vocab_size) == (V_SRC, V_TGT)
    with torch.no_grad():
        again = back(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
    torch.testing.assert_close(again, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("k,lp", [(1, 1.0), (3, 0.5)])
def test_beam_search_equals_transformers(marian, k, lp):
    ref, path = marian
    model = load_hf(path)
    src, mask, _ = _batch()
    n = max(1, k - 1)
    ours = model.generate(src, 10, src_mask=mask, num_beams=k, length_penalty=lp, n_best=n)
    kw = {} if k == 1 else {"num_beams": k, "length_penalty": lp, "early_stopping": True}
    out = ref.generate(
        input_ids=src,
        attention_mask=mask,
        max_new_tokens=10,
        do_sample=False,
        num_return_sequences=n,
        **kw,
    )
    rows = ours if n == 1 else [seq for row in ours for seq in row]
    assert len(rows) == out.shape[0]
    for mine, seq in zip(rows, out[:, 1:].tolist()):  # drop the decoder start token
        assert seq[: len(mine)] == mine
        assert all(tok in (EOS, PAD) for tok in seq[len(mine) :])


def test_shared_flag_with_two_sizes_is_refused():
    hf = marian_config(True).to_dict() | {"share_encoder_decoder_embeddings": True}
    with pytest.raises(HFCheckpointError, match="share_encoder_decoder_embeddings"):
        config_from_hf(hf)


def test_export_refuses_a_pad_token_outside_the_source_vocabulary(marian, tmp_path):
    """transformers' Marian has one pad_token_id, the padding_idx of the source embedding
    too: a model whose pad token is a target token only is refused by name, not written as
    a folder that transformers cannot build ("Padding_idx must be within num_embeddings")."""
    _, path = marian
    cfg = load_hf(path).cfg.override({"src_vocab_size": 20, "pad_id": 25})
    with pytest.raises(HFCheckpointError, match="pad_id=25 is not a source token"):
        save_hf(build_model(cfg), tmp_path)
    assert not (tmp_path / "config.json").exists()
