"""Per-member deadlines within a round: who has been silent too long, and why. No I/O.

A member we wait on fails when it sends nothing at all (not even a heartbeat) for
``liveness_timeout_s``, judged per stream: a member stuck in its handler may still talk on
the streams it opened to us, and the other way round. A reducer fails when it sends no
result of a part we lack for ``reducer_timeout_s``. The senders' own per-chunk deadlines
are the reductions' (:class:`~.reduction.PartReduction`).

Silence is measured on our clock, and our own loop may stall (a GC pause, a blocking
call): what the members sent meanwhile is queued, not lost, and their silence was ours.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from swarmloco.net.averaging.allreduce import AveragingConfig


class Watch:
    """The silence of the members of one round, judged on every tick of a watchdog."""

    def __init__(
        self,
        *,
        members: int,
        started: float,
        config: AveragingConfig,
    ) -> None:
        self.tick = min(max(config.heartbeat_s / 2, 0.02), 0.5)
        """Seconds between two looks."""
        self._liveness_timeout_s = config.liveness_timeout_s
        self._reducer_timeout_s = config.reducer_timeout_s
        self._last_result = dict.fromkeys(range(members), started)
        self._resumed = started  # silence before this was (also) ours
        self._last = started
        self._judged = True

    def heard_result(self, reducer: int, now: float) -> None:
        """``reducer`` sent a result, or was handed a part: its timer starts again."""
        self._last_result[reducer] = now

    def start(self, now: float) -> None:
        """The watchdog starts ticking now."""
        self._last = now

    def judges(self, now: float) -> bool:
        """Whether this tick judges anyone: not right after our own loop stalled."""
        late, self._last = now - self._last - self.tick, now
        if late > self.tick and self._judged:
            # From now on each member has a whole liveness timeout to be heard (what it sent
            # may take more than a tick to come through); judge again on the next tick (a
            # loop late on every tick still judges every other tick).
            self._judged, self._resumed = False, now
            return False
        self._judged = True
        return True

    def silence(
        self,
        member: int,
        now: float,
        *,
        answers_heard: float | None,
        stream_heard: float | None,
        lacking: bool,
    ) -> str | None:
        """Why ``member`` failed (None: it has not). ``answers_heard``: when its answers on
        our stream to it were last heard, None when we expect none; ``stream_heard``: the
        same for its stream to us (0 when it never opened one); ``lacking``: whether we
        still lack a part it reduces."""
        limit = self._liveness_timeout_s
        if answers_heard is not None:
            silent = now - max(answers_heard, self._resumed)
            if silent > limit:
                return f"silent for {silent:.1f}s (its answers)"
        if stream_heard is not None:
            silent = now - max(stream_heard, self._resumed)
            if silent > limit:
                return f"silent for {silent:.1f}s (its stream to us)"
        waited = now - self._last_result[member]
        if waited > self._reducer_timeout_s and lacking:
            return f"no result for {waited:.1f}s"
        return None
