"""MarianMT (``model_type`` marian, ``MarianMTModel``) <-> attnlab
:class:`~attnlab.models.seq2seq.Seq2SeqModel`.

Marian is a post-norm encoder–decoder with embeddings scaled by sqrt(d), sinusoidal
positions in the split layout (all sines, then all cosines), no final norms, one vocabulary
shared by source, target and output (tied), and a ``final_logits_bias``. With
``share_encoder_decoder_embeddings=false`` the source (``vocab_size``) and the target
(``decoder_vocab_size``) have vocabularies of their own, the output tied to the target's.
With ``tie_word_embeddings=false`` transformers ties nothing: the encoder, the decoder and
the output have tables of their own (``model.shared`` is then stored but unused).
Opus-mt models ask generation never to emit the pad token (``bad_words_ids: [[pad]]``, with
``renormalize_logits``): single-token entries become ``Seq2SeqConfig.blocked_ids`` (the
end-of-sequence token left out, as transformers does), written back on export. Its
``forced_eos_token_id`` (the end token in every opus-mt config, read as the settings above)
makes the last allowed token an end token: ``Seq2SeqConfig.forced_eos_ids``. The decoder
start and end tokens too are generation_config.json's where it has them, as generate's.

    model.shared (= encoder/decoder embed_tokens, lm_head)   -> src_emb (= tgt_emb, lm_head)
      unshared: model.encoder.embed_tokens                   -> src_emb (attnlab src_vocab_size)
                model.decoder.embed_tokens (= lm_head)       -> tgt_emb (= lm_head; vocab_size)
    {encoder,decoder}.layers.i.self_attn.[q; k; v]_proj      -> {encoder,decoder}.i.attn.qkv
    self_attn.out_proj, self_attn_layer_norm                 -> attn.out, attn_norm
    encoder_attn.q_proj, [k_proj; v_proj], out_proj          -> cross_attn.q, cross_attn.kv, .out
    encoder_attn_layer_norm                                  -> cross_norm
    fc1, fc2, final_layer_norm                               -> ffn.up, ffn.down, ffn_norm
    final_logits_bias (1, V)                                 -> logits_bias (V,)
    embed_positions.weight (fixed sinusoids)                 -> recomputed

Shapes: d d_model, V target vocabulary size.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import Tensor

from attnlab.config import AttentionConfig, FFNConfig, ModelConfig, NormConfig, PositionConfig
from attnlab.interop import io
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
from attnlab.nn.embedding import sinusoidal_table

# MarianModel (no "model." prefix, no logits bias or head) is refused by name.
ARCHITECTURES = {"marian": ("MarianMTModel",)}

# transformers' class defaults (MarianConfig) for the config.json keys read here (Family.defaults).
DEFAULTS: dict[str, dict[str, Any]] = {
    "marian": {
        "vocab_size": 58101,
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
        "decoder_start_token_id": 58100,
        "scale_embedding": False,
        "pad_token_id": 58100,
        "eos_token_id": 0,
        "forced_eos_token_id": 0,  # without generation_config.json (see with_generation_config)
        "share_encoder_decoder_embeddings": True,
        "tie_word_embeddings": True,
    },
}
TO_HF_ACTIVATIONS = {**io.TO_HF_ACTIVATIONS, "gelu_tanh": "gelu_new", "silu": "swish"}
# transformers' Marian LayerNorms: torch's default eps, which config.json cannot change.
LAYER_NORM_EPS = 1e-5
# The fixed sinusoid tables transformers saves; recomputed, never loaded.
IGNORED = re.compile(r"^model\.(encoder|decoder)\.embed_positions\.weight$")


def config_from_hf(hf: dict[str, Any], model_type: str = "marian") -> Seq2SeqConfig:
    src_vocab = get(hf, "vocab_size")
    # transformers 5 shares the tables through weight tying: untied, the encoder's and the
    # decoder's tables are their own (equal copies in a checkpoint of earlier versions)
    shared = bool(hf.get("share_encoder_decoder_embeddings", True))
    tie = bool(hf.get("tie_word_embeddings", True))
    V = hf.get("decoder_vocab_size") or src_vocab  # the target vocabulary
    if shared and V != src_vocab:
        raise HFCheckpointError(
            f"decoder_vocab_size={V} differs from vocab_size={src_vocab} but "
            "share_encoder_decoder_embeddings is true; separate vocabularies need it false"
        )
    same = [
        ("encoder_attention_heads", "decoder_attention_heads"),
        ("encoder_ffn_dim", "decoder_ffn_dim"),
    ]
    for a, b in same:
        if get(hf, a) != get(hf, b):
            raise HFCheckpointError(f"{a} != {b} is not supported (one value for both stacks)")
    if get(hf, "d_model") % 2:
        raise HFCheckpointError("an odd d_model is not supported")
    pad = get(hf, "pad_token_id")
    eos = get(hf, "eos_token_id")
    if isinstance(eos, list):  # generation_config.json may list the end token(s)
        if len(eos) != 1:
            raise HFCheckpointError(
                f"eos_token_id={eos}: only one end-of-sequence token is supported"
            )
        eos = eos[0]
    return Seq2SeqConfig(
        vocab_size=V,
        max_seq_len=get(hf, "max_position_embeddings"),
        d_model=hf["d_model"],
        n_layers=get(hf, "encoder_layers"),
        n_decoder_layers=get(hf, "decoder_layers"),
        attention=AttentionConfig(
            n_heads=hf["encoder_attention_heads"],
            qkv_bias=True,
            out_bias=True,
            dropout=float(hf.get("attention_dropout", 0.0)),
        ),
        position=PositionConfig(kind="sinusoidal"),
        ffn=FFNConfig(
            kind="mlp",
            activation=activation(hf.get("activation_function", "gelu"), "activation_function"),
            hidden_dim=hf["encoder_ffn_dim"],
        ),
        norm=NormConfig(kind="layernorm", eps=LAYER_NORM_EPS, placement="post"),
        tie_embeddings=tie,
        dropout=float(hf.get("dropout", 0.0)),
        init_std=float(hf.get("init_std", 0.02)),
        share_embeddings=shared and tie,
        src_vocab_size=None if shared and tie else src_vocab,
        scale_embeddings=bool(hf.get("scale_embedding", False)),
        sinusoid_layout="split",
        final_norm=False,
        final_logits_bias=True,
        pad_id=pad,
        bos_id=hf.get("decoder_start_token_id", pad),
        eos_id=eos,
        blocked_ids=blocked_ids(hf.get("bad_words_ids"), eos),
        renormalize_logits=bool(hf.get("renormalize_logits", False)),
        forced_eos_ids=forced_eos_ids(hf.get("forced_eos_token_id")),
    )


def forced_eos_ids(forced: Any) -> list[int]:
    """``forced_eos_token_id`` (an id, a list of ids or None) as a list."""
    ids = [] if forced is None else [forced] if isinstance(forced, int) else forced
    if not (isinstance(ids, list) and all(isinstance(i, int) for i in ids)):
        raise HFCheckpointError(
            f"forced_eos_token_id must be an id or a list of ids, got {forced!r}"
        )
    return ids


def blocked_ids(bad_words_ids: Any, eos: int) -> list[int]:
    """The tokens of ``bad_words_ids`` ([[id], ...]; None: none) but ``eos``, which
    transformers never blocks."""
    if bad_words_ids is None:
        return []
    ok = isinstance(bad_words_ids, list) and all(
        isinstance(w, list) and all(isinstance(i, int) for i in w) for w in bad_words_ids
    )
    if not ok:
        raise HFCheckpointError(
            f"bad_words_ids must be a list of lists of ids, got {bad_words_ids!r}"
        )
    longer = [w for w in bad_words_ids if len(w) != 1]
    if longer:
        raise HFCheckpointError(
            f"bad_words_ids: only single tokens are supported, got {longer[0]}; remove the "
            "longer entries from config.json / generation_config.json"
        )
    return sorted({w[0] for w in bad_words_ids} - {eos})


def exports(cfg: ModelConfig) -> bool:
    return cfg.arch == "seq2seq"


def export_type(cfg: ModelConfig) -> str:
    assert isinstance(cfg, Seq2SeqConfig)
    ok = (
        cfg.norm.placement == "post"
        and cfg.norm.kind == "layernorm"
        and cfg.norm.bias
        and cfg.norm.eps == LAYER_NORM_EPS
        and cfg.position.kind == "sinusoidal"
        and cfg.sinusoid_layout == "split"
        and cfg.final_logits_bias
        and not cfg.final_norm
        and cfg.ffn.kind == "mlp"
        and cfg.ffn.activation in TO_HF_ACTIVATIONS
        and cfg.ffn.bias
        and cfg.attention.kind == "mha"
        and cfg.attention.kv_heads == cfg.attention.n_heads
        and cfg.head_dim * cfg.n_heads == cfg.d_model
        and cfg.attention.qkv_bias
        and cfg.attention.out_bias
    )
    if not ok:
        raise unrepresentable(
            f"Marian needs post-norm LayerNorm with bias and eps={LAYER_NORM_EPS} (it has no "
            "eps setting), split sinusoids, a final logits bias, no final norms, an MLP and "
            "multi-head attention with biases"
        )
    if cfg.scale_decoder_output:  # (MarianMTModel's head reads the decoder's output as it is)
        raise unrepresentable(
            "scale_decoder_output (T5's tied-head rescale; Marian has none: set it to false, "
            "or export a T5-shaped model as t5)"
        )
    pieces = {"embedding_norm": cfg.embedding_norm, "forced_bos_id": cfg.forced_bos_id is not None}
    found = [name for name, present in pieces.items() if present]
    if found:  # BART's pieces
        raise unrepresentable(
            f"{found[0]} (BART's; Marian has none: unset it, or export a model with learned "
            "positions as bart)"
        )
    if cfg.pad_id >= cfg.source_vocab_size:  # transformers' encoder embedding has it as padding_idx
        raise unrepresentable(
            f"pad_id={cfg.pad_id} is not a source token (src_vocab_size="
            f"{cfg.source_vocab_size}); Marian's one pad_token_id pads both vocabularies"
        )
    return "marian"


def config_to_hf(cfg: Seq2SeqConfig, model_type: str, dtype: torch.dtype) -> dict[str, Any]:
    f = cfg.ffn.hidden_size(cfg.d_model)
    return {
        "model_type": "marian",
        "architectures": ["MarianMTModel"],
        "vocab_size": cfg.source_vocab_size,
        "decoder_vocab_size": cfg.vocab_size,
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
        "init_std": cfg.init_std,
        "pad_token_id": cfg.pad_id,
        "decoder_start_token_id": cfg.bos_id,
        "eos_token_id": cfg.eos_id,
        "forced_eos_token_id": _one_or_list(cfg.forced_eos_ids),
        "share_encoder_decoder_embeddings": cfg.share_embeddings,
        "tie_word_embeddings": cfg.tie_embeddings,
        "is_encoder_decoder": True,
        **generation_entries(cfg),
        **dtype_entries(dtype),
    }


def _one_or_list(ids: list[int]) -> int | list[int] | None:
    return None if not ids else ids[0] if len(ids) == 1 else list(ids)


def generation_entries(cfg: Seq2SeqConfig) -> dict[str, Any]:
    """The blocked tokens as transformers' generation settings (none when none)."""
    if not cfg.blocked_ids:
        return {}
    bad = [[i] for i in cfg.blocked_ids]
    return {"bad_words_ids": bad, "renormalize_logits": cfg.renormalize_logits}


