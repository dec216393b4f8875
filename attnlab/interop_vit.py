"""Hugging Face ViT (``ViTForImageClassification``, ``ViTModel``) <-> attnlab
:class:`~attnlab.models.vit.VisionTransformer`.

Written in the Hub layout (transformers 4.x names, which 5.x renames on load); both the
4.x and the 5.x names are read:

    vit.embeddings.{cls_token, position_embeddings}        -> cls, pos
    vit.embeddings.patch_embeddings.projection             -> patch (a strided Conv2d)
    vit.encoder.layer.i.attention.attention.[q; k; v]      -> blocks.i.attn.qkv
    attention.output.dense, layernorm_before               -> attn.out, attn_norm
    intermediate.dense, output.dense, layernorm_after      -> ffn.up, ffn.down, ffn_norm

(5.x: vit.layers.i.attention.{q,k,v,o}_proj, mlp.fc1, mlp.fc2.)
    vit.layernorm, classifier                              -> norm, head
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from attnlab.config import AttentionConfig, FFNConfig, NormConfig
from attnlab.interop import HFCheckpointError
from attnlab.interop_io import Tensors, load_state, read_folder, write_folder
from attnlab.models.vit import VisionTransformer, ViTConfig

_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "relu": "relu", "silu": "silu"}
_ACTIVATIONS_BACK = {v: k for k, v in _ACTIVATIONS.items()}
# transformers 5.x names -> the Hub (4.x) names this module maps
_V5 = [
    (r"^vit\.layers\.(\d+)\.", r"vit.encoder.layer.\1."),
    (r"attention\.q_proj", "attention.attention.query"),
    (r"attention\.k_proj", "attention.attention.key"),
    (r"attention\.v_proj", "attention.attention.value"),
    (r"attention\.o_proj", "attention.output.dense"),
    (r"mlp\.fc1", "intermediate.dense"),
    (r"mlp\.fc2", "output.dense"),
]


def _hub_name(name: str) -> str:
    for pattern, repl in _V5:
        name = re.sub(pattern, repl, name)
    return name


def _size(value: Any) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else (int(value[0]), int(value[1]))


def config_from_vit(hf: dict[str, Any]) -> ViTConfig:
    if hf.get("model_type") != "vit":
        raise HFCheckpointError(f"model_type {hf.get('model_type')!r} is not 'vit'")
    (h, w), (ph, pw) = _size(hf.get("image_size", 224)), _size(hf.get("patch_size", 16))
    if ph != pw:
        raise HFCheckpointError("rectangular patches are not supported")
    act = hf.get("hidden_act", "gelu")
    if act not in _ACTIVATIONS:
        raise HFCheckpointError(f"hidden_act {act!r} is not supported")
    n_classes = hf.get("num_labels") or len(hf.get("id2label") or {}) or 2
    return ViTConfig(
        d_model=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        attention=AttentionConfig(
            n_heads=hf["num_attention_heads"],
            qkv_bias=bool(hf.get("qkv_bias", True)),
            out_bias=True,
            dropout=float(hf.get("attention_probs_dropout_prob", 0.0)),
        ),
        ffn=FFNConfig(kind="mlp", activation=_ACTIVATIONS[act], hidden_dim=hf["intermediate_size"]),
        norm=NormConfig(eps=float(hf.get("layer_norm_eps", 1e-12)), placement="pre"),
        dropout=float(hf.get("hidden_dropout_prob", 0.0)),
        init_std=float(hf.get("initializer_range", 0.02)),
        image_size=h,
        image_width=None if w == h else w,
        channels=hf.get("num_channels", 3),
        patch_size=ph,
        n_classes=n_classes,
    )


def config_to_vit(cfg: ViTConfig) -> dict[str, Any]:
    a = cfg.attention
    if (
        cfg.norm.placement != "pre"
        or cfg.norm.kind != "layernorm"
        or cfg.ffn.kind != "mlp"
        or cfg.ffn.activation not in _ACTIVATIONS_BACK
        or a.kv_heads != a.n_heads
        or cfg.head_dim * a.n_heads != cfg.d_model
        or not a.out_bias
    ):
        raise HFCheckpointError(
            "config is not representable as ViT: it needs pre-norm LayerNorm, an MLP and "
            "multi-head attention with head_dim = d_model / n_heads and an output bias"
        )
    labels = {str(i): f"LABEL_{i}" for i in range(cfg.n_classes)}
    size = (
        cfg.image_size if cfg.image_width in (None, cfg.image_size) else [cfg.image_size, cfg.width]
    )
    return {
        "model_type": "vit",
        "architectures": ["ViTForImageClassification"],
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": a.n_heads,
        "intermediate_size": cfg.ffn.hidden_size(cfg.d_model),
        "hidden_act": _ACTIVATIONS_BACK[cfg.ffn.activation],
        "hidden_dropout_prob": cfg.dropout,
        "attention_probs_dropout_prob": a.dropout,
        "initializer_range": cfg.init_std,
        "layer_norm_eps": cfg.norm.eps,
        "image_size": size,
        "patch_size": cfg.patch_size,
        "num_channels": cfg.channels,
        "qkv_bias": a.qkv_bias,
        "id2label": labels,
        "label2id": {v: int(k) for k, v in labels.items()},
    }


_LAYER = [
    ("attn.out", "attention.output.dense"),
    ("attn_norm", "layernorm_before"),
    ("ffn.up", "intermediate.dense"),
    ("ffn.down", "output.dense"),
    ("ffn_norm", "layernorm_after"),
]
_TOP = [
    ("cls", "vit.embeddings.cls_token"),
    ("pos", "vit.embeddings.position_embeddings"),
    ("patch.weight", "vit.embeddings.patch_embeddings.projection.weight"),
    ("patch.bias", "vit.embeddings.patch_embeddings.projection.bias"),
    ("norm.weight", "vit.layernorm.weight"),
    ("norm.bias", "vit.layernorm.bias"),
    ("head.weight", "classifier.weight"),
    ("head.bias", "classifier.bias"),
]


def vit_to_attnlab(tensors: dict[str, Tensor], cfg: ViTConfig) -> dict[str, Tensor]:
    tensors = {_hub_name(k): v for k, v in tensors.items()}
    src = Tensors(tensors, ignore=("pooler.dense.weight", "pooler.dense.bias"))
    out = {ours: src.take(theirs) for ours, theirs in _TOP}
    for i in range(cfg.n_layers):
        h, a = f"vit.encoder.layer.{i}.", f"blocks.{i}."
        names = ("query", "key", "value")
        qkv = [src.take(f"{h}attention.attention.{n}.weight") for n in names]
        out[f"{a}attn.qkv.weight"] = torch.cat(qkv, 0)
        if cfg.attention.qkv_bias:
            qkv = [src.take(f"{h}attention.attention.{n}.bias") for n in names]
            out[f"{a}attn.qkv.bias"] = torch.cat(qkv, 0)
        for ours, theirs in _LAYER:
            for s in ("weight", "bias"):
                out[f"{a}{ours}.{s}"] = src.take(f"{h}{theirs}.{s}")
    src.finish()
    return out


def attnlab_to_vit(sd: dict[str, Tensor], cfg: ViTConfig) -> dict[str, Tensor]:
    out = {theirs: sd[ours] for ours, theirs in _TOP}
    for i in range(cfg.n_layers):
        h, a = f"vit.encoder.layer.{i}.", f"blocks.{i}."
        for s in ("weight", "bias") if cfg.attention.qkv_bias else ("weight",):
            parts = sd[f"{a}attn.qkv.{s}"].split(cfg.d_model, 0)
            for n, t in zip(("query", "key", "value"), parts):
                out[f"{h}attention.attention.{n}.{s}"] = t
        for ours, theirs in _LAYER:
            for s in ("weight", "bias"):
                out[f"{h}{theirs}.{s}"] = sd[f"{a}{ours}.{s}"]
    return out


def load_vit(path: str | Path) -> VisionTransformer:
    """A :class:`VisionTransformer` (eval mode) from a transformers ViT classifier folder."""
    hf, tensors = read_folder(path)
    cfg = config_from_vit(hf)
    model = VisionTransformer(cfg)
    load_state(model, vit_to_attnlab(tensors, cfg), set())
    return model.eval()


def save_vit(model: VisionTransformer, path: str | Path) -> None:
    """A folder ``transformers.ViTForImageClassification.from_pretrained`` loads."""
    write_folder(path, config_to_vit(model.cfg), attnlab_to_vit(model.state_dict(), model.cfg))
