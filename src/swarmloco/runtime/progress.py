"""What this peer has trained: its steps and tokens, since it started and since its last
round, the swarm's global step, the rate others project its tokens by, and the time its
hook spends between two steps.

Pacing reads it (``runtime/pacer.py``: the tokens towards the next round, and since when
they count), the round driver resets it when a round starts (``runtime/rounds.py``), a
download or a NaN restarts it, and the checkpoint holds its counts. :class:`LocalProgress`
does no I/O; its clock is injected.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

CHECKPOINTED = ("steps", "steps_since_round", "tokens_since_round", "global_step")
"""The counts a checkpoint holds (under these names, at its top level)."""


class Rate:
    """Tokens per second over the recent steps: exponential averages of the tokens and of
    the seconds, divided (an average of each step's rate would be biased up when step times
    vary: one step of 1 ms and one of 9 ms make 2 steps in 10 ms, not 5.6 ms a step).

    ``warmup``: the first steps are not counted (allocations, caches, a first round: they
    say nothing of the speed to come); ``settle``: the value stays 0 ("not measured") until
    this many steps were counted, their plain totals then seeding the averages (so that no
    single early step weighs on it for long)."""

    def __init__(self, *, warmup: int = 0, settle: int = 1) -> None:
        if warmup < 0 or settle < 1:
            raise ValueError(f"warmup must be >= 0 and settle >= 1, got {warmup}, {settle}")
        self.value = 0.0
        self.steps = 0
        """Steps added (warm-up ones included)."""
        self._warmup, self._settle = warmup, settle
        self._tokens = self._seconds = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        if seconds <= 0 or not math.isfinite(seconds):
            return
        self.steps += 1
        counted = self.steps - self._warmup
        if counted <= 0:
            return
        if counted <= self._settle:
            self._tokens += tokens
            self._seconds += seconds
            if counted == self._settle:
                self._tokens /= self._settle
                self._seconds /= self._settle
                self.value = self._tokens / self._seconds
            return
        self._tokens = 0.9 * self._tokens + 0.1 * tokens
        self._seconds = 0.9 * self._seconds + 0.1 * seconds
        self.value = self._tokens / self._seconds


class LocalProgress:
    """See the module. ``clock``: monotonic seconds (the hook's own time is measured by it)."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.steps = 0
        self.steps_since_round = 0
        self.tokens_since_round = 0
        self.global_step = 0
        """The swarm's progress in inner steps: ``round * H / F`` plus this peer's steps
        into the next round (at most H / F; never decreasing but by a rollback)."""
        self.train_seconds = 0.0
        """Time in the user's steps (forward, backward, update), rounds and hooks aside."""
        self.loss = float("nan")
        """The last training loss the loop reported."""
        self.rate = Rate()
        self.counting_since: float | None = None
        """Swarm time the round's tokens began, if this peer started the round with the
        swarm (its own exchange started it); None after a start or a download: others may
        have been counting for long already, and pacing must not cap their tokens by our
        time."""
        self.resumed_at: float | None = None
        """Swarm time training resumed after a round."""
        self.resume_pending = False
        """A round landed in this hook without overlap: training resumes when it ends."""
        self.step_ended = 0.0
        self._lr_sum = 0.0  # learning rates of the inner steps since the last outer step
        self._lr_steps = 0
        self._hook_s = 0.0  # the last step's hook, rounds and downloads aside
        self._blocked_s = 0.0  # time in rounds and downloads during the current hook

    def stepped(self, tokens: int, lr: float, *, now: float) -> None:
        """One step of the loop ended at ``now`` (monotonic), on ``tokens`` tokens at the
        learning rate ``lr``."""
        seconds = now - self.step_ended  # the user's step: forward, backward, update
        self.steps += 1
        self.steps_since_round += 1
        self.tokens_since_round += tokens
        self._lr_sum += lr
        self._lr_steps += 1
        self.train_seconds += seconds
        # The rate others project this peer's tokens by: a whole cycle, this hook's own
        # time included (a few ms of pacing and bookkeeping weigh on steps of a few ms),
        # the rounds and downloads it waited for left out.
        self.rate.add(tokens, seconds + self._hook_s)

    def hook_ended(self, started: float, swarm_now: Callable[[], float]) -> None:
        """The hook that began at ``started`` ends now; training resumes (at swarm time
        ``swarm_now()`` if a round landed without overlap)."""
        if self.resume_pending:
            self.resume_pending = False
            self.resumed_at = swarm_now()
        ended = self.clock()
        self._hook_s = max(0.0, ended - started - self._blocked_s)
        self._blocked_s = 0.0
        self.step_ended = ended

    @contextlib.contextmanager
    def blocking(self) -> Iterator[None]:
        """Time spent on rounds and downloads between two steps, which the rate leaves out."""
        t0 = self.clock()
        try:
            yield
        finally:
            self._blocked_s += self.clock() - t0

    def advance(self, round: int, h: float) -> None:
        """Move the global step on to ``round`` (the rounds applied, and one in flight)
        plus the steps into the next (at most ``h``)."""
        swarm = int(round * h) + min(self.steps_since_round, int(h))
        self.global_step = max(self.global_step, swarm)

    def round_started(self, now: float) -> None:
        """This peer's exchange started at swarm time ``now``: what trains from now on
        counts towards the next round. Training goes on through the exchange only when it
        overlaps (delay > 0); else it resumes when the round lands."""
        self.steps_since_round = 0
        self.tokens_since_round = 0
        self.counting_since = self.resumed_at = now

    def restart(self) -> None:
        """The local steps since the last round are gone (a download, a discard, a
        rollback): nothing counts towards the next round yet, from no known time."""
        self.steps_since_round = 0
        self.tokens_since_round = 0
        self._lr_sum, self._lr_steps = 0.0, 0
        self.counting_since = self.resumed_at = None

    def mean_lr(self) -> float | None:
        """The mean inner learning rate since the last call (None: no step since)."""
        lr = self._lr_sum / self._lr_steps if self._lr_steps else None
        self._lr_sum, self._lr_steps = 0.0, 0
        return lr

    def state_dict(self) -> dict[str, int]:
        return {name: int(getattr(self, name)) for name in CHECKPOINTED}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for name in CHECKPOINTED:
            setattr(self, name, int(state[name]))
