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
