#!/usr/bin/env python3
"""Steps per round: does each peer train about H steps a round, whatever its step time?
Prints ONE JSON object.

    python scripts/bench_pacing.py                      # 2 peers, H = 20, 12 rounds
    python scripts/bench_pacing.py --sync-every 25 --rounds 20
    python scripts/bench_pacing.py --sync-every 10 --rounds 6 --step-seconds 1   # slow steps
    python scripts/bench_pacing.py --baseline-src OLD/src   # and an older checkout's, first

Two processes of ``examples/mlp_own_loop.py`` (the library API in a user's own loop: an
MLP whose steps take a few ms on a CPU, or ``--step-seconds`` more, an evaluation after
every round, progress records every 2 s as by default) create and join one swarm on
loopback and leave at ``--rounds``. For each peer: the local steps between consecutive
applied rounds (``per_round``), their median and its ratio to H (``median_over_h``; 1.0 is
the promise, issue 31), and the rounds it applied in a group of two. The swarm's promise
is per round: the group's steps add up to about 2 H (a faster peer trains more of them).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import machine

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "mlp_own_loop.py"


class Peer:
    """One example process and the events it prints."""

    def __init__(self, example: Path, args: list[str], env: dict[str, str]) -> None:
        self.events: list[dict[str, Any]] = []
        self._ready = threading.Event()
        self.process = subprocess.Popen(
            [sys.executable, str(example), *args, "--events"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith("{"):  # the rest: the swarm id create prints
                event = json.loads(line)
                self.events.append(event)
                if event["event"] == "ready":
                    self._ready.set()

    def ready(self, timeout: float) -> dict[str, Any]:
        if not self._ready.wait(timeout):
            raise SystemExit(f"no ready event in {timeout:.0f} s")
        return next(e for e in self.events if e["event"] == "ready")

    def wait(self, timeout: float) -> None:
        self.process.wait(timeout=timeout)
        self._reader.join(timeout=10)

    def report(self, h: int) -> dict[str, Any]:
        rounds = [e for e in self.events if e["event"] == "round"]
        steps = [e["step"] for e in rounds]
        per_round = [later - earlier for earlier, later in itertools.pairwise(steps)]
        median = statistics.median(per_round) if per_round else None
        return {
            "rounds": len(rounds),
            "rounds_together": sum(1 for e in rounds if e["group"] >= 2),
            "per_round": per_round,
            "median_steps": median,
            "median_over_h": round(median / h, 3) if median is not None else None,
        }


def pair(
    h: int, rounds: int, timeout: float, src: str | None, step_seconds: float = 0.0
) -> list[dict[str, Any]]:
    """Two peers of this checkout's example (the same workload for both), with the
    swarmloco of the checkout of ``src`` (None: this one)."""
    env, example = dict(os.environ), EXAMPLE
    if src is not None:
        env["PYTHONPATH"] = src
    with tempfile.TemporaryDirectory() as tmp:
        common = ["--max-rounds", str(rounds), "--min-peers", "2"]
        if step_seconds:
            common += ["--step-seconds", str(step_seconds)]
        a = Peer(example, ["create", "--data-dir", f"{tmp}/a", "--identity-work", "0",
                  "--sync-every", str(h), "--total-steps", str(100 * h * rounds),
                  *common], env)  # fmt: skip
        ready = a.ready(120)
        b = Peer(example, ["join", ready["swarm_id"], "--peer", ready["endpoint"],
                  "--data-dir", f"{tmp}/b", *common], env)  # fmt: skip
        for peer in (a, b):
            peer.wait(timeout)
    return [a.report(h), b.report(h)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sync-every", type=int, default=20, help="H (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=12, help="rounds each peer applies")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for each pair")
    p.add_argument("--baseline-src", default=None, help="an older checkout's src/ to run first")
    p.add_argument(
        "--step-seconds", type=float, default=0.0, help="added to each step (default: none)"
    )
    args = p.parse_args()
    h, slow = args.sync_every, args.step_seconds
    result: dict[str, Any] = {
        "bench": "pacing",
        "machine": machine(),
        "settings": {"sync_every": h, "rounds": args.rounds, "peers": 2, "step_seconds": slow},
    }
    if args.baseline_src:
        result["baseline"] = pair(h, args.rounds, args.timeout, args.baseline_src, slow)
    result["peers"] = pair(h, args.rounds, args.timeout, None, slow)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
