#!/usr/bin/env python3
"""Bandwidth-sized parts on a real shaped link: prints ONE JSON object on stdout.

One peer of ``--peers`` (4) sits in its own network namespace behind a veth pair that the
kernel shapes with ``tc tbf`` to ``--mbit`` (50) Mbit/s each way; the others run on the
host, where their links to each other are loopback. Every round averages ``--params``
(8M) fp32 values with the int8 codec (the peers of ``bench_allreduce.py``). Rounds
alternate between:

- ``equal``: every peer declares the default reduction bandwidth (100 Mbit/s), so the slow
  peer reduces a quarter of the vector, as before parts followed bandwidth;
- ``declared``: the slow peer declares its link (``swarmloco join --bandwidth MBIT`` does
  this), the others the default: its part shrinks to its share of the declared total;
- ``declared_fast``: the others also declare ``--fast-mbit`` (1000), as operators of
  fast links would (``--bandwidth 1000``).

Reports per mode the median round time (first member holds the group to last member holds
the result), the slow peer's share of the vector and bytes sent, and each mode's ratio to
``equal``. Needs root, ``ip`` and ``tc`` (network namespaces); the namespace and its
links are removed at the end.

    sudo python scripts/bench_bandwidth.py
    python scripts/bench_bandwidth.py --params 2000000 --rounds 3 --mbit 20
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import machine
from bench_allreduce import Worker, log, swarmloco_round

HOST_IP, SLOW_IP = "10.231.0.1", "10.231.0.2"


def sh(*command: str) -> None:
    subprocess.run(command, check=True, capture_output=True, text=True)


@contextlib.contextmanager
def shaped_namespace(mbit: float) -> Iterator[str]:
    """A network namespace joined to the host by a veth pair shaped to ``mbit`` each way."""
    name = f"swl-bw-{os.getpid()}"
    host_end, ns_end = f"swlh{os.getpid() % 100000}", f"swln{os.getpid() % 100000}"
    sh("ip", "netns", "add", name)
    try:
        sh("ip", "link", "add", host_end, "type", "veth", "peer", "name", ns_end)
        sh("ip", "link", "set", ns_end, "netns", name)
        sh("ip", "addr", "add", f"{HOST_IP}/30", "dev", host_end)
        sh("ip", "link", "set", host_end, "up")
        inside = ("ip", "netns", "exec", name)
        sh(*inside, "ip", "addr", "add", f"{SLOW_IP}/30", "dev", ns_end)
        sh(*inside, "ip", "link", "set", ns_end, "up")
        sh(*inside, "ip", "link", "set", "lo", "up")
        # Burst: a few ms at the rate; the queue: up to 100 ms of it.
        rate = f"{mbit}mbit"
        burst = f"{max(16, int(mbit * 1e6 / 8 * 0.004 / 1024))}kb"
        for prefix, dev in (((), host_end), (inside, ns_end)):
            sh(*prefix, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
               "burst", burst, "latency", "100ms")  # fmt: skip
        yield name
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            sh("ip", "link", "del", host_end)
        sh("ip", "netns", "del", name)


def run(args: argparse.Namespace) -> dict[str, Any]:
    default = 12.5e6  # bytes/s: what a peer without --bandwidth declares
    slow_declared = args.mbit * 1e6 / 8
    modes = {
        "equal": [default] * args.peers,
        "declared": [default] * (args.peers - 1) + [slow_declared],
        "declared_fast": [args.fast_mbit * 1e6 / 8] * (args.peers - 1) + [slow_declared],
    }
    results: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    with shaped_namespace(args.mbit) as namespace:
        log(f"{args.peers - 1} peers on the host, one behind {args.mbit} Mbit/s ({namespace})")
        first = Worker("swarmloco", 0, args, "", host=HOST_IP)
        workers = [first]
        try:
            for i in range(1, args.peers - 1):
                workers.append(Worker("swarmloco", i, args, first.endpoint, host=HOST_IP))
            workers.append(
                Worker(
                    "swarmloco",
                    args.peers - 1,
                    args,
                    first.endpoint,
                    host=SLOW_IP,
                    prefix=("ip", "netns", "exec", namespace),
                )
            )
            log("warm-up round (connections open, buffers allocated)")
            swarmloco_round(workers, 0, deadline=300.0)
            number = 1
            for r in range(args.rounds):
                for mode, declare in modes.items():  # interleaved: drift hits every mode
                    out = swarmloco_round(workers, number, deadline=300.0, declare=declare)
                    number += 1
                    results[mode].append(out)
                    log(f"round {r + 1} {mode}: {out['round_s']:.2f} s")
        finally:
            for w in workers:
                w.quit()
    summary: dict[str, Any] = {}
    for mode, rounds in results.items():
        summary[mode] = {
            "round_s_median": round(statistics.median(r["round_s"] for r in rounds), 3),
            "round_s": [round(r["round_s"], 3) for r in rounds],
            "slow_peer_part": round(statistics.median(r["own_parts"][-1] for r in rounds), 4),
            "slow_peer_bytes_sent": statistics.median(r["sent"][-1] for r in rounds),
        }
    for mode in ("declared", "declared_fast"):
        summary[mode]["round_time_ratio_to_equal"] = round(
            summary[mode]["round_s_median"] / summary["equal"]["round_s_median"], 3
        )
    return {
        "benchmark": "bandwidth",
        "machine": machine(),
        "settings": {
            "peers": args.peers,
            "params": args.params,
            "slow_link_mbit": args.mbit,
            "shaping": "tc tbf on both ends of a veth pair (network namespace)",
            "fast_declared_mbit": args.fast_mbit,
            "default_declared_mbit": default * 8 / 1e6,
            "rounds_per_mode": args.rounds,
        },
        **summary,
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--params", type=int, default=8_000_000)
    p.add_argument("--rounds", type=int, default=5, help="rounds per mode, interleaved")
    p.add_argument("--mbit", type=float, default=50.0, help="the slow peer's link")
    p.add_argument("--fast-mbit", type=float, default=1000.0, help="what fast peers declare")
    args = p.parse_args()
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        raise SystemExit("needs root, ip and tc (it makes a network namespace and shapes it)")
    args.plain = False
    print(json.dumps(run(args), indent=2))


if __name__ == "__main__":
    main()
