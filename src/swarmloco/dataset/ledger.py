"""Every sequence of a pinned dataset trained once: the ranges a peer read, which of them
landed, and the audit of what landed (DESIGN section 11, "Exactly once").

A *sequence* is a window of ``seq_len + 1`` tokens of a shard's training part starting at
a multiple of ``seq_len`` (:class:`Sequences`); a *range* is ``(epoch, shard, first,
count)`` of them (:class:`Range`). The :class:`Ledger` of one peer holds what it read and
what became of it:

- ``read``: ranges read since they last landed are *pending*, each with the fragments
  whose rounds have still to carry it;
- ``declare(round, fragment)``: at a round's start, the pending ranges whose last fragment
  is this one (they complete with the round: its declaration carries them);
- ``landed(round, included)``: the round was applied; what it completed landed if this
  peer's contribution was included whole, else it is *given back* (read again, once);
- ``failed(round)``: nothing changes (the delta keeps the tokens for the next attempt);
- ``discard()``: the local work is thrown away (NaN, a catch-up, a roll-back): every
  pending range is given back.

Given-back ranges are read again before anything new. All pure: no I/O but the
:class:`Audit` file, no clock.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from swarmloco.errors import DataError
from swarmloco.net.averaging.group import MAX_RANGES

logger = logging.getLogger(__name__)

MAX_DECLARED_RANGES = MAX_RANGES
"""Ranges one declaration carries at most (merged per shard first): the protocol's bound."""


@dataclasses.dataclass(frozen=True, order=True)
class Range:
    """Sequences ``first .. first + count - 1`` of ``shard`` in ``epoch``."""

    epoch: int
    shard: int
    first: int
    count: int

    @property
    def end(self) -> int:
        return self.first + self.count

    def to_list(self) -> list[int]:
        return [self.epoch, self.shard, self.first, self.count]

    @classmethod
    def from_list(cls, value: Sequence[Any]) -> Range:
        epoch, shard, first, count = (int(v) for v in value)
        if min(epoch, shard, first) < 0 or count <= 0:
            raise ValueError(f"not a range of sequences: {list(value)}")
        return cls(epoch, shard, first, count)


def merged(ranges: Iterable[Range]) -> list[Range]:
    """``ranges`` sorted, with touching or overlapping ranges of one shard and epoch as one."""
    out: list[Range] = []
    for r in sorted(ranges):
        last = out[-1] if out else None
        if last and (last.epoch, last.shard) == (r.epoch, r.shard) and r.first <= last.end:
            out[-1] = Range(r.epoch, r.shard, last.first, max(last.end, r.end) - last.first)
        else:
            out.append(r)
    return out


