"""Record validation: schemas, ownership and signatures (no network)."""

import dataclasses

import msgpack
import pytest
from netutil import SWARM, counter_key

from swarmloco.core.manifest import SwarmManifest
from swarmloco.net.identity import Identity
from swarmloco.net.records import (
    PEERS,
    CheckedRecords,
    Record,
    digest_key,
    held_bytes,
    leases_key,
    make_record,
    manifest_key,
    peers_key,
    progress_key,
    progress_report,
    sign,
    swarm_key,
    validate,
)
from swarmloco.net.rejections import Rejection

NOW = 1_700_000_000.0
PEER = {"endpoint": "127.0.0.1:5000", "role": "trainer", "version": "0.1.0", "public": True}


def rejected(record: Record) -> Rejection:
    with pytest.raises(Rejection) as info:
        validate(record, now=NOW)
    return info.value


def test_signed_record_round_trips():
    owner = Identity.generate()
    record = make_record(peers_key(SWARM), PEER, expiration=NOW + 60, owner=owner)
    assert record.subkey == owner.peer_id_hex
    assert validate(record, now=NOW) == PEER


def test_float_where_an_int_belongs_is_rejected():
    owner = Identity.generate()
    good = make_record(counter_key(), {"count": 3, "label": "x"}, expiration=NOW + 60, owner=owner)
    assert validate(good, now=NOW) == {"count": 3, "label": "x"}
    bad_value = msgpack.packb({"count": 3.0, "label": "x"})
    forged = _resign(owner, dataclasses.replace(good, value=bad_value))
    rejection = rejected(forged)
    assert rejection.code == "schema"
    assert "count must be an integer, got float" in rejection.reason
    # The publisher's own API refuses it before it leaves the peer.
    with pytest.raises(ValueError, match="count must be an integer"):
        make_record(counter_key(), {"count": 3.0, "label": "x"}, expiration=NOW + 60, owner=owner)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"count": True, "label": "x"}, "count must be an integer, got bool"),
        ({"count": -1, "label": "x"}, "outside"),
        ({"count": 1}, "lacks the field 'label'"),
        ({"count": 1, "label": "x", "extra": 1}, "unknown fields"),
        ({"count": 1, "label": "x" * 33}, "at most 32"),
        ([1, "x"], "must be a map"),
    ],
)
def test_schema_failures_are_rejected(value, message):
    owner = Identity.generate()
    good = make_record(counter_key(), {"count": 1, "label": "x"}, expiration=NOW + 60, owner=owner)
    bad = _resign(owner, dataclasses.replace(good, value=msgpack.packb(value)))
    rejection = rejected(bad)
    assert rejection.code == "schema"
    assert message in rejection.reason


def test_oversize_value_is_rejected_before_decoding():
    owner = Identity.generate()
    good = make_record(peers_key(SWARM), PEER, expiration=NOW + 60, owner=owner)
    huge = msgpack.packb({**PEER, "version": "v" * 4000})
    rejection = rejected(_resign(owner, dataclasses.replace(good, value=huge)))
    assert rejection.code == "oversize"
    assert f"at most {PEERS.max_value_bytes}" in rejection.reason


def test_malformed_msgpack_and_extension_types_are_rejected():
    owner = Identity.generate()
    good = make_record(peers_key(SWARM), PEER, expiration=NOW + 60, owner=owner)
    for value in (b"\xc1", b"\x92\x01", msgpack.packb(msgpack.ExtType(5, b"x")), b""):
        rejection = rejected(_resign(owner, dataclasses.replace(good, value=value)))
        assert rejection.code == "bad-msgpack"


def test_owned_subkey_without_signature_is_rejected():
    owner = Identity.generate()
    good = make_record(peers_key(SWARM), PEER, expiration=NOW + 60, owner=owner)
    unsigned = dataclasses.replace(good, signature=b"", owner_public_key=b"")
    assert rejected(unsigned).code == "unsigned"


