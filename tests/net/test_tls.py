"""TLS on the one port: real servers on loopback, real handshakes, a real man in the middle.

The man in the middle is a server with its own key that answers DHT calls with another
peer's logic, so it hands out that peer's signed card: what an attacker on the path
between two peers would relay. The stranger of issue 30 (attack 3) mints keys and sends
Pings whose cards claim an address with made-up TLS keys, before the peer that will serve
there starts.
"""

from __future__ import annotations

import datetime
import functools
import logging
import os
import time
from contextlib import AsyncExitStack

import grpc
import pytest
from avgutil import AvgPeer, assert_identical, averaging_peers, random_vectors, run_round
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from netutil import closed_port, loopback_network
from tcpproxy import TcpProxy

from swarmloco.errors import NetworkError
from swarmloco.net.averaging import AllReduceResult
from swarmloco.net.client import ClientConfig, Method, RpcClient, RpcError, TlsRefused
from swarmloco.net.deadline import Deadline
from swarmloco.net.dht.contact import sign_card
from swarmloco.net.dht.transport import PING, DhtServicer, GrpcDhtTransport
from swarmloco.net.endpoints import parse_endpoint
from swarmloco.net.identity import Identity
from swarmloco.net.node import NetNode, NodeConfig
from swarmloco.net.rejections import RejectionLog
from swarmloco.net.server import PeerServer, ServerConfig, unary_service
from swarmloco.net.tls import CertBook, TlsCredentials, TlsError, fetch_certificate
from swarmloco.proto.v1 import dht_pb2 as pb

HEALTH = Method(
    "/grpc.health.v1.Health/Check", health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse
)
CHECK = health_pb2.HealthCheckRequest()


async def claim(client: RpcClient, target: str, address: str) -> pb.PingResponse:
    """One Ping to ``target`` from a fresh key whose signed card claims ``address`` with a
    made-up TLS key: free to send, and a valid card."""
    card = sign_card(Identity.generate(), address, tls_fingerprint=os.urandom(32))
    return await client.call(target, PING, pb.PingRequest(sender=card.to_proto()), timeout=5)


def port_of(endpoint: str) -> int:
    return parse_endpoint(endpoint)[1]


def test_a_peer_keeps_its_tls_key_and_certificate_across_restarts():
    identity = Identity.generate()
    first, again = TlsCredentials.for_identity(identity), TlsCredentials.for_identity(identity)
    assert first.cert_pem == again.cert_pem and first.fingerprint == again.fingerprint
    assert TlsCredentials.for_identity(Identity.generate()).fingerprint != first.fingerprint


async def test_peers_talk_tls_and_a_plaintext_caller_gets_nothing():
    async with loopback_network(3) as nodes:
        a, b, c = nodes
        # Every card names its TLS key; c dialled a to join, and a's answer confirmed the
        # certificate it pinned, and a's claim on its address.
        assert all(len(n.dht.card.tls_fingerprint) == 32 for n in nodes)
        assert c.client.certs.trusted(a.endpoint)
        assert c.client.certs.confirmed(a.endpoint) == {a.dht.card.tls_fingerprint}
        await c.dht.store(
            "swarmloco/v1/" + "ab" * 20 + "/test-counter", {"count": 1, "label": "x"}, ttl=60
        )
        assert (await b.dht.get("swarmloco/v1/" + "ab" * 20 + "/test-counter")).entries
        async with grpc.aio.insecure_channel(a.endpoint) as plain:
            stub = health_pb2_grpc.HealthStub(plain)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Check(health_pb2.HealthCheckRequest(), timeout=3)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_a_man_in_the_middle_relaying_a_peers_card_is_refused_at_join():
    async with loopback_network(1) as (victim,):
        # Another key, the victim's answers (and so the victim's signed card).
        relay = DhtServicer(victim.dht, victim.dht.rejections).service()
        async with PeerServer(ServerConfig(), [relay]) as mitm:
            address = f"127.0.0.1:{mitm.port}"
            newcomer = NetNode(
                identity=Identity.generate(),
                config=NodeConfig(peers=(address,), dht=victim.config.dht),
            )
            with pytest.raises(NetworkError) as info:
                async with newcomer:
                    pass
    message = str(info.value)
    assert "man in the middle" in message and address in message
    assert newcomer.client.certs.rejections.counts["tls-relayed-card"] >= 1
    assert newcomer.client.certs.pinned(address) is None


