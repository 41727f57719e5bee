"""The peer daemon: one training peer of a swarm, composed from the layers below it.

A :class:`Peer` trains in the calling thread and does all its networking on a
:class:`~swarmloco.runtime.loop_thread.LoopThread`:

1. **Start.** Load (or create) the peer's key, build the model of the manifest, compile
   the codec, restore the newest valid checkpoint of this swarm from ``data_dir`` if there
   is one, start the server (DHT, averaging, state transfer on one port), join the
   network, (re)publish the manifest and announce the peer.
2. **Catch up.** Read the swarm's ``progress`` records: if other peers already work on a
   later round than this peer's state, download the state of the round before it from
   the holders of the digest most peers published for it (falling back from donor to
   donor, and from digest to digest), take it as the global and local parameters, and
   keep the local optimizer and data position.
3. **Train.** Inner AdamW steps. A round is due when the peers working on it have
   together trained H steps' worth of tokens each (:meth:`Peer._pace`). Round r averages
   fragment ``(r - 1) % F`` of ``delta = theta_g - theta`` (weighted by the tokens the
   fragment trained on since its last sync) with the peers ready for the same round; the
   exchange runs while the peer trains ``tau`` more steps, then the outer Nesterov step is
   applied to that fragment of ``theta_g`` on CPU, the fragment's local copy becomes
   ``lerp(theta_g, theta, alpha)``, the digest of the new global state is published and a
   checkpoint written (hashing and writing run on threads of their own: training waits only
   for copies of the state). F = 1, tau = 0, alpha = 0 is plain DiLoCo. A round that fails
   changes nothing: the fragment's delta keeps growing and the next attempt carries it.
   Before each round the peer checks the digests of its own last round and downloads the
   state that ranks first if its own does not.
4. **Stop.** On :meth:`Peer.stop` (SIGINT/SIGTERM in the CLI) or after ``max_rounds``:
   the exchange in flight lands, a final checkpoint, then the network is left and the loop
   thread stopped.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import copy
import dataclasses
import json
import logging
import math
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from swarmloco import __version__
from swarmloco.core.adoption import Evidence
from swarmloco.core.codec import Backend, ErrorFeedback, warm_up
from swarmloco.core.config import require, require_int, require_positive
from swarmloco.core.flat import FlatLayout
from swarmloco.core.fragments import assign_fragments
from swarmloco.core.manifest import SwarmManifest
from swarmloco.core.outer import OuterOptimizer
from swarmloco.core.pacing import PacingConfig, ProgressReport, Verdict, estimate
from swarmloco.core.state import MOMENTUM, THETA_G, StateSchema, StateSnapshot
from swarmloco.errors import RoundAborted, SwarmlocoError
from swarmloco.net.averaging import (
    Averager,
    AveragingConfig,
    BandwidthConfig,
    BandwidthLimiter,
    Matchmaker,
    MatchmakingConfig,
    averaging_service,
)
from swarmloco.net.deadline import Deadline
from swarmloco.net.identity import Identity
from swarmloco.net.node import NetNode, NodeConfig
from swarmloco.net.records import digest_key, progress_key, progress_report, status_key
from swarmloco.net.state import DownloadedState, StateDonor, state_service
from swarmloco.net.swarm import announce_peer, publish_manifest
from swarmloco.runtime.catchup import CatchUp, CatchUpConfig
from swarmloco.runtime.checkpoint import BackgroundWriter, CheckpointStore
from swarmloco.runtime.loop_thread import LoopThread
from swarmloco.train.data import BatchStream, eval_windows
from swarmloco.train.inner import CompileMode, InnerLoop, Precision, evaluate
from swarmloco.train.tasks import run_from_manifest

logger = logging.getLogger(__name__)

EventSink = Callable[[dict[str, Any]], None]
DIGEST_TTL_S = 3600.0
PROGRESS_TTL_S = 120.0
_FRESH_REPORTS = 5  # a report older than this many publishing intervals: the peer left
_FRESH_MIN_S = 10.0
_MAX_WAIT_ROUNDS = 4
_CATCH_UP_RETRY_S = 2.0
_UNBACKED_S = 10.0  # how long a claim of a later round without digests is ignored
_ROUND_FAILURES = (RoundAborted, SwarmlocoError, TimeoutError, concurrent.futures.CancelledError)
_MAX_DISCARDS = 3  # NaN/Inf restarts without a round in between before the peer gives up
_DISTRUSTED_S = 600.0  # how long the holders of a refused state are not asked again


@dataclasses.dataclass(frozen=True, kw_only=True)
class PeerConfig:
    """How one peer runs (its own choices: nothing here enters the manifest)."""

    data_dir: Path
    """The peer's key, and per swarm its manifest copy and checkpoints."""
    node: NodeConfig = dataclasses.field(default_factory=NodeConfig)
    """Where to serve and which peers to join through."""
    device: str = "auto"
    """cpu, cuda, cuda:N, or auto (cuda when available)."""
    max_rounds: int | None = None
    """Leave after the swarm's state reached this round (None: until stopped)."""
    round_timeout_s: float = 120.0
    """Matchmaking plus all-reduce of one round."""
    matchmaking: MatchmakingConfig = dataclasses.field(default_factory=MatchmakingConfig)
    averaging: AveragingConfig = dataclasses.field(default_factory=AveragingConfig)
    catchup: CatchUpConfig = dataclasses.field(default_factory=CatchUpConfig)
    """Which states to download from whom, on what evidence, and how long it may take."""
    checkpoint_every: int = 1
    """Rounds between checkpoints (0: only when the peer stops)."""
    keep_checkpoints: int = 3
    eval_every: int = 1
    """Evaluate the global model every this many rounds (0: never)."""
    progress_interval_s: float = 5.0
    """How often the peer publishes its progress record."""
    compile: CompileMode | None = None
    """Override the inner loop's torch.compile choice (auto, on, off)."""
    precision: Precision | None = None
    """Override the inner loop's precision (auto, fp32, bf16, fp16)."""
    name: str = ""
    """How the dashboard names this peer (default: the host name)."""
    bandwidth: BandwidthConfig | None = None
    """Cap this peer's upload and download (averaging and state transfer together)."""
    dashboard_port: int | None = None
    """Serve the swarm's dashboard on 127.0.0.1 at this port (0: a free one; None: not)."""
    codec_backend: Backend | None = None
    """Override the codec's backend (auto, compiled, eager); the wire format is the same."""

    def __post_init__(self) -> None:
        if self.max_rounds is not None:
            require_int("max_rounds", self.max_rounds, minimum=1)
        require_positive("round_timeout_s", self.round_timeout_s)
        require_int("checkpoint_every", self.checkpoint_every, minimum=0)
        require_int("keep_checkpoints", self.keep_checkpoints, minimum=1)
        require_int("eval_every", self.eval_every, minimum=0)
        require_positive("progress_interval_s", self.progress_interval_s)
        require(len(self.name) <= 64, f"a peer name has at most 64 characters, got {self.name!r}")
        require(
            self.dashboard_port is None or 0 <= self.dashboard_port < 65536,
            f"dashboard port must be in [0, 65535], got {self.dashboard_port!r}",
        )
        require(
            self.compile in (None, "auto", "on", "off"),
            f"compile must be auto, on or off, got {self.compile!r}",
        )
        require(
            self.precision in (None, "auto", "fp32", "bf16", "fp16"),
            f"precision must be auto, fp32, bf16 or fp16, got {self.precision!r}",
        )
        require(
            self.codec_backend in (None, "auto", "compiled", "eager"),
            f"codec backend must be auto, compiled or eager, got {self.codec_backend!r}",
        )


