"""Whose listing of a shard counts as theirs to read (``LeasedData.held``): a listing shows
work or it idles, however many keys make it (docs/SECURITY.md, "Datasets")."""

import time

import numpy as np
import pytest

from swarmloco.dataset.leases import LeasedData
from swarmloco.dataset.ledger import Landed, Range, Sequences

IDLE = 100.0


def reader(tmp_path) -> LeasedData:
    shards = [np.arange(10 * 8 + 1, dtype=np.uint16) % 50 for _ in range(4)]
    return LeasedData(
        Sequences(shards, seq_len=8, val_fraction=0.0),
        batch_size=4,
        vocab_size=64,
        seed=5,
        fragments=1,
        audit=tmp_path / "audit.jsonl",
        max_epochs=1,
        idle_s=IDLE,
    )


def test_a_strangers_listing_idles_whatever_keys_renew_or_repeat_it(tmp_path):
    data = reader(tmp_path)
    t0 = time.monotonic()
    assert data.held({(0, 1): {"s1"}}, t0) == {(0, 1)}
    assert data.held({(0, 1): {"s1"}}, t0 + IDLE - 1) == {(0, 1)}
    assert data.held({(0, 1): {"s1"}}, t0 + IDLE) == set()  # idle: free to read here
    # Fresh keys listing it, or the key dropping it from its record and listing it again
    # between two looks, start nothing again: nothing of it landed.
    assert data.held({(0, 1): {"s2", "s3"}}, t0 + IDLE + 5) == set()
    # A shard found listed by nobody is free; listed again, its clock starts again.
    assert data.held({}, t0 + IDLE + 6) == set()
    assert data.held({(0, 1): {"s4"}}, t0 + IDLE + 7) == {(0, 1)}
    assert data.held({(0, 1): {"s4"}}, t0 + 2 * IDLE + 7) == set()


def test_a_listing_holds_while_its_shard_lands_or_a_lister_averaged_here(tmp_path):
    data = reader(tmp_path)
    t0 = time.monotonic()  # about when the rounds below are applied
    listed = {(0, 1): {"reader"}, (0, 2): {"partner"}, (0, 3): {"left"}}
    assert data.held(listed, t0 - 60) == set(listed)  # first found listed a minute before
    # Something of shard 1 landed in a round this peer applied (another member read it),
    # with "partner" a member; "left" was left out of the round's result: no partner, and
    # what it declared did not land.
    declared = {"other": [(0, 1, 0, 4)], "partner": [], "left": [(0, 3, 0, 4)]}
    data.landed(1, declared, {"other": True, "partner": True, "left": False}, "me")
    # Shard 2 landed nothing for longer than IDLE, but its lister averaged here since;
    # shard 1's clock started again when it landed; shard 3 is idle.
    assert data.held(listed, t0 + 50) == {(0, 1), (0, 2)}
    # Nothing more landed and the partner averaged here no more: both idle in time.
    assert data.held(listed, t0 + IDLE + 50) == set()


def test_a_peer_refuses_an_idle_time_shorter_than_two_lease_lives(tmp_path):
    from swarmloco.runtime.config import PeerConfig
    from swarmloco.runtime.daemon import DaemonConfig

    peer = PeerConfig(data_dir=tmp_path)
    assert DaemonConfig(peer=peer, lease_s=60.0).lease_idle_s == 1800.0
    assert DaemonConfig(peer=peer, lease_s=4.0, lease_idle_s=8.0).lease_idle_s == 8.0
    with pytest.raises(ValueError, match=r"at least two lease lives \(120 s\)"):
        DaemonConfig(peer=peer, lease_s=60.0, lease_idle_s=100.0)


def test_what_landed_is_the_states_and_a_state_taken_replaces_it(tmp_path):
    data = reader(tmp_path)
    declared = {"p": [(0, 1, 0, 4)], "me": [(0, 2, 0, 10)]}
    data.landed(1, declared, {"p": True, "me": True}, "me")
    assert data.account.ranges == [Range(0, 1, 0, 4), Range(0, 2, 0, 10)]
    assert (data._todo(0, 1), data._todo(0, 2)) == ([(4, 10)], [])
    # Another state is taken, in which shard 3 landed and shard 2 did not: shard 2 is read
    # again (what landed in the state left behind left with it), shard 3 is not.
    data.adopted(Landed([Range(0, 3, 0, 10)], [10]))
    assert (data._todo(0, 2), data._todo(0, 3)) == ([(0, 10)], [])
    assert data.progress()["landed"] == 10 and data.progress()["done"] == 1
    # The checkpoint keeps what was read, not what landed (that is the state's); one of
    # before, with the partners and donors whose word counted then, loads.
    state = data.state_dict()
    assert set(state) == {"epoch", "open_epoch", "ledger"}
    again = reader(tmp_path)
    again.load_state_dict({**state, "partners": ["p"], "donors": ["d"], "trusted": ["t"]})
    assert again.epoch == data.epoch and not again.account


def test_what_a_state_taken_says_landed_of_a_shard_being_read_is_not_read(tmp_path):
    data = reader(tmp_path)
    data.reading[(0, 1)] = [(0, 10)]  # leased, nothing of it read yet
    data.adopted(Landed([Range(0, 1, 2, 4)], [4]))  # sequences 2..5 landed in the state taken
    assert data.ready(1)  # 6 left, a batch of 4
    x, _ = data.next_batch()
    assert x.shape[0] == 4
    assert data.reading[(0, 1)] == [(8, 10)]
    assert [e.range for e in data.ledger.pending] == [Range(0, 1, 0, 2), Range(0, 1, 6, 2)]
