"""Catching up with the swarm: which later (or majority) state to download, and from whom.

A peer is *behind* when other peers report working on later rounds than its state's, and
*in the minority* when its partners hold another digest of its round than its own. Either
way it looks for another state (:meth:`CatchUp.find`):

1. Read the swarm's ``progress`` claims; the rounds worth a look are those other peers hold
   (a peer working towards round r holds r - 1, or r - 2 while r - 1 is in flight), newest
   first, a stranger's claim capped at the ``quorum``-th highest claim of the peers that
   hold a round (one peer alone cannot lead this one past what the others report; a
   witness can; a newcomer at the initial state does not count). Read the digests
   published for each, ``rounds_tried`` rounds at a time: when none of a batch's states
   is adopted, the next rounds are read (those the most claims name first), at most
   ``rounds_read`` in all, so that a few keys claiming rounds far ahead that nobody
   serves cannot keep the rounds the swarm holds from being looked at.
2. Rank the candidate states: those held by a *witness* (a peer that averaged with this one
   lately) first, then the newer round, then the most backed; a fresh peer (no witness
   yet) and an orphaned one (every witness silent, or none ever) take a state held by the
   run's creator or a peer they joined through at an address their operator gave first
   (:func:`trusted_peers`: their claims are read first and not capped), then the state
   held from the most source networks (counting only holders that answered this peer
   there);
   a fresh peer weighs every round read so (not the newest batch first), so that keys
   filling the newest rounds cannot exile it to a round number the swarm never reaches.
3. Take each candidate only with evidence (``core/adoption.py``): backed by a witness (a
   peer with nobody to ask takes any, on the checks that follow), a round that time
   allows; download it from its holders (at most ``donors_per_digest``, each bounded by
   the download's own limits, picked as below); then check it whole against this peer's
   own state (finite, the distance the outer steps move, the momentum its updates build,
   the token count). A state that fails is refused and its holders distrusted.
4. Of its own round, a peer takes another digest only when its witnesses back that digest
   more than its own (never on strangers' word): a split group heals, a thousand keys
   publishing another digest of the round change nothing.

Donors, of a digest or of the initial state, are picked on what this peer saw itself,
never on what they announced (a record's expiration, a claimed endpoint): witnesses
first, then peers that answered it at that endpoint (a state served, a DHT call), then the
rest in random order; one per source network before a second from any; and a donor that
failed lately after all the others, so that the next try asks new ones.

It runs on the peer's event loop while the training thread waits for it, so it reads the
peer's ``theta_g`` without a copy. Everything it refused is returned for the log, the
events and the dashboard.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import random
import time
from collections import Counter
from collections.abc import AsyncGenerator, Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from swarmloco.core.adoption import (
    AdoptionConfig,
    Evidence,
    Reference,
    backing,
    check_state,
    outweighs,
    round_plausible,
)
from swarmloco.core.config import require_int, require_positive
from swarmloco.core.manifest import SwarmManifest
from swarmloco.core.state import LANDED, MOMENTUM, THETA_G, TOKENS, StateSchema, StateSnapshot
from swarmloco.dataset.ledger import Landed
from swarmloco.net.client import RpcClient
from swarmloco.net.deadline import Deadline
from swarmloco.net.dht.node import DHTNode
from swarmloco.net.endpoints import parse_endpoint, source_network
from swarmloco.net.node import NetNode
from swarmloco.net.records import digest_key, progress_key, progress_report
from swarmloco.net.rejections import RejectionLog
from swarmloco.net.state import (
    Donor,
    DonorFailure,
    DownloadConfig,
    DownloadedState,
    Requester,
    StateTransferError,
    download_state,
)
from swarmloco.net.swarm import creator_peer_id, find_peers

logger = logging.getLogger(__name__)

FAILED_DONOR_S = 30.0
"""How long a donor whose download failed (unreachable, refusing, stalling) is asked only
after every other: the next tries go to donors not yet asked."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class CatchUpConfig:
    """How a peer looks for, checks and downloads the swarm's state."""

    adoption: AdoptionConfig = dataclasses.field(default_factory=AdoptionConfig)
    """The evidence a state takes before it replaces this peer's."""
    download: DownloadConfig = dataclasses.field(default_factory=DownloadConfig)
    """Per-donor limits (header, chunks, minimum rate)."""
    state_timeout_s: float = 300.0
    """One catch-up, every candidate and donor together."""
    rounds_tried: int = 8
    """Later rounds whose digests are read, and their states tried, at a time."""
    rounds_read: int = 64
    """Later rounds whose digests one look reads at most: the ``rounds_tried`` newest,
    then, while none of the states read so far is adopted, the rounds the most claims
    name (keys claiming rounds nobody serves cost this peer a read each)."""
    donors_per_digest: int = 4
    """Holders of one digest asked for it before moving on to the next candidate."""

    def __post_init__(self) -> None:
        require_positive("state_timeout_s", self.state_timeout_s)
        require_int("rounds_tried", self.rounds_tried, minimum=1)
        require_int("rounds_read", self.rounds_read, minimum=1)
        require_int("donors_per_digest", self.donors_per_digest, minimum=1)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A state some peers published a digest for."""

    round: int
    digest: bytes
    holders: tuple[str, ...]
    endpoints: dict[str, str]
    answered: frozenset[str] = frozenset()
    """The holders that answered this peer at the endpoint they publish."""

    @property
    def networks(self) -> int:
        """Distinct source networks of the endpoints of the holders that answered there
        (an endpoint claimed and never answered from costs a key nothing)."""
        answered = (self.endpoints.get(p, "") for p in self.holders if p in self.answered)
        return len({_network(e) for e in answered} - {""})


def _network(endpoint: str) -> str:
    if not endpoint:
        return ""
    try:
        return source_network(parse_endpoint(endpoint)[0])
    except ValueError:
        return ""


def trusted_peers(node: NetNode, manifest: SwarmManifest) -> frozenset[str]:
    """Whose states a peer with nothing of its own to hold a state against takes first:
    the peers it joined through at the addresses its operator gave, and the run's creator
    (the swarm id its operator gave hashes the creator's key)."""
    return node.trusted_peers() | ({creator_peer_id(manifest)} - {""})


@dataclasses.dataclass(frozen=True)
class Refusal:
    """A candidate state not adopted, and why."""

    round: int
    digest: str
    reason: str
    holders: tuple[str, ...] = ()


@dataclasses.dataclass
class Found:
    """What one :meth:`CatchUp.find` came to."""

    adopted: DownloadedState | None = None
    why: str = ""
    refused: list[Refusal] = dataclasses.field(default_factory=list)
    failed: list[str] = dataclasses.field(default_factory=list)
    """Downloads that failed (every donor of a digest), as messages."""
    adopted_holders: tuple[str, ...] = ()
    """Who published the adopted state's digest (distrusted if it is rolled back)."""
    unbacked: set[str] = dataclasses.field(default_factory=set)
    """Peers claiming later rounds that no adoptable state backs (pacing ignores them)."""
    distrusted: set[str] = dataclasses.field(default_factory=set)
    """Holders of a state refused after its download (it was not a plausible successor)."""
    distance: float | None = None
    """How far (L2) the adopted state lay from this peer's, and the bound it was held to
    (None: no bound, this peer never measured an outer step)."""
    bound: float | None = None
    momentum: float | None = None
    """The adopted state's outer momentum (L2) and the bound it was held to."""
    momentum_bound: float | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Search:
    """One :meth:`CatchUp.find`: the round this peer holds, its own state that candidates
    are checked against, the states never asked for again, the schedule's peak learning
    rate, the deadline of the whole search, and what it found so far."""

    round: int
    reference: Reference
    distrusted_digests: frozenset[bytes]
    peak_lr: Callable[[int], float | None] | None
    deadline: Deadline
    found: Found = dataclasses.field(default_factory=Found)


class CatchUp:
    """Finds, checks and downloads a later or majority state for one peer."""

    def __init__(
        self,
        *,
        me: str,
        swarm_id: str,
        dht: DHTNode,
        client: RpcClient,
        schema: StateSchema,
        evidence: Evidence,
        config: CatchUpConfig | None = None,
        rejections: RejectionLog | None = None,
        clock: Callable[[], float] = time.time,
        requester: Requester | None = None,
        spool: Path | None = None,
        trusted: Callable[[], frozenset[str]] = frozenset,
    ) -> None:
        """``spool``: where downloaded states are received, in unnamed files (None: in
        memory); ``trusted``: the peers whose states come first when this one has nothing
        of its own to hold a state against (:func:`trusted_peers`)."""
        self.me = me
        self.spool = spool
        self.requester = requester
        """Who signs download requests (a private swarm's member; None: unsigned)."""
        self.swarm_id = swarm_id
        self.dht = dht
        self.client = client
        self.schema = schema
        self.evidence = evidence
        self.config = config or CatchUpConfig()
        self.rejections = rejections
        self.clock = clock
        self._failed: dict[str, float] = {}
        """Peer id -> until when (monotonic) it is asked after every other donor."""
        self._served: dict[str, str] = {}
        """Peer id -> the endpoint it served this peer a state from."""
        self.trusted = trusted

    async def claims(self) -> dict[str, int]:
        """Peer id -> the round it says it works towards, for every other peer reporting."""
        result = await self.dht.get(progress_key(self.swarm_id))
        return {
            e.subkey: progress_report(e.subkey, e.value).round
            for e in result.entries.values()
            if e.subkey != self.me
        }

    async def digests_of(self, round: int) -> dict[str, tuple[bytes, str]]:
        """Peer id -> (digest, endpoint) of everyone who published one for ``round``."""
        result = await self.dht.get(digest_key(self.swarm_id, round))
        return {e.subkey: (e.value["digest"], e.value["endpoint"]) for e in result.entries.values()}

    async def find(
        self,
        *,
        round: int,
        digest: bytes | None,
        reference: Reference,
        distrusted: set[str],
        distrusted_digests: frozenset[bytes] = frozenset(),
        peak_lr: Callable[[int], float | None] | None = None,
    ) -> Found:
        """A later state than ``round``'s, or another state of ``round`` than this peer's
        (``digest``) when its partners back that one more; ``reference``: this peer's own
        global state, which a candidate is checked against; ``distrusted``: holders whose
        states were refused before, and ``distrusted_digests``: states rolled back (never
        asked for again); ``peak_lr(n)``: the highest inner learning rate of the schedule
        over the next ``n`` rounds, when known (it scales the bounds)."""
        search = _Search(
            round=round,
            reference=reference,
            distrusted_digests=distrusted_digests,
            peak_lr=peak_lr,
            deadline=Deadline.after(self.config.state_timeout_s),
        )
        if await self._find_later(search, await self.claims(), distrusted):
            return search.found
        if round != 0 and digest is not None:
            await self._find_majority(search, digest, distrusted)
        return search.found

    async def _find_later(
        self, search: _Search, claims: dict[str, int], distrusted: set[str]
    ) -> bool:
        """Adopt a later state than ``search.round``'s, if one passes; either way note in
        ``search.found`` the peers whose claims of later rounds nothing backs."""
        found = search.found
        # While partners report, only their claims say which later rounds are worth a
        # look: a crowd of keys claiming rounds ahead costs no digest reads (and no
        # downloads: only a partner's word backs a state then anyway).
        partners = {
            p: r for p, r in claims.items() if p in self.evidence.witnesses and p not in distrusted
        }
        counted = list(partners.values()) if partners else self._counted(claims)
        trusted = {p: r for p, r in claims.items() if p in self.trusted() and p not in distrusted}
        candidates: list[Candidate] = []

        def live() -> set[str]:
            heard = set(claims) | {h for c in candidates for h in c.holders}
            return (heard & self.evidence.witnesses.keys()) - distrusted

        why = "the swarm is at round {target}, this peer at " + str(search.round)
        # Orphaned: every recent partner is silent (or was caught serving a bad state).
        fresh = self.evidence.fresh
        orphaned = not fresh and not live()
        later = self._later(counted, search.round, search.distrusted_digests, trusted.values())
        async with contextlib.aclosing(later) as batches:
            async for batch in batches:
                candidates += batch
                if fresh:
                    continue  # it weighs every round read before it takes one (below)
                orphaned = not live()
                if await self._try(search, batch, distrusted, why, orphaned):
                    return True
        # A fresh peer has no round of its own to hold a later one against: keys filling
        # the newest rounds with the swarm's own weights under round numbers the swarm
        # never reaches would have it take one of those and never meet the swarm. So it
        # takes, of every round read, the state held from the most networks.
        if fresh and await self._try(search, candidates, distrusted, why, orphaned):
            return True
        heard_live = live()
        if heard_live and not heard_live - found.distrusted:
            # The only partners still heard from just served states that failed the
            # checks: this peer is on its own now, and looks at what everyone claims.
            orphaned = True
            gone = distrusted | found.distrusted
            heard_rest = {p: r for p, r in claims.items() if p not in gone}
            later = self._later(self._counted(heard_rest), search.round, search.distrusted_digests)
            async with contextlib.aclosing(later) as batches:
                async for batch in batches:
                    rest = self._beyond(search, batch, gone)
                    candidates += rest
                    if await self._try(search, rest, gone, why, orphaned):
                        return True
        backed = {
            h for c in candidates for h in c.holders if not self._unbacked_reason(c, orphaned)
        }
        found.unbacked = {p for p, r in claims.items() if r > search.round + 2 and p not in backed}
        return False

    def _beyond(self, search: _Search, batch: list[Candidate], gone: set[str]) -> list[Candidate]:
        """The states of ``batch`` held by someone not ``gone``; a refusal of one of them is
        taken back, since it is tried again."""
        rest = [c for c in batch if not set(c.holders) <= gone]
        retried = {(c.round, c.digest.hex()) for c in rest}
        found = search.found
        found.refused = [r for r in found.refused if (r.round, r.digest) not in retried]
        return rest

    async def _find_majority(self, search: _Search, digest: bytes, distrusted: set[str]) -> None:
        """Adopt another state of ``search.round`` than this peer's ``digest`` if its
        partners back that one more, and it passes."""
        round = search.round
        published = await self.digests_of(round)
        published.pop(self.me, None)
        own = (*(p for p, (d, _) in published.items() if d == digest), self.me)
        grouped = self.evidence.grouped_round == round
        others = [
            c
            for c in self._candidates(round, published)
            if c.digest != digest and c.digest not in search.distrusted_digests
        ]
        ahead = []
        for c in sorted(others, key=lambda c: -self.evidence.support(c.holders)):
            reason = outweighs(
                c.holders, own, self.evidence, grouped=grouped, tie_break=c.digest < digest
            )
            if reason is None:
                ahead.append(c)
            elif self.evidence.support(c.holders) > 0:
                self._refuse(search.found, c, reason)  # strangers' digests are not worth a line
        why = f"this peer's partners back another state of round {round} than its own"
        await self._try(search, ahead, distrusted, why, False)

    async def _later(
        self,
        counted: list[int],
        round: int,
        distrusted_digests: frozenset[bytes],
        trusted: Iterable[int] = (),
    ) -> AsyncGenerator[list[Candidate], None]:
        """The states published for the rounds ``counted`` claims say peers hold past
        ``round`` (a peer working towards r holds r - 1, or r - 2 while r - 1 is in
        flight), ``rounds_tried`` rounds at a time, at most ``rounds_read`` in all.

        The rounds the trusted peers' claims (``trusted``) name first; then the newest
        rounds; after them, the rounds the most claims name. Claims cost
        nothing: two keys claiming a round far ahead set every stranger's ceiling there,
        and three more claiming the rounds just below it took all the newest places,
        rounds nobody serves. So a batch that yields no state does not end the look: the
        rounds the swarm holds are still read (a crowd of claims costs this peer reads,
        and downloads only where some key publishes a state, which the checks decide)."""
        named = collections.Counter(x for r in counted for x in {r - 1, r - 2} if x > round)
        first = sorted({x for r in trusted for x in (r - 1, r - 2) if x in named}, reverse=True)
        tried = self.config.rounds_tried
        newest = [x for x in sorted(named, reverse=True) if x not in first]
        rest = sorted(newest[tried:], key=lambda x: (-named[x], -x))
        order = (first + newest[:tried] + rest)[: self.config.rounds_read]
        for at in range(0, len(order), tried):
            targets = order[at : at + tried]
            published = await asyncio.gather(*(self.digests_of(t) for t in targets))
            batch = [
                c
                for target, digests in zip(targets, published, strict=True)
                for c in self._candidates(target, digests)
                if c.digest not in distrusted_digests
            ]
            if batch:
                yield batch

    async def initial(self, digest: bytes) -> DownloadedState | None:
        """The round-0 state (the run's initial weights) from any peer of the swarm still at
        round 0, checked against ``digest`` (the manifest's): no trust is needed."""
        peers = await find_peers(self.dht, self.swarm_id)
        donors = self._pick(
            [Donor(p.peer_id, p.endpoint) for p in peers if p.peer_id != self.me and p.endpoint],
            self.config.donors_per_digest * 2,
        )
        if not donors:
            return None
        deadline = Deadline.after(self.config.state_timeout_s)
        try:
            return await self._transfer(donors, deadline, round=0, digest=digest)
        except StateTransferError as exc:
            logger.info("no peer serves the initial state: %s", exc)
            return None

    def _counted(self, claims: dict[str, int]) -> list[int]:
        """The rounds claimed, a stranger's capped at the ``quorum``-th highest claim: one
        peer alone cannot lead this one to a later round than others report (a witness
        can: a peer that fell behind its partners must follow them).

        Only peers that hold a round of their own (claiming round 2 or later) set the
        ceiling: a newcomer still at the initial state vouches for nothing, and counting
        it would keep every newcomer of a swarm with one peer ahead from ever following
        that peer (two fresh peers capping it at each other's round 1)."""
        quorum = self.config.adoption.quorum
        ranked = sorted((r for r in claims.values() if r >= 2), reverse=True)
        if not ranked:
            return list(claims.values())
        ceiling = ranked[min(quorum, len(ranked)) - 1]
        vouched = self.evidence.witnesses.keys() | self.trusted()
        return [r if peer in vouched else min(r, ceiling) for peer, r in claims.items()]

    def _candidates(self, round: int, published: dict[str, tuple[bytes, str]]) -> list[Candidate]:
        endpoints = {peer: endpoint for peer, (_, endpoint) in published.items()}
        answered = frozenset(p for p, e in endpoints.items() if e and self._answered(p, e))
        holders: dict[bytes, list[str]] = {}
        for peer, (digest, _) in sorted(published.items()):
            holders.setdefault(digest, []).append(peer)
        return [Candidate(round, d, tuple(h), endpoints, answered) for d, h in holders.items()]

    def _order(self, candidates: Sequence[Candidate], orphaned: bool) -> list[Candidate]:
        if self.evidence.fresh or orphaned:
            # Nothing of its own to hold claims against: the states held by the peers its
            # operator had it join through first (the more of them the better), then the
            # state held from the most networks that answered, then by the most holders
            # that answered (keys and claimed endpoints cost nothing; the checks after the
            # download decide).
            trusted = self.trusted()
            return sorted(
                candidates,
                key=lambda c: (
                    -len(trusted.intersection(c.holders)),
                    -c.networks,
                    -len(c.answered.intersection(c.holders)),
                    -len(c.holders),
                    -c.round,
                    c.digest,
                ),
            )
        witnesses = self.evidence.witnesses
        return sorted(
            candidates,
            key=lambda c: (
                not (set(c.holders) & witnesses.keys()),
                -c.round,
                -self.evidence.support(c.holders),
                c.digest,
            ),
        )

    def _unbacked_reason(self, c: Candidate, orphaned: bool) -> str | None:
        return backing(c.holders, self.evidence, self.config.adoption, orphaned=orphaned)

    async def _try(
        self,
        search: _Search,
        candidates: Sequence[Candidate],
        distrusted: set[str],
        why: str,
        orphaned: bool,
    ) -> bool:
        """Adopt the first of ``candidates`` that is backed, plausible and passes the checks
        once downloaded (``why``: the reason to give, ``{target}`` its round); refuse the
        rest tried on the way."""
        round, found, peak_lr = search.round, search.found, search.peak_lr
        adoption = self.config.adoption
        for c in self._order(candidates, orphaned):
            ahead = c.round - round
            reason = self._unbacked_reason(c, orphaned) or round_plausible(
                ahead, self.clock(), self.evidence, adoption
            )
            donors = self._donors(c, distrusted)
            if reason is None and not donors:
                reason = "none of its holders serves state (client mode, or distrusted)"
            if reason is not None:
                self._refuse(found, c, reason)
                continue
            got = await self._download(c, donors, search.deadline, found)
            if got is None:
                continue
            lr = peak_lr(max(ahead, 0) + 2) if peak_lr is not None else None
            checked = check_state(
                got.snapshot,
                ahead=ahead,
                reference=search.reference,
                evidence=self.evidence,
                config=adoption,
                lr=lr,
                theta_g=THETA_G,
                momentum=MOMENTUM,
                tokens=TOKENS,
            )
            found.distance, found.bound = checked.distance, checked.bound
            found.momentum, found.momentum_bound = checked.momentum, checked.momentum_bound
            reason = checked.reason or _landed_problem(got.snapshot)
            if reason is not None:
                self._refuse(found, c, reason)
                found.distrusted |= set(c.holders)
                continue
            found.adopted = got
            found.adopted_holders = c.holders
            found.why = why.format(target=c.round)
            trusted = len(self.trusted().intersection(c.holders))
            if trusted:
                found.why += f"; held by {trusted} peer(s) it trusts (the creator or a --peer)"
            return True
        return False

    def _donors(self, c: Candidate, distrusted: set[str]) -> list[Donor]:
        usable = [
            Donor(p, c.endpoints[p])
            for p in c.holders
            if p != self.me and c.endpoints.get(p) and p not in distrusted
        ]
        return self._pick(usable, self.config.donors_per_digest)

    def _pick(self, donors: Sequence[Donor], count: int) -> list[Donor]:
        """Up to ``count`` of ``donors``, in the order to ask them: witnesses and trusted
        peers, then peers that answered this one at that endpoint, then the rest, in random
        order within each (a stalling donor cannot always be asked first, nor one whose
        record says so); one per source network before a second from any; those that
        failed lately last."""
        now = time.monotonic()
        self._failed = {p: until for p, until in self._failed.items() if until > now}
        witnesses, trusted = self.evidence.witnesses, self.trusted()
        seen: Counter[tuple[bool, bool, bool, str]] = Counter()
        keyed: list[tuple[tuple[bool, bool, bool, int], Donor]] = []
        for d in random.sample(list(donors), len(donors)):
            rank = (
                d.peer_id in self._failed,
                d.peer_id not in witnesses and d.peer_id not in trusted,
                not self._answered(d.peer_id, d.endpoint),
            )
            network = (*rank, _network(d.endpoint))
            keyed.append(((*rank, seen[network]), d))
            seen[network] += 1
        keyed.sort(key=lambda k: k[0])
        return [d for _, d in keyed[:count]]

    def _answered(self, peer_id: str, endpoint: str) -> bool:
        """Whether ``peer_id`` answered this peer at ``endpoint``: served it a state from
        there, or is a contact of its DHT there (the routing table keeps only contacts
        that answered from the endpoint of their card, and drops those that fail)."""
        if self._served.get(peer_id) == endpoint:
            return True
        try:
            contact = self.dht.routing.get(bytes.fromhex(peer_id))
        except ValueError:
            return False
        return contact is not None and contact.endpoint == endpoint

    async def _transfer(
        self, donors: list[Donor], deadline: Deadline, *, round: int, digest: bytes
    ) -> DownloadedState:
        """The state of ``round`` with ``digest`` from the first of ``donors`` that delivers
        it; the donors that failed are asked after the others for ``FAILED_DONOR_S``."""
        try:
            got = await download_state(
                self.client,
                donors,
                swarm_id=self.swarm_id,
                deadline=deadline,
                expected_round=round,
                expected_digest=digest,
                schema=self.schema,
                config=self.config.download,
                rejections=self.rejections,
                requester=self.requester,
                spool=self.spool,
            )
        except StateTransferError as exc:
            self._note_failures(exc.failures)
            raise
        self._note_failures(got.failures)
        self._served[got.donor.peer_id] = got.donor.endpoint
        return got

    def _note_failures(self, failures: Sequence[DonorFailure]) -> None:
        until = time.monotonic() + FAILED_DONOR_S
        for failure in failures:
            self._failed[failure.donor.peer_id] = until

    async def _download(
        self, c: Candidate, donors: list[Donor], deadline: Deadline, found: Found
    ) -> DownloadedState | None:
        logger.info(
            "downloading the state of round %d (digest %s, %d holder(s))",
            c.round,
            c.digest.hex()[:12],
            len(c.holders),
        )
        try:
            return await self._transfer(donors, deadline, round=c.round, digest=c.digest)
        except StateTransferError as exc:
            logger.warning("%s", exc)
            found.failed.append(str(exc))
            return None

    def _refuse(self, found: Found, c: Candidate, reason: str) -> None:
        refusal = Refusal(c.round, c.digest.hex(), reason, c.holders)
        found.refused.append(refusal)
        logger.info(
            "not adopting the state of round %d (digest %s): %s",
            c.round,
            refusal.digest[:12],
            reason,
        )


def describe(found: Found) -> dict[str, Any]:
    """The parts of a :class:`Found` worth an event."""
    return {
        "refused": [dataclasses.asdict(r) | {"holders": len(r.holders)} for r in found.refused],
        "failed": len(found.failed),
    }


def _landed_problem(snapshot: StateSnapshot) -> str | None:
    """Why the sequences a state says landed in it cannot be taken, or None."""
    if snapshot.spec(LANDED) is None:
        return None
    try:
        Landed.from_tensor(snapshot.tensor(LANDED))
    except ValueError as exc:
        return f"what it says landed of the dataset is malformed: {exc}"
    return None
