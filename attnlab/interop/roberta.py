"""RoBERTa (``model_type`` roberta) and XLM-RoBERTa (``xlm-roberta``, the same architecture
with a larger vocabulary) <-> attnlab :class:`~attnlab.models.encoder.EncoderModel`; the
head follows config.json's ``architectures``: ``RobertaForMaskedLM`` (mlm),
``RobertaForSequenceClassification`` (sequence), ``RobertaForTokenClassification`` (token),
``RobertaForQuestionAnswering`` (qa), ``RobertaModel`` (none), and the ``XLMRoberta...``
classes alike. Labels, ``problem_type`` and the task an imported head serves as bert.py's.

RoBERTa (Liu et al. 2019) is BERT's encoder (post-norm blocks, the same layer names,
read by bert.py's backbone mapping) with:

- positions counted past the padding token (``position.padding_idx`` = ``pad_token_id``):
  transformers' create_position_ids_from_input_ids gives a token padding_idx + the number of
  non-padding tokens up to it and padding padding_idx, so the learned table has
  ``max_position_embeddings`` = max_seq_len + pad_token_id + 1 rows (514 for 512 tokens);
- a classification head of its own (``classifier_transform='roberta'``): the first token
  (<s>) -> dropout -> dense -> tanh -> dropout -> out_proj, no pooler; the dense layer is
  attnlab's ``head.pooler`` and out_proj ``head.classifier``;
- a masked-LM head whose activation is GELU whatever ``hidden_act`` (``head_activation``
  'gelu' where hidden_act is another), then LayerNorm and the decoder tied to the token
  embedding with its own bias, as BERT's;
- one token type in the published models (``type_vocab_size`` 1).

Layouts, HF (``roberta.`` under a head) -> attnlab, beyond bert.py's backbone:

    lm_head.dense, lm_head.layer_norm        -> head.transform, head.norm
    lm_head.bias (= lm_head.decoder.bias)    -> head.bias (untied: lm_head.decoder.bias)
    lm_head.decoder.weight                   -> head.decoder (tied to tok_emb)
    classifier.dense, classifier.out_proj    -> head.pooler, head.classifier (sequence)
    classifier / qa_outputs                  -> head.classifier / head.span
    pooler.dense                             -> (RobertaModel's; unused, not read)

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
    read_mlm_decoder,
    unplan,
    unrepresentable,
    write_mlm_decoder,
)
from attnlab.models.encoder import EncoderConfig

_HEADS = {
    "ForMaskedLM": "mlm",
    "Model": "none",
    "ForSequenceClassification": "sequence",
    "ForTokenClassification": "token",
    "ForQuestionAnswering": "qa",
}
CLASS_PREFIX = {"roberta": "Roberta", "xlm-roberta": "XLMRoberta"}
# model_type -> {transformers class -> head}
HEAD_ARCHITECTURES = {
    t: {f"{name}{suffix}": head for suffix, head in _HEADS.items()}
    for t, name in CLASS_PREFIX.items()
}
ARCHITECTURES = {t: tuple(heads) for t, heads in HEAD_ARCHITECTURES.items()}

# transformers' RobertaConfig / XLMRobertaConfig class defaults for the config.json keys
# read here (Family.defaults): BERT's but the vocabulary and the special tokens.
_BERT = {k: v for k, v in bert.DEFAULTS["bert"].items() if k != "vocab_size"}
DEFAULTS: dict[str, dict[str, Any]] = {
    "roberta": {**_BERT, "vocab_size": 50265, "pad_token_id": 1},
    "xlm-roberta": {**_BERT, "vocab_size": 30522, "pad_token_id": 1},
}
# Buffers transformers saves (position and token-type ids); recomputed, never loaded.
IGNORED = re.compile(r"^(roberta\.)?embeddings\.(position_ids|token_type_ids)$")
LM_HEAD_ACTIVATION = "gelu"  # RobertaLMHead's, whatever hidden_act


def config_from_hf(hf: dict[str, Any], model_type: str = "roberta") -> EncoderConfig:
    cfg = bert.encoder_config_from_hf(hf, HEAD_ARCHITECTURES[model_type], "RoBERTa")
    pad = hf.get("pad_token_id")
    if not isinstance(pad, int) or isinstance(pad, bool) or pad < 0:
        raise HFCheckpointError(
            f"config.json pad_token_id={pad!r}: RoBERTa counts its positions past the padding "
            "token, so it needs that token's id (the published models' is 1)"
        )
    n_positions = get(hf, "max_position_embeddings")
    if n_positions <= pad + 1:
        raise HFCheckpointError(
            f"config.json max_position_embeddings={n_positions} leaves no position past "
            f"pad_token_id={pad} (RoBERTa's first token is at pad_token_id + 1); raise it to "
            f"at least {pad + 2}"
        )
    if pad >= cfg.vocab_size:
        raise HFCheckpointError(
            f"config.json pad_token_id={pad} is not below vocab_size={cfg.vocab_size}"
        )
    act = cfg.ffn.activation
    return cfg.override(
        {
            "max_seq_len": n_positions - pad - 1,
            "position.padding_idx": pad,
            "classifier_transform": "roberta",
            "head_activation": None if act == LM_HEAD_ACTIVATION else LM_HEAD_ACTIVATION,
        }
    )


def exports(cfg: ModelConfig) -> bool:
    """Encoders with RoBERTa's pieces (positions past a padding id, its classification
    head), which BERT's and ModernBERT's layouts would drop."""
    return isinstance(cfg, EncoderConfig) and (
        cfg.position.padding_idx is not None or cfg.classifier_transform == "roberta"
    )


def export_type(cfg: ModelConfig) -> str:
    """``roberta`` (XLM-RoBERTa's configs are RoBERTa's: export writes roberta), or
    HFCheckpointError naming what RoBERTa lacks."""
    assert isinstance(cfg, EncoderConfig)
    problems = bert.layout_problems(cfg, "RoBERTa")
    # (the classification transform is the sequence head's only: other heads build none)
    transform = cfg.classifier_transform if cfg.head == "sequence" else "roberta"
    for field, value, theirs in (
        ("classifier_transform", transform, "roberta"),
        ("first_attn_norm", cfg.first_attn_norm, True),
        ("pooling", cfg.pooling, "cls"),
        ("head_bias", cfg.head_bias, True),
        ("decoder_bias", cfg.decoder_bias, True),
        ("head_activation (or ffn.activation)", cfg.head_activation or cfg.ffn.activation,
         LM_HEAD_ACTIVATION),
    ):  # fmt: skip
        if value != theirs:
            problems.append(f"{field}={value!r} (RoBERTa's is {theirs!r})")
    if cfg.position.padding_idx is None:
        problems.append(
            "position.padding_idx=None (RoBERTa counts positions past the padding token's id: "
            "set it, e.g. to 1)"
        )
    if problems:
        raise unrepresentable("; ".join(problems))
    return "roberta"


def config_to_hf(cfg: EncoderConfig, model_type: str, dtype: torch.dtype) -> dict[str, Any]:
    pad = cfg.position.padding_idx
    assert pad is not None
    written = bert.config_to_hf(cfg, model_type, dtype)
    arch = f"{CLASS_PREFIX[model_type]}{next(s for s, h in _HEADS.items() if h == cfg.head)}"
    return {
        **written,
        "model_type": model_type,
        "architectures": [arch],
        "max_position_embeddings": cfg.max_seq_len + pad + 1,
        "pad_token_id": pad,
        # RoBERTa's <s> and </s> (transformers' defaults): attnlab models record none, and
        # the layers read neither
        "bos_token_id": DEFAULT_BOS,
        "eos_token_id": DEFAULT_EOS,
    }


DEFAULT_BOS, DEFAULT_EOS = 0, 2  # RobertaConfig's


def _specs(cfg: EncoderConfig, b: str) -> Specs:
    """attnlab name -> HF name(s); ``b`` the backbone prefix (``roberta.`` or none)."""
    wb = ("weight", "bias")
    specs = bert.backbone_specs(cfg, b)
    if cfg.head == "mlm":
        specs |= {f"head.transform.{s}": f"lm_head.dense.{s}" for s in wb}
        specs |= {f"head.norm.{s}": f"lm_head.layer_norm.{s}" for s in wb}
        specs["head.bias"] = "lm_head.bias"
        if not cfg.tie_embeddings:
            specs["head.decoder.weight"] = "lm_head.decoder.weight"
    elif cfg.head == "sequence":
        specs |= {f"head.pooler.{s}": f"classifier.dense.{s}" for s in wb}
        specs |= {f"head.classifier.{s}": f"classifier.out_proj.{s}" for s in wb}
    elif cfg.head == "token":
        specs |= {f"head.classifier.{s}": f"classifier.{s}" for s in wb}
    elif cfg.head == "qa":
        specs |= {f"head.span.{s}": f"qa_outputs.{s}" for s in wb}
    return specs


def weights_to_attnlab(src: Source, cfg: EncoderConfig) -> Plan:
    b = prefix(src, "roberta.", "embeddings.word_embeddings.weight")
    plan = src.plan(_specs(cfg, b))
    for s in ("weight", "bias"):  # RobertaModel's pooler: no head attnlab maps uses it
        src.skip(f"{b}pooler.dense.{s}")
    if cfg.head == "mlm":  # stored copies: the decoder bias, the tied decoder weight
        read_mlm_decoder(src, plan, cfg, "lm_head.decoder")
    return plan  # type: ignore[return-value]  # None entries only with src.missing/wrong


def weights_from_attnlab(
    sd: dict[str, Tensor], cfg: EncoderConfig, model_type: str
) -> dict[str, Tensor]:
    out = unplan(_specs(cfg, "" if cfg.head == "none" else "roberta."), sd)
    if cfg.head == "mlm":
        write_mlm_decoder(out, sd, cfg, "lm_head.decoder")
    return out


FAMILY = Family(
    name="roberta",
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
