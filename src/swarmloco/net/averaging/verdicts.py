"""The agreement that ends a round: which digests the members hold, the verdicts of the
serving members, and whether this member may apply its result. No I/O.

Every member sends a ``MemberDone`` with the digest of its whole result once it has every
part; a serving member that holds the digest of every live serving member answers each
stream with a ``Verdict`` (agreed only if they are all the same). A member applies its
result only once every live serving member's verdict agrees with its own digest. A member
may hold an older result while a rerun notice is on its way to it, so a serving member
waits up to ``patience`` seconds for the digests to match before it declares a
disagreement; that wait starts again each time the round moves on here (a part moved, a
result sealed, an audit judged, a member's digest changed: :meth:`Agreement.progressed`),
and lasts ``PATIENCE_SPAN`` times the patience at most. A rerun takes an audit's wait, the
re-reduction and the audit of its result, each its own deadline: a fixed wait from the
first disagreement was shorter than that chain, and on a loaded machine a member sent a
disagreeing verdict while the round was still converging, which aborted it for everyone.

A client's digest decides nothing but what the client itself applies: it sends no verdict,
and a client that holds another result than the servers applies nothing (the servers'
verdicts differ from its digest) while the others apply theirs. (Counting clients' digests
let any member that joined as a client, a stranger admitted to the group, abort the round
for everyone with a made-up digest.)

Every announcement is signed (the caller checks the signatures), numbered in the round,
and carries the seals its digest is made of (``view.py``); a disagreeing verdict carries
the latest announcement of each server whose digest differed from its author's. What those
show is first-hand evidence: a member that told two servers two digests under one number
has signed both, and a reducer that sealed one part at one epoch over two results has
signed both (either is *proven two-faced* and named, ``dissenters``); a server whose
disagreement another server's signed word explains is not taken for the one out of line,
nor a member whose digest differs from ours only in a two-faced reducer's parts. (Before,
a member telling one honest server another digest than the rest had that server named as
the lone dissenter by everyone else.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from swarmloco.proto.v1 import averaging_pb2 as pb

MAX_ANNOUNCEMENTS = 64
"""Announcements kept per member (an honest one makes one per change of what it holds)."""

PATIENCE_SPAN = 4.0
"""The longest a member waits for digests to match, in patiences since the disagreement
began, however the round moves on meanwhile (a member making our view move without end
delays the verdict this long, no longer)."""


@dataclasses.dataclass
class Shown:
    """What the servers' verdicts show us, from the signed announcements they carry."""

    proven: set[int] = dataclasses.field(default_factory=set)
    """Servers proven two-faced: two digests signed under one number (to us, or to us and
    another), or one part sealed at one epoch over two results."""
    ahead: set[int] = dataclasses.field(default_factory=set)
    """Servers that told another server an announcement newer than any they told us."""
    explained: set[int] = dataclasses.field(default_factory=set)
    """Authors of verdicts that show another server's signed digest differing from
    theirs: their disagreement rests on that server's word, not only on their own."""


@dataclasses.dataclass(frozen=True)
class Step:
    """What one look at the agreement asks of the round."""

    announce: bytes | None = None
    """Our digest changed: send it to every live member we stream to."""
    verdict: pb.Verdict | None = None
    """Our verdict, now made: send it on every stream to us, and close them."""
    disagreement: str | None = None
    """Why the round must end with nothing applied (after sending ``verdict``)."""
    dissenters: tuple[int, ...] = ()
    """With a disagreement: the servers proven two-faced (two signed digests under one
    number, or two seals of one part and epoch over different results), else the one
    server that caused it when every other live server announced our digest (empty: no
    proof and no lone culprit, or not all digests known)."""
    out_of_line: tuple[int, ...] = ()
    """With a disagreement: every server out of line with us (its digest differs, it is
    proven two-faced, or its verdict disagrees while its digest is ours and nothing signed
    explains it), when those holding our digest, us included, are most of the live servers
    and every digest is in (else none)."""
    decided: bool = False
    """Every live serving member agreed with our digest: apply it."""


