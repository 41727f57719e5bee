"""A stranger with many keys against catch-up (docs/SECURITY.md, "Many keys"), on loopback.

Real gRPC servers and signed DHT records: honest holders serve their state with a real
``StateDonor``; the attacker publishes ``digest/<r>`` and ``progress`` records under as
many fresh keys as it likes (one node stores them all: keys cost nothing) and serves, from
a few addresses of its own, the honest weights with the outer momentum multiplied (x1000
ends training; x1, the state before the round, would make every peer throw its round away).
"""

from __future__ import annotations

import time
from contextlib import AsyncExitStack

import pytest
import torch
from netutil import catch_up_of

from swarmloco.core.adoption import AdoptionConfig, Evidence, Reference
from swarmloco.core.manifest import SwarmManifest
from swarmloco.core.state import MOMENTUM, THETA_G, TOKENS, StateSnapshot
from swarmloco.net.identity import Identity
from swarmloco.net.node import NetNode, NodeConfig
from swarmloco.net.records import digest_key, make_record, progress_key
from swarmloco.net.server import ServerConfig
from swarmloco.net.state import DownloadConfig, StateDonor, state_service
from swarmloco.runtime.catchup import CatchUp, CatchUpConfig, Found, trusted_peers

pytestmark = pytest.mark.timeout(120)

SWARM = "5b" * 20
NUMEL = 4096
LR, MU = 0.7, 0.9
CONFIG = CatchUpConfig(
    download=DownloadConfig(chunk_timeout_s=2.0, header_timeout_s=2.0), state_timeout_s=60.0
)


