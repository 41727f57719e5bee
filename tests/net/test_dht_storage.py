"""Storage: clamped expirations, replacement order, quotas per sender, owner and source
network, and which records make room for which (no network)."""

import contextlib
import dataclasses
import gc
import tracemalloc

import msgpack
import pytest
from netutil import SWARM, counter_key

from swarmloco.net.dht.storage import Storage, StorageConfig
from swarmloco.net.dht.wire import record_from_proto, record_to_proto
from swarmloco.net.endpoints import source_network
from swarmloco.net.identity import Identity
from swarmloco.net.records import (
    PEERS,
    Int,
    Record,
    RecordKind,
    Struct,
    digest_key,
    held_bytes,
    make_record,
    peers_key,
    progress_key,
    register,
    status_key,
)
from swarmloco.net.rejections import Rejection
from swarmloco.proto.v1 import dht_pb2 as pb

PEER = {"endpoint": "127.0.0.1:5000", "role": "trainer", "version": "0.1.0", "public": True}
YEAR = 365 * 24 * 3600.0
NET = "203.0.113.0/24"


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def test_expiration_ten_years_ahead_is_clamped_to_the_max_ttl():
    clock = Clock()
    storage = Storage(StorageConfig(), clock=clock)
    owner = Identity.generate()
    record = make_record(peers_key(SWARM), PEER, expiration=clock.now + 10 * YEAR, owner=owner)
    assert storage.put(record, sender=owner.peer_id, network=NET)
    assert storage.expires_at(record.key, record.subkey) == clock.now + PEERS.max_ttl
    clock.now += PEERS.max_ttl - 1
    assert storage.get(record.key) == [record]  # served as signed, expiration untouched
    clock.now += 2
    assert storage.get(record.key) == []
    assert len(storage) == 0 and storage.records_from(owner.peer_id) == 0


def test_later_expiration_replaces_earlier_and_not_the_other_way():
    clock = Clock()
    storage = Storage(StorageConfig(), clock=clock)
    owner = Identity.generate()
    old = make_record(peers_key(SWARM), PEER, expiration=clock.now + 60, owner=owner)
    new = make_record(
        peers_key(SWARM),
        {**PEER, "endpoint": "127.0.0.1:6000"},
        expiration=clock.now + 120,
        owner=owner,
    )
    assert storage.put(old, sender=b"a", network=NET)
    assert storage.put(old, sender=b"a", network=NET)  # the same record again (a republish) is fine
    assert storage.put(new, sender=b"b", network=NET)
    assert not storage.put(old, sender=b"a", network=NET)
    assert storage.get(old.key) == [new]
    assert storage.records_from(b"a") == 0 and storage.records_from(b"b") == 1


def test_per_sender_quota_is_checked_before_any_signature():
    clock = Clock()
    storage = Storage(StorageConfig(max_records_per_sender=10), clock=clock)
    records = [
        make_record(
            counter_key(),
            {"count": i, "label": ""},
            expiration=clock.now + 60,
            owner=Identity.generate(),
        )
        for i in range(12)
    ]
    for record in records[:10]:
        assert storage.put(record, sender=b"flooder", network=NET)
    for record in records[10:]:
        with pytest.raises(Rejection) as info:
            storage.put(record, sender=b"flooder", network=NET)
        assert info.value.code == "quota"
    # The same records from another sender are fine: the quota is per sender.
    assert storage.put(records[10], sender=b"someone else", network=NET)


def test_per_key_subkey_cap_and_node_capacity():
    clock = Clock()
    storage = Storage(StorageConfig(max_records=5, max_records_per_sender=100), clock=clock)
    for i in range(5):
        owner = Identity.generate()
        record = make_record(peers_key(SWARM), PEER, expiration=clock.now + 60 + i, owner=owner)
        assert storage.put(record, sender=owner.peer_id, network=NET)
    owner = Identity.generate()
    record = make_record(peers_key(SWARM), PEER, expiration=clock.now + 60, owner=owner)
    with pytest.raises(Rejection, match="full"):
        storage.put(record, sender=owner.peer_id, network=NET)
    clock.now += 120  # everything expired: sweeping frees the room
    assert storage.put(
        make_record(peers_key(SWARM), PEER, expiration=clock.now + 60, owner=owner),
        sender=owner.peer_id,
        network=NET,
    )
    assert len(storage) == 1


