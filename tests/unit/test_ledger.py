"""The ledger of the sequences a peer read and what became of them, and the audit."""

import json

import numpy as np
import pytest
import torch

from swarmloco.dataset.ledger import (
    Audit,
    Landed,
    Landing,
    Ledger,
    Range,
    Sequences,
    coverage,
    epoch_order,
    merged,
    read_audit,
)
from swarmloco.errors import DataError


def r(shard: int, first: int, count: int, epoch: int = 0) -> Range:
    return Range(epoch, shard, first, count)


def test_sequences_are_windows_at_multiples_of_seq_len_over_each_shards_training_part():
    shards = [np.arange(100, dtype=np.uint16), np.arange(1000, 1010, dtype=np.uint16)]
    seqs = Sequences(shards, seq_len=8, val_fraction=0.2)
    # 80 training tokens: windows of 9 starting at 0, 8, ..., 64 (72 + 9 > 80).
    assert seqs.counts == [9, 0]
    windows = seqs.read(r(0, 2, 3))
    assert windows.shape == (3, 9)
    assert windows[0, 0] == 16 and windows[0, -1] == 24 and windows[2, 0] == 32
    # Each token but the first is a target exactly once across the shard's sequences.
    targets = np.concatenate([w[1:] for w in seqs.read(r(0, 0, 9))])
    assert sorted(targets) == list(range(1, 73))
    with pytest.raises(DataError, match="past"):
        seqs.read(r(0, 8, 2))
    with pytest.raises(DataError, match="no shard"):
        Sequences([np.arange(5)], seq_len=8, val_fraction=0.0)


def test_epoch_orders_are_the_runs_and_differ_by_epoch():
    assert epoch_order(7, 0, 10) == epoch_order(7, 0, 10)
    assert sorted(epoch_order(7, 0, 10)) == list(range(10))
    assert epoch_order(7, 0, 10) != epoch_order(7, 1, 10)


def test_merged_joins_touching_ranges_of_one_shard_and_epoch():
    assert merged([r(1, 4, 4), r(1, 0, 4), r(2, 0, 1), r(1, 10, 2), r(1, 0, 2, epoch=1)]) == [
        r(1, 0, 8),
        r(1, 10, 2),
        r(2, 0, 1),
        r(1, 0, 2, epoch=1),
    ]


def test_ranges_land_with_the_round_that_carried_them_and_a_failed_round_changes_nothing():
    ledger = Ledger()
    ledger.read([r(0, 0, 4)])
    assert ledger.declare(1, 0) == [r(0, 0, 4)]
    ledger.read([r(0, 4, 4)])  # read while round 1 is in flight: the next round's
    ledger.failed(1)
    assert ledger.declare(2, 0) == [r(0, 0, 8)]  # the next attempt carries both
    ledger.read([r(0, 8, 4)])
    assert ledger.landed(2, included=True) == [r(0, 0, 8)]
    assert [e.range for e in ledger.pending] == [r(0, 8, 4)]
    assert ledger.landed(99, included=True) == []  # a round never declared


def test_a_contribution_left_out_and_thrown_away_work_are_read_again_once():
    ledger = Ledger()
    ledger.read([r(0, 0, 4), r(3, 0, 2)])
    ledger.declare(1, 0)
    ledger.read([r(0, 4, 4)])
    assert ledger.landed(1, included=False) == []  # struck: what it carried is given back
    assert ledger.redo == [r(0, 0, 4), r(3, 0, 2)]
    assert ledger.take_redo(5) == [r(0, 0, 4), r(3, 0, 1)]
    assert ledger.redo == [r(3, 1, 1)]
    assert ledger.discard() == [r(0, 4, 4)]  # NaN, or a catch-up: all pending given back
    assert ledger.redo == [r(0, 4, 4), r(3, 1, 1)]
    assert ledger.pending == [] and ledger.given_back_total == 10


