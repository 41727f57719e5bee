"""The bytes of a state download: the signed header, the chunks, and their checks (pure).

A ``Download`` stream (``proto/swarmloco/v1/state.proto``) is a :class:`StateHeader`
signed by the donor, then the concatenated raw bytes of the state's tensors in the
header's order, cut into chunks of ``header.chunk_bytes`` (the last one shorter). The donor
builds the header with :func:`sign_header` and reads the chunks off its snapshot
(``StateSnapshot.chunks``); the requester checks the header with :func:`check_header` and
feeds the chunks to a :class:`StateAssembler`, which checks each chunk's index and size as
it arrives, writes it into a sink (new tensors, or a file: ``files.py``) and hashes it, and
at the end compares the digest.

Everything here raises :class:`~swarmloco.net.rejections.Rejection` with a short code on
bad input; nothing does I/O but the sink it is given.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import msgpack

from swarmloco.core.config import require_int
from swarmloco.core.state import (
    DIGEST_BYTES,
    DTYPES,
    MemorySource,
    StateHasher,
    StateSchema,
    StateSnapshot,
    StateSource,
    TensorSpec,
    check_name,
    raw_bytes,
)
from swarmloco.net.identity import (
    PUBLIC_KEY_BYTES,
    SIGNATURE_BYTES,
    Identity,
    peer_id_of,
    verify,
)
from swarmloco.net.rejections import Rejection
from swarmloco.proto.v1 import state_pb2 as pb

if TYPE_CHECKING:
    from swarmloco.net.admission import Gate

SERVICE_NAME = "swarmloco.v1.StateTransfer"
DOWNLOAD_PATH = f"/{SERVICE_NAME}/Download"
HEADER_DOMAIN = b"swarmloco/v1/state-header\x00"
REQUEST_DOMAIN = b"swarmloco/v1/download-request\x00"
NONCE_BYTES = 16
MAX_NONCE_BYTES = 64
MAX_REQUEST_BYTES = 1024
CHUNK_OVERHEAD_BYTES = 32
"""Protobuf framing around a chunk's data, at most (field keys and varints)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReceiveLimits:
    """What a requester accepts from a donor before it knows the donor is honest."""

    max_state_bytes: int = 16 * 1024**3
    """Largest state (sum of the tensors' bytes) accepted without a schema: a state of the
    schema's layout is as large as the requester's own, and is taken whatever its size."""
    max_tensors: int = 64
    """Most tensors a state may hold."""
    min_chunk_bytes: int = 4096
    """Smallest chunk a donor may cut the state into (tiny chunks waste the receiver's CPU)."""
    max_chunk_bytes: int = 4 * 1024 * 1024
    """Largest chunk a donor may send (must fit in a gRPC message)."""
    max_header_bytes: int = 64 * 1024
    """Largest header message."""

    def __post_init__(self) -> None:
        require_int("max_state_bytes", self.max_state_bytes, minimum=0)
        require_int("max_tensors", self.max_tensors, minimum=1)
        require_int("min_chunk_bytes", self.min_chunk_bytes, minimum=1)
        require_int("max_chunk_bytes", self.max_chunk_bytes, minimum=self.min_chunk_bytes)
        require_int("max_header_bytes", self.max_header_bytes, minimum=1024)


# -- requests --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Requester:
    """Who signs download requests, in a private swarm: the peer's key and certificate."""

    identity: Identity
    membership: bytes = b""
    clock: Callable[[], float] = time.time


def _request_payload(request: pb.DownloadRequest) -> bytes:
    return msgpack.packb(
        [
            request.swarm_id,
            bytes(request.nonce),
            request.round if request.HasField("round") else None,
            bytes(request.digest),
            request.timestamp_ms,
        ],
        use_bin_type=True,
    )


def encode_request(
    *,
    swarm_id: str,
    nonce: bytes,
    round: int | None = None,
    digest: bytes | None = None,
    requester: Requester | None = None,
) -> bytes:
    """A download request; signed, with a membership certificate, when ``requester`` is
    given (a private swarm's donors serve nothing else)."""
    request = pb.DownloadRequest(swarm_id=swarm_id, nonce=nonce, digest=digest or b"")
    if round is not None:
        request.round = round
    if requester is not None:
        request.public_key = requester.identity.public_key
        request.membership = requester.membership
        request.timestamp_ms = int(requester.clock() * 1000)
        request.signature = requester.identity.sign(REQUEST_DOMAIN, _request_payload(request))
    return request.SerializeToString()


