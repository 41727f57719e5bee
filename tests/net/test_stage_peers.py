"""The peer's collaborators over one pipeline stage's parameters, without ``Swarm``: two
``Peer`` objects built around stage 1 of the GPT (its blocks and head, the stage's manifest
derived from the pipelined run's) average it with the round driver alone, a third catches
up with the follower, and a restart resumes from what the checkpoints hold; real gRPC on
loopback, real files."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from avgutil import PATIENT
from netutil import run_in_threads

from swarmloco.core.runspec import RunSpec
from swarmloco.core.state import state_digest
from swarmloco.errors import Stopped
from swarmloco.net.averaging import MatchmakingConfig
from swarmloco.net.identity import Identity
from swarmloco.net.node import NodeConfig
from swarmloco.pipeline.manifest import pipeline_manifest
from swarmloco.pipeline.manifest import stage_manifest as derive_stage_manifest
from swarmloco.pipeline.stages import gpt_stages
from swarmloco.runtime.config import PeerConfig
from swarmloco.runtime.peer import Kept, Peer, Trainee
from swarmloco.runtime.schedule import SwarmSchedule
from swarmloco.train.spec import GPTConfig

pytestmark = pytest.mark.timeout(180)

GPT = GPTConfig(vocab_size=64, seq_len=8, n_layer=2, n_head=2, n_embd=16)
SPEC = RunSpec(sync_every=4, delay=1, codec=dataclasses.replace(PATIENT.codec))


def stage_manifest(creator: Identity):
    """Stage 1's manifest, as every peer derives it from the pipelined run's."""
    run = pipeline_manifest(
        SPEC, gpt_stages(GPT, 2, seed=0), creator=creator.public_key.hex(), task="gpt-bytes",
        identity_work=0,
    )  # fmt: skip
    return derive_stage_manifest(run, 1)


@contextlib.contextmanager
def stage_peer(tmp: Path, name: str, manifest, *peers: str, **changes) -> Iterator[Peer]:
    """A Peer serving stage 1 of the run, entered (its own loop, network, checkpoints)."""
    stage = gpt_stages(GPT, 2, seed=0)[1]
    optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-2)
    settings = {
        "handle_signals": False,
        "hook": False,
        "progress_interval_s": 0.2,
        "matchmaking": MatchmakingConfig(gather_s=1.0, poll_s=0.05, min_group_size=2),
        "averaging": PATIENT,
        "codec_backend": "eager",
    }
    config = PeerConfig(data_dir=tmp / name, node=NodeConfig(peers=peers), **(settings | changes))
    identity = Identity.load_or_create(config.directory)
    trainee = Trainee(model=stage, optimizer=optimizer, objects={}, box=None, evaluate=None,
                      schedule=SwarmSchedule(optimizer, lambda: 0))  # fmt: skip
    kept = Kept.fresh(config, identity.peer_id_hex, lambda *_, **__: None)
    peer = Peer(manifest, trainee, kept, config=config, identity=identity, on_step=lambda: None)
    with contextlib.ExitStack() as stack:
        peer.enter(stack)
        yield peer
        peer.leave(stack, failed=False, interrupted=False)


def step(peer: Peer, g: torch.Generator) -> None:
    """One step of the stage on activations and targets of its own."""
    stage, optimizer = peer.trainee.model, peer.trainee.optimizer
    x = torch.randn(2, GPT.seq_len, GPT.n_embd, generator=g)
    y = torch.randint(0, GPT.vocab_size, (2, GPT.seq_len), generator=g)
    optimizer.zero_grad()
    stage(x, y).backward()
    optimizer.step()


def train(peer: Peer, seed: int, steps: int = 3) -> None:
    """A few steps, counted by hand (no step hook)."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        step(peer, g)
        peer.kept.progress.stepped(16, 1e-2, now=0.0)
        peer.diloco.trained(16)


