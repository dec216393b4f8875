"""T5's relative position buckets (Raffel et al. 2020, Sec. 2.1; Mesh TensorFlow's
``_relative_position_bucket``): a key at relative position r = key - query falls in one of
``num_buckets`` buckets, one per distance below ``max_exact`` and logarithmically wider ones
up to ``max_distance``, beyond which every distance shares the last bucket.

    bidirectional (encoder): half the buckets for r > 0, half for r <= 0; n = |r|
    unidirectional (decoder): n = max(-r, 0) (later keys, masked anyway, share bucket 0)
    max_exact = buckets / 2 (of the half, bidirectional)
    bucket(n) = n                                                    n < max_exact
              = min(max_exact + floor(ln(n / max_exact) / ln(max_distance / max_exact)
                                      * (buckets - max_exact)), buckets - 1)   otherwise

Shapes: any; the buckets have the shape of the relative positions.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def relative_buckets(
    relative: Tensor, *, bidirectional: bool, num_buckets: int, max_distance: int
) -> Tensor:
    """The bucket (long, in [0, num_buckets)) of each relative position ``relative`` (long,
    key - query). The logarithm is taken in float32, as transformers' T5 takes it, so the
    bucket edges fall on the same distances."""
    buckets = torch.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative > 0).long() * num_buckets
        distance = relative.abs()
    else:
        distance = (-relative).clamp(min=0)
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    # clamp: ln(0) would be -inf, whose cast to long is undefined (the small branch wins there)
    far = distance.clamp(min=max_exact).float()
    large = (
        max_exact
        + (
            torch.log(far / max_exact)
            / math.log(max_distance / max_exact)
            * (num_buckets - max_exact)
        ).long()
    )
    large = large.clamp(max=num_buckets - 1)
    return buckets + torch.where(is_small, distance, large)


def log_bucket_positions(relative: Tensor, *, buckets: int, max_distance: int) -> Tensor:
    """DeBERTa's log-bucketed relative positions (He et al. 2021, DeBERTa-v2's
    ``make_log_bucket_position``): ``relative`` (long, query - key) kept as it is within
    ``mid = buckets // 2`` of zero, and beyond it compressed logarithmically with its sign,

        bucket(r) = r                                                          |r| <= mid
                  = sign(r) (mid + ceil(ln(|r| / mid) / ln((max_distance - 1) / mid)
                                        * (mid - 1)))                           otherwise

    so that |r| = max_distance - 1 lands on 2 mid - 1 and farther distances keep growing
    slowly (the caller clamps them to its table). The logarithms are float32, as
    transformers takes them, so the bucket edges fall on the same distances. Returns long,
    the shape of ``relative``; odd: bucket(-r) = -bucket(r)."""
    mid = buckets // 2
    sign = torch.sign(relative)
    # |r| < mid takes the exact branch; mid - 1 there only keeps the logarithm finite
    far = torch.where(relative.abs() < mid, torch.full_like(relative, mid - 1), relative.abs())
    span = torch.log(torch.tensor((max_distance - 1) / mid, dtype=torch.float32))
    log_pos = torch.ceil(torch.log(far / mid) / span * (mid - 1)) + mid  # float32
    return torch.where(far <= mid, relative.float(), log_pos * sign).long()
