"""Mixture-of-experts feed-forward (DeepSeekMoE: Dai et al. 2024; DeepSeek-V2, -V3).

    y = sum_{i in shared} FFN_i(x) + sum_{i in topk} g_i FFN_i(x)

Many small routed experts, of which each token uses k, plus shared experts every token uses.
With ``shared_expert_gate`` (Qwen2-MoE) a learned gate scales the shared experts' output
per token: y = sigmoid(x w_g) sum_{i in shared} FFN_i(x) + sum_{i in topk} g_i FFN_i(x).
Every expert is a gated FFN (SwiGLU). Routers, by name:

* ``deepseek-v3``: s = sigmoid(x W_r^T); experts are *chosen* by s + b, where b is a
  per-expert bias nudged after each optimizer step toward under-loaded experts
  (auxiliary-loss-free balancing, DeepSeek-V3 Sec. 2.1.2), and *weighted* by s alone,
  normalised over the chosen k. Group-limited: experts form n_groups groups, a group's
  score is the sum of its top 2, and a token picks only from its topk_groups best groups.
* ``deepseek-v2``: s = softmax(x W_r^T); greedy top-k (or group-limited: a group's score
  is its best expert), weights s of the chosen experts. With norm_topk_prob and a router
  bias this is GPT-OSS's router (top-k of the logits x W_r^T + b, softmax over those k:
  the same weights, since exp(l_i) / sum_topk exp(l_j) = s_i / sum_topk s_j).

Both multiply the weights by routed_scaling_factor; ``router_bias`` adds a learned bias to
the logits (GPT-OSS), which trains by gradient like W_r. An expert's glu(gate, up) is
act(gate) * up, or GPT-OSS's clamped SwiGLU (feedforward.py); ``expert_bias`` gives its
projections biases (GPT-OSS). Experts run on the tokens routed to them, grouped by sorting
the (token, expert) pairs by expert: a loop over experts, never over tokens. Under
torch.compile, when the tokens choose no more (token, expert) pairs than there are experts
(a decode step), each token's k experts' weights are gathered instead: static shapes (the
group sizes of the loop are data), reading only the chosen experts; compiled decoding of
more tokens runs every expert on every token, weighted 0 where not chosen (``dense``).

Shapes: b batch, t length, d d_model, N = b t tokens, E routed experts, k experts per token,
f expert hidden size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.config import FFNConfig
from attnlab.functional.softmax import softmax_dtype
from attnlab.nn.feedforward import Gated, GatedFFN, gated_activation
from attnlab.nn.linear import Linear


class KeepsPrecision(nn.Module):
    """A module whose tensors named in ``full_precision`` (parameters or buffers) stay at
    least float32 when the model is cast to half precision (``model.to(bf16)``, and
    ``attnlab.weights.materialize``): cast back from their values before the cast, so
    nothing is rounded. A float64 model keeps them float64."""

    full_precision: tuple[str, ...] = ()

    def _apply(self, fn, recurse: bool = True):
        before = {name: getattr(self, name) for name in self.full_precision}
        before = {k: v.detach() if v is not None else None for k, v in before.items()}
        super()._apply(fn, recurse)
        for name, value in before.items():
            after = getattr(self, name)
            if after is None or not after.is_floating_point() or after.element_size() >= 4:
                continue
            source = value if value is not None and value.device.type != "meta" else after
            kept = source.detach().to(device=after.device, dtype=torch.float32)
            if name in self._parameters:
                self._parameters[name].data = kept  # the same Parameter (optimizers keep it)
            else:
                self._buffers[name] = kept
        return self


class Router(KeepsPrecision):
    """Scores, chosen experts and their weights. ``e_score_correction_bias`` (deepseek-v3
    only) is a buffer, not a parameter: it is set by :meth:`MoE.update_bias`, not by
    gradients. ``bias`` (``router_bias``, GPT-OSS) is a parameter added to the logits."""

    def __init__(self, d_model: int, cfg: FFNConfig):
        super().__init__()
        self.kind, self.top_k = cfg.router, cfg.n_activated_experts
        self.n_experts, self.n_groups, self.topk_groups = (
            cfg.n_routed_experts,
            cfg.n_groups,
            cfg.topk_groups,
        )
        self.norm_topk_prob, self.scaling = cfg.norm_topk_prob, cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, d_model))
        bias = nn.Parameter(torch.empty(cfg.n_routed_experts)) if cfg.router_bias else None
        self.register_parameter("bias", bias)
        if self.kind == "deepseek-v3":
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts))
        else:
            self.e_score_correction_bias = None
        self.init_weights(0.02)

    def init_weights(self, std: float) -> None:
        nn.init.normal_(self.weight, std=std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)
        if self.e_score_correction_bias is not None:
            self.e_score_correction_bias.zero_()

    # Kept at least float32 in a half-precision model (model.to(bf16), load_hf(dtype=bf16)),
    # as transformers keeps them (DeepSeek's _keep_in_fp32_modules_strict): the routing
    # runs in float32, and the balancing bias's steps of bias_update_speed (1e-3) would
    # round away near the scores' 0.5 in bf16.
    full_precision = ("weight", "bias", "e_score_correction_bias")

    def _group_mask(self, choice: Tensor) -> Tensor:
        """(N, E) True for experts in each token's topk_groups best groups."""
        N = choice.shape[0]
        grouped = choice.view(N, self.n_groups, choice.shape[1] // self.n_groups)  # (N, g, E/g)
        if self.kind == "deepseek-v3":
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # (N, groups)
        else:
            group_scores = grouped.amax(dim=-1)
        best = group_scores.topk(self.topk_groups, dim=-1).indices  # (N, topk_groups)
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return keep[:, :, None].expand_as(grouped).reshape(choice.shape)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x (N, d) -> weights (N, k), experts (N, k), scores (N, E); float32 (float64 in a
        float64 model)."""
        # Routing in float32, under autocast too (which would run this product in bf16: near
        # ties, e.g. sigmoid scores about 0.5, would then pick other experts).
        with torch.autocast(x.device.type, enabled=False):
            x = softmax_dtype(x)  # float32 at least (float64 kept)
            bias = None if self.bias is None else self.bias.to(x.dtype)
            logits = F.linear(x, self.weight.to(x.dtype), bias)  # (N, E)
        if self.kind == "deepseek-v3":
            scores = logits.sigmoid()
            choice = scores + self.e_score_correction_bias  # the bias chooses, never weighs
        else:
            scores = logits.softmax(dim=-1)
            choice = scores
        if self.n_groups > 1:
            choice = choice.masked_fill(~self._group_mask(choice), float("-inf"))
        experts = choice.topk(self.top_k, dim=-1).indices  # (N, k)
        weights = scores.gather(1, experts)  # (N, k)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, experts, scores


class Experts(nn.Module):
    """E gated FFNs as stacked weights: ``gate_up`` (E, 2f, d) with rows [gate; up] (as
    :class:`GatedFFN`), ``down`` (E, d, f); with ``bias`` (GPT-OSS) also ``gate_up_bias``
    (E, 2f) and ``down_bias`` (E, d). ``activation``: an elementwise activation's name
    (act(gate) * up) or a glu(gate, up) from :func:`gated_activation`."""

    # biases held as matrices (one row per expert): no weight decay (training/optim.py)
    no_weight_decay = ("gate_up_bias", "down_bias")

    def __init__(
        self,
        d_model: int,
        n_experts: int,
        hidden: int,
        activation: str | Callable[[Tensor, Tensor], Tensor] = "silu",
        bias: bool = False,
    ):
        super().__init__()
        self.n_experts, self.hidden = n_experts, hidden
        self.gate_up = nn.Parameter(torch.empty(n_experts, 2 * hidden, d_model))
        self.down = nn.Parameter(torch.empty(n_experts, d_model, hidden))
        gate_up_bias = nn.Parameter(torch.empty(n_experts, 2 * hidden)) if bias else None
        down_bias = nn.Parameter(torch.empty(n_experts, d_model)) if bias else None
        self.register_parameter("gate_up_bias", gate_up_bias)
        self.register_parameter("down_bias", down_bias)
        self.glu = Gated(activation) if isinstance(activation, str) else activation
        self.init_weights(0.02)

    def init_weights(self, std: float) -> None:
        nn.init.normal_(self.gate_up, std=std)
        nn.init.normal_(self.down, std=std)
        if self.gate_up_bias is not None:
            nn.init.zeros_(self.gate_up_bias)
            nn.init.zeros_(self.down_bias)

    def expert(self, e: int, x: Tensor) -> Tensor:
        """Expert e on x (n, d) -> (n, d)."""
        biased = self.gate_up_bias is not None
        h = F.linear(x, self.gate_up[e], self.gate_up_bias[e] if biased else None)  # (n, 2f)
        gate, up = h.split(self.hidden, dim=-1)
        return F.linear(self.glu(gate, up), self.down[e], self.down_bias[e] if biased else None)

    def forward(self, x: Tensor, experts: Tensor, weights: Tensor) -> Tensor:
        """x (N, d); experts, weights (N, k) -> sum_j weights[:, j] expert_{experts[:, j]}(x)."""
        N, k = experts.shape
        if torch.compiler.is_compiling():  # static shapes where the graph must not break
            if N * k <= self.n_experts:
                return self.gathered(x, experts, weights)
            if not torch.is_grad_enabled():  # compiled decoding of a larger batch
                return self.dense(x, experts, weights)
            # compiled training: the grouped products below (a graph break at the counts)
        flat = experts.flatten()  # (N k,): pair p is token p // k
        order = flat.argsort(stable=True)  # pairs grouped by expert
        token = order // k  # (N k,) the token of each sorted pair
        counts = torch.bincount(flat, minlength=self.n_experts).tolist()
        chunks = x[token].split(counts)  # the tokens of expert 0, then 1, ...
        out = torch.cat([self.expert(e, xs) for e, xs in enumerate(chunks)])  # (N k, d)
        out = out * weights.flatten()[order, None].to(out.dtype)
        # In the experts' dtype, which is not x's under autocast (bf16 products of float32
        # activations: index_add_ refused to add them into a float32 buffer)
        return x.new_zeros(x.shape, dtype=out.dtype).index_add_(0, token, out)  # (N, d)

    def gathered(self, x: Tensor, experts: Tensor, weights: Tensor) -> Tensor:
        """:meth:`forward` with the chosen experts' weights gathered per token: (N, k, 2f, d)
        and (N, k, d, f). Static shapes, for compiled decoding of a few tokens."""
        h = torch.einsum("nkfd,nd->nkf", self.gate_up[experts], x)  # (N, k, 2f)
        if self.gate_up_bias is not None:
            h = h + self.gate_up_bias[experts]  # (N, k, 2f)
        gate, up = h.split(self.hidden, dim=-1)
        y = torch.einsum("nkdf,nkf->nkd", self.down[experts], self.glu(gate, up))  # (N, k, d)
        if self.down_bias is not None:
            y = y + self.down_bias[experts]
        return (y * weights[..., None].to(y.dtype)).sum(dim=1)  # (N, d)

    def dense(self, x: Tensor, experts: Tensor, weights: Tensor) -> Tensor:
        """:meth:`forward` with every expert on every token, weighted by each token's gates
        (0 for the experts it did not choose). Static shapes; reads each expert's weights
        once, where :meth:`gathered` would read N k expert copies: for compiled decoding
        of more tokens than n_experts / k."""
        gates = torch.zeros(x.shape[0], self.n_experts, dtype=x.dtype, device=x.device)
        gates = gates.scatter_add(1, experts, weights.to(x.dtype))  # (N, E)
        h = torch.einsum("efd,nd->nef", self.gate_up, x)  # (N, E, 2f)
        if self.gate_up_bias is not None:
            h = h + self.gate_up_bias  # (E, 2f) on every token
        gate, up = h.split(self.hidden, dim=-1)
        y = torch.einsum("edf,nef->ned", self.down, self.glu(gate, up))  # (N, E, d)
        if self.down_bias is not None:
            y = y + self.down_bias
        return torch.einsum("ned,ne->nd", y, gates)


@dataclass(frozen=True)
class SwitchBalance:
    """The Switch Transformer load-balancing loss (Fedus et al. 2021, eq. 4-6) over several
    MoE layers at once, as transformers' ``load_balancing_loss_func`` (Mixtral, Qwen2-MoE,
    Qwen3-MoE, GPT-OSS) computes it: coef E sum_i F_i P_i, where over all layers' tokens F_i is the
    number of (layer, token, top-k slot) choices of expert i per token and P_i the mean
    softmax probability of i. Not a sum of per-layer losses: each layer reports its sums
    (:attr:`MoE.aux_stats`) and the model adds those of every layer with the same pool
    (``aux_pool``: equal settings) before calling this once (``models.outputs.collect_aux``)."""

    coef: float
    n_experts: int

    def __call__(self, choices: Tensor, probs: Tensor, tokens: Tensor) -> Tensor:
        """choices (E,) chosen slots per expert, probs (E,) summed probabilities, tokens
        (0-d): each summed over the layers' real tokens."""
        tokens = tokens.clamp(min=1)  # a batch of padding only: 0, not 0 / 0
        return self.coef * self.n_experts * ((choices / tokens) * (probs / tokens)).sum()


