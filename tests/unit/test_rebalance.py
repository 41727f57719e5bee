"""Rebalancing a pipelined run (pipeline/rebalance.py, the Rebalancer of
pipeline/daemon.py): the stage that limits the pipeline draws exactly one replica of the
most served stage per check, every peer reading the same records agrees which, nobody
moves when it would not raise the slowest stage, the last replica of a stage stays, a peer
that just moved stays, and a joining peer takes the stage the pipeline needs most."""

from __future__ import annotations

import hashlib

import pytest

from swarmloco.pipeline.daemon import Rebalancer
from swarmloco.pipeline.load import StageLoad
from swarmloco.pipeline.rebalance import RebalanceConfig, choose_move, choose_stage

NOW = 1_800_000_000.0


def replica(name: str, stage: int, rate: float, at: float = NOW) -> StageLoad:
    peer = hashlib.sha1(name.encode()).hexdigest()
    return StageLoad(
        peer=peer, stage=stage, endpoint=f"{name}:1", rate=rate, queue=0, free=4, at=at
    )


def movers(loads: list[StageLoad], stages: int, epoch: int, gap: float = 0.2) -> dict[str, int]:
    """Every peer's own verdict, as each computes it from the same records."""
    verdicts = {x.peer: choose_move(loads, stages, me=x.peer, epoch=epoch, gap=gap) for x in loads}
    return {peer: v.to for peer, v in verdicts.items() if v.to is not None}


def test_one_replica_of_the_most_served_stage_moves_to_the_one_that_limits_the_pipeline():
    loads = [replica(n, 0, 10.0) for n in "abc"] + [replica("d", 1, 4.0)]
    chosen = set()
    for epoch in range(40):
        moving = movers(loads, 2, epoch)
        assert list(moving.values()) == [1], moving  # exactly one, and to stage 1
        chosen |= moving.keys()
    # The choice is spread over the candidates by the epoch, never the stage-1 peer.
    assert chosen == {x.peer for x in loads[:3]}
    verdict = choose_move(loads, 2, me=loads[3].peer, epoch=0, gap=0.2)
    assert verdict.throughput == (30.0, 4.0) and verdict.replicas == (3, 1)


def test_nobody_moves_when_the_stages_are_within_the_gap_or_a_move_would_not_help():
    balanced = [replica("a", 0, 10.0), replica("b", 0, 10.0), replica("c", 1, 17.0)]
    assert movers(balanced, 2, epoch=1) == {}
    # 20 against 15: over the gap, but one replica less leaves stage 0 at 10 < 15.
    close = [replica("a", 0, 10.0), replica("b", 0, 10.0), replica("c", 1, 15.0)]
    verdict = choose_move(close, 2, me=close[0].peer, epoch=1, gap=0.2)
    assert verdict.to is None and "would not raise" in verdict.reason
    assert movers(close, 2, epoch=1) == {}
    # 284 against 145 (one fast and one slow replica at stage 1): a move would leave stage
    # 0 at 154, a gain of 6% on the slowest stage, not worth a move (gap 20%).
    marginal = [
        replica("a", 0, 130.0),
        replica("b", 0, 154.0),
        replica("c", 1, 6.5),
        replica("d", 1, 138.0),
    ]
    assert all(movers(marginal, 2, epoch=e) == {} for e in range(20))
    # A wider gap tolerates more.
    assert movers([replica("a", 0, 10), replica("b", 0, 10), replica("c", 1, 5)], 2, 1, 0.8) == {}


def test_the_last_replica_of_a_stage_stays_and_an_empty_stage_draws_one():
    alone = [replica("a", 0, 50.0), replica("b", 1, 1.0)]
    assert movers(alone, 2, epoch=3) == {}
    # Stage 2 has no replica: the pipeline stalls, so one of stage 0's two moves there,
    # even before every rate is measured.
    stalled = [replica("a", 0, 10.0), replica("b", 0, 0.0), replica("c", 1, 10.0)]
    assert list(movers(stalled, 3, epoch=3).values()) == [2]


def test_on_a_pinned_dataset_nobody_moves_into_or_out_of_stage_0():
    """Stage 0's peers read the run's dataset: fixed, they stay however over-served, and a
    stage with no replica draws one from the other stages only (stage 0 empty: the
    readers left at their last epoch, and the pipeline stalls rather than a peer without
    the dataset, or with no state of stage 0 to take, reading the epochs again)."""
    fixed = frozenset({0})
    readers = [replica(n, 0, 10.0) for n in "abc"] + [replica("d", 1, 4.0)]
    assert movers(readers, 2, epoch=1) != {}  # (they would move, not fixed)
    verdicts = [choose_move(readers, 2, me=x.peer, epoch=1, gap=0.2, fixed=fixed) for x in readers]
    assert [v.to for v in verdicts] == [None] * 4
    assert "read the run's dataset" in verdicts[0].reason
    # Stage 0 has no replica: nobody moves there; stage 2 is the slowest of the others.
    three = [replica("d", 1, 10.0), replica("e", 1, 10.0), replica("f", 2, 2.0)]
    verdicts = [choose_move(three, 3, me=x.peer, epoch=2, gap=0.2, fixed=fixed) for x in three]
    assert sorted(v.to for v in verdicts if v.to is not None) == [2], verdicts


