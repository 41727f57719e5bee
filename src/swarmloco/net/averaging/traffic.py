"""The bytes one round's streams carry, each message through the fault plan (tests) and
the bandwidth limiter, counted for the round's report.

Both directions of every stream go through here, so that a fault aimed at a phase fires
whichever stream carries it, and the limiter sees all of a round's traffic.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from swarmloco.net.averaging.faults import FaultPlan, Phase
from swarmloco.net.averaging.limiter import BandwidthLimiter
from swarmloco.proto.v1 import averaging_pb2 as pb


class Heard(Protocol):
    last_heard: float


class Traffic:
    """What one round sent and received, and the waits that pace it."""

    def __init__(
        self,
        *,
        round: int,
        faults: FaultPlan | None,
        limiter: BandwidthLimiter | None,
        clock: Callable[[], float],
        sign_done: Callable[[bytes, int], pb.MemberDone] | None = None,
    ) -> None:
        """``sign_done(digest, seq)``: our signed announcement (a fault that forges one
        signs what it forges, as a member that lies would)."""
        self._round = round
        self._sign_done = sign_done
        self._faults = faults
        self._limiter = limiter
        self._clock = clock
        self.bytes_sent = 0
        self.bytes_received = 0

    async def write_out(
        self,
        phase: Phase,
        peer: str,
        message: bytes,
        write: Callable[[bytes], Any],
        call_bytes: int,
    ) -> int:
        """Send one message to ``peer`` through the fault plan and the limiter; return the
        bytes sent."""
        if self._faults is not None:
            changed = await self._faults.outgoing(
                phase,
                peer=peer,
                round=self._round,
                message=message,
                call_bytes=call_bytes,
                sign_done=self._sign_done,
            )
            if changed is None:
                return 0
            message = changed
        if self._limiter is not None:
            await self._limiter.upload(len(message))
        await write(message)
        self.bytes_sent += len(message)
        return len(message)

    async def received(self, stream: Heard, data: bytes) -> None:
        """``stream`` brought ``data``: it is alive, and the limiter paces what follows."""
        stream.last_heard = self._clock()
        self.bytes_received += len(data)
        if self._limiter is not None:
            await self._limiter.download(len(data))
