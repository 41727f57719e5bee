"""The bytes one round's streams carry, each message through the fault plan (tests) and
the bandwidth limiter, counted for the round's report.

Both directions of every stream go through here, so that a fault aimed at a phase fires
whichever stream carries it, and the limiter sees all of a round's traffic.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from swarmloco.net.averaging import wire
from swarmloco.net.averaging.faults import FaultPlan, Phase
from swarmloco.net.averaging.limiter import BandwidthLimiter
from swarmloco.net.averaging.view import PartHasher
from swarmloco.net.rejections import Rejection
from swarmloco.proto.v1 import averaging_pb2 as pb

AUDIT_PHASES = frozenset(("audit", "statements", "fetch", "segment", "proof"))


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
        forge_done: Callable[[pb.MemberDone], pb.MemberDone] | None = None,
        seal: Callable[[int, int, bytes], bytes] | None = None,
        restate: Callable[[str, bytes], bytes] | None = None,
    ) -> None:
        """``forge_done(done)``: another announcement of ours under its number, signed;
        ``seal(part, epoch, hash)``: our seal message of a part; ``restate(peer, chunk)``:
        a chunk message to ``peer`` with our statement of the bytes it carries. With a
        fault plan, what a fault forges is signed, as a member that lies would sign it: a
        forged announcement, an altered chunk, and the seal of a part whose result messages
        to a member a fault altered (it seals what that member was sent)."""
        self._round = round
        self._forge_done = forge_done
        self._seal = seal
        self._restate = restate
        self._sent_results: dict[tuple[str, int, int], PartHasher] = {}
        self._altered: set[tuple[str, int, int]] = set()
        self._faults = faults
        self._limiter = limiter
        self._clock = clock
        self.bytes_sent = 0
        self.bytes_received = 0
        self.audit_bytes_sent = 0
        """Of ``bytes_sent``, what audits took (questions, statements, segments)."""

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
                forge_done=self._forge_done,
            )
            if phase == "result" and changed is not None:
                self._follow_result(peer, message, changed)
            elif phase == "seal" and changed is not None:
                changed = self._reseal(peer, changed)
            elif phase == "chunk" and changed not in (None, message) and self._restate:
                assert changed is not None
                changed = self._restate(peer, changed)
            if changed is None:
                return 0
            message = changed
        if self._limiter is not None:
            await self._limiter.upload(len(message))
        await write(message)
        self.bytes_sent += len(message)
        if phase in AUDIT_PHASES:
            self.audit_bytes_sent += len(message)
        return len(message)

    def _follow_result(self, peer: str, original: bytes, sent: bytes) -> None:
        """Hash the result messages that go to ``peer`` per part, and note those a fault
        altered (fault plans only)."""
        try:
            result = wire.decode_response(sent)
        except Rejection:
            return  # a corruption its receiver refuses: no seal will matter
        if not isinstance(result, wire.ResultMessage):
            return
        key = (peer, result.part, result.epoch)
        hasher = self._sent_results.setdefault(key, PartHasher())
        hasher.update(sent)
        if sent != original:
            self._altered.add(key)

    def _reseal(self, peer: str, message: bytes) -> bytes:
        """The seal to send ``peer``: ours, or, where a fault altered what it was sent of
        the part, one of what it was sent."""
        seal = pb.AggregateResponse.FromString(message).seal
        key = (peer, seal.part, seal.epoch)
        if key not in self._altered or self._seal is None:
            return message
        return self._seal(seal.part, seal.epoch, self._sent_results[key].digest())

    async def received(self, stream: Heard, data: bytes) -> None:
        """``stream`` brought ``data``: it is alive, and the limiter paces what follows."""
        stream.last_heard = self._clock()
        self.bytes_received += len(data)
        if self._limiter is not None:
            await self._limiter.download(len(data))
