#!/usr/bin/env python3
"""What a new DHT contact costs a node that holds many keys: prints ONE JSON object.

A node hands each contact new to its routing table the records of the keys it is now one of
the k closest nodes to (``net/dht/replication.py``). Which keys those are is a look at every
held key (up to 4,096) against the routing table, on the event loop (a slice of keys at a
time). Keys cost whoever stores them only a free key's signature when they are records of
made-up swarms (docs/SECURITY.md, "Records of made-up swarms"), and contacts that drop and
come back count as new, so this look is a CPU price a stranger can make a node pay.

In this process: ``--keys`` records stored under distinct keys, a routing table offered
``--contacts`` cards at random ids, then ``--trials`` new contacts, each timed through
``records_for``: ``handoff_look_s`` (median), ``handoff_records`` (what the last one got).
Run it with ``PYTHONPATH=<tree>/src`` to compare trees.

    python scripts/bench_handoff.py
    python scripts/bench_handoff.py --keys 4096 --contacts 74 --trials 15
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import machine

from swarmloco.net.dht.config import DhtConfig
from swarmloco.net.dht.contact import Contact
from swarmloco.net.dht.replication import records_for
from swarmloco.net.dht.routing import RoutingTable
from swarmloco.net.dht.storage import Storage, StorageConfig
from swarmloco.net.identity import Identity
from swarmloco.net.records import make_record, peers_key

PEER = {"endpoint": "203.0.113.7:4000", "role": "trainer", "version": "0.1.0", "public": True}


def contact(rng: random.Random, host: str) -> Contact:
    """A card at a random id (the look reads ids and nothing else of it)."""
    return Contact(rng.randbytes(20), b"", f"{host}:4000", 0, b"")


def run(args: argparse.Namespace) -> dict[str, Any]:
    now = time.time()
    storage = Storage(StorageConfig(max_records_per_sender=1 << 20), clock=lambda: now)
    owner = Identity.generate()
    for i in range(args.keys):
        key = peers_key(f"{i:040x}")  # the peers of a made-up swarm
        record = make_record(key, PEER, expiration=now + 600, owner=owner)
        if not storage.put(record, sender=owner.peer_id, network="203.0.113.0/24"):
            raise SystemExit(f"the storage refused key {i}: lower --keys")
    k = DhtConfig().k
    rng = random.Random(args.seed)
    routing = RoutingTable(rng.randbytes(20), k=k)
    offered = 0
    while len(routing) < args.contacts and offered < 100 * args.contacts:
        routing.add(contact(rng, f"10.{rng.randrange(256)}.{rng.randrange(256)}.1"), now=0)
        offered += 1
    times, got = [], 0
    for _ in range(args.trials):
        newcomer = contact(rng, "198.51.100.9")
        started = time.perf_counter()
        got = len(records_for(newcomer, storage=storage, routing=routing, k=k))
        times.append(time.perf_counter() - started)
    return {
        "benchmark": "handoff",
        "machine": machine(),
        "settings": {
            "keys": args.keys,
            "contacts": len(routing),
            "k": k,
            "trials": args.trials,
            "seed": args.seed,
        },
        "handoff_look_s": statistics.median(times),
        "handoff_look_s_all": [round(t, 5) for t in times],
        "handoff_records": got,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=4096, help="keys held (default 4096)")
    parser.add_argument(
        "--contacts", type=int, default=74, help="routing table contacts (default 74)"
    )
    parser.add_argument("--trials", type=int, default=15, help="new contacts timed")
    parser.add_argument("--seed", type=int, default=0)
    print(json.dumps(run(parser.parse_args()), indent=1))


if __name__ == "__main__":
    main()