def moving_into(stage: int, count: int) -> list[StageLoad]:
    """Records of keys that say they move into ``stage`` (no endpoint, no rate)."""
    return [
        StageLoad(peer=f"{i:040x}", stage=stage, endpoint="", rate=0.0, queue=0, free=0, at=NOW)
        for i in range(count)
    ]


def test_nobody_moves_into_a_stage_until_its_newest_replica_is_measured_and_no_other_waits():
    """A replica not measured yet (a mover, a newcomer) adds nothing to its stage's
    throughput, and nobody else moves into that stage until what it adds is measured. No
    other stage waits: one key publishing a record with no rate no longer holds every move
    of the run off (it did, for as long as it published). A stage counts two such records
    at most."""
    loads = [replica(n, 0, 10.0) for n in "abc"] + [replica("d", 1, 4.0), replica("e", 1, 0.0)]
    verdict = choose_move(loads, 2, me=loads[0].peer, epoch=0, gap=0.2)
    assert verdict.to is None and "stage 1 has a replica not measured yet" in verdict.reason
    assert verdict.throughput == (30.0, 4.0) and verdict.replicas == (3, 2)
    assert verdict.unmeasured == (0, 1)
    assert movers(loads, 2, epoch=0) == {}
    # A key that says it moves into stage 2 (or a stranger's record there with no rate)
    # holds no move into stage 1 off.
    three = [*loads[:4], replica("f", 2, 10.0), replica("g", 2, 10.0)]
    for held in (moving_into(2, 1), moving_into(2, 40), [replica("s", 2, 0.0)]):
        verdict = choose_move([*three, *held], 3, me=loads[0].peer, epoch=0, gap=0.2)
        assert verdict.replicas[2] == 2 + min(len(held), 2), verdict
        assert list(movers([*three, *held], 3, epoch=0).values()) == [1], verdict
    # Into stage 1 itself they hold moves off (as a claimed rate can), two counted.
    verdict = choose_move([*three, *moving_into(1, 40)], 3, me=loads[0].peer, epoch=0, gap=0.2)
    assert verdict.to is None and verdict.replicas == (3, 3, 2), verdict
    # A stage whose one measured replica has a newcomer beside it keeps it: the newcomer
    # may not work out.
    pair = [replica("a", 0, 10.0), replica("b", 0, 0.0), replica("c", 1, 2.0)]
    verdict = choose_move(pair, 2, me=pair[0].peer, epoch=0, gap=0.2)
    assert verdict.to is None and "one measured replica" in verdict.reason
    # Nothing measured anywhere: nobody moves.
    unknown = [replica(n, 0, 0.0) for n in "ab"] + [replica("c", 1, 0.0)]
    assert movers(unknown, 2, epoch=0) == {}
    stranger = choose_move(loads, 2, me="ee" * 20, epoch=0, gap=0.2)
    assert stranger.to is None and "not read yet" in stranger.reason


def test_a_stage_counts_four_records_of_one_network_the_slowest():
    """Forty keys on one machine claiming stage 1 at 1,000 seq/s: the rebalancer counts
    four of them (as a driver draws four), the slowest; an honest peer that is one of too
    many on its network is told so, and does not move."""
    honest = [replica(n, 0, 10.0) for n in "ab"] + [replica("c", 1, 10.0)]
    sybils = [
        StageLoad(peer=f"{i:040x}", stage=1, endpoint="203.0.113.7:1", rate=1000.0 + i,
                  queue=0, free=4, at=NOW)
        for i in range(40)
    ]  # fmt: skip
    verdict = choose_move([*honest, *sybils], 2, me=honest[0].peer, epoch=0, gap=0.2)
    assert verdict.replicas == (2, 5) and verdict.throughput == (20.0, 10.0 + 4006.0)
    crowd = [
        StageLoad(peer=f"{i:040x}", stage=0, endpoint="203.0.113.9:1", rate=5.0, queue=0,
                  free=4, at=NOW)
        for i in range(5)
    ]  # fmt: skip
    left_out = max(crowd, key=lambda x: x.peer)
    verdict = choose_move([*crowd, *honest], 2, me=left_out.peer, epoch=0, gap=0.2)
    assert verdict.to is None and "not counted" in verdict.reason
    assert verdict.replicas == (6, 1)


