"""The parts a DHT node is made of, each alone with real parts around it: the contact book,
a lookup's state, the hand-off to newcomers, the request handlers, the entry peers and the
clock check, the private swarms' gates (in process; the in-memory network where one node
must answer another)."""

import asyncio
import logging
import random
import time
import types
from collections import Counter

import pytest
from netutil import SWARM, counter_key

from swarmloco.errors import NetworkError
from swarmloco.net.dht.book import ContactBook, ContactHooks
from swarmloco.net.dht.config import DhtConfig
from swarmloco.net.dht.contact import contact_from_proto, distance, sign_card
from swarmloco.net.dht.gates import SwarmGates
from swarmloco.net.dht.joining import EntryPeers, check_clock, network_votes
from swarmloco.net.dht.lookup import Entry, Lookup
from swarmloco.net.dht.memory import MemoryNetwork, MemoryTransport
from swarmloco.net.dht.node import DHTNode
from swarmloco.net.dht.replication import KEYS_PER_SLICE, Replicator, records_for
from swarmloco.net.dht.requests import Requests
from swarmloco.net.dht.routing import RoutingTable
from swarmloco.net.dht.storage import Storage, StorageConfig
from swarmloco.net.dht.wire import key_id, signed_store_request
from swarmloco.net.identity import Identity
from swarmloco.net.records import MEMBER_FIELD, make_record, peers_key
from swarmloco.net.rejections import Rejection, RejectionLog
from swarmloco.net.work import IdentityWork, solve
from swarmloco.proto.v1 import dht_pb2 as pb

PEER = {"endpoint": "127.0.0.1:5000", "role": "trainer", "version": "0.1.0", "public": True}
logger = logging.getLogger(__name__)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def card(host: str = "8.8.8.8", identity: Identity | None = None):
    return sign_card(identity or Identity.generate(), f"{host}:4000", started_at_ms=1)


def book_of(own: Identity, *, config: DhtConfig | None = None, clock=time.monotonic, **hooks):
    routing = RoutingTable(own.peer_id, k=(config or DhtConfig()).k)
    return ContactBook(
        routing=routing,
        config=config or DhtConfig(),
        rejections=RejectionLog(logger),
        stats=Counter(),
        hooks=ContactHooks(**hooks),
        monotonic=clock,
    )


# -- the contact book ------------------------------------------------------------------


def test_a_contact_whose_call_failed_is_skipped_for_unreachable_s_then_counts_again():
    clock = Clock()
    book = book_of(Identity.generate(), config=DhtConfig(unreachable_s=30.0), clock=clock)
    contact = card()
    book.seen(contact)
    book.failed(contact, "timed out")
    assert contact.peer_id not in book.routing and book.unreachable(contact.peer_id)
    clock.now += 29.0
    assert book.unreachable(contact.peer_id)
    clock.now += 2.0
    assert not book.unreachable(contact.peer_id)


def test_a_contact_that_answers_again_counts_at_once_and_one_our_stall_failed_is_not_blamed():
    book = book_of(Identity.generate())
    blamed, stalled = card("8.8.8.8"), card("9.9.9.9")
    book.failed(blamed, "timed out")
    book.failed(stalled, "timed out while this process was frozen", blame=False)
    assert book.unreachable(blamed.peer_id) and not book.unreachable(stalled.peer_id)
    book.seen(blamed)
    assert not book.unreachable(blamed.peer_id) and blamed.peer_id in book.routing


def test_the_book_tells_of_newcomers_once_and_of_dropped_contacts():
    added, removed, newcomers = [], [], []
    book = book_of(
        Identity.generate(), added=added.append, removed=removed.append, newcomer=newcomers.append
    )
    contact = card()
    book.seen(contact)
    book.seen(contact)  # heard from again: not new
    book.failed(contact, "refused")
    assert added == [contact] and newcomers == [contact] and removed == [contact]


def test_a_forged_card_is_refused_and_counted_once():
    book = book_of(Identity.generate())
    forged = card().to_proto()
    forged.endpoint = "6.6.6.6:4000"  # no longer what the key signed
    assert book.card_from(forged, source=None) is None
    assert sum(book._rejections.counts.values()) == 1


