"""A pipelined run in one process over real gRPC on loopback: the GPT cut in two stages,
two peers serving each. The stage-0 peers drive micro-batches through stage 1's replicas,
which they find by their stage-load records; each stage's replicas average that stage's
parameters in DiLoCo rounds of their own and hold the same state after each round they
averaged together; every micro-batch a driver finished was applied once at each stage."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from avgutil import PATIENT
from netutil import run_in_threads, wait_until

from swarmloco.core.runspec import RunSpec
from swarmloco.net.averaging import MatchmakingConfig
from swarmloco.net.identity import Identity
from swarmloco.net.node import NetNode, NodeConfig
from swarmloco.net.swarm import fetch_manifest
from swarmloco.pipeline.manifest import pipeline_manifest
from swarmloco.pipeline.peer import StagePeer, StageWork
from swarmloco.pipeline.service import FORWARD
from swarmloco.pipeline.stages import gpt_stages
from swarmloco.pipeline.wire import Boundary
from swarmloco.proto.v1 import stage_pb2 as pb
from swarmloco.runtime.config import PeerConfig
from swarmloco.train.spec import GPTConfig

pytestmark = pytest.mark.timeout(240)

GPT = GPTConfig(vocab_size=64, seq_len=8, n_layer=2, n_head=2, n_embd=16)
SPEC = RunSpec(sync_every=4, delay=1, codec=dataclasses.replace(PATIENT.codec))
MICRO = 2  # sequences a micro-batch
IDS = Boundary(width=0, max_batch=MICRO, max_tokens=GPT.seq_len, vocab=GPT.vocab_size)
ACTS = Boundary(width=GPT.n_embd, max_batch=MICRO, max_tokens=GPT.seq_len)
ROUNDS = 2


class Events:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seen: list[dict[str, Any]] = []

    def __call__(self, event: dict[str, Any]) -> None:
        with self.lock:
            self.seen.append(event)

    def rounds(self) -> list[dict[str, Any]]:
        with self.lock:
            return [e for e in self.seen if e["event"] == "round"]


def new_run():
    """A new pipelined run of the GPT cut in two (a creator of its own)."""
    return pipeline_manifest(
        SPEC, gpt_stages(GPT, 2, seed=0), creator=Identity.generate().public_key.hex(),
        task="gpt-bytes", identity_work=0,
    )  # fmt: skip


@contextlib.contextmanager
def stage_peer(
    tmp: Path, name: str, run, stage: int, *peers: str, min_group: int = 2
) -> Iterator[StagePeer]:
    module = gpt_stages(GPT, 2, seed=0)[stage]
    work = StageWork(
        module=module,
        optimizer=torch.optim.AdamW(module.parameters(), lr=3e-3),
        activations=ACTS,
        ids=IDS,
        step_samples=2 * MICRO,
        tokens_per_sequence=GPT.seq_len,
        lr_at=lambda step: 1e-3 / (1 + step),  # the schedule, by the stage's global step
        grad_clip=1.0,
    )
    config = PeerConfig(
        data_dir=tmp / name,
        node=NodeConfig(peers=peers),
        handle_signals=False,
        progress_interval_s=0.2,
        matchmaking=MatchmakingConfig(gather_s=1.0, poll_s=0.05, min_group_size=min_group),
        averaging=PATIENT,
        codec_backend="eager",
    )
    events = Events()
    peer = StagePeer(run, stage, work, config=config, on_event=events, load_interval_s=0.2)
    peer.events = events  # type: ignore[attr-defined]
    with peer:
        sizes: list[int] = []  # the sequences of each step it takes
        hook = peer.replica.before_step
        assert hook is not None

        def before_step() -> None:
            sizes.append(peer.replica.samples)
            hook()

        peer.replica.before_step = before_step
        peer.step_sizes = sizes  # type: ignore[attr-defined]
        yield peer


def averaged(peers: list[StagePeer]) -> bool:
    """Every peer applied ROUNDS rounds, one of them at least with its stage's other peer."""
    return all(
        len(rounds := p.events.rounds()) >= ROUNDS  # type: ignore[attr-defined]
        and any(e["group"] == 2 for e in rounds)
        for p in peers
    )


def drive(peer: StagePeer, seed: int, peers: list[StagePeer], done: list[int]) -> None:
    """Micro-batches, two in flight at once (a step's: ``step_samples`` is two
    micro-batches), until every peer of both stages has averaged (a condition, not a
    count: how the two stages' rounds fall depends on the machine's load)."""
    g = torch.Generator().manual_seed(seed)
    pending: list[concurrent.futures.Future[Any]] = []
    while pending or not averaged(peers):
        while len(pending) < 2 and not averaged(peers):
            tokens = torch.randint(0, GPT.vocab_size, (MICRO, GPT.seq_len + 1), generator=g)
            pending.append(peer.submit(tokens[:, :-1], tokens[:, 1:], timeout=60))
        pending.pop(0).result()
        done.append(1)


