"""When this peer's next round is due (DESIGN section 3, "When a round is due"), and whom
matchmaking waits for.

The round is due when the peers working on it have together processed as many tokens as
each doing H / F steps (each of its own: their records say their steps' tokens): a fast
peer trains on past its steps while slower ones catch up
(and so contributes more tokens, and weight), a slow one joins early, and they arrive at
matchmaking together. Alone, a peer averages (with itself) every H / F steps. It never
waits past ``4 H / F`` steps for peers whose reports promise more.

Keys cost nothing: once this peer has partners (peers it averaged with lately) and hears
from any of them, only their reports decide when a round is due, that it is behind, or
that the round started; strangers' reports count again when every partner is silent.

:class:`Pacer` reads the progress records the network keeps (``SwarmNetwork.reports``)
and this peer's own counts (:class:`~swarmloco.runtime.progress.LocalProgress`); the
decision itself is ``core/pacing.py``'s :func:`~swarmloco.core.pacing.estimate`.
"""

from __future__ import annotations

import collections
import logging
import statistics
import time
from collections.abc import Callable, Collection, Mapping

from swarmloco.core.adoption import Evidence
from swarmloco.core.pacing import PacingConfig, ProgressReport, Verdict, estimate
from swarmloco.net.records import is_farewell
from swarmloco.runtime.config import PeerConfig
from swarmloco.runtime.network import SwarmNetwork
from swarmloco.runtime.progress import LocalProgress

logger = logging.getLogger(__name__)

FRESH_REPORTS = 5  # a report older than this many publishing intervals: the peer left
FRESH_MIN_S = 10.0
MAX_WAIT_ROUNDS = 4
STEP_SPREAD = 64.0
"""Another peer's step counts as at most this many times this peer's, and at least its
share (a swarm's cards differ in batch by less): a claim of its step's tokens holds a
round off as much as 63 phantom peers would, and never past ``MAX_WAIT_ROUNDS`` H."""
EXPECTED_STRANGERS = 2  # newcomers a round waits for (a short grace) besides partners
NO_SHOW_ABORTS = 2
"""Attempts at one round that aborted because none of the peers expected came: from then
on those peers are waited for as strangers are (a short grace), for ``ABSENT_S``."""
ABSENT_S = 600.0
MAX_ABSENT = 4096


