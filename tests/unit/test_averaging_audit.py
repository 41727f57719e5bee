"""Audits of a reducer's part (``net/averaging/audit.py``): a segment of a real
PartReduction's result recomputed from its senders' signed bytes, passing when the reducer
was honest, naming it when it was not, and naming a sender that shows other bytes than it
signed; with silent contributors, the result held within what their signed norms allow."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from swarmloco.core.aggregate import AggregatorConfig
from swarmloco.core.codec import CodecConfig, chunk_spans, quantize
from swarmloco.net.averaging import wire
from swarmloco.net.averaging.audit import (
    SILENT_KEPT,
    SILENT_S,
    Audit,
    Claimed,
    Piece,
    Silent,
    Statement,
    decoded,
    excess,
    measured,
    piece_of,
    recompute,
    root_of,
    segment_hashes,
    segment_norms,
    segment_span,
    segments_of,
)
from swarmloco.net.averaging.reduction import PartReduction
from swarmloco.net.identity import Identity, verify
from swarmloco.net.rejections import Rejection
from swarmloco.proto.v1 import averaging_pb2 as pb

GROUP = b"g" * 16
ROUND, PART, EPOCH, REDUCER = 7, 0, 0, 0
MEMBERS = 4
WEIGHTS = [1.0, 2.0, 1.0, 1.5]


@dataclasses.dataclass
class Reduced:
    """One part reduced for real: every sender's chunks, statements and the results."""

    codec: CodecConfig
    aggregator: AggregatorConfig
    spans: list
    slices: dict  # sender -> [(payload, scales)] per chunk
    statements: list[Statement]
    results: list  # per chunk: (payload, scales, contributors)
    keys: list[Identity]
    bound: float


def _signed_part(sender: int, index: int, root: bytes, norms) -> bytes:
    return wire.statement_payload(
        GROUP,
        ROUND,
        REDUCER,
        PART,
        EPOCH,
        sender=sender,
        index=index,
        root=root,
        norms=wire.packed_norms(norms),
    )


def _signed(key: Identity, sender: int, index: int, root: bytes, norms) -> Statement:
    """``sender``'s statement of chunk ``index``, signed with ``key``."""
    signature = key.sign(wire.STATEMENT_DOMAIN, _signed_part(sender, index, root, norms))
    return Statement(sender, index, root, tuple(norms), signature)


def _statement(key: Identity, sender: int, index: int, payload, scales, codec) -> Statement:
    hashes = segment_hashes(
        payload.numpy().tobytes(),
        scales.numpy().tobytes(),
        block_size=codec.block_size,
        scale_bytes=codec.scale_bytes,
    )
    return _signed(
        key, sender, index, root_of(hashes), segment_norms(payload, scales, codec.block_size)
    )


def _reduce(
    method: str = "mean",
    *,
    scale_dtype: str = "float32",
    seed: int = 0,
    reversed_by_reducer: int | None = None,
    parallel: bool = False,
) -> Reduced:
    """One part reduced; ``reversed_by_reducer``: a sender whose slice the reducer counts
    reversed (the same norm), its statements and slices left as it signed them;
    ``parallel``: every sender's update one direction (its norm the sum of theirs)."""
    # 16-value blocks, 40 blocks a chunk (three segments, the last short), three chunks.
    scale_bytes = 4 if scale_dtype == "float32" else 2
    codec = CodecConfig(
        block_size=16,
        scale_dtype=scale_dtype,  # type: ignore[arg-type]
        chunk_bytes=40 * (16 + scale_bytes),
    )
    aggregator = AggregatorConfig(method=method)  # type: ignore[arg-type]
    numel = 16 * 100
    spans = chunk_spans(numel, codec)
    assert [s.blocks for s in spans] == [40, 40, 20]
    keys = [Identity.generate() for _ in range(MEMBERS)]
    generator = torch.Generator().manual_seed(seed)
    bound = 1000.0
    reduction = PartReduction(
        part=PART,
        epoch=EPOCH,
        spans=spans,
        weights=WEIGHTS,
        senders=range(MEMBERS),
        codec=codec,
        aggregator=aggregator,
        timeout=10.0,
        now=0.0,
        norm_bound=bound,
    )
    slices: dict[int, list] = {}
    statements = []
    direction = torch.randn(numel, generator=generator)
    for sender in range(MEMBERS):
        if not parallel:
            direction = torch.randn(numel, generator=generator)
        vector = direction * (sender + 1)
        q, s = quantize(vector, codec)
        chunks = []
        for span in spans:
            payload = q[span.start : span.stop]
            scales = s[span.first_block : span.first_block + span.blocks]
            chunks.append((payload, scales))
            statements.append(_statement(keys[sender], sender, span.index, payload, scales, codec))
            counted = -payload if sender == reversed_by_reducer else payload
            reduction.accept(sender, span.index, counted, scales, 0.0, remote=sender != REDUCER)
        slices[sender] = chunks
    results = []
    while reduction.ready():
        _index, payload, scales, contributors = reduction.finish()
        results.append((payload, scales, contributors))
    assert reduction.done
    return Reduced(codec, aggregator, spans, slices, statements, results, keys, bound)


