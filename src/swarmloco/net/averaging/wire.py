"""The bytes of the Aggregate stream: its messages encoded and decoded, the hot ones by hand.

Every Aggregate message is a ``swarmloco.v1.AggregateRequest`` or ``AggregateResponse``
(``proto/swarmloco/v1/averaging.proto``). The stream's gRPC methods use identity
(de)serializers and this module does the encoding, because the generated protobuf code
copies every ``bytes`` field at least twice per message: building a ``PartChunk`` from a
1 MiB int8 slice, serializing it and parsing it again would cost more CPU than the rest of
the all-reduce. So the two hot messages (:class:`ChunkMessage` inside a request, the
result chunk inside a response) are written here with one copy (a ``join`` of the header
and the tensors' own buffers) and read back as memoryviews into the received bytes, with
no copy at all. Their encoding is the protobuf wire format of the .proto, field for field
(a test checks that the generated classes read what we write and the other way round);
the rare messages (hello, done, verdict, ...) go through the generated classes.

Also here: the payload of the stream hello signature, and the bitmap of contributors.
"""

from __future__ import annotations

import dataclasses
import struct
import warnings
from collections.abc import Iterable, Sequence

import torch

from swarmloco.net.rejections import Rejection
from swarmloco.proto.v1 import averaging_pb2 as pb

SERVICE_NAME = "swarmloco.v1.Averaging"
AGGREGATE_PATH = f"/{SERVICE_NAME}/Aggregate"
HELLO_DOMAIN = b"swarmloco/v1/aggregate-hello\x00"
DONE_DOMAIN = b"swarmloco/v1/member-done\x00"
SEAL_DOMAIN = b"swarmloco/v1/part-seal\x00"
STATEMENT_DOMAIN = b"swarmloco/v1/chunk-statement\x00"
STATEMENTS_DOMAIN = b"swarmloco/v1/audit-answer\x00"

# Field numbers in averaging.proto.
_REQUEST_CHUNK = 2  # AggregateRequest.chunk
_RESPONSE_RESULT = 1  # AggregateResponse.result

_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5


# -- protobuf wire format primitives ---------------------------------------------------------


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        bits = value & 0x7F
        value >>= 7
        if value:
            out.append(bits | 0x80)
        else:
            out.append(bits)
            return bytes(out)


def _key(field: int, wire_type: int) -> bytes:
    return _varint(field << 3 | wire_type)


def _uint_field(field: int, value: int) -> bytes:
    # proto3 leaves fields at their default value out; so do we, to match it byte for byte.
    return _key(field, _VARINT) + _varint(value) if value else b""


