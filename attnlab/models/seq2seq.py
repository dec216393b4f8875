"""Encoder–decoder transformer (Vaswani et al. 2017; MarianMT and T5 are presets of it).

    m   = Encoder(sqrt(d) E_src[src] + P[0..s))             bidirectional, padding masked
    h_l = Block_l(h_{l-1}, m)                               masked self-attn, cross-attn to m, FFN
    logits = W_out h_L (+ b)                                W_out tied to E_tgt or separate

BART (Lewis et al. 2020) and mBART learn P (``position.kind`` learned, its rows read from
``position_offset`` on: transformers' offset of 2) and normalise the embedded tokens before the
first block (``embedding_norm``); mBART's blocks are pre-norm, with a final norm per stack.

M2M100 and NLLB (fairseq's) count sinusoidal positions past the padding id from the token ids
(``position.padding_idx``: a row's first real token is at padding_idx + 1, padding adds a
zero vector), with tensor2tensor's frequencies (``sinusoid_layout``); Pegasus adds Marian's
split sinusoids to pre-norm blocks with a final norm per stack.

T5 (Raffel et al. 2020) has no P: each stack's self-attention scores get a learned bias by
relative position (``position.kind`` relative_bias, ``nn/position_bias.py``), and its tied
head reads d^-1/2 h_L (``scale_decoder_output``).

Decoding (greedy or beam search) encodes the source once; cross-attention keys/values are
projected from it once (``CrossKV`` entries of the cache) and the decoder's self-attention
keys/values are cached.

Shapes: b batch, s source length, t target length, d d_model, V vocabulary size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.cache import Cache
from attnlab.config import (
    AttentionConfig,
    FFNConfig,
    ModelConfig,
    NormConfig,
    PositionConfig,
    _choice,
    _fail,
    _positive,
    register_model_config,
)
from attnlab.functional.masks import padding_mask
from attnlab.functional.softmax import softmax_dtype
from attnlab.models.build import register_model
from attnlab.models.inputs import check_ids, check_padding_mask, check_targets
from attnlab.models.loadable import LoadableModel
from attnlab.models.outputs import ModelOutput, aux_modules, finish_loss
from attnlab.nn.block import TransformerStack
from attnlab.nn.embedding import (
    LearnedPositionalEmbedding,
    sinusoidal_table,
    tensor2tensor_table,
)
from attnlab.nn.linear import Linear
from attnlab.nn.modes import enter_eval, restore
from attnlab.nn.norm import build_norm
from attnlab.nn.position_bias import build_position_bias

SINUSOID_LAYOUTS = ("interleaved", "split", "tensor2tensor")


@dataclass
class Seq2SeqConfig(ModelConfig):
    """Encoder–decoder. Defaults: the original Transformer (sinusoidal positions, post-norm,
    ReLU MLP, biases, scaled embeddings, one vocabulary shared by source and target).

    ``n_layers`` counts encoder layers, ``n_decoder_layers`` decoder layers (None: the
    same). ``sinusoid_layout``: ``interleaved`` (sin, cos pairs: Vaswani) or ``split``
    (all sines then all cosines: transformers' Marian and Pegasus) or ``tensor2tensor`` (all
    sines then all cosines, frequencies 10000^(-j/(d/2 - 1)): fairseq's, transformers'
    M2M100/NLLB). ``position.padding_idx`` (sinusoidal positions only, equal to ``pad_id``):
    positions counted from the token ids past the padding id, as M2M100's: a token's position
    is padding_idx + 1 + the number of non-padding tokens before it in its row (under a cache:
    those of this step plus the cached length, as transformers counts), a padding token adds a
    zero vector, and the padding token's embedding is not trained (transformers'
    ``padding_idx``). ``final_norm``: a norm after each stack
    (None: for pre-norm only; torch.nn.Transformer has one for post-norm too).
    ``blocked_ids``: tokens decoding never emits (Marian's ``bad_words_ids``: its pad
    token); ``renormalize_logits``: beam search renormalizes the log-probabilities once
    they are blocked (transformers' option of that name), else it scores with the
    unblocked softmax's. ``forced_eos_ids``: at the last step ``generate`` allows (greedy, beam
    search) only these tokens (transformers' ``forced_eos_token_id``: Marian's end token), so a
    length-limited output ends with one (its log-probability then counted as 0, as there).
    ``scale_decoder_output``: the head reads the decoder's output times d_model^-1/2 (T5 with
    tied embeddings: transformers' ``scale_decoder_outputs``). ``embedding_norm``: a norm
    (``norm``'s kind) on each stack's embedded tokens, positions added, before the first block
    (BART's ``layernorm_embedding``). ``position_offset``: learned position tables have
    ``max_seq_len + position_offset`` rows and position p reads row p + position_offset (BART's
    2; the rows below are never read). ``forced_bos_id``: the only token ``generate`` allows at
    the first step (transformers' ``forced_bos_token_id``: BART's bos after its start token),
    its log-probability counted as 0."""

    arch: str = "seq2seq"
    attention: AttentionConfig = field(
        default_factory=lambda: AttentionConfig(qkv_bias=True, out_bias=True)
    )
    position: PositionConfig = field(default_factory=lambda: PositionConfig(kind="sinusoidal"))
    ffn: FFNConfig = field(default_factory=lambda: FFNConfig(activation="relu"))
    norm: NormConfig = field(default_factory=lambda: NormConfig(placement="post"))
    n_decoder_layers: int | None = None
    src_vocab_size: int | None = None  # None: vocab_size
    share_embeddings: bool = True  # source and target use one embedding table
    scale_embeddings: bool = True  # (ModelConfig's field; on by default here, as Vaswani et al.)
    sinusoid_layout: str = "interleaved"
    final_norm: bool | None = None
    label_smoothing: float = 0.0
    pad_id: int = 0
    bos_id: int = 1  # the decoder's start token
    eos_id: int = 2
    blocked_ids: list[int] = field(default_factory=list)
    renormalize_logits: bool = False
    forced_eos_ids: list[int] = field(default_factory=list)
    scale_decoder_output: bool = False
    position_offset: int = 0
    forced_bos_id: int | None = None

    def validate(self, path: str = "") -> None:
        super().validate(path)
        at = (lambda name: f"{path}.{name}") if path else (lambda name: name)
        _positive(at("n_decoder_layers"), self.n_decoder_layers)
        _positive(at("src_vocab_size"), self.src_vocab_size)
        _choice(at("sinusoid_layout"), self.sinusoid_layout, SINUSOID_LAYOUTS)
        kinds = ("sinusoidal", "learned", "none", "relative_bias")
        _choice(at("position.kind"), self.position.kind, kinds)
        if self.attention.kind != "mha":
            _fail(at("attention.kind"), "encoder–decoder models use 'mha' attention")
        if self.share_embeddings and self.src_vocab_size not in (None, self.vocab_size):
            _fail(
                at("share_embeddings"),
                "shared embeddings need src_vocab_size == vocab_size (or null)",
            )
        if not 0.0 <= self.label_smoothing < 1.0:
            _fail(at("label_smoothing"), f"must be in [0, 1), got {self.label_smoothing}")
        for name in ("pad_id", "bos_id", "eos_id"):
            value = getattr(self, name)
            if not 0 <= value < self.vocab_size:
                _fail(at(name), f"must be a token id in [0, {self.vocab_size}), got {value}")
        for name in ("blocked_ids", "forced_eos_ids"):
            for value in getattr(self, name):
                if not 0 <= value < self.vocab_size:
                    _fail(at(name), f"must hold token ids in [0, {self.vocab_size}), got {value}")
        if self.forced_bos_id is not None and not 0 <= self.forced_bos_id < self.vocab_size:
            _fail(
                at("forced_bos_id"),
                f"must be a token id in [0, {self.vocab_size}), got {self.forced_bos_id}",
            )
        if self.position_offset < 0:
            _fail(at("position_offset"), f"must be >= 0, got {self.position_offset}")
        if self.position_offset and self.position.kind != "learned":
            _fail(
                at("position_offset"),
                f"offsets learned position tables; position.kind is {self.position.kind!r} "
                "(set position_offset to 0)",
            )
        pad = self.position.padding_idx
        if pad is not None and self.position.kind != "sinusoidal":
            _fail(at("position.padding_idx"), "counts sinusoidal positions in an encoder–"
                  f"decoder (M2M100's); position.kind is {self.position.kind!r} (set it to "
                  "null)")  # fmt: skip
        if pad is not None and pad != self.pad_id:
            _fail(at("position.padding_idx"), f"{pad} must be the padding token, pad_id="
                  f"{self.pad_id} (positions are counted past it)")  # fmt: skip
        if pad is not None and pad >= self.source_vocab_size:
            _fail(at("position.padding_idx"), f"{pad} must be a source token (below "
                  f"src_vocab_size={self.source_vocab_size})")  # fmt: skip
        if self.eos_id in self.blocked_ids:
            _fail(at("blocked_ids"), f"holds eos_id={self.eos_id}: decoding could never end")

    @property
    def decoder_layers(self) -> int:
        """Decoder depth: ``n_decoder_layers``, else ``n_layers``."""
        return self.n_decoder_layers or self.n_layers

    @property
    def source_vocab_size(self) -> int:
        """Source vocabulary: ``src_vocab_size``, else the shared ``vocab_size``."""
        return self.src_vocab_size or self.vocab_size


register_model_config("seq2seq", Seq2SeqConfig)


class Seq2SeqModel(LoadableModel):
    """``model(src, tgt, src_mask=..., targets=...)`` -> :class:`ModelOutput` with logits
    (b, t, V); ``encode``/``decode`` run the halves; ``generate`` decodes greedily or with
    beams."""

    def __init__(self, cfg: Seq2SeqConfig):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        d = cfg.d_model
        # M2M100: the padding token's embedding is not trained (position.padding_idx)
        pad = cfg.position.padding_idx
        self.src_emb = nn.Embedding(cfg.source_vocab_size, d, padding_idx=pad)
        self.tgt_emb = self.src_emb
        if not cfg.share_embeddings:
            self.tgt_emb = nn.Embedding(cfg.vocab_size, d, padding_idx=pad)
        self.src_pos = self.tgt_pos = None
        if cfg.position.kind == "learned":
            rows = cfg.max_seq_len + cfg.position_offset
            self.src_pos = LearnedPositionalEmbedding(rows, d)
            self.tgt_pos = LearnedPositionalEmbedding(rows, d)
        # a bias on the self-attention scores, one per stack (T5's relative position bias)
        self.src_pos_bias = build_position_bias(
            cfg.position, cfg.n_heads, bidirectional=True, n_layers=cfg.n_layers
        )
        self.tgt_pos_bias = build_position_bias(
            cfg.position, cfg.n_heads, bidirectional=False, n_layers=cfg.decoder_layers
        )
        self.emb_scale = d**0.5 if cfg.scale_embeddings else 1.0
        # a norm on each stack's embeddings (BART's layernorm_embedding)
        self.src_emb_norm = build_norm(cfg.norm, d) if cfg.embedding_norm else nn.Identity()
        self.tgt_emb_norm = build_norm(cfg.norm, d) if cfg.embedding_norm else nn.Identity()
        self.drop = nn.Dropout(cfg.dropout)
        self.encoder = TransformerStack(cfg, cfg.n_layers, causal=False)
        self.decoder = TransformerStack(cfg, cfg.decoder_layers, causal=True, cross_attention=True)
        final = cfg.final_norm if cfg.final_norm is not None else cfg.norm.placement == "pre"
        self.enc_norm = build_norm(cfg.norm, d) if final else nn.Identity()
        self.dec_norm = build_norm(cfg.norm, d) if final else nn.Identity()
        self.lm_head = Linear(d, cfg.vocab_size, bias=False)
        self.logits_bias = (
            nn.Parameter(torch.zeros(cfg.vocab_size)) if cfg.final_logits_bias else None
        )
        self.apply(self._init_weights)
        self.tie_weights()
        self._aux = aux_modules(self)  # MoE balance losses (outputs.py)

    def tied_parameters(self) -> dict[str, str]:
        """With ``share_embeddings`` the target embedding is the source's (one module);
        with ``tie_embeddings`` the head is the target embedding."""
        tied = {"tgt_emb.weight": "src_emb.weight"} if self.cfg.share_embeddings else {}
        if self.cfg.tie_embeddings:
            tied["lm_head.weight"] = "tgt_emb.weight"
        return tied

    def _init_weights(self, m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=self.cfg.init_std)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
            if getattr(m, "padding_idx", None) is not None:  # padding's row starts at 0
                with torch.no_grad():
                    m.weight[m.padding_idx].zero_()
        elif hasattr(m, "init_weights"):  # modules with raw parameters (MoE experts, router)
            m.init_weights(self.cfg.init_std)

    def _embed(
        self,
        ids: Tensor,
        emb: nn.Embedding,
        pos: nn.Module | None,
        positions: Tensor,
        norm: nn.Module | None = None,
    ):
        """Token ids (b, t) -> embedded inputs (b, t, d): scaled embeddings plus positions,
        then ``norm`` (a stack's embedding norm) where given, then dropout."""
        x = emb(ids) * self.emb_scale  # (b, t, d)
        if self.cfg.position.kind == "sinusoidal":
            # (.., t, d); float64 in a float64 model
            if self.cfg.sinusoid_layout == "tensor2tensor":
                table = tensor2tensor_table(positions, self.cfg.d_model, x.dtype)
            else:
                table = sinusoidal_table(positions, self.cfg.d_model, x.dtype)  # interleaved
                if self.cfg.sinusoid_layout == "split":  # [sin..., cos...]
                    table = torch.cat((table[..., 0::2], table[..., 1::2]), dim=-1)
            pad = self.cfg.position.padding_idx
            if pad is not None:  # padding adds nothing (its table row is zero)
                table = table * ids.ne(pad)[..., None]
            x = x + table.to(x.dtype)
        elif pos is not None:
            x = x + pos(positions + self.cfg.position_offset)
        return self.drop(norm(x) if norm is not None else x)

    def _counted_positions(self, ids: Tensor, past: int) -> Tensor:
        """M2M100's positions (``position.padding_idx``) of ids (b, t) after ``past`` cached
        tokens: (b, t) padding_idx + past + the count of non-padding tokens up to each one
        in ``ids``, padding_idx at padding (transformers' create_position_ids_from_input_ids)."""
        pad = self.cfg.position.padding_idx
        real = ids.ne(pad).long()  # (b, t)
        return (real.cumsum(dim=-1) + past) * real + pad

    def _check_length(self, n: int) -> None:
        if self.cfg.position.kind == "learned" and n > self.cfg.max_seq_len:
            raise ValueError(f"{n} tokens exceed max_seq_len={self.cfg.max_seq_len}; crop them")

    def encode(self, src: Tensor, src_mask: Tensor | None = None) -> Tensor:
        """src (b, s) -> memory (b, s, d). ``src_mask`` (b, s): 1 real, 0 padding."""
        b, s = check_ids("src", src)
        check_padding_mask("src_mask", src_mask, b, s)
        self._check_length(s)
        positions = torch.arange(src.shape[1], device=src.device)[None, :]
        counted = self.cfg.position.padding_idx is not None
        at = self._counted_positions(src, 0) if counted else positions
        x = self._embed(src, self.src_emb, self.src_pos, at, self.src_emb_norm)
        mask = real = None
        if src_mask is not None:
            mask = padding_mask(src_mask)  # (b, 1, 1, s)
            real = src_mask.bool().expand(b, s)  # MoE statistics skip the padding
        bias = self.src_pos_bias(positions, positions) if self.src_pos_bias is not None else None
        return self.enc_norm(self.encoder(x, mask=mask, real_tokens=real, bias=bias))

    def decode(
        self,
        tgt: Tensor,
        memory: Tensor | None,
        src_mask: Tensor | None = None,
        *,
        cache: Cache | None = None,
        tgt_mask: Tensor | None = None,
    ) -> Tensor:
        """tgt (b, t) decoder inputs (starting with bos_id) -> hidden states (b, t, d).
        Under a cache, ``tgt`` continues the cached tokens and ``memory`` is needed on the
        first step only (its keys/values are kept). ``tgt_mask`` (b, t): 1 real, 0 padding
        after the end; causal attention never reads it from a real position, so the mask
        only keeps the padding out of the MoE statistics and balance loss."""
        b, t = check_ids("tgt", tgt)
        check_padding_mask("tgt_mask", tgt_mask, b, t)
        context_mask = padding_mask(src_mask) if src_mask is not None else None
        past = 0
        if cache is not None:
            past = cache.length
            n = cache.length + t  # before begin(): a Python int, no host read per step
            step = cache.begin(t)
            positions = step.positions
            self._check_length(n)
            held = cache.key_positions()  # (b, s) every key held, this step's included
            key_positions = held if held is not None else cache.slot_pos[:, : step.end]
        else:  # no host read (a graph break in compiled training)
            positions = key_positions = torch.arange(t, device=tgt.device)[None, :]
            self._check_length(t)
        counted = self.cfg.position.padding_idx is not None
        at = self._counted_positions(tgt, past) if counted else positions
        x = self._embed(tgt, self.tgt_emb, self.tgt_pos, at, self.tgt_emb_norm)
        real = tgt_mask.bool().expand(b, t) if tgt_mask is not None else None
        # the query's true position against every key's (a cached step: all those held)
        bias = (
            self.tgt_pos_bias(positions, key_positions) if self.tgt_pos_bias is not None else None
        )
        x = self.decoder(
            x, cache=cache, context=memory, context_mask=context_mask, real_tokens=real, bias=bias
        )
        if cache is not None:
            cache.commit()
        return self.dec_norm(x)

    def logits(self, h: Tensor) -> Tensor:
        """Decoder hidden states (b, t, d) -> next-token logits (b, t, V), with the final
        logits bias where the model has one (Marian), of d^-1/2 h where the config says
        (``scale_decoder_output``: T5's tied head)."""
        if self.cfg.scale_decoder_output:
            h = h * self.cfg.d_model**-0.5
        out = self.lm_head(h)  # (b, t, V)
        return out + self.logits_bias if self.logits_bias is not None else out

    def forward(
        self,
        src: Tensor,
        tgt: Tensor,
        *,
        src_mask: Tensor | None = None,
        tgt_mask: Tensor | None = None,
        targets: Tensor | None = None,
    ) -> ModelOutput:
        """src (b, s); tgt (b, t) decoder inputs; ``targets`` (b, t) the next target token
        at each position (-100 ignored): cross-entropy with ``cfg.label_smoothing``.
        ``src_mask`` (b, s) and ``tgt_mask`` (b, t): 1 real, 0 padding (see :meth:`decode`)."""
        b, t = check_ids("tgt", tgt)
        if src.dim() == 2 and src.shape[0] != b:
            raise ValueError(f"src has {src.shape[0]} rows but tgt {b}; give one target per source")
        if targets is not None:
            targets = check_targets("targets", targets, (b, t), "(b, t) like tgt")
        memory = self.encode(src, src_mask)
        logits = self.logits(self.decode(tgt, memory, src_mask, tgt_mask=tgt_mask))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(
                softmax_dtype(logits.flatten(0, 1)),
                targets.flatten(),
                ignore_index=-100,
                label_smoothing=self.cfg.label_smoothing,
            )
        return ModelOutput(logits, *finish_loss(self._aux, loss, self.training))

    def new_cache(self, batch: int, max_len: int | None = None) -> Cache:
        """Decoder self-attention keys/values and, per layer, the cross-attention
        keys/values of the source (computed on the first step)."""
        p = self.tgt_emb.weight
        cache = Cache(batch, max_len or self.cfg.max_seq_len, dtype=p.dtype, device=p.device)
        return self.decoder.add_cache_entries(cache)

    @torch.inference_mode()
    def generate(
        self,
        src: Tensor,
        max_new_tokens: int = 32,
        *,
        src_mask: Tensor | None = None,
        num_beams: int = 1,
        length_penalty: float = 1.0,
        n_best: int = 1,
        use_cache: bool = True,
        style: str = "transformers",
        early_stopping: bool | str = True,
        **options,
    ) -> list[list[int]] | list[list[list[int]]]:
        """Translate each row of ``src`` (b, s): greedy (``num_beams`` 1) or beam search.
        Returns the new tokens of each row (``eos_id`` not included), or with ``n_best`` > 1
        a list of the n best per row, best first. See :func:`beam_search_core` for the
        scoring (``style``: that of transformers' ``generate(early_stopping=...)``, True
        by default, or GNMT's). Tokens of ``cfg.blocked_ids`` are never generated. The
        language models' sampling and stop options are refused by name (decoding ends at
        ``cfg.eos_id``)."""
        from attnlab.generation import beam_search_core, check_decoding, refuse_options

        refuse_options("Seq2SeqModel.generate", options)
        check_decoding(max_new_tokens, num_beams, n_best)
        if num_beams > 1 and not use_cache:
            raise ValueError(
                f"beam search (num_beams={num_beams}) is deterministic and cached; drop "
                "use_cache=False"
            )
        if max_new_tokens == 0:  # no new tokens, as a language model's generate
            return [[] if n_best == 1 else [[]] for _ in range(src.shape[0])]
        modes = enter_eval(self)
        try:
            b, eos = src.shape[0], self.cfg.eos_id
            memory = self.encode(src, src_mask)  # once per source
            start = torch.full((b, 1), self.cfg.bos_id, dtype=torch.long, device=src.device)
            if num_beams == 1 and n_best == 1:
                return self._greedy(start, memory, src_mask, max_new_tokens, use_cache)
            cache = self.new_cache(b, max_new_tokens + 1)
            # a (1, s) mask (encode takes one for every row) is reordered per beam row
            state = {"mask": None if src_mask is None else src_mask.expand(b, -1)}

            def advance(source: Tensor, tokens: Tensor) -> Tensor:
                # The beams of a source come from its own beams (beam_search_core), so
                # their cross keys/values and source mask, copies of the source's, only
                # need gathering when the number of beams changes (1 -> k at the first
                # step; over the first few on a vocabulary smaller than k).
                regroup = source.shape[0] != cache.batch
                cache.reorder(source, cross=regroup)
                if state["mask"] is not None and regroup:
                    state["mask"] = state["mask"].index_select(0, source)
                return self.logits(self.decode(tokens[:, None], None, state["mask"], cache=cache))[
                    :, -1
                ]

            first = self.logits(self.decode(start, memory, src_mask, cache=cache))[:, -1]
            hyps = beam_search_core(
                first,
                advance,
                num_beams=num_beams,
                max_new_tokens=max_new_tokens,
                eos_id=eos,
                length_penalty=length_penalty,
                n_best=n_best,
                style=style,
                early_stopping=early_stopping,
                blocked_ids=self.cfg.blocked_ids,
                renormalize=self.cfg.renormalize_logits,
                forced_last_ids=self.cfg.forced_eos_ids,
                forced_first_ids=self._forced_first(),
            )
        finally:
            restore(modes)
        if n_best == 1:
            return [row[0].tokens for row in hyps]
        return [[h.tokens for h in row] for row in hyps]

    def _forced_first(self) -> list[int]:
        return [] if self.cfg.forced_bos_id is None else [self.cfg.forced_bos_id]

    def _greedy(self, start, memory, src_mask, max_new_tokens, use_cache) -> list[list[int]]:
        from attnlab.generation import block_tokens, force_tokens

        b, eos = start.shape[0], self.cfg.eos_id
        cache = self.new_cache(b, max_new_tokens + 1) if use_cache else None
        seq, stopped = start, [False] * b
        rows: list[list[int]] = [[] for _ in range(b)]
        step_in, mem = start, memory
        for step in range(max_new_tokens):
            if cache is None:
                h = self.decode(seq, memory, src_mask)
            else:
                h = self.decode(step_in, mem, src_mask, cache=cache)
                mem = None  # cross keys/values are cached
            scores = block_tokens(self.logits(h[:, -1]), self.cfg.blocked_ids)  # (b, V)
            if step == 0:
                scores = force_tokens(scores, self._forced_first())
            if step == max_new_tokens - 1:
                scores = force_tokens(scores, self.cfg.forced_eos_ids)
            nxt = scores.argmax(-1)  # (b,)
            # the one host read per step (the loop needs it to stop); which rows have
            # stopped is kept here, on the host
            for i, token in enumerate(nxt.tolist()):
                if not stopped[i]:
                    stopped[i] = token == eos
                    if not stopped[i]:
                        rows[i].append(token)
            if all(stopped):
                break
            if cache is None:  # the whole sequence again (with a cache: only the new token)
                seq = torch.cat((seq, nxt[:, None]), dim=1)
            step_in = nxt[:, None]
        return rows


register_model("seq2seq")(Seq2SeqModel)
