"""Reading a swarm's records from the DHT, once (:func:`read_swarm`) or every few seconds
(:class:`Collector`), and keeping the latest view and a bounded history for the dashboard.

The collector survives the network going away: a failed poll keeps the last records (their
ages keep growing, so peers turn offline on time), puts the error in the view and, when no
DHT node answered at all, joins the network again through the peers it was given.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from swarmloco.core.config import require_int, require_positive
from swarmloco.core.manifest import SwarmManifest
from swarmloco.dashboard.view import (
    FRESH_S,
    HISTORY_POINTS,
    History,
    Reading,
    anchors_of,
    build_view,
    current_round,
    roster,
    stage_count,
)
from swarmloco.errors import ManifestError, NetworkError, SwarmlocoError
from swarmloco.net.admission import reader_gate
from swarmloco.net.dht.node import DHTNode, GetResult
from swarmloco.net.records import (
    digest_key,
    partners_key,
    peers_key,
    progress_key,
    stage_load_key,
    status_key,
)
from swarmloco.net.swarm import fetch_manifest
from swarmloco.pipeline.load import Vouching, fresh, stage_load
from swarmloco.pipeline.manifest import stage_manifest

logger = logging.getLogger(__name__)

Clock = Callable[[], float]


@dataclasses.dataclass(frozen=True, kw_only=True)
class CollectorConfig:
    interval_s: float = 2.0
    """Seconds between two polls of the DHT."""
    fresh_s: float = FRESH_S
    """A peer whose status record is older than this is shown offline."""
    timeout_s: float = 5.0
    """Deadline of each DHT lookup of one poll."""
    history_points: int = HISTORY_POINTS
    """Points kept per loss curve."""
    trust: tuple[str, ...] = ()
    """Peer ids (hex) whose word on whom they averaged with the figures rely on, besides
    the swarm's creator (docs/SECURITY.md, "What the dashboard counts")."""

    def __post_init__(self) -> None:
        require_positive("interval_s", self.interval_s)
        require_positive("fresh_s", self.fresh_s)
        require_positive("timeout_s", self.timeout_s)
        require_int("history_points", self.history_points, minimum=1)
        check_peer_ids(self.trust)


def check_peer_ids(peers: Sequence[str]) -> tuple[str, ...]:
    """``peers`` as peer ids in lower-case hex; ValueError naming the first that is not."""
    for peer in peers:
        if not re.fullmatch(r"[0-9a-fA-F]{40}", peer):
            raise ValueError(
                f"{peer!r} is not a peer id (40 hex digits; a peer's log names its id when it "
                "starts training)"
            )
    return tuple(peer.lower() for peer in peers)


def _values(result: GetResult) -> dict[str, Mapping[str, Any]]:
    return {subkey: entry.value for subkey, entry in result.entries.items()}


def _guard(dht: DHTNode, swarm_id: str, manifest: SwarmManifest | None) -> None:
    """A private swarm's dashboard shows its members only, a public run that asks for
    proofs of work its proven keys only: guard the node's reads."""
    if manifest is None or dht.guards(swarm_id):
        return
    gate = reader_gate(manifest, swarm_id)
    if gate is not None:
        dht.admit(gate)


async def read_swarm(
    dht: DHTNode,
    swarm_id: str,
    *,
    manifest: SwarmManifest | None,
    timeout_s: float = 5.0,
    fresh_s: float = FRESH_S,
    clock: Clock = time.time,
    trust: Sequence[str] = (),
    remembered: Iterable[str] = (),
    vouching: Vouching | None = None,
) -> Reading:
    """One poll: the swarm's peers, progress, status and partners records (and a
    pipelined run's ``stage-load`` records, with ``vouching`` those whose servers vouch
    for them), then the digests of the current round of the peers that count (``trust``
    and ``remembered``: :func:`~swarmloco.dashboard.view.roster`).
    Raises NetworkError when no DHT node answered."""
    if manifest is None:
        manifest = await _try_manifest(dht, swarm_id)
    _guard(dht, swarm_id, manifest)  # before the reads: a private swarm's show members only
    async with asyncio.TaskGroup() as group:
        status_task = group.create_task(dht.get(status_key(swarm_id), timeout=timeout_s))
        progress_task = group.create_task(dht.get(progress_key(swarm_id), timeout=timeout_s))
        peers_task = group.create_task(dht.get(peers_key(swarm_id), timeout=timeout_s))
        partners_task = group.create_task(dht.get(partners_key(swarm_id), timeout=timeout_s))
        stages_task = stage0_task = None
        if stage_count(manifest):
            stages_task = group.create_task(dht.get(stage_load_key(swarm_id), timeout=timeout_s))
        stage0 = _readers_swarm(manifest)
        if stage0 is not None:  # a pipelined run's readers say the dataset's epoch there
            stage0_task = group.create_task(dht.get(status_key(stage0), timeout=timeout_s))
    results = [status_task.result(), progress_task.result(), peers_task.result()]
    if all(result.responded == 0 and not result.entries for result in results):
        raise NetworkError(
            "no DHT node answered: the peers the dashboard joined through may be down (retrying)"
        )
    reading = Reading(
        swarm_id=swarm_id,
        at=clock(),
        manifest=manifest,
        peers=_values(results[2]),
        progress=_values(results[1]),
        status=_values(results[0]),
        partners=_values(partners_task.result()),
        stage_loads={} if stages_task is None else _values(stages_task.result()),
        stage_status={} if stage0_task is None else _values(stage0_task.result()),
    )
    if vouching is not None and reading.stage_loads:
        reading = dataclasses.replace(
            reading, vouched=await _vouched(reading, vouching, fresh_s=fresh_s)
        )
    whose = roster(reading, anchors=anchors_of(manifest, trust), remembered=remembered)
    round_now = current_round(whose.only(reading.status), now=reading.at, fresh_s=fresh_s)
    if round_now is None:
        return reading
    found = await dht.get(digest_key(swarm_id, round_now), timeout=timeout_s)
    digests = {subkey: entry.value["digest"] for subkey, entry in found.entries.items()}
    return dataclasses.replace(reading, digest_round=round_now, digests=digests)


