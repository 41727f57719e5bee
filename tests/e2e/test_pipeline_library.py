"""A pipelined run of a user's own model through the library, as users run it: their own
script (examples/pipeline_own_stages.py: two nn.Module stages of their own) in real
processes. The creator serves stage 1, a joiner finds the run by its id and drives stage 0;
a second joiner of stage 1 averages that stage with the creator; Ctrl-C stops each
cleanly."""

from __future__ import annotations

import math
import signal
from pathlib import Path

import pytest
from swarmutil import PeerProcess

pytestmark = pytest.mark.timeout(300)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pipeline_own_stages.py"


def test_a_users_own_stages_train_through_the_library(tmp_path):
    with PeerProcess.script(
        EXAMPLE, tmp_path / "a", "create", "--identity-work", "0", "--sync-every", "4"
    ) as head:
        swarm_id, endpoint = head.swarm_id, head.endpoint
        join = ("join", swarm_id, "--peer", endpoint)
        with (
            PeerProcess.script(EXAMPLE, tmp_path / "b", *join, "--stage", "1") as second,
            PeerProcess.script(EXAMPLE, tmp_path / "c", *join) as driver,
        ):
            # Until both stage-1 peers averaged their stage together, and stage 0 applied
            # two rounds of its own.
            head.wait_for("round", lambda e: e["group"] == 2, timeout=180)
            driver.wait_for("round", lambda e: e["round"] >= 2, timeout=120)
            for peer in (head, driver, second):  # Ctrl-C: each leaves cleanly
                peer.process.send_signal(signal.SIGINT)  # (a driver may lose a micro-batch)
            for peer in (driver, head, second):
                assert peer.wait(90) == 0, peer.log_tail()
    assert [p.of("ready")[0]["stage"] for p in (head, second, driver)] == [1, 1, 0]
    # Stage 0 trained: the pipeline's loss fell from about ln 256 (5.55).
    losses = [e["loss"] for e in driver.of("round")]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < 5.0, losses
    # The two stage-1 peers averaged together, on one digest.
    together = {e["round"]: e["digest"] for e in head.of("round") if e["group"] == 2}
    for e in second.of("round"):
        if e["round"] in together:
            assert e["digest"] == together[e["round"]], (e, together)
    for peer, stage in ((driver, 0), (head, 1), (second, 1)):
        assert f"left stage {stage}" in "".join(peer.log), peer.log_tail()
        # Stopped mid-round, a peer says what it trained that no round averaged.
        unaveraged = peer.of("stopped")[-1]["unaveraged_tokens"]
        said = f"leaves with {unaveraged:,} tokens trained since its last applied round"
        assert (said in "".join(peer.log)) == (unaveraged > 0), peer.log_tail()
