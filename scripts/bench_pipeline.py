#!/usr/bin/env python3
"""A two-stage pipeline of the built-in GPT over real gRPC on loopback, in eight parts
(``--parts``, all by default). Prints ONE JSON object.

- ``wiring``: stochastic wiring against a heterogeneous stage: micro-batches per second
  when stage 1 has a fast and a slow replica and the drivers draw the next hop by what
  they measured (the project's ``Driver``), against two baselines: a *fixed* pipeline
  (driver k always through replica k, as static pipelines are wired) and a *uniform* draw
  (random wiring blind to speed). ``stochastic_over_fixed`` (target >= 1.5).
- ``activations``: the same micro-batches of real text (the standard library's source)
  trained through the pipeline with int8 activations and gradients, and with f32: bytes
  per micro-batch between the stages (``activation_bytes_ratio``, target <= 0.27) and the
  mean loss of the last ``--loss-window`` micro-batches (``activation_loss_ratio``,
  target <= 1.01).
- ``kill``: one of two stage-1 replicas, each a process of its own, is SIGKILLed while a
  forward of the driver is on it, ``--kill-trials`` times: the seconds from the kill to the
  next micro-batch through the pipeline (the retry on the other replica), the micro-batches
  lost, and the hangs (a micro-batch not done in ``--hang-s``): ``kill_trials``,
  ``kill_hangs``, ``kill_retry_s_median``. With ``--kill-signal stop`` the replica is
  SIGSTOPped instead (a machine that froze or dropped off its network: its connections
  stay open), and each trial runs twice, in turn: with the driver's sessions, whose beats
  stop (DESIGN section 10), and without them (``DriverConfig.sessions=False``: the call
  fails at its deadline, ``hop_timeout_s``): ``kill_retry_s_by_arm`` (medians) and
  ``kill_retry_ratio``.
- ``driver-kill``: a stage-0 driver in a process of its own is SIGKILLed while a
  micro-batch of it is held at stage 1 (of three) and computing at stage 2, its replicas
  stepping every 2 micro-batches; another driver then drives on. The seconds from the kill
  until both replicas took a step (the dead driver's input held back the one it was
  admitted to), with the driver's sessions (DESIGN section 10: the replicas drop its
  inputs when its connections close) and without (``DriverConfig.sessions=False``: they
  wait for their deadline, 30 s at least), ``--driver-kill-trials`` each, in turn:
  ``driver_kill_step_s`` (medians) and ``driver_kill_step_ratio``. With
  ``--driver-signal stop`` the driver is SIGSTOPped instead (a machine that froze, slept or
  dropped off its network: its connections stay open, nothing answers on them) and killed
  once the trial ends.
- ``memory``: the bytes of what a stage peer holds of the model (parameters, gradients,
  AdamW's two moments) against the whole model's (target about 1/S). A stage peer's
  process builds its stage alone (``build_stage``), so it holds only these.
- ``parity``: 2 stages x 2 replicas (real stage peers, in this process) against DiLoCo
  data-parallel (two library peers over the whole model) on the same micro-batches of
  real text, the same spec and the same initial weights (``_pipeline_parity.py``):
  ``pipeline_over_diloco``, the ratio of their held-out losses (the median of
  ``--parity-repeats`` runs each), ``stage_digests_agree``, and how many rounds the
  replicas of each stage averaged together in each run (``stage_rounds_together``;
  ``--parity-arms pipeline`` repeats the pipeline alone, to count runs where they never
  did).

- ``inflight``: one driver keeping 1, 2, 4 ... micro-batches in the pipeline at once
  (``--in-flight-counts``), through one stage-1 replica over gRPC, both stages stepping
  every ``--inflight-step-samples`` sequences (replicas admit no more than a step's: a
  step is on the run's batch, and the micro-batches of one step are all that can be in
  flight at a stage): micro-batches per second at each count (the median of
  ``--repeats`` runs, in turn), ``inflight_speedup`` (the best count's rate over one's),
  and the most sequences any step was on (``inflight_step_samples_max``: the step's,
  however many are in flight).

- ``scaling``: why a pipeline over slow links works (the SWARM paper's square-cube law), at
  one middle stage of the built-in Llama (``--scaling-layers`` blocks; per width of
  ``--scaling-widths``: 64-wide heads, a quarter as many key-value heads, SwiGLU of 8/3 the
  width) on ``--device``: its compute per micro-batch (a forward, then the backward with
  the forward recomputed, as a replica runs them, in ``--precision``: by default bf16
  autocast on a GPU and fp32 on the CPU, as a stage peer chooses; the median of 5 after 2)
  against what it sends and receives for it (int8 activations in and out, int8 gradients
  back and on: the serialized tensors), and ``compute_over_transfer``, the compute's
  seconds over the larger direction's at ``--link-mbps`` (a full-duplex link; 100 Mb/s by
  default). Compute
  grows with the width's square per token, traffic with the width: the ratio grows with it.

    python scripts/bench_pipeline.py                   # 2 drivers, the slow replica 3x slower
    python scripts/bench_pipeline.py --parts wiring --slow-factor 2 --micro-batches 40
    python scripts/bench_pipeline.py --parts activations,kill --kill-trials 10
    python scripts/bench_pipeline.py --parts driver-kill --driver-kill-trials 3
    python scripts/bench_pipeline.py --parts kill --kill-trials 3 --kill-signal stop
    python scripts/bench_pipeline.py --parts parity --layers 2 --width 64 --seq-len 64
    python scripts/bench_pipeline.py --parts scaling --scaling-widths 256,512,1024,2048
    python scripts/bench_pipeline.py --parts scaling --device cuda --batch 8 --seq-len 1024 \
        --scaling-widths 1024,2048,4096,8192 --scaling-layers 4     # a GPU
    python scripts/bench_pipeline.py --parts parity --parity-arms pipeline --parity-repeats 30 \
        --layers 2 --width 64 --seq-len 64

Wiring, on loopback: each stage-1 replica is served by its own ``NetNode`` (gRPC, the
``swarmloco.v1.Stage`` service, int8 activations), and ``--drivers`` stage-0 drivers, each
with its own stage-0 replica and client, run ``--micro-batches`` each at once. The slow
replica's every forward sleeps ``--slow-s`` more (a slower machine that uses no CPU of
this one): by default ``--slow-factor`` - 1 times a stage-1 micro-batch's compute as
measured first, so that it is that many times slower (the design's setting: 3).
Replicas step their optimizers every 8 sequences. Each arm runs once to warm
up, then ``--repeats`` times, in turn; per arm: the median micro-batches per second and the fast
replica's share of them; the ratios of the measured draw's rate to each baseline's; and
how much slower the slow replica is (its seconds per micro-batch over the fast one's, as
they measured their own compute).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import random
import signal
import statistics
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import machine
from _pipeline_parity import parity

from swarmloco.net.identity import Identity
from swarmloco.net.node import NetNode, NodeConfig
from swarmloco.net.rejections import RejectionLog
from swarmloco.pipeline.driver import Driver, DriverConfig, PipelineError
from swarmloco.pipeline.replica import ReplicaConfig, StageReplica
from swarmloco.pipeline.service import StageService
from swarmloco.pipeline.stages import GPTStage, build_stage, gpt_stages
from swarmloco.pipeline.wire import Boundary, pack
from swarmloco.train.model import GPT
from swarmloco.train.spec import GPTConfig, LlamaConfig

SWARM = "be" * 20
CHILD_FLAGS = {"serve_replica", "serve_driver", "driver_endpoints", "driver_sessions"}
"""How the bench starts its own child processes: no setting of a run."""


class Uniform(random.Random):
    """The baseline's draw: every replica not yet tried alike, whatever was measured."""

    def choices(self, population, weights=None, *, cum_weights=None, k=1):  # type: ignore[override]
        return super().choices(population, k=k)


