"""Iterative Kademlia lookups: the state of one (:class:`Lookup`, no I/O) and the engine
that drives it (:class:`Lookups`).

A lookup keeps ``alpha`` queries in flight toward the target, always to the closest known
node not yet asked, until the ``k`` closest known nodes have all answered or failed; when
an answer brings nobody closer, it asks all of the k closest not yet asked at once. A value
lookup (a get) also stops as soon as it holds records and the ``get_quorum`` closest nodes
known have answered: records are stored at the k closest nodes, republished by their
owners, and handed by the closest holder to any newcomer that becomes one of the k closest
(Kademlia section 2.5), so the closest few nodes hold every subkey of a key.

Node ids are free to make, so a stranger can grind any number next to a key and answer
from one address with only its own cards: "the k closest" counts at most
``max_per_subnet`` nodes of one network (the routing table's cap, :func:`diverse`), and a
get's quorum one node per network, so that such ids take a few places, never all of them.

Every card and record an answer carries is checked before it is used; one invalid record
marks the whole answer as untrustworthy.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from google.protobuf.message import Message

from swarmloco.net.deadline import Deadline
from swarmloco.net.dht.book import ContactBook
from swarmloco.net.dht.config import DhtConfig
from swarmloco.net.dht.contact import Contact
from swarmloco.net.dht.gates import SwarmGates
from swarmloco.net.dht.routing import diverse
from swarmloco.net.dht.wire import record_from_proto
from swarmloco.net.endpoints import source_network
from swarmloco.net.records import CheckedRecords, Record
from swarmloco.net.rejections import Rejection, RejectionLog
from swarmloco.proto.v1 import dht_pb2 as pb


@dataclasses.dataclass(frozen=True)
class Entry:
    """One live subkey of a key, validated."""

    subkey: str
    value: Any
    expiration: float
    record: Record


@dataclasses.dataclass
class GetResult:
    entries: dict[str, Entry]
    """Live subkeys (the latest record of each)."""
    rejected: list[Rejection]
    """Records other nodes served that failed validation (with the peer)."""
    responded: int
    """Nodes that answered."""
    hops: int | None
    """Depth of the first answer that carried records (0 = our own storage, 1 = a node
    we knew already)."""


@dataclasses.dataclass
class LookupResult:
    closest: list[Contact]
    """The nodes closest to the target that answered, closest first (at most k)."""
    responded: int
    hops: int | None
    """For a node id: at which depth its card was first seen (0 = in our table)."""


class Lookup:
    """The state of one iterative lookup (no I/O)."""

    def __init__(self, *, target: bytes, k: int, book: ContactBook) -> None:
        self.target = target
        self._k = k
        self._book = book
        self._target_int = int.from_bytes(target, "big")
        self.candidates: dict[bytes, Contact] = {}
        self._networks: dict[bytes, str | None] = {}
        self.depth: dict[bytes, int] = {}
        self.queried: set[bytes] = set()
        self.responded: dict[bytes, Contact] = {}
        self.failed: set[bytes] = set()
        self.entries: dict[str, Entry] = {}
        self.rejected: list[Rejection] = []
        self.hops: int | None = None
        self.stalled = False

    def offer(self, contact: Contact, depth: int) -> None:
        if contact.peer_id == self.target and self.hops is None:
            self.hops = depth - 1
        if contact.peer_id in self.candidates or contact.peer_id == self._book.routing.local_id:
            return
        if not contact.reachable or self._book.unreachable(contact.peer_id):
            return
        self.candidates[contact.peer_id] = contact
        self.depth[contact.peer_id] = depth
        self._networks[contact.peer_id] = self._book.routing.subnet(contact)

    def _best_distance(self) -> int:
        return min(
            (
                int.from_bytes(i, "big") ^ self._target_int
                for i in self.candidates
                if i not in self.failed
            ),
            default=1 << 160,
        )

    def _closest(self, contacts: list[Contact], count: int, per_network: int) -> list[Contact]:
        contacts.sort(key=lambda c: int.from_bytes(c.peer_id, "big") ^ self._target_int)
        return diverse(
            contacts,
            count,
            network=lambda c: self._networks[c.peer_id],
            per_network=per_network,
        )

    def ranked(self) -> list[Contact]:
        """The k closest known that have not failed, at most ``max_per_subnet`` of a network."""
        live = [c for i, c in self.candidates.items() if i not in self.failed]
        return self._closest(live, self._k, self._book.routing.max_per_subnet)

    def quorum(self, count: int) -> list[Contact]:
        """The ``count`` closest known that have not failed, one per network: the nodes
        whose answers settle a get."""
        live = [c for i, c in self.candidates.items() if i not in self.failed]
        return self._closest(live, count, 1)

    def next_to_query(self, among: list[Contact]) -> Contact | None:
        """The first contact of ``among`` (closest first) not asked yet."""
        for contact in among:
            if contact.peer_id not in self.queried:
                return contact
        return None

    def settled(self, quorum: int) -> bool:
        """A get may stop: it holds records and the ``quorum`` closest known of distinct
        networks answered."""
        if not self.entries:
            return False
        return all(c.peer_id in self.responded for c in self.quorum(quorum))

    def absorb_nodes(
        self, contact: Contact, response: pb.FindNodeResponse | pb.FindValueResponse | None
    ) -> bool:
        """Take in the nodes an answer names; False when the call failed."""
        if response is None:
            self.failed.add(contact.peer_id)
            return False
        self.responded[contact.peer_id] = contact
        depth = self.depth[contact.peer_id]
        best = self._best_distance()
        # An honest node sends at most k cards; checking more would let one response
        # make us verify thousands of signatures.
        for info in response.closest[: self._k]:
            card = self._book.card_from(info, source=contact)
            if card is not None:
                self.offer(card, depth + 1)
        # Kademlia: when an answer brings nobody closer than the closest already seen, ask
        # all of the k closest not yet asked at once instead of alpha at a time.
        self.stalled = self._best_distance() >= best
        return True

    def merge(self, entry: Entry) -> None:
        known = self.entries.get(entry.subkey)
        if known is None or entry.expiration > known.expiration:
            self.entries[entry.subkey] = entry

    def closest_responded(self) -> list[Contact]:
        """The k closest that answered, at most ``max_per_subnet`` of a network."""
        found = list(self.responded.values())
        return self._closest(found, self._k, self._book.routing.max_per_subnet)


class Lookups:
    """Runs lookups for one node: asks its contacts, reads their answers, keeps the
    routing table's record of which buckets were looked into."""

    def __init__(
        self,
        *,
        config: DhtConfig,
        book: ContactBook,
        checked: CheckedRecords,
        gates: SwarmGates,
        rejections: RejectionLog,
        stats: Counter[str],
        clock: Callable[[], float],
    ) -> None:
        self._config = config
        self._book = book
        self._checked = checked
        self._gates = gates
        self._rejections = rejections
        self._stats = stats
        self._clock = clock

    def start(self, target: bytes) -> Lookup:
        return Lookup(target=target, k=self._config.k, book=self._book)

    async def run(
        self,
        lookup: Lookup,
        deadline: Deadline,
        send: Callable[[str, Any, Deadline], Awaitable[Any]],
        request: Message,
    ) -> None:
        cfg = self._config
        for contact in self._book.routing.closest(lookup.target, cfg.k):
            lookup.offer(contact, depth=1)
        value_lookup = isinstance(request, pb.FindValueRequest)
        inflight: dict[asyncio.Task[Any], Contact] = {}
        try:
            while not (value_lookup and lookup.settled(cfg.get_quorum)):
                # Once a get holds records, only the closest `get_quorum` nodes can still
                # change the outcome: asking farther ones would only cost calls.
                if value_lookup and lookup.entries:
                    among = lookup.quorum(cfg.get_quorum)
                else:
                    among = lookup.ranked()
                parallel = cfg.k if lookup.stalled else cfg.alpha
                while len(inflight) < parallel:
                    ask = lookup.next_to_query(among)
                    if ask is None:
                        break
                    lookup.queried.add(ask.peer_id)
                    call = self._book.call(ask, send, request, deadline)
                    inflight[asyncio.ensure_future(call)] = ask
                if not inflight:
                    break
                done, _ = await asyncio.wait(
                    inflight, timeout=deadline.remaining(), return_when=asyncio.FIRST_COMPLETED
                )
                if not done:
                    break  # the deadline passed; use what we have
                for task in done:
                    await self._absorb(lookup, inflight.pop(task), task.result())
        finally:
            for task in inflight:
                task.cancel()
            if inflight:
                await asyncio.wait(inflight)
        self._book.routing.mark_lookup(lookup.target, now=time.monotonic())
        self._stats["lookups"] += 1

    async def _absorb(
        self,
        lookup: Lookup,
        contact: Contact,
        response: pb.FindNodeResponse | pb.FindValueResponse | None,
    ) -> None:
        if lookup.absorb_nodes(contact, response) and isinstance(response, pb.FindValueResponse):
            await self._read_records(lookup, contact, response)

    async def _read_records(
        self, lookup: Lookup, contact: Contact, response: pb.FindValueResponse
    ) -> None:
        depth = lookup.depth[contact.peer_id]
        now = self._clock()
        # We dialled the contact at its host: the records came from that network.
        network = source_network(contact.host, limit_private=self._config.limit_private_subnets)
        records: list[Record] = []
        malformed: Rejection | None = None
        for message in response.records:
            try:
                records.append(record_from_proto(message))
            except Rejection as unreadable:
                malformed = unreadable  # the records before it are read, none after
                break
        # A record this lookup already holds was checked when it came from another node.
        fresh = [
            i
            for i, record in enumerate(records)
            if (known := lookup.entries.get(record.subkey)) is None or known.record != record
        ]
        outcomes = await self._checked.validate_many([records[i] for i in fresh], now=now)
        # Checked up to the first bad record, where the reading below stops too.
        checked = dict(zip(fresh, outcomes, strict=False))
        for i, record in enumerate(records):
            if i in checked:
                value = checked[i]
                if isinstance(value, Rejection):
                    if value.code == "expired":
                        continue  # clocks differ a little between honest nodes
                    malformed = value
                    break
                refused = self._gates.refusal(record, value, network=network)
                if refused is not None:
                    # Valid, but not from a member of a private swarm: a node that is
                    # no member itself (a bootstrap node) stores it in good faith.
                    self._rejections.record(refused.from_peer(str(contact)), str(contact))
                    continue
                lookup.merge(Entry(record.subkey, value, record.expiration, record))
            if lookup.hops is None:
                lookup.hops = depth
        if malformed is not None:
            # Honest nodes store only valid records: one bad record marks the whole answer
            # as untrustworthy, and bounds the work it costs.
            blamed = malformed.from_peer(str(contact))
            self._rejections.record(blamed, str(contact))
            lookup.rejected.append(blamed)