class MoE(KeepsPrecision):
    """Routed and shared experts. ``aux_metrics``: ``max_vio`` (DeepSeek-V3's MaxVio: the
    busiest expert's load over the mean load, minus 1, in this forward pass); ``aux_loss``:
    the sequence-wise balance loss when seq_aux_loss_coef > 0 (training only);
    ``aux_stats``: this layer's share of the Switch balance loss (:class:`SwitchBalance`,
    ``aux_pool``) when switch_aux_loss_coef > 0 (training only). Given ``real_tokens`` (a
    padded batch), the load that balances the bias, MaxVio and the balance losses count the
    real tokens only, as if each sequence came unpadded."""

    has_aux = True

    def __init__(self, d_model: int, cfg: FFNConfig, dropout: float = 0.0):
        super().__init__()
        self.n_experts, self.top_k = cfg.n_routed_experts, cfg.n_activated_experts
        self.bias_update_speed, self.aux_coef = cfg.bias_update_speed, cfg.seq_aux_loss_coef
        hidden = cfg.expert_hidden_size(d_model)
        self.gate = Router(d_model, cfg)
        glu = gated_activation(cfg)
        self.experts = Experts(d_model, cfg.n_routed_experts, hidden, glu, cfg.expert_bias)
        self.shared = (
            GatedFFN(d_model, hidden * cfg.n_shared_experts, glu, bias=cfg.expert_bias)
            if cfg.n_shared_experts
            else None
        )
        # Qwen2-MoE's shared_expert_gate: w_g (1, d), one logit per token
        self.shared_gate = Linear(d_model, 1, bias=False) if cfg.shared_expert_gate else None
        self.dropout = nn.Dropout(dropout)
        # Tokens routed to each expert since the last update_bias() (training passes).
        self.register_buffer("load", torch.zeros(cfg.n_routed_experts), persistent=False)
        self.aux_loss: Tensor | None = None
        self.aux_metrics: dict[str, Tensor | float] = {}
        coef = cfg.switch_aux_loss_coef
        self.aux_pool = SwitchBalance(coef, cfg.n_routed_experts) if coef > 0 else None
        self.aux_stats: tuple[Tensor, Tensor, Tensor] | None = None

    full_precision = ("load",)  # token counts: bf16 counts above 256 round

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """No tokens counted yet, as built (after building on the meta device or
        ``to_empty``: no state dict holds the counts)."""
        self.load.zero_()

    def forward(self, x: Tensor, real_tokens: Tensor | None = None) -> Tensor:
        """x (b, t, d) -> (b, t, d). ``real_tokens`` (b, t) bool: False at padding, which the
        experts still compute (fixed shapes) but the statistics and the balance loss skip."""
        b, t, d = x.shape
        flat = x.reshape(b * t, d)
        weights, experts, scores = self.gate(flat)  # (N, k), (N, k), (N, E)
        y = self.experts(flat, experts, weights).view(b, t, d)
        if self.shared is not None:
            shared = self.shared(x)  # (b, t, d)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x)) * shared  # (b, t, 1) gate
            y = y + shared
        with torch.no_grad():
            # tokens per expert (a fixed-size count: no data-dependent shape when compiled);
            # a padded token adds 0 (weighted, not indexed out: fixed shapes again)
            load = torch.zeros(self.n_experts, device=x.device)
            if real_tokens is None:
                counted = torch.ones(experts.numel(), device=x.device)  # (N k,)
            else:  # (N k,): pair p is token p // k
                counted = real_tokens.reshape(b * t, 1).expand(experts.shape).flatten()
            load.index_add_(0, experts.flatten(), counted.to(load.dtype))
            if self.training:
                self.load += load
            # 0 when nothing was counted (a batch of padding only), not 0 / 0
            max_vio = load.max() / load.mean() - 1
            self.aux_metrics = {"max_vio": torch.where(load.any(), max_vio, 0.0)}
        self.aux_stats = None
        if self.training and self.aux_pool is not None:
            # Switch (SwitchBalance): F_i from the experts the real tokens are routed to
            # (`load`: the top k of the softmax, as transformers counts, without groups),
            # P_i from their softmax scores (with the router's bias: GPT-OSS's logits)
            if real_tokens is None:
                probs, tokens = scores.sum(dim=0), torch.full((), b * t, device=x.device)
            else:
                real = real_tokens.reshape(b * t, 1)  # (N, 1)
                probs, tokens = (scores * real).sum(dim=0), real.sum()
            self.aux_stats = (load.to(scores.dtype), probs, tokens.to(scores.dtype))
        self.aux_loss = None
        if self.training and self.aux_coef > 0:
            counted = experts
            if self.gate.kind == "deepseek-v3":
                # f_i counts each token's k highest affinities (DeepSeek-V3 eq. 18): the
                # balancing bias and the group limit route, they are no part of the loss
                counted = scores.topk(self.top_k, dim=-1).indices  # (N, k)
            self.aux_loss = self._sequence_balance_loss(
                scores.view(b, t, scores.shape[-1]),
                counted.view(b, t, counted.shape[-1]),
                real_tokens,
            )
        return self.dropout(y)

    def _sequence_balance_loss(
        self, scores: Tensor, experts: Tensor, real_tokens: Tensor | None = None
    ) -> Tensor:
        """DeepSeek-V3 eq. 17-20, per sequence then averaged: alpha sum_i f_i P_i with
        f_i = E / (k T) (tokens counting i among ``experts``: their top k by affinity s for
        deepseek-v3, the experts they were routed to for v2) and P_i = mean over tokens of
        s_i / sum_j s_j.
        With ``real_tokens`` (b, t), T is a sequence's real tokens and P_i their mean; the
        average is over the sequences that have any (one of padding only adds nothing)."""
        b, t, _ = scores.shape
        chosen = torch.zeros_like(scores).scatter_(-1, experts, 1.0)  # (b, t, E)
        share = scores / scores.sum(dim=-1, keepdim=True)  # (b, t, E)
        if real_tokens is None:
            f = chosen.sum(dim=1) * self.n_experts / (self.top_k * t)  # (b, E)
            p = share.mean(dim=1)  # (b, E)
            return self.aux_coef * (f * p).sum(dim=-1).mean()
        real = real_tokens[..., None].to(scores.dtype)  # (b, t, 1)
        n = real.sum(dim=1)  # (b, 1) real tokens per sequence
        f = (chosen * real).sum(dim=1) * self.n_experts / (self.top_k * n.clamp(min=1))  # (b, E)
        p = (share * real).sum(dim=1) / n.clamp(min=1)  # (b, E)
        per_sequence = (f * p).sum(dim=-1)  # (b,): 0 for a sequence of padding only
        return self.aux_coef * per_sequence.sum() / (n > 0).sum().clamp(min=1)

    @torch.no_grad()
    def update_bias(self, frozen: bool = False) -> None:
        """Auxiliary-loss-free balancing (DeepSeek-V3): after an optimizer step, raise the
        bias of experts that took fewer tokens than the mean since the last call and lower
        the others by bias_update_speed; then start counting again. A no-op for routers
        without a bias (deepseek-v2), when no training pass ran, or ``frozen`` (the model
        is frozen while another module trains alone: DSA's warm-up stage)."""
        if frozen:
            self.load.zero_()
            return
        bias = self.gate.e_score_correction_bias
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(self.load)  # every process moves the bias alike
        # No `load.sum() > 0` test: a host read after every optimizer step on a GPU, and
        # without a training pass every load is 0, so every sign is 0 and the bias stays.
        if bias is not None:
            bias += self.bias_update_speed * torch.sign(self.load.mean() - self.load)
        self.load.zero_()

    # The trainer calls this on every module that has it, after each optimizer step, with
    # frozen=True while another module trains alone.
    after_optimizer_step = update_bias


def update_router_biases(model: nn.Module) -> int:
    """Call :meth:`MoE.update_bias` on every MoE layer of ``model`` (after each optimizer
    step); returns how many layers there were."""
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    for m in layers:
        m.update_bias()
    return len(layers)
