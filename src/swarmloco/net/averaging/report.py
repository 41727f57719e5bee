"""What one member learns from one round: the mean and the account of who counted where.

:class:`AllReduceReport` is what the daemon logs, shows on the dashboard and checks before
it applies the outer step; a test can recompute the exact mean of the contributors it
names, chunk by chunk (the chunks of a part are ``codec.chunk_spans(stop - start)``).
"""

from __future__ import annotations

import dataclasses

import torch

from swarmloco.core.codec import Encoded


@dataclasses.dataclass(frozen=True)
class PartReport:
    """Who counted in one part of the result."""

    part: int
    start: int
    """First element of the part in the flat vector."""
    stop: int
    """One past its last element (chunks: ``codec.chunk_spans(stop - start, codec)``)."""
    reducer: str
    """Peer id of the member whose result everyone used."""
    epoch: int
    """0 if the part's own reducer delivered it; n after n failovers."""
    chunks: int
    included: dict[str, int]
    """Per member peer id: how many leading chunks of the part include its contribution
    (a member absent from the dict counted in none)."""


@dataclasses.dataclass(frozen=True)
class AllReduceReport:
    """What happened in one round, from one member's point of view."""

    round: int
    group_id: str
    me: str
    members: tuple[str, ...]
    """Peer ids in part order."""
    parts: tuple[PartReport, ...]
    """Per part: final reducer, epoch and how many leading chunks include each member."""
    excluded: dict[str, str]
    """Peer id -> why it was left out of something (failed, struck, missed a deadline)."""
    rejections: dict[str, int]
    """Rejected inputs during this round, by code."""
    bytes_sent: int
    bytes_received: int
    timings: dict[str, float]
    """Seconds: quantize, exchange (until we held every part), agreement, total."""
    agreed: int
    """Serving members whose verdict matched our digest."""
    digest: str
    norm_bound: float = float("inf")
    """The group's bound on every update's L2 norm (inf: none)."""
    clipped: float = 1.0
    """The factor our own update was scaled by to fit the bound (1.0: it fitted)."""
    audit_bytes_sent: int = 0
    """Of ``bytes_sent``, what audits took: our questions, statements and segments."""
    liars: tuple[str, ...] = ()
    """Members our audits caught lying (a reducer whose result was not its senders'
    aggregate, a sender showing other bytes than it signed): seen first-hand."""

    def counted_whole(self) -> dict[str, bool]:
        """Per member: whether every chunk of every part of the result included its
        contribution (a member struck or lost in any part landed nothing whole). The same
        on every member that holds this result: a chunk's contributors are part of the
        digest the members agree on."""
        return {
            m: all(part.included.get(m, 0) >= part.chunks for part in self.parts)
            for m in self.members
        }


@dataclasses.dataclass(frozen=True)
class AllReduceResult:
    mean: torch.Tensor | Encoded
    """The weighted mean, padded like the input (fp32, or encoded as received, as the
    caller asked); identical on every member that returns."""
    report: AllReduceReport
