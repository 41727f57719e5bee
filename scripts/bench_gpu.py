#!/usr/bin/env python3
"""A peer on a GPU: the inner loop's MFU at the llama presets, and the share of wall time
two peers on one GPU train across rounds. Prints ONE JSON object (and writes it to --out).

    python scripts/bench_gpu.py                                    # mfu and swarm, on CUDA
    python scripts/bench_gpu.py --parts mfu --presets 135m:16,1b:8 --steps 20
    python scripts/bench_gpu.py --parts swarm --swarm-preset 135m --rounds 3

``mfu``: per PRESET:BATCH, the built-in ``llama`` task's model in the swarm's own inner
loop (``InnerLoop``: bf16 autocast, ``torch.compile``, fused AdamW, clipping), on random
tokens (a fresh batch each step from a pool of eight, so no cache holds them), ``--warmup``
steps (compilation) then ``--steps`` timed ones; ``step_s`` the median, ``tokens_per_s``,
``mfu`` against the card's dense bf16 peak (``--peak-tflops``, 989 for an H100 or H200
SXM), and ``mfu_measured_peak`` against the bf16 matrix product this run measured
(8192^3, random data). FLOPs per token: ``LlamaConfig.flops_per_token`` (docs/DESIGN.md).

``swarm``: ``scripts/local_swarm.py`` with two peers of ``--swarm-preset`` on this GPU,
``--sync-every`` (H, 500) steps a round, until ``--rounds``; from each peer's events, between
its first and last applied round: ``train_share`` (the training loop's share of the wall
time), ``stall_per_round_s`` (the wall time not spent in inner steps, per round), of it the
loop's time starting each round, waiting for its exchange at the landing, applying it and
evaluating (the checkpoint's copy is in its own event), and the rounds' own
seconds; ``--delay`` (tau) overlaps each exchange with that many steps; ``gpu_busy``
from ``nvidia-smi`` samples over the same stretch.
Without CUDA both parts run on the CPU at the tiny preset, a few steps and H = 10, so that
the script is tested (the report's settings say what ran).
"""

from __future__ import annotations

import argparse
import itertools
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import machine

from swarmloco.train.inner import InnerConfig, InnerLoop
from swarmloco.train.spec import LlamaConfig
from swarmloco.train.tasks import get_task, resolve_model

REPO = Path(__file__).resolve().parents[1]
# Without CUDA the script runs at a size the CPU takes in seconds (so that it is tested), in
# place of the options given; the report's settings are these then.
CPU_SETTINGS = {
    "presets": "tiny:4", "steps": 3, "warmup": 1,
    "swarm_preset": "tiny", "swarm_batch": 4, "sync_every": 10,
}  # fmt: skip


def matmul_tflops(device: torch.device) -> float | None:
    """bf16 8192^3 matrix products on random data: the median rate of 10, in TFLOP/s."""
    if device.type != "cuda":
        return None
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * n**3 / statistics.median(times) / 1e12


