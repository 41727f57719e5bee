"""The beats of a driver's session with a stage replica (``Attend``, docs/DESIGN.md section
10): each side sends one at least every beat interval and takes the other for gone once
it heard nothing for the silence. Two things must not pass for the other side's silence
or for a flood: this process not running (its machine froze and came back, or its event
loop was held), and the beats a stalled link then delivers all at once.

Pure: the caller passes the times (its event loop's clock).
"""

from __future__ import annotations

BURST = 16
"""Beats taken at once beyond the pace (a link that held some back delivers them
together)."""
PACE = 4.0
"""Beats taken per beat interval asked for, on average since the session opened (an
honest side sends one)."""


class Beats:
    """What one side heard on a session: when last, and how many beats since it opened."""

    def __init__(self, *, beat_s: float, silence_s: float, now: float) -> None:
        self.beat_s = beat_s
        self.silence_s = silence_s
        self.opened = self.heard = now
        self.count = 0

    def waited(self, *, asked: float, slept: float, now: float) -> None:
        """A wait for a beat that was asked to last ``asked`` seconds took ``slept``: far
        longer (by half the silence) means this process did not run meanwhile (frozen, or
        its event loop held), so the other side's quiet proves nothing: it gets a silence
        afresh."""
        if slept - asked > self.silence_s / 2:
            self.heard = now

    def heard_one(self, now: float) -> bool:
        """A beat came now. False: more have come than the pace allows (``BURST`` beyond
        ``PACE`` a beat interval since the session opened): each costs a read."""
        self.heard = now
        self.count += 1
        return self.count <= BURST + PACE * (now - self.opened) / self.beat_s

    def silent(self, now: float) -> bool:
        """Nothing heard for the silence."""
        return now - self.heard >= self.silence_s

    def wake(self, written: float) -> float:
        """When to wake next: to beat (after ``written``, the last beat sent) or to find
        the other side silent."""
        return min(self.heard + self.silence_s, written + self.beat_s)
