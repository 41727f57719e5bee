"""Private swarms: membership certificates, and a peer without one refused everywhere.

The certificate checks are pure; the refusals run on real gRPC servers on loopback: a
peer without a certificate cannot get a record stored on or read by members, cannot join
a members' group, and cannot download a member's state, while the members average and
download as in a public swarm.
"""

from __future__ import annotations

import time

import pytest
import torch
from avgutil import SWARM, assert_exact, assert_identical, averaging_peers, run_round
from test_state_transfer import fetch, make_snapshot, serving

from swarmloco.core.manifest import SwarmManifest
from swarmloco.dashboard.collector import read_swarm
from swarmloco.errors import ManifestError, RejectedInput
from swarmloco.net.admission import Admission, AdmissionError, Membership
from swarmloco.net.averaging import MatchmakingConfig
from swarmloco.net.client import RpcClient
from swarmloco.net.identity import Identity
from swarmloco.net.records import MEMBER_FIELD, progress_key
from swarmloco.net.rejections import Rejection
from swarmloco.net.state import Donor, Requester, StateDonor, StateTransferError, state_service

CREATOR = Identity.generate()


def gate(identity: Identity, *, certified: bool = True, clock=time.time) -> Admission:
    own = Membership.issue(CREATOR, SWARM, identity.peer_id_hex) if certified else None
    return Admission(swarm_id=SWARM, creator_public_key=CREATOR.public_key, own=own, clock=clock)


# -- certificates --------------------------------------------------------------------------


def test_a_certificate_admits_its_peer_only_in_its_swarm_until_it_expires():
    peer, other = Identity.generate(), Identity.generate()
    now = 1_000_000.0
    admission = gate(other, clock=lambda: now)
    cert = Membership.issue(CREATOR, SWARM, peer.peer_id_hex, expires_at=int(now) + 60)
    assert Membership.from_text(cert.to_text()) == cert
    admission.check(peer.peer_id_hex, cert.to_bytes())
    admission.check(admission.creator, b"")  # the creator needs none

    def refused(peer_id: str, data: bytes) -> str:
        with pytest.raises(Rejection) as caught:
            admission.check(peer_id, data)
        assert caught.value.code == "not-admitted"
        return caught.value.reason

    assert "shows no membership certificate" in refused(peer.peer_id_hex, b"")
    # Certificates are public: another key showing this one is refused.
    assert "certificate of" in refused(other.peer_id_hex, cert.to_bytes())
    forged = Membership.issue(peer, SWARM, peer.peer_id_hex)  # signed by the wrong key
    assert "not valid here" in refused(peer.peer_id_hex, forged.to_bytes())
    elsewhere = Membership.issue(CREATOR, "ef" * 20, peer.peer_id_hex)
    assert "not valid here" in refused(peer.peer_id_hex, elsewhere.to_bytes())
    tampered = bytearray(cert.to_bytes())
    tampered[-1] ^= 1
    assert "not valid here" in refused(peer.peer_id_hex, bytes(tampered))
    assert "not valid here" in refused(peer.peer_id_hex, b"\xc1garbage")
    now += 61
    assert "expired" in refused(peer.peer_id_hex, cert.to_bytes())
    with pytest.raises(AdmissionError, match="starts with"):
        Membership.from_text("not a certificate")
    with pytest.raises(AdmissionError, match="40 hex digits"):
        Membership.issue(CREATOR, SWARM, "peer")


def manifest(admission: str = "", creator: Identity = CREATOR) -> SwarmManifest:
    return SwarmManifest(
        task="t",
        model={},
        data={},
        hparams={},
        creator=creator.public_key.hex(),
        admission=admission,
        created_at="2026-11-23T00:00:00+00:00",
        nonce="00",
    )


def test_public_runs_keep_their_ids_and_a_private_run_needs_a_certificate_to_join():
    public = manifest()
    assert b"admission" not in public.to_bytes()  # the ids of existing runs stand
    assert SwarmManifest.from_bytes(public.to_bytes()) == public
    private = manifest("certificate")
    assert private.private and private.swarm_id != public.swarm_id
    assert SwarmManifest.from_bytes(private.to_bytes(), expected_id=private.swarm_id) == private
    with pytest.raises(ManifestError, match="admission must be"):
        manifest("anyone-with-a-key")

    peer = Identity.generate()
    assert Admission.of(public, peer, None) is None
    assert Admission.of(private, CREATOR, None) is not None  # the creator admits itself
    with pytest.raises(AdmissionError) as caught:
        Admission.of(private, peer, None)
    # The message says exactly what to run.
    assert f"swarmloco admit {peer.peer_id_hex} --swarm {private.swarm_id}" in str(caught.value)
    cert = Membership.issue(CREATOR, private.swarm_id, peer.peer_id_hex)
    admitted = Admission.of(private, peer, cert.to_text())
    assert admitted is not None and admitted.own_bytes == cert.to_bytes()
    someone_elses = Membership.issue(CREATOR, private.swarm_id, CREATOR.peer_id_hex)
    with pytest.raises(AdmissionError, match="cannot be used"):
        Admission.of(private, peer, someone_elses.to_text())