def bench_mfu(
    preset: str, batch: int, steps: int, warmup: int, device: torch.device, peaks: dict[str, Any]
) -> dict[str, Any]:
    task = get_task("llama")
    model_cfg = resolve_model(task, preset)
    config = LlamaConfig(**model_cfg)
    torch.manual_seed(0)
    model = task.build_model(model_cfg)
    on_cuda = device.type == "cuda"
    inner = InnerLoop(
        model,
        InnerConfig(
            lr=3e-4,
            warmup_steps=10,
            total_steps=10_000,
            batch_size=batch,
            precision="bf16" if on_cuda else "fp32",
            compile="on" if on_cuda else "off",
        ),
        device,
    )
    gen = torch.Generator(device="cpu").manual_seed(1)
    pool = [
        torch.randint(0, config.vocab_size, (batch, config.seq_len + 1), generator=gen).to(device)
        for _ in range(8)
    ]

    def batches(pool: list[torch.Tensor]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for rows in itertools.cycle(pool):
            yield rows[:, :-1], rows[:, 1:]

    stream = batches(pool)
    started = time.perf_counter()
    for _ in range(warmup):
        inner.train_step(stream)
    warm_s = time.perf_counter() - started
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        inner.train_step(stream)  # returns a float: the step is synchronised
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    tokens_per_s = batch * config.seq_len / step_s
    flops = config.flops_per_token() * tokens_per_s
    out: dict[str, Any] = {
        "preset": preset,
        "params": sum(p.numel() for p in model.parameters()),
        "seq_len": config.seq_len,
        "micro_batch": batch,
        "tokens_per_step": batch * config.seq_len,
        "warmup_steps": warmup,
        "warmup_s": round(warm_s, 1),
        "steps": steps,
        "step_s": round(step_s, 4),
        "step_s_min": round(min(times), 4),
        "step_s_max": round(max(times), 4),
        "tokens_per_s": round(tokens_per_s),
        "flops_per_token": config.flops_per_token(),
        "achieved_tflops": round(flops / 1e12, 1),
    }
    if on_cuda:
        out["mfu"] = round(flops / (peaks["datasheet_tflops"] * 1e12), 4)
        if peaks.get("measured_tflops"):
            out["mfu_measured_peak"] = round(flops / (peaks["measured_tflops"] * 1e12), 4)
        out["max_memory_gb"] = round(torch.cuda.max_memory_allocated(device) / 1e9, 1)
    del inner, model, pool, stream
    if on_cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return out


def _events(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut short by the peer's end
    return out


class GpuSampler:
    """``nvidia-smi`` utilisation samples (time, percent) every half second, while running."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, int]] = []
        self._proc: subprocess.Popen[str] | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> GpuSampler:
        try:
            self._proc = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                 "-lms", "500"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            )  # fmt: skip
        except OSError:
            return self
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        return self

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            try:
                self.samples.append((time.time(), int(line.strip().split()[0])))
            except (ValueError, IndexError):
                continue

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=10)

    def busy(self, start: float, end: float) -> float | None:
        """Mean utilisation (0-1) of the samples in [start, end]."""
        inside = [u for t, u in self.samples if start <= t <= end]
        return round(statistics.fmean(inside) / 100, 3) if inside else None


def bench_swarm(args: argparse.Namespace, run_dir: Path, device: torch.device) -> dict[str, Any]:
    preset = args.swarm_preset
    extra = f"--device {device.type} --eval-every {args.eval_every}"
    extra += " --min-group 2"  # every round averaged by both: what the figures are of
    command = [
        sys.executable, str(REPO / "scripts" / "local_swarm.py"),
        "--task", "llama", "--preset", preset, "--peers", "2",
        "--rounds", str(args.rounds), "--sync-every", str(args.sync_every),
        "--batch-size", str(args.swarm_batch), "--threads", "1",
        "--dashboard-port", "-1", "--dir", str(run_dir), "--extra", extra,
        "--create-extra", f"--delay {args.delay}",
    ]  # fmt: skip
    with GpuSampler() as sampler:
        swarm = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            stdout, stderr = swarm.communicate(timeout=args.swarm_timeout)
        except subprocess.TimeoutExpired:  # Ctrl-C: it stops its peers, the events stay
            swarm.send_signal(signal.SIGINT)
            stdout, stderr = swarm.communicate(timeout=120)
            stderr += f"\n(stopped at the --swarm-timeout of {args.swarm_timeout:.0f} s)"
    try:
        summary = json.loads(stdout)
    except json.JSONDecodeError:
        summary = {"stdout": stdout[-2000:]}
    out: dict[str, Any] = {
        "preset": preset,
        "peers": 2,
        "sync_every": args.sync_every,
        "micro_batch": args.swarm_batch,
        "rounds": args.rounds,
        "delay": args.delay,
        "eval_every": args.eval_every,
        "exit_code": swarm.returncode,
        "same_final_state": summary.get("same_final_state"),
    }
    if swarm.returncode != 0:
        out["stderr_tail"] = stderr[-3000:]
    out["per_peer"] = per_peer(run_dir, sampler)
    return out


def _median(events: list[dict[str, Any]], field: str) -> float | None:
    values = [e[field] for e in events if field in e]  # older events lack the field
    return statistics.median(values) if values else None


def per_peer(run_dir: Path, sampler: GpuSampler | None = None) -> list[dict[str, Any]]:
    """Each peer's figures between its first and last applied round, from the events in
    ``run_dir`` (peer0.events, peer1.events, ...), or in the newest run folder under it
    (``scripts/local_swarm.py --dir`` makes one a run)."""
    if not any(run_dir.glob("peer*.events")) and run_dir.is_dir():
        runs = sorted(d for d in run_dir.iterdir() if d.is_dir())
        run_dir = runs[-1] if runs else run_dir
    out = []
    for path in sorted(run_dir.glob("peer*.events")):
        rounds = [e for e in _events(path) if e["event"] == "round"]
        if len(rounds) < 2:
            out.append({"peer": path.stem, "rounds_applied": len(rounds)})
            continue
        first, final = rounds[0], rounds[-1]
        wall = final["time"] - first["time"]
        trained = final["train_seconds"] - first["train_seconds"]
        n = len(rounds) - 1
        out.append(
            {
                "peer": path.stem,
                "rounds_applied": len(rounds),
                "measured_rounds": n,
                "steps": final["step"] - first["step"],
                "wall_s": round(wall, 2),
                "train_share": round(trained / wall, 4) if wall > 0 else None,
                "stall_per_round_s": round((wall - trained) / n, 3),
                "round_seconds_median": statistics.median(e["seconds"] for e in rounds[1:]),
                "matchmaking_seconds_median": statistics.median(
                    e["matchmaking_seconds"] for e in rounds[1:]
                ),
                # Of the stall: the loop waiting for the exchange at the landing, evaluating.
                "wait_seconds_median": _median(rounds[1:], "wait_seconds"),
                "eval_seconds_median": _median(rounds[1:], "eval_seconds"),
                "start_seconds_median": _median(rounds[1:], "start_seconds"),
                "apply_seconds_median": _median(rounds[1:], "apply_seconds"),
                "final_digest": final["digest"][:16],
                "gpu_busy": sampler.busy(first["time"], final["time"]) if sampler else None,
            }
        )
    return out


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--parts", default="mfu,swarm", help="mfu, swarm or both (default)")
    p.add_argument(
        "--presets", default="135m:16,1b:8", help="PRESET:MICRO_BATCH,... of the llama task"
    )
    p.add_argument("--steps", type=int, default=20, help="timed inner steps per preset")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation)")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak")
    p.add_argument("--swarm-preset", default="135m", help="the two peers' llama preset")
    p.add_argument("--swarm-batch", type=int, default=8, help="the two peers' micro-batch")
    p.add_argument("--sync-every", type=int, default=500, help="H of the two peers")
    p.add_argument("--rounds", type=int, default=3, help="the two peers stop after this round")
    p.add_argument(
        "--delay",
        type=int,
        default=0,
        help="tau: inner steps each round's exchange overlaps (0: the loop waits for it)",
    )
    p.add_argument("--eval-every", type=int, default=1, help="rounds between evaluations (0: none)")
    p.add_argument("--swarm-timeout", type=float, default=600.0, help="seconds, then give up")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    p.add_argument(
        "--swarm-dir", type=Path, default=None, help="keep the two peers' logs here (default: none)"
    )
    p.add_argument(
        "--from-events",
        type=Path,
        default=None,
        help="only the swarm figures, from the peer*.events of an earlier run in this folder "
        "(or a --swarm-dir: its newest run)",
    )
    args = p.parse_args()
    if args.from_events is not None:
        figures = per_peer(args.from_events)
        if not figures:
            p.error(f"--from-events: no peer*.events in {args.from_events} nor in a run under it")
        print(json.dumps({"per_peer": figures}, indent=2))
        return 0
    on_cuda = torch.cuda.is_available()
    device = torch.device("cuda" if on_cuda else "cpu")
    if not on_cuda:  # what runs without CUDA, in place of what was asked (its settings say so)
        vars(args).update(CPU_SETTINGS)
    parts = set(args.parts.split(","))
    report: dict[str, Any] = {
        "bench": "gpu",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    }

    def save() -> None:
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")

    if "mfu" in parts:
        peaks = {"datasheet_tflops": args.peak_tflops, "measured_tflops": None}
        measured = matmul_tflops(device)
        peaks["measured_tflops"] = round(measured, 1) if measured else None
        report["peaks"] = peaks
        report["mfu"] = []
        for spec in args.presets.split(","):
            preset, _, batch = spec.partition(":")
            try:
                report["mfu"].append(
                    bench_mfu(preset, int(batch or 8), args.steps, args.warmup, device, peaks)
                )
            except Exception as exc:  # one preset's failure (memory) leaves the others
                report["mfu"].append({"preset": preset, "error": repr(exc)[:500]})
            print(json.dumps(report["mfu"][-1]), file=sys.stderr, flush=True)
            save()
    if "swarm" in parts:
        with tempfile.TemporaryDirectory() as tmp:
            try:
                report["swarm"] = bench_swarm(args, args.swarm_dir or Path(tmp), device)
            except Exception as exc:
                report["swarm"] = {"error": repr(exc)[:1000]}
        save()
    print(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