class Slowed(torch.nn.Module):
    def __init__(self, stage: GPTStage, delay: float) -> None:
        super().__init__()
        self.stage, self.delay = stage, delay

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        time.sleep(self.delay)
        return self.stage(x, targets)


def replica(
    module: torch.nn.Module, *, first: bool, last: bool, step_samples: int = 8
) -> StageReplica:
    return StageReplica(
        module,
        first=first,
        last=last,
        optimizer=torch.optim.AdamW(module.parameters(), lr=1e-3),
        config=ReplicaConfig(step_samples=step_samples),
    )


async def run_arm(args: argparse.Namespace, config: GPTConfig, arm: str) -> dict[str, Any]:
    ids, acts = boundaries(config)
    heads = [
        replica(Slowed(head, delay) if delay else head, first=False, last=True)
        for head, delay in (
            (gpt_stages(config, 2, seed=1)[1], 0.0),
            (gpt_stages(config, 2, seed=1)[1], args.slow_s),
        )
    ]
    async with contextlib.AsyncExitStack() as stack:
        endpoints: list[str] = []
        for r in heads:
            service = head_service(r, config, "int8")
            node = NetNode(
                identity=Identity.generate(),
                config=NodeConfig(peers=tuple(endpoints[:1])),
                services=[service.service()],
            )
            await stack.enter_async_context(node)
            endpoints.append(node.endpoint)
        drivers = []
        for k in range(args.drivers):
            client = NetNode(
                identity=Identity.generate(), config=NodeConfig(server=None, peers=(endpoints[0],))
            )
            await stack.enter_async_context(client)
            first = replica(gpt_stages(config, 2, seed=1)[0], first=True, last=False)
            wired = [endpoints[k % len(endpoints)]] if arm == "fixed" else endpoints
            rng = Uniform(k) if arm == "uniform" else random.Random(k)
            drivers.append(Driver(client.client, first, swarm_id=SWARM, replicas=[wired],
                                  boundaries=[acts], ids=ids, rng=rng))  # fmt: skip

        async def drive(driver: Driver, seed: int) -> None:
            g = torch.Generator().manual_seed(seed)
            for _ in range(args.micro_batches):
                rows = torch.randint(0, config.vocab_size, (args.batch, config.seq_len + 1),
                                     generator=g)  # fmt: skip
                await driver.run(rows[:, :-1], rows[:, 1:])

        started = time.perf_counter()
        await asyncio.gather(*(drive(d, k) for k, d in enumerate(drivers)))
        seconds = time.perf_counter() - started
    done = args.drivers * args.micro_batches
    rates = [h.rate.value for h in heads]  # sequences per second of each one's own compute
    return {
        "seconds": round(seconds, 3),
        "micro_batches_per_s": round(done / seconds, 3),
        "fast_share": round(heads[0].served / max(1, heads[0].served + heads[1].served), 3),
        "slow_over_fast": round(rates[0] / rates[1], 2) if all(rates) else None,
    }


