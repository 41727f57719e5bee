"""One host flooding a peer with calls and connections: honest rounds still complete.

The honest peers bind every interface and dial each other at ``[::1]``; the flooder dials
``127.0.0.1``, so the target's server sees two different addresses on one machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
import pytest
from avgutil import assert_identical, averaging_peers, random_vectors, run_round
from grpc_health.v1 import health_pb2, health_pb2_grpc
from netutil import wait_for

from swarmloco.net.averaging import AllReduceResult
from swarmloco.net.client import Method, RpcClient, RpcError
from swarmloco.net.endpoints import parse_endpoint
from swarmloco.net.rejections import RejectionLog
from swarmloco.net.server import PeerServer, ServerConfig, Service, unary_service
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
async def flood(port: int, *, watches: int, idle: int, connections: int = 4):
    """From 127.0.0.1: ``watches`` health Watch calls held open over ``connections`` TLS
    connections (each call is an RPC in flight until cancelled), and ``idle`` TCP
    connections that never say anything. Yields (calls taken, calls refused)."""
    address = f"127.0.0.1:{port}"
    sockets = []
    channels = []
    calls = []
    async with RpcClient() as client:
        await client.open(address, 5)  # fetch and pin the target's certificate
        credentials = grpc.ssl_channel_credentials(client.certs.pinned(address))
        try:
            for _ in range(idle):
                sockets.append(await asyncio.open_connection("127.0.0.1", port))
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


async def test_a_host_holding_hundreds_of_calls_and_connections_does_not_stop_a_round():
    server = ServerConfig(host="::", max_concurrent_rpcs=64, max_rpcs_per_host=24)
    vectors = random_vectors(4, 64 * 50, seed=11)
    async with averaging_peers(4, server=server, announce_host="::1") as peers:
        # The honest peers reach each other at ::1, a host of its own.
        target = peers[0].node
        assert target.endpoint.startswith("[::1]:")
        _, port = parse_endpoint(target.endpoint)
        async with flood(port, watches=200, idle=200) as (started, refused):
            # The flooder got its share of the server and no more.
            assert started == 24 and refused == 176
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
        assert target.server.rejections.counts["too-many-calls"] >= 176


async def test_calls_beyond_the_per_host_limit_are_refused_and_the_slots_come_back():
    gate = asyncio.Event()

    async def hold(request, context):
        await gate.wait()
        return request

    service: Service = unary_service(
        "swarmloco.v1.Hold",
        {"Hold": (health_pb2.HealthCheckRequest, hold)},
        rejections=RejectionLog(logging.getLogger("test.hold")),
    )
    method = Method(
        "/swarmloco.v1.Hold/Hold", health_pb2.HealthCheckRequest, health_pb2.HealthCheckRequest
    )
    async with (
        PeerServer(ServerConfig(max_rpcs_per_host=3), [service]) as server,
        RpcClient() as client,
    ):
        address = f"127.0.0.1:{server.port}"
        held = [
            asyncio.ensure_future(
                client.call(address, method, health_pb2.HealthCheckRequest(), timeout=10)
            )
            for _ in range(3)
        ]
        await wait_for(lambda: sum(server.per_host.active.values()) == 3)
        with pytest.raises(RpcError) as info:
            await client.call(address, method, health_pb2.HealthCheckRequest(), timeout=5)
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "too many calls from your address" in str(info.value)
        gate.set()
        await asyncio.gather(*held)
        assert not server.per_host.active  # every slot given back
        await client.call(address, method, health_pb2.HealthCheckRequest(), timeout=5)
