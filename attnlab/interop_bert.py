"""Hugging Face BERT (``BertModel``, ``BertForMaskedLM``, ``BertForSequenceClassification``,
``BertForTokenClassification``, ``BertForQuestionAnswering``) <-> attnlab
:class:`~attnlab.models.encoder.EncoderModel`.

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
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from attnlab.config import AttentionConfig, FFNConfig, NormConfig, PositionConfig
from attnlab.interop import HFCheckpointError
from attnlab.interop_io import Tensors, load_state, read_folder, write_folder
from attnlab.models.encoder import EncoderConfig, EncoderModel

HEAD_ARCHITECTURES = {
    "BertModel": "none",
    "BertForMaskedLM": "mlm",
    "BertForSequenceClassification": "sequence",
    "BertForTokenClassification": "token",
    "BertForQuestionAnswering": "qa",
}
ARCHITECTURE_OF_HEAD = {head: arch for arch, head in HEAD_ARCHITECTURES.items()}
_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "relu": "relu", "silu": "silu"}
_ACTIVATIONS_BACK = {v: k for k, v in _ACTIVATIONS.items()}


def config_from_bert(hf: dict[str, Any]) -> EncoderConfig:
    if hf.get("model_type") != "bert":
        raise HFCheckpointError(f"model_type {hf.get('model_type')!r} is not 'bert'")
    archs = hf.get("architectures") or ["BertModel"]
    if archs[0] not in HEAD_ARCHITECTURES:
        raise HFCheckpointError(
            f"architecture {archs[0]!r} is not supported; "
            f"use one of {', '.join(HEAD_ARCHITECTURES)}"
        )
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise HFCheckpointError("only absolute position embeddings are supported")
    act = hf.get("hidden_act", "gelu")
    if act not in _ACTIVATIONS:
        raise HFCheckpointError(f"hidden_act {act!r} is not supported")
    n_labels = hf.get("num_labels") or len(hf.get("id2label") or {}) or 2
    if archs[0] == "BertForQuestionAnswering" and n_labels != 2:
        raise HFCheckpointError(f"a QA model has 2 outputs (start, end), got num_labels={n_labels}")
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    return EncoderConfig(
        vocab_size=hf["vocab_size"],
        max_seq_len=hf["max_position_embeddings"],
        d_model=d,
        n_layers=hf["num_hidden_layers"],
        attention=AttentionConfig(
            n_heads=heads,
            qkv_bias=True,
            out_bias=True,
            dropout=float(hf.get("attention_probs_dropout_prob", 0.0)),
        ),
        position=PositionConfig(kind="learned"),
        ffn=FFNConfig(kind="mlp", activation=_ACTIVATIONS[act], hidden_dim=hf["intermediate_size"]),
        norm=NormConfig(
            kind="layernorm", eps=float(hf.get("layer_norm_eps", 1e-12)), placement="post"
        ),
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        dropout=float(hf.get("hidden_dropout_prob", 0.0)),
        init_std=float(hf.get("initializer_range", 0.02)),
        type_vocab_size=hf.get("type_vocab_size", 2),
        head=HEAD_ARCHITECTURES[archs[0]],
        n_labels=n_labels,
        classifier_dropout=hf.get("classifier_dropout"),
    )


def config_to_bert(cfg: EncoderConfig) -> dict[str, Any]:
    problems = []
    if cfg.norm.placement != "post" or cfg.norm.kind != "layernorm" or not cfg.norm.bias:
        problems.append("BERT uses post-norm LayerNorm with bias")
    if cfg.position.kind != "learned":
        problems.append("BERT uses learned positions")
    if cfg.ffn.kind != "mlp" or cfg.ffn.activation not in _ACTIVATIONS_BACK or not cfg.ffn.bias:
        problems.append("BERT uses an MLP with biases and gelu/relu/silu")
    a = cfg.attention
    if a.kind != "mha" or a.kv_heads != a.n_heads or cfg.head_dim * a.n_heads != cfg.d_model:
        problems.append("BERT uses multi-head attention with head_dim = d_model / n_heads")
    if not (a.qkv_bias and a.out_bias) or a.sliding_window is not None:
        problems.append("BERT attention has biases and no window")
    if not cfg.embedding_norm or cfg.type_vocab_size < 1:
        problems.append("BERT has an embedding LayerNorm and token types")
    if problems:
        raise HFCheckpointError("config is not representable as BERT: " + "; ".join(problems))
    labels = {str(i): f"LABEL_{i}" for i in range(2 if cfg.head == "qa" else cfg.n_labels)}
    return {
        "model_type": "bert",
        "architectures": [ARCHITECTURE_OF_HEAD[cfg.head]],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": a.n_heads,
        "intermediate_size": cfg.ffn.hidden_size(cfg.d_model),
        "hidden_act": _ACTIVATIONS_BACK[cfg.ffn.activation],
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
        "id2label": labels,
        "label2id": {v: int(k) for k, v in labels.items()},
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
    ("tok_emb.weight", "embeddings.word_embeddings.weight"),
    ("pos_emb.weight", "embeddings.position_embeddings.weight"),
    ("type_emb.weight", "embeddings.token_type_embeddings.weight"),
    ("emb_norm.weight", "embeddings.LayerNorm.weight"),
    ("emb_norm.bias", "embeddings.LayerNorm.bias"),
]


def _head_pairs(cfg: EncoderConfig, b: str) -> list[tuple[str, str]]:
    """(attnlab, HF) names of the head's tensors; ``b`` the backbone prefix."""
    wb = ("weight", "bias")
    if cfg.head == "mlm":
        p = "cls.predictions."
        pairs = [(f"head.transform.{s}", f"{p}transform.dense.{s}") for s in wb]
        pairs += [(f"head.norm.{s}", f"{p}transform.LayerNorm.{s}") for s in wb]
        pairs.append(("head.bias", f"{p}bias"))
        if not cfg.tie_embeddings:
            pairs.append(("head.decoder.weight", f"{p}decoder.weight"))
        return pairs
    if cfg.head == "sequence":
        return [(f"head.pooler.{s}", f"{b}pooler.dense.{s}") for s in wb] + [
            (f"head.classifier.{s}", f"classifier.{s}") for s in wb
        ]
    if cfg.head == "token":
        return [(f"head.classifier.{s}", f"classifier.{s}") for s in wb]
    if cfg.head == "qa":
        return [(f"head.span.{s}", f"qa_outputs.{s}") for s in wb]
    return []


