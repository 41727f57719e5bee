#!/usr/bin/env python3
"""What strangers' records cost a DHT node's event loop and CPU: prints ONE JSON object.

Records are signed by free keys, and a node checks each signature (about 90 us) it has not
seen before: a reader of a key, and a node that others store at (docs/SECURITY.md,
"Records per source network"). A DHT node runs in a child process; the parts
(``--parts``, both by default):

- ``first-read``: the node holds ``--records`` fresh ``peers`` records of one swarm (a full
  key: 4,096, 256 from each of 16 source networks); ``--trials`` times, a new client-mode
  node in this process (nothing checked yet) reads the key with ``find_peers`` while a
  probe on its event loop sleeps 5 ms at a time and notes how late it wakes: ``read_s``
  (median wall time of a read), ``loop_lag_max_s`` (median over reads of the latest
  wake-up), ``process_cpu_s`` (median CPU of this process a read), ``found``.
- ``store-flood``: for ``--flood-seconds``, this process stores records whose signatures
  are random bytes (nothing to make, a check each to refuse) at the node from 127.0.0.1,
  64 a request, 8 requests in flight, while an honest peer on 127.0.0.2 stores one record
  every 0.2 s: ``flood_records_sent`` and ``flood_bytes_sent``, ``flood_checks``
  (signatures the node checked: its ``bad-signature`` refusals), ``node_cpu_s`` (the
  node's CPU over the flood; on one machine the flood keeps it busy either way, so what
  tells is what a record and a megabyte of the flood cost it:
  ``node_cpu_us_per_record``, ``node_cpu_s_per_flood_mb``), ``node_loop_lag_max_s`` and
  ``node_loop_late_share`` (its probe's latest wake-up, and the share of wake-ups later
  than 50 ms),
  ``honest_store_s`` (median round trip of the honest peer's stores) and
  ``honest_stored`` (how many of them were stored).

Run it with ``PYTHONPATH=<tree>/src`` to compare trees.

    python scripts/bench_dht_load.py
    python scripts/bench_dht_load.py --parts store-flood --flood-seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "net"))  # the source-address forwarder
from _bench_common import loop_lag, machine, process_cpu_s  # noqa: E402
from sourceproxy import SourceProxy  # noqa: E402

from swarmloco.net.client import RpcClient, RpcError  # noqa: E402
from swarmloco.net.dht.contact import sign_card  # noqa: E402
from swarmloco.net.dht.transport import STORE  # noqa: E402
from swarmloco.net.dht.wire import signed_store_request  # noqa: E402
from swarmloco.net.endpoints import parse_endpoint  # noqa: E402
from swarmloco.net.identity import Identity  # noqa: E402
from swarmloco.net.node import NetNode, NodeConfig  # noqa: E402
from swarmloco.net.records import Record, make_record, peers_key  # noqa: E402
from swarmloco.net.server import ServerConfig  # noqa: E402
from swarmloco.net.swarm import find_peers  # noqa: E402

SWARM = "ab" * 20
PER_NETWORK = 256
PEER = {"endpoint": "203.0.113.7:4000", "role": "trainer", "version": "0.1.0", "public": True}
PROBE_S = 0.005
LATE_S = 0.05


class Probe:
    """How late an event loop wakes from ``PROBE_S`` sleeps, while it runs (``loop_lag``)."""

    def __init__(self) -> None:
        self.lags: list[float] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.lags.clear()
        self._task = asyncio.ensure_future(loop_lag(self.lags, PROBE_S))

    async def stop(self) -> dict[str, float]:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        late = sum(lag > LATE_S for lag in self.lags)
        return {
            "lag_max_s": max(self.lags, default=0.0),
            "late_share": late / len(self.lags) if self.lags else 0.0,
        }


async def serve(records: int) -> None:
    """The node: prints its endpoint, then serves; each line on its stdin starts (``start``)
    or ends (``stop``, answered with one JSON line) a probe of its loop; it exits when its
    stdin closes."""
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
        probe = Probe()
        loop = asyncio.get_running_loop()
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            if line.strip() == "start":
                probe.start()
            elif line.strip() == "stop":
                counts = node.dht.rejections.counts
                seen = {"checks": counts["bad-signature"]}
                print(json.dumps(await probe.stop() | seen), flush=True)


class Node:
    """The node in its child process."""

    def __init__(self, records: int) -> None:
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--serve", "--records", str(records)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None and self.process.stdin is not None
        self._out, self._in = self.process.stdout, self.process.stdin
        self.endpoint = self._out.readline().strip()
        if not self.endpoint:
            raise SystemExit("the node did not start")

    def tell(self, line: str) -> None:
        self._in.write(line + "\n")
        self._in.flush()

    def probed(self) -> dict[str, float]:
        self.tell("stop")
        return json.loads(self._out.readline())

    def close(self) -> None:
        self._in.close()
        self.process.wait(timeout=60)


async def read_once(endpoint: str) -> dict[str, float]:
    reader = NetNode(
        identity=Identity.generate(), config=NodeConfig(server=None, peers=(endpoint,))
    )
    async with reader:
        probe = Probe()
        probe.start()
        cpu, started = time.process_time(), time.perf_counter()
        found = len(await find_peers(reader.dht, SWARM))
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
        lag = (await probe.stop())["lag_max_s"]
    return {"read_s": elapsed, "cpu_s": cpu, "lag_max_s": lag, "found": found}


async def first_read(node: Node, trials: int) -> dict[str, Any]:
    reads = [await read_once(node.endpoint) for _ in range(trials)]
    return {
        "read_s": statistics.median(t["read_s"] for t in reads),
        "loop_lag_max_s": statistics.median(t["lag_max_s"] for t in reads),
        "process_cpu_s": statistics.median(t["cpu_s"] for t in reads),
        "found": reads[-1]["found"],
        "trials": [{k: round(v, 4) for k, v in t.items()} for t in reads],
    }


def forged_records(count: int) -> list[Record]:
    """``peers`` records of made-up swarms (no key full, no quota reached: a record whose
    signature fails is never stored) whose signatures are random bytes."""
    expiration = time.time() + 3600
    return [
        dataclasses.replace(
            make_record(
                peers_key(os.urandom(20).hex()),
                PEER,
                expiration=expiration,
                owner=Identity.generate(),
            ),
            signature=os.urandom(64),
        )
        for _ in range(count)
    ]


async def store_flood(node: Node, seconds: float) -> dict[str, Any]:
    forged = forged_records(1024)
    flooder, honest = Identity.generate(), Identity.generate()
    flooder_card, honest_card = sign_card(flooder, ""), sign_card(honest, "")
    sent = sent_bytes = 0
    rtts: list[float] = []
    stored = 0
    async with (
        RpcClient() as client,
        SourceProxy("127.0.0.2", parse_endpoint(node.endpoint)) as proxy,
    ):
        deadline = time.monotonic() + seconds

        async def flood(lane: int) -> None:
            nonlocal sent, sent_bytes
            i = lane * 64
            while time.monotonic() < deadline:
                batch = [forged[(i + j) % len(forged)] for j in range(64)]
                i += 8 * 64
                request = signed_store_request(
                    flooder, flooder_card, batch, timestamp_ms=int(time.time() * 1000)
                )
                with contextlib.suppress(RpcError):  # refused or timed out: it goes on
                    await client.call(node.endpoint, STORE, request, timeout=10, attempts=1)
                sent += len(batch)
                sent_bytes += request.ByteSize()

        async def store_honestly() -> None:
            nonlocal stored
            while time.monotonic() < deadline:
                record = make_record(
                    peers_key(SWARM), PEER, expiration=time.time() + 600, owner=honest
                )
                request = signed_store_request(
                    honest, honest_card, [record], timestamp_ms=int(time.time() * 1000)
                )
                started = time.perf_counter()
                with contextlib.suppress(RpcError):
                    answer = await client.call(proxy.endpoint, STORE, request, timeout=10)
                    stored += sum(r.stored for r in answer.results)
                rtts.append(time.perf_counter() - started)
                await asyncio.sleep(0.2)

        node.tell("start")
        cpu = process_cpu_s(node.process.pid)
        await asyncio.gather(*(flood(lane) for lane in range(8)), store_honestly())
        cpu = process_cpu_s(node.process.pid) - cpu
        seen = node.probed()
    return {
        "flood_seconds": seconds,
        "flood_records_sent": sent,
        "flood_bytes_sent": sent_bytes,
        "flood_checks": seen["checks"],
        "node_cpu_s": round(cpu, 2),
        "node_cpu_us_per_record": round(cpu / max(sent, 1) * 1e6, 2),
        "node_cpu_s_per_flood_mb": round(cpu / max(sent_bytes, 1) * 1e6, 4),
        "node_loop_lag_max_s": round(seen["lag_max_s"], 4),
        "node_loop_late_share": round(seen["late_share"], 4),
        "honest_store_s": round(statistics.median(rtts), 4) if rtts else None,
        "honest_stores": len(rtts),
        "honest_stored": stored,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    parts = [p for p in args.parts.split(",") if p]
    unknown = set(parts) - {"first-read", "store-flood"}
    if unknown:
        raise SystemExit(f"unknown part(s): {', '.join(sorted(unknown))}")
    result: dict[str, Any] = {
        "benchmark": "dht-load",
        "machine": machine(),
        "settings": {
            "parts": parts,
            "records": args.records,
            "trials": args.trials,
            "flood_seconds": args.flood_seconds,
            "probe_s": PROBE_S,
        },
    }
    node = Node(args.records if "first-read" in parts else 0)
    try:
        if "first-read" in parts:
            result["first_read"] = await first_read(node, args.trials)
        if "store-flood" in parts:
            result["store_flood"] = await store_flood(node, args.flood_seconds)
    finally:
        node.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--parts", default="first-read,store-flood", help="first-read, store-flood (both)"
    )
    parser.add_argument(
        "--records", type=int, default=4096, help="records in the key (default 4096, a full key)"
    )
    parser.add_argument("--trials", type=int, default=7, help="first reads timed (default 7)")
    parser.add_argument(
        "--flood-seconds", type=float, default=10.0, help="how long the flood lasts (default 10)"
    )
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args.records))
        return
    print(json.dumps(asyncio.run(run(args)), indent=1))


if __name__ == "__main__":
    main()