def check_requester(
    request: pb.DownloadRequest,
    admission: Gate,
    *,
    now_ms: int,
    max_skew_ms: int,
    network: str = "",
) -> str:
    """The hex peer id of the member who signed ``request``; Rejection (``not-admitted``,
    ``bad-signature`` or ``stale``) if it is not a recent request signed by a member. The
    credential is checked last, for the requester's source ``network``."""
    if not request.public_key or not request.signature:
        raise Rejection(
            "not-admitted",
            "this swarm serves its state to the keys it admits only (a member's certificate, "
            "or a proof of work): a download request must be signed by one",
        )
    if abs(now_ms - request.timestamp_ms) > max_skew_ms:
        raise Rejection("stale", "the download request was signed too long ago (or ahead)")
    if not verify(request.public_key, request.signature, REQUEST_DOMAIN, _request_payload(request)):
        raise Rejection("bad-signature", "the download request's signature does not match")
    peer_id = peer_id_of(bytes(request.public_key)).hex()
    admission.check(peer_id, bytes(request.membership), network=network)
    return peer_id


def decode_request(data: bytes) -> pb.DownloadRequest:
    """A request from the network, checked for shape; Rejection("malformed") otherwise."""
    if len(data) > MAX_REQUEST_BYTES:
        raise Rejection("malformed", f"a download request of {len(data)} bytes is too large")
    try:
        request = pb.DownloadRequest.FromString(data)
    except Exception:  # any parse failure of untrusted bytes means "malformed"
        raise Rejection("malformed", "the request is not a valid DownloadRequest") from None
    if not NONCE_BYTES <= len(request.nonce) <= MAX_NONCE_BYTES:
        raise Rejection(
            "malformed",
            f"the request nonce has {len(request.nonce)} bytes, not {NONCE_BYTES} to "
            f"{MAX_NONCE_BYTES}",
        )
    if request.digest and len(request.digest) != DIGEST_BYTES:
        raise Rejection("malformed", f"the requested digest is not {DIGEST_BYTES} bytes")
    return request


# -- the header ------------------------------------------------------------------------------


def header_payload(header: pb.StateHeader) -> bytes:
    """What the donor signs: every field of the header but the signature."""
    return msgpack.packb(
        [
            bytes(header.public_key),
            header.swarm_id,
            header.round,
            [[t.name, t.dtype, t.numel] for t in header.tensors],
            header.total_bytes,
            header.chunk_bytes,
            bytes(header.digest),
            header.timestamp_ms,
            bytes(header.nonce),
        ],
        use_bin_type=True,
    )


def sign_header(
    identity: Identity,
    snapshot: StateSnapshot,
    *,
    nonce: bytes,
    chunk_bytes: int,
    timestamp_ms: int,
) -> pb.StateHeader:
    """The donor's signed header for ``snapshot``, answering the request of ``nonce``."""
    specs = snapshot.specs
    header = pb.StateHeader(
        public_key=identity.public_key,
        swarm_id=snapshot.swarm_id,
        round=snapshot.round,
        tensors=[pb.TensorInfo(name=s.name, dtype=s.dtype, numel=s.numel) for s in specs],
        total_bytes=sum(s.nbytes for s in specs),
        chunk_bytes=chunk_bytes,
        digest=snapshot.digest,
        timestamp_ms=timestamp_ms,
        nonce=nonce,
    )
    header.signature = identity.sign(HEADER_DOMAIN, header_payload(header))
    return header


@dataclasses.dataclass(frozen=True)
class CheckedHeader:
    """A header that passed :func:`check_header`: what the stream that follows must hold."""

    swarm_id: str
    round: int
    specs: tuple[TensorSpec, ...]
    total_bytes: int
    chunk_bytes: int
    digest: bytes
    timestamp_ms: int

    @property
    def chunks(self) -> int:
        return chunk_count(self.total_bytes, self.chunk_bytes)


