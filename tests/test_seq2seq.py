"""Encoder–decoder models and beam search. References: torch.nn.Transformer with copied
weights (post-norm and pre-norm), a full forward pass for cached decoding, and
transformers' generate(num_beams=k) on the same weights for beam search.
Shapes: b batch, s source length, t target length, V vocabulary size."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from attnlab.config import ModelConfig  # noqa: E402
from attnlab.generation import beam_search, beam_search_core  # noqa: E402
from attnlab.models import build_model  # noqa: E402
from attnlab.models.seq2seq import Seq2SeqConfig, Seq2SeqModel  # noqa: E402

D, V = 32, 41


def _cfg(placement="post", **kw) -> Seq2SeqConfig:
    return Seq2SeqConfig(
        vocab_size=V,
        max_seq_len=64,
        d_model=D,
        n_layers=2,
        n_decoder_layers=3,
        ffn={"kind": "mlp", "activation": "relu", "hidden_dim": 48},
        norm={"placement": placement},
        **kw,
    ).override({})  # through from_dict: nested dicts become typed sections


def _copy_attention(ours, ref: nn.MultiheadAttention, cross: bool) -> None:
    w, b = ref.in_proj_weight, ref.in_proj_bias
    if cross:
        ours.q.weight.copy_(w[:D])
        ours.q.bias.copy_(b[:D])
        ours.kv.weight.copy_(w[D:])
        ours.kv.bias.copy_(b[D:])
    else:
        ours.qkv.weight.copy_(w)
        ours.qkv.bias.copy_(b)
    ours.out.load_state_dict(ref.out_proj.state_dict())


def _copy_from_torch(model: Seq2SeqModel, ref: nn.Transformer) -> None:
    with torch.no_grad():
        for blk, layer in zip(model.encoder, ref.encoder.layers):
            _copy_attention(blk.attn, layer.self_attn, cross=False)
            blk.ffn.up.load_state_dict(layer.linear1.state_dict())
            blk.ffn.down.load_state_dict(layer.linear2.state_dict())
            blk.attn_norm.load_state_dict(layer.norm1.state_dict())
            blk.ffn_norm.load_state_dict(layer.norm2.state_dict())
        for blk, layer in zip(model.decoder, ref.decoder.layers):
            _copy_attention(blk.attn, layer.self_attn, cross=False)
            _copy_attention(blk.cross_attn, layer.multihead_attn, cross=True)
            blk.ffn.up.load_state_dict(layer.linear1.state_dict())
            blk.ffn.down.load_state_dict(layer.linear2.state_dict())
            blk.attn_norm.load_state_dict(layer.norm1.state_dict())
            blk.cross_norm.load_state_dict(layer.norm2.state_dict())
            blk.ffn_norm.load_state_dict(layer.norm3.state_dict())
        model.enc_norm.load_state_dict(ref.encoder.norm.state_dict())
        model.dec_norm.load_state_dict(ref.decoder.norm.state_dict())


@pytest.mark.parametrize("placement", ["post", "pre"])
def test_matches_torch_transformer(placement):
    torch.manual_seed(0)
    ref = nn.Transformer(
        D, 4, 2, 3, 48, dropout=0.0, batch_first=True, norm_first=placement == "pre"
    ).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(0.3 * torch.randn_like(p) + (1.0 if p.dim() == 1 and p.shape[0] == D else 0))
    # nn.Transformer has a final norm after each stack, also for post-norm
    model = Seq2SeqModel(_cfg(placement, final_norm=True)).eval()
    _copy_from_torch(model, ref)
    src, tgt = torch.randint(0, V, (3, 9)), torch.randint(0, V, (3, 7))
    src_mask = torch.ones(3, 9, dtype=torch.bool)
    src_mask[1, 6:] = False
    src_mask[2, 3:] = False
    pos_s, pos_t = torch.arange(9)[None], torch.arange(7)[None]
    with torch.no_grad():
        src_x = model._embed(src, model.src_emb, None, pos_s)  # the same embedded inputs
        tgt_x = model._embed(tgt, model.tgt_emb, None, pos_t)
        expected = ref(
            src_x,
            tgt_x,
            tgt_mask=nn.Transformer.generate_square_subsequent_mask(7),
            src_key_padding_mask=~src_mask,
            memory_key_padding_mask=~src_mask,
        )
        memory = model.encode(src, src_mask)
        out = model.decode(tgt, memory, src_mask)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["sinusoidal", "learned"])
def test_stacks_receive_scaled_tokens_plus_their_positions(kind):
    """What each stack reads (the torch.nn.Transformer test feeds both the same embedded
    inputs): sqrt(d) E[ids] plus, for sinusoids, Vaswani et al.'s PE(p, 2i) = sin(p /
    10000^(2i/d)), PE(p, 2i+1) = cos(...) written out; for learned positions, the source's
    table under the source and the target's under the target."""
    torch.manual_seed(0)
    model = Seq2SeqModel(_cfg("pre", position={"kind": kind}, share_embeddings=False)).eval()
    seen = {}
    for name in ("encoder", "decoder"):
        getattr(model, name).register_forward_pre_hook(
            lambda m, args, name=name: seen.__setitem__(name, args[0])
        )
    src, tgt = torch.randint(0, V, (2, 9)), torch.randint(0, V, (2, 6))
    with torch.no_grad():
        model(src, tgt)
    for name, ids, emb, pos in (("encoder", src, model.src_emb, model.src_pos),
                                ("decoder", tgt, model.tgt_emb, model.tgt_pos)):  # fmt: skip
        p = torch.arange(ids.shape[1], dtype=torch.float64)[:, None]  # (t, 1)
        if kind == "learned":
            table = pos.weight[: ids.shape[1]]
        else:
            angle = p / 10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)  # (t, d/2)
            table = torch.stack((angle.sin(), angle.cos()), dim=-1).flatten(1).float()
        want = emb.weight[ids] * D**0.5 + table
        torch.testing.assert_close(seen[name], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_cached_decoding_equals_full_pass_and_cross_kv_once(qk_norm):
    torch.manual_seed(0)
    model = Seq2SeqModel(_cfg("pre", attention={"qk_norm": qk_norm})).eval()
    src, tgt = torch.randint(0, V, (2, 8)), torch.randint(0, V, (2, 6))
    src_mask = torch.tensor([[1] * 8, [1] * 5 + [0] * 3])
    with torch.no_grad():
        memory = model.encode(src, src_mask)
        full = model.logits(model.decode(tgt, memory, src_mask))
        cache = model.new_cache(2, 16)
        calls = []
        for blk in model.decoder:
            blk.cross_attn.kv.register_forward_hook(lambda *a: calls.append(1))
        steps = [model.logits(model.decode(tgt[:, :2], memory, src_mask, cache=cache))]
        for i in range(2, 6):
            steps.append(model.logits(model.decode(tgt[:, i : i + 1], None, src_mask, cache=cache)))
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
    assert len(calls) == model.cfg.decoder_layers  # cross keys/values projected once


def test_loss_label_smoothing_and_shared_embeddings():
    torch.manual_seed(0)
    model = build_model(_cfg(label_smoothing=0.1))
    assert isinstance(model, Seq2SeqModel)
    assert model.src_emb is model.tgt_emb and model.lm_head.weight is model.tgt_emb.weight
    src, tgt = torch.randint(0, V, (2, 5)), torch.randint(0, V, (2, 4))
    targets = torch.randint(0, V, (2, 4))
    targets[0, 3] = -100
    out = model(src, tgt, targets=targets)
    expected = F.cross_entropy(
        out.logits.flatten(0, 1), targets.flatten(), ignore_index=-100, label_smoothing=0.1
    )
    torch.testing.assert_close(out.loss, expected)
    cfg = ModelConfig.from_dict(_cfg(share_embeddings=False, src_vocab_size=50).to_dict())
    assert isinstance(cfg, Seq2SeqConfig)
    model = Seq2SeqModel(cfg)
    assert model.src_emb.weight.shape[0] == 50 and model.tgt_emb is not model.src_emb


def test_greedy_with_and_without_cache_agree():
    torch.manual_seed(0)
    model = Seq2SeqModel(_cfg("pre", eos_id=3)).eval()
    src = torch.randint(4, V, (3, 6))
    a = model.generate(src, 10)
    b = model.generate(src, 10, use_cache=False)
    assert a == b and all(len(r) <= 10 for r in a)
    # greedy equals an argmax loop over full passes
    for i in range(3):
        seq = [model.cfg.bos_id]
        for _ in range(10):
            nxt = int(model(src[i : i + 1], torch.tensor([seq])).logits[0, -1].argmax())
            if nxt == 3:
                break
            seq.append(nxt)
        assert a[i] == seq[1:]


def test_greedy_reads_the_device_once_per_step(monkeypatch):
    # one .tolist() of the step's tokens per step (not also the stop flags)
    torch.manual_seed(0)
    model = Seq2SeqModel(_cfg("pre", eos_id=3)).eval()
    src = torch.randint(4, V, (3, 6))
    want = model.generate(src, 9)
    reads, steps = [], []
    model.lm_head.register_forward_hook(lambda *a: steps.append(1))
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(1) or tolist(self))
    assert model.generate(src, 9) == want
    assert len(reads) == len(steps) > 1


