"""The one place that knows DHT record kinds: key names, value schemas, ownership, limits.

A record is ``(key, subkey, value, expiration)``. Keys are namespaced by swarm id:
``swarmloco/v1/<swarm id>/<name>``, and each *name* belongs to one :class:`RecordKind`
that says

- what the value must look like (msgpack checked against a :class:`Schema`: a float where
  an int belongs, an unknown field or a string that is too long is rejected);
- whether subkeys are *owned*: the subkey is then the owner's peer id in hex and the record
  must carry the owner's public key and signature over key, subkey, value and expiration;
- the longest a record may live (expirations further ahead are clamped by storage), the
  largest value and the most subkeys a node keeps under one key.

Kinds defined here: ``manifest`` (the content-addressed swarm manifest: its hash must be
the swarm id), ``peers`` (one signed entry per peer: endpoint, role, version, public) and
``round/<r>`` (one signed entry per peer ready to average round r: endpoint, weight,
bandwidth, client mode, announce time). Later layers add theirs (``progress``,
``status``, ``partners``, ``digest/<r>``, the pipeline's ``stage-load``) by defining a
:class:`RecordKind` here and calling :func:`register`.

Every record from the network passes :func:`validate` before it is stored or used; the
cheap checks run first and the signature check last. :class:`CheckedRecords` remembers
which records passed, for readers that get the same ones again and again.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import math
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgpack

from swarmloco.core.agreement import DIGEST_BYTES
from swarmloco.core.manifest import MAX_MANIFEST_BYTES, check_swarm_id, swarm_id_of
from swarmloco.core.pacing import ProgressReport
from swarmloco.net.identity import (
    PUBLIC_KEY_BYTES,
    SIGNATURE_BYTES,
    Identity,
    peer_id_of,
    verify,
)
from swarmloco.net.rejections import Rejection

KEY_PREFIX = "swarmloco/v1/"
MAX_KEY_CHARS = 160
MAX_SUBKEY_CHARS = 64
_SIGNATURE_DOMAIN = b"swarmloco/v1/record\x00"
_OWNED_SUBKEY = re.compile(r"[0-9a-f]{40}")
_KEY = re.compile(r"swarmloco/v1/([0-9a-f]{40})/([a-z0-9/_-]{1,64})")


# -- value schemas -------------------------------------------------------------------------


class SchemaError(ValueError):
    """A value does not match its schema (the message names the field)."""


class Schema(abc.ABC):
    """A check of one decoded msgpack value. Subclasses raise SchemaError with the path."""

    @abc.abstractmethod
    def check(self, value: Any, where: str) -> None: ...


@dataclasses.dataclass(frozen=True)
class Int(Schema):
    """An integer (never a bool or a float) in [minimum, maximum]."""

    minimum: int = -(2**63)
    maximum: int = 2**63 - 1

    def check(self, value: Any, where: str) -> None:
        if type(value) is not int:
            raise SchemaError(f"{where} must be an integer, got {type(value).__name__}")
        if not self.minimum <= value <= self.maximum:
            raise SchemaError(f"{where} = {value} is outside [{self.minimum}, {self.maximum}]")


@dataclasses.dataclass(frozen=True)
class Float(Schema):
    """A finite float (msgpack float32/64; an integer is not accepted) in [minimum, maximum]."""

    minimum: float = -math.inf
    maximum: float = math.inf

    def check(self, value: Any, where: str) -> None:
        if type(value) is not float:
            raise SchemaError(f"{where} must be a float, got {type(value).__name__}")
        if not math.isfinite(value) or not self.minimum <= value <= self.maximum:
            raise SchemaError(f"{where} = {value} is outside [{self.minimum}, {self.maximum}]")


@dataclasses.dataclass(frozen=True)
class Bool(Schema):
    def check(self, value: Any, where: str) -> None:
        if type(value) is not bool:
            raise SchemaError(f"{where} must be a bool, got {type(value).__name__}")


@dataclasses.dataclass(frozen=True)
class Str(Schema):
    """A string of at most ``max_chars`` characters, optionally matching ``pattern``."""

    max_chars: int
    pattern: str | None = None
    choices: frozenset[str] | None = None

    def check(self, value: Any, where: str) -> None:
        if type(value) is not str:
            raise SchemaError(f"{where} must be a string, got {type(value).__name__}")
        if len(value) > self.max_chars:
            raise SchemaError(f"{where} is {len(value)} characters; at most {self.max_chars}")
        if self.pattern is not None and not re.fullmatch(self.pattern, value):
            raise SchemaError(f"{where} = {value!r} does not match {self.pattern}")
        if self.choices is not None and value not in self.choices:
            raise SchemaError(f"{where} = {value!r} is not one of {sorted(self.choices)}")


@dataclasses.dataclass(frozen=True)
class Bin(Schema):
    """Raw bytes (msgpack bin) of at least ``min_bytes`` and at most ``max_bytes``."""

    max_bytes: int
    min_bytes: int = 0

    def check(self, value: Any, where: str) -> None:
        if type(value) is not bytes:
            raise SchemaError(f"{where} must be bytes, got {type(value).__name__}")
        if len(value) > self.max_bytes:
            raise SchemaError(f"{where} is {len(value)} bytes; at most {self.max_bytes}")
        if len(value) < self.min_bytes:
            raise SchemaError(f"{where} is {len(value)} bytes; at least {self.min_bytes}")


@dataclasses.dataclass(frozen=True)
class ListOf(Schema):
    """A list of ``min_items`` to ``max_items`` items, each matching ``item`` (a pair its
    reader unpacks says ``min_items=2``: one item fewer would stop the reader)."""

    item: Schema
    max_items: int
    min_items: int = 0

    def check(self, value: Any, where: str) -> None:
        if type(value) is not list:
            raise SchemaError(f"{where} must be a list, got {type(value).__name__}")
        if len(value) > self.max_items:
            raise SchemaError(f"{where} has {len(value)} items; at most {self.max_items}")
        if len(value) < self.min_items:
            raise SchemaError(f"{where} has {len(value)} items; at least {self.min_items}")
        for i, item in enumerate(value):
            self.item.check(item, f"{where}[{i}]")


@dataclasses.dataclass(frozen=True)
class Struct(Schema):
    """A map with exactly these string keys (those in ``optional`` may be missing).

    Unknown fields are rejected: a v1 peer must understand every field it stores. A new
    field means a new record kind (or a new key prefix), so old peers never mis-read it.
    """

    fields: Mapping[str, Schema]
    optional: frozenset[str] = frozenset()

    def check(self, value: Any, where: str) -> None:
        if type(value) is not dict:
            raise SchemaError(f"{where} must be a map, got {type(value).__name__}")
        unknown = [k for k in value if k not in self.fields]
        if unknown:
            raise SchemaError(f"{where} has unknown fields {sorted(map(str, unknown))}")
        for name, schema in self.fields.items():
            if name in value:
                schema.check(value[name], f"{where}.{name}")
            elif name not in self.optional:
                raise SchemaError(f"{where} lacks the field {name!r}")


MEMBER_FIELD = "member"
"""The optional field of every owned record value: the owner's membership certificate
of a private swarm (``net/admission.py``)."""
_MEMBER = Bin(192)


def owned_value(fields: Mapping[str, Schema], optional: frozenset[str] = frozenset()) -> Struct:
    """The schema of an owned record's value: ``fields`` and the optional ``member``."""
    return Struct({**fields, MEMBER_FIELD: _MEMBER}, optional=optional | {MEMBER_FIELD})


