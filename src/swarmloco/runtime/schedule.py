"""The inner learning rate, following the swarm rather than this peer's own step count.

:attr:`SwarmSchedule.global_step` is the swarm's progress in inner steps (``round * H / F``
plus this peer's steps into the next round), so a peer that joins at round 100 schedules
from there, not from its own first step. A schedule given through :meth:`lr_lambda` or
:meth:`scheduler` also tells the peer the learning rate at any global step (``lr_at``),
from which it bounds how far the rounds it missed can have moved the global state
(:meth:`peak`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

logger = logging.getLogger("swarmloco.runtime.swarm")

PEAK_SAMPLES = 256
"""Points of the schedule :meth:`SwarmSchedule.peak` looks at, at most."""


class SwarmSchedule:
    """See the module. ``global_step``: the swarm's step now (the peer's counts)."""

    def __init__(self, optimizer: torch.optim.Optimizer, global_step: Callable[[], int]) -> None:
        self.optimizer = optimizer
        self.global_step = global_step
        self.lr_at: Callable[[int], float] | None = None
        """The inner learning rate at a global step, when the loop follows a schedule (set
        by :meth:`lr_lambda`; a loop that sets its optimizer's learning rate itself may set
        it too). Without it, the current learning rate is assumed to hold."""
        self.schedulers: list[torch.optim.lr_scheduler.LambdaLR] = []  # made by scheduler()

    def lr(self) -> float:
        """The inner learning rate now (the first parameter group's)."""
        return float(self.optimizer.param_groups[0]["lr"])

    def lr_lambda(self, schedule: Callable[[int], float]) -> Callable[[int], float]:
        """A ``LambdaLR`` factor that follows the swarm: ``schedule(global_step)``, whatever
        step count the scheduler keeps itself. The first schedule given (that of the first
        parameter group, for a list of them) also sets :attr:`lr_at` if it is unset."""
        if self.lr_at is None:
            group = self.optimizer.param_groups[0]
            # LambdaLR keeps the base learning rate as "initial_lr"; before that, "lr" is it.
            self.lr_at = lambda step: float(group.get("initial_lr", group["lr"])) * schedule(step)
        return lambda _: schedule(self.global_step())

    def scheduler(self, schedule: Callable[[int], float]) -> torch.optim.lr_scheduler.LambdaLR:
        """``LambdaLR(optimizer, lr_lambda(schedule))``, which :meth:`follow` sets again."""
        sched = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.lr_lambda(schedule))
        self.schedulers.append(sched)
        return sched

    def follow(self) -> None:
        """Set the learning rates of the schedulers made by :meth:`scheduler` to the
        swarm's step now (one made before entering set them at global step 0: a peer that
        resumed or downloaded would take its first step at the warmup's rate)."""
        for sched in self.schedulers:
            for group, factor, base in zip(
                self.optimizer.param_groups, sched.lr_lambdas, sched.base_lrs, strict=False
            ):
                group["lr"] = base * factor(sched.last_epoch)

    def peak(self, steps: int) -> float | None:
        """The highest inner learning rate over the next ``steps`` global steps of the
        schedule (:attr:`lr_at`, sampled), or the current one when the schedule is not
        known (None: no positive rate)."""
        lr_at = self.lr_at
        if lr_at is None:
            current = self.lr()
            return current if current > 0 else None
        start, span = self.global_step(), max(1, steps)
        samples = min(span, PEAK_SAMPLES)
        try:
            return max(lr_at(start + span * i // samples) for i in range(samples + 1))
        except Exception as exc:  # the user's schedule; a bound from the current lr instead
            logger.warning("the learning-rate schedule failed (%s): using the current lr", exc)
            self.lr_at = None
            return self.peak(steps)
