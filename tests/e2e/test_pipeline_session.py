"""A driver's sessions (DESIGN section 10, "Weights a backward runs against"): a stage-0
driver in a process of its own is SIGKILLed while a micro-batch of it is held at stage 1
and computing at stage 2; both replicas drop its input as soon as the driver's sessions
end with its connections, long before any deadline (theirs are an hour here), so the step
it held back is not held back. SIGSTOPped instead (a machine that froze or dropped off its
network: no connection closes), its sessions fall silent, and end so."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest
import torch

from swarmloco.net.identity import Identity
from swarmloco.net.node import NetNode, NodeConfig
from swarmloco.net.rejections import RejectionLog
from swarmloco.net.server import Pool
from swarmloco.pipeline.driver import Driver, DriverConfig, PipelineError
from swarmloco.pipeline.replica import ReplicaConfig, StageReplica
from swarmloco.pipeline.service import StageService
from swarmloco.pipeline.stages import gpt_stages
from swarmloco.pipeline.wire import Boundary
from swarmloco.train.spec import GPTConfig

pytestmark = pytest.mark.timeout(180)

SWARM = "5b" * 20
SHAPE = dict(vocab_size=256, seq_len=16, n_layer=3, n_head=2, n_embd=32)
CONFIG = GPTConfig(**SHAPE)  # type: ignore[arg-type]
IDS = Boundary(width=0, max_batch=8, max_tokens=CONFIG.seq_len, vocab=CONFIG.vocab_size)
ACTS = Boundary(width=CONFIG.n_embd, max_batch=8, max_tokens=CONFIG.seq_len)
NO_DEADLINE = ReplicaConfig(
    inflight_s=3600.0, inflight_floor_s=3600.0, session_beat_s=0.5, session_silence_s=5.0
)

DRIVER = """
import asyncio, sys
import torch
from swarmloco.net.identity import Identity
from swarmloco.net.node import NetNode, NodeConfig
from swarmloco.pipeline.driver import Driver, DriverConfig
from swarmloco.pipeline.replica import StageReplica
from swarmloco.pipeline.stages import gpt_stages
from swarmloco.pipeline.wire import Boundary
from swarmloco.train.spec import GPTConfig

config = GPTConfig(**{shape!r})
ids = Boundary(width=0, max_batch=8, max_tokens=config.seq_len, vocab=config.vocab_size)
acts = Boundary(width=config.n_embd, max_batch=8, max_tokens=config.seq_len)


