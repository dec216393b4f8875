"""Additive attention against a loop; the GRU encoder-decoder's decoding against teacher
forcing and against exhaustive search; padding invariance; a real drop in loss."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from attnlab.config import ConfigError
from attnlab.generation import beam_search_core
from attnlab.generation import length_penalty as _length_penalty
from attnlab.models.outputs import ModelOutput
from attnlab.models.rnn import GRUSeq2Seq, RNNSeq2SeqConfig
from attnlab.nn.additive import AdditiveAttention


def length_penalty(length: int, alpha: float) -> float:
    """GNMT's (Wu et al. 2016, eq. 14) written out, not attnlab's: lp(Y) = (5 + |Y|)^alpha
    / (5 + 1)^alpha."""
    return (5 + length) ** alpha / (5 + 1) ** alpha


@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.0, 2.0])
def test_length_penalties_are_the_published_formulas(alpha):
    for n in (1, 2, 7, 40):
        assert math.isclose(_length_penalty(n, alpha, "gnmt"), length_penalty(n, alpha))
        assert math.isclose(_length_penalty(n, alpha), n**alpha)  # transformers': |Y|^alpha


def beam_search(step, state, reorder, *, bos_id, eos_id, beam_width, max_len=50, n_best=1):
    """The shared core (GNMT style) driven by a (step, state, reorder) model of one input:
    its hypotheses with EOS appended to the finished ones, as the GRU model returns them."""
    holder = {"state": state}
    log_probs, holder["state"] = step(torch.tensor([bos_id]), state)

    def advance(source, tokens):
        holder["state"] = reorder(holder["state"], source)
        log_probs, holder["state"] = step(tokens, holder["state"])
        return log_probs

    hyps = beam_search_core(
        log_probs, advance, num_beams=beam_width, max_new_tokens=max_len, eos_id=eos_id,
        length_penalty=0.0, n_best=n_best, style="gnmt",
    )[0]  # fmt: skip
    return [h._replace(tokens=h.tokens + [eos_id] * h.finished) for h in hyps]


# ------------------------------------------------------------------ additive attention


def loop_additive(attn: AdditiveAttention, q, k, v, mask):
    """One (batch, query, key) at a time: w_v . tanh(W_q q + W_k k), softmax over the real
    keys, weighted sum of values; float64."""
    W_q, W_k = attn.w_q.weight.double(), attn.w_k.weight.double()
    w_v = attn.w_v.weight.double()[0]
    b, t, s = q.shape[0], q.shape[1], k.shape[1]
    context = torch.zeros(b, t, v.shape[-1], dtype=torch.float64)
    weights = torch.zeros(b, t, s, dtype=torch.float64)
    for bi in range(b):
        for ti in range(t):
            scores = {}
            for si in range(s):
                if mask[bi, si]:
                    hidden = torch.tanh(W_q @ q[bi, ti].double() + W_k @ k[bi, si].double())
                    scores[si] = float((w_v @ hidden).detach())
            top = max(scores.values())
            total = sum(math.exp(x - top) for x in scores.values())
            for si, x in scores.items():
                weights[bi, ti, si] = math.exp(x - top) / total
                context[bi, ti] += weights[bi, ti, si] * v[bi, si].double()
    return context, weights


def test_additive_attention_matches_loop_with_padding():
    attn = AdditiveAttention(query_dim=5, key_dim=7, attention_dim=6)
    q, k, v = torch.randn(3, 4, 5), torch.randn(3, 6, 7), torch.randn(3, 6, 2)
    lengths = torch.tensor([6, 2, 4])
    mask = torch.arange(6)[None, :] < lengths[:, None]  # (b, s)
    context, weights = attn(q, k, v, mask=mask)
    want_context, want_weights = loop_additive(attn, q, k, v, mask)
    torch.testing.assert_close(context.double(), want_context, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weights.double(), want_weights, rtol=1e-5, atol=1e-6)
    assert bool((weights[1, :, 2:] == 0).all())  # padded keys get exactly zero weight
    # one query per row (the RNN decoder's use), with the keys projected once
    c1, w1 = attn(q[:, 0], k, v, mask=mask, projected_keys=attn.project_keys(k))
    torch.testing.assert_close(c1, context[:, 0])
    torch.testing.assert_close(w1, weights[:, 0])


def test_additive_attention_integer_padding_mask_means_keep_or_drop():
    """A 0/1 integer mask (as the Transformer encoder-decoder takes ``src_mask``) masks the
    padded keys like the bool one; it is not added to the scores as an additive mask."""
    attn = AdditiveAttention(query_dim=5, key_dim=7, attention_dim=6)
    q, k, v = torch.randn(2, 3, 5), torch.randn(2, 6, 7), torch.randn(2, 6, 2)
    mask = torch.arange(6)[None, :] < torch.tensor([6, 2])[:, None]  # (b, s) bool
    want = attn(q, k, v, mask=mask)
    for as_int in (mask.long(), mask.int(), mask.to(torch.uint8)):
        got = attn(q, k, v, mask=as_int)
        torch.testing.assert_close(got, want)
        assert bool((got[1][1, :, 2:] == 0).all())


def test_additive_attention_mask_shapes():
    """Per key: (b, s), (1, s) or (s,); per query: (b or 1, t or 1, s): each as the same
    mask broadcast to (b, t, s). A mask that fits neither, such as a (t, s) one for a batch
    of another size, is refused by name, not broadcast into a wrong output shape."""
    attn = AdditiveAttention(query_dim=5, key_dim=7, attention_dim=6)
    q, k, v = torch.randn(2, 3, 5), torch.randn(2, 6, 7), torch.randn(2, 6, 2)
    per_query = torch.rand(2, 3, 6) > 0.4
    per_query[..., 0] = True
    want = attn(q, k, v, mask=per_query)
    assert want[0].shape == (2, 3, 2) and want[1].shape == (2, 3, 6)
    assert bool((want[1][~per_query] == 0).all())
    keys = per_query[:, 0]  # (b, s)
    for mask in (keys, keys[:, None], keys[:, None].expand(2, 3, 6)):
        torch.testing.assert_close(attn(q, k, v, mask=mask), attn(q, k, v, mask=keys[:, None]))
    shared = keys[0]
    for mask in (shared, shared[None], shared[None, None], per_query[:1, :1]):
        torch.testing.assert_close(
            attn(q, k, v, mask=mask), attn(q, k, v, mask=shared.expand(2, 3, 6)), rtol=0, atol=0
        )
    with pytest.raises(ValueError, match=r"mask of shape \(3, 6\) does not fit 2 rows of 6"):
        attn(q, k, v, mask=per_query[0])  # (t, s): ambiguous, refused
    with pytest.raises(ValueError, match="does not fit"):
        attn(q, k, v, mask=torch.ones(2, 2, 6, dtype=torch.bool))  # t of 2, not 3
    with pytest.raises(ValueError, match="does not fit"):
        attn(q, k, v, mask=torch.ones(2, 5, dtype=torch.bool))  # 5 keys, not 6


def test_additive_attention_query_and_key_sizes_may_differ_and_gradients_flow():
    attn = AdditiveAttention(3, 9, 4)
    q = torch.randn(2, 3, requires_grad=True)
    k = torch.randn(2, 5, 9, requires_grad=True)
    context, weights = attn(q, k, k)
    assert context.shape == (2, 9) and weights.shape == (2, 5)
    context.sum().backward()
    assert q.grad is not None and k.grad is not None and attn.w_v.weight.grad is not None


# ------------------------------------------------------------------ GRU encoder-decoder

SRC_V, TGT_V = 7, 6  # tiny vocabularies keep exhaustive search affordable
EOS = 2


def tiny_model(**kw) -> GRUSeq2Seq:
    cfg = RNNSeq2SeqConfig(src_vocab_size=SRC_V, vocab_size=TGT_V, embed_dim=8, hidden_dim=12, **kw)
    model = GRUSeq2Seq(cfg).eval()
    with torch.no_grad():  # give EOS a fair chance so that hypotheses finish
        model.out.bias[EOS] += 1.0
    return model


def padded_sources():
    src = torch.randint(3, SRC_V, (3, 6))
    mask = torch.arange(6)[None, :] < torch.tensor([6, 3, 1])[:, None]
    return src.masked_fill(~mask, 0), mask


@pytest.mark.parametrize("n_layers", [1, 2])
def test_greedy_equals_beam_of_width_one(n_layers):
    model = tiny_model(n_layers=n_layers)
    src, mask = padded_sources()
    greedy = model.greedy(src, mask, max_len=8)
    beams = model.beam_search(src, mask, beam_width=1, max_len=8)
    for g, [b] in zip(greedy, beams):
        assert g.tokens == b.tokens and g.finished == b.finished
        assert math.isclose(g.log_prob, b.log_prob, rel_tol=1e-5, abs_tol=1e-6)


def test_greedy_reads_the_device_once_per_step(monkeypatch):
    # one .tolist() of the step's tokens per step (not also the stop flags), and the same
    # hypotheses as before
    torch.manual_seed(0)
    model = tiny_model(n_layers=2)
    with torch.no_grad():
        model.out.bias[EOS] -= 3.0  # rows that go on for a few steps
    src, mask = padded_sources()
    want = model.greedy(src, mask, max_len=8)
    reads, steps = [], []
    model.out.register_forward_hook(lambda *a: steps.append(1))
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(1) or tolist(self))
    assert model.greedy(src, mask, max_len=8) == want
    assert len(reads) == len(steps) + 2 > 3  # + the final scores and flags


@pytest.mark.parametrize("alpha", [0.0, 0.8])
def test_beam_is_sorted_and_scores_equal_teacher_forced_log_probs(alpha):
    model = tiny_model()
    src, mask = padded_sources()
    results = model.beam_search(src, mask, beam_width=4, max_len=7, length_penalty=alpha, n_best=4)
    for row, hyps in enumerate(results):
        assert len(hyps) == 4
        scores = [h.score for h in hyps]
        assert scores == sorted(scores, reverse=True)
        assert len({tuple(h.tokens) for h in hyps}) == 4  # distinct hypotheses
        for h in hyps:
            assert h.finished == (h.tokens[-1] == EOS) and EOS not in h.tokens[:-1]
            want = model.sequence_log_prob(src[row : row + 1], mask[row : row + 1], h.tokens)
            assert math.isclose(h.log_prob, want, rel_tol=1e-5, abs_tol=1e-5)
            assert math.isclose(h.score, want / length_penalty(len(h.tokens), alpha), rel_tol=1e-5)


def test_wide_beam_equals_exhaustive_search():
    # A beam wider than the number of prefixes prunes nothing: its n-best must be the n best
    # of every sequence ending in EOS within max_len, scored by teacher forcing.
    model = tiny_model()
    src, mask = padded_sources()
    max_len, alpha = 3, 0.6
    results = model.beam_search(
        src[:1], mask[:1], beam_width=TGT_V**max_len, max_len=max_len, length_penalty=alpha,
        n_best=5,
    )[0]  # fmt: skip
    candidates = []
    for n in range(max_len):  # n tokens before EOS
        for body in itertools.product([t for t in range(TGT_V) if t != EOS], repeat=n):
            tokens = [*body, EOS]
            lp = model.sequence_log_prob(src[:1], mask[:1], tokens)
            candidates.append((lp / length_penalty(len(tokens), alpha), tokens))
    candidates.sort(reverse=True)
    assert [h.tokens for h in results] == [tokens for _, tokens in candidates[:5]]
    for h, (score, _) in zip(results, candidates):
        assert math.isclose(h.score, score, rel_tol=1e-5)


@pytest.mark.parametrize("width, gathers", [(4, 1), (8, 2)])
def test_beam_search_gathers_the_memory_only_when_beams_change(monkeypatch, width, gathers):
    # the beams of a source share its memory: beam_search gathers it once (beams 1 -> k),
    # or twice when k exceeds the TGT_V = 6 tokens (beams 1 -> 6 -> 8); gathering it at
    # every step (the slow twin) gives the same hypotheses
    from attnlab.models.rnn import Memory

    model = tiny_model(n_layers=2)
    src, mask = padded_sources()

    def reordering_everything(max_len):
        memory, hidden = model.encode(src, mask)
        start = torch.full((src.shape[0],), model.cfg.bos_id)
        logits, hidden, _ = model.step(start, hidden, memory)
        state = {"hidden": hidden, "memory": memory}

        def advance(source, tokens):
            state["memory"] = state["memory"].index(source)
            hidden = state["hidden"].index_select(1, source)
            logits, state["hidden"], _ = model.step(tokens, hidden, state["memory"])
            return logits

        return beam_search_core(logits, advance, num_beams=width, max_new_tokens=max_len,
                                eos_id=EOS, length_penalty=0.6, n_best=4, style="gnmt")  # fmt: skip

    gathered = []
    index = Memory.index
    monkeypatch.setattr(Memory, "index", lambda self, rows: gathered.append(1) or index(self, rows))
    for max_len in (5, 9):
        with torch.no_grad():
            want = reordering_everything(max_len)
        gathered.clear()
        got = model.beam_search(src, mask, beam_width=width, max_len=max_len,
                                length_penalty=0.6, n_best=4)  # fmt: skip
        assert len(gathered) == gathers  # whatever the length
        for got_row, want_row in zip(got, want):
            # (beam_search's finished hypotheses end with EOS, the core's leave it out)
            assert got_row == [w._replace(tokens=w.tokens + [EOS] * w.finished) for w in want_row]


def test_beam_search_rejects_bad_settings():
    model = tiny_model()
    src, mask = padded_sources()
    for kw, message in [
        ({"beam_width": 0}, "beam_width"),
        ({"beam_width": 2, "n_best": 3}, "n_best"),
        ({"max_len": 0}, "max_len"),
        ({"length_penalty": -1.0}, "length_penalty"),
    ]:
        with pytest.raises(ValueError, match=message):
            model.beam_search(src, mask, **kw)


def test_early_stopping_reaches_the_shared_beam_search(monkeypatch):
    """generate/beam_search take transformers' early_stopping with style='transformers' (the
    CLI's translate --early-stopping); GNMT scoring keeps its own rule and refuses it."""
    import attnlab.models.rnn as rnn

    seen = []

    def spy(*args, **kwargs):
        seen.append(kwargs["early_stopping"])
        return beam_search_core(*args, **kwargs)

    monkeypatch.setattr(rnn, "beam_search_core", spy)
    model = tiny_model()
    src, mask = padded_sources()
    for early in (True, False, "never"):
        out = model.generate(src, 5, src_mask=mask, num_beams=3, style="transformers",
                             early_stopping=early)  # fmt: skip
        assert seen[-1] is early and len(out) == src.shape[0]
    with pytest.raises(ValueError, match="early_stopping applies to style='transformers'"):
        model.generate(src, 5, src_mask=mask, num_beams=3, early_stopping=False)  # gnmt


