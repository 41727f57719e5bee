"""The agreement that ends a round: which digests the members hold, the verdicts of the
serving members, and whether this member may apply its result. No I/O.

Every member sends a ``MemberDone`` with the digest of its whole result once it has every
part; a serving member that holds the digest of every live serving member answers each
stream with a ``Verdict`` (agreed only if they are all the same). A member applies its
result only once every live serving member's verdict agrees with its own digest. A member
may hold an older result while a rerun notice is on its way to it, so a serving member
waits up to ``patience`` seconds for the digests to match before it declares a
disagreement.

A client's digest decides nothing but what the client itself applies: it sends no verdict,
and a client that holds another result than the servers applies nothing (the servers'
verdicts differ from its digest) while the others apply theirs. (Counting clients' digests
let any member that joined as a client, a stranger admitted to the group, abort the round
for everyone with a made-up digest.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from swarmloco.proto.v1 import averaging_pb2 as pb


@dataclasses.dataclass(frozen=True)
class Step:
    """What one look at the agreement asks of the round."""

    announce: bytes | None = None
    """Our digest changed: send it to every live member we stream to."""
    verdict: pb.Verdict | None = None
    """Our verdict, now made: send it on every stream to us, and close them."""
    disagreement: str | None = None
    """Why the round must end with nothing applied (after sending ``verdict``)."""
    dissenter: int | None = None
    """With a disagreement: the one server that caused it, when every other live server
    announced our digest (None: no lone culprit, or not all digests known)."""
    out_of_line: tuple[int, ...] = ()
    """With a disagreement: every server out of line with us (its digest differs, or its
    verdict disagrees while its digest is ours), when those holding our digest, us
    included, are most of the live servers and every digest is in (else none)."""
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
        """The digest each member announced (ours included)."""
        self.verdicts: dict[int, pb.Verdict] = {}
        """The verdict of each serving member (ours included)."""
        self.verdict_sent = False
        self.my_done: bytes | None = None
        self.decided = False
        self._disagree_since: float | None = None
        self._dissent_since: float | None = None

    def step(self, digest: bytes, *, servers: Sequence[int], now: float) -> Step:
        """Move the agreement forward with our complete result's ``digest``; ``servers``
        are the serving members not failed (their digests alone make our verdict)."""
        announce = None
        if digest != self.my_done:
            self.my_done = digest
            self.done[self._me] = digest
            announce = digest
        verdict = None
        if self._serving and not self.verdict_sent and all(x in self.done for x in servers):
            differ = [self._label(x) for x in servers if self.done[x] != digest]
            if differ and self._patient(now):
                return Step(announce)
            verdict = self._make_verdict(digest, differ)
        for member, said in self.verdicts.items():
            if not said.agreed or said.digest != digest:
                missing = any(x not in self.done for x in servers) or any(
                    x not in self.verdicts for x in servers if self.done.get(x) == digest
                )
                if self._serving and missing and self._waiting_for_digests(now):
                    # Who is out of line can be told once every server's digest is in,
                    # and the verdict of each that holds ours (they are on their way):
                    # a little patience, then abort.
                    return Step(announce, verdict)
                why = said.reason or "its result differs from ours"
                reason = f"member {self._label(member)} disagrees ({why})"
                lone = self._lone_dissenter(digest, servers)
                out = self._out_of_line(digest, servers)
                return Step(announce, verdict, disagreement=reason, dissenter=lone, out_of_line=out)
        self.decided = all(x in self.verdicts for x in servers)
        return Step(announce, verdict, decided=self.decided)

    def _lone_dissenter(self, digest: bytes, servers: Sequence[int]) -> int | None:
        """The one live server out of line, in a group of three servers or more: the only
        one whose announced digest differs from ours, or, if every live server announced
        ours, the only one whose verdict disagrees; None otherwise (a split, or digests not
        all in). First-hand as far as this member can tell: each server's digest reached it
        directly. (A member that equivocates, telling each member another digest or result,
        can make an honest server look like the lone one here.)"""
        others = [x for x in servers if x != self._me]
        if len(servers) < 3 or any(x not in self.done for x in others):
            return None
        out = [x for x in others if self.done[x] != digest]
        if not out:
            out = [x for x in others if x in self.verdicts and not self._agrees(x, digest)]
        return out[0] if len(out) == 1 else None

    def _out_of_line(self, digest: bytes, servers: Sequence[int]) -> tuple[int, ...]:
        """The live servers out of line with us, when those holding our digest (us
        included) are a strict majority of three or more servers and every digest is in:
        two partners lying together are named both (the lone rule names neither). Members
        that equivocate can put honest servers here too, where they are most of the
        servers with us; what a name costs is therefore short (see ``demote``)."""
        others = [x for x in servers if x != self._me]
        if len(servers) < 3 or any(x not in self.done for x in others):
            return ()
        differ = [x for x in others if self.done[x] != digest]
        if 2 * (len(servers) - len(differ)) <= len(servers):
            return ()
        said = [x for x in others if x not in differ and x in self.verdicts]
        return tuple(differ + [x for x in said if not self._agrees(x, digest)])

    def _agrees(self, member: int, digest: bytes) -> bool:
        said = self.verdicts[member]
        return said.agreed and said.digest == digest

    def _waiting_for_digests(self, now: float) -> bool:
        """Whether to wait longer for servers' digests (and verdicts) after a verdict
        disagreed."""
        if self._dissent_since is None:
            self._dissent_since = now
        return now - self._dissent_since < self._patience

    def _patient(self, now: float) -> bool:
        """Whether to wait longer for members whose digest differs from ours: one may hold
        an older result while a rerun notice is on its way to it."""
        self._disagree_since = self._disagree_since or now
        return now - self._disagree_since < self._patience

    def _make_verdict(self, digest: bytes, differ: list[str]) -> pb.Verdict:
        verdict = pb.Verdict(
            agreed=not differ,
            digest=digest,
            reason=f"members {differ} hold another result" if differ else "",
        )
        self.verdict_sent = True
        self.verdicts[self._me] = verdict
        return verdict

    def agreed(self) -> int:
        """How many verdicts agree with our digest."""
        return sum(1 for v in self.verdicts.values() if v.agreed and v.digest == self.my_done)
