"""``attnlab classify``: classify inputs with a classification checkpoint, by its task:
images with a ViT (the image-classification task, or an imported ViT whose classes are
shown by their names, config.json's ``id2label``; each image is resized to the model's
size, its channel count must be the model's, 1: grayscale, and its pixels in [0, 1] are
normalised as the model's image_mean / image_std say: an imported ViT's image
processor), texts with an encoder of the text-classification task (the class names are
the task's labels) or an imported ``BertForSequenceClassification`` (its id2label's
names, its own WordPiece tokenizer and special tokens)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from attnlab.cli.common import (
    CLIError,
    add_checkpoint_argument,
    add_device_argument,
    add_dtype_argument,
    add_tokenizer_argument,
    load_for_inference,
    positive_int,
    refuse_tokenizer_option,
    resolve_device,
    tokenizer_option,
)
from attnlab.fileio import file_kind
from attnlab.functional.softmax import softmax_dtype
from attnlab.models.vit import RESAMPLE_FILTERS, normalize_pixels

CHANNELS_OF_MODE = {"1": 1, "L": 1, "I": 1, "I;16": 1, "F": 1, "P": 3, "RGB": 3, "RGBA": 4,
                    "LA": 2, "CMYK": 4, "YCbCr": 3}  # fmt: skip


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "classify",
        help="classify images or texts (an image- or text-classification checkpoint)",
        description="Classify images with a ViT trained for the image-classification task "
        "(attnlab train --preset vit-digits) or an imported ViT, or texts with an encoder "
        "trained for the text-classification task (attnlab train --preset bert-tiny-langid) "
        "or an imported BertForSequenceClassification. Pixels are "
        "scaled to [0, 1]; the digits were light strokes on a dark ground (use --invert for "
        "dark on light).",
    )
    add_checkpoint_argument(p)
    p.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="image files (PNG, JPEG, ...) for an image classifier, texts for a text classifier",
    )
    p.add_argument("--invert", action="store_true", help="images: use 1 - pixel (dark on light)")
    p.add_argument("--top", type=positive_int, default=3, metavar="K", help="classes shown")
    add_tokenizer_argument(p)
    add_device_argument(p)
    add_dtype_argument(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=run)


def load_image(
    path: str, channels: int, height: int, width: int, resample: str = "bilinear"
) -> torch.Tensor:
    """(channels, height, width) float32 in [0, 1]; CLIError when the file is not an image
    or its channel count is not ``channels``. An image of another size is resized with
    PIL's ``resample`` filter (a ViT config's ``resample``), as transformers' image
    processors do: 8-bit images as 8-bit pixels (rounded), others as float32."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    if Path(path).is_dir():
        raise CLIError(f"{path}: a folder; give image files")
    if not Path(path).exists():
        raise CLIError(f"{path}: no such file")
    if not Path(path).is_file():  # /dev/null, a FIFO (whose read would wait): not "no such file"
        raise CLIError(f"{path}: {file_kind(path)}, not an image file; give image files")
    try:
        image = Image.open(path)
        image.load()
    except (UnidentifiedImageError, OSError) as e:
        raise CLIError(f"{path}: not an image ({e})") from None
    image = ImageOps.exif_transpose(image)  # upright, as viewers show it (and transformers)
    have = CHANNELS_OF_MODE.get(image.mode)
    if have != channels:
        want = "grayscale (1 channel)" if channels == 1 else f"{channels} channels"
        to = {1: "L", 2: "LA", 3: "RGB", 4: "RGBA"}.get(channels)  # the mode it takes
        raise CLIError(
            f"{path}: an image of mode {image.mode} ({_channels(have)}); the model takes "
            f"{want} images." + (f" Convert it (e.g. PIL: image.convert({to!r}))" if to else "")
        )
    if image.mode in ("P", "YCbCr"):  # palette indices, luma and chroma: not R, G, B
        image = image.convert("RGB")
    if image.mode == "1":  # 1-bit pixels as 8-bit ones (0 and 255): resized as 8-bit
        image = image.convert("L")
    # The largest pixel value of the mode: pixels become [0, 1] (float images are taken as is).
    eight_bit = dict.fromkeys(("L", "LA", "RGB", "RGBA", "CMYK", "YCbCr"), 255.0)
    top = {"I": 65535.0, "I;16": 65535.0, **eight_bit}.get(image.mode)
    if image.size != (width, height):  # PIL's sizes are (width, height)
        if image.mode not in eight_bit:  # 16/32-bit integers, float: resized as float
            image = image.convert("F")
        image = image.resize((width, height), Image.Resampling(RESAMPLE_FILTERS[resample]))
    array = np.asarray(image, dtype=np.float32)
    x = torch.from_numpy(array / top if top else array)
    x = x[None] if x.dim() == 2 else x.permute(2, 0, 1)  # (C, H, W)
    return x.clamp(0.0, 1.0)


