"""Encoder-only transformer (BERT, Devlin et al. 2019; ModernBERT, Warner et al. 2024) with
task heads.

    h_0 = LayerNorm(E[idx] + P[positions] + T[token_type])   embeddings (BERT: post-norm)
    h_l = Block_l(h_{l-1})                                    bidirectional self-attention + FFN
    head(h_L): masked-LM logits, a sequence label (pooled [CLS] or mean of the tokens),
    token labels, or the start/end logits of an answer span (extractive QA)

ModernBERT's layout is the same stack pre-norm with RoPE (a second base on the local layers,
``position.local_rope_theta``), local layers attending within a window on both sides
(``attention.sliding_window`` with ``layer_pattern``), GeGLU, LayerNorms without bias, no
norm before the first layer's attention (``first_attn_norm``: the embeddings are normed
already), and every head starting with dense -> act -> norm (``classifier_transform``).

DeBERTa's (He et al. 2021; ``DebertaV2Model``) is BERT's stack with disentangled attention
(``position.kind`` disentangled, ``nn/disentangled.py``): one table of relative-position
embeddings shared by the layers, which every layer scores against its queries and keys;
absolute positions on the embeddings only with ``position.disentangled_absolute``.

T5's encoder (Raffel et al. 2020; ``T5EncoderModel``) is the stack pre-norm with RMSNorm and
no position embeddings: a learned bias by relative position on every layer's self-attention
scores (``position.kind`` relative_bias, both signs: ``nn/position_bias.py``), one table
shared by the layers.

Heads are picked by name (``EncoderConfig.head``) from :data:`HEADS`.

Shapes: b batch, t length, d d_model, V vocabulary size, n n_labels.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.config import ACTIVATIONS as ACTIVATION_NAMES
from attnlab.config import (
    CAUSAL_KINDS,
    GATED_ACTIVATIONS,
    AttentionConfig,
    ModelConfig,
    NormConfig,
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
from attnlab.nn.disentangled import RelativePositionTable
from attnlab.nn.embedding import LearnedPositionalEmbedding, SinusoidalPositionalEmbedding
from attnlab.nn.feedforward import ACTIVATIONS
from attnlab.nn.linear import Linear
from attnlab.nn.norm import build_norm
from attnlab.nn.position_bias import build_position_bias
from attnlab.nn.rope import RotaryEmbedding

ENCODER_HEADS = ("mlm", "sequence", "token", "qa", "none", "replaced_token")
# What the sequence, token and QA heads do before their classifier: "bert" (the sequence head
# pools with BERT's pooler, dense + tanh; the token and QA heads classify the hidden states
# as they are), "roberta" (RoBERTa's classification head: the same with classifier dropout
# before the dense layer too, dropout -> dense -> tanh -> dropout; token and QA heads as
# bert) or "dense_act_norm" (ModernBERT: dense -> head activation -> norm, the masked-LM
# head's transform, on the pooled state or on every token), "distilbert" (DistilBERT's: the
# sequence head's dense layer with ReLU, not tanh, then dropout; the QA head drops out the
# hidden states before its span layer; token head as bert) or "context_pooler" (DeBERTa's
# ContextPooler: the sequence head's dense -> head activation -> dropout, no tanh; token
# and QA heads as bert) or "electra" (ELECTRA's classification head: RoBERTa's with GELU,
# the exact one whatever the layers', for tanh: dropout -> dense -> GELU -> dropout; token
# and QA heads as bert)
CLASSIFIER_TRANSFORMS = (
    "bert",
    "roberta",
    "dense_act_norm",
    "distilbert",
    "context_pooler",
    "electra",
)
# the sequence head's pooler (dense + tanh; DistilBERT's + ReLU, DeBERTa's ContextPooler's
# activation, ELECTRA's GELU); no transform on the other heads
POOLER_TRANSFORMS = ("bert", "roberta", "distilbert", "context_pooler", "electra")
POOLINGS = ("cls", "mean")  # the sequence head's: the first token, or the real tokens' mean
# transformers' problem_type of a sequence classifier
PROBLEM_TYPES = ("single_label_classification", "multi_label_classification", "regression")


@dataclass
class EncoderConfig(ModelConfig):
    """BERT-style encoder. Defaults follow BERT: post-norm LayerNorm (eps 1e-12), biases on
    every projection, GELU MLP, learned positions, token types, a LayerNorm on the
    embeddings. ``head``: ``mlm`` (masked LM, tied decoder + bias), ``sequence`` (pooled
    [CLS] -> n_labels; n_labels 1 is regression), ``token`` (a label per token), ``qa``
    (start/end logits), ``none`` (hidden states), ``replaced_token`` (ELECTRA's
    discriminator: one logit per token, "this token was replaced"). ``label_names``: the
    names of the ``sequence``/``token`` head's labels in label order (an imported model's
    id2label);
    None: the names of the task the model was trained for. ``problem_type``: a ``sequence``
    head's transformers ``problem_type`` (config.json's): ``single_label_classification``
    (softmax over the classes), ``multi_label_classification`` (a sigmoid per class: each
    label on its own), ``regression``; None: from n_labels (1: regression, else single
    label).

    ModernBERT's pieces (BERT's values by default): ``first_attn_norm`` false: the first
    block's attention takes the embeddings as they are (pre-norm only); ``pooling``: the
    sequence head's pooled state, ``cls`` (the first token) or ``mean`` (the mean over the
    real tokens); ``classifier_transform`` (:data:`CLASSIFIER_TRANSFORMS`); ``head_bias``:
    a bias on the heads' dense transform; ``head_activation``: its activation (None:
    ffn.activation); ``decoder_bias``: the masked-LM decoder's bias. The embedding and head
    LayerNorms take ``norm.bias`` as the blocks' do.

    ALBERT's pieces (Lan et al. 2020; none by default): ``embedding_size`` E factorises the
    embeddings (token, position and token-type tables and their LayerNorm E wide, then a
    linear map E -> d_model; the masked-LM head's transform maps d_model -> E and decodes
    with the E-wide tied table); ``layer_sets`` shares parameters across layers (that many
    distinct blocks, layer i running block ``i * layer_sets // n_layers``: consecutive layers
    reuse one, the same module)."""

    arch: str = "encoder"
    attention: AttentionConfig = field(
        default_factory=lambda: AttentionConfig(qkv_bias=True, out_bias=True)
    )
    norm: NormConfig = field(default_factory=lambda: NormConfig(placement="post", eps=1e-12))
    type_vocab_size: int = 2  # 0: no token-type embedding
    embedding_norm: bool = True
    head: str = "mlm"
    n_labels: int = 2
    classifier_dropout: float | None = None  # None: dropout
    label_names: list[str] | None = None
    problem_type: str | None = None
    first_attn_norm: bool = True
    pooling: str = "cls"
    classifier_transform: str = "bert"
    head_bias: bool = True
    head_activation: str | None = None
    decoder_bias: bool = True
    embedding_size: int | None = None  # factorised embedding width E; None: d_model, no map
    layer_sets: int | None = None  # distinct blocks the layers reuse in order; None: n_layers

    def validate(self, path: str = "") -> None:
        super().validate(path)
        at = (lambda name: f"{path}.{name}") if path else (lambda name: name)
        _choice(at("head"), self.head, ENCODER_HEADS)
        _choice(at("pooling"), self.pooling, POOLINGS)
        _choice(at("classifier_transform"), self.classifier_transform, CLASSIFIER_TRANSFORMS)
        if self.head_activation is not None:
            _choice(at("head_activation"), self.head_activation, ACTIVATION_NAMES)
        transformed = self.head == "mlm" or (
            self.head in ("sequence", "token", "qa")
            and self.classifier_transform not in POOLER_TRANSFORMS
        )
        # DeBERTa's pooler applies the activation to its dense layer's output, ELECTRA's
        # discriminator to its dense layer's
        transformed |= self.head == "sequence" and self.classifier_transform == "context_pooler"
        transformed |= self.head == "replaced_token"
        if (
            transformed
            and self.head_activation is None
            and self.ffn.activation in GATED_ACTIVATIONS
        ):
            _fail(
                at("ffn.activation"),
                f"{self.ffn.activation!r} gates two projections; the head's transform applies "
                "the activation to one: use an elementwise one or set head_activation",
            )
        if not self.first_attn_norm and self.norm.placement != "pre":
            _fail(at("first_attn_norm"), "false leaves out the first block's pre-norm: it "
                  f"needs norm.placement 'pre', not {self.norm.placement!r}")  # fmt: skip
        _positive(at("n_labels"), self.n_labels)
        if self.embedding_size is not None:
            _positive(at("embedding_size"), self.embedding_size)
            if self.position.kind == "sinusoidal" and self.embedding_size % 2:
                _fail(at("embedding_size"), f"sinusoidal positions need an even width, got "
                      f"{self.embedding_size}")  # fmt: skip
        self._validate_layer_sets(at)
        _positive(at("type_vocab_size"), self.type_vocab_size, allow_zero=True)
        pad = self.position.padding_idx
        if pad is not None and pad >= self.vocab_size:
            _fail(at("position.padding_idx"), f"{pad} is the padding token's id: it must be "
                  f"below vocab_size={self.vocab_size}")  # fmt: skip
        if self.attention.kind in CAUSAL_KINDS:
            _fail(at("attention.kind"), f"{self.attention.kind!r} attention is causal only; an "
                  "encoder attends both ways: use mha, mla or dsa")  # fmt: skip
        if self.position.kind in ("rope", "relative_bias", "disentangled") and (
            self.attention.kind != "mha"
        ):
            _fail(at("position.kind"), f"{self.position.kind} encoders need attention.kind 'mha'")
        if self.position.kind == "disentangled":
            a = self.attention
            for name, value, off in (
                ("n_kv_heads", a.n_kv_heads not in (None, a.n_heads), "null"),
                ("sliding_window", a.sliding_window, "null"),
                ("sink_tokens", a.sink_tokens, "0"),
                ("global_tokens", a.global_tokens, "[]"),
                ("qk_norm", a.qk_norm, "false"),
                ("softcap", a.softcap, "null"),
                ("sink_logits", a.sink_logits, "false"),
                ("scale", a.scale, "null (the scale is 1 / sqrt(d_h (1 + terms)))"),
                ("clip_qkv", a.clip_qkv, "null"),
            ):
                if value:
                    _fail(at(f"attention.{name}"), "is not implemented by disentangled "
                          f"attention (position.kind 'disentangled'); set it to {off}")  # fmt: skip
        p = self.classifier_dropout
        if p is not None and not 0.0 <= p < 1.0:
            _fail(at("classifier_dropout"), f"must be in [0, 1), got {p}")
        if self.problem_type is not None:
            _choice(at("problem_type"), self.problem_type, PROBLEM_TYPES)
            if self.head != "sequence":
                _fail(at("problem_type"), f"head {self.head!r} has none; set it to null")
            if self.problem_type == "single_label_classification" and self.n_labels == 1:
                # a softmax over one class: loss 0 whatever the weights (transformers refuses it)
                _fail(at("problem_type"), "single_label_classification needs n_labels >= 2; "
                      "use regression for one output")  # fmt: skip
        names = self.label_names
        if names is not None and self.head not in ("sequence", "token"):
            _fail(at("label_names"), f"head {self.head!r} has no named labels; set it to null")
        if names is not None and len(names) != self.n_labels:
            _fail(
                at("label_names"),
                f"{len(names)} names for n_labels={self.n_labels}; give one per label or null",
            )

    def _validate_layer_sets(self, at) -> None:
        """Shared blocks must be the same for every layer that runs them: no per-layer
        pieces (windows by layer, dense and MoE layers, NoPE layers, a bias per layer)."""
        sets = self.layer_sets
        if sets is None:
            return
        where = at("layer_sets")
        if not 1 <= sets <= self.n_layers:
            _fail(where, f"must be in [1, n_layers={self.n_layers}], got {sets}; or null (a "
                  "block per layer)")  # fmt: skip
        per_layer = [
            ("attention.sliding_window", self.attention.sliding_window is not None),
            ("ffn.kind 'moe'", self.ffn.kind == "moe"),
            ("position.nope_layers", bool(self.position.nope_layers)),
            ("position.relative_bias_per_layer", self.position.relative_bias_per_layer),
            ("first_attn_norm false", not self.first_attn_norm),
        ]
        for name, on in per_layer:
            if on:
                _fail(where, f"shared blocks are alike in every layer, which {name} is not; "
                      "set layer_sets to null or drop it")  # fmt: skip


register_model_config("encoder", EncoderConfig)


# --------------------------------------------------------------------------- heads


def add_transform(head: nn.Module, cfg: EncoderConfig, width: int | None = None) -> None:
    """Give ``head`` the prediction transform ``transform`` (dense d_model -> ``width``, bias
    ``head_bias``) -> ``act`` (``head_activation``, else ffn.activation) -> ``norm``
    (LayerNorm, bias ``norm.bias``): BERT's masked-LM head's (ALBERT's to the embedding
    width), and ModernBERT's in every head. ``width`` None: d_model."""
    d, width = cfg.d_model, width or cfg.d_model
    head.transform = Linear(d, width, bias=cfg.head_bias)
    head.act = ACTIVATIONS[cfg.head_activation or cfg.ffn.activation]
    head.norm = nn.LayerNorm(width, eps=cfg.norm.eps, bias=cfg.norm.bias)


