"""Deadlines: computed once from a budget, then passed down to every remote wait.

A caller decides how long an operation may take (a round, a lookup, a join); everything
below it asks the same :class:`Deadline` how much time is left instead of inventing its
own timeout, so nested waits can never outlive the operation that started them.
"""

from __future__ import annotations

import time
from collections.abc import Callable

Clock = Callable[[], float]


class Deadline:
    """A point in time on a monotonic clock."""

    __slots__ = ("_clock", "at")

    def __init__(self, at: float, *, clock: Clock = time.monotonic) -> None:
        self.at = at
        self._clock = clock

    @classmethod
    def after(cls, seconds: float, *, clock: Clock = time.monotonic) -> Deadline:
        return cls(clock() + seconds, clock=clock)

    def remaining(self) -> float:
        """Seconds left, never negative."""
        return max(0.0, self.at - self._clock())

    @property
    def expired(self) -> bool:
        return self._clock() >= self.at

    def timeout(self, cap: float | None = None) -> float:
        """The time left, at most ``cap`` (for one call of several under this deadline)."""
        left = self.remaining()
        return left if cap is None else min(left, cap)

    def __repr__(self) -> str:
        return f"Deadline(remaining={self.remaining():.3f}s)"