def compute_seconds(args: argparse.Namespace, config: GPTConfig) -> float:
    """A stage-1 replica's compute for one micro-batch (its forward, then its backward with
    the forward recomputed), the median of 7 after 2, in this process."""
    head = StageReplica(gpt_stages(config, 2, seed=1)[1], first=False, last=True)
    g = torch.Generator().manual_seed(0)
    times = []
    for i in range(9):
        x = torch.randn(args.batch, config.seq_len, config.n_embd, generator=g)
        y = torch.randint(0, config.vocab_size, (args.batch, config.seq_len), generator=g)
        name = i.to_bytes(16, "big")
        started = time.perf_counter()
        head.forward(name, x, y)
        head.backward(name, None)
        times.append(time.perf_counter() - started)
    return statistics.median(times[2:])


def boundaries(config: GPTConfig) -> tuple[Boundary, Boundary]:
    """What crosses the cut: token ids (and targets), and activations."""
    ids = Boundary(width=0, max_batch=8, max_tokens=config.seq_len, vocab=config.vocab_size)
    return ids, Boundary(width=config.n_embd, max_batch=8, max_tokens=config.seq_len)


def head_service(head: StageReplica, config: GPTConfig, encoding: str) -> StageService:
    ids, acts = boundaries(config)
    rejections = RejectionLog(logging.getLogger("swarmloco.pipeline"))
    return StageService(head, swarm_id=SWARM, stage=1, inputs=acts, outputs=None, targets=ids,
                        encoding=encoding, rejections=rejections)  # fmt: skip


