"""Which rounds a catch-up looks at (``runtime/catchup.py``), against a DHT in memory: the
records are what the test puts there, and a download hands over the state its digest
names, if some holder serves it."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from swarmloco.core.adoption import Evidence, Reference
from swarmloco.core.state import MOMENTUM, THETA_G, StateSchema, StateSnapshot
from swarmloco.net.records import digest_key, progress_key
from swarmloco.net.state import Donor, DownloadedState, StateTransferError
from swarmloco.runtime import catchup as catchup_module
from swarmloco.runtime.catchup import Candidate, CatchUp, CatchUpConfig

SWARM = "e4" * 20
NUMEL = 64
FAR = 10**9


@dataclasses.dataclass(frozen=True)
class Entry:
    subkey: str
    value: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Result:
    entries: dict[str, Entry]


class NoContacts:
    """A routing table that holds nobody (no donor has answered this peer yet)."""

    def get(self, node_id: bytes) -> None:
        return None


class MemoryDHT:
    """Records by key and subkey; counts the keys read."""

    def __init__(self) -> None:
        self.keys: dict[str, dict[str, Entry]] = {}
        self.reads: list[str] = []
        self.routing = NoContacts()

    def put(self, key: str, subkey: str, value: dict[str, Any]) -> None:
        self.keys.setdefault(key, {})[subkey] = Entry(subkey, value)

    async def get(self, key: str) -> Result:
        self.reads.append(key)
        return Result(dict(self.keys.get(key, {})))


class Swarm:
    """Honest peers at one round, serving their state, and keys that claim rounds."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.dht = MemoryDHT()
        self.theta0 = torch.zeros(NUMEL)
        self.served: dict[bytes, StateSnapshot] = {}
        self.asked: list[str] = []
        monkeypatch.setattr(catchup_module, "download_state", self.download)

    def claim(self, peer: str, round: int) -> None:
        progress = {"round": round, "tokens": 0, "tokens_per_s": 1.0, "at": 1.0}
        self.dht.put(progress_key(SWARM), peer, progress)

    def hold(self, peer: str, round: int, digest: bytes) -> None:
        self.dht.put(digest_key(SWARM, round), peer, {"digest": digest, "endpoint": f"{peer}:1"})

    def honest(self, peers: int, round: int) -> StateSnapshot:
        theta = self.theta0 + 0.01
        state = StateSnapshot.of(
            swarm_id=SWARM, round=round, tensors={THETA_G: theta, MOMENTUM: torch.zeros(NUMEL)}
        )
        self.served[state.digest] = state
        for n in range(peers):
            self.claim(f"honest{n}", round + 1)
            self.hold(f"honest{n}", round, state.digest)
        return state

    async def download(self, client: Any, donors: list[Donor], **kw: Any) -> DownloadedState:
        self.asked += [d.peer_id for d in donors]
        state = self.served.get(kw["expected_digest"])
        if state is None:
            raise StateTransferError("nobody handed it over", ())
        return DownloadedState(state, donors[0], (), 0.0)

    async def join(self, trusted: frozenset[str] = frozenset()) -> catchup_module.Found:
        """A fresh peer's look (``trusted``: the peers it joined through at addresses its
        operator gave)."""
        finder = CatchUp(
            me="me",
            swarm_id=SWARM,
            dht=self.dht,  # type: ignore[arg-type]
            client=None,  # type: ignore[arg-type]
            schema=StateSchema.diloco(NUMEL),
            evidence=Evidence(),
            config=CatchUpConfig(),
            trusted=lambda: trusted,
        )
        fresh = Reference(
            theta_g=self.theta0, momentum=None, tokens=0, outer_lr=0.7, outer_momentum=0.9
        )
        return await finder.find(round=0, digest=None, reference=fresh, distrusted=set())


