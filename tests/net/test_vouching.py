"""Which ``stage-load`` records a peer counts when it rebalances (``Vouching`` in
pipeline/load.py): a record counts once the server at its endpoint answers, with its own
checked card, as the record's key. Real nodes on loopback: a key that names another
peer's address, or an address where nothing serves, is not counted; a move announced
(no endpoint) counts only for a key whose server vouched for it before; the peer's own
record is not asked about; answers are kept; a read asks a bounded number of servers, one
network after another."""

from __future__ import annotations

import asyncio

from netutil import closed_port, loopback_network

from swarmloco.core.manifest import SwarmManifest
from swarmloco.net.identity import Identity
from swarmloco.pipeline import load as load_module
from swarmloco.pipeline.daemon import _read_loads
from swarmloco.pipeline.load import StageLoad, Vouching, publish_load

NOW = 1_800_000_000.0


def record(peer: str, endpoint: str, stage: int = 1, rate: float = 10.0) -> StageLoad:
    return StageLoad(peer=peer, stage=stage, endpoint=endpoint, rate=rate, queue=0, free=4, at=NOW)


async def test_a_record_counts_once_its_server_answers_as_its_key():
    async with loopback_network(3) as (a, b, me):
        asked: list[str] = []

        async def who_serves(endpoint: str, timeout: float):
            asked.append(endpoint)
            return await me.who_serves(endpoint, timeout)

        strangers = [Identity.generate().peer_id_hex for _ in range(3)]
        nowhere = f"127.0.0.1:{closed_port()}"
        loads = [
            record(a.identity.peer_id_hex, a.endpoint),  # a's own, at a's address
            record(strangers[0], b.endpoint, rate=1000.0),  # a stranger naming b's address
            record(b.identity.peer_id_hex, a.endpoint),  # b's key at a's address
            record(strangers[1], nowhere, rate=1000.0),  # an address where nothing serves
            record(strangers[2], "", rate=0.0),  # a move announced by a key never served
            record(me.identity.peer_id_hex, me.endpoint, stage=0),  # this peer's own
        ]
        now = [0.0]
        vouching = Vouching(who_serves, me.identity.peer_id_hex, clock=lambda: now[0])
        counted = await vouching.counted(loads)
        assert counted == [loads[0], loads[5]]
        assert sorted(asked) == sorted([a.endpoint, b.endpoint, a.endpoint, nowhere])
        # Kept: the next read asks nobody, and counts the same.
        asked.clear()
        assert await vouching.counted(loads) == counted and asked == []
        # Silence is asked about again soon (a replica away a moment), another key's
        # answer later, a vouched record's later still.
        now[0] = load_module.SILENT_S + 1
        assert await vouching.counted(loads) == counted and asked == [nowhere]
        now[0] = load_module.UNVOUCHED_S + 1
        asked.clear()
        assert await vouching.counted(loads) == counted
        assert sorted(asked) == sorted([b.endpoint, a.endpoint, nowhere])
        now[0] = load_module.VOUCHED_S + 1
        asked.clear()
        assert await vouching.counted(loads) == counted and a.endpoint in asked


async def test_a_read_asks_a_bounded_number_of_servers_one_network_after_another(monkeypatch):
    """Thirty records at dead addresses of one network and one honest record elsewhere:
    with 4 asked a read, the honest one is asked at the first read, not after the
    thirty."""
    monkeypatch.setattr(load_module, "VOUCH_ASKED", 4)
    async with loopback_network(2) as (a, me):
        asked: list[str] = []

        async def who_serves(endpoint: str, timeout: float):
            asked.append(endpoint)
            return await me.who_serves(endpoint, timeout)

        flood = [
            record(Identity.generate().peer_id_hex, f"127.0.0.2:{closed_port()}") for _ in range(30)
        ]
        honest = record(a.identity.peer_id_hex, a.endpoint)
        vouching = Vouching(who_serves, me.identity.peer_id_hex)
        assert await vouching.counted([*flood, honest]) == [honest]
        assert len(asked) == 4 and a.endpoint in asked
        asked.clear()
        assert await vouching.counted([*flood, honest]) == [honest]
        assert len(asked) == 4 and a.endpoint not in asked  # the flood's next four


async def test_a_joining_peer_reads_the_records_their_servers_vouch_for_from_client_mode():
    """A peer joining without --stage reads the records through a node of its own in
    client mode (no server) and counts those vouched for: its pings get answers too."""
    run = SwarmManifest(task="t", model={}, data={}, hparams={})  # (no work asked)
    async with loopback_network(3) as (a, b, stranger):
        swarm = run.swarm_id
        for node, stage in ((a, 1), (b, 0)):
            load = {"rate": 5.0, "queue": 0, "free": 4}
            await publish_load(node.dht, swarm, stage=stage, endpoint=node.endpoint, load=load)
        load = {"rate": 1e6, "queue": 0, "free": 4}
        await publish_load(stranger.dht, swarm, stage=1, endpoint=b.endpoint, load=load)
        read = await asyncio.to_thread(_read_loads, run, [a.endpoint], Identity.generate())
    assert sorted((x.peer, x.stage) for x in read) == sorted(
        [(a.identity.peer_id_hex, 1), (b.identity.peer_id_hex, 0)]
    )


async def test_a_move_counts_only_for_a_key_whose_server_vouched_for_it_before():
    """A record with no endpoint announces a move (nothing to ask): it counts when the
    key's server answered for an earlier record here, for :data:`MOVER_SERVED_S`; a
    stranger's, or one claiming a rate (nothing serves there to measure), never does."""
    async with loopback_network(2) as (a, me):
        mover = a.identity.peer_id_hex
        now = [0.0]
        vouching = Vouching(me.who_serves, me.identity.peer_id_hex, clock=lambda: now[0])
        moving = record(mover, "", stage=2, rate=0.0)
        strangers = [record(Identity.generate().peer_id_hex, "", rate=0.0) for _ in range(40)]
        claimed = record(Identity.generate().peer_id_hex, "", rate=1e6)
        assert await vouching.counted([moving, *strangers, claimed]) == []
        serving = record(mover, a.endpoint, stage=1)
        assert await vouching.counted([serving]) == [serving]
        # Later the same key announces its move: its server (now restarting at another
        # stage) is not asked, and the move counts for as long as a move may take.
        now[0] = load_module.MOVER_SERVED_S - 1
        assert await vouching.counted([moving, *strangers, claimed]) == [moving]
        # A record with no endpoint that claims a rate never counts, served before or not.
        assert await vouching.counted([record(mover, "", rate=5.0)]) == []
        now[0] = load_module.MOVER_SERVED_S + 1
        assert await vouching.counted([moving]) == []
