"""MarianMT mapping: transformers' MarianMTModel from a tiny random config is the
reference for logits (both directions) and beam-search outputs. Shapes: b, s, t, V."""

from __future__ import annotations

import pytest
import torch
from hf_cases import transformers

from attnlab.interop import HFCheckpointError, load_hf, save_hf
from attnlab.models import build_model

V, PAD, EOS = 43, 1, 2


def _config(**kw):
    settings = dict(
        vocab_size=V,
        decoder_vocab_size=V,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
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
        activation_function="swish",
        dropout=0.0,
        attn_implementation="eager",
    )
    return transformers.MarianConfig(**{**settings, **kw})


@pytest.fixture(scope="module")
def marian(tmp_path_factory):
    torch.manual_seed(0)
    ref = transformers.MarianMTModel(_config()).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "embed_positions" in name:
                continue
            if "layer_norm" in name and name.endswith("weight"):
                p.copy_(0.5 + torch.rand_like(p))
            else:
                p.copy_(0.3 * torch.randn_like(p))
        ref.final_logits_bias.copy_(torch.randn_like(ref.final_logits_bias))
        ref.model.shared.weight[EOS] *= 1.5  # some beams end early
    path = tmp_path_factory.mktemp("marian")
    ref.save_pretrained(path)
    return ref, path


def _batch():
    g = torch.Generator().manual_seed(1)
    src = torch.randint(3, V, (2, 7), generator=g)
    mask = torch.ones(2, 7, dtype=torch.long)
    src[1, 5:], mask[1, 5:] = PAD, 0
    tgt = torch.cat((torch.full((2, 1), PAD), torch.randint(3, V, (2, 5), generator=g)), 1)
    return src, mask, tgt