@pytest.mark.parametrize("published", [False, True])
async def test_keys_claiming_rounds_nobody_serves_do_not_crowd_out_the_swarms_round(
    monkeypatch, published
):
    """Two keys claiming round R set a stranger's ceiling at R; three more claim R - 2,
    R - 4, R - 6: the eight newest rounds held are the attacker's. Rounds with no state, or
    (``published``: a digest of each round a key claims to hold) whose states nobody hands
    over, do not end the look: the honest round is read next and its state taken, first
    (a fresh peer weighs every round it read: the swarm's state has the most holders)."""
    swarm = Swarm(monkeypatch)
    good = swarm.honest(peers=2, round=20)
    for i, claimed in enumerate((FAR, FAR, FAR - 2, FAR - 4, FAR - 6)):
        swarm.claim(f"key{i}", claimed)
        if published:
            for held in (claimed - 1, claimed - 2):
                swarm.hold(f"key{i}", held, bytes([i]) * 32)
    found = await swarm.join()
    assert found.adopted is not None and found.adopted.snapshot.digest == good.digest
    assert not found.failed and set(swarm.asked) <= {"honest0", "honest1"}
    digests_read = [k for k in swarm.dht.reads if k != progress_key(SWARM)]
    assert len(digests_read) == 8 + 2  # R - 1 .. R - 8, then the swarm's 20 and 19


async def test_a_crowd_of_claims_costs_reads_not_the_rounds_most_claims_name(monkeypatch):
    """A hundred keys claim a hundred rounds far ahead, one each. The joiner reads the
    eight newest rounds held, then those the most claims name (the swarm's two, which its
    three peers name, first), up to ``rounds_read`` in all (a fresh peer weighs every round
    it read before it takes one), and takes the swarm's state."""
    swarm = Swarm(monkeypatch)
    good = swarm.honest(peers=3, round=20)
    for i in range(100):
        swarm.claim(f"key{i}", FAR - 3 * i)
    found = await swarm.join()
    assert found.adopted is not None and found.adopted.snapshot.digest == good.digest
    digests_read = [k for k in swarm.dht.reads if k != progress_key(SWARM)]
    assert len(digests_read) == CatchUpConfig().rounds_read
    assert digest_key(SWARM, 20) in digests_read[8:16]


async def test_a_peer_reads_no_more_than_rounds_read_rounds(monkeypatch):
    """Two hundred keys claiming rounds nobody holds: the look ends after ``rounds_read``
    rounds read, with nothing adopted and every one of those keys left out of pacing."""
    swarm = Swarm(monkeypatch)
    for i in range(200):
        swarm.claim(f"key{i}", FAR - 3 * i)
    found = await swarm.join()
    assert found.adopted is None and not swarm.asked
    digests_read = [k for k in swarm.dht.reads if k != progress_key(SWARM)]
    assert len(digests_read) == CatchUpConfig().rounds_read
    assert len(found.unbacked) == 200


@pytest.mark.parametrize("trusted", [False, True])
async def test_the_rounds_of_the_peer_joined_through_are_read_before_a_crowd_of_claims(
    monkeypatch, trusted
):
    """One honest peer at round 20; keys name 40 rounds far ahead two keys each, more than
    the swarm's rounds are named by, so the 64 rounds read are all theirs (the price
    docs/SECURITY.md states) and the look adopts nothing. A peer that joined through the
    honest peer's address reads its rounds first, and takes its state."""
    swarm = Swarm(monkeypatch)
    good = swarm.honest(peers=1, round=20)
    for i in range(80):
        swarm.claim(f"key{i}", FAR - 3 * (i // 2))
    found = await swarm.join(frozenset({"honest0"}) if trusted else frozenset())
    digests_read = [k for k in swarm.dht.reads if k != progress_key(SWARM)]
    if not trusted:
        assert found.adopted is None and digest_key(SWARM, 20) not in digests_read
        return
    assert found.adopted is not None and found.adopted.snapshot.digest == good.digest
    assert digests_read[:2] == [digest_key(SWARM, 20), digest_key(SWARM, 19)]


def test_holders_at_names_under_one_domain_count_as_one_network():
    """A state's holders count by the networks they answered at; names under one domain
    are one (its owner makes as many as it likes, pointing at one machine), and a name of
    one label (a container's) counts alone, as an address does."""
    keys = tuple(f"key{i}" for i in range(20))
    named = {k: f"a{i}.evil.example:4000" for i, k in enumerate(keys)}
    answered = frozenset(keys)
    assert Candidate(5, b"d" * 16, keys, named, answered=answered).networks == 1
    more = {**named, "x": "203.0.113.5:4000", "y": "peer1:4000", "z": "peer2:4000"}
    everyone = (*keys, "x", "y", "z")
    assert Candidate(5, b"d" * 16, everyone, more, answered=frozenset(everyone)).networks == 4
