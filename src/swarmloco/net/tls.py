"""TLS on the one gRPC port, with nothing to set up by hand.

Every serving peer has a P-256 key derived from its identity (the same on every run) and a
self-signed certificate for it. The SHA-256 of the key (its SubjectPublicKeyInfo, so a
renewed certificate for the same key keeps it) is the peer's TLS *fingerprint*, and the
peer's contact card, signed with its identity key, carries it (net/dht/contact.py). So the
card says "the peer with this id serves at this address, with this TLS key".

gRPC's Python API cannot check a certificate with a callback, so a caller pins instead: it
fetches the certificate a server presents (one TLS handshake, :func:`fetch_certificate`),
checks it, and then opens the gRPC channel with that exact certificate as its only root. A
server that cannot prove it holds that certificate's key fails the handshake.

The check, in :class:`CertBook`:

- If signed cards name fingerprints for the address (a caller learns every card its DHT
  lookups carry), the certificate's fingerprint must be one of them. Anyone can sign a
  card naming any address, so one matching card is enough, but a certificate that no card
  names is refused: that is a man in the middle.
- If no card names the address yet (the bootstrap address given on the command line, a
  peer remembered from the last run), the certificate is taken on first use, and the
  card the peer answers its first DHT call with must carry the same fingerprint
  (:meth:`CertBook.confirm`); otherwise the pin is dropped and the call refused.

What this does not cover: an address first dialled outside the DHT (the bootstrap)
whose attacker answers with a card of its own is just a peer under its own identity; the
attacker cannot pose as another peer id.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import datetime
import hashlib
import ssl
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from swarmloco.errors import NetworkError, SwarmlocoError
from swarmloco.net.endpoints import parse_endpoint
from swarmloco.net.identity import Identity

TLS_SERVER_NAME = "swarmloco.peer"
"""The name in every peer's certificate; callers check it instead of the address."""
FINGERPRINT_BYTES = 32
_KEY_DOMAIN = b"swarmloco/v1/tls-key\x00"
_MAX_ENDPOINTS = 4096
_MAX_CLAIMS_PER_ENDPOINT = 8


class TlsError(SwarmlocoError):
    """A TLS certificate, key or CA file given by the operator cannot be used."""


class TlsMismatch(NetworkError):
    """A server's certificate is not the one the signed cards for its address name."""

    def __init__(self, message: str, *, endpoint: str = "") -> None:
        super().__init__(message)
        self.endpoint = endpoint


def fingerprint_of(certificate: x509.Certificate) -> bytes:
    """SHA-256 of the certificate's SubjectPublicKeyInfo (stable across renewals)."""
    spki = certificate.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return hashlib.sha256(spki).digest()


@dataclasses.dataclass(frozen=True)
class TlsCredentials:
    """A server's key and certificate (PEM) and the fingerprint its card publishes."""

    key_pem: bytes
    cert_pem: bytes
    fingerprint: bytes

    @classmethod
    def for_identity(cls, identity: Identity) -> TlsCredentials:
        """The peer's own TLS key, derived from its identity: its fingerprint stays the same
        across restarts, so cards other peers cached stay true."""
        secret = int.from_bytes(identity.derive_secret(_KEY_DOMAIN), "big")
        # The P-256 group order is just under 2**256: fold the secret into [1, n - 1].
        order = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551
        key = ec.derive_private_key(secret % (order - 1) + 1, ec.SECP256R1())
        return cls._of(key)

    @classmethod
    def generate(cls) -> TlsCredentials:
        """A fresh key (a server without an identity of its own, e.g. in tests)."""
        return cls._of(ec.generate_private_key(ec.SECP256R1()))

    @classmethod
    def _of(cls, key: ec.EllipticCurvePrivateKey) -> TlsCredentials:
        spki = key.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, TLS_SERVER_NAME)])
        builder = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            # Everything in the certificate follows from the key, so that a restarted
            # peer presents the very certificate its callers pinned.
            .serial_number(int.from_bytes(hashlib.sha256(spki).digest()[:16], "big") >> 1)
            # Clocks of peers differ; the fingerprint, not the dates, is what is checked.
            .not_valid_before(datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC))
            .not_valid_after(datetime.datetime(2100, 1, 1, tzinfo=datetime.UTC))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(TLS_SERVER_NAME)]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        )
        try:
            certificate = builder.sign(key, hashes.SHA256(), ecdsa_deterministic=True)
        except TypeError:  # cryptography too old for RFC 6979: a random signature
            certificate = builder.sign(key, hashes.SHA256())
        key_pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        cert_pem = certificate.public_bytes(serialization.Encoding.PEM)
        return cls(key_pem, cert_pem, fingerprint_of(certificate))

    @classmethod
    def from_files(cls, cert_file: Path | str, key_file: Path | str) -> TlsCredentials:
        """An operator's own certificate (PEM, the chain after the leaf) and key.

        Raises TlsError naming the file when either cannot be read or they do not match."""
        try:
            cert_pem = Path(cert_file).read_bytes()
            key_pem = Path(key_file).read_bytes()
        except OSError as exc:
            raise TlsError(f"cannot read the TLS certificate or key: {exc}") from None
        try:
            leaf = x509.load_pem_x509_certificate(cert_pem)
            key = serialization.load_pem_private_key(key_pem, password=None)
        except (ValueError, TypeError) as exc:
            raise TlsError(
                f"{cert_file} / {key_file}: not a PEM certificate and an unencrypted PEM key "
                f"({exc})"
            ) from None
        ours = key.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        theirs = leaf.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        if ours != theirs:
            raise TlsError(f"the key in {key_file} is not the key of the certificate {cert_file}")
        return cls(key_pem, cert_pem, fingerprint_of(leaf))

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key_pem, self.cert_pem)])


