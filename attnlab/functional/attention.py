"""Scaled dot-product attention: softmax(Q K^T / sqrt(d_h) + mask) V (Vaswani et al. 2017).

One signature, several backends, picked by name from ``BACKENDS`` (``attend(backend=...)``,
config ``model.attention.backend``): ``eager`` is the readable reference (and can return
the attention weights); ``sdpa`` calls ``torch.nn.functional.scaled_dot_product_attention``;
``flash`` is tiled online-softmax attention in PyTorch (``functional/flash.py``), which
runs the Triton kernels on CUDA; ``triton`` asks for those kernels (``attnlab/kernels``);
``flex`` is torch's FlexAttention (``functional/flex.py``).

``sinks`` (h,): learned sink logits (GPT-OSS), one more softmax column per head with no
value, so a head can put weight nowhere. ``eager`` writes the column out; ``flash`` and
``triton`` start each row's online softmax from it (no (t, s) matrix); ``flex`` rescales
its output by the share its log-sum-exp leaves; ``sdpa`` rescales too, with the
log-sum-exp torch's fused CPU kernel returns, or elsewhere by forming the scores
(``functional/sinks.py``).

Shapes: b batch, h query heads, h_kv key/value heads (h_kv divides h), t query length,
s key length, d_h head dim. Masks broadcast to (b, h, t, s); boolean True = may attend,
or additive (0 / -inf). ``causal=True`` aligns query i with key s - t + i (bottom-right),
which is what a KV cache and chunked prefill need.

``softcap`` (Gemma 2): the scores after the scale become cap * tanh(scores / cap) before
the mask, so no logit leaves (-cap, cap). ``eager``, ``flash`` (its tiles, and a backward
that multiplies dS by the cap's derivative 1 - tanh^2), ``triton`` (the same in the
kernels, which ``flash`` runs on CUDA) and ``flex`` (a score_mod) take it; ``sdpa`` cannot
and refuses it (``SOFTCAP_BACKENDS``).

``recording_weights(sink)``: inside, every ``attend`` call runs ``eager`` whatever the
backend asked for and hands its softmax weights to ``sink`` (how ``attnlab.attention_maps``
reads a whole model's attention without a flag in any module).
"""

from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab.functional.flash import (
    check_doc_ids,
    check_keys,
    check_sinks,
    check_softcap,
    flash_attention,
    heads_error,
)
from attnlab.functional.masks import (
    additive_in,
    causal_mask,
    check_mask_dtype,
    check_mask_shape,
    combine_masks,
    document_mask,
    sliding_window_mask,
)
from attnlab.functional.sinks import (
    CpuSdpaSinks,
    CudaSdpaSinks,
    aligned_bias,
    cuda_sinks_fit,
    flash_kernel_fits,
    sink_rescale,
)
from attnlab.functional.softmax import masked_softmax, score_operands, softmax_dtype


def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """(b, h_kv, s, d_h) -> (b, h_kv * n_rep, s, d_h): query head j reads kv head j // n_rep."""
    if n_rep == 1:
        return x
    b, h_kv, s, d = x.shape
    return x[:, :, None].expand(b, h_kv, n_rep, s, d).reshape(b, h_kv * n_rep, s, d)


