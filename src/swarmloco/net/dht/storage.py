"""What one DHT node stores for others: validated records under quotas, until they expire.

Every record goes through ``records.validate`` (schema, ownership, signature) before it is
kept, but the quota checks run first, so a flood of records costs a node a dictionary
lookup each, not a signature verification each. Limits:

- per key: at most the kind's ``max_subkeys`` subkeys;
- per sender: at most ``max_records_per_sender`` records stored on behalf of one peer
  (the authenticated sender of the store request);
- per node: at most ``max_records`` records and ``max_bytes`` bytes in all;
- per record: expiration clamped to the kind's max TTL from now.

For one (key, subkey), a record with a later expiration replaces an earlier one (this is
how owners update values); an older or equal one is not stored.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from typing import Any

from swarmloco.core.config import require_int
from swarmloco.net.records import (
    Record,
    check_shape,
    check_signature,
    decode_value,
    effective_expiration,
)
from swarmloco.net.rejections import Rejection


@dataclasses.dataclass(frozen=True, kw_only=True)
class StorageConfig:
    max_records: int = 65_536
    """Most records one node keeps for others."""
    max_bytes: int = 64 * 1024 * 1024
    """Most bytes (keys, subkeys, values) one node keeps for others."""
    max_records_per_sender: int = 4096
    """Most records one node keeps on behalf of one sending peer. A node hands a newcomer
    every record of its neighbourhood it holds (in a small swarm, everyone's: a peer's
    progress and status, and a ``round/<r>`` and ``digest/<r>`` per recent round), so this
    bounds a flood, not what an honest neighbour hands over."""

    def __post_init__(self) -> None:
        require_int("max_records", self.max_records, minimum=1)
        require_int("max_bytes", self.max_bytes, minimum=1024)
        require_int("max_records_per_sender", self.max_records_per_sender, minimum=1)


@dataclasses.dataclass(slots=True)
class _Stored:
    record: Record
    value: Any  # decoded and checked
    expires_at: float  # clamped
    sender: bytes


class Storage:
    """Records held by one node. ``clock`` is wall-clock time (record expirations)."""

    def __init__(self, config: StorageConfig, *, clock: Callable[[], float]) -> None:
        self.config = config
        self._clock = clock
        self._data: dict[str, dict[str, _Stored]] = {}
        self._per_sender: Counter[bytes] = Counter()
        self._count = 0
        self._bytes = 0
        self._last_sweep = float("-inf")

    def __len__(self) -> int:
        return self._count

    def keys(self) -> list[str]:
        """The keys this node holds records under (expired ones may linger until swept)."""
        return list(self._data)

    @property
    def bytes_used(self) -> int:
        return self._bytes

    def records_from(self, sender: bytes) -> int:
        return self._per_sender[sender]

    def put(self, record: Record, *, sender: bytes) -> bool:
        """Store ``record`` for ``sender``; False if a newer one is already stored (True if
        this very record is).

        Raises :class:`Rejection` when the record is invalid or over a quota.
        """
        now = self._clock()
        kind = check_shape(record, now=now)
        subkeys = self._data.get(record.key)
        existing = subkeys.get(record.subkey) if subkeys else None
        if existing is not None:
            self._drop_if_expired(record.key, record.subkey, existing, now)
            existing = self._data.get(record.key, {}).get(record.subkey)
        if existing is not None and record == existing.record:
            return True  # a republished copy of what we hold
        if existing is not None and record.expiration <= existing.record.expiration:
            return False
        self._check_quotas(record, kind.max_subkeys, sender, replacing=existing, now=now)
        value = decode_value(kind, record.key, record.value)
        check_signature(kind, record)
        if existing is not None:
            self._forget(record.key, record.subkey, existing)
        expires_at = effective_expiration(kind, record.expiration, now=now)
        stored = _Stored(record, value, expires_at, sender)
        self._data.setdefault(record.key, {})[record.subkey] = stored
        self._per_sender[sender] += 1
        self._count += 1
        self._bytes += record.size
        return True

    def _check_quotas(
        self,
        record: Record,
        max_subkeys: int,
        sender: bytes,
        *,
        replacing: _Stored | None,
        now: float,
    ) -> None:
        def over() -> str | None:
            if replacing is None and len(self._data.get(record.key, ())) >= max_subkeys:
                return f"key already holds {max_subkeys} subkeys"
            if (replacing is None or replacing.sender != sender) and (
                self._per_sender[sender] >= self.config.max_records_per_sender
            ):
                limit = self.config.max_records_per_sender
                return f"this node keeps at most {limit} records per sender"
            if replacing is None and self._count >= self.config.max_records:
                return f"this node is full ({self.config.max_records} records)"
            if self._bytes + record.size > self.config.max_bytes:
                return f"this node is full ({self.config.max_bytes} bytes)"
            return None

        reason = over()
        if reason is not None and now - self._last_sweep >= 1.0:
            # Expired records still count until swept: sweep before refusing, but at most
            # once a second, so that a flood of records cannot make every refusal O(n).
            self.sweep(now=now)
            reason = over()
        if reason is not None:
            raise Rejection("quota", f"record not stored: {reason}")

    def get(self, key: str) -> list[Record]:
        """The live records under ``key`` (all subkeys)."""
        return [record for record, _ in self.entries(key)]

    def entries(self, key: str) -> list[tuple[Record, Any]]:
        """The live records under ``key`` with their decoded values."""
        subkeys = self._data.get(key)
        if not subkeys:
            return []
        now = self._clock()
        for subkey, stored in list(subkeys.items()):
            self._drop_if_expired(key, subkey, stored, now)
        return [(stored.record, stored.value) for stored in self._data.get(key, {}).values()]

    def expires_at(self, key: str, subkey: str) -> float | None:
        """When this node drops the record (its expiration clamped to the max TTL)."""
        stored = self._data.get(key, {}).get(subkey)
        return None if stored is None else stored.expires_at

    def sweep(self, *, now: float | None = None) -> int:
        """Drop every expired record; return how many."""
        self._last_sweep = self._clock()
        now = self._last_sweep if now is None else now
        dropped = 0
        for key, subkeys in list(self._data.items()):
            for subkey, stored in list(subkeys.items()):
                dropped += self._drop_if_expired(key, subkey, stored, now)
        return dropped

    def _drop_if_expired(self, key: str, subkey: str, stored: _Stored, now: float) -> int:
        if stored.expires_at > now:
            return 0
        self._forget(key, subkey, stored)
        return 1

    def _forget(self, key: str, subkey: str, stored: _Stored) -> None:
        subkeys = self._data[key]
        del subkeys[subkey]
        if not subkeys:
            del self._data[key]
        self._per_sender[stored.sender] -= 1
        if not self._per_sender[stored.sender]:
            del self._per_sender[stored.sender]
        self._count -= 1
        self._bytes -= stored.record.size
