"""State transfer on loopback: real gRPC servers on port 0, honest and hostile donors.

Hostile donors are real ``swarmloco.v1.StateTransfer`` servicers defined here: they build
the honest stream with the same wire helpers and then break one thing in it (a corrupted
chunk, a forged signature, a stall, a truncation...), and count that the fault fired.
Every download is checked to leave no task behind, whether it succeeded or failed.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager

import grpc
import pytest
import torch
from avgutil import Leftovers
from netutil import closed_port, wait_for
from sourceproxy import sources

from swarmloco.core.state import MOMENTUM, THETA_G, StateSchema, StateSnapshot, state_digest
from swarmloco.net.averaging import BandwidthConfig, BandwidthLimiter
from swarmloco.net.client import RpcClient
from swarmloco.net.deadline import Deadline
from swarmloco.net.identity import Identity
from swarmloco.net.node import NetNode, NodeConfig
from swarmloco.net.server import PeerServer, ServerConfig, Service
from swarmloco.net.state import (
    ByteBudget,
    Donor,
    DonorConfig,
    DownloadConfig,
    DownloadedState,
    StateDonor,
    StateTransferError,
    download_state,
    state_service,
    wire,
)
from swarmloco.net.state.donor import _Pace
from swarmloco.net.state.files import FileSource, write_state
from swarmloco.proto.v1 import state_pb2 as pb

SWARM = "5a" * 20
OTHER_SWARM = "a5" * 20
CHUNK = 64 * 1024
FAST = DownloadConfig(chunk_timeout_s=1.0)


def make_snapshot(
    numel: int,
    *,
    momentum: int | None = -1,
    seed: int = 0,
    round: int = 5,
    swarm_id: str = SWARM,
    dtype: torch.dtype = torch.float32,
) -> StateSnapshot:
    """A state of ``numel`` parameters; momentum of the same length (-1), of ``momentum``
    values, or none (None)."""
    g = torch.Generator().manual_seed(seed)
    tensors = {THETA_G: torch.randn(numel, generator=g).to(dtype)}
    if momentum is not None:
        tensors[MOMENTUM] = torch.randn(numel if momentum < 0 else momentum, generator=g)
    return StateSnapshot.of(swarm_id=swarm_id, round=round, tensors=tensors)


def assert_same_state(got: StateSnapshot, want: StateSnapshot) -> None:
    assert (got.swarm_id, got.round, got.digest) == (want.swarm_id, want.round, want.digest)
    assert list(got.tensors) == list(want.tensors)
    for name, tensor in want.tensors.items():
        received = got.tensors[name]
        assert received.dtype == tensor.dtype and received.shape == tensor.shape
        # Bit for bit: compare the raw bytes, so that even NaN payloads would have to match.
        assert torch.equal(received.view(torch.uint8), tensor.view(torch.uint8)), name


@dataclasses.dataclass
class Served:
    """A donor on loopback: who it claims to be and where it listens."""

    identity: Identity
    port: int
    donor: StateDonor | None = None
    fired: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)

    @property
    def as_donor(self) -> Donor:
        return Donor(self.identity.peer_id_hex, f"127.0.0.1:{self.port}")


@asynccontextmanager
async def serving(service: Service) -> AsyncIterator[int]:
    async with PeerServer(ServerConfig(grace_s=0.5), [service]) as server:
        yield server.port


@asynccontextmanager
async def honest(
    snapshot: StateSnapshot | None,
    *,
    config: DonorConfig | None = None,
    limiter: BandwidthLimiter | None = None,
) -> AsyncIterator[Served]:
    identity = Identity.generate()
    donor = StateDonor(
        identity=identity,
        snapshot=lambda: snapshot,
        config=config or DonorConfig(chunk_bytes=CHUNK),
        limiter=limiter,
    )
    async with serving(state_service(donor)) as port:
        yield Served(identity, port, donor)


# -- hostile donors ----------------------------------------------------------------------------

Messages = list[bytes]


def honest_messages(
    identity: Identity, snapshot: StateSnapshot, nonce: bytes, *, signer: Identity | None = None
) -> tuple[pb.StateHeader, list[bytes]]:
    header = wire.sign_header(
        signer or identity, snapshot, nonce=nonce, chunk_bytes=CHUNK, timestamp_ms=1
    )
    chunks = [bytes(c) for c in snapshot.chunks(CHUNK)]
    return header, chunks


def resign(header: pb.StateHeader, identity: Identity) -> pb.StateHeader:
    header.signature = identity.sign(wire.HEADER_DOMAIN, wire.header_payload(header))
    return header


Twist = Callable[[Identity, StateSnapshot, bytes], tuple[Messages, int | None]]
"""Builds a hostile stream: (messages to send, index of the message to stall before)."""


def _stream(header: pb.StateHeader, chunks: list[bytes]) -> Messages:
    return [wire.header_response(header)] + [
        wire.chunk_response(i, c) for i, c in enumerate(chunks)
    ]


def honest_stream(identity: Identity, snapshot: StateSnapshot, nonce: bytes):
    header, chunks = honest_messages(identity, snapshot, nonce)
    return _stream(header, chunks), None


def corrupt_chunk(identity: Identity, snapshot: StateSnapshot, nonce: bytes):
    header, chunks = honest_messages(identity, snapshot, nonce)
    flipped = bytearray(chunks[1])
    flipped[100] ^= 0x01
    chunks[1] = bytes(flipped)
    return _stream(header, chunks), None


def lying_digest(identity: Identity, snapshot: StateSnapshot, nonce: bytes):
    header, chunks = honest_messages(identity, snapshot, nonce)
    header.digest = bytes(32)
    return _stream(resign(header, identity), chunks), None


def forged_signature(identity: Identity, snapshot: StateSnapshot, nonce: bytes):
    # Claims to be the donor (its public key) but signs with another key.
    header, chunks = honest_messages(identity, snapshot, nonce, signer=Identity.generate())
    header.public_key = identity.public_key
    return _stream(header, chunks), None


def impostor(identity: Identity, snapshot: StateSnapshot, nonce: bytes):
    # A valid signature, by a key that is not the donor we asked.
    header, chunks = honest_messages(identity, snapshot, nonce, signer=Identity.generate())
    return _stream(header, chunks), None


def replayed(identity: Identity, snapshot: StateSnapshot, nonce: bytes):
    # The donor's own valid header, signed for another request.
    header, chunks = honest_messages(identity, snapshot, bytes(16))
    return _stream(header, chunks), None


def stall(identity: Identity, snapshot: StateSnapshot, nonce: bytes):
    header, chunks = honest_messages(identity, snapshot, nonce)
    return _stream(header, chunks), 3  # header and two chunks, then nothing


def stall_before_header(identity: Identity, snapshot: StateSnapshot, nonce: bytes):
    header, chunks = honest_messages(identity, snapshot, nonce)
    return _stream(header, chunks), 0


def truncate(identity: Identity, snapshot: StateSnapshot, nonce: bytes):
    header, chunks = honest_messages(identity, snapshot, nonce)
    return _stream(header, chunks)[:-2], None  # ends cleanly, two chunks short


def oversize_chunk(identity: Identity, snapshot: StateSnapshot, nonce: bytes):
    header, chunks = honest_messages(identity, snapshot, nonce)
    chunks[0] = chunks[0] + b"\x00" * 1024
    return _stream(header, chunks), None


def oversize_header(identity: Identity, snapshot: StateSnapshot, nonce: bytes):
    header, chunks = honest_messages(identity, snapshot, nonce)
    header.swarm_id = "x" * 100_000
    return _stream(resign(header, identity), chunks), None


def short_chunk(identity: Identity, snapshot: StateSnapshot, nonce: bytes):
    header, chunks = honest_messages(identity, snapshot, nonce)
    chunks[2] = chunks[2][:-4]
    return _stream(header, chunks), None


def skipped_index(identity: Identity, snapshot: StateSnapshot, nonce: bytes):
    header, chunks = honest_messages(identity, snapshot, nonce)
    messages = _stream(header, chunks)
    return messages[:2] + messages[3:], None


def extra_chunk(identity: Identity, snapshot: StateSnapshot, nonce: bytes):
    header, chunks = honest_messages(identity, snapshot, nonce)
    return [*_stream(header, chunks), wire.chunk_response(len(chunks), b"\x00" * 8)], None


def garbage(identity: Identity, snapshot: StateSnapshot, nonce: bytes):
    header, _ = honest_messages(identity, snapshot, nonce)
    return [wire.header_response(header), b"\xff\xff\xff\xff"], None


def huge_claim(identity: Identity, snapshot: StateSnapshot, nonce: bytes):
    # A header that asks the requester to allocate a petabyte.
    header, chunks = honest_messages(identity, snapshot, nonce)
    header.tensors[0].numel = 2**48
    header.total_bytes = sum(t.numel * 4 for t in header.tensors)
    return _stream(resign(header, identity), chunks), None


@asynccontextmanager
async def hostile(
    snapshot: StateSnapshot, twist: Twist, *, pause: float = 0.0
) -> AsyncIterator[Served]:
    """A donor that answers every request with ``twist``'s stream (ignoring what it asks),
    ``pause`` seconds before each message (a donor that drips)."""
    identity = Identity.generate()
    served = Served(identity, 0)

    async def download(data: bytes, context: grpc.aio.ServicerContext) -> None:
        request = pb.DownloadRequest.FromString(data)
        messages, stall_at = twist(identity, snapshot, bytes(request.nonce))
        served.fired["requests"] += 1
        for i, message in enumerate(messages):
            if i == stall_at:
                served.fired["stalled"] += 1
                await asyncio.Event().wait()  # until the requester gives up and cancels
            if pause:
                await asyncio.sleep(pause)
            await context.write(message)
        served.fired["finished"] += 1

    handler = grpc.unary_stream_rpc_method_handler(download)
    generic = grpc.method_handlers_generic_handler(wire.SERVICE_NAME, {"Download": handler})
    service = Service(wire.SERVICE_NAME, lambda s: s.add_generic_rpc_handlers((generic,)))
    async with serving(service) as port:
        served.port = port
        yield served


async def fetch(
    client: RpcClient, donors: list[Served | Donor], *, timeout: float = 10.0, **kwargs
) -> DownloadedState:
    return await download_state(
        client,
        [d.as_donor if isinstance(d, Served) else d for d in donors],
        swarm_id=kwargs.pop("swarm_id", SWARM),
        deadline=Deadline.after(timeout),
        config=kwargs.pop("config", FAST),
        **kwargs,
    )


# -- clean downloads ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("numel", "momentum"),
    [
        (3 * CHUNK // 4 * 2 + 7, -1),  # ends mid-chunk, straddles tensors
        (CHUNK // 4 * 3, -1),  # whole chunks exactly
        (1_000_003, -1),  # several MB
        (12_345, 0),  # a 0-length momentum
        (12_345, None),  # no momentum (a fresh swarm)
        (5, None),  # less than one chunk
        (0, None),  # nothing at all: a header and no chunks
    ],
)
async def test_a_clean_download_is_bit_identical(numel, momentum):
    snapshot = make_snapshot(numel, momentum=momentum, seed=numel)
    async with honest(snapshot) as donor, RpcClient() as client:
        before = Leftovers.now()
        got = await fetch(client, [donor])
        await before.assert_back(sockets=False)
    assert_same_state(got.snapshot, snapshot)
    assert got.donor == donor.as_donor and got.failures == ()
    assert donor.donor is not None and donor.donor.stats["served"] == 1
    assert donor.donor.stats["bytes"] == snapshot.nbytes
    assert got.snapshot.digest == state_digest(snapshot.tensors)


async def test_a_state_served_from_a_file_downloads_into_a_file_bit_identical(tmp_path):
    """A peer's states live in unnamed files (DESIGN section 6, "Host memory"): the donor
    reads its chunks off the file, the requester writes them into one; neither holds it
    in memory, and neither leaves a file behind."""
    state = make_snapshot(1_000_003, momentum=-1, seed=3)
    served, spool = tmp_path / "served", tmp_path / "spool"
    on_disk = write_state(served, swarm_id=SWARM, round=state.round, tensors=state.tensors)
    assert isinstance(on_disk.source, FileSource)
    async with honest(on_disk) as donor, RpcClient() as client:
        got = await fetch(client, [donor], spool=spool)
    assert isinstance(got.snapshot.source, FileSource)
    assert_same_state(got.snapshot, state)
    assert list(served.iterdir()) == [] and list(spool.iterdir()) == []


async def test_a_spool_on_a_full_disk_fails_the_attempt_not_the_requester(small_tmpfs):
    state = make_snapshot(1_000_003, momentum=-1, seed=4)  # 8 MB: more than the disk holds
    async with honest(state) as donor, RpcClient() as client:
        with pytest.raises(StateTransferError) as caught:
            await fetch(client, [donor], spool=small_tmpfs)
    assert [f.code for f in caught.value.failures] == ["no-room"]
    assert list(small_tmpfs.iterdir()) == []


async def test_other_dtypes_and_the_schema_of_a_diloco_state():
    tensors = {
        "a": torch.arange(1000, dtype=torch.int64),
        "b": torch.randn(777).to(torch.bfloat16),
        "c": torch.rand(5000) > 0.5,
        THETA_G: torch.randn(4321),
    }
    snapshot = StateSnapshot.of(swarm_id=SWARM, round=0, tensors=tensors)
    async with honest(snapshot) as donor, RpcClient() as client:
        got = await fetch(client, [donor])
        assert_same_state(got.snapshot, snapshot)
        # The same state does not fit the schema of a DiLoCo model of 4321 parameters.
        with pytest.raises(StateTransferError, match="holds a tensor 'a'"):
            await fetch(client, [donor], schema=StateSchema.diloco(4321))


async def test_served_through_a_net_node_like_any_other_service():
    snapshot = make_snapshot(100_000, seed=3)
    identity = Identity.generate()
    donor = StateDonor(identity=identity, snapshot=lambda: snapshot)
    node = NetNode(identity=identity, config=NodeConfig(), services=[state_service(donor)])
    async with node:
        joiner = NetNode(identity=Identity.generate(), config=NodeConfig(peers=(node.endpoint,)))
        async with joiner:
            got = await download_state(
                joiner.client,
                [Donor(identity.peer_id_hex, node.endpoint)],
                swarm_id=SWARM,
                expected_round=5,
                expected_digest=snapshot.digest,
                schema=StateSchema.diloco(100_000),
                deadline=Deadline.after(10),
            )
    assert_same_state(got.snapshot, snapshot)


# -- falling back to the next donor ------------------------------------------------------------


async def fallback(bad: Served | Donor, good: Served, snapshot: StateSnapshot, client, **kwargs):
    before = Leftovers.now()
    started = time.monotonic()
    got = await fetch(client, [bad, good], **kwargs)
    elapsed = time.monotonic() - started
    await before.assert_back(sockets=False)
    assert_same_state(got.snapshot, snapshot)
    assert got.donor == good.as_donor
    assert len(got.failures) == 1
    failure = got.failures[0]
    assert failure.donor == (bad.as_donor if isinstance(bad, Served) else bad)
    return failure, elapsed


async def test_falls_back_when_the_first_donor_is_down():
    snapshot = make_snapshot(50_000)
    down = Donor(Identity.generate().peer_id_hex, f"127.0.0.1:{closed_port()}")
    async with honest(snapshot) as good, RpcClient() as client:
        failure, _ = await fallback(down, good, snapshot, client)
    assert failure.code == "unreachable" and "UNAVAILABLE" in failure.reason


async def test_a_client_mode_peer_is_not_asked():
    snapshot = make_snapshot(50_000)
    client_mode = Donor(Identity.generate().peer_id_hex, "")
    async with honest(snapshot) as good, RpcClient() as client:
        failure, _ = await fallback(client_mode, good, snapshot, client)
    assert failure.code == "client-mode"


async def test_falls_back_when_the_first_donor_serves_another_swarm():
    snapshot = make_snapshot(50_000)
    foreign = make_snapshot(50_000, swarm_id=OTHER_SWARM)
    async with honest(foreign) as other, honest(snapshot) as good, RpcClient() as client:
        failure, _ = await fallback(other, good, snapshot, client)
        assert other.donor is not None
        assert other.donor.stats["declined"] == 1 and other.donor.stats["chunks"] == 0
    assert failure.code == "wrong-swarm" and OTHER_SWARM[:12] in failure.reason


async def test_falls_back_when_the_first_donor_has_no_state_yet():
    snapshot = make_snapshot(50_000)
    async with honest(None) as empty, honest(snapshot) as good, RpcClient() as client:
        failure, _ = await fallback(empty, good, snapshot, client)
    assert failure.code == "no-state" and "no state" in failure.reason


@pytest.mark.parametrize(
    ("twist", "code"),
    [
        (corrupt_chunk, "bad-digest"),
        (lying_digest, "bad-digest"),
        (forged_signature, "bad-signature"),
        (impostor, "wrong-donor"),
        (replayed, "replayed"),
        (truncate, "truncated"),
        (oversize_chunk, "too-large"),
        (oversize_header, "too-large"),
        (short_chunk, "bad-chunk"),
        (skipped_index, "bad-chunk"),
        (extra_chunk, "malformed"),
        (garbage, "malformed"),
        (huge_claim, "too-large"),
    ],
)
async def test_falls_back_when_the_first_donor_misbehaves(twist, code):
    snapshot = make_snapshot(200_003)
    async with hostile(snapshot, twist) as bad, honest(snapshot) as good, RpcClient() as client:
        failure, _ = await fallback(bad, good, snapshot, client)
        assert bad.fired["requests"] == 1
    assert failure.code == code, failure


@pytest.mark.parametrize("twist", [stall, stall_before_header])
async def test_a_stalled_donor_is_left_after_one_chunk_timeout(twist):
    snapshot = make_snapshot(200_003)
    async with hostile(snapshot, twist) as bad, honest(snapshot) as good, RpcClient() as client:
        failure, elapsed = await fallback(bad, good, snapshot, client, timeout=20.0)
        assert bad.fired["stalled"] == 1 and bad.fired["finished"] == 0
    assert failure.code == "stalled", failure
    # One chunk timeout (1 s) and the good download, far inside the 20 s deadline.
    assert elapsed < 5.0
    if twist is stall:
        assert "after 2 of" in failure.reason


async def test_a_donor_that_drips_chunks_just_inside_the_chunk_timeout_is_cut_off():
    """A chunk every 0.6 s never trips the 1 s chunk timeout, but 1.6 MB at that pace would
    take 15 s: the donor gets its chunk timeout plus the state's size at 1 MB/s (2.6 s)."""
    snapshot = make_snapshot(200_003)
    async with (
        hostile(snapshot, honest_stream, pause=0.6) as bad,
        honest(snapshot) as good,
        RpcClient() as client,
    ):
        failure, elapsed = await fallback(bad, good, snapshot, client, timeout=20.0)
        assert bad.fired["finished"] == 0
    assert failure.code == "slow", failure
    assert "the whole state" in failure.reason
    assert elapsed < 8.0  # far from the 15 s the drip would have taken