def _check(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    dropout_p: float = 0.0,
    sinks: Tensor | None = None,
) -> int:
    if not 0.0 <= dropout_p <= 1.0:  # NaN fails too; a negative p dropped nothing, silently
        raise ValueError(f"dropout_p must be a probability in [0, 1], got {dropout_p}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"attention expects (b, h, t, d_h) tensors, got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    h, h_kv = q.shape[1], k.shape[1]
    if h % h_kv or v.shape[1] != h_kv:
        raise ValueError(heads_error(h, h_kv, v.shape[1]))
    check_keys(q, k, v)
    check_mask_dtype(mask)
    check_mask_shape(mask, (q.shape[0], h, q.shape[2], k.shape[2]))
    check_sinks(sinks, h)
    return h // h_kv


def eager_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    *,
    causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    return_weights: bool = False,
    sinks: Tensor | None = None,
    softcap: float | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """The reference: every step written out. Fully masked rows give zero output.
    ``sinks`` (h,): each row's softmax gets one more column, the head's sink logit, which
    is then dropped (its value is zero): the weights sum to less than 1. ``softcap``:
    scores -> softcap * tanh(scores / softcap) after the scale, before the mask (Gemma 2)."""
    n_rep = _check(q, k, v, mask, dropout_p, sinks)
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)  # (b, h, s, d_h)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if causal:
        mask = combine_masks(mask, causal_mask(q.shape[-2], k.shape[-2], device=q.device))
    qs, ks = score_operands(q, k)  # float16 in float32: its products overflow
    scores = softmax_dtype((qs @ ks.transpose(-2, -1)) * scale)  # (b, h, t, s)
    if softcap is not None:  # in transformers' order: / cap, tanh, * cap
        scores = torch.tanh(scores / softcap) * softcap
    if sinks is None:
        weights = masked_softmax(scores, mask).to(q.dtype)
    else:
        if mask is not None:  # the sink column is never masked
            scores = (
                scores.masked_fill(~mask, float("-inf"))
                if mask.dtype == torch.bool
                else scores + mask
            )
        b, h, t = scores.shape[0], q.shape[1], q.shape[2]
        column = sinks.to(scores.dtype)[:, None, None].expand(b, h, t, 1)
        weights = masked_softmax(torch.cat((scores, column), -1), None)[..., :-1].to(q.dtype)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    out = weights @ v  # (b, h, t, d_h)
    return (out, weights) if return_weights else out


def sdpa_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    *,
    causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    sinks: Tensor | None = None,
) -> Tensor:
    """torch's fused kernel, with two fixes: bottom-right causal alignment when t != s,
    and zeros (not NaN) for query rows that may attend to nothing. ``sinks``: without
    dropout, the kernel's own log-sum-exp rescales the output: torch's CPU kernel
    (:class:`CpuSdpaSinks`) or, on a GPU, FlashAttention-2 or the memory-efficient kernel
    (:class:`CudaSdpaSinks`: float32/float16/bfloat16, a head dim of whole 16-byte
    vectors); otherwise
    :func:`sink_rescale` does, forming the scores (``F.scaled_dot_product_attention``
    returns no log-sum-exp)."""
    n_rep = _check(q, k, v, mask, dropout_p, sinks)
    # (the kernels' backward gives the mask no gradient: a learned bias takes the rescale)
    mask_grad = mask is not None and mask.requires_grad
    fused = q.device.type == "cpu" or cuda_sinks_fit(q)
    if sinks is not None and (not fused or dropout_p > 0.0 or mask_grad):
        out = sdpa_attention(q, k, v, mask, causal=causal, scale=scale, dropout_p=dropout_p)
        return sink_rescale(out, q, k, sinks, mask, causal=causal, scale=scale)
    t, s = q.shape[-2], k.shape[-2]
    while mask is not None and mask.dim() < 2:  # a key mask (s,): torch's SDPA wants >= 2-D
        mask = mask[None]
    causal = causal and t > 1  # one query is the newest position: it may see every key
    # A branch, not the expression: under dynamic shapes t == s is a SymBool (bool() keeps
    # it one), which SDPA's is_causal rejects: a graph break at every call
    is_causal = True if causal and mask is None and t == s else False
    if causal and not is_causal:
        mask = combine_masks(mask, causal_mask(t, s, device=q.device))
    keep = None
    if mask is not None:
        if mask.dtype != torch.bool:
            # before ``keep``: a finite float32 value out of float16's range would become -inf
            # in SDPA's cast and empty a row that eager (and ``keep``) sees as allowed
            narrowed, saturated = additive_in(mask, q.dtype)
            if saturated is not None and bool(saturated.any()):
                # a row wholly below float16's range: whether its offset swamps the scores
                # (-1e9: uniform weights) or not (-1e5: softmax of the scores) depends on the
                # float32 scores themselves, which only eager forms (one host read, float16
                # queries with a wider mask only)
                return eager_attention(q, k, v, mask, scale=scale, dropout_p=dropout_p, sinks=sinks)  # type: ignore[return-value]
            mask = narrowed
        allowed = mask if mask.dtype == torch.bool else mask > float("-inf")
        keep = allowed.any(dim=-1, keepdim=True)  # (.., t, 1): rows with some key
        # Eager on the CPU: look (one host read) and skip the fix-up when every row has a
        # key. Compiled, or on a GPU: always fix up (the same result where every row has
        # a key), so the graph has no data-dependent branch and a GPU does not wait for
        # the host in every masked layer (each decoding step of a padded batch or of a
        # windowed layer, the static cache's every step).
        look = not torch.compiler.is_compiling() and q.device.type == "cpu"
        if not look or not bool(keep.all()):
            # Let empty rows attend everywhere (finite), then zero their output. An additive
            # mask keeps its finite values (e.g. a bias) on the other rows.
            if mask.dtype == torch.bool:
                mask = allowed | ~keep
            else:
                mask = torch.where(keep, mask, mask.new_zeros(()))
        else:
            keep = None
    if sinks is not None:  # the kernel itself, for its log-sum-exp
        if mask is not None and mask.dtype == torch.bool:  # it takes additive masks only
            mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(
                ~mask, float("-inf")
            )
        if q.device.type == "cpu":
            out = CpuSdpaSinks.apply(q, k, v, sinks, mask, is_causal, scale)
        else:  # the CUDA kernel reads no grouped heads, and a bias only aligned
            k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
            bias = None if mask is None else aligned_bias(mask, (*q.shape[:3], s))
            flash = (
                bias is None
                and q.dtype in (torch.float16, torch.bfloat16)
                and q.shape[-1] <= 256
                and flash_kernel_fits(q.device)
            )
            out = CudaSdpaSinks.apply(q, k, v, sinks, bias, is_causal, scale, flash)
    else:
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=n_rep > 1,
        )
    if keep is not None:
        out = out * keep.to(out.dtype)
    return out