def _audit(reduced: Reduced, index: int, segment: int, received=None) -> Audit:
    """The audit of ``segment`` of chunk ``index``; ``received``: per chunk, the result
    the auditor got where it is not the reduction's (a lie)."""
    received = received or {}

    def check(statement: Statement) -> bool:
        sender = statement.sender
        signed = _signed_part(sender, statement.index, statement.root, statement.norms)
        key = reduced.keys[sender].public_key
        return verify(key, statement.signature, wire.STATEMENT_DOMAIN, signed)

    return Audit(
        part=PART,
        epoch=EPOCH,
        reducer=REDUCER,
        index=index,
        segment=segment,
        chunks=[
            Claimed(
                span.blocks,
                tuple(reduced.results[i][2]),
                measured(*received.get(i, reduced.results[i][:2]), reduced.codec.block_size),
            )
            for i, span in enumerate(reduced.spans)
        ],
        included=dict.fromkeys(range(MEMBERS), len(reduced.spans)),
        weights=WEIGHTS,
        codec=reduced.codec,
        aggregator=reduced.aggregator,
        norm_bound=reduced.bound,
        verify=check,
    )


def _piece(reduced: Reduced, sender: int, index: int, segment: int) -> Piece:
    block = reduced.codec.block_size
    payload, scales = reduced.slices[sender][index]
    first, count = segment_span(segment, reduced.spans[index].blocks)
    hashes = segment_hashes(
        payload.numpy().tobytes(),
        scales.numpy().tobytes(),
        block_size=block,
        scale_bytes=reduced.codec.scale_bytes,
    )
    return Piece(
        sender,
        payload[first * block : (first + count) * block],
        scales[first : first + count],
        tuple(hashes),
    )


def _result_segment(reduced: Reduced, index: int, segment: int, payload=None, scales=None):
    block = reduced.codec.block_size
    got_payload, got_scales, _ = reduced.results[index]
    payload = got_payload if payload is None else payload
    scales = got_scales if scales is None else scales
    first, count = segment_span(segment, reduced.spans[index].blocks)
    return payload[first * block : (first + count) * block], scales[first : first + count]


def _run(
    reduced: Reduced,
    index: int,
    segment: int,
    *,
    payload=None,
    scales=None,
    pieces=None,
    silent=(),
):
    got_payload, got_scales, _ = reduced.results[index]
    received = {
        index: (
            got_payload if payload is None else payload,
            got_scales if scales is None else scales,
        )
    }
    audit = _audit(reduced, index, segment, received)
    assert audit.take_statements(reduced.statements) is None
    for sender in range(MEMBERS):
        if sender not in silent:
            audit.take_piece((pieces or {}).get(sender) or _piece(reduced, sender, index, segment))
    assert audit.ready == (not silent)
    audit.hush(silent)
    assert audit.ready
    return audit.verdict(*_result_segment(reduced, index, segment, payload, scales))