class Trajectory:
    """Honest training, round by round: Nesterov outer steps (lr 0.7, momentum 0.9) with
    pseudo-gradients that keep a direction, as a model's do, plus noise."""

    def __init__(self, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.theta = torch.randn(NUMEL, generator=g)
        self.theta0 = self.theta.clone()
        self.momentum = torch.zeros(NUMEL)
        self.tokens = 0
        self.round = 0
        self._g = g
        self._direction = torch.randn(NUMEL, generator=g)
        self.updates: list[float] = []

    def step(self) -> None:
        noise = torch.randn(NUMEL, generator=self._g)
        update = 0.01 * (self._direction + noise) / (self._direction + noise).norm()
        self.momentum = MU * self.momentum + update
        self.theta = self.theta - LR * (update + MU * self.momentum)
        self.tokens += 2048
        self.round += 1
        self.updates.append(float(update.norm()))

    def snapshot(self, *, momentum_times: float = 1.0) -> StateSnapshot:
        tensors = {THETA_G: self.theta.clone(), MOMENTUM: self.momentum * momentum_times}
        tensors[TOKENS] = torch.tensor([self.tokens], dtype=torch.int64)
        return StateSnapshot.of(swarm_id=SWARM, round=self.round, tensors=tensors)

    def reference(self) -> Reference:
        return Reference(
            theta_g=self.theta,
            momentum=self.momentum if self.round else None,
            tokens=self.tokens,
            outer_lr=LR,
            outer_momentum=MU,
        )


class Server:
    """A peer on its own address that serves one snapshot and counts what it served."""

    def __init__(self, node: NetNode, donor: StateDonor, holder: list[StateSnapshot]) -> None:
        self.node, self.donor, self._holder = node, donor, holder

    @property
    def peer_id(self) -> str:
        return self.node.identity.peer_id_hex

    @property
    def served(self) -> int:
        return self.donor.stats["served"]

    def serve(self, snapshot: StateSnapshot) -> None:
        self._holder[:] = [snapshot]


async def server(stack: AsyncExitStack, boot: NetNode | None, host: str) -> Server:
    identity = Identity.generate()
    holder: list[StateSnapshot] = []
    donor = StateDonor(identity=identity, snapshot=lambda: holder[0] if holder else None)
    node = await stack.enter_async_context(
        NetNode(
            identity=identity,
            config=NodeConfig(
                peers=(boot.endpoint,) if boot else (), server=ServerConfig(host=host)
            ),
            services=[state_service(donor)],
        )
    )
    return Server(node, donor, holder)


async def publish(
    node: NetNode, owner: Identity, *, round: int, digest: bytes, endpoint: str, claim: int
) -> None:
    """``owner``'s digest of ``round`` (served at ``endpoint``) and its progress claim,
    stored through ``node`` (a stranger needs no server per key)."""
    now = node.dht.clock()
    records = [
        make_record(
            digest_key(SWARM, round),
            {"digest": digest, "endpoint": endpoint, "at": now},
            expiration=now + 60,
            owner=owner,
        ),
        make_record(
            progress_key(SWARM),
            {"round": claim, "tokens": 0, "tokens_per_s": 1000.0, "at": now},
            expiration=now + 60,
            owner=owner,
        ),
    ]
    for record in records:
        assert await node.dht.store_record(record, republish=False) >= 1


def trained(*, seed: int, rounds: int) -> tuple[torch.Tensor, StateSnapshot]:
    """The initial weights of an honest trajectory and its state after ``rounds``."""
    honest = Trajectory(seed=seed)
    theta0 = honest.theta0.clone()
    for _ in range(rounds):
        honest.step()
    return theta0, honest.snapshot()


def partner_history(partners: list[str], trajectory: Trajectory, rounds: int) -> Evidence:
    """This peer averaged rounds 1..``rounds`` of ``trajectory`` with ``partners``."""
    evidence = Evidence()
    start = time.time() - 10.0 * rounds
    for r in range(1, rounds + 1):
        evidence.applied(
            0.05,
            at=start + 10.0 * r,
            lr=1e-3,
            update=trajectory.updates[r - 1],
            tokens=2048,
        )
        evidence.grouped(r, ["me", *partners], "me", AdoptionConfig())
    return evidence


def catchup(me: NetNode, evidence: Evidence) -> CatchUp:
    return catch_up_of(me, swarm_id=SWARM, numel=NUMEL, config=CONFIG, evidence=evidence)


async def honest_holders(
    stack: AsyncExitStack, good: StateSnapshot, count: int
) -> tuple[Server, list[Server]]:
    """A bootstrap node on 127.0.0.1 and ``count`` honest peers on 127.0.0.2 and on, each
    serving ``good`` (round 20) and saying so, working on round 21."""
    boot = await server(stack, None, "127.0.0.1")
    peers = [await server(stack, boot.node, f"127.0.0.{2 + i}") for i in range(count)]
    for p in peers:
        p.serve(good)
        node = p.node
        endpoint, key = node.endpoint, node.identity
        await publish(node, key, round=20, digest=good.digest, endpoint=endpoint, claim=21)
    return boot, peers


async def fresh_joiner_looks(stack: AsyncExitStack, boot: Server, theta0: torch.Tensor) -> Found:
    """A fresh peer joined through ``boot``, its own state ``theta0``: what one look of its
    catch-up finds."""
    me = await stack.enter_async_context(
        NetNode(identity=Identity.generate(), config=NodeConfig(peers=(boot.node.endpoint,)))
    )
    fresh = Reference(theta_g=theta0, momentum=None, tokens=0, outer_lr=LR, outer_momentum=MU)
    look = catchup(me, Evidence())
    return await look.find(round=0, digest=None, reference=fresh, distrusted=set())


@pytest.mark.parametrize("momentum_times", [1000.0, 1.0])
async def test_sybil_digests_of_the_round_just_applied_change_nothing(momentum_times):
    """This peer applied round 12 with its partner; 200 fresh keys publish another digest
    of round 12 (and claim rounds ahead) and four addresses serve it: the honest weights
    with the momentum x1000, or the state before the round (x1: a majority that would
    make every peer throw its round away). Nothing is downloaded, nothing adopted."""
    honest = Trajectory(seed=1)
    for _ in range(11):
        honest.step()
    before = honest.snapshot()  # round 11
    honest.step()
    mine = honest.snapshot()  # round 12, what this peer and its partner hold
    forged = honest.snapshot(momentum_times=momentum_times) if momentum_times != 1 else before
    forged = StateSnapshot.of(swarm_id=SWARM, round=12, tensors=dict(forged.tensors))
    async with AsyncExitStack() as stack:
        boot = await server(stack, None, "127.0.0.1")
        partner = await server(stack, boot.node, "127.0.0.2")
        partner.serve(mine)
        attackers = [await server(stack, boot.node, f"127.0.0.{10 + i}") for i in range(4)]
        for a in attackers:
            a.serve(forged)
        me = await stack.enter_async_context(
            NetNode(identity=Identity.generate(), config=NodeConfig(peers=(boot.node.endpoint,)))
        )
        await publish(
            partner.node,
            partner.node.identity,
            round=12,
            digest=mine.digest,
            endpoint=partner.node.endpoint,
            claim=13,
        )
        for i in range(200):
            served_by = attackers[i % 4]
            key = served_by.node.identity if i < 4 else Identity.generate()
            for round, claim in ((12, 13), (13, 15)):
                await publish(
                    served_by.node,
                    key,
                    round=round,
                    digest=forged.digest,
                    endpoint=served_by.node.endpoint,
                    claim=claim,
                )
        evidence = partner_history([partner.peer_id], honest, 12)
        assert evidence.grouped_round == 12
        found = await catchup(me, evidence).find(
            round=12, digest=mine.digest, reference=honest.reference(), distrusted=set()
        )
    assert found.adopted is None
    assert sum(a.served for a in attackers) == 0  # not even asked
    # Strangers' digests are not worth a refusal line; their claims of later rounds, while
    # the partner reports, not even a read. They back nothing: pacing leaves them out.
    assert not found.refused
    assert len(found.unbacked) >= 100


async def test_a_fresh_joiner_that_reaches_honest_peers_and_sybils_takes_the_honest_state():
    """A newcomer (nothing of its own but the initial weights) sees round 20 held by four
    honest peers on four addresses and by eight attacker keys serving, from four addresses
    of their own, the honest weights with the momentum x1000. Networks are even, so it
    tries the state held by more keys first, refuses it whole (an outer step of that
    momentum reaches far further than training went from the initial weights), distrusts
    its holders, and takes the honest state."""
    honest = Trajectory(seed=2)
    theta0 = honest.theta0.clone()
    for _ in range(20):
        honest.step()
    good = honest.snapshot()
    forged = honest.snapshot(momentum_times=1000.0)
    async with AsyncExitStack() as stack:
        boot, _ = await honest_holders(stack, good, 4)
        attackers = [await server(stack, boot.node, f"127.0.0.{10 + i % 4}") for i in range(8)]
        for a in attackers:
            a.serve(forged)
            await publish(
                a.node,
                a.node.identity,
                round=20,
                digest=forged.digest,
                endpoint=a.node.endpoint,
                claim=21,
            )
        found = await fresh_joiner_looks(stack, boot, theta0)
    assert found.adopted is not None
    assert found.adopted.snapshot.digest == good.digest
    refused = [r for r in found.refused if r.digest == forged.digest.hex()]
    assert refused and "outer momentum" in refused[0].reason
    assert {a.peer_id for a in attackers} & found.distrusted
    assert sum(a.served for a in attackers) >= 1  # it was tried, and refused whole


async def exilers(
    stack: AsyncExitStack, boot: Server, exile: StateSnapshot, count: int
) -> list[Server]:
    """``count`` attackers on addresses of their own (127.0.0.10 on) serving ``exile`` (the
    round before a far one) and claiming that far round."""
    attackers = [await server(stack, boot.node, f"127.0.0.{10 + i}") for i in range(count)]
    for a in attackers:
        a.serve(exile)
        node = a.node
        await publish(
            node,
            node.identity,
            round=exile.round,
            digest=exile.digest,
            endpoint=node.endpoint,
            claim=exile.round + 1,
        )
    return attackers


async def test_the_swarms_weights_under_rounds_it_never_reaches_do_not_exile_a_fresh_joiner():
    """Three honest peers on three addresses hold round 20. Two attacker keys on two
    addresses of their own serve the honest weights themselves under round R - 1, R = 10^9,
    and claim R (setting a stranger's ceiling there); three more keys claim R - 2, R - 4
    and R - 6, so the eight newest rounds are all the attacker's. The state passes every
    check a fresh peer can make (it is the swarm's); had the joiner taken it from the first
    rounds it read, it would wait for rounds the swarm never reaches. It weighs every round
    it read and takes round 20, held from more networks."""
    theta0, good = trained(seed=4, rounds=20)
    far = 10**9
    exile = StateSnapshot.of(swarm_id=SWARM, round=far - 1, tensors=dict(good.tensors))
    async with AsyncExitStack() as stack:
        boot, peers = await honest_holders(stack, good, 3)
        attackers = await exilers(stack, boot, exile, 2)
        for claimed in (far - 2, far - 4, far - 6):
            await claim(attackers[0].node, Identity.generate(), claim=claimed)
        found = await fresh_joiner_looks(stack, boot, theta0)
    assert found.adopted is not None
    assert found.adopted.snapshot.round == 20
    assert found.adopted.donor.peer_id in {p.peer_id for p in peers}
    assert sum(a.served for a in attackers) == 0


@pytest.mark.parametrize("through", ["bootstrap", "honest peer", "creator"])
async def test_a_fresh_joiner_takes_the_state_of_a_peer_it_has_first_hand_reason_to_trust(
    through,
):
    """One honest peer holds round 20; attackers on three addresses of their own serve the
    swarm's weights themselves under round 10^9 - 1 (every check a fresh peer can make
    passes). Joined through the bootstrap node alone, in a run someone else created, a
    fresh peer takes the state held from the most networks: the attackers' (the limit
    docs/SECURITY.md states). Joined through the honest peer's address (``--peer``, its
    operator's choice), or in a run the honest peer created (the swarm id names its key),
    it takes that peer's state first, and never asks the attackers."""
    theta0, good = trained(seed=5, rounds=20)
    far = 10**9
    exile = StateSnapshot.of(swarm_id=SWARM, round=far - 1, tensors=dict(good.tensors))
    async with AsyncExitStack() as stack:
        boot, [honest] = await honest_holders(stack, good, 1)
        attackers = await exilers(stack, boot, exile, 3)
        entry = honest if through == "honest peer" else boot
        me = await stack.enter_async_context(
            NetNode(identity=Identity.generate(), config=NodeConfig(peers=(entry.node.endpoint,)))
        )
        creator = honest.node.identity if through == "creator" else Identity.generate()
        manifest = SwarmManifest(
            task="gpt-bytes",
            model={"preset": "tiny"},
            data={},
            hparams={},
            creator=creator.public_key.hex(),
        )
        assert trusted_peers(me, manifest) == {entry.peer_id, creator.peer_id_hex}
        fresh = Reference(theta_g=theta0, momentum=None, tokens=0, outer_lr=LR, outer_momentum=MU)
        look = catchup(me, Evidence())
        look.trusted = lambda: trusted_peers(me, manifest)
        found = await look.find(round=0, digest=None, reference=fresh, distrusted=set())
    assert found.adopted is not None
    if through == "bootstrap":
        assert found.adopted.snapshot.round == far - 1  # three networks against one
        return
    assert found.adopted.snapshot.round == 20
    assert found.adopted.donor.peer_id == honest.peer_id
    assert sum(a.served for a in attackers) == 0
    assert found.why.endswith("; held by 1 peer(s) it trusts (the creator or a --peer)")


async def claim(node: NetNode, owner: Identity, *, claim: int) -> None:
    """``owner``'s progress claim alone (no state behind it), stored through ``node``."""
    now = node.dht.clock()
    record = make_record(
        progress_key(SWARM),
        {"round": claim, "tokens": 0, "tokens_per_s": 1000.0, "at": now},
        expiration=now + 60,
        owner=owner,
    )
    assert await node.dht.store_record(record, republish=False) >= 1


@pytest.mark.parametrize("published", [False, True])
async def test_five_keys_claiming_rounds_far_ahead_do_not_keep_a_fresh_joiner_from_the_swarm(
    published,
):
    """Three honest peers on three addresses hold round 20 (working on 21). Five attacker
    keys claim rounds far ahead: two claim R = 10^9, which sets a stranger's ceiling there
    (the quorum is two claims), three claim R - 2, R - 4 and R - 6, so the eight newest
    rounds held, R - 1 .. R - 8, are all theirs. Nobody serves them: no state is published
    for them at all, or (``published``) each key publishes digests of the two rounds it
    claims to hold, at an address that serves nothing. A fresh joiner passes over them (a
    round with no state takes no place; states nobody hands over do not end the look) and
    takes the honest state of round 20, first: it weighs every round it read, and the
    swarm's is held from the most networks."""
    theta0, good = trained(seed=3, rounds=20)
    far = 10**9
    async with AsyncExitStack() as stack:
        boot, peers = await honest_holders(stack, good, 3)
        attacker = await server(stack, boot.node, "127.0.0.10")  # serves no state
        for i, claimed in enumerate((far, far, far - 2, far - 4, far - 6)):
            key = Identity.generate()
            await claim(attacker.node, key, claim=claimed)
            if published:
                for held in (claimed - 1, claimed - 2):
                    now = attacker.node.dht.clock()
                    record = make_record(
                        digest_key(SWARM, held),
                        {"digest": bytes([i]) * 32, "endpoint": attacker.node.endpoint, "at": now},
                        expiration=now + 60,
                        owner=key,
                    )
                    assert await attacker.node.dht.store_record(record, republish=False) >= 1
        found = await fresh_joiner_looks(stack, boot, theta0)
    assert found.adopted is not None
    assert found.adopted.snapshot.round == 20
    assert found.adopted.snapshot.digest == good.digest
    assert found.adopted.donor.peer_id in {p.peer_id for p in peers}
    assert not found.failed  # the attacker's states were not even asked for
    assert sum(p.served for p in peers) == 1
