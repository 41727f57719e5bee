"""Peers as a source of a pinned dataset: the ``swarmloco.v1.DatasetFiles`` service a peer
serves the dataset files it holds with, and the reader a joining peer fetches them with
(``docs/DESIGN.md`` section 11).

The server answers ``Read(dataset id, file name)`` with the file in chunks, from the
directories that hold that dataset on this peer (its cache, its local copy), and only the
dataset's own files (``index.json``, ``tokenizer.json``, ``shard-NNNNN.bin``). Limits, so
that strangers cannot keep the data from the peers that need it (as state transfer's):
``max_concurrent_reads`` at once, ``max_reads_per_network`` to one source network, and a
byte budget per network over ``budget_window_s``; more is refused with RESOURCE_EXHAUSTED
at once, so the reader asks another peer. A reader that takes no chunk for
``write_timeout_s`` is dropped. The reader trusts nothing it gets: ``fetch.py`` checks the
index against the dataset id and every file against the index's hash.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import grpc

from swarmloco.core.config import require_int, require_positive
from swarmloco.dataset.fetch import Source
from swarmloco.dataset.index import INDEX, TOKENIZER
from swarmloco.net.client import RpcClient
from swarmloco.net.endpoints import host_of_grpc_peer, is_loopback, source_network
from swarmloco.net.identity import Identity
from swarmloco.net.node import NetNode, NodeConfig
from swarmloco.net.rejections import Rejection, RejectionLog
from swarmloco.net.server import Service, decoder, refuse
from swarmloco.net.state.donor import ByteBudget
from swarmloco.net.swarm import find_peers
from swarmloco.proto.v1 import dataset_pb2 as pb
from swarmloco.runtime.loop_thread import LoopThread

logger = logging.getLogger(__name__)

SERVICE_NAME = "swarmloco.v1.DatasetFiles"
READ_PATH = f"/{SERVICE_NAME}/Read"
_NAME = re.compile(rf"^({re.escape(INDEX)}|{re.escape(TOKENIZER)}|shard-\d{{5,}}\.bin)$")
_DATASET_ID = re.compile(r"^[0-9a-f]{40}$")
Holdings = Callable[[str], Sequence[Path]]
"""The directories that hold a dataset on this peer (none: it holds nothing of it)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class FilesConfig:
    """How a peer serves its dataset files to others."""

    chunk_bytes: int = 1 << 20
    """Bytes of a file per chunk message."""
    max_concurrent_reads: int = 4
    """Files served at once; more are refused with RESOURCE_EXHAUSTED."""
    max_reads_per_network: int = 1
    """Files served at once to one source network (a /24, a /64, one loopback or private
    address)."""
    limit_loopback: bool = False
    """Count loopback readers per network too (peers on this machine are its operator's)."""
    write_timeout_s: float = 30.0
    """A reader that takes no chunk for this long is dropped."""
    budget_bytes: float = 4 << 30
    """Bytes one source network may take per ``budget_window_s``."""
    budget_window_s: float = 600.0

    def __post_init__(self) -> None:
        require_int("chunk_bytes", self.chunk_bytes, minimum=4096)
        require_int("max_concurrent_reads", self.max_concurrent_reads, minimum=1)
        require_int("max_reads_per_network", self.max_reads_per_network, minimum=1)
        require_positive("write_timeout_s", self.write_timeout_s)
        require_positive("budget_bytes", self.budget_bytes)
        require_positive("budget_window_s", self.budget_window_s)


