"""Rebalancing a pipelined run without a coordinator (``docs/DESIGN.md`` section 10).

A pipeline runs at its slowest stage's throughput: every micro-batch passes through one
replica of each stage. A stage's throughput is the sum of its replicas' rates (sequences
per second of their compute) from the ``stage-load`` records every peer reads. Every peer
asks :func:`choose_move` every ``every_s`` seconds whether it should move; the answer is
the same on every peer that reads the same records:

- the *source* is the stage of highest throughput, the *target* the one of lowest;
- a move is worth it only when the target is below the source by more than ``gap`` (a
  share of the source's), the source keeps at least one measured replica, and moving one
  raises the slower of the two by more than ``gap`` too (the target's throughput grows by
  what a replica does there, the source's falls by the mover's rate): a move costs the
  mover's warm-up and a download, and two stages never trade a replica back and forth;
- of the source's replicas, the one whose ``blake2b(peer id, epoch)`` is smallest moves
  (the epoch is the current ``every_s`` window): one mover per check, another one in the
  next window if the gap is still there;
- a peer that moved less than ``hold_s`` ago stays (its rate at the new stage must be
  measured before anyone judges it), and nobody moves into a stage with a replica not
  measured yet (a mover, a newcomer: what it adds is measured first); a stage with no
  replica at all draws one at once.

A rate is a claim, as everywhere in a record: a liar can attract a move or hold one off,
not take over a peer (the mover downloads the target stage's state from its replicas,
checked like any download), and the stage it leaves keeps a replica. What many keys can
claim is bounded: a stage counts at most :data:`RECORDS_PER_NETWORK` measured records of
one network and :data:`UNMEASURED_PER_STAGE` unmeasured ones (:func:`stage_view`).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import statistics
from collections.abc import Iterable, Sequence

from swarmloco.net.endpoints import endpoint_network
from swarmloco.pipeline.load import StageLoad


@dataclasses.dataclass(frozen=True, kw_only=True)
class RebalanceConfig:
    every_s: float = 30.0
    """How often a peer asks whether it should move (0: never; the peer keeps its stage)."""
    gap: float = 0.2
    """Move only when the slowest stage's throughput is below the fastest's by more than
    this share of it."""
    hold_s: float = 300.0
    """A peer that moved stays at least this long."""

    def __post_init__(self) -> None:
        if self.every_s < 0:
            raise ValueError(f"every_s must be >= 0 (0: never move), got {self.every_s}")
        if not 0.0 <= self.gap < 1.0:
            raise ValueError(f"gap must be in [0, 1), got {self.gap}")
        if self.hold_s < 0:
            raise ValueError(f"hold_s must be >= 0, got {self.hold_s}")


@dataclasses.dataclass(frozen=True)
class Move:
    """A peer's verdict at one check: where it goes (None: it stays) and why."""

    to: int | None
    reason: str
    throughput: tuple[float, ...] = ()
    """Each stage's throughput as read (sequences per second; 0: no replica)."""
    replicas: tuple[int, ...] = ()
    """Each stage's replicas as counted."""
    unmeasured: tuple[int, ...] = ()
    """Of those, each stage's not measured yet (adding nothing to its throughput)."""


RECORDS_PER_NETWORK = 4
"""A stage's serving records counted per source network (the /24 of a public IPv4
address, the /64 of an IPv6 one), the slowest first: as many as a driver draws from
(``DriverConfig.replicas_per_network``)."""
UNMEASURED_PER_STAGE = 2
"""A stage's records of peers not measured yet (one moving in, one that has not computed
enough yet) counted: honest peers move one at a time into a stage."""


def latest(loads: Iterable[StageLoad]) -> dict[str, StageLoad]:
    """Each peer's newest record."""
    newest: dict[str, StageLoad] = {}
    for load in loads:
        if load.peer not in newest or load.at > newest[load.peer].at:
            newest[load.peer] = load
    return newest


def stage_view(loads: Iterable[StageLoad], stages: int) -> list[list[StageLoad]]:
    """Each stage's counted replicas: the newest record of each peer (stages out of range
    ignored), of the measured ones at most :data:`RECORDS_PER_NETWORK` of one network at
    one stage (the slowest, then by peer id), of the others at most
    :data:`UNMEASURED_PER_STAGE` a stage (by peer id). Every peer reading the same records
    counts the same ones."""
    pools: list[list[StageLoad]] = [[] for _ in range(stages)]
    taken: collections.Counter[tuple[int, str]] = collections.Counter()
    unmeasured: collections.Counter[int] = collections.Counter()
    for load in sorted(latest(loads).values(), key=lambda x: (x.rate, x.peer)):
        if not 0 <= load.stage < stages:
            continue
        if load.rate > 0:
            network = (load.stage, endpoint_network(load.endpoint))
            if taken[network] >= RECORDS_PER_NETWORK:
                continue
            taken[network] += 1
        else:
            if unmeasured[load.stage] >= UNMEASURED_PER_STAGE:
                continue
            unmeasured[load.stage] += 1
        pools[load.stage].append(load)
    return pools