async def test_a_wrong_dtype_or_length_is_refused_before_the_payload():
    snapshot = make_snapshot(30_000)
    half = make_snapshot(30_000, dtype=torch.float16)
    short = make_snapshot(29_999)
    schema = StateSchema.diloco(30_000)
    async with (
        honest(half) as bad_dtype,
        honest(short) as bad_numel,
        honest(snapshot) as good,
        RpcClient() as client,
    ):
        got = await fetch(client, [bad_dtype, bad_numel, good], schema=schema)
        assert_same_state(got.snapshot, snapshot)
    assert [f.code for f in got.failures] == ["bad-layout", "bad-layout"]
    assert "float16" in got.failures[0].reason and "29999" in got.failures[1].reason


# -- expected round and digest -----------------------------------------------------------------


async def test_a_donor_with_another_digest_is_skipped_without_its_payload():
    majority = make_snapshot(300_000, seed=1)
    minority = make_snapshot(300_000, seed=2)
    async with honest(minority) as odd, honest(majority) as good, RpcClient() as client:
        before = Leftovers.now()
        got = await fetch(client, [odd, good], expected_digest=majority.digest)
        await before.assert_back(sockets=False)
        assert odd.donor is not None and good.donor is not None
        assert odd.donor.stats["declined"] == 1
        assert odd.donor.stats["chunks"] == 0 and odd.donor.stats["bytes"] == 0
        await wait_for(lambda: good.donor.active == 0)  # its handler counts after the last chunk
        assert good.donor.stats["served"] == 1
    assert_same_state(got.snapshot, majority)
    assert [f.code for f in got.failures] == ["wrong-digest"]


