"""DeBERTa-v2 and DeBERTa-v3 (``model_type`` deberta-v2) <-> attnlab
:class:`~attnlab.models.encoder.EncoderModel` with disentangled attention
(``position.kind`` disentangled, ``nn/disentangled.py``); the head follows config.json's
``architectures``: ``DebertaV2ForMaskedLM`` (mlm), ``DebertaV2Model`` (none),
``DebertaV2ForSequenceClassification`` (sequence), ``DebertaV2ForTokenClassification``
(token), ``DebertaV2ForQuestionAnswering`` (qa).

DeBERTa (He et al. 2021) is BERT's post-norm encoder with:

- disentangled attention: relative positions query - key, log-bucketed past
  ``position_buckets`` / 2 up to ``max_relative_positions`` (-1: max_position_embeddings),
  scored by the terms ``pos_att_type`` lists (c2p, p2c; a list or "p2c|c2p") against one
  table of relative embeddings ``encoder.rel_embeddings`` (2 x position_buckets rows, or 2 x
  max_relative_positions unbucketed) with its LayerNorm (``norm_rel_ebd`` "layer_norm");
  the position keys and queries come from the layer's own key and query projections
  (``share_att_key``, v3's) or from ``pos_key_proj`` / ``pos_query_proj`` (v2's);
- absolute positions on the embeddings only with ``position_biased_input`` (v3: none);
- no token types in the published models (``type_vocab_size`` 0);
- a sequence classifier whose ContextPooler runs the first token through dense ->
  ``pooler_hidden_act`` (``classifier_transform='context_pooler'``, ``head_activation``
  where that differs from ``hidden_act``), then dropout (``cls_dropout``: attnlab's
  ``classifier_dropout``) and the classifier; its dropout before the dense layer
  (``pooler_dropout``, 0 in the published configs) is not represented (a warning where it
  is set: training only).

Refused by name: ``relative_attention`` false, terms other than c2p / p2c (v1's p2p), the
convolution of the first layer (``conv_kernel_size`` > 0: DeBERTa-v2-xlarge's and
-xxlarge's), an ``embedding_size`` other than ``hidden_size``, ``norm_rel_ebd`` other than
none / layer_norm, a ``pooler_hidden_size`` other than ``hidden_size``, and
``DebertaV2ForMultipleChoice``.

Layouts, HF (``deberta.`` under a head) -> attnlab:

    embeddings.{word,position,token_type}_embeddings, LayerNorm -> tok_emb, pos_emb, type_emb,
                                                                   emb_norm
    encoder.rel_embeddings, encoder.LayerNorm                   -> pos_bias.embeddings, .norm
    encoder.layer.i.attention.self.[query; key; value]_proj     -> blocks.i.attn.qkv (rows stacked)
    attention.self.pos_key_proj, pos_query_proj                 -> attn.pos_key, attn.pos_query
    attention.output.dense / LayerNorm, intermediate.dense,     -> attn.out, attn_norm, ffn.up,
    output.dense / LayerNorm                                       ffn.down, ffn_norm
    cls.predictions.transform.{dense,LayerNorm}, .bias          -> head.transform, head.norm,
                                                                   head.bias (legacy head)
    lm_predictions.lm_head.{dense,LayerNorm,bias}               -> the same (legacy=false)
    pooler.dense, classifier (sequence)                         -> head.pooler, head.classifier
    classifier / qa_outputs                                     -> head.classifier / head.span

Export writes the legacy masked-LM head (transformers' default). Shapes: d d_model,
V vocabulary size.
"""

from __future__ import annotations

import re
import warnings
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
    activation,
    get,
    hf_activation,
    prefix,
    read_mlm_decoder,
    unplan,
    unrepresentable,
    write_mlm_decoder,
)
from attnlab.models.encoder import EncoderConfig

HEAD_ARCHITECTURES = {
    "DebertaV2ForMaskedLM": "mlm",
    "DebertaV2Model": "none",
    "DebertaV2ForSequenceClassification": "sequence",
    "DebertaV2ForTokenClassification": "token",
    "DebertaV2ForQuestionAnswering": "qa",
}
ARCHITECTURES = {"deberta-v2": tuple(HEAD_ARCHITECTURES)}
ARCHITECTURE_OF_HEAD = {head: arch for arch, head in HEAD_ARCHITECTURES.items()}
REFUSED_ARCHITECTURES = ("DebertaV2ForMultipleChoice",)

