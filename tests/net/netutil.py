"""Helpers for the peer-layer tests: a record kind with an integer field, nodes on loopback."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager

from swarmloco.core.adoption import Evidence
from swarmloco.core.state import StateSchema
from swarmloco.net.client import RpcClient
from swarmloco.net.dht.node import DHTNode
from swarmloco.net.dht.transport import DhtServicer, DhtTransport, GrpcDhtTransport
from swarmloco.net.identity import Identity
from swarmloco.net.node import NetNode, NodeConfig
from swarmloco.net.records import Int, RecordKind, Str, Struct, register
from swarmloco.net.server import PeerServer, ServerConfig
from swarmloco.runtime.catchup import CatchUp, CatchUpConfig

SWARM = "ab" * 20

# Registered through the public extension point, as later layers register theirs: the
# layer's own kinds have no integer field to put a float in.
COUNTER = register(
    RecordKind(
        name="test-counter",
        pattern="test-counter",
        schema=Struct({"count": Int(minimum=0), "label": Str(32)}),
        owned=True,
        max_ttl=3600.0,
        max_value_bytes=128,
        max_subkeys=1_000_000,
    )
)


def counter_key(swarm_id: str = SWARM) -> str:
    return f"swarmloco/v1/{swarm_id}/test-counter"


@asynccontextmanager
async def loopback_network(size: int, **config: object) -> AsyncIterator[list[NetNode]]:
    """``size`` real nodes on 127.0.0.1 (ports picked by the OS), all joined via the first."""
    async with AsyncExitStack() as stack:
        first = await stack.enter_async_context(
            NetNode(identity=Identity.generate(), config=NodeConfig(**config))  # type: ignore[arg-type]
        )
        nodes = [first]
        for _ in range(size - 1):
            node = NetNode(
                identity=Identity.generate(),
                config=NodeConfig(peers=(first.endpoint,), **config),  # type: ignore[arg-type]
            )
            nodes.append(await stack.enter_async_context(node))
        yield nodes


@asynccontextmanager
async def serving(
    make: Callable[[DhtTransport], DHTNode], *, host: str = "127.0.0.1"
) -> AsyncIterator[DHTNode]:
    """A DHT node built by ``make`` (an honest or a misbehaving one), served on ``host`` (a
    loopback address)."""
    async with RpcClient() as client:
        node = make(GrpcDhtTransport(client))
        async with PeerServer(
            ServerConfig(host=host), [DhtServicer(node, node.rejections).service()]
        ) as server:
            node.set_endpoint(f"{host}:{server.port}", tls_fingerprint=server.tls_fingerprint)
            async with node:
                yield node


def closed_port() -> int:
    """A local port with nothing listening on it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def wait_for(condition: Callable[[], bool], *, timeout: float = 10.0) -> None:
    """Poll ``condition`` until it holds (a deadline, not a sleep, bounds the wait)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met before the deadline")
        await asyncio.sleep(0.01)


def wait_until(condition: Callable[[], bool], *, timeout: float, what: str = "") -> None:
    """:func:`wait_for` for a thread that is not an event loop's."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met before the deadline: {what}")
        pause.wait(0.05)


def run_in_threads(*calls: Callable[[], None], timeout: float) -> None:
    """Run each call on a thread of its own (daemon: one that hangs fails its test, not the
    run) and wait for all, up to ``timeout`` each; what any raised fails the test here."""
    errors: list[BaseException] = []

    def run(call: Callable[[], None]) -> None:
        try:
            call()
        except BaseException as exc:  # reported in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(call,), daemon=True) for call in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not errors and not any(t.is_alive() for t in threads), errors


def catch_up_of(
    me: NetNode,
    *,
    swarm_id: str,
    numel: int,
    config: CatchUpConfig,
    evidence: Evidence | None = None,
) -> CatchUp:
    """The catch-up of the peer at ``me`` in a swarm of DiLoCo states of ``numel`` values
    (``evidence``: what it saw of its own rounds; none: a fresh peer)."""
    return CatchUp(
        me=me.identity.peer_id_hex,
        swarm_id=swarm_id,
        dht=me.dht,
        client=me.client,
        schema=StateSchema.diloco(numel),
        evidence=evidence if evidence is not None else Evidence(),
        config=config,
        trusted=me.trusted_peers,
    )
