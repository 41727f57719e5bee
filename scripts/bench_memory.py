#!/usr/bin/env python3
"""A peer's host memory per parameter, beside the same model and inner optimizer without a
swarm. Prints ONE JSON object.

    python scripts/bench_memory.py                          # llama 135m, two peers
    python scripts/bench_memory.py --preset 360m --peers 1  # one peer alone at 362M
    python scripts/bench_memory.py --peers 1 --baseline-src OLD/src  # and an older checkout's

``plain``: a process that builds the ``llama`` preset's model and its AdamW (fp32, the CPU
loop of the daemon), loads the run's data and takes ``--sync-every`` steps: its resident
memory after them (``plain_rss_mb``) and its peak. ``swarm``: ``swarmloco join`` peers of
the same model (a bootstrap node; the second peer starts after the first applied round 2,
so it downloads the state, and the first trains on, its donor and partner, until the second
applied ``--rounds`` rounds), ``--rounds`` rounds of ``--sync-every`` steps, a checkpoint
every round; each peer's resident memory sampled every 0.1 s and read against its events:
``between_rounds_mb`` (the median while it trains between rounds, once a round was applied
and its checkpoint written), ``peak_mb`` (the highest sample), and the peak in each phase
(``round``: from a round's start to its event; ``checkpoint``: to the checkpoint's event;
``download``: from start to the ``downloaded`` event), and the peak between rounds (a
step's own temporaries come and go: the median does not see them); and from the events,
what the training loop waited for a round (``round_stall_s``: start and apply;
``round_wait_s``: the exchange at the landing; ``checkpoint_stall_s``: a checkpoint's
files written; ``eval_s``), medians.
``host_bytes_per_param_overhead``
is (between rounds - plain) / parameters and ``peak_bytes_per_param_overhead`` (peak -
plain peak) / parameters, over the peers; ``phase_peak_over_between_bytes_per_param``: for
each phase, how far its peak rose above the same peer's peak between rounds, per
parameter (the highest over the peers; 0 or less: no higher). ``held``: the buffers the
peer's DiLoCo state allocates for this model, by name, in bytes per parameter (read off a
``DilocoState`` built here for the manifest's layout; the states a peer serves, its
fallback and its downloads are unnamed files, in the page cache rather than the peer's
memory).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import machine, status_mb, stop_processes

COMMAND = [sys.executable, "-m", "swarmloco.cli"]


def plain(preset: str, seq_len: int, steps: int) -> None:
    """The reference process: model, AdamW, data and ``steps`` inner steps; prints JSON."""
    import os

    import torch

    from swarmloco.train.data import BatchStream
    from swarmloco.train.inner import InnerConfig, InnerLoop
    from swarmloco.train.spec import DataSpec
    from swarmloco.train.tasks import get_task, resolve_model

    torch.set_num_threads(1)
    task = get_task("llama")
    model_cfg = resolve_model(task, preset, {"seq_len": seq_len})
    torch.manual_seed(0)
    model = task.build_model(model_cfg)
    loop = InnerLoop(model, InnerConfig(batch_size=1, compile="off"), torch.device("cpu"))
    data = task.load_data(model_cfg, DataSpec())
    stream = BatchStream(
        data.train, seq_len=seq_len, batch_size=1, vocab_size=data.vocab_size, seed=0, worker=0
    )
    batches = iter(stream)
    for _ in range(steps):
        loop.train_step(batches)
    pid = os.getpid()
    print(
        json.dumps(
            {
                "params": sum(p.numel() for p in model.parameters()),
                "rss_mb": status_mb(pid, "VmRSS"),
                "peak_mb": status_mb(pid, "VmHWM"),
            }
        )
    )


def held(preset: str, seq_len: int) -> dict[str, float]:
    """Bytes per parameter of each buffer a peer's DiLoCo state allocates for the model
    (the states it serves, its fallback and its downloads are files: none here)."""
    import torch

    from swarmloco.core.flat import FlatLayout
    from swarmloco.core.runspec import RunSpec
    from swarmloco.train.diloco import DilocoState
    from swarmloco.train.tasks import get_task, resolve_model

    task = get_task("llama")
    model = task.build_model(resolve_model(task, preset, {"seq_len": seq_len}))
    spec = RunSpec()
    names = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    layout = FlatLayout(names, [0] * len(names), spec.codec.block_size)
    state = DilocoState(layout, spec.outer, spec.codec)
    n = sum(p.numel() for p in model.parameters())

    def nbytes(*tensors: torch.Tensor) -> float:
        return sum(t.nbytes for t in tensors) / n

    out = {
        "theta_g": nbytes(state.theta_g),
        "momentum": nbytes(state.momentum),
        "message": nbytes(*(t for m in state.messages for t in (m.payload, m.scales))),
        "mean": nbytes(*(t for m in state.means for t in (m.payload, m.scales))),
        "error_feedback": nbytes(
            *(
                t
                for f in state.feedback or []
                for t in vars(f).values()
                if isinstance(t, torch.Tensor)
            )
        ),
    }
    return {k: round(v, 3) for k, v in out.items()}


class Sampler:
    """Resident memory of some processes, every 0.1 s."""

    def __init__(self) -> None:
        self.samples: dict[int, list[tuple[float, float]]] = {}
        self.peaks: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def watch(self, pid: int) -> None:
        self.samples.setdefault(pid, [])

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            for pid in list(self.samples):
                rss, hwm = status_mb(pid, "VmRSS"), status_mb(pid, "VmHWM")
                if rss is not None:
                    self.samples[pid].append((time.time(), rss))
                if hwm is not None:
                    self.peaks[pid] = hwm

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def events_of(path: Path) -> list[dict[str, Any]]:
    out = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def phases(samples: list[tuple[float, float]], events: list[dict[str, Any]]) -> dict[str, Any]:
    def peak(windows: list[tuple[float, float]]) -> float | None:
        inside = [r for t, r in samples if any(a <= t <= b for a, b in windows)]
        return round(max(inside), 1) if inside else None

    rounds = [e for e in events if e["event"] == "round"]
    checkpoints = {e["round"]: e["time"] for e in events if e["event"] == "checkpoint"}
    ready = next((e["time"] for e in events if e["event"] == "ready"), None)
    downloaded = [e["time"] for e in events if e["event"] == "downloaded"]
    in_round = [(e["time"] - e["seconds"], e["time"]) for e in rounds]
    in_checkpoint = [
        (e["time"], checkpoints[e["round"]]) for e in rounds if e["round"] in checkpoints
    ]
    # Training between rounds: after the first round's checkpoint, outside every round
    # and checkpoint.
    busy = in_round + in_checkpoint
    settled = checkpoints.get(rounds[0]["round"], rounds[0]["time"]) if rounds else float("inf")
    steady = [r for t, r in samples if t > settled and not any(a <= t <= b for a, b in busy)]
    start = samples[0][0] if samples else 0.0
    return {
        "rounds_applied": len(rounds),
        "between_rounds_mb": round(statistics.median(steady), 1) if steady else None,
        "peak_between_rounds_mb": round(max(steady), 1) if steady else None,
        "peak_mb": round(max(r for _, r in samples), 1) if samples else None,
        "peak_in_round_mb": peak(in_round),
        "peak_in_checkpoint_mb": peak(in_checkpoint),
        "peak_in_download_mb": peak([(start, downloaded[0])]) if downloaded else None,
        "ready_s": round(ready - start, 1) if ready and samples else None,
        **stalls(events),
    }


def stalls(events: list[dict[str, Any]]) -> dict[str, float | None]:
    """What the training loop waited for, per round (medians, seconds): starting and
    applying the round (the update encoded, the outer step, the weights back) and the
    exchange it waited for at the landing; writing a checkpoint's files (the page cache;
    the rest is on the writer's thread); the evaluation."""

    def median(values: list[float]) -> float | None:
        return round(statistics.median(values), 3) if values else None

    rounds = [e for e in events if e["event"] == "round"]
    return {
        "round_stall_s": median(
            [e.get("start_seconds", 0) + e.get("apply_seconds", 0) for e in rounds]
        ),
        "round_wait_s": median([e.get("wait_seconds", 0) for e in rounds]),
        "checkpoint_stall_s": median(
            [e["copy_seconds"] for e in events if e["event"] == "checkpoint"]
        ),
        "eval_s": median([e.get("eval_seconds", 0) for e in rounds]),
    }


