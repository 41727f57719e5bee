"""A stage-0 peer driving micro-batches through the pipeline (``docs/DESIGN.md``
section 10, "A micro-batch's path").

:meth:`Driver.run` computes stage 0 locally, calls ``Forward`` on one replica of each
later stage in turn (the last returns the loss), then ``Backward`` from the last stage down
to stage 1, and ends with stage 0's own backward (computing, packing and unpacking on
worker threads, never on the event loop). A forward hop that fails, is refused or
misses its deadline goes to another replica of the same stage (nothing was applied
anywhere yet); a backward hop that fails abandons the micro-batch below it (the stages
above keep the gradients they added: true gradients of its loss). A micro-batch that
fails is dropped at once by the replicas holding its input (``Abandon``, best effort), so
they need not wait for it to take their steps. Several micro-batches may run at once,
each its own :meth:`Driver.run`. A replica that failed is
not drawn again for ``shun_s``. Which replica takes a hop is drawn with probability
proportional to ``rate / (1 + queue)``: the rate is what this driver measured of the
replica (sequences per second of its forward calls, an exponential average) where it has
measured it, else what the replica's ``stage-load`` record claims, capped at the best this
driver measured (a record claims, a call proves; ``pipeline/load.py``), else the best
measured, so that a new replica is tried; the queue is this driver's calls to it in flight
plus the micro-batches its record says it holds. No replica's weight falls below
``EXPLORE`` of the best's, so that a stale measurement is measured again.
:meth:`Driver.update` takes the fresh records as the replicas to draw from. A share of
the answers each later stage gave (``audit_share``) is computed again by another replica of
the stage once the micro-batch is through, and a replica judged wrong twice by three
answers is not drawn for ``distrust_s`` (``audit.py``; ``docs/DESIGN.md`` section 10,
"Audits"). The driver holds a session (``Session``, a call it keeps open) with each
replica it sends forwards to and names it in them: when this process dies its
connections close, the sessions end, and the replicas drop its micro-batches' inputs at
once instead of at their deadline.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import os
import random
import time
from collections.abc import Callable, Sequence

import grpc
import torch

from swarmloco.core.config import require_fraction, require_int, require_positive
from swarmloco.errors import SwarmlocoError
from swarmloco.net.client import Method, Req, Resp, RpcClient, RpcError
from swarmloco.net.endpoints import endpoint_network
from swarmloco.net.rejections import Rejection
from swarmloco.pipeline.audit import Answer, Used, distance, judge
from swarmloco.pipeline.beats import Beats
from swarmloco.pipeline.load import StageLoad
from swarmloco.pipeline.replica import StageReplica
from swarmloco.pipeline.service import (
    ABANDON,
    ATTEND,
    AUDIT,
    BACKWARD,
    FORWARD,
    MICRO_BATCH_BYTES,
    SESSION,
    SESSION_BYTES,
    CallPools,
)
from swarmloco.pipeline.wire import Boundary, pack, unpack
from swarmloco.proto.v1 import stage_pb2 as pb

logger = logging.getLogger(__name__)

BUSY_PAUSE_S = 0.1
"""The first pause before a stage whose every replica was busy is tried again."""
MAX_BUSY_PAUSE_S = 1.0
EXPLORE = 0.1
"""The least weight a replica is drawn with, as a share of the best replica's."""
SESSION_RETRY_S = 30.0
"""A replica whose session ended (refused, or broken) is asked for a new one no sooner."""
BEAT_BOUNDS_S = (0.2, 60.0)
"""The beats of a session (``Attend``) are sent as often as its replica asks, within
these: a replica cannot have its drivers beat it without pause."""


def micro_batch_name() -> bytes:
    """A new micro-batch's name: random, :data:`MICRO_BATCH_BYTES` long."""
    return os.urandom(MICRO_BATCH_BYTES)


class PipelineError(SwarmlocoError):
    """A micro-batch could not be run through the pipeline."""


class Withdrawn(PipelineError):
    """Stage 0 withdrew the micro-batch before its own forward (its sequences landed in
    the state meanwhile): nothing of it trained anywhere."""


