"""Handing a newcomer the records it is now one of the k closest nodes to (Kademlia section
2.5), so that gets find them at once instead of after the owners' next republish.

Every holder that counts the newcomer among the k closest nodes it knows to a key sends it,
not only the holder closest to the key (the paper's rule to save messages): the closest
holders often do not know the newcomer (its bucket in their table is full) or are newcomers
themselves still waiting for the record, and the newcomer would then miss it until the next
republish. The price is a few duplicate stores of small records per join; the receiver
drops duplicates.

The :class:`Replicator` owns the hand-offs under way and bounds them; which records a
newcomer gets is the plain function :func:`records_for`.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import Any

from swarmloco.net.deadline import Deadline
from swarmloco.net.dht.book import ContactBook
from swarmloco.net.dht.config import DhtConfig
from swarmloco.net.dht.contact import Contact
from swarmloco.net.dht.routing import RoutingTable
from swarmloco.net.dht.storage import Storage
from swarmloco.net.dht.transport import DhtTransport
from swarmloco.net.dht.wire import key_id
from swarmloco.net.records import Record
from swarmloco.proto.v1 import dht_pb2 as pb

MAX_REPLICATIONS = 16  # newcomers being handed records at once
MAX_PENDING_REPLICATIONS = 1024  # newcomers waiting for a hand-off (beyond: republish)
MAX_REPLICATED_KEYS = 4096  # keys considered per newcomer (beyond: republish)
KEYS_PER_SLICE = 256  # keys looked at between two yields to the event loop


def store_batches(
    records: list[Record], max_records: int, max_bytes: int
) -> Iterator[list[Record]]:
    """``records`` in order, cut into batches of at most ``max_records`` records and
    ``max_bytes`` bytes (``Record.size``; a larger record goes alone)."""
    batch: list[Record] = []
    size = 0
    for record in records:
        if batch and (len(batch) >= max_records or size + record.size > max_bytes):
            yield batch
            batch, size = [], 0
        batch.append(record)
        size += record.size
    if batch:
        yield batch


def records_for(
    newcomer: Contact,
    *,
    storage: Storage,
    routing: RoutingTable,
    k: int,
    keys: Sequence[str] | None = None,
) -> list[Record]:
    """The stored records of every key (``keys``, else the first ``MAX_REPLICATED_KEYS``)
    to which ``newcomer`` is closer than the k-th closest other node we know: fewer than k
    others are closer (XOR distances to one key never tie). Counted, not sorted, over the
    table's ids read once: a look at 4,096 keys against 74 contacts took 0.17 s sorting
    them per key, a tenth of that counting."""
    others = [int.from_bytes(c.peer_id, "big") for c in routing if c.peer_id != newcomer.peer_id]
    mine = int.from_bytes(newcomer.peer_id, "big")
    records: list[Record] = []
    for key in storage.keys()[:MAX_REPLICATED_KEYS] if keys is None else keys:
        target = int.from_bytes(key_id(key), "big")
        near = mine ^ target
        if len(others) < k or sum(1 for o in others if o ^ target < near) < k:
            # Interleaved across the networks they came from: the newcomer takes at most
            # its cap per key from our network, and a flood stored here must not take all
            # of it.
            records.extend(storage.get(key))
    return records


class Replicator:
    """The hand-offs of one node: at most ``MAX_REPLICATIONS`` at once, newcomers beyond
    that waiting their turn (a skipped newcomer would miss its records until the next
    republish), and at most ``MAX_PENDING_REPLICATIONS`` waiting."""

    def __init__(
        self,
        *,
        config: DhtConfig,
        storage: Storage,
        book: ContactBook,
        transport: DhtTransport,
        sign: Callable[[list[Record]], pb.StoreRequest],
        spawn: Callable[[Coroutine[Any, Any, None]], None],
        stats: Counter[str],
    ) -> None:
        self._config = config
        self._storage = storage
        self._book = book
        self._transport = transport
        self._sign = sign
        self._spawn = spawn
        self._stats = stats
        self._pending: set[bytes] = set()
        self._slots = asyncio.Semaphore(MAX_REPLICATIONS)

    def offer(self, newcomer: Contact) -> None:
        """A contact new to our table: hand it its records in the background."""
        if len(self._storage) and len(self._pending) < MAX_PENDING_REPLICATIONS:
            self._pending.add(newcomer.peer_id)
            self._spawn(self._replicate_to(newcomer))

    async def _replicate_to(self, newcomer: Contact) -> None:
        try:
            async with self._slots:
                await self._hand_off(newcomer)
        finally:
            self._pending.discard(newcomer.peer_id)

    async def _hand_off(self, newcomer: Contact) -> None:
        """Store at ``newcomer`` the records it is now one of the k closest nodes to. They
        are found a slice of keys at a time, yielding to the event loop between slices:
        each key is measured against the routing table, and with thousands of keys held
        (records of made-up swarms cost a stranger only free keys) the whole look held the
        loop for a quarter of a second per new contact (17 ms since :func:`records_for`
        counts instead of sorting)."""
        cfg = self._config
        keys = self._storage.keys()[:MAX_REPLICATED_KEYS]
        records: list[Record] = []
        for start in range(0, len(keys), KEYS_PER_SLICE):
            if start:
                await asyncio.sleep(0)  # let the calls waiting on the loop in
            records += records_for(
                newcomer,
                storage=self._storage,
                routing=self._book.routing,
                k=cfg.k,
                keys=keys[start : start + KEYS_PER_SLICE],
            )
        deadline = Deadline.after(cfg.lookup_timeout_s)
        for batch in store_batches(records, cfg.max_records_per_request, cfg.max_request_bytes):
            request = self._sign(batch)
            if await self._book.call(newcomer, self._transport.store, request, deadline) is None:
                return
            self._stats["replicated"] += len(batch)
