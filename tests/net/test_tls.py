"""TLS on the one port: real servers on loopback, real handshakes, a real man in the middle.

The man in the middle is a server with its own key that answers DHT calls with another
peer's logic, so it hands out that peer's signed card: what an attacker on the path
between two peers would relay.
"""

from __future__ import annotations

import datetime
import time

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from netutil import loopback_network

from swarmloco.errors import NetworkError
from swarmloco.net.client import ClientConfig, Method, RpcClient, RpcError
from swarmloco.net.dht.transport import PING, DhtServicer
from swarmloco.net.identity import Identity
from swarmloco.net.node import NetNode, NodeConfig
from swarmloco.net.server import PeerServer, ServerConfig
from swarmloco.net.tls import CertBook, TlsCredentials, TlsError, fetch_certificate
from swarmloco.proto.v1 import dht_pb2 as pb

HEALTH = Method(
    "/grpc.health.v1.Health/Check", health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse
)


def test_a_peer_keeps_its_tls_key_and_certificate_across_restarts():
    identity = Identity.generate()
    first, again = TlsCredentials.for_identity(identity), TlsCredentials.for_identity(identity)
    assert first.cert_pem == again.cert_pem and first.fingerprint == again.fingerprint
    assert TlsCredentials.for_identity(Identity.generate()).fingerprint != first.fingerprint


async def test_peers_talk_tls_and_a_plaintext_caller_gets_nothing():
    async with loopback_network(3) as nodes:
        a, b, c = nodes
        # Every card names its TLS key, and the cards the DHT carried pinned what was dialled.
        assert all(len(n.dht.card.tls_fingerprint) == 32 for n in nodes)
        assert a.client.certs.claimed(b.endpoint) == {b.dht.card.tls_fingerprint}
        assert c.client.certs.pinned(a.endpoint) is not None
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
    assert newcomer.client.certs.refused >= 1
    assert newcomer.client.certs.pinned(address) is None


async def test_a_server_whose_certificate_no_card_names_is_refused():
    async with loopback_network(2) as (a, b):
        # An attacker now answers at an address b's signed card names (here: its own
        # server, b's card made to name it, as if it had taken over b's address).
        async with PeerServer(
            ServerConfig(), [DhtServicer(b.dht, b.dht.rejections).service()]
        ) as mitm:
            address = f"127.0.0.1:{mitm.port}"
            a.client.certs.claim(
                address, b.identity.peer_id, int(time.time() * 1000), b.dht.card.tls_fingerprint
            )
            started = time.monotonic()
            with pytest.raises(RpcError) as info:
                await a.client.call(
                    address, PING, pb.PingRequest(sender=a.dht.card.to_proto()), timeout=10
                )
            assert time.monotonic() - started < 5  # refused, not retried until the deadline
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert "no signed card for that address names" in str(info.value)
        # b itself is still trusted.
        answer = await a.client.call(
            b.endpoint, PING, pb.PingRequest(sender=a.dht.card.to_proto()), timeout=10
        )
        assert answer.peer.tls_fingerprint == b.dht.card.tls_fingerprint


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
    with pytest.raises(NetworkError, match="TLS handshake with"):
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