async def test_a_server_at_an_address_where_another_key_answered_is_refused():
    async with loopback_network(2) as (a, b):
        gone = NetNode(identity=Identity.generate(), config=NodeConfig(peers=(a.endpoint,)))
        async with gone:
            address = gone.endpoint
            await a.client.call(address, HEALTH, CHECK, timeout=10)
            assert a.client.certs.confirmed(address) == {gone.dht.card.tls_fingerprint}
        # An attacker takes over the address (its own key, relaying b's answers) before
        # anything told a that the peer there is gone.
        relay = DhtServicer(b.dht, b.dht.rejections).service()
        async with PeerServer(ServerConfig(port=port_of(address)), [relay]):
            started = time.monotonic()
            with pytest.raises(RpcError) as info:
                await a.client.call(address, HEALTH, CHECK, timeout=10)
            assert time.monotonic() - started < 5  # refused, not retried until the deadline
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert "a man in the middle, or a stale address" in str(info.value)
        assert a.client.certs.rejections.counts == {"tls-other-key": 1}
        # b itself is still trusted.
        answer = await a.client.call(
            b.endpoint, PING, pb.PingRequest(sender=a.dht.card.to_proto()), timeout=10
        )
        assert answer.peer.tls_fingerprint == b.dht.card.tls_fingerprint


async def test_a_certificate_taken_on_first_use_is_confirmed_before_another_call_uses_it():
    reached: list[object] = []

    async def echo(request, context):
        reached.append(request)
        return request

    echo_service = unary_service(
        "swarmloco.v1.Echo",
        {"Echo": (health_pb2.HealthCheckRequest, echo)},
        rejections=RejectionLog(logging.getLogger("test.echo")),
    )
    method = Method(
        "/swarmloco.v1.Echo/Echo", health_pb2.HealthCheckRequest, health_pb2.HealthCheckRequest
    )
    async with loopback_network(2) as (a, victim):
        # A relay with its own key in front of the victim's answers, at an address no one
        # has dialled: its certificate is taken on first use, and must be confirmed.
        relay = DhtServicer(victim.dht, victim.dht.rejections).service()
        async with PeerServer(ServerConfig(), [relay, echo_service]) as mitm:
            address = f"127.0.0.1:{mitm.port}"
            with pytest.raises(RpcError) as info:
                await a.client.call(address, method, CHECK, timeout=10)
            assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
            assert "relaying another peer" in str(info.value)
            assert reached == []  # the call itself never went out
            assert a.client.certs.rejections.counts == {"tls-relayed-card": 1}
            # A client with no card to confirm with uses what it was given: the same call
            # reaches the relay.
            async with RpcClient() as bare:
                await bare.call(address, method, CHECK, timeout=10)
            assert len(reached) == 1
        # A real peer's own card confirms its certificate, and the call goes through.
        answer = await a.client.call(victim.endpoint, HEALTH, CHECK, timeout=10)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
        assert a.client.certs.trusted(victim.endpoint)
        assert a.client.certs.confirmed(victim.endpoint) == {victim.dht.card.tls_fingerprint}


async def test_pings_claiming_an_address_before_its_peer_starts_do_not_lock_it_out():
    """Issue 30, attack 3: 24 Pings per honest peer, each with a fresh key's card claiming
    the address a peer will start at, with a random TLS key. The first 16 come from
    127.0.0.2: their cards never enter a routing table (their host is not the caller's),
    so no failed contact ever withdraws them; the last 8 come from 127.0.0.1 and do. Once
    that peer starts, all four peers average together in one group."""
    answered: list[str] = []
    async with AsyncExitStack() as stack:
        door = await stack.enter_async_context(TcpProxy())
        door.target = lambda: ("127.0.0.1", closed_port())  # nothing serves there yet
        address = f"127.0.0.1:{door.port}"
        sources = [await stack.enter_async_context(TcpProxy(source="127.0.0.2")) for _ in "abc"]

        async def attack(honest: list[AvgPeer]) -> None:
            async with RpcClient() as client:
                for peer, other_network in zip(honest, sources, strict=True):
                    other_network.target = functools.partial(parse_endpoint, peer.node.endpoint)
                    for i in range(24):
                        via = f"127.0.0.1:{other_network.port}" if i < 16 else peer.node.endpoint
                        answered.append((await claim(client, via, address)).observed_host)

        vectors = random_vectors(4, 1000, seed=30)
        async with averaging_peers(4, proxies={3: door}, before={3: attack}) as peers:
            results = await run_round(peers, 1, vectors, [1.0] * 4)
            victim = peers[3].node
            # The attack reached every honest peer, from both networks.
            assert sorted(answered) == ["127.0.0.1"] * 24 + ["127.0.0.2"] * 48
            assert victim.endpoint == address
            assert all(isinstance(r, AllReduceResult) for r in results), results
            averaged = [r for r in results if isinstance(r, AllReduceResult)]
            assert [len(r.report.members) for r in averaged] == [4] * 4
            assert all(not r.report.excluded for r in averaged)
            assert_identical(averaged)
            for peer in peers[:3]:
                certs = peer.node.client.certs
                assert certs.rejections.total == 0, certs.rejections.counts
                assert certs.trusted(address)
                assert certs.confirmed(address) == {victim.dht.card.tls_fingerprint}
                # What it holds: only what the addresses it dialled said of themselves.
                assert certs.claims() <= 3