async def fetch_certificate(endpoint: str, timeout: float, *, ca_pem: bytes | None = None) -> bytes:
    """The certificate (DER) the server at ``endpoint`` presents: one TLS handshake and
    nothing else. Unchecked, unless ``ca_pem`` is given: then its chain must lead to that
    CA. Raises NetworkError when it cannot be had in time (or the CA refuses it)."""
    host, port = parse_endpoint(endpoint)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False  # peers are known by key; the card names it
    if ca_pem is None:
        context.verify_mode = ssl.CERT_NONE  # we read it to check it ourselves
    else:
        context.load_verify_locations(cadata=ca_pem.decode("ascii"))
    context.set_alpn_protocols(["h2"])
    try:
        async with asyncio.timeout(max(timeout, 0.001)):
            _, writer = await asyncio.open_connection(
                host, port, ssl=context, server_hostname=TLS_SERVER_NAME
            )
    except (OSError, TimeoutError, ssl.SSLError) as exc:
        why = "no answer in time" if isinstance(exc, TimeoutError) else str(exc) or repr(exc)
        raise NetworkError(f"TLS handshake with {endpoint} failed: {why}") from None
    try:
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    finally:
        writer.close()
    if not der:
        raise NetworkError(f"{endpoint} presented no TLS certificate")
    return bytes(der)


def _dns_name(certificate: x509.Certificate) -> str:
    """The first DNS name the certificate is for (its common name if it has none)."""
    try:
        names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName)
        dns = names.value.get_values_for_type(x509.DNSName)
        if dns:
            return dns[0]
    except x509.ExtensionNotFound:
        pass
    common = certificate.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(common[0].value) if common else TLS_SERVER_NAME


@dataclasses.dataclass
class _Pin:
    fingerprint: bytes
    pem: bytes
    confirmed: bool
    """Whether a signed card named it (False: taken on first use, awaiting a card)."""
    name: str = TLS_SERVER_NAME
    """The name to check the certificate for (a CA-issued certificate names its host)."""


