"""The Kademlia routing table: 160 k-buckets by XOR distance, with a subnet cap per bucket.

Bucket ``i`` holds contacts whose distance to the local id has bit length ``i + 1``. Each
bucket keeps at most ``k`` contacts in least-recently-seen order, and at most
``max_per_subnet`` of them from one /24 (IPv4) or /64 (IPv6), so that one operator with
one block of addresses cannot fill our buckets and eclipse us. A full bucket keeps
newcomers in a small replacement cache (Kademlia section 4.1) and promotes the freshest
one when a member fails. Pure data structure: no I/O, the caller passes the time. Lookups
apply the same cap to the k closest nodes they keep (:func:`diverse`).
"""

from __future__ import annotations

import enum
import heapq
import random
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator

from swarmloco.net.dht.contact import Contact, distance
from swarmloco.net.endpoints import subnet_of
from swarmloco.net.identity import PEER_ID_BYTES

ID_BITS = PEER_ID_BYTES * 8


class Added(enum.Enum):
    NEW = "new"
    UPDATED = "updated"
    REPLACEMENT = "replacement"  # bucket full: kept in the replacement cache
    SUBNET_FULL = "subnet-full"
    IGNORED = "ignored"  # ourselves, a client-mode peer, or an older card


class _Bucket:
    __slots__ = ("contacts", "last_lookup", "replacements", "seen")

    def __init__(self) -> None:
        self.contacts: OrderedDict[bytes, Contact] = OrderedDict()  # oldest first
        self.seen: dict[bytes, float] = {}
        self.replacements: OrderedDict[bytes, Contact] = OrderedDict()
        self.last_lookup = 0.0


def diverse(
    contacts: Iterable[Contact],
    count: int,
    *,
    network: Callable[[Contact], str | None],
    per_network: int,
) -> list[Contact]:
    """The first ``count`` of ``contacts`` (in their order, closest first) with at most
    ``per_network`` of them from one ``network`` (None: exempt, each counts alone).

    Node ids cost nothing to make, so one operator can grind any number of them next to a
    key; its addresses are what it cannot multiply. Lookups keep, ask and store to the
    closest nodes under this cap, so ids from one network take at most ``per_network``
    of their places however close they are (S/Kademlia's disjoint paths, simplified).
    """
    taken: Counter[str] = Counter()
    chosen: list[Contact] = []
    for contact in contacts:
        if len(chosen) >= count:
            break
        group = network(contact)
        if group is not None:
            if taken[group] >= per_network:
                continue
            taken[group] += 1
        chosen.append(contact)
    return chosen


