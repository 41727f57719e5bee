"""One member's view of a round: failover claims, convergence, digest and report."""

import hashlib

import pytest

from swarmloco.core.codec import CodecConfig
from swarmloco.errors import RoundAborted
from swarmloco.net.averaging.group import Group, Member
from swarmloco.net.averaging.view import Claim, RoundView, digest_of
from swarmloco.net.averaging.wire import bitmap
from swarmloco.net.rejections import Rejection
from swarmloco.proto.v1 import averaging_pb2 as pb

CODEC = CodecConfig(block_size=64, chunk_bytes=4 * (64 + 4), backend="eager")


def group(serving=(True, True, True, False)) -> Group:
    members = tuple(
        Member(f"{i:040x}", b"k" * 32, "127.0.0.1:1" if s else "", 1.0, 1.0 if s else 0.0)
        for i, s in enumerate(serving)
    )
    n_serving = sum(serving)
    blocks = 8
    parts, first = [], 0
    for s in serving:
        size = blocks if s else 0
        parts.append((first, size))
        first += size
    return Group(
        group_id=b"g" * 16,
        round=1,
        members=members,
        parts=tuple(parts),
        numel=64 * blocks * n_serving,
        block_size=64,
    )


def message(part: int, index: int, bits: bytes, payload: bytes = b"p") -> bytes:
    """A stand-in for the result message of a chunk (the seal covers its bytes)."""
    return bytes([part, index]) + bits + payload


def seal_of(view: RoundView, part: int, hash: bytes | None = None) -> pb.Seal:
    claim = view.owner[part]
    hash = view.part_hash(part) if hash is None else hash
    return pb.Seal(part=part, epoch=claim.epoch, reducer=claim.reducer, hash=hash)


def fill(view: RoundView, part: int, contributors=(0, 1, 2, 3), payload: bytes = b"p") -> None:
    for k in range(view.received(part), len(view.spans[part])):
        bits = bitmap(contributors, view.group.size)
        view.on_result(part, k, bits, message(part, k, bits, payload))
    assert view.seal(seal_of(view, part))


def test_parts_of_a_failed_reducer_move_to_the_next_serving_member():
    view = RoundView(group(), me=3, codec=CODEC)
    assert view.parts == [0, 1, 2] and view.owner[2] == Claim(0, 2)
    fill(view, 1)
    # Member 2 fails: part 2 goes to the next serving member after it, skipping the client
    # (3): member 0, one epoch up.
    assert view.fail(2, "gone") == [2]
    assert view.owner[2] == Claim(1, 0)
    # Member 1 fails too, but we already hold its whole part: nothing moves.
    assert view.fail(1, "gone") == []
    # Member 0 fails: part 0 and part 2 have nowhere left to go.
    with pytest.raises(RoundAborted):
        view.fail(0, "gone")


def test_claims_converge_on_the_highest_epoch_then_the_closest_backup():
    view = RoundView(group(), me=1, codec=CODEC)
    assert not view.notice(0, Claim(0, 1))  # epoch 0 belongs to the part's own reducer
    assert view.notice(0, Claim(1, 2))
    assert view.notice(0, Claim(1, 1))  # same epoch, closer after member 0
    assert not view.notice(0, Claim(1, 2))
    assert view.notice(0, Claim(2, 2))
    assert view.owner[0] == Claim(2, 2)
    with pytest.raises(Rejection):
        view.notice(3, Claim(1, 0))  # the client has no part


def test_a_claim_by_a_member_we_failed_moves_nothing():
    # Member 2 went bad: we failed it, and its notice that it reruns part 0 (at a higher
    # epoch than ours) arrives after. Moving there would wait forever on a member we no
    # longer send to or watch: the claim is ignored, and part 0 stays with member 0.
    view = RoundView(group(), me=1, codec=CODEC)
    view.fail(2, "struck")
    assert view.owner[2] == Claim(1, 0)
    assert not view.notice(0, Claim(1, 2))
    assert not view.notice(0, Claim(5, 2))
    assert view.owner[0] == Claim(0, 0)
    # A live backup's claim still beats ours.
    assert view.notice(0, Claim(1, 1)) and view.owner[0] == Claim(1, 1)
    assert all(claim.reducer not in view.failed for claim in view.owner.values())


def test_a_move_forgets_what_was_received_of_the_part():
    view = RoundView(group(), me=0, codec=CODEC)
    fill(view, 1)
    assert view.part_complete(1)
    view.notice(1, Claim(1, 2))
    assert view.received(1) == 0 and not view.expects(1, 0, 1) and view.expects(1, 1, 2)


