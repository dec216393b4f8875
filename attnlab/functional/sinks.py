"""Learned attention-sink logits (GPT-OSS): each head h has a logit s_h that joins every
query's softmax as one more column with no value,

    y = sum_j softmax([s_h, z_1, ..., z_S])_j v_j  =  attention(q, k, v) * sigmoid(lse(z) - s_h)

so a head can put weight "nowhere". ``attend(..., sinks=)`` takes them on every backend:
``eager`` writes the column out, ``flash`` and ``triton`` start each row's online softmax
from it, ``flex`` rescales with its own log-sum-exp. ``sdpa`` calls torch's fused kernel
directly, which returns its log-sum-exp: the CPU one (:class:`CpuSdpaSinks`) or, on a GPU,
FlashAttention-2 or the memory-efficient one (:class:`CudaSdpaSinks`); no (t, s) matrix,
forward or backward.
With dropout, or inputs those kernels do not take, it rescales with :func:`sink_rescale`,
which forms the (t, s) scores for their log-sum-exp.

Shapes: b batch, h heads, h_kv key/value heads, t queries, s keys, d_h head dim.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnlab.functional.softmax import score_operands, softmax_dtype

# Score elements formed at once when nothing needs gradients (64 MiB of float32): a prefill
# under no_grad rescales block by block of query rows instead of forming all (t, s) scores.
CHUNK_SCORES = 2**24


def sink_rescale(
    y: Tensor,
    q: Tensor,
    k: Tensor,
    sink: Tensor,
    mask: Tensor | None = None,
    *,
    causal: bool = False,
    scale: float | None = None,
) -> Tensor:
    """y (b, h, t, d_h) the attention output over keys k (b, h_kv, s, d_h) for queries q
    under ``mask`` (bool or additive, broadcastable to (b, h, t, s)) and bottom-right
    ``causal``; sink (h,) logits. Returns y scaled by each row's share left after the sink.
    With gradients the whole (b, h, t, s) score matrix is formed (autograd keeps it);
    without, blocks of query rows of at most ``CHUNK_SCORES`` scores."""
    b, h, t, d_h = q.shape
    s = k.shape[2]
    k = k.repeat_interleave(h // k.shape[1], dim=1) if k.shape[1] != h else k
    qs, ks = score_operands(q, k)  # float16 in float32: its products overflow
    scale = d_h**-0.5 if scale is None else scale
    grads = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or sink.requires_grad)
    rows = t if grads or torch.compiler.is_compiling() else max(1, CHUNK_SCORES // (b * h * s))
    shares = []
    for r0 in range(0, t, rows):
        r1 = min(t, r0 + rows)
        scores = softmax_dtype(qs[:, :, r0:r1] @ ks.transpose(-1, -2)) * scale  # (b, h, r, s)
        if mask is not None:
            m = mask[..., r0:r1, :] if mask.dim() >= 2 and mask.shape[-2] > 1 else mask
            scores = scores.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else scores + m
        if causal and t > 1:
            q_pos = torch.arange(s - t + r0, s - t + r1, device=q.device)[:, None]
            allowed = torch.arange(s, device=q.device)[None, :] <= q_pos  # (r, s), bottom-right
            scores = scores.masked_fill(~allowed, float("-inf"))
        lse = scores.logsumexp(-1, keepdim=True)  # (b, h, r, 1); -inf for rows with no key
        shares.append(torch.sigmoid(lse - sink.to(lse.dtype)[:, None, None]))
    share = shares[0] if len(shares) == 1 else torch.cat(shares, dim=2)  # (b, h, t, 1)
    return y * share.to(y.dtype)


class CpuSdpaSinks(torch.autograd.Function):
    """torch's fused CPU attention kernel with sink logits. Its forward returns each row's
    log-sum-exp L over the keys; with the sink column L' = logaddexp(L, sink), and the
    output is the kernel's times exp(L - L') = sigmoid(L - sink). Its backward recomputes
    the weights as exp(S - L) from the L it is handed: given L' and the rescaled output, it
    computes the gradients of attention with the sink column (the column has no value, so
    dP_sink = 0), exactly as ``flash`` does, and the sink's own gradient is
    -sum over rows of exp(sink - L') * D, D = rowsum(dy * y). No (t, s) matrix is kept.

    ``apply(q, k, v, sinks, mask, is_causal, scale)``: q (b, h, t, d_h), k and v
    (b, h_kv, s, d_h) (the kernel reads grouped heads itself), sinks (h,), ``mask`` None or
    additive in q's dtype, broadcastable to (b, h, t, s), with a key in every row;
    ``is_causal`` top-left aligned, as SDPA's. CPU tensors, no dropout."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, mask, is_causal, scale):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, is_causal, attn_mask=mask, scale=scale
        )  # lse (b, h, t): float32 for half-precision inputs
        lse_all = torch.logaddexp(lse, sinks.detach().to(lse.dtype)[:, None])
        y = out * torch.exp(lse - lse_all)[..., None].to(out.dtype)
        ctx.save_for_backward(q, k, v, y, lse_all, mask, sinks)
        ctx.is_causal, ctx.scale = is_causal, scale
        return y

    @staticmethod
    def backward(ctx, dy):
        q, k, v, y, lse_all, mask, sinks = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dy.contiguous(), q, k, v, y, lse_all, 0.0, ctx.is_causal, attn_mask=mask,
            scale=ctx.scale,
        )  # fmt: skip
        dsinks = None
        if ctx.needs_input_grad[3]:
            f = lse_all.dtype
            delta = (dy.to(f) * y.to(f)).sum(-1)  # (b, h, t)
            p_sink = torch.exp(sinks.detach().to(f)[:, None] - lse_all)  # (b, h, t)
            dsinks = (-p_sink * delta).sum((0, 2)).to(sinks.dtype)
        return dq, dk, dv, dsinks, None, None, None


