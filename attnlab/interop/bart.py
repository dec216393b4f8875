"""BART (``model_type`` bart, ``BartForConditionalGeneration``) and mBART (``mbart``,
``MBartForConditionalGeneration``) <-> attnlab :class:`~attnlab.models.seq2seq.Seq2SeqModel`.

BART (Lewis et al. 2020) is an encoder–decoder with learned positions, a LayerNorm on each
stack's embedded tokens (``layernorm_embedding``: ``embedding_norm``), post-norm blocks with
exact-GELU MLPs, one vocabulary shared by source, target and output (tied), and a
``final_logits_bias``. Its position tables have ``max_position_embeddings + 2`` rows and
position p reads row p + 2 (fairseq's offset past its padding index): attnlab keeps the whole
table (``position_offset`` 2), so rows 0 and 1, which nothing reads, are imported and
exported as stored. mBART (Liu et al. 2020) is the same with pre-norm blocks and a final
LayerNorm after each stack (``layer_norm``: ``final_norm``), and its checkpoints scale the
embeddings by sqrt(d) (``scale_embedding``). The kind of block follows ``model_type`` alone:
transformers ignores the legacy ``normalize_before`` / ``add_final_layer_norm`` keys, as
attnlab does. With ``tie_word_embeddings=false`` transformers ties nothing: the encoder, the
decoder and the output have tables of their own (``model.shared`` is then stored but unused).

Decoding starts from ``decoder_start_token_id`` (BART's end token, 2; where it is null, as
generate does, ``bos_token_id``); ``forced_bos_token_id`` (bart-large's 0, mBART-50's target
language) is the only first token allowed (``Seq2SeqConfig.forced_bos_id``) and
``forced_eos_token_id`` ends length-limited outputs (``forced_eos_ids``), as in transformers;
generation_config.json's values win over config.json's, as there. Left out, as training-only
settings attnlab has no place for: ``activation_dropout`` (dropout inside the MLP) and
``encoder_layerdrop`` / ``decoder_layerdrop`` (dropping whole layers); export writes them as
0. Generation defaults (``num_beams``, ``length_penalty``, ``no_repeat_ngram_size``, ...) are
``attnlab translate``'s options, not read. Different encoder and decoder widths (heads, FFN)
are refused by name; encoder and decoder depths may differ.

    model.shared (= encoder/decoder embed_tokens, lm_head)   -> src_emb (= tgt_emb, lm_head)
      untied: model.encoder.embed_tokens, decoder.embed_tokens, lm_head
                                                             -> src_emb, tgt_emb, lm_head
    model.{encoder,decoder}.embed_positions (P + 2, d)        -> {src,tgt}_pos (all rows)
    model.{encoder,decoder}.layernorm_embedding               -> {src,tgt}_emb_norm
    {encoder,decoder}.layers.i: as Marian's (interop/marian.py)
    model.{encoder,decoder}.layer_norm (mBART)                -> enc_norm, dec_norm
    final_logits_bias (1, V)                                  -> logits_bias (V,)

Shapes: d d_model, V vocabulary size, P max_position_embeddings.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import Tensor

from attnlab.config import AttentionConfig, FFNConfig, ModelConfig, NormConfig, PositionConfig
from attnlab.interop import marian
from attnlab.interop.io import (
    Family,
    HFCheckpointError,
    Plan,
    Source,
    Specs,
    activation,
    dtype_entries,
    get,
    hf_activation,
    unplan,
    unrepresentable,
)
from attnlab.models.seq2seq import Seq2SeqConfig

# BartModel / MBartModel (no head) and the classification, question-answering and
# decoder-only classes are refused by name (registry.lookup lists these).
ARCHITECTURES = {
    "bart": ("BartForConditionalGeneration",),
    "mbart": ("MBartForConditionalGeneration",),
}
# model_type -> placement of its blocks' norms (mBART's pre-norm adds a final norm per stack)
PLACEMENT = {"bart": "post", "mbart": "pre"}

# transformers' class defaults (BartConfig, MBartConfig) for the config.json keys read here
# (Family.defaults); MBartConfig's decoder_start_token_id is None (left out: generate then
# starts from bos_token_id).
_BART_DEFAULTS: dict[str, Any] = {
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
    "scale_embedding": False,
    "pad_token_id": 1,
    "bos_token_id": 0,
    "eos_token_id": 2,
    "decoder_start_token_id": 2,
    "forced_eos_token_id": 2,  # without generation_config.json (see with_generation_config)
    "tie_word_embeddings": True,
}
DEFAULTS: dict[str, dict[str, Any]] = {
    "bart": _BART_DEFAULTS,
    "mbart": {k: v for k, v in _BART_DEFAULTS.items() if k != "decoder_start_token_id"},
}
TO_HF_ACTIVATIONS = marian.TO_HF_ACTIVATIONS
# transformers' BART LayerNorms: torch's default eps, which config.json cannot change.
LAYER_NORM_EPS = 1e-5
# transformers' BartLearnedPositionalEmbedding: position p reads row p + 2.
POSITION_OFFSET = 2
# fairseq-converted checkpoints' version buffers, which transformers ignores on load.
IGNORED = re.compile(r"^(model\.)?(encoder|decoder)\.version$")


def _one_token(hf: dict[str, Any], key: str) -> int | None:
    value = hf.get(key)
    if isinstance(value, list):  # generation_config.json may list the end token(s)
        if len(value) != 1:
            raise HFCheckpointError(f"{key}={value}: only one token is supported")
        value = value[0]
    if value is not None and not isinstance(value, int):
        raise HFCheckpointError(f"config.json {key} must be a token id, got {value!r}")
    return value


def config_from_hf(hf: dict[str, Any], model_type: str = "bart") -> Seq2SeqConfig:
    for a, b in [
        ("encoder_attention_heads", "decoder_attention_heads"),
        ("encoder_ffn_dim", "decoder_ffn_dim"),
    ]:
        if get(hf, a) != get(hf, b):
            raise HFCheckpointError(
                f"{a}={hf[a]} != {b}={hf[b]} is not supported (attnlab's encoder and decoder "
                "blocks have one width: give both the same value)"
            )
    V = get(hf, "vocab_size")
    tie = bool(hf.get("tie_word_embeddings", True))
    eos = _one_token(hf, "eos_token_id")
    if eos is None:
        raise HFCheckpointError("config.json has no eos_token_id; BART's decoding ends at it")
    start = _one_token(hf, "decoder_start_token_id")
    if start is None:  # generate's fallback (mBART's class default is None)
        start = _one_token(hf, "bos_token_id")
    if start is None:
        raise HFCheckpointError(
            "config.json has neither decoder_start_token_id nor bos_token_id; generation "
            "starts from one of them (BART: decoder_start_token_id 2)"
        )
    pre = PLACEMENT[model_type] == "pre"
    dec = get(hf, "decoder_layers")
    return Seq2SeqConfig(
        vocab_size=V,
        max_seq_len=get(hf, "max_position_embeddings"),
        d_model=get(hf, "d_model"),
        n_layers=get(hf, "encoder_layers"),
        n_decoder_layers=None if dec == get(hf, "encoder_layers") else dec,  # None: as many
        attention=AttentionConfig(
            n_heads=hf["encoder_attention_heads"],
            qkv_bias=True,
            out_bias=True,
            dropout=float(hf.get("attention_dropout", 0.0)),
        ),
        position=PositionConfig(kind="learned"),
        position_offset=POSITION_OFFSET,
        ffn=FFNConfig(
            kind="mlp",
            activation=activation(get(hf, "activation_function"), "activation_function"),
            hidden_dim=hf["encoder_ffn_dim"],
        ),
        norm=NormConfig(kind="layernorm", eps=LAYER_NORM_EPS, placement="pre" if pre else "post"),
        final_norm=pre,
        embedding_norm=True,
        tie_embeddings=tie,
        share_embeddings=tie,
        src_vocab_size=None if tie else V,
        dropout=float(hf.get("dropout", 0.0)),
        init_std=float(hf.get("init_std", 0.02)),
        scale_embeddings=bool(hf.get("scale_embedding", False)),
        final_logits_bias=True,
        pad_id=get(hf, "pad_token_id"),
        bos_id=start,
        eos_id=eos,
        forced_bos_id=_one_token(hf, "forced_bos_token_id"),
        forced_eos_ids=marian.forced_eos_ids(hf.get("forced_eos_token_id")),
        blocked_ids=marian.blocked_ids(hf.get("bad_words_ids"), eos),
        renormalize_logits=bool(hf.get("renormalize_logits", False)),
    )


def exports(cfg: ModelConfig) -> bool:
    """The encoder–decoders with learned positions (Marian's are sinusoidal, T5's relative)."""
    return isinstance(cfg, Seq2SeqConfig) and cfg.position.kind == "learned"


def export_type(cfg: ModelConfig) -> str:
    assert isinstance(cfg, Seq2SeqConfig)
    att, ffn, norm = cfg.attention, cfg.ffn, cfg.norm
    final = cfg.final_norm if cfg.final_norm is not None else norm.placement == "pre"
    checks = [
        (
            norm.kind == "layernorm" and norm.bias and norm.eps == LAYER_NORM_EPS,
            f"LayerNorm with bias and eps={LAYER_NORM_EPS} (it has no eps setting)",
        ),
        (
            (norm.placement, final) in (("post", False), ("pre", True)),
            "post-norm blocks without final norms (bart) or pre-norm blocks with them (mbart)",
        ),
        (cfg.embedding_norm, "a norm on the embeddings (embedding_norm true)"),
        (
            cfg.position_offset == POSITION_OFFSET,
            f"position_offset={POSITION_OFFSET} (its position tables' first rows are unused)",
        ),
        (cfg.final_logits_bias, "a final logits bias (final_logits_bias true)"),
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
    ]
    missing = [what for ok, what in checks if not ok]
    if missing:
        raise unrepresentable(f"BART needs {'; '.join(missing)}")
    return "bart" if norm.placement == "post" else "mbart"


def config_to_hf(cfg: Seq2SeqConfig, model_type: str, dtype: torch.dtype) -> dict[str, Any]:
    written = bart_style_config(cfg, model_type, dtype)
    return {**written, "architectures": list(ARCHITECTURES[model_type][:1])}


def bart_style_config(cfg: Seq2SeqConfig, model_type: str, dtype: torch.dtype) -> dict:
    """config.json of an encoder–decoder in BART's keys (M2M100's and Pegasus's too), all
    but ``architectures``."""
    f = cfg.ffn.hidden_size(cfg.d_model)
    written = {
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "d_model": cfg.d_model,
        "encoder_layers": cfg.n_layers,
        "decoder_layers": cfg.decoder_layers,
        "encoder_attention_heads": cfg.n_heads,
        "decoder_attention_heads": cfg.n_heads,
        "encoder_ffn_dim": f,
        "decoder_ffn_dim": f,
        "activation_function": hf_activation(cfg.ffn.activation, TO_HF_ACTIVATIONS),
        "max_position_embeddings": cfg.max_seq_len,
        "scale_embedding": cfg.scale_embeddings,
        "dropout": cfg.dropout,
        "attention_dropout": cfg.attention.dropout,
        "activation_dropout": 0.0,
        "encoder_layerdrop": 0.0,
        "decoder_layerdrop": 0.0,
        "init_std": cfg.init_std,
        "pad_token_id": cfg.pad_id,
        "decoder_start_token_id": cfg.bos_id,
        "eos_token_id": cfg.eos_id,
        "forced_eos_token_id": marian._one_or_list(cfg.forced_eos_ids),
        "tie_word_embeddings": cfg.tie_embeddings,
        "is_encoder_decoder": True,
        **marian.generation_entries(cfg),
        **dtype_entries(dtype),
    }
    if cfg.forced_bos_id is not None:
        written["forced_bos_token_id"] = cfg.forced_bos_id
    return written


def _specs(cfg: Seq2SeqConfig) -> Specs:
    """attnlab name -> HF name: Marian's tables and blocks, and BART's own pieces."""
    specs = marian._specs(cfg)
    for ours, stack in (("src", "encoder"), ("tgt", "decoder")):
        specs[f"{ours}_pos.weight"] = f"model.{stack}.embed_positions.weight"
        for s in ("weight", "bias"):
            specs[f"{ours}_emb_norm.{s}"] = f"model.{stack}.layernorm_embedding.{s}"
    if cfg.norm.placement == "pre":  # mBART's final norms
        for ours, stack in (("enc_norm", "encoder"), ("dec_norm", "decoder")):
            for s in ("weight", "bias"):
                specs[f"{ours}.{s}"] = f"model.{stack}.layer_norm.{s}"
    return specs


def weights_to_attnlab(src: Source, cfg: Seq2SeqConfig) -> Plan:
    plan = src.plan(_specs(cfg))
    if not cfg.share_embeddings:  # untied: transformers' forward skips `shared`
        src.skip("model.shared.weight")
    plan["logits_bias"] = src.take("final_logits_bias", (1, cfg.vocab_size))
    tied = marian._TIED_COPIES if cfg.share_embeddings else ()
    for name in tied + (("lm_head.weight",) if cfg.tie_embeddings else ()):
        src.tied(name, plan["src_emb.weight"])  # tied: one table (stored copies must equal it)
    return plan  # type: ignore[return-value]  # None entries only with src.missing/wrong


def weights_from_attnlab(
    sd: dict[str, Tensor], cfg: Seq2SeqConfig, model_type: str
) -> dict[str, Tensor]:
    """The tied table once (``model.shared``), as transformers writes it; untied, the
    tables of their own, and ``model.shared`` (unused) as the encoder's."""
    out = unplan(_specs(cfg), sd)
    if not cfg.share_embeddings:
        out["model.shared.weight"] = sd["src_emb.weight"]
    out["final_logits_bias"] = sd["logits_bias"][None, :]
    return out


FAMILY = Family(
    name="bart",
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
