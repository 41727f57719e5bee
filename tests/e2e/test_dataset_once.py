"""Every sequence of a pinned dataset lands once, through a SIGKILL: three `swarmloco join`
peers lease the shards of a dataset prepared on the spot (a tokenizer trained on it), one
is killed after its first round with the others and started again from its data
directory; all leave once nothing of the epoch is left for them (`--max-epochs 1`). The
model the run ends on holds every sequence of the epoch exactly once: what landed in a
state travels with it (DESIGN section 11), so the final checkpoints say so."""

from __future__ import annotations

import collections
import re
import signal
from pathlib import Path

import numpy as np
import pytest
from swarmutil import Bootstrap, PeerProcess, last_landed, process_gone, rank_pid

from swarmloco.cli import main
from swarmloco.dataset.fetch import EVAL_SHARDS
from swarmloco.dataset.index import read_index
from swarmloco.dataset.ledger import Sequences, read_audit
from swarmloco.dataset.serve import serve_dataset

pytestmark = pytest.mark.timeout(420)

SEQ_LEN = 64


def prepared(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    """About 30,000 tokens of this project's own source in shards of 3,000."""
    runtime = Path(__file__).resolve().parents[2] / "src" / "swarmloco" / "runtime"
    files = [str(runtime / name) for name in ("swarm.py", "hook.py", "rounds.py", "peer.py")]
    data = tmp_path / "data"
    assert main(["-q", "data", "prepare", *files, "--train-tokenizer", "400", "--out", str(data),
                 "--shard-tokens", "3000", "--no-progress"]) == 0  # fmt: skip
    capsys.readouterr()
    return data


def epoch_sequences(data: Path) -> list[int]:
    index = read_index(data)
    shards = [
        np.fromfile(data / f"shard-{i:05d}.bin", dtype=np.dtype(index.dtype))
        for i in range(len(index.shards))
    ]
    return Sequences(shards, seq_len=SEQ_LEN, val_fraction=0.05).counts


def test_three_peers_and_a_sigkill_land_every_sequence_of_the_epoch_once(tmp_path, capsys):
    data = prepared(tmp_path, capsys)
    counts = epoch_sequences(data)
    assert len(counts) >= 8 and sum(counts) >= 300
    peer = ("--dataset", str(data), "--max-epochs", "1", "--lease-seconds", "4")
    with Bootstrap(tmp_path / "boot") as boot:
        swarm = PeerProcess.publish(
            tmp_path / "creator", boot.endpoint, "--dataset", str(data), "--seq-len", str(SEQ_LEN)
        )
        peers = {n: PeerProcess.join(swarm, boot.endpoint, tmp_path / n, *peer) for n in "abc"}
        try:
            peers["c"].wait_for("round", lambda e: e["group"] >= 2, timeout=180)
            peers["c"].process.send_signal(signal.SIGKILL)
            peers["c"].wait(30)
            peers["c"] = PeerProcess.join(swarm, boot.endpoint, tmp_path / "c", *peer)
            for name, p in peers.items():
                assert p.wait(240) == 0, (name, p.log_tail())
        finally:
            for p in peers.values():
                if p.process.poll() is None:
                    p.kill()
    for p in peers.values():
        assert "every shard of the dataset's 1 epoch(s) landed" in "".join(p.log), p.log_tail()
    # Each peer's last state: no sequence landed in it twice, and the run ends on a state
    # that holds the whole epoch (a peer that left first may hold less: its last rounds'
    # partners went on without it).
    covers = {}
    for n in "abc":
        round_, landed = last_landed(tmp_path / n)
        covers[n] = (round_, landed.coverage(counts, epoch=0))
    assert all(c.duplicated == 0 for _, c in covers.values()), covers
    assert any((c.landed, c.missing) == (sum(counts), 0) for _, c in covers.values()), covers
    audits = {n: read_audit(tmp_path / n / "audit.jsonl") for n in "abc"}
    # What two peers saw land in one round is the same (a contribution is one landing).
    seen: dict[tuple[int, str], object] = {}
    for audit in audits.values():
        for landing in audit:
            key = (landing.round, landing.contributor)
            assert seen.setdefault(key, landing.ranges) == landing.ranges, key


def test_a_box_and_a_peer_lease_one_dataset_and_land_every_sequence_once(tmp_path, capsys):
    """A box of two ranks leases through its rank 0, which deals each rank its ranges
    before each step (DESIGN section 2, "A box of ranks"), beside a peer of one rank. The
    box has no copy of the dataset: its rank 0 fetches each shard from the run's mirror
    when it leases it, into the cache the ranks share. The box's daemon is SIGKILLed after
    a round with the peer: its ranks die with it, and the box starts again from its data
    directory. Both leave once the epoch landed, each one's last state holds no sequence
    twice, the run ends on one that holds the whole epoch, and the box's landings are in
    it."""
    data = prepared(tmp_path, capsys)
    counts = epoch_sequences(data)
    dataset_id = read_index(data).dataset_id
    peer = ("--max-epochs", "1", "--lease-seconds", "4")
    with Bootstrap(tmp_path / "boot") as boot, serve_dataset(data) as url:
        swarm = PeerProcess.publish(
            tmp_path / "creator", boot.endpoint, "--dataset", str(data), "--dataset-mirror", url,
            "--seq-len", str(SEQ_LEN),
        )  # fmt: skip
        peers = {
            "box": PeerProcess.join(
                swarm, boot.endpoint, tmp_path / "box", *peer, "--nproc-per-node", "2"
            ),
            "peer": PeerProcess.join(
                swarm, boot.endpoint, tmp_path / "peer", *peer, "--dataset", str(data)
            ),
        }
        killed = peers["box"]
        try:
            killed.wait_for("round", lambda e: e["group"] >= 2, timeout=180)
            ranks = [rank_pid(killed, r) for r in (0, 1)]
            killed.process.send_signal(signal.SIGKILL)
            killed.wait(30)
            assert all(process_gone(pid) for pid in ranks), ranks  # (no orphan holds the box)
            peers["box"] = PeerProcess.join(
                swarm, boot.endpoint, tmp_path / "box", *peer, "--nproc-per-node", "2"
            )
            for name in ("peer", "box"):
                assert peers[name].wait(300) == 0, (name, peers[name].log_tail())
        finally:
            for p in [killed, *peers.values()]:
                if p.process.poll() is None:
                    p.kill()
    # The box fetched the evaluation's shards at start and each shard it leased when it
    # leased it, none other, each once (its rank 1 found every shard dealt it in the cache).
    box_log = "".join(killed.log) + "".join(peers["box"].log)
    leased = {int(m) for m in re.findall(r"leased shard (\d+) of epoch", box_log)}
    expected = set(range(min(EVAL_SHARDS, len(counts)))) | leased
    cache = tmp_path / "box" / "datasets" / dataset_id
    assert sorted(int(p.name[6:11]) for p in cache.glob("shard-*.bin")) == sorted(expected)
    fetched = collections.Counter(re.findall(r"fetching shard (\d+) of dataset", box_log))
    assert all(n == 1 for n in fetched.values()), fetched
    for p in peers.values():
        assert "every shard of the dataset's 1 epoch(s) landed" in "".join(p.log), p.log_tail()
    covers = {}
    for name in peers:
        round_, landed = last_landed(tmp_path / name)
        covers[name] = (round_, landed.coverage(counts, epoch=0))
    assert all(c.duplicated == 0 for _, c in covers.values()), covers
    assert any((c.landed, c.missing) == (sum(counts), 0) for _, c in covers.values()), covers
    # A round the two applied together (a group of 2: the box, before or after its kill, and
    # the peer): one digest, what landed being part of it. (Whether the box started again
    # in time to average with the peer before the epoch's end is the run's to decide.)
    together = [
        {e["round"]: e["digest"] for r in runs for e in r.of("round") if e["group"] == 2}
        for runs in ((killed, peers["box"]), (peers["peer"],))
    ]
    for r in set(together[0]) & set(together[1]):
        assert together[0][r] == together[1][r], (r, together)
    # The box read through its leases: its own landings hold sequences of both ranks'
    # steps (it declared what it dealt).
    box_id = peers["box"].of("ready")[0]["peer_id"]
    mine = [
        r for landing in read_audit(tmp_path / "box" / "audit.jsonl")
        if landing.contributor == box_id for r in landing.ranges
    ]  # fmt: skip
    assert sum(r.count for r in mine) >= 2 * 4, mine