async def test_a_donor_that_ignores_the_expected_digest_is_still_skipped():
    # The hostile donor streams everything whatever the request says; the requester stops
    # reading at the header.
    majority = make_snapshot(100_000, seed=1)
    minority = make_snapshot(100_000, seed=2)
    async with (
        hostile(minority, lambda i, s, n: (_stream(*honest_messages(i, s, n)), None)) as odd,
        honest(majority) as good,
        RpcClient() as client,
    ):
        failure, _ = await fallback(odd, good, majority, client, expected_digest=majority.digest)
    assert failure.code == "wrong-digest"


async def test_a_donor_at_another_round_is_skipped():
    old = make_snapshot(10_000, round=4)
    current = make_snapshot(10_000, round=5)
    async with honest(old) as behind, honest(current) as good, RpcClient() as client:
        failure, _ = await fallback(behind, good, current, client, expected_round=5)
    assert failure.code == "wrong-round" and "round 4" in failure.reason


# -- when nobody delivers ----------------------------------------------------------------------


async def test_when_every_donor_fails_the_error_names_each_and_why():
    snapshot = make_snapshot(50_000)
    down = Donor(Identity.generate().peer_id_hex, f"127.0.0.1:{closed_port()}")
    async with (
        hostile(snapshot, corrupt_chunk) as corrupt,
        honest(make_snapshot(50_000, swarm_id=OTHER_SWARM)) as foreign,
        hostile(snapshot, stall) as stalled,
        RpcClient() as client,
    ):
        before = Leftovers.now()
        with pytest.raises(StateTransferError) as caught:
            await fetch(client, [down, corrupt, foreign, stalled])
        await before.assert_back(sockets=False)
    error = caught.value
    assert [f.code for f in error.failures] == [
        "unreachable",
        "bad-digest",
        "wrong-swarm",
        "stalled",
    ]
    message = str(error)
    assert "any of 4 donor(s)" in message
    for failure in error.failures:
        assert str(failure.donor) in message and failure.reason in message


