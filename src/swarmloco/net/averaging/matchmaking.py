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
import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable, Collection, Iterable, Sequence

import grpc

from swarmloco.core.config import require, require_int, require_non_negative, require_positive
from swarmloco.errors import RejectedInput, RoundAborted
from swarmloco.net.admission import Gate
from swarmloco.net.averaging.announcing import RoundEntries
from swarmloco.net.averaging.candidates import (
    Candidate,
    formed_marked,
    leader_candidates,
    leader_rank,
    servers,
)
from swarmloco.net.averaging.faults import FaultPlan
from swarmloco.net.averaging.following import JOIN, Leaders, check_answer
from swarmloco.net.averaging.group import (
    NONCE_BYTES,
    Group,
    check_group,
    sign_declaration,
    single_group,
)
from swarmloco.net.averaging.leading import Gathering, TooFew, closing_reason, refused
from swarmloco.net.averaging.peerlist import PeerList
from swarmloco.net.client import RpcClient
from swarmloco.net.deadline import Deadline
from swarmloco.net.dht.node import DHTNode, Entry
from swarmloco.net.endpoints import host_of_grpc_peer, parse_endpoint, source_network, subnet_of
from swarmloco.net.heap import release_after
from swarmloco.net.identity import Identity
from swarmloco.net.records import round_key
from swarmloco.net.rejections import Rejection, RejectionLog
from swarmloco.proto.v1 import averaging_pb2 as pb

__all__ = ["JOIN", "Matchmaker", "MatchmakingConfig", "check_answer", "leader_rank"]

logger = logging.getLogger(__name__)

_MAX_REDIRECTS = 8
DEMOTED_S = 3600.0
"""How long a partner proven two-faced in a round, or that alone aborted one, is taken as a
stranger."""
OUT_OF_LINE_S = 600.0
"""How long a partner out of line with most of the servers of a round that aborted is
taken as a stranger: the next attempts (members that send different results to different
members can put honest servers there too, so it is short; they still average, as
clients)."""
MAX_DEMOTED = 4096
# Refusals after which asking again (elsewhere) makes sense; the others are final.
_TRANSIENT = frozenset({"not-leading", "formed", "full", "subnet-full", "stepped-down"})


class _Held:
    """Keys held until a time (``time.monotonic()``), at most ``kept`` of them (the
    oldest forgotten first): a demoted partner, a barred network."""

    def __init__(self, kept: int) -> None:
        self._until: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._kept = kept

    def __contains__(self, key: object) -> bool:
        return key in self._until

    def hold(self, key: str, until: float) -> None:
        """Hold ``key`` until ``until``, or longer if it is held so already."""
        self._until[key] = max(until, self._until.get(key, until))
        self._until.move_to_end(key)
        while len(self._until) > self._kept:
            self._until.popitem(last=False)

    def live(self, now: float) -> Collection[str]:
        """The keys still held at ``now`` (the others forgotten)."""
        for key in [k for k, until in self._until.items() if until <= now]:
            del self._until[key]
        return self._until.keys()


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
    max_strangers: int = 2
    """Members a leader with partners takes besides them in one group (they serve no part
    and give no verdict); more are refused (``strangers-full``) and download the result."""
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
        require_int("max_strangers", self.max_strangers, minimum=0)
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


class _Handover(Exception):
    """Internal: the gathering leader found a peer ahead of it at ``endpoint``."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(endpoint)
        self.endpoint = endpoint


@dataclasses.dataclass
class _Search:
    """A follower's search for its leader in one round."""

    round: int
    me: pb.MemberDeclaration
    deadline: Deadline
    expected: int | None
    strangers: int
    tried: set[str] = dataclasses.field(default_factory=set)
    formed_without_us: bool = False
    not_leading: dict[str, float] = dataclasses.field(default_factory=dict)
    """Since when each leader refused us as not leading (yet)."""
    redirects: int = 0
    next_endpoint: str | None = None
    unserved_since: float | None = None
    """Client mode: since when no leader is in sight."""
    failed_leaders: set[str] = dataclasses.field(default_factory=set)
    """Candidates that did not answer our Join."""
    ids: dict[str, str] = dataclasses.field(default_factory=dict)
    """The peer id of each candidate asked, by endpoint."""
    lead_now: bool = False
    """A candidate behind us in the order follows us: lead without asking anyone else."""


