"""The client: a deadline on every call, bounded retries, errors that say what failed."""

import asyncio
import time
from contextlib import AsyncExitStack

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from netutil import closed_port, wait_for

from swarmloco.errors import NetworkError
from swarmloco.net.client import ClientConfig, Method, RpcClient, RpcError
from swarmloco.net.deadline import Deadline
from swarmloco.net.dht.contact import sign_card
from swarmloco.net.dht.transport import PING
from swarmloco.net.identity import Identity
from swarmloco.net.node import NetNode, NodeConfig
from swarmloco.net.server import ServerConfig, Service
from swarmloco.proto.v1 import dht_pb2 as pb


async def test_unreachable_peer_fails_fast_after_bounded_retries():
    endpoint = f"127.0.0.1:{closed_port()}"
    async with RpcClient(ClientConfig(attempts=3)) as client:
        started = time.monotonic()
        with pytest.raises(RpcError) as info:
            await client.call(endpoint, PING, pb.PingRequest(), timeout=10)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert info.value.endpoint == endpoint
    message = str(info.value)
    assert f"Ping to {endpoint} failed: UNAVAILABLE" in message
    assert "attempt 3 of 3" in message
    assert time.monotonic() - started < 5


async def test_silent_peer_is_cut_off_by_the_deadline():
    finished = asyncio.Event()

    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # accept the connection, never answer, until the client leaves
        writer.close()
        finished.set()

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        async with RpcClient() as client:
            started = time.monotonic()
            with pytest.raises(RpcError) as info:
                await client.call(f"127.0.0.1:{port}", PING, pb.PingRequest(), timeout=0.5)
            elapsed = time.monotonic() - started
        await asyncio.wait_for(finished.wait(), timeout=5)
    # gRPC gives up on a peer that never sends its HTTP/2 settings even before our deadline.
    assert info.value.code in {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE}
    assert elapsed < 2


async def test_a_spent_deadline_makes_no_call():
    async with RpcClient() as client:
        with pytest.raises(RpcError, match="no time left"):
            await client.call("127.0.0.1:1", PING, pb.PingRequest(), timeout=Deadline.after(-1))


async def test_channels_beyond_the_cache_size_are_closed():
    async with RpcClient(ClientConfig(max_channels=2, tls=False)) as client:
        channels = [client.channel(f"127.0.0.1:{port}") for port in (1001, 1002, 1003)]
        assert client.channel("127.0.0.1:1003") is channels[2]
        assert client.channel("127.0.0.1:1001") is not channels[0]  # evicted, reopened


async def test_a_channel_in_use_is_not_evicted_and_the_cache_shrinks_once_it_is_idle():
    async with RpcClient(ClientConfig(max_channels=2, tls=False)) as client:
        first, second = (client.channel(f"127.0.0.1:{port}") for port in (1001, 1002))
        with client.holding(first), client.holding(second):
            for port in (1003, 1004, 1005):
                client.channel(f"127.0.0.1:{port}")
            # Both busy ones stay, beside the newest: max_channels plus the busy ones.
            assert list(client._channels) == ["127.0.0.1:1001", "127.0.0.1:1002", "127.0.0.1:1005"]
        assert len(client._channels) == 2  # trimmed as they went idle
        assert "127.0.0.1:1005" in client._channels


async def test_a_forgotten_channel_in_use_closes_only_when_its_call_ends():
    async with RpcClient(ClientConfig(tls=False)) as client:
        channel = client.channel("127.0.0.1:1001")
        with client.holding(channel):
            await client.forget("127.0.0.1:1001")
            assert client.channel("127.0.0.1:1001") is not channel  # a new one for new calls
            await asyncio.sleep(0)
            assert channel.get_state() != grpc.ChannelConnectivity.SHUTDOWN
        await asyncio.gather(*client._closing)
        assert channel.get_state() == grpc.ChannelConnectivity.SHUTDOWN


async def test_a_closed_client_makes_no_call():
    """A task that outlived its peer gets an error, not a channel nobody would close (a
    call left pending on one when the loop closed has crashed grpc)."""
    async with RpcClient(ClientConfig(tls=False)) as client:
        client.channel("127.0.0.1:1001")
    with pytest.raises(NetworkError, match="the client is closed"):
        await client.call("127.0.0.1:1001", PING, pb.PingRequest(), timeout=5)
    assert not client._channels and not client._closing


HOLD = Method("/test.Slow/Hold", pb.PingRequest, pb.PingResponse)
"""A unary call the honest peer answers only when the test says so."""


