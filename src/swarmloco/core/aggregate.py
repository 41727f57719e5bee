"""Robust aggregation of one chunk: coordinate-wise trimmed mean and CenteredClip.

In every mode each member's update is first bounded to ``norm_clip`` times the group's
median declared norm (see ``net/averaging/group.py`` and ``reduction.py``), so no member
moves the mean further than that, weighted. Within the bound, a plain mean still follows
one member all the way; a reducer can instead buffer every sender's decoded chunk and
combine them robustly:

* trimmed mean: per coordinate, drop the ``trim`` largest and ``trim`` smallest values and
  average the rest (unweighted);
* CenteredClip (*Secure Distributed Training at Scale*, Alg. 2): start from the members'
  weighted medoid and iterate ``v <- v + sum_i w_i clip_tau(x_i - v) / sum_i w_i``, where
  clip_tau scales a difference down to norm ``tau``, so a far-away update moves ``v`` by at
  most ``tau * w_i / sum w``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Literal

import torch

from swarmloco.core.codec import CodecConfig, dequantize_into_, dequantize_trim_one_
from swarmloco.core.config import require, require_int, require_non_negative

Method = Literal["mean", "trimmed_mean", "centered_clip"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class AggregatorConfig:
    """How a reducer combines the chunks of its senders."""

    method: Method = "mean"
    """mean (streamed, weighted), trimmed_mean or centered_clip (buffered per chunk)."""
    trim: int = 1
    """trimmed_mean: values dropped at each end, per coordinate."""
    clip_tau: float = 0.0
    """centered_clip: clipping radius (0: the median distance of the others to their medoid)."""
    clip_iterations: int = 5
    """centered_clip: fixed-point iterations."""
    norm_clip: float = 4.0
    """Every mode: each member's update is bounded to this multiple of the group's median
    declared update norm (an honest member scales its own down to it; a reducer strikes a
    sender whose slice exceeds it). 0: no bound."""

    def __post_init__(self) -> None:
        require(
            self.method in ("mean", "trimmed_mean", "centered_clip"),
            f"aggregator must be mean, trimmed_mean or centered_clip, got {self.method!r}",
        )
        require_int("trim", self.trim, minimum=0)
        require_non_negative("clip_tau", self.clip_tau)
        require_int("clip_iterations", self.clip_iterations, minimum=1)
        require(
            isinstance(self.norm_clip, (int, float))
            and math.isfinite(self.norm_clip)
            and (self.norm_clip == 0 or self.norm_clip >= 1),
            f"norm_clip must be 0 (no bound) or a multiple >= 1, got {self.norm_clip!r}",
        )

    @property
    def streaming(self) -> bool:
        """True when chunks can be accumulated as they arrive (no buffering)."""
        return self.method == "mean"


# Reductions across a few rows (``stacked.sort(dim=0)``, ``.median(dim=0)``) are slow in
# torch: for 4 rows of 6M values, sort takes 16x and median 25x the time of the elementwise
# ``torch.minimum`` / ``torch.maximum`` they can be built from. Up to this many
# compare-exchanges, order statistics use a selection network instead.
_MAX_COMPARATORS = 256


def _exchange(rows: list[torch.Tensor], i: int, j: int) -> None:
    """Order rows i < j per coordinate: the smaller value to i, the larger to j."""
    a, b = rows[i], rows[j]
    rows[i], rows[j] = torch.minimum(a, b), torch.maximum(a, b)


def _drop_extremes(rows: list[torch.Tensor], low: int, high: int) -> list[torch.Tensor]:
    """Per coordinate, the values left after removing the ``low`` smallest and ``high``
    largest (in no particular order): bubble passes move one extreme per pass to an end."""
    rows = list(rows)
    lo, hi = 0, len(rows)
    for _ in range(high):
        for i in range(lo, hi - 1):
            _exchange(rows, i, i + 1)
        hi -= 1
    for _ in range(low):
        for i in range(hi - 1, lo, -1):
            _exchange(rows, i - 1, i)
        lo += 1
    return rows[lo:hi]


def trimmed_mean(chunks: Sequence[torch.Tensor] | torch.Tensor, trim: int) -> torch.Tensor:
    """Coordinate-wise mean after dropping the ``trim`` largest and smallest values."""
    n = len(chunks)
    require(n > 0, "no chunks to aggregate")
    trim = min(trim, (n - 1) // 2)
    if trim == 0:
        return torch.stack(list(chunks)).mean(dim=0)
    if 2 * trim * n <= _MAX_COMPARATORS:
        middle = _drop_extremes(list(chunks), trim, trim)
        out = middle[0].clone()
        for row in middle[1:]:
            out.add_(row)
        return out.div_(len(middle))
    ordered, _ = torch.stack(list(chunks)).sort(dim=0)
    return ordered[trim : n - trim].mean(dim=0)


class TrimmedAccumulator:
    """The trimmed mean of rows that arrive one at a time, kept up to date as they come.

    No row is buffered beyond the ``2 * trim + 1`` needed: per coordinate the ``trim``
    largest values so far (``top``, largest first) and the ``trim`` smallest (``bottom``,
    smallest first) are kept, and every value that can no longer be among them is added
    to ``middle``. A new row passes through ``top`` (each step keeps the larger value and
    passes the smaller on), then through ``bottom`` (keeps the smaller, passes the larger),
    and what comes out of both is a middle value for good: ``top`` only ever grows and
    ``bottom`` only ever shrinks. Each value lands in exactly one place, so nothing is
    subtracted and a huge value cannot cancel the others out of the sum.

    The result equals :func:`trimmed_mean` of all rows (up to the order of the additions),
    also when fewer than ``2 * trim + 1`` rows came (then fewer are trimmed). Rows handed
    to :meth:`add` become this object's storage; :meth:`buffer` hands out one to decode
    into without allocating. ``storage`` (3 x at least the row length, float32): memory
    for :meth:`add_quantized` with ``trim == 1`` to keep its three rows in, e.g. reused
    from chunk to chunk; the result is then a view of it.
    """

    def __init__(self, trim: int, storage: torch.Tensor | None = None) -> None:
        require_int("trim", trim, minimum=0)
        self.trim = trim
        self._storage = storage
        self.count = 0
        self._rows: list[torch.Tensor] = []  # until 2 * trim + 1 came
        self._top: list[torch.Tensor] = []
        self._bottom: list[torch.Tensor] = []
        self._middle: torch.Tensor | None = None
        self._free: list[torch.Tensor] = []
        # add_quantized with trim 1: the largest and smallest values so far.
        self._hi: torch.Tensor | None = None
        self._lo: torch.Tensor | None = None

    def buffer(self, numel: int) -> torch.Tensor:
        """A free float32 buffer of ``numel`` values to decode the next row into."""
        while self._free:
            spare = self._free.pop()
            if spare.numel() == numel:
                return spare
        return torch.empty(numel)

    def add(self, row: torch.Tensor) -> None:
        """Take in ``row`` (kept or overwritten: the caller must not use it again)."""
        require(self._hi is None, "rows were added quantized: use add_quantized()")
        self.count += 1
        if self._middle is None:
            self._rows.append(row)
            if len(self._rows) == 2 * self.trim + 1:
                ordered = self._rows
                for _ in range(len(ordered)):  # bubble sort, smallest first
                    for i in range(len(ordered) - 1):
                        _exchange(ordered, i, i + 1)
                t = self.trim
                self._bottom = ordered[:t]
                self._middle = ordered[t]
                self._top = ordered[t + 1 :][::-1]
                self._rows = []
            return
        spare = self.buffer(row.numel())
        x = row
        for i, kept in enumerate(self._top):
            torch.maximum(kept, x, out=spare)
            torch.minimum(kept, x, out=x)
            self._top[i], spare = spare, kept
        for i, kept in enumerate(self._bottom):
            torch.minimum(kept, x, out=spare)
            torch.maximum(kept, x, out=x)
            self._bottom[i], spare = spare, kept
        self._middle.add_(x)
        self._free += [x, spare]  # both free again: x's values are in the middle sum

    def add_quantized(self, q: torch.Tensor, scale: torch.Tensor, codec: CodecConfig) -> None:
        """Decode a row of the codec's blocks and take it in. With ``trim == 1`` (what a
        public run uses) this is one fused pass over the row that keeps the largest and
        smallest values and adds the rest; otherwise the row is decoded, then added."""
        if self.trim != 1:
            row = self.buffer(q.numel())
            dequantize_into_(row, q, scale, codec)
            self.add(row)
            return
        require(self._hi is not None or self.count == 0, "rows were added decoded: use add()")
        if self._hi is None:
            self._hi, self._lo, self._middle = self.storage(q.numel()).unbind(0)
        assert self._lo is not None and self._middle is not None
        dequantize_trim_one_(self._hi, self._lo, self._middle, q, scale, codec, taken=self.count)
        self.count += 1

    def storage(self, numel: int) -> torch.Tensor:
        """Room for the largest, smallest and middle sum of ``numel`` values (3 x numel):
        handed in at construction to reuse memory, a new tensor otherwise."""
        given = self._storage
        if given is None or given.dim() != 2 or given.shape[0] != 3 or given.shape[1] < numel:
            return torch.empty(3, numel)
        return given[:, :numel]

    def result(self) -> torch.Tensor:
        """The trimmed mean of every row added so far (a view of this object's storage,
        or a new tensor)."""
        require(self.count > 0, "no chunks to aggregate")
        if self._hi is not None:
            assert self._lo is not None and self._middle is not None
            if self.count == 1:
                return self._hi
            if self.count == 2:
                return self._hi.add_(self._lo).div_(2)
            return self._middle.div_(self.count - 2)
        if self._middle is None:
            return trimmed_mean(self._rows, self.trim)
        return self._middle.div_(self.count - 2 * self.trim)


# CenteredClip forms its Gram matrices over blocks of this many coordinates: each block's
# products are taken in float32 (one matrix product, its rows still in cache) and summed
# across blocks in float64.
_CLIP_BLOCK = 1 << 15
# When the members' differences are this small against their norms, the Gram matrix of the
# raw rows cannot resolve them in float32, and it is formed again from the differences.
_RESOLVE = 1e-3


def _gram(rows: torch.Tensor, center: torch.Tensor | None) -> torch.Tensor:
    """``(X - c)(X - c)^T`` in float64 for the rows of ``X`` (``c``: none, or a row)."""
    n, d = rows.shape
    gram = torch.zeros(n, n, dtype=torch.float64)
    scratch = torch.empty(n, min(d, _CLIP_BLOCK), dtype=rows.dtype) if center is not None else None
    for start in range(0, d, _CLIP_BLOCK):
        block = rows[:, start : start + _CLIP_BLOCK]
        y = block
        if center is not None and scratch is not None:
            y = scratch[:, : block.shape[1]]
            torch.sub(block, center[start : start + _CLIP_BLOCK], out=y)
        products = y @ y.T
        if not bool(torch.isfinite(products).all()):  # overflowed float32: in float64
            y64 = block.double()
            if center is not None:
                y64 = y64.sub_(center[start : start + _CLIP_BLOCK].double())
            products = y64 @ y64.T
        gram += products
    return gram


def centered_clip(
    chunks: Sequence[torch.Tensor] | torch.Tensor,
    weights: Sequence[float],
    *,
    tau: float = 0.0,
    iterations: int = 5,
) -> torch.Tensor:
    """CenteredClip (Alg. 2) from the members' weighted medoid ``x_c``; ``tau = 0`` picks
    the median distance of the others to it. Stops early once the centre moves less than
    ``1e-6 * tau`` (a fixed point: every member within ``tau``, or the clipped pulls
    balance).

    ``chunks``: one row per member (a 2-D tensor of rows, as a reducer keeps them, or a
    sequence of equal-length vectors). The centre stays a convex combination of the rows
    all along, ``v = x_c + sum_j a_j (x_j - x_c)`` (the fixed point of the iteration is a
    weighted mean of the rows, so nothing is lost by it), so every distance it needs,
    ``|y_i - u|^2 = G_ii - 2 (G a)_i + a.G a`` with ``y_i = x_i - x_c``, comes from the
    members' Gram matrix ``G``: the iterations work on n x n numbers (in float64). The data
    is read twice in all: once for the Gram matrix of the rows (whose distances also pick
    the medoid), once for the result, one matrix-vector product that cannot overflow. When
    the rows are too close together for the raw products to resolve their differences
    (``_RESOLVE``), ``G`` is formed again from the differences to ``x_c``; a block whose
    products overflow float32 takes them in float64.

    The medoid (the row with the least weighted sum of distances to the others) is where
    the iteration starts and what it is measured against: with fewer than half the weight
    far away it is an honest row, and a far-away update moves ``v`` by at most ``tau * w_i
    / sum w`` per iteration.
    """
    rows = chunks if isinstance(chunks, torch.Tensor) else torch.stack(list(chunks))
    require(
        rows.dim() == 2 and rows.shape[0] == len(weights) and rows.shape[0] > 0,
        "one weight per chunk is needed",
    )
    n = rows.shape[0]
    w = torch.tensor(weights, dtype=torch.float64)
    w = w / w.sum()
    if n == 1:
        return rows[0].clone()
    raw = _gram(rows, None)
    norms = raw.diagonal()
    dist_sq = (norms[:, None] + norms[None, :] - 2.0 * raw).clamp_min(0.0)
    c = int(torch.argmin(dist_sq.sqrt() @ w))
    others = [i for i in range(n) if i != c]
    if float(dist_sq[c, others].max()) < _RESOLVE * float(norms.max()):
        gram = _gram(rows, rows[c])  # the raw products cannot resolve such close rows
    else:  # the same matrix, about x_c: G_ij - G_ic - G_jc + G_cc
        gram = raw - raw[:, c : c + 1] - raw[c : c + 1, :] + raw[c, c]
    sq = gram.diagonal().clamp_min(0.0)
    if tau <= 0:
        tau = float(sq[others].sqrt().median())
        if tau == 0.0:
            return rows[c].clone()
    a = torch.zeros(n, dtype=torch.float64)
    for _ in range(iterations):
        ga = gram @ a
        distances = (sq - 2.0 * ga + a @ ga).clamp_min(0.0).sqrt()
        pull = w * torch.clamp(tau / distances.clamp_min(1e-300), max=1.0)
        step = pull - pull.sum() * a
        a = a + step
        if float(step @ gram @ step) <= (1e-6 * tau) ** 2:
            break
    coefficients = a.clone()
    coefficients[c] += 1.0 - float(a.sum())
    return torch.mv(rows.T, coefficients.to(rows.dtype))


def aggregate(
    chunks: Sequence[torch.Tensor] | torch.Tensor,
    weights: Sequence[float],
    config: AggregatorConfig,
) -> torch.Tensor:
    """Combine decoded chunks (one per sender, same length; or a 2-D tensor of them, one
    row each) per ``config``."""
    if config.method == "trimmed_mean":
        return trimmed_mean(chunks, config.trim)
    if config.method == "centered_clip":
        return centered_clip(
            chunks, weights, tau=config.clip_tau, iterations=config.clip_iterations
        )
    total = float(sum(weights))
    out = torch.zeros_like(chunks[0])
    for c, w in zip(chunks, weights, strict=True):
        out.add_(c, alpha=w / total)
    return out
