"""Handing freed memory back to the system: after large input was refused, and once a round.

A message of several megabytes passes through gRPC's buffers, the protobuf parser and
Python's bytes. Once freed, that memory stays with the C allocator: glibc serves large
blocks from its heaps once one such block was freed (its mmap threshold rises), and those
heaps fragment, so the process keeps the memory. Measured on a bootstrap node (2026-11-26):
20 refused Pings of 7 MiB each, nothing of which was kept, left it 55 to 60 MB larger than
after the first, for good; with ``malloc_trim`` called after them, 9 to 35 MB.

:func:`release_after` is what handlers call when they refuse input by its size: at most
once per ``min_interval_s``, a moment after the refusal (once the call ended and its
message was freed), it asks glibc to return what is free (``malloc_trim``); input refused
meanwhile is covered by the release already due, so the last message of a burst is
released too. Without glibc (macOS, musl) it does nothing. Only refused input
triggers it: an attacker chooses how often, and the interval bounds what that costs
(a trim of a large training process's heap takes up to tens of milliseconds).
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import time
from collections.abc import Callable

LARGE_BYTES = 1 << 20
"""Input at least this large triggers a release (smaller messages come and go in the
allocator's small-object pools)."""
_SETTLE_S = 0.1  # how long after a refusal its call has ended and its message is freed


def _malloc_trim() -> Callable[[], object] | None:
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):  # not glibc, or not a POSIX dlopen
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return lambda: trim(0)


class Releaser:
    """Calls ``trim`` after large input, at most once per ``min_interval_s``."""

    def __init__(
        self,
        trim: Callable[[], object] | None,
        *,
        min_interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._trim = trim
        self._min_interval_s = min_interval_s
        self._clock = clock
        self._last = float("-inf")
        self._pending: tuple[asyncio.AbstractEventLoop, asyncio.TimerHandle] | None = None
        self.trims = 0
        """How many times memory was handed back."""

    def after(self, nbytes: int) -> None:
        """``nbytes`` of input were refused: release free memory a moment from now, on the
        running event loop, and no sooner than an interval after the last release."""
        if self._trim is None or nbytes < LARGE_BYTES:
            return
        now = self._clock()
        # Never at once: the refused message is still referenced by the call refusing it,
        # and gRPC frees its buffers once the call has ended.
        due = max(now + _SETTLE_S, self._last + self._min_interval_s)
        if self._pending is not None:
            loop, handle = self._pending
            if not loop.is_closed() and handle.when() - loop.time() >= due - now:
                return  # the release already due comes late enough to cover this input
            handle.cancel()
        loop = asyncio.get_running_loop()
        self._pending = (loop, loop.call_later(due - now, self._release))

    def _release(self) -> None:
        self._pending = None
        self._last = self._clock()
        assert self._trim is not None
        self._trim()
        self.trims += 1


RELEASER = Releaser(_malloc_trim())
"""The process's releaser (the allocator is the process's, not a peer's)."""


def resident_bytes() -> int | None:
    """This process's resident set, from /proc (None where there is none)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


async def release_when_grown(
    *,
    interval_s: float = 5.0,
    grown_bytes: int = 8 << 20,
    trim: Callable[[], object] | None = None,
    resident: Callable[[], int | None] = resident_bytes,
) -> None:
    """Forever: every ``interval_s``, hand free memory back when the resident set has grown
    ``grown_bytes`` past where the last release left it.

    For a process that serves the DHT alone (a bootstrap node): its messages are small, so
    gRPC refuses a large one itself, before any handler of ours sees it and can call
    :func:`release_after`; what gRPC held for it stays with the allocator. Its heap is
    small, so a trim costs it little. Without glibc or /proc it returns at once."""
    trim = trim or _malloc_trim()
    if trim is None or resident() is None:
        return
    floor = resident() or 0
    while True:
        await asyncio.sleep(interval_s)
        now = resident() or 0
        if now >= floor + grown_bytes:
            trim()
            floor = resident() or now
        else:
            floor = min(floor, now)


def release_now() -> None:
    """Hand what is free back to the system now. A peer calls it once a round, between
    two steps: the round's messages, its temporaries and the evaluation's batches
    otherwise stay with the allocator, about 1.5 bytes a parameter of a 135M model
    (measured with ``scripts/bench_memory.py``; DESIGN section 6, "Host memory")."""
    if RELEASER._trim is not None:
        RELEASER._trim()


def release_after(nbytes: int) -> None:
    """Tell the process that ``nbytes`` of input were just refused (see the module)."""
    RELEASER.after(nbytes)
