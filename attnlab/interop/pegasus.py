"""Pegasus (``model_type`` pegasus, ``PegasusForConditionalGeneration``) <-> attnlab
:class:`~attnlab.models.seq2seq.Seq2SeqModel`.

Pegasus (Zhang et al. 2020) is an encoder–decoder with Marian's fixed sinusoids (all sines
then all cosines, frequencies 10000^(-2j/d): ``sinusoid_layout`` split, positions 0, 1, ...
whatever the padding), pre-norm blocks with a final LayerNorm after each stack
(``final_norm``), MLPs of ``activation_function`` (ReLU in google/pegasus-* checkpoints,
GELU the class default), embeddings scaled by sqrt(d) where ``scale_embedding`` says (the
checkpoints: true), one vocabulary shared by source, target and output (tied) and a
``final_logits_bias`` (a buffer there). transformers stores the sinusoid tables
(``embed_positions.weight``): import recomputes them, export writes them.

Decoding starts from ``decoder_start_token_id`` (the pad token, 0) and ``forced_eos_token_id``
(the end token, 1) ends length-limited outputs (``forced_eos_ids``); ``forced_bos_token_id``
where given is the only first token allowed (``forced_bos_id``). Left out, as training-only
settings attnlab has no place for: ``activation_dropout`` and the layer drops (export writes
them as 0); generation defaults (``num_beams``, ``length_penalty``, ...) are
``attnlab translate``'s options. Different encoder and decoder widths are refused by name;
depths may differ. With ``tie_word_embeddings=false`` transformers ties nothing.

    model.shared (= encoder/decoder embed_tokens, lm_head)   -> src_emb (= tgt_emb, lm_head)
    {encoder,decoder}.layers.i: as Marian's (interop/marian.py)
    model.{encoder,decoder}.layer_norm                        -> enc_norm, dec_norm
    final_logits_bias (1, V)                                  -> logits_bias (V,)
    model.{encoder,decoder}.embed_positions.weight (sinusoids) -> recomputed

Shapes: d d_model, V vocabulary size.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import Tensor

from attnlab.config import ModelConfig, PositionConfig
from attnlab.interop import bart, m2m_100
from attnlab.interop.io import Family, Plan, Source, unrepresentable
from attnlab.models.seq2seq import Seq2SeqConfig
from attnlab.nn.embedding import sinusoidal_table

# PegasusModel (no head) and PegasusForCausalLM are refused by name.
ARCHITECTURES = {"pegasus": ("PegasusForConditionalGeneration",)}

# transformers' class defaults (PegasusConfig) for the config.json keys read here
# (Family.defaults); its bos_token_id is None (left out).
DEFAULTS: dict[str, dict[str, Any]] = {
    "pegasus": {
        "vocab_size": 50265,
        "max_position_embeddings": 1024,
        "encoder_layers": 12,
        "encoder_ffn_dim": 4096,
        "encoder_attention_heads": 16,
        "decoder_layers": 12,
        "decoder_ffn_dim": 4096,
        "decoder_attention_heads": 16,
        "activation_function": "gelu",
        "d_model": 1024,
        "dropout": 0.1,
        "attention_dropout": 0.0,
        "init_std": 0.02,
        "decoder_start_token_id": 0,
        "scale_embedding": False,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "forced_eos_token_id": 1,  # without generation_config.json (see with_generation_config)
        "tie_word_embeddings": True,
    },
}
# The fixed sinusoid tables transformers saves; recomputed, never loaded.
IGNORED = re.compile(r"^model\.(encoder|decoder)\.embed_positions\.weight$")


def config_from_hf(hf: dict[str, Any], model_type: str = "pegasus") -> Seq2SeqConfig:
    position = PositionConfig(kind="sinusoidal")
    return m2m_100.prenorm_config_from_hf(hf, "Pegasus", position, "split", logits_bias=True)


def exports(cfg: ModelConfig) -> bool:
    """The pre-norm encoder–decoders with sinusoids not M2M100's (Marian's are post-norm)."""
    return (
        isinstance(cfg, Seq2SeqConfig)
        and cfg.position.kind == "sinusoidal"
        and cfg.norm.placement == "pre"
    )


def export_type(cfg: ModelConfig) -> str:
    assert isinstance(cfg, Seq2SeqConfig)
    checks = m2m_100.prenorm_checks(cfg) + [
        (cfg.sinusoid_layout == "split", "split sinusoids (sinusoid_layout split)"),
        (cfg.final_logits_bias, "a final logits bias (final_logits_bias true)"),
    ]
    missing = [what for ok, what in checks if not ok]
    if missing:
        raise unrepresentable(f"Pegasus needs {'; '.join(missing)}")
    return "pegasus"


def config_to_hf(cfg: Seq2SeqConfig, model_type: str, dtype: torch.dtype) -> dict[str, Any]:
    written = bart.bart_style_config(cfg, model_type, dtype)
    return {**written, "architectures": list(ARCHITECTURES["pegasus"])}


def weights_to_attnlab(src: Source, cfg: Seq2SeqConfig) -> Plan:
    plan = m2m_100.prenorm_weights_to_attnlab(src, cfg)
    plan["logits_bias"] = src.take("final_logits_bias", (1, cfg.vocab_size))
    return plan


def weights_from_attnlab(
    sd: dict[str, Tensor], cfg: Seq2SeqConfig, model_type: str
) -> dict[str, Tensor]:
    out = m2m_100.prenorm_weights_from_attnlab(sd, cfg)
    emb = sd["src_emb.weight"]
    table = sinusoidal_table(torch.arange(cfg.max_seq_len), cfg.d_model)  # interleaved
    table = torch.cat((table[:, 0::2], table[:, 1::2]), dim=-1).to(emb.dtype)  # -> split
    out |= {
        "model.encoder.embed_positions.weight": table,
        "model.decoder.embed_positions.weight": table,
        "final_logits_bias": sd["logits_bias"][None, :],
    }
    return out


FAMILY = Family(
    name="pegasus",
    arch="seq2seq",
    architectures=ARCHITECTURES,
    config_from_hf=config_from_hf,
    defaults=DEFAULTS,
    config_to_hf=config_to_hf,  # type: ignore[arg-type]  # a Seq2SeqConfig family
    weights_to_attnlab=weights_to_attnlab,  # type: ignore[arg-type]
    weights_from_attnlab=weights_from_attnlab,  # type: ignore[arg-type]
    exports=exports,
    export_type=export_type,
    ignored=IGNORED,
    task=lambda cfg: "seq2seq",
)
