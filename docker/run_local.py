#!/usr/bin/env python3
"""docker/compose.yaml without Docker: its services' commands as processes on 127.0.0.1.

    python docker/run_local.py [--dir DIR] [--until-round N] [--run-options "--sync-every 8"]

Each service's one-line ``command`` is read from compose.yaml and run with ``sh -c`` as
it is there; only the environment differs (addresses on 127.0.0.1, free ports, the
shared and data volumes as folders under --dir). The order is compose's: the bootstrap
node, then ``publish`` (retried until the bootstrap node answers, as compose's
``restart: on-failure`` does), then the peers and the dashboard. Ctrl-C stops them all;
with --until-round N they are stopped once the dashboard shows the swarm at round N (and,
with --until-peers M, M peers online), and a JSON summary is printed (exit 0 when every
process left cleanly).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

COMPOSE = Path(__file__).resolve().parent / "compose.yaml"
_SERVICE = re.compile(r"^  ([a-z0-9_-]+):\s*$")
_COMMAND = re.compile(r"^    command: (\[.*\])\s*$")
_ENVIRONMENT = re.compile(r"^    environment: \{ <<: \*environment, (.*) \}\s*$")
_PAIR = re.compile(r'([A-Z_]+): "?([^",]*)"?')


def services(text: str) -> dict[str, dict[str, Any]]:
    """Each service's command (one shell line, compose's ``$$`` made ``$``) and its own
    environment entries, in the file's order."""
    found: dict[str, dict[str, Any]] = {}
    current = None
    in_services = False
    for line in text.splitlines():
        if line.startswith("services:"):
            in_services = True
            continue
        if in_services and line and not line.startswith(" "):
            in_services = False
        if not in_services:
            continue
        if m := _SERVICE.match(line):
            current = found.setdefault(m.group(1), {"env": {}})
        elif current is not None and (m := _COMMAND.match(line)):
            [command] = json.loads(m.group(1))
            if "$" in command.replace("$$", ""):
                # compose would substitute it from the host's environment (or refuse
                # `$(`): every `$` meant for the shell is written `$$`.
                raise SystemExit(f"compose.yaml: a lone `$` in {m.group(1)}")
            current["command"] = command.replace("$$", "$")
        elif current is not None and (m := _ENVIRONMENT.match(line)):
            current["env"] = dict(_PAIR.findall(m.group(1)))
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=None, help="volumes and logs (default: a temp dir)")
    p.add_argument("--until-round", type=int, default=None, help="stop at this swarm round")
    p.add_argument(
        "--until-peers", type=int, default=0, help="... and this many peers online (default: any)"
    )
    p.add_argument("--run-options", default="", help="RUN_OPTIONS: more `create` options")
    p.add_argument("--timeout", type=float, default=900.0, help="give up after (s)")
    args = p.parse_args()
    root = args.dir or Path(tempfile.mkdtemp(prefix="swarmloco-compose-"))
    (root / "shared").mkdir(parents=True, exist_ok=True)
    (root / "data").mkdir(parents=True, exist_ok=True)
    (root / "logs").mkdir(parents=True, exist_ok=True)
    bootstrap_port = free_port()
    base = {
        **os.environ,
        # The `swarmloco` of this Python first (a virtual environment's).
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "BOOTSTRAP": f"127.0.0.1:{bootstrap_port}",
        "BOOTSTRAP_PORT": str(bootstrap_port),
        "SHARED": str(root / "shared"),
        "DATA": str(root / "data"),
        "HOST": "127.0.0.1",
        "RUN_OPTIONS": args.run_options,
    }
    local = {"ANNOUNCE": "127.0.0.1", "PORT": "0"}  # one machine: loopback, free ports
    specs = services(COMPOSE.read_text(encoding="utf-8"))
    running: dict[str, subprocess.Popen[str]] = {}
    deadline = time.monotonic() + args.timeout
    swarm_id = ""

    def start(name: str) -> subprocess.Popen[str]:
        env = (
            base | specs[name]["env"] | {k: v for k, v in local.items() if k in specs[name]["env"]}
        )
        log = open(root / "logs" / f"{name}.log", "a", encoding="utf-8")  # noqa: SIM115
        print(f"[{name}] {specs[name]['command']}", file=sys.stderr)
        return subprocess.Popen(
            ["sh", "-c", specs[name]["command"]],
            env=env,
            stdout=subprocess.PIPE if name == "dashboard" else log,
            stderr=log,
            text=True,
        )

    def stop_all() -> dict[str, int]:
        for proc in running.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        codes = {}
        for name, proc in running.items():
            try:
                codes[name] = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[name] = proc.wait()
        return codes

    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        running["bootstrap"] = start("bootstrap")
        while True:  # compose: restart: on-failure, until the bootstrap node answers
            code = start("publish").wait(timeout=300)
            if code == 0:
                break
            if time.monotonic() > deadline or running["bootstrap"].poll() is not None:
                raise SystemExit(f"publish failed ({code}); see {root / 'logs'}")
            time.sleep(1.0)
        swarm_id = (root / "shared" / "swarm_id").read_text(encoding="utf-8").strip()
        for name in specs:
            if name not in ("bootstrap", "publish"):
                running[name] = start(name)
        dashboard = running.get("dashboard")
        url = ""
        if dashboard is not None and dashboard.stdout is not None:
            # "swarmloco dashboard: serving URL for swarm ID"
            line = dashboard.stdout.readline()
            found = re.search(r"https?://\S+", line)
            url = found.group(0) if found else ""
            print(f"dashboard: {url}", file=sys.stderr)
        view: dict[str, Any] = {}
        while True:
            failed = {n: p.returncode for n, p in running.items() if p.poll() not in (None, 0)}
            if failed:
                raise SystemExit(f"{failed} exited; see {root / 'logs'}")
            if url and args.until_round is not None:
                with urllib.request.urlopen(url.rstrip("/") + "/api/v1/state", timeout=10) as r:
                    view = json.load(r)
                online = view.get("peers_online") or 0
                if (view.get("round") or 0) >= args.until_round and online >= args.until_peers:
                    break
            if time.monotonic() > deadline:
                raise SystemExit(
                    f"no round {args.until_round} with {args.until_peers} peer(s) online in "
                    f"{args.timeout:.0f} s (last seen: {view})"
                )
            time.sleep(1.0)
    except KeyboardInterrupt:
        view = {}
    finally:
        codes = stop_all()
    summary = {
        "swarm_id": swarm_id,
        "round": view.get("round"),
        "peers_online": view.get("peers_online"),
        "agreement": view.get("agreement"),
        "exit_codes": codes,
        "dir": str(root),
    }
    print(json.dumps(summary, indent=2))
    return 0 if all(c == 0 for c in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
