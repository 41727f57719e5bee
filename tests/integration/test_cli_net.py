"""`swarmloco bootstrap`, `create --no-train` and `join --dry-run` as real processes."""

import asyncio
import re
import signal
import sys
import time
from pathlib import Path

import msgpack
from cliutil import COMMAND, Bootstrap, rss_mb, swarmloco

from swarmloco.core.manifest import SwarmManifest
from swarmloco.net.admission import Membership
from swarmloco.net.client import RpcClient
from swarmloco.net.dht.node import DHTNode
from swarmloco.net.dht.transport import DhtServicer, GrpcDhtTransport
from swarmloco.net.dht.wire import record_to_proto
from swarmloco.net.identity import Identity
from swarmloco.net.node import NetNode, NodeConfig
from swarmloco.net.records import Record
from swarmloco.net.server import PeerServer, ServerConfig


def test_bootstrap_serves_keeps_its_identity_and_stops_gracefully(tmp_path):
    with Bootstrap(tmp_path / "boot") as first:
        host, port = first.endpoint.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0
        assert first.stop(signal.SIGTERM) == 0
    assert any("stopping" in line for line in first.log)
    assert (tmp_path / "boot" / "identity.pem").stat().st_mode & 0o077 == 0
    with Bootstrap(tmp_path / "boot") as again:
        assert again.peer_id == first.peer_id
        assert again.stop(signal.SIGINT) == 0


def test_a_process_sent_sigusr1_writes_every_threads_stack_and_goes_on(tmp_path):
    # (How a peer that seems stuck says where; the e2e helper asks a peer still running
    # when its test failed.)
    with Bootstrap(tmp_path / "boot") as boot:
        boot.process.send_signal(signal.SIGUSR1)
        boot.wait_for_log(r"most recent call first", timeout=30)
        assert boot.stop(signal.SIGTERM) == 0  # it went on, and stops as usual


async def test_bootstrap_logs_peers_joining_and_leaving(tmp_path):
    with Bootstrap(tmp_path / "boot", "--liveness-interval", "0.3") as boot:
        identity = Identity.generate()
        async with NetNode(identity=identity, config=NodeConfig(peers=(boot.endpoint,))):
            await asyncio.to_thread(boot.wait_for_log, f"peer joined: {identity.peer_id_hex[:12]}")
        await asyncio.to_thread(boot.wait_for_log, f"peer left: {identity.peer_id_hex[:12]}")
        assert boot.stop() == 0


