"""Whose records the dashboard counts: the peers a trusted peer averaged with, as both
sides' signed ``partners`` records say (docs/SECURITY.md, "What the dashboard counts")."""

from typing import Any

from swarmloco.core.manifest import SwarmManifest
from swarmloco.dashboard import text
from swarmloco.dashboard.view import MAX_REMEMBERED, History, Reading, anchors_of, build_view
from swarmloco.net.identity import Identity
from swarmloco.net.records import MAX_PARTNERS, encode_value, partners_key

NOW = 1_700_000_000.0
CREATOR = Identity.generate()
MANIFEST = SwarmManifest(
    task="gpt-bytes",
    model={"preset": "tiny"},
    data={"source": "stdlib"},
    hparams={"sync_every": 50},
    creator=CREATOR.public_key.hex(),
)
SWARM = MANIFEST.swarm_id
ANCHOR = CREATOR.peer_id_hex
HONEST = [f"{i:040x}" for i in range(1, 4)]
SYBILS = [f"{0xE000 + i:040x}" for i in range(20)]


def status(round: int = 7, tokens_per_s: float = 1000.0, **fields: Any) -> dict[str, Any]:
    value = {
        "name": "box",
        "state": "training",
        "round": round,
        "step": 350,
        "tokens": 1000,
        "tokens_per_s": tokens_per_s,
        "loss": 2.5,
        "at": NOW - 1.0,
    }
    value.update(fields)
    return value


def partners(*peers: str) -> dict[str, Any]:
    value = {"peers": list(peers), "round": 7, "at": NOW - 1.0}
    encode_value(partners_key(SWARM), value)  # a value the DHT layer lets through
    return value


