"""What the swarm costs a user's training loop, beside the same loop without it. Prints one
JSON object.

Per preset of the built-in GPT or another built-in task (``llama:360m``; a user's own
loop: AdamW, clipping, the task's batches), one peer alone, in this process:

  plain       the loop without a swarm: median seconds per step
  hooked      the same loop inside ``with swarm`` (the optimizer's step hooked), between
              rounds (H far beyond the measured steps): median seconds per step; the two
              arms alternate step by step, with the swarm's network thread running
  rounds      the same with a round every H steps: the stall of a step that runs a round
              (median over rounds of that step's time minus the median step)

Keys per preset: ``step_plain_s``, ``step_hooked_s``, ``hook_overhead_ratio`` (target
<= 1.01), ``round_stall_s``. With ``--baseline-src DIR`` (the ``src`` of another checkout,
e.g. one from before the library API) the daemon of both is run alone for the same rounds
(``swarmloco create --max-rounds``) and ``daemon_stall_per_round_s`` compares them: the
wall time not spent in inner steps, per round.

    python scripts/bench_overhead.py [--presets tiny,small] [--steps 60] [--baseline-src DIR]
    python scripts/bench_overhead.py --presets llama:135m,llama:360m --seq-len 64 --steps 20
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import machine

import swarmloco
from swarmloco.net.averaging import MatchmakingConfig
from swarmloco.net.node import NodeConfig
from swarmloco.train.data import BatchStream
from swarmloco.train.spec import DataSpec
from swarmloco.train.tasks import get_task, resolve_model

REPO = Path(__file__).resolve().parents[1]


def user_loop(preset: str, batch_size: int, seq_len: int | None) -> tuple[Any, Any, Any]:
    """A user's model, AdamW and step: ``preset`` is the built-in GPT's, or ``TASK:PRESET``
    (``llama:360m``); ``seq_len`` overrides the preset's context (None: the preset's)."""
    task_name, _, name = preset.rpartition(":")
    task = get_task(task_name or "gpt-bytes")
    config = resolve_model(task, name, {"seq_len": seq_len} if seq_len else None)
    torch.manual_seed(0)
    model = task.build_model(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = task.load_data(config, DataSpec())
    stream = iter(
        BatchStream(
            data.train,
            seq_len=int(config["seq_len"]),
            batch_size=batch_size,
            vocab_size=data.vocab_size,
            seed=0,
            worker=0,
        )
    )

    def step() -> None:
        x, y = next(stream)
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()  # with a swarm, its work runs in here (the hook)

    return model, opt, step


def timed(step: Any, n: int) -> list[float]:
    out = []
    for _ in range(n):
        started = time.perf_counter()
        step()
        out.append(time.perf_counter() - started)
    return out


def peer(tmp: Path, name: str, sync_every: int, model: Any, opt: Any) -> swarmloco.Swarm:
    config = swarmloco.PeerConfig(
        data_dir=tmp / name,
        node=NodeConfig(),
        handle_signals=False,
        matchmaking=MatchmakingConfig(gather_s=0.5, poll_s=0.05),
        codec_backend="eager",
    )
    return swarmloco.create(swarmloco.RunSpec(sync_every=sync_every), model, opt, config=config)


def bench_preset(
    preset: str, steps: int, batch_size: int, seq_len: int | None, tmp: Path
) -> dict[str, Any]:
    _, _, plain_step = user_loop(preset, batch_size, seq_len)
    model, opt, hooked_step = user_loop(preset, batch_size, seq_len)
    with peer(tmp, f"{preset}-hooked", 100_000, model, opt):
        timed(plain_step, 3)
        timed(hooked_step, 3)
        # Interleaved, step by step: a drift of the machine hits both arms alike.
        plain, hooked = [], []
        for _ in range(steps):
            plain += timed(plain_step, 1)
            hooked += timed(hooked_step, 1)
    # The two arms' models go before the third is built: at 362M, three models and their
    # AdamW do not fit in 23 GB beside a swarm's state.
    del plain_step, hooked_step, model, opt
    gc.collect()
    h = 10
    model, opt, round_step = user_loop(preset, batch_size, seq_len)
    swarm = peer(tmp, f"{preset}-rounds", h, model, opt)
    with swarm:
        times, rounds = [], []
        for _ in range(steps):
            before = swarm.round
            started = time.perf_counter()
            round_step()
            times.append(time.perf_counter() - started)
            rounds.append(swarm.round != before)
    normal = statistics.median(t for t, r in zip(times, rounds, strict=True) if not r)
    stalls = [t - normal for t, r in zip(times, rounds, strict=True) if r]
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "steps": steps,
        "batch_size": batch_size,
        "step_plain_s": statistics.median(plain),
        "step_hooked_s": statistics.median(hooked),
        "hook_overhead_ratio": statistics.median(hooked) / statistics.median(plain),
        "rounds": len(stalls),
        "sync_every": h,
        "round_stall_s": statistics.median(stalls) if stalls else None,
    }


def daemon_stall(src: Path | None, tmp: Path, rounds: int, preset: str) -> float:
    """(wall - inner-step time) per round of `swarmloco create` alone, from its events."""
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = f"{src}{os.pathsep}{env.get('PYTHONPATH', '')}"
    task, _, name = preset.rpartition(":")
    done = subprocess.run(
        [
            sys.executable, "-m", "swarmloco.cli", "create", "--task", task or "gpt-bytes",
            "--preset", name,
            "--sync-every", "10", "--batch-size", "8", "--max-rounds", str(rounds),
            "--host", "127.0.0.1", "--threads", "1", "--codec", "eager", "--gather", "0.5",
            "--data-dir", str(tmp), "--events", "-",
        ],
        capture_output=True, text=True, env=env, timeout=1800,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    stopped = next(e for e in events if e["event"] == "stopped")
    return (stopped["wall_seconds"] - stopped["train_seconds"]) / rounds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--presets",
        default="tiny,small",
        help="the built-in GPT's presets, or TASK:PRESET (llama:135m,llama:360m)",
    )
    p.add_argument("--seq-len", type=int, default=None, help="context (default: the preset's)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--threads", type=int, default=1, help="torch threads (the same per arm)")
    p.add_argument("--baseline-src", type=Path, default=None)
    p.add_argument("--daemon-rounds", type=int, default=10)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as scratch:
        tmp = Path(scratch)
        for preset in args.presets.split(","):
            results[preset] = bench_preset(preset, args.steps, args.batch_size, args.seq_len, tmp)
            if args.baseline_src is not None:
                ours = daemon_stall(None, tmp / f"{preset}-daemon", args.daemon_rounds, preset)
                base = daemon_stall(
                    args.baseline_src, tmp / f"{preset}-base", args.daemon_rounds, preset
                )
                results[preset]["daemon_stall_per_round_s"] = {"this": ours, "baseline": base}
    print(
        json.dumps(
            {
                "benchmark": "overhead",
                "machine": machine(),
                "settings": {
                    "presets": args.presets.split(","),
                    "steps": args.steps,
                    "batch_size": args.batch_size,
                    "seq_len": args.seq_len,
                    "threads": args.threads,
                    "baseline_src": str(args.baseline_src) if args.baseline_src else None,
                },
                "results": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
