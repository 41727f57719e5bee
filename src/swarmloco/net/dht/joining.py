"""Entering the network: the peers a node joins through (:class:`EntryPeers`), asked all at
once, and what their clocks say of ours (:func:`check_clock`, a plain function), then the
clocks of peers on other networks (:meth:`EntryPeers.clocks`, :func:`network_votes`).

A node joins through the addresses it was given; it remembers them, and joins through
them again when its routing table runs empty (a frozen process finds every contact failed
when it wakes). An address may belong to a peer that is still starting, so each is pinged
until it answers or the join deadline passes; once one answered, the others get
``join_grace_s`` more, so a dead address costs that and not the whole join timeout.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import Callable, Sequence

from swarmloco.errors import NetworkError
from swarmloco.net.deadline import Deadline
from swarmloco.net.dht.book import ContactBook
from swarmloco.net.dht.config import DhtConfig
from swarmloco.net.dht.transport import DhtTransport
from swarmloco.net.endpoints import endpoint_network
from swarmloco.net.tls import TlsMismatch
from swarmloco.proto.v1 import dht_pb2 as pb


@dataclasses.dataclass(frozen=True)
class Answer:
    """An entry peer's answer to a join ping, and how far its clock is ahead of ours."""

    response: pb.PingResponse
    offset: float
    endpoint: str = ""
    """The address it was asked at."""
    peer_id: str = ""
    """Its key's peer id (hex), from its signed card."""


@dataclasses.dataclass(frozen=True)
class ClockCheck:
    """What the entry peers' clocks say of ours."""

    skew: float | None
    """How far their clocks are ahead of ours, to keep from now on (None: keep ours)."""
    warning: str | None = None
    """Why the clock is worth a warning (None: it is within network jitter)."""
    refusal: str | None = None
    """Why the node must not start: its records would be refused (None: it may)."""


