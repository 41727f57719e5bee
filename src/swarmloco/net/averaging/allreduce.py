"""The streamed int8 butterfly all-reduce of one group, over gRPC, surviving failures.

:meth:`Averager.all_reduce` averages a flat fp32 vector (padded to whole codec blocks) with
the members of a :class:`~swarmloco.net.averaging.group.Group` and returns the mean, which
every member that returns holds bit for bit, and a report of who counted where.

How a round runs, for member i (the pure pieces live in ``reduction.py`` and ``view.py``):

1. Quantize the whole vector once (the compiled codec amortizes best on big inputs); the
   chunks sent later are views of it.
2. Open one ``Aggregate`` stream to every other *serving* member j and stream it the slice
   of part j, chunk by chunk. Member j reduces part j from all members' streams (a
   :class:`~swarmloco.net.averaging.reduction.PartReduction`): it checks and accumulates
   each chunk as it arrives and, when a chunk has every live contribution, quantizes the
   mean once and sends the same bytes back on every stream. Everybody, j included,
   decodes those bytes into its result, so every member holds the same bits.
3. Failures (``view.py``): a member that goes silent, breaks its stream, stops making
   progress or refuses us is *failed* in our view; the parts it reduced move to the next
   serving member, which announces the rerun to everyone; senders that miss a chunk
   deadline are left out of the rest of that part; senders that send something invalid
   are struck (refused, counted). Every deadline is derived from the round deadline.
4. Agreement: a member that holds every part sends the digest of what it holds to every
   serving member (``MemberDone``); a serving member that holds its own result and has
   heard every live member answers each with its ``Verdict``; a member applies (returns)
   the result only if every live serving member agreed on its digest. Otherwise, or when
   the round deadline passes, :class:`~swarmloco.errors.RoundAborted` is raised: nothing
   is applied, and every task and stream of the round is gone when it returns.

One :class:`Averager` per peer serves the ``Aggregate`` streams of every round it takes
part in (see :func:`averaging_service`). It does no I/O until ``all_reduce`` is called.
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
from grpc._cython import cygrpc

from swarmloco.core.aggregate import AggregatorConfig
from swarmloco.core.codec import CodecConfig, dequantize_into_, quantize
from swarmloco.core.config import require, require_positive
from swarmloco.errors import NetworkError, RoundAborted
from swarmloco.net.averaging import wire
from swarmloco.net.averaging.faults import FaultCut, FaultPlan, Phase
from swarmloco.net.averaging.group import Group
from swarmloco.net.averaging.limiter import BandwidthLimiter
from swarmloco.net.averaging.reduction import PartReduction
from swarmloco.net.averaging.view import Claim, PartReport, RoundView
from swarmloco.net.client import RpcClient
from swarmloco.net.deadline import Deadline
from swarmloco.net.identity import Identity, verify
from swarmloco.net.rejections import Rejection, RejectionLog
from swarmloco.proto.v1 import averaging_pb2 as pb

logger = logging.getLogger(__name__)

_CLOSE = object()  # queue sentinel: the writer half-closes (client) or stops (server)


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


@dataclasses.dataclass(frozen=True)
class AllReduceReport:
    """What happened in one round, from one member's point of view."""

    round: int
    group_id: str
    me: str
    members: tuple[str, ...]
    """Peer ids in part order."""
    parts: tuple[PartReport, ...]
    """Per part: final reducer, epoch and how many leading chunks include each member."""
    excluded: dict[str, str]
    """Peer id -> why it was left out of something (failed, struck, missed a deadline)."""
    rejections: dict[str, int]
    """Rejected inputs during this round, by code."""
    bytes_sent: int
    bytes_received: int
    timings: dict[str, float]
    """Seconds: quantize, exchange (until we held every part), agreement, total."""
    agreed: int
    """Serving members whose verdict matched our digest."""
    digest: str