def _beam_reordering_everything(model, src, src_mask, n, k):
    """The slow twin of Seq2SeqModel.generate's beam search: the cache (cross keys/values
    too) and the source mask gathered by ``source`` at every step."""
    cache = model.new_cache(src.shape[0], n + 1)
    state = {"mask": src_mask}

    def advance(source, tokens):
        cache.reorder(source)
        state["mask"] = state["mask"].index_select(0, source)
        return model.logits(model.decode(tokens[:, None], None, state["mask"], cache=cache))[:, -1]

    start = torch.full((src.shape[0], 1), model.cfg.bos_id)
    first = model.logits(model.decode(start, model.encode(src, src_mask), src_mask, cache=cache))
    hyps = beam_search_core(first[:, -1], advance, num_beams=k, max_new_tokens=n,
                            eos_id=model.cfg.eos_id, n_best=k)  # fmt: skip
    return [[h.tokens for h in row] for row in hyps]


def test_beam_search_gathers_cross_keys_and_source_mask_only_when_beams_change(monkeypatch):
    # the beams of a source share its cross keys/values and mask: generate gathers them
    # once (beams 1 -> k), the reordering twin at every step, to the same hypotheses
    from attnlab.cache import CrossKV

    torch.manual_seed(0)
    model = Seq2SeqModel(_cfg("pre", eos_id=3)).eval()
    src = torch.randint(4, V, (3, 7))
    src_mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3, [1] * 2 + [0] * 5])
    gathered = []
    reorder = CrossKV.reorder
    monkeypatch.setattr(
        CrossKV, "reorder", lambda self, *a: gathered.append(1) or reorder(self, *a)
    )
    for n in (6, 12):
        gathered.clear()
        got = model.generate(src, n, src_mask=src_mask, num_beams=3, n_best=3)
        assert len(gathered) == model.cfg.decoder_layers  # once per layer, whatever n
        with torch.inference_mode():
            assert got == _beam_reordering_everything(model, src, src_mask, n, 3)


