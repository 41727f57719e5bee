"""Stage 0's micro-batches from a pinned dataset's leases (``docs/DESIGN.md`` section 10,
"A pinned dataset"): :class:`LeasedFeed`.

The driver takes a micro-batch's ranges *in flight* (``LeasedData.take_ranges``) and names
the micro-batch; the stage-0 replica names the micro-batches each step it takes holds
(``StageReplica.on_step``), and their ranges are recorded as read there, on the stepping
thread, before the step's hook may start a round (so a round declares what its delta
holds). A micro-batch that fails, or whose step was skipped, gives its ranges back; one
whose sequences landed in the state before its stage-0 forward (a state this peer took
holds them), or whose shard was given up meanwhile (another took it while this peer's
leases lapsed), is withdrawn there, untrained.
"""

from __future__ import annotations

import threading

import torch

from swarmloco.dataset.leases import LeasedData, read_batch
from swarmloco.dataset.ledger import Range
from swarmloco.pipeline.driver import micro_batch_name
from swarmloco.pipeline.replica import StageReplica


class LeasedFeed:
    """The micro-batches of ``reader`` (its batch size: a micro-batch's sequences) through
    the stage-0 ``replica`` of this peer, whose steps are ``step`` sequences. Install with
    :meth:`attach` before driving."""

    def __init__(self, reader: LeasedData, replica: StageReplica, *, step: int) -> None:
        self.reader = reader
        self.replica = replica
        self.step = step  # a step's sequences: the shards are leased two steps ahead
        self._flying: dict[bytes, list[Range]] = {}
        self._lock = threading.Lock()

    def attach(self) -> None:
        self.replica.on_step = self._stepped
        self.replica.admits = self._wanted

    def take(self) -> tuple[torch.Tensor, torch.Tensor, bytes] | None:
        """The next micro-batch (inputs, targets, name), or None when none is to be read
        now (every shard left is another's, or the last epoch is read: the caller waits
        on ``reader.changed``)."""
        if not self.reader.ready(step=self.step):
            return None
        ranges = self.reader.take_ranges()
        if not ranges:  # past the last sequences of a short step
            return None
        name = micro_batch_name()
        with self._lock:
            self._flying[name] = ranges
        try:
            x, y = read_batch(self.reader.sequences, ranges, self.reader.vocab_size)
        except BaseException:
            self.failed(name)
            raise
        return x, y, name

    def failed(self, name: bytes) -> None:
        """The micro-batch ``name`` will not come through: its ranges are read again,
        unless its gradient reached this peer's accumulator before it failed (then the
        step that holds it records them)."""
        if self.replica.withdraw(name):
            return
        with self._lock:
            ranges = self._flying.pop(name, None)
        if ranges is not None:
            self.reader.give_back(ranges)

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._flying)

    def _wanted(self, name: bytes) -> bool:
        """(The replica's ``admits``, under its lock.) Whether nothing of the micro-batch
        landed in the state since it was taken (a state this peer took meanwhile, being
        behind, may hold its sequences, read by another peer) and none of its shards was
        given up since (taken by another while this peer's leases lapsed)."""
        with self._lock:
            ranges = self._flying.get(name)
        return ranges is None or not (
            self.reader.landed_any(ranges) or self.reader.lost_any(ranges)
        )

    def _stepped(self, names: list[bytes], stepped: bool) -> None:
        """(The replica's ``on_step``, under its lock.)"""
        with self._lock:
            taken = [self._flying.pop(n) for n in names if n in self._flying]
        ranges = [r for rs in taken for r in rs]
        if stepped:
            self.reader.trained(ranges)
        else:
            self.reader.give_back(ranges)
