"""The DHT over real gRPC on loopback: records across nodes, and every kind of bad input."""

import asyncio
import contextlib
import dataclasses
import os
import threading
import time
import uuid
from collections import Counter
from functools import partial

import msgpack
import pytest
from netutil import SWARM, closed_port, counter_key, loopback_network, serving, wait_for
from tcpproxy import TcpProxy

from swarmloco.core.manifest import SwarmManifest
from swarmloco.errors import ManifestError, NetworkError
from swarmloco.net import records as records_module
from swarmloco.net.client import RpcClient, RpcError
from swarmloco.net.dht.contact import distance, sign_card
from swarmloco.net.dht.node import DhtConfig, DHTNode
from swarmloco.net.dht.storage import StorageConfig
from swarmloco.net.dht.transport import STORE
from swarmloco.net.dht.wire import key_id, record_to_proto, signed_store_request
from swarmloco.net.endpoints import parse_endpoint
from swarmloco.net.identity import Identity
from swarmloco.net.node import NetNode, NodeConfig
from swarmloco.net.records import (
    MEMBER_FIELD,
    PEERS,
    Record,
    encode_value,
    make_record,
    peers_key,
    sign,
)
from swarmloco.net.server import ServerConfig
from swarmloco.net.swarm import announce_peer, fetch_manifest, find_peers, publish_manifest
from swarmloco.net.work import IdentityWork, solve
from swarmloco.proto.v1 import dht_pb2 as pb

PEER = {"endpoint": "127.0.0.1:5000", "role": "trainer", "version": "0.1.0", "public": True}


def manifest(**overrides) -> SwarmManifest:
    return SwarmManifest(
        task="gpt-bytes", model={"preset": "tiny"}, data={}, hparams={}, **overrides
    )


async def test_records_stored_by_one_node_are_found_from_every_other():
    async with loopback_network(8) as nodes:
        swarm = manifest()
        assert await publish_manifest(nodes[2].dht, swarm) >= 8
        for node in nodes:
            fetched = await fetch_manifest(node.dht, swarm.swarm_id)
            assert fetched == swarm
        for node in nodes[:5]:
            await announce_peer(node.dht, swarm.swarm_id, role="trainer")
        peers = await find_peers(nodes[7].dht, swarm.swarm_id)
        assert {p.peer_id for p in peers} == {n.identity.peer_id_hex for n in nodes[:5]}
        assert {p.endpoint for p in peers} == {n.endpoint for n in nodes[:5]}
        # An owner updates its entry by storing a later record; readers see the new value.
        await nodes[0].dht.store(
            peers_key(swarm.swarm_id), {**PEER, "role": "client", "endpoint": ""}, ttl=600
        )
        peers = {p.peer_id: p for p in await find_peers(nodes[4].dht, swarm.swarm_id)}
        assert peers[nodes[0].identity.peer_id_hex].role == "client"


async def send_store(client: RpcClient, target: NetNode, sender: Identity, records, **kwargs):
    card = sign_card(sender, "")  # a client-mode card: the sender need not serve
    request = signed_store_request(
        sender, card, records, timestamp_ms=kwargs.get("ts", int(time.time() * 1000))
    )
    return await client.call(target.endpoint, STORE, request, timeout=5, attempts=1)


async def test_forged_unsigned_and_malformed_records_are_refused_and_counted():
    victim, mallory = Identity.generate(), Identity.generate()
    now = time.time()
    key = peers_key(SWARM)
    genuine = make_record(key, PEER, expiration=now + 60, owner=victim)
    evil = make_record(key, {**PEER, "endpoint": "6.6.6.6:666"}, expiration=now + 60, owner=mallory)
    counter = make_record(
        counter_key(), {"count": 1, "label": ""}, expiration=now + 60, owner=mallory
    )
    # A forged signature last: the rest of a request is not read past one.
    bad = {
        "unsigned": dataclasses.replace(genuine, signature=b"", owner_public_key=b""),
        "schema": sign(
            dataclasses.replace(counter, value=msgpack.packb({"count": 1.0, "label": ""})), mallory
        ),
        "oversize": sign(dataclasses.replace(evil, value=b"\x00" * 10_000), mallory),
        "unknown-kind": Record(f"swarmloco/v1/{SWARM}/whatever", "", b"\x01", now + 60),
        "expired": make_record(key, PEER, expiration=now - 1, owner=mallory),
        "bad-signature": dataclasses.replace(evil, subkey=victim.peer_id_hex),
    }
    async with loopback_network(3) as nodes, RpcClient() as client:
        target = nodes[1]
        answer = await send_store(client, target, mallory, list(bad.values()))
        assert [r.stored for r in answer.results] == [False] * len(bad)
        for (code, _), result in zip(bad.items(), answer.results, strict=True):
            assert result.reason, code
        assert len(target.dht.storage) == 0
        for code in bad:
            assert target.dht.rejections.counts[code] >= 1, code
        # Nobody else got them either, and the genuine record still goes through.
        assert (await nodes[2].dht.get(key)).entries == {}
        assert (await send_store(client, target, mallory, [genuine])).results[0].stored