def test_beam_search_regathers_cross_keys_while_beams_grow_on_a_small_vocabulary(monkeypatch):
    # 7 beams over 5 tokens: 1 -> 5 beams at the first step, 5 -> 7 at the second, so the
    # cross keys/values and mask are gathered twice, and match the reordering twin
    from attnlab.cache import CrossKV

    torch.manual_seed(0)
    model = Seq2SeqModel(_cfg("pre", eos_id=3).override({"vocab_size": 5})).eval()
    src = torch.randint(0, 5, (3, 7))
    src_mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3, [1] * 2 + [0] * 5])
    gathered = []
    reorder = CrossKV.reorder
    monkeypatch.setattr(
        CrossKV, "reorder", lambda self, *a: gathered.append(1) or reorder(self, *a)
    )
    got = model.generate(src, 8, src_mask=src_mask, num_beams=7, n_best=7)
    assert len(gathered) == 2 * model.cfg.decoder_layers
    with torch.inference_mode():
        assert got == _beam_reordering_everything(model, src, src_mask, 8, 7)


def test_cache_keeps_cross_entries_only_for_the_same_batch():
    model = Seq2SeqModel(_cfg("pre")).eval()
    cache = model.new_cache(2, 4)
    with pytest.raises(ValueError, match="cross=False"):
        cache.reorder(torch.tensor([0, 0, 1, 1]), cross=False)


