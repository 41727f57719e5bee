"""Averaging among real processes, one of which is killed, frozen or stuck mid-stream.

Four peers (``averaging_peer.py``) average on loopback; the victim's scripted marker fault
fires at a chosen point of its stream (after a few chunks or results, which its upload
limit spreads over a second or so), and the test then SIGKILLs or SIGSTOPs it. The
survivors must finish well within the round deadline with identical bytes, equal to the
exact weighted mean of the contributors their report names, and name the lost peer.
"""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "net"))
sys.path.insert(0, str(HERE))

from averaging_peer import CODEC, vector_of, weight_of  # noqa: E402
from avgutil import expected_mean  # noqa: E402

from swarmloco.net.averaging import AllReduceReport, PartReport  # noqa: E402

SIZE = 4
NUMEL = 64 * 400
DEADLINE = 20.0
# A marker: fires once, does nothing; the test acts when it reads that it fired.
MARK = {"action": "delay", "seconds": 0.0, "times": 1}


class Peer:
    """An ``averaging_peer.py`` process and the JSON events it prints."""

    def __init__(self, index: int, tmp: Path, bootstrap: str | None = None, **spec) -> None:
        self.index = index
        self.out = tmp / f"peer-{index}.bin"
        spec = {
            "index": index,
            "size": SIZE,
            "numel": NUMEL,
            "deadline": DEADLINE,
            "out": str(self.out),
            "bootstrap": bootstrap,
            **spec,
        }
        self.process = subprocess.Popen(
            [sys.executable, str(HERE / "averaging_peer.py"), json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.events: queue.Queue[dict] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        ready = self.wait("ready", timeout=60)
        self.endpoint, self.peer_id = ready["endpoint"], ready["peer_id"]

    def _pump(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.events.put(json.loads(line))
        self.events.put({"event": "exit"})

    def wait(self, *kinds: str, timeout: float) -> dict:
        end = time.monotonic() + timeout
        while True:
            try:
                event = self.events.get(timeout=max(0.0, end - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"peer {self.index}: no {kinds} in {timeout}s") from None
            if event["event"] in kinds:
                return event
            if event["event"] == "exit":
                raise AssertionError(f"peer {self.index} exited before {kinds}")

    def go(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write("go\n")
        self.process.stdin.flush()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.kill()
        self.process.wait(timeout=10)


def run_with_victim(tmp: Path, victim: int, act, **victim_spec) -> tuple[list[dict], list[Peer]]:
    """Start the peers, let the victim's marker fire, ``act`` on it, collect survivors."""
    peers = [Peer(0, tmp)]
    try:
        for i in range(1, SIZE):
            spec = victim_spec if i == victim else {}
            peers.append(Peer(i, tmp, bootstrap=peers[0].endpoint, **spec))
        started = time.monotonic()
        for peer in peers:
            peer.go()
        peers[victim].wait("fired", timeout=DEADLINE)
        act(peers[victim].process)
        done = []
        for i, peer in enumerate(peers):
            if i != victim:
                event = peer.wait("done", "aborted", timeout=DEADLINE + 5)
                assert event["event"] == "done", f"survivor {i}: {event}"
                done.append(event)
        elapsed = time.monotonic() - started
        assert elapsed < DEADLINE / 2, f"survivors took {elapsed:.1f}s"
        return done, peers
    finally:
        for peer in peers:
            peer.stop()


def check_survivors(done: list[dict], peers: list[Peer], victim: int) -> list[AllReduceReport]:
    means = [
        torch.frombuffer(bytearray(p.out.read_bytes()), dtype=torch.float32)
        for i, p in enumerate(peers)
        if i != victim
    ]
    for mean in means[1:]:
        assert torch.equal(means[0], mean)  # identical bytes on every survivor
    reports = []
    for event in done:
        r = event["report"]
        r["parts"] = tuple(PartReport(**p) for p in r["parts"])
        reports.append(AllReduceReport(**r))
    ids = {p.peer_id: i for i, p in enumerate(peers)}
    vectors = {pid: vector_of(i, NUMEL) for pid, i in ids.items()}
    weights = {pid: weight_of(i) for pid, i in ids.items()}
    expected, bound = expected_mean(reports[0], vectors, weights, CODEC)
    assert ((means[0].double() - expected).abs() <= bound.double()).all()
    for report in reports:
        assert report.digest == reports[0].digest
        assert peers[victim].peer_id in report.excluded  # the report names the lost peer
    return reports


def victim_part(report: AllReduceReport, victim_id: str) -> PartReport:
    """The part the victim reduced: rerun by a survivor, one or more epochs up."""
    part = report.parts[report.members.index(victim_id)]
    assert part.epoch >= 1 and part.reducer != victim_id
    return part


def test_a_sender_killed_mid_stream(tmp_path):
    # The victim is a client-mode member: it only sends (slowly) and receives.
    marker = {**MARK, "phase": "chunk", "skip": 6}
    done, peers = run_with_victim(
        tmp_path,
        3,
        lambda p: p.send_signal(signal.SIGKILL),
        client=True,
        upload_bytes_per_s=40_000,
        faults=[marker],
    )
    reports = check_survivors(done, peers, 3)
    victim = peers[3].peer_id
    counted = [part.included.get(victim, 0) for part in reports[0].parts]
    # How much of its stream had reached the reducers when it died depends on scheduling
    # (on a busy machine its first chunks may still have been in its own buffers: none);
    # never all of it, and the mean is exactly over what each part included (above).
    assert sum(counted) < sum(part.chunks for part in reports[0].parts)


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGSTOP])
def test_a_reducer_killed_or_frozen_mid_stream(tmp_path, signum):
    marker = {**MARK, "phase": "result", "skip": 4}
    done, peers = run_with_victim(
        tmp_path,
        2,
        lambda p: p.send_signal(signum),
        upload_bytes_per_s=40_000,
        faults=[marker],
    )
    reports = check_survivors(done, peers, 2)
    part = victim_part(reports[0], peers[2].peer_id)
    assert set(part.included) == {p.peer_id for i, p in enumerate(peers) if i != 2}


def test_a_peer_whose_handler_holds_the_gil(tmp_path):
    # A pure-Python busy loop in its handler, on its event loop's thread: the whole process
    # goes silent (no heartbeat on any stream) while its sockets stay open. The others
    # detect it by liveness and finish without it, well inside the round deadline.
    spin = {"action": "spin", "phase": "handler", "skip": 20, "seconds": 3 * DEADLINE}
    done, peers = run_with_victim(
        tmp_path, 1, lambda p: None, faults=[spin], upload_bytes_per_s=200_000
    )
    reports = check_survivors(done, peers, 1)
    victim_part(reports[0], peers[1].peer_id)


def test_a_peer_stuck_in_its_handler(tmp_path):
    # Its handler stops reading and writing while its process, its sockets and the streams
    # it opened itself stay up: its part is rerun elsewhere. (What it sends as a sender is
    # valid and may count, as the report says.)
    stall = {"action": "stall", "phase": "handler", "skip": 20}
    done, peers = run_with_victim(
        tmp_path, 1, lambda p: None, faults=[stall], upload_bytes_per_s=200_000
    )
    reports = check_survivors(done, peers, 1)
    victim_part(reports[0], peers[1].peer_id)
