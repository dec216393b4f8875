"""T5 (``model_type`` t5), mT5 (``mt5``) and UMT5 (``umt5``) <-> attnlab:
``T5ForConditionalGeneration`` (``MT5...``, ``UMT5...``) <->
:class:`~attnlab.models.seq2seq.Seq2SeqModel`; ``T5EncoderModel`` (``MT5EncoderModel``,
``UMT5EncoderModel``: the encoder stack alone, returning its hidden states) <->
:class:`~attnlab.models.encoder.EncoderModel` with head ``none``. ``T5Model`` (and
``MT5Model``, ``UMT5Model``: encoder and decoder without a head) are refused by name:
attnlab's encoder–decoder always ends in its LM head.

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

mT5 (Xue et al. 2021) is T5 v1.1's architecture (gated GELU, a head of its own) with a
250112-token vocabulary and a config class of its own (MT5Config: v1.1's defaults, and
transformers 5's MT5ForConditionalGeneration never rescales the decoder's output, tied or
not, and reads no ``scale_decoder_outputs``). Its configs are T5's, so export writes them
as ``t5`` (T5ForConditionalGeneration / T5EncoderModel give the same outputs).

UMT5 (Chung et al. 2023) is mT5 with a relative position bias table in every layer's
self-attention (``position.relative_bias_per_layer``), not one per stack kept in the first
block; it reads the decoder's rescale as T5 does. Configs with a table per layer export as
``umt5``, the others as ``t5``.

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

    T5EncoderModel: shared -> tok_emb, encoder.block.0...relative_attention_bias ->
    pos_bias.table, encoder.block.i -> blocks.i (as above), encoder.final_layer_norm -> norm
    UMT5: {stack}.block.i.layer.0.SelfAttention.relative_attention_bias -> {src,tgt,}_pos_bias
    .tables.i (every block's)

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
    TASK_OF_HEAD,
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
from attnlab.models.encoder import EncoderConfig
from attnlab.models.seq2seq import Seq2SeqConfig

# model_type -> (encoder–decoder class, its alias, encoder-only class): the first is what
# export writes for a seq2seq config. T5Model / MT5Model (no head) are refused by name.
# T5WithLMHeadModel: the name early checkpoints' config.json gives T5ForConditionalGeneration.
ARCHITECTURES = {
    "t5": ("T5ForConditionalGeneration", "T5WithLMHeadModel", "T5EncoderModel"),
    "mt5": ("MT5ForConditionalGeneration", "MT5EncoderModel"),
    "umt5": ("UMT5ForConditionalGeneration", "UMT5EncoderModel"),
}
ENCODER_ARCHITECTURES = ("T5EncoderModel", "MT5EncoderModel", "UMT5EncoderModel")

_T5_DEFAULTS: dict[str, Any] = {
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
}
# transformers' class defaults (T5Config, MT5Config, UMT5Config) for the config.json keys
# read here (Family.defaults): mT5's and UMT5's are T5 v1.1 small's with their vocabulary
# and start token.
_MT5_DEFAULTS: dict[str, Any] = {
    **_T5_DEFAULTS,
    "vocab_size": 250112,
    "d_ff": 1024,
    "num_layers": 8,
    "num_heads": 6,
    "feed_forward_proj": "gated-gelu",
    "decoder_start_token_id": 0,
}
DEFAULTS: dict[str, dict[str, Any]] = {
    "t5": _T5_DEFAULTS,
    "mt5": _MT5_DEFAULTS,
    "umt5": _MT5_DEFAULTS,
}
# model types with a relative position bias table in every layer (UMT5's)
PER_LAYER_TYPES = ("umt5",)
CLASS_PREFIX = {"t5": "T5", "umt5": "UMT5"}  # the model types export writes, their classes
# model types whose transformers class never rescales the decoder's output (MT5Config
# has no scale_decoder_outputs: transformers 5's mT5 leaves it out, tied or not)
UNSCALED_TYPES = ("mt5",)
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


def _stack_pieces(hf: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The config fields both of T5's stacks share, encoder–decoder or encoder alone."""
    dropout = float(hf.get("dropout_rate", 0.0))
    return dict(
        vocab_size=get(hf, "vocab_size"),
        max_seq_len=hf.get("n_positions") or MAX_SEQ_LEN,
        d_model=get(hf, "d_model"),
        n_layers=get(hf, "num_layers"),
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
            relative_bias_per_layer=model_type in PER_LAYER_TYPES,
        ),
        ffn=feed_forward(get(hf, "feed_forward_proj"), get(hf, "d_ff")),
        norm=NormConfig(kind="rmsnorm", eps=float(get(hf, "layer_norm_epsilon")), placement="pre"),
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        dropout=dropout,
    )