def test_what_was_sealed_of_a_claim_stays_to_judge_proofs_after_the_part_moved_on():
    """An auditor's proof of part 1 as member 1 reduced it may come after the part moved
    on: what we received of that claim, sealed, is kept (each chunk's contributors and
    message hash); a claim we never held whole has nothing."""
    view = RoundView(group(), me=0, codec=CODEC)
    fill(view, 1, contributors=(0, 2))
    first = Claim(0, 1)
    sealed = view.sealed_result(1, first)
    assert sealed is not None and len(sealed.hashes) == len(view.spans[1])
    bits = bitmap((0, 2), 4)
    assert sealed.hashes[0] == hashlib.sha256(message(1, 0, bits)).digest()
    assert sealed.contributors(0, 4) == [0, 2] and sealed.included(4) == {
        0: len(view.spans[1]),
        1: 0,
        2: len(view.spans[1]),
        3: 0,
    }
    assert view.notice(1, Claim(1, 2))
    assert view.sealed_result(1, first) == sealed
    assert view.sealed_result(1, Claim(1, 2)) is None  # nothing of it received yet
    assert view.sealed_result(2, Claim(0, 2)) is None  # never sealed


def test_results_must_come_in_order_and_name_somebody():
    view = RoundView(group(), me=0, codec=CODEC)
    view.on_result(0, 0, bitmap([0], 4), b"m")
    with pytest.raises(Rejection):
        view.on_result(0, 2, bitmap([0], 4), b"m")
    with pytest.raises(Rejection):
        view.on_result(0, 1, bitmap([], 4), b"m")


def test_a_part_is_whole_only_once_sealed_over_the_results_we_received():
    view = RoundView(group(), me=3, codec=CODEC)
    bits = bitmap([0, 1, 2, 3], 4)
    view.on_result(0, 0, bits, message(0, 0, bits))
    with pytest.raises(Rejection, match="before its last result chunk"):
        view.seal(seal_of(view, 0))
    view.on_result(0, 1, bits, message(0, 1, bits))
    assert view.chunks_complete(0) and not view.part_complete(0)
    with pytest.raises(Rejection, match="over other results than it sent"):
        view.seal(seal_of(view, 0, hash=b"x" * 16))
    stale = pb.Seal(part=0, epoch=1, reducer=1, hash=view.part_hash(0))
    assert not view.seal(stale)  # not the claim we hold the part under
    assert view.seal(seal_of(view, 0)) and view.part_complete(0)
    view.notice(0, Claim(1, 1))  # a rerun: its seal goes with what was received
    assert not view.part_complete(0) and 0 not in view.sealed


def test_the_same_contributors_under_other_bytes_make_another_digest():
    """A reducer that sends two members different results over the same contributors:
    before seals, the digest covered the contributors alone, and both members applied
    what they held."""
    a, b = RoundView(group(), me=0, codec=CODEC), RoundView(group(), me=1, codec=CODEC)
    for view in (a, b):
        fill(view, 0)
        fill(view, 1)
    fill(a, 2)
    fill(b, 2, payload=b"reversed")
    assert a.digest() != b.digest()
    differ = [x.part for x, y in zip(a.seals(), b.seals(), strict=True) if x != y]
    assert differ == [2]
    assert a.digest() == digest_of(a.group.group_id, a.group.round, a.seals())


def test_digest_and_report_say_who_counted_where():
    a, b = RoundView(group(), me=0, codec=CODEC), RoundView(group(), me=1, codec=CODEC)
    for view in (a, b):
        fill(view, 0)
        fill(view, 1)
    fill(a, 2, (0, 1, 2))
    view_c = b
    bits = bitmap([0, 1, 2, 3], 4)
    view_c.on_result(2, 0, bits, message(2, 0, bits))
    fill(view_c, 2, (0, 1, 2))
    assert a.complete and b.complete
    assert a.digest() != b.digest()  # member 3 counted in chunk 0 of part 2 only for b
    report = {p.part: p for p in b.report()}
    assert report[2].included["0" * 39 + "3"] == 1
    assert report[2].included["0" * 39 + "0"] == report[2].chunks == 2
    assert (report[1].start, report[1].stop) == (512, 1024)
    a2 = RoundView(group(), me=2, codec=CODEC)
    for part in (0, 1):
        fill(a2, part)
    fill(a2, 2, (0, 1, 2))
    assert a2.digest() == a.digest()
