"""One round of this peer, from its start to its landing (DESIGN section 3): the round
driver.

:meth:`RoundDriver.start` averages the next round's fragment of ``delta = theta_g -
theta`` (weighted by the tokens the fragment trained on since its last sync) with the
peers ready for the same round; the exchange runs on the peer's event loop while the
training loop goes on. :meth:`RoundDriver.land` waits for it (``tau`` steps later, or at
once without overlap), applies the outer Nesterov step to that fragment of ``theta_g``,
mixes the fragment's local copy back (``lerp(theta_g, theta, alpha)``), counts the round
as evidence for adoption, hashes the new global state on a thread of its own and then
publishes its digest. A round that fails, whatever the others sent, changes nothing: the
fragment's delta keeps growing and the next attempt carries all of it.

When a round is due, and whether this peer must catch up first, is the pacer's and the
follower's to say; ``Swarm`` calls them in order between two steps.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch

from swarmloco.dataset.ledger import Range
from swarmloco.errors import RoundAborted, SwarmlocoError
from swarmloco.net.heap import release_now
from swarmloco.runtime.network import RoundOutcome
from swarmloco.runtime.pacer import Pacer
from swarmloco.runtime.parts import PeerParts
from swarmloco.train.diloco import fragment_of_round

logger = logging.getLogger(__name__)

ROUND_FAILURES = (SwarmlocoError, TimeoutError)
"""What ends a round routinely (anything else is also caught, and logged with its trace)."""


@dataclasses.dataclass(frozen=True)
class Exchange:
    """A round in flight: started after local step ``step``, applied ``tau`` steps later."""

    round: int
    fragment: int
    future: Any  # concurrent.futures.Future[AveragingOutcome]
    step: int
    started: float
    weight: float
    start_seconds: float = 0.0
    """The training loop's time starting it (a look for a later state, the delta)."""


