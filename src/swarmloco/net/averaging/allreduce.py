"""The streamed int8 butterfly all-reduce of one group, over gRPC, surviving failures.

:meth:`Averager.all_reduce` averages a flat fp32 vector (padded to whole codec blocks) with
the members of a :class:`~swarmloco.net.averaging.group.Group` and returns the mean, which
every member that returns holds bit for bit, and a report of who counted where.

How a round runs, for member i (the pure pieces live in ``reduction.py``, ``view.py``,
``audit.py``, ``verdicts.py`` and ``liveness.py``, the driver in ``round.py``, the stream
ends in ``streams.py``):

1. Quantize the whole vector once (the compiled codec amortizes best on big inputs), or
   take it as the peer encoded it; the chunks sent later are views of it.
2. Open one ``Aggregate`` stream to every other *serving* member j and stream it the slice
   of part j, chunk by chunk. Member j reduces part j from all members' streams (a
   :class:`~swarmloco.net.averaging.reduction.PartReduction`): it checks and accumulates
   each chunk as it arrives and, when a chunk has every live contribution, quantizes the
   mean once and sends the same bytes back on every stream, then a signed hash of them
   (``Seal``). Everybody, j included, decodes those bytes into its result (or keeps them,
   for a result kept encoded), so every member holds the same bits, and takes the part as
   whole once the seal matches what it received and, for a serving member under the mean
   or the trimmed mean, once its *audit* passed: each chunk a member sends carries its
   signed statement (the chunk's root and norm), and the auditor recomputes one random
   segment of the part from its contributors' own bytes (``audit.py``); a reducer whose
   result is not their aggregate fails.
3. Failures (``view.py``): a member that goes silent, breaks its stream, stops making
   progress or refuses us is *failed* in our view; the parts it reduced move to the next
   serving member, which announces the rerun to everyone; senders that miss a chunk
   deadline are left out of the rest of that part; senders that send something invalid
   are struck (refused, counted). Every deadline is derived from the round deadline.
4. Agreement: a member that holds every part sends the digest of what it holds (made of
   the parts' seals) to every serving member (``MemberDone``); a serving member that holds
   its own result and has heard every live member answers each with its ``Verdict``; a
   member applies (returns) the result only if every live serving member agreed on its
   digest (announcements are signed and numbered, and a disagreeing verdict shows the
   signed ones that differed, so that a member telling two servers two digests, or a
   reducer sealing two results of one part, is proven two-faced: ``verdicts.py``).
   Otherwise, or when the round deadline passes, :class:`~swarmloco.errors.RoundAborted`
   is raised: nothing is applied, and every task and stream of the round is gone when it
   returns.

One :class:`Averager` per peer serves the ``Aggregate`` streams of every round it takes
part in (see :func:`averaging_service`). It does no I/O until ``all_reduce`` is called.
Given its server's :class:`~swarmloco.net.server.CallSlots`, it reserves the server's
capacity for the other members' hosts as a round starts, until the round's deadline: the
round's streams then never compete with strangers for a slot.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import grpc
import torch

from swarmloco.core.aggregate import AggregatorConfig
from swarmloco.core.codec import CodecConfig, Encoded, ErrorFeedback
from swarmloco.core.config import require, require_positive
from swarmloco.net.averaging import wire
from swarmloco.net.averaging.audit import Silent
from swarmloco.net.averaging.faults import FaultPlan
from swarmloco.net.averaging.group import GROUP_ID_BYTES, Group
from swarmloco.net.averaging.limiter import BandwidthLimiter
from swarmloco.net.averaging.report import AllReduceResult
from swarmloco.net.averaging.round import RoundRun
from swarmloco.net.client import RpcClient
from swarmloco.net.deadline import Deadline
from swarmloco.net.endpoints import parse_endpoint
from swarmloco.net.heap import release_after
from swarmloco.net.identity import Identity
from swarmloco.net.rejections import Rejection, RejectionLog
from swarmloco.net.server import CallSlots
from swarmloco.proto.v1 import averaging_pb2 as pb

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AveragingConfig:
    """How a peer all-reduces: codec, aggregator and the timeouts derived per round."""

    codec: CodecConfig = dataclasses.field(default_factory=CodecConfig)
    """Quantization on the wire (block size, scale type, chunk size, backend)."""
    aggregator: AggregatorConfig = dataclasses.field(default_factory=AggregatorConfig)
    """How a reducer combines the senders' chunks (mean, trimmed mean, CenteredClip)."""
    sender_timeout_s: float = 10.0
    """A sender whose next chunk is this late (after its previous chunk, or after another
    sender delivered that chunk) is left out of the rest of the part."""
    reducer_timeout_s: float = 20.0
    """A reducer that sends no result of a part we lack for this long has failed (must
    exceed sender_timeout_s: a reducer waits that long for slow senders)."""
    liveness_timeout_s: float = 10.0
    """A member we wait on that sends nothing at all (not even a heartbeat) for this long
    has failed (a frozen process, a dead link)."""
    heartbeat_s: float = 1.0
    """An idle stream carries a heartbeat this often."""
    open_timeout_s: float = 5.0
    """How long an incoming stream waits for its round to start on this peer."""
    close_grace_s: float = 2.0
    """After a round, how long streams get to deliver the last verdicts and close."""
    audit: bool = True
    """A serving member recomputes one random segment of every part another member
    reduced, from its senders' signed bytes, before it takes the part (``audit.py``;
    under the mean and the trimmed mean). Off: only for measuring what it costs."""

    def __post_init__(self) -> None:
        for name in (
            "sender_timeout_s",
            "reducer_timeout_s",
            "liveness_timeout_s",
            "heartbeat_s",
            "open_timeout_s",
            "close_grace_s",
        ):
            require_positive(name, getattr(self, name))
        require(
            self.reducer_timeout_s > self.sender_timeout_s,
            "reducer_timeout_s must exceed sender_timeout_s (reducers wait for slow senders)",
        )
        require(
            self.heartbeat_s * 2 <= self.liveness_timeout_s,
            "heartbeat_s must be at most half of liveness_timeout_s",
        )


