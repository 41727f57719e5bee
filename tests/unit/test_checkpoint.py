"""Checkpoints: exact round trips, keep-last-K, and every way a checkpoint can be broken."""

import copy
import json
import random
import shutil
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from swarmloco.errors import CheckpointError
from swarmloco.runtime.checkpoint import (
    MANIFEST,
    STATE,
    TENSORS,
    BackgroundWriter,
    CheckpointStore,
    checkpoint_name,
    flatten,
    unflatten,
)
from swarmloco.train.inner import InnerConfig, InnerLoop
from swarmloco.train.model import GPT
from swarmloco.train.spec import GPTConfig

SWARM = "a" * 40


def sample_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "theta_g": torch.randn(1000, generator=g),
        "momentum": torch.randn(1000, generator=g),
        "local": {"w": torch.randn(3, 5, generator=g).to(torch.bfloat16), "step": torch.tensor(7)},
        "mask": torch.rand(17, generator=g) > 0.5,
        "empty": torch.zeros(0, 4),
        "data": {"worker": 3, "epoch": 1, "cursor": [1, 2, 3]},
        "python_rng": random.Random(seed).getstate(),
        "torch_rng": torch.get_rng_state(),
        "note": None,
    }


def assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


def test_flatten_round_trips_nested_state():
    state = sample_state()
    tensors: dict = {}
    skeleton = flatten(state, tensors)
    json.dumps(skeleton)  # nothing but plain values left
    assert_same(unflatten(skeleton, tensors), state)


def test_flatten_refuses_what_it_cannot_restore():
    with pytest.raises(TypeError, match="set"):
        flatten({"x": {1, 2}}, {})


def test_save_then_latest_gives_back_the_same_state(tmp_path):
    state = sample_state()
    with CheckpointStore(tmp_path, swarm_id=SWARM) as store:
        path = store.save(round=4, step=200, state=state)
        loaded = store.latest()
    assert loaded is not None and loaded.path == path
    assert (loaded.round, loaded.step, loaded.swarm_id) == (4, 200, SWARM)
    assert_same(loaded.state, state)
    assert sorted(p.name for p in path.iterdir()) == sorted([MANIFEST, STATE, TENSORS])
    # The tensor file is plain safetensors: the library itself reads it.
    assert torch.equal(load_file(str(path / TENSORS))["t.0"], state["theta_g"])


def test_optimizer_state_resumes_to_the_identical_next_step(tmp_path):
    config = InnerConfig(lr=3e-3, warmup_steps=2, total_steps=50, precision="fp32", compile="off")
    model_config = GPTConfig(n_layer=1, n_embd=16, n_head=2, seq_len=8)
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, 256, (4, 9), generator=g)
    batch = (rows[:, :-1], rows[:, 1:])
    torch.manual_seed(0)
    loop = InnerLoop(GPT(model_config), config, torch.device("cpu"))
    for _ in range(3):
        loop.train_step(iter([batch]))
    with CheckpointStore(tmp_path, swarm_id=SWARM) as store:
        state = {"model": loop.model.state_dict(), "inner": loop.state_dict()}
        store.save(round=0, step=3, state=state)
        loaded = store.latest()
    expected = loop.train_step(iter([batch]))

    torch.manual_seed(1)  # a different initial model: everything must come from the file
    resumed = InnerLoop(GPT(model_config), config, torch.device("cpu"))
    resumed.model.load_state_dict(loaded.state["model"])
    resumed.load_state_dict(loaded.state["inner"])
    assert resumed.train_step(iter([batch])) == expected
    for a, b in zip(resumed.model.parameters(), loop.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_only_the_newest_k_are_kept(tmp_path):
    with CheckpointStore(tmp_path, swarm_id=SWARM, keep=2) as store:
        for r in range(5):
            store.save(round=r, step=r * 10, state={"r": r})
        assert [p.name for p, why in store.inventory()] == [
            checkpoint_name(4, 40),
            checkpoint_name(3, 30),
        ]
        assert store.latest().state == {"r": 4}


def test_newest_is_by_round_then_step(tmp_path):
    with CheckpointStore(tmp_path, swarm_id=SWARM, keep=5) as store:
        store.save(round=2, step=10, state={"which": "late round"})
        store.save(round=1, step=999, state={"which": "early round"})
        assert store.latest().state == {"which": "late round"}


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        (lambda p: (p / MANIFEST).unlink(), "no valid manifest"),
        (lambda p: (p / MANIFEST).write_text("{not json"), "no valid manifest"),
        (lambda p: (p / STATE).unlink(), "missing"),
        (lambda p: flip_byte(p / TENSORS), "does not match its hash"),
        (lambda p: flip_byte(p / STATE), "does not match its hash"),
        (lambda p: truncate(p / TENSORS), "does not match its hash"),
    ],
)
def test_a_damaged_checkpoint_does_not_exist_and_the_previous_one_is_used(tmp_path, damage, why):
    with CheckpointStore(tmp_path, swarm_id=SWARM) as store:
        store.save(round=1, step=10, state=sample_state(1))
        newest = store.save(round=2, step=20, state=sample_state(2))
        damage(newest)
        assert why in store.inventory()[0][1]
        loaded = store.latest()
    assert loaded.round == 1
    assert_same(loaded.state, sample_state(1))
    assert newest.exists()  # kept for a person to look at, never silently deleted


