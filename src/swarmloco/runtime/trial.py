"""A peer's trust in the states it adopts: the adopted state on trial, what a rollback
returns to, and whom the peer no longer believes (DESIGN section 3, "Adoption").

A state downloaded from other peers is *on probation* until this peer has averaged
enough rounds with others from it (``AdoptionConfig.probation_rounds``); meanwhile the
peer keeps the last state it trained and verified itself (the *fallback*). A training
loss that explodes or turns NaN *condemns* the adopted state: at the next step boundary
the peer rolls back to the fallback, and never takes that state again (its digest is
remembered) nor anything from its holders for a while.

Pacing leaves out, for a while, peers that claim later rounds no adoptable state backs
(liars, or a lone peer ahead of everyone), and longer the holders of a state refused
after its download.

:class:`Trial` keeps that bookkeeping; the peer (``Swarm``) does what it implies to the
model, the optimizer and the global state.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable, Mapping
from typing import Any

from swarmloco.core.adoption import AdoptionConfig, Probation, recent_losses
from swarmloco.core.state import StateSnapshot

UNBACKED_S = 10.0
"""How long a claim of a later round that no adoptable state backs is ignored."""
DISTRUSTED_S = 600.0
"""How long the holders of a refused state are not asked again."""
ROLLED_BACK_S = 60.0
"""How long the holders of a state rolled back are not asked again."""
MAX_DISTRUSTED_DIGESTS = 1024
"""States rolled back, remembered (the newest)."""


class Trial:
    """See the module. Times are the peer's monotonic clock."""

    def __init__(self, adoption: AdoptionConfig) -> None:
        self.adoption = adoption
        self.probation: Probation | None = None
        """The adopted state on trial, while it is."""
        self.fallback: StateSnapshot | None = None
        """The last state this peer trained (or checked against the manifest) itself, kept
        while an adopted one is on probation: what a rollback returns to."""
        self.condemned: str | None = None
        """Why the state on probation is to be rolled back, at the next step boundary."""
        self.losses: collections.deque[float] = collections.deque(maxlen=8)
        """The last finite training losses (a probation's reference)."""
        self.distrusted: dict[str, float] = {}
        """Peers not asked for a state until then."""
        self.unbacked: dict[str, float] = {}
        """Peers whose claims of later rounds pacing ignores until then."""
        self.distrusted_digests: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        """States rolled back: never adopted again."""
        self._told: set[tuple[int, str]] = set()

    # -- probation ------------------------------------------------------------------------------

    def loss(self, value: float) -> None:
        """A training loss: kept as a reference, and judged while a state is on trial."""
        if math.isfinite(value):
            self.losses.append(value)
        if self.probation is not None and self.condemned is None:
            self.condemned = self.probation.loss(value, self.adoption)

    def adopt(self, snapshot: StateSnapshot, holders: Iterable[str], own: StateSnapshot) -> None:
        """``snapshot``, vouched for by ``holders``, becomes this peer's state on trial;
        ``own`` is the state it replaces (the fallback, unless a state adopted earlier is
        still on trial: a second adoption keeps the first one's fallback)."""
        if self.probation is None:
            self.fallback = own
        self.probation = Probation(
            round=snapshot.round,
            digest=snapshot.digest,
            holders=tuple(holders),
            before=recent_losses(self.losses),
        )
        self.condemned = None

    def applied(self, grouped: bool) -> Probation | None:
        """A round was applied (``grouped``: with others): the probation it completes,
        which then ends (the adopted state is this peer's own); else None."""
        probation = self.probation
        if probation is None or not probation.round_applied(grouped, self.adoption):
            return None
        self.probation = self.fallback = None
        return probation

    def end(self) -> None:
        """The state on trial is this peer's own now (no fallback to return to)."""
        self.probation = self.fallback = self.condemned = None

    def roll_back(self, now: float) -> tuple[Probation, StateSnapshot] | None:
        """End the trial in failure: the probation and the fallback to return to (None
        when there is nothing to roll back to). The state is never taken again; its holders
        are not asked for another for a while (they may be honest peers whose state
        training here disagreed with: pacing keeps hearing them)."""
        probation, fallback = self.probation, self.fallback
        self.end()
        if probation is None or fallback is None:
            return None
        self.distrusted_digests[probation.digest] = None
        while len(self.distrusted_digests) > MAX_DISTRUSTED_DIGESTS:
            self.distrusted_digests.popitem(last=False)
        until = now + ROLLED_BACK_S
        for peer in probation.holders:
            self.distrusted[peer] = max(self.distrusted.get(peer, 0.0), until)
        return probation, fallback

    # -- what the catch-up found ----------------------------------------------------------------

    def distrusted_now(self, now: float) -> set[str]:
        return {peer for peer, until in self.distrusted.items() if until > now}

    def heard(self, *, unbacked: Iterable[str], distrusted: Iterable[str], now: float) -> None:
        """A look for the swarm's state found claims no adoptable state backs
        (``unbacked``) and the holders of states it refused (``distrusted``)."""
        for peer in unbacked:
            self.unbacked[peer] = now + UNBACKED_S
        for peer in distrusted:
            self.distrusted[peer] = now + DISTRUSTED_S
            self.unbacked[peer] = now + DISTRUSTED_S

    def first_refusal(self, round: int, digest: str) -> bool:
        """Whether the refusal of this state is news (told once per state, not at every
        look)."""
        key = (round, digest)
        if key in self._told:
            return False
        self._told.add(key)
        return True

    # -- checkpoints ----------------------------------------------------------------------------

    def to_state(self) -> dict[str, Any] | None:
        return None if self.probation is None else self.probation.to_state()

    def load_state(self, state: Mapping[str, Any] | None) -> None:
        """A checkpoint's probation (None: none); its fallback is found apart."""
        self.probation = Probation.from_state(state) if state is not None else None