async def test_no_donor_at_all_says_what_to_do():
    async with RpcClient() as client:
        with pytest.raises(StateTransferError, match="no donor to ask"):
            await fetch(client, [])


async def test_the_overall_deadline_bounds_every_donor():
    snapshot = make_snapshot(50_000)
    slow = DownloadConfig(chunk_timeout_s=30.0)
    async with (
        hostile(snapshot, stall) as first,
        hostile(snapshot, stall) as second,
        RpcClient() as client,
    ):
        before = Leftovers.now()
        started = time.monotonic()
        with pytest.raises(StateTransferError, match="deadline passed") as caught:
            await fetch(client, [first, second], timeout=0.8, config=slow)
        assert time.monotonic() - started < 3.0
        await before.assert_back(sockets=False)
    assert [f.code for f in caught.value.failures] == ["deadline", "deadline"]


# -- the donor under hostile or heavy load -----------------------------------------------------


async def test_a_hostile_requester_cannot_crash_the_donor():
    snapshot = make_snapshot(20_000)
    async with honest(snapshot) as donor, RpcClient() as client:
        assert donor.donor is not None
        channel = await client.open(donor.as_donor.endpoint, 10)
        raw = channel.unary_stream(wire.DOWNLOAD_PATH)
        bad_requests = [
            b"\xff\xff\xff\xff\x0f",  # not protobuf
            b"\x0a\xff\xff\xff\xff\x0f",  # a length that runs past the end
            pb.DownloadRequest(swarm_id=SWARM, nonce=b"short").SerializeToString(),
            pb.DownloadRequest(swarm_id=SWARM, nonce=bytes(16), digest=b"x").SerializeToString(),
            b"\x00" * 5000,  # too large
        ]
        for request in bad_requests:
            call = raw(request, timeout=5)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call.read()
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert donor.donor.rejections.counts["malformed"] == len(bad_requests)
        assert donor.donor.active == 0
        got = await fetch(client, [donor])  # still serving
        assert_same_state(got.snapshot, snapshot)


