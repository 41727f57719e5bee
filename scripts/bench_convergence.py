#!/usr/bin/env python3
"""Learning quality at equal tokens on the default task, as the DiLoCo papers measure it.
Prints one JSON object.

The default protocol (``--protocol warm-start``), per seed:

1. a shared warm start: ``--warm-steps`` steps of synchronous data-parallel training
   (``workers`` times the per-worker batch) from the seed's initial model;
2. from that checkpoint (weights, AdamW state, step), the rest of the same schedule in each
   arm, all at equal tokens except ``single``:

   sync            one model, ``workers`` times the batch (data-parallel)
   diloco_fp32     DiLoCo, exact fp32 averaging
   diloco_int8     DiLoCo, the int8 codec both ways (as on the wire)
   streaming_int8  Streaming DiLoCo: F fragments, overlap tau, mix alpha, int8
   single          one worker alone at the per-worker batch (a quarter of the tokens with
                   4 workers): where DiLoCo would be without the others
   trimmed_int8    (optional) diloco_int8 with the trimmed mean a public run uses

The DiLoCo paper warm-starts from a synchronously trained checkpoint too; from scratch, the
first pseudo-gradient carries the whole initial drop of the loss and outer momentum keeps
re-applying it (``--protocol scratch`` measures that regime: no warm start). Seeds run in
parallel processes (one torch thread each); every arm of a seed sees the same data streams.

Keys: ``<arm>_final_eval_loss`` (mean over seeds), ``diloco_over_sync`` (diloco_int8 over
sync, mean over seeds; ``diloco_over_sync_per_seed``), ``share_of_gain`` (the share of the
gain from ``single`` to ``sync`` that diloco_int8 keeps, mean over seeds),
``int8_over_fp32``, ``eval_stderr_of_diloco_over_sync`` (the standard error of
diloco_over_sync that comes from the finite eval set, both arms scored on the same
windows: how far the eval set alone can move the comparison; the largest over seeds).
Targets: diloco_over_sync <= 1.04, share_of_gain >= 0.7,
int8_over_fp32 <= 1.005.

    python scripts/bench_convergence.py                      # two seeds, ~15 min on 2 cores
    python scripts/bench_convergence.py --seeds 0 --arms sync,diloco_fp32 --sync-every 30

``--protocol scaling`` is the DiLoCo scaling-law study's comparison, meant for a GPU
(``--device cuda --preset small``): from scratch, every run sees ``--tokens-per-param``
(20) tokens per parameter. Data-parallel training is tuned first, its batch over
``--dp-batches`` (32) and its inner lr over ``--dp-lrs`` (best mean over seeds); then DiLoCo
with each of ``--worker-counts`` (1, 2, 4) workers at ``--batch-multiples`` (1, 2, 4) times
the best data-parallel batch in all (each worker a share of it), each of ``--outer-lrs``
(0.4, 0.7, 1.0) and of ``--outer-momenta`` (0.5, 0.9), its inner lr data-parallel's times
each of ``--diloco-lr-factors`` (1), H = ``--sync-every`` (30), int8 exchange; the best cell per
worker count (mean over seeds) is compared with data-parallel. Keys: ``data_parallel``
(its batch x lr grid and the best), ``by_workers`` (per count: every cell, the best,
``over_data_parallel`` and its per-seed values). Targets: 1 worker <= data-parallel, 2
workers <= +1.5%, 4 workers <= +4%. ``--model`` changes the preset's model (a CPU runs the
grid at toy sizes: ``--model n_layer=2,n_head=2,n_embd=64,seq_len=64``, 0.12M parameters,
30-150 s a run on one core). ``--runs-log`` keeps each finished run; ``--resume`` takes
them from it, so a grid cut short goes on where it stopped.

    python scripts/bench_convergence.py --protocol scaling --device cuda --preset small \
        --dp-batches 16,32 --batch-multiples 0.5,1,2 --runs-log runs.jsonl --resume
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import multiprocessing
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import machine

from swarmloco.core.aggregate import AggregatorConfig
from swarmloco.train.data import eval_windows
from swarmloco.train.simulate import (
    SimulationConfig,
    WarmStart,
    run_diloco,
    run_sync,
    warm_start,
)
from swarmloco.train.spec import DataSpec
from swarmloco.train.tasks import build_task_model, get_task, resolve_model

ARMS = ("sync", "diloco_fp32", "diloco_int8", "streaming_int8", "single", "trimmed_int8")
DEFAULT_ARMS = ARMS[:5]


def _group_losses(model: torch.nn.Module, windows: torch.Tensor) -> list[float]:
    """The eval loss of each group of 8 windows (the eval loss is their mean)."""
    model.eval()
    with torch.no_grad():
        return [float(model(b[:, :-1], b[:, 1:])) for b in windows.split(8) if len(b) == 8]


def _ratio_stderr(a: torch.nn.Module, b: torch.nn.Module, windows: torch.Tensor) -> float:
    """The standard error of eval(a) / eval(b) that comes from the finite eval set (both
    scored on the same windows), by the delta method over groups of windows."""
    la, lb = _group_losses(a, windows), _group_losses(b, windows)
    ratio = statistics.fmean(la) / statistics.fmean(lb)
    residuals = [x - ratio * y for x, y in zip(la, lb, strict=True)]
    return statistics.stdev(residuals) / len(residuals) ** 0.5 / statistics.fmean(lb)


def _run_seed(job: tuple[Any, ...]) -> dict[str, Any]:
    """Every arm of one seed, in this (spawned) process."""
    seed, preset, run, streaming, sim, arms, warm_steps, progress = job
    torch.set_num_threads(1)
    task = get_task("gpt-bytes")
    model = resolve_model(task, preset)
    data = task.load_data(model, DataSpec())
    run = dataclasses.replace(run, spec=dataclasses.replace(run.spec, seed=seed))
    start: WarmStart | None = None
    out: dict[str, Any] = {"seed": seed}
    if warm_steps:
        began = time.monotonic()
        start = warm_start(task, model, data, run, sim, warm_steps, progress=progress)
        out["warm_start_seconds"] = round(time.monotonic() - began, 1)
    final: dict[str, torch.nn.Module] = {}
    for arm in arms:
        arm_run, arm_sim = run, sim
        if arm == "streaming_int8":
            fragments, delay, alpha = streaming
            spec = dataclasses.replace(run.spec, fragments=fragments, delay=delay, alpha=alpha)
            arm_run = dataclasses.replace(run, spec=spec)
        elif arm == "trimmed_int8":
            spec = dataclasses.replace(run.spec, aggregator=AggregatorConfig(method="trimmed_mean"))
            arm_run = dataclasses.replace(run, spec=spec)
        arm_sim = dataclasses.replace(sim, exchange="int8" if arm.endswith("int8") else "fp32")
        if arm == "sync":
            result = run_sync(
                task, model, data, arm_run, arm_sim, label=arm, progress=progress, start=start
            )
        elif arm == "single":
            arm_sim = dataclasses.replace(arm_sim, workers=1)
            result = run_sync(
                task, model, data, arm_run, arm_sim, label=arm, progress=progress, start=start
            )
        else:
            result = run_diloco(
                task, model, data, arm_run, arm_sim, label=arm, progress=progress, start=start
            )
        out[arm] = result.summary()
        if result.final_model is not None:
            final[arm] = result.final_model
    if "sync" in final and "diloco_int8" in final:
        windows = eval_windows(data.val, seq_len=int(model["seq_len"]), count=sim.eval_windows)
        out["eval_stderr_of_diloco_over_sync"] = _ratio_stderr(
            final["diloco_int8"], final["sync"], windows
        )
    out["data"] = data.description
    out["model_params"] = sum(p.numel() for p in build_task_model(task, model, run).parameters())
    return out


def _mean(values: list[float]) -> float:
    return statistics.fmean(values)


def summarize(per_seed: list[dict[str, Any]], arms: list[str]) -> dict[str, Any]:
    """The JSON keys over seeds (see the module docstring)."""
    out: dict[str, Any] = {}
    for arm in arms:
        out[f"{arm}_final_eval_loss"] = _mean([s[arm]["final_eval_loss"] for s in per_seed])
    has = set(arms).__contains__
    if has("sync") and has("diloco_int8"):
        out["diloco_over_sync"] = _mean(
            [s["diloco_int8"]["final_eval_loss"] / s["sync"]["final_eval_loss"] for s in per_seed]
        )
        out["target_diloco_over_sync_at_most_1.04"] = out["diloco_over_sync"] <= 1.04
        out["diloco_over_sync_per_seed"] = [
            s["diloco_int8"]["final_eval_loss"] / s["sync"]["final_eval_loss"] for s in per_seed
        ]
    if has("sync") and has("diloco_fp32"):
        out["diloco_fp32_over_sync"] = _mean(
            [s["diloco_fp32"]["final_eval_loss"] / s["sync"]["final_eval_loss"] for s in per_seed]
        )
    if has("sync") and has("streaming_int8"):
        out["streaming_int8_over_sync"] = _mean(
            [
                s["streaming_int8"]["final_eval_loss"] / s["sync"]["final_eval_loss"]
                for s in per_seed
            ]
        )
    if has("diloco_fp32") and has("diloco_int8"):
        out["int8_over_fp32"] = _mean(
            [
                s["diloco_int8"]["final_eval_loss"] / s["diloco_fp32"]["final_eval_loss"]
                for s in per_seed
            ]
        )
        out["target_int8_over_fp32_at_most_1.005"] = out["int8_over_fp32"] <= 1.005
    if has("single") and has("sync") and has("diloco_int8"):
        shares = []
        for s in per_seed:
            single, sync = s["single"]["final_eval_loss"], s["sync"]["final_eval_loss"]
            if single > sync:  # only meaningful where the larger batch helped at all
                shares.append((single - s["diloco_int8"]["final_eval_loss"]) / (single - sync))
        if shares:
            out["share_of_gain"] = _mean(shares)
            out["target_share_of_gain_at_least_0.7"] = out["share_of_gain"] >= 0.7
    if has("trimmed_int8") and has("diloco_int8"):
        out["trimmed_int8_over_diloco_int8"] = _mean(
            [
                s["trimmed_int8"]["final_eval_loss"] / s["diloco_int8"]["final_eval_loss"]
                for s in per_seed
            ]
        )
    return out


# -- the scaling protocol ---------------------------------------------------------------

SCALING_TARGETS = {1: 1.0, 2: 1.015, 4: 1.04}  # workers -> at most this times data-parallel


def _scaling_run(job: tuple[Any, ...]) -> dict[str, Any]:
    """One run of the scaling grid, from scratch, in this (spawned) process: data-parallel
    (``workers`` None) or DiLoCo with ``workers`` workers."""
    seed, model, run, sim, workers, progress = job
    torch.set_num_threads(1)
    task = get_task("gpt-bytes")
    data = task.load_data(model, DataSpec())
    run = dataclasses.replace(run, spec=dataclasses.replace(run.spec, seed=seed))
    if workers is None:
        result = run_sync(task, model, data, run, sim, label="dp", progress=progress)
    else:
        sim = dataclasses.replace(sim, workers=workers)
        result = run_diloco(
            task, model, data, run, sim, label=f"diloco{workers}", progress=progress
        )
    return {"final_eval_loss": result.final_eval_loss, "seconds": round(result.seconds, 1)}


def _identity(job: tuple[Any, ...]) -> dict[str, Any]:
    """What sets a run's result, as the runs log records it (one JSON line per run)."""
    seed, model, run, sim, workers, _ = job
    line = {
        "seed": seed,
        "workers": workers or 0,
        "batch_per_worker": run.inner.batch_size,
        "inner_lr": run.inner.lr,
        "steps": run.spec.total_steps,
        "warmup_steps": run.inner.warmup_steps,
    }
    if workers:  # data-parallel has no outer step
        line["outer_lr"] = run.spec.outer_lr
        line["outer_momentum"] = run.spec.outer_momentum
        line["sync_every"] = run.spec.sync_every
    line.update(model=model, eval_windows=sim.eval_windows, device=sim.device)
    return line