def test_a_peer_counts_at_its_newest_record_only():
    # Peer "a" moved from stage 0 to stage 1: its old record must not count at stage 0.
    loads = [
        replica("a", 0, 10.0, at=NOW - 10),
        replica("a", 1, 4.0, at=NOW),
        replica("b", 0, 10.0),
        replica("c", 1, 4.0),
    ]
    verdict = choose_move(loads, 2, me=loads[2].peer, epoch=0, gap=0.2)
    assert verdict.replicas == (1, 2) and verdict.throughput == (10.0, 8.0)


class View:
    """What the Rebalancer reads of its stage peer (the records, the swarm's clock) and
    what it tells it (a move)."""

    def __init__(self, loads: list[StageLoad], stage: int, now: list[float]) -> None:
        self.loads, self.stage, self.now = loads, stage, now
        self.reads = 0
        self.announced: list[int] = []
        self.busy = 0.0  # seconds its replica computed
        self.failed: set[str] = set()  # replicas its driver does not draw now

    def busy_seconds(self) -> float:
        return self.busy

    def unserving(self) -> set[str]:
        return self.failed

    def read_loads(self) -> list[StageLoad]:
        self.reads += 1
        return self.loads

    def swarm_clock(self) -> float:
        return NOW + self.now[0]

    def announce_move(self, stage: int) -> None:
        self.announced.append(stage)

    def working(self) -> bool:
        return self.now[0] >= 1.0  # its first micro-batch took a second