async def test_a_busy_donor_refuses_at_once_and_the_requester_moves_on():
    snapshot = make_snapshot(1_000_000)
    slow = BandwidthLimiter(BandwidthConfig(upload_bytes_per_s=256 * 1024))
    async with AsyncExitStack() as stack:
        busy = await stack.enter_async_context(
            honest(snapshot, config=DonorConfig(max_concurrent_downloads=1), limiter=slow)
        )
        good = await stack.enter_async_context(honest(snapshot))
        client = await stack.enter_async_context(RpcClient())
        assert busy.donor is not None
        # Occupy the busy donor's only slot with a download that reads its header and
        # waits (the limiter keeps the donor sending for many seconds).
        request = wire.encode_request(swarm_id=SWARM, nonce=bytes(16))
        hog = (await client.open(busy.as_donor.endpoint, 10)).unary_stream(wire.DOWNLOAD_PATH)(
            request, timeout=30
        )
        first = pb.DownloadResponse.FromString(await hog.read())
        assert first.WhichOneof("kind") == "header" and busy.donor.active == 1
        try:
            failure, elapsed = await fallback(busy, good, snapshot, client)
        finally:
            hog.cancel()
        assert failure.code == "busy" and "ask another donor" in failure.reason
        assert busy.donor.stats["busy"] == 1
        assert elapsed < 5.0
        await wait_for(lambda: busy.donor is not None and busy.donor.active == 0)


