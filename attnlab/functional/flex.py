"""The ``flex`` backend: torch's FlexAttention (``torch.nn.attention.flex_attention``).

Masks are written as ``mask_mod(b, h, q_idx, kv_idx) -> bool`` functions, turned into a
block mask (which tiles to skip) by ``create_block_mask``; additive masks become a
``score_mod``. Causal aligns bottom-right like the rest of attnlab: query i sits at
position s - t + i.

Compilation: on CUDA ``flex_attention`` is wrapped in ``torch.compile`` (a fused kernel);
on CPU it runs eagerly by default, an unfused version that forms the (t, s) scores
(``compile=True`` asks for the fused CPU kernel, which costs a compile of tens of seconds).
FlexAttention has no backward on CPU (torch 2.13, eager or compiled): calling it there on
inputs that require grad fails at once with a message naming the alternatives.

Shapes: b batch, h heads, h_kv key/value heads, t query length, s key length, d_h head dim.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch
from torch import Tensor

from attnlab.functional.flash import check_sinks, check_softcap
from attnlab.functional.masks import additive_in

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]

NO_CPU_BACKWARD = (
    "attention backend 'flex' has no backward on CPU (a torch FlexAttention limitation); "
    "train with backend 'flash', 'sdpa' or 'eager', or run flex on CUDA"
)


def causal_mod(t: int, s: int) -> MaskMod:
    off = s - t
    return lambda b, h, q_idx, kv_idx: kv_idx <= q_idx + off


def sliding_window_mod(t: int, s: int, window: int) -> MaskMod:
    off = s - t
    return lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx + off) & (kv_idx > q_idx + off - window)


def document_mod(doc_ids: Tensor, t: int) -> MaskMod:
    """doc_ids (b, s): a query sees keys of its own document only (packed sequences)."""
    off = doc_ids.shape[-1] - t
    return lambda b, h, q_idx, kv_idx: doc_ids[b, q_idx + off] == doc_ids[b, kv_idx]


def prefix_lm_mod(t: int, s: int, prefix: int | Tensor) -> MaskMod:
    """Bidirectional over the first ``prefix`` positions (int, or (b,) tensor), causal after.
    Its ``reads`` names the indices it depends on (see :func:`flex_attention`)."""
    off = s - t
    if isinstance(prefix, Tensor):
        mod = lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx + off) | (kv_idx < prefix[b])  # noqa: E731
        mod.reads = ("b",)
    else:
        mod = lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx + off) | (kv_idx < prefix)  # noqa: E731
        mod.reads = ()
    return mod


def tensor_mod(allowed: Tensor) -> MaskMod:
    """A mask broadcastable to (b, h, t, s) as a mask_mod (bool; or values, for a score_mod):
    indexes its dimensions of size > 1, the others broadcast."""
    while allowed.dim() < 4:
        allowed = allowed[None]
    # Size-1 (broadcast) dimensions are dropped here, and the rest indexed by tensors only:
    # torch 2.10's vmap (create_block_mask runs the mod under it) cannot mix an int index
    # with tensor ones (it calls .item()).
    read = tuple(i for i, n in enumerate(allowed.shape) if n > 1)
    kept = allowed[tuple(slice(None) if n > 1 else 0 for n in allowed.shape)]
    if not read:  # one value for every (b, h, q_idx, kv_idx)
        return lambda b, h, q_idx, kv_idx: kept
    return lambda b, h, q_idx, kv_idx: kept[tuple((b, h, q_idx, kv_idx)[i] for i in read)]


def and_mods(*mods: MaskMod | None) -> MaskMod | None:
    mods = tuple(m for m in mods if m is not None)
    if not mods:
        return None

    def mod(b, h, q_idx, kv_idx):
        out = mods[0](b, h, q_idx, kv_idx)
        for m in mods[1:]:
            out = out & m(b, h, q_idx, kv_idx)
        return out

    return mod


# Whether torch has had its one unfused-flex warning (hidden by the first call).
_unfused_warned = False


@functools.cache
def _compiled():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: int | None = None,
    doc_ids: Tensor | None = None,
    mask_mod: MaskMod | None = None,
    compile: bool | None = None,
    sinks: Tensor | None = None,
    softcap: float | None = None,
) -> Tensor:
    """Attention through FlexAttention, equal to ``eager_attention``. ``mask`` bool or
    additive broadcastable to (b, h, t, s); ``mask_mod`` any extra mask function (e.g.
    ``prefix_lm_mod``); ``sinks`` (h,) sink logits, applied from FlexAttention's
    log-sum-exp L as out * sigmoid(L - sink); ``softcap``: a score_mod capping the scaled
    scores, softcap * tanh(score / softcap), before an additive mask's bias (Gemma 2).
    Rows that may attend to nothing give zeros."""
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    if q.device.type == "cpu":
        if not torch.is_grad_enabled():  # torch checks requires_grad even under no_grad
            q, k, v = q.detach(), k.detach(), v.detach()
        elif q.requires_grad or k.requires_grad or v.requires_grad:
            raise NotImplementedError(NO_CPU_BACKWARD)
    b, h, t, _ = q.shape
    h_kv, s = k.shape[1], k.shape[2]
    check_sinks(sinks, h)
    check_softcap(softcap)
    if causal and s < t:
        raise ValueError(f"causal attention: key length s={s} is shorter than query length t={t}")
    if t == 0 or s == 0:  # no query, or no key to attend to (block masks need both)
        return q.new_zeros(b, h, t, v.shape[-1])
    score_mod = None
    mask_from_tensor = None
    if mask is not None:
        if mask.dtype == torch.bool:
            mask_from_tensor = tensor_mod(mask)
        else:  # additive: -inf entries become a mask (so tiles can be skipped), the rest a bias
            # before the -inf test: -1e9 is no -inf in float16 (equal to eager, see additive_in)
            mask, saturated = additive_in(mask, q.dtype)
            if saturated is not None and bool(saturated.any()):
                raise ValueError(
                    f"flex attention: a mask row lies wholly below {q.dtype}'s range, whose "
                    "result depends on float32 scores; use backend 'eager' or 'sdpa', or a "
                    "bool mask"
                )
            mask_from_tensor = tensor_mod(mask > float("-inf"))
            bias = torch.where(mask > float("-inf"), mask, torch.zeros_like(mask))
            bias_at = tensor_mod(bias)
            score_mod = lambda score, b_, h_, q_, k_: score + bias_at(b_, h_, q_, k_)
    if softcap is not None:  # the cap first, then the bias (eager's order)
        score_mod = _capped(score_mod, softcap)
    structure = None
    if window is not None:
        structure = sliding_window_mod(t, s, window)
    elif causal:
        structure = causal_mod(t, s)
    docs = None if doc_ids is None else document_mod(doc_ids, t)
    mod = and_mods(structure, docs, mask_from_tensor, mask_mod)
    block_mask = None
    if mod is not None:
        # A mask_mod may read b or h (prefix_lm_mod with a (b,) prefix): a block mask built
        # for row 0 only would skip, or take as full, tiles that differ in other rows. One
        # that says which it reads (a ``reads`` attribute: "b", "h") gets only those: a
        # (b, h) block mask costs b h times the time and memory (5 s and 5 GB at b 8, h 16,
        # 2K x 2K on CPU, against 0.015 s for one).
        reads = getattr(mask_mod, "reads", ("b", "h")) if mask_mod is not None else ()
        per_batch = doc_ids is not None or "b" in reads or (mask is not None and _dim(mask, 0) > 1)
        per_head = "h" in reads or (mask is not None and _dim(mask, 1) > 1)
        block_mask = create_block_mask(
            mod, b if per_batch else None, h if per_head else None, t, s, device=q.device
        )
    use_compile = q.is_cuda if compile is None else compile
    fn = _compiled() if use_compile else torch_flex
    aux = {} if sinks is None else {"return_aux": AuxRequest(lse=True)}
    call = functools.partial(
        fn,
        q,
        k,
        v,
        score_mod=score_mod,
        block_mask=block_mask,
        scale=scale,
        enable_gqa=h != h_kv,
        **aux,
    )
    global _unfused_warned
    if use_compile or _unfused_warned:
        return _sink_share(call(), sinks)
    # Unfused on CPU is our choice (no compile time); torch warns about it once per
    # process, so only the first call hides it: catch_warnings resets every module's
    # warning registry (a caller's "default" warning would show again after each call)
    # and swaps the process-wide filters (not thread-safe).
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile")
        out = call()
    _unfused_warned = True
    return _sink_share(out, sinks)


def _capped(score_mod, softcap: float):
    """``score_mod`` (or none) after capping the score: softcap * tanh(score / softcap)."""

    def capped(score, b, h, q_idx, kv_idx):
        score = torch.tanh(score / softcap) * softcap
        return score if score_mod is None else score_mod(score, b, h, q_idx, kv_idx)

    return capped


def _sink_share(out, sinks: Tensor | None) -> Tensor:
    """FlexAttention's output, or (with sinks) its (output, aux) scaled by each row's share
    left after the sink column: sigmoid(L - sink); an empty row's L is -inf (share 0)."""
    if sinks is None:
        return out
    out, aux = out
    share = torch.sigmoid(aux.lse - sinks.to(aux.lse.dtype)[:, None])  # (b, h, t)
    return out * share[..., None].to(out.dtype)


def _dim(mask: Tensor, i: int) -> int:
    """Size of dim i of a mask broadcast to 4-D."""
    shape = (1,) * (4 - mask.dim()) + tuple(mask.shape)
    return shape[i]
