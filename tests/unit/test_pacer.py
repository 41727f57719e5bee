"""The pacer alone, over progress records given as data: when a round is due, when a peer
is behind, whom matchmaking waits for, and whose claims count (runtime/pacer.py)."""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time

import pytest

from swarmloco.core.adoption import Evidence
from swarmloco.core.pacing import ProgressReport, Verdict
from swarmloco.net.records import FAREWELL_AT
from swarmloco.runtime.config import PeerConfig
from swarmloco.runtime.loop_thread import LoopThread
from swarmloco.runtime.pacer import EXPECTED_STRANGERS, MAX_WAIT_ROUNDS, STEP_SPREAD, Pacer
from swarmloco.runtime.progress import LocalProgress

H = 10
TOKENS = 100  # a step's
NOW = 1_700_000_000.0


@dataclasses.dataclass
class Board:
    """The progress records as the network last read them (what the pacer reads of it)."""

    reports: list[ProgressReport] = dataclasses.field(default_factory=list)
    reads: int = 2
    late: tuple[int, int] | None = None
    aborted: set[int] = dataclasses.field(default_factory=set)
    wakes: int = 0

    def wake(self) -> None:
        self.wakes += 1

    def wait_for_reads(self, count: int, timeout: float) -> bool:
        return self.reads >= count

    def late_group_aborted(self, round: int) -> bool:
        return round in self.aborted


def report(peer: str, round: int, tokens: int = 0, rate: float = 1e9) -> ProgressReport:
    return ProgressReport(peer=peer, round=round, tokens=tokens, tokens_per_s=rate, at=NOW)


def pacer(loop: LoopThread, board: Board, tmp_path, *, steps: int, **kw) -> Pacer:
    progress = LocalProgress()
    for i in range(steps):
        progress.stepped(TOKENS, 1e-3, now=float(i))
    return Pacer(
        network=board,  # type: ignore[arg-type]
        wake=board.wake,
        config=PeerConfig(data_dir=tmp_path, progress_interval_s=1.0),
        peer_id="me",
        h=H,
        progress=progress,
        evidence=kw.get("evidence", Evidence()),
        unbacked=kw.get("unbacked", {}),
        now=lambda: NOW,
    )


def test_alone_a_round_is_due_after_h_steps(tmp_path):
    with LoopThread() as loop:
        board = Board()
        assert pacer(loop, board, tmp_path, steps=0).verdict(4) is Verdict.WAIT
        assert pacer(loop, board, tmp_path, steps=H - 1).verdict(4) is Verdict.WAIT
        assert pacer(loop, board, tmp_path, steps=H).verdict(4) is Verdict.DUE