def _bytes_header(field: int, length: int) -> bytes:
    return _key(field, _LENGTH) + _varint(length) if length else b""


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise Rejection("malformed", "truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise Rejection("malformed", "varint longer than 64 bits")


def parse_fields(buf: memoryview) -> dict[int, int | memoryview]:
    """The fields of one protobuf message: ``{number: int or memoryview}`` (last one wins).

    Unknown fields are kept like known ones (the caller ignores them); fixed-width fields
    are returned as integers. Raises Rejection("malformed") on truncated input.
    """
    fields: dict[int, int | memoryview] = {}
    pos, end = 0, len(buf)
    while pos < end:
        key, pos = _read_varint(buf, pos)
        field, wire_type = key >> 3, key & 7
        if field == 0:
            raise Rejection("malformed", "field number 0")
        if wire_type == _VARINT:
            fields[field], pos = _read_varint(buf, pos)
        elif wire_type == _LENGTH:
            length, pos = _read_varint(buf, pos)
            if pos + length > end:
                raise Rejection("malformed", "a length-delimited field runs past the message")
            fields[field] = buf[pos : pos + length]
            pos += length
        elif wire_type in (_FIXED64, _FIXED32):
            width = 8 if wire_type == _FIXED64 else 4
            if pos + width > end:
                raise Rejection("malformed", "a fixed-width field runs past the message")
            fields[field] = int.from_bytes(buf[pos : pos + width], "little")
            pos += width
        else:
            raise Rejection("malformed", f"unsupported wire type {wire_type}")
    return fields


def _uint(fields: dict[int, int | memoryview], number: int) -> int:
    value = fields.get(number, 0)
    if not isinstance(value, int):
        raise Rejection("malformed", f"field {number} should be an integer")
    return value


def _view(fields: dict[int, int | memoryview], number: int) -> memoryview:
    value = fields.get(number, memoryview(b""))
    if not isinstance(value, memoryview):
        raise Rejection("malformed", f"field {number} should be bytes")
    return value


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(tensor.numpy()).cast("B")  # type: ignore[arg-type]


def tensor_from(data: memoryview, dtype: torch.dtype) -> torch.Tensor:
    """A read-only tensor over received bytes (no copy); never written to."""
    if len(data) == 0:
        return torch.empty(0, dtype=dtype)
    with warnings.catch_warnings():
        # The buffer is the immutable bytes gRPC handed us. torch warns that it cannot mark
        # the tensor read-only; we only ever read it (decode), so the warning is noise.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=dtype)


# -- the hot messages ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class ChunkMessage:
    """A decoded ``PartChunk``: views into the received bytes (valid while they live)."""

    group_id: bytes
    round: int
    part: int
    epoch: int
    index: int
    payload: memoryview
    scales: memoryview
    signature: bytes = b""
    norms: bytes = b""
    """The sender's statement of the chunk: its signature, and the squared norms it claims of
    its segments (float64 little-endian, :func:`norms_of`)."""


def encode_chunk(
    *,
    group_id: bytes,
    round: int,
    part: int,
    epoch: int,
    index: int,
    payload: torch.Tensor,
    scales: torch.Tensor,
    signature: bytes = b"",
    norms: bytes = b"",
) -> bytes:
    """``AggregateRequest{chunk: PartChunk{...}}`` with one copy of the tensors' bytes."""
    data, scale_data = _tensor_bytes(payload), _tensor_bytes(scales)
    head = b"".join(
        (
            _bytes_header(1, len(group_id)),
            group_id,
            _uint_field(2, round),
            _uint_field(3, part),
            _uint_field(4, epoch),
            _uint_field(5, index),
            _bytes_header(6, len(data)),
        )
    )
    tail = b"".join(
        (
            _bytes_header(7, len(scale_data)),
            scale_data,
            _bytes_header(8, len(signature)),
            signature,
            _bytes_header(10, len(norms)),
            norms,
        )
    )
    inner = len(head) + len(data) + len(tail)
    outer = _key(_REQUEST_CHUNK, _LENGTH) + _varint(inner)
    return b"".join((outer, head, data, tail))


def encode_result(
    *,
    part: int,
    epoch: int,
    index: int,
    payload: torch.Tensor,
    scales: torch.Tensor,
    contributors: bytes,
) -> bytes:
    """``AggregateResponse{result: ResultChunk{...}}`` with one copy of the tensors' bytes."""
    data, scale_data = _tensor_bytes(payload), _tensor_bytes(scales)
    head = b"".join(
        (
            _uint_field(1, part),
            _uint_field(2, epoch),
            _uint_field(3, index),
            _bytes_header(4, len(data)),
        )
    )
    tail = b"".join(
        (
            _bytes_header(5, len(scale_data)),
            scale_data,
            _bytes_header(6, len(contributors)),
            contributors,
        )
    )
    inner = len(head) + len(data) + len(tail)
    outer = _key(_RESPONSE_RESULT, _LENGTH) + _varint(inner)
    return b"".join((outer, head, data, tail))


@dataclasses.dataclass(frozen=True, slots=True)
class ResultMessage:
    """A decoded ``ResultChunk``: views into the received bytes."""

    part: int
    epoch: int
    index: int
    payload: memoryview
    scales: memoryview
    contributors: bytes


def _oneof(data: bytes) -> tuple[int, memoryview | int | None]:
    """The set member of a top-level oneof (the last one on the wire wins)."""
    fields = parse_fields(memoryview(data))
    if not fields:
        return 0, None
    number = next(reversed(fields))
    return number, fields[number]


def decode_request(data: bytes) -> ChunkMessage | pb.AggregateRequest:
    """A request off the stream: a ChunkMessage (no copy), else the generated message."""
    number, value = _oneof(data)
    if number == _REQUEST_CHUNK and isinstance(value, memoryview):
        f = parse_fields(value)
        return ChunkMessage(
            group_id=bytes(_view(f, 1)),
            round=_uint(f, 2),
            part=_uint(f, 3),
            epoch=_uint(f, 4),
            index=_uint(f, 5),
            payload=_view(f, 6),
            scales=_view(f, 7),
            signature=bytes(_view(f, 8)),
            norms=bytes(_view(f, 10)),
        )
    try:
        return pb.AggregateRequest.FromString(data)
    except Exception:  # any parse failure of untrusted bytes
        raise Rejection("malformed", "the request is not a valid AggregateRequest") from None


def decode_response(data: bytes) -> ResultMessage | pb.AggregateResponse:
    """A response off the stream: a ResultMessage (no copy), else the generated message."""
    number, value = _oneof(data)
    if number == _RESPONSE_RESULT and isinstance(value, memoryview):
        f = parse_fields(value)
        return ResultMessage(
            part=_uint(f, 1),
            epoch=_uint(f, 2),
            index=_uint(f, 3),
            payload=_view(f, 4),
            scales=_view(f, 5),
            contributors=bytes(_view(f, 6)),
        )
    try:
        return pb.AggregateResponse.FromString(data)
    except Exception:  # any parse failure of untrusted bytes
        raise Rejection("malformed", "the response is not a valid AggregateResponse") from None


# -- small helpers ---------------------------------------------------------------------------


def hello_payload(group_id: bytes, round: int, sender: int, reducer: int) -> bytes:
    """What a sender signs to open a stream: the group, the round and both member indices."""
    return group_id + struct.pack("<QII", round, sender, reducer)


def seal_payload(group_id: bytes, round: int, seal: pb.Seal) -> bytes:
    """What a reducer signs to seal a part: the group, the round, the part, the epoch, its
    own index and the hash of the part's result messages."""
    return group_id + struct.pack("<QIII", round, seal.part, seal.epoch, seal.reducer) + seal.hash


def statement_payload(
    group_id: bytes,
    round: int,
    reducer: int,
    part: int,
    epoch: int,
    *,
    sender: int,
    index: int,
    root: bytes,
    norms: bytes,
) -> bytes:
    """What a sender signs about one chunk it sent a reducer (its *statement*, see
    ``audit.py``): the group, the round, the sender, the reducer, the part, the epoch, the
    chunk's index, its root and its segments' squared norms (:func:`norms_of`)."""
    return (
        group_id
        + struct.pack("<QIIIIIH", round, sender, reducer, part, epoch, index, len(root))
        + root
        + norms
    )


def statements_payload(group_id: bytes, round: int, reducer: int, answer: pb.Statements) -> bytes:
    """What a reducer signs of its answer to an audit (``answer``'s signature aside): the
    group, the round, its own index, the part, the epoch and every statement it holds, each
    with its sender's signature."""
    out = [
        group_id,
        struct.pack("<QIIII", round, reducer, answer.part, answer.epoch, len(answer.statements)),
    ]
    for s in answer.statements:
        out.append(
            struct.pack("<IIIII", s.sender, s.index, len(s.root), len(s.norms), len(s.signature))
        )
        out += [s.root, s.norms, s.signature]
    return b"".join(out)


def packed_norms(norms: Sequence[float]) -> bytes:
    """Segments' squared norms as a statement carries them: float64 little-endian."""
    return struct.pack(f"<{len(norms)}d", *norms)


def norms_of(data: bytes) -> tuple[float, ...]:
    """The squared norms a statement carries; Rejection if they are not whole float64s."""
    if len(data) % 8:
        raise Rejection("malformed", f"segment norms of {len(data)} bytes, not float64s")
    return struct.unpack(f"<{len(data) // 8}d", data)


def done_payload(group_id: bytes, round: int, member: int, seq: int, digest: bytes) -> bytes:
    """What a member signs to announce its digest: the group, the round, its index, the
    number of the announcement in the round and the digest."""
    return group_id + struct.pack("<QII", round, member, seq) + digest


def bitmap(members: Iterable[int], size: int) -> bytes:
    """Member indices as a bitmap (bit i of byte i // 8, least significant bit first)."""
    out = bytearray((size + 7) // 8)
    for i in members:
        out[i // 8] |= 1 << (i % 8)
    return bytes(out)


def members_of(bits: bytes, size: int) -> list[int]:
    """The member indices set in a bitmap; Rejection if it names members beyond ``size``."""
    if len(bits) != (size + 7) // 8:
        raise Rejection(
            "bad-result", f"contributor bitmap has {len(bits)} bytes for {size} members"
        )
    found = [i for i in range(size) if bits[i // 8] >> (i % 8) & 1]
    if any(bits[i // 8] >> (i % 8) & 1 for i in range(size, len(bits) * 8)):
        raise Rejection("bad-result", "contributor bitmap names members outside the group")
    return found


def request(**kind: object) -> bytes:
    """A rare request (hello, done, heartbeat), through the generated class."""
    return pb.AggregateRequest(**kind).SerializeToString()  # type: ignore[arg-type]


def response(**kind: object) -> bytes:
    """A rare response (rerun, verdict, refusal, heartbeat), through the generated class."""
    return pb.AggregateResponse(**kind).SerializeToString()  # type: ignore[arg-type]


HEARTBEAT_REQUEST = request(heartbeat=pb.Heartbeat())
HEARTBEAT_RESPONSE = response(heartbeat=pb.Heartbeat())


def scales_dtype(scale_bytes: int) -> torch.dtype:
    return torch.float32 if scale_bytes == 4 else torch.float16


def check_sizes(
    payload: memoryview, scales: memoryview, *, numel: int, block_size: int, scale_bytes: int
) -> None:
    """Refuse a payload/scales pair that does not hold exactly one chunk of ``numel``."""
    if len(payload) != numel:
        raise Rejection("bad-size", f"chunk has {len(payload)} int8 values, expected {numel}")
    blocks = numel // block_size
    if len(scales) != blocks * scale_bytes:
        raise Rejection(
            "bad-size", f"chunk has {len(scales)} bytes of scales, expected {blocks * scale_bytes}"
        )
