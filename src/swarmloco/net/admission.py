"""Admission to a private swarm: membership certificates signed by the run's creator.

A private run's manifest says ``admission: "certificate"``. Its creator (the key in the
manifest's ``creator``) signs a certificate for each peer it admits (``swarmloco admit
PEER_ID``): the swarm id, the peer id and an expiry, under a signature domain of its own.
A member shows its certificate with everything it offers the swarm:

* in every DHT record it owns under the swarm's keys (the value's ``member`` field):
  members ignore records without a valid one and do not store them;
* in its group declaration: a leader refuses to take it, and every member refuses a group
  that holds a declaration without one;
* in its state download requests, signed with its key: donors refuse to serve others.

The creator needs no certificate. Certificates are public (they travel in records), so a
certificate alone proves nothing: it is always checked against a key that signed the
record, declaration or request it came with. A public run (no ``admission``) is open to
any key, and nothing here runs.
"""

from __future__ import annotations

import base64
import binascii
import collections
import copy
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import msgpack

from swarmloco.errors import SwarmlocoError
from swarmloco.net.identity import Identity, peer_id_of, verify
from swarmloco.net.rejections import Rejection
from swarmloco.net.work import IdentityWork, load_or_solve, solve

if TYPE_CHECKING:
    from swarmloco.core.manifest import SwarmManifest

DOMAIN = b"swarmloco/v1/membership\x00"
MAX_CERTIFICATE_BYTES = 192
TEXT_PREFIX = "swarmloco-member-v1:"
PRIVATE = "certificate"
"""The manifest's ``admission`` of a private run."""
_CACHE = 4096


class AdmissionError(SwarmlocoError):
    """A membership certificate is malformed, not for this peer or swarm, or expired; or a
    private swarm was joined without one."""


