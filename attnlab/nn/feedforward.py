"""Position-wise feed-forward networks. Shapes: (b, t, d) -> (b, t, d).

MLP:   W2 act(W1 x)                       (ReLU in Vaswani et al., GELU in GPT-2)
Gated: W_down glu(W_gate x, W_up x)       glu(g, u) = act(g) * u (Shazeer 2020: GLU =
                                           sigmoid, GeGLU = gelu, SwiGLU = silu as in
                                           LLaMA), or GPT-OSS's clamped SwiGLU
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.config import FFNConfig
from attnlab.nn.dropout import dropout as build_dropout
from attnlab.nn.linear import Linear


def gelu_tanh(x: Tensor) -> Tensor:
    """GPT-2's GELU (tanh approximation). A module-level function, not a lambda: modules
    keep their activation as an attribute, and a lambda made the model unpicklable
    (``torch.save(model)``, ``pickle``)."""
    return F.gelu(x, approximate="tanh")


def relu2(x: Tensor) -> Tensor:
    """Squared ReLU, relu(x)^2 (So et al. 2021, Primer; Persimmon's and Nemotron's MLPs)."""
    return torch.square(F.relu(x))


ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": gelu_tanh,
    "silu": F.silu,
    "sigmoid": F.sigmoid,
    "relu2": relu2,
}


def clamped_swiglu(gate: Tensor, up: Tensor, alpha: float = 1.702, limit: float = 7.0) -> Tensor:
    """GPT-OSS's gated activation: the gate clamped above at ``limit``, the up projection
    to [-limit, limit], then g * sigmoid(alpha g) * (u + 1) (a sigmoid-gated GELU-like
    unit, and an up projection offset by 1)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return gate * torch.sigmoid(alpha * gate) * (up + 1)


class Gated:
    """glu(gate, up) = act(gate) * up: what a gated FFN or expert makes of its two
    projections. A plain class, not a lambda, so that models stay picklable."""

    def __init__(self, activation: str):
        self.activation, self.act = activation, ACTIVATIONS[activation]

    def __call__(self, gate: Tensor, up: Tensor) -> Tensor:
        return self.act(gate) * up

    def __repr__(self) -> str:
        return f"Gated({self.activation})"


class ClampedSwiGLU:
    """glu(gate, up) = :func:`clamped_swiglu` with the config's alpha and limit."""

    def __init__(self, alpha: float, limit: float):
        self.alpha, self.limit = alpha, limit

    def __call__(self, gate: Tensor, up: Tensor) -> Tensor:
        return clamped_swiglu(gate, up, self.alpha, self.limit)

    def __repr__(self) -> str:
        return f"ClampedSwiGLU(alpha={self.alpha}, limit={self.limit})"


# ffn.activation -> glu(gate, up) of the gated kinds (glu, moe); elementwise activations are
# act(gate) * up (Gated). The registry: a new gated activation is one entry here and its name
# in config.GATED_ACTIVATIONS.
GATED_ACTIVATIONS: dict[str, Callable[[FFNConfig], Callable[[Tensor, Tensor], Tensor]]] = {
    "clamped_swiglu": lambda cfg: ClampedSwiGLU(cfg.swiglu_alpha, cfg.swiglu_limit),
}


def gated_activation(cfg: FFNConfig) -> Callable[[Tensor, Tensor], Tensor]:
    """glu(gate, up) of ``cfg.activation`` for gated FFNs and experts."""
    if cfg.activation in GATED_ACTIVATIONS:
        return GATED_ACTIVATIONS[cfg.activation](cfg)
    return Gated(cfg.activation)


class MLP(nn.Module):
    """Two-layer feed-forward network: ``down(act(up(x)))`` with dropout (GPT-2's, the
    original Transformer's)."""

    def __init__(
        self,
        d_model: int,
        hidden: int,
        activation: str = "gelu",
        bias: bool = True,
        dropout: float = 0.0,
    ):
        super().__init__()
        self.up = Linear(d_model, hidden, bias=bias)
        self.down = Linear(hidden, d_model, bias=bias)
        self.down.residual_projection = True
        self.act = ACTIVATIONS[activation]
        self.dropout = build_dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.down(self.act(self.up(x))))


class GatedFFN(nn.Module):
    """Gate and up projections are one matmul (one weight read) split in two.
    ``activation``: an elementwise activation's name (act(gate) * up), or a glu(gate, up)
    from :func:`gated_activation`."""

    def __init__(
        self,
        d_model: int,
        hidden: int,
        activation: str | Callable[[Tensor, Tensor], Tensor] = "silu",
        bias: bool = False,
        dropout: float = 0.0,
    ):
        super().__init__()
        self.hidden = hidden
        self.gate_up = Linear(d_model, 2 * hidden, bias=bias)  # rows: [gate; up]
        self.down = Linear(hidden, d_model, bias=bias)
        self.down.residual_projection = True
        self.glu = Gated(activation) if isinstance(activation, str) else activation
        self.dropout = build_dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x).split(self.hidden, dim=-1)  # (b, t, hidden) each
        return self.dropout(self.down(self.glu(gate, up)))


def build_ffn(cfg: FFNConfig, d_model: int, dropout: float = 0.0, *, layer: int = 0) -> nn.Module:
    """The FFN of block ``layer``. ``moe``: mixture of experts, except in the first
    ``first_k_dense`` layers, which are dense gated FFNs (as DeepSeek's)."""
    hidden = cfg.hidden_size(d_model)
    if cfg.moe_layer(layer):
        from attnlab.nn.moe import MoE  # moe builds on this module

        return MoE(d_model, cfg, dropout)
    if cfg.kind in ("glu", "moe"):
        return GatedFFN(d_model, hidden, gated_activation(cfg), cfg.bias, dropout)
    return MLP(d_model, hidden, cfg.activation, cfg.bias, dropout)
