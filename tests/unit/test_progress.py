"""A peer's own progress alone: steps and tokens, the global step, the rate and the hook's
time (runtime/progress.py)."""

from __future__ import annotations

import pytest

from swarmloco.runtime.progress import CHECKPOINTED, LocalProgress


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_steps_count_towards_the_round_and_the_global_step_never_runs_past_h():
    clock = Clock()
    p = LocalProgress(clock=clock)
    for _ in range(30):
        clock.now += 0.1
        p.stepped(64, 1e-3, now=clock.now)
        p.advance(2, 25)
    assert (p.steps, p.steps_since_round, p.tokens_since_round) == (30, 30, 30 * 64)
    assert p.global_step == 2 * 25 + 25  # at most H into the next round
    p.round_started(now=5_000.0)
    assert (p.steps_since_round, p.tokens_since_round) == (0, 0)
    assert p.counting_since == p.resumed_at == 5_000.0
    p.advance(2, 25)  # never back
    assert p.global_step == 75
    assert p.mean_lr() == pytest.approx(1e-3) and p.mean_lr() is None


def test_a_restart_drops_the_rounds_count_and_forgets_since_when_it_counted():
    p = LocalProgress(clock=Clock())
    p.round_started(now=1.0)
    p.stepped(10, 0.5, now=2.0)
    p.restart()
    assert (p.steps, p.steps_since_round, p.tokens_since_round) == (1, 0, 0)
    assert p.counting_since is None and p.resumed_at is None and p.mean_lr() is None


def test_the_rate_counts_the_hooks_own_time_but_not_the_rounds_it_waited_for():
    clock = Clock()
    p = LocalProgress(clock=clock)
    p.step_ended = clock.now
    for _ in range(50):
        clock.now += 0.010  # the user's step
        started = clock.now
        p.stepped(100, 1e-3, now=started)
        clock.now += 0.002  # pacing and bookkeeping
        with p.blocking():
            clock.now += 1.0  # a round landing: left out of the rate
        p.hook_ended(started, swarm_now=lambda: 0.0)
    # 100 tokens every 12 ms (the first step had no hook before it): the waits are not in it.
    assert p.rate.value == pytest.approx(100 / 0.012, rel=1e-2)
    assert p.train_seconds == pytest.approx(50 * 0.010)  # the user's steps alone


def test_a_rate_leaves_out_its_warm_up_and_says_nothing_until_it_settled():
    from swarmloco.runtime.progress import Rate

    rate = Rate(warmup=2, settle=3)
    for _ in range(2):
        rate.add(10, 5.0)  # warming up: 2 tokens/s, not counted
    for seconds in (0.1, 0.3):
        rate.add(10, seconds)
        assert rate.value == 0.0  # not measured yet
    rate.add(10, 0.2)
    assert rate.value == pytest.approx(30 / 0.6) and rate.steps == 5
    rate.add(10, 0.2)  # then an exponential average, seeded with the settled mean
    assert rate.value == pytest.approx(50.0)
    rate.add(10, float("nan"))  # an untimed step is skipped
    assert rate.steps == 6
    with pytest.raises(ValueError):
        Rate(settle=0)


def test_a_round_landed_without_overlap_resumes_the_count_when_the_hook_ends():
    clock = Clock()
    p = LocalProgress(clock=clock)
    p.resume_pending = True
    p.hook_ended(clock.now, swarm_now=lambda: 777.0)
    assert p.resumed_at == 777.0 and not p.resume_pending
    p.hook_ended(clock.now, swarm_now=lambda: 888.0)
    assert p.resumed_at == 777.0


def test_the_checkpointed_counts_round_trip():
    p = LocalProgress(clock=Clock())
    for i in range(7):
        p.stepped(3, 0.1, now=float(i))
    p.advance(4, 5)
    state = p.state_dict()
    assert set(state) == set(CHECKPOINTED)
    q = LocalProgress(clock=Clock())
    q.load_state_dict(state)
    assert (
        q.state_dict()
        == state
        == {
            "steps": 7,
            "steps_since_round": 7,
            "tokens_since_round": 21,
            "global_step": 25,
        }
    )