# -- one lookup's state -----------------------------------------------------------------


def test_a_lookup_asks_the_closest_unasked_contact_and_skips_unreachable_ones():
    own = Identity.generate()
    book = book_of(own)
    target = Identity.generate().peer_id
    cards = (card(f"8.8.{i}.8") for i in range(5))
    contacts = sorted(cards, key=lambda c: distance(c.peer_id, target))
    book.failed(contacts[0], "timed out")  # the closest failed a moment ago
    lookup = Lookup(target=target, k=3, book=book)
    for contact in contacts:
        lookup.offer(contact, depth=1)
    lookup.offer(sign_card(own, "8.8.4.4:4000"), depth=1)  # never ourselves
    assert [c.peer_id for c in lookup.ranked()] == [c.peer_id for c in contacts[1:4]]
    first = lookup.next_to_query(lookup.ranked())
    assert first == contacts[1]
    lookup.queried.add(first.peer_id)
    assert lookup.next_to_query(lookup.ranked()) == contacts[2]
    assert lookup.next_to_query(lookup.ranked()[:1]) is None


def test_ids_ground_next_to_the_target_from_one_network_take_two_of_the_k_places():
    own = Identity.generate()
    book = book_of(own)
    target = Identity.generate().peer_id
    honest = [card(f"8.8.{i}.8") for i in range(6)]
    nearest = min(distance(c.peer_id, target) for c in honest)
    ground = []  # closer to the target than every honest node, all on one /24
    while len(ground) < 5:
        identity = Identity.generate()
        if distance(identity.peer_id, target) < nearest:
            ground.append(card(f"6.6.6.{len(ground) + 1}", identity))
    lookup = Lookup(target=target, k=4, book=book)
    for contact in ground + honest:
        lookup.offer(contact, depth=1)
    by_distance = sorted(ground + honest, key=lambda c: distance(c.peer_id, target))
    closest_honest = [c for c in by_distance if c in honest]
    closest_ground = [c for c in by_distance if c in ground]
    assert lookup.ranked() == sorted(
        closest_ground[:2] + closest_honest[:2], key=lambda c: distance(c.peer_id, target)
    )
    # A get settles on the closest node of each of two networks, not on two of one.
    assert lookup.quorum(2) == [closest_ground[0], closest_honest[0]]
    for contact in ground + honest:
        assert lookup.absorb_nodes(contact, pb.FindNodeResponse(peer=contact.to_proto()))
    assert lookup.closest_responded() == lookup.ranked()
    # When those two fail, the next two of their network take their places, no more.
    lookup.failed.update(c.peer_id for c in closest_ground[:2])
    assert [c for c in lookup.ranked() if c in ground] == closest_ground[2:4]


def test_a_get_is_settled_once_it_holds_records_and_the_closest_answered():
    book = book_of(Identity.generate())
    target = key_id(peers_key(SWARM))
    near, far = sorted(
        (card("8.8.8.8"), card("9.9.9.9")), key=lambda c: distance(c.peer_id, target)
    )
    lookup = Lookup(target=target, k=20, book=book)
    lookup.offer(near, depth=1)
    lookup.offer(far, depth=1)
    answer = pb.FindValueResponse(peer=far.to_proto())
    assert lookup.absorb_nodes(far, answer) and not lookup.settled(quorum=1)
    owner = Identity.generate()
    record = make_record(peers_key(SWARM), PEER, expiration=time.time() + 60, owner=owner)
    lookup.merge(Entry(record.subkey, PEER, record.expiration, record))
    assert not lookup.settled(quorum=1)  # the closest has not answered yet
    assert lookup.absorb_nodes(near, pb.FindValueResponse(peer=near.to_proto()))
    assert lookup.settled(quorum=1) and lookup.settled(quorum=2)


# -- the hand-off to newcomers ----------------------------------------------------------


