"""The library API as users run it: their own script (examples/mlp_own_loop.py) in real
processes, creating and joining one swarm, stopped with Ctrl-C and started again."""

from __future__ import annotations

import importlib.util
import signal
import time
from pathlib import Path

import pytest
from swarmutil import PeerProcess

pytestmark = pytest.mark.timeout(300)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "mlp_own_loop.py"


def _example():
    spec = importlib.util.spec_from_file_location("mlp_own_loop", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rounds_of(peer: PeerProcess) -> dict[int, dict]:
    return {e["round"]: e for e in peer.of("round")}


def test_two_processes_agree_and_a_late_third_follows_the_swarms_learning_rate(tmp_path):
    rounds, h, total = 30, 200, 20_000
    run = ("--sync-every", str(h), "--total-steps", str(total), "--identity-work", "0")
    common = ("--max-rounds", str(rounds), "--min-peers", "2")
    with PeerProcess.script(EXAMPLE, tmp_path / "a", "create", *run, *common) as a:
        swarm_id = a.swarm_id
        endpoint = a.wait_for("ready")["endpoint"]
        join = ("join", swarm_id, "--peer", endpoint, *common)
        with PeerProcess.script(EXAMPLE, tmp_path / "b", *join) as b:
            a.wait_for("round", lambda e: e["round"] >= 5, timeout=120)
            with PeerProcess.script(EXAMPLE, tmp_path / "c", *join) as c:
                for p in (a, b, c):
                    assert p.wait(120) == 0, p.log_tail()
    final = {rounds_of(p)[rounds]["digest"] for p in (a, b, c)}
    assert len(final) == 1, final
    assert max(e["group"] for e in c.of("round")) == 3
    # The late peer took the swarm's state, and with it the swarm's place in the schedule.
    fetched = c.of("downloaded")
    assert fetched and fetched[0]["round"] >= 5, c.events
    assert fetched[0]["global_step"] == fetched[0]["round"] * h
    # Its learning rate is the schedule's at the swarm's step: the last optimizer step of a
    # round ran at a global step within that round (the schedule decreasing there).
    schedule = _example().schedule
    first = min(set(rounds_of(c)) & set(rounds_of(a)))  # a round both applied
    for peer in (a, c):
        event = rounds_of(peer)[first]
        assert event["global_step"] == first * h
        low = 3e-3 * schedule(first * h, total)
        high = 3e-3 * schedule((first - 1) * h, total)
        assert low * 0.999 <= event["lr"] <= high * 1.001, (peer.data_dir.name, event["lr"])
    # Warming up again from its own first step would have started it at 1/100 of the peak.
    assert rounds_of(c)[first]["lr"] > 0.5 * 3e-3


def test_ctrl_c_during_a_round_exits_cleanly_and_resumes_at_the_same_global_step(tmp_path):
    common = ("--min-peers", "2")
    with PeerProcess.script(
        EXAMPLE, tmp_path / "a", "create", "--identity-work", "0", *common
    ) as a:
        endpoint = a.wait_for("ready")["endpoint"]
        join = ("join", a.swarm_id, "--peer", endpoint, *common)
        with PeerProcess.script(EXAMPLE, tmp_path / "b", *join) as b:
            a.wait_for("round", lambda e: e["round"] >= 3 and e["group"] == 2, timeout=120)
            # With its partner frozen, a's next round cannot complete: Ctrl-C reaches it
            # with the round in flight (or about to be), and it must still leave in time.
            b.process.send_signal(signal.SIGSTOP)
            last = max(e["round"] for e in a.of("round"))
            a.wait_for("aborted", lambda e: e["round"] > last, timeout=60)
            a.process.send_signal(signal.SIGINT)
            started = time.monotonic()
            assert a.wait(120) == 0, a.log_tail()
            assert time.monotonic() - started < 60  # well inside the 120 s round deadline
            b.process.send_signal(signal.SIGCONT)
            b.kill()
    stopped = a.of("stopped")[-1]
    assert stopped["reason"] == "signal SIGINT"
    last = a.of("checkpoint")[-1]
    assert (last["round"], last["step"]) == (stopped["round"], stopped["step"])
    # The same create command again, on the same data directory (its partner gone): it
    # resumes the same swarm where it was, as its creator.
    with PeerProcess.script(
        EXAMPLE, tmp_path / "a", "create", "--identity-work", "0", *common
    ) as again:
        resumed = again.wait_for("resumed", timeout=120)
        again.wait_for("ready", timeout=120)
        again.process.send_signal(signal.SIGINT)
        assert again.wait(120) == 0, again.log_tail()
    assert again.swarm_id == a.swarm_id
    assert any("resuming swarm " + a.swarm_id in line for line in again.log), again.log_tail()
    assert resumed["global_step"] == stopped["global_step"]
    assert (resumed["round"], resumed["step"]) == (stopped["round"], stopped["step"])
    # And by its id, as any peer resumes (the manifest read from the directory's copy).
    with PeerProcess.script(EXAMPLE, tmp_path / "a", "join", a.swarm_id) as third:
        third.wait_for("ready", timeout=120)
        third.process.send_signal(signal.SIGINT)
        assert third.wait(120) == 0, third.log_tail()
    assert third.of("resumed")[0]["round"] == stopped["round"]