# -- record kinds ---------------------------------------------------------------------------

# (swarm id, the match of the kind's pattern against the key name, decoded value) -> None;
# raises Rejection for what the schema cannot express (e.g. a content hash).
ExtraCheck = Callable[[str, "re.Match[str]", Any], None]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RecordKind:
    """The rules for the records under one kind of key name."""

    name: str
    """Human name for messages, e.g. ``peers`` or ``round/<r>``."""
    pattern: str
    """Regular expression the key name (after ``swarmloco/v1/<swarm id>/``) must fullmatch."""
    schema: Schema
    """What the decoded msgpack value must look like."""
    owned: bool
    """Subkeys are owners' peer ids (hex) and records carry the owner's signature."""
    max_ttl: float
    """Longest a record may live (seconds); storage clamps later expirations to this."""
    max_value_bytes: int
    """Largest encoded value."""
    max_subkeys: int = 1
    """Most subkeys one node keeps under one key of this kind."""
    subkey_pattern: str = ""
    """For unowned kinds: what a subkey must fullmatch (default: only the empty subkey)."""
    extra_check: ExtraCheck | None = None
    """Checks the schema cannot express (e.g. a content hash)."""

    def __post_init__(self) -> None:
        if self.max_ttl <= 0 or self.max_value_bytes <= 0 or self.max_subkeys < 1:
            raise ValueError(f"record kind {self.name}: limits must be positive")
        re.compile(self.pattern)


