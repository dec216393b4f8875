"""Causal linear attention (Katharopoulos et al. 2020, "Transformers are RNNs").

Softmax attention's similarity exp(q.k) is replaced by phi(q).phi(k) with the feature map
phi(x) = elu(x) + 1 (positive), so

    y_i = phi(q_i)^T S_i / (phi(q_i)^T z_i),   S_i = sum_{j<=i} phi(k_j) v_j^T,
                                               z_i = sum_{j<=i} phi(k_j)          (eq. 5-9)

and a sequence is an RNN whose state (S, z) has a constant size, d_h x d_v + d_h per head.

RoPE (RoFormer, Su et al. 2021, section 3.3): the numerator uses rotated features
R_i phi(q_i), R_j phi(k_j); the denominator the unrotated ones, so it stays positive.
Without RoPE both are the same.

Training and prefill use the chunked form: within a chunk of c tokens a c x c masked
product, across chunks the running state, so no t x t matrix is ever built.

Shapes: b batch, h heads, h_kv key/value heads, t length, d_h head dim, d_v value dim.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnlab.functional.softmax import compute_dtype

EPS = 1e-6  # added to the normaliser (as the paper's code): rows with no key give 0, not NaN


def elu_feature_map(x: Tensor) -> Tensor:
    """phi(x) = elu(x) + 1 > 0, as x + 1 (x > 0) and exp(x): elu(x) + 1 cancels for
    negative x (elu near -1, rounded in x's dtype, then + 1): in bf16 every phi below 0.004
    came out 0 or a multiple of 0.004 (outputs off by 4.5% for x ~ N(-5, 1))."""
    return torch.where(x > 0, x + 1.0, torch.exp(x.clamp(max=0.0)))


def _repeat(x: Tensor, n_rep: int) -> Tensor:
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)  # (b, h, ...)


def _as(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x`` in ``dtype``; no call at all where it already is (float32 decoding runs this
    path once per token and layer: seven no-op ``.to`` calls cost ~15% of it)."""
    return x if x.dtype == dtype else x.to(dtype)


def causal_linear_attention(
    q_num: Tensor,
    k_num: Tensor,
    v: Tensor,
    q_den: Tensor,
    k_den: Tensor,
    state: tuple[Tensor, Tensor] | None = None,
    *,
    chunk_size: int = 64,
    eps: float = EPS,
) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """Chunked causal linear attention over t tokens that follow ``state``.

    q_num, q_den (b, h, t, d_h): query features for the numerator / the normaliser;
    k_num, k_den (b, h_kv, t, d_h), v (b, h_kv, t, d_v): key features and values, already
    zero at padded positions (so they add nothing to the state). ``state`` (S, z):
    S (b, h_kv, d_h, d_v), z (b, h_kv, d_h) of the tokens before (None: zeros).
    Returns y (b, h, t, d_v) and the state after the t tokens.

    The state is a sum over every token so far, kept in float32 for half-precision inputs
    (float64 kept): in bf16, z of a few thousand tokens stops growing (its spacing there,
    8 or 16, swallows each token's phi(k) of about 1) and decoding one token at a time
    drifts far from the chunked pass. float16 inputs are raised to float32 throughout: the
    chunk's products phi(q) . phi(k) and their sums (the normaliser) pass 65504 with
    features of about 10 (inf / inf: NaN rows) where decoding, from the float32 state, did
    not; bfloat16 shares float32's range and keeps its products. Under float16 autocast
    (which would run those products in float16 again: normalisers of ~750 tokens of
    d_h = 64 became inf and their rows 0) autocast is turned off here, for the same reason."""
    device = q_num.device.type
    # (the meta device has no autocast; torch.amp.is_autocast_available would say so, but
    # torch 2.11's compiler cannot trace it)
    if (
        device != "meta"
        and torch.is_autocast_enabled(device)
        and torch.get_autocast_dtype(device) == torch.float16
    ):
        with torch.autocast(device, enabled=False):
            return causal_linear_attention(
                q_num, k_num, v, q_den, k_den, state, chunk_size=chunk_size, eps=eps
            )
    out_dtype = q_num.dtype
    if out_dtype == torch.float16:
        q_num, k_num, v, q_den, k_den = (x.float() for x in (q_num, k_num, v, q_den, k_den))
    b, h, t, d_h = q_num.shape
    h_kv, d_v = k_num.shape[1], v.shape[-1]
    n_rep = h // h_kv
    acc = compute_dtype(q_num.dtype)  # the state's dtype, and the cross-chunk terms'
    if state is None:
        S = q_num.new_zeros(b, h_kv, d_h, d_v, dtype=acc)
        z = q_num.new_zeros(b, h_kv, d_h, dtype=acc)
    else:
        S, z = (_as(x, torch.promote_types(x.dtype, acc)) for x in state)
    ys = []
    for i in range(0, t, chunk_size):
        sl = slice(i, min(i + chunk_size, t))
        qn, qd = q_num[:, :, sl], q_den[:, :, sl]  # (b, h, c, d_h)
        kn, kd, vc = k_num[:, :, sl], k_den[:, :, sl], v[:, :, sl]  # (b, h_kv, c, .)
        c = qn.shape[2]
        tril = torch.ones(c, c, dtype=torch.bool, device=qn.device).tril()
        # Inside the chunk: the masked c x c product (the quadratic form, small).
        scores = (qn @ _repeat(kn, n_rep).transpose(-1, -2)).masked_fill(~tril, 0.0)
        weights = (qd @ _repeat(kd, n_rep).transpose(-1, -2)).masked_fill(~tril, 0.0)
        past = _as(qn, S.dtype) @ _repeat(S, n_rep)  # (b, h, c, d_v): tokens before the chunk
        num = _as(scores @ _repeat(vc, n_rep), S.dtype) + past
        den_past = (_as(qd, z.dtype) @ _repeat(z, n_rep)[..., None]).squeeze(-1)  # (b, h, c)
        den = _as(weights.sum(-1), z.dtype) + den_past
        ys.append(_as(num / (den[..., None] + eps), out_dtype))
        # The chunk joins the state: S += phi(K)^T V, z += sum phi(K).
        S = S + _as(kn.transpose(-1, -2), S.dtype) @ _as(vc, S.dtype)  # (b, h_kv, d_h, d_v)
        z = z + _as(kd, z.dtype).sum(2)  # (b, h_kv, d_h)
    y = torch.cat(ys, dim=2) if ys else q_num.new_zeros(b, h, 0, d_v, dtype=out_dtype)
    return y, (S, z)