def _key(identity: dict[str, Any]) -> str:
    return json.dumps(identity, sort_keys=True)


def _logged_runs(log: str) -> dict[str, dict[str, Any]]:
    """The results already in the runs log ``log``, by run (:func:`_key`); none if it does
    not exist yet."""
    try:
        lines = Path(log).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return {}
    done = {}
    for n, text in enumerate(lines, 1):
        try:
            line = json.loads(text)
            result = {k: line.pop(k) for k in ("final_eval_loss", "seconds")}
        except (ValueError, KeyError, AttributeError):
            raise SystemExit(f"--resume: line {n} of {log} is not a run of this script") from None
        done[_key(line)] = result
    return done


def _run_all(
    pool: concurrent.futures.Executor, jobs: list[tuple[Any, ...]], log: str, resume: bool
) -> list[dict[str, Any]]:
    """Every job's result, in the jobs' order; with ``log``, each run is also appended to
    that file as one JSON line as it finishes (a grid cut short keeps what it ran), and with
    ``resume`` a run already in it is not run again."""
    done = _logged_runs(log) if resume else {}
    results: list[dict[str, Any]] = [{} for _ in jobs]
    futures = {}
    for i, job in enumerate(jobs):
        if (logged := done.get(_key(_identity(job)))) is not None:
            results[i] = logged
        else:
            futures[pool.submit(_scaling_run, job)] = i
    for future in concurrent.futures.as_completed(futures):
        i = futures[future]
        results[i] = future.result()
        if log:
            with open(log, "a", encoding="utf-8") as f:
                f.write(json.dumps({**_identity(jobs[i]), **results[i]}) + "\n")
    return results


