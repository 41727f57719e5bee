"""Conversions between DHT protobuf messages and domain objects, and store-request signing.

A store request is signed by its sender because storing nodes charge records to the
sender's quota: without the signature anyone could spend someone else's quota. The
signature covers a timestamp (bounding replays) and every field of every record.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgpack

from swarmloco.net.dht.contact import Contact
from swarmloco.net.identity import PEER_ID_BYTES, SIGNATURE_BYTES, Identity, verify
from swarmloco.net.records import Record, max_record_bytes
from swarmloco.net.rejections import Rejection
from swarmloco.proto.v1 import dht_pb2 as pb

_STORE_DOMAIN = b"swarmloco/v1/store\x00"


def key_id(key: str) -> bytes:
    """Where a key lives in the id space: BLAKE2b-160 of its UTF-8 bytes."""
    return hashlib.blake2b(key.encode("utf-8"), digest_size=PEER_ID_BYTES).digest()


def record_to_proto(record: Record) -> pb.Record:
    return pb.Record(
        key=record.key,
        subkey=record.subkey,
        value=record.value,
        expiration=record.expiration,
        owner_public_key=record.owner_public_key,
        signature=record.signature,
    )


def record_from_proto(message: pb.Record) -> Record:
    """The record a message carries; Rejection ``oversize`` when the message is larger than
    a record of any kind can be (checked before any field is read: reading a bytes or
    string field copies it, however long)."""
    size, limit = message.ByteSize(), max_record_bytes()
    if size > limit:
        raise Rejection("oversize", f"a record of {size} bytes; no kind allows more than {limit}")
    return Record(
        message.key,
        message.subkey,
        message.value,
        message.expiration,
        message.owner_public_key,
        message.signature,
    )


def _store_payload(timestamp_ms: int, records: Sequence[pb.Record]) -> bytes:
    fields = [
        [r.key, r.subkey, r.value, r.expiration, r.owner_public_key, r.signature] for r in records
    ]
    return msgpack.packb([timestamp_ms, fields], use_bin_type=True)


def signed_store_request(
    identity: Identity, card: Contact, records: Sequence[Record], *, timestamp_ms: int
) -> pb.StoreRequest:
    messages = [record_to_proto(r) for r in records]
    return pb.StoreRequest(
        sender=card.to_proto(),
        records=messages,
        timestamp_ms=timestamp_ms,
        signature=identity.sign(_STORE_DOMAIN, _store_payload(timestamp_ms, messages)),
    )


def check_store_request(
    request: pb.StoreRequest, sender: Contact, *, now_ms: int, max_skew_ms: int, max_records: int
) -> None:
    """Raise Rejection unless ``sender`` signed this request recently and it is not too big."""
    if len(request.signature) != SIGNATURE_BYTES:
        raise Rejection(
            "bad-signature",
            f"store request signature is {len(request.signature)} bytes, not {SIGNATURE_BYTES}",
        )
    if len(request.records) > max_records:
        raise Rejection(
            "too-many-records",
            f"store request carries {len(request.records)} records; at most {max_records}",
        )
    if abs(now_ms - request.timestamp_ms) > max_skew_ms:
        raise Rejection(
            "stale-request",
            f"store request is dated {(request.timestamp_ms - now_ms) / 1000:+.0f}s from now "
            f"(more than {max_skew_ms / 1000:.0f}s off: replayed, or the sender's clock is wrong)",
        )
    payload = _store_payload(request.timestamp_ms, request.records)
    if not verify(sender.public_key, request.signature, _STORE_DOMAIN, payload):
        raise Rejection("bad-signature", "store request is not signed by its sender")
