"""A pipelined run through the CLI, as a user starts one: `swarmloco create --stages 2`
publishes the cut of the built-in GPT, and two `swarmloco join` peers each take the stage
with the fewest peers (the later one first: drivers need it). The stage-0 peer drives
micro-batches of the task's data through the stage-1 peer; each applies its rounds and
stops at --max-rounds, having stepped on the same micro-batches."""

from __future__ import annotations

import pytest
from swarmutil import Bootstrap, PeerProcess

pytestmark = pytest.mark.timeout(300)


def test_create_with_stages_and_two_joins_train_a_two_stage_pipeline(tmp_path):
    with Bootstrap(tmp_path / "boot") as boot:
        swarm = PeerProcess.publish(tmp_path / "creator", boot.endpoint, "--stages", "2")
        rounds = ("--max-rounds", "2")
        with PeerProcess.join(swarm, boot.endpoint, tmp_path / "late", *rounds) as late:
            # Its record is what tells the next peer that stage 1 is served.
            late.wait_for("ready", timeout=120)
            with PeerProcess.join(swarm, boot.endpoint, tmp_path / "first", *rounds) as first:
                for p in (first, late):
                    assert p.wait(240) == 0, p.log_tail()
    assert late.of("ready")[0]["stage"] == 1 and first.of("ready")[0]["stage"] == 0
    for p in (first, late):
        assert [e["round"] for e in p.of("round")] == [1, 2], p.events
        assert p.of("stopped")[-1]["reason"].startswith("round 2 reached")
    # The stage-1 peer stepped on what the driver sent it: the same steps, give or take the
    # one in progress when each stopped.
    driven, served = first.of("stopped")[-1]["step"], late.of("stopped")[-1]["step"]
    assert abs(driven - served) <= 1, (driven, served)
    assert "micro-batches driven" in first.log_tail(5), first.log_tail()
    # It learns: an untrained byte model's loss is ln 256 = 5.55.
    losses = [e["loss"] for e in first.of("round")]
    assert losses[-1] < 5.0, losses


def test_a_killed_stage_peer_resumes_from_its_checkpoint_and_the_pipeline_goes_on(tmp_path):
    """The stage-1 peer SIGKILLed after a checkpoint: the stage-0 peer does not exit (its
    micro-batches find no replica until one is back: it says so and tries again), and the
    peer restarted on the same data directory resumes stage 1 from that checkpoint; both
    stages then reach round 3."""
    with Bootstrap(tmp_path / "boot") as boot:
        swarm = PeerProcess.publish(tmp_path / "creator", boot.endpoint, "--stages", "2")
        rounds = ("--max-rounds", "3")
        served = tmp_path / "served"
        with PeerProcess.join(swarm, boot.endpoint, served, "--stage", "1", *rounds) as late:
            late.wait_for("ready", timeout=120)
            first_dir = tmp_path / "first"
            with PeerProcess.join(
                swarm, boot.endpoint, first_dir, "--stage", "0", *rounds
            ) as first:
                late.wait_for("checkpoint", lambda e: e["round"] >= 1, timeout=180)
                late.kill()  # SIGKILL: no chance to save or say goodbye
                killed_at = max(e["round"] for e in late.of("checkpoint"))
                with PeerProcess.join(
                    swarm, boot.endpoint, served, "--stage", "1", *rounds
                ) as again:
                    resumed = again.wait_for("resumed", timeout=120)
                    assert resumed["round"] == killed_at, again.events
                    for p in (first, again):
                        assert p.wait(240) == 0, p.log_tail()
    for p in (first, again):
        assert p.of("round")[-1]["round"] == 3, p.events
        assert p.of("stopped")[-1]["reason"].startswith("round 3 reached")
        assert "Traceback" not in "".join(p.log), p.log_tail()
    assert [e["round"] for e in again.of("round")] == list(range(killed_at + 1, 4)), again.events
