"""``attnlab classify``: classify images with a ViT: a checkpoint of the image-classification
task or an imported one (classes shown by their names, config.json's ``id2label``, where
the model has them). Each image is resized to the model's size; its channel count must be
the model's (1: grayscale)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from attnlab.cli.common import CLIError, load_for_inference, positive_int, resolve_device

CHANNELS_OF_MODE = {"1": 1, "L": 1, "I": 1, "I;16": 1, "F": 1, "P": 3, "RGB": 3, "RGBA": 4,
                    "LA": 2, "CMYK": 4, "YCbCr": 3}  # fmt: skip


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "classify",
        help="classify images (an image-classification checkpoint)",
        description="Classify images with a ViT trained for the image-classification task "
        "(attnlab train --preset vit-digits). Pixels are scaled to [0, 1]; the digits "
        "were light strokes on a dark ground (use --invert for dark on light).",
    )
    p.add_argument("--ckpt", required=True, metavar="DIR", help="checkpoint folder")
    p.add_argument("images", nargs="+", metavar="IMAGE", help="image files (PNG, JPEG, ...)")
    p.add_argument("--invert", action="store_true", help="use 1 - pixel (dark on light)")
    p.add_argument("--top", type=positive_int, default=3, metavar="K", help="classes shown")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ... (default auto)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=run)


def load_image(path: str, channels: int, height: int, width: int) -> torch.Tensor:
    """(channels, height, width) float32 in [0, 1]; CLIError when the file is not an image
    or its channel count is not ``channels``."""
    from PIL import Image, UnidentifiedImageError

    if not Path(path).is_file():
        raise CLIError(f"{path}: no such file")
    try:
        image = Image.open(path)
        image.load()
    except (UnidentifiedImageError, OSError) as e:
        raise CLIError(f"{path}: not an image ({e})") from None
    have = CHANNELS_OF_MODE.get(image.mode)
    if have != channels:
        want = "grayscale (1 channel)" if channels == 1 else f"{channels} channels"
        raise CLIError(
            f"{path}: a {image.mode} image with {have or 'unknown'} channels; the model takes "
            f"{want} images. Convert it (e.g. PIL: image.convert('L'))"
        )
    if image.mode == "P":
        image = image.convert("RGB")
    # The largest pixel value of the mode: pixels become [0, 1] (float images are taken as is).
    top = {"1": 1.0, "L": 255.0, "RGB": 255.0, "I": 65535.0, "I;16": 65535.0}.get(image.mode)
    array = np.asarray(image, dtype=np.float32)
    x = torch.from_numpy(array / top if top else array)
    x = x[None] if x.dim() == 2 else x.permute(2, 0, 1)  # (C, H, W)
    if tuple(x.shape[1:]) != (height, width):
        x = torch.nn.functional.interpolate(
            x[None], size=(height, width), mode="bilinear", antialias=True, align_corners=False
        )[0]
    return x.clamp(0.0, 1.0)


def run(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    model, cfg, _ = load_for_inference(args.ckpt, device)
    if cfg.model.arch != "vit":  # trained for image-classification, or an imported ViT
        raise CLIError(
            f"{args.ckpt} holds a {cfg.model.arch!r} model; classify needs an "
            "image-classification checkpoint (attnlab train --preset vit-digits, or an "
            "imported ViT)"
        )
    m = cfg.model
    names = m.class_names or [str(i) for i in range(m.n_classes)]
    images = torch.stack([load_image(p, m.channels, m.image_size, m.width) for p in args.images])
    if args.invert:
        images = 1.0 - images
    with torch.no_grad():
        probs = model(images.to(device)).logits.float().softmax(-1).cpu()
    k = min(args.top, probs.shape[-1])
    report = {}
    for path, row in zip(args.images, probs):
        top = row.topk(k)
        report[path] = {
            "class": int(top.indices[0]),
            "top": [[int(i), round(float(p), 4)] for p, i in zip(top.values, top.indices)],
        }
        if m.class_names:
            report[path]["label"] = names[int(top.indices[0])]
    if args.json:
        print(json.dumps(report))
    else:
        for path, r in report.items():
            shown = ", ".join(f"{names[c]}: {p:.3f}" for c, p in r["top"])
            print(f"{path}\t{names[r['class']]}\t({shown})")
    return 0
