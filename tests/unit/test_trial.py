"""A peer's adoption trial alone: probation, rollback, and whom it stops believing."""

from __future__ import annotations

import math

import torch

from swarmloco.core.adoption import AdoptionConfig
from swarmloco.core.state import THETA_G, StateSnapshot
from swarmloco.runtime.trial import DISTRUSTED_S, ROLLED_BACK_S, UNBACKED_S, Trial

SWARM = "12" * 20


def snapshot(round: int, value: float) -> StateSnapshot:
    return StateSnapshot.of(swarm_id=SWARM, round=round, tensors={THETA_G: torch.full((8,), value)})


def test_an_adopted_state_passes_after_its_rounds_with_others_and_keeps_the_first_fallback():
    trial = Trial(AdoptionConfig(probation_rounds=2))
    for loss in (3.0, math.nan, 2.9):
        trial.loss(loss)
    own, first, second = snapshot(10, 0.0), snapshot(12, 1.0), snapshot(14, 2.0)
    trial.adopt(first, ["a", "b"], own=own)
    assert trial.probation is not None and trial.probation.before == [3.0, 2.9]
    trial.adopt(second, ["c"], own=first)  # adopted again while on trial
    assert trial.fallback is own and trial.probation.digest == second.digest
    assert trial.applied(grouped=False) is None  # alone: does not count
    assert trial.applied(grouped=True) is None
    passed = trial.applied(grouped=True)
    assert passed is not None and passed.round == 14 and passed.rounds == 2
    assert trial.probation is None and trial.fallback is None
    assert trial.applied(grouped=True) is None  # nothing on trial any more


def test_a_loss_gone_nan_condemns_the_state_and_rolling_back_distrusts_it_and_its_holders():
    trial = Trial(AdoptionConfig())
    trial.loss(math.nan)  # nothing on trial: only not kept
    assert trial.condemned is None and not trial.losses
    own, bad = snapshot(10, 0.0), snapshot(11, 1e6)
    trial.adopt(bad, ["liar", "dupe"], own=own)
    trial.loss(math.inf)
    assert trial.condemned is not None and "inf" in trial.condemned
    ended = trial.roll_back(now=100.0)
    assert ended is not None and ended[1] is own and ended[0].digest == bad.digest
    assert bad.digest in trial.distrusted_digests
    assert trial.distrusted == {"liar": 100.0 + ROLLED_BACK_S, "dupe": 100.0 + ROLLED_BACK_S}
    assert trial.distrusted_now(100.0 + ROLLED_BACK_S - 1) == {"liar", "dupe"}
    assert trial.distrusted_now(100.0 + ROLLED_BACK_S) == set()
    assert trial.condemned is None and trial.probation is None
    assert trial.roll_back(now=200.0) is None  # nothing on trial: nothing to return to


def test_a_longer_distrust_is_not_shortened_and_refusals_are_told_once():
    trial = Trial(AdoptionConfig())
    trial.heard(unbacked=["ahead"], distrusted=["refused"], now=50.0)
    assert trial.unbacked == {"ahead": 50.0 + UNBACKED_S, "refused": 50.0 + DISTRUSTED_S}
    trial.adopt(snapshot(3, 1.0), ["refused"], own=snapshot(2, 0.0))
    trial.roll_back(now=60.0)  # 60 s of distrust after a rollback: the 600 s stays
    assert trial.distrusted["refused"] == 50.0 + DISTRUSTED_S
    assert trial.first_refusal(3, "ab") and not trial.first_refusal(3, "ab")
    assert trial.first_refusal(4, "ab")


def test_a_probation_survives_a_checkpoint_without_its_fallback():
    trial = Trial(AdoptionConfig())
    assert trial.to_state() is None
    trial.loss(2.0)
    trial.adopt(snapshot(5, 1.0), ["a"], own=snapshot(4, 0.0))
    trial.applied(grouped=True)
    again = Trial(AdoptionConfig())
    again.load_state(trial.to_state())
    assert again.probation == trial.probation and again.fallback is None
    again.load_state(None)
    assert again.probation is None
