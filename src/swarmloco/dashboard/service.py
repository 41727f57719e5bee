"""What ``swarmloco dashboard`` and ``swarmloco status`` run: a DHT client that reads one
swarm, and for the dashboard the collector and the HTTP app around it.

Both use a throwaway identity in client mode: they serve nothing on the DHT, announce
nothing and write nothing to disk. An unknown swarm id is refused up front (ManifestError).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from swarmloco.core.config import require
from swarmloco.core.manifest import check_swarm_id
from swarmloco.dashboard.app import HttpConfig, is_loopback, make_app, serve
from swarmloco.dashboard.collector import (
    Collector,
    CollectorConfig,
    check_peer_ids,
    read_swarm,
)
from swarmloco.dashboard.view import FRESH_S, build_view
from swarmloco.net.identity import Identity
from swarmloco.net.node import NetNode, NodeConfig
from swarmloco.net.swarm import fetch_manifest
from swarmloco.pipeline.load import Vouching

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DashboardConfig:
    swarm_id: str
    """The swarm to show."""
    peers: tuple[str, ...]
    """HOST:PORT of DHT nodes to join through."""
    host: str = "127.0.0.1"
    """Address the HTTP app binds (loopback by default: the page is for this machine)."""
    port: int = 8080
    """Port the HTTP app binds; 0 picks a free one."""
    collector: CollectorConfig = dataclasses.field(default_factory=CollectorConfig)
    http: HttpConfig = dataclasses.field(default_factory=HttpConfig)
    """How long and how many connections the HTTP app keeps (half-open ones time out)."""

    def __post_init__(self) -> None:
        check_swarm_id(self.swarm_id)
        require(bool(self.peers), "the dashboard joins the network through --peer HOST:PORT")
        require(
            isinstance(self.port, int) and 0 <= self.port < 65536,
            f"port must be in [0, 65535], got {self.port!r}",
        )


@asynccontextmanager
async def _reader(peers: tuple[str, ...]) -> AsyncIterator[NetNode]:
    config = NodeConfig(server=None, peers=peers)
    async with NetNode(identity=Identity.generate(), config=config) as node:
        yield node


async def serve_dashboard(
    config: DashboardConfig, *, stop: asyncio.Event, ready: Callable[[str], None]
) -> None:
    """Serve the dashboard until ``stop`` is set; ``ready(url)`` once it serves."""
    swarm_id = check_swarm_id(config.swarm_id)
    async with _reader(config.peers) as node:
        manifest = await fetch_manifest(node.dht, swarm_id)
        collector = Collector(
            dht=node.dht,
            swarm_id=swarm_id,
            manifest=manifest,
            rejoin=config.peers,
            config=config.collector,
            vouching=Vouching(node.who_serves, node.identity.peer_id_hex),
        )
        await collector.poll()  # the first page shows the swarm, not an empty table
        loopback = is_loopback(config.host)
        if not loopback:
            logger.warning(
                "serving the dashboard on %s: anyone who can reach this address can read it "
                "(it is read-only)",
                config.host,
            )
        app = make_app(lambda: collector.view, loopback_only=loopback)
        async with serve(app, host=config.host, port=config.port, config=config.http) as url:
            ready(url)
            async with asyncio.TaskGroup() as group:
                polling = group.create_task(collector.run())
                await stop.wait()
                polling.cancel()
    logger.info("dashboard stopped")


async def swarm_status(
    swarm_id: str,
    peers: tuple[str, ...],
    *,
    fresh_s: float = FRESH_S,
    timeout_s: float = 5.0,
    trust: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Read the swarm once and return its view (``swarmloco status``); ``trust``: peer
    ids whose partners' figures count, besides the swarm's creator."""
    swarm_id = check_swarm_id(swarm_id)
    trust = check_peer_ids(trust)
    async with _reader(peers) as node:
        manifest = await fetch_manifest(node.dht, swarm_id)
        reading = await read_swarm(
            node.dht,
            swarm_id,
            manifest=manifest,
            timeout_s=timeout_s,
            fresh_s=fresh_s,
            trust=trust,
            vouching=Vouching(node.who_serves, node.identity.peer_id_hex),
        )
    return build_view(reading, now=reading.at, fresh_s=fresh_s, trust=trust)