def test_bootstrap_imports_no_torch_and_stays_under_100_mb(tmp_path):
    probe = (
        "import sys; import swarmloco.cli as cli; cli.build_parser(); "
        "import swarmloco.net.bootstrap, swarmloco.net.node, swarmloco.net.swarm; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    import subprocess

    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    with Bootstrap(tmp_path / "boot") as boot:
        # Give it some work first: a swarm is created through it and peers look it up.
        created = swarmloco(
            "create", "--peer", boot.endpoint, "--data-dir", str(tmp_path / "p"), "--no-train"
        )
        assert created.returncode == 0, created.stderr
        for _ in range(3):
            joined = swarmloco("join", created.stdout.strip(), "--peer", boot.endpoint, "--dry-run")
            assert joined.returncode == 0, joined.stderr
        maps = Path(f"/proc/{boot.process.pid}/maps").read_text()
        assert "torch" not in maps  # no torch library was ever loaded
        assert rss_mb(boot.process.pid) < 100
        assert boot.stop() == 0


def test_create_publishes_and_join_dry_run_verifies(tmp_path):
    with Bootstrap(tmp_path / "boot") as boot:
        created = swarmloco(
            "create",
            "--task",
            "gpt-bytes",
            "--preset",
            "tiny",
            "--peer",
            boot.endpoint,
            "--data-dir",
            str(tmp_path / "creator"),
            "--warmup",
            "200",
            "--outer-momentum",
            "0.5",
            "--no-train",
        )
        assert created.returncode == 0, created.stderr
        swarm_id = created.stdout.strip()
        assert re.fullmatch(r"[0-9a-f]{40}", swarm_id), created.stdout
        summary = swarmloco("join", swarm_id, "--peer", boot.endpoint, "--dry-run")
        assert summary.returncode == 0, summary.stderr
        assert summary.stdout.startswith(f"swarm {swarm_id}\n"), summary.stdout
        for shown in (
            "gpt-bytes, preset tiny: 837,888 parameters",
            "every 50 inner steps; the run ends after 2,000 steps, 40 rounds",
            "warmup 200 steps",
            "momentum 0.5; updates combined by trimmed_mean",
            "anyone, each key proving 8 bits of work once",
        ):
            assert shown in summary.stdout, summary.stdout
        joined = swarmloco("join", swarm_id, "--peer", boot.endpoint, "--dry-run", "--json")
        assert joined.returncode == 0, joined.stderr
        assert '"task": "gpt-bytes"' in joined.stdout
        creator = Identity.load_or_create(tmp_path / "creator").public_key.hex()
        assert f'"creator": "{creator}"' in joined.stdout
        assert '"warmup_steps": 200' in joined.stdout  # --warmup enters the manifest
        assert '"outer_momentum": 0.5' in joined.stdout  # and so does --outer-momentum
        too_long = swarmloco(
            "create", "--peer", boot.endpoint, "--data-dir", str(tmp_path / "creator"),
            "--warmup", "5000", "--total-steps", "1000", "--no-train",
        )  # fmt: skip
        assert too_long.returncode != 0
        assert "--warmup 5000 is longer than the run" in too_long.stderr
        # Anyone may join a public run: its default aggregator is a robust one.
        assert '"method": "trimmed_mean"' in joined.stdout
        # An id nobody created, and something that is not an id at all.
        unknown = swarmloco("join", "12" * 20, "--peer", boot.endpoint, "--dry-run")
        assert unknown.returncode != 0
        assert "unknown to this network" in unknown.stderr
        malformed = swarmloco("join", "xyz", "--peer", boot.endpoint, "--dry-run")
        assert malformed.returncode != 0 and "not a swarm id" in malformed.stderr
        # A stage of a run that has none is refused, not ignored.
        staged = swarmloco("join", swarm_id, "--peer", boot.endpoint, "--stage", "1", "--dry-run")
        assert staged.returncode != 0 and "not a pipelined run" in staged.stderr, staged.stderr
        assert "--stage mean" in staged.stderr
        audited = swarmloco("join", swarm_id, "--peer", boot.endpoint, "--audit-share", "0.1",
                            "--dry-run")  # fmt: skip
        assert audited.returncode != 0 and "--audit-share mean" in audited.stderr
        idle = swarmloco("join", swarm_id, "--peer", boot.endpoint, "--leave-idle", "60",
                         "--dry-run")  # fmt: skip
        assert idle.returncode != 0 and "--leave-idle mean" in idle.stderr, idle.stderr
        gapped = swarmloco("join", swarm_id, "--peer", boot.endpoint, "--rebalance-gap", "1",
                           "--dry-run")  # fmt: skip
        assert gapped.returncode != 0 and "--rebalance-gap is a share" in gapped.stderr
        # A stage peer must be dialled: a pipelined run refuses --client-mode by name.
        creator = ("--peer", boot.endpoint, "--data-dir", str(tmp_path / "creator"))
        piped = swarmloco("create", *creator, "--stages", "2", "--no-train")
        assert piped.returncode == 0, piped.stderr
        hidden = swarmloco("join", piped.stdout.strip(), "--peer", boot.endpoint,
                           "--client-mode", "--dry-run")  # fmt: skip
        assert hidden.returncode != 0 and "is a pipelined run" in hidden.stderr, hidden.stderr
        negative = swarmloco("join", piped.stdout.strip(), "--peer", boot.endpoint,
                             "--leave-idle", "-1", "--dry-run")  # fmt: skip
        assert negative.returncode != 0 and "--leave-idle is seconds" in negative.stderr
        assert "--client-mode serves nothing, and a stage peer must be dialled" in hidden.stderr
        driving = swarmloco("create", *creator, "--stages", "2", "--client-mode")
        assert driving.returncode != 0 and "a stage peer must be dialled" in driving.stderr
        assert boot.stop() == 0


def test_the_creator_of_a_private_swarm_admits_peers_and_nobody_else_can(tmp_path):
    with Bootstrap(tmp_path / "boot") as boot:
        creator = str(tmp_path / "creator")
        common = ("--preset", "tiny", "--peer", boot.endpoint, "--no-train")
        private = swarmloco("create", *common, "--data-dir", creator, "--private")
        assert private.returncode == 0, private.stderr
        swarm_id = private.stdout.strip()
        shown = swarmloco("join", swarm_id, "--peer", boot.endpoint, "--dry-run")
        assert shown.returncode == 0, shown.stderr
        assert "combined by mean" in shown.stdout  # admitted peers only: the plain mean
        assert "admitted keys only" in shown.stdout
        peer = Identity.load_or_create(tmp_path / "peer").peer_id_hex
        admitted = swarmloco(
            "admit",
            peer,
            "--swarm",
            swarm_id,
            "--peer",
            boot.endpoint,
            "--data-dir",
            creator,
            "--days",
            "30",
        )
        assert admitted.returncode == 0, admitted.stderr
        cert = Membership.from_text(admitted.stdout)
        assert (cert.swarm_id, cert.peer_id) == (swarm_id, peer)
        assert 29 * 86400 < cert.expires_at - time.time() <= 30 * 86400
        assert f"admitted peer {peer}" in admitted.stderr
        # Another key cannot admit; a public swarm has nobody to admit.
        other = swarmloco(
            "admit",
            peer,
            "--swarm",
            swarm_id,
            "--peer",
            boot.endpoint,
            "--data-dir",
            str(tmp_path / "peer"),
        )
        assert other.returncode == 2 and "only its creator can admit" in other.stderr
        public = swarmloco("create", *common, "--data-dir", creator)
        assert public.returncode == 0, public.stderr
        open_run = swarmloco(
            "admit",
            peer,
            "--swarm",
            public.stdout.strip(),
            "--peer",
            boot.endpoint,
            "--data-dir",
            creator,
        )
        assert open_run.returncode == 2 and "is public" in open_run.stderr
        assert boot.stop() == 0


def test_a_peer_address_that_does_not_answer_fails_within_seconds():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    started = time.monotonic()
    result = swarmloco("join", "12" * 20, "--peer", dead, "--dry-run")
    assert result.returncode == 2
    assert f"cannot join the network: none of {dead} answered" in result.stderr
    assert time.monotonic() - started < 10  # the join deadline is 5 s


def test_a_client_mode_creator_without_a_peer_is_refused_before_anything_starts(tmp_path):
    result = swarmloco("create", "--client-mode", "--data-dir", str(tmp_path))
    assert result.returncode == 2
    assert "--client-mode serves nothing" in result.stderr
    assert result.stdout == ""  # no swarm id printed for a swarm nobody could reach


def test_every_command_explains_itself():
    for command in ("bootstrap", "create", "join", "admit"):
        result = swarmloco(command, "--help")
        assert result.returncode == 0
        assert "example" in result.stdout
        assert "--peer" in result.stdout and "--data-dir" in result.stdout


class RogueNode(DHTNode):
    """Serves the manifest of another run under any manifest key it is asked for."""

    impostor: SwarmManifest

    async def handle_find_value(self, request, observed_host):
        response = await super().handle_find_value(request, observed_host)
        fake = Record(request.key, "", msgpack.packb(self.impostor.to_bytes()), time.time() + 60)
        response.records.append(record_to_proto(fake))
        return response


async def test_join_refuses_a_manifest_whose_hash_differs():
    wanted = SwarmManifest(task="gpt-bytes", model={}, data={}, hparams={}, name="wanted")
    impostor = SwarmManifest(task="gpt-bytes", model={}, data={}, hparams={}, name="impostor")
    async with RpcClient() as client:
        rogue = RogueNode(identity=Identity.generate(), transport=GrpcDhtTransport(client))
        rogue.impostor = impostor
        async with PeerServer(
            ServerConfig(), [DhtServicer(rogue, rogue.rejections).service()]
        ) as server:
            rogue.set_endpoint(f"127.0.0.1:{server.port}", tls_fingerprint=server.tls_fingerprint)
            async with rogue:
                process = await asyncio.create_subprocess_exec(
                    *COMMAND,
                    "join",
                    wanted.swarm_id,
                    "--peer",
                    rogue.endpoint,
                    "--dry-run",
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE,
                )
                stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode == 2
    assert (
        f"hashes to {impostor.swarm_id}, not to the swarm id {wanted.swarm_id}" in stderr.decode()
    )
    assert stdout == b""
