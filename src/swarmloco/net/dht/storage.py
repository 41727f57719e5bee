"""What one DHT node stores for others: validated records under quotas, until they expire.

Every record goes through ``records.validate`` (schema, ownership, signature) before it is
kept, but the quota checks run first, so a flood of records costs a node a dictionary
lookup and the decoding of a small value each (what a record costs in memory is counted
with its value), not a signature verification each. A guarded swarm's gate (a proof of
work, a certificate) is asked last, of signed records only.

A key costs nothing to make, so quotas that count signers alone do not bind anyone: one
sender can store records owned by thousands of fresh keys. What costs an attacker is an
address, so the quotas also count the *source network* a record came from (the caller's
/24 or /64, see ``endpoints.source_network``), and prefer *first-hand* records, stored by their
owner itself, over relayed ones (stored by anyone else: honest nodes relay when they hand
a newcomer the records of its neighbourhood, Kademlia section 2.5). Limits:

- per key: at most the kind's ``max_subkeys`` subkeys, of which at most
  ``max_subkeys_per_network`` came from one source network. A first-hand record that
  finds no room takes the place of a record that has less claim to it: when its own
  network is at that cap, of the network's oldest relayed record; when the key is full, of
  the oldest record (relayed ones first) of the network that holds the most subkeys under
  the key, provided that network holds more than the record's own. An owner's own record
  therefore always finds room under a key unless its network already holds as many
  subkeys there as any other;
- per sender, per owner, per source network: at most ``max_records_per_sender``,
  ``max_records_per_owner`` and ``max_records_per_network`` records in all keys;
- per source network: at most ``max_bytes_per_network`` bytes;
- per node: at most ``max_records`` records and ``max_bytes`` bytes in all;
- per record: expiration clamped to the kind's max TTL from now.

Bytes are memory (:func:`~swarmloco.net.records.held_bytes`: the record's Python objects,
its decoded value's and its place in the indexes), not encoded size, which undercounts a
small record's cost about five times.

For one (key, subkey), a record with a later expiration replaces an earlier one (this is
how owners update values); an older or equal one is not stored. A record is only ever
evicted for one whose signature checked.

Reads list a key's records interleaved across the networks they came from, first-hand
first: a node handing them to a newcomer, which caps what one network hands it, hands over
a share of every source instead of the first few hundred of whoever stored the most.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar

from swarmloco.core.config import require_int
from swarmloco.net.records import (
    Record,
    RecordKind,
    check_shape,
    check_signature,
    decode_value,
    effective_expiration,
    held_bytes,
)
from swarmloco.net.rejections import Rejection

T = TypeVar("T")

LOCAL_NETWORK = "local"
"""The source network of the records a node stores for itself."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class StorageConfig:
    max_records: int = 65_536
    """Most records one node keeps for others."""
    max_bytes: int = 32 * 1024 * 1024
    """Most bytes of memory one node's records for others take (``held_bytes``: about
    1.2 KB for a ``peers`` entry, 3-6 KB for a ``status``): room for the records of a swarm
    of a thousand peers or two, and what a flood can make a node hold."""
    max_bytes_per_network: int = 8 * 1024 * 1024
    """Most of those bytes that came from one source network: four networks are needed to
    fill a node."""
    max_records_per_sender: int = 4096
    """Most records one node keeps on behalf of one sending peer. A node hands a newcomer
    every record of its neighbourhood it holds (in a small swarm, everyone's: a peer's
    progress and status, and a ``round/<r>`` and ``digest/<r>`` per recent round), so this
    bounds a flood, not what an honest neighbour hands over."""
    max_records_per_owner: int = 4096
    """Most records one node keeps owned by one key, whoever sent them. An honest peer owns
    a ``peers``, ``progress`` and ``status`` entry and one ``round/<r>`` and ``digest/<r>``
    entry per round still alive: a few dozen at rounds of a few seconds, a few thousand
    at sub-second rounds on one machine."""
    max_records_per_network: int = 16_384
    """Most records one node keeps that came from one source network (a /24 or /64; a
    loopback or private address alone), whoever signed and sent them: with the default
    ``max_records``, four networks are needed to fill a node."""
    max_subkeys_per_network: int = 256
    """Most subkeys of one key that came from one source network: with the 4,096 subkeys
    of a ``peers`` key, sixteen networks are needed to fill it, and first-hand records
    still displace theirs then. More honest peers than this behind one address or /24 (one
    NAT, one lab) are not all listed by one node, so it is set well above what a lab
    runs."""

    def __post_init__(self) -> None:
        require_int("max_records", self.max_records, minimum=1)
        require_int("max_bytes", self.max_bytes, minimum=1024)
        require_int("max_bytes_per_network", self.max_bytes_per_network, minimum=1024)
        require_int("max_records_per_sender", self.max_records_per_sender, minimum=1)
        require_int("max_records_per_owner", self.max_records_per_owner, minimum=1)
        require_int("max_records_per_network", self.max_records_per_network, minimum=1)
        require_int("max_subkeys_per_network", self.max_subkeys_per_network, minimum=1)


