"""Matchmaking and stream admission on loopback: dead leaders, strangers, join faults."""

import asyncio
import dataclasses
import logging
import time

import pytest
from avgutil import SWARM, averaging_peers, random_vectors
from netutil import closed_port

from swarmloco.errors import RejectedInput, RoundAborted
from swarmloco.net.averaging import (
    BandwidthConfig,
    BandwidthLimiter,
    Fault,
    FaultPlan,
    MatchmakingConfig,
    wire,
)
from swarmloco.net.averaging.matchmaking import leader_rank
from swarmloco.net.client import RpcClient
from swarmloco.net.deadline import Deadline
from swarmloco.net.identity import Identity
from swarmloco.net.records import make_record, peers_key, round_key, validate
from swarmloco.net.rejections import Rejection
from swarmloco.net.swarm import announce_peer
from swarmloco.proto.v1 import averaging_pb2 as pb


async def form(peers, round, numel, deadline):
    return await asyncio.gather(
        *(
            p.matchmaker.form_group(
                round, weight=1.0, numel=numel, block_size=64, deadline=deadline
            )
            for p in peers
        )
    )


def first_round_led_by(peers, leader, *, start=1):
    """The first round from ``start`` in which ``peers[leader]`` is first in the order of
    leadership among ``peers``."""
    ids = [p.peer_id for p in peers]
    for round in range(start, start + 1000):
        ranks = [leader_rank(SWARM, round, i) for i in ids]
        if min(ranks) == ranks[leader]:
            return round
    raise AssertionError("no such round in 1000")


async def test_a_leader_that_announced_and_died_costs_one_failed_call():
    config = MatchmakingConfig(max_group_size=2, gather_s=5.0, poll_s=0.1)
    async with averaging_peers(3, matchmaking=config) as peers:
        # Peer 2 announces itself for a round it would lead, with an endpoint nobody
        # listens on, and takes no part (a peer that crashed right after announcing).
        round = first_round_led_by(peers, 2)
        ghost = peers[2].node.dht
        await ghost.store(
            round_key(SWARM, round),
            {
                "endpoint": f"127.0.0.1:{closed_port()}",
                "weight": 1.0,
                "bandwidth": 1.0,
                "client_mode": False,
                "announced_at": time.time(),
                "numel": 640,
            },
            ttl=60,
        )
        started = time.monotonic()
        groups = await form(peers[:2], round, 640, Deadline.after(10))
        assert time.monotonic() - started < 3
        assert groups[0].group_id == groups[1].group_id and groups[0].size == 2


async def test_an_announcement_claiming_the_earliest_time_does_not_win_leadership():
    # A liar announces for a round it is last in the order of leadership, dated long
    # before anyone else, at an address that counts who calls it: the honest peers form
    # their group without calling it even once.
    calls = 0

    async def count(reader, writer):
        nonlocal calls
        calls += 1
        writer.close()

    trap = await asyncio.start_server(count, "127.0.0.1", 0)
    port = trap.sockets[0].getsockname()[1]
    config = MatchmakingConfig(max_group_size=2, gather_s=5.0, poll_s=0.1)
    try:
        async with averaging_peers(3, matchmaking=config) as peers:
            ids = [p.peer_id for p in peers]
            round = next(
                r
                for r in range(1, 1000)
                if leader_rank(SWARM, r, ids[2]) > max(leader_rank(SWARM, r, i) for i in ids[:2])
            )
            await peers[2].node.dht.store(
                round_key(SWARM, round),
                {
                    "endpoint": f"127.0.0.1:{port}",
                    "weight": 1.0,
                    "bandwidth": 1.0,
                    "client_mode": False,
                    "announced_at": 0.0,
                    "numel": 640,
                },
                ttl=60,
            )
            groups = await form(peers[:2], round, 640, Deadline.after(10))
            assert groups[0].group_id == groups[1].group_id and groups[0].size == 2
            leader = groups[0].members[0].peer_id
            assert leader == min(ids[:2], key=lambda i: leader_rank(SWARM, round, i))
    finally:
        trap.close()
        await trap.wait_closed()
    assert calls == 0


