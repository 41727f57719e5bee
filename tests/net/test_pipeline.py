"""Pipeline stages over real gRPC on loopback: a micro-batch driven through a replica of
each stage computes what one process computes, travels int8 at a quarter of fp32's bytes,
survives a dead replica, and what a hostile caller sends is refused and counted."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import statistics
import threading
import time
from collections.abc import AsyncIterator, Sequence

import grpc
import pytest
import torch
from netutil import closed_port, wait_for

from swarmloco.net.identity import Identity
from swarmloco.net.node import NetNode, NodeConfig
from swarmloco.net.rejections import RejectionLog
from swarmloco.net.server import Service
from swarmloco.pipeline.driver import Driver, DriverConfig, PipelineError
from swarmloco.pipeline.load import Vouching, fresh, publish_load, read_loads
from swarmloco.pipeline.replica import ReplicaConfig, StageReplica
from swarmloco.pipeline.service import (
    ABANDON,
    ATTEND,
    AUDIT,
    BACKWARD,
    FORWARD,
    SESSION,
    StageService,
)
from swarmloco.pipeline.stages import GPTStage, gpt_stages, split_evenly
from swarmloco.pipeline.wire import Boundary, pack
from swarmloco.proto.v1 import stage_pb2 as pb
from swarmloco.train.spec import GPTConfig

CONFIG = GPTConfig(vocab_size=256, seq_len=16, n_layer=3, n_head=2, n_embd=32)
SWARM = "5a" * 20
IDS = Boundary(width=0, max_batch=8, max_tokens=CONFIG.seq_len, vocab=CONFIG.vocab_size)
ACTS = Boundary(width=CONFIG.n_embd, max_batch=8, max_tokens=CONFIG.seq_len)


def batch(seed: int, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, CONFIG.vocab_size, (n, CONFIG.seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def service_of(
    module: GPTStage, stage: int, stages: int, encoding: str, replica: StageReplica | None = None
) -> StageService:
    last = stage == stages - 1
    return StageService(
        replica or StageReplica(module, first=False, last=last),
        swarm_id=SWARM,
        stage=stage,
        inputs=ACTS,
        outputs=None if last else ACTS,
        targets=IDS if last else None,
        encoding=encoding,
        rejections=RejectionLog(logging.getLogger("swarmloco.pipeline")),
    )


@contextlib.asynccontextmanager
async def pipeline(
    services: Sequence[Sequence[StageService]],
    first: StageReplica,
    *,
    nodes: list[NetNode] | None = None,
    **driver: object,
) -> AsyncIterator[tuple[Driver, list[list[str]]]]:
    """Each service served by a peer of its own on loopback, and a client-mode driver
    (``nodes``: filled with the peers' nodes, then the driver's)."""
    nodes = [] if nodes is None else nodes
    async with contextlib.AsyncExitStack() as stack:
        endpoints: list[list[str]] = []
        entry: tuple[str, ...] = ()
        for replicas in services:
            endpoints.append([])
            for service in replicas:
                stack.callback(service.close)
                node = NetNode(
                    identity=Identity.generate(),
                    config=NodeConfig(peers=entry),
                    services=[service.service()],
                )
                await stack.enter_async_context(node)
                nodes.append(node)
                entry = entry or (node.endpoint,)
                endpoints[-1].append(node.endpoint)
        client = await stack.enter_async_context(
            NetNode(identity=Identity.generate(), config=NodeConfig(server=None, peers=entry))
        )
        nodes.append(client)
        replicas = driver.pop("replicas", endpoints)
        yield (
            Driver(
                client.client,
                first,
                swarm_id=SWARM,
                replicas=replicas,  # type: ignore[arg-type]
                boundaries=[ACTS] * len(services),
                ids=IDS,
                **driver,  # type: ignore[arg-type]
            ),
            endpoints,
        )


def test_the_blocks_are_split_as_evenly_as_they_go():
    assert split_evenly(3, 2) == [range(0, 2), range(2, 3)]
    assert split_evenly(8, 3) == [range(0, 3), range(3, 6), range(6, 8)]
    with pytest.raises(ValueError, match="cannot cut"):
        split_evenly(2, 3)


async def test_two_stages_over_fp32_compute_what_one_process_computes():
    local, remote = gpt_stages(CONFIG, 2, seed=1)
    ref0, ref1 = gpt_stages(CONFIG, 2, seed=1)
    first = StageReplica(local, first=True, last=False)
    service = service_of(remote, 1, 2, "f32")
    async with pipeline([[service]], first, config=DriverConfig(encoding="f32")) as (drv, _):
        for seed in range(3):
            x, y = batch(seed)
            trace = await drv.run(x, y)
            loss = ref1(ref0(x), y)
            loss.backward()
            assert trace.loss == pytest.approx(loss.item(), rel=1e-6)
    assert service.replica.micro_batches == 3 and first.micro_batches == 3
    for mine, ref in ((local, ref0), (remote, ref1)):
        for (name, p), q in zip(mine.named_parameters(), ref.parameters(), strict=True):
            assert p.grad is not None and q.grad is not None, name
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)
    # One optimizer step on the mean of the three: the accumulator empties.
    opt = torch.optim.AdamW(remote.parameters(), lr=1e-3)
    assert service.replica.step(opt) == 3 and service.replica.micro_batches == 0


async def test_three_stages_over_int8_send_a_quarter_of_the_bytes_at_a_small_loss_error():
    stages = gpt_stages(CONFIG, 3, seed=2)
    ref = gpt_stages(CONFIG, 3, seed=2)
    first = StageReplica(stages[0], first=True, last=False)
    sent = {}
    for encoding in ("f32", "int8"):
        services = [[service_of(stages[k], k, 3, encoding)] for k in (1, 2)]
        config = DriverConfig(encoding=encoding)
        async with pipeline(services, first, config=config) as (drv, _):
            x, y = batch(7)
            trace = await drv.run(x, y)
        sent[encoding] = trace.bytes_sent
        with torch.no_grad():
            want = float(ref[2](ref[1](ref[0](x)), y))
        assert trace.loss == pytest.approx(want, rel=1e-6 if encoding == "f32" else 1e-2)
    assert sent["int8"] <= 0.27 * sent["f32"], sent


async def test_a_dead_replica_costs_a_retry_and_each_micro_batch_is_applied_once():
    class FirstDrawn(random.Random):
        def choices(self, population, weights=None, **_):  # the dead replica is listed first
            return [population[0]]

    local, remote = gpt_stages(CONFIG, 2, seed=3)
    first = StageReplica(local, first=True, last=False)
    service = service_of(remote, 1, 2, "int8")
    async with pipeline([[service]], first) as (drv, endpoints):
        dead = f"127.0.0.1:{closed_port()}"
        drv.replicas, drv.rng = [[dead, *endpoints[0]]], FirstDrawn()
        traces = [await drv.run(*batch(s)) for s in range(3)]
        drv.replicas = [[dead]]
        with pytest.raises(PipelineError, match="no replica of stage 1"):
            await drv.run(*batch(9))
        # A stage no record names yet: waited for (up to the hop's deadline), then told.
        drv.replicas = [[]]
        drv.config = DriverConfig(hop_timeout_s=0.3)
        with pytest.raises(PipelineError, match="stage 1 has no peer"):
            await drv.run(*batch(10))
    assert [t.retries for t in traces] == [1, 0, 0] and dead in drv.shunned
    assert drv.unserving() == {dead}  # what its peer's rebalancing does not count
    assert all(t.path == endpoints[0] for t in traces)
    assert service.replica.micro_batches == 3 and first.micro_batches == 3
    assert first.inflight == 0  # the broken micro-batch's input was let go at once


async def test_a_replica_that_keeps_failing_is_shunned_twice_as_long_each_time():
    """One that takes calls and never answers would otherwise cost each driver a hop's
    deadline every ``shun_s``."""

    class FirstDrawn(random.Random):
        def choices(self, population, weights=None, **_):
            return [population[0]]

    local, remote = gpt_stages(CONFIG, 2, seed=3)
    first = StageReplica(local, first=True, last=False)
    config = DriverConfig(shun_s=10.0, max_shun_s=35.0, audit_share=0.0)
    async with pipeline([[service_of(remote, 1, 2, "int8")]], first, config=config) as (
        drv,
        endpoints,
    ):
        dead = f"127.0.0.1:{closed_port()}"
        drv.replicas, drv.rng = [[dead, *endpoints[0]]], FirstDrawn()
        shunned_for = []
        for seed in range(4):
            trace = await drv.run(*batch(seed))
            assert trace.retries == 1 and trace.path == endpoints[0]
            shunned_for.append(drv.shunned.pop(dead) - time.monotonic())  # as if it expired
        assert drv.failures[dead] == 4
        # A replica that failed before and answers a backward starts afresh.
        drv.failures[endpoints[0][0]] = 3
        drv.replicas = [endpoints[0]]
        await drv.run(*batch(9))
        assert endpoints[0][0] not in drv.failures and drv.failures[dead] == 4
    assert [round(s) for s in shunned_for] == [10, 20, 35, 35], shunned_for


class _Stall(torch.autograd.Function):
    """The identity, whose backward waits on ``gate`` (a replica stuck in its backward)."""

    @staticmethod
    def forward(ctx, x, gate):  # type: ignore[override]
        ctx.gate = gate
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        ctx.gate.wait(timeout=30)
        return grad, None


class StuckBackward(torch.nn.Module):
    """A last stage whose backwards hang until ``gate`` is set."""

    def __init__(self, stage: GPTStage, gate: threading.Event) -> None:
        super().__init__()
        self.stage, self.gate = stage, gate

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        return self.stage(_Stall.apply(x, self.gate), targets)


async def test_a_backward_past_its_deadline_loses_the_micro_batch_not_the_peer():
    """A replica that answers the forward and then hangs in the backward: the driver gives
    the micro-batch up at the hop's deadline with a PipelineError (what a stage-0 peer
    retries), drops its own input, shuns the replica and goes on through the other one."""
    gate = threading.Event()
    local, remote = gpt_stages(CONFIG, 2, seed=6)
    spare = gpt_stages(CONFIG, 2, seed=6)[1]
    first = StageReplica(local, first=True, last=False)
    stuck = service_of(StuckBackward(remote, gate), 1, 2, "int8")
    good = service_of(spare, 1, 2, "int8")
    config = DriverConfig(hop_timeout_s=1.0)
    try:
        async with pipeline([[stuck, good]], first, config=config) as (drv, endpoints):
            drv.replicas = [[endpoints[0][0]]]  # the stuck one alone first
            with pytest.raises(PipelineError, match=r"backward .* the micro-batch is lost"):
                await drv.run(*batch(0))
            assert first.inflight == 0 and endpoints[0][0] in drv.shunned
            drv.replicas = [endpoints[0]]
            trace = await drv.run(*batch(1))
            assert trace.path == [endpoints[0][1]]
    finally:
        gate.set()
    assert good.replica.micro_batches == 1 and first.micro_batches == 1


async def test_backwards_are_answered_however_many_forwards_wait_for_a_step():
    """A step's sequences are admitted and a micro-batch is still between its forward and
    backward: the forwards of many drivers wait for the step, and the backward that
    brings it must not queue behind them (it did: they held every thread of one shared
    pool, 120 s)."""
    local, remote = gpt_stages(CONFIG, 2, seed=4)
    replica = StageReplica(
        remote,
        first=False,
        last=True,
        config=ReplicaConfig(step_samples=8),
        optimizer=torch.optim.AdamW(remote.parameters(), lr=1e-3),
    )
    service = service_of(remote, 1, 2, "f32", replica)
    first = StageReplica(local, first=True, last=False)
    async with pipeline([[service]], first) as (drv, endpoints):
        endpoint = endpoints[0][0]
        x, y = batch(0)
        h = first.forward(b"h" * 16, x)

        async def forward(name: bytes) -> str:
            request = pb.ForwardRequest(
                swarm_id=SWARM, stage=1, micro_batch=name, input=pack(h, "f32"),
                targets=pack(y, "i64"),
            )  # fmt: skip
            answer = await drv.client.call(endpoint, FORWARD, request, timeout=60.0, attempts=1)
            return answer.WhichOneof("outcome")

        async def backward(name: bytes) -> str:
            request = pb.BackwardRequest(swarm_id=SWARM, stage=1, micro_batch=name)
            answer = await drv.client.call(endpoint, BACKWARD, request, timeout=60.0, attempts=1)
            return answer.WhichOneof("outcome")

        async def through(name: bytes) -> tuple[str, str]:
            return await forward(name), await backward(name)

        # a and b: a step's sequences admitted; a's backward in, b in flight.
        assert await forward(b"a" * 16) == await forward(b"b" * 16) == "loss"
        assert await backward(b"a" * 16) == "grad_input"
        # More waiting forwards than asyncio's default pool has threads, on any machine.
        many = 2 * (min(32, (os.cpu_count() or 1) + 4) // 2) + 2
        waiting = [
            asyncio.create_task(through(bytes([i]) * 16)) for i in range(ord("c"), ord("c") + many)
        ]
        while replica.waiting < many:  # every one of them waits for the step
            await asyncio.sleep(0.05)
        assert await backward(b"b" * 16) == "grad_input"
        # The step taken, they go on, two at a time (a step's sequences).
        assert await asyncio.gather(*waiting) == [("loss", "grad_input")] * many
    assert replica.steps == 1 + many // 2


async def test_a_stage_that_computes_nan_refuses_to_send_it():
    """A replica whose weights went bad answers its gradient's NaN with a counted refusal,
    not an error, and the driver loses that micro-batch only."""
    local, remote = gpt_stages(CONFIG, 2, seed=4)
    with torch.no_grad():
        next(remote.parameters()).fill_(float("nan"))
    service = service_of(remote, 1, 2, "int8")
    first = StageReplica(local, first=True, last=False)
    async with pipeline([[service]], first) as (drv, _):
        with pytest.raises(PipelineError, match="computed NaN or Inf"):
            await drv.run(*batch(0))
        assert dict(service.refused) == {"not-finite": 1}
        with torch.no_grad():
            next(local.parameters()).fill_(float("nan"))  # the driver's own stage now
        with pytest.raises(PipelineError, match="stage 0's output cannot be sent"):
            await drv.run(*batch(1))
    assert dict(service.refused) == {"not-finite": 1}  # nothing was sent


async def test_a_micro_batch_that_fails_later_on_is_dropped_at_once_where_it_was_held():
    """Stage 2 refuses its backward (its weights went bad): the replica of stage 1 that holds the
    micro-batch's input is told to drop it (Abandon), so its step need not wait for the
    input's deadline; and only the micro-batch's driver can name it."""
    stages = gpt_stages(CONFIG, 3, seed=5)
    with torch.no_grad():
        next(stages[2].parameters()).fill_(float("nan"))
    first = StageReplica(stages[0], first=True, last=False)
    config = ReplicaConfig(inflight_s=600.0)
    middle = StageReplica(stages[1], first=False, last=False, config=config)
    services = [
        [service_of(stages[1], 1, 3, "int8", middle)],
        [service_of(stages[2], 2, 3, "int8")],
    ]
    async with pipeline(services, first) as (drv, endpoints):
        stranger = pb.AbandonRequest(swarm_id=SWARM, stage=1, micro_batch=os.urandom(16))
        answer = await drv.client.call(endpoints[0][0], ABANDON, stranger, timeout=10.0)
        assert not answer.dropped and not answer.HasField("refused")
        wrong = pb.AbandonRequest(swarm_id=SWARM, stage=2, micro_batch=os.urandom(16))
        answer = await drv.client.call(endpoints[0][0], ABANDON, wrong, timeout=10.0)
        assert answer.refused.code == "wrong-stage"
        with pytest.raises(PipelineError, match=r"stage 2's backward .* is lost"):
            await drv.run(*batch(0))
        deadline = time.monotonic() + 60
        while middle.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.02)  # the Abandon call is not waited for by run()
        assert middle.inflight == 0 and middle.dropped == 0  # dropped at once, not expired
        assert first.inflight == 0
    assert services[1][0].refused["not-finite"] == 1


async def test_hostile_activations_and_calls_are_refused_and_counted(
    caplog: pytest.LogCaptureFixture,
):
    caplog.set_level(logging.WARNING, logger="swarmloco.pipeline")
    local, remote = gpt_stages(CONFIG, 2, seed=4)
    service = service_of(remote, 1, 2, "int8")
    first = StageReplica(local, first=True, last=False)
    async with pipeline([[service]], first) as (drv, endpoints):
        endpoint = endpoints[0][0]
        x, y = batch(0)
        good = torch.randn(4, CONFIG.seq_len, CONFIG.n_embd)

        async def forward(tensor: pb.StageTensor, **change: object) -> str:
            request = pb.ForwardRequest(
                swarm_id=SWARM,
                stage=1,
                micro_batch=os.urandom(16),
                input=tensor,
                targets=pack(y, "i64"),
            )
            for field, value in change.items():
                setattr(request, field, value)
            answer = await drv.client.call(endpoint, FORWARD, request, timeout=10.0)
            assert answer.WhichOneof("outcome") == "refused", answer
            return answer.refused.code

        nan = good.clone()
        nan[0, 0, 0] = float("nan")
        huge = good.clone()
        huge[1, 2, 3] = 1e30
        wide = torch.randn(4, CONFIG.seq_len, CONFIG.n_embd + 1)
        # (Packed by hand: our own pack refuses to send NaN.)
        raw_nan = pb.StageTensor(shape=list(nan.shape), encoding="f32", data=nan.numpy().tobytes())
        assert await forward(raw_nan) == "not-finite"
        assert await forward(pack(huge, "f32")) == "out-of-bounds"
        assert await forward(pack(huge, "int8")) == "out-of-bounds"
        assert await forward(pack(wide, "f32")) == "bad-shape"
        assert await forward(pack(torch.randn(9, 4, CONFIG.n_embd), "f32")) == "bad-shape"
        short = pack(good, "f32")
        short.data = short.data[:-4]
        assert await forward(short) == "malformed"
        assert await forward(pack(good, "f32"), stage=0) == "wrong-stage"
        assert await forward(pack(good, "f32"), micro_batch=b"x") == "malformed"
        unknown = pb.BackwardRequest(swarm_id=SWARM, stage=1, micro_batch=os.urandom(16))
        answer = await drv.client.call(endpoint, BACKWARD, unknown, timeout=10.0)
        assert answer.refused.code == "unknown"
        # Nothing was held or applied, and the pipeline still works.
        assert service.replica.inflight == 0 and service.replica.micro_batches == 0
        assert all(p.grad is None for p in remote.parameters())
        await drv.run(x, y)
    assert service.replica.micro_batches == 1
    assert dict(service.refused) == {
        "not-finite": 1,
        "out-of-bounds": 2,
        "bad-shape": 2,
        "malformed": 2,
        "wrong-stage": 1,
        "unknown": 1,
    }
    assert sum(service.rejections.counts.values()) == 9
    # The log names the caller as its connection came (its source network keys the
    # log's rate limit), not as a call made in the process.
    lines = [r.getMessage() for r in caplog.records if "rejected input" in r.getMessage()]
    assert lines and all(line.startswith("rejected input from ipv4:127.0.0.1:") for line in lines)


class Slowed(torch.nn.Module):
    """A stage whose every forward takes ``delay`` seconds more (a slower machine)."""

    def __init__(self, stage: GPTStage, delay: float) -> None:
        super().__init__()
        self.stage, self.delay = stage, delay

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        time.sleep(self.delay)
        return self.stage(x, targets)


def counting(seed: int, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences that count up from a random start: a pattern a tiny model learns fast."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, CONFIG.vocab_size, (n, 1), generator=g)
    tokens = (start + torch.arange(CONFIG.seq_len + 1)) % CONFIG.vocab_size
    return tokens[:, :-1], tokens[:, 1:]


async def test_two_drivers_train_through_a_fast_and_a_slow_replica_each_micro_batch_once():
    """Stage 1 has two replicas, one slowed by 0.3 s a forward (several times what a
    forward costs here even on a busy machine); two stage-0 peers drive micro-batches at
    once. The replicas step every 8 sequences on their own; the loss falls; both drivers
    measured the slow replica as slower and the fast replica took most micro-batches; each
    is applied exactly once."""
    heads = [gpt_stages(CONFIG, 2, seed=5)[1] for _ in range(2)]
    replicas = [
        StageReplica(
            Slowed(head, delay) if delay else head,
            first=False,
            last=True,
            optimizer=torch.optim.AdamW(head.parameters(), lr=3e-3),
            config=ReplicaConfig(step_samples=8),
        )
        for head, delay in zip(heads, (0.0, 0.3), strict=True)
    ]
    services = [service_of(h, 1, 2, "int8", r) for h, r in zip(heads, replicas, strict=True)]
    firsts = []
    for _ in range(2):
        stage0 = gpt_stages(CONFIG, 2, seed=5)[0]
        firsts.append(
            StageReplica(
                stage0,
                first=True,
                last=False,
                optimizer=torch.optim.AdamW(stage0.parameters(), lr=3e-3),
                config=ReplicaConfig(step_samples=8),
            )
        )
    losses: list[list[float]] = [[], []]
    async with pipeline([services], firsts[0]) as (one, endpoints):
        two = Driver(one.client, firsts[1], swarm_id=SWARM, replicas=endpoints,
                     boundaries=[ACTS], ids=IDS)  # fmt: skip

        async def drive(driver: Driver, k: int) -> None:
            for i in range(24):
                trace = await driver.run(*counting(100 * k + i))
                losses[k].append(trace.loss)

        await asyncio.gather(drive(one, 0), drive(two, 1))
    fast, slow = replicas
    assert fast.served + slow.served == 48 == sum(f.served for f in firsts)
    assert fast.served > slow.served, (fast.served, slow.served)
    for driver in (one, two):
        rate = driver.stats.rate
        assert rate[endpoints[0][0]] > rate[endpoints[0][1]], rate
    assert fast.steps >= 2 and all(f.steps >= 2 for f in firsts)
    for mine in losses:
        # The first and last 8 of 24 (nats): over four, one run on a loaded machine fell
        # 0.299 where others fell 0.46-0.73; over eight they fell 0.40-0.65 beside two busy
        # loops and quiet alike.
        assert statistics.mean(mine[-8:]) < statistics.mean(mine[:8]) - 0.2, mine


async def test_replicas_say_where_they_serve_in_the_dht_and_a_driver_draws_among_them():
    """Each replica publishes its stage-load record through its own node; the driver reads
    them through its own and draws from them alone. A stranger's record claiming a stage 1
    replica a thousand times faster, where nothing serves, costs at most one retry: a
    record claims, a call proves."""
    local, one, two = gpt_stages(CONFIG, 3, seed=5)
    first = StageReplica(local, first=True, last=False)
    services = [service_of(one, 1, 3, "int8"), service_of(two, 2, 3, "int8")]
    nodes: list[NetNode] = []
    async with pipeline([[s] for s in services], first, nodes=nodes, replicas=[[], []]) as (
        drv,
        endpoints,
    ):
        *servers, client = nodes
        dead = f"127.0.0.1:{closed_port()}"
        liar = NetNode(
            identity=Identity.generate(), config=NodeConfig(peers=(servers[0].endpoint,))
        )
        async with liar:
            await publish_load(
                liar.dht, SWARM, stage=1, endpoint=dead, load={"rate": 1e6, "queue": 0, "free": 64}
            )
        for node, service, stage in zip(servers, services, (1, 2), strict=True):
            load = service.replica.load()
            await publish_load(node.dht, SWARM, stage=stage, endpoint=node.endpoint, load=load)
        loads = fresh(await read_loads(client.dht, SWARM), client.dht.clock())
        drv.update(loads)
        assert sorted(drv.replicas[0]) == sorted([endpoints[0][0], dead])
        assert drv.replicas[1] == endpoints[1]
        traces = [await drv.run(*batch(seed)) for seed in range(4)]
    assert all(t.path == [endpoints[0][0], endpoints[1][0]] for t in traces), traces
    retries = sum(t.retries for t in traces)
    assert retries <= 1 and (retries == 0 or dead in drv.shunned)
    assert [s.replica.micro_batches for s in services] == [4, 4]
    # Each backward was timed (its rate is said once its warm-up is over: test_stage_load).
    assert all(s.replica.rate.steps == 4 for s in services)


async def test_a_strangers_record_naming_an_honest_replicas_address_is_not_drawn():
    """A stranger publishes, under its own key, a stage-2 record at the address of the
    honest stage-1 replica. Taken as it is, the driver draws that address for stage 2 and
    is refused (wrong stage): that costs a retry, and the address is no longer drawn for
    stage 2 (it used to be shunned, and the honest replica lost to stage 1 too). A driver
    reads the records its peer's servers vouch for (``Vouching``: the server there answers
    as its own key, not the stranger's), and that record is not drawn at all."""

    class FirstDrawn(random.Random):
        def choices(self, population, weights=None, **_):
            return [population[-1]]  # the stranger's record comes last

    local, one, two = gpt_stages(CONFIG, 3, seed=5)
    first = StageReplica(local, first=True, last=False)
    services = [service_of(one, 1, 3, "int8"), service_of(two, 2, 3, "int8")]
    nodes: list[NetNode] = []
    config = DriverConfig(audit_share=0.0)
    async with pipeline(
        [[s] for s in services], first, nodes=nodes, replicas=[[], []], config=config
    ) as (drv, endpoints):
        *servers, client = nodes
        for node, service, stage in zip(servers, services, (1, 2), strict=True):
            load = service.replica.load()
            await publish_load(node.dht, SWARM, stage=stage, endpoint=node.endpoint, load=load)
        stranger = NetNode(
            identity=Identity.generate(), config=NodeConfig(peers=(servers[0].endpoint,))
        )
        async with stranger:
            await publish_load(stranger.dht, SWARM, stage=2, endpoint=endpoints[0][0], load=load)
        loads = fresh(await read_loads(client.dht, SWARM), client.dht.clock())
        drv.rng = FirstDrawn()
        # Taken as they are: a refused call, and the address is dropped from stage 2.
        drv.update(loads)
        assert drv.replicas[1] == [endpoints[1][0], endpoints[0][0]]
        trace = await drv.run(*batch(0))  # refused at stage 2, retried on its replica
        assert trace.retries == 1 and not drv.shunned
        assert drv.replicas == [[endpoints[0][0]], [endpoints[1][0]]]
        assert (await drv.run(*batch(1))).path == [endpoints[0][0], endpoints[1][0]]
        # Vouched for: the stranger's record does not count.
        drv.update(loads)
        assert drv.replicas[1] == [endpoints[1][0], endpoints[0][0]]  # as read, unvouched
        vouching = Vouching(client.who_serves, client.identity.peer_id_hex)
        drv.update(await vouching.counted(loads))
        assert drv.replicas == [[endpoints[0][0]], [endpoints[1][0]]]
        traces = [await drv.run(*batch(seed)) for seed in range(2)]
    assert all(t.path == [endpoints[0][0], endpoints[1][0]] and not t.retries for t in traces)