async def test_a_requester_that_stops_reading_loses_its_slot():
    # More than HTTP/2 flow control lets the donor send ahead of a requester that reads
    # nothing, so the donor's writes block and its write timeout drops the requester.
    snapshot = StateSnapshot.of(swarm_id=SWARM, round=1, tensors={THETA_G: torch.zeros(6_000_000)})
    config = DonorConfig(max_concurrent_downloads=1, write_timeout_s=0.3)
    async with honest(snapshot, config=config) as donor, RpcClient() as client:
        assert donor.donor is not None
        request = wire.encode_request(swarm_id=SWARM, nonce=bytes(16))
        hog = (await client.open(donor.as_donor.endpoint, 10)).unary_stream(wire.DOWNLOAD_PATH)(
            request, timeout=30
        )
        try:
            assert pb.DownloadResponse.FromString(await hog.read()).HasField("header")
            await wait_for(lambda: donor.donor is not None and donor.donor.active == 0)
            assert donor.donor.stats["dropped"] == 1
            assert donor.donor.stats["bytes"] < snapshot.nbytes
            got = await fetch(client, [donor])  # the slot is free for the next requester
            assert_same_state(got.snapshot, snapshot)
        finally:
            hog.cancel()


async def test_one_address_cannot_take_every_download_slot():
    # Larger than HTTP/2 lets the donor send ahead: the hog, reading nothing, holds its slot.
    snapshot = make_snapshot(6_000_000)
    identity = Identity.generate()
    donor = StateDonor(
        identity=identity,
        snapshot=lambda: snapshot,
        config=DonorConfig(chunk_bytes=CHUNK, max_downloads_per_network=1, limit_loopback=True),
    )
    server = PeerServer(ServerConfig(host="::", grace_s=0.5), [state_service(donor)])
    async with server, RpcClient() as client:
        request = wire.encode_request(swarm_id=SWARM, nonce=bytes(16))
        # 127.0.0.1 takes one of the two slots, and may not take the other.
        hog = (await client.open(f"127.0.0.1:{server.port}", 10)).unary_stream(wire.DOWNLOAD_PATH)(
            request, timeout=30
        )
        try:
            assert pb.DownloadResponse.FromString(await hog.read()).HasField("header")
            second = (await client.open(f"127.0.0.1:{server.port}", 10)).unary_stream(
                wire.DOWNLOAD_PATH
            )(request, timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await second.read()
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "download(s) to 127.0.0.1" in (refused.value.details() or "")
            # Another address gets the free slot.
            got = await fetch(client, [Donor(identity.peer_id_hex, f"[::1]:{server.port}")])
            assert_same_state(got.snapshot, snapshot)
        finally:
            hog.cancel()
        await wait_for(lambda: donor.active == 0)


async def _read_slowly(call, pace_s: float, taken: collections.Counter[str]) -> str:
    """A requester that reads every message, one per ``pace_s`` (its own pace, as slow as
    a stranger likes: not a wait for anything), until the call ends or it is cancelled;
    returns the status that ended it."""
    try:
        while await call.read() is not grpc.aio.EOF:
            taken["messages"] += 1
            await asyncio.sleep(pace_s)
    except grpc.aio.AioRpcError as error:
        return f"{error.code().name}: {error.details()}"
    finally:
        call.cancel()
    return "EOF"


async def _slow_readers(
    client: RpcClient, readers: list[Donor], request: bytes
) -> tuple[list[asyncio.Future[str]], list[collections.Counter[str]]]:
    """Each of ``readers`` starts a download and reads it slowly (:func:`_read_slowly`,
    a message per 0.2 s: ~320 KiB/s in chunks of 64 KiB), its header read already."""
    taken = [collections.Counter[str]() for _ in readers]
    tasks = []
    for reader, counter in zip(readers, taken, strict=True):
        channel = await client.open(reader.endpoint, 10)
        call = channel.unary_stream(wire.DOWNLOAD_PATH)(request, timeout=120)
        assert pb.DownloadResponse.FromString(await call.read()).HasField("header")
        tasks.append(asyncio.ensure_future(_read_slowly(call, 0.2, counter)))
    return tasks, taken


@asynccontextmanager
async def behind_sources(
    snapshot: StateSnapshot, config: DonorConfig, addresses: list[str]
) -> AsyncIterator[tuple[StateDonor, list[Donor], RpcClient]]:
    """A donor of ``snapshot`` on loopback, the same donor as dialled from each of
    ``addresses`` (each a source network of its own), and a client to dial it."""
    identity = Identity.generate()
    donor = StateDonor(identity=identity, snapshot=lambda: snapshot, config=config)
    async with AsyncExitStack() as stack:
        port = await stack.enter_async_context(serving(state_service(donor)))
        proxies = await stack.enter_async_context(sources(addresses, ("127.0.0.1", port)))
        client = await stack.enter_async_context(RpcClient())
        yield donor, [Donor(identity.peer_id_hex, p.endpoint) for p in proxies], client


async def test_two_slow_readers_cannot_keep_a_newcomer_from_the_state():
    # Two networks (127.0.0.2, 127.0.0.3) each take one of two slots and read a 24 MB
    # state at ~320 KiB/s, often enough that the write timeout never drops them. An honest
    # newcomer (127.0.0.4) is refused while they hold the slots, and gets the state once
    # the donor cuts them off for reading slower than its minimum.
    snapshot = make_snapshot(3_000_000)
    config = DonorConfig(
        chunk_bytes=CHUNK,
        max_concurrent_downloads=2,
        limit_loopback=True,
        min_read_rate_bytes_s=2 * 1024 * 1024,
        read_grace_s=1.0,
    )
    request = wire.encode_request(swarm_id=SWARM, nonce=bytes(16))
    addresses = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
    async with behind_sources(snapshot, config, addresses) as (donor, dialled, client):
        *slow, newcomer = dialled
        readers, taken = await _slow_readers(client, slow, request)
        assert donor.active == 2
        with pytest.raises(StateTransferError) as refused:
            await fetch(client, [newcomer])
        assert refused.value.failures[0].code == "busy"
        assert "already serves 2 downloads" in refused.value.failures[0].reason
        await wait_for(lambda: donor.stats["too-slow"] == 2, timeout=30)
        assert donor.active == 0 and donor.stats["dropped"] == 0  # not the write timeout
        assert donor.rejections.counts["too-slow"] == 2
        assert all(counter["messages"] >= 2 for counter in taken)  # they were reading
        got = await fetch(client, [newcomer], timeout=30)
        assert_same_state(got.snapshot, snapshot)
        assert donor.stats["too-slow"] == 2  # the honest reader was not taken for slow
        for reader_task in readers:
            reader_task.cancel()  # they would read the data sent ahead for seconds more
        await asyncio.gather(*readers, return_exceptions=True)


async def test_slow_readers_give_a_slot_up_to_a_newcomer_at_once():
    # Two networks each take one of two slots and read a 24 MB state at ~320 KiB/s, above
    # the donor's minimum (so it does not cut them off) but below the rate a slot is kept
    # at when others wait: a newcomer from a third network is served at once, in the slot
    # of one of them; the other reads on.
    snapshot = make_snapshot(3_000_000)
    config = DonorConfig(
        chunk_bytes=CHUNK,
        max_concurrent_downloads=2,
        limit_loopback=True,
        min_read_rate_bytes_s=64 * 1024,
        read_grace_s=1.0,
        yield_below_bytes_s=2 * 1024 * 1024,
        yield_window_s=1.0,
    )
    request = wire.encode_request(swarm_id=SWARM, nonce=bytes(16))
    addresses = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
    async with behind_sources(snapshot, config, addresses) as (donor, dialled, client):
        *slow, newcomer = dialled
        readers, _ = await _slow_readers(client, slow, request)
        assert donor.active == 2
        await wait_for(lambda: donor.yielding() == 2, timeout=30)
        # A request for another state costs nothing: it takes nobody's slot.
        other_digest = make_snapshot(10, seed=9).digest
        with pytest.raises(StateTransferError) as refused:
            await fetch(client, [newcomer], expected_digest=other_digest)
        assert refused.value.failures[0].code == "busy" and donor.stats["yielded"] == 0
        got = await fetch(client, [newcomer], timeout=30)
        assert_same_state(got.snapshot, snapshot)
        assert donor.stats["yielded"] == 1 and donor.rejections.counts["yielded"] == 1
        assert donor.stats["too-slow"] == 0 and donor.stats["busy"] == 1
        ended, _ = await asyncio.wait(readers, timeout=30, return_when=asyncio.FIRST_COMPLETED)
        (yielded,) = ended
        assert yielded.result().startswith("RESOURCE_EXHAUSTED: another requester asked")
        assert "ask another donor" in yielded.result()
        assert donor.active == 1  # the other slow reader still holds its slot
        for reader_task in readers:
            reader_task.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        await wait_for(lambda: donor.active == 0)


async def test_downloads_started_and_dropped_are_charged_whole():
    # Starting downloads over and over (to keep a slot young, say) costs the network a
    # whole state each, however little of it was read.
    snapshot = make_snapshot(1_000_000)
    config = DonorConfig(chunk_bytes=CHUNK, limit_loopback=True, budget_states=2)
    request = wire.encode_request(swarm_id=SWARM, nonce=bytes(16))
    async with behind_sources(snapshot, config, ["127.0.0.2", "127.0.0.3"]) as (
        donor,
        (starter, other),
        client,
    ):
        channel = await client.open(starter.endpoint, 10)
        for _ in range(2):
            call = channel.unary_stream(wire.DOWNLOAD_PATH)(request, timeout=10)
            assert pb.DownloadResponse.FromString(await call.read()).HasField("header")
            call.cancel()
            await wait_for(lambda: donor.active == 0)
        assert donor.stats["bytes"] < snapshot.nbytes
        with pytest.raises(StateTransferError) as refused:
            await fetch(client, [starter])
        assert "127.0.0.2 took" in refused.value.failures[0].reason
        assert donor.stats["budget-spent"] == 1
        assert_same_state((await fetch(client, [other])).snapshot, snapshot)


def test_the_rate_a_slot_is_kept_at_forgets_a_fast_start():
    # 100 MB read in a second, then 300 KB/s for two minutes: 1.1 MB/s on average since
    # the start, 0.36 MB/s over the last half minute or so.
    pace = _Pace(grace_s=10.0, min_rate=256 * 1024, window_s=30.0)
    pace.wrote(100_000_000, 1.0, now=1.0)
    for now in range(2, 121):
        pace.wrote(300_000, 1.0, now=float(now))
    pace.written, pace.waited = 100_000_000 + 119 * 300_000, 120.0
    assert pace.rate > 1e6
    assert 300_000 < pace.recent_rate(120.0) < 400_000
    pace.writing_since = 120.0  # a write waiting on the requester counts as it waits
    assert pace.recent_rate(130.0) < pace.recent_rate(120.0)


async def test_the_donors_own_upload_cap_is_not_taken_for_a_slow_reader():
    # The donor sends at 256 KiB/s (its own cap), below the 1 MiB/s it asks of readers:
    # the time its writes wait on the cap is its own, and the reader gets the whole state.
    snapshot = make_snapshot(100_000)
    limiter = BandwidthLimiter(BandwidthConfig(upload_bytes_per_s=256 * 1024))
    config = DonorConfig(chunk_bytes=CHUNK, min_read_rate_bytes_s=1024 * 1024, read_grace_s=0.2)
    async with honest(snapshot, config=config, limiter=limiter) as donor, RpcClient() as client:
        assert donor.donor is not None
        got = await fetch(client, [donor], config=DownloadConfig(min_rate_bytes_s=64 * 1024))
        assert_same_state(got.snapshot, snapshot)
        assert got.seconds > snapshot.nbytes / (256 * 1024) / 2  # the cap did slow it
        await wait_for(lambda: donor.donor.active == 0)  # its handler counts after the last chunk
        assert donor.donor.stats["too-slow"] == 0 and donor.donor.stats["served"] == 1


async def test_a_requester_that_keeps_pulling_is_refused_once_its_budget_is_spent():
    snapshot = make_snapshot(100_000)
    config = DonorConfig(chunk_bytes=CHUNK, limit_loopback=True, budget_states=2)
    addresses = ["127.0.0.2", "127.0.0.3"]
    async with behind_sources(snapshot, config, addresses) as (donor, dialled, client):
        pulling, other = dialled
        for _ in range(2):
            assert_same_state((await fetch(client, [pulling])).snapshot, snapshot)
        with pytest.raises(StateTransferError) as refused:
            await fetch(client, [pulling])
        failure = refused.value.failures[0]
        assert failure.code == "busy"
        assert "127.0.0.2 took" in failure.reason and "2 whole states per 600s" in failure.reason
        assert donor.rejections.counts["budget-spent"] == 1
        assert donor.stats["budget-spent"] == 1
        assert donor.stats["bytes"] == 2 * snapshot.nbytes  # nothing more left for it
        # A request for another state costs nothing and is still answered (header only).
        other_digest = make_snapshot(10, seed=9).digest
        with pytest.raises(StateTransferError, match="digest"):
            await fetch(client, [pulling], expected_digest=other_digest)
        # Another network has its own budget.
        assert_same_state((await fetch(client, [other])).snapshot, snapshot)


def test_a_byte_budget_drains_over_its_window():
    now = [0.0]
    budget = ByteBudget(window_s=600.0, clock=lambda: now[0], max_networks=4)
    state = 1000
    capacity = 3 * state
    for _ in range(3):
        assert budget.wait_s("203.0.113.0/24", state, capacity) == 0
        budget.charge("203.0.113.0/24", state, capacity)
    assert budget.wait_s("203.0.113.0/24", state, capacity) == pytest.approx(200.0)
    assert budget.wait_s("198.51.100.0/24", state, capacity) == 0  # another network
    assert budget.wait_s("203.0.113.0/24", 0, 0) == 0  # an empty state costs nothing
    now[0] = 100.0
    assert budget.level("203.0.113.0/24") == pytest.approx(2500.0)
    assert budget.wait_s("203.0.113.0/24", state, capacity) == pytest.approx(100.0)
    now[0] = 200.0
    assert budget.wait_s("203.0.113.0/24", state, capacity) == 0
    # Bounded: new networks push out the emptiest, never past the bound.
    for i in range(10):
        budget.charge(f"10.0.{i}.1", i + 1, capacity)
        assert len(budget._levels) <= 4
    assert budget.level("10.0.9.1") == 10
    assert budget.level("203.0.113.0/24") == pytest.approx(2000.0)  # the heavy user stays


async def test_a_donor_that_moved_on_serves_the_round_before_to_whoever_asks_for_it():
    older, newer = make_snapshot(5000, round=4, seed=1), make_snapshot(5000, round=5, seed=2)
    identity = Identity.generate()
    donor = StateDonor(
        identity=identity,
        snapshot=lambda: newer,
        previous=lambda: older,
        config=DonorConfig(chunk_bytes=CHUNK),
    )
    async with serving(state_service(donor)) as port, RpcClient() as client:
        served = Donor(identity.peer_id_hex, f"127.0.0.1:{port}")
        got = await fetch(client, [served], expected_round=4, expected_digest=older.digest)
        assert_same_state(got.snapshot, older)
        got = await fetch(client, [served], expected_round=5, expected_digest=newer.digest)
        assert_same_state(got.snapshot, newer)
        # Another state of round 4 is not served in its place.
        other = make_snapshot(5000, round=4, seed=3)
        with pytest.raises(StateTransferError, match="round 5, not 4"):
            await fetch(client, [served], expected_round=4, expected_digest=other.digest)