def test_with_fragments_a_range_lands_with_the_last_fragment_to_carry_it():
    ledger = Ledger(fragments=2)
    ledger.read([r(0, 0, 4)])
    assert ledger.declare(1, 0) == []  # fragment 0 carries its share; fragment 1 has to
    assert ledger.landed(1, included=True) == []
    ledger.read([r(0, 4, 4)])
    assert ledger.declare(2, 1) == [r(0, 0, 4)]  # completes the first range only
    assert ledger.landed(2, included=True) == [r(0, 0, 4)]
    # The second was read before round 2 began: fragment 1 carried its share there, and
    # fragment 0's next round completes it.
    assert ledger.declare(3, 0) == [r(0, 4, 4)]
    assert ledger.landed(3, included=True) == [r(0, 4, 4)]


def test_a_declaration_carries_sixteen_ranges_at_most_and_the_rest_wait():
    ledger = Ledger()
    ledger.read([r(s, 0, 1) for s in range(20)])
    first = ledger.declare(1, 0)
    assert len(first) == 16
    assert ledger.landed(1, included=True) == first
    assert ledger.declare(2, 0) == [r(s, 0, 1) for s in range(16, 20)]


def test_the_ledgers_state_round_trips_and_malformed_state_is_refused():
    ledger = Ledger(fragments=2)
    ledger.read([r(0, 0, 4)])
    ledger.declare(1, 0)
    ledger.landed(1, included=True)
    ledger.redo = [r(1, 0, 2)]
    state = json.loads(json.dumps(ledger.state_dict()))
    again = Ledger(fragments=2)
    again.load_state_dict(state)
    assert [(e.range, e.fragments) for e in again.pending] == [(r(0, 0, 4), {1})]
    assert again.redo == [r(1, 0, 2)]
    for bad in ({}, {"pending": [[0, 0, 0]], "redo": []}, {"pending": [], "redo": [[0, 0, 0, 0]]}):
        with pytest.raises(DataError, match="malformed"):
            Ledger().load_state_dict(bad)
    with pytest.raises(DataError, match="fragments"):
        Ledger(fragments=1).load_state_dict(state)


def test_the_audit_survives_a_torn_last_line_and_coverage_counts_each_contribution_once(tmp_path):
    path = tmp_path / "audit.jsonl"
    audit = Audit(path)
    audit.append([Landing(1, "a", (r(0, 0, 4),)), Landing(1, "b", (r(1, 0, 3),))])
    audit.append([Landing(2, "a", (r(0, 4, 2),))])
    with path.open("a") as fh:
        fh.write('{"round": 3, "peer": "a", "ran')  # a crash in the middle of a write
    assert [x.round for x in read_audit(path)] == [1, 1, 2]
    # Another peer saw the same round-1 landings: each contribution counts once.
    other = [Landing(1, "a", (r(0, 0, 4),)), Landing(1, "b", (r(1, 0, 3),))]
    cover = coverage([read_audit(path), other], counts=[6, 4], epoch=0)
    assert (cover.sequences, cover.landed, cover.duplicated, cover.missing) == (10, 9, 0, 1)
    # The same sequences in two contributions are a duplicate.
    again = [Landing(5, "c", (r(0, 2, 2),))]
    cover = coverage([read_audit(path), again], counts=[6, 4], epoch=0)
    assert cover.duplicated == 2 and cover.missing == 1


def test_what_landed_in_a_state_counts_repeats_and_round_trips_through_its_tensor():
    landed = Landed()
    assert not landed and Landed.from_tensor(landed.to_tensor()) == landed
    landed.add([r(0, 0, 4), r(1, 0, 3)])
    landed.add([r(0, 4, 6), r(2, 1, 2, epoch=1)])
    assert landed.ranges == [r(0, 0, 10), r(1, 0, 3), r(2, 1, 2, epoch=1)]
    assert landed.counted == [13, 2] and landed.of(0, 0) == [(0, 10)]
    back = Landed.from_tensor(landed.to_tensor())
    assert back == landed and back.copy() == landed
    assert landed.coverage([10, 5, 4], epoch=0).to_json() == {
        "sequences": 19, "landed": 13, "duplicated": 0, "missing": 6
    }  # fmt: skip
    landed.add([r(1, 2, 2)])  # sequence 2 of shard 1 lands a second time
    cover = landed.coverage([10, 5, 4], epoch=0)
    assert (cover.landed, cover.duplicated, cover.missing) == (14, 1, 5)
    # An epoch past the one after the newest counted is left out (a declaration cannot grow
    # the state by epochs at will); the one after is taken.
    before = landed.copy()
    landed.add([r(0, 0, 1, epoch=3), r(0, 0, 1, epoch=2**31)])
    assert landed == before
    landed.add([r(0, 0, 1, epoch=2)])
    assert landed.counted == [15, 2, 1]