class RoutingTable:
    def __init__(
        self,
        local_id: bytes,
        *,
        k: int = 20,
        max_per_subnet: int = 2,
        limit_private_subnets: bool = False,
    ) -> None:
        if len(local_id) != PEER_ID_BYTES:
            raise ValueError(f"node ids are {PEER_ID_BYTES} bytes")
        self.local_id = local_id
        self.k = k
        self.max_per_subnet = max_per_subnet
        self.limit_private_subnets = limit_private_subnets
        self._buckets = [_Bucket() for _ in range(ID_BITS)]
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __contains__(self, peer_id: bytes) -> bool:
        return peer_id in self._buckets[self.bucket_index(peer_id)].contacts

    def __iter__(self) -> Iterator[Contact]:
        for bucket in self._buckets:
            yield from bucket.contacts.values()

    def bucket_index(self, peer_id: bytes) -> int:
        d = distance(self.local_id, peer_id)
        return max(d.bit_length() - 1, 0)

    def get(self, peer_id: bytes) -> Contact | None:
        return self._buckets[self.bucket_index(peer_id)].contacts.get(peer_id)

    def subnet(self, contact: Contact) -> str | None:
        """The network ``contact`` counts toward in the subnet cap (None: exempt)."""
        return subnet_of(contact.host, limit_private=self.limit_private_subnets)

    def _subnet_count(self, contacts: OrderedDict[bytes, Contact], subnet: str) -> int:
        return sum(1 for c in contacts.values() if self.subnet(c) == subnet)

    def add(self, contact: Contact, *, now: float) -> Added:
        """Record that ``contact`` answered or called us (it is alive)."""
        if contact.peer_id == self.local_id or not contact.reachable:
            return Added.IGNORED
        bucket = self._buckets[self.bucket_index(contact.peer_id)]
        known = bucket.contacts.get(contact.peer_id)
        if known is not None:
            if contact.started_at_ms < known.started_at_ms:
                return Added.IGNORED
            if contact.endpoint != known.endpoint:
                # A restarted peer on a new address still counts toward a subnet cap.
                subnet = self.subnet(contact)
                others = OrderedDict(
                    (i, c) for i, c in bucket.contacts.items() if i != contact.peer_id
                )
                if subnet is not None and self._subnet_count(others, subnet) >= self.max_per_subnet:
                    return Added.SUBNET_FULL
            bucket.contacts[contact.peer_id] = contact
            bucket.contacts.move_to_end(contact.peer_id)
            bucket.seen[contact.peer_id] = now
            return Added.UPDATED
        subnet = self.subnet(contact)
        if (
            subnet is not None
            and self._subnet_count(bucket.contacts, subnet) >= self.max_per_subnet
        ):
            return Added.SUBNET_FULL
        if len(bucket.contacts) < self.k:
            bucket.contacts[contact.peer_id] = contact
            bucket.seen[contact.peer_id] = now
            bucket.replacements.pop(contact.peer_id, None)
            self._size += 1
            return Added.NEW
        bucket.replacements[contact.peer_id] = contact
        bucket.replacements.move_to_end(contact.peer_id)
        while len(bucket.replacements) > self.k:
            bucket.replacements.popitem(last=False)
        return Added.REPLACEMENT

    def remove(self, peer_id: bytes, *, now: float) -> tuple[Contact | None, Contact | None]:
        """Drop a failed contact; return it and the replacement promoted in its place."""
        bucket = self._buckets[self.bucket_index(peer_id)]
        bucket.replacements.pop(peer_id, None)
        removed = bucket.contacts.pop(peer_id, None)
        bucket.seen.pop(peer_id, None)
        if removed is None:
            return None, None
        self._size -= 1
        while bucket.replacements:
            _, candidate = bucket.replacements.popitem(last=True)  # freshest first
            subnet = self.subnet(candidate)
            if subnet is None or self._subnet_count(bucket.contacts, subnet) < self.max_per_subnet:
                bucket.contacts[candidate.peer_id] = candidate
                bucket.seen[candidate.peer_id] = now
                self._size += 1
                return removed, candidate
        return removed, None

    def closest(self, target: bytes, count: int, *, exclude: bytes | None = None) -> list[Contact]:
        """The ``count`` known contacts closest to ``target`` by XOR distance."""
        t = int.from_bytes(target, "big")
        return heapq.nsmallest(
            count,
            (c for c in self if c.peer_id != exclude),
            key=lambda c: int.from_bytes(c.peer_id, "big") ^ t,
        )

    def stale(self, *, now: float, older_than: float, limit: int) -> list[Contact]:
        """Up to ``limit`` contacts not heard from for ``older_than`` seconds, oldest first."""
        found: list[tuple[float, Contact]] = []
        for bucket in self._buckets:
            for peer_id, contact in bucket.contacts.items():
                seen = bucket.seen[peer_id]
                if now - seen >= older_than:
                    found.append((seen, contact))
        found.sort(key=lambda item: item[0])
        return [c for _, c in found[:limit]]

    def mark_lookup(self, target: bytes, *, now: float) -> None:
        """A lookup toward ``target`` refreshed its bucket."""
        if target != self.local_id:
            self._buckets[self.bucket_index(target)].last_lookup = now

    def buckets_to_refresh(self, *, now: float, interval: float) -> list[int]:
        """Non-empty buckets without a lookup for ``interval`` seconds."""
        return [
            i
            for i, bucket in enumerate(self._buckets)
            if bucket.contacts and now - bucket.last_lookup >= interval
        ]

    def random_id_in_bucket(self, index: int, rng: random.Random) -> bytes:
        """A random id whose distance to us has bit length ``index + 1``."""
        offset = (1 << index) | rng.getrandbits(index) if index else 1
        value = int.from_bytes(self.local_id, "big") ^ offset
        return value.to_bytes(PEER_ID_BYTES, "big")
