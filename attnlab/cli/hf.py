"""``attnlab import-hf`` and ``attnlab export-hf``: convert between attnlab checkpoint
folders and Hugging Face model folders of every family ``attnlab.interop`` maps (GPT-2,
LLaMA, Mistral, Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE, Mixtral, GPT-OSS, Gemma 1/2/3,
DeepSeek-V2/V3/V3.2, BERT, MarianMT, BART, mBART, ViT),
picked by config.json's ``model_type`` on import and by the checkpoint's config on export.

``import-hf`` takes the source folder's ``tokenizer.json`` or one given with
``--tokenizer``. A weight-only folder imports too, without a tokenizer (Marian ships
SentencePiece files, ViT reads no text, some repositories keep the tokenizer elsewhere):
``generate`` then takes ``--tokenizer FILE`` or token ids (``--prompt-ids``).
Either command writes into a new or empty folder, or over its own earlier output (a
re-import, a re-export); it refuses a folder that holds anything else it would replace: a
training run (its trainer state), a Hugging Face folder (import-hf), an attnlab
checkpoint (export-hf), or a config.json of neither kind.

``export-hf`` copies the checkpoint's ``tokenizer.json`` (Hugging Face ``tokenizers``
format) beside the weights with a ``tokenizer_config.json`` naming the plain
``PreTrainedTokenizerFast`` class: without it, ``AutoTokenizer`` would pick the class of
config.json's model_type (``GPT2Tokenizer``), which replaces the tokenizer's own
pre-tokenizer and decoder with GPT-2's byte-level ones and adds an ``<|endoftext|>``
token, so a character-level tokenizer exported as GPT-2 would lose its spaces and
newlines.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from attnlab.cli.common import (
    DTYPES,
    CLIError,
    add_dtype_argument,
    check_dir,
    is_hf_dir,
    is_run_config,
    path_arg,
)
from attnlab.fileio import file_kind
from attnlab.interop.io import CONFIG_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"  # which transformers class runs tokenizer.json
GENERATION_CONFIG = "generation_config.json"  # eos_token_id, read by ``generate``
# Written first into the folder export-hf writes: later exports may replace that folder's
# files, and only that folder's (a Hugging Face model saved by anything else is refused).
EXPORT_MARKER = ".attnlab-export"
# What an export writes or removes: an unmarked folder holding any of them is refused.
EXPORT_FILES = (CONFIG_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME,
                GENERATION_CONFIG, TOKENIZER_FILE, TOKENIZER_CONFIG)  # fmt: skip
# config.json's special token ids, which transformers' generate takes from
# generation_config.json alone when there is one
TOKEN_ID_KEYS = ("bos_token_id", "decoder_start_token_id", "pad_token_id", "eos_token_id")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "import-hf",
        help="Hugging Face model folder -> attnlab checkpoint",
        description="Convert a Hugging Face model folder (config.json + safetensors) into an "
        "attnlab checkpoint folder for generate, eval, info and the task commands (translate, "
        "classify, fill-mask, tag, answer). The tokenizer comes from "
        "SRC/tokenizer.json or --tokenizer; without either, the checkpoint has none (generate "
        "then takes --tokenizer or --prompt-ids).",
    )
    p.add_argument("src", type=path_arg, metavar="SRC", help="Hugging Face model folder")
    p.add_argument("out", type=path_arg, metavar="OUT", help="attnlab checkpoint folder to write")
    p.add_argument(
        "--tokenizer", type=path_arg, metavar="FILE", help="tokenizer.json (default: SRC's)"
    )
    add_dtype_argument(p)
    p.set_defaults(handler=run_import)

    p = subparsers.add_parser(
        "export-hf",
        help="attnlab checkpoint -> Hugging Face model folder",
        description="Write an attnlab checkpoint as a Hugging Face model folder (config.json, "
        "model.safetensors; tokenizer.json and tokenizer_config.json when it has a tokenizer; "
        "generation_config.json when it has end-of-sequence tokens; preprocessor_config.json "
        "for a ViT) that transformers' "
        "from_pretrained and AutoTokenizer load.",
    )
    p.add_argument("ckpt", type=path_arg, metavar="CKPT", help="attnlab checkpoint folder")
    p.add_argument("out", type=path_arg, metavar="OUT", help="folder to write")
    p.set_defaults(handler=run_export)


def _refuse_same(src: Path, out: Path) -> None:
    if out.exists() and out.resolve() == src.resolve():
        raise CLIError(f"{out}: the output folder must differ from the input folder")


def _refuse_foreign(out: Path, writes: str) -> None:
    """Refuse an ``out`` that is not a folder, or whose files the conversion would replace
    although an earlier conversion of this kind did not write them (``writes``: "hf" for
    export-hf, "attnlab" for import-hf): a training run would lose its trainer state, a
    model folder of the other kind its config.json and weights."""
    from attnlab.training.checkpoint import CONFIG_FILE, STATE_FILE

    if out.exists() and not out.is_dir():
        raise CLIError(f"{out}: exists and is not a folder; give a folder to write into")
    config = out / CONFIG_FILE
    if writes == "hf":
        clash = [name for name in EXPORT_FILES if (out / name).exists()]
        if (out / STATE_FILE).exists():
            found = "an attnlab checkpoint"
        elif config.exists() and not is_hf_dir(out):
            found = "a config.json that is not a Hugging Face config"
        elif (out / EXPORT_MARKER).is_file() or not clash:
            return  # an earlier export's folder, or nothing this would replace
        elif is_hf_dir(out):
            found = f"a Hugging Face model that export-hf did not write (no {EXPORT_MARKER})"
        else:
            found = f"files an export writes ({', '.join(clash)})"
    else:
        if is_hf_dir(out):
            found = "a Hugging Face model folder"
        elif _resumable(out):
            found = "a training run (trainer_state.pt with optimizer state)"
        elif config.exists() and not _attnlab_config(config):
            found = "a config.json that is not an attnlab checkpoint's"
        else:
            return
    raise CLIError(
        f"{out} holds {found}, which this would replace; choose a new or empty output folder"
    )


def _resumable(folder: Path) -> bool:
    """Whether ``folder`` holds a trainer state that resuming needs (an unreadable one
    counts: it cannot be told apart)."""
    import torch

    from attnlab.training.checkpoint import STATE_FILE

    path = folder / STATE_FILE
    if not path.exists():
        return False
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # corrupt or not ours: not for us to replace
        return True
    return not isinstance(state, dict) or state.get("has_state", True) is not False


def _attnlab_config(path: Path) -> bool:
    import json

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and is_run_config(data)


def run_import(args: argparse.Namespace) -> int:
    from attnlab.config import RunConfig
    from attnlab.interop import config_from_hf, load_hf
    from attnlab.interop.io import read_config, with_generation_config
    from attnlab.interop.registry import lookup
    from attnlab.tokenizers import load_tokenizer
    from attnlab.training.checkpoint import save_checkpoint

    src, out = check_dir(args.src, "Hugging Face model folder"), Path(args.out)
    _refuse_same(src, out)
    _refuse_foreign(out, "attnlab")
    if not is_hf_dir(src):
        raise CLIError(
            f"{src}: not a Hugging Face model folder (needs a config.json with model_type)"
        )
    hf_config = with_generation_config(src, read_config(src))
    family, _ = lookup(hf_config)  # the family and config, before the weights
    given = args.tokenizer is not None
    tokenizer_file = Path(args.tokenizer) if given else src / TOKENIZER_FILE
    tokenizer = None
    if tokenizer_file.is_file():
        tokenizer = load_tokenizer(tokenizer_file)
    elif given and tokenizer_file.exists():  # a folder, /dev/null: it is there, not "not found"
        raise CLIError(
            f"--tokenizer {tokenizer_file}: is {file_kind(tokenizer_file)}, not a file; give a "
            "tokenizer.json file"
        )
    elif given:
        raise CLIError(f"{tokenizer_file}: tokenizer not found; give a tokenizer.json file")
    model_cfg = config_from_hf(hf_config)
    # the largest embedding table: a seq2seq model's tokenizer may serve its source only
    vocab_size = max(model_cfg.vocab_size, getattr(model_cfg, "source_vocab_size", 0))
    if tokenizer is not None and tokenizer.vocab_size > vocab_size:  # fewer: padded embeddings
        raise CLIError(
            f"{tokenizer_file}: {tokenizer.vocab_size} tokens but the model has only "
            f"vocab_size={vocab_size} embeddings; give the model's own tokenizer"
        )
    model = load_hf(src, dtype=DTYPES[args.dtype])
    save_checkpoint(out, model, RunConfig(model=model.cfg, task=family.task(model.cfg)), tokenizer)
    _copy_generation_config(src, out)
    n = sum(p.numel() for p in model.parameters())
    print(f"imported {src} ({n:,} parameters) -> attnlab checkpoint {out}")
    if tokenizer is None and family.arch == "decoder":
        print(
            f"no tokenizer ({src / TOKENIZER_FILE} not found): give `attnlab generate` "
            "--tokenizer FILE or token ids with --prompt-ids, or copy a tokenizer.json into "
            f"{out}"
        )
    return 0


def run_export(args: argparse.Namespace) -> int:
    from attnlab.fileio import atomic_write_text
    from attnlab.interop import save_hf
    from attnlab.interop.io import GENERATION_KEYS, read_config
    from attnlab.training.checkpoint import load_checkpoint

    ckpt_dir, out = check_dir(args.ckpt, "checkpoint folder"), Path(args.out)
    if is_hf_dir(ckpt_dir):
        raise CLIError(
            f"{ckpt_dir} is a Hugging Face model folder already; export-hf reads attnlab "
            f"checkpoints (attnlab import-hf {ckpt_dir} DIR makes one)"
        )
    _refuse_same(ckpt_dir, out)
    _refuse_foreign(out, "hf")
    ckpt = load_checkpoint(ckpt_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / EXPORT_MARKER, f"written by attnlab export-hf from {ckpt_dir}\n")
    save_hf(ckpt.model, out)
    written = [CONFIG_NAME, WEIGHTS_NAME]
    # transformers reads generation settings from generation_config.json alone when there
    # is one: the settings save_hf put in config.json (Marian's blocked pad token) and its
    # special token ids (Marian's decoder start) go there too
    hf_config = read_config(out)
    settings = {k: hf_config[k] for k in GENERATION_KEYS if hf_config.get(k) is not None}
    token_ids = {k: hf_config[k] for k in TOKEN_ID_KEYS if hf_config.get(k) is not None}
    eos = _copy_generation_config(ckpt_dir, out, settings, token_ids)
    if (out / GENERATION_CONFIG).is_file():
        written.append(GENERATION_CONFIG)
    if ckpt.tokenizer is not None:
        ckpt.tokenizer.save(out / TOKENIZER_FILE)
        _write_tokenizer_config(out, ckpt.tokenizer, ckpt.config.model.max_seq_len, eos)
        written += [TOKENIZER_FILE, TOKENIZER_CONFIG]
    else:  # none left from an older export into the same folder
        for name in (TOKENIZER_FILE, TOKENIZER_CONFIG):
            (out / name).unlink(missing_ok=True)
    print(f"exported {ckpt_dir} -> Hugging Face folder {out} ({', '.join(written)})")
    return 0


def _write_tokenizer_config(out: Path, tokenizer, max_seq_len: int, eos: list[int]) -> None:
    """``tokenizer_config.json`` for ``AutoTokenizer.from_pretrained(out)``: the generic
    fast tokenizer class, which runs tokenizer.json as written (see the module docstring),
    no clean-up of spaces around punctuation on decode (older transformers versions do it
    by default), the model's context as ``model_max_length``, the end-of-sequence token
    where ``eos`` names one the tokenizer has, and a WordPiece tokenizer's BERT tokens
    ([PAD], [MASK], ...: without them transformers cannot pad a batch)."""
    import json

    from attnlab.fileio import atomic_write_text

    config: dict = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_seq_len,
    }
    eos_token = tokenizer.hf.id_to_token(eos[0]) if eos else None
    if eos_token is not None:
        config["eos_token"] = eos_token
    if tokenizer.kind == "wordpiece":  # BERT's: a pipeline pads, masks and splits with them
        for name in ("unk", "sep", "pad", "cls", "mask"):
            token = f"[{name.upper()}]"
            if tokenizer.hf.token_to_id(token) is not None:
                config[f"{name}_token"] = token
    atomic_write_text(out / TOKENIZER_CONFIG, json.dumps(config, indent=2) + "\n")


def _copy_generation_config(
    src: Path, out: Path, settings: dict | None = None, token_ids: dict | None = None
) -> list[int]:
    """Carry the end-of-sequence tokens (``eos_token_id`` of generation_config.json, else of
    an HF config.json) from ``src`` to ``out``/generation_config.json, where ``generate``
    looks for them; with them, or with generation ``settings`` (an exported Marian's
    blocked tokens), the file also gets ``settings`` and ``token_ids`` (the exported
    config.json's). Returns the end-of-sequence tokens ([] when ``src`` has none)."""
    import json

    from attnlab.fileio import atomic_write_text
    from attnlab.interop.io import eos_token_ids

    eos = eos_token_ids(src)
    if not eos and not settings:
        (out / GENERATION_CONFIG).unlink(missing_ok=True)  # none left from an older export
        return []
    data = {**(token_ids or {}), **(settings or {})}
    if eos:
        data["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    atomic_write_text(out / GENERATION_CONFIG, json.dumps(data, indent=2) + "\n")
    return eos