def test_forged_records_under_an_owned_subkey_are_rejected():
    victim, mallory = Identity.generate(), Identity.generate()
    genuine = make_record(peers_key(SWARM), PEER, expiration=NOW + 60, owner=victim)
    evil = {**PEER, "endpoint": "6.6.6.6:666"}
    # Mallory signs with her key but writes under the victim's subkey.
    own = make_record(peers_key(SWARM), evil, expiration=NOW + 60, owner=mallory)
    assert rejected(dataclasses.replace(own, subkey=victim.peer_id_hex)).code == "bad-signature"
    # Mallory puts the victim's key beside her own signature.
    claimed = dataclasses.replace(
        own, subkey=victim.peer_id_hex, owner_public_key=victim.public_key
    )
    assert rejected(claimed).code == "bad-signature"
    # Mallory changes the value, expiration or key of the victim's genuine record.
    for tampered in (
        dataclasses.replace(genuine, value=msgpack.packb(evil)),
        dataclasses.replace(genuine, expiration=NOW + 600),
        dataclasses.replace(genuine, key=peers_key("cd" * 20)),
    ):
        assert rejected(tampered).code == "bad-signature"
    # An unowned kind must not carry a signature at all (nothing to trust it by).
    manifest = SwarmManifest(task="t", model={}, data={}, hparams={})
    record = make_record(
        manifest_key(manifest.swarm_id), manifest.to_bytes(), expiration=NOW + 60, owner=None
    )
    signed = dataclasses.replace(record, signature=b"x" * 64, owner_public_key=victim.public_key)
    assert rejected(signed).code == "bad-signature"


def test_manifest_whose_hash_is_not_the_swarm_id_is_rejected():
    manifest = SwarmManifest(task="t", model={}, data={}, hparams={})
    other = SwarmManifest(task="u", model={}, data={}, hparams={})
    record = make_record(
        manifest_key(manifest.swarm_id), manifest.to_bytes(), expiration=NOW + 60, owner=None
    )
    assert validate(record, now=NOW) == manifest.to_bytes()
    swapped = dataclasses.replace(record, value=msgpack.packb(other.to_bytes()))
    rejection = rejected(swapped)
    assert rejection.code == "manifest-mismatch"
    assert other.swarm_id in rejection.reason and manifest.swarm_id in rejection.reason
    with pytest.raises(ValueError, match="hashes to"):
        make_record(
            manifest_key(manifest.swarm_id), other.to_bytes(), expiration=NOW + 60, owner=None
        )


def test_expired_and_non_finite_expirations_are_rejected():
    owner = Identity.generate()
    record = make_record(peers_key(SWARM), PEER, expiration=NOW - 1, owner=owner)
    assert rejected(record).code == "expired"
    nan = _resign(owner, dataclasses.replace(record, expiration=float("nan")))
    assert rejected(nan).code == "bad-expiration"


@pytest.mark.parametrize(
    "key",
    [
        "peers",
        f"swarmloco/v1/{SWARM}/no-such-kind",
        f"swarmloco/v1/{'zz' * 20}/peers",
        f"swarmloco/v2/{SWARM}/peers",
        f"swarmloco/v1/{SWARM}/" + "x" * 200,
    ],
)
def test_unknown_or_malformed_keys_are_rejected(key):
    record = Record(key, "", msgpack.packb(1), NOW + 60)
    assert rejected(record).code in {"bad-key", "unknown-kind"}


def test_swarm_key_checks_its_parts():
    assert swarm_key(SWARM.upper(), "peers") == f"swarmloco/v1/{SWARM}/peers"
    with pytest.raises(ValueError):
        swarm_key(SWARM, "Bad Name")


def _resign(owner: Identity, record: Record) -> Record:
    """Sign a (bad) record properly, so that only the property under test is wrong."""
    return sign(record, owner)


def test_progress_record_becomes_a_pacing_report():
    owner = Identity.generate()
    value = {"round": 3, "tokens": 40_960, "tokens_per_s": 812.5, "at": NOW}
    record = make_record(progress_key(SWARM), value, expiration=NOW + 30, owner=owner)
    report = progress_report(record.subkey, validate(record, now=NOW))
    assert (report.peer, report.round, report.tokens) == (owner.peer_id_hex, 3, 40_960)
    assert (report.tokens_per_s, report.at) == (812.5, NOW)
    assert report.step_tokens is None  # a peer that does not say it
    said = value | {"step_tokens": 4096}
    record = make_record(progress_key(SWARM), said, expiration=NOW + 30, owner=owner)
    assert progress_report(record.subkey, validate(record, now=NOW)).step_tokens == 4096


