"""One peer of a swarm, around the user's own training loop: :class:`Swarm`.

``with swarm:`` around a loop of ``loss.backward(); optimizer.step()``. The user's model,
optimizer, gradient scaler, clipping and LR scheduler stay theirs: the swarm hooks the
optimizer's step (a post hook; or the loop calls :meth:`Swarm.step`), counts the step and
its tokens, and does the swarm's work between two steps:

1. **Enter.** Fetch the manifest (a swarm id) or take it (``create``), refuse a model that
   is not the swarm's (names, shapes, dtypes; before any other network traffic), restore
   the newest checkpoint of this swarm from the data directory (model, optimizer, the
   objects registered with :meth:`Swarm.register`, the DiLoCo state), start networking
   and catch up with the swarm (downloading its state, or the initial weights when this
   model's differ from the manifest's).
2. **Between steps.** A round is due when the peers working on it have together trained
   H / F steps' worth of tokens each (:meth:`Swarm._pace`). Round r averages fragment
   ``(r - 1) % F`` of ``delta = theta_g - theta`` (weighted by the tokens the fragment
   trained on since its last sync) with the peers ready for the same round; the exchange
   runs while the loop trains ``tau`` more steps, then the outer Nesterov step is applied
   to that fragment of ``theta_g`` on the CPU, the fragment's local copy becomes
   ``lerp(theta_g, theta, alpha)``, the digest of the new global state is published and a
   checkpoint written (hashing and writing run on threads of their own). A round that
   fails changes nothing. Before each round the peer checks that its state is the swarm's
   and downloads the swarm's when it is behind or outvoted (``runtime/catchup.py``).
3. **Exit.** The round in flight lands, a final checkpoint is written, the peer leaves.
   Once asked to stop (a signal, ``max_rounds``, the end of the run, :meth:`Swarm.stop`)
   the next ``optimizer.step()`` raises :class:`~swarmloco.errors.Stopped`, which leaves
   the loop at a step boundary and which ``with swarm`` swallows.

The learning rate follows the swarm: :attr:`Swarm.global_step` is the swarm's progress
in inner steps (``round * H / F`` plus this peer's steps into the next round), so a peer
that joins at round 100 schedules from there, not from its own first step
(:meth:`Swarm.lr_lambda`, :meth:`Swarm.scheduler`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import socket
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from swarmloco.core.adoption import Evidence, Reference
from swarmloco.core.codec import warm_up
from swarmloco.core.manifest import SwarmManifest
from swarmloco.core.pacing import PacingConfig, ProgressReport, Verdict, estimate
from swarmloco.core.runspec import RunSpec
from swarmloco.core.signature import (
    ModelSignature,
    parameters_in_order,
    params_of,
)
from swarmloco.core.state import THETA_G, StateSnapshot, state_digest
from swarmloco.errors import (
    ModelMismatch,
    RoundAborted,
    Stopped,
    SwarmlocoError,
)
from swarmloco.net.admission import Gate
from swarmloco.net.averaging.report import AllReduceReport
from swarmloco.net.identity import Identity
from swarmloco.net.records import is_farewell
from swarmloco.net.state import DownloadedState
from swarmloco.runtime.box import (
    STOPPED_PREFIX,
    Box,
    BoxError,
    BoxParams,
    Op,
    load_model_state,
    load_optimizer_state,
    local_state,
    unwrap,
)
from swarmloco.runtime.checkpoint import BackgroundWriter, CheckpointStore, Saved
from swarmloco.runtime.config import PeerConfig
from swarmloco.runtime.keeper import CheckpointKeeper
from swarmloco.runtime.loop_thread import LoopThread
from swarmloco.runtime.network import SwarmNetwork, averaging_config, peer_codec
from swarmloco.runtime.session import REMEMBER, Session, handle_signals
from swarmloco.runtime.snapshots import Snapshots
from swarmloco.runtime.status import Counters, StatusSheet
from swarmloco.runtime.trial import Trial
from swarmloco.train.diloco import DilocoState, fragment_of_round

logger = logging.getLogger(__name__)

EventSink = Callable[[dict[str, Any]], None]
Evaluator = Callable[[], float]

_FRESH_REPORTS = 5  # a report older than this many publishing intervals: the peer left
_FRESH_MIN_S = 10.0
_MAX_WAIT_ROUNDS = 4
_CATCH_UP_RETRY_S = 2.0
_PEERS_POLL_S = 0.5  # how long wait_for_peers waits for a read of the records at most
_EXPECTED_STRANGERS = 2  # newcomers a round waits for (a short grace) besides partners
_MAX_DISCARDS = 3  # NaN/Inf restarts without a round in between before the peer gives up
_INITIAL_RETRY_S = 2.0
_ROUND_FAILURES = (SwarmlocoError, TimeoutError)


class Stateful(Protocol):
    """What :meth:`Swarm.register` checkpoints: a scheduler, a data loader, an RNG."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


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


@dataclasses.dataclass(frozen=True)
class _Exchange:
    """A round in flight: started after local step ``step``, applied ``tau`` steps later."""

    round: int
    fragment: int
    future: Any  # concurrent.futures.Future[tuple[AllReduceResult, float]]
    step: int
    started: float
    weight: float


def manifest_spec(manifest: SwarmManifest) -> RunSpec:
    try:
        return RunSpec.from_manifest(manifest.hparams["run"])
    except (KeyError, TypeError, ValueError) as exc:
        raise SwarmlocoError(
            f"swarm {manifest.swarm_id}'s manifest has no valid run spec: {exc}"
        ) from exc


def manifest_signature(manifest: SwarmManifest) -> ModelSignature:
    signature = manifest.model.get("signature")
    if not isinstance(signature, Mapping):
        raise SwarmlocoError(
            f"swarm {manifest.swarm_id}'s manifest has no model signature: it was made by an "
            "older swarmloco; create the run again"
        )
    return ModelSignature.from_manifest(signature)


