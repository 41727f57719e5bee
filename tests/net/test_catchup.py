"""Catching up on loopback: honest holders, a liar that serves a poisoned state matching
its own digest, and donors that stall, all real gRPC servers with signed DHT records.

The peer under test is at round 10 with a known history (witnesses, the size of its outer
steps, its round interval); the others publish ``progress`` claims and ``digest/<r>``
records through their own keys and serve their states with a real ``StateDonor``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from contextlib import AsyncExitStack

import grpc
import pytest
import torch
from netutil import catch_up_of

from swarmloco.core.adoption import AdoptionConfig, Evidence, Reference
from swarmloco.core.state import LANDED, MOMENTUM, THETA_G, StateSnapshot
from swarmloco.dataset.ledger import Landed, Range
from swarmloco.net.identity import Identity
from swarmloco.net.node import NetNode, NodeConfig
from swarmloco.net.records import digest_key, progress_key
from swarmloco.net.server import ServerConfig, Service
from swarmloco.net.state import DownloadConfig, StateDonor, state_service, wire
from swarmloco.runtime.catchup import CatchUp, CatchUpConfig, Found

SWARM = "c7" * 20
NUMEL = 4096
STEP = 0.05  # the norm of one outer step of the peer under test
CONFIG = CatchUpConfig(
    download=DownloadConfig(chunk_timeout_s=1.0, header_timeout_s=1.0), state_timeout_s=60.0
)


def state_after(theta: torch.Tensor, rounds: int, seed: int = 0) -> torch.Tensor:
    """``theta`` moved by ``rounds`` outer steps of norm STEP (random directions)."""
    g = torch.Generator().manual_seed(seed)
    out = theta.clone()
    for _ in range(rounds):
        d = torch.randn(NUMEL, generator=g)
        out += STEP * d / d.norm()
    return out


def snapshot(round: int, theta: torch.Tensor) -> StateSnapshot:
    return StateSnapshot.of(
        swarm_id=SWARM, round=round, tensors={THETA_G: theta, MOMENTUM: torch.zeros(NUMEL)}
    )


@dataclasses.dataclass
class Holder:
    """A peer on loopback that claims a round and publishes (and may serve) a state."""

    node: NetNode
    state: StateSnapshot | None

    @property
    def peer_id(self) -> str:
        return self.node.identity.peer_id_hex

    async def publish(self, *, claim: int, state: StateSnapshot, endpoint: str | None = None):
        now = time.time()
        progress = {"round": claim, "tokens": 0, "tokens_per_s": 1000.0, "at": now}
        assert await self.node.dht.store(progress_key(SWARM), progress, ttl=60)
        digest = {"digest": state.digest, "endpoint": endpoint or self.node.endpoint, "at": now}
        assert await self.node.dht.store(digest_key(SWARM, state.round), digest, ttl=60)


def _stalling_service(stalled: list[int]) -> Service:
    """A StateTransfer service that accepts every download and never sends a byte."""

    async def download(data: bytes, context: grpc.aio.ServicerContext) -> None:
        stalled.append(1)
        await asyncio.Event().wait()

    handler = grpc.unary_stream_rpc_method_handler(download)
    generic = grpc.method_handlers_generic_handler(wire.SERVICE_NAME, {"Download": handler})
    return Service(wire.SERVICE_NAME, lambda s: s.add_generic_rpc_handlers((generic,)))


async def node(stack: AsyncExitStack, *peers: str) -> NetNode:
    """A plain node on loopback (the bootstrap, or the peer that catches up)."""
    return await stack.enter_async_context(
        NetNode(identity=Identity.generate(), config=NodeConfig(peers=peers))
    )


async def holder(
    stack: AsyncExitStack, boot: NetNode, *, stalls: list[int] | None = None, host: str = ""
):
    """A holder serving on ``host`` (127.0.0.N: a network of its own), by default 127.0.0.1."""
    identity = Identity.generate()
    h = Holder(node=None, state=None)  # type: ignore[arg-type]
    if stalls is not None:
        service = _stalling_service(stalls)
    else:
        donor = StateDonor(identity=identity, snapshot=lambda: h.state)
        service = state_service(donor)
    h.node = await stack.enter_async_context(
        NetNode(
            identity=identity,
            config=NodeConfig(
                peers=(boot.endpoint,), server=ServerConfig(host=host or "127.0.0.1")
            ),
            services=[service],
        )
    )
    return h


def seasoned(witnesses: list[str], *, last_round_at: float) -> Evidence:
    """Rounds 1..10 averaged with ``witnesses``, 10 s apart, each step of norm STEP."""
    evidence = Evidence()
    for r in range(1, 11):
        evidence.applied(STEP, at=last_round_at - 10 * (10 - r))
        evidence.grouped(r, witnesses, "me", AdoptionConfig())
    return evidence


def reference(theta: torch.Tensor) -> Reference:
    """This peer's own state: ``theta`` and no momentum yet."""
    return Reference(theta_g=theta, momentum=None, tokens=0, outer_lr=0.7, outer_momentum=0.9)


