"""The streams other members open to us in one round: at most one per member, every one
sent what was sent before it opened, and each handler awaited before the round returns.

A member whose stream opens after our reductions have produced results (or after our
verdict) is sent those first, so that a late stream misses nothing. The round ends its
side of them gracefully once it committed (members still read their verdict for up to
``close_grace_s``), at once otherwise.
"""

from __future__ import annotations

import asyncio
from collections.abc import Container, Iterable
from typing import TYPE_CHECKING, Any

from swarmloco.net.averaging.faults import Phase
from swarmloco.net.rejections import Rejection

if TYPE_CHECKING:
    from swarmloco.net.averaging.streams import IncomingStream


class Incoming:
    """The incoming streams of one round, by sender, and the tasks that serve them."""

    def __init__(self, *, close_grace_s: float) -> None:
        self._close_grace_s = close_grace_s
        self.streams: dict[int, IncomingStream] = {}
        self.closing = False
        """The round is ending: no stream is served from now on."""
        self._handlers: set[asyncio.Task[Any]] = set()
        self._gone = asyncio.Event()
        self._gone.set()

    def check(self, sender: int, struck: Container[int]) -> None:
        """Rejection unless ``sender`` may open a stream to us now."""
        if sender in struck:
            raise Rejection("struck", "this member was struck from the round")
        if sender in self.streams:
            raise Rejection("duplicate", "this member already has a stream open")

    def send(self, phase: Phase, message: bytes, *, skip: Container[int] = ()) -> None:
        """Queue ``message`` on every stream (those of ``skip`` excepted)."""
        for member, inc in self.streams.items():
            if member not in skip:
                inc.send(phase, message)

    def send_last(self, phase: Phase, message: bytes) -> None:
        """Queue ``message`` on every stream as the last it carries."""
        for inc in self.streams.values():
            inc.send(phase, message)
            inc.send_close()

    async def serve(
        self, inc: IncomingStream, earlier: Iterable[tuple[Phase, bytes]], last: bytes | None
    ) -> None:
        """Run ``inc`` until it ends, sent ``earlier`` messages first (and ``last``, our
        verdict, when it is made already)."""
        self.streams[inc.sender] = inc
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        self._gone.clear()
        for phase, message in earlier:
            inc.send(phase, message)
        if last is not None:
            inc.send("verdict", last)
            inc.send_close()
        try:
            await inc.run()
        finally:
            self.streams.pop(inc.sender, None)
            self._handlers.discard(task)
            if not self._handlers:
                self._gone.set()

    async def close(self, *, committed: bool, failed: Container[int]) -> None:
        """End our side of every stream: gracefully when committed, else now; return once
        every handler is gone."""
        self.closing = True
        if committed:
            for member, inc in list(self.streams.items()):
                if member in failed:
                    inc.abort()
            try:
                async with asyncio.timeout(self._close_grace_s):
                    await self._gone.wait()
            except TimeoutError:
                pass
        for inc in list(self.streams.values()):
            inc.abort()
        await self._gone.wait()
