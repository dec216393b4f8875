"""Numbers-to-words data: disjoint deterministic splits, exact round trips, padded batches."""

from __future__ import annotations

import pytest
import torch
from num2words import num2words

from attnlab.data.corpus import DataError
from attnlab.data.numbers import (
    IGNORE_INDEX,
    CharVocab,
    collate,
    iterate_batches,
    make_numbers_dataset,
)


@pytest.fixture(scope="module", params=["en", "fr"])
def data(request):
    return make_numbers_dataset(request.param, max_number=3000, n_train=2000, n_val=300, n_test=300)


def test_pairs_are_num2words_and_splits_are_disjoint_by_number(data):
    numbers = {name: [int(s) for s, _ in data.split(name)] for name in ("train", "val", "test")}
    assert [len(v) for v in numbers.values()] == [2000, 300, 300]
    for name, values in numbers.items():
        assert len(set(values)) == len(values), name
    assert not set(numbers["train"]) & set(numbers["test"])
    assert not set(numbers["train"]) & set(numbers["val"])
    assert not set(numbers["val"]) & set(numbers["test"])
    for digits, words in data.train[:50] + data.test[:50]:
        assert words == num2words(int(digits), lang=data.lang)
        assert 0 <= int(digits) < 3000


def test_same_seed_same_splits_other_seed_other_splits():
    a = make_numbers_dataset("en", max_number=500, n_train=300, n_val=50, n_test=50, seed=3)
    b = make_numbers_dataset("en", max_number=500, n_train=300, n_val=50, n_test=50, seed=3)
    c = make_numbers_dataset("en", max_number=500, n_train=300, n_val=50, n_test=50, seed=4)
    assert (a.train, a.val, a.test) == (b.train, b.val, b.test)
    assert a.tgt_vocab.itos == b.tgt_vocab.itos
    assert a.test != c.test


def test_encode_decode_round_trip_with_specials(data):
    for digits, words in data.train[:200] + data.test[:200]:
        ids = data.tgt_vocab.encode(words, bos=True, eos=True)
        assert ids[0] == data.tgt_vocab.bos_id and ids[-1] == data.tgt_vocab.eos_id
        assert data.tgt_vocab.decode(ids) == words
        assert data.tgt_vocab.decode(ids + [data.tgt_vocab.pad_id] * 3) == words
        assert data.src_vocab.decode(data.src_vocab.encode(digits)) == digits
    assert data.tgt_vocab.itos[:3] == ["<pad>", "<bos>", "<eos>"]
    # a decoder's output runs on after its EOS: what follows is not text
    vocab = data.src_vocab
    assert vocab.decode(vocab.encode("12", eos=True) + vocab.encode("34", eos=True)) == "12"


def test_target_vocabulary_holds_the_letters_of_every_split():
    """The held-out numbers' words may hold letters no training number has ("z" of zero):
    the target vocabulary is the alphabet of every split, so a test batch encodes."""
    data = make_numbers_dataset("en", max_number=20, n_train=1, n_val=0, n_test=19, seed=0)
    words = [num2words(n, lang="en") for n in range(20)]
    assert data.tgt_vocab.chars == "".join(sorted(set("".join(words))))
    collate(data.test, data.src_vocab, data.tgt_vocab)


def test_french_vocabulary_has_accents_and_english_has_commas():
    fr = make_numbers_dataset("fr", max_number=100, n_train=100, n_val=0, n_test=0)
    en = make_numbers_dataset("en", max_number=2000, n_train=2000, n_val=0, n_test=0)
    assert "é" in fr.tgt_vocab.chars  # zéro
    assert "," in en.tgt_vocab.chars  # one thousand, two hundred ...


def test_collate_pads_and_masks(data):
    pairs = data.train[:7]
    batch = collate(pairs, data.src_vocab, data.tgt_vocab)
    b = len(pairs)
    assert batch.src.shape == batch.src_mask.shape and batch.src.shape[0] == b
    assert batch.tgt_in.shape == batch.tgt_out.shape == batch.tgt_mask.shape
    for row, (digits, words) in enumerate(pairs):
        n_src, n_tgt = len(digits), len(words) + 1  # + BOS in, + EOS out
        assert batch.src_mask[row].sum() == n_src
        assert data.src_vocab.decode(batch.src[row, :n_src].tolist()) == digits
        assert bool((batch.src[row, n_src:] == data.src_vocab.pad_id).all())
        assert batch.tgt_in[row, 0] == data.tgt_vocab.bos_id
        # the decoder's input shifted by one is the target
        assert batch.tgt_in[row, 1:n_tgt].tolist() == batch.tgt_out[row, : n_tgt - 1].tolist()
        assert batch.tgt_out[row, n_tgt - 1] == data.tgt_vocab.eos_id
        assert bool((batch.tgt_out[row, n_tgt:] == IGNORE_INDEX).all())
        assert bool((batch.tgt_in[row, n_tgt:] == data.tgt_vocab.pad_id).all())
        assert batch.tgt_mask[row].sum() == n_tgt


def test_iterate_batches_covers_every_pair_once_and_shuffles_by_seed(data):
    pairs = data.val

    def seen(**kw):
        out = []
        for batch in iterate_batches(pairs, data.src_vocab, data.tgt_vocab, 64, **kw):
            assert batch.src.shape[0] <= 64
            out += [data.tgt_vocab.decode(row) for row in batch.tgt_in[:, 1:].tolist()]
        return out

    plain = seen()
    assert plain == [w for _, w in pairs]
    shuffled = seen(shuffle=True, seed=1)
    assert sorted(shuffled) == sorted(plain) and shuffled != plain
    assert shuffled == seen(shuffle=True, seed=1)
    # a last batch of one pair is kept too
    assert len(pairs) % 64 != 1
    tail = pairs[: 64 * 2 + 1]
    batches = list(iterate_batches(tail, data.src_vocab, data.tgt_vocab, 64))
    assert [b.src.shape[0] for b in batches] == [64, 64, 1]


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: make_numbers_dataset("xx"), "no language 'xx'"),
        (lambda: make_numbers_dataset(max_number=100, n_train=90, n_val=10, n_test=10), "fit"),
        (lambda: make_numbers_dataset(n_val=-1), "n_val"),
        (lambda: make_numbers_dataset(n_train=0), "n_train"),
        (lambda: CharVocab("ab").encode("abc"), "not in the vocabulary"),
        (lambda: collate([], CharVocab("1"), CharVocab("a")), "no pairs"),
        (lambda: list(iterate_batches([("1", "a")], CharVocab("1"), CharVocab("a"), 0)), "batch_size"),  # noqa: E501
    ],
)  # fmt: skip
def test_bad_input_is_a_data_error(call, message):
    with pytest.raises(DataError, match=message):
        call()


def test_batches_are_plain_tensors_any_model_can_read(data):
    batch = collate(data.train[:3], data.src_vocab, data.tgt_vocab)
    assert batch._fields == ("src", "src_mask", "tgt_in", "tgt_out", "tgt_mask")
    assert batch.src.dtype == batch.tgt_in.dtype == batch.tgt_out.dtype == torch.long
    assert batch.src_mask.dtype == batch.tgt_mask.dtype == torch.bool
