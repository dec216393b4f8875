"""Vision Transformer (Dosovitskiy et al. 2021): an image is a sequence of patches.

    x_p  = Conv_{P x P, stride P}(image)                 patch embedding (b, N, d), N = HW / P^2
    h_0  = [cls; x_p] + E_pos                            learned positions, N + 1 of them
    h_l  = Block_l(h_{l-1})                              pre-norm, bidirectional
    logits = W norm(h_L)[:, 0]                           classify the [CLS] token

Shapes: b batch, C channels, H x W image, P patch size, N patches, d d_model, n classes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.config import (
    CAUSAL_KINDS,
    AttentionConfig,
    FFNConfig,
    ModelConfig,
    NormConfig,
    _fail,
    _positive,
    register_model_config,
)
from attnlab.functional.softmax import softmax_dtype
from attnlab.models.build import register_model
from attnlab.models.inputs import check_targets
from attnlab.models.loadable import LoadableModel
from attnlab.models.outputs import ModelOutput, aux_modules, finish_loss
from attnlab.nn.block import TransformerStack
from attnlab.nn.linear import Linear
from attnlab.nn.norm import build_norm

# PIL's resampling filters by name, with the number a Hugging Face image processor's
# ``resample`` gives (PIL.Image.Resampling).
RESAMPLE_FILTERS = {"nearest": 0, "lanczos": 1, "bilinear": 2, "bicubic": 3, "box": 4, "hamming": 5}


@dataclass
class ViTConfig(ModelConfig):
    """``image_size`` (height; ``image_width`` None: square), ``channels``, ``patch_size``
    (must divide both sides), ``n_classes`` and optionally their names (``class_names``,
    e.g. an imported model's ``id2label``). Defaults follow ViT: pre-norm LayerNorm,
    GELU MLP, attention biases. ``vocab_size`` and ``max_seq_len`` are unused."""

    arch: str = "vit"
    attention: AttentionConfig = field(
        default_factory=lambda: AttentionConfig(qkv_bias=True, out_bias=True)
    )
    norm: NormConfig = field(default_factory=lambda: NormConfig(placement="pre", eps=1e-12))
    image_size: int = 32
    image_width: int | None = None
    channels: int = 3
    patch_size: int = 4
    n_classes: int = 10
    class_names: list[str] | None = None
    # The per-channel normalisation of the model's inputs, for pixels in [0, 1]:
    # (pixel - image_mean) / image_std (a Hugging Face image processor's, e.g. 0.5 and 0.5);
    # None: the pixels as they are. Applied by what feeds images (normalize_pixels).
    image_mean: list[float] | None = None
    image_std: list[float] | None = None
    # How images of another size are resized to the model's (PIL's filter, on the 8-bit
    # pixels, as a Hugging Face image processor's ``resample``): one of RESAMPLE_FILTERS.
    resample: str = "bilinear"

    def validate(self, path: str = "") -> None:
        super().validate(path)
        at = (lambda name: f"{path}.{name}") if path else (lambda name: name)
        for name in ("image_size", "image_width", "channels", "patch_size", "n_classes"):
            _positive(at(name), getattr(self, name))
        if self.position.kind != "learned":
            _fail(at("position.kind"), "ViT uses learned positions")
        if self.attention.kind in CAUSAL_KINDS:
            _fail(at("attention.kind"), f"{self.attention.kind!r} attention is causal only; a "
                  "ViT attends both ways: use mha, mla or dsa")  # fmt: skip
        names = self.class_names
        if names is not None and len(names) != self.n_classes:
            _fail(
                at("class_names"),
                f"{len(names)} names for n_classes={self.n_classes}; give one per class or null",
            )
        if (self.image_mean is None) != (self.image_std is None):
            _fail(at("image_mean"), "give image_mean and image_std together, or neither")
        for name in ("image_mean", "image_std"):
            values = getattr(self, name)
            if values is None:
                continue
            if len(values) != self.channels:
                _fail(at(name), f"{len(values)} values for channels={self.channels}; give one "
                      "per channel")  # fmt: skip
            if not all(math.isfinite(v) for v in values) or (
                name == "image_std" and min(values) <= 0
            ):
                _fail(at(name), f"must be finite{' and > 0' if name == 'image_std' else ''}, "
                      f"got {values}")  # fmt: skip
        if self.resample not in RESAMPLE_FILTERS:
            _fail(at("resample"), f"unknown filter {self.resample!r}; choose one of "
                  f"{', '.join(RESAMPLE_FILTERS)}")  # fmt: skip
        h, w, p = self.image_size, self.width, self.patch_size
        if h % p or w % p:
            _fail(
                at("patch_size"),
                f"patch_size={p} must divide the image height {h} and width {w}; "
                f"pick a divisor (e.g. {_divisors(h, w)})",
            )

    @property
    def width(self) -> int:
        """Image width in pixels: ``image_width``, else square (``image_size``)."""
        return self.image_width or self.image_size

    @property
    def n_patches(self) -> int:
        """Patches per image: (height / patch) x (width / patch)."""
        return (self.image_size // self.patch_size) * (self.width // self.patch_size)


def normalize_pixels(pixels: Tensor, cfg: ViTConfig) -> Tensor:
    """pixels (b, C, H, W) in [0, 1] -> the model's inputs: (pixels - image_mean) /
    image_std per channel, as the image processor its weights were trained with (an
    imported ViT's ``preprocessor_config.json``), or the pixels unchanged."""
    if cfg.image_mean is None:
        return pixels
    mean = torch.tensor(cfg.image_mean, dtype=pixels.dtype, device=pixels.device)
    std = torch.tensor(cfg.image_std, dtype=pixels.dtype, device=pixels.device)
    return (pixels - mean[:, None, None]) / std[:, None, None]


def _divisors(h: int, w: int) -> str:
    return ", ".join(str(p) for p in range(1, min(h, w) + 1) if h % p == 0 and w % p == 0)


register_model_config("vit", ViTConfig)


class VisionTransformer(LoadableModel):
    """``model(images, targets=labels)`` -> :class:`ModelOutput` with logits (b, n).

    Images are the config's size (image_size x width) unless ``interpolate_pos_encoding=True``
    (transformers' option of that name): then any size that is a whole number of patches, the
    patch position embeddings resized bicubically (align_corners=False) from the config's
    grid to the image's, the [CLS] token's kept as it is."""

    # The class token and position embeddings take no weight decay (the optimizer), though
    # they are matrices: as timm's ViT (no_weight_decay) and Google's big_vision train them.
    no_weight_decay = ("cls", "pos")
    embedding_tables = ("pos",)  # the learned positions: embedding parameters (`info`)

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        d, p = cfg.d_model, cfg.patch_size
        self.patch = nn.Conv2d(cfg.channels, d, kernel_size=p, stride=p)
        self.cls = nn.Parameter(torch.zeros(1, 1, d))
        self.pos = nn.Parameter(torch.zeros(1, cfg.n_patches + 1, d))
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = TransformerStack(cfg, causal=False)
        self.norm = build_norm(cfg.norm, d) if cfg.norm.placement == "pre" else nn.Identity()
        self.head = Linear(d, cfg.n_classes)
        self.apply(self._init_weights)
        nn.init.trunc_normal_(self.pos, std=cfg.init_std)
        nn.init.trunc_normal_(self.cls, std=cfg.init_std)
        self._aux = aux_modules(self)  # MoE balance losses (outputs.py)

    def _init_weights(self, m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            nn.init.trunc_normal_(m.weight, std=self.cfg.init_std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif hasattr(m, "init_weights"):  # modules with raw parameters (MoE experts, router)
            m.init_weights(self.cfg.init_std)

    def features(self, images: Tensor, *, interpolate_pos_encoding: bool = False) -> Tensor:
        """images (b, C, H, W) -> final hidden states (b, N + 1, d); index 0 is [CLS]."""
        cfg = self.cfg
        expected = (cfg.channels, cfg.image_size, cfg.width)
        if images.dim() != 4 or images.shape[1] != cfg.channels:
            raise ValueError(
                f"expected images of shape (b, {', '.join(map(str, expected))}) (channels "
                f"first), got {tuple(images.shape)}"
            )
        h, w, p = *images.shape[2:], cfg.patch_size
        if not interpolate_pos_encoding and (h, w) != expected[1:]:
            raise ValueError(
                f"expected images of the model's size {cfg.image_size} x {cfg.width}, got "
                f"{h} x {w}; pass interpolate_pos_encoding=True to resize the position embeddings"
            )
        if h % p or w % p:
            raise ValueError(
                f"image size {h} x {w} is not a whole number of {p} x {p} patches; resize or "
                f"crop it to multiples of {p}"
            )
        if not images.is_floating_point():
            # an integer tensor is raw pixels (uint8 0..255): cast as they are, the logits
            # would be those of an image 255 times too bright, silently
            raise TypeError(
                f"images must be floating point (pixels scaled to [0, 1], then normalised by the "
                f"model's image_mean / image_std), got {images.dtype}; e.g. images.float() / 255"
            )
        # pixels in the weights' dtype, as transformers' ViT: a bf16 model takes float32 images
        x = self.patch(images.to(self.patch.weight.dtype))  # (b, d, H/P, W/P)
        x = x.flatten(2).transpose(1, 2)  # (b, N, d): patches in row-major order
        x = torch.cat((self.cls.expand(x.shape[0], -1, -1), x), dim=1)  # (b, N + 1, d)
        x = self.drop(x + self._positions(h // p, w // p))
        return self.norm(self.blocks(x))

    def _positions(self, rows: int, cols: int) -> Tensor:
        """Position embeddings (1, 1 + rows * cols, d) for a rows x cols patch grid: the
        learned ones, or their patch part resized bicubically, as transformers' ViT."""
        cfg = self.cfg
        grid = (cfg.image_size // cfg.patch_size, cfg.width // cfg.patch_size)
        if (rows, cols) == grid:
            return self.pos
        d = self.pos.shape[-1]
        patches = self.pos[:, 1:].reshape(1, *grid, d).permute(0, 3, 1, 2)  # (1, d, h0, w0)
        patches = F.interpolate(patches, size=(rows, cols), mode="bicubic", align_corners=False)
        return torch.cat((self.pos[:, :1], patches.permute(0, 2, 3, 1).reshape(1, -1, d)), dim=1)

    def forward(
        self,
        images: Tensor,
        *,
        targets: Tensor | None = None,
        interpolate_pos_encoding: bool = False,
    ) -> ModelOutput:
        features = self.features(images, interpolate_pos_encoding=interpolate_pos_encoding)
        logits = self.head(features[:, 0])  # (b, n)
        loss = None
        if targets is not None:
            b = logits.shape[0]
            # (b, 1) class ids too, as transformers' labels.view(-1)
            flat = targets.reshape(-1) if targets.numel() == b else targets
            targets = check_targets("targets", flat, (b,), "(b,) class ids")
            loss = F.cross_entropy(softmax_dtype(logits), targets)
        return ModelOutput(logits, *finish_loss(self._aux, loss, self.training))

    def num_parameters(self) -> int:
        """Parameters (tied ones counted once)."""
        return sum(p.numel() for p in self.parameters())


register_model("vit")(VisionTransformer)


def vit_digits() -> ViTConfig:
    """A ViT for scikit-learn's 8 x 8 digits: 2 x 2 patches (16 + [CLS] tokens), d 64,
    3 layers, no dropout. ``init_std`` 0.1: with 0.02 the [CLS] token's logits start near
    zero and the loss sits at chance (ln 10) for ~100 steps. ``python
    benchmarks/vit_digits.py`` trains it (measured 99% test accuracy in 150 s, 1 thread)."""
    return ViTConfig(
        d_model=64,
        n_layers=3,
        attention=AttentionConfig(n_heads=4, qkv_bias=True, out_bias=True),
        ffn=FFNConfig(kind="mlp", activation="gelu", hidden_dim=128),
        dropout=0.0,
        init_std=0.1,
        image_size=8,
        channels=1,
        patch_size=2,
        n_classes=10,
    )
