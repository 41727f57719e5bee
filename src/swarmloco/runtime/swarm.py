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
import socket
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from swarmloco.core.adoption import Evidence
from swarmloco.core.codec import warm_up
from swarmloco.core.manifest import SwarmManifest
from swarmloco.core.pacing import Verdict
from swarmloco.core.runspec import RunSpec
from swarmloco.core.signature import (
    ModelSignature,
    parameters_in_order,
    params_of,
)
from swarmloco.core.state import THETA_G, StateSnapshot, state_digest
from swarmloco.errors import (
    ModelMismatch,
    Stopped,
    SwarmlocoError,
)
from swarmloco.net.admission import Gate
from swarmloco.net.identity import Identity
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
from swarmloco.runtime.follow import Follower
from swarmloco.runtime.keeper import CheckpointKeeper
from swarmloco.runtime.loop_thread import LoopThread
from swarmloco.runtime.network import SwarmNetwork, averaging_config, peer_codec
from swarmloco.runtime.pacer import Pacer
from swarmloco.runtime.parts import PeerParts
from swarmloco.runtime.progress import LocalProgress
from swarmloco.runtime.rounds import RoundDriver
from swarmloco.runtime.session import REMEMBER, Session, handle_signals
from swarmloco.runtime.snapshots import Snapshots
from swarmloco.runtime.status import Counters, StatusSheet
from swarmloco.runtime.trial import Trial
from swarmloco.train.diloco import DilocoState

logger = logging.getLogger(__name__)

EventSink = Callable[[dict[str, Any]], None]
Evaluator = Callable[[], float]

