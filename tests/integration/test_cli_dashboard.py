"""`swarmloco dashboard` and `swarmloco status` as real processes against a real
`swarmloco bootstrap` node, reading records that a node in this test publishes."""

import asyncio
import json
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from cliutil import COMMAND, Bootstrap, swarmloco

from swarmloco.core.agreement import DIGEST_BYTES
from swarmloco.core.manifest import SwarmManifest
from swarmloco.net.identity import Identity
from swarmloco.net.node import NetNode, NodeConfig
from swarmloco.net.records import digest_key, progress_key, status_key
from swarmloco.net.swarm import announce_peer, publish_manifest

pytestmark = pytest.mark.timeout(90)

MANIFEST = SwarmManifest(
    task="gpt-bytes", model={"preset": "tiny"}, data={}, hparams={}, name="cli run"
)
SWARM = MANIFEST.swarm_id
UNKNOWN = "0" * 40


def publish(entry: str, names: list[str]) -> list[str]:
    """Training peers' records, stored through the bootstrap node; returns their peer ids."""

    async def run() -> list[str]:
        ids = []
        for i, name in enumerate(names):
            config = NodeConfig(server=None, peers=(entry,))
            async with NetNode(identity=Identity.generate(), config=config) as node:
                if i == 0:
                    await publish_manifest(node.dht, MANIFEST)
                now = time.time()
                await announce_peer(node.dht, SWARM, role="trainer")
                status = {
                    "name": name,
                    "state": "training",
                    "round": 3,
                    "step": 300,
                    "tokens": 300 * 1024,
                    "tokens_per_s": 1000.0,
                    "loss": 2.25,
                    "device": "cpu",
                    "version": "0.1.0",
                    "started_at": now - 120.0,
                    "rounds_applied": 3,
                    "rounds_aborted": 0,
                    "downloads": 1,
                    "last_error": "",
                    "rounds": [
                        {
                            "round": 3,
                            "group": len(names),
                            "seconds": 0.8,
                            "bytes_sent": 250_000,
                            "bytes_received": 250_000,
                            "payload_bytes": 1_000_000,
                            "ok": True,
                            "at": now - 3.0,
                        }
                    ],
                    "at": now,
                }
                await node.dht.store(status_key(SWARM), status, ttl=300)
                progress = {"round": 4, "tokens": 2048, "tokens_per_s": 1000.0, "at": now}
                await node.dht.store(progress_key(SWARM), progress, ttl=300)
                digest = {"digest": b"\x07" * DIGEST_BYTES, "endpoint": "", "at": now}
                await node.dht.store(digest_key(SWARM, 3), digest, ttl=300)
                ids.append(node.identity.peer_id_hex)
        return ids

    return asyncio.run(run())


def get(url: str) -> tuple[int, dict[str, str], bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def test_status_prints_the_swarm_once(tmp_path: Path):
    with Bootstrap(tmp_path / "boot") as boot:
        ids = publish(boot.endpoint, ["alpha", "beta"])
        as_json = swarmloco("status", SWARM, "--peer", boot.endpoint, "--json")
        assert as_json.returncode == 0, as_json.stderr
        view = json.loads(as_json.stdout)
        assert view["swarm"]["name"] == "cli run" and view["peers_online"] == 2
        assert {p["id"] for p in view["peers"]} == set(ids) and view["round"] == 3
        assert view["agreement"]["holders"] == 2 and view["tokens_per_s"] == 2000.0
        as_text = swarmloco("status", SWARM, "--peer", boot.endpoint)
        assert as_text.returncode == 0, as_text.stderr
        assert f"swarm {SWARM}" in as_text.stdout and "'cli run'" in as_text.stdout
        assert "peers online 2 (of 2 known)" in as_text.stdout
        assert re.search(r"alpha\s+[0-9a-f]{12}\s+training\s+3", as_text.stdout)
        assert "2/2 agree on round 3" in as_text.stdout and "4.00x" in as_text.stdout
        unknown = swarmloco("status", UNKNOWN, "--peer", boot.endpoint)
        assert unknown.returncode == 2
        assert f"swarm {UNKNOWN} is unknown to this network" in unknown.stderr
        assert boot.stop() == 0


def test_dashboard_serves_until_sigterm_and_never_loads_torch(tmp_path: Path):
    with Bootstrap(tmp_path / "boot") as boot:
        ids = publish(boot.endpoint, ["gamma"])
        args = ["dashboard", SWARM, "--peer", boot.endpoint, "--port", "0", "--interval", "0.5"]
        process = subprocess.Popen(
            [*COMMAND, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert process.stdout is not None
            line = process.stdout.readline()  # printed once it serves, or it died
            match = re.fullmatch(
                rf"swarmloco dashboard: serving (http://127\.0\.0\.1:\d+/) for swarm {SWARM}\n",
                line,
            )
            assert match, (line, process.stderr.read() if process.poll() is not None else "")
            url = match.group(1)
            status, headers, body = get(url + "api/v1/state")
            assert status == 200 and headers["Cache-Control"] == "no-store"
            view = json.loads(body)
            assert view["peers_online"] == 1 and view["peers"][0]["id"] == ids[0]
            status, _, body = get(url + "metrics")
            assert status == 200 and b"swarmloco_peers_online 1.0" in body
            status, headers, body = get(url)
            assert status == 200 and b"<svg" in body and "Content-Security-Policy" in headers
            request = urllib.request.Request(url + "api/v1/state", data=b"{}", method="POST")
            try:
                urllib.request.urlopen(request, timeout=10)
                raise AssertionError("POST was accepted")
            except urllib.error.HTTPError as error:
                assert error.code == 405
            assert "torch" not in Path(f"/proc/{process.pid}/maps").read_text()
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=15) == 0
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)
        assert boot.stop() == 0


def test_dashboard_refuses_an_unknown_swarm(tmp_path: Path):
    with Bootstrap(tmp_path / "boot") as boot:
        result = swarmloco("dashboard", UNKNOWN, "--peer", boot.endpoint, "--port", "0")
        assert result.returncode == 2 and "serving" not in result.stdout
        assert f"swarm {UNKNOWN} is unknown to this network" in result.stderr
        malformed = swarmloco("dashboard", "not-an-id", "--peer", boot.endpoint)
        assert malformed.returncode == 2 and "is not a swarm id" in malformed.stderr
        assert boot.stop() == 0
