"""Leases of a pinned dataset's shards over real DHT nodes on loopback: readers share an
epoch without reading a sequence twice, a dead reader's shard goes to another from where it
landed, what strangers publish moves nothing, and a partner's malformed entry stops nothing."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from netutil import SWARM, loopback_network

from swarmloco.dataset.leases import LeasedData
from swarmloco.dataset.ledger import Landing, Range, Sequences, coverage
from swarmloco.net import records
from swarmloco.net.records import (
    LEASES,
    MAX_LANDED_SPANS,
    MAX_LEASES,
    SHARD,
    Float,
    Int,
    ListOf,
    leases_key,
    owned_value,
    shard_key,
)

pytestmark = pytest.mark.timeout(120)

SEQ = 8
COUNTS = [10, 10, 10, 10, 10, 6]


def sequences() -> Sequences:
    shards = [np.arange(n * SEQ + 1, dtype=np.uint16) % 50 for n in COUNTS]
    return Sequences(shards, seq_len=SEQ, val_fraction=0.0)


def reader(tmp_path: Path, name: str, **kw: object) -> LeasedData:
    data = LeasedData(
        sequences(),
        batch_size=4,
        vocab_size=64,
        seed=5,
        fragments=1,
        audit=tmp_path / name / "audit.jsonl",
        max_epochs=1,
        **kw,  # type: ignore[arg-type]
    )
    return data


class Trainer:
    """A reader's training thread: reads batches and lands each as its own round (a peer
    alone), until the reader says nothing is left (or ``give_up_s`` passed: ``gave_up``)."""

    def __init__(
        self, data: LeasedData, me: str, *, steps: int | None = None, give_up_s: float = 90.0
    ) -> None:
        self.data, self.me, self.steps = data, me, steps
        self.stopped = threading.Event()
        self.read: list[Range] = []
        data.stop_peer = lambda why: self.stopped.set()
        self.round = 0
        self.give_up_s = give_up_s
        self.gave_up = False

    def __call__(self) -> None:
        done = 0
        deadline = time.monotonic() + self.give_up_s
        while not self.stopped.is_set() and (self.steps is None or done < self.steps):
            if time.monotonic() > deadline:
                self.gave_up = True
                return
            if not self.data.ready():
                self.data.changed.wait(0.2)
                self.data.changed.clear()
                continue
            self.data.next_batch()
            self.round += 1
            declared = self.data.declare(self.round, 0)
            self.read += [Range(*r) for r in declared]
            self.data.landed(self.round, {self.me: declared}, {self.me: True}, self.me)
            done += 1


async def published(node, shard: int, peer: str, landed: list[list[int]]) -> None:
    """Until ``peer``'s entry for ``shard`` says ``landed`` (read through ``node``)."""
    deadline = asyncio.get_running_loop().time() + 10.0
    while True:
        result = await node.dht.get(shard_key(SWARM, shard))
        entry = result.entries.get(peer)
        if entry is not None and entry.value["landed"] == landed:
            return
        assert asyncio.get_running_loop().time() < deadline, "never published"
        await asyncio.sleep(0.05)


async def test_two_readers_share_an_epoch_and_land_every_sequence_once(tmp_path):
    async with loopback_network(3) as nodes:
        a, b = reader(tmp_path, "a", lease_s=4.0), reader(tmp_path, "b", lease_s=4.0)
        ids = [nodes[0].identity.peer_id_hex, nodes[1].identity.peer_id_hex]
        # Peers of one swarm average together (or one took the other's state), and each
        # counts the other's word on what landed; here each lands its rounds alone.
        a.adopted({ids[1]})
        b.adopted({ids[0]})
        tasks = [
            asyncio.create_task(a.run(nodes[0].dht, SWARM, ids[0])),
            asyncio.create_task(b.run(nodes[1].dht, SWARM, ids[1])),
        ]
        ta, tb = Trainer(a, ids[0]), Trainer(b, ids[1])
        await asyncio.gather(asyncio.to_thread(ta), asyncio.to_thread(tb))
        await a.close()
        await b.close()
        assert all(t.done() for t in tasks)
        assert ta.read and tb.read  # both read
        landings = [Landing(1, "a", tuple(ta.read)), Landing(1, "b", tuple(tb.read))]
        cover = coverage([landings], COUNTS, epoch=0)
        assert (cover.duplicated, cover.missing) == (0, 0), cover
        # Each one's audit says what it saw land; the leases were released on leaving.
        result = await nodes[2].dht.get(leases_key(SWARM))
        assert all(e.value["shards"] == [] for e in result.entries.values())