def catchup(me: NetNode, evidence: Evidence, config: CatchUpConfig = CONFIG) -> CatchUp:
    return catch_up_of(me, swarm_id=SWARM, numel=NUMEL, config=config, evidence=evidence)


@pytest.mark.parametrize("liar_is_a_witness", [False, True])
async def test_a_liar_serving_a_poisoned_state_that_matches_its_digest_is_never_adopted(
    liar_is_a_witness,
):
    """The liar claims round 16 (R + 5 from the honest round 11), publishes the digest of
    round 15 and serves a state that matches it. The honest holders are strangers (this
    peer's last partner left), in two networks of their own. As a stranger, the liar's
    claim counts only as far as the others' go: its round is never a candidate, and with
    every partner silent the honest state, held from two networks, is taken. As a former
    group partner the liar keeps this peer from following strangers while it is heard:
    5 rounds in 2 s are implausible, nothing is adopted; once enough time passed, its
    state lies too far from this peer's to be a successor, it is distrusted, and the
    honest state is taken."""
    theta = torch.randn(NUMEL)
    honest_state = snapshot(11, state_after(theta, 1, seed=1))
    poisoned = snapshot(15, theta + 100.0)
    async with AsyncExitStack() as stack:
        boot = await node(stack)
        a = await holder(stack, boot, host="127.0.0.2")
        b = await holder(stack, boot, host="127.0.0.3")
        liar = await holder(stack, boot)
        me = await node(stack, boot.endpoint)
        for h in (a, b):
            h.state = honest_state
            await h.publish(claim=12, state=honest_state)
        liar.state = poisoned
        await liar.publish(claim=16, state=poisoned)
        gone = Identity.generate().peer_id_hex  # the partner of this peer's last rounds
        witnesses = [gone] + ([liar.peer_id] if liar_is_a_witness else [])
        now = time.time()
        evidence = seasoned(witnesses, last_round_at=now - 2.0)
        found = await catchup(me, evidence).find(
            round=10, digest=None, reference=reference(theta), distrusted=set()
        )
        refused = [r for r in found.refused if r.digest == poisoned.digest.hex()]
        if not liar_is_a_witness:  # a stranger's claim counts only as far as the others' go
            assert not refused and not found.distrusted
            assert found.adopted is not None
            assert found.adopted.snapshot.digest == honest_state.digest
            assert found.adopted.donor.peer_id in (a.peer_id, b.peer_id)
            return
        # While the partner is heard, only its claim is looked into: the strangers' state
        # is not even read, let alone downloaded.
        assert found.adopted is None
        assert refused and "rounds ahead" in refused[0].reason
        assert not [r for r in found.refused if r.digest == honest_state.digest.hex()]
        # Later, when 5 rounds would have had time to pass: the distance check.
        late = seasoned(witnesses, last_round_at=now - 60.0)
        again = await catchup(me, late).find(
            round=10, digest=None, reference=reference(theta), distrusted=set()
        )
        far = [r for r in again.refused if r.digest == poisoned.digest.hex()]
        assert far and "away from this peer's state" in far[0].reason
        assert liar.peer_id in again.distrusted
        assert again.adopted is not None
        assert again.adopted.snapshot.digest == honest_state.digest


