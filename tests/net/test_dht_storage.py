"""Storage: clamped expirations, replacement order, quotas (no network)."""

import pytest
from netutil import SWARM, counter_key

from swarmloco.net.dht.storage import Storage, StorageConfig
from swarmloco.net.identity import Identity
from swarmloco.net.records import PEERS, make_record, peers_key
from swarmloco.net.rejections import Rejection

PEER = {"endpoint": "127.0.0.1:5000", "role": "trainer", "version": "0.1.0", "public": True}
YEAR = 365 * 24 * 3600.0


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
    assert storage.put(record, sender=owner.peer_id)
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
    assert storage.put(old, sender=b"a")
    assert storage.put(old, sender=b"a")  # the same record again (a republish) is fine
    assert storage.put(new, sender=b"b")
    assert not storage.put(old, sender=b"a")
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
        assert storage.put(record, sender=b"flooder")
    for record in records[10:]:
        with pytest.raises(Rejection) as info:
            storage.put(record, sender=b"flooder")
        assert info.value.code == "quota"
    # The same records from another sender are fine: the quota is per sender.
    assert storage.put(records[10], sender=b"someone else")


def test_per_key_subkey_cap_and_node_capacity():
    clock = Clock()
    storage = Storage(StorageConfig(max_records=5, max_records_per_sender=100), clock=clock)
    for i in range(5):
        owner = Identity.generate()
        record = make_record(peers_key(SWARM), PEER, expiration=clock.now + 60 + i, owner=owner)
        assert storage.put(record, sender=owner.peer_id)
    owner = Identity.generate()
    record = make_record(peers_key(SWARM), PEER, expiration=clock.now + 60, owner=owner)
    with pytest.raises(Rejection, match="full"):
        storage.put(record, sender=owner.peer_id)
    clock.now += 120  # everything expired: sweeping frees the room
    assert storage.put(
        make_record(peers_key(SWARM), PEER, expiration=clock.now + 60, owner=owner),
        sender=owner.peer_id,
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
        )
    assert len(storage) == 0 and storage.bytes_used == 0
