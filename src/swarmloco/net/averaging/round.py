"""One member's side of one all-reduce round: the driver that joins the pure pieces
(:class:`~.view.RoundView`, :class:`~.reduction.PartReduction`) to the streams.

:class:`RoundRun` opens a stream to every other serving member, serves the streams other
members open to it, runs the reductions of the parts it holds, decodes every result into
the output, moves parts to backups when members fail (``view.py``), and drives the
agreement: ``MemberDone`` digests out, ``Verdict`` back, apply only if every live serving
member agreed (see ``allreduce.py`` for the whole protocol). Everything it starts ends
with it: its tasks run in one TaskGroup, the handlers of its incoming streams are awaited
before it returns, and a failed round raises RoundAborted after all of that is gone.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc
import torch

from swarmloco.core.codec import ErrorFeedback, dequantize_into_, l2_norm, quantize
from swarmloco.errors import RoundAborted, SwarmlocoError
from swarmloco.net.averaging import wire
from swarmloco.net.averaging.faults import Phase
from swarmloco.net.averaging.group import Group
from swarmloco.net.averaging.reduction import PartReduction
from swarmloco.net.averaging.report import AllReduceReport, AllReduceResult
from swarmloco.net.averaging.streams import IncomingStream, OutgoingStream
from swarmloco.net.averaging.view import Claim, RoundView
from swarmloco.net.deadline import Deadline
from swarmloco.net.identity import verify
from swarmloco.net.rejections import Rejection
from swarmloco.proto.v1 import averaging_pb2 as pb

if TYPE_CHECKING:
    from swarmloco.net.averaging.allreduce import Averager

logger = logging.getLogger("swarmloco.net.averaging.allreduce")


class RoundRun:
    """Member ``me``'s side of one round (see the module docstring)."""

    def __init__(
        self,
        averager: Averager,
        group: Group,
        me: int,
        vector: torch.Tensor,
        result: torch.Tensor,
        deadline: Deadline,
        error_feedback: ErrorFeedback | None = None,
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
        self.error_feedback = error_feedback
        self.norm_bound = group.norm_bound(self.cfg.aggregator.norm_clip)
        self.clipped = 1.0
        self.buffers: list[torch.Tensor] = []
        self.q = torch.empty(0, dtype=torch.int8)
        self.scales = torch.empty(0)
        self.reductions: dict[int, PartReduction] = {}
        self.backlog: dict[int, list[tuple[Phase, bytes]]] = {}
        self.outgoing: dict[int, OutgoingStream] = {}
        self.incoming: dict[int, IncomingStream] = {}
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
        except RoundAborted:
            raise
        except Exception as exc:
            # Whatever other members sent, a round ends in RoundAborted: an error raised
            # while handling their messages (an ExceptionGroup of our tasks) must not take
            # the peer down. It is a bug on our side or an input we failed to refuse, so
            # say where.
            logger.exception("round %d failed on an unexpected error", self.group.round)
            raise RoundAborted(
                f"round {self.group.round} failed: {type(exc).__name__}: {exc}"
            ) from exc
        return AllReduceResult(self.result, self._report())

    def _bounded(self, vector: torch.Tensor) -> torch.Tensor:
        """``vector``, scaled down to the group's norm bound if it exceeds it (a copy; the
        caller's vector stays as it is)."""
        if not math.isfinite(self.norm_bound):
            return vector
        norm = l2_norm(vector)
        if norm <= self.norm_bound:
            return vector
        # A hair below the bound, so that float rounding cannot take it past.
        self.clipped = self.norm_bound / norm * (1 - 1e-6)
        clipped = self._take(vector.numel(), torch.float32)
        torch.mul(vector, self.clipped, out=clipped)
        logger.info(
            "round %d: our update's norm %.3g is above the group's bound %.3g: scaled by %.3g",
            self.group.round,
            norm,
            self.norm_bound,
            self.clipped,
        )
        return clipped

    async def _exchange(self) -> None:
        t0 = self.a.clock()
        if self.error_feedback is not None:
            self.q, self.scales = self.error_feedback.encode(self.vector, max_norm=self.norm_bound)
        else:
            self.vector = self._bounded(self.vector)
            codec = self.cfg.codec
            self.q = self._take(self.group.numel, torch.int8)
            self.scales = self._take(self.group.numel // codec.block_size, codec.scale_torch_dtype)
            quantize(self.vector, codec, out=(self.q, self.scales))
        self.timings["quantize"] = self.a.clock() - t0
        aborted: RoundAborted | None = None
        async with asyncio.TaskGroup() as tg:
            for member in self.servers:
                if member != self.me:
                    out = OutgoingStream(self, member)
                    self.outgoing[member] = out
                    out.task = tg.create_task(out.run())
            watchdog = tg.create_task(self._watchdog())
            if self.me in self.view.owner:
                self._start_reduction(self.me, 0)
            await self.a.open_round(self)
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
        last, judged = self.a.clock(), True
        resumed = self.started  # silence before this was (also) ours
        while True:
            await asyncio.sleep(tick)
            now = self.a.clock()
            late, last = now - last - tick, now
            if late > tick and judged:
                # Our own loop stalled (a GC pause, a blocking call): what the members sent
                # meanwhile is queued, not lost, and their silence was ours. From now on
                # each member has a whole liveness timeout to be heard (what it sent may
                # take more than a tick to come through); judge again on the next tick (a
                # loop late on every tick still judges every other tick).
                judged, resumed = False, now
                continue
            judged = True
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
                    silent = now - max(out.last_heard, resumed)
                    if silent > cfg.liveness_timeout_s:
                        self.fail(member, f"silent for {silent:.1f}s (its answers)")
                        continue
                if self._waiting_on_input(member):
                    inc = self.incoming.get(member)
                    silent = now - max(inc.last_heard if inc is not None else 0.0, resumed)
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
            norm_bound=self.norm_bound,
            buffer=self._take(self.group.parts[part][1] * self.group.block_size, torch.float32)
            if self.cfg.aggregator.streaming
            else None,
            take=lambda numel: self._take(numel, torch.float32),
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
            payload, scales = self.slice_of(part, index)
            try:
                reduction.accept(self.me, index, payload, scales, self.a.clock(), remote=False)
            except Rejection as rejection:  # what the others would refuse from us
                self.error = RoundAborted(
                    f"round {self.group.round}: this peer's own update cannot be averaged: "
                    f"{rejection.reason}"
                )
                self.changed.set()
                return
        self._drain(part)

    def slice_of(self, part: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
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
            try:
                index, payload, scales, contributors = reduction.finish()
            except RoundAborted as exc:
                self.error = exc  # nothing of a broken mean may leave this member
                self.changed.set()
                return
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
        self.view.check_result(part, index, bits)
        span = self.view.spans[part][index]
        start = self.group.part_range(part)[0] + span.start
        # One multiply per element (q * s), the same on every member for the same bytes:
        # identical bits everywhere. Recorded as received only once decoded: a chunk the
        # decoder refuses (NaN or huge scales) must leave its part incomplete, so that
        # failing its reducer moves the part on (a complete part would stay, its slice of
        # the result whatever the reused buffer held, different on every member).
        dequantize_into_(self.result[start : start + span.numel], payload, scales, self.cfg.codec)
        self.view.on_result(part, index, bits)
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
        except SwarmlocoError as exc:  # CodecError: NaN/Inf, negative or huge scales
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
        inc = IncomingStream(self, sender, context)
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
            norm_bound=self.norm_bound,
            clipped=self.clipped,
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

    async def received(self, stream: OutgoingStream | IncomingStream, data: bytes) -> None:
        stream.last_heard = self.a.clock()
        self.bytes_received += len(data)
        if self.a.limiter is not None:
            await self.a.limiter.download(len(data))
