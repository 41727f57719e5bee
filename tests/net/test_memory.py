"""What a stranger sends costs a peer nothing it keeps, and its refusals few log lines.

Real nodes and servers on loopback. Oversized fields (a 7 MiB signature, a 7 MiB
membership certificate, a 7 MiB health service name) are refused before they are read,
counted with their reason, never cached, and the refused request is freed at once rather
than left to the cyclic garbage collector (the collector is switched off while they
arrive, so anything only it could free would still be there). A flood of refused requests
from one address over a new connection each logs one line. (The same on a real
`swarmloco bootstrap` process, measured by its RSS: tests/integration/test_bootstrap_memory.py.)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from avgutil import SWARM, averaging_peers
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from netutil import wait_for
from tcpproxy import TcpProxy

from swarmloco.net import heap
from swarmloco.net.admission import Admission, Membership
from swarmloco.net.averaging import MatchmakingConfig
from swarmloco.net.averaging.group import sign_declaration
from swarmloco.net.averaging.matchmaking import JOIN, leader_rank
from swarmloco.net.client import Method, RpcClient
from swarmloco.net.deadline import Deadline
from swarmloco.net.dht import contact
from swarmloco.net.dht.contact import sign_card
from swarmloco.net.dht.transport import FIND_NODE, FIND_VALUE, PING, STORE
from swarmloco.net.dht.wire import signed_store_request
from swarmloco.net.endpoints import parse_endpoint
from swarmloco.net.identity import Identity
from swarmloco.net.node import NetNode, NodeConfig
from swarmloco.net.records import make_record, progress_key
from swarmloco.net.server import PeerServer, ServerConfig
from swarmloco.net.tls import TLS_SERVER_NAME
from swarmloco.proto.v1 import averaging_pb2 as apb
from swarmloco.proto.v1 import dht_pb2 as pb

pytestmark = pytest.mark.timeout(90)

HUGE = 7 * 1024 * 1024
LARGE = 1 << 20  # no refused message this large may outlive its call
CREATOR = Identity.generate()


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@contextlib.contextmanager
def collector_off() -> Iterator[None]:
    """No cyclic garbage collection inside: only reference counting frees objects."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def alive(message_type: type, *, larger_than: int = LARGE) -> int:
    """How many messages of ``message_type`` larger than ``larger_than`` bytes are alive."""
    return sum(
        1 for o in gc.get_objects() if type(o) is message_type and o.ByteSize() > larger_than
    )


async def released() -> None:
    """Until the process has handed back the memory of what was refused last."""
    trims = heap.RELEASER.trims
    await wait_for(lambda: heap.RELEASER.trims > trims)


def card_with(*, signature: bytes) -> pb.PeerInfo:
    card = sign_card(Identity.generate(), "127.0.0.1:9").to_proto()
    card.signature = signature
    return card


async def refused(client: RpcClient, endpoint: str, method: Method, request: Message) -> str:
    """Send ``request`` and return why it was refused (INVALID_ARGUMENT). It travels as
    bytes, and the error is not kept (``pytest.raises`` would keep it in a reference
    cycle): no message of it stays alive on this side to be mistaken for the node's."""
    data = request.SerializeToString()
    del request
    channel = await client.open(endpoint, 10)
    try:
        await channel.unary_unary(method.path)(data, timeout=20)
    except grpc.aio.AioRpcError as error:
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
        return error.details() or ""
    raise AssertionError(f"{method.name} was accepted")