def swarm(
    args: argparse.Namespace, base: dict[str, Any], name: str, src: str | None
) -> dict[str, Any]:
    """The peers' part of the benchmark (see the module), run from ``src`` (a checkout's
    ``src/``; None: this one), its files under ``name``."""
    env = os.environ.copy()
    if src is not None:
        env["PYTHONPATH"] = src
    report: dict[str, Any] = {}
    children: list[subprocess.Popen[str]] = []
    with tempfile.TemporaryDirectory() as tmp, Sampler() as sampler:
        run = (args.dir or Path(tmp)) / name
        run.mkdir(parents=True, exist_ok=True)
        try:
            boot = subprocess.Popen(
                [*COMMAND, "bootstrap", "--host", "127.0.0.1", "--port", "0",
                 "--data-dir", str(run / "boot")],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
            )  # fmt: skip
            children.append(boot)
            assert boot.stdout is not None
            endpoint = re.search(r"serving on (\S+:\d+)", boot.stdout.readline())
            if endpoint is None:
                raise RuntimeError("the bootstrap node did not start")
            created = subprocess.run(
                [*COMMAND, "create", "--task", "llama", "--preset", args.preset,
                 "--seq-len", str(args.seq_len), "--batch-size", "1",
                 "--sync-every", str(args.sync_every), "--identity-work", "0", "--no-train",
                 "--peer", endpoint.group(1), "--data-dir", str(run / "peer0")],
                capture_output=True, text=True, check=True, timeout=600, env=env,
            )  # fmt: skip
            swarm = created.stdout.split()[0]

            def join(i: int, rounds: int) -> subprocess.Popen[str]:
                child = subprocess.Popen(
                    [*COMMAND, "join", swarm, "--peer", endpoint.group(1),
                     "--host", "127.0.0.1", "--threads", "1", "--gather", "2",
                     "--data-dir", str(run / f"peer{i}"), "--max-rounds", str(rounds),
                     "--events", str(run / f"peer{i}.events")],
                    stdout=subprocess.DEVNULL, stderr=(run / f"peer{i}.log").open("w"), text=True,
                    env=env,
                )  # fmt: skip
                children.append(child)
                sampler.watch(child.pid)
                return child

            # With a second peer, the first trains on until the second is done: its donor.
            peers = [join(0, args.rounds if args.peers == 1 else 1_000_000)]
            if args.peers == 2:
                # The second peer joins once the first has a state worth downloading.
                while not any(
                    e["event"] == "round" and e["round"] >= 2
                    for e in events_of(run / "peer0.events")
                ):
                    if peers[0].poll() is not None:
                        raise RuntimeError((run / "peer0.log").read_text()[-2000:])
                    time.sleep(0.5)
                peers.append(join(1, 1_000_000))
                # --max-rounds is a round of the swarm, and the newcomer starts from the
                # one it downloads: it is stopped once it applied --rounds of its own.
                while (
                    sum(e["event"] == "round" for e in events_of(run / "peer1.events"))
                    < args.rounds
                ):
                    if any(c.poll() is not None for c in peers):
                        break
                    time.sleep(0.5)
                for child in peers:
                    if child.poll() is None:
                        child.send_signal(signal.SIGTERM)  # it finishes the step and leaves
            for child in peers:
                child.wait(timeout=600)
            report["exit_codes"] = [c.returncode for c in peers]
            report["peers"] = [
                phases(sampler.samples[c.pid], events_of(run / f"peer{i}.events"))
                | {"vm_hwm_mb": sampler.peaks.get(c.pid)}
                for i, c in enumerate(peers)
            ]
            if any(c.returncode != 0 for c in peers):
                report["log_tail"] = (run / "peer0.log").read_text()[-2000:]
        finally:
            stop_processes(children)
            for i in range(args.peers):  # the checkpoints: 20 bytes a parameter each
                shutil.rmtree(run / f"peer{i}" / "swarms", ignore_errors=True)
    params = base["params"]
    steady = [p["between_rounds_mb"] for p in report["peers"] if p["between_rounds_mb"]]
    peaks = [p["peak_mb"] for p in report["peers"] if p["peak_mb"]]
    if steady:
        report["host_bytes_per_param_overhead"] = round(
            (max(steady) - base["rss_mb"]) * 2**20 / params, 2
        )
    if peaks:
        report["peak_bytes_per_param_overhead"] = round(
            (max(peaks) - base["peak_mb"]) * 2**20 / params, 2
        )
    # Whether a round, a checkpoint or a download costs more than training between rounds:
    # each phase's peak over the same peer's resident memory between rounds.
    over: dict[str, float] = {}
    for phase in ("round", "checkpoint", "download"):
        rises = [
            p[f"peak_in_{phase}_mb"] - p["peak_between_rounds_mb"]
            for p in report["peers"]
            if p[f"peak_in_{phase}_mb"] is not None and p["peak_between_rounds_mb"] is not None
        ]
        if rises:
            over[phase] = round(max(rises) * 2**20 / params, 2)
    report["phase_peak_over_between_bytes_per_param"] = over
    return report


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", default="135m", help="llama preset (default: 135m)")
    p.add_argument("--seq-len", type=int, default=16, help="context (default 16: CPU steps)")
    p.add_argument("--peers", type=int, default=2, help="1 or 2 (default 2)")
    p.add_argument("--rounds", type=int, default=4, help="rounds each peer applies (default 4)")
    p.add_argument("--sync-every", type=int, default=4, help="H (default 4)")
    p.add_argument(
        "--dir", type=Path, default=None, help="keep logs and events here (not checkpoints)"
    )
    p.add_argument(
        "--baseline-src",
        default=None,
        help="an older checkout's src/: its peers measured the same way, after this one's",
    )
    p.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.plain:
        plain(args.preset, args.seq_len, args.sync_every)
        return 0
    if args.peers not in (1, 2):
        p.error("--peers is 1 or 2")
    reference = subprocess.run(
        [sys.executable, __file__, "--plain", "--preset", args.preset,
         "--seq-len", str(args.seq_len), "--sync-every", str(args.sync_every)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    base = json.loads(reference.stdout.strip().splitlines()[-1])
    params = int(base["params"])
    report: dict[str, Any] = {
        "bench": "memory",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "params": params,
        "plain_rss_mb": base["rss_mb"],
        "plain_peak_mb": base["peak_mb"],
        "held_bytes_per_param": held(args.preset, args.seq_len),
    }
    report |= swarm(args, base, "swarm", None)
    if args.baseline_src:
        report["baseline"] = swarm(args, base, "baseline", args.baseline_src)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