def test_marian_logits_both_ways(marian, tmp_path):
    ref, path = marian
    model = load_hf(path)
    src, mask, tgt = _batch()
    with torch.no_grad():
        expected = ref(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
        out = model(src, tgt, src_mask=mask).logits
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    save_hf(model, tmp_path)
    back = transformers.MarianMTModel.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        again = back(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
    torch.testing.assert_close(again, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("k,lp", [(1, 1.0), (3, 1.0), (4, 0.5)])
def test_marian_beam_search_equals_transformers(marian, k, lp):
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


@pytest.mark.parametrize("early", [False, "never"])
@pytest.mark.parametrize("k,lp", [(3, 1.0), (3, 0.0), (4, -1.0), (2, 2.0)])
def test_marian_early_stopping_equals_transformers(marian, k, lp, early):
    """early_stopping False (transformers' default) and "never": the n-best tokens of
    transformers' generate."""
    ref, path = marian
    model = load_hf(path)
    src, mask, _ = _batch()
    ours = model.generate(src, 10, src_mask=mask, num_beams=k, length_penalty=lp, n_best=k,
                          early_stopping=early)  # fmt: skip
    out = ref.generate(input_ids=src, attention_mask=mask, max_new_tokens=10, do_sample=False,
                       num_beams=k, num_return_sequences=k, length_penalty=lp,
                       early_stopping=early)  # fmt: skip
    theirs = [seq[1:] for seq in out.tolist()]  # without the decoder start token
    theirs = [[t for t in seq if t != PAD] for seq in theirs]
    theirs = [seq[: seq.index(EOS)] if EOS in seq else seq for seq in theirs]
    assert [seq for row in ours for seq in row] == theirs


@pytest.mark.parametrize("k,lp", [(3, 0.0), (4, -1.0), (2, 2.0)])
def test_marian_beam_scores_equal_transformers(marian, k, lp, monkeypatch):
    """The n-best hypotheses' scores (log p / generated length ** lp, EOS counted, the
    decoder start token not), not only their tokens, are transformers' sequences_scores,
    also for length penalties at and below 0."""
    import attnlab.generation as generation

    ref, path = marian
    model = load_hf(path)
    src, mask, _ = _batch()
    searched = []
    core = generation.beam_search_core
    monkeypatch.setattr(
        generation,
        "beam_search_core",
        lambda *a, **kw: searched.append(core(*a, **kw)) or searched[-1],
    )
    ours = model.generate(src, 8, src_mask=mask, num_beams=k, length_penalty=lp, n_best=k)
    out = ref.generate(input_ids=src, attention_mask=mask, max_new_tokens=8, do_sample=False,
                       num_beams=k, num_return_sequences=k, length_penalty=lp, early_stopping=True,
                       output_scores=True, return_dict_in_generate=True)  # fmt: skip
    theirs = [seq[1:] for seq in out.sequences.tolist()]  # without the decoder start token
    theirs = [seq[: seq.index(EOS)] if EOS in seq else seq for seq in theirs]
    assert [seq for row in ours for seq in row] == theirs
    scores = [h.score for row in searched[0] for h in row]
    torch.testing.assert_close(torch.tensor(scores), out.sequences_scores, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "changes",
    [{"norm.eps": 1e-2}, {"norm.bias": False}, {"ffn.bias": False}],
    ids=["eps", "norm_bias", "ffn_bias"],
)
def test_export_refuses_what_marian_cannot_hold(marian, changes, tmp_path):
    """transformers' Marian has LayerNorms of torch's default eps (1e-5, no config.json
    setting) with biases and biased MLPs: a model with another eps is refused, not written
    with the eps dropped (a folder transformers loads with other logits), and one without
    those biases is refused by name, not a KeyError."""
    _, path = marian
    model = build_model(load_hf(path).cfg.override(changes))
    with pytest.raises(HFCheckpointError, match="Marian needs"):
        save_hf(model, tmp_path)
    assert not (tmp_path / "config.json").exists()


def test_export_refuses_t5s_decoder_rescale(marian, tmp_path):
    """scale_decoder_output (T5's head reads d^-1/2 h) in an otherwise Marian-shaped model:
    refused by name, not written as a MarianMTModel whose head drops the rescale."""
    _, path = marian
    model = build_model(load_hf(path).cfg.override({"scale_decoder_output": True}))
    with pytest.raises(HFCheckpointError, match=r"scale_decoder_output \(T5's tied-head rescale"):
        save_hf(model, tmp_path)
    assert not (tmp_path / "config.json").exists()


@pytest.mark.parametrize("act", ["gelu_new", "sigmoid"])
def test_activations_imported_are_exported(act, tmp_path):
    """Every activation_function the import reads (gelu_new as attnlab's gelu_tanh) is
    written back: the model re-exports with transformers' logits, not refused as a Marian
    it cannot hold."""
    torch.manual_seed(0)
    config = _config()
    config.activation_function = act
    ref = transformers.MarianMTModel(config).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "embed_positions" not in name:
                p.copy_(0.3 * torch.randn_like(p))
    ref.save_pretrained(tmp_path / "hf")
    model = load_hf(tmp_path / "hf")
    save_hf(model, tmp_path / "ours")
    back = transformers.MarianMTModel.from_pretrained(tmp_path / "ours").eval()
    assert back.config.activation_function == act
    src, mask, tgt = _batch()
    with torch.no_grad():
        expected = ref(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
        again = back(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
        out = model(src, tgt, src_mask=mask).logits
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(again, expected, atol=1e-4, rtol=1e-4)


def test_unscaled_embeddings_start_token_and_dropout_both_ways(tmp_path):
    """What the fixture's opus-mt settings leave alone: scale_embedding false (MarianConfig's
    default), a decoder start token other than the pad token and the dropouts are imported
    and written back."""
    import json

    torch.manual_seed(2)
    ref = transformers.MarianMTModel(
        _config(scale_embedding=False, decoder_start_token_id=5, attention_dropout=0.05)
    ).eval()
    ref.config.dropout = 0.2
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "embed_positions" not in name and p.dim() > 1:
                p.copy_(0.3 * torch.randn_like(p))
    ref.save_pretrained(tmp_path / "hf")
    model = load_hf(tmp_path / "hf")
    cfg = model.cfg
    assert (cfg.scale_embeddings, cfg.bos_id, cfg.pad_id) == (False, 5, PAD)
    assert (cfg.dropout, cfg.attention.dropout) == (0.2, 0.05)
    src, mask, tgt = _batch()
    tgt[:, 0] = 5
    with torch.no_grad():
        expected = ref(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
        out = model(src, tgt, src_mask=mask).logits
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
        save_hf(model, tmp_path / "ours")
        back = transformers.MarianMTModel.from_pretrained(tmp_path / "ours").eval()
        again = back(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
    torch.testing.assert_close(again, expected, atol=1e-4, rtol=1e-4)
    written = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert (written["scale_embedding"], written["decoder_start_token_id"]) == (False, 5)
    assert (written["dropout"], written["attention_dropout"]) == (0.2, 0.05)


def test_base_marian_model_is_refused_by_name(tmp_path):
    """A MarianModel folder (bare names, no logits bias or head) is not a translation model:
    refused by its architecture, not with every tensor reported missing."""
    transformers.MarianModel(_config()).save_pretrained(tmp_path)
    with pytest.raises(HFCheckpointError, match="architecture 'MarianModel' is not supported"):
        load_hf(tmp_path)


def test_untied_marian_has_three_tables(tmp_path):
    """With tie_word_embeddings=false transformers 5 ties nothing, not even the encoder's
    and decoder's tables to ``model.shared``: each is its own (and ``shared`` unused)."""
    torch.manual_seed(1)
    ref = transformers.MarianMTModel(_config(tie_word_embeddings=False)).eval()
    with torch.no_grad():
        for table in (ref.model.encoder.embed_tokens, ref.model.decoder.embed_tokens, ref.lm_head):
            table.weight.normal_(std=0.3)
    assert not torch.equal(ref.model.encoder.embed_tokens.weight, ref.model.shared.weight)
    ref.save_pretrained(tmp_path / "hf")
    model = load_hf(tmp_path / "hf")
    assert not model.cfg.share_embeddings and not model.cfg.tie_embeddings
    src, mask, tgt = _batch()
    with torch.no_grad():
        expected = ref(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
        torch.testing.assert_close(
            model(src, tgt, src_mask=mask).logits, expected, atol=1e-4, rtol=1e-4
        )
        save_hf(model, tmp_path / "ours")
        back = transformers.MarianMTModel.from_pretrained(tmp_path / "ours").eval()
        again = back(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
    torch.testing.assert_close(again, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("k", [1, 3])
def test_forced_eos_ends_length_limited_outputs_as_transformers(marian, tmp_path, k):
    """opus-mt configs set ``forced_eos_token_id`` (= eos): transformers' generate then makes
    the last allowed token EOS (scored 0), so a length-limited output has one real token
    fewer, and beams are ranked with that EOS. Import, generate and export keep the rule."""
    import json
    import shutil

    _, path = marian
    folder = tmp_path / "forced"
    shutil.copytree(path, folder)
    for name in ("config.json", "generation_config.json"):
        data = json.loads((folder / name).read_text())
        (folder / name).write_text(json.dumps({**data, "forced_eos_token_id": EOS}))
    ref = transformers.MarianMTModel.from_pretrained(folder).eval()
    model = load_hf(folder)
    assert model.cfg.forced_eos_ids == [EOS]
    src, mask, _ = _batch()
    kw = {} if k == 1 else {"num_beams": k, "length_penalty": 1.0, "early_stopping": True}
    for new in (3, 6):
        out = ref.generate(input_ids=src, attention_mask=mask, max_new_tokens=new, do_sample=False,
                           num_return_sequences=k, **kw)  # fmt: skip
        expected = [seq[: seq.index(EOS)] for seq in out[:, 1:].tolist()]  # all end with EOS
        ours = model.generate(src, new, src_mask=mask, num_beams=k, n_best=k)
        assert (ours if k == 1 else [seq for row in ours for seq in row]) == expected
        assert any(len(seq) == new - 1 for seq in expected)  # some stopped at the limit
    save_hf(model, tmp_path / "back")
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert back["forced_eos_token_id"] == EOS


@pytest.mark.parametrize(
    "tokens", [{"decoder_start_token_id": 5}, {"eos_token_id": 24}], ids=["start", "eos"]
)
def test_generation_config_tokens_win_over_config_json_as_in_transformers(marian, tmp_path, tokens):
    """transformers' generate takes the decoder start and end tokens from
    generation_config.json alone when a folder has one: where that file's differ from
    config.json's, attnlab decodes with that file's too (it started from config.json's
    decoder start and stopped at its EOS, translating otherwise)."""
    import json
    import shutil

    _, path = marian
    folder = tmp_path / "tokens"
    shutil.copytree(path, folder)
    generation = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**generation, **tokens}))
    ref = transformers.MarianMTModel.from_pretrained(folder).eval()
    model = load_hf(folder)
    eos = tokens.get("eos_token_id", EOS)
    src, mask, _ = _batch()
    for k in (1, 3):
        kw = {} if k == 1 else {"num_beams": k, "length_penalty": 1.0, "early_stopping": True}
        out = ref.generate(input_ids=src, attention_mask=mask, max_new_tokens=10, do_sample=False,
                           **kw)  # fmt: skip
        expected = [seq[: seq.index(eos)] if eos in seq else seq for seq in out[:, 1:].tolist()]
        assert model.generate(src, 10, src_mask=mask, num_beams=k) == expected


def test_null_generation_config_tokens_keep_config_jsons(marian, tmp_path):
    """A generation_config.json whose decoder start and end tokens are null has none: the
    model keeps config.json's (transformers would have no start token to generate from),
    and translates as the folder without those entries."""
    import json
    import shutil

    _, path = marian
    folder = tmp_path / "null_tokens"
    shutil.copytree(path, folder)
    generation = json.loads((folder / "generation_config.json").read_text())
    nulls = {"decoder_start_token_id": None, "eos_token_id": None}
    (folder / "generation_config.json").write_text(json.dumps({**generation, **nulls}))
    model, plain = load_hf(folder), load_hf(path)
    assert (model.cfg.bos_id, model.cfg.eos_id) == (plain.cfg.bos_id, plain.cfg.eos_id)
    assert (model.cfg.bos_id, model.cfg.eos_id) == (PAD, EOS)
    src, mask, _ = _batch()
    for k in (1, 3):
        got = model.generate(src, 10, src_mask=mask, num_beams=k)
        assert got == plain.generate(src, 10, src_mask=mask, num_beams=k)
