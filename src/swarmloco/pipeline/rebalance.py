"""Rebalancing a pipelined run without a coordinator (``docs/DESIGN.md`` section 10).

A pipeline runs at its slowest stage's throughput: every micro-batch passes through one
replica of each stage. A stage's throughput is the sum of its replicas' rates (sequences
per second of their compute) from the ``stage-load`` records every peer reads. Every peer
asks :func:`choose_move` every ``every_s`` seconds whether it should move; the answer is
the same on every peer that reads the same records:

- the *source* is the stage of highest throughput, the *target* the one of lowest;
- a move is worth it only when the target is below the source by more than ``gap`` (a
  share of the source's), the source keeps at least one replica, and moving one raises
  the slower of the two by more than ``gap`` too (the target's throughput grows by what
  a replica does there, the source's falls by the mover's rate): a move costs the
  mover's warm-up and a download, and two stages never trade a replica back and forth;
- of the source's replicas, the one whose ``blake2b(peer id, epoch)`` is smallest moves
  (the epoch is the current ``every_s`` window): one mover per check, another one in the
  next window if the gap is still there;
- a peer that moved less than ``hold_s`` ago stays (its rate at the new stage must be
  measured before anyone judges it), and no move is judged while a replica's rate is
  not measured yet, except into a stage with no replica at all.

A rate is a claim, as everywhere in a record: a liar can attract a move or hold one off,
not take over a peer (the mover downloads the target stage's state from its replicas,
checked like any download), and the stage it leaves keeps a replica.
"""

from __future__ import annotations

import dataclasses
import hashlib
import statistics
from collections.abc import Iterable, Sequence

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
    """Each stage's replicas as read."""


def latest(loads: Iterable[StageLoad]) -> dict[str, StageLoad]:
    """Each peer's newest record."""
    newest: dict[str, StageLoad] = {}
    for load in loads:
        if load.peer not in newest or load.at > newest[load.peer].at:
            newest[load.peer] = load
    return newest


def stage_view(loads: Iterable[StageLoad], stages: int) -> tuple[list[list[StageLoad]], bool]:
    """Each stage's replicas (newest record per peer, stages out of range ignored), and
    whether every replica's rate is measured."""
    pools: list[list[StageLoad]] = [[] for _ in range(stages)]
    for load in latest(loads).values():
        if 0 <= load.stage < stages:
            pools[load.stage].append(load)
    measured = all(x.rate > 0 for pool in pools for x in pool)
    return pools, measured


def throughputs(pools: Sequence[Sequence[StageLoad]]) -> list[float]:
    """Each stage's throughput: its replicas' rates summed."""
    return [sum(x.rate for x in pool) for pool in pools]


def mover_key(peer: str, epoch: int) -> bytes:
    return hashlib.blake2b(f"{peer}/{epoch}".encode(), digest_size=16).digest()


def choose_move(
    loads: Iterable[StageLoad], stages: int, *, me: str, epoch: int, gap: float
) -> Move:
    """Whether peer ``me`` should move now, and to which stage (see the module)."""
    pools, measured = stage_view(loads, stages)
    t = throughputs(pools)
    seen = (tuple(round(x, 3) for x in t), tuple(len(p) for p in pools))
    mine = next((x for pool in pools for x in pool if x.peer == me), None)
    if mine is None:
        return Move(None, "this peer's record is not read yet", *seen)
    target = min(range(stages), key=lambda k: (t[k], len(pools[k]), -k))
    source = max(range(stages), key=lambda k: (t[k], len(pools[k]), -k))
    empty = not pools[target]
    if not measured and not empty:
        return Move(None, "a replica's rate is not measured yet", *seen)
    if source == target or t[target] >= (1.0 - gap) * t[source]:
        return Move(None, "the stages are balanced", *seen)
    if len(pools[source]) < 2:
        return Move(None, f"stage {source} has one replica", *seen)
    # The mover's rate at the target is not known: the target's replicas' median says
    # what a replica does there (a stage with none: any replica is better than none).
    mover = min(pools[source], key=lambda x: mover_key(x.peer, epoch))
    if not empty:
        gained = statistics.median(x.rate for x in pools[target])
        if min(t[source] - mover.rate, t[target] + gained) <= (1.0 + gap) * t[target]:
            return Move(None, "moving one replica would not raise the slowest stage", *seen)
    if mover.peer != me:
        return Move(None, f"another replica of stage {source} moves", *seen)
    why = "it has no replica" if empty else f"{t[target]:.3g} seq/s against {t[source]:.3g}"
    return Move(target, f"stage {target} limits the pipeline ({why})", *seen)


def choose_stage(loads: Iterable[StageLoad], stages: int) -> int:
    """The stage a joining peer takes: one with no replica (the later first: drivers are
    no use until every later stage has one), else the stage of least throughput when
    every rate is measured, else the one with the fewest replicas (the later on a tie)."""
    pools, measured = stage_view(loads, stages)
    if measured and all(pools):
        t = throughputs(pools)
        return min(range(stages), key=lambda k: (t[k], -k))
    return min(range(stages), key=lambda k: (len(pools[k]), -k))
