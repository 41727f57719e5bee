"""The hardened gRPC server: health, reflection, extra services, limits, malformed input."""

import asyncio
import logging
import random
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from netutil import loopback_network, wait_for

from swarmloco.errors import NetworkError
from swarmloco.net.client import Method, RpcClient, RpcError
from swarmloco.net.identity import Identity
from swarmloco.net.node import NetNode, NodeConfig
from swarmloco.net.rejections import RejectionLog
from swarmloco.net.server import PeerServer, ServerConfig, Service, unary_service
from swarmloco.proto.v1 import dht_pb2 as pb

ECHO = Method("/swarmloco.v1.Echo/Echo", pb.PingRequest, pb.PingRequest)


def echo_service(gate: asyncio.Event | None = None, entered: list[int] | None = None) -> Service:
    """A service another layer might add: echoes its request (after ``gate``, if given)."""

    async def echo(request: pb.PingRequest, context: grpc.aio.ServicerContext) -> pb.PingRequest:
        if entered is not None:
            entered.append(1)
        if gate is not None:
            await gate.wait()
        return request

    rejections = RejectionLog(logging.getLogger("test.echo"))
    return unary_service(
        "swarmloco.v1.Echo", {"Echo": (pb.PingRequest, echo)}, rejections=rejections
    )


async def health_of(endpoint: str, service: str = "") -> int:
    async with RpcClient() as client:
        stub = health_pb2_grpc.HealthStub(await client.open(endpoint, 5))
        response = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        return response.status


async def test_health_and_reflection_answer_standard_tools():
    config = NodeConfig(server=ServerConfig(reflection=True))
    node = NetNode(identity=Identity.generate(), config=config, services=[echo_service()])
    async with node, RpcClient() as client:
        endpoint = node.endpoint
        assert node.server is not None and node.server.port > 0
        for service in ("", "swarmloco.v1.Dht", "swarmloco.v1.Echo"):
            assert await health_of(endpoint, service) == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(await client.open(endpoint, 5))
        requests = [
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol="swarmloco.v1.Dht"),
        ]
        answers = [a async for a in stub.ServerReflectionInfo(iter(requests), timeout=5)]
        names = {s.name for s in answers[0].list_services_response.service}
        assert {"swarmloco.v1.Dht", "swarmloco.v1.Echo", "grpc.health.v1.Health"} <= names
        assert answers[1].file_descriptor_response.file_descriptor_proto


async def test_reflection_is_off_unless_asked_for():
    async with PeerServer(ServerConfig()) as server, RpcClient() as client:
        stub = reflection_pb2_grpc.ServerReflectionStub(
            await client.open(f"127.0.0.1:{server.port}", 5)
        )
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            _ = [a async for a in stub.ServerReflectionInfo(iter([request]), timeout=5)]
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_other_layers_register_services_on_the_same_port():
    async with PeerServer(ServerConfig(), [echo_service()]) as server, RpcClient() as client:
        request = pb.PingRequest(sender=pb.PeerInfo(endpoint="x:1"))
        answer = await client.call(f"127.0.0.1:{server.port}", ECHO, request, timeout=5)
        assert answer == request
        with pytest.raises(RuntimeError, match="before the server starts"):
            server.add_service(echo_service())


async def test_fuzzed_protobuf_bytes_crash_nothing_and_store_nothing():
    rng = random.Random(20240601)
    async with loopback_network(2) as (target, other):
        valid = [
            pb.PingRequest(sender=other.dht.card.to_proto()).SerializeToString(),
            pb.FindNodeRequest(
                sender=other.dht.card.to_proto(), target=b"x" * 20
            ).SerializeToString(),
            pb.StoreRequest(
                sender=other.dht.card.to_proto(),
                records=[pb.Record(key="swarmloco/v1/" + "ab" * 20 + "/peers", value=b"\x80")],
            ).SerializeToString(),
        ]

        def fuzz() -> bytes:
            if rng.random() < 0.5:
                return rng.randbytes(rng.randint(0, 600))
            data = bytearray(rng.choice(valid))
            for _ in range(rng.randint(1, 8)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            return bytes(data)

        codes = set()
        async with RpcClient() as client:
            channel = await client.open(target.endpoint, 5)
            for name in ("Ping", "FindNode", "Store", "FindValue"):
                raw = channel.unary_unary(f"/swarmloco.v1.Dht/{name}")
                for _ in range(150):
                    try:
                        await raw(fuzz(), timeout=5)
                        codes.add(grpc.StatusCode.OK)
                    except grpc.aio.AioRpcError as exc:
                        codes.add(exc.code())
        # Refused as bad input (or undecodable): never an unhandled error in a handler.
        assert codes <= {
            grpc.StatusCode.OK,
            grpc.StatusCode.INVALID_ARGUMENT,
            grpc.StatusCode.INTERNAL,
        }
        assert grpc.StatusCode.INVALID_ARGUMENT in codes
        assert len(target.dht.storage) == 0
        assert target.dht.rejections.total > 0
        # Still serving, and still a working DHT node.
        assert await health_of(target.endpoint) == health_pb2.HealthCheckResponse.SERVING
        assert await other.dht.join([target.endpoint]) == 1


async def test_oversize_messages_are_refused():
    config = ServerConfig(max_message_bytes=64 * 1024)
    async with PeerServer(config, [echo_service()]) as server, RpcClient() as client:
        big = pb.PingRequest(sender=pb.PeerInfo(signature=b"x" * 100_000))
        with pytest.raises(RpcError) as info:
            await client.call(f"127.0.0.1:{server.port}", ECHO, big, timeout=5)
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_concurrent_rpc_limit_refuses_instead_of_queueing():
    gate, entered = asyncio.Event(), []
    config = ServerConfig(max_concurrent_rpcs=2)
    async with PeerServer(config, [echo_service(gate, entered)]) as server, RpcClient() as client:
        endpoint = f"127.0.0.1:{server.port}"
        held = [
            asyncio.create_task(
                client.call(endpoint, ECHO, pb.PingRequest(), timeout=10, attempts=1)
            )
            for _ in range(2)
        ]
        await wait_for(lambda: len(entered) == 2)
        with pytest.raises(RpcError) as info:
            await client.call(endpoint, ECHO, pb.PingRequest(), timeout=5, attempts=1)
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        gate.set()
        await asyncio.gather(*held)


async def test_connection_that_never_finishes_its_handshake_is_closed():
    config = ServerConfig(handshake_timeout_s=0.5)
    async with PeerServer(config) as server:
        started = time.monotonic()
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        try:
            data = await asyncio.wait_for(reader.read(), timeout=10)
        finally:
            writer.close()
        # The server hangs up (after a GOAWAY frame that says why, in this gRPC version).
        assert data == b"" or b"handshake timeout" in data
        assert time.monotonic() - started < 5


async def test_port_in_use_is_a_clear_error():
    async with PeerServer(ServerConfig()) as server:
        with pytest.raises(NetworkError, match=r"cannot listen on 127\.0\.0\.1"):
            async with PeerServer(ServerConfig(port=server.port)):
                pass


def test_config_is_validated():
    with pytest.raises(ValueError, match="max_concurrent_rpcs"):
        ServerConfig(max_concurrent_rpcs=0)
    with pytest.raises(ValueError, match="port"):
        ServerConfig(port=70000)