class Agreement:
    """Member ``me``'s account of the digests and verdicts of one round."""

    def __init__(
        self,
        *,
        me: int,
        serving: bool,
        patience: float,
        label: Callable[[int], str],
    ) -> None:
        """``label(member)`` names a member in reasons."""
        self._me = me
        self._serving = serving
        self._patience = patience
        self._label = label
        self.done: dict[int, bytes] = {}
        """The digest each member announced last (ours included)."""
        self.announced: dict[int, dict[int, pb.MemberDone]] = {}
        """Each member's announcements to us by number (ours included, unsigned)."""
        self.two_faced: set[int] = set()
        """Members proven two-faced: that signed two digests under one number, or sealed
        one part at one epoch over two different results."""
        self._sealed: dict[tuple[int, int, int], bytes] = {}
        """(part, epoch, reducer) -> the hash of the first seal of it we saw."""
        self.seq = 0
        """The number of our latest announcement."""
        self.verdicts: dict[int, pb.Verdict] = {}
        """The verdict of each serving member (ours included)."""
        self.verdict_sent = False
        self.my_done: bytes | None = None
        self.decided = False
        self._disagree_since: float | None = None
        self._dissent_since: float | None = None
        self._progress_at: float | None = None

    def step(
        self,
        digest: bytes,
        *,
        servers: Sequence[int],
        now: float,
        seals: Sequence[pb.Seal] = (),
    ) -> Step:
        """Move the agreement forward with our complete result's ``digest`` (made of
        ``seals``); ``servers`` are the serving members not failed (their digests alone
        make our verdict)."""
        announce = None
        if digest != self.my_done:
            self.my_done = digest
            self.seq += 1
            self._note(seals)
            self._record(self._me, pb.MemberDone(digest=digest, seq=self.seq, seals=seals))
            announce = digest
        verdict = None
        if self._serving and not self.verdict_sent and all(x in self.done for x in servers):
            differ = [x for x in servers if self.done[x] != digest]
            # Patience is for a member still holding a part's result from before a rerun;
            # one sent other results under the same claim will not come round.
            lagging = [x for x in differ if self._differs(x, digest)]
            if lagging and self._patient(now):
                return Step(announce)
            verdict = self._make_verdict(digest, differ)
        for member, said in self.verdicts.items():
            if not said.agreed or said.digest != digest:
                shown = self._shown(servers)
                missing = (
                    any(x not in self.done for x in servers)
                    or any(x not in self.verdicts for x in servers if self.done.get(x) == digest)
                    or bool(shown.ahead)
                )
                if self._serving and missing and self._waiting_for_digests(now):
                    # Who is out of line can be told once every server's digest is in,
                    # the verdict of each that holds ours, and every announcement a
                    # verdict shows us (they are on their way): a little patience, then
                    # abort.
                    return Step(announce, verdict)
                why = said.reason or "its result differs from ours"
                reason = f"member {self._label(member)} disagrees ({why})"
                proven = tuple(sorted(shown.proven))
                lone = self._lone_dissenter(digest, servers, shown)
                dissenters = proven or (() if lone is None else (lone,))
                out = self._out_of_line(digest, servers, shown)
                return Step(
                    announce, verdict, disagreement=reason, dissenters=dissenters, out_of_line=out
                )
        self.decided = all(x in self.verdicts for x in servers)
        return Step(announce, verdict, decided=self.decided)

    def heard(self, member: int, done: pb.MemberDone) -> None:
        """``member`` announced ``done`` to us (its signatures checked by the caller)."""
        self._note(done.seals)
        earlier = self.announced.get(member, {}).get(done.seq)
        if earlier is not None and earlier.digest != done.digest:
            self.two_faced.add(member)  # it signed both: proof enough
            return
        self._record(member, done)

    def _note(self, seals: Sequence[pb.Seal]) -> None:
        """Seals we saw: a reducer that sealed one part at one epoch twice, over different
        results, sent members different results (it signed both)."""
        for seal in seals:
            first = self._sealed.setdefault((seal.part, seal.epoch, seal.reducer), seal.hash)
            if first != seal.hash:
                self.two_faced.add(seal.reducer)

    def _record(self, member: int, done: pb.MemberDone) -> None:
        said = self.announced.setdefault(member, {})
        if done.seq not in said and len(said) >= MAX_ANNOUNCEMENTS:
            del said[min(said)]  # a member announcing without end keeps its latest only
        said[done.seq] = done
        if done.seq == max(said):
            self.done[member] = bytes(done.digest)

    def _shown(self, servers: Sequence[int]) -> Shown:
        """What the live servers' verdicts show (see :class:`Shown`)."""
        for verdict in self.verdicts.values():
            for entry in verdict.evidence:
                self._note(entry.done.seals)
        shown = Shown(proven={x for x in self.two_faced if x in servers and x != self._me})
        for author, verdict in self.verdicts.items():
            for entry in verdict.evidence:
                x, done = entry.member, entry.done
                if x == author or x not in servers or done.digest == verdict.digest:
                    continue
                shown.explained.add(author)
                said = self.announced.get(x, {})
                ours = said.get(done.seq)
                if x == self._me:
                    continue  # (ours is what we signed; an older one is no one's fault)
                if ours is not None and ours.digest != done.digest:
                    shown.proven.add(x)
                elif ours is None and done.seq > max(said, default=0):
                    shown.ahead.add(x)
        return shown

    def _lone_dissenter(self, digest: bytes, servers: Sequence[int], shown: Shown) -> int | None:
        """The one live server out of line, in a group of three servers or more: the only
        one whose announced digest differs from ours (or that told another server something
        newer than it told us), or, if every live server announced ours, the only one
        whose verdict disagrees with nothing signed to explain it; None otherwise (a split,
        or digests not all in). First-hand as far as this member can tell: each server's
        digest reached it directly, and what a verdict shows is signed by its member."""
        others = [x for x in servers if x != self._me]
        if len(servers) < 3 or any(x not in self.done for x in others):
            return None
        out = [x for x in others if self._differs(x, digest) or x in shown.ahead]
        if not out:
            out = [x for x in others if self._dissents(x, digest, shown)]
        return out[0] if len(out) == 1 else None

    def _out_of_line(self, digest: bytes, servers: Sequence[int], shown: Shown) -> tuple[int, ...]:
        """The live servers out of line with us, when those holding our digest (us
        included, those proven two-faced not) are a strict majority of three or more
        servers and every digest is in: two partners lying together are named both (the
        lone rule names neither)."""
        others = [x for x in servers if x != self._me]
        if len(servers) < 3 or any(x not in self.done for x in others):
            return ()
        differ = [
            x for x in others if self._differs(x, digest) or x in shown.proven or x in shown.ahead
        ]
        if 2 * (len(servers) - len(differ)) <= len(servers):
            return ()
        said = [x for x in others if x not in differ]
        return tuple(differ + [x for x in said if self._dissents(x, digest, shown)])

    def _differs(self, member: int, digest: bytes) -> bool:
        """Whether ``member`` holds another result than ours for a reason of its own: its
        digest differs, and not only in parts whose reducer is proven two-faced (a member
        sent other results than we were is not out of line)."""
        if self.done[member] == digest:
            return False
        theirs, ours = self._seals_of(member), self._seals_of(self._me)
        if not theirs or len(theirs) != len(ours):
            return True
        return any(
            (a.part, a.epoch, a.reducer) != (b.part, b.epoch, b.reducer)
            or (a.hash != b.hash and a.reducer not in self.two_faced)
            for a, b in zip(theirs, ours, strict=True)
        )

    def _seals_of(self, member: int) -> Sequence[pb.Seal]:
        said = self.announced.get(member)
        return said[max(said)].seals if said else ()

    def _dissents(self, member: int, digest: bytes, shown: Shown) -> bool:
        """Whether ``member``'s verdict disagrees with our digest while nothing signed
        explains why: neither another server's announcement it shows, nor a two-faced
        reducer that sent it other results than us."""
        if member not in self.verdicts or self._agrees(member, digest):
            return False
        if self.done.get(member, digest) != digest:
            return self._differs(member, digest)
        return not (member in shown.explained and self.verdicts[member].digest == digest)

    def _agrees(self, member: int, digest: bytes) -> bool:
        said = self.verdicts[member]
        return said.agreed and said.digest == digest

    def progressed(self, now: float) -> None:
        """The round moved on here at ``now`` (a part moved, a result sealed, an audit
        judged, a member's digest changed): the patience with a disagreement starts again,
        within ``PATIENCE_SPAN`` patiences of its beginning."""
        self._progress_at = now

    def _waiting_for_digests(self, now: float) -> bool:
        """Whether to wait longer for servers' digests (and verdicts) after a verdict
        disagreed."""
        if self._dissent_since is None:
            self._dissent_since = now
        return self._within_patience(self._dissent_since, now)

    def _patient(self, now: float) -> bool:
        """Whether to wait longer for members whose digest differs from ours: one may hold
        an older result while a rerun notice is on its way to it."""
        if self._disagree_since is None:
            self._disagree_since = now
        return self._within_patience(self._disagree_since, now)

    def _within_patience(self, since: float, now: float) -> bool:
        """Less than a patience since ``since`` or the round's last progress after it, and
        less than ``PATIENCE_SPAN`` patiences since ``since``."""
        last = max(since, self._progress_at if self._progress_at is not None else since)
        return now - last < self._patience and now - since < PATIENCE_SPAN * self._patience

    def _make_verdict(self, digest: bytes, differ: list[int]) -> pb.Verdict:
        names = [self._label(x) for x in differ]
        verdict = pb.Verdict(
            agreed=not differ,
            digest=digest,
            reason=f"members {names} hold another result" if differ else "",
        )
        for x in differ:
            said = self.announced.get(x)
            if said:
                verdict.evidence.add(member=x, done=said[max(said)])
        self.verdict_sent = True
        self.verdicts[self._me] = verdict
        return verdict

    def agreed(self) -> int:
        """How many verdicts agree with our digest."""
        return sum(1 for v in self.verdicts.values() if v.agreed and v.digest == self.my_done)
