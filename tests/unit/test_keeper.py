"""The checkpoint keeper alone: a real store and writer on disk, a state given as a dict."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from swarmloco.errors import SwarmlocoError
from swarmloco.runtime.checkpoint import BackgroundWriter, CheckpointStore
from swarmloco.runtime.keeper import CheckpointKeeper

SWARM = "cd" * 20


class Events(list):
    def __call__(self, event: str, **fields: Any) -> None:
        self.append((event, fields))

    def of(self, event: str) -> list[dict[str, Any]]:
        return [fields for name, fields in self if name == event]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def keeper_at(root: Path, events: Events, clock: Clock | None = None) -> CheckpointKeeper:
    store = CheckpointStore(root, swarm_id=SWARM, keep=5).open()
    return CheckpointKeeper(
        store, BackgroundWriter(store), retry_s=30.0, emit=events, clock=clock or Clock()
    )


def state(value: float, shape: tuple[int, ...] = (4,)) -> dict[str, Any]:
    return {"w": torch.full(shape, value), "steps": int(value)}


def write(keeper: CheckpointKeeper, round: int, s: dict[str, Any]) -> None:
    assert keeper.save(lambda: s, round=round, step=round)
    assert keeper.collect(wait=True) is not None


def test_it_resumes_from_the_newest_checkpoint_that_fits_and_tells_of_those_that_do_not(
    tmp_path,
):
    events = Events()
    keeper = keeper_at(tmp_path, events)
    write(keeper, 1, state(1.0))
    write(keeper, 2, state(2.0, (5,)))  # saved by a wider model: does not fit now
    loaded: list[float] = []

    def load(s: dict[str, Any]) -> None:
        if s["w"].shape != (4,):
            raise ValueError(f"w is {tuple(s['w'].shape)}, this peer's (4,)")
        loaded.append(float(s["w"][0]))

    found = keeper.resume(load)
    assert found is not None and found.round == 1 and loaded == [1.0]
    skipped = events.of("checkpoint-skipped")
    assert len(skipped) == 1
    assert "does not fit this peer: ValueError: w is (5,)" in skipped[0]["why"]
    # Left on disk for a person to look at, marked for what it is.
    why = dict(keeper.store.inventory())[Path(skipped[0]["checkpoint"])]
    assert why.startswith("does not fit this peer")


def test_checkpoints_with_good_hashes_of_which_none_fits_are_not_started_over(tmp_path):
    keeper = keeper_at(tmp_path, Events())
    write(keeper, 1, state(1.0))
    write(keeper, 2, state(2.0))

    def load(s: dict[str, Any]) -> None:
        raise KeyError("object 'sampler' (registered now, not when it was saved)")

    with pytest.raises(SwarmlocoError, match=r"nor do the 1 older one\(s\).*move them away"):
        keeper.resume(load)


def test_only_corrupt_checkpoints_start_afresh_and_say_so(tmp_path):
    keeper = keeper_at(tmp_path, Events())
    assert keeper.resume(lambda s: None) is None and keeper.error == ""  # none at all
    write(keeper, 1, state(1.0))
    for f in (p for p in tmp_path.rglob("*") if p.is_file() and p.suffix == ".safetensors"):
        f.write_bytes(b"\0" * f.stat().st_size)  # same size, other bytes: the hash fails
    assert keeper.resume(lambda s: None) is None
    assert "none of the 1 checkpoint(s)" in keeper.error and "intact" in keeper.error


def test_a_checkpoint_that_finds_the_writer_busy_is_skipped_or_owed_if_urgent(tmp_path):
    clock = Clock()
    keeper = keeper_at(tmp_path, Events(), clock)
    release = threading.Event()
    original = keeper.writer._commit

    def slow(*args: Any) -> Any:
        release.wait(30)
        return original(*args)

    keeper.writer._commit = slow  # type: ignore[method-assign]
    captured: list[int] = []

    def capture(round: int) -> Any:
        return lambda: captured.append(round) or state(float(round))

    assert keeper.save(capture(1), round=1, step=1)
    assert not keeper.save(capture(2), round=2, step=2)  # a round's: skipped
    assert keeper.due is None and not keeper.owed()
    assert not keeper.save(capture(3), round=3, step=3, urgent=True)  # owed
    assert keeper.due == clock.now and not keeper.owed()  # the writer is still busy
    assert captured == [1]  # nothing was captured for the ones not written
    release.set()
    assert keeper.collect(wait=True).round == 1
    assert keeper.owed()
    assert keeper.save(capture(3), round=3, step=3)
    assert keeper.collect(wait=True).round == 3 and keeper.due is None
    assert [c.round for c in keeper.store.valid()] == [3, 1]


def test_a_failed_write_is_told_and_owed_again_and_a_later_one_clears_it(small_tmpfs):
    events = Events()
    clock = Clock()
    keeper = keeper_at(small_tmpfs, events, clock)
    write(keeper, 1, state(1.0))
    keeper.dirty = True
    assert keeper.save(lambda: state(2.0, (1 << 20,)), round=2, step=2)  # 4 MiB: no room
    assert keeper.collect(wait=True) is None
    assert keeper.failures == 1 and keeper.error.startswith("checkpoint failed")
    failed = events.of("checkpoint-failed")
    assert failed[0]["round"] == 2 and "space" in failed[0]["error"]
    assert keeper.dirty and keeper.due == clock.now + 30.0 and not keeper.owed()
    assert [c.round for c in keeper.store.valid()] == [1]  # the earlier one is intact
    clock.now += 30.0
    assert keeper.owed()
    write(keeper, 3, state(3.0))
    assert keeper.error == "" and not keeper.dirty and keeper.due is None


def test_an_adopted_state_is_saved_unverified_and_the_verified_one_stays(tmp_path):
    keeper = keeper_at(tmp_path, Events())
    write(keeper, 1, state(1.0))
    keeper.verified = False
    for r in (2, 3, 4, 5, 6, 7):
        write(keeper, r, state(float(r)))
    assert [c.round for c in keeper.store.valid(verified=True)] == [1]
    found = keeper.resume(lambda s: None)
    assert found is not None and found.round == 7 and not found.verified
    assert not keeper.verified
    assert keeper.resume(lambda s: None, verified=True).round == 1 and keeper.verified
