"""The donor side of state transfer: the ``swarmloco.v1.StateTransfer`` service of a peer.

A :class:`StateDonor` answers ``Download`` calls with whatever its snapshot provider
returns at that moment (the daemon passes a callable that returns the state of the last
committed round, or None before it holds one). Each answer is a header signed with the
peer's identity, bound to the request's nonce, then the raw chunks of the state. When the
request asks for another swarm, round or digest than the donor holds, the donor sends the
signed header alone: the requester learns why from a signed statement and moves on.

Limits: at most ``max_concurrent_downloads`` downloads are served at once (more are refused
at once with RESOURCE_EXHAUSTED, so the requester asks another donor instead of waiting);
a requester that takes no chunk for ``write_timeout_s`` is dropped; an optional shared
:class:`~swarmloco.net.averaging.limiter.BandwidthLimiter` caps the upload rate (the same
limiter as averaging's, so the peer's upload cap covers both). A malformed request is
refused with INVALID_ARGUMENT and counted. In a private swarm, a request not signed by a
member (``net/admission.py``) is refused with PERMISSION_DENIED.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import ipaddress
import logging
import time
from collections.abc import Callable

import grpc

from swarmloco.core.config import require, require_int, require_positive
from swarmloco.core.state import StateSnapshot
from swarmloco.net.admission import Admission
from swarmloco.net.averaging.limiter import BandwidthLimiter
from swarmloco.net.endpoints import host_of_grpc_peer
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
    max_downloads_per_host: int = 1
    """Downloads served at once to one IP address, so one host cannot take every slot."""
    limit_loopback: bool = False
    """Apply ``max_downloads_per_host`` to loopback callers too (peers on this machine
    are its operator's own, e.g. a local swarm)."""
    write_timeout_s: float = 30.0
    """A requester that takes no message for this long is dropped (frees its slot)."""
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
        require_int("max_downloads_per_host", self.max_downloads_per_host, minimum=1)
        require_positive("write_timeout_s", self.write_timeout_s)
        require_positive("max_request_age_s", self.max_request_age_s)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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
        admission: Admission | None = None,
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
        ``chunks``, ``bytes``."""
        self._snapshot = snapshot
        self._previous = previous
        self._wall_clock = wall_clock
        self._active = 0
        self._per_host: collections.Counter[str] = collections.Counter()

    @property
    def active(self) -> int:
        """Downloads being served now."""
        return self._active

    async def handle_download(self, data: bytes, context: grpc.aio.ServicerContext) -> None:
        """The ``Download`` handler (raw bytes in and out: ``wire.py`` encodes)."""
        try:
            request = wire.decode_request(data)
        except Rejection as rejection:
            self.rejections.record(rejection, context.peer())
            release_after(len(data))
            # Not abort: it would keep the request (maybe megabytes) alive; see refuse.
            refuse(context, grpc.StatusCode.INVALID_ARGUMENT, rejection.reason)
            return
        if self.admission is not None:
            try:
                wire.check_requester(
                    request,
                    self.admission,
                    now_ms=int(self._wall_clock() * 1000),
                    max_skew_ms=int(self.config.max_request_age_s * 1000),
                )
            except Rejection as rejection:
                self.stats["refused"] += 1
                self.rejections.record(rejection, context.peer())
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, rejection.reason)
                return
        if self._active >= self.config.max_concurrent_downloads:
            self.stats["busy"] += 1
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this peer already serves {self._active} downloads; ask another donor",
            )
            return
        host = host_of_grpc_peer(context.peer())
        if not self.config.limit_loopback and _is_loopback(host):
            host = ""  # not counted per host
        if host and self._per_host[host] >= self.config.max_downloads_per_host:
            self.stats["busy"] += 1
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this peer already serves {self._per_host[host]} download(s) to {host}; "
                "ask another donor",
            )
            return
        snapshot = self._snapshot()
        if snapshot is not None and request.round and request.round != snapshot.round:
            # Asked for the round before ours (we moved on while the requester decided):
            # the previous snapshot, if it is that state, saves it a new search.
            older = self._previous() if self._previous is not None else None
            if (
                older is not None
                and older.round == request.round
                and (not request.digest or older.digest == request.digest)
            ):
                snapshot = older
        if snapshot is None:
            self.stats["no-state"] += 1
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "this peer holds no state to serve yet"
            )
            return
        self._active += 1
        self._per_host[host] += 1
        try:
            await self._serve(snapshot, request, context)
        except _Stalled:
            stalled = True
        else:
            stalled = False
        finally:
            self._active -= 1
            self._per_host[host] -= 1
            if self._per_host[host] <= 0:
                del self._per_host[host]
        if stalled:
            # The slot is free already: the status waits behind the data the requester
            # does not read, and leaves when it reads, cancels or its deadline passes.
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

    async def _serve(
        self,
        snapshot: StateSnapshot,
        request: pb.DownloadRequest,
        context: grpc.aio.ServicerContext,
    ) -> None:
        chunk_bytes = self.config.chunk_bytes
        header = wire.sign_header(
            self.identity,
            snapshot,
            nonce=bytes(request.nonce),
            chunk_bytes=chunk_bytes,
            timestamp_ms=int(self._wall_clock() * 1000),
        )
        await self._write(context, wire.header_response(header))
        if (
            request.swarm_id != snapshot.swarm_id
            or (request.HasField("round") and request.round != snapshot.round)
            or (request.digest and bytes(request.digest) != snapshot.digest)
        ):
            self.stats["declined"] += 1
            return  # the signed header says what we hold; the requester moves on
        for index, data in enumerate(wire.state_chunks(snapshot.tensors, chunk_bytes)):
            message = wire.chunk_response(index, data)
            if self.limiter is not None:
                await self.limiter.upload(len(message))
            await self._write(context, message)
            self.stats["chunks"] += 1
            self.stats["bytes"] += len(data)
        self.stats["served"] += 1

    async def _write(self, context: grpc.aio.ServicerContext, message: bytes) -> None:
        try:
            async with asyncio.timeout(self.config.write_timeout_s):
                await context.write(message)
        except TimeoutError:
            raise _Stalled from None


class _Stalled(Exception):
    """The requester took no message for ``write_timeout_s``."""


def state_service(donor: StateDonor) -> Service:
    """The ``swarmloco.v1.StateTransfer`` service served by ``donor``."""
    handler = grpc.unary_stream_rpc_method_handler(donor.handle_download)
    generic = grpc.method_handlers_generic_handler(wire.SERVICE_NAME, {"Download": handler})
    return Service(wire.SERVICE_NAME, lambda server: server.add_generic_rpc_handlers((generic,)))
