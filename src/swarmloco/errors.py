"""The exceptions swarmloco raises on purpose.

Every error a user can meet derives from :class:`SwarmlocoError` and says what to do next.
Bad configuration raises :class:`ValueError` (from the config dataclasses) instead.
"""

from __future__ import annotations


class SwarmlocoError(Exception):
    """Base class of every swarmloco error."""


class CodecError(SwarmlocoError):
    """A tensor cannot be encoded or a payload cannot be decoded (NaN/Inf, wrong size)."""


class ManifestError(SwarmlocoError):
    """A swarm manifest is malformed or does not match its swarm id."""


class DataError(SwarmlocoError):
    """Training data cannot be found or read."""


class CheckpointError(SwarmlocoError):
    """A checkpoint is missing, incomplete or corrupt."""


class NetworkError(SwarmlocoError):
    """A remote peer could not be reached or answered badly."""


class RejectedInput(SwarmlocoError):
    """Input from a remote peer failed validation; the peer is named in the message."""

    def __init__(self, reason: str, *, peer: str | None = None) -> None:
        super().__init__(f"{reason} (from {peer})" if peer else reason)
        self.reason = reason
        self.peer = peer


class RoundAborted(SwarmlocoError):
    """An averaging round could not complete; nothing was applied.

    ``late``: the round goes on without this peer (its group formed before this peer
    came): catch up with the group's result of the round rather than average it again at
    once with whoever else came late. ``unmet``: none of the peers this one expected came
    (they may be out of step with it, or only claim to work on the round). ``dissenters``:
    the peer ids of the servers proven two-faced (each signed two digests under one number
    in the round), else of a lone server whose verdict or digest differed from every other
    server's, which were all this peer's own (first-hand: it aborted the round alone),
    and of the members this peer's audits caught lying in the round.
    ``out_of_line``: every server whose digest differed from ours, or whose verdict
    disagreed while its digest was ours, when those holding ours (us included) were most
    of the servers (the lone dissenter among them)."""

    def __init__(
        self,
        message: str,
        *,
        late: bool = False,
        unmet: bool = False,
        dissenters: frozenset[str] = frozenset(),
        out_of_line: frozenset[str] = frozenset(),
    ) -> None:
        super().__init__(message)
        self.late = late
        self.unmet = unmet
        self.dissenters = dissenters
        self.out_of_line = out_of_line | dissenters


class ModelMismatch(SwarmlocoError):
    """A peer's model is not the one its swarm trains; the message names the differences."""

    def __init__(self, message: str, differences: list[str]) -> None:
        super().__init__(message)
        self.differences = differences


class Stopped(BaseException):
    """Raised from ``optimizer.step()`` once the peer was asked to stop (a signal, the end
    of the run, ``swarm.stop()``) and the training loop stepped again: it leaves the loop at
    a step boundary, and ``with swarm`` swallows it after landing the round in flight and
    writing a checkpoint. A BaseException, so that ``except Exception`` does not catch it."""