def test_each_peer_leads_about_its_share_of_rounds_whatever_it_announces():
    ids = [Identity.generate().peer_id_hex for _ in range(4)]
    led = dict.fromkeys(ids, 0)
    for round in range(2000):
        led[min(ids, key=lambda i: leader_rank(SWARM, round, i))] += 1
    # Binomial(2000, 1/4): mean 500, sd 19; 400 and 600 are more than 5 sd away.
    assert all(400 < n < 600 for n in led.values()), led
    assert leader_rank(SWARM, 7, ids[0]) == leader_rank(SWARM, 7, ids[0])
    assert leader_rank(SWARM, 7, ids[0]) != leader_rank("other", 7, ids[0])


async def test_a_leader_closes_once_the_expected_peers_joined():
    # A long gathering window: without `expected` the leader would wait all of it.
    config = MatchmakingConfig(gather_s=8.0, poll_s=0.1)
    async with averaging_peers(3, matchmaking=config) as peers:
        started = time.monotonic()
        groups = await asyncio.gather(
            *(
                p.matchmaker.form_group(
                    1,
                    weight=1.0,
                    numel=640,
                    block_size=64,
                    deadline=Deadline.after(20),
                    expected=3,
                )
                for p in peers
            )
        )
        assert time.monotonic() - started < 4
        assert len({g.group_id for g in groups}) == 1 and groups[0].size == 3
        # Alone and expecting nobody else: a group of one at once.
        started = time.monotonic()
        alone = await peers[0].matchmaker.form_group(
            2, weight=1.0, numel=640, block_size=64, deadline=Deadline.after(20), expected=1
        )
        assert alone.size == 1 and time.monotonic() - started < 2
        with pytest.raises(ValueError, match="expected"):
            await peers[0].matchmaker.form_group(
                3, weight=1.0, numel=640, block_size=64, deadline=Deadline.after(5), expected=0
            )


def formed(caplog, round):
    """What the leader's log says of how ``round``'s group closed."""
    prefix = f"round {round}: formed a group"
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(prefix)]


async def test_strangers_cost_a_leader_whose_known_peers_joined_a_grace_not_the_window(caplog):
    """Progress claims under many keys fill the places a round keeps for strangers. Once
    the peers it knows joined, the leader waits for strangers a short grace, never the
    gathering window (here longer than the round's deadline: had it waited the window out,
    it would have closed at the deadline, saying so)."""
    caplog.set_level(logging.INFO, logger="swarmloco.net.averaging.matchmaking")
    config = MatchmakingConfig(gather_s=300.0, poll_s=0.1, stranger_grace_s=0.5)
    async with averaging_peers(2, matchmaking=config) as peers:
        round = first_round_led_by(peers, 0)
        deadline = Deadline.after(60.0)
        groups = await asyncio.gather(
            *(
                p.matchmaker.form_group(
                    round,
                    weight=1.0,
                    numel=640,
                    block_size=64,
                    deadline=deadline,
                    expected=2,
                    strangers=2,
                )
                for p in peers
            )
        )
        assert groups[0].group_id == groups[1].group_id
        assert {m.peer_id for m in groups[0].members} == {p.peer_id for p in peers}
        assert formed(caplog, round) == [
            f"round {round}: formed a group of 2 (its 2 known peer(s) joined, 0 of 2 "
            "stranger(s) within the 0.5 s grace)"
        ]
        # Knowing nobody else, and told of strangers only: a group of one after the grace.
        alone = await peers[0].matchmaker.form_group(
            round + 1, weight=1.0, numel=640, block_size=64, deadline=deadline,
            expected=1, strangers=2,
        )  # fmt: skip
        assert alone.size == 1
        assert formed(caplog, round + 1) == [
            f"round {round + 1}: formed a group of 1 (its 1 known peer(s) joined, 0 of 2 "
            "stranger(s) within the 0.5 s grace)"
        ]
        with pytest.raises(ValueError, match="strangers"):
            await peers[0].matchmaker.form_group(
                round + 2, weight=1.0, numel=640, block_size=64, deadline=deadline,
                expected=1, strangers=-1,
            )  # fmt: skip
    with pytest.raises(ValueError, match="stranger_grace_s"):
        MatchmakingConfig(stranger_grace_s=-1.0)


