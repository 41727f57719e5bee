"""Group arithmetic of one averaging round: who reduces which part, and whose weight counts.

Pure functions of the group the leader formed, so that every member computes the same parts
from the same group message.
"""

from __future__ import annotations

import math
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


BANDWIDTH_CAP_MULTIPLE = 4.0
"""No member's part is cut by more than this many times the lower median of the serving
members' declared bandwidths."""


def part_bandwidths(declared: Sequence[float]) -> list[float]:
    """What the parts are cut by: each serving member's declared bandwidth (0: it serves
    none), at most :data:`BANDWIDTH_CAP_MULTIPLE` times the lower median of the serving
    members'. A declaration is the member's own word: uncapped, one claim of 1e300 would
    make its member the reducer of nearly every part, and so of nearly the whole mean. The
    lower median, so that in a group of two the other member cannot lift the cap with its
    own claim."""
    serving = sorted(b for b in declared if b > 0)
    if not serving:
        return list(declared)
    cap = BANDWIDTH_CAP_MULTIPLE * serving[(len(serving) - 1) // 2]
    return [min(b, cap) for b in declared]


def weight_violations(weights: Sequence[float]) -> dict[int, str]:
    """Members whose declared weight is no weight at all, with the reason: a weight must be
    a finite positive number. (A weight far above the others' is capped, not refused:
    :func:`capped_weights`.)"""
    return {
        i: f"weight {w!r} is not a finite positive number"
        for i, w in enumerate(weights)
        if not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0
    }


def weight_cap(weights: Sequence[float], cap_multiple: float) -> float:
    """The largest weight a member counts with: ``cap_multiple`` times the lower median of
    the valid ``weights`` (``inf`` when ``cap_multiple`` is 0). The lower median, so that
    in a group of two the heavier member cannot lift the cap with its own claim."""
    invalid = weight_violations(weights)
    valid = sorted(w for i, w in enumerate(weights) if i not in invalid)
    if cap_multiple <= 0 or not valid:
        return math.inf
    return cap_multiple * valid[(len(valid) - 1) // 2]


def capped_weights(weights: Sequence[float], cap_multiple: float) -> list[float]:
    """The weights the members' updates are averaged with: each declared weight, at most
    :func:`weight_cap`. A member that trained on many more tokens than the others (a fast
    peer, one back from a catch-up) still counts, as ``cap_multiple`` times the median
    member; a liar gains nothing by claiming more, and nobody's work is thrown away."""
    cap = weight_cap(weights, cap_multiple)
    return [min(float(w), cap) for w in weights]
