"""A bandwidth limiter: token buckets for what a peer uploads and downloads while averaging.

Users on a shared link cap what averaging may use; the benchmarks use the same limiter to
imitate a WAN link (e.g. 100 Mbit/s) on loopback. One :class:`BandwidthLimiter` per peer,
shared by all its averaging streams: the writer of a stream takes tokens for a message
before handing it to gRPC, the reader takes tokens for a message it received before
processing it (so a slow reader also slows its senders, through HTTP/2 flow control).

Waiters are served first come, first served (they queue on one lock), and a message larger
than the burst is let through by running the bucket into debt, which the next waiters pay
off: over any interval the rate holds to within one burst plus one message.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable

from swarmloco.core.config import require_int, require_non_negative

MBIT = 1_000_000 / 8
"""Bytes per second in one Mbit/s."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class BandwidthConfig:
    """Averaging traffic limits of one peer (0 = unlimited)."""

    upload_bytes_per_s: float = 0.0
    """Bytes per second this peer may send on averaging streams."""
    download_bytes_per_s: float = 0.0
    """Bytes per second this peer may receive on averaging streams."""
    burst_bytes: int = 64 * 1024
    """Bytes that may go at once after an idle period."""

    def __post_init__(self) -> None:
        require_non_negative("upload_bytes_per_s", self.upload_bytes_per_s)
        require_non_negative("download_bytes_per_s", self.download_bytes_per_s)
        require_int("burst_bytes", self.burst_bytes, minimum=1)

    @classmethod
    def mbit(cls, upload: float, download: float | None = None) -> BandwidthConfig:
        """Limits in Mbit/s (download defaults to the upload limit)."""
        return cls(
            upload_bytes_per_s=upload * MBIT,
            download_bytes_per_s=(upload if download is None else download) * MBIT,
        )


class TokenBucket:
    """``rate`` bytes per second with bursts of up to ``burst`` bytes."""

    def __init__(
        self,
        rate: float,
        burst: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
    ) -> None:
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._sleep = sleep
        self._tokens = burst
        self._last = clock()
        self._lock = asyncio.Lock()
        self.waited_s = 0.0
        """Total time takers spent waiting (how much the limit slowed things down)."""

    async def take(self, amount: int) -> None:
        """Wait until ``amount`` bytes may pass."""
        async with self._lock:
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            self._tokens -= amount
            if self._tokens < 0:
                wait = -self._tokens / self.rate
                self.waited_s += wait
                # Sleep holding the lock: later takers queue behind us, first come first
                # served, and the refill during our sleep pays off our debt.
                await self._sleep(wait)


class BandwidthLimiter:
    """The upload and download buckets of one peer."""

    def __init__(self, config: BandwidthConfig) -> None:
        self.config = config
        self._up = (
            TokenBucket(config.upload_bytes_per_s, config.burst_bytes)
            if config.upload_bytes_per_s
            else None
        )
        self._down = (
            TokenBucket(config.download_bytes_per_s, config.burst_bytes)
            if config.download_bytes_per_s
            else None
        )

    async def upload(self, amount: int) -> None:
        if self._up is not None:
            await self._up.take(amount)

    async def download(self, amount: int) -> None:
        if self._down is not None:
            await self._down.take(amount)