@dataclasses.dataclass(eq=False)
class _Session:
    """A session with one replica: its name, and whether the replica said it is open."""

    stage: int
    name: bytes = dataclasses.field(default_factory=lambda: os.urandom(SESSION_BYTES))
    open: bool = False
    task: asyncio.Task[None] | None = None
    ended_at: float | None = None
    lost: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    """Set when the replica fell silent on the session (its machine froze, or dropped off
    the network): the calls under way there fail at once."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DriverConfig:
    encoding: str = "int8"
    """How activations and their gradients travel (int8, f32 or bf16)."""
    hop_timeout_s: float = 30.0
    """Deadline of one call to one replica."""
    shun_s: float = 30.0
    """How long a replica that failed is not drawn again; twice as long at each failure
    more with no backward it answered in between, up to ``max_shun_s``."""
    max_shun_s: float = 3600.0
    """The longest a replica that keeps failing is not drawn (one that takes forwards and
    never answers costs each driver a hop's deadline a shunning, not one every ``shun_s``)."""
    replicas_per_network: int = 4
    """A stage's replicas drawn from at most, per source network (the /24 of a public
    IPv4 address, the /64 of IPv6; a loopback or private address each its own): many
    keys on one network cannot crowd out the stage's other replicas."""
    audit_share: float = 0.05
    """The chance that a stage's answer to a micro-batch is computed again by another
    replica and compared (each stage of each micro-batch drawn apart; 0: no audits)."""
    audit_tolerance: float = 0.8
    """Two answers to one micro-batch agree within this relative distance (honest replicas
    of a stage differ by their own steps since the stage's last round)."""
    strikes: int = 2
    """Audits a replica is judged wrong in, with no audit it agreed in between, before it is
    found out (one alone may be an honest replica's answer from before a round that its
    auditors have since landed); its answers are all audited from its first."""
    distrust_s: float = 3600.0
    """How long a replica found out answering wrong is not drawn again."""
    max_audits: int = 2
    """Audits under way at once; one more due then is not made."""
    replica_silence_s: float = 10.0
    """A replica heard nothing from on a session that beats (``Attend``) for this long (or
    three of the beat intervals it asked for, if longer) is taken for lost: the calls under
    way there fail at once, and it is shunned."""
    sessions: bool = True
    """Hold a session with each replica it sends forwards to and name it in them, so that
    the replicas drop this driver's micro-batches as soon as it dies (False: forwards name
    none, and a dead driver's inputs wait for the replicas' deadline: the benchmark's
    baseline, or a network that cuts calls held open)."""

    def __post_init__(self) -> None:
        require_positive("hop_timeout_s", self.hop_timeout_s)
        require_positive("shun_s", self.shun_s)
        require_positive("max_shun_s", self.max_shun_s)
        require_int("replicas_per_network", self.replicas_per_network, minimum=1)
        require_fraction("audit_share", self.audit_share)
        require_positive("audit_tolerance", self.audit_tolerance)
        require_positive("distrust_s", self.distrust_s)
        require_int("strikes", self.strikes, minimum=1)
        require_int("max_audits", self.max_audits, minimum=1)


@dataclasses.dataclass
class Trace:
    """What one micro-batch did: its loss, the replica of each later stage, the retries."""

    loss: float = float("nan")
    path: list[str] = dataclasses.field(default_factory=list)
    retries: int = 0
    bytes_sent: int = 0
    """Activations and gradients this driver sent (their payload: data and scales)."""
    bytes_received: int = 0
    """Activations and gradients it received."""
    holding: dict[int, str] = dataclasses.field(default_factory=dict)
    """The replicas that hold its input now (by stage): forward done, backward not yet."""


class HopStats:
    """What a driver measured of each replica (its rate, the calls to it in flight) and
    what the replicas' records claim."""

    def __init__(self) -> None:
        self.rate: dict[str, float] = {}
        """Sequences per second of its forward calls (an exponential average)."""
        self.busy: collections.Counter[str] = collections.Counter()
        self.claims: dict[str, StageLoad] = {}
        """Each replica's last ``stage-load`` record."""

    def weight(self, endpoint: str) -> float:
        best = max(self.rate.values(), default=0.0)
        claim = self.claims.get(endpoint)
        rate = self.rate.get(endpoint)
        if rate is None and claim is not None and claim.rate > 0:
            rate = min(claim.rate, best) if best > 0 else claim.rate
        if rate is None:
            rate = best or 1.0
        queue = self.busy[endpoint] + (claim.queue if claim is not None else 0)
        return rate / (1 + queue)

    def measured(self, endpoint: str, sequences: int, seconds: float) -> None:
        rate = sequences / max(seconds, 1e-6)
        old = self.rate.get(endpoint)
        self.rate[endpoint] = rate if old is None else 0.8 * old + 0.2 * rate


class Driver:
    """See the module. ``replicas[k - 1]``: the endpoints of stage k's replicas (k >= 1);
    ``boundaries[k]``: what crosses into stage k + 1 (activations); ``ids``: what stage 0
    takes."""

    def __init__(
        self,
        client: RpcClient,
        first: StageReplica,
        *,
        swarm_id: str,
        replicas: Sequence[Sequence[str]],
        boundaries: Sequence[Boundary],
        ids: Boundary,
        config: DriverConfig | None = None,
        rng: random.Random | None = None,
        on_event: Callable[..., None] | None = None,
        step: Callable[[], int] | None = None,
    ) -> None:
        self.client = client
        self.step = step
        """This driver's step (its peer's global step), said with each micro-batch: a later
        stage's learning rate follows it (None: not said)."""
        self.first = first
        self.swarm_id = swarm_id
        self.replicas = [list(r) for r in replicas]
        self.boundaries = list(boundaries)
        self.ids = ids
        self.config = config or DriverConfig()
        self.rng = rng or random.Random()
        self.shunned: dict[str, float] = {}
        """Replicas that failed, until when they are not drawn."""
        self.failures: collections.Counter[str] = collections.Counter()
        """Each replica's failures since the last backward it answered."""
        self.stats = HopStats()
        self._own = CallPools("driver", forwards=2, backwards=2)
        """Where this peer's own stage computes (as a replica's service does)."""
        self._abandoning: set[asyncio.Task[None]] = set()
        """Abandon calls under way (kept: a task nobody refers to may be collected)."""
        self.on_event = on_event
        """Called as ``on_event(name, **fields)`` for ``replica-distrusted``."""
        self.distrusted: dict[str, float] = {}
        """Replicas found out answering wrong, until when they are not drawn."""
        self.audits: collections.Counter[str] = collections.Counter()
        """Audits by outcome: ``agreed``, ``judged-wrong`` (one of three, a strike),
        ``found-out`` (of those, the ones that distrusted a replica), ``disputed``,
        ``unchecked`` (no other replica answered), ``not-made`` (too many under way)."""
        self.strikes: collections.Counter[str] = collections.Counter()
        """Audits each replica was judged wrong in since it last agreed in one."""
        self._auditing: set[asyncio.Task[None]] = set()
        self._sessions: dict[str, _Session] = {}
        """This driver's session with each replica it sent forwards to, by endpoint."""

    def close(self) -> None:
        """Stop its worker threads, its audits and its sessions (its peer leaves; any
        thread)."""
        self._own.close()
        sessions = [s.task for s in list(self._sessions.values()) if s.task is not None]
        for task in [*list(self._auditing), *sessions]:
            with contextlib.suppress(RuntimeError):  # its loop is closed: nothing runs
                task.get_loop().call_soon_threadsafe(task.cancel)

    @property
    def sessions(self) -> int:
        """Sessions the replicas said are open now."""
        return sum(1 for s in list(self._sessions.values()) if s.open)

    def _session(self, endpoint: str, stage: int) -> bytes:
        """The name of this driver's session open at ``endpoint`` (b"": none open yet; one
        is asked for, unless one ended there within ``SESSION_RETRY_S``)."""
        session = self._sessions.get(endpoint)
        if session is not None and session.stage != stage:  # the replica moved
            self._end_session(endpoint)
            session = None
        if session is None or (
            session.task is None
            and (session.ended_at is None or time.monotonic() - session.ended_at >= SESSION_RETRY_S)
        ):
            session = self._sessions[endpoint] = _Session(stage)
            session.task = asyncio.get_running_loop().create_task(
                self._hold_session(endpoint, session)
            )
        return session.name if session.open else b""

    def _end_session(self, endpoint: str) -> None:
        session = self._sessions.pop(endpoint, None)
        if session is not None and session.task is not None:
            session.task.cancel()

    async def _hold_session(self, endpoint: str, session: _Session) -> None:
        """Open the session and keep it open, beating, until the replica or this driver
        ends it (a replica without ``Attend``, an older one: the one-way ``Session``)."""
        request = pb.SessionRequest(
            swarm_id=self.swarm_id, stage=session.stage, session=session.name
        )
        try:
            channel = await self.client.open(endpoint, self.config.hop_timeout_s)
            with self.client.holding(channel):  # no await since open: the cache keeps it
                try:
                    await self._attend(channel, request, session, endpoint)
                except grpc.RpcError as exc:
                    if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                        raise
                    call = channel.unary_stream(
                        SESSION.path,
                        request_serializer=pb.SessionRequest.SerializeToString,
                        response_deserializer=pb.SessionEvent.FromString,
                    )(request)
                    async for event in call:
                        session.open = event.open
                        if not event.open:  # refused (the replica holds too many, say)
                            call.cancel()
                            break
        except (RpcError, grpc.RpcError):
            pass  # gone, or never there: forwards go without a session
        finally:
            session.open = False
            session.task = None
            session.ended_at = time.monotonic()

    async def _attend(
        self,
        channel: grpc.aio.Channel,
        request: pb.SessionRequest,
        session: _Session,
        endpoint: str,
    ) -> None:
        """Hold ``session`` on an ``Attend`` call: a beat as often as the replica asked in
        its open answer, and the replica's beats heard, until the replica ends the call (a
        refusal, or the end), or falls silent (then ``session.lost`` is set)."""
        call = channel.stream_stream(
            ATTEND.path,
            request_serializer=pb.SessionRequest.SerializeToString,
            response_deserializer=pb.SessionEvent.FromString,
        )()
        try:
            await call.write(request)
            event = await call.read()
            if event is grpc.aio.EOF or not event.open:
                return  # refused (the replica holds too many, say)
            session.open = True
            low, high = BEAT_BOUNDS_S
            beat_s = min(max(event.beat_ms / 1000, low), high)
            silence_s = max(self.config.replica_silence_s, 3 * beat_s)
            loop = asyncio.get_running_loop()
            heard = Beats(beat_s=beat_s, silence_s=silence_s, now=loop.time())
            written = loop.time()
            reading = asyncio.ensure_future(call.read())
            try:
                while True:
                    before = loop.time()
                    asked = max(0.0, heard.wake(written) - before)
                    await asyncio.wait({reading}, timeout=asked)
                    now = loop.time()
                    heard.waited(asked=asked, slept=now - before, now=now)
                    if reading.done():
                        event = reading.result()
                        if event is grpc.aio.EOF or not event.open:
                            return  # the replica ended the session
                        if not heard.heard_one(now):  # each costs this event loop a read
                            logger.warning(
                                "the replica at %s beats far more often than it asked: "
                                "its session ended", endpoint,
                            )  # fmt: skip
                            return
                        reading = asyncio.ensure_future(call.read())
                    elif heard.silent(now):
                        logger.warning(
                            "the replica at %s said nothing for %.0f s: taken for lost",
                            endpoint, silence_s,
                        )  # fmt: skip
                        session.lost.set()
                        return
                    if now - written >= beat_s:
                        try:
                            await call.write(pb.SessionRequest())
                        except asyncio.InvalidStateError:
                            return  # the call ended meanwhile (the replica ended it)
                        written = now
            finally:
                reading.cancel()
        finally:
            call.cancel()

    def update(self, loads: Sequence[StageLoad]) -> None:
        """Draw from the replicas of these (fresh) records from now on: each later stage's,
        at most ``replicas_per_network`` of one network (those this driver measured
        first, the fastest first, then those it drew from before, then the records'
        order), with what each claims. A stage none of them serves keeps the replicas it
        had (a pipeline does not stall on one empty read)."""
        stages = len(self.replicas) + 1
        said: list[list[str]] = [[] for _ in self.replicas]
        claims: dict[str, StageLoad] = {}
        for load in loads:
            if (
                1 <= load.stage < stages
                and load.endpoint
                and load.endpoint not in said[load.stage - 1]
            ):
                said[load.stage - 1].append(load.endpoint)
                claims[load.endpoint] = load
        for k, endpoints in enumerate(said):
            if endpoints:
                self.replicas[k] = self._capped(endpoints, self.replicas[k])
        drawn = {e for replicas in self.replicas for e in replicas}
        for endpoint in [e for e in self._sessions if e not in drawn]:
            self._end_session(endpoint)  # not drawn from any more (it left, or moved)
        # The claims of the replicas drawn from, no others (records come and go).
        self.stats.claims = {
            e: claims.get(e) or self.stats.claims[e]
            for replicas in self.replicas
            for e in replicas
            if e in claims or e in self.stats.claims
        }

    def _capped(self, endpoints: list[str], before: list[str]) -> list[str]:
        """``endpoints``, at most ``replicas_per_network`` of each network, in order of
        what this driver knows of them (see :meth:`update`)."""
        measured = self.stats.rate

        def known(i: int) -> tuple[int, float, int]:
            endpoint = endpoints[i]
            if endpoint in measured:
                return (0, -measured[endpoint], i)
            return (1 if endpoint in before else 2, 0.0, i)

        order = sorted(range(len(endpoints)), key=known)
        taken: collections.Counter[str] = collections.Counter()
        kept: list[int] = []
        for i in order:
            network = endpoint_network(endpoints[i])
            if taken[network] < self.config.replicas_per_network:
                taken[network] += 1
                kept.append(i)
        return [endpoints[i] for i in sorted(kept)]

    async def run(
        self, x: torch.Tensor, targets: torch.Tensor, *, name: bytes | None = None
    ) -> Trace:
        """One micro-batch, forward and backward: its loss and path. The answers drawn for
        an audit are audited once it is through, without waiting. ``name``: the
        micro-batch's (:func:`micro_batch_name`; a new one if None)."""
        name = name or micro_batch_name()
        trace = Trace()
        stages = len(self.replicas) + 1
        drawn = {k for k in range(1, stages) if self.rng.random() < self.config.audit_share}
        audited: dict[int, Used] = {}
        try:
            await self._run(name, x, targets, trace, drawn, audited)
        except BaseException:
            self._abandon(name, trace)
            raise
        for used in audited.values():
            self._start_audit(used)
        return trace

    def _abandon(self, name: bytes, trace: Trace) -> None:
        """Have every replica that holds the micro-batch's input drop it, this peer's own
        too (at once if no compute holds it, else on its threads), without waiting."""
        if not self.first.try_abandon(name):
            self._own.submit("backward", self.first.abandon, name)
        for stage, endpoint in trace.holding.items():
            self._abandon_at(endpoint, stage, name)
        trace.holding.clear()

    def _abandon_at(self, endpoint: str, stage: int, name: bytes) -> None:
        """Ask one replica to drop the micro-batch's input, without waiting."""
        request = pb.AbandonRequest(swarm_id=self.swarm_id, stage=stage, micro_batch=name)
        task = asyncio.get_running_loop().create_task(self._call_abandon(endpoint, request))
        self._abandoning.add(task)
        task.add_done_callback(self._abandoning.discard)

    async def _call_abandon(self, endpoint: str, request: pb.AbandonRequest) -> None:
        with contextlib.suppress(RpcError):  # it expires there at its deadline anyway
            await self.client.call(endpoint, ABANDON, request, timeout=10.0, attempts=1)

    async def _run(
        self,
        name: bytes,
        x: torch.Tensor,
        targets: torch.Tensor,
        trace: Trace,
        drawn: set[int],
        audited: dict[int, Used],
    ) -> None:
        """``drawn``: the stages whose answers are audited (a suspect's always are);
        ``audited``: filled with those answers, by stage."""
        h = await self._own.run("forward", self.first.forward, name, x)
        stages = len(self.replicas) + 1
        for k in range(1, stages):
            last = k == stages - 1
            request = pb.ForwardRequest(
                swarm_id=self.swarm_id,
                stage=k,
                micro_batch=name,
                input=await self._pack(h, f"stage {k - 1}'s output"),
                targets=pack(targets, "i64") if last else None,
                seed=self.rng.getrandbits(63) | 1,
                step=None if self.step is None else max(0, self.step()),
            )
            trace.bytes_sent += len(request.input.data) + len(request.input.scales)
            endpoint, answer = await self._forward(k, request, trace)
            trace.path.append(endpoint)
            trace.holding[k] = endpoint
            used = None
            if k in drawn or self.strikes[endpoint]:
                used = audited[k] = Used(stage=k, endpoint=endpoint, forward=request)
            if last:
                trace.loss = answer.loss
                if used is not None:
                    used.output = answer.loss
            else:
                trace.bytes_received += len(answer.output.data) + len(answer.output.scales)
                try:
                    h = await asyncio.to_thread(
                        unpack, answer.output, self.boundaries[k], f"stage {k}'s output"
                    )
                except Rejection as exc:  # what a replica answers is checked like a call
                    self._shun(endpoint)
                    raise PipelineError(f"stage {k} on {endpoint} answered badly: {exc}") from exc
                if used is not None:
                    used.output = h
        grad: torch.Tensor | None = None
        for k in range(stages - 1, 0, -1):
            request_b = pb.BackwardRequest(
                swarm_id=self.swarm_id,
                stage=k,
                micro_batch=name,
                grad_output=None if grad is None else await self._pack(grad, "a gradient"),
            )
            endpoint = trace.path[k - 1]
            if grad is not None:
                trace.bytes_sent += len(request_b.grad_output.data) + len(
                    request_b.grad_output.scales
                )
            try:
                answer_b = await self._call(endpoint, BACKWARD, request_b)
                if answer_b.WhichOneof("outcome") != "grad_input":
                    raise Rejection(answer_b.refused.code, answer_b.refused.reason)
                trace.bytes_received += len(answer_b.grad_input.data) + len(
                    answer_b.grad_input.scales
                )
                del trace.holding[k]  # its backward ran there: nothing is held any more
                del self.failures[endpoint]  # it answered: a failure next is shunned afresh
                grad = await asyncio.to_thread(
                    unpack, answer_b.grad_input, self.boundaries[k - 1], f"stage {k}'s gradient"
                )
                used = audited.get(k)
                if used is not None:
                    used.grad_output, used.grad_input = request_b.grad_output, grad
            except (RpcError, Rejection) as exc:
                # Only the replica that ran the forward holds its input: the micro-batch is
                # lost (the replicas before it drop theirs at their deadline), never the peer.
                self._shun(endpoint)
                raise PipelineError(
                    f"stage {k}'s backward on {endpoint} failed ({exc}): the micro-batch is lost"
                ) from exc
        await self._own.run("backward", self.first.backward, name, grad)

    async def _pack(self, x: torch.Tensor, what: str) -> pb.StageTensor:
        try:
            return await asyncio.to_thread(pack, x, self.config.encoding)
        except Rejection as exc:  # NaN or Inf: nobody would take it
            raise PipelineError(f"{what} cannot be sent: {exc}") from exc

    async def _forward(
        self, stage: int, request: pb.ForwardRequest, trace: Trace
    ) -> tuple[str, pb.ForwardResponse]:
        """Forward on one replica of ``stage``, another one after each failure. When every
        replica said it is busy (between two steps: a round), or none is known yet, all
        are tried again after a pause, growing, until ``hop_timeout_s`` has passed."""
        tried: set[str] = set()
        errors: list[str] = []
        busy = 0  # refusals as busy since the last round of tries
        give_up_at = time.monotonic() + self.config.hop_timeout_s
        pause = BUSY_PAUSE_S
        while True:
            endpoint = self._draw(stage, tried)
            unserved = not self.replicas[stage - 1]  # no record of a replica (yet)
            all_busy = bool(tried) and busy == len(tried)
            if endpoint is None and (unserved or all_busy) and time.monotonic() < give_up_at:
                # Back-pressure (the stage is in a round), or its first records to come.
                await asyncio.sleep(pause)
                pause = min(2 * pause, MAX_BUSY_PAUSE_S)
                tried.clear()
                busy = 0
                continue
            if endpoint is None and unserved:
                raise PipelineError(f"stage {stage} has no peer (no stage-load record of one)")
            if endpoint is None:
                raise PipelineError(
                    f"no replica of stage {stage} took the micro-batch: " + "; ".join(errors[-8:])
                )
            tried.add(endpoint)
            started = time.monotonic()
            self.stats.busy[endpoint] += 1
            try:
                request.session = self._session(endpoint, stage) if self.config.sessions else b""
                answer = await self._call(endpoint, FORWARD, request)
                if answer.WhichOneof("outcome") == "refused":
                    raise Rejection(answer.refused.code, answer.refused.reason)
                sequences = int(request.input.shape[0]) if request.input.shape else 1
                self.stats.measured(endpoint, sequences, time.monotonic() - started)
                return endpoint, answer
            except (RpcError, Rejection) as exc:
                errors.append(f"{endpoint}: {exc}")
                if isinstance(exc, Rejection) and exc.code == "busy":
                    busy += 1
                elif isinstance(exc, Rejection) and exc.code == "wrong-stage":
                    # It serves another stage now (it moved since its record was read):
                    # not drawn for this one until a record says so again, still for its own.
                    if endpoint in self.replicas[stage - 1]:
                        self.replicas[stage - 1].remove(endpoint)
                    self._end_session(endpoint)
                else:
                    self._shun(endpoint)
                if isinstance(exc, RpcError):  # past its deadline, it may hold it still
                    self._abandon_at(endpoint, stage, request.micro_batch)
                trace.retries += 1
            finally:
                self.stats.busy[endpoint] -= 1

    def _shun(self, endpoint: str) -> None:
        """Do not draw ``endpoint`` for ``shun_s``, doubled for each failure before this
        one since it last answered a backward (up to ``max_shun_s``)."""
        self.failures[endpoint] += 1
        doublings = min(self.failures[endpoint] - 1, 32)
        seconds = min(self.config.shun_s * 2.0**doublings, self.config.max_shun_s)
        self.shunned[endpoint] = time.monotonic() + seconds

    def _draw(self, stage: int, tried: set[str]) -> str | None:
        now = time.monotonic()
        fresh = [
            e
            for e in self.replicas[stage - 1]
            if e not in tried
            and self.shunned.get(e, 0.0) <= now
            and self.distrusted.get(e, 0.0) <= now
        ]
        if not fresh:
            return None
        weights = [self.stats.weight(e) for e in fresh]
        # Every replica keeps a share (EXPLORE of the best's weight): a rate measured once
        # on a call that waited for the replica's round would otherwise starve it of the
        # draws that measure it again, and a replica with no micro-batches takes no steps,
        # so it never comes to its stage's rounds.
        floor = EXPLORE * max(weights)
        return self.rng.choices(fresh, weights=[max(w, floor) for w in weights])[0]

    async def _call(self, endpoint: str, method: Method[Req, Resp], request: Req) -> Resp:
        """One call to a replica; it fails at once if the replica falls silent on this
        driver's session with it meanwhile (its machine froze: nothing else would end the
        call before its deadline)."""
        calling = self.client.call(
            endpoint, method, request, timeout=self.config.hop_timeout_s, attempts=1
        )
        session = self._sessions.get(endpoint)
        if session is None or not session.open:
            return await calling
        answer = asyncio.ensure_future(calling)
        lost = asyncio.ensure_future(session.lost.wait())
        try:
            await asyncio.wait({answer, lost}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            lost.cancel()
            if not answer.done():
                answer.cancel()
        if answer.done() and not answer.cancelled():
            return answer.result()
        raise RpcError(
            f"{endpoint} fell silent on this driver's session",
            endpoint=endpoint,
            code=grpc.StatusCode.UNAVAILABLE,
        )

    def unserving(self) -> set[str]:
        """The replicas it does not draw now (they failed it, or answered wrong): its own
        evidence that they serve it nothing, whatever their records say."""
        now = time.monotonic()
        drawn_not = (*list(self.shunned.items()), *list(self.distrusted.items()))
        return {endpoint for endpoint, until in drawn_not if until > now}

    def distrusting(self) -> int:
        """How many replicas it does not draw now for answering wrong."""
        now = time.monotonic()
        return sum(1 for until in list(self.distrusted.values()) if until > now)

    async def finish_audits(self) -> None:
        """Wait for the audits under way to end."""
        while self._auditing:
            await asyncio.gather(*list(self._auditing), return_exceptions=True)

    def _start_audit(self, used: Used) -> None:
        """Audit ``used`` in the background, if fewer than ``max_audits`` are under way."""
        if len(self._auditing) >= self.config.max_audits:
            self.audits["not-made"] += 1
            return
        task = asyncio.get_running_loop().create_task(self._audit(used))
        self._auditing.add(task)
        task.add_done_callback(self._auditing.discard)

    async def _audit(self, used: Used) -> None:
        """Have another replica of the stage compute ``used``'s answer again and compare;
        a third when the two do not agree, and judge by the three (``audit.judge``)."""
        stage, tolerance = used.stage, self.config.audit_tolerance
        tried = {used.endpoint}
        answers: dict[str, Answer] = {used.endpoint: used.answer()}
        distances: dict[tuple[int, int], float] = {}
        while len(answers) < 3:
            auditor = await self._audit_at(used, tried)
            if auditor is None:
                break
            answers[auditor[0]] = auditor[1]
            new = len(answers) - 1
            for i, endpoint in enumerate(list(answers)[:new]):
                # (A micro-batch's activations can be tens of millions of values: not on the
                # event loop.)
                distances[(i, new)] = await asyncio.to_thread(
                    distance, answers[endpoint], auditor[1]
                )
            if new == 1 and distances[(0, 1)] <= tolerance:
                self.audits["agreed"] += 1
                for endpoint in answers:
                    del self.strikes[endpoint]  # evidence of an honest answer
                return
        if len(answers) == 1:
            self.audits["unchecked"] += 1
            return
        endpoints = list(answers)
        said = ", ".join(
            f"{endpoints[i]}-{endpoints[j]} {d:.3g}" for (i, j), d in distances.items()
        )
        suspect = judge(distances, tolerance) if len(answers) == 3 else None
        if suspect is None:
            self.audits["disputed"] += 1
            logger.warning(
                "stage %d's answers to a micro-batch do not agree, and do not say who is "
                "wrong (relative distances: %s; the tolerance %.3g)", stage, said, tolerance
            )  # fmt: skip
            return
        liar = endpoints[suspect]
        self.audits["judged-wrong"] += 1
        if self.distrusted.get(liar, 0.0) > time.monotonic():
            # Found out already: an audit of a micro-batch it answered before that, which
            # ran beside the one that found it out.
            return
        self.strikes[liar] += 1
        for endpoint in endpoints:
            if endpoint != liar:
                del self.strikes[endpoint]  # they agreed with each other
        if self.strikes[liar] < self.config.strikes:
            logger.warning(
                "stage %d's replica at %s answered a micro-batch wrong (relative distances: "
                "%s; the tolerance %.3g): %d of %d strikes, its answers are all audited now",
                stage, liar, said, tolerance, self.strikes[liar], self.config.strikes,
            )  # fmt: skip
            return
        self.audits["found-out"] += 1
        del self.strikes[liar]
        self.distrusted[liar] = time.monotonic() + self.config.distrust_s
        logger.warning(
            "stage %d's replica at %s answered a micro-batch wrong again (relative distances: "
            "%s; the tolerance %.3g): not drawn for %.0f s", stage, liar, said, tolerance,
            self.config.distrust_s,
        )  # fmt: skip
        if self.on_event is not None:
            self.on_event("replica-distrusted", endpoint=liar, at_stage=stage, distances=said)

    async def _audit_at(self, used: Used, tried: set[str]) -> tuple[str, Answer] | None:
        """``used``'s answer from a replica of its stage not in ``tried`` (each tried is
        added; one that refuses or fails makes way for the next): None when none answers."""
        k = used.stage
        request = pb.AuditRequest(
            swarm_id=self.swarm_id,
            stage=k,
            input=used.forward.input,
            targets=used.forward.targets if used.forward.HasField("targets") else None,
            seed=used.forward.seed,
            grad_output=used.grad_output,
        )
        last = k == len(self.replicas)
        while (endpoint := self._draw(k, tried)) is not None:
            tried.add(endpoint)
            try:
                reply = await self._call(endpoint, AUDIT, request)
                if reply.WhichOneof("outcome") != "answer":
                    continue  # busy (a round), or leaving: the next one
                output: torch.Tensor | float = reply.answer.loss
                if not last:
                    output = await asyncio.to_thread(
                        unpack, reply.answer.output, self.boundaries[k], "an audit's output"
                    )
                grad = await asyncio.to_thread(
                    unpack, reply.answer.grad_input, self.boundaries[k - 1], "an audit's gradient"
                )
            except RpcError:
                continue
            except Rejection:  # what it answered is checked like any answer
                self._shun(endpoint)
                continue
            return endpoint, Answer(output, grad)
        return None