def config_from_hf(hf: dict[str, Any], model_type: str = "t5") -> ModelConfig:
    archs = hf.get("architectures") or [ARCHITECTURES[model_type][0]]
    if archs[0] in ENCODER_ARCHITECTURES:
        # the encoder alone: no head, the embedding and blocks as they are (no embedding
        # norm, no token types) and the final norm of a pre-norm stack
        return EncoderConfig(
            **_stack_pieces(hf, model_type), type_vocab_size=0, embedding_norm=False, head="none"
        )
    pieces = _stack_pieces(hf, model_type)
    tie = pieces["tie_embeddings"]
    # transformers 5 keeps the rescale apart (it ties whatever config.json says, unless a
    # checkpoint holds a head of its own); earlier versions rescale exactly when tied.
    # mT5's class never rescales.
    scale = model_type not in UNSCALED_TYPES and bool(hf.get("scale_decoder_outputs", tie))
    pad = get(hf, "pad_token_id")
    eos = get(hf, "eos_token_id")
    if isinstance(eos, list):  # generation_config.json may list the end token(s)
        if len(eos) != 1:
            raise HFCheckpointError(
                f"eos_token_id={eos}: only one end-of-sequence token is supported"
            )
        eos = eos[0]
    start = hf.get("decoder_start_token_id")
    n_layers, dec = pieces["n_layers"], hf.get("num_decoder_layers")
    return Seq2SeqConfig(
        **pieces,
        n_decoder_layers=None if dec in (None, n_layers) else dec,  # None: as many
        scale_decoder_output=scale,
        share_embeddings=True,
        scale_embeddings=False,
        final_norm=True,
        pad_id=pad,
        bos_id=pad if start is None else start,
        eos_id=eos,
    )


def config_for_weights(cfg: ModelConfig, names: Collection[str]) -> ModelConfig:
    """transformers 5 writes tie_word_embeddings=true for every T5 (keeping the rescale
    apart, ``scale_decoder_outputs``) and unties, as from_pretrained, a head the checkpoint
    stores: a tied config without the rescale (T5 v1.1 as transformers 5 saves it) whose
    checkpoint holds ``lm_head.weight`` has that head of its own (equal to the embedding,
    where transformers ties them, it gives the same outputs)."""
    if not isinstance(cfg, Seq2SeqConfig):
        return cfg  # the encoder alone has no head
    if cfg.tie_embeddings and not cfg.scale_decoder_output and "lm_head.weight" in names:
        return dataclasses.replace(cfg, tie_embeddings=False)
    return cfg


def exports(cfg: ModelConfig) -> bool:
    return cfg.arch in ("seq2seq", "encoder") and cfg.position.kind == "relative_bias"


def _stack_problems(cfg: ModelConfig) -> list[str]:
    """What keeps ``cfg``'s blocks out of T5's layout, each named."""
    att, ffn = cfg.attention, cfg.ffn
    proj = GATED_PROJ if ffn.kind == "glu" else PLAIN_PROJ if ffn.kind == "mlp" else {}
    checks = [
        (cfg.norm.kind == "rmsnorm" and cfg.norm.placement == "pre", "pre-norm RMSNorm"),
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
    ]
    return [what for ok, what in checks if not ok]


