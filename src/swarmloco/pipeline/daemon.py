"""A pipelined run of a built-in task, as ``swarmloco create --stages S`` makes it and
``swarmloco join`` serves it (``docs/DESIGN.md`` section 10).

:func:`build_pipeline_manifest` is the task's manifest (its model, data and every
hyperparameter) declaring the cut of its model into stages. :func:`train_stage` runs one
peer of it: the stage it is told, else the one whose checkpoints its data directory holds
(:func:`served_before`: a restarted peer takes back its stage), else the one the pipeline
needs most (:func:`~swarmloco.pipeline.rebalance.choose_stage`, from the ``stage-load``
records); at stage 0 it draws micro-batches from the task's data and drives them through
the pipeline, elsewhere it serves, until stopped or until its :class:`Rebalancer` says
that the stage limiting the pipeline needs it more: then it lets its micro-batches in
flight finish, leaves (a checkpoint, its records gone) and serves that stage, starting
from the state of its replicas (the stage's swarm downloads it as for any newcomer).
A peer builds its stage alone (never the whole model), every peer the same weights: each
parameter is drawn by a generator seeded by the run's seed and its name.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import gc
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from swarmloco.core.manifest import SwarmManifest
from swarmloco.dataset.leases import LeasedData
from swarmloco.errors import Stopped, SwarmlocoError
from swarmloco.net.admission import reader_gate
from swarmloco.net.identity import Identity
from swarmloco.net.node import NetNode, NodeConfig
from swarmloco.net.server import Service
from swarmloco.pipeline.driver import DriverConfig, PipelineError, Trace, Withdrawn
from swarmloco.pipeline.load import StageLoad, Vouching, read_counted
from swarmloco.pipeline.manifest import (
    declare_pipeline,
    pipeline_of,
    stage_manifest,
    stage_signatures,
)
from swarmloco.pipeline.peer import StagePeer, StageWork
from swarmloco.pipeline.rebalance import RebalanceConfig, choose_move, choose_stage
from swarmloco.pipeline.stages import build_stage
from swarmloco.pipeline.wire import Boundary
from swarmloco.runtime.config import PeerConfig
from swarmloco.runtime.daemon import (
    DaemonConfig,
    dataset_sequences,
    leased_data,
    pinned_dataset,
    resolve_device,
)
from swarmloco.runtime.loop_thread import LoopThread
from swarmloco.runtime.session import handle_signals
from swarmloco.runtime.start import describe_device
from swarmloco.train.data import BatchStream
from swarmloco.train.inner import Precision, inner_adamw, resolve_precision
from swarmloco.train.llama import Llama
from swarmloco.train.model import GPT
from swarmloco.train.spec import DataSpec
from swarmloco.train.tasks import (
    RunConfig,
    Task,
    build_manifest,
    run_from_manifest,
)

logger = logging.getLogger(__name__)

NO_REPLICA_PAUSE_S = 2.0  # a stage with no peer yet: how long a driver waits before trying again
DRIVEN_EVERY_S = 2.0  # how often a driver says how many micro-batches it drove (a `driven` event)
NO_DATA_WAIT_S = 1.0  # stage 0 with nothing to read now: how long it waits before looking again


def task_stage(
    task: Task,
    model: Mapping[str, Any],
    run: RunConfig,
    stages: int,
    stage: int,
    device: torch.device | str = "cpu",
) -> nn.Module:
    """Stage ``stage`` of the task's model (the built-in GPT or Llama) cut into ``stages``,
    built alone on ``device`` (:func:`~swarmloco.pipeline.stages.build_stage`: every peer
    builds the same, and none builds the whole model)."""
    with torch.device("meta"):  # the model's shape only: no memory, no draw
        skeleton = task.build_model(model)
    if not isinstance(skeleton, GPT | Llama):
        raise SwarmlocoError(
            f"task {task.name} cannot be cut into stages (the built-in GPT and Llama can)"
        )
    if skeleton.config.n_layer < stages:
        raise SwarmlocoError(
            f"the model has {skeleton.config.n_layer} layer(s): it cannot be cut into {stages} "
            "stages (each needs one at least)"
        )
    return build_stage(skeleton.config, stages, stage, seed=run.spec.seed, device=device)


def build_pipeline_manifest(
    task: str,
    preset: str,
    stages: int,
    *,
    creator: str,
    encoding: str = "int8",
    **options: Any,
) -> SwarmManifest:
    """:func:`~swarmloco.train.tasks.build_manifest`'s manifest (``options`` are its)
    declaring its model cut into ``stages`` stages (each built in turn, one at a time)."""
    manifest = build_manifest(task, preset, creator=creator, **options)
    t, model, _, run = run_from_manifest(manifest)
    signatures = [
        stage_signatures(run.spec, [task_stage(t, model, run, stages, k)], t.layer_unit)[0]
        for k in range(stages)
    ]
    return declare_pipeline(manifest, run.spec, signatures, encoding)


def served_before(manifest: SwarmManifest, stages: int, directory: Path) -> int | None:
    """The stage whose checkpoints ``directory`` holds (the newest, if several): a peer
    restarted without ``--stage`` takes back the stage it served, its work included."""
    newest: tuple[float, int] | None = None
    for k in range(stages):
        folder = directory / "swarms" / stage_manifest(manifest, k).swarm_id / "checkpoints"
        times = [p.stat().st_mtime for p in folder.glob("ckpt-*")] if folder.is_dir() else []
        if times and (newest is None or max(times) > newest[0]):
            newest = (max(times), k)
    return None if newest is None else newest[1]


def _read_loads(
    manifest: SwarmManifest, peers: Sequence[str], identity: Identity
) -> list[StageLoad]:
    """The run's counted ``stage-load`` records, as read through ``peers`` (none: a peer
    that starts a network of its own, as a creator may, finds nobody)."""
    if not peers:
        return []

    async def read() -> list[StageLoad]:
        config = NodeConfig(server=None, peers=tuple(peers))
        async with NetNode(identity=identity, config=config) as node:
            gate = reader_gate(manifest)  # (records of keys without the run's credential: none)
            if gate is not None:
                node.dht.admit(gate)
            vouching = Vouching(node.who_serves, identity.peer_id_hex)
            return await read_counted(node.dht, manifest.swarm_id, vouching)

    with LoopThread(name="swarmloco-choose-stage") as loop:
        return loop.run(read(), timeout=60.0)


@dataclasses.dataclass(frozen=True)
class StageSummary:
    """What a stage's peer did (``stage``: the one it served last)."""

    stage: int
    round: int
    steps: int
    micro_batches: int
    stopped_because: str
    moves: int = 0
    dropped: int = 0
    """Inputs its replicas held for a backward that never came, dropped at their deadline."""
    orphaned: int = 0
    """Micro-batches of drivers whose sessions ended (they died, or left) that its replicas
    dropped or did not take then."""


