"""A Kademlia DHT node: iterative parallel lookups, store, get, and the upkeep of its tables.

The node is transport-agnostic: it sends through a :class:`DhtTransport` and answers as a
:class:`DhtHandler`, so the same code runs over gRPC and over the in-memory network of
simulations. It is an async context manager that owns a TaskGroup with its background
work (bucket refresh, republishing its own records, pinging quiet contacts, dropping
expired records); leaving the context cancels all of it.

Lookups follow Kademlia: keep ``alpha`` queries in flight toward the target, always to
the closest known node not yet asked, until the ``k`` closest known nodes have all
answered or failed. A value lookup (``get``) also stops as soon as it holds records and
the ``get_quorum`` closest nodes known have answered: records are stored at the k
closest nodes, republished by their owners, and handed by the closest holder to any
newcomer that becomes one of the k closest (Kademlia section 2.5), so the closest few
nodes hold every subkey of a key.

Everything a node receives is checked before it is used: contact cards must be signed by
the key they name, store requests by their sender, records by their owner; each refusal
is logged and counted once in ``rejections``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from google.protobuf.message import Message

from swarmloco.core.config import require, require_int, require_positive
from swarmloco.errors import NetworkError
from swarmloco.net.deadline import Deadline
from swarmloco.net.dht.contact import (
    MAX_CARD_BYTES,
    Contact,
    contact_from_proto,
    distance,
    sign_card,
)
from swarmloco.net.dht.routing import Added, RoutingTable
from swarmloco.net.dht.storage import LOCAL_NETWORK, Storage, StorageConfig
from swarmloco.net.dht.transport import DhtTransport
from swarmloco.net.dht.wire import (
    check_store_request,
    key_id,
    record_from_proto,
    record_to_proto,
    signed_store_request,
)
from swarmloco.net.endpoints import format_endpoint, is_ip_address, source_network
from swarmloco.net.heap import release_after
from swarmloco.net.identity import PEER_ID_BYTES, Identity
from swarmloco.net.records import (
    MAX_KEY_CHARS,
    MEMBER_FIELD,
    CheckedRecords,
    Record,
    decode_value,
    kind_of,
    make_record,
    max_record_bytes,
    validate,
)
from swarmloco.net.rejections import Rejection, RejectionLog
from swarmloco.net.tls import TlsMismatch
from swarmloco.proto.v1 import dht_pb2 as pb

if TYPE_CHECKING:
    from swarmloco.net.admission import Gate

logger = logging.getLogger(__name__)

Resp = TypeVar("Resp", bound=Message)
_MAX_REPLICATIONS = 16  # newcomers being handed records at once
_MAX_PENDING_REPLICATIONS = 1024  # newcomers waiting for a hand-off (beyond: republish)
_MAX_UNREACHABLE = 4096  # contacts remembered as unreachable (beyond: not remembered)
_OWN_STALL_S = 1.0  # a failed call this late past its deadline: our own stall, not theirs
_MAX_REPLICATED_KEYS = 4096
ContactCallback = Callable[[Contact], None]

DHT_MESSAGE_BYTES = 1024 * 1024
"""The largest message a node that serves only the DHT (a bootstrap node) receives: a store
request of :attr:`DhtConfig.max_request_bytes` with its framing fits. A training peer's
server takes larger ones (averaging chunks); a DHT-only node has no use for them, and every
byte of a large message is held in memory before it can be refused."""


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


@dataclasses.dataclass(frozen=True)
class _Answer:
    """An entry peer's answer to a join ping, and how far its clock is ahead of ours."""

    response: pb.PingResponse
    offset: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class DhtConfig:
    k: int = 20
    """Bucket size and replication factor: records live on the k closest nodes."""
    alpha: int = 3
    """Queries in flight per lookup."""
    get_quorum: int = 2
    """A get may stop once it has records and this many of the closest nodes answered.
    Records live on the k closest nodes and newcomers are handed theirs on arrival, so the
    closest two hold every subkey unless both lost a store; 3 costs one more tail wait."""
    max_per_subnet: int = 2
    """Contacts per bucket from one /24 (IPv4) or /64 (IPv6)."""
    limit_private_subnets: bool = False
    """Count loopback and private addresses by subnet as public ones are (simulations), in
    the routing table's subnet cap and in storage's quotas per source network. Otherwise
    the routing cap exempts them and storage counts each such address by itself."""
    rpc_timeout_s: float = 2.0
    """Longest wait for one DHT call."""
    lookup_timeout_s: float = 8.0
    """Longest one store or get may take, all its calls included."""
    join_timeout_s: float = 5.0
    """Longest wait for the initial peers to answer."""
    join_grace_s: float = 0.5
    """Once one initial peer answered, how much longer the others get to answer too."""
    refresh_interval_s: float = 600.0
    """A bucket without a lookup for this long is refreshed with a lookup into it."""
    republish_interval_s: float = 600.0
    """How often a node re-stores its own records (they reach nodes that joined since)."""
    liveness_interval_s: float = 120.0
    """Contacts not heard from for this long are pinged and dropped if they fail."""
    unreachable_s: float = 30.0
    """A contact whose call failed is not asked again in lookups for this long when other
    nodes name it (they may not have noticed yet: a frozen or partitioned peer would cost
    every lookup a call timeout); it counts again at once when it calls us or answers."""
    sweep_interval_s: float = 60.0
    """How often expired records are dropped from storage."""
    rejoin_interval_s: float = 5.0
    """A node whose routing table ran empty (every contact failed, e.g. after the process
    was frozen) joins again through the peers it first joined through, this often."""
    max_records_per_request: int = 64
    """Most records in one store request."""
    max_request_bytes: int = 512 * 1024
    """Most bytes of records (``Record.size``) this node puts in one store request it
    sends (a record larger than this goes alone): DHT-only nodes such as a bootstrap node
    receive messages of at most :data:`DHT_MESSAGE_BYTES`."""
    checked_records_bytes: int = 8 * 1024 * 1024
    """Records read from other nodes that a node remembers as checked, in bytes of memory
    (``held_bytes``): a full ``peers`` key (4,096 records, about 5 MiB) read again costs
    lookups, not signature checks."""
    max_clock_skew_s: float = 600.0
    """Store requests dated further from our clock are refused (replays); a node whose
    clock is further off the peers it joins through refuses to start."""
    warn_clock_skew_s: float = 5.0
    """A clock further off the entry peers' than this is warned about (the node keeps the
    swarm's time anyway: :meth:`DHTNode.clock`)."""
    storage: StorageConfig = dataclasses.field(default_factory=StorageConfig)

    def __post_init__(self) -> None:
        require_int("k", self.k, minimum=1)
        require_int("alpha", self.alpha, minimum=1)
        require_int("get_quorum", self.get_quorum, minimum=1)
        require(self.get_quorum <= self.k, "get_quorum must be <= k")
        require_int("max_per_subnet", self.max_per_subnet, minimum=1)
        require_int("max_records_per_request", self.max_records_per_request, minimum=1)
        require_int("max_request_bytes", self.max_request_bytes, minimum=1)
        require_int("checked_records_bytes", self.checked_records_bytes, minimum=0)
        for name in (
            "rpc_timeout_s",
            "lookup_timeout_s",
            "join_timeout_s",
            "join_grace_s",
            "refresh_interval_s",
            "republish_interval_s",
            "liveness_interval_s",
            "unreachable_s",
            "sweep_interval_s",
            "rejoin_interval_s",
            "max_clock_skew_s",
            "warn_clock_skew_s",
        ):
            require_positive(name, getattr(self, name))


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


