"""One member's side of one all-reduce round: the driver that joins the pure pieces to the
streams.

:class:`RoundRun` opens a stream to every other serving member, serves the streams other
members open to it, decodes every result into the output, moves parts to backups when
members fail (``view.py``), and drives the agreement: ``MemberDone`` digests out,
``Verdict`` back, apply only if every live serving member agreed (see ``allreduce.py`` for
the whole protocol). Its parts, each owning one job and its state:

- :class:`~.contribution.Contribution`: the sender side, our update bounded, quantized
  once and cut into chunks;
- :class:`~.reducing.Reductions`: the reducer side, the parts we reduce and what they sent;
- :class:`~.output.Output`: the result, every chunk checked and decoded into it;
- :class:`~.view.RoundView`: which member reduces which part, and what we hold of each;
- :class:`~.audit.Auditor`: the audits we run of the parts others reduce;
- :class:`~.liveness.Watch`: per-member deadlines, judged on the watchdog's ticks;
- :class:`~.verdicts.Agreement`: digests and verdicts, and whether we may apply;
- :class:`~.outgoing.Outgoing`, :class:`~.incoming.Incoming`: the streams each way, and
  :class:`~.traffic.Traffic`: the bytes they carry, through the fault plan and the limiter.

Everything it starts ends with it: its tasks run in one TaskGroup, the handlers of its
incoming streams are awaited before it returns, and a failed round raises RoundAborted
after all of that is gone.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import hashlib
import logging
import secrets
from typing import TYPE_CHECKING

import grpc
import torch

from swarmloco.core.codec import Encoded, ErrorFeedback
from swarmloco.errors import RoundAborted
from swarmloco.net.averaging import wire
from swarmloco.net.averaging.audit import (
    Audit,
    Auditor,
    Claimed,
    Outcome,
    Running,
    Statement,
    piece_of,
    restated,
    segment_of,
    segments_of,
    signed_by_sender,
)
from swarmloco.net.averaging.contribution import Contribution
from swarmloco.net.averaging.group import Group
from swarmloco.net.averaging.incoming import Incoming
from swarmloco.net.averaging.liveness import Watch
from swarmloco.net.averaging.outgoing import Outgoing
from swarmloco.net.averaging.output import Output, decode_chunk
from swarmloco.net.averaging.reducing import Reductions
from swarmloco.net.averaging.report import AllReduceReport, AllReduceResult
from swarmloco.net.averaging.streams import IncomingStream, OutgoingStream
from swarmloco.net.averaging.traffic import Traffic
from swarmloco.net.averaging.verdicts import Agreement
from swarmloco.net.averaging.view import (
    PART_HASH_BYTES,
    RESULT_DIGEST_BYTES,
    Claim,
    RoundView,
    SealedResult,
    digest_of,
)
from swarmloco.net.deadline import Deadline
from swarmloco.net.identity import verify
from swarmloco.net.rejections import Rejection
from swarmloco.proto.v1 import averaging_pb2 as pb

if TYPE_CHECKING:
    from swarmloco.net.averaging.allreduce import Averager

logger = logging.getLogger("swarmloco.net.averaging.allreduce")


def check_hello(hello: pb.StreamHello, group: Group, me: int) -> int:
    """The sender index of a hello that opens a stream to member ``me`` of ``group``, signed
    by the member it names; Rejection otherwise."""
    if hello.round != group.round:
        raise Rejection("stale-round", f"hello of round {hello.round}")
    if hello.reducer != me:
        raise Rejection("bad-hello", "the stream is meant for another member")
    sender = hello.sender
    if sender >= group.size or sender == me:
        raise Rejection("not-member", f"sender index {sender} is not another member")
    payload = wire.hello_payload(hello.group_id, hello.round, hello.sender, hello.reducer)
    if not verify(group.members[sender].public_key, hello.signature, wire.HELLO_DOMAIN, payload):
        raise Rejection("not-member", "the hello is not signed by the member it names")
    return sender


def check_seal(seal: pb.Seal, group: Group) -> None:
    """Rejection unless ``seal`` is signed by the member it names as its reducer."""
    if seal.reducer >= group.size or len(seal.hash) != PART_HASH_BYTES:
        raise Rejection("malformed", "a seal of no member, or of a hash of another size")
    payload = wire.seal_payload(group.group_id, group.round, seal)
    if not verify(
        group.members[seal.reducer].public_key, seal.signature, wire.SEAL_DOMAIN, payload
    ):
        raise Rejection("bad-signature", "a seal not signed by its reducer")


def check_statements(answer: pb.Statements, group: Group, reducer: int) -> bool:
    """Whether ``reducer`` signed ``answer``, its answer to an audit."""
    payload = wire.statements_payload(group.group_id, group.round, reducer, answer)
    return verify(
        group.members[reducer].public_key, answer.signature, wire.STATEMENTS_DOMAIN, payload
    )


def check_done(
    done: pb.MemberDone, group: Group, member: int, verified: set[bytes] | None = None
) -> None:
    """Rejection unless ``done`` is an announcement signed by ``member`` of ``group`` for
    its round, of the digest its seals make, one seal per part, each signed by its
    reducer. ``verified``: seals (serialized) known good, which need no second look; the
    ones found good are added."""
    if len(done.digest) != RESULT_DIGEST_BYTES:
        raise Rejection(
            "malformed", f"a digest of {len(done.digest)} bytes, not {RESULT_DIGEST_BYTES}"
        )
    if done.seq < 1:
        raise Rejection("malformed", "an announcement numbered 0")
    payload = wire.done_payload(group.group_id, group.round, member, done.seq, done.digest)
    if not verify(group.members[member].public_key, done.signature, wire.DONE_DOMAIN, payload):
        raise Rejection("bad-signature", "an announcement not signed by its member")
    parts = [p for p, (_, blocks) in enumerate(group.parts) if blocks]
    if [seal.part for seal in done.seals] != parts:
        raise Rejection("malformed", "an announcement without one seal per part, in order")
    if digest_of(group.group_id, group.round, done.seals) != done.digest:
        raise Rejection("malformed", "an announcement of another digest than its seals make")
    for seal in done.seals:
        key = seal.SerializeToString()
        if verified is None or key not in verified:
            check_seal(seal, group)
            if verified is not None:
                verified.add(key)


def check_chunk(chunk: wire.ChunkMessage, group: Group) -> None:
    """Rejection unless ``chunk`` belongs to ``group``'s round."""
    if chunk.round != group.round:
        raise Rejection("stale-round", f"chunk of round {chunk.round} in round {group.round}")
    if chunk.group_id != group.group_id:
        raise Rejection("bad-group", "chunk of another group")