async def test_a_stranger_that_comes_within_the_grace_is_in_the_group(caplog):
    """A newcomer, not a partner of anyone yet, comes after the leader's known peers
    joined: the grace still takes it, and the group closes as soon as it is in."""
    caplog.set_level(logging.INFO, logger="swarmloco.net.averaging.matchmaking")
    config = MatchmakingConfig(gather_s=300.0, poll_s=0.1, stranger_grace_s=30.0)
    async with averaging_peers(3, matchmaking=config) as peers:
        round = first_round_led_by(peers, 0)
        deadline = Deadline.after(60.0)

        def join(p, **expecting):
            return p.matchmaker.form_group(
                round, weight=1.0, numel=640, block_size=64, deadline=deadline, **expecting
            )

        known = [asyncio.create_task(join(p, expected=2, strangers=1)) for p in peers[:2]]
        leader = peers[0].matchmaker
        while len(getattr(leader._leading.get(round), "declarations", ())) < 2:
            assert not deadline.expired, "the known follower never joined the leader"
            await asyncio.sleep(0.05)
        newcomer = await join(peers[2])
        groups = [*await asyncio.gather(*known), newcomer]
        assert len({g.group_id for g in groups}) == 1
        assert {m.peer_id for m in newcomer.members} == {p.peer_id for p in peers}
        assert formed(caplog, round) == [
            f"round {round}: formed a group of 3 (the 3 peer(s) expected joined)"
        ]


async def test_peers_that_come_after_the_group_formed_wait_for_it_instead_of_splitting():
    """Peers 0 and 1 form round r's group. Peers 2 and 3 come later (in a round where
    peer 2 is first in the order of leadership, so it asks nobody): rather than average
    the round as a second group of two (a split), each aborts it as late, to take the
    group's result. The marker that says so is the leader's word alone, so it costs one
    attempt: on the next, the two average together."""
    config = MatchmakingConfig(max_group_size=4, gather_s=2.0, poll_s=0.1)
    async with averaging_peers(4, matchmaking=config) as peers:
        round = first_round_led_by(peers, 2)
        deadline = Deadline.after(30.0)

        async def join(p, expected):
            return await p.matchmaker.form_group(
                round, weight=1.0, numel=64 * 8, block_size=64, deadline=deadline,
                expected=expected,
            )  # fmt: skip

        first = await asyncio.gather(join(peers[0], 2), join(peers[1], 2))
        assert {g.size for g in first} == {2}
        # The leader marks its entry once the group formed (in the background).
        key = round_key(SWARM, round)
        while not any(
            e.value.get("formed") == 2 for e in (await peers[3].node.dht.get(key)).entries.values()
        ):
            assert not deadline.expired, "the leader never marked its group formed"
            await asyncio.sleep(0.05)
        late = await asyncio.gather(join(peers[2], 2), join(peers[3], 2), return_exceptions=True)
        for outcome in late:
            assert isinstance(outcome, RoundAborted) and outcome.late, late
            assert "formed before this peer came" in str(outcome)
        again = await asyncio.gather(join(peers[2], 2), join(peers[3], 2))
        assert {g.size for g in again} == {2}
        assert {m.peer_id for m in again[0].members} == {peers[2].peer_id, peers[3].peer_id}


