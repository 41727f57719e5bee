"""A peer's checkpoints: which one it resumes from, when one is written, what failed.

The peer says what its state is and how to load one; the keeper decides the rest. It owns
the store and the background writer, and the bookkeeping between them:

- **resuming**: the newest checkpoint that passes the hash check *and* loads into this
  peer. One that fails either is skipped with a warning and a ``checkpoint-skipped``
  event, and the next one is loaded over everything the failed one touched. When
  checkpoints with good hashes exist but none fits, resuming raises: starting afresh over
  them would lose the user's work.
- **saving**: only the copy happens on the caller's thread; the write on the writer's. A
  round's checkpoint that finds the last one still being written is skipped (the next one
  carries its state); an *urgent* one (a downloaded or rolled-back state, which no round
  may follow soon) is owed and taken as soon as the writer is free.
- **failing**: a failed write (a full disk) is reported, an event and a warning, and tried
  again ``retry_s`` later; training goes on and the checkpoints before it stay intact.
- **verified**: whether the state now is one this peer trained and checked itself. A
  state adopted on probation is saved unverified, and the store keeps the newest verified
  checkpoint however many unverified ones follow it (what a rollback returns to).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from swarmloco.errors import CheckpointError, SwarmlocoError
from swarmloco.runtime.checkpoint import BackgroundWriter, Checkpoint, CheckpointStore, Saved

logger = logging.getLogger(__name__)

Emit = Callable[..., None]
"""``emit(event, **fields)``: where the keeper's events go (the peer's event log)."""


class CheckpointKeeper:
    """See the module. ``emit`` receives ``checkpoint-skipped`` and ``checkpoint-failed``
    events; the caller reports the checkpoints :meth:`collect` returns."""

    def __init__(
        self,
        store: CheckpointStore,
        writer: BackgroundWriter,
        *,
        retry_s: float,
        emit: Emit,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.writer = writer
        self._retry_s = retry_s
        self._emit = emit
        self._clock = clock
        self.dirty = False
        """The state changed since the last checkpoint was taken."""
        self.due: float | None = None
        """When a checkpoint is owed (a retry, or an urgent one that found the writer
        busy); None when none is."""
        self.verified = True
        """Whether the state now is one this peer trained and checked itself."""
        self.error = ""
        """What went wrong with the checkpoints last (a failed write, none intact), until
        a write succeeds; empty when nothing did."""
        self.failures = 0
        """Writes that failed so far."""
        self._writing = 0  # the round of the checkpoint being written

    # -- resuming -------------------------------------------------------------------------------

    def resume(
        self, load: Callable[[Mapping[str, Any]], None], *, verified: bool | None = None
    ) -> Checkpoint | None:
        """Load the newest checkpoint that ``load`` accepts (with ``verified``, the newest
        whose state this peer verified itself, or that it did not) and return it; None when
        there is none. ``load`` raises whatever it likes on a state that does not fit."""
        # Reasons, not exceptions: a traceback would hold each failed state in memory.
        misfits: list[tuple[Path, str]] = []
        corrupt: list[Path] = []

        def skipped(path: Path, why: str) -> None:
            corrupt.append(path)
            self._emit("checkpoint-skipped", checkpoint=str(path), why=why)

        for candidate in self.store.valid(verified=verified, on_skip=skipped):
            try:
                load(candidate.state)
            except Exception as exc:  # whatever the content makes the loaders raise
                why = f"does not fit this peer: {type(exc).__name__}: {exc}"
                self.store.reject(candidate.path, why)
                logger.warning("skipping checkpoint %s: %s", candidate.path, why)
                self._emit("checkpoint-skipped", checkpoint=str(candidate.path), why=why)
                misfits.append((candidate.path, why))
                continue
            self.verified = candidate.verified
            return candidate
        if misfits:
            (path, why), older = misfits[0], len(misfits) - 1
            raise SwarmlocoError(
                f"checkpoint {path} {why}"
                + (f" (nor do the {older} older one(s) beside it)" if older else "")
                + f"; move {'them' if older else 'it'} away to start over"
            )
        if corrupt:
            self.error = (
                f"none of the {len(corrupt)} checkpoint(s) in {self.store.root} is intact "
                "(left there to look at): started without them"
            )
            logger.warning("%s", self.error)
        return None

    # -- saving ---------------------------------------------------------------------------------

    def save(
        self,
        capture: Callable[[], dict[str, Any]],
        *,
        round: int,
        step: int,
        urgent: bool = False,
    ) -> bool:
        """Start writing the state ``capture()`` returns (called only when a write can
        start) as the checkpoint of ``round`` and ``step``; False when the last one is
        still being written (an ``urgent`` one is then owed: :meth:`owed`). Collect the
        last one first (:meth:`collect`)."""
        if self.writer.busy:
            if urgent:
                self.due = self._clock()
            else:
                logger.info("checkpoint of round %d skipped: the last one is being written", round)
            return False
        self.due = None
        self._writing = round
        self.writer.submit(round=round, step=step, state=capture(), verified=self.verified)
        self.dirty = False
        return True

    def owed(self) -> bool:
        """Whether a checkpoint owed is due now and the writer is free for it."""
        return self.due is not None and self._clock() >= self.due and not self.writer.busy

    def collect(self, *, wait: bool = False, stopping: bool = False) -> Saved | None:
        """The checkpoint written in the background, once it is on disk (None before, or
        when none is in flight); with ``wait``, block for it. A failed write is reported
        here and owed again ``retry_s`` later (``stopping``: there is no later, and the
        work since the last checkpoint on disk is lost)."""
        try:
            saved = self.writer.wait() if wait else self.writer.poll()
        except CheckpointError as exc:
            self.failures += 1
            self.dirty = True
            self.due = self._clock() + self._retry_s
            self.error = f"checkpoint failed: {exc}"
            logger.log(
                logging.ERROR if stopping else logging.WARNING,
                "checkpoint failed%s: %s",
                "; the work since the last one on disk is lost"
                if stopping
                else f"; training goes on, next try in {self._retry_s:.0f} s",
                exc,
            )
            self._emit("checkpoint-failed", round=self._writing, error=str(exc))
            return None
        if saved is not None and self.error.startswith("checkpoint failed"):
            self.error = ""
        return saved
