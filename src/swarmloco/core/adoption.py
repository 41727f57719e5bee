"""When a peer may replace its global state with another peer's (DESIGN section 8).

A peer that is behind the swarm, or whose state is in the minority of its round, downloads
a state from peers that published its digest. Records are cheap to forge: one peer can
claim any round, publish a digest for it and serve a state that matches the digest. So a
state is adopted only on evidence this peer can check:

1. **Backing** (:func:`backing`). The digest is held by at least ``quorum`` distinct peers,
   or by a *witness*: a peer this peer averaged with in one of its recent rounds (it was a
   signed member of a group this peer verified, and produced the same bytes). A fresh peer,
   which never applied a round, takes any, the most held first (trust on first use).
2. **A plausible round** (:func:`round_plausible`). The swarm cannot have applied more
   rounds since this peer's last one than time allows: at most ``max_speedup`` times as
   many as this peer's own round interval would give, plus ``round_slack``.
3. **A plausible distance** (:func:`distance_bound`), checked after the download: the
   downloaded ``theta_g`` is at most ``movement_slack`` times the median movement of this
   peer's recent outer steps per round behind (plus two rounds, for a split within the
   last ones) away from this peer's own ``theta_g``. An outer step moves in proportion to
   the inner learning rate of the steps before it, so movements are kept per unit of
   learning rate and the bound follows the schedule over the rounds missed: a peer that
   fell behind during a warmup expects the larger steps the swarm took since.

A Sybil majority (many keys that all publish and serve the same forged state) passes
backing; checks 2 and 3 bound what it gains against a peer with history. Pure: the caller
passes what it observed; :class:`Evidence` is what it keeps (and checkpoints) between
rounds.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Iterable, Mapping
from typing import Any

from swarmloco.core.config import require_int, require_positive

_HISTORY = 16  # recent rounds whose movement and interval are kept


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdoptionConfig:
    """How much evidence adopting another peer's state takes."""

    quorum: int = 2
    """Distinct holders that back a digest on their own (witnesses back it alone)."""
    witness_rounds: int = 64
    """A peer stays a witness for this many rounds after it last averaged with this one."""
    max_speedup: float = 4.0
    """Rounds may come at most this many times faster than this peer's own interval (a
    round is joined after a quarter of its steps at the earliest: see pacing)."""
    round_slack: int = 2
    """Rounds always allowed ahead, whatever the time since this peer's last round."""
    movement_slack: float = 4.0
    """A downloaded state may lie this many median outer steps per round away."""

    def __post_init__(self) -> None:
        require_int("quorum", self.quorum, minimum=1)
        require_int("witness_rounds", self.witness_rounds, minimum=1)
        require_positive("max_speedup", self.max_speedup)
        require_int("round_slack", self.round_slack, minimum=0)
        require_positive("movement_slack", self.movement_slack)


