#!/usr/bin/env python3
"""How long training waits at each round for the checkpoint and the state digest. Prints one
JSON object.

A peer checkpoints after every round by default. Its state is the global parameters and
outer momentum, the local parameters, and AdamW's two moments: five times the model in
fp32. It also hashes the new global state (parameters and momentum) to publish its digest.
For each preset, in one run and on the same disk, this compares:

  sync        on the training thread: CheckpointStore.save (copy, write, hash, fsync), and
              the snapshot of the global state with its digest
  background  what the peer does: it copies the state and the snapshot on the training
              thread (the stall); the checkpoint writer and the digest thread do the rest

Keys per preset: `params`, `checkpoint_bytes`, `checkpoint_sync_stall_s`,
`checkpoint_background_stall_s`, `checkpoint_background_write_s`, `digest_sync_stall_s`,
`digest_background_stall_s` (medians over --repeats), and `stall_ratio` (both sync stalls
over both background stalls).

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

from swarmloco.core.state import MOMENTUM, THETA_G, StateSnapshot
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
    live = state["params"]
    scratch = torch.empty_like(live)  # the peer gathers its parameters into a scratch vector
    state["params"] = scratch
    sync, stall, write = [], [], []
    nbytes = 0
    store = CheckpointStore(root / preset, swarm_id=SWARM, keep=1)
    with store, BackgroundWriter(store) as writer:
        for i in range(repeats):
            started = time.monotonic()
            scratch.copy_(live)
            store.save(round=2 * i + 1, step=i, state=state)
            sync.append(time.monotonic() - started)

            started = time.monotonic()
            scratch.copy_(live)
            writer.submit(round=2 * i + 2, step=i, state=state)
            stall.append(time.monotonic() - started)
            saved = writer.wait()
            assert saved is not None
            write.append(saved.write_seconds)
            nbytes = saved.nbytes
    digest_sync, digest_stall = [], []
    for _ in range(repeats):
        started = time.monotonic()
        tensors = {THETA_G: state["theta_g"].clone(), MOMENTUM: state["momentum"].clone()}
        digest_stall.append(time.monotonic() - started)
        StateSnapshot.of(swarm_id=SWARM, round=1, tensors=tensors)
        digest_sync.append(time.monotonic() - started)
    result = {
        "params": numel,
        "checkpoint_bytes": nbytes,
        "checkpoint_sync_stall_s": statistics.median(sync),
        "checkpoint_background_stall_s": statistics.median(stall),
        "checkpoint_background_write_s": statistics.median(write),
        "digest_sync_stall_s": statistics.median(digest_sync),
        "digest_background_stall_s": statistics.median(digest_stall),
    }
    result["stall_ratio"] = (result["checkpoint_sync_stall_s"] + result["digest_sync_stall_s"]) / (
        result["checkpoint_background_stall_s"] + result["digest_background_stall_s"]
    )
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
