"""An in-memory network for DHT nodes: thousands of nodes in one process and one loop.

Nodes register their handler under an endpoint; a :class:`MemoryTransport` delivers a
call by serializing the request, handing the bytes to the handler and serializing the
answer back, as the wire would, so no object is ever shared between two nodes. A node
that left the network is unreachable at once (like a refused connection). Each call
yields to the loop, so concurrent lookups interleave as they would over sockets;
``latency_s`` adds a fixed delay per call when a simulation wants one.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from google.protobuf.message import Message

from swarmloco.errors import NetworkError
from swarmloco.net.deadline import Deadline
from swarmloco.net.dht.node import DhtConfig, DHTNode
from swarmloco.net.dht.transport import DhtHandler
from swarmloco.net.endpoints import parse_endpoint
from swarmloco.net.identity import Identity
from swarmloco.net.rejections import Rejection
from swarmloco.proto.v1 import dht_pb2 as pb

Resp = TypeVar("Resp", bound=Message)


class MemoryNetwork:
    """Who is reachable at which endpoint, and how many calls were delivered."""

    def __init__(self, *, latency_s: float = 0.0) -> None:
        self.latency_s = latency_s
        self.calls = 0
        self._handlers: dict[str, DhtHandler] = {}

    def register(self, endpoint: str, handler: DhtHandler) -> None:
        if endpoint in self._handlers:
            raise ValueError(f"{endpoint} is already taken")
        self._handlers[endpoint] = handler

    def unregister(self, endpoint: str) -> None:
        self._handlers.pop(endpoint, None)

    def __contains__(self, endpoint: str) -> bool:
        return endpoint in self._handlers

    async def deliver(
        self,
        caller_host: str,
        endpoint: str,
        request: Message,
        response_type: type[Resp],
        handle: Callable[[DhtHandler, Message, str], Awaitable[Message]],
        deadline: Deadline,
    ) -> Resp:
        await asyncio.sleep(self.latency_s)
        handler = self._handlers.get(endpoint)
        if handler is None:
            raise NetworkError(f"{endpoint} did not answer: connection refused")
        if deadline.expired:
            raise NetworkError(f"{endpoint} did not answer: deadline exceeded")
        self.calls += 1
        incoming = type(request).FromString(request.SerializeToString())
        try:
            answer = await handle(handler, incoming, caller_host)
        except Rejection as rejection:
            raise NetworkError(f"{endpoint} refused the call: {rejection.reason}") from None
        return response_type.FromString(answer.SerializeToString())


class MemoryTransport:
    """The calls of one node whose address is ``host`` (as its peers observe it)."""

    def __init__(self, network: MemoryNetwork, endpoint: str) -> None:
        self._network = network
        self.host = parse_endpoint(endpoint)[0]

    async def _send(
        self, endpoint: str, request: Message, answer: type[Resp], handler: str, deadline: Deadline
    ) -> Resp:
        def handle(node: DhtHandler, message: Message, host: str) -> Awaitable[Message]:
            return getattr(node, handler)(message, host)  # type: ignore[no-any-return]

        return await self._network.deliver(self.host, endpoint, request, answer, handle, deadline)

    async def ping(
        self, endpoint: str, request: pb.PingRequest, deadline: Deadline
    ) -> pb.PingResponse:
        return await self._send(endpoint, request, pb.PingResponse, "handle_ping", deadline)

    async def find_node(
        self, endpoint: str, request: pb.FindNodeRequest, deadline: Deadline
    ) -> pb.FindNodeResponse:
        return await self._send(
            endpoint, request, pb.FindNodeResponse, "handle_find_node", deadline
        )

    async def store(
        self, endpoint: str, request: pb.StoreRequest, deadline: Deadline
    ) -> pb.StoreResponse:
        return await self._send(endpoint, request, pb.StoreResponse, "handle_store", deadline)

    async def find_value(
        self, endpoint: str, request: pb.FindValueRequest, deadline: Deadline
    ) -> pb.FindValueResponse:
        return await self._send(
            endpoint, request, pb.FindValueResponse, "handle_find_value", deadline
        )


class MemoryCluster:
    """Many DHT nodes on one :class:`MemoryNetwork`, for tests and simulations.

    Nodes get random public-looking IPv4 endpoints (so the per-/24 cap applies as on the
    internet). Add and remove nodes from the task that closes the cluster: each node's
    context is entered and left there.
    """

    def __init__(
        self,
        *,
        config: DhtConfig | None = None,
        rng: random.Random | None = None,
        latency_s: float = 0.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.clock = clock
        self.network = MemoryNetwork(latency_s=latency_s)
        self.config = config or DhtConfig(limit_private_subnets=True)
        self.rng = rng or random.Random()
        self.nodes: list[DHTNode] = []

    def _endpoint(self) -> str:
        while True:
            octets = [self.rng.randint(1, 223), *(self.rng.randint(0, 255) for _ in range(2))]
            endpoint = f"{'.'.join(map(str, octets))}.{self.rng.randint(1, 254)}:31337"
            if endpoint not in self.network:
                return endpoint

    async def add(self, *, join: bool = True, identity: Identity | None = None) -> DHTNode:
        """Start a node and join it through a random live node (the first needs none)."""
        endpoint = self._endpoint()
        node = DHTNode(
            identity=identity or Identity.generate(),
            transport=MemoryTransport(self.network, endpoint),
            config=self.config,
            endpoint=endpoint,
            rng=random.Random(self.rng.random()),
            clock=self.clock,
        )
        self.network.register(endpoint, node)
        await node.__aenter__()
        try:
            if join and self.nodes:
                await node.join([self.rng.choice(self.nodes).endpoint])
        except BaseException:
            self.network.unregister(endpoint)
            await node.__aexit__(None, None, None)
            raise
        self.nodes.append(node)
        return node

    async def remove(self, node: DHTNode) -> None:
        """Take a node off the network at once (as a crash would), then stop it."""
        self.network.unregister(node.endpoint)
        self.nodes.remove(node)
        await node.__aexit__(None, None, None)

    async def __aenter__(self) -> MemoryCluster:
        return self

    async def __aexit__(self, *exc: object) -> None:
        while self.nodes:
            await self.remove(self.nodes[-1])
