"""Rejections of remote input: one exception type with a short code, and one counter.

Every piece of remote input that fails validation (a record, a contact card, a request) is
rejected with a :class:`Rejection` whose ``code`` is a short, stable label ("bad-signature",
"quota", ...) for metrics and whose message says what was wrong. The component that
drops the input reports it to its :class:`RejectionLog` exactly once; the log counts every
rejection and writes a log line naming the peer and the reason, rate-limited per peer and
code so that a flood of bad input cannot flood the logs too.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable

from swarmloco.errors import RejectedInput


class Rejection(RejectedInput):
    """Remote input that failed validation; ``code`` labels the reason for metrics."""

    def __init__(self, code: str, reason: str, *, peer: str | None = None) -> None:
        super().__init__(reason, peer=peer)
        self.code = code

    def from_peer(self, peer: str) -> Rejection:
        """The same rejection, attributed to ``peer``."""
        return Rejection(self.code, self.reason, peer=peer)


class RejectionLog:
    """Counts rejections by code and logs them, at most one line per peer and code per
    ``log_interval`` seconds (the line says how many were suppressed since the last)."""

    def __init__(
        self,
        logger: logging.Logger,
        *,
        log_interval: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        max_tracked: int = 10_000,
    ) -> None:
        self.counts: Counter[str] = Counter()
        self._logger = logger
        self._log_interval = log_interval
        self._clock = clock
        self._max_tracked = max_tracked
        self._last: dict[tuple[str, str], tuple[float, int]] = {}

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def record(self, rejection: Rejection, peer: str) -> None:
        self.counts[rejection.code] += 1
        slot = (peer, rejection.code)
        now = self._clock()
        last = self._last.get(slot)
        if last is not None and now - last[0] < self._log_interval:
            self._last[slot] = (last[0], last[1] + 1)
            return
        suppressed = f" ({last[1]} more like it suppressed)" if last and last[1] else ""
        if len(self._last) >= self._max_tracked:
            self._last.clear()  # bound memory under a flood of distinct peers
        self._last[slot] = (now, 0)
        self._logger.warning("rejected input from %s: %s%s", peer, rejection.reason, suppressed)