# ---------------------------------------------------------------------------- registry


def _fold_structure(
    mask: Tensor | None,
    t: int,
    s: int,
    causal: bool,
    window: int | None,
    doc_ids: Tensor | None,
    device: torch.device,
) -> tuple[Tensor | None, bool]:
    """For backends without native support: window and documents become an explicit mask."""
    if window is not None:
        mask = combine_masks(mask, sliding_window_mask(t, s, window, device=device))
        causal = False  # the window mask is causal already
    if doc_ids is not None:
        mask = combine_masks(mask, document_mask(doc_ids, t))
    return mask, causal


def _eager(q, k, v, mask, *, causal, scale, dropout_p, window, doc_ids, sinks, softcap):
    mask, causal = _fold_structure(
        mask, q.shape[-2], k.shape[-2], causal, window, doc_ids, q.device
    )
    return eager_attention(
        q,
        k,
        v,
        mask,
        causal=causal,
        scale=scale,
        dropout_p=dropout_p,
        sinks=sinks,
        softcap=softcap,
    )


def _sdpa(q, k, v, mask, *, causal, scale, dropout_p, window, doc_ids, sinks, softcap):
    if softcap is not None:
        raise ValueError(softcap_refusal("sdpa"))
    mask, causal = _fold_structure(
        mask, q.shape[-2], k.shape[-2], causal, window, doc_ids, q.device
    )
    return sdpa_attention(
        q, k, v, mask, causal=causal, scale=scale, dropout_p=dropout_p, sinks=sinks
    )


