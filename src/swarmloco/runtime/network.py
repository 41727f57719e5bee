"""A peer's presence in its swarm: everything it does on the network, on its event loop.

:class:`SwarmNetwork` composes the layers of ``net/`` for one peer of one swarm: its node
(gRPC server, client and DHT), matchmaking and the all-reduce, the state donor, catch-up,
and the records it keeps publishing (``progress`` and ``status``, read back for pacing
and the dashboard; ``digest/<r>`` per round). Its coroutines run on the peer's event loop;
the training thread reaches them through the peer's :class:`LoopThread` bridge.

Constructing it does no I/O (a test builds one with a fault plan and hands it to the
peer); ``async with`` starts it: the node joins the network, the manifest is (re)published,
the peer announced, and the publishing loop (and the dashboard, if asked) starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from swarmloco.core.adoption import Evidence
from swarmloco.core.codec import (
    CodecConfig,
    Encoded,
    ErrorFeedback,
    encoded_norm,
    settle_backend,
)
from swarmloco.core.manifest import SwarmManifest
from swarmloco.core.pacing import ProgressReport
from swarmloco.core.state import StateSchema, StateSnapshot
from swarmloco.errors import RoundAborted, SwarmlocoError
from swarmloco.net.admission import Gate
from swarmloco.net.averaging import (
    AllReduceResult,
    Averager,
    AveragingConfig,
    BandwidthLimiter,
    FaultPlan,
    Matchmaker,
    MatchmakingConfig,
    averaging_service,
)
from swarmloco.net.deadline import Deadline
from swarmloco.net.dht.node import DHT_MESSAGE_BYTES
from swarmloco.net.identity import Identity
from swarmloco.net.node import NetNode, NodeConfig
from swarmloco.net.records import (
    FAREWELL_AT,
    MAX_PARTNERS,
    digest_key,
    partners_key,
    progress_key,
    progress_report,
    status_key,
)
from swarmloco.net.state import Requester, StateDonor, state_service
from swarmloco.net.swarm import announce_peer, publish_manifest, withdraw_peer
from swarmloco.runtime.catchup import CatchUp, trusted_peers
from swarmloco.runtime.config import PeerConfig

logger = logging.getLogger(__name__)

# Catch-up looks at recent rounds only (donors serve their latest state), and a DHT node
# keeps a bounded number of records per sender: a digest per round for an hour would crowd
# out the records that matter once rounds come every few seconds.
DIGEST_TTL_S = 300.0
PROGRESS_TTL_S = 120.0
ANNOUNCE_EVERY_S = 120.0
FAREWELL_S = 5.0  # at most this long to tell the swarm that the peer leaves

Provider = Callable[[], dict[str, Any]]


class SwarmNetwork:
    """One peer's node, averaging, donor, catch-up and records (see the module docstring)."""

    def __init__(
        self,
        *,
        identity: Identity,
        manifest: SwarmManifest,
        config: PeerConfig,
        averaging: AveragingConfig,
        schema: StateSchema,
        evidence: Evidence,
        faults: FaultPlan | None = None,
        admission: Gate | None = None,
    ) -> None:
        """``admission``: the gate of a private swarm (None: a public one)."""
        self.identity = identity
        self.admission = admission
        self.peer_id = identity.peer_id_hex
        self.manifest = manifest
        self.swarm_id = manifest.swarm_id
        self.config = config
        self.node = NetNode(identity=identity, config=receiving(config.node, averaging.codec))
        if admission is not None:
            self.node.dht.admit(admission)
        self.matchmaker = self._matchmaker(evidence, faults, admission)
        limiter = BandwidthLimiter(config.bandwidth) if config.bandwidth is not None else None
        self.averager = Averager(
            identity=identity,
            client=self.node.client,
            config=averaging,
            limiter=limiter,
            faults=faults,
            slots=self.node.server.slots if self.node.server is not None else None,
        )
        self.snapshot: Callable[[], StateSnapshot | None] = lambda: None
        """What the donor serves (the peer sets it before entering)."""
        self.previous_snapshot: Callable[[], StateSnapshot | None] = lambda: None
        """The snapshot before it, served to whoever asks for that round."""
        self.donor = self._donor(limiter, admission)
        if self.node.server is not None:
            self.node.server.add_service(averaging_service(self.matchmaker, self.averager))
            self.node.server.add_service(state_service(self.donor))
        self.catchup = self._catchup(schema, evidence, admission)
        self.progress: Provider = dict
        """This peer's ``progress`` value (set by the peer before entering)."""
        self.status: Provider = dict
        """This peer's ``status`` value (set by the peer before entering)."""
        self.on_dashboard: Callable[[str], None] = lambda url: None
        self._partners: list[str] = []
        self._partners_at = 0.0
        self.reports: list[ProgressReport] = []
        """Every peer's latest progress report, as last read (this peer's included)."""
        self.reads = 0
        """How often the progress reports were read since the network started."""
        self._read = threading.Condition()
        self.late: tuple[int, int] | None = None
        """(round, numel) of a round whose group formed without this peer (set by the peer
        from its own thread): the progress loop watches that round's entries."""
        self.late_marker: tuple[int, bool] | None = None
        """(round, whether the entries still mark its group formed), as last read."""
        self.late_marker_seen: int | None = None
        """The late round whose formed mark was read at least once."""
        self._wake: asyncio.Event | None = None
        self._tasks: list[asyncio.Task[None]] = []

    def _matchmaker(
        self, evidence: Evidence, faults: FaultPlan | None, admission: Gate | None
    ) -> Matchmaker:
        """Matchmaking for this peer, in the swarm's time and among the swarm's announced
        peers; once it has partners (``evidence``'s witnesses), only they may lead it."""
        return Matchmaker(
            identity=self.identity,
            dht=self.node.dht,
            client=self.node.client,
            swarm_id=self.swarm_id,
            config=matchmaking_config(self.config),
            faults=faults,
            admission=admission,
            peer_records=True,
            clock=self.node.dht.clock,  # declarations are dated in the swarm's time
            partners=lambda: evidence.witnesses.keys(),
        )

    def _donor(self, limiter: BandwidthLimiter | None, admission: Gate | None) -> StateDonor:
        """The donor of this peer's state: whatever ``snapshot`` and ``previous_snapshot``
        give when asked (the peer sets them after construction)."""
        return StateDonor(
            identity=self.identity,
            config=self.config.donor,
            snapshot=lambda: self.snapshot(),
            previous=lambda: self.previous_snapshot(),
            limiter=limiter,
            admission=admission,
        )

    def _catchup(self, schema: StateSchema, evidence: Evidence, admission: Gate | None) -> CatchUp:
        """Catch-up through this peer's node, its download requests signed as a member
        when the swarm is private."""
        return CatchUp(
            me=self.peer_id,
            swarm_id=self.swarm_id,
            dht=self.node.dht,
            client=self.node.client,
            schema=schema,
            evidence=evidence,
            config=self.config.catchup,
            rejections=self.node.dht.rejections,
            requester=Requester(self.identity, admission.own_bytes)
            if admission is not None
            else None,
            spool=self.config.swarm_directory(self.swarm_id),
            trusted=lambda: trusted_peers(self.node, self.manifest),
        )

    @property
    def endpoint(self) -> str:
        """Where others dial this peer ("" in client mode)."""
        return self.node.endpoint

    async def __aenter__(self) -> SwarmNetwork:
        await self.node.__aenter__()
        try:
            try:
                await publish_manifest(self.node.dht, self.manifest)
            except SwarmlocoError as exc:  # alone on a new network: our own storage holds it
                logger.info("manifest: %s", exc)
            await announce_peer(self.node.dht, self.swarm_id, role="trainer")
        except BaseException:
            await self.node.__aexit__(None, None, None)
            raise
        self._wake = asyncio.Event()
        self._tasks = [asyncio.create_task(self._publish_forever())]
        if self.config.dashboard_port is not None:
            self._tasks.append(
                asyncio.create_task(self._serve_dashboard(self.config.dashboard_port))
            )
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []
        try:
            await self.matchmaker.close()
            await self._farewell()
        finally:
            await self.node.__aexit__(None, None, None)

    async def _farewell(self) -> None:
        """Tell the swarm this peer left, so that nobody waits for it: its progress record
        at :data:`FAREWELL_AT` (pacing and matchmaking stop counting it at their next read),
        its status ``left`` (the dashboard lists it offline), its peers entry withdrawn
        (``wait_for_peers`` no longer counts it). Best effort and bounded: a peer leaving
        an unreachable network leaves all the same (its records then expire)."""
        dht = self.node.dht
        progress = {**self.progress(), "at": FAREWELL_AT}
        status = {**self.status(), "state": "left"}
        stores = (
            dht.store(progress_key(self.swarm_id), progress, ttl=PROGRESS_TTL_S),
            dht.store(status_key(self.swarm_id), status, ttl=PROGRESS_TTL_S),
            withdraw_peer(dht, self.swarm_id),
        )
        try:
            await asyncio.wait_for(asyncio.gather(*stores, return_exceptions=True), FAREWELL_S)
        except TimeoutError:
            logger.info("could not say goodbye to the swarm in %.0f s; leaving", FAREWELL_S)

    # -- records ---------------------------------------------------------------------------

    def wake(self) -> None:
        """Publish progress (and read the others') now: a round started or landed. Call
        on the loop (``loop.call_soon_threadsafe(network.wake)`` from another thread)."""
        if self._wake is not None:
            self._wake.set()

    async def _publish_forever(self) -> None:
        assert self._wake is not None
        announced = time.monotonic()
        while True:
            self._wake.clear()
            started = time.monotonic()
            try:
                key = progress_key(self.swarm_id)
                await self.node.dht.store(key, self.progress(), ttl=PROGRESS_TTL_S)
                await self.node.dht.store(
                    status_key(self.swarm_id), self.status(), ttl=PROGRESS_TTL_S
                )
                await self._publish_partners()
                result = await self.node.dht.get(key)
                self.reports = [progress_report(e.subkey, e.value) for e in result.entries.values()]
                with self._read:
                    self.reads += 1
                    self._read.notify_all()
                if logger.isEnabledFor(logging.DEBUG):
                    logger.debug(
                        "progress published and %d report(s) read in %.2f s: %s",
                        len(self.reports),
                        time.monotonic() - started,
                        [(r.peer[:8], r.round, r.tokens) for r in self.reports[:16]],
                    )
                if (late := self.late) is not None:
                    formed = await self.matchmaker.formed_without_us(*late)
                    if formed:
                        self.late_marker_seen = late[0]
                    self.late_marker = (late[0], formed)
                if time.monotonic() - announced > ANNOUNCE_EVERY_S:
                    await announce_peer(self.node.dht, self.swarm_id, role="trainer")
                    announced = time.monotonic()
            except Exception as exc:  # the network may be away for a while: keep training
                logger.warning("could not publish progress: %s", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=self.config.progress_interval_s)

    async def _publish_partners(self) -> None:
        """The peers this one averaged with lately (the dashboard counts a peer's figures
        when a peer it trusts names it and is named back), when they changed or the record
        is half its life old."""
        evidence = self.catchup.evidence
        peers = evidence.partners(MAX_PARTNERS)
        now = time.monotonic()
        if not peers or (peers == self._partners and now - self._partners_at < PROGRESS_TTL_S / 2):
            return
        value = {"peers": peers, "round": evidence.grouped_round, "at": self.node.dht.clock()}
        await self.node.dht.store(partners_key(self.swarm_id), value, ttl=PROGRESS_TTL_S)
        self._partners, self._partners_at = peers, now

    def wait_for_reads(self, count: int, timeout: float) -> bool:
        """Block (another thread than the loop's) until the progress records were read
        ``count`` times since the network started, or ``timeout`` passed: whether they were."""
        with self._read:
            return self._read.wait_for(lambda: self.reads >= count, timeout)

    def late_group_aborted(self, round: int) -> bool:
        """Whether the group of ``round`` that formed without this peer aborted: its mark
        was read, and is gone now (its leader announced the round again)."""
        marker = self.late_marker
        return self.late_marker_seen == round and marker == (round, False)

    async def publish_digest(self, round: int, digest: bytes) -> None:
        value = {"digest": digest, "endpoint": self.endpoint, "at": self.node.dht.clock()}
        try:
            await self.node.dht.store(digest_key(self.swarm_id, round), value, ttl=DIGEST_TTL_S)
        except Exception as exc:
            logger.warning("could not publish the digest of round %d: %s", round, exc)

    async def _serve_dashboard(self, port: int) -> None:
        """The swarm's dashboard, read through this peer's own DHT node (GET only)."""
        from swarmloco.dashboard.app import make_app, serve
        from swarmloco.dashboard.collector import Collector, CollectorConfig
        from swarmloco.pipeline.load import Vouching

        collector = Collector(
            dht=self.node.dht,
            swarm_id=self.swarm_id,
            manifest=self.manifest,
            rejoin=self.config.node.peers,
            config=CollectorConfig(trust=(self.peer_id,)),  # its own partners count
            vouching=Vouching(self.node.who_serves, self.peer_id),
        )
        try:
            async with serve(make_app(lambda: collector.view), host="127.0.0.1", port=port) as url:
                logger.info("dashboard of swarm %s at %s", self.swarm_id[:12], url)
                self.on_dashboard(url)
                await collector.run()
        except OSError as exc:  # the port is taken: train on without the page
            logger.warning("cannot serve the dashboard on port %d: %s", port, exc)

    async def known_peers(self, limit: int) -> list[str]:
        """Endpoints of up to ``limit`` peers in this node's routing table (on the loop)."""
        own = self.node.dht.endpoint
        known = [c.endpoint for c in self.node.dht.routing if c.endpoint and c.endpoint != own]
        return known[:limit]

    # -- one round -------------------------------------------------------------------------

    async def average(
        self,
        round: int,
        message: Encoded,
        out: Encoded,
        *,
        weight: float,
        expected: int | None,
        strangers: int = 0,
        error_feedback: ErrorFeedback | None = None,
        ranges: Sequence[tuple[int, int, int, int]] = (),
    ) -> RoundOutcome:
        """The all-reduce of this peer's encoded update ``message`` in ``round``: the
        group's mean, kept encoded in ``out``. ``expected``: how many
        peers known to this one work on this round, this one included (None: unknown);
        ``strangers``: how many others besides are worth a short wait (see
        ``MatchmakingConfig.stranger_grace_s``); ``ranges``: the pinned dataset's sequences
        this peer's update completes, declared to the group."""
        deadline = Deadline.after(self.config.round_timeout_s)
        started = time.monotonic()
        group = await self.matchmaker.form_group(
            round,
            weight=weight,
            numel=message.numel,
            block_size=self.averager.config.codec.block_size,
            deadline=deadline,
            expected=expected,
            strangers=strangers,
            norm=encoded_norm(message),
            ranges=ranges,
        )
        if group.size == 1 and (expected or 1) > 1:
            # Peers we know work on this round but none came: they are a round ahead (or
            # behind) of us. Averaging alone would split the swarm's state; catch up
            # instead. (Strangers that did not come are no such sign: anyone claims.)
            raise RoundAborted(
                f"round {round}: none of the {(expected or 1) - 1} other peer(s) working on "
                "it joined; out of step with them",
                unmet=True,
            )
        matchmaking = time.monotonic() - started
        try:
            result = await self.averager.all_reduce(
                group, message, deadline=deadline, out=out, error_feedback=error_feedback
            )
        except RoundAborted as exc:
            self.matchmaker.aborted(exc)
            raise
        self.matchmaker.demote(result.report.liars, why="was caught lying by an audit")
        declared = {m.peer_id: m.ranges for m in group.members if m.ranges}
        # Only what the result holds whole counts: a member struck or lost in the round
        # (a stranger that cut its streams at once, whatever weight it declared) added no
        # tokens to it.
        whole = result.report.counted_whole()
        tokens = sum(
            w for m, w in zip(group.members, group.weights, strict=True) if whole[m.peer_id]
        )
        return RoundOutcome(result, matchmaking, float(tokens), declared, whole)


