"""The peer's session, alone: its manifest (the data directory's copy, or fetched from a
real DHT node on loopback), admission, remembered peers and signal handlers, each with
its parts injected (a real loop thread, a real data directory)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import threading
from pathlib import Path

import pytest

from swarmloco.core.manifest import SwarmManifest
from swarmloco.errors import ManifestError, SwarmlocoError
from swarmloco.net.admission import AdmissionError, Membership
from swarmloco.net.identity import Identity
from swarmloco.net.node import NetNode, NodeConfig
from swarmloco.net.swarm import publish_manifest
from swarmloco.runtime.config import PeerConfig
from swarmloco.runtime.loop_thread import LoopThread
from swarmloco.runtime.session import REMEMBER, Session, handle_signals

CREATOR = Identity.generate()


def manifest(**changes) -> SwarmManifest:
    fields = {
        "task": "custom",
        "model": {"signature": {}},
        "data": {},
        "hparams": {"run": {}},
        "creator": CREATOR.public_key.hex(),
    }
    return SwarmManifest(**{**fields, **changes})


@pytest.fixture
def loop():
    with LoopThread(name="test-session") as thread:
        yield thread


def session(tmp_path: Path, loop: LoopThread, swarm_id: str, *peers: str, **config) -> Session:
    cfg = PeerConfig(data_dir=tmp_path, node=NodeConfig(peers=peers), **config)
    return Session(cfg, Identity.load_or_create(tmp_path), loop, swarm_id)


def test_the_manifest_comes_from_the_data_directorys_copy_without_a_network(tmp_path, loop):
    m = manifest()
    copy = tmp_path / "swarms" / m.swarm_id / "manifest.json"
    copy.parent.mkdir(parents=True)
    copy.write_bytes(m.to_bytes())
    s = session(tmp_path, loop, m.swarm_id.upper())  # a user's spelling of the id
    assert s.manifest() == m and s.swarm_id == m.swarm_id
    copy.write_bytes(manifest(name="another run").to_bytes())  # a copy that is not it
    with pytest.raises(ManifestError):
        s.manifest()


def test_without_a_copy_or_a_peer_it_says_what_to_give(tmp_path, loop):
    with pytest.raises(SwarmlocoError, match="no peer to fetch its manifest from"):
        session(tmp_path, loop, manifest().swarm_id).manifest()


def test_the_manifest_is_fetched_through_a_peer_and_checked_against_the_id(tmp_path, loop):
    m = manifest()

    async def serve(ready: threading.Event, stop: threading.Event, where: list[str]) -> None:
        async with NetNode(identity=Identity.generate(), config=NodeConfig()) as node:
            await publish_manifest(node.dht, m)
            where.append(node.endpoint)
            ready.set()
            await asyncio.to_thread(stop.wait)

    with LoopThread(name="test-node") as other:
        ready, stop, where = threading.Event(), threading.Event(), []
        served = other.submit(serve(ready, stop, where))
        assert ready.wait(30)
        try:
            s = session(tmp_path, loop, m.swarm_id, where[0])
            assert s.manifest() == m
            with pytest.raises(ManifestError):
                session(
                    tmp_path / "b", loop, manifest(name="unknown").swarm_id, where[0]
                ).manifest()
        finally:
            stop.set()
            served.result(30)


def test_the_peers_it_knew_are_kept_for_the_next_start(tmp_path, loop):
    s = session(tmp_path, loop, manifest().swarm_id)
    assert s.remembered() == ()  # nothing yet
    s.swarm_dir.mkdir(parents=True)
    s.remember(["127.0.0.1:1000", "127.0.0.2:2000"])
    assert s.remembered() == ("127.0.0.1:1000", "127.0.0.2:2000")
    path = s.swarm_dir / "peers.json"
    before = path.stat().st_mtime_ns
    s.remember(["127.0.0.1:1000", "127.0.0.2:2000"])  # unchanged: not written again
    assert path.stat().st_mtime_ns == before
    # What a hand (or a torn write) left there is read with care.
    path.write_text(json.dumps({"peers": ["not an endpoint", 7, "127.0.0.3:3000"]}))
    assert s.remembered() == ("127.0.0.3:3000",)
    path.write_text("{")
    assert s.remembered() == ()
    many = [f"127.0.0.1:{1000 + i}" for i in range(3 * REMEMBER)]
    s.remember(many)
    assert len(s.remembered()) == REMEMBER


def test_a_private_swarms_certificate_is_kept_for_restarts(tmp_path, loop):
    m = manifest(admission="certificate")
    peer = Identity.load_or_create(tmp_path)
    text = Membership.issue(CREATOR, m.swarm_id, peer.peer_id_hex).to_text()
    with pytest.raises(AdmissionError):
        session(tmp_path, loop, m.swarm_id).admission(m)  # none given, none kept
    assert session(tmp_path, loop, m.swarm_id, membership=text).admission(m) is not None
    kept = tmp_path / "swarms" / m.swarm_id / "membership"
    assert kept.read_text().strip() == text
    assert session(tmp_path, loop, m.swarm_id).admission(m) is not None  # the kept one
    assert session(tmp_path, loop, manifest().swarm_id).admission(manifest()) is None  # open


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals")
def test_the_first_signal_asks_to_stop_and_the_second_stops_at_once():
    asked: list[str] = []
    before = signal.getsignal(signal.SIGINT)
    with contextlib.ExitStack() as stack:
        handle_signals(stack, asked.append)
        signal.raise_signal(signal.SIGTERM)
        assert asked == ["signal SIGTERM"]
        # The defaults are back: a second Ctrl-C interrupts at once.
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert signal.getsignal(signal.SIGINT) is before  # and the caller's, once it is over
