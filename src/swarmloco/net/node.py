"""A peer's presence on the network: its gRPC server, its client and its DHT node, composed.

``async with NetNode(identity=..., config=...) as node`` binds the server (unless the node
runs in client mode), signs the node's contact card with the real port, starts the DHT
node and joins the network through ``config.peers``; leaving the block stops all of it in
reverse order. Other layers serve their own gRPC services on the same port by passing
:class:`~swarmloco.net.server.Service` registrations, and call other peers through
``node.client``: before such a call uses a TLS certificate taken on first use, the node
pings the address so that the server's own signed card confirms it (net/tls.py).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from typing import Any

import grpc

from swarmloco.core.config import require
from swarmloco.errors import NetworkError
from swarmloco.net.client import ClientConfig, RpcClient
from swarmloco.net.deadline import Deadline
from swarmloco.net.dht.contact import Contact, contact_from_proto
from swarmloco.net.dht.node import DhtConfig, DHTNode
from swarmloco.net.dht.transport import DhtServicer, GrpcDhtTransport
from swarmloco.net.endpoints import format_endpoint, guess_host, is_unspecified, parse_endpoint
from swarmloco.net.identity import Identity
from swarmloco.net.rejections import Rejection
from swarmloco.net.server import PeerServer, ServerConfig, Service
from swarmloco.net.tls import TlsCredentials
from swarmloco.proto.v1 import dht_pb2 as pb

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class NodeConfig:
    server: ServerConfig | None = dataclasses.field(default_factory=ServerConfig)
    """Where to serve; None runs in client mode (calls out, serves nothing, is no contact)."""
    announce_host: str | None = None
    """Host others should dial. Default: the bound host, or, when bound to every interface,
    the address the first peer that answers sees us at."""
    announce_port: int | None = None
    """Port others should dial, when it is not the bound one (a forwarded port, a proxy)."""
    peers: tuple[str, ...] = ()
    """HOST:PORT of peers to join through (none: start a new network)."""
    remembered: tuple[str, ...] = ()
    """HOST:PORT of peers known from an earlier run, tried together with ``peers``: any one
    answering is enough. If only these were given and none answers, the node starts alone
    (with a warning) instead of failing."""
    client: ClientConfig = dataclasses.field(default_factory=ClientConfig)
    dht: DhtConfig = dataclasses.field(default_factory=DhtConfig)

    def __post_init__(self) -> None:
        if self.server is not None:
            require(
                self.server.tls == self.client.tls,
                "server.tls and client.tls differ: a peer must speak TLS both ways or not at all",
            )
        for peer in (*self.peers, *self.remembered):
            parse_endpoint(peer)
        if self.announce_port is not None:
            require(
                0 < self.announce_port < 65536 and self.server is not None,
                "announce_port must be a port (1-65535) of a node that serves",
            )
        require(
            self.server is not None or bool(self.peers),
            "a client-mode node (no server) needs at least one peer to join through",
        )


class NetNode:
    """Server + client + DHT of one peer. Constructing does no I/O; entering starts it."""

    def __init__(
        self,
        *,
        identity: Identity,
        config: NodeConfig,
        services: Sequence[Service] = (),
        interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
        on_contact_added: Callable[[Contact], None] | None = None,
        on_contact_removed: Callable[[Contact], None] | None = None,
    ) -> None:
        self.identity = identity
        self.config = config
        self.client = RpcClient(config.client, interceptors=interceptors, confirm=self._confirm)
        self._transport = GrpcDhtTransport(self.client)
        self._on_contact_removed = on_contact_removed
        credentials = None
        if config.server is not None and config.server.tls:
            server = config.server
            credentials = (
                TlsCredentials.from_files(server.tls_cert_file, server.tls_key_file)
                if server.tls_cert_file and server.tls_key_file
                else TlsCredentials.for_identity(identity)
            )
        self.dht = DHTNode(
            identity=identity,
            transport=self._transport,
            config=config.dht,
            on_contact_added=on_contact_added,
            on_contact_removed=self._removed,
            on_card=self._card,
            tls_fingerprint=credentials.fingerprint if credentials is not None else b"",
        )
        dht_service = DhtServicer(self.dht, self.dht.rejections).service()
        self.server = (
            PeerServer(config.server, [dht_service, *services], credentials=credentials)
            if config.server is not None
            else None
        )
        self._stack = AsyncExitStack()

    def _removed(self, contact: Contact) -> None:
        self.client.certs.withdraw(contact.endpoint, contact.peer_id)
        if self._on_contact_removed is not None:
            self._on_contact_removed(contact)

    def _card(self, contact: Contact) -> None:
        self.client.certs.heard(
            contact.endpoint, contact.peer_id, contact.started_at_ms, contact.tls_fingerprint
        )

    async def _confirm(self, endpoint: str, deadline: Deadline) -> None:
        """Ping ``endpoint``: the transport checks that the card its server answers with
        names the key of the certificate it presented."""
        request = pb.PingRequest(sender=self.dht.card.to_proto())
        await self._transport.ping(endpoint, request, deadline)

    async def who_serves(self, endpoint: str, timeout: float) -> Contact:
        """The card the server at ``endpoint`` answers a ping with, checked (self-signed;
        under TLS, the key of its certificate): first-hand word of which key serves there.
        NetworkError when nothing answers or its card does not check out."""
        request = pb.PingRequest(sender=self.dht.card.to_proto())
        response = await self._transport.ping(endpoint, request, Deadline.after(timeout))
        try:
            return contact_from_proto(response.peer)
        except Rejection as exc:
            raise NetworkError(
                f"{endpoint} answered with a card that does not check: {exc}"
            ) from None

    def trusted_peers(self) -> frozenset[str]:
        """The peer ids (hex) that answered this node's join at the addresses it was given
        (``config.peers``: the operator's own choice, first-hand; not the peers remembered
        from an earlier run, whom the DHT named). Catch-up takes their states first when it
        has nothing of its own to hold a state against (docs/SECURITY.md, "The peers one
        joined through, and the creator")."""
        given = set(self.config.peers)
        return frozenset(p for e, p in self.dht.joined_through.items() if e in given and p)

    @property
    def endpoint(self) -> str:
        """What other peers dial to reach us ("" in client mode)."""
        return self.dht.endpoint

    async def __aenter__(self) -> NetNode:
        async with AsyncExitStack() as stack:
            await stack.enter_async_context(self.client)
            announce_port = None
            if self.server is not None:
                await stack.enter_async_context(self.server)
                host = self.config.announce_host or self.server.config.host
                port = self.config.announce_port or self.server.port
                if not is_unspecified(host):
                    self.dht.set_endpoint(format_endpoint(host, port))
                elif self.config.peers or self.config.remembered:
                    announce_port = port  # learn our host from the peers
                else:
                    # Nobody to ask how we are seen: announce our address on the default
                    # route (behind NAT, operators must say announce_host).
                    guessed = guess_host()
                    logger.warning(
                        "bound to every interface with no host to announce: announcing %s "
                        "(set the announce host if peers must dial another address)",
                        guessed,
                    )
                    self.dht.set_endpoint(format_endpoint(guessed, port))
            await stack.enter_async_context(self.dht)
            entry = tuple(dict.fromkeys((*self.config.peers, *self.config.remembered)))
            if entry:
                try:
                    await self.dht.join(entry, announce_port=announce_port)
                except NetworkError as exc:
                    if self.config.peers:
                        raise
                    logger.warning(
                        "none of the %d peer(s) remembered from the last run answered; "
                        "starting alone (%s)",
                        len(entry),
                        exc,
                    )
                    if announce_port is not None:
                        self.dht.set_endpoint(format_endpoint(guess_host(), announce_port))
            self._stack = stack.pop_all()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self._stack.aclose()
