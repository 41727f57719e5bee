"""A stage replica behind the ``swarmloco.v1.Stage`` gRPC service (``proto/swarmloco/v1/
stage.proto``): each call decoded and checked (``wire.py``), computed and its answer
packed in the run's encoding on a worker thread (never on the event loop). Whatever a
caller sends becomes a counted refusal, never an exception in the peer.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import grpc
import torch

from swarmloco.net.client import Method
from swarmloco.net.rejections import Rejection, RejectionLog
from swarmloco.net.server import Service, decoder, unary_method_handlers
from swarmloco.pipeline import replica as replica_module
from swarmloco.pipeline.beats import BURST, Beats
from swarmloco.pipeline.replica import StageReplica
from swarmloco.pipeline.wire import Boundary, pack, unpack
from swarmloco.proto.v1 import stage_pb2 as pb

SERVICE_NAME = "swarmloco.v1.Stage"
FORWARD = Method(f"/{SERVICE_NAME}/Forward", pb.ForwardRequest, pb.ForwardResponse)
BACKWARD = Method(f"/{SERVICE_NAME}/Backward", pb.BackwardRequest, pb.BackwardResponse)
ABANDON = Method(f"/{SERVICE_NAME}/Abandon", pb.AbandonRequest, pb.AbandonResponse)
AUDIT = Method(f"/{SERVICE_NAME}/Audit", pb.AuditRequest, pb.AuditResponse)
SESSION = Method(f"/{SERVICE_NAME}/Session", pb.SessionRequest, pb.SessionEvent)
ATTEND = Method(f"/{SERVICE_NAME}/Attend", pb.SessionRequest, pb.SessionEvent)
MICRO_BATCH_BYTES = 16
SESSION_BYTES = 16
FORWARD_THREADS = 32
"""Forwards computed or waiting for a due step at once; more wait for a thread."""
BACKWARD_THREADS = 2
"""Backwards at once (the replica computes one at a time, under its lock)."""
AUDIT_THREADS = 1
"""Audits at once: on threads of their own, so that audits never hold a backward back
by more than the one compute under way."""
AUDITS_WAITING = 4
"""Audits running or waiting for their thread at most; more are refused as busy (an
audit costs a compute and holds its tensors: nobody queues them without bound)."""
_CLOSED = object()
"""What a session's reader puts in its inbox once the driver closed its side."""

logger = logging.getLogger(__name__)
T = TypeVar("T")