def a_run(**extra_partners: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The creator's peer and three honest peers that averaged together."""
    everyone = [ANCHOR, *HONEST]
    named = {p: partners(*(q for q in everyone if q != p)) for p in everyone}
    named.update(extra_partners)
    return named


def sybil_records(claimed_partners: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """20 keys that claim round 1,000,000, 2e10 tokens/s and a loss of -1e9, and name each
    other (and ``claimed_partners``) as partners."""
    status_of = {
        s: status(round=1_000_000, tokens_per_s=9e8, loss=-1e9, tokens=10**12) for s in SYBILS
    }
    named = {
        s: partners(*[*claimed_partners, *(t for t in SYBILS if t != s)][:MAX_PARTNERS])
        for s in SYBILS
    }
    return status_of, named


def reading(status_of: dict[str, Any], named: dict[str, Any]) -> Reading:
    return Reading(swarm_id=SWARM, at=NOW, manifest=MANIFEST, status=status_of, partners=named)


def honest_status() -> dict[str, Any]:
    return {p: status() for p in [ANCHOR, *HONEST]}


def test_the_creators_key_is_trusted_and_so_is_what_the_operator_names():
    assert anchors_of(MANIFEST) == {ANCHOR}
    assert anchors_of(MANIFEST, [HONEST[0]]) == {ANCHOR, HONEST[0]}
    assert anchors_of(None) == frozenset()


def test_sybils_naming_each_other_and_the_honest_peers_are_listed_apart():
    fake_status, fake_partners = sybil_records(claimed_partners=[ANCHOR, *HONEST])
    view = build_view(
        reading({**honest_status(), **fake_status}, {**a_run(), **fake_partners}), now=NOW
    )
    assert {row["id"] for row in view["peers"]} == {ANCHOR, *HONEST}
    assert {row["id"] for row in view["uncounted"]} == set(SYBILS)
    assert view["peers_online"] == 4 and view["peers_uncounted"] == 20
    assert view["round"] == 7 and view["tokens_per_s"] == 4000.0 and view["loss"] == 2.5
    assert all(row["share"] == 0.0 for row in view["uncounted"])
    assert sum(row["share"] for row in view["peers"]) == 1.0
    assert view["trust"] == {
        "anchored": True,
        "trusted_online": [ANCHOR[:12]],
        "vouched": 3,
    }
    assert any("20 peer(s) not counted" in w for w in view["warnings"])
    shown = text.render(view)
    assert "not counted" in shown and SYBILS[0][:12] in shown


def test_one_key_in_a_real_round_brings_at_most_its_partners_not_a_chain():
    """A Sybil that averaged with the creator's peer is counted; the keys it names (and that
    name it) are counted beside it, at most MAX_PARTNERS of them; the keys those name are
    not."""
    inside = SYBILS[0]
    run = a_run()
    run[ANCHOR] = partners(*HONEST, inside)
    friends = SYBILS[1:MAX_PARTNERS]  # all inside's record has room for, besides the anchor
    far = SYBILS[MAX_PARTNERS:]
    named = {inside: partners(ANCHOR, *friends)}
    named.update({f: partners(inside, *far) for f in friends})
    named.update({f: partners(*friends) for f in far})
    fake_status = {s: status() for s in SYBILS}
    view = build_view(reading({**honest_status(), **fake_status}, {**run, **named}), now=NOW)
    counted = {row["id"] for row in view["peers"]}
    assert counted == {ANCHOR, *HONEST, inside, *friends}
    assert {row["id"] for row in view["uncounted"]} == set(far)


def test_a_claim_counts_only_when_both_sides_name_each_other():
    run = a_run()
    run[HONEST[2]] = partners(ANCHOR)  # HONEST[2] names the creator's peer...
    run[ANCHOR] = partners(*HONEST[:2])  # ...which does not name it back
    run[HONEST[0]] = partners(ANCHOR)
    run[HONEST[1]] = partners(ANCHOR)
    view = build_view(reading(honest_status(), run), now=NOW)
    assert {row["id"] for row in view["uncounted"]} == {HONEST[2]}


def test_with_no_trusted_peer_publishing_every_record_counts_and_the_page_says_so():
    records = {p: status() for p in HONEST}
    view = build_view(reading(records, {}), now=NOW)
    assert view["peers_online"] == 3 and view["uncounted"] == []
    assert view["trust"]["anchored"] is False
    assert any("no trusted peer publishes" in w for w in view["warnings"])
    trusted = build_view(reading(records, {}), now=NOW, trust=[HONEST[0]])
    assert trusted["peers_online"] == 1 and trusted["peers_uncounted"] == 2


def test_a_peer_the_creator_averaged_with_stays_counted_while_it_publishes():
    history = History()
    history.add(reading(honest_status(), a_run()))
    assert set(history.remembered) == set(HONEST)
    # The creator's peer leaves; the others keep publishing and naming each other.
    later = {p: partners(*(q for q in HONEST if q != p)) for p in HONEST}
    fake_status, fake_partners = sybil_records(claimed_partners=HONEST)
    after = reading({**{p: status() for p in HONEST}, **fake_status}, {**later, **fake_partners})
    history.add(after)
    view = build_view(after, now=NOW, history=history)
    assert {row["id"] for row in view["peers"]} == set(HONEST)
    assert view["trust"]["anchored"] is True and view["peers_uncounted"] == 20
    # One honest peer stops publishing: it is forgotten, the rest stay.
    gone = reading({p: status() for p in HONEST[1:]}, {p: later[p] for p in HONEST[1:]})
    history.add(gone)
    assert set(history.remembered) == set(HONEST[1:])


def test_memory_of_vouched_peers_is_bounded():
    history = History()
    many = [f"{0xA0000 + i:040x}" for i in range(MAX_REMEMBERED + 50)]
    records = {p: status() for p in [ANCHOR, *many]}
    for start in range(0, len(many), MAX_PARTNERS):
        batch = many[start : start + MAX_PARTNERS]
        named = {ANCHOR: partners(*batch), **{p: partners(ANCHOR) for p in batch}}
        history.add(reading(records, named))
    assert len(history.remembered) == MAX_REMEMBERED