def _oracle_beam(logprob_fn, k, n, eos, lp):
    """Exhaustive-by-level reference of the same rules, on plain Python lists."""
    running, finished = [(0.0, [])], []
    for step in range(n):
        cands = []
        for score, seq in running:
            lps = logprob_fn(seq)
            cands += [(score + lps[t], seq + [t]) for t in range(len(lps))]
        cands.sort(key=lambda c: -c[0])
        cands = cands[: 2 * k]
        if len(finished) < k:
            for score, seq in cands[:k]:
                if seq[-1] == eos or step == n - 1:
                    finished.append((score / (step + 1) ** lp, seq[:-1] if seq[-1] == eos else seq))
            finished = sorted(finished, key=lambda h: -h[0])[:k]
        if step == n - 1 or len(finished) >= k:
            break
        running = [c for c in cands if c[1][-1] != eos][:k]
    return finished


def test_beam_search_core_matches_oracle():
    g = torch.Generator().manual_seed(0)
    table = torch.randn(50, 8, generator=g) * 2  # logits depend on (length, last token)

    def logits_of(seq):
        return table[(len(seq) * 7 + (seq[-1] if seq else 0)) % 50]

    for k, lp in ((2, 1.0), (3, 0.5), (4, 2.0)):
        expected = _oracle_beam(lambda s: torch.log_softmax(logits_of(s), -1).tolist(), k, 6, 0, lp)
        state = {"seqs": [[]]}

        def advance(source, tokens, state=state):
            state["seqs"] = [
                state["seqs"][i] + [t] for i, t in zip(source.tolist(), tokens.tolist())
            ]
            return torch.stack([logits_of(s) for s in state["seqs"]])

        got = beam_search_core(
            logits_of([])[None],
            advance,
            num_beams=k,
            max_new_tokens=6,
            eos_id=0,
            length_penalty=lp,
            n_best=k,
        )[0]
        assert [h.tokens for h in got] == [h[1] for h in expected]
        assert [round(h.score, 4) for h in got] == [round(h[0], 4) for h in expected]


def test_beam_search_refuses_beams_that_can_never_be_filled():
    """Beam search keeps distinct continuations: n new tokens over a vocabulary of V have
    V ** n of them (V for one token), so more beams than that is a ValueError naming the
    limit (a huge num_beams ran out of memory, late); up to it every beam fills, and that
    many is an exhaustive search: the best of all V ** n sequences, found here by brute
    force (no EOS: every sequence runs to n)."""
    import itertools

    table = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))  # next: table[last]

    def search(k, n):
        return beam_search_core(table[:1], lambda source, tokens: table[tokens], num_beams=k,
                                max_new_tokens=n, eos_id=None)[0]  # fmt: skip

    for k, n, limit in ((5, 1, 4), (17, 2, 16), (10**9, 3, 64)):
        said = f"num_beams={k} exceeds the {limit} distinct continuations of max_new_tokens={n}"
        with pytest.raises(ValueError, match=f"{said} tokens over a vocabulary of 4"):
            search(k, n)
    logp = torch.log_softmax(table, -1).tolist()
    for n in (1, 2, 3):
        scores = {seq: sum(logp[a][b] for a, b in zip((0, *seq), seq))
                  for seq in itertools.product(range(4), repeat=n)}  # fmt: skip
        (best,) = search(4**n, n)
        assert tuple(best.tokens) == max(scores, key=scores.get)
        assert best.log_prob == pytest.approx(max(scores.values()), abs=1e-5)
    # the models' searches: V + 1 beams for one new token are refused, V search
    torch.manual_seed(0)
    lm = build_model(ModelConfig(vocab_size=V, d_model=16, n_layers=1, max_seq_len=8)).eval()
    seq2seq = Seq2SeqModel(_cfg("pre")).eval()
    src = torch.randint(4, V, (1, 5))
    for call in (lambda k: beam_search(lm, [1, 2], 1, num_beams=k)[0][0].tokens,
                 lambda k: lm.generate([1, 2], 1, num_beams=k),
                 lambda k: seq2seq.generate(src, 1, num_beams=k)[0]):  # fmt: skip
        with pytest.raises(ValueError, match=f"num_beams={V + 1} exceeds the {V} distinct"):
            call(V + 1)
        assert len(call(V)) <= 1