@pytest.mark.parametrize(
    ("method", "scale_dtype", "parallel"),
    [
        ("mean", "float32", False),
        ("trimmed_mean", "float32", False),
        ("mean", "float16", False),
        ("mean", "float32", True),
        ("mean", "float16", True),
        ("trimmed_mean", "float16", True),
        ("centered_clip", "float32", False),
        ("centered_clip", "float16", True),
    ],
)
def test_every_segment_of_an_honest_reduction_passes(
    method: str, scale_dtype: str, parallel: bool
) -> None:
    # Parallel updates make the mean as long as its senders' norms allow (the tightest
    # case of every segment's bound), to the rounding.
    reduced = _reduce(method, scale_dtype=scale_dtype, parallel=parallel)
    for index, span in enumerate(reduced.spans):
        for segment in range(segments_of(span.blocks)):
            outcome = _run(reduced, index, segment)
            assert outcome.liar is None, (index, segment, outcome.reason)


@pytest.mark.parametrize("method", ["mean", "trimmed_mean"])
def test_a_reversed_result_names_the_reducer_in_every_segment(method: str) -> None:
    reduced = _reduce(method)
    for index, span in enumerate(reduced.spans):
        payload, _scales, _ = reduced.results[index]
        for segment in range(segments_of(span.blocks)):
            outcome = _run(reduced, index, segment, payload=-payload)
            assert outcome.liar == REDUCER, (index, segment)
            assert "not its senders' aggregate" in outcome.reason


def test_two_steps_off_on_one_value_are_seen_in_its_segment_only() -> None:
    reduced = _reduce()
    payload, _scales, _ = reduced.results[1]
    lied = payload.clone()
    at = 16 * 20 + 3  # block 20: segment 1
    lied[at] = lied[at] + (2 if lied[at] < 100 else -2)
    outcomes = [_run(reduced, 1, segment, payload=lied) for segment in range(3)]
    assert [o.liar for o in outcomes] == [None, REDUCER, None]


def test_a_value_moved_two_steps_is_always_seen_and_one_step_may_not_be() -> None:
    # An honest value is within half a step of the true aggregate; the tolerance allows
    # half a step (and float rounding), so a liar moves each value unseen by at most one
    # step from the honest rounding, never more than half a step from the true value.
    reduced = _reduce()
    _payload, _scales, _ = reduced.results[0]
    block = reduced.codec.block_size
    pieces = [_piece(reduced, sender, 0, 0) for sender in range(MEMBERS)]
    rows = [decoded(p.payload, p.scales, block) for p in pieces]
    expected = recompute(rows, WEIGHTS, reduced.aggregator)
    segment = _result_segment(reduced, 0, 0)
    assert excess(segment[0], segment[1], expected, rows, reduced.codec) == 0.0
    for at in range(0, 16 * 16, 37):
        lied = segment[0].clone()
        lied[at] = lied[at] + (1 if lied[at] < 100 else -1)
        assert 0.0 <= excess(lied, segment[1], expected, rows, reduced.codec) <= 1.001
        lied[at] = lied[at] + (1 if lied[at] < 100 else -1)
        assert excess(lied, segment[1], expected, rows, reduced.codec) >= 0.98


@pytest.mark.parametrize("silent", [(), (2,)])
def test_a_segment_zeroed_under_huge_scales_names_the_reducer(silent) -> None:
    # Every value of a segment 0 under scales 1e4 times the honest ones is within half a
    # step of anything: the rounding an audit allows counts no larger a step than an
    # honest reducer's scale (the aggregate's largest value over 127).
    reduced = _reduce()
    payload, scales, _ = reduced.results[0]
    for segment in range(3):
        zeroed = torch.zeros_like(payload)
        outcome = _run(reduced, 0, segment, payload=zeroed, scales=scales * 1e4, silent=silent)
        assert outcome.liar == REDUCER, (segment, outcome.reason)


