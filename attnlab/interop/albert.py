"""ALBERT (``model_type`` albert) <-> attnlab :class:`~attnlab.models.encoder.EncoderModel`; the
head follows config.json's ``architectures``: ``AlbertForMaskedLM`` (mlm),
``AlbertForSequenceClassification`` (sequence), ``AlbertForTokenClassification`` (token),
``AlbertForQuestionAnswering`` (qa), ``AlbertModel`` (none). Labels, ``problem_type`` and the
task an imported head serves as bert.py's. The sentence-order pre-training model
(``AlbertForPreTraining``) is not read: no attnlab head is its SOP classifier.

ALBERT (Lan et al. 2020) is BERT's post-norm encoder with two savings:

- factorised embeddings (``EncoderConfig.embedding_size`` E): the token, position and
  token-type tables and their LayerNorm are E wide, then ``embedding_hidden_mapping_in``
  maps E -> hidden; the masked-LM head maps hidden -> E (dense -> hidden_act -> LayerNorm)
  and decodes with the tied E-wide token table and a bias;
- cross-layer sharing (``EncoderConfig.layer_sets``): ``num_hidden_groups`` groups of
  layers, layer i running group ``int(i / (num_hidden_layers / num_hidden_groups))``, which
  is attnlab's ``i * layer_sets // n_layers`` (configs where the two round differently are
  refused by name). A group of more than one layer (``inner_group_num`` > 1) repeats a
  cycle of distinct layers, which consecutive shared blocks do not describe: refused.

Layouts, HF (``albert.`` under a head) -> attnlab:

    embeddings.{word,position,token_type}_embeddings, LayerNorm -> tok_emb, pos_emb, type_emb,
                                                                   emb_norm (E wide)
    encoder.embedding_hidden_mapping_in                          -> emb_proj
    encoder.albert_layer_groups.g.albert_layers.0.
        attention.[query; key; value], attention.dense           -> blocks.g.attn.qkv, .attn.out
        attention.LayerNorm                                      -> blocks.g.attn_norm
        ffn, ffn_output, full_layer_layer_norm                   -> blocks.g.ffn.up, .ffn.down,
                                                                   .ffn_norm
    predictions.dense, predictions.LayerNorm, predictions.bias  -> head.transform, head.norm,
                                                                   head.bias
    predictions.decoder.weight                                   -> head.decoder (tied: tok_emb)
    pooler + classifier                                          -> head.pooler, head.classifier
    classifier / qa_outputs                                      -> head.classifier / head.span

Shapes: E embedding_size, d d_model, V vocabulary size.
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
    read_mlm_decoder,
    unplan,
    unrepresentable,
    write_mlm_decoder,
)
from attnlab.models.encoder import EncoderConfig

HEAD_ARCHITECTURES = {
    "AlbertForMaskedLM": "mlm",
    "AlbertModel": "none",
    "AlbertForSequenceClassification": "sequence",
    "AlbertForTokenClassification": "token",
    "AlbertForQuestionAnswering": "qa",
}
ARCHITECTURES = {"albert": tuple(HEAD_ARCHITECTURES)}
ARCHITECTURE_OF_HEAD = {head: arch for arch, head in HEAD_ARCHITECTURES.items()}

# transformers' AlbertConfig class defaults for the config.json keys read here
# (Family.defaults): albert-xxlarge's sizes, no dropout in the layers.
DEFAULTS: dict[str, dict[str, Any]] = {
    "albert": {
        "vocab_size": 30000,
        "embedding_size": 128,
        "hidden_size": 4096,
        "num_hidden_layers": 12,
        "num_hidden_groups": 1,
        "num_attention_heads": 64,
        "intermediate_size": 16384,
        "inner_group_num": 1,
        "hidden_act": "gelu_new",
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        "max_position_embeddings": 512,
        "type_vocab_size": 2,
        "initializer_range": 0.02,
        "layer_norm_eps": 1e-12,
        "classifier_dropout_prob": 0.1,
        "pad_token_id": 0,
        "bos_token_id": 2,
        "eos_token_id": 3,
        "tie_word_embeddings": True,
    },
}
# Buffers transformers saves (position and token-type ids); recomputed, never loaded.
IGNORED = re.compile(r"^(albert\.)?embeddings\.(position_ids|token_type_ids)$")


def group_of_layer(i: int, n_layers: int, n_groups: int) -> int:
    """transformers' group of layer i (AlbertTransformer.forward), in its float arithmetic."""
    return int(i / (n_layers / n_groups))