def test_a_newcomer_is_handed_the_records_of_the_keys_it_is_closer_to_than_the_kth_node():
    clock = Clock()
    clock.now = time.time()
    storage = Storage(StorageConfig(), clock=clock)
    owner = Identity.generate()
    keys = [counter_key(f"{i:02x}" * 20) for i in range(24)]
    for key in keys:
        record = make_record(key, {"count": 1, "label": ""}, expiration=clock.now + 60, owner=owner)
        assert storage.put(record, sender=owner.peer_id, network="203.0.113.0/24")
    routing = RoutingTable(Identity.generate().peer_id, k=1)
    known, newcomer = card("8.8.8.8"), card("9.9.9.9")
    routing.add(known, now=0)
    handed = records_for(newcomer, storage=storage, routing=routing, k=1)
    closer = [
        k
        for k in keys
        if distance(newcomer.peer_id, key_id(k)) < distance(known.peer_id, key_id(k))
    ]
    assert sorted(r.key for r in handed) == sorted(closer)
    # Knowing fewer than k others, every key is the newcomer's.
    assert len(records_for(newcomer, storage=storage, routing=routing, k=2)) == len(keys)


@pytest.mark.parametrize("k", [1, 3, 20])
def test_the_keys_handed_to_a_newcomer_are_those_the_kth_closest_other_node_is_farther_from(k):
    """The hand-off counts the others closer to each key (no sort): the same keys as the
    definition, the k closest others by the routing table and the k-th's distance, on
    tables of many sizes (the newcomer among them or not)."""
    clock = Clock()
    clock.now = time.time()
    storage = Storage(StorageConfig(max_records_per_sender=1 << 20), clock=clock)
    owner = Identity.generate()
    keys = [counter_key(f"{i:03x}" * 13 + "0") for i in range(300)]
    for key in keys:
        record = make_record(key, {"count": 1, "label": ""}, expiration=clock.now + 60, owner=owner)
        assert storage.put(record, sender=owner.peer_id, network="203.0.113.0/24")
    rng = random.Random(k)
    for tries in (0, k - 1, k, 3 * k, 100):  # cards offered (full buckets keep fewer)
        routing = RoutingTable(rng.randbytes(20), k=k)
        for _ in range(tries):
            routing.add(card(f"10.{rng.randrange(256)}.{rng.randrange(256)}.1"), now=0)
        for newcomer in (card("9.9.9.9"), *list(routing)[:1]):
            expected = []
            for key in keys:
                target = key_id(key)
                others = routing.closest(target, k, exclude=newcomer.peer_id)
                if len(others) < k or distance(newcomer.peer_id, target) < distance(
                    others[-1].peer_id, target
                ):
                    expected.append(key)
            handed = records_for(newcomer, storage=storage, routing=routing, k=k)
            assert sorted(r.key for r in handed) == sorted(expected), (len(routing), k)
            assert expected, len(routing)


async def test_a_hand_off_of_many_keys_lets_the_event_loop_in_between_slices():
    """Thousands of keys held (records of made-up swarms cost only free keys) and a new
    contact: which records it gets is found a slice of keys at a time, and the loop runs
    the others' calls in between (the whole look held it a quarter of a second)."""
    clock = Clock()
    clock.now = time.time()
    storage = Storage(StorageConfig(), clock=clock)
    owner = Identity.generate()
    count = 3 * KEYS_PER_SLICE
    for i in range(count):
        key = counter_key(f"{i:04x}" * 10)
        record = make_record(key, {"count": 1, "label": ""}, expiration=clock.now + 60, owner=owner)
        assert storage.put(record, sender=owner.peer_id, network="203.0.113.0/24")
    stored: list[int] = []

    class Book:  # a newcomer that takes every store at once (no yield of its own)
        routing = RoutingTable(Identity.generate().peer_id, k=DhtConfig().k)

        async def call(self, contact, method, request, deadline):
            stored.append(len(request))
            return True

    tasks: list[asyncio.Task[None]] = []
    replicator = Replicator(
        config=DhtConfig(),
        storage=storage,
        book=Book(),
        transport=types.SimpleNamespace(store=None),
        sign=lambda batch: batch,
        spawn=lambda coro: tasks.append(asyncio.ensure_future(coro)),
        stats=Counter(),
    )
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    looked: list[int] = []  # the ticker's count each time a key's records are read
    read = storage.get

    def get(key: str):
        looked.append(ticks)
        return read(key)

    storage.get = get  # type: ignore[method-assign]
    other = asyncio.create_task(ticker())
    replicator.offer(card("9.9.9.9"))
    await tasks[0]
    other.cancel()
    assert sum(stored) == count  # every key's record handed over
    assert len(set(looked)) == 3  # the loop ran the others between the three slices


