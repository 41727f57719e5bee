#!/usr/bin/env python3
"""DHT benchmark: prints ONE JSON object on stdout (progress goes to stderr).

1. Simulation: ``--sim-nodes`` (1,000) DHT nodes in this process on the in-memory
   transport; records are stored, then 20% of the nodes leave abruptly one by one while
   as many new ones join, with lookups running throughout and after: lookup success rate
   and hops (a value lookup's hops = depth of the first node that returned the record).
2. Loopback, real gRPC, separate processes: one `swarmloco bootstrap` process plus
   ``--nodes - 1`` worker processes (this script with ``--worker``), each one node with
   its own event loop, driven over stdin/stdout. Node a stores a small record, then
   another node b gets it; times are taken inside the worker around the DHT call.
   Node start = in-process time to bind the server and join; the bootstrap process is
   also timed from spawn to its "serving on" line and its RSS is read from /proc.
3. hivemind 1.1.12 (when importable, e.g. from .venv-bench) doing the same in the same
   run: ``--nodes`` ``hivemind.DHT`` instances (each a child process with its p2pd), store
   on one, ``get`` (default arguments) from another; times taken around the calls in this
   process, as a hivemind user sees them. RSS = the DHT's Python child plus its p2pd.

    .venv-bench/bin/python scripts/bench_dht.py            # everything
    python scripts/bench_dht.py --skip-hivemind --sim-nodes 200
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PEER_VALUE = {"endpoint": "127.0.0.1:5000", "role": "trainer", "version": "0.1.0", "public": True}


def log(message: str) -> None:
    print(f"[bench_dht] {message}", file=sys.stderr, flush=True)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def children_of(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        found.extend(int(c) for c in text)
    return found


def quantiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "median": round(statistics.median(ordered), 3),
        "p90": round(ordered[int(0.9 * (len(ordered) - 1))], 3),
        "max": round(ordered[-1], 3),
    }


def summary(
    name: str,
    store_ms: list[float],
    get_ms: list[float],
    found: int,
    first_start_s: float,
    joining_start_s: list[float],
    rss: float,
) -> dict[str, Any]:
    """The loopback figures of one system, under the keys the issue asks for."""
    return {
        f"{name}_get_ms_median": round(statistics.median(get_ms), 2),
        f"{name}_get_ms": quantiles(get_ms),
        f"{name}_store_ms_median": round(statistics.median(store_ms), 2),
        f"{name}_store_ms": quantiles(store_ms),
        f"{name}_get_success_rate": found / len(get_ms),
        f"{name}_node_start_s": round(first_start_s, 4),
        f"{name}_joining_node_start_s_median": round(statistics.median(joining_start_s), 4),
        f"{name}_node_rss_mb": round(rss, 1),
    }


def machine_info() -> dict[str, Any]:
    """The shared description of the machine, plus what matters to a network benchmark."""
    import grpc
    from _bench_common import machine

    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        **machine(),
        "mem_gb": round(mem_gb, 1),
        "grpcio": grpc.__version__,
        # Other work on the machine inflates every latency below (both systems alike).
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }


# -- 1. the in-memory simulation --------------------------------------------------------


async def simulate(
    nodes: int, records: int, churn: float, lookups_per_step: int, seed: int
) -> dict[str, Any]:
    from swarmloco.net.dht.memory import MemoryCluster
    from swarmloco.net.records import peers_key

    rng = random.Random(seed)
    started = time.perf_counter()
    async with MemoryCluster(rng=rng) as cluster:
        for i in range(nodes):
            await cluster.add()
            if (i + 1) % 250 == 0:
                log(f"sim: {i + 1} nodes joined ({time.perf_counter() - started:.1f}s)")
        build_s = time.perf_counter() - started
        keys = [peers_key(f"{rng.getrandbits(160):040x}") for _ in range(records)]
        for key in keys:
            await rng.choice(cluster.nodes).store(key, PEER_VALUE, ttl=3600)
        value_ok: list[bool] = []
        value_hops: list[int] = []
        node_ok: list[bool] = []
        node_hops: list[int] = []

        async def value_lookup() -> None:
            result = await rng.choice(cluster.nodes).get(rng.choice(keys))
            value_ok.append(len(result.entries) == 1)
            if result.hops is not None:
                value_hops.append(result.hops)

        async def node_lookup() -> None:
            a, b = rng.sample(cluster.nodes, 2)
            result = await a.find_nodes(b.peer_id)
            node_ok.append(b.peer_id in {c.peer_id for c in result.closest})
            if result.hops is not None:
                node_hops.append(result.hops)

        churned = int(churn * nodes)
        churn_started = time.perf_counter()
        for step in range(churned):
            await cluster.remove(rng.choice(cluster.nodes))  # abrupt: unreachable at once
            await cluster.add()
            # Lookups run concurrently with each other, between departures and arrivals.
            await asyncio.gather(*(value_lookup() for _ in range(lookups_per_step)), node_lookup())
            if (step + 1) % 50 == 0:
                log(f"sim: churn {step + 1}/{churned}")
        churn_s = time.perf_counter() - churn_started
        for _ in range(records):
            await asyncio.gather(value_lookup(), node_lookup())
        calls = cluster.network.calls
    return {
        "sim_nodes": nodes,
        "sim_records": records,
        "sim_churn_fraction": churn,
        "sim_nodes_left": churned,
        "sim_nodes_joined_during_run": churned,
        "lookup_success_rate": round(sum(value_ok) / len(value_ok), 4),
        "lookups": len(value_ok),
        "median_hops": statistics.median(value_hops) if value_hops else None,
        "hops_p90": sorted(value_hops)[int(0.9 * (len(value_hops) - 1))] if value_hops else None,
        "node_lookup_success_rate": round(sum(node_ok) / len(node_ok), 4),
        "node_lookups": len(node_ok),
        "node_lookup_median_hops": statistics.median(node_hops) if node_hops else None,
        "sim_build_s": round(build_s, 1),
        "sim_churn_phase_s": round(churn_s, 1),
        "sim_messages": calls,
    }


# -- 2. swarmloco over gRPC, one process per node ---------------------------------------


async def worker(bootstrap: str, get_quorum: int) -> None:
    """One node in its own process: JSON commands on stdin, JSON answers on stdout."""
    from swarmloco.net.identity import Identity
    from swarmloco.net.node import NetNode, NodeConfig

    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    started = time.perf_counter()
    from swarmloco.net.dht.node import DhtConfig

    config = NodeConfig(peers=(bootstrap,), dht=DhtConfig(get_quorum=get_quorum))
    async with NetNode(identity=Identity.generate(), config=config) as node:
        start_s = time.perf_counter() - started
        print(
            json.dumps({"ready": True, "start_s": start_s, "rss_mb": rss_mb(os.getpid())}),
            flush=True,
        )
        while line := await reader.readline():
            command = json.loads(line)
            t0 = time.perf_counter()
            if command["op"] == "store":
                stored = await node.dht.store(command["key"], PEER_VALUE, ttl=600)
                answer = {"ms": (time.perf_counter() - t0) * 1000, "ok": stored > 0}
            elif command["op"] == "warm":
                # What a long-running node does on its own: ping every contact (liveness),
                # which also opens the connections its lookups will use.
                await node.dht.check_liveness(older_than=0)
                answer = {"ms": (time.perf_counter() - t0) * 1000, "ok": True}
            elif command["op"] == "get":
                result = await node.dht.get(command["key"])
                answer = {"ms": (time.perf_counter() - t0) * 1000, "ok": len(result.entries) == 1}
            else:
                break
            print(json.dumps(answer), flush=True)


class Worker:
    def __init__(self, bootstrap: str, get_quorum: int) -> None:
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--worker", bootstrap, "--get-quorum", str(get_quorum)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def read(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError("a worker died (see its stderr above)")
        return json.loads(line)  # type: ignore[no-any-return]

    def ask(self, **command: Any) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.process.stdin:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()


async def first_node_start_s() -> float:
    from swarmloco.net.identity import Identity
    from swarmloco.net.node import NetNode, NodeConfig

    identity = Identity.generate()  # made before the clock starts: a real peer loads it
    started = time.perf_counter()
    async with NetNode(identity=identity, config=NodeConfig()):
        return time.perf_counter() - started


def swarmloco_loopback(nodes: int, operations: int, seed: int, get_quorum: int) -> dict[str, Any]:
    from swarmloco.net.records import peers_key

    rng = random.Random(seed)
    from swarmloco.cli import run_async

    first_start = run_async(first_node_start_s())
    with tempfile.TemporaryDirectory() as data_dir:
        spawned = time.perf_counter()
        boot = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "swarmloco.cli",
                "-q",
                "bootstrap",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--data-dir",
                data_dir,
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert boot.stdout is not None
        line = boot.stdout.readline()
        ready_s = time.perf_counter() - spawned
        match = re.search(r"serving on (\S+:\d+)", line)
        if match is None:
            raise RuntimeError(f"bootstrap did not start: {line!r}")
        endpoint = match.group(1)
        workers: list[Worker] = []
        try:
            starts, worker_rss = [], []
            for _ in range(nodes - 1):  # one after the other, as the hivemind nodes below
                workers.append(Worker(endpoint, get_quorum))
                hello = workers[-1].read()
                starts.append(hello["start_s"])
                worker_rss.append(hello["rss_mb"])
            for w in workers:
                w.ask(op="warm")
            store_ms, get_ms, ok = [], [], 0
            for _ in range(operations):
                a, b = rng.sample(workers, 2)
                key = peers_key(f"{rng.getrandbits(160):040x}")
                store = a.ask(op="store", key=key)
                got = b.ask(op="get", key=key)
                store_ms.append(store["ms"])
                get_ms.append(got["ms"])
                ok += got["ok"]
            boot_rss = rss_mb(boot.pid)
            maps = Path(f"/proc/{boot.pid}/maps").read_text()
        finally:
            for w in workers:
                w.close()
            boot.terminate()
            boot.wait(timeout=10)
    return {
        **summary("swarmloco", store_ms, get_ms, ok, first_start, starts, boot_rss),
        "swarmloco_bootstrap_process_ready_s": round(ready_s, 3),
        "swarmloco_bootstrap_imports_torch": "torch" in maps,
        "swarmloco_worker_rss_mb_median": round(statistics.median(worker_rss), 1),
    }


# -- 3. hivemind doing the same ----------------------------------------------------------


def hivemind_loopback(nodes: int, operations: int, seed: int) -> dict[str, Any]:
    try:
        import hivemind
    except Exception as exc:  # not installed, or broken by its numpy/torch pins
        return {"hivemind_available": False, "hivemind_error": f"{type(exc).__name__}: {exc}"}
    from hivemind.utils import get_dht_time

    rng = random.Random(seed)
    dhts = []
    try:
        started = time.perf_counter()
        first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        first_start = time.perf_counter() - started
        dhts.append(first)
        peers = [str(a) for a in first.get_visible_maddrs()]
        starts = []
        for _ in range(nodes - 1):
            started = time.perf_counter()
            dhts.append(
                hivemind.DHT(start=True, initial_peers=peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
            )
            starts.append(time.perf_counter() - started)
        store_ms, get_ms, ok = [], [], 0
        for i in range(operations):
            a, b = rng.sample(dhts[1:], 2)
            key = f"bench-{seed}-{i}"
            t0 = time.perf_counter()
            a.store(key, dict(PEER_VALUE), expiration_time=get_dht_time() + 600)
            store_ms.append((time.perf_counter() - t0) * 1000)
            t0 = time.perf_counter()
            found = b.get(key)
            get_ms.append((time.perf_counter() - t0) * 1000)
            ok += found is not None
        child = dhts[1].pid
        rss = rss_mb(child) + sum(rss_mb(p) for p in children_of(child))
    finally:
        for dht in dhts:
            dht.shutdown()
    return {
        "hivemind_available": True,
        "hivemind_version": hivemind.__version__,
        **summary("hivemind", store_ms, get_ms, ok, first_start, starts, rss),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", metavar="BOOTSTRAP", help=argparse.SUPPRESS)
    parser.add_argument("--sim-nodes", type=int, default=1000)
    parser.add_argument("--sim-records", type=int, default=200)
    parser.add_argument("--churn", type=float, default=0.2)
    parser.add_argument("--lookups-per-step", type=int, default=5)
    parser.add_argument("--nodes", type=int, default=16, help="loopback nodes (default 16)")
    parser.add_argument("--operations", type=int, default=100, help="store+get pairs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--get-quorum", type=int, default=2, help="swarmloco DhtConfig.get_quorum (default 2)"
    )
    parser.add_argument("--skip-sim", action="store_true")
    parser.add_argument("--skip-hivemind", action="store_true")
    args = parser.parse_args()
    from swarmloco.cli import run_async  # the loop every swarmloco process runs (uvloop)

    if args.worker:
        run_async(worker(args.worker, args.get_quorum))
        return 0
    result: dict[str, Any] = {
        "benchmark": "dht",
        "machine": machine_info(),
        "settings": {
            "k": 20,
            "alpha": 3,
            "sim_transport": "in-memory, one process, one event loop",
            "loopback": f"{args.nodes} nodes on 127.0.0.1, one process each (swarmloco: 1 "
            f"`swarmloco bootstrap` + {args.nodes - 1} workers; hivemind: {args.nodes} DHT "
            "child processes, each with its p2pd)",
            "operations": args.operations,
            "record": "one small signed peers record (~80 bytes) per key",
            "seed": args.seed,
            "swarmloco_get_quorum": args.get_quorum,
        },
    }
    if not args.skip_sim:
        log(f"simulation: {args.sim_nodes} nodes, {args.churn:.0%} churn")
        result.update(
            asyncio.run(
                simulate(
                    args.sim_nodes, args.sim_records, args.churn, args.lookups_per_step, args.seed
                )
            )
        )
    log(f"swarmloco: {args.nodes} nodes on loopback")
    result.update(swarmloco_loopback(args.nodes, args.operations, args.seed, args.get_quorum))
    if args.skip_hivemind:
        result["hivemind_available"] = False
        result["hivemind_error"] = "skipped (--skip-hivemind)"
    else:
        log(f"hivemind: {args.nodes} nodes on loopback")
        result.update(hivemind_loopback(args.nodes, args.operations, args.seed))
    if result.get("hivemind_available"):
        result["get_latency_ratio_vs_hivemind"] = round(
            result["swarmloco_get_ms_median"] / result["hivemind_get_ms_median"], 3
        )
        result["node_start_ratio_vs_hivemind"] = round(
            result["swarmloco_node_start_s"] / result["hivemind_node_start_s"], 3
        )
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
