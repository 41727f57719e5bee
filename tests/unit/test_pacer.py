"""The pacer alone, over progress records given as data: when a round is due, when a peer
is behind, whom matchmaking waits for, and whose claims count (runtime/pacer.py)."""

from __future__ import annotations

import dataclasses
import time

from swarmloco.core.adoption import Evidence
from swarmloco.core.pacing import ProgressReport, Verdict
from swarmloco.net.records import FAREWELL_AT
from swarmloco.runtime.config import PeerConfig
from swarmloco.runtime.loop_thread import LoopThread
from swarmloco.runtime.pacer import EXPECTED_STRANGERS, Pacer
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
        loop=loop,
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


def test_a_peer_late_for_its_group_waits_for_its_result_until_that_group_aborts(tmp_path):
    with LoopThread() as loop:
        board = Board()
        p = pacer(loop, board, tmp_path, steps=H)
        p.wait_for_late_group(5, time.monotonic() + 600, numel=1000)
        assert board.late == (5, 1000)
        assert p.verdict(4) is Verdict.BEHIND
        board.aborted.add(5)
        assert p.verdict(4) is Verdict.DUE and p.late is None and board.late is None