def check_header(
    header: pb.StateHeader,
    *,
    peer_id: str,
    nonce: bytes,
    swarm_id: str,
    round: int | None = None,
    digest: bytes | None = None,
    schema: StateSchema | None = None,
    limits: ReceiveLimits,
) -> CheckedHeader:
    """Check a donor's header against the request and the donor's identity.

    ``peer_id`` (hex) is who we asked: the header must be signed by that peer's key.
    ``round``/``digest``/``schema``: what we want (None: anything). Raises Rejection with
    the reason, whose code says which check failed.

    The timestamp is not checked: the nonce already binds the header to this request (a
    replayed header fails), and the clocks of volunteers' machines disagree.
    """
    if bytes(header.nonce) != nonce:
        raise Rejection("replayed", "the header answers another request (its nonce differs)")
    if len(header.public_key) != PUBLIC_KEY_BYTES or len(header.signature) != SIGNATURE_BYTES:
        raise Rejection("bad-header", "the header carries no valid public key or signature")
    signer = peer_id_of(bytes(header.public_key)).hex()
    if signer != peer_id:
        raise Rejection(
            "wrong-donor", f"the header is signed by peer {signer[:12]}, not by {peer_id[:12]}"
        )
    if not verify(header.public_key, header.signature, HEADER_DOMAIN, header_payload(header)):
        raise Rejection("bad-signature", "the header's signature does not match the donor's key")
    if header.swarm_id != swarm_id:
        raise Rejection(
            "wrong-swarm",
            f"the donor serves swarm {header.swarm_id[:40]!r}, not {swarm_id}",
        )
    if round is not None and header.round != round:
        raise Rejection("wrong-round", f"the donor holds round {header.round}, not {round}")
    if len(header.digest) != DIGEST_BYTES:
        raise Rejection("bad-header", f"the header's digest is not {DIGEST_BYTES} bytes")
    if digest is not None and bytes(header.digest) != digest:
        raise Rejection(
            "wrong-digest",
            f"the donor's round-{header.round} state has digest {header.digest.hex()[:16]}, "
            f"not the expected {digest.hex()[:16]}",
        )
    specs = _check_layout(header, limits)
    if schema is not None:
        problem = schema.mismatch(specs)
        if problem:
            raise Rejection("bad-layout", f"the donor's state does not fit: {problem}")
    elif header.total_bytes > limits.max_state_bytes:
        # (A state of the schema's layout is the requester's own size, whatever the cap:
        # a run of any size downloads; the cap bounds what a layout nobody asked for costs.)
        raise Rejection(
            "too-large",
            f"the state has {header.total_bytes} bytes, > {limits.max_state_bytes} accepted",
        )
    return CheckedHeader(
        swarm_id=header.swarm_id,
        round=header.round,
        specs=specs,
        total_bytes=header.total_bytes,
        chunk_bytes=header.chunk_bytes,
        digest=bytes(header.digest),
        timestamp_ms=header.timestamp_ms,
    )


def _check_layout(header: pb.StateHeader, limits: ReceiveLimits) -> tuple[TensorSpec, ...]:
    if len(header.tensors) > limits.max_tensors:
        raise Rejection(
            "too-large", f"the state has {len(header.tensors)} tensors, > {limits.max_tensors}"
        )
    specs = []
    for info in header.tensors:
        problem = check_name(info.name)
        if problem:
            raise Rejection("bad-layout", problem)
        if info.dtype not in DTYPES:
            raise Rejection("bad-layout", f"tensor {info.name} has unknown dtype {info.dtype!r}")
        specs.append(TensorSpec(info.name, info.dtype, info.numel))
    names = [s.name for s in specs]
    if names != sorted(set(names)):
        raise Rejection("bad-layout", "the tensors are not named once each, in sorted order")
    total = sum(s.nbytes for s in specs)
    if total != header.total_bytes:
        raise Rejection(
            "bad-layout",
            f"the header says {header.total_bytes} bytes, its tensors make {total}",
        )
    if not limits.min_chunk_bytes <= header.chunk_bytes <= limits.max_chunk_bytes:
        raise Rejection(
            "bad-layout",
            f"chunks of {header.chunk_bytes} bytes are outside "
            f"[{limits.min_chunk_bytes}, {limits.max_chunk_bytes}]",
        )
    return tuple(specs)