_KINDS: list[RecordKind] = []


def register(kind: RecordKind) -> RecordKind:
    """Make ``kind`` known to every validator in this process (names must not overlap)."""
    for known in _KINDS:
        if known.name == kind.name:
            raise ValueError(f"record kind {kind.name} is already registered")
    _KINDS.append(kind)
    return kind


def max_record_bytes() -> int:
    """The largest a record of any registered kind can be on the wire: its kind's largest
    value, the longest key and subkey (4 bytes a character at most), a key, a signature,
    an expiration and the field tags."""
    largest = max((kind.max_value_bytes for kind in _KINDS), default=0)
    return largest + 4 * (MAX_KEY_CHARS + MAX_SUBKEY_CHARS) + 256


def swarm_key(swarm_id: str, name: str) -> str:
    """The DHT key of record ``name`` (e.g. ``peers``) of swarm ``swarm_id``."""
    key = f"{KEY_PREFIX}{check_swarm_id(swarm_id)}/{name}"
    if not _KEY.fullmatch(key):
        raise ValueError(f"{name!r} is not a valid record name")
    return key


def kind_of(key: str) -> tuple[RecordKind, str, re.Match[str]]:
    """The kind of ``key``, its swarm id and the match of the name; Rejection if unknown."""
    if len(key) > MAX_KEY_CHARS:
        raise Rejection("bad-key", f"record key is {len(key)} characters; at most {MAX_KEY_CHARS}")
    parts = _KEY.fullmatch(key)
    if parts is None:
        raise Rejection("bad-key", f"record key {key[:80]!r} is not swarmloco/v1/<swarm id>/<name>")
    swarm_id, name = parts.group(1), parts.group(2)
    for kind in _KINDS:
        match = re.fullmatch(kind.pattern, name)
        if match is not None:
            return kind, swarm_id, match
    raise Rejection("unknown-kind", f"no record kind is called {name!r}")


# -- records --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Record:
    """One record as it travels: the value is encoded msgpack."""

    key: str
    subkey: str
    value: bytes
    expiration: float
    owner_public_key: bytes = b""
    signature: bytes = b""

    def signing_payload(self) -> bytes:
        return signing_payload(self.key, self.subkey, self.value, self.expiration)

    @property
    def size(self) -> int:
        """Bytes this record takes on the wire (roughly): what a node holding it costs in
        memory is :func:`held_bytes`."""
        return len(self.key) + len(self.subkey) + len(self.value) + 96


BOOKKEEPING_BYTES = 400
"""What a node's indexes take per record it holds (entries in a few dictionaries and
counters, and the small object that ties them together), measured with tracemalloc."""


def held_bytes(record: Record, value: Any) -> int:
    """Bytes of memory a node spends holding ``record`` with its decoded ``value``: the
    Python objects of its fields and of the value, and :data:`BOOKKEEPING_BYTES`. A small
    record takes about five times its size on the wire, so quotas in encoded bytes would
    undercount what a flood of records costs; these are what storage counts."""
    fields = (record.key, record.subkey, record.value, record.owner_public_key, record.signature)
    return (
        sys.getsizeof(record)
        + sum(sys.getsizeof(field) for field in fields)
        + _deep_size(value)
        + BOOKKEEPING_BYTES
    )


def _deep_size(value: Any) -> int:
    """The bytes of a decoded msgpack value's own objects (dicts, lists, strings, numbers);
    not those it shares with every other value: map keys (msgpack interns them), None,
    booleans and small integers."""
    total = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if item is None or isinstance(item, bool) or (type(item) is int and -5 <= item <= 256):
            continue
        total += sys.getsizeof(item)
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return total


def signing_payload(key: str, subkey: str, value: bytes, expiration: float) -> bytes:
    """What an owner signs: every field that gives the record its meaning."""
    return msgpack.packb([key, subkey, value, float(expiration)], use_bin_type=True)


def encode_value(key: str, value: Any) -> bytes:
    """msgpack-encode ``value`` for ``key``, checking it against the kind's schema first.

    Raises ValueError (with the field) when the value would be rejected by other peers.
    """
    kind, swarm_id, match = kind_of(key)
    kind.schema.check(value, kind.name)
    data: bytes = msgpack.packb(value, use_bin_type=True)
    if len(data) > kind.max_value_bytes:
        raise ValueError(f"{kind.name} value is {len(data)} bytes; at most {kind.max_value_bytes}")
    if kind.extra_check is not None:
        try:
            kind.extra_check(swarm_id, match, value)
        except Rejection as rejection:
            raise ValueError(rejection.reason) from None
    return data


