"""Rejections of remote input: one exception type with a short code, and one counter.

Every piece of remote input that fails validation (a record, a contact card, a request) is
rejected with a :class:`Rejection` whose ``code`` is a short, stable label ("bad-signature",
"quota", ...) for metrics and whose message says what was wrong. The component that
drops the input reports it to its :class:`RejectionLog` exactly once; the log counts every
rejection and writes a log line naming the peer and the reason, rate-limited per source
network and code, and in all, so that a flood of bad input cannot flood the logs too.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable

from swarmloco.errors import RejectedInput
from swarmloco.net.endpoints import host_of_grpc_peer, parse_endpoint, source_network

MAX_CODE_CHARS = 32
"""The longest rejection code accepted from another peer (ours are under 20)."""
MAX_REASON_CHARS = 1024
"""The longest reason accepted from another peer in a refusal or verdict (ours are under
400): it ends up in our logs and errors."""


class Rejection(RejectedInput):
    """Remote input that failed validation; ``code`` labels the reason for metrics."""

    def __init__(self, code: str, reason: str, *, peer: str | None = None) -> None:
        super().__init__(reason, peer=peer)
        self.code = code

    def from_peer(self, peer: str) -> Rejection:
        """The same rejection, attributed to ``peer``."""
        return Rejection(self.code, self.reason, peer=peer)


def host_named_by(peer: str) -> str:
    """The host in each form a peer is named by: a gRPC peer (``ipv4:1.2.3.4:5``), a
    contact (``<id>@host:port``), an endpoint (``host:port``) or a bare host; anything
    else (a peer id) as it is."""
    if peer.startswith(("ipv4:", "ipv6:")):
        return host_of_grpc_peer(peer)
    named = peer.rpartition("@")[2]
    try:
        return parse_endpoint(named)[0]
    except ValueError:
        return named


@dataclasses.dataclass(slots=True)
class _Slot:
    logged_at: float
    suppressed: int = 0


class RejectionLog:
    """Counts every rejection by code, exactly, and logs them sparingly.

    A line is written at most once per ``log_interval`` seconds for each source network
    and code (the line says how many like it were suppressed since the last), and at most
    ``max_lines`` lines per interval in all (the next line says how many from other sources
    went unlogged). The source network (``endpoints.source_network``: a /24, a /64, or a
    loopback or private address) is taken from ``source`` when the caller knows where the
    input came from, else from ``peer``: a caller opening a connection per request, or an
    IPv6 host with a /64 of addresses, still gets one line per interval. The per-source
    state is bounded by ``max_tracked`` entries of under 300 bytes each.
    """

    def __init__(
        self,
        logger: logging.Logger,
        *,
        log_interval: float = 10.0,
        max_lines: int = 50,
        clock: Callable[[], float] = time.monotonic,
        max_tracked: int = 4096,
    ) -> None:
        if log_interval < 0 or max_lines < 1 or max_tracked < 1:
            raise ValueError("log_interval must be >= 0, max_lines and max_tracked >= 1")
        self.counts: Counter[str] = Counter()
        self._logger = logger
        self._log_interval = log_interval
        self._max_lines = max_lines
        self._clock = clock
        self._max_tracked = max_tracked
        # (source network, code) -> when it was last logged; ordered by that time.
        self._last: dict[tuple[str, str], _Slot] = {}
        self._window_at = float("-inf")
        self._window_lines = 0
        self._unlogged = 0

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def tracked(self) -> int:
        """How many (source network, code) pairs it remembers a last line for."""
        return len(self._last)

    def record(self, rejection: Rejection, peer: str, *, source: str | None = None) -> None:
        """Count ``rejection`` of input from ``peer`` (how the log line names it) and log
        it unless a line about its source network and code was written lately.
        ``source``: the caller's address as the transport saw it (an IP address or a gRPC
        peer string), when ``peer`` is something the sender chose (its card's endpoint)."""
        self.counts[rejection.code] += 1
        network = source_network(host_named_by(peer if source is None else source))
        slot = (network, rejection.code)
        now = self._clock()
        last = self._last.get(slot)
        if last is not None and now - last.logged_at < self._log_interval:
            last.suppressed += 1
            return
        if now - self._window_at >= self._log_interval:
            self._window_at, self._window_lines = now, 0
        if self._window_lines >= self._max_lines:
            self._unlogged += 1
            return
        self._window_lines += 1
        notes = []
        if last is not None and last.suppressed:
            notes.append(f"{last.suppressed} more like it suppressed")
        if self._unlogged:
            notes.append(f"{self._unlogged} more from other sources not logged")
            self._unlogged = 0
        self._last.pop(slot, None)
        while len(self._last) >= self._max_tracked:
            del self._last[next(iter(self._last))]  # the one logged longest ago
        self._last[slot] = _Slot(now)
        suffix = f" ({'; '.join(notes)})" if notes else ""
        self._logger.warning("rejected input from %s: %s%s", peer, rejection.reason, suffix)
