#!/usr/bin/env python3
"""A real swarm on this machine: a bootstrap node, N training peers and the dashboard, each
its own process.

    python scripts/local_swarm.py [--peers 3] [--rounds 20] [--task gpt-bytes] [--preset tiny]
                                  [--sync-every 50]

Everything talks over gRPC on 127.0.0.1. The script publishes a new swarm's manifest
through the bootstrap node, starts the dashboard (http://127.0.0.1:8080/ unless that port
is taken) and the peers (`swarmloco join SWARM_ID --peer ...`), prints one line per round
as the peers apply it, and when every peer has reached --rounds (or on Ctrl-C) stops them
all and prints a JSON summary: the rounds, each peer's final eval loss and whether all
peers hold the same global state (the digest of the last round each averaged or
downloaded). With --keep-dashboard
the dashboard (and the bootstrap node) stay up after training until Ctrl-C. Logs, events
and checkpoints stay in --dir.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _bench_common import stop_processes

COMMAND = [sys.executable, "-m", "swarmloco.cli"]


def read_events(path: Path, offset: int) -> tuple[list[dict[str, Any]], int]:
    """Complete JSON lines appended to ``path`` since ``offset``."""
    if not path.exists():
        return [], offset
    with path.open("rb") as f:
        f.seek(offset)
        data = f.read()
    end = data.rfind(b"\n") + 1
    events = [json.loads(line) for line in data[:end].splitlines() if line.strip()]
    return events, offset + end


def start_bootstrap(run_dir: Path) -> tuple[subprocess.Popen[str], str]:
    """A `swarmloco bootstrap` node on 127.0.0.1 (log in run_dir/bootstrap.log); its HOST:PORT.

    Raises RuntimeError when it does not start."""
    boot = subprocess.Popen(
        [
            *COMMAND,
            "bootstrap",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--data-dir",
            str(run_dir / "bootstrap"),
        ],
        stdout=subprocess.PIPE,
        stderr=(run_dir / "bootstrap.log").open("w"),
        text=True,
    )
    assert boot.stdout is not None
    line = boot.stdout.readline()
    match = re.search(r"serving on (\S+:\d+)", line)
    if match is None:
        boot.kill()
        raise RuntimeError(f"the bootstrap node did not start: {line!r}")
    return boot, match.group(1)


def publish_swarm(endpoint: str, run_dir: Path, *options: str) -> str:
    """`swarmloco create --no-train OPTIONS` with peer 0's data directory (its key is the
    creator's): publish a new swarm; its id."""
    created = subprocess.run(
        [
            *COMMAND,
            "create",
            *options,
            "--no-train",
            "--peer",
            endpoint,
            "--data-dir",
            # The first peer's: the dashboard trusts the creator's key, so the swarm's
            # figures count the peers it averages with (docs/SECURITY.md).
            str(run_dir / "peer0"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if created.returncode != 0:
        raise RuntimeError(f"swarmloco create failed: {created.stderr}")
    return created.stdout.split()[0]


def start_peer(
    swarm: str, endpoint: str, run_dir: Path, index: int, *options: str
) -> subprocess.Popen[str]:
    """`swarmloco join` as peer ``index``: its data in run_dir/peer<i>, its events in
    peer<i>.events, its log in peer<i>.log."""
    return subprocess.Popen(
        [
            *COMMAND,
            "join",
            swarm,
            "--peer",
            endpoint,
            "--host",
            "127.0.0.1",
            "--data-dir",
            str(run_dir / f"peer{index}"),
            "--events",
            str(run_dir / f"peer{index}.events"),
            *options,
        ],
        stdout=subprocess.DEVNULL,
        stderr=(run_dir / f"peer{index}.log").open("w"),
        text=True,
    )


def start_dashboard(
    port: int, swarm: str, boot: str, run_dir: Path, children: list[subprocess.Popen[str]]
) -> str:
    """Start `swarmloco dashboard`; its URL, or "" when it could not start (or port < 0)."""
    for attempt in [port, 0] if port > 0 else [port]:
        if attempt < 0:
            return ""
        log = (run_dir / "dashboard.log").open("a")
        dash = subprocess.Popen(
            [
                *COMMAND,
                "dashboard",
                swarm,
                "--peer",
                boot,
                "--host",
                "127.0.0.1",
                "--port",
                str(attempt),
            ],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
        assert dash.stdout is not None
        match = re.search(r"serving (http://\S+)", dash.stdout.readline())
        if match is not None:
            children.append(dash)
            return match.group(1)
        dash.wait()
    print("the dashboard did not start (see dashboard.log); going on without it", file=sys.stderr)
    return ""


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--peers", type=int, default=3, help="training peers (default: 3)")
    p.add_argument("--rounds", type=int, default=20, help="stop after this round (default: 20)")
    p.add_argument("--task", default="gpt-bytes", help="task (default: gpt-bytes)")
    p.add_argument("--preset", default="tiny", help="model preset (default: tiny)")
    p.add_argument("--sync-every", type=int, default=50, help="H, inner steps per round")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per inner step")
    p.add_argument("--threads", type=int, default=1, help="torch threads per peer")
    p.add_argument(
        "--dir", type=Path, default=Path("runs/local-swarm"), help="where peers keep data"
    )
    p.add_argument(
        "--dashboard-port", type=int, default=8080, help="0: any free port; -1: no dashboard"
    )
    p.add_argument(
        "--keep-dashboard",
        action="store_true",
        help="keep the dashboard up after training, until Ctrl-C",
    )
    p.add_argument(
        "--extra",
        default="",
        help="more `swarmloco join` options for every peer, as one string",
    )
    p.add_argument(
        "--create-extra",
        default="",
        help="more `swarmloco create` options (the run's, e.g. '--delay 20'), as one string",
    )
    args = p.parse_args()
    if args.peers < 1 or args.rounds < 1:
        p.error("--peers and --rounds must be at least 1")

    run_dir = args.dir / time.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    children: list[subprocess.Popen[str]] = []

    def stop_all() -> None:
        stop_processes(children)

    try:
        boot, endpoint = start_bootstrap(run_dir)
        children.append(boot)
        print(f"bootstrap node on {endpoint}", file=sys.stderr)
        swarm = publish_swarm(
            endpoint,
            run_dir,
            *("--task", args.task, "--preset", args.preset),
            *("--sync-every", str(args.sync_every)),
            *("--batch-size", str(args.batch_size), "--name", "local swarm"),
            *args.create_extra.split(),
        )
        print(
            f"swarm {swarm}: {args.peers} peers, {args.rounds} rounds, H={args.sync_every}",
            file=sys.stderr,
        )

        url = start_dashboard(args.dashboard_port, swarm, endpoint, run_dir, children)
        if url:
            print(f"dashboard: {url}", file=sys.stderr)
        events = [run_dir / f"peer{i}.events" for i in range(args.peers)]
        for i in range(args.peers):
            children.append(
                start_peer(
                    swarm,
                    endpoint,
                    run_dir,
                    i,
                    *("--max-rounds", str(args.rounds), "--threads", str(args.threads)),
                    *("--peer-name", f"peer{i}", *args.extra.split()),
                )
            )
        offsets = [0] * args.peers
        last: dict[int, dict[str, Any]] = {}
        printed = 0
        last_at, printed_before = 0.0, 0
        peers = children[2:] if url else children[1:]
        while any(c.poll() is None for c in peers):
            for i in range(args.peers):
                new, offsets[i] = read_events(events[i], offsets[i])
                for e in new:
                    if e["event"] in ("round", "downloaded"):
                        last[i] = e
                    if e["event"] == "round" and e["round"] > printed:
                        printed = e["round"]
                        since = ""
                        if last_at:
                            gap = (e["time"] - last_at) / max(1, e["round"] - printed_before)
                            left = (args.rounds - e["round"]) * gap
                            since = f", a round every {gap:.1f} s" + (
                                f"; round {args.rounds} in about {left:.0f} s" if left > 0 else ""
                            )
                        last_at, printed_before = e["time"], e["round"]
                        loss = e.get("eval_loss")
                        shown = f"{loss:.3f}" if loss is not None else "-"
                        print(
                            f"round {e['round']:4d} of {args.rounds}: {e['group']} peer(s), "
                            f"averaging {e['seconds']:.2f} s{since}, eval loss {shown}",
                            file=sys.stderr,
                        )
                    elif e["event"] in ("aborted", "download-failed"):
                        print(f"peer{i}: {e['event']}: {e.get('error', '')}", file=sys.stderr)
            time.sleep(0.5)
        codes = [c.returncode for c in peers]
        if url and args.keep_dashboard:
            print(f"training done; the dashboard stays at {url} until Ctrl-C", file=sys.stderr)
            while children[1].poll() is None:
                time.sleep(1)
    except KeyboardInterrupt:
        print("interrupted: stopping the peers", file=sys.stderr)
        codes = []
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    finally:
        stop_all()

    finals: dict[str, Any] = {}
    digests = set()
    for i, path in enumerate(events):
        evs, _ = read_events(path, 0)
        rounds = [e for e in evs if e["event"] == "round"]
        # The state a peer ended on: its last round averaged, or a later one it downloaded
        # (a peer late for the last round takes it from one that stayed for it).
        held = [e for e in evs if e["event"] in ("round", "downloaded")]
        if held:
            digests.add(held[-1]["digest"])
            finals[f"peer{i}"] = {
                "round": held[-1]["round"],
                "eval_loss": rounds[-1].get("eval_loss") if rounds else None,
                "rounds_applied": len(rounds),
                "digest": held[-1]["digest"][:16],  # the same on every peer: one state
                "downloads": sum(e["event"] == "downloaded" for e in evs),
            }
    print(
        json.dumps(
            {
                "swarm": swarm if "swarm" in locals() else None,
                "peers": args.peers,
                "rounds": args.rounds,
                "exit_codes": codes,
                "final": finals,
                "same_final_state": len(digests) == 1,
                "seconds": round(time.monotonic() - started, 1),
                "dir": str(run_dir),
            },
            indent=2,
        )
    )
    return 0 if codes and all(c == 0 for c in codes) else 1


if __name__ == "__main__":
    sys.exit(main())