async def test_store_requests_must_be_signed_by_their_sender_and_recent():
    mallory, victim = Identity.generate(), Identity.generate()
    async with loopback_network(2) as nodes, RpcClient() as client:
        target = nodes[1]
        record = make_record(peers_key(SWARM), PEER, expiration=time.time() + 60, owner=mallory)
        # Signed by mallory but claiming to come from the victim (to spend its quota).
        request = signed_store_request(
            mallory, sign_card(victim, ""), [record], timestamp_ms=int(time.time() * 1000)
        )
        with pytest.raises(RpcError, match="not signed by its sender"):
            await client.call(target.endpoint, STORE, request, timeout=5)
        # A genuine request replayed an hour later.
        stale = int((time.time() - 3600) * 1000)
        request = signed_store_request(
            mallory, sign_card(mallory, ""), [record], timestamp_ms=stale
        )
        with pytest.raises(RpcError, match="replayed"):
            await client.call(target.endpoint, STORE, request, timeout=5)
        # A card whose signature does not match.
        card = sign_card(mallory, "")
        forged = dataclasses.replace(card, endpoint="127.0.0.1:1")
        request = signed_store_request(
            mallory, forged, [record], timestamp_ms=int(time.time() * 1000)
        )
        with pytest.raises(RpcError, match="contact card is not signed"):
            await client.call(target.endpoint, STORE, request, timeout=5)
        assert len(target.dht.storage) == 0


async def test_a_hundred_thousand_subkeys_from_one_peer_are_not_all_stored():
    total, quota, batch = 100_000, 256, 1000
    # The quota per sender, alone: the share of a key per source network would otherwise
    # bind at the same count (all of this comes from 127.0.0.1; tested on its own below).
    storage = StorageConfig(max_records_per_sender=quota, max_subkeys_per_network=2 * quota)
    config = DhtConfig(max_records_per_request=batch, storage=storage)
    flooder = Identity.generate()
    now = time.time()
    # The first records are genuine (each from its own key); the quota is checked before
    # any signature, so the rest need not be, and cost the target no signature check.
    genuine = [
        make_record(
            counter_key(),
            {"count": i, "label": ""},
            expiration=now + 600,
            owner=Identity.generate(),
        )
        for i in range(quota + 50)
    ]
    filler = [
        Record(
            counter_key(),
            uuid.uuid4().hex + "00000000",
            genuine[0].value,
            now + 600,
            b"k" * 32,
            b"s" * 64,
        )
        for _ in range(total - len(genuine))
    ]
    records = genuine + filler
    assert len({r.subkey for r in records}) == total
    async with loopback_network(2, dht=config) as nodes, RpcClient() as client:
        target = nodes[1]
        started = time.monotonic()
        stored = 0
        for i in range(0, total, batch):
            answer = await send_store(client, target, flooder, records[i : i + batch])
            stored += sum(r.stored for r in answer.results)
        elapsed = time.monotonic() - started
        assert stored == quota
        assert target.dht.storage.records_from(flooder.peer_id) == quota
        assert target.dht.rejections.counts["quota"] == total - quota
        # Bounded by the quota, not the flood (in memory, about 1.1 KB a record).
        assert target.dht.storage.bytes_used < 1500 * quota
        # The node still serves everyone else.
        other = await nodes[0].dht.store(peers_key(SWARM), PEER, ttl=60)
        assert other == 2
    assert elapsed < 60


def fresh_peer_records(count: int, key: str) -> list[Record]:
    """``count`` valid peers records, each owned by a key of its own (keys are free)."""
    expiration = time.time() + 600
    return [
        make_record(key, PEER, expiration=expiration, owner=Identity.generate())
        for _ in range(count)
    ]


@contextlib.asynccontextmanager
async def from_address(host: str, target: NetNode):
    """The endpoint through which calls reach ``target`` from ``host`` (a 127.0.0.N)."""
    async with TcpProxy(source=host) as proxy:
        proxy.target = lambda: parse_endpoint(target.endpoint)
        yield f"127.0.0.1:{proxy.port}"


