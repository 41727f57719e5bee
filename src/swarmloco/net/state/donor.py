"""The donor side of state transfer: the ``swarmloco.v1.StateTransfer`` service of a peer.

A :class:`StateDonor` answers ``Download`` calls with whatever its snapshot provider
returns at that moment (the daemon passes a callable that returns the state of the last
committed round, or None before it holds one). Each answer is a header signed with the
peer's identity, bound to the request's nonce, then the raw chunks of the state. When the
request asks for another swarm, round or digest than the donor holds, the donor sends the
signed header alone: the requester learns why from a signed statement and moves on.

Limits, so that strangers cannot keep the state from the peers that need it: at most
``max_concurrent_downloads`` downloads are served at once, and ``max_downloads_per_network``
to one source network (a /24, a /64, or one loopback or private address: see
``endpoints.source_network``); more are refused at once with RESOURCE_EXHAUSTED, so the
requester asks another donor instead of waiting. A requester that takes no message for
``write_timeout_s`` is dropped, and so is one that reads slower than
``min_read_rate_bytes_s`` (a slow reader would hold its slot for as long as it likes). When
a request finds every slot taken, the download read slowest lately gives its slot up to it
if it was read slower than ``yield_below_bytes_s`` (a reader just above the minimum would
otherwise hold a slot for as long as a large state takes). One source network takes at
most ``budget_states`` whole states per ``budget_window_s`` (:class:`ByteBudget`), each
download charged whole when it starts (so starting downloads to keep slots costs a state
each); a request beyond that is refused with RESOURCE_EXHAUSTED, saying when to come
back. An optional shared
:class:`~swarmloco.net.averaging.limiter.BandwidthLimiter` caps the upload rate (the same
limiter as averaging's, so the peer's upload cap covers both). A malformed request is
refused with INVALID_ARGUMENT. In a private swarm, a request not signed by a member
(``net/admission.py``) is refused with PERMISSION_DENIED. Every refusal of a requester is
counted with its reason.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import math
import time
from collections.abc import Callable

import grpc

from swarmloco.core.config import require, require_int, require_positive
from swarmloco.core.state import StateSnapshot
from swarmloco.net.admission import Gate
from swarmloco.net.averaging.limiter import BandwidthLimiter
from swarmloco.net.endpoints import host_of_grpc_peer, is_loopback, source_network
from swarmloco.net.heap import release_after
from swarmloco.net.identity import Identity
from swarmloco.net.rejections import Rejection, RejectionLog
from swarmloco.net.server import Service, refuse
from swarmloco.net.state import wire
from swarmloco.proto.v1 import state_pb2 as pb

logger = logging.getLogger(__name__)

SnapshotProvider = Callable[[], StateSnapshot | None]
"""Returns the state to serve now, or None when the peer holds none yet."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DonorConfig:
    """How a peer serves its state to others."""

    chunk_bytes: int = 1024 * 1024
    """Bytes of state per chunk message, 4 KiB to 4 MiB (what requesters accept by
    default: see ``wire.ReceiveLimits``)."""
    max_concurrent_downloads: int = 2
    """Downloads served at once; further requests are refused with RESOURCE_EXHAUSTED."""
    max_downloads_per_network: int = 1
    """Downloads served at once to one source network (a /24 of IPv4, a /64 of IPv6, one
    loopback or private address), so one network cannot take every slot."""
    limit_loopback: bool = False
    """Apply ``max_downloads_per_network`` and the byte budget to loopback callers too
    (peers on this machine are its operator's own, e.g. a local swarm)."""
    write_timeout_s: float = 30.0
    """A requester that takes no message for this long is dropped (frees its slot)."""
    min_read_rate_bytes_s: float = 256 * 1024
    """A requester must take the state at least this fast: the time the donor's writes
    wait on it may not pass ``read_grace_s`` plus what it took at this rate, else it is
    cut off and its slot freed. Time the donor's own upload cap spends is not counted.
    Well below what requesters ask of a donor (``DownloadConfig.min_rate_bytes_s``)."""
    read_grace_s: float = 10.0
    """Waiting on a requester beyond its bytes at ``min_read_rate_bytes_s`` allowed in
    all (a slow start, a hiccup of either side); also how long a download is served before
    it may give its slot up to a newcomer."""
    yield_below_bytes_s: float = 1e6
    """When a request finds every slot taken, a download read slower than this over about
    the last ``yield_window_s`` (time in the donor's own upload cap not counted) gives its
    slot up to it: the slowest such, once served ``read_grace_s``. What requesters ask of a
    donor by default (``DownloadConfig.min_rate_bytes_s``)."""
    yield_window_s: float = 30.0
    """How far back the rate of ``yield_below_bytes_s`` looks (an average that forgets at
    this time constant: a fast start does not buy a slow hour)."""
    budget_states: float = 4.0
    """Whole states one source network may take per ``budget_window_s`` (what was served
    drains at that rate); a request it cannot afford is refused with RESOURCE_EXHAUSTED."""
    budget_window_s: float = 600.0
    """The window of ``budget_states``."""
    max_request_age_s: float = 600.0
    """Private swarms: a signed request made longer ago (or further ahead, by the
    requester's clock) is refused."""

    def __post_init__(self) -> None:
        limits = wire.ReceiveLimits()
        require_int("chunk_bytes", self.chunk_bytes, minimum=limits.min_chunk_bytes)
        require(
            self.chunk_bytes <= limits.max_chunk_bytes,
            f"chunk_bytes must be at most {limits.max_chunk_bytes} (requesters refuse larger "
            f"chunks), got {self.chunk_bytes}",
        )
        require_int("max_concurrent_downloads", self.max_concurrent_downloads, minimum=1)
        require_int("max_downloads_per_network", self.max_downloads_per_network, minimum=1)
        require_positive("write_timeout_s", self.write_timeout_s)
        require_positive("min_read_rate_bytes_s", self.min_read_rate_bytes_s)
        require_positive("read_grace_s", self.read_grace_s)
        require_positive("yield_below_bytes_s", self.yield_below_bytes_s)
        require_positive("yield_window_s", self.yield_window_s)
        require(
            self.budget_states >= 1,
            f"budget_states must be at least 1 (a whole state), got {self.budget_states}",
        )
        require_positive("budget_window_s", self.budget_window_s)
        require_positive("max_request_age_s", self.max_request_age_s)


