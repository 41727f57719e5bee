"""A peer's batches from the shards of a pinned dataset it leases through the DHT, every
sequence landing once (DESIGN section 11, "Exactly once"): :class:`LeasedData`.

The training thread reads batches (:meth:`LeasedData.ready`, :meth:`LeasedData.next_batch`)
and the round driver tells it what became of them (:meth:`declare`, :meth:`landed`,
:meth:`failed`, :meth:`discard`) and of the state (:meth:`adopted`, :meth:`restored`); a
task on the peer's event loop (:meth:`run`) keeps the leases: it claims (and fetches) a
shard when the reader runs short, renews the peer's ``leases`` record, releases a shard
once all of it landed and moves to the next epoch when nothing of the current one is free.

What landed is the account of the state this peer holds (``ledger.Landed``: the rounds it
applied add to it, a state it takes brings its own): it reads what has not landed there.
Nobody's word on what landed is read, a stranger's or a partner's. A peer holds at most
:data:`MAX_LEASES` shards (the ``leases`` record holds no more); a claim is stored, then the
record read again: a claimant that finds another peer listing the same shard withdraws.
Another peer's listing counts only while it shows work (:data:`IDLE_S`): a key that lists
shards and never reads them holds nothing past that. An entry this peer cannot read (its
schema is checked again here) is passed over, the others counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from swarmloco.dataset.ledger import (
    Audit,
    Landed,
    Landing,
    Ledger,
    Range,
    Sequences,
    epoch_order,
    merged,
)
from swarmloco.errors import DataError
from swarmloco.net.records import LEASES, MAX_LEASES, leases_key

logger = logging.getLogger(__name__)

LEASE_S = 60.0
"""How long a lease lives unless renewed (renewed every quarter of it)."""
STALE_LEASE = 0.75
"""Past this share of its life without a renewal, a lease is not read from any more."""
IDLE_S = 1800.0
"""A shard other peers list is theirs to read while something of it landed (as this peer
knows it) within this long of this peer first finding it listed, or while one of its
listers averaged with this peer in a round it applied within as long; past that the
listing is idle and the shard free to this peer (docs/SECURITY.md, "Datasets")."""

CLOSE_WAIT_S = 5.0
"""How long :meth:`LeasedData.close` waits for the lease task to end by itself."""

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


Lease = tuple[int, int]
"""``(epoch, shard)``."""

_T = TypeVar("_T")


def read_batch(
    sequences: Sequences, ranges: Sequence[Range], vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The inputs and targets of the sequences of ``ranges`` (no rows for none)."""
    if not ranges:
        empty = torch.empty((0, sequences.seq_len), dtype=torch.int64)
        return empty, empty.clone()
    batch = torch.from_numpy(np.concatenate([sequences.read(r) for r in ranges]))
    top = int(batch.max())
    if top >= vocab_size or int(batch.min()) < 0:
        raise DataError(f"token id {top} is outside the vocabulary of {vocab_size}")
    return batch[:, :-1], batch[:, 1:]


class DealtData:
    """The data of a rank of a box other than 0, on a pinned dataset: rank 0 leases for
    the box and deals each rank the ranges of its micro-batches before each step
    (:meth:`LeasedData.deal`); this rank reads them (:func:`read_batch`) from its own copy
    of the shards."""

    def __init__(self, sequences: Sequences, *, vocab_size: int) -> None:
        self.sequences = sequences
        self.vocab_size = vocab_size

    def state_dict(self) -> dict[str, Any]:
        return {}  # what was read is rank 0's to keep

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def listed_in(value: Any) -> list[Lease]:
    """The leases a ``leases`` entry's ``value`` lists (its schema checked again)."""
    LEASES.schema.check(value, "leases entry")
    return [(epoch, shard) for epoch, shard in value["shards"]]


