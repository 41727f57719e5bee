"""How DHT messages travel: a transport interface, its gRPC implementation and the gRPC
servicer that hands incoming calls to a :class:`DhtHandler` (the DHT node).

The DHT node never touches gRPC itself: it calls a :class:`DhtTransport` and answers as a
:class:`DhtHandler`. Over the network both sides are gRPC (this module); in simulations
both are the in-memory network of ``memory.py``. The node's logic is the same either way.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

import grpc
from google.protobuf.message import Message

from swarmloco.net.client import Method, RpcClient
from swarmloco.net.deadline import Deadline
from swarmloco.net.dht.contact import contact_from_proto
from swarmloco.net.endpoints import host_of_grpc_peer
from swarmloco.net.rejections import Rejection, RejectionLog
from swarmloco.net.server import Service, refuse, unary_service
from swarmloco.proto.v1 import dht_pb2 as pb

Req = TypeVar("Req", bound=Message)
Resp = TypeVar("Resp", bound=Message)

SERVICE_NAME = "swarmloco.v1.Dht"
PING = Method(f"/{SERVICE_NAME}/Ping", pb.PingRequest, pb.PingResponse)
FIND_NODE = Method(f"/{SERVICE_NAME}/FindNode", pb.FindNodeRequest, pb.FindNodeResponse)
STORE = Method(f"/{SERVICE_NAME}/Store", pb.StoreRequest, pb.StoreResponse)
FIND_VALUE = Method(f"/{SERVICE_NAME}/FindValue", pb.FindValueRequest, pb.FindValueResponse)


class DhtTransport(Protocol):
    """Outgoing DHT calls. Each raises NetworkError when the peer cannot answer in time."""

    async def ping(
        self, endpoint: str, request: pb.PingRequest, deadline: Deadline
    ) -> pb.PingResponse: ...

    async def find_node(
        self, endpoint: str, request: pb.FindNodeRequest, deadline: Deadline
    ) -> pb.FindNodeResponse: ...

    async def store(
        self, endpoint: str, request: pb.StoreRequest, deadline: Deadline
    ) -> pb.StoreResponse: ...

    async def find_value(
        self, endpoint: str, request: pb.FindValueRequest, deadline: Deadline
    ) -> pb.FindValueResponse: ...


class DhtHandler(Protocol):
    """Incoming DHT calls; ``observed_host`` is the caller's IP as the transport saw it.

    A handler raises :class:`Rejection` to refuse a request (the caller gets
    INVALID_ARGUMENT with the reason).
    """

    async def handle_ping(self, request: pb.PingRequest, observed_host: str) -> pb.PingResponse: ...

    async def handle_find_node(
        self, request: pb.FindNodeRequest, observed_host: str
    ) -> pb.FindNodeResponse: ...

    async def handle_store(
        self, request: pb.StoreRequest, observed_host: str
    ) -> pb.StoreResponse: ...

    async def handle_find_value(
        self, request: pb.FindValueRequest, observed_host: str
    ) -> pb.FindValueResponse: ...


class GrpcDhtTransport:
    """DHT calls over the peer's :class:`RpcClient`; one attempt each (a lookup moves on
    to other nodes rather than waiting for one).

    With TLS, every answer's card confirms the certificate the server presented: the
    card must name that certificate's key (a server relaying another peer's card is
    refused), and a card naming the very address dialled makes its claim on that address
    confirmed (net/tls.py). A certificate taken on first use needs no other confirmation
    before a DHT call: the answer is its confirmation, and the node checks the peer id it
    answers as.
    """

    def __init__(self, client: RpcClient, *, attempts: int = 1) -> None:
        self._client = client
        self._attempts = attempts

    async def _send(
        self, endpoint: str, method: Method[Req, Resp], request: Req, deadline: Deadline
    ) -> Resp:
        response = await self._client.call(
            endpoint,
            method,
            request,
            timeout=deadline,
            attempts=self._attempts,
            confirms_itself=True,
        )
        if self._client.config.tls and "peer" in response.DESCRIPTOR.fields_by_name:
            self._confirm(endpoint, response.peer)  # type: ignore[attr-defined]
        return response

    def _confirm(self, endpoint: str, info: pb.PeerInfo) -> None:
        """Raises TlsMismatch (a NetworkError) when the card names another key than the
        server's certificate."""
        try:
            card = contact_from_proto(info)
        except Rejection:
            return  # nothing confirmed; the node refuses the card and counts why
        self._client.certs.confirm(
            endpoint,
            peer_id=card.peer_id,
            card_endpoint=card.endpoint,
            started_at_ms=card.started_at_ms,
            fingerprint=card.tls_fingerprint,
        )

    async def ping(
        self, endpoint: str, request: pb.PingRequest, deadline: Deadline
    ) -> pb.PingResponse:
        return await self._send(endpoint, PING, request, deadline)

    async def find_node(
        self, endpoint: str, request: pb.FindNodeRequest, deadline: Deadline
    ) -> pb.FindNodeResponse:
        return await self._send(endpoint, FIND_NODE, request, deadline)

    async def store(
        self, endpoint: str, request: pb.StoreRequest, deadline: Deadline
    ) -> pb.StoreResponse:
        return await self._send(endpoint, STORE, request, deadline)

    async def find_value(
        self, endpoint: str, request: pb.FindValueRequest, deadline: Deadline
    ) -> pb.FindValueResponse:
        return await self._send(endpoint, FIND_VALUE, request, deadline)


class DhtServicer:
    """The gRPC face of a DHT node: thin adapters from messages to the handler."""

    def __init__(self, handler: DhtHandler, rejections: RejectionLog) -> None:
        self.handler = handler
        self._rejections = rejections

    def service(self) -> Service:
        return unary_service(
            SERVICE_NAME,
            {
                "Ping": (pb.PingRequest, self.ping),
                "FindNode": (pb.FindNodeRequest, self.find_node),
                "Store": (pb.StoreRequest, self.store),
                "FindValue": (pb.FindValueRequest, self.find_value),
            },
            rejections=self._rejections,
        )

    async def _dispatch(
        self,
        context: grpc.aio.ServicerContext,
        call: Callable[[DhtHandler, str], Awaitable[Resp]],
        refused: type[Resp],
    ) -> Resp:
        try:
            return await call(self.handler, host_of_grpc_peer(context.peer()))
        except Rejection as rejection:
            reason = rejection.reason
        refuse(context, grpc.StatusCode.INVALID_ARGUMENT, reason)  # not abort: see refuse
        return refused()  # never seen by the caller

    async def ping(
        self, request: pb.PingRequest, context: grpc.aio.ServicerContext
    ) -> pb.PingResponse:
        return await self._dispatch(
            context, lambda h, host: h.handle_ping(request, host), pb.PingResponse
        )

    async def find_node(
        self, request: pb.FindNodeRequest, context: grpc.aio.ServicerContext
    ) -> pb.FindNodeResponse:
        return await self._dispatch(
            context, lambda h, host: h.handle_find_node(request, host), pb.FindNodeResponse
        )

    async def store(
        self, request: pb.StoreRequest, context: grpc.aio.ServicerContext
    ) -> pb.StoreResponse:
        return await self._dispatch(
            context, lambda h, host: h.handle_store(request, host), pb.StoreResponse
        )

    async def find_value(
        self, request: pb.FindValueRequest, context: grpc.aio.ServicerContext
    ) -> pb.FindValueResponse:
        return await self._dispatch(
            context, lambda h, host: h.handle_find_value(request, host), pb.FindValueResponse
        )
