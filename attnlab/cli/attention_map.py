"""``attnlab attention-map``: draw the attention weights of one input as a PNG grid of
heatmaps (rows: layers, columns: heads), recorded by :mod:`attnlab.attention_maps`.

- decoder (language model) and encoder (BERT) checkpoints: self-attention over ``--text``
  (or token ids, ``--ids``);
- seq2seq checkpoints: encoder self-attention, decoder self-attention and cross-attention
  (target tokens down, source tokens across) for the source ``--text`` and the target
  ``--target``, by default the model's greedy translation; each decoder row is labelled
  with the token predicted there;
- ViT checkpoints: the [CLS] token's attention over the patches of ``--image``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from attnlab.cli.common import (
    CLIError,
    add_checkpoint_argument,
    add_device_argument,
    add_dtype_argument,
    add_tokenizer_argument,
    load_for_inference,
    path_arg,
    positive_int,
    refuse_tokenizer_option,
    require_tokenizer,
    resolve_device,
    text_codec,
    token_ids,
    tokenizer_option,
)

if TYPE_CHECKING:
    from attnlab.attention_maps import AttentionGrid

ARCHS = ("decoder", "encoder", "seq2seq", "vit")
# encoder tasks whose inputs are [CLS] text [SEP] (question answering's are pairs)
WRAPPED_TASKS = ("text-classification", "token-classification")


def index_list(text: str) -> list[int]:
    """``"0,2"`` -> [0, 2] (layer or head indices)."""
    parts = text.replace(",", " ").split()
    if not parts or not all(part.isdigit() for part in parts):
        raise argparse.ArgumentTypeError(f"expected indices like 0,2 (from 0), got {text!r}")
    return sorted(set(int(part) for part in parts))


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "attention-map",
        help="draw a model's attention weights for one input (PNG)",
        description="Run one input through a checkpoint with eager attention, record every "
        "layer's softmax weights and draw them as a PNG grid (rows: layers, columns: "
        "heads). Decoder and encoder checkpoints: self-attention over --text. Seq2seq: "
        "encoder self-, decoder self- and cross-attention for the source --text and the "
        "target --target (default: the greedy translation). ViT: the [CLS] token's "
        "attention over the patches of --image.",
    )
    add_checkpoint_argument(p)
    p.add_argument("--out", type=path_arg, required=True, metavar="FILE", help="PNG file to write")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--text", metavar="TEXT", help="the input text (seq2seq: the source)")
    source.add_argument("--ids", type=token_ids, metavar="IDS", help="the input as token ids")
    target = p.add_mutually_exclusive_group()
    target.add_argument("--target", metavar="TEXT", help="seq2seq: the target text")
    target.add_argument("--target-ids", type=token_ids, metavar="IDS", help="seq2seq: target ids")
    p.add_argument("--image", type=path_arg, metavar="FILE", help="ViT: the image")
    p.add_argument("--invert", action="store_true", help="ViT: use 1 - pixel (dark on light)")
    p.add_argument("--layers", type=index_list, metavar="I,J", help="layers to draw (default all)")
    p.add_argument("--heads", type=index_list, metavar="I,J", help="heads to draw (default all)")
    p.add_argument(
        "--max-new-tokens", type=positive_int, metavar="N", help="seq2seq: longest translation"
    )
    add_tokenizer_argument(p)
    add_device_argument(p)
    add_dtype_argument(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from attnlab.attention_maps import AttentionMapError, draw_attention, save_png

    out = Path(args.out)
    if out.is_dir():
        raise CLIError(f"--out {args.out}: is a folder; give a .png file name")
    if out.suffix.lower() != ".png":  # a PNG under another name, or over another file (a
        # checkpoint's model.safetensors)
        raise CLIError(f"--out {args.out}: give a .png file name (the map is written as a PNG)")
    device = resolve_device(args.device)
    model, cfg, vocab = load_for_inference(args.ckpt, device, args.dtype)
    arch = cfg.model.arch
    if arch not in ARCHS:
        raise CLIError(
            f"{args.ckpt} holds a {arch!r} model; attention-map draws {', '.join(ARCHS)} models"
        )
    if arch != "vit" and (args.image is not None or args.invert):
        option = "--image" if args.image is not None else "--invert"
        raise CLIError(f"{option} is for ViT checkpoints; {args.ckpt} holds a {arch!r} model")
    if arch != "seq2seq" and (args.target is not None or args.target_ids is not None):
        raise CLIError(f"--target is for seq2seq checkpoints; {args.ckpt} holds a {arch!r} model")
    if arch != "seq2seq" and args.max_new_tokens is not None:
        raise CLIError(
            f"--max-new-tokens is for seq2seq checkpoints; {args.ckpt} holds a {arch!r} model"
        )
    if arch == "vit":
        refuse_tokenizer_option(args.tokenizer, f"{args.ckpt} is a ViT")
    draw = {"decoder": _text_grids, "encoder": _text_grids, "seq2seq": _seq2seq_grids,
            "vit": _vit_grids}[arch]  # fmt: skip
    try:
        grids, title = draw(args, model, cfg, vocab, device)
        fig = draw_attention(grids, args.layers, args.heads, title)
    except AttentionMapError as e:
        raise CLIError(str(e)) from None
    save_png(fig, args.out)
    n_rows = len(fig.axes)
    print(f"wrote {args.out} ({n_rows} heatmaps: {', '.join(g.title for g in grids)})")
    return 0


def _record(model, *inputs, **kwargs) -> dict:
    """Stacked maps (L, h, t, s) of one forward pass on one example."""
    import torch

    from attnlab.attention_maps import record_attention, stack_layers

    with torch.no_grad(), record_attention(model) as maps:
        model(*inputs, **kwargs)
    return {name: w[:, 0].cpu() for name, w in stack_layers(maps).items()}


def _check_length(n: int, limit: int, option: str) -> None:
    if n > limit:
        raise CLIError(f"{option}: {n} tokens exceed the model's max_seq_len={limit}; shorten it")


def _text_grids(args, model, cfg, tokenizer, device: str) -> tuple[list[AttentionGrid], str]:
    """Self-attention of a decoder or encoder over ``--text`` / ``--ids``."""
    import torch

    from attnlab.attention_maps import AttentionGrid, token_label
    from attnlab.tokenizers import TokenizerError

    from .translate import check_ids

    m = cfg.model
    tokenizer = tokenizer_option(args.tokenizer, tokenizer, m.vocab_size)
    if args.ids is not None:
        ids, option = check_ids(args.ids, m.vocab_size, "--ids"), "--ids"
    elif args.text is None:
        raise CLIError("give the input with --text TEXT (or token ids with --ids)")
    else:
        tokenizer = require_tokenizer(tokenizer, args.ckpt, " or token ids with --ids")
        try:
            # as transformers' tokenizer(text): with the special tokens its post-processor
            # adds (an imported LLaMA's <s>, BERT's [CLS] ... [SEP]; attnlab's own: none)
            ids, option = tokenizer.encode(args.text, add_special_tokens=True), "--text"
        except TokenizerError as e:
            raise CLIError(f"--text: {e}") from None
        if not ids:
            raise CLIError("--text: the text is empty")
    token_text = None if tokenizer is None else (lambda i: tokenizer.decode([i]))
    if m.arch == "encoder" and cfg.task in WRAPPED_TASKS and args.ids is None:
        # the input classify and tag feed the model: [CLS] text [SEP] (the map of the bare
        # text was of an input the model never sees; an imported BERT's tokenizer adds them)
        codec = text_codec(tokenizer, m.vocab_size)
        if ids[:1] != [codec.cls_id]:
            ids = codec.single(ids)
        token_text = codec.token_text
    _check_length(len(ids), m.max_seq_len, option)
    maps = _record(model, torch.tensor([ids], device=device))
    if token_text is None:
        labels = [str(i) for i in ids]
    else:
        labels = [token_label(token_text(i)) for i in ids]
    weights = maps["blocks.attn"]
    kind = "causal self-attention" if m.arch == "decoder" else "self-attention"
    return [AttentionGrid(kind, weights, labels, labels)], f"{args.ckpt}: {len(ids)} tokens"


def _seq2seq_grids(args, model, cfg, vocab, device: str) -> tuple[list[AttentionGrid], str]:
    """Encoder self-, decoder self- and cross-attention of one source and target."""
    import torch

    from attnlab.attention_maps import AttentionGrid

    from .translate import check_ids, seq2seq_text

    text, m = seq2seq_text(args, cfg, vocab, ("--ids", "--target-ids")), cfg.model
    if args.ids is not None:
        src_ids = check_ids(args.ids, m.source_vocab_size, "--ids")
    elif args.text is None:
        raise CLIError("give the source with --text TEXT (or token ids with --ids)")
    else:
        src_ids = text.encode_source(args.text, "--text")
    _check_length(len(src_ids), m.max_seq_len, "--ids" if args.ids is not None else "--text")
    src = torch.tensor([src_ids], device=device)
    if args.target_ids is not None:
        tgt_ids = check_ids(args.target_ids, m.vocab_size, "--target-ids")
    elif args.target is not None:
        tgt_ids = text.encode_target(args.target, "--target")
    else:  # the model's own greedy translation
        tgt_ids = model.generate(src, args.max_new_tokens or m.max_seq_len - 1)[0]
        if len(tgt_ids) + 1 > m.max_seq_len:  # it fits unless --max-new-tokens let it grow
            raise CLIError(
                f"--max-new-tokens {args.max_new_tokens}: the greedy translation has "
                f"{len(tgt_ids)} tokens, past the model's max_seq_len={m.max_seq_len} (with "
                f"BOS); give at most {m.max_seq_len - 1}"
            )
    option = "--target-ids" if args.target_ids is not None else "--target"
    _check_length(len(tgt_ids) + 1, m.max_seq_len, option)
    tgt_in = torch.tensor([[m.bos_id, *tgt_ids]], device=device)  # (1, t): BOS + target
    maps = _record(model, src, tgt_in)
    source = text.source_labels(src_ids)
    # decoder row i reads BOS + target[:i] and predicts target[i] (EOS after the last)
    predicted = text.target_labels([*tgt_ids, m.eos_id])
    inputs = text.target_labels([m.bos_id, *tgt_ids])
    grids = [
        AttentionGrid("encoder self", maps["encoder.attn"], source, source),
        AttentionGrid("decoder self", maps["decoder.attn"], predicted, inputs),
        AttentionGrid("cross", maps["decoder.cross_attn"], predicted, source),
    ]
    shown = text.decode_target(tgt_ids)
    target = shown if shown is not None else ",".join(map(str, tgt_ids))
    origin = "given" if args.target is not None or args.target_ids is not None else "greedy"
    print(f"target ({origin}): {target}")
    return grids, f"{args.ckpt}: {len(src_ids)} source -> {len(tgt_ids) + 1} target tokens"


def _vit_grids(args, model, cfg, vocab, device: str) -> tuple[list[AttentionGrid], str]:
    """The [CLS] token's attention over the image's patches."""
    from attnlab.attention_maps import AttentionGrid
    from attnlab.models.vit import normalize_pixels

    from .classify import load_image

    if args.image is None:
        raise CLIError(f"{args.ckpt} is a ViT: give the image with --image FILE")
    if args.text is not None or args.ids is not None:
        raise CLIError("a ViT reads images, not text: give --image FILE instead of --text/--ids")
    m = cfg.model
    image = load_image(args.image, m.channels, m.image_size, m.width, m.resample)
    if args.invert:
        image = 1.0 - image
    maps = _record(model, normalize_pixels(image[None], m).to(device))
    p = m.patch_size
    labels = ["[CLS]"] + [f"patch {i}" for i in range(m.n_patches)]
    grid = AttentionGrid(
        "[CLS] over patches",
        maps["blocks.attn"],
        labels,
        labels,
        patches=(m.image_size // p, m.width // p),
    )
    return [grid], f"{args.ckpt}: {args.image}, {m.n_patches} patches"