# transformers' DebertaV2Config class defaults for the config.json keys read here
# (Family.defaults); share_att_key, position_buckets, norm_rel_ebd and conv_kernel_size are
# no class attributes (the model reads them with getattr: false, -1, "none", 0).
DEFAULTS: dict[str, dict[str, Any]] = {
    "deberta-v2": {
        "vocab_size": 128100,
        "hidden_size": 1536,
        "num_hidden_layers": 24,
        "num_attention_heads": 24,
        "intermediate_size": 6144,
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.1,
        "attention_probs_dropout_prob": 0.1,
        "max_position_embeddings": 512,
        "type_vocab_size": 0,
        "initializer_range": 0.02,
        "layer_norm_eps": 1e-7,
        "relative_attention": False,
        "max_relative_positions": -1,
        "pad_token_id": 0,
        "position_biased_input": True,
        "pooler_dropout": 0.0,
        "pooler_hidden_act": "gelu",
        "legacy": True,
        "tie_word_embeddings": True,
    },
}
# Buffers transformers saves, and the replaced-token-detection head of the published
# checkpoints (transformers skips it too); never loaded.
IGNORED = re.compile(r"^(deberta\.)?embeddings\.(position_ids|token_type_ids)$|^mask_predictions\.")
ABSOLUTE_TABLE = "embeddings.position_embeddings.weight"


def _terms(hf: dict[str, Any]) -> list[str]:
    terms = hf.get("pos_att_type") or []
    if isinstance(terms, str):
        terms = [t.strip() for t in terms.lower().split("|")]
    unknown = [t for t in terms if t not in ("c2p", "p2c")]
    if unknown or not terms:
        raise HFCheckpointError(
            f"DeBERTa-v2: pos_att_type={hf.get('pos_att_type')!r} is not supported; attnlab's "
            "disentangled attention takes c2p, p2c or both"
        )
    return list(dict.fromkeys(terms))  # (transformers reads each once)


