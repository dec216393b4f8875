"""Task pieces: pair batching, MLM batches, digits data, image augmentation; a tiny
seq2seq model learns to reverse sequences with them."""

from __future__ import annotations

import pytest
import torch

from attnlab.data.pairs import mlm_batches, pad_pairs, pair_batches, seq2seq_step
from attnlab.models.seq2seq import Seq2SeqConfig, Seq2SeqModel


def test_pad_pairs_teacher_forcing_layout():
    batch = pad_pairs([([5, 6, 7], [8, 9]), ([5], [8, 9, 10])], pad_id=0, bos_id=1, eos_id=2)
    assert batch.src.tolist() == [[5, 6, 7], [5, 0, 0]]
    assert batch.src_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch.tgt.tolist() == [[1, 8, 9, 0], [1, 8, 9, 10]]
    assert batch.targets.tolist() == [[8, 9, 2, -100], [8, 9, 10, 2]]


def test_pair_batches_refuse_a_batch_no_epoch_can_fill():
    """With fewer pairs than ``batch_size`` (or none) no epoch held a batch: ``next`` looped
    for ever."""
    pairs = [([3], [4]), ([5], [6]), ([7], [8])]
    batch = next(pair_batches(pairs, 3, pad_id=0, bos_id=1, eos_id=2))  # as many as pairs: fine
    assert sorted(batch.src[:, 0].tolist()) == [3, 5, 7]
    for given, size in ((pairs, 4), ([], 1), (pairs, 0)):
        with pytest.raises(ValueError, match=f"batch_size={size}"):
            next(pair_batches(given, size, pad_id=0, bos_id=1, eos_id=2))


def test_mlm_batches_shapes_and_targets():
    tokens = torch.arange(4, 500) % 50 + 4
    inputs, targets = next(mlm_batches(tokens, 16, 8, mask_id=3, vocab_size=60, mask_prob=0.5))
    assert inputs.shape == targets.shape == (8, 16)
    chosen = targets != -100
    assert chosen.any() and bool((targets[chosen] >= 4).all())  # original stream tokens
    assert bool((inputs[~chosen] >= 4).all())  # unchosen positions keep their token


def test_mlm_batches_draw_every_window_the_last_one_too():
    """Masked LM needs no next token: the window ending at the stream's last token is one
    of the ``n - block_size + 1`` windows (it was never drawn, nor a stream of exactly
    ``block_size`` tokens accepted)."""
    block = 16
    for n in (block, block + 1, block + 3):
        tokens = torch.arange(10, 10 + n)
        batches = mlm_batches(tokens, block, 64, mask_id=3, vocab_size=60, mask_prob=1.0)
        firsts = {int(t) for _ in range(4) for t in next(batches)[1][:, 0]}  # targets: all
        assert firsts == set(range(10, 10 + n - block + 1))


def test_image_batches_refuse_a_batch_no_epoch_can_fill():
    """More images per batch than images (or none): ``next`` looped for ever."""
    from attnlab.data.images import image_batches

    x, y = torch.zeros(5, 1, 8, 8), torch.arange(5)
    assert sorted(next(image_batches(x, y, 5))[1].tolist()) == list(range(5))
    for size in (6, 0):
        with pytest.raises(ValueError, match=f"batch_size={size}"):
            next(image_batches(x, y, size))


def test_seq2seq_learns_to_reverse():
    torch.manual_seed(0)
    cfg = Seq2SeqConfig(
        vocab_size=14,
        max_seq_len=16,
        d_model=32,
        n_layers=2,
        n_decoder_layers=2,
        attention={"n_heads": 4, "qkv_bias": True, "out_bias": True},
        norm={"placement": "pre"},
        pad_id=0,
        bos_id=1,
        eos_id=2,
    ).override({})
    model = Seq2SeqModel(cfg)
    g = torch.Generator().manual_seed(0)
    pairs = []
    for _ in range(400):
        x = torch.randint(3, 14, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g)
        pairs.append((x.tolist(), x.flip(0).tolist()))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = pair_batches(pairs, 32, pad_id=0, bos_id=1, eos_id=2)
    for _ in range(300):
        loss = seq2seq_step(model, next(batches)).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    src = pad_pairs(pairs[:16], pad_id=0, bos_id=1, eos_id=2)
    out = model.generate(src.src, 8, src_mask=src.src_mask, num_beams=2)
    right = sum(o == y for o, (_, y) in zip(out, pairs[:16]))
    assert right >= 12, out