@dataclasses.dataclass(frozen=True)
class Membership:
    """One peer's membership certificate of one swarm."""

    swarm_id: str
    """The swarm (40 hex digits)."""
    peer_id: str
    """The admitted peer (40 hex digits)."""
    expires_at: int
    """Unix seconds after which it no longer counts (0: never)."""
    signature: bytes
    """The creator's Ed25519 signature over the three fields above."""

    @staticmethod
    def _payload(swarm_id: str, peer_id: str, expires_at: int) -> bytes:
        return msgpack.packb([swarm_id, peer_id, expires_at], use_bin_type=True)

    @classmethod
    def issue(
        cls, creator: Identity, swarm_id: str, peer_id: str, *, expires_at: int = 0
    ) -> Membership:
        """A certificate for ``peer_id``, signed by ``creator`` (the swarm's creator key)."""
        peer_id = _check_hex_id("peer id", peer_id)
        swarm_id = _check_hex_id("swarm id", swarm_id)
        if not isinstance(expires_at, int) or expires_at < 0:
            raise AdmissionError(f"expires_at must be unix seconds >= 0, got {expires_at!r}")
        signature = creator.sign(DOMAIN, cls._payload(swarm_id, peer_id, expires_at))
        return cls(swarm_id, peer_id, expires_at, signature)

    def signed_by(self, creator_public_key: bytes) -> bool:
        payload = self._payload(self.swarm_id, self.peer_id, self.expires_at)
        return verify(creator_public_key, self.signature, DOMAIN, payload)

    def to_bytes(self) -> bytes:
        return msgpack.packb(
            [self.swarm_id, self.peer_id, self.expires_at, self.signature], use_bin_type=True
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> Membership:
        """Parse a certificate (AdmissionError if malformed; the signature is not checked)."""
        if not isinstance(data, bytes) or not 0 < len(data) <= MAX_CERTIFICATE_BYTES:
            raise AdmissionError("a membership certificate is 1 to 192 bytes")
        try:
            fields = msgpack.unpackb(data, raw=False, strict_map_key=True)
        except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
            raise AdmissionError(f"membership certificate is not msgpack: {exc}") from None
        if (
            not isinstance(fields, list)
            or len(fields) != 4
            or not all(isinstance(f, str) for f in fields[:2])
            or type(fields[2]) is not int
            or not isinstance(fields[3], bytes)
        ):
            raise AdmissionError("membership certificate is not [swarm, peer, expiry, signature]")
        swarm_id, peer_id, expires_at, signature = fields
        cert = cls(
            _check_hex_id("swarm id", swarm_id),
            _check_hex_id("peer id", peer_id),
            expires_at,
            signature,
        )
        if cert.to_bytes() != data:
            raise AdmissionError("membership certificate is not in canonical form")
        return cert

    def to_text(self) -> str:
        """One line to paste into ``--membership`` (or a file)."""
        return TEXT_PREFIX + base64.urlsafe_b64encode(self.to_bytes()).decode("ascii")

    @classmethod
    def from_text(cls, text: str) -> Membership:
        text = text.strip()
        if not text.startswith(TEXT_PREFIX):
            raise AdmissionError(
                f"a membership certificate starts with {TEXT_PREFIX!r} (as `swarmloco admit` "
                "prints it)"
            )
        try:
            data = base64.urlsafe_b64decode(text[len(TEXT_PREFIX) :].encode("ascii"))
        except (binascii.Error, ValueError) as exc:
            raise AdmissionError(f"membership certificate is not base64: {exc}") from None
        return cls.from_bytes(data)


def _check_hex_id(what: str, value: str) -> str:
    normalized = value.strip().lower() if isinstance(value, str) else ""
    if len(normalized) != 40 or any(c not in "0123456789abcdef" for c in normalized):
        raise AdmissionError(f"{what} {value!r} is not 40 hex digits")
    return normalized


class Gate(Protocol):
    """Who may take part in one swarm, as every layer asks it: a private run's
    :class:`Admission` (certificates), or a public run's :class:`~swarmloco.net.work.
    IdentityWork` (proofs of work). The credential a peer shows travels in the same places
    (a record's ``member`` field, a declaration's ``membership``, a signed download
    request) and is checked with the key that signed what it came with."""

    swarm_id: str
    """The swarm whose records, declarations and requests it guards."""
    run_id: str
    """The run its credentials name: the swarm's own id, or a pipelined run's id for the
    swarm of one of its stages (a key's one credential serves every stage)."""
    own_bytes: bytes

    def guarding(self, swarm_id: str) -> Gate:
        """A gate of the same run and credential over ``swarm_id``'s records (a stage
        peer guards its run's swarm, whose ``stage-load`` records it publishes, too)."""
        ...

    def check(self, peer_id: str, credential: bytes, *, network: str = "") -> None:
        """Raise Rejection unless ``credential`` lets ``peer_id`` (verified) take part;
        ``network`` is the source network it came from ("": not known), which a gate whose
        checks cost something shares them by."""
        ...

    def admits(self, peer_id: str, credential: bytes, *, network: str = "") -> bool: ...


def gate_of(
    manifest: SwarmManifest,
    identity: Identity,
    certificate: str | Membership | None = None,
    *,
    work_file: Path | None = None,
    clock: Callable[[], float] = time.time,
) -> Gate | None:
    """The gate of ``manifest``'s swarm for ``identity`` (None: an open run): a private
    run's certificates (:meth:`Admission.of`, AdmissionError when the peer has none), or a
    public run's proofs of work, this key's own solved (and kept in ``work_file``) here
    when the run asks for them (about 2^bits x 5 ms, once)."""
    if manifest.private:
        return Admission.of(manifest, identity, certificate, clock=clock)
    bits = manifest.identity_work
    if not bits:
        return None
    run = manifest.run_id
    own = (
        load_or_solve(work_file, run, identity.peer_id, bits)
        if work_file is not None
        else solve(run, identity.peer_id, bits)
    )
    return IdentityWork(swarm_id=manifest.swarm_id, bits=bits, own=own, run_id=run)


def reader_gate(manifest: SwarmManifest, swarm_id: str = "") -> Gate | None:
    """The gate of ``manifest``'s swarm (or of ``swarm_id``, read by its rules) for a
    node that only reads its records (a dashboard, a peer choosing its stage): it holds no
    credential of its own, and drops the records of keys that show none (None: an open
    run)."""
    swarm = swarm_id or manifest.swarm_id
    run = manifest.run_id if manifest.run_id != manifest.swarm_id else swarm
    if manifest.private:
        creator = bytes.fromhex(manifest.creator)
        return Admission(swarm_id=swarm, creator_public_key=creator, run_id=run)
    if manifest.identity_work:
        return IdentityWork(swarm_id=swarm, bits=manifest.identity_work, run_id=run)
    return None


class Admission:
    """Who may take part in one private swarm, and this peer's own certificate.

    :meth:`check` is what every layer calls with a peer id it verified (a record's owner,
    a declaration's key, a download request's signer) and the certificate that came with
    it. Verified certificates are cached, so a check costs a dictionary lookup.
    """

    def __init__(
        self,
        *,
        swarm_id: str,
        creator_public_key: bytes,
        own: Membership | None = None,
        clock: Callable[[], float] = time.time,
        run_id: str = "",
    ) -> None:
        """``run_id``: the run whose certificates admit (empty: ``swarm_id``'s own)."""
        self.swarm_id = swarm_id
        self.run_id = run_id or swarm_id
        self.creator_public_key = bytes(creator_public_key)
        self.creator = peer_id_of(self.creator_public_key).hex()
        self.own = own
        self.own_bytes = own.to_bytes() if own is not None else b""
        """What this peer attaches (empty for the creator)."""
        self._clock = clock
        self._verified: collections.OrderedDict[bytes, Membership | None] = (
            collections.OrderedDict()
        )

    @classmethod
    def of(
        cls,
        manifest: SwarmManifest,
        identity: Identity,
        certificate: str | Membership | None,
        *,
        clock: Callable[[], float] = time.time,
    ) -> Admission | None:
        """The gate of ``manifest``'s swarm for ``identity`` (None: a public run).

        Raises AdmissionError, with what to do, when the run is private and this peer is
        neither its creator nor holds a valid certificate for itself.
        """
        if manifest.admission != PRIVATE:
            return None
        gate = cls(
            swarm_id=manifest.swarm_id,
            creator_public_key=bytes.fromhex(manifest.creator),
            clock=clock,
            run_id=manifest.run_id,
        )
        me = identity.peer_id_hex
        if me == gate.creator:
            return gate
        if certificate is None or certificate == "":
            raise AdmissionError(
                f"swarm {gate.run_id} is private: this peer ({me}) needs a membership "
                "certificate from its creator. Ask the creator to run\n"
                f"  swarmloco admit {me} --swarm {gate.run_id}\n"
                "and start this peer with --membership CERTIFICATE (the line it prints, or a "
                "file holding it)"
            )
        own = (
            certificate
            if isinstance(certificate, Membership)
            else (Membership.from_text(certificate))
        )
        try:
            gate.check(me, own.to_bytes())
        except Rejection as rejection:
            raise AdmissionError(
                f"the membership certificate given cannot be used: {rejection.reason}"
            ) from None
        gate.own = own
        gate.own_bytes = own.to_bytes()
        return gate

    def guarding(self, swarm_id: str) -> Admission:
        gate = copy.copy(self)  # (its run, certificate and verdicts: certificates checked once)
        gate.swarm_id = swarm_id
        return gate

    def check(self, peer_id: str, certificate: bytes, *, network: str = "") -> None:
        """Raise Rejection ``not-admitted`` unless ``peer_id`` (hex, verified by the caller)
        is the creator or ``certificate`` admits it to this swarm now (a signature check at
        most, whatever ``network`` it came from)."""
        if peer_id == self.creator:
            return
        if not certificate:
            raise Rejection("not-admitted", f"peer {peer_id[:12]} shows no membership certificate")
        if len(certificate) > MAX_CERTIFICATE_BYTES:
            raise Rejection(
                "not-admitted",
                f"peer {peer_id[:12]}'s membership certificate is {len(certificate)} bytes; "
                f"a certificate is at most {MAX_CERTIFICATE_BYTES}",
            )
        cert = self._verify(bytes(certificate))
        if cert is None:
            raise Rejection(
                "not-admitted", f"peer {peer_id[:12]}'s membership certificate is not valid here"
            )
        if cert.peer_id != peer_id:
            raise Rejection(
                "not-admitted",
                f"peer {peer_id[:12]} shows the membership certificate of {cert.peer_id[:12]}",
            )
        if cert.expires_at and cert.expires_at < self._clock():
            raise Rejection(
                "not-admitted", f"peer {peer_id[:12]}'s membership certificate has expired"
            )

    @property
    def cached_bytes(self) -> int:
        """Bytes of certificates this gate remembers the verdict on (at most 4,096 of at
        most ``MAX_CERTIFICATE_BYTES`` each)."""
        return sum(len(data) for data in self._verified)

    def admits(self, peer_id: str, certificate: bytes, *, network: str = "") -> bool:
        try:
            self.check(peer_id, certificate, network=network)
        except Rejection:
            return False
        return True

    def _verify(self, data: bytes) -> Membership | None:
        # Checked before the cache is even looked up: hashing a key of any length costs
        # time, and keeping one would cost its size. Cached certificates are at most
        # MAX_CERTIFICATE_BYTES, so an entry (the bytes, the parsed Membership and its
        # fields, the dictionary's links) stays under 1 KiB: 4 MiB for the whole cache.
        if not 0 < len(data) <= MAX_CERTIFICATE_BYTES:
            return None
        if data in self._verified:
            self._verified.move_to_end(data)
            return self._verified[data]
        try:
            cert: Membership | None = Membership.from_bytes(data)
        except AdmissionError:
            cert = None
        if cert is not None and (
            cert.swarm_id != self.run_id or not cert.signed_by(self.creator_public_key)
        ):
            cert = None
        self._verified[data] = cert
        if len(self._verified) > _CACHE:
            self._verified.popitem(last=False)
        return cert