async def relay(client: RpcClient, endpoint: str, sender: Identity, records) -> int:
    """Store ``records`` through ``endpoint``, sent (and signed) by ``sender``; how many
    were taken."""
    card = sign_card(sender, "")
    stored = 0
    for i in range(0, len(records), 64):
        request = signed_store_request(
            sender, card, records[i : i + 64], timestamp_ms=int(time.time() * 1000)
        )
        answer = await client.call(endpoint, STORE, request, timeout=10, attempts=1)
        stored += sum(r.stored for r in answer.results)
    return stored


async def test_one_address_storing_the_records_of_4096_fresh_keys_leaves_room_for_newcomers():
    """The flood fills at most its network's share of the key at every node: the peers that
    announce themselves afterwards are stored and found everywhere, and a node that joins
    later is handed their records, not the flood's alone."""
    key = peers_key(SWARM)
    share = StorageConfig().max_subkeys_per_network
    flood = fresh_peer_records(4096, key)
    flooder = Identity.generate()
    async with loopback_network(4) as nodes, RpcClient() as client:
        for node in nodes:
            async with from_address("127.0.0.2", node) as endpoint:
                assert await relay(client, endpoint, flooder, flood) == share
        for node in nodes:
            assert node.dht.storage.records_via("127.0.0.2", key=key) == share
            assert node.dht.rejections.counts["network-quota"] == len(flood) - share
            assert node.dht.storage.records_from(flooder.peer_id) == share
        # Client-mode peers hold nothing: the nodes hand their records on for them.
        clients = [
            NetNode(
                identity=Identity.generate(),
                config=NodeConfig(server=None, peers=(nodes[0].endpoint,)),
            )
            for _ in range(2)
        ]
        async with contextlib.AsyncExitStack() as stack:
            for peer in clients:
                await stack.enter_async_context(peer)
            for peer in (*nodes, *clients):
                assert await announce_peer(peer.dht, SWARM, role="trainer") == len(nodes)
        announced = {n.identity.peer_id_hex for n in (*nodes, *clients)}
        newcomer = NetNode(
            identity=Identity.generate(), config=NodeConfig(peers=(nodes[0].endpoint,))
        )
        async with newcomer:
            # Every node hands it the key, all of it from 127.0.0.1 (one network): the
            # peers' records among the first, not after the flood's share.
            held = newcomer.dht.storage
            await wait_for(lambda: announced <= {r.subkey for r in held.get(key)})
            assert await announce_peer(newcomer.dht, SWARM, role="trainer") == len(nodes) + 1
            honest = announced | {newcomer.identity.peer_id_hex}
            for node in (*nodes, newcomer):
                assert honest <= {r.subkey for r in node.dht.storage.get(key)}, node
                found = {p.peer_id for p in await find_peers(node.dht, SWARM)}
                assert honest <= found, node
                assert len(found - honest) <= share  # the flood's share, and no more


async def test_a_full_key_makes_room_for_a_newcomers_own_record():
    """Sixteen addresses fill a node's peers key to its 4,096 subkeys; a seventeenth is
    refused, and a newcomer's own record takes the place of a relayed one."""
    key = peers_key(SWARM)
    share = StorageConfig().max_subkeys_per_network
    flood = fresh_peer_records(16 * share, key)
    flooder = Identity.generate()
    async with loopback_network(2) as (entry, target), RpcClient() as client:
        for i in range(16):
            async with from_address(f"127.0.0.{i + 2}", target) as endpoint:
                part = flood[i * share : (i + 1) * share]
                assert await relay(client, endpoint, flooder, part) == share
        assert len(target.dht.storage.get(key)) == PEERS.max_subkeys
        async with from_address("127.0.0.18", target) as endpoint:
            assert await relay(client, endpoint, flooder, fresh_peer_records(1, key)) == 0
        assert target.dht.rejections.counts["quota"] == 1
        newcomer = NetNode(identity=Identity.generate(), config=NodeConfig(peers=(entry.endpoint,)))
        async with newcomer:
            assert await announce_peer(newcomer.dht, SWARM, role="trainer") == 3
        assert target.dht.storage.evicted == 1
        held = {r.subkey for r in target.dht.storage.get(key)}
        assert newcomer.identity.peer_id_hex in held and len(held) == PEERS.max_subkeys
        found = {p.peer_id for p in await find_peers(target.dht, SWARM)}
        assert newcomer.identity.peer_id_hex in found