def make_record(
    key: str, value: Any, *, expiration: float, owner: Identity | None, subkey: str = ""
) -> Record:
    """Encode and (for owned kinds) sign a record. ``owner`` is required for owned kinds."""
    kind, _, _ = kind_of(key)
    data = encode_value(key, value)
    if not kind.owned:
        return Record(key, subkey, data, float(expiration))
    if owner is None:
        raise ValueError(f"{kind.name} records are owned: pass the owner's identity")
    return sign(Record(key, owner.peer_id_hex, data, float(expiration)), owner)


def sign(record: Record, owner: Identity) -> Record:
    """``record`` with ``owner``'s public key and signature over its fields."""
    return dataclasses.replace(
        record,
        owner_public_key=owner.public_key,
        signature=owner.sign(_SIGNATURE_DOMAIN, record.signing_payload()),
    )


def _reject(kind: RecordKind, code: str, reason: str) -> Rejection:
    return Rejection(code, f"{kind.name} record: {reason}")


def check_shape(record: Record, *, now: float) -> RecordKind:
    """The cheap checks (no decoding, no signature): key, subkey, size, expiration."""
    kind, _, _ = kind_of(record.key)
    if kind.owned:
        if not _OWNED_SUBKEY.fullmatch(record.subkey):
            raise _reject(kind, "bad-subkey", "an owned subkey must be the owner's peer id in hex")
        if not record.signature:
            raise _reject(kind, "unsigned", "the owned subkey carries no signature")
        if (
            len(record.owner_public_key) != PUBLIC_KEY_BYTES
            or len(record.signature) != SIGNATURE_BYTES
        ):
            raise _reject(
                kind,
                "bad-signature",
                f"an owned record carries a {PUBLIC_KEY_BYTES}-byte key and a "
                f"{SIGNATURE_BYTES}-byte signature, not {len(record.owner_public_key)} and "
                f"{len(record.signature)} bytes",
            )
    else:
        if len(record.subkey) > MAX_SUBKEY_CHARS or not re.fullmatch(
            kind.subkey_pattern, record.subkey
        ):
            raise _reject(kind, "bad-subkey", f"subkey {record.subkey[:70]!r} is not allowed")
        if record.signature or record.owner_public_key:
            raise _reject(kind, "bad-signature", "an unowned record must not carry a signature")
    if len(record.value) > kind.max_value_bytes:
        raise _reject(
            kind, "oversize", f"value is {len(record.value)} bytes; at most {kind.max_value_bytes}"
        )
    if not math.isfinite(record.expiration):
        raise _reject(kind, "bad-expiration", "expiration is not a finite number")
    if record.expiration <= now:
        raise _reject(kind, "expired", "the record has already expired")
    return kind


def _reject_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not allowed")


def decode_value(kind: RecordKind, key: str, data: bytes) -> Any:
    """Decode msgpack ``data`` and check it against ``kind``; Rejection if it fails."""
    try:
        value = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            ext_hook=_reject_ext,
            timestamp=0,
        )
    except Exception as exc:  # msgpack raises many types on malformed input
        raise _reject(kind, "bad-msgpack", f"value is not valid msgpack ({exc})") from None
    try:
        kind.schema.check(value, kind.name)
    except SchemaError as exc:
        raise _reject(kind, "schema", str(exc)) from None
    if kind.extra_check is not None:
        parts = _KEY.fullmatch(key)
        assert parts is not None  # kind_of accepted the key
        match = re.fullmatch(kind.pattern, parts.group(2))
        assert match is not None
        kind.extra_check(parts.group(1), match, value)
    return value


def check_signature(kind: RecordKind, record: Record) -> None:
    """For owned kinds: the owner's key derives the subkey and signed these exact fields."""
    if not kind.owned:
        return
    if peer_id_of(record.owner_public_key).hex() != record.subkey:
        raise _reject(kind, "bad-signature", "the public key does not belong to the subkey's owner")
    if not verify(
        record.owner_public_key, record.signature, _SIGNATURE_DOMAIN, record.signing_payload()
    ):
        raise _reject(kind, "bad-signature", "the signature does not match the record")


