"""Checkpoints: exact round trips, the order of writing, what is kept, and every way a
checkpoint can be broken."""

import copy
import gc
import hashlib
import json
import os
import random
import shutil
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from swarmloco.errors import CheckpointError
from swarmloco.runtime import checkpoint
from swarmloco.runtime.box import load_optimizer_state
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


def test_a_loaded_checkpoint_is_mapped_from_its_file_and_lets_it_go_once_loaded(tmp_path):
    """Resuming holds no second copy of the state: the tensors are mapped from the file and
    copied into place; the optimizer keeps copies, so the (later pruned) file is let go."""
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    with CheckpointStore(tmp_path, swarm_id=SWARM) as store:
        path = store.save(round=1, step=1, state={"optimizer": opt.state_dict()})
        loaded = store.latest()
    assert loaded is not None

    def mapped() -> bool:
        with open("/proc/self/maps") as maps:
            return any(str(path / TENSORS) in line for line in maps)

    assert mapped()
    fresh = torch.optim.AdamW(model.parameters())
    load_optimizer_state(fresh, loaded.state["optimizer"])
    del loaded
    gc.collect()
    assert not mapped()
    for p in model.parameters():
        assert torch.equal(fresh.state[p]["exp_avg"], opt.state[p]["exp_avg"])


def test_only_the_newest_k_are_kept(tmp_path):
    with CheckpointStore(tmp_path, swarm_id=SWARM, keep=2) as store:
        for r in range(5):
            store.save(round=r, step=r * 10, state={"r": r})
        assert [p.name for p, why in store.inventory()] == [
            checkpoint_name(5, 4, 40),
            checkpoint_name(4, 3, 30),
        ]
        assert store.latest().state == {"r": 4}


def test_newest_is_the_last_written_whatever_its_round_even_after_a_restart(tmp_path):
    # A peer that rolled back from a poisoned round 85 to its own round 80 trains on from
    # there: round 81 written after round 85 is the newer one.
    with CheckpointStore(tmp_path, swarm_id=SWARM, keep=5) as store:
        store.save(round=85, step=1000, state={"which": "poisoned"})
        store.save(round=81, step=1010, state={"which": "rolled back"})
        assert store.latest().state == {"which": "rolled back"}
    with CheckpointStore(tmp_path, swarm_id=SWARM, keep=5) as store:
        assert store.latest().state == {"which": "rolled back"}
        path = store.save(round=82, step=0, state={"which": "restarted"})  # steps from 0
        assert path.name == checkpoint_name(3, 82, 0)
        assert [c.round for c in store.valid()] == [82, 81, 85]


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
        assert [p.name for p in tmp_path.iterdir() if p.name != ".lock"] == [
            checkpoint_name(1, 1, 1)
        ]
        assert store.latest().state == {"v": 1}


def test_a_closed_store_refuses_to_save(tmp_path):
    store = CheckpointStore(tmp_path / "never-created", swarm_id=SWARM)
    assert not (tmp_path / "never-created").exists()  # the constructor does no I/O
    with pytest.raises(CheckpointError, match="not open"):
        store.save(round=1, step=1, state={})


# --- the order of writing, verified states, what is kept ---------------------------------


def as_earlier_format(path):
    """The checkpoint at ``path`` as the earlier format wrote it: named by round and step,
    no sequence number or verified flag in its manifest."""
    manifest = json.loads((path / MANIFEST).read_text())
    del manifest["sequence"], manifest["verified"]
    (path / MANIFEST).write_text(json.dumps(manifest))
    earlier = path.with_name(f"ckpt-{manifest['round']:010d}-{manifest['step']:012d}")
    path.rename(earlier)
    return earlier