async def test_a_dead_readers_shard_goes_to_another_from_where_it_landed(tmp_path):
    async with loopback_network(3) as nodes:
        ids = [n.identity.peer_id_hex for n in nodes]
        a = reader(tmp_path, "a", lease_s=4.0)
        task = asyncio.create_task(a.run(nodes[0].dht, SWARM, ids[0]))
        ta = Trainer(a, ids[0], steps=1)  # one batch of its first shard lands, then it dies
        await asyncio.to_thread(ta)
        (first,) = {r.shard for r in ta.read}
        landed = [[r.first, r.end] for r in ta.read]
        await published(nodes[2], first, ids[0], landed)  # what landed is in the DHT
        task.cancel()  # killed: its lease is not released, it expires
        with pytest.raises(asyncio.CancelledError):
            await task
        await nodes[0].dht.store(leases_key(SWARM), {"shards": [[0, first]], "at": 0.0}, ttl=4)
        b = reader(tmp_path, "b", lease_s=4.0)
        b.adopted({ids[0]})  # b took the state a gave: a's word on what landed counts
        tb = Trainer(b, ids[1])
        run_b = asyncio.create_task(b.run(nodes[1].dht, SWARM, ids[1]))
        await asyncio.to_thread(tb)
        await b.close()
        assert run_b.done()
        cover = coverage([[Landing(1, "a", tuple(ta.read)), Landing(1, "b", tuple(tb.read))]],
                         COUNTS, epoch=0)  # fmt: skip
        assert (cover.duplicated, cover.missing) == (0, 0), cover
        assert any(r.shard == first for r in tb.read)  # it finished the dead one's shard


async def test_strangers_cannot_finish_shards_nor_hold_more_than_the_cap(tmp_path):
    async with loopback_network(3) as nodes:
        stranger = nodes[2]
        # A stranger says every shard landed whole: nobody who does not trust it believes it.
        for shard, n in enumerate(COUNTS):
            value = {"epoch": 0, "landed": [[0, n]], "at": 0.0}
            await stranger.dht.store(shard_key(SWARM, shard), value, ttl=600)
        # And it cannot lease more than the cap in its record (every node refuses one).
        with pytest.raises(ValueError, match="at most"):
            value = {"shards": [[0, s] for s in range(MAX_LEASES + 1)], "at": 0.0}
            await stranger.dht.store(leases_key(SWARM), value, ttl=60)
        me = nodes[0].identity.peer_id_hex
        a = reader(tmp_path, "a", lease_s=4.0)
        task = asyncio.create_task(a.run(nodes[0].dht, SWARM, me))
        ta = Trainer(a, me)
        await asyncio.to_thread(ta)
        await a.close()
        assert task.done()
        cover = coverage([[Landing(1, "a", tuple(ta.read))]], COUNTS, epoch=0)
        assert (cover.duplicated, cover.missing) == (0, 0), cover