class Averager:
    """Runs this peer's side of all-reduce rounds and serves other members' streams."""

    def __init__(
        self,
        *,
        identity: Identity,
        client: RpcClient,
        config: AveragingConfig | None = None,
        limiter: BandwidthLimiter | None = None,
        faults: FaultPlan | None = None,
        clock: Callable[[], float] = time.monotonic,
        slots: CallSlots | None = None,
    ) -> None:
        """``slots``: this peer's server's call slots (``PeerServer.slots``), to reserve
        for the members of each round; None in client mode (no server)."""
        self.identity = identity
        self.slots = slots
        self.client = client
        self.config = config or AveragingConfig()
        self.limiter = limiter
        self.faults = faults
        self.clock = clock
        self.rejections = RejectionLog(logger)
        self.stats: collections.Counter[str] = collections.Counter()
        self.silent = Silent()
        """Peers that left one of our audits unanswered (``audit.py``)."""
        self._rounds: dict[bytes, RoundRun] = {}
        self._finished: collections.deque[bytes] = collections.deque(maxlen=256)
        self._rounds_changed: asyncio.Condition | None = None
        self.scratch = Scratch()

    # -- the public API ----------------------------------------------------------------

    async def all_reduce(
        self,
        group: Group,
        vector: torch.Tensor | Encoded,
        *,
        deadline: Deadline,
        out: torch.Tensor | Encoded | None = None,
        error_feedback: ErrorFeedback | None = None,
    ) -> AllReduceResult:
        """Average ``vector`` with ``group``; RoundAborted if that fails by ``deadline``.

        ``vector``: flat, contiguous fp32 on CPU, padded to ``group.numel`` (whole codec
        blocks), quantized here; or already encoded by this peer's codec (a peer's update:
        see ``DilocoState.encode``), sent as it is. It is not modified. ``out``: where to
        put the mean, of the same kind (fp32: decoded into it; encoded: kept as the wire
        carried it, about a quarter of the memory), reused across rounds to spare the
        allocation (its contents are unspecified if the round aborts); a new fp32 tensor
        by default. ``error_feedback``: for an fp32 vector, send ``q(vector + residual)``
        and keep the new residual (an encoded vector was encoded with it); rolled back if
        the round aborts, committed when it returns a result.
        """
        self._check_vectors(group, vector, out)
        me = group.index_of(self.identity.peer_id_hex)
        if self.slots is not None:
            # Before any await: the other members open their streams as soon as they hold
            # the group, and a stream refused for want of a slot fails this peer.
            until = deadline.at + self.config.close_grace_s
            self.slots.reserve(_member_hosts(group, me), until=until)
        result = torch.empty(group.numel) if out is None else out
        rnd = RoundRun(self, group, me, vector, result, deadline, error_feedback)
        try:
            outcome = await rnd.run()
        except BaseException:
            if error_feedback is not None:
                error_feedback.rollback()  # the update was not averaged: keep all of it
            raise
        else:
            if error_feedback is not None:
                error_feedback.commit()
            return outcome
        finally:
            self._rounds.pop(group.group_id, None)
            self._finished.append(group.group_id)
            for buffer in rnd.buffers:
                self.scratch.give(buffer)

    def _check_vectors(
        self, group: Group, vector: torch.Tensor | Encoded, out: torch.Tensor | Encoded | None
    ) -> None:
        codec = self.config.codec
        if group.block_size != codec.block_size:
            raise ValueError(
                f"group uses blocks of {group.block_size}, codec of {codec.block_size}"
            )
        for name, given in (("vector", vector), ("out", vector if out is None else out)):
            if isinstance(given, Encoded):
                if (
                    not isinstance(vector, Encoded)
                    or given.numel != group.numel
                    or given.block_size != codec.block_size
                    or given.scales.dtype != codec.scale_torch_dtype
                ):
                    raise ValueError(
                        f"{name} must be a vector of {group.numel} values encoded in blocks "
                        f"of {codec.block_size} with {codec.scale_dtype} scales, as the "
                        "vector is"
                    )
            elif (
                isinstance(vector, Encoded)
                or given.dtype != torch.float32
                or given.dim() != 1
                or given.numel() != group.numel
                or not given.is_contiguous()
                or given.device.type != "cpu"
            ):
                raise ValueError(
                    f"{name} must be a flat, contiguous float32 CPU vector of {group.numel} "
                    f"values, as the vector is, got {given.dtype} {tuple(given.shape)}"
                )

    async def handle_aggregate(
        self, request_iterator: Any, context: grpc.aio.ServicerContext
    ) -> None:
        """The ``Aggregate`` stream handler: check the hello, hand the stream to its round."""
        first = await self._first_message(context)
        if first is None:
            return
        try:
            hello = wire.decode_request(first)
            if isinstance(hello, wire.ChunkMessage) or not hello.HasField("hello"):
                raise Rejection("malformed", "an Aggregate stream must start with a hello")
            # The hello's size first: reading its group id would copy it, however long.
            if hello.hello.ByteSize() > 128 or len(hello.hello.group_id) != GROUP_ID_BYTES:
                raise Rejection("malformed", f"a group id is {GROUP_ID_BYTES} bytes")
            rnd = await self._round_of(hello.hello.group_id, context)
            sender = rnd.check_hello(hello.hello)
        except Rejection as rejection:
            self.rejections.record(rejection, context.peer())
            release_after(len(first))
            await context.write(
                wire.response(refusal=pb.Refusal(code=rejection.code, reason=rejection.reason))
            )
            return
        await rnd.serve(sender, context)

    # -- serving helpers ---------------------------------------------------------------

    async def _first_message(self, context: grpc.aio.ServicerContext) -> bytes | None:
        try:
            async with asyncio.timeout(self.config.open_timeout_s):
                data = await context.read()
        except TimeoutError:
            return None
        return None if data is grpc.aio.EOF else bytes(data)

    def _condition(self) -> asyncio.Condition:
        if self._rounds_changed is None:
            self._rounds_changed = asyncio.Condition()
        return self._rounds_changed

    async def _round_of(self, group_id: bytes, context: grpc.aio.ServicerContext) -> RoundRun:
        if group_id in self._finished:
            raise Rejection("round-over", "that round is over on this peer")
        condition = self._condition()
        wait = min(self.config.open_timeout_s, context.time_remaining() or 0.0)
        try:
            async with asyncio.timeout(wait), condition:
                await condition.wait_for(lambda: group_id in self._rounds)
        except TimeoutError:
            raise Rejection(
                "unknown-group", "this peer takes part in no such round (yet)"
            ) from None
        return self._rounds[group_id]

    async def open_round(self, rnd: RoundRun) -> None:
        """Let the streams of ``rnd`` in (the round is ready for their chunks)."""
        self._rounds[rnd.group.group_id] = rnd
        condition = self._condition()
        async with condition:
            condition.notify_all()


