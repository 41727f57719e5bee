"""Who a peer is, in which swarm, before it trains: the first collaborator of
:class:`~swarmloco.runtime.swarm.Swarm` (DESIGN section 2, "The peer object and its
collaborators").

A :class:`Session` owns what a peer reads from and keeps in its data directory besides
checkpoints, and what it settles before any weight moves:

- the manifest: the copy in ``swarms/<id>/manifest.json`` (a restart needs no network),
  else fetched through the configured peers with a throwaway key, verified against the id;
- admission: a private swarm's membership certificate (given once, kept for restarts) or a
  public swarm's proof of work for this key (solved once, kept);
- the remembered peers, ``swarms/<id>/peers.json``: a restart joins through the peers it
  last knew, so a dead bootstrap address costs nothing;
and, beside it, :func:`handle_signals`: the first SIGINT or SIGTERM asks the peer to stop
at the next step, a second one stops at once.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from swarmloco.core.manifest import SwarmManifest, check_swarm_id
from swarmloco.errors import SwarmlocoError
from swarmloco.net.admission import Gate, gate_of
from swarmloco.net.endpoints import parse_endpoint
from swarmloco.net.identity import Identity
from swarmloco.runtime.config import PeerConfig
from swarmloco.runtime.loop_thread import LoopThread

logger = logging.getLogger("swarmloco.runtime.swarm")

REMEMBER = 32
"""Peers kept in ``peers.json`` for the next start."""


def is_endpoint(text: str) -> bool:
    try:
        parse_endpoint(text)
    except ValueError:
        return False
    return True


class Session:
    """The data directory's view of one swarm for one peer (see the module docstring).
    ``swarm_id`` may be a user's spelling of the id until :meth:`manifest` checks it."""

    def __init__(
        self, config: PeerConfig, identity: Identity, loop: LoopThread, swarm_id: str
    ) -> None:
        self.config = config
        self.identity = identity
        self.loop = loop
        self.swarm_id = swarm_id
        self._written: list[str] = []  # what peers.json holds, as written by us

    @property
    def swarm_dir(self) -> Path:
        return self.config.swarm_directory(self.swarm_id)

    # -- the manifest and admission ---------------------------------------------------------

    def manifest(self) -> SwarmManifest:
        """The swarm's manifest: the data directory's copy, else fetched through the peers
        (SwarmlocoError when there is neither; ManifestError when what came is not it)."""
        from swarmloco.net.node import NetNode, NodeConfig
        from swarmloco.net.swarm import fetch_manifest

        swarm_id = self.swarm_id = check_swarm_id(self.swarm_id)
        local = self.swarm_dir / "manifest.json"
        peers = self.config.node.peers
        if local.is_file():
            # A restart: our own copy, verified against the id (again, here) when we first
            # joined, needs no network; a dead entry address then costs nothing.
            return SwarmManifest.from_bytes(local.read_bytes(), expected_id=swarm_id)
        if not peers:
            raise SwarmlocoError(
                f"cannot join swarm {swarm_id}: no peer to fetch its manifest from (give "
                "peers=[HOST:PORT]) and no copy in the data directory"
            )

        async def fetch() -> SwarmManifest:
            # Fetching leaves nothing behind: a throwaway identity, no key file.
            config = NodeConfig(server=None, peers=peers, remembered=self.remembered())
            async with NetNode(identity=Identity.generate(), config=config) as node:
                return await fetch_manifest(node.dht, swarm_id)

        return self.loop.run(fetch(), timeout=60.0)

    def admission(self, manifest: SwarmManifest) -> Gate | None:
        """The swarm's gate with this peer's credential: a private swarm's certificate (the
        one in the config, then kept in the data directory for restarts, or the one kept;
        AdmissionError, saying what to do, before anything else happens, when the peer
        holds none), or a public run's proof of work for this key (solved once, kept)."""
        swarm_dir = self.config.swarm_directory(manifest.swarm_id)
        kept = swarm_dir / "membership"
        given = self.config.membership.strip()
        text = given
        if not text and kept.is_file():
            text = kept.read_text().strip()
        admission = gate_of(manifest, self.identity, text or None, work_file=swarm_dir / "work")
        if admission is not None and given:
            kept.parent.mkdir(parents=True, exist_ok=True)
            tmp = kept.with_suffix(".tmp")
            tmp.write_text(given + "\n")
            os.replace(tmp, kept)
        return admission

    # -- the peers it knew ------------------------------------------------------------------

    def remembered(self) -> tuple[str, ...]:
        """The peers this one knew when it last ran (``peers.json``): a restart joins
        through them too."""
        try:
            known = json.loads((self.swarm_dir / "peers.json").read_text())["peers"]
            return tuple(p for p in known if isinstance(p, str) and is_endpoint(p))[:REMEMBER]
        except (OSError, ValueError, KeyError, TypeError):
            return ()

    def remember(self, peers: list[str]) -> None:
        """Write ``peers`` to ``peers.json`` when they changed since the last write (best
        effort: a full disk only costs the next start a remembered address)."""
        if not peers or peers == self._written:
            return
        path = self.swarm_dir / "peers.json"
        try:
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"peers": peers[:REMEMBER], "at": time.time()}))
            os.replace(tmp, path)
            self._written = peers
        except OSError as exc:
            logger.debug("could not remember the peers this one knows: %s", exc)


def handle_signals(stack: contextlib.ExitStack, stop: Callable[[str], None]) -> None:
    """Until ``stack`` closes, the first SIGINT or SIGTERM calls ``stop("signal NAME")`` and
    the default handlers come back, so that a second one stops at once. Main thread only
    (Python's rule for signal handlers)."""
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def on_signal(signum: int, _frame: object) -> None:
        name = signal.Signals(signum).name
        logger.warning("%s: stopping after this step (again to stop at once)", name)
        stop(f"signal {name}")
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    for s in previous:
        signal.signal(s, on_signal)

    def restore() -> None:
        for s, handler in previous.items():
            signal.signal(s, handler)

    stack.callback(restore)
