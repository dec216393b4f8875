"""GRU encoder-decoder with additive attention (Bahdanau, Cho and Bengio 2015).

    h_1..h_S   = BiGRU(E_src[x])                  encoder: forward and backward states, (b, s, 2H)
    s_0        = tanh(W_init [h_fwd_S; h_bwd_1])  decoder start from both final states
    c_t, a_t   = Attn(query=s_{t-1}, keys=values=h, mask=source padding)
    s_t        = GRU([E_tgt[y_{t-1}]; c_t], s_{t-1})
    p(y_t | .) = softmax(W_out [s_t; c_t])

The attention query is the previous decoder state s_{t-1}, so the decoder runs one step at
a time also under teacher forcing: ``forward`` and the decoding loops share ``step``.
Padding: the encoder packs the sequences (the backward GRU starts at each row's last real
token) and attention ignores padded keys, so padding never changes another row's output.

Shapes: b batch, s source length, t target length, E embedding size, H hidden size,
L layers, V target vocabulary size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from attnlab.config import ModelConfig, _fail, _positive, register_model_config
from attnlab.functional.softmax import softmax_dtype
from attnlab.generation import (
    Hypothesis,
    beam_search_core,
    check_beam_search,
    check_decoding,
    refuse_options,
)
from attnlab.models.build import register_model
from attnlab.models.inputs import check_ids, check_padding_mask, check_targets
from attnlab.models.outputs import ModelOutput
from attnlab.nn.additive import AdditiveAttention
from attnlab.nn.linear import Linear
from attnlab.nn.modes import enter_eval, restore

IGNORE_INDEX = -100  # targets with this value add nothing to the loss


@dataclass
class RNNSeq2SeqConfig(ModelConfig):
    """The GRU encoder-decoder (``arch`` "gru-seq2seq"). ``vocab_size`` is the target
    vocabulary, ``src_vocab_size`` the source's; ``n_layers`` GRU layers; ``dropout`` on
    embeddings and outputs (and between GRU layers). The transformer fields (``d_model``,
    ``attention``, ``ffn``, ``norm``, ``position``) are unused; ``max_seq_len`` bounds
    decoding."""

    arch: str = "gru-seq2seq"
    n_layers: int = 1
    src_vocab_size: int = 16
    pad_id: int = 0  # in both vocabularies
    bos_id: int = 1  # target vocabulary
    eos_id: int = 2  # target vocabulary
    embed_dim: int = 64
    hidden_dim: int = 128
    attention_dim: int | None = None  # None: hidden_dim

    @property
    def tgt_vocab_size(self) -> int:
        """The target vocabulary size (an alias of ``vocab_size``)."""
        return self.vocab_size

    def validate(self, path: str = "") -> None:
        super().validate(path)
        at = (lambda name: f"{path}.{name}") if path else (lambda name: name)
        for name in ("src_vocab_size", "embed_dim", "hidden_dim"):
            _positive(at(name), getattr(self, name))
        _positive(at("attention_dim"), self.attention_dim)
        for name in ("pad_id", "bos_id", "eos_id"):
            value = getattr(self, name)
            if not 0 <= value < self.vocab_size:
                _fail(at(name), f"{value} is outside [0, vocab_size={self.vocab_size})")
        if not 0 <= self.pad_id < self.src_vocab_size:
            _fail(
                at("pad_id"), f"{self.pad_id} is outside [0, src_vocab_size={self.src_vocab_size})"
            )


register_model_config("gru-seq2seq", RNNSeq2SeqConfig)


@dataclass
class Seq2SeqOutput(ModelOutput):
    """A model output (logits (b, t, V), loss: mean cross-entropy over targets != -100)
    plus ``attention`` (b, t, s): the weights each target position gave the source."""

    attention: Tensor | None = None


torch.export.register_dataclass(Seq2SeqOutput, serialized_type_name="attnlab.Seq2SeqOutput")


class Memory(NamedTuple):
    """What the decoder reads at every step: the encoder states and their padding."""

    states: Tensor  # (b, s, 2H) keys and values
    projected: Tensor  # (b, s, d_a) W_k h, computed once
    mask: Tensor  # (b, s) True at real source tokens

    def index(self, rows: Tensor) -> Memory:
        return Memory(*(x.index_select(0, rows) for x in self))


class GRUSeq2Seq(nn.Module):
    """Bahdanau et al.'s GRU encoder-decoder: a bidirectional GRU encoder, a GRU decoder
    whose previous state queries the source through additive attention; teacher forcing in
    ``forward``, greedy and beam decoding in ``generate``."""

    def __init__(self, cfg: RNNSeq2SeqConfig) -> None:
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        H, E, L = cfg.hidden_dim, cfg.embed_dim, cfg.n_layers
        self.src_embed = nn.Embedding(cfg.src_vocab_size, E, padding_idx=cfg.pad_id)
        self.tgt_embed = nn.Embedding(cfg.tgt_vocab_size, E, padding_idx=cfg.pad_id)
        rnn_dropout = cfg.dropout if L > 1 else 0.0  # GRU applies it between layers only
        self.encoder = nn.GRU(
            E, H, num_layers=L, batch_first=True, bidirectional=True, dropout=rnn_dropout
        )
        self.init_state = Linear(2 * H, H)
        self.attention = AdditiveAttention(H, 2 * H, cfg.attention_dim or H)
        self.decoder = nn.GRU(E + 2 * H, H, num_layers=L, batch_first=True, dropout=rnn_dropout)
        self.out = Linear(H + 2 * H, cfg.tgt_vocab_size)
        self.dropout = nn.Dropout(cfg.dropout)

    # ------------------------------------------------------------------ encoder

    def encode(self, src: Tensor, src_mask: Tensor | None = None) -> tuple[Memory, Tensor]:
        """src (b, s) ids, src_mask (b, s) True (or 1) at real tokens (a prefix of each row)
        -> (memory, initial decoder state (L, b, H))."""
        b, s = check_ids("src", src)
        check_padding_mask("src_mask", src_mask, b, s, one_row=False)
        if src_mask is None:
            src_mask = torch.ones_like(src, dtype=torch.bool)
        # keep/drop, whatever its dtype: a float 0/1 mask (which the Transformer
        # encoder-decoder takes too) gave the packed encoder these lengths but reached the
        # additive attention as an additive mask (+1 on real keys), attending to the padding
        src_mask = src_mask.bool()
        lengths = src_mask.sum(dim=1)
        if bool((lengths == 0).any()):
            raise ValueError("every source sequence needs at least one real token")
        if not bool((src_mask[:, 1:] <= src_mask[:, :-1]).all()):
            # packing reads the first `length` tokens: left padding would be encoded as tokens
            raise ValueError(
                "src_mask must mark a prefix of each row (pad on the right, not the left)"
            )
        x = self.dropout(self.src_embed(src))  # (b, s, E)
        packed = pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
        states, last = self.encoder(packed)  # last: (L * 2, b, H), per row's real end
        states, _ = pad_packed_sequence(states, batch_first=True, total_length=src.shape[1])
        b, L, H = src.shape[0], self.cfg.n_layers, self.cfg.hidden_dim
        last = last.view(L, 2, b, H).permute(0, 2, 1, 3).reshape(L, b, 2 * H)  # [fwd; bwd]
        hidden = torch.tanh(self.init_state(last))  # (L, b, H)
        memory = Memory(states, self.attention.project_keys(states), src_mask)
        return memory, hidden

    # ------------------------------------------------------------------ decoder

    def step(self, tokens: Tensor, hidden: Tensor, memory: Memory) -> tuple[Tensor, Tensor, Tensor]:
        """One decoder step: previous tokens (b,), state (L, b, H) -> logits (b, V),
        new state, attention weights (b, s)."""
        features, hidden, weights = self._recur(self.tgt_embed(tokens), hidden, memory)
        return self.out(features), hidden, weights

    def _recur(
        self, embedded: Tensor, hidden: Tensor, memory: Memory
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The recurrent part of a step: embedded previous tokens (b, E), state (L, b, H) ->
        the output layer's input dropout([s_t; c_t]) (b, 3H), new state, weights (b, s)."""
        query = hidden[-1]  # (b, H): the top layer's previous state
        context, weights = self.attention(
            query, memory.states, memory.states, mask=memory.mask, projected_keys=memory.projected
        )  # (b, 2H), (b, s)
        x = torch.cat([self.dropout(embedded), context], dim=-1)  # (b, E + 2H)
        output, hidden = self.decoder(x[:, None], hidden)  # (b, 1, H), (L, b, H)
        return self.dropout(torch.cat([output[:, 0], context], dim=-1)), hidden, weights

    def forward(
        self,
        src: Tensor,
        src_mask: Tensor | None = None,
        tgt: Tensor | None = None,
        targets: Tensor | None = None,
        *,
        tgt_mask: Tensor | None = None,
    ) -> Seq2SeqOutput:
        """Teacher forcing. tgt (b, t) = BOS y_1 .. y_{t-1} (the decoder's inputs); targets
        (b, t) = y_1 .. EOS with -100 where there is nothing to predict (padding). Positional
        ``model(src, src_mask, tgt, targets)``, or the keywords the Transformer
        encoder-decoder takes: ``model(src, tgt=..., src_mask=..., tgt_mask=...,
        targets=...)``. ``tgt_mask`` is unused here: the loss already skips the padded
        targets, and the GRU keeps no per-position statistics (the Transformer's MoE does)."""
        if tgt is None:
            raise ValueError("the decoder inputs tgt (b, t) are needed")
        b, t = check_ids("tgt", tgt)
        if src.dim() == 2 and src.shape[0] != b:
            raise ValueError(f"src has {src.shape[0]} rows but tgt {b}; give one target per source")
        if targets is not None:
            targets = check_targets("targets", targets, (b, t), "(b, t) like tgt")
        memory, hidden = self.encode(src, src_mask)
        # Only the recurrence runs step by step: the embedding and the output layer, which
        # no step feeds back, take every position at once (one product, and one gradient
        # each, instead of t). Dropout is still drawn step by step, in :meth:`step`'s order.
        embedded = self.tgt_embed(tgt)  # (b, t, E)
        features, weights = [], []
        for i in range(t):
            step_features, hidden, step_weights = self._recur(embedded[:, i], hidden, memory)
            features.append(step_features)
            weights.append(step_weights)
        logits_bt = self.out(torch.stack(features, dim=1))  # (b, t, V)
        loss = None
        if targets is not None:
            # in float32 (float64 kept), as every model's loss: a float16 loss sums past 65504
            loss = F.cross_entropy(
                softmax_dtype(logits_bt.flatten(0, 1)), targets.flatten(), ignore_index=IGNORE_INDEX
            )
        return Seq2SeqOutput(logits_bt, loss, attention=torch.stack(weights, dim=1))

    @torch.no_grad()
    def sequence_log_prob(self, src: Tensor, src_mask: Tensor | None, tokens: list[int]) -> float:
        """log p(tokens | src) of one source row by teacher forcing (tokens without BOS)."""
        dev = src.device
        tgt_in = torch.tensor([[self.cfg.bos_id, *tokens[:-1]]], device=dev)
        out = self(src, src_mask, tgt_in)
        log_probs = out.logits.double().log_softmax(-1)[0]  # (t, V)
        picked = log_probs.gather(1, torch.tensor(tokens, device=dev)[:, None])  # (t, 1)
        return float(picked.sum())

    # ------------------------------------------------------------------ decoding

    @torch.no_grad()
    def greedy(
        self, src: Tensor, src_mask: Tensor | None = None, *, max_len: int = 50
    ) -> list[Hypothesis]:
        """The most probable next token at every step, for each row; stops at EOS."""
        check_beam_search(1, max_len, 1, 0.0, "gnmt")
        memory, hidden = self.encode(src, src_mask)
        b, dev = src.shape[0], src.device
        # on the source's device: CPU tensors failed beside a GPU model's states
        tokens = torch.full((b,), self.cfg.bos_id, dtype=torch.long, device=dev)
        log_prob = torch.zeros(b, dtype=torch.float64, device=dev)
        done = torch.zeros(b, dtype=torch.bool, device=dev)
        out: list[list[int]] = [[] for _ in range(b)]
        stopped = [False] * b  # ``done`` on the host, kept from the tokens read
        for _ in range(max_len):
            logits, hidden, _ = self.step(tokens, hidden, memory)
            log_probs = logits.double().log_softmax(-1)  # (b, V)
            tokens = log_probs.argmax(-1)  # (b,)
            log_prob += torch.where(done, 0.0, log_probs.gather(1, tokens[:, None])[:, 0])
            # the tokens, read once per step (not once per row): the one host read
            for row, token in enumerate(tokens.tolist()):
                if not stopped[row]:
                    out[row].append(token)
                    stopped[row] = token == self.cfg.eos_id
            done |= tokens == self.cfg.eos_id
            if all(stopped):
                break
        return [
            Hypothesis(seq, score=lp, log_prob=lp, finished=bool(d))
            for seq, lp, d in zip(out, log_prob.tolist(), done.tolist())
        ]

    @torch.no_grad()
    def generate(
        self,
        src: Tensor,
        max_new_tokens: int = 32,
        *,
        src_mask: Tensor | None = None,
        num_beams: int = 1,
        length_penalty: float = 0.0,
        n_best: int = 1,
        style: str = "gnmt",
        early_stopping: bool | str = True,
        **options,
    ) -> list[list[int]] | list[list[list[int]]]:
        """The Transformer encoder-decoder's decoding interface: the new tokens of each row
        (EOS not included), greedy or beam search; with ``n_best`` > 1 the n best per row
        (``early_stopping``: :func:`attnlab.generation.beam_search_core`, with
        ``style='transformers'``). The language models' sampling and stop options are
        refused by name."""
        refuse_options("GRUSeq2Seq.generate", options)
        check_decoding(max_new_tokens, num_beams, n_best)
        if max_new_tokens == 0:  # no new tokens, as a language model's generate
            return [[] if n_best == 1 else [[]] for _ in range(src.shape[0])]
        modes = enter_eval(self)
        try:
            if num_beams == 1 and n_best == 1:
                hyps = [[h] for h in self.greedy(src, src_mask, max_len=max_new_tokens)]
            else:
                hyps = self.beam_search(
                    src,
                    src_mask,
                    beam_width=num_beams,
                    max_len=max_new_tokens,
                    length_penalty=length_penalty,
                    n_best=n_best,
                    style=style,
                    early_stopping=early_stopping,
                )
        finally:
            restore(modes)
        rows = [[h.tokens[:-1] if h.finished else h.tokens for h in row] for row in hyps]
        return [row[0] for row in rows] if n_best == 1 else rows

    def num_parameters(self) -> int:
        """Number of trainable values (tied tensors counted once)."""
        return sum(p.numel() for p in self.parameters())

    @torch.no_grad()
    def beam_search(
        self,
        src: Tensor,
        src_mask: Tensor | None = None,
        *,
        beam_width: int = 4,
        max_len: int = 50,
        length_penalty: float = 0.0,
        n_best: int = 1,
        style: str = "gnmt",
        early_stopping: bool | str = True,
    ) -> list[list[Hypothesis]]:
        """For each source row, its ``n_best`` hypotheses, best first: the shared beam
        search (:func:`attnlab.generation.beam_search_core`), GNMT scoring by default.
        Here a hypothesis' tokens end with EOS when it finished (as :meth:`greedy`'s do);
        ``max_len`` counts that EOS."""
        check_beam_search(beam_width, max_len, n_best, length_penalty, style, early_stopping)
        memory, hidden = self.encode(src, src_mask)
        start = torch.full((src.shape[0],), self.cfg.bos_id, dtype=torch.long, device=src.device)
        logits, hidden, _ = self.step(start, hidden, memory)
        state = {"hidden": hidden, "memory": memory}

        def advance(source: Tensor, tokens: Tensor) -> Tensor:
            hidden = state["hidden"].index_select(1, source)  # (L, n, H): row j continues source[j]
            # The beams of a source come from its own beams (beam_search_core), so their
            # memory, copies of the source's, only needs gathering when the number of beams
            # changes (1 -> k at the first step; over the first few on a vocabulary smaller
            # than k).
            if source.shape[0] != state["memory"].states.shape[0]:
                state["memory"] = state["memory"].index(source)
            logits, state["hidden"], _ = self.step(tokens, hidden, state["memory"])
            return logits

        results = beam_search_core(
            logits,
            advance,
            num_beams=beam_width,
            max_new_tokens=max_len,
            eos_id=self.cfg.eos_id,
            length_penalty=length_penalty,
            n_best=n_best,
            style=style,
            early_stopping=early_stopping,
        )
        eos = [self.cfg.eos_id]
        return [[h._replace(tokens=h.tokens + eos * h.finished) for h in row] for row in results]


register_model("gru-seq2seq")(GRUSeq2Seq)