def _scaled_run(base: Any, *, batch: int, steps: int, lr: float, warmup: float, **spec: Any) -> Any:
    """``base`` with a schedule of ``steps`` steps of ``batch`` sequences per worker."""
    inner = dataclasses.replace(
        base.inner,
        batch_size=batch,
        grad_accum=1,
        lr=lr,
        total_steps=steps,
        warmup_steps=max(1, round(warmup * steps)),
    )
    return dataclasses.replace(
        base, inner=inner, spec=dataclasses.replace(base.spec, total_steps=steps, **spec)
    )


def _model_overrides(text: str) -> dict[str, int | float]:
    """``n_layer=2,n_embd=64`` as a mapping (numbers only: every GPT field is one)."""
    out: dict[str, int | float] = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--model takes KEY=VALUE pairs, got {item!r}")
        try:
            out[key.strip()] = float(value) if "." in value else int(value)
        except ValueError:
            raise SystemExit(f"--model {key}: {value!r} is not a number") from None
    return out


def _numbers(text: str, kind: type, flag: str, *, positive: bool = False) -> list[Any]:
    """``text``, a comma-separated list, as numbers of ``kind``; a clear exit if it is not."""
    try:
        out = [kind(x) for x in text.split(",")]
    except ValueError:
        raise SystemExit(f"{flag} takes comma-separated numbers, got {text!r}") from None
    if positive and any(x <= 0 for x in out):
        raise SystemExit(f"{flag} takes numbers above 0, got {text!r}")
    return out


