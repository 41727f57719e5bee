"""The evidence a peer asks for before it adopts another peer's state (pure)."""

import dataclasses
import math

import pytest
import torch

from swarmloco.core.adoption import (
    AdoptionConfig,
    Evidence,
    Probation,
    Reference,
    backing,
    check_state,
    distance_bound,
    momentum_bound,
    outweighs,
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


def test_only_a_witness_backs_a_state_however_many_strangers_hold_it():
    evidence = seasoned()
    assert backing(["a"], evidence, CONFIG) is None
    # A thousand fresh keys publishing one digest: keys cost nothing.
    strangers = [f"sybil{i}" for i in range(1000)]
    why = backing(strangers, evidence, CONFIG)
    assert why is not None and "held by 1000 peer(s)" in why and "recent partner" in why
    assert backing([*strangers, "b"], evidence, CONFIG) is None


def test_a_peer_with_nobody_to_ask_weighs_no_claim():
    """Every partner of this peer went silent (the swarm turned over while it was away),
    or it only ever averaged alone: any state backs itself, and the whole-state checks
    against its own history (and the probation) decide."""
    evidence = seasoned()
    assert backing(["k1", "k2"], evidence, CONFIG) is not None
    assert backing(["k1"], evidence, CONFIG, orphaned=True) is None


def test_a_fresh_peer_has_nothing_to_hold_a_claim_against():
    fresh = Evidence()
    assert fresh.fresh
    assert backing(["x"], fresh, CONFIG) is None
    # A peer that averaged alone is not fresh: it has a state of its own to keep.
    alone = Evidence()
    alone.applied(0.1, at=10.0)
    assert not alone.fresh
    assert backing(["x"], alone, CONFIG) is not None


def test_a_round_averaged_in_a_group_is_never_replaced_on_strangers_word():
    evidence = seasoned()  # ten rounds with a and b
    sybils = [f"sybil{i}" for i in range(1000)]
    why = outweighs(sybils, ["me", "a", "b"], evidence, grouped=True)
    assert why is not None and "stranger" in why
    # Even alone on its digest, and even a round it did not average in: strangers count 0.
    assert outweighs(sybils, ["me"], evidence, grouped=True) is not None
    assert outweighs(sybils, ["me"], evidence, grouped=False) is not None


def test_a_split_group_heals_towards_the_side_more_partners_are_on():
    """Five peers averaged together for ten rounds; round 11 split them 3 + 2. Each side
    counts its partners' rounds together: the side of two takes the side of three's
    state, the side of three keeps its own."""
    peers = ["a1", "a2", "a3", "b1", "b2"]

    def history(me: str, side: list[str]) -> Evidence:
        evidence = Evidence()
        for r in range(1, 11):
            evidence.applied(0.5, at=10.0 * r)
            evidence.grouped(r, peers, me, CONFIG)
        evidence.applied(0.5, at=110.0)
        evidence.grouped(11, side, me, CONFIG)
        return evidence

    a, b = ["a1", "a2", "a3"], ["b1", "b2"]
    assert outweighs(b, a, history("a1", a), grouped=True) is not None
    assert outweighs(a, b, history("b1", b), grouped=True) is None
    # Two partners split evenly (each alone on its digest): the lower digest wins on both
    # sides, never one that no partner holds.
    assert outweighs(["b2"], ["b1"], history("b1", ["b1"]), grouped=False) is None
    even = Evidence(witnesses={"b2": 11}, together={"b2": 11}, grouped_round=11)
    assert outweighs(["b2"], [], even, grouped=True, tie_break=True) is None
    assert outweighs(["b2"], [], even, grouped=True, tie_break=False) is not None
    assert outweighs(["sybil"], [], Evidence(), grouped=False, tie_break=True) is not None
    # A stranger that averaged one round with b1 does not tip the balance.
    b1 = history("b1", b)
    b1.grouped(11, ["b1", "sybil"], "b1", CONFIG)
    assert outweighs(["sybil"], b, b1, grouped=True) is not None


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
    evidence.applied(0.4, at=1210.0, lr=1e-3, update=0.2, tokens=4096)
    assert evidence.lrs[-2:] == [0.0, 1e-3] and len(evidence.lrs) == len(evidence.movements)
    assert evidence.updates[-1] == 0.2 and evidence.tokens[-1] == 4096
    assert len(evidence.updates) == len(evidence.tokens) == len(evidence.movements)
    restored = Evidence.from_state(evidence.to_state())
    assert restored == evidence
    assert restored.together == {"a": 10, "b": 10} and restored.grouped_round == 10
    assert Evidence.from_state({}) == Evidence()
    # From before rounds together were counted: each witness counts one.
    older = Evidence.from_state({"witnesses": {"a": 3}, "movements": [0.1]})
    assert older.together == {"a": 1} and older.updates == [0.0]
    # A checkpoint from before learning rates were kept: its movements' rates are unknown.
    old = Evidence.from_state({"movements": [0.1, 0.2]})
    assert old.lrs == [0.0, 0.0] and distance_bound(0, old, CONFIG, lr=1.0) == pytest.approx(1.2)


@pytest.mark.parametrize(
    "field, value",
    [
        ("quorum", 0),
        ("witness_rounds", 0),
        ("max_speedup", 0.0),
        ("movement_slack", -1.0),
        ("momentum_slack", 0.0),
        ("probation_rounds", -1),
        ("explode_factor", 1.0),
    ],
)
def test_config_is_validated(field, value):
    with pytest.raises(ValueError, match=field):
        AdoptionConfig(**{field: value})


def _trained(updates: float = 0.1, lr: float = 1e-3) -> Evidence:
    evidence = Evidence()
    for r in range(1, 11):
        evidence.applied(0.05, at=10.0 * r, lr=lr, update=updates, tokens=1000)
        evidence.grouped(r, ["me", "a"], "me", CONFIG)
    return evidence


def _reference(n: int = 64, **fields) -> Reference:
    return Reference(
        theta_g=fields.pop("theta_g", torch.zeros(n)),
        momentum=fields.pop("momentum", torch.zeros(n)),
        tokens=fields.pop("tokens", 10_000),
        outer_lr=0.7,
        outer_momentum=0.9,
        **fields,
    )


def test_the_momentum_bound_is_what_the_measured_updates_build_up():
    evidence = _trained(updates=0.1)
    # |b| <= max|g| / (1 - mu): 0.1 / 0.1 = 1, times the slack of 4.
    assert momentum_bound(evidence, CONFIG, outer_momentum=0.9) == pytest.approx(4.0)
    # Over F fragments the whole buffer is sqrt(F) times one fragment's.
    assert momentum_bound(evidence, CONFIG, outer_momentum=0.9, fragments=4) == pytest.approx(8)
    # Updates grow with the inner learning rate: a swarm past a warmup builds more.
    assert momentum_bound(evidence, CONFIG, outer_momentum=0.9, lr=4e-3) == pytest.approx(16)
    assert momentum_bound(Evidence(), CONFIG, outer_momentum=0.9) is None


def _state(theta, momentum, tokens=10_500):
    return {
        "theta_g": theta,
        "momentum": momentum,
        "tokens": torch.tensor([tokens], dtype=torch.int64),
    }


def test_a_state_with_honest_weights_and_a_poisoned_momentum_is_refused_whole():
    """The issue's attack: the honest weights, the outer momentum times 1000. The weights
    pass the distance check; the momentum does not."""
    evidence = _trained(updates=0.1)
    honest_b = torch.full((64,), 0.1)  # |b| = 0.8, under the bound of 4
    ok = check_state(
        _state(torch.full((64,), 0.01), honest_b),
        ahead=1,
        reference=_reference(),
        evidence=evidence,
        config=CONFIG,
    )
    assert ok.reason is None and ok.momentum == pytest.approx(0.8)
    poisoned = check_state(
        _state(torch.full((64,), 0.01), 1000 * honest_b),
        ahead=1,
        reference=_reference(),
        evidence=evidence,
        config=CONFIG,
    )
    assert poisoned.reason is not None and "outer momentum" in poisoned.reason
    assert poisoned.distance is not None and poisoned.distance <= poisoned.bound


@pytest.mark.parametrize(
    "tensors, why",
    [
        (_state(torch.full((64,), math.nan), torch.zeros(64)), "NaN"),
        (_state(torch.zeros(64), torch.full((64,), math.inf)), "NaN"),
        (_state(torch.full((64,), 5.0), torch.zeros(64)), "away from this peer's state"),
        (_state(torch.zeros(64), torch.zeros(64), tokens=-1), "negative"),
        (_state(torch.zeros(64), torch.zeros(64), tokens=20_000_000_000), "token count"),
    ],
)
def test_every_part_of_a_state_is_checked(tensors, why):
    check = check_state(
        tensors, ahead=1, reference=_reference(), evidence=_trained(), config=CONFIG
    )
    assert check.reason is not None and why in check.reason


def test_a_fresh_peer_holds_the_momentum_against_how_far_the_state_moved():
    """No history: one outer step of the momentum may not go further than the state
    moved from this peer's own (the initial weights), with the slack."""
    fresh = Evidence()
    theta0 = torch.zeros(64)
    trained = torch.full((64,), 0.05)  # 0.4 away from the initial weights
    honest = check_state(
        _state(trained, torch.full((64,), 0.04)),
        ahead=20,
        reference=_reference(theta_g=theta0, momentum=None, tokens=0),
        evidence=fresh,
        config=CONFIG,
    )
    assert honest.reason is None
    poisoned = check_state(
        _state(trained, torch.full((64,), 40.0)),
        ahead=20,
        reference=_reference(theta_g=theta0, momentum=None, tokens=0),
        evidence=fresh,
        config=CONFIG,
    )
    assert poisoned.reason is not None and "outer momentum" in poisoned.reason


def test_probation_condemns_a_loss_that_explodes_after_the_first_round_lands():
    config = AdoptionConfig(probation_rounds=2)
    trial = Probation(round=5, digest=b"d" * 32, holders=("x",), before=[])
    # Before the first outer step from the state lands: its own loss is the reference.
    for loss in (1.4, 1.5, 1.3):
        assert trial.loss(loss, config) is None
    assert trial.reference() == pytest.approx(1.5)
    assert not trial.round_applied(True, config)
    # One spike is noise; a median of five losses in a row over 100 x 1.5 is an explosion.
    assert trial.loss(5000.0, config) is None
    assert trial.loss(5.0, config) is None
    assert trial.loss(2.0, config) is None
    assert trial.loss(3134.6, config) is None  # four so far
    why = trial.loss(2900.0, config)  # the median of 5000, 5, 2, 3134.6 and 2900
    assert why is not None and "2900" in why
    assert "nan" in (trial.loss(math.nan, config) or "").lower()
    # Rounds averaged alone do not count towards the probation's end.
    assert not trial.round_applied(False, config)
    assert trial.round_applied(True, config)


def test_a_small_noisy_loss_is_not_an_explosion():
    """A regression loss near zero jumps by several times from one batch to the next
    (0.004, then 0.024): against the highest loss before the adoption, the median of three
    is no explosion."""
    config = AdoptionConfig()
    trial = Probation(
        round=17, digest=b"d" * 32, holders=("a", "b"), before=[0.0044, 0.021, 0.001, 0.03]
    )
    trial.round_applied(True, config)
    assert all(trial.loss(x, config) is None for x in (0.024, 0.11, 0.002, 0.05, 0.09))


def test_a_fresh_peers_loss_near_its_floor_rising_after_its_first_round_is_no_explosion():
    """A fresh peer's reference is its few steps on the adopted state (fitted to its own
    batches); its first round averaged with others brings the loss up several times. Seen
    in a real run: at most 0.0087 before, a median of 0.039 after."""
    config = AdoptionConfig()
    trial = Probation(round=11, digest=b"d" * 32, holders=("a", "b"), before=[])
    for loss in (0.0087, 0.0, 0.002, 0.0051):
        assert trial.loss(loss, config) is None
    trial.round_applied(True, config)
    assert all(trial.loss(x, config) is None for x in (0.031, 0.044, 0.039, 0.052, 0.036, 0.07))
    # NaN still condemns at once.
    assert trial.loss(math.nan, config) is not None


def test_a_probation_survives_a_checkpoint():
    trial = Probation(round=7, digest=b"\x01" * 32, holders=("a", "b"), before=[1.5, math.nan])
    trial.loss(1.2, CONFIG)
    trial.round_applied(True, CONFIG)
    again = Probation.from_state(trial.to_state())
    assert again == dataclasses.replace(trial, before=[1.5])
    assert again.reference() == pytest.approx(1.2) and again.landed and again.rounds == 1
