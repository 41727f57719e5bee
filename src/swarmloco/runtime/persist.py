"""What a checkpoint of this peer holds, and how it is taken and given back.

:class:`PeerState` is the peer's whole state as a checkpoint sees it: the model, the
optimizer, the objects registered with ``Swarm.register``, the RNG, the counts of
:class:`~swarmloco.runtime.progress.LocalProgress`, the DiLoCo state, what the peer
observed itself (``Evidence``) and an adopted state's probation; in a box, each other
rank's objects, RNG and shards. :class:`PeerCheckpoints` resumes from the newest
checkpoint that fits (an adopted state on probation with its fallback), copies the state
between two steps and has the keeper write it on its own thread, and tells of each
checkpoint on disk or failed write. Where and how often is the keeper's
(``runtime/keeper.py``); the files are the store's (``runtime/checkpoint.py``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from swarmloco.core.adoption import Evidence
from swarmloco.runtime.box import (
    Box,
    BoxParams,
    Op,
    load_model_state,
    load_optimizer_state,
    local_state,
)
from swarmloco.runtime.checkpoint import Checkpoint, Saved
from swarmloco.runtime.keeper import CheckpointKeeper
from swarmloco.runtime.progress import LocalProgress
from swarmloco.runtime.snapshots import Snapshots
from swarmloco.runtime.status import StatusSheet
from swarmloco.runtime.trial import Trial
from swarmloco.train.diloco import DilocoState

logger = logging.getLogger(__name__)


class Stateful(Protocol):
    """What ``Swarm.register`` checkpoints: a scheduler, a data loader, an RNG."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class PeerState:
    """See the module: the parts of the peer a checkpoint holds."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    objects: Mapping[str, Stateful]
    diloco: DilocoState
    params: BoxParams
    progress: LocalProgress
    evidence: Evidence
    trial: Trial
    box: Box | None

    def capture(self) -> dict[str, Any]:
        """This peer's whole state as it is now (copied by the store before its write)."""
        ranks: list[Any] = []
        if self.box is not None:
            self.box.tell(Op.SAVE)
            ranks = (self.box.gather(None) or [None])[1:]
        state = {
            "diloco": self.diloco.state_dict(),
            "model": local_state(self.model.state_dict()),
            "optimizer": local_state(self.optimizer.state_dict()),
            "objects": {name: obj.state_dict() for name, obj in self.objects.items()},
            "rng": torch.get_rng_state(),
            **self.progress.state_dict(),
            "evidence": self.evidence.to_state(),
        }
        if (probation := self.trial.to_state()) is not None:
            state["probation"] = probation
        if ranks:
            state["ranks"] = ranks  # the box's other ranks: their objects, RNG and shards
        return state

    def load(self, s: Mapping[str, Any]) -> None:
        """Load one checkpoint's state; raises at the first part that does not fit (what
        was loaded before it is overwritten by the next checkpoint tried)."""
        ranks = s.get("ranks", [])
        if self.box is not None and len(ranks) != self.box.size - 1:
            raise ValueError(
                f"it was saved by a box of {len(ranks) + 1} rank(s), this one has {self.box.size}"
            )
        if self.box is None and ranks:
            raise ValueError(f"it was saved by a box of {len(ranks) + 1} ranks")
        self.diloco.load_state_dict(s["diloco"])
        load_model_state(self.model, s["model"])
        load_optimizer_state(self.optimizer, s["optimizer"])
        objects = s.get("objects", {})
        for name, obj in self.objects.items():
            if name not in objects:
                raise KeyError(f"object {name!r} (registered now, not when it was saved)")
            obj.load_state_dict(objects[name])
        torch.set_rng_state(s["rng"])
        self.progress.load_state_dict(s)
        self.evidence.load_state(s.get("evidence", {}))
        self.trial.load_state(s.get("probation"))

    def give_ranks(self, s: Mapping[str, Any]) -> None:
        """Give each of the box's other ranks its part of a loaded checkpoint: its own
        objects and RNG, and its shards (sharded) or rank 0's model and optimizer
        (replicated)."""
        if self.box is None:
            return
        parts: list[Any] = [None]
        for part in s.get("ranks", []):
            if not self.params.sharded:
                part = {**part, "model": s["model"], "optimizer": s["optimizer"]}
            parts.append(part)
        self.box.tell(Op.LOAD)
        self.box.scatter(parts)


