#!/usr/bin/env python3
"""Stochastic wiring against a heterogeneous stage: micro-batches per second of a two-stage
pipeline whose stage 1 has a fast and a slow replica, when the drivers draw the next hop
by what they measured (the project's ``Driver``), against two baselines: a *fixed*
pipeline (driver k always through replica k, as static pipelines are wired) and a
*uniform* draw (random wiring blind to speed). Prints ONE JSON object.

    python scripts/bench_pipeline.py                   # 2 drivers, the slow replica 3x slower
    python scripts/bench_pipeline.py --slow-factor 2 --micro-batches 40 --repeats 5

Real parts on loopback: each stage-1 replica is served by its own ``NetNode`` (gRPC, the
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
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import machine

from swarmloco.net.identity import Identity
from swarmloco.net.node import NetNode, NodeConfig
from swarmloco.net.rejections import RejectionLog
from swarmloco.pipeline.driver import Driver
from swarmloco.pipeline.replica import ReplicaConfig, StageReplica
from swarmloco.pipeline.service import StageService
from swarmloco.pipeline.stages import GPTStage, gpt_stages
from swarmloco.pipeline.wire import Boundary
from swarmloco.train.spec import GPTConfig

SWARM = "be" * 20


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


def replica(module: torch.nn.Module, *, first: bool, last: bool) -> StageReplica:
    return StageReplica(
        module,
        first=first,
        last=last,
        optimizer=torch.optim.AdamW(module.parameters(), lr=1e-3),
        config=ReplicaConfig(step_samples=8),
    )


async def run_arm(args: argparse.Namespace, config: GPTConfig, arm: str) -> dict[str, Any]:
    ids = Boundary(width=0, max_batch=8, max_tokens=config.seq_len, vocab=config.vocab_size)
    acts = Boundary(width=config.n_embd, max_batch=8, max_tokens=config.seq_len)
    rejections = RejectionLog(logging.getLogger("swarmloco.pipeline"))
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
            service = StageService(r, swarm_id=SWARM, stage=1, inputs=acts, outputs=None,
                                   targets=ids, encoding="int8", rejections=rejections)  # fmt: skip
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
    args = p.parse_args()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    config = GPTConfig(vocab_size=256, seq_len=args.seq_len, n_layer=args.layers, n_head=4,
                       n_embd=args.width)  # fmt: skip
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
    report = {
        "bench": "pipeline",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(),
        "settings": vars(args),
        **out,
        "fast_compute_s": round(fast_s, 4),
        "slow_over_fast_median": statistics.median(slower) if slower else None,
        "measured_over_fixed": round(rate["measured"] / rate["fixed"], 3),
        "measured_over_uniform": round(rate["measured"] / rate["uniform"], 3),
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