def test_invalid_records_are_not_stored():
    clock = Clock()
    storage = Storage(StorageConfig(), clock=clock)
    owner = Identity.generate()
    record = make_record(peers_key(SWARM), PEER, expiration=clock.now + 60, owner=owner)
    forged = make_record(
        peers_key(SWARM), {**PEER, "role": "client"}, expiration=clock.now + 60, owner=owner
    )
    with pytest.raises(Rejection):
        storage.put(
            type(record)(
                record.key,
                record.subkey,
                forged.value,
                record.expiration,
                record.owner_public_key,
                record.signature,
            ),
            sender=b"x",
            network=NET,
        )
    assert len(storage) == 0 and storage.bytes_used == 0


# A kind with few subkeys, so that a key fills in a few records (the layer's own kinds keep
# 4,096); registered through the public extension point, as later layers register theirs.
SMALL = register(
    RecordKind(
        name="test-small",
        pattern="test-small",
        schema=Struct({"n": Int(minimum=0)}),
        owned=True,
        max_ttl=3600.0,
        max_value_bytes=64,
        max_subkeys=8,
    )
)
SMALL_KEY = f"swarmloco/v1/{SWARM}/test-small"
A, B, C = "198.51.100.0/24", "203.0.113.0/24", "2001:db8::/64"


def small(owner: Identity, clock: Clock, *, key: str = SMALL_KEY, n: int = 0) -> Record:
    return make_record(key, {"n": n}, expiration=clock.now + 60, owner=owner)


def first_hand(storage: Storage, record: Record, network: str) -> bool:
    """Stored by its owner itself."""
    return storage.put(record, sender=bytes.fromhex(record.subkey), network=network)


def refused(storage: Storage, record: Record, *, sender: bytes, network: str) -> Rejection:
    with pytest.raises(Rejection) as info:
        storage.put(record, sender=sender, network=network)
    return info.value


def test_one_network_holds_at_most_its_share_of_a_key_and_owners_take_their_place_back():
    clock = Clock()
    storage = Storage(StorageConfig(max_subkeys_per_network=3), clock=clock)
    relayed = [small(Identity.generate(), clock) for _ in range(4)]
    for record in relayed[:3]:
        assert storage.put(record, sender=b"relay", network=A)  # one sender, many owners
    # Beyond the network's share, even a forged record is refused by count, unverified.
    forged = dataclasses.replace(relayed[3], signature=b"s" * 64)
    rejection = refused(storage, forged, sender=b"relay", network=A)
    assert rejection.code == "network-quota" and A in rejection.reason
    assert storage.records_via(A, key=SMALL_KEY) == 3
    # Another network has a share of its own.
    assert storage.put(relayed[3], sender=b"relay", network=B)
    # An owner in network A storing its own record takes the place of A's oldest relayed one.
    owner = Identity.generate()
    assert first_hand(storage, small(owner, clock), A)
    assert storage.evicted == 1
    held = {r.subkey for r in storage.get(SMALL_KEY)}
    assert relayed[0].subkey not in held and owner.peer_id_hex in held
    assert storage.records_via(A, key=SMALL_KEY) == 3 and storage.records_from(b"relay") == 3
    # Once A's share is all first-hand, a fourth owner from A is refused.
    for _ in range(2):
        assert first_hand(storage, small(Identity.generate(), clock), A)
    rejection = refused(storage, small(Identity.generate(), clock), sender=b"x", network=A)
    assert rejection.code == "network-quota"
    late = Identity.generate()
    rejection = refused(storage, small(late, clock), sender=late.peer_id, network=A)
    assert rejection.code == "network-quota"
    assert storage.evicted == 3 and storage.records_from(b"relay") == 1  # only B's left


