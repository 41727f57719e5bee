"""Keys that cost something: a proof of work per (swarm, peer id).

A key costs nothing to make, so a stranger can show a public run as many keys as it likes.
A run whose manifest sets ``identity_work`` (bits) takes part only keys that proved work for
it: an 8-byte nonce such that scrypt(peer id + nonce, salt = domain + swarm id) starts with
that many zero bits. scrypt (N = 2^11, r = 8: 2 MiB and about 5 ms an evaluation here) is
memory-hard, so a GPU or an ASIC gains little over the CPU an honest peer solves it on: at
8 bits a key costs about 256 evaluations, a second or so of one core, once per swarm (the
nonce is kept in the data directory). Checking a proof is one evaluation, and each proof is
checked once (the verdicts are kept, bounded). The proof names the swarm: keys cannot be
minted before the run exists, nor carried from one run to another.

What it buys (docs/SECURITY.md, "Many keys"): an attacker with C cores mints about C keys
a second at 8 bits, 1,000 keys in 4 core-minutes, where plain keys take milliseconds. It is
a price, not a wall: the defences that hold against any number of keys are those that never
count keys (partners' word, networks).

The gate (:class:`IdentityWork`) has the shape of a private run's :class:`Admission`: a
proof travels wherever a membership certificate does (the ``member`` field of every owned
record, a group declaration's ``membership``, a signed download request), and every layer
checks it with the same ``check(peer_id, credential)``.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from swarmloco.core.manifest import MAX_IDENTITY_WORK
from swarmloco.errors import SwarmlocoError
from swarmloco.net.rejections import Rejection

logger = logging.getLogger(__name__)

DOMAIN = b"swarmloco/v1/identity-work\x00"
NONCE_BYTES = 8
MAX_BITS = MAX_IDENTITY_WORK
_N, _R, _P = 1 << 11, 8, 1  # 2 MiB of memory per evaluation
_CACHE = 4096  # verdicts kept: (peer id, nonce) -> proven, about 100 bytes each
_CHECKS_PER_S = 40.0  # proofs not seen before checked per second at most (a flood's cost)
_CHECK_BURST = 200.0


class WorkError(SwarmlocoError):
    """This peer's proof of work cannot be made or read."""


def work_bits(swarm_id: str, peer_id: bytes, nonce: bytes) -> int:
    """How many leading zero bits ``nonce`` proves for ``peer_id`` in ``swarm_id``."""
    digest = hashlib.scrypt(
        peer_id + nonce,
        salt=DOMAIN + bytes.fromhex(swarm_id),
        n=_N,
        r=_R,
        p=_P,
        maxmem=64 * 1024 * 1024,
        dklen=32,
    )
    value = int.from_bytes(digest, "big")
    return 256 - value.bit_length()


def solve(
    swarm_id: str,
    peer_id: bytes,
    bits: int,
    *,
    progress: Callable[[int], None] | None = None,
) -> bytes:
    """A nonce proving ``bits`` for ``peer_id`` in ``swarm_id`` (about 2^bits evaluations);
    ``progress(tries)`` is called every 64 tries."""
    if not 0 <= bits <= MAX_BITS:
        raise ValueError(f"identity work is 0 to {MAX_BITS} bits, got {bits}")
    start = int.from_bytes(os.urandom(NONCE_BYTES), "big")
    tries = 0
    while True:
        nonce = ((start + tries) % (1 << (8 * NONCE_BYTES))).to_bytes(NONCE_BYTES, "big")
        tries += 1
        if work_bits(swarm_id, peer_id, nonce) >= bits:
            return nonce
        if progress is not None and tries % 64 == 0:
            progress(tries)


def load_or_solve(path: Path, swarm_id: str, peer_id: bytes, bits: int) -> bytes:
    """The nonce kept at ``path`` if it still proves ``bits`` for this key, else a new one,
    solved here (a second or so at 8 bits, with a line on the log) and kept."""
    try:
        kept = bytes.fromhex(path.read_text().strip())
        if len(kept) == NONCE_BYTES and work_bits(swarm_id, peer_id, kept) >= bits:
            return kept
    except (OSError, ValueError):
        pass
    logger.info(
        "proving this peer's key for swarm %s (%d bits of work: about %.0f s, once)",
        swarm_id[:12],
        bits,
        (1 << bits) * 0.005,
    )
    started = time.monotonic()
    nonce = solve(swarm_id, peer_id, bits)
    logger.info("key proven in %.1f s", time.monotonic() - started)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(nonce.hex() + "\n")
        os.replace(tmp, path)
    except OSError as exc:
        logger.warning("could not keep the proof of work in %s (%s): it is made again", path, exc)
    return nonce


class IdentityWork:
    """The gate of a public run that asks every key for ``bits`` of work, and this peer's
    own proof (``own_bytes``; empty for a gate that only reads, as a dashboard's)."""

    def __init__(
        self,
        *,
        swarm_id: str,
        bits: int,
        own: bytes = b"",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < bits <= MAX_BITS:
            raise ValueError(f"identity work is 1 to {MAX_BITS} bits, got {bits}")
        self.swarm_id = swarm_id
        self.bits = bits
        self.own_bytes = bytes(own)
        """What this peer attaches to what it offers: its nonce."""
        self._clock = clock
        self._verdicts: collections.OrderedDict[tuple[str, bytes], bool] = collections.OrderedDict()
        self._tokens = _CHECK_BURST
        self._refilled = clock()
        self.checked = 0
        """Proofs evaluated (each once)."""

    def check(self, peer_id: str, credential: bytes) -> None:
        """Raise Rejection ``unproven`` unless ``credential`` (a nonce) proves this gate's
        work for ``peer_id`` (hex, verified by the caller). A proof not seen before costs
        one scrypt, within a budget per second: beyond it, it is refused unchecked (and
        checked when shown again), so a flood of made-up proofs costs a bounded share of
        a core."""
        nonce = bytes(credential)
        if len(nonce) != NONCE_BYTES:
            raise Rejection("unproven", f"peer {peer_id[:12]} shows no proof of work for its key")
        key = (peer_id, nonce)
        verdict = self._verdicts.get(key)
        if verdict is None:
            if not self._spend():
                raise Rejection(
                    "unproven", f"peer {peer_id[:12]}'s proof of work is not checked yet (busy)"
                )
            try:
                verdict = work_bits(self.swarm_id, bytes.fromhex(peer_id), nonce) >= self.bits
            except ValueError:
                verdict = False
            self.checked += 1
            self._verdicts[key] = verdict
            while len(self._verdicts) > _CACHE:
                self._verdicts.popitem(last=False)
        else:
            self._verdicts.move_to_end(key)
        if not verdict:
            raise Rejection(
                "unproven",
                f"peer {peer_id[:12]}'s key does not prove {self.bits} bits of work",
            )

    def admits(self, peer_id: str, credential: bytes) -> bool:
        try:
            self.check(peer_id, credential)
        except Rejection:
            return False
        return True

    def _spend(self) -> bool:
        now = self._clock()
        self._tokens = min(_CHECK_BURST, self._tokens + (now - self._refilled) * _CHECKS_PER_S)
        self._refilled = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True