async def test_a_latecomer_learns_that_the_group_it_missed_aborted_and_joins_its_retry():
    """Peers 0 and 1 form round r's group without peer 2, and the leader marks it formed.
    Their round then aborts (here: they simply try r again), and the leader's new
    announcement carries no mark: peer 2, which would otherwise wait for a result that never
    comes, reads that and joins the retry, a group of all three."""
    config = MatchmakingConfig(max_group_size=4, gather_s=4.0, poll_s=0.1)
    async with averaging_peers(3, matchmaking=config) as peers:
        round = first_round_led_by(peers, 0)
        numel = 64 * 8
        deadline = Deadline.after(30.0)

        async def join(p, expected):
            return await p.matchmaker.form_group(
                round, weight=1.0, numel=numel, block_size=64, deadline=deadline,
                expected=expected,
            )  # fmt: skip

        first = await asyncio.gather(join(peers[0], 2), join(peers[1], 2))
        assert {g.size for g in first} == {2}
        late = peers[2].matchmaker
        while not await late.formed_without_us(round, numel):  # the mark is stored after
            assert not deadline.expired, "the leader never marked its group formed"
            await asyncio.sleep(0.05)
        # The members' own view: their group formed with them, not without.
        assert not await peers[1].matchmaker.formed_without_us(round, numel)
        assert not await late.formed_without_us(round, numel * 2)  # another vector size

        retry = [asyncio.create_task(join(p, 3)) for p in peers[:2]]
        while await late.formed_without_us(round, numel):
            assert not deadline.expired, "the retry's announcements never replaced the mark"
            await asyncio.sleep(0.05)
        groups = await asyncio.gather(*retry, join(peers[2], 3))
        assert {g.size for g in groups} == {3}


async def test_join_faults_fire_and_the_group_still_forms():
    plan = FaultPlan([Fault(action="delay", phase="join", seconds=0.2)])
    async with averaging_peers(3, faults={1: plan, 2: plan}) as peers:
        groups = await form(peers, 1, 640, Deadline.after(10))
    assert len({g.group_id for g in groups}) == 1 and groups[0].size == 3
    assert plan.fired[0] >= 1


async def test_strangers_and_forged_hellos_are_refused_and_counted():
    slow = {i: BandwidthLimiter(BandwidthConfig(upload_bytes_per_s=100_000)) for i in (0, 1)}
    vectors = random_vectors(2, 64 * 1000, seed=3)
    async with averaging_peers(2, limiters=slow) as peers:
        deadline = Deadline.after(20)
        groups = await form(peers, 1, vectors[0].numel(), deadline)
        group = groups[0]
        rounds = asyncio.gather(
            *(
                p.averager.all_reduce(g, v, deadline=deadline)
                for p, g, v in zip(peers, groups, vectors)
            )
        )
        target = next(p for p in peers if p.peer_id == group.members[0].peer_id)
        stranger = Identity.generate()
        hello = pb.StreamHello(group_id=group.group_id, round=1, sender=1, reducer=0)
        payload = wire.hello_payload(group.group_id, 1, 1, 0)
        hello.signature = stranger.sign(wire.HELLO_DOMAIN, payload)  # not member 1's key
        async with RpcClient() as client:
            channel = await client.open(target.node.endpoint, 10)
            call = channel.stream_stream(wire.AGGREGATE_PATH)(timeout=10)
            await call.write(wire.request(hello=hello))
            answer = wire.decode_response(await call.read())
            assert answer.WhichOneof("kind") == "refusal"
            assert answer.refusal.code == "not-member"
            call.cancel()
        results = await rounds
        assert results[0].report.digest == results[1].report.digest
        assert target.averager.rejections.counts["not-member"] == 1


def test_round_entries_are_owned_signed_and_schema_checked():
    owner = Identity.generate()
    key = round_key(SWARM, 12)
    value = {
        "endpoint": "127.0.0.1:5000",
        "weight": 3.0,
        "bandwidth": 1e6,
        "client_mode": False,
        "announced_at": 1000.0,
        "numel": 4096,
    }
    record = make_record(key, value, expiration=2000.0, owner=owner)
    assert record.subkey == owner.peer_id_hex
    assert validate(record, now=1000.0) == value
    with pytest.raises(ValueError, match="weight"):
        make_record(key, {**value, "weight": 3}, expiration=2000.0, owner=owner)
    with pytest.raises(ValueError, match="round number"):
        round_key(SWARM, -1)
    forged = dataclasses.replace(
        record,
        value=make_record(
            key, {**value, "weight": 1e9}, expiration=2000.0, owner=Identity.generate()
        ).value,
    )
    with pytest.raises(Rejection):
        validate(forged, now=1000.0)


