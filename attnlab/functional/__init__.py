"""Pure tensor maths: no parameters, the equations of attention."""

from attnlab.functional.attention import attend, eager_attention, sdpa_attention
from attnlab.functional.masks import causal_mask, combine_masks, padding_mask, to_additive
from attnlab.functional.rope import apply_rope, rope_angles
from attnlab.functional.softmax import masked_softmax, stable_softmax

__all__ = [
    "apply_rope",
    "attend",
    "causal_mask",
    "combine_masks",
    "eager_attention",
    "masked_softmax",
    "padding_mask",
    "rope_angles",
    "sdpa_attention",
    "stable_softmax",
    "to_additive",
]
