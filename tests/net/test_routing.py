"""The routing table: bucket size, the per-/24 cap, replacements, XOR order; the same cap
on the closest nodes a lookup keeps."""

import random

from swarmloco.net.dht.contact import sign_card
from swarmloco.net.dht.routing import Added, RoutingTable, diverse
from swarmloco.net.identity import Identity


def card(endpoint: str, identity: Identity | None = None, started: int = 1):
    return sign_card(identity or Identity.generate(), endpoint, started_at_ms=started)


def contacts_in_bucket(table: RoutingTable, index: int, count: int, host) -> list:
    """``count`` cards whose ids land in bucket ``index`` of ``table``."""
    found = []
    while len(found) < count:
        identity = Identity.generate()
        if table.bucket_index(identity.peer_id) == index:
            found.append(card(f"{host(len(found))}:4000", identity))
    return found


def test_a_bucket_holds_k_and_keeps_newcomers_as_replacements():
    table = RoutingTable(Identity.generate().peer_id, k=4)
    members = contacts_in_bucket(table, 159, 6, lambda i: f"8.8.{i}.1")
    assert [table.add(c, now=0) for c in members] == [Added.NEW] * 4 + [Added.REPLACEMENT] * 2
    assert len(table) == 4
    removed, promoted = table.remove(members[0].peer_id, now=1)
    assert removed == members[0] and promoted == members[5]  # the freshest replacement
    assert members[5].peer_id in table


def test_at_most_two_contacts_per_ipv4_slash_24_per_bucket():
    table = RoutingTable(Identity.generate().peer_id)
    same_subnet = contacts_in_bucket(table, 159, 3, lambda i: f"81.2.69.{i + 1}")
    assert [table.add(c, now=0) for c in same_subnet] == [Added.NEW, Added.NEW, Added.SUBNET_FULL]
    other = contacts_in_bucket(table, 159, 1, lambda i: "82.1.1.7")[0]
    assert table.add(other, now=0) is Added.NEW
    assert len(table) == 3


def test_loopback_and_private_hosts_are_exempt_unless_asked():
    local = Identity.generate().peer_id
    lenient = RoutingTable(local)
    strict = RoutingTable(local, limit_private_subnets=True)
    many = contacts_in_bucket(lenient, 159, 5, lambda i: "127.0.0.1")
    assert all(lenient.add(c, now=0) is Added.NEW for c in many)
    assert [strict.add(c, now=0) for c in many].count(Added.NEW) == 2


def test_newer_card_updates_older_card_is_ignored():
    table = RoutingTable(Identity.generate().peer_id)
    identity = Identity.generate()
    assert table.add(card("8.8.8.8:1", identity, started=10), now=0) is Added.NEW
    assert table.add(card("8.8.8.8:2", identity, started=20), now=0) is Added.UPDATED
    assert table.get(identity.peer_id).endpoint == "8.8.8.8:2"
    assert table.add(card("8.8.8.8:3", identity, started=5), now=0) is Added.IGNORED
    assert table.get(identity.peer_id).endpoint == "8.8.8.8:2"
    assert table.add(card("", Identity.generate()), now=0) is Added.IGNORED  # client mode


def test_closest_is_ordered_by_xor_distance():
    table = RoutingTable(Identity.generate().peer_id)
    for i in range(200):
        table.add(card(f"10.{i}.0.1:1"), now=0)
    target = random.Random(1).randbytes(20)
    everyone = sorted(
        table, key=lambda c: int.from_bytes(c.peer_id, "big") ^ int.from_bytes(target, "big")
    )
    assert table.closest(target, 20) == everyone[:20]


def test_random_id_in_bucket_lands_in_that_bucket():
    table = RoutingTable(Identity.generate().peer_id)
    rng = random.Random(3)
    for index in (0, 1, 7, 100, 159):
        assert table.bucket_index(table.random_id_in_bucket(index, rng)) == index


def test_diverse_keeps_the_order_and_caps_each_network_and_exempts_none():
    contacts = [
        card(f"{host}:4000") for host in ("1.1.1.1", "1.1.1.2", "1.1.1.3", "2.2.2.2", "10.0.0.1")
    ]
    table = RoutingTable(Identity.generate().peer_id)
    chosen = diverse(contacts, 4, network=table.subnet, per_network=2)
    assert chosen == [contacts[0], contacts[1], contacts[3], contacts[4]]
    assert diverse(contacts, 2, network=table.subnet, per_network=1) == [contacts[0], contacts[3]]
    private = [card("10.0.0.1:4000"), card("10.0.0.2:4000"), card("10.0.0.3:4000")]
    assert diverse(private, 3, network=table.subnet, per_network=1) == private  # exempt
    strict = RoutingTable(Identity.generate().peer_id, limit_private_subnets=True)
    assert diverse(private, 3, network=strict.subnet, per_network=1) == private[:1]
