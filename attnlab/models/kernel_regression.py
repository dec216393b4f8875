"""Nadaraya-Watson kernel regression: the oldest attention pooling (Nadaraya 1964, Watson 1964).

    f(q) = sum_i alpha(q, k_i) v_i,   alpha(q, k_i) = K((q - k_i) / h) / sum_j K((q - k_j) / h)

The training inputs are the keys, their targets the values, a new input the query; the
normalised kernel is the attention weight. With the Gaussian kernel the weights are a
softmax of the scores -||q - k||^2 / (2 h^2). Learning h by gradient descent makes the
pooling parametric (d2l.ai, section 11.2, writes the same model with w = 1/h in the
exponent); it is trained leaving each point out of its own prediction, otherwise h -> 0
interpolates the noise.

Zero total weight: a compactly supported kernel (boxcar, Epanechnikov) gives a query with
no key inside its window nothing to average. Such a query attends to its nearest (allowed)
key with weight 1. This is the limit of the estimate as the window grows until it holds
one key, and what the Gaussian weights become numerically far from the data, so every
kernel gives a finite, continuous answer.

Shapes: n_q queries, n_k keys (= values), d input dimension (inputs may be 1-D (n,)).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from attnlab.functional.softmax import masked_softmax


def gaussian(u: Tensor) -> Tensor:
    return torch.exp(-0.5 * u**2)


def boxcar(u: Tensor) -> Tensor:
    return (u.abs() <= 1).to(u.dtype)


def epanechnikov(u: Tensor) -> Tensor:
    return torch.clamp(1 - u**2, min=0)


# Unnormalised kernels of the scaled distance u = ||q - k|| / h (constants cancel in alpha).
KERNELS: dict[str, Callable[[Tensor], Tensor]] = {
    "gaussian": gaussian,
    "boxcar": boxcar,
    "epanechnikov": epanechnikov,
}


def _as_points(x: Tensor, name: str) -> Tensor:
    """(n,) or (n, d) -> (n, d) floating point."""
    x = torch.as_tensor(x)
    if not x.is_floating_point():
        x = x.float()
    if x.dim() == 1:
        x = x[:, None]
    if x.dim() != 2:
        raise ValueError(f"{name} must have shape (n,) or (n, d), got {tuple(x.shape)}")
    return x


def check_kernel(kernel: str) -> None:
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; choose one of {list(KERNELS)}")


def check_bandwidth(bandwidth: float | Tensor) -> None:
    value = float(bandwidth.detach()) if isinstance(bandwidth, Tensor) else float(bandwidth)
    if not (value > 0 and math.isfinite(value)):  # also rejects nan
        raise ValueError(f"bandwidth must be a finite number > 0, got {value}")


def kernel_weights(
    queries: Tensor,
    keys: Tensor,
    *,
    kernel: str = "gaussian",
    bandwidth: float | Tensor = 1.0,
    mask: Tensor | None = None,
) -> Tensor:
    """The attention weights alpha (n_q, n_k): each row is >= 0 and sums to 1.

    ``bandwidth`` may be a tensor (learned); ``mask`` (n_q, n_k), True (or 1, any dtype) =
    the query may use that key (e.g. ``~eye`` to leave each point out of its own prediction).
    """
    check_kernel(kernel)
    check_bandwidth(bandwidth)
    q, k = _as_points(queries, "queries"), _as_points(keys, "keys")
    if k.shape[0] == 0:
        raise ValueError("kernel regression needs at least one (key, value) pair; got none")
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"queries have dimension {q.shape[1]} but keys have {k.shape[1]}")
    if mask is not None:
        # keep/drop whatever its dtype: masked_softmax would add a 0/1 mask to the Gaussian's
        # scores (using the dropped keys), and the compact kernels' masked_fill refused it
        mask = torch.as_tensor(mask).bool()
    if mask is not None and not bool(mask.any(dim=-1).all()):
        raise ValueError("mask leaves a query with no key to attend to")
    if q.shape[1] > 1:
        # from the differences: cdist's default for over 25 rows, |q|^2 + |k|^2 - 2 q.k,
        # cancels for points far from the origin (float32 inputs near 100: distances off by
        # 0.02, weights at h = 0.05 by 0.17)
        dtype = torch.promote_types(q.dtype, k.dtype)
        q, k = q.to(dtype), k.to(dtype)
        dist = torch.cdist(q, k, compute_mode="donot_use_mm_for_euclid_dist")  # (n_q, n_k)
    else:
        dist = (q - k.T).abs()  # (n_q, n_k)
    u = dist / bandwidth
    if kernel == "gaussian":
        # softmax of the log-kernel: stable even where every exp(-u^2/2) underflows, and
        # then (far from the data) equal to the nearest-key rule of the compact kernels.
        return masked_softmax(-0.5 * u**2, mask)
    values = KERNELS[kernel](u)
    if mask is not None:
        values = values * mask
    total = values.sum(dim=-1, keepdim=True)  # (n_q, 1)
    empty = total == 0  # no key inside the window: use the nearest allowed key
    if mask is not None:
        dist = dist.masked_fill(~mask, float("inf"))
    nearest = torch.zeros_like(values).scatter_(-1, dist.argmin(dim=-1, keepdim=True), 1.0)
    return torch.where(empty, nearest, values / torch.where(empty, 1.0, total))


def nadaraya_watson(
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    *,
    kernel: str = "gaussian",
    bandwidth: float | Tensor = 1.0,
    mask: Tensor | None = None,
    return_weights: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """f(q) = alpha(q, keys) @ values: (n_q,) for values (n_k,), (n_q, d_v) for (n_k, d_v)."""
    keys_2d = _as_points(keys, "keys")
    values = torch.as_tensor(values)
    if values.shape[0] != keys_2d.shape[0]:
        raise ValueError(f"{keys_2d.shape[0]} keys but {values.shape[0]} values; give one per key")
    weights = kernel_weights(queries, keys_2d, kernel=kernel, bandwidth=bandwidth, mask=mask)
    out = weights @ values.to(weights.dtype)  # (n_q,) or (n_q, d_v)
    return (out, weights) if return_weights else out


def leave_one_out_mask(n: int, device: torch.device | str | None = None) -> Tensor:
    """(n, n) True off the diagonal: point i may not use itself when predicting itself."""
    if n < 2:
        raise ValueError(f"leaving one out needs at least 2 data points, got {n}")
    return ~torch.eye(n, dtype=torch.bool, device=device)


class KernelRegression(nn.Module):
    """Nadaraya-Watson with a learnable bandwidth h = exp(log_h) (kept > 0 by construction).

    ``fit(x, y)`` stores the data (keys and values); ``forward(queries)`` pools them. With
    ``learn_bandwidth=False`` the bandwidth is a fixed hyper-parameter (the non-parametric
    estimator). The boxcar kernel is piecewise constant in h, so its bandwidth cannot be
    learned by gradient descent.
    """

    def __init__(self, kernel: str = "gaussian", bandwidth: float = 1.0, learn_bandwidth=True):
        super().__init__()
        check_kernel(kernel)
        check_bandwidth(bandwidth)
        if learn_bandwidth and kernel == "boxcar":
            raise ValueError(
                "the boxcar kernel has zero gradient in the bandwidth; learn the bandwidth of "
                "a gaussian or epanechnikov kernel, or fix it (learn_bandwidth=False)"
            )
        self.kernel = kernel
        self.log_bandwidth = nn.Parameter(
            torch.tensor(math.log(bandwidth)), requires_grad=learn_bandwidth
        )
        self.register_buffer("keys", torch.zeros(0, 1))
        self.register_buffer("values", torch.zeros(0))

    @property
    def bandwidth(self) -> Tensor:
        return self.log_bandwidth.exp()

    def fit(self, x: Tensor, y: Tensor) -> KernelRegression:
        keys = _as_points(x, "x")
        y = torch.as_tensor(y, dtype=keys.dtype)
        if keys.shape[0] == 0:
            raise ValueError("kernel regression needs at least one (x, y) pair; got none")
        if y.shape[0] != keys.shape[0]:
            raise ValueError(f"{keys.shape[0]} inputs but {y.shape[0]} targets")
        self.keys, self.values = keys, y
        return self

    def forward(
        self, queries: Tensor, *, mask: Tensor | None = None, return_weights: bool = False
    ) -> Tensor | tuple[Tensor, Tensor]:
        if self.keys.shape[0] == 0:
            raise ValueError("no data: call fit(x, y) before predicting")
        return nadaraya_watson(
            queries,
            self.keys,
            self.values,
            kernel=self.kernel,
            bandwidth=self.bandwidth,
            mask=mask,
            return_weights=return_weights,
        )

    def leave_one_out_loss(self) -> Tensor:
        """Mean squared error of predicting each stored point from all the others."""
        mask = leave_one_out_mask(self.keys.shape[0], self.keys.device)
        pred = self(self.keys, mask=mask)
        return ((pred - self.values) ** 2).mean()

    def train_bandwidth(self, steps: int = 200, lr: float = 0.05) -> list[float]:
        """Minimise the leave-one-out error over log h by gradient descent (Adam); returns
        the loss before each step. Leave-one-out is what keeps h from collapsing to 0."""
        if not self.log_bandwidth.requires_grad:
            raise ValueError("this model's bandwidth is fixed (learn_bandwidth=False)")
        optimizer = torch.optim.Adam([self.log_bandwidth], lr=lr)
        losses = []
        for _ in range(steps):
            loss = self.leave_one_out_loss()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        return losses
