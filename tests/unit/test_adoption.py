"""The evidence a peer asks for before it adopts another peer's state (pure)."""

import pytest

from swarmloco.core.adoption import (
    AdoptionConfig,
    Evidence,
    backing,
    distance_bound,
    round_plausible,
)

CONFIG = AdoptionConfig()


def seasoned() -> Evidence:
    """A peer that averaged rounds 1..10 with peers a and b, a round every 10 s."""
    evidence = Evidence()
    for r in range(1, 11):
        evidence.applied(0.5 + 0.01 * r, at=1000.0 + 10 * r)
        evidence.grouped(r, ["me", "a", "b"], "me", CONFIG)
    return evidence


def test_a_witness_backs_a_state_alone_and_strangers_need_a_quorum():
    evidence = seasoned()
    assert backing(["a"], evidence, CONFIG) is None
    assert backing(["x", "y"], evidence, CONFIG) is None
    why = backing(["liar"], evidence, CONFIG)
    assert why is not None and "held by 1 peer" in why and "2 holders" in why


def test_a_fresh_peer_has_nothing_to_hold_a_claim_against():
    fresh = Evidence()
    assert fresh.fresh
    assert backing(["x"], fresh, CONFIG) is None
    # A peer that averaged alone is not fresh: it has a state of its own to keep.
    alone = Evidence()
    alone.applied(0.1, at=10.0)
    assert not alone.fresh
    assert backing(["x"], alone, CONFIG) is not None


def test_witnesses_expire_after_witness_rounds():
    config = AdoptionConfig(witness_rounds=5)
    evidence = Evidence()
    evidence.grouped(1, ["me", "old"], "me", config)
    evidence.grouped(6, ["me", "new"], "me", config)
    assert set(evidence.witnesses) == {"old", "new"}
    evidence.grouped(7, ["me", "new"], "me", config)
    assert set(evidence.witnesses) == {"new"}


def test_rounds_cannot_come_faster_than_time_allows():
    evidence = seasoned()  # last round at t = 1100, rounds 10 s apart
    assert round_plausible(2, 1100.5, evidence, CONFIG) is None  # the slack
    why = round_plausible(5, 1102.0, evidence, CONFIG)
    assert why is not None and "5 rounds ahead" in why
    # A peer stopped for 100 s (ten rounds): 2 + 4 * 100 / 10 = 42 rounds are plausible.
    assert round_plausible(10, 1200.0, evidence, CONFIG) is None
    assert round_plausible(43, 1200.0, evidence, CONFIG) is not None
    # Without a measured interval there is nothing to hold a claim against.
    assert round_plausible(1000, 0.0, Evidence(), CONFIG) is None


def test_rounds_averaged_alone_do_not_reset_the_clock_of_plausible_rounds():
    """A peer cut off from the swarm (restarted behind it, its donors out of reach)
    averages alone now and then; the swarm's pace is still judged from its last round
    with others, or it could never take the state of the swarm running ahead of it."""
    evidence = seasoned()  # last round with others at t = 1100, rounds 10 s apart
    for at in (1130.0, 1160.0, 1190.0):
        evidence.applied(0.5, at=at, alone=True)
    assert evidence.last_round_at == 1100.0 and evidence.movements[-1] == 0.5
    # 91 s since the last round with others: 2 + 4 * 91 / 10 = 38.4 rounds are plausible.
    assert round_plausible(35, 1191.0, evidence, CONFIG) is None
    assert round_plausible(40, 1191.0, evidence, CONFIG) is not None


def test_the_distance_bound_grows_with_the_rounds_missed():
    evidence = seasoned()
    median = sorted(evidence.movements)[len(evidence.movements) // 2]
    assert distance_bound(0, evidence, CONFIG) == pytest.approx(4 * 2 * median, rel=0.05)
    assert distance_bound(10, evidence, CONFIG) == pytest.approx(4 * 12 * median, rel=0.05)
    assert distance_bound(3, Evidence(), CONFIG) is None


def test_the_distance_bound_follows_the_learning_rate_schedule():
    """A peer stopped during a linear warmup measured small outer steps; the swarm's
    steps since grew with the learning rate. Movements are kept per unit of learning
    rate, so the bound scales with the highest rate the rounds missed reach."""
    warmup = Evidence()
    for r in (1, 2):  # steps of 0.1 per unit of lr, at lrs 1e-5 and 3e-5
        warmup.applied(0.1 * (2 * r - 1) * 1e-5, at=10.0 * r, lr=(2 * r - 1) * 1e-5)
    stale = Evidence(movements=list(warmup.movements))  # the same steps, rates unknown
    # The swarm went on for 6 rounds at up to lr 1e-3: up to 0.1 * 1e-3 * 6 = 6e-4 away.
    moved = 6e-4
    assert distance_bound(6, stale, CONFIG, lr=1e-3) < moved  # the median movement: refused
    bound = distance_bound(6, warmup, CONFIG, lr=1e-3)
    assert bound == pytest.approx(4 * 0.1 * 1e-3 * 8) and bound > moved
    # A state ten times farther than the schedule moves it is still refused; without the
    # schedule the bound is the median movement, as before.
    assert bound < 10 * moved
    assert distance_bound(6, warmup, CONFIG) == pytest.approx(4 * 2e-6 * 8)


def test_evidence_survives_a_checkpoint_and_ignores_garbage_movements():
    evidence = seasoned()
    evidence.applied(float("nan"), at=1200.0)
    assert len(evidence.movements) == 10
    evidence.applied(0.4, at=1210.0, lr=1e-3)
    assert evidence.lrs[-2:] == [0.0, 1e-3] and len(evidence.lrs) == len(evidence.movements)
    restored = Evidence.from_state(evidence.to_state())
    assert restored == evidence
    assert Evidence.from_state({}) == Evidence()
    # A checkpoint from before learning rates were kept: its movements' rates are unknown.
    old = Evidence.from_state({"movements": [0.1, 0.2]})
    assert old.lrs == [0.0, 0.0] and distance_bound(0, old, CONFIG, lr=1.0) == pytest.approx(1.2)


@pytest.mark.parametrize(
    "field, value",
    [("quorum", 0), ("witness_rounds", 0), ("max_speedup", 0.0), ("movement_slack", -1.0)],
)
def test_config_is_validated(field, value):
    with pytest.raises(ValueError, match=field):
        AdoptionConfig(**{field: value})