def text_batches(config: GPTConfig, batch: int, count: int, seed: int) -> list[torch.Tensor]:
    """``count`` micro-batches of ``batch`` sequences of real text: byte windows of the
    standard library's own source at random offsets."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    corpus = b"".join(p.read_bytes() for p in sorted(stdlib.glob("[a-m]*.py"))[:40])
    data = torch.frombuffer(bytearray(corpus), dtype=torch.uint8).long()
    g = torch.Generator().manual_seed(seed)
    span = config.seq_len + 1
    starts = torch.randint(0, len(data) - span, (count, batch), generator=g)
    return [torch.stack([data[int(i) : int(i) + span] for i in row]) for row in starts]


async def train_through(
    args: argparse.Namespace, config: GPTConfig, encoding: str
) -> tuple[list[float], list[int]]:
    """The losses and bytes (sent and received by the driver) of each micro-batch of the
    same text trained through one stage-1 replica with activations as ``encoding``."""
    ids, acts = boundaries(config)
    local, remote = gpt_stages(config, 2, seed=1)
    head = replica(remote, first=False, last=True)
    service = head_service(head, config, encoding)
    losses, sizes = [], []
    node = NetNode(identity=Identity.generate(), config=NodeConfig(), services=[service.service()])
    async with node:
        client = NetNode(
            identity=Identity.generate(), config=NodeConfig(server=None, peers=(node.endpoint,))
        )
        async with client:
            driver = Driver(client.client, replica(local, first=True, last=False), swarm_id=SWARM,
                            replicas=[[node.endpoint]], boundaries=[acts], ids=ids,
                            config=DriverConfig(encoding=encoding))  # fmt: skip
            for rows in text_batches(config, args.batch, args.loss_micro_batches, seed=0):
                trace = await driver.run(rows[:, :-1], rows[:, 1:])
                losses.append(trace.loss)
                sizes.append(trace.bytes_sent + trace.bytes_received)
    return losses, sizes


def activations(args: argparse.Namespace, config: GPTConfig) -> dict[str, Any]:
    arms = {}
    for encoding in ("f32", "int8"):
        losses, sizes = asyncio.run(train_through(args, config, encoding))
        arms[encoding] = {
            "bytes_per_micro_batch": statistics.median(sizes),
            "loss_first": round(statistics.fmean(losses[: args.loss_window]), 5),
            "loss_last": round(statistics.fmean(losses[-args.loss_window :]), 5),
        }
    return {
        "activations": {"micro_batches": args.loss_micro_batches, **arms},
        "activation_bytes_ratio": round(
            arms["int8"]["bytes_per_micro_batch"] / arms["f32"]["bytes_per_micro_batch"], 4
        ),
        "activation_loss_ratio": round(arms["int8"]["loss_last"] / arms["f32"]["loss_last"], 5),
    }


def serve_replica(args: argparse.Namespace, config: GPTConfig) -> int:
    """(A child of the kill part.) Serve stage 1 until killed; print the endpoint."""
    head = replica(gpt_stages(config, 2, seed=1)[1], first=False, last=True)
    service = head_service(head, config, "int8")

    async def serve() -> None:
        node = NetNode(identity=Identity.generate(), config=NodeConfig(),
                       services=[service.service()])  # fmt: skip
        async with node:
            print(node.endpoint, flush=True)
            await asyncio.Event().wait()

    asyncio.run(serve())
    return 0


def start_replica(args: argparse.Namespace) -> tuple[subprocess.Popen[str], str]:
    command = [sys.executable, __file__, "--serve-replica", "--seq-len", str(args.seq_len),
               "--layers", str(args.layers), "--width", str(args.width)]  # fmt: skip
    child = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    endpoint = child.stdout.readline().strip()
    if not endpoint:
        raise SystemExit(f"the replica process exited ({child.wait()}) before serving")
    return child, endpoint


async def kill_trial(
    args: argparse.Namespace, config: GPTConfig, survivor: str, trial: int, sessions: bool = True
) -> dict[str, Any]:
    """One trial: drive micro-batches through the survivor and a fresh victim process;
    SIGKILL (or SIGSTOP, ``--kill-signal``) the victim while a forward is on it; drive on
    until ``--after-kill`` more micro-batches went through."""
    ids, acts = boundaries(config)
    victim, endpoint = start_replica(args)
    killed_at: float | None = None
    done_after: list[float] = []
    lost = hangs = 0
    try:
        client = NetNode(
            identity=Identity.generate(), config=NodeConfig(server=None, peers=(survivor,))
        )
        async with client:
            driver = Driver(client.client, replica(gpt_stages(config, 2, seed=1)[0], first=True,
                            last=False), swarm_id=SWARM, replicas=[[endpoint, survivor]],
                            boundaries=[acts], ids=ids, rng=random.Random(trial),
                            config=DriverConfig(sessions=sessions))  # fmt: skip

            async def kill_when_on_it() -> None:
                nonlocal killed_at
                while driver.stats.busy[endpoint] == 0 or driver.stats.rate.get(endpoint) is None:
                    await asyncio.sleep(0.002)  # a bench, not a test: polling is its clock
                victim.send_signal(signal.SIGSTOP if args.kill_signal == "stop" else signal.SIGKILL)
                killed_at = time.monotonic()

            killer = asyncio.create_task(kill_when_on_it())
            batches = text_batches(config, args.batch, 10_000, seed=trial)
            for rows in batches:
                if len(done_after) >= args.after_kill:
                    break
                try:
                    await asyncio.wait_for(driver.run(rows[:, :-1], rows[:, 1:]), args.hang_s)
                except PipelineError:
                    lost += 1
                    continue
                except TimeoutError:
                    hangs += 1
                    break
                if killed_at is not None:
                    done_after.append(time.monotonic())
            killer.cancel()
    finally:
        if victim.poll() is None:
            victim.kill()
        victim.wait()
    retry = done_after[0] - killed_at if killed_at is not None and done_after else None
    return {
        "sessions": sessions,
        "signal": args.kill_signal,
        "killed": killed_at is not None,
        "retry_s": None if retry is None else round(retry, 3),
        "lost": lost,
        "hangs": hangs,
    }


def kill(args: argparse.Namespace, config: GPTConfig) -> dict[str, Any]:
    """The ``kill`` part: ``--kill-trials`` trials (of each arm, in turn, with
    ``--kill-signal stop``)."""
    arms = (True, False) if args.kill_signal == "stop" else (True,)
    survivor, endpoint = start_replica(args)
    try:
        trials = [
            asyncio.run(kill_trial(args, config, endpoint, t, sessions))
            for t in range(args.kill_trials)
            for sessions in arms
        ]
    finally:
        survivor.kill()
        survivor.wait()

    def median_retry(sessions: bool) -> float | None:
        retries = [t["retry_s"] for t in trials if t["sessions"] == sessions]
        retries = [r for r in retries if r is not None]
        return statistics.median(retries) if retries else None

    report: dict[str, Any] = {
        "kill": {"trials": trials},
        "kill_signal": args.kill_signal,
        "kill_trials": sum(t["killed"] for t in trials),
        "kill_hangs": sum(t["hangs"] for t in trials),
        "kill_lost_micro_batches": sum(t["lost"] for t in trials),
        "kill_retry_s_median": median_retry(True),
    }
    if len(arms) == 2:
        by_arm = {"sessions": median_retry(True), "none": median_retry(False)}
        report["kill_retry_s_by_arm"] = by_arm
        if by_arm["sessions"] is not None and by_arm["none"]:
            report["kill_retry_ratio"] = round(by_arm["sessions"] / by_arm["none"], 4)
    return report


class Gated(torch.nn.Module):
    """A last stage whose next forward (not a backward's recompute) waits at a gate once
    armed, until released: the dead driver's micro-batch is caught there."""

    def __init__(self, stage: GPTStage) -> None:
        super().__init__()
        self.stage = stage
        self.armed = False
        self.entered = threading.Event()
        self.release = threading.Event()

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if self.armed and not torch.is_grad_enabled():
            self.armed = False
            self.entered.set()
            self.release.wait(timeout=300)
        return self.stage(x, targets)


def three_stage_service(held: StageReplica, stage: int, config: GPTConfig) -> StageService:
    ids, acts = boundaries(config)
    last = stage == 2
    rejections = RejectionLog(logging.getLogger("swarmloco.pipeline"))
    return StageService(held, swarm_id=SWARM, stage=stage, inputs=acts,
                        outputs=None if last else acts, targets=ids if last else None,
                        encoding="int8", rejections=rejections)  # fmt: skip


def serve_driver(args: argparse.Namespace, config: GPTConfig) -> int:
    """(A child of the driver-kill part.) Drive one micro-batch through the replicas at
    ``--driver-endpoints`` (with sessions or not: ``--driver-sessions``), say ``ready``,
    then drive another once told to (on stdin), until killed."""
    ids, acts = boundaries(config)
    one, two = args.driver_endpoints.split(",")

    async def drive() -> None:
        first = replica(gpt_stages(config, 3, seed=1)[0], first=True, last=False)
        node = NetNode(identity=Identity.generate(), config=NodeConfig(server=None, peers=(one,)))
        async with node:
            driver = Driver(node.client, first, swarm_id=SWARM, replicas=[[one], [two]],
                            boundaries=[acts, acts], ids=ids,
                            config=DriverConfig(sessions=bool(args.driver_sessions)))  # fmt: skip
            rows = text_batches(config, args.batch, 2, seed=7)
            await driver.run(rows[0][:, :-1], rows[0][:, 1:])
            while args.driver_sessions and driver.sessions < 2:
                await asyncio.sleep(0.01)  # its sessions open beside its first micro-batch
            print("ready", flush=True)
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
            await driver.run(rows[1][:, :-1], rows[1][:, 1:])  # killed under way

    asyncio.run(drive())
    return 0


async def driver_kill_trial(
    args: argparse.Namespace, config: GPTConfig, sessions: bool, trial: int
) -> dict[str, Any]:
    """One trial (see the module): fresh replicas of stages 1 and 2, a driver process that
    is killed under way, and this process's driver driving on."""
    ids, acts = boundaries(config)
    stages = gpt_stages(config, 3, seed=1)
    gate = Gated(stages[2])
    step = 2 * args.batch
    middle = replica(stages[1], first=False, last=False, step_samples=step)
    tail = replica(gate, first=False, last=True, step_samples=step)
    loop = asyncio.get_running_loop()
    async with contextlib.AsyncExitStack() as stack:
        nodes: list[NetNode] = []
        for k, stage_replica in ((1, middle), (2, tail)):
            service = three_stage_service(stage_replica, k, config)
            stack.callback(service.close)
            peers = (nodes[0].endpoint,) if nodes else ()
            node = NetNode(identity=Identity.generate(), config=NodeConfig(peers=peers),
                           services=[service.service()])  # fmt: skip
            nodes.append(await stack.enter_async_context(node))
        endpoints = [n.endpoint for n in nodes]
        command = [sys.executable, __file__, "--serve-driver", "--seq-len", str(args.seq_len),
                   "--layers", str(args.layers), "--width", str(args.width),
                   "--batch", str(args.batch), "--driver-endpoints", ",".join(endpoints),
                   "--driver-sessions", str(int(sessions))]  # fmt: skip
        child = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        stack.callback(child.wait)
        stack.callback(child.kill)
        assert child.stdout is not None and child.stdin is not None
        said = await loop.run_in_executor(None, child.stdout.readline)
        if said.strip() != "ready":
            raise SystemExit(f"the driver process exited ({child.wait()}) before it was ready")
        gate.armed = True
        child.stdin.write("go\n")
        child.stdin.flush()
        if not await loop.run_in_executor(None, gate.entered.wait, 120):
            raise SystemExit("the driver's micro-batch never reached stage 2")
        steps = (middle.steps, tail.steps)
        frozen = args.driver_signal == "stop"
        child.send_signal(signal.SIGSTOP if frozen else signal.SIGKILL)
        killed_at = time.monotonic()
        if not frozen:
            await loop.run_in_executor(None, child.wait)
        gate.release.set()  # its forward at stage 2 ends, for nobody
        client = NetNode(identity=Identity.generate(), config=NodeConfig(server=None,
                         peers=(endpoints[0],)))  # fmt: skip
        await stack.enter_async_context(client)
        own = replica(gpt_stages(config, 3, seed=1)[0], first=True, last=False)
        driver = Driver(client.client, own, swarm_id=SWARM, replicas=[[e] for e in endpoints],
                        boundaries=[acts, acts], ids=ids, rng=random.Random(trial))  # fmt: skip
        failed = 0
        stepped_at = None
        for rows in text_batches(config, args.batch, 10_000, seed=trial):
            if middle.steps > steps[0] and tail.steps > steps[1]:
                stepped_at = time.monotonic()
                break
            if time.monotonic() - killed_at > args.hang_s * 3:
                break
            try:
                await driver.run(rows[:, :-1], rows[:, 1:])
            except PipelineError:
                failed += 1  # refused as busy past its hop's deadline: a stalled stage
        driver.close()
    return {
        "sessions": sessions,
        "signal": args.driver_signal,
        "step_s": None if stepped_at is None else round(stepped_at - killed_at, 3),
        "failed_micro_batches": failed,
        "dropped_at_deadline": middle.dropped + tail.dropped,
        "dropped_at_session_end": middle.orphaned + tail.orphaned,
    }


def driver_kill(args: argparse.Namespace, config: GPTConfig) -> dict[str, Any]:
    trials: dict[str, list[dict[str, Any]]] = {"sessions": [], "none": []}
    for t in range(args.driver_kill_trials):
        for arm in ("sessions", "none") if t % 2 == 0 else ("none", "sessions"):
            trials[arm].append(asyncio.run(driver_kill_trial(args, config, arm == "sessions", t)))
    medians = {}
    for arm, runs in trials.items():
        times = [r["step_s"] for r in runs if r["step_s"] is not None]
        medians[arm] = statistics.median(times) if len(times) == len(runs) else None
    ratio = None
    if medians["sessions"] is not None and medians["none"]:
        ratio = round(medians["sessions"] / medians["none"], 4)
    return {
        "driver_kill": trials,
        "driver_kill_signal": args.driver_signal,
        "driver_kill_step_s": medians,
        "driver_kill_step_ratio": ratio,
    }


def held_bytes(module: torch.nn.Module) -> int:
    """Parameters, gradients and AdamW's two moments of ``module``, after one step."""
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    for p in module.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    tensors = [t for p in module.parameters() for t in (p, p.grad)]
    tensors += [v for state in optimizer.state.values() for v in state.values() if v.dim() > 0]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def memory(args: argparse.Namespace, config: GPTConfig) -> dict[str, Any]:
    torch.manual_seed(1)
    whole = held_bytes(GPT(config))
    stages = [held_bytes(stage) for stage in gpt_stages(config, 2, seed=1)]
    return {
        "memory": {"whole_bytes": whole, "stage_bytes": stages, "stages": 2},
        "stage_state_bytes_ratio": round(max(stages) / whole, 4),
    }


def scaling(args: argparse.Namespace) -> dict[str, Any]:
    """The ``scaling`` part (see the module)."""
    device = torch.device(
        args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    )
    widths = [int(w) for w in args.scaling_widths.split(",") if w.strip()]
    bf16 = args.precision == "bf16" or (args.precision == "auto" and device.type == "cuda")
    autocast = torch.bfloat16 if bf16 else None  # what a stage peer chooses by default
    link = args.link_mbps * 1e6 / 8  # bytes a second, each way
    rows = []
    for width in widths:
        if width % 64:
            raise SystemExit(f"--scaling-widths: {width} is not a multiple of 64")
        heads = width // 64
        config = LlamaConfig(
            vocab_size=256, seq_len=args.seq_len, n_layer=3 * args.scaling_layers,
            n_head=heads, n_kv_head=max(1, heads // 4), n_embd=width,
            ffn=64 * round(8 * width / 3 / 64), tie_embeddings=False,
        )  # fmt: skip
        stage = build_stage(config, 3, 1, seed=1, device=device)  # a middle stage, alone
        middle = StageReplica(stage, first=False, last=False, autocast=autocast)
        g = torch.Generator().manual_seed(0)
        times, sent, received = [], 0, 0
        for i in range(7):
            x = torch.randn(args.batch, args.seq_len, width, generator=g)
            grad = torch.randn(args.batch, args.seq_len, width, generator=g)
            name = i.to_bytes(16, "big")
            started = time.perf_counter()
            out = middle.forward(name, x)
            grad_input = middle.backward(name, grad)
            times.append(time.perf_counter() - started)
            assert grad_input is not None
            received = len(pack(x, "int8").SerializeToString())
            received += len(pack(grad, "int8").SerializeToString())
            sent = len(pack(out, "int8").SerializeToString())
            sent += len(pack(grad_input, "int8").SerializeToString())
        compute_s = statistics.median(times[2:])
        transfer_s = max(sent, received) / link
        rows.append({
            "width": width,
            "stage_params": sum(p.numel() for p in stage.parameters()),
            "compute_s": round(compute_s, 5),
            "bytes_in": received,
            "bytes_out": sent,
            "transfer_s": round(transfer_s, 5),
            "compute_over_transfer": round(compute_s / transfer_s, 4),
        })  # fmt: skip
        del stage, middle
    first, last = rows[0], rows[-1]
    return {
        "scaling": {
            "device": str(device),
            "link_mbps": args.link_mbps,
            "layers": args.scaling_layers,
            "micro_batch": [args.batch, args.seq_len],
            "precision": "bf16 autocast" if bf16 else "fp32",
            "widths": rows,
        },
        "compute_over_transfer_growth": round(
            last["compute_over_transfer"] / first["compute_over_transfer"], 3
        ),
        "scaling_width_ratio": round(last["width"] / first["width"], 3),
    }


async def run_inflight(args: argparse.Namespace, config: GPTConfig, count: int) -> dict[str, Any]:
    """One driver, ``count`` micro-batches at once, ``args.micro_batches`` in all."""
    ids, acts = boundaries(config)
    local, remote = gpt_stages(config, 2, seed=1)
    step = args.inflight_step_samples
    head = replica(remote, first=False, last=True, step_samples=step)
    first = replica(local, first=True, last=False, step_samples=step)
    stepped_on: list[int] = []
    for r in (head, first):
        r.before_step = lambda r=r: stepped_on.append(r.samples)  # type: ignore[misc]
    async with contextlib.AsyncExitStack() as stack:
        service = head_service(head, config, "int8")
        stack.callback(service.close)
        node = await stack.enter_async_context(
            NetNode(identity=Identity.generate(), config=NodeConfig(), services=[service.service()])
        )
        client = await stack.enter_async_context(
            NetNode(
                identity=Identity.generate(), config=NodeConfig(server=None, peers=(node.endpoint,))
            )
        )
        driver = Driver(client.client, first, swarm_id=SWARM, replicas=[[node.endpoint]],
                        boundaries=[acts], ids=ids, rng=random.Random(0))  # fmt: skip
        stack.callback(driver.close)
        g = torch.Generator().manual_seed(count)
        rows = [torch.randint(0, config.vocab_size, (args.batch, config.seq_len + 1),
                              generator=g) for _ in range(args.micro_batches)]  # fmt: skip
        queue = list(reversed(rows))

        async def worker() -> None:
            while queue:
                batch = queue.pop()
                await driver.run(batch[:, :-1], batch[:, 1:])

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(count)))
        seconds = time.perf_counter() - started
    return {
        "seconds": round(seconds, 3),
        "micro_batches_per_s": round(args.micro_batches / seconds, 3),
        "steps": len(stepped_on),
        "step_samples_max": max(stepped_on, default=0),
    }


