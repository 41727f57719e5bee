"""Train your own model with a swarm: an MLP classifier in your own training loop.

The data is generated: points from a mixture of Gaussians in 32 dimensions, labelled by
which of 10 clusters drew them (each peer samples its own stream, seeded by the swarm per
peer; the held-out set is the same everywhere). It runs on a CPU in a minute.

Two peers on one machine::

    python examples/mlp_own_loop.py create --data-dir /tmp/mlp-a --port 47000
    # it prints the swarm id; then, in another terminal:
    python examples/mlp_own_loop.py join SWARM_ID --peer 127.0.0.1:47000 --data-dir /tmp/mlp-b

Stop either with Ctrl-C (it finishes the round in flight and checkpoints); start it again
with the same --data-dir and it resumes. ``--events`` prints one JSON object per event.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

import swarmloco

DIM, CLASSES, HIDDEN = 32, 10, 128
WARMUP = 100


def build_model(hidden: int = HIDDEN) -> nn.Module:
    torch.manual_seed(0)  # every peer starts from the same weights (else it fetches them)
    return nn.Sequential(
        nn.Linear(DIM, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
        nn.Linear(hidden, CLASSES),
    )  # fmt: skip


def centers() -> torch.Tensor:
    return torch.randn(CLASSES, DIM, generator=torch.Generator().manual_seed(1234)) * 1.5


def batches(seed: int, batch_size: int = 64) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """An endless stream of labelled points, its own for every seed."""
    g = torch.Generator().manual_seed(seed)
    c = centers()
    while True:
        y = torch.randint(0, CLASSES, (batch_size,), generator=g)
        yield c[y] + torch.randn(batch_size, DIM, generator=g) * 1.5, y


def schedule(step: int, total_steps: int | None) -> float:
    """Linear warmup, then cosine to a tenth by the run's end, on the swarm's global step."""
    if step < WARMUP:
        return (step + 1) / WARMUP
    if total_steps is None:
        return 1.0
    progress = min(1.0, (step - WARMUP) / max(1, total_steps - WARMUP))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("command", choices=("create", "join"))
    p.add_argument("swarm_id", nargs="?", help="with join: the swarm id create printed")
    p.add_argument("--peer", action="append", default=[], help="HOST:PORT to join through")
    p.add_argument("--data-dir", required=True, help="this peer's key and checkpoints")
    p.add_argument("--port", type=int, default=0, help="port to serve on (0: any free)")
    p.add_argument("--sync-every", type=int, default=20, help="H: inner steps per round")
    p.add_argument("--total-steps", type=int, default=2000, help="the run's length")
    p.add_argument("--max-rounds", type=int, default=None, help="leave at this round")
    p.add_argument(
        "--min-peers",
        type=int,
        default=1,
        help="average only in groups of at least this many (1: a peer alone averages with itself)",
    )
    p.add_argument(
        "--identity-work",
        type=int,
        default=None,
        help="create: bits of work each key proves to take part (default: 8, about a second "
        "of one core once per key; 0: none)",
    )
    p.add_argument(
        "--step-seconds",
        type=float,
        default=0.0,
        help="make each step take this much longer (to watch the swarm at a large model's "
        "pace on a small one; default: 0)",
    )
    p.add_argument("--events", nargs="?", const="-", help="one JSON object per event on stdout (-)")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    def on_event(event: dict) -> None:
        if args.events:
            print(json.dumps(event), flush=True)

    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    config = swarmloco.PeerConfig(
        data_dir=Path(args.data_dir),
        max_rounds=args.max_rounds,
        matchmaking=swarmloco.MatchmakingConfig(min_group_size=args.min_peers),
    )
    common = dict(peers=args.peer, port=args.port, config=config, on_event=on_event)
    if args.command == "create":
        spec = swarmloco.RunSpec(sync_every=args.sync_every, total_steps=args.total_steps)
        swarm = swarmloco.create(
            spec, model, optimizer, name="mlp example", identity_work=args.identity_work, **common
        )
        print(swarm.swarm_id, flush=True)
    else:
        if not args.swarm_id:
            p.error("join needs the SWARM_ID that create printed")
        swarm = swarmloco.join(args.swarm_id, model, optimizer, **common)

    stream = batches(swarm.data_seed)
    held_out = next(batches(seed=12345, batch_size=2048))  # the same on every peer
    loss_fn = nn.CrossEntropyLoss()

    def evaluate() -> float:
        eval_model = build_model()
        swarm.load_global_into(eval_model)
        with torch.no_grad():
            return float(loss_fn(eval_model(held_out[0]), held_out[1]))

    swarm.evaluate = evaluate  # scored after every round, shown in events and the dashboard
    with swarm:
        print(f"peer {swarm.peer_id[:12]} serving on {swarm.endpoint}", file=sys.stderr)
        # The learning rate follows the swarm's progress (its global step), not this
        # peer's, over the run's length (a joiner reads it from the manifest on entering).
        sched = swarm.scheduler(lambda step: schedule(step, swarm.spec.total_steps))
        for x, y in stream:
            if args.step_seconds:
                time.sleep(args.step_seconds)  # a larger model's forward and backward
            loss = loss_fn(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()  # the swarm's rounds start and land after this step
            sched.step()
            swarm.log(loss=loss.item())
    print(f"left at round {swarm.round}, global step {swarm.global_step}", file=sys.stderr)


if __name__ == "__main__":
    try:
        main()
    except swarmloco.SwarmlocoError as exc:
        sys.exit(f"error: {exc}")
