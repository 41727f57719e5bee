"""Floods of calls and connections against a peer's server: honest calls and rounds go on.

The honest peers bind every interface and dial each other at ``[::1]``; flooders call
from 127.0.0.1, or from 127.0.0.N through a :class:`~sourceproxy.SourceProxy`, so the
target's server sees each flooder as a network of its own, apart from the honest peers.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from contextlib import AsyncExitStack

import grpc
import pytest
from avgutil import assert_identical, averaging_peers, random_vectors, run_round
from grpc_health.v1 import health_pb2, health_pb2_grpc
from netutil import wait_for
from sourceproxy import sources

from swarmloco.net.averaging import AllReduceResult
from swarmloco.net.client import Method, RpcClient, RpcError
from swarmloco.net.endpoints import host_of_grpc_peer, parse_endpoint
from swarmloco.net.rejections import RejectionLog
from swarmloco.net.server import PeerServer, Pool, ServerConfig, Service, unary_service
from swarmloco.net.tls import TLS_SERVER_NAME

HEALTH = Method(
    "/grpc.health.v1.Health/Check", health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse
)


def _has_ipv6_loopback() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


pytestmark = pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback (::1)")


@contextlib.asynccontextmanager
async def flood(address: str, *, watches: int, idle: int = 0, connections: int = 4):
    """To ``address``: ``watches`` health Watch calls held open over ``connections`` TLS
    connections (each call is an RPC in flight until cancelled), and ``idle`` TCP
    connections that never say anything. Yields (calls taken, calls refused)."""
    host, port = parse_endpoint(address)
    sockets = []
    channels = []
    calls = []
    async with RpcClient() as client:
        await client.open(address, 5)  # fetch and pin the target's certificate
        credentials = grpc.ssl_channel_credentials(client.certs.pinned(address))
        try:
            for _ in range(idle):
                sockets.append(await asyncio.open_connection(host, port))
            for _ in range(connections):
                options = [
                    ("grpc.ssl_target_name_override", TLS_SERVER_NAME),
                    ("grpc.use_local_subchannel_pool", 1),  # a connection of its own
                ]
                channels.append(grpc.aio.secure_channel(address, credentials, options=options))
            taken = refused = 0
            for i in range(watches):
                stub = health_pb2_grpc.HealthStub(channels[i % connections])
                call = stub.Watch(health_pb2.HealthCheckRequest())
                calls.append(call)
                try:
                    await asyncio.wait_for(call.read(), 5)
                    taken += 1
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
                    refused += 1
            yield taken, refused
        finally:
            for call in calls:
                call.cancel()
            for channel in channels:
                await channel.close()
            for _, writer in sockets:
                writer.close()


HOLD = Method(
    "/swarmloco.v1.Hold/Hold", health_pb2.HealthCheckRequest, health_pb2.HealthCheckRequest
)


class Holder:
    """A ``Hold`` service whose calls stay open until ``gate`` is set: any call a stranger
    can keep open (a wait for a group, a slow request), made to last as long as a test
    needs. ``entered`` counts the calls let in, by caller host."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.entered: collections.Counter[str] = collections.Counter()

    def service(self) -> Service:
        async def hold(request, context):
            self.entered[host_of_grpc_peer(context.peer())] += 1
            await self.gate.wait()
            return request

        return unary_service(
            "swarmloco.v1.Hold",
            {"Hold": (health_pb2.HealthCheckRequest, hold)},
            rejections=RejectionLog(logging.getLogger("test.hold")),
        )


async def test_a_host_holding_hundreds_of_calls_and_connections_does_not_stop_a_round():
    server = ServerConfig(host="::", max_concurrent_rpcs=64, max_rpcs_per_network=24)
    vectors = random_vectors(4, 64 * 50, seed=11)
    async with averaging_peers(4, server=server, announce_host="::1") as peers:
        # The honest peers reach each other at ::1, a host of its own.
        target = peers[0].node
        assert target.endpoint.startswith("[::1]:")
        _, port = parse_endpoint(target.endpoint)
        async with flood(f"127.0.0.1:{port}", watches=200, idle=200) as (started, refused):
            # The flooder got its share of the long-call budget and no more.
            assert started == 4 and refused == 196
            results = await run_round(peers, 1, vectors, [1.0] * 4, timeout=20)
            assert all(isinstance(r, AllReduceResult) for r in results), results
            assert_identical(results)  # type: ignore[arg-type]
            assert all(len(r.report.members) == 4 and not r.report.excluded for r in results)  # type: ignore[union-attr]
            # And a fresh honest call still gets through.
            async with RpcClient() as client:
                answer = await client.call(
                    target.endpoint, HEALTH, health_pb2.HealthCheckRequest(), timeout=5
                )
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
        assert target.server is not None
        assert target.server.rejections.counts["too-many-long-calls"] >= 196