class FileServer:
    """Serves this peer's dataset files. Constructing does no I/O; register :meth:`service`."""

    def __init__(
        self,
        holdings: Holdings,
        *,
        rejections: RejectionLog,
        config: FilesConfig | None = None,
    ) -> None:
        self.holdings = holdings
        self.rejections = rejections
        self.config = config or FilesConfig()
        self.budget = ByteBudget(window_s=self.config.budget_window_s)
        self._active = 0
        self._per_network: collections.Counter[str] = collections.Counter()
        self.served_bytes = 0

    def service(self) -> Service:
        handler = grpc.unary_stream_rpc_method_handler(
            self.handle_read,
            request_deserializer=decoder(pb.FileRequest),
            response_serializer=pb.FileChunk.SerializeToString,
        )
        generic = grpc.method_handlers_generic_handler(SERVICE_NAME, {"Read": handler})
        return Service(SERVICE_NAME, lambda server: server.add_generic_rpc_handlers((generic,)))

    async def handle_read(self, request: object, context: grpc.aio.ServicerContext) -> None:
        """The ``Read`` handler: the file in chunks, or a refusal with its reason."""
        path = self._file(request, context)
        if path is None:
            return
        host = host_of_grpc_peer(context.peer())
        counted = self.config.limit_loopback or not is_loopback(host)
        network = source_network(host) if counted else ""  # "": not counted per network
        size = path.stat().st_size
        refusal = self._busy(network, size)
        if refusal is not None:
            self.rejections.record(refusal, context.peer())
            refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED, refusal.reason)
            return
        self._active += 1
        self._per_network[network] += 1
        try:
            await self._stream(path, size, network, context)
        finally:
            self._active -= 1
            self._per_network[network] -= 1
            if self._per_network[network] <= 0:
                del self._per_network[network]

    def _file(self, request: object, context: grpc.aio.ServicerContext) -> Path | None:
        if (
            not isinstance(request, pb.FileRequest)
            or not _DATASET_ID.match(request.dataset_id)
            or not _NAME.match(request.name)
        ):
            rejection = Rejection("malformed", "not a request for a dataset's file")
            self.rejections.record(rejection, context.peer())
            refuse(context, grpc.StatusCode.INVALID_ARGUMENT, rejection.reason)
            return None
        for directory in self.holdings(request.dataset_id):
            path = directory / request.name
            if path.is_file():
                return path
        refuse(context, grpc.StatusCode.NOT_FOUND, "this peer does not hold that file")
        return None

    def _busy(self, network: str, size: int) -> Rejection | None:
        config = self.config
        if self._active >= config.max_concurrent_reads:
            return Rejection("busy", f"this peer already serves {self._active} files")
        if network and self._per_network[network] >= config.max_reads_per_network:
            return Rejection("busy", f"this peer already serves a file to {network}")
        if network:
            wait = self.budget.wait_s(network, size, config.budget_bytes)
            if wait > 0:
                return Rejection(
                    "budget-spent",
                    f"{network} took its share of this peer's data lately; ask another peer, "
                    f"or this one again in {wait:.0f}s",
                )
        return None

    async def _stream(
        self, path: Path, size: int, network: str, context: grpc.aio.ServicerContext
    ) -> None:
        chunk = self.config.chunk_bytes
        with path.open("rb") as f:
            first = True
            while True:
                data = await asyncio.to_thread(f.read, chunk)
                if not data and not first:
                    return
                message = pb.FileChunk(total_bytes=size if first else 0, data=data)
                try:
                    await asyncio.wait_for(context.write(message), self.config.write_timeout_s)
                except TimeoutError:
                    refuse(context, grpc.StatusCode.DEADLINE_EXCEEDED, "the reader stalled")
                    return
                if network:
                    self.budget.charge(network, len(data), self.config.budget_bytes)
                self.served_bytes += len(data)
                first = False
                if not data:
                    return


