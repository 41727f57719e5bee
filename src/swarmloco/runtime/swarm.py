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
2. **Between steps** (``runtime/hook.py``, the round in one place). A round is due when
   the peers working on it have together trained H / F steps' worth of tokens each
   (``runtime/pacer.py``). Round r averages fragment
   ``(r - 1) % F`` of ``delta = theta_g - theta`` (weighted by the tokens the fragment
   trained on since its last sync) with the peers ready for the same round; the exchange
   runs while the loop trains ``tau`` more steps, then the outer Nesterov step is applied
   to that fragment of ``theta_g`` on the CPU, the fragment's local copy becomes
   ``lerp(theta_g, theta, alpha)``, the digest of the new global state is published and a
   checkpoint written (hashing and writing run on threads of their own). A round that
   fails changes nothing. Before each round the peer checks that its state is the swarm's
   and downloads the swarm's when it is behind or outvoted (``runtime/follow.py``,
   ``runtime/catchup.py``); the round itself is ``runtime/rounds.py``'s.
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
from collections.abc import Callable
from typing import Any

import torch

from swarmloco.core.adoption import Evidence
from swarmloco.core.manifest import SwarmManifest
from swarmloco.core.runspec import RunSpec
from swarmloco.core.signature import parameters_in_order, params_of
from swarmloco.errors import ModelMismatch, Stopped, SwarmlocoError
from swarmloco.net.admission import Gate
from swarmloco.net.identity import Identity
from swarmloco.runtime.box import STOPPED_PREFIX, Box, BoxError, Op, unwrap
from swarmloco.runtime.checkpoint import CheckpointStore
from swarmloco.runtime.config import PeerConfig
from swarmloco.runtime.follow import Follower
from swarmloco.runtime.hook import StepHook, StopFlag
from swarmloco.runtime.loop_thread import LoopThread
from swarmloco.runtime.network import SwarmNetwork
from swarmloco.runtime.pacer import Pacer
from swarmloco.runtime.parts import PeerParts
from swarmloco.runtime.persist import PeerCheckpoints, PeerState, Stateful
from swarmloco.runtime.progress import LocalProgress
from swarmloco.runtime.rounds import RoundDriver
from swarmloco.runtime.schedule import SwarmSchedule
from swarmloco.runtime.session import REMEMBER, Session, handle_signals
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

__all__ = ["Evaluator", "EventSink", "Stateful", "Summary", "Swarm", "describe_device",
           "manifest_signature", "manifest_spec"]  # fmt: skip

logger = logging.getLogger(__name__)

EventSink = Callable[[dict[str, Any]], None]
Evaluator = Callable[[], float]