class Swarm:
    """One peer of one swarm around the user's training loop (see the module docstring).

    Build it with :func:`swarmloco.create` or :func:`swarmloco.join`; constructing does no
    I/O. ``source`` is the run's manifest, or a swarm id whose manifest is fetched on enter.
    ``network``: the peer's network (built on enter by default; tests inject one with a
    fault plan). ``evaluate``: returns the loss of the global model (after
    :meth:`load_global_into` of the caller's eval copy), run every ``eval_every`` rounds.
    ``box``: the box's rank 0, when the peer is several ranks (``runtime/box.py``).
    """

    def __init__(
        self,
        source: SwarmManifest | str,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        config: PeerConfig,
        *,
        identity: Identity,
        network: SwarmNetwork | None = None,
        on_event: EventSink | None = None,
        evaluate: Evaluator | None = None,
        box: Box | None = None,
    ) -> None:
        self.manifest = source if isinstance(source, SwarmManifest) else None
        self.swarm_id = source.swarm_id if isinstance(source, SwarmManifest) else source
        self.box = box if box is not None and box.size > 1 else None
        self.model = unwrap(model)
        self.optimizer = optimizer
        self.config = config
        self.identity = identity
        self.peer_id = identity.peer_id_hex
        self.network = network
        self.on_event = on_event
        self.evaluate = evaluate
        self.objects: dict[str, Stateful] = {}
        self._schedulers: list[torch.optim.lr_scheduler.LambdaLR] = []  # made by scheduler()
        self.state = "starting"
        self.started_at = time.time()
        self.last_error = ""
        self.sheet = StatusSheet(
            # Several peers on one host (or in containers named alike) stay apart.
            name=config.name or f"{socket.gethostname()[:50]}/{self.peer_id[:6]}",
            device="",  # known once the swarm is entered
            started_at=self.started_at,
        )
        self.steps = 0
        self.steps_since_round = 0
        self.tokens_since_round = 0
        # When the counts above began, if this peer started the round with the swarm (its
        # own exchange started it); None after a start or a download: others may have been
        # counting for long already, and pacing must not cap their tokens by our time.
        self._hook_s = 0.0  # the last step's hook, rounds and downloads aside
        self._resume_pending = False  # a round landed in this hook (no overlap)
        self._blocked_s = 0.0  # time in rounds and downloads during the current hook
        self._counting_since: float | None = None  # swarm time the round's tokens began
        self._resumed_at: float | None = None  # swarm time training resumed after a round
        self.rounds_applied = 0
        self.rounds_aborted = 0
        self.downloads = 0
        self.last_eval: float | None = None
        self.last_loss = float("nan")
        self.train_seconds = 0.0
        self.evidence = Evidence()
        self.lr_at: Callable[[int], float] | None = None
        """The inner learning rate at a global step, when the loop follows a schedule
        (:meth:`lr_lambda` and :meth:`scheduler` set it; a loop that sets its optimizer's
        learning rate itself may too). A peer behind the swarm uses it to judge how far the
        rounds it missed can have moved the global state; without it, it assumes the
        current learning rate held."""
        self._lr_sum = 0.0  # learning rates of the inner steps since the last outer step
        self._lr_steps = 0
        self.admission: Gate | None = None
        """The swarm's gate, once entered: a private swarm's certificates, or a public
        run's proofs of work (None: an open run)."""
        self._global_step = 0
        self._told_stopping = False
        self._stop = threading.Event()
        self._run_over = False  # the run reached its end here (not just this peer stopping)
        self._stop_reason = ""
        self._stack: contextlib.ExitStack | None = None
        self._inflight: _Exchange | None = None
        self._rate = _Rate()
        self._consistent = True  # False while a round's result is being applied
        self._expected: tuple[int, int] | None = None
        """Peers known to work on the next round (this one included), and strangers worth a
        short wait besides (see ``_pace``)."""
        # (round, the other members' ids) of our last group
        self._last_group: tuple[int, frozenset[str]] | None = None
        self._next_catch_up = 0.0
        self._nan_in_a_row = 0
        self._train_started = 0.0
        self._step_ended = 0.0
        self._late: tuple[int, float] | None = None
        """(round, until): that round's group formed without this peer, which waits for its
        result (a download) instead of averaging the round with whoever else came late."""
        self._read_twice = False  # the first round waited for a second read of the records
        self._round_s = 5.0  # how long this peer's last applied round took (a guess at first)
        self.trial = Trial(config.catchup.adoption)
        """The adopted state on trial, its fallback, and whom this peer no longer believes."""
        self._hook: Any = None

    # -- what the user reads and calls ------------------------------------------------------

    @property
    def spec(self) -> RunSpec:
        """The run's shared hyperparameters (known once entered, or at once for a create)."""
        if self.manifest is None:
            raise SwarmlocoError("the run spec is known once the swarm is entered (with swarm:)")
        return manifest_spec(self.manifest)

    @property
    def round(self) -> int:
        """The round of this peer's global state."""
        return self.diloco.round if hasattr(self, "diloco") else 0

    @property
    def global_step(self) -> int:
        """The swarm's progress in inner steps: ``round * H / F`` plus this peer's steps into
        the next round (at most H / F; never decreasing)."""
        return self._global_step

    @property
    def data_seed(self) -> int:
        """A seed for this peer's data sampler: distinct per peer (it comes from the peer's
        key), the same after a restart with the same data directory."""
        return int(self.peer_id[:15], 16)

    @property
    def endpoint(self) -> str:
        """HOST:PORT where other peers reach this one once entered ("" in client mode)."""
        return self.network.endpoint if self.network is not None else ""

    @property
    def stopping(self) -> bool:
        """Whether the peer was asked to stop; a loop that checks it ends cleanly. In a
        box, as told to every rank at the last step's end (all ranks leave together)."""
        if self.box is not None:
            return self._told_stopping
        return self._stop.is_set()

    def stop(self, reason: str = "asked to stop") -> None:
        """Ask the peer to stop at the next step (thread-safe)."""
        if not self._stop.is_set():
            self._stop_reason = reason
            self._stop.set()

    def register(self, name: str, obj: Stateful) -> None:
        """Checkpoint ``obj`` (``state_dict``/``load_state_dict``) with the peer, and
        restore it on enter: a scheduler, a data loader, an RNG. Register before entering."""
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise TypeError(f"{name!r} has no state_dict/load_state_dict to checkpoint")
        if self._stack is not None:
            raise SwarmlocoError("register objects before entering the swarm (with swarm:)")
        self.objects[name] = obj

    def lr_lambda(self, schedule: Callable[[int], float]) -> Callable[[int], float]:
        """A ``LambdaLR`` factor that follows the swarm: ``schedule(global_step)``, whatever
        step count the scheduler keeps itself. The first schedule given (that of the first
        parameter group, for a list of them) also sets :attr:`lr_at` if it is unset."""
        if self.lr_at is None:
            group = self.optimizer.param_groups[0]
            # LambdaLR keeps the base learning rate as "initial_lr"; before that, "lr" is it.
            self.lr_at = lambda step: float(group.get("initial_lr", group["lr"])) * schedule(step)
        return lambda _: schedule(self.global_step)

    def scheduler(self, schedule: Callable[[int], float]) -> torch.optim.lr_scheduler.LambdaLR:
        """``LambdaLR(optimizer, lr_lambda(schedule))``: call its ``step()`` after each
        ``optimizer.step()`` as usual; it is registered (checkpointed) as ``scheduler``."""
        sched = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.lr_lambda(schedule))
        if self._stack is None and "scheduler" not in self.objects:
            self.register("scheduler", sched)
        self._schedulers.append(sched)
        return sched

    def _follow_schedules(self) -> None:
        """Set the learning rates of the schedulers made by :meth:`scheduler` to the
        swarm's step now (one made before entering set them at global step 0: a peer that
        resumed or downloaded would take its first step at the warmup's rate)."""
        for sched in self._schedulers:
            for group, factor, base in zip(
                self.optimizer.param_groups, sched.lr_lambdas, sched.base_lrs, strict=False
            ):
                group["lr"] = base * factor(sched.last_epoch)

    def log(self, *, loss: float | None = None) -> None:
        """Report the training loss (shown on the dashboard and in round events). While a
        downloaded state is on probation, a loss that explodes or turns NaN rolls it back
        at the next step boundary."""
        if loss is None:
            return
        self.last_loss = float(loss)
        self.trial.loss(self.last_loss)

    def load_global_into(self, module: torch.nn.Module) -> None:
        """Copy the global parameters (``theta_g``) into ``module`` (e.g. an eval copy)."""
        with torch.no_grad():
            self.diloco.layout.scatter(
                self.diloco.theta_g, parameters_in_order(module, self.signature.params)
            )

    def global_parameters(self) -> dict[str, torch.Tensor]:
        """The global parameters (``theta_g``) by name, as views of the swarm's own fp32
        vector on the CPU: no copy (read them, never write them; they change when a round
        lands). ``torch.func.functional_call(model, swarm.global_parameters(), args)``
        evaluates the global model without an eval copy of the model."""
        theta = self.diloco.theta_g
        return {
            slot.name: theta[slot.start : slot.start + slot.numel].view(slot.shape)
            for slot in self.diloco.layout.slots
        }

    def wait_for_peers(self, n: int, *, timeout_s: float = 600.0) -> int:
        """Block until at least ``n`` peers of the swarm (this one included) are online, so
        that they start training together; returns how many are. Online: a peer whose
        progress record is fresh (it reports every ``progress_interval_s``; one that left
        said goodbye, one that was killed falls silent). Raises :class:`SwarmlocoError`
        after ``timeout_s``, and :class:`Stopped` when the peer is asked to stop meanwhile
        (Ctrl-C: ``with swarm`` leaves quietly, no step runs). Inside ``with swarm:``; in a
        box, every rank calls it."""
        if self._stack is None or self.network is None:
            raise SwarmlocoError("wait_for_peers() inside `with swarm:`")
        network = self.network
        deadline = time.monotonic() + timeout_s
        found, error = 1, ""
        while True:
            # Count on records read from now on: a peer that left a moment ago is seen gone.
            reads = network.reads
            self.loop.loop.call_soon_threadsafe(network.wake)
            network.wait_for_reads(reads + 1, _PEERS_POLL_S)
            if self._stop.is_set():
                error = STOPPED_PREFIX + self._stop_reason
                break
            found = 1 + len({r.peer for r in self._fresh_reports(self._now())})
            if found >= n:
                break
            if time.monotonic() > deadline:
                error = f"{found} of {n} peers online after {timeout_s:.0f} s"
                break
        if self.box is not None:
            self.box.share(error)
        if error.startswith(STOPPED_PREFIX):
            raise Stopped(self._stop_reason)
        if error:
            raise SwarmlocoError(error)
        logger.info("%d peers online", found)
        return found

    @property
    def summary(self) -> Summary:
        return Summary(
            swarm_id=self.swarm_id,
            peer_id=self.peer_id,
            round=self.round,
            steps=self.steps,
            global_step=self.global_step,
            rounds_applied=self.rounds_applied,
            rounds_aborted=self.rounds_aborted,
            downloads=self.downloads,
            last_eval_loss=self.last_eval,
            stopped_because=self._stop_reason,
        )

    def _emit(self, event: str, **fields: Any) -> None:
        if self.on_event is not None:
            self.on_event({"event": event, "time": time.time(), **fields})

    # -- entering -----------------------------------------------------------------------------

    def __enter__(self) -> Swarm:
        if self._stack is not None:
            raise SwarmlocoError("this swarm object is already entered")
        stack = contextlib.ExitStack()
        try:
            self._enter(stack)
            if self.box is not None:
                self.box.tell(Op.READY)
                self.box.share(
                    {
                        "swarm_id": self.swarm_id,
                        "peer_id": self.peer_id,
                        "endpoint": self.endpoint,
                        "data_seed": self.data_seed,
                        "round": self.round,
                        "global_step": self.global_step,
                    }
                )
        except BaseException as exc:
            self._stack = None
            self._abort_box(exc)
            stack.close()
            raise
        self._stack = stack
        return self

    def _abort_box(self, exc: BaseException) -> None:
        """Tell the box's other ranks that this one failed (they raise too)."""
        if self.box is None or self.box.broken:
            return
        try:
            self.box.tell(Op.ABORT)
            self.box.share(f"{type(exc).__name__}: {exc}")
        except BoxError:
            pass

    def _enter(self, stack: contextlib.ExitStack) -> None:
        cfg = self.config
        if cfg.handle_signals and threading.current_thread() is threading.main_thread():
            handle_signals(stack, self.stop)  # Ctrl-C while starting: stop at step one
        self.loop = stack.enter_context(LoopThread(name="swarmloco-peer-loop"))
        self.session = Session(cfg, self.identity, self.loop, self.swarm_id)
        if self.manifest is None:
            self.manifest = self.session.manifest()
            self.swarm_id = self.session.swarm_id
        manifest = self.manifest
        spec = manifest_spec(manifest)
        self.signature = manifest_signature(manifest)
        self._check_model()
        # After the model's check (a wrong model is refused at once), before the network:
        # a private run's certificate, or this key's proof of work (solved once, kept).
        self.admission = self.session.admission(manifest)
        self.h = spec.steps_per_round
        self.spec_ = spec
        if self.box is not None:
            self.box.tell(Op.MANIFEST)
            self.box.share(manifest.to_bytes())
        layout = self.signature.layout(spec.codec.block_size)
        codec = peer_codec(cfg, spec.codec, layout.numel)
        seconds = warm_up(codec)  # before any round: compiling stalls the event loop
        logger.info("codec (%s) ready in %.1fs", codec.backend, seconds)
        self.codec = codec
        self.diloco = DilocoState(layout, spec.outer, codec)
        self.params = BoxParams(
            parameters_in_order(self.model, self.signature.params), self.diloco.layout, self.box
        )
        self.sheet.device = describe_device(self._device)
        self._open_checkpoints(stack, manifest)
        self.snapshots = stack.enter_context(Snapshots(self.swarm_id))
        own_initial = True
        if not self._restore():
            layout = self.diloco.layout
            with self.params.view(None, read=True) as whole:
                theta = layout.gather(whole, layout.zeros())
            own_initial = state_digest({THETA_G: theta}) == self.signature.init_digest
            if own_initial:
                self.diloco.theta_g.copy_(theta)
        self.snapshots.publish(self.round, self.diloco.committed())
        self._start_network(stack, spec)
        self._train_started = time.monotonic()
        self._catch_up()
        if not own_initial and self.round == 0:
            self._fetch_initial()
        self._follow_schedules()
        if cfg.hook:
            self._hook = self.optimizer.register_step_post_hook(lambda *_: self.step())
            stack.callback(self._hook.remove)
        self.state = "training"
        self._step_ended = time.monotonic()
        self._ready(spec)

    def _check_model(self) -> None:
        """Refuse a model that is not the swarm's, naming each difference."""
        differences = self.signature.differences(params_of(self.model))
        if differences:
            lines = "\n".join(f"  - {d}" for d in differences)
            raise ModelMismatch(
                f"this model is not the one swarm {self.swarm_id} trains:\n{lines}\nbuild the "
                "model exactly as the swarm's creator did (same class, config and dtype)",
                differences,
            )

    def _open_checkpoints(self, stack: contextlib.ExitStack, manifest: SwarmManifest) -> None:
        """The swarm's directory (with a copy of its manifest), its checkpoint store and
        the keeper of its checkpoints."""
        cfg = self.config
        swarm_dir = cfg.directory / "swarms" / self.swarm_id
        swarm_dir.mkdir(parents=True, exist_ok=True)
        _write_manifest_copy(swarm_dir / "manifest.json", manifest)
        self.store = stack.enter_context(
            CheckpointStore(
                swarm_dir / "checkpoints", swarm_id=self.swarm_id, keep=cfg.keep_checkpoints
            )
        )
        writer = stack.enter_context(BackgroundWriter(self.store))
        self.keeper = CheckpointKeeper(
            self.store, writer, retry_s=cfg.checkpoint_retry_s, emit=self._emit
        )

    def _ready(self, spec: RunSpec) -> None:
        """Say that this peer trains: its event and its log line."""
        self._emit(
            "ready",
            swarm_id=self.swarm_id,
            peer_id=self.peer_id,
            endpoint=self.network.endpoint if self.network else "",
            round=self.round,
            global_step=self.global_step,
            params=self.signature.numel,
            device=str(self._device),
        )
        logger.info(
            "swarm %s: %s parameters, each of %d fragment(s) syncs every %d steps (overlap %d "
            "steps, mix %.2f); this peer (id %s) at round %d, global step %d",
            self.swarm_id[:12],
            f"{self.signature.numel:,}",
            spec.fragments,
            spec.sync_every,
            spec.delay,
            spec.alpha,
            self.peer_id,
            self.round,
            self.global_step,
        )

    @property
    def _device(self) -> torch.device:
        return self.params.device

    def _remember_peers(self) -> None:
        """Keep the peers this one knows now for its next start (``peers.json``)."""
        if self.network is None:
            return
        try:
            peers = self.loop.run(self.network.known_peers(REMEMBER), timeout=5.0)
        except (TimeoutError, SwarmlocoError) as exc:
            logger.debug("could not list the peers this one knows: %s", exc)
            return
        self.session.remember(peers)

    def _start_network(self, stack: contextlib.ExitStack, spec: RunSpec) -> None:
        assert self.manifest is not None
        if self.network is None:
            config = self.config
            remembered = self.session.remembered()
            if remembered:
                node = dataclasses.replace(config.node, remembered=remembered)
                config = dataclasses.replace(config, node=node)
            self.network = SwarmNetwork(
                identity=self.identity,
                manifest=self.manifest,
                config=config,
                averaging=averaging_config(self.config, self.codec, spec.averaging_aggregator),
                schema=self.diloco.schema,
                evidence=self.evidence,
                admission=self.admission,
            )
        network = self.network
        network.catchup.evidence = self.evidence  # restored from a checkpoint, maybe
        network.snapshot = lambda: self.snapshots.current
        network.previous_snapshot = lambda: self.snapshots.previous
        network.progress = self._progress_value
        network.status = self._status_value
        network.on_dashboard = lambda url: self._emit("dashboard", url=url)
        self.loop.run(network.__aenter__(), timeout=60.0)
        stack.callback(self._leave_network)
        skew = network.node.dht.clock_skew_s
        if abs(skew) > network.node.dht.config.warn_clock_skew_s:
            where = "behind" if skew > 0 else "ahead of"
            # Shown on the dashboard until something else goes wrong.
            self.last_error = (
                f"clock {abs(skew):.0f} s {where} the swarm's (kept in step with it): set it "
                "right (NTP)"
            )

    def _leave_network(self) -> None:
        assert self.network is not None
        self._remember_peers()
        with contextlib.suppress(Exception):
            self.loop.run(self.network.__aexit__(None, None, None), timeout=30.0)

    def _fetch_initial(self) -> None:
        """This model's initial weights are not the manifest's and the swarm has no later
        state yet: fetch round 0's from a peer, checked against the manifest's digest."""
        assert self.network is not None
        deadline = time.monotonic() + self.config.catchup.state_timeout_s
        while self.round == 0:
            got = self.loop.run(
                self.network.catchup.initial(self.signature.init_digest),
                timeout=self.config.catchup.state_timeout_s + 30.0,
            )
            if got is not None:
                self._take(got, "this model's initial weights are not the swarm's")
                return
            self._catch_up()
            if self.round > 0:
                return
            if time.monotonic() > deadline:
                raise SwarmlocoError(
                    "this model's initial weights differ from the swarm's, and no peer serves "
                    "the swarm's state: seed torch as the swarm's creator did before building "
                    f"the model (torch.manual_seed({self.spec_.seed})), or join while a peer "
                    "of the swarm is up"
                )
            time.sleep(_INITIAL_RETRY_S)

    # -- checkpoints --------------------------------------------------------------------------

    def _restore(self, *, verified: bool | None = None) -> bool:
        """Resume from the newest checkpoint that loads and fits this peer (with
        ``verified=True``, the newest whose global state this peer trained and checked
        itself); False when there is none (see :class:`CheckpointKeeper`)."""
        found = self.keeper.resume(self._load_checkpoint, verified=verified)
        if found is None:
            if self.keeper.error:
                self.last_error = self.keeper.error
            return False
        if self.box is not None:
            self._restore_box(found.state, found.state.get("ranks", []))
        if not found.verified:
            self._resume_probation()
        logger.info(
            "resumed from %s: round %d, step %d, global step %d%s",
            found.path.name,
            self.round,
            self.steps,
            self.global_step,
            "" if found.verified else " (an adopted state, on probation)",
        )
        self._emit(
            "resumed",
            round=self.round,
            step=self.steps,
            global_step=self.global_step,
            checkpoint=str(found.path),
            verified=found.verified,
        )
        return True

    def _resume_probation(self) -> None:
        """Resumed from a checkpoint of an adopted state still on probation: its fallback
        is the newest checkpoint of a state this peer verified itself. Without one (a fresh
        peer that adopted and stopped before its first verified save), the state is kept
        as this peer's own, with a warning."""
        fallback = None
        for candidate in self.keeper.store.valid(verified=True):
            try:
                state = candidate.state["diloco"]
                fallback = StateSnapshot.of(
                    swarm_id=self.swarm_id,
                    round=int(state["round"]),
                    tensors=DilocoState.snapshot_tensors(state),
                )
            except (KeyError, TypeError, ValueError) as exc:
                logger.warning("checkpoint %s holds no usable state: %s", candidate.path, exc)
                continue
            break
        probation = self.trial.probation
        if probation is None or fallback is None:
            if probation is not None:
                logger.warning(
                    "the state of round %d was adopted on probation and no state this peer "
                    "verified itself is checkpointed: keeping it as this peer's own",
                    probation.round,
                )
            self.trial.end()
            self.keeper.verified = True
            return
        self.trial.fallback = fallback
        logger.info(
            "the state of round %d is on probation; its fallback is this peer's own state of "
            "round %d",
            probation.round,
            fallback.round,
        )

    def _load_checkpoint(self, s: Mapping[str, Any]) -> None:
        """Load one checkpoint's state into the model, optimizer, registered objects, RNG,
        counters and DiLoCo state; raises at the first part that does not fit (what was
        loaded before it is overwritten by the next checkpoint tried)."""
        ranks = s.get("ranks", [])
        if self.box is not None and len(ranks) != self.box.size - 1:
            raise ValueError(
                f"it was saved by a box of {len(ranks) + 1} rank(s), this one has {self.box.size}"
            )
        if self.box is None and ranks:
            raise ValueError(f"it was saved by a box of {len(ranks) + 1} ranks")
        self.diloco.load_state_dict(s["diloco"])
        load_model_state(self.model, s["model"])
        load_optimizer_state(self.optimizer, s["optimizer"])
        objects = s.get("objects", {})
        for name, obj in self.objects.items():
            if name not in objects:
                raise KeyError(f"object {name!r} (registered now, not when it was saved)")
            obj.load_state_dict(objects[name])
        torch.set_rng_state(s["rng"])
        self.steps = int(s["steps"])
        self.steps_since_round = int(s["steps_since_round"])
        self.tokens_since_round = int(s["tokens_since_round"])
        self._global_step = int(s["global_step"])
        self.evidence = Evidence.from_state(s.get("evidence", {}))
        self.trial.load_state(s.get("probation"))

    def _restore_box(self, s: Mapping[str, Any], ranks: list[dict[str, Any]]) -> None:
        """Give each of the box's other ranks its part of a checkpoint: its own objects and
        RNG, and its shards (sharded) or rank 0's model and optimizer (replicated)."""
        assert self.box is not None
        parts: list[Any] = [None]
        for part in ranks:
            if not self.params.sharded:
                part = {**part, "model": s["model"], "optimizer": s["optimizer"]}
            parts.append(part)
        self.box.tell(Op.LOAD)
        self.box.scatter(parts)

    def _checkpoint(self, *, wait: bool = False, urgent: bool = False) -> None:
        """Checkpoint the state as it is now: only the copy happens here, the write on the
        writer's thread (see :meth:`CheckpointKeeper.save`); with ``wait``, until it is on
        disk."""
        self._collect_checkpoint(wait=wait)
        started = self.keeper.save(self._capture, round=self.round, step=self.steps, urgent=urgent)
        if started and wait:
            self._collect_checkpoint(wait=True)

    def _capture(self) -> dict[str, Any]:
        """What a checkpoint holds: this peer's whole state as it is now."""
        ranks: list[Any] = []
        if self.box is not None:
            self.box.tell(Op.SAVE)
            ranks = (self.box.gather(None) or [None])[1:]
        state = {
            "diloco": self.diloco.state_dict(),
            "model": local_state(self.model.state_dict()),
            "optimizer": local_state(self.optimizer.state_dict()),
            "objects": {name: obj.state_dict() for name, obj in self.objects.items()},
            "rng": torch.get_rng_state(),
            "steps": self.steps,
            "steps_since_round": self.steps_since_round,
            "tokens_since_round": self.tokens_since_round,
            "global_step": self._global_step,
            "evidence": self.evidence.to_state(),
        }
        if (probation := self.trial.to_state()) is not None:
            state["probation"] = probation
        if ranks:
            state["ranks"] = ranks  # the box's other ranks: their objects, RNG and shards
        return state

    def _collect_checkpoint(self, *, wait: bool = False) -> None:
        """Report a checkpoint written in the background once it is on disk, or a failed
        write (tried again later: see :meth:`CheckpointKeeper.collect`)."""
        failures = self.keeper.failures
        saved = self.keeper.collect(wait=wait, stopping=self._stop.is_set())
        self._saved(saved, failed=self.keeper.failures > failures)

    def _saved(self, saved: Saved | None, *, failed: bool) -> None:
        """Tell of a checkpoint on disk (``saved``) or a write that ``failed``."""
        if failed:
            self.last_error = self.keeper.error
        if saved is None:
            return
        self._remember_peers()
        if self.last_error.startswith("checkpoint failed"):
            self.last_error = ""
        self.snapshots.finish(wait=True)  # the round's event before its checkpoint's
        self._emit(
            "checkpoint",
            round=saved.round,
            step=saved.step,
            path=str(saved.path),
            bytes=saved.nbytes,
            seconds=round(saved.write_seconds, 3),
            copy_seconds=round(saved.copy_seconds, 3),
            verified=saved.verified,
        )

    # -- leaving ------------------------------------------------------------------------------

    def __exit__(self, exc_type: type[BaseException] | None, exc: Any, tb: Any) -> bool:
        stack, self._stack = self._stack, None
        if stack is None:
            return False
        interrupted = exc_type is not None and not issubclass(exc_type, (Exception, Stopped))
        try:
            if self._hook is not None:
                self._hook.remove()
                self._hook = None
            if exc_type is not None and issubclass(exc_type, Exception):
                self.stop(f"the training loop raised {exc_type.__name__}")
            box = self.box
            if box is not None and exc_type is not None and not issubclass(exc_type, Stopped):
                # The other ranks may be anywhere in the step (in a collective of the
                # model's own): nothing more is asked of them, and nothing is saved that
                # would need their shards. The last checkpoint on disk stands.
                box.broken = True
                self._consistent = False
            if box is not None and box.broken and self._inflight is not None:
                self._inflight.future.cancel()
                self._inflight = None
            if self._inflight is not None:
                if interrupted:
                    self._inflight.future.cancel()  # a second Ctrl-C: do not wait for it
                    self._inflight = None
                else:
                    self._land()
            self.snapshots.finish(wait=True)
            self.state = "stopping"
            if self.keeper.dirty and self._consistent:
                self._checkpoint(wait=True)
            self._collect_checkpoint(wait=True)
            if box is not None and not box.broken:
                box.tell(Op.EXIT)  # before lingering: the other ranks are done
            if self._run_over and not interrupted:
                self._linger()
        finally:
            wall = time.monotonic() - self._train_started if self._train_started else 0.0
            stack.close()
            self._emit(
                "stopped",
                round=self.round,
                step=self.steps,
                global_step=self.global_step,
                reason=self._stop_reason,
                # Time in inner steps over time since training started: what rounds cost.
                train_seconds=round(self.train_seconds, 3),
                wall_seconds=round(wall, 3),
            )
        return exc_type is not None and issubclass(exc_type, Stopped)

    # -- between two steps --------------------------------------------------------------------

    def step(self, tokens: int | None = None) -> None:
        """One optimizer step of the training loop happened (the hook calls this; with
        ``hook=False`` the loop does, after each ``optimizer.step()``). ``tokens``: what
        the step trained on (default: the config's ``tokens_per_step``; in a box, what
        the whole box trained on)."""
        if self._stack is None:
            raise SwarmlocoError("step() outside `with swarm:`")
        if self.box is None:
            self._step(tokens)
            return
        try:
            self._step(tokens)
        except Stopped:
            self._end_step(raised=True)
            raise
        except BaseException as exc:
            self._abort_box(exc)
            raise
        self._end_step()

    def _end_step(self, *, raised: bool = False) -> None:
        """Tell the box's other ranks that the step is over, and whether to stop."""
        assert self.box is not None
        self._told_stopping = self._stop.is_set()
        self.box.tell(Op.END, self.global_step, self.round, self._told_stopping, raised)

    def _step(self, tokens: int | None) -> None:
        started = time.monotonic()
        seconds = started - self._step_ended  # the user's step: forward, backward, update
        n = self.config.tokens_per_step if tokens is None else int(tokens)
        self.steps += 1
        self.steps_since_round += 1
        self.tokens_since_round += n
        self.diloco.trained(n)
        self._lr_sum += float(self.optimizer.param_groups[0]["lr"])
        self._lr_steps += 1
        self.keeper.dirty = True
        self.train_seconds += seconds
        # The rate others project this peer's tokens by: a whole cycle, this hook's own
        # time included (a few ms of pacing and bookkeeping weigh on steps of a few ms),
        # the rounds and downloads it waited for left out.
        self._rate.add(n, seconds + self._hook_s)
        self._advance_global()
        if self._stop.is_set():  # the loop stepped on after a stop: leave it here
            raise Stopped(self._stop_reason)
        self._between_steps()
        if self._resume_pending:
            self._resume_pending = False
            self._resumed_at = self._now()
        ended = time.monotonic()
        self._hook_s = max(0.0, ended - started - self._blocked_s)
        self._blocked_s = 0.0
        self._step_ended = ended

    @contextlib.contextmanager
    def _blocking(self) -> Iterator[None]:
        """Time spent on rounds and downloads between two steps, which the rate leaves out."""
        t0 = time.monotonic()
        try:
            yield
        finally:
            self._blocked_s += time.monotonic() - t0

    def _advance_global(self) -> None:
        pending = 1 if self._inflight is not None else 0
        swarm = int((self.round + pending) * self.h) + min(self.steps_since_round, int(self.h))
        self._global_step = max(self._global_step, swarm)

    def _between_steps(self) -> None:
        tau = self.spec_.delay
        while True:
            self.snapshots.finish()
            self._collect_checkpoint()
            if self.keeper.owed():
                self._checkpoint()
            if self._ends():
                return
            if self._inflight is not None:
                if self.steps - self._inflight.step >= tau:
                    with self._blocking():
                        self._land()  # the exchange overlapped tau steps: apply it now
                    continue
                return
            if self.trial.condemned is not None:
                with self._blocking():
                    self._roll_back(self.trial.condemned)
                return
            verdict = self._pace()
            if verdict is Verdict.BEHIND and time.monotonic() >= self._next_catch_up:
                # Others work on a later round. If its state is not to be had yet (digests
                # not published, donors busy), train on and look again later.
                with self._blocking():
                    self._catch_up()
                self._next_catch_up = time.monotonic() + _CATCH_UP_RETRY_S
                return
            if verdict is Verdict.DUE:
                with self._blocking():
                    self._start_round()
                if self._inflight is not None and tau == 0:
                    continue
            return

    def _ends(self) -> bool:
        """Whether the peer must stop now (and asks itself to)."""
        cfg, spec = self.config, self.spec_
        if cfg.max_rounds is not None and self.round >= cfg.max_rounds:
            self.stop(f"round {self.round} reached (max rounds {cfg.max_rounds})")
        elif spec.total_steps is not None and self.round * self.h >= spec.total_steps:
            # By rounds, not this peer's own steps: every peer stops after the same round.
            self._run_over = True
            self.stop(f"the run is over: round {self.round} reached {spec.total_steps} steps")
        elif spec.total_tokens is not None and self.diloco.tokens >= spec.total_tokens:
            self._run_over = True
            self.stop(f"the run is over: {self.diloco.tokens} of {spec.total_tokens} tokens")
        return self._stop.is_set()

    def _linger(self) -> None:
        """The run is over: stay a donor while other peers still work towards a round this
        one applied (a group of them may be short of members now, and can only finish by
        downloading the final state), for at most ``linger_s``."""
        if self.network is None or self.config.linger_s <= 0:
            return
        deadline = time.monotonic() + self.config.linger_s
        told = False
        while time.monotonic() < deadline:
            behind = {r.peer for r in self._fresh_reports(self._now()) if r.round <= self.round}
            if not behind:
                return
            if not told:
                told = True
                logger.info(
                    "the run is over; serving its final state to %d peer(s) still finishing "
                    "(at most %.0f s)",
                    len(behind),
                    self.config.linger_s,
                )
                self._emit("lingering", round=self.round, peers=len(behind))
            time.sleep(min(1.0, self.config.progress_interval_s / 2))  # reports come in

    def discard_local(self, why: str) -> None:
        """NaN or Inf in training: nothing of it may reach the swarm. Drop the local steps
        since the last round and the optimizer's moments (they hold the NaN too), restart
        from the global state; give up when it happens again and again. In a box, every
        rank calls it at the same point of the loop."""
        try:
            self._discard(why)
        except BaseException as exc:
            self._abort_box(exc)
            raise
        if self.box is not None:
            self._end_step()

    def _discard(self, why: str) -> None:
        if self.trial.probation is not None:
            # Training from a state on probation failed: the state is to blame, not the
            # data or the learning rate.
            self._roll_back(f"{why} after adopting it")
            return
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
        if self.box is not None:
            self.box.tell(Op.RESET)
        self.optimizer.state.clear()
        self._take_global()

    def _take_global(self) -> None:
        with self.params.view(None, read=False, write=True) as whole:
            self.diloco.take_global(whole)
        self.steps_since_round = 0
        self.tokens_since_round = 0
        self._lr_sum, self._lr_steps = 0.0, 0
        self._counting_since = self._resumed_at = None

    # -- pacing -------------------------------------------------------------------------------

    def _now(self) -> float:
        """The swarm's time (this machine's clock corrected to the peers' it joined
        through): what progress reports and records are dated and judged by."""
        return self.network.node.dht.clock() if self.network is not None else time.time()

    def _fresh_reports(self, now: float) -> list[ProgressReport]:
        assert self.network is not None
        clock = time.monotonic()
        fresh = max(_FRESH_MIN_S, _FRESH_REPORTS * self.config.progress_interval_s)
        target = self.round + 1
        return [
            r
            for r in self.network.reports
            if r.peer != self.peer_id
            and now - r.at <= fresh
            and not (r.round > target + 1 and self.trial.unbacked.get(r.peer, 0.0) > clock)
        ]

    def _pace(self) -> Verdict:
        """Whether to average now (DESIGN section 3, "When a round is due").

        The round is due when the peers working on it have together processed as many
        tokens as each doing H / F steps: a fast peer trains on past its steps while slower
        ones catch up (and so contributes more tokens, and weight), a slow one joins early,
        and they arrive at matchmaking together. Alone, a peer averages (with itself) every
        H / F steps. It never waits past ``4 H / F`` steps for peers whose reports promise
        more.
        """
        h = self.h
        if self.steps_since_round == 0:
            return Verdict.WAIT
        if self.steps_since_round >= _MAX_WAIT_ROUNDS * h:
            return Verdict.DUE
        assert self.network is not None
        if self.network.reads < 2 and not self._read_twice:
            if self.steps_since_round < h:
                return Verdict.WAIT
            self._wait_for_a_second_read()
        now = self._now()
        target = self.round + 1
        mine = ProgressReport(
            peer=self.peer_id,
            round=target,
            tokens=self.tokens_since_round,
            tokens_per_s=self._rate.value,
            at=now,
        )
        everyone = self._fresh_reports(now)
        # Keys cost nothing: once this peer has partners (peers it averaged with lately)
        # and hears from any of them, only their reports decide when a round is due, that
        # it is behind, or that the round started; strangers' reports count again when
        # every partner is silent (this peer is on its own).
        partners = self.evidence.witnesses
        heard = [r for r in everyone if r.peer in partners]
        reports = heard if heard else everyone
        working = 1 + len({r.peer for r in reports if r.round == target})
        self._expected = self._expect(everyone, partners if heard else None, target)
        if any(r.round > target + 1 for r in reports):
            return Verdict.BEHIND  # others applied rounds this peer has not
        if self._late is not None and self._still_late(target):
            return Verdict.BEHIND  # this round's group formed without us: fetch its result
        if any(r.round == target + 1 for r in reports) and self.steps_since_round >= h / 4:
            # Someone started this round already: join it now, with what we have, rather
            # than fall a gathering window out of step with it (not before a quarter of
            # the round's steps: a liar cannot make rounds much more frequent).
            return Verdict.DUE
        tokens_per_step = max(1, self.tokens_since_round // max(1, self.steps_since_round))
        config = PacingConfig(tokens_per_round=max(1, round(working * h * tokens_per_step)))
        verdict = estimate(
            [mine, *reports],
            round=target,
            now=now,
            config=config,
            trusted=self.peer_id,
            since=self._counting_since,
            resumed=self._resumed_at,
        ).verdict
        if verdict is Verdict.STALLED:  # cannot happen with our own fresh rate; be safe
            return Verdict.DUE if self.steps_since_round >= h else Verdict.WAIT
        return verdict

    def _wait_for_a_second_read(self) -> None:
        """Just joined: peers that started with this one may not have reported yet (a
        report interval apart), and one that decides it is alone now splits the first
        round. Once due by its own count, the training thread waits (once, briefly) for a
        second read: training on instead would make a lone peer's first round as long as
        the network is slow, and its result depend on timing."""
        assert self.network is not None
        self._read_twice = True
        self.loop.loop.call_soon_threadsafe(self.network.wake)
        with self._blocking():
            read = self.network.wait_for_reads(2, 2 * self.config.progress_interval_s + 1.0)
        if not read:
            logger.info("no second read of the progress records: deciding on what we have")

    def _expect(
        self, everyone: list[ProgressReport], partners: Collection[str] | None, target: int
    ) -> tuple[int, int]:
        """(peers matchmaking waits for, this one included; strangers worth a short wait
        besides) for round ``target``, from the reports and, when any partner is heard
        (``partners``), from theirs alone.

        Matchmaking waits for the peers of this round: those whose report names it, the
        round before (they applied it with us and have not reported since) or the round
        after (they started this one: it is in flight on their side). Counting too many
        costs a gathering window, too few a group split in two. A few newcomers are waited
        for besides partners, not a crowd of keys, and only for a short grace once the
        partners are in (``stranger_grace_s``): anyone can claim progress."""
        assert self.network is not None
        near = {r.peer for r in everyone if target - 1 <= r.round <= target + 1}
        known = {p for p in near if p in partners} if partners is not None else near
        expected = 1 + len(known)
        if self._last_group is not None and self._last_group[0] == self.round:
            # Who averaged the last round with us will most likely average this one too,
            # even when their reports lag a round behind; not those that said goodbye.
            left = {r.peer for r in self.network.reports if is_farewell(r)}
            expected = max(expected, 1 + len(self._last_group[1] - left))
        return expected, min(len(near - known), _EXPECTED_STRANGERS)

    def _still_late(self, target: int) -> bool:
        """Whether this peer still waits for the result of round ``target``'s group that
        formed without it (until its deadline, or until that group aborts)."""
        assert self._late is not None and self.network is not None
        late_round, until = self._late
        if late_round != target or time.monotonic() >= until:
            self._end_late_wait()
            return False
        if self.network.late_group_aborted(target):
            logger.info("round %d: the group that formed without us aborted", target)
            self._end_late_wait()
            return False
        return True

    def _end_late_wait(self) -> None:
        self._late = None
        assert self.network is not None
        self.network.late = None

    # -- catching up ----------------------------------------------------------------------------

    def _catch_up(self) -> None:
        """Download the swarm's state if this peer's is older or in the minority, on the
        evidence ``runtime/catchup.py`` asks for.

        Peers that claim later rounds no adoptable state backs (liars, or a lone peer ahead
        of everyone) are left out of pacing for a while instead of stalling this one, and
        the holders of a state refused after its download for longer.
        """
        assert self.network is not None
        self.snapshots.finish(wait=True)  # this peer's own digest of its last round
        current = self.snapshots.current
        assert current is not None
        try:
            found = self.loop.run(
                self.network.catchup.find(
                    round=self.round,
                    digest=current.digest if self.round > 0 else None,
                    reference=self._reference(),
                    distrusted=self.trial.distrusted_now(time.monotonic()),
                    distrusted_digests=frozenset(self.trial.distrusted_digests),
                    peak_lr=self._peak_lr,
                ),
                timeout=self.config.catchup.state_timeout_s + 30.0,
            )
        except (SwarmlocoError, TimeoutError) as exc:
            logger.warning("could not catch up with the swarm: %s", exc)
            return
        self.trial.heard(unbacked=found.unbacked, distrusted=found.distrusted, now=time.monotonic())
        for refusal in found.refused:
            if self.trial.first_refusal(refusal.round, refusal.digest):
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
            checked = {
                "distance": found.distance,
                "bound": found.bound,
                "momentum": found.momentum,
                "momentum_bound": found.momentum_bound,
            }
            self._take(found.adopted, found.why, checked, holders=found.adopted_holders)

    def _reference(self) -> Reference:
        """This peer's own global state, which a downloaded one is checked against."""
        spec = self.spec_
        return Reference(
            theta_g=self.diloco.theta_g,
            momentum=self.diloco.momentum if self.round > 0 else None,
            tokens=self.diloco.tokens,
            outer_lr=spec.outer_lr,
            outer_momentum=spec.outer_momentum,
            fragments=self.diloco.fragments,
            group_cap=self.config.matchmaking.max_group_size,
        )

    def _peak_lr(self, rounds: int) -> float | None:
        """The highest inner learning rate over the next ``rounds`` rounds of the schedule
        (:attr:`lr_at`, sampled), or the current one when the schedule is not known."""
        lr_at = self.lr_at
        if lr_at is None:
            current = float(self.optimizer.param_groups[0]["lr"])
            return current if current > 0 else None
        start = self.global_step
        span = max(1, int(rounds * self.h))
        samples = min(span, 256)
        try:
            return max(lr_at(start + span * i // samples) for i in range(samples + 1))
        except Exception as exc:  # the user's schedule; a bound from the current lr instead
            logger.warning("the learning-rate schedule failed (%s): using the current lr", exc)
            self.lr_at = None
            return self._peak_lr(rounds)

    def _take(
        self,
        got: DownloadedState,
        why: str,
        checked: dict[str, Any] | None = None,
        *,
        holders: tuple[str, ...] | None = None,
    ) -> None:
        """Make a downloaded state this peer's global state (and local parameters);
        ``checked``: how far it lay from this peer's and the bound it met (for the event).
        ``holders``: who vouched for it; the state is then on probation (None: a state
        checked against the manifest, the run's initial one)."""
        snap = got.snapshot
        if holders is not None and self.config.catchup.adoption.probation_rounds > 0:
            self.snapshots.finish(wait=True)
            assert self.snapshots.current is not None
            self.trial.adopt(snap, holders, own=self.snapshots.current)
            self.keeper.verified = False  # its checkpoints never replace the verified one
        self.diloco.adopt(snap)
        self._take_global()
        self._global_step = max(self._global_step, int(self.round * self.h))
        self.snapshots.publish(self.round, self.diloco.committed(), snap.digest)
        self.evidence.adopted(time.time())
        self.downloads += 1
        self.keeper.dirty = True
        if self.config.checkpoint_every:
            self._checkpoint(urgent=True)  # what was downloaded is not lost to a crash
        logger.info("took the swarm's state of round %d from %s: %s", self.round, got.donor, why)
        self._emit(
            "downloaded",
            round=self.round,
            global_step=self.global_step,
            donor=str(got.donor),
            bytes=snap.nbytes,
            seconds=round(got.seconds, 3),
            why=why,
            digest=snap.digest.hex(),
            **(checked or {}),
        )

    def _roll_back(self, why: str) -> None:
        """Training from the adopted state on probation went wrong (``why``): return to the
        last state this peer trained and verified itself, drop the local work since, and
        never take that state, nor anything from its holders for a while, again."""
        ended = self.trial.roll_back(time.monotonic())
        if ended is None:
            return
        probation, verified = ended
        self.keeper.verified = True
        logger.error(
            "rolling back the state of round %d (digest %s) adopted from %d peer(s): %s. "
            "Back to this peer's own state of round %d; that state is never taken again, "
            "nor another from its holders for a minute",
            probation.round,
            probation.digest.hex()[:12],
            len(probation.holders),
            why,
            verified.round,
        )
        if self.box is not None:
            self.box.tell(Op.RESET)
        self.optimizer.state.clear()  # its moments came from the condemned state
        self.diloco.adopt(verified)
        self._global_step = int(self.round * self.h)
        self._take_global()
        self.snapshots.publish(self.round, self.diloco.committed(), verified.digest)
        self.last_error = f"rolled back an adopted state of round {probation.round}: {why}"
        self.keeper.dirty = True
        self._emit(
            "rolled-back",
            round=self.round,
            adopted_round=probation.round,
            digest=probation.digest.hex(),
            holders=len(probation.holders),
            why=why,
        )
        if self.config.checkpoint_every:
            self._checkpoint(urgent=True)

    # -- one round ------------------------------------------------------------------------------

    def _start_round(self) -> None:
        """Start averaging the next round's fragment; training goes on while it runs."""
        assert self.network is not None
        self._catch_up()
        if self.steps_since_round == 0:
            return  # the download replaced this peer's work with the swarm's state
        target = self.round + 1
        f = fragment_of_round(target, self.diloco.fragments)
        with self.params.view(f, read=True) as whole:
            delta = self.diloco.delta(f, whole)
        if not bool(torch.isfinite(delta).all()):
            self._discard("the local model holds NaN/Inf")
            return
        weight = float(self.diloco.fragment_tokens[f])
        self.state = "averaging"
        feedback = self.diloco.feedback[f] if self.diloco.feedback else None
        expected, strangers = self._expected or (None, 0)
        future = self.loop.submit(
            self.network.average(
                target,
                delta,
                self.diloco.means[f],
                weight=weight,
                expected=expected,
                strangers=strangers,
                error_feedback=feedback,
            )
        )
        self._inflight = _Exchange(target, f, future, self.steps, time.monotonic(), weight)
        self.loop.loop.call_soon_threadsafe(self.network.wake)
        # What trains from now on counts towards the next round.
        self.steps_since_round = 0
        self.tokens_since_round = 0
        # Swarm time, as reports are dated. Training goes on through the exchange only
        # when it overlaps (delay > 0); else it resumes when the round lands (_land).
        self._counting_since = self._resumed_at = self._now()

    def _land(self) -> None:
        """Wait for the exchange in flight; apply its outer step, or count it as aborted."""
        x = self._inflight
        assert x is not None and self.network is not None
        self._inflight = None
        try:
            try:
                outcome = x.future.result(timeout=self.config.round_timeout_s + 10.0)
            finally:
                # Without overlap nobody of the group trained meanwhile: their tokens count
                # again from when the loop resumes (after the outer step and evaluation).
                self._resume_pending = self.spec_.delay == 0
            if not bool(torch.isfinite(self.diloco.means[x.fragment]).all()):
                raise RoundAborted(f"round {x.round}: the group's mean is not finite")
        except Exception as exc:  # whatever the others sent: the round fails, never the peer
            self._aborted(x, exc)
            return
        self.state = "training"
        f = x.fragment
        report, matchmaking = outcome.result.report, outcome.matchmaking_s
        self._consistent = False
        movement = self.diloco.apply(f, x.round, weight=x.weight, group_tokens=outcome.group_tokens)
        alpha = self.spec_.streaming.alpha
        with self.params.view(f, read=alpha != 0.0, write=True) as whole:
            self.diloco.land(f, whole, alpha)
        self._consistent = True
        self._advance_global()
        self._weigh(x, report.members, movement, outcome.group_tokens)
        event: dict[str, Any] = {}  # filled in below; emitted once the digest is known

        def hashed(digest: bytes) -> None:
            assert self.network is not None
            self.loop.submit(self.network.publish_digest(event["round"], digest))
            self._emit("round", **event, digest=digest.hex())

        self.snapshots.hash_later(self.round, self.diloco.committed(), hashed)
        self.rounds_applied += 1
        self._nan_in_a_row = 0  # a round made it: training works from this state
        self._last_group = (x.round, frozenset(report.members) - {self.peer_id})
        self.loop.loop.call_soon_threadsafe(self.network.wake)
        # The round's own time (matchmaking and exchange): the same figure in the event, the
        # log and the status record, without the evaluation below.
        seconds = time.monotonic() - x.started
        self.sheet.remember(
            round=x.round,
            group=len(report.members),
            seconds=seconds,
            payload_bytes=4 * self.diloco.deltas[f].numel(),
            bytes_sent=report.bytes_sent,
            bytes_received=report.bytes_received,
            ok=True,
            matchmaking_s=matchmaking,
        )
        eval_loss = None
        if (
            self.evaluate is not None
            and self.config.eval_every
            and (self.round % self.config.eval_every == 0)
        ):
            eval_loss = self.last_eval = float(self.evaluate())
        self._round_s = seconds
        event.update(self._round_event(x, report, seconds, matchmaking, eval_loss))
        logger.info(
            "round %d (fragment %d) applied with %d peer(s) in %.2fs: train loss %.3f%s",
            self.round,
            f,
            len(report.members),
            seconds,
            self.last_loss,
            f", eval loss {eval_loss:.3f}" if eval_loss is not None else "",
        )
        if self.config.checkpoint_every and self.round % self.config.checkpoint_every == 0:
            self._checkpoint()

    def _aborted(self, x: _Exchange, exc: BaseException) -> None:
        """The exchange ``x`` failed (``exc``): nothing applied, the round counted as
        aborted; a peer late for a group that formed without it waits for its result."""
        assert self.network is not None
        if not isinstance(exc, _ROUND_FAILURES):
            logger.error("round %d failed on an unexpected error", x.round, exc_info=exc)
        x.future.cancel()
        self.state = "training"
        if not (isinstance(exc, RoundAborted) and exc.late):
            # (Late for a group that formed without it: a healthy peer's routine, not an
            # error the dashboard should show; it takes the group's result instead.)
            self.last_error = f"round {x.round} aborted: {exc}"
        self.sheet.remember(
            round=x.round,
            group=0,
            seconds=time.monotonic() - x.started,
            payload_bytes=4 * self.diloco.deltas[x.fragment].numel(),
            ok=False,
        )
        # Nothing applied: the fragment's delta keeps growing and the next attempt
        # carries all of it.
        self.rounds_aborted += 1
        self._last_group = None  # those we expected did not come
        if isinstance(exc, RoundAborted) and exc.late:
            # The others average this round without us: take their result once it is
            # published. Wait about as long as their round takes (a gathering window
            # and the exchange, twice over), then try the round again as usual.
            wait = 2 * (self.config.matchmaking.gather_s + self._round_s)
            self._late = (x.round, time.monotonic() + min(wait, self.config.round_timeout_s))
            # Unless that group aborts: its members then announce the round again.
            self.network.late = (x.round, self.diloco.means[x.fragment].numel())
            self.loop.loop.call_soon_threadsafe(self.network.wake)
        logger.warning("round %d aborted: %s", x.round, exc)
        self._emit(
            "aborted",
            round=x.round,
            fragment=x.fragment,
            error=f"{type(exc).__name__}: {exc}",
            seconds=round(time.monotonic() - x.started, 3),
        )

    def _weigh(
        self, x: _Exchange, members: Sequence[str], movement: float, group_tokens: int
    ) -> None:
        """Count the applied round as evidence for adoption, and end a probation it
        completes."""
        lr = self._lr_sum / self._lr_steps if self._lr_steps else None
        self._lr_sum, self._lr_steps = 0.0, 0
        grouped = len(members) >= 2
        adoption = self.config.catchup.adoption
        self.evidence.applied(
            movement,
            time.time(),
            alone=not grouped,
            lr=lr,
            update=float(torch.linalg.vector_norm(self.diloco.means[x.fragment])),
            tokens=group_tokens,
        )
        self.evidence.grouped(x.round, members, self.peer_id, adoption)
        if (passed := self.trial.applied(grouped)) is not None:
            logger.info(
                "the state adopted at round %d passed its probation (%d round(s) averaged "
                "with others since): it is this peer's own now",
                passed.round,
                passed.rounds,
            )
            self.keeper.verified = True

    def _round_event(
        self,
        x: _Exchange,
        report: AllReduceReport,
        seconds: float,
        matchmaking: float,
        eval_loss: float | None,
    ) -> dict[str, Any]:
        """The fields of an applied round's event (its digest comes once it is hashed)."""
        return {
            "round": self.round,
            "fragment": x.fragment,
            "step": self.steps,
            "global_step": self.global_step,
            "overlap_steps": self.steps - x.step,
            "group": len(report.members),
            "weight": x.weight,
            "lr": float(self.optimizer.param_groups[0]["lr"]),
            "loss": self.last_loss,
            "eval_loss": eval_loss,
            "bytes_sent": report.bytes_sent,
            "seconds": round(seconds, 3),
            "matchmaking_seconds": round(matchmaking, 3),
            # The training loop's own time so far (the share of wall time it trains,
            # between any two rounds, is the difference of this over that of "time").
            "train_seconds": round(self.train_seconds, 3),
            "excluded": sorted(report.excluded),
            "rejections": dict(report.rejections),
            "clipped": report.clipped,
        }

    # -- records ----------------------------------------------------------------------------

    def describe_compute(
        self,
        *,
        fit: str = "",
        flops_per_token: float | None = None,
        peak_flops: float | None = None,
    ) -> None:
        """What the dashboard shows of this peer's compute: how its step fits the device
        (``fit``, a few words), and its model FLOPs utilisation, from the training FLOPs of
        a token and the device's peak (both needed; the rate is the peer's own)."""
        self.sheet.describe_compute(fit=fit, flops_per_token=flops_per_token, peak_flops=peak_flops)

    def _progress_value(self) -> dict[str, Any]:
        # The round this peer's new tokens count towards: while round r is in flight,
        # r + 1 (its tokens since r started are the next round's).
        return {
            "round": self.round + 1 + (self._inflight is not None),
            "tokens": self.tokens_since_round,
            "tokens_per_s": self._rate.value,
            "at": self._now(),
        }

    def _status_value(self) -> dict[str, Any]:
        return self.sheet.value(
            Counters(
                state=self.state,
                round=self.round,
                step=self.steps,
                tokens=self.steps * self.config.tokens_per_step,
                tokens_per_s=self._rate.value,
                rounds_applied=self.rounds_applied,
                rounds_aborted=self.rounds_aborted,
                downloads=self.downloads,
                last_error=self.last_error,
                loss=self.last_loss,
                eval_loss=self.last_eval,
                at=self._now(),
            )
        )


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


class _Rate:
    """Tokens per second over the recent steps: exponential averages of the tokens and of
    the seconds, divided (an average of each step's rate would be biased up when step times
    vary: one step of 1 ms and one of 9 ms make 2 steps in 10 ms, not 5.6 ms a step)."""

    def __init__(self) -> None:
        self.value = 0.0
        self._tokens = self._seconds = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        if seconds <= 0 or not math.isfinite(seconds):
            return
        if self._seconds == 0.0:
            self._tokens, self._seconds = float(tokens), seconds
        else:
            self._tokens = 0.9 * self._tokens + 0.1 * tokens
            self._seconds = 0.9 * self._seconds + 0.1 * seconds
        self.value = self._tokens / self._seconds


def _write_manifest_copy(path: Path, manifest: SwarmManifest) -> None:
    """Keep the manifest beside the checkpoints (atomic: a torn copy never replaces one)."""
    data = manifest.to_bytes()
    if path.exists() and path.read_bytes() == data:
        return
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)