_LAYER = [
    ("attn.out", "self_attn.out_proj"),
    ("attn_norm", "self_attn_layer_norm"),
    ("ffn.up", "fc1"),
    ("ffn.down", "fc2"),
    ("ffn_norm", "final_layer_norm"),
]
_CROSS = [
    ("cross_attn.q", "encoder_attn.q_proj"),
    ("cross_attn.out", "encoder_attn.out_proj"),
    ("cross_norm", "encoder_attn_layer_norm"),
]
_TIED_COPIES = ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight")


def _specs(cfg: Seq2SeqConfig) -> Specs:
    """attnlab name -> HF name(s), but for the logits bias (stored (1, V))."""
    specs: Specs = {"src_emb.weight": "model.shared.weight"}
    if not cfg.share_embeddings:
        specs = {
            "src_emb.weight": "model.encoder.embed_tokens.weight",
            "tgt_emb.weight": "model.decoder.embed_tokens.weight",
        }
    if not cfg.tie_embeddings:
        specs["lm_head.weight"] = "lm_head.weight"
    for stack, n in (("encoder", cfg.n_layers), ("decoder", cfg.decoder_layers)):
        for i in range(n):
            a, h = f"{stack}.{i}.", f"model.{stack}.layers.{i}."
            for s in ("weight", "bias"):
                specs[f"{a}attn.qkv.{s}"] = [f"{h}self_attn.{p}_proj.{s}" for p in "qkv"]
                layer = _LAYER
                if stack == "decoder":
                    specs[f"{a}cross_attn.kv.{s}"] = [f"{h}encoder_attn.{p}_proj.{s}" for p in "kv"]
                    layer = _LAYER + _CROSS
                specs |= {f"{a}{ours}.{s}": f"{h}{theirs}.{s}" for ours, theirs in layer}
    return specs