# -- the request handlers ---------------------------------------------------------------


class Spawned:
    """What the handlers start in the background, kept to look at (and closed after)."""

    def __init__(self) -> None:
        self.work = []

    def __call__(self, work) -> None:
        self.work.append(work)

    def close(self) -> None:
        for work in self.work:
            work.close()


def requests_of(own: Identity, spawned: Spawned, *, gates: SwarmGates | None = None):
    config = DhtConfig()
    network = MemoryNetwork()
    book = book_of(own, config=config)
    storage = Storage(config.storage, clock=time.time)
    requests = Requests(
        config=config,
        book=book,
        storage=storage,
        gates=gates or SwarmGates(),
        rejections=book._rejections,
        transport=MemoryTransport(network, "8.8.4.4:4000"),
        card=lambda: sign_card(own, "8.8.4.4:4000"),
        clock=time.time,
        spawn=spawned,
    )
    return requests, book, storage


async def test_an_oversized_ping_is_refused_before_its_card_is_read_and_counted():
    spawned = Spawned()
    requests, book, _ = requests_of(Identity.generate(), spawned)
    request = pb.PingRequest(sender=card().to_proto())
    request.sender.endpoint = "x" * 10_000
    with pytest.raises(Rejection) as refused:
        await requests.handle_ping(request, "8.8.8.8")
    assert refused.value.code == "oversize" and book._rejections.counts["oversize"] == 1
    assert len(book.routing) == 0


async def test_a_caller_at_its_cards_host_joins_the_table_and_one_elsewhere_is_pinged_first():
    spawned = Spawned()
    requests, book, _ = requests_of(Identity.generate(), spawned)
    honest, elsewhere = card("8.8.8.8"), card("9.9.9.9")
    answer = await requests.handle_ping(pb.PingRequest(sender=honest.to_proto()), "8.8.8.8")
    assert answer.observed_host == "8.8.8.8" and honest.peer_id in book.routing
    await requests.handle_ping(pb.PingRequest(sender=elsewhere.to_proto()), "7.7.7.7")
    assert elsewhere.peer_id not in book.routing and len(spawned.work) == 1
    spawned.close()


async def test_a_store_from_a_non_member_of_a_guarded_swarm_is_refused_per_record():
    spawned = Spawned()
    gates = SwarmGates()
    gates.admit(IdentityWork(swarm_id=SWARM, bits=1))
    requests, book, storage = requests_of(Identity.generate(), spawned, gates=gates)
    member, stranger = Identity.generate(), Identity.generate()
    proven = {**PEER, MEMBER_FIELD: solve(SWARM, member.peer_id, 1)}
    records = [
        make_record(peers_key(SWARM), proven, expiration=time.time() + 60, owner=member),
        make_record(peers_key(SWARM), PEER, expiration=time.time() + 60, owner=stranger),
    ]
    sender = Identity.generate()
    request = signed_store_request(
        sender, sign_card(sender, "8.8.8.8:4000"), records, timestamp_ms=int(time.time() * 1000)
    )
    answer = await requests.handle_store(request, "8.8.8.8")
    assert [r.stored for r in answer.results] == [True, False]
    assert "proof of work" in answer.results[1].reason
    assert [r.subkey for r in storage.get(peers_key(SWARM))] == [member.peer_id_hex]
    assert book._rejections.counts["unproven"] == 1
    spawned.close()


