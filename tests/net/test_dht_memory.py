"""The same DHT code on the in-memory network: many nodes, churn, republish, expiry, upkeep."""

import random
import statistics
import time

from netutil import SWARM, wait_for

from swarmloco.net.dht.contact import distance
from swarmloco.net.dht.memory import MemoryCluster
from swarmloco.net.dht.wire import key_id
from swarmloco.net.records import peers_key

PEER = {"endpoint": "1.2.3.4:5", "role": "trainer", "version": "0.1.0", "public": True}


def random_key(rng: random.Random) -> str:
    return peers_key(f"{rng.getrandbits(160):040x}")


async def test_lookups_in_200_nodes_survive_20_percent_churn():
    rng = random.Random(7)
    async with MemoryCluster(rng=rng) as cluster:
        for _ in range(200):
            await cluster.add()
        keys = [random_key(rng) for _ in range(40)]
        for key in keys:
            assert await rng.choice(cluster.nodes).store(key, PEER, ttl=600) >= 20
        for _ in range(40):  # 20% leave abruptly, as many join
            await cluster.remove(rng.choice(cluster.nodes))
            await cluster.add()
        found, hops = 0, []
        for key in keys:
            result = await rng.choice(cluster.nodes).get(key)
            found += len(result.entries) == 1
            hops.append(result.hops)
        assert found == len(keys)
        assert statistics.median(hops) <= 4
        node_hops = []
        for _ in range(40):
            a, b = rng.sample(cluster.nodes, 2)
            lookup = await a.find_nodes(b.peer_id)
            assert b.peer_id in {c.peer_id for c in lookup.closest}
            node_hops.append(lookup.hops)
        assert statistics.median(node_hops) <= 4


async def test_newcomers_are_handed_the_records_they_are_now_closest_to():
    rng = random.Random(11)
    async with MemoryCluster(rng=rng) as cluster:
        for _ in range(25):
            await cluster.add()
        key = random_key(rng)
        await cluster.nodes[0].store(key, PEER, ttl=600)
        for _ in range(40):
            await cluster.add()
        target = key_id(key)
        closest = sorted(cluster.nodes, key=lambda n: distance(n.peer_id, target))[:20]
        await wait_for(lambda: all(n.storage.get(key) for n in closest))
        assert sum(n.stats["replicated"] for n in cluster.nodes) >= 1


async def test_republish_restores_records_after_every_holder_left():
    rng = random.Random(13)
    async with MemoryCluster(rng=rng) as cluster:
        for _ in range(60):
            await cluster.add()
        publisher = cluster.nodes[0]
        key = random_key(rng)
        await publisher.store(key, PEER, ttl=600)
        for holder in [n for n in cluster.nodes if n is not publisher and n.storage.get(key)]:
            await cluster.remove(holder)
        publisher.storage.sweep(now=float("inf"))  # the publisher's own copy is gone too
        assert (await cluster.nodes[5].get(key)).entries == {}
        assert await publisher.republish() == 1
        assert (await cluster.nodes[5].get(key)).entries


async def test_records_expire_on_every_node():
    now = [1_800_000_000.0]
    async with MemoryCluster(rng=random.Random(3), clock=lambda: now[0]) as cluster:
        for _ in range(30):
            await cluster.add()
        await cluster.nodes[4].store(peers_key(SWARM), PEER, ttl=60)
        assert (await cluster.nodes[9].get(peers_key(SWARM))).entries
        now[0] += 61
        assert (await cluster.nodes[9].get(peers_key(SWARM))).entries == {}
        for node in cluster.nodes:
            node.storage.sweep()
        assert sum(len(n.storage) for n in cluster.nodes) == 0
        assert await cluster.nodes[4].republish() == 0  # nothing left to republish


async def test_upkeep_refreshes_buckets_and_drops_dead_contacts():
    async with MemoryCluster(rng=random.Random(5)) as cluster:
        for _ in range(60):
            await cluster.add()
        node = cluster.nodes[-1]
        # Forget all but a few contacts (replacements included): the refresh's lookups in
        # every bucket must find others again through those few.
        while len(node.routing) > 3:
            node.routing.remove(next(iter(node.routing)).peer_id, now=time.monotonic())
        await node.refresh_buckets(older_than=0)
        assert len(node.routing) > 3
        dead = node.routing.stale(now=time.monotonic(), older_than=0, limit=5)  # pinged first
        for contact in dead:
            gone = next(n for n in cluster.nodes if n.peer_id == contact.peer_id)
            await cluster.remove(gone)
        await node.check_liveness(older_than=0)
        assert not any(c.peer_id in node.routing for c in dead)
