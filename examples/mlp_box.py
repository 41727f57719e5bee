"""A box of ranks as one peer: the MLP of ``mlp_own_loop.py`` trained by several processes
over torch.distributed (DDP or FSDP2), averaging with the swarm as one peer.

Every rank runs this script (torchrun starts them); rank 0 is the peer. Each rank trains
on its own slice of every batch, so a box of N ranks steps on the batch a one-process peer
steps on, and a 1-rank, a 2-rank DDP and a 2-rank FSDP peer average in one swarm::

    torchrun --nproc-per-node 2 examples/mlp_box.py create --layout fsdp --data-dir /tmp/box-a
    # rank 0 prints the swarm id and its address; then, elsewhere:
    torchrun --nproc-per-node 2 --master-port 29501 examples/mlp_box.py join SWARM_ID \\
        --peer 127.0.0.1:PORT --layout ddp --data-dir /tmp/box-b
    python examples/mlp_box.py join SWARM_ID --peer 127.0.0.1:PORT --data-dir /tmp/box-c

On a CPU the ranks use gloo; with ``--device cuda`` each rank takes its own GPU (NCCL).
Ctrl-C (or SIGTERM to torchrun) stops every rank at the same step; the box checkpoints
and resumes from the same --data-dir.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from mlp_own_loop import batches, build_model, schedule
from torch import nn

import swarmloco


def shard(model: nn.Module, layout: str) -> nn.Module:
    """The box's layout: DDP (a replica per rank) or FSDP2 (each layer sharded)."""
    if layout == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model.children():
            if any(True for _ in layer.parameters()):
                fully_shard(layer)
        fully_shard(model)
        return model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("command", choices=("create", "join"))
    p.add_argument("swarm_id", nargs="?", help="with join: the swarm id create printed")
    p.add_argument("--peer", action="append", default=[], help="HOST:PORT to join through")
    p.add_argument("--data-dir", required=True, help="the box's key and checkpoints")
    p.add_argument("--port", type=int, default=0, help="port rank 0 serves on (0: any free)")
    p.add_argument("--layout", choices=("ddp", "fsdp"), default="ddp", help="default: ddp")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--sync-every", type=int, default=20, help="H: inner steps per round")
    p.add_argument("--total-steps", type=int, default=2000, help="the run's length")
    p.add_argument("--max-rounds", type=int, default=None, help="leave at this round")
    p.add_argument("--min-peers", type=int, default=1, help="smallest group to average in")
    p.add_argument("--gather", type=float, default=None, help="matchmaking window, seconds")
    p.add_argument("--batch-size", type=int, default=64, help="the box's batch per step")
    p.add_argument("--hidden", type=int, default=128, help="the MLP's width (its size)")
    p.add_argument("--data-seed", type=int, default=None, help="default: the swarm's")
    p.add_argument("--start-with", type=int, default=1, help="wait for this many peers first")
    p.add_argument(
        "--identity-work",
        type=int,
        default=None,
        help="create: bits of work each key proves to take part (default: 8, about a second "
        "of one core once per key; 0: none)",
    )
    p.add_argument("--events", nargs="?", const="-", help="rank 0: one JSON line per event (-)")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    single = "RANK" not in os.environ  # started without torchrun: one process, no box
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not single:
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = (0, 1) if single else (dist.get_rank(), dist.get_world_size())
    if args.batch_size % world:
        p.error(f"--batch-size {args.batch_size} does not split over {world} ranks")
    device = torch.device(args.device, torch.cuda.current_device() if args.device == "cuda" else 0)

    try:
        train(args, p, single=single, rank=rank, world=world, device=device)
    finally:
        if not single:
            # Nothing holds the process group by now (the model's DDP or FSDP wrapper and
            # the box died with train()): its threads are joined here, not during the
            # interpreter's exit, where freeing their last work object can abort it.
            gc.collect()
            dist.destroy_process_group()


def train(
    args: argparse.Namespace,
    p: argparse.ArgumentParser,
    *,
    single: bool,
    rank: int,
    world: int,
    device: torch.device,
) -> None:
    def on_event(event: dict) -> None:
        if args.events:
            print(json.dumps(event), flush=True)

    model = build_model(args.hidden).to(device)
    wrapped = shard(model, args.layout) if world > 1 else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    matchmaking = swarmloco.MatchmakingConfig(min_group_size=args.min_peers)
    if args.gather is not None:
        matchmaking = swarmloco.MatchmakingConfig(
            min_group_size=args.min_peers, gather_s=args.gather
        )
    config = swarmloco.PeerConfig(
        data_dir=Path(args.data_dir),
        max_rounds=args.max_rounds,
        matchmaking=matchmaking,
        tokens_per_step=args.batch_size,  # what the whole box trains on per step
    )
    box = None if single else swarmloco.Box()
    common = dict(peers=args.peer, port=args.port, config=config, on_event=on_event, box=box)
    if args.command == "create":
        spec = swarmloco.RunSpec(sync_every=args.sync_every, total_steps=args.total_steps)
        swarm = swarmloco.create(
            spec,
            wrapped,
            optimizer,
            name="mlp box example",
            identity_work=args.identity_work,
            **common,
        )
    else:
        if not args.swarm_id:
            p.error("join needs the SWARM_ID that create printed")
        swarm = swarmloco.join(args.swarm_id, wrapped, optimizer, **common)

    if rank == 0:
        print(swarm.swarm_id, flush=True)  # rank 0 knows it; the others learn it on entering
    loss_fn = nn.CrossEntropyLoss()
    with swarm:
        if rank == 0:
            print(f"box of {world} rank(s) serving on {swarm.endpoint}", file=sys.stderr)
        if args.start_with > 1:
            swarm.wait_for_peers(args.start_with)
        seed = swarm.data_seed if args.data_seed is None else args.data_seed
        stream = batches(seed, args.batch_size)  # the box's stream; this rank's rows of it
        sched = swarm.scheduler(lambda step: schedule(step, swarm.spec.total_steps))
        for x, y in stream:
            x, y = x[rank::world].to(device), y[rank::world].to(device)
            loss = loss_fn(wrapped(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()  # the swarm's rounds start and land after this step
            sched.step()
            swarm.log(loss=loss.item())
            if swarm.stopping:
                break
    if rank == 0:
        print(f"left at round {swarm.round}, global step {swarm.global_step}", file=sys.stderr)


if __name__ == "__main__":
    try:
        main()
    except swarmloco.SwarmlocoError as exc:
        sys.exit(f"error: {exc}")