def _transformed(head: nn.Module, h: Tensor) -> Tensor:
    """dense -> act -> norm where the head has them (BERT's token and QA heads do not: the
    hidden states as they are)."""
    return head.norm(head.act(head.transform(h))) if hasattr(head, "transform") else h


class MaskedLMHead(nn.Module):
    """BERT's prediction head: dense -> act -> LayerNorm, then a decoder (tied to the token
    embedding when ``tie_embeddings``) with its own bias (none without ``decoder_bias``).
    With ``embedding_size`` E (ALBERT's) the transform maps d_model -> E and the decoder
    E -> V."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        width = cfg.embedding_size or cfg.d_model
        add_transform(self, cfg, width)
        self.decoder = Linear(width, cfg.vocab_size, bias=False)
        self.bias = nn.Parameter(torch.zeros(cfg.vocab_size)) if cfg.decoder_bias else None

    def forward(self, h: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        logits = self.decoder(_transformed(self, h))  # (b, t, V)
        return logits if self.bias is None else logits + self.bias

    @staticmethod
    def loss(logits: Tensor, targets: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """targets (b, t): the original token at masked positions, -100 elsewhere. A batch
        with no masked position (a short one can draw none) has loss 0: no gradient, where
        the mean over nothing would be NaN."""
        targets = check_targets("targets", targets, logits.shape[:2], "(b, t) like idx")
        total = F.cross_entropy(
            softmax_dtype(logits.flatten(0, 1)),
            targets.flatten(),
            ignore_index=-100,
            reduction="sum",
        )
        return total / (targets != -100).sum().clamp(min=1)  # (no host read)


def mean_pool(h: Tensor, attention_mask: Tensor | None) -> Tensor:
    """(b, t, d) -> (b, d): the mean over each row's real tokens (``attention_mask`` 1)."""
    if attention_mask is None:
        return h.mean(dim=1)
    keep = attention_mask.to(h.dtype)[..., None]  # (b, t, 1)
    return (h * keep).sum(dim=1) / keep.sum(dim=1)


