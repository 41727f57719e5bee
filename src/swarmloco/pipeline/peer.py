"""One peer of a pipelined run, serving one stage (``docs/DESIGN.md`` section 10).

A :class:`StagePeer` composes what the other modules of this package and the runtime
build:

- the stage's **replica** (``replica.py``), owned: this peer's stepping thread takes each
  due step (``step_samples`` sequences) and runs the step hook of a ``Peer`` over the
  stage's parameters before it lets forwards in again, so the stage's DiLoCo rounds (its
  replicas' swarm, named by the manifest ``manifest.py`` derives) pace, start, land and
  catch up as a data-parallel peer's do, and never under a micro-batch;
- past stage 0, the replica's **service** on the peer's own gRPC server; at every stage
  its ``stage-load`` record, published every few seconds (``load.py``);
- at stage 0, a **driver** (``driver.py``) that draws each later stage's replicas from the
  records it reads; :meth:`StagePeer.drive` runs one micro-batch through the pipeline,
  :meth:`StagePeer.submit` starts one (several may be in flight).

Every stage of the built-in transformers takes and gives activations of one shape
(``activations``); token ids enter stage 0 and the targets the last (``ids``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from swarmloco.core.manifest import SwarmManifest
from swarmloco.dataset.leases import LeasedData
from swarmloco.errors import Stopped, SwarmlocoError
from swarmloco.net.identity import Identity
from swarmloco.net.node import NetNode
from swarmloco.net.rejections import Rejection, RejectionLog
from swarmloco.net.server import Service
from swarmloco.net.swarm import publish_manifest
from swarmloco.pipeline.driver import Driver, DriverConfig, PipelineError, Trace, Withdrawn
from swarmloco.pipeline.feed import LeasedFeed
from swarmloco.pipeline.load import (
    StageLoad,
    Vouching,
    keep_publishing,
    keep_reading,
    publish_load,
    read_counted,
)
from swarmloco.pipeline.manifest import pipeline_of, stage_manifest
from swarmloco.pipeline.replica import ReplicaConfig, StageReplica
from swarmloco.pipeline.service import StageService
from swarmloco.pipeline.wire import Boundary, prepare
from swarmloco.runtime.config import PeerConfig
from swarmloco.runtime.peer import Kept, Peer, Trainee
from swarmloco.runtime.schedule import SwarmSchedule
from swarmloco.runtime.start import write_manifest_copy

logger = logging.getLogger(__name__)

STEP_POLL_S = 0.5  # how long the stepping thread waits for a due step before looking again
IDLE_LAND_S = 3.0  # no step for this long and a round's exchange over: land it without them
LEAVE_DRAIN_S = 10.0
"""A leaving peer waits this long at most for the backwards of the micro-batches it holds:
the stages before it apply them too (without, a stage that ends its run first would leave
the ones before it short of the micro-batches it had taken, and they never end theirs)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageWork:
    """What this peer trains: its stage's module (as every peer builds it) and optimizer,
    what crosses the stages' boundaries, and the sequences of one optimizer step."""

    module: nn.Module
    optimizer: torch.optim.Optimizer
    activations: Boundary
    ids: Boundary
    step_samples: int
    tokens_per_sequence: int
    lr_at: Callable[[int], float] | None = None
    """The learning rate at the stage's global step (None: the optimizer's own)."""
    grad_clip: float = 0.0
    """Clip this stage's gradient norm to this before each step (0: no clipping). Each
    stage clips its own part: no peer sees the whole model's norm."""
    autocast: torch.dtype | None = None
    """bf16: the stage computes under bf16 autocast (a GPU's choice); None: fp32."""


