"""A member's own update as the sender side of a round sends it: bounded to the group's
norm, quantized once (or taken as the peer encoded it), and cut into the chunks of every
part.

Quantized once and kept: every reducer of a part (and a backup reducer after a failure)
gets the same bytes, sliced out of one int8 tensor and its scales without a copy. With
error feedback, the encoder bounds and quantizes the update itself and keeps what the
quantization lost for the next round.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable

import torch

from swarmloco.core.codec import (
    CodecConfig,
    Encoded,
    ErrorFeedback,
    encoded_norm,
    l2_norm,
    quantize,
)
from swarmloco.net.averaging import wire
from swarmloco.net.averaging.audit import (
    Piece,
    root_of,
    segment_hashes,
    segment_norms,
    segment_span,
    segments_of,
    stated,
)
from swarmloco.net.averaging.group import Group
from swarmloco.net.averaging.view import RoundView
from swarmloco.net.rejections import Rejection
from swarmloco.proto.v1 import averaging_pb2 as pb

# The round's events are the all-reduce's: one logger for the whole round.
logger = logging.getLogger("swarmloco.net.averaging.allreduce")

Take = Callable[[int, torch.dtype], torch.Tensor]


@dataclasses.dataclass(frozen=True, slots=True)
class Hashed:
    """What a statement of one of our chunks says of it: its segments' hashes, its root and
    its segments' squared norms (``audit.py``)."""

    hashes: tuple[bytes, ...]
    root: bytes
    norms: tuple[float, ...]

    @property
    def norm_sq(self) -> float:
        """The chunk's squared norm."""
        return math.fsum(self.norms)


def _bytes(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.numpy()).cast("B")  # type: ignore[arg-type]


