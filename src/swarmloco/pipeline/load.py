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
import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from swarmloco.net.dht.node import DHTNode
from swarmloco.net.records import stage_load_key

logger = logging.getLogger(__name__)

LOAD_TTL_S = 60.0
"""How long a replica's record lives unless refreshed."""
FRESH_S = 20.0
"""A record older than this says nothing of the replica any more (it may be gone)."""


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
    )


async def publish_load(
    dht: DHTNode, swarm_id: str, *, stage: int, endpoint: str, load: Mapping[str, Any]
) -> None:
    """Store this replica's record (``load``: its rate, queue and free slots, its stage's
    round when it has one, its skipped steps, refused calls and the replicas its audits
    distrust when it says them)."""
    value = {
        "stage": stage,
        "endpoint": endpoint,
        "rate": float(load["rate"]),
        "queue": int(load["queue"]),
        "free": int(load["free"]),
        "at": float(dht.clock()),
    }
    for optional in ("round", "skipped", "refused", "distrusted"):
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
) -> None:
    """Read the run's records every ``interval_s`` and hand the fresh ones to ``update``
    (a driver's) until cancelled."""
    while True:
        try:
            update(fresh(await read_loads(dht, swarm_id), dht.clock()))
        except Exception as exc:
            logger.warning("could not read the stages' load: %s", exc)
        await asyncio.sleep(interval_s)
