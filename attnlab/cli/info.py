"""``attnlab info``: parameters, FLOPs per token, KV-cache and weight memory of a model,
from its config alone (see attnlab.analysis for the conventions)."""

from __future__ import annotations

import argparse
import json

from attnlab.cli.common import (
    DTYPES,
    CLIError,
    check_dir,
    human_bytes,
    human_count,
    is_hf_dir,
    model_config_from_file,
    parse_assignments,
    path_arg,
    positive_int,
    run_preset,
)
from attnlab.config import ModelConfig, RunConfig


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "info",
        help="parameter, FLOP and memory counts of a model",
        description="Parameter count, FLOPs per token (forward and training), KV-cache and "
        "weight memory of a preset, a checkpoint or a config file.",
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--preset", metavar="NAME", help="a model or run preset (see presets)")
    source.add_argument(
        "--ckpt", type=path_arg, metavar="DIR", help="an attnlab or Hugging Face model folder"
    )
    source.add_argument(
        "--config",
        type=path_arg,
        metavar="FILE",
        help="JSON: a run config, a model config or an HF config",
    )
    p.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="override a field, e.g. model.n_layers=24 (repeatable)",
    )
    p.add_argument("--seq-len", type=positive_int, help="context length (default max_seq_len)")
    p.add_argument("--batch", type=positive_int, default=1, help="sequences in the KV cache")
    p.add_argument("--dtype", choices=list(DTYPES), default="float32", help="storage dtype")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=run)


def model_config(args: argparse.Namespace) -> tuple[ModelConfig, str]:
    if args.preset is not None:
        cfg, source = run_preset(args.preset).model, f"preset {args.preset}"
    elif args.config is not None:
        cfg, source = model_config_from_file(args.config), args.config
    else:
        path = check_dir(args.ckpt, "checkpoint folder")
        if is_hf_dir(path):
            from attnlab.interop.io import CONFIG_NAME

            cfg = model_config_from_file(path / CONFIG_NAME)
        else:  # the config only (checked against the weights' header, not their GBs)
            from attnlab.training.checkpoint import checked_config_file

            cfg = model_config_from_file(checked_config_file(path))
        source = str(path)
    overrides = parse_assignments(args.set)
    if overrides:
        bad = [key for key in overrides if not key.startswith("model.")]
        if bad:
            raise CLIError(f"--set {bad[0]}: info only uses model.* fields")
        cfg = RunConfig(model=cfg).override(overrides).model
    return cfg, source


def run(args: argparse.Namespace) -> int:
    from attnlab import analysis

    cfg, source = model_config(args)
    seq_len = args.seq_len or cfg.max_seq_len
    dtype = DTYPES[args.dtype]
    params = analysis.count_parameters(cfg)
    decoder = cfg.arch == "decoder"  # the FLOP and KV formulas describe decoders only
    flops = analysis.flops_per_token(cfg, seq_len) if decoder else None
    kv_token = analysis.kv_cache_bytes_per_token(cfg, dtype) if decoder else None
    kv_total = analysis.kv_cache_bytes(cfg, seq_len, args.batch, dtype) if decoder else None
    weights = analysis.weights_bytes(cfg, dtype)
    if args.json:
        report = {
            "source": source,
            "seq_len": seq_len,
            "batch": args.batch,
            "dtype": args.dtype,
            "parameters": params,
            "flops_per_token": flops,
            "kv_cache_bytes_per_token": kv_token,
            "kv_cache_bytes": kv_total,
            "weights_bytes": weights,
            "config": cfg.to_dict(),
        }
        print(json.dumps(report))
        return 0
    att = cfg.attention
    if att.kind in ("mla", "dsa"):  # one shared latent, heads of two widths
        dims = att.mla_dims(cfg.d_model)
        heads = (
            f"{att.n_heads} heads x (q/k {dims.qk_nope_head_dim + dims.qk_rope_head_dim}, "
            f"v {dims.v_head_dim}) over a latent of {dims.kv_lora_rank} + "
            f"{dims.qk_rope_head_dim} (RoPE key)"
        )
    else:
        heads = f"{att.n_heads} heads ({cfg.n_kv_heads} kv) x {cfg.head_dim}"
    print(f"model         {source}")
    print(f"shape         {_shape(cfg, heads)}")
    print(
        f"parameters    {params['total']:,} total ({human_count(params['total'])}), "
        f"{params['non_embedding']:,} non-embedding, {params['embedding']:,} embedding"
    )
    print(f"weights       {human_bytes(weights)} in {args.dtype}")
    if not decoder:
        print(f"FLOPs, KV     - (the formulas describe decoder-only models; arch {cfg.arch})")
        return 0
    print(
        f"FLOPs/token   forward {human_count(flops['forward'])} "
        f"(dense {human_count(flops['dense'])} + attention {human_count(flops['attention'])} "
        f"at seq_len {seq_len}), training {human_count(flops['training'])} (3x forward)"
    )
    print(
        f"KV cache      {human_bytes(kv_token)} per token; {human_bytes(kv_total)} for "
        f"batch {args.batch} x {seq_len} tokens in {args.dtype}"
    )
    return 0


def _shape(cfg: ModelConfig, heads: str) -> str:
    """The shape line: the fields the architecture uses (a GRU has no heads, a ViT no
    vocabulary: printing the base config's defaults for them described another model)."""
    if cfg.arch == "gru-seq2seq":
        return (
            f"{cfg.n_layers} GRU layers, hidden {cfg.hidden_dim}, embeddings {cfg.embed_dim}, "
            f"vocab {cfg.src_vocab_size} source / {cfg.vocab_size} target, "
            f"max_seq_len {cfg.max_seq_len}"
        )
    if cfg.arch == "vit":
        return (
            f"{cfg.n_layers} layers, d_model {cfg.d_model}, {heads}, images "
            f"{cfg.image_size}x{cfg.width}x{cfg.channels} in {cfg.n_patches} patches of "
            f"{cfg.patch_size}, {cfg.n_classes} classes"
        )
    return (
        f"{cfg.n_layers} layers, d_model {cfg.d_model}, {heads}, vocab {cfg.vocab_size}, "
        f"max_seq_len {cfg.max_seq_len}"
    )