class ByteBudget:
    """Bytes served per source network, as a bucket that drains.

    A network's level rises by every byte served to it and drains at ``capacity /
    window_s`` per second, so over any window it takes about ``capacity`` bytes (plus what
    drained meanwhile), however it spreads its requests. ``capacity`` is given at each call
    (whole states, so it follows the size of the state served). Pure: the clock is
    injected; at most ``max_networks`` are tracked (the emptiest forgotten first).
    """

    def __init__(
        self,
        *,
        window_s: float,
        clock: Callable[[], float] = time.monotonic,
        max_networks: int = 65_536,
    ) -> None:
        self.window_s = window_s
        self._clock = clock
        self._max_networks = max_networks
        self._levels: dict[str, tuple[float, float, float]] = {}
        """network -> (level in bytes, when, drain in bytes per second)."""

    def level(self, network: str) -> float:
        """Bytes still counted against ``network`` now."""
        entry = self._levels.get(network)
        if entry is None:
            return 0.0
        level, when, drain = entry
        return max(0.0, level - (self._clock() - when) * drain)

    def wait_s(self, network: str, nbytes: int, capacity: float) -> float:
        """Seconds until ``network`` can afford ``nbytes`` more (0: it can now)."""
        over = self.level(network) + nbytes - capacity
        if over <= 0 or capacity <= 0:  # affordable, or an empty state: nothing to spend
            return 0.0
        return over / (capacity / self.window_s)

    def charge(self, network: str, nbytes: int, capacity: float) -> None:
        if network not in self._levels and len(self._levels) >= self._max_networks:
            self._forget()
        level = self.level(network) + nbytes
        self._levels[network] = (level, self._clock(), capacity / self.window_s)

    def _forget(self) -> None:
        """Make room: drop the drained networks, and the emptiest quarter if that is not
        enough (at once, so a stream of new networks sorts once per quarter, not each)."""
        levels = {network: self.level(network) for network in self._levels}
        kept = sorted((n for n, level in levels.items() if level > 0), key=levels.__getitem__)
        if len(kept) >= self._max_networks:
            kept = kept[max(1, len(kept) // 4) :]
        self._levels = {network: self._levels[network] for network in kept}


@dataclasses.dataclass
class _Pace:
    """How long the writes to one requester waited on it, against what it took: in all,
    and lately (sums that decay at the time constant ``window_s``)."""

    grace_s: float
    min_rate: float
    window_s: float
    written: int = 0
    waited: float = 0.0
    recent_bytes: float = 0.0
    recent_wait: float = 0.0
    stamp: float = 0.0
    writing_since: float | None = None
    """When the write waiting on the requester now began (None: none is)."""

    def allowance(self, nbytes: int) -> float:
        """How long the next write of ``nbytes`` may wait on the requester, at most."""
        return self.grace_s + (self.written + nbytes) / self.min_rate - self.waited

    @property
    def rate(self) -> float:
        return self.written / self.waited if self.waited > 0 else float("inf")

    def wrote(self, nbytes: int, waited: float, now: float) -> None:
        decay = self._decay(now)
        self.recent_bytes = self.recent_bytes * decay + nbytes
        self.recent_wait = self.recent_wait * decay + waited
        self.stamp = now

    def recent_rate(self, now: float) -> float:
        """Bytes a second the requester took lately, the write in flight included."""
        decay = self._decay(now)
        wait = self.recent_wait * decay
        if self.writing_since is not None:
            wait += now - self.writing_since
        return self.recent_bytes * decay / wait if wait > 0 else float("inf")

    def _decay(self, now: float) -> float:
        return math.exp(-max(0.0, now - self.stamp) / self.window_s)


@dataclasses.dataclass(eq=False)
class _Download:
    """One download being served: it holds a slot until it ends or gives it up."""

    network: str
    """Its source network ("": not counted per network)."""
    started: float
    pace: _Pace
    write: asyncio.Timeout | None = None
    """The timeout of the write waiting on the requester now, if one is."""
    yielded: float | None = None
    """Its recent rate when it gave its slot up to a newcomer (None: it holds it)."""


class StateDonor:
    """Serves this peer's state. Constructing does no I/O; register :func:`state_service`."""

    def __init__(
        self,
        *,
        identity: Identity,
        snapshot: SnapshotProvider,
        previous: SnapshotProvider | None = None,
        config: DonorConfig | None = None,
        limiter: BandwidthLimiter | None = None,
        wall_clock: Callable[[], float] = time.time,
        admission: Gate | None = None,
    ) -> None:
        """``admission``: a private swarm's gate (only signed requests of members are
        served)."""
        self.identity = identity
        self.admission = admission
        self.config = config or DonorConfig()
        self.limiter = limiter
        self.rejections = RejectionLog(logger)
        self.stats: collections.Counter[str] = collections.Counter()
        """``served``, ``declined`` (header only), ``busy``, ``no-state``, ``dropped``,
        ``too-slow``, ``yielded``, ``budget-spent``, ``chunks``, ``bytes``."""
        self._snapshot = snapshot
        self._previous = previous
        self._wall_clock = wall_clock
        self._downloads: list[_Download] = []
        """The downloads holding a slot, oldest first."""
        self.budget = ByteBudget(window_s=self.config.budget_window_s)
        """Bytes served per source network, over ``budget_window_s``."""

    @property
    def active(self) -> int:
        """Downloads being served now."""
        return len(self._downloads)

    def yielding(self) -> int:
        """Downloads that would give their slot up to a newcomer now."""
        now = asyncio.get_running_loop().time()
        return sum(self._yields(d, now) for d in self._downloads)

    async def handle_download(self, data: bytes, context: grpc.aio.ServicerContext) -> None:
        """The ``Download`` handler (raw bytes in and out: ``wire.py`` encodes)."""
        admitted = await self._admit(data, context)
        if admitted is None:
            return
        request, host, network = admitted
        snapshot = _snapshot_for(request, self._snapshot(), self._previous)
        if snapshot is None:
            self.stats["no-state"] += 1
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "this peer holds no state to serve yet"
            )
            return
        charged = bool(network) and not _declined(request, snapshot)
        if charged:
            spent = self._budget_spent(network, snapshot)
            if spent is not None:
                self.stats["budget-spent"] += 1
                await self._refuse(context, spent, network)
                return
        # A request for another state (the header alone) costs nothing, so it takes no
        # other download's slot.
        download = self._take_slot(network, preempt=not _declined(request, snapshot))
        if download is None:
            self.stats["busy"] += 1
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this peer already serves {self.active} downloads; ask another donor",
            )
            return
        if charged:  # whole, now: a download dropped early costs its network the same
            capacity = self.config.budget_states * snapshot.nbytes
            self.budget.charge(network, snapshot.nbytes, capacity)
        try:
            await self._serve(snapshot, request, context, download)
            return
        except _Stalled:
            reason = "stalled"
        except _TooSlow:
            reason = "too-slow"
        except _Yielded:
            reason = "yielded"
        finally:
            if download in self._downloads:
                self._downloads.remove(download)
        # The slot is free already: the status waits behind the data the requester does
        # not read, and leaves when it reads, cancels or its deadline passes.
        await self._drop(context, reason, download, where=network or host)

    def _take_slot(self, network: str, *, preempt: bool) -> _Download | None:
        """A slot for a download from ``network``: a free one, or (``preempt``) the one the
        slowest download that may yield gives up (None: every slot is taken and kept)."""
        now = asyncio.get_running_loop().time()
        if len(self._downloads) >= self.config.max_concurrent_downloads:
            candidates = [d for d in self._downloads if preempt and self._yields(d, now)]
            if not candidates:
                return None
            victim = min(candidates, key=lambda d: d.pace.recent_rate(now))
            victim.yielded = victim.pace.recent_rate(now)
            self._downloads.remove(victim)
            if victim.write is not None and not victim.write.expired():
                victim.write.reschedule(now)  # the write waiting on it ends now
        pace = _Pace(
            self.config.read_grace_s,
            self.config.min_read_rate_bytes_s,
            self.config.yield_window_s,
            stamp=now,
        )
        download = _Download(network, now, pace)
        self._downloads.append(download)
        return download

    def _yields(self, download: _Download, now: float) -> bool:
        """Whether ``download`` gives its slot up to a newcomer now: served for
        ``read_grace_s`` and read slower than ``yield_below_bytes_s`` lately."""
        return (
            now - download.started >= self.config.read_grace_s
            and download.pace.recent_rate(now) < self.config.yield_below_bytes_s
        )

    async def _admit(
        self, data: bytes, context: grpc.aio.ServicerContext
    ) -> tuple[pb.DownloadRequest, str, str] | None:
        """The request, the requester's host and source network ("": not counted per
        network), if it is to be served; None once it was refused."""
        try:
            request = wire.decode_request(data)
        except Rejection as rejection:
            self.rejections.record(rejection, context.peer())
            release_after(len(data))
            # Not abort: it would keep the request (maybe megabytes) alive; see refuse.
            refuse(context, grpc.StatusCode.INVALID_ARGUMENT, rejection.reason)
            return None
        host = host_of_grpc_peer(context.peer())
        if self.admission is not None:
            try:
                wire.check_requester(
                    request,
                    self.admission,
                    now_ms=int(self._wall_clock() * 1000),
                    max_skew_ms=int(self.config.max_request_age_s * 1000),
                    network=source_network(host),
                )
            except Rejection as rejection:
                self.stats["refused"] += 1
                self.rejections.record(rejection, context.peer())
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, rejection.reason)
                return None
        network = source_network(host)
        if not self.config.limit_loopback and is_loopback(host):
            network = ""  # not counted per network
        held = sum(d.network == network for d in self._downloads) if network else 0
        if held >= self.config.max_downloads_per_network:
            self.stats["busy"] += 1
            await self._refuse(
                context,
                Rejection(
                    "too-many-downloads",
                    f"this peer already serves {held} download(s) to {network}; ask another donor",
                ),
                network,
            )
            return None
        return request, host, network

    def _budget_spent(self, network: str, snapshot: StateSnapshot) -> Rejection | None:
        """Why ``network`` may not take ``snapshot`` now (None: its budget affords it)."""
        capacity = self.config.budget_states * snapshot.nbytes
        wait = self.budget.wait_s(network, snapshot.nbytes, capacity)
        if wait <= 0:
            return None
        return Rejection(
            "budget-spent",
            f"{network} took {self.budget.level(network) / 1e6:.1f} MB of this "
            f"peer's state lately: {self.config.budget_states:g} whole states "
            f"per {self.config.budget_window_s:g}s is all one network gets; ask another "
            f"donor, or this one again in {wait:.0f}s",
        )

    async def _drop(
        self, context: grpc.aio.ServicerContext, reason: str, download: _Download, where: str
    ) -> None:
        """End a download whose requester did not read it: it took nothing for
        ``write_timeout_s`` (``stalled``), read slower than the minimum rate
        (``too-slow``), or gave its slot up to a newcomer (``yielded``)."""
        if reason == "yielded":
            self.stats["yielded"] += 1
            rate = download.yielded or 0.0
            await self._refuse(
                context,
                Rejection(
                    "yielded",
                    f"another requester asked while every slot was taken, and this download "
                    f"was read at {rate / 1024:.0f} KiB/s lately, under the "
                    f"{self.config.yield_below_bytes_s / 1024:.0f} KiB/s a slot is kept at "
                    "then; ask another donor, or this one later",
                ),
                where,
            )
            return
        pace = download.pace
        if reason == "stalled":
            self.stats["dropped"] += 1
            logger.info(
                "dropped the download of %s: it took nothing for %.1fs",
                context.peer(),
                self.config.write_timeout_s,
            )
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"the requester took nothing for {self.config.write_timeout_s}s",
            )
            return
        self.stats["too-slow"] += 1
        too_slow = Rejection(
            "too-slow",
            f"the download was read at {pace.rate / 1024:.0f} KiB/s, under this peer's "
            f"minimum of {self.config.min_read_rate_bytes_s / 1024:.0f} KiB/s",
        )
        await self._refuse(context, too_slow, where)

    async def _refuse(
        self, context: grpc.aio.ServicerContext, rejection: Rejection, network: str
    ) -> None:
        self.rejections.record(rejection, network or context.peer())
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, rejection.reason)

    async def _serve(
        self,
        snapshot: StateSnapshot,
        request: pb.DownloadRequest,
        context: grpc.aio.ServicerContext,
        download: _Download,
    ) -> None:
        chunk_bytes = self.config.chunk_bytes
        header = wire.sign_header(
            self.identity,
            snapshot,
            nonce=bytes(request.nonce),
            chunk_bytes=chunk_bytes,
            timestamp_ms=int(self._wall_clock() * 1000),
        )
        declined = _declined(request, snapshot)
        if declined:  # counted first: once the requester has the header, it is counted
            self.stats["declined"] += 1
        await self._write(context, wire.header_response(header), download)
        if declined:
            return  # the signed header says what we hold; the requester moves on
        chunks = enumerate(snapshot.chunks(chunk_bytes))
        while True:
            try:  # a state in a file is read as it is sent (see net/state/files.py)
                index, data = next(chunks)
            except StopIteration:
                break
            except OSError as exc:
                logger.warning("could not read the state of round %d: %s", snapshot.round, exc)
                self.stats["unreadable"] += 1
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the donor cannot read its state")
            message = wire.chunk_response(index, data)
            if self.limiter is not None:
                await self.limiter.upload(len(message))
            await self._write(context, message, download)
            self.stats["chunks"] += 1
            self.stats["bytes"] += len(data)
        self.stats["served"] += 1

    async def _write(
        self, context: grpc.aio.ServicerContext, message: bytes, download: _Download
    ) -> None:
        pace = download.pace
        if download.yielded is not None:
            raise _Yielded
        allowed = pace.allowance(len(message))
        wait = min(self.config.write_timeout_s, allowed)
        loop = asyncio.get_running_loop()
        started = pace.writing_since = loop.time()
        taken = 0
        try:
            async with asyncio.timeout(wait) as download.write:
                await context.write(message)
            taken = len(message)
        except TimeoutError:
            if download.yielded is not None:
                raise _Yielded from None
            raise (_Stalled if wait >= self.config.write_timeout_s else _TooSlow) from None
        finally:
            download.write = pace.writing_since = None
            now = loop.time()
            pace.waited += now - started
            pace.wrote(taken, now - started, now)
        pace.written += len(message)