def alone(
    group: Group, me: int, vector: torch.Tensor | Encoded, result: torch.Tensor | Encoded
) -> AllReduceResult:
    """A group of one: its own vector is the mean, and nothing was exchanged."""
    peer_ids = tuple(m.peer_id for m in group.members)
    report = AllReduceReport(
        round=group.round,
        group_id=group.group_id.hex(),
        me=peer_ids[me],
        members=peer_ids,
        parts=(),
        excluded={},
        rejections={},
        bytes_sent=0,
        bytes_received=0,
        timings={"total": 0.0},
        agreed=1,
        digest="",
    )
    if isinstance(vector, Encoded) and isinstance(result, Encoded):
        result.payload.copy_(vector.payload)
        result.scales.copy_(vector.scales)
    else:
        assert isinstance(vector, torch.Tensor) and isinstance(result, torch.Tensor)
        result.copy_(vector)
    return AllReduceResult(result, report)


class RoundRun:
    """Member ``me``'s side of one round (see the module docstring)."""

    def __init__(
        self,
        averager: Averager,
        group: Group,
        me: int,
        vector: torch.Tensor | Encoded,
        result: torch.Tensor | Encoded,
        deadline: Deadline,
        error_feedback: ErrorFeedback | None = None,
    ) -> None:
        self.a = averager
        self.cfg = cfg = averager.config
        self.group = group
        self.me = me
        self.n = group.size
        self.deadline = deadline
        self.vector = vector
        self.view = RoundView(group, me, cfg.codec)
        self.serving = group.members[me].serving
        self.servers = [i for i, m in enumerate(group.members) if m.serving]
        self.output = Output(
            result=result, group=group, view=self.view, codec=cfg.codec, aggregator=cfg.aggregator
        )
        self.error_feedback = error_feedback
        self.buffers: list[torch.Tensor] = []
        self.ours = Contribution(
            group=group,
            view=self.view,
            codec=cfg.codec,
            norm_bound=group.norm_bound(cfg.aggregator.norm_clip),
            take=self._take,
        )
        self.reducing = Reductions(
            group=group,
            view=self.view,
            me=me,
            config=cfg,
            contribution=self.ours,
            clock=averager.clock,
            take=lambda numel: self._take(numel, torch.float32),
            sign=averager.identity.sign,
        )
        self.auditor = Auditor(draw=secrets.randbelow)
        self.auditing = cfg.audit and self.serving
        """Whether we audit the parts other members reduce (``audit.py``)."""
        self._answered: collections.Counter[tuple[str, int]] = collections.Counter()
        self.liars: set[int] = set()
        """Members our audits caught lying this round (or another auditor's proof)."""
        self._proofs: set[tuple[int, int, int, bool]] = set()
        """(prover, part, epoch, on our stream to it) of every proof shown us: one each."""
        self._judged_proofs: set[tuple[int, int, int]] = set()
        """(prover, part, epoch) of the proofs we judged (or could not)."""
        self._waiting_proofs: dict[int, dict[int, pb.Proof]] = {}
        """Per part, per prover: proofs of the part's claim that wait for its seal."""
        self.agreement = Agreement(
            me=me, serving=self.serving, patience=cfg.reducer_timeout_s, label=self.label
        )
        self.started = now = averager.clock()
        self.watch = Watch(members=self.n, started=now, config=cfg)
        self.outgoing = Outgoing()
        self.incoming = Incoming(close_grace_s=cfg.close_grace_s)
        self.struck: dict[int, str] = {}
        self.excluded: dict[int, str] = {}
        self.changed = asyncio.Event()
        self.error: BaseException | None = None
        self.traffic = Traffic(
            round=group.round,
            faults=averager.faults,
            limiter=averager.limiter,
            clock=averager.clock,
            forge_done=self._forged_done,
            seal=self._seal_message,
            restate=self._restated_chunk,
        )
        self.timings: dict[str, float] = {}
        self.seals_verified: set[bytes] = set()
        """Seals (serialized) whose signatures we checked or made."""
        self.rejections_before = collections.Counter(averager.rejections.counts)

    def _take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        buffer = self.a.scratch.take(numel, dtype)
        self.buffers.append(buffer)
        return buffer

    @property
    def peer_ids(self) -> list[str]:
        return [m.peer_id for m in self.group.members]

    @property
    def done(self) -> dict[int, bytes]:
        """The digest each member announced (ours included)."""
        return self.agreement.done

    @property
    def decided(self) -> bool:
        """Every live serving member agreed with our result: it is applied."""
        return self.agreement.decided

    def label(self, member: int) -> str:
        return self.group.members[member].peer_id[:12]

    def slice_of(self, part: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Our quantized contribution to chunk ``index`` of ``part`` (views, no copy)."""
        return self.ours.slice_of(part, index)

    def chunk_message(self, reducer: int, part: int, epoch: int, index: int) -> bytes:
        """Our chunk ``index`` of ``part`` for ``reducer`` at ``epoch``, with our statement."""
        return self.ours.chunk_message(
            reducer, part, epoch, index, sender=self.me, sign=self.a.identity.sign
        )

    # -- the driver ----------------------------------------------------------------------

    async def run(self) -> AllReduceResult:
        loop = asyncio.get_running_loop()
        if self.n == 1:
            return alone(self.group, self.me, self.vector, self.output.result)
        try:
            async with asyncio.timeout_at(loop.time() + self.deadline.remaining()):
                try:
                    await self._exchange()
                finally:
                    await self.incoming.close(committed=self.decided, failed=self.view.failed)
        except TimeoutError:
            raise RoundAborted(
                f"round {self.group.round} missed its deadline; still lacking parts "
                f"{self.view.missing()}, failed members {[self.label(m) for m in self.view.failed]}"
            ) from None
        except RoundAborted as exc:
            # Whoever our audits caught lying is named, as a two-faced member is.
            caught = frozenset(self.peer_ids[m] for m in self.liars)
            exc.dissenters |= caught
            exc.out_of_line |= caught
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
        return AllReduceResult(self.output.result, self._report())

    async def _exchange(self) -> None:
        t0 = self.a.clock()
        self.ours.encode(self.vector, self.error_feedback)
        self.timings["quantize"] = self.a.clock() - t0
        aborted: RoundAborted | None = None
        async with asyncio.TaskGroup() as tg:
            others = [m for m in self.servers if m != self.me]
            self.outgoing.open((OutgoingStream(self, m) for m in others), tg)
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
                self.outgoing.end(committed=self.decided)
        if aborted is not None:
            raise aborted
        self.timings["total"] = self.a.clock() - t0

    def _abort(self, error: RoundAborted) -> None:
        """End the round with ``error``: the driver raises it, not the handler that saw it."""
        self.error = error
        self.changed.set()

    async def _until_decided(self) -> None:
        while True:
            if self.error is not None:
                raise self.error
            if self._evaluate():
                return
            await self.changed.wait()
            self.changed.clear()

    def _evaluate(self) -> bool:
        """Move the agreement forward; True once we may apply the result."""
        view = self.view
        if not view.complete:
            return False
        first = self.agreement.my_done is None
        servers = [x for x in self.servers if x not in view.failed]
        seals = view.seals()
        step = self.agreement.step(view.digest(), servers=servers, now=self.a.clock(), seals=seals)
        if step.announce is not None:
            if first:
                self.timings["exchange"] = self.a.clock() - self.started
            done = self._signed_done(step.announce, self.agreement.seq)
            done.seals.extend(seals)
            message = wire.request(done=done)
            self.outgoing.send(("done", message), skip=view.failed)
        if step.verdict is not None:
            self.incoming.send_last("verdict", wire.response(verdict=step.verdict))
        if step.disagreement is not None:
            members = self.group.members
            raise RoundAborted(
                f"round {self.group.round}: {step.disagreement}; nothing applied",
                dissenters=frozenset(members[x].peer_id for x in step.dissenters),
                out_of_line=frozenset(members[x].peer_id for x in step.out_of_line),
            )
        if step.decided:
            self.timings["agreement"] = self.a.clock() - self.started - self.timings["exchange"]
        return step.decided

    async def _watchdog(self) -> None:
        watch = self.watch
        watch.start(self.a.clock())
        while True:
            await asyncio.sleep(watch.tick)
            now = self.a.clock()
            if not watch.judges(now):
                continue
            for sender, reason in self.reducing.expire(now).items():
                self.excluded.setdefault(sender, reason)
            self._expire_audits(now)
            for part in list(self.reducing.active):
                self._drain(part)
            for member in range(self.n):
                if member == self.me or member in self.view.failed:
                    continue
                why = watch.silence(
                    member,
                    now,
                    answers_heard=self._answers_heard(member),
                    stream_heard=self._stream_heard(member),
                    lacking=self._lacking_from(member),
                )
                if why is not None:
                    self.fail(member, why)
            self.changed.set()  # timers (a pending disagreement) are re-evaluated too

    def _answers_heard(self, member: int) -> float | None:
        """When serving member ``member`` was last heard on our stream to it (None: we
        expect no more results or verdict from it)."""
        if self._lacking_from(member) or member not in self.agreement.verdicts:
            return self.outgoing.last_heard(member)
        return None

    def _stream_heard(self, member: int) -> float | None:
        """When ``member`` was last heard on its stream to us (None: we expect no more
        chunks or digest on it)."""
        if (self.serving and member not in self.done) or self.reducing.waiting_on(member):
            inc = self.incoming.streams.get(member)
            return inc.last_heard if inc is not None else 0.0
        return None

    def _lacking_from(self, member: int) -> bool:
        return any(
            claim.reducer == member and not self.view.part_complete(part)
            for part, claim in self.view.owner.items()
        )

    # -- reductions we run -------------------------------------------------------------

    def _start_reduction(self, part: int, epoch: int) -> None:
        view = self.view
        senders = [s for s in range(self.n) if s not in view.failed and s not in self.struck]
        try:
            notice = self.reducing.start(part, epoch, senders)
        except RoundAborted as exc:
            self._abort(exc)
            return
        if notice is not None:
            self.incoming.send("rerun", notice)
        self._drain(part)

    def _drain(self, part: int) -> None:
        """Hand out every chunk of our reduction of ``part`` that is complete."""
        while True:
            try:
                done = self.reducing.finish_next(part)
            except RoundAborted as exc:
                self._abort(exc)  # nothing of a broken mean may leave this member
                return
            if done is None:
                return
            self.incoming.send("result", done.message, skip=self.struck)
            ours = (part, done.epoch, self.me, done.index, done.payload, done.scales)
            applied = self.output.apply(*ours, done.contributors, done.message)
            if applied and self.view.chunks_complete(part):
                self._seal(part, done.epoch)
            self._landed(self.me, applied)

    def _seal(self, part: int, epoch: int) -> None:
        """We sent every result chunk of ``part``: seal what we sent, and send the seal."""
        seal = self._signed_seal(part, epoch, self.view.part_hash(part))
        message = wire.response(seal=seal)
        self.seals_verified.add(seal.SerializeToString())
        self.reducing.sealed(part, message)
        self.incoming.send("seal", message, skip=self.struck)
        self.view.seal(seal)

    def _signed_seal(self, part: int, epoch: int, hash: bytes) -> pb.Seal:
        seal = pb.Seal(part=part, epoch=epoch, reducer=self.me, hash=hash)
        self._sign_seal(seal)
        return seal

    def _sign_seal(self, seal: pb.Seal) -> None:
        payload = wire.seal_payload(self.group.group_id, self.group.round, seal)
        seal.signature = self.a.identity.sign(wire.SEAL_DOMAIN, payload)

    def _seal_message(self, part: int, epoch: int, hash: bytes) -> bytes:
        return wire.response(seal=self._signed_seal(part, epoch, hash))

    def _landed(self, reducer: int, applied: bool) -> None:
        """A result chunk of ``reducer``'s went into the output (or was stale: not)."""
        if not applied:
            self.a.stats["stale-results"] += 1
            return
        self.watch.heard_result(reducer, self.a.clock())
        self.changed.set()

    def _move(self, parts: list[int]) -> None:
        """Our view moved these parts to new claims: reset them and send them there."""
        for part in parts:
            self.auditor.running.pop(part, None)
            claim = self.view.owner[part]
            self.reducing.drop(part, claim.epoch, claim.reducer)
            self.watch.heard_result(claim.reducer, self.a.clock())
            if claim.reducer == self.me:
                self._start_reduction(part, claim.epoch)
            elif claim.reducer in self.outgoing.streams:
                self.outgoing.streams[claim.reducer].send(("part", part, claim.epoch))
        self._progressed()

    def _progressed(self) -> None:
        """The round moved on here: the agreement's patience starts again."""
        self.agreement.progressed(self.a.clock())
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
            self._abort(exc)
            return
        self.reducing.exclude(member, reason)
        for part in list(self.reducing.active):
            self._drain(part)
        self.outgoing.abort(member)
        self._move(moved)

    def strike(self, member: int, rejection: Rejection) -> None:
        """``member`` sent invalid input: refuse it, count it, and fail it."""
        self.a.rejections.record(rejection, self.group.members[member].peer_id)
        self.struck[member] = rejection.reason
        inc = self.incoming.streams.get(member)
        if inc is not None:
            refusal = pb.Refusal(code=rejection.code, reason=rejection.reason)
            inc.send("verdict", wire.response(refusal=refusal))
            inc.send_close()
        self.fail(member, f"struck: {rejection.reason}")

    def on_chunk(self, sender: int, chunk: wire.ChunkMessage) -> None:
        """A chunk arrived from ``sender``; Rejection if it must be struck."""
        check_chunk(chunk, self.group)
        if sender in self.struck or sender in self.view.failed:
            self.a.stats["late-chunks"] += 1
            return
        part = chunk.part
        if part not in self.view.owner:
            raise Rejection("bad-part", f"chunk of part {part}, which does not exist")
        ours = Claim(chunk.epoch, self.me)
        claim = self.view.owner[part]
        if claim != ours:
            stale = self.agreement.verdict_sent or not self.view.beats(part, ours, claim)
            if chunk.epoch == 0 or stale:
                if chunk.epoch == 0 and part != self.me:
                    raise Rejection("bad-part", f"part {part} is not reduced here")
                self.a.stats["stale-chunks"] += 1
                return
            self.view.notice(part, ours)
            self._move([part])
        self.reducing.accept(sender, chunk)
        self._drain(part)

    def _signed_done(self, digest: bytes, seq: int) -> pb.MemberDone:
        return pb.MemberDone(digest=digest, seq=seq, signature=self._done_signature(digest, seq))

    def _done_signature(self, digest: bytes, seq: int) -> bytes:
        group = self.group
        payload = wire.done_payload(group.group_id, group.round, self.me, seq, digest)
        return self.a.identity.sign(wire.DONE_DOMAIN, payload)

    def _forged_done(self, done: pb.MemberDone) -> pb.MemberDone:
        """Another announcement under ``done``'s number, as a member lying about what it
        holds would sign it: the seal of a part it reduced, over other results, and the
        digest that makes (with no part of its own, another digest alone). For fault
        plans: a peer signs what it forges."""
        forged = pb.MemberDone()
        forged.CopyFrom(done)
        group = self.group
        own = [seal for seal in forged.seals if seal.reducer == self.me]
        if own:
            seal = own[0]
            seal.hash = bytes(b ^ 0xFF for b in seal.hash)
            self._sign_seal(seal)
            forged.digest = digest_of(group.group_id, group.round, forged.seals)
        else:
            forged.digest = bytes(b ^ 0xFF for b in done.digest)
        forged.signature = self._done_signature(forged.digest, forged.seq)
        return forged

    def on_done(self, sender: int, done: pb.MemberDone) -> None:
        """``sender`` announced its digest; Rejection unless it signed it, with a seal of
        every part signed by its reducer."""
        check_done(done, self.group, sender, self.seals_verified)
        moved = self.agreement.done.get(sender) != done.digest
        self.agreement.heard(sender, done)
        if moved:
            self._progressed()
        self.changed.set()

    def on_result(self, reducer: int, result: wire.ResultMessage, raw: bytes) -> None:
        """A result chunk from ``reducer`` (``raw``: as it came); Rejection if the reducer
        sent nonsense."""
        applied = self.output.receive(reducer, result, raw)
        if applied and self.auditing:
            spans = self.view.spans[result.part]
            self.auditor.pick(result.part, result.epoch, reducer, [s.blocks for s in spans])
            codec = self.cfg.codec
            self.auditor.keep(
                result.part,
                result.epoch,
                reducer,
                result.index,
                wire.tensor_from(result.payload, torch.int8),
                wire.tensor_from(result.scales, codec.scale_torch_dtype),
                codec.block_size,
                raw,
            )
        self._landed(reducer, applied)

    def on_seal(self, reducer: int, seal: pb.Seal) -> None:
        """``reducer``'s seal of a part; Rejection unless it signed it, for itself, over the
        result messages it sent us."""
        if seal.reducer != reducer:
            raise Rejection("bad-seal", "a seal in another member's name")
        check_seal(seal, self.group)
        self.seals_verified.add(seal.SerializeToString())
        if self.view.seal(seal):
            if self.auditing and self.auditor.due(seal.part, seal.epoch, seal.reducer):
                self._start_audit(seal.part)
            self._judge_waiting_proofs(seal.part)
            self._progressed()
        else:
            self.a.stats["stale-results"] += 1

    # -- audits we run (audit.py) ---------------------------------------------------------

    def _start_audit(self, part: int) -> None:
        """``part`` is sealed: hold it, ask its reducer for its statements and (where the
        aggregator's result recomputes a segment at a time) every other contributor of the
        chunk we picked for its segment."""
        view = self.view
        claim = view.owner[part]
        blocks = [s.blocks for s in view.spans[part]]
        index, segment = self.auditor.pick(part, claim.epoch, claim.reducer, blocks)
        payload, scales = self.auditor.kept(part, claim.epoch, claim.reducer)
        held = view.sealed_result(part, claim)
        assert held is not None  # (sealed: its seal just came)
        audit = self._audit_of(part, claim, index, segment, held)
        now = self.a.clock()
        view.held.add(part)
        result = self.auditor.raw(part, claim.epoch, claim.reducer)
        self.auditor.running[part] = Running(audit, now, payload, scales, result)
        self.watch.heard_result(claim.reducer, now)
        to_reducer = self.outgoing.streams.get(claim.reducer)
        if to_reducer is None:  # (its seal came on that stream: not so far)
            self._end_audit(part, Outcome(None, "no stream to its reducer"))
            return
        to_reducer.send(("audit", wire.request(audit=pb.Audit(part=part, epoch=claim.epoch))))
        if not audit.recomputed:  # CenteredClip: its segments' bounds alone
            return
        fetch = wire.response(
            fetch=pb.Fetch(
                reducer=claim.reducer, part=part, epoch=claim.epoch, index=index, segment=segment
            )
        )
        for member in audit.contributors:
            if member == self.me:
                audit.take_piece(self.ours.piece(self.me, part, index, segment))
                continue
            inc = self.incoming.streams.get(member)
            if inc is None or self.a.silent.quiet(self.group.members[member].peer_id, now):
                # It never opened its stream to us, or it ended, or it left an audit of
                # ours unanswered before: silent, not waited for.
                audit.hush([member])
                self.a.stats["audit-fetches-skipped"] += 1
                continue
            inc.send("fetch", fetch)

    def _audit_of(
        self, part: int, claim: Claim, index: int, segment: int, held: SealedResult
    ) -> Audit:
        """An audit of segment ``segment`` of chunk ``index`` of ``part`` as ``claim``
        reduced it, from what we received of it (``held``)."""
        n = self.n
        chunks = [
            Claimed(
                span.blocks,
                tuple(held.contributors(i, n)),
                self.auditor.measured(part, claim.epoch, claim.reducer, i),
            )
            for i, span in enumerate(self.view.spans[part])
        ]
        return Audit(
            part=part,
            epoch=claim.epoch,
            reducer=claim.reducer,
            index=index,
            segment=segment,
            chunks=chunks,
            included=held.included(n),
            weights=self.group.weights,
            codec=self.cfg.codec,
            aggregator=self.cfg.aggregator,
            norm_bound=self.ours.norm_bound,
            verify=functools.partial(
                signed_by_sender, self.group, claim.reducer, part, claim.epoch
            ),
        )

    def _show_proof(self, running: Running) -> None:
        """Our audit found its reducer lying: show every other live server what it found
        (:class:`pb.Proof`: the reducer's signed answer, the segments its contributors
        answered with), so that each judges it on the result it holds and fails the reducer
        itself, before the reducer's next claims reach it. (Without it, a caught reducer
        told the others that the auditor had failed, and those that had not judged it yet
        took its rerun of the auditor's part: the attempt ended with two digests.)"""
        audit = running.audit
        if running.answer is None or not running.result:
            return  # nothing it signed to show
        senders = sorted(running.segments)
        proof = pb.Proof(
            part=audit.part,
            epoch=audit.epoch,
            reducer=audit.reducer,
            index=audit.index,
            segment=audit.segment,
            statements=running.answer,
            segments=[running.segments[s] for s in senders],
            senders=senders,
            result=running.result,
        )
        # Both ways: on our streams to the servers, before the chunks we send a part's new
        # reducer, and on every member's stream to us, before the rerun we announce on it.
        skip = {*self.view.failed, audit.reducer}
        self.outgoing.send(("proof", wire.request(proof=proof)), skip=skip)
        self.incoming.send("proof", wire.response(proof=proof), skip=skip)
        self.a.stats["proofs-shown"] += 1

    def on_proof(self, sender: int, proof: pb.Proof, *, answer: bool) -> None:
        """``sender`` shows what its audit of a part found (``answer``: on our stream to
        it): we judge the same segment on the result we hold of it, and fail its reducer if
        that proves it lied. A proof that proves nothing changes nothing (our view may
        differ from the auditor's); one of a part whose result we do not hold whole yet
        waits for its seal; one of a claim we hold no more is not judged. Rejection if it
        is malformed or shows an answer its reducer did not sign."""
        part, epoch, reducer = proof.part, proof.epoch, proof.reducer
        view = self.view
        if part not in view.owner or reducer >= self.n:
            raise Rejection("malformed", "a proof of no part, or of no member")
        if reducer == self.me or reducer in view.failed or self.decided:
            self.a.stats["proofs-late"] += 1
            return
        claim = Claim(epoch, reducer)
        current = view.owner[part] == claim
        held = view.sealed_result(part, claim)
        if held is None and not current:
            self.a.stats["proofs-unjudged"] += 1  # a claim we never held whole
            return
        if (sender, part, epoch, answer) in self._proofs:
            raise Rejection("malformed", "a second proof of one claim")
        self._proofs.add((sender, part, epoch, answer))
        if (sender, part, epoch) in self._judged_proofs:
            return  # (it came the other way first)
        if held is None:
            self._waiting_proofs.setdefault(part, {})[sender] = proof  # judged once sealed
            return
        self._judged_proofs.add((sender, part, epoch))
        spans = view.spans[part]
        if proof.index >= len(spans) or proof.segment >= segments_of(spans[proof.index].blocks):
            raise Rejection("malformed", "a proof of no segment of its part")
        if hashlib.sha256(proof.result).digest() != held.hashes[proof.index]:
            raise Rejection("malformed", "a proof showing a result its reducer did not seal")
        if not check_statements(proof.statements, self.group, reducer):
            raise Rejection("malformed", "a proof showing an answer its reducer did not sign")
        audit = self._audit_of(part, claim, proof.index, proof.segment, held)
        outcome = self._judged(audit, proof)
        if outcome.liar != reducer:
            self.a.stats["proofs-unproven"] += 1
            return
        self.a.stats["proofs-taken"] += 1
        self.liars.add(reducer)
        reason = f"{self.label(sender)}'s audit shows it: {outcome.reason}"
        self.a.rejections.record(
            Rejection("audit-failed", reason), self.group.members[reducer].peer_id
        )
        logger.warning(
            "round %d: member %s lied about part %d: %s",
            self.group.round,
            self.label(reducer),
            part,
            reason,
        )
        self.fail(reducer, f"failed an audit: {reason}")

    def _judge_waiting_proofs(self, part: int) -> None:
        """``part`` is sealed: the proofs of its claim that came before, judged now (one
        that proves nothing changes nothing; a malformed one strikes its prover)."""
        for prover, proof in self._waiting_proofs.pop(part, {}).items():
            if prover in self.view.failed or prover in self.struck:
                continue
            self._proofs.discard((prover, proof.part, proof.epoch, False))
            self._proofs.discard((prover, proof.part, proof.epoch, True))
            try:
                self.on_proof(prover, proof, answer=False)
            except Rejection as rejection:
                self.strike(prover, rejection)

    def _judged(self, audit: Audit, proof: pb.Proof) -> Outcome:
        """``audit`` judged on what ``proof`` shows; Rejection if a segment it shows is not
        one of that chunk's (the prover's fault: a contributor's would have been struck)."""
        try:
            statements = [
                Statement(s.sender, s.index, s.root, wire.norms_of(s.norms), s.signature)
                for s in proof.statements.statements
            ]
        except Rejection as rejection:  # it signed an answer no audit could take
            return Outcome(audit.reducer, f"its audit answer: {rejection.reason}")
        outcome = audit.take_statements(statements)
        if outcome is not None or not audit.recomputed:
            return outcome or Outcome(None, "")
        if len(proof.senders) != len(proof.segments):
            raise Rejection("malformed", "a proof's segments and senders do not pair")
        asked = (audit.reducer, audit.part, audit.epoch, audit.index, audit.segment)
        for member, segment in zip(proof.senders, proof.segments, strict=True):
            key = (segment.reducer, segment.part, segment.epoch, segment.index, segment.segment)
            if key != asked or member not in audit.contributors or member in audit.pieces:
                raise Rejection("malformed", "a proof's segment of another chunk, or twice")
            audit.take_piece(piece_of(member, segment, audit.blocks, self.cfg.codec))
        audit.hush(audit.contributors)
        result = wire.decode_response(proof.result)
        assert isinstance(result, wire.ResultMessage)  # (its hash is a sealed message's)
        numel = self.view.spans[audit.part][audit.index].numel
        payload, scales = decode_chunk(result.payload, result.scales, numel, self.cfg.codec)
        block = self.cfg.codec.block_size
        return audit.verdict(*segment_of(payload, scales, audit.segment, block))

    def on_statements(self, reducer: int, answer: pb.Statements) -> None:
        """``reducer``'s statements for our audit of its part; Rejection if they show it
        lied (we fail it, and the part is reduced again)."""
        running = self.auditor.running.get(answer.part)
        audit = running.audit if running is not None else None
        if audit is None or (audit.epoch, audit.reducer) != (answer.epoch, reducer):
            self.a.stats["stale-audits"] += 1
            return
        if audit.statements is not None:
            raise Rejection("malformed", "a second answer to one audit")
        assert running is not None
        if not check_statements(answer, self.group, reducer):
            self.auditor.running.pop(answer.part, None)
            self.liars.add(reducer)
            raise Rejection("audit-failed", "its audit answer is not signed by it")
        running.answer = answer
        try:
            statements = [
                Statement(s.sender, s.index, s.root, wire.norms_of(s.norms), s.signature)
                for s in answer.statements
            ]
        except Rejection as rejection:
            self.auditor.running.pop(answer.part, None)
            self.liars.add(reducer)
            self._show_proof(running)
            raise Rejection("audit-failed", f"its audit answer: {rejection.reason}") from None
        outcome = audit.take_statements(statements)
        if outcome is not None:  # its answer, or a segment past its senders' norms
            self.auditor.running.pop(answer.part, None)
            self.liars.add(reducer)
            self._show_proof(running)
            raise Rejection("audit-failed", outcome.reason)
        self.watch.heard_result(reducer, self.a.clock())
        self._conclude(answer.part)

    def on_segment(self, sender: int, segment: pb.Segment) -> None:
        """``sender``'s segment for our audit of a part; Rejection if malformed or not what
        it signed (we strike it)."""
        running = self.auditor.running.get(segment.part)
        audit = running.audit if running is not None else None
        asked = (audit.reducer, audit.epoch, audit.index, audit.segment) if audit else None
        key = (segment.reducer, segment.epoch, segment.index, segment.segment)
        if audit is None or asked != key or sender not in audit.contributors:
            self.a.stats["stale-audits"] += 1
            return
        if sender in audit.pieces:
            raise Rejection("malformed", "a second segment for one audit")
        audit.take_piece(piece_of(sender, segment, audit.blocks, self.cfg.codec))
        if sender in audit.pieces and running is not None:
            running.segments[sender] = segment
        self._conclude(segment.part)

    def _conclude(self, part: int) -> None:
        """Judge the audit of ``part`` once everything it asked for is in."""
        running = self.auditor.running.get(part)
        if running is None or not running.audit.ready:
            return
        self._end_audit(part, running.audit.verdict(running.payload, running.scales))

    def _end_audit(self, part: int, outcome: Outcome) -> None:
        running = self.auditor.running.pop(part)
        self._progressed()
        audit = running.audit
        if outcome.liar is None:
            self.a.stats["audits-passed" if not outcome.reason else "audits-unanswered"] += 1
            if outcome.reason:
                logger.info(
                    "round %d: audit of part %d (reducer %s) passed, not whole: %s",
                    self.group.round,
                    part,
                    self.label(audit.reducer),
                    outcome.reason,
                )
            self.view.held.discard(part)
            self.changed.set()
            return
        rejection = Rejection("audit-failed", outcome.reason)
        self.liars.add(outcome.liar)
        logger.warning(
            "round %d: audit of part %d (reducer %s): member %s lied: %s",
            self.group.round,
            part,
            self.label(audit.reducer),
            self.label(outcome.liar),
            outcome.reason,
        )
        if outcome.liar == audit.reducer:
            self.a.rejections.record(rejection, self.group.members[audit.reducer].peer_id)
            self._show_proof(running)
            self.fail(audit.reducer, f"failed its audit: {outcome.reason}")
            return
        # A contributor showed other bytes than it signed to the reducer: its lie, and
        # the audit cannot tell whether the reducer lied; the part is taken.
        self.view.held.discard(part)
        self.strike(outcome.liar, rejection)
        self.changed.set()

    def _expire_audits(self, now: float) -> None:
        """Contributors that have not answered an audit within the senders' timeout are
        silent, and the audit judged without their segments (a reducer that does not answer
        is the watch's: it lacks a part)."""
        for part, running in list(self.auditor.running.items()):
            audit = running.audit
            if audit.statements is not None and now - running.started > self.cfg.sender_timeout_s:
                for member in audit.contributors:
                    if member not in audit.pieces and member not in audit.silent:
                        self.a.silent.add(self.group.members[member].peer_id, now)
                audit.hush(audit.contributors)
                self._conclude(part)

    # -- audits of our parts and our chunks -----------------------------------------------

    def on_audit(self, auditor: int, audit: pb.Audit) -> None:
        """``auditor`` audits our reduction of a part: our statements of it, signed."""
        if not self._answer_allowed("audit", auditor):
            return
        answer = self.reducing.statements(audit.part, audit.epoch)
        inc = self.incoming.streams.get(auditor)
        if answer is None or inc is None:
            self.a.stats["stale-audits"] += 1
            return
        g = self.group
        payload = wire.statements_payload(g.group_id, g.round, self.me, answer)
        answer.signature = self.a.identity.sign(wire.STATEMENTS_DOMAIN, payload)
        inc.send("statements", wire.response(statements=answer))

    def on_fetch(self, auditor: int, fetch: pb.Fetch) -> None:
        """``auditor`` audits a part we sent a chunk of: the segment it asks for; Rejection
        if there is no such segment."""
        if not self._answer_allowed("fetch", auditor):
            return
        answer = self.ours.segment_answer(fetch)
        stream = self.outgoing.streams.get(auditor)
        if stream is not None:
            stream.send(("segment", wire.request(segment=answer)))

    def _answer_allowed(self, kind: str, member: int) -> bool:
        """At most two answers of a kind a part to one member a round (a rerun asks again)."""
        key = (kind, member)
        if self._answered[key] >= 2 * len(self.view.parts):
            self.a.stats["audits-refused"] += 1
            return False
        self._answered[key] += 1
        return True

    def _restated_chunk(self, peer: str, message: bytes) -> bytes:
        """A chunk message to ``peer`` that a fault plan altered, with our statement of the
        bytes it now carries (fault plans only: a liar signs what it sends)."""
        if peer not in self.peer_ids:
            return message
        return restated(
            message,
            sender=self.me,
            reducer=self.peer_ids.index(peer),
            codec=self.cfg.codec,
            sign=self.a.identity.sign,
        )

    def on_rerun(self, reducer: int, part: int, epoch: int) -> None:
        if self.view.notice(part, Claim(epoch, reducer)):
            self._move([part])

    def on_verdict(self, server: int, verdict: pb.Verdict) -> None:
        """``server``'s verdict; Rejection unless every announcement it shows is signed by
        its member."""
        for entry in verdict.evidence:
            if entry.member >= self.n:
                raise Rejection("malformed", f"a verdict shows member {entry.member}")
            check_done(entry.done, self.group, entry.member, self.seals_verified)
        self.agreement.verdicts[server] = verdict
        self.changed.set()

    # -- incoming streams ----------------------------------------------------------------

    def check_hello(self, hello: pb.StreamHello) -> int:
        """The sender index of a valid hello; Rejection otherwise."""
        sender = check_hello(hello, self.group, self.me)
        self.incoming.check(sender, self.struck)
        return sender

    async def serve(self, sender: int, context: grpc.aio.ServicerContext) -> None:
        if self.incoming.closing:
            return
        inc = IncomingStream(self, sender, context)
        agreement = self.agreement
        verdict = agreement.verdicts[self.me] if agreement.verdict_sent else None
        last = wire.response(verdict=verdict) if verdict is not None else None
        try:
            await self.incoming.serve(inc, self.reducing.backlog(), last)
        finally:
            if not inc.clean and not self.decided:
                self.fail(sender, inc.end_reason or "its stream broke")

    # -- bookkeeping -------------------------------------------------------------------

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
            bytes_sent=self.traffic.bytes_sent,
            bytes_received=self.traffic.bytes_received,
            timings=dict(self.timings),
            agreed=self.agreement.agreed(),
            digest=(self.agreement.my_done or b"").hex(),
            norm_bound=self.ours.norm_bound,
            clipped=self.ours.clipped,
            audit_bytes_sent=self.traffic.audit_bytes_sent,
            liars=tuple(sorted(self.peer_ids[m] for m in self.liars)),
        )
