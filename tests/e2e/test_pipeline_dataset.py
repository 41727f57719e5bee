"""A pipelined run on a pinned dataset, every sequence landing once in stage 0's state: a
dataset prepared on the spot, `swarmloco create --stages 2 --dataset DIR`, a stage-1 peer,
and two stage-0 peers that lease the dataset's shards (one with a copy, one fetching
each shard from the other when it leases it) and drive their micro-batches through the
stage-1 peer until every shard of the epoch landed (`--max-epochs 1`; DESIGN section 10,
"A pinned dataset"). The one without a copy is SIGKILLed after a round with the other,
and started again with the same command."""

from __future__ import annotations

import re
import signal

import pytest
from swarmutil import Bootstrap, PeerProcess, last_landed
from test_dataset_once import SEQ_LEN, epoch_sequences, prepared

from swarmloco.dataset.fetch import EVAL_SHARDS
from swarmloco.dataset.index import read_index

pytestmark = pytest.mark.timeout(420)


def test_two_stage_0_peers_lease_a_dataset_and_stage_0_lands_every_sequence_once(tmp_path, capsys):
    data = prepared(tmp_path, capsys)
    counts = epoch_sequences(data)
    dataset_id = read_index(data).dataset_id
    reading = ("--stage", "0", "--max-epochs", "1", "--lease-seconds", "4")
    with Bootstrap(tmp_path / "boot") as boot:
        swarm = PeerProcess.publish(
            tmp_path / "creator", boot.endpoint, "--stages", "2", "--dataset", str(data),
            "--seq-len", str(SEQ_LEN),
        )  # fmt: skip
        with PeerProcess.join(swarm, boot.endpoint, tmp_path / "s1", "--stage", "1") as s1:
            s1.wait_for("ready", timeout=120)  # its record tells the drivers it serves
            copy = ("--dataset", str(data))
            with PeerProcess.join(swarm, boot.endpoint, tmp_path / "a", *reading, *copy) as a:
                a.wait_for("ready", timeout=120)  # it serves the dataset's files from now on
                with PeerProcess.join(swarm, boot.endpoint, tmp_path / "b", *reading) as killed:
                    killed.wait_for("round", lambda e: e["group"] >= 2, timeout=180)
                    killed.process.send_signal(signal.SIGKILL)
                    killed.wait(30)
                # The same command again: it resumes stage 0 from its data directory.
                with PeerProcess.join(swarm, boot.endpoint, tmp_path / "b", *reading) as b:
                    assert b.wait(300) == 0, b.log_tail()
                for p in (a, b):
                    assert p.wait(300) == 0, p.log_tail()
            s1.process.send_signal(signal.SIGINT)
            assert s1.wait(90) == 0, s1.log_tail()
    for p in (a, b):
        assert "every shard of the dataset's 1 epoch(s) landed" in "".join(p.log), p.log_tail()
        assert "Traceback" not in "".join(p.log), p.log_tail()
    # Stage 0's last states: no sequence landed twice, one holds the whole epoch.
    covers = {n: last_landed(tmp_path / n)[1].coverage(counts, epoch=0) for n in "ab"}
    assert all(c.duplicated == 0 for c in covers.values()), covers
    assert any((c.landed, c.missing) == (sum(counts), 0) for c in covers.values()), covers
    # Both averaged together before the kill; the restarted one resumed stage 0 from its
    # data directory (whether it read more after, or found the epoch done by the other,
    # the run's timing decides).
    assert any(e["group"] == 2 for e in a.of("round")), a.events
    assert b.of("resumed") and b.of("resumed")[0]["stage"] == 0, b.events
    # The peer with no copy fetched the evaluation's shards and each shard it leased, no
    # other (from the peer that has one: there is no mirror).
    log = "".join(killed.log) + "".join(b.log)
    leased = {int(m) for m in re.findall(r"leased shard (\d+) of epoch", log)}
    cache = tmp_path / "b" / "datasets" / dataset_id
    fetched = {int(p.name[6:11]) for p in cache.glob("shard-*.bin")}
    assert fetched == set(range(min(EVAL_SHARDS, len(counts)))) | leased, (fetched, leased)
    # Stage 1 trained on what stage 0 drove.
    assert s1.of("round"), s1.log_tail()
