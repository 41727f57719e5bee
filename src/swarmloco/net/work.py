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

Proofs not seen before are checked within a budget (:class:`CheckBudget`): at most 40 a
second in all, shared among the source networks they came from, so that one network's
flood of made-up proofs costs a bounded share of a core and leaves other networks'
newcomers checked at once. Callers check what is cheap first (a record's or a request's
signature) and spend the budget last.

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
import copy
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
_PROVEN = 4096  # proven (peer id, nonce) pairs kept, about 100 bytes each
_REFUTED = 1024  # refuted ones, kept apart: made-up proofs never push a proven key out
_CHECKS_PER_S = 40.0  # proofs not seen before checked per second at most (a flood's cost)
_CHECK_BURST = 200.0
_NETWORK_BURST = 50.0  # checked at once for one source network
_RESERVE = 10.0  # checks kept for networks that asked nothing of late (newcomers)
_NETWORKS = 1024  # source networks whose share of the checks is tracked


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


class CheckBudget:
    """How many proofs not seen before a gate checks, and for whom: at most ``rate`` a
    second in all (``burst`` at once), shared among the source networks that ask.

    Each network has a bucket of its own, ``network_burst`` deep, that refills at rate / n,
    n the networks asking now (those whose buckets are not full again; at most
    ``networks`` of them, the least recent forgotten first): a flood from a few networks
    costs each its share and no more. A network asking now may not take the last
    ``reserve`` checks: they are kept for one that asked nothing of late, so that a
    newcomer's first proof is checked at once however long the flood lasts.
    """

    def __init__(
        self,
        *,
        rate: float = _CHECKS_PER_S,
        burst: float = _CHECK_BURST,
        network_burst: float = _NETWORK_BURST,
        reserve: float = _RESERVE,
        networks: int = _NETWORKS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if reserve < 0.0 or reserve + 1.0 > burst or network_burst < 1.0:
            raise ValueError("a check budget needs room for one check beyond its reserve")
        self._rate = rate
        self._burst = burst
        self._network_burst = network_burst
        self._reserve = reserve
        self._max_networks = networks
        self._clock = clock
        self._tokens = burst
        self._refilled = clock()
        self._networks: collections.OrderedDict[str, list[float]] = collections.OrderedDict()
        """[tokens, refilled] by network, the least recent asker first."""

    @property
    def networks(self) -> int:
        """Networks asking now (each has rate / networks a second)."""
        return len(self._networks)

    def spend(self, network: str) -> bool:
        """Whether a proof from ``network`` may be checked now (then it is counted)."""
        now = self._clock()
        self._tokens = min(self._burst, self._tokens + (now - self._refilled) * self._rate)
        self._refilled = now
        full = self._network_burst
        while self._networks:
            first, (tokens, refilled) = next(iter(self._networks.items()))
            share = self._rate / len(self._networks)
            if first == network or tokens + (now - refilled) * share < full:
                break
            del self._networks[first]  # full again: it asks nothing now
        bucket = self._networks.get(network)
        if bucket is None:
            bucket = self._networks[network] = [full, now]
            if len(self._networks) > self._max_networks:
                self._networks.popitem(last=False)
        else:
            share = self._rate / len(self._networks)
            bucket[0] = min(full, bucket[0] + (now - bucket[1]) * share)
            bucket[1] = now
            self._networks.move_to_end(network)
        floor = 0.0 if bucket[0] >= full else self._reserve
        if bucket[0] < 1.0 or self._tokens < 1.0 + floor:
            return False
        bucket[0] -= 1.0
        self._tokens -= 1.0
        return True


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
        run_id: str = "",
    ) -> None:
        """``run_id``: the run the proofs name (empty: ``swarm_id``; a pipelined run's id
        for the swarm of one of its stages)."""
        if not 0 < bits <= MAX_BITS:
            raise ValueError(f"identity work is 1 to {MAX_BITS} bits, got {bits}")
        self.swarm_id = swarm_id
        self.run_id = run_id or swarm_id
        self.bits = bits
        self.own_bytes = bytes(own)
        """What this peer attaches to what it offers: its nonce."""
        self._proven: collections.OrderedDict[tuple[str, bytes], None] = collections.OrderedDict()
        self._refuted: collections.OrderedDict[tuple[str, bytes], None] = collections.OrderedDict()
        self.budget = CheckBudget(clock=clock)
        self.checked = 0
        """Proofs evaluated (each once)."""

    def check(self, peer_id: str, credential: bytes, *, network: str = "") -> None:
        """Raise Rejection ``unproven`` unless ``credential`` (a nonce) proves this gate's
        work for ``peer_id`` (hex, verified by the caller). A proof not seen before costs
        one scrypt, within ``network``'s share of the budget (the caller's source network,
        ``endpoints.source_network``; "" where it is not known): beyond it, it is refused
        unchecked (and checked when shown again), so a flood of made-up proofs costs a
        bounded share of a core, and leaves other networks' proofs checked."""
        nonce = bytes(credential)
        if len(nonce) != NONCE_BYTES:
            raise Rejection("unproven", f"peer {peer_id[:12]} shows no proof of work for its key")
        key = (peer_id, nonce)
        if key in self._proven:
            self._proven.move_to_end(key)
            return
        if key not in self._refuted:
            if not self.budget.spend(network):
                raise Rejection(
                    "unproven", f"peer {peer_id[:12]}'s proof of work is not checked yet (busy)"
                )
            try:
                proven = work_bits(self.run_id, bytes.fromhex(peer_id), nonce) >= self.bits
            except ValueError:
                proven = False
            self.checked += 1
            verdicts, limit = (self._proven, _PROVEN) if proven else (self._refuted, _REFUTED)
            verdicts[key] = None
            while len(verdicts) > limit:
                verdicts.popitem(last=False)
            if proven:
                return
        raise Rejection(
            "unproven", f"peer {peer_id[:12]}'s key does not prove {self.bits} bits of work"
        )

    def guarding(self, swarm_id: str) -> IdentityWork:
        """A gate of the same run, proof and budget over ``swarm_id``'s records."""
        gate = copy.copy(self)  # (one node's budget and verdicts, whichever swarm asks)
        gate.swarm_id = swarm_id
        return gate

    def admits(self, peer_id: str, credential: bytes, *, network: str = "") -> bool:
        try:
            self.check(peer_id, credential, network=network)
        except Rejection:
            return False
        return True
