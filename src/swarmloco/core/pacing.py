"""When the swarm's next outer round is due (DESIGN section 3), as a pure function of the
progress reports that peers publish.

Peers train at different speeds. Each publishes, every few seconds, how many tokens it has
processed since the last round and its current rate. Round r is due when the swarm's tokens
since the last round reach ``tokens_per_round``; every peer projects the reports forward to
estimate that moment, and joins matchmaking then, so fast and slow peers arrive together
(the fast ones having contributed more tokens, and so more weight).

Nothing here reads a clock or the network: the caller passes the reports and ``now``.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Iterable

from swarmloco.core.config import require_int, require_non_negative, require_positive


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProgressReport:
    """What one peer says of its work towards a round."""

    peer: str
    round: int
    """The round the peer is working towards (its last applied round + 1)."""
    tokens: int
    """Tokens it processed since its last applied round."""
    tokens_per_s: float
    """Its recent training rate."""
    at: float
    """Unix seconds when the report was made."""
    step_tokens: int | None = None
    """The tokens one of its steps trains on (None: not said)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PacingConfig:
    tokens_per_round: int
    """Swarm-wide tokens per outer round (H steps x the nominal global batch)."""
    stale_after_s: float = 60.0
    """Reports older than this count with their tokens but no longer with their rate (the
    peer may have left or stalled)."""
    rate_cap_multiple: float = 10.0
    """Another peer's rate counts at most this multiple of the median reported rate, and
    its tokens at most what that rate makes, twice over, since the round began here."""

    def __post_init__(self) -> None:
        require_int("tokens_per_round", self.tokens_per_round, minimum=1)
        require_positive("stale_after_s", self.stale_after_s)
        require_positive("rate_cap_multiple", self.rate_cap_multiple)


class Verdict(enum.Enum):
    WAIT = "wait"
    """Not due yet; ``due_at`` says when it is expected."""
    DUE = "due"
    """The swarm's projected tokens reached the target: join matchmaking now."""
    BEHIND = "behind"
    """Some peer already works on a later round: this peer missed a round and must fetch
    the newer state before it trains on."""
    STALLED = "stalled"
    """Nobody is making progress (no fresh rate): no due time can be estimated."""


@dataclasses.dataclass(frozen=True)
class Estimate:
    verdict: Verdict
    due_at: float
    """Projected unix time the round is due (``now`` when due; ``inf`` when stalled)."""
    tokens_now: float
    """The swarm's projected tokens for the round at ``now``."""
    tokens_per_s: float
    """The swarm's rate from fresh reports."""
    peers: int
    """Peers counted (one report each, the newest)."""
    reason: str
    """A line the dashboard can show."""


def estimate(
    reports: Iterable[ProgressReport],
    *,
    round: int,
    now: float,
    config: PacingConfig,
    trusted: str | None = None,
    since: float | None = None,
    resumed: float | None = None,
    next_decision_s: float = 0.0,
) -> Estimate:
    """When round ``round`` is due, from the newest report of each peer.

    Reports for earlier rounds are ignored (those peers are catching up); a report for a
    later round makes the verdict :attr:`Verdict.BEHIND`. A fresh report counts its tokens
    plus its rate times the time since it was made, or since ``resumed`` if later (when
    training resumed after the last round: a peer reports the new round as its exchange
    starts, and without overlap trains nothing until it lands; projected from the report
    instead, a fast peer's rate over the exchange would make the next round due after a
    step or two); a stale one only its tokens.

    Reports other than ``trusted``'s (this peer's own) are bounded: a rate counts at most
    ``rate_cap_multiple`` times the median rate of all reports, and with ``since`` (when
    the round began on this peer, unix seconds) the tokens at most twice what that capped
    rate makes from ``since`` to the report. One peer over-reporting therefore brings a
    round forward by at most what that many fast honest peers would. What it can do to the
    *result* is bounded elsewhere (weights capped at a multiple of the group's lower
    median, updates at a multiple of the median norm).

    ``next_decision_s``: when the caller decides again if it waits now (after its next
    step). The round is due now when the target is nearer than it would be then, that is
    when the tokens short of it are at most what the swarm makes in half that time.
    Decisions come only between steps: waiting for the projection to reach the target
    exactly would run one step too many whenever it falls short by less than a step, and
    with slow steps it does so on average by half of another peer's step (a report is
    made between that peer's steps, and projects its tokens linearly from there).
    """
    require_int("round", round, minimum=0)
    require_non_negative("now", now)
    newest = _newest_per_peer(reports)
    ahead = [r for r in newest.values() if r.round > round]
    if ahead:
        return _behind(ahead, now=now)
    current = [r for r in newest.values() if r.round == round and _sane(r)]
    tokens_now, rate = _projected(
        current, now=now, config=config, trusted=trusted, since=since, resumed=resumed
    )
    return _verdict(
        round=round,
        now=now,
        target=config.tokens_per_round,
        tokens_now=tokens_now,
        margin=rate * max(0.0, next_decision_s) / 2,
        rate=rate,
        peers=len(current),
    )