_PEERS_POLL_S = 0.5  # how long wait_for_peers waits for a read of the records at most
_MAX_DISCARDS = 3  # NaN/Inf restarts without a round in between before the peer gives up


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
        self.started_at = time.time()
        self.sheet = StatusSheet(
            # Several peers on one host (or in containers named alike) stay apart.
            name=config.name or f"{socket.gethostname()[:50]}/{self.peer_id[:6]}",
            device="",  # known once the swarm is entered
            started_at=self.started_at,
        )
        self.progress = LocalProgress()
        self.evidence = Evidence()
        self.trial = Trial(config.catchup.adoption)
        """The adopted state on trial, its fallback, and whom this peer no longer believes."""
        self.lr_at: Callable[[int], float] | None = None
        """The inner learning rate at a global step, when the loop follows a schedule
        (:meth:`lr_lambda` and :meth:`scheduler` set it; a loop that sets its optimizer's
        learning rate itself may too). A peer behind the swarm uses it to judge how far the
        rounds it missed can have moved the global state; without it, it assumes the
        current learning rate held."""
        self.admission: Gate | None = None
        """The swarm's gate, once entered: a private swarm's certificates, or a public
        run's proofs of work (None: an open run)."""
        # Built on enter, around the parts they share (see _collaborators).
        self.parts: PeerParts | None = None
        self.pacer: Pacer | None = None
        self.rounds: RoundDriver | None = None
        self.follower: Follower | None = None
        self._told_stopping = False
        self._stop = threading.Event()
        self._run_over = False  # the run reached its end here (not just this peer stopping)
        self._stop_reason = ""
        self._stack: contextlib.ExitStack | None = None
        self._consistent = True  # False once the model may not be whole (a box rank failed)
        self._nan_in_a_row = 0
        self._train_started = 0.0
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
        return self.progress.global_step

    @property
    def steps(self) -> int:
        """This peer's own optimizer steps (counted across restarts)."""
        return self.progress.steps

    @property
    def state(self) -> str:
        """In a word: starting, training, averaging, stopping."""
        return self.sheet.state

    @property
    def last_error(self) -> str:
        """What last went wrong (shown on the dashboard), "" once set right."""
        return self.sheet.last_error

    @property
    def rounds_applied(self) -> int:
        return self.rounds.applied if self.rounds is not None else 0

    @property
    def rounds_aborted(self) -> int:
        return self.rounds.aborted if self.rounds is not None else 0

    @property
    def downloads(self) -> int:
        return self.follower.downloads if self.follower is not None else 0

    @property
    def last_eval(self) -> float | None:
        """The global model's loss at the last evaluation (``evaluate``), if any."""
        return self.rounds.last_eval if self.rounds is not None else None

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
        self.progress.loss = float(loss)
        self.trial.loss(self.progress.loss)

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
        if self._stack is None or self.network is None or self.pacer is None:
            raise SwarmlocoError("wait_for_peers() inside `with swarm:`")
        network, pacer = self.network, self.pacer
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
            found = 1 + len({r.peer for r in pacer.fresh_reports(self.round)})
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
        self._spec = spec
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
        follower = self._start_network(stack, spec)
        self._train_started = time.monotonic()
        follower.catch_up()
        if not own_initial and self.round == 0:
            follower.fetch_initial(self.signature.init_digest, spec.seed)
        self._follow_schedules()
        if cfg.hook:
            self._hook = self.optimizer.register_step_post_hook(lambda *_: self.step())
            stack.callback(self._hook.remove)
        self.sheet.state = "training"
        self.progress.step_ended = time.monotonic()
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

    def _start_network(self, stack: contextlib.ExitStack, spec: RunSpec) -> Follower:
        """Start networking, with the collaborators that need it (the network reads this
        peer's progress as soon as it runs): returns the follower, for the catch-up."""
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
        follower = self._collaborators(network, spec)
        network.catchup.evidence = self.evidence
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
            self.sheet.last_error = (
                f"clock {abs(skew):.0f} s {where} the swarm's (kept in step with it): set it "
                "right (NTP)"
            )
        return follower

    def _collaborators(self, network: SwarmNetwork, spec: RunSpec) -> Follower:
        """The pacer, the round driver and the follower, around the parts they share."""
        parts = PeerParts(
            config=self.config,
            spec=spec,
            peer_id=self.peer_id,
            loop=self.loop,
            network=network,
            diloco=self.diloco,
            params=self.params,
            snapshots=self.snapshots,
            progress=self.progress,
            evidence=self.evidence,
            trial=self.trial,
            keeper=self.keeper,
            sheet=self.sheet,
            box=self.box,
            emit=self._emit,
        )
        self.parts = parts
        self.pacer = Pacer(
            network=network,
            loop=self.loop,
            config=self.config,
            peer_id=self.peer_id,
            h=spec.steps_per_round,
            progress=self.progress,
            evidence=self.evidence,
            unbacked=self.trial.unbacked,
            now=parts.now,
        )
        self.rounds = RoundDriver(
            parts,
            self.pacer,
            evaluate=self.evaluate,
            lr=lambda: float(self.optimizer.param_groups[0]["lr"]),
        )
        self.follower = Follower(
            parts,
            peak_lr=self._peak_lr,
            reset_optimizer=self._reset_optimizer,
            checkpoint=self._urgent_checkpoint,
        )
        return self.follower

    def _leave_network(self) -> None:
        assert self.network is not None
        self._remember_peers()
        with contextlib.suppress(Exception):
            self.loop.run(self.network.__aexit__(None, None, None), timeout=30.0)

    # -- checkpoints --------------------------------------------------------------------------

    def _restore(self, *, verified: bool | None = None) -> bool:
        """Resume from the newest checkpoint that loads and fits this peer (with
        ``verified=True``, the newest whose global state this peer trained and checked
        itself); False when there is none (see :class:`CheckpointKeeper`)."""
        found = self.keeper.resume(self._load_checkpoint, verified=verified)
        if found is None:
            if self.keeper.error:
                self.sheet.last_error = self.keeper.error
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
        self.progress.load_state_dict(s)
        self.evidence.load_state(s.get("evidence", {}))
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

    def _urgent_checkpoint(self) -> None:
        """What was downloaded or rolled back to is not lost to a crash."""
        if self.config.checkpoint_every:
            self._checkpoint(urgent=True)

    def _reset_optimizer(self) -> None:
        """Clear the inner optimizer's moments (every rank's): they came from a state
        this peer no longer trains from."""
        if self.box is not None:
            self.box.tell(Op.RESET)
        self.optimizer.state.clear()

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
            **self.progress.state_dict(),
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
            self.sheet.last_error = self.keeper.error
        if saved is None:
            return
        self._remember_peers()
        if self.sheet.last_error.startswith("checkpoint failed"):
            self.sheet.last_error = ""
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
            self._leave(exc_type, interrupted)
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
                train_seconds=round(self.progress.train_seconds, 3),
                wall_seconds=round(wall, 3),
            )
        return exc_type is not None and issubclass(exc_type, Stopped)

    def _leave(self, exc_type: type[BaseException] | None, interrupted: bool) -> None:
        """Land the round in flight (unless interrupted again, or a box rank failed), write
        the last checkpoint, and stay a donor a while if the run is over."""
        rounds, box = self.rounds, self.box
        assert rounds is not None
        if box is not None and exc_type is not None and not issubclass(exc_type, Stopped):
            # The other ranks may be anywhere in the step (in a collective of the model's
            # own): nothing more is asked of them, and nothing is saved that would need
            # their shards. The last checkpoint on disk stands.
            box.broken = True
            self._consistent = False
        if interrupted or (box is not None and box.broken):
            rounds.cancel()  # a second Ctrl-C: do not wait for it
        elif rounds.inflight is not None:
            self._land()
        self.snapshots.finish(wait=True)
        self.sheet.state = "stopping"
        if self.keeper.dirty and self._consistent and rounds.consistent:
            self._checkpoint(wait=True)
        self._collect_checkpoint(wait=True)
        if box is not None and not box.broken:
            box.tell(Op.EXIT)  # before lingering: the other ranks are done
        if self._run_over and not interrupted:
            self._linger()

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
        assert self.rounds is not None and self.parts is not None
        started = time.monotonic()
        n = self.config.tokens_per_step if tokens is None else int(tokens)
        self.progress.stepped(n, float(self.optimizer.param_groups[0]["lr"]), now=started)
        self.diloco.trained(n)
        self.keeper.dirty = True
        self.progress.advance(self.round + (self.rounds.inflight is not None), self.h)
        if self._stop.is_set():  # the loop stepped on after a stop: leave it here
            raise Stopped(self._stop_reason)
        self._between_steps()
        self.progress.hook_ended(started, self.parts.now)

    def _between_steps(self) -> None:
        """The swarm's work between two steps, in order: land the round in flight once it
        overlapped ``tau`` steps, roll back a condemned adopted state, catch up when others
        are on later rounds, start the next round when it is due."""
        assert self.rounds is not None and self.pacer is not None and self.follower is not None
        rounds, follower, progress = self.rounds, self.follower, self.progress
        tau = self._spec.delay
        while True:
            self.snapshots.finish()
            self._collect_checkpoint()
            if self.keeper.owed():
                self._checkpoint()
            if self._ends():
                return
            if rounds.inflight is not None:
                if progress.steps - rounds.inflight.step >= tau:
                    with progress.blocking():
                        self._land()  # the exchange overlapped tau steps: apply it now
                    continue
                return
            if self.trial.condemned is not None:
                with progress.blocking():
                    follower.roll_back(self.trial.condemned)
                return
            verdict = self.pacer.verdict(self.round)
            if verdict is Verdict.BEHIND and follower.may_look():
                # Others work on a later round. If its state is not to be had yet (digests
                # not published, donors busy), train on and look again later.
                with progress.blocking():
                    follower.catch_up()
                follower.looked()
                return
            if verdict is Verdict.DUE:
                with progress.blocking():
                    self._start_round()
                if rounds.inflight is not None and tau == 0:
                    continue
            return

    def _start_round(self) -> None:
        """Catch up first (this peer's state must be the swarm's), then start averaging the
        next round's fragment; training goes on while it runs."""
        assert self.rounds is not None and self.follower is not None
        self.follower.catch_up()
        if self.progress.steps_since_round == 0:
            return  # the download replaced this peer's work with the swarm's state
        if not self.rounds.start():
            self._discard("the local model holds NaN/Inf")

    def _land(self) -> None:
        """Apply the round in flight (or count it aborted); checkpoint every so often."""
        assert self.rounds is not None
        if not self.rounds.land():
            return
        self._nan_in_a_row = 0  # a round made it: training works from this state
        every = self.config.checkpoint_every
        if every and self.round % every == 0:
            self._checkpoint()

    def _ends(self) -> bool:
        """Whether the peer must stop now (and asks itself to)."""
        cfg, spec = self.config, self._spec
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
        if self.pacer is None or self.config.linger_s <= 0:
            return
        deadline = time.monotonic() + self.config.linger_s
        told = False
        while time.monotonic() < deadline:
            reports = self.pacer.fresh_reports(self.round)
            behind = {r.peer for r in reports if r.round <= self.round}
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
        assert self.follower is not None
        if self.trial.probation is not None:
            # Training from a state on probation failed: the state is to blame, not the
            # data or the learning rate.
            self.follower.roll_back(f"{why} after adopting it")
            return
        self._nan_in_a_row += 1
        logger.error(
            "%s after %d local steps: discarding them and restarting from the global state "
            "of round %d (%d time(s) since a round last succeeded)",
            why,
            self.progress.steps_since_round,
            self.round,
            self._nan_in_a_row,
        )
        self._emit("discarded", round=self.round, steps=self.progress.steps_since_round, why=why)
        if self._nan_in_a_row > _MAX_DISCARDS:
            raise SwarmlocoError(
                f"training produced NaN/Inf {self._nan_in_a_row} times from the swarm's global "
                "state without completing a round; check the data and the learning rate (or "
                "try --compile off) before joining again"
            )
        self._reset_optimizer()
        self.follower.restart_from_global()

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
        assert self.rounds is not None and self.parts is not None
        # The round this peer's new tokens count towards: while round r is in flight,
        # r + 1 (its tokens since r started are the next round's).
        return {
            "round": self.round + 1 + (self.rounds.inflight is not None),
            "tokens": self.progress.tokens_since_round,
            "tokens_per_s": self.progress.rate.value,
            "at": self.parts.now(),
        }

    def _status_value(self) -> dict[str, Any]:
        assert self.parts is not None
        return self.sheet.value(
            Counters(
                round=self.round,
                step=self.steps,
                tokens=self.steps * self.config.tokens_per_step,
                tokens_per_s=self.progress.rate.value,
                rounds_applied=self.rounds_applied,
                rounds_aborted=self.rounds_aborted,
                downloads=self.downloads,
                loss=self.progress.loss,
                eval_loss=self.last_eval,
                at=self.parts.now(),
            )
        )


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


def _write_manifest_copy(path: Path, manifest: SwarmManifest) -> None:
    """Keep the manifest beside the checkpoints (atomic: a torn copy never replaces one)."""
    data = manifest.to_bytes()
    if path.exists() and path.read_bytes() == data:
        return
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)