@pytest.mark.parametrize(
    "values, problem",
    [
        ([], "vector"),
        ([1, 5, 0, 0, 0], "not ranges"),  # a row cut short
        ([1, -1], "not ranges"),  # a negative count
        ([2, 4], "epoch"),  # counts for fewer epochs than it says
        ([1, 3, 0, 0, 0, 4], "more sequences"),  # holds 4, counts 3
        ([1, 8, 0, 0, 4, 4, 0, 0, 0, 4], "sorted"),  # out of order
        ([1, 8, 0, 0, 0, 4, 0, 0, 4, 4], "merged"),  # touching, not merged
        ([1, 4, 1, 0, 0, 4], "does not count"),  # a range of epoch 1, one epoch counted
        ([1, 4, 0, 0, -2, 4], "not a range"),
        ([1, 0], "more sequences"),  # an epoch counted with nothing
    ],
)
def test_a_malformed_landed_tensor_is_refused(values, problem):
    with pytest.raises(ValueError, match=problem):
        Landed.from_tensor(torch.tensor(values, dtype=torch.int64))
    assert Landed.from_tensor(torch.tensor([1, 4, 0, 0, 0, 4])).counted == [4]


def test_what_a_round_landed_is_part_of_the_state_its_digest_and_its_checkpoint():
    from swarmloco.core.codec import CodecConfig
    from swarmloco.core.flat import FlatLayout
    from swarmloco.core.outer import OuterConfig
    from swarmloco.core.state import LANDED, StateSnapshot
    from swarmloco.train.diloco import DilocoState

    def state() -> DilocoState:
        layout = FlatLayout([("w", (8, 16))], [0], 64)
        return DilocoState(layout, OuterConfig(), CodecConfig(block_size=64, backend="eager"))

    a, b = state(), state()
    for s in (a, b):
        s.apply(0, 1, torch.zeros(128), landed=[r(0, 0, 4)])
    assert LANDED in a.committed() and a.landed.counted == [4]
    digest = StateSnapshot.of(swarm_id="5a" * 20, round=1, tensors=a.committed()).digest
    b.apply(0, 2, torch.zeros(128), landed=[r(1, 0, 2, epoch=1)])
    b.round = 1  # the same weights and round, another landing: another state
    assert StateSnapshot.of(swarm_id="5a" * 20, round=1, tensors=b.committed()).digest != digest
    # A peer that takes the state takes what landed in it; a checkpoint keeps it.
    taker = state()
    taker.adopt(StateSnapshot.of(swarm_id="5a" * 20, round=1, tensors=a.committed()))
    assert taker.landed == a.landed
    restored = state()
    restored.load_state_dict(b.state_dict())
    assert restored.landed == b.landed and restored.landed.counted == [4, 2]
    assert (
        DilocoState.snapshot_tensors(b.state_dict())[LANDED].tolist()
        == b.landed.to_tensor().tolist()
    )
    # Nothing landed (no pinned dataset): the state is what it always was.
    plain = state()
    plain.apply(0, 1, torch.zeros(128))
    assert LANDED not in plain.committed() and LANDED not in DilocoState.snapshot_tensors(
        plain.state_dict()
    )
    bad = b.state_dict() | {"landed": torch.tensor([1, 0], dtype=torch.int64)}
    with pytest.raises(ValueError, match="more sequences"):
        restored.load_state_dict(bad)
    assert restored.landed == b.landed  # nothing changed
