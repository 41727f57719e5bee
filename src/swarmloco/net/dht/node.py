"""A Kademlia DHT node: iterative parallel lookups, store, get, and the upkeep of its tables.

The node is transport-agnostic: it sends through a :class:`DhtTransport` and answers as a
:class:`DhtHandler`, so the same code runs over gRPC and over the in-memory network of
simulations. It is an async context manager that owns a TaskGroup with its background
work (bucket refresh, republishing its own records, pinging quiet contacts, dropping
expired records); leaving the context cancels all of it.

The node is the composition of parts that each own one job:

- :mod:`~swarmloco.net.dht.book`: the contacts it knows, and every call to one of them;
- :mod:`~swarmloco.net.dht.lookup`: iterative lookups toward a node id or a key;
- :mod:`~swarmloco.net.dht.requests`: other nodes' calls, admitted or refused;
- :mod:`~swarmloco.net.dht.replication`: records handed to newcomers;
- :mod:`~swarmloco.net.dht.joining`: the peers it joins through, and what their clocks say;
- :mod:`~swarmloco.net.dht.gates`: the private swarms whose records it guards;
- :mod:`~swarmloco.net.dht.storage`: the records it holds, within quotas per sender.

What stays here is what ties them together: joining, storing and getting, republishing the
node's own records, and the background upkeep.

Everything a node receives is checked before it is used: contact cards must be signed by
the key they name, store requests by their sender, records by their owner; each refusal
is logged and counted once in ``rejections``.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from swarmloco.core.config import require_positive
from swarmloco.errors import NetworkError
from swarmloco.net.deadline import Deadline
from swarmloco.net.dht.book import ContactBook, ContactCallback, ContactHooks
from swarmloco.net.dht.config import DHT_MESSAGE_BYTES, DhtConfig
from swarmloco.net.dht.contact import Contact, distance, sign_card
from swarmloco.net.dht.gates import SwarmGates
from swarmloco.net.dht.joining import (
    Answer,
    EntryPeers,
    check_clock,
    low_median,
    network_votes,
)
from swarmloco.net.dht.lookup import Entry, GetResult, LookupResult, Lookups
from swarmloco.net.dht.replication import Replicator, store_batches
from swarmloco.net.dht.requests import Requests
from swarmloco.net.dht.routing import RoutingTable
from swarmloco.net.dht.storage import LOCAL_NETWORK, Storage
from swarmloco.net.dht.transport import DhtTransport
from swarmloco.net.dht.wire import key_id, signed_store_request
from swarmloco.net.endpoints import endpoint_network, format_endpoint, is_ip_address
from swarmloco.net.identity import PEER_ID_BYTES, Identity
from swarmloco.net.records import CheckedRecords, Record, kind_of, make_record, validate
from swarmloco.net.rejections import Rejection, RejectionLog
from swarmloco.proto.v1 import dht_pb2 as pb

if TYPE_CHECKING:
    from swarmloco.net.admission import Gate

__all__ = [
    "DHT_MESSAGE_BYTES",
    "DHTNode",
    "DhtConfig",
    "Entry",
    "GetResult",
    "LookupResult",
    "store_batches",
]

logger = logging.getLogger(__name__)


class DHTNode:
    """One Kademlia node. Construct, then ``async with node: await node.join(peers)``."""

    def __init__(
        self,
        *,
        identity: Identity,
        transport: DhtTransport,
        config: DhtConfig | None = None,
        endpoint: str = "",
        clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
        on_contact_added: ContactCallback | None = None,
        on_contact_removed: ContactCallback | None = None,
        on_card: ContactCallback | None = None,
        tls_fingerprint: bytes = b"",
    ) -> None:
        """``on_card`` sees every verified card, ours excepted (e.g. to learn the TLS keys
        of addresses); ``tls_fingerprint`` goes into our own card."""
        self.identity = identity
        self.config = cfg = config or DhtConfig()
        self._local_clock = clock
        self.clock_skew_s = 0.0
        """How far the entry peers' clocks were ahead of ours when this node joined (the
        median): :meth:`clock` adds it, so that this node keeps the swarm's time."""
        self._transport = transport
        self._rng = rng or random.Random()
        self._tls_fingerprint = tls_fingerprint
        self.routing = RoutingTable(
            identity.peer_id,
            k=cfg.k,
            max_per_subnet=cfg.max_per_subnet,
            limit_private_subnets=cfg.limit_private_subnets,
        )
        self.storage = Storage(cfg.storage, clock=self.clock)
        self.rejections = RejectionLog(logger)
        self.checked = CheckedRecords(max_bytes=cfg.checked_records_bytes)
        self.stats: Counter[str] = Counter()
        self.card = sign_card(identity, endpoint, tls_fingerprint=tls_fingerprint)
        self._published: dict[tuple[str, str], Record] = {}
        self._group: asyncio.TaskGroup | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._gates = SwarmGates()
        self._book = ContactBook(
            routing=self.routing,
            config=cfg,
            rejections=self.rejections,
            stats=self.stats,
            hooks=ContactHooks(
                added=on_contact_added,
                removed=on_contact_removed,
                card=on_card,
                newcomer=self._newcomer,
            ),
        )
        self._assemble(transport)

    def _assemble(self, transport: DhtTransport) -> None:
        """The parts that work through the contact book, each handed what it uses."""
        cfg = self.config
        self._lookups = Lookups(
            config=cfg,
            book=self._book,
            checked=self.checked,
            gates=self._gates,
            rejections=self.rejections,
            stats=self.stats,
            clock=self.clock,
        )
        self._replicator = Replicator(
            config=cfg,
            storage=self.storage,
            book=self._book,
            transport=transport,
            sign=self._signed_store,
            spawn=self._spawn,
            stats=self.stats,
        )
        self._requests = Requests(
            config=cfg,
            book=self._book,
            storage=self.storage,
            gates=self._gates,
            rejections=self.rejections,
            transport=transport,
            card=lambda: self.card,
            clock=self.clock,
            spawn=self._spawn,
        )
        self._entry = EntryPeers(
            config=cfg,
            transport=transport,
            book=self._book,
            local_clock=self._local_clock,
            rng=self._rng,
        )

    # -- lifecycle ---------------------------------------------------------------------

    @property
    def peer_id(self) -> bytes:
        return self.identity.peer_id

    @property
    def endpoint(self) -> str:
        return self.card.endpoint

    def set_endpoint(self, endpoint: str, *, tls_fingerprint: bytes | None = None) -> None:
        """Announce ``endpoint`` (and ``tls_fingerprint``, when given) from now on: a newly
        signed card."""
        if tls_fingerprint is not None:
            self._tls_fingerprint = tls_fingerprint
        self.card = sign_card(self.identity, endpoint, tls_fingerprint=self._tls_fingerprint)

    async def __aenter__(self) -> DHTNode:
        group = asyncio.TaskGroup()
        await group.__aenter__()
        self._group = group
        cfg = self.config
        self._spawn(self._every(cfg.refresh_interval_s / 4, self.refresh_buckets))
        self._spawn(self._every(cfg.republish_interval_s, self.republish))
        self._spawn(self._every(cfg.liveness_interval_s / 2, self.check_liveness))
        self._spawn(self._every(cfg.sweep_interval_s, self._sweep))
        self._spawn(self._every(cfg.rejoin_interval_s, self._rejoin_if_alone))
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any
    ) -> None:
        group, self._group = self._group, None
        assert group is not None
        for task in list(self._tasks):
            task.cancel()
        # Tell the group only about a cancellation: it must see that to handle it, but any
        # other error of the body would come back wrapped in an ExceptionGroup, and callers
        # should get the NetworkError they can handle, not a group.
        try:
            if exc_type is not None and issubclass(exc_type, asyncio.CancelledError):
                await group.__aexit__(exc_type, exc, tb)
            else:
                await group.__aexit__(None, None, None)
        finally:
            self.checked.close()

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        if self._group is None:
            work.close()
            return
        task = self._group.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _every(self, interval: float, work: Callable[[], Awaitable[object]]) -> None:
        while True:
            # Jitter so that the nodes of a simulation do not all wake together.
            await asyncio.sleep(interval * self._rng.uniform(0.8, 1.2))
            await work()

    async def _sweep(self) -> None:
        self.storage.sweep()

    @property
    def joined_through(self) -> Mapping[str, str]:
        """Address -> the peer id (hex) that answered this node's join there (its last
        join; empty before it joined, or when it started the network)."""
        return self._entry.answered

    async def _rejoin_if_alone(self) -> None:
        """Every contact failed (a frozen process finds all its calls timed out when it
        wakes): without a contact no lookup can reach anyone, so join again through the
        peers the node first joined through."""
        if len(self.routing) > 0 or not self._entry.endpoints:
            return
        self.stats["rejoins"] += 1
        try:
            answered = await self.join(self._entry.endpoints)
        except NetworkError as exc:
            logger.warning("lost every DHT contact and cannot join again yet: %s", exc)
            return
        logger.info("lost every DHT contact; joined again through %d peer(s)", answered)

    # -- joining -----------------------------------------------------------------------

    async def join(
        self,
        peers: Sequence[str],
        *,
        timeout: float | None = None,
        announce_port: int | None = None,
    ) -> int:
        """Enter the network through ``peers`` (HOST:PORT); return how many answered.

        Every address is pinged at once. Once one answers, the others get
        ``join_grace_s`` more to answer too (a dead address costs that, not the whole join
        timeout). With ``announce_port``, the node learns its own host from how the first
        peer that answers sees it and announces ``that-host:announce_port``. Raises
        NetworkError naming every address and why it failed when none answers within the
        join timeout, or when this machine's clock is too far off theirs.
        """
        request = pb.PingRequest(sender=self.card.to_proto())
        budget = timeout or self.config.join_timeout_s
        answered = await self._entry.ask(peers, request, budget=budget)
        verdict = check_clock(
            [a.offset for a in answered if a.response.time_ms], config=self.config
        )
        if verdict.skew is not None:
            self.clock_skew_s = verdict.skew
        if verdict.warning is not None:
            logger.warning("%s", verdict.warning)
        first = answered[0].response
        # The address the entry peer saw us at becomes our card's: only an IP address.
        if announce_port is not None and is_ip_address(first.observed_host):
            self.set_endpoint(format_endpoint(first.observed_host, announce_port))
        # Looking ourselves up fills our buckets near us and tells those nodes about us.
        await self.find_nodes(self.peer_id)
        await self._ask_the_time(answered, request, refusal=verdict.refusal)
        return len(answered)

    async def _ask_the_time(
        self, answered: Sequence[Answer], request: pb.PingRequest, *, refusal: str | None
    ) -> None:
        """Ask the time of up to ``clock_sample`` contacts, one per source network no entry
        peer is on, and keep the median of one vote per network, the entry peers' included:
        entry peers whose clocks are off, or who lie about them, are outvoted (SECURITY.md,
        "Time from the entry peers"). ``refusal``: why the entry peers' time alone would
        stop this node (they put its clock further off than records tolerate); it stands
        when no other network answers. Raises NetworkError when the peers of many networks
        put this machine's clock further off than records tolerate."""
        entry = [(endpoint_network(a.endpoint), a.offset) for a in answered if a.response.time_ms]
        sampled = await self._sample_clocks(entry, request)
        if not sampled:
            if refusal is not None:
                raise NetworkError(refusal)
            return
        votes = network_votes([*entry, *sampled])
        verdict = check_clock(votes, config=self.config, whose="networks whose peers it asked")
        if verdict.refusal is not None:
            raise NetworkError(verdict.refusal)
        wider = verdict.skew
        assert wider is not None
        said = low_median([offset for _, offset in entry])
        if refusal is None and abs(wider - self.clock_skew_s) <= self.config.warn_clock_skew_s:
            return
        logger.warning(
            "the %d peer(s) this node joined through put the swarm's time %+.0f s from this "
            "machine's clock; the peers of %d networks in all put it %+.0f s from it: keeping "
            "theirs (an entry peer's clock is wrong, or it lied about it)",
            len(answered), said, len(votes), wider,
        )  # fmt: skip
        self.clock_skew_s = wider

    async def _sample_clocks(
        self, entry: Sequence[tuple[str, float]], request: pb.PingRequest
    ) -> list[tuple[str, float]]:
        """The clock offsets of up to ``clock_sample`` contacts, one per source network no
        entry peer is on (``entry``: the entry peers' networks and offsets)."""
        if self.config.clock_sample <= 0 or not entry:
            return []
        networks = {network for network, _ in entry}
        contacts = [c for c in self.routing if c.endpoint]
        self._rng.shuffle(contacts)
        asked: list[str] = []
        for contact in contacts:
            network = endpoint_network(contact.endpoint)
            if network not in networks and len(asked) < self.config.clock_sample:
                networks.add(network)
                asked.append(contact.endpoint)
        return await self._entry.clocks(asked, request) if asked else []

    def clock(self) -> float:
        """The swarm's time: this machine's clock corrected by how far the peers it joined
        through are ahead of it. Records, their expiry and every timestamp compared across
        peers (progress reports, digests) use it, so that a clock a little off (under
        ``max_clock_skew_s``) costs nothing; further off, joining is refused."""
        return self._local_clock() + self.clock_skew_s

    # -- the public API ----------------------------------------------------------------

    async def store(self, key: str, value: Any, *, ttl: float, subkey: str = "") -> int:
        """Encode, sign (owned kinds) and store ``value`` under ``key`` for ``ttl`` seconds.

        The node republishes it until it expires. Returns how many nodes (itself
        included) stored it; ValueError when the value does not fit the key's schema.
        """
        require_positive("ttl", ttl)
        value = self._gates.with_membership(key, value)
        try:
            record = make_record(
                key, value, expiration=self.clock() + ttl, owner=self.identity, subkey=subkey
            )
        except Rejection as rejection:
            raise ValueError(rejection.reason) from None
        return await self.store_record(record)

    async def store_record(
        self, record: Record, *, republish: bool = True, timeout: float | None = None
    ) -> int:
        """Store a ready (signed) record on the k closest nodes; return how many took it."""
        try:
            validate(record, now=self.clock())
        except Rejection as rejection:
            raise ValueError(f"refusing to publish an invalid record: {rejection.reason}") from None
        if republish:
            self._published[(record.key, record.subkey)] = record
        deadline = Deadline.after(timeout or self.config.lookup_timeout_s)
        target = key_id(record.key)
        lookup = await self.find_nodes(target, deadline=deadline)
        targets = lookup.closest
        stored = 0
        far = distance(targets[-1].peer_id, target) if len(targets) >= self.config.k else None
        if self.card.reachable and (far is None or distance(self.peer_id, target) < far):
            stored += self._put_local(record)
        request = self._signed_store([record])
        answers = await asyncio.gather(
            *(self._book.call(c, self._transport.store, request, deadline) for c in targets)
        )
        stored += sum(1 for a in answers if a is not None and a.results and a.results[0].stored)
        self.stats["stores"] += 1
        return stored

    def _signed_store(self, records: list[Record]) -> pb.StoreRequest:
        return signed_store_request(
            self.identity, self.card, records, timestamp_ms=int(self.clock() * 1000)
        )

    def _put_local(self, record: Record) -> int:
        try:
            return int(self.storage.put(record, sender=self.peer_id, network=LOCAL_NETWORK))
        except Rejection as rejection:
            logger.warning("own record not stored locally: %s", rejection.reason)
            return 0

    async def get(self, key: str, *, timeout: float | None = None) -> GetResult:
        """All live subkeys of ``key`` from the nodes closest to it (and ourselves)."""
        try:
            kind_of(key)
        except Rejection as rejection:
            raise ValueError(rejection.reason) from None
        deadline = Deadline.after(timeout or self.config.lookup_timeout_s)
        lookup = self._lookups.start(key_id(key))
        for record, value in self.storage.entries(key):
            if self.gate(record, value) is not None:
                continue
            lookup.merge(Entry(record.subkey, value, record.expiration, record))
            lookup.hops = 0
        request = pb.FindValueRequest(sender=self.card.to_proto(), key=key)
        await self._lookups.run(lookup, deadline, self._transport.find_value, request)
        self.stats["gets"] += 1
        return GetResult(lookup.entries, lookup.rejected, len(lookup.responded), lookup.hops)

    async def find_nodes(self, target: bytes, *, deadline: Deadline | None = None) -> LookupResult:
        """The k nodes closest to ``target`` that answer (an iterative FIND_NODE)."""
        if len(target) != PEER_ID_BYTES:
            raise ValueError(f"ids are {PEER_ID_BYTES} bytes")
        lookup = self._lookups.start(target)
        if target in self.routing:
            lookup.hops = 0
        request = pb.FindNodeRequest(sender=self.card.to_proto(), target=target)
        await self._lookups.run(
            lookup,
            deadline or Deadline.after(self.config.lookup_timeout_s),
            self._transport.find_node,
            request,
        )
        return LookupResult(lookup.closest_responded(), len(lookup.responded), lookup.hops)

    # -- private swarms ------------------------------------------------------------------

    def admit(self, admission: Gate) -> None:
        """Guard the records of ``admission``'s swarm: this node's gets drop, and it does
        not store, owned records whose owner shows no valid membership certificate; its own
        records of that swarm carry its certificate."""
        self._gates.admit(admission)

    def guards(self, swarm_id: str) -> bool:
        """Whether :meth:`admit` guards ``swarm_id``'s records."""
        return self._gates.guards(swarm_id)

    def gate(self, record: Record, value: Any) -> Rejection | None:
        """Why a valid record must be ignored here (None: it may be used)."""
        return self._gates.refusal(record, value)

    # -- upkeep --------------------------------------------------------------------------

    async def refresh_buckets(self, *, older_than: float | None = None) -> None:
        """Look up a random id in every bucket without a lookup for ``older_than`` seconds
        (default: the refresh interval)."""
        interval = self.config.refresh_interval_s if older_than is None else older_than
        stale = self.routing.buckets_to_refresh(now=time.monotonic(), interval=interval)
        for index in stale:
            await self.find_nodes(self.routing.random_id_in_bucket(index, self._rng))

    async def republish(self) -> int:
        """Store our own live records again (on nodes that joined since); return how many."""
        now = self.clock()
        count = 0
        for slot, record in list(self._published.items()):
            if record.expiration <= now:
                del self._published[slot]
                continue
            if await self.store_record(record, republish=False):
                count += 1
        return count

    def forget_published(self, key: str, subkey: str) -> None:
        """Stop republishing a record (it still lives until its expiration)."""
        self._published.pop((key, subkey), None)

    async def check_liveness(self, *, older_than: float | None = None) -> None:
        """Ping contacts not heard from for ``older_than`` seconds (default: the liveness
        interval); drop those that fail."""
        quiet = self.routing.stale(
            now=time.monotonic(),
            older_than=self.config.liveness_interval_s if older_than is None else older_than,
            limit=self.config.k,
        )
        request = pb.PingRequest(sender=self.card.to_proto())
        deadline = Deadline.after(self.config.rpc_timeout_s)
        await asyncio.gather(
            *(self._book.call(c, self._transport.ping, request, deadline) for c in quiet)
        )

    # -- contacts ----------------------------------------------------------------------

    def unreachable(self, peer_id: bytes) -> bool:
        """Whether a call to this contact failed within ``unreachable_s`` (and it has not
        been heard from since)."""
        return self._book.unreachable(peer_id)

    def _failed(self, contact: Contact, why: str, *, blame: bool = True) -> None:
        """Drop a contact whose call failed (as a failed call would)."""
        self._book.failed(contact, why, blame=blame)

    def _newcomer(self, contact: Contact) -> None:
        self._replicator.offer(contact)

    # -- handlers (DhtHandler) -----------------------------------------------------------

    async def handle_ping(self, request: pb.PingRequest, observed_host: str) -> pb.PingResponse:
        return await self._requests.handle_ping(request, observed_host)

    async def handle_find_node(
        self, request: pb.FindNodeRequest, observed_host: str
    ) -> pb.FindNodeResponse:
        return await self._requests.handle_find_node(request, observed_host)

    async def handle_find_value(
        self, request: pb.FindValueRequest, observed_host: str
    ) -> pb.FindValueResponse:
        return await self._requests.handle_find_value(request, observed_host)

    async def handle_store(self, request: pb.StoreRequest, observed_host: str) -> pb.StoreResponse:
        return await self._requests.handle_store(request, observed_host)
