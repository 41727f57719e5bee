"""Streaming DiLoCo: which parameters form each fragment, and when each fragment syncs.

*Streaming DiLoCo* (section 2.2) splits the model into F fragments and syncs fragment f
every H inner steps at offset ``f * H / F``, so a sync moves 1/F of the model and the peak
bandwidth drops F-fold. The exchange of a fragment started at step t overlaps with ``tau``
further inner steps and lands at step ``t + tau``; the fragment's local parameters then
become ``lerp(theta_g_f, theta_f, alpha)`` (alpha = 0 takes the global value).

F = 1, tau = 0 is plain DiLoCo. Fragments are *strided* groups of layers: with 12 blocks and
F = 3, fragment 0 holds blocks 0, 3, 6, 9 (the paper's strided pattern, which spreads
every depth over every fragment).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from swarmloco.core.config import require, require_fraction, require_int


@dataclasses.dataclass(frozen=True, kw_only=True)
class StreamingConfig:
    """When fragments sync. ``fragments=1, delay=0`` is plain DiLoCo."""

    sync_every: int = 50
    """H: inner steps between two syncs of the same fragment."""
    fragments: int = 1
    """F: number of fragments synced at staggered times."""
    delay: int = 0
    """tau: inner steps a fragment's exchange overlaps before its result is applied."""
    alpha: float = 0.0
    """Mix on landing: local = lerp(global, local, alpha); 0 takes the global value."""

    def __post_init__(self) -> None:
        require_int("sync_every", self.sync_every, minimum=1)
        require_int("fragments", self.fragments, minimum=1)
        require_int("delay", self.delay, minimum=0)
        require(
            self.fragments <= self.sync_every,
            f"fragments ({self.fragments}) cannot exceed sync_every ({self.sync_every})",
        )
        require(
            self.delay < self.sync_every,
            f"delay ({self.delay}) must be shorter than sync_every ({self.sync_every}): a "
            "fragment's exchange has to land before that fragment syncs again",
        )
        require_fraction("alpha", self.alpha)


class FragmentSchedule:
    """The pure timetable of a :class:`StreamingConfig`.

    Steps count from 1 (the first inner step). Fragment f starts an exchange after step t
    when ``t % H == offset(f)`` (offset 0 means after steps H, 2H, ...), and that exchange
    lands after step ``t + tau``.
    """

    def __init__(self, config: StreamingConfig) -> None:
        self.config = config
        h, f = config.sync_every, config.fragments
        # Offsets f * H / F, with fragment 0 last in the period so that plain DiLoCo syncs
        # after steps H, 2H, ... like the paper.
        self.offsets = [((i + 1) * h // f) % h for i in range(f)]

    def offset(self, fragment: int) -> int:
        return self.offsets[fragment]

    def starts_after(self, step: int) -> list[int]:
        """Fragments whose exchange starts after inner step ``step`` (>= 1)."""
        if step < 1:
            return []
        h = self.config.sync_every
        return [f for f, off in enumerate(self.offsets) if step % h == off and step >= (off or h)]

    def lands_after(self, step: int) -> list[int]:
        """Fragments whose exchange (started ``tau`` steps earlier) lands after ``step``."""
        return self.starts_after(step - self.config.delay)

    def next_start(self, fragment: int, step: int) -> int:
        """The first step > ``step`` after which ``fragment`` starts an exchange."""
        h, off = self.config.sync_every, self.offsets[fragment]
        first = off or h
        if step < first:
            return first
        return step + ((off - step) % h or h)


def assign_fragments(unit_of_param: Sequence[str], fragments: int) -> list[int]:
    """Fragment index of every parameter, given the layer unit each parameter belongs to.

    Units are numbered in order of first appearance (embeddings, block 0, block 1, ...,
    head) and unit k goes to fragment ``k % fragments``: a strided pattern. Every parameter
    belongs to exactly one fragment; with more fragments than units, the extra ones are
    empty, which is a configuration error.
    """
    require_int("fragments", fragments, minimum=1)
    order: dict[str, int] = {}
    for unit in unit_of_param:
        order.setdefault(unit, len(order))
    require(
        len(order) >= fragments,
        f"the model has {len(order)} layer units, too few for {fragments} fragments",
    )
    return [order[unit] % fragments for unit in unit_of_param]