def _projected(
    current: list[ProgressReport],
    *,
    now: float,
    config: PacingConfig,
    trusted: str | None,
    since: float | None,
    resumed: float | None,
) -> tuple[float, float]:
    """The swarm's tokens for the round projected to ``now``, and its rate from fresh
    reports, with every report but ``trusted``'s bounded."""
    cap = _rate_cap(current, config)
    tokens_now = 0.0
    rate = 0.0
    for r in current:
        r_rate, r_tokens = float(r.tokens_per_s), float(r.tokens)
        if r.peer != trusted and cap > 0:
            r_rate, r_tokens = _bounded(r, cap=cap, since=since)
        age = max(0.0, now - r.at)
        tokens_now += r_tokens
        if age <= config.stale_after_s:
            trained = age if resumed is None else max(0.0, now - max(r.at, resumed))
            tokens_now += r_rate * trained
            rate += r_rate
    return tokens_now, rate


def _newest_per_peer(reports: Iterable[ProgressReport]) -> dict[str, ProgressReport]:
    """Each peer's newest report: the latest round it names, then the latest time."""
    newest: dict[str, ProgressReport] = {}
    for report in reports:
        known = newest.get(report.peer)
        if known is None or (report.round, report.at) > (known.round, known.at):
            newest[report.peer] = report
    return newest


def _behind(ahead: list[ProgressReport], *, now: float) -> Estimate:
    """The verdict when some peers already report a later round."""
    latest = max(r.round for r in ahead)
    return Estimate(
        Verdict.BEHIND,
        now,
        0.0,
        0.0,
        len(ahead),
        f"{len(ahead)} peer(s) already work on round {latest}; fetch the newer state",
    )


def _rate_cap(current: list[ProgressReport], config: PacingConfig) -> float:
    """The most another peer's rate may count: a multiple of the median reported rate
    (the lower median, so that one fast liar among two peers cannot raise it); 0 when
    nobody reports."""
    rates = sorted(r.tokens_per_s for r in current)
    return config.rate_cap_multiple * rates[(len(rates) - 1) // 2] if rates else 0.0


def _bounded(report: ProgressReport, *, cap: float, since: float | None) -> tuple[float, float]:
    """An untrusted report's rate and tokens, held to ``cap`` and, with ``since``, its
    tokens to twice what ``cap`` makes from ``since`` to the report."""
    rate = min(float(report.tokens_per_s), cap)
    tokens = float(report.tokens)
    if since is not None:
        tokens = min(tokens, 2 * cap * max(0.0, report.at - since))
    return rate, tokens


def _verdict(
    *,
    round: int,
    now: float,
    target: int,
    tokens_now: float,
    rate: float,
    peers: int,
    margin: float = 0.0,
) -> Estimate:
    """Due, stalled or waiting, from the swarm's projected tokens and rate; due already
    ``margin`` tokens short of the target."""
    if tokens_now + margin >= target:
        return Estimate(
            Verdict.DUE,
            now,
            tokens_now,
            rate,
            peers,
            f"round {round} due: {tokens_now:,.0f} of {target:,} tokens from {peers} peer(s)",
        )
    if rate <= 0:
        return Estimate(
            Verdict.STALLED,
            math.inf,
            tokens_now,
            0.0,
            peers,
            f"round {round}: {tokens_now:,.0f} of {target:,} tokens and no peer making progress",
        )
    due_in = (target - margin - tokens_now) / rate
    return Estimate(
        Verdict.WAIT,
        now + due_in,
        tokens_now,
        rate,
        peers,
        f"round {round} due in {due_in:.1f} s: {tokens_now:,.0f} of {target:,} tokens, "
        f"{rate:,.0f} tokens/s from {peers} peer(s)",
    )


def _sane(report: ProgressReport) -> bool:
    """Reports come from untrusted peers; ones that cannot be true do not count."""
    return (
        report.tokens >= 0
        and math.isfinite(report.tokens_per_s)
        and report.tokens_per_s >= 0
        and math.isfinite(report.at)
    )