def train_stage(
    manifest: SwarmManifest,
    config: PeerConfig,
    *,
    identity: Identity,
    stage: int | None = None,
    device: str = "auto",
    on_event: Callable[[dict[str, Any]], None] | None = None,
    rebalance: RebalanceConfig | None = None,
    slowdown_s: float = 0.0,
    precision: Precision | None = None,
    in_flight: int | None = None,
    audit_share: float | None = None,
    reading: DaemonConfig | None = None,
    leave_idle_s: float = 0.0,
) -> StageSummary:
    """Serve ``stage`` of the pipelined run ``manifest`` (None: :func:`served_before`, else
    :func:`~swarmloco.pipeline.rebalance.choose_stage`) on ``device`` (``auto``: a GPU if
    torch sees one) until stopped (a signal, max rounds, the run's end), moving to the
    stage that limits the pipeline when :class:`Rebalancer` says so. ``slowdown_s``: each
    forward of this peer's stage waits that long more (a slower device, for tests and
    benchmarks: the wait uses no CPU). ``precision``: this peer's choice over the run's
    (auto: bf16 autocast on a GPU that has it, fp32 elsewhere; fp16 is not offered to a
    stage, which would need a loss scale across the pipeline). ``in_flight``: the
    micro-batches a stage-0 peer keeps in the pipeline at once (None: the run's stage
    count). ``audit_share``: the share of each later stage's answers a stage-0 peer has
    computed again by another replica and compared (None: ``DriverConfig``'s).
    ``reading``: on a pinned dataset, how stage 0 reads it (its local copies, epochs,
    leases, read log: the fields of ``DaemonConfig`` for those; None: the defaults).
    ``leave_idle_s``: a peer of a later stage leaves once no micro-batch came in or went
    back through it for that long with no driver's session open there
    (``StageReplica.idle_s``), once it averaged what it trained since its last round
    (:class:`_Leaving`; 0: it serves until stopped); stage 0 drives its own."""
    if slowdown_s < 0:
        raise ValueError(f"slowdown_s must be >= 0, got {slowdown_s}")
    if not leave_idle_s >= 0:
        raise ValueError(f"leave_idle_s must be >= 0, got {leave_idle_s}")
    if in_flight is not None and in_flight < 1:
        raise ValueError(f"in_flight must be >= 1, got {in_flight}")
    where = resolve_device(device)
    pipeline = pipeline_of(manifest)
    if pipeline is None:
        raise SwarmlocoError(f"swarm {manifest.swarm_id} is not a pipelined run")
    if stage is None:
        stage = served_before(manifest, pipeline.stages, config.directory)
        if stage is not None:
            logger.info(
                "serving stage %d of %d again (this data directory holds its checkpoints)",
                stage,
                pipeline.stages,
            )
    if stage is None:
        loads = _read_loads(manifest, config.node.peers, identity)
        stage = choose_stage(loads, pipeline.stages)
        logger.info(
            "serving stage %d of %d (the one the pipeline needs most)", stage, pipeline.stages
        )
    if not 0 <= stage < pipeline.stages:
        raise SwarmlocoError(f"swarm {manifest.swarm_id} has stages 0 to {pipeline.stages - 1}")
    if config.max_rounds is not None and stage > 0:
        logger.warning(
            "max rounds %d counts stage %d's rounds, which run ahead of stage 0's (the run's) "
            "where fewer peers serve this stage than stage 0 and behind where more do; the "
            "run ends at stage 0, and a later stage's peer leaves once its drivers are gone",
            config.max_rounds,
            stage,
        )
    in_flight = in_flight or pipeline.stages
    driver = DriverConfig() if audit_share is None else DriverConfig(audit_share=audit_share)
    task, model, data, run = run_from_manifest(manifest)
    # On a pinned dataset stage 0's peers are its readers: they join with the means to
    # read it and leave at --max-epochs; nobody moves in or out (DESIGN section 10).
    rebalancer = Rebalancer(
        rebalance or RebalanceConfig(), pipeline.stages, identity.peer_id_hex, on_event,
        fixed=frozenset({0}) if data.source == "dataset" else frozenset(),
    )  # fmt: skip
    asked: list[str] = []  # why a signal asked this peer to stop (it may come mid-move)
    current: list[StagePeer] = []  # the stage peer such a signal stops

    def on_signal(why: str) -> None:
        asked.append(why)
        for p in current:
            _stop(p, why)

    driven = moves = dropped = orphaned = 0
    with contextlib.ExitStack() as signals:
        if config.handle_signals:
            handle_signals(signals, on_signal)
        while True:
            module = task_stage(task, model, run, pipeline.stages, stage, where)
            if slowdown_s > 0:
                module.register_forward_pre_hook(_slowed(slowdown_s))
            work = _work(module, model, run, precision or run.inner.precision, pipeline.stages)
            logger.info(
                "stage %d computes on %s in %s", stage, describe_device(where),
                "bf16 autocast" if work.autocast else "fp32",
            )  # fmt: skip
            reader_stack = contextlib.ExitStack()  # stage 0's reader of a pinned dataset
            reader, services = None, []
            try:
                if stage == 0 and data.source == "dataset":
                    reader, server = _stage_reader(
                        reader_stack, manifest, data, reading or DaemonConfig(peer=config),
                        model, run, work,
                    )  # fmt: skip
                    services.append(server)
                peer = StagePeer(
                    manifest,
                    stage,
                    work,
                    config=config,
                    identity=identity,
                    on_event=on_event,
                    driver=driver,
                    reader=reader,
                    services=services,
                )
            except BaseException:
                reader_stack.close()
                raise
            if reader is not None:
                reader.stop_peer = functools.partial(_stop, peer)
            move: int | None = None
            current[:] = [peer]
            with reader_stack, peer:
                if asked:
                    _stop(peer, asked[0])
                rebalancer.arrived()
                if stage == 0:
                    n, move = _drive(peer, task, model, data, run, work, rebalancer, in_flight)
                    driven += n
                else:
                    leaving = _Leaving(peer, leave_idle_s)
                    while not peer.stopped.wait(0.5) and not _asked_to_stop(peer):
                        if leaving.done():
                            break
                        move = rebalancer.check(peer, driven)
                        if move is not None:
                            break
                if move is not None:
                    left = peer.replica.drain(peer.replica.config.inflight_s)
                    logger.info(
                        "moving from stage %d to stage %d (%d micro-batch(es) left in flight)",
                        stage,
                        move,
                        left,
                    )
            assert peer.peer is not None
            k = peer.peer.kept
            dropped += peer.replica.dropped
            orphaned += peer.replica.orphaned
            if move is None or asked:
                return StageSummary(
                    stage, peer.peer.diloco.round, k.progress.steps, driven, k.stop.reason, moves,
                    dropped, orphaned,
                )  # fmt: skip
            if on_event is not None:
                on_event({"event": "moved", "time": time.time(), "from": stage, "to": move})
            stage, moves = move, moves + 1
            # This stage's weights, AdamW and state let go before the next is built: a card
            # (or host) that holds one stage need not hold two.
            current.clear()
            del peer, work, module, k
            gc.collect()  # the stage peer's parts refer to each other
            if where.type == "cuda":
                torch.cuda.empty_cache()


