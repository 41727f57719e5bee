"""Helpers for the averaging tests: peers on loopback, rounds, and the exact reference mean."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import os
import re
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager

import grpc
import torch
from tcpproxy import TcpProxy

from swarmloco.core.codec import CodecConfig, chunk_spans, padded_numel
from swarmloco.errors import RoundAborted
from swarmloco.net.admission import Admission
from swarmloco.net.averaging import (
    AllReduceReport,
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
from swarmloco.net.identity import Identity
from swarmloco.net.node import NetNode, NodeConfig
from swarmloco.net.server import ServerConfig, Service

SWARM = "cd" * 20
# Small chunks so that small test vectors still have several chunks per part.
CODEC = CodecConfig(block_size=64, chunk_bytes=4 * (64 + 4), backend="eager")
PATIENT = AveragingConfig(codec=CODEC)
"""The production timeouts (a member fails after seconds of silence): for rounds in which
no member is meant to fail on a timer, so that a busy machine fails no honest member."""
FAST = AveragingConfig(
    codec=CODEC,
    sender_timeout_s=1.0,
    reducer_timeout_s=2.0,
    liveness_timeout_s=1.0,
    heartbeat_s=0.2,
    open_timeout_s=2.0,
    close_grace_s=1.0,
)
"""Timeouts of a second or two: only for tests in which a member must fail on a timer (a
silent or stuck member); any other round runs with PATIENT."""


@dataclasses.dataclass
class AvgPeer:
    node: NetNode
    matchmaker: Matchmaker
    averager: Averager

    @property
    def peer_id(self) -> str:
        return self.node.identity.peer_id_hex


@asynccontextmanager
async def averaging_peers(
    size: int,
    *,
    clients: Sequence[int] = (),
    config: AveragingConfig = PATIENT,
    matchmaking: MatchmakingConfig | None = None,
    faults: dict[int, FaultPlan] | None = None,
    limiters: dict[int, BandwidthLimiter] | None = None,
    bandwidths: dict[int, float] | None = None,
    configs: dict[int, AveragingConfig] | None = None,
    server: ServerConfig | None = None,
    announce_host: str | None = None,
    gates: Callable[[int, Identity], Admission | None] | None = None,
    proxies: dict[int, TcpProxy] | None = None,
    before: dict[int, Callable[[list[AvgPeer]], Awaitable[None]]] | None = None,
    services: Sequence[Service] = (),
    hosts: dict[int, str] | None = None,
) -> AsyncIterator[list[AvgPeer]]:
    """``size`` peers on 127.0.0.1 joined through the first (which must serve);
    ``configs``: per peer, an averaging config other than ``config`` (a liar's);
    ``server``/``announce_host``: where the serving peers bind and what they announce;
    ``gates``: per peer (index, identity), the gate of a private swarm (None: none);
    ``proxies``: per serving peer, a started proxy it announces instead of its own port;
    ``before``: per peer, what to do to the peers started so far before it starts (an
    attack that must come first); ``services``: more services every serving peer serves;
    ``hosts``: per serving peer, a loopback address to bind and announce (its own source
    network) instead of 127.0.0.1."""
    assert 0 not in clients
    faults = faults or {}
    limiters = limiters or {}
    bandwidths = bandwidths or {}
    async with AsyncExitStack() as stack:
        peers: list[AvgPeer] = []
        for i in range(size):
            if (prelude := (before or {}).get(i)) is not None:
                await prelude(peers)
            identity = Identity.generate()
            first = () if i == 0 else (peers[0].node.endpoint,)
            if i in clients:
                node_config = NodeConfig(server=None, peers=first)
            else:
                proxy = (proxies or {}).get(i)
                host = (hosts or {}).get(i)
                node_config = NodeConfig(
                    peers=first,
                    server=dataclasses.replace(server or ServerConfig(), host=host)
                    if host is not None
                    else server or ServerConfig(),
                    announce_host=host or announce_host,
                    announce_port=proxy.port if proxy is not None else None,
                )
            node = NetNode(
                identity=identity, config=node_config, services=() if i in clients else services
            )
            if i not in clients and (proxy := (proxies or {}).get(i)) is not None:
                proxy.target = functools.partial(_bound, node)
            gate = gates(i, identity) if gates is not None else None
            if gate is not None:
                node.dht.admit(gate)
            mm_config = matchmaking or MatchmakingConfig(
                max_group_size=size, gather_s=10.0, poll_s=0.2
            )
            if i in bandwidths:
                mm_config = dataclasses.replace(mm_config, bandwidth=bandwidths[i])
            matchmaker = Matchmaker(
                identity=identity,
                dht=node.dht,
                client=node.client,
                swarm_id=SWARM,
                config=mm_config,
                faults=faults.get(i),
                admission=gate,
            )
            averager = Averager(
                identity=identity,
                client=node.client,
                config=(configs or {}).get(i, config),
                faults=faults.get(i),
                limiter=limiters.get(i),
                slots=node.server.slots if node.server is not None else None,
            )
            if node.server is not None:
                node.server.add_service(averaging_service(matchmaker, averager))
            await stack.enter_async_context(node)
            stack.push_async_callback(matchmaker.close)  # (before its node closes)
            peers.append(AvgPeer(node, matchmaker, averager))
        yield peers


def _bound(node: NetNode) -> tuple[str, int]:
    assert node.server is not None
    return "127.0.0.1", node.server.port


async def average(
    peer: AvgPeer,
    round: int,
    vector: torch.Tensor,
    weight: float,
    *,
    deadline: Deadline,
    norm: float | None = None,
) -> AllReduceResult:
    """One member's round; it declares ``norm`` (default: its vector's, as a peer does)."""
    group = await peer.matchmaker.form_group(
        round,
        weight=weight,
        numel=vector.numel(),
        block_size=peer.averager.config.codec.block_size,
        deadline=deadline,
        norm=float(vector.double().norm()) if norm is None else norm,
    )
    try:
        result = await peer.averager.all_reduce(group, vector, deadline=deadline)
    except RoundAborted as exc:
        peer.matchmaker.aborted(exc)  # as a peer's network does
        raise
    peer.matchmaker.demote(result.report.liars, why="was caught lying by an audit")  # likewise
    return result


async def run_round(
    peers: Sequence[AvgPeer],
    round: int,
    vectors: Sequence[torch.Tensor],
    weights: Sequence[float],
    *,
    timeout: float = 20.0,
    norms: Sequence[float | None] | None = None,
) -> list[AllReduceResult | BaseException]:
    deadline = Deadline.after(timeout)
    norms = norms or [None] * len(peers)
    return await asyncio.gather(
        *(
            average(p, round, v, w, deadline=deadline, norm=n)
            for p, v, w, n in zip(peers, vectors, weights, norms, strict=True)
        ),
        return_exceptions=True,
    )


def random_vectors(count: int, numel: int, seed: int, block: int = 64) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    padded = padded_numel(numel, block)
    out = []
    for _ in range(count):
        v = torch.zeros(padded)
        v[:numel] = torch.randn(numel, generator=g) * (1 + torch.rand(1, generator=g).item())
        out.append(v)
    return out


def expected_mean(
    report: AllReduceReport,
    vectors: dict[str, torch.Tensor],
    weights: dict[str, float],
    codec: CodecConfig = CODEC,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact weighted mean of the contributors the report names, chunk by chunk, and
    the codec's bound per element (senders' rounding plus the result's)."""
    numel = next(iter(vectors.values())).numel()
    expected = torch.zeros(numel, dtype=torch.float64)
    for part in report.parts:
        for k, span in enumerate(chunk_spans(part.stop - part.start, codec)):
            who = [p for p, n in part.included.items() if n > k]
            assert who, f"chunk {k} of part {part.part} averages nobody"
            lo, hi = part.start + span.start, part.start + span.stop
            total = sum(weights[p] for p in who)
            expected[lo:hi] = sum(weights[p] * vectors[p][lo:hi].double() for p in who) / total
    absmax = torch.stack([v.view(-1, codec.block_size).abs().amax(1) for v in vectors.values()])
    bound = (2 * absmax.amax(0) / 254 + 1e-6).repeat_interleave(codec.block_size)
    return expected, bound


