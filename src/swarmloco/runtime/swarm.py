"""One peer of a swarm, around the user's own training loop: :class:`Swarm`.

``with swarm:`` around a loop of ``loss.backward(); optimizer.step()``. The user's model,
optimizer, gradient scaler, clipping and LR scheduler stay theirs: the swarm hooks the
optimizer's step (a post hook; or the loop calls :meth:`Swarm.step`), counts the step and
its tokens, and does the swarm's work between two steps:

1. **Enter** (``runtime/peer.py``). Fetch the manifest (a swarm id) or take it
   (``create``), refuse a model that is not the swarm's (names, shapes, dtypes; before any
   other network traffic), restore the newest checkpoint of this swarm from the data
   directory (model, optimizer, the objects registered with :meth:`Swarm.register`, the
   DiLoCo state), start networking and catch up with the swarm (downloading its state, or
   the initial weights when this model's differ from the manifest's).
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
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from swarmloco.core.manifest import SwarmManifest
from swarmloco.core.runspec import RunSpec
from swarmloco.core.signature import parameters_in_order
from swarmloco.errors import Stopped, SwarmlocoError
from swarmloco.net.identity import Identity
from swarmloco.net.server import Service
from swarmloco.runtime.box import STOPPED_PREFIX, Box, BoxLead, unwrap
from swarmloco.runtime.config import PeerConfig
from swarmloco.runtime.network import SwarmNetwork
from swarmloco.runtime.parts import RangeKeeper
from swarmloco.runtime.peer import Kept, Peer, Summary, Trainee
from swarmloco.runtime.persist import Stateful
from swarmloco.runtime.schedule import SwarmSchedule
from swarmloco.runtime.session import handle_signals
from swarmloco.runtime.start import describe_device, manifest_signature, manifest_spec

__all__ = [
    "Evaluator",
    "EventSink",
    "Stateful",
    "Summary",
    "Swarm",
    "describe_device",
    "manifest_signature",
    "manifest_spec",
]

logger = logging.getLogger(__name__)

EventSink = Callable[[dict[str, Any]], None]
Evaluator = Callable[[], float]


class Swarm:
    """One peer of one swarm around the user's training loop (see the module docstring).

    Build it with :func:`swarmloco.create` or :func:`swarmloco.join`; constructing does no
    I/O. ``source`` is the run's manifest, or a swarm id whose manifest is fetched on enter.
    ``network``: the peer's network (built on enter by default; tests inject one with a
    fault plan). ``evaluate``: returns the loss of the global model (after
    :meth:`load_global_into` of the caller's eval copy), run every ``eval_every`` rounds.
    ``box``: the box's rank 0, when the peer is several ranks (``runtime/box.py``).
    ``ranges``: the reader of a pinned dataset's leased shards, told what became of the
    sequences it read (``dataset/leases.py``).
    Entered, it is the :class:`~swarmloco.runtime.peer.Peer` it builds (``runtime/peer.py``)
    that trains with the swarm.
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
        services: Sequence[Service] = (),
        ranges: RangeKeeper | None = None,
    ) -> None:
        self.box = box if box is not None and box.size > 1 else None
        self.model = unwrap(model)
        self.optimizer, self.config, self.identity = optimizer, config, identity
        self.peer_id = identity.peer_id_hex
        self.on_event = on_event
        self.objects: dict[str, Stateful] = {}
        kept = Kept.fresh(config, self.peer_id, self._emit)
        self.sheet, self.progress, self.trial = kept.sheet, kept.progress, kept.trial
        self._stop = kept.stop
        self.schedule = SwarmSchedule(optimizer, lambda: self.progress.global_step)
        trainee = Trainee(
            model=self.model,
            optimizer=optimizer,
            objects=self.objects,
            box=self.box,
            evaluate=evaluate,
            schedule=self.schedule,
            ranges=ranges,
        )
        self.peer = Peer(
            source,
            trainee,
            kept,
            config=config,
            identity=identity,
            network=network,
            on_step=self.step,
            services=services,
        )
        self._entered = False
        self.lead = BoxLead(self.box)
        self._stack: contextlib.ExitStack | None = None

    # -- what the user reads and calls ------------------------------------------------------

    @property
    def evaluate(self) -> Evaluator | None:
        """The evaluation of the global model (set it before entering)."""
        return self.peer.trainee.evaluate

    @evaluate.setter
    def evaluate(self, evaluate: Evaluator | None) -> None:
        self.peer.trainee = dataclasses.replace(self.peer.trainee, evaluate=evaluate)

    @property
    def swarm_id(self) -> str:
        return self.peer.swarm_id

    @property
    def manifest(self) -> SwarmManifest | None:
        return self.peer.manifest

    @property
    def network(self) -> SwarmNetwork | None:
        return self.peer.network

    @property
    def spec(self) -> RunSpec:
        """The run's shared hyperparameters (known once entered, or at once for a create)."""
        if self.manifest is None:
            raise SwarmlocoError("the run spec is known once the swarm is entered (with swarm:)")
        return manifest_spec(self.manifest)

    @property
    def round(self) -> int:
        """The round of this peer's global state."""
        return self.peer.diloco.round if self._entered else 0

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
    def last_error(self) -> str:
        """What last went wrong (shown on the dashboard), "" once set right."""
        return self.sheet.last_error

    @property
    def data_seed(self) -> int:
        """A seed for this peer's data sampler: distinct per peer (it comes from the peer's
        key), the same after a restart with the same data directory."""
        return int(self.peer_id[:15], 16)

    @property
    def endpoint(self) -> str:
        """HOST:PORT where other peers reach this one once entered ("" in client mode)."""
        network = self.peer.network
        return network.endpoint if network is not None else ""

    @property
    def stopping(self) -> bool:
        """Whether the peer was asked to stop; a loop that checks it ends cleanly. In a
        box, as told to every rank at the last step's end (all ranks leave together)."""
        if self.box is not None:
            return self.lead.told_stopping
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
            self.peer.diloco.layout.scatter(
                self.peer.diloco.theta_g, parameters_in_order(module, self.peer.signature.params)
            )

    def global_parameters(self) -> dict[str, torch.Tensor]:
        """The global parameters (``theta_g``) by name, as views of the swarm's own fp32
        vector on the CPU: no copy (read them, never write them; they change when a round
        lands). ``torch.func.functional_call(model, swarm.global_parameters(), args)``
        evaluates the global model without an eval copy of the model."""
        return self.peer.diloco.global_by_name()

    def wait_for_peers(self, n: int, *, timeout_s: float = 600.0) -> int:
        """Block until at least ``n`` peers of the swarm (this one included) are online, so
        that they start training together; returns how many are. Online: a peer whose
        progress record is fresh (it reports every ``progress_interval_s``; one that left
        said goodbye, one that was killed falls silent). Raises :class:`SwarmlocoError`
        after ``timeout_s``, and :class:`Stopped` when the peer is asked to stop meanwhile
        (Ctrl-C: ``with swarm`` leaves quietly, no step runs). Inside ``with swarm:``; in a
        box, every rank calls it."""
        if self._stack is None or not self._entered:
            raise SwarmlocoError("wait_for_peers() inside `with swarm:`")
        found, error = self.peer.count_online(n, time.monotonic() + timeout_s)
        if self._stop.is_set():
            error = STOPPED_PREFIX + self._stop.reason  # every rank raises Stopped too
        elif error:
            error += f" after {timeout_s:.0f} s"
        if self.box is not None:
            self.box.share(error)
        if self._stop.is_set():
            raise Stopped(self._stop.reason)
        if error:
            raise SwarmlocoError(error)
        logger.info("%d peers online", found)
        return found

    @property
    def summary(self) -> Summary:
        return self.peer.summary(entered=self._entered)

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

    # -- entering and leaving -----------------------------------------------------------------

    def __enter__(self) -> Swarm:
        if self._stack is not None:
            raise SwarmlocoError("this swarm object is already entered")
        stack = contextlib.ExitStack()
        try:
            if self.config.handle_signals and threading.current_thread() is threading.main_thread():
                handle_signals(stack, self.stop)  # Ctrl-C while starting: stop at step one
            self.peer.enter(stack)
            self._entered = True
            self.lead.ready(
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
            self.lead.abort(exc)
            stack.close()
            raise
        self._stack = stack
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: Any, tb: Any) -> bool:
        stack, self._stack = self._stack, None
        if stack is None:
            return False
        interrupted = exc_type is not None and not issubclass(exc_type, (Exception, Stopped))
        if exc_type is not None and issubclass(exc_type, Exception):
            self.stop(f"the training loop raised {exc_type.__name__}")
        failed = exc_type is not None and not issubclass(exc_type, Stopped)
        self.peer.leave(stack, failed=failed, interrupted=interrupted)
        return exc_type is not None and issubclass(exc_type, Stopped)

    # -- between two steps --------------------------------------------------------------------

    def step(self, tokens: int | None = None) -> None:
        """One optimizer step of the training loop happened (the hook calls this; with
        ``hook=False`` the loop does, after each ``optimizer.step()``). ``tokens``: what
        the step trained on (default: the config's ``tokens_per_step``; in a box, what
        the whole box trained on)."""
        if self._stack is None:
            raise SwarmlocoError("step() outside `with swarm:`")
        n = self.config.tokens_per_step if tokens is None else int(tokens)
        self.lead.around_step(lambda: self.peer.hook.stepped(n), self._end_step)

    def _end_step(self, raised: bool) -> None:
        self.lead.end_step(self.global_step, self.round, self._stop.is_set(), raised=raised)

    def idle(self, *, flush: bool = False) -> None:
        """No batch to train on now (the data is not to be had yet): do the swarm's work
        between steps without a step (the round in flight lands once its exchange ended).
        ``flush``: none is coming for a while (the data is read to its end): average the
        steps not averaged yet now. Raises :class:`Stopped` once the peer is asked to
        stop. In a box, the other ranks wait for their part of the next step meanwhile
        (:meth:`BoxRank.dealt`)."""
        if self._stack is None:
            raise SwarmlocoError("idle() inside `with swarm:`")
        self.lead.idle()
        self.peer.hook.wait(flush=flush)

    def deal(self, parts: Sequence[Any]) -> Any:
        """A box's rank 0: the next step trains each rank on its part of ``parts`` (one a
        rank), each other rank waiting for it in :meth:`BoxRank.dealt`; rank 0's own."""
        if self._stack is None or self.box is None:
            raise SwarmlocoError("deal() is for rank 0 of a box, inside `with swarm:`")
        return self.lead.deal(parts)

    def discard_local(self, why: str) -> None:
        """NaN or Inf in training: nothing of it may reach the swarm. Drop the local steps
        since the last round and the optimizer's moments (they hold the NaN too), restart
        from the global state; give up when it happens again and again. In a box, every
        rank calls it at the same point of the loop."""
        if self._stack is None:
            raise SwarmlocoError("discard_local() inside `with swarm:`")
        self.lead.around_step(lambda: self.peer.hook.discard(why), self._end_step)
