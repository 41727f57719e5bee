"""`swarmloco simulate`: a swarm of simulated peers in one process."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from swarmloco.cli.common import _add_data_options, _data_spec, _model_overrides

if TYPE_CHECKING:
    from swarmloco.core.runspec import RunSpec
    from swarmloco.train.data import TokenData
    from swarmloco.train.simulate import ArmResult, SimulationConfig, WarmStart
    from swarmloco.train.tasks import RunConfig, Task


def _add_simulate(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "simulate",
        help="N DiLoCo workers in one process vs synchronous data-parallel training",
        description=(
            "Train N DiLoCo workers in this process (no network) with the real codec and outer "
            "step, and the synchronous data-parallel baseline at equal tokens (one model, N "
            "times the batch), then print a JSON summary. Example: swarmloco simulate "
            "--preset tiny --workers 4 --steps 300 --sync-every 50"
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_run_options(p)
    _add_sweep_options(p)
    _add_machine_options(p)
    _add_data_options(p)
    p.set_defaults(handler=_run_simulate)


def _add_run_options(p: argparse.ArgumentParser) -> None:
    """The simulated run: task, workers, rounds, the exchange, the optimizers."""
    p.add_argument("--task", default="gpt-bytes", help="registered task name")
    p.add_argument("--preset", default="tiny", help="model preset of the task (tiny, small, base)")
    p.add_argument("--workers", type=int, default=4, help="number of DiLoCo workers")
    p.add_argument("--steps", type=int, default=300, help="inner steps per worker")
    p.add_argument("--sync-every", type=int, default=50, help="H: inner steps between syncs")
    p.add_argument(
        "--exchange",
        choices=("int8", "fp32"),
        default="int8",
        help="int8: the blockwise codec; fp32: exact averaging",
    )
    p.add_argument("--fragments", type=int, default=1, help="F: Streaming DiLoCo fragments")
    p.add_argument(
        "--delay",
        type=int,
        default=0,
        help="tau: inner steps a fragment's exchange overlaps before it lands",
    )
    p.add_argument(
        "--alpha",
        type=float,
        default=0.0,
        help="mix on landing: local = lerp(global, local, alpha)",
    )
    p.add_argument("--error-feedback", action="store_true", help="keep the quantization residual")
    p.add_argument("--outer-lr", type=float, default=None, help="outer learning rate (default 0.7)")
    p.add_argument(
        "--outer-momentum",
        type=float,
        default=None,
        help="outer Nesterov momentum (default 0.9)",
    )
    p.add_argument(
        "--lr", type=float, default=None, help="inner peak learning rate (preset default)"
    )
    p.add_argument("--batch-size", type=int, default=None, help="sequences per worker step")
    p.add_argument("--no-baseline", action="store_true", help="skip the synchronous baseline")
    p.add_argument(
        "--warm-start",
        type=int,
        default=0,
        metavar="STEPS",
        help="first train STEPS steps synchronously (N times the batch) and start every arm "
        "from there, as the DiLoCo paper does (0: every arm from the initial model)",
    )


def _add_sweep_options(p: argparse.ArgumentParser) -> None:
    """A grid of runs over H and the outer optimizer."""
    p.add_argument(
        "--sweep",
        action="store_true",
        help="try every H of --sweep-sync-every with every outer lr of --sweep-outer-lr and "
        "every momentum of --sweep-outer-momentum (one DiLoCo arm each, one baseline) and "
        "print them best first",
    )
    p.add_argument("--sweep-sync-every", default="10,30,100", help="the H values of --sweep")
    p.add_argument("--sweep-outer-lr", default="0.4,0.7,1.0", help="the outer lrs of --sweep")
    p.add_argument(
        "--sweep-outer-momentum",
        default="0.5,0.9",
        help="the outer momenta of --sweep (0.5 learned better than the papers' 0.9 in small "
        "runs with small batches)",
    )


def _add_machine_options(p: argparse.ArgumentParser) -> None:
    """Evaluation, seed, device and output."""
    p.add_argument("--eval-every", type=int, default=50, help="evaluate every N steps")
    p.add_argument("--seed", type=int, default=0, help="seed of the model and the data streams")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    p.add_argument(
        "--precision",
        choices=("auto", "fp32", "bf16", "fp16"),
        default="auto",
        help="inner-loop arithmetic (auto: bf16 on CUDA, fp32 on CPU)",
    )
    p.add_argument(
        "--compile",
        choices=("auto", "on", "off"),
        default="auto",
        help="torch.compile the model (auto: on CUDA only)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for torch (default: torch's choice, usually one per core)",
    )
    p.add_argument("--json", metavar="FILE", default=None, help="also write the summary here")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _run_simulate(args: argparse.Namespace) -> int:
    import torch

    from swarmloco.train.simulate import SimulationConfig, run_sync, warm_start
    from swarmloco.train.tasks import get_task, resolve_model

    task = get_task(args.task)
    model = resolve_model(task, args.preset, _model_overrides(args))
    run = _simulated_run(task.default_run(args.preset), args)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    sim = SimulationConfig(
        workers=args.workers,
        steps=args.steps,
        exchange=args.exchange,
        eval_every=args.eval_every,
        device=device,
    )
    data = task.load_data(model, _data_spec(args))
    print(f"data: {data.description}", file=sys.stderr)
    progress = not args.no_progress
    start = None
    if args.warm_start:
        if args.warm_start >= args.steps:
            raise SystemExit(f"--warm-start {args.warm_start} leaves nothing of --steps")
        start = warm_start(task, model, data, run, sim, args.warm_start, progress=progress)
    grid = _grid(args, run.spec)
    diloco = _diloco_arms(args, grid, task, model, data, run, sim, start, progress=progress)
    baseline = None
    if not args.no_baseline:
        baseline = run_sync(task, model, data, run, sim, progress=progress, start=start)
    arms = [*diloco, baseline] if baseline is not None else diloco
    summary = _summary(args, task, model, data, device, arms)
    if start is not None:
        summary["warm_start_steps"] = start.step
    if args.sweep:
        _rank_sweep(summary, grid, diloco, baseline)
    elif baseline is not None:
        _compare_to_sync(summary, diloco[0], baseline)
    text = json.dumps(summary, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    return 0


def _diloco_arms(
    args: argparse.Namespace,
    grid: list[tuple[int, float, float]],
    task: Task,
    model: dict[str, Any],
    data: TokenData,
    run: RunConfig,
    sim: SimulationConfig,
    start: WarmStart | None,
    *,
    progress: bool,
) -> list[ArmResult]:
    """One DiLoCo arm per (H, outer lr, outer momentum) of ``grid``, named by them when
    sweeping."""
    import dataclasses

    from swarmloco.train.simulate import run_diloco

    suffix = f"-F{args.fragments}" if args.fragments > 1 else ""
    arms = []
    for h, outer_lr, momentum in grid:
        arm_spec = dataclasses.replace(
            run.spec, sync_every=h, outer_lr=outer_lr, outer_momentum=momentum
        )
        arm_run = dataclasses.replace(run, spec=arm_spec)
        label = f"diloco-{args.exchange}{suffix}"
        if args.sweep:
            label += f"-H{h}-lr{outer_lr:g}-m{momentum:g}"
        arms.append(
            run_diloco(task, model, data, arm_run, sim, progress=progress, label=label, start=start)
        )
    return arms


def _summary(
    args: argparse.Namespace,
    task: Task,
    model: dict[str, Any],
    data: TokenData,
    device: str,
    arms: list[ArmResult],
) -> dict[str, Any]:
    """What was simulated, and what each arm measured."""
    return {
        "task": task.name,
        "preset": args.preset,
        "model_params": sum(p.numel() for p in task.build_model(model).parameters()),
        "workers": args.workers,
        "steps": args.steps,
        "sync_every": args.sync_every,
        "fragments": args.fragments,
        "delay": args.delay,
        "alpha": args.alpha,
        "exchange": args.exchange,
        "device": device,
        "precision": args.precision,
        "data": data.description,
        "tokens": arms[0].tokens,
        "arms": {a.name: a.summary() for a in arms},
    }


def _compare_to_sync(summary: dict[str, Any], diloco: ArmResult, baseline: ArmResult) -> None:
    """Put DiLoCo's final eval loss over the baseline's into ``summary``, and say it."""
    d, s = diloco.final_eval_loss, baseline.final_eval_loss
    summary["diloco_vs_sync_eval_loss_ratio"] = d / s
    print(
        f"final eval loss: {diloco.name} {d:.4f}, sync {s:.4f} "
        f"({100 * (d / s - 1):+.2f}% vs synchronous data-parallel at equal tokens)",
        file=sys.stderr,
    )


def _simulated_run(run: RunConfig, args: argparse.Namespace) -> RunConfig:
    """The task's default run with the command line's inner and outer settings."""
    import dataclasses

    inner = run.inner
    inner = dataclasses.replace(
        inner,
        total_steps=args.steps,
        lr=args.lr if args.lr is not None else inner.lr,
        batch_size=args.batch_size or inner.batch_size,
        warmup_steps=min(inner.warmup_steps, max(args.steps // 10, 1)),
        precision=args.precision,
        compile=args.compile,
    )
    spec = dataclasses.replace(
        run.spec,
        sync_every=args.sync_every,
        fragments=args.fragments,
        delay=args.delay,
        alpha=args.alpha,
        outer_lr=run.spec.outer_lr if args.outer_lr is None else args.outer_lr,
        outer_momentum=(
            run.spec.outer_momentum if args.outer_momentum is None else args.outer_momentum
        ),
        codec=dataclasses.replace(run.spec.codec, error_feedback=args.error_feedback),
        seed=args.seed,
    )
    return dataclasses.replace(run, inner=inner, spec=spec)


def _grid(args: argparse.Namespace, spec: RunSpec) -> list[tuple[int, float, float]]:
    """(H, outer lr, outer momentum) of each DiLoCo arm: one, or the sweep's grid."""
    if not args.sweep:
        return [(args.sync_every, spec.outer_lr, spec.outer_momentum)]
    return [
        (int(h), float(lr), float(mu))
        for h in args.sweep_sync_every.split(",")
        for lr in args.sweep_outer_lr.split(",")
        for mu in args.sweep_outer_momentum.split(",")
    ]