# The memory-efficient CUDA kernel's alignment (elements) for the bias's row strides and,
# by element size, for the head dim (16 bytes)
BIAS_ALIGN = 16


def cuda_sinks_fit(q: Tensor) -> bool:
    """Whether :class:`CudaSdpaSinks` can take queries like q: a CUDA tensor of float32,
    float16 or bfloat16 whose head dim fills whole 16-byte vectors (the kernel's rule)."""
    fits = q.dtype in (torch.float32, torch.float16, torch.bfloat16)
    return q.device.type == "cuda" and fits and (q.shape[-1] * q.element_size()) % 16 == 0


@torch.compiler.assume_constant_result
def flash_kernel_fits(device: torch.device) -> bool:
    """Whether torch's FlashAttention-2 CUDA kernel runs on this GPU (Ampere or newer)."""
    return torch.cuda.get_device_capability(device) >= (8, 0)


def aligned_bias(mask: Tensor, shape: tuple[int, int, int, int]) -> Tensor:
    """An additive ``mask`` broadcastable to ``shape`` (b, h, t, s), as the CUDA kernel
    reads a bias: expanded to 4-D (broadcast dimensions keep stride 0, no copy), the last
    dimension contiguous and every other stride a multiple of ``BIAS_ALIGN``; copied into
    a key dimension padded to that multiple (and sliced back) only where it is not."""
    while mask.dim() < 4:
        mask = mask[None]
    full = mask.expand(shape)
    if full.stride(-1) == 1 and all(st % BIAS_ALIGN == 0 for st in full.stride()[:-1]):
        return full
    s = shape[-1]
    rows = (*mask.shape[:-1], -(-s // BIAS_ALIGN) * BIAS_ALIGN)
    padded = mask.new_zeros(rows)
    padded[..., :s] = mask
    return padded[..., :s].expand(shape)


class CudaSdpaSinks(torch.autograd.Function):
    """:class:`CpuSdpaSinks` on a GPU, with one of the two CUDA kernels behind
    ``F.scaled_dot_product_attention`` called for its log-sum-exp L: FlashAttention-2 for
    float16/bfloat16 without a mask (head dim at most 256, Ampere or newer), else the
    memory-efficient kernel (float32, or a mask). The same algebra: output times
    exp(L - L'), L' = logaddexp(L, sink), the kernel's backward handed L' and the rescaled
    output, the sink's gradient -sum exp(sink - L') * D. No (t, s) matrix is formed,
    forward or backward.

    ``apply(q, k, v, sinks, bias, is_causal, scale, flash)``: q, k, v (b, h, t or s, d_h)
    with as many key/value heads as query heads (the kernels read no groups), sinks (h,),
    ``bias`` None or additive in q's dtype from :func:`aligned_bias`, with a key in every
    row; ``is_causal`` top-left aligned; ``flash``: use FlashAttention-2 (no bias). Inputs
    that :func:`cuda_sinks_fit`; no dropout."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, bias, is_causal, scale, flash):
        t = q.shape[2]
        if flash:
            out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = (
                torch.ops.aten._scaled_dot_product_flash_attention(
                    q, k, v, 0.0, is_causal, False, scale=scale
                )
            )  # out (b, h, t, d_h); lse (b, h, t), float32
            lse_all = torch.logaddexp(lse, sinks.detach().to(lse.dtype)[:, None])
            yt = (out * torch.exp(lse - lse_all)[..., None].to(out.dtype)).transpose(1, 2)
            ctx.lengths = (cum_q, cum_k, max_q, max_k)
        else:
            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # the kernel's (b, t, h, d_h)
            mask_type = 1 if is_causal else 0  # 1: causal from the top left
            out, lse, seed, offset, _, _ = torch.ops.aten._efficient_attention_forward(
                qt, kt, vt, bias, None, None, None, None, 0.0, mask_type, True, scale=scale
            )  # out (b, t, h, d_h); lse (b, h, t rounded up to 32 rows), float32
            lse_all = torch.logaddexp(lse, sinks.detach().to(lse.dtype)[:, None])
            share = torch.exp(lse[..., :t] - lse_all[..., :t]).transpose(1, 2)  # (b, t, h)
            yt = out * share[..., None].to(out.dtype)
            ctx.mask_type = mask_type
        ctx.save_for_backward(q, k, v, yt, lse_all, bias, sinks, seed, offset)
        ctx.is_causal, ctx.scale, ctx.flash = is_causal, scale, flash
        return yt.transpose(1, 2)

    @staticmethod
    def backward(ctx, dy):
        q, k, v, yt, lse_all, bias, sinks, seed, offset = ctx.saved_tensors
        t = q.shape[2]
        dyt = dy.transpose(1, 2).contiguous()  # (b, t, h, d_h)
        if ctx.flash:
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                dyt.transpose(1, 2), q, k, v, yt.transpose(1, 2), lse_all, *ctx.lengths, 0.0,
                ctx.is_causal, seed, offset, scale=ctx.scale,
            )  # fmt: skip
        else:
            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
            dq, dk, dv, _ = torch.ops.aten._efficient_attention_backward(
                dyt, qt, kt, vt, bias, yt, None, None, t, k.shape[2], lse_all, 0.0,
                seed, offset, ctx.mask_type, False, scale=ctx.scale,
            )  # fmt: skip
            dq, dk, dv = dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
        dsinks = None
        if ctx.needs_input_grad[3]:
            f = lse_all.dtype
            delta = (dyt.to(f) * yt.to(f)).sum(-1).transpose(1, 2)  # (b, h, t)
            p_sink = torch.exp(sinks.detach().to(f)[:, None] - lse_all[..., :t])
            dsinks = (-p_sink * delta).sum((0, 2)).to(sinks.dtype)
        return dq, dk, dv, dsinks, None, None, None, None
