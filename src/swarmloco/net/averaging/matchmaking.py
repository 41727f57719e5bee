"""Leader-based matchmaking: the peers ready for round r form one group under ``round/<r>``.

:meth:`Matchmaker.form_group` announces this peer under the round's DHT key (a signed,
owned, short-lived entry: endpoint, weight, bandwidth, client mode, announce time), then
reads the key back. The announced *serving* peer first in the round's order of leadership
(:func:`leader_rank`, a hash of the round and the peer id) leads: the others send it a
signed :class:`~swarmloco.proto.v1.averaging_pb2.MemberDeclaration` in a ``Join`` call
that it answers, as a long poll, once gathering is over. A leader gathers until the group
reaches ``max_group_size`` or the peers it expects, or its gathering window closes (the
strangers it was told of besides the peers it knows get ``stranger_grace_s`` once those
are in, not the window), strikes members whose weight is out of bounds, cuts the parts and
answers every member with the same group (or with the reason it was left out). A leader
that learns, while gathering, of a serving peer ahead of it in that order (one that
announced later, or at once and was missed) hands over: its followers are redirected
there, and so is it. The order is a hash, not the announce time, so that no peer can
make itself the leader of every round by claiming an early time. A group of one is a valid
outcome; fewer than ``min_group_size`` members is not.

A leader whose group formed marks its entry (``formed``). A peer that comes after its
round's group formed without it (the marker, or a leader's "formed" refusal) raises
``RoundAborted(late=True)`` instead of leading a second group of the round with other
latecomers, which would split the swarm's state; the caller takes the group's result (a
download). Once per round: a marker is only its leader's word. A group that aborts tries
the round again, and its leader's new announcement carries no marker
(``formed_without_us`` then says so): a latecomer waiting for a result stops waiting.

Nothing here waits without a deadline: an unreachable leader costs one call bounded by
the caller's deadline, after which the next candidate is tried or this peer leads itself
(client-mode peers never lead; they wait a gathering window for a serving peer to appear,
then average alone). A round that finds
no group by the deadline raises :class:`~swarmloco.errors.RoundAborted`; a member the
leader refused raises :class:`~swarmloco.errors.RejectedInput`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import hashlib
import logging
import math
import os
import time
from collections.abc import Callable, Collection, Iterable

import grpc

from swarmloco.core.config import require, require_int, require_non_negative, require_positive
from swarmloco.errors import RejectedInput, RoundAborted
from swarmloco.net.admission import Gate
from swarmloco.net.averaging.faults import FaultCut, FaultPlan
from swarmloco.net.averaging.group import (
    NONCE_BYTES,
    Group,
    Member,
    build_group,
    check_declaration,
    check_group,
    sign_declaration,
    single_group,
)
from swarmloco.net.averaging.wire import SERVICE_NAME
from swarmloco.net.client import Method, RpcClient, RpcError
from swarmloco.net.deadline import Deadline
from swarmloco.net.dht.node import DHTNode, Entry
from swarmloco.net.endpoints import (
    MAX_ENDPOINT_CHARS,
    host_of_grpc_peer,
    parse_endpoint,
    subnet_of,
)
from swarmloco.net.heap import release_after
from swarmloco.net.identity import Identity, peer_id_of
from swarmloco.net.records import round_key
from swarmloco.net.rejections import (
    MAX_CODE_CHARS,
    MAX_REASON_CHARS,
    Rejection,
    RejectionLog,
)
from swarmloco.net.swarm import find_peers
from swarmloco.proto.v1 import averaging_pb2 as pb

logger = logging.getLogger(__name__)

JOIN = Method(f"/{SERVICE_NAME}/Join", pb.JoinRequest, pb.JoinResponse)
_MAX_REDIRECTS = 8
_RECORDS_REREAD_S = 1.0  # how often a leader may read the peer list again for an unknown key
_RECORDS_WAIT_S = 5.0  # how long a Join waits for that read
_PROBED = 8  # leader candidates whose TLS handshake is tried at once
# Refusals after which asking again (elsewhere) makes sense; the others are final.
_TRANSIENT = frozenset({"not-leading", "formed", "full", "subnet-full", "stepped-down"})


@dataclasses.dataclass(frozen=True, kw_only=True)
class MatchmakingConfig:
    """How peers find their group for a round."""

    min_group_size: int = 1
    """Smallest group worth averaging in (a leader with fewer members aborts the round)."""
    max_group_size: int = 64
    """A leader stops gathering once this many members joined."""
    gather_s: float = 5.0
    """How long a leader waits for followers (bounded by the caller's deadline)."""
    poll_s: float = 0.5
    """How often a gathering leader (or a client-mode peer without a leader) re-reads the
    round's DHT key."""
    weight_cap_multiple: float = 10.0
    """A declared weight counts as at most this multiple of the group's lower median (0: no
    cap); above it, the member is kept with the capped weight, never struck."""
    bandwidth: float = 12.5e6
    """Declared reduction bandwidth in bytes/s (only ratios matter); parts are
    proportional to it. Client-mode peers always declare 0."""
    announce_ttl_s: float = 120.0
    """Lifetime of the ``round/<r>`` entry."""
    max_declaration_age_s: float = 600.0
    """A leader refuses declarations signed longer ago (or further ahead) than this."""
    max_members_per_subnet: int = 16
    """A leader takes at most this many members calling from one /24 (IPv4) or /64 (IPv6),
    itself included, so that one operator cannot fill a group with keys of its own."""
    limit_private_subnets: bool = False
    """Apply ``max_members_per_subnet`` to loopback and private addresses too (a swarm on
    one machine or one LAN would otherwise be capped)."""
    first_contact_s: float = 2.0
    """How long a follower waits for a leader candidate it has not reached before to
    answer its TLS handshake; candidates are reached in parallel, so a silent one costs
    this once, not a call timeout each."""
    stranger_leaders: int = 3
    """Candidates a peer without partners (no round averaged with others yet) asks to lead
    it before it leads itself, when they do not answer or refuse."""
    stranger_grace_s: float = 1.0
    """How long a leader whose expected known peers all joined (or who expects none) waits on
    for the strangers it was told to expect besides: a key that claims progress costs
    nothing, so strangers never hold a group for the whole gathering window (0: do not
    wait for them)."""

    def __post_init__(self) -> None:
        require_int("min_group_size", self.min_group_size, minimum=1)
        require_int("max_group_size", self.max_group_size, minimum=1)
        require(self.min_group_size <= self.max_group_size, "min_group_size > max_group_size")
        require_int("max_members_per_subnet", self.max_members_per_subnet, minimum=1)
        require_int("stranger_leaders", self.stranger_leaders, minimum=1)
        for name in (
            "gather_s",
            "poll_s",
            "announce_ttl_s",
            "max_declaration_age_s",
            "first_contact_s",
        ):
            require_positive(name, getattr(self, name))
        require_non_negative("stranger_grace_s", self.stranger_grace_s)
        require(
            math.isfinite(self.weight_cap_multiple) and self.weight_cap_multiple >= 0,
            "weight_cap_multiple must be a non-negative number",
        )
        require(math.isfinite(self.bandwidth) and self.bandwidth > 0, "bandwidth must be positive")


class _TooFew(Exception):
    """Internal: the group this peer led gathered fewer than ``min_group_size``."""


class _Handover(Exception):
    """Internal: the gathering leader found a peer ahead of it at ``endpoint``."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(endpoint)
        self.endpoint = endpoint


@dataclasses.dataclass
class _Gathering:
    """A round this peer leads: the declarations so far and each follower's answer."""

    round: int
    me: pb.MemberDeclaration
    numel: int
    block_size: int
    declarations: list[pb.MemberDeclaration]
    waiters: dict[str, asyncio.Future[pb.JoinResponse]]
    joined: asyncio.Event
    subnets: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    """Members per subnet (exempt addresses are not counted)."""
    subnet_of: dict[str, str] = dataclasses.field(default_factory=dict)
    """Each follower's subnet, by peer id."""
    closed: bool = False


@dataclasses.dataclass(frozen=True)
class _Candidate:
    rank: bytes
    peer_id: str
    endpoint: str
    gathering: bool = False
    """Its leader says it gathers its group now (and has partners)."""


def leader_rank(swarm_id: str, round: int, peer_id: str) -> bytes:
    """Where ``peer_id`` stands in the order of leadership of ``round`` (lowest leads).

    A hash nobody chooses: a peer cannot move itself ahead by what it announces, and each
    round draws a new order, so one peer leads about one round in as many as there are
    peers ready for it.
    """
    payload = f"{swarm_id}\x00{round}\x00{peer_id}".encode()
    return hashlib.blake2b(payload, digest_size=16, person=b"swarmloco-leader").digest()


class Matchmaker:
    """Forms this peer's group for each round. Constructing does no I/O."""

    def __init__(
        self,
        *,
        identity: Identity,
        dht: DHTNode,
        client: RpcClient,
        swarm_id: str,
        config: MatchmakingConfig | None = None,
        faults: FaultPlan | None = None,
        clock: Callable[[], float] = time.time,
        admission: Gate | None = None,
        peer_records: bool = False,
        partners: Callable[[], Collection[str]] | None = None,
    ) -> None:
        """``admission``: a private swarm's gate (only its members are taken into groups
        or accepted in one, and this peer's declarations show its certificate).
        ``peer_records``: the swarm's peers announce themselves in its signed ``peers``
        record (``net/swarm.py``), and a leader takes into its group only keys that did,
        at the endpoint they declare; leader candidates must have announced themselves
        there too. ``partners``: the peers this one averaged with lately (its witnesses):
        once it has any, only they may lead it, and only their ``formed`` marks count."""
        self.identity = identity
        self.partners = partners or (lambda: ())
        self.admission = admission
        self.peer_records = peer_records
        self._records: dict[str, str] = {}
        """Each announced peer's endpoint, by peer id, as last read from the DHT."""
        self._records_read_at = -math.inf
        self._reading_records: asyncio.Task[None] | None = None
        self.dht = dht
        self.client = client
        self.swarm_id = swarm_id
        self.config = config or MatchmakingConfig()
        self.faults = faults
        self.clock = clock
        self.rejections = RejectionLog(logger)
        self._leading: dict[int, _Gathering] = {}
        self._following: dict[int, str] = {}
        self._finished: collections.deque[int] = collections.deque(maxlen=64)
        self._came_late: collections.deque[int] = collections.deque(maxlen=64)
        self._lonely: collections.deque[int] = collections.deque(maxlen=64)
        """Rounds this peer led and gathered too few in (see ``_candidates``)."""
        self._entries: dict[int, dict[str, object]] = {}
        """This peer's ``round/<r>`` entry, per round it is forming a group for."""
        self._grouped: collections.OrderedDict[int, frozenset[str]] = collections.OrderedDict()
        """The members of this peer's last group of each recent round."""
        self._marking: set[asyncio.Task[None]] = set()

    # -- the public API ----------------------------------------------------------------

    async def form_group(
        self,
        round: int,
        *,
        weight: float,
        numel: int,
        block_size: int,
        deadline: Deadline,
        expected: int | None = None,
        strangers: int = 0,
        norm: float = 0.0,
    ) -> Group:
        """The group this peer averages ``round`` with.

        ``weight``: this peer's weight (tokens since the last round, > 0); ``numel``: the
        padded length of the vector; ``block_size``: the codec's block size; ``expected``:
        how many peers (this one included) are known to work on this round: if this peer
        leads, it closes the group as soon as that many joined instead of waiting out the
        gathering window (None: wait it out, or until ``max_group_size``). ``strangers``:
        how many peers it does not know besides are worth waiting for (newcomers whose
        progress reports name the round): once the ``expected`` peers joined, a leader
        waits for them ``stranger_grace_s`` at most (ignored without ``expected``). Raises
        RoundAborted when no group forms by ``deadline``, RejectedInput when the leader
        refused this peer (e.g. its weight is above the cap). ``norm``: the L2 norm of the
        update this peer brings (0: not declared); the group bounds every update by a
        multiple of the median declared norm.
        """
        if not (isinstance(weight, (int, float)) and math.isfinite(weight) and weight > 0):
            raise ValueError(f"weight must be a finite positive number, got {weight!r}")
        if expected is not None and (not isinstance(expected, int) or expected < 1):
            raise ValueError(f"expected must be a positive number of peers, got {expected!r}")
        if not isinstance(strangers, int) or isinstance(strangers, bool) or strangers < 0:
            raise ValueError(f"strangers must be a number of peers >= 0, got {strangers!r}")
        if not (isinstance(norm, (int, float)) and math.isfinite(norm) and norm >= 0):
            raise ValueError(f"norm must be a finite number >= 0, got {norm!r}")
        cfg = self.config
        endpoint = self.dht.endpoint
        me = sign_declaration(
            self.identity,
            endpoint=endpoint,
            weight=weight,
            bandwidth=cfg.bandwidth if endpoint else 0.0,
            swarm_id=self.swarm_id,
            round=round,
            numel=numel,
            block_size=block_size,
            timestamp_ms=int(self.clock() * 1000),
            norm=norm,
            membership=self.admission.own_bytes if self.admission is not None else b"",
        )
        announced_at = self.clock()  # shown to others, never trusted (see leader_rank)
        key = round_key(self.swarm_id, round)
        # A round tried again (the last attempt aborted) is not formed: followers asking
        # now should wait for this attempt's gathering, not give up on us.
        if round in self._finished:
            self._finished = collections.deque(
                (r for r in self._finished if r != round), maxlen=self._finished.maxlen
            )
        try:
            await self._announce(key, me, announced_at, deadline)
            group = await self._find_group(round, me, deadline, expected, strangers)
        finally:
            self.dht.forget_published(key, self.identity.peer_id_hex)
            self._following.pop(round, None)
            self._entries.pop(round, None)
            self._finished.append(round)
        self._grouped[round] = frozenset(m.peer_id for m in group.members)
        while len(self._grouped) > 64:
            self._grouped.popitem(last=False)
        return group

    # -- finding the leader ------------------------------------------------------------

    async def _announce(
        self, key: str, me: pb.MemberDeclaration, announced_at: float, deadline: Deadline
    ) -> None:
        value = {
            "endpoint": me.endpoint,
            "weight": float(me.weight),
            "bandwidth": float(me.bandwidth),
            "client_mode": not me.endpoint,
            "announced_at": announced_at,
            "numel": me.numel,
        }
        self._entries[me.round] = value
        try:
            async with asyncio.timeout(deadline.remaining()):
                await self.dht.store(key, value, ttl=self.config.announce_ttl_s)
        except TimeoutError:
            raise RoundAborted(f"round {me.round}: announcing took past the deadline") from None

    async def _candidates(
        self, round: int, me: pb.MemberDeclaration, deadline: Deadline
    ) -> tuple[list[_Candidate], bool]:
        """The serving peers of this round and vector size this peer may follow, in the
        order it asks them (all of them if it cannot lead); and whether a leader says the
        round's group formed (without us: a group we were in does not count).

        A peer with partners follows only partners ahead of it in the order of leadership.
        A peer without partners (a newcomer) follows the peers ahead of it, and, first,
        leaders with partners that say they are gathering now (``formed: 1``) wherever they
        stand in the order: peers with partners never follow a stranger, so a newcomer
        first in the order would otherwise lead, and average, alone."""
        key = round_key(self.swarm_id, round)
        timeout = max(min(deadline.remaining(), self.dht.config.lookup_timeout_s), 0.01)
        result = await self.dht.get(key, timeout=timeout)
        mine = self.identity.peer_id_hex
        formed = self._formed_marked(round, me.numel, result.entries.values())
        partners = set(self.partners())
        own = leader_rank(self.swarm_id, round, mine)
        entries = [
            e
            for e in result.entries.values()
            if e.subkey != mine
            and not e.value["client_mode"]
            and e.value["endpoint"]
            and e.value["numel"] == me.numel
            and (not partners or e.subkey in partners)  # a stranger never leads a partner
        ]
        if self.peer_records and any(
            self._records.get(e.subkey) != e.value["endpoint"] for e in entries
        ):
            await self._reread_records(deadline)
        found = []
        for entry in entries:
            if self.peer_records and self._records.get(entry.subkey) != entry.value["endpoint"]:
                continue  # not announced in the swarm's peer list (at that endpoint)
            rank = leader_rank(self.swarm_id, round, entry.subkey)
            gathering = entry.value.get("formed") == 1
            ahead = rank < own or not me.endpoint
            follow_any = not partners and (gathering or round in self._lonely)
            if ahead or follow_any:
                found.append(_Candidate(rank, entry.subkey, entry.value["endpoint"], gathering))
        # Gathering leaders first (a newcomer's), then the order of leadership.
        found.sort(key=lambda c: (not (c.gathering and not partners), c.rank))
        return found, formed

    def _formed_marked(self, round: int, numel: int, entries: Iterable[Entry]) -> bool:
        """Whether a peer outside our own group of ``round`` marks its entry ``formed``
        (once this peer has partners, only a partner's mark counts: a stranger's would
        make it wait for a result that never comes)."""
        mine = self.identity.peer_id_hex
        ours = self._grouped.get(round, frozenset())
        partners = set(self.partners())
        return any(
            e.value.get("formed", 0) > 1 and e.value["numel"] == numel
            for e in entries
            if e.subkey != mine and e.subkey not in ours and (not partners or e.subkey in partners)
        )

    async def formed_without_us(self, round: int, numel: int) -> bool:
        """Whether ``round``'s group formed without this peer, as the round's entries say
        now. A leader whose group aborted announces the round again, without the mark: a
        peer that came late stops waiting for a result that will not come."""
        result = await self.dht.get(round_key(self.swarm_id, round))
        return self._formed_marked(round, numel, result.entries.values())

    async def _find_group(
        self,
        round: int,
        me: pb.MemberDeclaration,
        deadline: Deadline,
        expected: int | None,
        strangers: int,
    ) -> Group:
        tried: set[str] = set()
        formed_without_us = False
        not_leading: dict[str, float] = {}
        redirects = 0
        next_endpoint: str | None = None
        unserved_since: float | None = None  # client mode: since when no leader is in sight
        failed_leaders: set[str] = set()  # candidates that did not answer our Join
        while not deadline.expired:
            if next_endpoint is None:
                candidates, formed = await self._candidates(round, me, deadline)
                formed_without_us |= formed
                untried = [c for c in candidates if c.endpoint not in tried]
                if len(failed_leaders) >= self.config.stranger_leaders and not self.partners():
                    untried = []  # enough strangers failed us: lead (or wait) instead
                tried |= await self._unreachable(untried, deadline)
                untried = [c for c in untried if c.endpoint not in tried]
                if not untried:
                    if formed_without_us and round not in self._came_late:
                        # A peer ahead of us already formed this round's group: leading
                        # another with whoever else came late would split the swarm's
                        # state in two. Once per round: a leader that only says so (a
                        # liar, or a group that aborted) costs one attempt, not the round.
                        self._came_late.append(round)
                        raise RoundAborted(
                            f"round {round}: its group formed before this peer came; "
                            "catching up with it instead",
                            late=True,
                        )
                    if me.endpoint:
                        try:
                            return await self._lead(round, me, tried, deadline, expected, strangers)
                        except _Handover as handover:
                            next_endpoint = handover.endpoint
                            continue
                        except _TooFew as lonely:
                            self._lonely.append(round)
                            raise RoundAborted(str(lonely)) from None
                    # A client-mode peer cannot lead. When no serving peer it can reach
                    # shows up for a whole gathering window, it averages alone, as a
                    # leader nobody joined would.
                    now = time.monotonic()
                    if unserved_since is None:
                        unserved_since = now
                    if now - unserved_since >= self.config.gather_s:
                        return self._alone(round, me)
                    await asyncio.sleep(min(self.config.poll_s, deadline.remaining()))
                    continue
                unserved_since = None
                next_endpoint = untried[0].endpoint
            endpoint, next_endpoint = next_endpoint, None
            response = await self._join(endpoint, me, deadline)
            if response is None:
                failed_leaders.add(endpoint)
                tried.add(endpoint)
                continue
            outcome = response.WhichOneof("outcome")
            if outcome == "group":
                try:
                    return check_group(
                        response.group,
                        me=me,
                        swarm_id=self.swarm_id,
                        cap_multiple=self.config.weight_cap_multiple,
                        admission=self.admission,
                    )
                except Rejection as rejection:
                    self.rejections.record(rejection, endpoint)
                    raise RoundAborted(
                        f"round {round}: the leader at {endpoint} sent an invalid group "
                        f"({rejection.reason})"
                    ) from None
            if outcome == "redirect" and redirects < _MAX_REDIRECTS:
                redirects += 1
                self._following[round] = response.redirect
                next_endpoint = response.redirect
                continue
            refusal = response.refused
            if outcome == "refused" and refusal.code == "too-few":
                raise RoundAborted(f"round {round}: {refusal.reason}")
            waiting = ("not-leading",) if me.endpoint else ("not-leading", "formed")
            if outcome == "refused" and refusal.code in waiting:
                # It announced but has not started leading yet (or never will: after a
                # gathering window of asking, give up on it). A client-mode peer, which
                # cannot lead, also waits out a leader that formed a group of this round
                # without it: the leader may try the round again (its last attempt
                # aborted) and would then take it.
                since = not_leading.setdefault(endpoint, time.monotonic())
                if time.monotonic() - since > self.config.gather_s:
                    tried.add(endpoint)
                await asyncio.sleep(min(self.config.poll_s, deadline.remaining()))
                continue
            if outcome == "refused" and refusal.code not in _TRANSIENT:
                raise RejectedInput(
                    f"round {round}: the leader refused us: {refusal.reason}", peer=endpoint
                )
            formed_without_us |= outcome == "refused" and refusal.code == "formed"
            tried.add(endpoint)
        raise RoundAborted(f"round {round}: no group formed before the deadline")

    async def _unreachable(self, candidates: list[_Candidate], deadline: Deadline) -> set[str]:
        """The endpoints among the first few ``candidates`` that do not answer a TLS
        handshake within ``first_contact_s``, all tried at once: a listener that never
        answers costs this once, not a call timeout per candidate. (Endpoints reached
        before answer at once.)"""
        batch = candidates[:_PROBED]
        if not batch:
            return set()
        wait = Deadline.after(min(self.config.first_contact_s, max(deadline.remaining(), 0.0)))

        async def reach(endpoint: str) -> str | None:
            try:
                await self.client.open(endpoint, wait)
            except RpcError as exc:
                logger.info("leader candidate %s is out of reach: %s", endpoint, exc)
                return endpoint
            return None

        gone = await asyncio.gather(*(reach(c.endpoint) for c in batch))
        return {endpoint for endpoint in gone if endpoint is not None}

    async def _join(
        self, endpoint: str, me: pb.MemberDeclaration, deadline: Deadline
    ) -> pb.JoinResponse | None:
        """Ask the leader at ``endpoint`` for the group; None if it cannot be reached."""
        request = pb.JoinRequest(member=me)
        self._following[me.round] = endpoint
        # A leader answers once its gathering window closes; twice that window is as long
        # as an honest leader can take, whatever the round deadline.
        wait = Deadline.after(min(deadline.remaining(), 2 * self.config.gather_s))
        try:
            if self.faults is not None:
                data = await self.faults.outgoing(
                    "join", peer=endpoint, round=me.round, message=request.SerializeToString()
                )
                if data is None:  # dropped: the leader never hears of us, we never hear back
                    await asyncio.sleep(wait.remaining())
                    return None
            response = await self.client.call(endpoint, JOIN, request, timeout=wait, attempts=2)
        except (RpcError, FaultCut) as exc:
            logger.info("round %d: leader %s did not answer: %s", me.round, endpoint, exc)
            return None
        try:
            check_answer(response)
        except Rejection as rejection:
            self.rejections.record(rejection, endpoint)
            return None
        return response

    # -- leading -------------------------------------------------------------------------

    async def _lead(
        self,
        round: int,
        me: pb.MemberDeclaration,
        tried: set[str],
        deadline: Deadline,
        expected: int | None = None,
        strangers: int = 0,
    ) -> Group:
        cfg = self.config
        if expected is None:
            known = enough = cfg.max_group_size
        else:
            enough = min(cfg.max_group_size, expected + strangers)
            known = min(expected, enough)
        loop = asyncio.get_running_loop()
        gathering = _Gathering(
            round=round,
            me=me,
            numel=me.numel,
            block_size=me.block_size,
            declarations=[me],
            waiters={},
            joined=asyncio.Event(),
        )
        own = self._subnet(parse_endpoint(me.endpoint)[0]) if me.endpoint else None
        if own is not None:
            gathering.subnets[own] += 1
        self._leading[round] = gathering
        self._following.pop(round, None)
        if self.partners():
            # Say so: newcomers, whom this peer would never follow, find their way here.
            self._mark_formed(round, 1, forget=False)
        window_closes = close_at = loop.time() + min(cfg.gather_s, deadline.remaining())
        try:
            if known <= 1:
                # Expecting nobody: still give way to a peer ahead of us (it may count on
                # us), rather than split the round in two.
                await self._give_way(gathering, me, tried, deadline)
            while len(gathering.declarations) < enough:
                if len(gathering.declarations) >= known and close_at == window_closes:
                    # Everyone we know joined: strangers get a short grace, not the window.
                    # Progress claims under many keys cost nothing and would fill every
                    # stranger's place, holding each group for the whole window.
                    close_at = min(close_at, loop.time() + cfg.stranger_grace_s)
                left = close_at - loop.time()
                if left <= 0:
                    break
                gathering.joined.clear()
                try:
                    async with asyncio.timeout(min(left, cfg.poll_s)):
                        await gathering.joined.wait()
                    continue
                except TimeoutError:
                    pass
                await self._give_way(gathering, me, tried, deadline)
            joined = len(gathering.declarations)
            if joined >= cfg.max_group_size:
                why = "the group is full"
            elif joined >= enough:
                why = f"the {enough} peer(s) expected joined"
            elif close_at < window_closes:
                why = (
                    f"its {known} known peer(s) joined, {joined - known} of {strangers} "
                    f"stranger(s) within the {cfg.stranger_grace_s:g} s grace"
                )
            else:
                why = "its gathering window closed"
            group = self._close(gathering, why)
        finally:
            gathering.closed = True
            self._leading.pop(round, None)
            for waiter in gathering.waiters.values():
                if not waiter.done():
                    waiter.set_result(_refused("formed", "the leader stopped gathering"))
        if group.size > 1:
            self._mark_formed(round, group.size)
        return group

    def _mark_formed(self, round: int, size: int, *, forget: bool = True) -> None:
        """Say in our ``round/<r>`` entry that the round's group formed with ``size``
        members, or with ``size`` 1 that this peer gathers it now (in the background: the
        exchange does not wait for it). A peer coming later does not lead a second group of
        a formed round with other latecomers; a newcomer asks a gathering leader."""
        entry = self._entries.get(round)
        if entry is None:
            return
        key, value = round_key(self.swarm_id, round), {**entry, "formed": size}

        async def store() -> None:
            try:
                await self.dht.store(key, value, ttl=self.config.announce_ttl_s)
            except Exception as exc:  # a lost marker costs at most a split, never the round
                logger.info("round %d: could not mark the group %s: %s", round, size, exc)
            finally:
                if forget:
                    self.dht.forget_published(key, self.identity.peer_id_hex)

        task = asyncio.get_running_loop().create_task(store())
        self._marking.add(task)
        task.add_done_callback(self._marking.discard)

    def _subnet(self, host: str) -> str | None:
        return subnet_of(host, limit_private=self.config.limit_private_subnets) if host else None

    def _alone(self, round: int, me: pb.MemberDeclaration) -> Group:
        cfg = self.config
        if cfg.min_group_size > 1:
            raise RoundAborted(
                f"round {round}: no serving peer to average with (client mode), at least "
                f"{cfg.min_group_size} members needed"
            )
        logger.info("round %d: no serving peer in sight (client mode): a group of one", round)
        info = single_group(me, os.urandom(NONCE_BYTES))
        return check_group(
            info,
            me=me,
            swarm_id=self.swarm_id,
            cap_multiple=cfg.weight_cap_multiple,
            admission=self.admission,
        )

    async def _give_way(
        self,
        gathering: _Gathering,
        me: pb.MemberDeclaration,
        tried: set[str],
        deadline: Deadline,
    ) -> None:
        """Hand the gathering over (raising _Handover) to a serving peer of the round ahead
        of us in the order of leadership and not tried yet; return if there is none."""
        candidates, _ = await self._candidates(gathering.round, me, deadline)
        ahead = [c for c in candidates if c.endpoint not in tried]
        if ahead:
            self._hand_over(gathering, ahead[0].endpoint)
            raise _Handover(ahead[0].endpoint)

    def _hand_over(self, gathering: _Gathering, endpoint: str) -> None:
        logger.info("round %d: handing the group over to %s", gathering.round, endpoint)
        gathering.closed = True
        for waiter in gathering.waiters.values():
            if not waiter.done():
                waiter.set_result(pb.JoinResponse(redirect=endpoint))

    def _close(self, gathering: _Gathering, why: str) -> Group:
        cfg = self.config
        gathering.closed = True
        info, struck = build_group(
            gathering.declarations,
            round=gathering.round,
            numel=gathering.numel,
            block_size=gathering.block_size,
            nonce=os.urandom(NONCE_BYTES),
        )
        ids = [_peer_of(d) for d in gathering.declarations]
        for index, reason in struck.items():
            self.rejections.record(Rejection("bad-weight", reason), ids[index])
            waiter = gathering.waiters.get(ids[index])
            if waiter is not None and not waiter.done():
                waiter.set_result(_refused("bad-weight", reason))
        if 0 in struck:
            # Our own weight is no weight (a bug of ours): no group of ours, and the others have not
            # missed one. They move on to the next leader in order (or lead).
            for waiter in gathering.waiters.values():
                if not waiter.done():
                    waiter.set_result(
                        _refused("stepped-down", "the leader's own weight was struck")
                    )
            raise RejectedInput(f"round {gathering.round}: our own declaration: {struck[0]}")
        size = len(gathering.declarations) - len(struck)
        if info is None or size < cfg.min_group_size:
            reason = (
                f"{size} member(s) gathered in round {gathering.round}, at least "
                f"{cfg.min_group_size} needed"
            )
            for waiter in gathering.waiters.values():
                if not waiter.done():
                    waiter.set_result(_refused("too-few", reason))
            raise _TooFew(reason)
        for waiter in gathering.waiters.values():
            if not waiter.done():
                waiter.set_result(pb.JoinResponse(group=info))
        logger.info("round %d: formed a group of %d (%s)", gathering.round, size, why)
        return check_group(
            info,
            me=gathering.me,
            swarm_id=self.swarm_id,
            cap_multiple=cfg.weight_cap_multiple,
            admission=self.admission,
        )

    async def handle_join(
        self, request: pb.JoinRequest, context: grpc.aio.ServicerContext
    ) -> pb.JoinResponse:
        """A follower asks us to lead it; answered when gathering is over."""
        declaration = request.member
        gathering = self._leading.get(declaration.round)
        if gathering is None or gathering.closed:
            following = self._following.get(declaration.round)
            if following:
                return pb.JoinResponse(redirect=following)
            if gathering is None and declaration.round not in self._finished:
                return _refused("not-leading", "this peer leads no group for that round (yet)")
            return _refused("formed", "the group of that round is already formed")
        try:
            member = check_declaration(
                declaration,
                swarm_id=self.swarm_id,
                round=gathering.round,
                numel=gathering.numel,
                block_size=gathering.block_size,
                now_ms=int(self.clock() * 1000),
                max_age_ms=int(self.config.max_declaration_age_s * 1000),
                admission=self.admission,
            )
        except Rejection as rejection:
            self.rejections.record(rejection, context.peer())
            release_after(request.ByteSize())
            return _refused(rejection.code, rejection.reason)
        if member.peer_id == self.identity.peer_id_hex:
            return _refused("bad-declaration", "that is the leader's own declaration")
        waiter = gathering.waiters.get(member.peer_id)
        if waiter is None and self.peer_records and not await self._announced(member):
            unknown = Rejection(
                "no-record",
                f"peer {member.peer_id[:12]} has no signed record in the swarm's peer list "
                f"at {member.endpoint or 'no endpoint'} (peers announce themselves before "
                "they average; a key that never did is not taken into a group)",
            )
            self.rejections.record(unknown, context.peer())
            return _refused(unknown.code, unknown.reason)
        if gathering.closed:  # while the peer list was read
            return _refused("formed", "the group of that round is already formed")
        waiter = gathering.waiters.get(member.peer_id)
        if waiter is None:
            if len(gathering.declarations) >= self.config.max_group_size:
                return _refused("full", "the group is full")
            host = host_of_grpc_peer(context.peer())
            subnet = self._subnet(host)
            if (
                subnet is not None
                and gathering.subnets[subnet] >= self.config.max_members_per_subnet
            ):
                full = Rejection(
                    "subnet-full",
                    f"the group already has {gathering.subnets[subnet]} members from {subnet}",
                )
                self.rejections.record(full, host)
                return _refused(full.code, full.reason)
            waiter = asyncio.get_running_loop().create_future()
            gathering.waiters[member.peer_id] = waiter
            gathering.declarations.append(declaration)
            if subnet is not None:
                gathering.subnets[subnet] += 1
                gathering.subnet_of[member.peer_id] = subnet
            gathering.joined.set()
        try:
            return await asyncio.shield(waiter)
        except asyncio.CancelledError:
            # The follower gave up (its deadline, its cancel): keep it out of the group.
            if not gathering.closed and not waiter.done():
                del gathering.waiters[member.peer_id]
                gathering.declarations = [
                    d for d in gathering.declarations if _peer_of(d) != member.peer_id
                ]
                left = gathering.subnet_of.pop(member.peer_id, None)
                if left is not None:
                    gathering.subnets[left] -= 1
            raise

    async def _announced(self, member: Member) -> bool:
        """Whether ``member`` announced itself in the swarm's peer list at the endpoint it
        declares. Unknown keys make the list be read again, at most once per second
        however many ask (one read serves them all), waiting at most 5 s for it."""
        if self._records.get(member.peer_id) == member.endpoint:
            return True
        await self._reread_records(Deadline.after(_RECORDS_WAIT_S), wait=True)
        return self._records.get(member.peer_id) == member.endpoint

    async def _reread_records(self, deadline: Deadline, *, wait: bool = False) -> bool:
        """Read the swarm's peer list again, at most once per second however many ask (one
        read serves them all), waiting at most 5 s (and ``deadline``) for it; whether it
        was read. ``wait``: if it was read less than a second ago, read it once the second
        is over (a key may have announced itself since) instead of not at all."""
        loop = asyncio.get_running_loop()
        early = self._records_read_at + _RECORDS_REREAD_S - loop.time()
        if early > 0 and not wait:
            return False
        if self._reading_records is None or self._reading_records.done():
            self._reading_records = loop.create_task(self._read_records(max(early, 0.0)))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(
                asyncio.shield(self._reading_records), deadline.timeout(_RECORDS_WAIT_S)
            )
        return self._reading_records.done()

    async def _read_records(self, after: float = 0.0) -> None:
        if after > 0:
            await asyncio.sleep(after)  # the once-a-second limit on reading the list
        try:
            peers = await find_peers(self.dht, self.swarm_id)
        except Exception as exc:  # a DHT read that fails keeps the list as it was
            logger.info("could not read the swarm's peer list: %s", exc)
            return
        finally:
            self._records_read_at = asyncio.get_running_loop().time()
        self._records = {p.peer_id: p.endpoint for p in peers}


def check_answer(response: pb.JoinResponse) -> None:
    """Refuse a leader's answer whose strings are longer than any honest one: a redirect
    is followed and handed to others, a refusal's reason ends up in our logs and errors.
    (A group's declarations are checked by ``check_group``.)"""
    outcome = response.WhichOneof("outcome")
    if outcome == "redirect":
        # Sizes before contents: reading a string field copies it, however long.
        if response.ByteSize() > 4 * MAX_ENDPOINT_CHARS + 8:
            raise Rejection("malformed", "the leader redirects to more than an endpoint")
        try:
            parse_endpoint(response.redirect)
        except ValueError:
            raise Rejection(
                "malformed", f"the leader redirects to {response.redirect[:80]!r}, not HOST:PORT"
            ) from None
    elif outcome == "refused" and (
        response.refused.ByteSize() > 4 * (MAX_CODE_CHARS + MAX_REASON_CHARS) + 16
        or len(response.refused.code) > MAX_CODE_CHARS
        or len(response.refused.reason) > MAX_REASON_CHARS
    ):
        raise Rejection(
            "malformed",
            f"the leader's refusal ({response.refused.ByteSize()} bytes) is longer than a "
            f"code of {MAX_CODE_CHARS} and a reason of {MAX_REASON_CHARS} characters",
        )


def _refused(code: str, reason: str) -> pb.JoinResponse:
    return pb.JoinResponse(refused=pb.Refusal(code=code, reason=reason))


def _peer_of(declaration: pb.MemberDeclaration) -> str:
    return peer_id_of(declaration.public_key).hex()