@pytest.mark.parametrize(
    "change",
    [
        {"tokens": 1.5},
        {"tokens": -1},
        {"tokens_per_s": -2.0},
        {"tokens_per_s": 3},
        {"round": -1},
        {"step_tokens": 0},
        {"step_tokens": 2.5},
    ],
)
def test_progress_values_that_cannot_be_true_are_rejected(change):
    owner = Identity.generate()
    value = {"round": 3, "tokens": 10, "tokens_per_s": 1.0, "at": NOW}
    good = make_record(progress_key(SWARM), value, expiration=NOW + 30, owner=owner)
    bad = _resign(owner, dataclasses.replace(good, value=msgpack.packb(value | change)))
    assert rejected(bad).code == "schema"
    with pytest.raises(ValueError):  # and the publisher's own API refuses it
        make_record(progress_key(SWARM), value | change, expiration=NOW + 30, owner=owner)


def test_digest_record_of_a_round():
    owner = Identity.generate()
    value = {"digest": b"\x07" * 32, "endpoint": "127.0.0.1:4000", "at": NOW}
    record = make_record(digest_key(SWARM, 12), value, expiration=NOW + 60, owner=owner)
    assert validate(record, now=NOW) == value
    for bad in ({"digest": b"\x07" * 31}, {"digest": b"\x07" * 33}, {"endpoint": "nowhere"}):
        forged = _resign(owner, dataclasses.replace(record, value=msgpack.packb(value | bad)))
        assert rejected(forged).code == "schema"
    with pytest.raises(ValueError, match="round number"):
        digest_key(SWARM, -1)


async def test_checked_records_are_remembered_within_their_budget_and_still_expire():
    records = [
        make_record(peers_key(SWARM), PEER, expiration=NOW + 60, owner=Identity.generate())
        for _ in range(4)
    ]
    checked = CheckedRecords(max_bytes=3 * held_bytes(records[0], PEER))
    [first] = await checked.validate_many(records[:1], now=NOW)
    assert first == PEER
    assert (await checked.validate_many(records[:1], now=NOW))[0] is first  # remembered
    assert await checked.validate_many(records[1:], now=NOW) == [PEER] * 3
    assert len(checked) == 3  # the budget holds three: the oldest was forgotten
    assert (await checked.validate_many(records[:1], now=NOW))[0] is not first
    # A remembered record still expires, and a copy changed in any field is checked whole.
    [expired] = await checked.validate_many(records[3:], now=NOW + 61)
    assert isinstance(expired, Rejection) and expired.code == "expired"
    tampered = dataclasses.replace(records[3], value=msgpack.packb({**PEER, "role": "client"}))
    [forged] = await checked.validate_many([tampered], now=NOW)
    checked.close()
    assert isinstance(forged, Rejection) and forged.code == "bad-signature"


async def test_checking_many_records_stops_at_the_first_bad_one_not_at_an_expired_one():
    """An expired record (clocks differ) is skipped and the rest read; a bad one ends the
    answer that carried it: nothing after it is checked or kept."""
    owners = [Identity.generate() for _ in range(5)]
    records = [
        make_record(peers_key(SWARM), PEER, expiration=NOW + (-1 if i == 1 else 60), owner=o)
        for i, o in enumerate(owners)
    ]
    records[3] = dataclasses.replace(records[3], value=msgpack.packb({**PEER, "role": "client"}))
    checked = CheckedRecords(max_bytes=1 << 20)
    await checked.validate_many(records[4:], now=NOW)  # remembered, yet after the bad one
    outcomes = await checked.validate_many(records, now=NOW)
    checked.close()
    assert [getattr(o, "code", o) for o in outcomes] == [PEER, "expired", PEER, "bad-signature"]
    assert len(checked) == 3  # records 0, 2 and 4: nothing bad or expired kept


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"shards": [[0]], "at": NOW}, "at least 2"),
        ({"shards": [[0, 1], []], "at": NOW}, "at least 2"),
        ({"shards": [[0, 1, 2]], "at": NOW}, "at most 2"),
    ],
)
def test_dataset_leases_are_pairs_their_readers_can_unpack(value, message):
    """A lease is [epoch, shard]: any other shape stopped every reader that counted the
    entry."""
    owner = Identity.generate()
    key = leases_key(SWARM)
    good = {"shards": [[0, 1]]}
    record = make_record(key, good | {"at": NOW}, expiration=NOW + 60, owner=owner)
    assert validate(record, now=NOW) == good | {"at": NOW}
    forged = _resign(owner, dataclasses.replace(record, value=msgpack.packb(value)))
    rejection = rejected(forged)
    assert rejection.code == "schema"
    assert message in rejection.reason
    with pytest.raises(ValueError, match=message):  # nor does its publisher send it
        make_record(key, value, expiration=NOW + 60, owner=owner)