def test_two_stages_of_two_peers_drive_micro_batches_and_average_each_stage(tmp_path):
    run = new_run()
    with stage_peer(tmp_path, "b1", run, 1) as b1:
        entry = b1.peer.network.node.endpoint  # type: ignore[union-attr]
        with (
            stage_peer(tmp_path, "b2", run, 1, entry) as b2,
            stage_peer(tmp_path, "a1", run, 0, entry) as a1,
            stage_peer(tmp_path, "a2", run, 0, entry) as a2,
        ):
            done: list[int] = []
            peers = [a1, a2, b1, b2]
            run_in_threads(
                lambda: drive(a1, 1, peers, done), lambda: drive(a2, 2, peers, done), timeout=180
            )
            # Both stage 1 replicas served (the drivers found both by their records).
            assert b1.replica.served > 0 and b2.replica.served > 0
            # Each finished micro-batch was applied once at each stage: stage 1's backwards
            # are the drivers' finished ones (a broken one may have reached stage 1 only).
            assert b1.replica.served + b2.replica.served >= len(done)
            assert a1.replica.served + a2.replica.served == len(done)
            # No step on more than the run's batch, two micro-batches in flight or not
            # (fewer: a round landed while no micro-batch came).
            for p in peers:
                sizes = p.step_sizes  # type: ignore[attr-defined]
                assert sizes and max(sizes) <= 2 * MICRO, (p.stage, sizes)
                # A step's tokens, as its records say them: a step is 2 x MICRO sequences
                # (before, a stage peer said 1 token a step before its first of a round,
                # and counted a token a step in its status record).
                assert p.peer is not None
                step_tokens = 2 * MICRO * GPT.seq_len
                assert p.peer.status_value()["tokens"] == p.peer.kept.progress.steps * step_tokens
                if not p.peer.kept.progress.steps_since_round:
                    assert p.peer.progress_value()["step_tokens"] == step_tokens
    for stage in ((a1, a2), (b1, b2)):
        together = {}
        for peer in stage:
            for e in peer.events.rounds():  # type: ignore[attr-defined]
                if e["group"] == 2:
                    together.setdefault(e["round"], set()).add(e["digest"])
        assert together, [p.events.seen for p in stage]  # type: ignore[attr-defined]
        assert all(len(digests) == 1 for digests in together.values()), together
    assert b1.manifest.swarm_id == b2.manifest.swarm_id != a1.manifest.swarm_id
    for peer in (a1, a2, b1, b2):  # the schedule set the rate of the last step, not 3e-3
        step = peer.peer.kept.progress.global_step  # type: ignore[union-attr]
        lr = peer.work.optimizer.param_groups[0]["lr"]
        assert step > 0 and lr in {1e-3 / (1 + s) for s in range(step + 1)}, (lr, step)


def test_a_stage_whose_drivers_stopped_lands_the_round_it_has_in_flight(tmp_path):
    # A round overlaps the next step (delay 1): a stage whose micro-batches stop coming
    # (the drivers paused, or their run ended) must land it without that step.
    run = new_run()
    with stage_peer(tmp_path, "b", run, 1, min_group=1) as b:
        entry = b.peer.network.node.endpoint  # type: ignore[union-attr]
        with stage_peer(tmp_path, "a", run, 0, entry, min_group=1) as a:
            g = torch.Generator().manual_seed(0)
            hook = b.peer.hook  # type: ignore[union-attr]
            driven = 0
            while hook.rounds.inflight is None:  # until stage 1 started a round
                tokens = torch.randint(0, GPT.vocab_size, (MICRO, GPT.seq_len + 1), generator=g)
                a.drive(tokens[:, :-1], tokens[:, 1:], timeout=60)
                driven += 1
                assert driven < 500, b.events.seen  # type: ignore[attr-defined]
            pending = hook.rounds.inflight.round
            served = b.replica.served
            seen = b.events  # type: ignore[attr-defined]
            wait_until(
                lambda: any(e["round"] == pending for e in seen.rounds()),
                timeout=60,
                what=f"stage 1 lands round {pending}: {seen.seen}",
            )
            assert b.replica.served == served  # no micro-batch came meanwhile
            assert hook.rounds.inflight is None
            # Its record says the driver's session open with it (the dashboard shows it).
            wait_until(
                lambda: [x.drivers for x in b.read_loads() if x.stage == 1] == [1],
                timeout=60,
                what="stage 1's record says one driver's session",
            )
        # The driver left: its session ended with it.
        wait_until(
            lambda: (
                b.replica.sessions == 0
                and [x.drivers for x in b.read_loads() if x.stage == 1] == [0]
            ),
            timeout=60,
            what="stage 1's record says no driver's session",
        )


def test_a_stage_peers_record_says_the_calls_it_refused(tmp_path):
    """What a caller sent that the stage refused (not as busy) is counted in the peer's
    stage-load record, which the dashboard shows."""
    run = new_run()
    with stage_peer(tmp_path, "b", run, 1, min_group=1) as b:
        entry = b.peer.network.node.endpoint  # type: ignore[union-attr]
        bad = pb.ForwardRequest(
            swarm_id=run.swarm_id, stage=0, micro_batch=b"x" * 16, input=pb.StageTensor()
        )

        async def call() -> str:
            config = NodeConfig(server=None, peers=(entry,))
            async with NetNode(identity=Identity.generate(), config=config) as node:
                answer = await node.client.call(entry, FORWARD, bad, timeout=10.0)
                return answer.refused.code

        assert asyncio.run(call()) == "wrong-stage"
        wait_until(
            lambda: [(x.refused, x.skipped) for x in b.read_loads()] == [(1, 0)],
            timeout=60,
            what="the record says one refused call",
        )


def test_a_stage_peer_publishes_the_runs_manifest_so_that_join_finds_it(tmp_path):
    # `swarmloco create --stages` that trains (no --no-train) publishes nothing else: the
    # run's manifest must come from its stage peers, as a data-parallel peer's does.
    run = new_run()
    with stage_peer(tmp_path, "b", run, 1, min_group=1) as b:
        entry = b.peer.network.node.endpoint  # type: ignore[union-attr]

        async def fetch() -> bytes:
            config = NodeConfig(server=None, peers=(entry,))
            async with NetNode(identity=Identity.generate(), config=config) as node:
                return (await fetch_manifest(node.dht, run.swarm_id)).to_bytes()

        assert asyncio.run(fetch()) == run.to_bytes()