@dataclasses.dataclass(frozen=True)
class AllReduceResult:
    mean: torch.Tensor
    """The weighted mean, padded like the input; identical on every member that returns."""
    report: AllReduceReport


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
    ) -> None:
        self.identity = identity
        self.client = client
        self.config = config or AveragingConfig()
        self.limiter = limiter
        self.faults = faults
        self.clock = clock
        self.rejections = RejectionLog(logger)
        self.stats: collections.Counter[str] = collections.Counter()
        self._rounds: dict[bytes, _Round] = {}
        self._finished: collections.deque[bytes] = collections.deque(maxlen=256)
        self._rounds_changed: asyncio.Condition | None = None
        self.scratch = Scratch()

    # -- the public API ----------------------------------------------------------------

    async def all_reduce(
        self,
        group: Group,
        vector: torch.Tensor,
        *,
        deadline: Deadline,
        out: torch.Tensor | None = None,
    ) -> AllReduceResult:
        """Average ``vector`` with ``group``; RoundAborted if that fails by ``deadline``.

        ``vector``: flat, contiguous fp32 on CPU, padded to ``group.numel`` (whole codec
        blocks). It is not modified. ``out``: where to put the mean (a buffer of the same
        shape, reused across rounds to spare the allocation; its contents are unspecified
        if the round aborts); a new tensor by default.
        """
        for name, tensor in (("vector", vector), ("out", vector if out is None else out)):
            if tensor.dtype != torch.float32 or tensor.dim() != 1 or tensor.numel() != group.numel:
                raise ValueError(
                    f"{name} must be a flat float32 vector of {group.numel} values, got "
                    f"{tensor.dtype} {tuple(tensor.shape)}"
                )
        if group.block_size != self.config.codec.block_size:
            raise ValueError(
                f"group uses blocks of {group.block_size}, codec of {self.config.codec.block_size}"
            )
        me = group.index_of(self.identity.peer_id_hex)
        result = torch.empty(group.numel) if out is None else out
        rnd = _Round(self, group, me, vector.contiguous().cpu(), result, deadline)
        try:
            return await rnd.run()
        finally:
            self._rounds.pop(group.group_id, None)
            self._finished.append(group.group_id)
            for buffer in rnd.buffers:
                self.scratch.give(buffer)

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
            rnd = await self._round_of(hello.hello.group_id, context)
            sender = rnd.check_hello(hello.hello)
        except Rejection as rejection:
            self.rejections.record(rejection, context.peer())
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

    async def _round_of(self, group_id: bytes, context: grpc.aio.ServicerContext) -> _Round:
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

    async def _register(self, rnd: _Round) -> None:
        self._rounds[rnd.group.group_id] = rnd
        condition = self._condition()
        async with condition:
            condition.notify_all()


class Scratch:
    """Buffers reused from round to round: fresh memory costs a page fault per 4 KiB, which
    for a 100 MB model is more CPU than quantizing it."""

    def __init__(self, keep: int = 2) -> None:
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


# --------------------------------------------------------------------------- one round