def replace_damaged(path):
    """Corrupt a file the way a rewrite does (a new file renamed over it)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    fresh = path.with_name(path.name + ".new")
    fresh.write_bytes(bytes(data))
    os.replace(fresh, path)


def names(store):
    return [p.name for p, _ in store.inventory()]


def test_the_sequence_grows_across_reopenings_and_past_directories_that_are_not_valid(
    tmp_path,
):
    with CheckpointStore(tmp_path, swarm_id=SWARM, keep=1) as store:
        store.save(round=5, step=50, state={"v": 1})
        store.save(round=6, step=60, state={"v": 2})
    with CheckpointStore(tmp_path, swarm_id=SWARM, keep=1) as store:
        third = store.save(round=0, step=0, state={"v": 3})  # a fresh start: steps at 0
        assert third.name == checkpoint_name(3, 0, 0)
        assert names(store) == [third.name]  # keep=1 pruned the first two
    # A directory that is no checkpoint at all (no manifest) still holds its number.
    (tmp_path / checkpoint_name(57, 90, 900)).mkdir()
    with CheckpointStore(tmp_path, swarm_id=SWARM, keep=1) as store:
        newest = store.save(round=1, step=4, state={"v": 4})
        assert newest.name == checkpoint_name(58, 1, 4)
        loaded = store.latest()
        assert (loaded.sequence, loaded.round, loaded.state) == (58, 1, {"v": 4})
        assert [why != "" for _, why in store.inventory()] == [False, True]


def test_earlier_format_checkpoints_are_read_older_than_every_numbered_one(tmp_path):
    with CheckpointStore(tmp_path, swarm_id=SWARM, keep=5) as store:
        as_earlier_format(store.save(round=6, step=10, state={"v": "r6"}))
        as_earlier_format(store.save(round=5, step=99, state={"v": "r5"}))
    with CheckpointStore(tmp_path, swarm_id=SWARM, keep=5) as store:
        # Among themselves by (round, step), as before.
        assert [c.state["v"] for c in store.valid()] == ["r6", "r5"]
        loaded = store.latest()
        assert (loaded.sequence, loaded.verified) == (0, True)
        first = store.save(round=0, step=0, state={"v": "new"})
        assert first.name == checkpoint_name(1, 0, 0)
        assert [c.state["v"] for c in store.valid()] == ["new", "r6", "r5"]


@pytest.mark.parametrize("earlier_format", [False, True])
def test_after_corrupt_checkpoints_a_fresh_start_keeps_its_new_ones(tmp_path, earlier_format):
    # Issue 30, attack 8: the newest checkpoints were corrupt (their manifests intact), the
    # peer started afresh (a download, its steps back at 0, lower rounds), and cleanup
    # deleted its new valid checkpoints because the corrupt ones sorted above them and
    # counted as kept.
    with CheckpointStore(tmp_path, swarm_id=SWARM, keep=3) as store:
        corrupt = [store.save(round=r, step=100 * r, state=sample_state(r)) for r in (83, 84, 85)]
    if earlier_format:
        corrupt = [as_earlier_format(p) for p in corrupt]
    for path in corrupt:
        flip_byte(path / TENSORS)
    with CheckpointStore(tmp_path, swarm_id=SWARM, keep=2) as store:
        assert store.latest() is None
        written = []
        for r in range(4):
            written.append(store.save(round=r, step=r * 4, state=sample_state(r)))
            loaded = store.latest()
            assert loaded.path == written[-1] and loaded.round == r
            assert_same(loaded.state, sample_state(r))
            # The newest two new ones stay; the corrupt ones are left for a person to see.
            assert names(store) == [p.name for p in written[::-1][:2]] + [
                p.name for p in corrupt[::-1]
            ]
        reasons = [why for _, why in store.inventory()]
        assert reasons[:2] == ["", ""] and all("does not match" in w for w in reasons[2:])


def test_a_corrupt_checkpoint_with_a_good_manifest_is_not_one_of_the_kept(tmp_path):
    with CheckpointStore(tmp_path, swarm_id=SWARM, keep=2) as store:
        first = store.save(round=1, step=1, state={"v": 1})
        second = store.save(round=2, step=2, state={"v": 2})
    flip_byte(second / STATE)  # its manifest still reads well
    with CheckpointStore(tmp_path, swarm_id=SWARM, keep=2) as store:
        third = store.save(round=3, step=3, state={"v": 3})
        # Counting the corrupt one as kept would have deleted the first.
        assert names(store) == [third.name, second.name, first.name]
        assert [c.state for c in store.valid()] == [{"v": 3}, {"v": 1}]


def test_a_checkpoint_damaged_while_the_store_is_open_is_judged_again_the_rest_is_not(
    tmp_path, monkeypatch
):
    hashed: list[str] = []
    real_sha256 = checkpoint._sha256

    def counting_sha256(path):
        if not path.parent.name.startswith(".tmp-"):  # (a save hashes what it just wrote)
            hashed.append(path.parent.name)
        return real_sha256(path)

    monkeypatch.setattr(checkpoint, "_sha256", counting_sha256)
    with CheckpointStore(tmp_path, swarm_id=SWARM, keep=3) as store:
        a = store.save(round=1, step=1, state={"v": 1})
        store.save(round=2, step=2, state={"v": 2})
    with CheckpointStore(tmp_path, swarm_id=SWARM, keep=3) as store:
        assert hashed == []  # what it wrote, it hashed before putting it in place
        c = store.save(round=3, step=3, state={"v": 3})
        assert sorted(hashed) == sorted(2 * [a.name, checkpoint_name(2, 2, 2)])  # once each
        hashed.clear()
        store.save(round=4, step=4, state={"v": 4})  # a is the fourth: deleted, not hashed
        assert hashed == [] and not a.exists()
        replace_damaged(c / TENSORS)
        store.save(round=5, step=5, state={"v": 5})
        assert hashed == [c.name]  # only the directory whose files changed
        # c no longer counts: round 2 is still one of the three kept.
        assert [x.state["v"] for x in store.valid()] == [5, 4, 2]
        assert c.exists()


def test_the_newest_verified_checkpoint_survives_any_number_of_unverified_saves(tmp_path):
    with CheckpointStore(tmp_path, swarm_id=SWARM, keep=2) as store:
        own = store.save(round=80, step=800, state={"v": "own"})
        adopted = []
        for r in range(81, 91):  # adopted states, on probation
            adopted.append(store.save(round=r, step=800 + r, state={"v": r}, verified=False))
            assert names(store) == [p.name for p in adopted[::-1][:2]] + [own.name]
            assert store.latest(verified=True).path == own
            assert store.latest().path == adopted[-1] and not store.latest().verified
    with CheckpointStore(tmp_path, swarm_id=SWARM, keep=2) as store:  # after a restart
        assert len(names(store)) == 3
        rollback = store.latest(verified=True)
        assert (rollback.round, rollback.verified, rollback.state) == (80, True, {"v": "own"})
        assert [c.round for c in store.valid(verified=False)] == [90, 89]
        # Trained and checked again: the old verified one is just another old checkpoint.
        again = store.save(round=91, step=1000, state={"v": "own again"})
        assert names(store) == [again.name, adopted[-1].name]


def test_when_the_newest_verified_checkpoint_is_corrupt_the_one_before_it_is_kept(tmp_path):
    with CheckpointStore(tmp_path, swarm_id=SWARM, keep=2) as store:
        older = store.save(round=80, step=800, state={"v": 80})
        newer = store.save(round=82, step=820, state={"v": 82})
    flip_byte(newer / TENSORS)  # its manifest, which says verified, still reads well
    with CheckpointStore(tmp_path, swarm_id=SWARM, keep=2) as store:
        adopted = [
            store.save(round=r, step=10 * r, state={"v": r}, verified=False) for r in range(83, 88)
        ]
        assert store.latest(verified=True).path == older
        assert names(store) == [adopted[-1].name, adopted[-2].name, newer.name, older.name]


def test_a_checkpoint_with_good_hashes_that_cannot_be_read_is_skipped_and_not_kept(tmp_path):
    with CheckpointStore(tmp_path, swarm_id=SWARM, keep=2) as store:
        good = store.save(round=1, step=1, state={"v": 1})
        bad = store.save(round=2, step=2, state={"v": 2})
    # Garbage in state.msgpack, and a manifest that vouches for it.
    garbage = b"\xc1" * 64  # 0xc1 is never used in msgpack
    (bad / STATE).write_bytes(garbage)
    manifest = json.loads((bad / MANIFEST).read_text())
    manifest["files"][STATE] = {
        "bytes": len(garbage),
        "sha256": hashlib.sha256(garbage).hexdigest(),
    }
    (bad / MANIFEST).write_text(json.dumps(manifest))
    skipped = []
    with CheckpointStore(tmp_path, swarm_id=SWARM, keep=2) as store:
        found = list(store.valid(on_skip=lambda path, why: skipped.append((path, why))))
        assert [c.path for c in found] == [good]
        assert skipped == [(bad, skipped[0][1])] and "cannot be read" in skipped[0][1]
        newest = store.save(round=3, step=3, state={"v": 3})
        assert names(store) == [newest.name, bad.name, good.name]  # bad is not one of two


def test_a_checkpoint_the_caller_rejects_is_not_kept_and_stays_on_disk(tmp_path):
    with CheckpointStore(tmp_path, swarm_id=SWARM, keep=2) as store:
        first = store.save(round=1, step=1, state={"v": 1})
        unfit = store.save(round=2, step=2, state={"v": "unfit"})
        store.reject(unfit, "does not fit this peer: a test said so")
        assert [c.path for c in store.valid()] == [first]
        latest = store.save(round=3, step=3, state={"v": 3})
        assert dict(store.inventory()) == {
            latest: "",
            unfit: "does not fit this peer: a test said so",
            first: "",
        }


def test_a_background_write_carries_the_verified_flag(tmp_path):
    with CheckpointStore(tmp_path, swarm_id=SWARM) as store, BackgroundWriter(store) as writer:
        writer.submit(round=1, step=10, state={"v": 1}, verified=False)
        saved = writer.wait()
        assert saved is not None and not saved.verified
        assert json.loads((saved.path / MANIFEST).read_text())["verified"] is False
        assert store.latest(verified=True) is None
        writer.submit(round=2, step=20, state={"v": 2})
        assert writer.wait().verified and store.latest(verified=True).round == 2


# --- writing in the background ----------------------------------------------------------


class GatedStore(CheckpointStore):
    """A real store whose writes, once staged, are finished (hashed, fsynced, put in
    place: the writer thread's half) only when the test lets them go."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()

    def commit(self, staged):
        assert self.gate.wait(30)
        return super().commit(staged)


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
        assert saved.path == tmp_path / checkpoint_name(1, 1, 10)
        assert saved.nbytes > 8000 and not writer.busy
        assert writer.poll() is None  # collected once
        assert_same(store.latest().state, expected)


def test_cloned_tensors_are_written_by_the_writer_as_they_were_when_submitted(tmp_path):
    """A GPU's tensors, cloned on the card where it has the room, are written by the
    writer's thread into holes the caller's thread left: here the fp32 tensors are cloned
    (on the CPU: the same path, the card's clone aside)."""
    state = sample_state()
    expected = copy.deepcopy(state)

    def fp32(tensors):
        return {n: t.clone() for n, t in tensors.items() if t.dtype == torch.float32}

    with (
        GatedStore(tmp_path, swarm_id=SWARM) as store,
        BackgroundWriter(store, clone=fp32) as writer,
    ):
        writer.submit(round=1, step=10, state=state)
        # What the caller's thread wrote: a whole file, with holes where the clones go.
        [staged] = [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
        written = load_file(staged / TENSORS)
        assert all(not t.any() for t in written.values() if t.dtype == torch.float32)
        assert any(torch.equal(t, expected["local"]["w"]) for t in written.values())
        state["theta_g"].add_(1.0)  # training goes on, in place
        state["momentum"].zero_()
        state["local"]["w"].zero_()
        store.gate.set()
        assert writer.wait() is not None
        assert_same(store.latest().state, expected)


def test_without_a_gpu_nothing_is_cloned():
    assert checkpoint.clone_on_device(flatten_tensors(sample_state())) == {}


def flatten_tensors(state: dict) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    flatten(state, tensors)
    return tensors


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
        with pytest.raises(CheckpointError, match="cannot write"):
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