class RoundDriver:
    """See the module. ``evaluate``: the loss of the global model, run every
    ``eval_every`` rounds; ``lr``: the inner learning rate now (for the round's event)."""

    def __init__(
        self,
        parts: PeerParts,
        pacer: Pacer,
        *,
        evaluate: Callable[[], float] | None = None,
        lr: Callable[[], float],
    ) -> None:
        self.parts = parts
        self.pacer = pacer
        self.evaluate = evaluate
        self.lr = lr
        self.inflight: Exchange | None = None
        self.applied = 0
        self.aborted = 0
        self.last_eval: float | None = None
        self.consistent = True
        """False while a round's result is being applied to the model (a checkpoint of it
        now would hold half a round)."""
        self._round_s = 5.0  # how long this peer's last applied round took (a guess at first)

    def start(self) -> bool:
        """Start averaging the next round's fragment; training goes on while it runs.
        False: the local model holds NaN or Inf, and nothing was started."""
        p = self.parts
        diloco = p.diloco
        target = diloco.round + 1
        f = fragment_of_round(target, diloco.fragments)
        with p.params.view(f, read=True) as whole:
            if not diloco.encode(f, whole):
                return False
        weight = float(diloco.fragment_tokens[f])
        p.sheet.state = "averaging"
        feedback = diloco.feedback[f] if diloco.feedback else None
        expected, strangers = self.pacer.expected or (None, 0)
        ranges = p.ranges.declare(target, f) if p.ranges is not None else []
        future = p.loop.submit(
            p.network.average(
                target,
                diloco.messages[f],
                diloco.means[f],
                weight=weight,
                expected=expected,
                strangers=strangers,
                error_feedback=feedback,
                ranges=ranges,
            )
        )
        self.inflight = Exchange(target, f, future, p.progress.steps, time.monotonic(), weight)
        p.wake()
        p.progress.round_started(p.now())
        return True

    def cancel(self) -> None:
        """Give up the exchange in flight without waiting for it (it changes nothing)."""
        if self.inflight is not None:
            self.inflight.future.cancel()
            self.inflight = None

    @property
    def started(self) -> int:
        """1 while a round is started and not applied (what this peer's progress report
        and global step count as begun), else 0."""
        x = self.inflight
        return int(x is not None and x.round > self.parts.diloco.round)

    def land(self) -> bool:
        """Wait for the exchange in flight; apply its outer step (True), or count it as
        aborted (False). The exchange stays in flight until then: while this peer waits
        for its group, its progress report names the round after (others see that it
        started the round, and join it), not the round with none of its tokens."""
        x = self.inflight
        assert x is not None
        try:
            return self._land(x)
        finally:
            self.inflight = None

    def _land(self, x: Exchange) -> bool:
        p = self.parts
        landing = time.monotonic()
        try:
            try:
                outcome = x.future.result(timeout=p.config.round_timeout_s + 10.0)
            finally:
                # Without overlap nobody of the group trained meanwhile: their tokens count
                # again from when the loop resumes (after the outer step and evaluation).
                p.progress.resume_pending = p.spec.delay == 0
            if not bool(torch.isfinite(p.diloco.means[x.fragment].scales).all()):
                raise RoundAborted(f"round {x.round}: the group's mean is not finite")
        except Exception as exc:  # whatever the others sent: the round fails, never the peer
            self._aborted(x, exc)
            return False
        p.sheet.state = "training"
        waited = time.monotonic() - landing
        report, matchmaking = outcome.result.report, outcome.matchmaking_s
        # Partners are the members the result holds whole, never the group as formed: a
        # stranger struck (or gone) at once averaged nothing with us, and its word must
        # not count as a partner's (leadership, pacing, adoption, the dataset's spans).
        whole = outcome.whole
        partners = frozenset(m for m, counted in whole.items() if counted) - {p.peer_id}
        # What the round landed of a pinned dataset joins the state: every member adds the
        # same (the declarations of the members the result holds whole), a peer that reads
        # at random (a box) as one that leases; without a dataset nobody declares any.
        landed = [Range(*r) for m, ranges in outcome.ranges.items() if whole.get(m) for r in ranges]
        self._apply(x, outcome.group_tokens, partners, landed)
        if p.ranges is not None:
            p.ranges.landed(x.round, outcome.ranges, whole, p.peer_id)
        applied = time.monotonic() - landing - waited
        event: dict[str, Any] = {}  # filled in below; emitted once the digest is known

        def hashed(digest: bytes) -> None:
            p.loop.submit(p.network.publish_digest(event["round"], digest))
            p.emit("round", **event, digest=digest.hex())

        p.snapshots.hash_later(p.diloco, hashed)
        self.applied += 1
        self.pacer.last_group = (x.round, partners)
        p.wake()
        # The round's own time (matchmaking and exchange): the same figure in the event, the
        # log and the status record, without the evaluation below.
        seconds = time.monotonic() - x.started
        p.sheet.remember(
            round=x.round,
            group=len(report.members),
            seconds=seconds,
            payload_bytes=4 * p.diloco.means[x.fragment].numel,
            bytes_sent=report.bytes_sent,
            bytes_received=report.bytes_received,
            ok=True,
            matchmaking_s=matchmaking,
        )
        evaluating = time.monotonic()
        eval_loss = self._evaluate()
        self._round_s = seconds
        event.update(self._event(x, outcome, seconds, eval_loss))
        # What the training loop waited for at the landing: the exchange (all of the round
        # without overlap, what tau steps did not hide with it), and the evaluation.
        event["wait_seconds"] = round(waited, 3)
        event["eval_seconds"] = round(time.monotonic() - evaluating, 3)
        # And what the loop spent on the round itself: starting it, applying it.
        event["start_seconds"] = round(x.start_seconds, 3)
        event["apply_seconds"] = round(applied, 3)
        release_now()  # what the round and the evaluation freed, back to the system
        logger.info(
            "round %d (fragment %d) applied with %d peer(s) in %.2fs: train loss %.3f%s",
            p.diloco.round,
            x.fragment,
            len(report.members),
            seconds,
            p.progress.loss,
            f", eval loss {eval_loss:.3f}" if eval_loss is not None else "",
        )
        return True

    def _apply(
        self,
        x: Exchange,
        group_tokens: float,
        partners: Collection[str],
        landed: Sequence[Range] = (),
    ) -> None:
        """The outer step on the fragment, its local copy mixed back, the round counted
        (``partners``: the other members the result holds whole; ``landed``: the ranges of
        a pinned dataset the round landed)."""
        p = self.parts
        self.consistent = False
        movement = p.diloco.apply(
            x.fragment, x.round, weight=x.weight, group_tokens=group_tokens, landed=landed
        )
        alpha = p.spec.streaming.alpha
        with p.params.view(x.fragment, read=alpha != 0.0, write=True) as whole:
            p.diloco.land(x.fragment, whole, alpha)
        self.consistent = True
        p.progress.advance(p.diloco.round, p.h)
        self._weigh(x, partners, movement, group_tokens)

    def _evaluate(self) -> float | None:
        every = self.parts.config.eval_every
        if self.evaluate is None or not every or self.parts.diloco.round % every:
            return None
        self.last_eval = float(self.evaluate())
        return self.last_eval

    def _aborted(self, x: Exchange, exc: BaseException) -> None:
        """The exchange ``x`` failed (``exc``): nothing applied, the round counted as
        aborted; a peer late for a group that formed without it waits for its result."""
        p = self.parts
        if not isinstance(exc, ROUND_FAILURES):
            logger.error("round %d failed on an unexpected error", x.round, exc_info=exc)
        x.future.cancel()
        if p.ranges is not None:
            p.ranges.failed(x.round)
        p.sheet.state = "training"
        late = isinstance(exc, RoundAborted) and exc.late
        if not late:
            # (Late for a group that formed without it: a healthy peer's routine, not an
            # error the dashboard should show; it takes the group's result instead.)
            p.sheet.last_error = f"round {x.round} aborted: {exc}"
        p.sheet.remember(
            round=x.round,
            group=0,
            seconds=time.monotonic() - x.started,
            payload_bytes=4 * p.diloco.means[x.fragment].numel,
            ok=False,
        )
        self.aborted += 1
        self.pacer.last_group = None  # those we expected did not come
        if isinstance(exc, RoundAborted) and exc.unmet:
            self.pacer.no_show(x.round)
        if late:
            # The others average this round without us: take their result once it is
            # published. Wait about as long as their round takes (a gathering window
            # and the exchange, twice over), then try the round again as usual.
            wait = 2 * (p.config.matchmaking.gather_s + self._round_s)
            until = time.monotonic() + min(wait, p.config.round_timeout_s)
            self.pacer.wait_for_late_group(x.round, until, p.diloco.means[x.fragment].numel)
        logger.warning("round %d aborted: %s", x.round, exc)
        p.emit(
            "aborted",
            round=x.round,
            fragment=x.fragment,
            error=f"{type(exc).__name__}: {exc}",
            seconds=round(time.monotonic() - x.started, 3),
        )

    def _weigh(
        self, x: Exchange, partners: Collection[str], movement: float, group_tokens: float
    ) -> None:
        """Count the applied round as evidence for adoption (averaged with others only if
        one of ``partners`` is), and end a probation it completes."""
        p = self.parts
        grouped = bool(partners)
        adoption = p.config.catchup.adoption
        p.evidence.applied(
            movement,
            time.time(),
            alone=not grouped,
            lr=p.progress.mean_lr(),
            update=p.diloco.outers[x.fragment].last_grad_norm,
            tokens=group_tokens,
        )
        p.evidence.grouped(x.round, partners, p.peer_id, adoption)
        if (passed := p.trial.applied(grouped)) is not None:
            logger.info(
                "the state adopted at round %d passed its probation (%d round(s) averaged "
                "with others since): it is this peer's own now",
                passed.round,
                passed.rounds,
            )
            p.keeper.verified = True

    def _event(
        self, x: Exchange, outcome: RoundOutcome, seconds: float, eval_loss: float | None
    ) -> dict[str, Any]:
        """The fields of an applied round's event (its digest comes once it is hashed)."""
        p = self.parts
        report = outcome.result.report
        return {
            "round": p.diloco.round,
            "fragment": x.fragment,
            "step": p.progress.steps,
            "global_step": p.progress.global_step,
            "overlap_steps": p.progress.steps - x.step,
            "group": len(report.members),
            # Of the group, the members the result holds whole (this peer among them
            # unless it was cut off somewhere), and the tokens their weights add.
            "whole": sum(outcome.whole.values()),
            "tokens": outcome.group_tokens,
            "weight": x.weight,
            "lr": self.lr(),
            "loss": p.progress.loss,
            "eval_loss": eval_loss,
            "bytes_sent": report.bytes_sent,
            "audit_bytes_sent": report.audit_bytes_sent,
            "seconds": round(seconds, 3),
            "matchmaking_seconds": round(outcome.matchmaking_s, 3),
            # The training loop's own time so far (the share of wall time it trains,
            # between any two rounds, is the difference of this over that of "time").
            "train_seconds": round(p.progress.train_seconds, 3),
            "excluded": sorted(report.excluded),
            "rejections": dict(report.rejections),
            "clipped": report.clipped,
        }
