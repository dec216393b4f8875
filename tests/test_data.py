"""Data pipeline: corpora, cached tokenisation, deterministic splits, batches, errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import attnlab.data.lm as lm
from attnlab.config import ConfigError, DataConfig
from attnlab.data import (
    DOCUMENT_SEPARATOR,
    EMBEDDED_NAME,
    DataError,
    TokenDataset,
    default_cache_dir,
    default_corpus,
    prepare_data,
    read_corpus,
)
from attnlab.tokenizers import train_tokenizer

DOC_A = "The first document.\nIt has two lines.\n"
DOC_B = "Second one: naïve café, 漢字 🙂\ttabs  and  spaces.\n"


def char_ids(text: str) -> np.ndarray:
    """Independent reference for the char tokenizer: id = rank of the character."""
    alphabet = {char: i for i, char in enumerate(sorted(set(text)))}
    return np.array([alphabet[char] for char in text], dtype=np.int64)


@pytest.fixture
def corpus_dir(tmp_path):
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "b.txt").write_text(DOC_B, encoding="utf-8")
    (root / "sub" / "a.txt").write_text(DOC_A * 40, encoding="utf-8")
    (root / "notes.rst").write_text("neither a .txt nor a .md file")
    (root / "empty.txt").write_text("")
    return root


def expected_text(root) -> str:
    # Sorted by relative path: "b.txt" < "sub/a.txt"; the empty file adds nothing.
    return DOC_B + "\n\n" + DOC_A * 40


def make_dataset(tokens: np.ndarray, val_fraction: float = 0.25) -> TokenDataset:
    tok = train_tokenizer("char", ["".join(chr(65 + i) for i in range(int(tokens.max()) + 1))])
    n_val = round(len(tokens) * val_fraction)
    return TokenDataset(tok, tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val :])


# ---------------------------------------------------------------------- corpora


def test_default_corpus_is_the_pydoc_topics():
    from pydoc_data.topics import topics

    text = default_corpus()
    assert text == default_corpus()  # deterministic
    assert 200_000 < len(text) < 2_000_000
    for name in ("if", "class", "lambda"):
        assert topics[name].strip("\n") in text
    docs = read_corpus(None)  # one document per topic, joined into the same text
    assert [name for name, _ in docs] == [f"{EMBEDDED_NAME}/{name}" for name in sorted(topics)]
    assert DOCUMENT_SEPARATOR.join(doc for _, doc in docs) == text


def test_read_corpus_folder_is_recursive_sorted_and_txt_only(corpus_dir):
    docs = read_corpus(corpus_dir)
    assert [name for name, _ in docs] == [
        str(corpus_dir / "b.txt"),
        str(corpus_dir / "sub" / "a.txt"),
    ]
    assert [text for _, text in docs] == [DOC_B, DOC_A * 40]
    assert read_corpus(corpus_dir / "b.txt") == [(str(corpus_dir / "b.txt"), DOC_B)]


def test_hidden_files_and_folders_of_a_corpus_folder_are_skipped(tmp_path):
    """Jupyter's .ipynb_checkpoints holds copies of the texts beside them (their text was
    read twice, into both splits), .git its own files; a hidden root or file named as the
    corpus itself is read."""
    root = tmp_path / ".corpus"
    (root / "sub" / ".ipynb_checkpoints").mkdir(parents=True)
    (root / "sub" / "notes.txt").write_text("notes\n")
    (root / "sub" / ".ipynb_checkpoints" / "notes-checkpoint.txt").write_text("notes\n")
    (root / ".hidden.md").write_text("hidden\n")
    (root / ".git").mkdir()
    (root / ".git" / "description.txt").write_text("git\n")
    assert read_corpus(root) == [(str(root / "sub" / "notes.txt"), "notes\n")]
    assert read_corpus(root / ".hidden.md") == [(str(root / ".hidden.md"), "hidden\n")]


def test_read_corpus_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        read_corpus(tmp_path / "nope.txt")
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(DataError, match="is empty"):
        read_corpus(tmp_path / "empty.txt")
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "x.rst").write_text("restructured text")
    with pytest.raises(DataError, match="no .txt or .md files"):
        read_corpus(folder)
    (folder / "y.txt").write_text("")
    with pytest.raises(DataError, match="are empty"):
        read_corpus(folder)
    # neither a file nor a folder: was searched as a folder, "no .txt or .md files under the
    # folder /dev/null"
    with pytest.raises(DataError, match="data.path: /dev/null is a character device, not a"):
        read_corpus("/dev/null")
    with pytest.raises(ConfigError, match="data.path: is empty; give a text file or a folder"):
        DataConfig(path="").validate()  # "" is the current folder: it was read as the corpus


def test_undecodable_bytes(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes("héllo ".encode() + b"\xff\xfe" + b" world")
    with pytest.raises(DataError) as info:
        read_corpus(bad)
    message = str(info.value)
    offset = len("héllo ".encode())  # 7: é takes two bytes
    assert str(bad) in message and f"byte offset {offset}" in message
    assert "data.errors=replace" in message and "\n" not in message
    [(_, text)] = read_corpus(bad, errors="replace")
    assert text == "héllo \ufffd\ufffd world"
    # prepare_data goes through the same reader.
    with pytest.raises(DataError, match="byte offset"):
        prepare_data(DataConfig(path=str(bad)), cache_dir=tmp_path / "cache")


def test_utf8_byte_order_mark_is_dropped(tmp_path):
    file = tmp_path / "bom.txt"
    file.write_bytes(b"\xef\xbb\xbfhello")
    assert read_corpus(file) == [(str(file), "hello")]


def test_a_file_of_only_a_byte_order_mark_is_empty(tmp_path):
    """A UTF-8 file with no text but its byte order mark (Notepad saves an empty one so) is
    empty, as a blank file is (before, it was read as a document of no text or of
    whitespace; alone, that failed later and without its name: "cannot train a char
    tokenizer on empty text")."""
    file = tmp_path / "bom.txt"
    file.write_bytes(b"\xef\xbb\xbf \r\n")
    with pytest.raises(DataError, match=f"data.path: {file} is empty"):
        prepare_data(DataConfig(path=str(file)), cache_dir=tmp_path / "cache")
    (tmp_path / "text.txt").write_text("some text\n")
    assert read_corpus(tmp_path) == [(str(tmp_path / "text.txt"), "some text\n")]


# ---------------------------------------------------------------------- prepare_data


def test_prepare_char_tokens_and_split(corpus_dir, tmp_path):
    cfg = DataConfig(path=str(corpus_dir), tokenizer="char", val_fraction=0.2)
    ds = prepare_data(cfg, cache_dir=tmp_path / "cache")
    text = expected_text(corpus_dir)
    reference = char_ids(text)
    assert ds.tokenizer.kind == "char"
    assert ds.tokenizer.vocab_size == len(set(text))
    assert ds.train.dtype == np.uint16 and ds.val.dtype == np.uint16
    assert ds.n_tokens == len(reference) == len(text)
    n_val = round(0.2 * len(reference))
    np.testing.assert_array_equal(ds.train, reference[:-n_val])
    np.testing.assert_array_equal(ds.val, reference[-n_val:])
    assert ds.tokenizer.decode(np.concatenate([ds.train, ds.val])) == text
    assert ds.n_chars == len(text) and len(ds.sources) == 2


def test_prepare_bpe_round_trips_the_corpus(corpus_dir, tmp_path):
    cfg = DataConfig(path=str(corpus_dir), tokenizer="bpe", bpe_vocab_size=300)
    ds = prepare_data(cfg, cache_dir=tmp_path / "cache")
    assert ds.tokenizer.kind == "bpe" and 256 <= ds.tokenizer.vocab_size <= 300
    stream = np.concatenate([ds.train, ds.val])
    assert stream.max() < ds.tokenizer.vocab_size
    assert ds.tokenizer.decode(stream) == expected_text(corpus_dir)
    assert stream.tolist() == ds.tokenizer.hf.encode(expected_text(corpus_dir)).ids


def test_prepare_with_a_sentencepiece_style_tokenizer(corpus_dir, tmp_path):
    """A LLaMA-2-style tokenizer (a "▁" prepended and for every space, byte fallback
    "<0xE6>" tokens) does not spell out the text in its tokens' strings: the stream is
    still split into its documents, each decoding to its own text (the tokens' character
    offsets, not their lengths)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers, trainers

    from attnlab.tokenizers import Tokenizer

    hf = HFTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    hf.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                    decoders.Fuse(), decoders.Strip(" ", 1, 0)])  # fmt: skip
    specials = ["<unk>"] + [f"<0x{i:02X}>" for i in range(256)]
    hf.train_from_iterator([DOC_A], trainers.BpeTrainer(vocab_size=300, special_tokens=specials))
    tokenizer = Tokenizer(hf)
    ds = prepare_data(DataConfig(path=str(corpus_dir)), tokenizer=tokenizer, cache_dir=tmp_path)
    stream = np.concatenate([ds.train, ds.val])
    assert stream.tolist() == hf.encode(expected_text(corpus_dir)).ids
    first, second = (tokenizer.decode(part) for part in np.split(stream, ds.doc_starts[1:]))
    assert (first, second) == (DOC_B + "\n\n", DOC_A * 40)


@pytest.mark.parametrize("fraction", [0.05, 0.1, 0.5])
def test_split_sizes_are_deterministic(corpus_dir, tmp_path, fraction):
    cfg = DataConfig(path=str(corpus_dir), val_fraction=fraction)
    first = prepare_data(cfg, cache_dir=tmp_path / "c1")
    second = prepare_data(cfg, cache_dir=tmp_path / "c2")  # no shared cache
    n = first.n_tokens
    assert abs(len(first.val) - fraction * n) <= 0.5
    np.testing.assert_array_equal(first.train, second.train)
    np.testing.assert_array_equal(first.val, second.val)


def test_large_vocabulary_uses_uint32(tmp_path):
    # 70 000 distinct code points (skipping surrogates) -> a char vocabulary above 65535.
    points = [p for p in range(0x100, 0x100 + 72_100) if not 0xD800 <= p < 0xE000][:70_000]
    text = "".join(map(chr, points))
    (tmp_path / "wide.txt").write_text(text, encoding="utf-8")
    ds = prepare_data(DataConfig(path=str(tmp_path / "wide.txt")), cache_dir=tmp_path / "cache")
    assert ds.tokenizer.vocab_size == 70_000
    assert ds.train.dtype == np.uint32
    np.testing.assert_array_equal(np.concatenate([ds.train, ds.val]), char_ids(text))


def test_cache_is_reused_and_invalidated(corpus_dir, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cfg = DataConfig(path=str(corpus_dir))
    calls = []
    real_encode = lm._encode_corpus
    monkeypatch.setattr(lm, "_encode_corpus", lambda *a: calls.append(1) or real_encode(*a))

    first = prepare_data(cfg, cache_dir=cache)
    assert len(calls) == 1 and not first.from_cache
    second = prepare_data(cfg, cache_dir=cache)
    assert len(calls) == 1 and second.from_cache  # not tokenised again
    assert isinstance(second.train, np.memmap)
    np.testing.assert_array_equal(first.train, second.train)
    np.testing.assert_array_equal(first.val, second.val)
    assert second.tokenizer.to_json() == first.tokenizer.to_json()
    assert second.n_chars == first.n_chars
    assert not list(cache.glob("*.tmp")) and not list(cache.glob(".*"))  # atomic writes

    # Changing a source file invalidates the cache.
    (corpus_dir / "b.txt").write_text(DOC_B + "more text\n", encoding="utf-8")
    third = prepare_data(cfg, cache_dir=cache)
    assert len(calls) == 2 and not third.from_cache
    assert third.n_tokens == first.n_tokens + len("more text\n")

    # So does a different tokenizer for the same corpus.
    other = train_tokenizer("char", [expected_text(corpus_dir) + "more text\n~"])
    fourth = prepare_data(cfg, tokenizer=other, cache_dir=cache)
    assert len(calls) == 3 and not fourth.from_cache
    assert fourth.tokenizer is other


def test_corrupt_cache_is_rebuilt(corpus_dir, tmp_path):
    cache = tmp_path / "cache"
    cfg = DataConfig(path=str(corpus_dir))
    first = prepare_data(cfg, cache_dir=cache)
    first.cache_file.write_bytes(b"garbage")
    second = prepare_data(cfg, cache_dir=cache)
    assert not second.from_cache
    np.testing.assert_array_equal(second.train, first.train)


@pytest.mark.parametrize("damage", ["empty", "garbled-header", "shorter", "meta-mismatch"])
def test_damaged_token_cache_is_rebuilt(corpus_dir, tmp_path, damage):
    """An empty stream file (a crash after the rename, before the data reached the disk)
    crashed with EOFError; a stream that reads as a valid but different array (a garbled
    .npy header), or a meta file of another stream, was used as it was."""
    cache = tmp_path / "cache"
    cfg = DataConfig(path=str(corpus_dir))
    first = prepare_data(cfg, cache_dir=cache)
    file = first.cache_file
    if damage == "empty":
        file.write_bytes(b"")
    elif damage == "garbled-header":
        file.write_bytes(file.read_bytes().replace(b"}", b" ", 1))  # tokenize.TokenError
    elif damage == "shorter":
        np.save(file, np.asarray(first.train[:50]))
    else:
        meta = file.with_suffix(".json")
        meta.write_text(meta.read_text().replace('"doc_starts": [', '"doc_starts": [99999999, ', 1))
    second = prepare_data(cfg, cache_dir=cache)
    assert not second.from_cache
    np.testing.assert_array_equal(second.train, first.train)
    np.testing.assert_array_equal(second.val, first.val)
    np.testing.assert_array_equal(second.doc_starts, first.doc_starts)
    assert prepare_data(cfg, cache_dir=cache).from_cache  # rewritten


def test_unreadable_or_foreign_tokenizer_cache_is_retrained(corpus_dir, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cfg = DataConfig(path=str(corpus_dir))
    first = prepare_data(cfg, cache_dir=cache)
    (entry,) = cache.glob("tokenizer-char-*.json")
    entry.write_text(train_tokenizer("bpe", ["some other text"], 300).to_json())
    assert prepare_data(cfg, cache_dir=cache).tokenizer.to_json() == first.tokenizer.to_json()

    def unreadable(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(lm, "load_tokenizer", unreadable)  # another user's 0600 file
    assert prepare_data(cfg, cache_dir=cache).tokenizer.to_json() == first.tokenizer.to_json()


def test_cache_location_from_env_and_cwd(corpus_dir, tmp_path, monkeypatch):
    cfg = DataConfig(path=str(corpus_dir))
    monkeypatch.setenv("ATTNLAB_CACHE", str(tmp_path / "env_cache"))
    ds = prepare_data(cfg)
    assert ds.cache_file.parent == tmp_path / "env_cache" and ds.cache_file.is_file()
    monkeypatch.delenv("ATTNLAB_CACHE")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    ds = prepare_data(cfg)
    # The user cache folder, never the current directory.
    assert ds.cache_file.parent == tmp_path / "xdg" / "attnlab" and ds.cache_file.is_file()
    assert not (tmp_path / ".attnlab_cache").exists()
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "attnlab"


def test_folder_corpus_reads_txt_and_md(tmp_path):
    (tmp_path / "c" / "sub").mkdir(parents=True)
    (tmp_path / "c" / "a.txt").write_text("plain text\n")
    (tmp_path / "c" / "sub" / "b.md").write_text("# A heading\n")
    (tmp_path / "c" / "skip.py").write_text("print()\n")
    docs = read_corpus(tmp_path / "c")
    assert [Path(name).name for name, _ in docs] == ["a.txt", "b.md"]


def test_folder_corpus_order_suffixes_and_blank_files(tmp_path):
    """Documents in order of their path relative to the folder (not the order the file
    system lists them, nor the folders' files first), suffixes in any case, and a file of
    whitespace only adds no document."""
    root = tmp_path / "c"
    for name in ("z.txt", "m/a.txt", "A.txt", "b.MD", "m/NOTES.TXT", "blank.txt"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(" \n\t\n" if name == "blank.txt" else f"text of {name}\n")
    (tmp_path / "outside.txt").write_text("text of 0.txt\n")
    (root / "0.txt").symlink_to(tmp_path / "outside.txt")  # a linked file sorts by its name
    docs = read_corpus(root)
    names = ["0.txt", "A.txt", "b.MD", "m/NOTES.TXT", "m/a.txt", "z.txt"]  # code point order
    assert [name for name, _ in docs] == [str(root / name) for name in names]
    assert [text for _, text in docs] == [f"text of {name}\n" for name in names]


def test_sources_digest_changes_with_names_contents_order_and_boundaries():
    from attnlab.data.corpus import RawSource, sources_digest

    def digest(*pairs):
        return sources_digest([RawSource(key, key, data) for key, data in pairs])

    base = digest(("a.txt", b"one"), ("b.txt", b"two"))
    assert base == digest(("a.txt", b"one"), ("b.txt", b"two"))
    others = [
        digest(("a.txt", b"one"), ("c.txt", b"two")),  # a file renamed
        digest(("a.txt", b"one"), ("b.txt", b"twO")),  # an edit
        digest(("b.txt", b"two"), ("a.txt", b"one")),  # the order
        digest(("a.txt", b"one"), ("b.txt", b"two"), ("c.txt", b"")),  # one more document
        digest(("a.txtone", b""), ("b.txt", b"two")),  # the same bytes, cut elsewhere
    ]
    assert len({base, *others}) == 1 + len(others)


def test_unwritable_cache_warns_and_still_works(corpus_dir, tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("a file where the cache folder should be")
    with pytest.warns(UserWarning, match="could not write the data cache"):
        ds = prepare_data(DataConfig(path=str(corpus_dir)), cache_dir=not_a_dir)
    text = expected_text(corpus_dir)
    assert ds.tokenizer.decode(np.concatenate([ds.train, ds.val])) == text


def test_given_tokenizer_missing_characters_is_a_data_error(corpus_dir, tmp_path):
    ascii_only = train_tokenizer("char", ["abcdefghijklmnopqrstuvwxyz .\n"])
    with pytest.raises(DataError, match="characters not in the vocabulary"):
        prepare_data(DataConfig(path=str(corpus_dir)), tokenizer=ascii_only, cache_dir=tmp_path)


def test_embedded_corpus_prepares(tmp_path):
    ds = prepare_data(DataConfig(), cache_dir=tmp_path)
    assert ds.sources == [name for name, _ in read_corpus(None)]  # one per topic
    assert ds.sources[0].startswith(EMBEDDED_NAME) and len(ds.doc_starts) == len(ds.sources)
    assert ds.n_tokens == len(default_corpus())  # char: one token per character


# ---------------------------------------------------------------------- blocks


def test_check_block(tmp_path):
    (tmp_path / "tiny.txt").write_text("abcdefghijklmnopqrst")  # 20 tokens: 18 train, 2 val
    ds = prepare_data(
        DataConfig(path=str(tmp_path / "tiny.txt"), val_fraction=0.1), cache_dir=tmp_path
    )
    ds.check_block(1)
    with pytest.raises(DataError) as info:
        ds.check_block(2)
    message = str(info.value)
    assert "val split has 2 tokens" in message and "at least 3" in message
    assert "val_fraction" in message
    with pytest.raises(DataError, match="train split has 10 tokens") as info:
        make_dataset(np.arange(20, dtype=np.uint16), val_fraction=0.5).check_block(10)
    assert "lower data.val_fraction" in str(info.value)


def test_sample_starts_cover_the_valid_range():
    tokens = np.arange(40, dtype=np.uint16) % 7
    ds = make_dataset(tokens)  # 30 train, 10 val
    block = 5
    starts = ds.sample_starts("train", 4000, block, torch.Generator().manual_seed(1))
    assert starts.dtype == torch.int64 and starts.shape == (4000,)
    # Every start from 0 to len - block - 1 (the last one with a full target) occurs.
    assert set(starts.tolist()) == set(range(len(ds.train) - block))
    again = ds.sample_starts("train", 4000, block, torch.Generator().manual_seed(1))
    assert torch.equal(starts, again)
    with pytest.raises(DataError, match="val split has 10 tokens"):
        ds.sample_starts("val", 1, 10, torch.Generator())
    with pytest.raises(DataError, match="unknown split 'test'"):
        ds.sample_starts("test", 1, 2, torch.Generator())


def test_batch_matches_direct_slicing():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50, size=500).astype(np.uint16)
    ds = make_dataset(tokens)
    block = 16
    for split, array in (("train", ds.train), ("val", ds.val)):
        starts = ds.sample_starts(split, 8, block, torch.Generator().manual_seed(3))
        x, y = ds.batch(split, starts, block)
        assert x.shape == y.shape == (8, block) and x.dtype == y.dtype == torch.int64
        assert x.is_contiguous() and y.is_contiguous()
        for row, start in enumerate(starts.tolist()):
            assert x[row].tolist() == array[start : start + block].tolist()
            assert y[row].tolist() == array[start + 1 : start + block + 1].tolist()
        assert torch.equal(y[:, :-1], x[:, 1:])  # y is x shifted by one token
    last = torch.tensor([len(ds.train) - block - 1])
    ds.batch("train", last, block)  # the last valid start
    with pytest.raises(DataError, match="block starts must lie"):
        ds.batch("train", last + 1, block)


def test_iter_eval_walks_non_overlapping_blocks():
    tokens = (np.arange(203, dtype=np.uint16) * 7) % 31
    ds = make_dataset(tokens, val_fraction=0.5)  # 102 train, 101 val
    block, batch_size = 8, 3
    batches = list(ds.iter_eval("val", batch_size, block))
    n_blocks = (len(ds.val) - 1) // block  # 12 full (x, y) blocks fit
    assert [len(x) for x, _ in batches] == [3, 3, 3, 3]
    xs = torch.cat([x for x, _ in batches])
    ys = torch.cat([y for _, y in batches])
    assert xs.shape == (n_blocks, block)
    assert xs.reshape(-1).tolist() == ds.val[: n_blocks * block].tolist()
    assert ys.reshape(-1).tolist() == ds.val[1 : n_blocks * block + 1].tolist()
    # Deterministic, and max_batches stops early.
    again = list(ds.iter_eval("val", batch_size, block))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, again))
    assert len(list(ds.iter_eval("val", batch_size, block, max_batches=2))) == 2
    # A ragged last batch: 12 train blocks of 8 in 102 tokens, batches of 5.
    sizes = [len(x) for x, _ in ds.iter_eval("train", 5, block)]
    assert sizes == [5, 5, 2]
    # A split of exactly k blocks + 1 token holds k blocks: the last target is its last token.
    exact = TokenDataset(ds.tokenizer, train=ds.train, val=ds.val[: 4 * block + 1])
    ys = torch.cat([y for _, y in exact.iter_eval("val", batch_size, block)])
    assert ys.shape == (4, block) and ys[-1, -1] == exact.val[-1]


def test_read_corpus_follows_symlinked_folders_once(tmp_path):
    """A symlinked subfolder's files are documents too (Path.rglob skipped them); a link
    back up the tree is read once, not forever."""
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "b.txt").write_text("linked text\n")
    root = tmp_path / "root"
    root.mkdir()
    (root / "a.txt").write_text("own text\n")
    (root / "linked").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (root / "loop").symlink_to(root, target_is_directory=True)
    from attnlab.data.corpus import load_sources

    assert [source.key for source in load_sources(root)] == ["a.txt", "linked/b.txt"]


def test_a_file_linked_inside_the_corpus_is_one_document(tmp_path):
    """A link to a file of the corpus ("latest.md" -> a note) is not a second copy of its
    text: the copy, last in sorted order, would be validation text the model trained on."""
    from attnlab.data.corpus import load_sources

    root = tmp_path / "root"
    root.mkdir()
    (root / "b.txt").write_text("the note\n")
    (root / "a_latest.txt").symlink_to(root / "b.txt")
    (root / "z_latest.txt").symlink_to(root / "b.txt")
    (root / "outside.txt").symlink_to(tmp_path / "elsewhere.txt")
    (tmp_path / "elsewhere.txt").write_text("linked from outside\n")
    keys = [source.key for source in load_sources(root)]
    assert keys == ["b.txt", "outside.txt"]  # the real name wins over the links' names


def test_a_hard_link_inside_the_corpus_is_one_document(tmp_path):
    """A hard link is another name of the same file, as a symbolic link is: its text was
    read twice, the copy (last in sorted order) in the validation split, text the model
    trained on."""
    import os

    from attnlab.data.corpus import load_sources

    root = tmp_path / "root"
    root.mkdir()
    (root / "b.txt").write_text(DOC_A * 20)
    (root / "a.txt").write_text(DOC_B)
    try:
        os.link(root / "b.txt", root / "z_copy.txt")
    except OSError:
        pytest.skip("this file system has no hard links")
    assert [source.key for source in load_sources(root)] == ["a.txt", "b.txt"]
    ds = prepare_data(DataConfig(path=str(root), val_fraction=0.3), cache_dir=tmp_path / "c")
    np.testing.assert_array_equal(
        np.concatenate([ds.train, ds.val]), char_ids(DOC_B + DOCUMENT_SEPARATOR + DOC_A * 20)
    )


@pytest.mark.parametrize("reverse", [False, True])
def test_a_folder_reached_directly_and_by_a_link_has_one_name_whatever_the_listing_order(
    tmp_path, monkeypatch, reverse
):
    """The file system lists a folder in its own order: a folder reachable both as itself
    and through a link is read once, under its real name, whichever comes first."""
    import os

    from attnlab.data.corpus import load_sources

    root = tmp_path / "root"
    (root / "z_real").mkdir(parents=True)
    (root / "z_real" / "x.txt").write_text("text\n")
    (root / "a_link").symlink_to(root / "z_real", target_is_directory=True)
    scandir = os.scandir

    class Listing:  # os.scandir's entries in the order a test picks
        def __init__(self, path):
            with scandir(path) as it:
                entries = sorted(it, key=lambda e: e.name, reverse=reverse)
            self.entries = iter(entries)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def __iter__(self):
            return self

        def __next__(self):
            return next(self.entries)

        def close(self):
            pass

    monkeypatch.setattr(os, "scandir", Listing)
    assert [source.key for source in load_sources(root)] == ["z_real/x.txt"]


def test_a_corpus_file_whose_name_is_not_utf8_is_read_and_cached(tmp_path):
    """A folder may hold a file whose name is not UTF-8 (os.walk gives its bytes as lone
    surrogates): its text is a document like any other; the cache key crashed with a
    UnicodeEncodeError. The key is the name's own bytes, so it still tells files apart."""
    import os

    root = tmp_path / "root"
    root.mkdir()
    try:
        with open(os.path.join(os.fsencode(root), b"caf\xe9.txt"), "w", encoding="utf-8") as f:
            f.write(DOC_A)
    except OSError:  # a file system that takes UTF-8 names only
        pytest.skip("this file system refuses names that are not UTF-8")
    (root / "b.txt").write_text(DOC_B, encoding="utf-8")
    cfg, cache = DataConfig(path=str(root)), tmp_path / "cache"
    first = prepare_data(cfg, cache_dir=cache)
    assert [Path(name).name for name in first.sources] == ["b.txt", "caf\udce9.txt"]
    text = DOC_B + DOCUMENT_SEPARATOR + DOC_A
    np.testing.assert_array_equal(np.concatenate([first.train, first.val]), char_ids(text))
    assert prepare_data(cfg, cache_dir=cache).from_cache
    # another name of the same bytes is another corpus
    os.rename(os.path.join(os.fsencode(root), b"caf\xe9.txt"), root / "c.txt")
    assert not prepare_data(cfg, cache_dir=cache).from_cache
