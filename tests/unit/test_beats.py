"""The beats of a pipeline driver's session with a replica (``pipeline/beats.py``): the
other side's silence, a flood, and this process's own stall told apart."""

from __future__ import annotations

from swarmloco.pipeline.beats import BURST, Beats


def test_the_other_side_is_silent_once_nothing_came_for_the_silence():
    b = Beats(beat_s=2.0, silence_s=10.0, now=100.0)
    assert not b.silent(109.9) and b.silent(110.0)
    assert b.heard_one(109.0) and not b.silent(118.9) and b.silent(119.0)
    assert b.wake(written=100.0) == 102.0  # the next beat to send comes first
    assert b.wake(written=118.0) == 119.0  # then the silence


def test_a_wait_far_longer_than_asked_is_this_process_stalled_not_the_other_side_silent():
    b = Beats(beat_s=2.0, silence_s=10.0, now=0.0)
    b.waited(asked=2.0, slept=2.1, now=2.1)  # on time: nothing to excuse
    b.waited(asked=2.0, slept=6.9, now=8.9)  # late, by less than half the silence
    assert b.silent(10.0)
    b = Beats(beat_s=2.0, silence_s=10.0, now=0.0)
    b.waited(asked=2.0, slept=47.0, now=47.0)  # frozen 45 s (SIGSTOP, a held loop)
    assert not b.silent(47.0) and not b.silent(56.9) and b.silent(57.0)


def test_beats_beyond_the_pace_are_a_flood_but_a_burst_after_a_stalled_link_is_not():
    b = Beats(beat_s=0.5, silence_s=5.0, now=0.0)
    assert all(b.heard_one(0.001) for _ in range(BURST))
    assert not b.heard_one(0.001)  # 17 at once, as the session opened
    b = Beats(beat_s=2.0, silence_s=10.0, now=0.0)
    assert all(b.heard_one(45.0) for _ in range(23))  # a link held 45 s, then all at once
    b = Beats(beat_s=2.0, silence_s=10.0, now=0.0)
    heard = [b.heard_one(t / 10) for t in range(1, 1000)]  # ten a second for 100 s
    assert not all(heard) and heard.index(False) < 100
