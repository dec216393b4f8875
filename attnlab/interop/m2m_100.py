"""M2M100 and NLLB (``model_type`` m2m_100, ``M2M100ForConditionalGeneration``) <-> attnlab
:class:`~attnlab.models.seq2seq.Seq2SeqModel`.

M2M100 (Fan et al. 2020) and NLLB-200 (NLLB Team 2022; its checkpoints use the same class)
are fairseq's many-to-many translation transformers: pre-norm blocks with a final LayerNorm
after each stack (``final_norm``), ReLU MLPs, embeddings scaled by sqrt(d)
(``scale_embedding``), one vocabulary shared by source, target and output (tied), no final
logits bias. Positions are fixed sinusoids counted past the padding id from the token ids
(``M2M100SinusoidalPositionalEmbedding``): a row's first real token is at pad + 1, whatever
padding precedes it, and a padding token adds a zero vector (``position.padding_idx`` =
``pad_id``); the sinusoids are tensor2tensor's, all sines then all cosines with frequencies
10000^(-j/(d/2 - 1)) (``sinusoid_layout`` tensor2tensor), computed, never stored. The token
embedding has the padding id as ``padding_idx`` (no gradient), as attnlab's does under
``position.padding_idx``. In the decoder the count restarts per forward call from the cached
length (transformers' ``cache_length``), as attnlab's decode under a cache does.

Decoding starts from ``decoder_start_token_id`` (the end token, 2); the target language is
the first token generated, forced by ``forced_bos_token_id`` (``Seq2SeqConfig.forced_bos_id``,
given to ``generate`` or stored in generation_config.json; export writes it there), and
``forced_eos_token_id`` where given ends length-limited outputs (``forced_eos_ids``). Left out,
as training-only settings attnlab has no place for: ``activation_dropout`` and
``encoder_layerdrop`` / ``decoder_layerdrop`` (export writes them as 0). Generation defaults
(``num_beams``, ``max_length``, ...) are ``attnlab translate``'s options, not read. Different
encoder and decoder widths (heads, FFN) are refused by name; depths may differ. With
``tie_word_embeddings=false`` transformers ties nothing (``model.shared`` stored but unused).

    model.shared (= encoder/decoder embed_tokens, lm_head)   -> src_emb (= tgt_emb, lm_head)
      untied: model.encoder.embed_tokens, decoder.embed_tokens, lm_head
                                                             -> src_emb, tgt_emb, lm_head
    {encoder,decoder}.layers.i: as Marian's (interop/marian.py)
    model.{encoder,decoder}.layer_norm                        -> enc_norm, dec_norm
    embed_positions (sinusoids, a buffer not saved)           -> recomputed

Shapes: d d_model, V vocabulary size.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import Tensor

from attnlab.config import AttentionConfig, FFNConfig, ModelConfig, NormConfig, PositionConfig
from attnlab.interop import bart, marian
from attnlab.interop.io import (
    Family,
    HFCheckpointError,
    Plan,
    Source,
    Specs,
    activation,
    get,
    unplan,
    unrepresentable,
)
from attnlab.models.seq2seq import Seq2SeqConfig

# M2M100Model (no head) is refused by name (registry.lookup lists it).
ARCHITECTURES = {"m2m_100": ("M2M100ForConditionalGeneration",)}

# transformers' class defaults (M2M100Config) for the config.json keys read here
# (Family.defaults).
DEFAULTS: dict[str, dict[str, Any]] = {
    "m2m_100": {
        "vocab_size": 128112,
        "max_position_embeddings": 1024,
        "encoder_layers": 12,
        "encoder_ffn_dim": 4096,
        "encoder_attention_heads": 16,
        "decoder_layers": 12,
        "decoder_ffn_dim": 4096,
        "decoder_attention_heads": 16,
        "activation_function": "relu",
        "d_model": 1024,
        "dropout": 0.1,
        "attention_dropout": 0.1,
        "init_std": 0.02,
        "decoder_start_token_id": 2,
        "scale_embedding": True,
        "pad_token_id": 1,
        "bos_token_id": 0,
        "eos_token_id": 2,
        "tie_word_embeddings": True,
    },
}
TO_HF_ACTIVATIONS = marian.TO_HF_ACTIVATIONS
# transformers' M2M100 and Pegasus LayerNorms: torch's default eps, which config.json cannot
# change.
LAYER_NORM_EPS = 1e-5
# Nothing stored is ignored (the sinusoids are a buffer transformers does not save).
IGNORED = re.compile(r"^$")


def prenorm_config_from_hf(
    hf: dict[str, Any], family: str, position: PositionConfig, layout: str, logits_bias: bool
) -> Seq2SeqConfig:
    """The config of a pre-norm encoder–decoder with sinusoids and final norms (M2M100's,
    Pegasus's): their config.json keys are BART's."""
    for a, b in [
        ("encoder_attention_heads", "decoder_attention_heads"),
        ("encoder_ffn_dim", "decoder_ffn_dim"),
    ]:
        if get(hf, a) != get(hf, b):
            raise HFCheckpointError(
                f"{a}={hf[a]} != {b}={hf[b]} is not supported (attnlab's encoder and decoder "
                "blocks have one width: give both the same value)"
            )
    d = get(hf, "d_model")
    if d % 2 or d < 4:
        raise HFCheckpointError(
            f"d_model={d}: {family}'s sinusoids need an even d_model of at least 4"
        )
    V = get(hf, "vocab_size")
    tie = bool(hf.get("tie_word_embeddings", True))
    eos = bart._one_token(hf, "eos_token_id")
    if eos is None:
        raise HFCheckpointError(f"config.json has no eos_token_id; {family}'s decoding ends at it")
    start = bart._one_token(hf, "decoder_start_token_id")
    if start is None:  # generate's fallback
        start = bart._one_token(hf, "bos_token_id")
    if start is None:
        raise HFCheckpointError(
            "config.json has neither decoder_start_token_id nor bos_token_id; generation "
            "starts from one of them"
        )
    dec = get(hf, "decoder_layers")
    return Seq2SeqConfig(
        vocab_size=V,
        max_seq_len=get(hf, "max_position_embeddings"),
        d_model=d,
        n_layers=get(hf, "encoder_layers"),
        n_decoder_layers=None if dec == get(hf, "encoder_layers") else dec,  # None: as many
        attention=AttentionConfig(
            n_heads=hf["encoder_attention_heads"],
            qkv_bias=True,
            out_bias=True,
            dropout=float(hf.get("attention_dropout", 0.0)),
        ),
        position=position,
        sinusoid_layout=layout,
        ffn=FFNConfig(
            kind="mlp",
            activation=activation(get(hf, "activation_function"), "activation_function"),
            hidden_dim=hf["encoder_ffn_dim"],
        ),
        norm=NormConfig(kind="layernorm", eps=LAYER_NORM_EPS, placement="pre"),
        final_norm=True,
        tie_embeddings=tie,
        share_embeddings=tie,
        src_vocab_size=None if tie else V,
        dropout=float(hf.get("dropout", 0.0)),
        init_std=float(hf.get("init_std", 0.02)),
        scale_embeddings=bool(hf.get("scale_embedding", False)),
        final_logits_bias=logits_bias,
        pad_id=get(hf, "pad_token_id"),
        bos_id=start,
        eos_id=eos,
        forced_bos_id=bart._one_token(hf, "forced_bos_token_id"),
        forced_eos_ids=marian.forced_eos_ids(hf.get("forced_eos_token_id")),
        blocked_ids=marian.blocked_ids(hf.get("bad_words_ids"), eos),
        renormalize_logits=bool(hf.get("renormalize_logits", False)),
    )


def config_from_hf(hf: dict[str, Any], model_type: str = "m2m_100") -> Seq2SeqConfig:
    pad = get(hf, "pad_token_id")
    position = PositionConfig(kind="sinusoidal", padding_idx=pad)
    return prenorm_config_from_hf(hf, "M2M100", position, "tensor2tensor", logits_bias=False)


def exports(cfg: ModelConfig) -> bool:
    """The encoder–decoders with M2M100's sinusoids (counted past the padding id, or
    tensor2tensor's frequencies); Pegasus and Marian take the other sinusoidal ones."""
    return (
        isinstance(cfg, Seq2SeqConfig)
        and cfg.position.kind == "sinusoidal"
        and (cfg.position.padding_idx is not None or cfg.sinusoid_layout == "tensor2tensor")
    )


def prenorm_checks(cfg: Seq2SeqConfig) -> list[tuple[bool, str]]:
    """What M2M100's and Pegasus's layouts share: each check and what it asks for."""
    att, ffn, norm = cfg.attention, cfg.ffn, cfg.norm
    final = cfg.final_norm if cfg.final_norm is not None else norm.placement == "pre"
    return [
        (
            norm.kind == "layernorm" and norm.bias and norm.eps == LAYER_NORM_EPS,
            f"LayerNorm with bias and eps={LAYER_NORM_EPS} (it has no eps setting)",
        ),
        (norm.placement == "pre" and final, "pre-norm blocks with final norms"),
        (not cfg.embedding_norm, "no norm on the embeddings (embedding_norm false)"),
        (
            ffn.kind == "mlp" and ffn.bias and ffn.activation in TO_HF_ACTIVATIONS,
            f"an MLP with biases ({', '.join(TO_HF_ACTIVATIONS)})",
        ),
        (
            att.kv_heads == att.n_heads and cfg.head_dim * cfg.n_heads == cfg.d_model,
            "multi-head attention of heads d_model / n_heads wide",
        ),
        (att.qkv_bias and att.out_bias, "attention with biases"),
        (att.scale is None, "the default softmax scale (attention.scale null)"),
        (
            att.softcap is None
            and att.sliding_window is None
            and not att.qk_norm
            and not att.sink_logits,
            "no soft-cap, window, QK-norm or sink logits",
        ),
        (
            cfg.share_embeddings == cfg.tie_embeddings and cfg.source_vocab_size == cfg.vocab_size,
            "one vocabulary, its tables shared and tied to the head (or none of them: "
            "share_embeddings = tie_embeddings)",
        ),
        (not cfg.scale_decoder_output, "no rescale of the decoder's output (T5's)"),
        (cfg.pad_id < cfg.source_vocab_size, "pad_id a token of the vocabulary"),
        (cfg.d_model >= 4, "d_model >= 4"),
    ]


def export_type(cfg: ModelConfig) -> str:
    assert isinstance(cfg, Seq2SeqConfig)
    checks = prenorm_checks(cfg) + [
        (
            cfg.sinusoid_layout == "tensor2tensor",
            "tensor2tensor sinusoids (sinusoid_layout tensor2tensor)",
        ),
        (
            cfg.position.padding_idx == cfg.pad_id,
            f"positions counted past the padding token (position.padding_idx={cfg.pad_id})",
        ),
        (not cfg.final_logits_bias, "no final logits bias (final_logits_bias false)"),
    ]
    missing = [what for ok, what in checks if not ok]
    if missing:
        raise unrepresentable(f"M2M100 needs {'; '.join(missing)}")
    return "m2m_100"


def config_to_hf(cfg: Seq2SeqConfig, model_type: str, dtype: torch.dtype) -> dict[str, Any]:
    written = bart.bart_style_config(cfg, model_type, dtype)
    return {**written, "architectures": list(ARCHITECTURES["m2m_100"])}


def prenorm_specs(cfg: Seq2SeqConfig) -> Specs:
    """attnlab name -> HF name: Marian's tables and blocks, and the final norms."""
    specs = marian._specs(cfg)
    for ours, stack in (("enc_norm", "encoder"), ("dec_norm", "decoder")):
        for s in ("weight", "bias"):
            specs[f"{ours}.{s}"] = f"model.{stack}.layer_norm.{s}"
    return specs


def prenorm_weights_to_attnlab(src: Source, cfg: Seq2SeqConfig) -> Plan:
    """The tables and blocks (the logits bias, where the family has one, is the caller's)."""
    plan = src.plan(prenorm_specs(cfg))
    if not cfg.share_embeddings:  # untied: transformers' forward skips `shared`
        src.skip("model.shared.weight")
    tied = marian._TIED_COPIES if cfg.share_embeddings else ()
    for name in tied + (("lm_head.weight",) if cfg.tie_embeddings else ()):
        src.tied(name, plan["src_emb.weight"])  # tied: one table (stored copies must equal it)
    return plan  # type: ignore[return-value]  # None entries only with src.missing/wrong


def prenorm_weights_from_attnlab(sd: dict[str, Tensor], cfg: Seq2SeqConfig) -> dict[str, Tensor]:
    """The tied table once (``model.shared``), as transformers writes it; untied, the
    tables of their own, and ``model.shared`` (unused) as the encoder's."""
    out = unplan(prenorm_specs(cfg), sd)
    if not cfg.share_embeddings:
        out["model.shared.weight"] = sd["src_emb.weight"]
    return out


def weights_from_attnlab(
    sd: dict[str, Tensor], cfg: Seq2SeqConfig, model_type: str
) -> dict[str, Tensor]:
    return prenorm_weights_from_attnlab(sd, cfg)


FAMILY = Family(
    name="m2m_100",
    arch="seq2seq",
    architectures=ARCHITECTURES,
    config_from_hf=config_from_hf,
    defaults=DEFAULTS,
    config_to_hf=config_to_hf,  # type: ignore[arg-type]  # a Seq2SeqConfig family
    weights_to_attnlab=prenorm_weights_to_attnlab,  # type: ignore[arg-type]
    weights_from_attnlab=weights_from_attnlab,  # type: ignore[arg-type]
    exports=exports,
    export_type=export_type,
    ignored=IGNORED,
    task=lambda cfg: "seq2seq",
)
