"""A peer's batches from the shards of a pinned dataset it leases through the DHT, every
sequence landing once (DESIGN section 11, "Exactly once"): :class:`LeasedData`.

The training thread reads batches (:meth:`LeasedData.ready`, :meth:`LeasedData.next_batch`)
and the round driver tells it what became of them (:meth:`declare`, :meth:`landed`,
:meth:`failed`, :meth:`discard`); a task on the peer's event loop (:meth:`run`) keeps the
leases: it claims a shard when the reader runs short, renews the peer's ``leases`` record,
releases a shard once all of it landed, publishes what this peer saw land (``shard/<s>``)
and moves to the next epoch when every shard is done.

Whom it believes: a shard's landed spans count when this peer saw them land itself (its
audit) or a peer it averaged with in a round it applied says so; a stranger's entry moves
nothing. A peer holds at most :data:`MAX_LEASES` shards (the ``leases`` record holds no
more); a claim is stored, then the record read again: a claimant that finds another peer
listing the same shard withdraws.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from swarmloco.dataset.ledger import (
    Audit,
    Landing,
    Ledger,
    Range,
    Sequences,
    epoch_order,
    merged,
    read_audit,
)
from swarmloco.errors import DataError
from swarmloco.net.records import MAX_LANDED_SPANS, MAX_LEASES, leases_key, shard_key

logger = logging.getLogger(__name__)

LEASE_S = 60.0
"""How long a lease lives unless renewed (renewed every quarter of it)."""
SHARD_ENTRY_TTL_S = 86400.0
"""How long a peer's word on a shard's landed spans lives in the DHT."""

Span = tuple[int, int]
"""Sequences ``[first, end)`` of one shard."""


def spans_union(spans: Sequence[Span]) -> list[Span]:
    out: list[Span] = []
    for first, end in sorted(spans):
        if out and first <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((first, end))
    return out


def spans_minus(whole: Span, taken: Sequence[Span]) -> list[Span]:
    """``whole`` without ``taken``."""
    out, at = [], whole[0]
    for first, end in spans_union(taken):
        if first > at:
            out.append((at, min(first, whole[1])))
        at = max(at, end)
        if at >= whole[1]:
            break
    if at < whole[1]:
        out.append((at, whole[1]))
    return [s for s in out if s[0] < s[1]]


class LeasedData:
    """The batches of one peer on a pinned dataset (see the module).

    ``sequences``: the dataset's training sequences; ``seed``: the run's (it orders each
    epoch's shards); ``fragments``: the run's F; ``audit``: where the landings this peer
    saw are appended; ``max_epochs``: stop the peer once this many epochs are done (None:
    go on)."""

    def __init__(
        self,
        sequences: Sequences,
        *,
        batch_size: int,
        vocab_size: int,
        seed: int,
        fragments: int,
        audit: Path,
        max_epochs: int | None = None,
        lease_s: float = LEASE_S,
    ) -> None:
        self.sequences = sequences
        self.batch_size = batch_size
        self.vocab_size = vocab_size
        self.seed = seed
        self.max_epochs = max_epochs
        self.lease_s = lease_s
        self.ledger = Ledger(fragments)
        self.audit = Audit(audit)
        self.epoch = 0
        self.trusted: set[str] = set()
        """Peers whose word on landed spans counts: those this peer averaged with."""
        self.known: dict[tuple[int, int], list[Span]] = {}
        """(epoch, shard) -> the spans this peer knows landed (first-hand or trusted)."""
        self.reading: dict[int, list[Span]] = {}
        """Shard this peer leases (this epoch) -> the spans it has still to read."""
        self.done: set[int] = set()
        """Shards of this epoch known to have landed whole."""
        self.waiting = ""
        """Why no batch is to be had ("" when batches are)."""
        self.epochs_done = 0
        self.stop_peer: Callable[[str], None] = lambda why: None
        self.changed = threading.Event()
        """Set when batches may have become available (a shard leased, an epoch ended)."""
        self._lock = threading.Lock()
        self._short = asyncio.Event()  # set from the reader (through the loop) when short
        self._dirty: set[tuple[int, int]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        for landing in read_audit(audit):  # what this peer saw land before a restart
            self._know(landing.ranges)

    # -- the training thread -----------------------------------------------------------------

    def ready(self, batches: int = 1) -> bool:
        """Whether ``batches`` batches can be read now (else the lease task is asked for a
        shard, and the caller idles). The last sequences of an epoch make a short batch."""
        with self._lock:
            have = self._available()
            want = batches * self.batch_size
            if have >= want:
                return True
            self._ask()
            return have > 0 and self._epoch_ending()

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        with self._lock:
            ranges = self._take(self.batch_size)
            if not ranges:
                raise DataError("no sequence is to be read: call ready() first")
            self.ledger.read(ranges)
        windows = np.concatenate([self.sequences.read(r) for r in ranges])
        batch = torch.from_numpy(windows)
        top = int(batch.max())
        if top >= self.vocab_size or int(batch.min()) < 0:
            raise DataError(f"token id {top} is outside the vocabulary of {self.vocab_size}")
        return batch[:, :-1], batch[:, 1:]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield self.next_batch()

    def _available(self) -> int:
        redo = sum(r.count for r in self.ledger.redo if r.shard in self.reading)
        return redo + sum(end - first for spans in self.reading.values() for first, end in spans)

    def _epoch_ending(self) -> bool:
        """Whether no shard is left to claim in this epoch (the reader's last sequences may
        then make a short batch)."""
        return len(self.done) + len(self.reading) >= len(self.sequences.counts) or (
            self.waiting.startswith("every shard")
        )

    def _take(self, limit: int) -> list[Range]:
        out: list[Range] = []
        # Given back first (only of shards this peer still leases), then the leased spans.
        keep = [r for r in self.ledger.redo if r.shard not in self.reading]
        self.ledger.redo = [r for r in self.ledger.redo if r.shard in self.reading]
        for r in self.ledger.take_redo(limit):
            for first, end in spans_minus((r.first, r.end), self.known.get((r.epoch, r.shard), [])):
                out.append(Range(r.epoch, r.shard, first, end - first))
        self.ledger.redo = merged([*self.ledger.redo, *keep])
        limit -= sum(r.count for r in out)
        for shard, spans in self.reading.items():
            while spans and limit > 0:
                first, end = spans[0]
                n = min(limit, end - first)
                out.append(Range(self.epoch, shard, first, n))
                limit -= n
                spans[0] = (first + n, end)
                if first + n == end:
                    spans.pop(0)
            if limit <= 0:
                break
        return out

    def _ask(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._short.set)

    # -- what became of the ranges read (the round driver, on the training thread) ----------

    def declare(self, round: int, fragment: int) -> list[tuple[int, int, int, int]]:
        with self._lock:
            return [
                (r.epoch, r.shard, r.first, r.count) for r in self.ledger.declare(round, fragment)
            ]

    def landed(
        self,
        round: int,
        declared: Mapping[str, Sequence[tuple[int, int, int, int]]],
        included: Mapping[str, bool],
        me: str,
    ) -> None:
        """Round ``round`` was applied: ``declared`` is what each member said its update
        completes, ``included`` whether each member's contribution counted whole."""
        landings = [
            Landing(round, peer, tuple(merged(Range(*r) for r in ranges)))
            for peer, ranges in declared.items()
            if ranges and included.get(peer, False)
        ]
        self.audit.append(landings)  # before the round's checkpoint
        with self._lock:
            self.trusted.update(p for p, ok in included.items() if ok and p != me)
            self.ledger.landed(round, included=included.get(me, False))
            for landing in landings:
                self._know(landing.ranges)
        self._ask()

    def failed(self, round: int) -> None:
        with self._lock:
            self.ledger.failed(round)

    def discard(self) -> None:
        """The local work is thrown away: what it read is read again (what of it is known to
        have landed meanwhile is not)."""
        with self._lock:
            given = self.ledger.discard()
        if given:
            logger.info("%d sequence(s) given back to be read again", sum(r.count for r in given))

    def _know(self, ranges: Sequence[Range]) -> None:
        for r in ranges:
            key = (r.epoch, r.shard)
            self.known[key] = spans_union([*self.known.get(key, []), (r.first, r.end)])
            self._dirty.add(key)
            if r.epoch == self.epoch and self._landed_whole(r.shard):
                self.done.add(r.shard)

    def _landed_whole(self, shard: int) -> bool:
        return (
            spans_minus((0, self.sequences.counts[shard]), self.known.get((self.epoch, shard), []))
            == []
        )

    # -- checkpoints -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            return {
                "epoch": self.epoch,
                "ledger": self.ledger.state_dict(),
                "trusted": sorted(self.trusted),
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            epoch = int(state["epoch"])
            trusted = {str(p) for p in state["trusted"]}
        except (KeyError, TypeError, ValueError) as exc:
            raise DataError(f"the leased data's state is malformed: {exc}") from exc
        with self._lock:
            self.ledger.load_state_dict(state["ledger"])
            self.epoch, self.trusted = epoch, trusted
            self.done = {s for s in range(len(self.sequences.counts)) if self._landed_whole(s)}

    # -- the leases (the peer's event loop) --------------------------------------------------

    def pending(self) -> bool:
        with self._lock:
            return bool(self.ledger.pending)

    async def run(self, dht: Any, swarm_id: str, peer_id: str) -> None:
        """Keep this peer's leases until :meth:`close` (then release them)."""
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        try:
            await self._reclaim(dht, swarm_id, peer_id)
            while True:
                try:
                    await self._tend(dht, swarm_id, peer_id)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # the network may be away for a while
                    logger.warning("could not tend the dataset's leases: %s", exc)
                self._short.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._short.wait(), timeout=self.lease_s / 4)
        finally:
            with contextlib.suppress(Exception):
                await self._store_leases(dht, swarm_id, [], ttl=self.lease_s)

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _reclaim(self, dht: Any, swarm_id: str, peer_id: str) -> None:
        """After a restart: claim again the shards of the ranges not landed; those another
        peer leases now are its to read (they are forgotten here)."""
        with self._lock:
            mine = sorted(
                {r.shard for r in self.ledger.redo} | {e.range.shard for e in self.ledger.pending}
            )
        if not mine:
            return
        held = await self._held_by_others(dht, swarm_id, peer_id)
        free = [s for s in mine if s not in held][:MAX_LEASES]
        if free:
            await self._store_leases(dht, swarm_id, free, ttl=self.lease_s)
        with self._lock:
            for s in free:
                self.reading.setdefault(s, [])
            gone = self.ledger.drop(lambda r: r.shard not in free or r.epoch != self.epoch)
        if gone:
            logger.info(
                "%d sequence(s) not landed are another peer's to read now",
                sum(r.count for r in gone),
            )

    async def _tend(self, dht: Any, swarm_id: str, peer_id: str) -> None:
        await self._publish_landed(dht, swarm_id)
        with self._lock:
            self._release_done()
            short = self._available() < 2 * self.batch_size and len(self.reading) < MAX_LEASES
        if short:
            await self._claim(dht, swarm_id, peer_id)
        with self._lock:
            shards = sorted(self.reading)
        await self._store_leases(dht, swarm_id, shards, ttl=self.lease_s)

    def _release_done(self) -> None:
        """Give up the shards read to the end whose every range landed."""
        held = self.ledger.held_shards()
        for shard in [s for s, spans in self.reading.items() if not spans]:
            if (self.epoch, shard) not in held:
                del self.reading[shard]
                logger.info("shard %d of epoch %d read and landed: released", shard, self.epoch)

    async def _claim(self, dht: Any, swarm_id: str, peer_id: str) -> None:
        count = len(self.sequences.counts)
        held = await self._held_by_others(dht, swarm_id, peer_id)
        order = epoch_order(self.seed, self.epoch, count)
        start = int(peer_id[:8], 16) % count
        leased_elsewhere = 0
        for shard in order[start:] + order[:start]:
            with self._lock:
                if shard in self.reading or shard in self.done:
                    continue
            if shard in held:
                leased_elsewhere += 1
                continue
            await self._learn(dht, swarm_id, shard)
            with self._lock:
                todo = spans_minus(
                    (0, self.sequences.counts[shard]), self.known.get((self.epoch, shard), [])
                )
                if not todo:
                    self.done.add(shard)
                    continue
                mine = sorted(self.reading)
            await self._store_leases(dht, swarm_id, [*mine, shard], ttl=self.lease_s)
            rivals = await self._held_by_others(dht, swarm_id, peer_id)
            if shard in rivals:  # claimed at the same time: both withdraw, try another
                await self._store_leases(dht, swarm_id, mine, ttl=self.lease_s)
                leased_elsewhere += 1
                continue
            with self._lock:
                self.reading[shard] = todo
                self.waiting = ""
            self.changed.set()
            logger.info(
                "leased shard %d of epoch %d: %d sequence(s) to read",
                shard,
                self.epoch,
                sum(e - f for f, e in todo),
            )
            return
        with self._lock:
            if leased_elsewhere or self.reading or self.ledger.held_shards():
                self.waiting = (
                    f"waiting for data: the {leased_elsewhere} shard(s) left are leased by others"
                    if leased_elsewhere and not self.reading
                    else ""
                )
                return
            self._next_epoch()
        self.changed.set()

    def _next_epoch(self) -> None:
        self.epochs_done = self.epoch + 1
        logger.info("epoch %d of the dataset is done: every shard landed", self.epoch)
        if self.max_epochs is not None and self.epochs_done >= self.max_epochs:
            self.waiting = f"every shard of the dataset's {self.max_epochs} epoch(s) landed"
            self.stop_peer(self.waiting)
            return
        self.epoch += 1
        self.done = {s for s in range(len(self.sequences.counts)) if self._landed_whole(s)}
        self.waiting = ""

    async def _held_by_others(self, dht: Any, swarm_id: str, peer_id: str) -> set[int]:
        """Shards of this epoch other peers' live ``leases`` records list."""
        result = await dht.get(leases_key(swarm_id))
        held: set[int] = set()
        for entry in result.entries.values():
            if entry.subkey != peer_id and entry.value["epoch"] == self.epoch:
                held.update(int(s) for s in entry.value["shards"])
        return held

    async def _learn(self, dht: Any, swarm_id: str, shard: int) -> None:
        """What the peers this one trusts say landed of ``shard`` (this epoch)."""
        result = await dht.get(shard_key(swarm_id, shard))
        spans: list[Span] = []
        with self._lock:
            for entry in result.entries.values():
                if entry.subkey in self.trusted and entry.value["epoch"] == self.epoch:
                    spans += [(int(a), int(b)) for a, b in entry.value["landed"] if a < b]
            if spans:
                self._know([Range(self.epoch, shard, a, b - a) for a, b in spans_union(spans)])

    async def _publish_landed(self, dht: Any, swarm_id: str) -> None:
        with self._lock:
            dirty, self._dirty = sorted(self._dirty), set()
            entries = [(key, self.known[key][:MAX_LANDED_SPANS]) for key in dirty]
        for (epoch, shard), spans in entries:
            value = {"epoch": epoch, "landed": [list(s) for s in spans], "at": dht.clock()}
            try:
                await dht.store(shard_key(swarm_id, shard), value, ttl=SHARD_ENTRY_TTL_S)
            except Exception:
                with self._lock:
                    self._dirty.add((epoch, shard))
                raise

    async def _store_leases(
        self, dht: Any, swarm_id: str, shards: Sequence[int], *, ttl: float
    ) -> None:
        value = {"epoch": self.epoch, "shards": list(shards), "at": dht.clock()}
        await dht.store(leases_key(swarm_id), value, ttl=ttl)

    # -- what the dashboard shows --------------------------------------------------------------

    def progress(self) -> dict[str, Any]:
        """This epoch's progress as this peer knows it."""
        with self._lock:
            landed = sum(
                e - f for (ep, _), spans in self.known.items() if ep == self.epoch for f, e in spans
            )
            return {
                "epoch": self.epoch,
                "sequences": self.sequences.total,
                "landed": landed,
                "shards": len(self.sequences.counts),
                "leased": sorted(self.reading),
                "done": len(self.done),
                "waiting": self.waiting,
            }