def inflight(args: argparse.Namespace, config: GPTConfig) -> dict[str, Any]:
    counts = [int(c) for c in args.in_flight_counts.split(",") if c.strip()]
    if not counts or min(counts) < 1:
        raise SystemExit("--in-flight-counts takes counts >= 1, comma-separated")
    short = argparse.Namespace(**{**vars(args), "micro_batches": 4})
    runs: dict[int, list[dict[str, Any]]] = {c: [] for c in counts}
    for c in counts:  # warm-up, not counted
        asyncio.run(run_inflight(short, config, c))
    for i in range(args.repeats):
        for c in counts[i % len(counts) :] + counts[: i % len(counts)]:
            runs[c].append(asyncio.run(run_inflight(args, config, c)))
    rate = {c: statistics.median(r["micro_batches_per_s"] for r in runs[c]) for c in counts}
    best = max(counts, key=lambda c: rate[c])
    return {
        "inflight": {
            str(c): {"micro_batches_per_s_median": rate[c], "runs": runs[c]} for c in counts
        },
        "inflight_speedup": round(rate[best] / rate[counts[0]], 3),
        "inflight_best_count": best,
        "inflight_step_samples_max": max(r["step_samples_max"] for c in counts for r in runs[c]),
    }


def summary(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    return {
        "micro_batches_per_s_median": statistics.median(r["micro_batches_per_s"] for r in runs),
        "fast_share_median": statistics.median(r["fast_share"] for r in runs),
        "runs": list(runs),
    }


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--drivers", type=int, default=2, help="stage-0 drivers at once")
    p.add_argument("--micro-batches", type=int, default=24, help="micro-batches per driver")
    p.add_argument("--batch", type=int, default=4, help="sequences per micro-batch")
    p.add_argument(
        "--slow-factor",
        type=float,
        default=3.0,
        help="the slow replica takes this many times the fast one's compute (default: 3)",
    )
    p.add_argument(
        "--slow-s", type=float, default=None, help="or: its extra seconds a forward, as given"
    )
    p.add_argument("--seq-len", type=int, default=128, help="tokens a sequence")
    p.add_argument("--repeats", type=int, default=3, help="runs of each arm, alternating")
    p.add_argument("--layers", type=int, default=8, help="the GPT's blocks (half per stage)")
    p.add_argument("--width", type=int, default=256, help="the GPT's n_embd")
    p.add_argument(
        "--parts",
        default="wiring,inflight,activations,kill,driver-kill,memory,scaling,parity",
        help="which parts to run, comma-separated (default: %(default)s)",
    )
    p.add_argument(
        "--loss-micro-batches", type=int, default=120, help="activations: micro-batches trained"
    )
    p.add_argument(
        "--loss-window", type=int, default=20, help="activations: the last micro-batches' loss"
    )
    p.add_argument("--kill-trials", type=int, default=5, help="kill: trials (of each arm)")
    p.add_argument(
        "--kill-signal",
        choices=("kill", "stop"),
        default="kill",
        help="kill: SIGKILL the replica (its kernel closes its connections) or SIGSTOP it (a "
        "machine that froze or dropped off its network), then with and without sessions",
    )
    p.add_argument(
        "--after-kill", type=int, default=5, help="kill: micro-batches driven after the kill"
    )
    p.add_argument("--hang-s", type=float, default=60.0, help="kill: a micro-batch's limit")
    p.add_argument(
        "--parity-micro-batches", type=int, default=128, help="parity: micro-batches per driver"
    )
    p.add_argument("--parity-sync-every", type=int, default=8, help="parity: H, in steps")
    p.add_argument("--parity-repeats", type=int, default=3, help="parity: runs of each arm")
    p.add_argument(
        "--parity-arms",
        default="pipeline,diloco",
        help="parity: the arms to run (pipeline alone, repeated: how often each stage's "
        "replicas average together)",
    )
    p.add_argument(
        "--scaling-widths",
        default="256,512,1024",
        help="scaling: the Llama widths (multiples of 64; default: %(default)s)",
    )
    p.add_argument(
        "--in-flight-counts",
        default="1,2,4",
        help="inflight: the micro-batches one driver keeps in flight, per arm (the first is "
        "the baseline; default: %(default)s)",
    )
    p.add_argument(
        "--inflight-step-samples",
        type=int,
        default=32,
        help="inflight: the sequences of a replica's step (default: %(default)s)",
    )
    p.add_argument("--scaling-layers", type=int, default=2, help="scaling: blocks in the stage")
    p.add_argument(
        "--link-mbps", type=float, default=100.0, help="scaling: the link's Mb/s each way"
    )
    p.add_argument(
        "--device", default="auto", help="scaling: where the stage computes (auto, cpu, cuda)"
    )
    p.add_argument(
        "--precision",
        choices=("auto", "fp32", "bf16"),
        default="auto",
        help="scaling: the stage's arithmetic (auto: bf16 autocast on a GPU, fp32 on the CPU)",
    )
    p.add_argument(
        "--driver-kill-trials", type=int, default=3, help="driver-kill: trials of each arm"
    )
    p.add_argument(
        "--driver-signal",
        choices=("kill", "stop"),
        default="kill",
        help="driver-kill: SIGKILL the driver (its kernel closes its connections) or SIGSTOP "
        "it (a machine that froze or dropped off its network: nothing closes)",
    )
    p.add_argument("--serve-replica", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--serve-driver", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--driver-endpoints", default="", help=argparse.SUPPRESS)
    p.add_argument("--driver-sessions", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.ERROR)
    config = GPTConfig(vocab_size=256, seq_len=args.seq_len, n_layer=args.layers, n_head=4,
                       n_embd=args.width)  # fmt: skip
    if args.serve_replica:
        return serve_replica(args, config)
    if args.serve_driver:
        return serve_driver(args, config)
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    known = {"wiring", "inflight", "activations", "kill", "driver-kill", "memory", "parity",
             "scaling"}  # fmt: skip
    unknown = set(parts) - known
    if unknown:
        p.error(f"no such part: {', '.join(sorted(unknown))}")
    report: dict[str, Any] = {
        "bench": "pipeline",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(),
        "settings": {k: v for k, v in vars(args).items() if k not in CHILD_FLAGS},
    }
    if "wiring" in parts:
        report.update(wiring(args, config))
    if "inflight" in parts:
        report.update(inflight(args, config))
    if "activations" in parts:
        report.update(activations(args, config))
    if "kill" in parts:
        report.update(kill(args, config))
    if "driver-kill" in parts:
        report.update(driver_kill(args, config))
    if "memory" in parts:
        report.update(memory(args, config))
    if "scaling" in parts:
        report.update(scaling(args))
    if "parity" in parts:
        arms = [a.strip() for a in args.parity_arms.split(",") if a.strip()]
        if not arms or set(arms) - {"pipeline", "diloco"}:
            p.error("--parity-arms takes pipeline, diloco or both")
        report.update(parity(config, sync_every=args.parity_sync_every, micro=args.batch,
                             micro_batches=args.parity_micro_batches,
                             repeats=args.parity_repeats, batches=text_batches,
                             arms=arms))  # fmt: skip
    report["settings"] = {k: v for k, v in vars(args).items() if k not in CHILD_FLAGS}
    print(json.dumps(report, indent=2))
    return 0


def wiring(args: argparse.Namespace, config: GPTConfig) -> dict[str, Any]:
    fast_s = compute_seconds(args, config)
    if args.slow_s is None:  # the slow replica: --slow-factor times the fast one's compute
        args.slow_s = round((args.slow_factor - 1) * fast_s, 4)
    arms: dict[str, list[dict[str, Any]]] = {"fixed": [], "uniform": [], "measured": []}
    short = argparse.Namespace(**{**vars(args), "micro_batches": 2})
    for name in arms:  # warm-up, not counted: the first calls and connections
        asyncio.run(run_arm(short, config, name))
    for i in range(args.repeats):
        order = list(arms)[i % 3 :] + list(arms)[: i % 3]  # each arm first in turn
        for name in order:
            arms[name].append(asyncio.run(run_arm(args, config, name)))
    out = {name: summary(runs) for name, runs in arms.items()}
    rate = {name: out[name]["micro_batches_per_s_median"] for name in arms}
    slower = [r["slow_over_fast"] for r in arms["measured"] if r["slow_over_fast"]]
    return {
        **out,
        "fast_compute_s": round(fast_s, 4),
        "slow_over_fast_median": statistics.median(slower) if slower else None,
        "stochastic_over_fixed": round(rate["measured"] / rate["fixed"], 3),
        "measured_over_fixed": round(rate["measured"] / rate["fixed"], 3),
        "measured_over_uniform": round(rate["measured"] / rate["uniform"], 3),
    }


if __name__ == "__main__":
    sys.exit(main())