async def read_file(
    client: RpcClient, endpoint: str, dataset_id: str, name: str, limit: int, timeout_s: float
) -> bytes:
    """The file ``name`` of ``dataset_id`` from the peer at ``endpoint`` (at most ``limit``
    bytes); OSError saying why when it is not had whole."""
    try:
        channel = await client.open(endpoint, timeout_s)
        with client.holding(channel):  # no await since open: the cache keeps it open
            method = channel.unary_stream(
                READ_PATH,
                request_serializer=pb.FileRequest.SerializeToString,
                response_deserializer=pb.FileChunk.FromString,
            )
            call = method(pb.FileRequest(dataset_id=dataset_id, name=name), timeout=timeout_s)
            parts: list[bytes] = []
            total = received = -1
            async for message in call:
                if total < 0:
                    total, received = message.total_bytes, 0
                    if total > limit:
                        call.cancel()
                        raise OSError(
                            f"{endpoint} offers {total:,} bytes of {name}, over {limit:,}"
                        )
                received += len(message.data)
                if received > total:
                    call.cancel()
                    raise OSError(f"{endpoint} sent more of {name} than it announced")
                parts.append(message.data)
    except grpc.aio.AioRpcError as exc:
        raise OSError(f"{endpoint}: {exc.code().name}: {exc.details()}") from None
    except Exception as exc:  # an RpcError of ours, a broken stream
        if isinstance(exc, OSError):
            raise
        raise OSError(f"{endpoint}: {exc}") from None
    if received != total:
        raise OSError(f"{endpoint} ended {name} at {max(received, 0):,} of {total:,} bytes")
    return b"".join(parts)


@dataclasses.dataclass(frozen=True)
class PeerSource:
    """A peer that may hold the dataset's files (``fetch.Source``)."""

    endpoint: str
    dataset_id: str
    reader: PeerReader

    def read(self, name: str, limit: int) -> bytes:
        return self.reader.read(self.endpoint, self.dataset_id, name, limit)

    def __str__(self) -> str:
        return f"peer {self.endpoint}"


class PeerReader:
    """A client-only node of the swarm's network on a thread of its own: finds the
    swarm's peers and reads files from them. ``with`` starts and stops it."""

    def __init__(self, peers: Sequence[str], *, timeout_s: float = 60.0) -> None:
        self.peers = tuple(peers)
        self.timeout_s = timeout_s
        self._loop = LoopThread(name="swarmloco-dataset-reader")
        self._node: NetNode | None = None

    def __enter__(self) -> PeerReader:
        self._loop.start()
        node = NetNode(
            identity=Identity.generate(), config=NodeConfig(server=None, peers=self.peers)
        )
        try:
            self._loop.run(node.__aenter__(), timeout=self.timeout_s)
        except BaseException:
            self._loop.stop()
            raise
        self._node = node
        return self

    def __exit__(self, *exc: object) -> None:
        if self._node is not None:
            with contextlib.suppress(Exception):
                self._loop.run(self._node.__aexit__(None, None, None), timeout=self.timeout_s)
        self._loop.stop()

    def sources(self, swarm_id: str, dataset_id: str) -> list[Source]:
        """The serving peers of ``swarm_id``, as sources of ``dataset_id``."""
        assert self._node is not None
        found = self._loop.run(find_peers(self._node.dht, swarm_id), timeout=self.timeout_s)
        return [PeerSource(p.endpoint, dataset_id, self) for p in found if p.endpoint]

    def read(self, endpoint: str, dataset_id: str, name: str, limit: int) -> bytes:
        assert self._node is not None
        # A shard's bytes at a modest floor rate, beyond a fixed allowance.
        timeout = self.timeout_s + limit / (1 << 20)
        coro = read_file(self._node.client, endpoint, dataset_id, name, limit, timeout)
        try:
            return self._loop.run(coro, timeout=timeout + 5)
        except TimeoutError:
            raise OSError(f"{endpoint}: no whole {name} within {timeout:.0f}s") from None


def holdings_in(directories: Sequence[Path], cache: Path) -> Holdings:
    """Where this peer holds dataset ``ID``: ``cache/ID`` and each local copy of that
    dataset (a directory whose index is that dataset's)."""
    from swarmloco.dataset.index import read_index
    from swarmloco.errors import DataError

    copies: dict[str, list[Path]] = collections.defaultdict(list)
    for directory in directories:
        with contextlib.suppress(DataError):
            copies[read_index(directory).dataset_id].append(directory)

    def holds(dataset_id: str) -> Iterator[Path]:
        yield from copies.get(dataset_id, [])
        if (cache / dataset_id).is_dir():
            yield cache / dataset_id

    return lambda dataset_id: list(holds(dataset_id))
