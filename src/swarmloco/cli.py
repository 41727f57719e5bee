"""The `swarmloco` command line: subcommands -> config dataclasses -> runtime. No logic here.

Modules that import torch are imported inside the command that needs them, so that
`swarmloco bootstrap` and `swarmloco dashboard` start fast and small.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from swarmloco import __version__
from swarmloco.errors import SwarmlocoError

Handler = Callable[[argparse.Namespace], int]
Register = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]

# Each entry adds one subcommand to the parser and sets its handler with set_defaults.
_COMMANDS: list[Register] = []


def command(register: Register) -> Register:
    """Decorator: add a subcommand (in definition order, which is the order of --help)."""
    _COMMANDS.append(register)
    return register


def _setup_logging(verbosity: int) -> None:
    level = logging.WARNING if verbosity < 0 else logging.INFO if verbosity == 0 else logging.DEBUG
    logging.basicConfig(
        level=level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swarmloco",
        description=(
            "Low-communication decentralized training: every peer trains locally with AdamW "
            "and the swarm averages what it learned every few hundred steps "
            "(DiLoCo / Streaming DiLoCo)."
        ),
    )
    parser.add_argument("--version", action="version", version=f"swarmloco {__version__}")
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)"
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for register in _COMMANDS:
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _setup_logging(-1 if args.quiet else args.verbose)
    handler: Handler = args.handler
    try:
        return handler(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (SwarmlocoError, ValueError) as exc:
        print(f"swarmloco {args.command}: error: {exc}", file=sys.stderr)
        return 2


# --------------------------------------------------------------------------- shared options


def _add_data_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data (default: the Python standard library's .py files as bytes)")
    g.add_argument(
        "--data",
        metavar="PATH",
        action="append",
        default=[],
        help="a text file or directory (all files below it), or with --data-kind tokens a .npy "
        "or raw .bin token file; repeat for several",
    )
    g.add_argument(
        "--data-kind",
        choices=("text", "tokens"),
        default="text",
        help="how to read --data paths: text (bytes, vocabulary 256) or tokens (pre-tokenized)",
    )
    g.add_argument(
        "--data-suffix",
        metavar="EXT",
        action="append",
        default=[],
        help="with text directories, only files ending in EXT (e.g. .py); repeatable",
    )
    g.add_argument(
        "--token-dtype",
        default="uint16",
        help="element type of raw .bin token files (default: uint16)",
    )
    g.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="vocabulary size for token files (default: the preset's, 256)",
    )


def _data_spec(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from swarmloco.train.spec import DataSpec

    if not args.data:
        return DataSpec()
    return DataSpec(
        source="tokens" if args.data_kind == "tokens" else "text",
        paths=tuple(args.data),
        suffixes=tuple(args.data_suffix),
        token_dtype=args.token_dtype,
    )


# --------------------------------------------------------------------------- simulate


@command
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
        "--lr", type=float, default=None, help="inner peak learning rate (preset default)"
    )
    p.add_argument("--batch-size", type=int, default=None, help="sequences per worker step")
    p.add_argument("--no-baseline", action="store_true", help="skip the synchronous baseline")
    p.add_argument("--eval-every", type=int, default=50, help="evaluate every N steps")
    p.add_argument("--seed", type=int, default=0, help="seed of the model and the data streams")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for torch (default: torch's choice, usually one per core)",
    )
    p.add_argument("--json", metavar="FILE", default=None, help="also write the summary here")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    _add_data_options(p)
    p.set_defaults(handler=_run_simulate)


def _run_simulate(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    from swarmloco.core.fragments import StreamingConfig
    from swarmloco.train.simulate import SimulationConfig, run_diloco, run_sync
    from swarmloco.train.tasks import get_task, resolve_model

    task = get_task(args.task)
    overrides = {"vocab_size": args.vocab_size} if args.vocab_size else {}
    model = resolve_model(task, args.preset, overrides)
    run = task.default_run(args.preset)
    inner = run.inner
    inner = dataclasses.replace(
        inner,
        total_steps=args.steps,
        lr=args.lr if args.lr is not None else inner.lr,
        batch_size=args.batch_size or inner.batch_size,
        warmup_steps=min(inner.warmup_steps, max(args.steps // 10, 1)),
    )
    streaming = StreamingConfig(
        sync_every=args.sync_every, fragments=args.fragments, delay=args.delay, alpha=args.alpha
    )
    outer = run.outer if args.outer_lr is None else dataclasses.replace(run.outer, lr=args.outer_lr)
    codec = dataclasses.replace(run.codec, error_feedback=args.error_feedback)
    run = dataclasses.replace(
        run, inner=inner, streaming=streaming, outer=outer, codec=codec, seed=args.seed
    )
    import torch

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
    arms = [
        run_diloco(
            task,
            model,
            data,
            run,
            sim,
            progress=progress,
            label=f"diloco-{args.exchange}" + (f"-F{args.fragments}" if args.fragments > 1 else ""),
        )
    ]
    if not args.no_baseline:
        arms.append(run_sync(task, model, data, run, sim, progress=progress))
    summary = {
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
        "data": data.description,
        "tokens": arms[0].tokens,
        "arms": {a.name: a.summary() for a in arms},
    }
    if len(arms) == 2:
        d, s = arms[0].final_eval_loss, arms[1].final_eval_loss
        summary["diloco_vs_sync_eval_loss_ratio"] = d / s
        print(
            f"final eval loss: {arms[0].name} {d:.4f}, sync {s:.4f} "
            f"({100 * (d / s - 1):+.2f}% vs synchronous data-parallel at equal tokens)",
            file=sys.stderr,
        )
    text = json.dumps(summary, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
