"""Position-wise feed-forward networks. Shapes: (b, t, d) -> (b, t, d).

MLP:   W2 act(W1 x)                       (ReLU in Vaswani et al., GELU in GPT-2)
Gated: W_down (act(W_gate x) * W_up x)    (Shazeer 2020: GLU = sigmoid, GeGLU = gelu,
                                           SwiGLU = silu as in LLaMA)
"""

from __future__ import annotations

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


ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": gelu_tanh,
    "silu": F.silu,
    "sigmoid": F.sigmoid,
}


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
    """Gate and up projections are one matmul (one weight read) split in two."""

    def __init__(
        self,
        d_model: int,
        hidden: int,
        activation: str = "silu",
        bias: bool = False,
        dropout: float = 0.0,
    ):
        super().__init__()
        self.hidden = hidden
        self.gate_up = Linear(d_model, 2 * hidden, bias=bias)  # rows: [gate; up]
        self.down = Linear(hidden, d_model, bias=bias)
        self.down.residual_projection = True
        self.act = ACTIVATIONS[activation]
        self.dropout = build_dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x).split(self.hidden, dim=-1)  # (b, t, hidden) each
        return self.dropout(self.down(self.act(gate) * up))


def build_ffn(cfg: FFNConfig, d_model: int, dropout: float = 0.0, *, layer: int = 0) -> nn.Module:
    """The FFN of block ``layer``. ``moe``: mixture of experts, except in the first
    ``first_k_dense`` layers, which are dense gated FFNs (as DeepSeek's)."""
    hidden = cfg.hidden_size(d_model)
    if cfg.moe_layer(layer):
        from attnlab.nn.moe import MoE  # moe builds on this module

        return MoE(d_model, cfg, dropout)
    cls = GatedFFN if cfg.kind in ("glu", "moe") else MLP
    return cls(d_model, hidden, cfg.activation, cfg.bias, dropout)
