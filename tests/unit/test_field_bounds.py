"""Every bytes and string field a peer accepts is length-checked before it is used, hashed,
verified or cached; signatures are exactly 64 bytes. Pure checks, no sockets (the same
over real gRPC, with the memory it costs, is in tests/net/test_memory.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time

import pytest

from swarmloco.net.admission import MAX_CERTIFICATE_BYTES, Admission, Membership
from swarmloco.net.averaging.group import check_declaration, sign_declaration
from swarmloco.net.averaging.matchmaking import check_answer
from swarmloco.net.dht import contact
from swarmloco.net.dht.contact import contact_from_proto, sign_card
from swarmloco.net.dht.wire import record_from_proto, record_to_proto
from swarmloco.net.endpoints import is_ip_address
from swarmloco.net.heap import LARGE_BYTES, Releaser, release_when_grown
from swarmloco.net.identity import Identity, verify
from swarmloco.net.records import make_record, progress_key, validate
from swarmloco.net.rejections import Rejection
from swarmloco.proto.v1 import averaging_pb2 as apb

SWARM = "ab" * 20
CREATOR = Identity.generate()


def rejected(check, *args, **kwargs) -> Rejection:
    with pytest.raises(Rejection) as caught:
        check(*args, **kwargs)
    return caught.value


def test_signatures_and_keys_of_any_other_length_are_refused_unread():
    me = Identity.generate()
    signature = me.sign(b"d", b"p")
    assert verify(me.public_key, signature, b"d", b"p")
    for wrong in (signature[:63], signature + b"\0", b"", b"\0" * (1 << 20)):
        assert not verify(me.public_key, wrong, b"d", b"p")
    assert not verify(me.public_key + b"\0", signature, b"d", b"p")


def test_contact_cards_are_refused_by_size_before_their_signature_is_checked_or_cached():
    card = sign_card(Identity.generate(), "127.0.0.1:9").to_proto()
    before = contact._checked_card.cache_info().currsize
    for signature in (card.signature + b"!", card.signature[:-1], os.urandom(7 << 20)):
        bad = type(card)()
        bad.CopyFrom(card)
        bad.signature = signature
        assert rejected(contact_from_proto, bad).code == "bad-contact"
    long_host = type(card)()
    long_host.CopyFrom(card)
    long_host.endpoint = "h" * 300 + ":9"
    assert rejected(contact_from_proto, long_host).code == "bad-contact"
    assert contact._checked_card.cache_info().currsize == before
    assert contact_from_proto(card).endpoint == "127.0.0.1:9"


def test_records_with_wrong_sized_keys_signatures_or_oversized_bodies_are_refused():
    owner = Identity.generate()
    value = {"round": 1, "tokens": 5, "tokens_per_s": 1.0, "at": time.time()}
    record = make_record(progress_key(SWARM), value, expiration=time.time() + 60, owner=owner)
    validate(record, now=time.time())
    for change in (
        {"signature": record.signature + b"!"},
        {"signature": record.signature[:-1]},
        {"owner_public_key": record.owner_public_key + b"!"},
    ):
        bad = dataclasses.replace(record, **change)
        refusal = rejected(validate, bad, now=time.time())
        assert refusal.code == "bad-signature" and "64-byte signature" in refusal.reason
    huge = record_to_proto(record)
    huge.value = b"\0" * (1 << 20)
    assert rejected(record_from_proto, huge).code == "oversize"
    assert record_from_proto(record_to_proto(record)) == record


def declaration(me: Identity, **changes: object) -> apb.MemberDeclaration:
    fields = {
        "endpoint": "127.0.0.1:9",
        "weight": 1.0,
        "bandwidth": 1.0,
        "swarm_id": SWARM,
        "round": 3,
        "numel": 640,
        "block_size": 64,
        "timestamp_ms": int(time.time() * 1000),
    }
    fields.update(changes)
    return sign_declaration(me, **fields)  # type: ignore[arg-type]


def test_declarations_are_refused_by_their_sizes_first():
    me = Identity.generate()
    check = dict(swarm_id=SWARM, round=3, numel=640, block_size=64)
    check_declaration(declaration(me), **check)
    cases = [
        declaration(me, membership=os.urandom(7 << 20)),  # the signature does not cover it
        declaration(me, membership=os.urandom(MAX_CERTIFICATE_BYTES + 1)),
        declaration(me, endpoint="h" * 300 + ":9"),
        declaration(me, swarm_id=SWARM + "00"),
    ]
    long_signature = declaration(me)
    long_signature.signature += b"!"
    short_key = declaration(me)
    short_key.public_key = short_key.public_key[:31]
    for d in [*cases, long_signature, short_key]:
        assert rejected(check_declaration, d, **check).code == "bad-declaration"


def test_a_leaders_answer_with_an_endless_redirect_or_reason_is_refused():
    check_answer(apb.JoinResponse(redirect="127.0.0.1:9"))
    check_answer(apb.JoinResponse(refused=apb.Refusal(code="full", reason="the group is full")))
    for answer in (
        apb.JoinResponse(redirect="h" * 2000 + ":9"),
        apb.JoinResponse(redirect="not an endpoint"),
        apb.JoinResponse(refused=apb.Refusal(code="x" * 33, reason="")),
        apb.JoinResponse(refused=apb.Refusal(code="full", reason="r" * 2000)),
    ):
        assert rejected(check_answer, answer).code == "malformed"


def test_certificates_longer_than_any_are_refused_without_being_cached():
    member = Identity.generate()
    gate = Admission(swarm_id=SWARM, creator_public_key=CREATOR.public_key)
    cert = Membership.issue(CREATOR, SWARM, member.peer_id_hex).to_bytes()
    gate.check(member.peer_id_hex, cert)
    cached = gate.cached_bytes
    assert cached == len(cert)
    for junk in (os.urandom(7 << 20), os.urandom(MAX_CERTIFICATE_BYTES + 1)):
        refusal = rejected(gate.check, member.peer_id_hex, junk)
        assert refusal.code == "not-admitted"
    assert gate.cached_bytes == cached


def test_an_entry_peer_can_only_tell_us_an_ip_address():
    assert is_ip_address("203.0.113.7") and is_ip_address("2001:db8::1")
    assert not is_ip_address("") and not is_ip_address("example.com")
    assert not is_ip_address("1" * 100)


async def test_memory_is_handed_back_once_per_interval_after_large_refusals():
    trims: list[float] = []
    releaser = Releaser(lambda: trims.append(time.monotonic()), min_interval_s=0.3)
    releaser.after(LARGE_BYTES - 1)  # small input: nothing to hand back
    releaser.after(LARGE_BYTES)
    for _ in range(10):  # a burst: covered by the release already due
        releaser.after(LARGE_BYTES)
    deadline = time.monotonic() + 10
    while releaser.trims < 1:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    releaser.after(LARGE_BYTES)  # inside the interval: done when it ends
    while releaser.trims < 2:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    assert len(trims) == 2 and trims[1] - trims[0] >= 0.3 - 0.01
    assert Releaser(None).trims == 0  # no glibc: nothing happens
    Releaser(None).after(LARGE_BYTES)


async def test_a_dht_only_node_hands_memory_back_when_it_has_grown():
    # gRPC refuses a bootstrap node's oversized messages itself: no handler sees them, so
    # the node checks its resident set instead. Here the readings are scripted.
    mib = 1 << 20
    readings = iter([100, 101, 112, 103, 104, 108, 118] + [118] * 1000)
    resident = [100 * mib]
    trimmed = asyncio.Event()
    trims: list[int] = []

    def read() -> int:
        resident[0] = next(readings) * mib
        return resident[0]

    def trim() -> None:
        trims.append(resident[0] // mib)
        if len(trims) == 2:
            trimmed.set()

    task = asyncio.ensure_future(
        release_when_grown(interval_s=0.001, grown_bytes=8 * mib, trim=trim, resident=read)
    )
    await asyncio.wait_for(trimmed.wait(), 10)
    task.cancel()
    # 112 is 12 past 100: handed back (103 after); 108 is 5 past 103: not yet; 118 is.
    assert trims == [112, 118]


def test_store_batches_hold_at_most_so_many_records_and_bytes():
    from swarmloco.net.dht.node import store_batches

    records = [
        make_record(progress_key(SWARM), {"round": i, "tokens": 1, "tokens_per_s": 1.0, "at": 1.0},
                    expiration=time.time() + 60, owner=CREATOR)
        for i in range(10)
    ]  # fmt: skip
    size = records[0].size
    batches = list(store_batches(records, 4, 3 * size))
    assert [len(b) for b in batches] == [3, 3, 3, 1]
    assert [r for b in batches for r in b] == records
    assert [len(b) for b in store_batches(records, 4, 100 * size)] == [4, 4, 2]
    assert [len(b) for b in store_batches(records, 4, 1)] == [1] * 10  # too large: alone
