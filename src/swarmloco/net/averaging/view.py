"""One member's view of a round: who reduces each part now, which results it holds, and
what it reports. No I/O.

Part j starts with member j as its reducer (*epoch 0*). When a member decides that the
reducer of a part it still lacks has failed (its stream broke, it went silent, it stopped
making progress, it refused us), it moves the part to the next serving member after the
failed one that it has not seen fail, one epoch higher, resets what it had received of the
part, and sends its slice there. That backup announces the rerun to every member
(``Rerun``), and a member that hears of a claim that *beats* its own moves too, even if it
had the whole part already: the backup's result supersedes the old one everywhere. Claims
are ordered by epoch, then by how soon after the part's own reducer the backup comes, so
members that chose different backups converge on one. A claim by a member we saw fail
is ignored: every part we lack is always claimed by a member we still wait on.

:meth:`RoundView.digest` summarizes what a member holds (the final claim of every part and
the hash of every result message of it, contributors included); members compare digests
before anyone applies the result, so any divergence the protocol did not prevent is
detected, not applied. A part is whole only once its reducer's signed *seal* of those
messages matches what this member received (:meth:`RoundView.seal`): the digest is made of
the seals (:func:`digest_of`), so that two members' digests show which part they differ in
and, where one reducer sealed one part and epoch twice over different results, prove that
reducer sent members different results.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from collections.abc import Sequence

from swarmloco.core.codec import ChunkSpan, CodecConfig, chunk_spans
from swarmloco.errors import RoundAborted
from swarmloco.net.averaging.group import Group
from swarmloco.net.averaging.report import PartReport
from swarmloco.net.averaging.wire import members_of
from swarmloco.net.rejections import Rejection
from swarmloco.proto.v1 import averaging_pb2 as pb

RESULT_DIGEST_BYTES = 16
"""The size of a member's digest of the round's result (``MemberDone``, ``Verdict``)."""
PART_HASH_BYTES = 16
"""The size of the hash of a part's result messages (``Seal``)."""


class PartHasher:
    """The hash of one part's result messages, in order: the SHA-256 of each message's
    SHA-256 (the CPU's SHA instructions make it the fastest of hashlib's where they exist,
    twice BLAKE2b's speed here), cut to ``PART_HASH_BYTES``. One pass over the bytes, and
    each message's own hash is kept (``chunks``): one result message can then be shown to
    be the one sealed, without the rest (an auditor's :class:`pb.Proof`)."""

    def __init__(self) -> None:
        self._h = hashlib.sha256(b"swarmloco/v1/part-results\x00")
        self.chunks: list[bytes] = []

    def update(self, message: bytes) -> None:
        chunk = hashlib.sha256(message).digest()
        self.chunks.append(chunk)
        self._h.update(chunk)

    def digest(self) -> bytes:
        return self._h.digest()[:PART_HASH_BYTES]


def digest_of(group_id: bytes, round: int, seals: Sequence[pb.Seal]) -> bytes:
    """The digest of a result whose parts carry ``seals`` (one per part, in part order)."""
    h = hashlib.blake2b(b"swarmloco/v1/round-result\x00", digest_size=RESULT_DIGEST_BYTES)
    h.update(group_id)
    h.update(struct.pack("<Q", round))
    for seal in seals:
        h.update(struct.pack("<III", seal.part, seal.epoch, seal.reducer))
        h.update(seal.hash)
    return h.digest()


@dataclasses.dataclass(frozen=True)
class Claim:
    """Who reduces a part, at which epoch."""

    epoch: int
    reducer: int


def part_spans(group: Group, codec: CodecConfig) -> list[list[ChunkSpan]]:
    """The chunks of every part (offsets relative to the part's start)."""
    return [
        chunk_spans(blocks * group.block_size, codec) if blocks else [] for _, blocks in group.parts
    ]


@dataclasses.dataclass(frozen=True)
class SealedResult:
    """What we received of one claim of a part, sealed: each result chunk's contributor
    bitmap and the SHA-256 of its message (enough to judge an auditor's proof of it after
    the part moved on)."""

    bits: tuple[bytes, ...]
    hashes: tuple[bytes, ...]

    def contributors(self, index: int, size: int) -> list[int]:
        return members_of(self.bits[index], size)

    def included(self, size: int) -> dict[int, int]:
        """Per member: how many leading result chunks name it."""
        return included_in(self.bits, size)


