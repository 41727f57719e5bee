"""What a peer tells the swarm of itself in its ``status`` record: who it is, where it is,
how fast it trains, its last rounds, how its step fits its device.

The dashboard and `swarmloco status` read these records; nothing else does. The peer
keeps a :class:`StatusSheet` and hands it its counters when the record is refreshed
(every few seconds, on the peer's loop thread). The sheet holds what the peer's parts
tell the dashboard and keep nowhere else: the state in a word and the last error (set by
whichever part meets it), the round timeline and the description of its compute.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

from swarmloco import __version__

TIMELINE_ROUNDS = 8
"""Rounds the timeline keeps (the status record's schema takes at most this many)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Counters:
    """A peer's figures as they stand when its status is refreshed."""

    round: int
    step: int
    tokens: int
    tokens_per_s: float
    rounds_applied: int
    rounds_aborted: int
    downloads: int
    loss: float
    eval_loss: float | None
    at: float


class StatusSheet:
    """A peer's round timeline and compute description, and the ``status`` value built
    from them and its :class:`Counters`."""

    def __init__(self, *, name: str, device: str, started_at: float) -> None:
        self.name = name
        self.device = device
        self.started_at = started_at
        self.state = "starting"
        """In a word: starting, training, averaging, stopping."""
        self.last_error = ""
        """What last went wrong, until it is set right (a checkpoint written again, ...)."""
        self.timeline: collections.deque[dict[str, Any]] = collections.deque(maxlen=TIMELINE_ROUNDS)
        self._fit = ""
        self.data: Callable[[], dict[str, int]] | None = None
        """On a pinned dataset: its reader's progress through the epoch."""
        self._flops_per_token: float | None = None
        self._peak_flops: float | None = None

    def remember(
        self,
        *,
        round: int,
        group: int,
        seconds: float,
        payload_bytes: int,
        bytes_sent: int = 0,
        bytes_received: int = 0,
        ok: bool,
        matchmaking_s: float | None = None,
    ) -> None:
        """One line of the round timeline: ``group`` 0 and not ``ok`` for an aborted
        round; ``payload_bytes`` the fp32 bytes of the update (its ratio to the bytes sent
        is the compression the codec gave)."""
        line: dict[str, Any] = {
            "round": round,
            "group": group,
            "seconds": seconds,
            "bytes_sent": bytes_sent,
            "bytes_received": bytes_received,
            "payload_bytes": payload_bytes,
            "ok": ok,
            "at": time.time(),
        }
        if matchmaking_s is not None:
            line["matchmaking_s"] = matchmaking_s
        self.timeline.append(line)

    def describe_compute(
        self,
        *,
        fit: str = "",
        flops_per_token: float | None = None,
        peak_flops: float | None = None,
    ) -> None:
        """How the peer's step fits its device (``fit``, a few words), and what its model
        FLOPs utilisation is computed from: the training FLOPs of a token and the device's
        peak (both needed; the rate is the peer's own)."""
        self._fit = fit
        self._flops_per_token = flops_per_token
        self._peak_flops = peak_flops

    def value(self, counters: Counters) -> dict[str, Any]:
        """The ``status`` record's value, every field within its schema's bounds."""
        c = counters
        value: dict[str, Any] = {
            "name": self.name[:64],
            "state": self.state,
            "round": c.round,
            "step": c.step,
            "tokens": c.tokens,
            "tokens_per_s": c.tokens_per_s,
            "device": self.device[:64],
            "version": __version__[:32],
            "started_at": self.started_at,
            "rounds_applied": c.rounds_applied,
            "rounds_aborted": c.rounds_aborted,
            "downloads": c.downloads,
            "last_error": self.last_error[:240],
            "rounds": list(self.timeline),
            "at": c.at,
        }
        if self._fit:
            value["fit"] = self._fit[:64]
        if self.data is not None:
            value["data"] = self.data()
        if self._flops_per_token and self._peak_flops and c.tokens_per_s > 0:
            value["mfu"] = min(1.0, c.tokens_per_s * self._flops_per_token / self._peak_flops)
        if math.isfinite(c.loss):
            value["loss"] = c.loss
        if c.eval_loss is not None and math.isfinite(c.eval_loss):
            value["eval_loss"] = c.eval_loss
        return value
