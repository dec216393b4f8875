"""Generation: greedy against an argmax loop, cache against no cache, seeded sampling,
top-k / top-p, stop tokens, streaming, left-padded batches, and context cropping.

Shapes: b batch, T tokens so far, V vocabulary size.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import pytest
import torch
from oracle import greedy_no_cache
from torch import Tensor

from attnlab.functional.softmax import softmax_dtype
from attnlab.generation import (
    Hypothesis,
    block_tokens,
    check_beam_search,
    force_tokens,
    sample_next,
    stop_ids,
)
from attnlab.generation import length_penalty as divisor
from attnlab.models import DecoderLM, build_model
from attnlab.presets import get_preset


def model_for(name: str, **overrides) -> DecoderLM:
    # A larger init than training uses, so that argmax decisions are far from ties.
    cfg = get_preset(name).override({"init_std": 0.2, **overrides})
    return build_model(cfg).eval()


@pytest.fixture(scope="module", params=["gpt2-tiny", "llama-tiny"])
def model(request):
    torch.manual_seed(1)
    return model_for(request.param)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_greedy_equals_argmax_loop(model):
    prompt = _prompt(7, 0)
    expected = greedy_no_cache(model, prompt, 12)
    assert model.generate(prompt, 12) == expected
    assert model.generate(prompt, 12, use_cache=False) == expected
    assert model.generate(torch.tensor(prompt), 12) == expected  # 1-D tensor prompt


def test_top_k_1_and_tiny_top_p_equal_greedy(model):
    prompt = _prompt(5, 1)
    greedy = model.generate(prompt, 10)
    assert model.generate(prompt, 10, temperature=1.0, top_k=1, seed=3) == greedy
    assert model.generate(prompt, 10, temperature=1.0, top_p=1e-6, seed=3) == greedy


def test_seeded_sampling_is_reproducible():
    torch.manual_seed(2)
    m = model_for("gpt2-tiny", init_std=0.02)  # near-uniform next-token distributions
    prompt = _prompt(4, 2)
    a = m.generate(prompt, 20, temperature=2.0, seed=123)
    b = m.generate(prompt, 20, temperature=2.0, seed=123)
    c = m.generate(prompt, 20, temperature=2.0, seed=124)
    assert a == b
    assert a != c
    g = torch.Generator().manual_seed(123)
    assert m.generate(prompt, 20, temperature=2.0, generator=g) == a
    # Sampling with a cache draws the same tokens as without one.
    assert m.generate(prompt, 20, temperature=2.0, seed=123, use_cache=False) == a


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"temperature": -0.5}, "temperature must be finite and >= 0"),
        ({"temperature": float("nan")}, "temperature must be finite and >= 0"),
        # logits / inf are all 0: top-k kept the lowest ids, not the likeliest
        ({"temperature": float("inf")}, "temperature must be finite and >= 0"),
        ({"temperature": 1.0, "top_k": 0}, "top_k must be >= 1"),
        ({"temperature": 1.0, "top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"temperature": 1.0, "top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"max_new_tokens": -1}, "max_new_tokens must be an integer >= 0"),
        # the generator drew alone: the seed was silently ignored
        ({"temperature": 1.0, "seed": 1, "generator": torch.Generator()}, "not both"),
    ],
)
def test_sampling_argument_errors(kwargs, match):
    m = model_for("gpt2-tiny")
    kwargs = {"max_new_tokens": 3, **kwargs}
    with pytest.raises(ValueError, match=match):
        m.generate([1, 2], **kwargs)
    with pytest.raises(ValueError, match=match):
        m.stream([1, 2], **kwargs)  # raised at the call, not at the first next()


def test_non_finite_logits_are_one_clear_error():
    """Weights that give NaN logits (corrupt, or overflowing float16): sampling raised
    torch.multinomial's RuntimeError and beam search an IndexError (no beam was kept)."""
    from attnlab.generation import NonFiniteLogitsError

    m = model_for("gpt2-tiny")
    with torch.no_grad():
        m.lm_head.weight.fill_(float("nan"))
    with pytest.raises(NonFiniteLogitsError, match="not finite"):
        m.generate([1, 2], 3, temperature=1.0, seed=0)
    with pytest.raises(NonFiniteLogitsError, match="not finite"):
        m.generate([[1, 2], [3]], 3, num_beams=2)
    # Greedy decoding took argmax of NaN (token 0, or wherever NaN was) and returned it.
    for kw in ({}, {"stop_tokens": [5]}, {"use_cache": False}):
        with pytest.raises(NonFiniteLogitsError, match="not finite"):
            m.generate([[1, 2], [3]], 3, **kw)
    with pytest.raises(NonFiniteLogitsError, match="not finite"):
        next(iter(m.stream([1, 2], 3)))  # before the first token


def test_greedy_decoding_refuses_logits_that_turn_non_finite_later(monkeypatch):
    """Logits finite at the prompt and infinite at the third step (a float16 overflow):
    generate raises before it returns anything; stream after the tokens before it."""
    import attnlab.generation as generation
    from attnlab.generation import NonFiniteLogitsError

    m = model_for("gpt2-tiny")
    first_two = m.generate([1, 2], 2, use_cache=False)
    forward = generation._forward_last
    calls = []

    def overflowing(model, ids, mask, cache):
        logits = forward(model, ids, mask, cache)
        calls.append(1)
        return logits + float("inf") if len(calls) == 3 else logits

    monkeypatch.setattr(generation, "_forward_last", overflowing)
    with pytest.raises(NonFiniteLogitsError):
        m.generate([1, 2], 5, use_cache=False)
    calls.clear()
    steps = iter(m.stream([1, 2], 5, use_cache=False))
    assert [next(steps), next(steps)] == first_two
    with pytest.raises(NonFiniteLogitsError):
        next(steps)
    calls.clear()
    with pytest.raises(NonFiniteLogitsError):
        list(m.stream([1, 2], 5, use_cache=False))


def test_prompt_errors():
    m = model_for("gpt2-tiny")
    with pytest.raises(ValueError, match="at least one token"):
        m.generate([[1, 2], []], 2)
    for kw in ({}, {"num_beams": 2}):
        with pytest.raises(ValueError, match="no prompt: give at least one token id"):
            m.generate([], 2, **kw)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 256\)"):
        m.generate([1, 256], 2)


