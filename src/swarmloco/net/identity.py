"""A peer's cryptographic identity: its Ed25519 key, its peer id, signing and verifying.

The peer id is BLAKE2b-160 of the raw 32-byte public key, and it is also the peer's DHT
node id, so a peer cannot choose where it sits in the key space without making a key
(S/Kademlia). The private key lives in the peer's data directory as an unencrypted PKCS#8
PEM file readable by its owner only (0600); it is created on first run and reused after.

Every signature swarmloco makes is over ``domain || payload`` with a distinct domain string
per purpose, so a signature made for one purpose can never be replayed as another.
"""

from __future__ import annotations

import functools
import hashlib
import os
import stat
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from swarmloco.errors import SwarmlocoError

PEER_ID_BYTES = 20
PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64
KEY_FILE_NAME = "identity.pem"


class IdentityError(SwarmlocoError):
    """The key file cannot be read, written or trusted."""


def peer_id_of(public_key: bytes) -> bytes:
    """The 20-byte peer id of a raw Ed25519 public key."""
    return hashlib.blake2b(public_key, digest_size=PEER_ID_BYTES).digest()


@functools.lru_cache(maxsize=4096)
def _public_key(raw: bytes) -> Ed25519PublicKey | None:
    # Parsing a key costs about as much as hashing it; peers verify the same keys over and
    # over (every contact card, every record of a peer), so keep the parsed objects. Only
    # 32-byte keys get here (verify checks first), so an entry is the key, a parsed key
    # object and the cache's links: under 1 KiB, 4 MiB at most for the whole cache.
    try:
        return Ed25519PublicKey.from_public_bytes(raw)
    except ValueError:
        return None


def verify(public_key: bytes, signature: bytes, domain: bytes, payload: bytes) -> bool:
    """Whether ``signature`` is ``public_key``'s signature of ``domain || payload``.

    The lengths are checked before anything else: bytes of any other length are refused
    without being parsed, hashed or cached.
    """
    if len(public_key) != PUBLIC_KEY_BYTES or len(signature) != SIGNATURE_BYTES:
        return False
    key = _public_key(bytes(public_key))
    if key is None:
        return False
    try:
        key.verify(bytes(signature), domain + payload)
    except InvalidSignature:
        return False
    return True


class Identity:
    """An Ed25519 key pair and the peer id derived from it."""

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._private_key = private_key
        self.public_key: bytes = private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.peer_id: bytes = peer_id_of(self.public_key)

    @classmethod
    def generate(cls) -> Identity:
        """A fresh identity that lives in memory only (simulations, tests, one-shot tools)."""
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load_or_create(cls, data_dir: Path | str) -> Identity:
        """The identity stored in ``data_dir``, created there (mode 0600) on first use.

        Raises IdentityError when the file exists but cannot be used, or is readable by
        other users (someone else could then impersonate this peer).
        """
        path = Path(data_dir) / KEY_FILE_NAME
        if path.exists():
            return cls._load(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        identity = cls.generate()
        pem = identity._private_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        # Write a temporary file created 0600 (never world-readable, not even briefly),
        # then link it into place: two processes starting together cannot both win.
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(pem)
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)
            except FileExistsError:
                return cls._load(path)
        finally:
            tmp.unlink(missing_ok=True)
        return identity

    @classmethod
    def _load(cls, path: Path) -> Identity:
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            raise IdentityError(
                f"{path} is readable by other users (mode {mode:o}); anyone who can read it "
                f"can act as this peer. Run `chmod 600 {path}` and start again."
            )
        try:
            key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        except (ValueError, TypeError) as exc:
            raise IdentityError(
                f"{path} is not an unencrypted Ed25519 private key ({exc}); move it away to "
                "start with a new identity"
            ) from exc
        if not isinstance(key, Ed25519PrivateKey):
            raise IdentityError(f"{path} holds a {type(key).__name__}, not an Ed25519 key")
        return cls(key)

    @property
    def peer_id_hex(self) -> str:
        return self.peer_id.hex()

    def sign(self, domain: bytes, payload: bytes) -> bytes:
        """Sign ``domain || payload`` (see :func:`verify`)."""
        return self._private_key.sign(domain + payload)

    def derive_secret(self, domain: bytes) -> bytes:
        """32 secret bytes for ``domain``, derived from the private key: the same on every
        run of this identity, and useless for recovering the key (e.g. the TLS key)."""
        raw = self._private_key.private_bytes(
            serialization.Encoding.Raw,
            serialization.PrivateFormat.Raw,
            serialization.NoEncryption(),
        )
        return hashlib.blake2b(domain, key=raw, digest_size=32).digest()

    def __repr__(self) -> str:
        return f"Identity(peer_id={self.peer_id_hex})"