def test_unfinished_hypotheses_fill_the_list_at_max_len():
    model = tiny_model()
    with torch.no_grad():
        model.out.bias[EOS] -= 100.0  # EOS never wins
    src, mask = padded_sources()
    hyps = model.beam_search(src[:1], mask[:1], beam_width=3, max_len=4, n_best=3)[0]
    assert all(not h.finished and len(h.tokens) == 4 for h in hyps)
    [g] = model.greedy(src[:1], mask[:1], max_len=4)
    assert not g.finished and len(g.tokens) == 4


def test_greedy_makes_its_tensors_on_the_sources_device():
    """With torch's default device elsewhere (meta), a tensor greedy decoding made without
    device= lands there and fails beside the model's: on a GPU its CPU tokens, scores and
    done flags failed so (the gru-numbers task's first evaluation, ``translate``)."""
    model = tiny_model(n_layers=2)
    src, mask = padded_sources()
    want = model.greedy(src, mask, max_len=6)
    with torch.device("meta"):
        got = model.greedy(src, mask, max_len=6)
    assert got == want


def test_source_padding_does_not_change_other_rows():
    model = tiny_model(n_layers=2)
    src, mask = padded_sources()
    tgt_in = torch.randint(0, TGT_V, (3, 5))
    batched = model(src, mask, tgt_in)
    garbage = src.masked_fill(~mask, 5)  # other ids under the padding: must not matter
    torch.testing.assert_close(model(garbage, mask, tgt_in).logits, batched.logits)
    for row in range(3):
        n = int(mask[row].sum())
        alone = model(src[row : row + 1, :n], None, tgt_in[row : row + 1])
        torch.testing.assert_close(alone.logits, batched.logits[row : row + 1])
        torch.testing.assert_close(alone.attention, batched.attention[row : row + 1, :, :n])
        assert bool((batched.attention[row, :, n:] == 0).all())
    assert [h.tokens for h in model.greedy(src, mask, max_len=6)] == [
        model.greedy(src[r : r + 1, : int(mask[r].sum())], max_len=6)[0].tokens for r in range(3)
    ]


