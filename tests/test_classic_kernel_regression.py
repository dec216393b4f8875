"""Nadaraya-Watson kernel regression against a direct double loop over queries and keys."""

from __future__ import annotations

import math

import pytest
import torch

from attnlab.models.kernel_regression import (
    KernelRegression,
    kernel_weights,
    leave_one_out_mask,
    nadaraya_watson,
)

KERNEL_FORMULAS = {  # written from the textbook definitions, independent of the library
    "gaussian": lambda u: math.exp(-u * u / 2),
    "boxcar": lambda u: 1.0 if abs(u) <= 1 else 0.0,
    "epanechnikov": lambda u: max(0.0, 1 - u * u),
}


def loop_estimate(queries, keys, values, kernel, h, excluded=lambda i, j: False):
    """For each query: sum_i K(|q - k_i| / h) y_i / sum_i K(|q - k_i| / h), over the keys
    that are not excluded; with zero total weight, the y of the nearest such key."""
    out = []
    for i, q in enumerate(queries.tolist()):
        num = den = 0.0
        best, best_dist = None, math.inf
        for j, (k, y) in enumerate(zip(keys.tolist(), values.tolist())):
            if excluded(i, j):
                continue
            if isinstance(q, list):  # a point in d dimensions
                dist = math.sqrt(sum((a - b) ** 2 for a, b in zip(q, k)))
            else:
                dist = abs(q - k)
            w = KERNEL_FORMULAS[kernel](dist / h)
            num += w * y
            den += w
            if dist < best_dist:
                best, best_dist = y, dist
        out.append(num / den if den > 0 else best)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("kernel", list(KERNEL_FORMULAS))
@pytest.mark.parametrize("h", [0.3, 1.0, 2.5])
def test_estimate_matches_double_loop(kernel, h):
    g = torch.Generator().manual_seed(1)
    keys = torch.rand(40, generator=g, dtype=torch.float64) * 5
    values = torch.randn(40, generator=g, dtype=torch.float64)
    queries = torch.rand(25, generator=g, dtype=torch.float64) * 6 - 0.5  # some outside
    got, weights = nadaraya_watson(
        queries, keys, values, kernel=kernel, bandwidth=h, return_weights=True
    )
    torch.testing.assert_close(got, loop_estimate(queries, keys, values, kernel, h))
    torch.testing.assert_close(weights.sum(-1), torch.ones(25, dtype=torch.float64))
    assert bool((weights >= 0).all())


@pytest.mark.parametrize("kernel", list(KERNEL_FORMULAS))
def test_multidimensional_inputs_and_vector_values(kernel):
    g = torch.Generator().manual_seed(2)
    keys = torch.randn(30, 3, generator=g, dtype=torch.float64)
    values = torch.randn(30, 2, generator=g, dtype=torch.float64)
    queries = torch.randn(10, 3, generator=g, dtype=torch.float64)
    got = nadaraya_watson(queries, keys, values, kernel=kernel, bandwidth=1.5)
    for col in range(2):
        want = loop_estimate(queries, keys, values[:, col], kernel, 1.5)
        torch.testing.assert_close(got[:, col], want)


@pytest.mark.parametrize("kernel", list(KERNEL_FORMULAS))
def test_multidimensional_distances_are_exact_far_from_the_origin(kernel):
    # float32 points near 100 with a small bandwidth: cdist's matrix-product shortcut
    # (|q|^2 + |k|^2 - 2 q.k, over 25 rows) was off by 0.02 in distance, 0.17 in weight
    g = torch.Generator().manual_seed(4)
    keys = 100 + torch.rand(60, 3, generator=g)
    values = torch.randn(60, generator=g)
    queries = 100 + torch.rand(40, 3, generator=g)
    got = nadaraya_watson(queries, keys, values, kernel=kernel, bandwidth=0.3)
    want = loop_estimate(queries.double(), keys.double(), values.double(), kernel, 0.3)
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)
    # float64 queries against float32 data: promoted, as for 1-D inputs
    assert nadaraya_watson(queries.double(), keys, values).dtype == torch.float64


def test_gaussian_weights_are_a_softmax_of_negative_squared_distance():
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(7, generator=g), torch.randn(9, generator=g)
    h = 0.7
    want = torch.softmax(-((q[:, None] - k[None, :]) ** 2) / (2 * h * h), dim=-1)
    torch.testing.assert_close(kernel_weights(q, k, bandwidth=h), want)


@pytest.mark.parametrize("kernel", ["boxcar", "epanechnikov", "gaussian"])
def test_query_with_zero_total_weight_takes_the_nearest_key(kernel):
    # Keys at 0, 1, 2: queries at 10 and -3 have no key inside a compact window of h = 0.5,
    # and every Gaussian weight exp(-u^2 / 2) underflows to 0 there at h = 0.05.
    keys = torch.tensor([0.0, 1.0, 2.0])
    values = torch.tensor([5.0, 6.0, 7.0])
    h = 0.5 if kernel != "gaussian" else 0.05
    got, weights = nadaraya_watson(
        torch.tensor([10.0, -3.0, 0.9]), keys, values, kernel=kernel, bandwidth=h,
        return_weights=True,
    )  # fmt: skip
    torch.testing.assert_close(got, torch.tensor([7.0, 5.0, 6.0]))
    torch.testing.assert_close(weights[0], torch.tensor([0.0, 0.0, 1.0]))
    assert bool(torch.isfinite(got).all())