async def test_a_readers_first_read_of_a_full_key_lets_its_event_loop_in(monkeypatch):
    """A key full of records under free keys is thousands of signature checks for a reader
    that has not seen them (a third of a second an answer): they run beside its event
    loop, which goes on serving its calls and rounds meanwhile."""
    key = peers_key(SWARM)
    share = StorageConfig().max_subkeys_per_network
    flood = fresh_peer_records(16 * share, key)
    flooder = Identity.generate()
    checking = threading.Event()  # the reader's first signature check began
    let_go = threading.Event()  # its event loop ran meanwhile
    waited_out: list[bool] = []
    check = records_module.validate

    def validate(record, *, now):
        if not checking.is_set():
            checking.set()
            waited_out.append(not let_go.wait(timeout=10))
        return check(record, now=now)

    async def watch() -> None:
        await wait_for(checking.is_set)
        let_go.set()

    async with loopback_network(2) as (entry, target), RpcClient() as client:
        for i in range(16):
            async with from_address(f"127.0.0.{i + 2}", target) as endpoint:
                part = flood[i * share : (i + 1) * share]
                assert await relay(client, endpoint, flooder, part) == share
        reader = NetNode(
            identity=Identity.generate(), config=NodeConfig(server=None, peers=(entry.endpoint,))
        )
        async with reader:
            monkeypatch.setattr(records_module, "validate", validate)
            watcher = asyncio.create_task(watch())
            found = {p.peer_id for p in await find_peers(reader.dht, SWARM)}
            await watcher
        assert waited_out == [False]  # at the old code (checks on the loop): [True]
        assert {r.subkey for r in flood} <= found


async def test_a_store_request_carrying_a_forged_record_is_not_read_past_it():
    """A forged signature costs nothing to make and a check (about 90 us) to refuse, and a
    record that fails is never stored, so it never fills a quota: 1,280 records with random
    bytes for signatures in 20 requests from 127.0.0.2 cost the node 20 checks, the rest of
    each request refused unread (honest nodes relay only records they checked); records
    before the forged one in a request are stored, and a newcomer's from 127.0.0.3 too."""
    key = peers_key(SWARM)
    forged = [
        dataclasses.replace(r, signature=os.urandom(64)) for r in fresh_peer_records(20 * 64, key)
    ]
    async with loopback_network(2) as (_, target), RpcClient() as client:
        async with from_address("127.0.0.2", target) as endpoint:
            assert await relay(client, endpoint, Identity.generate(), forged) == 0
            # At the code before, every one was checked: 1,280 bad signatures.
            assert target.dht.rejections.counts["bad-signature"] == 20
            mixed = [*fresh_peer_records(3, key), forged[0], *fresh_peer_records(3, key)]
            assert await relay(client, endpoint, Identity.generate(), mixed) == 3
        assert target.dht.rejections.counts["bad-signature"] == 21
        async with from_address("127.0.0.3", target) as endpoint:
            newcomer = fresh_peer_records(1, key)
            assert await relay(client, endpoint, Identity.generate(), newcomer) == 1


def made_up_proofs(keys: list[Identity], key: str) -> list[Record]:
    """Peers records each showing a made-up proof of work: half signed by a key of
    ``keys`` (keys are free), half with random bytes for a key and a signature."""
    expiration = time.time() + 600
    signed = [
        make_record(key, {**PEER, MEMBER_FIELD: os.urandom(8)}, expiration=expiration, owner=k)
        for k in keys
    ]
    value = encode_value(key, {**PEER, MEMBER_FIELD: os.urandom(8)})
    unsigned = [
        Record(key, os.urandom(20).hex(), value, expiration, os.urandom(32), os.urandom(64))
        for _ in keys
    ]
    return signed + unsigned


async def test_made_up_proofs_from_one_address_leave_newcomers_proofs_checked_at_once():
    """Eight streams of records with made-up proofs of work from 127.0.0.2 to a node that
    asks for work: each of three newcomers' proven records, sent once from 127.0.0.3 while
    the flood goes on, is stored and read there."""
    key = peers_key(SWARM)
    bits = 4
    flooder = Identity.generate()
    keys = [Identity.generate() for _ in range(32)]
    newcomers = [Identity.generate() for _ in range(3)]
    records = [
        make_record(
            key,
            {**PEER, MEMBER_FIELD: solve(SWARM, n.peer_id, bits)},
            expiration=time.time() + 600,
            owner=n,
        )
        for n in newcomers
    ]
    sent = [0]
    async with loopback_network(1) as (target,), RpcClient() as client:
        gate = IdentityWork(swarm_id=SWARM, bits=bits)
        target.dht.admit(gate)

        async def flood(endpoint: str) -> None:
            while True:
                try:
                    await relay(client, endpoint, flooder, made_up_proofs(keys, key))
                except RpcError:  # the flood's own calls may fail on a busy machine
                    continue
                sent[0] += 1

        async with (
            from_address("127.0.0.2", target) as junk,
            from_address("127.0.0.3", target) as honest,
            asyncio.TaskGroup() as flooding,
        ):
            started = time.monotonic()
            tasks = [flooding.create_task(flood(junk)) for _ in range(8)]
            await wait_for(lambda: sent[0] >= 40)  # 2,560 records: every check budget spent
            for newcomer, record in zip(newcomers, records, strict=True):
                await asyncio.sleep(0.5)
                stored = None
                while stored is None:  # a call that never got through is sent again
                    try:
                        stored = await relay(client, honest, newcomer, [record])
                    except RpcError:  # (each call has its deadline: the flood may starve it)
                        continue
                assert stored == 1, f"newcomer's proof not checked ({gate.checked} checks)"
            config = NodeConfig(server=None, peers=(target.endpoint,))
            async with NetNode(identity=Identity.generate(), config=config) as reader:
                found = {p.peer_id for p in await find_peers(reader.dht, SWARM)}
            assert {n.peer_id_hex for n in newcomers} <= found
            for task in tasks:
                task.cancel()
        counts = target.dht.rejections.counts
        assert counts["unproven"] > 0 and counts["bad-signature"] > 0
        # However many it was shown, a node checks at most 40 proofs a second (200 at once).
        assert gate.checked <= 200 + 40 * (time.monotonic() - started)