async def after_ten_rounds_away(theta: torch.Tensor, ahead: StateSnapshot) -> tuple[Found, str]:
    """What the peer at round 10 (``theta``) finds when its one witness serves ``ahead``
    (round 20) and the peer was frozen for 110 s (ten rounds of 10 s went by); and the
    witness's id."""
    async with AsyncExitStack() as stack:
        boot = await node(stack)
        a = await holder(stack, boot)
        me = await node(stack, boot.endpoint)
        a.state = ahead
        await a.publish(claim=21, state=ahead)
        evidence = seasoned([a.peer_id], last_round_at=time.time() - 110.0)
        found = await catchup(me, evidence).find(
            round=10, digest=None, reference=reference(theta), distrusted=set()
        )
    return found, a.peer_id


async def test_an_honest_peer_stopped_for_ten_rounds_still_heals():
    theta = torch.randn(NUMEL)
    found, _ = await after_ten_rounds_away(theta, snapshot(20, state_after(theta, 10, seed=2)))
    assert found.adopted is not None and found.adopted.snapshot.round == 20
    assert "round 20" in found.why


@pytest.mark.parametrize("well_formed", [True, False])
async def test_a_state_brings_what_landed_in_it_and_a_malformed_account_is_refused(well_formed):
    """A witness serves round 20 with the sequences of a pinned dataset that landed in it:
    well formed, the taker has them with the state (DESIGN section 11, "What landed travels
    with the state"); overlapping ranges, or more sequences than it counts, and the state
    is refused and its holder distrusted, whatever its weights."""
    theta = torch.randn(NUMEL)
    landed = Landed([Range(0, 3, 0, 40), Range(0, 7, 10, 5)], [45])
    account = landed.to_tensor()
    if not well_formed:
        account = torch.tensor([1, 44, 0, 3, 0, 40, 0, 7, 10, 5], dtype=torch.int64)
    tensors = {THETA_G: state_after(theta, 10, seed=2), MOMENTUM: torch.zeros(NUMEL)}
    ahead = StateSnapshot.of(swarm_id=SWARM, round=20, tensors={**tensors, LANDED: account})
    found, holder_id = await after_ten_rounds_away(theta, ahead)
    if well_formed:
        assert found.adopted is not None and found.adopted.snapshot.round == 20
        assert Landed.from_tensor(found.adopted.snapshot.tensor(LANDED)) == landed
        return
    assert found.adopted is None and holder_id in found.distrusted
    refused = [r for r in found.refused if r.digest == ahead.digest.hex()]
    assert refused and "what it says landed of the dataset is malformed" in refused[0].reason


@pytest.mark.parametrize("fresh", [False, True])
async def test_ten_stalling_fake_donors_hold_healing_for_a_bounded_time(fresh):
    """Ten keys publish one forged digest for the later round (ten holders outrank the one
    honest holder) and stall every download. A peer with history asks its witness first;
    a fresh peer tries at most ``donors_per_digest`` (4) fakes, each cut off by the header
    timeout (1 s), before the honest holder: healing completes within 4 s plus the
    download, whatever the number of fakes."""
    theta = torch.randn(NUMEL)
    honest_state = snapshot(11, state_after(theta, 1, seed=3))
    forged = snapshot(11, theta - 1.0)
    stalls: list[int] = []
    async with AsyncExitStack() as stack:
        boot = await node(stack)
        a = await holder(stack, boot)
        a.state = honest_state
        await a.publish(claim=12, state=honest_state)
        fakes = [await holder(stack, boot, stalls=stalls) for _ in range(10)]
        for f in fakes:
            await f.publish(claim=12, state=forged)
        me = await node(stack, boot.endpoint)
        evidence = Evidence() if fresh else seasoned([a.peer_id], last_round_at=time.time())
        started = time.monotonic()
        found = await catchup(me, evidence).find(
            round=10, digest=None, reference=reference(theta), distrusted=set()
        )
        elapsed = time.monotonic() - started
    assert found.adopted is not None
    assert found.adopted.snapshot.digest == honest_state.digest
    if fresh:
        assert len(stalls) == 4 and len(found.failed) == 1
        assert "too slow" in found.failed[0]
        assert elapsed < 4 * 1.0 + 3.0
    else:
        assert stalls == [] and not found.failed
        assert elapsed < 3.0


