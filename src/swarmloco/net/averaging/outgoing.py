"""Our streams to the serving members of one round: one each, opened at the start, told of
parts that moved to them and of our digest, and ended with the round: half-closed once it
committed (each ends when its server hangs up), cancelled otherwise.
"""

from __future__ import annotations

import asyncio
from collections.abc import Container, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from swarmloco.net.averaging.streams import OutgoingStream


class Outgoing:
    """The outgoing streams of one round, by the member they go to."""

    def __init__(self) -> None:
        self.streams: dict[int, OutgoingStream] = {}

    def open(self, streams: Iterable[OutgoingStream], group: asyncio.TaskGroup) -> None:
        """Run ``streams`` in the round's task group."""
        for out in streams:
            self.streams[out.member] = out
            out.task = group.create_task(out.run())

    def send(self, job: Any, *, skip: Container[int] = ()) -> None:
        """Queue ``job`` on every stream (those to ``skip`` excepted)."""
        for member, out in self.streams.items():
            if member not in skip:
                out.send(job)

    def last_heard(self, member: int) -> float | None:
        """When ``member`` last answered on our stream to it (None: we have none)."""
        out = self.streams.get(member)
        return out.last_heard if out is not None else None

    def abort(self, member: int) -> None:
        out = self.streams.get(member)
        if out is not None:
            out.abort()

    def end(self, *, committed: bool) -> None:
        for out in self.streams.values():
            if committed:
                out.close()  # streams end once their server hung up
            else:
                out.abort()