@dataclasses.dataclass(frozen=True)
class RoundOutcome:
    """A round that completed, as :meth:`SwarmNetwork.average` returns it."""

    result: AllReduceResult
    matchmaking_s: float
    """Seconds from asking for a group to having one."""
    group_tokens: float
    """The weights (as capped) of the members whose contribution the result included
    whole, summed: the tokens the round averaged (the same on every member)."""
    ranges: dict[str, tuple[tuple[int, int, int, int], ...]] = dataclasses.field(
        default_factory=dict
    )
    """Peer id -> the dataset sequences its update completes, as it declared them."""
    whole: dict[str, bool] = dataclasses.field(default_factory=dict)
    """Per member: whether the result holds its contribution whole
    (:meth:`~swarmloco.net.averaging.report.AllReduceReport.counted_whole`)."""


_FRAMING_BYTES = 64 * 1024
"""What an averaging message carries besides its chunk's payload and scales (ids, the
part and chunk numbers, a rerun's notice), with room to spare."""


def receiving(node: NodeConfig, codec: CodecConfig) -> NodeConfig:
    """``node`` with a server that receives nothing larger than the DHT's messages and the
    group's averaging chunks (``codec``'s) need, unless its config says otherwise: a
    stranger's 7 MiB Ping is refused by gRPC before it is whole."""
    server = node.server
    if server is None or server.max_receive_bytes is not None:
        return node
    largest = max(DHT_MESSAGE_BYTES, codec.max_chunk_bytes() + _FRAMING_BYTES)
    return dataclasses.replace(node, server=dataclasses.replace(server, max_receive_bytes=largest))


