"""``attnlab kv``: KV-cache memory of models side by side, from their configs alone.

Per model: bytes cached per token (all layers), how many times more the same model would
cache with full multi-head attention, GB (10^9 bytes) per sequence at each length, and how
many such sequences fit on a GPU of ``--gpu-gb`` GB once the weights (in the same dtype)
are loaded. See :mod:`attnlab.analysis` for the formulas.
"""

from __future__ import annotations

import argparse
import json

import torch

from attnlab.cli.common import (
    CLIError,
    parse_assignments,
    positive_float,
    positive_int,
    run_preset,
)
from attnlab.config import RunConfig

KV_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8": torch.float8_e4m3fn,
}
GB = 1e9


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "kv",
        help="KV-cache memory of models side by side",
        description="Bytes per token, ratio against full multi-head attention, GB per "
        "sequence and sequences that fit on a GPU after the weights, for each preset.",
    )
    p.add_argument(
        "--preset",
        action="append",
        required=True,
        metavar="NAME",
        help="a model or run preset (repeatable)",
    )
    p.add_argument(
        "--seq-len",
        action="append",
        type=positive_int,
        metavar="N",
        help="sequence length (repeatable; default 4096)",
    )
    p.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="override a model field of every preset, e.g. model.attention.sliding_window=4096 "
        "(repeatable)",
    )
    p.add_argument("--batch", type=positive_int, default=1, help="sequences per cache")
    p.add_argument("--dtype", choices=list(KV_DTYPES), default="bfloat16", help="cache dtype")
    p.add_argument(
        "--gpu-gb",
        type=positive_float,
        default=80.0,
        help="GPU memory in GB (10^9 bytes) for the fit column (default 80)",
    )
    p.add_argument("--json", action="store_true", help="print a JSON list, one object per model")
    p.set_defaults(handler=run)


def model_report(
    name: str,
    seq_lens: list[int],
    batch: int,
    dtype: torch.dtype,
    gpu_gb: float,
    overrides: dict | None = None,
) -> dict:
    from attnlab.analysis import (
        count_parameters,
        kv_cache_bytes,
        kv_cache_bytes_per_token,
        kv_cache_values_per_token,
        mha_kv_values_per_token,
        weights_bytes,
    )

    cfg = run_preset(name).model
    if overrides:
        bad = [key for key in overrides if not key.startswith("model.")]
        if bad:
            raise CLIError(f"--set {bad[0]}: kv only uses model.* fields")
        cfg = RunConfig(model=cfg).override(overrides).model
    params = count_parameters(cfg)["total"]
    weights = weights_bytes(cfg, dtype)
    free = gpu_gb * GB - weights
    per_seq = {n: kv_cache_bytes(cfg, n, batch, dtype) for n in seq_lens}
    return {
        "model": name,
        "attention": cfg.attention.kind,
        "parameters": params,
        "dtype": str(dtype).removeprefix("torch."),
        "batch": batch,
        "bytes_per_token": kv_cache_bytes_per_token(cfg, dtype),
        # None where nothing is cached per token (linear attention's fixed-size state)
        "mha_ratio": (
            mha_kv_values_per_token(cfg) / kv_cache_values_per_token(cfg)
            if cfg.attention.kind != "linear"
            else None
        ),
        "max_seq_len": cfg.max_seq_len,  # lengths past it are the cache such a run would hold
        "bytes": {str(n): b for n, b in per_seq.items()},
        "weights_bytes": weights,
        "gpu_gb": gpu_gb,
        # Caches of `batch` sequences that fit beside the weights (0 if the weights do not).
        "fit": {str(n): max(0, int(free // b)) for n, b in per_seq.items()},
    }


def run(args: argparse.Namespace) -> int:
    seq_lens = args.seq_len or [4096]
    dtype = KV_DTYPES[args.dtype]
    overrides = parse_assignments(args.set)
    reports = [
        model_report(n, seq_lens, args.batch, dtype, args.gpu_gb, overrides) for n in args.preset
    ]
    if args.json:
        print(json.dumps(reports, indent=2))
        return 0
    unit = "sequence" if args.batch == 1 else f"cache of {args.batch} sequences"
    print(f"KV cache in {args.dtype}, GB = 10^9 bytes per {unit}; fit: on {args.gpu_gb:g} GB")
    print(f"after the weights (in {args.dtype})\n")
    head = ["model", "attention", "bytes/token", "MHA/this"]
    head += [f"GB@{n}" for n in seq_lens] + [f"fit@{n}" for n in seq_lens]
    rows = [
        [
            r["model"],
            r["attention"],
            f"{r['bytes_per_token']:,}",
            "-" if r["mha_ratio"] is None else f"{r['mha_ratio']:.2f}x",
            *(gigabytes(r["bytes"][str(n)]) for n in seq_lens),
            *(f"{r['fit'][str(n)]:,}" for n in seq_lens),
        ]
        for r in reports
    ]
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]
    for row in [head, *rows]:
        print(
            "  ".join(
                c.ljust(w) if i < 2 else c.rjust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
    for r in reports:  # a learned-position model cannot run there; a RoPE one needs scaling
        past = " and ".join(f"{n:,}" for n in seq_lens if n > r["max_seq_len"])
        if past:
            limit = f"{r['max_seq_len']:,}"
            print(f"note: {r['model']} at {past} tokens: past its max_seq_len ({limit})")
    return 0


def gigabytes(n_bytes: int) -> str:
    """3 significant figures below 1,000 GB, whole GB with thousands separators above (not
    '2.1e+04')."""
    gb = n_bytes / GB
    return f"{gb:.3g}" if gb < 999.5 else f"{gb:,.0f}"