def included_in(chunks: Sequence[bytes], size: int) -> dict[int, int]:
    """Per member of a group of ``size``: how many leading contributor bitmaps of
    ``chunks`` name it."""
    counts = dict.fromkeys(range(size), 0)
    for member in counts:
        for bits in chunks:
            if not bits[member // 8] >> (member % 8) & 1:
                break
            counts[member] += 1
    return counts


class RoundView:
    """What member ``me`` knows about the parts of a round."""

    def __init__(self, group: Group, me: int, codec: CodecConfig) -> None:
        self.group = group
        self.me = me
        self.spans = part_spans(group, codec)
        self.parts = [p for p, spans in enumerate(self.spans) if spans]
        self.owner: dict[int, Claim] = {p: Claim(0, p) for p in self.parts}
        self.failed: dict[int, str] = {}
        self._received: dict[int, list[bytes]] = {p: [] for p in self.parts}
        self._hashes = {p: PartHasher() for p in self.parts}
        self.sealed: dict[int, pb.Seal] = {}
        """The seal of each part whose every result chunk we hold, under its claim."""
        self._former: dict[tuple[int, Claim], SealedResult] = {}
        """Per part and claim it moved on from: what we held of it sealed."""
        self.held: set[int] = set()
        """Sealed parts not whole yet: their audit is under way (``audit.py``)."""

    # -- who reduces what ---------------------------------------------------------------

    def rank(self, part: int, reducer: int) -> int:
        """How soon after the part's own reducer ``reducer`` comes (0 for itself)."""
        return (reducer - part) % self.group.size

    def beats(self, part: int, a: Claim, b: Claim) -> bool:
        return a.epoch > b.epoch or (
            a.epoch == b.epoch and self.rank(part, a.reducer) < self.rank(part, b.reducer)
        )

    def _backup_after(self, member: int) -> int | None:
        n = self.group.size
        for step in range(1, n):
            candidate = (member + step) % n
            if self.group.members[candidate].serving and candidate not in self.failed:
                return candidate
        return None

    def fail(self, member: int, reason: str) -> list[int]:
        """Member ``member`` failed: the parts it reduces that we still lack move on.

        Returns the parts whose claim changed (the caller resends them). Raises
        RoundAborted when no serving member is left to take a part.
        """
        if member in self.failed or member == self.me:
            return []
        self.failed[member] = reason
        moved = []
        for part, claim in self.owner.items():
            if claim.reducer != member or self.part_complete(part):
                continue
            backup = self._backup_after(member)
            if backup is None:
                raise RoundAborted(
                    f"no serving member is left to reduce part {part} (its reducer "
                    f"{self.group.members[member].peer_id[:12]} failed: {reason})"
                )
            self._move(part, Claim(claim.epoch + 1, backup))
            moved.append(part)
        return moved

    def notice(self, part: int, claim: Claim) -> bool:
        """Another member claims ``part``; True if the claim beats ours (we move).

        The claim of a member we saw fail is ignored, however high its epoch: we send it
        nothing more and wait on it for nothing, so a part moved to it would never come.
        (Its notice may well arrive after we failed it: it rerun a part when *it* failed
        someone, and we failed it for what it sent us meanwhile.)"""
        if part not in self.owner:
            raise Rejection("bad-part", f"part {part} does not exist in this group")
        if claim.reducer in self.failed or not self.beats(part, claim, self.owner[part]):
            return False
        self._move(part, claim)
        return True

    def _move(self, part: int, claim: Claim) -> None:
        former = self.sealed_result(part, self.owner[part])
        if former is not None:
            self._former[(part, self.owner[part])] = former
        self.owner[part] = claim
        self._received[part] = []
        self._hashes[part] = PartHasher()
        self.sealed.pop(part, None)
        self.held.discard(part)

    # -- results -------------------------------------------------------------------------

    def expects(self, part: int, epoch: int, reducer: int) -> bool:
        """Whether results of ``part`` at ``epoch`` from ``reducer`` are the ones we use."""
        return self.owner.get(part) == Claim(epoch, reducer)

    def check_result(self, part: int, index: int, contributors: bytes) -> None:
        """Rejection unless result chunk ``index`` of ``part`` is the next one and names
        possible contributors (call only when :meth:`expects`)."""
        received = self._received[part]
        if index != len(received) or index >= len(self.spans[part]):
            raise Rejection(
                "bad-result", f"result chunk {index} of part {part}, expected {len(received)}"
            )
        if not members_of(contributors, self.group.size):
            raise Rejection("bad-result", f"result chunk {index} of part {part} averages nobody")

    def on_result(self, part: int, index: int, contributors: bytes, message: bytes) -> None:
        """Record result chunk ``index`` of ``part`` as received (call only when
        :meth:`expects`, once its payload decoded), ``message`` the whole result message it
        came in (what the part's seal covers). Raises Rejection as :meth:`check_result`."""
        self.check_result(part, index, contributors)
        self._received[part].append(contributors)
        self._hashes[part].update(message)

    def received(self, part: int) -> int:
        return len(self._received[part])

    def chunks_complete(self, part: int) -> bool:
        """Whether we hold every result chunk of ``part`` (its seal may be on its way)."""
        return len(self._received[part]) == len(self.spans[part])

    def part_hash(self, part: int) -> bytes:
        """The hash of the result messages of ``part`` we hold, in order."""
        return self._hashes[part].digest()

    def sealed_result(self, part: int, claim: Claim) -> SealedResult | None:
        """What we received of ``part`` under ``claim``, once its seal matched (None: not
        all of it, not sealed, or never that claim's)."""
        if self.owner[part] != claim:
            return self._former.get((part, claim))
        if not self.chunks_complete(part) or part not in self.sealed:
            return None
        return SealedResult(tuple(self._received[part]), tuple(self._hashes[part].chunks))

    def seal(self, seal: pb.Seal) -> bool:
        """Take the seal of a part's results (its signature checked by the caller); False
        when it is stale (another claim holds the part now). Rejection when it comes before
        the part's last result chunk, or seals other results than we received."""
        part = seal.part
        if part not in self.owner:
            raise Rejection("bad-seal", f"a seal of part {part}, which does not exist")
        if not self.expects(part, seal.epoch, seal.reducer):
            return False
        if not self.chunks_complete(part):
            raise Rejection("bad-seal", f"a seal of part {part} before its last result chunk")
        if seal.hash != self.part_hash(part):
            raise Rejection("bad-seal", f"a seal of part {part} over other results than it sent")
        self.sealed[part] = seal
        return True

    def seals(self) -> list[pb.Seal]:
        """The seal of every part, in part order (call once :attr:`complete`)."""
        return [self.sealed[p] for p in self.parts]

    def part_complete(self, part: int) -> bool:
        return self.chunks_complete(part) and part in self.sealed and part not in self.held

    def included(self, part: int) -> dict[int, int]:
        """Per member: how many leading result chunks of ``part`` we received name it."""
        return included_in(self._received[part], self.group.size)

    @property
    def complete(self) -> bool:
        return all(self.part_complete(p) for p in self.parts)

    def missing(self) -> list[int]:
        return [p for p in self.parts if not self.part_complete(p)]

    # -- summary -------------------------------------------------------------------------

    def digest(self) -> bytes:
        """What we hold, in 16 bytes: every part's final claim and the hash of its result
        messages, as sealed (call once :attr:`complete`).

        Two members with the same digest decoded the same result messages of the same
        reducers.
        """
        return digest_of(self.group.group_id, self.group.round, self.seals())

    def report(self) -> list[PartReport]:
        reports = []
        for part in self.parts:
            claim = self.owner[part]
            included = {
                self.group.members[member].peer_id: count
                for member, count in self.included(part).items()
                if count
            }
            start, stop = self.group.part_range(part)
            reports.append(
                PartReport(
                    part=part,
                    start=start,
                    stop=stop,
                    reducer=self.group.members[claim.reducer].peer_id,
                    epoch=claim.epoch,
                    chunks=len(self.spans[part]),
                    included=included,
                )
            )
        return reports
