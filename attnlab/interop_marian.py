"""Hugging Face MarianMT (``MarianMTModel``) <-> attnlab
:class:`~attnlab.models.seq2seq.Seq2SeqModel`.

Marian is a post-norm encoder–decoder with embeddings scaled by sqrt(d), sinusoidal
positions in the split layout (all sines, then all cosines), no final norms, one vocabulary
shared by source, target and output (tied), and a ``final_logits_bias``.

    model.shared (= encoder/decoder embed_tokens, lm_head)   -> src_emb (= tgt_emb, lm_head)
    {encoder,decoder}.layers.i.self_attn.[q; k; v]_proj      -> {encoder,decoder}.i.attn.qkv
    self_attn.out_proj, self_attn_layer_norm                 -> attn.out, attn_norm
    encoder_attn.q_proj, [k_proj; v_proj], out_proj          -> cross_attn.q, cross_attn.kv, .out
    encoder_attn_layer_norm                                  -> cross_norm
    fc1, fc2, final_layer_norm                               -> ffn.up, ffn.down, ffn_norm
    final_logits_bias (1, V)                                 -> logits_bias (V,)
    embed_positions.weight (fixed sinusoids)                 -> recomputed
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from attnlab.config import AttentionConfig, FFNConfig, NormConfig, PositionConfig
from attnlab.interop import HFCheckpointError
from attnlab.interop_io import Tensors, load_state, read_folder, write_folder
from attnlab.models.seq2seq import Seq2SeqConfig, Seq2SeqModel
from attnlab.nn.embedding import sinusoidal_table

_ACTIVATIONS = {"gelu": "gelu", "swish": "silu", "silu": "silu", "relu": "relu"}
_ACTIVATIONS_BACK = {"gelu": "gelu", "silu": "swish", "relu": "relu"}


def config_from_marian(hf: dict[str, Any]) -> Seq2SeqConfig:
    if hf.get("model_type") != "marian":
        raise HFCheckpointError(f"model_type {hf.get('model_type')!r} is not 'marian'")
    V = hf["vocab_size"]
    if hf.get("decoder_vocab_size") not in (None, V) or not hf.get(
        "share_encoder_decoder_embeddings", True
    ):
        raise HFCheckpointError("Marian models with separate source/target vocabularies")
    same = [
        ("encoder_attention_heads", "decoder_attention_heads"),
        ("encoder_ffn_dim", "decoder_ffn_dim"),
    ]
    for a, b in same:
        if hf[a] != hf[b]:
            raise HFCheckpointError(f"{a} != {b} is not supported (one value for both stacks)")
    act = hf.get("activation_function", "gelu")
    if act not in _ACTIVATIONS:
        raise HFCheckpointError(f"activation_function {act!r} is not supported")
    if hf["d_model"] % 2:
        raise HFCheckpointError("an odd d_model is not supported")
    return Seq2SeqConfig(
        vocab_size=V,
        max_seq_len=hf["max_position_embeddings"],
        d_model=hf["d_model"],
        n_layers=hf["encoder_layers"],
        n_decoder_layers=hf["decoder_layers"],
        attention=AttentionConfig(
            n_heads=hf["encoder_attention_heads"],
            qkv_bias=True,
            out_bias=True,
            dropout=float(hf.get("attention_dropout", 0.0)),
        ),
        position=PositionConfig(kind="sinusoidal"),
        ffn=FFNConfig(kind="mlp", activation=_ACTIVATIONS[act], hidden_dim=hf["encoder_ffn_dim"]),
        norm=NormConfig(kind="layernorm", eps=1e-5, placement="post"),
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        dropout=float(hf.get("dropout", 0.0)),
        init_std=float(hf.get("init_std", 0.02)),
        share_embeddings=True,
        scale_embeddings=bool(hf.get("scale_embedding", False)),
        sinusoid_layout="split",
        final_norm=False,
        final_logits_bias=True,
        pad_id=hf["pad_token_id"],
        bos_id=hf.get("decoder_start_token_id", hf["pad_token_id"]),
        eos_id=hf["eos_token_id"],
    )


def config_to_marian(cfg: Seq2SeqConfig) -> dict[str, Any]:
    ok = (
        cfg.norm.placement == "post"
        and cfg.norm.kind == "layernorm"
        and cfg.position.kind == "sinusoidal"
        and cfg.sinusoid_layout == "split"
        and cfg.share_embeddings
        and cfg.final_logits_bias
        and not cfg.final_norm
        and cfg.ffn.kind == "mlp"
        and cfg.ffn.activation in _ACTIVATIONS_BACK
        and cfg.attention.kv_heads == cfg.attention.n_heads
        and cfg.head_dim * cfg.n_heads == cfg.d_model
        and cfg.attention.qkv_bias
        and cfg.attention.out_bias
    )
    if not ok:
        raise HFCheckpointError(
            "config is not representable as Marian: it needs post-norm LayerNorm, split "
            "sinusoids, shared embeddings, a final logits bias, no final norms, an MLP and "
            "multi-head attention with biases"
        )
    f = cfg.ffn.hidden_size(cfg.d_model)
    return {
        "model_type": "marian",
        "architectures": ["MarianMTModel"],
        "vocab_size": cfg.vocab_size,
        "decoder_vocab_size": cfg.vocab_size,
        "d_model": cfg.d_model,
        "encoder_layers": cfg.n_layers,
        "decoder_layers": cfg.decoder_layers,
        "encoder_attention_heads": cfg.n_heads,
        "decoder_attention_heads": cfg.n_heads,
        "encoder_ffn_dim": f,
        "decoder_ffn_dim": f,
        "activation_function": _ACTIVATIONS_BACK[cfg.ffn.activation],
        "max_position_embeddings": cfg.max_seq_len,
        "scale_embedding": cfg.scale_embeddings,
        "dropout": cfg.dropout,
        "attention_dropout": cfg.attention.dropout,
        "activation_dropout": 0.0,
        "init_std": cfg.init_std,
        "pad_token_id": cfg.pad_id,
        "decoder_start_token_id": cfg.bos_id,
        "eos_token_id": cfg.eos_id,
        "forced_eos_token_id": None,
        "share_encoder_decoder_embeddings": True,
        "tie_word_embeddings": cfg.tie_embeddings,
        "is_encoder_decoder": True,
    }


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


def _layers(cfg: Seq2SeqConfig):
    for stack, n in (("encoder", cfg.n_layers), ("decoder", cfg.decoder_layers)):
        for i in range(n):
            yield stack, f"{stack}.{i}.", f"model.{stack}.layers.{i}."


def marian_to_attnlab(tensors: dict[str, Tensor], cfg: Seq2SeqConfig) -> dict[str, Tensor]:
    src = Tensors(tensors, ignore=("embed_positions.weight",))
    out = {"src_emb.weight": src.take("model.shared.weight")}
    for name in ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight"):
        src.pop(name)  # tied copies of model.shared
    head = src.pop("lm_head.weight")
    if not cfg.tie_embeddings:
        if head is None:
            raise HFCheckpointError("untied Marian checkpoint without lm_head.weight")
        out["lm_head.weight"] = head
    out["logits_bias"] = src.take("final_logits_bias").reshape(-1)
    for stack, a, h in _layers(cfg):
        layer = _LAYER + (_CROSS if stack == "decoder" else [])
        for s in ("weight", "bias"):
            qkv = [src.take(f"{h}self_attn.{p}.{s}") for p in ("q_proj", "k_proj", "v_proj")]
            out[f"{a}attn.qkv.{s}"] = torch.cat(qkv, 0)
            if stack == "decoder":
                kv = [src.take(f"{h}encoder_attn.{p}.{s}") for p in ("k_proj", "v_proj")]
                out[f"{a}cross_attn.kv.{s}"] = torch.cat(kv, 0)
            for ours, theirs in layer:
                out[f"{a}{ours}.{s}"] = src.take(f"{h}{theirs}.{s}")
    src.finish()
    return out


def attnlab_to_marian(sd: dict[str, Tensor], cfg: Seq2SeqConfig) -> dict[str, Tensor]:
    d, emb = cfg.d_model, sd["src_emb.weight"]
    table = sinusoidal_table(torch.arange(cfg.max_seq_len), d)  # interleaved -> split
    table = torch.cat((table[:, 0::2], table[:, 1::2]), dim=-1).to(emb.dtype)
    out = {
        "model.shared.weight": emb,
        "model.encoder.embed_tokens.weight": emb,
        "model.decoder.embed_tokens.weight": emb,
        "model.encoder.embed_positions.weight": table,
        "model.decoder.embed_positions.weight": table,
        "final_logits_bias": sd["logits_bias"][None, :],
        "lm_head.weight": emb if cfg.tie_embeddings else sd["lm_head.weight"],
    }
    for stack, a, h in _layers(cfg):
        layer = _LAYER + (_CROSS if stack == "decoder" else [])
        for s in ("weight", "bias"):
            q, k, v = sd[f"{a}attn.qkv.{s}"].split(d, 0)
            for p, t in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                out[f"{h}self_attn.{p}.{s}"] = t
            if stack == "decoder":
                k, v = sd[f"{a}cross_attn.kv.{s}"].split(d, 0)
                out[f"{h}encoder_attn.k_proj.{s}"] = k
                out[f"{h}encoder_attn.v_proj.{s}"] = v
            for ours, theirs in layer:
                out[f"{h}{theirs}.{s}"] = sd[f"{a}{ours}.{s}"]
    return out


def load_marian(path: str | Path) -> Seq2SeqModel:
    """A :class:`Seq2SeqModel` (eval mode) from a transformers MarianMT folder."""
    hf, tensors = read_folder(path)
    cfg = config_from_marian(hf)
    model = Seq2SeqModel(cfg)
    skip = {"tgt_emb.weight"} | ({"lm_head.weight"} if cfg.tie_embeddings else set())
    load_state(model, marian_to_attnlab(tensors, cfg), skip)
    return model.eval()


def save_marian(model: Seq2SeqModel, path: str | Path) -> None:
    """A folder that ``transformers.MarianMTModel.from_pretrained`` loads with equal logits."""
    write_folder(
        path, config_to_marian(model.cfg), attnlab_to_marian(model.state_dict(), model.cfg)
    )
