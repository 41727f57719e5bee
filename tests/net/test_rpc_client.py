"""The client: a deadline on every call, bounded retries, errors that say what failed."""

import asyncio
import time

import grpc
import pytest
from netutil import closed_port

from swarmloco.net.client import ClientConfig, RpcClient, RpcError
from swarmloco.net.deadline import Deadline
from swarmloco.net.dht.transport import PING
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


def test_client_config_is_validated():
    with pytest.raises(ValueError, match="attempts"):
        ClientConfig(attempts=0)
    with pytest.raises(ValueError, match="max_backoff_s"):
        ClientConfig(backoff_s=2.0, max_backoff_s=1.0)
