"""The two ends of an ``Aggregate`` stream within one round, as one member sees them.

:class:`OutgoingStream` is the stream a member opens to a serving member: its slices of the
parts that member reduces go out, the averaged chunks, failover notices and the verdict
come back. :class:`IncomingStream` is the same stream on the serving side. Each end runs a
reader and a writer task (so a slow reader never blocks a writer), writes through the
fault plan and the bandwidth limiter (``traffic.py``), keeps the stream alive with
heartbeats when idle, and hands every message to its :class:`~.round.RoundRun`, which owns
all state. A broken stream is reported to the round, which decides what it means.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import grpc
from grpc._cython import cygrpc

from swarmloco.core.codec import ChunkSpan
from swarmloco.errors import NetworkError
from swarmloco.net.averaging import wire
from swarmloco.net.averaging.audit import ROOT_BYTES, SEGMENT_BLOCKS, segments_of
from swarmloco.net.averaging.faults import FaultCut, Phase
from swarmloco.net.averaging.view import PART_HASH_BYTES, RESULT_DIGEST_BYTES, Claim
from swarmloco.net.identity import SIGNATURE_BYTES
from swarmloco.net.rejections import MAX_CODE_CHARS, MAX_REASON_CHARS, Rejection
from swarmloco.proto.v1 import averaging_pb2 as pb

SEAL_BYTES = PART_HASH_BYTES + SIGNATURE_BYTES + 24
"""The most a ``Seal`` takes on the wire (three numbers, a hash and a signature)."""


STATEMENT_BYTES = 2 * ROOT_BYTES + SIGNATURE_BYTES + 32
"""The most a kept ``Statement`` takes on the wire beside its segments' norms (two
numbers, a root and a signature, with room to spare)."""


def statements_bytes(members: int, spans: list[list[ChunkSpan]]) -> int:
    """The most a reducer's answer to an audit of a part takes on the wire: a statement of
    every chunk of the longest part from every member, each with 8 bytes a segment, and
    the reducer's signature of it."""
    chunks = max((len(part) for part in spans), default=0)
    segments = max((segments_of(s.blocks) for part in spans for s in part), default=0)
    return members * chunks * (STATEMENT_BYTES + 8 * segments + 4) + SIGNATURE_BYTES + 32


def proof_bytes(members: int, spans: list[list[ChunkSpan]], block_bytes: int) -> int:
    """The most a ``Proof`` of a part takes on the wire: the reducer's answer (see
    :func:`statements_bytes`, with its signature), a segment from every member (up to
    ``SEGMENT_BLOCKS`` codec blocks of ``block_bytes``, payload and scales, and a hash of
    every segment of its chunk) and the result message of the chunk (its blocks, and the
    bitmap of its contributors)."""
    segments = max((segments_of(s.blocks) for part in spans for s in part), default=0)
    segment = SEGMENT_BLOCKS * block_bytes + segments * ROOT_BYTES + 48
    blocks = max((s.blocks for part in spans for s in part), default=0)
    result = blocks * block_bytes + members // 8 + 64
    return statements_bytes(members, spans) + members * segment + result + 64


def check_proof_size(rnd: RoundRun, proof: pb.Proof) -> None:
    """Rejection if ``proof`` is longer than any of the round's parts takes."""
    codec = rnd.cfg.codec
    most = proof_bytes(rnd.n, rnd.view.spans, codec.block_size + codec.scale_bytes)
    if proof.ByteSize() > most:
        raise Rejection("malformed", "a proof longer than its part's")


def announced_bytes(members: int) -> int:
    """The most a signed ``MemberDone`` of a group of ``members`` takes on the wire (digest,
    number, signature and a seal per part)."""
    return RESULT_DIGEST_BYTES + SIGNATURE_BYTES + 16 + members * (SEAL_BYTES + 4)


if TYPE_CHECKING:
    from swarmloco.net.averaging.round import RoundRun

CLOSE = object()  # queue sentinel: the writer half-closes (client) or stops (server)

# What a broken stream raises: on the client side an AioRpcError, or InvalidStateError
# ("RPC already finished") when writing to a call that just ended; on the server side,
# reading from or writing to a stream whose client vanished raises grpc's internal
# ExecuteBatchError (a cygrpc.BaseError); a cut scripted by the fault plan raises FaultCut.
STREAM_ERRORS = (
    grpc.aio.AioRpcError,
    asyncio.InvalidStateError,
    cygrpc.BaseError,
    NetworkError,
    FaultCut,
)