def export_type(cfg: ModelConfig) -> str:
    missing = _stack_problems(cfg)
    if isinstance(cfg, EncoderConfig):
        checks = [
            (cfg.head == "none", "head 'none' (T5EncoderModel returns the hidden states)"),
            (
                cfg.type_vocab_size == 0 and not cfg.embedding_norm and cfg.first_attn_norm,
                "no token types (type_vocab_size 0), no embedding norm, first_attn_norm true",
            ),
            (
                cfg.embedding_size is None and cfg.layer_sets is None,
                "no factorised embeddings or shared layers (embedding_size, layer_sets null)",
            ),
        ]
        layout = "T5's encoder (T5EncoderModel)"
    else:
        assert isinstance(cfg, Seq2SeqConfig)
        checks = [
            (cfg.final_norm is not False, "a final norm after each stack"),
            (cfg.share_embeddings and cfg.src_vocab_size is None, "one shared vocabulary"),
            (
                not cfg.scale_embeddings and not cfg.final_logits_bias,
                "unscaled embeddings, no logits bias",
            ),  # fmt: skip
            (
                not cfg.blocked_ids and not cfg.forced_eos_ids and cfg.forced_bos_id is None,
                "no blocked or forced tokens",
            ),
            (not cfg.embedding_norm, "no norm on the embeddings (embedding_norm false)"),
        ]
        layout = "T5"
    missing += [what for ok, what in checks if not ok]
    if missing:
        raise unrepresentable(f"{layout} needs {'; '.join(missing)}")
    return "umt5" if cfg.position.relative_bias_per_layer else "t5"


def config_to_hf(cfg: ModelConfig, model_type: str, dtype: torch.dtype) -> dict[str, Any]:
    ffn = cfg.ffn
    proj = (GATED_PROJ if ffn.kind == "glu" else PLAIN_PROJ)[ffn.activation]
    prefix = CLASS_PREFIX[model_type]
    written = {
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "d_model": cfg.d_model,
        "d_kv": cfg.head_dim,
        "d_ff": ffn.hidden_size(cfg.d_model),
        "num_layers": cfg.n_layers,
        "num_heads": cfg.n_heads,
        "relative_attention_num_buckets": cfg.position.relative_buckets,
        "relative_attention_max_distance": cfg.position.relative_max_distance,
        "dropout_rate": cfg.dropout,
        "layer_norm_epsilon": cfg.norm.eps,
        "feed_forward_proj": proj,
        "n_positions": cfg.max_seq_len,
        "tie_word_embeddings": cfg.tie_embeddings,
        **dtype_entries(dtype),
    }
    if isinstance(cfg, EncoderConfig):  # as T5EncoderModel saves it
        return {
            **written,
            "architectures": [f"{prefix}EncoderModel"],
            "is_encoder_decoder": False,
            "use_cache": False,
        }
    assert isinstance(cfg, Seq2SeqConfig)
    return {
        **written,
        "architectures": [f"{prefix}ForConditionalGeneration"],
        "num_decoder_layers": cfg.decoder_layers,
        "scale_decoder_outputs": cfg.scale_decoder_output,
        "pad_token_id": cfg.pad_id,
        "eos_token_id": cfg.eos_id,
        "decoder_start_token_id": cfg.bos_id,
        "is_encoder_decoder": True,
    }


_TIED_COPIES = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
_TABLE = "block.0.layer.0.SelfAttention.relative_attention_bias.weight"


def _block_specs(cfg: ModelConfig, ours: str, stack: str, i: int) -> Specs:
    """attnlab name -> HF name(s) of block ``i`` of ``stack`` (encoder or decoder: with
    cross-attention), the attnlab block's names starting with ``ours``."""
    h = f"{stack}.block.{i}.layer."
    attn = f"{h}0.SelfAttention."
    specs: Specs = {
        f"{ours}attn.qkv.weight": [f"{attn}{p}.weight" for p in "qkv"],
        f"{ours}attn.out.weight": f"{attn}o.weight",
        f"{ours}attn_norm.weight": f"{h}0.layer_norm.weight",
    }
    f = 1
    if stack == "decoder":
        cross, f = f"{h}1.EncDecAttention.", 2
        specs[f"{ours}cross_attn.q.weight"] = f"{cross}q.weight"
        specs[f"{ours}cross_attn.kv.weight"] = [f"{cross}{p}.weight" for p in "kv"]
        specs[f"{ours}cross_attn.out.weight"] = f"{cross}o.weight"
        specs[f"{ours}cross_norm.weight"] = f"{h}1.layer_norm.weight"
    dense = f"{h}{f}.DenseReluDense."
    if cfg.ffn.kind == "glu":
        specs[f"{ours}ffn.gate_up.weight"] = [f"{dense}wi_0.weight", f"{dense}wi_1.weight"]
    else:
        specs[f"{ours}ffn.up.weight"] = f"{dense}wi.weight"
    specs[f"{ours}ffn.down.weight"] = f"{dense}wo.weight"
    specs[f"{ours}ffn_norm.weight"] = f"{h}{f}.layer_norm.weight"
    return specs