async def test_watch_streams_from_four_networks_take_only_the_long_call_budget():
    # Were Watch streams calls at large, four networks with 16 each would hold all 64
    # slots: honest pings refused, no round (issue 30, attack 4). On a budget of their
    # own, they hold 10 long slots in all and nothing else.
    server = ServerConfig(
        host="::",
        max_concurrent_rpcs=64,
        max_rpcs_per_network=16,
        max_long_calls=10,
        max_long_calls_per_network=4,
    )
    vectors = random_vectors(4, 64 * 50, seed=12)
    async with averaging_peers(4, server=server, announce_host="::1") as peers:
        target = peers[0].node
        assert target.server is not None
        _, port = parse_endpoint(target.endpoint)
        addresses = [f"127.0.0.{n}" for n in range(2, 7)]
        async with (
            sources(addresses, ("127.0.0.1", port)) as proxies,
            AsyncExitStack() as stack,
        ):
            *strangers, honest = proxies
            floods = [
                await stack.enter_async_context(flood(p.endpoint, watches=64)) for p in strangers
            ]
            # As many as the server takes: 4 per network until 10 in all.
            assert [taken for taken, _ in floods] == [4, 4, 2, 0]
            assert all(taken + refused == 64 for taken, refused in floods)
            assert target.server.rejections.counts["too-many-long-calls"] == 4 * 64 - 10
            assert target.server.slots.held(Pool.LONG) == {
                "127.0.0.2": 4,
                "127.0.0.3": 4,
                "127.0.0.4": 2,
            }
            # A caller at another address still pings...
            async with RpcClient() as client:
                answer = await client.call(
                    honest.endpoint, HEALTH, health_pb2.HealthCheckRequest(), timeout=5
                )
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
            # ... and the honest peers still average.
            results = await run_round(peers, 1, vectors, [1.0] * 4, timeout=20)
            assert all(isinstance(r, AllReduceResult) for r in results), results
            assert_identical(results)  # type: ignore[arg-type]
            assert all(len(r.report.members) == 4 and not r.report.excluded for r in results)  # type: ignore[union-attr]
            assert target.server.slots.in_use(Pool.LONG) == 10  # the flood stayed all along


async def test_the_members_of_a_round_have_slots_no_stranger_can_take():
    # Four networks hold every slot of calls at large (16) with calls that stay open: a
    # fifth caller is refused. The members of the group the target averages with are on
    # its reserve, so their next round completes all the same.
    holder = Holder()
    server = ServerConfig(
        host="::", max_concurrent_rpcs=16, max_rpcs_per_network=4, reserved_rpcs=64
    )
    vectors = random_vectors(4, 64 * 50, seed=13)
    async with averaging_peers(
        4, server=server, announce_host="::1", services=[holder.service()]
    ) as peers:
        target = peers[0].node
        assert target.server is not None
        slots = target.server.slots
        results = await run_round(peers, 1, vectors, [1.0] * 4, timeout=30)
        assert all(isinstance(r, AllReduceResult) for r in results), results
        # The members' host is on the reserve until round 1's deadline.
        assert slots.reserved("::1") and not slots.reserved("127.0.0.2")
        _, port = parse_endpoint(target.endpoint)
        addresses = [f"127.0.0.{n}" for n in range(2, 7)]
        async with sources(addresses, ("127.0.0.1", port)) as proxies, RpcClient() as client:
            *strangers, late = proxies
            held = [
                asyncio.ensure_future(
                    client.call(p.endpoint, HOLD, health_pb2.HealthCheckRequest(), timeout=60)
                )
                for p in strangers
                for _ in range(6)
            ]
            try:
                await wait_for(
                    lambda: sum(holder.entered.values()) == 16 and sum(h.done() for h in held) == 8
                )
                assert holder.entered == {f"127.0.0.{n}": 4 for n in range(2, 6)}
                for refused in [h for h in held if h.done()]:
                    with pytest.raises(RpcError) as info:
                        refused.result()
                    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert target.server.rejections.counts["too-many-calls"] == 8
                assert slots.in_use(Pool.AT_LARGE) == 16
                # The fault is in place: a caller at a fifth network finds no slot.
                with pytest.raises(RpcError) as info:
                    await client.call(
                        late.endpoint, HEALTH, health_pb2.HealthCheckRequest(), timeout=5
                    )
                assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "calls already" in str(info.value)
                assert target.server.rejections.counts["server-busy"] == 1
                reserved_before = slots.taken[Pool.RESERVED]
                results = await run_round(peers, 2, vectors, [1.0] * 4, timeout=30)
                assert all(isinstance(r, AllReduceResult) for r in results), results
                assert_identical(results)  # type: ignore[arg-type]
                assert all(len(r.report.members) == 4 and not r.report.excluded for r in results)  # type: ignore[union-attr]
                assert slots.taken[Pool.RESERVED] > reserved_before  # how they got in
                assert slots.in_use(Pool.AT_LARGE) == 16  # the strangers held on throughout
            finally:
                holder.gate.set()
                await asyncio.gather(*held, return_exceptions=True)


async def test_calls_beyond_the_per_network_limit_are_refused_and_the_slots_come_back():
    holder = Holder()
    async with (
        PeerServer(ServerConfig(max_rpcs_per_network=3), [holder.service()]) as server,
        RpcClient() as client,
    ):
        address = f"127.0.0.1:{server.port}"
        held = [
            asyncio.ensure_future(
                client.call(address, HOLD, health_pb2.HealthCheckRequest(), timeout=10)
            )
            for _ in range(3)
        ]
        await wait_for(lambda: holder.entered["127.0.0.1"] == 3)
        with pytest.raises(RpcError) as info:
            await client.call(address, HOLD, health_pb2.HealthCheckRequest(), timeout=5)
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "3 calls from 127.0.0.1 are in flight already" in str(info.value)
        assert server.rejections.counts["too-many-calls"] == 1
        holder.gate.set()
        await asyncio.gather(*held)
        assert server.slots.in_flight == 0  # every slot given back
        await client.call(address, HOLD, health_pb2.HealthCheckRequest(), timeout=5)