async def test_a_replica_that_serves_another_stage_now_is_dropped_from_that_stage_not_shunned():
    """A driver that read a replica's record before it moved draws it for its old stage:
    refused (wrong stage), it is no longer drawn there, and still drawn for the stage it
    serves (a shunned address would be lost to every stage for 30 s)."""

    class FirstDrawn(random.Random):
        def choices(self, population, weights=None, **_):
            return [population[0]]

    local, one, two = gpt_stages(CONFIG, 3, seed=5)
    first = StageReplica(local, first=True, last=False)
    services = [service_of(one, 1, 3, "int8"), service_of(two, 2, 3, "int8")]
    config = DriverConfig(audit_share=0.0)
    async with pipeline([[s] for s in services], first, config=config) as (drv, endpoints):
        (at_one,), (at_two,) = endpoints
        drv.replicas, drv.rng = [[at_two, at_one], [at_two]], FirstDrawn()
        trace = await drv.run(*batch(0))
        assert trace.retries == 1 and trace.path == [at_one, at_two]
        assert drv.replicas == [[at_one], [at_two]] and not drv.shunned
        assert (await drv.run(*batch(1))).retries == 0


class _Flip(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        return -grad


class FlippedGradient(torch.nn.Module):
    """A liar's stage: honest outputs and parameter gradients, and the input gradient it
    returns sign-flipped (the stages before it would climb the loss). Every value is in
    bounds and finite."""

    def __init__(self, stage: GPTStage) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        return self.stage(_Flip.apply(x), targets)


class LyingAuditor(StageReplica):
    """A liar that serves its micro-batches honestly and answers audits of the others'
    with the input gradient flipped (to frame the replica audited)."""

    def audit(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        out, grad = super().audit(*args, **kwargs)
        return out, -grad


class WrongOnce(StageReplica):
    """An honest replica whose first answer is wrong (as an answer from before a round
    its auditors have since landed can look): one strike, cleared by the next audit."""

    wrong = True

    def backward(self, micro_batch, grad_output):  # type: ignore[no-untyped-def]
        grad = super().backward(micro_batch, grad_output)
        if self.wrong and grad is not None:
            self.wrong = False
            return -grad
        return grad


def nudged(stage: GPTStage, seed: int) -> GPTStage:
    """A copy of ``stage`` whose weights moved a little, as an honest replica's own steps
    since its stage's round move them."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in stage.parameters():
            p.add_(0.02 * p.abs().mean() * torch.randn(p.shape, generator=g))
    return stage


@pytest.mark.parametrize("liar", ["on-its-path", "in-audits"])
async def test_a_replica_that_answers_wrong_in_bounds_is_found_out_and_no_longer_drawn(liar):
    local, remote = gpt_stages(CONFIG, 2, seed=5)
    first = StageReplica(local, first=True, last=False)
    honest = [service_of(nudged(gpt_stages(CONFIG, 2, seed=5)[1], s), 1, 2, "int8")
              for s in (1, 2)]  # fmt: skip
    if liar == "on-its-path":
        lying = service_of(
            remote, 1, 2, "int8", StageReplica(FlippedGradient(remote), first=False, last=True)
        )
    else:
        lying = service_of(remote, 1, 2, "int8", LyingAuditor(remote, first=False, last=True))
    config = DriverConfig(audit_share=1.0, max_audits=1)
    async with pipeline([[*honest, lying]], first, config=config) as (drv, endpoints):
        drv.rng = random.Random(7)
        events: list[dict[str, object]] = []
        drv.on_event = lambda event, **fields: events.append({"event": event, **fields})
        liar_at = endpoints[0][2]
        for seed in range(60):
            await drv.run(*batch(seed))
            await drv.finish_audits()
            if drv.audits["found-out"]:
                break
        assert list(drv.distrusted) == [liar_at], (drv.audits, events)
        assert liar_at in drv.unserving()
        assert events[0]["event"] == "replica-distrusted" and events[0]["endpoint"] == liar_at
        assert drv.audits["agreed"] > 0 and drv.audits["found-out"] == 1
        # From now on it is drawn neither for a hop nor for an audit.
        audited_at = lying.replica.served
        for seed in range(100, 110):
            trace = await drv.run(*batch(seed))
            assert liar_at not in trace.path
        await drv.finish_audits()
        assert lying.replica.served == audited_at and drv.audits["found-out"] == 1


async def test_one_wrong_answer_is_a_strike_and_an_audit_agreed_in_clears_it():
    local, remote = gpt_stages(CONFIG, 2, seed=8)
    first = StageReplica(local, first=True, last=False)
    heads = [service_of(nudged(gpt_stages(CONFIG, 2, seed=8)[1], s), 1, 2, "int8")
             for s in (1, 2)]  # fmt: skip
    once = WrongOnce(remote, first=False, last=True)
    config = DriverConfig(audit_share=1.0, max_audits=1)
    async with pipeline([[*heads, service_of(remote, 1, 2, "int8", once)]], first,
                        config=config) as (drv, endpoints):  # fmt: skip
        drv.rng = random.Random(11)
        struck = False
        for seed in range(60):
            await drv.run(*batch(seed))
            await drv.finish_audits()
            struck = struck or drv.strikes[endpoints[0][2]] == 1
            if struck and once.served >= 3 and not drv.strikes:
                break
        assert struck and drv.audits["judged-wrong"] == 1, drv.audits
        assert not drv.strikes and not drv.distrusted and drv.audits["found-out"] == 0


async def test_two_replicas_that_do_not_agree_are_a_dispute_and_nobody_is_distrusted():
    """With one honest replica and one liar a driver cannot tell which lied: it counts the
    dispute and draws both as before."""
    local, remote = gpt_stages(CONFIG, 2, seed=6)
    first = StageReplica(local, first=True, last=False)
    honest = service_of(gpt_stages(CONFIG, 2, seed=6)[1], 1, 2, "int8")
    lying = service_of(remote, 1, 2, "int8", StageReplica(FlippedGradient(remote),
                                                          first=False, last=True))  # fmt: skip
    config = DriverConfig(audit_share=1.0, max_audits=1)
    async with pipeline([[honest, lying]], first, config=config) as (drv, _):
        drv.rng = random.Random(3)
        for seed in range(8):
            await drv.run(*batch(seed))
            await drv.finish_audits()
    assert drv.audits["disputed"] == 8 and not drv.distrusted
    assert drv.audits["found-out"] == 0


async def test_hostile_session_calls_are_refused_and_counted_and_a_session_is_its_drivers():
    local, remote = gpt_stages(CONFIG, 2, seed=4)
    service = service_of(remote, 1, 2, "f32")
    first = StageReplica(local, first=True, last=False)
    async with pipeline([[service]], first, config=DriverConfig(encoding="f32")) as (drv, ends):
        endpoint = ends[0][0]
        channel = await drv.client.open(endpoint, 10.0)
        method = channel.unary_stream(
            SESSION.path,
            request_serializer=pb.SessionRequest.SerializeToString,
            response_deserializer=pb.SessionEvent.FromString,
        )

        async def first_event(**fields: object) -> tuple[object, pb.SessionEvent]:
            request = pb.SessionRequest(swarm_id=SWARM, stage=1, session=b"s" * 16)
            for field, value in fields.items():
                setattr(request, field, value)
            call = method(request, timeout=30.0)
            async for event in call:
                return call, event
            raise AssertionError("no event")

        def refused(event: pb.SessionEvent) -> str:
            assert not event.open, event
            return event.refused.code

        with drv.client.holding(channel):
            assert refused((await first_event(session=b"x"))[1]) == "malformed"
            assert refused((await first_event(stage=0))[1]) == "wrong-stage"
            held, opened = await first_event()
            assert opened.open and service.replica.sessions == 1
            assert refused((await first_event())[1]) == "malformed"  # its name is taken
            # A forward naming a session not open is not held (nobody would come back).
            x, y = batch(0)
            h = local(x)
            request = pb.ForwardRequest(
                swarm_id=SWARM, stage=1, micro_batch=os.urandom(16), input=pack(h, "f32"),
                targets=pack(y, "i64"), session=b"n" * 16,
            )  # fmt: skip
            answer = await drv.client.call(endpoint, FORWARD, request, timeout=10.0)
            assert answer.refused.code == "busy" and "session" in answer.refused.reason
            request.session = b"s" * 16
            answer = await drv.client.call(endpoint, FORWARD, request, timeout=10.0)
            assert answer.WhichOneof("outcome") == "loss" and service.replica.inflight == 1
            held.cancel()  # its driver leaves: the input is dropped
            for _ in range(600):
                if service.replica.orphaned:
                    break
                await asyncio.sleep(0.05)
            assert service.replica.orphaned == 1 and service.replica.inflight == 0
        await drv.run(x, y)  # the driver's own session, and its micro-batch, go on
    assert service.replica.micro_batches == 1
    assert dict(service.refused) == {"malformed": 2, "wrong-stage": 1, "busy": 1}


async def test_hostile_attend_calls_end_and_are_counted_and_a_silent_one_ends_its_session():
    """A session that beats (``Attend``): a call that names no session, or a bad one, opens
    nothing; the replica beats back while the session is open; a beat that is not a
    ``SessionRequest`` ends its session, as silence does (the inputs it held dropped), and
    so do beats far more often than asked; a driver that closes its side leaves."""
    local, remote = gpt_stages(CONFIG, 2, seed=4)
    config = ReplicaConfig(session_beat_s=0.2, session_silence_s=2.0)
    service = service_of(remote, 1, 2, "f32", StageReplica(remote, first=False, last=True,
                                                           config=config))  # fmt: skip
    first = StageReplica(local, first=True, last=False)
    config_f32 = DriverConfig(encoding="f32", sessions=False)
    async with pipeline([[service]], first, config=config_f32) as (drv, ends):
        endpoint = ends[0][0]
        channel = await drv.client.open(endpoint, 10.0)
        method = channel.stream_stream(
            ATTEND.path,
            request_serializer=lambda b: b,
            response_deserializer=pb.SessionEvent.FromString,
        )
        named = pb.SessionRequest(swarm_id=SWARM, stage=1, session=b"s" * 16).SerializeToString()

        async def events(*messages: bytes, close: bool = False) -> list[pb.SessionEvent]:
            """Send ``messages``, then nothing (or close our side); the events, to the end."""
            call = method(timeout=30.0)
            # (The replica may end the call before the last are written.)
            with contextlib.suppress(asyncio.InvalidStateError, grpc.aio.AioRpcError):
                for message in messages:
                    await call.write(message)
                if close:
                    await call.done_writing()
            return [event async for event in call]

        @contextlib.asynccontextmanager
        async def beating(call: grpc.aio.StreamStreamCall) -> AsyncIterator[None]:
            """A beat on ``call`` every 0.1 s meanwhile."""

            async def beat() -> None:
                while True:
                    await call.write(b"")
                    await asyncio.sleep(0.1)

            task = asyncio.create_task(beat())
            try:
                yield
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                    await task

        async def rest_of(call: grpc.aio.StreamStreamCall) -> list[pb.SessionEvent]:
            """What the replica answers on ``call`` from now to the end."""
            events = []
            while (event := await call.read()) is not grpc.aio.EOF:
                events.append(event)
            return events

        x, y = batch(0)
        h = local(x)

        async def held() -> None:
            """A micro-batch held under the session named ``s`` * 16."""
            request = pb.ForwardRequest(
                swarm_id=SWARM, stage=1, micro_batch=os.urandom(16), input=pack(h, "f32"),
                targets=pack(y, "i64"), session=b"s" * 16,
            )  # fmt: skip
            answer = await drv.client.call(endpoint, FORWARD, request, timeout=10.0)
            assert answer.WhichOneof("outcome") == "loss", answer

        with drv.client.holding(channel):
            assert await events() == []  # named nothing within the silence: closed
            assert [e.refused.code for e in await events(b"\xff\xff")] == ["malformed"]
            wrong = pb.SessionRequest(swarm_id=SWARM, stage=0, session=b"s" * 16)
            assert [e.refused.code for e in await events(wrong.SerializeToString())] == [
                "wrong-stage"
            ]
            # Opened, told its beat, beaten while a micro-batch comes (no race with the
            # silence), then silent: ended for its silence, the input dropped.
            call = method(timeout=30.0)
            await call.write(named)
            opened = await call.read()
            assert opened.open and opened.beat_ms == 200 and service.replica.sessions == 1
            async with beating(call):
                await held()
            beats = await rest_of(call)  # the replica's beats, then the end
            assert beats and all(e.open for e in beats), beats
            await wait_for(lambda: service.replica.orphaned == 1, timeout=60)
            assert service.silent == 1 and service.replica.inflight == 0
            # A bad beat ends it too.
            call = method(timeout=30.0)
            await call.write(named)
            assert (await call.read()).open
            async with beating(call):
                await held()
            await call.write(b"\xff\xff")  # (at most 0.1 s after the last beat)
            assert [e.refused.code for e in await rest_of(call) if not e.open] == ["malformed"]
            await wait_for(lambda: service.replica.orphaned == 2, timeout=60)
            # Beats far faster than asked (17 within one interval of 0.2 s) end it.
            answers = await events(named, *[b""] * 40)
            assert answers[0].open
            assert [e.refused.code for e in answers[1:] if not e.open] == ["malformed"]
            # Its driver leaves (closes its side): ended, not silent.
            opened, *rest = await events(named, close=True)
            assert opened.open and all(e.open for e in rest) and service.silent == 1
    assert dict(service.refused) == {"malformed": 3, "wrong-stage": 1}


async def test_a_driver_whose_own_loop_was_held_does_not_take_its_replica_for_lost():
    """A driver's event loop held past the silence (a machine that froze and came back, or
    a long compute on the loop) hears no beat meanwhile, as its replica's (here in the same
    process) could not come: the quiet is its own, and the session goes on."""
    local, remote = gpt_stages(CONFIG, 2, seed=4)
    config = ReplicaConfig(session_beat_s=0.2, session_silence_s=5.0)
    service = service_of(remote, 1, 2, "f32", StageReplica(remote, first=False, last=True,
                                                           config=config))  # fmt: skip
    first = StageReplica(local, first=True, last=False)
    driver = DriverConfig(encoding="f32", replica_silence_s=1.0)
    async with pipeline([[service]], first, config=driver) as (drv, ends):
        await drv.run(*batch(0))
        await wait_for(lambda: drv.sessions == 1, timeout=60)
        session = drv._sessions[ends[0][0]]
        time.sleep(3.0)  # the loop held three times the driver's silence
        await drv.run(*batch(1))
        assert not session.lost.is_set() and drv.sessions == 1
        assert not drv.unserving()
    assert service.silent == 0 and service.replica.micro_batches == 2


async def test_a_replica_flooding_its_drivers_session_with_beats_loses_the_session():
    """A hostile replica answers a driver's session and then beats without pause: each beat
    costs the driver's event loop a read, so more than 16 within the interval it asked for
    end the session (the driver asks for no other there for a while)."""

    async def flood(requests: object, context: grpc.aio.ServicerContext) -> None:
        await anext(aiter(requests))  # its first message
        await context.write(pb.SessionEvent(open=True, beat_ms=2000))
        while True:
            await context.write(pb.SessionEvent(open=True))

    handlers = {
        "Attend": grpc.stream_stream_rpc_method_handler(
            flood,
            request_deserializer=pb.SessionRequest.FromString,
            response_serializer=pb.SessionEvent.SerializeToString,
        )
    }
    generic = grpc.method_handlers_generic_handler("swarmloco.v1.Stage", handlers)
    hostile = Service(
        "swarmloco.v1.Stage", lambda server: server.add_generic_rpc_handlers((generic,))
    )
    first = StageReplica(gpt_stages(CONFIG, 2, seed=4)[0], first=True, last=False)
    async with NetNode(
        identity=Identity.generate(), config=NodeConfig(), services=[hostile]
    ) as node:
        client = NetNode(
            identity=Identity.generate(), config=NodeConfig(server=None, peers=(node.endpoint,))
        )
        async with client:
            drv = Driver(client.client, first, swarm_id=SWARM, replicas=[[node.endpoint]],
                         boundaries=[ACTS], ids=IDS)  # fmt: skip
            try:
                drv._session(node.endpoint, 1)  # as a forward there asks for one
                session = drv._sessions[node.endpoint]
                await wait_for(lambda: session.ended_at is not None, timeout=60)
                assert not session.lost.is_set()  # ended, not taken for lost (it answered)
                assert drv._session(node.endpoint, 1) == b""  # none asked for again yet
            finally:
                drv.close()


async def test_a_driver_opens_a_session_with_each_replica_it_uses_unless_told_not_to():
    for sessions in (True, False):
        local, remote = gpt_stages(CONFIG, 2, seed=4)
        service = service_of(remote, 1, 2, "f32")
        first = StageReplica(local, first=True, last=False)
        config = DriverConfig(encoding="f32", sessions=sessions)
        async with pipeline([[service]], first, config=config) as (drv, _):
            for seed in range(3):
                await drv.run(*batch(seed))
                if not sessions or drv.sessions:
                    break
            for _ in range(600):  # it opens beside the first micro-batches
                if drv.sessions == int(sessions):
                    break
                await asyncio.sleep(0.05)
            assert drv.sessions == service.replica.sessions == int(sessions)
            await drv.run(*batch(5))
        assert service.replica.micro_batches >= 2


async def test_hostile_audit_calls_are_refused_and_counted():
    local, remote = gpt_stages(CONFIG, 3, seed=7)[:2]
    service = service_of(remote, 1, 3, "int8")
    first = StageReplica(local, first=True, last=False)
    async with pipeline([[service]], first) as (drv, endpoints):
        good = torch.randn(4, CONFIG.seq_len, CONFIG.n_embd)

        async def audit(**fields: object) -> str:
            request = pb.AuditRequest(swarm_id=SWARM, **{"stage": 1, **fields})  # type: ignore[arg-type]
            answer = await drv.client.call(endpoints[0][0], AUDIT, request, timeout=10.0)
            assert answer.WhichOneof("outcome") == "refused", answer
            return answer.refused.code

        assert await audit(input=pack(good, "f32")) == "bad-shape"  # no output gradient
        assert await audit(input=pack(good, "f32"), stage=0) == "wrong-stage"
        wrong = pack(torch.randn(4, CONFIG.seq_len, CONFIG.n_embd + 1), "f32")
        assert await audit(input=pack(good, "f32"), grad_output=wrong) == "bad-shape"
        huge = good.clone()
        huge[0, 0, 0] = 1e30
        assert await audit(input=pack(good, "f32"), grad_output=pack(huge, "f32")) == (
            "out-of-bounds"
        )
        request = pb.AuditRequest(swarm_id=SWARM, stage=1, input=pack(good, "int8"),
                                  grad_output=pack(good, "int8"))  # fmt: skip
        answer = await drv.client.call(endpoints[0][0], AUDIT, request, timeout=10.0)
        assert answer.WhichOneof("outcome") == "answer"
        assert tuple(answer.answer.grad_input.shape) == tuple(good.shape)
    assert service.replica.inflight == 0 and service.replica.micro_batches == 0
    assert all(p.grad is None for p in remote.parameters())
    assert dict(service.refused) == {"wrong-stage": 1, "bad-shape": 2, "out-of-bounds": 1}
