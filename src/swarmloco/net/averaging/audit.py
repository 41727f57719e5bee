"""Audits of a remote reducer's part: a random piece of it recomputed from its senders' own
bytes (docs/DESIGN.md section 5, step 6). No I/O.

Seals prove that every member got the same result of a part, not that the result is the
aggregate of what its senders sent. An audit checks that: every chunk a sender sends comes
with its *statement*, the sender's signature over the chunk's *root* (a hash of the hashes
of its *segments*, :data:`SEGMENT_BLOCKS` codec blocks each, payload and scales) and the
squared norm of each segment, and an auditor draws one chunk and one segment of it in
private, once the part's results and seal are out, and recomputes that segment's
aggregate from every contributor's segment, each checked against the root and the norm
its sender signed. A contributor that does not answer is *silent*: its row counts as zeros
and the result may lie as far from that as its signed norm lets it move the aggregate
(:func:`reach`). Before any segment comes, every segment of every result chunk of the part
is held to what its contributors' signed norms let it measure (all of them silent), so
a lie on segments no audit draws moves each no further than its senders could.

This module holds the pure pieces: segments and roots (:func:`segment_hashes`,
:func:`root_of`), the statement (:class:`Statement`), the recomputation and its tolerance
(:func:`recompute`, :func:`excess`), and one audit's state (:class:`Audit`), which names
who lied, if anyone, once everything it asked for is in (the statements' signatures are
checked through its ``verify``), and the draws and kept results of a round's audits
(:class:`Auditor`). The round (``round.py``) sends the questions and takes the answers: the
reducer's ``Statements`` on the auditor's stream to it, each contributor's ``Segment`` on
the contributor's stream to the auditor.

What the tolerance allows: the reducer's mean is a float32 sum in arrival order, then
quantized; the auditor's, a float64 sum in member order. The decoded result is within
half a quantization step of the reducer's mean, plus the rounding of the step itself when
scales travel as 16-bit floats (a value may be clamped at 127 steps), plus the float32
sum's rounding: :func:`excess` measures how far past that a result lies, 0 when within.
With silent contributors, :func:`beyond` holds the result to the recomputed aggregate in L2
within their reach plus the L2 norm of that rounding (:func:`allowed_distance`). The step
counted is never larger than an honest reducer's (the block's largest value over 127): a
segment zeroed under huge scales is within half a step of anything.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import math
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

from swarmloco.core.aggregate import AggregatorConfig, trimmed_mean
from swarmloco.core.codec import QMAX, CodecConfig, blocks_norm_sq
from swarmloco.net.averaging import wire
from swarmloco.net.averaging.group import Group
from swarmloco.net.averaging.reduction import slice_bound
from swarmloco.net.identity import verify
from swarmloco.net.rejections import Rejection
from swarmloco.proto.v1 import averaging_pb2 as pb

SEGMENT_BLOCKS = 16
"""Codec blocks per segment: the unit an auditor checks (16 KiB of int8 at 1,024 a block)."""
ROOT_BYTES = 16
"""A chunk's root, and each segment hash under it: SHA-256 cut to 16 bytes."""
RECOMPUTED_METHODS = ("mean", "trimmed_mean")
"""Aggregators whose result is one coordinate at a time, so a segment recomputes alone.
CenteredClip's parts are audited by their segments' bounds only (a convex combination of
the rows, weighted alike in every segment of a chunk)."""
_SUM_ROUNDING = 1e-5  # relative rounding of a float32 sum of a group's weighted values


