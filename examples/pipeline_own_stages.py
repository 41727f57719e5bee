"""Train your own model cut into two stages, each served by its own peers (a pipelined run).

The model is a small byte-level language model of causal convolutions, written here as
two ``nn.Module`` stages: stage 0 embeds the bytes and runs the first blocks, stage 1 runs
the rest and computes the loss. The data is the Python standard library's own source, as
bytes (each stage-0 peer reads its own random windows). Peers of stage 0 drive
micro-batches through a peer of stage 1 they draw; the peers of each stage average that
stage's parameters in DiLoCo rounds of their own. It runs on a CPU in a minute.

Two peers on one machine::

    python examples/pipeline_own_stages.py create --data-dir /tmp/pipe-a --port 47200
    # it prints the swarm id and serves stage 1; then, in another terminal:
    python examples/pipeline_own_stages.py join SWARM_ID --peer 127.0.0.1:47200 \\
        --data-dir /tmp/pipe-b --stage 0

Add more peers to either stage with ``join``. ``--events -`` prints one JSON object per
event on stdout; ``--max-rounds N`` leaves at a stage's round N.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import signal
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import swarmloco
from swarmloco.net.node import NodeConfig
from swarmloco.net.server import ServerConfig
from swarmloco.pipeline import (
    Boundary,
    PipelineError,
    StagePeer,
    StageWork,
    create_pipeline,
    fetch_pipeline,
)

VOCAB, WIDTH, TOKENS, MICRO = 256, 64, 64, 4  # bytes, channels, a sequence, a micro-batch


class CausalBlock(nn.Module):
    """A residual block mixing each position with the three before it."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.conv = nn.Conv1d(WIDTH, WIDTH, kernel_size=4, groups=WIDTH)
        self.mlp = nn.Sequential(
            nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x).transpose(1, 2)  # (batch, width, tokens)
        h = self.conv(F.pad(h, (3, 0))).transpose(1, 2)  # left padding: no peeking ahead
        return x + self.mlp(h)


class Embed(nn.Module):
    """Stage 0: byte ids (batch, tokens) in, activations (batch, tokens, WIDTH) out."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.Sequential(CausalBlock(), CausalBlock())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.bytes(ids))


class Head(nn.Module):
    """Stage 1: activations in; ``forward(x, targets)`` gives the mean cross-entropy."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(CausalBlock(), CausalBlock())
        self.norm = nn.LayerNorm(WIDTH)
        self.out = nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.out(self.norm(self.blocks(x)))
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def build_stages() -> list[nn.Module]:
    torch.manual_seed(0)  # every peer starts from the same weights
    return [Embed(), Head()]


def windows(seed: int) -> Iterator[torch.Tensor]:
    """Endless micro-batches of byte windows (TOKENS + 1 long) of the standard library."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    corpus = b"".join(p.read_bytes() for p in sorted(stdlib.glob("[a-m]*.py"))[:40])
    data = torch.frombuffer(bytearray(corpus), dtype=torch.uint8).long()
    g = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(data) - TOKENS - 1, (MICRO,), generator=g).tolist()
        yield torch.stack([data[i : i + TOKENS + 1] for i in starts])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("command", choices=("create", "join"))
    p.add_argument("swarm_id", nargs="?", help="with join: the swarm id create printed")
    p.add_argument("--peer", action="append", default=[], help="HOST:PORT to join through")
    p.add_argument("--data-dir", required=True, help="this peer's key and checkpoints")
    p.add_argument("--port", type=int, default=0, help="port to serve on (0: any free)")
    p.add_argument(
        "--stage", type=int, default=None, help="the stage to serve (default: create 1, join 0)"
    )
    p.add_argument("--sync-every", type=int, default=8, help="create: H, steps per round")
    p.add_argument("--max-rounds", type=int, default=None, help="leave at this round")
    p.add_argument(
        "--identity-work",
        type=int,
        default=None,
        help="create: bits of work each key proves to take part (default: 8; 0: none)",
    )
    p.add_argument("--events", nargs="?", const="-", help="one JSON object per event on stdout (-)")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    stages = build_stages()
    if args.command == "create":
        spec = swarmloco.RunSpec(sync_every=args.sync_every, delay=1)
        run = create_pipeline(
            spec, stages, data_dir=args.data_dir, name="own stages",
            identity_work=args.identity_work,
        )  # fmt: skip
        print(run.swarm_id, flush=True)
        stage = 1 if args.stage is None else args.stage
    else:
        if not args.swarm_id:
            p.error("join needs the SWARM_ID that create printed")
        run = fetch_pipeline(args.swarm_id, args.peer)
        stage = 0 if args.stage is None else args.stage
    if stage not in (0, 1):
        p.error(f"this model has stages 0 and 1, not {stage}")

    module = stages[stage]
    work = StageWork(
        module=module,
        optimizer=torch.optim.AdamW(module.parameters(), lr=3e-3, weight_decay=0.01),
        activations=Boundary(width=WIDTH, max_batch=MICRO, max_tokens=TOKENS),
        ids=Boundary(width=0, max_batch=MICRO, max_tokens=TOKENS, vocab=VOCAB),
        step_samples=2 * MICRO,  # the optimizer steps on two micro-batches' gradients
        tokens_per_sequence=TOKENS,
        grad_clip=1.0,
    )
    config = swarmloco.PeerConfig(
        data_dir=Path(args.data_dir),
        max_rounds=args.max_rounds,
        node=NodeConfig(peers=tuple(args.peer), server=ServerConfig(port=args.port)),
    )

    def on_event(event: dict) -> None:
        if args.events:
            print(json.dumps(event), flush=True)

    with StagePeer(run, stage, work, config=config, on_event=on_event) as peer:
        for number in (signal.SIGINT, signal.SIGTERM):  # leave cleanly: a checkpoint, records gone
            signal.signal(number, lambda *_: peer.stop("asked to stop"))
        print(f"serving stage {stage} of swarm {run.swarm_id[:12]}", file=sys.stderr)
        if stage == 0:
            # Two micro-batches in flight (a step's worth): while one is at stage 1, the
            # next computes here. peer.drive(x, y) runs one and waits for it.
            in_flight: collections.deque = collections.deque()
            for rows in windows(seed=int(peer.identity.peer_id_hex[:8], 16)):
                try:
                    in_flight.append(peer.submit(rows[:, :-1], rows[:, 1:]))
                    if len(in_flight) == 2:
                        in_flight.popleft().result()  # forward and backward, both stages
                except swarmloco.Stopped:
                    break
                except PipelineError as exc:  # no replica of stage 1 took it: the next one
                    logging.warning("%s", exc)
            for micro_batch in in_flight:  # let the last ones finish
                micro_batch.exception()
        else:
            peer.stopped.wait()  # serving stage 1 until max rounds or a signal
    print(f"left stage {stage}", file=sys.stderr)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
    except swarmloco.SwarmlocoError as exc:
        sys.exit(f"error: {exc}")