def _member_hosts(group: Group, me: int) -> list[str]:
    """The hosts the other members serve at (client-mode members name none)."""
    hosts = []
    for index, member in enumerate(group.members):
        if index != me and member.endpoint:
            try:
                hosts.append(parse_endpoint(member.endpoint)[0])
            except ValueError:
                continue  # not an address anyone can dial: nothing to reserve
    return hosts


class Scratch:
    """Buffers reused from round to round: fresh memory costs a page fault per 4 KiB, which
    for a 100 MB model is more CPU than quantizing it. Up to ``keep`` of one size are kept
    (a robust reducer holds a few chunks' rows at once)."""

    def __init__(self, keep: int = 8) -> None:
        self._free: dict[tuple[torch.dtype, int], list[torch.Tensor]] = {}
        self._keep = keep

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        free = self._free.get((dtype, numel))
        return free.pop() if free else torch.empty(numel, dtype=dtype)

    def give(self, tensor: torch.Tensor) -> None:
        free = self._free.setdefault((tensor.dtype, tensor.numel()), [])
        if len(free) < self._keep:
            free.append(tensor)


def averaging_service_handlers(averager: Averager) -> dict[str, grpc.RpcMethodHandler]:
    """The ``Aggregate`` method handler (bytes in, bytes out: ``wire.py`` encodes)."""
    return {"Aggregate": grpc.stream_stream_rpc_method_handler(averager.handle_aggregate)}