class CallPools:
    """The worker threads of a stage replica's calls, forwards and backwards apart: a
    forward may wait for a due step, holding its thread, and the backwards that bring the
    step must never queue behind such forwards (docs/DESIGN.md section 10)."""

    def __init__(self, name: str, *, forwards: int, backwards: int, audits: int = 0) -> None:
        calls = (("forward", forwards), ("backward", backwards), ("audit", audits))
        self._pools = {
            call: concurrent.futures.ThreadPoolExecutor(threads, f"swarmloco-{name}-{call}")
            for call, threads in calls
            if threads
        }

    async def run(self, call: str, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a thread of ``call``'s pool ("forward", "backward", "audit");
        :class:`Rejection` ``busy`` once closed (the peer is leaving)."""
        try:
            future = asyncio.get_running_loop().run_in_executor(self._pools[call], fn, *args)
        except RuntimeError:  # shut down
            raise Rejection("busy", "this replica is leaving") from None
        return await future

    def submit(self, call: str, fn: Callable[..., Any], *args: Any) -> None:
        """``fn(*args)`` on a thread of ``call``'s pool, not waited for (nothing once
        closed)."""
        with contextlib.suppress(RuntimeError):  # shut down
            self._pools[call].submit(fn, *args)

    def close(self) -> None:
        """Stop the threads (a call still running ends first, one not started is dropped)."""
        for pool in self._pools.values():
            pool.shutdown(wait=False, cancel_futures=True)


class StageService:
    """See the module. ``inputs``/``outputs``: what may cross the stage's two boundaries
    (``targets``: the last stage's targets); ``encoding``: how answers travel."""

    def __init__(
        self,
        replica: StageReplica,
        *,
        swarm_id: str,
        stage: int,
        inputs: Boundary,
        outputs: Boundary | None,
        targets: Boundary | None,
        encoding: str,
        rejections: RejectionLog,
    ) -> None:
        self.replica = replica
        self.swarm_id = swarm_id
        self.stage = stage
        self.inputs, self.outputs, self.targets = inputs, outputs, targets
        self.encoding = encoding
        self.rejections = rejections
        self.refused: collections.Counter[str] = collections.Counter()
        """Refusals by code."""
        self.silent = 0
        """Sessions ended because their driver sent no beat for ``session_silence_s``."""
        self._audits = 0  # running or waiting for their thread (on the event loop)
        self._pools = CallPools(
            f"stage{stage}",
            forwards=FORWARD_THREADS,
            backwards=BACKWARD_THREADS,
            audits=AUDIT_THREADS,
        )

    def close(self) -> None:
        """Stop the worker threads (the peer leaves)."""
        self._pools.close()

    def refusals(self) -> int:
        """Calls refused so far other than as busy (busy is back-pressure, not bad input)."""
        return sum(n for code, n in list(self.refused.items()) if code != "busy")

    def service(self) -> Service:
        handlers = unary_method_handlers(
            {
                "Forward": (pb.ForwardRequest, self.forward),
                "Backward": (pb.BackwardRequest, self.backward),
                "Abandon": (pb.AbandonRequest, self.abandon),
                "Audit": (pb.AuditRequest, self.audit),
            },
            rejections=self.rejections,
        )
        handlers["Session"] = grpc.unary_stream_rpc_method_handler(
            self.session,
            request_deserializer=decoder(pb.SessionRequest),
            response_serializer=pb.SessionEvent.SerializeToString,
        )
        handlers["Attend"] = grpc.stream_stream_rpc_method_handler(
            self.attend,
            request_deserializer=decoder(pb.SessionRequest),
            response_serializer=pb.SessionEvent.SerializeToString,
        )
        generic = grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)
        return Service(SERVICE_NAME, lambda server: server.add_generic_rpc_handlers((generic,)))

    def _check_stage(self, swarm_id: str, stage: int) -> None:
        if swarm_id != self.swarm_id or stage != self.stage:
            raise Rejection("wrong-stage", f"this peer serves stage {self.stage} of another run")

    def _check_call(self, swarm_id: str, stage: int, micro_batch: bytes) -> None:
        self._check_stage(swarm_id, stage)
        if len(micro_batch) != MICRO_BATCH_BYTES:
            raise Rejection("malformed", f"a micro-batch is named by {MICRO_BATCH_BYTES} bytes")

    async def forward(self, request: pb.ForwardRequest, context: Any) -> pb.ForwardResponse:
        try:
            self._check_call(request.swarm_id, request.stage, request.micro_batch)
            return await self._compute("forward", self._forward, request)
        except Rejection as rejection:
            return pb.ForwardResponse(refused=self._refuse(rejection, context))

    def _forward(self, request: pb.ForwardRequest) -> pb.ForwardResponse:
        x, targets = self._inputs(request.input, request.targets)
        out = self.replica.forward(
            request.micro_batch,
            x,
            targets,
            seed=request.seed,
            session=request.session,
            step=request.step if request.HasField("step") else None,
        )
        if self.replica.last:
            return pb.ForwardResponse(loss=float(out))
        return pb.ForwardResponse(output=pack(out, self.encoding))

    def _inputs(
        self, input: pb.StageTensor, targets: pb.StageTensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = unpack(input, self.inputs, "input")
        if self.targets is None:
            return x, None
        y = unpack(targets, self.targets, "targets")
        if y.shape != x.shape[:2]:
            raise Rejection("bad-shape", "the targets are not the input's shape")
        return x, y

    async def backward(self, request: pb.BackwardRequest, context: Any) -> pb.BackwardResponse:
        try:
            self._check_call(request.swarm_id, request.stage, request.micro_batch)
            return await self._compute("backward", self._backward, request)
        except Rejection as rejection:
            return pb.BackwardResponse(refused=self._refuse(rejection, context))

    def _backward(self, request: pb.BackwardRequest) -> pb.BackwardResponse:
        grad = None
        if self.outputs is not None:
            grad = unpack(request.grad_output, self.outputs, "grad_output")
        grad_input = self.replica.backward(request.micro_batch, grad)
        if grad_input is None:
            return pb.BackwardResponse(grad_input=pb.StageTensor())
        return pb.BackwardResponse(grad_input=pack(grad_input, self.encoding))

    async def abandon(self, request: pb.AbandonRequest, context: Any) -> pb.AbandonResponse:
        """Drop a micro-batch's input (its path broke after this stage). Only its driver
        knows its name: nobody else can drop another's micro-batch."""
        try:
            self._check_call(request.swarm_id, request.stage, request.micro_batch)
            # The replica's lock may be held by a compute: on a thread, as a backward.
            dropped = await self._compute("backward", self.replica.abandon, request.micro_batch)
            return pb.AbandonResponse(dropped=dropped)
        except Rejection as rejection:
            return pb.AbandonResponse(refused=self._refuse(rejection, context))

    async def audit(self, request: pb.AuditRequest, context: Any) -> pb.AuditResponse:
        """A micro-batch's answer computed again for a driver checking another replica's
        (``StageReplica.audit``), one at a time, on a thread of its own."""
        try:
            self._check_stage(request.swarm_id, request.stage)
            if self._audits >= AUDITS_WAITING:
                raise Rejection("busy", f"{self._audits} audits are waiting here")
            self._audits += 1
            try:
                return await self._compute("audit", self._audit, request)
            finally:
                self._audits -= 1
        except Rejection as rejection:
            return pb.AuditResponse(refused=self._refuse(rejection, context))

    def _audit(self, request: pb.AuditRequest) -> pb.AuditResponse:
        x, targets = self._inputs(request.input, request.targets)
        grad = None
        if self.outputs is not None:
            grad = unpack(request.grad_output, self.outputs, "grad_output")
        out, grad_input = self.replica.audit(x, targets, grad, seed=request.seed)
        answer = pb.AuditAnswer(grad_input=pack(grad_input, self.encoding))
        if self.replica.last:
            answer.loss = float(out)
        else:
            answer.output.CopyFrom(pack(out, self.encoding))
        return pb.AuditResponse(answer=answer)

    async def session(self, request: object, context: Any) -> None:
        """A driver's session (``Session``, one way: an older driver's): open until the
        call ends, then the inputs of its micro-batches held here are dropped
        (``StageReplica.end_session``). The server caps sessions per source network and in
        all (``ServerConfig.max_sessions``)."""
        session = await self._open_session(request, context)
        if session is None:
            return
        try:
            await context.write(pb.SessionEvent(open=True))
            await asyncio.Event().wait()  # until the call ends: its driver left, or died
        finally:
            self._end_session(session)

    async def attend(self, requests: Any, context: Any) -> None:
        """A driver's session that beats (``Attend``): its first message names it, then the
        driver sends one at least every ``session_beat_s``, and this replica writes its
        open answer again as often (its drivers hear it live, whatever it computes); the
        session ends (its inputs dropped, as at :meth:`session`'s end) when the call ends
        or nothing came for ``session_silence_s``: a driver whose machine froze or dropped
        off its network closes no connection (docs/DESIGN.md section 10)."""
        config = self.replica.config
        inbox: asyncio.Queue[object] = asyncio.Queue(maxsize=BURST)
        reader = asyncio.create_task(self._read_beats(requests, inbox))
        try:
            await self._attend(inbox, context, config)
        finally:
            reader.cancel()

    @staticmethod
    async def _read_beats(requests: Any, inbox: asyncio.Queue[object]) -> None:
        """Put what the driver sends in ``inbox`` (then ``_CLOSED``), waiting while it is
        full: a driver sending faster than the replica reads is held back by the call's
        flow control. (Reads are never cancelled half-way but here, at the call's end.)"""
        async for message in requests:
            await inbox.put(message)
        await inbox.put(_CLOSED)

    async def _attend(
        self, inbox: asyncio.Queue[object], context: Any, config: replica_module.ReplicaConfig
    ) -> None:
        try:
            first = await asyncio.wait_for(inbox.get(), config.session_silence_s)
        except TimeoutError:
            return  # named no session: nothing opened
        if first is _CLOSED:
            return
        session = await self._open_session(first, context)
        if session is None:
            return
        silent = False
        try:
            beat_ms = max(1, round(config.session_beat_s * 1000))
            beat = pb.SessionEvent(open=True, beat_ms=beat_ms)
            await context.write(beat)
            loop = asyncio.get_running_loop()
            heard = Beats(
                beat_s=config.session_beat_s, silence_s=config.session_silence_s, now=loop.time()
            )
            written = loop.time()
            while True:
                before = loop.time()
                asked = max(0.0, heard.wake(written) - before)
                try:
                    message = await asyncio.wait_for(inbox.get(), asked)
                except TimeoutError:
                    message = None
                now = loop.time()
                heard.waited(asked=asked, slept=now - before, now=now)
                if message is None and heard.silent(now):
                    self.silent += 1
                    logger.info(
                        "stage %d: a driver's session was silent for %.0f s: ended",
                        self.stage, config.session_silence_s,
                    )  # fmt: skip
                    silent = True
                    return
                if message is _CLOSED:
                    return  # the driver closed its side: it left
                if message is not None:
                    rejection = None
                    if not heard.heard_one(now):  # each costs the event loop a read
                        rejection = Rejection("malformed", "beats far more often than asked")
                    if not isinstance(message, pb.SessionRequest):
                        rejection = Rejection("malformed", "a beat is not a SessionRequest")
                    if rejection is not None:
                        refusal = self._refuse(rejection, context)
                        await context.write(pb.SessionEvent(refused=refusal))
                        return
                if now - written >= config.session_beat_s:
                    await context.write(beat)
                    written = now
        finally:
            self._end_session(session, silent=silent)

    async def _open_session(self, request: object, context: Any) -> bytes | None:
        """Open the session ``request`` names (its name), or answer a refusal (None)."""
        try:
            if not isinstance(request, pb.SessionRequest):
                raise Rejection("malformed", "Session: the request is not a SessionRequest")
            self._check_stage(request.swarm_id, request.stage)
            if len(request.session) != SESSION_BYTES:
                raise Rejection("malformed", f"a session is named by {SESSION_BYTES} bytes")
            if not self.replica.open_session(request.session):
                raise Rejection("malformed", "a session of that name is open already")
        except Rejection as rejection:
            await context.write(pb.SessionEvent(refused=self._refuse(rejection, context)))
            return None
        return request.session

    def _end_session(self, session: bytes, *, silent: bool = False) -> None:
        # Closed now (later forwards naming it are refused); its inputs dropped on a thread
        # (a compute may hold the replica), not waited for: the call ended (``silent``:
        # because its driver fell silent, who may come back).
        self.replica.close_session(session)
        end = self.replica.fell_silent if silent else self.replica.end_session
        self._pools.submit("backward", end, session)

    async def _compute(self, call: str, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a worker thread of the call's pool (decoding, the compute and
        encoding: never on the event loop); a call that waited long for one is logged (the
        replica logs the rest of a slow call's time)."""
        queued = time.perf_counter()

        def run() -> T:
            waited = time.perf_counter() - queued
            if waited > replica_module.SLOW_CALL_S:
                logger.warning("stage %d: a %s waited %.1f s for a worker thread", self.stage,
                               call, waited)  # fmt: skip
            return fn(*args)

        return await self._pools.run(call, run)

    def _refuse(self, rejection: Rejection, context: Any) -> pb.StageRefusal:
        self.refused[rejection.code] += 1
        # (grpc's servicer context is no subclass of grpc.aio.ServicerContext: asked by name.)
        peer = context.peer() if hasattr(context, "peer") else "in-process"
        self.rejections.record(rejection, peer)
        return pb.StageRefusal(code=rejection.code, reason=rejection.reason)