class CertBook:
    """What a caller knows of the TLS keys behind addresses: the fingerprints signed cards
    claim for them, and the certificate pinned for each address dialled."""

    def __init__(self, *, ca_pem: bytes | None = None) -> None:
        self.ca_pem = ca_pem
        """An operator's CA: every server's chain must lead to it (on top of the card
        check), and channels trust it instead of the server's own certificate."""
        # endpoint -> {peer id: (card start time, fingerprint)}, least recently used first
        self._claims: collections.OrderedDict[str, dict[bytes, tuple[int, bytes]]] = (
            collections.OrderedDict()
        )
        self._pins: dict[str, _Pin] = {}
        self._fetching: dict[str, asyncio.Future[bytes]] = {}
        self.refused = 0
        """Certificates refused (no signed card names them)."""

    def claim(self, endpoint: str, peer_id: bytes, started_at_ms: int, fingerprint: bytes) -> None:
        """A verified card says ``peer_id`` serves ``endpoint`` with ``fingerprint``."""
        if not endpoint or len(fingerprint) != FINGERPRINT_BYTES:
            return
        claims = self._claims.get(endpoint)
        if claims is None:
            claims = self._claims[endpoint] = {}
            while len(self._claims) > _MAX_ENDPOINTS:
                self._claims.popitem(last=False)
        else:
            self._claims.move_to_end(endpoint)
        old = claims.get(peer_id)
        if old is not None and old[0] >= started_at_ms:
            return
        if old is None and len(claims) >= _MAX_CLAIMS_PER_ENDPOINT:
            return
        claims[peer_id] = (started_at_ms, fingerprint)
        pin = self._pins.get(endpoint)
        if pin is not None and pin.fingerprint == fingerprint:
            pin.confirmed = True
        elif pin is not None and old is not None and old[1] == pin.fingerprint:
            # The peer we pinned restarted with another key: fetch its certificate again.
            self.forget(endpoint)

    def withdraw(self, endpoint: str, peer_id: bytes) -> None:
        """``peer_id`` no longer serves ``endpoint`` (its contact failed and was dropped):
        its claim no longer stands against another server at that address."""
        claims = self._claims.get(endpoint)
        if claims is not None and claims.pop(peer_id, None) is not None and not claims:
            del self._claims[endpoint]

    def claimed(self, endpoint: str) -> set[bytes]:
        return {fp for _, fp in self._claims.get(endpoint, {}).values()}

    def pinned(self, endpoint: str) -> bytes | None:
        """The certificate (PEM) pinned for ``endpoint``, if any."""
        pin = self._pins.get(endpoint)
        return pin.pem if pin is not None else None

    def server_name(self, endpoint: str) -> str:
        """The name a channel to ``endpoint`` checks its certificate for."""
        pin = self._pins.get(endpoint)
        return pin.name if pin is not None else TLS_SERVER_NAME

    def forget(self, endpoint: str) -> None:
        """Drop the pin (the server's certificate changed, or it proved false)."""
        self._pins.pop(endpoint, None)

    async def certificate(self, endpoint: str, timeout: float) -> bytes:
        """The PEM certificate to trust for ``endpoint``: pinned, or fetched and checked.

        Raises TlsMismatch when the server presents a certificate no card names, and
        NetworkError when it cannot be reached."""
        pem = self.pinned(endpoint)
        if pem is not None:
            return pem
        fetching = self._fetching.get(endpoint)
        if fetching is None:
            fetching = asyncio.ensure_future(self._fetch(endpoint, timeout))
            self._fetching[endpoint] = fetching
            fetching.add_done_callback(lambda f: self._fetched(endpoint, f))
        return await asyncio.shield(fetching)

    def _fetched(self, endpoint: str, fetching: asyncio.Future[bytes]) -> None:
        self._fetching.pop(endpoint, None)
        if not fetching.cancelled():
            fetching.exception()  # retrieved here too, in case every caller gave up

    async def _fetch(self, endpoint: str, timeout: float) -> bytes:
        der = await fetch_certificate(endpoint, timeout, ca_pem=self.ca_pem)
        try:
            certificate = x509.load_der_x509_certificate(der)
            fingerprint = fingerprint_of(certificate)
        except ValueError as exc:
            raise NetworkError(f"{endpoint} presented an unreadable certificate: {exc}") from None
        claimed = self.claimed(endpoint)
        if claimed and fingerprint not in claimed:
            self.refused += 1
            raise TlsMismatch(
                f"{endpoint} presented a TLS certificate (key {fingerprint.hex()[:16]}) that "
                f"no signed card for that address names ({len(claimed)} card(s) name "
                f"another key): a man in the middle, or a stale address; refusing it",
                endpoint=endpoint,
            )
        pem = certificate.public_bytes(serialization.Encoding.PEM)
        self._pins[endpoint] = _Pin(
            fingerprint, pem, confirmed=bool(claimed), name=_dns_name(certificate)
        )
        while len(self._pins) > _MAX_ENDPOINTS:  # the oldest pin goes; it is fetched again
            del self._pins[next(iter(self._pins))]
        return pem

    def confirm(self, endpoint: str, fingerprint: bytes) -> None:
        """The server at ``endpoint`` answered with a card naming ``fingerprint``.

        Raises TlsMismatch (and drops the pin) when its certificate has another key: the
        card is relayed by someone else."""
        pin = self._pins.get(endpoint)
        if pin is None or pin.fingerprint == fingerprint:
            if pin is not None:
                pin.confirmed = True
            return
        self.forget(endpoint)
        self.refused += 1
        raise TlsMismatch(
            f"{endpoint} answered with a card whose TLS key ({fingerprint.hex()[:16] or 'none'}) "
            f"is not the key of the certificate it presented ({pin.fingerprint.hex()[:16]}): "
            "a man in the middle relaying another peer; refusing it",
            endpoint=endpoint,
        )