async def test_a_reader_checks_each_record_once_however_often_it_reads_the_key():
    key = peers_key(SWARM)
    records = fresh_peer_records(200, key)
    async with loopback_network(2) as nodes, RpcClient() as client:
        for node in nodes:
            assert await relay(client, node.endpoint, Identity.generate(), records) == 200
        config = NodeConfig(server=None, peers=(nodes[0].endpoint,))
        async with NetNode(identity=Identity.generate(), config=config) as reader:
            first = (await reader.dht.get(key)).entries
            assert len(first) == 200 and len(reader.dht.checked) == 200
            again = (await reader.dht.get(key)).entries
            # The same decoded values: taken from what was checked, not decoded again.
            assert all(again[s].value is first[s].value for s in first)
            assert len(reader.dht.checked) == 200


async def test_joining_through_addresses_that_do_not_answer_fails_clearly_and_soon():
    finished = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()
        writer.close()
        finished.set()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    silent_endpoint = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    refused_endpoint = f"127.0.0.1:{closed_port()}"
    config = NodeConfig(
        server=None, peers=(refused_endpoint, silent_endpoint), dht=DhtConfig(join_timeout_s=1.5)
    )
    async with server:
        started = time.monotonic()
        with pytest.raises(NetworkError) as info:
            async with NetNode(identity=Identity.generate(), config=config):
                pass
        elapsed = time.monotonic() - started
        await asyncio.wait_for(finished.wait(), timeout=5)
    message = str(info.value)
    assert "cannot join the network" in message
    assert refused_endpoint in message and silent_endpoint in message
    assert elapsed < 5


async def test_one_answering_address_is_enough_and_dead_ones_do_not_hold_the_join():
    async with loopback_network(2) as nodes:
        dead = f"127.0.0.1:{closed_port()}"
        config = NodeConfig(
            server=None, peers=(dead, nodes[1].endpoint), dht=DhtConfig(join_timeout_s=60)
        )
        # Waiting out the dead address would take the whole 60 s join timeout.
        async with asyncio.timeout(15), NetNode(identity=Identity.generate(), config=config) as n:
            assert {c.endpoint for c in n.dht.routing} >= {nodes[1].endpoint}


async def test_remembered_peers_that_all_fail_leave_the_node_alone_not_failed(caplog):
    gone = (f"127.0.0.1:{closed_port()}", f"127.0.0.1:{closed_port()}")
    quick = DhtConfig(join_timeout_s=0.5)
    alone = NodeConfig(remembered=gone, dht=quick)
    async with NetNode(identity=Identity.generate(), config=alone) as node:
        assert len(node.dht.routing) == 0
    assert "none of the 2 peer(s) remembered from the last run answered" in caplog.text
    # An address the operator gave still has to answer.
    given = NodeConfig(peers=gone[:1], remembered=gone[1:], dht=quick)
    with pytest.raises(NetworkError, match="cannot join the network"):
        async with NetNode(identity=Identity.generate(), config=given):
            pass