def test_a_partner_with_the_other_half_of_the_tokens_makes_the_round_due_early(tmp_path):
    with LoopThread() as loop:
        # Two peers working on round 5: the round wants 2 x H steps' tokens between them.
        half = H * TOKENS
        board = Board(reports=[report("b", 5, tokens=half + TOKENS, rate=1.0)])
        assert pacer(loop, board, tmp_path, steps=H // 2).verdict(4) is Verdict.WAIT
        assert pacer(loop, board, tmp_path, steps=H).verdict(4) is Verdict.DUE


def test_each_peer_does_h_of_its_own_steps_whatever_a_step_trains_on(tmp_path, caplog):
    """A partner whose step trains on ten times this peer's tokens: the round wants H steps
    of each (H x 11 steps' worth of this peer's tokens), not 2 H of this peer's, which its
    partner's tokens alone would reach after two of its steps. A partner that says none
    counts as this peer's own; a claim is bounded to STEP_SPREAD of it."""
    with LoopThread() as loop:
        big = 10 * TOKENS

        def partner(steps: int, step_tokens: int | None = big) -> Board:
            said = dataclasses.replace(report("b", 5, tokens=steps * big, rate=1.0),
                                       step_tokens=step_tokens)  # fmt: skip
            return Board(reports=[said])

        assert pacer(loop, partner(5), tmp_path, steps=5).verdict(4) is Verdict.WAIT
        assert pacer(loop, partner(H - 1), tmp_path, steps=H - 1).verdict(4) is Verdict.WAIT
        assert pacer(loop, partner(H), tmp_path, steps=H).verdict(4) is Verdict.DUE
        # Said as this peer's own (a peer before the field): 2 H of this peer's steps.
        assert pacer(loop, partner(2, None), tmp_path, steps=1).verdict(4) is Verdict.DUE
        # A claim of a billion tokens a step counts as STEP_SPREAD of this peer's: the round
        # is due once the claimant did H such steps and this peer H of its own.
        spread = int(STEP_SPREAD) * TOKENS
        said = report("b", 5, tokens=H * spread - TOKENS, rate=1.0)
        liar = Board(reports=[dataclasses.replace(said, step_tokens=10**9)])
        assert pacer(loop, liar, tmp_path, steps=H - 1).verdict(4) is Verdict.WAIT
        liar.reports = [dataclasses.replace(said, tokens=H * spread, step_tokens=10**9)]
        assert pacer(loop, liar, tmp_path, steps=H).verdict(4) is Verdict.DUE
        # A peer whose step is far from what the others say is told so, once (a library
        # peer left at tokens_per_step 1); claims within STEP_SPREAD are not worth a word.
        caplog.clear()  # (the pacers above said it too, once each)
        with caplog.at_level(logging.WARNING, logger="swarmloco.runtime.pacer"):
            assert pacer(loop, partner(H), tmp_path, steps=H).verdict(4) is Verdict.DUE
            assert not caplog.records
            told = pacer(loop, liar, tmp_path, steps=H)
            for _ in range(3):
                told.verdict(4)
        (said_once,) = caplog.records
        assert "more than 64x apart" in said_once.getMessage()
        assert "1,000,000,000 a step" in said_once.getMessage()
        # And whatever anyone claims, a peer waits no longer than MAX_WAIT_ROUNDS x H steps.
        idle = Board(reports=[dataclasses.replace(said, tokens=0, step_tokens=10**9)])
        assert pacer(loop, idle, tmp_path, steps=MAX_WAIT_ROUNDS * H - 1).verdict(4) is Verdict.WAIT
        assert pacer(loop, idle, tmp_path, steps=MAX_WAIT_ROUNDS * H).verdict(4) is Verdict.DUE


def test_a_later_round_claimed_makes_a_peer_behind_unless_its_claimant_is_unbacked(tmp_path):
    with LoopThread() as loop:
        board = Board(reports=[report("liar", 10**6)])
        assert pacer(loop, board, tmp_path, steps=1).verdict(4) is Verdict.BEHIND
        unbacked = {"liar": time.monotonic() + 60}
        p = pacer(loop, board, tmp_path, steps=1, unbacked=unbacked)
        assert p.fresh_reports(4) == [] and p.verdict(4) is Verdict.WAIT


def test_once_a_partner_is_heard_strangers_claims_do_not_count(tmp_path):
    with LoopThread() as loop:
        partners = Evidence(witnesses={"b": 4})
        board = Board(reports=[report("b", 5), report("stranger", 10**6)])
        p = pacer(loop, board, tmp_path, steps=1, evidence=partners)
        assert p.verdict(4) is Verdict.WAIT
        board.reports = [report("stranger", 10**6)]  # every partner silent: on its own
        assert p.verdict(4) is Verdict.BEHIND


def test_matchmaking_waits_for_partners_and_a_few_strangers_not_for_those_who_left(tmp_path):
    with LoopThread() as loop:
        near = [report(f"s{i}", 5) for i in range(6)]
        p = pacer(loop, Board(reports=near), tmp_path, steps=1)
        p.verdict(4)
        assert p.expected == (7, 0)  # no partners: everyone near is waited for
        partners = Evidence(witnesses={"s0": 4, "s1": 4})
        p = pacer(loop, Board(reports=near), tmp_path, steps=1, evidence=partners)
        p.verdict(4)
        assert p.expected == (3, EXPECTED_STRANGERS)
        # The last group's members count even while their reports lag; not one that left.
        board = Board(reports=[report("s0", 5), report("gone", 3)])
        board.reports.append(dataclasses.replace(report("gone", 3), at=FAREWELL_AT))
        p = pacer(loop, board, tmp_path, steps=1)
        p.last_group = (4, frozenset({"s0", "lagging", "gone"}))
        p.verdict(4)
        assert p.expected[0] == 3  # this peer, s0 and the lagging one


def test_peers_that_miss_two_attempts_at_a_round_are_waited_for_as_strangers(tmp_path):
    with LoopThread() as loop:
        partners = Evidence(witnesses={"p": 4})
        board = Board(reports=[report("p", 5), report("claims", 5)])
        alone = pacer(loop, Board(reports=[report("claims", 5)]), tmp_path, steps=1)
        together = pacer(loop, board, tmp_path, steps=1, evidence=partners)
        alone.verdict(4)
        assert alone.expected == (2, 0)  # no partner heard: every claimant is expected
        alone.no_show(5)  # (one attempt is no sign: a peer may be a little late)
        alone.verdict(4)
        assert alone.expected == (2, 0)
        alone.no_show(5)
        alone.verdict(4)
        assert alone.expected == (1, 1)  # a stranger now: a short grace, not the round
        alone.verdict(5)  # the next round too
        assert alone.expected == (1, 1)
        # Aborts of different rounds do not add up; a partner that misses two is no
        # different (a stuck peer whose network still reports).
        together.verdict(4)
        assert together.expected == (2, 1)
        together.no_show(5)
        together.verdict(5)
        together.no_show(6)
        together.verdict(4)
        assert together.expected == (2, 1)
        together.no_show(5)
        together.verdict(4)
        assert together.expected == (2, 1)  # (the no-show count restarted at round 5)
        together.no_show(5)
        together.verdict(4)
        assert together.expected == (1, 2)


def test_a_peer_late_for_its_group_waits_for_its_result_until_that_group_aborts(tmp_path):
    with LoopThread() as loop:
        board = Board()
        p = pacer(loop, board, tmp_path, steps=H)
        p.wait_for_late_group(5, time.monotonic() + 600, numel=1000)
        assert board.late == (5, 1000)
        assert p.verdict(4) is Verdict.BEHIND
        board.aborted.add(5)
        assert p.verdict(4) is Verdict.DUE and p.late is None and board.late is None


def _round_of_two(step_s: float, b_lag: float, publish: tuple[float, float], tmp_path) -> list[int]:
    """Two peers start a round together and step every ``step_s`` (b ``b_lag`` of a step
    behind a), each publishing its progress every 2 s (first at ``publish``'s times) and
    deciding after each of its steps; the steps each had trained when its round was due."""
    clock = [0.0]
    interval = 2.0
    boards = {name: Board() for name in "ab"}
    progress: dict[str, LocalProgress] = {}
    pacers: dict[str, Pacer] = {}
    for name in "ab":
        progress[name] = LocalProgress(clock=lambda: clock[0])
        progress[name].rate.add(TOKENS, step_s)  # trained before: its rate is known
        progress[name].round_started(0.0)
        pacers[name] = Pacer(
            network=boards[name],  # type: ignore[arg-type]
            wake=boards[name].wake,
            config=PeerConfig(data_dir=tmp_path, progress_interval_s=interval),
            peer_id=name,
            h=4,
            progress=progress[name],
            evidence=Evidence(witnesses={"a": 0, "b": 0}),
            unbacked={},
            now=lambda: clock[0],
        )
    timeline = sorted(
        [
            (b_lag * step_s * (name == "b") + k * step_s, "step", name)
            for name in "ab"
            for k in range(1, 40)
        ]
        + [
            (start + j * interval, "publish", name)
            for name, start in zip("ab", publish)
            for j in range(40)
        ]
    )
    due: dict[str, int] = {}
    for at, what, name in timeline:
        if name in due:
            continue
        clock[0] = at
        p = progress[name]
        if what == "publish":
            boards["b" if name == "a" else "a"].reports = [
                ProgressReport(
                    peer=name,
                    round=1,
                    tokens=p.tokens_since_round,
                    tokens_per_s=p.rate.value,
                    at=at,
                )
            ]
            continue
        p.stepped(TOKENS, 1e-3, now=at)
        if pacers[name].verdict(0) is Verdict.DUE:
            due[name] = p.steps_since_round
        p.hook_ended(at, lambda: clock[0])
    return [due["a"], due["b"]]


@pytest.mark.parametrize("step_s", [0.005, 0.1, 1.0])
def test_two_peers_are_due_after_h_steps_each_whatever_their_step_time(tmp_path, step_s):
    """Decisions come between steps, and another peer's tokens are projected from a report
    made between its steps: waiting until the projection reaches the target ran one step
    too many at slow steps (a median of 5 steps a round at H = 4 and 1 s a step). The round
    is due when the target is nearer now than after another step."""
    per_round = [
        steps
        for lag in (0.0, 0.3, 0.7)
        for publish in ((0.1, 0.3), (0.6, 1.4), (1.1, 1.9), (1.6, 0.9))
        for steps in _round_of_two(step_s, lag, publish, tmp_path)
    ]
    assert statistics.median(per_round) == 4, per_round
    assert all(4 <= steps <= 5 for steps in per_round), per_round