def _table_specs(cfg: ModelConfig, ours: str, stack: str, n: int) -> Specs:
    """attnlab name -> HF name of the relative position bias table(s) of ``stack``: the
    first block's (T5), or every block's (UMT5, ``relative_bias_per_layer``)."""
    if not cfg.position.relative_bias_per_layer:
        return {f"{ours}.table.weight": f"{stack}.{_TABLE}"}
    table = _TABLE.replace("block.0.", "block.{i}.")
    return {f"{ours}.tables.{i}.weight": f"{stack}.{table.format(i=i)}" for i in range(n)}


def _encoder_specs(cfg: EncoderConfig) -> Specs:
    """attnlab name -> HF name(s) of T5EncoderModel."""
    specs: Specs = {
        "tok_emb.weight": "shared.weight",
        **_table_specs(cfg, "pos_bias", "encoder", cfg.n_layers),
        "norm.weight": "encoder.final_layer_norm.weight",
    }
    for i in range(cfg.n_layers):
        specs |= _block_specs(cfg, f"blocks.{i}.", "encoder", i)
    return specs


def _specs(cfg: ModelConfig) -> Specs:
    """attnlab name -> HF name(s)."""
    if isinstance(cfg, EncoderConfig):
        return _encoder_specs(cfg)
    assert isinstance(cfg, Seq2SeqConfig)
    specs: Specs = {
        "src_emb.weight": "shared.weight",
        **_table_specs(cfg, "src_pos_bias", "encoder", cfg.n_layers),
        **_table_specs(cfg, "tgt_pos_bias", "decoder", cfg.decoder_layers),
        "enc_norm.weight": "encoder.final_layer_norm.weight",
        "dec_norm.weight": "decoder.final_layer_norm.weight",
    }
    if not cfg.tie_embeddings:
        specs["lm_head.weight"] = "lm_head.weight"
    for stack, n in (("encoder", cfg.n_layers), ("decoder", cfg.decoder_layers)):
        for i in range(n):
            specs |= _block_specs(cfg, f"{stack}.{i}.", stack, i)
    return specs


def weights_to_attnlab(src: Source, cfg: ModelConfig) -> Plan:
    plan = src.plan(_specs(cfg))
    if isinstance(cfg, EncoderConfig):
        # T5EncoderModel reads the encoder of a whole T5's checkpoint too: transformers
        # ignores its decoder (and warns of the head, which attnlab skips as well)
        for name in [n for n in src.left if n.startswith("decoder.")] + ["lm_head.weight"]:
            src.skip(name)
        src.tied("encoder.embed_tokens.weight", plan["tok_emb.weight"])
        return plan  # type: ignore[return-value]  # None entries only with src.missing/wrong
    assert isinstance(cfg, Seq2SeqConfig)
    copies = _TIED_COPIES + (("lm_head.weight",) if cfg.tie_embeddings else ())
    for name in copies:  # stored by some versions; must equal the shared table
        src.tied(name, plan["src_emb.weight"])
    return plan  # type: ignore[return-value]  # None entries only with src.missing/wrong


def weights_from_attnlab(
    sd: dict[str, Tensor], cfg: ModelConfig, model_type: str
) -> dict[str, Tensor]:
    return unplan(_specs(cfg), sd)  # the shared table once, as transformers writes it


def task(cfg: ModelConfig) -> str:
    """seq2seq for the encoder–decoder; the encoder alone, head ``none``, serves no task
    (as BertModel: ``lm``, :data:`~attnlab.interop.io.TASK_OF_HEAD`)."""
    return TASK_OF_HEAD["none"] if isinstance(cfg, EncoderConfig) else "seq2seq"


FAMILY = Family(
    name="t5",
    arch="seq2seq",  # and "encoder" for T5EncoderModel
    architectures=ARCHITECTURES,
    config_from_hf=config_from_hf,
    defaults=DEFAULTS,
    config_to_hf=config_to_hf,
    weights_to_attnlab=weights_to_attnlab,
    weights_from_attnlab=weights_from_attnlab,
    exports=exports,
    export_type=export_type,
    ignored=IGNORED,
    task=task,
    config_for_weights=config_for_weights,
)