def config_from_hf(hf: dict[str, Any], model_type: str = "albert") -> EncoderConfig:
    inner = get(hf, "inner_group_num")
    if inner != 1:
        raise HFCheckpointError(
            f"config.json inner_group_num={inner} is not supported: a group of several layers "
            "repeats a cycle of distinct layers, which attnlab's shared blocks (consecutive "
            "layers reusing one) do not describe; the published ALBERTs have 1"
        )
    hf = {**hf, "classifier_dropout": hf.get("classifier_dropout_prob")}
    cfg = bert.encoder_config_from_hf(hf, HEAD_ARCHITECTURES, "ALBERT")
    n, groups = cfg.n_layers, get(hf, "num_hidden_groups")
    if not isinstance(groups, int) or not 1 <= groups <= n:
        raise HFCheckpointError(
            f"config.json num_hidden_groups={groups!r} must be in [1, num_hidden_layers={n}]"
        )
    if any(group_of_layer(i, n, groups) != i * groups // n for i in range(n)):
        raise HFCheckpointError(
            f"config.json num_hidden_groups={groups} with num_hidden_layers={n}: transformers' "
            "float arithmetic assigns the layers to groups other than i * groups // layers; "
            "pick a number of groups that divides the layers"
        )
    # the classifier's dropout: the sequence and token heads' only (QA has none), None where
    # it is the layers' (the token head's reading of None)
    p = cfg.classifier_dropout
    if cfg.head not in ("sequence", "token") or p == cfg.dropout:
        p = None
    return cfg.override(
        {
            "classifier_dropout": p,
            "embedding_size": get(hf, "embedding_size"),
            # as many groups as layers: a block per layer, attnlab's default
            "layer_sets": None if groups == n else groups,
        }
    )


def exports(cfg: ModelConfig) -> bool:
    """Encoders with factorised embeddings or shared layers, which the other encoder layouts
    would drop."""
    return isinstance(cfg, EncoderConfig) and (
        cfg.embedding_size is not None or cfg.layer_sets is not None
    )


def export_type(cfg: ModelConfig) -> str:
    """``albert``, or HFCheckpointError naming what ALBERT lacks."""
    assert isinstance(cfg, EncoderConfig)
    problems = bert.layout_problems(cfg, "ALBERT", shared=True)
    for field, value, theirs in (
        ("classifier_transform", cfg.classifier_transform, "bert"),
        ("pooling", cfg.pooling, "cls"),
        ("head_bias", cfg.head_bias, True),
        ("decoder_bias", cfg.decoder_bias, True),
        ("head_activation", cfg.head_activation, None),
        ("position.padding_idx", cfg.position.padding_idx, None),
        ("first_attn_norm", cfg.first_attn_norm, True),
    ):
        if value != theirs:
            problems.append(f"{field}={value!r} (ALBERT's is {theirs!r})")
    if cfg.embedding_size is None:
        problems.append(
            "embedding_size=None (ALBERT always maps its embeddings to the hidden width: set "
            "it, e.g. to 128)"
        )
    sets = cfg.layer_sets or cfg.n_layers
    if any(group_of_layer(i, cfg.n_layers, sets) != j for i, j in enumerate_order(cfg)):
        problems.append(
            f"layer_sets={sets} with n_layers={cfg.n_layers}: transformers assigns the layers "
            "to groups otherwise (its float arithmetic); pick a divisor of n_layers"
        )
    if problems:
        raise unrepresentable("; ".join(problems))
    return "albert"


def enumerate_order(cfg: EncoderConfig) -> list[tuple[int, int]]:
    """(layer, block) pairs of attnlab's sharing (TransformerStack's order)."""
    sets = cfg.layer_sets or cfg.n_layers
    return [(i, i * sets // cfg.n_layers) for i in range(cfg.n_layers)]


def config_to_hf(cfg: EncoderConfig, model_type: str, dtype: torch.dtype) -> dict[str, Any]:
    written = bert.config_to_hf(cfg, model_type, dtype)
    for key in ("classifier_dropout", "position_embedding_type"):
        written.pop(key)
    p = cfg.dropout if cfg.classifier_dropout is None else cfg.classifier_dropout
    if cfg.head not in ("sequence", "token"):  # no head reads it: transformers' default
        p = DEFAULTS["albert"]["classifier_dropout_prob"]
    return {
        **written,
        "model_type": "albert",
        "architectures": [ARCHITECTURE_OF_HEAD[cfg.head]],
        "embedding_size": cfg.embedding_size,
        "num_hidden_groups": cfg.layer_sets or cfg.n_layers,
        "inner_group_num": 1,
        "classifier_dropout_prob": p,
        "pad_token_id": DEFAULTS["albert"]["pad_token_id"],
        # ALBERT's [CLS] and [SEP] (transformers' defaults): the layers read neither
        "bos_token_id": DEFAULTS["albert"]["bos_token_id"],
        "eos_token_id": DEFAULTS["albert"]["eos_token_id"],
    }


_LAYER = [
    ("attn.out", "attention.dense"),
    ("attn_norm", "attention.LayerNorm"),
    ("ffn.up", "ffn"),
    ("ffn.down", "ffn_output"),
    ("ffn_norm", "full_layer_layer_norm"),
]


def _specs(cfg: EncoderConfig, b: str) -> Specs:
    """attnlab name -> HF name(s); ``b`` the backbone prefix (``albert.`` or none)."""
    wb = ("weight", "bias")
    specs: Specs = {f"{ours}.weight": f"{b}{theirs}.weight" for ours, theirs in bert._EMB}
    specs |= {f"emb_norm.{s}": f"{b}embeddings.LayerNorm.{s}" for s in wb}
    specs |= {f"emb_proj.{s}": f"{b}encoder.embedding_hidden_mapping_in.{s}" for s in wb}
    for g in range(cfg.layer_sets or cfg.n_layers):
        h, a = f"{b}encoder.albert_layer_groups.{g}.albert_layers.0.", f"blocks.{g}."
        for s in wb:
            specs[f"{a}attn.qkv.{s}"] = [f"{h}attention.{n}.{s}" for n in ("query", "key", "value")]
            specs |= {f"{a}{ours}.{s}": f"{h}{theirs}.{s}" for ours, theirs in _LAYER}
    if cfg.head == "mlm":
        specs |= {f"head.transform.{s}": f"predictions.dense.{s}" for s in wb}
        specs |= {f"head.norm.{s}": f"predictions.LayerNorm.{s}" for s in wb}
        specs["head.bias"] = "predictions.bias"
        if not cfg.tie_embeddings:
            specs["head.decoder.weight"] = "predictions.decoder.weight"
    elif cfg.head == "sequence":
        specs |= {f"head.pooler.{s}": f"{b}pooler.{s}" for s in wb}
        specs |= {f"head.classifier.{s}": f"classifier.{s}" for s in wb}
    elif cfg.head == "token":
        specs |= {f"head.classifier.{s}": f"classifier.{s}" for s in wb}
    elif cfg.head == "qa":
        specs |= {f"head.span.{s}": f"qa_outputs.{s}" for s in wb}
    return specs


def weights_to_attnlab(src: Source, cfg: EncoderConfig) -> Plan:
    b = prefix(src, "albert.", "embeddings.word_embeddings.weight")
    plan = src.plan(_specs(cfg, b))
    if cfg.head != "sequence":  # AlbertModel's pooler: no other head uses it
        for s in ("weight", "bias"):
            src.skip(f"{b}pooler.{s}")
    if cfg.head == "mlm":  # stored copies: the decoder bias, the tied decoder weight
        read_mlm_decoder(src, plan, cfg, "predictions.decoder")
    return plan  # type: ignore[return-value]  # None entries only with src.missing/wrong


def weights_from_attnlab(
    sd: dict[str, Tensor], cfg: EncoderConfig, model_type: str
) -> dict[str, Tensor]:
    out = unplan(_specs(cfg, "" if cfg.head == "none" else "albert."), sd)
    if cfg.head == "mlm":
        write_mlm_decoder(out, sd, cfg, "predictions.decoder")
    return out


FAMILY = Family(
    name="albert",
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