async def test_a_confirmed_claim_survives_a_flood_and_ends_when_its_peer_fails():
    async with loopback_network(1) as (a,), RpcClient() as stranger:
        first = NetNode(identity=Identity.generate(), config=NodeConfig(peers=(a.endpoint,)))
        async with first:
            address = first.endpoint
            await a.client.call(address, HEALTH, CHECK, timeout=10)
            for _ in range(64):  # eight times the claims an address used to hold
                await claim(stranger, a.endpoint, address)
            assert len(a.dht.routing) > 8  # the flood's cards were taken as contacts there
            assert a.client.certs.confirmed(address) == {first.dht.card.tls_fingerprint}
            assert a.client.certs.claims() == 1
            await a.client.call(address, HEALTH, CHECK, timeout=10)
        # Another honest peer, with another key, now serves at that address.
        second = NetNode(
            identity=Identity.generate(),
            config=NodeConfig(server=ServerConfig(port=port_of(address)), peers=(a.endpoint,)),
        )
        async with second:
            assert second.endpoint == address
            with pytest.raises(TlsRefused):
                await a.client.call(address, HEALTH, CHECK, timeout=10)
            # a's DHT finds the first peer's contact failing, and its claim ends with it.
            assert first.identity.peer_id in a.dht.routing
            await a.dht.check_liveness(older_than=0)
            assert first.identity.peer_id not in a.dht.routing
            answer = await a.client.call(address, HEALTH, CHECK, timeout=10)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
            assert a.client.certs.confirmed(address) == {second.dht.card.tls_fingerprint}


async def test_a_confirmed_claim_expires():
    with pytest.raises(ValueError, match="tls_claim_ttl_s"):
        ClientConfig(tls_claim_ttl_s=0)
    now = [0.0]
    async with RpcClient(ClientConfig(tls_claim_ttl_s=60.0), clock=lambda: now[0]) as client:
        # One attempt: finding the pinned certificate gone (and judging the new one) is
        # no attempt, however many the call has.
        transport = GrpcDhtTransport(client, attempts=1)
        me = pb.PingRequest(sender=sign_card(Identity.generate(), "").to_proto())
        first = NetNode(identity=Identity.generate(), config=NodeConfig())
        async with first:
            address = first.endpoint
            await transport.ping(address, me, Deadline.after(10))
        assert client.certs.confirmed(address) == {first.dht.card.tls_fingerprint}
        await client.forget(address)  # the pin stays; the old connection's errors go
        second = NetNode(
            identity=Identity.generate(),
            config=NodeConfig(server=ServerConfig(port=port_of(address))),
        )
        async with second:
            with pytest.raises(TlsRefused):
                await transport.ping(address, me, Deadline.after(10))
            now[0] += 59.0
            with pytest.raises(TlsRefused):
                await transport.ping(address, me, Deadline.after(10))
            now[0] += 2.0  # the address last answered with the first key 61 s ago
            answer = await transport.ping(address, me, Deadline.after(10))
            assert answer.peer.public_key == second.identity.public_key
            assert client.certs.confirmed(address) == {second.dht.card.tls_fingerprint}
        assert client.certs.rejections.counts == {"tls-other-key": 2}


async def test_only_a_peers_own_newer_card_ends_its_confirmed_claim():
    credentials, owner = TlsCredentials.generate(), Identity.generate()
    fingerprint = credentials.fingerprint
    async with PeerServer(ServerConfig(), credentials=credentials) as server:
        address = f"127.0.0.1:{server.port}"
        book = CertBook()
        await book.certificate(address, timeout=5)
        assert not book.trusted(address) and book.confirmed(address) == set()
        book.confirm(
            address,
            peer_id=owner.peer_id,
            card_endpoint=address,
            started_at_ms=1000,
            fingerprint=fingerprint,
        )
        assert book.trusted(address) and book.confirmed(address) == {fingerprint}
        # Strangers' cards for this address and 10,000 others, and the owner's own older
        # card with another key (a replay): nothing is kept, nothing changes.
        for i in range(10_000):
            where = address if i % 2 else f"10.0.{i // 256 % 256}.{i % 256}:{1024 + i}"
            book.heard(where, os.urandom(32), 2000, os.urandom(32))
        book.heard(address, owner.peer_id, 999, os.urandom(32))
        assert book.confirmed(address) == {fingerprint} and book.claims() == 1
        # The owner's newer card: it restarted at the same address with the same key...
        book.heard(address, owner.peer_id, 2000, fingerprint)
        assert book.confirmed(address) == {fingerprint}
        # ... and then with another: its claim ends and its old certificate is fetched anew.
        book.heard(address, owner.peer_id, 3000, os.urandom(32))
        assert book.confirmed(address) == set() and book.pinned(address) is None
        assert book.refused == 0