def test_a_full_key_makes_room_for_an_owners_record_from_a_network_with_fewer_entries():
    clock = Clock()
    storage = Storage(StorageConfig(max_subkeys_per_network=4), clock=clock)
    relayed = {net: [small(Identity.generate(), clock) for _ in range(4)] for net in (A, B)}
    for net, records in relayed.items():
        for record in records:
            assert storage.put(record, sender=b"relay", network=net)
    assert len(storage.get(SMALL_KEY)) == SMALL.max_subkeys
    # The key is full: a relayed record from a third network is refused ...
    stranger = small(Identity.generate(), clock)
    assert refused(storage, stranger, sender=b"relay", network=C).code == "quota"
    # ... a forged first-hand one evicts nothing (the signature is checked first) ...
    mallory = Identity.generate()
    forged = dataclasses.replace(small(mallory, clock), value=msgpack.packb({"n": 7}))
    assert refused(storage, forged, sender=mallory.peer_id, network=C).code == "bad-signature"
    assert storage.evicted == 0 and len(storage) == SMALL.max_subkeys
    # ... and a genuine owner's takes the place of the oldest record of the largest network.
    newcomer = Identity.generate()
    assert first_hand(storage, small(newcomer, clock), C)
    held = {r.subkey for r in storage.get(SMALL_KEY)}
    assert newcomer.peer_id_hex in held and relayed[A][0].subkey not in held
    assert storage.evicted == 1 and len(storage) == SMALL.max_subkeys
    assert [storage.records_via(n, key=SMALL_KEY) for n in (A, B, C)] == [3, 4, 1]


def test_owners_from_a_small_network_displace_first_hand_records_down_to_an_even_share():
    clock = Clock()
    storage = Storage(StorageConfig(max_subkeys_per_network=4), clock=clock)
    for net in (A, B):
        for _ in range(4):
            assert first_hand(storage, small(Identity.generate(), clock), net)
    for _ in range(3):
        assert first_hand(storage, small(Identity.generate(), clock), C)
    assert [storage.records_via(n, key=SMALL_KEY) for n in (A, B, C)] == [2, 3, 3]
    # C now holds as many as the largest: its next owner waits like everyone else's.
    owner = Identity.generate()
    rejection = refused(storage, small(owner, clock), sender=owner.peer_id, network=C)
    assert rejection.code == "quota" and "8 subkeys" in rejection.reason
    assert storage.evicted == 3


def test_an_owners_update_moves_its_record_to_the_network_it_came_from():
    clock = Clock()
    storage = Storage(StorageConfig(max_subkeys_per_network=2), clock=clock)
    owner = Identity.generate()
    assert storage.put(small(owner, clock), sender=b"relay", network=A)
    clock.now += 1
    assert first_hand(storage, small(owner, clock, n=1), B)
    assert storage.records_via(A) == 0 and storage.records_via(B, key=SMALL_KEY) == 1
    assert storage.records_owned_by(owner.peer_id_hex) == 1 and storage.records_from(b"relay") == 0


def test_quotas_per_owner_and_per_network_count_every_key():
    clock = Clock()
    config = StorageConfig(max_records_per_owner=3, max_records_per_network=5)
    storage = Storage(config, clock=clock)
    keys = [f"swarmloco/v1/{i:040x}/test-small" for i in range(8)]
    # One owner's records under many keys, each sent by another key from another network.
    owner = Identity.generate()
    for i, key in enumerate(keys[:3]):
        assert storage.put(small(owner, clock, key=key), sender=bytes([i]), network=f"10.{i}/x")
    rejection = refused(storage, small(owner, clock, key=keys[3]), sender=b"z", network=C)
    assert rejection.code == "owner-quota"
    # Fresh owners and fresh senders, one network: the network's total binds.
    for key in keys[:5]:
        fresh = Identity.generate()
        assert first_hand(storage, small(fresh, clock, key=key), A)
    fresh = Identity.generate()
    rejection = refused(storage, small(fresh, clock, key=keys[5]), sender=fresh.peer_id, network=A)
    assert rejection.code == "network-quota" and "5 records from one network" in rejection.reason
    assert first_hand(storage, small(fresh, clock, key=keys[5]), B)
    assert storage.records_via(A) == 5 and storage.records_owned_by(owner.peer_id_hex) == 3