# -- the private swarms' gates ----------------------------------------------------------


def test_own_records_of_a_guarded_swarm_carry_the_credential_and_others_pass_unchanged():
    own = Identity.generate()
    gates = SwarmGates()
    assert gates.with_membership(peers_key(SWARM), PEER) is PEER and not gates
    nonce = solve(SWARM, own.peer_id, 1)
    gates.admit(IdentityWork(swarm_id=SWARM, bits=1, own=nonce))
    assert gates.guards(SWARM) and not gates.guards("cd" * 20)
    assert gates.with_membership(peers_key(SWARM), PEER)[MEMBER_FIELD] == nonce
    assert gates.with_membership(peers_key("cd" * 20), PEER) is PEER
    value = gates.with_membership(peers_key(SWARM), PEER)
    record = make_record(peers_key(SWARM), value, expiration=time.time() + 60, owner=own)
    assert gates.refusal(record, value) is None
    bare = make_record(peers_key(SWARM), PEER, expiration=time.time() + 60, owner=own)
    assert gates.refusal(bare, PEER).code == "unproven"


# -- entering the network ---------------------------------------------------------------


def test_a_clock_within_network_jitter_is_kept_without_a_word():
    verdict = check_clock([0.4, -0.2, 0.1], config=DhtConfig())
    assert verdict.skew == pytest.approx(0.1) and verdict.warning is verdict.refusal is None
    assert check_clock([], config=DhtConfig()).skew is None


def test_a_clock_a_little_off_keeps_the_swarms_time_and_says_how_to_fix_it():
    verdict = check_clock([20.0, 21.0, 19.0], config=DhtConfig())
    assert verdict.skew == 20.0 and verdict.refusal is None
    assert "clock is 20 s behind the clock of the 3 peer(s)" in verdict.warning
    assert "NTP" in verdict.warning


def test_the_time_is_one_vote_per_network_each_its_own_median():
    votes = network_votes(
        [("10.0.0.1", 120.0), ("10.0.0.1", 120.0), ("10.0.0.1", 121.0), ("1.2.3.0/24", 0.5),
         ("5.6.7.0/24", -0.5), ("5.6.7.0/24", 0.1), ("9.9.9.0/24", 0.0)]
    )  # fmt: skip
    assert sorted(votes) == [-0.5, 0.0, 0.5, 120.0]  # four keys of one network are one vote
    assert check_clock(votes, config=DhtConfig()).skew == 0.0


def test_a_clock_off_by_more_than_records_tolerate_is_refused_and_not_kept():
    verdict = check_clock([-900.0], config=DhtConfig(max_clock_skew_s=600.0))
    assert verdict.skew is None and "900 s ahead of" in verdict.refusal
    assert "600 s off" in verdict.refusal


async def test_joining_through_a_dead_and_a_live_address_answers_with_the_live_one():
    network = MemoryNetwork()
    config = DhtConfig(join_grace_s=0.2)
    live = DHTNode(
        identity=Identity.generate(),
        transport=MemoryTransport(network, "8.8.8.8:4000"),
        endpoint="8.8.8.8:4000",
        config=config,
    )
    network.register("8.8.8.8:4000", live)
    own = Identity.generate()
    book = book_of(own, config=config)
    entry = EntryPeers(
        config=config,
        transport=MemoryTransport(network, "9.9.9.9:4000"),
        book=book,
        local_clock=time.time,
        rng=random.Random(1),
    )
    request = pb.PingRequest(sender=sign_card(own, "9.9.9.9:4000").to_proto())
    answers = await entry.ask(["6.6.6.6:4000", "8.8.8.8:4000"], request, budget=5.0)
    assert [contact_from_proto(a.response.peer).peer_id for a in answers] == [live.peer_id]
    assert live.peer_id in book.routing
    assert entry.endpoints == ("6.6.6.6:4000", "8.8.8.8:4000")
    with pytest.raises(NetworkError, match=r"none of 6\.6\.6\.6:4000 answered.*refused"):
        await entry.ask(["6.6.6.6:4000"], request, budget=0.3)
