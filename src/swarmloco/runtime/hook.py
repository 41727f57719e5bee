"""What runs between two steps of the user's loop: the swarm's round, in one place.

After each ``optimizer.step()`` (the hook; or ``Swarm.step``) :class:`StepHook` counts the
step and its tokens, then, in order:

1. reports a checkpoint written in the background, and starts one that is owed;
2. stops the peer at ``max_rounds`` or at the end of the run (by rounds or tokens, so that
   every peer stops after the same round);
3. lands the round in flight once it overlapped ``tau`` steps (``RoundDriver.land``);
4. rolls back an adopted state that training condemned (``Follower.roll_back``);
5. asks the pacer whether the next round is due: when others work on later rounds it
   catches up (``Follower.catch_up``), when the round is due it catches up once more (this
   peer's state must be the swarm's) and starts it (``RoundDriver.start``); without
   overlap, the round lands before the loop goes on.

A local model gone NaN or Inf is discarded (the steps since the last round, the
optimizer's moments), and the peer gives up when that happens again and again. On leaving,
the round in flight lands, the last checkpoint is written, and a peer whose run is over
stays a donor a while.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from swarmloco.core.pacing import Verdict
from swarmloco.errors import Stopped, SwarmlocoError
from swarmloco.runtime.box import Op
from swarmloco.runtime.follow import Follower
from swarmloco.runtime.pacer import Pacer
from swarmloco.runtime.parts import PeerParts
from swarmloco.runtime.persist import PeerCheckpoints
from swarmloco.runtime.rounds import RoundDriver

logger = logging.getLogger(__name__)

MAX_DISCARDS = 3  # NaN/Inf restarts without a round in between before the peer gives up


class StopFlag:
    """Whether the peer was asked to stop, and why (thread-safe: a signal handler, another
    thread, the hook itself)."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason = ""
        self.asks = 0
        """How often a stop was asked (one asked while the peer lingers ends it)."""
        self.finished = False
        """This peer reached its last round (the run's end, or its own ``max_rounds``), not
        just asked to stop: it serves that round's state to peers still working towards it
        before it leaves."""

    def stop(self, reason: str) -> None:
        self.asks += 1
        if not self._event.is_set():
            self.reason = reason
            self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()