def scaling(args: argparse.Namespace) -> dict[str, Any]:
    """The scaling protocol (see the module docstring); the JSON object it prints."""
    task = get_task("gpt-bytes")
    try:
        model = resolve_model(task, args.preset, _model_overrides(args.model))
    except (ValueError, TypeError) as e:
        raise SystemExit(f"--model: {e}") from None
    base = task.default_run(args.preset)
    params = sum(p.numel() for p in build_task_model(task, model, base).parameters())
    seq_len = int(model["seq_len"])
    tokens = round(args.tokens_per_param * params)
    seeds = _numbers(args.seeds, int, "--seeds")
    counts = _numbers(args.worker_counts, int, "--worker-counts", positive=True)
    multiples = _numbers(args.batch_multiples, float, "--batch-multiples", positive=True)
    outer_lrs = _numbers(args.outer_lrs, float, "--outer-lrs", positive=True)
    lr_factors = _numbers(args.diloco_lr_factors, float, "--diloco-lr-factors", positive=True)
    momenta = _numbers(args.outer_momenta, float, "--outer-momenta")
    dp_lrs = (
        _numbers(args.dp_lrs, float, "--dp-lrs", positive=True)
        if args.dp_lrs
        else [base.inner.lr * f for f in (0.5, 1.0, 2.0)]
    )
    sync_every = args.sync_every or 30
    dp_batches = _numbers(args.dp_batches, int, "--dp-batches", positive=True)
    cells: list[tuple[int, float, float, float, float]] = []
    for m in counts:
        for k in multiples:
            for b in dp_batches:  # whichever data-parallel wins, its cells can run
                if (k * b) % 1 or (k * b) % m:
                    raise SystemExit(f"{k:g} x a batch of {b} cannot be shared by {m} workers")
            cells.extend(
                (m, k, lr, f, mu) for lr in outer_lrs for f in lr_factors for mu in momenta
            )

    def steps_at(batch_in_all: int) -> int:
        steps = tokens // (batch_in_all * seq_len)
        if steps < sync_every:
            raise SystemExit(
                f"{tokens:,} tokens make {steps} steps at a batch of {batch_in_all}, fewer "
                f"than H = {sync_every}: raise --tokens-per-param or lower --sync-every"
            )
        return steps

    def sim_for(steps: int) -> SimulationConfig:
        return SimulationConfig(
            workers=1,
            steps=steps,
            eval_every=steps,
            eval_windows=args.eval_windows,
            device=args.device,
        )

    started = time.monotonic()
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=args.parallel, mp_context=ctx) as pool:
        # 1. data-parallel, its batch and inner lr tuned
        dp_cells = [(b, lr) for b in dp_batches for lr in dp_lrs]
        dp_jobs = [
            (
                seed,
                model,
                _scaled_run(base, batch=b, steps=steps_at(b), lr=lr, warmup=args.warmup),
                sim_for(steps_at(b)),
                None,
                args.progress,
            )
            for b, lr in dp_cells
            for seed in seeds
        ]
        dp_results = _run_all(pool, dp_jobs, args.runs_log, args.resume)
        dp_grid = []
        for i, (b, lr) in enumerate(dp_cells):
            losses = [
                r["final_eval_loss"] for r in dp_results[i * len(seeds) : (i + 1) * len(seeds)]
            ]
            dp_grid.append(
                {"batch": b, "lr": lr, "per_seed": losses, "final_eval_loss": _mean(losses)}
            )
        dp_best = min(dp_grid, key=lambda c: c["final_eval_loss"])
        dp_batch = dp_best["batch"]
        # 2. DiLoCo at every cell: batches in all a multiple of the best data-parallel
        # batch, inner lr a multiple of its lr
        jobs = []
        for m, k, outer_lr, factor, momentum in cells:
            in_all = round(k * dp_batch)
            steps = steps_at(in_all)
            cell_run = _scaled_run(
                base,
                batch=in_all // m,
                steps=steps,
                lr=dp_best["lr"] * factor,
                warmup=args.warmup,
                sync_every=sync_every,
                outer_lr=outer_lr,
                outer_momentum=momentum,
            )
            jobs.extend((seed, model, cell_run, sim_for(steps), m, args.progress) for seed in seeds)
        results = _run_all(pool, jobs, args.runs_log, args.resume)
    by_workers: dict[str, Any] = {}
    out_targets: dict[str, bool] = {}
    for m in counts:
        grid = []
        for i, (cm, k, outer_lr, factor, momentum) in enumerate(cells):
            if cm != m:
                continue
            losses = [r["final_eval_loss"] for r in results[i * len(seeds) : (i + 1) * len(seeds)]]
            grid.append(
                {
                    "batch_multiple": k,
                    "outer_lr": outer_lr,
                    "inner_lr": dp_best["lr"] * factor,
                    "outer_momentum": momentum,
                    "per_seed": losses,
                    "final_eval_loss": _mean(losses),
                }
            )
        best = min(grid, key=lambda c: c["final_eval_loss"])
        ratios = [a / b for a, b in zip(best["per_seed"], dp_best["per_seed"], strict=True)]
        by_workers[str(m)] = {
            "best": {
                k: best[k] for k in ("batch_multiple", "outer_lr", "inner_lr", "outer_momentum")
            },
            "final_eval_loss": best["final_eval_loss"],
            "over_data_parallel": _mean(ratios),
            "over_data_parallel_per_seed": ratios,
            "grid": grid,
        }
        if m in SCALING_TARGETS:
            bound = SCALING_TARGETS[m]
            out_targets[f"target_{m}_workers_at_most_{bound}x_data_parallel"] = (
                _mean(ratios) <= bound
            )
    return {
        "benchmark": "convergence",
        "protocol": "scaling",
        "machine": machine(),
        "settings": {
            "task": task.name,
            "preset": args.preset,
            "model": model,
            "model_params": params,
            "seq_len": seq_len,
            "tokens_per_param": args.tokens_per_param,
            "dp_batches": dp_batches,
            "warmup_fraction": args.warmup,
            "exchange": "int8",
            "eval_windows": args.eval_windows,
            "device": args.device,
            "runs_in_parallel": args.parallel,
        },
        "seeds": seeds,
        "sync_every": sync_every,
        "tokens": tokens,
        "data_parallel": {
            "grid": dp_grid,
            "best_batch": dp_batch,
            "best_lr": dp_best["lr"],
            **dp_best,
        },
        "by_workers": by_workers,
        **out_targets,
        "total_seconds": round(time.monotonic() - started, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--protocol",
        choices=("warm-start", "scratch", "scaling"),
        default="warm-start",
        help="warm-start: the arms continue a shared synchronous checkpoint "
        "(the papers' protocol); scratch: every arm from the initial model; scaling: the "
        "DiLoCo scaling-law comparison with a tuned data-parallel baseline (for a GPU)",
    )
    p.add_argument("--preset", default="tiny")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--steps", type=int, default=500, help="the schedule's length in steps")
    p.add_argument(
        "--warm-steps",
        type=int,
        default=150,
        help="steps of the shared synchronous warm start (warm-start protocol)",
    )
    p.add_argument(
        "--warmup",
        type=float,
        default=None,
        help="learning-rate warmup: steps (default 50), or with --protocol scaling a "
        "fraction of each run's steps (default 0.05)",
    )
    p.add_argument(
        "--sync-every",
        type=int,
        default=None,
        help="H, inner steps per round (default 10; 30 with --protocol scaling)",
    )
    p.add_argument("--batch-size", type=int, default=8, help="per-worker batch")
    p.add_argument("--lr", type=float, default=None, help="inner lr (preset default)")
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument(
        "--outer-momentum",
        type=float,
        default=None,
        help="outer Nesterov momentum (default 0.9; --protocol scaling: see --outer-momenta)",
    )
    p.add_argument("--fragments", type=int, default=2, help="Streaming DiLoCo's F")
    p.add_argument("--delay", type=int, default=2, help="Streaming DiLoCo's overlap tau")
    p.add_argument("--alpha", type=float, default=0.5, help="Streaming DiLoCo's mix alpha")
    p.add_argument("--seeds", default="0,1", help="comma-separated; each in its own process")
    p.add_argument(
        "--eval-windows",
        type=int,
        default=1024,
        help="held-out windows every eval loss is the mean of",
    )
    p.add_argument(
        "--eval-every", type=int, default=175, help="steps between evals (each costs ~4 s)"
    )
    p.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"of {', '.join(ARMS)}")
    p.add_argument("--parallel", type=int, default=2, help="seeds run at once")
    p.add_argument("--progress", action="store_true", help="progress bars on stderr")
    scale = p.add_argument_group("--protocol scaling")
    scale.add_argument("--tokens-per-param", type=float, default=20.0)
    scale.add_argument(
        "--dp-batches",
        default="32",
        help="data-parallel batches tried, in sequences (comma-separated; each with every "
        "lr of --dp-lrs)",
    )
    scale.add_argument(
        "--dp-lrs",
        default="",
        help="inner lrs tried for data-parallel (default: the preset's x 0.5, 1, 2)",
    )
    scale.add_argument("--worker-counts", default="1,2,4")
    scale.add_argument(
        "--batch-multiples",
        default="1,2,4",
        help="DiLoCo's batch in all, x the best data-parallel batch (0.5 tries half of it)",
    )
    scale.add_argument("--outer-lrs", default="0.4,0.7,1.0")
    scale.add_argument(
        "--outer-momenta",
        default="0.5,0.9",
        help="outer Nesterov momenta tried (0.9 is the papers'; 0.5 learns better in small, "
        "small-batch runs)",
    )
    scale.add_argument(
        "--diloco-lr-factors",
        default="1",
        help="DiLoCo's inner lrs, as multiples of data-parallel's tuned lr (e.g. 0.5,1)",
    )
    scale.add_argument(
        "--model",
        default="",
        help="the preset's model with these fields changed, e.g. n_layer=2,n_embd=64 "
        "(a model small enough for a CPU grid)",
    )
    scale.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    scale.add_argument(
        "--runs-log",
        default="",
        help="append each finished run to this file as one JSON line (workers 0: "
        "data-parallel), so a grid cut short keeps what it ran",
    )
    scale.add_argument(
        "--resume",
        action="store_true",
        help="take the runs already in --runs-log from it instead of running them again "
        "(rerun a grid that was cut short with the same command and --resume)",
    )
    args = p.parse_args()
    if args.protocol == "scaling":
        if args.outer_momentum is not None:
            raise SystemExit("--protocol scaling tries every momentum of --outer-momenta")
        if args.resume and not args.runs_log:
            raise SystemExit("--resume takes its finished runs from --runs-log: name one")
        args.warmup = 0.05 if args.warmup is None else args.warmup
        if not 0 <= args.warmup < 1:
            raise SystemExit("--warmup is a fraction of the steps with --protocol scaling")
        print(json.dumps(scaling(args), indent=2))
        return
    if args.runs_log or args.resume:
        raise SystemExit("--runs-log and --resume are for --protocol scaling")
    args.warmup = 50 if args.warmup is None else int(args.warmup)
    args.outer_momentum = 0.9 if args.outer_momentum is None else args.outer_momentum
    if args.eval_windows < 16:
        raise SystemExit(
            "--eval-windows must be at least 16 (the eval set's standard error "
            "takes two groups of 8 windows)"
        )
    args.sync_every = args.sync_every or 10

    arms = args.arms.split(",")
    unknown = set(arms) - set(ARMS)
    if unknown:
        raise SystemExit(f"unknown arm(s) {sorted(unknown)}; arms: {', '.join(ARMS)}")
    seeds = _numbers(args.seeds, int, "--seeds")
    warm_steps = args.warm_steps if args.protocol == "warm-start" else 0
    if warm_steps >= args.steps:
        raise SystemExit(f"--warm-steps {warm_steps} leaves nothing of --steps {args.steps}")

    task = get_task("gpt-bytes")
    model = resolve_model(task, args.preset)
    base = task.default_run(args.preset)
    inner = dataclasses.replace(
        base.inner,
        batch_size=args.batch_size,
        total_steps=args.steps,
        lr=args.lr or base.inner.lr,
        warmup_steps=args.warmup,
    )
    spec = dataclasses.replace(
        base.spec,
        sync_every=args.sync_every,
        outer_lr=args.outer_lr,
        outer_momentum=args.outer_momentum,
        total_steps=args.steps,
    )
    streaming = (args.fragments, args.delay, args.alpha)
    if "streaming_int8" in arms:  # a bad F / tau / alpha says which, before any work
        dataclasses.replace(spec, fragments=args.fragments, delay=args.delay, alpha=args.alpha)
    run = dataclasses.replace(base, inner=inner, spec=spec)
    sim = SimulationConfig(
        workers=args.workers,
        steps=args.steps,
        eval_every=args.eval_every,
        eval_windows=args.eval_windows,
    )
    started = time.monotonic()
    jobs = [
        (seed, args.preset, run, streaming, sim, arms, warm_steps, args.progress) for seed in seeds
    ]
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=args.parallel, mp_context=ctx) as pool:
        per_seed = list(pool.map(_run_seed, jobs))
    data_description = per_seed[0].pop("data")
    model_params = per_seed[0].pop("model_params")
    for s in per_seed[1:]:
        s.pop("data")
        s.pop("model_params")
    seq_len = int(model["seq_len"])
    trained = args.steps - warm_steps
    out: dict[str, Any] = {
        "benchmark": "convergence",
        "protocol": args.protocol,
        "machine": machine(),
        "settings": {
            "task": task.name,
            "preset": args.preset,
            "model_params": model_params,
            "batch_size_per_worker": args.batch_size,
            "seq_len": seq_len,
            "schedule_steps": args.steps,
            "warm_start_steps": warm_steps,
            "warmup_steps": args.warmup,
            "inner_lr": inner.lr,
            "outer_lr": spec.outer_lr,
            "outer_momentum": spec.outer_momentum,
            "streaming": dict(zip(("fragments", "delay", "alpha"), streaming, strict=True)),
            "eval_windows": args.eval_windows,
            "data": data_description,
            "seeds_in_parallel": args.parallel,
            "torch_threads_per_seed": 1,
        },
        "seeds": seeds,
        "workers": args.workers,
        "sync_every": args.sync_every,
        "tokens": trained * args.workers * args.batch_size * seq_len,
    }
    stderr = [
        s["eval_stderr_of_diloco_over_sync"]
        for s in per_seed
        if "eval_stderr_of_diloco_over_sync" in s
    ]
    if stderr:
        out["eval_stderr_of_diloco_over_sync"] = max(stderr)
    out.update(summarize(per_seed, arms))
    out["per_seed"] = per_seed
    out["total_seconds"] = round(time.monotonic() - started, 1)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