def segments_of(blocks: int) -> int:
    """How many segments a chunk of ``blocks`` codec blocks has."""
    return -(-blocks // SEGMENT_BLOCKS)


def segment_hashes(
    payload: bytes | memoryview, scales: bytes | memoryview, *, block_size: int, scale_bytes: int
) -> list[bytes]:
    """The hash of every segment of a chunk (its int8 payload and its scales, as sent)."""
    data, scale_data = memoryview(payload).cast("B"), memoryview(scales).cast("B")
    blocks = len(scale_data) // scale_bytes
    hashes = []
    for first in range(0, blocks, SEGMENT_BLOCKS):
        last = min(blocks, first + SEGMENT_BLOCKS)
        digest = hashlib.sha256(data[first * block_size : last * block_size])
        digest.update(scale_data[first * scale_bytes : last * scale_bytes])
        hashes.append(digest.digest()[:ROOT_BYTES])
    return hashes


def segment_norms(payload: torch.Tensor, scales: torch.Tensor, block_size: int) -> list[float]:
    """The squared norm of what each segment of a chunk (int8 ``payload`` under its block
    ``scales``) decodes to, as :func:`~swarmloco.core.codec.blocks_norm_sq` measures a
    chunk's."""
    per_block = torch.linalg.vector_norm(payload.view(-1, block_size).to(torch.float32), dim=1)
    squares = per_block.double().square().mul_(scales.double().square())
    pad = -squares.numel() % SEGMENT_BLOCKS
    if pad:
        squares = torch.nn.functional.pad(squares, (0, pad))
    return squares.view(-1, SEGMENT_BLOCKS).sum(dim=1).tolist()


def norms_match(measured: float, signed: float) -> bool:
    """Whether a squared norm measured from bytes is the one their sender signed, to the
    rounding of two machines' sums."""
    return math.isclose(measured, signed, rel_tol=1e-5, abs_tol=1e-30)


def root_of(hashes: Sequence[bytes]) -> bytes:
    """A chunk's root: the hash of its segments' hashes, in order."""
    return hashlib.sha256(b"".join(hashes)).digest()[:ROOT_BYTES]


def segment_of(
    payload: torch.Tensor, scales: torch.Tensor, segment: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Segment ``segment`` of a chunk's int8 ``payload`` under its block ``scales``."""
    first, count = segment_span(segment, scales.numel())
    return payload[first * block_size : (first + count) * block_size], scales[first : first + count]


def segment_span(segment: int, blocks: int) -> tuple[int, int]:
    """The first block and the number of blocks of ``segment`` in a chunk of ``blocks``."""
    first = segment * SEGMENT_BLOCKS
    return first, max(0, min(SEGMENT_BLOCKS, blocks - first))


@dataclasses.dataclass(frozen=True, slots=True)
class Statement:
    """What a sender signed about one chunk it sent a reducer: the chunk's root and the
    squared norm of what each of its segments decodes to."""

    sender: int
    index: int
    root: bytes
    norms: tuple[float, ...]
    signature: bytes

    @property
    def norm_sq(self) -> float:
        """The chunk's squared norm: its segments'."""
        return math.fsum(self.norms)


def stated(
    group: Group,
    reducer: int,
    part: int,
    epoch: int,
    *,
    sender: int,
    index: int,
    root: bytes,
    norms: Sequence[float],
) -> bytes:
    """What ``sender`` of ``group`` signs about its chunk ``index`` of ``part`` at ``epoch``
    for ``reducer`` (``wire.statement_payload`` under the group's id and round)."""
    return wire.statement_payload(
        group.group_id,
        group.round,
        reducer,
        part,
        epoch,
        sender=sender,
        index=index,
        root=root,
        norms=wire.packed_norms(norms),
    )


def signed_by_sender(
    group: Group, reducer: int, part: int, epoch: int, statement: Statement
) -> bool:
    """Whether ``statement`` carries its sender's signature for this reducer, part, epoch."""
    signed = stated(
        group,
        reducer,
        part,
        epoch,
        sender=statement.sender,
        index=statement.index,
        root=statement.root,
        norms=statement.norms,
    )
    key = group.members[statement.sender].public_key
    return verify(key, statement.signature, wire.STATEMENT_DOMAIN, signed)


def restated(
    message: bytes,
    *,
    sender: int,
    reducer: int,
    codec: CodecConfig,
    sign: Callable[[bytes, bytes], bytes],
) -> bytes:
    """A chunk message (altered by a fault plan) with ``sender``'s statement of the bytes
    it carries, signed by ``sign``: a liar signs what it sends. Left as it is where its
    sizes do not even decode (its receiver refuses those before any statement)."""
    chunk = wire.decode_request(message)
    if not isinstance(chunk, wire.ChunkMessage):
        return message
    try:
        payload = wire.tensor_from(chunk.payload, torch.int8)
        scales = wire.tensor_from(chunk.scales, codec.scale_torch_dtype)
        norms = wire.packed_norms(segment_norms(payload, scales, codec.block_size))
    except (RuntimeError, ValueError):
        return message
    hashes = segment_hashes(
        chunk.payload, chunk.scales, block_size=codec.block_size, scale_bytes=codec.scale_bytes
    )
    signed = wire.statement_payload(
        chunk.group_id,
        chunk.round,
        reducer,
        chunk.part,
        chunk.epoch,
        sender=sender,
        index=chunk.index,
        root=root_of(hashes),
        norms=norms,
    )
    return wire.encode_chunk(
        group_id=chunk.group_id,
        round=chunk.round,
        part=chunk.part,
        epoch=chunk.epoch,
        index=chunk.index,
        payload=payload,
        scales=scales,
        signature=sign(wire.STATEMENT_DOMAIN, signed),
        norms=norms,
    )


@dataclasses.dataclass(frozen=True, slots=True)
class Piece:
    """One contributor's audited segment: its int8 values and scales, and the hashes of
    every segment of the chunk (to check it against the root its sender signed)."""

    sender: int
    payload: torch.Tensor
    scales: torch.Tensor
    hashes: tuple[bytes, ...]


def piece_of(sender: int, segment: pb.Segment, blocks: int, codec: CodecConfig) -> Piece:
    """``sender``'s answer to a fetch of a segment of a chunk of ``blocks`` codec blocks;
    Rejection if its sizes are not that segment's."""
    _, count = segment_span(segment.segment, blocks)
    hashes = segment.hashes
    if (
        len(segment.payload) != count * codec.block_size
        or len(segment.scales) != count * codec.scale_bytes
        or len(hashes) != segments_of(blocks) * ROOT_BYTES
    ):
        raise Rejection("malformed", "a segment of another size than its chunk's")
    return Piece(
        sender,
        wire.tensor_from(memoryview(segment.payload), torch.int8),
        wire.tensor_from(memoryview(segment.scales), codec.scale_torch_dtype),
        tuple(hashes[i : i + ROOT_BYTES] for i in range(0, len(hashes), ROOT_BYTES)),
    )


def decoded(payload: torch.Tensor, scales: torch.Tensor, block_size: int) -> torch.Tensor:
    """What int8 ``payload`` under its block ``scales`` decodes to, in float64."""
    values = payload.to(torch.float64).view(-1, block_size)
    return (values * scales.to(torch.float64).view(-1, 1)).view(-1)


def recompute(
    rows: Sequence[torch.Tensor], weights: Sequence[float], aggregator: AggregatorConfig
) -> torch.Tensor:
    """The aggregate of decoded segments (one row per contributor, float64), as the
    reducer's aggregator makes it: the weighted mean, or the trimmed mean."""
    if aggregator.method == "trimmed_mean":
        return trimmed_mean(list(rows), aggregator.trim)
    if aggregator.method != "mean":
        raise ValueError(f"a {aggregator.method} result is not audited a segment at a time")
    total = math.fsum(weights)
    out = torch.zeros_like(rows[0])
    for row, weight in zip(rows, weights, strict=True):
        out.add_(row, alpha=weight)
    return out.div_(total)


def _rounding(step: torch.Tensor, largest: torch.Tensor, codec: CodecConfig) -> torch.Tensor:
    """How far the codec may round each value of a result block of scale ``step`` (one
    row per block), whose inputs reach ``largest`` in absolute value per block."""
    eps = torch.finfo(codec.scale_torch_dtype).eps
    return step * (0.5 + (QMAX + 1) * eps) * 1.001 + _SUM_ROUNDING * largest


def _honest_step(absmax: torch.Tensor | float, codec: CodecConfig) -> torch.Tensor | float:
    """The most an honest reducer's scale can be for a block whose aggregate reaches
    ``absmax`` (within the float32 sum's rounding, which the caller adds): its largest
    value over :data:`QMAX`, rounded to the scales' dtype. A larger scale would widen the
    rounding an audit allows (a segment zeroed under huge scales is within half a step of
    anything), so the allowance never counts more than this."""
    eps = torch.finfo(codec.scale_torch_dtype).eps
    return absmax / QMAX * (1 + eps) * 1.001


def _largest(rows: Sequence[torch.Tensor], block_size: int, floor: float = 0.0) -> torch.Tensor:
    """Per block of ``rows``, the largest absolute value any of them holds (at least
    ``floor``)."""
    largest = torch.stack([row.abs() for row in rows]).amax(dim=0).view(-1, block_size)
    return largest.amax(dim=1, keepdim=True).clamp_(min=floor)


def excess(
    payload: torch.Tensor,
    scales: torch.Tensor,
    expected: torch.Tensor,
    rows: Sequence[torch.Tensor],
    codec: CodecConfig,
) -> float:
    """How far past the codec's rounding the result (``payload`` under ``scales``) lies
    from ``expected``, the recomputed aggregate of ``rows``, at worst over its values, in
    quantization steps of each value's own block, no larger than an honest one (0: within;
    inf: a value off in a block of step 0; see the module docstring)."""
    block = codec.block_size
    got = decoded(payload, scales, block).view(-1, block)
    want = expected.view(-1, block)
    largest = _largest(rows, block)
    honest = _honest_step(want.abs().amax(dim=1, keepdim=True) + _SUM_ROUNDING * largest, codec)
    step = torch.minimum(scales.to(torch.float64).view(-1, 1), honest)  # type: ignore[arg-type]
    over = (got - want).abs() - _rounding(step, largest, codec)
    if not over.numel() or float(over.max()) <= 0:
        return 0.0
    steps = torch.where(over > 0, over / step, torch.zeros_like(over))  # inf where step 0
    return float(steps.max())


def allowed_distance(
    within: torch.Tensor,
    *,
    center: torch.Tensor,
    scales_sq: torch.Tensor,
    blocks: torch.Tensor,
    largest: torch.Tensor,
    codec: CodecConfig,
) -> torch.Tensor:
    """The most (L2) an honest result segment of ``blocks`` blocks, whose scales' squares
    sum to ``scales_sq``, lies from an aggregate ``T0`` when the true aggregate is within
    ``within`` of it: ``within``, plus the codec's rounding of every value under the
    result's scales, counted no larger than an honest reducer's (``center``: the L2 norm
    of ``T0``'s largest absolute value per block; ``largest``: the most any input value
    reaches). One value per segment (float64 tensors of one shape)."""
    block = codec.block_size
    sum_rounding = _SUM_ROUNDING * largest
    honest = _honest_step(center + within + sum_rounding * blocks.sqrt(), codec)
    steps = torch.minimum(scales_sq.sqrt(), honest)  # type: ignore[arg-type]
    eps = float(torch.finfo(codec.scale_torch_dtype).eps)
    rounding = math.sqrt(block) * steps * (0.5 + (QMAX + 1) * eps) * 1.001
    return within * (1 + 1e-6) + rounding + sum_rounding * (blocks * block).sqrt()


def reach(
    silent: Mapping[int, float],
    contributors: Sequence[int],
    weights: Sequence[float],
    aggregator: AggregatorConfig,
) -> float:
    """How far (L2) the aggregate of a segment can move when each ``silent`` contributor's
    row, of squared norm at most ``silent[member]``, is taken as zeros: its weight's share
    of its norm under the mean; under the trimmed mean, its norm over the number of values
    kept (moving one input by ``d`` moves a kept sum by at most ``d``)."""
    if aggregator.method == "trimmed_mean":
        m = len(contributors)
        kept = m - 2 * min(aggregator.trim, (m - 1) // 2)
        return math.fsum(math.sqrt(n) for n in silent.values()) / kept
    total = math.fsum(weights[c] for c in contributors)
    return math.fsum(weights[c] * math.sqrt(n) for c, n in silent.items()) / total


def beyond(
    payload: torch.Tensor,
    scales: torch.Tensor,
    expected: torch.Tensor,
    codec: CodecConfig,
    *,
    within: float,
    largest: float,
) -> tuple[float, float]:
    """The L2 distance of the result (``payload`` under ``scales``) from ``expected`` and
    the most it may be (:func:`allowed_distance`): ``within`` (a :func:`reach`) plus the
    codec's rounding (``largest``: the most any input value reaches)."""
    block = codec.block_size
    got = decoded(payload, scales, block)
    distance = float(torch.linalg.vector_norm(got - expected))
    one = torch.ones((), dtype=torch.float64)
    allowed = allowed_distance(
        one * within,
        center=torch.linalg.vector_norm(expected.view(-1, block).abs().amax(dim=1)),
        scales_sq=scales.double().square().sum(),
        blocks=one * scales.numel(),
        largest=one * largest,
        codec=codec,
    )
    return distance, float(allowed)


@dataclasses.dataclass(frozen=True, slots=True)
class Measured:
    """A result chunk as an auditor received it, per segment: the squared norm of what it
    decodes to and the sum of its scales' squares."""

    norms: torch.Tensor
    scales_sq: torch.Tensor


def measured(payload: torch.Tensor, scales: torch.Tensor, block_size: int) -> Measured:
    """``payload`` under ``scales`` (a result chunk) measured per segment."""
    squares = scales.double().square()
    pad = -squares.numel() % SEGMENT_BLOCKS
    if pad:
        squares = torch.nn.functional.pad(squares, (0, pad))
    return Measured(
        torch.tensor(segment_norms(payload, scales, block_size), dtype=torch.float64),
        squares.view(-1, SEGMENT_BLOCKS).sum(dim=1),
    )


@dataclasses.dataclass(frozen=True, slots=True)
class Outcome:
    """An audit's end: ``liar`` is None when the result is the senders' aggregate (or the
    audit could not tell), else the member that lied (the reducer, or a contributor whose
    segment did not match the root it signed) and why."""

    liar: int | None
    reason: str


@dataclasses.dataclass(frozen=True, slots=True)
class Claimed:
    """One result chunk of an audited part: its codec blocks, the members it names, and
    what it measures (None: not received)."""

    blocks: int
    contributors: tuple[int, ...]
    measured: Measured | None


class Audit:
    """One auditor's audit of chunk ``index``, segment ``segment``, of ``part`` at
    ``epoch``, reduced by ``reducer`` (see the module docstring).

    ``chunks``: every result chunk of the part; ``included``: per sender of the part, how
    many leading chunks include it (from the result bitmaps); ``weights``: the group's;
    ``verify(statement)``: whether its sender signed ``statement`` for this reducer, part
    and epoch. Under an aggregator not in :data:`RECOMPUTED_METHODS`, only the first
    check runs (:attr:`recomputed` is False).

    Two checks: once the reducer's statements are in, every segment of every result chunk
    against what its contributors' signed norms let it measure (:meth:`take_statements`);
    once every contributor of chunk ``index`` answered or fell silent, segment
    ``segment`` recomputed from their bytes (:meth:`verdict`)."""

    def __init__(
        self,
        *,
        part: int,
        epoch: int,
        reducer: int,
        index: int,
        segment: int,
        chunks: Sequence[Claimed],
        included: Mapping[int, int],
        weights: Sequence[float],
        codec: CodecConfig,
        aggregator: AggregatorConfig,
        norm_bound: float,
        verify: Callable[[Statement], bool],
    ) -> None:
        self.part = part
        self.epoch = epoch
        self.reducer = reducer
        self.index = index
        self.segment = segment
        self.chunks = tuple(chunks)
        self.blocks = chunks[index].blocks
        self.contributors = chunks[index].contributors
        self.included = dict(included)
        self.weights = weights
        self.codec = codec
        self.aggregator = aggregator
        self.norm_bound = norm_bound
        self._verify = verify
        self.recomputed = aggregator.method in RECOMPUTED_METHODS
        self.statements: dict[int, list[Statement]] | None = None
        self.pieces: dict[int, Piece] = {}
        self.silent: set[int] = set()
        """Contributors that will not answer (no stream to us, or out of time)."""

    @property
    def ready(self) -> bool:
        """Whether every statement is in, and every contributor's segment or silence
        (where the segment is recomputed)."""
        return self.statements is not None and (
            not self.recomputed
            or all(c in self.pieces or c in self.silent for c in self.contributors)
        )

    def hush(self, members: Iterable[int]) -> None:
        """``members`` will not answer: the verdict bounds their segments by their norms."""
        self.silent.update(m for m in members if m in self.contributors and m not in self.pieces)

    def take_statements(self, statements: Sequence[Statement]) -> Outcome | None:
        """The reducer's answer: every statement of every sender of the part. An answer
        that is not exactly that, or a statement its sender did not sign, or a sender's
        norms past the bound, is the reducer's lie (it checked them as they came)."""
        by_sender: dict[int, list[Statement]] = {}
        for statement in statements:
            by_sender.setdefault(statement.sender, []).append(statement)
        for sender, count in self.included.items():
            mine = sorted(by_sender.get(sender, []), key=lambda s: s.index)
            if [s.index for s in mine] != list(range(count)):
                return Outcome(
                    self.reducer,
                    f"its audit answer lacks statements of member {sender}'s chunks "
                    f"(it counted {count})",
                )
            for statement in mine:
                if (
                    len(statement.root) != ROOT_BYTES
                    or not all(math.isfinite(n) and n >= 0 for n in statement.norms)
                    or not self._verify(statement)
                ):
                    return Outcome(
                        self.reducer,
                        f"its audit answer shows a statement member {sender} did not sign",
                    )
            total = math.fsum(s.norm_sq for s in mine)
            bound = slice_bound(self.norm_bound, self.codec.block_size)
            if math.isfinite(bound) and math.sqrt(total) > bound:
                return Outcome(
                    self.reducer,
                    f"it counted member {sender}'s slice of norm {math.sqrt(total):.3g}, above "
                    f"the group's bound {self.norm_bound:.3g}",
                )
            by_sender[sender] = mine
        extra = set(by_sender) - set(self.included)
        if extra:
            return Outcome(
                self.reducer, f"its audit answer shows members it did not count: {extra}"
            )
        self.statements = by_sender
        return self._bounded(by_sender)

    def _bounded(self, by_sender: Mapping[int, list[Statement]]) -> Outcome | None:
        """Every segment of every result chunk against the most its contributors' signed
        norms let it measure (its aggregate within :func:`reach` of zeros, all silent),
        plus the codec's rounding: a lie on a segment no audit draws is bounded by what
        its senders sent there, not by what the whole part may measure."""
        method = self.aggregator.method
        for index, chunk in enumerate(self.chunks):
            segments = segments_of(chunk.blocks)
            signed = []
            for member in chunk.contributors:
                mine = by_sender.get(member, [])
                if len(mine) <= index:
                    return Outcome(
                        self.reducer, f"it named member {member} in chunk {index} uncounted"
                    )
                if len(mine[index].norms) != segments:
                    return Outcome(
                        self.reducer,
                        f"it counted member {member}'s chunk {index} with "
                        f"{len(mine[index].norms)} segment norms, not {segments}",
                    )
                signed.append(mine[index].norms)
            if chunk.measured is None or not signed:
                continue
            norms = torch.tensor(signed, dtype=torch.float64).sqrt_()  # contributors x segments
            if method == "centered_clip":  # a convex combination: no longer than its longest
                within = norms.amax(dim=0)
            elif method == "trimmed_mean":
                m = len(signed)
                within = norms.sum(dim=0) / (m - 2 * min(self.aggregator.trim, (m - 1) // 2))
            else:
                shares = torch.tensor([self.weights[c] for c in chunk.contributors])
                within = (shares.double() / shares.double().sum()) @ norms
            blocks = torch.full((segments,), float(SEGMENT_BLOCKS), dtype=torch.float64)
            blocks[-1] = segment_span(segments - 1, chunk.blocks)[1]
            allowed = allowed_distance(
                within,
                center=torch.zeros_like(within),
                scales_sq=chunk.measured.scales_sq,
                blocks=blocks,
                largest=norms.amax(dim=0),
                codec=self.codec,
            )
            got = chunk.measured.norms.sqrt()
            over = (got > allowed).nonzero()
            if over.numel():
                segment = int(over[0])
                return Outcome(
                    self.reducer,
                    f"chunk {index} of part {self.part}, segment {segment}, measures "
                    f"{float(got[segment]):.3g}, past the {float(allowed[segment]):.3g} its "
                    f"senders' signed norms allow",
                )
        return None

    def take_piece(self, piece: Piece) -> None:
        if piece.sender in self.contributors and piece.sender not in self.silent:
            self.pieces[piece.sender] = piece

    def verdict(self, payload: torch.Tensor, scales: torch.Tensor) -> Outcome:
        """Once :attr:`ready`: whether the result segment (``payload`` under ``scales``,
        as received) is the aggregate of the contributors' segments, or, with silent
        contributors, within their reach of the aggregate of the others'."""
        assert self.ready and self.statements is not None
        if not self.recomputed:
            return Outcome(None, "")
        codec = self.codec
        first, count = segment_span(self.segment, self.blocks)
        rows = []
        silent: dict[int, float] = {}
        for sender in self.contributors:
            signed = self.statements.get(sender, [])
            if len(signed) <= self.index:
                return Outcome(
                    self.reducer, f"it named member {sender} in chunk {self.index} uncounted"
                )
            statement = signed[self.index]
            if len(statement.norms) != segments_of(self.blocks):
                return Outcome(
                    self.reducer,
                    f"it counted member {sender}'s chunk {self.index} with "
                    f"{len(statement.norms)} segment norms, not {segments_of(self.blocks)}",
                )
            norm_sq = statement.norms[self.segment]
            piece = self.pieces.get(sender)
            if piece is None:  # silent: zeros, within its signed norm
                silent[sender] = norm_sq
                rows.append(torch.zeros(count * codec.block_size, dtype=torch.float64))
                continue
            outcome = self._check_piece(piece, statement, count)
            if outcome is not None:
                return outcome
            rows.append(decoded(piece.payload, piece.scales, codec.block_size))
        expected = recompute(rows, [self.weights[c] for c in self.contributors], self.aggregator)
        where = (
            f"chunk {self.index} of part {self.part} (segment {self.segment}, "
            f"blocks {first}-{first + count - 1})"
        )
        if not silent:
            off = excess(payload, scales, expected, rows, codec)
            if off > 0:
                return Outcome(
                    self.reducer,
                    f"{where} is not its senders' aggregate ({off:.3g} steps past the rounding)",
                )
            return Outcome(None, "")
        within = reach(silent, self.contributors, self.weights, self.aggregator)
        largest = max(math.sqrt(max(silent.values())), *(float(r.abs().max()) for r in rows))
        distance, allowed = beyond(payload, scales, expected, codec, within=within, largest=largest)
        if distance > allowed:
            return Outcome(
                self.reducer,
                f"{where} lies {distance:.3g} from its answering senders' aggregate, past the "
                f"{allowed:.3g} its silent members {sorted(silent)} can move it",
            )
        return Outcome(None, f"within what silent members {sorted(silent)} can move it")

    def _check_piece(self, piece: Piece, statement: Statement, count: int) -> Outcome | None:
        """Whether ``piece`` is the segment its sender signed in ``statement``: a liar
        named if not (the sender where its bytes are not those it signed; the reducer
        where they are but their norm is not: it counted them all the same)."""
        codec = self.codec
        sender = piece.sender
        if len(piece.hashes) != segments_of(self.blocks) or root_of(piece.hashes) != (
            statement.root
        ):
            return Outcome(sender, "its segment hashes are not the chunk it signed")
        mine = segment_hashes(
            piece.payload.numpy().tobytes(),
            piece.scales.numpy().tobytes(),
            block_size=codec.block_size,
            scale_bytes=codec.scale_bytes,
        )
        if (
            piece.scales.numel() != count
            or piece.payload.numel() != count * codec.block_size
            or mine != [piece.hashes[self.segment]]
        ):
            return Outcome(sender, "its segment is not the one it signed")
        norm_sq = blocks_norm_sq(piece.payload, piece.scales, codec.block_size)
        signed = statement.norms[self.segment]
        if not norms_match(norm_sq, signed):
            return Outcome(
                self.reducer,
                f"it counted member {sender}'s chunk {self.index}, whose segment "
                f"{self.segment} measures {norm_sq:.6g} squared where its sender signed "
                f"{signed:.6g}",
            )
        return None


SILENT_S = 3600.0
"""How long a peer that left one of our audits unanswered is not asked again."""
SILENT_KEPT = 4096
"""How many such peers we remember at most (the oldest forgotten first)."""


class Silent:
    """Peers that left one of our audits unanswered within the senders' timeout: for
    :data:`SILENT_S` our audits take them as silent at once, without asking (their segments
    bounded by their signed norms, as after the timeout), so a member that never answers
    costs each auditor one wait, not one a round."""

    def __init__(self) -> None:
        self._until: collections.OrderedDict[str, float] = collections.OrderedDict()

    def add(self, peer_id: str, now: float) -> None:
        self._until[peer_id] = now + SILENT_S
        self._until.move_to_end(peer_id)
        while len(self._until) > SILENT_KEPT:
            self._until.popitem(last=False)

    def quiet(self, peer_id: str, now: float) -> bool:
        """Whether ``peer_id`` is to be taken as silent without asking."""
        until = self._until.get(peer_id)
        if until is not None and until <= now:
            del self._until[peer_id]
            return False
        return until is not None


@dataclasses.dataclass
class Running:
    """An audit under way, and the result segment it checks; the reducer's signed answer
    and the contributors' segments as they came (what a :class:`pb.Proof` shows)."""

    audit: Audit
    started: float
    payload: torch.Tensor
    scales: torch.Tensor
    result: bytes = b""
    answer: pb.Statements | None = None
    segments: dict[int, pb.Segment] = dataclasses.field(default_factory=dict)


class Auditor:
    """The audits one member runs in a round (see the module docstring): which chunk and
    segment of each claim it checks, drawn in private before any of the claim's results
    arrived, the result chunk it keeps for that, and the audits under way by part.

    ``draw(n)``: a random integer below ``n`` (the caller's source of randomness)."""

    def __init__(self, *, draw: Callable[[int], int]) -> None:
        self._draw = draw
        self._picks: dict[tuple[int, int, int], tuple[int, int]] = {}
        self._kept: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._raw: dict[tuple[int, int, int], bytes] = {}
        self._measured: dict[tuple[int, int, int], dict[int, Measured]] = {}
        self._started: set[tuple[int, int, int]] = set()
        self.running: dict[int, Running] = {}

    def due(self, part: int, epoch: int, reducer: int) -> bool:
        """Whether this claim's audit is still to start (once per claim: a seal sent twice
        is audited once); True marks it started."""
        key = (part, epoch, reducer)
        if key in self._started or key not in self._kept:
            return False
        self._started.add(key)
        return True

    def pick(self, part: int, epoch: int, reducer: int, blocks: Sequence[int]) -> tuple[int, int]:
        """The chunk and segment we audit of ``part`` at ``epoch`` from ``reducer``, whose
        chunks have ``blocks`` codec blocks each."""
        key = (part, epoch, reducer)
        pick = self._picks.get(key)
        if pick is None:
            index = self._draw(len(blocks))
            pick = self._picks[key] = (index, self._draw(segments_of(blocks[index])))
        return pick

    def keep(
        self,
        part: int,
        epoch: int,
        reducer: int,
        index: int,
        payload: torch.Tensor,
        scales: torch.Tensor,
        block_size: int,
        raw: bytes = b"",
    ) -> None:
        """A result chunk received (``raw``: its message as it came): measured per
        segment, and its audited segment and message kept if it is the chunk we picked."""
        key = (part, epoch, reducer)
        self._measured.setdefault(key, {})[index] = measured(payload, scales, block_size)
        pick = self._picks.get(key)
        if pick is None or pick[0] != index:
            return
        self._kept[(part, epoch, reducer)] = segment_of(payload, scales, pick[1], block_size)
        self._raw[key] = raw

    def raw(self, part: int, epoch: int, reducer: int) -> bytes:
        """The result message we picked of ``reducer``'s ``part`` at ``epoch``, as it came."""
        return self._raw.get((part, epoch, reducer), b"")

    def kept(self, part: int, epoch: int, reducer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._kept[(part, epoch, reducer)]

    def measured(self, part: int, epoch: int, reducer: int, index: int) -> Measured | None:
        """Result chunk ``index`` of this claim, as we measured it (None: not received)."""
        return self._measured.get((part, epoch, reducer), {}).get(index)
