"""The parts of matchmaking that decide alone (no network): whom a peer asks to lead it,
whether its round formed without it, and a leader's gathering of one round."""

import asyncio
import logging
import time

import pytest

from swarmloco.net.averaging.candidates import (
    formed_marked,
    leader_candidates,
    leader_rank,
    servers,
)
from swarmloco.net.averaging.group import sign_declaration
from swarmloco.net.averaging.leading import Gathering, TooFew, closing_reason
from swarmloco.net.averaging.matchmaking import MatchmakingConfig, targets
from swarmloco.net.dht.node import Entry
from swarmloco.net.identity import Identity
from swarmloco.net.rejections import RejectionLog

SWARM = "ab" * 20
ROUND = 7
NUMEL = 64 * 8
logger = logging.getLogger(__name__)


def entry(peer_id: str, *, endpoint: str = "8.8.8.8:4000", formed: int = 0, numel: int = NUMEL):
    value = {
        "endpoint": endpoint,
        "client_mode": not endpoint,
        "numel": numel,
        "formed": formed,
    }
    return Entry(peer_id, value, time.time() + 60, None)


def ids(count: int) -> list[str]:
    """``count`` peer ids in the round's order of leadership (first leads)."""
    found = [Identity.generate().peer_id_hex for _ in range(count)]
    return sorted(found, key=lambda p: leader_rank(SWARM, ROUND, p))


def candidates(entries, mine, *, serving=True, partners=(), lonely=False, records=None):
    return [
        c.peer_id
        for c in leader_candidates(
            servers(entries, mine=mine, numel=NUMEL, partners=set(partners)),
            swarm_id=SWARM,
            round=ROUND,
            mine=mine,
            serving=serving,
            partners=set(partners),
            lonely=lonely,
            records=records,
        )
    ]


# -- whom to follow ----------------------------------------------------------------------


def test_a_peer_follows_the_serving_peers_ahead_of_it_in_the_order_of_leadership():
    first, second, me, last = ids(4)
    entries = [entry(last), entry(first), entry(me), entry(second), entry("cd" * 20, endpoint="")]
    assert candidates(entries, me) == [first, second]
    # A client-mode peer, which cannot lead, may follow any serving peer.
    assert candidates(entries, me, serving=False) == [first, second, last]
    # A peer that led this round and gathered too few follows anyone now.
    assert candidates(entries, me, lonely=True) == [first, second, last]


def test_a_peer_with_partners_follows_only_partners_and_a_newcomer_gathering_leaders_first():
    first, me, gathering = ids(3)
    entries = [entry(first), entry(gathering, formed=1)]
    assert candidates(entries, me, partners={gathering}) == []  # a partner behind us
    assert candidates(entries, me) == [gathering, first]  # a newcomer asks it first


def test_a_peer_not_in_the_swarms_peer_list_at_its_endpoint_is_never_asked():
    first, second, me = ids(3)
    entries = [entry(first), entry(second)]
    records = {first: "8.8.8.8:4000", second: "9.9.9.9:4000"}
    assert candidates(entries, me, records=records) == [first]


def test_only_a_partners_formed_mark_counts_once_a_peer_has_partners():
    stranger, partner, me = ids(3)
    marked = [entry(stranger, formed=3)]
    assert formed_marked(marked, mine=me, numel=NUMEL, ours=(), partners=())
    assert not formed_marked(marked, mine=me, numel=NUMEL, ours=(), partners={partner})
    assert not formed_marked(marked, mine=me, numel=NUMEL, ours={stranger}, partners=())
    gathering = [entry(partner, formed=1)]  # gathering now: not formed yet
    assert not formed_marked(gathering, mine=me, numel=NUMEL, ours=(), partners={partner})


# -- a leader's gathering ----------------------------------------------------------------


def declaration(identity: Identity, weight: float = 1.0, endpoint: str = "8.8.8.8:4000"):
    return sign_declaration(
        identity,
        endpoint=endpoint,
        weight=weight,
        bandwidth=1.0,
        swarm_id=SWARM,
        round=ROUND,
        numel=NUMEL,
        block_size=64,
        timestamp_ms=int(time.time() * 1000),
    )


def gathering_of(
    config: MatchmakingConfig,
    rejections: RejectionLog | None = None,
    partners: frozenset[str] = frozenset(),
) -> Gathering:
    return Gathering(
        me=declaration(Identity.generate(), endpoint="1.1.1.1:4000"),
        own_subnet="1.1.1.0/24",
        swarm_id=SWARM,
        admission=None,
        rejections=rejections or RejectionLog(logger),
        config=config,
        partners=partners,
    )


def join(gathering: Gathering, subnet: str = "8.8.8.0/24", identity: Identity | None = None):
    identity = identity or Identity.generate()
    endpoint = f"{subnet.split('/')[0][:-1]}8:4000"
    return identity.peer_id_hex, gathering.admit(
        declaration(identity, endpoint=endpoint), identity.peer_id_hex, subnet, "8.8.8.8"
    )