@pytest.mark.parametrize("style", ["transformers", "gnmt"])
def test_beam_search_core_host_work_is_linear_in_length(style, monkeypatch):
    """Each step reads a bounded number of values on the host (scores, flags, the tokens of
    the hypotheses that finish), not every candidate's tokens so far: a search of 4n steps
    reads about 4x the values of one of n steps (reading them all read 16x)."""
    table = torch.randn(16, 16, generator=torch.Generator().manual_seed(0))
    read = []
    tolist = torch.Tensor.tolist

    def counted(self):
        read.append(self.numel())
        return tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counted)

    def values_read(n):
        read.clear()
        hyps = beam_search_core(
            table[:1], lambda source, tokens: table[tokens], num_beams=4, max_new_tokens=n,
            eos_id=None, n_best=2, style=style,
        )  # fmt: skip
        assert [len(h.tokens) for h in hyps[0]] == [n, n]  # no EOS: every beam runs to n
        return sum(read)

    assert values_read(400) < 6 * values_read(100)


transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("k,lp", [(3, 1.0), (4, 0.6), (2, 2.0)])
def test_decoder_beam_search_matches_transformers(k, lp, tmp_path):
    from attnlab.interop import load_hf

    torch.manual_seed(0)
    eos = 5
    cfg = transformers.LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=0,
        attn_implementation="eager",
    )
    ref = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "norm" not in name:
                p.copy_(0.6 * torch.randn_like(p))
    # make EOS likely enough that some beams finish early
    with torch.no_grad():
        ref.lm_head.weight[eos] *= 1.5
    ref.save_pretrained(tmp_path)
    model = load_hf(tmp_path)
    prompts = [[7, 3, 9, 12], [1, 30, 2, 8]]
    ours = beam_search(model, prompts, 12, num_beams=k, length_penalty=lp, eos_id=eos, n_best=k)
    out = ref.generate(
        torch.tensor(prompts),
        attention_mask=torch.ones(2, 4, dtype=torch.long),
        max_new_tokens=12,
        num_beams=k,
        num_return_sequences=k,
        length_penalty=lp,
        early_stopping=True,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=eos,
        output_scores=True,
        return_dict_in_generate=True,
    )
    got = [h.tokens for row in ours for h in row]
    for i, seq in enumerate(out.sequences[:, 4:].tolist()):
        mine = got[i]
        assert seq[: len(mine)] == mine
        rest = seq[len(mine) :]
        assert rest == [] or rest[0] == eos  # then padding
    scores = [h.score for row in ours for h in row]
    torch.testing.assert_close(torch.tensor(scores), out.sequences_scores, atol=1e-4, rtol=1e-4)


def test_training_forward_compiles_without_graph_breaks_at_any_length():
    """Batches of another length make dynamo retrace with dynamic shapes (the trainer's
    torch.compile): the decoder's causal self-attention then compares symbolic lengths
    (is_causal must stay a bool for SDPA), and the length check reads no tensor."""
    torch.manual_seed(0)
    model = Seq2SeqModel(_cfg("pre", position={"kind": "learned"}))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend="eager")
    for s, t in ((7, 5), (9, 6)):
        src, tgt = torch.randint(4, V, (2, s)), torch.randint(4, V, (2, t))
        src_mask = torch.ones(2, s, dtype=torch.long)
        src_mask[1, -2:] = 0
        out = compiled(src, tgt, src_mask=src_mask, targets=tgt)
        ref = model(src, tgt, src_mask=src_mask, targets=tgt)
        torch.testing.assert_close(out.loss, ref.loss)
