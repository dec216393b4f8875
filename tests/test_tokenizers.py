"""Tokenizers: exact round trips, ids against independent references, save/load, errors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer

import attnlab.tokenizers as tokenizers_module
from attnlab.data import default_corpus
from attnlab.tokenizers import (
    TokenizerError,
    load_tokenizer,
    split_for_encoding,
    train_tokenizer,
)

# Tabs, runs of spaces, CRLF, leading/trailing whitespace, accents (precomposed and
# combining), CJK, an emoji outside the BMP, a zero-width joiner sequence, a NUL byte.
TRICKY = (
    "  Leading spaces\tand\ttabs\r\nCRLF line\n\n\nthree newlines   trailing  \n"
    "café cafe\u0301 naïve — “quotes” 漢字かな 🙂 👩\u200d💻 \x00 end "
)


@pytest.fixture(scope="module")
def small_corpus() -> str:
    return default_corpus()[:20_000]


@pytest.fixture(scope="module")
def bpe(small_corpus):
    return train_tokenizer("bpe", [small_corpus], vocab_size=320)


# ---------------------------------------------------------------------- char


def test_char_ids_match_sorted_vocabulary_and_hf_pipeline():
    tok = train_tokenizer("char", [TRICKY])
    alphabet = sorted(set(TRICKY))  # independent reference: id = rank of the character
    expected = [alphabet.index(char) for char in TRICKY]
    assert tok.kind == "char"
    assert tok.vocab_size == len(alphabet)
    assert tok.encode(TRICKY) == expected
    # The stored HF pipeline (what other tools use) gives the same ids and text.
    assert tok.hf.encode(TRICKY).ids == expected
    assert tok.hf.decode(expected) == TRICKY


def test_char_round_trip_is_exact():
    texts = [TRICKY, "", " ", "\n", TRICKY[::-1], TRICKY * 3]
    tok = train_tokenizer("char", texts)
    for text in texts:
        ids = tok.encode(text)
        assert len(ids) == len(text)  # one id per code point
        assert tok.decode(ids) == text
    assert tok.decode(np.array(tok.encode(TRICKY), dtype=np.uint16)) == TRICKY


def test_char_vocabulary_spans_all_texts():
    tok = train_tokenizer("char", ["abc", "cde", "\n"])
    assert tok.vocab_size == 6
    assert tok.encode("a\ne") == [1, 0, 5]  # sorted: "\n" a b c d e


def test_char_unknown_characters_are_named():
    tok = train_tokenizer("char", ["plain ascii text"])
    with pytest.raises(TokenizerError) as info:
        tok.encode("plain é text 🙂 é")
    message = str(info.value)
    assert "'é' (U+00E9)" in message
    assert "U+1F642" in message
    assert "3 characters not in the vocabulary" in message


def test_char_rejects_empty_training_text():
    with pytest.raises(TokenizerError, match="empty"):
        train_tokenizer("char", [""])


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_training_text_with_a_lone_surrogate_is_named(kind):
    # as encoding does (before: a TypeError or UnicodeEncodeError from the Rust bindings)
    with pytest.raises(TokenizerError, match=r"U\+DCFF\) at position 4, a lone surrogate"):
        train_tokenizer(kind, ["fine", "bad \udcff text"], 300)


# ---------------------------------------------------------------------- bpe


def test_bpe_round_trip_of_unseen_unicode(bpe):
    assert bpe.kind == "bpe"
    for text in [TRICKY, "", " ", "\n\n", "日本語のテキスト🙂" * 5, "\u0301\u200d\x7f\x00"]:
        ids = bpe.encode(text)
        assert all(0 <= i < bpe.vocab_size for i in ids)
        assert bpe.decode(ids) == text


@pytest.mark.parametrize(
    "text",
    [TRICKY, "".join(map(chr, range(0xA0, 0x100))) + "\u0800\uffff"],  # all of 0x80-0xBF
    ids=["tricky", "continuation-bytes"],
)
def test_char_starts_count_each_character_once(bpe, text):
    # bits per character: the characters a run of tokens predicts, where a character cut
    # across byte-level tokens counts once (decoding a run alone gives stray U+FFFDs)
    for tokenizer in (bpe, train_tokenizer("char", [text])):
        starts = tokenizer.char_starts()
        ids = np.asarray(tokenizer.encode(text))
        assert starts.shape == (tokenizer.vocab_size,)
        assert starts[ids].sum() == len(text)
        for cut in range(1, len(ids)):  # any two runs: every character in exactly one
            assert starts[ids[:cut]].sum() + starts[ids[cut:]].sum() == len(text)
            assert starts[ids[:cut]].sum() == len(tokenizer.decode(ids[:cut]))  # a prefix


def test_added_special_tokens_encode_decode_and_count_as_their_text(bpe):
    """Special tokens added to a byte-level tokenizer (GPT-2's "<|endoftext|>", and one
    whose text holds a space and an accent, which no byte-level symbol spells): their ids
    are in the vocabulary, a text holding them encodes to them and decodes back with them
    kept, and each counts as the characters of its text."""
    specials = ["<|endoftext|>", "<|fin du café|>"]
    hf = HFTokenizer.from_str(bpe.to_json())
    hf.add_special_tokens(specials)
    tokenizer = tokenizers_module.Tokenizer(hf)
    added = [hf.token_to_id(token) for token in specials]
    assert added == [bpe.vocab_size, bpe.vocab_size + 1]
    assert tokenizer.vocab_size == bpe.vocab_size + 2
    text = "the end.<|endoftext|>A new one <|fin du café|> and more"
    ids = tokenizer.encode(text)
    assert set(added) <= set(ids) and ids == hf.encode(text).ids
    assert tokenizer.decode(ids) == text
    starts = tokenizer.char_starts()
    assert starts[ids].sum() == len(text)
    assert starts[added].tolist() == [len(token) for token in specials]


def test_bpe_vocab_size_and_compression(bpe, small_corpus):
    assert bpe.vocab_size == 320  # 256 bytes + 64 merges learnt from a rich enough text
    ids = bpe.encode(small_corpus)
    assert len(ids) < 0.7 * len(small_corpus.encode("utf-8"))  # merges do compress
    assert bpe.decode(ids) == small_corpus


def test_bpe_vocab_smaller_than_bytes_is_rejected():
    with pytest.raises(TokenizerError, match="at least 256"):
        train_tokenizer("bpe", ["some text"], vocab_size=100)


def test_a_single_string_is_one_text(small_corpus):
    """``train_tokenizer(kind, "text")`` trains on that text: iterated, a string was one
    text per character, and bpe learnt no merge at all (256 tokens)."""
    text = small_corpus[:5000]
    for kind in ("char", "bpe"):
        alone = train_tokenizer(kind, text, vocab_size=300)
        assert alone.to_json() == train_tokenizer(kind, [text], vocab_size=300).to_json()


def test_bpe_training_is_deterministic(small_corpus):
    first = train_tokenizer("bpe", [small_corpus[:5000]], vocab_size=300)
    second = train_tokenizer("bpe", [small_corpus[:5000]], vocab_size=300)
    assert first.to_json() == second.to_json()


def test_bpe_chunked_encoding_equals_whole_text(bpe, monkeypatch):
    text = default_corpus()[:30_000] + "\n" + TRICKY
    monkeypatch.setattr(tokenizers_module, "_CHUNK_CHARS", 500)
    pieces = split_for_encoding(text)
    assert len(pieces) > 20 and "".join(pieces) == text
    # One HF encode of the whole string is the reference for the batched pieces.
    assert bpe.encode(text) == bpe.hf.encode(text).ids


def _sentencepiece_style(text: str) -> HFTokenizer:
    from oracle import llama_style_tokenizer

    return llama_style_tokenizer(text, vocab_size=300)


def test_sentencepiece_style_text_is_not_cut(monkeypatch):
    """A tokenizer that prepends "▁" to a text would prepend it at every cut too: a long
    text encodes whole (before, each of the 20+ pieces gained a "▁", and the decoded text
    a space there)."""
    text = default_corpus()[:30_000]
    tokenizer = tokenizers_module.Tokenizer(_sentencepiece_style(text))
    monkeypatch.setattr(tokenizers_module, "_CHUNK_CHARS", 500)
    assert len(split_for_encoding(text)) > 20
    ids = tokenizer.encode(text)
    assert ids == tokenizer.hf.encode(text, add_special_tokens=False).ids
    assert tokenizer.decode(ids) == text


def test_byte_level_with_a_prefix_space_is_not_cut(bpe, monkeypatch):
    """A byte-level pre-tokenizer with ``add_prefix_space`` (RoBERTa's) puts a space before
    every text, so before every cut piece too: a long text encodes whole."""
    from tokenizers import pre_tokenizers

    hf = HFTokenizer.from_str(bpe.to_json())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tokenizer = tokenizers_module.Tokenizer(hf)
    text = default_corpus()[:20_000]
    monkeypatch.setattr(tokenizers_module, "_CHUNK_CHARS", 500)
    assert len(split_for_encoding(text)) > 20
    assert tokenizer.encode(text) == hf.encode(text).ids


@pytest.mark.parametrize("pre_tokenizer", [None, "metaspace"])
def test_text_without_newline_splits_is_not_cut(monkeypatch, pre_tokenizer):
    """Without a pre-tokenizer that splits at newlines (none, as SentencePiece-style
    tokenizers without a prepended "▁" have, or Metaspace) a token may hold a newline and
    the next character: a long text encodes whole (before, each cut split "\\nb" in two)."""
    from tokenizers import decoders, models, normalizers, pre_tokenizers

    vocab = {"<unk>": 0, "a": 1, "b": 2, "\n": 3, "\nb": 4, "\u2581": 5}
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[("\n", "b")], unk_token="<unk>"))
    if pre_tokenizer is None:
        hf.normalizer = normalizers.Replace(" ", "\u2581")
    else:
        hf.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
    hf.decoder = decoders.Replace("\u2581", " ")
    tokenizer = tokenizers_module.Tokenizer(hf)
    text = "a\nb" * 200
    monkeypatch.setattr(tokenizers_module, "_CHUNK_CHARS", 50)
    assert len(split_for_encoding(text)) > 5
    assert tokenizer.encode(text) == hf.encode(text).ids == [1, 4] * 200


def test_char_starts_of_other_tokenizers_is_none_without_rereading_the_spec(monkeypatch):
    """eval --stride asks once per window: a tokenizer that does not say where characters
    begin (SentencePiece-style, WordPiece) answers None from what it read when built, not
    by parsing its whole tokenizer.json again at every call."""
    tokenizer = tokenizers_module.Tokenizer(_sentencepiece_style(default_corpus()[:5_000]))

    def reread(spec):
        raise AssertionError("parsed the tokenizer's spec again")

    monkeypatch.setattr(tokenizers_module, "_is_byte_level", reread)
    assert tokenizer.char_starts() is None and tokenizer.char_starts() is None


@pytest.mark.parametrize("chunk", [500, None])
def test_encode_with_special_tokens_as_transformers_does(bpe, monkeypatch, chunk):
    """``add_special_tokens=True`` gives ``tokenizer(text)``'s ids: a LLaMA-style
    tokenizer's <s> first, also for a text encoded in pieces; attnlab's own tokenizers
    have no special tokens."""
    text = default_corpus()[:5_000]
    if chunk:
        monkeypatch.setattr(tokenizers_module, "_CHUNK_CHARS", chunk)
    llama = tokenizers_module.Tokenizer(_sentencepiece_style(text))
    bos = llama.hf.token_to_id("<s>")
    assert llama.encode(text, add_special_tokens=True) == llama.hf.encode(text).ids
    assert llama.encode(text, add_special_tokens=True) == [bos, *llama.encode(text)]
    assert bpe.encode(text, add_special_tokens=True) == bpe.encode(text)
    char = train_tokenizer("char", [text])
    assert char.encode(text, add_special_tokens=True) == char.encode(text)


def test_split_for_encoding_only_cuts_between_visible_ascii():
    text = "a\nb c\n d\n\ne\nf" * 50
    pieces = split_for_encoding(text, chunk_chars=7)
    assert "".join(pieces) == text and len(pieces) > 1
    for left, right in zip(pieces, pieces[1:]):
        assert left.endswith("\n") and left[-2] not in " \n" and right[0] not in " \n"


# ---------------------------------------------------------------------- save / load


@pytest.mark.parametrize("kind", ["char", "bpe"])
@pytest.mark.parametrize("as_directory", [True, False])
def test_save_load_gives_same_ids(kind, as_directory, tmp_path, bpe):
    tok = bpe if kind == "bpe" else train_tokenizer("char", [TRICKY])
    target = tmp_path / "tok" if as_directory else tmp_path / "my_tokenizer.json"
    tok.save(target)
    file = target / "tokenizer.json" if as_directory else target
    assert file.is_file()
    assert not [p for p in file.parent.iterdir() if p.suffix == ".tmp"]  # atomic write
    json.loads(file.read_text())  # plain JSON that other tools can read
    loaded = load_tokenizer(target)
    assert (loaded.kind, loaded.vocab_size) == (tok.kind, tok.vocab_size)
    assert loaded.encode(TRICKY) == tok.encode(TRICKY)
    assert loaded.decode(tok.encode(TRICKY)) == TRICKY
    assert loaded.to_json() == tok.to_json()


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_saved_file_works_in_transformers(kind, tmp_path, bpe, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    tok = bpe if kind == "bpe" else train_tokenizer("char", [TRICKY])
    file = tok.save(tmp_path)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(file))
    ids = fast.encode(TRICKY, add_special_tokens=False)
    assert ids == tok.encode(TRICKY)
    assert fast.decode(ids, clean_up_tokenization_spaces=False) == TRICKY
    # And a plain HF tokenizers load of the same file.
    assert HFTokenizer.from_file(str(file)).encode(TRICKY).ids == tok.encode(TRICKY)


def test_saved_padding_and_truncation_are_ignored(tmp_path, bpe, small_corpus, monkeypatch):
    # transformers' save_pretrained writes the padding and truncation of the tokenizer's
    # last call into tokenizer.json; texts are still encoded whole and unpadded.
    hf = HFTokenizer.from_str(bpe.to_json())
    hf.enable_truncation(max_length=8)
    hf.enable_padding(pad_id=0, pad_token="!")  # pads a batch (of pieces) to its longest
    hf.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(tmp_path)
    monkeypatch.setattr(tokenizers_module, "_CHUNK_CHARS", 500)
    text = small_corpus[:5000] + TRICKY
    assert len(split_for_encoding(text)) > 2
    assert loaded.encode(text) == bpe.encode(text)
    assert loaded.hf.encode(TRICKY).ids == bpe.hf.encode(TRICKY).ids
    from attnlab.tokenizers import Tokenizer

    Tokenizer(hf)  # the caller's own tokenizer object keeps its settings
    assert hf.truncation is not None and hf.padding is not None


def test_load_errors_name_the_file(tmp_path):
    with pytest.raises(TokenizerError, match="not found"):
        load_tokenizer(tmp_path / "missing.json")
    with pytest.raises(TokenizerError, match="not found") as info:
        load_tokenizer(tmp_path)  # a directory without tokenizer.json
    assert str(tmp_path) in str(info.value)
    corrupt = tmp_path / "tokenizer.json"
    corrupt.write_text('{"model": {"type": "BPE", "vocab": ')
    with pytest.raises(TokenizerError, match="not a valid tokenizer.json") as info:
        load_tokenizer(tmp_path)
    assert str(corrupt) in str(info.value) and "\n" not in str(info.value)


def test_loads_from_a_folder_whose_name_is_not_utf8(bpe, tmp_path):
    # such a name's byte is a lone surrogate in str, which the Rust from_file refused
    # ("not a valid tokenizer.json"): no checkpoint in that folder could run on text
    try:
        folder = tmp_path / os.fsdecode(b"run\xe9")
        folder.mkdir()
    except (OSError, UnicodeError):
        pytest.skip("the file system takes only UTF-8 names")
    bpe.save(folder)
    assert load_tokenizer(folder).encode("the cat") == bpe.encode("the cat")
    bad = tmp_path / "bad.json"
    bad.write_bytes(b'{"model": \xff}')
    with pytest.raises(TokenizerError, match=r"bad.json: not a valid tokenizer.json \(byte"):
        load_tokenizer(bad)


def test_a_task_vocabulary_loads_as_utf8_whatever_the_locale(tmp_path, monkeypatch):
    """The numbers task's vocabularies are saved in UTF-8 with their accents unescaped;
    they load as UTF-8 where the locale's encoding is another (before, read by the
    locale's: cp1252 gave the target vocabulary "Ã" and "©" for "é", other ids)."""
    from attnlab.data.numbers import CharVocab, CharVocabPair

    saved = CharVocabPair(CharVocab("0123456789"), CharVocab("deux cent trente-quatre é"))
    saved.save(tmp_path)
    read_text = Path.read_text

    def locale_read_text(self, encoding=None, **kwargs):  # as Windows' cp1252 locale
        return read_text(self, encoding=encoding or "cp1252", **kwargs)

    monkeypatch.setattr(Path, "read_text", locale_read_text)
    loaded = load_tokenizer(tmp_path)
    assert isinstance(loaded, CharVocabPair)
    assert loaded.target.itos == saved.target.itos and loaded.source.itos == saved.source.itos


def test_unknown_kind_and_out_of_range_ids(bpe):
    with pytest.raises(TokenizerError, match="unknown tokenizer kind 'word'"):
        train_tokenizer("word", ["text"])
    tok = train_tokenizer("char", ["abc"])
    with pytest.raises(TokenizerError, match="outside"):
        tok.decode([0, 3])
    with pytest.raises(TokenizerError, match="outside"):
        bpe.decode([-1])


def test_save_accepts_str_paths(tmp_path):
    tok = train_tokenizer("char", ["xyz"])
    tok.save(os.fspath(tmp_path / "dir"))
    assert load_tokenizer(os.fspath(tmp_path / "dir")).encode("zyx") == [2, 1, 0]