def test_digits_and_random_shift():
    pytest.importorskip("sklearn")
    from attnlab.data.images import digits, random_shift

    data = digits(seed=0)
    assert data.train_x.shape[1:] == (1, 8, 8) and len(data.test_y) == 359
    assert 0.0 <= float(data.train_x.min()) and float(data.train_x.max()) <= 1.0
    x = torch.arange(2 * 64, dtype=torch.float32).view(2, 1, 8, 8)
    shifted = random_shift(x, pad=1, generator=torch.Generator().manual_seed(0))
    assert shifted.shape == x.shape
    for i in range(2):  # each output is the image moved by at most one pixel
        ok = False
        for dy in (-1, 0, 1):
            for dx in (-1, 0, 1):
                moved = torch.roll(x[i], (dy, dx), (1, 2))
                inner = shifted[i, :, 1:-1, 1:-1] == moved[:, 1:-1, 1:-1]
                ok |= bool(inner.all())
        assert ok


def test_digits_split_keeps_each_image_with_its_label():
    """Against scikit-learn's own arrays: the two splits together are every image once, each
    with its label, pixels 0..16 scaled to exactly 0..1."""
    pytest.importorskip("sklearn")
    from sklearn.datasets import load_digits

    from attnlab.data.images import digits

    ref = load_digits()
    want = sorted(
        (img.astype(int).tobytes(), int(label)) for img, label in zip(ref.images, ref.target)
    )
    data = digits(test_fraction=0.25, seed=3)
    x = torch.cat([data.train_x, data.test_x]) * 16  # (n, 1, 8, 8) back to grey levels
    y = torch.cat([data.train_y, data.test_y])
    assert torch.equal(x, x.round()) and float(x.max()) == 16.0
    got = sorted((img[0].numpy().astype(int).tobytes(), int(label)) for img, label in zip(x, y))
    assert got == want
    assert len(data.test_y) == round(0.25 * len(ref.target))


def test_shift_moves_each_image_by_pad_minus_its_offsets():
    from attnlab.data.images import shift

    x = torch.arange(1, 2 * 3 * 64 + 1, dtype=torch.float32).view(2, 3, 8, 8)
    dy, dx = torch.tensor([0, 2]), torch.tensor([2, 1])
    out = shift(x, dy, dx, pad=1)
    for i in range(2):  # moved down by 1 - dy, right by 1 - dx; zeros where nothing moves in
        down, right = 1 - int(dy[i]), 1 - int(dx[i])
        want = torch.zeros(3, 8, 8)
        for r in range(8):
            for c in range(8):
                if 0 <= r - down < 8 and 0 <= c - right < 8:
                    want[:, r, c] = x[i, :, r - down, c - right]
        assert torch.equal(out[i], want)


def test_random_shift_draws_every_offset_and_batches_keep_their_labels():
    from attnlab.data.images import image_batches, random_shift, shift

    x = torch.arange(1, 65, dtype=torch.float32).view(1, 1, 8, 8).expand(300, 1, 8, 8)
    out = random_shift(x, pad=1, generator=torch.Generator().manual_seed(0))
    offsets = [(dy, dx) for dy in range(3) for dx in range(3)]
    moved = {o: shift(x[:1], torch.tensor([o[0]]), torch.tensor([o[1]]))[0] for o in offsets}
    seen = {next(o for o in offsets if torch.equal(img, moved[o])) for img in out}
    assert seen == set(offsets)
    # images of constant grey level = label: an augmented image's inner pixels still say it
    images = torch.arange(40, dtype=torch.float32)[:, None, None, None].expand(40, 1, 8, 8)
    batches = image_batches(images, torch.arange(40), 8, seed=1)
    for _ in range(10):
        batch, labels = next(batches)
        assert torch.equal(batch[:, 0, 1:-1, 1:-1], labels[:, None, None].float().expand(8, 6, 6))


def test_accuracy_counts_argmax_hits_and_restores_modes():
    from types import SimpleNamespace

    from attnlab.data.images import accuracy

    class Picks(torch.nn.Module):  # logits: the image's first 3 pixels
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.Dropout(0.5)

        def forward(self, x):
            return SimpleNamespace(logits=x.flatten(1)[:, :3])

    x = torch.zeros(7, 1, 8, 8)
    predicted = torch.tensor([0, 1, 2, 0, 1, 2, 0])
    x[torch.arange(7), 0, 0, predicted] = 1.0
    y = torch.tensor([0, 1, 2, 1, 1, 0, 0])  # 5 of 7 right
    model = Picks().train()
    model.inner.eval()
    assert accuracy(model, x, y, batch_size=3) == pytest.approx(5 / 7)
    assert model.training and not model.inner.training
    with pytest.raises(IndexError):  # no logits to take the arg-max of: modes still return
        accuracy(model, x[..., :0], y)
    assert model.training and not model.inner.training


def test_text_classification_trains_single_label_classifiers():
    """A multi-label classifier (an imported problem_type) fine-tuned by the task, whose
    loss is softmax cross-entropy over one label, is a single-label one afterwards."""
    from attnlab.presets import get_run_preset
    from attnlab.tasks import get_task

    cfg = get_run_preset("bert-tiny-langid")
    cfg.model.problem_type = "multi_label_classification"
    get_task(cfg.task)(cfg).configure_model(cfg.model)
    assert cfg.model.problem_type is None
    cfg.model.validate()