class StagePeer:
    """See the module. Constructing does no I/O; ``with`` enters the stage's swarm."""

    def __init__(
        self,
        run: SwarmManifest,
        stage: int,
        work: StageWork,
        *,
        config: PeerConfig,
        identity: Identity | None = None,
        on_event: Callable[[dict[str, Any]], None] | None = None,
        replica: ReplicaConfig | None = None,
        driver: DriverConfig | None = None,
        load_interval_s: float = 2.0,
        reader: LeasedData | None = None,
        services: Sequence[Service] = (),
    ) -> None:
        pipeline = pipeline_of(run)
        if pipeline is None:
            raise SwarmlocoError(f"swarm {run.swarm_id} is not a pipelined run")
        self.run = run
        self.stage = stage
        self.stages = pipeline.stages
        self.manifest = stage_manifest(run, stage)
        self.work = work
        # A step's tokens are what it trained (``hook.stepped``); the config's say a step's
        # before one is taken (a progress record's claim, the status record's count).
        # A later stage's rounds count the steps of all the drivers reaching its replicas:
        # the run's total steps and tokens are stage 0's (DESIGN section 10, "The run's end").
        self.config = dataclasses.replace(
            config,
            hook=False,
            tokens_per_step=work.step_samples * work.tokens_per_sequence,
            ends_at_run_total=stage == 0 and config.ends_at_run_total,
        )
        self.identity = identity or Identity.load_or_create(config.directory)
        self.on_event = on_event
        self.load_interval_s = load_interval_s
        first, last = stage == 0, stage == pipeline.stages - 1
        if reader is not None and not first:
            raise SwarmlocoError("only stage 0 reads the run's data")
        self.reader = reader
        """Stage 0 on a pinned dataset: the reader of its leases (``dataset/leases.py``),
        fed micro-batch by micro-batch through :attr:`feed`."""
        self.services = list(services)
        self.replica = StageReplica(
            work.module,
            first=first,
            last=last,
            config=dataclasses.replace(replica or ReplicaConfig(), step_samples=work.step_samples),
            optimizer=work.optimizer,
            owned=True,
            autocast=work.autocast,
        )
        self.replica.before_step = self._before_step
        self.service = StageService(
            self.replica,
            swarm_id=run.swarm_id,
            stage=stage,
            inputs=work.ids if first else work.activations,
            outputs=None if last else work.activations,
            targets=work.ids if last else None,
            encoding=pipeline.encoding,
            rejections=RejectionLog(logger),
        )
        self.driver_config = dataclasses.replace(
            driver or DriverConfig(), encoding=pipeline.encoding
        )
        self.feed = (
            None if reader is None else LeasedFeed(reader, self.replica, step=work.step_samples)
        )
        self.driver: Driver | None = None
        self.peer: Peer | None = None
        self.stopped = threading.Event()
        """Set when the stage's peer stops (max rounds, the run's end, a stop asked)."""
        self.flushing = threading.Event()
        """(A later stage about to leave: ``--leave-idle``.) Set: once no step came for a
        while, what this stage trained since its last round is averaged at once, as stage
        0's does once its data is read (:meth:`StepHook.wait` with ``flush``)."""
        self._closing = threading.Event()
        self._stack: contextlib.ExitStack | None = None
        self._stepping: threading.Thread | None = None
        self._loops: list[concurrent.futures.Future[None]] = []
        self._publishing: concurrent.futures.Future[None] | None = None
        self._vouching: Vouching | None = None

    def emit(self, event: str, **fields: Any) -> None:
        """An event of this peer (its stage added) to ``on_event``."""
        if self.on_event is not None:
            self.on_event({"event": event, "time": time.time(), "stage": self.stage, **fields})

    def __enter__(self) -> StagePeer:
        w = self.work
        # Compiled now, if at all, not on the first call under a deadline (wire.py).
        seconds = prepare(w.activations, self.service.encoding)
        if seconds:
            logger.info("the activations' int8 encoder compiled in %.1f s", seconds)
        trainee = Trainee(
            model=w.module,
            optimizer=w.optimizer,
            objects={} if self.reader is None else {"data": self.reader},
            box=None,
            evaluate=None,
            schedule=SwarmSchedule(w.optimizer, lambda: self._global_step()),
            ranges=self.reader,
        )
        if self.feed is not None:
            self.feed.attach()
        kept = Kept.fresh(self.config, self.identity.peer_id_hex, self.emit)
        if self.reader is not None:  # its epoch in its status record, as a reader's
            kept.sheet.data = self.reader.progress
        peer = Peer(
            self.manifest,
            trainee,
            kept,
            config=self.config,
            identity=self.identity,
            services=[self.service.service()] * (self.stage > 0) + self.services,
            on_step=lambda: None,
        )
        stack = contextlib.ExitStack()
        try:
            peer.enter(stack)
            # The run's manifest beside the stage's: an export from this data directory
            # finds the run's stages from it.
            run_dir = self.config.swarm_directory(self.run.swarm_id)
            run_dir.mkdir(parents=True, exist_ok=True)
            write_manifest_copy(run_dir / "manifest.json", self.run)
            self.peer, self._stack = peer, stack
            self._start_loops(peer)
        except BaseException:
            stack.close()
            raise
        self._stepping = threading.Thread(
            target=self._steps, name=f"swarmloco-stage{self.stage}-steps", daemon=True
        )
        self._stepping.start()
        self.emit("stage-joined", stages=self.stages, swarm=self.manifest.swarm_id)
        return self

    def stop(self, why: str) -> None:
        """Ask this peer to stop (a signal handler may call it): :meth:`drive` raises
        :class:`Stopped` from now on, ``stopped`` is set, and leaving the ``with`` block
        then lands or abandons the round in flight, checkpoints and withdraws the records."""
        if self.peer is not None:
            self.peer.kept.stop.stop(why)
        self.stopped.set()

    def read_loads(self, timeout: float = 30.0) -> list[StageLoad]:
        """The run's fresh ``stage-load`` records this peer counts now: those whose server
        vouched for them (:class:`~swarmloco.pipeline.load.Vouching`), the moves announced
        by keys whose servers vouched before, and its own."""
        if self.peer is None or self.peer.network is None:
            raise SwarmlocoError("only an entered stage peer reads the stages' load")
        node = self.peer.network.node
        read = read_counted(node.dht, self.run.swarm_id, self._vouched_by(node))
        return self.peer.loop.run(read, timeout=timeout)

    def _vouched_by(self, node: NetNode) -> Vouching:
        """Which records this peer counts, its driver and its rebalancing alike."""
        if self._vouching is None:
            self._vouching = Vouching(node.who_serves, self.identity.peer_id_hex)
        return self._vouching

    def announce_move(self, stage: int, timeout: float = 30.0) -> None:
        """Say now that this peer leaves for ``stage``: its record from now on counts it
        there, serving nothing yet and its rate unmeasured (so no other peer judges a move
        on the old picture, and nobody judges one until this peer measured its new stage).
        Its drivers stop drawing it once they read it."""
        if self.peer is None or self.peer.network is None:
            raise SwarmlocoError("only an entered stage peer moves")
        if self._publishing is not None:
            self._publishing.cancel()
        dht = self.peer.network.node.dht
        moving = {"rate": 0.0, "queue": 0, "free": 0}
        store = publish_load(dht, self.run.swarm_id, stage=stage, endpoint="", load=moving)
        self.peer.loop.run(store, timeout=timeout)

    def working(self) -> bool:
        """Whether this peer's replica computed a micro-batch yet (its rate is measured)."""
        return self.replica.rate.value > 0

    def unserving(self, timeout: float = 30.0) -> set[str]:
        """The replicas of later stages this peer's driver does not draw now (they failed
        it or answered wrong: first-hand); none for a peer that does not drive."""
        if self.driver is None or self.peer is None:
            return set()
        driver = self.driver

        async def read() -> set[str]:  # on the loop, where the driver's maps change
            return driver.unserving()

        return self.peer.loop.run(read(), timeout=timeout)

    def busy_seconds(self) -> float:
        """Seconds this peer's replica has computed since it began (first-hand)."""
        return self.replica.busy_s

    def swarm_clock(self) -> float:
        """The swarm's time (unix seconds, as the DHT's records carry it)."""
        assert self.peer is not None and self.peer.network is not None
        return float(self.peer.network.node.dht.clock())

    def _before_step(self) -> None:
        """The learning rate of the stage's global step, and the clipping, on the mean
        gradient the replica is about to step on."""
        w = self.work
        if w.lr_at is not None:
            # A later stage's steps run at the pace its drivers reach it: its rate follows
            # stage 0's step, as they say it (DESIGN section 10, "The run's end").
            said = None if self.stage == 0 else self.replica.claimed_step()
            lr = w.lr_at(self._global_step() if said is None else said)
            for group in w.optimizer.param_groups:
                group["lr"] = lr
        if w.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(w.module.parameters(), w.grad_clip)

    def _global_step(self) -> int:
        return self.peer.kept.progress.global_step if self.peer is not None else 0

    def _start_loops(self, peer: Peer) -> None:
        """The run's manifest, the stage-load record (every stage's: a joining peer counts
        them to choose its stage; nobody calls stage 0), and at stage 0 the driver and its
        reading, on the peer's event loop."""
        assert peer.network is not None
        dht = peer.network.node.dht
        gate = peer.admission  # (the stage's swarm's: its credential names the run)
        run_gate = None if gate is None else gate.guarding(self.run.swarm_id)

        async def publish() -> None:
            # The run's records carry this key's credential, and those of keys without one
            # are dropped here, as in the stage's swarm.
            if run_gate is not None:
                dht.admit(run_gate)
            await publish_manifest(dht, self.run)

        # The run's own manifest, which `join RUN_ID` fetches: the peer's network publishes
        # its stage's, and a training `create --stages` nothing else.
        try:
            peer.loop.run(publish(), timeout=60.0)
        except SwarmlocoError as exc:  # alone on a new network: our own storage holds it
            logger.info("the run's manifest: %s", exc)
        interval = self.load_interval_s
        publishing = keep_publishing(
            dht,
            self.run.swarm_id,
            stage=self.stage,
            endpoint=peer.network.node.endpoint,
            load=lambda: {
                **self.replica.load(),
                "round": peer.diloco.round,
                "skipped": self.replica.skipped,
                "refused": self.service.refusals(),
                "distrusted": None if self.driver is None else self.driver.distrusting(),
                "drivers": None if self.stage == 0 else self.replica.sessions,
                "orphaned": (
                    None if self.stage == 0 else self.replica.dropped + self.replica.orphaned
                ),
            },
            interval_s=interval,
        )
        self._publishing = peer.loop.submit(publishing)
        self._loops.append(self._publishing)
        if self.stage > 0:
            return
        self.driver = Driver(
            peer.network.node.client,
            self.replica,
            swarm_id=self.run.swarm_id,
            replicas=[[] for _ in range(self.stages - 1)],
            boundaries=[self.work.activations] * (self.stages - 1),
            ids=self.work.ids,
            config=self.driver_config,
            on_event=self.emit,
            step=self._global_step,
        )
        reading = keep_reading(
            dht,
            self.run.swarm_id,
            self.driver.update,
            interval_s=interval,
            vouching=self._vouched_by(peer.network.node),
        )
        self._loops.append(peer.loop.submit(reading))

    def _steps(self) -> None:
        """Take each due step and run the stage's step hook before releasing the replica;
        end when the peer stops or this object closes. When no step came for
        ``IDLE_LAND_S`` and a round's exchange has ended, take what is accumulated and land
        the round (the steps it was to overlap may never come: the drivers stopped)."""
        peer = self.peer
        assert peer is not None
        last_step = time.monotonic()
        try:
            while not self._closing.is_set() and not self.stopped.is_set():
                samples = self.replica.take_step(timeout=STEP_POLL_S)
                idle = False
                if samples is None:
                    if peer.hook.settling:  # a round landed: its digest, without a step
                        peer.hook.settle()
                    # Stage 0 read its data to the end (or all it may lease), or a later
                    # stage is about to leave: what it trained is averaged now, not when
                    # steps that are not coming make a round due.
                    flush = (
                        self.reader is not None and self.reader.exhausted
                    ) or self.flushing.is_set()
                    if time.monotonic() - last_step < IDLE_LAND_S or not (
                        flush or peer.hook.exchange_over()
                    ):
                        continue
                    samples = self.replica.take_step(timeout=STEP_POLL_S, now=True)
                    if samples is None:
                        continue
                    idle = True
                last_step = time.monotonic()
                if self.stage == self.stages - 1:
                    peer.kept.progress.loss = self.replica.loss
                try:
                    if samples:
                        peer.hook.stepped(samples * self.work.tokens_per_sequence)
                    if idle and flush:
                        peer.hook.wait(flush=True)
                    elif idle:
                        peer.hook.idle()
                except Stopped:
                    self.stopped.set()
                except BaseException:
                    logger.exception("stage %d: the step hook failed", self.stage)
                    self.stopped.set()
                    raise
                finally:
                    self.replica.release()
        finally:
            # Nobody takes its steps any more: what is in flight ends here, then refuse.
            self.replica.drain(LEAVE_DRAIN_S)
            self.replica.close()

    def drive(self, x: torch.Tensor, targets: torch.Tensor, *, timeout: float = 300.0) -> Trace:
        """(Stage 0.) One micro-batch through the pipeline: its loss and path. Raises
        :class:`Stopped` once this peer stopped (as a data-parallel peer's step does),
        :class:`PipelineError` when no replica of a stage took it."""
        return self.submit(x, targets, timeout=timeout).result()

    def submit(
        self,
        x: torch.Tensor,
        targets: torch.Tensor,
        *,
        timeout: float = 300.0,
        name: bytes | None = None,
    ) -> concurrent.futures.Future[Trace]:
        """(Stage 0.) Start one micro-batch through the pipeline and return at once: the
        future's result is what :meth:`drive` returns or raises. Several may be in flight
        at once (their replicas admit no more than a step's sequences: none of them is
        applied twice, and no step is on more than the run's batch). ``name``: the
        micro-batch's (the replica's ``on_step`` names it; a new one if None)."""
        if self.driver is None or self.peer is None:
            raise SwarmlocoError("only an entered peer of stage 0 drives micro-batches")
        if self.stopped.is_set():
            raise Stopped(self.peer.kept.stop.reason or "this stage's peer stopped")
        return self.peer.loop.submit(self._drive(self.driver, x, targets, timeout, name))

    async def _drive(
        self,
        driver: Driver,
        x: torch.Tensor,
        targets: torch.Tensor,
        timeout: float,
        name: bytes | None,
    ) -> Trace:
        assert self.peer is not None
        deadline = time.monotonic() + timeout
        while True:
            try:
                trace = await asyncio.wait_for(
                    driver.run(x, targets, name=name), max(0.0, deadline - time.monotonic())
                )
                break
            except TimeoutError as exc:
                raise PipelineError(
                    f"the micro-batch did not get through in {timeout:.0f} s"
                ) from exc
            except Rejection as exc:  # this peer's own replica refused the micro-batch
                if self.replica.closed or self.stopped.is_set():  # it is leaving
                    raise Stopped(self.peer.kept.stop.reason or str(exc)) from exc
                if exc.code == "withdrawn":
                    raise Withdrawn(exc.reason) from exc
                # It is between two steps (a round longer than its forward waits): the
                # micro-batch waits on, until the round lands or the deadline.
                if time.monotonic() >= deadline:
                    raise PipelineError(f"this peer's own stage did not take it: {exc}") from exc
        self.peer.kept.progress.loss = trace.loss  # the pipeline's, for the round's log
        return trace

    def __exit__(self, *exc: object) -> None:
        self._closing.set()
        self.replica.drain(LEAVE_DRAIN_S)
        self.replica.close()
        self.service.close()
        if self.driver is not None:
            self.driver.close()
        if self._stepping is not None:
            self._stepping.join()
        for loop in self._loops:
            loop.cancel()
        if self.peer is not None and self._stack is not None:
            self.peer.leave(self._stack, failed=exc[0] is not None, interrupted=False)