@pytest.mark.parametrize("ahead", [20.0, 900.0])
async def test_a_clock_far_off_the_swarms_is_refused_at_join_and_a_small_skew_is_warned(
    ahead, caplog
):
    """The entry peer's clock runs ``ahead`` seconds ahead of ours (ours is behind)."""

    def skewed(transport):
        return DHTNode(
            identity=Identity.generate(), transport=transport, clock=lambda: time.time() + ahead
        )

    async with serving(skewed) as entry:
        config = NodeConfig(server=None, peers=(entry.endpoint,))
        if ahead > DhtConfig().max_clock_skew_s:
            with pytest.raises(NetworkError) as info:
                async with NetNode(identity=Identity.generate(), config=config):
                    pass
            message = str(info.value)
            assert "clock is 900 s behind" in message and "NTP" in message
        else:
            async with NetNode(identity=Identity.generate(), config=config) as node:
                assert node.dht.clock_skew_s == pytest.approx(ahead, abs=1.0)
            assert "clock is 20 s behind the clock of the 1 peer(s)" in caplog.text


class LyingClock(DHTNode):
    """A peer that says its clock is ``ahead`` seconds ahead of what it is."""

    def __init__(self, ahead: float, **kwargs) -> None:
        super().__init__(**kwargs)
        self.ahead = ahead

    async def handle_ping(self, request, observed_host):
        response = await super().handle_ping(request, observed_host)
        response.time_ms += int(self.ahead * 1000)
        return response


@pytest.mark.parametrize("lie", [120.0, 1200.0])
async def test_entry_peers_that_lie_about_the_time_are_outvoted_by_other_networks(lie, caplog):
    """Four liars on one network are the entry peers; three honest peers, each on a network
    of its own, are in the table they show: the newcomer keeps the honest time, even when
    the liars put its clock further off than records tolerate (1200 s: alone, that would
    stop it, as a clock that far off does)."""
    async with contextlib.AsyncExitStack() as stack:
        honest = []
        for n in (2, 3, 4):
            peers = (honest[0].endpoint,) if honest else ()
            config = NodeConfig(peers=peers, server=ServerConfig(host=f"127.0.0.{n}"))
            node = NetNode(identity=Identity.generate(), config=config)
            honest.append(await stack.enter_async_context(node))
        liars = []
        for _ in range(4):
            make = partial(LyingClock, lie, identity=Identity.generate())
            liar = await stack.enter_async_context(serving(lambda t, m=make: m(transport=t)))
            await liar.join([honest[0].endpoint])
            liars.append(liar)
        config = NodeConfig(server=None, peers=tuple(liar.endpoint for liar in liars))
        newcomer = await stack.enter_async_context(
            NetNode(identity=Identity.generate(), config=config)
        )
        # The liars said ``lie``; the three other networks, and so the median of one vote
        # per network (the liars' four are one), say the machine's own time.
        assert abs(newcomer.dht.clock_skew_s) < 5.0, newcomer.dht.clock_skew_s
        said = f"the 4 peer(s) this node joined through put the swarm's time +{lie:.0f} s"
        assert said in caplog.text
        assert "the peers of 4 networks in all" in caplog.text
        assert all(abs(node.dht.clock_skew_s) < 5.0 for node in honest)


class RogueNode(DHTNode):
    """A peer that serves a manifest of another run under the key of the asked one."""

    def __init__(self, impostor: SwarmManifest, **kwargs) -> None:
        super().__init__(**kwargs)
        self.impostor = impostor

    async def handle_find_value(self, request, observed_host):
        response = await super().handle_find_value(request, observed_host)
        fake = Record(request.key, "", msgpack.packb(self.impostor.to_bytes()), time.time() + 60)
        response.records.append(record_to_proto(fake))
        return response


async def test_a_manifest_whose_hash_differs_is_refused_with_both_ids():
    wanted, impostor = manifest(name="wanted"), manifest(name="impostor")
    rogue_node = partial(RogueNode, impostor, identity=Identity.generate())
    async with serving(lambda transport: rogue_node(transport=transport)) as rogue:
        config = NodeConfig(server=None, peers=(rogue.endpoint,))
        async with NetNode(identity=Identity.generate(), config=config) as reader:
            with pytest.raises(ManifestError) as info:
                await fetch_manifest(reader.dht, wanted.swarm_id)
            assert reader.dht.rejections.counts["manifest-mismatch"] == 1
        # With the genuine manifest in the network too, the reader gets it.
        async with loopback_network(3) as honest:
            await publish_manifest(honest[0].dht, wanted)
            config = NodeConfig(server=None, peers=(rogue.endpoint, honest[1].endpoint))
            async with NetNode(identity=Identity.generate(), config=config) as reader:
                assert await fetch_manifest(reader.dht, wanted.swarm_id) == wanted
    message = str(info.value)
    assert f"hashes to {impostor.swarm_id}, not to the swarm id {wanted.swarm_id}" in message