class _Lookup:
    """The state of one iterative lookup (no I/O)."""

    def __init__(self, node: DHTNode, target: bytes) -> None:
        self.node = node
        self.target = target
        self._target_int = int.from_bytes(target, "big")
        self.candidates: dict[bytes, Contact] = {}
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
        if contact.peer_id in self.candidates or contact.peer_id == self.node.peer_id:
            return
        if not contact.reachable or self.node.unreachable(contact.peer_id):
            return
        self.candidates[contact.peer_id] = contact
        self.depth[contact.peer_id] = depth

    def _best_distance(self) -> int:
        return min(
            (
                int.from_bytes(i, "big") ^ self._target_int
                for i in self.candidates
                if i not in self.failed
            ),
            default=1 << 160,
        )

    def ranked(self) -> list[Contact]:
        live = [c for i, c in self.candidates.items() if i not in self.failed]
        live.sort(key=lambda c: int.from_bytes(c.peer_id, "big") ^ self._target_int)
        return live[: self.node.config.k]

    def next_to_query(self, within: int) -> Contact | None:
        """The closest contact not asked yet among the ``within`` closest known."""
        for contact in self.ranked()[:within]:
            if contact.peer_id not in self.queried:
                return contact
        return None

    def settled(self, quorum: int) -> bool:
        """A get may stop: it holds records and the ``quorum`` closest known answered."""
        if not self.entries:
            return False
        closest = self.ranked()[:quorum]
        return all(c.peer_id in self.responded for c in closest)

    def absorb(
        self, contact: Contact, response: pb.FindNodeResponse | pb.FindValueResponse | None
    ) -> None:
        if response is None:
            self.failed.add(contact.peer_id)
            return
        self.responded[contact.peer_id] = contact
        depth = self.depth[contact.peer_id]
        best = self._best_distance()
        # An honest node sends at most k cards; checking more would let one response
        # make us verify thousands of signatures.
        for info in response.closest[: self.node.config.k]:
            card = self.node._card_from(info, source=contact)
            if card is not None:
                self.offer(card, depth + 1)
        # Kademlia: when an answer brings nobody closer than the closest already seen, ask
        # all of the k closest not yet asked at once instead of alpha at a time.
        self.stalled = self._best_distance() >= best
        if isinstance(response, pb.FindValueResponse):
            now = self.node.clock()
            for message in response.records:
                try:
                    record = record_from_proto(message)
                    known = self.entries.get(record.subkey)
                    checked = known is not None and known.record == record
                    value = None if checked else self.node.checked.validate(record, now=now)
                except Rejection as rejection:
                    if rejection.code == "expired":
                        continue  # clocks differ a little between honest nodes
                    rejection = rejection.from_peer(str(contact))
                    self.node.rejections.record(rejection, str(contact))
                    self.rejected.append(rejection)
                    # Honest nodes store only valid records: one bad record marks the
                    # whole answer as untrustworthy, and bounds the work it costs.
                    break
                if not checked:
                    refused = self.node.gate(record, value)
                    if refused is not None:
                        # Valid, but not from a member of a private swarm: a node that is
                        # no member itself (a bootstrap node) stores it in good faith.
                        self.node.rejections.record(refused.from_peer(str(contact)), str(contact))
                        continue
                    self.merge(Entry(record.subkey, value, record.expiration, record))
                if self.hops is None:
                    self.hops = depth

    def merge(self, entry: Entry) -> None:
        known = self.entries.get(entry.subkey)
        if known is None or entry.expiration > known.expiration:
            self.entries[entry.subkey] = entry

    def closest_responded(self) -> list[Contact]:
        t = self._target_int
        found = sorted(self.responded.values(), key=lambda c: int.from_bytes(c.peer_id, "big") ^ t)
        return found[: self.node.config.k]


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
        self.config = config or DhtConfig()
        self._local_clock = clock
        self.clock_skew_s = 0.0
        """How far the entry peers' clocks were ahead of ours when this node joined (the
        median): :meth:`clock` adds it, so that this node keeps the swarm's time."""
        self._transport = transport
        self._rng = rng or random.Random()
        self._on_added = on_contact_added
        self._on_removed = on_contact_removed
        self._on_card = on_card
        self._tls_fingerprint = tls_fingerprint
        self.routing = RoutingTable(
            identity.peer_id,
            k=self.config.k,
            max_per_subnet=self.config.max_per_subnet,
            limit_private_subnets=self.config.limit_private_subnets,
        )
        self.storage = Storage(self.config.storage, clock=self.clock)
        self.rejections = RejectionLog(logger)
        self.checked = CheckedRecords(max_bytes=self.config.checked_records_bytes)
        self.stats: Counter[str] = Counter()
        self.card = sign_card(identity, endpoint, tls_fingerprint=tls_fingerprint)
        self._published: dict[tuple[str, str], Record] = {}
        self._verifying: set[bytes] = set()
        self._replicating: set[bytes] = set()
        self._unreachable: dict[bytes, float] = {}  # peer id -> until when lookups skip it
        # Bounds concurrent hand-offs; newcomers beyond it wait their turn instead of being
        # skipped (a skipped newcomer would miss its records until the next republish).
        self._replication_slots = asyncio.Semaphore(_MAX_REPLICATIONS)
        self._group: asyncio.TaskGroup | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._entry_points: tuple[str, ...] = ()
        self._gates: dict[str, Gate] = {}

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
        if exc_type is not None and issubclass(exc_type, asyncio.CancelledError):
            await group.__aexit__(exc_type, exc, tb)
        else:
            await group.__aexit__(None, None, None)

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

    async def _rejoin_if_alone(self) -> None:
        """Every contact failed (a frozen process finds all its calls timed out when it
        wakes): without a contact no lookup can reach anyone, so join again through the
        peers the node first joined through."""
        if len(self.routing) > 0 or not self._entry_points:
            return
        self.stats["rejoins"] += 1
        try:
            answered = await self.join(self._entry_points)
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
        join timeout.
        """
        self._entry_points = tuple(peers)
        budget = timeout or self.config.join_timeout_s
        deadline = Deadline.after(budget)
        request = pb.PingRequest(sender=self.card.to_proto())
        pings = [asyncio.ensure_future(self._ping_endpoint(ep, request, deadline)) for ep in peers]
        try:
            pending: set[asyncio.Future[_Answer | str]] = set(pings)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if any(isinstance(f.result(), _Answer) for f in done):
                    break
            if pending:
                await asyncio.wait(pending, timeout=self.config.join_grace_s)
        finally:
            for ping in pings:
                ping.cancel()
        outcomes = [
            p.result() if p.done() and not p.cancelled() else "no answer in time" for p in pings
        ]
        answered = [o for o in outcomes if isinstance(o, _Answer)]
        if not answered:
            reasons = "; ".join(str(why) for why in outcomes)
            raise NetworkError(
                f"cannot join the network: none of {', '.join(peers)} answered within "
                f"{budget:g}s. Check the address, and that `swarmloco bootstrap` or a peer "
                f"runs there and is reachable from this machine. Last errors: {reasons}"
            )
        self._check_clock([a.offset for a in answered if a.response.time_ms])
        first = answered[0].response
        # The address the entry peer saw us at becomes our card's: only an IP address.
        if announce_port is not None and is_ip_address(first.observed_host):
            self.set_endpoint(format_endpoint(first.observed_host, announce_port))
        # Looking ourselves up fills our buckets near us and tells those nodes about us.
        await self.find_nodes(self.peer_id)
        return len(answered)

    def clock(self) -> float:
        """The swarm's time: this machine's clock corrected by how far the peers it joined
        through are ahead of it. Records, their expiry and every timestamp compared across
        peers (progress reports, digests) use it, so that a clock a little off (under
        ``max_clock_skew_s``) costs nothing; further off, joining is refused."""
        return self._local_clock() + self.clock_skew_s

    def _check_clock(self, offsets: Sequence[float]) -> None:
        """Compare our clock with the entry peers' (the median of their offsets, each taken
        at the middle of its ping): refuse to start when it is off by more than records
        tolerate; otherwise keep the swarm's time from now on (:meth:`clock`), and warn
        when the difference is more than network jitter."""
        offsets = sorted(offsets)
        if not offsets:
            return
        skew = offsets[(len(offsets) - 1) // 2]
        if abs(skew) <= self.config.max_clock_skew_s:
            self.clock_skew_s = skew
        if abs(skew) <= self.config.warn_clock_skew_s:
            return
        where = "behind" if skew > 0 else "ahead of"
        message = (
            f"this machine's clock is {abs(skew):.0f} s {where} the clock of the "
            f"{len(offsets)} peer(s) it joined through"
        )
        fix = (
            "set the clock right (enable NTP, e.g. `timedatectl set-ntp true`, or run "
            "chronyd or ntpd) and start again"
        )
        if abs(skew) > self.config.max_clock_skew_s:
            raise NetworkError(
                f"{message}: the swarm refuses records dated more than "
                f"{self.config.max_clock_skew_s:.0f} s off; {fix}"
            )
        logger.warning(
            "%s: this peer keeps the swarm's time from now on (its records and progress are "
            "dated by it), but the machine's clock is wrong; %s",
            message,
            fix,
        )

    async def _ping_endpoint(
        self, endpoint: str, request: pb.PingRequest, deadline: Deadline
    ) -> _Answer | str:
        """Ping until it answers or the join deadline passes (it may still be starting)."""
        pause = 0.1
        while True:
            call_deadline = Deadline.after(deadline.timeout(self.config.rpc_timeout_s))
            try:
                sent = self._local_clock()
                response = await self._transport.ping(endpoint, request, call_deadline)
                offset = response.time_ms / 1000 - (sent + self._local_clock()) / 2
            except TlsMismatch as exc:
                return str(exc)  # asking again would get the same false certificate
            except NetworkError as exc:
                if deadline.remaining() <= pause:
                    return str(exc)
                await asyncio.sleep(pause * self._rng.uniform(0.5, 1.0))
                pause = min(2 * pause, 1.0)
                continue
            contact = self._card_from(response.peer, source=None)
            if contact is None:
                return "its contact card is invalid"
            self._seen(contact)
            return _Answer(response, offset)

    # -- the public API ----------------------------------------------------------------

    async def store(self, key: str, value: Any, *, ttl: float, subkey: str = "") -> int:
        """Encode, sign (owned kinds) and store ``value`` under ``key`` for ``ttl`` seconds.

        The node republishes it until it expires. Returns how many nodes (itself
        included) stored it; ValueError when the value does not fit the key's schema.
        """
        require_positive("ttl", ttl)
        value = self._with_membership(key, value)
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
        request = signed_store_request(
            self.identity, self.card, [record], timestamp_ms=int(self.clock() * 1000)
        )
        answers = await asyncio.gather(
            *(self._call(c, self._transport.store, request, deadline) for c in targets)
        )
        stored += sum(1 for a in answers if a is not None and a.results and a.results[0].stored)
        self.stats["stores"] += 1
        return stored

    def _put_local(self, record: Record) -> int:
        try:
            return int(self.storage.put(record, sender=self.peer_id, network=LOCAL_NETWORK))
        except Rejection as rejection:
            logger.warning("own record not stored locally: %s", rejection.reason)
            return 0

    # -- private swarms ------------------------------------------------------------------

    def admit(self, admission: Gate) -> None:
        """Guard the records of ``admission``'s swarm: this node's gets drop, and it does
        not store, owned records whose owner shows no valid membership certificate; its own
        records of that swarm carry its certificate."""
        self._gates[admission.swarm_id] = admission

    def guards(self, swarm_id: str) -> bool:
        """Whether :meth:`admit` guards ``swarm_id``'s records."""
        return swarm_id in self._gates

    def gate(self, record: Record, value: Any) -> Rejection | None:
        """Why a valid record must be ignored here (None: it may be used)."""
        if not self._gates:
            return None
        kind, swarm_id, _ = kind_of(record.key)
        admission = self._gates.get(swarm_id)
        if admission is None or not kind.owned:
            return None
        try:
            admission.check(record.subkey, value.get(MEMBER_FIELD, b""))
        except Rejection as rejection:
            return Rejection(rejection.code, f"{kind.name} record: {rejection.reason}")
        return None

    def _with_membership(self, key: str, value: Any) -> Any:
        if not self._gates or not isinstance(value, dict):
            return value
        try:
            kind, swarm_id, _ = kind_of(key)
        except Rejection:
            return value  # make_record says what is wrong with the key
        admission = self._gates.get(swarm_id)
        if admission is None or not kind.owned or not admission.own_bytes:
            return value
        return {**value, MEMBER_FIELD: admission.own_bytes}

    async def get(self, key: str, *, timeout: float | None = None) -> GetResult:
        """All live subkeys of ``key`` from the nodes closest to it (and ourselves)."""
        try:
            kind_of(key)
        except Rejection as rejection:
            raise ValueError(rejection.reason) from None
        deadline = Deadline.after(timeout or self.config.lookup_timeout_s)
        lookup = _Lookup(self, key_id(key))
        for record, value in self.storage.entries(key):
            if self.gate(record, value) is not None:
                continue
            lookup.merge(Entry(record.subkey, value, record.expiration, record))
            lookup.hops = 0
        request = pb.FindValueRequest(sender=self.card.to_proto(), key=key)
        await self._run_lookup(lookup, deadline, self._transport.find_value, request)
        self.stats["gets"] += 1
        return GetResult(lookup.entries, lookup.rejected, len(lookup.responded), lookup.hops)

    async def find_nodes(self, target: bytes, *, deadline: Deadline | None = None) -> LookupResult:
        """The k nodes closest to ``target`` that answer (an iterative FIND_NODE)."""
        if len(target) != PEER_ID_BYTES:
            raise ValueError(f"ids are {PEER_ID_BYTES} bytes")
        lookup = _Lookup(self, target)
        if target in self.routing:
            lookup.hops = 0
        request = pb.FindNodeRequest(sender=self.card.to_proto(), target=target)
        await self._run_lookup(
            lookup,
            deadline or Deadline.after(self.config.lookup_timeout_s),
            self._transport.find_node,
            request,
        )
        return LookupResult(lookup.closest_responded(), len(lookup.responded), lookup.hops)

    async def _run_lookup(
        self,
        lookup: _Lookup,
        deadline: Deadline,
        send: Callable[[str, Any, Deadline], Awaitable[Any]],
        request: Message,
    ) -> None:
        for contact in self.routing.closest(lookup.target, self.config.k):
            lookup.offer(contact, depth=1)
        value_lookup = isinstance(request, pb.FindValueRequest)
        inflight: dict[asyncio.Task[Any], Contact] = {}
        try:
            while not (value_lookup and lookup.settled(self.config.get_quorum)):
                # Once a get holds records, only the closest `get_quorum` nodes can still
                # change the outcome: asking farther ones would only cost calls.
                within = (
                    self.config.get_quorum if value_lookup and lookup.entries else self.config.k
                )
                parallel = self.config.k if lookup.stalled else self.config.alpha
                while len(inflight) < parallel:
                    candidate = lookup.next_to_query(within)
                    if candidate is None:
                        break
                    contact = candidate
                    lookup.queried.add(contact.peer_id)
                    inflight[
                        asyncio.ensure_future(self._call(contact, send, request, deadline))
                    ] = contact
                if not inflight:
                    break
                done, _ = await asyncio.wait(
                    inflight, timeout=deadline.remaining(), return_when=asyncio.FIRST_COMPLETED
                )
                if not done:
                    break  # the deadline passed; use what we have
                for task in done:
                    lookup.absorb(inflight.pop(task), task.result())
        finally:
            for task in inflight:
                task.cancel()
            if inflight:
                await asyncio.wait(inflight)
        self.routing.mark_lookup(lookup.target, now=time.monotonic())
        self.stats["lookups"] += 1

    async def _call(
        self,
        contact: Contact,
        send: Callable[[str, Any, Deadline], Awaitable[Resp]],
        request: Message,
        deadline: Deadline,
    ) -> Resp | None:
        """One call to a known contact; None (and the contact dropped) when it fails."""
        call_deadline = Deadline.after(deadline.timeout(self.config.rpc_timeout_s))
        self.stats["calls"] += 1
        try:
            response = await send(contact.endpoint, request, call_deadline)
        except NetworkError as exc:
            # A call that ends well past its deadline did not wait for the contact: this
            # process was stalled or frozen, and the contact may be fine.
            ours = time.monotonic() - call_deadline.at > _OWN_STALL_S
            self._failed(contact, str(exc), blame=not ours)
            return None
        answered_as = self._card_from(response.peer, source=contact)  # type: ignore[attr-defined]
        if answered_as is None or answered_as.peer_id != contact.peer_id:
            self._failed(contact, "another node answers at its endpoint")
            return None
        self._seen(answered_as)
        return response

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
            *(self._call(c, self._transport.ping, request, deadline) for c in quiet)
        )

    # -- contacts ----------------------------------------------------------------------

    def _card_from(self, info: pb.PeerInfo, *, source: Contact | None) -> Contact | None:
        try:
            contact = contact_from_proto(info)
        except Rejection as rejection:
            self.rejections.record(rejection, str(source) if source else "a peer")
            return None
        self._card_seen(contact)
        return contact

    def _card_seen(self, contact: Contact) -> None:
        if self._on_card is not None and contact.peer_id != self.peer_id:
            self._on_card(contact)

    def unreachable(self, peer_id: bytes) -> bool:
        """Whether a call to this contact failed within ``unreachable_s`` (and it has not
        been heard from since)."""
        until = self._unreachable.get(peer_id)
        if until is None:
            return False
        if until > time.monotonic():
            return True
        del self._unreachable[peer_id]
        return False

    def _seen(self, contact: Contact) -> None:
        self._unreachable.pop(contact.peer_id, None)
        added = self.routing.add(contact, now=time.monotonic())
        if added is not Added.NEW:
            return
        if self._on_added is not None:
            self._on_added(contact)
        if len(self.storage) and len(self._replicating) < _MAX_PENDING_REPLICATIONS:
            self._replicating.add(contact.peer_id)
            self._spawn(self._replicate_to(contact))

    async def _replicate_to(self, newcomer: Contact) -> None:
        """Hand a newcomer the records it is now one of the k closest nodes to (Kademlia
        section 2.5), so that gets find them at once instead of after the next republish.

        Every holder that counts the newcomer among the k closest nodes it knows to a key
        sends it, not only the holder closest to the key (the paper's rule to save
        messages): the closest holders often do not know the newcomer (its bucket in their
        table is full) or are newcomers themselves still waiting for the record, and the
        newcomer would then miss it until the next republish. The price is a few
        duplicate stores of small records per join; the receiver drops duplicates. At most
        ``_MAX_REPLICATED_KEYS`` keys are considered per newcomer; beyond that republishing
        alone moves records.
        """
        try:
            async with self._replication_slots:
                await self._hand_off(newcomer)
        finally:
            self._replicating.discard(newcomer.peer_id)

    async def _hand_off(self, newcomer: Contact) -> None:
        records: list[Record] = []
        for key in self.storage.keys()[:_MAX_REPLICATED_KEYS]:
            target = key_id(key)
            others = self.routing.closest(target, self.config.k, exclude=newcomer.peer_id)
            bound = distance(others[-1].peer_id, target) if len(others) >= self.config.k else None
            if bound is None or distance(newcomer.peer_id, target) < bound:
                # Interleaved across the networks they came from: the newcomer takes at
                # most its cap per key from our network, and a flood stored here must
                # not take all of it.
                records.extend(self.storage.get(key))
        deadline = Deadline.after(self.config.lookup_timeout_s)
        for batch in store_batches(
            records, self.config.max_records_per_request, self.config.max_request_bytes
        ):
            request = signed_store_request(
                self.identity, self.card, batch, timestamp_ms=int(self.clock() * 1000)
            )
            if await self._call(newcomer, self._transport.store, request, deadline) is None:
                return
            self.stats["replicated"] += len(batch)

    def _failed(self, contact: Contact, why: str, *, blame: bool = True) -> None:
        """Drop a contact whose call failed; with ``blame``, lookups also skip it for
        ``unreachable_s`` when other nodes name it."""
        self.stats["failed_calls"] += 1
        now = time.monotonic()
        if blame:
            if len(self._unreachable) >= _MAX_UNREACHABLE:
                self._unreachable = {i: t for i, t in self._unreachable.items() if t > now}
            if len(self._unreachable) < _MAX_UNREACHABLE:
                self._unreachable[contact.peer_id] = now + self.config.unreachable_s
        removed, promoted = self.routing.remove(contact.peer_id, now=now)
        if removed is not None:
            logger.debug("dropped contact %s: %s", removed, why)
            if self._on_removed is not None:
                self._on_removed(removed)
        if promoted is not None and self._on_added is not None:
            self._on_added(promoted)

    def _sender(self, info: pb.PeerInfo, observed_host: str) -> Contact:
        """The checked card of a caller; it joins our table if it proves reachable."""
        try:
            contact = contact_from_proto(info)
        except Rejection as rejection:
            self.rejections.record(rejection, observed_host or "a peer")
            raise
        self._card_seen(contact)
        if contact.reachable and contact.peer_id != self.peer_id:
            if contact.host == observed_host:
                self._seen(contact)
            elif contact.peer_id not in self.routing and len(self._verifying) < 32:
                # The card names another host than the one calling: add it only once it
                # answers there, or anyone could aim our traffic at a third party.
                self._verifying.add(contact.peer_id)
                self._spawn(self._verify(contact))
        return contact

    async def _verify(self, contact: Contact) -> None:
        try:
            request = pb.PingRequest(sender=self.card.to_proto())
            await self._call(
                contact, self._transport.ping, request, Deadline.after(self.config.rpc_timeout_s)
            )
        finally:
            self._verifying.discard(contact.peer_id)

    # -- handlers (DhtHandler) -----------------------------------------------------------

    def _refuse_oversize(self, request: Message, limit: int, observed_host: str) -> None:
        """Refuse a request larger than any honest one before any field of it is read:
        reading a bytes or string field of a message copies it, however long, and a few
        copies of megabytes per call leave their mark on the process long after."""
        size = request.ByteSize()
        if size > limit:
            reason = f"{type(request).__name__} of {size} bytes; at most {limit}"
            self.rejections.record(Rejection("oversize", reason), observed_host or "a peer")
            release_after(size)
            # Raised unnamed: an exception held in a local of a frame in its own traceback
            # is a reference cycle, and it would keep the request alive until the cyclic
            # garbage collector ran.
            raise Rejection("oversize", reason)

    async def handle_ping(self, request: pb.PingRequest, observed_host: str) -> pb.PingResponse:
        self._refuse_oversize(request, MAX_CARD_BYTES + 16, observed_host)
        self._sender(request.sender, observed_host)
        return pb.PingResponse(
            peer=self.card.to_proto(),
            observed_host=observed_host,
            time_ms=int(self.clock() * 1000),
        )

    async def handle_find_node(
        self, request: pb.FindNodeRequest, observed_host: str
    ) -> pb.FindNodeResponse:
        self._refuse_oversize(request, MAX_CARD_BYTES + PEER_ID_BYTES + 16, observed_host)
        sender = self._sender(request.sender, observed_host)
        if len(request.target) != PEER_ID_BYTES:
            rejection = Rejection("bad-request", f"find-node target must be {PEER_ID_BYTES} bytes")
            self.rejections.record(rejection, str(sender), source=observed_host)
            raise rejection
        closest = self.routing.closest(request.target, self.config.k, exclude=sender.peer_id)
        return pb.FindNodeResponse(
            peer=self.card.to_proto(), closest=[c.to_proto() for c in closest]
        )

    async def handle_find_value(
        self, request: pb.FindValueRequest, observed_host: str
    ) -> pb.FindValueResponse:
        self._refuse_oversize(request, MAX_CARD_BYTES + 4 * MAX_KEY_CHARS + 16, observed_host)
        sender = self._sender(request.sender, observed_host)
        if len(request.key) > MAX_KEY_CHARS:
            rejection = Rejection("bad-request", f"key is longer than {MAX_KEY_CHARS} characters")
            self.rejections.record(rejection, str(sender), source=observed_host)
            raise rejection
        records = [record_to_proto(r) for r in self.storage.get(request.key)]
        closest = self.routing.closest(key_id(request.key), self.config.k, exclude=sender.peer_id)
        return pb.FindValueResponse(
            peer=self.card.to_proto(), records=records, closest=[c.to_proto() for c in closest]
        )

    async def handle_store(self, request: pb.StoreRequest, observed_host: str) -> pb.StoreResponse:
        records = self.config.max_records_per_request * (max_record_bytes() + 8)
        self._refuse_oversize(request, MAX_CARD_BYTES + records + 128, observed_host)
        sender = self._sender(request.sender, observed_host)
        peer = str(sender)
        try:
            check_store_request(
                request,
                sender,
                now_ms=int(self.clock() * 1000),
                max_skew_ms=int(self.config.max_clock_skew_s * 1000),
                max_records=self.config.max_records_per_request,
            )
        except Rejection as rejection:
            self.rejections.record(rejection, peer, source=observed_host)
            raise
        # Quotas count the network the call came from, not the card's claim: keys are free,
        # addresses are not.
        network = source_network(observed_host, limit_private=self.config.limit_private_subnets)
        results = []
        for message in request.records:
            try:
                record = record_from_proto(message)
                if self._gates:  # storage.put checks the signature; the gate needs the value
                    kind, _, _ = kind_of(record.key)
                    refused = self.gate(record, decode_value(kind, record.key, record.value))
                    if refused is not None:
                        raise refused
                stored = self.storage.put(record, sender=sender.peer_id, network=network)
            except Rejection as rejection:
                self.rejections.record(rejection, peer, source=observed_host)
                results.append(pb.StoreResult(stored=False, reason=rejection.reason))
                continue
            results.append(
                pb.StoreResult(stored=stored, reason="" if stored else "a newer record is stored")
            )
        return pb.StoreResponse(peer=self.card.to_proto(), results=results)