def test_the_rebalancer_checks_once_a_window_in_its_first_half_and_a_peer_that_moved_holds():
    loads = [replica(n, 0, 10.0) for n in "abc"] + [replica("d", 1, 4.0)]
    epoch = int(NOW // 10) + 2
    mover = next(x.peer for x in loads if movers(loads, 2, epoch).get(x.peer) == 1)
    now = [0.0]  # seconds since NOW, on both clocks (NOW starts a 10 s window)
    events: list[dict] = []
    config = RebalanceConfig(every_s=10.0, hold_s=100.0)
    rebalancer = Rebalancer(config, 2, mover, events.append, clock=lambda: now[0])
    view = View(loads, 0, now)
    rebalancer.arrived()
    assert rebalancer.check(view, driven=0) is None  # no work yet
    now[0] = 1.0
    assert rebalancer.check(view, driven=1) is None  # its first work: checks from 11 s
    now[0] = 10.5
    assert rebalancer.check(view, driven=5) is None and view.reads == 0
    now[0] = 17.0
    assert rebalancer.check(view, driven=5) is None and view.reads == 0  # the second half
    now[0] = 21.0
    assert rebalancer.check(view, driven=7) == 1 and view.announced == [1]
    assert events[-1]["move"] == 1 and events[-1]["driven"] == 7
    assert events[-1]["throughput"] == [30.0, 4.0] and events[-1]["replicas"] == [3, 1]
    now[0] = 22.0
    assert rebalancer.check(view, driven=7) is None and view.reads == 1  # once a window
    rebalancer.arrived()  # it moved: were the records the same, it would move again; it holds
    view.stage = 1
    now[0] = 23.0
    assert rebalancer.check(view, driven=7) is None  # it starts working there
    now[0] = 41.0
    while movers(loads, 2, int((NOW + now[0]) // 10)).get(mover) != 1:
        now[0] += 10.0
    assert rebalancer.check(view, driven=7) is None and view.reads == 2
    assert events[-1]["move"] is None and "it moved" in events[-1]["reason"]
    assert view.announced == [1]
    now[0] += 200.0
    while movers(loads, 2, int((NOW + now[0]) // 10)).get(mover) != 1:
        now[0] += 10.0
    assert rebalancer.check(view, driven=7) == 1  # the hold is over
    never = Rebalancer(RebalanceConfig(every_s=0), 2, mover, None, clock=lambda: now[0])
    never.arrived()
    for _ in range(3):
        now[0] += 1e6
        assert never.check(view, driven=0) is None


def working(
    mover: str, loads: list[StageLoad], stage: int, now: list[float], events: list[dict]
) -> tuple[Rebalancer, View]:
    """A Rebalancer (checks every 10 s) of peer ``mover`` at ``stage``, past its first
    work (at 1 s), and the View it reads."""
    rebalancer = Rebalancer(RebalanceConfig(every_s=10.0), 2, mover, events.append,
                            clock=lambda: now[0])  # fmt: skip
    view = View(loads, stage, now)
    rebalancer.arrived()
    now[0] = 1.0
    assert rebalancer.check(view, driven=0) is None  # its first work
    return rebalancer, view


def early_in(epoch: int) -> float:
    """Seconds since NOW early in the 10 s window ``epoch`` (its first half)."""
    return epoch * 10 - NOW + 1.0


def test_a_mover_busier_than_the_records_allow_stays_so_keys_claiming_its_stage_drain_nothing():
    """Forty keys on one address claim to serve stage 1 at 1,000 seq/s each. By the records
    stage 1 is over-served and one of its two honest replicas is drawn to move; were that
    so, the pipeline (at most stage 0's 20 seq/s) could keep it busy 0.05% of the time. It
    computed half of it: its own work says the records overstate its stage, and it stays.
    (Without this, both honest replicas left within 42 windows.) A replica that computed
    as little as the records allow moves as before."""
    honest = [replica(n, 0, 10.0) for n in "ab"] + [replica(n, 1, 10.0) for n in "cd"]
    sybils = [replica(f"s{i}", 1, 1000.0) for i in range(40)]
    loads = honest + sybils
    now = [0.0]
    windows = (int((NOW + t) // 10) for t in range(21, 100_000, 10))
    epoch = next(e for e in windows if set(movers(loads, 2, e)) & {x.peer for x in honest[2:]})
    mover = next(iter(set(movers(loads, 2, epoch)) & {x.peer for x in honest[2:]}))
    events: list[dict] = []
    rebalancer, view = working(mover, loads, 1, now, events)
    now[0] = early_in(epoch)  # the window the mover is drawn in
    view.busy = 0.5 * (now[0] - 1.0)
    assert rebalancer.check(view, driven=0) is None
    assert events[-1]["move"] is None and "it stays: it computed 50%" in events[-1]["reason"]
    assert view.announced == []
    # Where the records are true, a replica of the over-served stage is that idle: it moves.
    name = next(n for n in "cd" if replica(n, 1, 0.0).peer == mover)
    true = [replica(n, 0, 10.0) for n in ("a", "b", name)] + [replica("x", 1, 4.0)]
    later = next(e for e in range(epoch + 1, epoch + 1000) if movers(true, 2, e).get(mover))
    view.loads, view.stage = true, 0
    start = now[0]
    now[0] = early_in(later)
    view.busy += 0.1 * (now[0] - start)  # 10%, against the 13% the records allow
    assert rebalancer.check(view, driven=0) == 1, events[-1]


def test_a_driver_counts_no_record_of_a_replica_that_serves_it_nothing():
    """Stage 1's honest replica is gone; forty keys, each claiming an address of its own
    (so no network cap holds them), claim stage 1 at 1,000 seq/s and serve nothing. By
    the records stage 1 is the most served stage, and nobody moves there: the pipeline
    stalls. A stage-0 peer's driver tried them and does not draw them now: to it stage 1
    has no replica, and one of the two stage-0 peers moves there."""
    honest = [replica(n, 0, 10.0) for n in "ab"]
    fakes = [replica(f"203.0.{i}.1", 1, 1000.0) for i in range(40)]
    loads = [*honest, *fakes]
    mine = {x.peer for x in honest}
    assert all(not set(movers(loads, 2, epoch=e)) & mine for e in range(20))
    now = [0.0]
    windows = (int((NOW + t) // 10) for t in range(21, 100_000, 10))
    gone = {x.endpoint for x in fakes}
    epoch = next(e for e in windows if movers(honest, 2, e))  # stage 1 empty
    mover = next(iter(movers(honest, 2, epoch)))
    events: list[dict] = []
    rebalancer, view = working(mover, loads, 0, now, events)
    now[0] = early_in(epoch)
    view.failed = gone
    assert rebalancer.check(view, driven=0) == 1, events[-1]
    assert "no replica" in events[-1]["reason"] and events[-1]["replicas"] == [2, 0]
    # Without its driver's word it reads the records, and stays.
    other, view = working(mover, loads, 0, now, events)
    now[0] = early_in(epoch)
    assert other.check(view, driven=0) is None and events[-1]["replicas"] == [2, 40]


def test_a_joining_peer_takes_a_stage_with_no_replica_else_the_one_of_least_throughput():
    assert choose_stage([replica("a", 0, 10.0)], 3) == 2
    measured = [replica("a", 0, 10.0), replica("b", 1, 3.0), replica("c", 1, 3.0)]
    assert choose_stage(measured, 2) == 1  # 6 seq/s against 10, though it has more peers
    # A replica not measured yet counts as its stage's typical one: 3 + 3 against 10.
    unmeasured = [replica("a", 0, 10.0), replica("b", 1, 0.0), replica("c", 1, 3.0)]
    assert choose_stage(unmeasured, 2) == 1
    unknown = [replica("a", 0, 0.0), replica("b", 1, 0.0), replica("c", 1, 0.0)]
    assert choose_stage(unknown, 2) == 0  # no rate measured: the fewest peers


@pytest.mark.parametrize("bad", [{"every_s": -1.0}, {"gap": 1.0}, {"gap": -0.1}, {"hold_s": -5.0}])
def test_a_bad_rebalance_setting_is_refused(bad):
    with pytest.raises(ValueError):
        RebalanceConfig(**bad)