@dataclasses.dataclass
class PeerSummary:
    """What a peer did, returned by :meth:`Peer.run`."""

    swarm_id: str
    peer_id: str
    round: int
    steps: int
    rounds_applied: int
    rounds_aborted: int
    downloads: int
    last_eval_loss: float | None
    stopped_because: str


_PRECISION_NAMES = {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name} was asked for, but torch sees no CUDA device")
    return device


def _describe(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


def worker_of(peer_id: str) -> int:
    """The data stream of a peer: distinct per peer id, the same after a restart."""
    return int(peer_id[:15], 16)


class Peer:
    """One training peer. Constructing does no I/O; :meth:`run` does everything."""

    def __init__(
        self,
        manifest: SwarmManifest,
        config: PeerConfig,
        *,
        identity: Identity | None = None,
        on_event: EventSink | None = None,
    ) -> None:
        self.manifest = manifest
        self.swarm_id = manifest.swarm_id
        self.config = config
        self.identity = identity
        self.on_event = on_event
        self._stop = threading.Event()
        self._stop_reason = ""
        self._snapshot: StateSnapshot | None = None
        # The snapshot of the last round while the digest thread hashes it, and what then.
        self._hashing: (
            tuple[concurrent.futures.Future[StateSnapshot], Callable[[bytes], None]] | None
        ) = None
        self.state = "starting"
        self.started_at = time.time()
        self.last_error = ""
        self.history: collections.deque[dict[str, Any]] = collections.deque(maxlen=8)

    # -- control ---------------------------------------------------------------------------

    def stop(self, reason: str = "asked to stop") -> None:
        """Ask the peer to finish its current step (or round), checkpoint and leave."""
        if not self._stop.is_set():
            self._stop_reason = reason
            self._stop.set()

    def _emit(self, event: str, **fields: Any) -> None:
        if self.on_event is not None:
            self.on_event({"event": event, "time": time.time(), **fields})

    # -- the whole life of the peer ----------------------------------------------------------

    def run(self) -> PeerSummary:
        cfg = self.config
        self.identity = self.identity or Identity.load_or_create(cfg.data_dir)
        self.peer_id = self.identity.peer_id_hex
        swarm_dir = cfg.data_dir / "swarms" / self.swarm_id
        swarm_dir.mkdir(parents=True, exist_ok=True)
        _write_manifest_copy(swarm_dir / "manifest.json", self.manifest)
        self._build()
        store = CheckpointStore(
            swarm_dir / "checkpoints", swarm_id=self.swarm_id, keep=cfg.keep_checkpoints
        )
        with (
            store,
            BackgroundWriter(store) as writer,
            concurrent.futures.ThreadPoolExecutor(1, "swarmloco-digest") as digester,
            LoopThread(name="swarmloco-peer-loop") as loop,
        ):
            self.store, self.writer, self.digester, self.loop = store, writer, digester, loop
            self._restore()
            self._start_network()
            try:
                self._catch_up()
                self._train()
            finally:
                self._leave()
        return self.summary

    # -- building the training state --------------------------------------------------------

    def _build(self) -> None:
        task, model_config, data_spec, run = run_from_manifest(self.manifest)
        inner = run.inner  # compile and precision are this peer's own choices
        if self.config.compile is not None:
            inner = dataclasses.replace(inner, compile=self.config.compile)
        if self.config.precision is not None:
            inner = dataclasses.replace(inner, precision=self.config.precision)
        run = dataclasses.replace(run, inner=inner)
        if self.config.codec_backend is not None:
            run = dataclasses.replace(
                run, codec=dataclasses.replace(run.codec, backend=self.config.codec_backend)
            )
        self.run_config = run
        self.device = resolve_device(self.config.device)
        seconds = warm_up(run.codec)  # before any round: compiling stalls the event loop
        logger.info("codec (%s) ready in %.1fs", run.codec.backend, seconds)
        torch.manual_seed(run.seed)  # every peer starts from the same initial parameters
        model = task.build_model(model_config)
        self.eval_model = copy.deepcopy(model)
        named = list(model.named_parameters())
        streaming = run.streaming
        self.fragments = streaming.fragments
        fragment_of = assign_fragments([task.layer_unit(n) for n, _ in named], self.fragments)
        self.layout = FlatLayout(
            [(n, tuple(p.shape)) for n, p in named], fragment_of, run.codec.block_size
        )
        self.theta_g = self.layout.gather([p for _, p in named], self.layout.zeros())
        # One flat momentum vector for the state; each fragment's optimizer owns its slice.
        self.momentum = self.layout.zeros()
        self.outers = [
            OuterOptimizer(b - a, run.outer, buffer=self.momentum[a:b])
            for a, b in self.layout.fragment_ranges
        ]
        self.inner = InnerLoop(model, run.inner, self.device)
        self.params = [p for _, p in self.inner.model.named_parameters()]
        data = task.load_data(model_config, data_spec)
        self.seq_len = int(model_config["seq_len"])
        self.stream = BatchStream(
            data.train,
            seq_len=self.seq_len,
            batch_size=run.inner.batch_size,
            vocab_size=data.vocab_size,
            seed=run.seed,
            worker=worker_of(self.peer_id),
        )
        self.batches = iter(self.stream)
        self.evalset = eval_windows(data.val, seq_len=self.seq_len, count=data_spec.eval_sequences)
        self.tokens_per_step = run.inner.batch_size * run.inner.grad_accum * self.seq_len
        sizes = [b - a for a, b in self.layout.fragment_ranges]
        self.feedback = (
            [ErrorFeedback(n, run.codec) for n in sizes] if run.codec.error_feedback else None
        )
        self.deltas = [torch.zeros(n) for n in sizes]
        self.means = [torch.zeros(n) for n in sizes]
        self.scratch = self.layout.zeros()
        # Tokens each fragment's local copy trained on since that fragment last synced.
        self.fragment_tokens = [0] * self.fragments
        self._inflight: _Exchange | None = None
        self.schema = StateSchema.diloco(self.layout.numel)
        self.round = 0  # outer steps applied to theta_g: the state's round
        self.steps = 0
        self.steps_since_round = 0
        self.tokens_since_round = 0
        self.rounds_applied = 0
        self.rounds_aborted = 0
        self.downloads = 0
        self.last_eval: float | None = None
        self._dirty = False  # trained since the last checkpoint
        self._rate = _Rate()
        self._reports: list[ProgressReport] = []
        self._last_loss = float("nan")
        self._expected: int | None = None  # peers known to work on the next round
        self._last_group: tuple[int, int] | None = None  # (round, size) of our last group
        self._progress_wake: asyncio.Event | None = None
        self._next_catch_up = 0.0
        self.train_seconds = 0.0
        self._nan_in_a_row = 0
        self._train_started = 0.0
        self._unbacked: dict[str, float] = {}  # peer -> until when its claims are ignored
        self._distrusted: dict[str, float] = {}  # peer -> until when it is not asked for state
        self._refusals_told: set[tuple[int, str]] = set()
        self.evidence = Evidence()
        self._publish_snapshot(None)
        logger.info(
            "swarm %s: %s, %s parameters, device %s, each of %d fragment(s) syncs every %d "
            "steps of %d tokens (overlap %d steps, mix %.2f)",
            self.swarm_id[:12],
            self.manifest.task,
            f"{self.layout.real_numel:,}",
            self.device,
            self.fragments,
            streaming.sync_every,
            self.tokens_per_step,
            streaming.delay,
            streaming.alpha,
        )

    def _committed(self) -> dict[str, torch.Tensor]:
        """A copy of the committed global state (the donor serves it while training goes
        on and changes the original)."""
        tensors = {THETA_G: self.theta_g.clone()}
        if self.round > 0:
            tensors[MOMENTUM] = self.momentum.clone()
        return tensors

    def _publish_snapshot(self, digest: bytes | None) -> None:
        """What the state donor serves from now on: the committed global state (hashed
        here when its digest is not given)."""
        self._finish_digest(wait=True)
        self._snapshot = StateSnapshot.of(
            swarm_id=self.swarm_id, round=self.round, tensors=self._committed(), digest=digest
        )

    def _hash_snapshot(self, then: Callable[[bytes], None]) -> None:
        """:meth:`_publish_snapshot` of a new round, hashed on the digest thread while
        training goes on (a large model's state takes seconds to hash). Until the digest is
        known the donor serves the previous snapshot; then ``then(digest)`` runs on the
        training thread (in :meth:`_finish_digest`)."""
        self._finish_digest(wait=True)
        future = self.digester.submit(
            StateSnapshot.of, swarm_id=self.swarm_id, round=self.round, tensors=self._committed()
        )
        self._hashing = (future, then)

    def _finish_digest(self, *, wait: bool = False) -> None:
        """Take the snapshot whose digest the digest thread computed, if it is done (or
        once it is, with ``wait``), and run what waited for its digest."""
        if self._hashing is None:
            return
        future, then = self._hashing
        if not wait and not future.done():
            return
        self._hashing = None
        self._snapshot = future.result()
        then(self._snapshot.digest)

    # -- checkpoints -------------------------------------------------------------------------

    def _restore(self) -> None:
        found = self.store.latest()
        if found is None:
            return
        s = found.state
        try:
            self.theta_g.copy_(s["theta_g"])
            self.momentum.copy_(s["momentum"])
            steps = [int(n) for n in s["outer_steps"]]
            if len(steps) != self.fragments:
                raise ValueError(f"{len(steps)} fragments, the swarm has {self.fragments}")
            for outer, n in zip(self.outers, steps, strict=True):
                outer.steps = n
            self.fragment_tokens = [int(n) for n in s["fragment_tokens"]]
            self.layout.scatter(s["params"], self.params)
            self.inner.load_state_dict(s["inner"])
            self.stream.load_state_dict(json.loads(s["data"]))
            torch.set_rng_state(s["rng"])
            self.round = int(s["round"])
            self.steps = int(s["steps"])
            self.steps_since_round = int(s["steps_since_round"])
            self.tokens_since_round = int(s["tokens_since_round"])
            # Checkpoints from before evidence was kept hold none: the peer starts fresh.
            self.evidence = Evidence.from_state(s.get("evidence", {}))
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            raise SwarmlocoError(
                f"checkpoint {found.path} does not fit this peer's model: {exc}; move it away "
                "to start over"
            ) from exc
        self._publish_snapshot(None)
        logger.info("resumed from %s: round %d, step %d", found.path.name, self.round, self.steps)
        self._emit("resumed", round=self.round, step=self.steps, checkpoint=str(found.path))

    def _checkpoint(self, *, wait: bool = False) -> None:
        """Checkpoint the state as it is now. Only the copy of the state happens here; the
        write runs on the writer's thread while training goes on. While the previous
        checkpoint is still being written, a round's is skipped (the next one, or the one
        at stop, carries its state). ``wait``: block until this one is on disk."""
        self._collect_checkpoint(wait=wait)
        if self.writer.busy:
            logger.info(
                "checkpoint of round %d skipped: the last one is still being written", self.round
            )
            return
        state = {
            "theta_g": self.theta_g,
            "momentum": self.momentum,
            "outer_steps": [outer.steps for outer in self.outers],
            "fragment_tokens": self.fragment_tokens,
            # Gathered into the scratch vector: the writer copies it before this returns.
            "params": self.layout.gather(self.params, self.scratch),
            "inner": self.inner.state_dict(),
            # JSON: the generator state holds 128-bit integers msgpack cannot carry.
            "data": json.dumps(self.stream.state_dict()),
            "rng": torch.get_rng_state(),
            "round": self.round,
            "steps": self.steps,
            "steps_since_round": self.steps_since_round,
            "tokens_since_round": self.tokens_since_round,
            "evidence": self.evidence.to_state(),
        }
        self.writer.submit(round=self.round, step=self.steps, state=state)
        self._dirty = False
        if wait:
            self._collect_checkpoint(wait=True)

    def _collect_checkpoint(self, *, wait: bool = False) -> None:
        """Report the checkpoint written in the background once it is on disk (a failed
        write raises its CheckpointError here, on the training thread)."""
        saved = self.writer.wait() if wait else self.writer.poll()
        if saved is not None:
            self._finish_digest(wait=True)  # the round's event before its checkpoint's
            self._emit(
                "checkpoint",
                round=saved.round,
                step=saved.step,
                path=str(saved.path),
                bytes=saved.nbytes,
                seconds=round(saved.write_seconds, 3),
                copy_seconds=round(saved.copy_seconds, 3),
            )

    # -- the network -------------------------------------------------------------------------

    def _start_network(self) -> None:
        cfg = self.config
        assert self.identity is not None
        self.node = NetNode(identity=self.identity, config=cfg.node)
        self.matchmaker = Matchmaker(
            identity=self.identity,
            dht=self.node.dht,
            client=self.node.client,
            swarm_id=self.swarm_id,
            config=cfg.matchmaking,
        )
        limiter = BandwidthLimiter(cfg.bandwidth) if cfg.bandwidth is not None else None
        self.averager = Averager(
            identity=self.identity,
            client=self.node.client,
            config=dataclasses.replace(cfg.averaging, codec=self.run_config.codec),
            limiter=limiter,
        )
        self.donor = StateDonor(
            identity=self.identity, snapshot=lambda: self._snapshot, limiter=limiter
        )
        self.catchup = CatchUp(
            me=self.peer_id,
            swarm_id=self.swarm_id,
            dht=self.node.dht,
            client=self.node.client,
            schema=self.schema,
            evidence=self.evidence,
            config=cfg.catchup,
            rejections=self.node.dht.rejections,
        )
        if self.node.server is not None:
            self.node.server.add_service(averaging_service(self.matchmaker, self.averager))
            self.node.server.add_service(state_service(self.donor))
        self.loop.run(self.node.__aenter__(), timeout=60.0)
        self._network_up = True
        self.loop.run(self._announce(), timeout=30.0)
        self.state = "training"
        self._progress_task = self.loop.submit(self._publish_progress_forever())
        self._dashboard_task = None
        if cfg.dashboard_port is not None:
            self._dashboard_task = self.loop.submit(self._serve_dashboard(cfg.dashboard_port))
        self._emit(
            "ready",
            swarm_id=self.swarm_id,
            peer_id=self.peer_id,
            endpoint=self.node.endpoint,
            round=self.round,
            params=self.layout.real_numel,
            device=str(self.device),
            precision=_PRECISION_NAMES[self.inner.amp_dtype],
        )

    async def _announce(self) -> None:
        try:
            await publish_manifest(self.node.dht, self.manifest)
        except SwarmlocoError as exc:  # alone on a new network: our own storage holds it
            logger.info("manifest: %s", exc)
        await announce_peer(self.node.dht, self.swarm_id, role="trainer")

    async def _serve_dashboard(self, port: int) -> None:
        """The swarm's dashboard, read through this peer's own DHT node (GET only)."""
        from swarmloco.dashboard.app import make_app, serve
        from swarmloco.dashboard.collector import Collector

        collector = Collector(
            dht=self.node.dht,
            swarm_id=self.swarm_id,
            manifest=self.manifest,
            rejoin=self.config.node.peers,
        )
        try:
            async with serve(make_app(lambda: collector.view), host="127.0.0.1", port=port) as url:
                logger.info("dashboard of swarm %s at %s", self.swarm_id[:12], url)
                self._emit("dashboard", url=url)
                await collector.run()
        except OSError as exc:  # the port is taken: train on without the page
            logger.warning("cannot serve the dashboard on port %d: %s", port, exc)

    def _progress_value(self) -> dict[str, Any]:
        # The round this peer's new tokens count towards: while round r is in flight,
        # r + 1 (its tokens since r started are the next round's).
        return {
            "round": self.round + 1 + (self._inflight is not None),
            "tokens": self.tokens_since_round,
            "tokens_per_s": self._rate.value,
            "at": time.time(),
        }

    def _status_value(self) -> dict[str, Any]:
        value: dict[str, Any] = {
            "name": (self.config.name or socket.gethostname())[:64],
            "state": self.state,
            "round": self.round,
            "step": self.steps,
            "tokens": self.steps * self.tokens_per_step,
            "tokens_per_s": self._rate.value,
            "device": _describe(self.device)[:64],
            "version": __version__[:32],
            "started_at": self.started_at,
            "rounds_applied": self.rounds_applied,
            "rounds_aborted": self.rounds_aborted,
            "downloads": self.downloads,
            "last_error": self.last_error[:240],
            "rounds": list(self.history),
            "at": time.time(),
        }
        if math.isfinite(self._last_loss):
            value["loss"] = self._last_loss
        if self.last_eval is not None and math.isfinite(self.last_eval):
            value["eval_loss"] = self.last_eval
        return value

    async def _publish_progress_forever(self) -> None:
        announced = time.monotonic()
        self._progress_wake = asyncio.Event()
        while True:
            self._progress_wake.clear()
            try:
                key = progress_key(self.swarm_id)
                await self.node.dht.store(key, self._progress_value(), ttl=PROGRESS_TTL_S)
                await self.node.dht.store(
                    status_key(self.swarm_id), self._status_value(), ttl=PROGRESS_TTL_S
                )
                result = await self.node.dht.get(key)
                self._reports = [
                    progress_report(e.subkey, e.value) for e in result.entries.values()
                ]
                if time.monotonic() - announced > 120.0:
                    await announce_peer(self.node.dht, self.swarm_id, role="trainer")
                    announced = time.monotonic()
            except Exception as exc:  # the network may be away for a while: keep training
                logger.warning("could not publish progress: %s", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self._progress_wake.wait(), timeout=self.config.progress_interval_s
                )

    def _report_now(self) -> None:
        """Publish progress (and read the others') at once: a round started or landed."""
        wake = self._progress_wake
        if wake is not None:
            self.loop.loop.call_soon_threadsafe(wake.set)

    def _leave(self) -> None:
        if getattr(self, "_network_up", False):
            self._progress_task.cancel()
            if self._dashboard_task is not None:
                self._dashboard_task.cancel()
            with contextlib.suppress(Exception):
                self.loop.run(self.node.__aexit__(None, None, None), timeout=30.0)
            self._network_up = False
        wall = time.monotonic() - self._train_started if self._train_started else 0.0
        self._emit(
            "stopped",
            round=self.round,
            step=self.steps,
            reason=self._stop_reason,
            # Time in inner steps over time since training started: what the rounds cost.
            train_seconds=round(self.train_seconds, 3),
            wall_seconds=round(wall, 3),
        )

    # -- catching up with the swarm ------------------------------------------------------------

    def _catch_up(self) -> None:
        """Download the swarm's state if this peer's is older or in the minority, on the
        evidence ``runtime/catchup.py`` asks for.

        Peers that claim later rounds no adoptable state backs (liars, or a lone peer ahead
        of everyone) are left out of pacing for a while instead of stalling this one, and
        the holders of a state refused after its download for longer.
        """
        self._finish_digest(wait=True)  # this peer's own digest of its last round
        assert self._snapshot is not None
        try:
            found = self.loop.run(
                self.catchup.find(
                    round=self.round,
                    digest=self._snapshot.digest if self.round > 0 else None,
                    theta_g=self.theta_g,
                    distrusted={p for p, t in self._distrusted.items() if t > time.monotonic()},
                ),
                timeout=self.config.catchup.state_timeout_s + 30.0,
            )
        except (SwarmlocoError, TimeoutError) as exc:
            logger.warning("could not catch up with the swarm: %s", exc)
            return
        now = time.monotonic()
        for peer in found.unbacked:
            self._unbacked[peer] = now + _UNBACKED_S
        for peer in found.distrusted:
            self._distrusted[peer] = now + _DISTRUSTED_S
            self._unbacked[peer] = now + _DISTRUSTED_S
        for refusal in found.refused:
            key = (refusal.round, refusal.digest)
            if key not in self._refusals_told:  # once per state, not at every look
                self._refusals_told.add(key)
                self._emit(
                    "refused",
                    round=refusal.round,
                    digest=refusal.digest,
                    holders=len(refusal.holders),
                    why=refusal.reason,
                )
        if found.failed:
            self.last_error = f"state download failed: {found.failed[-1]}"
            self._emit("download-failed", round=self.round, error=found.failed[-1])
        if found.adopted is not None:
            self._take(found.adopted, found.why)

    def _take(self, got: DownloadedState, why: str) -> None:
        """Make a downloaded state this peer's global state (and local parameters)."""
        snap = got.snapshot
        self.theta_g.copy_(snap.tensors[THETA_G])
        momentum = snap.tensors.get(MOMENTUM)
        if momentum is None:
            self.momentum.zero_()
        else:
            self.momentum.copy_(momentum)
        for f, outer in enumerate(self.outers):
            outer.steps = rounds_of_fragment(snap.round, f, self.fragments)
        self.round = snap.round
        self._take_global()
        self._publish_snapshot(snap.digest)
        self.evidence.adopted(time.time())
        self.downloads += 1
        self._dirty = True
        logger.info("took the swarm's state of round %d from %s: %s", self.round, got.donor, why)
        self._emit(
            "downloaded",
            round=self.round,
            donor=str(got.donor),
            bytes=snap.nbytes,
            seconds=round(got.seconds, 3),
            why=why,
        )

    def _take_global(self) -> None:
        """theta <- theta_g; the local progress since the last round restarts from it."""
        with torch.no_grad():
            self.layout.scatter(self.theta_g, self.params)
        self.steps_since_round = 0
        self.tokens_since_round = 0
        self.fragment_tokens = [0] * self.fragments

    # -- training ------------------------------------------------------------------------------

    def _train(self) -> None:
        cfg = self.config
        tau = self.run_config.streaming.delay
        self._train_started = time.monotonic()
        while not self._stop.is_set():
            self._finish_digest()
            if cfg.max_rounds is not None and self.round >= cfg.max_rounds:
                self.stop(f"round {self.round} reached (max rounds {cfg.max_rounds})")
                break
            if self._inflight is not None:
                if self.steps - self._inflight.step >= tau:
                    self._land()  # the exchange overlapped tau steps: apply it now
                    continue
            else:
                verdict = self._pace()
                if verdict is Verdict.BEHIND and time.monotonic() >= self._next_catch_up:
                    # Others work on a later round. If its state is not to be had yet
                    # (digests not published, donors busy), train on and look again later.
                    self._catch_up()
                    self._next_catch_up = time.monotonic() + _CATCH_UP_RETRY_S
                elif verdict is Verdict.DUE:
                    self._start_round()
                    continue
            started = time.monotonic()
            try:
                loss = self.inner.train_step(self.batches)
            except FloatingPointError as exc:
                self._discard(str(exc))
                continue
            self.steps += 1
            self.steps_since_round += 1
            self.tokens_since_round += self.tokens_per_step
            for f in range(self.fragments):
                self.fragment_tokens[f] += self.tokens_per_step
            self._dirty = True
            seconds = time.monotonic() - started
            self.train_seconds += seconds
            self._rate.add(self.tokens_per_step, seconds)
            self._last_loss = loss
            self._collect_checkpoint()
        if self._inflight is not None:
            self._land()
        self._finish_digest(wait=True)
        self.state = "stopping"
        if self._dirty:
            self._checkpoint(wait=True)
        self._collect_checkpoint(wait=True)

    def _pace(self) -> Verdict:
        """Whether to average now (DESIGN section 3, "When a round is due").

        The round is due when the peers working on it have together processed as many
        tokens as each doing H steps: a fast peer trains on past its H steps while slower
        ones catch up (and so contributes more tokens, and weight), a slow one joins early,
        and they arrive at matchmaking together. Alone, a peer averages (with itself) every
        H steps. It never waits past ``4 H`` steps for peers whose reports promise more.
        """
        # Each fragment syncs every H steps, so some fragment is due every H / F steps.
        h = self.run_config.streaming.sync_every / self.fragments
        if self.steps_since_round == 0:
            return Verdict.WAIT
        if self.steps_since_round >= _MAX_WAIT_ROUNDS * h:
            return Verdict.DUE
        now = time.time()
        target = self.round + 1
        mine = ProgressReport(
            peer=self.peer_id,
            round=target,
            tokens=self.tokens_since_round,
            tokens_per_s=self._rate.value,
            at=now,
        )
        clock = time.monotonic()
        fresh = max(_FRESH_MIN_S, _FRESH_REPORTS * self.config.progress_interval_s)
        reports = [
            r
            for r in self._reports
            if r.peer != self.peer_id
            and now - r.at <= fresh
            and not (r.round > target + 1 and self._unbacked.get(r.peer, 0.0) > clock)
        ]
        working = 1 + len({r.peer for r in reports if r.round == target})
        # Matchmaking waits for the peers of this round: those whose report names it, the
        # round before (they applied it with us and have not reported since) or the round
        # after (they started this one: it is in flight on their side). Counting too many
        # costs a gathering window, too few a group split in two.
        self._expected = 1 + len({r.peer for r in reports if target - 1 <= r.round <= target + 1})
        if self._last_group is not None and self._last_group[0] == self.round:
            # Who averaged the last round with us will most likely average this one too,
            # even when their reports lag a round behind.
            self._expected = max(self._expected, self._last_group[1])
        if any(r.round > target + 1 for r in reports):
            return Verdict.BEHIND  # others applied rounds this peer has not
        if any(r.round == target + 1 for r in reports) and self.steps_since_round >= h / 4:
            # Someone started this round already: join it now, with what we have, rather
            # than fall a gathering window out of step with it (not before a quarter of
            # the round's steps: a liar cannot make rounds much more frequent).
            return Verdict.DUE
        config = PacingConfig(tokens_per_round=max(1, round(working * h * self.tokens_per_step)))
        verdict = estimate([mine, *reports], round=target, now=now, config=config).verdict
        if verdict is Verdict.STALLED:  # cannot happen with our own fresh rate; be safe
            return Verdict.DUE if self.steps_since_round >= h else Verdict.WAIT
        return verdict

    def _discard(self, why: str) -> None:
        """NaN or Inf in training: nothing of it may reach the swarm. Drop the local steps
        since the last round and the optimizer's moments (they hold the NaN too), restart
        from the global state; give up when it happens again and again."""
        self._nan_in_a_row += 1
        logger.error(
            "%s after %d local steps: discarding them and restarting from the global state "
            "of round %d (%d time(s) since a round last succeeded)",
            why,
            self.steps_since_round,
            self.round,
            self._nan_in_a_row,
        )
        self._emit("discarded", round=self.round, steps=self.steps_since_round, why=why)
        if self._nan_in_a_row > _MAX_DISCARDS:
            raise SwarmlocoError(
                f"training produced NaN/Inf {self._nan_in_a_row} times from the swarm's global "
                "state without completing a round; check the data and the learning rate (or "
                "try --compile off) before joining again"
            )
        self.inner.optimizer.state.clear()
        self._take_global()

    def _start_round(self) -> None:
        """Start averaging the next round's fragment; training goes on while it runs."""
        self._catch_up()
        if self.steps_since_round == 0:
            return  # the download replaced this peer's work with the swarm's state
        target = self.round + 1
        f = (target - 1) % self.fragments
        delta = self.deltas[f]
        with torch.no_grad():
            self.layout.gather(self.params, self.scratch, f)
            torch.sub(
                self.layout.fragment(self.theta_g, f),
                self.layout.fragment(self.scratch, f),
                out=delta,
            )
        if not bool(torch.isfinite(delta).all()):
            self._discard("the local model holds NaN/Inf")
            return
        weight = float(self.fragment_tokens[f])
        self.state = "averaging"
        future = self.loop.submit(self._average(target, f, weight))
        self._inflight = _Exchange(target, f, future, self.steps, time.monotonic(), weight)
        self._report_now()
        # What trains from now on counts towards the next round.
        self.steps_since_round = 0
        self.tokens_since_round = 0

    def _land(self) -> None:
        """Wait for the exchange in flight; apply its outer step, or count it as aborted."""
        x = self._inflight
        assert x is not None
        self._inflight = None
        try:
            result, matchmaking = x.future.result(timeout=self.config.round_timeout_s + 10.0)
            if not bool(torch.isfinite(self.means[x.fragment]).all()):
                raise RoundAborted(f"round {x.round}: the group's mean is not finite")
        except Exception as exc:  # whatever the others sent: the round fails, never the peer
            if not isinstance(exc, _ROUND_FAILURES):
                logger.error("round %d failed on an unexpected error", x.round, exc_info=exc)
            x.future.cancel()
            self.state = "training"
            self.last_error = f"round {x.round} aborted: {exc}"
            self._remember(x.round, 0, x.started, None, x.fragment)
            # Nothing applied: the fragment's delta keeps growing and the next attempt
            # carries all of it.
            self.rounds_aborted += 1
            self._last_group = None  # those we expected did not come
            logger.warning("round %d aborted: %s", x.round, exc)
            self._emit(
                "aborted",
                round=x.round,
                fragment=x.fragment,
                error=f"{type(exc).__name__}: {exc}",
                seconds=round(time.monotonic() - x.started, 3),
            )
            return
        self.state = "training"
        f = x.fragment
        self.outers[f].step(self.layout.fragment(self.theta_g, f), self.means[f])
        movement = float(torch.linalg.vector_norm(self.outers[f].last_update))
        self.evidence.applied(movement, time.time())
        self.evidence.grouped(
            x.round, result.report.members, self.peer_id, self.config.catchup.adoption
        )
        self.round = x.round
        self.fragment_tokens[f] = max(0, self.fragment_tokens[f] - int(x.weight))
        alpha = self.run_config.streaming.alpha
        with torch.no_grad():
            if alpha == 0.0:
                self.layout.scatter(self.theta_g, self.params, f)
            else:
                self.layout.lerp_into(self.theta_g, self.params, alpha, f)
        event: dict[str, Any] = {}  # filled in below; emitted once the digest is known

        def hashed(digest: bytes) -> None:
            self.loop.submit(self._publish_digest(event["round"], digest))
            self._emit("round", **event, digest=digest.hex())

        self._hash_snapshot(hashed)
        self.rounds_applied += 1
        report = result.report
        self._nan_in_a_row = 0  # a round made it: training works from this state
        self._last_group = (x.round, len(report.members))
        self._report_now()
        self._remember(x.round, len(report.members), x.started, report, f, matchmaking)
        eval_loss = None
        if self.config.eval_every and self.round % self.config.eval_every == 0:
            eval_loss = self._evaluate()
        seconds = time.monotonic() - x.started
        event.update(
            {
                "round": self.round,
                "fragment": f,
                "step": self.steps,
                "overlap_steps": self.steps - x.step,
                "group": len(report.members),
                "weight": x.weight,
                "loss": self._last_loss,
                "eval_loss": eval_loss,
                "bytes_sent": report.bytes_sent,
                "seconds": round(seconds, 3),
                "matchmaking_seconds": round(matchmaking, 3),
                "excluded": sorted(report.excluded),
            }
        )
        logger.info(
            "round %d (fragment %d) applied with %d peer(s) in %.2fs: train loss %.3f%s",
            self.round,
            f,
            len(report.members),
            seconds,
            self._last_loss,
            f", eval loss {eval_loss:.3f}" if eval_loss is not None else "",
        )
        if self.config.checkpoint_every and self.round % self.config.checkpoint_every == 0:
            self._checkpoint()

    def _remember(
        self,
        round: int,
        group: int,
        started: float,
        report: Any,
        fragment: int,
        matchmaking: float | None = None,
    ) -> None:
        """One line of the round timeline the status record carries."""
        line: dict[str, Any] = {
            "round": round,
            "group": group,
            "seconds": time.monotonic() - started,
            "bytes_sent": report.bytes_sent if report is not None else 0,
            "bytes_received": report.bytes_received if report is not None else 0,
            "payload_bytes": 4 * self.deltas[fragment].numel(),
            "ok": report is not None,
            "at": time.time(),
        }
        if matchmaking is not None:
            line["matchmaking_s"] = matchmaking
        self.history.append(line)

    async def _average(self, round: int, fragment: int, weight: float) -> tuple[Any, float]:
        """The all-reduce result of ``round``, and the seconds matchmaking took."""
        deadline = Deadline.after(self.config.round_timeout_s)
        started = time.monotonic()
        delta = self.deltas[fragment]
        group = await self.matchmaker.form_group(
            round,
            weight=weight,
            numel=delta.numel(),
            block_size=self.run_config.codec.block_size,
            deadline=deadline,
            expected=self._expected,
        )
        expected = self._expected or 1
        if group.size == 1 and expected > 1:
            # Others work on this round but none came: they are a round ahead (or behind)
            # of us. Averaging alone would split the swarm's state; catch up instead.
            raise RoundAborted(
                f"round {round}: none of the {expected - 1} other peer(s) working on it "
                "joined; out of step with them"
            )
        matchmaking = time.monotonic() - started
        result = await self.averager.all_reduce(
            group,
            delta,
            deadline=deadline,
            out=self.means[fragment],
            error_feedback=self.feedback[fragment] if self.feedback else None,
        )
        return result, matchmaking

    async def _publish_digest(self, round: int, digest: bytes) -> None:
        value = {"digest": digest, "endpoint": self.node.endpoint, "at": time.time()}
        try:
            await self.node.dht.store(digest_key(self.swarm_id, round), value, ttl=DIGEST_TTL_S)
        except Exception as exc:
            logger.warning("could not publish the digest of round %d: %s", round, exc)

    def _evaluate(self) -> float:
        params = [p for _, p in self.eval_model.named_parameters()]
        with torch.no_grad():
            self.layout.scatter(self.theta_g, params)
        self.eval_model.to(self.device)
        loss = evaluate(self.eval_model, self.evalset, self.device, self.inner.amp_dtype)
        self.last_eval = loss
        return loss

    @property
    def summary(self) -> PeerSummary:
        return PeerSummary(
            swarm_id=self.swarm_id,
            peer_id=getattr(self, "peer_id", ""),
            round=getattr(self, "round", 0),
            steps=getattr(self, "steps", 0),
            rounds_applied=getattr(self, "rounds_applied", 0),
            rounds_aborted=getattr(self, "rounds_aborted", 0),
            downloads=getattr(self, "downloads", 0),
            last_eval_loss=getattr(self, "last_eval", None),
            stopped_because=self._stop_reason,
        )


@dataclasses.dataclass(frozen=True)
class _Exchange:
    """A round in flight: started after inner step ``step``, applied ``tau`` steps later."""

    round: int
    fragment: int
    future: concurrent.futures.Future[Any]
    step: int
    started: float
    weight: float


def rounds_of_fragment(round: int, fragment: int, fragments: int) -> int:
    """How many of rounds 1..``round`` synced ``fragment`` (round r syncs (r - 1) % F)."""
    return 0 if round <= fragment else (round - 1 - fragment) // fragments + 1


class _Rate:
    """Tokens per second over the recent steps (exponential average)."""

    def __init__(self) -> None:
        self.value = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        if seconds <= 0 or not math.isfinite(seconds):
            return
        rate = tokens / seconds
        self.value = rate if self.value == 0.0 else 0.9 * self.value + 0.1 * rate


def _write_manifest_copy(path: Path, manifest: SwarmManifest) -> None:
    """Keep the manifest beside the checkpoints (atomic: a torn copy never replaces one)."""
    data = manifest.to_bytes()
    if path.exists() and path.read_bytes() == data:
        return
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)