class OutgoingStream:
    """Our stream to serving member ``member``: our slices out, its results back."""

    def __init__(self, rnd: RoundRun, member: int) -> None:
        self.rnd = rnd
        self.member = member
        self.peer = rnd.group.members[member].peer_id
        self.traffic = rnd.traffic
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.task: asyncio.Task[None] | None = None
        self._reader: asyncio.Task[None] | None = None
        self._writer: asyncio.Task[None] | None = None
        self.verdict = False
        self.sent = 0
        self.last_heard = rnd.a.clock()
        if member in rnd.view.owner:
            self.send(("part", member, 0))

    def send(self, job: Any) -> None:
        self.queue.put_nowait(job)

    def close(self) -> None:
        """Half-close once the queue is empty (the committed path)."""
        self.queue.put_nowait(CLOSE)

    def abort(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()

    async def run(self) -> None:
        rnd = self.rnd
        endpoint = rnd.group.members[self.member].endpoint
        try:
            channel = await rnd.a.client.open(endpoint, rnd.deadline)
        except NetworkError as exc:
            self._broken(f"cannot connect: {exc}")
            return
        with rnd.a.client.holding(channel):
            call = channel.stream_stream(wire.AGGREGATE_PATH)(
                timeout=max(rnd.deadline.remaining(), 0.001), wait_for_ready=True
            )
            try:
                async with asyncio.TaskGroup() as tg:
                    self._writer = tg.create_task(self._write(call))
                    self._reader = tg.create_task(self._read(call))
            finally:
                if not call.done():
                    call.cancel()

    def _broken(self, reason: str) -> None:
        for task in (self._reader, self._writer):
            if task is not None and task is not asyncio.current_task():
                task.cancel()
        if not self.verdict:
            self.rnd.fail(self.member, reason)

    async def _write(self, call: Any) -> None:
        rnd = self.rnd
        hello = pb.StreamHello(
            group_id=rnd.group.group_id, round=rnd.group.round, sender=rnd.me, reducer=self.member
        )
        payload = wire.hello_payload(hello.group_id, hello.round, hello.sender, hello.reducer)
        hello.signature = rnd.a.identity.sign(wire.HELLO_DOMAIN, payload)
        try:
            await self._send(call, "hello", wire.request(hello=hello))
            while True:
                try:
                    async with asyncio.timeout(rnd.cfg.heartbeat_s):
                        job = await self.queue.get()
                except TimeoutError:
                    await self._send(call, "heartbeat", wire.HEARTBEAT_REQUEST)
                    continue
                if job is CLOSE:
                    await call.done_writing()
                    return
                if job[0] == "part":
                    await self._send_part(call, job[1], job[2])
                else:
                    await self._send(call, job[0], job[1])
        except STREAM_ERRORS as exc:
            self._broken(f"sending to it failed: {describe(exc)}")

    async def _send_part(self, call: Any, part: int, epoch: int) -> None:
        rnd = self.rnd
        claim = Claim(epoch, self.member)
        for index in range(len(rnd.view.spans[part])):
            if rnd.view.owner.get(part) != claim:
                return  # the part moved on meanwhile
            await self._send(call, "chunk", rnd.chunk_message(self.member, part, epoch, index))

    async def _send(self, call: Any, phase: Phase, message: bytes) -> None:
        self.sent += await self.traffic.write_out(phase, self.peer, message, call.write, self.sent)

    async def _read(self, call: Any) -> None:
        rnd = self.rnd
        member = self.member
        try:
            while True:
                data = await call.read()
                if data is grpc.aio.EOF:
                    if not self.verdict:
                        self._broken("it ended the stream before its verdict")
                    return
                await self.traffic.received(self, data)
                try:
                    self._dispatch(wire.decode_response(data), data)
                except Rejection as rejection:
                    rnd.a.rejections.record(rejection, rnd.group.members[member].peer_id)
                    self._broken(f"it sent invalid data: {rejection.reason}")
                    return
        except STREAM_ERRORS as exc:
            self._broken(f"its stream broke: {describe(exc)}")

    def _dispatch(self, message: wire.ResultMessage | pb.AggregateResponse, raw: bytes) -> None:
        rnd = self.rnd
        if isinstance(message, wire.ResultMessage):
            rnd.on_result(self.member, message, raw)
            return
        kind = message.WhichOneof("kind")
        if kind == "rerun":
            rnd.on_rerun(self.member, message.rerun.part, message.rerun.epoch)
        elif kind == "seal":
            if message.seal.ByteSize() > SEAL_BYTES:
                raise Rejection("malformed", "a seal longer than one")
            rnd.on_seal(self.member, message.seal)
        elif kind == "verdict":
            verdict = message.verdict
            # Sizes before contents: reading a bytes or string field copies it.
            shown = rnd.n * (announced_bytes(rnd.n) + 16)  # an announcement per member, at most
            if (
                verdict.ByteSize() > 4 * MAX_REASON_CHARS + RESULT_DIGEST_BYTES + 16 + shown
                or len(verdict.digest) != RESULT_DIGEST_BYTES
                or len(verdict.reason) > MAX_REASON_CHARS
                or len(verdict.evidence) > rnd.n
            ):
                raise Rejection(
                    "malformed",
                    f"a verdict needs a digest of {RESULT_DIGEST_BYTES} bytes, a reason of "
                    f"at most {MAX_REASON_CHARS} characters and an announcement per member "
                    "at most",
                )
            self.verdict = True
            rnd.on_verdict(self.member, verdict)
            self.close()
        elif kind == "statements":
            answer = message.statements
            if answer.ByteSize() > statements_bytes(rnd.n, rnd.view.spans):
                raise Rejection("malformed", "an audit answer longer than its part's statements")
            rnd.on_statements(self.member, answer)
        elif kind == "fetch":
            rnd.on_fetch(self.member, message.fetch)
        elif kind == "proof":
            check_proof_size(rnd, message.proof)
            rnd.on_proof(self.member, message.proof, answer=True)
        elif kind == "refusal":
            refusal = message.refusal
            if (
                refusal.ByteSize() > 4 * (MAX_CODE_CHARS + MAX_REASON_CHARS) + 16
                or len(refusal.reason) > MAX_REASON_CHARS
            ):
                raise Rejection(
                    "malformed", f"a refusal's reason is over {MAX_REASON_CHARS} characters"
                )
            self._broken(f"it refused us: {refusal.reason}")
        elif kind != "heartbeat":
            raise Rejection("malformed", f"unexpected {kind or 'empty'} message")


class IncomingStream:
    """A member's stream to us: its chunks in, our results, notices and verdict out."""

    def __init__(self, rnd: RoundRun, sender: int, context: grpc.aio.ServicerContext) -> None:
        self.rnd = rnd
        self.sender = sender
        self.peer = rnd.group.members[sender].peer_id
        self.traffic = rnd.traffic
        self.context = context
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.clean = False
        self.end_reason = ""
        self.last_heard = rnd.a.clock()
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False

    def send(self, phase: Phase, message: bytes) -> None:
        if not self._closing:
            self.queue.put_nowait((phase, message))

    def send_close(self) -> None:
        if not self._closing:
            self._closing = True
            self.queue.put_nowait(CLOSE)

    def abort(self) -> None:
        for task in self._tasks:
            task.cancel()

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tg:
            self._tasks = [tg.create_task(self._read()), tg.create_task(self._write())]

    async def _stall_point(self) -> None:
        faults = self.rnd.a.faults
        if faults is not None:
            await faults.handler(peer=self.peer, round=self.rnd.group.round)

    async def _read(self) -> None:
        rnd = self.rnd
        try:
            while True:
                await self._stall_point()
                data = await self.context.read()
                if data is grpc.aio.EOF:
                    self.clean = not self.context.cancelled() and (
                        self.sender in rnd.done or rnd.decided or self.sender in rnd.view.failed
                    )
                    self.end_reason = "it ended its stream early"
                    return
                await self.traffic.received(self, data)
                try:
                    message = wire.decode_request(data)
                    if isinstance(message, wire.ChunkMessage):
                        rnd.on_chunk(self.sender, message)
                        continue
                    kind = message.WhichOneof("kind")
                    if kind == "done":
                        if message.done.ByteSize() > announced_bytes(rnd.n):
                            raise Rejection("malformed", "an announcement longer than one")
                        rnd.on_done(self.sender, message.done)
                    elif kind == "audit":
                        rnd.on_audit(self.sender, message.audit)
                    elif kind == "segment":
                        rnd.on_segment(self.sender, message.segment)
                    elif kind == "proof":
                        check_proof_size(rnd, message.proof)
                        rnd.on_proof(self.sender, message.proof, answer=False)
                    elif kind != "heartbeat":
                        raise Rejection("malformed", f"unexpected {kind or 'empty'} message")
                except Rejection as rejection:
                    rnd.strike(self.sender, rejection)
                    self.clean = True
                    return
        except STREAM_ERRORS as exc:
            self.end_reason = f"its stream broke: {describe(exc)}"

    async def _write(self) -> None:
        rnd = self.rnd
        sent = 0
        try:
            while True:
                try:
                    async with asyncio.timeout(rnd.cfg.heartbeat_s):
                        item = await self.queue.get()
                except TimeoutError:
                    item = ("heartbeat", wire.HEARTBEAT_RESPONSE)
                if item is CLOSE:
                    return
                await self._stall_point()
                phase, message = item
                sent += await self.traffic.write_out(
                    phase, self.peer, message, self.context.write, sent
                )
        except STREAM_ERRORS as exc:
            self.end_reason = f"sending to it failed: {describe(exc)}"
            for task in self._tasks:
                if task is not asyncio.current_task():
                    task.cancel()


def describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {(exc.details() or '').strip()}"
    return str(exc) or type(exc).__name__