@dataclasses.dataclass(slots=True)
class _Stored:
    record: Record
    value: Any  # decoded and checked
    expires_at: float  # clamped
    sender: bytes
    network: str
    owner: str  # the owner's peer id in hex; empty for unowned kinds
    first_hand: bool  # stored by its owner itself
    held: int = 0  # bytes of memory it takes (held_bytes)


class _Shelf:
    """The records under one key, by subkey and by the source network they came from
    (each network's in the order they were stored)."""

    __slots__ = ("by_network", "subkeys")

    def __init__(self) -> None:
        self.subkeys: dict[str, _Stored] = {}
        self.by_network: dict[str, dict[str, _Stored]] = {}

    def __len__(self) -> int:
        return len(self.subkeys)

    def count(self, network: str) -> int:
        return len(self.by_network.get(network, ()))

    def add(self, stored: _Stored) -> None:
        self.subkeys[stored.record.subkey] = stored
        self.by_network.setdefault(stored.network, {})[stored.record.subkey] = stored

    def remove(self, stored: _Stored) -> None:
        subkey = stored.record.subkey
        del self.subkeys[subkey]
        group = self.by_network[stored.network]
        del group[subkey]
        if not group:
            del self.by_network[stored.network]

    def oldest(self, network: str, *, relayed_only: bool) -> _Stored | None:
        """The record of ``network`` stored longest ago, relayed ones first."""
        group = self.by_network.get(network, {})
        relayed = next((s for s in group.values() if not s.first_hand), None)
        if relayed is not None or relayed_only:
            return relayed
        return next(iter(group.values()), None)

    def displaceable(self, network: str) -> _Stored | None:
        """What a first-hand record from ``network`` may take the place of in a full key:
        the oldest record (relayed first) of the network holding the most subkeys, if it
        holds more than ``network`` does."""
        largest = max(self.by_network, key=lambda n: len(self.by_network[n]))
        if self.count(largest) <= self.count(network):
            return None
        return self.oldest(largest, relayed_only=False)

    def interleaved(self) -> list[_Stored]:
        """Every record, taking one per network in turn, first-hand before relayed."""
        queues = [
            sorted(group.values(), key=lambda s: not s.first_hand)
            for group in self.by_network.values()
        ]
        rounds = itertools.zip_longest(*queues)
        return [stored for turn in rounds for stored in turn if stored is not None]


