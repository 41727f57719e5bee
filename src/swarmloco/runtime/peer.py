"""A peer entered in its swarm: the parts built on enter, in order, and the collaborators
around them (DESIGN section 2, "The peer object and its collaborators").

``Swarm`` is what the user holds; on ``with swarm:`` it builds a :class:`Peer` from what
the user brought (:class:`Trainee`) and what outlives the entering (:class:`Kept`), and
:meth:`Peer.enter` does the entering: fetch or take the manifest, refuse a model that is not
the swarm's (before any other network traffic), settle admission, build the DiLoCo state
around the model's parameters, open the checkpoints and resume from the newest that fits,
start the network with the pacer, the round driver, the follower and the step hook around
the parts they share, catch up with the swarm (or fetch the initial weights), and say that
it trains.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from swarmloco.core.adoption import Evidence
from swarmloco.core.manifest import SwarmManifest
from swarmloco.core.runspec import RunSpec
from swarmloco.core.signature import params_of
from swarmloco.errors import ModelMismatch, SwarmlocoError
from swarmloco.net.admission import Gate
from swarmloco.net.identity import Identity
from swarmloco.net.server import Service
from swarmloco.runtime.box import Box, Op
from swarmloco.runtime.config import PeerConfig
from swarmloco.runtime.follow import Follower
from swarmloco.runtime.hook import StepHook, StopFlag
from swarmloco.runtime.loop_thread import LoopThread
from swarmloco.runtime.network import SwarmNetwork
from swarmloco.runtime.pacer import Pacer
from swarmloco.runtime.parts import PeerParts, RangeKeeper
from swarmloco.runtime.persist import PeerCheckpoints, PeerState, Stateful
from swarmloco.runtime.progress import LocalProgress
from swarmloco.runtime.rounds import RoundDriver
from swarmloco.runtime.schedule import SwarmSchedule
from swarmloco.runtime.session import REMEMBER, Session
from swarmloco.runtime.snapshots import Snapshots
from swarmloco.runtime.start import (
    build_network,
    clock_warning,
    describe_device,
    diloco_around,
    log_ready,
    manifest_signature,
    manifest_spec,
    open_keeper,
    take_own_initial,
)
from swarmloco.runtime.status import Counters, StatusSheet
from swarmloco.runtime.trial import Trial

logger = logging.getLogger("swarmloco.runtime.swarm")

PEERS_POLL_S = 0.5  # how long a count of the peers online waits for a read at most


@dataclasses.dataclass(frozen=True, kw_only=True)
class Trainee:
    """What the user brought: the model and its optimizer, the objects registered to be
    checkpointed, the box of ranks (None: one process), the evaluation of the global model
    and the learning-rate schedule that follows the swarm."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    objects: Mapping[str, Stateful]
    box: Box | None
    evaluate: Callable[[], float] | None
    schedule: SwarmSchedule
    ranges: RangeKeeper | None = None
    """The data reader of a pinned dataset's leases (every sequence lands once)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Kept:
    """What the peer keeps from before it enters until after it leaves (the user reads
    it at any time): the status sheet, the counts, the evidence, the adoption trial, the
    stop flag, and the sink of its events."""

    sheet: StatusSheet
    progress: LocalProgress
    evidence: Evidence
    trial: Trial
    stop: StopFlag
    emit: Callable[..., None]

    @classmethod
    def fresh(cls, config: PeerConfig, peer_id: str, emit: Callable[..., None]) -> Kept:
        """A new peer's: nothing counted yet, its sheet named by ``config`` or after the
        host and the key (several peers on one host, or in containers named alike, stay
        apart)."""
        sheet = StatusSheet(
            name=config.name or f"{socket.gethostname()[:50]}/{peer_id[:6]}",
            device="",  # known once the swarm is entered
            started_at=time.time(),
        )
        return cls(
            sheet=sheet,
            progress=LocalProgress(),
            evidence=Evidence(),
            trial=Trial(config.catchup.adoption),
            stop=StopFlag(),
            emit=emit,
        )


@dataclasses.dataclass
class Summary:
    """What a peer did, in :attr:`Swarm.summary`."""

    swarm_id: str
    peer_id: str
    round: int
    steps: int
    global_step: int
    rounds_applied: int
    rounds_aborted: int
    downloads: int
    last_eval_loss: float | None
    stopped_because: str


class Peer:
    """See the module. Constructing does no I/O; :meth:`enter` builds everything, closed
    with the stack it is given. ``network``: injected (tests' fault plans), else built."""

    def __init__(
        self,
        source: SwarmManifest | str,
        trainee: Trainee,
        kept: Kept,
        *,
        config: PeerConfig,
        identity: Identity,
        network: SwarmNetwork | None = None,
        services: Sequence[Service] = (),
        on_step: Callable[[], None],
    ) -> None:
        self.manifest = source if isinstance(source, SwarmManifest) else None
        self.swarm_id = source.swarm_id if isinstance(source, SwarmManifest) else source
        self.trainee = trainee
        self.kept = kept
        self.config = config
        self.identity = identity
        self.peer_id = identity.peer_id_hex
        self.network = network
        self.services = tuple(services)
        """More gRPC services the peer's server carries (a pipeline stage's)."""
        self.on_step = on_step
        self.admission: Gate | None = None
        self.optimizer_hook: Any = None
        self.train_started = 0.0

    # -- entering -----------------------------------------------------------------------------

    def enter(self, stack: contextlib.ExitStack) -> None:
        cfg, t, k = self.config, self.trainee, self.kept
        self.loop = stack.enter_context(LoopThread(name="swarmloco-peer-loop"))
        self.session = Session(cfg, self.identity, self.loop, self.swarm_id)
        if self.manifest is None:
            self.manifest = self.session.manifest()
            self.swarm_id = self.session.swarm_id
        manifest = self.manifest
        self.spec = spec = manifest_spec(manifest)
        self.signature = manifest_signature(manifest)
        self._check_model()
        # After the model's check (a wrong model is refused at once), before the network:
        # a private run's certificate, or this key's proof of work (solved once, kept).
        self.admission = self.session.admission(manifest)
        if t.box is not None:
            t.box.tell(Op.MANIFEST)
            t.box.share(manifest.to_bytes())
        self.diloco, self.params, codec = diloco_around(t.model, self.signature, spec, cfg, t.box)
        k.sheet.device = describe_device(self.params.device)
        self.keeper = open_keeper(stack, cfg, manifest, k.emit)
        self.snapshots = stack.enter_context(
            Snapshots(self.swarm_id, cfg.swarm_directory(self.swarm_id))
        )
        own_initial = self._restore() or take_own_initial(
            self.diloco, self.params, self.signature.init_digest
        )
        self.snapshots.store(self.diloco)
        if self.network is None:
            self.network = build_network(
                config=cfg,
                session=self.session,
                identity=self.identity,
                manifest=manifest,
                diloco=self.diloco,
                codec=codec,
                evidence=k.evidence,
                admission=self.admission,
            )
        if self.network.node.server is not None:
            for service in self.services:
                self.network.node.server.add_service(service)
        self._start_network(stack, self.network, spec)
        self.train_started = time.monotonic()
        self.follower.catch_up()
        if not own_initial and self.diloco.round == 0:
            self.follower.fetch_initial(self.signature.init_digest, spec.seed)
        self._keep_leases(stack, self.network)  # after the catch-up: it trusts its donor
        t.schedule.follow()
        if cfg.hook:
            self.optimizer_hook = t.optimizer.register_step_post_hook(lambda *_: self.on_step())
            stack.callback(self.optimizer_hook.remove)
        k.sheet.state = "training"
        k.progress.step_ended = time.monotonic()
        self._ready()

    def _keep_leases(self, stack: contextlib.ExitStack, network: SwarmNetwork) -> None:
        """On a pinned dataset: keep the reader's leases on the loop while the peer is in
        the swarm. Ranges read before a restart and not landed are trained into the
        restored local state, which may also have reached the others before the crash:
        that work is thrown away and the ranges read again (once, less what landed)."""
        ranges = self.trainee.ranges
        if ranges is None:
            return
        if ranges.pending():
            self.follower.restart_from_global()
        ranges.restored(self.diloco.landed)  # what it reads: what has not landed in its state
        self.loop.submit(ranges.run(network.node.dht, self.swarm_id, self.peer_id))

        def stop() -> None:
            with contextlib.suppress(Exception):
                self.loop.run(ranges.close(), timeout=10.0)

        stack.callback(stop)

    def _check_model(self) -> None:
        """Refuse a model that is not the swarm's, naming each difference."""
        differences = self.signature.differences(params_of(self.trainee.model))
        if differences:
            lines = "\n".join(f"  - {d}" for d in differences)
            raise ModelMismatch(
                f"this model is not the one swarm {self.swarm_id} trains:\n{lines}\nbuild the "
                "model exactly as the swarm's creator did (same class, config and dtype)",
                differences,
            )

    def _restore(self) -> bool:
        """Resume from the newest checkpoint that loads and fits this peer (see
        :class:`PeerCheckpoints`); False when there is none."""
        t, k = self.trainee, self.kept
        state = PeerState(
            model=t.model,
            optimizer=t.optimizer,
            objects=t.objects,
            diloco=self.diloco,
            params=self.params,
            progress=k.progress,
            evidence=k.evidence,
            trial=k.trial,
            box=t.box,
        )
        self.checkpoints = PeerCheckpoints(
            state,
            self.keeper,
            swarm_id=self.swarm_id,
            snapshots=self.snapshots,
            sheet=k.sheet,
            emit=k.emit,
            remember=self.remember_peers,
            stopping=k.stop.is_set,
        )
        found = self.checkpoints.restore()
        if found is None:
            return False
        p = k.progress
        logger.info(
            "resumed from %s: round %d, step %d, global step %d%s",
            found.path.name,
            self.diloco.round,
            p.steps,
            p.global_step,
            "" if found.verified else " (an adopted state, on probation)",
        )
        k.emit(
            "resumed",
            round=self.diloco.round,
            step=p.steps,
            global_step=p.global_step,
            checkpoint=str(found.path),
            verified=found.verified,
        )
        return True

    def _start_network(
        self, stack: contextlib.ExitStack, network: SwarmNetwork, spec: RunSpec
    ) -> None:
        """Start networking, with the collaborators that need it (the network reads this
        peer's progress as soon as it runs)."""
        self._collaborators(network, spec)
        network.catchup.evidence = self.kept.evidence
        network.snapshot = lambda: self.snapshots.current
        network.previous_snapshot = lambda: self.snapshots.previous
        network.progress = self.progress_value
        network.status = self.status_value
        network.on_dashboard = lambda url: self.kept.emit("dashboard", url=url)
        self.loop.run(network.__aenter__(), timeout=60.0)
        stack.callback(self._leave_network)
        if warning := clock_warning(network):
            self.kept.sheet.last_error = warning  # shown until something else goes wrong

    def _collaborators(self, network: SwarmNetwork, spec: RunSpec) -> None:
        """The pacer, the round driver, the follower and the step hook, around the parts
        they share."""
        t, k = self.trainee, self.kept
        parts = self.parts = PeerParts(
            config=self.config,
            spec=spec,
            peer_id=self.peer_id,
            loop=self.loop,
            network=network,
            diloco=self.diloco,
            params=self.params,
            snapshots=self.snapshots,
            progress=k.progress,
            evidence=k.evidence,
            trial=k.trial,
            keeper=self.keeper,
            sheet=k.sheet,
            box=t.box,
            emit=k.emit,
            ranges=t.ranges,
        )
        self.pacer = Pacer(
            network=network,
            wake=parts.wake,
            config=self.config,
            peer_id=self.peer_id,
            h=spec.steps_per_round,
            progress=k.progress,
            evidence=k.evidence,
            unbacked=k.trial.unbacked,
            now=parts.now,
        )
        self.rounds = RoundDriver(parts, self.pacer, evaluate=t.evaluate, lr=t.schedule.lr)
        self.follower = Follower(
            parts,
            peak_lr=lambda rounds: t.schedule.peak(int(rounds * spec.steps_per_round)),
            reset_optimizer=self.reset_optimizer,
            checkpoint=self._urgent_checkpoint,
        )
        self.hook = StepHook(
            parts,
            pacer=self.pacer,
            rounds=self.rounds,
            follower=self.follower,
            checkpoints=self.checkpoints,
            stop=k.stop,
            lr=t.schedule.lr,
            reset_optimizer=self.reset_optimizer,
        )

    def _ready(self) -> None:
        """Say that this peer trains: its event and its log line."""
        assert self.network is not None
        p = self.kept.progress
        self.kept.emit(
            "ready",
            swarm_id=self.swarm_id,
            peer_id=self.peer_id,
            endpoint=self.network.endpoint,
            round=self.diloco.round,
            global_step=p.global_step,
            params=self.signature.numel,
            device=str(self.params.device),
        )
        log_ready(self.spec, self.signature, swarm_id=self.swarm_id, peer_id=self.peer_id,
                  round=self.diloco.round, global_step=p.global_step)  # fmt: skip

    def remember_peers(self) -> None:
        """Keep the peers this one knows now for its next start (``peers.json``)."""
        if self.network is None:
            return
        try:
            peers = self.loop.run(self.network.known_peers(REMEMBER), timeout=5.0)
        except (TimeoutError, SwarmlocoError) as exc:
            logger.debug("could not list the peers this one knows: %s", exc)
            return
        self.session.remember(peers)

    def _leave_network(self) -> None:
        assert self.network is not None
        self.remember_peers()
        with contextlib.suppress(Exception):
            self.loop.run(self.network.__aexit__(None, None, None), timeout=30.0)

    def leave(self, stack: contextlib.ExitStack, *, failed: bool, interrupted: bool) -> None:
        """Leave the swarm: the optimizer unhooked, the step hook's leaving (the round in
        flight, the last checkpoint, lingering; see :meth:`StepHook.leave`), everything
        entered closed, and the ``stopped`` event."""
        k = self.kept
        try:
            if self.optimizer_hook is not None:
                self.optimizer_hook.remove()
                self.optimizer_hook = None
            self.hook.leave(failed=failed, interrupted=interrupted)
        finally:
            wall = time.monotonic() - self.train_started if self.train_started else 0.0
            stack.close()
            # What it trained on that no applied round averaged: its checkpoint keeps it,
            # the swarm's state does not.
            unaveraged = self.hook.unaveraged_tokens()
            if unaveraged and not failed:
                logger.info(
                    "leaves with %s tokens trained since its last applied round: its "
                    "checkpoint keeps them (started again, it trains on from them), the "
                    "swarm's state does not",
                    f"{unaveraged:,}",
                )
            k.emit(
                "stopped",
                round=self.diloco.round,
                step=k.progress.steps,
                global_step=k.progress.global_step,
                reason=k.stop.reason,
                unaveraged_tokens=unaveraged,
                # Time in inner steps over time since training started: what rounds cost.
                train_seconds=round(k.progress.train_seconds, 3),
                wall_seconds=round(wall, 3),
            )

    # -- while it trains ------------------------------------------------------------------------

    def count_online(self, n: int, deadline: float) -> tuple[int, str]:
        """Count the peers online (this one included: a peer whose progress record is
        fresh) on records read from now on, until ``n`` are or ``deadline`` (monotonic)
        passes or the peer is asked to stop; returns the count and what went wrong ("")."""
        assert self.network is not None
        network, stop = self.network, self.kept.stop
        while True:
            # Count on records read from now on: a peer that left a moment ago is seen gone.
            reads = network.reads
            self.parts.wake()
            network.wait_for_reads(reads + 1, PEERS_POLL_S)
            if stop.is_set():
                return 0, "stopped"
            found = 1 + len({r.peer for r in self.pacer.fresh_reports(self.diloco.round)})
            if found >= n:
                return found, ""
            if time.monotonic() > deadline:
                return found, f"{found} of {n} peers online"

    def reset_optimizer(self) -> None:
        """Clear the inner optimizer's moments (every rank's): they came from a state
        this peer no longer trains from."""
        if self.trainee.box is not None:
            self.trainee.box.tell(Op.RESET)
        self.trainee.optimizer.state.clear()

    def _urgent_checkpoint(self) -> None:
        """What was downloaded or rolled back to is not lost to a crash."""
        if self.config.checkpoint_every:
            self.checkpoints.save(urgent=True)

    def summary(self, *, entered: bool) -> Summary:
        """What this peer did (``entered``: whether it got that far)."""
        p, k = self.kept.progress, self.kept
        return Summary(
            swarm_id=self.swarm_id,
            peer_id=self.peer_id,
            round=self.diloco.round if entered else 0,
            steps=p.steps,
            global_step=p.global_step,
            rounds_applied=self.rounds.applied if entered else 0,
            rounds_aborted=self.rounds.aborted if entered else 0,
            downloads=self.follower.downloads if entered else 0,
            last_eval_loss=self.rounds.last_eval if entered else None,
            stopped_because=k.stop.reason,
        )

    # -- what the network reads -----------------------------------------------------------------

    def progress_value(self) -> dict[str, Any]:
        # The round this peer's new tokens count towards: while round r is in flight,
        # r + 1 (its tokens since r started are the next round's).
        p = self.kept.progress
        return {
            "round": self.diloco.round + 1 + self.rounds.started,
            "tokens": p.tokens_since_round,
            "tokens_per_s": p.rate.value,
            "step_tokens": max(1, p.tokens_since_round // p.steps_since_round)
            if p.steps_since_round
            else self.config.tokens_per_step,
            "at": self.parts.now(),
        }

    def status_value(self) -> dict[str, Any]:
        p = self.kept.progress
        return self.kept.sheet.value(
            Counters(
                round=self.diloco.round,
                step=p.steps,
                tokens=p.steps * self.config.tokens_per_step,
                tokens_per_s=p.rate.value,
                rounds_applied=self.rounds.applied,
                rounds_aborted=self.rounds.aborted,
                downloads=self.follower.downloads,
                loss=p.loss,
                eval_loss=self.rounds.last_eval,
                at=self.parts.now(),
            )
        )