async def test_oversized_fields_of_dht_calls_are_refused_counted_and_nothing_of_them_kept():
    async with (
        NetNode(identity=Identity.generate(), config=NodeConfig()) as node,
        RpcClient() as client,
    ):
        at = node.endpoint
        cached = contact._checked_card.cache_info().currsize
        with collector_off():
            for _ in range(20):
                reason = await refused(
                    client, at, PING, pb.PingRequest(sender=card_with(signature=os.urandom(HUGE)))
                )
                assert "PingRequest of 7340" in reason
            await refused(
                client,
                at,
                FIND_NODE,
                pb.FindNodeRequest(
                    sender=sign_card(Identity.generate(), "127.0.0.1:9").to_proto(),
                    target=os.urandom(HUGE),
                ),
            )
            await refused(
                client,
                at,
                FIND_VALUE,
                pb.FindValueRequest(
                    sender=sign_card(Identity.generate(), "127.0.0.1:9").to_proto(), key="k" * HUGE
                ),
            )
            # The refusal reaches the caller before the node's handler has returned (on a
            # busy machine, seen: one FindValueRequest still alive at that moment): what
            # must not happen is that any of them stays.
            for kind in (pb.PingRequest, pb.FindNodeRequest, pb.FindValueRequest):
                await wait_for(lambda kind=kind: alive(kind) == 0, timeout=30)
        assert node.dht.rejections.counts["oversize"] == 22
        # Small, but not 64 bytes: refused by its length before any verification or cache.
        for size in (0, 63, 65, 1024):
            reason = await refused(
                client, at, PING, pb.PingRequest(sender=card_with(signature=b"s" * size))
            )
            assert "a 64-byte signature" in reason and f"got 32, {size}," in reason
        assert node.dht.rejections.counts["bad-contact"] == 4
        assert contact._checked_card.cache_info().currsize == cached

        # A store request: its own signature and each record's are exactly 64 bytes.
        sender = Identity.generate()
        card = sign_card(sender, "127.0.0.1:9")
        value = {"round": 1, "tokens": 5, "tokens_per_s": 1.0, "at": time.time()}
        record = make_record(progress_key(SWARM), value, expiration=time.time() + 60, owner=sender)
        now_ms = int(time.time() * 1000)
        request = signed_store_request(sender, card, [record], timestamp_ms=now_ms)
        request.signature += b"!"
        assert "signature is 65 bytes" in await refused(client, at, STORE, request)
        long_signed = dataclasses.replace(record, signature=record.signature + b"!")
        request = signed_store_request(sender, card, [long_signed], timestamp_ms=now_ms)
        answer = await client.call(at, STORE, request, timeout=10)
        assert not answer.results[0].stored
        assert "64-byte signature" in answer.results[0].reason
        assert node.dht.rejections.counts["bad-signature"] == 2
        assert not node.dht.storage.get(progress_key(SWARM))

        # What an honest peer sends still works.
        honest = pb.PingRequest(sender=sign_card(Identity.generate(), "127.0.0.1:9").to_proto())
        answer = await client.call(at, PING, honest, timeout=10)
        assert answer.peer.public_key == node.identity.public_key
        # Cached: the two valid cards (the store's sender, this one); none of the refused.
        assert contact._checked_card.cache_info().currsize == cached + 2


def member_gate(identity: Identity) -> Admission:
    own = Membership.issue(CREATOR, SWARM, identity.peer_id_hex)
    return Admission(swarm_id=SWARM, creator_public_key=CREATOR.public_key, own=own)


