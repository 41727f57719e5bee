"""Where each stage's replicas serve and how fast: the ``stage-load`` records of a
pipelined run (``docs/DESIGN.md`` section 10, "Choosing the next hop").

Every replica publishes its own record every few seconds (:func:`publish_load`): its
stage, endpoint, rate (sequences per second of its compute), queue and free slots, signed
by its key. Drivers read them (:func:`read_loads`) and hand the fresh ones to
:meth:`~swarmloco.pipeline.driver.Driver.update`, which makes them the replicas it draws
from. A record is a claim: a driver caps a claimed rate at the best it measured itself,
so a replica that claims to be fast is tried, not believed.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

from swarmloco.errors import NetworkError
from swarmloco.net.dht.contact import Contact
from swarmloco.net.dht.node import DHTNode
from swarmloco.net.endpoints import endpoint_network
from swarmloco.net.records import stage_load_key

logger = logging.getLogger(__name__)

LOAD_TTL_S = 60.0
"""How long a replica's record lives unless refreshed."""
FRESH_S = 20.0
"""A record older than this says nothing of the replica any more (it may be gone)."""
VOUCHED_S = 600.0
"""How long a server's answer that its record's key serves at its endpoint is kept."""
UNVOUCHED_S = 120.0
"""How long an endpoint whose server answered as another key is not asked again."""
SILENT_S = 20.0
"""How long an endpoint where nothing answered is not asked again (a replica busy or
briefly away is counted again soon)."""
VOUCH_TIMEOUT_S = 3.0
"""How long a server has to answer who it is."""
VOUCH_ASKED = 64
"""Servers asked at one read at most (the others at the next reads)."""
VOUCH_KEPT = 4096
"""Answers kept at most (the oldest go first)."""
MOVER_SERVED_S = 1200.0
"""A move announced (a record with no endpoint) counts when its key's server vouched for
a record here this recently: an answer is kept :data:`VOUCHED_S`, and a move (draining,
the new stage's download, its first measurements) may take minutes more."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageLoad:
    """What one replica says of itself."""

    peer: str
    stage: int
    endpoint: str
    rate: float
    """Sequences per second of its compute, recently (0: not measured yet)."""
    queue: int
    """Micro-batches held between forward and backward, and forwards waiting."""
    free: int
    """More micro-batches it takes before it refuses as busy."""
    at: float
    """Swarm time (unix seconds) when it said so."""
    round: int | None = None
    """The round its stage's state is at (None: not said)."""
    skipped: int = 0
    """Steps it did not take since it began serving (their gradient was not finite)."""
    refused: int = 0
    """Calls it refused since then, other than as busy (what a caller sent was bad)."""
    distrusted: int = 0
    """(A stage-0 peer.) Replicas of later stages its audits found answering wrong, which
    it does not draw now."""
    drivers: int = 0
    """(A later stage.) Drivers' sessions open with it now."""
    orphaned: int = 0
    """(A later stage.) Micro-batches of drivers gone since it began serving: dropped at
    their deadline or at their session's end, or not taken."""


def stage_load(peer: str, value: Mapping[str, Any]) -> StageLoad:
    """A validated ``stage-load`` value (as a DHT get returns it)."""
    return StageLoad(
        peer=peer,
        stage=int(value["stage"]),
        endpoint=str(value["endpoint"]),
        rate=float(value["rate"]),
        queue=int(value["queue"]),
        free=int(value["free"]),
        at=float(value["at"]),
        round=int(value["round"]) if "round" in value else None,
        skipped=int(value.get("skipped", 0)),
        refused=int(value.get("refused", 0)),
        distrusted=int(value.get("distrusted", 0)),
        drivers=int(value.get("drivers", 0)),
        orphaned=int(value.get("orphaned", 0)),
    )


async def publish_load(
    dht: DHTNode, swarm_id: str, *, stage: int, endpoint: str, load: Mapping[str, Any]
) -> None:
    """Store this replica's record (``load``: its rate, queue and free slots, its stage's
    round when it has one, its skipped steps, refused calls, the replicas its audits
    distrust, its drivers' sessions and their micro-batches orphaned when it says them)."""
    value = {
        "stage": stage,
        "endpoint": endpoint,
        "rate": float(load["rate"]),
        "queue": int(load["queue"]),
        "free": int(load["free"]),
        "at": float(dht.clock()),
    }
    for optional in ("round", "skipped", "refused", "distrusted", "drivers", "orphaned"):
        if load.get(optional) is not None:
            value[optional] = int(load[optional])
    await dht.store(stage_load_key(swarm_id), value, ttl=LOAD_TTL_S)


async def read_loads(dht: DHTNode, swarm_id: str) -> list[StageLoad]:
    """Every replica's record of the run (checked by the DHT: schema and signature)."""
    result = await dht.get(stage_load_key(swarm_id))
    return [stage_load(e.subkey, e.value) for e in result.entries.values()]


def fresh(loads: Iterable[StageLoad], now: float, *, within: float = FRESH_S) -> list[StageLoad]:
    """The records said in the last ``within`` seconds of ``now`` (none from the future)."""
    return [load for load in loads if 0.0 <= now - load.at <= within]


async def read_counted(
    dht: DHTNode, swarm_id: str, vouching: Vouching | None = None
) -> list[StageLoad]:
    """The run's fresh records, only those ``vouching`` counts when it is given."""
    loads = fresh(await read_loads(dht, swarm_id), dht.clock())
    return loads if vouching is None else await vouching.counted(loads)