def test_a_key_is_read_one_network_at_a_time_so_a_capped_receiver_gets_a_share_of_each():
    clock = Clock()
    holder = Storage(StorageConfig(), clock=clock)
    origin: dict[str, str] = {}
    for net, count in ((A, 5), (B, 2), (C, 1)):
        for _ in range(count):
            record = small(Identity.generate(), clock)
            assert holder.put(record, sender=b"relay", network=net)
            origin[record.subkey] = net
    listed = holder.get(SMALL_KEY)
    assert [origin[r.subkey] for r in listed[:3]] == [A, B, C]
    assert len(listed) == 8
    # A newcomer handed all of them by the holder (one sender, one network) keeps its cap
    # and holds every source network's records among them, not five of A's.
    newcomer = Storage(StorageConfig(max_subkeys_per_network=3), clock=clock)
    for record in listed:
        with contextlib.suppress(Rejection):
            newcomer.put(record, sender=b"holder", network="192.0.2.0/24")
    assert {origin[r.subkey] for r in newcomer.get(SMALL_KEY)} == {A, B, C}


def test_expiry_and_eviction_leave_every_count_at_zero():
    clock = Clock()
    storage = Storage(StorageConfig(max_subkeys_per_network=2), clock=clock)
    owners = [Identity.generate() for _ in range(6)]
    for owner in owners[:4]:
        with contextlib.suppress(Rejection):
            storage.put(small(owner, clock), sender=b"relay", network=A)
    for owner in owners[4:]:
        assert first_hand(storage, small(owner, clock), A)
    assert storage.evicted == 2 and len(storage) == 2
    clock.now += 3600
    assert storage.sweep() == 2
    assert len(storage) == 0 and storage.bytes_used == 0 and storage.keys() == []
    assert storage.records_via(A) == 0 and storage.records_from(b"relay") == 0
    assert all(storage.records_owned_by(o.peer_id_hex) == 0 for o in owners)


@pytest.mark.parametrize(
    ("host", "limit_private", "network"),
    [
        ("81.2.69.7", False, "81.2.69.0/24"),
        ("2a01:4f8:1:2:3:4:5:6", False, "2a01:4f8:1:2::/64"),
        ("::ffff:81.2.69.7", False, "81.2.69.0/24"),  # IPv4 through a dual-stack socket
        ("127.0.0.2", False, "127.0.0.2"),  # on one machine, each address counts alone
        ("::ffff:127.0.0.2", False, "127.0.0.2"),
        ("192.168.1.9", False, "192.168.1.9"),
        ("fe80::1%eth0", False, "fe80::1"),
        ("127.0.0.2", True, "127.0.0.0/24"),
        ("seed.example.org", False, "name:example.org"),
        # Names cost their domain's owner nothing: every one under a domain is one network.
        ("a1.Evil.example.", False, "name:evil.example"),
        ("10.0.0.1.nip.io", False, "name:nip.io"),
        ("peer1", False, "name:peer1"),  # one label: the operator's own resolver's
    ],
)
def test_the_network_a_caller_counts_toward(host, limit_private, network):
    assert source_network(host, limit_private=limit_private) == network


def wire_copy(record: Record) -> Record:
    """``record`` as a node gets it: every field a fresh object parsed from a message."""
    message = pb.Record()
    message.ParseFromString(record_to_proto(record).SerializeToString())
    return record_from_proto(message)


def full_status(i: int, now: float) -> dict:
    summary = {
        "round": 10_000 + i,
        "group": 5,
        "seconds": 1.5,
        "matchmaking_s": 0.25,
        "bytes_sent": 1 << 30,
        "bytes_received": 1 << 30,
        "payload_bytes": 1 << 30,
        "ok": True,
        "at": now,
    }
    return {
        "name": f"peer-{i:04d}",
        "state": "training",
        "round": 10_000 + i,
        "step": 1 << 20,
        "tokens": 1 << 40,
        "tokens_per_s": 12_345.5,
        "loss": 2.5,
        "eval_loss": 2.25,
        "device": "NVIDIA H200",
        "fit": "micro-batch 8 x 2",
        "mfu": 0.45,
        "version": "0.1.0",
        "started_at": now,
        "rounds_applied": 10_000,
        "rounds_aborted": 12,
        "downloads": 3,
        "last_error": "",
        "rounds": [summary] * 8,
        "at": now,
    }