async def test_a_gathering_takes_at_most_its_members_per_subnet_and_counts_the_refusal():
    rejections = RejectionLog(logger)
    gathering = gathering_of(MatchmakingConfig(max_members_per_subnet=2), rejections)
    assert isinstance(join(gathering)[1], asyncio.Future)
    assert isinstance(join(gathering)[1], asyncio.Future)
    _, third = join(gathering)
    assert third.refused.code == "subnet-full" and rejections.counts["subnet-full"] == 1
    assert len(gathering.declarations) == 3  # the leader and two from 8.8.8.0/24
    assert isinstance(join(gathering, subnet="9.9.9.0/24")[1], asyncio.Future)


async def test_a_follower_that_gives_up_leaves_the_gathering_and_its_subnet_place():
    gathering = gathering_of(MatchmakingConfig(max_members_per_subnet=1))
    peer, waiter = join(gathering)
    gathering.withdraw(peer, waiter)
    assert len(gathering.declarations) == 1 and peer not in gathering.waiters
    assert isinstance(join(gathering)[1], asyncio.Future)  # its place is free again


async def test_a_gathering_of_too_few_answers_everyone_with_the_reason():
    gathering = gathering_of(MatchmakingConfig(min_group_size=3))
    _, waiter = join(gathering)
    with pytest.raises(TooFew, match="2 member"):
        gathering.close("its gathering window closed")
    assert waiter.result().refused.code == "too-few"


async def test_a_gathering_closes_with_one_group_for_all_or_hands_everyone_over():
    gathering = gathering_of(MatchmakingConfig())
    _, waiter = join(gathering)
    group = gathering.close("the group is full")
    assert group.size == 2 and waiter.result().group.round == ROUND
    other = gathering_of(MatchmakingConfig())
    _, waiter = join(other)
    other.hand_over("7.7.7.7:4000")
    assert other.closed and waiter.result().redirect == "7.7.7.7:4000"


async def test_once_the_known_peers_joined_strangers_get_only_the_grace():
    config = MatchmakingConfig(stranger_grace_s=0.05, poll_s=10.0)
    gathering = gathering_of(config)
    loop = asyncio.get_running_loop()
    window_closes = loop.time() + 60.0
    gave_way = []

    async def give_way() -> None:
        gave_way.append(True)

    close_at = await gathering.wait(3, 1, window_closes, give_way=give_way)
    assert close_at < window_closes
    why = closing_reason(1, enough=3, known=1, strangers=2, graced=True, config=config)
    assert why == "its 1 known peer(s) joined, 0 of 2 stranger(s) within the 0.05 s grace"


def test_a_leader_gathers_its_expected_peers_and_strangers_up_to_the_group_cap():
    assert targets(None, 5, 64) == (64, 64)
    assert targets(3, 2, 64) == (5, 3)
    assert targets(3, 2, 4) == (4, 3)


async def test_a_leader_with_partners_waits_for_them_not_for_strangers_that_came_first():
    """Expecting its two partners (three peers, itself included) and no stranger, a leader
    with partners is not closed by strangers that come first: they take at most
    ``max_strangers`` places (the next is refused, ``strangers-full``) and count for none
    of the expected peers; the group closes once the partners are in."""
    partners = [Identity.generate() for _ in range(2)]
    config = MatchmakingConfig(stranger_grace_s=0.05, poll_s=10.0, max_strangers=2)
    rejections = RejectionLog(logger)
    gathering = gathering_of(
        config, rejections, partners=frozenset(i.peer_id_hex for i in partners)
    )
    for n in range(2):
        assert isinstance(join(gathering, subnet=f"9.9.{n}.0/24")[1], asyncio.Future)
    _, third = join(gathering, subnet="9.9.2.0/24")
    assert third.refused.code == "strangers-full" and rejections.counts["strangers-full"] == 1
    loop = asyncio.get_running_loop()
    window_closes = loop.time() + 60.0
    waiting = asyncio.create_task(gathering.wait(3, 3, window_closes, give_way=_nothing))
    await asyncio.sleep(0)
    assert not waiting.done()  # three declarations, none of them a partner
    join(gathering, subnet="7.7.1.0/24", identity=partners[0])
    await asyncio.sleep(0)
    assert not waiting.done()
    join(gathering, subnet="7.7.2.0/24", identity=partners[1])
    assert await asyncio.wait_for(waiting, 5) == window_closes  # closed by the partners
    group = gathering.close("the 3 peer(s) expected joined")
    strangers = [m for m in group.members[1:3]]
    assert all(not m.serving and group.parts[i + 1][1] == 0 for i, m in enumerate(strangers))
    assert all(group.members[i].serving for i in (0, 3, 4))


async def test_a_leader_without_partners_takes_everyone_alike():
    gathering = gathering_of(MatchmakingConfig(max_strangers=0))
    for n in range(3):
        assert isinstance(join(gathering, subnet=f"9.9.{n}.0/24")[1], asyncio.Future)
    group = gathering.close("its gathering window closed")
    assert all(m.serving for m in group.members) and all(b > 0 for _, b in group.parts)


async def _nothing() -> None:
    return None