def test_encoder_state_and_decoder_steps_are_bahdanaus_equations_written_out():
    """Bahdanau et al. (2015) written out here, with torch's GRU (its documented h_n layout,
    (layer, direction) pairs) as the encoder of each row's real tokens alone: layer l's
    initial decoder state is tanh(W_s [forward final; backward final] of layer l); at each
    step the top layer's previous state queries the source, e_j = v . tanh(W_q s + W_k h_j),
    and the context joins the embedded token at the GRU's input and its output at the
    output layer. Two layers, so that a layer or direction taken for another shows."""
    torch.manual_seed(0)
    model = tiny_model(n_layers=2)
    src, mask = padded_sources()
    tgt = torch.randint(0, TGT_V, (3, 4))
    L, H = 2, model.cfg.hidden_dim
    att = model.attention
    with torch.no_grad():
        out = model(src, mask, tgt)
        _, hidden = model.encode(src, mask)
        for row in range(3):
            n = int(mask[row].sum())
            states, h_n = model.encoder(model.src_embed(src[row : row + 1, :n]))
            h_n = h_n.view(L, 2, 1, H)  # torch's layout: (layer, direction)
            s = torch.tanh(model.init_state(torch.cat((h_n[:, 0], h_n[:, 1]), dim=-1)))
            torch.testing.assert_close(hidden[:, row : row + 1], s, atol=1e-6, rtol=1e-5)
            for i in range(tgt.shape[1]):
                scores = att.w_v(torch.tanh(att.w_q(s[-1])[:, None] + att.w_k(states)))
                weights = scores[..., 0].softmax(-1)  # (1, n)
                context = weights @ states[0]  # (1, 2H)
                x = torch.cat((model.tgt_embed(tgt[row : row + 1, i]), context), dim=-1)
                y, s = model.decoder(x[:, None], s)
                logits = model.out(torch.cat((y[:, 0], context), dim=-1))
                torch.testing.assert_close(out.logits[row, i], logits[0], atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(
                    out.attention[row, i, :n], weights[0], atol=1e-6, rtol=1e-5
                )


def test_dropout_sits_on_the_embeddings_and_the_output_layers_input():
    """In training, dropout acts on the embedded source and target tokens and on the output
    layer's input [s_t; c_t], and nowhere else (one GRU layer: none between layers). With
    the dropout module replaced by a fixed scaling, forward is Bahdanau's equations written
    out with that scaling in those three places."""

    class Halve(torch.nn.Module):  # dropout's scaling with one fixed mask: every unit kept
        def forward(self, x):
            return 0.5 * x

    torch.manual_seed(0)
    model = tiny_model(n_layers=1, dropout=0.3).train()
    model.dropout = Halve()
    src, tgt = torch.randint(3, SRC_V, (1, 5)), torch.randint(0, TGT_V, (1, 4))
    H, att = model.cfg.hidden_dim, model.attention
    with torch.no_grad():
        out = model(src, tgt=tgt)
        states, h_n = model.encoder(0.5 * model.src_embed(src))
        h_n = h_n.view(1, 2, 1, H)  # torch's layout: (layer, direction)
        s = torch.tanh(model.init_state(torch.cat((h_n[:, 0], h_n[:, 1]), dim=-1)))
        for i in range(tgt.shape[1]):
            scores = att.w_v(torch.tanh(att.w_q(s[-1])[:, None] + att.w_k(states)))
            context = scores[..., 0].softmax(-1) @ states[0]  # (1, 2H)
            x = torch.cat((0.5 * model.tgt_embed(tgt[:, i]), context), dim=-1)
            y, s = model.decoder(x[:, None], s)
            logits = model.out(0.5 * torch.cat((y[:, 0], context), dim=-1))
            torch.testing.assert_close(out.logits[0, i], logits[0], atol=1e-5, rtol=1e-5)


def test_left_padded_source_is_refused_not_encoded_as_tokens():
    """Packing reads the first ``length`` tokens of a row: under left padding it encoded the
    pads and dropped the last real tokens (logits 0.13 off the row alone), silently."""
    model = tiny_model()
    src, mask = padded_sources()
    left_src, left_mask = src.flip(1), mask.flip(1)
    with pytest.raises(ValueError, match="prefix of each row"):
        model(left_src, left_mask, torch.randint(0, TGT_V, (3, 5)))
    with pytest.raises(ValueError, match="prefix of each row"):
        model.generate(left_src, 4, src_mask=left_mask)


@pytest.mark.parametrize("dtype", [torch.long, torch.float32])
def test_source_mask_of_any_dtype_means_keep_or_drop(dtype):
    """A 0/1 ``src_mask`` that is not bool (the Transformer encoder-decoder takes one) hides
    the padding like the bool mask: a float one reached the additive attention as an
    additive mask (+1 on real keys) and the decoder attended to the padding."""
    model = tiny_model()
    src, mask = padded_sources()
    tgt_in = torch.randint(0, TGT_V, (3, 5))
    want = model(src, mask, tgt_in)
    got = model(src, mask.to(dtype), tgt_in)
    torch.testing.assert_close(got.attention, want.attention)
    torch.testing.assert_close(got.logits, want.logits)
    assert bool((got.attention[2, :, 1:] == 0).all())
    assert model.generate(src, 6, src_mask=mask.to(dtype)) == model.generate(src, 6, src_mask=mask)


def test_loss_is_cross_entropy_over_non_ignored_targets():
    model = tiny_model()
    src, mask = padded_sources()
    tgt_in = torch.randint(0, TGT_V, (3, 5))
    targets = torch.randint(0, TGT_V, (3, 5))
    targets[1, 3:] = -100
    targets[2, 1:] = -100
    out = model(src, mask, tgt_in, targets)
    log_probs = out.logits.log_softmax(-1)
    picked = [
        -log_probs[b, t, targets[b, t]] for b in range(3) for t in range(5) if targets[b, t] >= 0
    ]
    torch.testing.assert_close(out.loss, torch.stack(picked).mean())
    assert out.logits.shape == (3, 5, TGT_V) and out.attention.shape == (3, 5, 6)
    assert model(src, mask, tgt_in).loss is None


def test_output_is_a_model_output_that_unpacks_as_logits_and_loss():
    # docs/design.md: every model returns a ModelOutput, unpacking as (logits, loss)
    model = tiny_model()
    src, mask = padded_sources()
    tgt = torch.randint(0, TGT_V, (3, 5))
    out = model(src, mask, tgt, tgt)
    assert isinstance(out, ModelOutput) and out.aux_loss is None and out.metrics == {}
    logits, loss = out
    assert logits is out.logits and loss is out.loss and out.attention.shape == (3, 5, 6)


def teacher_forced_step_by_step(model, src, mask, tgt, targets):
    """The slow twin of ``forward``: ``model.step`` at every position (embedding and output
    layer included), as forward once ran."""
    memory, hidden = model.encode(src, mask)
    logits, weights = [], []
    for i in range(tgt.shape[1]):
        step_logits, hidden, step_weights = model.step(tgt[:, i], hidden, memory)
        logits.append(step_logits)
        weights.append(step_weights)
    logits = torch.stack(logits, dim=1)  # (b, t, V)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    return logits, loss, torch.stack(weights, dim=1)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_teacher_forcing_equals_stepping_one_position_at_a_time(dropout):
    # forward embeds every target and applies the output layer once; the logits, the
    # attention, the loss and every gradient equal step() run position by position, and
    # with dropout the same masks are drawn (same seed, same order)
    torch.manual_seed(0)
    model = tiny_model(n_layers=2, dropout=dropout).train()
    src, mask = padded_sources()
    tgt, targets = torch.randint(0, TGT_V, (2, 3, 5))

    def run(forward):
        torch.manual_seed(1)  # the same dropout masks, if drawn in the same order
        logits, loss, weights = forward()
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return logits, loss, weights, grads

    def fast():
        out = model(src, mask, tgt, targets)
        return out.logits, out.loss, out.attention

    results = [run(fast), run(lambda: teacher_forced_step_by_step(model, src, mask, tgt, targets))]
    (logits, loss, weights, grads), (want_logits, want_loss, want_weights, want_grads) = results
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, want_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_teacher_forcing_embeds_and_projects_all_positions_at_once():
    # structural: one embedding and one output-layer product (forward), one embedding
    # gradient (backward), whatever the target length; the recurrence alone is per step
    from torch.profiler import ProfilerActivity, profile

    model = tiny_model().train()
    src, mask = padded_sources()

    def op_counts(t):
        tgt = torch.randint(0, TGT_V, (3, t))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model(src, mask, tgt, tgt).loss.backward()
        names = [e.name for e in prof.events()]
        return {n: names.count(n) for n in ("aten::embedding", "aten::embedding_dense_backward")}

    # the source embedding and the target one
    assert op_counts(4) == op_counts(9) == {
        "aten::embedding": 2, "aten::embedding_dense_backward": 2}  # fmt: skip


def test_learns_to_reverse_short_sequences():
    # Target = the source reversed (ids shifted into the target vocabulary), then EOS: the
    # loss must drop well below its starting value in 150 steps.
    torch.manual_seed(0)
    cfg = RNNSeq2SeqConfig(src_vocab_size=8, vocab_size=8, embed_dim=16, hidden_dim=32)
    model = GRUSeq2Seq(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(150):
        src = torch.randint(3, 8, (32, 4))
        body = src.flip(1)
        tgt_in = torch.cat([torch.full((32, 1), cfg.bos_id), body], dim=1)
        targets = torch.cat([body, torch.full((32, 1), cfg.eos_id)], dim=1)
        loss = model(src, None, tgt_in, targets).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-10:]) / 10 < 0.25 * sum(losses[:10]) / 10
    model.eval()
    src = torch.randint(3, 8, (16, 4))
    got = [h.tokens for h in model.greedy(src, max_len=6)]
    right = sum(g == [*s.flip(0).tolist(), cfg.eos_id] for g, s in zip(got, src))
    assert right >= 12


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"hidden_dim": 0}, "hidden_dim"),
        ({"eos_id": 6}, "eos_id"),
        ({"dropout": 1.0}, "dropout"),
        ({"attention_dim": 0}, "attention_dim"),
    ],
)
def test_config_rejects_bad_values(kw, field):
    with pytest.raises(ConfigError, match=field):
        RNNSeq2SeqConfig(src_vocab_size=SRC_V, vocab_size=TGT_V, **kw).validate()
    with pytest.raises(ConfigError, match="hidden_dimm"):
        RNNSeq2SeqConfig.from_dict({"src_vocab_size": 3, "vocab_size": 4, "hidden_dimm": 2})


