"""Whom a peer asks for a state, on loopback: keys announcing dead endpoints under the
longest TTL a node keeps (24 h; honest peers announce for 300 s) in the swarm's ``peers``
record, or listing the honest digest of a round, against the honest donor (docs/SECURITY.md,
"Adopting another peer's state"). Real gRPC servers and signed DHT records; the keys need
no server (one node stores their records: keys cost nothing).
"""

from __future__ import annotations

import time
from contextlib import AsyncExitStack

import pytest
import torch
from netutil import catch_up_of, closed_port

from swarmloco.core.adoption import Reference
from swarmloco.core.state import MOMENTUM, THETA_G, StateSnapshot
from swarmloco.net.identity import Identity
from swarmloco.net.node import NetNode, NodeConfig
from swarmloco.net.records import PEERS, digest_key, make_record, peers_key, progress_key
from swarmloco.net.server import ServerConfig
from swarmloco.net.state import DownloadConfig, StateDonor, state_service
from swarmloco.net.swarm import PEER_TTL_S, announce_peer
from swarmloco.runtime.catchup import CatchUp, CatchUpConfig

pytestmark = pytest.mark.timeout(120)

SWARM = "d0" * 20
NUMEL = 1024
CONFIG = CatchUpConfig(
    download=DownloadConfig(chunk_timeout_s=1.0, header_timeout_s=1.0), state_timeout_s=60.0
)


def snapshot(round: int, theta: torch.Tensor) -> StateSnapshot:
    return StateSnapshot.of(
        swarm_id=SWARM, round=round, tensors={THETA_G: theta, MOMENTUM: torch.zeros(NUMEL)}
    )


def dead_endpoints(count: int, networks: int) -> list[str]:
    """``count`` endpoints where nothing listens, over ``networks`` addresses (127.0.0.N
    counts as a network of its own)."""
    return [f"127.0.0.{20 + i % networks}:{closed_port()}" for i in range(count)]


async def serving(stack: AsyncExitStack, state: StateSnapshot, *peers: str) -> NetNode:
    """A peer serving ``state``, in the DHT through ``peers`` (none: nobody knows it)."""
    identity = Identity.generate()
    donor = StateDonor(identity=identity, snapshot=lambda: state)
    return await stack.enter_async_context(
        NetNode(
            identity=identity,
            config=NodeConfig(peers=peers, server=ServerConfig(host="127.0.0.1")),
            services=[state_service(donor)],
        )
    )


async def plain(stack: AsyncExitStack, *peers: str) -> NetNode:
    return await stack.enter_async_context(
        NetNode(identity=Identity.generate(), config=NodeConfig(peers=peers))
    )


async def announce(node: NetNode, owner: Identity, endpoint: str, *, ttl: float) -> None:
    """``owner``'s entry in the swarm's peer list, stored through ``node``."""
    now = node.dht.clock()
    value = {"endpoint": endpoint, "role": "trainer", "version": "0", "public": True}
    record = make_record(peers_key(SWARM), value, expiration=now + ttl, owner=owner)
    assert await node.dht.store_record(record, republish=False) >= 1


def catchup(me: NetNode) -> CatchUp:
    return catch_up_of(me, swarm_id=SWARM, numel=NUMEL, config=CONFIG)


async def test_keys_announcing_dead_endpoints_for_24_h_do_not_keep_a_joiner_from_the_creator():
    """Twelve keys announce dead endpoints on three addresses for 24 h, the swarm's
    creator itself for 300 s: a joiner whose model is not built from the creator's seed
    gets the initial state from the creator on its first try (a peer that answered its
    DHT calls is asked before strangers, whatever their records' expiration)."""
    initial = snapshot(0, torch.randn(NUMEL))
    async with AsyncExitStack() as stack:
        boot = await plain(stack)
        creator = await serving(stack, initial, boot.endpoint)
        assert await announce_peer(creator.dht, SWARM, role="trainer", ttl=PEER_TTL_S)
        for endpoint in dead_endpoints(12, networks=3):
            await announce(boot, Identity.generate(), endpoint, ttl=PEERS.max_ttl)
        me = await plain(stack, boot.endpoint)
        got = await catchup(me).initial(initial.digest)
    assert got is not None
    assert got.donor.peer_id == creator.identity.peer_id_hex
    assert got.snapshot.digest == initial.digest


async def test_a_joiner_asks_other_donors_on_its_next_try_until_one_serves():
    """The creator is not among this joiner's DHT contacts, and twelve keys announce dead
    endpoints on twelve addresses for 24 h: each try asks eight donors, the ones that
    failed after the others, so the second try at the latest reaches the creator."""
    initial = snapshot(0, torch.randn(NUMEL))
    async with AsyncExitStack() as stack:
        boot = await plain(stack)
        creator = await serving(stack, initial)  # outside the DHT: nobody calls it there
        await announce(boot, creator.identity, creator.endpoint, ttl=PEER_TTL_S)
        for endpoint in dead_endpoints(12, networks=12):
            await announce(boot, Identity.generate(), endpoint, ttl=PEERS.max_ttl)
        me = await plain(stack, boot.endpoint)
        assert me.dht.routing.get(creator.identity.peer_id) is None
        joiner = catchup(me)
        tries = [await joiner.initial(initial.digest) for _ in range(2)]
    got = next((t for t in tries if t is not None), None)
    assert got is not None
    assert got.donor.peer_id == creator.identity.peer_id_hex
    if tries[0] is None:
        # The eight that failed are asked after the four keys not asked yet, and the creator.
        assert len(got.failures) <= 4


async def test_keys_listing_the_honest_digest_at_dead_endpoints_do_not_delay_its_download():
    """Ten keys publish the honest holder's digest of round 11 at dead endpoints: a fresh
    peer asks the holder, which answered its DHT calls, first (not four holders at random,
    most of them dead), every time."""
    theta = torch.randn(NUMEL)
    step = torch.randn(NUMEL)
    state = snapshot(11, theta + 0.05 * step / step.norm())  # one outer step ahead
    async with AsyncExitStack() as stack:
        boot = await plain(stack)
        holder = await serving(stack, state, boot.endpoint)
        owners = [(holder.identity, holder.endpoint)]
        owners += [(Identity.generate(), e) for e in dead_endpoints(10, networks=10)]
        now = time.time()
        for owner, endpoint in owners:
            published = {"digest": state.digest, "endpoint": endpoint, "at": now}
            progress = {"round": 12, "tokens": 0, "tokens_per_s": 1000.0, "at": now}
            for key, value in ((digest_key(SWARM, 11), published), (progress_key(SWARM), progress)):
                record = make_record(key, value, expiration=now + 60, owner=owner)
                assert await boot.dht.store_record(record, republish=False) >= 1
        me = await plain(stack, boot.endpoint)
        fresh = Reference(theta_g=theta, momentum=None, tokens=0, outer_lr=0.7, outer_momentum=0.9)
        for _ in range(3):
            found = await catchup(me).find(round=10, digest=None, reference=fresh, distrusted=set())
            assert found.adopted is not None
            assert found.adopted.donor.peer_id == holder.identity.peer_id_hex
            assert not found.adopted.failures
