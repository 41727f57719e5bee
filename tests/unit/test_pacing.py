"""When a round is due, from the peers' progress reports."""

import math

import pytest

from swarmloco.core.pacing import PacingConfig, ProgressReport, Verdict, estimate

CONFIG = PacingConfig(tokens_per_round=1_000_000, stale_after_s=60.0)


def report(peer="a", *, round=5, tokens=0, rate=1000.0, at=100.0):
    return ProgressReport(peer=peer, round=round, tokens=tokens, tokens_per_s=rate, at=at)


def test_one_peer_projects_its_own_rate():
    e = estimate(
        [report(tokens=400_000, rate=10_000.0, at=100.0)], round=5, now=110.0, config=CONFIG
    )
    assert e.verdict is Verdict.WAIT
    assert e.tokens_now == pytest.approx(500_000)
    assert e.due_at == pytest.approx(160.0)  # 500,000 more at 10,000/s
    assert "due in 50.0 s" in e.reason


def test_rates_add_up_across_peers():
    reports = [
        report("fast", tokens=300_000, rate=30_000.0, at=100.0),
        report("slow", tokens=100_000, rate=10_000.0, at=100.0),
    ]
    e = estimate(reports, round=5, now=100.0, config=CONFIG)
    assert (e.peers, e.tokens_per_s) == (2, 40_000.0)
    assert e.due_at == pytest.approx(115.0)


def test_due_once_the_projection_reaches_the_target():
    reports = [report("a", tokens=600_000, at=100.0), report("b", tokens=390_000, at=100.0)]
    # 990,000 + 2 x 1,000/s x 5 s = 1,000,000
    e = estimate(reports, round=5, now=105.0, config=CONFIG)
    assert e.verdict is Verdict.DUE and e.due_at == 105.0


def test_only_the_newest_report_of_a_peer_counts():
    reports = [report("a", tokens=900_000, at=90.0), report("a", tokens=100_000, at=100.0)]
    e = estimate(reports, round=5, now=100.0, config=CONFIG)
    assert e.tokens_now == pytest.approx(100_000) and e.peers == 1


def test_a_stale_peer_counts_its_tokens_but_not_its_rate():
    reports = [
        report("gone", tokens=200_000, rate=50_000.0, at=0.0),
        report("here", tokens=100_000, rate=1_000.0, at=100.0),
    ]
    e = estimate(reports, round=5, now=100.0, config=CONFIG)
    assert e.tokens_now == pytest.approx(300_000)
    assert e.tokens_per_s == 1_000.0


def test_nobody_progressing_is_stalled_not_a_division_by_zero():
    e = estimate([report(tokens=10, rate=0.0)], round=5, now=100.0, config=CONFIG)
    assert e.verdict is Verdict.STALLED and math.isinf(e.due_at)
    e = estimate([], round=5, now=100.0, config=CONFIG)
    assert e.verdict is Verdict.STALLED and e.peers == 0


def test_a_peer_on_a_later_round_means_we_are_behind():
    reports = [report("a", round=5, tokens=10), report("b", round=7, tokens=10)]
    e = estimate(reports, round=5, now=100.0, config=CONFIG)
    assert e.verdict is Verdict.BEHIND and "round 7" in e.reason


def test_peers_still_on_an_earlier_round_are_ignored():
    reports = [report("late", round=4, tokens=999_999, rate=1e6), report("a", round=5, tokens=0)]
    e = estimate(reports, round=5, now=100.0, config=CONFIG)
    assert e.peers == 1 and e.tokens_now == 0


@pytest.mark.parametrize(
    "bad",
    [
        report("x", tokens=-5),
        report("x", rate=float("nan")),
        report("x", rate=float("inf")),
        report("x", rate=-1.0),
        report("x", at=float("nan")),
    ],
)
def test_reports_that_cannot_be_true_do_not_count(bad):
    e = estimate([bad, report("a", tokens=10)], round=5, now=100.0, config=CONFIG)
    assert e.peers == 1 and e.tokens_now == 10


def test_fast_and_slow_peers_arrive_together():
    """Every peer re-estimates from the others' last reports (published every 5 s); all of
    them reach DUE within one report interval, the fast ones with more tokens."""
    rates = {"a": 40_000.0, "b": 20_000.0, "c": 5_000.0}
    tokens = dict.fromkeys(rates, 0.0)
    published = {p: report(p, tokens=0, rate=r, at=0.0) for p, r in rates.items()}
    due_at = {}
    t = 0.0
    while len(due_at) < len(rates) and t < 1000:
        t += 1.0
        for p, r in rates.items():
            tokens[p] += r
            if t % 5 == 0:
                published[p] = report(p, tokens=int(tokens[p]), rate=r, at=t)
        for p in rates:
            if p not in due_at:
                mine = report(p, tokens=int(tokens[p]), rate=rates[p], at=t)
                others = [v for k, v in published.items() if k != p]
                if estimate([*others, mine], round=5, now=t, config=CONFIG).verdict is Verdict.DUE:
                    due_at[p] = t
    assert len(due_at) == 3
    assert max(due_at.values()) - min(due_at.values()) <= 5.0
    assert tokens["a"] > tokens["b"] > tokens["c"]


