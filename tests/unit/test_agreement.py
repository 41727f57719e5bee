"""The majority digest of a round: which state is the swarm's."""

from swarmloco.core.agreement import DIGEST_BYTES, majority, ranking

A, B, C = (bytes([i]) * DIGEST_BYTES for i in (1, 2, 3))


def test_the_most_published_digest_wins_and_names_its_holders():
    m = majority({"p3": A, "p1": A, "p2": B, "p4": A, "p5": C})
    assert m.digest == A and m.holders == ("p1", "p3", "p4")
    assert m.published == 5 and m.share == 0.6
    assert m.agrees(A) and not m.agrees(B)


def test_a_tie_is_broken_the_same_way_by_everyone():
    one = majority({"x": B, "y": A})
    other = majority({"y": A, "x": B})
    assert one == other and one.digest == A


def test_malformed_digests_do_not_vote():
    m = majority({"short": b"\x01" * 31, "text": "a" * 32, "good": C})  # type: ignore[dict-item]
    assert m.digest == C and m.holders == ("good",) and m.published == 1


def test_nobody_published():
    m = majority({})
    assert m.digest is None and m.holders == () and m.share == 0.0
    assert not m.agrees(A)


def test_ranking_lists_every_digest_most_held_first():
    ranked = ranking({"a": B, "b": C, "c": B, "d": A, "e": C, "f": B})
    assert [r.digest for r in ranked] == [B, C, A]
    assert ranked[0].holders == ("a", "c", "f") and ranked[1].holders == ("b", "e")
    assert all(r.published == 6 for r in ranked)
    assert ranking({}) == []