class _Round:
    """Member ``me``'s side of one round: the pure view and reductions plus their I/O."""

    def __init__(
        self,
        averager: Averager,
        group: Group,
        me: int,
        vector: torch.Tensor,
        result: torch.Tensor,
        deadline: Deadline,
    ) -> None:
        self.a = averager
        self.cfg = averager.config
        self.group = group
        self.me = me
        self.n = group.size
        self.deadline = deadline
        self.vector = vector
        self.view = RoundView(group, me, self.cfg.codec)
        self.serving = group.members[me].serving
        self.servers = [i for i, m in enumerate(group.members) if m.serving]
        self.result = result
        self.buffers: list[torch.Tensor] = []
        self.q = self._take(group.numel, torch.int8)
        self.scales = self._take(group.numel // group.block_size, self.cfg.codec.scale_torch_dtype)
        self.reductions: dict[int, PartReduction] = {}
        self.backlog: dict[int, list[tuple[Phase, bytes]]] = {}
        self.outgoing: dict[int, _Outgoing] = {}
        self.incoming: dict[int, _Incoming] = {}
        self.struck: dict[int, str] = {}
        self.excluded: dict[int, str] = {}
        self.done: dict[int, bytes] = {}
        self.verdicts: dict[int, pb.Verdict] = {}
        self.verdict_sent = False
        self.my_done: bytes | None = None
        self.decided = False
        self.closing = False
        self.changed = asyncio.Event()
        self.error: BaseException | None = None
        now = averager.clock()
        self.started = now
        self.disagree_since: float | None = None
        self.last_result = dict.fromkeys(range(self.n), now)
        self.bytes_sent = 0
        self.bytes_received = 0
        self.timings: dict[str, float] = {}
        self.rejections_before = collections.Counter(averager.rejections.counts)
        self.handlers: set[asyncio.Task[Any]] = set()
        self.handlers_gone = asyncio.Event()
        self.handlers_gone.set()

    def _take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        buffer = self.a.scratch.take(numel, dtype)
        self.buffers.append(buffer)
        return buffer

    @property
    def peer_ids(self) -> list[str]:
        return [m.peer_id for m in self.group.members]

    def label(self, member: int) -> str:
        return self.group.members[member].peer_id[:12]

    # -- the driver ----------------------------------------------------------------------

    async def run(self) -> AllReduceResult:
        loop = asyncio.get_running_loop()
        if self.n == 1:
            return self._alone()
        try:
            async with asyncio.timeout_at(loop.time() + self.deadline.remaining()):
                try:
                    await self._exchange()
                finally:
                    await self._close_incoming()
        except TimeoutError:
            raise RoundAborted(
                f"round {self.group.round} missed its deadline; still lacking parts "
                f"{self.view.missing()}, failed members {self._failed_labels()}"
            ) from None
        return AllReduceResult(self.result, self._report())

    async def _exchange(self) -> None:
        t0 = self.a.clock()
        quantize(self.vector, self.cfg.codec, out=(self.q, self.scales))
        self.timings["quantize"] = self.a.clock() - t0
        aborted: RoundAborted | None = None
        async with asyncio.TaskGroup() as tg:
            for member in self.servers:
                if member != self.me:
                    out = _Outgoing(self, member)
                    self.outgoing[member] = out
                    out.task = tg.create_task(out.run())
            watchdog = tg.create_task(self._watchdog())
            if self.me in self.view.owner:
                self._start_reduction(self.me, 0)
            await self.a._register(self)
            try:
                await self._until_decided()
            except RoundAborted as exc:
                aborted = exc  # raised below: a TaskGroup would wrap it in an ExceptionGroup
            finally:
                watchdog.cancel()
                for out in self.outgoing.values():
                    if self.decided:
                        out.close()  # streams end once their server hung up
                    else:
                        out.abort()
        if aborted is not None:
            raise aborted
        self.timings["total"] = self.a.clock() - t0

    async def _until_decided(self) -> None:
        while True:
            if self.error is not None:
                raise self.error
            if self._evaluate():
                return
            await self.changed.wait()
            self.changed.clear()

    def _alone(self) -> AllReduceResult:
        t0 = self.a.clock()
        report = AllReduceReport(
            round=self.group.round,
            group_id=self.group.group_id.hex(),
            me=self.peer_ids[self.me],
            members=tuple(self.peer_ids),
            parts=(),
            excluded={},
            rejections={},
            bytes_sent=0,
            bytes_received=0,
            timings={"total": self.a.clock() - t0},
            agreed=1,
            digest="",
        )
        self.result.copy_(self.vector)
        return AllReduceResult(self.result, report)

    def _evaluate(self) -> bool:
        """Move the agreement forward; True once we may apply the result."""
        view = self.view
        if not view.complete:
            return False
        digest = view.digest()
        if digest != self.my_done:
            if self.my_done is None:
                self.timings["exchange"] = self.a.clock() - self.started
            self.my_done = digest
            self.done[self.me] = digest
            message = wire.request(done=pb.MemberDone(digest=digest))
            for member, out in self.outgoing.items():
                if member not in view.failed:
                    out.send(("done", message))
        alive = [x for x in range(self.n) if x not in view.failed]
        if self.serving and not self.verdict_sent and all(x in self.done for x in alive):
            differ = [self.label(x) for x in alive if self.done[x] != digest]
            if differ:
                # A member may hold an older result while a rerun notice is on its way to
                # it: give it time to catch up before declaring a disagreement.
                now = self.a.clock()
                self.disagree_since = self.disagree_since or now
                if now - self.disagree_since < self.cfg.reducer_timeout_s:
                    return False
            verdict = pb.Verdict(
                agreed=not differ,
                digest=digest,
                reason=f"members {differ} hold another result" if differ else "",
            )
            self.verdict_sent = True
            self.verdicts[self.me] = verdict
            message = wire.response(verdict=verdict)
            for inc in self.incoming.values():
                inc.send("verdict", message)
                inc.send_close()
        for member, verdict in self.verdicts.items():
            if not verdict.agreed or verdict.digest != digest:
                why = verdict.reason or "its result differs from ours"
                raise RoundAborted(
                    f"round {self.group.round}: member {self.label(member)} disagrees ({why}); "
                    "nothing applied"
                )
        servers = [x for x in self.servers if x not in view.failed]
        if not all(x in self.verdicts for x in servers):
            return False
        self.decided = True
        self.timings["agreement"] = self.a.clock() - self.started - self.timings["exchange"]
        return True

    async def _watchdog(self) -> None:
        cfg = self.cfg
        tick = min(max(cfg.heartbeat_s / 2, 0.02), 0.5)
        while True:
            await asyncio.sleep(tick)
            now = self.a.clock()
            for part, reduction in list(self.reductions.items()):
                for sender in reduction.expire(now):
                    self.excluded.setdefault(sender, reduction.left[sender])
                self._drain(part)
            for member in range(self.n):
                if member == self.me or member in self.view.failed:
                    continue
                # Silence is judged per stream: a member stuck in its handler may still
                # talk on the streams it opened to us, and the other way round.
                out = self.outgoing.get(member)
                if out is not None and self._waiting_on_output(member):
                    silent = now - out.last_heard
                    if silent > cfg.liveness_timeout_s:
                        self.fail(member, f"silent for {silent:.1f}s (its answers)")
                        continue
                if self._waiting_on_input(member):
                    inc = self.incoming.get(member)
                    silent = now - (inc.last_heard if inc is not None else self.started)
                    if silent > cfg.liveness_timeout_s:
                        self.fail(member, f"silent for {silent:.1f}s (its stream to us)")
                        continue
                waited = now - self.last_result[member]
                if waited > cfg.reducer_timeout_s and self._lacking_from(member):
                    self.fail(member, f"no result for {waited:.1f}s")
            self.changed.set()  # timers (a pending disagreement) are re-evaluated too

    def _waiting_on_output(self, member: int) -> bool:
        """Whether we still expect results or a verdict from serving member ``member``."""
        return self._lacking_from(member) or member not in self.verdicts

    def _waiting_on_input(self, member: int) -> bool:
        """Whether we still expect chunks or a digest on ``member``'s stream to us."""
        if self.serving and member not in self.done:
            return True
        return any(member in r.live and not r.done for r in self.reductions.values())

    def _lacking_from(self, member: int) -> bool:
        return any(
            claim.reducer == member and not self.view.part_complete(part)
            for part, claim in self.view.owner.items()
        )

    # -- reductions we run -------------------------------------------------------------

    def _start_reduction(self, part: int, epoch: int) -> None:
        view = self.view
        senders = [s for s in range(self.n) if s not in view.failed and s not in self.struck]
        reduction = PartReduction(
            part=part,
            epoch=epoch,
            spans=view.spans[part],
            weights=self.group.weights,
            senders=senders,
            codec=self.cfg.codec,
            aggregator=self.cfg.aggregator,
            timeout=self.cfg.sender_timeout_s,
            now=self.a.clock(),
            buffer=self._take(self.group.parts[part][1] * self.group.block_size, torch.float32)
            if self.cfg.aggregator.streaming
            else None,
        )
        self.reductions[part] = reduction
        self.backlog[part] = []
        if epoch > 0:
            logger.info(
                "round %d: reducing part %d (epoch %d) for failed member %s",
                self.group.round,
                part,
                epoch,
                self.label(part),
            )
            notice = wire.response(rerun=pb.Rerun(part=part, epoch=epoch))
            self.backlog[part].append(("rerun", notice))
            for inc in self.incoming.values():
                inc.send("rerun", notice)
        for index in range(reduction.chunks):
            payload, scales = self._slice(part, index)
            reduction.accept(self.me, index, payload, scales, self.a.clock(), remote=False)
        self._drain(part)

    def _slice(self, part: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Our quantized contribution to chunk ``index`` of ``part`` (views, no copy)."""
        first, _ = self.group.parts[part]
        span = self.view.spans[part][index]
        block = self.group.block_size
        start = (first + span.first_block) * block
        return (
            self.q[start : start + span.numel],
            self.scales[first + span.first_block : first + span.first_block + span.blocks],
        )

    def _drain(self, part: int) -> None:
        """Hand out every chunk of our reduction of ``part`` that is complete."""
        reduction = self.reductions.get(part)
        if reduction is None:
            return
        while reduction.ready():
            index, payload, scales, contributors = reduction.finish()
            bits = wire.bitmap(contributors, self.n)
            message = wire.encode_result(
                part=part,
                epoch=reduction.epoch,
                index=index,
                payload=payload,
                scales=scales,
                contributors=bits,
            )
            self.backlog[part].append(("result", message))
            for member, inc in self.incoming.items():
                if member not in self.struck:
                    inc.send("result", message)
            self._apply_result(part, reduction.epoch, self.me, index, payload, scales, bits)

    def _apply_result(
        self,
        part: int,
        epoch: int,
        reducer: int,
        index: int,
        payload: torch.Tensor,
        scales: torch.Tensor,
        bits: bytes,
    ) -> None:
        if not self.view.expects(part, epoch, reducer):
            self.a.stats["stale-results"] += 1
            return
        self.view.on_result(part, index, bits)
        span = self.view.spans[part][index]
        start = self.group.part_range(part)[0] + span.start
        # One multiply per element (q * s), the same on every member for the same bytes:
        # identical bits everywhere.
        dequantize_into_(self.result[start : start + span.numel], payload, scales, self.cfg.codec)
        self.last_result[reducer] = self.a.clock()
        self.changed.set()

    def _move(self, parts: list[int]) -> None:
        """Our view moved these parts to new claims: reset them and send them there."""
        for part in parts:
            claim = self.view.owner[part]
            old = self.reductions.get(part)
            if old is not None and (old.epoch, self.me) != (claim.epoch, claim.reducer):
                del self.reductions[part]
                self.backlog.pop(part, None)
            self.last_result[claim.reducer] = self.a.clock()
            if claim.reducer == self.me:
                self._start_reduction(part, claim.epoch)
            elif claim.reducer in self.outgoing:
                self.outgoing[claim.reducer].send(("part", part, claim.epoch))
        self.changed.set()

    # -- events ---------------------------------------------------------------------------

    def fail(self, member: int, reason: str) -> None:
        """``member`` failed in our view: stop waiting for it, move its parts on."""
        if member == self.me or member in self.view.failed or self.decided:
            return
        logger.info("round %d: member %s failed: %s", self.group.round, self.label(member), reason)
        self.excluded[member] = reason
        try:
            moved = self.view.fail(member, reason)
            if len(self.view.failed) == self.n - 1:
                # Our own vector is no average: keep it for the next round instead.
                raise RoundAborted(
                    f"round {self.group.round}: every other member failed (last: "
                    f"{self.label(member)}: {reason})"
                )
        except RoundAborted as exc:
            self.error = exc
            self.changed.set()
            return
        for part, reduction in list(self.reductions.items()):
            reduction.exclude(member, reason)
            self._drain(part)
        out = self.outgoing.get(member)
        if out is not None:
            out.abort()
        self._move(moved)

    def strike(self, member: int, rejection: Rejection) -> None:
        """``member`` sent invalid input: refuse it, count it, and fail it."""
        self.a.rejections.record(rejection, self.group.members[member].peer_id)
        self.struck[member] = rejection.reason
        inc = self.incoming.get(member)
        if inc is not None:
            refusal = pb.Refusal(code=rejection.code, reason=rejection.reason)
            inc.send("verdict", wire.response(refusal=refusal))
            inc.send_close()
        self.fail(member, f"struck: {rejection.reason}")

    def on_chunk(self, sender: int, chunk: wire.ChunkMessage) -> None:
        """A chunk arrived from ``sender``; Rejection if it must be struck."""
        if chunk.round != self.group.round:
            raise Rejection(
                "stale-round", f"chunk of round {chunk.round} in round {self.group.round}"
            )
        if chunk.group_id != self.group.group_id:
            raise Rejection("bad-group", "chunk of another group")
        if sender in self.struck or sender in self.view.failed:
            self.a.stats["late-chunks"] += 1
            return
        part = chunk.part
        if part not in self.view.owner:
            raise Rejection("bad-part", f"chunk of part {part}, which does not exist")
        ours = Claim(chunk.epoch, self.me)
        claim = self.view.owner[part]
        if claim != ours:
            if chunk.epoch == 0 or self.verdict_sent or not self.view.beats(part, ours, claim):
                if chunk.epoch == 0 and part != self.me:
                    raise Rejection("bad-part", f"part {part} is not reduced here")
                self.a.stats["stale-chunks"] += 1
                return
            self.view.notice(part, ours)
            self._move([part])
        reduction = self.reductions[part]
        if chunk.index >= reduction.chunks:
            raise Rejection(
                "bad-index", f"part {part} has {reduction.chunks} chunks, not {chunk.index + 1}"
            )
        span = reduction.spans[chunk.index]
        codec = self.cfg.codec
        wire.check_sizes(
            chunk.payload,
            chunk.scales,
            numel=span.numel,
            block_size=codec.block_size,
            scale_bytes=codec.scale_bytes,
        )
        payload = wire.tensor_from(chunk.payload, torch.int8)
        scales = wire.tensor_from(chunk.scales, codec.scale_torch_dtype)
        reduction.accept(sender, chunk.index, payload, scales, self.a.clock())
        self._drain(part)

    def on_done(self, sender: int, digest: bytes) -> None:
        self.done[sender] = digest
        self.changed.set()

    def on_result(self, reducer: int, result: wire.ResultMessage) -> None:
        """A result chunk from ``reducer``; Rejection if the reducer sent nonsense."""
        if not self.view.expects(result.part, result.epoch, reducer):
            self.a.stats["stale-results"] += 1
            return
        spans = self.view.spans[result.part]
        if result.index >= len(spans):
            raise Rejection("bad-result", f"result chunk {result.index} of part {result.part}")
        codec = self.cfg.codec
        wire.check_sizes(
            result.payload,
            result.scales,
            numel=spans[result.index].numel,
            block_size=codec.block_size,
            scale_bytes=codec.scale_bytes,
        )
        payload = wire.tensor_from(result.payload, torch.int8)
        scales = wire.tensor_from(result.scales, codec.scale_torch_dtype)
        try:
            self._apply_result(
                result.part,
                result.epoch,
                reducer,
                result.index,
                payload,
                scales,
                result.contributors,
            )
        except ValueError as exc:  # CodecError: NaN/Inf or negative scales
            raise Rejection("bad-result", str(exc)) from None

    def on_rerun(self, reducer: int, part: int, epoch: int) -> None:
        if self.view.notice(part, Claim(epoch, reducer)):
            self._move([part])

    def on_verdict(self, server: int, verdict: pb.Verdict) -> None:
        self.verdicts[server] = verdict
        self.changed.set()

    # -- incoming streams ----------------------------------------------------------------

    def check_hello(self, hello: pb.StreamHello) -> int:
        """The sender index of a valid hello; Rejection otherwise."""
        if hello.round != self.group.round:
            raise Rejection("stale-round", f"hello of round {hello.round}")
        if hello.reducer != self.me:
            raise Rejection("bad-hello", "the stream is meant for another member")
        sender = hello.sender
        if sender >= self.n or sender == self.me:
            raise Rejection("not-member", f"sender index {sender} is not another member")
        payload = wire.hello_payload(hello.group_id, hello.round, hello.sender, hello.reducer)
        if not verify(
            self.group.members[sender].public_key, hello.signature, wire.HELLO_DOMAIN, payload
        ):
            raise Rejection("not-member", "the hello is not signed by the member it names")
        if sender in self.struck:
            raise Rejection("struck", "this member was struck from the round")
        if sender in self.incoming:
            raise Rejection("duplicate", "this member already has a stream open")
        return sender

    async def serve(self, sender: int, context: grpc.aio.ServicerContext) -> None:
        if self.closing:
            return
        inc = _Incoming(self, sender, context)
        self.incoming[sender] = inc
        task = asyncio.current_task()
        assert task is not None
        self.handlers.add(task)
        self.handlers_gone.clear()
        for part in self.reductions:
            for phase, message in self.backlog.get(part, []):
                inc.send(phase, message)
        if self.verdict_sent:
            inc.send("verdict", wire.response(verdict=self.verdicts[self.me]))
            inc.send_close()
        try:
            await inc.run()
        finally:
            self.incoming.pop(sender, None)
            self.handlers.discard(task)
            if not self.handlers:
                self.handlers_gone.set()
            if not inc.clean and not self.decided:
                self.fail(sender, inc.end_reason or "its stream broke")

    async def _close_incoming(self) -> None:
        """End our side of the incoming streams: gracefully when committed, else now."""
        self.closing = True
        if self.decided:
            for member, inc in list(self.incoming.items()):
                if member in self.view.failed:
                    inc.abort()
            try:
                async with asyncio.timeout(self.cfg.close_grace_s):
                    await self.handlers_gone.wait()
            except TimeoutError:
                pass
        for inc in list(self.incoming.values()):
            inc.abort()
        await self.handlers_gone.wait()

    # -- bookkeeping -------------------------------------------------------------------

    def _failed_labels(self) -> list[str]:
        return [self.label(m) for m in self.view.failed]

    def _report(self) -> AllReduceReport:
        rejections = collections.Counter(self.a.rejections.counts)
        rejections.subtract(self.rejections_before)
        return AllReduceReport(
            round=self.group.round,
            group_id=self.group.group_id.hex(),
            me=self.peer_ids[self.me],
            members=tuple(self.peer_ids),
            parts=tuple(self.view.report()),
            excluded={self.peer_ids[m]: why for m, why in self.excluded.items()},
            rejections={code: n for code, n in rejections.items() if n > 0},
            bytes_sent=self.bytes_sent,
            bytes_received=self.bytes_received,
            timings=dict(self.timings),
            agreed=sum(1 for v in self.verdicts.values() if v.agreed and v.digest == self.my_done),
            digest=(self.my_done or b"").hex(),
        )

    # -- transport helpers -------------------------------------------------------------

    async def write_out(
        self,
        phase: Phase,
        member: int,
        message: bytes,
        write: Callable[[bytes], Any],
        call_bytes: int,
    ) -> int:
        """Send one message through the fault plan and the limiter; return bytes sent."""
        faults = self.a.faults
        if faults is not None:
            peer = self.group.members[member].peer_id
            changed = await faults.outgoing(
                phase, peer=peer, round=self.group.round, message=message, call_bytes=call_bytes
            )
            if changed is None:
                return 0
            message = changed
        if self.a.limiter is not None:
            await self.a.limiter.upload(len(message))
        await write(message)
        self.bytes_sent += len(message)
        return len(message)

    async def received(self, stream: _Outgoing | _Incoming, data: bytes) -> None:
        stream.last_heard = self.a.clock()
        self.bytes_received += len(data)
        if self.a.limiter is not None:
            await self.a.limiter.download(len(data))


# --------------------------------------------------------------------------- streams

# What a broken stream raises: on the client side an AioRpcError, or InvalidStateError
# ("RPC already finished") when writing to a call that just ended; on the server side,
# reading from or writing to a stream whose client vanished raises grpc's internal
# ExecuteBatchError (a cygrpc.BaseError); a cut scripted by the fault plan raises FaultCut.
_STREAM_ERRORS = (
    grpc.aio.AioRpcError,
    asyncio.InvalidStateError,
    cygrpc.BaseError,
    NetworkError,
    FaultCut,
)


class _Outgoing:
    """Our stream to serving member ``member``: our slices out, its results back."""

    def __init__(self, rnd: _Round, member: int) -> None:
        self.rnd = rnd
        self.member = member
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
        self.queue.put_nowait(_CLOSE)

    def abort(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()

    async def run(self) -> None:
        rnd = self.rnd
        endpoint = rnd.group.members[self.member].endpoint
        call = rnd.a.client.channel(endpoint).stream_stream(wire.AGGREGATE_PATH)(
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
                if job is _CLOSE:
                    await call.done_writing()
                    return
                if job[0] == "part":
                    await self._send_part(call, job[1], job[2])
                else:
                    await self._send(call, job[0], job[1])
        except _STREAM_ERRORS as exc:
            self._broken(f"sending to it failed: {_describe(exc)}")

    async def _send_part(self, call: Any, part: int, epoch: int) -> None:
        rnd = self.rnd
        claim = Claim(epoch, self.member)
        for index in range(len(rnd.view.spans[part])):
            if rnd.view.owner.get(part) != claim:
                return  # the part moved on meanwhile
            payload, scales = rnd._slice(part, index)
            message = wire.encode_chunk(
                group_id=rnd.group.group_id,
                round=rnd.group.round,
                part=part,
                epoch=epoch,
                index=index,
                payload=payload,
                scales=scales,
            )
            await self._send(call, "chunk", message)

    async def _send(self, call: Any, phase: Phase, message: bytes) -> None:
        self.sent += await self.rnd.write_out(phase, self.member, message, call.write, self.sent)

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
                await rnd.received(self, data)
                try:
                    self._dispatch(wire.decode_response(data))
                except Rejection as rejection:
                    rnd.a.rejections.record(rejection, rnd.group.members[member].peer_id)
                    self._broken(f"it sent invalid data: {rejection.reason}")
                    return
        except _STREAM_ERRORS as exc:
            self._broken(f"its stream broke: {_describe(exc)}")

    def _dispatch(self, message: wire.ResultMessage | pb.AggregateResponse) -> None:
        rnd = self.rnd
        if isinstance(message, wire.ResultMessage):
            rnd.on_result(self.member, message)
            return
        kind = message.WhichOneof("kind")
        if kind == "rerun":
            rnd.on_rerun(self.member, message.rerun.part, message.rerun.epoch)
        elif kind == "verdict":
            self.verdict = True
            rnd.on_verdict(self.member, message.verdict)
            self.close()
        elif kind == "refusal":
            self._broken(f"it refused us: {message.refusal.reason}")
        elif kind != "heartbeat":
            raise Rejection("malformed", f"unexpected {kind or 'empty'} message")


class _Incoming:
    """A member's stream to us: its chunks in, our results, notices and verdict out."""

    def __init__(self, rnd: _Round, sender: int, context: grpc.aio.ServicerContext) -> None:
        self.rnd = rnd
        self.sender = sender
        self.peer = rnd.group.members[sender].peer_id
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
            self.queue.put_nowait(_CLOSE)

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
                await rnd.received(self, data)
                try:
                    message = wire.decode_request(data)
                    if isinstance(message, wire.ChunkMessage):
                        rnd.on_chunk(self.sender, message)
                        continue
                    kind = message.WhichOneof("kind")
                    if kind == "done":
                        rnd.on_done(self.sender, bytes(message.done.digest))
                    elif kind != "heartbeat":
                        raise Rejection("malformed", f"unexpected {kind or 'empty'} message")
                except Rejection as rejection:
                    rnd.strike(self.sender, rejection)
                    self.clean = True
                    return
        except _STREAM_ERRORS as exc:
            self.end_reason = f"its stream broke: {_describe(exc)}"

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
                if item is _CLOSE:
                    return
                await self._stall_point()
                phase, message = item
                sent += await rnd.write_out(phase, self.sender, message, self.context.write, sent)
        except _STREAM_ERRORS as exc:
            self.end_reason = f"sending to it failed: {_describe(exc)}"
            for task in self._tasks:
                if task is not asyncio.current_task():
                    task.cancel()


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {(exc.details() or '').strip()}"
    return str(exc) or type(exc).__name__
