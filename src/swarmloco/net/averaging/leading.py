"""The leader's side of matchmaking: one round's gathering, the followers' declarations
and the answer each of them waits for.

A follower's ``Join`` is a long poll: it is answered once gathering is over, with the same
group for every member, with the reason it was left out (a weight out of bounds, too few
members), or with a redirect when the leader hands the group over to a peer ahead of it.
A leader takes at most ``max_group_size`` members, and at most ``max_members_per_subnet``
calling from one /24 (IPv4) or /64 (IPv6), itself included, so that one operator cannot
fill a group with keys of its own. A follower that gives up is taken out again.

A leader with partners (peers it averaged with lately) takes at most ``max_strangers``
others besides them, counts only its partners towards the peers it expects (keys are
cheap: strangers that come first must not close the group before the partners are in),
and makes its strangers clients of the group: they send their update and receive the
result, but reduce no part and give no verdict (``group.py``, ``verdicts.py``).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from swarmloco.errors import RejectedInput
from swarmloco.net.admission import Gate
from swarmloco.net.averaging.group import (
    NONCE_BYTES,
    Group,
    Member,
    build_group,
    check_declaration,
    check_group,
)
from swarmloco.net.identity import peer_id_of
from swarmloco.net.rejections import Rejection, RejectionLog
from swarmloco.proto.v1 import averaging_pb2 as pb

if TYPE_CHECKING:
    from swarmloco.net.averaging.matchmaking import MatchmakingConfig

# Matchmaking's events: one logger for all of it.
logger = logging.getLogger("swarmloco.net.averaging.matchmaking")


class TooFew(Exception):
    """The group this peer led gathered fewer than ``min_group_size``."""


def refused(code: str, reason: str) -> pb.JoinResponse:
    return pb.JoinResponse(refused=pb.Refusal(code=code, reason=reason))


def peer_of(declaration: pb.MemberDeclaration) -> str:
    return peer_id_of(declaration.public_key).hex()


def closing_reason(
    joined: int,
    *,
    enough: int,
    known: int,
    strangers: int,
    graced: bool,
    config: MatchmakingConfig,
) -> str:
    """Why a leader stopped gathering with ``joined`` members (for the log); ``graced``:
    the strangers had a grace shorter than the gathering window."""
    if joined >= config.max_group_size:
        return "the group is full"
    if joined >= enough:
        return f"the {enough} peer(s) expected joined"
    if graced:
        return (
            f"its {known} known peer(s) joined, {joined - known} of {strangers} "
            f"stranger(s) within the {config.stranger_grace_s:g} s grace"
        )
    return "its gathering window closed"


class Gathering:
    """A round this peer leads: the declarations so far and each follower's answer."""

    def __init__(
        self,
        *,
        me: pb.MemberDeclaration,
        own_subnet: str | None,
        swarm_id: str,
        admission: Gate | None,
        rejections: RejectionLog,
        config: MatchmakingConfig,
        partners: frozenset[str] = frozenset(),
    ) -> None:
        """``partners``: the leader's (none: every member counts alike and may serve)."""
        self.round = me.round
        self.partners = partners
        self.strangers = 0
        """Members admitted that are not the leader's partners (counted with partners)."""
        self.me = me
        self.numel = me.numel
        self.block_size = me.block_size
        self._swarm_id = swarm_id
        self._admission = admission
        self._rejections = rejections
        self._config = config
        self.declarations: list[pb.MemberDeclaration] = [me]
        self.waiters: dict[str, asyncio.Future[pb.JoinResponse]] = {}
        self.joined = asyncio.Event()
        """Set by every new member (the leader clears it before it waits)."""
        self.subnets: collections.Counter[str] = collections.Counter()
        """Members per subnet (exempt addresses are not counted)."""
        if own_subnet is not None:
            self.subnets[own_subnet] += 1
        self._subnet_of: dict[str, str] = {}
        """Each follower's subnet, by peer id."""
        self.closed = False

    def check(self, declaration: pb.MemberDeclaration, *, now_ms: int, network: str = "") -> Member:
        """The member a follower's declaration names, if it may join this gathering (signed,
        of this round and vector, recent, admitted); Rejection otherwise. ``network``: the
        follower's source network."""
        return check_declaration(
            declaration,
            swarm_id=self._swarm_id,
            round=self.round,
            numel=self.numel,
            block_size=self.block_size,
            now_ms=now_ms,
            max_age_ms=int(self._config.max_declaration_age_s * 1000),
            admission=self._admission,
            network=network,
        )

    async def wait(
        self,
        enough: int,
        known: int,
        window_closes: float,
        *,
        give_way: Callable[[], Awaitable[None]],
    ) -> float:
        """Wait for followers until ``enough`` joined or gathering closes (on the loop's
        clock: at ``window_closes``, or ``stranger_grace_s`` after the ``known`` peers
        joined); every ``poll_s`` without a newcomer, ``give_way`` to a leader ahead of us
        (it raises to hand over). Returns when gathering closed."""
        grace_s, poll_s = self._config.stranger_grace_s, self._config.poll_s
        loop = asyncio.get_running_loop()
        close_at = window_closes
        wanted = enough - known  # strangers worth gathering besides the known peers
        while True:
            if self.partners:  # the known peers are partners; strangers count up to wanted
                known_in = len(self.declarations) - self.strangers
                joined = known_in + min(self.strangers, wanted)
            else:
                known_in = joined = len(self.declarations)
            if joined >= enough or len(self.declarations) >= self._config.max_group_size:
                break
            if known_in >= known and close_at == window_closes:
                # Everyone we know joined: strangers get a short grace, not the window.
                # Progress claims under many keys cost nothing and would fill every
                # stranger's place, holding each group for the whole window.
                close_at = min(close_at, loop.time() + grace_s)
            left = close_at - loop.time()
            if left <= 0:
                break
            self.joined.clear()
            try:
                async with asyncio.timeout(min(left, poll_s)):
                    await self.joined.wait()
                continue
            except TimeoutError:
                pass
            await give_way()
        return close_at

    def admit(
        self, declaration: pb.MemberDeclaration, peer_id: str, subnet: str | None, host: str
    ) -> asyncio.Future[pb.JoinResponse] | pb.JoinResponse:
        """The answer a checked declaration waits for, or the refusal it gets at once."""
        waiter = self.waiters.get(peer_id)
        if waiter is not None:
            return waiter
        if len(self.declarations) >= self._config.max_group_size:
            return refused("full", "the group is full")
        stranger = bool(self.partners) and peer_id not in self.partners
        if stranger and self.strangers >= self._config.max_strangers:
            full = Rejection(
                "strangers-full",
                f"the group already has {self.strangers} member(s) the leader never averaged with",
            )
            self._rejections.record(full, host)
            return refused(full.code, full.reason)
        if subnet is not None and self.subnets[subnet] >= self._config.max_members_per_subnet:
            full = Rejection(
                "subnet-full", f"the group already has {self.subnets[subnet]} members from {subnet}"
            )
            self._rejections.record(full, host)
            return refused(full.code, full.reason)
        waiter = asyncio.get_running_loop().create_future()
        self.waiters[peer_id] = waiter
        self.declarations.append(declaration)
        self.strangers += stranger
        if subnet is not None:
            self.subnets[subnet] += 1
            self._subnet_of[peer_id] = subnet
        self.joined.set()
        return waiter

    def withdraw(self, peer_id: str, waiter: asyncio.Future[pb.JoinResponse]) -> None:
        """The follower gave up (its deadline, its cancel): keep it out of the group."""
        if self.closed or waiter.done():
            return
        del self.waiters[peer_id]
        self.declarations = [d for d in self.declarations if peer_of(d) != peer_id]
        self.strangers -= bool(self.partners) and peer_id not in self.partners
        left = self._subnet_of.pop(peer_id, None)
        if left is not None:
            self.subnets[left] -= 1

    def answer_all(self, response: pb.JoinResponse) -> None:
        """Answer every follower still waiting."""
        for waiter in self.waiters.values():
            if not waiter.done():
                waiter.set_result(response)

    def hand_over(self, endpoint: str) -> None:
        logger.info("round %d: handing the group over to %s", self.round, endpoint)
        self.closed = True
        self.answer_all(pb.JoinResponse(redirect=endpoint))

    def close(self, why: str) -> Group:
        """Form the group of everyone gathered and answer them all; RejectedInput when our
        own declaration is struck, :class:`TooFew` with fewer than ``min_group_size``."""
        min_size = self._config.min_group_size
        self.closed = True
        ids = [peer_of(d) for d in self.declarations]
        strangers = [i for i in range(1, len(ids)) if self.partners and ids[i] not in self.partners]
        info, struck = build_group(
            self.declarations,
            round=self.round,
            numel=self.numel,
            block_size=self.block_size,
            nonce=os.urandom(NONCE_BYTES),
            clients=strangers,
        )
        for index, reason in struck.items():
            self._rejections.record(Rejection("bad-weight", reason), ids[index])
            waiter = self.waiters.get(ids[index])
            if waiter is not None and not waiter.done():
                waiter.set_result(refused("bad-weight", reason))
        if 0 in struck:
            # Our own weight is no weight (a bug of ours): no group of ours, and the others
            # have not missed one. They move on to the next leader in order (or lead).
            self.answer_all(refused("stepped-down", "the leader's own weight was struck"))
            raise RejectedInput(f"round {self.round}: our own declaration: {struck[0]}")
        size = len(self.declarations) - len(struck)
        if info is None or size < min_size:
            reason = f"{size} member(s) gathered in round {self.round}, at least {min_size} needed"
            self.answer_all(refused("too-few", reason))
            raise TooFew(reason)
        self.answer_all(pb.JoinResponse(group=info))
        logger.info("round %d: formed a group of %d (%s)", self.round, size, why)
        return check_group(
            info,
            me=self.me,
            swarm_id=self._swarm_id,
            cap_multiple=self._config.weight_cap_multiple,
            admission=self._admission,
            max_clients_taken=self._config.max_strangers,
        )