async def test_a_peer_restarted_with_another_key_at_the_same_address_is_checked_again():
    first, second = TlsCredentials.generate(), TlsCredentials.generate()
    request = health_pb2.HealthCheckRequest()
    async with RpcClient() as client:
        async with PeerServer(ServerConfig(), credentials=first) as server:
            address = f"127.0.0.1:{server.port}"
            await client.call(address, HEALTH, request, timeout=5)
        assert client.certs.pinned(address) == first.cert_pem
        async with PeerServer(ServerConfig(port=server.port), credentials=second):
            # The pinned certificate fails the handshake; the call drops the pin and its
            # next attempt checks the new one (no card names the address: first contact).
            answer = await client.call(address, HEALTH, request, timeout=10)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
        assert client.certs.pinned(address) == second.cert_pem


async def test_fetching_a_certificate_from_a_dead_address_fails_clearly():
    async with PeerServer(ServerConfig()) as server:
        port = server.port
    with pytest.raises(NetworkError, match="refused the connection"):
        await fetch_certificate(f"127.0.0.1:{port}", timeout=2)
    book = CertBook()
    with pytest.raises(NetworkError):
        await book.certificate(f"127.0.0.1:{port}", timeout=2)


def test_a_node_must_speak_tls_both_ways_or_not_at_all():
    with pytest.raises(ValueError, match="TLS both ways"):
        NodeConfig(server=ServerConfig(tls=False), client=ClientConfig(tls=True))


def _issue(tmp_path, name: str, ca_key, ca_name) -> tuple[str, str]:
    """A certificate for ``name`` signed by the CA, and its key, as PEM files."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    certificate = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC))
        .not_valid_after(datetime.datetime(2100, 1, 1, tzinfo=datetime.UTC))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    cert_file, key_file = tmp_path / f"{name}.crt", tmp_path / f"{name}.key"
    cert_file.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return str(cert_file), str(key_file)


async def test_operators_own_certificates_and_ca_work_and_a_self_signed_peer_is_refused(
    tmp_path,
):
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "swarm operators' CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC))
        .not_valid_after(datetime.datetime(2100, 1, 1, tzinfo=datetime.UTC))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    ca_file = tmp_path / "ca.crt"
    ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))

    def config(name: str, *peers: str) -> NodeConfig:
        cert, key = _issue(tmp_path, name, ca_key, ca_name)
        return NodeConfig(
            server=ServerConfig(tls_cert_file=cert, tls_key_file=key),
            client=ClientConfig(tls_ca_file=str(ca_file)),
            peers=peers,
        )

    key = "swarmloco/v1/" + "ab" * 20 + "/test-counter"
    async with NetNode(identity=Identity.generate(), config=config("a.example")) as a:
        b = NetNode(identity=Identity.generate(), config=config("b.example", a.endpoint))
        async with b:
            await b.dht.store(key, {"count": 3, "label": "ca"}, ttl=60)
            assert (await a.dht.get(key)).entries
            assert b.client.certs.server_name(a.endpoint) == "a.example"
        # A peer with the default self-signed certificate is not one the CA issued.
        async with NetNode(identity=Identity.generate(), config=NodeConfig()) as stranger:
            with pytest.raises(RpcError) as info:
                await a.client.call(
                    stranger.endpoint,
                    PING,
                    pb.PingRequest(sender=a.dht.card.to_proto()),
                    timeout=5,
                    attempts=1,
                )
            assert "certificate verify failed" in str(info.value).lower()


def test_a_certificate_whose_key_does_not_match_is_refused_with_the_file_names(tmp_path):
    first, second = TlsCredentials.generate(), TlsCredentials.generate()
    (tmp_path / "a.crt").write_bytes(first.cert_pem)
    (tmp_path / "b.key").write_bytes(second.key_pem)
    with pytest.raises(TlsError, match="is not the key of the certificate"):
        TlsCredentials.from_files(tmp_path / "a.crt", tmp_path / "b.key")
    with pytest.raises(TlsError, match="cannot read"):
        TlsCredentials.from_files(tmp_path / "missing.crt", tmp_path / "b.key")
