"""T5 (``model_type`` t5, ``T5ForConditionalGeneration``) <-> attnlab
:class:`~attnlab.models.seq2seq.Seq2SeqModel`.

T5 (Raffel et al. 2020) is a pre-norm encoder–decoder with RMSNorm (T5LayerNorm: no bias,
no centring), no biases anywhere, unscaled scores (``attention.scale`` 1), heads of width
``d_kv`` (h d_kv may differ from d_model), no position embeddings but a learned relative
position bias per stack (``position.kind`` relative_bias: transformers keeps the table in
the first block's self-attention and adds it in every layer), a final norm after each stack
and one embedding shared by the encoder and the decoder. ``feed_forward_proj``: ``relu``
(T5 v1.0: wi -> relu -> wo, an MLP) or ``gated-gelu`` (v1.1, flan-t5: gelu_new(wi_0) * wi_1
-> wo, a GLU with the tanh GELU); ``gated-ACT`` and ``ACT`` for the other activations.
With ``tie_word_embeddings`` (v1.0) the head is the embedding and reads d^-1/2 times the
decoder's output (``scale_decoder_output``; transformers 5 stores it as
``scale_decoder_outputs``); v1.1 has a head of its own and no rescale. The decoder starts
from ``decoder_start_token_id``, the pad token.

    shared (= encoder/decoder.embed_tokens, lm_head if tied)    -> src_emb (= tgt_emb, lm_head)
    lm_head (untied)                                            -> lm_head
    {encoder,decoder}.block.0.layer.0.SelfAttention
        .relative_attention_bias (buckets, h)                  -> {src,tgt}_pos_bias.table
    {stack}.block.i.layer.0.SelfAttention.[q; k; v], .o         -> {stack}.i.attn.qkv, attn.out
    {stack}.block.i.layer.0.layer_norm                          -> attn_norm
    decoder.block.i.layer.1.EncDecAttention.q, [k; v], o        -> cross_attn.q, .kv, .out
    decoder.block.i.layer.1.layer_norm                          -> cross_norm
    {stack}.block.i.layer.F.DenseReluDense.wi, wo (relu)        -> ffn.up, ffn.down
        .[wi_0; wi_1], wo (gated)                              -> ffn.gate_up, ffn.down
    {stack}.block.i.layer.F.layer_norm                          -> ffn_norm
    {stack}.final_layer_norm                                    -> enc_norm, dec_norm
    (F: 1 in the encoder, 2 in the decoder)

Shapes: d d_model, V vocabulary size, h heads.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection
from typing import Any

import torch
from torch import Tensor

from attnlab.config import AttentionConfig, FFNConfig, ModelConfig, NormConfig, PositionConfig
from attnlab.interop.io import (
    Family,
    HFCheckpointError,
    Plan,
    Source,
    Specs,
    activation,
    dtype_entries,
    get,
    unplan,
    unrepresentable,
)
from attnlab.models.seq2seq import Seq2SeqConfig

# T5Model (no head) and T5EncoderModel (an encoder alone) are refused by name.
# T5WithLMHeadModel: the name early checkpoints' config.json gives the same model.
ARCHITECTURES = {"t5": ("T5ForConditionalGeneration", "T5WithLMHeadModel")}

# transformers' class defaults (T5Config) for the config.json keys read here (Family.defaults).
DEFAULTS: dict[str, dict[str, Any]] = {
    "t5": {
        "vocab_size": 32128,
        "d_model": 512,
        "d_kv": 64,
        "d_ff": 2048,
        "num_layers": 6,
        "num_heads": 8,
        "relative_attention_num_buckets": 32,
        "relative_attention_max_distance": 128,
        "dropout_rate": 0.1,
        "layer_norm_epsilon": 1e-6,
        "feed_forward_proj": "relu",
        "pad_token_id": 0,
        "eos_token_id": 1,
    },
}
# attnlab activation -> feed_forward_proj, gated (GLU) and not (MLP). "gated-gelu" is
# transformers' name for the tanh GELU (gelu_new), as T5 v1.1 uses; "gelu" alone is exact.
GATED_PROJ = {"gelu_tanh": "gated-gelu", "relu": "gated-relu", "silu": "gated-silu"}
PLAIN_PROJ = {"relu": "relu", "gelu": "gelu", "gelu_tanh": "gelu_new", "silu": "silu"}
# T5 has no limit on positions; the decoding cache's default capacity where config.json
# gives none (early checkpoints' n_positions).
MAX_SEQ_LEN = 512
# The second copy of the decoder's bias table that early checkpoints stored in the first
# block's cross-attention (unused: cross-attention has no position bias), as transformers.
IGNORED = re.compile(
    r"^decoder\.block\.0\.layer\.1\.EncDecAttention\.relative_attention_bias\.weight$"
)


def feed_forward(proj: Any, d_ff: int) -> FFNConfig:
    """``feed_forward_proj`` (``ACT`` or ``gated-ACT``) as an FFN without biases."""
    parts = proj.split("-") if isinstance(proj, str) else []
    if not parts or len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
        raise HFCheckpointError(
            f"config.json feed_forward_proj={proj!r} is not supported; use 'ACT' or "
            "'gated-ACT', e.g. 'relu' or 'gated-gelu'"
        )
    gated = len(parts) == 2
    # transformers reads gated-gelu as gelu_new (T5 v1.1), a plain gelu as the exact one
    name = "gelu_new" if proj == "gated-gelu" else parts[-1]
    return FFNConfig(
        kind="glu" if gated else "mlp",
        activation=activation(name, "feed_forward_proj"),
        hidden_dim=d_ff,
        bias=False,
    )


def config_from_hf(hf: dict[str, Any], model_type: str = "t5") -> Seq2SeqConfig:
    tie = bool(hf.get("tie_word_embeddings", True))
    # transformers 5 keeps the rescale apart (it ties whatever config.json says, unless a
    # checkpoint holds a head of its own); earlier versions rescale exactly when tied
    scale = bool(hf.get("scale_decoder_outputs", tie))
    pad = get(hf, "pad_token_id")
    eos = get(hf, "eos_token_id")
    if isinstance(eos, list):  # generation_config.json may list the end token(s)
        if len(eos) != 1:
            raise HFCheckpointError(
                f"eos_token_id={eos}: only one end-of-sequence token is supported"
            )
        eos = eos[0]
    start = hf.get("decoder_start_token_id")
    dropout = float(hf.get("dropout_rate", 0.0))
    n_layers, dec = get(hf, "num_layers"), hf.get("num_decoder_layers")
    return Seq2SeqConfig(
        vocab_size=get(hf, "vocab_size"),
        max_seq_len=hf.get("n_positions") or MAX_SEQ_LEN,
        d_model=get(hf, "d_model"),
        n_layers=n_layers,
        n_decoder_layers=None if dec in (None, n_layers) else dec,  # None: as many
        attention=AttentionConfig(
            n_heads=get(hf, "num_heads"),
            head_dim=get(hf, "d_kv"),
            scale=1.0,  # T5 folds the scale into its initialisation
            dropout=dropout,
        ),
        position=PositionConfig(
            kind="relative_bias",
            relative_buckets=get(hf, "relative_attention_num_buckets"),
            relative_max_distance=get(hf, "relative_attention_max_distance"),
        ),
        ffn=feed_forward(get(hf, "feed_forward_proj"), get(hf, "d_ff")),
        norm=NormConfig(kind="rmsnorm", eps=float(get(hf, "layer_norm_epsilon")), placement="pre"),
        tie_embeddings=tie,
        scale_decoder_output=scale,
        dropout=dropout,
        share_embeddings=True,
        scale_embeddings=False,
        final_norm=True,
        pad_id=pad,
        bos_id=pad if start is None else start,
        eos_id=eos,
    )


def config_for_weights(cfg: Seq2SeqConfig, names: Collection[str]) -> Seq2SeqConfig:
    """transformers 5 writes tie_word_embeddings=true for every T5 (keeping the rescale
    apart, ``scale_decoder_outputs``) and unties, as from_pretrained, a head the checkpoint
    stores: a tied config without the rescale (T5 v1.1 as transformers 5 saves it) whose
    checkpoint holds ``lm_head.weight`` has that head of its own (equal to the embedding,
    where transformers ties them, it gives the same outputs)."""
    if cfg.tie_embeddings and not cfg.scale_decoder_output and "lm_head.weight" in names:
        return dataclasses.replace(cfg, tie_embeddings=False)
    return cfg


def exports(cfg: ModelConfig) -> bool:
    return cfg.arch == "seq2seq" and cfg.position.kind == "relative_bias"


def export_type(cfg: ModelConfig) -> str:
    assert isinstance(cfg, Seq2SeqConfig)
    att, ffn = cfg.attention, cfg.ffn
    proj = GATED_PROJ if ffn.kind == "glu" else PLAIN_PROJ if ffn.kind == "mlp" else {}
    checks = [
        (cfg.norm.kind == "rmsnorm" and cfg.norm.placement == "pre", "pre-norm RMSNorm"),
        (cfg.final_norm is not False, "a final norm after each stack"),
        (
            ffn.activation in proj and not ffn.bias,
            f"an FFN without biases: mlp ({', '.join(PLAIN_PROJ)}) or glu "
            f"({', '.join(GATED_PROJ)})",
        ),
        (
            att.kind == "mha" and att.kv_heads == att.n_heads,
            "multi-head attention (n_kv_heads = n_heads)",
        ),
        (not att.qkv_bias and not att.out_bias, "attention without biases"),
        (att.scale == 1.0, "unscaled scores (attention.scale 1.0)"),
        (
            att.softcap is None
            and att.sliding_window is None
            and not att.qk_norm
            and not att.sink_logits,
            "no soft-cap, window, QK-norm or sink logits",
        ),
        (att.dropout == cfg.dropout, "one dropout rate (attention.dropout = dropout)"),
        (cfg.share_embeddings and cfg.src_vocab_size is None, "one shared vocabulary"),
        (
            not cfg.scale_embeddings and not cfg.final_logits_bias,
            "unscaled embeddings, no logits bias",
        ),  # fmt: skip
        (not cfg.blocked_ids and not cfg.forced_eos_ids, "no blocked or forced tokens"),
    ]
    missing = [what for ok, what in checks if not ok]
    if missing:
        raise unrepresentable(f"T5 needs {'; '.join(missing)}")
    return "t5"


def config_to_hf(cfg: Seq2SeqConfig, model_type: str, dtype: torch.dtype) -> dict[str, Any]:
    ffn = cfg.ffn
    proj = (GATED_PROJ if ffn.kind == "glu" else PLAIN_PROJ)[ffn.activation]
    return {
        "model_type": "t5",
        "architectures": ["T5ForConditionalGeneration"],
        "vocab_size": cfg.vocab_size,
        "d_model": cfg.d_model,
        "d_kv": cfg.head_dim,
        "d_ff": ffn.hidden_size(cfg.d_model),
        "num_layers": cfg.n_layers,
        "num_decoder_layers": cfg.decoder_layers,
        "num_heads": cfg.n_heads,
        "relative_attention_num_buckets": cfg.position.relative_buckets,
        "relative_attention_max_distance": cfg.position.relative_max_distance,
        "dropout_rate": cfg.dropout,
        "layer_norm_epsilon": cfg.norm.eps,
        "feed_forward_proj": proj,
        "n_positions": cfg.max_seq_len,
        "tie_word_embeddings": cfg.tie_embeddings,
        "scale_decoder_outputs": cfg.scale_decoder_output,
        "pad_token_id": cfg.pad_id,
        "eos_token_id": cfg.eos_id,
        "decoder_start_token_id": cfg.bos_id,
        "is_encoder_decoder": True,
        **dtype_entries(dtype),
    }


_TIED_COPIES = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")


def _specs(cfg: Seq2SeqConfig) -> Specs:
    """attnlab name -> HF name(s)."""
    table = "block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    specs: Specs = {
        "src_emb.weight": "shared.weight",
        "src_pos_bias.table.weight": f"encoder.{table}",
        "tgt_pos_bias.table.weight": f"decoder.{table}",
        "enc_norm.weight": "encoder.final_layer_norm.weight",
        "dec_norm.weight": "decoder.final_layer_norm.weight",
    }
    if not cfg.tie_embeddings:
        specs["lm_head.weight"] = "lm_head.weight"
    for stack, n in (("encoder", cfg.n_layers), ("decoder", cfg.decoder_layers)):
        for i in range(n):
            a, h = f"{stack}.{i}.", f"{stack}.block.{i}.layer."
            attn = f"{h}0.SelfAttention."
            specs[f"{a}attn.qkv.weight"] = [f"{attn}{p}.weight" for p in "qkv"]
            specs[f"{a}attn.out.weight"] = f"{attn}o.weight"
            specs[f"{a}attn_norm.weight"] = f"{h}0.layer_norm.weight"
            f = 1
            if stack == "decoder":
                cross, f = f"{h}1.EncDecAttention.", 2
                specs[f"{a}cross_attn.q.weight"] = f"{cross}q.weight"
                specs[f"{a}cross_attn.kv.weight"] = [f"{cross}{p}.weight" for p in "kv"]
                specs[f"{a}cross_attn.out.weight"] = f"{cross}o.weight"
                specs[f"{a}cross_norm.weight"] = f"{h}1.layer_norm.weight"
            dense = f"{h}{f}.DenseReluDense."
            if cfg.ffn.kind == "glu":
                specs[f"{a}ffn.gate_up.weight"] = [f"{dense}wi_0.weight", f"{dense}wi_1.weight"]
            else:
                specs[f"{a}ffn.up.weight"] = f"{dense}wi.weight"
            specs[f"{a}ffn.down.weight"] = f"{dense}wo.weight"
            specs[f"{a}ffn_norm.weight"] = f"{h}{f}.layer_norm.weight"
    return specs


def weights_to_attnlab(src: Source, cfg: Seq2SeqConfig) -> Plan:
    plan = src.plan(_specs(cfg))
    copies = _TIED_COPIES + (("lm_head.weight",) if cfg.tie_embeddings else ())
    for name in copies:  # stored by some versions; must equal the shared table
        src.tied(name, plan["src_emb.weight"])
    return plan  # type: ignore[return-value]  # None entries only with src.missing/wrong


def weights_from_attnlab(
    sd: dict[str, Tensor], cfg: Seq2SeqConfig, model_type: str
) -> dict[str, Tensor]:
    return unplan(_specs(cfg), sd)  # the shared table once, as transformers writes it


FAMILY = Family(
    name="t5",
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
    config_for_weights=config_for_weights,  # type: ignore[arg-type]
)
