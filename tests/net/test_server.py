"""The hardened gRPC server: health, reflection, extra services, limits, malformed input."""

import asyncio
import logging
import random
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from netutil import loopback_network, wait_for

from swarmloco.errors import NetworkError
from swarmloco.net.client import Method, RpcClient, RpcError
from swarmloco.net.endpoints import host_of_grpc_peer, source_network, subnet_of
from swarmloco.net.identity import Identity
from swarmloco.net.node import NetNode, NodeConfig
from swarmloco.net.rejections import Rejection, RejectionLog
from swarmloco.net.server import (
    CallSlots,
    PeerServer,
    Pool,
    ServerConfig,
    Service,
    unary_service,
)
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
        # The stream opened, nothing written: the server's answer is the status alone (a
        # request written after it refused would fail as the client's own INTERNAL error).
        call = stub.ServerReflectionInfo(timeout=5)
        assert await call.code() == grpc.StatusCode.UNIMPLEMENTED


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
    with pytest.raises(ValueError, match="max_long_calls_per_network"):
        ServerConfig(max_long_calls_per_network=0)
    with pytest.raises(ValueError, match="reserved_rpcs"):
        ServerConfig(reserved_rpcs=-1)
    with pytest.raises(ValueError, match="port"):
        ServerConfig(port=70000)


# -- call slots (pure: no server) --------------------------------------------------------------


def test_callers_are_counted_per_source_network():
    # Public addresses (documentation ranges count as private to Python's ipaddress).
    assert source_network("1.2.3.7") == source_network("1.2.3.200") == "1.2.3.0/24"
    assert source_network("2a01:4f8:1:2::1") == source_network("2a01:4f8:1:2:ffff::9")
    assert source_network("2a01:4f8:1:2::1") == "2a01:4f8:1:2::/64"
    # An IPv4 caller seen through a dual-stack socket is that IPv4 address.
    assert source_network("::ffff:1.2.3.9") == "1.2.3.0/24"
    # Loopback and private addresses count one by one (tests use 127.0.0.N as networks).
    assert source_network("127.0.0.2") != source_network("127.0.0.3")
    assert source_network("10.1.2.3") == "10.1.2.3"
    assert source_network("::1") == "::1"
    # gRPC percent-encodes an IPv6 peer's brackets.
    assert host_of_grpc_peer("ipv6:%5B::1%5D:48660") == "::1"
    assert host_of_grpc_peer("ipv6:[2a01:4f8::1]:5") == "2a01:4f8::1"
    assert host_of_grpc_peer("ipv4:127.0.0.1:5") == "127.0.0.1"
    assert subnet_of("::1", limit_private=False) is None  # decoded, so exempt as loopback


def test_a_network_gets_its_share_of_calls_at_large_and_no_more():
    slots = CallSlots(ServerConfig(max_concurrent_rpcs=5, max_rpcs_per_network=2))
    held = [slots.take("1.2.3.1", long=False), slots.take("1.2.3.2", long=False)]
    with pytest.raises(Rejection) as refused:
        slots.take("1.2.3.3", long=False)  # same /24, another address
    assert refused.value.code == "too-many-calls" and "1.2.3.0/24" in refused.value.reason
    held += [slots.take("5.6.7.1", long=False), slots.take("5.6.7.1", long=False)]
    held.append(slots.take("9.9.9.1", long=False))
    with pytest.raises(Rejection) as refused:
        slots.take("9.9.9.1", long=False)
    assert refused.value.code == "server-busy"
    for slot in held:
        slots.give(slot)
    assert slots.in_flight == 0 and slots.held(Pool.AT_LARGE) == {}
    slots.take("1.2.3.3", long=False)


def test_long_calls_have_a_budget_of_their_own():
    config = ServerConfig(
        max_concurrent_rpcs=2,
        max_rpcs_per_network=2,
        max_long_calls=3,
        max_long_calls_per_network=2,
    )
    slots = CallSlots(config)
    for _ in range(2):
        assert slots.take("1.2.3.1", long=True).pool is Pool.LONG
    with pytest.raises(Rejection) as refused:
        slots.take("1.2.3.1", long=True)
    assert refused.value.code == "too-many-long-calls"
    assert "from 1.2.3.0/24 are open already" in refused.value.reason
    slots.take("5.6.7.1", long=True)
    with pytest.raises(Rejection) as refused:
        slots.take("9.9.9.1", long=True)
    assert "this peer holds 3 long-lived calls" in refused.value.reason
    # Calls at large are untouched by them.
    assert slots.take("1.2.3.1", long=False).pool is Pool.AT_LARGE
    assert slots.take("1.2.3.1", long=False).pool is Pool.AT_LARGE
    assert slots.in_use(Pool.LONG) == 3 and slots.in_use(Pool.AT_LARGE) == 2