class PeerCheckpoints:
    """See the module. ``remember``: keeps the peers this one knows for its next start
    (each time a checkpoint is on disk); ``stopping``: whether the peer is leaving (a
    failed write is then not retried later)."""

    def __init__(
        self,
        state: PeerState,
        keeper: CheckpointKeeper,
        *,
        swarm_id: str,
        snapshots: Snapshots,
        sheet: StatusSheet,
        emit: Callable[..., None],
        remember: Callable[[], None],
        stopping: Callable[[], bool],
    ) -> None:
        self.state = state
        self.keeper = keeper
        self.swarm_id = swarm_id
        self.snapshots = snapshots
        self.sheet = sheet
        self.emit = emit
        self.remember = remember
        self.stopping = stopping

    def restore(self) -> Checkpoint | None:
        """Resume from the newest checkpoint that loads and fits this peer (see
        :class:`CheckpointKeeper`); None when there is none."""
        found = self.keeper.resume(self.state.load)
        if found is None:
            if self.keeper.error:
                self.sheet.last_error = self.keeper.error
            return None
        self.state.give_ranks(found.state)
        if not found.verified:
            self._resume_probation()
        return found

    def _resume_probation(self) -> None:
        """Resumed from a checkpoint of an adopted state still on probation: its fallback
        is the newest checkpoint of a state this peer verified itself. Without one (a fresh
        peer that adopted and stopped before its first verified save), the state is kept
        as this peer's own, with a warning."""
        trial = self.state.trial
        fallback = None
        for candidate in self.keeper.store.valid(verified=True):
            try:
                state = candidate.state["diloco"]
                fallback = self.snapshots.keep(
                    int(state["round"]), DilocoState.snapshot_tensors(state)
                )
            except (KeyError, TypeError, ValueError) as exc:
                logger.warning("checkpoint %s holds no usable state: %s", candidate.path, exc)
                continue
            break
        probation = trial.probation
        if probation is None or fallback is None:
            if probation is not None:
                logger.warning(
                    "the state of round %d was adopted on probation and no state this peer "
                    "verified itself is checkpointed: keeping it as this peer's own",
                    probation.round,
                )
            trial.end()
            self.keeper.verified = True
            return
        trial.fallback = fallback
        logger.info(
            "the state of round %d is on probation; its fallback is this peer's own state of "
            "round %d",
            probation.round,
            fallback.round,
        )

    def save(self, *, wait: bool = False, urgent: bool = False) -> None:
        """Checkpoint the state as it is now: only the copy happens here, the write on the
        writer's thread (see :meth:`CheckpointKeeper.save`); with ``wait``, until it is on
        disk."""
        self.collect(wait=wait)
        progress = self.state.progress
        started = self.keeper.save(
            self.state.capture, round=self.state.diloco.round, step=progress.steps, urgent=urgent
        )
        if started and wait:
            self.collect(wait=True)

    def collect(self, *, wait: bool = False) -> None:
        """Report a checkpoint written in the background once it is on disk, or a failed
        write (tried again later: see :meth:`CheckpointKeeper.collect`)."""
        failures = self.keeper.failures
        saved = self.keeper.collect(wait=wait, stopping=self.stopping())
        self._saved(saved, failed=self.keeper.failures > failures)

    def _saved(self, saved: Saved | None, *, failed: bool) -> None:
        """Tell of a checkpoint on disk (``saved``) or a write that ``failed``."""
        if failed:
            self.sheet.last_error = self.keeper.error
        if saved is None:
            return
        self.remember()
        if self.sheet.last_error.startswith("checkpoint failed"):
            self.sheet.last_error = ""
        self.snapshots.finish(wait=True)  # the round's event before its checkpoint's
        self.emit(
            "checkpoint",
            round=saved.round,
            step=saved.step,
            path=str(saved.path),
            bytes=saved.nbytes,
            seconds=round(saved.write_seconds, 3),
            copy_seconds=round(saved.copy_seconds, 3),
            verified=saved.verified,
        )
