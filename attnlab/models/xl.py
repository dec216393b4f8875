"""Transformer-XL language model (Dai et al. 2019): relative positional attention
(:mod:`attnlab.nn.relative`) and segment-level recurrence.

    h_0 = E[idx]
    m_l = the last mem_len inputs of layer l from earlier segments (no gradient)
    h_l = Block_l(h_{l-1}, memory = m_l)      keys/values over [m_l; h_{l-1}]
    logits = W_out norm(h_L)

``model(idx, memory=mem)`` returns :class:`XLOutput` with ``memory`` for the next segment,
so a stream is read segment by segment with a context of up to mem_len + t tokens per
layer (and, through the layers, up to n_layers x mem_len). Without ``memory`` it is a
causal LM over the segment alone: the generic trainer trains it so (no memory carry).

The paper evaluates with a longer memory than it trains with (WikiText-103: mem_len 150 in
training, 1600 in evaluation) and two settings of its code: ``clamp_len`` (relative
distances above it use its encoding) and ``same_length`` (every query sees the mem_len most
recent keys, its own included, where otherwise each query of a segment sees one key more
than the one before it).

Shapes: b batch, t segment length, m memory length, d d_model, V vocabulary size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.config import (
    ModelConfig,
    PositionConfig,
    _fail,
    _positive,
    register_model_config,
)
from attnlab.functional.masks import sliding_window_mask
from attnlab.functional.softmax import softmax_dtype
from attnlab.models.build import register_model
from attnlab.models.inputs import check_ids, check_padding_mask, check_targets
from attnlab.models.loadable import LoadableModel
from attnlab.models.outputs import (
    ModelOutput,
    aux_modules,
    finish_loss,
    init_residual_projections,
)
from attnlab.nn.feedforward import build_ffn
from attnlab.nn.linear import Linear
from attnlab.nn.modes import enter_eval, restore
from attnlab.nn.norm import build_norm
from attnlab.nn.relative import RelativeMultiHeadAttention, relative_encodings


@dataclass
class XLConfig(ModelConfig):
    """A Transformer-XL: ``mem_len`` hidden states kept per layer from earlier segments.
    Positions are relative inside attention, so ``position.kind`` must be ``none``.
    ``clamp_len``: relative distances above it use its encoding (None: no clamp);
    ``same_length``: each query attends to the mem_len most recent keys, its own included
    (False: to all of memory and segment up to itself). Both are the original code's
    evaluation settings; with mem_len, ``--set`` of ``attnlab eval`` and ``attnlab generate``
    may change them."""

    EVAL_FIELDS: ClassVar[tuple[str, ...]] = ("mem_len", "clamp_len", "same_length")

    arch: str = "xl"
    position: PositionConfig = field(default_factory=lambda: PositionConfig(kind="none"))
    mem_len: int = 64
    clamp_len: int | None = None
    same_length: bool = False

    def validate(self, path: str = "") -> None:
        super().validate(path)
        at = (lambda name: f"{path}.{name}") if path else (lambda name: name)
        _positive(at("mem_len"), self.mem_len)
        if self.clamp_len is not None and self.clamp_len <= 0:
            _fail(at("clamp_len"), f"must be a positive integer or null (no clamp), got "
                  f"{self.clamp_len}")  # fmt: skip
        if self.d_model % 2:
            _fail(at("d_model"), f"the relative encodings pair sines with cosines; give an even "
                  f"width, got {self.d_model}")  # fmt: skip
        if self.position.kind != "none":
            _fail(
                at("position.kind"),
                f"Transformer-XL encodes relative positions inside attention; set it to "
                f"none, got {self.position.kind!r}",
            )
        if self.attention.kind != "mha":
            _fail(at("attention.kind"), f"Transformer-XL uses its own attention, got "
                  f"{self.attention.kind!r}; leave it at mha")  # fmt: skip
        for name in ("sliding_window", "sink_tokens", "sink_logits", "qk_norm", "scale", "softcap"):
            if getattr(self.attention, name):
                _fail(at(f"attention.{name}"), "does not apply to Transformer-XL")
        if self.attention.backend not in ("eager", "sdpa"):  # (sdpa: the default)
            _fail(at("attention.backend"), f"{self.attention.backend!r} does not apply to "
                  "Transformer-XL, whose relative attention forms its scores itself; leave "
                  "it at sdpa or eager")  # fmt: skip
        if self.attention.kv_heads != self.attention.n_heads:
            _fail(
                at("attention.n_kv_heads"),
                f"Transformer-XL's relative attention has a key/value head per query head; "
                f"leave it unset, got {self.attention.n_kv_heads}",
            )


register_model_config("xl", XLConfig)


def same_length_mask(
    t: int, m: int, mem_len: int, *, device: torch.device | str | None = None
) -> Tensor:
    """(t, m + t) bool, True where query i (key position m + i) may attend key j with
    ``same_length``: the mem_len most recent keys, its own included. It is the original
    code's mask, triu(ones, 1 + m) + tril(ones, -(mem_len - m)) its complement (no tril
    while m + t <= mem_len: then causality alone)."""
    return sliding_window_mask(t, m + t, mem_len, device=device)


@dataclass
class XLOutput(ModelOutput):
    """A model output plus ``memory``: one (b, m, d) tensor per layer for the next segment."""

    memory: list[Tensor] | None = None


torch.export.register_dataclass(XLOutput, serialized_type_name="attnlab.XLOutput")


class XLBlock(nn.Module):
    def __init__(self, cfg: XLConfig, layer: int = 0):
        super().__init__()
        self.pre_norm = cfg.norm.placement == "pre"
        self.attn_norm = build_norm(cfg.norm, cfg.d_model)
        self.attn = RelativeMultiHeadAttention(
            cfg.d_model, cfg.attention, resid_dropout=cfg.dropout
        )
        self.ffn_norm = build_norm(cfg.norm, cfg.d_model)
        self.ffn = build_ffn(cfg.ffn, cfg.d_model, dropout=cfg.dropout, layer=layer)

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None = None,
        mask: Tensor | None = None,
        encodings: Tensor | None = None,
    ) -> Tensor:
        if self.pre_norm:
            mem = None if memory is None else self.attn_norm(memory)
            x = x + self.attn(self.attn_norm(x), memory=mem, mask=mask, encodings=encodings)
            return x + self.ffn(self.ffn_norm(x))
        x = self.attn_norm(x + self.attn(x, memory=memory, mask=mask, encodings=encodings))
        return self.ffn_norm(x + self.ffn(x))


@register_model("xl")
class TransformerXL(LoadableModel):
    """Transformer-XL (Dai et al. 2019): a decoder LM with segment-level recurrence (each
    segment attends to the cached hidden states of the previous ones) and relative
    positional encodings."""

    def __init__(self, cfg: XLConfig):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(XLBlock(cfg, i) for i in range(cfg.n_layers))
        pre = cfg.norm.placement == "pre"
        self.norm = build_norm(cfg.norm, cfg.d_model) if pre else nn.Identity()
        self.lm_head = Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.apply(self._init_weights)
        init_residual_projections(self, cfg.init_std, cfg.n_layers)
        self._aux = aux_modules(self)  # MoE balance losses (outputs.py)

    def tied_parameters(self) -> dict[str, str]:
        """The head is the token embedding when ``tie_embeddings``."""
        return {"lm_head.weight": "tok_emb.weight"} if self.cfg.tie_embeddings else {}

    def _init_weights(self, m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=self.cfg.init_std)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
        elif hasattr(m, "init_weights"):  # modules with raw parameters (MoE experts, router)
            m.init_weights(self.cfg.init_std)

    def num_parameters(self, *, exclude_embeddings: bool = False) -> int:
        """Parameters (tied ones counted once), optionally without the token embedding."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.tok_emb.weight.numel() if exclude_embeddings else n

    def forward(
        self,
        idx: Tensor,
        *,
        memory: list[Tensor] | None = None,
        targets: Tensor | None = None,
        attention_mask: Tensor | None = None,
        last_only: bool = False,
    ) -> XLOutput:
        """idx (b, t); ``memory`` from the previous segment's output (None: none yet);
        ``targets`` (b, t) next tokens (-100 ignored); ``attention_mask`` (b, t) 1 for real
        tokens: padded keys are hidden (the memory's keys are all real)."""
        b, t = check_ids("idx", idx)
        check_padding_mask("attention_mask", attention_mask, b, t)
        if targets is not None:
            targets = check_targets("targets", targets, (b, t), "(b, t) like idx")
        if memory is not None and len(memory) != len(self.blocks):
            raise ValueError(f"memory has {len(memory)} layers, the model {len(self.blocks)}")
        if memory is not None and memory[0].shape[0] != b:
            raise ValueError(f"memory holds {memory[0].shape[0]} rows but idx {b}")
        cfg, m = self.cfg, 0 if memory is None else memory[0].shape[1]
        mask = None
        if attention_mask is not None:
            keys = attention_mask.bool()
            if m:
                keys = torch.cat((keys.new_ones(keys.shape[0], m), keys), dim=1)
            mask = keys[:, None, None, :]  # (b, 1, 1, s)
        if cfg.same_length:
            window = same_length_mask(t, m, cfg.mem_len, device=idx.device)  # (t, s)
            mask = window if mask is None else mask & window  # (b, 1, t, s)
        x = self.drop(self.tok_emb(idx))  # (b, t, d)
        # one (s, d) table of distances s - 1, ..., 0 for every layer (each has its own W_R)
        encodings = relative_encodings(
            m + t, cfg.d_model, clamp_len=cfg.clamp_len, dtype=x.dtype, device=idx.device
        )
        new_memory = []
        for i, block in enumerate(self.blocks):
            mem = None if memory is None else memory[i]
            new_memory.append(self._next_memory(mem, x))
            x = block(x, mem, mask, encodings)
        if last_only:
            x = x[:, -1:]
        logits = self.lm_head(self.norm(x))  # (b, t, V)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(
                softmax_dtype(logits.flatten(0, 1)), targets.flatten(), ignore_index=-100
            )
        loss, aux_loss, metrics = finish_loss(self._aux, loss, self.training)
        return XLOutput(logits, loss, aux_loss, metrics, memory=new_memory)

    def _next_memory(self, memory: Tensor | None, x: Tensor) -> Tensor:
        """The last mem_len of [memory; this layer's input], cut from the graph."""
        h = x if memory is None else torch.cat((memory, x), dim=1)  # (b, m + t, d)
        return h[:, -self.cfg.mem_len :].detach()

    def new_memory(self, batch: int) -> list[Tensor]:
        """Empty memory (m = 0) for ``batch`` rows: the same as passing None."""
        p = self.tok_emb.weight
        return [p.new_zeros(batch, 0, self.cfg.d_model) for _ in self.blocks]

    # Generation reads the prompt in segments of max_seq_len, then one token per segment,
    # the memory carried all along: each new token sees its own segment and mem_len hidden
    # states per layer (more through the layers), however long the stream grows.
    unbounded_context = True  # no max_seq_len window: the CLI plans no slide

    def stream(
        self,
        prompts,
        max_new_tokens: int = 32,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        generator: torch.Generator | None = None,
        stop_tokens=None,
        use_cache: bool = True,
        pad_id: int = 0,
        compile: bool | str = False,
        overflow: str = "slide",
    ):
        """Yield new tokens as :meth:`DecoderLM.stream` does (an int per step for one prompt,
        a list with an int or None per row for a batch), decoding with the segment memory.
        The memory is this model's cache (``use_cache=False`` is refused) and its steps run
        eagerly (``compile`` is accepted and ignored); ``overflow`` and ``pad_id`` do not
        apply (each row decodes alone, unpadded), though they are checked as DecoderLM's are."""
        from attnlab.generation import (
            OVERFLOW_MODES,
            check_pad_id,
            check_request,
            check_sampling,
            stop_ids,
        )

        check_sampling(temperature, top_k, top_p)
        check_pad_id(pad_id, self.cfg.vocab_size)  # unused, but refused as DecoderLM refuses it
        if compile not in (True, False, "auto") or overflow not in OVERFLOW_MODES:
            raise ValueError(
                f"compile must be True, False or 'auto' (got {compile!r}) and overflow one of "
                f"{', '.join(OVERFLOW_MODES)} (got {overflow!r})"
            )
        if not use_cache:
            raise ValueError("Transformer-XL decodes with its segment memory: use_cache=True")
        rows, single, generator = check_request(self, prompts, max_new_tokens, seed, generator)
        sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
        return self._stream(rows, single, max_new_tokens, sampling, set(stop_ids(stop_tokens)))

    def generate(
        self,
        prompts,
        max_new_tokens: int = 32,
        *,
        num_beams: int = 1,
        length_penalty: float = 1.0,
        **kwargs,
    ):
        """The new tokens of :meth:`stream`: a list for one prompt, a list of lists for a
        batch (each row ends before its first stop token). Greedy or sampled only: the
        segment memory has no beam search (``num_beams`` > 1 is refused; ``length_penalty``,
        a beam option, does not apply)."""
        from attnlab.generation import _as_batch, check_num_beams, collect

        check_num_beams(num_beams)
        if num_beams > 1:
            raise ValueError(
                f"num_beams={num_beams}: Transformer-XL has no beam search (its segment memory "
                "is not reordered per beam); decode greedily or sample with num_beams=1"
            )
        rows, single = _as_batch(prompts)
        return collect(self.stream(prompts, max_new_tokens, **kwargs), single, len(rows))

    @torch.inference_mode()
    def _stream(self, rows, single, max_new_tokens, sampling, stops):
        from attnlab.generation import sample_next

        modes = enter_eval(self)
        try:
            device, seg = self.tok_emb.weight.device, self.cfg.max_seq_len
            # rows of different lengths keep their own memory: each row is a batch of one
            state = []  # per row: (memory, logits of its last position)
            for r in rows:
                ids, mem = torch.tensor([r], device=device), None
                for start in range(0, len(r), seg):
                    out = self(ids[:, start : start + seg], memory=mem, last_only=True)
                    mem = out.memory
                state.append([mem, out.logits[:, -1]])
            live = [True] * len(rows)
            for n in range(max_new_tokens):
                step: list[int | None] = []
                for i, (mem, logits) in enumerate(state):
                    if not live[i]:
                        step.append(None)
                        continue
                    token = int(sample_next(logits, **sampling))
                    if token in stops:
                        live[i] = False
                        step.append(None)
                        continue
                    if n + 1 < max_new_tokens:  # the next token's logits
                        out = self(torch.tensor([[token]], device=device), memory=mem)
                        state[i] = [out.memory, out.logits[:, -1]]
                    step.append(token)
                if not any(live):
                    return
                yield step[0] if single else step
        finally:
            restore(modes)


@torch.no_grad()
def xl_loss_sums(
    model: TransformerXL, tokens: Tensor, segment_len: int, *, memory: bool = True
) -> tuple[float, int]:
    """(sum of losses, targets) of a 1-D stream read in consecutive segments of
    ``segment_len``, carrying the memory from segment to segment (``memory=False``: each
    segment alone). Every target tokens[1:] is scored once. Batch of one stream."""
    modes = enter_eval(model)
    total, count, mem = 0.0, 0, None
    n = len(tokens) - 1
    try:
        for start in range(0, n, segment_len):
            end = min(start + segment_len, n)
            x, y = tokens[None, start:end], tokens[None, start + 1 : end + 1]
            out = model(x, memory=mem, targets=y)
            total += float(out.loss) * (end - start)
            count += end - start
            mem = out.memory if memory else None
    finally:
        restore(modes)
    return total, count
