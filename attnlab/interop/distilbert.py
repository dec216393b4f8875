"""DistilBERT (``model_type`` distilbert) <-> attnlab
:class:`~attnlab.models.encoder.EncoderModel`; the head follows config.json's
``architectures``: ``DistilBertForMaskedLM`` (mlm), ``DistilBertForSequenceClassification``
(sequence), ``DistilBertForTokenClassification`` (token), ``DistilBertForQuestionAnswering``
(qa), ``DistilBertModel`` (none). Labels, ``problem_type`` and the task an imported head
serves as bert.py's.

DistilBERT (Sanh et al. 2019) is BERT's post-norm encoder without token types and without
the pooler, every LayerNorm's epsilon 1e-12, under names of its own:

- the sequence head (``classifier_transform='distilbert'``): the first token ->
  ``pre_classifier`` (attnlab's ``head.pooler``) -> ReLU -> dropout (``seq_classif_dropout``,
  attnlab's ``classifier_dropout``) -> ``classifier``; the QA head drops out the hidden
  states (``qa_dropout``) before ``qa_outputs``; the token head with ``dropout``;
- the masked-LM head: ``vocab_transform`` -> ``activation`` -> ``vocab_layer_norm`` ->
  ``vocab_projector`` (tied to the token embedding; its bias is the head's);
- ``sinusoidal_pos_embds``: the position table is Vaswani et al.'s sinusoids, sine and
  cosine interleaved, which is attnlab's ``position.kind`` sinusoidal (the stored table is
  not read; export writes it).

Layouts, HF (``distilbert.`` under a head) -> attnlab:

    embeddings.{word,position}_embeddings, LayerNorm     -> tok_emb, pos_emb, emb_norm
    transformer.layer.i.attention.[q_lin; k_lin; v_lin] -> blocks.i.attn.qkv (rows stacked)
    attention.out_lin, sa_layer_norm                     -> attn.out, attn_norm
    ffn.lin1, ffn.lin2, output_layer_norm                -> ffn.up, ffn.down, ffn_norm
    vocab_transform, vocab_layer_norm                    -> head.transform, head.norm
    vocab_projector.weight, .bias                        -> head.decoder (tied), head.bias
    pre_classifier + classifier                          -> head.pooler, head.classifier
    classifier / qa_outputs                              -> head.classifier / head.span

Shapes: d d_model, V vocabulary size.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import Tensor

from attnlab.config import ModelConfig
from attnlab.interop import bert
from attnlab.interop.io import (
    TASK_OF_HEAD,
    Family,
    HFCheckpointError,
    Plan,
    Source,
    Specs,
    get,
    prefix,
    unplan,
    unrepresentable,
)
from attnlab.models.encoder import EncoderConfig
from attnlab.nn.embedding import sinusoidal_table

HEAD_ARCHITECTURES = {
    "DistilBertForMaskedLM": "mlm",
    "DistilBertModel": "none",
    "DistilBertForSequenceClassification": "sequence",
    "DistilBertForTokenClassification": "token",
    "DistilBertForQuestionAnswering": "qa",
}
ARCHITECTURES = {"distilbert": tuple(HEAD_ARCHITECTURES)}
ARCHITECTURE_OF_HEAD = {head: arch for arch, head in HEAD_ARCHITECTURES.items()}

# transformers' DistilBertConfig class defaults for the config.json keys read here
# (Family.defaults).
DEFAULTS: dict[str, dict[str, Any]] = {
    "distilbert": {
        "vocab_size": 30522,
        "max_position_embeddings": 512,
        "sinusoidal_pos_embds": False,
        "n_layers": 6,
        "n_heads": 12,
        "dim": 768,
        "hidden_dim": 3072,
        "dropout": 0.1,
        "attention_dropout": 0.1,
        "activation": "gelu",
        "initializer_range": 0.02,
        "qa_dropout": 0.1,
        "seq_classif_dropout": 0.2,
        "pad_token_id": 0,
        "tie_word_embeddings": True,
    },
}
# DistilBERT's LayerNorms (embeddings, blocks, masked-LM head): a fixed epsilon
LAYER_NORM_EPS = 1e-12
# Buffers transformers saves (position ids); recomputed, never loaded.
IGNORED = re.compile(r"^(distilbert\.)?embeddings\.position_ids$")
# the config.json key of each head's classifier dropout
_DROPOUT_KEY = {"sequence": "seq_classif_dropout", "qa": "qa_dropout"}


def config_from_hf(hf: dict[str, Any], model_type: str = "distilbert") -> EncoderConfig:
    head = HEAD_ARCHITECTURES.get((hf.get("architectures") or ["DistilBertModel"])[0])
    key = _DROPOUT_KEY.get(head)
    bert_keys = {
        "vocab_size": get(hf, "vocab_size"),
        "max_position_embeddings": get(hf, "max_position_embeddings"),
        "hidden_size": get(hf, "dim"),
        "num_hidden_layers": get(hf, "n_layers"),
        "num_attention_heads": get(hf, "n_heads"),
        "intermediate_size": get(hf, "hidden_dim"),
        "hidden_act": hf.get("activation", "gelu"),
        "hidden_dropout_prob": hf.get("dropout", 0.0),
        "attention_probs_dropout_prob": hf.get("attention_dropout", 0.0),
        "layer_norm_eps": LAYER_NORM_EPS,
        "type_vocab_size": 0,
        "classifier_dropout": hf.get(key) if key else None,
    }
    rest = {k: hf[k] for k in ("architectures", "num_labels", "id2label", "problem_type",
                               "initializer_range", "tie_word_embeddings") if k in hf}  # fmt: skip
    cfg = bert.encoder_config_from_hf({**rest, **bert_keys}, HEAD_ARCHITECTURES, "DistilBERT")
    sinusoids = hf.get("sinusoidal_pos_embds", False)
    if cfg.d_model % 2 and sinusoids:
        raise HFCheckpointError(
            f"config.json sinusoidal_pos_embds=true with dim={cfg.d_model}: sines and cosines "
            "come in pairs, so attnlab's sinusoids need an even dim"
        )
    return cfg.override(
        {
            "classifier_transform": "distilbert",
            "position.kind": "sinusoidal" if sinusoids else "learned",
        }
    )


def exports(cfg: ModelConfig) -> bool:
    """Encoders without token types (BERT's layout has them) or with DistilBERT's sequence
    head; ModernBERT's, RoBERTa's and ALBERT's pieces go to their families first."""
    return isinstance(cfg, EncoderConfig) and (
        cfg.type_vocab_size == 0 or cfg.classifier_transform == "distilbert"
    )


def export_type(cfg: ModelConfig) -> str:
    """``distilbert``, or HFCheckpointError naming what DistilBERT lacks."""
    assert isinstance(cfg, EncoderConfig)
    problems = [
        p
        for p in bert.layout_problems(cfg, "DistilBERT")
        if "token types" not in p and "learned positions" not in p
    ]
    if cfg.position.kind not in ("learned", "sinusoidal"):
        problems.append("DistilBERT uses learned or sinusoidal positions")
    if not cfg.embedding_norm:
        problems.append("DistilBERT has an embedding LayerNorm")
    # (the token head's transform is BERT's; the others' are DistilBERT's own)
    transform = cfg.classifier_transform if cfg.head in ("sequence", "qa") else "distilbert"
    token_dropout = cfg.classifier_dropout if cfg.head == "token" else None
    for field, value, theirs in (
        ("type_vocab_size", cfg.type_vocab_size, 0),
        ("norm.eps", cfg.norm.eps, LAYER_NORM_EPS),
        ("classifier_transform", transform, "distilbert"),
        ("classifier_dropout (the token head's is dropout)", token_dropout, None),
        ("pooling", cfg.pooling, "cls"),
        ("head_bias", cfg.head_bias, True),
        ("decoder_bias", cfg.decoder_bias, True),
        ("head_activation", cfg.head_activation, None),
        ("position.padding_idx", cfg.position.padding_idx, None),
        ("first_attn_norm", cfg.first_attn_norm, True),
    ):
        if value != theirs:
            problems.append(f"{field}={value!r} (DistilBERT's is {theirs!r})")
    if problems:
        raise unrepresentable("; ".join(problems))
    return "distilbert"


def config_to_hf(cfg: EncoderConfig, model_type: str, dtype: torch.dtype) -> dict[str, Any]:
    written = bert.config_to_hf(cfg, model_type, dtype)
    for key in (
        "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
        "hidden_act", "hidden_dropout_prob", "attention_probs_dropout_prob", "type_vocab_size",
        "layer_norm_eps", "classifier_dropout", "position_embedding_type",
    ):  # fmt: skip
        written.pop(key)
    dropouts = {k: DEFAULTS["distilbert"][k] for k in _DROPOUT_KEY.values()}
    if cfg.head in _DROPOUT_KEY:
        p = cfg.classifier_dropout
        dropouts[_DROPOUT_KEY[cfg.head]] = cfg.dropout if p is None else p
    return {
        **written,
        "model_type": "distilbert",
        "architectures": [ARCHITECTURE_OF_HEAD[cfg.head]],
        "dim": cfg.d_model,
        "n_layers": cfg.n_layers,
        "n_heads": cfg.attention.n_heads,
        "hidden_dim": cfg.ffn.hidden_size(cfg.d_model),
        "activation": bert.hf_activation(cfg.ffn.activation, bert.TO_HF_ACTIVATIONS),
        "dropout": cfg.dropout,
        "attention_dropout": cfg.attention.dropout,
        "sinusoidal_pos_embds": cfg.position.kind == "sinusoidal",
        **dropouts,
    }


_BLOCK = [
    ("attn.out", "attention.out_lin"),
    ("attn_norm", "sa_layer_norm"),
    ("ffn.up", "ffn.lin1"),
    ("ffn.down", "ffn.lin2"),
    ("ffn_norm", "output_layer_norm"),
]


def _specs(cfg: EncoderConfig, b: str) -> Specs:
    """attnlab name -> HF name(s); ``b`` the backbone prefix (``distilbert.`` or none)."""
    wb = ("weight", "bias")
    specs: Specs = {"tok_emb.weight": f"{b}embeddings.word_embeddings.weight"}
    if cfg.position.kind == "learned":
        specs["pos_emb.weight"] = f"{b}embeddings.position_embeddings.weight"
    specs |= {f"emb_norm.{s}": f"{b}embeddings.LayerNorm.{s}" for s in wb}
    for i in range(cfg.n_layers):
        h, a = f"{b}transformer.layer.{i}.", f"blocks.{i}."
        for s in wb:
            specs[f"{a}attn.qkv.{s}"] = [
                f"{h}attention.{n}.{s}" for n in ("q_lin", "k_lin", "v_lin")
            ]
            specs |= {f"{a}{ours}.{s}": f"{h}{theirs}.{s}" for ours, theirs in _BLOCK}
    if cfg.head == "mlm":
        specs |= {f"head.transform.{s}": f"vocab_transform.{s}" for s in wb}
        specs |= {f"head.norm.{s}": f"vocab_layer_norm.{s}" for s in wb}
        specs["head.bias"] = "vocab_projector.bias"
        if not cfg.tie_embeddings:
            specs["head.decoder.weight"] = "vocab_projector.weight"
    elif cfg.head == "sequence":
        specs |= {f"head.pooler.{s}": f"pre_classifier.{s}" for s in wb}
        specs |= {f"head.classifier.{s}": f"classifier.{s}" for s in wb}
    elif cfg.head == "token":
        specs |= {f"head.classifier.{s}": f"classifier.{s}" for s in wb}
    elif cfg.head == "qa":
        specs |= {f"head.span.{s}": f"qa_outputs.{s}" for s in wb}
    return specs


def weights_to_attnlab(src: Source, cfg: EncoderConfig) -> Plan:
    b = prefix(src, "distilbert.", "embeddings.word_embeddings.weight")
    plan = src.plan(_specs(cfg, b))
    if cfg.position.kind == "sinusoidal":  # the fixed table: attnlab computes it
        src.skip(f"{b}embeddings.position_embeddings.weight")
    if cfg.head == "mlm" and cfg.tie_embeddings:  # the stored copy of the tied weight
        src.tied("vocab_projector.weight", plan["tok_emb.weight"])
    return plan  # type: ignore[return-value]  # None entries only with src.missing/wrong


def weights_from_attnlab(
    sd: dict[str, Tensor], cfg: EncoderConfig, model_type: str
) -> dict[str, Tensor]:
    b = "" if cfg.head == "none" else "distilbert."
    out = unplan(_specs(cfg, b), sd)
    if cfg.position.kind == "sinusoidal":  # transformers stores the table (not trained)
        positions = torch.arange(cfg.max_seq_len)
        table = sinusoidal_table(positions, cfg.d_model)
        out[f"{b}embeddings.position_embeddings.weight"] = table.to(sd["tok_emb.weight"].dtype)
    if cfg.head == "mlm" and cfg.tie_embeddings:
        out["vocab_projector.weight"] = sd["tok_emb.weight"]
    return out


FAMILY = Family(
    name="distilbert",
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
    task=lambda cfg: TASK_OF_HEAD[cfg.head],
)
