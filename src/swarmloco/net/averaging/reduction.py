"""The reducer of one part at one epoch: chunks in, averaged chunks out. No I/O.

A :class:`PartReduction` receives every member's slice of a part chunk by chunk (in order
per sender), checks each chunk before it touches the sum, and accumulates it as it
arrives: weighted (``mean``), or through a
:class:`~swarmloco.core.aggregate.TrimmedAccumulator` that keeps only the extremes
(``trimmed_mean``); ``centered_clip`` keeps the decoded chunks of each chunk index until
they are all there. Chunk k is *complete* when every live sender
has delivered it; chunks complete in order, and the caller quantizes and sends out each
completed chunk's mean (:meth:`PartReduction.finish`).

Senders leave in two ways:

* *excluded*: the sender missed its chunk deadline, its stream broke, or its peer failed.
  The chunks it delivered so far stay in the sum; it is left out of the rest, and its
  late chunks are ignored. It keeps receiving results.
* *struck*: it sent something invalid (wrong size or index, NaN/Inf scales, a stale
  round or group, a duplicate, values so large that the weighted sum could overflow).
  Same as excluded, plus the caller refuses its stream.

Either way each chunk's mean is normalized by the weights of exactly the senders it
includes, and since every sender delivers in order, the senders a chunk includes are those
whose *included prefix* is longer than the chunk index: :meth:`included` is the whole
account of who counted where.

No member moves the mean further than the group allows: with a finite ``norm_bound`` (see
:meth:`~swarmloco.net.averaging.group.Group.norm_bound`), a sender's slice of the part,
decoded, must stay within the bound plus the codec's rounding (:func:`slice_bound`:
``||decode|| <= bound * (1 + 1e-3) + sqrt(sum over blocks of block_size * scale^2)``, the
rounding allowance never more than an honest sender's scales can reach,
``sqrt(block_size) / 127 * 1.01 * bound``, which an honest sender's clipped update always
meets); a chunk that would take it past is struck as ``too-large`` before it touches the
sum. (Without that cap on the allowance, values of +-1 under huge scales measured exactly
their own allowance and passed at any size.) Each reducer sees one part, so a liar's whole
update is at most ``sqrt(parts)`` times the bound.

No sum can overflow: a chunk is accepted only if its weighted values are at most
``FLOAT32_MAX / senders`` in magnitude, so the sum of every sender's is still finite. A
mean that is not finite anyway (a robust aggregator's arithmetic) raises
:class:`~swarmloco.errors.RoundAborted` from :meth:`PartReduction.finish`: nothing of it
leaves the reducer.

Deadlines (the caller's clock, in seconds): a live sender must deliver its next chunk
within ``timeout`` of the earlier of (a) its previous chunk (or the start) and (b) the
arrival of that chunk from half the remote senders (the lower median of their arrivals:
the first of two, the second of three or four). (a) catches a sender that stopped; (b) one
that lags far behind the others, which would otherwise hold the whole part back to its
pace. The median, not the first arrival: one sender that streams at line rate (zeros, say)
would otherwise set the pace, and have every slower honest sender dropped from the rest of
the part.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import torch

from swarmloco.core.aggregate import AggregatorConfig, TrimmedAccumulator, aggregate
from swarmloco.core.codec import (
    QMAX,
    ChunkSpan,
    CodecConfig,
    blocks_norm_sq,
    check_encoded,
    dequantize_accumulate_,
    dequantize_into_,
    quantize,
)
from swarmloco.errors import CodecError, RoundAborted
from swarmloco.net.rejections import Rejection

FLOAT32_MAX = float(torch.finfo(torch.float32).max)
_MAX_QUANT = 128  # the largest magnitude of an int8 value
_SCALE_ROUNDING = 1.01  # a scale sent as float16 or bfloat16 may be rounded up this much


def rounding_allowance(norm_bound: float, block_size: int) -> float:
    """The most the codec's rounding can add to the norm of an honest sender's slice whose
    norm is at most ``norm_bound``: every value is off by at most its block's scale, and an
    honest block's scale is its largest magnitude over 127, so no more than the block's norm
    over 127 (``sqrt(block_size) / 127`` of the slice's norm)."""
    return math.sqrt(block_size) / QMAX * _SCALE_ROUNDING * norm_bound


def slice_bound(norm_bound: float, block_size: int, slack: float = math.inf) -> float:
    """The largest norm a sender's decoded slice of a part may have: ``norm_bound`` plus the
    rounding its scales allow (``slack``: ``sqrt(block_size * sum of scale^2)``), the latter
    never more than an honest sender's scales reach (:func:`rounding_allowance`)."""
    return norm_bound * (1 + 1e-3) + min(slack, rounding_allowance(norm_bound, block_size))


class PartReduction:
    """Reduce part ``part`` at ``epoch`` from the given senders (member indices)."""

    def __init__(
        self,
        *,
        part: int,
        epoch: int,
        spans: Sequence[ChunkSpan],
        weights: Sequence[float],
        senders: Iterable[int],
        codec: CodecConfig,
        aggregator: AggregatorConfig,
        timeout: float,
        now: float,
        norm_bound: float = math.inf,
        take: Callable[[int], torch.Tensor] | None = None,
    ) -> None:
        self.part = part
        self.epoch = epoch
        self.spans = list(spans)
        self.weights = list(weights)
        self.codec = codec
        self.aggregator = aggregator
        self.timeout = timeout
        self.start = now
        self._buffered: dict[int, list[tuple[int, torch.Tensor]]] = {}
        self._trimmed: dict[int, TrimmedAccumulator] | None = None
        if aggregator.method == "trimmed_mean":
            self._trimmed = {}
        # Every mode keeps a few rows per chunk until it completes: each chunk's rows live
        # in one block of memory, recycled when the chunk is done (``take``: fresh memory,
        # e.g. a pool kept across rounds; fresh memory costs a page fault per 4 KiB). So
        # the reducer holds the chunks in flight, not its part (DESIGN section 6, "Host
        # memory"), as long as its own contribution is not decoded ahead of the others':
        # it waits as sent (views of the caller's message) until a chunk's first other
        # contribution arrives, or the chunk completes without one.
        self._take = take or (lambda numel: torch.empty(numel))
        self._storage: dict[int, torch.Tensor] = {}
        self._spare: list[torch.Tensor] = []
        self._waiting: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = {}
        self._weight_sum = [0.0] * len(self.spans)
        self.next_index: dict[int, int] = {s: 0 for s in senders}
        self.live: set[int] = set(self.next_index)
        # Rows of storage per chunk: the running sum of a mean (not zero-filled: a chunk's
        # first contribution is written, the others added); the largest, smallest and
        # middle sum of a trimmed mean that drops one value at each end; every sender's
        # decoded chunk for CenteredClip.
        self._rows = 1
        if self._trimmed is not None:
            self._rows = 3 if aggregator.trim == 1 else 0  # (other trims keep their own)
        elif aggregator.method == "centered_clip":
            self._rows = len(self.next_index)
        self._row_len = max((span.numel for span in self.spans), default=0)
        # What one sender's weighted chunk may hold at most, in magnitude, so that the sum
        # of every sender's stays a finite float32.
        self._limit = FLOAT32_MAX / max(1, len(self.next_index))
        self.norm_bound = norm_bound
        # Per sender: the squared norm of its decoded slice so far, and its rounding allowance.
        self._norm_sq: dict[int, float] = dict.fromkeys(self.next_index, 0.0)
        self._slack_sq: dict[int, float] = dict.fromkeys(self.next_index, 0.0)
        self.left: dict[int, str] = {}
        """Senders excluded or struck, with the reason."""
        self._last_progress: dict[int, float] = dict.fromkeys(self.next_index, now)
        self._arrivals: dict[int, list[float]] = {}  # chunk -> when remote senders sent it
        self._local: set[int] = set()  # senders fed in by this member (its own contribution)
        self.completed = 0
        """Chunks ``[0, completed)`` are complete (their means were handed out)."""

    @property
    def chunks(self) -> int:
        return len(self.spans)

    @property
    def done(self) -> bool:
        return self.completed == len(self.spans)

    # -- input ---------------------------------------------------------------------------

    def accept(
        self,
        sender: int,
        index: int,
        payload: torch.Tensor,
        scales: torch.Tensor,
        now: float,
        *,
        remote: bool = True,
        norm_sq: float | None = None,
    ) -> bool:
        """Add ``sender``'s chunk ``index``; return False if it came too late to count.
        ``norm_sq``: the squared norm it decodes to, when the caller measured it already.

        Raises Rejection (the caller strikes the sender) if the chunk is not the next one
        expected from this sender or does not decode to exactly that chunk.
        """
        if sender not in self.next_index:
            raise Rejection("not-member", f"member {sender} does not send part {self.part}")
        expected = self.next_index[sender]
        if sender not in self.live:
            return False
        if index != expected:
            code = "duplicate" if index < expected else "bad-index"
            raise Rejection(code, f"chunk {index} of part {self.part}, expected {expected}")
        if index >= len(self.spans):
            raise Rejection("bad-index", f"part {self.part} has only {len(self.spans)} chunks")
        weight = self.weights[sender]
        if scales.numel():
            largest = weight * _MAX_QUANT * float(scales.max())
            if largest > self._limit:  # NaN scales fail the decoder's checks below
                raise Rejection(
                    "too-large",
                    f"chunk {index} of part {self.part} holds values up to {largest:.3g} "
                    "(weighted): the sum would overflow",
                )
        if math.isfinite(self.norm_bound) and scales.numel():
            self._check_norm(sender, index, payload, scales, norm_sq)
        if remote:
            waiting = self._waiting.pop(index, None)
            if waiting is not None:  # the first other contribution: ours goes in first
                self._absorb(index, *waiting)
            self._absorb(index, sender, payload, scales)
        else:
            try:  # refused now as the decoder would refuse it, not when it is decoded
                check_encoded(payload, scales, self.codec)
            except CodecError as exc:
                raise Rejection("bad-chunk", f"chunk {index} of part {self.part}: {exc}") from None
            self._waiting[index] = (sender, payload, scales)
        self._weight_sum[index] += weight
        self.next_index[sender] = index + 1
        self._last_progress[sender] = now
        if remote:
            self._arrivals.setdefault(index, []).append(now)
        else:
            self._local.add(sender)
        return True

    def _absorb(self, index: int, sender: int, payload: torch.Tensor, scales: torch.Tensor) -> None:
        """Decode ``sender``'s chunk ``index`` into the chunk's rows."""
        span = self.spans[index]
        weight = self.weights[sender]
        storage = self._storage_of(index)
        try:
            if self._trimmed is not None:
                trimmer = self._trimmed.get(index)
                if trimmer is None:
                    trimmer = self._trimmed[index] = TrimmedAccumulator(
                        self.aggregator.trim, storage
                    )
                trimmer.add_quantized(payload, scales, self.codec)
                return
            assert storage is not None  # a mean's sum, CenteredClip's rows
            if self.aggregator.streaming:
                acc = storage[0, : span.numel]
                if index not in self._buffered:
                    self._buffered[index] = []
                    dequantize_into_(acc, payload, scales, self.codec, weight)
                else:
                    dequantize_accumulate_(acc, payload, scales, weight, self.codec)
            else:
                received = self._buffered.setdefault(index, [])
                row = storage[len(received), : span.numel]
                dequantize_into_(row, payload, scales, self.codec)
                received.append((sender, row))
        except CodecError as exc:
            raise Rejection("bad-chunk", f"chunk {index} of part {self.part}: {exc}") from None

    def _storage_of(self, index: int) -> torch.Tensor | None:
        """Chunk ``index``'s rows of memory (``_rows`` x the longest chunk), reused."""
        if not self._rows:
            return None
        storage = self._storage.get(index)
        if storage is None:
            if self._spare:
                storage = self._spare.pop()
            else:
                storage = self._take(self._rows * self._row_len).view(self._rows, -1)
            self._storage[index] = storage
        return storage

    def _check_norm(
        self,
        sender: int,
        index: int,
        payload: torch.Tensor,
        scales: torch.Tensor,
        measured: float | None,
    ) -> None:
        block = self.codec.block_size
        if payload.numel() != scales.numel() * block or not bool(torch.isfinite(scales).all()):
            return  # the decoder refuses it below, with the precise reason
        if measured is None:
            measured = blocks_norm_sq(payload, scales, block)
        norm_sq = self._norm_sq[sender] + measured
        slack_sq = self._slack_sq[sender] + block * float(scales.double().square().sum())
        allowed = slice_bound(self.norm_bound, block, math.sqrt(slack_sq))
        if math.sqrt(norm_sq) > allowed:
            raise Rejection(
                "too-large",
                f"chunk {index} of part {self.part} takes the sender's update to norm "
                f"{math.sqrt(norm_sq):.3g} in this part alone, above the group's bound "
                f"{self.norm_bound:.3g}",
            )
        self._norm_sq[sender] = norm_sq
        self._slack_sq[sender] = slack_sq

    def exclude(self, sender: int, reason: str) -> None:
        """Leave ``sender`` out of every chunk it has not delivered yet."""
        if sender in self.live:
            self.live.discard(sender)
            self.left[sender] = reason

    def expire(self, now: float) -> list[int]:
        """Exclude the senders whose deadline passed; return them."""
        late = [s for s in self.live if (d := self._deadline(s)) is not None and d <= now]
        for sender in late:
            self.exclude(
                sender,
                f"missed the deadline of chunk {self.next_index[sender]} of part {self.part}",
            )
        return late

    def _deadline(self, sender: int) -> float | None:
        index = self.next_index[sender]
        if index >= len(self.spans):
            return None
        since = self._last_progress[sender]
        arrivals = self._arrivals.get(index, [])
        half = (len(self.next_index) - len(self._local) - 1) // 2  # the lower median's place
        if len(arrivals) > half:
            since = min(since, arrivals[half])
        return since + self.timeout

    def next_deadline(self) -> float | None:
        """When :meth:`expire` may next exclude someone (None: nobody is awaited)."""
        deadlines = [d for s in self.live if (d := self._deadline(s)) is not None]
        return min(deadlines, default=None)

    # -- output --------------------------------------------------------------------------

    def ready(self) -> bool:
        """Whether the next chunk (``completed``) has every live sender's contribution."""
        if self.done:
            return False
        k = self.completed
        return all(self.next_index[s] > k for s in self.live)

    def finish(self) -> tuple[int, torch.Tensor, torch.Tensor, list[int]]:
        """Complete the next ready chunk: ``(index, int8 payload, scales, contributors)``.

        The mean is normalized by the weights of exactly the contributors listed. Raises
        RoundAborted if it is not finite (then the chunk stays incomplete).
        """
        assert self.ready(), "finish() needs a ready chunk"
        k = self.completed
        span = self.spans[k]
        contributors = self.contributors(k)
        total = self._weight_sum[k]
        if not contributors or not math.isfinite(total) or total <= 0:
            raise RoundAborted(
                f"chunk {k} of part {self.part} has no sender or weights summing to {total}"
            )
        waiting = self._waiting.pop(k, None)
        if waiting is not None:  # no other contribution came: ours alone
            try:
                self._absorb(k, *waiting)
            except Rejection as rejection:  # (checked as it was accepted: never so far)
                raise RoundAborted(
                    f"this peer's own chunk {k} of part {self.part}: {rejection.reason}"
                ) from None
        if self._trimmed is not None:
            mean = self._trimmed.pop(k).result()
        elif self.aggregator.streaming:
            self._buffered.pop(k)
            mean = self._storage[k][0, : span.numel]
            mean.mul_(1.0 / total)
        else:
            received = self._buffered.pop(k)
            rows = self._storage[k][: len(received), : span.numel]  # in the order received
            mean = aggregate(rows, [self.weights[s] for s, _ in received], self.aggregator)
        try:  # quantizing refuses NaN and Inf (a block's scale would not be finite)
            payload, scales = quantize(mean.contiguous(), self.codec)
        except CodecError:
            raise RoundAborted(
                f"the mean of chunk {k} of part {self.part} is not finite; nothing applied"
            ) from None
        storage = self._storage.pop(k, None)
        if storage is not None:  # the mean was quantized out of it: free for a later chunk
            self._spare.append(storage)
        self.completed += 1
        return k, payload, scales, contributors

    def contributors(self, index: int) -> list[int]:
        """Members whose contribution chunk ``index`` includes."""
        return sorted(s for s, n in self.next_index.items() if n > index)

    def included(self) -> dict[int, int]:
        """Per sender: how many leading chunks include it."""
        return dict(self.next_index)
