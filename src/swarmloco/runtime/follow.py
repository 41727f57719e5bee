"""Keeping this peer's state the swarm's: catching up, adopting a downloaded state, rolling
an adopted one back (DESIGN section 3, "Catching up" and "Adoption").

Before each round, and whenever pacing finds others on a later round, the
:class:`Follower` asks the network's catch-up (``runtime/catchup.py``) whether this peer's
state is older than the swarm's or in the minority, and downloads the swarm's on the
evidence that asks for. A state adopted from other peers is on probation (``Trial``):
a training loss that explodes or turns NaN rolls it back to the last state this peer
verified itself. Either way the local steps since the last round are dropped, and an
urgent checkpoint keeps what was taken.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from swarmloco.core.adoption import Reference
from swarmloco.errors import SwarmlocoError
from swarmloco.net.state import DownloadedState
from swarmloco.runtime.parts import PeerParts

logger = logging.getLogger(__name__)

RETRY_S = 2.0
"""How long a peer behind the swarm trains on before it looks for the swarm's state again
(its digests may not be published yet, its donors busy)."""
INITIAL_RETRY_S = 2.0


class Follower:
    """See the module. ``peak_lr(rounds)``: the highest inner learning rate over the next
    ``rounds`` rounds (what bounds how far they can move a state); ``reset_optimizer``:
    clears the inner optimizer's moments (every rank's); ``checkpoint``: an urgent save."""

    def __init__(
        self,
        parts: PeerParts,
        *,
        peak_lr: Callable[[int], float | None],
        reset_optimizer: Callable[[], None],
        checkpoint: Callable[[], None],
    ) -> None:
        self.parts = parts
        self.peak_lr = peak_lr
        self.reset_optimizer = reset_optimizer
        self.checkpoint = checkpoint
        self.downloads = 0
        self._retry_at = 0.0

    def may_look(self) -> bool:
        """Whether it is time to look for a later state again (see :meth:`looked`)."""
        return time.monotonic() >= self._retry_at

    def looked(self) -> None:
        """Others work on a later round and its state was looked for: if none was to be
        had yet (digests not published, donors busy), train on and look again later."""
        self._retry_at = time.monotonic() + RETRY_S

    def catch_up(self) -> None:
        """Download the swarm's state if this peer's is older or in the minority, on the
        evidence ``runtime/catchup.py`` asks for.

        Peers that claim later rounds no adoptable state backs (liars, or a lone peer ahead
        of everyone) are left out of pacing for a while instead of stalling this one, and
        the holders of a state refused after its download for longer.
        """
        p = self.parts
        p.snapshots.finish(wait=True)  # this peer's own digest of its last round
        current = p.snapshots.current
        assert current is not None
        current_round = p.diloco.round
        try:
            found = p.loop.run(
                p.network.catchup.find(
                    round=current_round,
                    digest=current.digest if current_round > 0 else None,
                    reference=self.reference(),
                    distrusted=p.trial.distrusted_now(time.monotonic()),
                    distrusted_digests=frozenset(p.trial.distrusted_digests),
                    peak_lr=self.peak_lr,
                ),
                timeout=p.config.catchup.state_timeout_s + 30.0,
            )
        except (SwarmlocoError, TimeoutError) as exc:
            logger.warning("could not catch up with the swarm: %s", exc)
            return
        p.trial.heard(unbacked=found.unbacked, distrusted=found.distrusted, now=time.monotonic())
        for refusal in found.refused:
            if p.trial.first_refusal(refusal.round, refusal.digest):
                p.emit(
                    "refused",
                    round=refusal.round,
                    digest=refusal.digest,
                    holders=len(refusal.holders),
                    why=refusal.reason,
                )
        if found.failed:
            p.sheet.last_error = f"state download failed: {found.failed[-1]}"
            p.emit("download-failed", round=current_round, error=found.failed[-1])
        if found.adopted is not None:
            checked = {
                "distance": found.distance,
                "bound": found.bound,
                "momentum": found.momentum,
                "momentum_bound": found.momentum_bound,
            }
            self.take(found.adopted, found.why, checked, holders=found.adopted_holders)

    def reference(self) -> Reference:
        """This peer's own global state, which a downloaded one is checked against."""
        p = self.parts
        return Reference(
            theta_g=p.diloco.theta_g,
            momentum=p.diloco.momentum if p.diloco.round > 0 else None,
            tokens=p.diloco.tokens,
            outer_lr=p.spec.outer_lr,
            outer_momentum=p.spec.outer_momentum,
            fragments=p.diloco.fragments,
            group_cap=p.config.matchmaking.max_group_size,
        )

    def fetch_initial(self, init_digest: bytes, seed: int) -> None:
        """This model's initial weights are not the manifest's (``init_digest``) and the
        swarm has no later state yet: fetch round 0's from a peer, checked against the
        manifest's digest."""
        p = self.parts
        deadline = time.monotonic() + p.config.catchup.state_timeout_s
        while p.diloco.round == 0:
            got = p.loop.run(
                p.network.catchup.initial(init_digest),
                timeout=p.config.catchup.state_timeout_s + 30.0,
            )
            if got is not None:
                self.take(got, "this model's initial weights are not the swarm's")
                return
            self.catch_up()
            if p.diloco.round > 0:
                return
            if time.monotonic() > deadline:
                raise SwarmlocoError(
                    "this model's initial weights differ from the swarm's, and no peer serves "
                    "the swarm's state: seed torch as the swarm's creator did before building "
                    f"the model (torch.manual_seed({seed})), or join while a peer of the swarm "
                    "is up"
                )
            time.sleep(INITIAL_RETRY_S)

    def take(
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
        p = self.parts
        snap = got.snapshot
        if holders is not None and p.config.catchup.adoption.probation_rounds > 0:
            p.snapshots.finish(wait=True)
            assert p.snapshots.current is not None
            p.trial.adopt(snap, holders, own=p.snapshots.current)
            p.keeper.verified = False  # its checkpoints never replace the verified one
        p.diloco.adopt(snap)
        if p.ranges is not None:  # what landed in it decides what this peer reads
            p.ranges.adopted(p.diloco.landed)
        self.restart_from_global()
        p.progress.global_step = max(p.progress.global_step, int(p.diloco.round * p.h))
        p.snapshots.publish(snap)  # served from where it was received
        p.evidence.adopted(time.time())
        self.downloads += 1
        p.keeper.dirty = True
        self.checkpoint()  # what was downloaded is not lost to a crash
        logger.info(
            "took the swarm's state of round %d from %s: %s", p.diloco.round, got.donor, why
        )
        p.emit(
            "downloaded",
            round=p.diloco.round,
            global_step=p.progress.global_step,
            donor=str(got.donor),
            bytes=snap.nbytes,
            seconds=round(got.seconds, 3),
            why=why,
            digest=snap.digest.hex(),
            **(checked or {}),
        )

    def roll_back(self, why: str) -> None:
        """Training from the adopted state on probation went wrong (``why``): return to the
        last state this peer trained and verified itself, drop the local work since, and
        never take that state, nor anything from its holders for a while, again."""
        p = self.parts
        ended = p.trial.roll_back(time.monotonic())
        if ended is None:
            return
        probation, verified = ended
        p.keeper.verified = True
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
        self.reset_optimizer()  # its moments came from the condemned state
        p.diloco.adopt(verified)
        if p.ranges is not None:  # what landed only in the condemned state is read again
            p.ranges.adopted(p.diloco.landed)
        p.progress.global_step = int(p.diloco.round * p.h)
        self.restart_from_global()
        p.snapshots.publish(verified)
        p.sheet.last_error = f"rolled back an adopted state of round {probation.round}: {why}"
        p.keeper.dirty = True
        p.emit(
            "rolled-back",
            round=p.diloco.round,
            adopted_round=probation.round,
            digest=probation.digest.hex(),
            holders=len(probation.holders),
            why=why,
        )
        self.checkpoint()

    def restart_from_global(self) -> None:
        """The local parameters become the global state; the steps since the last round
        are dropped."""
        p = self.parts
        with p.params.view(None, read=False, write=True) as whole:
            p.diloco.take_global(whole)
        p.progress.restart()
        if p.ranges is not None:
            p.ranges.discard()  # what the dropped steps read is read again
