"""ELECTRA (``model_type`` electra) <-> attnlab :class:`~attnlab.models.encoder.EncoderModel`;
the head follows config.json's ``architectures``: ``ElectraForPreTraining`` (the
discriminator: ``replaced_token``), ``ElectraForMaskedLM`` (the generator: mlm),
``ElectraForSequenceClassification`` (sequence), ``ElectraForTokenClassification`` (token),
``ElectraForQuestionAnswering`` (qa), ``ElectraModel`` (none). Labels, ``problem_type`` and
the task an imported head serves as bert.py's (the discriminator's: none runs it, as the base
model's). The multiple-choice and causal-LM classes are not read (no attnlab head is theirs);
the ``summary_*`` keys configure only the multiple-choice head, and are neither read nor
written.

ELECTRA (Clark et al. 2020) is BERT's post-norm encoder with:

- embeddings ``embedding_size`` E wide (token, position and token-type tables and their
  LayerNorm), then ``embeddings_project`` E -> hidden where E != hidden (attnlab's
  ``embedding_size`` and ``emb_proj``, ALBERT's layout; E == hidden: ``embedding_size``
  None, no map, as transformers builds none);
- the discriminator's head (``head='replaced_token'``): dense hidden -> hidden, hidden_act,
  ``dense_prediction`` hidden -> 1, one logit per token; its loss is the sigmoid
  cross-entropy over the real tokens;
- the generator's masked-LM head: dense hidden -> E, GELU (always the exact one, whatever
  hidden_act: ``head_activation`` 'gelu' where hidden_act differs), LayerNorm, then
  ``generator_lm_head`` E -> V with a bias, tied to the token table;
- the sequence head (``classifier_transform='electra'``, every imported ELECTRA's): the
  first token, dropout -> dense -> GELU -> dropout -> ``out_proj``; token and QA heads as
  BERT's.

Layouts, HF (``electra.`` under a head) -> attnlab:

    embeddings.{word,position,token_type}_embeddings, LayerNorm -> tok_emb, pos_emb, type_emb,
                                                                   emb_norm (E wide)
    embeddings_project                                           -> emb_proj (E != hidden)
    encoder.layer.i.*                                            -> blocks.i.* (bert.py's)
    discriminator_predictions.dense, .dense_prediction           -> head.dense, head.prediction
    generator_predictions.dense, .LayerNorm                      -> head.transform, head.norm
    generator_lm_head.bias, .weight                              -> head.bias, head.decoder
                                                                   (tied: tok_emb)
    classifier.dense, classifier.out_proj (sequence)             -> head.pooler, head.classifier
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
    Plan,
    Source,
    Specs,
    get,
    prefix,
    unplan,
    unrepresentable,
)
from attnlab.models.encoder import EncoderConfig

HEAD_ARCHITECTURES = {
    "ElectraForPreTraining": "replaced_token",
    "ElectraModel": "none",
    "ElectraForMaskedLM": "mlm",
    "ElectraForSequenceClassification": "sequence",
    "ElectraForTokenClassification": "token",
    "ElectraForQuestionAnswering": "qa",
}
ARCHITECTURES = {"electra": tuple(HEAD_ARCHITECTURES)}
ARCHITECTURE_OF_HEAD = {head: arch for arch, head in HEAD_ARCHITECTURES.items()}
# the generator head's activation: transformers' get_activation("gelu"), whatever hidden_act
GENERATOR_ACTIVATION = "gelu"

# transformers' ElectraConfig class defaults for the config.json keys read here
# (Family.defaults): electra-small's discriminator sizes.
DEFAULTS: dict[str, dict[str, Any]] = {
    "electra": {
        "vocab_size": 30522,
        "embedding_size": 128,
        "hidden_size": 256,
        "num_hidden_layers": 12,
        "num_attention_heads": 4,
        "intermediate_size": 1024,
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.1,
        "attention_probs_dropout_prob": 0.1,
        "max_position_embeddings": 512,
        "type_vocab_size": 2,
        "initializer_range": 0.02,
        "layer_norm_eps": 1e-12,
        "pad_token_id": 0,
        "tie_word_embeddings": True,
    },
}
# Buffers transformers saves (position and token-type ids); recomputed, never loaded.
IGNORED = re.compile(r"^(electra\.)?embeddings\.(position_ids|token_type_ids)$")


def config_from_hf(hf: dict[str, Any], model_type: str = "electra") -> EncoderConfig:
    cfg = bert.encoder_config_from_hf(hf, HEAD_ARCHITECTURES, "ELECTRA")
    e = get(hf, "embedding_size")
    head_act = None
    if cfg.head == "mlm" and cfg.ffn.activation != GENERATOR_ACTIVATION:
        head_act = GENERATOR_ACTIVATION
    return cfg.override(
        {
            # E == hidden: transformers builds no embeddings_project
            "embedding_size": None if e == cfg.d_model else e,
            "classifier_transform": "electra",
            "head_activation": head_act,
        }
    )


def exports(cfg: ModelConfig) -> bool:
    """Encoders with ELECTRA's discriminator head or its classification head (which every
    imported ELECTRA has): the other layouts hold neither."""
    return isinstance(cfg, EncoderConfig) and (
        cfg.head == "replaced_token" or cfg.classifier_transform == "electra"
    )


def export_type(cfg: ModelConfig) -> str:
    """``electra``, or HFCheckpointError naming what ELECTRA lacks."""
    assert isinstance(cfg, EncoderConfig)
    problems = bert.layout_problems(cfg, "ELECTRA", shared=True)
    # (classifier_transform: ELECTRA's, or the discriminator head's, which reads none)
    for field, value, theirs in (
        ("pooling", cfg.pooling, "cls"),
        ("head_bias", cfg.head_bias, True),
        ("decoder_bias", cfg.decoder_bias, True),
        ("position.padding_idx", cfg.position.padding_idx, None),
        ("first_attn_norm", cfg.first_attn_norm, True),
        ("layer_sets", cfg.layer_sets, None),
    ):
        if value != theirs:
            problems.append(f"{field}={value!r} (ELECTRA's is {theirs!r})")
    if cfg.embedding_size == cfg.d_model:
        problems.append(
            f"embedding_size={cfg.embedding_size} equals d_model (ELECTRA maps its embeddings "
            "only where they are narrower or wider: set it to null)"
        )
    act, head_act = cfg.ffn.activation, cfg.head_activation
    if cfg.head == "mlm" and (head_act or act) != GENERATOR_ACTIVATION:
        problems.append(
            f"head_activation={head_act!r} with ffn.activation={act!r} (ELECTRA's generator "
            f"head applies {GENERATOR_ACTIVATION!r}: set head_activation to it)"
        )
    elif cfg.head == "replaced_token" and head_act not in (None, act):
        problems.append(
            f"head_activation={head_act!r} (ELECTRA's discriminator head applies hidden_act, "
            f"the layers' {act!r}: set it to null)"
        )
    elif cfg.head not in ("mlm", "replaced_token") and head_act is not None:
        problems.append(f"head_activation={head_act!r} (ELECTRA's {cfg.head} head has none)")
    if problems:
        raise unrepresentable("; ".join(problems))
    return "electra"


def config_to_hf(cfg: EncoderConfig, model_type: str, dtype: torch.dtype) -> dict[str, Any]:
    # BERT's entries (the discriminator's as its base model's: BERT has no such head)
    base = cfg.override({"head": "none"}) if cfg.head == "replaced_token" else cfg
    written = bert.config_to_hf(base, model_type, dtype)
    written.pop("position_embedding_type")
    return {
        **written,
        "model_type": "electra",
        "architectures": [ARCHITECTURE_OF_HEAD[cfg.head]],
        "embedding_size": cfg.embedding_size or cfg.d_model,
    }


def _specs(cfg: EncoderConfig, b: str) -> Specs:
    """attnlab name -> HF name(s); ``b`` the backbone prefix (``electra.`` or none)."""
    wb = ("weight", "bias")
    specs = bert.backbone_specs(cfg, b)
    if cfg.embedding_size is not None:
        specs |= {f"emb_proj.{s}": f"{b}embeddings_project.{s}" for s in wb}
    if cfg.head == "replaced_token":
        p = "discriminator_predictions."
        specs |= {f"head.dense.{s}": f"{p}dense.{s}" for s in wb}
        specs |= {f"head.prediction.{s}": f"{p}dense_prediction.{s}" for s in wb}
    elif cfg.head == "mlm":
        specs |= {f"head.transform.{s}": f"generator_predictions.dense.{s}" for s in wb}
        specs |= {f"head.norm.{s}": f"generator_predictions.LayerNorm.{s}" for s in wb}
        specs["head.bias"] = "generator_lm_head.bias"
        if not cfg.tie_embeddings:
            specs["head.decoder.weight"] = "generator_lm_head.weight"
    elif cfg.head == "sequence":
        specs |= {f"head.pooler.{s}": f"classifier.dense.{s}" for s in wb}
        specs |= {f"head.classifier.{s}": f"classifier.out_proj.{s}" for s in wb}
    elif cfg.head == "token":
        specs |= {f"head.classifier.{s}": f"classifier.{s}" for s in wb}
    elif cfg.head == "qa":
        specs |= {f"head.span.{s}": f"qa_outputs.{s}" for s in wb}
    return specs


def weights_to_attnlab(src: Source, cfg: EncoderConfig) -> Plan:
    b = prefix(src, "electra.", "embeddings.word_embeddings.weight")
    plan = src.plan(_specs(cfg, b))
    if cfg.head == "mlm" and cfg.tie_embeddings:  # a stored copy of the token table
        src.tied("generator_lm_head.weight", plan["tok_emb.weight"])
    return plan  # type: ignore[return-value]  # None entries only with src.missing/wrong


def weights_from_attnlab(
    sd: dict[str, Tensor], cfg: EncoderConfig, model_type: str
) -> dict[str, Tensor]:
    return unplan(_specs(cfg, "" if cfg.head == "none" else "electra."), sd)


FAMILY = Family(
    name="electra",
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