def slow_service(started: asyncio.Event, release: asyncio.Event) -> Service:
    async def hold(request: pb.PingRequest, context: object) -> pb.PingResponse:
        started.set()
        await release.wait()
        return pb.PingResponse()

    handler = grpc.unary_unary_rpc_method_handler(
        hold,
        request_deserializer=pb.PingRequest.FromString,
        response_serializer=pb.PingResponse.SerializeToString,
    )
    generic = grpc.method_handlers_generic_handler("test.Slow", {"Hold": handler})
    return Service("test.Slow", lambda server: server.add_generic_rpc_handlers((generic,)))


async def flood_with_cards(stack: AsyncExitStack, victim: NetNode, count: int) -> list[NetNode]:
    """A stranger Pings ``victim`` with cards of fresh keys, each naming another endpoint
    that completes TLS (``count`` nodes on 127.0.0.2): verifying each card dials it.
    Returns once every named node heard the victim's verifying Ping."""
    named = [
        await stack.enter_async_context(
            NetNode(
                identity=Identity.generate(),
                config=NodeConfig(server=ServerConfig(host="127.0.0.2")),
            )
        )
        for _ in range(count)
    ]
    stranger = await stack.enter_async_context(RpcClient(ClientConfig()))
    for node in named:
        card = sign_card(Identity.generate(), node.endpoint)
        request = pb.PingRequest(sender=card.to_proto())
        await stranger.call(victim.endpoint, PING, request, timeout=5, confirms_itself=True)
    await wait_for(lambda: all(victim.identity.peer_id in node.dht.routing for node in named))
    return named


MAX_CHANNELS = 4


async def honest_and_victim(stack: AsyncExitStack, *services: Service) -> tuple[NetNode, NetNode]:
    honest = await stack.enter_async_context(
        NetNode(identity=Identity.generate(), config=NodeConfig(), services=services)
    )
    victim = await stack.enter_async_context(
        NetNode(
            identity=Identity.generate(),
            config=NodeConfig(
                peers=(honest.endpoint,), client=ClientConfig(max_channels=MAX_CHANNELS)
            ),
        )
    )
    return honest, victim


async def test_a_flood_of_second_hand_cards_leaves_a_call_in_flight_to_an_honest_peer():
    # Closing a channel cancels every call on it: the cache evicts idle channels only.
    started, release = asyncio.Event(), asyncio.Event()
    async with AsyncExitStack() as stack:
        honest, victim = await honest_and_victim(stack, slow_service(started, release))
        call = asyncio.create_task(
            victim.client.call(honest.endpoint, HOLD, pb.PingRequest(), timeout=30)
        )
        stack.callback(call.cancel)
        await asyncio.wait_for(started.wait(), 10)
        named = await flood_with_cards(stack, victim, 2 * MAX_CHANNELS)
        cached = victim.client._channels
        assert sum(node.endpoint in cached for node in named) < len(named)  # it evicted
        await wait_for(lambda: len(cached) <= MAX_CHANNELS)  # the verifying Pings ended
        assert honest.endpoint in cached
        assert not call.done()
        release.set()
        assert await asyncio.wait_for(call, 10) == pb.PingResponse()


async def test_a_flood_of_second_hand_cards_leaves_a_stream_to_an_honest_peer_open():
    # A stream (an Aggregate stream, a state download) opens its channel once and runs
    # long, inside RpcClient.holding: the flood must not end it.
    async with AsyncExitStack() as stack:
        honest, victim = await honest_and_victim(stack)
        channel = await victim.client.open(honest.endpoint, 5)
        stack.enter_context(victim.client.holding(channel))
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
        stack.callback(watch.cancel)
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        named = await flood_with_cards(stack, victim, 2 * MAX_CHANNELS)
        cached = victim.client._channels
        assert sum(node.endpoint in cached for node in named) < len(named)  # it evicted
        await wait_for(lambda: len(cached) <= MAX_CHANNELS)
        assert cached.get(honest.endpoint) is channel
        assert not watch.done()
        await honest.server._health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        news = await asyncio.wait_for(watch.read(), 5)
        assert news.status == health_pb2.HealthCheckResponse.NOT_SERVING


def test_client_config_is_validated():
    with pytest.raises(ValueError, match="attempts"):
        ClientConfig(attempts=0)
    with pytest.raises(ValueError, match="max_backoff_s"):
        ClientConfig(backoff_s=2.0, max_backoff_s=1.0)