def test_config_validation():
    with pytest.raises(ValueError, match="tokens_per_round"):
        PacingConfig(tokens_per_round=0)
    with pytest.raises(ValueError, match="stale_after_s"):
        PacingConfig(tokens_per_round=1, stale_after_s=0)
    with pytest.raises(ValueError, match="round"):
        estimate([], round=-1, now=0.0, config=CONFIG)


def test_a_peer_over_reporting_counts_at_most_a_plausible_rate_and_tokens():
    honest = [report(p, tokens=10_000, rate=1_000.0, at=100.0) for p in ("me", "b", "c")]
    liar = report("liar", tokens=10**12, rate=1e12, at=100.0)
    # Trusting every report, the liar makes the round due at once.
    assert estimate([*honest, liar], round=5, now=100.0, config=CONFIG).verdict is Verdict.DUE
    # Bounded: its rate counts 10x the median (10,000/s), its tokens twice what that makes
    # since the round began here (at 90: 2 x 10,000 x 10 s).
    e = estimate([*honest, liar], round=5, now=100.0, config=CONFIG, trusted="me", since=90.0)
    assert e.verdict is Verdict.WAIT
    assert e.tokens_per_s == pytest.approx(3 * 1_000 + 10_000)
    assert e.tokens_now == pytest.approx(3 * 10_000 + 200_000)
    # Our own report is never capped (a fast box alone among slow ones paces itself).
    fast_me = report("me", tokens=900_000, rate=1e6, at=100.0)
    e = estimate([fast_me, *honest[1:]], round=5, now=100.0, config=CONFIG, trusted="me")
    assert e.tokens_per_s == pytest.approx(1e6 + 2_000)


def test_one_liar_beside_one_honest_peer_cannot_raise_the_cap():
    # The cap follows the lower median: with two peers, the honest one's rate.
    me = report("me", tokens=0, rate=1_000.0, at=100.0)
    liar = report("liar", tokens=0, rate=1e12, at=100.0)
    e = estimate([me, liar], round=5, now=100.0, config=CONFIG, trusted="me")
    assert e.tokens_per_s == pytest.approx(1_000 + 10 * 1_000)


def test_honest_peers_within_the_cap_count_in_full():
    reports = [
        report("me", tokens=50_000, rate=5_000.0, at=100.0),
        report("gpu", tokens=400_000, rate=40_000.0, at=100.0),  # 8x the median: kept
        report("laptop", tokens=10_000, rate=1_000.0, at=100.0),
    ]
    free = estimate(reports, round=5, now=100.0, config=CONFIG)
    bounded = estimate(reports, round=5, now=100.0, config=CONFIG, trusted="me", since=85.0)
    assert (bounded.tokens_now, bounded.tokens_per_s) == (free.tokens_now, free.tokens_per_s)


def test_a_report_is_projected_only_over_time_spent_training():
    # The partner reported round 5 (0 tokens) as the exchange of round 4 started at 100;
    # training resumed at 100.5, after the outer step and an evaluation. At 100.6 it has
    # trained 0.1 s, not 0.6 s: a fast peer's rate over the exchange would make the round
    # due at once.
    partner = report("b", tokens=0, rate=10_000.0, at=100.0)
    e = estimate([partner], round=5, now=100.6, config=CONFIG, resumed=100.5)
    assert e.tokens_now == pytest.approx(1_000)
    assert estimate([partner], round=5, now=100.6, config=CONFIG).tokens_now == pytest.approx(6_000)
    # A report made after training resumed is projected from itself.
    later = report("b", tokens=2_000, rate=10_000.0, at=100.55)
    e = estimate([later], round=5, now=100.6, config=CONFIG, resumed=100.5)
    assert e.tokens_now == pytest.approx(2_500)


def test_a_peers_rate_is_its_tokens_over_its_time_not_an_average_of_step_rates():
    from swarmloco.runtime.progress import Rate

    rate = Rate()
    for _ in range(200):
        rate.add(1, 0.001)
        rate.add(1, 0.009)
    # Two steps every 10 ms: 200 steps/s (averaging the steps' own rates gives about 555).
    assert rate.value == pytest.approx(200.0, rel=0.1)
