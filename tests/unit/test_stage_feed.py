"""Stage 0's micro-batches from a pinned dataset's leases (``pipeline/feed.py``): a
micro-batch's sequences count as read once the step that holds its gradient is taken; one
that failed is read again, unless its gradient was in the step already; one whose sequences
landed meanwhile is withdrawn before its forward."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from swarmloco.dataset.leases import LeasedData
from swarmloco.dataset.ledger import Range, Sequences
from swarmloco.net.rejections import Rejection
from swarmloco.pipeline.feed import LeasedFeed
from swarmloco.pipeline.replica import ReplicaConfig, StageReplica

SEQ = 8


def stage_zero(tmp_path) -> tuple[LeasedFeed, StageReplica, LeasedData]:
    """A reader holding shard 0 (12 sequences) in micro-batches of 4, and an owned stage-0
    replica (an embedding) stepping every 8 sequences."""
    shards = [np.arange(12 * SEQ + 1, dtype=np.uint16) % 50]
    reader = LeasedData(
        Sequences(shards, seq_len=SEQ, val_fraction=0.0),
        batch_size=4, vocab_size=64, seed=5, fragments=1, audit=tmp_path / "audit.jsonl",
    )  # fmt: skip
    reader.reading[(0, 0)] = [(0, 12)]  # (leased: what its lease task does over the DHT)
    torch.manual_seed(0)
    module = torch.nn.Embedding(64, 4)
    replica = StageReplica(
        module, first=True, last=False, config=ReplicaConfig(step_samples=8),
        optimizer=torch.optim.SGD(module.parameters(), lr=0.1), owned=True,
    )  # fmt: skip
    feed = LeasedFeed(reader, replica, step=8)
    feed.attach()
    return feed, replica, reader


def through(replica: StageReplica, name: bytes, x: torch.Tensor) -> None:
    """The micro-batch's forward and backward at stage 0 (the later stages' part done)."""
    out = replica.forward(name, x)
    replica.backward(name, torch.ones_like(out))


def test_a_steps_sequences_are_read_once_the_step_is_taken_and_a_failed_one_is_given_back(
    tmp_path,
):
    feed, replica, reader = stage_zero(tmp_path)
    (x1, _, one), (x2, _, two), (_, _, three) = feed.take(), feed.take(), feed.take()
    through(replica, one, x1)
    through(replica, two, x2)
    assert not reader.pending()  # in flight until the step that holds them
    feed.failed(three)  # never forwarded: its sequences are read again
    assert reader.ledger.redo == [Range(0, 0, 8, 4)]
    assert replica.take_step(timeout=5.0) == 8
    replica.release()
    declared = reader.declare(1, 0)
    assert declared == [(0, 0, 0, 8)]  # what the step trained, no more
    reader.landed(1, {"me": declared}, {"me": True}, "me")
    assert feed.in_flight == 0
    # A micro-batch whose backward ran here and that failed further on is in the next step.
    x4, _, four = feed.take()  # the given-back sequences
    assert not reader.ledger.redo and x4.shape == (4, SEQ)
    through(replica, four, x4)
    feed.failed(four)
    assert replica.take_step(timeout=5.0, now=True) == 4
    replica.release()
    assert reader.declare(2, 0) == [(0, 0, 8, 4)]


def test_a_micro_batch_whose_sequences_landed_meanwhile_is_withdrawn_before_its_forward(
    tmp_path,
):
    feed, replica, reader = stage_zero(tmp_path)
    x, _, name = feed.take()
    # A state taken meanwhile (this peer was behind) holds them: another peer read them.
    reader.landed(1, {"other": [(0, 0, 0, 4)]}, {"other": True}, "me")
    with pytest.raises(Rejection) as refused:
        replica.forward(name, x)
    assert refused.value.code == "withdrawn"
    feed.failed(name)
    assert replica.micro_batches == 0 and feed.in_flight == 0
    x, _, name = feed.take()  # given back, and passed over: it landed
    assert not reader.ledger.redo
    assert torch.equal(x, torch.from_numpy(reader.sequences.read(Range(0, 0, 4, 4)))[:, :-1])


def test_a_micro_batch_on_its_way_when_its_shard_is_given_up_is_withdrawn_and_not_read_again(
    tmp_path,
):
    """The leases of this peer lapsed (its machine froze) and another peer took its shard.
    Between two steps the peer throws its local work away and gives the shard up; a
    micro-batch taken before then, whose stage-0 forward waited for that step, is the other
    peer's to read now: refused at its forward, neither recorded nor read again here."""
    feed, replica, reader = stage_zero(tmp_path)
    (x1, _, one), (x2, _, two), (x3, _, three) = feed.take(), feed.take(), feed.take()
    through(replica, one, x1)
    through(replica, two, x2)
    assert replica.take_step(timeout=5.0) == 8  # `three` waits for the step to be released
    reader.taken_by_others({(0, 0)})  # (what its lease task finds after the lapse)
    assert reader.lapsed()
    reader.discard()  # (the step hook: the local work is thrown away...)
    assert reader.forget_lapsed() == 8  # (...and what it read of the shard is forgotten)
    replica.release()
    with pytest.raises(Rejection) as refused:
        replica.forward(three, x3)
    assert refused.value.code == "withdrawn"
    feed.failed(three)
    assert replica.micro_batches == 0 and feed.in_flight == 0
    assert not reader.ledger.redo and not reader.pending() and not reader.ready()
    assert reader.declare(1, 0) == []