def test_sessions_have_a_budget_of_their_own():
    config = ServerConfig(
        max_concurrent_rpcs=1, max_rpcs_per_network=1, max_sessions=3, max_sessions_per_network=2
    )
    slots = CallSlots(config)
    for _ in range(2):
        assert slots.take("1.2.3.1", long=False, session=True).pool is Pool.SESSION
    with pytest.raises(Rejection) as refused:
        slots.take("1.2.3.9", long=False, session=True)  # same /24
    assert refused.value.code == "too-many-sessions"
    assert "from 1.2.3.0/24 are open already" in refused.value.reason
    last = slots.take("5.6.7.1", long=False, session=True)
    with pytest.raises(Rejection, match="this peer holds 3 sessions"):
        slots.take("9.9.9.1", long=False, session=True)
    # Neither calls at large nor long calls give up a slot to them, nor take theirs.
    assert slots.take("1.2.3.1", long=False).pool is Pool.AT_LARGE
    assert slots.take("1.2.3.1", long=True).pool is Pool.LONG
    slots.give(last)
    assert slots.take("9.9.9.1", long=False, session=True).pool is Pool.SESSION
    assert slots.in_use(Pool.SESSION) == 3 and slots.held(Pool.SESSION)["1.2.3.0/24"] == 2


def test_a_reserve_holds_slots_for_the_members_until_it_expires():
    now = [100.0]
    config = ServerConfig(max_concurrent_rpcs=1, max_rpcs_per_network=1, reserved_rpcs=2)
    slots = CallSlots(config, clock=lambda: now[0])
    slots.take("1.2.3.1", long=False)  # a stranger holds every slot at large
    with pytest.raises(Rejection):
        slots.take("5.6.7.7", long=False)
    slots.reserve(["5.6.7.7", "::ffff:9.9.9.5", "[2a01:4f8::1]"], until=110.0)
    assert slots.take("5.6.7.7", long=False).pool is Pool.RESERVED
    assert slots.take("9.9.9.5", long=False).pool is Pool.RESERVED  # as the same host
    with pytest.raises(Rejection) as refused:
        slots.take("2a01:4f8::1", long=False)  # the reserve (2) is spent
    assert refused.value.code == "server-busy"
    with pytest.raises(Rejection):
        slots.take("5.6.7.8", long=False)  # its neighbour is no member
    # A long call of a member is still a long call.
    assert slots.take("5.6.7.7", long=True).pool is Pool.LONG
    # An earlier expiry never shortens a reservation; once it passes, the host is a stranger.
    slots.reserve(["5.6.7.7"], until=105.0)
    now[0] = 109.0
    assert slots.reserved("5.6.7.7")
    now[0] = 110.0
    assert not slots.reserved("5.6.7.7") and not slots.reserved("2a01:4f8::1")
    slots.reserve([], until=120.0)  # drops what expired
    assert slots._reserved == {}


def test_the_reserve_remembers_a_bounded_number_of_hosts():
    slots = CallSlots(ServerConfig(), clock=lambda: 0.0, max_reserved_hosts=3)
    slots.reserve([f"10.0.0.{i}" for i in range(5)], until=10.0)
    slots.reserve(["10.0.1.1"], until=20.0)
    assert len(slots._reserved) == 3 and slots.reserved("10.0.1.1")


def test_a_call_cancelled_as_a_peer_leaves_is_not_logged_as_an_error(caplog):
    grpc_log = logging.getLogger("grpc._cython.cygrpc")
    try:
        raise asyncio.CancelledError
    except asyncio.CancelledError:
        cancelled = sys.exc_info()
    try:
        raise ValueError("a handler bug")
    except ValueError:
        failed = sys.exc_info()
    with caplog.at_level(logging.ERROR, logger="grpc._cython.cygrpc"):
        message = "Exception not handled by _handle_exceptions in servicer method [/x/Store]"
        grpc_log.error(message, exc_info=cancelled)
        grpc_log.error(message, exc_info=failed)  # a real error still is
    assert [r.exc_info[0] for r in caplog.records if r.exc_info] == [ValueError]
