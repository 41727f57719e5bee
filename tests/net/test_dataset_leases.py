"""Leases of a pinned dataset's shards over real DHT nodes on loopback: readers share an
epoch without reading a sequence twice, a dead reader's shard goes to another from where it
landed, what a peer reads is what has not landed in its state (a state taken decides it),
and a malformed listing stops nothing."""

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

from swarmloco.dataset.leases import LeasedData, read_batch
from swarmloco.dataset.ledger import (
    Landed,
    Landing,
    Range,
    Sequences,
    coverage,
    epoch_order,
    merged,
)
from swarmloco.net import records
from swarmloco.net.records import (
    LEASES,
    MAX_LEASES,
    Float,
    Int,
    ListOf,
    leases_key,
    owned_value,
    swarm_key,
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


class Group:
    """Readers that average together: every round one of them lands is applied by all, so
    what it landed is in each one's state (as ``DilocoState.apply`` adds it)."""

    def __init__(self, **readers: LeasedData) -> None:
        self.readers = readers
        self.lock = threading.RLock()
        self.round = 0

    def land(self, me: str, declared: list[tuple[int, int, int, int]]) -> None:
        with self.lock:
            self.round += 1
            for name, data in self.readers.items():
                data.landed(self.round, {me: declared}, {me: True}, name)


class Trainer:
    """A reader's training thread: reads batches and lands each as a round (of its group, by
    default of itself alone), until the reader says nothing is left (or ``give_up_s``
    passed: ``gave_up``)."""

    def __init__(
        self,
        data: LeasedData,
        me: str,
        *,
        steps: int | None = None,
        give_up_s: float = 90.0,
        group: Group | None = None,
        box: tuple[int, int] | None = None,
    ) -> None:
        self.data, self.me, self.steps = data, me, steps
        self.box = box  # (ranks, micro-batches): a box's rank 0, dealing each step
        self.dealt: list[list[list[list[Range]]]] = []
        self.group = group or Group(**{me: data})
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
            if not self.data.ready(1 if self.box is None else self.box[0] * self.box[1]):
                self.data.changed.wait(0.2)
                self.data.changed.clear()
                continue
            if self.box is None:
                self.data.next_batch()
            else:
                self.dealt.append(self.data.deal(*self.box))
            with self.group.lock:  # the round this reader declares for is the group's next
                declared = self.data.declare(self.group.round + 1, 0)
                self.group.land(self.me, declared)
            self.read += [Range(*r) for r in declared]
            done += 1


async def test_two_readers_share_an_epoch_and_land_every_sequence_once(tmp_path):
    async with loopback_network(3) as nodes:
        a, b = reader(tmp_path, "a", lease_s=4.0), reader(tmp_path, "b", lease_s=4.0)
        ids = [nodes[0].identity.peer_id_hex, nodes[1].identity.peer_id_hex]
        group = Group(**{ids[0]: a, ids[1]: b})  # peers of one swarm average together
        tasks = [
            asyncio.create_task(a.run(nodes[0].dht, SWARM, ids[0])),
            asyncio.create_task(b.run(nodes[1].dht, SWARM, ids[1])),
        ]
        ta, tb = Trainer(a, ids[0], group=group), Trainer(b, ids[1], group=group)
        await asyncio.gather(asyncio.to_thread(ta), asyncio.to_thread(tb))
        await a.close()
        await b.close()
        assert all(t.done() for t in tasks)
        assert ta.read and tb.read  # both read
        landings = [Landing(1, "a", tuple(ta.read)), Landing(1, "b", tuple(tb.read))]
        cover = coverage([landings], COUNTS, epoch=0)
        assert (cover.duplicated, cover.missing) == (0, 0), cover
        # Their states hold the same: every sequence once.
        assert a.account == b.account
        state = a.account.coverage(COUNTS, epoch=0)
        assert (state.duplicated, state.missing) == (0, 0), state
        # The leases were released on leaving.
        result = await nodes[2].dht.get(leases_key(SWARM))
        assert all(e.value["shards"] == [] for e in result.entries.values())


@pytest.mark.parametrize(
    ("ranks", "micro", "last"),
    [(2, 2, [[4, 0], [4, 0]]), (1, 3, [[4, 4, 0]])],
    ids=["a box of 2 ranks", "a peer accumulating 3"],
)
async def test_a_step_deals_every_sequence_once_and_the_last_step_is_short(
    tmp_path, ranks, micro, last
):
    """A box's rank 0 (2 ranks, 2 micro-batches of 4 a step), or a peer of one rank
    accumulating 3, reads the epoch alone: each step deals every rank its ranges, nothing
    twice; the last step (56 sequences: 3 x 16 + 8, 4 x 12 + 8) is short, its last
    micro-batches empty (they were an error), rank 0's first one full. (A step needing more
    than the lease task kept ahead, two micro-batches, never came before.)"""
    async with loopback_network(2) as nodes:
        me = nodes[0].identity.peer_id_hex
        box = reader(tmp_path, "box", lease_s=4.0)
        run = asyncio.create_task(box.run(nodes[0].dht, SWARM, me))
        trainer = Trainer(box, me, box=(ranks, micro))
        await asyncio.to_thread(trainer)
        await box.close()
        assert run.done() and not trainer.gave_up
    dealt = [r for step in trainer.dealt for rank in step for micro in rank for r in micro]
    assert merged(dealt) == merged(trainer.read)  # what rank 0 declares is all it dealt
    cover = coverage([[Landing(1, "box", tuple(dealt))]], COUNTS, epoch=0)
    assert (cover.duplicated, cover.missing) == (0, 0), cover
    sizes = [[[sum(r.count for r in m) for m in rank] for rank in step] for step in trainer.dealt]
    assert sizes[:-1] == [[[4] * micro] * ranks] * (len(sizes) - 1), sizes
    assert sizes[-1] == last, sizes
    x, y = read_batch(box.sequences, [], box.vocab_size)  # an empty micro-batch
    assert x.shape == y.shape == (0, SEQ)
    for part in trainer.dealt[-1]:
        for ranges in part:
            x, y = read_batch(box.sequences, ranges, box.vocab_size)
            assert x.shape == (sum(r.count for r in ranges), SEQ)


async def test_a_reader_whose_rounds_fail_reads_what_it_leased_then_averages_it(tmp_path):
    """Its partners gone, a peer's rounds fail while it trains on: it reads every shard it
    may lease to its end (at :data:`MAX_LEASES` the last of them as a short step: steps of
    12 do not divide them), then says no batch comes until they land (``exhausted``: the
    daemon averages at once, alone if need be, where it used to idle until the listing
    idled out, 30 minutes); once they landed it reads on, every sequence once."""
    async with loopback_network(2) as nodes:
        me = nodes[0].identity.peer_id_hex
        data = reader(tmp_path, "a", lease_s=4.0)
        run = asyncio.create_task(data.run(nodes[0].dht, SWARM, me))
        read: list[Range] = []

        def train_with_every_round_failing() -> None:
            deadline = time.monotonic() + 60
            while not data.exhausted:
                assert time.monotonic() < deadline, (data.reading, read)
                if not data.ready(3):
                    data.changed.wait(0.2)
                    data.changed.clear()
                    continue
                for _ in range(3):
                    read.extend(data.next_ranges())

        await asyncio.to_thread(train_with_every_round_failing)
        leased = sorted(data.reading)
        assert len(leased) == MAX_LEASES and not any(data.reading.values())
        assert merged(read) == merged(Range(0, s, 0, COUNTS[s]) for _, s in leased)
        group = Group(**{me: data})  # a round lands at last: its shards are released
        group.land(me, data.declare(1, 0))
        assert not data.exhausted
        rest = Trainer(data, me, group=group, box=(1, 3))
        await asyncio.to_thread(rest)
        await data.close()
        assert run.done() and not rest.gave_up
    cover = coverage([[Landing(1, "a", tuple(read)), Landing(2, "a", tuple(rest.read))]],
                     COUNTS, epoch=0)  # fmt: skip
    assert (cover.duplicated, cover.missing) == (0, 0), cover


async def test_a_shard_leased_while_a_round_is_open_is_read_once_it_landed(tmp_path):
    """A member of a round released a shard once the round landed its last ranges (it
    applied the round first); this reader, whose round is still in flight, leases the
    shard from its account before the landing. It reads nothing of it until its round
    ended: once it landed, the shard is done (before, the whole shard was to be read at
    once, and read twice: a pipeline's stage 0, or any peer whose rounds overlap steps)."""
    async with loopback_network(2) as nodes:
        me, other = nodes[0].identity.peer_id_hex, nodes[1].identity.peer_id_hex
        data = reader(tmp_path, "a", lease_s=4.0)
        first = epoch_order(5, 0, len(COUNTS))[int(me[:8], 16) % len(COUNTS)]
        assert data.declare(1, 0) == []  # its round 1 is in flight
        await data._tend(nodes[0].dht, SWARM, me)  # one turn of its lease task
        assert (0, first) in data.reading
        assert not data.ready()  # (it was ready: the shard's 10 sequences to read)
        whole = (0, first, 0, COUNTS[first])  # what the other member read and declared
        data.landed(1, {other: [whole], me: []}, {other: True, me: True}, me)
        group = Group(**{me: data})
        group.round = 1
        trainer = Trainer(data, me, group=group)
        run = asyncio.create_task(data.run(nodes[0].dht, SWARM, me))
        await asyncio.to_thread(trainer)
        await data.close()
        assert run.done() and not trainer.gave_up
    assert trainer.read and all(r.shard != first for r in trainer.read), trainer.read
    landings = [Landing(1, other, (Range(*whole),)), Landing(2, me, tuple(trainer.read))]
    cover = coverage([landings], COUNTS, epoch=0)
    assert (cover.duplicated, cover.missing) == (0, 0), cover


async def test_a_dead_readers_shard_goes_to_another_from_where_it_landed(tmp_path):
    async with loopback_network(3) as nodes:
        ids = [n.identity.peer_id_hex for n in nodes]
        a = reader(tmp_path, "a", lease_s=4.0)
        # One turn of its lease task leases a shard (stored for 4 s), one batch of it
        # lands, then it dies: nothing renews or releases its lease, which expires. (Its
        # task is not cancelled in the middle of a DHT call: a test's loop closing on a
        # call so cut short has crashed grpc.)
        await a._tend(nodes[0].dht, SWARM, ids[0])
        ta = Trainer(a, ids[0], steps=1)
        await asyncio.to_thread(ta)
        (first,) = {r.shard for r in ta.read}
        assert a.reading.keys() == {(0, first)}
        b = reader(tmp_path, "b", lease_s=4.0)
        b.adopted(a.account)  # b took the state a left: what landed in it comes with it
        tb = Trainer(b, ids[1])
        run_b = asyncio.create_task(b.run(nodes[1].dht, SWARM, ids[1]))
        await asyncio.to_thread(tb)
        await b.close()
        assert run_b.done()
        cover = coverage([[Landing(1, "a", tuple(ta.read)), Landing(1, "b", tuple(tb.read))]],
                         COUNTS, epoch=0)  # fmt: skip
        assert (cover.duplicated, cover.missing) == (0, 0), cover
        assert any(r.shard == first for r in tb.read)  # it finished the dead one's shard


async def test_a_stranger_cannot_list_more_than_the_cap_nor_say_what_landed(tmp_path):
    async with loopback_network(3) as nodes:
        stranger = nodes[2]
        # It cannot lease more than the cap in its record (every node refuses one).
        with pytest.raises(ValueError, match="at most"):
            value = {"shards": [[0, s] for s in range(MAX_LEASES + 1)], "at": 0.0}
            await stranger.dht.store(leases_key(SWARM), value, ttl=60)
        # Nor is there a record in which to say a shard landed (what landed is a state's).
        with pytest.raises(ValueError, match="no record kind"):
            value = {"epoch": 0, "landed": [[0, COUNTS[0]]], "at": 0.0}
            await stranger.dht.store(swarm_key(SWARM, "shard/0"), value, ttl=600)
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


async def test_what_landed_in_the_state_taken_decides_what_is_read_not_a_union(tmp_path):
    """A peer takes a state in which half the shards landed: it reads only the rest. Then it
    takes another (its own again after a roll-back, say) in which only the first shard
    landed: what landed only in the state it left is read again, so the state it ends on
    holds every sequence once."""
    async with loopback_network(2) as nodes:
        me = nodes[0].identity.peer_id_hex
        half = range(len(COUNTS) // 2)
        taken = Landed([Range(0, s, 0, COUNTS[s]) for s in half], [sum(COUNTS[s] for s in half)])
        joiner = reader(tmp_path, "joiner", lease_s=4.0)
        joiner.adopted(taken)
        task = asyncio.create_task(joiner.run(nodes[0].dht, SWARM, me))
        first = Trainer(joiner, me, give_up_s=60.0)
        await asyncio.to_thread(first)
        assert not first.gave_up
        assert {r.shard for r in first.read} == set(range(len(COUNTS))) - set(half)
        joiner.adopted(Landed([Range(0, 0, 0, COUNTS[0])], [COUNTS[0]]))
        again = Trainer(joiner, me, give_up_s=60.0)
        await asyncio.to_thread(again)
        await joiner.close()
        assert task.done() and not again.gave_up
        assert {r.shard for r in again.read} == set(range(len(COUNTS))) - {0}
        cover = joiner.account.coverage(COUNTS, epoch=0)
        assert (cover.duplicated, cover.missing) == (0, 0), cover


def loosen_dataset_schemas(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every node in this process stores and serves ``leases`` pairs of any length, in
    either order (the schema before it asked for pairs): what a node whose checks let a
    malformed entry through hands its readers."""
    pair = ListOf(Int(minimum=0), 2)
    loose = {LEASES.name: owned_value({"shards": ListOf(pair, MAX_LEASES), "at": Float()})}
    kinds = [dataclasses.replace(k, schema=loose.get(k.name, k.schema)) for k in records._KINDS]
    monkeypatch.setattr(records, "_KINDS", kinds)


async def test_a_malformed_listing_leaves_its_peer_leasing_and_counting_the_others(
    tmp_path, monkeypatch, caplog
):
    """A ``leases`` entry whose leases are no pairs reaches the peer: it is passed over, and
    the peer still leaves alone the shard another lists and leases and lands every other."""
    loosen_dataset_schemas(monkeypatch)
    async with loopback_network(3) as nodes:
        ids = [n.identity.peer_id_hex for n in nodes]
        bad, other = nodes[1], nodes[2]
        assert await bad.dht.store(leases_key(SWARM), {"shards": [[0]], "at": 0.0}, ttl=600) > 0
        value = {"shards": [[0, 0]], "at": 0.0}
        assert await other.dht.store(leases_key(SWARM), value, ttl=600) > 0
        result = await nodes[0].dht.get(leases_key(SWARM))
        assert result.entries[ids[1]].value["shards"] == [[0]]  # it reaches the peer
        a = reader(tmp_path, "a", lease_s=4.0)
        task = asyncio.create_task(a.run(nodes[0].dht, SWARM, ids[0]))
        rest = sum(COUNTS[1:])  # what it reads: every shard but the one listed, in batches
        ta = Trainer(a, ids[0], steps=-(-rest // a.batch_size), give_up_s=60.0)
        with caplog.at_level(logging.WARNING, logger="swarmloco.dataset.leases"):
            await asyncio.to_thread(ta)
        await a.close()
        assert task.done() and not ta.gave_up
        assert {r.shard for r in ta.read} == set(range(1, len(COUNTS)))
        assert sum(r.count for r in ta.read) == rest
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


async def test_a_reader_whose_leases_lapsed_gives_up_what_another_took_meanwhile(tmp_path):
    """A reads a batch of its shard and then its leases go unrenewed past their life (its
    network away; a machine that froze or slept is the same). B, a peer it averaged with,
    takes the shard, reading what has not landed in its state: the batch A read too. Back,
    A starts no round until its lease task looked (``unsure``), finds the shard B's
    (``lapsed``), and once its local work is thrown away (as the peer does between two
    steps) forgets what it read of it: nothing of it is declared, nothing read twice."""
    async with loopback_network(3) as nodes:
        ids = [n.identity.peer_id_hex for n in nodes]
        a = reader(tmp_path, "a", lease_s=4.0)
        run_a = asyncio.create_task(a.run(nodes[0].dht, SWARM, ids[0]))
        await asyncio.to_thread(a.changed.wait, 10.0)  # a shard is leased
        assert a.ready()
        read = a.next_ranges()
        (shard,) = {(r.epoch, r.shard) for r in read}
        store = nodes[0].dht.store

        async def fail(*args: object, **kwargs: object) -> int:
            raise RuntimeError("the network is away")

        nodes[0].dht.store = fail  # type: ignore[method-assign]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30.0
        while not a.unsure():
            assert loop.time() < deadline, "its leases never lapsed"
            await asyncio.sleep(0.05)
        b = reader(tmp_path, "b", lease_s=4.0)
        others = [s for s in range(len(COUNTS)) if (0, s) != shard]
        # Every other shard landed in b's state: the lapsed one is all b has left to take.
        b.adopted(Landed([Range(0, s, 0, COUNTS[s]) for s in others],
                         [sum(COUNTS[s] for s in others)]))  # fmt: skip
        run_b = asyncio.create_task(b.run(nodes[1].dht, SWARM, ids[1]))
        while shard not in b.reading:  # its lease expired: b may take it
            assert loop.time() < deadline + 30.0, "b never took the lapsed shard"
            await asyncio.sleep(0.05)
        assert b.ready() and {(r.epoch, r.shard) for r in b.next_ranges()} == {shard}
        nodes[0].dht.store = store  # type: ignore[method-assign]  # back
        while not a.lapsed():
            assert loop.time() < deadline + 60.0, "a never found its shard taken"
            await asyncio.sleep(0.05)
        a.discard()  # the peer throws its local work away (the hook does, between steps)
        assert a.forget_lapsed() == sum(r.count for r in read)
        assert shard not in a.reading
        while a.unsure():  # its leases are renewed (without the shard) right after
            assert loop.time() < deadline + 90.0, "a never renewed its leases"
            await asyncio.sleep(0.05)
        assert all((r[0], r[1]) != shard for r in a.declare(1, 0))
        for data, task in ((a, run_a), (b, run_b)):
            await data.close()
            assert task.done()
