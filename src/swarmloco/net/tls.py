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

The check, in :class:`CertBook`, believes only what an address says of itself:

- A card seen second hand (in a lookup, in a caller's request, in a store) proves nothing
  about an address: anyone can sign a card naming any address and any key, and keys cost
  nothing. So such a card is never a reason to refuse a certificate, and it is not even
  kept; it only counts as its own peer's word about itself (:meth:`CertBook.heard`: a
  newer card of a peer that moved or changed keys ends what was believed of it).
- A claim is *confirmed* when the server at the address presented the certificate and
  answered a DHT call with a card signed by a peer that names that certificate's key and
  that address (:meth:`CertBook.confirm`). While a confirmed claim stands, another
  certificate at the address is refused: a man in the middle, or a stale address. It
  stands for ``claim_ttl_s`` after the address last answered so, and ends sooner when its
  peer's calls fail (:meth:`CertBook.withdraw`) or its peer's own newer card says so; a
  peer that really moved does not lock its old address.
- A certificate that no confirmed claim names is taken on first use, and trusted only
  once the server's own signed card names its key: the DHT's calls check the card they are
  answered with, and a client with a confirmer (a Ping, see net/node.py) confirms before
  any other call uses the certificate (:meth:`CertBook.confirmation`). A server relaying
  another peer's card has another key than that card names, and is refused.

What this does not cover: a server answering under *its own* identity is just a peer; it
cannot pose as another peer id. The DHT checks which peer id an address answers as; other
calls learn only that the server holds the key its own signed card names.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import datetime
import functools
import hashlib
import logging
import ssl
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, Generic, NoReturn, TypeVar

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from swarmloco.errors import NetworkError, SwarmlocoError
from swarmloco.net.endpoints import parse_endpoint
from swarmloco.net.identity import Identity
from swarmloco.net.rejections import Rejection, RejectionLog

logger = logging.getLogger(__name__)
T = TypeVar("T")

TLS_SERVER_NAME = "swarmloco.peer"
"""The name in every peer's certificate; callers check it instead of the address."""
FINGERPRINT_BYTES = 32
_KEY_DOMAIN = b"swarmloco/v1/tls-key\x00"
_MAX_ENDPOINTS = 4096  # addresses with a confirmed claim, and pinned addresses
_MAX_CLAIMS_PER_ENDPOINT = 4  # peers confirmed at one address (restarts under new ids)


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
    except ConnectionRefusedError:
        raise NetworkError(f"{endpoint} refused the connection (nothing listens there)") from None
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
    """Whether the server's own signed card named its key (False: taken on first use)."""
    name: str = TLS_SERVER_NAME
    """The name to check the certificate for (a CA-issued certificate names its host)."""


@dataclasses.dataclass
class _Claim:
    """What the server at an address proved: it holds the key of ``fingerprint`` and
    answered with ``peer_id``'s card (started at ``started_at_ms``) naming that key and
    that address."""

    peer_id: bytes
    started_at_ms: int
    fingerprint: bytes
    until: float
    """When it stops counting (monotonic clock) unless the address answers so again."""


class _Shared(Generic[T]):
    """One job per address at a time: callers that come while it runs wait for the same
    one, and a caller that gives up (is cancelled) leaves it running for the others."""

    def __init__(self) -> None:
        self._jobs: dict[str, asyncio.Future[T]] = {}

    async def run(self, endpoint: str, start: Callable[[], Coroutine[Any, Any, T]]) -> T:
        job = self._jobs.get(endpoint)
        if job is None:
            job = self._jobs[endpoint] = asyncio.ensure_future(start())
            job.add_done_callback(functools.partial(self._done, endpoint))
        return await asyncio.shield(job)

    async def close(self) -> None:
        """End the jobs still running (their owner is closing): cancelled and waited for,
        so none calls out after its client closed."""
        jobs = list(self._jobs.values())
        for job in jobs:
            job.cancel()
        for job in jobs:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await job

    def _done(self, endpoint: str, job: asyncio.Future[T]) -> None:
        if self._jobs.get(endpoint) is job:
            del self._jobs[endpoint]
        if not job.cancelled():
            job.exception()  # retrieved here too, in case every caller gave up