def test_a_stages_replicas_average_it_catch_up_and_resume_with_the_peers_collaborators(tmp_path):
    manifest = stage_manifest(Identity.generate())
    with (
        stage_peer(tmp_path, "a", manifest) as a,
        stage_peer(tmp_path, "b", manifest, a.network.endpoint) as b,
    ):
        initial = state_digest(a.diloco.committed())
        for peer, seed in ((a, 1), (b, 2)):
            train(peer, seed)
        # The round driver alone: both start round 1, then both land it.
        assert a.rounds.start() and b.rounds.start()
        assert a.rounds.land() and b.rounds.land()
        assert a.diloco.round == b.diloco.round == 1
        digest = state_digest(a.diloco.committed())
        assert digest == state_digest(b.diloco.committed()) != initial
        assert a.rounds.applied == b.rounds.applied == 1
        for peer in (a, b):
            peer.snapshots.finish(wait=True)  # its digest published
            peer.checkpoints.save(wait=True)
        # A newcomer's follower takes the stage's state of round 1 from them.
        with stage_peer(tmp_path, "c", manifest, a.network.endpoint) as c:
            assert c.diloco.round == 1 and c.follower.downloads == 1
            assert state_digest(c.diloco.committed()) == digest
    # b again, from its own checkpoint: the round, the counts and the state.
    with stage_peer(tmp_path, "b", manifest) as again:
        assert again.diloco.round == 1 and again.kept.progress.steps == 3
        assert state_digest(again.diloco.committed()) == digest


def test_the_step_hook_paces_and_runs_a_stages_rounds_until_its_last(tmp_path):
    """Each replica's loop calls only the step hook after its optimizer steps: the hook
    paces, starts and lands the rounds, and stops both replicas after round 3 on one
    state."""
    manifest = stage_manifest(Identity.generate())
    with (
        stage_peer(tmp_path, "a", manifest, max_rounds=3) as a,
        stage_peer(tmp_path, "b", manifest, a.network.endpoint, max_rounds=3) as b,
    ):

        def loop(peer: Peer, seed: int) -> None:
            g = torch.Generator().manual_seed(seed)
            with contextlib.suppress(Stopped):
                while True:
                    step(peer, g)
                    peer.hook.stepped(16)

        run_in_threads(lambda: loop(a, 1), lambda: loop(b, 2), timeout=120)
        assert a.diloco.round == b.diloco.round == 3
        assert state_digest(a.diloco.committed()) == state_digest(b.diloco.committed())
        assert a.rounds.applied >= 1 and b.rounds.applied >= 1
        assert a.rounds.applied + a.follower.downloads >= 3
        assert a.kept.stop.reason.startswith("round 3 reached")


def test_a_peer_waiting_for_its_group_reports_the_round_as_begun(tmp_path):
    """Without overlap the training thread waits in ``land`` for its group: meanwhile its
    progress report names the round after the one it averages (others see that it began
    and join it), not that round with none of its tokens (which kept a partner at slow
    steps from ever coming: every round aborted). Cancelled, the report names the round
    again."""
    manifest = stage_manifest(Identity.generate())
    nobody = MatchmakingConfig(gather_s=600.0, poll_s=0.05, min_group_size=2)
    with stage_peer(tmp_path, "a", manifest, matchmaking=nobody) as a:
        train(a, 1)
        assert a.progress_value()["round"] == 1
        assert a.rounds.start()
        landed: list[bool] = []
        entered = threading.Event()

        def landing_thread() -> None:
            entered.set()
            landed.append(a.rounds.land())

        landing = threading.Thread(target=landing_thread, daemon=True)
        landing.start()
        assert entered.wait(60)
        # What the network published and read back while the thread waits in land.
        assert a.network.wait_for_reads(a.network.reads + 2, 60)
        own = [r for r in a.network.reports if r.peer == a.peer_id]
        assert [(r.round, r.tokens) for r in own] == [(2, 0)], own
        assert a.kept.progress.global_step == 0  # nothing applied yet
        a.rounds.cancel()
        landing.join(60)
        assert landed == [False] and a.diloco.round == 0
        assert a.progress_value()["round"] == 1