def _rank_sweep(
    summary: dict[str, Any],
    grid: list[tuple[int, float, float]],
    diloco: list[ArmResult],
    baseline: ArmResult | None,
) -> None:
    """Rank the sweep's arms by final eval loss into ``summary`` and print the ranking."""
    ranked = sorted(zip(grid, diloco, strict=True), key=lambda g: g[1].final_eval_loss)
    summary["sweep"] = [
        {
            "sync_every": h,
            "outer_lr": lr,
            "outer_momentum": mu,
            "final_eval_loss": a.final_eval_loss,
            **({"over_sync": a.final_eval_loss / baseline.final_eval_loss} if baseline else {}),
        }
        for (h, lr, mu), a in ranked
    ]
    summary["best"] = summary["sweep"][0]
    for row in summary["sweep"]:
        versus = f" ({100 * (row['over_sync'] - 1):+.2f}% vs sync)" if baseline else ""
        print(
            f"H {row['sync_every']:>4}  outer lr {row['outer_lr']:<4g}  "
            f"momentum {row['outer_momentum']:<4g}  "
            f"final eval loss {row['final_eval_loss']:.4f}{versus}",
            file=sys.stderr,
        )
    best = summary["best"]
    print(
        f"best: --sync-every {best['sync_every']} --outer-lr {best['outer_lr']:g} "
        f"--outer-momentum {best['outer_momentum']:g}",
        file=sys.stderr,
    )