@dataclasses.dataclass
class Evidence:
    """What a peer observed itself, which no remote record can forge."""

    witnesses: dict[str, int] = dataclasses.field(default_factory=dict)
    """Peer id -> the last round it averaged with this peer."""
    movements: list[float] = dataclasses.field(default_factory=list)
    """Norms of this peer's recent outer steps (``|theta_g after - theta_g before|``)."""
    lrs: list[float] = dataclasses.field(default_factory=list)
    """The mean inner learning rate of the steps before each of ``movements`` (0: not
    known)."""
    intervals: list[float] = dataclasses.field(default_factory=list)
    """Seconds between this peer's recent consecutive applied rounds."""
    last_round_at: float | None = None
    """Unix time at which this peer's state reached its round (applied, downloaded)."""

    @property
    def fresh(self) -> bool:
        """Whether this peer never applied a round (it has nothing to hold a claim against)."""
        return not self.witnesses and not self.movements

    def grouped(self, round: int, members: Iterable[str], me: str, config: AdoptionConfig) -> None:
        """The members of a group that completed ``round`` with this peer are witnesses."""
        for peer in members:
            if peer != me:
                self.witnesses[peer] = round
        oldest = round - config.witness_rounds
        for peer in [p for p, r in self.witnesses.items() if r < oldest]:
            del self.witnesses[peer]

    def applied(
        self, movement: float, at: float, *, alone: bool = False, lr: float | None = None
    ) -> None:
        """This peer applied an outer step of norm ``movement`` at unix time ``at``, after
        inner steps of mean learning rate ``lr``; ``alone``: in a group of one. A round
        alone says nothing of the swarm's pace, so it leaves the clock of
        :func:`round_plausible` running from the last round applied with others: a peer
        that averaged alone for a while (the others out of reach or ahead) may still take
        a state that many rounds ahead."""
        if math.isfinite(movement):
            self.movements = [*self.movements, movement][-_HISTORY:]
            rate = 0.0 if lr is None or not math.isfinite(lr) or lr <= 0 else float(lr)
            self.lrs = [*self.lrs, rate][-_HISTORY:]
        if alone and self.last_round_at is not None:
            return
        if self.last_round_at is not None and at > self.last_round_at:
            self.intervals = [*self.intervals, at - self.last_round_at][-_HISTORY:]
        self.last_round_at = at

    def adopted(self, at: float) -> None:
        """This peer took another state at ``at`` (no interval: it did not train it)."""
        self.last_round_at = at

    def to_state(self) -> dict[str, Any]:
        return {
            "witnesses": dict(self.witnesses),
            "movements": list(self.movements),
            "lrs": list(self.lrs),
            "intervals": list(self.intervals),
            "last_round_at": self.last_round_at,
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> Evidence:
        last = state.get("last_round_at")
        movements = [float(m) for m in state.get("movements", [])][-_HISTORY:]
        lrs = [float(x) for x in state.get("lrs", [])][-_HISTORY:]
        return cls(
            witnesses={str(p): int(r) for p, r in dict(state.get("witnesses", {})).items()},
            movements=movements,
            lrs=lrs if len(lrs) == len(movements) else [0.0] * len(movements),
            intervals=[float(s) for s in state.get("intervals", [])][-_HISTORY:],
            last_round_at=None if last is None else float(last),
        )


def backing(holders: Iterable[str], evidence: Evidence, config: AdoptionConfig) -> str | None:
    """Why a digest held by ``holders`` is not backed, or None if it is. A fresh peer has
    nothing to hold a claim against: every digest backs itself, and the caller tries the
    most held first."""
    held = set(holders)
    if evidence.fresh or held & evidence.witnesses.keys():
        return None
    if len(held) >= config.quorum:
        return None
    return (
        f"held by {len(held)} peer(s), none of which averaged with this peer lately "
        f"(adopting takes {config.quorum} holders or one recent partner)"
    )


def round_plausible(
    ahead: int, now: float, evidence: Evidence, config: AdoptionConfig
) -> str | None:
    """Why the swarm cannot be ``ahead`` rounds past this peer by ``now``, or None."""
    if ahead <= config.round_slack or evidence.last_round_at is None or not evidence.intervals:
        return None
    interval = statistics.median(evidence.intervals)
    if interval <= 0:
        return None
    elapsed = max(0.0, now - evidence.last_round_at)
    allowed = config.round_slack + config.max_speedup * elapsed / interval
    if ahead <= allowed:
        return None
    return (
        f"{ahead} rounds ahead {elapsed:.1f}s after this peer's last round, while rounds "
        f"took {interval:.1f}s here: at most {allowed:.1f} are plausible"
    )


def distance_bound(
    ahead: int, evidence: Evidence, config: AdoptionConfig, *, lr: float | None = None
) -> float | None:
    """How far (L2) a state ``ahead`` rounds past this peer's may lie from its own
    ``theta_g``; None when this peer has not measured its outer steps yet.

    ``lr``: the highest inner learning rate the schedule reaches over those rounds, when
    known; each round missed then moves up to the median movement per unit of learning
    rate times it. Without it (or without the learning rates of the movements), the
    median movement itself."""
    if not evidence.movements:
        return None
    rounds = max(ahead, 0) + 2
    rates = [m / x for m, x in zip(evidence.movements, evidence.lrs, strict=False) if x > 0]
    if lr is not None and math.isfinite(lr) and lr > 0 and rates:
        return config.movement_slack * statistics.median(rates) * lr * rounds
    typical = statistics.median(evidence.movements)
    return config.movement_slack * typical * rounds