_PEERS_POLL_S = 0.5  # how long wait_for_peers waits for a read of the records at most


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
        self.schedule = SwarmSchedule(optimizer, lambda: self.progress.global_step)
        self.sheet = StatusSheet(
            # Several peers on one host (or in containers named alike) stay apart.
            name=config.name or f"{socket.gethostname()[:50]}/{self.peer_id[:6]}",
            device="",  # known once the swarm is entered
            started_at=time.time(),
        )
        self.progress = LocalProgress()
        self.evidence = Evidence()
        self.trial = Trial(config.catchup.adoption)
        """The adopted state on trial, its fallback, and whom this peer no longer believes."""
        self.admission: Gate | None = None
        """The swarm's gate, once entered: a private swarm's certificates, or a public
        run's proofs of work (None: an open run)."""
        # Built on enter (see _enter and _collaborators).
        self.parts: PeerParts | None = None
        self.checkpoints: PeerCheckpoints | None = None
        self.pacer: Pacer | None = None
        self.rounds: RoundDriver | None = None
        self.follower: Follower | None = None
        self.hook: StepHook | None = None
        self._stop = StopFlag()
        self._told_stopping = False
        self._stack: contextlib.ExitStack | None = None
        self._train_started = 0.0
        self._optimizer_hook: Any = None

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
        self._stop.stop(reason)

    def register(self, name: str, obj: Stateful) -> None:
        """Checkpoint ``obj`` (``state_dict``/``load_state_dict``) with the peer, and
        restore it on enter: a scheduler, a data loader, an RNG. Register before entering."""
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise TypeError(f"{name!r} has no state_dict/load_state_dict to checkpoint")
        if self._stack is not None:
            raise SwarmlocoError("register objects before entering the swarm (with swarm:)")
        self.objects[name] = obj

    @property
    def lr_at(self) -> Callable[[int], float] | None:
        """The inner learning rate at a global step, when the loop follows a schedule
        (:meth:`lr_lambda` and :meth:`scheduler` set it; a loop that sets its optimizer's
        learning rate itself may too). A peer behind the swarm uses it to judge how far the
        rounds it missed can have moved the global state; without it, it assumes the
        current learning rate held."""
        return self.schedule.lr_at

    @lr_at.setter
    def lr_at(self, lr_at: Callable[[int], float] | None) -> None:
        self.schedule.lr_at = lr_at

    def lr_lambda(self, schedule: Callable[[int], float]) -> Callable[[int], float]:
        """A ``LambdaLR`` factor that follows the swarm: ``schedule(global_step)``, whatever
        step count the scheduler keeps itself. The first schedule given (that of the first
        parameter group, for a list of them) also sets :attr:`lr_at` if it is unset."""
        return self.schedule.lr_lambda(schedule)

    def scheduler(self, schedule: Callable[[int], float]) -> torch.optim.lr_scheduler.LambdaLR:
        """``LambdaLR(optimizer, lr_lambda(schedule))``: call its ``step()`` after each
        ``optimizer.step()`` as usual; it is registered (checkpointed) as ``scheduler``."""
        sched = self.schedule.scheduler(schedule)
        if self._stack is None and "scheduler" not in self.objects:
            self.register("scheduler", sched)
        return sched

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
                error = STOPPED_PREFIX + self._stop.reason
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
            raise Stopped(self._stop.reason)
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
            stopped_because=self._stop.reason,
        )

    @property
    def store(self) -> CheckpointStore:
        """This peer's checkpoints of this swarm (once entered)."""
        return self.keeper.store

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
        if self.box is not None:
            self.box.tell(Op.MANIFEST)
            self.box.share(manifest.to_bytes())
        self.diloco, self.params, codec = diloco_around(
            self.model, self.signature, spec, cfg, self.box
        )
        self.sheet.device = describe_device(self.params.device)
        self.keeper = open_keeper(stack, cfg, manifest, self._emit)
        self.snapshots = stack.enter_context(Snapshots(self.swarm_id))
        own_initial = self._restore() or take_own_initial(
            self.diloco, self.params, self.signature.init_digest
        )
        self.snapshots.publish(self.round, self.diloco.committed())
        if self.network is None:
            self.network = build_network(
                config=cfg,
                session=self.session,
                identity=self.identity,
                manifest=manifest,
                diloco=self.diloco,
                codec=codec,
                evidence=self.evidence,
                admission=self.admission,
            )
        follower = self._start_network(stack, self.network, spec)
        self._train_started = time.monotonic()
        follower.catch_up()
        if not own_initial and self.round == 0:
            follower.fetch_initial(self.signature.init_digest, spec.seed)
        self.schedule.follow()
        if cfg.hook:
            self._optimizer_hook = self.optimizer.register_step_post_hook(lambda *_: self.step())
            stack.callback(self._optimizer_hook.remove)
        self.sheet.state = "training"
        self.progress.step_ended = time.monotonic()
        self._emit(
            "ready",
            swarm_id=self.swarm_id,
            peer_id=self.peer_id,
            endpoint=self.network.endpoint,
            round=self.round,
            global_step=self.global_step,
            params=self.signature.numel,
            device=str(self.params.device),
        )
        log_ready(spec, self.signature, swarm_id=self.swarm_id, peer_id=self.peer_id,
                  round=self.round, global_step=self.global_step)  # fmt: skip

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

    def _restore(self) -> bool:
        """Resume from the newest checkpoint that loads and fits this peer (see
        :class:`PeerCheckpoints`); False when there is none."""
        state = PeerState(
            model=self.model,
            optimizer=self.optimizer,
            objects=self.objects,
            diloco=self.diloco,
            params=self.params,
            progress=self.progress,
            evidence=self.evidence,
            trial=self.trial,
            box=self.box,
        )
        self.checkpoints = PeerCheckpoints(
            state,
            self.keeper,
            swarm_id=self.swarm_id,
            snapshots=self.snapshots,
            sheet=self.sheet,
            emit=self._emit,
            remember=self._remember_peers,
            stopping=self._stop.is_set,
        )
        found = self.checkpoints.restore()
        if found is None:
            return False
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

    def _start_network(
        self, stack: contextlib.ExitStack, network: SwarmNetwork, spec: RunSpec
    ) -> Follower:
        """Start networking, with the collaborators that need it (the network reads this
        peer's progress as soon as it runs): returns the follower, for the catch-up."""
        follower = self._collaborators(network, spec)
        network.catchup.evidence = self.evidence
        network.snapshot = lambda: self.snapshots.current
        network.previous_snapshot = lambda: self.snapshots.previous
        network.progress = self._progress_value
        network.status = self._status_value
        network.on_dashboard = lambda url: self._emit("dashboard", url=url)
        self.loop.run(network.__aenter__(), timeout=60.0)
        stack.callback(self._leave_network)
        if warning := clock_warning(network):
            self.sheet.last_error = warning  # shown until something else goes wrong
        return follower

    def _collaborators(self, network: SwarmNetwork, spec: RunSpec) -> Follower:
        """The pacer, the round driver, the follower and the step hook, around the parts
        they share."""
        assert self.checkpoints is not None
        parts = self.parts = PeerParts(
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
        pacer = self.pacer = Pacer(
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
        self.rounds = RoundDriver(parts, pacer, evaluate=self.evaluate, lr=self.schedule.lr)
        self.follower = Follower(
            parts,
            peak_lr=lambda rounds: self.schedule.peak(int(rounds * self.h)),
            reset_optimizer=self._reset_optimizer,
            checkpoint=self._urgent_checkpoint,
        )
        self.hook = StepHook(
            parts,
            pacer=pacer,
            rounds=self.rounds,
            follower=self.follower,
            checkpoints=self.checkpoints,
            stop=self._stop,
            lr=self.schedule.lr,
            reset_optimizer=self._reset_optimizer,
        )
        return self.follower

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

    def _leave_network(self) -> None:
        assert self.network is not None
        self._remember_peers()
        with contextlib.suppress(Exception):
            self.loop.run(self.network.__aexit__(None, None, None), timeout=30.0)

    # -- leaving ------------------------------------------------------------------------------

    def __exit__(self, exc_type: type[BaseException] | None, exc: Any, tb: Any) -> bool:
        stack, self._stack = self._stack, None
        if stack is None:
            return False
        interrupted = exc_type is not None and not issubclass(exc_type, (Exception, Stopped))
        try:
            if self._optimizer_hook is not None:
                self._optimizer_hook.remove()
                self._optimizer_hook = None
            if exc_type is not None and issubclass(exc_type, Exception):
                self.stop(f"the training loop raised {exc_type.__name__}")
            assert self.hook is not None
            failed = exc_type is not None and not issubclass(exc_type, Stopped)
            self.hook.leave(failed=failed, interrupted=interrupted)
        finally:
            wall = time.monotonic() - self._train_started if self._train_started else 0.0
            stack.close()
            self._emit(
                "stopped",
                round=self.round,
                step=self.steps,
                global_step=self.global_step,
                reason=self._stop.reason,
                # Time in inner steps over time since training started: what rounds cost.
                train_seconds=round(self.progress.train_seconds, 3),
                wall_seconds=round(wall, 3),
            )
        return exc_type is not None and issubclass(exc_type, Stopped)

    # -- between two steps --------------------------------------------------------------------

    def step(self, tokens: int | None = None) -> None:
        """One optimizer step of the training loop happened (the hook calls this; with
        ``hook=False`` the loop does, after each ``optimizer.step()``). ``tokens``: what
        the step trained on (default: the config's ``tokens_per_step``; in a box, what
        the whole box trained on)."""
        if self._stack is None or self.hook is None:
            raise SwarmlocoError("step() outside `with swarm:`")
        n = self.config.tokens_per_step if tokens is None else int(tokens)
        if self.box is None:
            self.hook.stepped(n)
            return
        try:
            self.hook.stepped(n)
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

    def discard_local(self, why: str) -> None:
        """NaN or Inf in training: nothing of it may reach the swarm. Drop the local steps
        since the last round and the optimizer's moments (they hold the NaN too), restart
        from the global state; give up when it happens again and again. In a box, every
        rank calls it at the same point of the loop."""
        if self.hook is None:
            raise SwarmlocoError("discard_local() inside `with swarm:`")
        try:
            self.hook.discard(why)
        except BaseException as exc:
            self._abort_box(exc)
            raise
        if self.box is not None:
            self._end_step()

    def _reset_optimizer(self) -> None:
        """Clear the inner optimizer's moments (every rank's): they came from a state
        this peer no longer trains from."""
        if self.box is not None:
            self.box.tell(Op.RESET)
        self.optimizer.state.clear()

    def _urgent_checkpoint(self) -> None:
        """What was downloaded or rolled back to is not lost to a crash."""
        if self.config.checkpoint_every and self.checkpoints is not None:
            self.checkpoints.save(urgent=True)

    # -- records ----------------------------------------------------------------------------

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