def validate(record: Record, *, now: float) -> Any:
    """Check everything about a record from the network; return its decoded value.

    Raises :class:`Rejection` (with a code) on the first failure. Expirations beyond the
    kind's max TTL are *not* rejected here: storage clamps them (see ``effective_expiration``).
    """
    kind = check_shape(record, now=now)
    value = decode_value(kind, record.key, record.value)
    check_signature(kind, record)
    return value


INLINE_CHECKS = 32
"""Records not seen before that :class:`CheckedRecords` checks on the caller's thread (3
ms of signatures at most); more go to its checking thread."""


class CheckedRecords:
    """Records that passed :func:`validate`, with their values, remembered up to
    ``max_bytes`` of memory (:func:`held_bytes`; the oldest are forgotten first).

    A reader polling a key (the swarm's ``peers``, a round's entries) gets the same records
    from every node it asks, time after time, and a key may hold thousands: a record seen
    before costs a dictionary lookup and the cheap checks (it may have expired since), not
    a decoding and a signature check. More than :data:`INLINE_CHECKS` records not seen
    before are checked in a thread of its own (:meth:`close` ends it): a full key's are
    thousands of signatures (about 90 us each), which would hold the event loop for a third
    of a second an answer, and the signature check lets go of the interpreter while it
    runs.
    """

    def __init__(self, *, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._values: dict[Record, tuple[Any, int]] = {}  # the value, its held bytes
        self._bytes = 0
        self._checker: ThreadPoolExecutor | None = None  # started at the first check

    def close(self) -> None:
        """End the checking thread (waiting for a check it runs); a later check starts
        another."""
        checker, self._checker = self._checker, None
        if checker is not None:
            checker.shutdown(wait=True, cancel_futures=True)

    def __len__(self) -> int:
        return len(self._values)

    async def validate_many(self, records: Sequence[Record], *, now: float) -> list[Any]:
        """:func:`validate` of each record in order, remembered: the value of each, or the
        :class:`Rejection` it met, up to the first refused for anything but its expiry (one
        bad record marks the whole answer that carried it, and bounds the work it costs:
        the records after it are not checked, and not in the list)."""
        unknown = [record for record in records if record not in self._values]
        if len(unknown) <= INLINE_CHECKS:
            outcomes = _validate_in_order(unknown, now)
        else:
            if self._checker is None:
                self._checker = ThreadPoolExecutor(1, thread_name_prefix="record-checks")
            loop = asyncio.get_running_loop()
            outcomes = await loop.run_in_executor(self._checker, _validate_in_order, unknown, now)
        found = dict(zip(unknown, outcomes, strict=False))
        result: list[Any] = []
        for record in records:
            if record in found:
                outcome = found[record]
                if not isinstance(outcome, Rejection):
                    self._remember(record, outcome)
            elif record in self._values:
                try:
                    check_shape(record, now=now)
                    outcome = self._values[record][0]
                except Rejection as rejection:
                    outcome = rejection
            else:  # checked after the bad record that ended the checks
                break
            result.append(outcome)
            if isinstance(outcome, Rejection) and outcome.code != "expired":
                break
        return result

    def _remember(self, record: Record, value: Any) -> None:
        held = held_bytes(record, value)
        if held > self.max_bytes or record in self._values:
            return
        while self._bytes + held > self.max_bytes:
            oldest = next(iter(self._values))
            self._bytes -= self._values.pop(oldest)[1]
        self._values[record] = (value, held)
        self._bytes += held


def _validate_in_order(records: list[Record], now: float) -> list[Any]:
    """Each record's value or :class:`Rejection`, up to the first refused for anything but
    its expiry (run in a worker thread: it touches nothing shared)."""
    outcomes: list[Any] = []
    for record in records:
        try:
            outcomes.append(validate(record, now=now))
        except Rejection as rejection:
            outcomes.append(rejection)
            if rejection.code != "expired":
                break
    return outcomes


def effective_expiration(kind: RecordKind, expiration: float, *, now: float) -> float:
    """The expiration a node honours: at most ``max_ttl`` from now."""
    return min(expiration, now + kind.max_ttl)


# -- the kinds of this layer ----------------------------------------------------------------


def _manifest_hash(swarm_id: str, _match: re.Match[str], value: Any) -> None:
    actual = swarm_id_of(value)
    if actual != swarm_id:
        raise Rejection(
            "manifest-mismatch",
            f"the manifest hashes to {actual}, not to the swarm id {swarm_id}: it belongs to "
            "another run or was tampered with",
        )


MANIFEST = register(
    RecordKind(
        name="manifest",
        pattern="manifest",
        # The canonical manifest bytes (core/manifest.py); content-addressed by the key, so
        # anyone may store or re-store it but nobody can change it.
        schema=Bin(MAX_MANIFEST_BYTES),
        owned=False,
        max_ttl=30 * 24 * 3600.0,
        max_value_bytes=MAX_MANIFEST_BYTES + 16,
        extra_check=_manifest_hash,
    )
)

# HOST:PORT where a peer serves gRPC; empty for client-mode peers.
ENDPOINT = Str(262, pattern=r"|[^\s/]{1,255}:[0-9]{1,5}")

PEER_ROLES = frozenset({"bootstrap", "trainer", "client", "dashboard", "left"})
"""``left``: the peer's farewell, stored over its entry when it leaves
(:func:`~swarmloco.net.swarm.withdraw_peer`)."""

PEERS = register(
    RecordKind(
        name="peers",
        pattern="peers",
        schema=owned_value(
            {
                # HOST:PORT where the peer serves gRPC; empty for client-mode peers.
                "endpoint": ENDPOINT,
                "role": Str(16, choices=PEER_ROLES),
                "version": Str(32),
                # Whether the peer accepts inbound connections (serves parts and state).
                "public": Bool(),
            }
        ),
        owned=True,
        max_ttl=24 * 3600.0,
        max_value_bytes=768,
        max_subkeys=4096,
    )
)


def manifest_key(swarm_id: str) -> str:
    return swarm_key(swarm_id, "manifest")


def peers_key(swarm_id: str) -> str:
    return swarm_key(swarm_id, "peers")


PROGRESS = register(
    RecordKind(
        name="progress",
        pattern="progress",
        # One signed entry per training peer, refreshed every few seconds: its work towards
        # the next round, from which every peer estimates when the round is due
        # (core/pacing.py).
        schema=owned_value(
            {
                # The round the peer works towards (its last applied round + 1).
                "round": Int(minimum=0),
                # Tokens processed since its last applied round.
                "tokens": Int(minimum=0),
                # Its recent training rate.
                "tokens_per_s": Float(minimum=0.0),
                # The tokens one of its steps trains on (pacing sums H steps of each
                # peer); optional: peers before it said none.
                "step_tokens": Int(minimum=1),
                # Unix seconds when the report was made.
                "at": Float(minimum=0.0),
            },
            optional=frozenset({"step_tokens"}),
        ),
        owned=True,
        max_ttl=600.0,
        max_value_bytes=512,
        max_subkeys=4096,
    )
)


def progress_key(swarm_id: str) -> str:
    return swarm_key(swarm_id, "progress")


FAREWELL_AT = 0.0
"""The ``at`` of a leaving peer's last progress record: stale at once, so nobody paces on
it, and told apart from a report that merely aged (:func:`is_farewell`)."""


def is_farewell(report: ProgressReport) -> bool:
    """Whether ``report`` is a peer's farewell (it left the swarm)."""
    return report.at == FAREWELL_AT


def progress_report(peer: str, value: Mapping[str, Any]) -> ProgressReport:
    """A validated ``progress`` value (as a DHT get returns it) as a pacing report."""
    return ProgressReport(
        peer=peer,
        round=int(value["round"]),
        tokens=int(value["tokens"]),
        tokens_per_s=float(value["tokens_per_s"]),
        at=float(value["at"]),
        step_tokens=int(value["step_tokens"]) if "step_tokens" in value else None,
    )


# -- the kinds of the averaging layer --------------------------------------------------------

ROUND = register(
    RecordKind(
        name="round/<r>",
        pattern=r"round/(0|[1-9][0-9]{0,18})",
        # One signed entry per peer ready to average round r (net/averaging/matchmaking.py):
        # the serving peer first in the round's order of leadership (a hash of the round
        # and its id, not this announce time) leads the group, the others ask it to.
        schema=owned_value(
            {
                # HOST:PORT where the peer serves gRPC; empty for client-mode peers.
                "endpoint": ENDPOINT,
                # Declared weight (tokens since the last round); the leader caps it.
                "weight": Float(minimum=0.0),
                # Declared reduction bandwidth (bytes/s); 0 in client mode.
                "bandwidth": Float(minimum=0.0),
                "client_mode": Bool(),
                # Unix seconds when the peer announced itself (orders leader candidates).
                "announced_at": Float(minimum=0.0),
                # Padded length of the vector it averages (peers of other sizes are ignored).
                "numel": Int(minimum=0),
                # Set by a leader: 1 while it gathers its group (a leader with partners,
                # which newcomers then ask), then the group's size once formed. A peer that
                # comes later and was not in it waits for the round's result instead of
                # averaging the round again with other latecomers (a split).
                "formed": Int(minimum=1),
            },
            optional=frozenset({"formed"}),
        ),
        owned=True,
        max_ttl=3600.0,
        max_value_bytes=768,
        max_subkeys=4096,
    )
)


def _check_round(round: int) -> None:
    if not isinstance(round, int) or isinstance(round, bool) or not 0 <= round < 10**19:
        raise ValueError(f"a round number is an integer in [0, 10^19), got {round!r}")


def round_key(swarm_id: str, round: int) -> str:
    _check_round(round)
    return swarm_key(swarm_id, f"round/{round}")


DIGEST = register(
    RecordKind(
        name="digest/<r>",
        pattern=r"digest/(0|[1-9][0-9]{0,18})",
        # One signed entry per peer that applied round r: the digest of its global state
        # after the round. The majority digest is the swarm's state (core/agreement.py); a
        # peer that disagrees re-downloads it from a holder of the majority.
        schema=owned_value(
            {
                "digest": Bin(DIGEST_BYTES, min_bytes=DIGEST_BYTES),
                # HOST:PORT where the peer serves its state; empty for client-mode peers.
                "endpoint": ENDPOINT,
                # Unix seconds when the round was applied.
                "at": Float(minimum=0.0),
            }
        ),
        owned=True,
        max_ttl=6 * 3600.0,
        max_value_bytes=640,
        max_subkeys=4096,
    )
)


def digest_key(swarm_id: str, round: int) -> str:
    _check_round(round)
    return swarm_key(swarm_id, f"digest/{round}")


# -- the kinds of the training daemon ----------------------------------------------------------

PEER_STATES = frozenset({"starting", "downloading", "training", "averaging", "stopping", "left"})

ROUND_SUMMARY = Struct(
    {
        "round": Int(minimum=0),
        # Peers in the group (0 when the round aborted).
        "group": Int(minimum=0, maximum=1 << 16),
        # Matchmaking plus exchange, seconds; and of those, matchmaking alone (optional).
        "seconds": Float(minimum=0.0),
        "matchmaking_s": Float(minimum=0.0),
        "bytes_sent": Int(minimum=0),
        "bytes_received": Int(minimum=0),
        # fp32 bytes of the update this peer averaged (the ratio to bytes_sent is the
        # compression the codec gave).
        "payload_bytes": Int(minimum=0),
        "ok": Bool(),
        "at": Float(minimum=0.0),
    },
    optional=frozenset({"matchmaking_s"}),
)

MAX_LEASES = 4
"""Shards one peer leases at once at most (a record listing more is refused)."""

STATUS = register(
    RecordKind(
        name="status",
        pattern="status",
        # One signed entry per training peer, refreshed every few seconds: what the
        # dashboard and `swarmloco status` show. Nothing else reads it.
        schema=owned_value(
            {
                "name": Str(64),
                "state": Str(16, choices=PEER_STATES),
                # The round of its global state, and its inner steps since it started.
                "round": Int(minimum=0),
                "step": Int(minimum=0),
                # Tokens it trained on since it started (all rounds).
                "tokens": Int(minimum=0),
                "tokens_per_s": Float(minimum=0.0),
                # Last inner (training) loss, and the eval loss of the global model at its
                # last round; absent until known.
                "loss": Float(),
                "eval_loss": Float(),
                "device": Str(64),
                # How it fits its step to the device ("micro-batch 8 x 2, checkpointing"),
                # and the model FLOPs utilisation of its training (0-1), where known.
                "fit": Str(64),
                "mfu": Float(minimum=0.0, maximum=1.0),
                "version": Str(32),
                "started_at": Float(minimum=0.0),
                "rounds_applied": Int(minimum=0),
                "rounds_aborted": Int(minimum=0),
                "downloads": Int(minimum=0),
                "last_error": Str(240),
                # Its last rounds, oldest first.
                "rounds": ListOf(ROUND_SUMMARY, max_items=8),
                "at": Float(minimum=0.0),
                # On a pinned dataset: the epoch it reads and what it knows of it (the
                # sequences known to have landed of the dataset's, the shards it leases,
                # those known done, of how many).
                "data": Struct(
                    {
                        "epoch": Int(minimum=0),
                        "landed": Int(minimum=0),
                        "sequences": Int(minimum=0),
                        "leased": Int(minimum=0, maximum=MAX_LEASES),
                        "done": Int(minimum=0),
                        "shards": Int(minimum=0),
                    }
                ),
            },
            optional=frozenset({"loss", "eval_loss", "fit", "mfu", "data"}),
        ),
        owned=True,
        max_ttl=600.0,
        max_value_bytes=2560,
        max_subkeys=4096,
    )
)


def status_key(swarm_id: str) -> str:
    return swarm_key(swarm_id, "status")


MAX_PARTNERS = 16
"""Peers a ``partners`` record names at most."""

PARTNERS = register(
    RecordKind(
        name="partners",
        pattern="partners",
        # One signed entry per training peer: the peers it averaged with in its last rounds
        # (newest first), its own word about its own groups. The dashboard counts a peer's
        # figures when a peer it trusts names it and it names that peer back.
        schema=owned_value(
            {
                "peers": ListOf(Str(40, pattern=r"[0-9a-f]{40}"), max_items=MAX_PARTNERS),
                # The last round it averaged in a group of two or more.
                "round": Int(minimum=0),
                "at": Float(minimum=0.0),
            }
        ),
        owned=True,
        max_ttl=600.0,
        max_value_bytes=1024,
        max_subkeys=4096,
    )
)


def partners_key(swarm_id: str) -> str:
    return swarm_key(swarm_id, "partners")


# -- the kinds of the pipeline layer ---------------------------------------------------------

MAX_STAGES = 256
"""Stages a pipelined run has at most."""

STAGE_LOAD = register(
    RecordKind(
        name="stage-load",
        pattern="stage-load",
        # One signed entry per stage replica of a pipelined run, refreshed every few
        # seconds: where it serves and how fast, from which drivers draw their next hop
        # (pipeline/load.py). A claim, never proof: a driver caps a claimed rate at the
        # best it measured itself.
        schema=owned_value(
            {
                "stage": Int(minimum=0, maximum=MAX_STAGES - 1),
                "endpoint": ENDPOINT,
                # Sequences per second of its compute (forward and backward), recently.
                "rate": Float(minimum=0.0),
                # Micro-batches held between forward and backward, and forwards waiting.
                "queue": Int(minimum=0),
                # More micro-batches it takes before it refuses as busy.
                "free": Int(minimum=0),
                # The round its stage's state is at (the stage averages in rounds of its
                # own); optional: peers before it said none.
                "round": Int(minimum=0),
                # Since it began serving the stage: steps not taken (their gradient held
                # NaN or Inf) and calls refused other than as busy (bad shapes, NaN,
                # absurd values, wrong stage); optional, as "round" is.
                "skipped": Int(minimum=0),
                "refused": Int(minimum=0),
                # A stage-0 peer: the replicas of later stages its audits found answering
                # wrong, which it does not draw now; optional.
                "distrusted": Int(minimum=0),
                # A later stage: drivers' sessions open with it now, and the micro-batches
                # of drivers gone (died or left) since it began serving, which it dropped
                # (at their deadline, or at their session's end) or did not take; optional.
                "drivers": Int(minimum=0),
                "orphaned": Int(minimum=0),
                "at": Float(minimum=0.0),
            },
            optional=frozenset(
                {"round", "skipped", "refused", "distrusted", "drivers", "orphaned"}
            ),
        ),
        owned=True,
        max_ttl=600.0,
        max_value_bytes=512,
        max_subkeys=4096,
    )
)


def stage_load_key(swarm_id: str) -> str:
    return swarm_key(swarm_id, "stage-load")


# -- the kinds of a pinned dataset's leases (dataset/leases.py) ----------------------------------

MAX_DATASET_SHARDS = 1 << 20
"""Shards a pinned dataset has at most."""

LEASES = register(
    RecordKind(
        name="leases",
        pattern="leases",
        # One signed entry per peer training on the run's pinned dataset: the shards it
        # reads, each [epoch, shard] (the tail of one epoch and the start of the next).
        # Live while the record is (renewed while it trains).
        schema=owned_value(
            {
                "shards": ListOf(
                    ListOf(Int(minimum=0, maximum=MAX_DATASET_SHARDS - 1), 2, min_items=2),
                    MAX_LEASES,
                ),
                "at": Float(minimum=0.0),
            }
        ),
        owned=True,
        max_ttl=600.0,
        max_value_bytes=256,
        max_subkeys=4096,
    )
)


def leases_key(swarm_id: str) -> str:
    return swarm_key(swarm_id, "leases")
