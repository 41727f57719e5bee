#!/usr/bin/env python3
"""Compute utilization of real peers under a rate-limited link: plain DiLoCo against
Streaming DiLoCo, side by side in one run. Prints one JSON object.

Each arm is a fresh swarm on 127.0.0.1: a bootstrap node and --peers `swarmloco join`
processes (one torch thread each), every peer capped at --mbit megabits/s up and down.
Both arms train the same inner steps: plain DiLoCo syncs the whole model every H steps
and waits for it; Streaming DiLoCo syncs one of F fragments every H/F steps and trains on
for tau steps while it travels. A peer's utilization is the time it spent in inner steps
over the time since it started training (from its `stopped` event); the figure is the
median over peers. DESIGN target for streaming: at least 0.95.

    python scripts/bench_streaming.py [--peers 2] [--mbit 4] [--sync-every 50] [--rounds 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import machine
from local_swarm import publish_swarm, start_bootstrap, start_peer


def run_arm(
    name: str, swarm_args: list[str], rounds: int, args: argparse.Namespace, root: Path
) -> dict[str, Any]:
    root.mkdir(parents=True)
    boot, endpoint = start_bootstrap(root)
    peers: list[subprocess.Popen[str]] = []
    try:
        swarm = publish_swarm(
            endpoint,
            root,
            *("--preset", args.preset, "--batch-size", str(args.batch_size)),
            *("--sync-every", str(args.sync_every), *swarm_args),
        )
        events = [root / f"peer{i}.events" for i in range(args.peers)]
        for i in range(args.peers):
            peers.append(
                start_peer(
                    swarm,
                    endpoint,
                    root,
                    i,
                    *("--max-rounds", str(rounds), "--threads", "1"),
                    *("--bandwidth", str(args.mbit), "--checkpoint-every", "0"),
                    *("--eval-every", "0", "--codec", "compiled"),
                )
            )
        for p in peers:
            p.wait(timeout=1800)
    finally:
        for p in [*peers, boot]:
            if p.poll() is None:
                p.kill()
    per_peer = []
    for path in events:
        evs = [json.loads(line) for line in path.read_text().splitlines()]
        stopped = [e for e in evs if e["event"] == "stopped"][-1]
        rounds_ = [e for e in evs if e["event"] == "round"]
        per_peer.append(
            {
                "utilization": stopped["train_seconds"] / stopped["wall_seconds"],
                "train_seconds": stopped["train_seconds"],
                "wall_seconds": stopped["wall_seconds"],
                "steps": stopped["step"],
                "rounds_applied": len(rounds_),
                "round_seconds_median": statistics.median(e["seconds"] for e in rounds_)
                if rounds_
                else None,
                "groups": sorted({e["group"] for e in rounds_}),
                "bytes_sent_per_round_median": statistics.median(e["bytes_sent"] for e in rounds_)
                if rounds_
                else None,
            }
        )
    return {
        "arm": name,
        "swarm_args": swarm_args,
        "rounds": rounds,
        "utilization_median": statistics.median(p["utilization"] for p in per_peer),
        "peers": per_peer,
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--peers", type=int, default=2)
    p.add_argument("--mbit", type=float, default=4.0, help="per-peer cap, up and down")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--sync-every", type=int, default=50, help="H")
    p.add_argument("--fragments", type=int, default=2, help="F of the streaming arm")
    p.add_argument("--delay", type=int, default=None, help="tau (default: H/F - 1)")
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--rounds", type=int, default=8, help="full-model syncs per arm")
    p.add_argument("--arms", default="plain,streaming", help="which arms to run")
    p.add_argument("--keep", type=Path, default=None, help="keep logs and events in this dir")
    args = p.parse_args()
    tau = args.delay if args.delay is not None else args.sync_every // args.fragments - 1
    started = time.monotonic()
    arms = args.arms.split(",")
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-streaming-") as tmp:
        root = args.keep or Path(tmp)
        if "plain" in arms:
            results["plain"] = run_arm("plain", [], args.rounds, args, root / "plain")
        if "streaming" in arms:
            results["streaming"] = run_arm(
                "streaming",
                [
                    "--fragments",
                    str(args.fragments),
                    "--delay",
                    str(tau),
                    "--alpha",
                    str(args.alpha),
                ],
                args.rounds * args.fragments,
                args,
                root / "streaming",
            )
    plain, streaming = results.get("plain"), results.get("streaming")
    print(
        json.dumps(
            {
                "benchmark": "streaming_utilization",
                "machine": machine(),
                "settings": {
                    "peers": args.peers,
                    "mbit_per_peer": args.mbit,
                    "preset": args.preset,
                    "batch_size": args.batch_size,
                    "sync_every": args.sync_every,
                    "fragments": args.fragments,
                    "delay": tau,
                    "alpha": args.alpha,
                    "full_syncs": args.rounds,
                    "torch_threads_per_peer": 1,
                },
                "plain_utilization": plain["utilization_median"] if plain else None,
                "streaming_utilization": streaming["utilization_median"] if streaming else None,
                "target_streaming_utilization_at_least_0_95": (
                    streaming["utilization_median"] >= 0.95 if streaming else None
                ),
                "plain": plain,
                "streaming": streaming,
                "total_seconds": round(time.monotonic() - started, 1),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