def bert_to_attnlab(tensors: dict[str, Tensor], cfg: EncoderConfig) -> dict[str, Tensor]:
    b = "bert." if "bert.embeddings.word_embeddings.weight" in tensors else ""
    # Buffers, the decoder bias (a copy of cls.predictions.bias) and a pooler the head
    # does not use (BertModel and the MLM/token/QA models may carry one) are not loaded.
    ignore = ("position_ids", "token_type_ids", "predictions.decoder.bias")
    if cfg.head != "sequence":
        ignore += ("pooler.dense.weight", "pooler.dense.bias")
    src = Tensors(tensors, ignore)
    out = {ours: src.take(b + theirs) for ours, theirs in _EMB}
    for i in range(cfg.n_layers):
        h, a = f"{b}encoder.layer.{i}.", f"blocks.{i}."
        for s in ("weight", "bias"):
            qkv = [src.take(f"{h}attention.self.{n}.{s}") for n in ("query", "key", "value")]
            out[f"{a}attn.qkv.{s}"] = torch.cat(qkv, dim=0)
            for ours, theirs in _BLOCK:
                out[f"{a}{ours}.{s}"] = src.take(f"{h}{theirs}.{s}")
    for ours, theirs in _head_pairs(cfg, b):
        out[ours] = src.take(theirs)
    if cfg.head == "mlm" and cfg.tie_embeddings:
        src.pop("cls.predictions.decoder.weight")  # the tied copy of the word embeddings
    src.finish()
    return out


def attnlab_to_bert(sd: dict[str, Tensor], cfg: EncoderConfig) -> dict[str, Tensor]:
    b = "" if cfg.head == "none" else "bert."
    out = {b + theirs: sd[ours] for ours, theirs in _EMB}
    d = cfg.d_model
    for i in range(cfg.n_layers):
        h, a = f"{b}encoder.layer.{i}.", f"blocks.{i}."
        for s in ("weight", "bias"):
            q, k, v = sd[f"{a}attn.qkv.{s}"].split(d, dim=0)
            for n, t in (("query", q), ("key", k), ("value", v)):
                out[f"{h}attention.self.{n}.{s}"] = t
            for ours, theirs in _BLOCK:
                out[f"{h}{theirs}.{s}"] = sd[f"{a}{ours}.{s}"]
    for ours, theirs in _head_pairs(cfg, b):
        out[theirs] = sd[ours]
    if cfg.head == "mlm":
        out["cls.predictions.decoder.bias"] = sd["head.bias"]
        if cfg.tie_embeddings:
            out["cls.predictions.decoder.weight"] = sd["tok_emb.weight"]
    return out


def load_bert(path: str | Path) -> EncoderModel:
    """An :class:`EncoderModel` (eval mode) from a transformers BERT folder."""
    hf, tensors = read_folder(path)
    cfg = config_from_bert(hf)
    model = EncoderModel(cfg)
    tied = {"head.decoder.weight"} if cfg.head == "mlm" and cfg.tie_embeddings else set()
    load_state(model, bert_to_attnlab(tensors, cfg), tied)
    return model.eval()


def save_bert(model: EncoderModel, path: str | Path) -> None:
    """A folder that ``transformers.AutoModelFor...from_pretrained`` loads with equal logits."""
    hf = config_to_bert(model.cfg)
    hf["torch_dtype"] = str(model.tok_emb.weight.dtype).removeprefix("torch.")
    write_folder(path, hf, attnlab_to_bert(model.state_dict(), model.cfg))