# -- refused everywhere ----------------------------------------------------------------------


async def test_a_peer_without_a_certificate_gets_nothing_stored_read_or_averaged():
    outsider = 3
    mm = MatchmakingConfig(max_group_size=4, gather_s=2.0, poll_s=0.1)
    gates = {}

    def make(i: int, identity: Identity) -> Admission | None:
        gates[i] = None if i == outsider else gate(identity)
        return gates[i]

    async with averaging_peers(4, matchmaking=mm, gates=make) as peers:
        members = [p for i, p in enumerate(peers) if i != outsider]
        # Records: members refuse to store the outsider's, and ignore it wherever stored.
        value = {"round": 1, "tokens": 5, "tokens_per_s": 1.0, "at": time.time()}
        for p in peers:
            await p.node.dht.store(progress_key(SWARM), value, ttl=60)
        seen = await members[0].node.dht.get(progress_key(SWARM))
        assert set(seen.entries) == {p.peer_id for p in members}
        assert all(MEMBER_FIELD in e.value for e in seen.entries.values())
        by_outsider = await peers[outsider].node.dht.get(progress_key(SWARM))
        assert peers[outsider].peer_id in by_outsider.entries  # its own storage kept it
        refusals = sum(p.node.dht.rejections.counts["not-admitted"] for p in members)
        assert refusals > 0
        # The dashboard of a private swarm, even read through the outsider's node, shows
        # the members only.
        reading = await read_swarm(
            peers[outsider].node.dht, SWARM, manifest=manifest("certificate"), timeout_s=5.0
        )
        assert set(reading.progress) == {p.peer_id for p in members}

        # A round: the members average among themselves, the outsider is turned away.
        vectors = [torch.randn(4096, generator=torch.Generator().manual_seed(i)) for i in range(4)]
        weights = [1.0, 2.0, 3.0, 4.0]
        results = await run_round(peers, 1, vectors, weights, timeout=20.0)
        honest = [results[i] for i in range(4) if i != outsider]
        assert all(not isinstance(r, BaseException) for r in honest), honest
        assert_identical(honest)
        for r in honest:
            assert set(r.report.members) == {p.peer_id for p in members}
            assert_exact(
                r,
                {p.peer_id: vectors[i] for i, p in enumerate(peers)},
                {p.peer_id: weights[i] for i, p in enumerate(peers)},
            )
        turned_away = results[outsider]
        # Refused by a member leader (or, had it seen none, alone): never in their group.
        assert isinstance(turned_away, RejectedInput) or set(turned_away.report.members) == {
            peers[outsider].peer_id
        }, turned_away
        if isinstance(turned_away, RejectedInput):
            assert "membership certificate" in str(turned_away)


async def test_a_private_swarms_donor_serves_signed_requests_of_members_only():
    member, stranger = Identity.generate(), Identity.generate()
    donor_identity = Identity.generate()
    snapshot = make_snapshot(50_000, swarm_id=SWARM)
    donor = StateDonor(
        identity=donor_identity, snapshot=lambda: snapshot, admission=gate(donor_identity)
    )
    async with serving(state_service(donor)) as port, RpcClient() as client:
        served = [Donor(donor_identity.peer_id_hex, f"127.0.0.1:{port}")]

        async def refused(requester: Requester | None) -> str:
            with pytest.raises(StateTransferError) as caught:
                await fetch(client, served, requester=requester, swarm_id=SWARM)
            (failure,) = caught.value.failures
            assert failure.code == "not-admitted", failure
            return failure.reason

        assert "must be signed by one" in await refused(None)
        assert "shows no membership certificate" in await refused(Requester(stranger))
        cert = Membership.issue(CREATOR, SWARM, member.peer_id_hex).to_bytes()
        # A member's certificate, shown by another key.
        assert "certificate of" in await refused(Requester(stranger, cert))
        stale = Requester(member, cert, clock=lambda: time.time() - 3600)
        assert "signed too long ago" in await refused(stale)
        got = await fetch(client, served, requester=Requester(member, cert), swarm_id=SWARM)
    assert got.snapshot.digest == snapshot.digest
    assert donor.stats["served"] == 1 and donor.stats["refused"] == 4