class CertBook:
    """What a caller knows of the TLS keys behind addresses: the claims the addresses
    themselves confirmed, and the certificate pinned for each address dialled."""

    def __init__(
        self,
        *,
        ca_pem: bytes | None = None,
        claim_ttl_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ca_pem = ca_pem
        """An operator's CA: every server's chain must lead to it (on top of the card
        check), and channels trust it instead of the server's own certificate."""
        self.claim_ttl_s = claim_ttl_s
        self._clock = clock
        # endpoint -> {peer id: claim}, the address confirmed least recently first
        self._claims: collections.OrderedDict[str, dict[bytes, _Claim]] = collections.OrderedDict()
        self._where: dict[bytes, str] = {}  # peer id -> the address its claim is for
        self._pins: dict[str, _Pin] = {}
        self._fetching: _Shared[bytes] = _Shared()
        self._confirming: _Shared[None] = _Shared()
        self.rejections = RejectionLog(logger)
        """Certificates refused, by reason: ``tls-other-key`` (not the key its address
        confirmed), ``tls-relayed-card`` (the server's card names another key),
        ``tls-unconfirmed`` (no valid card of the server's own confirmed it)."""

    @property
    def refused(self) -> int:
        """Certificates refused, for every reason."""
        return self.rejections.total

    async def close(self) -> None:
        """End the fetches and confirmations still running (a caller that gave up left
        them running for others): their client is closing."""
        await self._fetching.close()
        await self._confirming.close()

    # -- claims ------------------------------------------------------------------------

    def heard(self, endpoint: str, peer_id: bytes, started_at_ms: int, fingerprint: bytes) -> None:
        """A verified card seen second hand says ``peer_id`` serves ``endpoint`` with
        ``fingerprint``. That proves nothing about the address (anyone can sign such a
        card for any address), so it is not kept; but a newer card of a peer whose claim
        was confirmed is that peer's own word that it moved or changed keys: its claim
        ends, and a pin of its old key at the same address is dropped."""
        where = self._where.get(peer_id)
        if where is None:
            return
        claim = self._claims[where][peer_id]
        if started_at_ms <= claim.started_at_ms:
            return  # an old card, replayed or late
        if endpoint == where and fingerprint == claim.fingerprint:
            claim.started_at_ms = started_at_ms  # restarted with the same address and key
            return
        self._drop(where, peer_id)
        pin = self._pins.get(where)
        if endpoint == where and pin is not None and pin.fingerprint == claim.fingerprint:
            self.forget(where)  # its certificate changed: fetch it again

    def withdraw(self, endpoint: str, peer_id: bytes) -> None:
        """``peer_id`` no longer serves ``endpoint`` (its contact failed and was dropped):
        its claim no longer stands against another server at that address."""
        if self._where.get(peer_id) == endpoint:
            self._drop(endpoint, peer_id)

    def confirmed(self, endpoint: str) -> set[bytes]:
        """The keys the server at ``endpoint`` proved for it, while their claims stand."""
        claims = self._claims.get(endpoint)
        if claims is None:
            return set()
        now = self._clock()
        for peer_id in [p for p, c in claims.items() if c.until <= now]:
            self._drop(endpoint, peer_id)
        return {c.fingerprint for c in claims.values()}

    def claims(self) -> int:
        """How many claims are held (every one confirmed by its address)."""
        return len(self._where)

    def _believe(self, endpoint: str, peer_id: bytes, started_at_ms: int, fp: bytes) -> None:
        where = self._where.get(peer_id)
        if where is not None:
            known = self._claims[where][peer_id]
            if started_at_ms < known.started_at_ms:
                return  # an older run of the peer than we know: not its word any more
            if where != endpoint:
                self._drop(where, peer_id)
        claims = self._claims.get(endpoint)
        if claims is None:
            claims = self._claims[endpoint] = {}
            while len(self._claims) > _MAX_ENDPOINTS:
                _, gone = self._claims.popitem(last=False)
                for other in gone:
                    del self._where[other]
        else:
            self._claims.move_to_end(endpoint)
        if peer_id not in claims and len(claims) >= _MAX_CLAIMS_PER_ENDPOINT:
            # Only other confirmations can fill an address: the oldest one goes.
            self._drop(endpoint, min(claims, key=lambda p: claims[p].until))
        claims[peer_id] = _Claim(peer_id, started_at_ms, fp, self._clock() + self.claim_ttl_s)
        self._where[peer_id] = endpoint

    def _drop(self, endpoint: str, peer_id: bytes) -> None:
        claims = self._claims[endpoint]
        del claims[peer_id]
        del self._where[peer_id]
        if not claims:
            del self._claims[endpoint]

    # -- pins --------------------------------------------------------------------------

    def pinned(self, endpoint: str) -> bytes | None:
        """The certificate (PEM) pinned for ``endpoint``, if any."""
        pin = self._pins.get(endpoint)
        return pin.pem if pin is not None else None

    def trusted(self, endpoint: str) -> bool:
        """Whether the certificate pinned for ``endpoint`` was confirmed by the server's own
        signed card (not only taken on first use)."""
        pin = self._pins.get(endpoint)
        return pin is not None and pin.confirmed

    def server_name(self, endpoint: str) -> str:
        """The name a channel to ``endpoint`` checks its certificate for."""
        pin = self._pins.get(endpoint)
        return pin.name if pin is not None else TLS_SERVER_NAME

    def forget(self, endpoint: str) -> None:
        """Drop the pin (the server's certificate changed, or it proved false)."""
        self._pins.pop(endpoint, None)

    async def certificate(self, endpoint: str, timeout: float) -> bytes:
        """The PEM certificate to trust for ``endpoint``: pinned, or fetched and checked.

        Raises TlsMismatch when the server presents a certificate other than the one its
        address confirmed, and NetworkError when it cannot be reached."""
        pem = self.pinned(endpoint)
        if pem is not None:
            return pem
        return await self._fetching.run(endpoint, lambda: self._fetch(endpoint, timeout))

    async def _fetch(self, endpoint: str, timeout: float) -> bytes:
        der = await fetch_certificate(endpoint, timeout, ca_pem=self.ca_pem)
        try:
            certificate = x509.load_der_x509_certificate(der)
            fingerprint = fingerprint_of(certificate)
        except ValueError as exc:
            raise NetworkError(f"{endpoint} presented an unreadable certificate: {exc}") from None
        confirmed = self.confirmed(endpoint)
        if confirmed and fingerprint not in confirmed:
            self._refuse(
                "tls-other-key",
                endpoint,
                f"{endpoint} presented a TLS certificate (key {fingerprint.hex()[:16]}) other "
                f"than the one the peer there proved for that address (key "
                f"{min(confirmed).hex()[:16]}): a man in the middle, or a stale address; "
                f"refusing it until that peer's calls fail, or for {self.claim_ttl_s:g}s "
                "after it last answered there",
            )
        pem = certificate.public_bytes(serialization.Encoding.PEM)
        self._pins[endpoint] = _Pin(
            fingerprint, pem, confirmed=bool(confirmed), name=_dns_name(certificate)
        )
        while len(self._pins) > _MAX_ENDPOINTS:  # the oldest pin goes; it is fetched again
            del self._pins[next(iter(self._pins))]
        return pem

    def confirm(
        self,
        endpoint: str,
        *,
        peer_id: bytes,
        card_endpoint: str,
        started_at_ms: int,
        fingerprint: bytes,
    ) -> None:
        """The server at ``endpoint`` answered with ``peer_id``'s verified card, which names
        ``card_endpoint`` and ``fingerprint``: the pinned certificate is trusted, and, when
        the card names this very address, the claim is confirmed.

        Raises TlsMismatch (and drops the pin) when its certificate has another key: the
        card is relayed by someone else."""
        pin = self._pins.get(endpoint)
        if pin is None:
            return  # dropped meanwhile: the next call fetches and confirms it again
        if pin.fingerprint != fingerprint:
            self.forget(endpoint)
            self._refuse(
                "tls-relayed-card",
                endpoint,
                f"{endpoint} answered with a card whose TLS key "
                f"({fingerprint.hex()[:16] or 'none'}) is not the key of the certificate it "
                f"presented ({pin.fingerprint.hex()[:16]}): a man in the middle relaying "
                "another peer; refusing it",
            )
        pin.confirmed = True
        if card_endpoint == endpoint:
            self._believe(endpoint, peer_id, started_at_ms, fingerprint)

    async def confirmation(
        self, endpoint: str, confirm: Callable[[], Coroutine[Any, Any, None]]
    ) -> None:
        """Make sure the certificate pinned for ``endpoint`` is confirmed: unless it is,
        ``confirm`` has the server answer with its card (a DHT Ping, which calls
        :meth:`confirm`); one confirmation per address at a time.

        Raises TlsMismatch when the server answered without a valid card naming its key,
        and what ``confirm`` raises when it cannot be asked."""
        if self.trusted(endpoint):
            return
        await self._confirming.run(endpoint, confirm)
        if self.trusted(endpoint):
            return
        pin = self._pins.get(endpoint)
        if pin is None:
            raise NetworkError(f"the certificate of {endpoint} changed while it was confirmed")
        self.forget(endpoint)
        self._refuse(
            "tls-unconfirmed",
            endpoint,
            f"{endpoint} did not answer with a valid signed card naming the key of its TLS "
            f"certificate ({pin.fingerprint.hex()[:16]}); refusing it",
        )

    def _refuse(self, code: str, endpoint: str, why: str) -> NoReturn:
        self.rejections.record(Rejection(code, why), endpoint)
        raise TlsMismatch(why, endpoint=endpoint)
