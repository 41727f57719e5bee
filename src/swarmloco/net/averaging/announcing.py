"""This peer's ``round/<r>`` entries: announced when it looks for a group, marked when it
gathers one or the group formed, forgotten when the round is over.

A marked entry tells later peers what happened: ``formed: 1`` that its leader gathers the
group now (newcomers, whom peers with partners never follow, find their way there), a
larger ``formed`` that the round's group formed with that many members (a peer coming
later does not lead a second group of the round with other latecomers). Marks are stored in
the background: the exchange does not wait for them, and a lost mark costs at most a split,
never the round.
"""

from __future__ import annotations

import asyncio
import logging

from swarmloco.errors import RoundAborted
from swarmloco.net.deadline import Deadline
from swarmloco.net.dht.node import DHTNode
from swarmloco.net.records import round_key
from swarmloco.proto.v1 import averaging_pb2 as pb

# Matchmaking's events: one logger for all of it.
logger = logging.getLogger("swarmloco.net.averaging.matchmaking")


class RoundEntries:
    """The entries this peer announced, per round it is forming a group for."""

    def __init__(self, *, dht: DHTNode, swarm_id: str, owner: str, ttl_s: float) -> None:
        """``owner``: this peer's id (hex), the subkey of its entries."""
        self._dht = dht
        self._swarm_id = swarm_id
        self._owner = owner
        self._ttl_s = ttl_s
        self._entries: dict[int, dict[str, object]] = {}
        self._marking: set[asyncio.Task[None]] = set()

    async def announce(
        self, me: pb.MemberDeclaration, announced_at: float, deadline: Deadline
    ) -> None:
        """Announce this peer as ready for ``me.round``; RoundAborted past ``deadline``."""
        value = {
            "endpoint": me.endpoint,
            "weight": float(me.weight),
            "bandwidth": float(me.bandwidth),
            "client_mode": not me.endpoint,
            "announced_at": announced_at,
            "numel": me.numel,
        }
        self._entries[me.round] = value
        key = round_key(self._swarm_id, me.round)
        try:
            async with asyncio.timeout(deadline.remaining()):
                await self._dht.store(key, value, ttl=self._ttl_s)
        except TimeoutError:
            raise RoundAborted(f"round {me.round}: announcing took past the deadline") from None

    def forget(self, round: int) -> None:
        """The round is over for us: stop republishing its entry (it lives out its TTL)."""
        self._dht.forget_published(round_key(self._swarm_id, round), self._owner)
        self._entries.pop(round, None)

    async def close(self) -> None:
        """End the markers still being stored (cancelled and waited for): the DHT node
        and its client are about to close."""
        tasks = list(self._marking)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def mark_formed(self, round: int, size: int, *, forget: bool = True) -> None:
        """Say in our entry that the round's group formed with ``size`` members, or with
        ``size`` 1 that this peer gathers it now (in the background)."""
        entry = self._entries.get(round)
        if entry is None:
            return
        key, value = round_key(self._swarm_id, round), {**entry, "formed": size}

        async def store() -> None:
            try:
                await self._dht.store(key, value, ttl=self._ttl_s)
            except Exception as exc:  # a lost marker costs at most a split, never the round
                logger.info("round %d: could not mark the group %s: %s", round, size, exc)
            finally:
                if forget:
                    self._dht.forget_published(key, self._owner)

        task = asyncio.get_running_loop().create_task(store())
        self._marking.add(task)
        task.add_done_callback(self._marking.discard)