def test_the_bytes_storage_counts_bound_the_memory_its_records_take():
    # What a flood of small records costs is their Python objects, about five times their
    # encoded size: storage counts those, so max_bytes bounds the memory they take.
    clock = Clock()
    owners = [Identity.generate() for _ in range(64)]
    values = {
        peers_key(SWARM): lambda i: {**PEER, "endpoint": f"127.0.0.1:{5000 + i}"},
        progress_key(SWARM): lambda i: {
            "round": i, "tokens": 1 << 30, "tokens_per_s": 512.5, "at": clock.now
        },
        digest_key(SWARM, 7): lambda i: {
            "digest": bytes([i % 256]) * 32, "endpoint": "127.0.0.1:4000", "at": clock.now
        },
        status_key(SWARM): lambda i: full_status(i, clock.now),
    }  # fmt: skip
    records = [
        wire_copy(make_record(key, value(i), expiration=clock.now + 60, owner=owners[i]))
        for key, value in values.items()
        for i in range(64)
    ]
    storage = Storage(StorageConfig(max_records_per_sender=1 << 20), clock=clock)
    # Every record first, into a storage of its own: what a put allocates once for the
    # process is not a record's cost, and a test run before this one in the process may have
    # paid it or not: a module's lazy state, and the process's cache of parsed public keys
    # (4 MiB at most, for every peer's keys), whose table grows as keys come in (at 1,366
    # keys, 74 KB at once, counted here once when the tests before had verified 1,320).
    warm = Storage(StorageConfig(max_records_per_sender=1 << 20), clock=clock)
    for record in records:
        assert warm.put(wire_copy(record), sender=b"relay", network=NET)
    gc.collect()
    # Frames enough to reach this test's own from any allocation under put(): what other
    # threads of the process allocate meanwhile (a test before may have left one winding
    # down) is not counted.
    tracemalloc.start(64)
    try:
        for record in records:
            # Every field again a fresh object, as each arrives in a message of its own.
            assert storage.put(wire_copy(record), sender=b"relay", network=NET)
        gc.collect()
        ours = tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(True, __file__, all_frames=True)]
        )
        taken = sum(stat.size for stat in ours.statistics("filename"))
    finally:
        tracemalloc.stop()
    counted = storage.bytes_used
    encoded = sum(record.size for record in records)
    assert 0.8 * counted <= taken <= counted, (taken, counted)
    assert counted > 3 * encoded  # what counting encoded bytes would have missed
    # And a node at its budget refuses the next record, from any network.
    full = Storage(StorageConfig(max_bytes=counted, max_bytes_per_network=counted), clock=clock)
    for record in records:
        full.put(record, sender=b"relay", network=NET)
    late = make_record(peers_key(SWARM), PEER, expiration=clock.now + 60, owner=Identity.generate())
    with pytest.raises(Rejection, match="full"):
        full.put(late, sender=late.subkey.encode(), network="198.51.100.0/24")


def test_one_network_fills_at_most_its_share_of_a_nodes_bytes():
    clock = Clock()
    owners = [Identity.generate() for _ in range(5)]
    flood = [
        make_record(peers_key(SWARM), PEER, expiration=clock.now + 60, owner=o) for o in owners
    ]
    one = held_bytes(flood[0], PEER)  # every record here takes as much
    storage = Storage(StorageConfig(max_bytes=8 * one, max_bytes_per_network=3 * one), clock=clock)
    for record in flood[:3]:
        assert storage.put(record, sender=b"flooder", network=NET)
    with pytest.raises(Rejection) as info:
        storage.put(flood[3], sender=b"flooder", network=NET)
    assert info.value.code == "network-quota" and "bytes" in info.value.reason
    # Another network still finds room, and an update from the same network replaces its
    # earlier record within the share.
    assert storage.put(flood[3], sender=b"someone", network="198.51.100.0/24")
    newer = make_record(peers_key(SWARM), PEER, expiration=clock.now + 120, owner=owners[0])
    assert storage.put(newer, sender=b"flooder", network=NET)
    assert storage.bytes_used == 4 * one