BUSY_BEYOND_SAID = 2.0
BUSY_FLOOR = 0.1
"""A mover stays when it computed more than ``BUSY_BEYOND_SAID`` times the share of its
time the records leave its stage, plus this: its own work, first-hand, against claims."""


class Rebalancer:
    """When this peer asks whether to move, and what it read. Checks are aligned on the
    swarm's clock: one in each ``every_s`` window, in its first half (a mover's record,
    announced at once, has the second half to reach every peer before anyone judges on the
    next window's choice), none within ``every_s`` of this peer's first work at its stage
    nor within ``hold_s`` of a move. Each check's view is a ``stages`` event (every stage's
    throughput and replicas, the verdict and its reason)."""

    def __init__(
        self,
        config: RebalanceConfig,
        stages: int,
        me: str,
        on_event: Callable[[dict[str, Any]], None] | None,
        *,
        clock: Callable[[], float] = time.monotonic,
        fixed: frozenset[int] = frozenset(),
    ) -> None:
        self.config = config
        self.stages = stages
        self.fixed = fixed
        """Stages nobody moves into or out of (``choose_move``)."""
        self.me = me
        self.on_event = on_event
        self.clock = clock
        self._arrivals = 0
        self._not_before: float | None = None  # None: this peer has not worked at its stage yet
        self._moved_at: float | None = None
        self._epoch = -1
        self._busy_at: tuple[float, float] | None = None  # (clock, busy seconds) then

    def arrived(self) -> None:
        """This peer (re)entered a stage: the first check comes an interval after its
        first work there (the pipeline must have run for its rates to say anything)."""
        self._arrivals += 1
        if self._arrivals > 1:
            self._moved_at = self.clock()
        self._not_before = None

    def _busy_share(self, peer: StagePeer) -> float | None:
        """The share of the time since its last check that this peer computed (None
        before a first interval)."""
        now, busy = self.clock(), peer.busy_seconds()
        before, self._busy_at = self._busy_at, (now, busy)
        if before is None or now <= before[0]:
            return None
        return (busy - before[1]) / (now - before[0])

    def check(self, peer: StagePeer, driven: int) -> int | None:
        """The stage to move to now, if any (None until a check is due). A move is
        announced (:meth:`StagePeer.announce_move`) before it is returned."""
        every = self.config.every_s
        if every <= 0 or not self._arrivals:
            return None
        if self._not_before is None:
            if not peer.working():
                return None
            self._not_before = self.clock() + every
            self._busy_at = (self.clock(), peer.busy_seconds())
        if self.clock() < self._not_before:
            return None
        epoch, phase = divmod(peer.swarm_clock(), every)
        if epoch <= self._epoch or phase >= every / 2:
            return None
        self._epoch = int(epoch)
        # A peer that drives knows which replicas serve it nothing (they failed it, or
        # answered wrong): their records do not count, whatever they claim, so a stage
        # only such keys claim is empty to it, and draws a replica.
        unserving = peer.unserving()
        loads = [x for x in peer.read_loads() if x.stage == 0 or x.endpoint not in unserving]
        move = choose_move(
            loads, self.stages, me=self.me, epoch=int(epoch), gap=self.config.gap,
            fixed=self.fixed,
        )  # fmt: skip
        busy = self._busy_share(peer)
        since = None if self._moved_at is None else self.clock() - self._moved_at
        held = since is not None and since < self.config.hold_s and move.to is not None
        to = None if held else move.to
        reason = f"it moved {since:.0f} s ago ({move.reason})" if held else move.reason
        if to is not None and busy is not None:
            # The records say the stage this peer leaves is over-served: then the pipeline
            # can keep it busy at most the target's throughput over its stage's. Busier
            # than that by far, its own work says the records overstate its stage (keys
            # that claim to serve it and do not, say).
            said = move.throughput[to] / max(move.throughput[peer.stage], 1e-9)
            if busy > BUSY_BEYOND_SAID * said + BUSY_FLOOR:
                reason = (
                    f"it stays: it computed {busy:.0%} of the time since its last check, "
                    f"where the records leave its stage work for {said:.0%} ({move.reason})"
                )
                to = None
        if self.on_event is not None:
            self.on_event(
                {
                    "event": "stages",
                    "time": time.time(),
                    "stage": peer.stage,
                    "throughput": list(move.throughput),
                    "replicas": list(move.replicas),
                    "unmeasured": list(move.unmeasured),
                    "move": to,
                    "reason": reason,
                    "driven": driven,
                }
            )
        if to is not None:
            logger.info("rebalancing: %s", move.reason)
            peer.announce_move(to)
        return to


