"""The learning rate that follows the swarm, alone (runtime/schedule.py)."""

from __future__ import annotations

import pytest
import torch

from swarmloco.runtime.schedule import SwarmSchedule


def warmup(step: int) -> float:
    return min(1.0, (step + 1) / 100)


def schedule_at(step: list[int], lr: float = 1e-2) -> SwarmSchedule:
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], lr=lr)
    return SwarmSchedule(optimizer, lambda: step[0])


def test_a_scheduler_made_before_the_swarm_is_entered_follows_the_swarms_step():
    step = [0]
    s = schedule_at(step)
    sched = s.scheduler(warmup)
    assert s.lr() == pytest.approx(1e-2 * warmup(0))
    step[0] = 1_000  # restored or downloaded: the swarm is far past the warmup
    s.follow()
    assert s.lr() == pytest.approx(1e-2)
    s.optimizer.step()  # (no gradients: nothing moves)
    sched.step()  # the scheduler's own count does not matter
    assert s.lr() == pytest.approx(1e-2)
    assert s.lr_at is not None and s.lr_at(49) == pytest.approx(1e-2 * 0.5)


def test_the_peak_is_the_schedules_highest_rate_ahead_or_the_current_one():
    step = [0]
    s = schedule_at(step)
    assert s.peak(10) == pytest.approx(1e-2)  # no schedule known: the current rate
    s.lr_lambda(warmup)
    assert s.peak(10) == pytest.approx(1e-2 * warmup(10))
    assert s.peak(10_000) == pytest.approx(1e-2)
    for group in s.optimizer.param_groups:
        group["lr"] = 0.0
    s.lr_at = None
    assert s.peak(10) is None  # no positive rate to bound anything by


def test_a_schedule_that_raises_falls_back_to_the_current_rate():
    s = schedule_at([5])

    def broken(step: int) -> float:
        raise ZeroDivisionError("the user's bug")

    s.lr_at = broken
    assert s.peak(10) == pytest.approx(1e-2) and s.lr_at is None