async def test_a_fresh_peer_follows_no_stranger_past_what_the_others_report():
    """One honest holder at round 11, a liar claiming round 16: a fresh peer (nothing to
    hold a claim against) counts the liar's claim only up to the others' and never asks
    it for its state."""
    theta = torch.randn(NUMEL)
    honest_state = snapshot(11, state_after(theta, 1, seed=4))
    async with AsyncExitStack() as stack:
        boot = await node(stack)
        a, liar = await holder(stack, boot), await holder(stack, boot)
        a.state = honest_state
        await a.publish(claim=12, state=honest_state)
        liar.state = snapshot(15, theta + 100.0)
        await liar.publish(claim=16, state=liar.state)
        me = await node(stack, boot.endpoint)
        found = await catchup(me, Evidence()).find(
            round=0, digest=None, reference=reference(theta), distrusted=set()
        )
        assert found.adopted is not None and found.adopted.snapshot.round == 11
        assert found.adopted.snapshot.digest == honest_state.digest
        assert not found.refused  # the liar's round was never a candidate


async def test_a_newcomer_at_round_0_does_not_keep_a_fresh_peer_from_the_lone_peer_ahead():
    """The run's first peer trained alone to round 54; another newcomer, still at the
    initial state, reports working on round 1. It holds nothing and vouches for nothing:
    a fresh peer follows the one peer ahead (trust on first use), instead of capping it
    at the newcomer's round 1, which nobody serves (issue 12's newcomers that never
    caught up)."""
    theta = torch.randn(NUMEL)
    ahead = snapshot(54, state_after(theta, 54, seed=6))
    async with AsyncExitStack() as stack:
        boot = await node(stack)
        a, newcomer = await holder(stack, boot), await holder(stack, boot)
        a.state = ahead
        await a.publish(claim=55, state=ahead)
        progress = {"round": 1, "tokens": 0, "tokens_per_s": 1000.0, "at": time.time()}
        assert await newcomer.node.dht.store(progress_key(SWARM), progress, ttl=60)
        me = await node(stack, boot.endpoint)
        found = await catchup(me, Evidence()).find(
            round=0, digest=None, reference=reference(theta), distrusted=set()
        )
    assert found.adopted is not None and found.adopted.snapshot.round == 54
    assert found.adopted.snapshot.digest == ahead.digest


async def test_an_orphaned_peer_takes_a_strangers_state_only_within_its_own_bounds():
    """A peer whose last partner left; round 11 held by one stranger, and another state of
    round 11 (a liar's) held from two networks. With nobody to ask, the peer tries the
    liar's first (more networks), refuses it on the distance its own outer steps allow,
    distrusts its holders, and takes the other."""
    theta = torch.randn(NUMEL)
    async with AsyncExitStack() as stack:
        boot = await node(stack)
        a = await holder(stack, boot)
        liars = [await holder(stack, boot, host=f"127.0.0.{n}") for n in (2, 3)]
        a.state = snapshot(11, state_after(theta, 1, seed=5))
        await a.publish(claim=12, state=a.state)
        poisoned = snapshot(11, theta + 100.0)
        for liar in liars:
            liar.state = poisoned
            await liar.publish(claim=12, state=poisoned)
        me = await node(stack, boot.endpoint)
        gone = Identity.generate().peer_id_hex
        evidence = seasoned([gone], last_round_at=time.time())
        found = await catchup(me, evidence).find(
            round=10, digest=None, reference=reference(theta), distrusted=set()
        )
    assert found.adopted is not None and found.adopted.snapshot.digest == a.state.digest
    (refused,) = [r for r in found.refused if r.digest == poisoned.digest.hex()]
    assert "away from this peer's state" in refused.reason
    assert {liar.peer_id for liar in liars} <= found.distrusted