def test_numpy_prompts_are_token_ids(model):
    """A numpy array, or a list of numpy integers (a tokenizer's ``encode_array``), is a
    prompt like the list of ints: both were refused as "must be a list of token ids"."""
    prompt = _prompt(5, 4)
    want = model.generate(prompt, 6)
    assert model.generate(np.array(prompt), 6) == want
    assert model.generate([np.int64(t) for t in prompt], 6) == want
    assert model.generate(np.array([prompt]), 6) == [want]
    assert model.generate([np.array(prompt), prompt[:2]], 6)[0] == want
    beams = model.generate(prompt, 6, num_beams=2)
    assert model.generate(np.array(prompt), 6, num_beams=2) == beams


def test_beam_search_takes_stream_options_only_at_their_defaults(model):
    """generate(num_beams>1) honours stop tokens, pad id and the cache, and takes every
    other option of stream only at its default: seed=0 and top_k=0 passed (equal to 0.0)
    and were ignored, while overflow="slide" (the default) was refused; a misspelt name is
    Python's TypeError, as without beams."""
    prompt = _prompt(5, 4)
    beams = model.generate(prompt, 5, num_beams=2)
    for given in ({"overflow": "slide"}, {"temperature": 0}, {"compile": False},
                  {"compile": "auto"}, {"seed": None}, {"pad_id": 3}):  # fmt: skip
        assert model.generate(prompt, 5, num_beams=2, **given) == beams, given
    for name, value in (("seed", 0), ("top_k", 0), ("top_p", 1.0), ("temperature", 0.7),
                        ("overflow", "stop"), ("compile", True)):  # fmt: skip
        with pytest.raises(ValueError, match=f"deterministic and cached; drop {name}$"):
            model.generate(prompt, 5, num_beams=2, **{name: value})
    with pytest.raises(TypeError, match="unexpected keyword argument 'temprature'"):
        model.generate(prompt, 5, num_beams=2, temprature=0.7)
    with pytest.raises(TypeError, match="unexpected keyword argument 'temprature'"):
        model.generate(prompt, 5, temprature=0.7)


def test_top_k_must_be_an_integer():
    """top_k=3.0 is refused at the call, naming top_k (it reached torch.topk at the first
    token: a TypeError after stream() had returned)."""
    m = model_for("gpt2-tiny")
    for call in (m.generate, m.stream):
        with pytest.raises(ValueError, match="top_k must be an integer >= 1, got 3.0"):
            call([1, 2], 3, temperature=1.0, top_k=3.0)


def test_float_token_ids_and_bad_num_beams_are_refused():
    """A float token id was truncated ([[1, 2.7]] decoded as [[1, 2]], a float tensor's ids
    too) and num_beams=0 or -1 decoded greedily (2.5 failed inside torch.topk)."""
    m = model_for("gpt2-tiny")
    for prompt in ([[1, 2.7]], torch.tensor([1.0, 2.0])):
        for call in (m.stream, m.generate, lambda p, n: m.generate(p, n, num_beams=2)):
            with pytest.raises(ValueError, match="prompt token ids must be integers, got "):
                call(prompt, 3)
    for k in (0, -1, 2.5):
        with pytest.raises(ValueError, match="num_beams .beam_width. must be an integer >= 1"):
            m.generate([1, 2], 3, num_beams=k)


@pytest.mark.parametrize("alpha", [float("nan"), float("inf")])
def test_beam_search_rejects_a_length_penalty_that_ranks_nothing(alpha):
    m = model_for("gpt2-tiny")
    with pytest.raises(ValueError, match="length_penalty must be a finite number"):
        m.generate([1, 2], 3, num_beams=2, length_penalty=alpha)


def _nucleus(probs: torch.Tensor, p: float) -> set[int]:
    """Smallest set of most likely tokens whose total probability reaches p."""
    chosen, total = set(), 0.0
    for i in probs.argsort(descending=True).tolist():
        chosen.add(i)
        total += float(probs[i])
        if total >= p:
            break
    return chosen


def test_sample_next_respects_top_k_and_top_p():
    logits = torch.randn(1, 20) * 2
    g = torch.Generator().manual_seed(0)
    topk = set(logits[0].topk(4).indices.tolist())
    seen = {int(sample_next(logits, temperature=1.0, top_k=4, generator=g)) for _ in range(300)}
    assert seen == topk
    for p in (0.3, 0.7, 0.95):
        allowed = _nucleus(logits[0].softmax(-1), p)
        seen = {int(sample_next(logits, temperature=1.0, top_p=p, generator=g)) for _ in range(400)}
        assert seen <= allowed
        assert len(seen) >= min(len(allowed), 2)
    assert int(sample_next(logits)) == int(logits.argmax())  # temperature 0 is greedy


def test_top_p_keeps_the_tokens_whose_mass_reaches_top_p_exactly():
    """Uniform logits over 8 tokens (each exactly 1/8, so the running sums are exact): the
    smallest set reaching top_p = 1/2 is 4 tokens, as transformers' TopPLogitsWarper keeps;
    a strict comparison (mass before a token > top_p) would keep a fifth."""
    lp = pytest.importorskip("transformers.generation.logits_process")
    logits = torch.zeros(1, 8)
    g = torch.Generator().manual_seed(0)
    for top_p in (0.5, 0.25, 0.125, 0.75):
        n = int(lp.TopPLogitsWarper(top_p)(None, logits).isfinite().sum())
        assert n == round(top_p * 8)
        seen = {
            int(sample_next(logits, temperature=1.0, top_p=top_p, generator=g)) for _ in range(200)
        }
        assert len(seen) == n


