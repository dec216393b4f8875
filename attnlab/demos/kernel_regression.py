"""Nadaraya-Watson kernel regression on noisy 1-D data: three fixed kernels against a
Gaussian whose bandwidth is learned by gradient descent on the leave-one-out error.

Data (as in d2l.ai 11.2): y = 2 sin(x) + x^0.8 + noise on x ~ U(0, 5); the test error is the
mean squared error against the noise-free function on an even grid of [0, 5].
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from attnlab.demos.common import check_memory, format_table, new_figure, save_figure
from attnlab.models.kernel_regression import KERNELS, KernelRegression

NAME = "kernel-regression"
DESCRIPTION = (
    "Nadaraya-Watson regression as attention pooling: fixed kernels vs a learned bandwidth"
)


def true_function(x: torch.Tensor) -> torch.Tensor:
    return 2 * torch.sin(x) + x**0.8


def add_arguments(p: argparse.ArgumentParser) -> None:
    from attnlab.cli.common import non_negative_float, positive_float, positive_int

    p.add_argument("--n-train", type=positive_int, default=50, help="noisy training points")
    p.add_argument("--n-test", type=positive_int, default=100, help="test grid points")
    p.add_argument("--noise", type=non_negative_float, default=0.5, help="noise standard deviation")
    p.add_argument("--bandwidth", type=positive_float, default=0.5, help="fixed kernels' h")
    p.add_argument("--steps", type=positive_int, default=300, help="gradient steps on log h")


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.noise < math.inf:  # (the parser's check, for callers of run)
        raise ValueError(f"--noise must be a finite number >= 0, got {args.noise}")
    # float32, as the models compute: a bandwidth of 1e-300 was 0 there, one of 1e39 inf,
    # and the error named the library's bandwidth, not this option
    if not 0 < torch.tensor(math.log(args.bandwidth)).exp().item() < math.inf:
        raise ValueError(
            f"--bandwidth {args.bandwidth:g}: outside float32's range (the demo's precision); "
            "give a bandwidth from 1e-38 to 1e38"
        )
    if args.n_train < 2:  # the learned bandwidth predicts each point from the others
        raise ValueError(f"--n-train must be at least 2 to leave one out, got {args.n_train}")
    # the (n_train, n_train) leave-one-out weights and (n_test, n_train) test weights, each
    # with a few float32 intermediates (distances, scores)
    check_memory(16 * args.n_train * max(args.n_train, args.n_test), "--n-train / --n-test")
    g = torch.Generator().manual_seed(args.seed)
    x = torch.sort(torch.rand(args.n_train, generator=g) * 5).values
    y = true_function(x) + args.noise * torch.randn(args.n_train, generator=g)
    # a prediction is a weighted mean of the targets: its squared error is at most
    # (2 max |y|)^2; past float32's range the learned bandwidth went NaN (an error that
    # named the library's bandwidth)
    if not math.isfinite(((2 * y.abs().max()) ** 2 * args.n_train).item()):
        raise ValueError(
            f"--noise {args.noise:g}: the squared errors of targets that noisy overflow "
            "float32 (the demo's precision); give a smaller --noise"
        )
    x_test = torch.linspace(0, 5, args.n_test)
    y_test = true_function(x_test)

    def test_mse(pred: torch.Tensor) -> float:
        return ((pred - y_test) ** 2).mean().item()

    rows = [["mean of y (baseline)", "-", "-", test_mse(y.mean().expand(args.n_test))]]
    predictions, weights = {}, {}
    for kernel in KERNELS:
        model = KernelRegression(kernel, args.bandwidth, learn_bandwidth=False).fit(x, y)
        with torch.no_grad():
            predictions[kernel], weights[kernel] = model(x_test, return_weights=True)
        rows.append([f"fixed {kernel}", kernel, args.bandwidth, test_mse(predictions[kernel])])
    learned = KernelRegression("gaussian", bandwidth=1.0).fit(x, y)
    losses = learned.train_bandwidth(steps=args.steps, lr=0.05)
    with torch.no_grad():
        predictions["learned"], weights["learned"] = learned(x_test, return_weights=True)
        # at the bandwidth printed: losses[-1] is the error before the last step
        final_loss = learned.leave_one_out_loss().item()
    h = learned.bandwidth.item()
    rows.append(["learned gaussian (LOO)", "gaussian", h, test_mse(predictions["learned"])])

    print(
        f"{args.n_train} training points, noise sd {args.noise}; test error = MSE against the "
        f"noise-free function on {args.n_test} grid points of [0, 5]"
    )
    print(format_table(["estimator", "kernel", "bandwidth", "test MSE"], rows))
    print(
        f"learned bandwidth: 1.0 -> {h:.4g} in {args.steps} Adam steps, leave-one-out MSE "
        f"{losses[0]:.4g} -> {final_loss:.4g}"
    )
    plot(args.out, x, y, x_test, y_test, predictions, weights, args.bandwidth, h)
    return 0


def plot(out, x, y, x_test, y_test, predictions, weights, bandwidth, learned_h) -> Path:
    fig, (ax, ax_fixed, ax_learned) = new_figure(3)
    ax.plot(x, y, "o", alpha=0.5, label="noisy data", color="gray")
    ax.plot(x_test, y_test, "k-", lw=2, label="true function")
    for name, pred in predictions.items():
        label = f"learned gaussian (h={learned_h:.2f})" if name == "learned" else f"{name}"
        ax.plot(x_test, pred, "--" if name != "learned" else "-", label=label)
    ax.set(xlabel="x", ylabel="y", title=f"Nadaraya-Watson estimates (fixed h={bandwidth})")
    ax.legend(fontsize=8)
    for axis, name, title in (
        (ax_fixed, "gaussian", f"gaussian weights, h={bandwidth}"),
        (ax_learned, "learned", f"learned gaussian weights, h={learned_h:.2f}"),
    ):
        im = axis.pcolormesh(x, x_test, weights[name], cmap="Reds", shading="nearest")
        axis.invert_yaxis()
        axis.set(xlabel="training input x_i (keys)", ylabel="test input x (queries)", title=title)
        fig.colorbar(im, ax=axis, label="attention weight")
    return save_figure(fig, Path(out) / "kernel_regression.png")