def _slowed(seconds: float) -> Callable[..., None]:
    def wait(module: nn.Module, args: Any) -> None:
        time.sleep(seconds)

    return wait


def _work(
    module: nn.Module,
    model: Mapping[str, Any],
    run: RunConfig,
    precision: Precision,
    stages: int,
) -> StageWork:
    inner = run.inner
    device = next(module.parameters()).device
    autocast = resolve_precision(precision, device)
    if autocast == torch.float16:
        if precision == "fp16":
            raise SwarmlocoError(
                "a pipeline stage computes in fp32 or bf16 (fp16 would need a loss scale "
                "across the stages): use --precision bf16 or fp32"
            )
        autocast = None  # auto on a GPU without bf16: fp32
    sequences = inner.batch_size * inner.grad_accum
    # A step holds at least a micro-batch a stage where its batch allows (4 to 8 sequences
    # each): the micro-batches of one step are all a stage admits at once, and the stages
    # compute side by side only with that many in flight. Below 4 sequences a call's own
    # cost (packing, the hop) outweighs the overlap.
    micro = max(1, min(8, sequences, max(4, -(-sequences // stages))))
    seq_len, width, vocab = int(model["seq_len"]), int(model["n_embd"]), int(model["vocab_size"])
    return StageWork(
        module=module,
        optimizer=inner_adamw(module, inner),  # the data-parallel inner loop's
        activations=Boundary(width=width, max_batch=micro, max_tokens=seq_len),
        ids=Boundary(width=0, max_batch=micro, max_tokens=seq_len, vocab=vocab),
        step_samples=sequences,
        tokens_per_sequence=seq_len,
        lr_at=inner.lr_at,
        grad_clip=inner.grad_clip,
        autocast=autocast,
    )


def _stage_reader(
    stack: contextlib.ExitStack,
    manifest: SwarmManifest,
    data: DataSpec,
    reading: DaemonConfig,
    model: Mapping[str, Any],
    run: RunConfig,
    work: StageWork,
) -> tuple[LeasedData, Service]:
    """Stage 0's reader of the run's pinned dataset (its shards fetched as it leases them,
    from its copies, stage 0's peers, the mirrors), and the service of the files it holds
    to the other stage-0 peers (``docs/DESIGN.md`` section 10, "A pinned dataset")."""
    vocab = int(model["vocab_size"])
    swarm_id = stage_manifest(manifest, 0).swarm_id  # stage 0's peers serve the files
    _, server, lazy = pinned_dataset(stack, swarm_id, data, reading, vocab)
    sequences = dataset_sequences(lazy, work.tokens_per_sequence, data.val_fraction)
    reader = leased_data(sequences, vocab, reading, run, work.ids.max_batch)
    return reader, server.service()


LEAVE_IDLE_S = 300.0
"""``join --leave-idle``'s default: a later stage's peer leaves once no micro-batch came
through it and no driver held a session with it for this long (the run ended at stage 0,
or every driver is gone; a stage with no peer draws one over by rebalancing first)."""

LEAVE_FLUSH_S = 120.0
"""How long a later stage's peer leaving by itself (``--leave-idle``) gives the round that
averages its last steps before it leaves without."""


class _Leaving:
    """(A later stage's peer with ``--leave-idle S``.) Once no micro-batch came through it
    for S seconds with no driver's session open there, it averages what it trained since
    its last round at once (:attr:`StagePeer.flushing`), as stage 0's readers do once
    their data is read, then leaves; it leaves without after :data:`LEAVE_FLUSH_S`. A
    micro-batch coming meanwhile calls it off."""

    def __init__(self, peer: StagePeer, after_s: float) -> None:
        self.peer = peer
        self.after_s = after_s
        self._since: float | None = None  # when the flush began

    def done(self) -> bool:
        """Whether the peer was stopped to leave (called every half second)."""
        peer = self.peer
        if not self.after_s or peer.peer is None:
            return False
        if peer.replica.idle_s() < self.after_s:
            if self._since is not None:
                logger.info("stage %d: micro-batches came again; it stays", peer.stage)
                peer.flushing.clear()
                self._since = None
            return False
        hook = peer.peer.hook
        if self._since is None:
            self._since = time.monotonic()
            if not hook.flushed:
                logger.info(
                    "stage %d: no micro-batch and no driver for %g s: averaging its last "
                    "steps (%d tokens) before it leaves",
                    peer.stage, self.after_s, hook.unaveraged_tokens(),
                )  # fmt: skip
            peer.flushing.set()
        why = f"no micro-batch and no driver for {self.after_s:g} s"
        if not hook.flushed:
            if time.monotonic() - self._since < LEAVE_FLUSH_S:
                return False
            logger.warning(
                "stage %d: its last steps (%d tokens) were not averaged within %.0f s; it "
                "leaves without (its checkpoint keeps them)",
                peer.stage, hook.unaveraged_tokens(), LEAVE_FLUSH_S,
            )  # fmt: skip
        _stop(peer, f"{why} (--leave-idle)")
        return True


def _stop(peer: StagePeer, why: str) -> None:
    if peer.peer is not None:
        peer.peer.kept.stop.stop(why)


def _asked_to_stop(peer: StagePeer) -> bool:
    return peer.peer is not None and peer.peer.kept.stop.is_set()


def _drive(
    peer: StagePeer,
    task: Task,
    model: Mapping[str, Any],
    data_spec: DataSpec,
    run: RunConfig,
    work: StageWork,
    rebalancer: Rebalancer,
    in_flight: int,
) -> tuple[int, int | None]:
    """Stage 0: micro-batches of the task's data (or of its pinned dataset's leases:
    ``peer.feed``) through the pipeline, up to ``in_flight`` at once, until stopped or the
    rebalancer moves this peer; returns how many went through, and where it moves (the
    ones in flight are collected first)."""
    feed = peer.feed
    stream = None
    if feed is None:
        data = task.load_data(model, data_spec)
        stream = BatchStream(
            data.train,
            seq_len=work.tokens_per_sequence,
            batch_size=work.ids.max_batch,
            vocab_size=data.vocab_size,
            seed=run.spec.seed,
            worker=int(rebalancer.me[:8], 16),
        )
    driven = 0
    said_at, loss = time.monotonic(), float("nan")
    pending: dict[concurrent.futures.Future[Trace], bytes | None] = {}
    move: int | None = None
    stopped = pause = False
    while True:
        # Collect what came back; a failed micro-batch pauses the driving a while.
        done = {f: name for f, name in pending.items() if f.done()}
        for future, name in done.items():
            del pending[future]
            try:
                trace = future.result()
            except (Stopped, PipelineError) as exc:
                if feed is not None and name is not None:
                    feed.failed(name)  # its sequences are read again
                if isinstance(exc, Stopped):
                    stopped = True
                    continue
                if isinstance(exc, Withdrawn):  # nothing trained: the next one goes
                    continue
                if not pause:  # a stage without a peer yet, or all of its gone
                    logger.warning("%s; trying again in %.0f s", exc, NO_REPLICA_PAUSE_S)
                pause = True
                continue
            driven, loss = driven + 1, trace.loss
            if trace.retries:
                peer.emit("hop-retried", retries=trace.retries, path=trace.path)
        if time.monotonic() - said_at >= DRIVEN_EVERY_S:
            audits = dict(peer.driver.audits) if peer.driver is not None else {}
            peer.emit("driven", driven=driven, loss=loss, audits=audits)
            said_at = time.monotonic()
        if move is None and not stopped:
            stopped = _asked_to_stop(peer)
        if move is None and not stopped:
            move = rebalancer.check(peer, driven)
        if stopped or move is not None:
            if not pending:
                return driven, move
        elif pause:
            if not pending:
                pause = False
                if peer.stopped.wait(NO_REPLICA_PAUSE_S):
                    stopped = True
                continue
        elif len(pending) < in_flight:
            name = None
            if feed is None:
                assert stream is not None
                x, y = stream.next_batch()
            else:
                batch = feed.take()
                if batch is None:  # nothing to read now: the stepping thread lands rounds
                    if not pending:
                        feed.reader.changed.wait(NO_DATA_WAIT_S)
                        feed.reader.changed.clear()
                        continue
                    concurrent.futures.wait(pending, timeout=1.0, return_when="FIRST_COMPLETED")
                    continue
                x, y, name = batch
            try:
                pending[peer.submit(x, y, name=name)] = name
            except Stopped:
                if feed is not None and name is not None:
                    feed.failed(name)
                stopped = True
            continue
        concurrent.futures.wait(pending, timeout=1.0, return_when="FIRST_COMPLETED")