def test_top_p_ties_at_the_boundary_go_to_the_lowest_index():
    """Tokens tied at the nucleus boundary: as many kept as transformers' TopPLogitsWarper
    keeps, the lowest indices among the tied ones (as top-k's ties), also in a row long
    enough that torch's unstable sort orders its ties arbitrarily."""
    lp = pytest.importorskip("transformers.generation.logits_process")
    captured = []

    def probs_of(logits, top_p):
        original = torch.multinomial

        def record(probs, n, generator=None):
            captured.append(probs)
            return original(probs, n, generator=generator)

        torch.multinomial = record
        try:
            sample_next(logits, temperature=1.0, top_p=top_p)
        finally:
            torch.multinomial = original
        return captured.pop()

    kept = probs_of(torch.tensor([[1.0, 1.0, 0.0]]), 0.3)[0] > 0
    assert kept.tolist() == [True, False, False]
    logits = torch.randint(0, 20, (2, 50_000), generator=torch.Generator().manual_seed(0)).float()
    kept = probs_of(logits, 0.5) > 0
    reference = lp.TopPLogitsWarper(0.5)(None, logits).isfinite()
    assert torch.equal(kept.sum(-1), reference.sum(-1))
    for row, keep in zip(logits, kept):
        boundary = row[keep].min()
        assert (row[keep] > boundary).sum() == (row > boundary).sum()  # all above it kept
        tied = (row == boundary).nonzero().flatten()
        n = int((keep & (row == boundary)).sum())
        assert keep[tied[:n]].all()  # the lowest-index ties


def test_stop_tokens_stop_each_row(model):
    prompts = [_prompt(6, 3), _prompt(3, 4)]
    free = model.generate(prompts, 10)
    row = free[0]
    # A stop token that row 0 emits after a few tokens (not earlier).
    stop = next(tok for i, tok in enumerate(row) if i >= 2 and tok not in row[:i])
    stopped = model.generate(prompts, 10, stop_tokens=[stop])
    for got, full in zip(stopped, free):
        expected = full[: full.index(stop)] if stop in full else full
        assert got == expected
    assert stop not in stopped[0]
    assert model.generate(prompts[0], 10, stop_tokens=[stop]) == stopped[0]


def test_stream_yields_what_generate_returns(model):
    prompt = _prompt(5, 5)
    assert list(model.stream(prompt, 8)) == model.generate(prompt, 8)
    prompts = [_prompt(5, 5), _prompt(2, 6)]
    steps = list(model.stream(prompts, 8))
    assert all(isinstance(s, list) and len(s) == 2 for s in steps)
    rows = [[s[i] for s in steps if s[i] is not None] for i in range(2)]
    assert rows == model.generate(prompts, 8)


@pytest.mark.parametrize("compile", [False, True])
def test_generate_reads_the_tokens_from_the_device_once(model, monkeypatch, compile):
    """Without stop tokens generate() never needs a token on the host before the end, so
    it reads them all at once (a GPU then runs step after step without waiting): as many
    reads for 40 new tokens as for 4, and the tokens stream() yields one by one."""
    torch._dynamo.reset()  # (each model compiles its own step: stay under dynamo's limit)
    one, batch = _prompt(5, 5), [_prompt(5, 5), _prompt(2, 6)]
    want_one = list(model.stream(one, 40, compile=compile))
    want_batch = [list(row) for row in zip(*model.stream(batch, 40, compile=compile))]
    reads = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(1) or real(t))

    def generate(prompts, n):
        reads.clear()
        return model.generate(prompts, n, compile=compile), len(reads)

    for prompts, want in ((one, want_one), (batch, want_batch)):
        (short, few), (long, many) = generate(prompts, 4), generate(prompts, 40)
        assert few == many
        assert long == want
        assert short == (want[:4] if prompts is one else [row[:4] for row in want])


@pytest.mark.parametrize("use_cache", [True, False])
def test_batched_left_padded_prompts_equal_each_prompt_alone(model, use_cache):
    prompts = [_prompt(n, 10 + n) for n in (3, 9, 6, 1)]
    batch = model.generate(prompts, 8, use_cache=use_cache)
    for prompt, got in zip(prompts, batch):
        assert got == greedy_no_cache(model, prompt, 8)


def test_pad_id_is_a_token_id_of_the_vocabulary():
    """The pad id left-pads a batch and is masked out, so any id of the vocabulary gives
    the same tokens; one outside it failed inside the embedding (IndexError), None (a
    tokenizer's pad_token_id when it has none) inside torch.full (TypeError), and 2.5 was
    truncated to 2."""
    m = model_for("gpt2-tiny")
    prompts = [[1, 2, 3], [4]]
    for kw in ({}, {"num_beams": 2}, {"stop_tokens": [5]}):
        assert m.generate(prompts, 3, pad_id=255, **kw) == m.generate(prompts, 3, **kw)
        for bad in (-1, 256, None, 2.5):
            with pytest.raises(ValueError, match=r"pad_id must be a token id in \[0, 256\)"):
                m.generate(prompts, 3, pad_id=bad, **kw)
    with pytest.raises(ValueError, match="pad_id must be a token id"):
        m.stream(prompts, 3, pad_id=None)  # at the call, not at the first next()


def test_max_new_tokens_zero():
    m = model_for("gpt2-tiny")
    assert m.generate([1, 2, 3], 0) == []
    assert m.generate([[1, 2], [3]], 0) == [[], []]


# --------------------------------------------------------------------------- long contexts