@pytest.mark.parametrize("method", ["mean", "trimmed_mean", "centered_clip"])
def test_a_segment_past_its_senders_signed_norms_names_the_reducer_in_every_audit(method):
    # One segment of one chunk x20, the rest true: every audit, whichever chunk and segment
    # it drew, holds every segment of the part to what its senders' signed norms allow.
    # (The part's own bound let a lie on a few segments take the whole part's budget;
    # CenteredClip's parts were not audited at all.)
    reduced = _reduce(method)
    payload, scales, _ = reduced.results[1]
    values = decoded(payload, scales, reduced.codec.block_size)
    values[16 * 16 : 32 * 16] *= 20  # segment 1 of chunk 1
    lied = quantize(values.float(), reduced.codec)
    for index, span in enumerate(reduced.spans):
        for segment in range(segments_of(span.blocks)):
            audit = _audit(reduced, index, segment, received={1: lied})
            outcome = audit.take_statements(reduced.statements)
            assert outcome is not None and outcome.liar == REDUCER, (index, segment)
            assert "chunk 1 of part 0, segment 1, measures" in outcome.reason


def test_a_sender_showing_other_bytes_than_it_signed_is_named_not_the_reducer() -> None:
    reduced = _reduce()
    honest = _piece(reduced, 2, 0, 1)
    other = Piece(2, -honest.payload, honest.scales, honest.hashes)
    assert _run(reduced, 0, 1, pieces={2: other}).liar == 2
    rehashed = list(honest.hashes)
    rehashed[1] = segment_hashes(
        other.payload.numpy().tobytes(),
        other.scales.numpy().tobytes(),
        block_size=16,
        scale_bytes=4,
    )[0]
    outcome = _run(
        reduced, 0, 1, pieces={2: Piece(2, other.payload, other.scales, tuple(rehashed))}
    )
    assert (outcome.liar, outcome.reason) == (2, "its segment hashes are not the chunk it signed")


def test_the_reducers_answer_must_show_every_counted_chunk_signed_and_within_the_bound() -> None:
    reduced = _reduce()
    missing = [s for s in reduced.statements if (s.sender, s.index) != (3, 2)]
    outcome = _audit(reduced, 0, 0).take_statements(missing)
    assert outcome is not None and outcome.liar == REDUCER and "lacks" in outcome.reason
    forged = [
        dataclasses.replace(s, norms=tuple(n / 4 for n in s.norms))
        if (s.sender, s.index) == (1, 0)
        else s
        for s in reduced.statements
    ]
    outcome = _audit(reduced, 0, 0).take_statements(forged)
    assert outcome is not None and outcome.liar == REDUCER and "did not sign" in outcome.reason
    # The reducer's own slice made up after the fact, past the bound: its own statements
    # sign it, and the sum of their norms gives it away.
    key = reduced.keys[REDUCER]
    big = [
        _signed(key, REDUCER, s.index, s.root, [(reduced.bound * 2) ** 2, *s.norms[1:]])
        if s.sender == REDUCER
        else s
        for s in reduced.statements
    ]
    outcome = _audit(reduced, 0, 0).take_statements(big)
    assert outcome is not None and outcome.liar == REDUCER and "above" in outcome.reason


def test_a_segment_measuring_other_than_its_signed_norm_names_the_reducer_that_counted_it():
    # The sender signed its bytes' root with norms a thousand times too small: an honest
    # reducer measures every segment it takes in and strikes such a sender, so one that
    # counted the chunk did not check it (a silent sender's signed norms bound the result).
    reduced = _reduce()
    key = reduced.keys[1]
    small = [
        _signed(key, 1, 0, s.root, [n / 1000 for n in s.norms])
        if (s.sender, s.index) == (1, 0)
        else s
        for s in reduced.statements
    ]
    audit = _audit(reduced, 0, 0)
    assert audit.take_statements(small) is None
    for sender in range(MEMBERS):
        audit.take_piece(_piece(reduced, sender, 0, 0))
    outcome = audit.verdict(*_result_segment(reduced, 0, 0))
    assert outcome.liar == REDUCER and "where its sender signed" in outcome.reason
    # A statement with another number of segment norms than the chunk has, alike.
    short = [
        _signed(key, 1, 0, s.root, s.norms[:-1]) if (s.sender, s.index) == (1, 0) else s
        for s in reduced.statements
    ]
    outcome = _audit(reduced, 1, 0).take_statements(short)
    assert outcome is not None and outcome.liar == REDUCER and "segment norms" in outcome.reason


