#!/usr/bin/env python3
"""Learning quality at equal tokens on the default task. Prints one JSON object.

Arms (all from the same initial model; all but `single` see the same number of tokens):
  sync            one model, `workers` times the batch (synchronous data-parallel)
  diloco_fp32     DiLoCo, exact fp32 averaging
  diloco_int8     DiLoCo, the int8 codec both ways (as on the wire)
  streaming_int8  Streaming DiLoCo: F fragments, overlap tau, mix alpha, int8
  trimmed_int8    diloco_int8 with the trimmed mean (trim 1) instead of the mean, the
                  aggregator a public run uses by default
  single          for scale, not at equal tokens: one worker alone, the per-worker batch

Targets: diloco_int8 within 2% of sync; int8 within 0.5% of fp32. With the single arm, the
JSON also says what share of the gain from one worker to the synchronous baseline DiLoCo
keeps: (single - diloco_int8) / (single - sync).

    python scripts/bench_convergence.py [--steps 400] [--workers 4] [--sync-every 50]
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
from swarmloco.train.simulate import SimulationConfig, run_diloco, run_sync
from swarmloco.train.spec import DataSpec
from swarmloco.train.tasks import get_task, resolve_model

ARMS = ("sync", "diloco_fp32", "diloco_int8", "streaming_int8", "trimmed_int8", "single")


def _run_arm(job: tuple[Any, ...]) -> dict[str, Any]:
    """One arm in its own process (spawned, one torch thread)."""
    arm, preset, run, streaming, workers, steps, progress = job  # streaming: (F, tau, alpha)
    torch.set_num_threads(1)
    task = get_task("gpt-bytes")
    model = resolve_model(task, preset)
    data = task.load_data(model, DataSpec())
    exchange = "int8" if arm.endswith("int8") else "fp32"
    sim = SimulationConfig(workers=workers, steps=steps, exchange=exchange, eval_every=50)
    if arm == "sync":
        result = run_sync(task, model, data, run, sim, label=arm, progress=progress)
    elif arm == "single":  # the baseline's loop with one worker's batch
        sim = dataclasses.replace(sim, workers=1)
        result = run_sync(task, model, data, run, sim, label=arm, progress=progress)
    else:
        if arm == "streaming_int8":
            fragments, delay, alpha = streaming
            spec = dataclasses.replace(run.spec, fragments=fragments, delay=delay, alpha=alpha)
            run = dataclasses.replace(run, spec=spec)
        if arm == "trimmed_int8":
            spec = dataclasses.replace(run.spec, aggregator=AggregatorConfig(method="trimmed_mean"))
            run = dataclasses.replace(run, spec=spec)
        result = run_diloco(task, model, data, run, sim, label=arm, progress=progress)
    summary = result.summary()
    summary["data"] = data.description
    summary["model_params"] = sum(p.numel() for p in task.build_model(model).parameters())
    return summary


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", default="tiny")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--sync-every", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=None, help="inner lr (preset default)")
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.9)
    p.add_argument("--fragments", type=int, default=2)
    p.add_argument("--delay", type=int, default=5)
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--progress", action="store_true", help="progress bars on stderr")
    p.add_argument(
        "--parallel", type=int, default=2, help="arms run at once, each in its own 1-thread process"
    )
    args = p.parse_args()

    task = get_task("gpt-bytes")
    model = resolve_model(task, args.preset)
    base = task.default_run(args.preset)
    inner = dataclasses.replace(
        base.inner,
        batch_size=args.batch_size,
        total_steps=args.steps,
        lr=args.lr or base.inner.lr,
        warmup_steps=min(base.inner.warmup_steps, args.steps // 10),
    )
    arms = args.arms.split(",")
    unknown = set(arms) - set(ARMS)
    if unknown:
        raise SystemExit(f"unknown arm(s) {sorted(unknown)}; arms: {', '.join(ARMS)}")
    spec = dataclasses.replace(
        base.spec,
        sync_every=args.sync_every,
        outer_lr=args.outer_lr,
        outer_momentum=args.outer_momentum,
        seed=args.seed,
    )
    # Checked only when the streaming arm runs (F may not fit a short --sync-every).
    streaming = (args.fragments, args.delay, args.alpha)
    if "streaming_int8" in arms:
        dataclasses.replace(spec, fragments=args.fragments, delay=args.delay, alpha=args.alpha)
    run = dataclasses.replace(base, inner=inner, spec=spec)
    started = time.monotonic()
    jobs = [
        (arm, args.preset, run, streaming, args.workers, args.steps, args.progress) for arm in arms
    ]
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=args.parallel, mp_context=ctx) as pool:
        results = dict(zip(arms, pool.map(_run_arm, jobs), strict=True))
    data_description = results[arms[0]].pop("data")
    model_params = results[arms[0]].pop("model_params")

    out: dict[str, object] = {
        "benchmark": "convergence",
        "machine": machine(),
        "settings": {
            "task": task.name,
            "preset": args.preset,
            "model_params": model_params,
            "batch_size_per_worker": args.batch_size,
            "seq_len": model["seq_len"],
            "inner_lr": inner.lr,
            "outer_lr": spec.outer_lr,
            "outer_momentum": spec.outer_momentum,
            "streaming": dict(zip(("fragments", "delay", "alpha"), streaming, strict=True)),
            "seed": args.seed,
            "data": data_description,
            "arms_in_parallel": args.parallel,
            "torch_threads_per_arm": 1,
        },
        "workers": args.workers,
        "sync_every": args.sync_every,
        "steps": args.steps,
        "tokens": next(
            (r["tokens"] for arm, r in results.items() if arm != "single"),
            results[arms[0]]["tokens"],
        ),
    }
    loss = {arm: r["final_eval_loss"] for arm, r in results.items()}
    for arm, r in results.items():
        out[f"{arm}_final_eval_loss"] = r["final_eval_loss"]
        out[f"{arm}_eval_curve"] = r["eval_curve"]
        out[f"{arm}_seconds"] = round(r["seconds"], 1)
        if r["bytes_per_worker"]:
            out[f"{arm}_bytes_per_worker"] = r["bytes_per_worker"]
    if "sync" in loss and "diloco_int8" in loss:
        out["diloco_int8_over_sync"] = loss["diloco_int8"] / loss["sync"]
        out["target_diloco_int8_within_2pct_of_sync"] = loss["diloco_int8"] <= 1.02 * loss["sync"]
    if "diloco_fp32" in loss and "diloco_int8" in loss:
        out["int8_over_fp32"] = loss["diloco_int8"] / loss["diloco_fp32"]
        out["target_int8_within_half_pct_of_fp32"] = (
            abs(loss["diloco_int8"] / loss["diloco_fp32"] - 1) <= 0.005
        )
    if "single" in loss:
        out["single_tokens"] = results["single"]["tokens"]
    # Only meaningful where the larger batch helped at all (not in very short runs).
    if {"single", "sync", "diloco_int8"} <= loss.keys() and loss["single"] > loss["sync"]:
        out["diloco_int8_share_of_sync_gain"] = (loss["single"] - loss["diloco_int8"]) / (
            loss["single"] - loss["sync"]
        )
    if "diloco_int8" in loss and "trimmed_int8" in loss:
        out["trimmed_int8_over_diloco_int8"] = loss["trimmed_int8"] / loss["diloco_int8"]
    if "sync" in loss and "streaming_int8" in loss:
        out["streaming_int8_over_sync"] = loss["streaming_int8"] / loss["sync"]
    out["total_seconds"] = round(time.monotonic() - started, 1)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