def _snapshot_for(
    request: pb.DownloadRequest,
    current: StateSnapshot | None,
    previous: SnapshotProvider | None,
) -> StateSnapshot | None:
    """The state to answer ``request`` with: ours (None: we hold none yet), or, when it
    asks for the round before ours (we moved on while the requester decided), the previous
    snapshot if it is that state: it saves the requester a new search."""
    if current is None or not request.round or request.round == current.round:
        return current
    older = previous() if previous is not None else None
    if (
        older is not None
        and older.round == request.round
        and (not request.digest or older.digest == request.digest)
    ):
        return older
    return current


def _declined(request: pb.DownloadRequest, snapshot: StateSnapshot) -> bool:
    """Whether ``request`` asks for another state than ``snapshot`` (it gets the header)."""
    return (
        request.swarm_id != snapshot.swarm_id
        or (request.HasField("round") and request.round != snapshot.round)
        or bool(request.digest and bytes(request.digest) != snapshot.digest)
    )


class _Stalled(Exception):
    """The requester took no message for ``write_timeout_s``."""


class _TooSlow(Exception):
    """The requester took the state slower than ``min_read_rate_bytes_s``."""


class _Yielded(Exception):
    """The download gave its slot up to a newcomer."""


def state_service(donor: StateDonor) -> Service:
    """The ``swarmloco.v1.StateTransfer`` service served by ``donor``."""
    handler = grpc.unary_stream_rpc_method_handler(donor.handle_download)
    generic = grpc.method_handlers_generic_handler(wire.SERVICE_NAME, {"Download": handler})
    return Service(wire.SERVICE_NAME, lambda server: server.add_generic_rpc_handlers((generic,)))