def weights_to_attnlab(src: Source, cfg: Seq2SeqConfig) -> Plan:
    plan = src.plan(_specs(cfg))
    if not cfg.share_embeddings:  # shared=true, untied: transformers' forward skips `shared`
        src.skip("model.shared.weight")
    plan["logits_bias"] = src.take("final_logits_bias", (1, cfg.vocab_size))
    copies = _TIED_COPIES if cfg.share_embeddings else ()
    for name in copies + (("lm_head.weight",) if cfg.tie_embeddings else ()):
        src.tied(name, plan["src_emb.weight" if cfg.share_embeddings else "tgt_emb.weight"])
    return plan  # type: ignore[return-value]  # None entries only with src.missing/wrong


def weights_from_attnlab(
    sd: dict[str, Tensor], cfg: Seq2SeqConfig, model_type: str
) -> dict[str, Tensor]:
    emb = sd["src_emb.weight"] if cfg.share_embeddings else sd["tgt_emb.weight"]  # the target's
    table = sinusoidal_table(torch.arange(cfg.max_seq_len), cfg.d_model)  # interleaved
    table = torch.cat((table[:, 0::2], table[:, 1::2]), dim=-1).to(emb.dtype)  # -> split
    out = unplan(_specs(cfg), sd)
    if cfg.share_embeddings:
        out |= dict.fromkeys(_TIED_COPIES, emb)
    out |= {
        "model.encoder.embed_positions.weight": table,
        "model.decoder.embed_positions.weight": table,
        "final_logits_bias": sd["logits_bias"][None, :],
        "lm_head.weight": emb if cfg.tie_embeddings else sd["lm_head.weight"],
    }
    return out


FAMILY = Family(
    name="marian",
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