@pytest.mark.parametrize("method", ["mean", "trimmed_mean"])
@pytest.mark.parametrize("silent", [(1,), (1, 3), (0, 2, 3)])
def test_every_segment_of_an_honest_reduction_passes_with_silent_contributors(
    method: str, silent: tuple[int, ...]
) -> None:
    reduced = _reduce(method)
    for index, span in enumerate(reduced.spans):
        for segment in range(segments_of(span.blocks)):
            outcome = _run(reduced, index, segment, silent=silent)
            assert outcome.liar is None, (index, segment, outcome.reason)
            assert "silent members" in outcome.reason


@pytest.mark.parametrize("method", ["mean", "trimmed_mean"])
def test_a_silent_member_buys_the_reducer_no_more_than_its_own_slice(method: str) -> None:
    # The reducer counts member 2's slice reversed (what a colluder could have sent, the
    # same norm) and member 2 never answers: every segment passes. Had member 2 answered,
    # its segment would give the lie away; a reversed result is past any silent reach.
    reduced = _reduce(method, reversed_by_reducer=2)
    caught = 0
    for index, span in enumerate(reduced.spans):
        for segment in range(segments_of(span.blocks)):
            assert _run(reduced, index, segment, silent=(2,)).liar is None
            caught += _run(reduced, index, segment).liar == REDUCER
            payload, _scales, _ = reduced.results[index]
            outcome = _run(reduced, index, segment, payload=-payload, silent=(0,))
            assert outcome.liar == REDUCER, (index, segment)
            assert "past the" in outcome.reason
    assert caught == sum(segments_of(span.blocks) for span in reduced.spans)


def test_a_segment_answer_of_another_size_is_refused():
    codec = CodecConfig(block_size=16, chunk_bytes=40 * (16 + 4))
    hashes = b"h" * (segments_of(40) * 16)
    good = pb.Segment(segment=2, payload=bytes(8 * 16), scales=bytes(8 * 4), hashes=hashes)
    piece = piece_of(3, good, 40, codec)  # the last segment of 40 blocks holds 8
    assert (piece.sender, piece.payload.numel(), piece.scales.numel()) == (3, 128, 8)
    assert len(piece.hashes) == 3
    for bad in (
        pb.Segment(segment=2, payload=bytes(16 * 16), scales=bytes(8 * 4), hashes=hashes),
        pb.Segment(segment=2, payload=bytes(8 * 16), scales=bytes(16 * 4), hashes=hashes),
        pb.Segment(segment=2, payload=bytes(8 * 16), scales=bytes(8 * 4), hashes=hashes[:-1]),
    ):
        with pytest.raises(Rejection) as refused:
            piece_of(3, bad, 40, codec)
        assert refused.value.code == "malformed"


def test_a_peer_that_left_an_audit_unanswered_is_not_asked_again_for_an_hour():
    silent = Silent()
    silent.add("a", now=100.0)
    assert silent.quiet("a", 100.0 + SILENT_S - 1) and not silent.quiet("b", 100.0)
    assert not silent.quiet("a", 100.0 + SILENT_S)
    assert not silent.quiet("a", 100.0)  # forgotten once it expired
    for i in range(SILENT_KEPT + 5):  # many keys: the oldest are forgotten first
        silent.add(f"k{i}", now=0.0)
    assert not silent.quiet("k0", 1.0) and silent.quiet(f"k{SILENT_KEPT + 4}", 1.0)