@pytest.mark.parametrize("kernel", list(KERNEL_FORMULAS))
def test_leave_one_out_matches_loop_and_never_uses_the_point_itself(kernel):
    g = torch.Generator().manual_seed(4)
    x = torch.rand(30, generator=g, dtype=torch.float64) * 5
    y = torch.randn(30, generator=g, dtype=torch.float64)
    mask = leave_one_out_mask(30)
    got, weights = nadaraya_watson(
        x, x, y, kernel=kernel, bandwidth=0.4, mask=mask, return_weights=True
    )
    want = loop_estimate(x, x, y, kernel, 0.4, excluded=lambda i, j: i == j)
    torch.testing.assert_close(got, want)
    assert bool((weights.diagonal() == 0).all())


@pytest.mark.parametrize("kernel", list(KERNEL_FORMULAS))
@pytest.mark.parametrize("dtype", [torch.long, torch.float64])
def test_a_zero_one_mask_of_any_dtype_means_keep_or_drop(kernel, dtype):
    # the Gaussian added a 0/1 mask to its scores (the left-out point still used: 0.15 off),
    # the compact kernels failed inside masked_fill
    g = torch.Generator().manual_seed(5)
    x = torch.rand(20, generator=g, dtype=torch.float64) * 5
    y = torch.randn(20, generator=g, dtype=torch.float64)
    got = nadaraya_watson(
        x, x, y, kernel=kernel, bandwidth=0.5, mask=leave_one_out_mask(20).to(dtype)
    )
    torch.testing.assert_close(got, loop_estimate(x, x, y, kernel, 0.5, lambda i, j: i == j))


def test_learned_bandwidth_finds_the_leave_one_out_optimum():
    # Gradient descent on log h must land where a fine grid search of the same
    # leave-one-out error has its minimum.
    g = torch.Generator().manual_seed(5)
    x = torch.sort(torch.rand(60, generator=g) * 5).values
    y = 2 * torch.sin(x) + x**0.8 + 0.5 * torch.randn(60, generator=g)
    model = KernelRegression("gaussian", bandwidth=2.0).fit(x, y)
    losses = model.train_bandwidth(steps=300, lr=0.05)
    assert losses[-1] < losses[0]
    grid = torch.exp(torch.linspace(math.log(0.02), math.log(3.0), 2000))
    mask = leave_one_out_mask(60)
    grid_losses = torch.stack(
        [((nadaraya_watson(x, x, y, bandwidth=h, mask=mask) - y) ** 2).mean() for h in grid]
    )
    best = grid[grid_losses.argmin()]
    assert abs(model.bandwidth.item() - best.item()) / best.item() < 0.02
    assert model.leave_one_out_loss().item() <= grid_losses.min().item() * (1 + 1e-4)


def test_fixed_bandwidth_model_equals_the_function():
    g = torch.Generator().manual_seed(6)
    x, y, q = torch.randn(20, generator=g), torch.randn(20, generator=g), torch.randn(5)
    model = KernelRegression("epanechnikov", bandwidth=0.8, learn_bandwidth=False).fit(x, y)
    torch.testing.assert_close(
        model(q), nadaraya_watson(q, x, y, kernel="epanechnikov", bandwidth=0.8)
    )
    with pytest.raises(ValueError, match="fixed"):
        model.train_bandwidth(steps=1)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: nadaraya_watson(torch.ones(2), torch.ones(3), torch.ones(3), bandwidth=0.0), "bandwidth"),  # noqa: E501
        (lambda: nadaraya_watson(torch.ones(2), torch.ones(3), torch.ones(3), bandwidth=-1.0), "bandwidth"),  # noqa: E501
        (lambda: nadaraya_watson(torch.ones(2), torch.ones(3), torch.ones(3), bandwidth=math.nan), "bandwidth"),  # noqa: E501
        (lambda: nadaraya_watson(torch.ones(2), torch.ones(3), torch.ones(3), kernel="tricube"), "unknown kernel"),  # noqa: E501
        (lambda: nadaraya_watson(torch.ones(2), torch.ones(0), torch.ones(0)), "at least one"),
        (lambda: nadaraya_watson(torch.ones(2), torch.ones(3), torch.ones(4)), "3 keys but 4 values"),  # noqa: E501
        (lambda: KernelRegression("boxcar"), "zero gradient"),
        (lambda: KernelRegression(bandwidth=0), "bandwidth"),
        (lambda: KernelRegression().fit(torch.ones(0), torch.ones(0)), "at least one"),
        (lambda: KernelRegression()(torch.ones(2)), "call fit"),
        (lambda: KernelRegression().fit(torch.ones(1), torch.ones(1)).leave_one_out_loss(), "at least 2"),  # noqa: E501
    ],
)  # fmt: skip
def test_bad_input_is_one_clear_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()