def flip_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 8])


def test_a_checkpoint_of_another_swarm_is_not_used(tmp_path):
    with CheckpointStore(tmp_path, swarm_id="b" * 40) as other:
        other.save(round=9, step=9, state={"x": 1})
    with CheckpointStore(tmp_path, swarm_id=SWARM) as store:
        assert store.latest() is None
        assert "belongs to swarm" in store.inventory()[0][1]


def test_leftovers_of_an_interrupted_save_are_removed_on_open(tmp_path):
    leftover = tmp_path / ".tmp-ckpt-0000000001-000000000010-123-456"
    leftover.mkdir()
    (leftover / TENSORS).write_bytes(b"half")
    with CheckpointStore(tmp_path, swarm_id=SWARM) as store:
        assert not leftover.exists()
        assert store.latest() is None


def test_a_second_store_on_the_same_directory_is_refused(tmp_path):
    with (
        CheckpointStore(tmp_path, swarm_id=SWARM),
        pytest.raises(CheckpointError, match="in use by another process"),
    ):
        CheckpointStore(tmp_path, swarm_id=SWARM).open()
    with CheckpointStore(tmp_path, swarm_id=SWARM):  # free again once closed
        pass


def test_saving_the_same_round_and_step_again_replaces_it(tmp_path):
    with CheckpointStore(tmp_path, swarm_id=SWARM) as store:
        store.save(round=1, step=1, state={"v": 1})
        store.save(round=1, step=1, state={"v": 2})
        assert len(store.inventory()) == 1
        assert store.latest().state == {"v": 2}


def test_a_state_that_cannot_be_saved_leaves_nothing_behind(tmp_path):
    with CheckpointStore(tmp_path, swarm_id=SWARM) as store:
        store.save(round=1, step=1, state={"v": 1})
        with pytest.raises(TypeError):
            store.save(round=2, step=2, state={"bad": object()})
        assert [p.name for p in tmp_path.iterdir() if p.name != ".lock"] == [checkpoint_name(1, 1)]
        assert store.latest().state == {"v": 1}


def test_a_closed_store_refuses_to_save(tmp_path):
    store = CheckpointStore(tmp_path / "never-created", swarm_id=SWARM)
    assert not (tmp_path / "never-created").exists()  # the constructor does no I/O
    with pytest.raises(CheckpointError, match="not open"):
        store.save(round=1, step=1, state={})


# --- writing in the background ----------------------------------------------------------


class GatedStore(CheckpointStore):
    """A real store whose writes wait until the test lets them go."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()

    def write(self, **kwargs):
        assert self.gate.wait(30)
        return super().write(**kwargs)


def test_a_background_write_saves_the_state_as_it_was_when_submitted(tmp_path):
    state = sample_state()
    expected = copy.deepcopy(state)
    with GatedStore(tmp_path, swarm_id=SWARM) as store, BackgroundWriter(store) as writer:
        writer.submit(round=1, step=10, state=state)
        assert writer.busy and writer.poll() is None
        # Training goes on and changes the live tensors in place while the write waits.
        state["theta_g"].add_(1.0)
        state["local"]["w"].zero_()
        store.gate.set()
        saved = writer.wait()
        assert saved is not None and (saved.round, saved.step) == (1, 10)
        assert saved.path == tmp_path / checkpoint_name(1, 10)
        assert saved.nbytes > 8000 and not writer.busy
        assert writer.poll() is None  # collected once
        assert_same(store.latest().state, expected)


def test_one_write_at_a_time_and_each_is_collected(tmp_path):
    with GatedStore(tmp_path, swarm_id=SWARM) as store, BackgroundWriter(store) as writer:
        writer.submit(round=1, step=10, state=sample_state())
        with pytest.raises(RuntimeError, match="still being written"):
            writer.submit(round=2, step=20, state=sample_state())
        store.gate.set()
        deadline = time.monotonic() + 30
        while writer.busy and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(RuntimeError, match="not collected"):
            writer.submit(round=2, step=20, state=sample_state())
        assert writer.poll().round == 1
        writer.submit(round=2, step=20, state=sample_state(1))
        assert writer.wait().round == 2
        assert store.latest().round == 2


def test_a_failed_background_write_raises_where_it_is_collected(tmp_path):
    root = tmp_path / "ckpt"
    with CheckpointStore(root, swarm_id=SWARM) as store, BackgroundWriter(store) as writer:
        writer.submit(round=1, step=10, state=sample_state())
        assert writer.wait().round == 1
        shutil.rmtree(root)  # the directory is gone under the peer's feet
        writer.submit(round=2, step=20, state=sample_state())
        with pytest.raises(CheckpointError, match="cannot write checkpoint"):
            writer.wait()


def test_closing_the_writer_finishes_the_write_in_flight(tmp_path):
    store = GatedStore(tmp_path, swarm_id=SWARM).open()
    writer = BackgroundWriter(store)
    writer.submit(round=3, step=30, state=sample_state())
    threading.Timer(0.2, store.gate.set).start()
    writer.close()  # blocks until the write is on disk
    assert not writer.busy
    assert store.latest().round == 3
    store.close()