async def test_a_leader_takes_at_most_its_cap_of_members_from_one_subnet():
    # Every peer calls from 127.0.0.1: one operator's keys, as far as the leader can tell.
    config = MatchmakingConfig(
        max_group_size=5,
        gather_s=2.0,
        poll_s=0.1,
        max_members_per_subnet=2,
        limit_private_subnets=True,
    )
    async with averaging_peers(5, matchmaking=config) as peers:
        groups = await asyncio.gather(
            *(
                p.matchmaker.form_group(
                    1, weight=1.0, numel=640, block_size=64, deadline=Deadline.after(20)
                )
                for p in peers
            )
        )
        assert all(g.size <= 2 for g in groups), [g.size for g in groups]
        # Those turned away formed groups of their own: every peer averages this round.
        by_id: dict[bytes, int] = {}
        for g in groups:
            by_id[g.group_id] = g.size
        assert sum(by_id.values()) == 5
        refused = sum(p.matchmaker.rejections.counts["subnet-full"] for p in peers)
        assert refused >= 1


async def test_a_leader_takes_only_keys_that_announced_themselves_in_the_peer_list():
    # Peers 0 and 1 announced themselves in the swarm's signed peer list; peer 2 (a key
    # made up on the spot, as a flood of fake members would be) did not.
    config = MatchmakingConfig(max_group_size=3, gather_s=2.0, poll_s=0.1)
    async with averaging_peers(3, matchmaking=config) as peers:
        for p in peers:
            p.matchmaker.peer_records = True
        for p in peers[:2]:
            await announce_peer(p.node.dht, SWARM, role="trainer")
        round = first_round_led_by(peers, 0)
        got = await asyncio.gather(
            *(
                p.matchmaker.form_group(
                    round, weight=1.0, numel=640, block_size=64, deadline=Deadline.after(20)
                )
                for p in peers
            ),
            return_exceptions=True,
        )
        assert got[0].size == 2 and got[0].group_id == got[1].group_id, got
        assert isinstance(got[2], RejectedInput) and "no signed record" in str(got[2])
        assert peers[0].matchmaker.rejections.counts["no-record"] == 1
        # Once it announced itself, the same key is taken in.
        await announce_peer(peers[2].node.dht, SWARM, role="trainer")
        round = first_round_led_by(peers, 0, start=round + 1)
        groups = await form(peers, round, 640, Deadline.after(20))
        assert {g.size for g in groups} == {3}


async def _sybil_keys(peers, listener_port, *, keys: int = 30, announced: bool):
    """``keys`` fresh keys (stored through peer 0's node: a stranger needs no server per
    key) at a listener that accepts connections and never answers; ``announced``: each
    with a signed record in the swarm's peer list."""
    dht = peers[0].node.dht
    endpoint = f"127.0.0.1:{listener_port}"
    sybils = [Identity.generate() for _ in range(keys)]
    if announced:
        now = dht.clock()
        peer = {"endpoint": endpoint, "role": "trainer", "version": "0.1.0", "public": True}
        for key in sybils:
            record = make_record(peers_key(SWARM), peer, expiration=now + 60, owner=key)
            await dht.store_record(record, republish=False)
    return sybils, endpoint


async def _lead_round(peers, sybils, endpoint, round):
    """Each of ``sybils`` announces itself ready to lead ``round`` at ``endpoint``."""
    dht = peers[0].node.dht
    now = dht.clock()
    entry = {
        "endpoint": endpoint,
        "weight": 1.0,
        "bandwidth": 1.0,
        "client_mode": False,
        "announced_at": 0.0,
        "numel": 640,
    }
    for key in sybils:
        record = make_record(round_key(SWARM, round), entry, expiration=now + 60, owner=key)
        await dht.store_record(record, republish=False)