def test_generic_beam_search_with_a_fixed_distribution():
    # A step function that ignores the prefix: p(a) = 0.4, p(EOS) = 0.35, p(b) = 0.25. Width
    # 2, step 1: keep a and b, finish [EOS] (0.35). Step 2: aa 0.16, a EOS 0.14, ab 0.1 ...:
    # keep aa, finish [a, EOS], keep ab; two finished = beam width: stop.
    probs = torch.tensor([[0.4, 0.25, 0.35]]).log()
    step = lambda tokens, state: (probs.expand(len(tokens), 3), state)
    hyps = beam_search(step, None, lambda s, i: s, bos_id=0, eos_id=2, beam_width=2, n_best=2)
    assert [h.tokens for h in hyps] == [[2], [0, 2]]
    torch.testing.assert_close(
        torch.tensor([h.log_prob for h in hyps], dtype=torch.float64),
        torch.tensor([0.35, 0.14], dtype=torch.float64).log(),
    )
    # An EOS extension that ranks below the kept prefixes is not finished (the usual rule):
    # with p(EOS) = 0.2 the search runs to max_len and fills the list with unfinished ones.
    probs = torch.tensor([[0.5, 0.3, 0.2]]).log()
    hyps = beam_search(
        step, None, lambda s, i: s, bos_id=0, eos_id=2, beam_width=3, max_len=4, n_best=3
    )
    assert [(h.tokens, h.finished) for h in hyps[:2]] == [([2], True), ([0, 0, 0, 0], False)]
    assert not hyps[2].finished and sorted(hyps[2].tokens) == [0, 0, 0, 1]  # one of 4 ties
    assert math.isclose(hyps[2].log_prob, math.log(0.5**3 * 0.3), rel_tol=1e-6)  # float32 steps