class StepHook:
    """See the module. ``lr``: the inner learning rate now; ``reset_optimizer``: clears the
    inner optimizer's moments (every rank's)."""

    def __init__(
        self,
        parts: PeerParts,
        *,
        pacer: Pacer,
        rounds: RoundDriver,
        follower: Follower,
        checkpoints: PeerCheckpoints,
        stop: StopFlag,
        lr: Callable[[], float],
        reset_optimizer: Callable[[], None],
    ) -> None:
        self.parts = parts
        self.pacer = pacer
        self.rounds = rounds
        self.follower = follower
        self.checkpoints = checkpoints
        self.stop = stop
        self.lr = lr
        self.reset_optimizer = reset_optimizer
        self._nan_in_a_row = 0

    def stepped(self, tokens: int) -> None:
        """One step of the loop trained on ``tokens`` tokens: count it, then do the swarm's
        work (raises :class:`Stopped` once the peer is asked to stop)."""
        p = self.parts
        started = time.monotonic()
        p.progress.stepped(tokens, self.lr(), now=started)
        p.diloco.trained(tokens)
        p.keeper.dirty = True
        p.progress.advance(p.diloco.round + self.rounds.started, p.h)
        if self.stop.is_set():  # the loop stepped on after a stop: leave it here
            raise Stopped(self.stop.reason)
        self._between_steps()
        p.progress.hook_ended(started, p.now)

    def exchange_over(self) -> bool:
        """Whether a round is in flight whose exchange has ended (it waits to be landed)."""
        x = self.rounds.inflight
        return x is not None and x.future.done()

    def idle(self) -> None:
        """(A pipeline stage whose micro-batches stopped coming: its drivers paused, or the
        run ended for them.) Land the round in flight now if its exchange has ended, not
        after the steps it was to overlap, which may never come; then do what is due
        between steps. Raises :class:`Stopped` once the peer is asked to stop."""
        if self.exchange_over():
            with self.parts.progress.blocking():
                self._land()
            self._between_steps()
        if self.stop.is_set():
            raise Stopped(self.stop.reason)

    @property
    def settling(self) -> bool:
        """Whether a landed round's digest is still being computed."""
        return self.parts.snapshots.pending

    def settle(self) -> None:
        """Take a landed round's digest once it is ready (the round's event, its digest
        record), without a step: a pipeline stage whose micro-batches stopped coming calls
        this between its polls. Touches no parameter."""
        self.parts.snapshots.finish()

    def wait(self, *, flush: bool = False) -> None:
        """(A peer with no batch to train now: its data's shards are all leased by others,
        or read.) Land the round in flight once its exchange has ended, then do what is due
        between steps: a round the others start still carries this peer's steps not
        averaged yet. ``flush``: no more batches are coming for a while, so the steps not
        averaged yet are averaged now (a round started at once, not when the swarm's
        tokens come to H steps: this peer adds none). Raises :class:`Stopped` once the
        peer is asked to stop."""
        p = self.parts
        if self.exchange_over():
            with p.progress.blocking():
                self._land()
        if flush and self.rounds.inflight is None and self._unaveraged() and not self._ends():
            # (Not the pacer's DUE: its count of steps restarts when a round starts, also
            # one that aborts, and this peer adds no steps now.)
            with p.progress.blocking():
                self.follower.catch_up()
                # With whoever comes, alone if nobody does: the others may be out of data
                # too, with nothing to average (they catch up once they train again).
                self.pacer.expected = None
                if self._unaveraged() and not self.rounds.start():
                    self.discard("the local model holds NaN/Inf")
        self._between_steps()
        if self.stop.is_set():
            raise Stopped(self.stop.reason)

    def _unaveraged(self) -> bool:
        """Whether this peer trained on tokens no applied round has averaged yet."""
        return self.unaveraged_tokens() > 0

    def unaveraged_tokens(self) -> int:
        """The tokens this peer trained on that no applied round has averaged yet (its
        local work that leaving now would keep out of the swarm's state)."""
        return int(sum(self.parts.diloco.fragment_tokens))

    @property
    def flushed(self) -> bool:
        """Whether everything this peer trained on is averaged: no round in flight and no
        tokens since the last applied round (what :meth:`wait` with ``flush`` comes to)."""
        return self.rounds.inflight is None and not self._unaveraged()

    def _between_steps(self) -> None:
        p, rounds, follower = self.parts, self.rounds, self.follower
        tau = p.spec.delay
        while True:
            p.snapshots.finish()
            self.checkpoints.collect()
            if p.keeper.owed():
                self.checkpoints.save()
            if self._ends():
                return
            if rounds.inflight is not None:
                if p.progress.steps - rounds.inflight.step >= tau:
                    with p.progress.blocking():
                        self._land()  # the exchange overlapped tau steps: apply it now
                    continue
                return
            if p.trial.condemned is not None:
                with p.progress.blocking():
                    follower.roll_back(p.trial.condemned)
                return
            if p.ranges is not None and p.ranges.lapsed():
                self._lost_shards()
                return
            if p.ranges is not None and p.ranges.unsure():
                return  # its leases lapsed and may be another's: no round carries them yet
            verdict = self.pacer.verdict(p.diloco.round)
            if verdict is Verdict.BEHIND and follower.may_look():
                # Others work on a later round. If its state is not to be had yet (digests
                # not published, donors busy), train on and look again later.
                with p.progress.blocking():
                    follower.catch_up()
                follower.looked()
                return
            if verdict is Verdict.DUE:
                with p.progress.blocking():
                    self._start_round()
                if rounds.inflight is not None and tau == 0:
                    continue
            return

    def _lost_shards(self) -> None:
        """Shards this peer read were taken by another while its leases lapsed (docs/
        DESIGN.md section 11, "Leases"): drop the local steps since the last round (what
        they read of its other shards is read again) and forget what they read of those."""
        p = self.parts
        assert p.ranges is not None
        steps = p.progress.steps_since_round
        with p.progress.blocking():
            self.follower.restart_from_global()
            p.ranges.forget_lapsed()
        p.emit("discarded", round=p.diloco.round, steps=steps, why="leases lapsed and taken")

    def _start_round(self) -> None:
        began = time.monotonic()
        self.follower.catch_up()
        if self.parts.progress.steps_since_round == 0:
            return  # the download replaced this peer's work with the swarm's state
        if not self.rounds.start():
            self.discard("the local model holds NaN/Inf")
        elif (x := self.rounds.inflight) is not None:
            self.rounds.inflight = dataclasses.replace(x, start_seconds=time.monotonic() - began)

    def _land(self) -> None:
        """Apply the round in flight (or count it aborted); checkpoint every so often."""
        if not self.rounds.land():
            return
        self._nan_in_a_row = 0  # a round made it: training works from this state
        every = self.parts.config.checkpoint_every
        if every and self.parts.diloco.round % every == 0:
            self.checkpoints.save()

    def _ends(self) -> bool:
        """Whether the peer must stop now (and asks itself to)."""
        p = self.parts
        cfg, spec, current = p.config, p.spec, p.diloco.round
        if cfg.max_rounds is not None and current >= cfg.max_rounds:
            self.stop.finished = True
            self.stop.stop(f"round {current} reached (max rounds {cfg.max_rounds})")
        elif not cfg.ends_at_run_total:
            pass  # (a pipelined run's later stage: the run ends at stage 0)
        elif spec.total_steps is not None and current * p.h >= spec.total_steps:
            # By rounds, not this peer's own steps: every peer stops after the same round.
            self.stop.finished = True
            self.stop.stop(f"the run is over: round {current} reached {spec.total_steps} steps")
        elif spec.total_tokens is not None and p.diloco.tokens >= spec.total_tokens:
            self.stop.finished = True
            self.stop.stop(f"the run is over: {p.diloco.tokens} of {spec.total_tokens} tokens")
        return self.stop.is_set()

    def discard(self, why: str) -> None:
        """NaN or Inf in training: nothing of it may reach the swarm. Drop the local steps
        since the last round and the optimizer's moments (they hold the NaN too), restart
        from the global state; give up when it happens again and again."""
        p = self.parts
        if p.trial.probation is not None:
            # Training from a state on probation failed: the state is to blame, not the
            # data or the learning rate.
            self.follower.roll_back(f"{why} after adopting it")
            return
        self._nan_in_a_row += 1
        steps = p.progress.steps_since_round
        logger.error(
            "%s after %d local steps: discarding them and restarting from the global state "
            "of round %d (%d time(s) since a round last succeeded)",
            why,
            steps,
            p.diloco.round,
            self._nan_in_a_row,
        )
        p.emit("discarded", round=p.diloco.round, steps=steps, why=why)
        if self._nan_in_a_row > MAX_DISCARDS:
            raise SwarmlocoError(
                f"training produced NaN/Inf {self._nan_in_a_row} times from the swarm's global "
                "state without completing a round; check the data and the learning rate (or "
                "try --compile off) before joining again"
            )
        self.reset_optimizer()
        self.follower.restart_from_global()

    def leave(self, *, failed: bool, interrupted: bool) -> None:
        """Land the round in flight (unless interrupted again, or a box rank ``failed``),
        write the last checkpoint, and stay a donor a while if this was the peer's last
        round."""
        p, rounds, box = self.parts, self.rounds, self.parts.box
        consistent = True
        if box is not None and failed:
            # The other ranks may be anywhere in the step (in a collective of the model's
            # own): nothing more is asked of them, and nothing is saved that would need
            # their shards. The last checkpoint on disk stands.
            box.broken = True
            consistent = False
        if interrupted or (box is not None and box.broken):
            rounds.cancel()  # a second Ctrl-C: do not wait for it
        elif rounds.inflight is not None:
            self._land()
        p.snapshots.finish(wait=True)
        p.sheet.state = "stopping"
        if p.keeper.dirty and consistent and rounds.consistent:
            self.checkpoints.save(wait=True)
        self.checkpoints.collect(wait=True)
        if box is not None and not box.broken:
            box.tell(Op.EXIT)  # before lingering: the other ranks are done
        if self.stop.finished and not interrupted:
            self._linger()

    def _linger(self) -> None:
        """This peer's last round is applied (the run is over, or its ``max_rounds``): stay
        a donor while other peers still work towards a round this one applied (a group of
        them may be short of members now, and can only finish by downloading that state),
        for at most ``linger_s``. Peers that applied it too are not waited for. A stop
        asked meanwhile (a signal, :meth:`Swarm.stop`) ends it."""
        p = self.parts
        if p.config.linger_s <= 0:
            return
        deadline = time.monotonic() + p.config.linger_s
        told, asks = False, self.stop.asks
        while time.monotonic() < deadline and self.stop.asks == asks:
            reports = self.pacer.fresh_reports(p.diloco.round)
            behind = {r.peer for r in reports if r.round <= p.diloco.round}
            if not behind:
                return
            if not told:
                told = True
                logger.info(
                    "%s; serving that state to %d peer(s) still working towards it (at most "
                    "%.0f s; a signal leaves now)",
                    self.stop.reason,
                    len(behind),
                    p.config.linger_s,
                )
                p.emit("lingering", round=p.diloco.round, peers=len(behind))
            time.sleep(min(1.0, p.config.progress_interval_s / 2))  # reports come in
        if self.stop.asks != asks:
            logger.info("asked to stop while serving the last round's state: leaving now")
