"""Checkpoints against real crashes: kill -9 in the middle of saves, a full disk."""

import json
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from swarmloco.errors import CheckpointError
from swarmloco.runtime.checkpoint import CheckpointStore, checkpoint_name

SWARM = "c" * 40


def state_for(round_: int) -> dict:
    """What the writer saves at ``round_``: large enough that a save takes a while."""
    g = torch.Generator().manual_seed(round_)
    return {"theta_g": torch.randn(4_000_000, generator=g), "round": round_}


WRITER = textwrap.dedent(
    """
    import sys, torch
    from swarmloco.runtime.checkpoint import CheckpointStore
    root, swarm = sys.argv[1], sys.argv[2]
    with CheckpointStore(root, swarm_id=swarm, keep=2) as store:
        for r in range(1, 10_000):
            g = torch.Generator().manual_seed(r)
            state = {"theta_g": torch.randn(4_000_000, generator=g), "round": r}
            store.save(round=r, step=r, state=state)
            print(r, flush=True)
    """
)


def test_kill_9_during_saves_leaves_the_last_complete_checkpoint(tmp_path):
    caught_mid_save = 0
    for trial in range(5):
        root = tmp_path / f"trial-{trial}"
        writer = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(root), SWARM],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            first = writer.stdout.readline()
            assert first.strip() == "1", "the writer did not save its first checkpoint"
            # Kill it as soon as a save is under way (its temporary directory is there): a
            # condition, not a timer, so a loaded machine changes nothing but the odds that
            # the save ends in the moment between the look and the kill.
            deadline = time.monotonic() + 30
            while not any(p.name.startswith(".tmp-") for p in root.iterdir()):
                assert time.monotonic() < deadline, "the writer began no save in 30 s"
            writer.send_signal(signal.SIGKILL)
            writer.wait(timeout=30)
        finally:
            writer.kill()
        reported = [int(line) for line in [first, *writer.stdout.read().split()] if line.strip()]
        writer.stdout.close()
        caught_mid_save += any(p.name.startswith(".tmp-") for p in root.iterdir())
        with CheckpointStore(root, swarm_id=SWARM) as store:
            loaded = store.latest()
            assert not any(p.name.startswith(".tmp-") for p in root.iterdir())
            assert all(why == "" for _, why in store.inventory())
        assert loaded is not None
        # The newest complete one: at least the last the writer reported (it may have
        # finished the rename of one more before printing).
        assert loaded.round >= max(reported)
        assert loaded.state["round"] == loaded.round
        assert torch.equal(loaded.state["theta_g"], state_for(loaded.round)["theta_g"])
    assert caught_mid_save >= 1, "no kill landed inside a save: the test proved nothing"


FULL_DISK = textwrap.dedent(
    """
    import json, resource, signal, sys, torch
    from swarmloco.errors import CheckpointError
    from swarmloco.runtime.checkpoint import CheckpointStore
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
    limit = 1_000_000
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    with CheckpointStore(sys.argv[1], swarm_id=sys.argv[2]) as store:
        store.save(round=1, step=1, state={"small": torch.ones(1000)})
        try:
            store.save(round=2, step=2, state={"big": torch.ones(1_000_000)})
            print(json.dumps({"raised": None}))
        except CheckpointError as e:
            print(json.dumps({"raised": str(e)}))
    """
)


def test_a_file_size_limit_fails_the_save_cleanly(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", FULL_DISK, str(tmp_path), SWARM],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    raised = json.loads(out.stdout)["raised"]
    first = checkpoint_name(1, 1, 1)
    assert raised is not None and "no space" in raised and first in raised
    with CheckpointStore(tmp_path, swarm_id=SWARM) as store:
        assert [p.name for p in tmp_path.iterdir() if p.name != ".lock"] == [first]
        assert torch.equal(store.latest().state["small"], torch.ones(1000))


def test_a_full_disk_fails_the_save_and_keeps_the_earlier_checkpoint(small_tmpfs):
    with CheckpointStore(small_tmpfs, swarm_id=SWARM) as store:
        store.save(round=1, step=1, state={"w": torch.ones(100_000)})  # 400 kB
        with pytest.raises(CheckpointError, match="no space"):
            store.save(round=2, step=2, state={"w": torch.ones(1_000_000)})  # 4 MB
        assert not any(p.name.startswith(".tmp-") for p in small_tmpfs.iterdir())
        loaded = store.latest()
        assert loaded.round == 1 and torch.equal(loaded.state["w"], torch.ones(100_000))
        # Space is back once the failed save is cleaned up: a small one still fits.
        store.save(round=3, step=3, state={"w": torch.zeros(10)})
        assert store.latest().round == 3