class Storage:
    """Records held by one node. ``clock`` is wall-clock time (record expirations)."""

    def __init__(self, config: StorageConfig, *, clock: Callable[[], float]) -> None:
        self.config = config
        self._clock = clock
        self._data: dict[str, _Shelf] = {}
        self._per_sender: Counter[bytes] = Counter()
        self._per_owner: Counter[str] = Counter()
        self._per_network: Counter[str] = Counter()
        self._bytes_per_network: Counter[str] = Counter()
        self._count = 0
        self._bytes = 0
        self._last_sweep = float("-inf")
        self.evicted = 0
        """Records that gave up their place to a first-hand record."""

    def __len__(self) -> int:
        return self._count

    def keys(self) -> list[str]:
        """The keys this node holds records under (expired ones may linger until swept)."""
        return list(self._data)

    @property
    def bytes_used(self) -> int:
        """Bytes of memory the records held take (``held_bytes``)."""
        return self._bytes

    def records_from(self, sender: bytes) -> int:
        return self._per_sender[sender]

    def records_owned_by(self, owner: str) -> int:
        """Records owned by the peer id ``owner`` (hex)."""
        return self._per_owner[owner]

    def records_via(self, network: str, *, key: str | None = None) -> int:
        """Records that came from ``network`` (under ``key`` only, when given)."""
        if key is None:
            return self._per_network[network]
        shelf = self._data.get(key)
        return shelf.count(network) if shelf else 0

    def put(
        self,
        record: Record,
        *,
        sender: bytes,
        network: str,
        admit: Callable[[Record, Any], Rejection | None] | None = None,
    ) -> bool:
        """Store ``record`` for ``sender``, whose call came from ``network``
        (``endpoints.source_network``; :data:`LOCAL_NETWORK` for this node's own records);
        False if a newer one is already stored (True if this very record is).
        ``admit(record, value)`` says why a record that passed everything else must not be
        stored (a private swarm's gate: the costliest check, made last).

        Raises :class:`Rejection` when the record is invalid, over a quota or not admitted.
        """
        now = self._clock()
        kind = check_shape(record, now=now)
        shelf = self._data.get(record.key)
        existing = shelf.subkeys.get(record.subkey) if shelf else None
        if existing is not None:
            self._drop_if_expired(existing, now)
            shelf = self._data.get(record.key)
            existing = shelf.subkeys.get(record.subkey) if shelf else None
        if existing is not None and record == existing.record:
            return True  # a republished copy of what we hold
        if existing is not None and record.expiration <= existing.record.expiration:
            return False
        # Decoded before the quotas (what it costs is counted with its value), checked
        # after them: a refused record never costs a signature check.
        value = decode_value(kind, record.key, record.value)
        stored = _Stored(
            record,
            value,
            effective_expiration(kind, record.expiration, now=now),
            sender,
            network,
            owner=record.subkey if kind.owned else "",
            first_hand=kind.owned and record.subkey == sender.hex(),
            held=held_bytes(record, value),
        )
        victim = self._make_room(stored, kind, replacing=existing, now=now)
        check_signature(kind, record)
        refused = admit(record, value) if admit is not None else None
        if refused is not None:
            raise refused
        if existing is not None:
            self._forget(existing)
        if victim is not None:
            self._forget(victim)
            self.evicted += 1
        self._data.setdefault(record.key, _Shelf()).add(stored)
        self._per_sender[sender] += 1
        self._per_network[network] += 1
        if stored.owner:
            self._per_owner[stored.owner] += 1
        self._count += 1
        self._bytes += stored.held
        self._bytes_per_network[network] += stored.held
        return True

    def _make_room(
        self, new: _Stored, kind: RecordKind, *, replacing: _Stored | None, now: float
    ) -> _Stored | None:
        """The record ``new`` takes the place of (None: there is room); Rejection when
        it is over a quota."""
        outcome = self._room(new, kind, replacing)
        if isinstance(outcome, Rejection) and now - self._last_sweep >= 1.0:
            # Expired records still count until swept: sweep before refusing, but at most
            # once a second, so that a flood of records cannot make every refusal O(n).
            self.sweep(now=now)
            outcome = self._room(new, kind, replacing)
        if isinstance(outcome, Rejection):
            raise outcome
        return outcome

    def _room(
        self, new: _Stored, kind: RecordKind, replacing: _Stored | None
    ) -> _Stored | Rejection | None:
        cfg = self.config
        record, network = new.record, new.network
        shelf = self._data.get(record.key) or _Shelf()
        victim: _Stored | None = None

        def over(held: int, cap: int, same: Callable[[_Stored], bool]) -> bool:
            """Whether storing ``new`` takes a count that stands at ``held`` past ``cap``,
            given the records it takes the place of (``same``: those in the count)."""
            if replacing is not None and same(replacing):
                return False  # it takes its own earlier record's place in this count
            return held - int(victim is not None and same(victim)) >= cap

        def same_network(s: _Stored) -> bool:
            return s.network == network

        network_cap = min(kind.max_subkeys, cfg.max_subkeys_per_network)
        if over(shelf.count(network), network_cap, same_network):
            victim = shelf.oldest(network, relayed_only=True) if new.first_hand else None
            if victim is None:
                return Rejection(
                    "network-quota",
                    f"record not stored: this key already holds {network_cap} records "
                    f"from your network ({network})",
                )
        elif over(len(shelf), kind.max_subkeys, lambda _: True):
            victim = shelf.displaceable(network) if new.first_hand else None
            if victim is None:
                return Rejection(
                    "quota", f"record not stored: key already holds {kind.max_subkeys} subkeys"
                )
        if over(
            self._per_sender[new.sender],
            cfg.max_records_per_sender,
            lambda s: s.sender == new.sender,
        ):
            limit = cfg.max_records_per_sender
            return Rejection(
                "quota", f"record not stored: this node keeps at most {limit} records per sender"
            )
        if new.owner and over(
            self._per_owner[new.owner], cfg.max_records_per_owner, lambda s: s.owner == new.owner
        ):
            limit = cfg.max_records_per_owner
            return Rejection(
                "owner-quota",
                f"record not stored: this node keeps at most {limit} records per owner",
            )
        if over(self._per_network[network], cfg.max_records_per_network, same_network):
            limit = cfg.max_records_per_network
            return Rejection(
                "network-quota",
                f"record not stored: this node keeps at most {limit} records from one "
                f"network ({network})",
            )
        if over(self._count, cfg.max_records, lambda _: True):
            return Rejection(
                "quota", f"record not stored: this node is full ({cfg.max_records} records)"
            )
        freed = [s for s in (replacing, victim) if s is not None]
        released = sum(s.held for s in freed if s.network == network)
        if self._bytes_per_network[network] - released + new.held > cfg.max_bytes_per_network:
            limit = cfg.max_bytes_per_network
            return Rejection(
                "network-quota",
                f"record not stored: this node keeps at most {limit} bytes from one network "
                f"({network})",
            )
        if self._bytes - sum(s.held for s in freed) + new.held > cfg.max_bytes:
            return Rejection(
                "quota", f"record not stored: this node is full ({cfg.max_bytes} bytes)"
            )
        return victim

    def get(self, key: str) -> list[Record]:
        """The live records under ``key`` (all subkeys), interleaved across source networks."""
        return [record for record, _ in self.entries(key)]

    def entries(self, key: str) -> list[tuple[Record, Any]]:
        """The live records under ``key`` with their decoded values, interleaved across the
        networks they came from."""
        shelf = self._data.get(key)
        if not shelf:
            return []
        now = self._clock()
        for stored in list(shelf.subkeys.values()):
            self._drop_if_expired(stored, now)
        shelf = self._data.get(key)
        if not shelf:
            return []
        return [(stored.record, stored.value) for stored in shelf.interleaved()]

    def expires_at(self, key: str, subkey: str) -> float | None:
        """When this node drops the record (its expiration clamped to the max TTL)."""
        shelf = self._data.get(key)
        stored = shelf.subkeys.get(subkey) if shelf else None
        return None if stored is None else stored.expires_at

    def sweep(self, *, now: float | None = None) -> int:
        """Drop every expired record; return how many."""
        self._last_sweep = self._clock()
        now = self._last_sweep if now is None else now
        dropped = 0
        for shelf in list(self._data.values()):
            for stored in list(shelf.subkeys.values()):
                dropped += self._drop_if_expired(stored, now)
        return dropped

    def _drop_if_expired(self, stored: _Stored, now: float) -> int:
        if stored.expires_at > now:
            return 0
        self._forget(stored)
        return 1

    def _forget(self, stored: _Stored) -> None:
        key = stored.record.key
        shelf = self._data[key]
        shelf.remove(stored)
        if not shelf:
            del self._data[key]
        _release(self._per_sender, stored.sender)
        _release(self._per_network, stored.network)
        if stored.owner:
            _release(self._per_owner, stored.owner)
        self._count -= 1
        self._bytes -= stored.held
        _release(self._bytes_per_network, stored.network, stored.held)


def _release(counter: Counter[T], item: T, amount: int = 1) -> None:
    counter[item] -= amount
    if not counter[item]:
        del counter[item]
