"""A later stage's peer that leaves once the run is over for it (`join --leave-idle`): a
stage-1 peer serves a stage-0 peer that drives micro-batches through it until its
`--max-rounds`, then leaves; the stage-1 peer, with no micro-batch and no driver's session
left, averages what it trained since its last round, then leaves by itself, exit 0, saying
why, with nothing it trained left out of its stage's state."""

from __future__ import annotations

import pytest
from swarmutil import Bootstrap, PeerProcess

pytestmark = pytest.mark.timeout(420)


def test_a_later_stage_peer_leaves_once_its_drivers_are_gone(tmp_path):
    with Bootstrap(tmp_path / "boot") as boot:
        swarm = PeerProcess.publish(tmp_path / "creator", boot.endpoint, "--stages", "2")
        late = ("--stage", "1", "--leave-idle", "3")
        with PeerProcess.join(swarm, boot.endpoint, tmp_path / "s1", *late) as s1:
            s1.wait_for("ready", timeout=120)  # its record tells the driver it serves
            first = ("--stage", "0", "--max-rounds", "1")
            with PeerProcess.join(swarm, boot.endpoint, tmp_path / "s0", *first) as s0:
                assert s0.wait(240) == 0, s0.log_tail()
                assert s1.wait(120) == 0, s1.log_tail()
    stopped = s1.of("stopped")[-1]
    assert stopped["reason"] == "no micro-batch and no driver for 3 s (--leave-idle)", s1.events
    # What it trained since its stage's last round (most runs: some micro-batches came
    # after it) was averaged before it left (as when stopped: 1,536 tokens left out).
    assert stopped["unaveraged_tokens"] == 0, s1.log_tail()
    assert "tokens trained since its last applied round" not in "".join(s1.log)
    assert s1.of("round"), s1.log_tail()  # it trained on what stage 0 drove
    assert "left stage 1" in "".join(s1.log), s1.log_tail()
    assert "Traceback" not in "".join(s1.log), s1.log_tail()


def test_two_replicas_of_a_later_stage_average_their_last_steps_and_leave(tmp_path):
    """Two stage-1 peers with `--leave-idle`: once stage 0's peer left, each averages what
    it trained since its stage's last round (with the other when both have some and meet,
    alone otherwise) and leaves with nothing left out of its stage's state."""
    with Bootstrap(tmp_path / "boot") as boot:
        swarm = PeerProcess.publish(tmp_path / "creator", boot.endpoint, "--stages", "2")
        late = ("--stage", "1", "--leave-idle", "3")
        with (
            PeerProcess.join(swarm, boot.endpoint, tmp_path / "s1a", *late) as a,
            PeerProcess.join(swarm, boot.endpoint, tmp_path / "s1b", *late) as b,
        ):
            for s1 in (a, b):
                s1.wait_for("ready", timeout=120)
            first = ("--stage", "0", "--max-rounds", "3")
            with PeerProcess.join(swarm, boot.endpoint, tmp_path / "s0", *first) as s0:
                assert s0.wait(240) == 0, s0.log_tail()
                for s1 in (a, b):
                    assert s1.wait(180) == 0, s1.log_tail()
    for s1 in (a, b):
        stopped = s1.of("stopped")[-1]
        assert "(--leave-idle)" in stopped["reason"], s1.events
        assert stopped["unaveraged_tokens"] == 0, s1.log_tail()
    # Rounds they applied together left them on one digest, the last included.
    together = {e["round"]: e["digest"] for e in a.of("round") if e["group"] == 2}
    both = [e for e in b.of("round") if e["round"] in together]
    assert both, (a.of("round"), b.of("round"))  # they averaged their stage together
    assert all(e["digest"] == together[e["round"]] for e in both), (together, both)


def test_the_run_ends_at_stage_0s_total_steps_and_a_later_stage_leaves_after(tmp_path):
    """Two stage-0 peers drive micro-batches through one stage-1 peer: stage 1 steps on both
    drivers' micro-batches, so its rounds run twice as fast as stage 0's. The run's total
    steps are stage 0's: both stage-0 peers end there, and the stage-1 peer, past the
    run's total steps in its own rounds, serves on until its drivers are gone, at the
    learning rate of stage 0's step. (Before, it ended the run at its round 4, its rate at
    the schedule's floor, and the stage-0 peers waited for a stage 1 until stopped.)"""
    with Bootstrap(tmp_path / "boot") as boot:
        run = ("--stages", "2", "--total-steps", "32", "--warmup", "4")  # 4 rounds of stage 0
        swarm = PeerProcess.publish(tmp_path / "creator", boot.endpoint, *run)
        fixed = ("--rebalance-every", "0")  # (nobody moves: stage 1 keeps one replica)
        late = ("--stage", "1", "--leave-idle", "3", *fixed)
        with PeerProcess.join(swarm, boot.endpoint, tmp_path / "s1", *late) as s1:
            s1.wait_for("ready", timeout=120)
            with (
                PeerProcess.join(swarm, boot.endpoint, tmp_path / "a", "--stage", "0", *fixed) as a,
                PeerProcess.join(swarm, boot.endpoint, tmp_path / "b", "--stage", "0", *fixed) as b,
            ):
                for s0 in (a, b):
                    assert s0.wait(300) == 0, s0.log_tail()
                assert s1.wait(180) == 0, s1.log_tail()
    for s0 in (a, b):
        assert "the run is over" in s0.of("stopped")[-1]["reason"], s0.events
        assert max(e["round"] for e in s0.of("round")) == 4, s0.of("round")
    assert "(--leave-idle)" in s1.of("stopped")[-1]["reason"], s1.events
    # Both drivers' 32 steps went through its one replica: more than 4 rounds of its own.
    assert max(e["round"] for e in s1.of("round")) >= 6, s1.of("round")
    # Its learning rate followed stage 0's step, as its drivers said it: at its round 4
    # (32 steps of its own, the schedule's end by its own count) it was mid-schedule
    # (before, at the floor stage 0 reached at its own end).
    floor = min(e["lr"] for s0 in (a, b) for e in s0.of("round"))
    at_4 = [e["lr"] for e in s1.of("round") if e["round"] == 4]
    assert at_4 and at_4[0] > 2 * floor, (at_4, floor, s1.of("round"))
