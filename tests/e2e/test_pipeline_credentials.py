"""A pipelined run as its creator starts it, with the credentials a real run asks for: a
public run's proofs of work, a private run's certificates. The creator starts a network of
its own (no `--peer`), a peer joins stage 0 through it, and `swarmloco status` shows both
stages served: every stage peer's `stage-load` record, under the run's id, carries the key's
credential, which names the run, and each stage's swarm takes it.

(Found by running `create --stages 2` by hand on 2026-12-07: without `--peer` the creator
failed at once; with one, `status` and the dashboard showed every stage empty, the records
refused as unproven; a private run's joiner had no certificate its stage would take. The
other pipeline tests ask no work of their keys.)"""

from __future__ import annotations

import time

import pytest
from swarmutil import PeerProcess, swarmloco

from swarmloco.net.identity import Identity

pytestmark = pytest.mark.timeout(300)


def served(status: str) -> list[list[str]]:
    """The (stage, peers) rows of `swarmloco status`'s table of stages."""
    rows = [line.split() for line in status.splitlines()]
    return [row[:2] for row in rows if row[:1] in (["0"], ["1"])]


@pytest.mark.parametrize("credential", ["proof-of-work", "certificate"])
def test_a_pipelined_run_from_its_creator_alone_shows_its_stages_served(tmp_path, credential):
    run = ["--stages", "2"]  # (the creator takes stage 1: no stage has a peer, the later first)
    run += ["--identity-work", "4"] if credential == "proof-of-work" else ["--private"]
    with PeerProcess.create(tmp_path / "creator", *run) as creator:
        swarm, entry = creator.swarm_id, creator.endpoint
        joiner = []
        if credential == "certificate":
            key = Identity.load_or_create(tmp_path / "peer").peer_id_hex
            cert = swarmloco(
                "admit", key, "--swarm", swarm, "--data-dir", str(tmp_path / "creator")
            )
            assert cert.returncode == 0, cert.stderr
            joiner = ["--membership", cert.stdout.strip()]
        with PeerProcess.join(swarm, entry, tmp_path / "peer", "--stage", "0", *joiner) as peer:
            peer.wait_for("ready", timeout=120)
            peer.wait_for("driven", lambda e: e["driven"] > 0, timeout=120)
            # `status` reads once: the records of both are fresh every 2 s, and a record
            # counts once its server answered the reader as its key.
            deadline = time.monotonic() + 60
            while True:
                shown = swarmloco("status", swarm, "--peer", entry, timeout=60)
                assert shown.returncode == 0, shown.stderr
                if served(shown.stdout) == [["0", "1"], ["1", "1"]]:
                    break
                assert time.monotonic() < deadline, (shown.stdout, shown.stderr)
            assert "rejected input" not in shown.stderr, shown.stderr
            for p in (peer, creator):
                assert p.stop() == 0, p.log_tail()
                assert "Traceback" not in "".join(p.log), p.log_tail()
