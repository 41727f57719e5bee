"""Issue 31's promises through the daemon (`swarmloco join`), not only the library: at the
tiny preset's fast steps (tens of ms) a round comes after the swarm's tokens for H steps,
and a peer that leaves with Ctrl-C costs its partner no round."""

from __future__ import annotations

import itertools
import signal
import statistics

import pytest
from swarmutil import Bootstrap, PeerProcess

pytestmark = pytest.mark.timeout(300)


def _steps_between(peer: PeerProcess) -> dict[int, int]:
    """Round r -> the steps this peer trained between its rounds r - 1 and r, for the
    rounds it averaged in a group of two after another such round."""
    rounds = [e for e in peer.of("round") if e["group"] == 2]
    return {
        later["round"]: later["step"] - earlier["step"]
        for earlier, later in itertools.pairwise(rounds)
        if later["round"] == earlier["round"] + 1
    }


def test_daemon_peers_at_fast_steps_average_after_the_swarms_tokens_for_h_steps(tmp_path):
    """Two daemon peers at the tiny preset's steps, H = 16: the steps both trained between
    two rounds add up to 2 H within 20% (each brings its share; a faster one brings more)."""
    h, rounds = 16, 7
    with Bootstrap(tmp_path / "boot") as boot:
        swarm = PeerProcess.publish(tmp_path / "creator", boot.endpoint, "--sync-every", str(h))
        two = ("--max-rounds", str(rounds), "--min-group", "2")
        with (
            PeerProcess.join(swarm, boot.endpoint, tmp_path / "a", *two) as a,
            PeerProcess.join(swarm, boot.endpoint, tmp_path / "b", *two) as b,
        ):
            for p in (a, b):
                assert p.wait(300) == 0, p.log_tail()
    mine, theirs = _steps_between(a), _steps_between(b)
    together = [mine[r] + theirs[r] for r in sorted(mine.keys() & theirs.keys())]
    assert len(together) >= 3, (a.of("round"), b.of("round"))
    print(f"steps between rounds: a {mine}, b {theirs}, together {together}")
    assert 0.8 * 2 * h <= statistics.median(together) <= 1.2 * 2 * h, (mine, theirs)


def test_a_daemon_peer_that_leaves_with_ctrl_c_costs_its_partner_no_round(tmp_path):
    """b averages with a, then gets SIGINT: it finishes its step, says goodbye and exits 0;
    a's next rounds go on alone without one aborted round waiting for b."""
    with Bootstrap(tmp_path / "boot") as boot:
        swarm = PeerProcess.publish(tmp_path / "creator", boot.endpoint)
        with (
            PeerProcess.join(swarm, boot.endpoint, tmp_path / "a", "--max-rounds", "9") as a,
            PeerProcess.join(swarm, boot.endpoint, tmp_path / "b") as b,
        ):
            b.wait_for("round", lambda e: e["group"] == 2 and e["round"] >= 3, timeout=240)
            b.process.send_signal(signal.SIGINT)
            assert b.wait(60) == 0, b.log_tail()
            assert a.wait(300) == 0, a.log_tail()
    stopped = b.of("stopped")[-1]
    assert stopped["reason"] == "signal SIGINT", stopped
    left = stopped["round"]
    # The round b was in (or about to start) when it left may abort; none after it.
    assert not [e for e in a.of("aborted") if e["round"] > left + 1], a.of("aborted")
    assert all(e["group"] == 1 for e in a.of("round") if e["round"] > left + 1), a.of("round")
    assert max(e["round"] for e in a.of("round")) == 9