class LeasedData:
    """The batches of one peer on a pinned dataset (see the module).

    ``sequences``: the dataset's training sequences; ``seed``: the run's (it orders each
    epoch's shards); ``fragments``: the run's F; ``audit``: where the landings this peer
    saw are appended; ``max_epochs``: leave once every shard of the first ``max_epochs``
    epochs is known to have landed (None: go on); ``read_log``: a file the ranges of each
    batch are appended to."""

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
        idle_s: float = IDLE_S,
        read_log: Path | None = None,
    ) -> None:
        self.sequences = sequences
        self.read_log = read_log
        self.batch_size = batch_size
        self.vocab_size = vocab_size
        self.seed = seed
        self.max_epochs = max_epochs
        self.lease_s = lease_s
        self.idle_s = idle_s
        self.ledger = Ledger(fragments)
        self.audit = Audit(audit)
        self.epoch = 0
        """The newest epoch this peer claims shards of."""
        self.open_epoch = 0
        """The oldest epoch with a shard not known to have landed (claimed first)."""
        self.account = Landed()
        """What landed in the state this peer holds (the rounds it applied add to it; a state
        it takes, or restores, brings its own)."""
        self.known: dict[Lease, list[Span]] = {}
        """(epoch, shard) -> the spans of :attr:`account`, by shard."""
        self.reading: dict[Lease, list[Span]] = {}
        """(epoch, shard) this peer leases -> the spans it has still to read."""
        self.ended = ""
        """Why the peer leaves ("" while it reads)."""
        self.last_epoch = False
        """Nothing of the last epoch ``max_epochs`` allows is left to claim: the last
        sequences make a short batch, and the peer leaves once its own landed."""
        self.stop_peer: Callable[[str], None] = lambda why: None
        self.changed = threading.Event()
        """Set when batches may have become available (a shard leased, an epoch ended)."""
        self._lock = threading.Lock()
        self._short = asyncio.Event()  # set from the reader (through the loop) when short
        self._step = batch_size  # the sequences of a step, as ready() was last asked
        self._stopping = False  # close() asked the lease task to end
        self._unavailable: set[int] = set()  # shards no source served (tried again later)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._renewed = time.monotonic()  # when this peer's leases record was last stored
        self._partnered: dict[str, float] = {}  # peer -> when last in a round applied here
        self._quiet: dict[Lease, float] = {}  # listed by others -> since when nothing landed
        self._idle: set[Lease] = set()  # listed by others, idle at the last look
        self._malformed: set[str] = set()  # peers with an entry passed over (logged once)
        self._flying: list[Range] = []  # taken, neither trained nor given back yet
        self._open: set[int] = set()  # rounds declared, neither landed nor failed yet
        self._fresh: dict[Lease, set[int]] = {}  # leased while these rounds were open
        self._lapsed: set[Lease] = set()  # held as the leases lapsed, listed by another since
        self._lost: list[Range] = []  # in flight as their shards were given up: not ours now

    # -- the training thread -----------------------------------------------------------------

    def ready(self, batches: int = 1, *, step: int | None = None) -> bool:
        """Whether ``batches`` batches can be read now (else the lease task is asked for a
        shard, and the caller idles). The last sequences of the last epoch make a short
        step, and so do the last of the shards leased when no more may be (at
        :data:`MAX_LEASES`: one is released only once read to its end and landed).
        ``step``: the sequences of a step where a step is read a batch at a time (a
        pipeline's stage 0): the shards are leased ahead by it."""
        with self._lock:
            if self.reading and time.monotonic() - self._renewed > STALE_LEASE * self.lease_s:
                # Its leases could not be renewed (the network is away): another peer may
                # take them soon; nothing more is read of them until they are renewed.
                self._ask()
                return False
            want = batches * self.batch_size
            self._step = max(want, step or 0)
            have = self._available()
            if have >= want:
                return True
            self._ask()
            return have > 0 and self._short_step()

    def _short_step(self) -> bool:
        """Whether a step may be short (no more is coming until what is left is read): the
        last epoch's end, or every shard this peer may lease leased. (Under the lock.)"""
        return self.last_epoch or len(self.reading) >= MAX_LEASES

    @property
    def exhausted(self) -> bool:
        """No batch is coming until what was read lands: nothing of the last epoch
        ``max_epochs`` allows is left to claim (every shard landed, or leased), or every
        shard this peer may lease (:data:`MAX_LEASES`) is read to its end and waits for its
        ranges to land (rounds that failed meanwhile: its partners went away). The caller
        averages what it trained now, instead of when its steps would make a round due
        (it takes none)."""
        with self._lock:
            if self.last_epoch:
                return True
            return self._short_step() and self._available() == 0 and bool(self.ledger.pending)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next micro-batch (empty past the sequences of a short step: see
        :meth:`ready`)."""
        return read_batch(self.sequences, self.next_ranges(), self.vocab_size)

    def next_ranges(self) -> list[Range]:
        """The ranges of the next micro-batch, recorded as read (none past the sequences
        of a short step: see :meth:`ready`)."""
        ranges = self.take_ranges()
        self.trained(ranges)
        return ranges

    def take_ranges(self) -> list[Range]:
        """The ranges of the next micro-batch, *in flight* until :meth:`trained` (its
        gradient is in a step: a pipeline's stage 0 learns that later) or
        :meth:`give_back` (it never will be); their shards are held meanwhile. None past
        the sequences of a short step (see :meth:`ready`)."""
        with self._lock:
            ranges = self._take(self.batch_size)
            if not ranges and not self._short_step():
                raise DataError("no sequence is to be read: call ready() first")
            self._flying.extend(ranges)
        return ranges

    def trained(self, ranges: Sequence[Range]) -> None:
        """``ranges``, taken in flight, are trained into the local state: recorded as read
        (declared by the next round of each fragment)."""
        with self._lock:
            ranges = self._land_flying(ranges)
            self.ledger.read(ranges)
        if self.read_log is not None and ranges:  # flushed, not synced: outlives a SIGKILL
            with self.read_log.open("a", encoding="utf-8") as fh:
                fh.write(json.dumps([r.to_list() for r in ranges]) + "\n")

    def give_back(self, ranges: Sequence[Range]) -> None:
        """``ranges``, taken in flight, were not trained (the micro-batch failed): they are
        read again, first."""
        with self._lock:
            ranges = self._land_flying(ranges)
            self.ledger.redo = merged([*self.ledger.redo, *ranges])
        if ranges:
            self.changed.set()

    def landed_any(self, ranges: Sequence[Range]) -> bool:
        """Whether any sequence of ``ranges`` landed in the state this peer holds."""
        with self._lock:
            return any(
                spans_minus((r.first, r.end), self.known.get((r.epoch, r.shard), []))
                != [(r.first, r.end)]
                for r in ranges
            )

    def lost_any(self, ranges: Sequence[Range]) -> bool:
        """Whether any of ``ranges``, in flight, is of a shard given up since it was taken
        (:meth:`forget_lapsed`): another peer reads it now, so its micro-batch must not be
        trained here."""
        with self._lock:
            return any(r in self._lost for r in ranges)

    def _land_flying(self, ranges: Sequence[Range]) -> list[Range]:
        """``ranges`` are in flight no more: those still this peer's to record or read again
        (not of a shard given up meanwhile)."""
        kept = []
        for r in ranges:
            if r in self._flying:
                self._flying.remove(r)
                kept.append(r)
            else:
                self._lost.remove(r)  # (its shard is another's: not recorded, not read again)
        return kept

    def _held_shards(self) -> set[Lease]:
        """The shards this peer holds on to: ranges read and not landed, given back, or in
        flight. (Under the lock.)"""
        return self.ledger.held_shards() | {(r.epoch, r.shard) for r in self._flying}

    def deal(self, ranks: int, micro_batches: int) -> list[list[list[Range]]]:
        """A box's step: for each of ``ranks`` ranks, the ranges of its ``micro_batches``
        micro-batches, all recorded as read by this peer (dealt micro-batch by micro-batch,
        so rank 0 has the first sequences: a short last step trains on rank 0 at least).
        Call :meth:`ready` with ``ranks * micro_batches`` first."""
        dealt: list[list[list[Range]]] = [[] for _ in range(ranks)]
        for _ in range(micro_batches):
            for rank in range(ranks):
                dealt[rank].append(self.next_ranges())
        return dealt

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield self.next_batch()

    def _available(self, *, fresh: bool = False) -> int:
        """The sequences to be read now (``fresh``: and those of the shards leased while a
        round was open, read once it ended)."""
        self._prune_redo()
        redo = sum(r.count for r in self.ledger.redo if (r.epoch, r.shard) in self.reading)
        return redo + sum(
            end - first
            for lease, spans in self.reading.items()
            if fresh or lease not in self._fresh
            for first, end in spans
        )

    def _prune_redo(self) -> None:
        """Forget the given-back sequences, and those of the leased shards still to read,
        that landed in the state meanwhile (a state taken brought them)."""
        kept = []
        for r in self.ledger.redo:
            for first, end in spans_minus((r.first, r.end), self.known.get((r.epoch, r.shard), [])):
                kept.append(Range(r.epoch, r.shard, first, end - first))
        self.ledger.redo = kept
        for lease, spans in self.reading.items():
            landed = self.known.get(lease)
            if spans and landed:
                spans[:] = [s for span in spans for s in spans_minus(span, landed)]

    def _take(self, limit: int) -> list[Range]:
        """Up to ``limit`` sequences: those given back first (of the shards this peer still
        leases), then the leased spans, the oldest epoch first."""
        self._prune_redo()
        ours = [r for r in self.ledger.redo if (r.epoch, r.shard) in self.reading]
        others = [r for r in self.ledger.redo if (r.epoch, r.shard) not in self.reading]
        self.ledger.redo = ours
        out = self.ledger.take_redo(limit)
        self.ledger.redo = merged([*self.ledger.redo, *others])
        limit -= sum(r.count for r in out)
        for (epoch, shard), spans in sorted(self.reading.items()):
            if (epoch, shard) in self._fresh:
                continue  # what landed of it may not be known yet
            while spans and limit > 0:
                first, end = spans[0]
                n = min(limit, end - first)
                out.append(Range(epoch, shard, first, n))
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
            self._open.add(round)
            ranges = self.ledger.declare(round, fragment)
        return [(r.epoch, r.shard, r.first, r.count) for r in ranges]

    def landed(
        self,
        round: int,
        declared: Mapping[str, Sequence[tuple[int, int, int, int]]],
        included: Mapping[str, bool],
        me: str,
    ) -> None:
        """Round ``round`` was applied: ``declared`` is what each member said its update
        completes, ``included`` whether each member's contribution counted whole. What the
        included members declared landed in the state (as ``DilocoState.apply`` adds it)."""
        landings = [
            Landing(round, peer, tuple(merged(Range(*r) for r in ranges)))
            for peer, ranges in declared.items()
            if ranges and included.get(peer, False)
        ]
        self.audit.append(landings)  # before the round's checkpoint
        now = time.monotonic()
        ranges = [Range(*r) for p, rs in declared.items() if included.get(p, False) for r in rs]
        with self._lock:
            partners = [p for p, ok in included.items() if ok and p != me]
            for peer in [p for p, t in self._partnered.items() if now - t >= self.idle_s]:
                del self._partnered[peer]
            self._partnered.update(dict.fromkeys(partners, now))
            self.ledger.landed(round, included=included.get(me, False))
            self.account.add(ranges)
            self._know(ranges)
            self._ended(round)
        self._ask()

    def failed(self, round: int) -> None:
        with self._lock:
            self.ledger.failed(round)
            self._ended(round)

    def _ended(self, round: int) -> None:
        """Round ``round`` landed or failed: the shards leased while it was open are read
        now, if no other round they waited for is open (under the lock). A shard leased
        while this peer's round was in flight may be one whose last ranges that round
        lands (another member read them, applied it first and released the shard): read
        at once, from this peer's account before the landing, they would be read twice."""
        self._open.discard(round)
        for lease in list(self._fresh):
            self._fresh[lease].discard(round)
            if not self._fresh[lease]:
                del self._fresh[lease]
                self.changed.set()

    def discard(self) -> None:
        """The local work is thrown away: what it read is read again (what of it landed in
        the state meanwhile is not)."""
        with self._lock:
            given = self.ledger.discard()
        if given:
            logger.info("%d sequence(s) given back to be read again", sum(r.count for r in given))

    def adopted(self, landed: Landed) -> None:
        """This peer took another state (downloaded, or its own again after a roll-back):
        what landed in it (``landed``, part of the state and its digest) decides what this
        peer reads. What landed only in the state left behind is read again; what landed in
        this one and was still to read is not."""
        self.restored(landed)

    def restored(self, landed: Landed) -> None:
        """The state this peer holds (restored from a checkpoint, or taken) has ``landed``."""
        known: dict[Lease, list[Span]] = {}
        for r in landed.ranges:  # (merged: in order, apart)
            known.setdefault((r.epoch, r.shard), []).append((r.first, r.end))
        with self._lock:
            for lease in set(self.known) | set(known):
                if self.known.get(lease) != known.get(lease):
                    self._quiet.pop(lease, None)  # what landed of it changed
            self.account, self.known = landed.copy(), known
            self.last_epoch = False  # (something may be left to read again: looked for anew)
            self._open.clear()  # (no round of the state left behind lands here)
            self._fresh.clear()
        self._ask()

    def pending(self) -> bool:
        with self._lock:
            return bool(self.ledger.pending)

    def unsure(self) -> bool:
        """Whether this peer's leases went unrenewed past their life (its machine froze or
        slept, its network was away) and the lease task has not looked since whether
        another peer took them: no round may carry what it read until then."""
        return self._task is not None and time.monotonic() - self._renewed > self.lease_s

    def lapsed(self) -> bool:
        """Whether another peer took shards this one held while its leases lapsed: it reads
        what has not landed in its state, so the local work that read them must be thrown
        away before any round carries it (then :meth:`forget_lapsed`)."""
        with self._lock:
            return bool(self._lapsed)

    def forget_lapsed(self) -> int:
        """(The local work was thrown away, what it read given back.) What was read of the
        shards taken while the leases lapsed is the other peer's to read now: forgotten
        here. Returns how many sequences."""
        with self._lock:
            lost, self._lapsed = self._lapsed, set()
            gone = self.ledger.drop(lambda r: (r.epoch, r.shard) in lost)
            for lease in lost:
                self.reading.pop(lease, None)
            # A micro-batch taken before and not yet in a step (a pipeline's stage 0 holds
            # none between two steps: it is on its way there) is refused, then given back.
            self._lost += [r for r in self._flying if (r.epoch, r.shard) in lost]
            self._flying = [r for r in self._flying if (r.epoch, r.shard) not in lost]
        count = sum(r.count for r in gone)
        logger.warning(
            "%d shard(s) were taken by another peer while this one's leases lapsed: the "
            "local work is thrown away, and the %d sequence(s) it read of them are theirs",
            len(lost),
            count,
        )
        self._ask()
        return count

    def _know(self, ranges: Sequence[Range]) -> None:
        """``ranges`` landed in the state (:attr:`known` follows :attr:`account`)."""
        for r in ranges:
            key = (r.epoch, r.shard)
            spans = spans_union([*self.known.get(key, []), (r.first, r.end)])
            if spans != self.known.get(key):
                self._quiet.pop(key, None)  # something of it landed: its listers read it
            self.known[key] = spans

    def _todo(self, epoch: int, shard: int) -> list[Span]:
        """What of a shard has not landed in the state."""
        return spans_minus((0, self.sequences.counts[shard]), self.known.get((epoch, shard), []))

    # -- checkpoints -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            return {
                "epoch": self.epoch,
                "open_epoch": self.open_epoch,
                "ledger": self.ledger.state_dict(),
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """(What landed is the state's: :meth:`restored`. An older checkpoint's partners and
        donors, whose word on what landed counted then, are not read.)"""
        try:
            epoch = int(state["epoch"])
            open_epoch = min(epoch, int(state.get("open_epoch", 0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise DataError(f"the leased data's state is malformed: {exc}") from exc
        with self._lock:
            self.ledger.load_state_dict(state["ledger"])
            self.epoch, self.open_epoch = epoch, open_epoch

    # -- the leases (the peer's event loop) --------------------------------------------------

    async def run(self, dht: Any, swarm_id: str, peer_id: str) -> None:
        """Keep this peer's leases until :meth:`close` (then release them)."""
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self._renewed = time.monotonic()  # (nothing to have lapsed before it began)
        try:
            await self._reclaim(dht, swarm_id, peer_id)
            while not self._stopping:
                try:
                    await self._tend(dht, swarm_id, peer_id)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # the network may be away for a while
                    logger.warning("could not tend the dataset's leases: %s", exc)
                if self._stopping:
                    break
                self._short.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._short.wait(), timeout=self.lease_s / 4)
        finally:
            with contextlib.suppress(Exception):
                await self._store_leases(dht, swarm_id, [])

    async def close(self) -> None:
        """Stop keeping the leases (and release them): the task is asked to end where it
        waits, not cut in the middle of a DHT call (whose grpc task a closing loop would
        then find pending); cancelled only if it has not ended within :data:`CLOSE_WAIT_S`."""
        task, self._task = self._task, None
        if task is None or task.done():
            return
        self._stopping = True
        self._short.set()
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout=CLOSE_WAIT_S)
        except Exception:  # (TimeoutError among them)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _reclaim(self, dht: Any, swarm_id: str, peer_id: str) -> None:
        """After a restart: claim again the shards of the ranges not landed; those another
        peer leases now are its to read (they are forgotten here)."""
        with self._lock:
            mine = sorted(self._held_shards())
        if not mine:
            return
        held = await self._held_by_others(dht, swarm_id, peer_id)
        free = [s for s in mine if s not in held][:MAX_LEASES]
        for _, shard in free:  # read before the restart: in the cache, checked again
            await asyncio.to_thread(self.sequences.open, shard)
        if free:
            await self._store_leases(dht, swarm_id, free)
        with self._lock:
            for lease in free:
                self.reading.setdefault(lease, [])
            gone = self.ledger.drop(lambda r: (r.epoch, r.shard) not in free)
        if gone:
            logger.info(
                "%d sequence(s) not landed are another peer's to read now",
                sum(r.count for r in gone),
            )

    async def _tend(self, dht: Any, swarm_id: str, peer_id: str) -> None:
        if time.monotonic() - self._renewed > self.lease_s:
            await self._after_lapse(dht, swarm_id, peer_id)
        with self._lock:
            self._release_done()
            # The next shard is leased (and fetched) while half a shard is left to read, or
            # two steps (of a box, with their accumulation: as ready() was last asked).
            ahead = max(2 * self._step, self.sequences.total // len(self.sequences.counts) // 2)
            short = self._available(fresh=True) < ahead and len(self.reading) < MAX_LEASES
        if not short:
            self._unavailable.clear()  # (what could not be had is tried again later)
        if short:
            await self._claim(dht, swarm_id, peer_id)
        with self._lock:
            leases = sorted(self.reading)
            leaving = (
                self.last_epoch
                and not leases
                and not self._held_shards()
                and self._all_landed(self.max_epochs or 0)
            )
        await self._store_leases(dht, swarm_id, leases)
        if leaving:
            self.ended = f"every shard of the dataset's {self.max_epochs} epoch(s) landed"
            self.stop_peer(self.ended)

    async def _after_lapse(self, dht: Any, swarm_id: str, peer_id: str) -> None:
        """The leases went unrenewed past their life: before renewing them, find the shards
        it held that another peer lists now (it may have read them from where they
        landed, so what this peer read of them and has not landed may be read twice);
        those are given up, and the local work is thrown away (:meth:`lapsed`)."""
        self.taken_by_others(await self._held_by_others(dht, swarm_id, peer_id))

    def taken_by_others(self, held: Collection[Lease]) -> None:
        """(After a lapse.) Of the shards this peer held, those in ``held`` (other peers
        list them now) are given up: read no more here, and :meth:`lapsed`."""
        with self._lock:
            taken = (set(self.reading) | self._held_shards()) & set(held)
            for lease in taken:
                self.reading.pop(lease, None)
            self._lapsed |= taken
        if taken:
            logger.warning(
                "this peer's leases lapsed (unrenewed for %.0f s) and another peer lists %d "
                "of its shards now",
                time.monotonic() - self._renewed,
                len(taken),
            )

    def _release_done(self) -> None:
        """Give up the shards read to the end whose every range landed."""
        self._prune_redo()
        held = self._held_shards()
        for lease in [k for k, spans in self.reading.items() if not spans]:
            if lease not in held:
                del self.reading[lease]
                logger.info("shard %d of epoch %d read and landed: released", lease[1], lease[0])

    async def _claim(self, dht: Any, swarm_id: str, peer_id: str) -> None:
        """Lease the next shard nobody reads and not known to have landed, of the oldest
        epoch that has one (a dead reader's shard of an earlier epoch comes back once its
        lease expired); none left: on to the next epoch, or, past ``max_epochs``, no more
        (what others still read is watched until it landed)."""
        count = len(self.sequences.counts)
        held = await self._held_by_others(dht, swarm_id, peer_id)
        start = int(peer_id[:8], 16) % count
        others: list[Lease] = []
        for epoch in range(self.open_epoch, self.epoch + 1):
            order = epoch_order(self.seed, epoch, count)
            for shard in order[start:] + order[:start]:
                lease = (epoch, shard)
                if lease in self.reading or not self._todo(*lease) or shard in self._unavailable:
                    continue
                if lease in held:
                    others.append(lease)
                    continue
                if await self._take_lease(dht, swarm_id, peer_id, lease):
                    return
                others.append(lease)
        while self.open_epoch < self.epoch and self._all_landed(self.open_epoch + 1):
            self.open_epoch += 1
        # Nothing is free: every shard landed, or is another's to read.
        if self.max_epochs is not None and self.epoch + 1 >= self.max_epochs:
            with self._lock:
                self.last_epoch = True
            self.changed.set()
            return
        with self._lock:
            logger.info(
                "no shard of epoch %d is free (%d read by others): on to epoch %d",
                self.epoch,
                len(others),
                self.epoch + 1,
            )
            self.epoch += 1
        self.changed.set()
        self._short.set()  # claim in the new epoch at once

    async def _take_lease(self, dht: Any, swarm_id: str, peer_id: str, lease: Lease) -> bool:
        """Claim ``lease`` (stored, then read back: of two claimants, one that finds the
        other's claim withdraws); False when it is not to be had."""
        with self._lock:
            todo = self._todo(*lease)
            mine = sorted(self.reading)
        if not todo:
            return False
        await self._store_leases(dht, swarm_id, [*mine, lease])
        rivals = await self._held_by_others(dht, swarm_id, peer_id)
        if lease in rivals:  # claimed at the same time: both withdraw, try another
            await self._store_leases(dht, swarm_id, mine)
            return False
        try:  # fetched (from the peers that hold it, the mirrors) and checked, if need be
            await asyncio.to_thread(self.sequences.open, lease[1])
        except DataError as exc:
            logger.error("shard %d could not be had: %s", lease[1], exc)
            self._unavailable.add(lease[1])
            await self._store_leases(dht, swarm_id, mine)
            return False
        with self._lock:
            self.reading[lease] = todo
            if self._open:  # read once the rounds in flight ended (:meth:`_ended`)
                self._fresh[lease] = set(self._open)
            self.ended = ""
        self.changed.set()
        logger.info(
            "leased shard %d of epoch %d: %d sequence(s) to read",
            lease[1],
            lease[0],
            sum(e - f for f, e in todo),
        )
        return True

    def _all_landed(self, epochs: int) -> bool:
        """Whether every shard of the epochs before ``epochs`` is known to have landed."""
        count = len(self.sequences.counts)
        return all(not self._todo(e, s) for e in range(epochs) for s in range(count))

    async def _held_by_others(self, dht: Any, swarm_id: str, peer_id: str) -> set[Lease]:
        """(epoch, shard) of the leases other peers' live ``leases`` records list that count
        as theirs (:meth:`held`)."""
        result = await dht.get(leases_key(swarm_id))
        listed: dict[Lease, set[str]] = {}
        for entry in result.entries.values():
            if entry.subkey != peer_id:
                for lease in self._read(entry, listed_in):
                    listed.setdefault(lease, set()).add(entry.subkey)
        with self._lock:
            return self.held(listed, time.monotonic())

    def held(self, listed: Mapping[Lease, Collection[str]], now: float) -> set[Lease]:
        """Of the leases others list (lease -> the keys that list it), read at ``now``
        (``time.monotonic()``), those that count as theirs to read: something of the shard
        landed within :attr:`idle_s` of this peer first finding it listed, or one of its
        listers averaged with this peer in a round it applied within as long. The rest are
        idle: free to this peer. A shard found listed by nobody has its clock started
        again. (Call with the lock held.)"""
        for lease in [k for k in self._quiet if k not in listed]:
            del self._quiet[lease]
        held: set[Lease] = set()
        idle: set[Lease] = set()
        for lease, keys in listed.items():
            since = self._quiet.setdefault(lease, now)
            partner = any(now - self._partnered.get(k, -math.inf) < self.idle_s for k in keys)
            if partner or now - since < self.idle_s:
                held.add(lease)
                continue
            idle.add(lease)
            if lease not in self._idle:
                logger.warning(
                    "shard %d of epoch %d is listed by %d other key(s), but nothing of it "
                    "landed for %.0f s and none of them averaged here: free to read",
                    lease[1],
                    lease[0],
                    len(keys),
                    now - since,
                )
        self._idle = idle
        return held

    def _read(self, entry: Any, read: Callable[[Any], list[_T]]) -> list[_T]:
        """``read`` of ``entry``'s value; nothing when it cannot be read (passed over, logged
        once a peer): one peer's entry must not stop the lease task, which would retry on
        the same entry for ever."""
        try:
            return read(entry.value)
        except (KeyError, TypeError, ValueError) as exc:
            if entry.subkey not in self._malformed:
                self._malformed.add(entry.subkey)
                logger.warning("peer %s's entry is passed over: %s", entry.subkey[:8], exc)
            return []

    async def _store_leases(self, dht: Any, swarm_id: str, leases: Sequence[Lease]) -> None:
        value = {"shards": [list(x) for x in leases], "at": dht.clock()}
        if await dht.store(leases_key(swarm_id), value, ttl=self.lease_s) > 0:
            self._renewed = time.monotonic()

    # -- what the dashboard shows --------------------------------------------------------------

    def progress(self) -> dict[str, int]:
        """The epoch's progress in this peer's state (its ``status`` record's ``data``)."""
        with self._lock:
            epoch = self.epoch
            landed = sum(
                e - f for (ep, _), spans in self.known.items() if ep == epoch for f, e in spans
            )
            return {
                "epoch": epoch,
                "sequences": self.sequences.total,
                "landed": landed,
                "shards": len(self.sequences.counts),
                "leased": len(self.reading),
                "done": sum(
                    1 for s in range(len(self.sequences.counts)) if not self._todo(epoch, s)
                ),
            }
