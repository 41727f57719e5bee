"""Robust aggregation of one chunk: coordinate-wise trimmed mean and CenteredClip.

In every mode each member's update is first bounded to ``norm_clip`` times the group's
median declared norm (see ``net/averaging/group.py`` and ``reduction.py``), so no member
moves the mean further than that, weighted. Within the bound, a plain mean still follows
one member all the way; a reducer can instead buffer every sender's decoded chunk and
combine them robustly:

* trimmed mean: per coordinate, drop the ``trim`` largest and ``trim`` smallest values and
  average the rest (unweighted);
* CenteredClip (*Secure Distributed Training at Scale*, Alg. 2): start from the coordinate
  median and iterate ``v <- v + sum_i w_i clip_tau(x_i - v) / sum_i w_i``, where clip_tau
  scales a difference down to norm ``tau``, so a far-away update moves ``v`` by at most
  ``tau * w_i / sum w``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Literal

import torch

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
    """centered_clip: clipping radius (0: the median distance of the senders to the median)."""
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


def trimmed_mean(chunks: Sequence[torch.Tensor], trim: int) -> torch.Tensor:
    """Coordinate-wise mean after dropping the ``trim`` largest and smallest values."""
    n = len(chunks)
    require(n > 0, "no chunks to aggregate")
    trim = min(trim, (n - 1) // 2)
    stacked = torch.stack(list(chunks))
    if trim == 0:
        return stacked.mean(dim=0)
    ordered, _ = stacked.sort(dim=0)
    return ordered[trim : n - trim].mean(dim=0)


def centered_clip(
    chunks: Sequence[torch.Tensor],
    weights: Sequence[float],
    *,
    tau: float = 0.0,
    iterations: int = 5,
) -> torch.Tensor:
    """CenteredClip from the coordinate-wise median; ``tau = 0`` picks the median distance."""
    require(len(chunks) == len(weights) and len(chunks) > 0, "one weight per chunk is needed")
    stacked = torch.stack(list(chunks))
    w = torch.tensor(weights, dtype=torch.float32)
    w = w / w.sum()
    v = stacked.median(dim=0).values
    # Norms in float64: the squares of large but valid float32 values overflow float32.
    if tau <= 0:
        tau = float(torch.linalg.vector_norm(stacked - v, dim=1, dtype=torch.float64).median())
        if tau == 0.0:
            return v
    for _ in range(iterations):
        diff = stacked - v
        norms = torch.linalg.vector_norm(diff, dim=1, dtype=torch.float64).clamp_min(1e-30)
        scale = torch.clamp(tau / norms, max=1.0).to(torch.float32)
        v = v + (w * scale) @ diff
    return v


def aggregate(
    chunks: Sequence[torch.Tensor], weights: Sequence[float], config: AggregatorConfig
) -> torch.Tensor:
    """Combine decoded chunks (one per sender, same length) per ``config``."""
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
