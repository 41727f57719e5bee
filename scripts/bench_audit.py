#!/usr/bin/env python3
"""Audits of a pipeline's stages (``docs/DESIGN.md`` section 10, "Audits"), in two parts
(``--parts``, both by default). Prints ONE JSON object.

- ``spread``: how far apart honest replicas of a stage answer, against how far a liar's
  answer is from an honest one: what ``audit_tolerance`` (0.5) has to separate. The built-in
  GPT (``--layers``, ``--width``, ``--seq-len``) is cut in three and trained ``--pretrain``
  steps on real text (the standard library's source); then two copies train apart, each on
  its own text, for H of ``--sync-every`` steps (a round's local steps) at each learning rate
  of ``--lrs`` (AdamW, as a stage's inner optimizer), and both answer the same held-out
  micro-batches at stage 1 (a middle stage: its output and input gradient) and stage 2 (the
  last: its loss and input gradient), through the int8 wire both ways. Per setting: the
  largest relative distance of the two honest answers (``audit.distance``, what a driver
  compares); then each attack's distance from an honest answer: the input gradient
  sign-flipped, flipped and scaled by 10, doubled, scaled by 1.2, zeroed, replaced by noise
  of its norm. ``honest_max`` is the largest honest distance seen, ``caught_min`` the
  smallest distance among the attacks the tolerance is for (all but the 1.2 scale).
- ``attack``: a two-stage pipeline over real gRPC on loopback, three stage-1 replicas (one a
  *liar* whose input gradients are flipped and scaled by 10: finite, in bounds, and enough to
  make stage 0 climb the loss), one driver, ``--micro-batches`` of real text; every replica
  steps AdamW every 8 sequences. Arms: ``honest`` and ``honest-unaudited`` (three honest
  replicas, audits at ``--audit-share`` and off: the audits' cost, ``audited_over_unaudited``,
  the ratio of their micro-batches per second, the median of ``--repeats``),
  ``liar-unaudited`` and ``liar-audited``: the mean loss of the first and last
  ``--loss-window`` micro-batches, the micro-batch at which the liar was found out, and the
  audits' outcomes.

    python scripts/bench_audit.py
    python scripts/bench_audit.py --parts spread --sync-every 10,50,250 --lrs 4e-4,1e-3
    python scripts/bench_audit.py --parts attack --micro-batches 400 --audit-share 0.05
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import machine
from bench_pipeline import SWARM, boundaries, head_service, replica, text_batches

from swarmloco.net.identity import Identity
from swarmloco.net.node import NetNode, NodeConfig
from swarmloco.pipeline.audit import Answer, distance
from swarmloco.pipeline.driver import Driver, DriverConfig
from swarmloco.pipeline.stages import GPTStage, gpt_stages
from swarmloco.pipeline.wire import Boundary, pack, unpack
from swarmloco.train.spec import GPTConfig

ATTACKS = {
    "flipped": lambda g: -g,
    "flipped_x10": lambda g: -10 * g,
    "doubled": lambda g: 2 * g,
    "scaled_1.2": lambda g: 1.2 * g,
    "zeroed": torch.zeros_like,
    "noise": lambda g: torch.randn_like(g) * g.norm() / g.numel() ** 0.5,
}
MEANT = [name for name in ATTACKS if name != "scaled_1.2"]
"""The attacks the tolerance is to catch (a 1.2 scale is within honest divergence)."""


def wired(tensor: torch.Tensor, boundary: Boundary) -> torch.Tensor:
    """``tensor`` as it comes off the int8 wire."""
    return unpack(pack(tensor, "int8"), boundary, "bench")


def train(stages: list[GPTStage], batches: list[torch.Tensor], lr: float) -> None:
    opts = [torch.optim.AdamW(s.parameters(), lr=lr, weight_decay=0.1) for s in stages]
    for rows in batches:
        h = rows[:, :-1]
        for stage in stages[:-1]:
            h = stage(h)
        stages[-1](h, rows[:, 1:]).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)


def answers(
    stages: list[GPTStage], h0: torch.Tensor, targets: torch.Tensor, grad_out: torch.Tensor,
    acts: Boundary,
) -> tuple[Answer, Answer]:  # fmt: skip
    """Stage 1's answer (output, input gradient against ``grad_out``) and stage 2's (loss,
    input gradient) to the same inputs, off the int8 wire."""
    x = h0.clone().requires_grad_(True)
    out = stages[1](x)
    (g1,) = torch.autograd.grad(out, x, grad_out)
    x2 = wired(out.detach(), acts).requires_grad_(True)
    loss = stages[2](x2, targets)
    (g2,) = torch.autograd.grad(loss, x2)
    middle = Answer(wired(out.detach(), acts), wired(g1, acts))
    last = Answer(float(loss.detach()), wired(g2, acts))
    return middle, last


def spread(args: argparse.Namespace, config: GPTConfig) -> dict[str, Any]:
    _, acts = boundaries(config)
    torch.manual_seed(0)
    base = gpt_stages(config, 3, seed=1)
    train(base, text_batches(config, args.batch, args.pretrain, seed=1), args.lrs[0])
    held = text_batches(config, args.batch, 4, seed=9)
    settings, honest_max, caught_min = [], 0.0, float("inf")
    for lr in args.lrs:
        for h in args.sync_every:
            a, b = copy.deepcopy(base), copy.deepcopy(base)
            train(a, text_batches(config, args.batch, h, seed=2), lr)
            train(b, text_batches(config, args.batch, h, seed=3), lr)
            honest = {"middle": [], "last": []}
            attacks: dict[str, list[float]] = {name: [] for name in ATTACKS}
            for rows in held:
                with torch.no_grad():
                    h0 = wired(a[0](rows[:, :-1]), acts)
                grad_out = wired(torch.randn_like(h0) * 1e-3, acts)
                ours = answers(a, h0, rows[:, 1:], grad_out, acts)
                theirs = answers(b, h0, rows[:, 1:], grad_out, acts)
                for where, mine, other in zip(("middle", "last"), ours, theirs, strict=True):
                    honest[where].append(distance(mine, other))
                    for name, attack in ATTACKS.items():
                        lie = Answer(mine.output, wired(attack(mine.grad_input), acts))
                        attacks[name].append(distance(mine, lie))
            row = {
                "lr": lr,
                "sync_every": h,
                "honest_middle_max": round(max(honest["middle"]), 4),
                "honest_last_max": round(max(honest["last"]), 4),
                **{f"attack_{n}_min": round(min(d), 4) for n, d in attacks.items()},
            }
            settings.append(row)
            honest_max = max(honest_max, *honest["middle"], *honest["last"])
            caught_min = min(caught_min, *(min(attacks[n]) for n in MEANT))
    return {
        "spread": {"pretrain_steps": args.pretrain, "stages": 3, "settings": settings},
        "honest_max": round(honest_max, 4),
        "caught_min": round(caught_min, 4),
        "tolerance": DriverConfig().audit_tolerance,
    }


class _Flip10(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return -10 * grad


class Liar(torch.nn.Module):
    """Stage 1 computed honestly, its input gradient flipped and scaled by 10."""

    def __init__(self, stage: GPTStage) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        return self.stage(_Flip10.apply(x), targets)


async def attack_arm(
    args: argparse.Namespace, config: GPTConfig, *, liar: bool, share: float, seed: int
) -> dict[str, Any]:
    ids, acts = boundaries(config)
    local = gpt_stages(config, 2, seed=1)[0]
    heads = []
    for k in range(3):
        stage = gpt_stages(config, 2, seed=1)[1]
        heads.append(replica(Liar(stage) if liar and k == 2 else stage, first=False, last=True))
    losses: list[float] = []
    found_at = None
    async with contextlib.AsyncExitStack() as stack:
        endpoints: list[str] = []
        for head in heads:
            node = NetNode(identity=Identity.generate(), config=NodeConfig(),
                           services=[head_service(head, config, "int8").service()])  # fmt: skip
            await stack.enter_async_context(node)
            endpoints.append(node.endpoint)
        client = NetNode(
            identity=Identity.generate(), config=NodeConfig(server=None, peers=(endpoints[0],))
        )
        await stack.enter_async_context(client)
        driver = Driver(
            client.client,
            replica(local, first=True, last=False),
            swarm_id=SWARM,
            replicas=[endpoints],
            boundaries=[acts],
            ids=ids,
            config=DriverConfig(audit_share=share),
            rng=random.Random(seed),
        )
        started = time.perf_counter()
        for i, rows in enumerate(text_batches(config, args.batch, args.micro_batches, seed=seed)):
            trace = await driver.run(rows[:, :-1], rows[:, 1:])
            losses.append(trace.loss)
            if found_at is None and driver.audits["found-out"]:
                found_at = i + 1
        await driver.finish_audits()
        seconds = time.perf_counter() - started
    w = args.loss_window
    return {
        "micro_batches_per_s": round(args.micro_batches / seconds, 3),
        "loss_first": round(statistics.fmean(losses[:w]), 4),
        "loss_last": round(statistics.fmean(losses[-w:]), 4),
        "found_out_at": found_at,
        "distrusted": [endpoints.index(e) for e in driver.distrusted],
        "audits": dict(driver.audits),
        "liar_served": heads[2].served if liar else None,
    }


def attack(args: argparse.Namespace, config: GPTConfig) -> dict[str, Any]:
    arms: dict[str, list[dict[str, Any]]] = {}
    settings = {
        "honest": (False, args.audit_share),
        "honest-unaudited": (False, 0.0),
        "liar-unaudited": (True, 0.0),
        "liar-audited": (True, args.audit_share),
    }
    for repeat in range(args.repeats):
        for name, (liar, share) in settings.items():
            result = asyncio.run(attack_arm(args, config, liar=liar, share=share, seed=repeat))
            arms.setdefault(name, []).append(result)
    rate = {n: statistics.median(r["micro_batches_per_s"] for r in runs)
            for n, runs in arms.items()}  # fmt: skip
    found = [r["found_out_at"] for r in arms["liar-audited"]]
    return {
        "attack": arms,
        "audited_over_unaudited": round(rate["honest"] / rate["honest-unaudited"], 4),
        "liar_found_out_at_median": statistics.median(found) if None not in found else None,
        "honest_distrusted": sum(len(r["distrusted"]) for r in arms["honest"]),
        "loss_last_liar_audited": statistics.median(r["loss_last"] for r in arms["liar-audited"]),
        "loss_last_liar_unaudited": statistics.median(
            r["loss_last"] for r in arms["liar-unaudited"]
        ),
        "loss_last_honest": statistics.median(r["loss_last"] for r in arms["honest"]),
    }


def numbers(kind: type, text: str) -> list[Any]:
    return [kind(v) for v in text.split(",") if v]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--parts", default="spread,attack", help="spread, attack (default: both)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4, help="sequences per micro-batch")
    parser.add_argument("--pretrain", type=int, default=300, help="spread: steps before")
    parser.add_argument("--sync-every", type=lambda t: numbers(int, t), default=[10, 50, 250],
                        help="spread: local steps the two copies train apart")  # fmt: skip
    parser.add_argument("--lrs", type=lambda t: numbers(float, t), default=[4e-4, 1e-3])
    parser.add_argument("--micro-batches", type=int, default=300, help="attack: per arm")
    parser.add_argument("--audit-share", type=float, default=0.05)
    parser.add_argument("--loss-window", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3, help="attack: runs of each arm")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    config = GPTConfig(vocab_size=256, seq_len=args.seq_len, n_layer=args.layers, n_head=4,
                       n_embd=args.width)  # fmt: skip
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    result: dict[str, Any] = {
        "benchmark": "audit",
        "machine": machine(),
        "settings": {k: v for k, v in vars(args).items()},
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
    }
    for part in parts:
        if part == "spread":
            result.update(spread(args, config))
        elif part == "attack":
            result.update(attack(args, config))
        else:
            parser.error(f"unknown part {part!r}")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
