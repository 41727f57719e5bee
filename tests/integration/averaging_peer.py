"""One averaging peer as a real process, driven by the multi-process tests.

    python averaging_peer.py '{"index": 0, "size": 4, "numel": 25600, ...}'

Prints JSON lines on stdout: ``ready`` (endpoint, peer id), then after ``go`` on stdin,
``fired`` whenever a scripted fault fires (the tests use that as the moment to kill or
freeze this process), ``group`` once the group is formed, and ``done`` (the report; the
mean is written to ``out`` as raw float32) or ``aborted``. Exits on EOF of stdin.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "net"))
from avgutil import CODEC, FAST

from swarmloco.net.averaging import (
    Averager,
    BandwidthConfig,
    BandwidthLimiter,
    Fault,
    FaultPlan,
    Matchmaker,
    MatchmakingConfig,
    averaging_service,
)
from swarmloco.net.deadline import Deadline
from swarmloco.net.identity import Identity
from swarmloco.net.node import NetNode, NodeConfig

SWARM = "ef" * 20
# The loopback tests' settings: small chunks, second-scale timeouts.
CONFIG = dataclasses.replace(FAST, open_timeout_s=3.0)


def vector_of(index: int, numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(500 + index)
    return torch.randn(numel, generator=g) * (1 + index)


def weight_of(index: int) -> float:
    return 1.0 + index


def emit(**event: object) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


async def main(spec: dict) -> None:
    torch.set_num_threads(1)
    identity = Identity.generate()
    bootstrap = spec.get("bootstrap")
    server = None if spec.get("client") else NodeConfig().server
    node = NetNode(
        identity=identity,
        config=NodeConfig(server=server, peers=(bootstrap,) if bootstrap else ()),
    )
    faults = FaultPlan(
        [Fault(**f) for f in spec.get("faults", [])],
        on_fire=lambda i, fault, peer, round: emit(event="fired", fault=i, phase=fault.phase),
    )
    limiter = None
    if spec.get("upload_bytes_per_s"):
        limiter = BandwidthLimiter(BandwidthConfig(upload_bytes_per_s=spec["upload_bytes_per_s"]))
    matchmaker = Matchmaker(
        identity=identity,
        dht=node.dht,
        client=node.client,
        swarm_id=SWARM,
        config=MatchmakingConfig(max_group_size=spec["size"], gather_s=15.0, poll_s=0.1),
    )
    averager = Averager(
        identity=identity, client=node.client, config=CONFIG, limiter=limiter, faults=faults
    )
    if node.server is not None:
        node.server.add_service(averaging_service(matchmaker, averager))
    loop = asyncio.get_running_loop()
    stdin = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    vector = vector_of(spec["index"], spec["numel"])
    async with node:
        emit(event="ready", endpoint=node.endpoint, peer_id=identity.peer_id_hex)
        if not await stdin.readline():
            return
        deadline = Deadline.after(spec.get("deadline", 20.0))
        try:
            group = await matchmaker.form_group(
                1,
                weight=weight_of(spec["index"]),
                numel=vector.numel(),
                block_size=CODEC.block_size,
                deadline=deadline,
            )
            emit(event="group", members=[m.peer_id for m in group.members])
            result = await averager.all_reduce(group, vector, deadline=deadline)
        except Exception as exc:  # the test reads why
            traceback.print_exception(exc)
            emit(event="aborted", error=f"{type(exc).__name__}: {exc}")
        else:
            with open(spec["out"], "wb") as f:
                f.write(result.mean.numpy().tobytes())
            emit(event="done", report=dataclasses.asdict(result.report))
        await stdin.read()  # until the test closes our stdin


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
