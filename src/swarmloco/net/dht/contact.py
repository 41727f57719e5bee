"""Contacts: a peer's self-signed card (id, public key, endpoint, start time, TLS key).

Every contact on the wire is a ``PeerInfo`` signed by the key it names, and the node id is
derived from that key, so a peer can neither claim someone else's id nor point another
peer's id at its own address. Verifying a card is cached: the same cards come back in
almost every lookup response.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import msgpack

from swarmloco.net.endpoints import MAX_ENDPOINT_CHARS, parse_endpoint
from swarmloco.net.identity import (
    PUBLIC_KEY_BYTES,
    SIGNATURE_BYTES,
    Identity,
    peer_id_of,
    verify,
)
from swarmloco.net.rejections import Rejection
from swarmloco.net.tls import FINGERPRINT_BYTES
from swarmloco.proto.v1 import dht_pb2 as pb

_CARD_DOMAIN = b"swarmloco/v1/peer-info\x00"


@dataclasses.dataclass(frozen=True, slots=True)
class Contact:
    """A verified contact card. ``endpoint`` is empty for client-mode peers."""

    peer_id: bytes
    public_key: bytes
    endpoint: str
    started_at_ms: int
    signature: bytes
    tls_fingerprint: bytes = b""
    """SHA-256 of the key of the TLS certificate it serves with (empty: no TLS)."""

    @property
    def host(self) -> str:
        return parse_endpoint(self.endpoint)[0]

    @property
    def reachable(self) -> bool:
        return bool(self.endpoint)

    def to_proto(self) -> pb.PeerInfo:
        return pb.PeerInfo(
            public_key=self.public_key,
            endpoint=self.endpoint,
            started_at_ms=self.started_at_ms,
            signature=self.signature,
            tls_fingerprint=self.tls_fingerprint,
        )

    def __str__(self) -> str:
        return f"{self.peer_id.hex()[:12]}@{self.endpoint or 'client'}"


def _card_payload(endpoint: str, started_at_ms: int, tls_fingerprint: bytes) -> bytes:
    return msgpack.packb([endpoint, started_at_ms, tls_fingerprint])


def sign_card(
    identity: Identity,
    endpoint: str,
    *,
    started_at_ms: int | None = None,
    tls_fingerprint: bytes = b"",
) -> Contact:
    """This peer's own card (``started_at_ms`` defaults to now)."""
    started = int(time.time() * 1000) if started_at_ms is None else started_at_ms
    payload = _card_payload(endpoint, started, tls_fingerprint)
    signature = identity.sign(_CARD_DOMAIN, payload)
    return Contact(
        identity.peer_id, identity.public_key, endpoint, started, signature, tls_fingerprint
    )


@functools.lru_cache(maxsize=8192)
def _checked_card(
    public_key: bytes, endpoint: str, started_at_ms: int, signature: bytes, tls_fingerprint: bytes
) -> Contact:
    # Cached whole: every lookup response repeats the same few dozen cards. Only valid
    # cards are kept (a Rejection is raised, not cached: a liar can vary its cards at will,
    # so remembering them would only spend memory), and only after every field's length
    # was checked: an entry is at most 32 + 262 + 64 + 32 bytes of fields, a peer id and
    # the objects around them, about 1 KiB, so 8 MiB for the whole cache.
    if endpoint:
        try:
            parse_endpoint(endpoint)
        except ValueError:
            raise Rejection(
                "bad-contact", f"contact endpoint {endpoint[:80]!r} is not HOST:PORT"
            ) from None
    payload = _card_payload(endpoint, started_at_ms, tls_fingerprint)
    if not verify(public_key, signature, _CARD_DOMAIN, payload):
        raise Rejection("bad-contact", "contact card is not signed by the key it names")
    return Contact(
        peer_id_of(public_key), public_key, endpoint, started_at_ms, signature, tls_fingerprint
    )


MAX_CARD_BYTES = 2048
"""The largest serialized card accepted: every field at its longest (an endpoint of 262
characters of up to 4 bytes each) with room to spare. Checked first, because reading a
bytes or string field of a message copies it, however long it is."""


def contact_from_proto(info: pb.PeerInfo) -> Contact:
    """Check a card from the network; Rejection when it is malformed or not self-signed."""
    size = info.ByteSize()
    if size > MAX_CARD_BYTES:
        raise Rejection(
            "bad-contact", f"contact card is {size} bytes; a card is at most {MAX_CARD_BYTES}"
        )
    if (
        len(info.endpoint) > MAX_ENDPOINT_CHARS
        or len(info.public_key) != PUBLIC_KEY_BYTES
        or len(info.signature) != SIGNATURE_BYTES
        or len(info.tls_fingerprint) not in (0, FINGERPRINT_BYTES)
    ):
        raise Rejection(
            "bad-contact",
            f"contact card is malformed (a {PUBLIC_KEY_BYTES}-byte key, a "
            f"{SIGNATURE_BYTES}-byte signature, an endpoint of at most {MAX_ENDPOINT_CHARS} "
            f"characters and a TLS fingerprint of 0 or {FINGERPRINT_BYTES} bytes; got "
            f"{len(info.public_key)}, {len(info.signature)}, {len(info.endpoint)} and "
            f"{len(info.tls_fingerprint)})",
        )
    return _checked_card(
        info.public_key, info.endpoint, info.started_at_ms, info.signature, info.tls_fingerprint
    )


def distance(a: bytes, b: bytes) -> int:
    """Kademlia's XOR metric."""
    return int.from_bytes(a, "big") ^ int.from_bytes(b, "big")
