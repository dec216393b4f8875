"""Why scaled dot-product attention divides by sqrt(d_k) (Vaswani et al. 2017, footnote 4).

For q, k with independent unit-variance components, q . k = sum_i q_i k_i has variance
d_k. Unscaled, the scores of one query over n keys spread by sqrt(d_k): the largest takes
almost all the softmax weight, a key one standard deviation above the mean gets almost
none, and the softmax Jacobian J = diag(p) - p p^T goes to zero, so almost no gradient
reaches the scores. Dividing by sqrt(d_k) keeps the variance 1 at every d_k.

Measured here, not derived: per d_k, ``n_rows`` queries each against ``n_keys`` keys.
Shapes: r rows (queries), n keys per row, d d_k.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from attnlab.demos.common import check_memory, format_table, new_figure, save_figure

NAME = "sqrt-dk"
DESCRIPTION = "why scores are divided by sqrt(d_k): score variance, softmax saturation, gradient"


def softmax_jacobian(p: torch.Tensor) -> torch.Tensor:
    """d softmax / d scores = diag(p) - p p^T for each row: (r, n) -> (r, n, n)."""
    return torch.diag_embed(p) - p[:, :, None] * p[:, None, :]


def measure(d: int, *, n_keys: int, n_rows: int, generator: torch.Generator) -> dict[str, float]:
    chunks = []
    for start in range(0, n_rows, 64):  # 64 queries at a time keeps k small at d_k = 1024
        r = min(64, n_rows - start)
        q = torch.randn(r, 1, d, generator=generator, dtype=torch.float64)
        k = torch.randn(r, n_keys, d, generator=generator, dtype=torch.float64)
        chunks.append((q @ k.transpose(1, 2))[:, 0])  # (r, n)
    raw = torch.cat(chunks)  # (n_rows, n) unscaled scores
    row = {"d_k": d}
    for name, scores in (("raw", raw), ("scaled", raw / math.sqrt(d))):
        row[f"var_{name}"] = scores.var().item()
        sigma = scores.std().item()
        # Key 0's score set to one standard deviation above the mean: its softmax weight.
        lifted = scores.clone()
        lifted[:, 0] = scores.mean() + sigma
        row[f"p_sigma_{name}"] = lifted.softmax(-1)[:, 0].median().item()
        p = scores.softmax(-1)  # (r, n)
        row[f"p_max_{name}"] = p.max(-1).values.median().item()
        row[f"jacobian_{name}"] = softmax_jacobian(p).flatten(1).norm(dim=-1).median().item()
    return row


def dims(d_max: int) -> list[int]:
    """The d_k measured: 1, 2, 4, ... up to ``d_max``, and ``d_max`` itself last when it is
    not a power of 2 (--d-max 1000 stopped at 512)."""
    powers = [2**i for i in range(d_max.bit_length())]  # (bit_length: no float log2)
    return powers if powers[-1] == d_max else [*powers, d_max]


def add_arguments(p: argparse.ArgumentParser) -> None:
    from attnlab.cli.common import positive_int

    p.add_argument(
        "--d-max",
        type=positive_int,
        default=1024,
        help="largest d_k: the powers of 2 below it, then it (default 1024)",
    )
    p.add_argument("--n-keys", type=positive_int, default=64, help="keys per query (softmax size)")
    p.add_argument("--n-rows", type=positive_int, default=500, help="queries per d_k")


def run(args: argparse.Namespace) -> int:
    if args.n_keys < 2:
        raise ValueError(f"--n-keys must be at least 2 for a softmax to choose, got {args.n_keys}")
    # float64: a chunk of 64 rows' keys at the largest d_k, and every row's softmax Jacobian
    need = 8 * max(64 * args.n_keys * args.d_max, args.n_rows * args.n_keys**2)
    check_memory(need, "--d-max / --n-keys / --n-rows")
    g = torch.Generator().manual_seed(args.seed)
    d_ks = dims(args.d_max)
    rows = [measure(d, n_keys=args.n_keys, n_rows=args.n_rows, generator=g) for d in d_ks]
    uniform = 1 / args.n_keys
    print(
        f"q, k ~ N(0, I_d); one query against {args.n_keys} keys, median over {args.n_rows} "
        f"queries. p(+1 sd): softmax weight of a score one standard deviation above the mean "
        f"(uniform = {uniform:.4g}); p(max): weight of the largest score; ||J||: Frobenius "
        "norm of the softmax Jacobian (0 = saturated, no gradient)"
    )
    headers = ["d_k", "var raw", "var scaled", "p(+1sd) raw", "p(+1sd) scaled",
               "p(max) raw", "p(max) scaled", "||J|| raw", "||J|| scaled"]  # fmt: skip
    keys = ["d_k", "var_raw", "var_scaled", "p_sigma_raw", "p_sigma_scaled",
            "p_max_raw", "p_max_scaled", "jacobian_raw", "jacobian_scaled"]  # fmt: skip
    print(format_table(headers, [[r[k] for k in keys] for r in rows]))
    plot(Path(args.out), rows)
    return 0


def plot(out: Path, rows: list[dict]) -> Path:
    d = [r["d_k"] for r in rows]
    fig, (ax_var, ax_p, ax_j) = new_figure(3)
    for name, style in (("raw", "o-"), ("scaled", "s--")):
        label = "q.k" if name == "raw" else "q.k / sqrt(d_k)"
        ax_var.plot(d, [r[f"var_{name}"] for r in rows], style, label=label)
        ax_p.plot(d, [r[f"p_max_{name}"] for r in rows], style, label=f"max weight, {label}")
        ax_p.plot(d, [r[f"p_sigma_{name}"] for r in rows], style, alpha=0.6,
                  label=f"+1 sd score, {label}")  # fmt: skip
        ax_j.plot(d, [r[f"jacobian_{name}"] for r in rows], style, label=label)
    ax_var.set(xscale="log", yscale="log", xlabel="d_k", ylabel="variance of the score",
               title="score variance")  # fmt: skip
    ax_p.set(xscale="log", xlabel="d_k", ylabel="softmax weight", title="softmax saturation")
    ax_j.set(xscale="log", yscale="log", xlabel="d_k", ylabel="||diag(p) - p p^T||_F",
             title="softmax gradient (Jacobian norm)")  # fmt: skip
    for ax in (ax_var, ax_p, ax_j):
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=8)
    return save_figure(fig, out / "sqrt_dk.png")
