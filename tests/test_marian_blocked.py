"""Marian's blocked pad token: opus-mt configs ask generation never to emit the pad token
(``bad_words_ids: [[pad]]``; their generation_config.json adds ``renormalize_logits``).
A tiny random MarianMTModel whose logits bias favours the pad token (so that, unblocked,
it wins) is saved both ways (generation_config.json with renormalization; config.json
alone, without); attnlab's greedy and beam search equal transformers' ``generate`` on
each, directly, through ``import-hf``/``translate`` and after ``export-hf``."""

from __future__ import annotations

import json

import pytest
import torch
from hf_cases import transformers

from attnlab.cli.main import main
from attnlab.interop import load_hf

V, PAD, EOS = 43, 1, 2
SEARCHES = [(1, 1.0, 1), (3, 1.0, 2), (4, 0.5, 3)]  # (num_beams, length_penalty, n_best)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{"generation": folder with generation_config.json (bad_words_ids, renormalize),
    "config": folder with bad_words_ids in config.json only}."""
    torch.manual_seed(0)
    cfg = transformers.MarianConfig(
        vocab_size=V, decoder_vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=48,
        decoder_ffn_dim=48, max_position_embeddings=64, pad_token_id=PAD,
        decoder_start_token_id=PAD, eos_token_id=EOS, forced_eos_token_id=None,
        scale_embedding=True, activation_function="swish", dropout=0.0,
    )  # fmt: skip
    model = transformers.MarianMTModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1 and "embed_positions" not in name:
                p.normal_(0.0, 3.0 * p.shape[-1] ** -0.5)
        model.final_logits_bias.normal_()
        model.final_logits_bias[0, PAD] += 4.0  # unblocked, the pad token often wins
        model.final_logits_bias[0, EOS] += 2.0  # some beams end before the length limit
    root = tmp_path_factory.mktemp("marian-blocked")
    model.generation_config.bad_words_ids = [[PAD]]
    model.generation_config.renormalize_logits = True
    model.save_pretrained(root / "generation")
    model.generation_config = transformers.GenerationConfig()
    model.save_pretrained(root / "config")
    (root / "config" / "generation_config.json").unlink()
    config = json.loads((root / "config" / "config.json").read_text())
    (root / "config" / "config.json").write_text(json.dumps({**config, "bad_words_ids": [[PAD]]}))
    return {"generation": root / "generation", "config": root / "config"}


def sources():
    g = torch.Generator().manual_seed(1)
    src = torch.randint(3, V, (3, 7), generator=g)
    mask = torch.ones(3, 7, dtype=torch.long)
    src[1, 5:], mask[1, 5:] = PAD, 0
    return src, mask


def transformers_generate(folder, k: int, lp: float, n: int) -> list[list[int]]:
    """transformers' outputs (n per row), without the decoder start and the padding."""
    ref = transformers.MarianMTModel.from_pretrained(folder).eval()
    src, mask = sources()
    kw = {} if k == 1 else {"num_beams": k, "length_penalty": lp, "early_stopping": True}
    out = ref.generate(input_ids=src, attention_mask=mask, max_new_tokens=10, do_sample=False,
                       num_return_sequences=n, **kw)  # fmt: skip
    rows = []
    for seq in out[:, 1:].tolist():
        ends = seq.index(EOS) if EOS in seq else len(seq)
        rows.append(seq[:ends])
    return rows


def attnlab_generate(model, k: int, lp: float, n: int) -> list[list[int]]:
    src, mask = sources()
    out = model.generate(src, 10, src_mask=mask.bool(), num_beams=k, length_penalty=lp, n_best=n)
    return out if n == 1 else [seq for row in out for seq in row]


@pytest.mark.parametrize("k,lp,n", SEARCHES)
def test_greedy_and_beam_search_block_the_pad_token_as_transformers(folders, k, lp, n):
    results = {}
    for name, folder in folders.items():
        model = load_hf(folder)
        assert model.cfg.blocked_ids == [PAD]
        assert model.cfg.renormalize_logits == (name == "generation")
        ours = attnlab_generate(model, k, lp, n)
        assert ours == transformers_generate(folder, k, lp, n)
        assert all(PAD not in seq for seq in ours)
        results[name] = ours
        model.cfg.blocked_ids = []  # the rule lifted: the pad token wins somewhere
        assert any(PAD in seq for seq in attnlab_generate(model, k, lp, n))
    if k == 4:  # renormalizing after blocking changes which beams win
        assert results["generation"] != results["config"]


def test_import_translate_and_export_keep_the_rule(folders, tmp_path, capsys):
    folder = folders["generation"]
    assert main(["import-hf", str(folder), str(tmp_path / "ckpt")]) == 0
    saved = json.loads((tmp_path / "ckpt" / "config.json").read_text())["model"]
    assert (saved["blocked_ids"], saved["renormalize_logits"]) == ([PAD], True)
    src, mask = sources()
    row = src[0].tolist()
    want = transformers_generate(folder, 4, 1.0, 1)[0]
    capsys.readouterr()
    argv = ["translate", "--ckpt", str(tmp_path / "ckpt"), "--source-ids", ",".join(map(str, row)),
            "--num-beams", "4", "--length-penalty", "1.0", "--beam-style", "transformers",
            "--max-new-tokens", "10", "--json"]  # fmt: skip
    assert main(argv) == 0
    (got,) = json.loads(capsys.readouterr().out).values()
    assert got == ",".join(map(str, want))
    assert main(["export-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert generation["bad_words_ids"] == [[PAD]] and generation["renormalize_logits"] is True
    for k, lp, n in SEARCHES:
        assert transformers_generate(tmp_path / "hf", k, lp, n) == transformers_generate(
            folder, k, lp, n
        )


def test_longer_bad_words_are_refused(folders, tmp_path, capsys):
    import shutil

    shutil.copytree(folders["config"], tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["bad_words_ids"] = [[PAD], [5, 6]]
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bad_words_ids: only single tokens" in err


def test_end_token_among_the_bad_words_is_never_blocked(folders, tmp_path):
    """transformers leaves the end token out of ``bad_words_ids`` (blocking it would never
    end a translation): imported so, and decoded as transformers decodes."""
    import shutil

    folder = tmp_path / "eos"
    shutil.copytree(folders["generation"], folder)
    generation = json.loads((folder / "generation_config.json").read_text())
    generation["bad_words_ids"] = [[PAD], [EOS]]
    (folder / "generation_config.json").write_text(json.dumps(generation))
    model = load_hf(folder)
    assert model.cfg.blocked_ids == [PAD]
    for k, lp, n in ((1, 1.0, 1), (3, 1.0, 1)):
        assert attnlab_generate(model, k, lp, n) == transformers_generate(folder, k, lp, n)
