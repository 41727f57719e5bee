"""Learning-rate schedules, as plain functions of the step."""

from __future__ import annotations

import math


def warmup_cosine(
    step: int, *, base_lr: float, warmup_steps: int, total_steps: int, min_ratio: float
) -> float:
    """Linear warmup from ~0 to ``base_lr`` over ``warmup_steps``, then cosine decay to
    ``min_ratio * base_lr`` at ``total_steps``; constant after that.

    ``step`` counts from 0 (the learning rate of the first update).
    """
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    if total_steps <= warmup_steps:
        return base_lr
    progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    floor = base_lr * min_ratio
    return floor + (base_lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
