"""What models' forward and the functional entry points do with the inputs users get wrong:
a silently wrong result becomes an error naming the argument, and transformers' accepted
forms (a (b, 1) label column) give its result."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnlab.config import AttentionConfig, ModelConfig
from attnlab.functional import attend, flash_attention, masked_softmax
from attnlab.models.decoder import DecoderLM
from attnlab.models.encoder import EncoderConfig, EncoderModel
from attnlab.models.rnn import GRUSeq2Seq, RNNSeq2SeqConfig
from attnlab.models.seq2seq import Seq2SeqConfig, Seq2SeqModel
from attnlab.models.xl import TransformerXL, XLConfig


def _qkv():
    torch.manual_seed(0)
    q = torch.randn(2, 4, 5, 8)
    k, v = torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    keep = torch.rand(2, 1, 5, 6) > 0.3
    keep[..., 0] = True
    return q, k, v, keep


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8])
@pytest.mark.parametrize("backend", ["eager", "sdpa", "flash"])
def test_integer_masks_are_refused_not_added_to_the_scores(backend, dtype):
    """A 1 = keep / 0 = drop integer mask was added to the scores (+1 on kept keys, the
    dropped ones attended to) on every backend; torch's SDPA refuses it."""
    q, k, v, keep = _qkv()
    with pytest.raises(ValueError, match=r"mask must be bool .* mask.bool\(\)"):
        attend(q, k, v, keep.to(dtype), backend=backend)


def test_masked_softmax_and_flash_refuse_integer_masks():
    q, k, v, keep = _qkv()
    with pytest.raises(ValueError, match="mask must be bool"):
        masked_softmax(torch.randn(2, 5, 6), keep[:, 0].long())
    with pytest.raises(ValueError, match="mask must be bool"):
        flash_attention(q, k, v, keep.int())


@pytest.mark.parametrize("backend", ["eager", "sdpa", "flash"])
def test_values_and_keys_of_different_lengths_are_refused(backend):
    """torch's SDPA on the CPU returned a result for 5 values under 6 keys."""
    q, k, v, _ = _qkv()
    with pytest.raises(ValueError, match="same number of keys"):
        attend(q, k, v[:, :, :5], backend=backend)


def _decoder() -> DecoderLM:
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=40, max_seq_len=16, d_model=16, n_layers=1,
        attention=AttentionConfig(n_heads=2), init_std=0.1,
    )  # fmt: skip
    return DecoderLM(cfg).eval()


def test_decoder_names_malformed_inputs():
    m = _decoder()
    idx = torch.randint(0, 40, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    with pytest.raises(ValueError, match=r"idx must be \(b, t\).*idx\[None\]"):
        m(idx[0])
    with pytest.raises(ValueError, match="idx must hold integer token ids"):
        m(idx.float())
    # a 4-D mask failed as "split_with_sizes expects split_sizes to sum exactly to 2"
    with pytest.raises(ValueError, match=r"attention_mask must be \(2, 8\)"):
        m(idx, attention_mask=mask[:, None, None, :])
    with pytest.raises(ValueError, match=r"targets must be \(b, t\) like idx = \(2, 8\)"):
        m(idx, targets=idx[:, 1:])
    # int32 targets, like int32 ids, give the int64 loss (cross-entropy refused them)
    assert m(idx, targets=idx.int()).loss.item() == m(idx, targets=idx).loss.item()


def test_seq2seq_models_name_malformed_inputs():
    torch.manual_seed(0)
    src, tgt = torch.randint(3, 20, (2, 7)), torch.randint(3, 20, (2, 5))
    mask = torch.ones(2, 7, dtype=torch.bool)
    gru = GRUSeq2Seq(RNNSeq2SeqConfig(src_vocab_size=20, vocab_size=20, embed_dim=8, hidden_dim=8))
    # the GRU model said "every source sequence needs at least one real token"
    with pytest.raises(ValueError, match=r"src_mask must be \(2, 7\)"):
        gru(src, tgt=tgt, src_mask=mask[:, None, None, :])
    attention = AttentionConfig(n_heads=2, qkv_bias=True, out_bias=True)
    cfg = Seq2SeqConfig(vocab_size=20, max_seq_len=16, d_model=16, n_layers=1, attention=attention)
    s2s = Seq2SeqModel(cfg)
    for model in (gru, s2s):
        with pytest.raises(ValueError, match="src has 2 rows but tgt 1"):
            model(src, tgt=tgt[:1])
        with pytest.raises(ValueError, match=r"src must be \(b, t\)"):
            model(src[0], tgt=tgt)


def test_seq2seq_names_a_target_mask_of_another_shape():
    """tgt_mask (b, t) like tgt: the source's mask given by mistake failed as an expand
    error deep in decode, or (with a matching width) silently masked other positions."""
    torch.manual_seed(0)
    src, tgt = torch.randint(3, 20, (2, 7)), torch.randint(3, 20, (2, 5))
    attention = AttentionConfig(n_heads=2, qkv_bias=True, out_bias=True)
    cfg = Seq2SeqConfig(vocab_size=20, max_seq_len=16, d_model=16, n_layers=1, attention=attention)
    model = Seq2SeqModel(cfg)
    for bad in (torch.ones(2, 7), torch.ones(3, 5), torch.ones(2, 1, 1, 5)):
        with pytest.raises(ValueError, match=r"tgt_mask must be \(2, 5\)"):
            model(src, tgt=tgt, tgt_mask=bad)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1] * 5])
    torch.testing.assert_close(model(src, tgt=tgt, tgt_mask=mask).logits, model(src, tgt).logits)