def _greedy_cropped(model: DecoderLM, prompt: list[int], n_new: int) -> list[int]:
    """The argmax loop re-run from scratch every step on the context generation promises:
    the last max_seq_len tokens of the prompt, then, each time the context is full, only
    its last max_seq_len - max_seq_len // 2 tokens."""
    limit = model.cfg.max_seq_len
    ids, out = list(prompt), []
    start = max(0, len(ids) - limit)  # a batch slides each row's context on its own
    with torch.no_grad():
        for _ in range(n_new):
            nxt = int(model(torch.tensor([ids[start:]])).logits[0, -1].argmax())
            out.append(nxt)
            ids.append(nxt)
            if len(ids) - start > limit:
                start = len(ids) - (limit - limit // 2)
    return out


def test_generation_beyond_max_seq_len_costs_o1_tokens_per_step():
    """Past max_seq_len the context slides by half: 20 new tokens with max_seq_len 16 feed
    far fewer tokens than re-encoding 16 tokens for every step (224)."""
    m = model_for("llama-tiny", max_seq_len=16)
    fed = []
    hook = m.tok_emb.register_forward_hook(lambda mod, args, out: fed.append(args[0].numel()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m.generate(_prompt(10, 3), 20)
    hook.remove()
    # prefill 10, then 19 steps of one token, plus one re-encoding of 8 tokens per 8 steps
    assert sum(fed) <= 10 + 19 + 8 * 3
    assert sum(fed) < 224 / 3


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_long_prompt_is_cropped_with_warning(name):
    m = model_for(name, max_seq_len=16)
    prompt = _prompt(21, 7)
    with pytest.warns(UserWarning) as record:
        got = m.generate(prompt, 4)
    messages = [str(w.message) for w in record]
    assert any("prompt longer than max_seq_len=16: keeping its last 16" in t for t in messages)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert got == m.generate(prompt[-16:], 4)
    assert got == _greedy_cropped(m, prompt, 4)


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_generation_beyond_max_seq_len_cache_equals_no_cache(name):
    m = model_for(name, max_seq_len=16)
    prompts = [_prompt(6, 8), _prompt(11, 9)]
    with pytest.warns(UserWarning, match="exceeds max_seq_len=16"):
        cached = m.generate(prompts, 25)
    with pytest.warns(UserWarning, match="exceeds max_seq_len=16"):
        uncached = m.generate(prompts, 25, use_cache=False)
    assert cached == uncached
    assert all(len(r) == 25 for r in cached)
    assert cached[0] == _greedy_cropped(m, prompts[0], 25)
    # A single prompt too, and through the stream interface.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        single = list(m.stream(prompts[1], 25))
    assert single == cached[1] == _greedy_cropped(m, prompts[1], 25)


@torch.no_grad()
def test_beam_search_with_several_stop_tokens_equals_transformers(tmp_path):
    """With three stop tokens among the best candidates, k beams must still live on: a
    LLaMA with its layers zeroed is an exact bigram table, whose beam search transformers
    runs the same way (n-best tokens and scores)."""
    import math

    transformers = pytest.importorskip("transformers")
    from attnlab.generation import beam_search
    from attnlab.interop import load_hf

    V, D, EOS, S, A, B = 40, 48, [5, 6, 7], 10, 11, 12
    table = torch.randn(V, V, generator=torch.Generator().manual_seed(0))  # logits[last, next]
    p = torch.full((V,), 0.01 / (V - 5))
    p[[5, A, 6, 7, B]] = torch.tensor([0.28, 0.25, 0.20, 0.15, 0.11])  # from S: 3 stops in 4
    table[S] = p.log()
    table[B] = -20.0
    table[B, 5] = 0.0  # B ends at once
    cfg = transformers.LlamaConfig(
        vocab_size=V, hidden_size=D, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
        bos_token_id=None, eos_token_id=EOS, pad_token_id=0, tie_word_embeddings=False,
        attn_implementation="eager",
    )  # fmt: skip
    ref = transformers.LlamaForCausalLM(cfg).eval()
    for name, param in ref.named_parameters():
        param.fill_(1.0) if "norm" in name else param.zero_()
    ref.model.embed_tokens.weight[:, :V] = torch.eye(V)
    ref.lm_head.weight[:, :V] = table.T / math.sqrt(D)  # logits = table[last token]
    ref.save_pretrained(tmp_path)
    model = load_hf(tmp_path)
    out = ref.generate(
        torch.tensor([[S]]), attention_mask=torch.ones(1, 1, dtype=torch.long),
        max_new_tokens=4, num_beams=2, num_return_sequences=2, length_penalty=1.0,
        early_stopping=True, do_sample=False, pad_token_id=0, eos_token_id=EOS,
        output_scores=True, return_dict_in_generate=True,
    )  # fmt: skip
    theirs = [[t for t in row if t not in EOS] for row in out.sequences[:, 1:].tolist()]
    hyps = beam_search(model, [[S]], 4, num_beams=2, eos_id=EOS, n_best=2)[0]
    assert [h.tokens for h in hyps] == theirs == [[B], []]
    assert [h.score for h in hyps] == pytest.approx(out.sequences_scores.tolist(), abs=1e-4)
    assert model.generate([S], 4, num_beams=2, stop_tokens=EOS) == [B]


def test_sampling_distribution_equals_transformers_warpers(monkeypatch):
    """The distribution sample_next draws from equals that of transformers' warpers in
    generate's order (temperature, top-k, top-p) on float32 logits, -inf ones included, for
    float32 and half-precision logits (generate casts them to float32 first). Logits
    without ties: at a tied top-k boundary attnlab keeps exactly k, transformers every tie."""
    lp = pytest.importorskip("transformers.generation.logits_process")
    import attnlab.generation as gen

    drawn = {}
    real_multinomial = torch.multinomial

    def multinomial(probs, n, generator=None):
        drawn["probs"] = probs
        return real_multinomial(probs, n, generator=generator)

    monkeypatch.setattr(gen.torch, "multinomial", multinomial)
    g = torch.Generator().manual_seed(0)
    V = 40
    for temperature, top_k, top_p in [
        (1.0, None, None), (0.7, 5, None), (1.3, None, 0.8), (0.5, 10, 0.9), (1.0, V + 3, 1e-6),
        (2.0, V, 1.0), (1.0, 1, 0.5),
    ]:  # fmt: skip
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            logits = (torch.randperm(V, generator=g).float() / 4 - 5).expand(3, V).clone()
            logits[1, : V // 3] = float("-inf")
            logits = logits.to(dtype)  # distinct values in every dtype
            warpers = [lp.TemperatureLogitsWarper(temperature), lp.TopPLogitsWarper(top_p or 1.0)]
            if top_k is not None:
                warpers.insert(1, lp.TopKLogitsWarper(top_k))
            want = lp.LogitsProcessorList(warpers)(None, logits.float()).softmax(-1)
            sample_next(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=g)
            torch.testing.assert_close(drawn["probs"], want, rtol=0, atol=1e-6)


def _tiny_llama_pair(tmp_path, vocab_size: int, eos_boost: float = 0.0):
    """A random tiny transformers LLaMA (EOS id 3, pad 0) and attnlab's import of it; with
    ``eos_boost``, EOS's output row is moved toward the final norm's gain (EOS likelier)."""
    import transformers

    from attnlab.interop import load_hf

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        bos_token_id=None, eos_token_id=3, pad_token_id=0, tie_word_embeddings=False,
        attn_implementation="eager", initializer_range=0.5,
    )  # fmt: skip
    ref = transformers.LlamaForCausalLM(cfg).eval()
    ref.lm_head.weight[3] += eos_boost * ref.model.norm.weight
    ref.save_pretrained(tmp_path)
    return ref, load_hf(tmp_path)


@torch.no_grad()
def test_batched_beam_search_equals_transformers_with_early_stopping(tmp_path):
    """A random tiny LLaMA, left-padded prompts, length penalties above, at and below 0:
    every row's n-best tokens and scores are transformers' generate(num_beams=3,
    early_stopping=True)."""
    pytest.importorskip("transformers")
    from attnlab.generation import beam_search

    ref, model = _tiny_llama_pair(tmp_path, vocab_size=24)
    prompts = [torch.randint(5, 24, (n,)).tolist() for n in (2, 5, 4)]
    ids = torch.zeros(3, 5, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, 5 - len(p) :] = torch.tensor(p)
    for alpha in (1.0, -0.5, 2.0):
        out = ref.generate(
            ids, attention_mask=(ids != 0).long(), max_new_tokens=5, num_beams=3,
            num_return_sequences=3, length_penalty=alpha, early_stopping=True, do_sample=False,
            pad_token_id=0, eos_token_id=3, output_scores=True, return_dict_in_generate=True,
        )  # fmt: skip
        theirs = [row[: row.index(3)] if 3 in row else row for row in out.sequences[:, 5:].tolist()]
        hyps = beam_search(model, prompts, 5, num_beams=3, eos_id=3, n_best=3, length_penalty=alpha)
        assert [h.tokens for row in hyps for h in row] == theirs
        scores = [h.score for row in hyps for h in row]
        assert scores == pytest.approx(out.sequences_scores.tolist(), abs=1e-4)


@torch.no_grad()
def test_beam_search_early_stopping_equals_transformers(tmp_path):
    """early_stopping True, False (transformers' default: search on while the best live
    beam could still beat a finished one) and "never": a random tiny LLaMA whose EOS is
    likely, left-padded prompts, length penalties above, at and below 0: every row's n-best
    tokens and scores are transformers' generate (scores within float32 rounding)."""
    pytest.importorskip("transformers")
    from attnlab.generation import beam_search

    ref, model = _tiny_llama_pair(tmp_path, vocab_size=16, eos_boost=0.3)  # beams end early
    changed = 0
    for seed in range(2):
        g = torch.Generator().manual_seed(seed)
        prompts = [torch.randint(4, 16, (n,), generator=g).tolist() for n in (2, 5, 4)]
        ids = torch.zeros(3, 5, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, 5 - len(p) :] = torch.tensor(p)
        for alpha in (1.0, 0.0, -0.7, 2.0):
            found = {}
            for early in (True, False, "never"):
                out = ref.generate(
                    ids, attention_mask=(ids != 0).long(), max_new_tokens=8, num_beams=3,
                    num_return_sequences=3, length_penalty=alpha, early_stopping=early,
                    do_sample=False, pad_token_id=0, eos_token_id=3, output_scores=True,
                    return_dict_in_generate=True,
                )  # fmt: skip
                rows = out.sequences[:, 5:].tolist()
                theirs = [row[: row.index(3)] if 3 in row else row for row in rows]
                hyps = beam_search(
                    model, prompts, 8, num_beams=3, eos_id=3, n_best=3, length_penalty=alpha,
                    early_stopping=early,
                )  # fmt: skip
                assert [h.tokens for row in hyps for h in row] == theirs, (seed, alpha, early)
                scores = [h.score for row in hyps for h in row]
                assert scores == pytest.approx(out.sequences_scores.tolist(), rel=1e-5, abs=1e-5)
                found[early] = theirs
            changed += found[False] != found[True] or found["never"] != found[True]
            best = model.generate(prompts, 8, num_beams=3, length_penalty=alpha,
                                  early_stopping=False, stop_tokens=3)  # fmt: skip
            assert best == found[False][::3]
    assert changed  # the settings are told apart


def test_early_stopping_is_checked():
    from attnlab.generation import beam_search_core

    logits = torch.zeros(1, 8)
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="early_stopping must be True, False or 'never'"):
            beam_search_core(logits, None, num_beams=2, max_new_tokens=3, eos_id=1,
                             early_stopping=bad)  # fmt: skip
    with pytest.raises(ValueError, match="early_stopping applies to style='transformers'"):
        beam_search_core(logits, None, num_beams=2, max_new_tokens=3, eos_id=1, style="gnmt",
                         early_stopping=False)  # fmt: skip


def test_top_k_ties_go_to_the_lowest_index_so_top_k_1_is_greedy():
    logits = torch.zeros(3, 8)
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        assert sample_next(logits, temperature=1.0, top_k=1, generator=g).tolist() == [0, 0, 0]
        two = sample_next(logits, temperature=1.0, top_k=2, generator=g)
        assert set(two.tolist()) <= {0, 1}


def test_sampling_keeps_float64_logits():
    """A float64 model samples from float64 logits (they were rounded to float32, where
    1 and 1 + 1e-12 tie and top_k=1 took the first)."""
    logits = torch.tensor([[1.0, 1.0 + 1e-12, -3.0]], dtype=torch.float64)
    assert sample_next(logits, temperature=1.0, top_k=1).tolist() == [1]


# --------------------------------------------------------------------------- one interface
# Every model kind's generate takes the same names with the same meaning, and refuses what
# it does not support with a one-line ValueError (not a TypeError from a keyword or a check).


def _kinds():
    from attnlab.models import XLConfig
    from attnlab.models.rnn import GRUSeq2Seq, RNNSeq2SeqConfig
    from attnlab.models.seq2seq import Seq2SeqConfig

    torch.manual_seed(0)
    xl = build_model(XLConfig(vocab_size=40, d_model=16, n_layers=1, mem_len=8)).eval()
    s2s = build_model(Seq2SeqConfig(vocab_size=12, src_vocab_size=10, share_embeddings=False,
                                    max_seq_len=16, d_model=16, n_layers=1)).eval()  # fmt: skip
    gru = GRUSeq2Seq(RNNSeq2SeqConfig(src_vocab_size=10, vocab_size=12, embed_dim=8,
                                      hidden_dim=8)).eval()  # fmt: skip
    return xl, s2s, gru


def test_stop_tokens_and_eos_id_take_one_id_or_any_sequence_of_ids(model):
    from attnlab.generation import beam_search

    xl, _, _ = _kinds()
    for lm in (model, xl):
        greedy = lm.generate([1, 2, 3], 8)
        stop = greedy[3]
        want = greedy[: greedy.index(stop)]
        for stops in (stop, np.int64(stop), [np.int64(stop)], np.array([stop, 0]),
                      torch.tensor([stop]), (stop,)):  # fmt: skip
            assert lm.generate([1, 2, 3], 8, stop_tokens=stops) == want, stops
    beams = beam_search(model, [1, 2, 3], 4, num_beams=2, eos_id=[7])
    assert beam_search(model, [1, 2, 3], 4, num_beams=2, eos_id=np.int64(7)) == beams
    assert beam_search(model, [1, 2, 3], 4, num_beams=2, eos_id=torch.tensor([7])) == beams
    for bad in ("5", [1.5], [-1]):
        with pytest.raises(ValueError, match="stop_tokens must be"):
            model.generate([1, 2, 3], 4, stop_tokens=bad)
    with pytest.raises(ValueError, match="eos_id must be"):
        beam_search(model, [1, 2, 3], 4, num_beams=2, eos_id=2.0)


def test_seed_and_max_new_tokens_mean_the_same_for_every_kind(model):
    xl, s2s, gru = _kinds()
    src = torch.tensor([[4, 5, 6]])
    for lm in (model, xl):  # a numpy seed is a seed
        sampled = lm.generate([1, 2], 5, temperature=1.0, seed=3)
        assert lm.generate([1, 2], 5, temperature=1.0, seed=np.int64(3)) == sampled
        with pytest.raises(ValueError, match="seed must be an integer"):
            lm.generate([1, 2], 5, temperature=1.0, seed=1.5)
        assert lm.generate([1, 2], 0) == []
    for m, prompt in ((model, [1, 2]), (xl, [1, 2]), (s2s, src), (gru, src)):
        for bad in (-1, 2.5):
            with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 0"):
                m.generate(prompt, bad)
        with pytest.raises(ValueError, match=r"num_beams \(beam_width\) must be an integer"):
            m.generate(prompt, 3, num_beams=True)
    for m in (s2s, gru):  # no new tokens, greedy or beams (beams failed on 0)
        assert m.generate(src, 0) == m.generate(src, 0, num_beams=2) == [[]]


def test_options_a_kind_does_not_support_are_one_line_value_errors():
    xl, s2s, gru = _kinds()
    src = torch.tensor([[4, 5, 6]])
    assert xl.generate([1, 2], 3, num_beams=1, length_penalty=0.6) == xl.generate([1, 2], 3)
    assert xl.generate([1, 2], 3, pad_id=0) == xl.generate([1, 2], 3)  # as DecoderLM's
    with pytest.raises(ValueError, match="num_beams=2: Transformer-XL has no beam search"):
        xl.generate([1, 2], 3, num_beams=2)
    for m, name in ((s2s, "Seq2SeqModel"), (gru, "GRUSeq2Seq")):
        for option, value in (("temperature", 0.7), ("top_k", 5), ("seed", 0),
                              ("stop_tokens", [1])):  # fmt: skip
            with pytest.raises(ValueError, match=f"{name}.generate does not take {option}: "):
                m.generate(src, 3, **{option: value})
        with pytest.raises(TypeError, match="unexpected keyword argument 'temprature'"):
            m.generate(src, 3, temprature=0.7)  # a misspelling stays Python's error
    with pytest.raises(ValueError, match="deterministic and cached; drop use_cache=False"):
        s2s.generate(src, 3, num_beams=2, use_cache=False)  # (it used the cache silently)


def test_stop_tokens_take_any_iterable_of_ids_as_before(model):
    # set(stop_tokens) took a dict's values or a generator; the shared check refused them
    greedy = model.generate([1, 2, 3], 8)
    want = greedy[: greedy.index(greedy[3])]
    for stops in ({"eos": greedy[3]}.values(), (t for t in [greedy[3]])):
        assert model.generate([1, 2, 3], 8, stop_tokens=stops) == want


def test_seq2seq_beam_search_takes_one_source_mask_for_every_row():
    # encode takes a (1, s) src_mask for every row; the beams' index_select on it failed
    _, s2s, _ = _kinds()
    src = torch.tensor([[4, 5, 6, 7], [7, 6, 5, 4]])
    one = torch.ones(1, 4, dtype=torch.bool)
    full = one.expand(2, -1)
    for beams in (1, 2):
        want = s2s.generate(src, 4, src_mask=full, num_beams=beams)
        assert s2s.generate(src, 4, src_mask=one, num_beams=beams) == want


# --------------------------------------------------------------------------- beam search reads
# beam_search_core reads the device once per step; the implementation before (a read per
# flag tensor, another for the tokens of the hypotheses that finish, the sequences kept on
# the device) is kept here as its twin.


def _beam_search_core_before(
    logits: Tensor,
    advance,
    *,
    num_beams: int,
    max_new_tokens: int,
    eos_id: int | Sequence[int] | None,
    length_penalty: float = 1.0,
    n_best: int = 1,
    style: str = "transformers",
    blocked_ids: Sequence[int] = (),
    renormalize: bool = False,
    forced_last_ids: Sequence[int] = (),
    early_stopping: bool | str = True,
    forced_first_ids: Sequence[int] = (),
) -> list[list[Hypothesis]]:
    """beam_search_core as it was before one host read per step: a read per flag tensor
    and per finishing step, the sequences on the device (early_stopping True only: it
    came later; the forced first tokens too, added to both)."""
    assert early_stopping is True
    k, alpha = num_beams, length_penalty
    check_beam_search(k, max_new_tokens, n_best, alpha, style)
    gnmt = style == "gnmt"
    b, V = logits.shape
    device = logits.device
    stops = stop_ids(eos_id, "eos_id")
    eos = torch.tensor(stops, dtype=torch.long, device=device)
    bound_lp = divisor(max_new_tokens, alpha, style)  # the largest a prefix can get
    scores = torch.zeros(b, 1, device=device)  # (b, beams): summed log-probs, -inf: dead
    seqs = torch.zeros(b, 1, 0, dtype=torch.long, device=device)  # (b, beams, n)
    finished: list[list[Hypothesis]] = [[] for _ in range(b)]
    done = [False] * b
    for step in range(max_new_tokens):
        beams = scores.shape[1]
        last = step == max_new_tokens - 1
        logp = block_tokens(torch.log_softmax(softmax_dtype(logits), dim=-1), blocked_ids)
        first = list(forced_first_ids) if step == 0 else []
        forced = list(forced_last_ids) if last else []
        logp = force_tokens(force_tokens(logp, first), forced)
        if renormalize and (blocked_ids or forced or first):
            logp = torch.log_softmax(logp, dim=-1)
        logp = logp.view(b, beams, V) + scores[..., None]  # (b, beams, V)
        # enough candidates that k beams live on even if every stop token is among them
        # (transformers keeps max(2, 1 + n_eos) * k)
        n_cand = min(max(2, 1 + len(stops)) * k, beams * V)
        top, flat = logp.view(b, beams * V).topk(n_cand, dim=-1)  # (b, C)
        beam, tok = flat // V, flat % V
        cand = torch.cat((seqs.gather(1, beam[..., None].expand(-1, -1, step)), tok[..., None]), 2)
        is_eos = torch.isin(tok, eos)
        ends = torch.ones_like(is_eos) if last and not gnmt else is_eos
        alive = torch.isfinite(top)
        n_keep = min(k, n_cand)
        going_on = top.masked_fill(ends | ~alive, float("-inf"))
        keep = going_on.topk(n_keep, dim=-1).indices  # (b, n_keep)
        kept = going_on.gather(1, keep)  # (b, n_keep), -inf where fewer beams go on
        penalty = divisor(step + 1, alpha, style)
        top_l, ends_l, eos_l, alive_l = top.tolist(), ends.tolist(), is_eos.tolist(), alive.tolist()
        best_live = kept.max(dim=1).values.tolist()
        # only the tokens of the candidates that finish, read in one go (reading every
        # candidate's tokens at every step cost O(step): quadratic in max_new_tokens)
        ending = [
            (r, j)
            for r in range(b)
            if not done[r]
            for j in range(n_keep)  # only the best k candidates may finish
            if ends_l[r][j] and alive_l[r][j]
        ]
        if ending:
            rows_e, cols_e = zip(*ending)
            for (r, j), tokens in zip(ending, cand[list(rows_e), list(cols_e)].tolist()):
                total = top_l[r][j]
                tokens = tokens[:-1] if eos_l[r][j] else tokens
                finished[r].append(Hypothesis(tokens, total / penalty, total, eos_l[r][j]))
        for r in range(b):
            if done[r]:
                continue
            finished[r] = sorted(finished[r], key=lambda h: -h.score)[:k]
            if not gnmt:
                done[r] = len(finished[r]) >= k
            elif best_live[r] == float("-inf"):
                done[r] = True  # nothing goes on
            elif len(finished[r]) >= n_best:
                done[r] = finished[r][n_best - 1].score >= best_live[r] / bound_lp
        if last and gnmt:  # the length limit: unfinished beams fill short lists
            for r in range(b):
                if not done[r] and len(finished[r]) < n_best:
                    rows = keep[r].tolist()
                    live = [
                        Hypothesis(cand[r, j].tolist(), top_l[r][j] / penalty, top_l[r][j], False)
                        for j in rows
                        if alive_l[r][j] and top_l[r][j] > float("-inf") and not eos_l[r][j]
                    ]
                    finished[r] += sorted(live, key=lambda h: -h.score)
        if last or all(done):
            break
        scores = kept
        seqs = cand.gather(1, keep[..., None].expand(-1, -1, step + 1))
        source = (torch.arange(b, device=device)[:, None] * beams + beam.gather(1, keep)).flatten()
        logits = advance(source, tok.gather(1, keep).flatten())  # (b * n_keep, V)
    return [f[:n_best] for f in finished]


def _table_search(core, table, b, **kw):
    """``core`` on a model whose logits depend on a beam's input row, length and last token
    (rows of ``table``, picked by a hash), so both twins see the same model."""
    n = table.shape[0]
    state = [(r, 0, 0) for r in range(b)]  # per decoding row: (input row, length, last token)

    def logits_of(rows):
        return table[[(13 * r + 7 * length + last) % n for r, length, last in rows]]

    def advance(source, tokens):
        state[:] = [
            (state[s][0], state[s][1] + 1, t) for s, t in zip(source.tolist(), tokens.tolist())
        ]
        return logits_of(state)

    return core(logits_of(state), advance, **kw)


def test_beam_search_core_equals_its_twin_on_random_settings():
    """Same hypotheses, scores and order as the implementation before, over random
    settings: beams (fewer at first on small vocabularies), both styles, length penalties,
    stop sets, n_best, batch sizes, blocked / forced tokens, float32 and float64 logits,
    and logits on a coarse grid, where scores tie often."""
    from attnlab.generation import beam_search_core

    rng = np.random.default_rng(0)
    g = torch.Generator().manual_seed(0)
    compared = finished_early = 0
    for _ in range(400):
        V = int(rng.choice([3, 5, 9]))
        style = str(rng.choice(["transformers", "gnmt"]))
        k = int(rng.choice([1, 2, 3, 5]))
        alphas = [0.0, 0.6, 1.0, 2.0] + ([-0.5] if style == "transformers" else [])
        kw = dict(
            num_beams=k,
            max_new_tokens=int(rng.integers(1, 9)),
            eos_id=[None, 0, [0, 2], [0, 1, V - 1]][rng.integers(4)],
            length_penalty=float(rng.choice(alphas)),
            n_best=int(rng.integers(1, k + 1)),
            style=style,
        )
        if k > V ** kw["max_new_tokens"]:  # more beams than continuations: refused
            kw["max_new_tokens"] = 2  # (generation.check_beams_can_fill); 2 fill them
        if rng.random() < 0.3:
            kw.update(blocked_ids=[V - 2], renormalize=bool(rng.random() < 0.5))
        if rng.random() < 0.3:
            kw.update(forced_last_ids=[0])
        if rng.random() < 0.2:
            kw.update(forced_first_ids=[1])
        table = torch.randn(23, V, generator=g) * 3
        if rng.random() < 0.5:
            table = table.round()  # many ties
        if rng.random() < 0.3:
            table = table.double()
        b = int(rng.integers(1, 4))
        want = _table_search(_beam_search_core_before, table, b, **kw)
        got = _table_search(beam_search_core, table, b, **kw)
        assert got == want, kw
        compared += 1
        finished_early += any(len(h.tokens) < kw["max_new_tokens"] for row in got for h in row)
    assert finished_early > 50  # the settings exercise stops before the length limit


@pytest.mark.parametrize("b", [3, 0])
def test_read_together_gives_each_tensors_tolist_in_one_read(b, host_reads):
    """Half-precision, float32 and float64 values (inf, nan, subnormals), bools and ids
    past 2**24 (where float32 would round them) come back exactly as each tolist() gives
    them, with one read for all; an empty batch gives empty rows."""
    from attnlab.generation import read_together

    g = torch.Generator().manual_seed(0)
    special = torch.tensor([float("-inf"), float("inf"), float("nan"), 1e-7])
    tensors = [
        torch.cat((torch.randn(b, 5, generator=g) * 1e4, special.expand(b, -1)), 1).to(dtype)
        for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    ]
    tensors += [
        torch.randint(0, 2, (b, 3), generator=g).bool(),
        torch.randint(2**24, 2**53, (b, 6), generator=g),
        torch.randint(-(2**24), 2**24, (b, 2), generator=g, dtype=torch.int32),
    ]
    want = [t.tolist() for t in tensors]
    host_reads.clear()
    got = read_together(*tensors)
    assert len(host_reads) == 1
    assert repr(got) == repr(want)  # repr: nan equals nan, and 1 / 1.0 / True differ


def test_beam_search_core_reads_the_device_once_per_step(host_reads):
    """One host read per step (the twin before read 5 or 6 per step), whatever the style."""
    from attnlab.generation import beam_search_core

    table = torch.randn(16, 16, generator=torch.Generator().manual_seed(0))
    steps = []

    def advance(source, tokens):
        steps.append(1)
        return table[tokens]

    for style in ("transformers", "gnmt"):
        for core in (beam_search_core, _beam_search_core_before):
            host_reads.clear()
            steps.clear()
            hyps = core(table[[1, 2, 3]], advance, num_beams=4, max_new_tokens=12, eos_id=[0, 5],
                        n_best=2, style=style)  # fmt: skip
            n_steps = len(steps) + 1
            assert n_steps > 3 and any(h.finished for row in hyps for h in row)
            if core is beam_search_core:
                assert len(host_reads) == n_steps, host_reads
            else:  # the twin: at least 5 reads per step
                assert len(host_reads) >= 5 * n_steps


def _both_cores(monkeypatch, search, *args, **kwargs):
    """What beam_search_core returns inside ``search(*args, **kwargs)``, then what its twin
    returns there (every model calls the one core)."""
    import attnlab.generation as generation
    import attnlab.models.rnn as rnn

    results = []
    for core in (generation.beam_search_core, _beam_search_core_before):

        def spy(*a, _core=core, **kw):
            results.append(_core(*a, **kw))
            return results[-1]

        monkeypatch.setattr(generation, "beam_search_core", spy)
        monkeypatch.setattr(rnn, "beam_search_core", spy)
        search(*args, **kwargs)
    return results


@pytest.mark.parametrize("family", ["gpt2-tiny", "llama-tiny", "seq2seq", "gru"])
def test_every_family_beam_searches_as_with_the_twin(family, monkeypatch):
    """Each model family's beam search, with the core and with its twin: the same
    hypotheses and scores, over beams, length penalties, stop sets and batch sizes (the
    seq2seq model with blocked, forced and renormalized tokens, as Marian's)."""
    from attnlab.generation import beam_search
    from attnlab.models.rnn import GRUSeq2Seq, RNNSeq2SeqConfig
    from attnlab.models.seq2seq import Seq2SeqConfig

    torch.manual_seed(0)
    rng = np.random.default_rng(1)
    if family == "seq2seq":
        marian = {"blocked_ids": [3], "forced_eos_ids": [2], "renormalize_logits": True}
        model = build_model(Seq2SeqConfig(vocab_size=12, src_vocab_size=10, max_seq_len=16,
                                          d_model=16, n_layers=1, init_std=0.5,
                                          share_embeddings=False, **marian)).eval()  # fmt: skip
    elif family == "gru":
        model = GRUSeq2Seq(RNNSeq2SeqConfig(src_vocab_size=10, vocab_size=12, embed_dim=8,
                                            hidden_dim=8)).eval()  # fmt: skip
    else:
        model = model_for(family, vocab_size=16)
    for _ in range(6):
        b, k = int(rng.integers(1, 4)), int(rng.choice([2, 3, 5]))
        n, n_best = int(rng.integers(2, 7)), int(rng.integers(1, k + 1))
        kw = dict(length_penalty=float(rng.choice([0.0, 0.6, 1.5])), n_best=n_best,
                  style=str(rng.choice(["transformers", "gnmt"])))  # fmt: skip
        src = torch.randint(3, 10, (b, 5))
        if family == "seq2seq":
            got, want = _both_cores(monkeypatch, model.generate, src, n, num_beams=k, **kw)
        elif family == "gru":
            got, want = _both_cores(monkeypatch, model.beam_search, src, beam_width=k, max_len=n,
                                    **kw)  # fmt: skip
        else:
            eos = [None, 3, [3, 7, 11]][rng.integers(3)]
            prompts = [torch.randint(0, 16, (int(rng.integers(1, 5)),)).tolist() for _ in range(b)]
            got, want = _both_cores(monkeypatch, beam_search, model, prompts, n, num_beams=k,
                                    eos_id=eos, **kw)  # fmt: skip
        assert got == want