@pytest.mark.parametrize("partners, announced", [(True, True), (False, False), (False, True)])
async def test_thirty_fake_leaders_that_never_answer_cost_a_round_seconds(partners, announced):
    """Thirty fresh keys announce themselves for a round at a listener that accepts TCP
    and never answers (each once cost a follower two 5 s TLS attempts: a round took
    minutes). Peers with partners follow only partners, so the fakes cost nothing; peers
    without partners skip keys absent from the swarm's peer list, and reach the announced
    ones all at once with a short first contact: the round forms within one first-contact
    deadline of its clean time."""
    held: list[asyncio.StreamWriter] = []

    async def silent(reader, writer):
        held.append(writer)  # accepted, never a byte back

    listener = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    config = MatchmakingConfig(max_group_size=3, gather_s=2.0, poll_s=0.1, first_contact_s=1.0)
    try:
        async with averaging_peers(3, matchmaking=config) as peers:
            ids = {p.peer_id for p in peers}
            for p in peers:
                p.matchmaker.peer_records = True
                await announce_peer(p.node.dht, SWARM, role="trainer")
                if partners:
                    p.matchmaker.partners = lambda me=p.peer_id: ids - {me}
            # Announced (or not) in the peer list before the clean round, which reads it.
            sybils, endpoint = await _sybil_keys(peers, port, announced=announced)
            clean_started = time.monotonic()
            clean = await form(peers, 1, 640, Deadline.after(30))
            clean_s = time.monotonic() - clean_started
            assert len({g.group_id for g in clean}) == 1 and clean[0].size == 3
            await _lead_round(peers, sybils, endpoint, 2)
            started = time.monotonic()
            groups = await form(peers, 2, 640, Deadline.after(60))
            elapsed = time.monotonic() - started
    finally:
        listener.close()
        for writer in held:
            writer.close()
    assert len({g.group_id for g in groups}) == 1 and groups[0].size == 3
    assert {m.peer_id for m in groups[0].members} == ids
    probed = bool(held)
    assert probed == (announced and not partners), len(held)
    # Within the first-contact deadline (once, all fakes together) of the clean round.
    assert elapsed < clean_s + config.first_contact_s + 2 * config.gather_s, (elapsed, clean_s)


async def test_a_leader_whose_attempt_gathered_too_few_does_not_say_the_round_formed():
    """Peer 0, first in the order of leadership, leads round r alone and aborts it (fewer
    than ``min_group_size``). Peer 1 comes next and asks it to lead: peer 0 must not
    answer that the round's group formed (none did), or peer 1 would wait, as late, for a
    result nobody publishes; each peer doing so to the other stalled a stage's rounds. Peer
    1 instead tries for itself (here it gathers too few as well: not late). Trying again,
    each (having gathered too few) follows anyone, so each asks the other, which answers
    that it follows the asker: the one ahead in the order of leadership leads and the
    other joins it (they used to redirect each other until both led alone again, in 5 of
    12 runs beside two busy loops)."""
    config = MatchmakingConfig(max_group_size=2, min_group_size=2, gather_s=1.0, poll_s=0.05)
    async with averaging_peers(2, matchmaking=config) as peers:
        round = first_round_led_by(peers, 0)
        deadline = Deadline.after(30.0)

        async def join(p):
            return await p.matchmaker.form_group(
                round, weight=1.0, numel=64 * 8, block_size=64, deadline=deadline, expected=2
            )

        for p in peers:  # each alone in turn: too few, and nobody late
            with pytest.raises(RoundAborted, match="at least 2 needed") as aborted:
                await join(p)
            assert not aborted.value.late
        again = await asyncio.gather(join(peers[0]), join(peers[1]))
        assert {g.size for g in again} == {2} and again[0].group_id == again[1].group_id