# -- responses -------------------------------------------------------------------------------


def header_response(header: pb.StateHeader) -> bytes:
    return pb.DownloadResponse(header=header).SerializeToString()


def chunk_response(index: int, data: bytes | memoryview) -> bytes:
    return pb.DownloadResponse(
        chunk=pb.StateChunk(index=index, data=bytes(data))
    ).SerializeToString()


def decode_response(data: bytes) -> pb.DownloadResponse:
    try:
        return pb.DownloadResponse.FromString(data)
    except Exception:  # any parse failure of untrusted bytes means "malformed"
        raise Rejection("malformed", "the donor sent bytes that are no DownloadResponse") from None


# -- chunks ----------------------------------------------------------------------------------


def chunk_count(total_bytes: int, chunk_bytes: int) -> int:
    return -(-total_bytes // chunk_bytes)


class StateSink(Protocol):
    """Where an assembler writes a state's bytes: in memory, or a file (``files.py``)."""

    def write(self, offset: int, data: bytes | memoryview) -> None: ...

    def source(self) -> StateSource: ...

    def discard(self) -> None: ...


class MemorySink:
    """New tensors of the header's specs, filled in place."""

    def __init__(self, specs: tuple[TensorSpec, ...]) -> None:
        self.tensors = [spec.empty() for spec in specs]
        self._source = MemorySource(self.tensors)
        self._raws = [raw_bytes(t) for t in self.tensors]
        self._starts = [0]
        for raw in self._raws:
            self._starts.append(self._starts[-1] + len(raw))

    def write(self, offset: int, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        i = 0
        while view:
            while self._starts[i + 1] <= offset:
                i += 1
            at = offset - self._starts[i]
            take = min(len(view), len(self._raws[i]) - at)
            self._raws[i][at : at + take] = view[:take]
            view, offset = view[take:], offset + take

    def source(self) -> StateSource:
        return self._source

    def discard(self) -> None:
        self.tensors = []


class StateAssembler:
    """Writes the chunks of a checked header into a sink (new tensors by default),
    checking and hashing them."""

    def __init__(self, header: CheckedHeader, sink: StateSink | None = None) -> None:
        self.header = header
        self.sink = sink if sink is not None else MemorySink(header.specs)
        self._hasher = StateHasher(header.specs)
        self.received_bytes = 0
        self.next_index = 0

    @property
    def complete(self) -> bool:
        return self.next_index == self.header.chunks

    def accept(self, index: int, data: bytes | memoryview) -> None:
        """Take chunk ``index``; Rejection if it is not the next one or has the wrong size."""
        header = self.header
        if self.complete:
            raise Rejection("bad-chunk", f"chunk {index} arrived after the last chunk")
        if index != self.next_index:
            raise Rejection(
                "bad-chunk", f"chunk {index} arrived where chunk {self.next_index} was due"
            )
        want = min(header.chunk_bytes, header.total_bytes - self.received_bytes)
        if len(data) != want:
            raise Rejection("bad-chunk", f"chunk {index} has {len(data)} bytes, {want} were due")
        self._hasher.update(data)
        self.sink.write(self.received_bytes, data)
        self.received_bytes += len(data)
        self.next_index += 1

    def finish(self) -> StateSnapshot:
        """The state, once every chunk arrived and the digest matches the header's."""
        if not self.complete:
            raise Rejection(
                "truncated",
                f"the stream ended after {self.next_index} of {self.header.chunks} chunks",
            )
        digest = self._hasher.digest()
        if digest != self.header.digest:
            raise Rejection(
                "bad-digest",
                f"the state hashes to {digest.hex()[:16]}, the donor's header promised "
                f"{self.header.digest.hex()[:16]} (corrupted in transit or by the donor)",
            )
        header = self.header
        return StateSnapshot.from_source(
            swarm_id=header.swarm_id,
            round=header.round,
            specs=header.specs,
            digest=header.digest,
            source=self.sink.source(),
        )