class Pacer:
    """See the module. ``unbacked``: peers whose claims of later rounds are ignored until
    then (monotonic; the adoption trial keeps them). ``now``: the swarm's time."""

    def __init__(
        self,
        *,
        network: SwarmNetwork,
        wake: Callable[[], None],
        config: PeerConfig,
        peer_id: str,
        h: float,
        progress: LocalProgress,
        evidence: Evidence,
        unbacked: Mapping[str, float],
        now: Callable[[], float],
    ) -> None:
        self.network = network
        self.wake = wake
        """Have the network publish and read the records now (from any thread)."""
        self.config = config
        self.peer_id = peer_id
        self.h = h
        self.progress = progress
        self.evidence = evidence
        self.unbacked = unbacked
        self.now = now
        self.expected: tuple[int, int] | None = None
        """Peers known to work on the next round (this one included), and strangers worth a
        short wait besides."""
        self.last_group: tuple[int, frozenset[str]] | None = None
        """(round, the ids of the other members its result held whole) of this peer's last
        group: a member struck or lost in it is no partner to wait for."""
        self.late: tuple[int, float] | None = None
        """(round, until): that round's group formed without this peer, which waits for its
        result (a download) instead of averaging the round with whoever else came late."""
        self._read_twice = False  # the first round waited for a second read of the records
        self._expecting: tuple[int, frozenset[str]] = (0, frozenset())
        """(round, the known peers) matchmaking was last told to wait for."""
        self._no_shows = (0, 0)
        """(round, its attempts that aborted with none of the peers expected there)."""
        self._absent: collections.OrderedDict[str, float] = collections.OrderedDict()
        """Peers that missed attempts at a round they said they worked on -> until when
        (monotonic) they are waited for as strangers only."""
        self._spread_said = False  # the warning of steps far apart, once

    def fresh_reports(self, current: int) -> list[ProgressReport]:
        """Other peers' reports that are recent, but for claims of rounds far ahead of
        ``current`` (this peer's round) from peers no adoptable state backs."""
        now, clock = self.now(), time.monotonic()
        fresh = max(FRESH_MIN_S, FRESH_REPORTS * self.config.progress_interval_s)
        target = current + 1
        return [
            r
            for r in self.network.reports
            if r.peer != self.peer_id
            and now - r.at <= fresh
            and not (r.round > target + 1 and self.unbacked.get(r.peer, 0.0) > clock)
        ]

    def verdict(self, current: int) -> Verdict:
        """Whether to average the round after ``current`` (this peer's round) now, wait, or
        catch up first."""
        h, p = self.h, self.progress
        if p.steps_since_round == 0:
            return Verdict.WAIT
        if p.steps_since_round >= MAX_WAIT_ROUNDS * h:
            return Verdict.DUE
        if self.network.reads < 2 and not self._read_twice:
            if p.steps_since_round < h:
                return Verdict.WAIT
            self._wait_for_a_second_read()
        now = self.now()
        target = current + 1
        mine = ProgressReport(
            peer=self.peer_id,
            round=target,
            tokens=p.tokens_since_round,
            tokens_per_s=p.rate.value,
            at=now,
        )
        everyone = self.fresh_reports(current)
        partners = self.evidence.witnesses
        heard = [r for r in everyone if r.peer in partners]
        reports = heard if heard else everyone
        working = 1 + len({r.peer for r in reports if r.round == target})
        self.expected = self._expect(everyone, partners if heard else None, current)
        if any(r.round > target + 1 for r in reports):
            return Verdict.BEHIND  # others applied rounds this peer has not
        if self.late is not None and self._still_late(target):
            return Verdict.BEHIND  # this round's group formed without us: fetch its result
        if any(r.round == target + 1 for r in reports) and p.steps_since_round >= h / 4:
            # Someone started this round already: join it now, with what we have, rather
            # than fall a gathering window out of step with it (not before a quarter of
            # the round's steps: a liar cannot make rounds much more frequent).
            return Verdict.DUE
        tokens_per_step = max(1, p.tokens_since_round // max(1, p.steps_since_round))
        # H steps of each working peer, each at its own step's tokens (bounded claims).
        steps_of = {r.peer: _step_tokens(r, tokens_per_step) for r in reports if r.round == target}
        self._warn_of_spread([r for r in reports if r.round == target], tokens_per_step)
        per_round = h * (tokens_per_step + sum(steps_of.values()))
        config = PacingConfig(tokens_per_round=max(1, round(per_round)))
        found = estimate(
            [mine, *reports],
            round=target,
            now=now,
            config=config,
            trusted=self.peer_id,
            since=p.counting_since,
            resumed=p.resumed_at,
            next_decision_s=tokens_per_step / p.rate.value if p.rate.value > 0 else 0.0,
        )
        verdict = found.verdict
        if verdict is not Verdict.WAIT:
            logger.debug(
                "%s after %d step(s); %d peer(s) working on it: %s; reports: %s",
                found.reason,
                p.steps_since_round,
                working,
                mine,
                reports,
            )
        if verdict is Verdict.STALLED:  # cannot happen with our own fresh rate; be safe
            return Verdict.DUE if p.steps_since_round >= h else Verdict.WAIT
        return verdict

    def _wait_for_a_second_read(self) -> None:
        """Just joined: peers that started with this one may not have reported yet (a
        report interval apart), and one that decides it is alone now splits the first
        round. Once due by its own count, the training thread waits (once, briefly) for a
        second read: training on instead would make a lone peer's first round as long as
        the network is slow, and its result depend on timing."""
        self._read_twice = True
        self.wake()
        with self.progress.blocking():
            read = self.network.wait_for_reads(2, 2 * self.config.progress_interval_s + 1.0)
        if not read:
            logger.info("no second read of the progress records: deciding on what we have")

    def _warn_of_spread(self, reports: list[ProgressReport], mine: int) -> None:
        """Say once when the peers working on this round say steps far from this peer's
        (beyond :data:`STEP_SPREAD` either way, where their claims are clipped and rounds
        no longer come every H of each peer's steps): most often a library peer that left
        ``tokens_per_step`` at its default of 1."""
        typical = None if self._spread_said else _spread(reports, mine)
        if typical is None:
            return
        self._spread_said = True
        logger.warning(
            "this peer counts %d token(s) a step and the peers working on its round say "
            "%s a step (median of %d), more than %dx apart: a claim counts at most %dx this "
            "peer's step, so rounds do not come every H steps of each peer; pass the tokens "
            "each step trains on (PeerConfig.tokens_per_step, or swarm.step(tokens))",
            mine,
            f"{typical:,.0f}",
            len([r for r in reports if r.step_tokens]),
            int(STEP_SPREAD),
            int(STEP_SPREAD),
        )

    def _expect(
        self, everyone: list[ProgressReport], partners: Collection[str] | None, current: int
    ) -> tuple[int, int]:
        """(peers matchmaking waits for, this one included; strangers worth a short wait
        besides) for the round after ``current``, from the reports and, when any partner is
        heard (``partners``), from theirs alone.

        Matchmaking waits for the peers of this round: those whose report names it, the
        round before (they applied it with us and have not reported since) or the round
        after (they started this one: it is in flight on their side). Counting too many
        costs a gathering window, too few a group split in two. A few newcomers are waited
        for besides partners, not a crowd of keys, and only for a short grace once the
        partners are in (``stranger_grace_s``): anyone can claim progress."""
        target = current + 1
        near = {r.peer for r in everyone if target - 1 <= r.round <= target + 1}
        known = {p for p in near if p in partners} if partners is not None else near
        # A peer that says it works on the round and never comes (a stuck peer, or a key
        # that only claims) holds it off twice at most, then waits as a stranger does.
        known = known - self._absent_now()
        expected, awaited = 1 + len(known), set(known)
        if self.last_group is not None and self.last_group[0] == current:
            # Who averaged the last round with us will most likely average this one too,
            # even when their reports lag a round behind; not those that said goodbye.
            left = {r.peer for r in self.network.reports if is_farewell(r)}
            expected = max(expected, 1 + len(self.last_group[1] - left))
            awaited |= self.last_group[1] - left
        self._expecting = (target, frozenset(awaited))
        return expected, min(len(near - known), EXPECTED_STRANGERS)

    def no_show(self, round: int) -> None:
        """An attempt at ``round`` aborted: none of the peers expected came. From the
        :data:`NO_SHOW_ABORTS`-th such attempt, they are waited for as strangers."""
        expected_round, peers = self._expecting
        seen_round, count = self._no_shows
        count = count + 1 if seen_round == round else 1
        self._no_shows = (round, count)
        if count < NO_SHOW_ABORTS or expected_round != round or not peers:
            return
        until = time.monotonic() + ABSENT_S
        for peer in sorted(peers):
            self._absent[peer] = until
            self._absent.move_to_end(peer)
        while len(self._absent) > MAX_ABSENT:
            self._absent.popitem(last=False)
        logger.warning(
            "round %d: %d peer(s) that say they work on it missed %d attempts; waiting for "
            "them as for newcomers for %.0f s",
            round,
            len(peers),
            count,
            ABSENT_S,
        )

    def _absent_now(self) -> set[str]:
        # (Oldest first, and all kept equally long: the expired ones are at the front.)
        now = time.monotonic()
        while self._absent and next(iter(self._absent.values())) <= now:
            self._absent.popitem(last=False)
        return set(self._absent)

    def wait_for_late_group(self, round: int, until: float, numel: int) -> None:
        """Round ``round``'s group formed without this peer: wait for its result until
        ``until`` (monotonic), unless that group aborts (its members then announce the
        round again, which the network listens for)."""
        self.late = (round, until)
        self.network.late = (round, numel)
        self.wake()

    def _still_late(self, target: int) -> bool:
        """Whether this peer still waits for the result of round ``target``'s group that
        formed without it (until its deadline, or until that group aborts)."""
        assert self.late is not None
        late_round, until = self.late
        if late_round != target or time.monotonic() >= until:
            self._end_late_wait()
            return False
        if self.network.late_group_aborted(target):
            logger.info("round %d: the group that formed without us aborted", target)
            self._end_late_wait()
            return False
        return True

    def _end_late_wait(self) -> None:
        self.late = None
        self.network.late = None


def _spread(reports: list[ProgressReport], mine: int) -> float | None:
    """The median of the step tokens ``reports`` say, when it lies beyond
    :data:`STEP_SPREAD` of ``mine`` either way (None otherwise, or when none says any)."""
    said = [r.step_tokens for r in reports if r.step_tokens]
    if not said:
        return None
    typical = float(statistics.median(said))
    return typical if not mine / STEP_SPREAD <= typical <= mine * STEP_SPREAD else None


def _step_tokens(report: ProgressReport, mine: int) -> float:
    """The tokens of one step of ``report``'s peer, as it says, within :data:`STEP_SPREAD`
    of ``mine`` (this peer's own when it says none)."""
    if report.step_tokens is None:
        return float(mine)
    return min(max(float(report.step_tokens), mine / STEP_SPREAD), mine * STEP_SPREAD)
