#!/usr/bin/env python3
"""Learning under liars: what members sending hostile updates cost a short DiLoCo run, under
each aggregator. Prints one JSON object.

Each cell is a DiLoCo run of the simulator (the default task, int8 exchange, from scratch)
in which the last ``liars`` of ``workers`` send, every round, instead of their update:

   huge     their update x1e30, declaring its honest norm
   flipped  their update x -1000, declared as it is
   steady   one fixed direction at just under the group's norm bound, declaring an
            honest norm (an attack a norm check cannot catch)
   reversed their update reversed and stretched to just under the bound, declaring an
            honest norm (the strongest push against training that passes the check)

Every round is bounded as a real one is (``swarmloco.train.simulate.lie``): the bound is 4x
the lower median of the declared norms, honest updates above it are scaled down, and a liar
above it is struck. Each attack is compared with the clean run of the same aggregator (no
liars: every worker honest) and with the clean run of the plain mean. The trimmed mean
trims as many values at each end as there are liars. Target (the hostile-peers issue):
every robust cell within 2% of its clean run.

Keys: ``cells`` (per layout, aggregator and attack: ``final_eval_loss``,
``over_clean`` and ``over_clean_mean``), ``worst_over_clean`` per aggregator, and the
settings.

    python scripts/bench_attacks.py                        # 1 of 4 and 2 of 8, ~30 min
    python scripts/bench_attacks.py --layouts 4:1 --steps 100 --aggregators mean,trimmed_mean
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import multiprocessing
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import machine

from swarmloco.core.aggregate import AggregatorConfig
from swarmloco.train.simulate import ATTACKS, SimulationConfig, run_diloco
from swarmloco.train.spec import DataSpec
from swarmloco.train.tasks import get_task, resolve_model

AGGREGATORS = ("mean", "trimmed_mean", "centered_clip")


def _cell(job: tuple[Any, ...]) -> dict[str, Any]:
    """One run, in this (spawned) process."""
    preset, run, sim, method, liars, attack, progress = job
    torch.set_num_threads(1)
    task = get_task("gpt-bytes")
    model = resolve_model(task, preset)
    data = task.load_data(model, DataSpec())
    trim = max(1, liars)
    aggregator = AggregatorConfig(method=method, trim=trim)
    run = dataclasses.replace(run, spec=dataclasses.replace(run.spec, aggregator=aggregator))
    sim = dataclasses.replace(sim, liars=liars, attack=attack)
    label = f"{sim.workers}:{liars} {method} {attack if liars else 'clean'}"
    result = run_diloco(task, model, data, run, sim, label=label, progress=progress)
    return {
        "workers": sim.workers,
        "liars": liars,
        "aggregator": method,
        "trim": trim if method == "trimmed_mean" else None,
        "attack": attack if liars else "clean",
        "final_eval_loss": result.final_eval_loss,
        "seconds": round(result.seconds, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument(
        "--layouts", default="4:1,8:2", help="WORKERS:LIARS pairs (default: 1 of 4 and 2 of 8)"
    )
    p.add_argument("--aggregators", default=",".join(AGGREGATORS))
    p.add_argument("--attacks", default=",".join(ATTACKS))
    p.add_argument("--steps", type=int, default=200, help="inner steps per worker")
    p.add_argument("--sync-every", type=int, default=20, help="H: inner steps per round")
    p.add_argument("--batch-size", type=int, default=8, help="per worker")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-windows", type=int, default=256)
    p.add_argument("--parallel", type=int, default=2, help="runs at once (one thread each)")
    p.add_argument("--progress", action="store_true", help="a progress bar per run")
    args = p.parse_args()

    layouts = []
    for item in args.layouts.split(","):
        workers, liars = (int(x) for x in item.split(":"))
        if not 0 < liars < workers / 2:
            raise SystemExit(f"layout {item}: liars must be fewer than half the workers")
        layouts.append((workers, liars))
    methods = args.aggregators.split(",")
    attacks = args.attacks.split(",")
    for name, given, known in (("aggregator", methods, AGGREGATORS), ("attack", attacks, ATTACKS)):
        if set(given) - set(known):
            raise SystemExit(f"unknown {name}(s) {sorted(set(given) - set(known))}")

    task = get_task("gpt-bytes")
    base = task.default_run(args.preset)
    inner = dataclasses.replace(base.inner, batch_size=args.batch_size, total_steps=args.steps)
    spec = dataclasses.replace(
        base.spec, sync_every=args.sync_every, total_steps=args.steps, seed=args.seed
    )
    run = dataclasses.replace(base, inner=inner, spec=spec)
    jobs = []
    for workers, liars in layouts:
        sim = SimulationConfig(
            workers=workers,
            steps=args.steps,
            eval_every=args.steps,
            eval_windows=args.eval_windows,
        )
        for method in methods:
            jobs.append((args.preset, run, sim, method, 0, "steady", args.progress))
            jobs += [(args.preset, run, sim, method, liars, a, args.progress) for a in attacks]
    started = time.monotonic()
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=args.parallel, mp_context=ctx) as pool:
        cells = list(pool.map(_cell, jobs))

    clean = {
        (c["workers"], c["aggregator"]): c["final_eval_loss"]
        for c in cells
        if c["attack"] == "clean"
    }
    worst: dict[str, float] = {}
    for c in cells:
        c["over_clean"] = c["final_eval_loss"] / clean[(c["workers"], c["aggregator"])]
        if (c["workers"], "mean") in clean:
            c["over_clean_mean"] = c["final_eval_loss"] / clean[(c["workers"], "mean")]
        if c["attack"] != "clean":
            worst[c["aggregator"]] = max(worst.get(c["aggregator"], 0.0), c["over_clean"])
    out = {
        "benchmark": "attacks",
        "machine": machine(),
        "settings": {
            "task": task.name,
            "preset": args.preset,
            "steps": args.steps,
            "sync_every": args.sync_every,
            "batch_size_per_worker": args.batch_size,
            "seed": args.seed,
            "eval_windows": args.eval_windows,
            "norm_clip": AggregatorConfig().norm_clip,
            "exchange": "int8",
        },
        "cells": cells,
        "worst_over_clean": worst,
        "targets": {f"{m} <= 1.02 x clean": worst[m] <= 1.02 for m in worst if m != "mean"},
        "total_seconds": round(time.monotonic() - started, 1),
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