def _readers_swarm(manifest: SwarmManifest | None) -> str | None:
    """The swarm of a pipelined run's stage 0, when the run is on a pinned dataset (its
    peers read it, and say its epoch in their status records); None otherwise, or when
    the manifest's stages cannot be read (the stages' pools say so)."""
    if manifest is None or not stage_count(manifest) or manifest.data.get("source") != "dataset":
        return None
    try:
        return stage_manifest(manifest, 0).swarm_id
    except SwarmlocoError:
        return None


async def _vouched(reading: Reading, vouching: Vouching, *, fresh_s: float) -> frozenset[str]:
    """The owners of the reading's fresh ``stage-load`` records that ``vouching`` counts."""
    loads = []
    for peer_id, value in reading.stage_loads.items():
        try:
            loads.append(stage_load(peer_id, value))
        except (KeyError, TypeError, ValueError):
            continue  # (the DHT checked the schema: nothing of the kind is expected)
    counted = await vouching.counted(fresh(loads, reading.at, within=fresh_s))
    return frozenset(load.peer for load in counted)


async def _try_manifest(dht: DHTNode, swarm_id: str) -> SwarmManifest | None:
    try:
        return await fetch_manifest(dht, swarm_id)
    except ManifestError:
        return None


class Collector:
    """Polls one swarm's records every ``config.interval_s`` and keeps the latest view.

    Construct it, then run :meth:`run` as a task of the application's task group (cancel
    it to stop). :attr:`view` is always a complete view, from the start on.
    """

    def __init__(
        self,
        *,
        dht: DHTNode,
        swarm_id: str,
        manifest: SwarmManifest | None = None,
        rejoin: Sequence[str] = (),
        config: CollectorConfig | None = None,
        clock: Clock | None = None,
        vouching: Vouching | None = None,
    ) -> None:
        """``clock``: what records' ages are judged by (default: the node's, the swarm's
        time); ``vouching``: which of a pipelined run's ``stage-load`` records its pools
        count (None: all of them; answers are kept from poll to poll)."""
        self.dht = dht
        self.vouching = vouching
        self.swarm_id = swarm_id
        self.config = config or CollectorConfig()
        self.history = History(points=self.config.history_points)
        self.polls = 0
        self.failures = 0
        self._rejoin = tuple(rejoin)
        self._clock = clock or dht.clock
        self._manifest = manifest
        self._reading = Reading(
            swarm_id=swarm_id, at=self._clock(), manifest=manifest, error="not read yet"
        )
        self._view = self._build()

    @property
    def view(self) -> dict[str, Any]:
        """The view of the latest poll (or of the last good one, with the error)."""
        return self._view

    def _build(self) -> dict[str, Any]:
        return build_view(
            self._reading,
            now=self._clock(),
            history=self.history,
            fresh_s=self.config.fresh_s,
        )

    async def poll(self) -> dict[str, Any]:
        """Read the records once and return the new view (never raises for network errors)."""
        self.polls += 1
        try:
            reading = await read_swarm(
                self.dht,
                self.swarm_id,
                manifest=self._manifest,
                timeout_s=self.config.timeout_s,
                fresh_s=self.config.fresh_s,
                clock=self._clock,
                trust=self.config.trust,
                remembered=self.history.remembered,
                vouching=self.vouching,
            )
        except Exception as exc:  # the network or a peer misbehaving: keep the last records
            self.failures += 1
            error = str(exc) or type(exc).__name__
            if error != self._reading.error:
                logger.warning("reading swarm %s failed: %s", self.swarm_id[:12], error)
            self._reading = dataclasses.replace(self._reading, error=error)
            if isinstance(exc, NetworkError) and self._rejoin:
                await self._join_again()
        else:
            if self._reading.error and self.polls > 1:
                logger.info("reading swarm %s works again", self.swarm_id[:12])
            self._manifest = reading.manifest
            self._reading = reading
            self.history.add(reading, fresh_s=self.config.fresh_s, trust=self.config.trust)
        self._view = self._build()
        return self._view

    async def _join_again(self) -> None:
        try:
            await self.dht.join(self._rejoin, timeout=self.config.timeout_s)
        except NetworkError as exc:
            logger.debug("joining again failed: %s", exc)
        else:
            logger.info("joined the network again through %s", ", ".join(self._rejoin))

    async def run(self) -> None:
        """Poll forever, ``interval_s`` apart (start to start when polls are fast)."""
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            await self.poll()
            await asyncio.sleep(max(0.0, self.config.interval_s - (loop.time() - started)))
