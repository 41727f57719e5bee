#!/usr/bin/env python3
"""How long training waits for a checkpoint. Prints one JSON object.

A peer checkpoints after every round by default. Its state is the global parameters and
outer momentum, the local parameters, and AdamW's two moments: five times the model in
fp32. For each preset, in one run and on the same disk, this compares:

  sync        CheckpointStore.save on the training thread (copy, write, hash, fsync)
  background  what the peer does: BackgroundWriter.submit copies the state on the
              training thread (the stall) and the write runs on the writer's thread

Keys per preset: `params`, `checkpoint_bytes`, `sync_stall_s`, `background_stall_s`,
`background_write_s` (medians over --repeats), and `stall_ratio` (sync / background).

    python scripts/bench_checkpoint.py [--presets tiny,small,base] [--repeats 3] [--dir .]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import machine

from swarmloco.runtime.checkpoint import BackgroundWriter, CheckpointStore
from swarmloco.train.inner import InnerLoop
from swarmloco.train.tasks import get_task, resolve_model

SWARM = "0" * 40


def peer_state(preset: str) -> tuple[int, dict[str, Any]]:
    """A state shaped like the peer's: the preset's real model and a real AdamW state."""
    task = get_task("gpt-bytes")
    model = task.build_model(resolve_model(task, preset))
    inner = InnerLoop(model, task.default_run(preset).inner, torch.device("cpu"))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    inner.optimizer.step()  # creates both moments of every parameter
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    state = {
        "theta_g": flat.clone(),
        "momentum": torch.zeros_like(flat),
        "params": flat,
        "inner": inner.state_dict(),
        "rng": torch.get_rng_state(),
        "round": 1,
    }
    return flat.numel(), state


def measure(preset: str, repeats: int, root: Path) -> dict[str, Any]:
    numel, state = peer_state(preset)
    sync, stall, write = [], [], []
    nbytes = 0
    store = CheckpointStore(root / preset, swarm_id=SWARM, keep=1)
    with store, BackgroundWriter(store) as writer:
        for i in range(repeats):
            started = time.monotonic()
            store.save(round=2 * i + 1, step=i, state=state)
            sync.append(time.monotonic() - started)

            started = time.monotonic()
            writer.submit(round=2 * i + 2, step=i, state=state)
            stall.append(time.monotonic() - started)
            saved = writer.wait()
            assert saved is not None
            write.append(saved.write_seconds)
            nbytes = saved.nbytes
    result = {
        "params": numel,
        "checkpoint_bytes": nbytes,
        "sync_stall_s": statistics.median(sync),
        "background_stall_s": statistics.median(stall),
        "background_write_s": statistics.median(write),
    }
    result["stall_ratio"] = result["sync_stall_s"] / result["background_stall_s"]
    return result


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--presets", default="tiny,small,base", help="comma-separated presets")
    p.add_argument("--repeats", type=int, default=3, help="saves of each kind per preset")
    p.add_argument("--dir", type=Path, default=Path("."), help="where to write (its disk)")
    args = p.parse_args()
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-checkpoint-", dir=args.dir) as tmp:
        for preset in args.presets.split(","):
            results[preset] = measure(preset, args.repeats, Path(tmp))
            print(f"{preset}: {json.dumps(results[preset])}", file=sys.stderr)
    out = {
        "benchmark": "checkpoint",
        "machine": machine(),
        "settings": {"repeats": args.repeats, "dir": str(args.dir.resolve()), "keep": 1},
        **results,
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