def sequences_in(train_tokens: int, seq_len: int) -> int:
    """Sequences of ``seq_len + 1`` tokens at multiples of ``seq_len`` in ``train_tokens``."""
    return max(0, (train_tokens - 1) // seq_len)


def epoch_order(seed: int, epoch: int, shards: int) -> list[int]:
    """The order epoch ``epoch`` visits ``shards`` shards in: drawn from the run's seed."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, 0x5EED, epoch])))
    return [int(s) for s in rng.permutation(shards)]


class Sequences:
    """The training sequences of a dataset's shards (token files, as the task reads them):
    shard ``s`` has ``counts[s]`` sequences, read as ``(count, seq_len + 1)`` windows.

    ``shards``: the shards' tokens; or, to open each shard only when it is first read (a
    peer fetches the shards it leases), ``tokens`` (each shard's length) and ``opener`` (a
    shard's tokens, fetched if need be)."""

    def __init__(
        self,
        shards: Sequence[np.ndarray] = (),
        *,
        seq_len: int,
        val_fraction: float,
        tokens: Sequence[int] | None = None,
        opener: Callable[[int], np.ndarray] | None = None,
    ) -> None:
        self.seq_len = seq_len
        self.val_fraction = val_fraction
        lengths = [len(s) for s in shards] if tokens is None else list(tokens)
        self._cut = [int(n * (1 - val_fraction)) for n in lengths]
        self._train: dict[int, np.ndarray] = {
            i: s[: self._cut[i]] for i, s in enumerate(shards) if tokens is None
        }
        self._opener = opener
        self.counts = [sequences_in(n, seq_len) for n in self._cut]
        if not any(self.counts):
            raise DataError(
                f"no shard of the dataset has a training sequence of {seq_len + 1} tokens"
            )

    @property
    def total(self) -> int:
        return sum(self.counts)

    def open(self, shard: int) -> None:
        """Have ``shard`` at hand (fetched, checked and mapped) before it is read."""
        if shard not in self._train:
            if self._opener is None:
                raise DataError(f"shard {shard} is not at hand")
            tokens = self._opener(shard)
            if len(tokens) < self._cut[shard]:
                raise DataError(f"shard {shard} holds {len(tokens)} tokens, fewer than its index")
            self._train[shard] = tokens[: self._cut[shard]]

    def read(self, r: Range) -> np.ndarray:
        if r.end > self.counts[r.shard]:
            raise DataError(f"{r} is past the {self.counts[r.shard]} sequences of its shard")
        self.open(r.shard)
        tokens = self._train[r.shard]
        out = np.empty((r.count, self.seq_len + 1), dtype=np.int64)
        for row in range(r.count):
            at = (r.first + row) * self.seq_len
            out[row] = tokens[at : at + self.seq_len + 1]
        return out


@dataclasses.dataclass(eq=False)
class _Pending:
    range: Range
    fragments: set[int]
    """The fragments whose rounds have still to carry it."""


class Ledger:
    """What one peer read and what became of it (see the module)."""

    def __init__(self, fragments: int = 1) -> None:
        self.fragments = fragments
        self.pending: list[_Pending] = []
        self.redo: list[Range] = []
        """Given back: read these again before anything new."""
        self._declared: dict[int, tuple[int, list[_Pending]]] = {}
        """Round -> its fragment and the pending ranges it carries a share of."""
        self.given_back_total = 0

    def read(self, ranges: Iterable[Range]) -> None:
        for r in ranges:
            self.pending.append(_Pending(r, set(range(self.fragments))))

    def take_redo(self, limit: int) -> list[Range]:
        """Up to ``limit`` sequences of the given-back ranges, first come first."""
        out: list[Range] = []
        while self.redo and limit > 0:
            r = self.redo[0]
            if r.count <= limit:
                out.append(self.redo.pop(0))
                limit -= r.count
            else:
                out.append(Range(r.epoch, r.shard, r.first, limit))
                self.redo[0] = Range(r.epoch, r.shard, r.first + limit, r.count - limit)
                limit = 0
        return out

    def declare(self, round: int, fragment: int) -> list[Range]:
        """The ranges this round completes (merged; at most :data:`MAX_DECLARED_RANGES`,
        the rest wait for the fragment's next round)."""
        carried = [e for e in self.pending if fragment in e.fragments]
        completing = [e for e in carried if e.fragments == {fragment}]
        ranges = merged(e.range for e in completing)
        if len(ranges) > MAX_DECLARED_RANGES:
            keep = set(ranges[:MAX_DECLARED_RANGES])
            ranges = ranges[:MAX_DECLARED_RANGES]
            covered = [e for e in completing if any(_within(e.range, k) for k in keep)]
            carried = [e for e in carried if e not in completing or e in covered]
        self._declared[round] = (fragment, carried)
        return ranges

    def landed(self, round: int, *, included: bool) -> list[Range]:
        """Round ``round`` was applied: its share of each carried range is spent; the ranges
        it completed landed (returned) if this peer was ``included`` whole, else they and
        every range it carried are given back."""
        fragment, carried = self._declared.pop(round, (None, []))
        if fragment is None:
            return []
        done: list[Range] = []
        for e in carried:
            if e not in self.pending:
                continue  # given back meanwhile
            if not included:
                self._give_back([e])
                continue
            e.fragments.discard(fragment)
            if not e.fragments:
                self.pending.remove(e)
                done.append(e.range)
        return merged(done)

    def failed(self, round: int) -> None:
        """Round ``round`` failed: nothing changes (the next attempt carries its tokens)."""
        self._declared.pop(round, None)

    def discard(self) -> list[Range]:
        """The local work is thrown away: every pending range is given back."""
        given = [e.range for e in self.pending]
        self._give_back(list(self.pending))
        self._declared.clear()
        return merged(given)

    def _give_back(self, entries: list[_Pending]) -> None:
        for e in entries:
            if e in self.pending:
                self.pending.remove(e)
            self.given_back_total += e.range.count
        self.redo = merged([*self.redo, *(e.range for e in entries)])

    def held_shards(self) -> set[tuple[int, int]]:
        """(epoch, shard) of every range not landed: their leases are kept."""
        return {(e.range.epoch, e.range.shard) for e in self.pending} | {
            (r.epoch, r.shard) for r in self.redo
        }

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: the pending ranges (trained into the checkpoint's local
        state) with the fragments still to carry them, and those given back."""
        return {
            "pending": [[*e.range.to_list(), sorted(e.fragments)] for e in self.pending],
            "redo": [r.to_list() for r in self.redo],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            pending = [
                _Pending(Range.from_list(v[:4]), {int(f) for f in v[4]}) for v in state["pending"]
            ]
            redo = merged(Range.from_list(v) for v in state["redo"])
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise DataError(f"the data ledger's state is malformed: {exc}") from exc
        if any(not e.fragments or max(e.fragments) >= self.fragments for e in pending):
            raise DataError("the data ledger's state names fragments this run does not have")
        self.pending, self.redo, self._declared = pending, redo, {}

    def drop(self, shard_of: Callable[[Range], bool]) -> list[Range]:
        """Forget the ranges (pending or given back) ``shard_of`` says are no longer this
        peer's to read (their shard is leased by another now); returns them."""
        gone = [e.range for e in self.pending if shard_of(e.range)]
        gone += [r for r in self.redo if shard_of(r)]
        self.pending = [e for e in self.pending if not shard_of(e.range)]
        self.redo = [r for r in self.redo if not shard_of(r)]
        return merged(gone)


def _within(inner: Range, outer: Range) -> bool:
    return (inner.epoch, inner.shard) == (outer.epoch, outer.shard) and (
        outer.first <= inner.first and inner.end <= outer.end
    )


# -- what landed in a state ------------------------------------------------------------------

MAX_LANDED_EPOCHS = 1 << 16
"""Epochs a state's landed sequences may name (a state naming more is malformed)."""


class Landed:
    """The sequences of a pinned dataset that landed in one global state: the union of the
    ranges every round of its lineage landed (merged), and per epoch how many sequences
    those landings held, repeats counted (so a sequence that landed twice in the state
    shows). It travels with the state: held by ``DilocoState``, in its digest, its
    checkpoints and what its donors serve (DESIGN section 11, "What landed travels with
    the state"). The tensor form (:meth:`to_tensor`) is int64 ``[E, n_0 .. n_{E-1}, epoch,
    shard, first, count, ...]``."""

    def __init__(self, ranges: Iterable[Range] = (), counted: Sequence[int] = ()) -> None:
        self.ranges: list[Range] = merged(ranges)
        self.counted: list[int] = list(counted)
        """Epoch -> sequences its landings held, repeats counted."""

    def add(self, ranges: Iterable[Range]) -> None:
        """Ranges a round landed in this state (each included member's declared ranges, as
        given). A range of an epoch past the one after the newest this state counts (or
        past :data:`MAX_LANDED_EPOCHS`) is left out: no honest reader gets there, and a
        declaration must not grow every member's state by an epoch a round at will. Every
        member of a round holds the same state and adds the same, so what is left out is
        the same for all (its sequences are read again)."""
        newest = min(len(self.counted), MAX_LANDED_EPOCHS - 1)
        kept = [r for r in ranges if r.epoch <= newest]
        for r in kept:
            if r.epoch >= len(self.counted):
                self.counted += [0] * (r.epoch + 1 - len(self.counted))
            self.counted[r.epoch] += r.count
        if kept:
            self.ranges = merged([*self.ranges, *kept])

    def __bool__(self) -> bool:
        return bool(self.counted)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Landed):
            return NotImplemented
        return (self.ranges, self.counted) == (other.ranges, other.counted)

    def __repr__(self) -> str:
        return f"Landed({len(self.ranges)} range(s), counted per epoch {self.counted})"

    def copy(self) -> Landed:
        return Landed(self.ranges, self.counted)

    def of(self, epoch: int, shard: int) -> list[tuple[int, int]]:
        """The spans ``[first, end)`` of ``shard`` that landed in ``epoch``."""
        return [(r.first, r.end) for r in self.ranges if (r.epoch, r.shard) == (epoch, shard)]

    def coverage(self, counts: Sequence[int], epoch: int) -> Coverage:
        """Epoch ``epoch`` of shards of ``counts`` sequences, as this state holds it."""
        inside = [r for r in self.ranges if r.epoch == epoch and r.shard < len(counts)]
        landed = sum(
            min(r.end, counts[r.shard]) - r.first for r in inside if r.first < counts[r.shard]
        )
        held = sum(r.count for r in self.ranges if r.epoch == epoch)
        counted = self.counted[epoch] if epoch < len(self.counted) else 0
        total = sum(counts)
        return Coverage(total, landed, counted - held, total - landed)

    def to_tensor(self) -> torch.Tensor:
        values = [len(self.counted), *self.counted]
        for r in self.ranges:
            values += r.to_list()
        return torch.tensor(values, dtype=torch.int64)

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> Landed:
        """The landed sequences a state's tensor holds; ValueError when it is not one (a
        donor's state, a checkpoint: nothing is taken on trust)."""
        if tensor.dtype != torch.int64 or tensor.dim() != 1 or tensor.numel() < 1:
            raise ValueError("a state's landed sequences are a vector of int64")
        values = tensor.tolist()
        epochs = values[0]
        if not 0 <= epochs <= MAX_LANDED_EPOCHS or len(values) < 1 + epochs:
            raise ValueError(f"a state's landed sequences name {epochs} epoch(s)")
        counted, rows = values[1 : 1 + epochs], values[1 + epochs :]
        if len(rows) % 4 or min(counted, default=0) < 0:
            raise ValueError("a state's landed sequences are not ranges and counts")
        ranges = [Range.from_list(rows[i : i + 4]) for i in range(0, len(rows), 4)]
        if merged(ranges) != ranges:
            raise ValueError("a state's landed ranges are not sorted, apart and merged")
        held = [0] * epochs
        for r in ranges:
            if r.epoch >= epochs:
                raise ValueError(f"a state's landed range {r} is of an epoch it does not count")
            held[r.epoch] += r.count
        if any(h > n for h, n in zip(held, counted, strict=True)) or (epochs and not counted[-1]):
            raise ValueError("a state's landed ranges hold more sequences than it counts")
        return cls(ranges, counted)


