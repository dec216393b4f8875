"""BERT (``model_type`` bert) <-> attnlab :class:`~attnlab.models.encoder.EncoderModel`; the
head follows config.json's ``architectures``: ``BertForMaskedLM`` (mlm),
``BertForSequenceClassification`` (sequence), ``BertForTokenClassification`` (token),
``BertForQuestionAnswering`` (qa), ``BertModel`` (none). The classifiers' label names
(config.json's ``id2label``) become ``EncoderConfig.label_names`` (the label ids as text where
id2label has none or only transformers' ``LABEL_<i>``) and a sequence classifier's
``problem_type`` (multi-label: a sigmoid per class) ``EncoderConfig.problem_type``; both are
written back on export; the
imported checkpoint records the task its head serves (:data:`TASK_OF_HEAD`), so ``classify``,
``tag``, ``answer`` and ``fill-mask`` run it.

Layouts (attnlab Linear weights are (out, in), like transformers'):

    embeddings.{word,position,token_type}_embeddings            -> tok_emb, pos_emb, type_emb
    embeddings.LayerNorm                                         -> emb_norm
    encoder.layer.i.attention.self.[query; key; value]           -> blocks.i.attn.qkv (rows stacked)
    attention.output.dense, attention.output.LayerNorm           -> attn.out, attn_norm (post-norm)
    intermediate.dense, output.dense, output.LayerNorm           -> ffn.up, ffn.down, ffn_norm
    cls.predictions.transform.{dense,LayerNorm}                  -> head.transform, head.norm
    cls.predictions.bias, .decoder                               -> head.bias, head.decoder
    pooler.dense + classifier                                    -> head.pooler, head.classifier
    classifier / qa_outputs                                      -> head.classifier / head.span

The original BERT files (bert-base-uncased's) are read as transformers reads them:
``LayerNorm.gamma`` / ``.beta`` are ``.weight`` / ``.bias``, and the pre-training heads no
mapped head uses (the next-sentence ``cls.seq_relationship``, the pooler but for sequence
classification) are left unread.

Shapes: d d_model, V vocabulary size.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import Tensor

from attnlab.config import AttentionConfig, FFNConfig, ModelConfig, NormConfig, PositionConfig
from attnlab.interop import io
from attnlab.interop.io import (
    NAMED_HEADS,
    TASK_OF_HEAD,
    Family,
    HFCheckpointError,
    Plan,
    Source,
    Specs,
    activation,
    dtype_entries,
    exported_label_names,
    get,
    hf_activation,
    label_entries,
    label_names,
    n_labels,
    numbered,
    read_mlm_decoder,
    unplan,
    unrepresentable,
    write_mlm_decoder,
)
from attnlab.models.encoder import PROBLEM_TYPES, EncoderConfig

HEAD_ARCHITECTURES = {
    "BertForMaskedLM": "mlm",
    "BertModel": "none",
    "BertForSequenceClassification": "sequence",
    "BertForTokenClassification": "token",
    "BertForQuestionAnswering": "qa",
}
ARCHITECTURES = {"bert": tuple(HEAD_ARCHITECTURES)}

# transformers' class defaults (BertConfig) for the config.json keys read here (Family.defaults).
DEFAULTS: dict[str, dict[str, Any]] = {
    "bert": {
        "vocab_size": 30522,
        "hidden_size": 768,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "intermediate_size": 3072,
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.1,
        "attention_probs_dropout_prob": 0.1,
        "max_position_embeddings": 512,
        "type_vocab_size": 2,
        "initializer_range": 0.02,
        "layer_norm_eps": 1e-12,
        "tie_word_embeddings": True,
    },
}
ARCHITECTURE_OF_HEAD = {head: arch for arch, head in HEAD_ARCHITECTURES.items()}
TO_HF_ACTIVATIONS = {**io.TO_HF_ACTIVATIONS, "gelu_tanh": "gelu_new"}
# Buffers transformers saves (position and token-type ids); recomputed, never loaded.
IGNORED = re.compile(r"^(bert\.)?embeddings\.(position_ids|token_type_ids)$")
# The next-sentence head of pre-training checkpoints (bert-base-uncased's file, whose
# config.json says BertForMaskedLM): no head attnlab maps uses it, nor does transformers'.
NSP_HEAD = ("cls.seq_relationship.weight", "cls.seq_relationship.bias")
# The LayerNorm names of the original BERT checkpoints, which transformers renames on load
# (its "legacy" weight renamings): LayerNorm.gamma -> .weight, LayerNorm.beta -> .bias.
_LEGACY_NORM = re.compile(r"(LayerNorm)\.(gamma|beta)$")


def legacy_name(name: str) -> str:
    return _LEGACY_NORM.sub(lambda m: f"{m[1]}.{'weight' if m[2] == 'gamma' else 'bias'}", name)


def config_from_hf(hf: dict[str, Any], model_type: str = "bert") -> EncoderConfig:
    return encoder_config_from_hf(hf, HEAD_ARCHITECTURES, "BERT")


def encoder_config_from_hf(
    hf: dict[str, Any], head_architectures: dict[str, str], family: str
) -> EncoderConfig:
    """The EncoderConfig of a BERT-layout config.json (BERT's, and RoBERTa's before its own
    pieces); ``head_architectures`` maps the family's classes to heads (the base model's
    second), ``family`` names it in errors."""
    arch = (hf.get("architectures") or [list(head_architectures)[1]])[0]
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise HFCheckpointError(f"{family}: only absolute position embeddings are supported")
    for key in ("is_decoder", "add_cross_attention"):  # causal / cross-attending BERT
        if hf.get(key):
            raise HFCheckpointError(f"{family}: {key}=true is not supported (encoders only)")
    labels = n_labels(hf)
    head = head_architectures[arch]
    if head == "qa" and labels != 2:
        raise HFCheckpointError(f"a QA model has 2 outputs (start, end), got num_labels={labels}")
    names = None
    if head in NAMED_HEADS:
        names = label_names(hf, labels) or numbered(labels)
    problem_type = hf.get("problem_type") if head == "sequence" else None
    if problem_type is not None and problem_type not in PROBLEM_TYPES:
        raise HFCheckpointError(
            f"config.json problem_type={problem_type!r} is not supported; supported: "
            f"{', '.join(PROBLEM_TYPES)}"
        )
    return EncoderConfig(
        vocab_size=get(hf, "vocab_size"),
        max_seq_len=get(hf, "max_position_embeddings"),
        d_model=get(hf, "hidden_size"),
        n_layers=get(hf, "num_hidden_layers"),
        attention=AttentionConfig(
            n_heads=get(hf, "num_attention_heads"),
            qkv_bias=True,
            out_bias=True,
            dropout=float(hf.get("attention_probs_dropout_prob", 0.0)),
        ),
        position=PositionConfig(kind="learned"),
        ffn=FFNConfig(
            kind="mlp",
            activation=activation(hf.get("hidden_act", "gelu"), "hidden_act"),
            hidden_dim=get(hf, "intermediate_size"),
        ),
        norm=NormConfig(
            kind="layernorm", eps=float(hf.get("layer_norm_eps", 1e-12)), placement="post"
        ),
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        dropout=float(hf.get("hidden_dropout_prob", 0.0)),
        init_std=float(hf.get("initializer_range", 0.02)),
        type_vocab_size=hf.get("type_vocab_size", 2),
        head=head,
        n_labels=labels,
        classifier_dropout=hf.get("classifier_dropout"),
        label_names=names,
        problem_type=problem_type,
    )


def exports(cfg: ModelConfig) -> bool:
    return cfg.arch == "encoder"


def layout_problems(cfg: EncoderConfig, family: str = "BERT", shared: bool = False) -> list[str]:
    """What keeps ``cfg`` out of BERT's layout (which RoBERTa shares, and ALBERT's with
    factorised embeddings and shared layers: ``shared``), each named."""
    problems = [] if shared else shared_problems(cfg, family)
    if cfg.norm.placement != "post" or cfg.norm.kind != "layernorm" or not cfg.norm.bias:
        problems.append(f"{family} uses post-norm LayerNorm with bias")
    if cfg.position.kind != "learned":
        problems.append(f"{family} uses learned positions")
    if cfg.ffn.kind != "mlp" or cfg.ffn.activation not in TO_HF_ACTIVATIONS or not cfg.ffn.bias:
        problems.append(f"{family} uses an MLP with biases and {'/'.join(TO_HF_ACTIVATIONS)}")
    a = cfg.attention
    if a.kind != "mha" or a.kv_heads != a.n_heads or cfg.head_dim * a.n_heads != cfg.d_model:
        problems.append(f"{family} uses multi-head attention with head_dim = d_model / n_heads")
    if not (a.qkv_bias and a.out_bias) or a.sliding_window is not None:
        problems.append(f"{family} attention has biases and no window")
    if not cfg.embedding_norm or cfg.type_vocab_size < 1:
        problems.append(f"{family} has an embedding LayerNorm and token types")
    return problems


def shared_problems(cfg: EncoderConfig, family: str) -> list[str]:
    """ALBERT's pieces, which ``family``'s layout lacks, each named."""
    return [
        f"{field}={value} ({family} has no {what}; ALBERT does: set it to null or export as ALBERT)"
        for field, value, what in (
            ("embedding_size", cfg.embedding_size, "factorised embeddings"),
            ("layer_sets", cfg.layer_sets, "layers sharing parameters"),
        )
        if value is not None
    ]


def export_type(cfg: ModelConfig) -> str:
    assert isinstance(cfg, EncoderConfig)
    problems = layout_problems(cfg)
    if problems:
        raise unrepresentable("; ".join(problems))
    return "bert"


def config_to_hf(cfg: EncoderConfig, model_type: str, dtype: torch.dtype) -> dict[str, Any]:
    a = cfg.attention
    return {
        "model_type": "bert",
        "architectures": [ARCHITECTURE_OF_HEAD[cfg.head]],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": a.n_heads,
        "intermediate_size": cfg.ffn.hidden_size(cfg.d_model),
        "hidden_act": hf_activation(cfg.ffn.activation, TO_HF_ACTIVATIONS),
        "hidden_dropout_prob": cfg.dropout,
        "attention_probs_dropout_prob": a.dropout,
        "max_position_embeddings": cfg.max_seq_len,
        "type_vocab_size": cfg.type_vocab_size,
        "layer_norm_eps": cfg.norm.eps,
        "initializer_range": cfg.init_std,
        "tie_word_embeddings": cfg.tie_embeddings,
        "classifier_dropout": cfg.classifier_dropout,
        "position_embedding_type": "absolute",
        "pad_token_id": 0,
        **label_entries(
            2 if cfg.head == "qa" else cfg.n_labels,
            exported_label_names(cfg.label_names, cfg.n_labels),
        ),
        **({"problem_type": cfg.problem_type} if cfg.problem_type else {}),
        **dtype_entries(dtype),
    }


# (attnlab suffix, HF suffix) of each block's single-tensor parameters
_BLOCK = [
    ("attn.out", "attention.output.dense"),
    ("attn_norm", "attention.output.LayerNorm"),
    ("ffn.up", "intermediate.dense"),
    ("ffn.down", "output.dense"),
    ("ffn_norm", "output.LayerNorm"),
]
_EMB = [
    ("tok_emb", "embeddings.word_embeddings"),
    ("pos_emb", "embeddings.position_embeddings"),
    ("type_emb", "embeddings.token_type_embeddings"),
]


def backbone_specs(cfg: EncoderConfig, b: str) -> Specs:
    """attnlab name -> HF name(s) of the embeddings and the blocks (BERT's and RoBERTa's
    layout); ``b`` the backbone prefix (``bert.``, ``roberta.`` or none)."""
    wb = ("weight", "bias")
    specs: Specs = {f"{ours}.weight": f"{b}{theirs}.weight" for ours, theirs in _EMB}
    specs |= {f"emb_norm.{s}": f"{b}embeddings.LayerNorm.{s}" for s in wb}
    for i in range(cfg.n_layers):
        h, a = f"{b}encoder.layer.{i}.", f"blocks.{i}."
        for s in wb:
            specs[f"{a}attn.qkv.{s}"] = [
                f"{h}attention.self.{n}.{s}" for n in ("query", "key", "value")
            ]
            specs |= {f"{a}{ours}.{s}": f"{h}{theirs}.{s}" for ours, theirs in _BLOCK}
    return specs


def _specs(cfg: EncoderConfig, b: str) -> Specs:
    """attnlab name -> HF name(s); ``b`` the backbone prefix (``bert.`` or none)."""
    wb = ("weight", "bias")
    specs = backbone_specs(cfg, b)
    if cfg.head == "mlm":
        p = "cls.predictions."
        specs |= {f"head.transform.{s}": f"{p}transform.dense.{s}" for s in wb}
        specs |= {f"head.norm.{s}": f"{p}transform.LayerNorm.{s}" for s in wb}
        specs["head.bias"] = f"{p}bias"
        if not cfg.tie_embeddings:
            specs["head.decoder.weight"] = f"{p}decoder.weight"
    elif cfg.head == "sequence":
        specs |= {f"head.pooler.{s}": f"{b}pooler.dense.{s}" for s in wb}
        specs |= {f"head.classifier.{s}": f"classifier.{s}" for s in wb}
    elif cfg.head == "token":
        specs |= {f"head.classifier.{s}": f"classifier.{s}" for s in wb}
    elif cfg.head == "qa":
        specs |= {f"head.span.{s}": f"qa_outputs.{s}" for s in wb}
    return specs


def weights_to_attnlab(src: Source, cfg: EncoderConfig) -> Plan:
    b = "bert." if src.has("bert.embeddings.word_embeddings.weight") else ""
    plan = src.plan(_specs(cfg, b))
    if cfg.head != "sequence":  # a pooler the head does not use (BertModel may carry one)
        for s in ("weight", "bias"):
            src.skip(f"{b}pooler.dense.{s}")
    for name in NSP_HEAD:
        src.skip(name)
    if cfg.head == "mlm":  # stored copies: the decoder bias, the tied decoder weight (an
        # untied head's own decoder bias wins: cls.predictions.bias, taken above, goes unused)
        read_mlm_decoder(src, plan, cfg, "cls.predictions.decoder")
    return plan  # type: ignore[return-value]  # None entries only with src.missing/wrong


def weights_from_attnlab(
    sd: dict[str, Tensor], cfg: EncoderConfig, model_type: str
) -> dict[str, Tensor]:
    out = unplan(_specs(cfg, "" if cfg.head == "none" else "bert."), sd)
    if cfg.head == "mlm":
        write_mlm_decoder(out, sd, cfg, "cls.predictions.decoder")
    return out


FAMILY = Family(
    name="bert",
    arch="encoder",
    architectures=ARCHITECTURES,
    config_from_hf=config_from_hf,
    defaults=DEFAULTS,
    config_to_hf=config_to_hf,  # type: ignore[arg-type]  # an EncoderConfig family
    weights_to_attnlab=weights_to_attnlab,  # type: ignore[arg-type]
    weights_from_attnlab=weights_from_attnlab,  # type: ignore[arg-type]
    exports=exports,
    export_type=export_type,
    ignored=IGNORED,
    rename=legacy_name,
    task=lambda cfg: TASK_OF_HEAD[cfg.head],
)