def low_median(values: Sequence[float]) -> float:
    """The median of ``values`` (not empty), the lower of the two middle ones when even."""
    return sorted(values)[(len(values) - 1) // 2]


def network_votes(offsets: Sequence[tuple[str, float]]) -> list[float]:
    """One clock offset per source network (``(network, offset)`` pairs in): the median of
    that network's, so that many keys on one network's addresses are one vote."""
    by_network: dict[str, list[float]] = {}
    for network, offset in offsets:
        by_network.setdefault(network, []).append(offset)
    return [low_median(o) for o in by_network.values()]


def check_clock(
    offsets: Sequence[float], *, config: DhtConfig, whose: str = "peer(s) it joined through"
) -> ClockCheck:
    """Compare our clock with the entry peers' (the median of their offsets, each taken at
    the middle of its ping): refuse to start when it is off by more than records tolerate;
    otherwise keep the swarm's time from now on, and warn when the difference is more than
    network jitter. ``whose``: what the offsets are of, for the messages."""
    if not offsets:
        return ClockCheck(None)
    skew = low_median(offsets)
    kept = skew if abs(skew) <= config.max_clock_skew_s else None
    if abs(skew) <= config.warn_clock_skew_s:
        return ClockCheck(kept)
    where = "behind" if skew > 0 else "ahead of"
    message = (
        f"this machine's clock is {abs(skew):.0f} s {where} the clock of the {len(offsets)} {whose}"
    )
    fix = (
        "set the clock right (enable NTP, e.g. `timedatectl set-ntp true`, or run "
        "chronyd or ntpd) and start again"
    )
    if kept is None:
        return ClockCheck(
            None,
            refusal=f"{message}: the swarm refuses records dated more than "
            f"{config.max_clock_skew_s:.0f} s off; {fix}",
        )
    return ClockCheck(
        kept,
        warning=f"{message}: this peer keeps the swarm's time from now on (its records and "
        f"progress are dated by it), but the machine's clock is wrong; {fix}",
    )


class EntryPeers:
    """The addresses a node joined through, and the pings that ask them."""

    def __init__(
        self,
        *,
        config: DhtConfig,
        transport: DhtTransport,
        book: ContactBook,
        local_clock: Callable[[], float],
        rng: random.Random,
    ) -> None:
        self._config = config
        self._transport = transport
        self._book = book
        self._local_clock = local_clock
        self._rng = rng
        self.endpoints: tuple[str, ...] = ()
        """Where the node last joined through (empty: it started the network)."""
        self.answered: dict[str, str] = {}
        """Address -> the peer id (hex) that answered there when the node last joined."""

    async def ask(
        self, peers: Sequence[str], request: pb.PingRequest, *, budget: float
    ) -> list[Answer]:
        """Ping every address at once; the answers of those that answered in time (their
        cards now in our table). Raises NetworkError naming every address and why it failed
        when none answers within ``budget`` seconds."""
        self.endpoints = tuple(peers)
        deadline = Deadline.after(budget)
        pings = [asyncio.ensure_future(self._ping(ep, request, deadline)) for ep in peers]
        try:
            pending: set[asyncio.Future[Answer | str]] = set(pings)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if any(isinstance(f.result(), Answer) for f in done):
                    break
            if pending:
                await asyncio.wait(pending, timeout=self._config.join_grace_s)
        finally:
            for ping in pings:
                ping.cancel()
        outcomes = [
            p.result() if p.done() and not p.cancelled() else "no answer in time" for p in pings
        ]
        answered = [o for o in outcomes if isinstance(o, Answer)]
        if answered:
            self.answered = {a.endpoint: a.peer_id for a in answered}
        if not answered:
            reasons = "; ".join(str(why) for why in outcomes)
            raise NetworkError(
                f"cannot join the network: none of {', '.join(peers)} answered within "
                f"{budget:g}s. Check the address, and that `swarmloco bootstrap` or a peer "
                f"runs there and is reachable from this machine. Last errors: {reasons}"
            )
        return answered

    async def _ping(
        self, endpoint: str, request: pb.PingRequest, deadline: Deadline
    ) -> Answer | str:
        """Ping until it answers or the join deadline passes (it may still be starting)."""
        pause = 0.1
        while True:
            call_deadline = Deadline.after(deadline.timeout(self._config.rpc_timeout_s))
            try:
                sent = self._local_clock()
                response = await self._transport.ping(endpoint, request, call_deadline)
                offset = self._offset(response, sent)
            except TlsMismatch as exc:
                return str(exc)  # asking again would get the same false certificate
            except NetworkError as exc:
                if deadline.remaining() <= pause:
                    return str(exc)
                await asyncio.sleep(pause * self._rng.uniform(0.5, 1.0))
                pause = min(2 * pause, 1.0)
                continue
            contact = self._book.card_from(response.peer, source=None)
            if contact is None:
                return "its contact card is invalid"
            self._book.seen(contact)
            return Answer(response, offset, endpoint, contact.peer_id.hex())

    def _offset(self, response: pb.PingResponse, sent: float) -> float:
        """How far a peer's clock is ahead of ours, by its answer to a ping ``sent`` at
        that local time (its time taken at the middle of the call)."""
        return response.time_ms / 1000 - (sent + self._local_clock()) / 2

    async def clocks(
        self, endpoints: Sequence[str], request: pb.PingRequest
    ) -> list[tuple[str, float]]:
        """Ping every address once, at once, within one call's deadline: how far the
        clock of each that answered is ahead of ours, with its address's source network."""
        deadline = Deadline.after(self._config.rpc_timeout_s)

        async def one(endpoint: str) -> tuple[str, float] | None:
            sent = self._local_clock()
            try:
                response = await self._transport.ping(endpoint, request, deadline)
            except NetworkError:
                return None
            if not response.time_ms:
                return None
            return endpoint_network(endpoint), self._offset(response, sent)

        answers = await asyncio.gather(*(one(e) for e in endpoints))
        return [a for a in answers if a is not None]