# -- the audit ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Landing:
    """One contribution's ranges that landed in a round this peer applied."""

    round: int
    contributor: str
    ranges: tuple[Range, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "peer": self.contributor,
            "ranges": [r.to_list() for r in self.ranges],
        }


class Audit:
    """The ranges that landed in the rounds this peer applied, one JSON line per
    contribution, appended and fsynced (a torn last line, from a crash, is ignored)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def append(self, landings: Sequence[Landing]) -> None:
        if not landings:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        text = "".join(json.dumps(x.to_json(), separators=(",", ":")) + "\n" for x in landings)
        with self.path.open("a", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())

    def __iter__(self) -> Iterator[Landing]:
        return iter(read_audit(self.path))


def read_audit(path: Path) -> list[Landing]:
    """The landings an audit file holds (a line that does not parse is skipped, with a
    warning unless it is the last: a crash mid-write tears only the last)."""
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    out: list[Landing] = []
    for i, line in enumerate(lines):
        try:
            value = json.loads(line)
            out.append(
                Landing(
                    int(value["round"]),
                    str(value["peer"]),
                    tuple(Range.from_list(r) for r in value["ranges"]),
                )
            )
        except (ValueError, KeyError, TypeError):
            if i != len(lines) - 1:
                logger.warning("%s line %d is not a landing; skipped", path, i + 1)
    return out


@dataclasses.dataclass(frozen=True)
class Coverage:
    """What the union of audits says of one epoch: each contribution counted once."""

    sequences: int
    """The epoch's sequences (every shard's)."""
    landed: int
    """Distinct sequences that landed."""
    duplicated: int
    """Sequences that landed in more than one contribution (counted once per extra)."""
    missing: int

    def to_json(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def coverage(audits: Iterable[Iterable[Landing]], counts: Sequence[int], epoch: int) -> Coverage:
    """The union of ``audits`` (several peers saw the same contribution land: one landing)
    against epoch ``epoch`` of shards of ``counts`` sequences."""
    contributions: dict[tuple[int, str], set[Range]] = {}
    for audit in audits:
        for landing in audit:
            rs = contributions.setdefault((landing.round, landing.contributor), set())
            rs.update(r for r in landing.ranges if r.epoch == epoch)
    hits = [np.zeros(n, dtype=np.int32) for n in counts]
    for ranges in contributions.values():
        for r in merged(ranges):
            if r.shard < len(hits):
                hits[r.shard][r.first : r.end] += 1
    landed = sum(int((h > 0).sum()) for h in hits)
    duplicated = sum(int(np.maximum(h - 1, 0).sum()) for h in hits)
    total = sum(counts)
    return Coverage(total, landed, duplicated, total - landed)
