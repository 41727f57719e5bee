#!/usr/bin/env python3
"""Learning quality at equal tokens on the default task. Prints one JSON object.

Arms (all from the same initial model, all seeing the same number of tokens):
  sync            one model, `workers` times the batch (synchronous data-parallel)
  diloco_fp32     DiLoCo, exact fp32 averaging
  diloco_int8     DiLoCo, the int8 codec both ways (as on the wire)
  streaming_int8  Streaming DiLoCo: F fragments, overlap tau, mix alpha, int8

Targets: diloco_int8 within 2% of sync; int8 within 0.5% of fp32.

    python scripts/bench_convergence.py [--steps 400] [--workers 4] [--sync-every 50]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import machine

from swarmloco.core.fragments import StreamingConfig
from swarmloco.train.simulate import SimulationConfig, run_diloco, run_sync
from swarmloco.train.spec import DataSpec
from swarmloco.train.tasks import get_task, resolve_model


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", default="tiny")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--sync-every", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=None, help="inner lr (preset default)")
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.9)
    p.add_argument("--fragments", type=int, default=2)
    p.add_argument("--delay", type=int, default=5)
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arms", default="sync,diloco_fp32,diloco_int8,streaming_int8")
    p.add_argument("--progress", action="store_true", help="progress bars on stderr")
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
    outer = dataclasses.replace(base.outer, lr=args.outer_lr, momentum=args.outer_momentum)
    plain = StreamingConfig(sync_every=args.sync_every)
    streaming = StreamingConfig(
        sync_every=args.sync_every, fragments=args.fragments, delay=args.delay, alpha=args.alpha
    )
    run = dataclasses.replace(base, inner=inner, outer=outer, streaming=plain, seed=args.seed)
    data = task.load_data(model, DataSpec())
    started = time.monotonic()

    def sim(exchange: str) -> SimulationConfig:
        return SimulationConfig(
            workers=args.workers, steps=args.steps, exchange=exchange, eval_every=args.steps
        )

    results = {}
    for arm in args.arms.split(","):
        if arm == "sync":
            r = run_sync(task, model, data, run, sim("fp32"), label=arm, progress=args.progress)
        elif arm == "diloco_fp32":
            r = run_diloco(task, model, data, run, sim("fp32"), label=arm, progress=args.progress)
        elif arm == "diloco_int8":
            r = run_diloco(task, model, data, run, sim("int8"), label=arm, progress=args.progress)
        elif arm == "streaming_int8":
            srun = dataclasses.replace(run, streaming=streaming)
            r = run_diloco(task, model, data, srun, sim("int8"), label=arm, progress=args.progress)
        else:
            raise SystemExit(f"unknown arm {arm!r}")
        results[arm] = r

    out: dict[str, object] = {
        "benchmark": "convergence",
        "machine": machine(),
        "settings": {
            "task": task.name,
            "preset": args.preset,
            "model_params": sum(p.numel() for p in task.build_model(model).parameters()),
            "batch_size_per_worker": args.batch_size,
            "seq_len": model["seq_len"],
            "inner_lr": inner.lr,
            "outer_lr": outer.lr,
            "outer_momentum": outer.momentum,
            "streaming": dataclasses.asdict(streaming),
            "seed": args.seed,
            "data": data.description,
        },
        "workers": args.workers,
        "sync_every": args.sync_every,
        "steps": args.steps,
        "tokens": next(iter(results.values())).tokens,
    }
    for arm, r in results.items():
        out[f"{arm}_final_eval_loss"] = r.final_eval_loss
        out[f"{arm}_seconds"] = round(r.seconds, 1)
    if "sync" in results and "diloco_int8" in results:
        out["diloco_int8_over_sync"] = (
            results["diloco_int8"].final_eval_loss / results["sync"].final_eval_loss
        )
    if "diloco_fp32" in results and "diloco_int8" in results:
        out["int8_over_fp32"] = (
            results["diloco_int8"].final_eval_loss / results["diloco_fp32"].final_eval_loss
        )
    if "sync" in results and "streaming_int8" in results:
        out["streaming_int8_over_sync"] = (
            results["streaming_int8"].final_eval_loss / results["sync"].final_eval_loss
        )
    out["total_seconds"] = round(time.monotonic() - started, 1)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