def matchmaking_config(config: PeerConfig) -> MatchmakingConfig:
    """The peer's matchmaking, declaring no more reduction bandwidth than its cap allows
    (the slower of its upload and download limits): the part a member reduces is
    proportional to what it declares, so a capped peer is given a smaller one."""
    mm = config.matchmaking
    cap = config.bandwidth
    if cap is None:
        return mm
    limits = [r for r in (cap.upload_bytes_per_s, cap.download_bytes_per_s) if r > 0]
    if not limits or min(limits) >= mm.bandwidth:
        return mm
    return dataclasses.replace(mm, bandwidth=min(limits))


def peer_codec(config: PeerConfig, codec: CodecConfig, numel: int) -> CodecConfig:
    """The run's ``codec`` with this peer's backend: its own ``--codec`` if it chose one,
    else ``auto`` settled for a vector of ``numel`` values (:func:`settle_backend`)."""
    if config.codec_backend is not None:
        codec = dataclasses.replace(codec, backend=config.codec_backend)
    return settle_backend(codec, numel)


def averaging_config(config: PeerConfig, codec: CodecConfig, aggregator: Any) -> AveragingConfig:
    """The peer's averaging timeouts with the run's aggregator and ``codec`` (the run's,
    with this peer's backend: :func:`peer_codec`)."""
    return dataclasses.replace(config.averaging, codec=codec, aggregator=aggregator)