async def keep_publishing(
    dht: DHTNode,
    swarm_id: str,
    *,
    stage: int,
    endpoint: str,
    load: Callable[[], Mapping[str, Any]],
    interval_s: float,
) -> None:
    """Publish this replica's record every ``interval_s`` until cancelled; a store that
    fails is tried again at the next interval (the network may be away for a while)."""
    while True:
        try:
            await publish_load(dht, swarm_id, stage=stage, endpoint=endpoint, load=load())
        except Exception as exc:
            logger.warning("could not publish this replica's load: %s", exc)
        await asyncio.sleep(interval_s)


async def keep_reading(
    dht: DHTNode,
    swarm_id: str,
    update: Callable[[list[StageLoad]], None],
    *,
    interval_s: float,
    vouching: Vouching | None = None,
) -> None:
    """Read the run's records every ``interval_s`` and hand the fresh ones to ``update``
    (a driver's) until cancelled: only those their servers vouch for, with ``vouching``."""
    while True:
        try:
            update(await read_counted(dht, swarm_id, vouching))
        except Exception as exc:
            logger.warning("could not read the stages' load: %s", exc)
        await asyncio.sleep(interval_s)


class Vouching:
    """Which records a server vouches for: a record counts (drawn by a driver, counted in
    rebalancing) once the server at its endpoint answered, with its own checked card, as
    the record's key (``who_serves``: :meth:`~swarmloco.net.node.NetNode.who_serves`).
    A record is a claim anyone can publish for any address; a server that answers is
    first-hand, costs a real server per address, and no key can borrow another's (its
    card names its own key): a stranger's record naming an honest replica's address under
    another stage would have that replica refuse the driver and be shunned.
    This peer's own record is not asked about. A record with no endpoint announces a move
    (its peer serves no stage while it moves): it counts only when the peer's server
    vouched for an earlier record of its key here, within :data:`MOVER_SERVED_S` (a move
    is made by a replica that served; a key that never did announces nothing), and a
    record with no endpoint that claims a rate never counts (nothing serves there to
    measure or to ask).

    Answers are kept :data:`VOUCHED_S` (another key's :data:`UNVOUCHED_S`, silence
    :data:`SILENT_S`); a read
    asks at most :data:`VOUCH_ASKED` servers, at once, one network after another (so that
    many records of one network do not keep the others waiting), and counts a record not
    asked yet from the read that asks."""

    def __init__(
        self,
        who_serves: Callable[[str, float], Awaitable[Contact]],
        me: str,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.who_serves = who_serves
        self.me = me
        self.clock = clock
        self._known: collections.OrderedDict[tuple[str, str], tuple[bool, float]] = (
            collections.OrderedDict()
        )
        """(peer, endpoint): whether its server vouched for it, and until when that holds."""
        self._served: collections.OrderedDict[str, float] = collections.OrderedDict()
        """Peer -> when its server last vouched for a record of its key here."""

    def _answer(self, key: tuple[str, str], now: float) -> bool | None:
        known = self._known.get(key)
        return None if known is None or known[1] <= now else known[0]

    async def counted(self, loads: Sequence[StageLoad]) -> list[StageLoad]:
        """Of ``loads``, those whose server vouched for them (see the class)."""
        now = self.clock()
        asked: dict[str, list[tuple[str, str]]] = collections.defaultdict(list)
        for load in loads:
            key = (load.peer, load.endpoint)
            if not load.endpoint or load.peer == self.me or self._answer(key, now) is not None:
                continue
            network = asked[endpoint_network(load.endpoint)]
            if key not in network:
                network.append(key)
        # One of each network in turn, up to the read's share.
        turns = itertools.chain.from_iterable(itertools.zip_longest(*asked.values()))
        batch = [key for key in turns if key is not None][:VOUCH_ASKED]
        if batch:
            await asyncio.gather(*(self._ask(peer, endpoint) for peer, endpoint in batch))
        now = self.clock()
        return [load for load in loads if self._counts(load, now)]

    def _counts(self, load: StageLoad, now: float) -> bool:
        if load.peer == self.me:
            return True
        if not load.endpoint:  # a move announced, by a replica that served here before
            served = self._served.get(load.peer)
            return load.rate == 0.0 and served is not None and now - served <= MOVER_SERVED_S
        return bool(self._answer((load.peer, load.endpoint), now))

    async def _ask(self, peer: str, endpoint: str) -> None:
        try:
            card = await asyncio.wait_for(
                self.who_serves(endpoint, VOUCH_TIMEOUT_S), VOUCH_TIMEOUT_S
            )
            vouched = card.peer_id.hex() == peer and card.endpoint == endpoint
            kept = VOUCHED_S if vouched else UNVOUCHED_S
        except (NetworkError, TimeoutError) as exc:
            logger.debug("%s did not vouch for %s: %s", endpoint, peer[:12], exc)
            vouched, kept = False, SILENT_S
        now = self.clock()
        _keep(self._known, (peer, endpoint), (vouched, now + kept))
        if vouched:
            _keep(self._served, peer, now)


def _keep(kept: collections.OrderedDict[Any, Any], key: Any, value: Any) -> None:
    """``kept[key] = value`` as the newest entry, the oldest dropped past :data:`VOUCH_KEPT`."""
    kept.pop(key, None)
    kept[key] = value
    while len(kept) > VOUCH_KEPT:
        kept.popitem(last=False)