def typical_rates(pools: Sequence[Sequence[StageLoad]]) -> list[float | None]:
    """What a replica of each stage does: the median of its measured rates, else of every
    stage's (None: no rate is measured anywhere)."""
    everywhere = [x.rate for pool in pools for x in pool if x.rate > 0]
    if not everywhere:
        return [None] * len(pools)
    run = statistics.median(everywhere)
    typical: list[float | None] = []
    for pool in pools:
        rates = [x.rate for x in pool if x.rate > 0]
        typical.append(statistics.median(rates) if rates else run)
    return typical


def throughputs(pools: Sequence[Sequence[StageLoad]], *, expected: bool = False) -> list[float]:
    """Each stage's throughput: its replicas' rates summed; one not measured yet adds
    nothing, or (``expected``) what a replica of its stage does (:func:`typical_rates`)."""
    typical = typical_rates(pools) if expected else [None] * len(pools)
    return [
        sum(x.rate if x.rate > 0 else typical[k] or 0.0 for x in pool)
        for k, pool in enumerate(pools)
    ]


def mover_key(peer: str, epoch: int) -> bytes:
    return hashlib.blake2b(f"{peer}/{epoch}".encode(), digest_size=16).digest()


def choose_move(
    loads: Iterable[StageLoad],
    stages: int,
    *,
    me: str,
    epoch: int,
    gap: float,
    fixed: frozenset[int] = frozenset(),
) -> Move:
    """Whether peer ``me`` should move now, and to which stage (see the module).
    ``fixed``: stages nobody moves into or out of (stage 0 of a run on a pinned dataset:
    its peers are the dataset's readers)."""
    loads = list(loads)
    pools = stage_view(loads, stages)
    t = throughputs(pools)
    seen = (
        tuple(round(x, 3) for x in t),
        tuple(len(p) for p in pools),
        tuple(sum(1 for x in p if x.rate <= 0) for p in pools),
    )
    mine = next((x for pool in pools for x in pool if x.peer == me), None)
    if mine is None:
        if me in latest(loads):
            return Move(None, "this peer's record is not counted at its stage", *seen)
        return Move(None, "this peer's record is not read yet", *seen)
    if mine.stage in fixed:
        return Move(None, f"stage {mine.stage}'s peers stay (they read the run's dataset)", *seen)
    movable = [k for k in range(stages) if k not in fixed]
    target = min(movable, key=lambda k: (t[k], len(pools[k]), -k))
    source = max(movable, key=lambda k: (t[k], len(pools[k]), -k))
    empty = not pools[target]
    measured = [x.rate for x in pools[target] if x.rate > 0]
    if len(measured) < len(pools[target]):
        # A mover or a newcomer there: what it adds is measured before anyone else is
        # drawn in. Only this stage waits (one record with no rate once held every move).
        return Move(None, f"stage {target} has a replica not measured yet", *seen)
    if source == target or t[target] >= (1.0 - gap) * t[source]:
        return Move(None, "the stages are balanced", *seen)
    # Into a stage with no replica any replica is better than none (the pipeline stalls:
    # nobody is measured anew); otherwise the source keeps a measured one (one not
    # measured yet may not work out), and one not measured there does not move again.
    candidates = pools[source] if empty else [x for x in pools[source] if x.rate > 0]
    if len(candidates) < 2:
        kept = "replica" if empty else "measured replica"
        return Move(None, f"stage {source} has one {kept}", *seen)
    # The mover's rate at the target is not known: the median of the target's replicas
    # says what it would add.
    mover = min(candidates, key=lambda x: mover_key(x.peer, epoch))
    if not empty:
        gained = statistics.median(measured)
        if min(t[source] - mover.rate, t[target] + gained) <= (1.0 + gap) * t[target]:
            return Move(None, "moving one replica would not raise the slowest stage", *seen)
    if mover.peer != me:
        return Move(None, f"another replica of stage {source} moves", *seen)
    why = "it has no replica" if empty else f"{t[target]:.3g} seq/s against {t[source]:.3g}"
    return Move(target, f"stage {target} limits the pipeline ({why})", *seen)


def choose_stage(loads: Iterable[StageLoad], stages: int) -> int:
    """The stage a joining peer takes: one with no replica (the later first: drivers are
    no use until every later stage has one), else the stage of least throughput (a
    replica not measured yet counted at what its stage's replicas do) once a rate is
    measured, else the one with the fewest replicas (the later on a tie)."""
    pools = stage_view(loads, stages)
    if all(pools) and typical_rates(pools)[0] is not None:
        t = throughputs(pools, expected=True)
        return min(range(stages), key=lambda k: (t[k], -k))
    return min(range(stages), key=lambda k: (len(pools[k]), -k))