class SequenceClassificationHead(nn.Module):
    """The pooled state (``pooling``: the first, [CLS], token or the mean of the real
    tokens), BERT's pooler (dense + tanh; RoBERTa's head drops out its input first;
    DistilBERT's pre_classifier takes ReLU instead of tanh; DeBERTa's ContextPooler: dense +
    the head activation) or
    ModernBERT's transform (dense -> act -> norm) as ``classifier_transform`` says,
    dropout, a linear classifier."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        d = cfg.d_model
        self.mean = cfg.pooling == "mean"
        p = cfg.dropout if cfg.classifier_dropout is None else cfg.classifier_dropout
        if cfg.classifier_transform in POOLER_TRANSFORMS:
            self.pooler = Linear(d, d)
            # tanh (BERT, RoBERTa), ReLU (DistilBERT), GELU (ELECTRA), or DeBERTa's
            # pooler_hidden_act
            self.pooler_act = {
                "distilbert": torch.relu,
                "electra": F.gelu,
                "context_pooler": ACTIVATIONS[cfg.head_activation or cfg.ffn.activation],
            }.get(cfg.classifier_transform, torch.tanh)
        else:
            add_transform(self, cfg)
        # RoBERTa (and ELECTRA) drop out the pooled state before the dense layer too (the
        # same rate)
        self.pool_dropout = (
            nn.Dropout(p) if cfg.classifier_transform in ("roberta", "electra") else nn.Identity()
        )
        self.dropout = nn.Dropout(p)
        self.classifier = Linear(d, cfg.n_labels)

    def forward(self, h: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        pooled = mean_pool(h, attention_mask) if self.mean else h[:, 0]  # (b, d)
        if hasattr(self, "pooler"):
            pooled = self.pooler_act(self.pooler(self.pool_dropout(pooled)))
        return self.classifier(self.dropout(_transformed(self, pooled)))  # (b, n)

    @staticmethod
    def loss(
        logits: Tensor,
        targets: Tensor,
        attention_mask: Tensor | None = None,
        problem_type: str | None = None,
    ) -> Tensor:
        """As transformers' sequence classifiers, by ``problem_type`` (None, as transformers
        infers it: ``regression`` for one label, else ``single_label_classification`` for
        integer targets and ``multi_label_classification`` for float ones): single label,
        targets (b,) class ids (-100 ignored) or, given that problem_type, (b, n) class
        probabilities, softmax cross-entropy; multi label, targets (b, n) 0 / 1 per class, a
        sigmoid cross-entropy per class; regression, targets (b, n) real values ((b,) for
        one label), mean squared error."""
        b, n = logits.shape
        if problem_type is None:
            if n == 1:
                problem_type = "regression"
            elif targets.is_floating_point():
                problem_type = "multi_label_classification"
            else:
                problem_type = "single_label_classification"
        prediction = softmax_dtype(logits)
        if problem_type == "regression":
            # (b,) or (b, 1) for one label, as transformers' squeeze: a (b, 1) target
            # broadcast against (b,) predictions compared every row with every target
            if targets.numel() != prediction.numel() or targets.shape[0] != b:
                raise ValueError(
                    f"targets must be (b, n_labels) = ({b}, {n}) real values, got shape "
                    f"{tuple(targets.shape)}"
                )
            return F.mse_loss(prediction, targets.reshape(b, n).to(prediction.dtype))
        if problem_type == "multi_label_classification":
            # the softmax cross-entropy took 0 / 1 targets as class probabilities
            if tuple(targets.shape) != (b, n):
                raise ValueError(
                    f"targets must be (b, n_labels) = ({b}, {n}), 1 for each label that "
                    f"applies, got shape {tuple(targets.shape)}"
                )
            return F.binary_cross_entropy_with_logits(prediction, targets.to(prediction.dtype))
        if targets.is_floating_point():  # class probabilities (b, n)
            if tuple(targets.shape) != (b, n):
                raise ValueError(
                    f"targets must be (b,) = ({b},) class ids or ({b}, {n}) class "
                    f"probabilities, got {targets.dtype} of shape {tuple(targets.shape)}"
                )
            return F.cross_entropy(prediction, targets)
        # (b, 1) class ids too, as transformers' labels.view(-1)
        flat = targets.reshape(-1) if targets.numel() == b else targets
        targets = check_targets("targets", flat, (b,), "(b,) class ids")
        return F.cross_entropy(prediction, targets, ignore_index=-100)


class TokenClassificationHead(nn.Module):
    """(ModernBERT: dense -> act -> norm,) dropout, a linear classifier on every token."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        if cfg.classifier_transform not in POOLER_TRANSFORMS:
            add_transform(self, cfg)
        p = cfg.dropout if cfg.classifier_dropout is None else cfg.classifier_dropout
        self.dropout = nn.Dropout(p)
        self.classifier = Linear(cfg.d_model, cfg.n_labels)

    def forward(self, h: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return self.classifier(self.dropout(_transformed(self, h)))  # (b, t, n)

    @staticmethod
    def loss(logits: Tensor, targets: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """targets (b, t) label ids, -100 for ignored tokens (padding, sub-words)."""
        targets = check_targets("targets", targets, logits.shape[:2], "(b, t) like idx")
        return F.cross_entropy(
            softmax_dtype(logits.flatten(0, 1)), targets.flatten(), ignore_index=-100
        )


def mask_padding(logits: Tensor, attention_mask: Tensor | None) -> Tensor:
    """logits (b, t, ...) with the padded positions (``attention_mask`` 0) at -inf."""
    if attention_mask is None:
        return logits
    pad = ~attention_mask.bool().view(*attention_mask.shape, *([1] * (logits.dim() - 2)))
    return softmax_dtype(logits).masked_fill(pad, float("-inf"))


class QuestionAnsweringHead(nn.Module):
    """Start and end logits of the answer span: logits (b, t, 2), [..., 0] start, [..., 1] end
    (ModernBERT: after dense -> act -> norm and dropout)."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        transformed = cfg.classifier_transform not in POOLER_TRANSFORMS
        if transformed:
            add_transform(self, cfg)
        p = cfg.dropout if cfg.classifier_dropout is None else cfg.classifier_dropout
        # ModernBERT's (after its transform) and DistilBERT's (qa_dropout) drop out first
        dropped = transformed or cfg.classifier_transform == "distilbert"
        self.dropout = nn.Dropout(p) if dropped else nn.Identity()
        self.span = Linear(cfg.d_model, 2)

    def forward(self, h: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return self.span(self.dropout(_transformed(self, h)))  # (b, t, 2)

    @staticmethod
    def loss(logits: Tensor, targets: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """targets (b, 2): start and end token index; indices past the sequence are
        ignored and negative ones clamped to 0, the [CLS] token (as transformers does). The
        loss is the mean of the two. Padding (``attention_mask`` 0) is no candidate
        position, so an example's loss does not depend on the batch it is padded in
        (transformers' BERT counts it)."""
        b, t = logits.shape[:2]
        targets = check_targets("targets", targets, (b, 2), "(b, 2) start and end indices")
        targets = targets.clamp(0, t)  # t: ignored
        logits = mask_padding(logits, attention_mask)
        start = F.cross_entropy(softmax_dtype(logits[..., 0]), targets[:, 0], ignore_index=t)
        end = F.cross_entropy(softmax_dtype(logits[..., 1]), targets[:, 1], ignore_index=t)
        return (start + end) / 2


class ReplacedTokenHead(nn.Module):
    """ELECTRA's discriminator (replaced-token detection, Clark et al. 2020): dense d -> d ->
    act (``head_activation``, else ffn.activation) -> a linear score d -> 1 on every token;
    logits (b, t), positive for "replaced"."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.dense = Linear(cfg.d_model, cfg.d_model, bias=cfg.head_bias)
        self.act = ACTIVATIONS[cfg.head_activation or cfg.ffn.activation]
        self.prediction = Linear(cfg.d_model, 1)

    def forward(self, h: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return self.prediction(self.act(self.dense(h))).squeeze(-1)  # (b, t)

    @staticmethod
    def loss(logits: Tensor, targets: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """targets (b, t): 1 where the token was replaced, 0 where it is the original (any
        dtype: bool, integer or float). The sigmoid cross-entropy, mean over the real tokens
        (``attention_mask`` 1; every token without one), as transformers'
        ElectraForPreTraining."""
        if tuple(targets.shape) != tuple(logits.shape):
            raise ValueError(
                f"targets must be (b, t) = {tuple(logits.shape)} like idx, 1 where the token "
                f"was replaced, got shape {tuple(targets.shape)}"
            )
        logits = softmax_dtype(logits)
        if attention_mask is not None:
            real = attention_mask.bool().expand(logits.shape)
            logits, targets = logits[real], targets[real]
        return F.binary_cross_entropy_with_logits(logits, targets.to(logits.dtype))


class NoHead(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()

    def forward(self, h: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return h

    @staticmethod
    def loss(logits: Tensor, targets: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        raise ValueError("an encoder with head 'none' has no loss; pick a head")


HEADS: dict[str, type[nn.Module]] = {
    "mlm": MaskedLMHead,
    "sequence": SequenceClassificationHead,
    "token": TokenClassificationHead,
    "qa": QuestionAnsweringHead,
    "none": NoHead,
    "replaced_token": ReplacedTokenHead,
}


# --------------------------------------------------------------------------- model


class EncoderModel(LoadableModel):
    """An encoder-only transformer with the head ``cfg.head`` names.

    ``model(idx, attention_mask=..., token_type_ids=..., targets=...)`` returns
    :class:`ModelOutput`; ``encode`` returns the final hidden states."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        # the embeddings' width: d_model, or ALBERT's factorised E (mapped to d_model after)
        d = cfg.embedding_size or cfg.d_model
        # RoBERTa: the padding token's embedding is not trained (position.padding_idx)
        self.tok_emb = nn.Embedding(cfg.vocab_size, d, padding_idx=cfg.position.padding_idx)
        self.pos_emb: nn.Module | None = None
        if cfg.position.kind == "learned" or cfg.position.disentangled_absolute:
            self.pos_emb = LearnedPositionalEmbedding(cfg.max_seq_len, d, cfg.position.padding_idx)
        elif cfg.position.kind == "sinusoidal":
            self.pos_emb = SinusoidalPositionalEmbedding(d)
        self.rope = self.local_rope = None
        if cfg.position.kind == "rope":
            self.rope = RotaryEmbedding.from_config(cfg.head_dim, cfg.position)
        if cfg.position.local_rope_theta is not None:  # ModernBERT: the local layers' own base
            theta, layout = cfg.position.local_rope_theta, cfg.position.rope_layout
            self.local_rope = RotaryEmbedding(cfg.head_dim, theta, layout)
        # a bias on the self-attention scores, both ways (T5's relative position bias)
        self.pos_bias = build_position_bias(
            cfg.position, cfg.n_heads, bidirectional=True, n_layers=cfg.n_layers
        )
        if cfg.position.kind == "disentangled":  # DeBERTa: relative embeddings every layer reads
            self.pos_bias = RelativePositionTable(
                cfg.position, d, eps=cfg.norm.eps, dropout=cfg.dropout
            )
        self.type_emb = nn.Embedding(cfg.type_vocab_size, d) if cfg.type_vocab_size else None
        self.emb_norm = (
            nn.LayerNorm(d, eps=cfg.norm.eps, bias=cfg.norm.bias)
            if cfg.embedding_norm
            else nn.Identity()
        )
        self.drop = nn.Dropout(cfg.dropout)
        # ALBERT: E -> d_model (embedding_hidden_mapping_in)
        self.emb_proj = Linear(d, cfg.d_model) if cfg.embedding_size else None
        d = cfg.d_model
        self.blocks = TransformerStack(
            cfg,
            causal=False,
            rope=self.rope,
            local_rope=self.local_rope,
            layer_sets=cfg.layer_sets,
        )
        if not cfg.first_attn_norm:  # ModernBERT: the embeddings end in a norm already
            self.blocks[0].attn_norm = nn.Identity()
        # Post-norm blocks end in a norm already; a pre-norm stack needs a final one.
        self.norm = build_norm(cfg.norm, d) if cfg.norm.placement == "pre" else nn.Identity()
        self.head = HEADS[cfg.head](cfg)
        self.apply(self._init_weights)
        self.tie_weights()
        self._aux = aux_modules(self)  # MoE balance losses, DSA indexers (outputs.py)

    def tied_parameters(self) -> dict[str, str]:
        """The masked-LM decoder is the token embedding when ``tie_embeddings``."""
        if self.cfg.head == "mlm" and self.cfg.tie_embeddings:
            return {"head.decoder.weight": "tok_emb.weight"}
        return {}

    def _init_weights(self, m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=self.cfg.init_std)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
            if getattr(m, "padding_idx", None) is not None:  # padding's rows start at 0
                with torch.no_grad():
                    m.weight[m.padding_idx].zero_()
        elif hasattr(m, "init_weights"):  # modules with raw parameters (MoE experts, router)
            m.init_weights(self.cfg.init_std)

    def encode(
        self,
        idx: Tensor,
        *,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        positions: Tensor | None = None,
    ) -> Tensor:
        """idx (b, t) -> hidden states (b, t, d). ``attention_mask`` (b, t): 1 real token,
        0 padding (any side); positions count from 0 (BERT numbers pads too), or with
        ``position.padding_idx`` (RoBERTa) from the ids: past padding_idx, over the tokens
        that are not padding_idx. Given ``positions`` index the position table as they are
        (transformers' position_ids)."""
        b, t = check_ids("idx", idx)
        check_padding_mask("attention_mask", attention_mask, b, t)
        for name, ids in (("token_type_ids", token_type_ids), ("positions", positions)):
            # (1, t) or (t,) serve every row; other rows broadcast: one row of idx with
            # three of token types gave three rows of logits
            if ids is not None and (
                ids.dim() > 2
                or ids.shape[-1] != t
                or (ids.dim() == 2 and ids.shape[0] not in (1, b))
            ):
                raise ValueError(
                    f"{name} must be (b, t) = ({b}, {t}) like idx, got shape {tuple(ids.shape)}"
                )
        if t > self.cfg.max_seq_len and isinstance(self.pos_emb, LearnedPositionalEmbedding):
            raise ValueError(
                f"sequence of {t} tokens exceeds max_seq_len={self.cfg.max_seq_len} of learned "
                "positions; crop the input"
            )
        if positions is None and isinstance(self.pos_emb, LearnedPositionalEmbedding):
            positions = self.pos_emb.positions(idx)  # (1, t), or (b, t) counted past padding
        elif positions is None:
            positions = torch.arange(t, device=idx.device)[None, :]  # (1, t)
        x = self.tok_emb(idx)  # (b, t, d)
        if self.pos_emb is not None:
            x = x + self.pos_emb(positions, dtype=x.dtype).to(x.dtype)
        if self.type_emb is not None:
            if token_type_ids is None:
                token_type_ids = torch.zeros_like(idx)
            x = x + self.type_emb(token_type_ids)
        x = self.drop(self.emb_norm(x))
        if self.emb_proj is not None:  # (b, t, E) -> (b, t, d)
            x = self.emb_proj(x)
        mask = real = None
        if attention_mask is not None:
            mask = padding_mask(attention_mask)  # (b, 1, 1, t)
            real = attention_mask.bool().expand(b, t)  # MoE and DSA statistics skip padding
        rope = self.rope.tables(positions) if self.rope is not None else None
        local_rope = self.local_rope.tables(positions) if self.local_rope is not None else None
        bias = self.pos_bias(positions, positions) if self.pos_bias is not None else None
        x = self.blocks(
            x,
            positions=positions,
            rope=rope,
            mask=mask,
            real_tokens=real,
            local_rope=local_rope,
            bias=bias,
        )
        return self.norm(x)

    def forward(
        self,
        idx: Tensor,
        *,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        positions: Tensor | None = None,
        targets: Tensor | None = None,
    ) -> ModelOutput:
        """Logits of the head: mlm (b, t, V), sequence (b, n), token (b, t, n), qa (b, t, 2),
        none (b, t, d), replaced_token (b, t). ``targets`` as the head's ``loss`` describes."""
        h = self.encode(
            idx, attention_mask=attention_mask, token_type_ids=token_type_ids, positions=positions
        )
        logits = self.head(h, attention_mask)  # (mean pooling leaves the padding out)
        # every head's loss takes the padding; question answering's leaves it out of its span
        # a sequence classifier's loss follows its problem_type (multi-label: a sigmoid each)
        kw = {"problem_type": self.cfg.problem_type} if self.cfg.head == "sequence" else {}
        loss = None
        if targets is not None:
            loss = self.head.loss(logits, targets, attention_mask, **kw)
        return ModelOutput(logits, *finish_loss(self._aux, loss, self.training))

    def num_parameters(self) -> int:
        """Parameters (tied ones, and shared blocks, counted once)."""
        return sum(p.numel() for p in self.parameters())


register_model("encoder")(EncoderModel)


# --------------------------------------------------------------------------- MLM data


def mask_tokens(
    idx: Tensor,
    *,
    mask_id: int,
    vocab_size: int,
    mask_prob: float = 0.15,
    special: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """BERT's masking (Devlin et al. 2019, 3.1): choose ``mask_prob`` of the tokens; of those,
    80% become ``mask_id``, 10% a random token, 10% stay. Returns (inputs, targets):
    targets hold the original token at chosen positions and -100 elsewhere.

    ``special`` (b, t) bool (or a 1-D tensor of token ids): never chosen (padding, [CLS],
    [SEP]). Pure: ``idx`` is not modified."""
    if not 0.0 <= mask_prob <= 1.0:
        raise ValueError(f"mask_prob must be in [0, 1], got {mask_prob}")
    dev = idx.device

    def rand(shape):
        return torch.rand(shape, generator=generator, device=dev)

    chosen = rand(idx.shape) < mask_prob
    if special is not None:
        protect = special if special.dtype == torch.bool else torch.isin(idx, special)
        chosen &= ~protect
    u = rand(idx.shape)
    random_ids = torch.randint(vocab_size, idx.shape, generator=generator, device=dev)
    return _replace(idx, chosen, u, random_ids, mask_id)


def mask_whole_words(
    idx: Tensor,
    word_ids: Tensor,
    *,
    mask_id: int,
    vocab_size: int,
    mask_prob: float = 0.15,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """Whole-word masking (BERT's released WWM models): the words are chosen, not the tokens.
    ``word_ids`` (b, t) numbers the words of each row 0, 1, 2, ... (a word's tokens share
    its number); each word is chosen with probability ``mask_prob`` (so each token is too:
    the expected masking rate is unchanged) and all its tokens are predicted. Each chosen
    token then becomes ``mask_id`` (80%), a random token (10%) or stays (10%) on its own
    draw, as Google's ``create_pretraining_data.py`` does with ``do_whole_word_mask``.
    Returns (inputs, targets) as :func:`mask_tokens`."""
    if not 0.0 <= mask_prob <= 1.0:
        raise ValueError(f"mask_prob must be in [0, 1], got {mask_prob}")
    dev = idx.device
    n_words = int(word_ids.max()) + 1 if word_ids.numel() else 0
    per_word = torch.rand((idx.shape[0], n_words), generator=generator, device=dev)  # (b, W)
    chosen = (per_word < mask_prob).gather(1, word_ids)  # (b, t)
    u = torch.rand(idx.shape, generator=generator, device=dev)  # 80/10/10 per token
    random_ids = torch.randint(vocab_size, idx.shape, generator=generator, device=dev)
    return _replace(idx, chosen, u, random_ids, mask_id)


def _replace(
    idx: Tensor, chosen: Tensor, u: Tensor, random_ids: Tensor, mask_id: int
) -> tuple[Tensor, Tensor]:
    """80/10/10 at the ``chosen`` positions by the uniform draws ``u``: (inputs, targets)."""
    targets = torch.where(chosen, idx, torch.full_like(idx, -100))
    to_mask = chosen & (u < 0.8)
    to_random = chosen & (u >= 0.8) & (u < 0.9)
    inputs = torch.where(to_mask, torch.full_like(idx, mask_id), idx)
    inputs = torch.where(to_random, random_ids, inputs)
    return inputs, targets