def run(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    model, cfg, tokenizer = load_for_inference(args.ckpt, device, args.dtype)
    if cfg.task == "text-classification":
        if args.invert:
            raise CLIError("--invert applies to images; this is a text-classification checkpoint")
        tokenizer = tokenizer_option(args.tokenizer, tokenizer, cfg.model.vocab_size)
        report = classify_texts(model, cfg, tokenizer, args.inputs, args.top, device, args.ckpt)
    elif cfg.model.arch == "vit":  # trained for image-classification, or an imported ViT
        refuse_tokenizer_option(args.tokenizer, f"{args.ckpt} is an image classifier")
        report = classify_images(model, cfg, args.inputs, args.invert, args.top, device)
    else:
        raise CLIError(
            f"{args.ckpt} holds a {cfg.model.arch!r} model for task {cfg.task!r}; classify "
            "needs an image-classification checkpoint (attnlab train --preset vit-digits, or "
            "an imported ViT) or a text-classification one (attnlab train --preset "
            "bert-tiny-langid) or an imported BertForSequenceClassification"
        )
    if args.json:  # one entry per distinct input (a repeated one has the same result)
        print(json.dumps(report, ensure_ascii=False))
    else:  # one line per input, in order, repeats included
        names = cfg.model.class_names if cfg.model.arch == "vit" else None
        label = (lambda c: names[c]) if names else (lambda c: c)  # noqa: E731
        for name in args.inputs:
            r = report[name]
            shown = ", ".join(f"{label(c)}: {p:.3f}" for c, p in r["top"])
            print(f"{name}\t{label(r['class'])}\t({shown})")
    return 0


def _top(probs: torch.Tensor, names: list, k: int) -> dict:
    top = probs.topk(min(k, probs.shape[-1]))
    ranked = [[names[int(i)], round(float(p), 4)] for p, i in zip(top.values, top.indices)]
    return {"class": ranked[0][0], "top": ranked}


def classify_images(model, cfg, paths: list[str], invert: bool, k: int, device: str) -> dict:
    """path -> {"class": digit, "top": [[digit, prob], ...]} for each image file."""
    m = cfg.model
    names = m.class_names or [str(i) for i in range(m.n_classes)]
    images = torch.stack(
        [load_image(p, m.channels, m.image_size, m.width, m.resample) for p in paths]
    )
    if invert:
        images = 1.0 - images
    images = normalize_pixels(images, m)  # an imported ViT's image processor's normalisation
    with torch.no_grad():
        probs = softmax_dtype(model(images.to(device)).logits).softmax(-1).cpu()
    report = {}
    for path, row in zip(paths, probs):
        report[path] = _top(row, list(range(row.numel())), k)
        if m.class_names:
            report[path]["label"] = names[report[path]["class"]]
    return report


def _shown(text: str, limit: int = 50) -> str:
    """A text as an error names it: a long one by its start (the whole of a page-long text
    made an error line of that length)."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"


def classify_texts(model, cfg, tokenizer, texts: list[str], k: int, device: str, ckpt) -> dict:
    """text -> {"class": label name, "top": [[name, prob], ...]} for each text: softmax
    over the classes of ``[CLS] text [SEP]`` (the texts padded to one batch), or a sigmoid
    per class for a multi-label classifier (problem_type multi_label_classification), as
    transformers' text-classification pipeline."""
    from attnlab.cli.common import label_names, require_tokenizer, text_codec
    from attnlab.tasks.text import check_length, pad
    from attnlab.tokenizers import TokenizerError

    problem = getattr(cfg.model, "problem_type", None)
    if problem == "regression" or (cfg.model.n_labels == 1 and problem is None):
        raise CLIError(
            f"{ckpt}: the model is a regression head (n_labels={cfg.model.n_labels}, "
            f"problem_type={problem}); classify needs a classifier"
        )
    names = label_names(cfg)
    codec = text_codec(require_tokenizer(tokenizer, ckpt), cfg.model.vocab_size)
    rows = []
    for text in texts:
        try:
            rows.append(codec.single(codec.encode(text)[0]))
        except TokenizerError as e:
            raise CLIError(f"the text {_shown(text)}: {e}") from None
    for text, row in zip(texts, rows):
        check_length(len(row), cfg.model.max_seq_len, f"the text {_shown(text)}")
    idx, valid = pad(rows, codec.pad_id), pad([[1] * len(r) for r in rows], 0)
    with torch.no_grad():
        logits = model(idx.to(device), attention_mask=valid.to(device)).logits
    logits = softmax_dtype(logits)  # half precision in float32 (float64 kept)
    multi_label = problem == "multi_label_classification" or cfg.model.n_labels == 1
    probs = (logits.sigmoid() if multi_label else logits.softmax(-1)).cpu()
    return {text: _top(row, names, k) for text, row in zip(texts, probs)}


def _channels(n: int | None) -> str:
    return "channels unknown" if n is None else f"{n} channel{'s' if n != 1 else ''}"