class Contribution:
    """Our quantized update in one round, and its chunks (see the module docstring)."""

    def __init__(
        self,
        *,
        group: Group,
        view: RoundView,
        codec: CodecConfig,
        norm_bound: float,
        take: Take,
    ) -> None:
        """``take(numel, dtype)`` lends a scratch buffer for the round."""
        self._group = group
        self._view = view
        self._codec = codec
        self.norm_bound = norm_bound
        self._take = take
        self.clipped = 1.0
        """The factor our update was scaled by to stay within the norm bound (1: none)."""
        self.q = torch.empty(0, dtype=torch.int8)
        self.scales = torch.empty(0)
        self._hashed: dict[tuple[int, int], Hashed] = {}

    def encode(self, vector: torch.Tensor | Encoded, error_feedback: ErrorFeedback | None) -> None:
        """Bound and quantize ``vector``, or take it as encoded and bound it by its scales
        (the caller's stays as it is)."""
        if isinstance(vector, Encoded):
            self.q, self.scales = vector.payload, vector.scales
            norm = encoded_norm(vector)
            if math.isfinite(self.norm_bound) and norm > self.norm_bound:
                # Scaling the scales scales every value it decodes to: the same message as
                # quantizing the scaled vector, to rounding. What error feedback left out
                # shrinks alike (a rolled-back round restores it).
                self._clip(norm)
                scales = self._take(vector.scales.numel(), vector.scales.dtype)
                torch.mul(vector.scales, self.clipped, out=scales)
                self.scales = scales
                if error_feedback is not None:
                    error_feedback.scale(self.clipped)
            return
        if error_feedback is not None:
            self.q, self.scales = error_feedback.encode(vector, max_norm=self.norm_bound)
            return
        bounded = self._bounded(vector)
        numel = self._group.numel
        self.q = self._take(numel, torch.int8)
        self.scales = self._take(numel // self._codec.block_size, self._codec.scale_torch_dtype)
        quantize(bounded, self._codec, out=(self.q, self.scales))

    def _bounded(self, vector: torch.Tensor) -> torch.Tensor:
        """``vector``, scaled down to the group's norm bound if it exceeds it (a copy; the
        caller's vector stays as it is)."""
        if not math.isfinite(self.norm_bound):
            return vector
        norm = l2_norm(vector)
        if norm <= self.norm_bound:
            return vector
        self._clip(norm)
        clipped = self._take(vector.numel(), torch.float32)
        torch.mul(vector, self.clipped, out=clipped)
        return clipped

    def _clip(self, norm: float) -> None:
        # A hair below the bound, so that float rounding cannot take it past.
        self.clipped = self.norm_bound / norm * (1 - 1e-6)
        logger.info(
            "round %d: our update's norm %.3g is above the group's bound %.3g: scaled by %.3g",
            self._group.round,
            norm,
            self.norm_bound,
            self.clipped,
        )

    def chunk_hashes(self, part: int, index: int) -> Hashed:
        """The segment hashes, root and squared norms of our chunk ``index`` of ``part``
        (made once: every reducer of the part gets the same bytes)."""
        hashed = self._hashed.get((part, index))
        if hashed is None:
            payload, scales = self.slice_of(part, index)
            hashes = tuple(
                segment_hashes(
                    _bytes(payload),
                    _bytes(scales),
                    block_size=self._codec.block_size,
                    scale_bytes=self._codec.scale_bytes,
                )
            )
            norms = tuple(segment_norms(payload, scales, self._codec.block_size))
            hashed = self._hashed[(part, index)] = Hashed(hashes, root_of(hashes), norms)
        return hashed

    def chunk_message(
        self,
        reducer: int,
        part: int,
        epoch: int,
        index: int,
        *,
        sender: int,
        sign: Callable[[bytes, bytes], bytes],
    ) -> bytes:
        """Our chunk ``index`` of ``part`` for ``reducer`` at ``epoch``, with our statement
        of it (``sender``: our member index; ``sign``: our key's)."""
        payload, scales = self.slice_of(part, index)
        hashed = self.chunk_hashes(part, index)
        group = self._group
        signed = stated(
            group,
            reducer,
            part,
            epoch,
            sender=sender,
            index=index,
            root=hashed.root,
            norms=hashed.norms,
        )
        return wire.encode_chunk(
            group_id=group.group_id,
            round=group.round,
            part=part,
            epoch=epoch,
            index=index,
            payload=payload,
            scales=scales,
            signature=sign(wire.STATEMENT_DOMAIN, signed),
            norms=wire.packed_norms(hashed.norms),
        )

    def piece(self, sender: int, part: int, index: int, segment: int) -> Piece:
        """Our segment ``segment`` of chunk ``index`` of ``part``, for our own audit."""
        payload, scales = self._segment(part, index, segment)
        return Piece(sender, payload, scales, self.chunk_hashes(part, index).hashes)

    def segment_answer(self, fetch: pb.Fetch) -> pb.Segment:
        """Our answer to an auditor's fetch; Rejection if we have no such segment."""
        spans = self._view.spans[fetch.part] if fetch.part < len(self._view.spans) else []
        if fetch.index >= len(spans) or fetch.segment >= segments_of(spans[fetch.index].blocks):
            raise Rejection("malformed", f"no segment {fetch.segment} of chunk {fetch.index}")
        payload, scales = self._segment(fetch.part, fetch.index, fetch.segment)
        return pb.Segment(
            reducer=fetch.reducer,
            part=fetch.part,
            epoch=fetch.epoch,
            index=fetch.index,
            segment=fetch.segment,
            payload=payload.numpy().tobytes(),
            scales=scales.numpy().tobytes(),
            hashes=b"".join(self.chunk_hashes(fetch.part, fetch.index).hashes),
        )

    def _segment(self, part: int, index: int, segment: int) -> tuple[torch.Tensor, torch.Tensor]:
        payload, scales = self.slice_of(part, index)
        first, count = segment_span(segment, scales.numel())
        block = self._codec.block_size
        return payload[first * block : (first + count) * block], scales[first : first + count]

    def slice_of(self, part: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Our quantized contribution to chunk ``index`` of ``part`` (views, no copy)."""
        first, _ = self._group.parts[part]
        span = self._view.spans[part][index]
        start = (first + span.first_block) * self._group.block_size
        return (
            self.q[start : start + span.numel],
            self.scales[first + span.first_block : first + span.first_block + span.blocks],
        )