def assert_exact(
    result: AllReduceResult, vectors: dict[str, torch.Tensor], weights: dict[str, float]
) -> None:
    expected, bound = expected_mean(result.report, vectors, weights)
    error = (result.mean.double() - expected).abs()
    assert (error <= bound.double()).all(), f"off by up to {float((error - bound).max())}"


def assert_identical(results: Sequence[AllReduceResult]) -> None:
    first = results[0]
    for other in results[1:]:
        assert torch.equal(first.mean, other.mean)
        assert first.report.digest == other.report.digest


def _task_kind(task: asyncio.Task[object]) -> str:
    match = re.search(r"coro=<([^\s(]+)", repr(task))
    return match.group(1) if match else repr(task.get_coro())


@dataclasses.dataclass
class Leftovers:
    """What a round must not leave behind: tasks, threads, open file descriptors.

    Tasks are compared by kind: a gRPC server keeps one task waiting for the next call and
    replaces it after each call, so the same kinds in the same numbers are "nothing left".
    """

    tasks: collections.Counter[str]
    threads: int
    fds: int

    @classmethod
    async def before_grpc(cls) -> Leftovers:
        """:meth:`now`, for a baseline taken before the test's first gRPC call: what gRPC
        keeps for the life of the process (its aio poller's thread and descriptors, and
        those of its first channel) is started first, so that a test that happens to be its
        worker's first gRPC user does not count it as left behind."""
        grpc.aio.init_grpc_aio()
        channel = grpc.aio.insecure_channel("127.0.0.1:9")
        await channel.close()
        return cls.now()

    @classmethod
    def now(cls) -> Leftovers:
        current = asyncio.current_task()
        return cls(
            collections.Counter(_task_kind(t) for t in asyncio.all_tasks() if t is not current),
            threading.active_count(),
            len(os.listdir("/proc/self/fd")),
        )

    async def assert_back(self, timeout: float = 5.0, *, sockets: bool = True) -> None:
        """Wait (polling, bounded) until only what existed before remains. ``sockets=False``
        when the round may have opened the channels a client keeps for the next one."""
        deadline = time.monotonic() + timeout
        while True:
            now = Leftovers.now()
            extra = now.tasks - self.tasks
            fds_ok = now.fds <= self.fds or not sockets
            if not extra and now.threads <= self.threads and fds_ok:
                return
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"left behind: tasks {dict(extra)}, threads {now.threads} (was "
                    f"{self.threads}), fds {now.fds} (was {self.fds})"
                )
            await asyncio.sleep(0.02)