class FloodingNode(DHTNode):
    """Answers every lookup with thousands of forged records and a flood of cards."""

    async def handle_find_value(self, request, observed_host):
        response = await super().handle_find_value(request, observed_host)
        forged = [
            Record(
                request.key,
                f"{i:040x}",
                msgpack.packb(PEER),
                time.time() + 60,
                b"k" * 32,
                b"s" * 64,
            )
            for i in range(2000)
        ]
        response.records.extend(record_to_proto(r) for r in forged)
        card = self.card.to_proto()
        response.closest.extend(card for _ in range(5000))
        return response


async def test_an_answer_full_of_forgeries_costs_the_reader_one_check():
    async with serving(
        lambda t: FloodingNode(identity=Identity.generate(), transport=t)
    ) as flooder:
        config = NodeConfig(server=None, peers=(flooder.endpoint,))
        async with NetNode(identity=Identity.generate(), config=config) as reader:
            result = await reader.dht.get(peers_key(SWARM))
    assert result.entries == {}
    assert len(result.rejected) == 1 and result.rejected[0].code == "bad-signature"
    assert reader.dht.rejections.total == 1


class EclipsingNode(DHTNode):
    """One of many ids ground next to a key and served from one address: it names only its
    crew in every answer and claims every store without keeping it."""

    def __init__(self, crew: list[DHTNode], **kwargs) -> None:
        super().__init__(**kwargs)
        self.crew = crew
        self.lies = Counter[str]()

    def _crew_cards(self) -> list[pb.PeerInfo]:
        return [node.card.to_proto() for node in self.crew]

    async def handle_find_node(self, request, observed_host):
        await super().handle_find_node(request, observed_host)  # checks the caller's card
        self.lies["find"] += 1
        return pb.FindNodeResponse(peer=self.card.to_proto(), closest=self._crew_cards())

    async def handle_find_value(self, request, observed_host):
        await super().handle_find_value(request, observed_host)
        self.lies["find"] += 1
        return pb.FindValueResponse(peer=self.card.to_proto(), closest=self._crew_cards())

    async def handle_store(self, request, observed_host):
        self.lies["store"] += len(request.records)
        claims = [pb.StoreResult(stored=True) for _ in request.records]
        return pb.StoreResponse(peer=self.card.to_proto(), results=claims)


async def test_twenty_ids_ground_next_to_a_key_on_one_address_do_not_eclipse_it():
    key = peers_key(SWARM)
    target = key_id(key)
    # 127.N.0.1 are networks of their own (as /24s of public addresses would be).
    dht = DhtConfig(limit_private_subnets=True)
    honest_ids = [Identity.generate() for _ in range(6)]
    nearest = min(distance(i.peer_id, target) for i in honest_ids)
    ground: list[Identity] = []  # every one closer to the key than every honest node
    while len(ground) < 20:
        identity = Identity.generate()
        if distance(identity.peer_id, target) < nearest:
            ground.append(identity)
    crew: list[DHTNode] = []
    async with contextlib.AsyncExitStack() as stack:
        honest: list[NetNode] = []
        for i, identity in enumerate(honest_ids):
            config = NodeConfig(
                server=ServerConfig(host=f"127.{i + 1}.0.1"),
                peers=(honest[0].endpoint,) if honest else (),
                dht=dht,
            )
            honest.append(
                await stack.enter_async_context(NetNode(identity=identity, config=config))
            )
        for identity in ground:
            make = partial(EclipsingNode, crew, identity=identity, config=dht)
            node = serving(lambda t, make=make: make(transport=t), host="127.66.0.1")
            crew.append(await stack.enter_async_context(node))
        # The subnet cap lets two of the crew into each bucket of an honest table; more of
        # them enter other buckets as lookups name them (and are then handed the records
        # they are close to, as any newcomer is).
        for node in crew[:2]:
            await node.join([h.endpoint for h in honest])
        await wait_for(
            lambda: all(any(c.host == "127.66.0.1" for c in h.dht.routing) for h in honest)
        )

        writer, reader = honest[1], honest[2]
        value = dict(PEER, endpoint=writer.endpoint)
        stored = await writer.dht.store(key, value, ttl=60)
        holders = [h for h in honest if h.dht.storage.get(key)]
        result = await reader.dht.get(key)
    lies = sum((node.lies for node in crew), Counter[str]())
    assert lies["find"] > 0  # the crew answered lookups with only its own cards
    # Two of the crew take a place among the closest (the store's own count of claims);
    # every honest node holds the record.
    assert (len(holders), stored) == (len(honest), len(honest) + 2)
    assert lies["store"] >= 2  # the two, and any hand-offs to crew met later
    assert list(result.entries) == [writer.dht.peer_id.hex()]