async def test_a_shard_a_stranger_lists_and_never_reads_is_read_once_its_listing_idles(
    tmp_path,
):
    """A key that lists shards and renews the listing for ever, reading nothing: the peer
    reads the rest of the epoch, then those shards once nothing of them landed for
    ``idle_s``, and its run of one epoch ends with every sequence landed once."""
    async with loopback_network(3) as nodes:
        stranger = nodes[2]
        value = {"shards": [[0, 0], [0, 1]], "at": 0.0}
        assert await stranger.dht.store(leases_key(SWARM), value, ttl=600) > 0
        me = nodes[0].identity.peer_id_hex
        a = reader(tmp_path, "a", lease_s=4.0, idle_s=3.0)
        task = asyncio.create_task(a.run(nodes[0].dht, SWARM, me))
        ta = Trainer(a, me, give_up_s=60.0)
        await asyncio.to_thread(ta)
        await a.close()
        assert task.done()
        assert not ta.gave_up, "the run did not end: the stranger's listing held it"
        assert {0, 1} <= {r.shard for r in ta.read}
        cover = coverage([[Landing(1, "a", tuple(ta.read))]], COUNTS, epoch=0)
        assert (cover.duplicated, cover.missing) == (0, 0), cover
        # The listing still lives (ten minutes): it was passed over, not gone.
        result = await nodes[1].dht.get(leases_key(SWARM))
        assert result.entries[stranger.identity.peer_id_hex].value["shards"] == [[0, 0], [0, 1]]