def test_xl_names_memory_of_another_batch():
    torch.manual_seed(0)
    m = TransformerXL(XLConfig(vocab_size=20, d_model=16, n_layers=1,
                               attention=AttentionConfig(n_heads=2), mem_len=4))  # fmt: skip
    memory = m(torch.randint(0, 20, (2, 6))).memory
    with pytest.raises(ValueError, match="memory holds 2 rows but idx 1"):
        m(torch.randint(0, 20, (1, 6)), memory=memory)


def _encoder(head: str, n_labels: int, problem_type: str | None = None) -> EncoderModel:
    torch.manual_seed(0)
    cfg = EncoderConfig(
        vocab_size=40, max_seq_len=16, d_model=16, n_layers=1,
        attention=AttentionConfig(n_heads=2, qkv_bias=True, out_bias=True),
        head=head, n_labels=n_labels, problem_type=problem_type, init_std=0.1,
    )  # fmt: skip
    return EncoderModel(cfg).eval()


def test_regression_targets_as_a_column_give_the_loss_of_a_vector():
    """(b, 1) targets broadcast against (b,) predictions: every row against every target
    (transformers squeezes both)."""
    m = _encoder("sequence", 1)
    idx, y = torch.randint(0, 40, (3, 6)), torch.randn(3)
    out = m(idx, targets=y[:, None])
    torch.testing.assert_close(out.loss, F.mse_loss(out.logits[:, 0], y))
    assert out.loss.item() == m(idx, targets=y).loss.item()


def test_class_id_column_is_accepted_as_transformers_does():
    m = _encoder("sequence", 3)
    idx, y = torch.randint(0, 40, (3, 6)), torch.tensor([0, 2, 1])
    out = m(idx, targets=y[:, None].int())
    torch.testing.assert_close(out.loss, F.cross_entropy(out.logits, y))


def test_multi_label_classifier_trains_a_sigmoid_per_label():
    """problem_type multi_label_classification (an imported model's) was ignored: 0/1 targets
    reached the softmax cross-entropy as class probabilities."""
    m = _encoder("sequence", 3, "multi_label_classification")
    idx = torch.randint(0, 40, (3, 6))
    y = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    out = m(idx, targets=y)
    torch.testing.assert_close(out.loss, F.binary_cross_entropy_with_logits(out.logits, y))
    reg = _encoder("sequence", 3, "regression")
    out = reg(idx, targets=y)
    torch.testing.assert_close(out.loss, F.mse_loss(out.logits, y))


def test_a_classifier_without_problem_type_infers_it_from_the_targets_as_transformers(
    tmp_path,
):
    """problem_type None: class ids -> softmax cross-entropy, float (b, n) targets -> a
    sigmoid per label (transformers' multi_label_classification; they were read as class
    probabilities, which an explicit single_label_classification still takes): the losses
    of transformers' BertForSequenceClassification, imported."""
    transformers = pytest.importorskip("transformers")
    from attnlab.interop import load_hf

    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=24,
                                  num_labels=3)  # fmt: skip
    hf = transformers.BertForSequenceClassification(cfg).eval()
    hf.save_pretrained(tmp_path)
    m = load_hf(tmp_path).eval()
    assert m.cfg.problem_type is None
    idx = torch.randint(0, 40, (3, 6))
    y = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    ids = torch.tensor([2, 0, 1])
    with torch.no_grad():
        for targets in (y, ids):
            hf.config.problem_type = None  # transformers sets it at its first loss
            want = hf(input_ids=idx, labels=targets).loss
            torch.testing.assert_close(m(idx, targets=targets).loss, want)
    soft = _encoder("sequence", 3, "single_label_classification")
    out = soft(idx, targets=y.softmax(-1))
    torch.testing.assert_close(out.loss, F.cross_entropy(out.logits, y.softmax(-1)))


def test_encoder_names_malformed_targets_and_token_types():
    idx = torch.randint(0, 40, (2, 6))
    with pytest.raises(ValueError, match=r"targets must be \(b, 2\) start and end"):
        _encoder("qa", 2)(idx, targets=torch.tensor([[1, 3, 0], [2, 2, 0]]))
    with pytest.raises(ValueError, match=r"token_type_ids must be \(b, t\)"):
        _encoder("none", 2)(idx, token_type_ids=torch.zeros(2, 5, dtype=torch.long))


@pytest.mark.parametrize("name", ["token_type_ids", "positions"])
def test_encoder_refuses_token_types_or_positions_of_other_rows(name):
    """Rows other than b (or 1, for every row) broadcast against idx: one row of token ids
    with three rows of token types gave three rows of logits."""
    m = _encoder("sequence", 2)
    idx = torch.randint(0, 40, (2, 6))
    ids = torch.arange(6)[None] % 2  # (1, t): the same for every row
    torch.testing.assert_close(
        m(idx, **{name: ids}).logits, m(idx, **{name: ids.expand(2, 6)}).logits
    )
    with pytest.raises(ValueError, match=rf"{name} must be \(b, t\) = \(1, 6\)"):
        m(idx[:1], **{name: torch.zeros(3, 6, dtype=torch.long)})
    with pytest.raises(ValueError, match=rf"{name} must be \(b, t\) = \(2, 6\)"):
        m(idx, **{name: torch.zeros(3, 6, dtype=torch.long)})
