"""The swarm's peer list as matchmaking reads it: each announced peer's endpoint, by peer id.

Where a swarm's peers announce themselves in its signed ``peers`` record, a leader takes
into its group only keys that did, at the endpoint they declare, and a follower asks only
such peers to lead it. A key not in the list (yet) makes the list be read again, at most
once per second however many ask: one read serves them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math

from swarmloco.net.deadline import Deadline
from swarmloco.net.dht.node import DHTNode
from swarmloco.net.rejections import Rejection
from swarmloco.net.swarm import find_peers

# Matchmaking's events: one logger for all of it.
logger = logging.getLogger("swarmloco.net.averaging.matchmaking")

REREAD_S = 1.0  # how often the list may be read again for an unknown key
WAIT_S = 5.0  # how long a caller waits for that read


class PeerList:
    """The endpoints of the swarm's announced peers, as last read from the DHT."""

    def __init__(self, *, dht: DHTNode, swarm_id: str) -> None:
        self._dht = dht
        self._swarm_id = swarm_id
        self.endpoints: dict[str, str] = {}
        """Each announced peer's endpoint, by peer id."""
        self._read_at = -math.inf
        self._reading: asyncio.Task[None] | None = None

    async def announced(self, peer_id: str, endpoint: str) -> bool:
        """Whether ``peer_id`` announced itself at ``endpoint``. An unknown key makes the
        list be read again, waiting at most ``WAIT_S`` for it."""
        if self.endpoints.get(peer_id) == endpoint:
            return True
        await self.reread(Deadline.after(WAIT_S), wait=True)
        return self.endpoints.get(peer_id) == endpoint

    async def unannounced(self, peer_id: str, endpoint: str) -> Rejection | None:
        """Why ``peer_id`` is not taken into a group (None: it announced itself there)."""
        if await self.announced(peer_id, endpoint):
            return None
        return Rejection(
            "no-record",
            f"peer {peer_id[:12]} has no signed record in the swarm's peer list "
            f"at {endpoint or 'no endpoint'} (peers announce themselves before "
            "they average; a key that never did is not taken into a group)",
        )

    async def reread(self, deadline: Deadline, *, wait: bool = False) -> bool:
        """Read the list again, at most once per second however many ask, waiting at most
        ``WAIT_S`` (and ``deadline``) for it; whether it was read. ``wait``: if it was read
        less than a second ago, read it once the second is over (a key may have announced
        itself since) instead of not at all."""
        loop = asyncio.get_running_loop()
        early = self._read_at + REREAD_S - loop.time()
        if early > 0 and not wait:
            return False
        if self._reading is None or self._reading.done():
            self._reading = loop.create_task(self._read(max(early, 0.0)))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._reading), deadline.timeout(WAIT_S))
        return self._reading.done()

    async def close(self) -> None:
        """End a read still running (it outlives the callers that stopped waiting)."""
        reading, self._reading = self._reading, None
        if reading is not None and not reading.done():
            reading.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reading

    async def _read(self, after: float = 0.0) -> None:
        if after > 0:
            await asyncio.sleep(after)  # the once-a-second limit on reading the list
        try:
            peers = await find_peers(self._dht, self._swarm_id)
        except Exception as exc:  # a DHT read that fails keeps the list as it was
            logger.info("could not read the swarm's peer list: %s", exc)
            return
        finally:
            self._read_at = asyncio.get_running_loop().time()
        self.endpoints = {p.peer_id: p.endpoint for p in peers}
