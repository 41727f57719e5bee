"""A box of ranks is one peer: examples/mlp_box.py under torchrun (gloo, real processes),
averaging with one-process peers in one swarm."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from pathlib import Path

import pytest
import torch
from swarmutil import Bootstrap, PeerProcess, process_gone, rank_pid

from swarmloco.runtime.checkpoint import CheckpointStore
from swarmloco.runtime.export import export

pytestmark = pytest.mark.timeout(400)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "mlp_box.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
ROUNDS = 4


def peer(data_dir: Path, ranks: int, *args: str) -> PeerProcess:
    if ranks == 1:
        return PeerProcess.script(EXAMPLE, data_dir, *args)
    command = [*TORCHRUN, "--nproc-per-node", str(ranks), str(EXAMPLE)]
    return PeerProcess(list(args), data_dir, command=command)


def swarm_of(root: Path, boxes: list[tuple[int, str]]) -> list[PeerProcess]:
    """A one-process creator and ``boxes`` (ranks, layout), each on its own data seed, all
    starting together and averaging every round in one group of all of them."""
    n = len(boxes) + 1
    common = ("--max-rounds", str(ROUNDS), "--min-peers", str(n), "--start-with", str(n))
    common += ("--sync-every", "10", "--gather", "3")
    create = ("create", "--identity-work", "0")
    with peer(root / "creator", 1, *create, *common, "--data-seed", "1") as creator:
        join = ("join", creator.swarm_id, "--peer", creator.endpoint, *common)
        others = [
            peer(root / f"box{i}", ranks, *join, "--layout", layout, "--data-seed", str(i + 2))
            for i, (ranks, layout) in enumerate(boxes)
        ]
        try:
            for p in (creator, *others):
                assert p.wait(300) == 0, p.log_tail()
        finally:
            for p in others:
                p.__exit__()
    return [creator, *others]


def theta_g(p: PeerProcess, rounds: int) -> torch.Tensor:
    [swarm_dir] = (p.data_dir / "swarms").iterdir()
    with CheckpointStore(swarm_dir / "checkpoints", swarm_id=swarm_dir.name) as store:
        found = store.latest()
    assert found is not None and found.round == rounds
    return found.state["diloco"]["theta_g"]


def test_a_1_rank_a_ddp_and_an_fsdp_peer_average_in_one_swarm_and_agree_on_every_round(
    tmp_path,
):
    peers = swarm_of(tmp_path, [(2, "ddp"), (2, "fsdp")])
    for r in range(1, ROUNDS + 1):
        rounds = [{e["round"]: e for e in p.of("round")}[r] for p in peers]
        assert {e["group"] for e in rounds} == {3}, rounds
        assert len({e["digest"] for e in rounds}) == 1, rounds
    # One peer's bytes on the wire, whatever its ranks (but for its audits, whose segments
    # are drawn at random: a large share of a model this small).
    sent = [{e["bytes_sent"] - e["audit_bytes_sent"] for e in p.of("round")} for p in peers]
    assert max(max(s) for s in sent) < 1.1 * min(min(s) for s in sent), sent


def test_a_box_computes_what_one_process_computes_on_the_same_data(tmp_path):
    """Alone, a peer averages every H steps: a 1-rank, a 2-rank DDP and a 2-rank FSDP peer
    trained on the same batches end their rounds on the same global model (the ranks split
    each batch; float sums in another order, and where they tip the codec's rounding, are
    all that differs)."""
    rounds = 3
    args = ("create", "--identity-work", "0", "--max-rounds", str(rounds), "--sync-every", "10")
    args += ("--data-seed", "7")
    runs = [
        peer(tmp_path / "one", 1, *args),
        peer(tmp_path / "ddp", 2, *args, "--layout", "ddp"),
        peer(tmp_path / "fsdp", 2, *args, "--layout", "fsdp"),
        # A box on other data ends elsewhere: the comparison can fail.
        peer(tmp_path / "other", 1, *args[:-1], "8"),
    ]
    with contextlib.ExitStack() as stack:
        for p in runs:
            stack.enter_context(p)
        for p in runs:
            assert p.wait(300) == 0, p.log_tail()
    one, ddp, fsdp, other = (theta_g(p, rounds) for p in runs)
    # A round applies the update as the codec encodes it, alone too (as any group's mean):
    # a sum in another order moves a value across a rounding boundary now and then, by one
    # step of its block's scale. Training on other data moves every value, by far more.
    apart = (other - one).abs()
    for got in (ddp, fsdp):
        diff = (got - one).abs()
        assert diff.mean() < 1e-3 * apart.mean(), (diff.mean(), apart.mean())
        assert diff.max() < 0.05 * apart.max(), (diff.max(), apart.max())


def test_a_box_catches_up_stops_resumes_exports_and_leaves_cleanly_when_a_rank_dies(tmp_path):
    # Two one-process peers train on while the box is away; the box's peer downloads the
    # swarm's state into its shards when it joins late and again after its restart.
    common = ("--sync-every", "20", "--gather", "2", "--total-steps", "1000000")
    common += ("--min-peers", "2")
    with contextlib.ExitStack() as stack:
        create = ("create", "--identity-work", "0")
        creator = stack.enter_context(peer(tmp_path / "creator", 1, *create, *common))
        join = ("join", creator.swarm_id, "--peer", creator.endpoint, *common)
        helper = stack.enter_context(peer(tmp_path / "helper", 1, *join, "--data-seed", "5"))
        helper.wait_for("round", lambda e: e["round"] >= 2, timeout=120)
        box_args = (*join, "--layout", "fsdp")
        # SIGTERM to torchrun: rank 0 stops the box at a step's end, checkpoints every
        # rank's shards and leaves.
        with peer(tmp_path / "box", 2, *box_args) as box:
            assert box.wait_for("downloaded", timeout=120)["round"] >= 2
            box.wait_for("round", lambda e: e["group"] == 3, timeout=120)
            box.process.send_signal(signal.SIGTERM)
            box.wait(120)
        saved = box.of("checkpoint")[-1]
        assert box.of("stopped")[-1]["round"] == saved["round"]
        creator.wait_for("round", lambda e: e["round"] > saved["round"], timeout=120)
        # Started again, it resumes from that checkpoint, downloads the rounds it missed
        # and averages with the swarm.
        with peer(tmp_path / "box", 2, *box_args) as again:
            assert again.wait_for("resumed", timeout=120)["round"] == saved["round"]
            assert again.wait_for("downloaded", timeout=120)["round"] > saved["round"]
            together = again.wait_for("round", lambda e: e["group"] == 3, timeout=120)
            creator.wait_for("round", lambda e: e["round"] >= together["round"], timeout=60)
            digest = {e["round"]: e["digest"] for e in creator.of("round")}[together["round"]]
            assert together["digest"] == digest
            # Rank 1 killed: torchrun stops rank 0, whose next collective fails; the box's
            # peer leaves the swarm, and the swarm trains on without it.
            os.kill(rank_pid(again, 1), signal.SIGKILL)
            stopped = again.wait_for("stopped", timeout=120)
            assert again.wait(120) != 0
        creator.wait_for("round", lambda e: e["time"] > stopped["time"], timeout=120)
        # What is on disk is a whole box's checkpoint (rank 0's state and rank 1's shards),
        # not a half one taken after the kill.
        [swarm_dir] = (tmp_path / "box" / "swarms").iterdir()
        with CheckpointStore(swarm_dir / "checkpoints", swarm_id=swarm_dir.name) as store:
            latest = store.latest()
        assert latest is not None and len(latest.state["ranks"]) == 1
        assert "model" in latest.state["ranks"][0]  # FSDP: rank 1's shards
        # The trained model comes out of the box's data dir like any peer's: the swarm's
        # global weights of that round, with the digest every peer published.
        out = export(creator.swarm_id, tmp_path / "model", data_dir=tmp_path / "box")
        assert out.round == latest.round
        creator.wait_for("round", lambda e: e["round"] >= out.round, timeout=60)
        assert {e["round"]: e["digest"] for e in creator.of("round")}[out.round] == out.digest
        for p in (helper, creator):
            p.process.send_signal(signal.SIGTERM)
            assert p.wait(60) == 0, p.log_tail()


def test_a_box_whose_daemon_is_killed_leaves_no_rank_behind_and_starts_again(tmp_path):
    """`swarmloco create --nproc-per-node 2` SIGKILLed (as the OOM killer would): its ranks
    die with it (left running, rank 0 would stay a peer holding the data directory), and the
    box starts again from that directory, resuming from its checkpoint."""
    long = ("--nproc-per-node", "2", "--max-rounds", "100000")
    with Bootstrap(tmp_path / "boot") as boot:
        box = PeerProcess.create(tmp_path / "box", "--peer", boot.endpoint, *long)
        ranks: list[int] = []
        try:
            box.wait_for("checkpoint", timeout=180)
            ranks = [rank_pid(box, r) for r in (0, 1)]
            box.process.send_signal(signal.SIGKILL)
            box.wait(30)
            assert all(process_gone(pid) for pid in ranks), ranks
        finally:
            if box.process.poll() is None:
                box.kill()
            for pid in ranks:  # (left running only when they did not die with it)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        saved = box.of("checkpoint")[-1]["round"]
        with PeerProcess.join(box.swarm_id, boot.endpoint, tmp_path / "box", *long) as again:
            assert again.wait_for("resumed", timeout=180)["round"] >= saved
            again.wait_for("round", lambda e: e["round"] > saved, timeout=120)
            assert again.stop(120) == 0, again.log_tail()
