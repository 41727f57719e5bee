"""A pipelined run through the CLI, as a user starts one: `swarmloco create --task llama
--stages 2` publishes the cut of the built-in Llama (tests/e2e/test_pipeline_rebalance.py
runs the GPT's), and two `swarmloco join` peers each take the stage
with the fewest peers (the later one first: drivers need it). The stage-0 peer drives
micro-batches of the task's data through the stage-1 peer. The stage-1 peer is SIGKILLed
after a checkpoint and restarted with the same command: it takes back its stage and
resumes it from that checkpoint, while the stage-0 peer waits for a replica; both stages
then apply their rounds up to --max-rounds."""

from __future__ import annotations

import pytest
from swarmutil import Bootstrap, PeerProcess

pytestmark = pytest.mark.timeout(420)


def test_a_two_stage_pipeline_from_the_cli_trains_through_a_killed_stage_peer(tmp_path):
    with Bootstrap(tmp_path / "boot") as boot:
        swarm = PeerProcess.publish(
            tmp_path / "creator", boot.endpoint, "--task", "llama", "--stages", "2"
        )
        rounds = ("--max-rounds", "3")
        bf16 = (*rounds, "--precision", "bf16")  # stage 1 under bf16 autocast, as on a GPU
        served = tmp_path / "served"
        with PeerProcess.join(swarm, boot.endpoint, served, *bf16) as late:
            # Its record is what tells the next peer that stage 1 is served.
            late.wait_for("ready", timeout=120)
            with PeerProcess.join(swarm, boot.endpoint, tmp_path / "first", *rounds) as first:
                late.wait_for("checkpoint", lambda e: e["round"] >= 1, timeout=180)
                late.kill()  # SIGKILL: no chance to save or say goodbye
                killed_at = max(e["round"] for e in late.of("checkpoint"))
                # The same command again: the data directory says which stage it served.
                with PeerProcess.join(swarm, boot.endpoint, served, *bf16) as again:
                    resumed = again.wait_for("resumed", timeout=120)
                    assert resumed["round"] == killed_at, again.events
                    for p in (first, again):
                        assert p.wait(240) == 0, p.log_tail()
    assert [p.of("ready")[0]["stage"] for p in (late, first, again)] == [1, 0, 1]
    assert "serving stage 1 of 2 again" in "".join(again.log), again.log_tail()
    assert "stage 1 computes on" in "".join(again.log) and "in bf16 autocast" in "".join(again.log)
    assert "stage 0 computes on" in "".join(first.log) and " in fp32" in "".join(first.log)
    assert [e["round"] for e in again.of("round")] == list(range(killed_at + 1, 4)), again.events
    for p in (first, again):
        assert p.of("round")[-1]["round"] == 3, p.events
        assert p.of("stopped")[-1]["reason"].startswith("round 3 reached")
        assert "Traceback" not in "".join(p.log), p.log_tail()
    # While stage 1 had no peer the driver said so and tried again; it never exited.
    said = "".join(first.log)
    assert "no replica of stage 1 took" in said or "stage 1 has no peer" in said, said[-3000:]
    assert "micro-batches driven" in first.log_tail(5), first.log_tail()
    # It learns: an untrained byte model's loss is ln 256 = 5.55.
    losses = [e["loss"] for e in first.of("round")]
    assert losses[-1] < 5.0, losses