def targets(expected: int | None, strangers: int, max_size: int) -> tuple[int, int]:
    """How many members a leader gathers at most (``enough``), and after how many (the
    peers it knows of: ``known``) the strangers get only a short grace."""
    if expected is None:
        return max_size, max_size
    enough = min(max_size, expected + strangers)
    return enough, min(expected, enough)


def check_arguments(weight: float, expected: int | None, strangers: int, norm: float) -> None:
    """ValueError unless :meth:`Matchmaker.form_group`'s numbers make sense."""
    if not (isinstance(weight, (int, float)) and math.isfinite(weight) and weight > 0):
        raise ValueError(f"weight must be a finite positive number, got {weight!r}")
    if expected is not None and (not isinstance(expected, int) or expected < 1):
        raise ValueError(f"expected must be a positive number of peers, got {expected!r}")
    if not isinstance(strangers, int) or isinstance(strangers, bool) or strangers < 0:
        raise ValueError(f"strangers must be a number of peers >= 0, got {strangers!r}")
    if not (isinstance(norm, (int, float)) and math.isfinite(norm) and norm >= 0):
        raise ValueError(f"norm must be a finite number >= 0, got {norm!r}")


class Matchmaker:
    """Forms this peer's group for each round. Constructing does no I/O.

    The composition of matchmaking's parts: the round's entries (``announcing.py``), whom
    to follow (``candidates.py``), the calls to leaders (``following.py``), a gathering
    when this peer leads (``leading.py``) and the swarm's peer list (``peerlist.py``).
    """

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
        self.dht = dht
        self.client = client
        self.swarm_id = swarm_id
        self.config = cfg = config or MatchmakingConfig()
        self.faults = faults
        self.clock = clock
        self.rejections = RejectionLog(logger)
        self.peers = PeerList(dht=dht, swarm_id=swarm_id)
        self.entries = RoundEntries(
            dht=dht, swarm_id=swarm_id, owner=identity.peer_id_hex, ttl_s=cfg.announce_ttl_s
        )
        self.leaders = Leaders(client=client, rejections=self.rejections, faults=faults, config=cfg)
        self._leading: dict[int, Gathering] = {}
        self._following: dict[int, str] = {}
        self._formed: collections.deque[int] = collections.deque(maxlen=64)
        """Rounds whose last attempt here ended in a group of more than this peer."""
        self._came_late: collections.deque[int] = collections.deque(maxlen=64)
        self._lonely: collections.deque[int] = collections.deque(maxlen=64)
        """Rounds this peer led and gathered too few in (it follows anyone then)."""
        self._demoted = _Held(MAX_DEMOTED)
        """Partners taken as strangers for a while (:meth:`demote`)."""
        self._grouped: collections.OrderedDict[int, frozenset[str]] = collections.OrderedDict()
        """The members of this peer's last group of each recent round."""
        self._networks: collections.OrderedDict[str, str] = collections.OrderedDict()
        """The source network each server of this peer's recent groups served from (peer
        -> network of its endpoint there), at most ``MAX_DEMOTED``."""
        self._own_network: str | None = None
        self._barred = _Held(MAX_DEMOTED)
        """Networks of partners demoted for ``DEMOTED_S``: their other partners are
        strangers here as long too."""

    async def close(self) -> None:
        """End what matchmaking runs in the background (a formed group's marker being
        stored, a read of the peer list): before the DHT node and its client close."""
        await self.entries.close()
        await self.peers.close()

    def demote(
        self,
        peers: Iterable[str],
        seconds: float = DEMOTED_S,
        why: str = "was two-faced in a round, or alone disagreed with every other server",
        *,
        network: bool = True,
    ) -> None:
        """Take ``peers`` as strangers for ``seconds`` (or longer, if already so): each was
        proven two-faced, or was the lone server whose verdict or digest differed from every
        other server's, in a round that aborted here (``RoundAborted.dissenters``), or
        (``OUT_OF_LINE_S``) out of line with most of them (``RoundAborted.out_of_line``), or
        was caught lying by this peer's audits (``AllReduceReport.liars``).
        This peer follows them no more, and makes them clients of the groups it leads:
        partners turned liars cannot abort every attempt at a round, however long they stay
        partners while no round applies. With ``network``, every partner last seen serving
        from the source network of one of ``peers`` is a stranger as long (this peer's own
        network excepted): keys of one machine abort one attempt, not one each."""
        until = time.monotonic() + seconds
        for peer in peers:
            logger.warning(
                "peer %s %s: taken as a stranger (a client of this peer's groups) for %.0f s",
                peer[:12],
                why,
                seconds,
            )
            self._demoted.hold(peer, until)
            where = self._networks.get(peer)
            if network and where is not None and where != self._own_network:
                if where not in self._barred:
                    logger.warning(
                        "the other partners serving from %s (the network of %s) are "
                        "strangers here for %.0f s too",
                        where,
                        peer[:12],
                        seconds,
                    )
                self._barred.hold(where, until)

    def aborted(self, exc: RoundAborted) -> None:
        """A round of this peer aborted with ``exc``: the servers proven two-faced in it, or
        the lone server that aborted it, are strangers for ``DEMOTED_S``, the others out of
        line with most servers for ``OUT_OF_LINE_S`` (clients of the next attempts)."""
        self.demote(exc.dissenters)
        self.demote(
            exc.out_of_line - exc.dissenters,
            OUT_OF_LINE_S,
            why="was out of line with most servers of a round",
            network=False,  # members lying to some can put honest servers there
        )

    def _partners(self) -> set[str]:
        """The partners this peer follows and lets serve: its partners, less those it
        demoted (:meth:`demote`) and those last seen serving from a network it barred with
        them, until their time is up."""
        now = time.monotonic()
        demoted, barred = self._demoted.live(now), self._barred.live(now)
        return {
            p for p in self.partners() if p not in demoted and self._networks.get(p) not in barred
        }

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
        ranges: Sequence[tuple[int, int, int, int]] = (),
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
        multiple of the median declared norm. ``ranges``: the pinned dataset's sequences
        this peer's update completes (``dataset/ledger.py``), declared to the group.
        """
        check_arguments(weight, expected, strangers, norm)
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
            ranges=ranges,
        )
        announced_at = self.clock()  # shown to others, never trusted (see leader_rank)
        # A round tried again (the last attempt aborted) is not formed: followers asking
        # now should wait for this attempt's gathering, not give up on us.
        if round in self._formed:
            self._formed = collections.deque(
                (r for r in self._formed if r != round), maxlen=self._formed.maxlen
            )
        try:
            await self.entries.announce(me, announced_at, deadline)
            group = await self._find_group(_Search(round, me, deadline, expected, strangers))
        finally:
            self.entries.forget(round)
            self._following.pop(round, None)
        if group.size > 1:
            self._formed.append(round)
        self._grouped[round] = frozenset(m.peer_id for m in group.members)
        while len(self._grouped) > 64:
            self._grouped.popitem(last=False)
        self._learn_networks(group)
        return group

    def _learn_networks(self, group: Group) -> None:
        """Keep the network each server of ``group`` serves from (a member with an
        endpoint: the others reach it there, its key checked, so it is not a claim)."""
        for member in group.members:
            if not member.endpoint:
                continue
            try:
                host = parse_endpoint(member.endpoint)[0]
            except ValueError:
                continue
            network = source_network(host, limit_private=self.config.limit_private_subnets)
            if member.peer_id == self.identity.peer_id_hex:
                self._own_network = network
                continue
            self._networks[member.peer_id] = network
            self._networks.move_to_end(member.peer_id)
        while len(self._networks) > MAX_DEMOTED:
            self._networks.popitem(last=False)

    async def formed_without_us(self, round: int, numel: int) -> bool:
        """Whether ``round``'s group formed without this peer, as the round's entries say
        now. A leader whose group aborted announces the round again, without the mark: a
        peer that came late stops waiting for a result that will not come."""
        result = await self.dht.get(round_key(self.swarm_id, round))
        return self._formed_marked(round, numel, result.entries.values())

    # -- finding the leader ------------------------------------------------------------

    def _formed_marked(self, round: int, numel: int, entries: Iterable[Entry]) -> bool:
        return formed_marked(
            entries,
            mine=self.identity.peer_id_hex,
            numel=numel,
            ours=self._grouped.get(round, frozenset()),
            partners=self._partners(),
        )

    async def _candidates(
        self, round: int, me: pb.MemberDeclaration, deadline: Deadline
    ) -> tuple[list[Candidate], bool]:
        """The serving peers of this round and vector size this peer may follow, in the
        order it asks them (all of them if it cannot lead); and whether a leader says the
        round's group formed (without us: a group we were in does not count). See
        ``candidates.py`` for whom a peer follows."""
        key = round_key(self.swarm_id, round)
        timeout = max(min(deadline.remaining(), self.dht.config.lookup_timeout_s), 0.01)
        result = await self.dht.get(key, timeout=timeout)
        mine = self.identity.peer_id_hex
        formed = self._formed_marked(round, me.numel, result.entries.values())
        partners = self._partners()
        entries = servers(result.entries.values(), mine=mine, numel=me.numel, partners=partners)
        records = self.peers.endpoints if self.peer_records else None
        if records is not None and any(
            records.get(e.subkey) != e.value["endpoint"] for e in entries
        ):
            await self.peers.reread(deadline)
            records = self.peers.endpoints
        found = leader_candidates(
            entries,
            swarm_id=self.swarm_id,
            round=round,
            mine=mine,
            serving=bool(me.endpoint),
            partners=partners,
            lonely=round in self._lonely,
            records=records,
        )
        return found, formed

    async def _find_group(self, search: _Search) -> Group:
        while not search.deadline.expired:
            if search.next_endpoint is None:
                group = await self._without_leader(search)
                if group is not None:
                    return group
                if search.next_endpoint is None:
                    continue
            endpoint, search.next_endpoint = search.next_endpoint, None
            self._following[search.round] = endpoint
            response = await self.leaders.join(endpoint, search.me, search.deadline)
            if response is None:
                search.failed_leaders.add(endpoint)
                search.tried.add(endpoint)
                continue
            group = await self._answered(search, endpoint, response)
            if group is not None:
                return group
        raise RoundAborted(f"round {search.round}: no group formed before the deadline")

    async def _without_leader(self, search: _Search) -> Group | None:
        """Pick the next leader to ask (``search.next_endpoint``); with none left, lead (a
        serving peer), average alone or wait (a client-mode peer), or give way to the
        group that formed before we came."""
        round, me, deadline, tried = search.round, search.me, search.deadline, search.tried
        candidates, formed = await self._candidates(round, me, deadline)
        search.formed_without_us |= formed
        untried = [c for c in candidates if c.endpoint not in tried]
        if len(search.failed_leaders) >= self.config.stranger_leaders and not self._partners():
            untried = []  # enough strangers failed us: lead (or wait) instead
        if search.lead_now and me.endpoint:
            untried = []
        tried |= await self.leaders.unreachable(untried, deadline)
        untried = [c for c in untried if c.endpoint not in tried]
        if untried:
            search.unserved_since = None
            search.next_endpoint = untried[0].endpoint
            search.ids[untried[0].endpoint] = untried[0].peer_id
            return None
        if search.formed_without_us and round not in self._came_late:
            # A peer ahead of us already formed this round's group: leading another with
            # whoever else came late would split the swarm's state in two. Once per round:
            # a leader that only says so (a liar, or a group that aborted) costs one
            # attempt, not the round.
            self._came_late.append(round)
            raise RoundAborted(
                f"round {round}: its group formed before this peer came; "
                "catching up with it instead",
                late=True,
            )
        if me.endpoint:
            try:
                return await self._lead(search)
            except _Handover as handover:
                search.next_endpoint = handover.endpoint
                search.lead_now = False
                return None
            except TooFew as lonely:
                self._lonely.append(round)
                raise RoundAborted(str(lonely)) from None
        # A client-mode peer cannot lead. When no serving peer it can reach shows up for a
        # whole gathering window, it averages alone, as a leader nobody joined would.
        now = time.monotonic()
        if search.unserved_since is None:
            search.unserved_since = now
        if now - search.unserved_since >= self.config.gather_s:
            return self._alone(round, me)
        await asyncio.sleep(min(self.config.poll_s, deadline.remaining()))
        return None

    async def _answered(
        self, search: _Search, endpoint: str, response: pb.JoinResponse
    ) -> Group | None:
        """Act on a leader's answer: the group, or where to ask next (None)."""
        round, me = search.round, search.me
        outcome = response.WhichOneof("outcome")
        if outcome == "group":
            try:
                return self._checked(response.group, me)
            except Rejection as rejection:
                self.rejections.record(rejection, endpoint)
                raise RoundAborted(
                    f"round {round}: the leader at {endpoint} sent an invalid group "
                    f"({rejection.reason})"
                ) from None
        if outcome == "redirect" and me.endpoint and response.redirect == me.endpoint:
            # The peer we asked follows us: two peers with nobody else to follow (each of
            # them led the round and gathered too few, say) asked each other. The one ahead
            # in the order of leadership leads; the other asks it again until it does.
            asked = search.ids.get(endpoint)
            if asked is not None and self._ahead_of(round, asked):
                search.lead_now = True
                return None
            await self._wait_for_leader(search, endpoint)
            return None
        if outcome == "redirect" and search.redirects < _MAX_REDIRECTS:
            search.redirects += 1
            self._following[round] = response.redirect
            search.next_endpoint = response.redirect
            return None
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
            await self._wait_for_leader(search, endpoint)
            return None
        if outcome == "refused" and refusal.code not in _TRANSIENT:
            raise RejectedInput(
                f"round {round}: the leader refused us: {refusal.reason}", peer=endpoint
            )
        search.formed_without_us |= outcome == "refused" and refusal.code == "formed"
        search.tried.add(endpoint)
        return None

    async def _wait_for_leader(self, search: _Search, endpoint: str) -> None:
        """``endpoint`` does not lead us yet: ask again after a poll, for a gathering
        window at most (then it counts as tried)."""
        since = search.not_leading.setdefault(endpoint, time.monotonic())
        if time.monotonic() - since > self.config.gather_s:
            search.tried.add(endpoint)
        await asyncio.sleep(min(self.config.poll_s, search.deadline.remaining()))

    def _ahead_of(self, round: int, peer_id: str) -> bool:
        """Whether this peer stands before ``peer_id`` in ``round``'s order of leadership."""
        mine = leader_rank(self.swarm_id, round, self.identity.peer_id_hex)
        return mine < leader_rank(self.swarm_id, round, peer_id)

    def _alone(self, round: int, me: pb.MemberDeclaration) -> Group:
        cfg = self.config
        if cfg.min_group_size > 1:
            raise RoundAborted(
                f"round {round}: no serving peer to average with (client mode), at least "
                f"{cfg.min_group_size} members needed"
            )
        logger.info("round %d: no serving peer in sight (client mode): a group of one", round)
        return self._checked(single_group(me, os.urandom(NONCE_BYTES)), me)

    def _checked(self, info: pb.GroupInfo, me: pb.MemberDeclaration) -> Group:
        """The group ``info`` describes, checked as every member checks it."""
        return check_group(
            info,
            me=me,
            swarm_id=self.swarm_id,
            cap_multiple=self.config.weight_cap_multiple,
            admission=self.admission,
            max_clients_taken=self.config.max_strangers,
        )

    # -- leading -------------------------------------------------------------------------

    async def _lead(self, search: _Search) -> Group:
        cfg = self.config
        round, me, deadline = search.round, search.me, search.deadline
        enough, known = targets(search.expected, search.strangers, cfg.max_group_size)
        gathering = Gathering(
            me=me,
            own_subnet=self._subnet(parse_endpoint(me.endpoint)[0]) if me.endpoint else None,
            swarm_id=self.swarm_id,
            admission=self.admission,
            rejections=self.rejections,
            config=cfg,
            partners=frozenset(self._partners()),
        )
        self._leading[round] = gathering
        self._following.pop(round, None)
        if self._partners():
            # Say so: newcomers, whom this peer would never follow, find their way here.
            self.entries.mark_formed(round, 1, forget=False)
        window_closes = asyncio.get_running_loop().time() + min(cfg.gather_s, deadline.remaining())
        try:
            if known <= 1:
                # Expecting nobody: still give way to a peer ahead of us (it may count on
                # us), rather than split the round in two.
                await self._give_way(gathering, search)
            close_at = await gathering.wait(
                enough, known, window_closes, give_way=lambda: self._give_way(gathering, search)
            )
            why = closing_reason(
                len(gathering.declarations),
                enough=enough,
                known=known,
                strangers=search.strangers,
                graced=close_at < window_closes,
                config=cfg,
            )
            group = gathering.close(why)
        finally:
            gathering.closed = True
            self._leading.pop(round, None)
            gathering.answer_all(self._not_gathering(round))
        if group.size > 1:
            self.entries.mark_formed(round, group.size)
        return group

    def _subnet(self, host: str) -> str | None:
        return subnet_of(host, limit_private=self.config.limit_private_subnets) if host else None

    async def _give_way(self, gathering: Gathering, search: _Search) -> None:
        """Hand the gathering over (raising _Handover) to a serving peer of the round ahead
        of us in the order of leadership and not tried yet; return if there is none."""
        candidates, _ = await self._candidates(gathering.round, search.me, search.deadline)
        own = leader_rank(self.swarm_id, gathering.round, self.identity.peer_id_hex)
        # Ahead in the order, or gathering now: never one behind us that we would follow
        # only because we are lonely (it may be following us).
        ahead = [
            c
            for c in candidates
            if c.endpoint not in search.tried and (c.rank < own or c.gathering)
        ]
        if ahead:
            gathering.hand_over(ahead[0].endpoint)
            raise _Handover(ahead[0].endpoint)

    def _not_gathering(self, round: int) -> pb.JoinResponse:
        """The answer to a follower of ``round`` while this peer gathers no group for it:
        "formed" only when a group of more than this peer formed (the follower came late
        and takes that group's result); otherwise it has not led yet, or its attempt ended
        alone or aborted and it will try again: "not-leading", and the follower asks again
        or leads. (A "formed" for an attempt that aborted sent two peers, each refused by
        the other, to wait for a result neither would publish.)"""
        if round in self._formed:
            return refused("formed", "the group of that round is already formed")
        return refused("not-leading", "this peer leads no group for that round now")

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
            return self._not_gathering(declaration.round)
        host = host_of_grpc_peer(context.peer())
        network = source_network(host, limit_private=self.config.limit_private_subnets)
        try:
            member = gathering.check(declaration, now_ms=int(self.clock() * 1000), network=network)
        except Rejection as rejection:
            self.rejections.record(rejection, context.peer())
            release_after(request.ByteSize())
            return refused(rejection.code, rejection.reason)
        if member.peer_id == self.identity.peer_id_hex:
            return refused("bad-declaration", "that is the leader's own declaration")
        if member.peer_id not in gathering.waiters and self.peer_records:
            unknown = await self.peers.unannounced(member.peer_id, member.endpoint)
            if unknown is not None:
                self.rejections.record(unknown, context.peer())
                return refused(unknown.code, unknown.reason)
        if gathering.closed:  # while the peer list was read
            return self._not_gathering(declaration.round)
        waiter = gathering.admit(declaration, member.peer_id, self._subnet(host), host)
        if isinstance(waiter, pb.JoinResponse):
            return waiter
        try:
            return await asyncio.shield(waiter)
        except asyncio.CancelledError:
            gathering.withdraw(member.peer_id, waiter)
            raise