def config_from_hf(hf: dict[str, Any], model_type: str = "deberta-v2") -> EncoderConfig:
    archs = hf.get("architectures") or ["DebertaV2Model"]
    if archs[0] in REFUSED_ARCHITECTURES:
        raise HFCheckpointError(f"DeBERTa-v2: {archs[0]} is not supported; import DebertaV2Model")
    if not hf.get("relative_attention", False):
        raise HFCheckpointError(
            "DeBERTa-v2: relative_attention=false is not supported "
            "(attnlab's DeBERTa is disentangled attention): set it true"
        )
    if hf.get("conv_kernel_size", 0) > 0:
        raise HFCheckpointError(
            f"DeBERTa-v2: conv_kernel_size={hf['conv_kernel_size']} (the first layer's "
            "ConvLayer) is not supported; only models without it (conv_kernel_size 0)"
        )
    d = get(hf, "hidden_size")
    if hf.get("embedding_size", d) != d:
        raise HFCheckpointError(
            f"DeBERTa-v2: embedding_size={hf['embedding_size']} differs "
            f"from hidden_size={d} (embed_proj) and is not supported"
        )
    heads = get(hf, "num_attention_heads")
    if hf.get("attention_head_size", d // heads) * heads != d:
        raise HFCheckpointError(
            "DeBERTa-v2: attention_head_size must be hidden_size / num_attention_heads"
        )
    norm_rel = [x.strip() for x in str(hf.get("norm_rel_ebd", "none")).lower().split("|")]
    if any(x not in ("none", "layer_norm") for x in norm_rel):
        raise HFCheckpointError(
            f"DeBERTa-v2: norm_rel_ebd={hf['norm_rel_ebd']!r} is not "
            "supported; use 'layer_norm' or 'none'"
        )
    if hf.get("pooler_hidden_size", d) != d:
        raise HFCheckpointError(
            f"DeBERTa-v2: pooler_hidden_size={hf['pooler_hidden_size']} differs from "
            f"hidden_size={d} and is not supported"
        )
    buckets = hf.get("position_buckets", -1)
    max_rel = get(hf, "max_relative_positions")
    if max_rel < 1:
        max_rel = get(hf, "max_position_embeddings")
    # DebertaV2ForTokenClassification / ForQuestionAnswering lay out as BERT's heads
    plain = {**hf, "architectures": archs, "type_vocab_size": get(hf, "type_vocab_size")}
    names = {arch.replace("DebertaV2", "Bert"): head for arch, head in
             HEAD_ARCHITECTURES.items()}  # fmt: skip
    plain["architectures"] = [a.replace("DebertaV2", "Bert") for a in archs]
    cfg = bert.encoder_config_from_hf(plain, names, "DeBERTa-v2")
    pooled = {}
    if cfg.head == "sequence":
        if get(hf, "pooler_dropout"):
            warnings.warn(
                f"config.json pooler_dropout={hf['pooler_dropout']}: attnlab's DeBERTa "
                "pooler drops out after its dense layer only (training only; evaluation is "
                "unaffected)",
                stacklevel=3,
            )
        act = activation(get(hf, "pooler_hidden_act"), "pooler_hidden_act")
        pooled = {
            "classifier_dropout": hf.get("cls_dropout"),
            "head_activation": None if act == cfg.ffn.activation else act,
        }
    return cfg.override(
        {
            **pooled,
            "classifier_transform": "context_pooler",
            "position.kind": "disentangled",
            "position.disentangled_terms": _terms(hf),
            "position.disentangled_buckets": max(buckets, 0),
            "position.disentangled_max_distance": max_rel,
            "position.disentangled_share_key": bool(hf.get("share_att_key", False)),
            "position.disentangled_norm": "layer_norm" in norm_rel,
            "position.disentangled_absolute": bool(get(hf, "position_biased_input")),
            "norm.eps": float(get(hf, "layer_norm_eps")),
            # legacy=false: the decoder is the word embedding itself, whatever the tying
            "tie_embeddings": bool(get(hf, "tie_word_embeddings")) or not get(hf, "legacy"),
        }
    )


def exports(cfg: ModelConfig) -> bool:
    """The encoders with disentangled attention, and those with DeBERTa's ContextPooler
    (which the other layouts would drop: export_type names what else they lack)."""
    return isinstance(cfg, EncoderConfig) and (
        cfg.position.kind == "disentangled" or cfg.classifier_transform == "context_pooler"
    )


def export_type(cfg: ModelConfig) -> str:
    """``deberta-v2``, or HFCheckpointError naming what DeBERTa lacks."""
    assert isinstance(cfg, EncoderConfig)
    problems = [
        p for p in bert.layout_problems(cfg, "DeBERTa")
        if "learned positions" not in p and "token types" not in p
    ]  # fmt: skip
    if not cfg.embedding_norm:
        problems.append("DeBERTa has an embedding LayerNorm")
    if cfg.position.kind != "disentangled":
        problems.append(
            f"position.kind={cfg.position.kind!r} (DeBERTa's is 'disentangled'; "
            "classifier_transform='context_pooler' exports as deberta-v2 only)"
        )
    for field, value, theirs in (
        ("first_attn_norm", cfg.first_attn_norm, True),
        ("head_bias", cfg.head_bias, True),
        ("decoder_bias", cfg.decoder_bias, True),
        ("head_activation", None if cfg.head == "sequence" else cfg.head_activation, None),
        ("position.padding_idx", cfg.position.padding_idx, None),
    ):
        if value != theirs:
            problems.append(f"{field}={value!r} (DeBERTa's is {theirs!r})")
    transform = cfg.classifier_transform if cfg.head == "sequence" else "context_pooler"
    if transform != "context_pooler":
        problems.append(f"classifier_transform={transform!r} (DeBERTa's is 'context_pooler')")
    if problems:
        raise unrepresentable("; ".join(problems))
    return "deberta-v2"


def config_to_hf(cfg: EncoderConfig, model_type: str, dtype: torch.dtype) -> dict[str, Any]:
    pos = cfg.position
    written = bert.config_to_hf(cfg, model_type, dtype)
    for key in ("position_embedding_type", "classifier_dropout"):
        written.pop(key)
    return {
        **written,
        "model_type": "deberta-v2",
        "architectures": [ARCHITECTURE_OF_HEAD[cfg.head]],
        "relative_attention": True,
        "pos_att_type": list(pos.disentangled_terms),
        "position_buckets": pos.disentangled_buckets or -1,
        "max_relative_positions": pos.disentangled_max_distance,
        "share_att_key": pos.disentangled_share_key,
        "norm_rel_ebd": "layer_norm" if pos.disentangled_norm else "none",
        "position_biased_input": pos.disentangled_absolute,
        "conv_kernel_size": 0,
        "legacy": True,
        "pooler_hidden_size": cfg.d_model,
        "pooler_hidden_act": hf_activation(
            cfg.head_activation or cfg.ffn.activation, bert.TO_HF_ACTIVATIONS
        ),
        "pooler_dropout": 0.0,
        "cls_dropout": cfg.classifier_dropout,
    }


def _specs(cfg: EncoderConfig, b: str, legacy: bool = True) -> Specs:
    """attnlab name -> HF name(s); ``b`` the backbone prefix (``deberta.`` or none);
    ``legacy``: the masked-LM head under cls.predictions (else lm_predictions.lm_head)."""
    wb = ("weight", "bias")
    pos = cfg.position
    specs: Specs = {"tok_emb.weight": f"{b}embeddings.word_embeddings.weight"}
    if pos.disentangled_absolute:
        specs["pos_emb.weight"] = f"{b}{ABSOLUTE_TABLE}"
    if cfg.type_vocab_size:
        specs["type_emb.weight"] = f"{b}embeddings.token_type_embeddings.weight"
    specs |= {f"emb_norm.{s}": f"{b}embeddings.LayerNorm.{s}" for s in wb}
    specs["pos_bias.embeddings.weight"] = f"{b}encoder.rel_embeddings.weight"
    if pos.disentangled_norm:
        specs |= {f"pos_bias.norm.{s}": f"{b}encoder.LayerNorm.{s}" for s in wb}
    own = {"c2p": ("pos_key", "pos_key_proj"), "p2c": ("pos_query", "pos_query_proj")}
    for i in range(cfg.n_layers):
        h, a = f"{b}encoder.layer.{i}.", f"blocks.{i}."
        for s in wb:
            specs[f"{a}attn.qkv.{s}"] = [
                f"{h}attention.self.{n}_proj.{s}" for n in ("query", "key", "value")
            ]
            specs |= {f"{a}{ours}.{s}": f"{h}{theirs}.{s}" for ours, theirs in bert._BLOCK}
            if not pos.disentangled_share_key:
                for term in pos.disentangled_terms:
                    ours, theirs = own[term]
                    specs[f"{a}attn.{ours}.{s}"] = f"{h}attention.self.{theirs}.{s}"
    if cfg.head == "mlm":
        dense, norm, bias = (
            ("cls.predictions.transform.dense", "cls.predictions.transform.LayerNorm",
             "cls.predictions.bias") if legacy else
            ("lm_predictions.lm_head.dense", "lm_predictions.lm_head.LayerNorm",
             "lm_predictions.lm_head.bias")
        )  # fmt: skip
        specs |= {f"head.transform.{s}": f"{dense}.{s}" for s in wb}
        specs |= {f"head.norm.{s}": f"{norm}.{s}" for s in wb}
        specs["head.bias"] = bias
        if not cfg.tie_embeddings:
            specs["head.decoder.weight"] = "cls.predictions.decoder.weight"
    elif cfg.head == "sequence":
        specs |= {f"head.pooler.{s}": f"pooler.dense.{s}" for s in wb}
        specs |= {f"head.classifier.{s}": f"classifier.{s}" for s in wb}
    elif cfg.head == "token":
        specs |= {f"head.classifier.{s}": f"classifier.{s}" for s in wb}
    elif cfg.head == "qa":
        specs |= {f"head.span.{s}": f"qa_outputs.{s}" for s in wb}
    return specs


def weights_to_attnlab(src: Source, cfg: EncoderConfig) -> Plan:
    b = prefix(src, "deberta.", "embeddings.word_embeddings.weight")
    legacy = not src.has("lm_predictions.lm_head.bias")
    plan = src.plan(_specs(cfg, b, legacy))
    if not cfg.position.disentangled_absolute:  # stored by some checkpoints, never read
        src.skip(f"{b}{ABSOLUTE_TABLE}")
    if cfg.head == "mlm" and legacy:  # stored copies: the decoder bias, the tied weight
        read_mlm_decoder(src, plan, cfg, "cls.predictions.decoder")
    return plan  # type: ignore[return-value]  # None entries only with src.missing/wrong


def weights_from_attnlab(
    sd: dict[str, Tensor], cfg: EncoderConfig, model_type: str
) -> dict[str, Tensor]:
    out = unplan(_specs(cfg, "" if cfg.head == "none" else "deberta."), sd)
    if cfg.head == "mlm":
        write_mlm_decoder(out, sd, cfg, "cls.predictions.decoder")
    return out


FAMILY = Family(
    name="deberta_v2",
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