async def test_an_unknown_swarm_id_says_so():
    async with loopback_network(3) as nodes:
        with pytest.raises(ManifestError, match="unknown to this network"):
            await fetch_manifest(nodes[1].dht, "12" * 20)
        with pytest.raises(ManifestError, match="not a swarm id"):
            await fetch_manifest(nodes[1].dht, "not-an-id")


async def test_a_node_bound_to_every_interface_learns_its_address_from_peers():
    async with loopback_network(1) as (first,):
        config = NodeConfig(server=ServerConfig(host="0.0.0.0"), peers=(first.endpoint,))
        async with NetNode(identity=Identity.generate(), config=config) as node:
            assert node.server is not None
            assert node.endpoint == f"127.0.0.1:{node.server.port}"
            assert node.identity.peer_id in first.dht.routing


async def test_leaving_a_node_leaves_no_task_behind():
    before = asyncio.all_tasks()
    async with loopback_network(3) as nodes:
        await nodes[1].dht.store(peers_key(SWARM), PEER, ttl=60)
        assert all(node.dht._tasks for node in nodes)
    leftover = {t for t in asyncio.all_tasks() - before if not t.done()}
    assert leftover == set()


async def test_a_node_that_lost_every_contact_joins_again_through_its_entry_points():
    """A process frozen for a while (SIGSTOP) wakes to find every call it had in flight
    timed out: each failure drops a contact, and the routing table runs empty. The node
    joins again through the peers it first joined through and finds records again."""
    config = dataclasses.replace(DhtConfig(), rejoin_interval_s=0.2)
    async with loopback_network(3, dht=config) as nodes:
        lonely = nodes[2].dht
        await announce_peer(nodes[0].dht, SWARM, role="trainer")
        for contact in list(lonely.routing):
            lonely._failed(contact, "timed out while this process was frozen")
        assert len(lonely.routing) == 0
        await wait_for(lambda: len(lonely.routing) > 0, timeout=10.0)
        assert lonely.stats["rejoins"] >= 1
        peers = await find_peers(lonely, SWARM)
        assert [p.peer_id for p in peers] == [nodes[0].identity.peer_id_hex]


async def test_a_peer_that_stops_answering_costs_one_call_timeout_not_one_per_lookup():
    """A frozen peer (its link swallows every byte, as a SIGSTOPped process's does) fails
    one call and is dropped; the others still name it, but lookups skip it until it is
    heard from again. A call that fails only because this process stalled blames nobody.
    (The deadline, 2 s, is longer than a loaded machine takes between the calls leaving and
    the stall beginning; the stall, 4 s, is more than the deadline and the 1 s past it
    that tell a stall from a silence.)"""
    config = DhtConfig(rpc_timeout_s=2.0)
    async with TcpProxy() as proxy, loopback_network(2, dht=config) as (boot, node):
        frozen = NetNode(
            identity=Identity.generate(),
            config=NodeConfig(peers=(boot.endpoint,), announce_port=proxy.port, dht=config),
        )
        proxy.target = lambda: ("127.0.0.1", frozen.server.port)  # type: ignore[union-attr]
        async with frozen:
            frozen_id = frozen.identity.peer_id
            await announce_peer(node.dht, SWARM, role="trainer")  # it meets the frozen one
            assert frozen_id in node.dht.routing and frozen_id in boot.dht.routing
            proxy.mode = "blackhole"

            # Our own stall: the call's failure comes long past its deadline.
            calls = node.dht.stats["calls"]
            storing = asyncio.ensure_future(announce_peer(node.dht, SWARM, role="trainer"))
            await wait_for(lambda: node.dht.stats["calls"] >= calls + 2)  # both in flight
            time.sleep(4.0)  # the whole process stalls (blocks its event loop)
            await storing
            assert frozen_id not in node.dht.routing  # dropped, as any failed contact
            assert not node.dht.unreachable(frozen_id)  # but not blamed

            # Its own silence: one timeout, then the others' word for it is not taken.
            failed = node.dht.stats["failed_calls"]
            for _ in range(5):
                await announce_peer(node.dht, SWARM, role="trainer")
                assert frozen_id in boot.dht.routing  # the bootstrap still names it
            assert node.dht.stats["failed_calls"] == failed + 1
            assert node.dht.unreachable(frozen_id)

            # Thawed, it calls us: it counts again at once. (A thawed process's connections
            # are intact; the proxy's lost what it swallowed, so it closes them.)
            proxy.cut()

            async def thawed_calls() -> None:
                # Its first call that reaches us clears it (on a loaded machine a call may
                # pass its 2 s deadline before it does: the next one comes).
                while node.dht.unreachable(frozen_id):
                    await announce_peer(frozen.dht, SWARM, role="trainer")

            await asyncio.wait_for(thawed_calls(), timeout=60)
            assert frozen_id in node.dht.routing
