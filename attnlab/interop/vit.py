"""ViT (``model_type`` vit, ``ViTForImageClassification``) <-> attnlab
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

The image processor's normalisation (preprocessor_config.json, else ViTImageProcessor's
defaults: mean and std 0.5) becomes the config's image_mean / image_std, which ``attnlab
classify`` applies to pixels in [0, 1], and its ``resample`` filter (default bilinear) the
config's ``resample``, with which ``classify`` resizes images of another size; export
writes both back.

Shapes: d d_model.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import Tensor

from attnlab.config import AttentionConfig, FFNConfig, ModelConfig, NormConfig
from attnlab.interop import io
from attnlab.interop.io import (
    PREPROCESSOR_CONFIG_NAME,
    Family,
    HFCheckpointError,
    Plan,
    Source,
    Specs,
    activation,
    dtype_entries,
    get,
    hf_activation,
    label_entries,
    label_names,
    n_labels,
    unplan,
    unrepresentable,
)
from attnlab.models.vit import RESAMPLE_FILTERS, ViTConfig

ARCHITECTURES = {"vit": ("ViTForImageClassification",)}

# transformers' class defaults (ViTConfig) for the config.json keys read here (Family.defaults).
DEFAULTS: dict[str, dict[str, Any]] = {
    "vit": {
        "hidden_size": 768,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "intermediate_size": 3072,
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        "initializer_range": 0.02,
        "layer_norm_eps": 1e-12,
        "image_size": 224,
        "patch_size": 16,
        "num_channels": 3,
        "qkv_bias": True,
    },
}
TO_HF_ACTIVATIONS = {**io.TO_HF_ACTIVATIONS, "gelu_tanh": "gelu_new"}
# A pooler the classifier does not use (ViTModel checkpoints carry one).
IGNORED = re.compile(r"^vit\.pooler\.dense\.(weight|bias)$")
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


def hub_name(name: str) -> str:
    for pattern, repl in _V5:
        name = re.sub(pattern, repl, name)
    return name


def _size(value: Any) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else (int(value[0]), int(value[1]))


def config_from_hf(hf: dict[str, Any], model_type: str = "vit") -> ViTConfig:
    (h, w), (ph, pw) = _size(hf.get("image_size", 224)), _size(hf.get("patch_size", 16))
    classes = n_labels(hf)
    if ph != pw:
        raise HFCheckpointError("ViT: rectangular patches are not supported")
    problem_type = hf.get("problem_type")
    if problem_type is None and classes == 1:
        # transformers reads one label without a problem_type as regression (an MSE loss;
        # its image-classification pipeline a sigmoid): attnlab's softmax over one class
        # would give every image probability 1
        raise HFCheckpointError(
            "ViT: config.json has one label and no problem_type, which transformers reads as "
            "regression; attnlab's ViT is a single-label classifier (2 or more labels)"
        )
    if problem_type not in (None, "single_label_classification"):
        # attnlab's ViT scores its classes by a softmax (its loss, classify): a multi-label
        # or regression head would be run as one
        raise HFCheckpointError(
            f"ViT: config.json problem_type={problem_type!r} is not supported; attnlab's ViT "
            "is a single-label classifier (single_label_classification)"
        )
    return ViTConfig(
        d_model=get(hf, "hidden_size"),
        n_layers=get(hf, "num_hidden_layers"),
        attention=AttentionConfig(
            n_heads=get(hf, "num_attention_heads"),
            qkv_bias=bool(hf.get("qkv_bias", True)),
            out_bias=True,
            dropout=float(hf.get("attention_probs_dropout_prob", 0.0)),
        ),
        ffn=FFNConfig(
            kind="mlp",
            activation=activation(hf.get("hidden_act", "gelu"), "hidden_act"),
            hidden_dim=get(hf, "intermediate_size"),
        ),
        norm=NormConfig(eps=float(hf.get("layer_norm_eps", 1e-12)), placement="pre"),
        dropout=float(hf.get("hidden_dropout_prob", 0.0)),
        init_std=float(hf.get("initializer_range", 0.02)),
        image_size=h,
        image_width=None if w == h else w,
        channels=hf.get("num_channels", 3),
        patch_size=ph,
        n_classes=classes,
        class_names=label_names(hf, classes),
        **normalization(hf, hf.get("num_channels", 3)),
        resample=resample_filter(hf.get("resample", RESAMPLE_FILTERS["bilinear"])),
    )


def resample_filter(code: Any) -> str:
    """The name of an image processor's ``resample`` (PIL's filter number; ViTImageProcessor's
    default is bilinear, 2)."""
    names = {number: name for name, number in RESAMPLE_FILTERS.items()}
    if isinstance(code, bool) or code not in names:
        raise HFCheckpointError(
            f"{PREPROCESSOR_CONFIG_NAME}: resample={code!r} is not one of PIL's filters "
            f"({', '.join(f'{n} {name}' for n, name in sorted(names.items()))})"
        )
    return names[code]


# transformers' ViTImageProcessor defaults (IMAGENET_STANDARD_MEAN / _STD, 8-bit rescaling)
PROCESSOR_DEFAULTS = {"do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True}
DEFAULT_MEAN = DEFAULT_STD = 0.5


def normalization(hf: dict[str, Any], channels: int) -> dict[str, list[float] | None]:
    """ViTConfig's image_mean / image_std from an image processor's settings (the keys of
    preprocessor_config.json; absent ones take ViTImageProcessor's defaults): what its
    (pixel * rescale_factor - mean) / std is for pixels p = pixel / 255 in [0, 1],
    (p - mean') / std' with mean' = mean / (255 rescale_factor), std' likewise. None when
    that is the pixels as they are."""
    settings = PROCESSOR_DEFAULTS | {k: v for k, v in hf.items() if k in PROCESSOR_DEFAULTS}
    factor = settings["rescale_factor"] if settings["do_rescale"] else 1.0
    if settings["do_normalize"]:
        mean = hf.get("image_mean", DEFAULT_MEAN)
        std = hf.get("image_std", DEFAULT_STD)
    else:
        mean, std = 0.0, 1.0
    mean, std = (v if isinstance(v, list) else [v] * channels for v in (mean, std))
    for key, values in (("rescale_factor", [factor]), ("image_mean", mean), ("image_std", std)):
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            per = "" if key == "rescale_factor" else " (or a list, one per channel)"
            raise HFCheckpointError(
                f"{PREPROCESSOR_CONFIG_NAME}: {key} must be a number{per}, got {hf[key]!r}"
            )
    if len(mean) != channels or len(std) != channels:
        raise HFCheckpointError(
            f"image_mean {mean} and image_std {std} need one value per channel "
            f"(num_channels={channels})"
        )
    to_unit = 255.0 * float(factor)  # pixels in [0, 1] -> the processor's rescaled pixels
    mean = [round(float(m) / to_unit, 12) for m in mean]  # (1/255 x 255 is not 1 exactly)
    std = [round(float(s) / to_unit, 12) for s in std]
    if all(m == 0.0 for m in mean) and all(s == 1.0 for s in std):
        return {"image_mean": None, "image_std": None}
    return {"image_mean": mean, "image_std": std}


def preprocessor_config(cfg: ViTConfig) -> dict[str, dict[str, Any]]:
    """The preprocessor_config.json export writes: transformers' ViTImageProcessor resizing
    to the model's size with the model's filter (``resample``, as ``attnlab classify``) and
    normalising as the model's image_mean / image_std (none: do_normalize false)."""
    normalize = cfg.image_mean is not None
    channels = cfg.channels
    return {
        PREPROCESSOR_CONFIG_NAME: {
            "image_processor_type": "ViTImageProcessor",
            "do_resize": True,
            "size": {"height": cfg.image_size, "width": cfg.width},
            "resample": RESAMPLE_FILTERS[cfg.resample],  # PIL's filter number
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": normalize,
            "image_mean": cfg.image_mean if normalize else [DEFAULT_MEAN] * channels,
            "image_std": cfg.image_std if normalize else [DEFAULT_STD] * channels,
        }
    }


def exports(cfg: ModelConfig) -> bool:
    return cfg.arch == "vit"


def export_type(cfg: ModelConfig) -> str:
    a = cfg.attention
    if (
        cfg.norm.placement != "pre"
        or cfg.norm.kind != "layernorm"
        or not cfg.norm.bias
        or cfg.ffn.kind != "mlp"
        or not cfg.ffn.bias
        or cfg.ffn.activation not in TO_HF_ACTIVATIONS
        or a.kind != "mha"
        or a.kv_heads != a.n_heads
        or cfg.head_dim * a.n_heads != cfg.d_model
        or not a.out_bias
    ):
        raise unrepresentable(
            "ViT needs pre-norm LayerNorm with bias, an MLP with biases and multi-head "
            "attention with head_dim = d_model / n_heads and an output bias"
        )
    if cfg.n_classes == 1:  # transformers reads num_labels 1 as regression (see above)
        raise unrepresentable(
            "ViT with n_classes=1: transformers reads one label as regression; a "
            "single-label classifier needs n_classes >= 2"
        )
    return "vit"


def config_to_hf(cfg: ViTConfig, model_type: str, dtype: torch.dtype) -> dict[str, Any]:
    a = cfg.attention
    square = cfg.image_width in (None, cfg.image_size)
    return {
        "model_type": "vit",
        "architectures": ["ViTForImageClassification"],
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": a.n_heads,
        "intermediate_size": cfg.ffn.hidden_size(cfg.d_model),
        "hidden_act": hf_activation(cfg.ffn.activation, TO_HF_ACTIVATIONS),
        "hidden_dropout_prob": cfg.dropout,
        "attention_probs_dropout_prob": a.dropout,
        "initializer_range": cfg.init_std,
        "layer_norm_eps": cfg.norm.eps,
        "image_size": cfg.image_size if square else [cfg.image_size, cfg.width],
        "patch_size": cfg.patch_size,
        "num_channels": cfg.channels,
        "qkv_bias": a.qkv_bias,
        **label_entries(cfg.n_classes, cfg.class_names),
        **dtype_entries(dtype),
    }


_LAYER = [
    ("attn.out", "attention.output.dense"),
    ("attn_norm", "layernorm_before"),
    ("ffn.up", "intermediate.dense"),
    ("ffn.down", "output.dense"),
    ("ffn_norm", "layernorm_after"),
]
_TOP = {
    "cls": "vit.embeddings.cls_token",
    "pos": "vit.embeddings.position_embeddings",
    "patch.weight": "vit.embeddings.patch_embeddings.projection.weight",
    "patch.bias": "vit.embeddings.patch_embeddings.projection.bias",
    "norm.weight": "vit.layernorm.weight",
    "norm.bias": "vit.layernorm.bias",
    "head.weight": "classifier.weight",
    "head.bias": "classifier.bias",
}


def _specs(cfg: ViTConfig) -> Specs:
    """attnlab name -> HF name(s), in the Hub layout."""
    specs: Specs = dict(_TOP)
    for i in range(cfg.n_layers):
        h, a = f"vit.encoder.layer.{i}.", f"blocks.{i}."
        for s in ("weight", "bias") if cfg.attention.qkv_bias else ("weight",):
            specs[f"{a}attn.qkv.{s}"] = [
                f"{h}attention.attention.{n}.{s}" for n in ("query", "key", "value")
            ]
        for ours, theirs in _LAYER:
            for s in ("weight", "bias"):
                specs[f"{a}{ours}.{s}"] = f"{h}{theirs}.{s}"
    return specs


def weights_to_attnlab(src: Source, cfg: ViTConfig) -> Plan:
    return src.plan(_specs(cfg))  # type: ignore[return-value]  # None only with src.missing


def weights_from_attnlab(
    sd: dict[str, Tensor], cfg: ViTConfig, model_type: str
) -> dict[str, Tensor]:
    return unplan(_specs(cfg), sd)


FAMILY = Family(
    name="vit",
    arch="vit",
    architectures=ARCHITECTURES,
    config_from_hf=config_from_hf,
    defaults=DEFAULTS,
    config_to_hf=config_to_hf,  # type: ignore[arg-type]  # a ViTConfig family
    weights_to_attnlab=weights_to_attnlab,  # type: ignore[arg-type]
    weights_from_attnlab=weights_from_attnlab,  # type: ignore[arg-type]
    exports=exports,
    export_type=export_type,
    ignored=IGNORED,
    rename=hub_name,
    task=lambda cfg: "image-classification",
    extra_files=preprocessor_config,  # type: ignore[arg-type]
)