async def main(one, two):
    first = StageReplica(gpt_stages(config, 3, seed=5)[0], first=True, last=False)
    node_config = NodeConfig(server=None, peers=(one,))
    async with NetNode(identity=Identity.generate(), config=node_config) as node:
        driver = Driver(
            node.client, first, swarm_id={swarm!r}, replicas=[[one], [two]],
            boundaries=[acts, acts], ids=ids, config=DriverConfig(encoding="f32"),
        )
        tokens = torch.randint(0, config.vocab_size, (2, config.seq_len + 1))
        await driver.run(tokens[:, :-1], tokens[:, 1:])  # its sessions open meanwhile
        while driver.sessions < 2:
            await asyncio.sleep(0.01)
        print("sessions", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        await driver.run(tokens[:, :-1], tokens[:, 1:])  # killed under way


asyncio.run(main(*sys.argv[1:]))
"""


class Gated(torch.nn.Module):
    """The last stage, whose forward (not its backward's recompute) waits at a gate once
    armed."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.armed = False
        self.entered = threading.Event()
        self.release = threading.Event()

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.armed and not torch.is_grad_enabled():
            self.entered.set()
            self.release.wait(timeout=120)
        return self.inner(x, targets)


def service(module: torch.nn.Module, stage: int) -> StageService:
    last = stage == 2
    return StageService(
        StageReplica(module, first=False, last=last, config=NO_DEADLINE),
        swarm_id=SWARM,
        stage=stage,
        inputs=ACTS,
        outputs=None if last else ACTS,
        targets=IDS if last else None,
        encoding="f32",
        rejections=RejectionLog(logging.getLogger("swarmloco.pipeline")),
    )


async def until(what: str, condition: Callable[[], bool], timeout: float = 60.0) -> None:
    """Wait for ``condition`` (checked every 50 ms) up to ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f} s: {what}")
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
async def test_a_lost_drivers_micro_batch_is_dropped_where_it_is_held_when_its_sessions_end(how):
    _, middle, tail = gpt_stages(CONFIG, 3, seed=5)
    gated = Gated(tail)
    services = [service(middle, 1), service(gated, 2)]
    async with contextlib.AsyncExitStack() as stack:
        nodes = []
        for s in services:
            stack.callback(s.close)
            peers = (nodes[0].endpoint,) if nodes else ()
            node = NetNode(identity=Identity.generate(), config=NodeConfig(peers=peers),
                           services=[s.service()])  # fmt: skip
            nodes.append(await stack.enter_async_context(node))
        script = DRIVER.format(shape=SHAPE, swarm=SWARM)
        driver = subprocess.Popen(
            [sys.executable, "-c", script, nodes[0].endpoint, nodes[1].endpoint],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        stack.callback(driver.kill)
        loop = asyncio.get_running_loop()
        line = await asyncio.wait_for(loop.run_in_executor(None, driver.stdout.readline), 120)
        assert line == b"sessions\n", driver.stderr.read().decode()[-3000:]
        one, two = (s.replica for s in services)
        assert one.sessions == two.sessions == 1 and one.micro_batches == 1
        assert all(n.server.slots.in_use(Pool.SESSION) == 1 for n in nodes)
        gated.armed = True
        driver.stdin.write(b"go\n")
        driver.stdin.flush()
        assert await loop.run_in_executor(None, gated.entered.wait, 120)
        assert one.inflight == 1  # held at stage 1 for its backward; computing at stage 2
        os.kill(driver.pid, how)
        if how == signal.SIGKILL:
            await loop.run_in_executor(None, driver.wait)
        await until("stage 1 drops the lost driver's input", lambda: one.orphaned == 1)
        assert one.inflight == 0 and one.sessions == 0
        gated.release.set()  # the forward under way ends, for nobody
        await until("stage 2 drops it once computed", lambda: two.orphaned == 1)
        assert two.inflight == 0 and two.sessions == 0
        assert one.dropped == two.dropped == 0  # no deadline passed: the sessions said
        # A frozen driver's sessions ended for their silence (its connections stay open).
        expected = 1 if how == signal.SIGSTOP else 0
        assert [s.silent for s in services] == [expected, expected]
        await until(
            "the sessions' slots come back",
            lambda: all(n.server.slots.in_use(Pool.SESSION) == 0 for n in nodes),
        )


REPLICA = """
import asyncio, logging, sys
from swarmloco.net.identity import Identity
from swarmloco.net.node import NetNode, NodeConfig
from swarmloco.net.rejections import RejectionLog
from swarmloco.pipeline.replica import StageReplica
from swarmloco.pipeline.service import StageService
from swarmloco.pipeline.stages import gpt_stages
from swarmloco.pipeline.wire import Boundary
from swarmloco.train.spec import GPTConfig

config = GPTConfig(**{shape!r})
ids = Boundary(width=0, max_batch=8, max_tokens=config.seq_len, vocab=config.vocab_size)
acts = Boundary(width=config.n_embd, max_batch=8, max_tokens=config.seq_len)


async def main():
    replica = StageReplica(gpt_stages(config, 2, seed=5)[1], first=False, last=True)
    service = StageService(
        replica, swarm_id={swarm!r}, stage=1, inputs=acts, outputs=None, targets=ids,
        encoding="f32", rejections=RejectionLog(logging.getLogger("swarmloco.pipeline")),
    )
    async with NetNode(identity=Identity.generate(), config=NodeConfig(),
                       services=[service.service()]) as node:
        print(node.endpoint, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)


asyncio.run(main())
"""


async def test_a_driver_fails_its_call_to_a_replica_that_froze_at_its_sessions_silence():
    """A stage replica in a process of its own answers one micro-batch, then is SIGSTOPped
    (a machine that froze or dropped off its network: its connections stay open). The
    driver's next micro-batch, sent there, fails once the replica's beats stop on the
    session (3 s here), not at its hop's deadline (an hour here), and the replica is
    shunned."""
    first = StageReplica(gpt_stages(CONFIG, 2, seed=5)[0], first=True, last=False)
    script = REPLICA.format(shape=SHAPE, swarm=SWARM)
    replica = subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    loop = asyncio.get_running_loop()
    try:
        line = await asyncio.wait_for(loop.run_in_executor(None, replica.stdout.readline), 120)
        endpoint = line.decode().strip()
        assert endpoint, replica.stderr.read().decode()[-3000:]
        config = DriverConfig(encoding="f32", hop_timeout_s=3600.0, replica_silence_s=3.0)
        node_config = NodeConfig(server=None, peers=(endpoint,))
        async with NetNode(identity=Identity.generate(), config=node_config) as node:
            driver = Driver(
                node.client, first, swarm_id=SWARM, replicas=[[endpoint]],
                boundaries=[ACTS], ids=IDS, config=config,
            )  # fmt: skip
            try:
                tokens = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.seq_len + 1))
                await driver.run(tokens[:, :-1], tokens[:, 1:])
                await until("the session opens", lambda: driver.sessions == 1)
                os.kill(replica.pid, signal.SIGSTOP)
                with pytest.raises(PipelineError, match="fell silent"):
                    await driver.run(tokens[:, :-1], tokens[:, 1:])
                assert endpoint in driver.unserving() and driver.sessions == 0
            finally:
                driver.close()
    finally:
        replica.kill()
        replica.wait()
