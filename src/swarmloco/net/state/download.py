"""The requester side of state transfer: download the swarm's state from the first good donor.

:func:`download_state` asks the donors one after another, in the order given, under one
overall deadline. From each it expects a header signed by that donor's key and bound to a
fresh nonce, then every chunk in order, each within ``chunk_timeout_s`` of the message
before it, the header within ``header_timeout_s`` and the whole state at no less than
``min_rate_bytes_s`` on average (a donor that stalls, or drips a chunk now and then, holds
the requester for a bounded time whatever the overall deadline). Chunks are checked
and written as they arrive (into new tensors, or with ``spool`` into an unnamed file that
keeps a large state out of the peer's memory) and hashed on the way; the state is
returned only if the digest matches the signed header (and ``expected_digest``, when the
caller knows the majority digest of the round).

Any failure (unreachable, busy, another swarm, round or digest, a bad signature, a
malformed, oversized, stalled, truncated or corrupted stream, a layout that does not fit
the schema) moves on to the next donor and is kept in the report. When no donor is left,
:class:`StateTransferError` names every donor and its reason. Every call ends before
:func:`download_state` returns: nothing keeps running behind it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import grpc

from swarmloco.core.config import require_positive
from swarmloco.core.manifest import check_swarm_id
from swarmloco.core.state import DIGEST_BYTES, StateSchema, StateSnapshot
from swarmloco.errors import NetworkError
from swarmloco.net.client import RpcClient, RpcError
from swarmloco.net.deadline import Deadline
from swarmloco.net.rejections import Rejection, RejectionLog
from swarmloco.net.state import wire
from swarmloco.net.state.files import FileSink

logger = logging.getLogger(__name__)


class DonorLike(Protocol):
    """Anything that names a peer and where to dial it (e.g. a ``swarm.PeerEntry``)."""

    @property
    def peer_id(self) -> str: ...

    @property
    def endpoint(self) -> str: ...


@dataclasses.dataclass(frozen=True)
class Donor:
    """A peer to download from: its peer id (hex) and ``HOST:PORT``."""

    peer_id: str
    endpoint: str

    def __str__(self) -> str:
        return f"{self.peer_id[:12]}@{self.endpoint}"


@dataclasses.dataclass(frozen=True)
class DonorFailure:
    """Why one donor did not deliver: a short ``code`` and a ``reason`` for people."""

    donor: Donor
    code: str
    reason: str

    def __str__(self) -> str:
        return f"{self.donor}: {self.reason}"


@dataclasses.dataclass(frozen=True)
class DownloadedState:
    """A verified state, who gave it, and what went wrong with the donors tried before."""

    snapshot: StateSnapshot
    donor: Donor
    failures: tuple[DonorFailure, ...]
    seconds: float


class StateTransferError(NetworkError):
    """No donor handed over the state; ``failures`` lists each donor and its reason."""

    def __init__(self, message: str, failures: tuple[DonorFailure, ...]) -> None:
        super().__init__(message)
        self.failures = failures


@dataclasses.dataclass(frozen=True, kw_only=True)
class DownloadConfig:
    """How a peer downloads state."""

    chunk_timeout_s: float = 10.0
    """Every chunk must arrive within this long of the message before it; a donor that
    stalls longer is left for the next one."""
    header_timeout_s: float = 5.0
    """The signed header must arrive within this long of the request (a donor serves a
    state it holds ready: the header costs it nothing)."""
    min_rate_bytes_s: float = 1e6
    """After the header, a donor has ``chunk_timeout_s`` plus the state's size at this
    rate to deliver all of it."""
    limits: wire.ReceiveLimits = dataclasses.field(default_factory=wire.ReceiveLimits)
    """What is accepted from a donor (state size, tensors, chunk and header sizes)."""

    def __post_init__(self) -> None:
        require_positive("chunk_timeout_s", self.chunk_timeout_s)
        require_positive("header_timeout_s", self.header_timeout_s)
        require_positive("min_rate_bytes_s", self.min_rate_bytes_s)


async def download_state(
    client: RpcClient,
    donors: Sequence[DonorLike],
    *,
    swarm_id: str,
    deadline: Deadline,
    expected_round: int | None = None,
    expected_digest: bytes | None = None,
    schema: StateSchema | None = None,
    config: DownloadConfig | None = None,
    rejections: RejectionLog | None = None,
    requester: wire.Requester | None = None,
    spool: Path | None = None,
) -> DownloadedState:
    """Download the state of ``swarm_id`` from the first of ``donors`` that delivers it.

    ``expected_round``/``expected_digest``: the round and digest wanted (None: any); a
    donor whose signed header says otherwise is skipped before its payload is read.
    ``schema``: the tensors the state must hold (e.g. ``StateSchema.diloco(numel)``).
    ``rejections``: where to count and log invalid input from donors. ``requester``: who
    signs the requests (a member of a private swarm; its donors serve nobody else).
    ``spool``: receive the state into an unnamed file in this directory (``files.py``)
    rather than memory; a disk that cannot hold it fails that donor's attempt.

    Raises StateTransferError naming every donor and why it failed, when none delivered
    by ``deadline``.
    """
    swarm_id = check_swarm_id(swarm_id)
    if expected_digest is not None and len(expected_digest) != DIGEST_BYTES:
        raise ValueError(
            f"expected_digest must be a {DIGEST_BYTES}-byte state digest, got "
            f"{len(expected_digest)} bytes"
        )
    if expected_round is not None and expected_round < 0:
        raise ValueError(f"expected_round must be >= 0, got {expected_round}")
    config = config or DownloadConfig()
    rejections = rejections or RejectionLog(logger)
    started = time.monotonic()
    failures: list[DonorFailure] = []
    for given in donors:
        donor = Donor(given.peer_id, given.endpoint)
        if not donor.endpoint:
            failures.append(
                DonorFailure(donor, "client-mode", "a client-mode peer serves no state")
            )
            continue
        if deadline.expired:
            failures.append(DonorFailure(donor, "deadline", "not tried: the deadline passed"))
            continue
        attempt = _Attempt(
            client,
            donor,
            swarm_id=swarm_id,
            deadline=deadline,
            round=expected_round,
            digest=expected_digest,
            schema=schema,
            config=config,
            requester=requester,
            spool=spool,
        )
        try:
            snapshot = await attempt.run()
        except Rejection as rejection:
            rejections.record(rejection, str(donor))
            failures.append(DonorFailure(donor, rejection.code, rejection.reason))
            continue
        except _Failed as failed:
            logger.info("state download from %s failed: %s", donor, failed.reason)
            failures.append(DonorFailure(donor, failed.code, failed.reason))
            continue
        seconds = time.monotonic() - started
        logger.info(
            "downloaded round %d of swarm %s (%d bytes) from %s in %.2fs",
            snapshot.round,
            swarm_id[:12],
            snapshot.nbytes,
            donor,
            seconds,
        )
        return DownloadedState(snapshot, donor, tuple(failures), seconds)
    raise StateTransferError(_summary(swarm_id, failures, deadline), tuple(failures))


def _summary(swarm_id: str, failures: list[DonorFailure], deadline: Deadline) -> str:
    if not failures:
        return (
            f"cannot download the state of swarm {swarm_id}: no donor to ask. Find peers of "
            "the swarm first (they announce themselves in the DHT), then retry."
        )
    lines = "\n".join(f"  - {failure}" for failure in failures)
    hint = (
        "the deadline passed: allow more time or pick faster donors"
        if deadline.expired
        else "retry later or with other donors; if every donor serves another swarm or "
        "round, check the swarm id and the expected round"
    )
    return (
        f"cannot download the state of swarm {swarm_id} from any of {len(failures)} "
        f"donor(s):\n{lines}\n{hint}"
    )


class _Failed(Exception):
    """One donor failed for a reason that is not invalid input (unreachable, stalled...)."""

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


_STATUS_CODES = {
    grpc.StatusCode.UNAVAILABLE: "unreachable",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "busy",
    grpc.StatusCode.FAILED_PRECONDITION: "no-state",
    grpc.StatusCode.DEADLINE_EXCEEDED: "deadline",
    grpc.StatusCode.UNIMPLEMENTED: "no-service",
    grpc.StatusCode.PERMISSION_DENIED: "not-admitted",
}


class _Attempt:
    """One download from one donor: one call, its messages read under their deadlines."""

    def __init__(
        self,
        client: RpcClient,
        donor: Donor,
        *,
        swarm_id: str,
        deadline: Deadline,
        round: int | None,
        digest: bytes | None,
        schema: StateSchema | None,
        config: DownloadConfig,
        requester: wire.Requester | None = None,
        spool: Path | None = None,
    ) -> None:
        self.client = client
        self.spool = spool
        self.requester = requester
        self.donor = donor
        self.swarm_id = swarm_id
        self.deadline = deadline
        self.round = round
        self.digest = digest
        self.schema = schema
        self.config = config
        self.nonce = secrets.token_bytes(wire.NONCE_BYTES)
        self.received = 0
        self.expected = 0
        # What this donor may take, at most: the header first, then the whole state.
        self.budget = self._capped(config.header_timeout_s)

    def _capped(self, seconds: float) -> Deadline:
        return Deadline(min(self.deadline.at, Deadline.after(seconds).at))

    async def run(self) -> StateSnapshot:
        request = wire.encode_request(
            swarm_id=self.swarm_id,
            nonce=self.nonce,
            round=self.round,
            digest=self.digest,
            requester=self.requester,
        )
        try:
            channel = await self.client.open(self.donor.endpoint, self.budget)
        except RpcError as exc:
            label = "refused" if exc.code == grpc.StatusCode.UNAUTHENTICATED else "unreachable"
            raise _Failed(label, str(exc)) from None
        with self.client.holding(channel):
            method = channel.unary_stream(wire.DOWNLOAD_PATH)
            call = method(request, timeout=max(self.deadline.remaining(), 0.001))
            try:
                return await self._receive(call)
            finally:
                call.cancel()  # a no-op once the call is over; ends it on every other way out

    async def _receive(self, call: Any) -> StateSnapshot:
        limits = self.config.limits
        data = await self._next(call, "its header")
        if data is None:
            raise Rejection("truncated", "the donor ended the stream before its header")
        if len(data) > limits.max_header_bytes:
            raise Rejection(
                "too-large", f"the header has {len(data)} bytes, > {limits.max_header_bytes}"
            )
        message = wire.decode_response(data)
        if message.WhichOneof("kind") != "header":
            raise Rejection("malformed", "the stream does not start with a header")
        header = wire.check_header(
            message.header,
            peer_id=self.donor.peer_id,
            nonce=self.nonce,
            swarm_id=self.swarm_id,
            round=self.round,
            digest=self.digest,
            schema=self.schema,
            limits=limits,
        )
        try:
            sink = None if self.spool is None else FileSink(self.spool, header.specs)
        except OSError as exc:
            raise _Failed("no-room", f"cannot make a file for the state: {exc}") from None
        assembler = wire.StateAssembler(header, sink)
        try:
            return await self._assemble(call, header, assembler)
        except BaseException:
            assembler.sink.discard()
            raise

    async def _assemble(
        self, call: Any, header: wire.CheckedHeader, assembler: wire.StateAssembler
    ) -> StateSnapshot:
        self.expected = header.chunks
        config = self.config
        self.budget = self._capped(
            config.chunk_timeout_s + header.total_bytes / config.min_rate_bytes_s
        )
        while not assembler.complete:
            data = await self._next(call, f"chunk {assembler.next_index}")
            if data is None:
                break  # finish() says how much is missing
            if len(data) > header.chunk_bytes + wire.CHUNK_OVERHEAD_BYTES:
                raise Rejection(
                    "too-large",
                    f"a chunk message of {len(data)} bytes exceeds the header's chunk size "
                    f"{header.chunk_bytes}",
                )
            message = wire.decode_response(data)
            if message.WhichOneof("kind") != "chunk":
                raise Rejection("malformed", "a header or nothing arrived where a chunk was due")
            try:
                assembler.accept(message.chunk.index, message.chunk.data)
            except OSError as exc:  # the spool's disk is full
                raise _Failed("no-room", f"cannot write the state: {exc}") from None
            self.received += 1
        else:
            if await self._next(call, "the end of the stream") is not None:
                raise Rejection("malformed", "the donor sent more after the last chunk")
        return assembler.finish()

    async def _next(self, call: Any, what: str) -> bytes | None:
        """The next message (None at the end of the stream), within the chunk timeout."""
        wait = min(self.deadline.timeout(self.config.chunk_timeout_s), self.budget.remaining())
        try:
            async with asyncio.timeout(wait):
                data = await call.read()
        except TimeoutError:
            if self.deadline.expired:
                raise _Failed(
                    "deadline", f"the deadline passed while waiting for {what}{self._progress()}"
                ) from None
            if self.budget.expired:
                allowed = "the header" if not self.expected else "the whole state"
                raise _Failed(
                    "slow",
                    f"too slow: {allowed} did not arrive in the time allowed for it "
                    f"(waiting for {what}{self._progress()})",
                ) from None
            raise _Failed(
                "stalled", f"sent nothing for {wait:.1f}s while {what} was due{self._progress()}"
            ) from None
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            details = (exc.details() or "").strip()
            label = _STATUS_CODES.get(code, "rpc-error")
            if "larger than max" in details:  # gRPC's own message size limit, not a busy donor
                label = "too-large"
            said = f"{code.name}: {details}" if details else code.name
            raise _Failed(label, f"{said}{self._progress()}") from None
        return None if data is grpc.aio.EOF else bytes(data)

    def _progress(self) -> str:
        return f" (after {self.received} of {self.expected} chunks)" if self.expected else ""
