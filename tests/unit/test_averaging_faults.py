"""The fault plan: which messages a fault hits, what it does to them, and its counters."""

import asyncio

import pytest
import torch

from swarmloco.net.averaging import wire
from swarmloco.net.averaging.faults import Fault, FaultCut, FaultPlan
from swarmloco.proto.v1 import averaging_pb2 as pb


def chunk(round: int = 5, index: int = 0) -> bytes:
    return wire.encode_chunk(
        group_id=b"g" * 16,
        round=round,
        part=1,
        epoch=0,
        index=index,
        payload=torch.ones(128, dtype=torch.int8),
        scales=torch.ones(2),
    )


async def test_faults_match_peer_round_phase_and_count():
    plan = FaultPlan(
        [
            Fault(action="drop", phase="chunk", peer="aa", round=5, skip=1, times=2),
            Fault(action="delay", phase="done", seconds=0.0),
        ]
    )
    sent = [await plan.outgoing("chunk", peer="aa", round=5, message=chunk()) for _ in range(4)]
    assert [m is None for m in sent] == [False, True, True, False]
    assert await plan.outgoing("chunk", peer="bb", round=5, message=chunk()) is not None
    assert await plan.outgoing("chunk", peer="aa", round=6, message=chunk()) is not None
    assert await plan.outgoing("done", peer="bb", round=1, message=b"x") == b"x"
    assert plan.fired == [2, 1]


async def test_corruptions_produce_what_they_say():
    nan = FaultPlan([Fault(action="corrupt", phase="chunk", corruption="nan")])
    message = wire.decode_request(await nan.outgoing("chunk", peer="a", round=5, message=chunk()))
    assert isinstance(message, wire.ChunkMessage)
    assert torch.isnan(wire.tensor_from(message.scales, torch.float32)).all()
    short = FaultPlan([Fault(action="corrupt", phase="chunk", corruption="truncate")])
    message = wire.decode_request(await short.outgoing("chunk", peer="a", round=5, message=chunk()))
    assert len(message.payload) == 64
    stale = FaultPlan([Fault(action="corrupt", phase="chunk", corruption="stale-round")])
    message = wire.decode_request(await stale.outgoing("chunk", peer="a", round=5, message=chunk()))
    assert message.round == 4
    bloat = FaultPlan([Fault(action="corrupt", phase="done", corruption="bloat")])
    done = wire.request(done=pb.MemberDone(digest=b"d" * 16))
    message = wire.decode_request(await bloat.outgoing("done", peer="a", round=5, message=done))
    assert isinstance(message, pb.AggregateRequest) and len(message.done.digest) == 1 << 20
    with pytest.raises(ValueError):
        Fault(action="corrupt", phase="chunk", corruption="bloat")
    negate = FaultPlan([Fault(action="corrupt", phase="result", corruption="negate")])
    values = torch.tensor([-128, -5, 0, 7, 127], dtype=torch.int8)
    result = wire.encode_result(
        part=1, epoch=0, index=0, payload=values, scales=torch.ones(1), contributors=b"\x03"
    )
    message = wire.decode_response(
        await negate.outgoing("result", peer="a", round=5, message=result)
    )
    assert isinstance(message, wire.ResultMessage) and message.contributors == b"\x03"
    assert wire.tensor_from(message.payload, torch.int8).tolist() == [127, 5, 0, -7, -127]


async def test_replay_sends_the_message_of_an_earlier_round():
    plan = FaultPlan([Fault(action="replay", phase="chunk", round=6)])
    old = chunk(round=5)
    assert await plan.outgoing("chunk", peer="a", round=5, message=old) == old
    assert await plan.outgoing("chunk", peer="a", round=6, message=chunk(round=6)) == old
    assert plan.fired == [1]


async def test_cut_after_bytes_and_stall_until_cancelled():
    plan = FaultPlan(
        [
            Fault(action="cut", phase="chunk", after_bytes=300),
            Fault(action="stall", phase="handler"),
        ]
    )
    message = chunk()
    assert await plan.outgoing("chunk", peer="a", round=5, message=message, call_bytes=0)
    with pytest.raises(FaultCut):
        await plan.outgoing("chunk", peer="a", round=5, message=message, call_bytes=len(message))
    stalled = asyncio.ensure_future(plan.handler(peer="a", round=5))
    await asyncio.sleep(0.05)
    assert not stalled.done() and plan.fired == [1, 1]
    stalled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stalled


def test_bad_faults_are_configuration_errors():
    with pytest.raises(ValueError):
        Fault(action="explode", phase="chunk")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Fault(action="corrupt", phase="done")


def test_an_audits_segment_is_altered_with_its_hashes_kept():
    segment = pb.Segment(
        reducer=1,
        part=2,
        epoch=0,
        index=3,
        segment=4,
        payload=bytes([1, 2, 3, 255]),
        scales=b"\x00\x00\x80\x3f",
        hashes=b"h" * 32,
    )
    message = pb.AggregateRequest(segment=segment).SerializeToString()
    plan = FaultPlan([Fault(action="corrupt", phase="segment", corruption="negate")])
    altered = asyncio.run(plan.outgoing("segment", peer="a", round=5, message=message))
    assert altered is not None
    got = pb.AggregateRequest.FromString(altered).segment
    assert got.payload == bytes([255, 254, 253, 1])  # -1, -2, -3, 1 as int8
    assert (got.hashes, got.scales, got.index, got.segment) == (b"h" * 32, segment.scales, 3, 4)
