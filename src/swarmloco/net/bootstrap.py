"""A DHT-only node for public runs (`swarmloco bootstrap`): no training, no torch.

It serves the DHT on one port with a stable identity (its key lives in its data dir, so
its peer id survives restarts), tells the caller its address once it serves, logs peers
as they enter and leave its routing table, and runs until ``stop`` is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path

from swarmloco.core.config import require, require_positive
from swarmloco.net.client import ClientConfig
from swarmloco.net.dht.contact import Contact
from swarmloco.net.dht.node import DHT_MESSAGE_BYTES, DhtConfig
from swarmloco.net.heap import release_when_grown
from swarmloco.net.identity import Identity
from swarmloco.net.node import NetNode, NodeConfig
from swarmloco.net.server import ServerConfig

logger = logging.getLogger("swarmloco.bootstrap")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BootstrapConfig:
    data_dir: Path
    """Where the node keeps its key (created on first run)."""
    host: str = "0.0.0.0"
    """Address to bind."""
    port: int = 31337
    """Port to bind (0: any free port)."""
    announce_host: str | None = None
    """Host other peers should dial, when it is not the bound address."""
    peers: tuple[str, ...] = ()
    """Other bootstrap nodes to join (optional)."""
    liveness_interval_s: float = 60.0
    """Peers not heard from for this long are pinged, and logged as gone if they fail."""
    reflection: bool = False
    """Serve gRPC server reflection (for `grpcurl`)."""
    tls_cert_file: str | None = None
    """The operator's own TLS certificate (with ``tls_key_file``); None: self-signed."""
    tls_key_file: str | None = None
    tls_ca_file: str | None = None
    """Accept only peers whose certificate this CA issued."""

    def __post_init__(self) -> None:
        require(0 <= self.port < 65536, f"port must be in [0, 65535], got {self.port}")
        require_positive("liveness_interval_s", self.liveness_interval_s)


async def serve_bootstrap(
    config: BootstrapConfig,
    *,
    stop: asyncio.Event,
    ready: Callable[[str, Identity], None],
) -> None:
    """Serve until ``stop`` is set; call ``ready(endpoint, identity)`` once serving."""
    identity = Identity.load_or_create(config.data_dir)
    node_config = NodeConfig(
        server=ServerConfig(
            host=config.host,
            port=config.port,
            # It serves the DHT alone: a larger message is refused by gRPC before it is
            # whole, and costs the node far less memory than one read and then refused.
            max_message_bytes=DHT_MESSAGE_BYTES,
            reflection=config.reflection,
            tls_cert_file=config.tls_cert_file,
            tls_key_file=config.tls_key_file,
        ),
        client=ClientConfig(tls_ca_file=config.tls_ca_file),
        announce_host=config.announce_host,
        peers=config.peers,
        dht=DhtConfig(liveness_interval_s=config.liveness_interval_s),
    )

    def joined(contact: Contact) -> None:
        logger.info("peer joined: %s (%d known)", contact, len(node.dht.routing))

    def left(contact: Contact) -> None:
        logger.info("peer left: %s (%d known)", contact, len(node.dht.routing))

    node = NetNode(
        identity=identity, config=node_config, on_contact_added=joined, on_contact_removed=left
    )
    async with node:
        releasing = asyncio.ensure_future(release_when_grown())
        try:
            ready(node.endpoint, identity)
            await stop.wait()
            logger.info("stopping")
        finally:
            releasing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await releasing