def test_beam_does_not_stop_while_a_live_prefix_can_still_win():
    # Tokens a=0, b=1, EOS=2. The right answer is "aaaa" EOS (p = 0.9^4 * 0.98 = 0.64);
    # prefixes with a typo (a b) end at length 3 with EOS almost surely, one step before
    # the right answer can. Stopping at beam_width finished hypotheses returned a typo.
    def probs(prefix: tuple[int, ...]) -> list[float]:
        if 1 in prefix and len(prefix) >= 3:
            return [0.02, 0.01, 0.97]
        if 1 not in prefix and len(prefix) == 4:
            return [0.01, 0.01, 0.98]
        return [0.9, 0.08, 0.02]

    def step(tokens, prefixes):
        prefixes = [p if t == BOS else p + (t,) for p, t in zip(prefixes, tokens.tolist())]
        return torch.tensor([probs(p) for p in prefixes]).log(), prefixes

    def reorder(prefixes, rows):
        return [prefixes[r] for r in rows.tolist()]

    BOS = 3  # an input only, never an output
    for width in (2, 3, 4):
        hyps = beam_search(step, [()], reorder, bos_id=BOS, eos_id=2, beam_width=width, n_best=2)
        assert hyps[0].tokens == [0, 0, 0, 0, 2], width
        assert math.isclose(hyps[0].log_prob, math.log(0.9**4 * 0.98), rel_tol=1e-6)


@torch.no_grad()
def test_float16_loss_is_summed_in_float32():
    """A float16 model's loss: the cross-entropy runs in float32 (as every other model's),
    where float16 summed the tokens' losses past 65504 (inf for a batch of 7,680)."""
    torch.manual_seed(0)
    model = GRUSeq2Seq(RNNSeq2SeqConfig()).eval()
    tgt = torch.randint(0, 256, (64, 120))
    src = torch.randint(3, 16, (64, 4))
    with torch.no_grad():
        model.out.weight.mul_(30)
    loss = model.half()(src, None, tgt, tgt).loss
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, model.float()(src, None, tgt, tgt).loss, atol=2e-2, rtol=2e-3)