async def test_a_donors_word_on_what_landed_decides_what_its_taker_reads_and_goes_no_further(
    tmp_path,
):
    """A joiner's donor may be a stranger (anyone may serve a state that passes the checks):
    its word that half the shards landed makes the joiner read only the rest, but the joiner
    does not pass it on, so a peer that averaged with the joiner reads that half."""
    async with loopback_network(3) as nodes:
        ids = [n.identity.peer_id_hex for n in nodes]
        liar = nodes[2]
        lied = range(len(COUNTS) // 2)
        for shard in lied:
            value = {"epoch": 0, "landed": [[0, COUNTS[shard]]], "at": 0.0}
            await liar.dht.store(shard_key(SWARM, shard), value, ttl=600)
        joiner = reader(tmp_path, "joiner", lease_s=4.0)
        joiner.adopted({ids[2]})  # the state it took came from the liar
        task = asyncio.create_task(joiner.run(nodes[0].dht, SWARM, ids[0]))
        tj = Trainer(joiner, ids[0], give_up_s=60.0)
        await asyncio.to_thread(tj)
        await joiner.close()
        assert task.done() and not tj.gave_up
        assert {r.shard for r in tj.read} == set(range(len(COUNTS))) - set(lied)  # believed
        for shard in lied:  # and published none of it
            result = await nodes[1].dht.get(shard_key(SWARM, shard))
            assert ids[0] not in result.entries, shard
        partner = reader(tmp_path, "partner", lease_s=4.0)
        partner.landed(1, {ids[0]: [], ids[1]: []}, {ids[0]: True, ids[1]: True}, ids[1])
        task = asyncio.create_task(partner.run(nodes[1].dht, SWARM, ids[1]))
        tp = Trainer(partner, ids[1], give_up_s=60.0)
        await asyncio.to_thread(tp)
        await partner.close()
        assert task.done() and not tp.gave_up
        # The partner read what the joiner skipped, and nothing the joiner saw land.
        landings = [Landing(1, "joiner", tuple(tj.read)), Landing(2, "partner", tuple(tp.read))]
        cover = coverage([landings], COUNTS, epoch=0)
        assert (cover.duplicated, cover.missing) == (0, 0), cover


def loosen_dataset_schemas(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every node in this process stores and serves ``shard/<s>`` spans and ``leases`` pairs
    of any length, in either order (the schemas before they asked for pairs): what a node
    whose checks let a malformed entry through hands its readers."""
    pair = ListOf(Int(minimum=0), 2)
    loose = {
        SHARD.name: owned_value(
            {"epoch": Int(minimum=0), "landed": ListOf(pair, MAX_LANDED_SPANS), "at": Float()}
        ),
        LEASES.name: owned_value({"shards": ListOf(pair, MAX_LEASES), "at": Float()}),
    }
    kinds = [dataclasses.replace(k, schema=loose.get(k.name, k.schema)) for k in records._KINDS]
    monkeypatch.setattr(records, "_KINDS", kinds)


async def test_a_partners_malformed_entries_leave_its_peer_leasing_and_counting_the_others(
    tmp_path, monkeypatch, caplog
):
    """A partner's ``shard/<s>`` entries whose spans are no pairs (or empty, or reversed),
    and a ``leases`` entry the same, reach the peer: each is passed over, the peer leases and
    lands every other shard, and another partner's word on the same shard still counts."""
    loosen_dataset_schemas(monkeypatch)
    async with loopback_network(3) as nodes:
        ids = [n.identity.peer_id_hex for n in nodes]
        bad, good = nodes[1], nodes[2]
        shapes = [[[5]], [[]], [[7, 3]], [[0, 4], [5]]]
        for shard in range(len(COUNTS)):
            value = {"epoch": 0, "landed": shapes[shard % len(shapes)], "at": 0.0}
            assert await bad.dht.store(shard_key(SWARM, shard), value, ttl=600) > 0
        assert await bad.dht.store(leases_key(SWARM), {"shards": [[0]], "at": 0.0}, ttl=600) > 0
        told = 0  # the honest partner saw all of it land (the other says [[5]] of it)
        value = {"epoch": 0, "landed": [[0, COUNTS[told]]], "at": 0.0}
        assert await good.dht.store(shard_key(SWARM, told), value, ttl=600) > 0
        result = await nodes[0].dht.get(shard_key(SWARM, 0))
        assert result.entries[ids[1]].value["landed"] == [[5]]  # it reaches the peer
        a = reader(tmp_path, "a", lease_s=4.0)
        a.landed(1, {ids[1]: [], ids[2]: []}, {i: True for i in ids}, ids[0])  # both partners
        task = asyncio.create_task(a.run(nodes[0].dht, SWARM, ids[0]))
        ta = Trainer(a, ids[0], give_up_s=30.0)
        with caplog.at_level(logging.WARNING, logger="swarmloco.dataset.leases"):
            await asyncio.to_thread(ta)
        await a.close()
        assert task.done() and not ta.gave_up, "the partner's entries stopped the peer"
        assert {r.shard for r in ta.read} == set(range(len(COUNTS))) - {told}
        told_landed = Landing(1, "good", (Range(0, told, 0, COUNTS[told]),))
        cover = coverage([[Landing(2, "a", tuple(ta.read)), told_landed]], COUNTS, epoch=0)
        assert (cover.duplicated, cover.missing) == (0, 0), cover
        assert f"peer {ids[1][:8]}'s entry is passed over" in caplog.text


async def test_a_reader_whose_leases_cannot_be_renewed_stops_reading_them(tmp_path):
    async with loopback_network(2) as nodes:
        me = nodes[0].identity.peer_id_hex
        a = reader(tmp_path, "a", lease_s=4.0)
        task = asyncio.create_task(a.run(nodes[0].dht, SWARM, me))
        await asyncio.to_thread(a.changed.wait, 10.0)  # a shard is leased
        assert a.reading and a.ready()
        broken = RuntimeError("the network is away")

        async def fail(*args: object, **kwargs: object) -> int:
            raise broken

        nodes[0].dht.store = fail  # type: ignore[method-assign]  # every store fails from now
        # Within three quarters of the lease's life, nothing more is read of it: another
        # peer may take it once it expires.
        deadline = asyncio.get_running_loop().time() + 10.0
        while a.ready():
            assert asyncio.get_running_loop().time() < deadline, "still reading"
            await asyncio.sleep(0.05)
        assert a.reading  # still its own, not read until renewed
        await a.close()
        assert task.done()
