"""A public run that asks every key for a proof of work: a key without one is refused
everywhere a private run refuses a peer without a certificate (records, groups, state),
on real gRPC servers on loopback, while the proven peers average as usual."""

from __future__ import annotations

import time

import pytest
import torch
from avgutil import SWARM, assert_identical, averaging_peers, run_round
from test_state_transfer import fetch, make_snapshot, serving

from swarmloco.core.manifest import SwarmManifest
from swarmloco.dashboard.collector import read_swarm
from swarmloco.errors import RejectedInput
from swarmloco.net.averaging import MatchmakingConfig
from swarmloco.net.client import RpcClient
from swarmloco.net.identity import Identity
from swarmloco.net.records import MEMBER_FIELD, progress_key
from swarmloco.net.state import Donor, Requester, StateDonor, StateTransferError, state_service
from swarmloco.net.work import IdentityWork, solve, work_bits

BITS = 4  # 16 scrypt evaluations a key: what matters here is the check, not the price


def with_work() -> SwarmManifest:
    """A public run's manifest that asks for ``BITS`` of work (the records are read under
    the test's swarm id)."""
    return SwarmManifest(task="t", model={}, data={}, hparams={}, identity_work=BITS)


def proven(identity: Identity) -> IdentityWork:
    return IdentityWork(swarm_id=SWARM, bits=BITS, own=solve(SWARM, identity.peer_id, BITS))


def unproven(identity: Identity, *, start: int = 0) -> bytes:
    """A nonce that proves nothing for ``identity`` (a made-up one that happens to prove
    the work, one in 2^BITS, is skipped: the test must show a refusal)."""
    return next(
        n
        for n in (i.to_bytes(8, "big") for i in range(start, start + 1000))
        if work_bits(SWARM, identity.peer_id, n) < BITS
    )


async def test_a_key_without_work_gets_nothing_stored_read_or_averaged():
    outsider = 3
    mm = MatchmakingConfig(max_group_size=4, gather_s=2.0, poll_s=0.1)

    def make(i: int, identity: Identity) -> IdentityWork:
        # The outsider shows a made-up nonce: a key costs it nothing.
        if i == outsider:
            return IdentityWork(swarm_id=SWARM, bits=BITS, own=unproven(identity))
        return proven(identity)

    async with averaging_peers(4, matchmaking=mm, gates=make) as peers:
        members = [p for i, p in enumerate(peers) if i != outsider]
        value = {"round": 1, "tokens": 5, "tokens_per_s": 1.0, "at": time.time()}
        for p in peers:
            await p.node.dht.store(progress_key(SWARM), value, ttl=60)
        seen = await members[0].node.dht.get(progress_key(SWARM))
        assert set(seen.entries) == {p.peer_id for p in members}
        assert all(len(e.value[MEMBER_FIELD]) == 8 for e in seen.entries.values())
        refusals = sum(p.node.dht.rejections.counts["unproven"] for p in members)
        assert refusals > 0
        # The dashboard of a run with work, even read through the outsider's node (which
        # kept its own record), shows the proven keys only.
        reading = await read_swarm(
            peers[outsider].node.dht, SWARM, manifest=with_work(), timeout_s=5.0
        )
        assert set(reading.progress) == {p.peer_id for p in members}

        vectors = [torch.randn(4096, generator=torch.Generator().manual_seed(i)) for i in range(4)]
        results = await run_round(peers, 1, vectors, [1.0, 2.0, 3.0, 4.0], timeout=20.0)
        honest = [results[i] for i in range(4) if i != outsider]
        assert all(not isinstance(r, BaseException) for r in honest), honest
        assert_identical(honest)
        for r in honest:
            assert set(r.report.members) == {p.peer_id for p in members}
        turned_away = results[outsider]
        assert isinstance(turned_away, RejectedInput) or set(turned_away.report.members) == {
            peers[outsider].peer_id
        }, turned_away
        if isinstance(turned_away, RejectedInput):
            assert "bits of work" in str(turned_away)


async def test_a_donor_of_a_run_with_work_serves_proven_keys_only():
    donor_identity, member = Identity.generate(), Identity.generate()
    nonce = solve(SWARM, member.peer_id, BITS)
    stranger = Identity.generate()
    while work_bits(SWARM, stranger.peer_id, nonce) >= BITS:  # the member's nonce: not its
        stranger = Identity.generate()
    snapshot = make_snapshot(50_000, swarm_id=SWARM)
    donor = StateDonor(
        identity=donor_identity, snapshot=lambda: snapshot, admission=proven(donor_identity)
    )
    async with serving(state_service(donor)) as port, RpcClient() as client:
        served = [Donor(donor_identity.peer_id_hex, f"127.0.0.1:{port}")]
        reasons = []
        for requester in (None, Requester(stranger), Requester(stranger, nonce)):
            with pytest.raises(StateTransferError) as caught:
                await fetch(client, served, requester=requester, swarm_id=SWARM)
            (failure,) = caught.value.failures
            reasons.append(failure.reason)
        assert "must be signed by one" in reasons[0]
        assert all("work" in r for r in reasons[1:]), reasons
        got = await fetch(client, served, requester=Requester(member, nonce), swarm_id=SWARM)
    assert got.snapshot.digest == snapshot.digest
    assert donor.stats["served"] == 1
