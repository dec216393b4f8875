"""Slow, readable references that the fast code is tested against.

Everything here is written as directly from the equations as possible: Python loops over
queries and positions, complex numbers for rotations. Nothing here imports attnlab, so a
bug in the library cannot leak into its own reference.

Shapes: b batch, h query heads, h_kv key/value heads, t query length, s key length,
d_h head dim, d d_model.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def naive_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    allowed: Tensor | None = None,
    bias: Tensor | None = None,
    *,
    scale: float | None = None,
    softcap: float | None = None,
) -> Tensor:
    """One query at a time: out_i = sum_j softmax_j(q_i . k_j * scale + bias_ij) v_j over the
    keys j with ``allowed[i, j]``. Query head j reads key/value head j // (h / h_kv).
    ``softcap`` c (Gemma 2): each q_i . k_j * scale becomes c tanh(q_i . k_j * scale / c)
    before the bias.

    q (b, h, t, d_h); k, v (b, h_kv, s, d_h); ``allowed`` bool and ``bias`` float, both
    broadcastable to (b, h, t, s). A query with no allowed key gives zeros."""
    q, k, v = q.detach(), k.detach(), v.detach()  # a reference value, never differentiated
    b, h, t, d_h = q.shape
    h_kv, s = k.shape[1], k.shape[2]
    group = h // h_kv
    scale = 1.0 / math.sqrt(d_h) if scale is None else scale
    if allowed is None:
        allowed = torch.ones(1, 1, 1, 1, dtype=torch.bool)
    allowed = allowed.expand(b, h, t, s)
    bias = torch.zeros(b, h, t, s) if bias is None else bias.expand(b, h, t, s)
    out = torch.zeros(b, h, t, d_h, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            kv = hi // group
            for i in range(t):
                scores = []
                for j in range(s):
                    if allowed[bi, hi, i, j] and bias[bi, hi, i, j] > float("-inf"):
                        dot = float(q[bi, hi, i].double() @ k[bi, kv, j].double()) * scale
                        if softcap is not None:
                            dot = softcap * math.tanh(dot / softcap)
                        scores.append((j, dot + float(bias[bi, hi, i, j])))
                if not scores:
                    continue
                top = max(x for _, x in scores)
                z = sum(math.exp(x - top) for _, x in scores)
                for j, x in scores:
                    out[bi, hi, i] += (math.exp(x - top) / z) * v[bi, kv, j].double()
    return out.to(q.dtype)


def head_norm(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float, kind: str) -> Tensor:
    """QK-norm written out one head at a time: x (b, n, t, d_h); weight (and bias) (d_h,),
    shared by the n heads, or (n, d_h), head j's its row j. "layernorm": (x - mean) /
    sqrt(mean((x - mean)^2) + eps) * w + b; "rmsnorm": x / sqrt(mean(x^2) + eps) * w."""
    out = torch.empty_like(x)
    for j in range(x.shape[1]):
        xj = x[:, j]  # (b, t, d_h)
        w = weight if weight.dim() == 1 else weight[j]
        centred = xj - xj.mean(-1, keepdim=True) if kind == "layernorm" else xj
        y = centred / torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + eps) * w
        if bias is not None:
            y = y + (bias if bias.dim() == 1 else bias[j])
        out[:, j] = y
    return out


def alibi_slopes_paper(n_heads: int, max_bias: float = 8.0) -> list[float]:
    """ALiBi's head slopes as the paper's code (Press et al. 2022, ``get_slopes``) forms
    them: for n a power of two the geometric sequence starting at, and with ratio,
    2^(-max_bias / n); otherwise the slopes of the closest power of two p below n, followed
    by every other slope (the 1st, 3rd, ...) of the sequence for 2p heads, n - p of them."""

    def power_of_2(n: int) -> list[float]:
        start = 2 ** (-max_bias / n)
        return [start * start**i for i in range(n)]

    if math.log2(n_heads).is_integer():
        return power_of_2(n_heads)
    p = 2 ** math.floor(math.log2(n_heads))
    return power_of_2(p) + alibi_slopes_paper(2 * p, max_bias)[0::2][: n_heads - p]


def alibi_bias(
    slopes: list[float], q_pos: Tensor, k_pos: Tensor, *, bidirectional: bool = False
) -> Tensor:
    """(b, h, t, s) float64: the ALiBi bias -m_h (i - j) of query position q_pos[b, i]
    against key position k_pos[b, j] (-m_h |i - j| when ``bidirectional``), one entry at a
    time. q_pos (b, t), k_pos (b, s) integer positions."""
    b, t, s = q_pos.shape[0], q_pos.shape[1], k_pos.shape[1]
    out = torch.zeros(b, len(slopes), t, s, dtype=torch.float64)
    for bi in range(b):
        for h, m in enumerate(slopes):
            for i in range(t):
                for j in range(s):
                    distance = int(q_pos[bi, i]) - int(k_pos[bi, j])
                    out[bi, h, i, j] = -m * (abs(distance) if bidirectional else distance)
    return out


def causal_allowed(t: int, s: int) -> Tensor:
    """(t, s) bool: query i is the token at position s - t + i and sees keys up to it."""
    allowed = torch.zeros(t, s, dtype=torch.bool)
    for i in range(t):
        for j in range(s):
            allowed[i, j] = j <= s - t + i
    return allowed


def sliding_window_allowed(t: int, s: int, window: int) -> Tensor:
    """(t, s) bool: causal, and the key is one of the last ``window`` positions (self included)."""
    allowed = torch.zeros(t, s, dtype=torch.bool)
    for i in range(t):
        pos = s - t + i
        for j in range(s):
            allowed[i, j] = pos - window < j <= pos
    return allowed


def global_window_allowed(
    positions: Tensor,
    window: int,
    global_positions: list[int],
    *,
    causal: bool = True,
    valid: Tensor | None = None,
) -> Tensor:
    """(b, 1, t, t) bool over tokens at absolute ``positions`` (b, t), Longformer's rule
    one pair at a time: a key is visible when it lies in the query's window (causal: the
    last ``window`` positions, the query's own included; else within ``window - 1`` on
    either side) or when the key or the query is global; causal hides later keys; keys
    that are not ``valid`` (b, t) (padding) are hidden."""
    b, t = positions.shape
    allowed = torch.zeros(b, 1, t, t, dtype=torch.bool)
    for r in range(b):
        for i in range(t):
            p = int(positions[r, i])
            for j in range(t):
                q = int(positions[r, j])
                if valid is not None and not valid[r, j]:
                    continue
                if causal and q > p:
                    continue
                local = 0 <= p - q < window if causal else abs(p - q) < window
                allowed[r, 0, i, j] = local or p in global_positions or q in global_positions
    return allowed


def streaming_llm_keys(n_tokens: int, start_size: int, recent_size: int) -> list[list[int]]:
    """StreamingLLM's reference loop (Xiao et al. 2023; mit-han-lab/streaming-llm,
    ``StartRecentKVCache`` as ``eval_long_ppl.py`` drives it): tokens go in one at a time;
    each attends to the cached tokens and itself, then joins the cache, which is cut to its
    first ``start_size`` and last ``recent_size`` tokens whenever it holds more than
    start_size + recent_size. Returns, per query, the positions of its keys in cache order
    (the query last); under its position shift a key's position is its index here."""
    cache: list[int] = []
    keys = []
    for p in range(n_tokens):
        cache = cache + [p]
        keys.append(cache)
        if len(cache) > start_size + recent_size:
            cache = cache[:start_size] + cache[len(cache) - recent_size :]
    return keys