def _triton_takes(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> bool:
    """Whether ``flash`` may hand these tensors to the Triton kernels (soft-capped or not:
    they cap the scores as the tiled twin does): CUDA, one head dim for q, k and v (not
    MLA's narrower values), one dtype the kernels take (float64 went to the kernels on CUDA,
    which refused it, instead of to the tiled twin), and no float64 mask (the kernels add a
    float32 bias; the tiled twin widens its scores as eager does)."""
    return (
        q.is_cuda
        and v.shape[-1] == q.shape[-1] == k.shape[-1]
        and q.dtype in (torch.float32, torch.float16, torch.bfloat16)
        and q.dtype == k.dtype == v.dtype
        and (mask is None or mask.dtype != torch.float64)
    )


def _flash(q, k, v, mask, *, causal, scale, dropout_p, window, doc_ids, sinks, softcap):
    from attnlab import kernels

    kw = dict(
        causal=causal, scale=scale, window=window, doc_ids=doc_ids, sinks=sinks, softcap=softcap
    )
    if _triton_takes(q, k, v, mask) and kernels.triton_available():
        return kernels.triton_attention(q, k, v, mask, **kw)
    return flash_attention(q, k, v, mask, **kw)


def _triton(q, k, v, mask, *, causal, scale, dropout_p, window, doc_ids, sinks, softcap):
    from attnlab import kernels

    return kernels.triton_attention(
        q,
        k,
        v,
        mask,
        causal=causal,
        scale=scale,
        window=window,
        doc_ids=doc_ids,
        sinks=sinks,
        softcap=softcap,
    )


def _flex(q, k, v, mask, *, causal, scale, dropout_p, window, doc_ids, sinks, softcap):
    from attnlab.functional.flex import flex_attention

    return flex_attention(
        q,
        k,
        v,
        mask,
        causal=causal,
        scale=scale,
        window=window,
        doc_ids=doc_ids,
        sinks=sinks,
        softcap=softcap,
    )


def _triton_missing() -> str | None:
    from attnlab import kernels

    return kernels.triton_unavailable_reason()


@dataclass(frozen=True)
class Backend:
    """One way to compute attention. ``fn(q, k, v, mask, *, causal, scale, dropout_p,
    window, doc_ids, sinks, softcap)``; ``dropout`` says whether it implements
    dropout_p > 0, ``softcap`` whether it caps the scores; ``unavailable()`` returns why it
    cannot run here, or None."""

    fn: Callable[..., Tensor]
    summary: str
    dropout: bool = False
    softcap: bool = True
    unavailable: Callable[[], str | None] = lambda: None


BACKENDS: dict[str, Backend] = {
    "eager": Backend(_eager, "readable reference; the only one that returns weights", True),
    "sdpa": Backend(_sdpa, "torch.nn.functional.scaled_dot_product_attention", True, softcap=False),
    "flash": Backend(_flash, "tiled online softmax in PyTorch (Triton kernel on CUDA)"),
    "triton": Backend(_triton, "Triton flash-attention kernels", unavailable=_triton_missing),
    "flex": Backend(_flex, "torch FlexAttention (no backward on CPU)"),
}
# the backends that take soft-capped scores (attention.softcap)
SOFTCAP_BACKENDS = tuple(name for name, b in BACKENDS.items() if b.softcap)


def softcap_refusal(backend: str) -> str:
    """The one-line refusal of soft-capping by a backend that cannot cap the scores."""
    *first, last = map(repr, SOFTCAP_BACKENDS)
    return (
        f"attention.softcap (logit soft-capping) needs backend {', '.join(first)} or {last}; "
        f"{backend!r} cannot cap the scores"
    )


# Where attend() hands its weights while recording (None: not recording).
_WEIGHT_SINK: ContextVar[Callable[[Tensor], None] | None] = ContextVar(
    "attnlab_attention_weight_sink", default=None
)


@contextlib.contextmanager
def recording_weights(sink: Callable[[Tensor], None]) -> Iterator[None]:
    """Inside the block, every :func:`attend` call computes with the ``eager`` backend
    (whatever backend it names) and calls ``sink(weights)`` with its softmax weights
    (b, h, t, s). Attention written without ``attend`` is not seen."""
    token = _WEIGHT_SINK.set(sink)
    try:
        yield
    finally:
        _WEIGHT_SINK.reset(token)


def hand_over_weights(weights: Callable[[], Tensor]) -> None:
    """For :func:`recording_weights`: the softmax weights (b, h, t, s) an attention formed
    without :func:`attend` (MLA's absorbed path, DSA's gathered keys), made by
    ``weights()`` only while recording (not when compiled)."""
    sink = None if torch.compiler.is_compiling() else _WEIGHT_SINK.get()
    if sink is not None:
        sink(weights())


def backend_names() -> tuple[str, ...]:
    """Every registered backend name (configs are validated against this)."""
    return tuple(BACKENDS)


def available_backends() -> tuple[str, ...]:
    """The backends that can run on this machine (``triton`` needs the package and a GPU
    or ``TRITON_INTERPRET=1``)."""
    return tuple(name for name, b in BACKENDS.items() if b.unavailable() is None)


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    *,
    causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    backend: str = "sdpa",
    return_weights: bool = False,
    window: int | None = None,
    doc_ids: Tensor | None = None,
    sinks: Tensor | None = None,
    softcap: float | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention with the chosen backend, the one switch between implementations.

    q (b, h, t, d_h); k, v (b, h_kv, s, d_h); ``mask`` bool or additive, broadcastable to
    (b, h, t, s). ``causal`` aligns bottom-right. ``window`` (with causal): each query sees
    its last ``window`` keys. ``doc_ids`` (b, s): no attention across packed documents.
    ``flash`` and ``triton`` skip whole blocks that window and sorted documents rule out;
    ``eager`` and ``sdpa`` turn them into masks. ``sinks`` (h,): learned sink logits, a
    softmax column per head with no value (the weights then sum to less than 1).
    ``softcap``: scores -> softcap * tanh(scores / softcap) before the mask (Gemma 2;
    ``SOFTCAP_BACKENDS`` only). ``return_weights`` needs ``eager`` (or
    :func:`recording_weights`, which makes every
    call eager)."""
    if backend not in BACKENDS:
        raise ValueError(
            f"unknown attention backend {backend!r}; choose one of {', '.join(BACKENDS)}"
        )
    entry = BACKENDS[backend]
    _check(q, k, v, mask, dropout_p, sinks)
    check_doc_ids(doc_ids, q.shape[0], q.shape[2], k.shape[2])
    # a number of keys (a float w keeps the keys k > p - w, as every backend reads it)
    if isinstance(window, bool) or not isinstance(window, (numbers.Real, type(None))):
        raise ValueError(f"window must be a number of keys, got {window!r}")
    if window is not None and (not causal or window <= 0):
        raise ValueError(f"window={window} needs causal=True and a positive size")
    check_softcap(softcap)
    if softcap is not None and not entry.softcap:
        raise ValueError(softcap_refusal(backend))
    # Compiled graphs never record (and dynamo cannot trace ContextVar.get).
    sink = None if torch.compiler.is_compiling() else _WEIGHT_SINK.get()
    if return_weights or sink is not None:
        if sink is None and backend != "eager":
            raise ValueError(
                f"return_weights=True needs backend='eager' ({backend!r} never forms the weights)"
            )
        mask, causal = _fold_structure(
            mask, q.shape[-2], k.shape[-2], causal, window, doc_ids, q.device
        )
        out, weights = eager_attention(
            q,
            k,
            v,
            mask,
            causal=causal,
            scale=scale,
            dropout_p=dropout_p,
            return_weights=True,
            sinks=sinks,
            softcap=softcap,
        )
        if sink is not None:
            sink(weights)
        return (out, weights) if return_weights else out
    if dropout_p > 0.0 and not entry.dropout:
        raise ValueError(
            f"attention dropout needs backend 'eager' or 'sdpa' ({backend!r} has none); "
            "set model.attention.dropout=0 or change the backend"
        )
    return entry.fn(
        q,
        k,
        v,
        mask,
        causal=causal,
        scale=scale,
        dropout_p=dropout_p,
        window=window,
        doc_ids=doc_ids,
        sinks=sinks,
        softcap=softcap,
    )
