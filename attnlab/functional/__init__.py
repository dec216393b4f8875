"""Pure tensor maths: no parameters, the equations of attention."""

from attnlab.functional.attention import (
    BACKENDS,
    attend,
    available_backends,
    backend_names,
    eager_attention,
    sdpa_attention,
)
from attnlab.functional.flash import flash_attention
from attnlab.functional.masks import (
    causal_mask,
    combine_masks,
    document_ids,
    document_mask,
    document_positions,
    padding_mask,
    prefix_lm_mask,
    sliding_window_mask,
    to_additive,
)
from attnlab.functional.rope import apply_rope, rope_angles
from attnlab.functional.softmax import (
    attention_online,
    masked_softmax,
    softmax_3pass,
    softmax_online,
    stable_softmax,
)

__all__ = [
    "BACKENDS",
    "apply_rope",
    "attend",
    "attention_online",
    "available_backends",
    "backend_names",
    "causal_mask",
    "combine_masks",
    "document_ids",
    "document_mask",
    "document_positions",
    "eager_attention",
    "flash_attention",
    "masked_softmax",
    "padding_mask",
    "prefix_lm_mask",
    "rope_angles",
    "sdpa_attention",
    "sliding_window_mask",
    "softmax_3pass",
    "softmax_online",
    "stable_softmax",
    "to_additive",
]