def sinusoid_table(n_positions: int, d: int) -> Tensor:
    """(n_positions, d): p[i, 2j] = sin(i / 10000^(2j/d)), p[i, 2j+1] = cos(i / 10000^(2j/d))."""
    table = torch.zeros(n_positions, d, dtype=torch.float64)
    for i in range(n_positions):
        for j in range(d // 2):
            angle = i / 10000 ** (2 * j / d)
            table[i, 2 * j] = math.sin(angle)
            table[i, 2 * j + 1] = math.cos(angle)
    return table


def rope_complex_interleaved(x: Tensor, positions: Tensor, theta: float = 10000.0) -> Tensor:
    """RoPE as complex multiplication (RoFormer eq. 34): pair (x_2i, x_2i+1) is the complex
    number x_2i + i x_2i+1, multiplied by e^{i m theta^(-2i/d)} at position m.

    x (..., t, d_h), positions (t,) -> (..., t, d_h), computed in float64."""
    d_h = x.shape[-1]
    freqs = torch.tensor([theta ** (-2 * i / d_h) for i in range(d_h // 2)], dtype=torch.float64)
    angles = positions.double()[:, None] * freqs[None, :]  # (t, d_h/2)
    rot = torch.polar(torch.ones_like(angles), angles)  # e^{i angle}
    z = torch.view_as_complex(x.double().reshape(*x.shape[:-1], d_h // 2, 2).contiguous())
    return torch.view_as_real(z * rot).reshape(x.shape)


def sequence_balance_loss(affinity: Tensor, top_k: int, alpha: float) -> Tensor:
    """DeepSeek-V3's complementary sequence-wise balance loss (eq. 17-20), one sequence
    and one expert at a time, averaged over the sequences of ``affinity`` (b, T, E), the
    router's s_{i,t}: L = alpha sum_i f_i P_i, f_i = E / (k T) sum_t 1(s_{i,t} in
    Topk_j(s_{j,t}, k)), P_i = 1/T sum_t s_{i,t} / sum_j s_{j,t}."""
    b, T, E = affinity.shape
    losses = []
    for seq in affinity:
        loss = 0.0
        for i in range(E):
            top = [i in seq[t].topk(top_k).indices.tolist() for t in range(T)]
            f_i = E / (top_k * T) * sum(top)
            p_i = sum(seq[t, i] / seq[t].sum() for t in range(T)) / T
            loss = loss + f_i * p_i
        losses.append(alpha * loss)
    return torch.stack(losses).mean()


def switch_balance_loss(
    logits: list[Tensor], top_k: int, coef: float, real: Tensor | None = None
) -> Tensor:
    """The Switch Transformer balance loss (Fedus et al. 2021, eq. 4-6) over several MoE
    layers' router ``logits`` (each (N, E)), one expert at a time, over the tokens with
    ``real`` (N,) bool (all without): coef E sum_i F_i P_i, where over all (layer, token)
    pairs F_i = (times i is among a token's top_k softmax probabilities) / pairs and
    P_i = sum of softmax_i / pairs."""
    E = logits[0].shape[-1]
    keep = [True] * logits[0].shape[0] if real is None else real.tolist()
    pairs, loss = sum(keep) * len(logits), 0.0
    for i in range(E):
        chosen = prob = 0.0
        for layer in logits:
            for n, row in enumerate(layer.softmax(dim=-1)):
                if keep[n]:
                    chosen += i in row.topk(top_k).indices.tolist()
                    prob = prob + row[i]
        loss = loss + (chosen / pairs) * (prob / pairs)
    return coef * E * loss


def indexer_kl_loss(weights: Tensor, index_scores: Tensor, support: Tensor) -> float:
    """DeepSeek-V3.2's indexer loss (Sec. 2.1), one query at a time: p_t = the main
    attention ``weights`` (b, h, t, s) summed over the heads, L1-normalised over the keys of
    ``support`` (b, t, s) bool (every allowed key in the dense warm-up, the selected set S_t
    in sparse training); L = mean over the queries with a key of sum_s p_t[s]
    (log p_t[s] - log softmax(I_t over the support)[s]), ``index_scores`` (b, t, s) the I_t."""
    b, h, t, s = weights.shape
    total, n_rows = 0.0, 0
    for bi in range(b):
        for ti in range(t):
            keys = [si for si in range(s) if support[bi, ti, si]]
            if not keys:
                continue
            mass = {si: sum(float(weights[bi, hi, ti, si]) for hi in range(h)) for si in keys}
            norm = sum(mass.values())
            top = max(float(index_scores[bi, ti, si]) for si in keys)
            z = sum(math.exp(float(index_scores[bi, ti, si]) - top) for si in keys)
            for si in keys:
                p = mass[si] / norm
                if p > 0:
                    log_q = float(index_scores[bi, ti, si]) - top - math.log(z)
                    total += p * (math.log(p) - log_q)
            n_rows += 1
    return total / max(n_rows, 1)


def greedy_no_cache(model, prompt: list[int], n_new: int) -> list[int]:
    """Greedy decoding by re-running the whole sequence each step and taking the argmax."""
    ids = list(prompt)
    out = []
    with torch.no_grad():
        for _ in range(n_new):
            logits = model(torch.tensor([ids])).logits[0, -1]
            nxt = int(logits.argmax())
            out.append(nxt)
            ids.append(nxt)
    return out


def llama_style_tokenizer(text: str, vocab_size: int):
    """A LLaMA-style (SentencePiece-like) ``tokenizers.Tokenizer`` trained on ``text``:
    "▁" prepended to a text and standing for every space, BPE over the pieces, ``<s>`` put
    first by its post-processor (as transformers' ``tokenizer(text)`` then encodes)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers

    hf = Tokenizer(models.BPE(unk_token="<unk>"))
    hf.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    )
    hf.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    hf.train_from_iterator([text], trainer=trainer)
    hf.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", hf.token_to_id("<s>"))]
    )
    return hf


def hf_training_loss(ref, idx, targets, attention_mask=None) -> torch.Tensor:
    """A transformers causal LM's ``out.loss`` (with its router balance loss where its
    config sets ``output_router_logits``) for attnlab-style ``targets`` (b, t) (the next
    token at each position, -100 ignored; none after the last): transformers shifts its
    ``labels`` inside, so labels[:, j + 1] = targets[:, j]. With an ``attention_mask``,
    positions that count real tokens only, as :func:`hf_logits`."""
    assert (targets[:, -1] == -100).all(), "transformers has no target after the last token"
    labels = torch.cat([torch.full_like(targets[:, :1], -100), targets[:, :-1]], dim=1)
    kwargs = {}
    if attention_mask is not None:
        kwargs["position_ids"] = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        kwargs["attention_mask"] = attention_mask
    return ref(idx, labels=labels, **kwargs).loss


def randomize_weights(model, seed: int, *, std: float, norms: tuple[float, float], is_norm=None):
    """Every parameter of ``model`` far from its init, so that a wrong weight mapping changes
    the outputs a lot: norm weights (``is_norm(name, p)``; default: "norm" in the name)
    uniform in ``norms`` = [low, high) around the family's identity value, every other
    parameter (biases too) normal with ``std``."""
    is_norm = is_norm or (lambda name, p: "norm" in name)
    low, high = norms
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if is_norm(name, p):
                p.copy_(torch.rand(p.shape, generator=g) * (high - low) + low)
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))


def assert_greedy_tokens_match_hf(ref, model, vocab_size: int, n: int = 12) -> None:
    """attnlab's greedy ``generate`` gives transformers' ``generate`` tokens: one prompt of
    7 tokens, and a batch of two prompts (4 and 9 tokens) that transformers takes
    left-padded with its attention mask and attnlab as ragged lists. With a window under
    7 + n tokens, decoding runs past it."""
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, vocab_size, (1, 7), generator=g)
    theirs = ref.generate(
        prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=n,
        pad_token_id=0,
    )  # fmt: skip
    assert model.generate(prompt[0].tolist(), n) == theirs[0, prompt.shape[1] :].tolist()
    rows = [torch.randint(1, vocab_size, (4,), generator=g).tolist(),
            torch.randint(1, vocab_size, (9,), generator=g).tolist()]  # fmt: skip
    ids = torch.zeros(2, 9, dtype=torch.long)
    mask = torch.zeros(2, 9, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, 9 - len(r) :], mask[i, 9 - len(r) :] = torch.tensor(r), 1
    theirs = ref.generate(
        ids, attention_mask=mask, do_sample=False, max_new_tokens=n, pad_token_id=0
    )
    assert model.generate(rows, n) == theirs[:, 9:].tolist()


def hf_logits(ref, idx, attention_mask=None) -> torch.Tensor:
    """A transformers causal LM's logits for ``idx``; with an ``attention_mask`` (left
    padding), positions that count real tokens only, as attnlab's do."""
    kwargs = {}
    if attention_mask is not None:
        kwargs["position_ids"] = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        kwargs["attention_mask"] = attention_mask
    with torch.no_grad():
        return ref(idx, **kwargs).logits


def left_padded_batch(vocab_size: int, seed: int = 2) -> tuple[Tensor, Tensor]:
    """(3, 16) token ids and their attention mask: rows 0 and 2 left-padded by 5 and 9
    (pads are token 0), row 1 whole."""
    idx = torch.randint(0, vocab_size, (3, 16), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(idx)
    mask[0, :5] = 0
    mask[2, :9] = 0
    return idx.masked_fill(mask == 0, 0), mask


def assert_logits_match_hf(ref, model, vocab_size: int, tol: float, seed: int = 1) -> None:
    """A transformers causal LM and a model holding its weights: logits of a (3, 16) batch
    within ``tol``, the reference's not all near zero."""
    idx = torch.randint(0, vocab_size, (3, 16), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ours = model(idx).logits
    theirs = hf_logits(ref, idx)
    assert theirs.abs().max() > 1.0  # the comparison is not between near-zero logits
    assert (ours - theirs).abs().max() <= tol


def assert_left_padded_logits_match_hf(ref, model, vocab_size: int, tol: float) -> None:
    """The same with :func:`left_padded_batch`: the real tokens' logits within ``tol``."""
    idx, mask = left_padded_batch(vocab_size)
    with torch.no_grad():
        ours = model(idx, attention_mask=mask).logits
    theirs = hf_logits(ref, idx, mask)
    real = mask.bool()
    assert (ours[real] - theirs[real]).abs().max() <= tol


def deberta_row_paper(relative: int, span: int) -> int:
    """DeBERTa's delta(i, j) (He et al. 2021, eq. 3) for relative = i - j: 0 at or below -k,
    2k - 1 at or above k, i - j + k between."""
    if relative <= -span:
        return 0
    if relative >= span:
        return 2 * span - 1
    return relative + span


def disentangled_scores(
    q: Tensor,
    k: Tensor,
    pos_key: Tensor | None,
    pos_query: Tensor | None,
    rows: Tensor,
) -> Tensor:
    """DeBERTa's attention scores one query and one key at a time: q (b, h, t, d_h), k (b, h,
    s, d_h), the position keys / queries (h, 2k, d_h) (None: that term left out), rows
    (t, s) the table row of each pair. A[i, j] = (q_i . k_j + q_i . K^r[row] + k_j .
    Q^r[row]) / sqrt(d_h (1 + terms))."""
    b, h, t, d = q.shape
    s = k.shape[-2]
    n_terms = (pos_key is not None) + (pos_query is not None)
    out = torch.zeros(b, h, t, s, dtype=q.dtype)
    for i in range(t):
        for j in range(s):
            r = int(rows[i, j])
            score = (q[:, :, i] * k[:, :, j]).sum(-1)  # (b, h)
            if pos_key is not None:
                score = score + (q[:, :, i] * pos_key[None, :, r]).sum(-1)
            if pos_query is not None:
                score = score + (k[:, :, j] * pos_query[None, :, r]).sum(-1)
            out[:, :, i, j] = score / math.sqrt(d * (1 + n_terms))
    return out
