"""Group arithmetic of one averaging round: who reduces which part, and whose weight counts.

Pure functions of the group the leader formed, so that every member computes the same parts
from the same group message.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


def part_blocks(total_blocks: int, bandwidths: Sequence[float]) -> list[tuple[int, int]]:
    """Split ``total_blocks`` codec blocks into one contiguous part per member.

    Part sizes are proportional to the declared bandwidths (largest-remainder rounding, ties
    to the earlier member); a member with bandwidth 0 (client mode) gets an empty part.
    Returns ``(first_block, blocks)`` per member, in member order, covering every block once.
    """
    if total_blocks < 0:
        raise ValueError("total_blocks must be non-negative")
    if any(not math.isfinite(b) or b < 0 for b in bandwidths):
        raise ValueError(f"bandwidths must be finite and non-negative, got {list(bandwidths)}")
    total_bw = sum(bandwidths)
    if total_bw <= 0:
        raise ValueError("at least one member must serve a part (all bandwidths are 0)")
    exact = [total_blocks * b / total_bw for b in bandwidths]
    sizes = [math.floor(e) for e in exact]
    left = total_blocks - sum(sizes)
    order = sorted(range(len(exact)), key=lambda i: (-(exact[i] - sizes[i]), i))
    for i in order[:left]:
        sizes[i] += 1
    parts, first = [], 0
    for size in sizes:
        parts.append((first, size))
        first += size
    return parts


def weight_violations(weights: Sequence[float], cap_multiple: float) -> dict[int, str]:
    """Members whose declared weight is not acceptable, with the reason.

    A weight must be finite and positive, and at most ``cap_multiple`` times the median of
    the group's valid weights (so one peer cannot claim the round for itself).
    """
    reasons: dict[int, str] = {}
    valid = []
    for i, w in enumerate(weights):
        if not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0:
            reasons[i] = f"weight {w!r} is not a finite positive number"
        else:
            valid.append(w)
    if valid and cap_multiple > 0:
        cap = cap_multiple * statistics.median(valid)
        for i, w in enumerate(weights):
            if i not in reasons and w > cap:
                reasons[i] = f"weight {w:g} exceeds {cap_multiple:g} x the group median ({cap:g})"
    return reasons
