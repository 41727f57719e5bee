"""The hand-written encoding of the hot Aggregate messages is the .proto's wire format."""

import pytest
import torch

from swarmloco.net.averaging import wire
from swarmloco.net.rejections import Rejection
from swarmloco.proto.v1 import averaging_pb2 as pb


def _tensors(numel: int = 256, blocks: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    payload = torch.randint(-127, 128, (numel,), dtype=torch.int8)
    scales = torch.rand(blocks)
    return payload, scales


def test_chunks_match_the_generated_code_byte_for_byte():
    payload, scales = _tensors()
    ours = wire.encode_chunk(
        group_id=b"g" * 16, round=7, part=2, epoch=1, index=300, payload=payload, scales=scales
    )
    chunk = pb.PartChunk(
        group_id=b"g" * 16,
        round=7,
        part=2,
        epoch=1,
        index=300,
        payload=payload.numpy().tobytes(),
        scales=scales.numpy().tobytes(),
    )
    assert ours == pb.AggregateRequest(chunk=chunk).SerializeToString()
    parsed = pb.AggregateRequest.FromString(ours)
    assert parsed.chunk == chunk
    # With the sender's statement (a signature and its segments' squared norms, doubles).
    norms = wire.packed_norms([1234.5, 0.0, 2.5e-7])
    stated = wire.encode_chunk(
        group_id=b"g" * 16,
        round=7,
        part=2,
        epoch=1,
        index=300,
        payload=payload,
        scales=scales,
        signature=b"s" * 64,
        norms=norms,
    )
    chunk.signature, chunk.norms = b"s" * 64, norms
    assert stated == pb.AggregateRequest(chunk=chunk).SerializeToString()
    back = wire.decode_request(stated)
    assert isinstance(back, wire.ChunkMessage)
    assert (back.signature, back.norms, back.index) == (b"s" * 64, norms, 300)
    assert wire.norms_of(back.norms) == (1234.5, 0.0, 2.5e-7)
    with pytest.raises(Rejection):
        wire.norms_of(norms[:-1])
    # Zero fields (part 0, epoch 0, index 0) are left out, as protobuf does.
    zero = wire.encode_chunk(
        group_id=b"g", round=0, part=0, epoch=0, index=0, payload=payload, scales=scales
    )
    assert (
        zero
        == pb.AggregateRequest(
            chunk=pb.PartChunk(
                group_id=b"g", payload=payload.numpy().tobytes(), scales=scales.numpy().tobytes()
            )
        ).SerializeToString()
    )


def test_chunks_decode_without_copies_whatever_wrote_them():
    payload, scales = _tensors()
    data = pb.AggregateRequest(
        chunk=pb.PartChunk(
            group_id=b"x" * 16,
            round=2**40,
            part=3,
            epoch=0,
            index=5,
            payload=payload.numpy().tobytes(),
            scales=scales.numpy().tobytes(),
        )
    ).SerializeToString()
    chunk = wire.decode_request(data)
    assert isinstance(chunk, wire.ChunkMessage)
    assert (chunk.group_id, chunk.round, chunk.part, chunk.epoch, chunk.index) == (
        b"x" * 16,
        2**40,
        3,
        0,
        5,
    )
    assert torch.equal(wire.tensor_from(chunk.payload, torch.int8), payload)
    assert torch.equal(wire.tensor_from(chunk.scales, torch.float32), scales)
    assert chunk.payload.obj is data  # a view into the received bytes, not a copy


def test_results_round_trip_and_match_the_generated_code():
    payload, scales = _tensors()
    bits = wire.bitmap([0, 3, 9], 10)
    ours = wire.encode_result(
        part=1, epoch=2, index=3, payload=payload, scales=scales, contributors=bits
    )
    expected = pb.AggregateResponse(
        result=pb.ResultChunk(
            part=1,
            epoch=2,
            index=3,
            payload=payload.numpy().tobytes(),
            scales=scales.numpy().tobytes(),
            contributors=bits,
        )
    )
    assert ours == expected.SerializeToString()
    result = wire.decode_response(ours)
    assert isinstance(result, wire.ResultMessage)
    assert (result.part, result.epoch, result.index) == (1, 2, 3)
    assert wire.members_of(result.contributors, 10) == [0, 3, 9]
    assert torch.equal(wire.tensor_from(result.payload, torch.int8), payload)


def test_rare_messages_go_through_the_generated_code():
    data = wire.request(done=pb.MemberDone(digest=b"d" * 16))
    message = wire.decode_request(data)
    assert isinstance(message, pb.AggregateRequest)
    assert message.WhichOneof("kind") == "done"
    verdict = wire.decode_response(wire.response(verdict=pb.Verdict(agreed=True, digest=b"x")))
    assert isinstance(verdict, pb.AggregateResponse) and verdict.verdict.agreed


@pytest.mark.parametrize(
    "data",
    [
        b"\x12\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",  # varint longer than 64 bits
        b"\x12\x05abc",  # length past the end
        b"\x12\x03\x32\x10a",  # inner payload length past the end
        b"\x0b",  # unsupported wire type (group start)
    ],
)
def test_malformed_input_is_a_rejection(data):
    with pytest.raises(Rejection):
        wire.decode_request(data)


def test_bitmaps_refuse_members_outside_the_group():
    assert wire.members_of(wire.bitmap([1, 2], 3), 3) == [1, 2]
    with pytest.raises(Rejection):
        wire.members_of(b"\x08", 3)  # bit 3 of a group of 3
    with pytest.raises(Rejection):
        wire.members_of(b"\x01\x00", 3)  # wrong length
