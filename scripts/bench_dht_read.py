#!/usr/bin/env python3
"""What a reader's first read of a full key costs its event loop: prints ONE JSON object.

A key can hold 4,096 records (``peers``: 256 from each of 16 source networks), each signed
by a free key, and a reader checks the signature of every record it has not seen before
(docs/SECURITY.md, "Records per source network"): a stranger on 16 networks who keeps
storing fresh records makes every reader of the swarm's peers pay that on each poll.

A DHT node in a child process holds ``--records`` fresh ``peers`` records of one swarm (16
source networks at most 256 each); then, ``--trials`` times, a new client-mode node in
this process (nothing checked yet) reads the key with ``find_peers`` while a probe on its
event loop sleeps 5 ms at a time and notes how late it wakes: ``read_s`` (median wall time
of a read), ``loop_lag_max_s`` (median over reads of the latest wake-up),
``process_cpu_s`` (median CPU of this process a read), ``found`` (records the last read
returned). Run it with ``PYTHONPATH=<tree>/src`` to compare trees.

    python scripts/bench_dht_read.py
    python scripts/bench_dht_read.py --records 4096 --trials 7
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import machine

from swarmloco.net.identity import Identity
from swarmloco.net.node import NetNode, NodeConfig
from swarmloco.net.records import make_record, peers_key
from swarmloco.net.server import ServerConfig
from swarmloco.net.swarm import find_peers

SWARM = "ab" * 20
PER_NETWORK = 256
PEER = {"endpoint": "203.0.113.7:4000", "role": "trainer", "version": "0.1.0", "public": True}


async def serve(records: int) -> None:
    """The holding node: prints its endpoint, serves until its stdin closes."""
    node = NetNode(identity=Identity.generate(), config=NodeConfig(server=ServerConfig()))
    async with node:
        key = peers_key(SWARM)
        expiration = time.time() + 3600
        for i in range(records):
            owner = Identity.generate()
            record = make_record(key, PEER, expiration=expiration, owner=owner)
            network = f"203.0.{i // PER_NETWORK}.0/24"
            if not node.dht.storage.put(record, sender=owner.peer_id, network=network):
                raise SystemExit(f"the node refused record {i}: lower --records")
        print(node.endpoint, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


async def read_once(endpoint: str) -> dict[str, float]:
    lags: list[float] = []
    stop = asyncio.Event()

    async def probe() -> None:
        while not stop.is_set():
            asked = time.perf_counter()
            await asyncio.sleep(0.005)
            lags.append(time.perf_counter() - asked - 0.005)

    reader = NetNode(
        identity=Identity.generate(), config=NodeConfig(server=None, peers=(endpoint,))
    )
    async with reader:
        prober = asyncio.create_task(probe())
        cpu, started = time.process_time(), time.perf_counter()
        found = len(await find_peers(reader.dht, SWARM))
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
        stop.set()
        await prober
    return {"read_s": elapsed, "cpu_s": cpu, "lag_max_s": max(lags, default=0.0), "found": found}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    holder = subprocess.Popen(
        [sys.executable, __file__, "--serve", "--records", str(args.records)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        endpoint = holder.stdout.readline().strip()
        if not endpoint:
            raise SystemExit("the holding node did not start")
        trials = [await read_once(endpoint) for _ in range(args.trials)]
    finally:
        if holder.stdin is not None:
            holder.stdin.close()
        holder.wait(timeout=60)
    return {
        "benchmark": "dht-read",
        "machine": machine(),
        "settings": {"records": args.records, "trials": args.trials, "probe_s": 0.005},
        "read_s": statistics.median(t["read_s"] for t in trials),
        "loop_lag_max_s": statistics.median(t["lag_max_s"] for t in trials),
        "process_cpu_s": statistics.median(t["cpu_s"] for t in trials),
        "found": trials[-1]["found"],
        "trials": [{k: round(v, 4) for k, v in t.items()} for t in trials],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--records", type=int, default=4096, help="records in the key (default 4096, a full key)"
    )
    parser.add_argument("--trials", type=int, default=7, help="first reads timed (default 7)")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args.records))
        return
    print(json.dumps(asyncio.run(run(args)), indent=1))


if __name__ == "__main__":
    main()
