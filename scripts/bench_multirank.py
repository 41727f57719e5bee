"""What a box of ranks costs beside a one-process peer: round time, the training stall per
round, the bytes each sends, and steps per second.

Each layout runs as the peer under test in a swarm of two (a one-process partner), on the
MLP of ``examples/mlp_box.py`` at ``--hidden`` width, every round a group of both:

    python scripts/bench_multirank.py                        # 1 rank, DDP 2, FSDP 2, gloo
    python scripts/bench_multirank.py --device cuda --ranks 8 --hidden 8192   # NCCL

The stall is the time the training thread spent in the swarm's work per round (wall time
less the time in steps: the pseudo-gradient's gather, the landing, the checkpoint copy and
waiting for a group). Prints one JSON object: the machine, the settings, per layout the
medians, and the ratios against the one-process peer (targets: bytes 1.0, stall <= 1.2).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import machine

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "mlp_box.py"


def launch(args: list[str], ranks: int, box: bool) -> subprocess.Popen[str]:
    if not box:
        command = [sys.executable, str(EXAMPLE)]
    else:
        command = [
            *(sys.executable, "-m", "torch.distributed.run", "--standalone"),
            *("--nproc-per-node", str(ranks), str(EXAMPLE)),
        ]
    return subprocess.Popen(
        [*command, *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )


class Peer:
    """A launched peer whose stdout (its swarm id line, then JSON events) is collected."""

    def __init__(self, args: list[str], ranks: int = 1, box: bool = False) -> None:
        self.process = launch(args, ranks, box)
        self.first_line = ""
        self.events: list[dict[str, Any]] = []
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith("{"):
                event = json.loads(line)
                self.events.append(event)
                if event["event"] == "ready":
                    self.ready.set()
            elif not self.first_line:
                self.first_line = line.strip()
        self.ready.set()

    def endpoint(self) -> str:
        self.ready.wait(300)
        ready = [e for e in self.events if e["event"] == "ready"]
        if not ready:
            raise SystemExit("the partner peer did not start")
        return str(ready[0]["endpoint"])

    def wait(self) -> int:
        code = self.process.wait(timeout=1200)
        self.thread.join(10)
        return code


def measure(
    layout: str, ranks: int, options: argparse.Namespace, *, box: bool = True
) -> dict[str, Any]:
    """The peer under test: one plain process (``box`` False) or a box of ``ranks`` ranks
    under torchrun (also of one rank: the box's code paths over one GPU's NCCL)."""
    common = [
        *("--max-rounds", str(options.rounds), "--sync-every", str(options.sync_every)),
        *("--min-peers", "2", "--start-with", "2", "--hidden", str(options.hidden)),
        *("--batch-size", str(options.batch_size), "--device", options.device),
        *("--total-steps", "1000000", "--events", "-"),
    ]
    with tempfile.TemporaryDirectory(prefix="bench-multirank-") as tmp:
        partner = Peer(["create", *common, "--data-dir", f"{tmp}/partner"])
        endpoint = partner.endpoint()
        join = ["join", partner.first_line, "--peer", endpoint, "--layout", layout]
        peer = Peer([*join, *common, "--data-dir", f"{tmp}/peer"], ranks, box)
        codes = (peer.wait(), partner.wait())
    if any(codes):
        raise SystemExit(f"{layout} x{ranks}: exit codes {codes}")
    rounds = [e for e in peer.events if e["event"] == "round"][1:]  # the first one waits
    stopped = next(e for e in peer.events if e["event"] == "stopped")
    applied = max(1, len(rounds) + 1)
    stall = (stopped["wall_seconds"] - stopped["train_seconds"]) / applied
    steps_per_second = stopped["step"] / max(stopped["train_seconds"], 1e-9)
    return {
        "layout": f"{layout} x{ranks}" if box else "one process",
        "params": next(e for e in peer.events if e["event"] == "ready")["params"],
        "rounds": len(rounds),
        "round_seconds_median": statistics.median(e["seconds"] for e in rounds),
        "bytes_sent_median": statistics.median(e["bytes_sent"] for e in rounds),
        "groups": sorted({e["group"] for e in rounds}),
        "stall_seconds_per_round": round(stall, 4),
        "steps_per_second": round(steps_per_second, 1),
        "samples_per_second": round(steps_per_second * options.batch_size),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layouts", default="ddp,fsdp", help="box layouts beside one process")
    p.add_argument("--ranks", type=int, default=2, help="ranks of each box")
    p.add_argument("--hidden", type=int, default=1024, help="the MLP's width (model size)")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--sync-every", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    options = p.parse_args()
    results = [measure("ddp", 1, options, box=False)]
    results += [measure(layout, options.ranks, options) for layout in options.layouts.split(",")]
    base = results[0]
    for r in results[1:]:
        r["bytes_ratio"] = round(r["bytes_sent_median"] / base["bytes_sent_median"], 4)
        r["stall_ratio"] = round(
            r["stall_seconds_per_round"] / max(base["stall_seconds_per_round"], 1e-9), 3
        )
        r["round_time_ratio"] = round(r["round_seconds_median"] / base["round_seconds_median"], 3)
    print(
        json.dumps(
            {
                "machine": machine(),
                "settings": {
                    k: getattr(options, k)
                    for k in ("ranks", "hidden", "rounds", "sync_every", "batch_size", "device")
                }
                | {"backend": "nccl" if options.device == "cuda" else "gloo"},
                "results": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
