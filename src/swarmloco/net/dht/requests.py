"""Other nodes' calls to a DHT node, admitted or refused: the node's :class:`DhtHandler`.

Each request is measured before any field of it is read, its sender's card checked, and
only then answered; a store request must also be signed by its sender, dated near our clock
and hold records that pass validation and storage's quotas. Every refusal is logged and
counted once, with the peer and the reason.

A caller joins our routing table when it calls from the host its card names; a card that
names another host is pinged there first (anyone could otherwise aim our traffic at a
third party).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine
from typing import Any

from google.protobuf.message import Message

from swarmloco.net.deadline import Deadline
from swarmloco.net.dht.book import ContactBook
from swarmloco.net.dht.config import DhtConfig
from swarmloco.net.dht.contact import MAX_CARD_BYTES, Contact, contact_from_proto
from swarmloco.net.dht.gates import SwarmGates
from swarmloco.net.dht.storage import Storage
from swarmloco.net.dht.transport import DhtTransport
from swarmloco.net.dht.wire import check_store_request, key_id, record_from_proto, record_to_proto
from swarmloco.net.endpoints import source_network
from swarmloco.net.heap import release_after
from swarmloco.net.identity import PEER_ID_BYTES
from swarmloco.net.records import MAX_KEY_CHARS, max_record_bytes
from swarmloco.net.rejections import Rejection, RejectionLog
from swarmloco.proto.v1 import dht_pb2 as pb

UNREAD = "not read: the request carried a record with a forged signature"
MAX_VERIFYING = 32  # callers whose card names another host, being pinged there at once


class Requests:
    """Answers the four DHT calls for one node."""

    def __init__(
        self,
        *,
        config: DhtConfig,
        book: ContactBook,
        storage: Storage,
        gates: SwarmGates,
        rejections: RejectionLog,
        transport: DhtTransport,
        card: Callable[[], Contact],
        clock: Callable[[], float],
        spawn: Callable[[Coroutine[Any, Any, None]], None],
    ) -> None:
        """``card`` is our own card as it is now (the endpoint may change); ``spawn``
        starts the pings that verify a caller's card in the node's task group."""
        self._config = config
        self._book = book
        self._storage = storage
        self._gates = gates
        self._rejections = rejections
        self._transport = transport
        self._card = card
        self._clock = clock
        self._spawn = spawn
        self._verifying: set[bytes] = set()

    def _refuse_oversize(self, request: Message, limit: int, observed_host: str) -> None:
        """Refuse a request larger than any honest one before any field of it is read:
        reading a bytes or string field of a message copies it, however long, and a few
        copies of megabytes per call leave their mark on the process long after."""
        size = request.ByteSize()
        if size > limit:
            reason = f"{type(request).__name__} of {size} bytes; at most {limit}"
            self._rejections.record(Rejection("oversize", reason), observed_host or "a peer")
            release_after(size)
            # Raised unnamed: an exception held in a local of a frame in its own traceback
            # is a reference cycle, and it would keep the request alive until the cyclic
            # garbage collector ran.
            raise Rejection("oversize", reason)

    def _sender(self, info: pb.PeerInfo, observed_host: str) -> Contact:
        """The checked card of a caller; it joins our table if it proves reachable."""
        try:
            contact = contact_from_proto(info)
        except Rejection as rejection:
            self._rejections.record(rejection, observed_host or "a peer")
            raise
        self._book.card_seen(contact)
        if contact.reachable and contact.peer_id != self._book.routing.local_id:
            if contact.host == observed_host:
                self._book.seen(contact)
            elif contact.peer_id not in self._book.routing and len(self._verifying) < MAX_VERIFYING:
                # The card names another host than the one calling: add it only once it
                # answers there, or anyone could aim our traffic at a third party.
                self._verifying.add(contact.peer_id)
                self._spawn(self._verify(contact))
        return contact

    async def _verify(self, contact: Contact) -> None:
        try:
            request = pb.PingRequest(sender=self._card().to_proto())
            deadline = Deadline.after(self._config.rpc_timeout_s)
            await self._book.call(contact, self._transport.ping, request, deadline)
        finally:
            self._verifying.discard(contact.peer_id)

    def _refuse(self, rejection: Rejection, sender: Contact, observed_host: str) -> Rejection:
        self._rejections.record(rejection, str(sender), source=observed_host)
        return rejection

    async def handle_ping(self, request: pb.PingRequest, observed_host: str) -> pb.PingResponse:
        self._refuse_oversize(request, MAX_CARD_BYTES + 16, observed_host)
        self._sender(request.sender, observed_host)
        return pb.PingResponse(
            peer=self._card().to_proto(),
            observed_host=observed_host,
            time_ms=int(self._clock() * 1000),
        )

    async def handle_find_node(
        self, request: pb.FindNodeRequest, observed_host: str
    ) -> pb.FindNodeResponse:
        self._refuse_oversize(request, MAX_CARD_BYTES + PEER_ID_BYTES + 16, observed_host)
        sender = self._sender(request.sender, observed_host)
        if len(request.target) != PEER_ID_BYTES:
            why = f"find-node target must be {PEER_ID_BYTES} bytes"
            raise self._refuse(Rejection("bad-request", why), sender, observed_host)
        closest = self._book.routing.closest(request.target, self._config.k, exclude=sender.peer_id)
        return pb.FindNodeResponse(
            peer=self._card().to_proto(), closest=[c.to_proto() for c in closest]
        )

    async def handle_find_value(
        self, request: pb.FindValueRequest, observed_host: str
    ) -> pb.FindValueResponse:
        self._refuse_oversize(request, MAX_CARD_BYTES + 4 * MAX_KEY_CHARS + 16, observed_host)
        sender = self._sender(request.sender, observed_host)
        if len(request.key) > MAX_KEY_CHARS:
            why = f"key is longer than {MAX_KEY_CHARS} characters"
            raise self._refuse(Rejection("bad-request", why), sender, observed_host)
        records = [record_to_proto(r) for r in self._storage.get(request.key)]
        closest = self._book.routing.closest(
            key_id(request.key), self._config.k, exclude=sender.peer_id
        )
        return pb.FindValueResponse(
            peer=self._card().to_proto(), records=records, closest=[c.to_proto() for c in closest]
        )

    async def handle_store(self, request: pb.StoreRequest, observed_host: str) -> pb.StoreResponse:
        cfg = self._config
        records = cfg.max_records_per_request * (max_record_bytes() + 8)
        self._refuse_oversize(request, MAX_CARD_BYTES + records + 128, observed_host)
        sender = self._sender(request.sender, observed_host)
        try:
            check_store_request(
                request,
                sender,
                now_ms=int(self._clock() * 1000),
                max_skew_ms=int(cfg.max_clock_skew_s * 1000),
                max_records=cfg.max_records_per_request,
            )
        except Rejection as rejection:
            self._refuse(rejection, sender, observed_host)
            raise
        # Quotas count the network the call came from, not the card's claim: keys are free,
        # addresses are not.
        network = source_network(observed_host, limit_private=cfg.limit_private_subnets)
        results: list[pb.StoreResult] = []
        for message in request.records:
            result, forged = self._store(message, sender, network, observed_host)
            results.append(result)
            if forged:
                # Honest nodes relay only records they checked: a forged signature marks
                # the whole request, and the rest is refused unread, so that a flood of
                # forgeries (free to make, a check each to refuse) costs a call a check.
                unread = pb.StoreResult(stored=False, reason=UNREAD)
                results += [unread] * (len(request.records) - len(results))
                break
        return pb.StoreResponse(peer=self._card().to_proto(), results=results)

    def _store(
        self, message: pb.Record, sender: Contact, network: str, observed_host: str
    ) -> tuple[pb.StoreResult, bool]:
        """The result of storing one record, and whether its signature was forged."""
        try:
            record = record_from_proto(message)
            # The gate last, once quotas and the signature passed: a proof of work not
            # seen before costs a share of the network's checks, and a made-up record
            # must cost none of them.
            stored = self._storage.put(
                record,
                sender=sender.peer_id,
                network=network,
                admit=functools.partial(self._gates.refusal, network=network),
            )
        except Rejection as rejection:
            self._refuse(rejection, sender, observed_host)
            forged = rejection.code == "bad-signature"
            return pb.StoreResult(stored=False, reason=rejection.reason), forged
        reason = "" if stored else "a newer record is stored"
        return pb.StoreResult(stored=stored, reason=reason), False