async def test_joins_with_huge_certificates_are_refused_and_leave_the_leader_as_it_was():
    numel = 640
    config = MatchmakingConfig(max_group_size=2, gather_s=30.0, poll_s=0.1)
    gates: dict[int, Admission] = {}

    def gate(i: int, identity: Identity) -> Admission:
        gates[i] = member_gate(identity)
        return gates[i]

    async with averaging_peers(2, matchmaking=config, gates=gate) as peers, RpcClient() as client:
        ids = [p.peer_id for p in peers]
        round = next(
            r
            for r in range(1, 1000)
            if leader_rank(SWARM, r, ids[0]) < leader_rank(SWARM, r, ids[1])
        )
        leader = peers[0]
        deadline = Deadline.after(60)
        leading = asyncio.ensure_future(
            leader.matchmaker.form_group(
                round, weight=1.0, numel=numel, block_size=64, deadline=deadline
            )
        )
        stranger = Identity.generate()

        def join(membership: bytes) -> apb.JoinRequest:
            return apb.JoinRequest(
                member=sign_declaration(
                    stranger,
                    endpoint="127.0.0.1:9",
                    weight=1.0,
                    bandwidth=1.0,
                    swarm_id=SWARM,
                    round=round,
                    numel=numel,
                    block_size=64,
                    timestamp_ms=int(time.time() * 1000),
                    membership=membership,
                )
            )

        async def answer(request: apb.JoinRequest) -> apb.Refusal:
            response = await client.call(leader.node.endpoint, JOIN, request, timeout=10)
            assert response.WhichOneof("outcome") == "refused", response
            return response.refused

        # The stranger waits until the leader gathers the round (it has no certificate).
        while (await answer(join(b""))).code == "not-leading":
            assert not deadline.expired
            await asyncio.sleep(0.05)
        cached = gates[0].cached_bytes
        start = rss_mb()
        with collector_off():
            for _ in range(20):
                refusal = await answer(join(os.urandom(HUGE)))
                assert refusal.code == "bad-declaration", refusal
                assert "is 7340" in refusal.reason
            for kind in (apb.JoinRequest, apb.MemberDeclaration):  # (see the DHT's test)
                await wait_for(lambda kind=kind: alive(kind) == 0, timeout=30)
        await released()
        # Nothing of them was cached (the certificate cache is keyed by certificates).
        assert gates[0].cached_bytes == cached
        assert leader.matchmaker.rejections.counts["bad-declaration"] == 20
        grown = rss_mb() - start
        # 140 MiB passed through this process, both ways (the stranger is here too):
        # what stays is what gRPC and the allocator keep of any large message.
        assert grown < 50, grown

        # A member with its certificate is still taken: the round's group forms.
        joined = await peers[1].matchmaker.form_group(
            round, weight=1.0, numel=numel, block_size=64, deadline=deadline
        )
        led = await leading
        assert led.group_id == joined.group_id and {m.peer_id for m in led.members} == set(ids)


async def test_health_refuses_service_names_longer_than_any_real_one():
    async with PeerServer(ServerConfig()) as server, RpcClient() as client:
        channel = await client.open(f"127.0.0.1:{server.port}", 10)
        stub = health_pb2_grpc.HealthStub(channel)
        with collector_off():
            for method in (stub.Check, stub.Watch):
                call = method(health_pb2.HealthCheckRequest(service="x" * HUGE), timeout=10)
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await (call if method is stub.Check else call.read())
                assert await call.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "at most 200 characters" in (await call.details())
                del call
            await wait_for(lambda: alive(health_pb2.HealthCheckRequest) == 0, timeout=30)
        assert server.rejections.counts["malformed"] == 2
        # Real names still work.
        watch = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()
        assert (await stub.Check(health_pb2.HealthCheckRequest())).status == 1


async def test_a_flood_from_one_address_over_a_connection_a_call_logs_one_line(caplog):
    caplog.set_level(logging.WARNING, logger="swarmloco.net.dht.node")
    async with NetNode(identity=Identity.generate(), config=NodeConfig()) as node:
        host, port = parse_endpoint(node.endpoint)
        async with (
            TcpProxy(source="127.0.0.5") as five,
            TcpProxy(source="127.0.0.6") as six,
            RpcClient() as client,
        ):
            for proxy in (five, six):
                proxy.target = lambda: (host, port)
                await client.open(f"127.0.0.1:{proxy.port}", 10)  # pin the node's certificate
            for proxy in (five, six):
                address = f"127.0.0.1:{proxy.port}"
                credentials = grpc.ssl_channel_credentials(client.certs.pinned(address))
                options = [
                    ("grpc.ssl_target_name_override", TLS_SERVER_NAME),
                    ("grpc.use_local_subchannel_pool", 1),  # a connection of its own
                ]
                for _ in range(30):
                    async with grpc.aio.secure_channel(address, credentials, options) as channel:
                        garbage = channel.unary_unary("/swarmloco.v1.Dht/Ping")
                        with pytest.raises(grpc.aio.AioRpcError) as caught:
                            await garbage(b"\xff\xff\xff", timeout=10)
                        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # Every call counted; one line per source address (each call came over a new
        # connection, from a new port: keyed by address and port, that was 60 lines).
        assert node.dht.rejections.counts["malformed"] == 60
        lines = [r.getMessage() for r in caplog.records if "rejected input" in r.getMessage()]
        assert len(lines) == 2, lines
        assert sum("127.0.0.5" in line for line in lines) == 1
        assert sum("127.0.0.6" in line for line in lines) == 1
